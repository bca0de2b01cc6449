// The references of the KV-cache family and their checks (host memory only).
//
// Decode: each sequence's keys / values are gathered from the pages (through the page table,
// dequantized for fp8: fp8 * scale in float, then held in q's dtype: exact for fp32 q, or for a
// power-of-two scale) into contiguous host arrays; attention of its q_len queries over them is the
// attention family's float64 reference (attention_reference.h) with bottom-right causal alignment,
// window_left, softcap and ALiBi: fixed length (1 sequence, S_q = q_len, S_k = seq_len) per
// sequence. A key whose page index is outside [0, num_pages) (unchecked mode) or past the table
// is hidden by a bool mask. out is checked with flash-attention's rule (check_attention_output);
// lse (fp32 whatever q's dtype) with the same rule, rounded to fp32.
//
// Append: the cache after append_kv in float64: rope_f64 on k (angle = pos * theta^(-2i/rd), all
// in double), v as given; fp8: the dequantized value of x / scale saturated to +-448. q rotated.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_cache/kv_cache_params.h"
#include "testing/check.h"

namespace optimized::testing {

// RoPE of one row of head_dim values, in double.
void rope_f64(double* x, int64_t pos, RopeLayout layout, double theta, int64_t rotary_dim);

// decode: p with HOST pointers (out and lse read as the call wrote them).
CheckResult check_kv_decode(const KvDecodeParams& p);

// append: the expected cache (indexed like the params' pages: page * k_page + ... in elements) of
// the written slots and q; `written[page * page_size + slot]` marks them.
struct KvAppendReference {
  std::vector<double> k, v;  // one row of head_dim per (page, slot, head): ((page * P + slot) * H + h) * D + d
  std::vector<uint8_t> written;
  std::vector<double> q;     // rotated q (b, s, h, d), when p.q is set
  std::vector<double> q_bound;  // the rope's rounding bound per q element
  std::vector<double> k_bound;
};
// p: host pointers, read BEFORE the call (q is rotated in place).
KvAppendReference kv_append_reference_f64(const KvAppendParams& p);
// The cache (and q) through p's host pointers after the call, against ref.
CheckResult check_kv_append(const KvAppendParams& p, const KvAppendReference& ref);

}  // namespace optimized::testing
