// The direct epilogue of a wgmma accumulator: a warpgroup's 64 x kN fp32 tile (wgmma.cuh gives
// the fragment layout) goes through an epilogue functor (alpha_beta.cuh) straight from registers
// to global memory, two neighbouring columns per access where C allows it. Rows and columns past
// the matrix (ragged edges) are not written.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels {

// c: the tile's top-left element; rows_left / cols_left: rows and columns of C from there on;
// pairs: C's base, ldc (and batch stride) even, so two neighbouring elements are one 4-byte access.
template <int kN, typename T, typename Epilogue>
__device__ __forceinline__ void store_wgmma_tile(const float (&acc)[kN / 2], T* c, int64_t ldc, int64_t rows_left,
                                                 int64_t cols_left, bool pairs, const Epilogue& epi) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row0 = 16 * warp + lane / 4;
  const int col0 = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= rows_left) continue;
    T* c_row = c + row * ldc;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      const int col = 8 * j + col0;
      const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      if (pairs && col + 1 < cols_left) {
        epi.store2(c_row + col, v0, v1);
      } else {
        if (col < cols_left) epi.store(c_row + col, v0);
        if (col + 1 < cols_left) epi.store(c_row + col + 1, v1);
      }
    }
  }
}

}  // namespace optimized::kernels
