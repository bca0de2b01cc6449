// The permutation on CUDA: a stable counting sort of the T k pairs by expert, in three launches,
// with no atomic deciding any order (so the same slots every run) and no host synchronisation.
//
//   count_kernel   one block per 256 pairs: the block's pairs per expert (shared-memory histogram;
//                  the counts do not depend on the order of the adds), written to row b of the
//                  workspace's (blocks, E + 1) table; column E counts ids outside [0, E)
//   scan_kernel    one block: per expert, the blocks' counts turned into exclusive prefixes (each
//                  block's first rank) and the total; kept = min(total, capacity); counts, the
//                  exclusive scan of kept (offsets), and dropped
//   place_kernel   one block per 256 pairs again: a pair's rank = its block's prefix + the pairs of
//                  the same expert in earlier warps of the block + those in earlier lanes of its
//                  warp (__match_any_sync); slot = offsets[e] + rank when rank < kept, else dropped
//                  (slot_of = -1). Slots past offsets[E] get -1.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kPairsPerBlock = 256;               // one pair a thread
constexpr int kWarps = kPairsPerBlock / 32;
constexpr int kScanThreads = 1024;                // scan_kernel: one expert a thread per pass

int64_t blocks_for(int64_t pairs) { return (pairs + kPairsPerBlock - 1) / kPairsPerBlock; }

__device__ __forceinline__ int expert_of(const MoePermuteParams& p, int64_t i) {
  if (i >= p.pairs) return -2;  // past the end
  const int32_t e = p.ids[i];
  return e >= 0 && e < p.experts ? e : -1;  // -1: outside [0, E)
}

__global__ void __launch_bounds__(kPairsPerBlock) count_kernel(const MoePermuteParams p, int32_t* table) {
  extern __shared__ int32_t hist[];  // E + 1
  const int64_t E = p.experts;
  for (int64_t e = threadIdx.x; e <= E; e += kPairsPerBlock) hist[e] = 0;
  __syncthreads();
  const int e = expert_of(p, int64_t(blockIdx.x) * kPairsPerBlock + threadIdx.x);
  if (e >= 0) atomicAdd(&hist[e], 1);
  else if (e == -1) atomicAdd(&hist[E], 1);
  __syncthreads();
  int32_t* row = table + int64_t(blockIdx.x) * (E + 1);
  for (int64_t i = threadIdx.x; i <= E; i += kPairsPerBlock) row[i] = hist[i];
}

__global__ void __launch_bounds__(kScanThreads) scan_kernel(const MoePermuteParams p, int32_t* table, int64_t blocks) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  using Reduce = cub::BlockReduce<int64_t, kScanThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } tmp;
  __shared__ int64_t carry;
  const int64_t E = p.experts;
  if (threadIdx.x == 0) carry = 0;
  int64_t dropped = 0;
  // Experts in passes of kScanThreads (E <= kMoeMaxExperts: one pass); column E (invalid ids) too.
  for (int64_t e0 = 0; e0 <= E; e0 += kScanThreads) {
    const int64_t e = e0 + threadIdx.x;
    int64_t total = 0;
    if (e <= E)
      for (int64_t b = 0; b < blocks; ++b) {  // exclusive prefix over the blocks, in block order
        int32_t* c = table + b * (E + 1) + e;
        const int32_t v = *c;
        *c = static_cast<int32_t>(total);
        total += v;
      }
    int64_t kept = 0;
    if (e < E) {
      kept = p.capacity > 0 && total > p.capacity ? p.capacity : total;
      dropped += total - kept;
      p.counts[e] = static_cast<int32_t>(kept);
    } else if (e == E) {
      dropped += total;  // ids outside [0, E)
    }
    int64_t before, pass_total;
    __syncthreads();  // carry from the previous pass is visible
    Scan(tmp.scan).ExclusiveSum(kept, before, pass_total);
    if (e < E) p.offsets[e] = static_cast<int32_t>(carry + before);
    __syncthreads();
    if (threadIdx.x == 0) carry += pass_total;
  }
  __syncthreads();
  const int64_t all_dropped = Reduce(tmp.reduce).Sum(dropped);
  if (threadIdx.x == 0) {
    p.offsets[E] = static_cast<int32_t>(carry);
    if (p.dropped) *p.dropped = static_cast<int32_t>(all_dropped);
  }
}

__global__ void __launch_bounds__(kPairsPerBlock) place_kernel(const MoePermuteParams p, const int32_t* table) {
  extern __shared__ int32_t warp_counts[];  // (kWarps, E)
  const int64_t E = p.experts;
  for (int64_t i = threadIdx.x; i < kWarps * E; i += kPairsPerBlock) warp_counts[i] = 0;
  __syncthreads();
  const int64_t i = int64_t(blockIdx.x) * kPairsPerBlock + threadIdx.x;
  const int e = expert_of(p, i);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int in_warp = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && in_warp == 0) warp_counts[warp * E + e] = __popc(peers);
  __syncthreads();
  const int32_t total_kept = p.offsets[E];
  if (i < p.pairs && i >= total_kept) p.sorted_pairs[i] = -1;  // slots past the kept pairs
  if (i >= p.pairs) return;
  if (e < 0) {
    p.slot_of[i] = -1;
    return;
  }
  int64_t rank = table[int64_t(blockIdx.x) * (E + 1) + e] + in_warp;
  for (int w = 0; w < warp; ++w) rank += warp_counts[w * E + e];
  if (rank < p.counts[e]) {
    const int32_t slot = static_cast<int32_t>(p.offsets[e] + rank);
    p.sorted_pairs[slot] = static_cast<int32_t>(i);
    p.slot_of[i] = slot;
  } else {
    p.slot_of[i] = -1;
  }
}

}  // namespace

size_t moe_permute_workspace_bytes(int64_t pairs, int64_t experts) {
  return static_cast<size_t>(std::max<int64_t>(1, blocks_for(pairs)) * (experts + 1)) * sizeof(int32_t);
}

cudaError_t moe_permute(const MoePermuteParams& p, const Workspace& workspace, cudaStream_t stream) {
  const int64_t blocks = std::max<int64_t>(1, blocks_for(p.pairs));
  if (workspace.bytes < moe_permute_workspace_bytes(p.pairs, p.experts) || blocks > 0x7fffffff)
    return cudaErrorInvalidValue;
  auto* table = static_cast<int32_t*>(workspace.data);
  const size_t hist_bytes = static_cast<size_t>(p.experts + 1) * sizeof(int32_t);
  const size_t warp_bytes = static_cast<size_t>(kWarps * p.experts) * sizeof(int32_t);
  if (cudaError_t e = cudaFuncSetAttribute(place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(warp_bytes));
      e != cudaSuccess)
    return e;
  count_kernel<<<static_cast<unsigned>(blocks), kPairsPerBlock, hist_bytes, stream>>>(p, table);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  scan_kernel<<<1, kScanThreads, 0, stream>>>(p, table, blocks);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  place_kernel<<<static_cast<unsigned>(blocks), kPairsPerBlock, warp_bytes, stream>>>(p, table);
  return cudaGetLastError();
}

}  // namespace optimized::cuda
