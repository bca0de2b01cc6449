// The store of a block's mma.sync accumulators through shared memory: every warp writes its
// fragments as fp32 into a (kBM, kBN + 8) tile, then the block walks the tile in whole rows, 4
// columns per thread per step, and hands them to an epilogue functor (epilogue/alpha_beta.cuh), so
// that C is read and written in full, coalesced rows whatever the fragment layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels {

template <class Tile>
struct StagedTile {
  static constexpr int kStride = Tile::kBN + 8;  // floats; +8 keeps the float2 writes conflict-free
  static constexpr int kBytes = Tile::kBM * kStride * 4;
  static_assert((Tile::kBM * Tile::kBN / 4) % Tile::kThreads == 0, "epilogue: whole steps of 4 columns");
};

// acc: the mainloop's accumulators (C fragment layout of mma.m16n8k16). epi: StagedTile<Tile>::kBytes
// of shared memory that no warp uses any more (the mainloop's ring). The tile's rows [m0, m0 + kBM)
// and columns [n0, n0 + kBN) of C (m x n, row stride ldc) are written where they lie inside C.
// c_vec4: C's base is 8-byte aligned and ldc a multiple of 4 (store4 for whole groups of 4).
template <class Tile, typename T, class Epilogue>
__device__ __forceinline__ void store_staged_tile(const float (&acc)[Tile::kMT][Tile::kNT][4], float* epi, T* c,
                                                  int64_t m, int64_t n, int64_t ldc, int64_t m0, int64_t n0,
                                                  bool c_vec4, const Epilogue& epilogue) {
  using C = Tile;
  constexpr int kStride = StagedTile<Tile>::kStride;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / C::kWarpsN;
  const int wn = warp % C::kWarpsN;
  {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < C::kMT; ++mi)
#pragma unroll
      for (int ni = 0; ni < C::kNT; ++ni) {
        const int r = wm * C::kWM + mi * 16 + g;
        const int col = wn * C::kWN + ni * 8 + 2 * t;
        *reinterpret_cast<float2*>(epi + r * kStride + col) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
        *reinterpret_cast<float2*>(epi + (r + 8) * kStride + col) = make_float2(acc[mi][ni][2], acc[mi][ni][3]);
      }
  }
  __syncthreads();

  constexpr int kVecPerRow = C::kBN / 4;  // threads covering one row, 4 columns each
#pragma unroll 4
  for (int it = 0; it < C::kBM * C::kBN / 4 / C::kThreads; ++it) {
    const int idx = it * C::kThreads + tid;
    const int r = idx / kVecPerRow;
    const int col = (idx % kVecPerRow) * 4;
    const int64_t gm = m0 + r, gn = n0 + col;
    if (gm >= m || gn >= n) continue;
    const float4 v = *reinterpret_cast<const float4*>(epi + r * kStride + col);
    T* cp = c + gm * ldc + gn;
    if (c_vec4 && gn + 4 <= n) {
      epilogue.store4(cp, v);
    } else {
      const float vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (gn + e < n) epilogue.store(cp + e, vv[e]);
    }
  }
}

}  // namespace optimized::kernels
