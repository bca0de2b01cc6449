// The attention family's check: flash-attention's rule (tolerance.h's reduction rule) applied to
// every output of a call, the one oracle of the C++ tests and of the benchmark's validation:
//
//   max |ours - ref| <= 2 * max |same - ref| + 2 * u_out * max |ref| + 16 * sqrt(n) * u_acc * scale + floor
//
// per unit, with ref the float64 reference and same the same-dtype reference of
// attention_reference.h (what torch's math path gets in the dtype), rounded to the output dtype.
// Units and n:
//   out, dq   one row of head_dim values of (row, query head), n = seqlen_k (the keys summed);
//   lse       one value per (row, query head), fp32 (fp64 for fp64), n = seqlen_k;
//   dk, dv    one row of head_dim values of (key row, kv head), n = seqlen_q * group (the query
//             rows of the whole GQA group summed).
// (varlen: seqlen_* are the max_seqlen_* of the call.) u_acc: fp32's unit, fp64's for fp64.
// The terms (scale = max(max |ref|, terms)), with E_i = 1 + max_j |s terms_ij| (|scale| sum_d
// |q_id k_jd| + |ALiBi| + |mask|: an absolute error in a score is a relative one in p):
//   out_i   E_i max_j |v_j|;   lse_i  E_i;
//   dq_i    sum_j p_ij E_i |scale| (sum_d |dout_id v_jd| + sum_d |dout_id out_id|) max |k_j|;
//   dk_j    the same sum over the group's rows i, with max |q_i|;  dv_j  sum_i p_ij E_i max |dout_i|.
// NaN must be where the reference has NaN, an infinite reference (lse -inf of a row with no visible
// key) matched exactly; a row with no visible key must hold exactly what the reference says (0)
// within the floor, so that an unwritten (poisoned) element fails.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "attention/attention_params.h"
#include "testing/attention_reference.h"
#include "testing/check.h"

namespace optimized::testing {

enum class AttentionOutput : uint8_t { kOut, kLse, kDq, kDk, kDv };

std::string_view attention_output_name(AttentionOutput o);  // "out", "lse", "dq", "dk", "dv"
std::vector<double>& field(AttentionReference& r, AttentionOutput o);
const std::vector<double>& field(const AttentionReference& r, AttentionOutput o);
// The outputs a call produces: forward out (and lse when p.lse is set), backward dq, dk, dv.
std::vector<AttentionOutput> attention_outputs(const AttentionParams& p);
// The rule's parameters for output o of the call p.
ReductionRule attention_rule(const AttentionParams& p, AttentionOutput o);

// Everything the check needs of one call (p: host pointers, as for attention_reference_f64).
struct AttentionExpected {
  AttentionReference ref;    // float64
  AttentionReference same;   // same-dtype, unrounded
  AttentionReference terms;  // one value per unit
};
AttentionExpected attention_expected(const AttentionParams& p);

// Output o as the call wrote it through p's HOST pointers (out, lse, dq, dk, dv), in the order of
// attention_reference.h.
std::vector<double> read_attention_output(const AttentionParams& p, AttentionOutput o);

// Output o (got: in the reference's order) against e.
CheckResult check_attention_output(const AttentionParams& p, const AttentionExpected& e, AttentionOutput o,
                                   const std::vector<double>& got);
// Every output of the call p (read through its host pointers) against e / against a fresh
// attention_expected(p). The first failure names the output and the element: "dk[b=1, j=6, g=0, d=3]"
// (varlen: "dk[row=13, g=0, d=3]").
CheckResult check_attention(const AttentionParams& p, const AttentionExpected& e);
CheckResult check_attention(const AttentionParams& p);

}  // namespace optimized::testing
