// The references of the fused family (see fused_reference.h): one plain loop per op over the rows,
// the formulas of optimized/fused.h written out as torch evaluates them, in a math type T: double
// for the float64 reference (long double for fp64 operands), the dtype's working precision for the
// same-dtype one.
#include "testing/fused_reference.h"

#include <cmath>
#include <cstddef>
#include <vector>

#include "optimized/buffer.h"
#include "testing/tolerance.h"

namespace optimized::testing {
namespace {

// How the references differ: the math type is the template parameter, the rest is here.
struct Mode {
  bool same_dtype = false;  // h rounded to the dtype; the norms' backward reads the saved statistics
};

template <typename T>
class Reference {
 public:
  Reference(const FusedParams& p, Mode mode) : p_(p), mode_(mode) {}

  FusedReference run() {
    switch (p_.op) {
      case FusedOp::kSoftmax:
      case FusedOp::kLogSoftmax: p_.backward ? softmax_backward() : softmax_forward(); break;
      case FusedOp::kLayerNorm:
      case FusedOp::kRmsNorm:
      case FusedOp::kAddLayerNorm:
      case FusedOp::kAddRmsNorm: p_.backward ? norm_backward() : norm_forward(); break;
      case FusedOp::kBiasGelu: bias_gelu(); break;
      case FusedOp::kSiluAndMul: silu_and_mul(); break;
    }
    return std::move(out_);
  }

 private:
  static constexpr T kSqrtHalf = T(kGeluSqrtHalf);
  static constexpr T kSqrt2OverPi = T(kGeluSqrt2OverPi);
  static constexpr T kInvSqrt2Pi = T(kGeluInvSqrt2Pi);
  static constexpr T kCubic = T(kGeluCubic);

  // Row r of a (rows, n) operand whose rows are ld elements apart.
  void load_row(const void* data, int64_t ld, int64_t r, int64_t n, std::vector<T>& v) const {
    v.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) v[static_cast<size_t>(j)] = static_cast<T>(load_as_double(data, p_.dtype, r * ld + j));
  }

  // A (width) operand, or `fill` everywhere when absent.
  std::vector<T> load_vector(const void* data, int64_t n, T fill) const {
    std::vector<T> v(static_cast<size_t>(n), fill);
    if (data)
      for (int64_t j = 0; j < n; ++j) v[static_cast<size_t>(j)] = static_cast<T>(load_as_double(data, p_.dtype, j));
    return v;
  }

  // max that propagates NaN (as torch's reduction does): once NaN, always NaN.
  static T nan_max(const std::vector<T>& v) {
    T m = -INFINITY;
    for (T e : v)
      if (std::isnan(e) || e > m) {
        m = e;
        if (std::isnan(e)) break;
      }
    return m;
  }

  // Pairwise sums, as torch's reductions are tree-shaped: an error of ~u log2(n), not ~u n.
  static T pairwise(const T* v, size_t n) {
    if (n <= 8) {
      T s = 0;
      for (size_t i = 0; i < n; ++i) s += v[i];
      return s;
    }
    const size_t half = n / 2;
    return pairwise(v, half) + pairwise(v + half, n - half);
  }
  static T sum(const std::vector<T>& v) { return pairwise(v.data(), v.size()); }
  // sum over j of f(j), j < n.
  template <typename F>
  T sum_of(int64_t n, F f) {
    terms_.resize(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) terms_[static_cast<size_t>(j)] = f(j);
    return sum(terms_);
  }

  // Sums over rows (the parameter gradients), in blocks of kRowBlock rows: ~u (kRowBlock + rows /
  // kRowBlock) of error rather than ~u rows.
  static constexpr int64_t kRowBlock = 64;
  struct RowSum {
    std::vector<T> total, block;
    explicit RowSum(int64_t n) : total(static_cast<size_t>(n), T(0)), block(static_cast<size_t>(n), T(0)) {}
    void add(int64_t j, T v) { block[static_cast<size_t>(j)] += v; }
    void end_row(int64_t r) {
      if ((r + 1) % kRowBlock != 0) return;
      flush();
    }
    std::vector<double> done() {
      flush();
      return std::vector<double>(total.begin(), total.end());
    }
    void flush() {
      for (size_t j = 0; j < total.size(); ++j) total[j] += block[j], block[j] = T(0);
    }
  };

  T gelu(T z) const {
    if (p_.gelu == GeluApproximation::kTanh)
      return T(0.5) * z * (T(1) + std::tanh(kSqrt2OverPi * (z + kCubic * z * z * z)));
    return T(0.5) * z * (T(1) + std::erf(z * kSqrtHalf));
  }

  T gelu_grad(T z) const {
    if (p_.gelu == GeluApproximation::kTanh) {
      const T t = std::tanh(kSqrt2OverPi * (z + kCubic * z * z * z));
      return T(0.5) * (T(1) + t) + T(0.5) * z * (T(1) - t * t) * kSqrt2OverPi * (T(1) + T(3) * kCubic * z * z);
    }
    return T(0.5) * (T(1) + std::erf(z * kSqrtHalf)) + z * kInvSqrt2Pi * std::exp(T(-0.5) * z * z);
  }

  void softmax_forward() {
    const int64_t n = p_.width;
    const bool log = p_.op == FusedOp::kLogSoftmax;
    const T scale = static_cast<T>(p_.scale);
    out_.y.resize(static_cast<size_t>(p_.rows * n));
    std::vector<T> s;
    for (int64_t r = 0; r < p_.rows; ++r) {
      load_row(p_.x, p_.ld_x, r, n, s);
      for (T& e : s) e *= scale;
      const T m = nan_max(s);
      const T total = sum_of(n, [&](int64_t j) { return std::exp(s[j] - m); });  // only -inf: NaN, as torch
      double* y = &out_.y[static_cast<size_t>(r * n)];
      const T lse = std::log(total);
      for (int64_t j = 0; j < n; ++j) y[j] = log ? (s[j] - m) - lse : std::exp(s[j] - m) / total;
    }
  }

  void softmax_backward() {
    const int64_t n = p_.width;
    const bool log = p_.op == FusedOp::kLogSoftmax;
    const T scale = static_cast<T>(p_.scale);
    out_.dx.resize(static_cast<size_t>(p_.rows * n));
    std::vector<T> y, dy;
    for (int64_t r = 0; r < p_.rows; ++r) {
      load_row(p_.x, p_.ld_x, r, n, y);  // the forward output
      load_row(p_.dy, p_.ld_dy, r, n, dy);
      double* dx = &out_.dx[static_cast<size_t>(r * n)];
      if (log) {
        const T sdy = sum(dy);
        for (int64_t j = 0; j < n; ++j) dx[j] = scale * (dy[j] - std::exp(y[j]) * sdy);
      } else {
        const T dot = sum_of(n, [&](int64_t j) { return dy[j] * y[j]; });
        for (int64_t j = 0; j < n; ++j) dx[j] = scale * y[j] * (dy[j] - dot);
      }
    }
  }

  // The statistics of one row h: mean (layer_norm forms; 0 for rms_norm) and rstd.
  void row_stats(const std::vector<T>& h, T& mean, T& rstd) {
    const T n = static_cast<T>(h.size());
    const T eps = static_cast<T>(p_.eps);
    if (p_.is_layer_norm()) {
      mean = sum(h) / n;
      const T var = sum_of(static_cast<int64_t>(h.size()), [&](int64_t j) { return (h[j] - mean) * (h[j] - mean); });
      rstd = T(1) / std::sqrt(var / n + eps);  // biased variance, as torch
    } else {
      mean = 0;
      const T ms = sum_of(static_cast<int64_t>(h.size()), [&](int64_t j) { return h[j] * h[j]; });
      rstd = T(1) / std::sqrt(ms / n + eps);
    }
  }

  void norm_forward() {
    const int64_t n = p_.width;
    const size_t total = static_cast<size_t>(p_.rows * n);
    out_.y.resize(total);
    if (p_.is_add_form()) out_.residual_out.resize(total);
    if (p_.is_layer_norm()) out_.mean.resize(static_cast<size_t>(p_.rows));
    out_.rstd.resize(static_cast<size_t>(p_.rows));
    const std::vector<T> w = load_vector(p_.weight, n, T(1));
    const std::vector<T> b = load_vector(p_.is_layer_norm() ? p_.bias : nullptr, n, T(0));
    std::vector<T> h, res;
    for (int64_t r = 0; r < p_.rows; ++r) {
      load_row(p_.x, p_.ld_x, r, n, h);
      if (p_.is_add_form()) {
        load_row(p_.residual, p_.ld_residual, r, n, res);
        for (int64_t j = 0; j < n; ++j) {
          h[j] += res[j];  // float64: no rounding to the dtype; same-dtype: rounded, as the library does
          if (mode_.same_dtype) h[j] = static_cast<T>(round_to(p_.dtype, h[j]));
          out_.residual_out[static_cast<size_t>(r * n + j)] = h[j];
        }
      }
      T mean = 0, rstd = 0;
      row_stats(h, mean, rstd);
      if (p_.is_layer_norm()) out_.mean[static_cast<size_t>(r)] = mean;
      out_.rstd[static_cast<size_t>(r)] = rstd;
      double* y = &out_.y[static_cast<size_t>(r * n)];
      for (int64_t j = 0; j < n; ++j) y[j] = (h[j] - mean) * rstd * w[j] + b[j];
    }
  }

  void norm_backward() {
    const int64_t n = p_.width;
    const T dn = static_cast<T>(n);
    out_.dx.resize(static_cast<size_t>(p_.rows * n));
    RowSum dweight(n), dbias(n);
    if (p_.is_layer_norm()) out_.mean.resize(static_cast<size_t>(p_.rows));
    out_.rstd.resize(static_cast<size_t>(p_.rows));
    const std::vector<T> w = load_vector(p_.weight, n, T(1));
    std::vector<T> h, dy, dres, xhat(static_cast<size_t>(n)), g(static_cast<size_t>(n));
    for (int64_t r = 0; r < p_.rows; ++r) {
      load_row(p_.x, p_.ld_x, r, n, h);
      load_row(p_.dy, p_.ld_dy, r, n, dy);
      T mean = 0, rstd = 0;
      if (mode_.same_dtype && p_.rstd64 && (p_.mean64 || !p_.is_layer_norm())) {
        // the saved fp64 statistics (fp64 data), as the library reads them
        mean = p_.is_layer_norm() ? static_cast<T>(p_.mean64[r]) : T(0);
        rstd = static_cast<T>(p_.rstd64[r]);
      } else if (mode_.same_dtype && p_.rstd && (p_.mean || !p_.is_layer_norm())) {
        // the saved fp32 statistics, as the library reads them
        mean = p_.is_layer_norm() ? static_cast<T>(p_.mean[r]) : T(0);
        rstd = static_cast<T>(p_.rstd[r]);
      } else {
        row_stats(h, mean, rstd);  // recomputed; the float64 reference never reads p.mean / p.rstd
      }
      if (p_.is_layer_norm()) out_.mean[static_cast<size_t>(r)] = mean;
      out_.rstd[static_cast<size_t>(r)] = rstd;
      for (int64_t j = 0; j < n; ++j) {
        xhat[j] = (h[j] - mean) * rstd;
        g[j] = dy[j] * w[j];
      }
      T mean_g = sum(g) / dn;
      const T mean_gx = sum_of(n, [&](int64_t j) { return g[j] * xhat[j]; }) / dn;
      if (!p_.is_layer_norm()) mean_g = 0;  // rms_norm subtracts no mean
      if (p_.dresidual_out) load_row(p_.dresidual_out, p_.ld_dresidual_out, r, n, dres);
      double* dx = &out_.dx[static_cast<size_t>(r * n)];
      for (int64_t j = 0; j < n; ++j) {
        T v = rstd * (g[j] - mean_g - xhat[j] * mean_gx);
        if (p_.dresidual_out) v += dres[j];
        dx[j] = v;
        dweight.add(j, dy[j] * xhat[j]);
        dbias.add(j, dy[j]);
      }
      dweight.end_row(r);
      dbias.end_row(r);
    }
    out_.dweight = dweight.done();
    if (p_.is_layer_norm()) out_.dbias = dbias.done();
  }

  void bias_gelu() {
    const int64_t n = p_.width;
    const std::vector<T> b = load_vector(p_.bias, n, T(0));
    std::vector<T> x, dy;
    RowSum dbias(n);
    std::vector<double>& dst = p_.backward ? out_.dx : out_.y;
    dst.resize(static_cast<size_t>(p_.rows * n));
    for (int64_t r = 0; r < p_.rows; ++r) {
      load_row(p_.x, p_.ld_x, r, n, x);
      if (p_.backward) load_row(p_.dy, p_.ld_dy, r, n, dy);
      double* o = &dst[static_cast<size_t>(r * n)];
      for (int64_t j = 0; j < n; ++j) {
        const T z = x[j] + b[j];
        if (p_.backward) {
          const T d = dy[j] * gelu_grad(z);
          o[j] = d;
          dbias.add(j, d);
        } else {
          o[j] = gelu(z);
        }
      }
      dbias.end_row(r);
    }
    if (p_.backward) out_.dbias = dbias.done();
  }

  void silu_and_mul() {
    const int64_t d = p_.width;
    std::vector<T> x, dy;
    if (p_.backward)
      out_.dx.resize(static_cast<size_t>(p_.rows * 2 * d));
    else
      out_.y.resize(static_cast<size_t>(p_.rows * d));
    for (int64_t r = 0; r < p_.rows; ++r) {
      load_row(p_.x, p_.ld_x, r, 2 * d, x);
      if (p_.backward) load_row(p_.dy, p_.ld_dy, r, d, dy);
      for (int64_t j = 0; j < d; ++j) {
        const T a = x[j], b = x[d + j];
        const T s = T(1) / (T(1) + std::exp(-a));
        const T silu = a / (T(1) + std::exp(-a));  // torch's form
        if (p_.backward) {
          double* dx = &out_.dx[static_cast<size_t>(r * 2 * d)];
          dx[j] = dy[j] * b * s * (T(1) + a * (T(1) - s));
          dx[d + j] = dy[j] * silu;
        } else {
          out_.y[static_cast<size_t>(r * d + j)] = silu * b;
        }
      }
    }
  }

  const FusedParams& p_;
  Mode mode_;
  FusedReference out_;
  std::vector<T> terms_;  // sum_of's scratch
};

}  // namespace

FusedReference fused_reference_f64(const FusedParams& p) {
  // fp64 operands: long double math, so that the reference stays more precise than the fp64
  // computation it judges (and the same-dtype reference's error measures that one's conditioning).
  if (p.dtype == DType::kF64) return Reference<long double>(p, Mode{false}).run();
  return Reference<double>(p, Mode{false}).run();
}

FusedReference fused_reference_same_dtype(const FusedParams& p) {
  if (p.dtype == DType::kF64) return Reference<double>(p, Mode{true}).run();
  return Reference<float>(p, Mode{true}).run();
}

}  // namespace optimized::testing
