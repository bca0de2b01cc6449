// The paged KV cache and decode attention: the cache an autoregressive engine keeps (K and V in
// fixed-size pages, PagedAttention), appending new tokens into it (with rotary embedding fused),
// and attention of a few new query tokens per sequence over everything cached (decode, and
// speculative decoding with up to 8 query tokens).
//
// The cache. K and V pages of shape (num_pages, page_size, H_kv, D), page_size 1 to 256, the last
// dimension contiguous (other strides free). The caller owns the allocation of pages to sequences,
// as in vLLM and FlashInfer: a page table (B, max_pages_per_seq) int32 maps page p of sequence b to
// a cache page, and seq_lens (B) int32 says how many tokens sequence b holds. Token t of sequence b
// lives in cache page page_table[b][t / page_size], slot t % page_size.
//
// Dtypes: K/V pages fp16, bf16, fp32 (fp64 on the cpu variant), or fp8 e4m3 with fp32 per-kv-head
// scales (value = fp8 * scale; quantized on append with the scale given, dequantized in attention).
// Queries, new keys / values and outputs: fp16, bf16, fp32 (fp64 on cpu); with an fp16/bf16/fp32
// cache they have the cache's dtype.
//
// Decode attention. q (B, q_len, H_q, D), q_len 1 to 8. The q_len new tokens are the last q_len of
// each sequence (already appended): query t of sequence b sits at position seq_lens[b] - q_len + t
// and sees the cached keys at positions <= its own (causal inside the new tokens), within the
// sliding window when one is given. The score rules (scale, softcap, ALiBi, window) are those of
// include/optimized/attention.h with bottom-right alignment. A sequence with seq_len 0 (or a query
// that sees no key) gives out 0 and lse -inf. GQA / MQA as in attention.h.
//
// Checked and unchecked. Page tables and seq_lens live on the device with the cache. With
// `validate` the host reads them back (a synchronization) and refuses a page index out of
// [0, num_pages), a seq_len < 0 or beyond the pages its row provides, or one between 1 and q_len - 1
// (a sequence of seq_len 0 holds nothing: its queries give out 0 and lse -inf);
// without it nothing is read back (CUDA-graph safe) and the kernels still never read outside the
// cache: an out-of-range page index reads as an empty page (its keys masked).
//
// Variants: cpu, and on CUDA (compute capability 8.0+, head_dim up to 512) contiguous_naive, paged,
// paged_split, paged_mma; append_kv on CUDA runs one kernel whichever CUDA variant is named. paged and
// paged_split stage fp32 K/V tiles in shared memory: on GPUs with 99 KiB of it per block (compute
// capability 8.6, 8.9) they take head_dim up to 381 (the launch fails beyond; H100 and A100 run 512).
// paged_mma (tensor cores) takes fp16 / bf16 q, head_dim 64, 128 or 256 and cache rows that start
// 16-byte aligned (as PagedKVCache allocates them); auto runs it where it fits and paged_split
// elsewhere (fp32, other head dims). It rounds the probabilities to 16 bits before P V (fp32
// accumulation), as FlashAttention does.
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "optimized/core.h"
#include "optimized/rope.h"

namespace optimized {

enum class KvCacheVariant : uint8_t {
  kAuto,  // the best rung for the device (CPU: kCpu; CUDA: kPagedMma where it runs, else kPagedSplit)
  kCpu,   // threads over (sequence, kv head): the readable reference rung
  kContiguousNaive,  // CUDA: one block per (sequence, query head, query), two passes, scalar loads
  kPaged,            // CUDA: one block per (sequence, kv head), GQA packed, online softmax, 16-byte loads
  kPagedSplit,       // CUDA: paged over key chunks (flash-decoding) + an LSE merge
  kPagedMma,         // CUDA: paged_split's split, per-warp cp.async rings and tensor cores (CUDA's auto)
};

std::string_view kv_cache_variant_name(KvCacheVariant variant);   // "cpu", "paged_split", ...
KvCacheVariant parse_kv_cache_variant(std::string_view name);      // throws Error naming the choices
std::span<const KvCacheVariant> all_kv_cache_variants();            // every variant but kAuto
bool kv_cache_variant_is_cuda(KvCacheVariant variant);
std::string kv_cache_variant_rejects_dtype(KvCacheVariant variant, DType dtype);  // empty: runs it

// The cache as views: k_pages, v_pages (num_pages, page_size, H_kv, D) of one dtype; fp8 e4m3
// pages carry k_scale, v_scale fp32 (H_kv) (absent otherwise).
struct PagedKVCacheView {
  TensorView k_pages, v_pages;
  TensorView k_scale, v_scale;
};

// Rotary embedding, applied to the new keys on append (and to q when given): RopeLayout and
// RopeOptions (include/optimized/rope.h, shared with the fused family's rope_forward): for pair i of
// the rotary dims, angle = position * theta^(-2i / rotary_dim); kNeox pairs (x[i], x[i + rotary_dim / 2]),
// kInterleaved (x[2i], x[2i + 1]); dimensions past rotary_dim pass through.

// Writes new tokens into the cache. k, v (B, S_new, H_kv, D): S_new tokens per sequence, at
// positions (B, S_new) int32 (a position < 0 marks padding: skipped); token (b, s) goes to
// position positions[b][s] of sequence b through page_table. With rope, k is rotated before it is
// stored and q (B, S_new, H_q, D), when given, is rotated in place (q_out = rope(q)). fp8 caches
// store round(x / scale) saturated to e4m3's range.
void append_kv(const PagedKVCacheView& cache, const TensorView& k, const TensorView& v,
               const TensorView& page_table, const TensorView& positions, const TensorView& q = {},
               const RopeOptions& rope = {}, bool validate = true, KvCacheVariant variant = KvCacheVariant::kAuto,
               const ExecutionContext& ctx = {});

struct DecodeOptions {
  double softmax_scale = std::numeric_limits<double>::quiet_NaN();  // NaN: 1 / sqrt(D)
  int64_t window_left = -1;   // keys more than window_left before a query's position are masked; -1: none
  double softcap = 0.0;       // > 0: s = softcap * tanh(s / softcap)
  TensorView alibi_slopes;    // fp32 (H_q) or (B, H_q); absent: off
  bool validate = true;       // read page_table / seq_lens back and check them (see above)
};

// out (B, q_len, H_q, D) = attention of q over the cached tokens of each sequence; lse fp32
// (B, H_q, q_len) or absent.
void paged_attention_decode(const TensorView& q, const PagedKVCacheView& cache, const TensorView& page_table,
                            const TensorView& seq_lens, const TensorView& out, const TensorView& lse = {},
                            const DecodeOptions& options = {}, KvCacheVariant variant = KvCacheVariant::kAuto,
                            const ExecutionContext& ctx = {});

// Prefill over the cache (chunked prefill, prefix caching): the attention of a chunk of new tokens
// per sequence, already appended (append_kv), over the whole cached sequence: the cached prefix and
// the chunk, causal inside the chunk. The decode op with any q_len >= 1 (S_new, dimension 1 of q
// (B, S_new, H_q, D)): query t of sequence b sits at position seq_lens[b] - S_new + t (the chunk is
// right-aligned to the sequence's end); a sequence shorter than S_new leaves its first rows at
// negative positions, which see no key (out 0, lse -inf): chunks of different lengths share one
// padded q. Every variant runs it (one block per 16 (paged_mma) or 32 query rows of a kv head, each
// reading the keys its rows see; the split rule as decode's). auto, for chunks of 64 or more queries
// whose q and out are (B * S_new, H_q, D) rows (B = 1, or a batch stride of S_new rows as in a
// contiguous tensor) or hold each sequence's (S_new, H_q, D) block contiguously (a slice of a longer
// prompt: copied into packed rows and back), with fp16 / bf16 q and a head dim of
// attention_head_dims() on CUDA (not fp64), gathers every sequence's K/V out of its pages into
// packed buffers of q's dtype (fp8 dequantized) and runs attention_varlen_forward on them (flash2
// on CUDA, its cpu rung on the host; causal bottom-right); other calls run paged_mma (CUDA) or cpu.
// The buffers (2 * B * len * H_kv * D elements, the offsets, the packed copies of q and out when
// taken, and an fp32 (H_q, B * S_new) lse when lse is asked for with B > 1; len = the
// longest sequence when validate reads seq_lens back, else max_pages * page_size) come from
// ctx.workspace or the library's stream-ordered pool (host memory on the CPU). validate refuses only a
// seq_len < 0 or beyond the pages (not one < S_new); unchecked, such a seq_len is clipped to the
// pages, and the gather reads a page index outside the cache as a key and value of zeros (the rungs
// skip it: unchecked garbage differs by route, never reads out of bounds).
void paged_attention_prefill(const TensorView& q, const PagedKVCacheView& cache, const TensorView& page_table,
                             const TensorView& seq_lens, const TensorView& out, const TensorView& lse = {},
                             const DecodeOptions& options = {}, KvCacheVariant variant = KvCacheVariant::kAuto,
                             const ExecutionContext& ctx = {});

// Plan / run. A decode step whose launch is fixed once on the host, so that it can be captured in
// a CUDA graph and replayed as the sequences grow: plan_paged_decode resolves the variant, chooses
// the split of paged_split / paged_mma and sizes the workspace for a shape (host only: it reads
// device facts such as the SM count, nothing else on the device). The split rules
// (src/kv_cache/kv_cache_config.h): paged_split: splits = 1 when B * heads_kv blocks fill the SMs or
// max_seq_len <= 256; otherwise about two blocks per SM, min(ceil(2 * SMs / (B * heads_kv)),
// ceil(max_seq_len / 256)), at most 128. paged_mma: the split that fills whole waves of resident
// blocks at the least cost, counting the merge (mma_decode_splits), at most 128. Each
// sequence's keys are cut into `splits` chunks on the device from its current length, so a plan
// stays correct for any length (max_seq_len only tunes the split).
struct DecodePlan {
  KvCacheVariant variant = KvCacheVariant::kAuto;  // resolved (never kAuto in a plan that was made)
  Device device = Device::cpu();
  int64_t batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0, q_len = 1, page_size = 0, max_seq_len = 0;
  DType dtype = DType::kF16, cache_dtype = DType::kF16;  // of q / out, of the pages
  int64_t splits = 1;          // key chunks per sequence (paged_split, paged_mma; 1 elsewhere)
  size_t workspace_bytes = 0;  // ExecutionContext::workspace the run needs (256-byte aligned)
};

DecodePlan plan_paged_decode(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t q_len,
                             int64_t page_size, int64_t max_seq_len, DType dtype, DType cache_dtype, Device device,
                             KvCacheVariant variant = KvCacheVariant::kAuto);

// The run: as the call above, checking that the call fits the plan (Error naming the argument:
// shape, dtypes, page size, device) and using ctx.workspace (at least plan.workspace_bytes, 256-byte
// aligned; Error when the plan needs one and none is given) without allocating; it never
// synchronizes. options.validate may stay true outside graph capture (it reads the page table
// back, a synchronization); under capture the read-back is skipped.
void paged_attention_decode(const TensorView& q, const PagedKVCacheView& cache, const TensorView& page_table,
                            const TensorView& seq_lens, const TensorView& out, const TensorView& lse,
                            const DecodeOptions& options, const DecodePlan& plan, const ExecutionContext& ctx = {});

}  // namespace optimized
