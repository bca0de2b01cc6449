// The MoE family's params: what every backend receives once the public API (moe.cpp, grouped_gemm.cpp)
// has validated the operands. Raw pointers and sizes; no tensor view, no torch.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "optimized/core.h"
#include "optimized/moe.h"

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

// The router's backward (moe.h's moe_route_backward): the scoring options that shape the gradient;
// the choice's (bias, groups) play no part.
struct MoeRouteBackwardParams {
  const void* logits = nullptr;         // (tokens, experts), rows ld apart, unit stride along experts
  DType dtype = DType::kF32;            // fp32, fp16, bf16
  int64_t tokens = 0, experts = 0, ld = 0;
  const int32_t* ids = nullptr;         // (tokens, k); ids outside [0, experts) leave their pair out
  const float* grad_weights = nullptr;  // (tokens, k) or null (zero)
  const float* grad_lse = nullptr;      // (tokens) or null (zero)
  void* grad_logits = nullptr;          // (tokens, experts), rows ld_grad apart
  DType grad_dtype = DType::kF32;       // dtype or fp32
  int64_t ld_grad = 0;
  int k = 1;
  int scoring = 0;                      // MoeScoring: 0 softmax, 1 sigmoid
  bool topk_softmax = false, normalize = false;
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
  // Forward with SwiGLU in the epilogue: b[g] (k, n) is [gate | up] (n = 2F), c (m, F) = silu(a b[g][:, :F]) *
  // (a b[g][:, F:]) in fp32 from the accumulators; pre (m, n) rows pre_rs apart, or null, gets a b[g].
  bool swiglu = false;
  void* pre = nullptr;
  int64_t pre_rs = 0;
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

// The gather of token rows into slot order (moe.h's moe_gather): xs[s] = x[sorted_pairs[s] / k], zeros
// where sorted_pairs[s] is not a pair of [0, T k).
struct MoeGatherParams {
  DType dtype = DType::kBF16;
  int64_t tokens = 0, k = 1, n = 0, slots = 0;
  const void* x = nullptr;  // (tokens, n), rows ld_x apart
  int64_t ld_x = 0;
  const int32_t* sorted_pairs = nullptr;  // (slots)
  void* xs = nullptr;       // (slots, n), rows ld_xs apart
  int64_t ld_xs = 0;
};

constexpr int kMoeMaxGroups = 64;  // group-limited routing: the allowed groups are bits of a uint64_t

}  // namespace optimized
