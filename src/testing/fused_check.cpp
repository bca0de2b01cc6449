// The fused family's check (see fused_check.h).
#include "testing/fused_check.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "optimized/buffer.h"
#include "testing/tolerance.h"

namespace optimized::testing {

std::string_view fused_output_name(FusedOutput o) {
  switch (o) {
    case FusedOutput::kY: return "y";
    case FusedOutput::kResidualOut: return "residual_out";
    case FusedOutput::kMean: return "mean";
    case FusedOutput::kRstd: return "rstd";
    case FusedOutput::kDx: return "dx";
    case FusedOutput::kDweight: return "dweight";
    case FusedOutput::kDbias: return "dbias";
  }
  return "?";
}

std::vector<double>& field(FusedReference& r, FusedOutput o) {
  switch (o) {
    case FusedOutput::kY: return r.y;
    case FusedOutput::kResidualOut: return r.residual_out;
    case FusedOutput::kMean: return r.mean;
    case FusedOutput::kRstd: return r.rstd;
    case FusedOutput::kDx: return r.dx;
    case FusedOutput::kDweight: return r.dweight;
    case FusedOutput::kDbias: return r.dbias;
  }
  return r.y;
}

const std::vector<double>& field(const FusedReference& r, FusedOutput o) {
  return field(const_cast<FusedReference&>(r), o);
}

bool is_row_output(FusedOutput o) {
  return o == FusedOutput::kY || o == FusedOutput::kResidualOut || o == FusedOutput::kDx;
}

int64_t output_cols(const FusedParams& p, FusedOutput o) {
  if (o == FusedOutput::kDx && p.op == FusedOp::kSiluAndMul) return 2 * p.width;
  if (o == FusedOutput::kMean || o == FusedOutput::kRstd) return p.rows;
  return p.width;
}

ReductionRule fused_rule(const FusedParams& p, FusedOutput o) {
  ReductionRule rule;
  const bool stats = o == FusedOutput::kMean || o == FusedOutput::kRstd;
  rule.out = stats && p.dtype != DType::kF64 ? DType::kF32 : p.dtype;  // fp64 data: fp64 statistics
  if (o == FusedOutput::kDweight || o == FusedOutput::kDbias) rule.n = p.rows;
  else if (p.has_row_reduction() && o != FusedOutput::kResidualOut) rule.n = p.width;
  else rule.n = 1;
  // The norms' backward reads fp32 statistics for fp32 / fp16 / bf16 data (fp64 ones for fp64).
  rule.u_acc = p.backward && p.is_norm() && p.dtype != DType::kF64 ? std::ldexp(1.0, -24) : accumulation_unit(p.dtype);
  return rule;
}

namespace {

double load(const void* data, DType dtype, int64_t index) { return load_as_double(data, dtype, index); }
double fin(double v) { return std::isfinite(v) ? std::fabs(v) : 0.0; }

// The magnitude of what gelu(h) = 0.5 h (1 + s) adds up (s = erf(h / sqrt 2), or the tanh form's
// tanh), and of what gelu'(h) adds up: where 1 + s cancels (h < 0) the fp32 rounding of s is
// relative to these, not to the tiny result.
double gelu_terms(double h, bool tanh_form) {
  const double s = tanh_form ? std::tanh(kGeluSqrt2OverPi * (h + kGeluCubic * h * h * h)) : std::erf(h * kGeluSqrtHalf);
  return 0.5 * std::fabs(h) * (1 + std::fabs(s));
}
double gelu_grad_terms(double h, bool tanh_form) {
  if (tanh_form) {
    const double t = std::tanh(kGeluSqrt2OverPi * (h + kGeluCubic * h * h * h));
    return 0.5 * (1 + std::fabs(t)) + 0.5 * std::fabs(h) * (1 - t * t) * kGeluSqrt2OverPi * (1 + 3 * kGeluCubic * h * h);
  }
  return 0.5 * (1 + std::fabs(std::erf(h * kGeluSqrtHalf))) + std::fabs(h) * kGeluInvSqrt2Pi * std::exp(-0.5 * h * h);
}

// The terms of fused_check.h, from the float64 reference's statistics.
FusedReference terms_of(const FusedParams& p, const FusedReference& ref) {
  FusedReference t;
  const int64_t R = p.rows, W = p.width;
  if (p.is_softmax() && p.backward) {
    t.dx.resize(static_cast<size_t>(R));
    const double sc = std::fabs(p.scale);
    for (int64_t r = 0; r < R; ++r) {
      double max_y = 0, max_ey = 0, max_dy = 0, sum_dy = 0;
      for (int64_t j = 0; j < W; ++j) {
        const double y = load(p.x, p.dtype, r * p.ld_x + j), dy = fin(load(p.dy, p.dtype, r * p.ld_dy + j));
        max_y = std::max(max_y, fin(y));
        max_ey = std::max(max_ey, fin(std::exp(y)));
        max_dy = std::max(max_dy, dy);
        sum_dy += dy;
      }
      t.dx[static_cast<size_t>(r)] =
          p.op == FusedOp::kLogSoftmax ? sc * (max_dy + max_ey * sum_dy) : 2 * sc * max_y * max_dy;
    }
  } else if (p.op == FusedOp::kBiasGelu) {
    // gelu_terms / gelu_grad_terms (times |dy|) per element; a row's largest; dbias: their sum.
    const bool tanh_form = p.gelu == GeluApproximation::kTanh;
    auto h_at = [&](int64_t r, int64_t j) {
      return load(p.x, p.dtype, r * p.ld_x + j) + (p.bias ? load(p.bias, p.dtype, j) : 0.0);
    };
    std::vector<double>& unit = p.backward ? t.dx : t.y;
    unit.resize(static_cast<size_t>(R));
    if (p.backward) t.dbias.assign(static_cast<size_t>(W), 0.0);  // whether or not this call asks for dbias
    for (int64_t r = 0; r < R; ++r) {
      double m = 0;
      for (int64_t j = 0; j < W; ++j) {
        const double h = h_at(r, j);
        if (!std::isfinite(h)) continue;
        const double term = p.backward ? gelu_grad_terms(h, tanh_form) * fin(load(p.dy, p.dtype, r * p.ld_dy + j))
                                       : gelu_terms(h, tanh_form);
        m = std::max(m, term);
        if (p.backward) t.dbias[static_cast<size_t>(j)] += term;
      }
      unit[static_cast<size_t>(r)] = m;
    }
  } else if (p.is_norm()) {
    const bool layer = p.is_layer_norm();
    auto h_at = [&](int64_t r, int64_t j) {
      if (p.backward) return load(p.x, p.dtype, r * p.ld_x + j);
      double h = load(p.x, p.dtype, r * p.ld_x + j);
      if (p.is_add_form()) h += load(p.residual, p.dtype, r * p.ld_residual + j);
      return h;
    };
    if (!p.backward && layer) {
      double max_w = p.weight ? 0.0 : 1.0;
      for (int64_t j = 0; p.weight && j < W; ++j) max_w = std::max(max_w, fin(load(p.weight, p.dtype, j)));
      t.mean.resize(static_cast<size_t>(R));
      t.y.resize(static_cast<size_t>(R));
      for (int64_t r = 0; r < R; ++r) {
        double s = 0;
        for (int64_t j = 0; j < W; ++j) s += fin(h_at(r, j));
        const double mean_abs = W > 0 ? s / static_cast<double>(W) : 0.0;
        t.mean[static_cast<size_t>(r)] = mean_abs;
        t.y[static_cast<size_t>(r)] = mean_abs * fin(ref.rstd[static_cast<size_t>(r)]) * max_w;
      }
    }
    if (p.backward) {
      t.dx.resize(static_cast<size_t>(R));
      t.dweight.assign(static_cast<size_t>(W), 0.0);
      for (int64_t r = 0; r < R; ++r) {
        const double rstd = fin(ref.rstd[static_cast<size_t>(r)]);
        const double mean = layer ? ref.mean[static_cast<size_t>(r)] : 0.0;
        double max_g = 0, max_dres = 0;
        for (int64_t j = 0; j < W; ++j) {
          const double dy = fin(load(p.dy, p.dtype, r * p.ld_dy + j));
          const double w = p.weight ? fin(load(p.weight, p.dtype, j)) : 1.0;
          max_g = std::max(max_g, dy * w);
          if (p.dresidual_out) max_dres = std::max(max_dres, fin(load(p.dresidual_out, p.dtype, r * p.ld_dresidual_out + j)));
          t.dweight[static_cast<size_t>(j)] += 3 * dy * fin((h_at(r, j) - mean) * rstd);
        }
        t.dx[static_cast<size_t>(r)] = 3 * rstd * max_g + max_dres;
      }
    }
  }
  return t;
}

}  // namespace

FusedExpected fused_expected(const FusedParams& p) {
  FusedExpected e;
  e.ref = fused_reference_f64(p);
  e.same = fused_reference_same_dtype(p);
  e.terms = terms_of(p, e.ref);
  return e;
}

void add_parameter_gradients(FusedExpected& total, const FusedExpected& chunk) {
  for (FusedOutput o : {FusedOutput::kDweight, FusedOutput::kDbias})
    for (auto member : {&FusedExpected::ref, &FusedExpected::same, &FusedExpected::terms}) {
      const std::vector<double>& from = field(chunk.*member, o);
      std::vector<double>& into = field(total.*member, o);
      if (from.empty()) continue;
      if (into.empty()) into.assign(from.size(), 0.0);
      for (size_t j = 0; j < from.size(); ++j) into[j] += from[j];
    }
}

CheckResult check_fused_output(const FusedParams& p, const FusedExpected& e, FusedOutput o,
                               const std::vector<double>& got, int64_t first_row) {
  const std::vector<double>& ref = field(e.ref, o);
  const std::vector<double>& same = field(e.same, o);
  const std::vector<double>& terms = field(e.terms, o);
  const std::string name(fused_output_name(o));
  CheckResult r;
  if (got.size() != ref.size() || same.size() != ref.size()) {
    r.failures = 1;
    r.first_failure = name + ": " + std::to_string(got.size()) + " values to check against a reference of " +
                      std::to_string(ref.size()) + " (same-dtype: " + std::to_string(same.size()) + ")";
    return r;
  }
  const ReductionRule rule = fused_rule(p, o);
  if (is_row_output(o)) {
    const int64_t cols = output_cols(p, o);
    const int64_t rows = cols > 0 ? static_cast<int64_t>(ref.size()) / cols : 0;
    for (int64_t i = 0; i < rows; ++i) {
      const size_t at = static_cast<size_t>(i * cols);
      const double t = terms.empty() ? 0.0 : terms[static_cast<size_t>(i)];
      check_reduction_unit(rule, &got[at], &ref[at], &same[at], cols, t,
                           [&](int64_t j) {
                             return name + "[" + std::to_string(first_row + i) + ", " + std::to_string(j) + "]";
                           },
                           r);
    }
  } else if (o == FusedOutput::kMean || o == FusedOutput::kRstd) {  // one unit per row's statistic
    for (size_t i = 0; i < ref.size(); ++i)
      check_reduction_unit(rule, &got[i], &ref[i], &same[i], 1, terms.empty() ? 0.0 : terms[i],
                           [&](int64_t) { return name + "[" + std::to_string(first_row + static_cast<int64_t>(i)) + "]"; },
                           r);
  } else {
    double t = 0;
    for (double v : terms) t = std::max(t, v);
    check_reduction_unit(rule, got.data(), ref.data(), same.data(), static_cast<int64_t>(ref.size()), t,
                         [&](int64_t j) { return name + "[" + std::to_string(j) + "]"; }, r);
  }
  if (r.checked == 0) r.passed = true;  // zero rows: nothing to hold against the reference
  return r;
}

}  // namespace optimized::testing
