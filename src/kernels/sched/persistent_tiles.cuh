// Tile schedulers of the Hopper GEMM (warp-specialized kernels, where producer and consumers must
// walk the same tiles in the same order). Both answer: the i-th tile of this block, if any
// (tile row, tile column, batch), tiles rasterized in groups of kGroupM rows (tile/raster.cuh).
//   OneTilePerBlock: blockIdx.x is the tile, blockIdx.z the batch (a grid as large as the work).
//   PersistentTiles: a grid of about one block per SM walks every tile of every batch with a
//     stride of gridDim.x, so the next tile's loads start while this one's epilogue runs and no
//     wave is left with idle SMs but the last.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/tile/raster.cuh"

namespace optimized::kernels {

struct ScheduledTile {
  int m, n;       // tile row, tile column
  int64_t batch;  // the batch index
  int split = 0;  // which of the scheduler's K ranges (split-K), 0 without
};

// The k-blocks [begin, end) of split s of `splits` over k_blocks (as even as integers allow).
__device__ __forceinline__ int split_begin(int s, int splits, int k_blocks) {
  return static_cast<int>(int64_t(s) * k_blocks / splits);
}

template <int kGroupM>
struct OneTilePerBlock {
  int tiles_m, tiles_n;
  int64_t z_base;  // first batch of this launch (batches beyond the grid's z limit: more launches)

  __device__ __forceinline__ bool next(int i, ScheduledTile* t) const {
    if (i > 0) return false;
    const TileCoord<int> c = grouped_tile<int>(static_cast<int>(blockIdx.x), tiles_m, tiles_n, kGroupM);
    *t = {c.m, c.n, z_base + blockIdx.z, 0};
    return true;
  }
};

// kClusterM > 1: the grid is made of clusters of kClusterM blocks (along x) that take kClusterM
// vertically adjacent tiles (same columns: they share B through TMA multicast) as one unit; a
// block whose tile falls below the last tile row still runs (its share of B feeds its peers) and
// stores nothing. splits > 1: each (cluster) tile is `splits` units, one per K range, adjacent in
// the order so that a tile's splits run at the same time.
template <int kGroupM, int kClusterM = 1>
struct PersistentTiles {
  int tiles_m, tiles_n;
  int64_t batch;
  int splits = 1;

  __host__ __device__ __forceinline__ int cluster_rows() const { return (tiles_m + kClusterM - 1) / kClusterM; }
  // Units of work (cluster tiles x splits) over every batch.
  int64_t total() const { return int64_t(cluster_rows()) * tiles_n * batch * splits; }

  // Whether the units fit the 32-bit arithmetic of next() (launchers refuse more: 2^31 tiles of
  // 64 x 128 are far past any memory).
  bool fits() const { return total() <= INT32_MAX; }

  // In 32 bits (fits()): 64-bit divisions are a called subroutine on the GPU, ~100 instructions,
  // whose register saves showed up as stack in the consumers.
  __device__ __forceinline__ bool next(int i, ScheduledTile* t) const {
    const int rows = cluster_rows();
    const unsigned unit = blockIdx.x / kClusterM + unsigned(i) * (gridDim.x / kClusterM);
    const unsigned per_batch = unsigned(rows) * unsigned(tiles_n);
    const unsigned id = unit / unsigned(splits);
    if (id >= per_batch * unsigned(batch)) return false;
    const unsigned z = id / per_batch;
    const TileCoord<int> c = grouped_tile<int>(static_cast<int>(id - z * per_batch), rows, tiles_n,
                                               (kGroupM + kClusterM - 1) / kClusterM);
    *t = {c.m * kClusterM + static_cast<int>(blockIdx.x % kClusterM), c.n, int64_t(z),
          static_cast<int>(unit - id * unsigned(splits))};
    return true;
  }
};

}  // namespace optimized::kernels
