// The store of a block's mma.sync accumulators through shared memory: every warp writes its
// fragments as fp32 into a (kBM, kBN + 8) tile, then the block walks the tile in whole rows, 4
// columns per thread per step, and hands them to an epilogue functor (epilogue/fused_epilogue.cuh), so
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
// and columns [n0, n0 + kBN) of batch z of C (m x n) are handed to the epilogue functor
// (alpha_beta.cuh's AlphaBetaOutput or fused_epilogue.cuh's FusedEpilogue: store4 for whole groups
// of 4 columns, store at the right edge) where they
// lie inside C. Column sums (kColumnSums, a kernel that can be asked for them): a thread keeps the columns [col, col + 4) of every
// kThreads / (kBN / 4)-th row of the tile, so `partials` (null: none; else the tile's first row of
// partials, rows n apart) gets one row per such group of threads, summed in row order.
template <class Tile>
constexpr int kStagedPartialRows = Tile::kThreads / (Tile::kBN / 4);

template <class Tile, bool kColumnSums, class Epilogue>
__device__ __forceinline__ void store_staged_tile(const float (&acc)[Tile::kMT][Tile::kNT][4], float* epi, int64_t z,
                                                  int64_t m, int64_t n, int64_t m0, int64_t n0,
                                                  const Epilogue& epilogue, float* partials) {
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
  static_assert(C::kThreads % kVecPerRow == 0, "a thread keeps the same 4 columns on every row it stores");
  float4 sums = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const int col = (tid % kVecPerRow) * 4;
  const int64_t gn = n0 + col;
  // The fused epilogue's code (kColumnSums: a fused kernel) once per loop, not once per unrolled
  // step: its activations are long, and copies of them crowd the instruction cache.
  constexpr int kUnroll = kColumnSums ? 1 : 4;
#pragma unroll kUnroll
  for (int it = 0; it < C::kBM * C::kBN / 4 / C::kThreads; ++it) {
    const int r = (it * C::kThreads + tid) / kVecPerRow;
    const int64_t gm = m0 + r;
    if (gm >= m || gn >= n) continue;
    const float4 v = *reinterpret_cast<const float4*>(epi + r * kStride + col);
    float4 out;
    if (gn + 4 <= n) {
      epilogue.store4(z, gm, gn, v, &out);
    } else {
      const float vv[4] = {v.x, v.y, v.z, v.w};
      float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (gn + e < n) o[e] = epilogue.store(z, gm, gn + e, vv[e]);
      out = make_float4(o[0], o[1], o[2], o[3]);
    }
    if constexpr (kColumnSums) sums.x += out.x, sums.y += out.y, sums.z += out.z, sums.w += out.w;
  }
  if (kColumnSums && partials && gn < n) {
    float* row = partials + int64_t(tid / kVecPerRow) * n + gn;
    const float s[4] = {sums.x, sums.y, sums.z, sums.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (gn + e < n) row[e] = s[e];
  }
}

}  // namespace optimized::kernels
