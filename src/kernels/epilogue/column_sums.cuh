// Column sums of a matrix output without atomics, the same bits every run: the producing kernel
// writes fp32 partial sums of its output's columns, one row of partials per group of output rows
// it owns (partials (batch, rows, n): row r holds the sums over the output rows of group r), and
// finish_column_sums adds the rows of partials in a fixed tree:
//
//   block = 32 columns x 8 slices of the partial rows; thread (slice s, column j) sums rows
//   s, s + 8, s + 16, ... in that order, then slice 0 adds the 8 slice sums in slice order.
//
// The order depends only on `rows`, never on timing, so the result is deterministic; the cost is
// one read of the partials (rows * n * 4 bytes per batch), far less than the output when the
// groups are 8 or more rows tall.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels {

constexpr int kColumnSumCols = 32;
constexpr int kColumnSumSlices = 8;

// grid: (ceil(n / 32), min(batch, 65535)); block: (32, 8). Batches past grid.y by a stride loop.
// (A template, so that every translation unit that includes this may hold its instance.)
template <int kUnused = 0>
__global__ void __launch_bounds__(kColumnSumCols * kColumnSumSlices)
    finish_column_sums(const float* __restrict__ partials, int64_t rows, int64_t n, int64_t batch,
                       float* __restrict__ sums) {
  __shared__ float slice_sums[kColumnSumSlices][kColumnSumCols];
  const int64_t col = int64_t(blockIdx.x) * kColumnSumCols + threadIdx.x;
  for (int64_t z = blockIdx.y; z < batch; z += gridDim.y) {
    float s = 0.0f;
    if (col < n) {
      const float* p = partials + (z * rows) * n + col;
#pragma unroll 4
      for (int64_t r = threadIdx.y; r < rows; r += kColumnSumSlices) s += p[r * n];
    }
    slice_sums[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < n) {
      float total = 0.0f;
#pragma unroll
      for (int i = 0; i < kColumnSumSlices; ++i) total += slice_sums[i][threadIdx.x];
      sums[z * n + col] = total;
    }
    __syncthreads();
  }
}

}  // namespace optimized::kernels
