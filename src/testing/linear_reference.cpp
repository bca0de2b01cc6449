// The linear family's float64 reference and checks (see linear_reference.h).
#include "testing/linear_reference.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "testing/tolerance.h"

namespace optimized::testing {

double activation_f64(Activation act, double x) {
  switch (act) {
    case Activation::kRelu: return x > 0 ? x : (x == x ? 0.0 : x);
    case Activation::kGeluErf: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case Activation::kGeluTanh:
      return 0.5 * x * (1 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case Activation::kSilu: return x / (1 + std::exp(-x));
    default: return x;
  }
}

double activation_grad_f64(Activation act, double x) {
  switch (act) {
    case Activation::kRelu: return x > 0 ? 1.0 : (x == x ? 0.0 : x);
    case Activation::kGeluErf:
      return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
    case Activation::kGeluTanh: {
      const double c = std::sqrt(2.0 / M_PI), t = std::tanh(c * (x + 0.044715 * x * x * x));
      return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
    }
    case Activation::kSilu: {
      const double s = 1 / (1 + std::exp(-x));
      return s * (1 + x * (1 - s));
    }
    default: return 1.0;
  }
}

LinearForwardF64 linear_forward_f64(const LinearProblemF64& p) {
  LinearForwardF64 r;
  const size_t mn = static_cast<size_t>(p.m * p.n);
  r.pre.assign(mn, 0), r.y.assign(mn, 0), r.magnitude.assign(mn, 0);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      double s = p.b.empty() ? 0.0 : p.b[static_cast<size_t>(j)];
      double mag = std::fabs(s);
      for (int64_t k = 0; k < p.k; ++k) {
        const double t = p.x[static_cast<size_t>(i * p.k + k)] * p.w[static_cast<size_t>(j * p.k + k)];
        s += t, mag += std::fabs(t);
      }
      const size_t o = static_cast<size_t>(i * p.n + j);
      r.pre[o] = s, r.y[o] = activation_f64(p.act, s), r.magnitude[o] = mag;
    }
  return r;
}

LinearBackwardF64 linear_backward_f64(const LinearProblemF64& p, const std::vector<double>& pre_used, bool recomputed,
                                      DType dtype, DType gi_dtype, DType gw_dtype, DType gb_dtype,
                                      const std::vector<double>& c0_w, const std::vector<double>& c0_b) {
  const bool act = p.act != Activation::kNone;
  const double u = unit_roundoff(dtype), ua = accumulation_unit(dtype);
  const size_t mn = static_cast<size_t>(p.m * p.n);
  std::vector<double> eg(mn, 0.0), g(mn, 0.0);
  std::vector<double> dpre(mn, 0.0);
  if (act && recomputed) {
    const LinearForwardF64 f = linear_forward_f64(p);
    for (size_t o = 0; o < mn; ++o)
      dpre[o] = 8.0 * std::sqrt(static_cast<double>(p.k)) * ua * f.magnitude[o] + u * std::fabs(f.pre[o]);
  }
  std::vector<double> eg_sum(mn, 0.0);  // error of the fp32 value summed into db (not rounded to dtype)
  for (size_t o = 0; o < mn; ++o) {
    const double dy = p.dy[o];
    if (!act) {
      g[o] = dy;
      continue;
    }
    const double x = pre_used[o];
    g[o] = dy * activation_grad_f64(p.act, x);
    eg_sum[o] = std::fabs(dy) * (dpre[o] + 8.0 * ua * (1 + std::fabs(x)));
    eg[o] = eg_sum[o] + u * std::fabs(g[o]);
  }
  LinearBackwardF64 r;
  r.g = g;
  r.grad_input.assign(static_cast<size_t>(p.m * p.k), 0.0);
  r.grad_input_bound.assign(r.grad_input.size(), 0.0);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t k = 0; k < p.k; ++k) {
      double s = 0, mag = 0, e = 0;
      for (int64_t j = 0; j < p.n; ++j) {
        const size_t o = static_cast<size_t>(i * p.n + j);
        const double w = p.w[static_cast<size_t>(j * p.k + k)];
        s += g[o] * w, mag += std::fabs(g[o] * w), e += eg[o] * std::fabs(w);
      }
      const size_t o = static_cast<size_t>(i * p.k + k);
      r.grad_input[o] = s;
      r.grad_input_bound[o] = unit_roundoff(gi_dtype) * std::fabs(s) + half_subnormal_step(gi_dtype) + e +
                              8.0 * std::sqrt(static_cast<double>(p.n)) * ua * mag;
    }
  r.grad_weight.assign(static_cast<size_t>(p.n * p.k), 0.0);
  r.grad_weight_bound.assign(r.grad_weight.size(), 0.0);
  for (int64_t j = 0; j < p.n; ++j)
    for (int64_t k = 0; k < p.k; ++k) {
      const size_t o = static_cast<size_t>(j * p.k + k);
      const double c0 = c0_w.empty() ? 0.0 : c0_w[o];
      double s = c0, mag = std::fabs(c0), e = 0;
      for (int64_t i = 0; i < p.m; ++i) {
        const size_t gi = static_cast<size_t>(i * p.n + j);
        const double x = p.x[static_cast<size_t>(i * p.k + k)];
        s += g[gi] * x, mag += std::fabs(g[gi] * x), e += eg[gi] * std::fabs(x);
      }
      r.grad_weight[o] = s;
      r.grad_weight_bound[o] = unit_roundoff(gw_dtype) * std::fabs(s) + half_subnormal_step(gw_dtype) + e +
                               8.0 * std::sqrt(static_cast<double>(std::max<int64_t>(p.m, 1))) * ua * mag;
    }
  r.grad_bias.assign(static_cast<size_t>(p.n), 0.0);
  r.grad_bias_bound.assign(r.grad_bias.size(), 0.0);
  for (int64_t j = 0; j < p.n; ++j) {
    const double c0 = c0_b.empty() ? 0.0 : c0_b[static_cast<size_t>(j)];
    double s = c0, mag = std::fabs(c0), e = 0;
    for (int64_t i = 0; i < p.m; ++i) {
      const size_t o = static_cast<size_t>(i * p.n + j);
      s += g[o], mag += std::fabs(g[o]), e += eg_sum[o];
    }
    r.grad_bias[static_cast<size_t>(j)] = s;
    r.grad_bias_bound[static_cast<size_t>(j)] = unit_roundoff(gb_dtype) * std::fabs(s) + half_subnormal_step(gb_dtype) +
                                                e + static_cast<double>(p.m + 1) * ua * mag;
  }
  return r;
}

namespace {

void check_elements(const char* name, const std::vector<double>& got, const std::vector<double>& ref,
                    const std::vector<double>& bound, int64_t cols, CheckResult& r) {
  double max_err = 0, max_ref = 0;
  for (size_t o = 0; o < ref.size(); ++o) {
    double ratio = 0;
    const bool ok = element_ok(got[o], ref[o], bound[o], &ratio);
    ++r.checked;
    r.worst_ratio = std::max(r.worst_ratio, ratio);
    if (std::isfinite(ref[o]) && std::isfinite(got[o])) {
      max_err = std::max(max_err, std::fabs(got[o] - ref[o]));
      max_ref = std::max(max_ref, std::fabs(ref[o]));
    }
    if (!ok && r.failures++ == 0) {
      std::ostringstream s;
      s.precision(9);
      const int64_t i = static_cast<int64_t>(o) / std::max<int64_t>(cols, 1), j = static_cast<int64_t>(o) % std::max<int64_t>(cols, 1);
      s << name << "[" << i << ", " << j << "] = " << got[o] << ", expected " << ref[o] << " (error "
        << std::fabs(got[o] - ref[o]) << ", allowed " << bound[o] << ")";
      r.first_failure = s.str();
    }
  }
  r.max_rel_error = std::max(r.max_rel_error, max_ref > 0 ? max_err / max_ref : max_err);
  r.passed = r.failures == 0;
}

}  // namespace

CheckResult check_linear_forward(const LinearProblemF64& p, DType dtype, const std::vector<double>& y_got,
                                 const std::vector<double>* pre_got) {
  const LinearForwardF64 f = linear_forward_f64(p);
  const double ua = accumulation_unit(dtype), u = unit_roundoff(dtype), floor = half_subnormal_step(dtype);
  std::vector<double> y_bound(f.y.size()), pre_bound(f.y.size());
  for (size_t o = 0; o < f.y.size(); ++o) {
    const double e_acc = 8.0 * std::sqrt(static_cast<double>(p.k)) * ua * f.magnitude[o];
    pre_bound[o] = gemm_allowed_error(dtype, p.k, f.pre[o], f.magnitude[o]);
    y_bound[o] = 1.2 * e_acc + u * std::fabs(f.y[o]) + floor + 8.0 * ua * (std::fabs(f.pre[o]) + std::fabs(f.y[o]));
  }
  CheckResult r;
  check_elements("y", y_got, f.y, y_bound, p.n, r);
  if (pre_got) check_elements("pre", *pre_got, f.pre, pre_bound, p.n, r);
  return r;
}

CheckResult check_linear_gradient(const char* name, const std::vector<double>& got, const std::vector<double>& ref,
                                  const std::vector<double>& bound, int64_t cols) {
  CheckResult r;
  check_elements(name, got, ref, bound, cols, r);
  return r;
}

}  // namespace optimized::testing
