// The attention family's check (see attention_check.h).
#include "testing/attention_check.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "optimized/buffer.h"
#include "testing/tolerance.h"

namespace optimized::testing {

std::string_view attention_output_name(AttentionOutput o) {
  switch (o) {
    case AttentionOutput::kOut: return "out";
    case AttentionOutput::kLse: return "lse";
    case AttentionOutput::kDq: return "dq";
    case AttentionOutput::kDk: return "dk";
    case AttentionOutput::kDv: return "dv";
  }
  return "?";
}

std::vector<double>& field(AttentionReference& r, AttentionOutput o) {
  switch (o) {
    case AttentionOutput::kOut: return r.out;
    case AttentionOutput::kLse: return r.lse;
    case AttentionOutput::kDq: return r.dq;
    case AttentionOutput::kDk: return r.dk;
    case AttentionOutput::kDv: return r.dv;
  }
  return r.out;
}

const std::vector<double>& field(const AttentionReference& r, AttentionOutput o) {
  return field(const_cast<AttentionReference&>(r), o);
}

std::vector<AttentionOutput> attention_outputs(const AttentionParams& p) {
  if (p.backward) return {AttentionOutput::kDq, AttentionOutput::kDk, AttentionOutput::kDv};
  if (p.lse) return {AttentionOutput::kOut, AttentionOutput::kLse};
  return {AttentionOutput::kOut};
}

ReductionRule attention_rule(const AttentionParams& p, AttentionOutput o) {
  ReductionRule rule;
  const bool lse = o == AttentionOutput::kLse;
  rule.out = lse ? (p.dtype == DType::kF64 ? DType::kF64 : DType::kF32) : p.dtype;
  const bool kv = o == AttentionOutput::kDk || o == AttentionOutput::kDv;
  rule.n = std::max<int64_t>(1, kv ? p.seqlen_q * p.group() : p.seqlen_k);
  rule.u_acc = accumulation_unit(p.dtype);
  return rule;
}

AttentionExpected attention_expected(const AttentionParams& p) {
  AttentionExpected e;
  e.ref = attention_reference_f64(p, &e.terms);
  e.same = attention_reference_same_dtype(p);
  return e;
}

namespace {

bool on_k(AttentionOutput o) { return o == AttentionOutput::kDk || o == AttentionOutput::kDv; }

// The tensor, strides and head count of a row output.
struct RowOutput {
  const void* base = nullptr;
  AttentionStrides s;
  int64_t heads = 0;
};
RowOutput row_output(const AttentionParams& p, AttentionOutput o) {
  switch (o) {
    case AttentionOutput::kOut: return {p.out, p.out_s, p.heads_q};
    case AttentionOutput::kDq: return {p.dq, p.dq_s, p.heads_q};
    case AttentionOutput::kDk: return {p.dk, p.dk_s, p.heads_kv};
    case AttentionOutput::kDv: return {p.dv, p.dv_s, p.heads_kv};
    default: return {};
  }
}

// "out[b=1, i=6, h=0" (fixed) or "out[row=13, h=0" (varlen) of unit u (row * heads + head).
std::string unit_name(const AttentionParams& p, AttentionOutput o, int64_t u) {
  const bool k = on_k(o);
  const int64_t heads = k ? p.heads_kv : p.heads_q, r = u / heads, h = u % heads;
  std::string s = std::string(attention_output_name(o)) + "[";
  if (p.varlen()) s += "row=" + std::to_string(r);
  else {
    const int64_t len = k ? p.seqlen_k : p.seqlen_q;
    s += "b=" + std::to_string(len ? r / len : 0) + (k ? ", j=" : ", i=") + std::to_string(len ? r % len : 0);
  }
  return s + (k ? ", g=" : ", h=") + std::to_string(h);
}

}  // namespace

std::vector<double> read_attention_output(const AttentionParams& p, AttentionOutput o) {
  const bool k = on_k(o), lse = o == AttentionOutput::kLse;
  const int64_t rows = k ? attention_rows_k(p) : attention_rows_q(p), D = p.head_dim;
  const RowOutput ro = row_output(p, o);
  const int64_t heads = lse ? p.heads_q : ro.heads;
  std::vector<double> v(static_cast<size_t>(rows * heads * (lse ? 1 : D)), 0.0);
  const DType lse_dtype = p.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  for (int64_t b = 0; b < p.batch; ++b) {
    const AttentionSeq sq = attention_seq(p, b);
    const int64_t len = k ? sq.len_k : sq.len_q, start = k ? sq.start_k : sq.start_q;
    for (int64_t i = 0; i < len; ++i) {
      const int64_t r = p.varlen() ? start + i : b * (k ? p.seqlen_k : p.seqlen_q) + i;
      for (int64_t h = 0; h < heads; ++h) {
        const size_t unit = static_cast<size_t>(r * heads + h);
        if (lse) {
          v[unit] = load_as_double(p.lse, lse_dtype, b * p.lse_batch + h * p.lse_head + sq.start_q + i);
          continue;
        }
        const int64_t at = b * ro.s.batch + (start + i) * ro.s.row + h * ro.s.head;
        for (int64_t d = 0; d < D; ++d)
          v[unit * static_cast<size_t>(D) + static_cast<size_t>(d)] = load_as_double(ro.base, p.dtype, at + d);
      }
    }
  }
  return v;
}

CheckResult check_attention_output(const AttentionParams& p, const AttentionExpected& e, AttentionOutput o,
                                   const std::vector<double>& got) {
  const ReductionRule rule = attention_rule(p, o);
  const std::vector<double>& ref = field(e.ref, o);
  const std::vector<double>& same = field(e.same, o);
  const std::vector<double>& terms = field(e.terms, o);
  CheckResult result;
  if (got.size() != ref.size() || same.size() != ref.size()) {
    result.failures = 1;
    result.first_failure = std::string(attention_output_name(o)) + ": " + std::to_string(got.size()) +
                           " values, expected " + std::to_string(ref.size());
    return result;
  }
  const int64_t width = o == AttentionOutput::kLse ? 1 : p.head_dim;
  const int64_t units = width ? static_cast<int64_t>(ref.size()) / width : 0;
  for (int64_t u = 0; u < units; ++u) {
    const size_t at = static_cast<size_t>(u * width);
    const double t = static_cast<size_t>(u) < terms.size() ? terms[static_cast<size_t>(u)] : 0.0;
    check_reduction_unit(
        rule, got.data() + at, ref.data() + at, same.data() + at, width, t,
        [&](int64_t d) {
          return unit_name(p, o, u) + (o == AttentionOutput::kLse ? "]" : ", d=" + std::to_string(d) + "]");
        },
        result);
  }
  if (units == 0) result.passed = true;
  return result;
}

CheckResult check_attention(const AttentionParams& p, const AttentionExpected& e) {
  CheckResult all;
  for (AttentionOutput o : attention_outputs(p)) all.merge(check_attention_output(p, e, o, read_attention_output(p, o)));
  return all;
}

CheckResult check_attention(const AttentionParams& p) { return check_attention(p, attention_expected(p)); }

}  // namespace optimized::testing
