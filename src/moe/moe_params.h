// The MoE family's params: what every backend receives once the public API (moe.cpp) has validated
// the operands. Raw pointers and sizes; no tensor view, no torch. moe_route_token is the routing of
// one token, shared by the CPU loop and the CUDA kernel (one thread per token), so that both
// backends choose the same experts by the same rule (include/optimized/moe.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"
#include "optimized/core.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#else
#include "optimized/buffer.h"
#endif

namespace optimized {

struct MoeRouteParams {
  const void* logits = nullptr;  // (tokens, experts), rows ld apart, unit stride along experts
  DType dtype = DType::kF32;     // fp32, fp16, bf16
  int64_t tokens = 0, experts = 0, ld = 0;
  const float* bias = nullptr;   // (experts) or null
  int32_t* ids = nullptr;        // (tokens, k)
  float* weights = nullptr;      // (tokens, k)
  float* lse = nullptr;          // (tokens) or null
  int k = 1;
  int scoring = 0;               // MoeScoring: 0 softmax, 1 sigmoid
  bool topk_softmax = false, normalize = false;
  int n_groups = 1, topk_groups = 1;
  float routed_scale = 1.0f;
};

struct MoePermuteParams {
  const int32_t* ids = nullptr;  // (pairs): pair p = t k + j
  int64_t pairs = 0, experts = 0;
  int64_t capacity = 0;          // 0: dropless
  int32_t* counts = nullptr;     // (experts)
  int32_t* offsets = nullptr;    // (experts + 1)
  int32_t* sorted_pairs = nullptr;  // (pairs)
  int32_t* slot_of = nullptr;    // (pairs)
  int32_t* dropped = nullptr;    // (1) or null
};

// The combine and its backward (moe.h): y (slots, n) rows ld_y apart; out / dout (tokens, n) rows
// ld_out apart; slot_of, weights (tokens, k); sorted_pairs (slots).
struct MoeCombineParams {
  DType dtype = DType::kBF16;  // y, out, dout, grad_y
  int64_t tokens = 0, k = 0, n = 0, slots = 0;
  const void* y = nullptr;
  int64_t ld_y = 0;
  const int32_t* slot_of = nullptr;
  const int32_t* sorted_pairs = nullptr;  // backward
  const float* weights = nullptr;
  void* out = nullptr;        // forward: out; backward: null
  const void* dout = nullptr; // backward
  int64_t ld_out = 0;         // out's or dout's row stride
  void* grad_y = nullptr;     // backward, (slots, n) rows ld_gy apart, or null
  int64_t ld_gy = 0;
  float* grad_weights = nullptr;  // backward, (tokens, k), or null
};

// The grouped GEMM (both directions): forward c (M, N) = a (M, K) @ b[g] (K, N) per group of rows;
// weight_grad c[g] (K, N) = a[rows of g]^T (K, rows) @ b[rows of g] (rows, N), a = x (M, K), b = dout
// (M, N). Strides in elements.
struct GroupedGemmParams {
  bool weight_grad = false;
  int64_t m = 0, n = 0, k = 0, groups = 0;
  DType dtype = DType::kBF16;    // a and b
  DType c_dtype = DType::kBF16;  // c: dtype, or fp32 (weight_grad)
  const void* a = nullptr;
  int64_t a_rs = 0;              // a's row stride (unit along its columns)
  const void* b = nullptr;
  int64_t b_gs = 0, b_rs = 0, b_cs = 1;  // forward: b[g](k, n) at g b_gs + k b_rs + n b_cs; weight_grad: b (M, N) rows b_rs apart
  const int32_t* offs = nullptr;
  void* c = nullptr;
  int64_t c_gs = 0, c_rs = 0;    // forward: rows c_rs apart; weight_grad: c[g](k, n) at g c_gs + k c_rs + n
  bool accumulate = false;       // weight_grad: c += ...
};

// Group g's rows [begin, end) from unchecked offsets: clamped to [0, m], each end at least the one
// before (a running max), as moe.h documents.
OPTIMIZED_HOST_DEVICE inline void grouped_rows(const GroupedGemmParams& p, int64_t g, int64_t* begin, int64_t* end) {
  int64_t prev = 0, cur = 0;
  for (int64_t i = 0; i <= g; ++i) {
    prev = cur;
    int64_t o = p.offs[i];
    o = o < 0 ? 0 : (o > p.m ? p.m : o);
    cur = o > prev ? o : prev;
  }
  *begin = prev;
  *end = cur;
}

constexpr int kMoeMaxGroups = 64;
constexpr int kMoeMaxK = 32;

namespace moe_detail {

OPTIMIZED_HOST_DEVICE inline float load_logit(const MoeRouteParams& p, int64_t t, int64_t e) {
  const int64_t i = t * p.ld + e;
#if defined(__CUDACC__)
  switch (p.dtype) {
    case DType::kF16: return __half2float(static_cast<const __half*>(p.logits)[i]);
    case DType::kBF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p.logits)[i]);
    default: return static_cast<const float*>(p.logits)[i];
  }
#else
  switch (p.dtype) {
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(p.logits)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p.logits)[i]);
    default: return static_cast<const float*>(p.logits)[i];
  }
#endif
}

OPTIMIZED_HOST_DEVICE inline bool is_nan(float x) { return x != x; }

// a ranks above b (NaN below every number; equal values: neither, so the earlier index stays).
OPTIMIZED_HOST_DEVICE inline bool ranks_above(float a, float b) {
  if (is_nan(a)) return false;
  if (is_nan(b)) return true;
  return a > b;
}

}  // namespace moe_detail

// Routes token t (moe.h's rule).
OPTIMIZED_HOST_DEVICE inline void moe_route_token(const MoeRouteParams& p, int64_t t) {
  using namespace moe_detail;
  const int64_t E = p.experts;
  // softmax statistics: the max of the numbers, the sum of exp; a NaN logit makes both NaN
  float m = -INFINITY;
  bool nan = false;
  for (int64_t e = 0; e < E; ++e) {
    const float l = load_logit(p, t, e);
    if (is_nan(l)) nan = true;
    else if (l > m) m = l;
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += expf(load_logit(p, t, e) - m);
  if (nan) sum = NAN;
  if (p.lse) p.lse[t] = nan ? NAN : m + logf(sum);
  const bool softmax = p.scoring == 0;
  // The score (the weight before normalize) and the choice score of expert e.
  const auto score = [&](int64_t e) -> float {
    const float l = load_logit(p, t, e);
    if (softmax) return expf(l - m) / sum;
    return 1.0f / (1.0f + expf(-l));
  };
  const auto choice = [&](int64_t e) -> float {
    // softmax without a bias chooses on the logits (the same order as the probabilities, and a NaN
    // logit then ranks only itself last); topk_softmax always does
    if (softmax && (p.topk_softmax || !p.bias)) return load_logit(p, t, e) + (p.bias ? p.bias[e] : 0.0f);
    return score(e) + (p.bias ? p.bias[e] : 0.0f);
  };
  // group-limited routing: the groups allowed (a bit each)
  uint64_t allowed = ~uint64_t(0);
  const int64_t gsize = E / p.n_groups;
  if (p.n_groups > 1) {
    float gscore[kMoeMaxGroups];
    for (int g = 0; g < p.n_groups; ++g) {
      float b1 = NAN, b2 = NAN;  // the group's two best choice scores
      for (int64_t e = g * gsize; e < (g + 1) * gsize; ++e) {
        const float c = choice(e);
        if (ranks_above(c, b1)) b2 = b1, b1 = c;
        else if (ranks_above(c, b2)) b2 = c;
      }
      gscore[g] = gsize == 1 ? b1 : b1 + b2;
    }
    allowed = 0;
    for (int j = 0; j < p.topk_groups; ++j) {
      int best = -1;
      for (int g = 0; g < p.n_groups; ++g)
        if (!(allowed >> g & 1) && (best < 0 || ranks_above(gscore[g], gscore[best]))) best = g;
      allowed |= uint64_t(1) << best;
    }
  }
  // top-k, best first
  int32_t* ids = p.ids + t * p.k;
  float* w = p.weights + t * p.k;
  for (int j = 0; j < p.k; ++j) {
    int64_t best = -1;
    float best_c = NAN;
    for (int64_t e = 0; e < E; ++e) {
      if (p.n_groups > 1 && !(allowed >> (e / gsize) & 1)) continue;
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (taken) continue;
      const float c = choice(e);
      if (best < 0 || ranks_above(c, best_c)) best = e, best_c = c;
    }
    ids[j] = static_cast<int32_t>(best);
  }
  // weights
  float total = 0.0f;
  if (softmax && p.topk_softmax) {
    float mk = -INFINITY;
    for (int j = 0; j < p.k; ++j) {
      const float l = load_logit(p, t, ids[j]);
      if (l > mk) mk = l;
    }
    float s = 0.0f;
    for (int j = 0; j < p.k; ++j) s += expf(load_logit(p, t, ids[j]) - mk);
    for (int j = 0; j < p.k; ++j) w[j] = nan ? NAN : expf(load_logit(p, t, ids[j]) - mk) / s;
  } else {
    for (int j = 0; j < p.k; ++j) w[j] = score(ids[j]);
  }
  for (int j = 0; j < p.k; ++j) total += w[j];
  for (int j = 0; j < p.k; ++j) w[j] = (p.normalize ? w[j] / total : w[j]) * p.routed_scale;
}

}  // namespace optimized
