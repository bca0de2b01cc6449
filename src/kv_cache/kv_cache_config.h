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

// paged_mma (cuda/paged_mma.cu): 4 warps a block, one m16 tile of query rows (more rows: several
// blocks, each reading the keys again), head dims 64 / 128 / 256, and a cp.async ring of
// mma_stages 16-key tiles per warp: about 24-32 KiB of K / V in flight per warp, so that a block
// takes 64-128 KiB of shared memory and an SM holds 1-3 of them.
constexpr int kMmaWarps = 4;
constexpr int kMmaRows = 16;
constexpr bool mma_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }
constexpr int mma_stages(int head_dim, bool fp8) {
  if (fp8) return head_dim <= 64 ? 6 : (head_dim <= 128 ? 4 : 2);
  return head_dim <= 64 ? 4 : (head_dim <= 128 ? 3 : 2);
}

// The split of paged_mma. `blocks` = B * H_kv * row groups, `slots` = the blocks resident at once
// (SMs x blocks per SM, from the occupancy of the instance). A split of s chunks runs
// ceil(blocks * s / slots) waves of blocks each reading 1/s of the keys: time ~ waves(s) / s of one
// unsplit pass, plus the merge, which writes and reads back about 2 * rows fp32 rows per split
// against the 2 * max_seq_len K / V rows a block reads: s * 2 * rows / max_seq_len. The rule takes
// the s in [1, min(kMaxSplits, max_seq_len / kMinKeysPerMmaSplit)] of least cost (the smallest on a
// tie); a grid of at least one full wave is not split (splitting 16384 prefill blocks in two saved
// under 1% of waves on paper and cost a 268 MB merge). H100, GQA 32 / 8, d = 128 (2 blocks per SM,
// 264 slots): B = 1, L = 32k: 8 blocks -> s = 32 (one full wave); B = 16, L = 4k: 128 blocks ->
// s = 2; B = 64: 512 blocks -> s = 1 (two waves); B = 128: 1.
constexpr int64_t kMinKeysPerMmaSplit = 64;
inline int64_t mma_decode_splits(int64_t blocks, int64_t rows, int64_t max_seq_len, int64_t slots) {
  blocks = std::max<int64_t>(1, blocks), slots = std::max<int64_t>(1, slots);
  if (blocks >= slots) return 1;  // a full wave already: a split only shaves the last wave's rounding
  const int64_t most = std::clamp<int64_t>(max_seq_len / kMinKeysPerMmaSplit, 1, kMaxSplits);
  const double merge = max_seq_len > 0 ? 2.0 * static_cast<double>(rows) / static_cast<double>(max_seq_len) : 0.0;
  int64_t best = 1;
  double best_cost = 0.0;
  for (int64_t s = 1; s <= most; ++s) {
    const double waves = static_cast<double>((blocks * s + slots - 1) / slots);
    const double cost = waves / static_cast<double>(s) + static_cast<double>(s) * merge;
    if (s == 1 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// paged_attention_prefill with variant auto takes the attention family's forward (K/V gathered
// into contiguous buffers first: cuda/gather.cu, cpu_kv_gather) for chunks of at least this many
// queries (on CUDA: fp16 / bf16 q and a head dim flash2 is compiled for); shorter chunks run the
// family's own rungs (paged_mma on CUDA), which read each page once instead of gathering (a first
// guess, not measured: flash2's query tile is 64 or 128 rows).
constexpr int64_t kPrefillAttentionMinChunk = 64;

inline int64_t decode_splits(int64_t batch, int64_t heads_kv, int64_t max_seq_len, int sm_count) {
  const int64_t blocks = std::max<int64_t>(1, batch * heads_kv);
  if (blocks >= sm_count || max_seq_len <= kMinKeysPerSplit) return 1;
  const int64_t want = (kBlocksPerSm * sm_count + blocks - 1) / blocks;
  const int64_t most = (max_seq_len + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  return std::clamp<int64_t>(std::min(want, most), 1, kMaxSplits);
}

}  // namespace optimized::kv_cache_config
