"""Persistent GEMM with TMA descriptors in Triton, for Hopper (and later): ``c = a @ b``, fp16 / bf16
inputs, fp32 accumulation.

Versions:
2. (this file; 1 is matmul.py's tiled GEMM) persistent + TMA: the grid is one program per SM, and
   each program walks the output tiles ``tile = pid, pid + NUM_SMS, ...`` (grouped rasterization, as
   in version 1), so launch and tail costs are paid once and the next tile's loads overlap the
   current tile's epilogue. Operands are read through TMA tensor descriptors (``TensorDescriptor``,
   built on the host: base, shape, strides, block shape): one instruction copies a whole
   ``(BLOCK_M, BLOCK_K)`` tile into shared memory, out-of-bounds rows and columns zero-filled by the
   hardware (no masks), and the C tile is written back through a descriptor too (clipped at the
   edges). On sm_90 Triton lowers ``tl.dot`` of these tiles to wgmma -- the CUDA ladder's
   ``wgmma_persistent`` rung, without writing the mbarrier pipeline by hand.
Needs 16-byte aligned operand rows (TMA): K and N multiples of 8 for fp16 / bf16. Autotuned over a
small space (the descriptors' block shapes set per config by a pre-hook). In Triton's interpreter
(CPU tests) one small fixed config runs, with NUM_SMS = 4 so that programs loop over several tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import _compat, interpreter  # noqa: F401  (_compat: the interpreter under NumPy >= 2.4)


def _set_block_shapes(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


def _configs():
    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): 128x256x64 with 8 warps is the usual bf16 winner on
    # the H100 (two warpgroups of wgmma), the others for smaller or skinny problems.
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w,
                          pre_hook=_set_block_shapes)
            for bm, bn, bk, s, w in ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4),
                                     (64, 128, 64, 4, 4), (128, 64, 64, 4, 4))]


@triton.jit
def _matmul_tma_kernel(a_desc, b_desc, c_desc, M, N, K, NUM_SMS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    in_group = GROUP_M * tiles_n
    for tile in range(start, tiles_m * tiles_n, NUM_SMS):  # persistent: this program's tiles
        first_m = (tile // in_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % group_rows
        pid_n = (tile % in_group) // group_rows
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BLOCK_M, BLOCK_N)
        for ki in range(0, k_tiles):
            a = a_desc.load([off_m, ki * BLOCK_K])  # (BLOCK_M, BLOCK_K), zero-filled past the edges
            b = b_desc.load([ki * BLOCK_K, off_n])  # (BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))  # clipped at the edges


_tuned = None


def _launcher():
    global _tuned
    if _tuned is None:
        _tuned = triton.autotune(configs=_configs(), key=["M", "N", "K"])(_matmul_tma_kernel)
    return _tuned


def tma_problem(t: torch.Tensor) -> str:
    """Why the 2-D operand t cannot be read or written through TMA ("" where it can): unit-stride
    rows at 16-byte aligned addresses and row strides."""
    es = t.element_size()
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return f"expected unit-stride rows (TMA); given strides {list(t.stride())}"
    if any((s * es) % 16 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        return (f"expected rows at 16-byte aligned addresses and strides (TMA: K and N multiples of {16 // es} for "
                f"{t.dtype}); given shape {list(t.shape)}, strides {list(t.stride())}")
    return ""


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if not tma_problem(t) else t.clone(memory_format=torch.contiguous_format)  # a fresh, aligned buffer


def matmul_tma_2d(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """c (M, N) = a (M, K) @ b (K, N): all three 2-D, TMA-compatible (tma_problem(t) == "" for each)."""
    m, k = a.shape
    n = b.shape[1]
    if interpreter():
        bm = bn = bk = 32
        num_sms = 4
        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(b, [bk, bn])
        c_desc = TensorDescriptor.from_tensor(c, [bm, bn])
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        _matmul_tma_kernel[(min(num_sms, tiles),)](a_desc, b_desc, c_desc, m, n, k, NUM_SMS=num_sms, BLOCK_M=bm,
                                                   BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
        return
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    dummy = [64, 64]  # replaced per config by _set_block_shapes
    a_desc = TensorDescriptor.from_tensor(a, dummy)
    b_desc = TensorDescriptor.from_tensor(b, dummy)
    c_desc = TensorDescriptor.from_tensor(c, dummy)

    def grid(meta):
        return (min(num_sms, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)
    _launcher()[grid](a_desc, b_desc, c_desc, m, n, k, NUM_SMS=num_sms)


def matmul_tma_3d(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, M, K) @ (B, K, N) -> (B, M, N) contiguous: one persistent launch per batch index."""
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    for i in range(batch):
        ci = c[i]
        if tma_problem(ci):  # a batch slice at an unaligned offset (M * N * element size not a multiple of 16)
            ci = torch.empty_like(ci)
        matmul_tma_2d(_aligned(a[i]), _aligned(b[i]), ci)
        if ci.data_ptr() != c[i].data_ptr():
            c[i].copy_(ci)
    return c
