// The linear family's CUDA kernel: g = dy * act'(pre) and the bias gradient, for every CUDA rung
// (launchers.h). One version (the GEMMs around it are where the ladder is):
//
//   act_grad_kernel      block = 32 columns x 8 row slices (threads of a warp walk along a row:
//                        coalesced reads of dy and pre, coalesced writes of g); block (x, y) owns
//                        columns [32 x, 32 x + 32) of a group of rows_per_group rows; thread (slice
//                        s, column j) takes rows s, s + 8, ... of the group in that order, computes
//                        v = dy * act'(pre) in fp32 (kernels::activate_grad, the GEMM epilogue's),
//                        writes round(v) into g and sums v; slice 0 adds the 8 slice sums in slice
//                        order into the group's row of partials.
//   finish_column_sums   (kernels/epilogue/column_sums.cuh) adds the groups' partials in a fixed tree.
//   store_bias_grad      bias_grad[j] = round(sum_j (+ bias_grad[j] with accumulate)).
//
// Every order depends on m and n alone, never on timing: the same bits every run, no atomics.
// The workspace holds the partials (groups x n fp32) and the sums (n fp32), carved by the same code
// that answers the workspace query (core/workspace.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "core/workspace.h"
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/epilogue/column_sums.cuh"
#include "kernels/epilogue/fused_epilogue.cuh"
#include "linear/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;

constexpr int kCols = kColumnSumCols;      // 32: a warp along a row
constexpr int kSlices = kColumnSumSlices;  // 8 row slices: 256 threads
constexpr int64_t kRowsPerGroup = 128;     // 16 rows per thread: enough work to hide the loads
constexpr int64_t kMaxGroups = 65535;      // grid.y

static_assert(kCols == 32, "a warp walks along a row");

// The groups of rows of one launch (the rows of partials) and their height.
struct RowGroups {
  int64_t groups = 1, rows = 1;
};
RowGroups row_groups(int64_t m) {
  RowGroups r;
  r.groups = std::min<int64_t>(kMaxGroups, std::max<int64_t>(1, (m + kRowsPerGroup - 1) / kRowsPerGroup));
  r.rows = (m + r.groups - 1) / r.groups;
  return r;
}

// grid: (ceil(n / 32), groups); block: (32, 8).
template <typename T>
__global__ void __launch_bounds__(kCols * kSlices)
    act_grad_kernel(const T* __restrict__ dy, int64_t ld_dy, const T* __restrict__ pre, int64_t ld_pre,
                    T* __restrict__ g, int64_t ld_g, int act, int64_t m, int64_t n, int64_t rows_per_group,
                    float* __restrict__ partials) {
  __shared__ float slice_sums[kSlices][kCols];
  const int64_t col = int64_t(blockIdx.x) * kCols + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_group;
  const int64_t r1 = min(m, r0 + rows_per_group);
  float s = 0.0f;
  if (col < n) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kSlices) {
      float v = to_float(dy[r * ld_dy + col]);
      if (act != kActNone) v *= activate_grad(act, to_float(pre[r * ld_pre + col]));
      if (g) g[r * ld_g + col] = from_float<T>(v);
      s += v;
    }
  }
  if (!partials) return;  // uniform over the grid
  slice_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kSlices; ++i) total += slice_sums[i][threadIdx.x];
    partials[int64_t(blockIdx.y) * n + col] = total;
  }
}

// out[j] = round(sums[j]) or round(out[j] + sums[j]) (accumulate), in fp32 then rounded once.
template <typename TB>
__global__ void store_bias_grad(const float* __restrict__ sums, int64_t n, bool accumulate, TB* __restrict__ out) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const float s = sums[j];
  out[j] = from_float<TB>(accumulate ? to_float(out[j]) + s : s);
}

// The workspace's slices: partials (groups x n) and sums (n), when the bias gradient is asked for.
struct Slices {
  float* partials = nullptr;
  float* sums = nullptr;
};
Slices carve(const LinearGradParams& p, WorkspaceArena& arena) {
  Slices s;
  if (!p.bias_grad) return s;
  s.partials = arena.take<float>(row_groups(p.m).groups * p.n);
  s.sums = arena.take<float>(p.n);
  return s;
}

}  // namespace

cudaError_t linear_act_grad_workspace(const LinearGradParams& p, size_t* bytes) {
  WorkspaceArena arena;
  carve(p, arena);
  *bytes = arena.peak();
  return cudaSuccess;
}

cudaError_t linear_act_grad(const LinearGradParams& p, const Workspace& workspace, cudaStream_t stream) {
  if (p.m < 1 || p.n < 1 || (p.act != kActNone && !p.pre)) return cudaErrorInvalidValue;
  WorkspaceArena arena(workspace);
  const Slices ws = carve(p, arena);
  if (!arena.ok()) return cudaErrorInvalidValue;
  const RowGroups groups = row_groups(p.m);
  const int64_t col_blocks = (p.n + kCols - 1) / kCols;
  if (col_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 block(kCols, kSlices);
  cudaError_t e = dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    act_grad_kernel<T><<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(groups.groups)), block, 0,
                         stream>>>(static_cast<const T*>(p.dy), p.ld_dy, static_cast<const T*>(p.pre), p.ld_pre,
                                   static_cast<T*>(p.g), p.ld_g, p.act, p.m, p.n, groups.rows, ws.partials);
    return cudaGetLastError();
  });
  if (e != cudaSuccess || !p.bias_grad) return e;
  finish_column_sums<<<dim3(static_cast<unsigned>(col_blocks), 1), block, 0, stream>>>(ws.partials, groups.groups,
                                                                                       p.n, 1, ws.sums);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  constexpr int kStoreThreads = 256;
  const auto store_blocks = static_cast<unsigned>((p.n + kStoreThreads - 1) / kStoreThreads);
  return dispatch_float_dtype(p.bias_grad_dtype, [&]<typename TB>() -> cudaError_t {
    store_bias_grad<TB><<<store_blocks, kStoreThreads, 0, stream>>>(ws.sums, p.n, p.accumulate,
                                                                    static_cast<TB*>(p.bias_grad));
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
