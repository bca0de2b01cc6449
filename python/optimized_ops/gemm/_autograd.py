"""Autograd of ``optimized::matmul``, reverse mode and forward mode: the rules, registered through
``optimized_ops._autograd.register_autograd`` (the mechanism, shared with the fused family). Both
call the op again (same variant), so gradients and tangents run on the same kernels.

``optimized::scaled_mm`` (the fp8 GEMM) has none: its Autograd kernel (at the end) raises, naming the
op, when a backward or a jvp reaches its output."""

from __future__ import annotations

import math

import torch

from .._autograd import has_tangent, register_autograd
from .._library import load
from . import matmul

load()  # registers torch.ops.optimized.* before the registrations below


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    a, b = inputs
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.a_shape, ctx.b_shape = a.shape, b.shape
    # grad_a needs b, grad_b needs a: save only what a requested gradient uses.
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    v = ctx.variant
    a_1d, b_1d = len(ctx.a_shape) == 1, len(ctx.b_shape) == 1
    # Everything as matrices: a 1-D a is the row (1, K), a 1-D b the column (K, 1), and the
    # gradient gets back the M and N dimensions the output dropped: (*batch, M, N).
    if b_1d:
        grad = grad.unsqueeze(-1)
    if a_1d:
        grad = grad.unsqueeze(-2)
    a_m = None if a is None else (a.unsqueeze(0) if a_1d else a)
    b_m = None if b is None else (b.unsqueeze(-1) if b_1d else b)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        # grad_a = grad @ b^T: (*batch, M, N) @ (.., N, K) -> (*batch, M, K), summed over the batch
        # dimensions a was broadcast along (sum_to_size), then back to a's shape (1-D: (K,)).
        a_m_shape = (1, ctx.a_shape[0]) if a_1d else ctx.a_shape
        grad_a = matmul(grad, b_m.transpose(-1, -2), variant=v).sum_to_size(a_m_shape).reshape(ctx.a_shape)
    if ctx.needs_input_grad[1]:
        b_m_shape = (ctx.b_shape[0], 1) if b_1d else ctx.b_shape
        if len(b_m_shape) == 2 and grad.dim() > 2:
            # b shared by every batch: one GEMM over the folded batch,
            # sum_p a_p^T g_p = [a_1; ..; a_B]^T [g_1; ..; g_B]: (K, B*M) @ (B*M, N) -> (K, N)
            k, n = a_m.shape[-1], grad.shape[-1]
            rows = math.prod(grad.shape[:-1])  # B*M, spelled out: reshape(-1, 0) is ambiguous
            a_all = a_m.expand(*grad.shape[:-2], a_m.shape[-2], k)
            grad_b = matmul(a_all.reshape(rows, k).transpose(0, 1), grad.reshape(rows, n), variant=v)
        else:
            # grad_b = a^T @ grad: (.., K, M) @ (*batch, M, N) -> (*batch, K, N), summed likewise
            grad_b = matmul(a_m.transpose(-1, -2), grad, variant=v).sum_to_size(b_m_shape)
        grad_b = grad_b.reshape(ctx.b_shape)
    return grad_a, grad_b


def _jvp(inputs, keyword_only_inputs, output, tangents):
    """d(a @ b) = da @ b + a @ db, both through this op (same variant, same broadcasting)."""
    (a, b), (ta, tb) = inputs, tangents
    v = keyword_only_inputs.get("variant", "auto")
    da = matmul(ta, b, variant=v) if ta is not None else None
    db = matmul(a, tb, variant=v) if tb is not None else None
    return db if da is None else da if db is None else da + db


register_autograd("optimized::matmul", _backward, setup_context=_setup_context, jvp=_jvp)


# ---- optimized::scaled_mm: no derivative ------------------------------------------------------------
#
# The scaled (fp8) GEMM has no backward. Without an Autograd kernel, torch's fallback for a C++ op
# would only warn when a backward reaches it and hand every input a None gradient (silently wrong
# training). This kernel runs the op and, where an input requires grad (or carries a forward-mode
# tangent), gives the output a node that raises, naming the op, when a backward (or a jvp) reaches it:
# what torch does for its own ops without a derivative (torch._scaled_mm: "derivative for
# aten::_scaled_mm is not implemented"), also under torch.compile, where tracing the backward of a
# graph whose inputs require grad raises while compiling.
# torch.library.register_autograd (and _autograd.register_autograd) refuse the op: its bias is a
# kwarg-only tensor.

_SCALED_MM = torch.ops.optimized.scaled_mm.default
_NO_DERIVATIVE = ("derivative for optimized::scaled_mm is not implemented: the scaled (fp8) GEMM has no backward "
                  "(no gradient for a, b, scale_a, scale_b or bias), as torch._scaled_mm; detach its inputs, or "
                  "compute the gradient with a higher-precision matmul")


def _scaled_mm_below_autograd(keyset, a, b, scale_a, scale_b, bias, kwargs):
    with torch._C._AutoDispatchBelowAutograd():
        return _SCALED_MM.redispatch(keyset & torch._C._after_autograd_keyset, a, b, scale_a, scale_b, bias=bias,
                                     **kwargs)


class _ScaledMmNoDerivative(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, kwargs, a, b, scale_a, scale_b, bias):
        return _scaled_mm_below_autograd(keyset, a, b, scale_a, scale_b, bias, kwargs)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(_NO_DERIVATIVE)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_DERIVATIVE.replace("has no backward", "has no forward-mode derivative"))


def _scaled_mm_autograd(keyset, a, b, scale_a, scale_b, *, bias=None, **kwargs):
    tensors = [t for t in (a, b, scale_a, scale_b, bias) if isinstance(t, torch.Tensor)]
    if has_tangent(tensors) or (torch.is_grad_enabled() and torch._C._any_requires_grad(*tensors)):
        return _ScaledMmNoDerivative.apply(keyset, kwargs, a, b, scale_a, scale_b, bias)
    return _scaled_mm_below_autograd(keyset, a, b, scale_a, scale_b, bias, kwargs)


_LIB = torch.library.Library("optimized", "FRAGMENT")
_LIB.impl("scaled_mm", _scaled_mm_autograd, "Autograd", with_keyset=True)
