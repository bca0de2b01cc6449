"""layer_norm and rms_norm in Triton, forward and backward, over rows of ``n`` elements.

Forward (one program per row): statistics in float32 -- layer_norm's mean, then the biased variance
of the centred row (two passes, never E[x^2] - E[x]^2), rms_norm's mean square -- then
``y = (x - mean) * rstd * w + b`` rounded once; mean and rstd (float32, one per row) are saved for
the backward. ``SINGLE``: the row is read once into registers (``n <= kMaxSingle``); otherwise it
is streamed in ``kChunk``-element chunks (three reads: sum, centred squares, write).

Backward, with ``xhat = (x - mean) * rstd`` and ``g = dy * w``:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (rms_norm: without mean(g))
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy
dweight / dbias are reduced deterministically in two stages, never with atomics: stage 1, each
program owns a fixed group of consecutive rows and sums its rows' ``dy * xhat`` (and ``dy``) into
its own row of a float32 ``(groups, n)`` partial buffer (in registers for a single-block row,
read-modify-write of its own partial row when streamed); stage 2 (``_column_sum_kernel``) sums the
partials of each column over the groups in order. The groups depend only on the shape and the
device, so the result is the same bits from run to run.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _compat  # noqa: F401  (the interpreter under NumPy >= 2.4)
from ._rows import num_warps as _num_warps, row_block as _block

kColumns = 256  # columns per program of the stage-2 column sum


@triton.jit
def _norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, stride_x, stride_y, eps,
                     IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
                     SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    if SINGLE:
        mask = cols < n
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, 0) / n
            xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / n + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if IS_RMS:
            mean = 0.0
        else:
            acc = tl.zeros([BLOCK], tl.float32)
            for start in range(0, n, BLOCK):
                c = start + cols
                acc += tl.load(x_row + c, mask=c < n, other=0.0).to(tl.float32)
            mean = tl.sum(acc, 0) / n
        acc2 = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            xc = tl.where(mask, tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
            acc2 += xc * xc
        rstd = 1.0 / tl.sqrt(tl.sum(acc2, 0) / n + eps)
        for start in range(0, n, BLOCK):
            c = start + cols
            mask = c < n
            y = (tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
            if HAS_W:
                y = y * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=mask)
    if not IS_RMS:
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _norm_bwd_kernel(x_ptr, dy_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, pw_ptr, pb_ptr, rows, n, rows_per_prog,
                     stride_x, stride_dy, stride_dx,
                     IS_RMS: tl.constexpr, HAS_W: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
                     BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    cols = tl.arange(0, BLOCK)  # (BLOCK,)
    p_off = pid.to(tl.int64) * n  # this program's row of the partial buffers
    if SINGLE:
        mask = cols < n
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK], tl.float32)
        db_acc = tl.zeros([BLOCK], tl.float32)
        for i in range(0, rows_per_prog):  # rows past `rows` (the last group's tail) are masked off
            row = row_start + i
            r = row.to(tl.int64)
            live = row < rows
            rmask = mask & live
            x = tl.load(x_ptr + r * stride_x + cols, mask=rmask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r * stride_dy + cols, mask=rmask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + r, mask=live, other=0.0)
            if IS_RMS:
                xhat = x * rstd
            else:
                xhat = tl.where(rmask, (x - tl.load(mean_ptr + r, mask=live, other=0.0)) * rstd, 0.0)
            if HAS_W:
                g = dy * w
            else:
                g = dy
            c1 = tl.sum(xhat * g, 0) / n
            if IS_RMS:
                dx = (g - xhat * c1) * rstd
            else:
                dx = (g - tl.sum(g, 0) / n - xhat * c1) * rstd
            tl.store(dx_ptr + r * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=rmask)
            if COMPUTE_DW:
                dw_acc += dy * xhat
            if COMPUTE_DB:
                db_acc += dy
        if COMPUTE_DW:
            tl.store(pw_ptr + p_off + cols, dw_acc, mask=mask)
        if COMPUTE_DB:
            tl.store(pb_ptr + p_off + cols, db_acc, mask=mask)
    else:
        for start in range(0, n, BLOCK):  # this program's partial rows start at zero
            c = start + cols
            if COMPUTE_DW:
                tl.store(pw_ptr + p_off + c, tl.zeros([BLOCK], tl.float32), mask=c < n)
            if COMPUTE_DB:
                tl.store(pb_ptr + p_off + c, tl.zeros([BLOCK], tl.float32), mask=c < n)
        for i in range(0, rows_per_prog):  # rows past `rows` (the last group's tail) are masked off
            row = row_start + i
            r = row.to(tl.int64)
            live = row < rows
            rstd = tl.load(rstd_ptr + r, mask=live, other=0.0)
            if IS_RMS:
                mean = 0.0
            else:
                mean = tl.load(mean_ptr + r, mask=live, other=0.0)
            acc1 = tl.zeros([BLOCK], tl.float32)  # xhat * g
            acc2 = tl.zeros([BLOCK], tl.float32)  # g
            for start in range(0, n, BLOCK):
                c = start + cols
                mask = (c < n) & live
                x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(dy_ptr + r * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    g = g * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
                acc1 += tl.where(mask, (x - mean) * rstd, 0.0) * g
                acc2 += g
            c1 = tl.sum(acc1, 0) / n
            c2 = tl.sum(acc2, 0) / n
            for start in range(0, n, BLOCK):
                c = start + cols
                mask = (c < n) & live
                x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + r * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
                xhat = (x - mean) * rstd
                if HAS_W:
                    g = dy * tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
                else:
                    g = dy
                if IS_RMS:
                    dx = (g - xhat * c1) * rstd
                else:
                    dx = (g - c2 - xhat * c1) * rstd
                tl.store(dx_ptr + r * stride_dx + c, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if COMPUTE_DW:
                    pw = tl.load(pw_ptr + p_off + c, mask=mask, other=0.0)
                    tl.store(pw_ptr + p_off + c, pw + dy * xhat, mask=mask)
                if COMPUTE_DB:
                    pb = tl.load(pb_ptr + p_off + c, mask=mask, other=0.0)
                    tl.store(pb_ptr + p_off + c, pb + dy, mask=mask)


@triton.jit
def _column_sum_kernel(p_ptr, out_ptr, groups, n, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask = cols < n
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, groups):  # in order: the same sum every run
        acc += tl.load(p_ptr + g * n + cols, mask=mask, other=0.0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
             rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: (rows, n), unit column stride; weight / bias: (n,) contiguous or None. Returns y (rows, n)
    contiguous, mean (rows,) float32 (layer_norm; (0,) for rms_norm), rstd (rows,) float32."""
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    mean = torch.empty((0 if rms else rows,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows and n:
        block, single = _block(n)
        _norm_fwd_kernel[(rows,)](x, weight if weight is not None else x, bias if bias is not None else x, y,
                                  rstd if rms else mean, rstd, n, x.stride(0), y.stride(0), float(eps),
                                  IS_RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block,
                                  SINGLE=single, num_warps=_num_warps(block))
    return y, mean, rstd


def _groups(rows: int, device: torch.device) -> tuple[int, int]:
    """(groups, rows per group) of the backward: about four programs per SM on CUDA."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    per = triton.cdiv(rows, max(1, min(rows, target)))
    return triton.cdiv(rows, per), per


def norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
             rstd: torch.Tensor, rms: bool, compute_dw: bool, compute_db: bool, param_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx (rows, n) contiguous in x's dtype; dweight, dbias (n,) in param_dtype ((0,) where not asked for)."""
    rows, n = x.shape
    dev = x.device
    dx = torch.empty((rows, n), dtype=x.dtype, device=dev)
    dw = torch.empty((n if compute_dw else 0,), dtype=param_dtype, device=dev)
    db = torch.empty((n if compute_db else 0,), dtype=param_dtype, device=dev)
    if rows == 0 or n == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    groups, per = _groups(rows, dev)
    pw = torch.empty((groups, n) if compute_dw else (0,), dtype=torch.float32, device=dev)
    pb = torch.empty((groups, n) if compute_db else (0,), dtype=torch.float32, device=dev)
    block, single = _block(n)
    _norm_bwd_kernel[(groups,)](x, dy, weight if weight is not None else x, rstd if rms else mean, rstd, dx,
                                pw if compute_dw else dx, pb if compute_db else dx, rows, n, per,
                                x.stride(0), dy.stride(0), dx.stride(0),
                                IS_RMS=rms, HAS_W=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
                                BLOCK=block, SINGLE=single, num_warps=_num_warps(block))
    for p, out, asked in ((pw, dw, compute_dw), (pb, db, compute_db)):
        if asked:
            _column_sum_kernel[(triton.cdiv(n, kColumns),)](p, out, groups, n, BLOCK_N=kColumns)
    return dx, dw, db
