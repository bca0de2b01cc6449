"""Autograd of ``optimized::moe_route`` (``moe_route_backward``: topk_weights and lse to the logits, for the
ids the forward chose; the ids are integers, the bias gets no gradient), of ``optimized::moe_combine``
(one ``moe_combine_backward`` call: grad_y scattered through ``sorted_pairs``, grad_weights the dot
products) and of ``optimized::grouped_mm`` (``torch.library.register_autograd``): grad_x =
``grouped_mm(dout, w.transpose(-2, -1), offs)`` (rows past the last group get zeros, as their outputs
were), grad_w = ``grouped_mm_weight_grad(x, dout, offs)``; the same variant; and of ``optimized::grouped_mm_swiglu``
(below). No double backward yet."""

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


# grouped_mm_swiglu: out = silu(h[:, :F]) * h[:, F:], h = x @ w[g]. The backward takes h from the saved pre
# (recomputed by grouped_mm when the forward did not save it): dh = silu_and_mul's backward, then grad_x
# and grad_w as grouped_mm's. pre is not differentiable.
def _swiglu_setup(ctx, inputs, keyword_only_inputs, output):
    x, w, offs = inputs
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    pre = output[1]
    if pre is not None:
        ctx.mark_non_differentiable(pre)
    # No zeros made for pre's gradient (an (M, 2F) fill, ~0.3 ms at the layer shape).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, w, offs, pre)


def _swiglu_backward(ctx, dout, dpre):
    x, w, offs, pre = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if dout is None or not (need_x or need_w):
        return None, None, None
    if pre is None:
        pre = _ops.grouped_mm.default(x, w, offs, variant=ctx.variant)
    dh = _ops.silu_and_mul_bwd.default(dout.contiguous(), pre)
    gx = _ops.grouped_mm.default(dh, w.transpose(-2, -1), offs, variant=ctx.variant) if need_x else None
    gw = _ops.grouped_mm_weight_grad.default(x, dh, offs, variant=ctx.variant) if need_w else None
    return gx, gw, None


torch.library.register_autograd("optimized::grouped_mm_swiglu", _swiglu_backward, setup_context=_swiglu_setup)


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


# moe_gather: grad_x[t] = sum_j grad_xs[slot_of[t, j]] (dropped pairs add nothing) = moe_combine with unit
# weights: fixed order, no atomics.
def _gather_setup(ctx, inputs, output):
    x, sorted_pairs, slot_of = inputs
    ctx.save_for_backward(sorted_pairs, slot_of)


def _gather_backward(ctx, grad_xs):
    sorted_pairs, slot_of = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None
    ones = torch.ones(slot_of.shape, dtype=torch.float32, device=slot_of.device)
    return _ops.moe_combine.default(grad_xs.contiguous(), slot_of, sorted_pairs, ones), None, None


torch.library.register_autograd("optimized::moe_gather", _gather_backward, setup_context=_gather_setup)


def _route_setup(ctx, inputs, keyword_only_inputs, output):
    logits, _bias = inputs
    ids = output[0]
    ctx.options = {name: keyword_only_inputs[name] for name in ("scoring", "topk_softmax", "normalize", "routed_scale")}
    ctx.save_for_backward(logits, ids)


def _route_backward(ctx, _grad_ids, grad_weights, grad_lse):
    if not ctx.needs_input_grad[0]:
        return None, None
    logits, ids = ctx.saved_tensors
    # autograd passes zeros for an unused output: moe.h's rule makes them add nothing (not even NaN)
    grad = _ops.moe_route_backward.default(logits, ids, grad_weights, grad_lse, **ctx.options)
    return grad, None


torch.library.register_autograd("optimized::moe_route", _route_backward, setup_context=_route_setup)
