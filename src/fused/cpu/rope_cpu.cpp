// cpu_rope: the CPU rung of RoPE (rope_forward / rope_backward, include/optimized/fused.h), the
// readable statement of what the CUDA kernel (cuda/rope.cu) does.
//
// Threads (OpenMP) over the tokens (b, s). Per token: position p = positions[b][s] (or [s]); the
// cos / sin of its rotary_dim / 2 angles, once, into a table (kernels/rope.h: the angle formed and
// reduced in fp64, cos / sin in fp64 and rounded to the math type A -- fp32, or fp64 for fp64; from
// the caller's cos_sin cache instead when given, NaN for a position outside it); backward negates
// the sines (the transpose). Then every row of q and of k: each pair (x0, x1) widened to A, rotated,
// rounded to the dtype; the dims past rotary_dim copied unless the output is the input (in place).
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/cpu_loops.h"
#include "core/host_dtype.h"
#include "fused/rope_params.h"
#include "kernels/rope.h"

namespace optimized {
namespace {

using namespace host;  // F32, F64, F16, BF16

template <class D>
void rotate_rows(const RopeParams& p, const RopeTensor& r, int64_t b, int64_t s, const typename D::Acc* cs,
                 const typename D::Acc* sn) {
  using T = typename D::T;
  using A = typename D::Acc;
  const int64_t half = p.half(), D_ = p.head_dim;
  for (int64_t h = 0; h < r.heads; ++h) {
    const T* x = static_cast<const T*>(r.x) + b * r.x_b + s * r.x_s + h * r.x_h;
    T* y = static_cast<T*>(r.out) + b * r.out_b + s * r.out_s + h * r.out_h;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t i0 = kernels::rope_first(p.neox, i), i1 = kernels::rope_second(p.neox, i, half);
      A y0, y1;
      kernels::rope_rotate<A>(D::load(x[i0]), D::load(x[i1]), cs[i], sn[i], &y0, &y1);
      y[i0] = D::store(y0);  // x may be y: both read above
      y[i1] = D::store(y1);
    }
    if (y != x)
      for (int64_t d = p.rotary_dim; d < D_; ++d) y[d] = x[d];
  }
}

template <class D>
void rope(const RopeParams& p, int threads) {
  using A = typename D::Acc;
  const int64_t S = p.seq, tokens = p.tokens(), half = p.half();
  const int nth = cpu_thread_count(threads, tokens);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t b = t / S, s = t % S;
      const int64_t at = b * p.pos_b + s * p.pos_s;
      const int64_t pos = p.positions_i64 ? static_cast<const int64_t*>(p.positions)[at]
                                          : static_cast<const int32_t*>(p.positions)[at];
      if (p.cos_sin) {
        const bool in = pos >= 0 && pos < p.cos_sin_rows;
        const A* row = in ? static_cast<const A*>(p.cos_sin) + pos * p.ld_cos_sin : nullptr;
        for (int64_t i = 0; i < half; ++i) {
          cs[i] = in ? row[i] : std::numeric_limits<A>::quiet_NaN();
          sn[i] = in ? row[half + i] : std::numeric_limits<A>::quiet_NaN();
        }
      } else {
        for (int64_t i = 0; i < half; ++i) {
          const double r = kernels::rope_reduced_angle(pos, kernels::rope_inv_freq(i, p.rotary_dim, p.theta));
          cs[i] = static_cast<A>(std::cos(r));
          sn[i] = static_cast<A>(std::sin(r));
        }
      }
      if (p.inverse)
        for (int64_t i = 0; i < half; ++i) sn[i] = -sn[i];
      rotate_rows<D>(p, p.q, b, s, cs.data(), sn.data());
      if (p.k.x) rotate_rows<D>(p, p.k, b, s, cs.data(), sn.data());
    }
  }
}

}  // namespace

void cpu_rope(const RopeParams& p, int cpu_threads) {
  host::visit_traits(p.dtype, [&]<class D>() { rope<D>(p, cpu_threads); });
}

}  // namespace optimized
