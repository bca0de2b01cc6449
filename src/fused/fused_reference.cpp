// The float64 reference of the fused family (see fused_reference.h): one plain loop per op over
// the rows, every operand widened to double, the formulas of optimized/fused.h written out as
// torch evaluates them. Slow and obvious on purpose; it is never timed.
#include "fused/fused_reference.h"

#include <cmath>
#include <cstddef>
#include <vector>

#include "optimized/buffer.h"

namespace optimized {
namespace {

constexpr double kSqrtHalf = 0.70710678118654752440;     // 1 / sqrt(2)
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi)
constexpr double kGeluCubic = 0.044715;

// Row r of a (rows, n) operand whose rows are ld elements apart, widened to double.
void load_row(const void* data, DType dtype, int64_t ld, int64_t r, int64_t n, std::vector<double>& out) {
  out.resize(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) out[static_cast<size_t>(j)] = load_as_double(data, dtype, r * ld + j);
}

// A (width) operand, or `fill` everywhere when absent.
std::vector<double> load_vector(const void* data, DType dtype, int64_t n, double fill) {
  std::vector<double> v(static_cast<size_t>(n), fill);
  if (data)
    for (int64_t j = 0; j < n; ++j) v[static_cast<size_t>(j)] = load_as_double(data, dtype, j);
  return v;
}

// max that propagates NaN (as torch's reduction does): once NaN, always NaN.
double nan_max(const std::vector<double>& v) {
  double m = -INFINITY;
  for (double e : v)
    if (std::isnan(e) || e > m) {
      m = e;
      if (std::isnan(e)) break;
    }
  return m;
}

double sum(const std::vector<double>& v) {
  double s = 0;
  for (double e : v) s += e;
  return s;
}

double gelu(double z, GeluApproximation a) {
  if (a == GeluApproximation::kTanh) {
    return 0.5 * z * (1.0 + std::tanh(kSqrt2OverPi * (z + kGeluCubic * z * z * z)));
  }
  return 0.5 * z * (1.0 + std::erf(z * kSqrtHalf));
}

double gelu_grad(double z, GeluApproximation a) {
  if (a == GeluApproximation::kTanh) {
    const double t = std::tanh(kSqrt2OverPi * (z + kGeluCubic * z * z * z));
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kGeluCubic * z * z);
  }
  return 0.5 * (1.0 + std::erf(z * kSqrtHalf)) + z * kInvSqrt2Pi * std::exp(-0.5 * z * z);
}

void softmax_forward(const FusedParams& p, FusedReference& out) {
  const int64_t n = p.width;
  const bool log = p.op == FusedOp::kLogSoftmax;
  out.y.resize(static_cast<size_t>(p.rows * n));
  std::vector<double> s;
  for (int64_t r = 0; r < p.rows; ++r) {
    load_row(p.x, p.dtype, p.ld_x, r, n, s);
    for (double& e : s) e *= static_cast<double>(p.scale);
    const double m = nan_max(s);
    double total = 0;
    for (double e : s) total += std::exp(e - m);  // a row of only -inf: -inf - -inf = NaN, as torch
    double* y = &out.y[static_cast<size_t>(r * n)];
    const double lse = std::log(total);
    for (int64_t j = 0; j < n; ++j) y[j] = log ? (s[j] - m) - lse : std::exp(s[j] - m) / total;
  }
}

void softmax_backward(const FusedParams& p, FusedReference& out) {
  const int64_t n = p.width;
  const bool log = p.op == FusedOp::kLogSoftmax;
  const double scale = p.scale;
  out.dx.resize(static_cast<size_t>(p.rows * n));
  std::vector<double> y, dy;
  for (int64_t r = 0; r < p.rows; ++r) {
    load_row(p.x, p.dtype, p.ld_x, r, n, y);  // the forward output
    load_row(p.dy, p.dtype, p.ld_dy, r, n, dy);
    double* dx = &out.dx[static_cast<size_t>(r * n)];
    if (log) {
      const double sdy = sum(dy);
      for (int64_t j = 0; j < n; ++j) dx[j] = scale * (dy[j] - std::exp(y[j]) * sdy);
    } else {
      double dot = 0;
      for (int64_t j = 0; j < n; ++j) dot += dy[j] * y[j];
      for (int64_t j = 0; j < n; ++j) dx[j] = scale * y[j] * (dy[j] - dot);
    }
  }
}

// The statistics of one row h: mean (layer_norm forms; 0 for rms_norm) and rstd.
void row_stats(const FusedParams& p, const std::vector<double>& h, double& mean, double& rstd) {
  const double n = static_cast<double>(h.size());
  const double eps = p.eps;
  if (p.is_layer_norm()) {
    mean = sum(h) / n;
    double var = 0;
    for (double e : h) var += (e - mean) * (e - mean);
    rstd = 1.0 / std::sqrt(var / n + eps);  // biased variance, as torch
  } else {
    mean = 0;
    double ms = 0;
    for (double e : h) ms += e * e;
    rstd = 1.0 / std::sqrt(ms / n + eps);
  }
}

void norm_forward(const FusedParams& p, FusedReference& out) {
  const int64_t n = p.width;
  const size_t total = static_cast<size_t>(p.rows * n);
  out.y.resize(total);
  if (p.is_add_form()) out.residual_out.resize(total);
  if (p.is_layer_norm()) out.mean.resize(static_cast<size_t>(p.rows));
  out.rstd.resize(static_cast<size_t>(p.rows));
  const std::vector<double> w = load_vector(p.weight, p.dtype, n, 1.0);
  const std::vector<double> b = load_vector(p.is_layer_norm() ? p.bias : nullptr, p.dtype, n, 0.0);
  std::vector<double> h, res;
  for (int64_t r = 0; r < p.rows; ++r) {
    load_row(p.x, p.dtype, p.ld_x, r, n, h);
    if (p.is_add_form()) {
      load_row(p.residual, p.dtype, p.ld_residual, r, n, res);
      for (int64_t j = 0; j < n; ++j) h[j] += res[j];  // in double: no rounding to the dtype
      for (int64_t j = 0; j < n; ++j) out.residual_out[static_cast<size_t>(r * n + j)] = h[j];
    }
    double mean = 0, rstd = 0;
    row_stats(p, h, mean, rstd);
    if (p.is_layer_norm()) out.mean[static_cast<size_t>(r)] = mean;
    out.rstd[static_cast<size_t>(r)] = rstd;
    double* y = &out.y[static_cast<size_t>(r * n)];
    for (int64_t j = 0; j < n; ++j) y[j] = (h[j] - mean) * rstd * w[j] + b[j];
  }
}

void norm_backward(const FusedParams& p, FusedReference& out) {
  const int64_t n = p.width;
  const double dn = static_cast<double>(n);
  out.dx.resize(static_cast<size_t>(p.rows * n));
  out.dweight.assign(static_cast<size_t>(n), 0.0);
  if (p.is_layer_norm()) out.dbias.assign(static_cast<size_t>(n), 0.0);
  if (p.is_layer_norm()) out.mean.resize(static_cast<size_t>(p.rows));
  out.rstd.resize(static_cast<size_t>(p.rows));
  const std::vector<double> w = load_vector(p.weight, p.dtype, n, 1.0);
  std::vector<double> h, dy, dres, xhat(static_cast<size_t>(n)), g(static_cast<size_t>(n));
  for (int64_t r = 0; r < p.rows; ++r) {
    load_row(p.x, p.dtype, p.ld_x, r, n, h);
    load_row(p.dy, p.dtype, p.ld_dy, r, n, dy);
    double mean = 0, rstd = 0;
    row_stats(p, h, mean, rstd);  // recomputed in double; p.mean / p.rstd are not read
    if (p.is_layer_norm()) out.mean[static_cast<size_t>(r)] = mean;
    out.rstd[static_cast<size_t>(r)] = rstd;
    double mean_g = 0, mean_gx = 0;
    for (int64_t j = 0; j < n; ++j) {
      xhat[j] = (h[j] - mean) * rstd;
      g[j] = dy[j] * w[j];
      mean_g += g[j];
      mean_gx += g[j] * xhat[j];
    }
    mean_g /= dn;
    mean_gx /= dn;
    if (!p.is_layer_norm()) mean_g = 0;  // rms_norm subtracts no mean
    if (p.dresidual_out) load_row(p.dresidual_out, p.dtype, p.ld_dresidual_out, r, n, dres);
    double* dx = &out.dx[static_cast<size_t>(r * n)];
    for (int64_t j = 0; j < n; ++j) {
      dx[j] = rstd * (g[j] - mean_g - xhat[j] * mean_gx);
      if (p.dresidual_out) dx[j] += dres[j];
      out.dweight[j] += dy[j] * xhat[j];
      if (p.is_layer_norm()) out.dbias[j] += dy[j];
    }
  }
}

void bias_gelu(const FusedParams& p, FusedReference& out) {
  const int64_t n = p.width;
  const std::vector<double> b = load_vector(p.bias, p.dtype, n, 0.0);
  std::vector<double> x, dy;
  std::vector<double>& dst = p.backward ? out.dx : out.y;
  dst.resize(static_cast<size_t>(p.rows * n));
  if (p.backward) out.dbias.assign(static_cast<size_t>(n), 0.0);
  for (int64_t r = 0; r < p.rows; ++r) {
    load_row(p.x, p.dtype, p.ld_x, r, n, x);
    if (p.backward) load_row(p.dy, p.dtype, p.ld_dy, r, n, dy);
    double* o = &dst[static_cast<size_t>(r * n)];
    for (int64_t j = 0; j < n; ++j) {
      const double z = x[j] + b[j];
      if (p.backward) {
        o[j] = dy[j] * gelu_grad(z, p.gelu);
        out.dbias[j] += o[j];
      } else {
        o[j] = gelu(z, p.gelu);
      }
    }
  }
}

void silu_and_mul(const FusedParams& p, FusedReference& out) {
  const int64_t d = p.width;
  std::vector<double> x, dy;
  if (p.backward)
    out.dx.resize(static_cast<size_t>(p.rows * 2 * d));
  else
    out.y.resize(static_cast<size_t>(p.rows * d));
  for (int64_t r = 0; r < p.rows; ++r) {
    load_row(p.x, p.dtype, p.ld_x, r, 2 * d, x);
    if (p.backward) load_row(p.dy, p.dtype, p.ld_dy, r, d, dy);
    for (int64_t j = 0; j < d; ++j) {
      const double a = x[j], b = x[d + j];
      const double s = 1.0 / (1.0 + std::exp(-a));
      const double silu = a / (1.0 + std::exp(-a));  // torch's form
      if (p.backward) {
        double* dx = &out.dx[static_cast<size_t>(r * 2 * d)];
        dx[j] = dy[j] * b * s * (1.0 + a * (1.0 - s));
        dx[d + j] = dy[j] * silu;
      } else {
        out.y[static_cast<size_t>(r * d + j)] = silu * b;
      }
    }
  }
}

}  // namespace

FusedReference fused_reference_f64(const FusedParams& p) {
  FusedReference out;
  switch (p.op) {
    case FusedOp::kSoftmax:
    case FusedOp::kLogSoftmax:
      p.backward ? softmax_backward(p, out) : softmax_forward(p, out);
      break;
    case FusedOp::kLayerNorm:
    case FusedOp::kRmsNorm:
    case FusedOp::kAddLayerNorm:
    case FusedOp::kAddRmsNorm:
      p.backward ? norm_backward(p, out) : norm_forward(p, out);
      break;
    case FusedOp::kBiasGelu: bias_gelu(p, out); break;
    case FusedOp::kSiluAndMul: silu_and_mul(p, out); break;
  }
  return out;
}

}  // namespace optimized
