// Decode attention, CUDA rung 3: paged_split (flash-decoding). paged's mainloop (decode_tile.cuh)
// over p.splits chunks of each sequence's keys: block (sequence, kv head, row group, split) writes
// its rows' normalized partial output o_s and lse_s (fp32) into the workspace; merge_kernel then
// combines the splits of each (sequence, query head, query) by their LSE:
//
//   M = max_s lse_s;  w_s = exp(lse_s - M);  out = sum_s w_s o_s / sum_s w_s;  lse = M + log sum_s w_s
//
// (every split is empty: M = -inf, out 0, lse -inf; a NaN lse propagates through the max).
// What changed from paged, and why it is faster: at B = 1 with 8 kv heads paged runs 8 blocks;
// with the plan's splits (kv_cache_config.h: about two blocks per SM) the same keys are read by
// 2 x 132 blocks at once, so a long sequence streams at the memory's speed; the price is one
// extra fp32 row per (query row, split) written and read back by the merge. splits = 1 runs
// paged's kernel directly (no workspace, no merge).
//
// Workspace (kv_cache_paged_split_workspace): with splits > 1, rows * splits * (head_dim + 1) fp32,
// rows = B * H_q * q_len, carved by WorkspaceArena (256-byte aligned slices).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/workspace.h"
#include "kernels/dispatch.cuh"
#include "kernels/reduce.cuh"
#include "kv_cache/cuda/decode_tile.cuh"
#include "kv_cache/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using namespace optimized::cuda::kv_cache_cuda;

constexpr int kMergeThreads = 128;
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

// The slices of the workspace (measured with a counting arena, or carved from the caller's).
SplitOut carve(const KvDecodeParams& p, int64_t splits, WorkspaceArena& arena) {
  const int64_t rows = p.batch * p.heads_q * p.q_len;
  SplitOut s;
  s.o = arena.take<float>(rows * splits * p.cache.head_dim);
  s.lse = arena.take<float>(rows * splits);
  return s;
}

// One warp per (b, h, t) row, lanes over d.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(const __grid_constant__ KvDecodeParams p, int64_t splits, SplitOut part) {
  const int64_t rows = p.batch * p.heads_q * p.q_len, D = p.cache.head_dim;
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kMergeWarps) {
    const int64_t t = row % p.q_len, bh = row / p.q_len, h = bh % p.heads_q, b = bh / p.heads_q;
    const float* lse = part.lse + row * splits;
    float M = -INFINITY;
    for (int64_t s = 0; s < splits; ++s) M = MaxOp::apply(M, lse[s]);
    const bool empty = M == -INFINITY;
    float sum = 0.0f;
    if (!empty)
      for (int64_t s = 0; s < splits; ++s) sum += expf(lse[s] - M);
    T* out = static_cast<T*>(p.out) + b * p.out_b + t * p.out_t + h * p.out_h;
    for (int64_t d = lane; d < D; d += 32) {
      float acc = 0.0f;
      if (!empty)
        for (int64_t s = 0; s < splits; ++s) {
          const float w = expf(lse[s] - M);
          // Every split adds, even one whose weight underflows to 0: 0 * NaN stays NaN, as the
          // one-split path and the cpu rung give. An empty split wrote o = 0 and lse = -inf.
          acc = fmaf(w, part.o[(row * splits + s) * D + d], acc);
        }
      out[d] = from_float<T>(empty ? 0.0f : acc / sum);
    }
    if (p.lse && lane == 0) p.lse[b * p.lse_b + h * p.lse_h + t] = empty ? -INFINITY : M + logf(sum);
  }
}

int64_t splits_of(const KvDecodeParams& p) { return p.splits < 1 ? 1 : p.splits; }

}  // namespace

cudaError_t kv_cache_paged_split_workspace(const KvDecodeParams& p, size_t* bytes) {
  const int64_t splits = splits_of(p);
  if (splits == 1) {
    *bytes = 0;
    return cudaSuccess;
  }
  WorkspaceArena arena;
  carve(p, splits, arena);
  *bytes = arena.peak();
  return cudaSuccess;
}

cudaError_t kv_cache_paged_split(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads_q <= 0) return cudaSuccess;
  const int64_t splits = splits_of(p);
  const bool fp8 = p.cache.dtype == DType::kF8E4M3;
  if (splits == 1)
    return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
      return fp8 ? launch_decode_tile<T, Fp8>(p, 1, {}, stream) : launch_decode_tile<T, T>(p, 1, {}, stream);
    });
  WorkspaceArena arena(workspace);
  const SplitOut part = carve(p, splits, arena);
  if (!arena.ok()) return cudaErrorInvalidValue;
  const int64_t rows = p.batch * p.heads_q * p.q_len;
  const int64_t need = ceil_div(rows, kMergeWarps);
  const unsigned merge_grid = static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks);
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    const cudaError_t e =
        fp8 ? launch_decode_tile<T, Fp8>(p, splits, part, stream) : launch_decode_tile<T, T>(p, splits, part, stream);
    if (e != cudaSuccess) return e;
    merge_kernel<T><<<merge_grid, kMergeThreads, 0, stream>>>(p, splits, part);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
