"""Autograd of ``optimized::grouped_mm`` (``torch.library.register_autograd``): grad_x =
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
