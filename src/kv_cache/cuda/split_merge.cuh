// The split-KV (flash-decoding) tail shared by paged_split and paged_mma: where the splits' partial
// results go (SplitOut, carved from the caller's workspace) and the kernel that merges them.
//
// Split s of query row (b, h, t) writes its normalized partial output o_s (fp32, head_dim) and its
// lse_s; the merge combines the splits by their LSE:
//
//   M = max_s lse_s;  w_s = exp(lse_s - M);  out = sum_s w_s o_s / sum_s w_s;  lse = M + log sum_s w_s
//
// (every split is empty: M = -inf, out 0, lse -inf; a NaN lse propagates through the max).
// Workspace: rows * splits * (head_dim + 1) fp32, rows = B * H_q * q_len, carved by WorkspaceArena
// (256-byte aligned slices).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/workspace.h"
#include "kernels/common.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "kv_cache/kv_cache_params.h"

namespace optimized::cuda::kv_cache_cuda {

// Where the partial results of the splits go, or null (one split: straight to out / lse).
struct SplitOut {
  float* o = nullptr;    // (B * H_q * q_len rows, splits, D): normalized partial outputs
  float* lse = nullptr;  // (rows, splits)
};

// The slices of the workspace (measured with a counting arena, or carved from the caller's).
inline SplitOut carve_split_out(const KvDecodeParams& p, int64_t splits, WorkspaceArena& arena) {
  const int64_t rows = p.batch * p.heads_q * p.q_len;
  SplitOut s;
  s.o = arena.take<float>(rows * splits * p.cache.head_dim);
  s.lse = arena.take<float>(rows * splits);
  return s;
}

// The workspace bytes of `splits` splits (0 for one split: nothing to merge).
inline size_t split_workspace_bytes(const KvDecodeParams& p, int64_t splits) {
  if (splits <= 1) return 0;
  WorkspaceArena arena;
  carve_split_out(p, splits, arena);
  return arena.peak();
}

constexpr int kMergeThreads = 128;
constexpr int kMergeWarps = kMergeThreads / 32;

// One warp per (b, h, t) row, lanes over d.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    merge_splits_kernel(const __grid_constant__ KvDecodeParams p, int64_t splits, SplitOut part) {
  using namespace optimized::kernels;
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

// Enqueues the merge of `splits` partial results into p.out / p.lse.
template <typename T>
cudaError_t launch_merge_splits(const KvDecodeParams& p, int64_t splits, SplitOut part, cudaStream_t stream) {
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  const int64_t rows = p.batch * p.heads_q * p.q_len;
  const int64_t need = kernels::ceil_div(rows, kMergeWarps);
  const unsigned grid = static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks);
  merge_splits_kernel<T><<<grid, kMergeThreads, 0, stream>>>(p, splits, part);
  return cudaGetLastError();
}

}  // namespace optimized::cuda::kv_cache_cuda
