// The direct epilogue of a wgmma accumulator: a warpgroup's 64 x kN fp32 tile (wgmma.cuh gives
// the fragment layout) goes through an epilogue functor (fused_epilogue.cuh) straight from
// registers to global memory, two neighbouring columns per access where C allows it. Rows and columns past
// the matrix (ragged edges) are not written. Or, for a TMA store, staged as swizzled 64 x 64
// chunks in shared memory (stage_wgmma_chunk_sw128).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/dtype.cuh"

namespace optimized::kernels {

// The warpgroup's 64 x kN tile at (m0, n0) of batch z through an epilogue functor (store /
// store2 at (batch, row, column): alpha_beta.cuh's AlphaBetaOutput, or fused_epilogue.cuh's
// FusedEpilogue), two neighbouring columns as one access where it can; rows_left / cols_left:
// rows and columns of C from (m0, n0) on.
template <int kN, typename Epilogue>
__device__ __forceinline__ void store_wgmma_tile(const float (&acc)[kN / 2], int64_t z, int64_t m0, int64_t n0,
                                                 int64_t rows_left, int64_t cols_left, const Epilogue& epi) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row0 = 16 * warp + lane / 4;
  const int col0 = 2 * (lane % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= rows_left) continue;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      const int col = 8 * j + col0;
      const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
      float o0, o1;
      if (col + 1 < cols_left)
        epi.store2(z, m0 + row, n0 + col, v0, v1, &o0, &o1);
      else if (col < cols_left)
        epi.store(z, m0 + row, n0 + col, v0);
    }
  }
}

// Where a thread's two neighbouring 16-bit columns of 16-byte unit `unit` of row `row` sit in a
// 64 x 64 chunk staged for a TMA store with the 128-byte swizzle (128-byte rows; unit u of row r at
// unit u ^ (r % 8)): lane % 4 picks the 4 bytes inside the unit, as wgmma's fragment layout does.
__device__ __forceinline__ uint32_t sw128_pair_offset(int row, int unit, int lane) {
  return row * 128 + ((unit ^ (row % 8)) * 16) + 4 * (lane % 4);
}

// Those two columns, v0 and v1 rounded to T, written into the staged chunk `buf`.
template <typename T>
__device__ __forceinline__ void stage_pair_sw128(unsigned char* buf, int row, int unit, int lane, float v0, float v1) {
  static_assert(sizeof(T) == 2, "64 elements per 128-byte row: 16-bit C");
  uint32_t packed;
  T* pv = reinterpret_cast<T*>(&packed);
  pv[0] = from_float<T>(v0);
  pv[1] = from_float<T>(v1);
  *reinterpret_cast<uint32_t*>(buf + sw128_pair_offset(row, unit, lane)) = packed;
}

// The 64 x 64 chunk q (columns 64q .. 64q + 63) of a warpgroup's 64 x kN accumulator, times alpha
// and rounded to T, into `buf` (8 KiB, 1024-byte aligned) as one TMA box (sw128_pair_offset), ready
// for a TMA store. A warp's store covers 8 rows x 16 bytes, which the swizzle spreads over all 32
// banks.
template <int kN, typename T>
__device__ __forceinline__ void stage_wgmma_chunk_sw128(const float (&acc)[kN / 2], int q, unsigned char* buf,
                                                        float alpha) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row0 = 16 * warp + lane / 4;
#pragma unroll
  for (int u = 0; u < 8; ++u) {  // the 16-byte unit (8 columns) of the chunk's row
    const int j = 8 * q + u;     // the accumulator's n8 block
#pragma unroll
    for (int h = 0; h < 2; ++h)
      stage_pair_sw128<T>(buf, row0 + 8 * h, u, lane, alpha * acc[4 * j + 2 * h], alpha * acc[4 * j + 2 * h + 1]);
  }
}

}  // namespace optimized::kernels
