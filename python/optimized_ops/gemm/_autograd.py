"""Autograd of ``optimized::matmul``, reverse mode and forward mode: the rules, registered through
``optimized_ops._autograd.register_autograd`` (the mechanism, shared with the fused family). Both
call the op again (same variant), so gradients and tangents run on the same kernels."""

from __future__ import annotations

import math

from .._autograd import register_autograd
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
