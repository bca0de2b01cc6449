"""The row layout the Triton row kernels share (softmax.py, norms.py): a row of up to ``kMaxSingle``
elements is held in registers as one ``BLOCK = next_pow2(n)`` block; a longer one is streamed in
``kChunk``-element chunks; the warps per program grow with the block."""

from __future__ import annotations

import triton

kMaxSingle = 8192  # longest row held in registers (fp32: 8192 values over 16 warps = 16 per thread)
kChunk = 4096  # chunk of the streamed path


def num_warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 4096 else 16)


def row_block(n: int) -> tuple[int, bool]:
    """(BLOCK, SINGLE) of a row of n elements."""
    if n <= kMaxSingle:
        return triton.next_power_of_2(max(n, 1)), True
    return kChunk, False
