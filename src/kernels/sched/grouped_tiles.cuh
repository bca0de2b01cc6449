// A tile scheduler for batched GEMMs: one block per output tile, blockIdx.x -> tile in grouped
// rasterization (tile/raster.cuh), blockIdx.z -> batch. Batches beyond the grid's z limit take
// several launches, each starting at z_base. Beside it: persistent_tiles.cuh (the persistent walk) and
// ragged_tiles.cuh (the MoE grouped GEMM's walk over groups sized on the device).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/tile/raster.cuh"

namespace optimized::kernels {

template <int kGroupM>
struct GroupedTileScheduler {
  int64_t z_base;  // first batch of this launch
  int tiles_m;
  int tiles_n;

  // Tile ids and the rasterization's products are int on the device.
  static bool fits(int64_t tiles_m, int64_t tiles_n) {
    return tiles_m * tiles_n <= INT32_MAX / 2 && kGroupM * tiles_n <= INT32_MAX / 2;
  }
  static GroupedTileScheduler make(int64_t tiles_m, int64_t tiles_n) {
    return {0, static_cast<int>(tiles_m), static_cast<int>(tiles_n)};
  }
  // The grid of the launch for batches [z0, min(z0 + kMaxGridZ, batch)).
  dim3 grid(int64_t z0, int64_t batch) const {
    return dim3(static_cast<unsigned>(int64_t(tiles_m) * tiles_n), 1,
                static_cast<unsigned>(std::min<int64_t>(batch - z0, kMaxGridZ)));
  }

  __device__ __forceinline__ TileCoord<int> tile() const {
    return grouped_tile<int>(static_cast<int>(blockIdx.x), tiles_m, tiles_n, kGroupM);
  }
  __device__ __forceinline__ int64_t batch() const { return z_base + blockIdx.z; }
};

}  // namespace optimized::kernels
