// Tuning of the KV-cache family's CUDA rungs, in one place (host and device).
//
// The split rule of flash-decoding (paged_split; plan_paged_decode uses it, and the call without a
// plan): a decode step launches B * H_kv blocks (one per sequence and kv head, times the row
// groups). When that fills the GPU (>= one block per SM) splitting the keys only adds a merge:
// splits = 1. Otherwise each sequence's keys are cut into `splits` chunks so that about two
// blocks land on each SM (2 * sm_count blocks in all), but no chunk is shorter than
// kMinKeysPerSplit keys (the partial results and the merge cost about one key row per query row
// and split, so a chunk of fewer keys than that would spend more on the merge than it saves),
// and never more than kMaxSplits. Example, the H100 (132 SMs), GQA 32 / 8: B = 1, L = 32k:
// 8 blocks -> splits = min(ceil(264 / 8), 32768 / 256) = 33; B = 16: 128 blocks -> splits = 3
// (L > 512); B = 64: 512 blocks -> 1. Not yet measured on the GPU: the constants are a first
// guess to be tuned against the benchmark (issue 14's shapes).
#pragma once

#include <algorithm>
#include <cstdint>

namespace optimized::kv_cache_config {

constexpr int64_t kMinKeysPerSplit = 256;
constexpr int64_t kMaxSplits = 128;
constexpr int64_t kBlocksPerSm = 2;

// Keys of a tile (one lane per key in the softmax step) and the most query rows one block of
// paged / paged_split serves (rows = the GQA group's heads x q_len; more rows: several blocks).
constexpr int kKeyTile = 32;
constexpr int kMaxRowsPerBlock = 32;
constexpr int kDecodeThreads = 128;
// The largest head_dim the CUDA rungs take (shared memory holds fp32 rows of it).
constexpr int64_t kMaxHeadDim = 512;

inline int64_t decode_splits(int64_t batch, int64_t heads_kv, int64_t max_seq_len, int sm_count) {
  const int64_t blocks = std::max<int64_t>(1, batch * heads_kv);
  if (blocks >= sm_count || max_seq_len <= kMinKeysPerSplit) return 1;
  const int64_t want = (kBlocksPerSm * sm_count + blocks - 1) / blocks;
  const int64_t most = (max_seq_len + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  return std::clamp<int64_t>(std::min(want, most), 1, kMaxSplits);
}

}  // namespace optimized::kv_cache_config
