// gemm_blocked: cache-blocked loops, no packing of fp32 operands.
//
// C is cut into MB x NB blocks; each block accumulates in an fp32 scratch (fp64 for fp64) over K
// in KB steps.
// Inside a block the loop order is i-k-j: the inner loop runs along a row of B and a row of the
// scratch (both contiguous), so the compiler vectorizes it, and the KB x NB block of B is reused
// by all MB rows while it sits in L2. Threads (OpenMP) take whole (batch, M-block) units.
// Column-major operands: A is read with its strides; B is copied into a row-major tile per block.
// This file is compiled for the baseline ISA, so the vectorization is whatever that allows
// (SSE2 on x86-64): this rung shows what blocking alone buys, the SIMD microkernel is gemm_packed.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gemm/cpu/cpu_gemm.h"
#include "optimized/buffer.h"

namespace optimized::cpu {
namespace {

constexpr int64_t kMB = 64;   // rows of C per block (scratch: MB x NB fp32 = 64 KB)
constexpr int64_t kNB = 256;  // columns of C per block (one scratch row: 1 KB, stays in L1)
constexpr int64_t kKB = 256;  // depth per step (B block KB x NB fp32 = 256 KB, stays in L2)

float widen(float v, DType) { return v; }
double widen(double v, DType) { return v; }
float widen(uint16_t v, DType dtype) {
  return dtype == DType::kF16 ? half_to_float(v) : bf16_to_float(v);
}
void narrow(float v, float* out, DType) { *out = v; }
void narrow(double v, double* out, DType) { *out = v; }
void narrow(float v, uint16_t* out, DType dtype) {
  *out = dtype == DType::kF16 ? float_to_half(v) : float_to_bf16(v);
}

template <class T>
void run(const GemmParams& p, int threads) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;  // fp64 accumulates in fp64
  const Acc alpha = p.alpha, beta = p.beta;
  const int64_t m_blocks = (p.m + kMB - 1) / kMB;
  const int64_t units = p.batch * m_blocks;
  int nth = threads > 0 ? threads : omp_get_max_threads();
  nth = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nth, units)));
  constexpr bool kWide = std::is_same_v<T, Acc>;
  // B is read in place when it is row-major fp32/fp64; 16-bit or column-major B is copied (widened,
  // row-major) into a tile first. A is read with its strides along rows and along K.
  const bool b_in_place = kWide && !p.trans_b;
  const int64_t a_rs = p.trans_a ? 1 : p.lda, a_cs = p.trans_a ? p.lda : 1;

#pragma omp parallel num_threads(nth)
  {
    std::vector<Acc> acc(kMB * kNB);
    std::vector<Acc> btile(b_in_place ? 0 : kKB * kNB);

#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t bi = u / m_blocks;
      const int64_t i0 = (u % m_blocks) * kMB;
      const int64_t mb = std::min(kMB, p.m - i0);
      const T* a = static_cast<const T*>(p.a) + bi * p.batch_stride_a + i0 * a_rs;
      const T* b = static_cast<const T*>(p.b) + bi * p.batch_stride_b;
      T* c = static_cast<T*>(p.c) + bi * p.batch_stride_c + i0 * p.ldc;

      for (int64_t j0 = 0; j0 < p.n; j0 += kNB) {
        const int64_t nb = std::min(kNB, p.n - j0);
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t k0 = 0; k0 < p.k; k0 += kKB) {
          const int64_t kb = std::min(kKB, p.k - k0);
          const Acc* bblk;
          int64_t ldbb;
          if (b_in_place) {
            bblk = reinterpret_cast<const Acc*>(b) + k0 * p.ldb + j0;
            ldbb = p.ldb;
          } else {
            for (int64_t k = 0; k < kb; ++k)
              for (int64_t j = 0; j < nb; ++j)
                btile[k * kNB + j] = widen(b[p.b_index(k0 + k, j0 + j)], p.dtype);
            bblk = btile.data();
            ldbb = kNB;
          }
          for (int64_t i = 0; i < mb; ++i) {
            Acc* __restrict crow = acc.data() + i * kNB;
            const T* ai = a + i * a_rs + k0 * a_cs;
            for (int64_t k = 0; k < kb; ++k) {
              const Acc aik = widen(ai[k * a_cs], p.dtype);
              const Acc* __restrict brow = bblk + k * ldbb;
              for (int64_t j = 0; j < nb; ++j) crow[j] += aik * brow[j];
            }
          }
        }
        for (int64_t i = 0; i < mb; ++i) {
          const Acc* crow = acc.data() + i * kNB;
          T* out = c + i * p.ldc + j0;
          if (beta == 0) {
            for (int64_t j = 0; j < nb; ++j) narrow(alpha * crow[j], out + j, p.dtype);
          } else {
            for (int64_t j = 0; j < nb; ++j)
              narrow(alpha * crow[j] + beta * widen(out[j], p.dtype), out + j, p.dtype);
          }
        }
      }
    }
  }
}

}  // namespace

void gemm_blocked(const GemmParams& p, int threads) {
  if (p.dtype == DType::kF32) return run<float>(p, threads);
  if (p.dtype == DType::kF64) return run<double>(p, threads);
  return run<uint16_t>(p, threads);
}

}  // namespace optimized::cpu
