// gemm_naive: the i-j-k triple loop, one fp32 accumulator (fp64 for fp64) per element of C, one thread.
// The readable baseline of the CPU ladder. The inner loop walks B down a column (stride ldb), so
// every load of B touches a new cache line once N is more than a few lines wide. Both operands are
// read through the params' layout (a_index, b_index): row- or column-major.
#include <cstdint>

#include "core/host_dtype.h"
#include "gemm/cpu/cpu_gemm.h"

namespace optimized::cpu {
namespace {

using namespace host;  // F32, F64, F16, BF16

template <class D>
void run(const GemmParams& p) {
  using T = typename D::T;
  for (int64_t bi = 0; bi < p.batch; ++bi) {
    const T* a = static_cast<const T*>(p.a) + bi * p.batch_stride_a;
    const T* b = static_cast<const T*>(p.b) + bi * p.batch_stride_b;
    T* c = static_cast<T*>(p.c) + bi * p.batch_stride_c;
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = 0; j < p.n; ++j) {
        typename D::Acc acc = 0;
        const typename D::Acc alpha = p.alpha, beta = p.beta;
        for (int64_t k = 0; k < p.k; ++k) acc += D::load(a[p.a_index(i, k)]) * D::load(b[p.b_index(k, j)]);
        T& out = c[i * p.ldc + j];
        // beta == 0: C is write-only (its old value, NaN or not, is never read).
        out = D::store(beta == 0 ? alpha * acc : alpha * acc + beta * D::load(out));
      }
    }
  }
}

}  // namespace

void gemm_naive(const GemmParams& p) {
  host::visit_traits(p.dtype, [&]<class D>() { run<D>(p); });
}

}  // namespace optimized::cpu
