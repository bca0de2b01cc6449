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
#include "kv_cache/kv_cache_config.h"
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

// One thread per (row (b, h, t), d), grid-stride: a single pass over the splits with a running
// max (the online softmax of the splits), so every load of lse_s (the same for the warp's lanes:
// one broadcast) and o_s (coalesced over d) is independent of the others and in flight together;
// no shared memory, no barrier (the merge of a 32-split B = 1 decode is bound by load latency).
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    merge_splits_kernel(const __grid_constant__ KvDecodeParams p, int64_t splits, SplitOut part) {
  const int64_t D = p.cache.head_dim, total = p.batch * p.heads_q * p.q_len * D;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kMergeThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kMergeThreads) {
    const int64_t row = i / D, d = i % D;
    const int64_t t = row % p.q_len, bh = row / p.q_len, h = bh % p.heads_q, b = bh / p.heads_q;
    const float* lse = part.lse + row * splits;
    const float* o = part.o + row * splits * D + d;
    float M = -INFINITY, sum = 0.0f, acc = 0.0f;
    bool nan = false;
#pragma unroll 8
    for (int64_t s = 0; s < splits; ++s) {
      const float l = lse[s], x = o[s * D];
      nan |= l != l;
      if (l > M) {  // a new max: rescale what was summed (exp(-inf) = 0 on the first finite one)
        const float r = expf(M - l);
        sum *= r, acc *= r, M = l;
      }
      // Every split adds, even one whose weight is 0: 0 * NaN stays NaN, as the one-split path
      // and the cpu rung give. An empty split wrote o = 0 and lse = -inf.
      const float w = l == -INFINITY ? 0.0f : expf(l - M);
      sum += w;
      acc = fmaf(w, x, acc);
    }
    const bool empty = !nan && M == -INFINITY;
    const float v = nan ? NAN : (empty ? 0.0f : acc / sum);
    static_cast<T*>(p.out)[b * p.out_b + t * p.out_t + h * p.out_h + d] = kernels::from_float<T>(v);
    if (p.lse && d == 0) p.lse[b * p.lse_b + h * p.lse_h + t] = nan ? NAN : (empty ? -INFINITY : M + logf(sum));
  }
}

// Enqueues the merge of `splits` partial results into p.out / p.lse (the launchers refuse more
// than kMaxSplits splits before their first launch: split_count_ok).
inline bool split_count_ok(int64_t splits) { return splits >= 1 && splits <= kv_cache_config::kMaxSplits; }
template <typename T>
cudaError_t launch_merge_splits(const KvDecodeParams& p, int64_t splits, SplitOut part, cudaStream_t stream) {
  if (!split_count_ok(splits)) return cudaErrorInvalidValue;
  constexpr int64_t kMaxBlocks = int64_t{1} << 20;
  const int64_t rows = p.batch * p.heads_q * p.q_len;
  const int64_t need = kernels::ceil_div(rows * p.cache.head_dim, int64_t{kMergeThreads});
  const unsigned grid = static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks);
  merge_splits_kernel<T><<<grid, kMergeThreads, 0, stream>>>(p, splits, part);
  return cudaGetLastError();
}

}  // namespace optimized::cuda::kv_cache_cuda
