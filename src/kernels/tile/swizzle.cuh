// The XOR swizzle of 16-byte chunks inside 128-byte lines of shared memory.
//
// Row r of a tile keeps its 16-byte chunk c at chunk c ^ (r % 8). The XOR touches the low 3 bits
// only, so it permutes the 8 chunks of each 128-byte line (rows of 128 bytes or any multiple). Eight
// consecutive rows read at one logical chunk (one 8x8 ldmatrix matrix, or a cp.async group of 8
// threads writing one row) land in 8 distinct 16-byte bank groups: one conflict-free wavefront.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels {

// The physical chunk of logical chunk `chunk` in row `row`.
__device__ __forceinline__ int swizzle128(int chunk, int row) { return chunk ^ (row & 7); }

// Byte offset of (row, chunk) in a tile whose rows are kRowBytes apart.
template <int kRowBytes>
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk) {
  static_assert(kRowBytes % 128 == 0, "the swizzle permutes chunks inside 128-byte lines");
  return row * kRowBytes + (swizzle128(chunk, row) << 4);
}

}  // namespace optimized::kernels
