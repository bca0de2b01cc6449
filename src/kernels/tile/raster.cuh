// Grouped rasterization of a grid of output tiles, for L2 reuse.
//
// Consecutive block ids walk down a group of kGroupM tile rows before moving one tile column to the
// right, so the blocks running at the same time share a few row panels of A and column panels of B
// in L2 instead of streaming all of B once per tile row:
//
//   tile ids, tiles_m = 5, tiles_n = 3, group_m = 2:     0  2  4
//                                                        1  3  5
//                                                        6  8 10
//                                                        7  9 11
//                                                       12 13 14   (last group: 1 row)
//
// I: the integer type the caller computes in (int or uint32_t: the division stays the caller's).
#pragma once

#include <cuda_runtime.h>

namespace optimized::kernels {

template <typename I>
struct TileCoord {
  I m, n;  // tile row, tile column
};

template <typename I>
__device__ __forceinline__ TileCoord<I> grouped_tile(I id, I tiles_m, I tiles_n, I group_m) {
  const I per_group = group_m * tiles_n;
  const I group = id / per_group;
  const I first_m = group * group_m;
  const I rows = min(tiles_m - first_m, group_m);
  const I in_group = id - group * per_group;
  return {first_m + in_group % rows, in_group / rows};
}

}  // namespace optimized::kernels
