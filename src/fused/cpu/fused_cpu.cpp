// cpu_fused: forward and backward of every op of the fused family on the host, the CPU rung of
// the ladder and the baseline the CUDA kernels are explained against.
//
// One row at a time, threads (OpenMP) over rows. Each input row is first widened into a
// per-thread fp32 scratch (fp64 for fp64) and every pass reads the scratch, so an output that is
// the very same view as an input (y = x, residual_out = residual, dx = dy) is safe: the row is
// read whole before any of it is written.
// Numerics, as optimized/fused.h promises and torch does:
//   - fp32 math and fp32 statistics for fp32 / fp16 / bf16 (fp64 throughout for fp64, the saved
//     statistics included), except where a row's sums meet (below);
//   - sums over a row are blocked: blocks of kSumBlock terms summed in the math type with 8
//     interleaved accumulators (this vectorizes), the block sums added pairwise in double. The error
//     then stays flat in the row length. 8 accumulators over the whole row grow like sqrt(n / 8):
//     at n = 2^20 (fp32, N(mean, 1) rows) layer_norm's error was 4.9e-5 at mean 0 and 1.6e-4 at
//     mean 100, against torch's 6e-7 and 1e-5; it is now 6e-7 and 3e-6;
//   - mean and variance by the corrected two-pass algorithm: m1 = sum(h) / n, then d = h - m1 and
//     mean = m1 + sum(d) / n, var = sum(d^2) / n - (sum(d) / n)^2 (no E[x^2] - E[x]^2
//     cancellation; the correction removes the rounding of m1, so a constant row has its exact
//     value as mean and a variance of exactly 0);
//   - eps and scale: double for fp64; for fp32 math, scale is rounded to fp32 and rstd =
//     1 / sqrt(var + eps) is evaluated in double from the double statistics, then rounded once (an
//     eps below fp32's range still counts, as torch's double eps does);
//   - softmax subtracts the row max; a NaN anywhere in a row makes the max, and the row, NaN;
//   - the add forms round h = x + residual to the dtype before normalizing it (what residual_out
//     holds is what was normalized); bias + GELU does NOT round x + bias;
//   - dweight / dbias: per-thread partial sums over the thread's rows in double, added in thread
//     order (deterministic for a given thread count), then rounded to the dtype.
// Backward of the norms reads the saved mean / rstd (the backward has no eps to recompute rstd
// with): fp32 for fp32 / fp16 / bf16, fp64 for fp64 (p.mean64 / p.rstd64), so fp64 gradients of
// the norms are fp64-accurate.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/cpu_loops.h"
#include "core/host_dtype.h"
#include "fused/fused_params.h"
#include "optimized/buffer.h"

namespace optimized {
namespace {

// ---- dtypes: storage type, math type, conversions (core/host_dtype.h) ---------------------------

using namespace host;  // F32, F64, F16, BF16

template <class D>
void load_row(const void* base, int64_t ld, int64_t r, int64_t n, typename D::Acc* out) {
  const auto* src = static_cast<const typename D::T*>(base) + r * ld;
  for (int64_t j = 0; j < n; ++j) out[j] = D::load(src[j]);
}

template <class D>
void store_row(void* base, int64_t ld, int64_t r, int64_t n, const typename D::Acc* in) {
  auto* dst = static_cast<typename D::T*>(base) + r * ld;
  for (int64_t j = 0; j < n; ++j) dst[j] = D::store(in[j]);
}

// ---- sums over a row ---------------------------------------------------------------------------
// Blocks of kSumBlock terms: each of the 8 accumulators of a block adds kSumBlock / 8 = 16 terms,
// so a block's rounding error is that of a 16-term sum; blocks are few enough (n / 128) that adding
// their sums in double costs nothing, and pairwise makes that part log2(n / 128) roundings of double.
constexpr int64_t kSumBlock = 128;

// sum over j in [begin, end) of f(j) (end - begin <= kSumBlock), in A, 8 interleaved accumulators.
template <class A, class F>
A block_sum(int64_t begin, int64_t end, F& f) {
  A acc[8] = {};
  int64_t j = begin;
  for (; j + 8 <= end; j += 8)
    for (int k = 0; k < 8; ++k) acc[k] += f(j + k);
  A tail = 0;
  for (; j < end; ++j) tail += f(j);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

// Adds values pairwise: the k-th stored partial is the sum of 2^k consecutive values, merged with
// its equal the moment one appears (a binary counter), so each value goes through about log2(count)
// additions of like-sized sums.
class PairwiseSum {
 public:
  void add(double v) {
    int k = 0;
    for (uint64_t c = count_; c & 1; c >>= 1, ++k) v = partial_[k] + v;
    partial_[k] = v;
    ++count_;
  }
  double total() const {
    double t = 0;
    for (int k = 0; k < 64; ++k)
      if ((count_ >> k) & 1) t = partial_[k] + t;  // the small partials first
    return t;
  }

 private:
  double partial_[64];
  uint64_t count_ = 0;
};

// sum over j < n of f(j): blocks in A, block sums pairwise in double.
template <class A, class F>
double row_sum(int64_t n, F f) {
  PairwiseSum total;
  for (int64_t b = 0; b < n; b += kSumBlock) total.add(block_sum<A>(b, std::min(n, b + kSumBlock), f));
  return total.total();
}

// sum(d) and sum(d^2) over d = v[j] - shift, j < n, in one pass over the row: each block is summed
// twice while it is in L1 (two plain loops vectorize better than one with both sums).
template <class A>
std::pair<double, double> row_moments(const A* v, int64_t n, A shift) {
  auto d = [&](int64_t j) { return v[j] - shift; };
  auto dd = [&](int64_t j) { return (v[j] - shift) * (v[j] - shift); };
  PairwiseSum s1, s2;
  for (int64_t b = 0; b < n; b += kSumBlock) {
    const int64_t end = std::min(n, b + kSumBlock);
    s1.add(block_sum<A>(b, end, d));
    s2.add(block_sum<A>(b, end, dd));
  }
  return {s1.total(), s2.total()};
}

// Per-thread partial sums of (width) gradients over the thread's rows, in double (a sum over
// thousands of rows), combined in thread order and stored in the dtype.
template <class D>
struct Partials {
  std::vector<std::vector<double>> parts;
  Partials(bool wanted, int threads, int64_t width)
      : parts(wanted ? threads : 0, std::vector<double>(static_cast<size_t>(width), 0.0)) {}
  double* mine() { return parts.empty() ? nullptr : parts[static_cast<size_t>(omp_get_thread_num())].data(); }
  void store(void* out, int64_t width) const {
    if (!out || parts.empty()) return;
    auto* dst = static_cast<typename D::T*>(out);
    for (int64_t j = 0; j < width; ++j) {
      double s = 0;
      for (const auto& part : parts) s += part[static_cast<size_t>(j)];
      dst[j] = D::store(static_cast<typename D::Acc>(s));
    }
  }
};

// ---- softmax / log_softmax ---------------------------------------------------------------------

template <class D>
void softmax_forward(const FusedParams& p, int nth) {
  using A = typename D::Acc;
  const int64_t n = p.width;
  const A scale = static_cast<A>(p.scale);  // fp32 math: rounded once
  const bool log = p.op == FusedOp::kLogSoftmax;
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> s(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row<D>(p.x, p.ld_x, r, n, s.data());
      for (int64_t j = 0; j < n; ++j) s[j] *= scale;
      const A m = nan_propagating_max(s.data(), n);
      // A row of only -inf: -inf - (-inf) = NaN everywhere; a +inf entry: NaN sum. Both as torch.
      const A total = static_cast<A>(row_sum<A>(n, [&](int64_t j) { return std::exp(s[j] - m); }));
      if (log) {
        const A lse = std::log(total);
        for (int64_t j = 0; j < n; ++j) s[j] = (s[j] - m) - lse;
      } else {
        const A inv = A(1) / total;
        for (int64_t j = 0; j < n; ++j) s[j] = std::exp(s[j] - m) * inv;
      }
      store_row<D>(p.y, p.ld_y, r, n, s.data());
    }
  }
}

template <class D>
void softmax_backward(const FusedParams& p, int nth) {
  using A = typename D::Acc;
  const int64_t n = p.width;
  const A scale = static_cast<A>(p.scale);  // fp32 math: rounded once
  const bool log = p.op == FusedOp::kLogSoftmax;
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> y(static_cast<size_t>(n)), dy(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row<D>(p.x, p.ld_x, r, n, y.data());  // the forward output
      load_row<D>(p.dy, p.ld_dy, r, n, dy.data());
      if (log) {
        const A sdy = static_cast<A>(row_sum<A>(n, [&](int64_t j) { return dy[j]; }));
        for (int64_t j = 0; j < n; ++j) dy[j] = scale * (dy[j] - std::exp(y[j]) * sdy);
      } else {
        const A dot = static_cast<A>(row_sum<A>(n, [&](int64_t j) { return dy[j] * y[j]; }));
        for (int64_t j = 0; j < n; ++j) dy[j] = scale * y[j] * (dy[j] - dot);
      }
      store_row<D>(p.dx, p.ld_dx, r, n, dy.data());
    }
  }
}

// ---- layer_norm / rms_norm and their add forms -------------------------------------------------

// mean (0 for rms_norm) and rstd of a row h, in A; the sums and rstd's square root in double.
template <class A>
void row_stats(const FusedParams& p, const A* h, int64_t n, A& mean, A& rstd) {
  const double dn = static_cast<double>(n);  // divided by, not multiplied by 1 / n: exact multiples stay exact
  double var = 0;
  if (p.is_layer_norm()) {
    // Corrected two-pass: the correction sum(d) / n removes the rounding of m1.
    const A m1 = static_cast<A>(row_sum<A>(n, [&](int64_t j) { return h[j]; }) / dn);
    const auto [sd, sdd] = row_moments(h, n, m1);
    const double c = sd / dn;
    // An infinite m1 (a row of +inf or -inf alone) stays the mean, as the plain sum gives; var is
    // NaN then (inf - inf), and stays NaN below, as does everything of a row holding a NaN.
    mean = std::isinf(m1) ? m1 : static_cast<A>(static_cast<double>(m1) + c);
    var = sdd / dn - c * c;
    if (var < 0) var = 0;  // rounding only: sum(d^2) / n >= (sum(d) / n)^2 exactly
  } else {
    mean = 0;
    var = row_sum<A>(n, [&](int64_t j) { return h[j] * h[j]; }) / dn;  // the mean square
  }
  rstd = static_cast<A>(1.0 / std::sqrt(var + p.eps));
}

template <class D>
void norm_forward(const FusedParams& p, int nth) {
  using A = typename D::Acc;
  using T = typename D::T;
  const int64_t n = p.width;
  const auto* weight = static_cast<const T*>(p.weight);
  const auto* bias = p.is_layer_norm() ? static_cast<const T*>(p.bias) : nullptr;
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> h(static_cast<size_t>(n)), res(p.is_add_form() ? static_cast<size_t>(n) : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row<D>(p.x, p.ld_x, r, n, h.data());
      if (p.is_add_form()) {
        load_row<D>(p.residual, p.ld_residual, r, n, res.data());
        // Rounded to the dtype: residual_out holds exactly what is normalized.
        for (int64_t j = 0; j < n; ++j) h[j] = D::load(D::store(h[j] + res[j]));
        store_row<D>(p.residual_out, p.ld_residual_out, r, n, h.data());
      }
      A mean = 0, rstd = 0;
      row_stats(p, h.data(), n, mean, rstd);
      if (p.mean) p.mean[r] = static_cast<float>(mean);
      if (p.rstd) p.rstd[r] = static_cast<float>(rstd);
      if (p.mean64) p.mean64[r] = static_cast<double>(mean);
      if (p.rstd64) p.rstd64[r] = static_cast<double>(rstd);
      for (int64_t j = 0; j < n; ++j) {
        A v = (h[j] - mean) * rstd;
        if (weight) v *= D::load(weight[j]);
        if (bias) v += D::load(bias[j]);
        h[j] = v;
      }
      store_row<D>(p.y, p.ld_y, r, n, h.data());
    }
  }
}

template <class D>
void norm_backward(const FusedParams& p, int nth) {
  using A = typename D::Acc;
  using T = typename D::T;
  const int64_t n = p.width;
  const auto* weight = static_cast<const T*>(p.weight);
  const bool layer = p.is_layer_norm();
  Partials<D> dweight(p.dweight != nullptr, nth, n), dbias(layer && p.dbias != nullptr, nth, n);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> h(static_cast<size_t>(n)), dy(static_cast<size_t>(n)), g(static_cast<size_t>(n));
    std::vector<A> dres(p.dresidual_out ? static_cast<size_t>(n) : 0);
    double* dw = dweight.mine();
    double* db = dbias.mine();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row<D>(p.x, p.ld_x, r, n, h.data());
      load_row<D>(p.dy, p.ld_dy, r, n, dy.data());
      const A mean = !layer ? A(0) : p.mean64 ? static_cast<A>(p.mean64[r]) : A(p.mean[r]);
      const A rstd = p.rstd64 ? static_cast<A>(p.rstd64[r]) : A(p.rstd[r]);
      // h becomes xhat = (h - mean) * rstd; g = dy * weight.
      for (int64_t j = 0; j < n; ++j) {
        h[j] = (h[j] - mean) * rstd;
        g[j] = weight ? dy[j] * D::load(weight[j]) : dy[j];
      }
      const double dn = static_cast<double>(n);
      const A mean_g = layer ? static_cast<A>(row_sum<A>(n, [&](int64_t j) { return g[j]; }) / dn) : A(0);
      const A mean_gx = static_cast<A>(row_sum<A>(n, [&](int64_t j) { return g[j] * h[j]; }) / dn);
      if (dw)
        for (int64_t j = 0; j < n; ++j) dw[j] += static_cast<double>(dy[j] * h[j]);
      if (db)
        for (int64_t j = 0; j < n; ++j) db[j] += static_cast<double>(dy[j]);
      if (p.dresidual_out) load_row<D>(p.dresidual_out, p.ld_dresidual_out, r, n, dres.data());
      for (int64_t j = 0; j < n; ++j) {
        A v = rstd * (g[j] - mean_g - h[j] * mean_gx);
        if (p.dresidual_out) v += dres[j];
        g[j] = v;
      }
      store_row<D>(p.dx, p.ld_dx, r, n, g.data());
    }
  }
  dweight.store(p.dweight, n);
  dbias.store(p.dbias, n);
}

// ---- bias + GELU -------------------------------------------------------------------------------

template <class A>
A gelu(A z, GeluApproximation approximate) {
  if (approximate == GeluApproximation::kTanh) {
    const A k = A(0.79788456080286535588);  // sqrt(2 / pi)
    return A(0.5) * z * (A(1) + std::tanh(k * (z + A(0.044715) * z * z * z)));
  }
  return A(0.5) * z * (A(1) + std::erf(z * A(0.70710678118654752440)));
}

template <class A>
A gelu_grad(A z, GeluApproximation approximate) {
  if (approximate == GeluApproximation::kTanh) {
    const A k = A(0.79788456080286535588);
    const A t = std::tanh(k * (z + A(0.044715) * z * z * z));
    return A(0.5) * (A(1) + t) + A(0.5) * z * (A(1) - t * t) * k * (A(1) + A(3 * 0.044715) * z * z);
  }
  return A(0.5) * (A(1) + std::erf(z * A(0.70710678118654752440))) +
         z * A(0.39894228040143267794) * std::exp(A(-0.5) * z * z);  // z * phi(z)
}

template <class D>
void bias_gelu(const FusedParams& p, int nth) {
  using A = typename D::Acc;
  using T = typename D::T;
  const int64_t n = p.width;
  const auto* bias = static_cast<const T*>(p.bias);
  Partials<D> dbias(p.backward && p.dbias != nullptr, nth, n);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> x(static_cast<size_t>(n)), dy(p.backward ? static_cast<size_t>(n) : 0);
    double* db = dbias.mine();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row<D>(p.x, p.ld_x, r, n, x.data());
      if (p.backward) load_row<D>(p.dy, p.ld_dy, r, n, dy.data());
      for (int64_t j = 0; j < n; ++j) {
        const A z = bias ? x[j] + D::load(bias[j]) : x[j];  // not rounded to the dtype
        if (p.backward) {
          x[j] = dy[j] * gelu_grad(z, p.gelu);
          if (db) db[j] += x[j];
        } else {
          x[j] = gelu(z, p.gelu);
        }
      }
      if (p.backward)
        store_row<D>(p.dx, p.ld_dx, r, n, x.data());
      else
        store_row<D>(p.y, p.ld_y, r, n, x.data());
    }
  }
  dbias.store(p.dbias, n);
}

// ---- SiLU-and-mul ------------------------------------------------------------------------------

template <class D>
void silu_and_mul(const FusedParams& p, int nth) {
  using A = typename D::Acc;
  const int64_t d = p.width;
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> x(static_cast<size_t>(2 * d)), dy(p.backward ? static_cast<size_t>(d) : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      load_row<D>(p.x, p.ld_x, r, 2 * d, x.data());
      if (p.backward) {
        load_row<D>(p.dy, p.ld_dy, r, d, dy.data());
        for (int64_t j = 0; j < d; ++j) {
          const A a = x[j], b = x[d + j];
          const A e = std::exp(-a);
          const A s = A(1) / (A(1) + e);
          x[j] = dy[j] * b * s * (A(1) + a * (A(1) - s));
          x[d + j] = dy[j] * (a / (A(1) + e));
        }
        store_row<D>(p.dx, p.ld_dx, r, 2 * d, x.data());
      } else {
        for (int64_t j = 0; j < d; ++j) x[j] = x[j] / (A(1) + std::exp(-x[j])) * x[d + j];  // torch's silu form
        store_row<D>(p.y, p.ld_y, r, d, x.data());
      }
    }
  }
}

template <class D>
void run(const FusedParams& p, int threads) {
  const int nth = cpu_thread_count(threads, p.rows);
  switch (p.op) {
    case FusedOp::kSoftmax:
    case FusedOp::kLogSoftmax:
      return p.backward ? softmax_backward<D>(p, nth) : softmax_forward<D>(p, nth);
    case FusedOp::kLayerNorm:
    case FusedOp::kRmsNorm:
    case FusedOp::kAddLayerNorm:
    case FusedOp::kAddRmsNorm:
      return p.backward ? norm_backward<D>(p, nth) : norm_forward<D>(p, nth);
    case FusedOp::kBiasGelu: return bias_gelu<D>(p, nth);
    case FusedOp::kSiluAndMul: return silu_and_mul<D>(p, nth);
  }
}

}  // namespace

void cpu_fused(const FusedParams& params, int threads) {
  host::visit_traits(params.dtype, [&]<class D>() { run<D>(params, threads); });
}

}  // namespace optimized
