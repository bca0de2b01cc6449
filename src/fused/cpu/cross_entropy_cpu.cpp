// cpu_cross_entropy: cross-entropy on the host, the CPU rung of the ladder and the baseline the CUDA
// kernel (cuda/cross_entropy.cu) is explained against.
//
// One row at a time, threads (OpenMP) over rows. Each row is widened into a per-thread scratch in
// the math type (fp32 for fp32 / fp16 / bf16, fp64 for fp64) before anything is written, so a
// gradient that is the logits' own memory (in place) is safe. Per row, with m the row's maximum and
// s = sum(exp(x - m)) (the sums over the row in double):
//   loss = log(s) + (1 - ls) (m - x[t]) + ls (m - mean(x)) + z lse^2,   lse = m + log(s)
// -- optimized/fused.h's formula, regrouped so that lse - x[t] does not cancel in fp32 when the logits
// are large -- each term whose coefficient is 0 dropped, and
//   grad = (exp(x - m) / s * (1 + 2 z lse) - ls / V - (1 - ls) onehot(t)) * k,
// k the row's grad_scale (1 when absent). cpu_cross_entropy_scale_grad is the backward: a stored
// gradient's rows times grad_loss, rows whose factor is 1 left alone.
// A row of only -inf: lse = -inf, loss and gradient NaN (m - x is NaN, as float64 math gives); a +inf logit: s is NaN; NaN propagates.
// Ignored rows: loss 0, lse 0, gradient 0, the logits unread. The targets were checked by the API.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cpu_loops.h"
#include "core/host_dtype.h"
#include "fused/cross_entropy_params.h"

namespace optimized {
namespace {

using namespace host;  // F32, F64, F16, BF16

template <class D, class I>
void cross_entropy_rows(const CrossEntropyParams& p, int nth) {
  using A = typename D::Acc;  // the math type; also the type of loss and lse
  using T = typename D::T;
  const int64_t n = p.vocab;
  const A ls = static_cast<A>(p.label_smoothing), z = static_cast<A>(p.z_loss);  // fp32 math: rounded once
  const A ls_over_v = ls / static_cast<A>(n);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> x(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      const int64_t t = static_cast<int64_t>(static_cast<const I*>(p.target)[r * p.target_stride]);
      A* loss = static_cast<A*>(p.loss) + r;
      A* lse_out = p.lse ? static_cast<A*>(p.lse) + r : nullptr;
      T* g = p.grad ? static_cast<T*>(p.grad) + r * p.ld_grad : nullptr;
      if (t == p.ignore_index) {
        *loss = A(0);
        if (lse_out) *lse_out = A(0);
        if (g)
          for (int64_t j = 0; j < n; ++j) g[j] = D::store(A(0));
        continue;
      }
      const T* row = static_cast<const T*>(p.logits) + r * p.ld_logits;
      for (int64_t j = 0; j < n; ++j) x[j] = D::load(row[j]);  // the whole row before any write
      const A m = nan_propagating_max(x.data(), n);
      double s = 0.0, sum_x = 0.0;
      if (m != -INFINITY)  // only -inf: s = 0 and lse = -inf (exp(-inf - -inf) would be NaN)
        for (int64_t j = 0; j < n; ++j) s += static_cast<double>(std::exp(x[j] - m));
      if (ls != A(0))
        for (int64_t j = 0; j < n; ++j) sum_x += static_cast<double>(x[j]);
      const A log_s = static_cast<A>(std::log(s));
      const A lse = m + log_s;
      A l = log_s;
      if (ls != A(1)) l += (A(1) - ls) * (m - x[t]);
      if (ls != A(0)) l += ls * (m - static_cast<A>(sum_x / static_cast<double>(n)));
      if (z != A(0)) l += z * lse * lse;
      *loss = l;
      if (lse_out) *lse_out = lse;
      if (!g) continue;
      const A inv_s = static_cast<A>(1.0 / s);
      const A c = z != A(0) ? A(1) + A(2) * z * lse : A(1);
      const A k = p.grad_scale ? static_cast<const A*>(p.grad_scale)[r * p.grad_scale_stride] : A(1);
      for (int64_t j = 0; j < n; ++j) {
        A v = std::exp(x[j] - m) * inv_s * c - ls_over_v;
        if (j == t) v -= A(1) - ls;
        g[j] = D::store(v * k);
      }
    }
  }
}

template <class D>
void scale_rows(const CrossEntropyParams& p, int nth) {
  using A = typename D::Acc;
  using T = typename D::T;
  const A* k = static_cast<const A*>(p.grad_scale);
#pragma omp parallel for num_threads(nth) schedule(static)
  for (int64_t r = 0; r < p.rows; ++r) {
    const A f = k[r * p.grad_scale_stride];
    if (f == A(1)) continue;
    T* g = static_cast<T*>(p.grad) + r * p.ld_grad;
    for (int64_t j = 0; j < p.vocab; ++j) g[j] = D::store(D::load(g[j]) * f);
  }
}

template <class D>
void run(const CrossEntropyParams& p, int threads) {
  const int nth = cpu_thread_count(threads, p.rows);
  if (p.target_dtype == DType::kI32) return cross_entropy_rows<D, int32_t>(p, nth);
  cross_entropy_rows<D, int64_t>(p, nth);
}

}  // namespace

void cpu_cross_entropy(const CrossEntropyParams& params, int threads) {
  host::visit_traits(params.dtype, [&]<class D>() { run<D>(params, threads); });
}

void cpu_cross_entropy_scale_grad(const CrossEntropyParams& params, int threads) {
  host::visit_traits(params.dtype, [&]<class D>() { scale_rows<D>(params, cpu_thread_count(threads, params.rows)); });
}

}  // namespace optimized
