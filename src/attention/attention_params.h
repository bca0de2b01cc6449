// The params of the attention family: what every backend, launcher and the float64 reference
// receive once the public API (src/attention/attention.cpp) has validated the operands. Raw
// pointers and strides in elements; no tensor view, no torch. Forward and backward share the
// struct; the backward fields are null in a forward call.
//
// Addressing (fixed length and varlen alike): row i of sequence b, head h of tensor X is
//   X + b * X.batch + (start_X(b) + i) * X.row + h * X.head      (the last dimension contiguous)
// where start_q(b) = cu_seqlens_q[b] (varlen; X.batch = 0 there) or 0 (fixed length), and the
// sequence lengths are cu_seqlens_q[b + 1] - cu_seqlens_q[b] or seqlen_q (likewise for k).
// lse: lse + b * lse_batch + h * lse_head + start_q(b) + i.
//
// The score semantics (include/optimized/attention.h) are written once, in AttentionScore below,
// for the host and the device: every rung calls it (or, in flash2's inner loop, the same algebra
// split into its range part and its value part, each documented against it).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"
#include "optimized/attention.h"
#include "optimized/core.h"

namespace optimized {

struct AttentionStrides {
  int64_t batch = 0, row = 0, head = 0;
};

struct AttentionParams {
  DType dtype = DType::kF16;  // q, k, v, out, dout, dq, dk, dv
  int64_t batch = 0;          // B (varlen: number of sequences)
  int64_t seqlen_q = 0;       // fixed: S_q; varlen: max_seqlen_q (grids are sized by it)
  int64_t seqlen_k = 0;       // fixed: S_k; varlen: max_seqlen_k
  int64_t heads_q = 0, heads_kv = 0;
  int64_t head_dim = 0;       // D as given (the kernels may round up to an instantiated size)
  int64_t total_q = 0, total_k = 0;  // varlen: packed rows; fixed: batch * seqlen

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;  // forward output; backward input
  AttentionStrides q_s, k_s, v_s, out_s;
  // fp32 (fp64 for fp64 inputs); forward: written when non-null; backward: read (required).
  void* lse = nullptr;
  int64_t lse_batch = 0, lse_head = 0;

  const int32_t* cu_seqlens_q = nullptr;  // varlen (B + 1); null: fixed length
  const int32_t* cu_seqlens_k = nullptr;

  // ---- score semantics (normalized by the API) ---------------------------------------------
  double scale = 0.0;          // resolved: 1/sqrt(D) when the caller gave NaN
  bool causal = false;         // informative: window_right is already 0 when set
  bool top_left = false;       // alignment: offset 0 instead of S_k - S_q
  int64_t window_left = -1;    // -1: unbounded
  int64_t window_right = -1;   // -1: unbounded (0 when causal)
  double softcap = 0.0;        // > 0: on
  const float* alibi = nullptr;  // (B, H_q) or (H_q); null: off
  int64_t alibi_batch = 0;       // 0 for (H_q)
  // Explicit mask (fixed length only): element (b, h, i, j) at
  // mask + b * mask_s[0] + h * mask_s[1] + i * mask_s[2] + j * mask_s[3] (broadcast: stride 0).
  const void* mask = nullptr;
  DType mask_dtype = DType::kBool;  // kBool (nonzero: attend) or an additive float dtype
  int64_t mask_s[4] = {0, 0, 0, 0};

  // ---- backward ------------------------------------------------------------------------------
  bool backward = false;
  bool deterministic = false;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  AttentionStrides dout_s, dq_s, dk_s, dv_s;

  OPTIMIZED_HOST_DEVICE bool varlen() const { return cu_seqlens_q != nullptr; }
  OPTIMIZED_HOST_DEVICE int64_t group() const { return heads_q / heads_kv; }  // query heads per kv head
  OPTIMIZED_HOST_DEVICE bool has_window() const { return window_left >= 0 || window_right >= 0; }
};

// One sequence of a call: where its rows start in the packed (or per-batch) tensors and how many
// there are.
struct AttentionSeq {
  int64_t start_q = 0, start_k = 0;
  int64_t len_q = 0, len_k = 0;
};
OPTIMIZED_HOST_DEVICE inline AttentionSeq attention_seq(const AttentionParams& p, int64_t b) {
  AttentionSeq s;
  if (p.cu_seqlens_q) {
    s.start_q = p.cu_seqlens_q[b];
    s.len_q = p.cu_seqlens_q[b + 1] - s.start_q;
    s.start_k = p.cu_seqlens_k[b];
    s.len_k = p.cu_seqlens_k[b + 1] - s.start_k;
  } else {
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
  }
  return s;
}

// The score rule of one (sequence, batch b, query head h), in the math type T (float on the CUDA
// rungs and for fp32/fp16/bf16 on the CPU; double for fp64 and the reference):
//   AttentionScore<float> sc(p, seq, b, h);
//   [lo, hi) = sc.key_range(i)                 keys outside are -inf (window, causal)
//   s = sc.value(dot, i, j)                    scale, softcap, ALiBi (no mask, no range)
//   s += mask                                  the explicit mask, where the rung reads it
template <typename T>
struct AttentionScore {
  T scale = 0;
  T softcap = 0;  // 0: off
  T slope = 0;    // 0: no ALiBi
  int64_t offset = 0;  // diagonal: query i's aligned key is i + offset
  int64_t window_left = -1, window_right = -1;
  int64_t len_k = 0;

  OPTIMIZED_HOST_DEVICE AttentionScore(const AttentionParams& p, const AttentionSeq& seq, int64_t b, int64_t h)
      : scale(static_cast<T>(p.scale)),
        softcap(static_cast<T>(p.softcap)),
        slope(p.alibi ? static_cast<T>(p.alibi[b * p.alibi_batch + h]) : T(0)),
        offset(p.top_left ? 0 : seq.len_k - seq.len_q),
        window_left(p.window_left),
        window_right(p.window_right),
        len_k(seq.len_k) {}

  // The keys query i may see: [lo, hi), clipped to [0, len_k); empty (lo >= hi) for none.
  OPTIMIZED_HOST_DEVICE int64_t key_lo(int64_t i) const {
    const int64_t lo = window_left < 0 ? 0 : i + offset - window_left;
    return lo < 0 ? 0 : lo;
  }
  OPTIMIZED_HOST_DEVICE int64_t key_hi(int64_t i) const {
    const int64_t hi = window_right < 0 ? len_k : i + offset + window_right + 1;
    return hi > len_k ? len_k : (hi < 0 ? 0 : hi);
  }
  // scale * dot, soft-capped, minus the ALiBi distance term.
  OPTIMIZED_HOST_DEVICE T value(T dot, int64_t i, int64_t j) const {
    T s = scale * dot;
    if (softcap > T(0)) s = softcap * tanh_of(s / softcap);
    if (slope != T(0)) {
      const int64_t d = i + offset - j;
      s -= slope * static_cast<T>(d < 0 ? -d : d);
    }
    return s;
  }
  // The backward through the soft-cap: with t = tanh(s / softcap) (s = scale * dot), d value /
  // d s = 1 - t * t; the gradient of dot is then scale * (1 - t * t) * dS. ALiBi and the mask are
  // additive constants: they pass dS through unchanged.
  static OPTIMIZED_HOST_DEVICE T softcap_grad_from_tanh(T t) { return T(1) - t * t; }

 private:
  static OPTIMIZED_HOST_DEVICE T tanh_of(T x) {
#ifdef __CUDA_ARCH__
    if constexpr (sizeof(T) == 4) return tanhf(x);
    else return tanh(x);
#else
    return std::tanh(x);
#endif
  }
};

}  // namespace optimized
