"""Autograd of ``optimized::linear_forward``, reverse mode and forward mode: the rules, registered through
``optimized_ops._autograd.register_autograd`` (the mechanism, shared with GEMM and the fused family).

* backward: one ``optimized::linear_backward`` call on the forward's variant and ``fp8`` flag, with ``output_mask`` from
  ``ctx.needs_input_grad`` (only the gradients that are needed are computed) and the forward's ``pre``
  when it kept one (else the C++ API recomputes it from x, W and b). ``pre`` is an output marked
  non-differentiable: it is what the backward reads, not a result to differentiate.
* double backward (``create_graph=True`` with tensors that require grad): the same gradients from a
  composite formula that torch can differentiate once more -- ``pre`` recomputed with
  ``optimized_ops.matmul``, ``g = dy * act'(pre)`` in float32 (float64 for float64), ``g W`` and
  ``g^T x`` through ``optimized_ops.matmul`` -- as ``linear_backward`` itself has no autograd kernel.
  With ``fp8`` that formula is the full-precision one (the fp8 rounding has no derivative to keep).
* jvp: ``t_y = act'(pre) * (t_x W^T + x t_W^T + t_b)``, the products through ``linear_forward``
  itself (same variant) and ``pre`` recomputed by it, so nested forward mode sees its dependence on
  x, W and b.
* a batching rule (a loop over the batch, ``batching=True``): torch's vmap fallback cannot stack the
  optional ``pre``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._autograd import compute_dtype, register_autograd
from .._library import load
from ..fused._autograd import _gelu_derivatives, _silu_derivatives
from ..gemm import matmul

load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized


def _act_grad(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act'(z), a differentiable torch formula (relu' = 1 where z > 0, as torch's relu backward)."""
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation in ("gelu", "gelu_tanh"):
        return _gelu_derivatives(z, "tanh" if activation == "gelu_tanh" else "none")[0]
    if activation == "silu":
        return _silu_derivatives(z)[1]
    return torch.ones_like(z)


def _needs(ctx, n: int) -> tuple:
    needs = tuple(ctx.needs_input_grad)
    return needs + (False,) * (n - len(needs))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, weight, bias = inputs
    _, pre = output
    ctx.activation = keyword_only_inputs.get("activation", "none")
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.fp8 = keyword_only_inputs.get("fp8", False)
    ctx.save_for_backward(x, weight, bias, pre)
    if pre is not None:
        ctx.mark_non_differentiable(pre)
    ctx.set_materialize_grads(False)  # a None gradient (y unused) costs no zeros


def _composite_backward(dy, x, weight, bias, activation, need):
    """The gradients as a formula torch differentiates (double backward)."""
    n, k = weight.shape
    c = compute_dtype(x)
    g = dy.to(c)
    if activation != "none":
        z = matmul(x.to(c), weight.to(c).t())
        if bias is not None:
            z = z + bias.to(c)
        g = g * _act_grad(z, activation)
    g2 = g.reshape(-1, n)
    grad_x = matmul(g, weight.to(c)).to(x.dtype) if need[0] else None
    grad_w = matmul(g2.t(), x.to(c).reshape(-1, k)).to(weight.dtype) if need[1] else None
    grad_b = g2.sum(0).to(bias.dtype) if need[2] else None
    return grad_x, grad_w, grad_b


def _backward(ctx, dy, _dpre):
    x, weight, bias, pre = ctx.saved_tensors
    need_x, need_w, need_b = _needs(ctx, 3)
    need = (need_x, need_w, need_b and bias is not None)
    if dy is None or not any(need):
        return None, None, None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (dy, x, weight, bias)):
        return _composite_backward(dy, x, weight, bias, ctx.activation, need)
    return _ops.linear_backward.default(dy, x, weight, pre, bias, activation=ctx.activation, output_mask=list(need),
                                        variant=ctx.variant, fp8=ctx.fp8)


def _jvp(inputs, keyword_only_inputs, output, tangents):
    x, weight, bias = inputs
    tx, tw, tb = tangents[:3]
    y = output[0]
    activation = keyword_only_inputs.get("activation", "none")
    variant = keyword_only_inputs.get("variant", "auto")
    fp8 = keyword_only_inputs.get("fp8", False)

    def lin(a, w, b):
        return _ops.linear_forward.default(a, w, b, variant=variant, fp8=fp8)[0]

    t: Optional[torch.Tensor] = None
    if tx is not None:
        t = lin(tx, weight, tb)
    elif tb is not None:
        t = tb.expand(y.shape)
    if tw is not None:
        t = lin(x, tw, None) if t is None else t + lin(x, tw, None)
    if t is None:
        return None, None
    if activation != "none":
        c = compute_dtype(x)
        pre = lin(x, weight, bias)
        t = (_act_grad(pre.to(c), activation) * t.to(c)).to(y.dtype)
    return t, None


register_autograd("optimized::linear_forward", _backward, setup_context=_setup_context, jvp=_jvp, batching=True)
