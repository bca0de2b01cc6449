// The references of the attention family, the yardsticks every test and the benchmark's validation
// hold the CPU rung and the CUDA kernels against (the rule: tolerance.h, applied by
// attention_check.h).
//
// Both read the host operands of an AttentionParams (fp32, fp16, bf16 or fp64 q / k / v / out /
// dout; any strides; fixed length or varlen; mask, ALiBi, window, soft-cap as the params say) and
// compute straight from the formulas of optimized/attention.h, written here again on their own
// (they call neither the CPU rung nor AttentionScore, so that a slip in either shows):
//   s_ij = scale q_i . k_j; soft-cap; minus slope |i + offset - j|; plus the additive mask;
//   hidden (-inf) outside [i + offset - window_left, i + offset + window_right] or where a bool
//   mask is false; P = softmax over the visible keys; out = P V; lse = log sum exp.
// A row with no visible key (every score -inf): out 0, lse -inf, gradients 0. A NaN score makes
// its row NaN; an infinite score makes the row NaN (inf - inf in the max-subtracted softmax).
// Backward: D_i = dout_i . out_i with out as the params GIVE it (the backward's input, as every
// rung reads it); dP = dout Vᵀ; dS = P (dP - D) (times 1 - tanh² through the soft-cap);
// dq = scale dS K; dk = scale dSᵀ Q; dv = Pᵀ dout; dk / dv summed over the GQA group. P is
// recomputed from the scores (p.lse is not read).
//
// attention_reference_f64: every value widened, double math (long double for fp64 operands, so
// that the reference stays more precise than what it judges), no rounding anywhere.
//
// attention_reference_same_dtype: what PyTorch's math path (matmul, softmax, matmul in the dtype)
// gets, emulated: dot products accumulated in the working precision (fp32; fp64 for fp64), and
// every tensor torch would materialize rounded to the dtype: S = q kᵀ scale, the soft-cap's
// S / softcap, tanh and product, the ALiBi bias and S + bias, S + mask, P = softmax(S) (computed in
// fp32 from the rounded S), and in the backward dP = dout vᵀ, dS = P (dP - sum_j P dP) (torch's
// softmax backward), the soft-cap factor and its product. The outputs themselves (out, dq, and the
// per-head dk / dv before the GQA sum is added) are NOT rounded: the check rounds them. lse: from
// the rounded S in fp32 (torch's math path has none; this is what a same-dtype S gives).
//
// Order of the outputs (the "rows" of the call: fixed length row r = b * seqlen + i, varlen
// r = cu_seqlens[b] + i, i.e. the packed (total, H, D) order):
//   out, dq   ((r * heads_q + h) * head_dim + d), r < total_q
//   lse       (r * heads_q + h)
//   dk, dv    ((r * heads_kv + g) * head_dim + d), r < total_k
// A field the call does not produce stays empty. Slow and obvious on purpose: never timed.
#pragma once

#include <cstdint>
#include <vector>

#include "attention/attention_params.h"

namespace optimized::testing {

struct AttentionReference {
  std::vector<double> out;  // forward
  std::vector<double> lse;  // forward (whether or not p.lse is given)
  std::vector<double> dq, dk, dv;  // backward
};

// Rows of q and of k the call covers: total_q / total_k (fixed length: batch * seqlen).
int64_t attention_rows_q(const AttentionParams& p);
int64_t attention_rows_k(const AttentionParams& p);

// p: as the public API hands it to a backend, with HOST pointers (out and dout read in a backward
// call; the output pointers are not touched). terms (optional): per unit (one per row of out / dq
// / dk / dv, one per lse), the magnitude of what was summed into it, for the check's noise term
// (attention_check.h says which).
AttentionReference attention_reference_f64(const AttentionParams& p, AttentionReference* terms = nullptr);
AttentionReference attention_reference_same_dtype(const AttentionParams& p);

}  // namespace optimized::testing
