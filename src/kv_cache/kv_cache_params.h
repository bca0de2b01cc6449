// The params of the KV-cache family: what every backend and the float64 reference receive once the
// public API (src/kv_cache/kv_cache.cpp) has validated the operands. Raw pointers and strides in
// elements; no tensor view, no torch. One struct per op: append and decode.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "optimized/core.h"
#include "optimized/kv_cache.h"

namespace optimized {

// The cache as the backends see it. Element (page, slot, head, d) of K at
// k_pages + page * k_page + slot * k_slot + head * k_head + d (V alike).
struct KvCachePages {
  DType dtype = DType::kF16;  // of the pages: fp16, bf16, fp32, fp64 (cpu) or fp8 e4m3
  int64_t num_pages = 0, page_size = 0, heads_kv = 0, head_dim = 0;
  void* k_pages = nullptr;
  void* v_pages = nullptr;
  int64_t k_page = 0, k_slot = 0, k_head = 0;
  int64_t v_page = 0, v_slot = 0, v_head = 0;
  const float* k_scale = nullptr;  // fp8: (H_kv) dequantization scales; null otherwise
  const float* v_scale = nullptr;
};

// The page table: page_table[b * table_row + p] (int32), max_pages entries per sequence.
struct KvPageTable {
  const int32_t* entries = nullptr;
  int64_t batch = 0, max_pages = 0, row = 0;
};

struct KvAppendParams {
  KvCachePages cache;
  KvPageTable table;
  DType dtype = DType::kF16;  // of k, v (and q): the cache's, or fp16/bf16/fp32 into an fp8 cache
  int64_t new_tokens = 0;     // S_new per sequence
  const void* k = nullptr;    // (B, S_new, H_kv, D), element (b, s, h, d) at k + b*k_b + s*k_s + h*k_h + d
  const void* v = nullptr;
  int64_t k_b = 0, k_s = 0, k_h = 0, v_b = 0, v_s = 0, v_h = 0;
  const int32_t* positions = nullptr;  // (B, S_new): positions[b * pos_b + s]; < 0: padding
  int64_t pos_b = 0;
  void* q = nullptr;                   // (B, S_new, H_q, D) rotated in place, or null
  int64_t q_b = 0, q_s = 0, q_h = 0, heads_q = 0;
  RopeLayout rope = RopeLayout::kNone;
  double rope_theta = 10000.0;
  int64_t rotary_dim = 0;              // resolved: even, 2 <= rotary_dim <= head_dim (when rope is on)
};

struct KvDecodeParams {
  KvCachePages cache;
  KvPageTable table;
  DType dtype = DType::kF16;  // of q and out
  int64_t batch = 0, q_len = 1, heads_q = 0;
  const void* q = nullptr;    // (B, q_len, H_q, D): q + b*q_b + t*q_t + h*q_h + d
  int64_t q_b = 0, q_t = 0, q_h = 0;
  void* out = nullptr;        // like q
  int64_t out_b = 0, out_t = 0, out_h = 0;
  float* lse = nullptr;       // (B, H_q, q_len): lse + b*lse_b + h*lse_h + t; or null
  int64_t lse_b = 0, lse_h = 0;
  const int32_t* seq_lens = nullptr;  // (B)
  double scale = 0.0;         // resolved (1/sqrt(D) for NaN)
  int64_t window_left = -1;   // -1: none
  double softcap = 0.0;
  const float* alibi = nullptr;  // (B, H_q) or (H_q): alibi[b * alibi_b + h]
  int64_t alibi_b = 0;
  int64_t splits = 1;         // paged_split: key chunks per sequence (the plan's; >= 1); other rungs ignore it

  OPTIMIZED_HOST_DEVICE int64_t group() const { return heads_q / cache.heads_kv; }
};

// The gather of prefill's attention path (cuda/gather.cu, cpu_kv_gather): every sequence's K/V out
// of its pages, packed for attention_varlen_forward: sequence b's key j at row cu_k[b] + j of
// (rows, H_kv, D) buffers of `dtype`, L_b = seq_lens[b] clipped to [0, len], cu_k[b] = L_0 + ... +
// L_{b-1}; and cu_q[b] = b * q_len (q packed as (batch * q_len, H_q, D)). A key whose page is outside
// the table or the cache (unchecked mode) is gathered as zeros.
struct KvGatherParams {
  KvCachePages cache;
  KvPageTable table;
  const int32_t* seq_lens = nullptr;  // (batch)
  DType dtype = DType::kF16;          // of the buffers (q's)
  int64_t batch = 0, len = 0;         // len: rows per sequence at most (<= max_pages * page_size)
  int64_t q_len = 0;
  void* k_out = nullptr;
  void* v_out = nullptr;
  int32_t* cu_q = nullptr;  // (batch + 1), written
  int32_t* cu_k = nullptr;  // (batch + 1), written
};

}  // namespace optimized
