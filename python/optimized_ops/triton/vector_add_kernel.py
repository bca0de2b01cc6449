"""Vector add, the first Triton kernel: ``out = x + y``.

Versions: 1 (this one). The grid has one program per block of ``BLOCK`` elements; each program
computes its offsets ``pid * BLOCK + arange(BLOCK)``, masks the tail past ``n`` (any length works,
1 and primes included), loads both inputs, adds, stores. Triton turns the block into vectorized,
coalesced loads across the program's warps: the CUDA "naive" elementwise kernel, without writing
threads or indices by hand. Memory-bound: 3 * n * element size bytes moved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _compat  # noqa: F401  (the interpreter under NumPy >= 2.4)

kBlock = 1024  # elements per program: 4 warps x 32 threads x 8 elements


@triton.jit
def _vector_add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    if x.dtype.is_fp16() or x.dtype.is_bf16():  # added in float32, rounded once: torch's arithmetic
        x, y = x.to(tl.float32), y.to(tl.float32)
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.shape != y.shape:
        raise ValueError(f"optimized::triton_vector_add: y: expected shape {list(x.shape)} (same as x); "
                         f"given {list(y.shape)}")
    if x.dtype != y.dtype:
        raise ValueError(f"optimized::triton_vector_add: y: expected dtype {x.dtype} (same as x); given {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"optimized::triton_vector_add: y: expected device {x.device} (same as x); given {y.device}")
    xc, yc = x.contiguous(), y.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _vector_add_kernel[(triton.cdiv(n, kBlock),)](xc, yc, out, n, BLOCK=kBlock)
    return out
