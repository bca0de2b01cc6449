"""Row softmax in Triton, forward and backward: ``y = softmax(scale * x)`` over the last dimension.

Versions (one kernel each way, two paths picked by a constexpr):
1. ``SINGLE``: the row fits one block (``BLOCK = next_pow2(n)``, up to ``kMaxSingle`` elements): it
   is loaded once into registers, max, exp, sum and the division happen there, one read and one
   write per element -- the CUDA ``fused_registers`` rung's design.
2. streamed: longer rows are read in ``BLOCK``-element chunks, twice: pass 1 keeps a running max
   and a running sum per lane, the sum rescaled by ``exp(m_old - m_new)`` whenever the max grows
   (the online softmax of flash attention), pass 2 writes ``exp(s x - M) / S`` -- the CUDA
   ``fused_streaming`` rung's design (one extra read).
Padded lanes hold -inf and contribute exp(-inf) = 0; a lane whose max is still -inf contributes 0
(never exp(-inf - -inf) = NaN). Math in float32, one rounding to the output dtype.

Backward: ``dx = scale * y * (dy - sum(dy * y))``, the same two paths (one dot, one write).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _compat  # noqa: F401  (the interpreter under NumPy >= 2.4)
from ._rows import num_warps as _num_warps, row_block as _block



@triton.jit
def _softmax_fwd_kernel(x_ptr, y_ptr, n, stride_x, stride_y, scale, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    if SINGLE:
        mask = cols < n
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, x * scale, -float("inf"))
        m = tl.max(x, 0)
        e = tl.where(x == -float("inf"), 0.0, tl.exp(x - m))
        y = e / tl.sum(e, 0)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full([BLOCK], -float("inf"), tl.float32)  # running max per lane
        s = tl.zeros([BLOCK], tl.float32)  # running sum per lane, relative to m
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            x = tl.where(mask, x * scale, -float("inf"))
            m_new = tl.maximum(m, x)
            alive = m_new != -float("inf")
            s = tl.where(alive, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
            m = m_new
        big_m = tl.max(m, 0)
        total = tl.sum(tl.where(m == -float("inf"), 0.0, s * tl.exp(m - big_m)), 0)
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32) * scale
            y = tl.exp(x - big_m) / total
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n, stride_y, stride_dy, stride_dx, scale,
                        BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    dy_row = dy_ptr + row * stride_dy
    dx_row = dx_ptr + row * stride_dx
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(y * dy, 0)
        dx = scale * y * (dy - dot)
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            y = tl.load(y_row + c, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + c, mask=mask, other=0.0).to(tl.float32)
            acc += y * dy
        dot = tl.sum(acc, 0)
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            y = tl.load(y_row + c, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + c, (scale * y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


def softmax_fwd(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x: (rows, n) with unit column stride (any row stride); returns a new contiguous (rows, n)."""
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows and n:
        block, single = _block(n)
        _softmax_fwd_kernel[(rows,)](x, y, n, x.stride(0), y.stride(0), float(scale), BLOCK=block, SINGLE=single,
                                     num_warps=_num_warps(block))
    return y


def softmax_bwd(y: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    rows, n = y.shape
    dx = torch.empty((rows, n), dtype=y.dtype, device=y.device)
    if rows and n:
        block, single = _block(n)
        _softmax_bwd_kernel[(rows,)](y, dy, dx, n, y.stride(0), dy.stride(0), dx.stride(0), float(scale),
                                     BLOCK=block, SINGLE=single, num_warps=_num_warps(block))
    return dx
