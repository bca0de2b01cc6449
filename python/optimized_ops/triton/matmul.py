"""Tiled GEMM in Triton: ``c[b] = a[b] @ b[b]`` for a batch of matrices, fp32 accumulation.

Versions:
1. (this file) tiled: one program per ``(BLOCK_M, BLOCK_N)`` tile of C; the K loop loads a
   ``(BLOCK_M, BLOCK_K)`` tile of A and a ``(BLOCK_K, BLOCK_N)`` tile of B and accumulates
   ``tl.dot`` into a float32 register tile -- Triton places the tiles in shared memory, pipelines
   the loads over ``num_stages`` buffers (cp.async / TMA on Hopper) and issues the tensor-core MMAs
   (mma.sync, wgmma on Hopper): what the CUDA ladder builds by hand from ``smem_tiled`` up to
   ``mma_pipeline``. Tiles are visited in groups of ``GROUP_M`` tile rows (grouped rasterization), so
   programs running together share A and B tiles in L2. The M and N tails re-read valid rows
   (indices modulo M and N; the store is masked), and K is masked only when it is not a multiple
   of BLOCK_K (EVEN_K), so the K loop of most shapes runs without a test. The strides are arguments: transposed operands (the backward's
   ``b^T``, ``a^T``) are read in place.
Autotuned (``triton.autotune``, keyed on M, N, K and the dtype) over a small space of tile shapes,
pipeline depths and warp counts; fp32 inputs use ``input_precision="ieee"`` (true fp32 products:
the fp32 rule of the GEMM tests, no tf32). In Triton's interpreter (CPU tests) one small fixed
config runs instead of the autotuner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _compat, interpreter  # noqa: F401  (_compat: the interpreter under NumPy >= 2.4)


def _configs():
    out = []
    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): the usual Hopper / Ampere winners for 16-bit inputs,
    # and smaller tiles for skinny or small problems.
    for bm, bn, bk, s, w in ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 32, 4, 4),
                             (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (32, 64, 32, 5, 2)):
        out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s,
                                 num_warps=w))
    return out


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
                   DTYPE_KEY: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # grouped rasterization: GROUP_M tile rows at a time, column by column within the group
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    # The loads read rows rm % M and columns rn % N: the tail tiles re-read valid rows instead of masking
    # (no M / N test in the K loop); the store masks them off.
    am = rm % M
    bn = rn % N
    rk = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    a_tile = a_ptr + batch * stride_ab + am[:, None] * stride_am + rk[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_tile = b_ptr + batch * stride_bb + rk[:, None] * stride_bk + bn[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # K a multiple of BLOCK_K: no mask at all
            a = tl.load(a_tile)
            b = tl.load(b_tile)
        else:
            a = tl.load(a_tile, mask=rk[None, :] + k0 < K, other=0.0)
            b = tl.load(b_tile, mask=rk[:, None] + k0 < K, other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    c = c_ptr + batch * stride_cb + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


_tuned = None


def _launcher():
    global _tuned
    if _tuned is None:
        even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_matmul_kernel)
        _tuned = triton.autotune(configs=_configs(), key=["M", "N", "K", "DTYPE_KEY"])(even_k)
    return _tuned


def matmul_3d(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: (B, M, K), b: (B, K, N), any strides (a batch stride of 0 broadcasts); same dtype and
    device. Returns a new contiguous (B, M, N)."""
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    args = (a, b, c, m, n, k, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
            c.stride(0), c.stride(1), c.stride(2))
    key, ieee = str(a.dtype), a.dtype == torch.float32
    if interpreter():
        grid = (triton.cdiv(m, 32) * triton.cdiv(n, 32), batch)
        _matmul_kernel[grid](*args, DTYPE_KEY=key, IEEE=ieee, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4,
                             EVEN_K=k % 32 == 0)
    else:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)
        _launcher()[grid](*args, DTYPE_KEY=key, IEEE=ieee)
    return c
