// A persistent tile scheduler over groups of rows whose sizes only the device knows (the grouped GEMM
// of MoE: group g is the rows [offs[g-1], offs[g]) of a stacked operand, offs written by an earlier
// kernel, never read by the host). The grid is about one block per SM; block b takes the tiles
// b, b + gridDim.x, b + 2 gridDim.x, ... of one list that runs group after group:
//
//   by rows (the forward):  group g has ceil(rows_g / kBM) x tiles_n tiles, so an empty group has
//                           none and costs nothing; with `tail`, a last pseudo-group (index
//                           `groups`) covers the rows from the last end to m (rows no group owns,
//                           which the caller stores as zeros).
//   fixed (the weight gradient, one (K x N) output per group, reduced over the group's rows):
//                           every group has tiles_m x tiles_n tiles (an empty one stores zeros),
//                           or none when `skip_empty` (accumulating: nothing to add).
//
// Inside a group the tiles are rasterized in groups of kGroupM tile rows (tile/raster.cuh). A
// block's tile ids only grow, so the group is found by a cursor that walks forward: over a whole
// launch a block reads each offset once, whatever the number of groups. The offsets are taken as
// moe.h documents them: clamped to [0, m], each end at least the one before (a running max).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/tile/raster.cuh"

namespace optimized::kernels {

struct RaggedTile {
  int g;           // the group (== groups: the tail of rows past the last group)
  int begin, end;  // the group's rows [begin, end) of the stacked operand
  int m, n;        // the tile's row and column inside the group's tiles
};

template <int kBM, int kGroupM = 8>
struct RaggedTiles {
  const int32_t* offs;
  int groups;
  int m;              // rows of the stacked operand
  int tiles_n;        // tile columns of every group
  int tiles_m_fixed;  // 0: tile rows from each group's rows; else every group's tile rows
  bool tail;          // by rows: the pseudo-group of rows past the last group
  bool skip_empty;    // fixed: empty groups have no tiles

  // Where a thread stands in the list: the group and its first tile id and tile count.
  struct Cursor {
    int g = -1;
    int begin = 0, end = 0;
    int first = 0, count = 0;
  };

  __device__ __forceinline__ int tile_rows(int rows) const {
    if (tiles_m_fixed > 0) return rows == 0 && skip_empty ? 0 : tiles_m_fixed;
    return (rows + kBM - 1) / kBM;
  }

  // The tile `id` of the list, if there is one. Ids passed to one cursor must not decrease.
  __device__ __forceinline__ bool next(int id, Cursor* c, RaggedTile* t) const {
    while (id >= c->first + c->count) {
      if (c->g >= groups) return false;  // past the tail (or past the last group without one)
      c->first += c->count;
      c->begin = c->end;
      ++c->g;
      if (c->g < groups) {
        int o = __ldg(offs + c->g);
        o = o < 0 ? 0 : (o > m ? m : o);
        c->end = o > c->end ? o : c->end;
        c->count = tile_rows(c->end - c->begin) * tiles_n;
      } else {
        c->end = m;
        c->count = tail ? (m - c->begin + kBM - 1) / kBM * tiles_n : 0;
      }
    }
    const int local = id - c->first;
    const int rows = c->count / tiles_n;
    const TileCoord<int> tc = grouped_tile<int>(local, rows, tiles_n, kGroupM);
    *t = {c->g, c->begin, c->end, tc.m, tc.n};
    return true;
  }
};

}  // namespace optimized::kernels
