"""Autograd of ``optimized::moe_combine`` (one ``moe_combine_backward`` call: grad_y scattered through
``sorted_pairs``, grad_weights the dot products) and of ``optimized::grouped_mm`` (``torch.library.register_autograd``): grad_x =
``grouped_mm(dout, w.transpose(-2, -1), offs)`` (rows past the last group get zeros, as their outputs
were), grad_w = ``grouped_mm_weight_grad(x, dout, offs)``; the same variant. No double backward yet."""

from __future__ import annotations

import torch

from .._library import load

load()
_ops = torch.ops.optimized


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, w, offs = inputs
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dout):
    x, w, offs = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dout = dout.contiguous()
    gx = _ops.grouped_mm.default(dout, w.transpose(-2, -1), offs, variant=ctx.variant) if need_x else None
    gw = _ops.grouped_mm_weight_grad.default(x, dout, offs, variant=ctx.variant) if need_w else None
    return gx, gw, None


torch.library.register_autograd("optimized::grouped_mm", _backward, setup_context=_setup_context)


def _combine_setup(ctx, inputs, output):
    y, slot_of, sorted_pairs, weights = inputs
    ctx.save_for_backward(y, slot_of, sorted_pairs, weights)


def _combine_backward(ctx, dout):
    y, slot_of, sorted_pairs, weights = ctx.saved_tensors
    need = [ctx.needs_input_grad[0], ctx.needs_input_grad[3]]
    if not any(need):
        return None, None, None, None
    gy, gw = _ops.moe_combine_backward.default(dout, y, slot_of, sorted_pairs, weights, output_mask=need)
    return gy, None, None, gw


torch.library.register_autograd("optimized::moe_combine", _combine_backward, setup_context=_combine_setup)
