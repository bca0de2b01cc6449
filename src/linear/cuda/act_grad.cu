// The linear family's CUDA kernel: g = dy * act'(pre) and the bias gradient, for every CUDA rung
// (launchers.h). One version (the GEMMs around it are where the ladder is):
//
//   act_grad_kernel      block = 32 column groups x 8 row slices (threads of a warp walk along a
//                        row: coalesced reads of dy and pre, coalesced writes of g); a thread's
//                        group is kVec neighbouring columns (16 bytes: 8 of fp16 / bf16, 4 of fp32,
//                        when n, the leading dimensions and the pointers are 16-byte aligned; else
//                        1); block (x, y) owns 32 kVec columns of a group of rows_per_group rows;
//                        thread (slice s, group j) takes rows s, s + 8, ... of the group in that
//                        order, computes v = dy * act'(pre) in fp32 (kernels::activate_grad, the
//                        GEMM epilogue's), writes round(v) into g and sums v per column; the block
//                        then adds the 8 slice sums of each column in slice order into the
//                        group's row of partials.
//                        With amax_bits (the fp8 path), max |round(v)| is raised into it, one
//                        atomicMax a warp (a max: the same result in any order).
//   finish_column_sums   (kernels/epilogue/column_sums.cuh) adds the groups' partials in a fixed tree.
//   store_bias_grad      bias_grad[j] = round(sum_j (+ bias_grad[j] with accumulate)).
//
// Every order depends on m and n alone, never on timing: the same bits every run, no atomics in
// the sums.
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
#include "kernels/reduce.cuh"
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

// grid: (ceil(n / (32 kVec)), groups); block: (32, 8). kVec neighbouring columns a thread (one
// 16-byte access of dy, pre and g when n, the leading dimensions and the pointers allow it, else 1).
template <typename T, int kVec>
__global__ void __launch_bounds__(kCols * kSlices)
    act_grad_kernel(const T* __restrict__ dy, int64_t ld_dy, const T* __restrict__ pre, int64_t ld_pre,
                    T* __restrict__ g, int64_t ld_g, int act, int64_t m, int64_t n, int64_t rows_per_group,
                    float* __restrict__ partials, unsigned* __restrict__ amax_bits) {
  constexpr int kBlockCols = kCols * kVec;
  __shared__ float slice_sums[kSlices][kBlockCols];
  const int64_t col = (int64_t(blockIdx.x) * kCols + threadIdx.x) * kVec;  // kVec > 1: n % kVec == 0
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_group;
  const int64_t r1 = min(m, r0 + rows_per_group);
  float s[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) s[e] = 0.0f;
  unsigned amax = 0;  // max |round(v)| as float bits (the fp8 path's)
  if (col < n) {
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kSlices) {
      const Vec<T, kVec> d = load_vec<T, kVec>(dy + r * ld_dy + col);
      Vec<T, kVec> x;
      if (act != kActNone) x = load_vec<T, kVec>(pre + r * ld_pre + col);
      Vec<T, kVec> o;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        float v = to_float(d.v[e]);
        if (act != kActNone) v *= activate_grad(act, to_float(x.v[e]));
        o.v[e] = from_float<T>(v);
        s[e] += v;
        amax = max(amax, __float_as_uint(fabsf(to_float(o.v[e]))));
      }
      if (g) store_vec<T, kVec>(g + r * ld_g + col, o);
    }
  }
  if (amax_bits) warp_raise_max_bits(amax_bits, amax);  // uniform over the grid
  if (!partials) return;  // uniform over the grid
#pragma unroll
  for (int e = 0; e < kVec; ++e) slice_sums[threadIdx.y][threadIdx.x * kVec + e] = s[e];
  __syncthreads();
  // The block's columns, one a thread (slices added in slice order).
  for (int c = threadIdx.y * kCols + threadIdx.x; c < kBlockCols; c += kCols * kSlices) {
    const int64_t cc = int64_t(blockIdx.x) * kBlockCols + c;
    if (cc >= n) continue;
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < kSlices; ++i) total += slice_sums[i][c];
    partials[int64_t(blockIdx.y) * n + cc] = total;
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
    constexpr int kVec = 16 / sizeof(T);
    const auto aligned = [](const void* ptr, int64_t ld) {
      return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && ld % kVec == 0;
    };
    const bool vector = p.n % kVec == 0 && aligned(p.dy, p.ld_dy) && (p.act == kActNone || aligned(p.pre, p.ld_pre)) &&
                        (!p.g || aligned(p.g, p.ld_g));
    const auto launch = [&](auto kernel, int64_t blocks) {
      kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(groups.groups)), block, 0, stream>>>(
          static_cast<const T*>(p.dy), p.ld_dy, static_cast<const T*>(p.pre), p.ld_pre, static_cast<T*>(p.g), p.ld_g,
          p.act, p.m, p.n, groups.rows, ws.partials, p.amax_bits);
    };
    if (vector) launch(act_grad_kernel<T, kVec>, (p.n + kCols * kVec - 1) / (kCols * kVec));
    else launch(act_grad_kernel<T, 1>, col_blocks);
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
