// AVX2 + FMA pieces of gemm_packed: a 6 x 16 fp32 microkernel (12 ymm accumulators, 2 ymm of B,
// A broadcast from memory), packing and the fp16/bf16 epilogue. Compiled with -mavx2 -mfma -mf16c;
// gemm_packed.cpp calls into this file only when cpuid reports avx2 and fma.
#include <immintrin.h>

#include <cmath>

#include "gemm/cpu/gemm_packed_kernels.h"

namespace optimized::cpu::packed {
namespace {

constexpr int kMR = 6;
constexpr int kNR = 16;

void kernel_full(int64_t kc, const float* __restrict ap, const float* __restrict bp, float* c,
                 int64_t ldc, float alpha, float beta) {
  __m256 c0[kMR], c1[kMR];
#pragma GCC unroll 6
  for (int i = 0; i < kMR; ++i) {
    c0[i] = _mm256_setzero_ps();
    c1[i] = _mm256_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 15), _MM_HINT_T0);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(bp);
    const __m256 b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) {
      const __m256 a = _mm256_broadcast_ss(ap + i);
      c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
    }
    ap += kMR;
    bp += kNR;
  }
  const __m256 va = _mm256_set1_ps(alpha);
  if (beta == 0.0f) {
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) {
      _mm256_storeu_ps(c + i * ldc, _mm256_mul_ps(va, c0[i]));
      _mm256_storeu_ps(c + i * ldc + 8, _mm256_mul_ps(va, c1[i]));
    }
  } else {
    const __m256 vb = _mm256_set1_ps(beta);
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) {
      float* r = c + i * ldc;
      _mm256_storeu_ps(r, _mm256_fmadd_ps(vb, _mm256_loadu_ps(r), _mm256_mul_ps(va, c0[i])));
      _mm256_storeu_ps(r + 8, _mm256_fmadd_ps(vb, _mm256_loadu_ps(r + 8), _mm256_mul_ps(va, c1[i])));
    }
  }
}

void kernel(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, float alpha,
            float beta, int m, int n) {
  if (m == kMR && n == kNR) return kernel_full(kc, ap, bp, c, ldc, alpha, beta);
  kernel_edge<kMR, kNR>(kernel_full, kc, ap, bp, c, ldc, alpha, beta, m, n);
}

void pack_a(DType dtype, const void* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* ap) {
  pack_a_dispatch<kMR>(dtype, a, rs, cs, mc, kc, ap);
}

void pack_b(DType dtype, const void* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, float* bp) {
  pack_b_dispatch<kNR>(dtype, b, rs, cs, kc, nc, bp);
}

void epilogue(DType dtype, const float* w, int64_t ldw, void* c, int64_t ldc, int64_t rows,
              int64_t n, float alpha, float beta) {
  uint16_t* c16 = static_cast<uint16_t*>(c);
  if (dtype == DType::kBF16) return epilogue_bf16(w, ldw, c16, ldc, rows, n, alpha, beta);
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  for (int64_t r = 0; r < rows; ++r) {
    const float* wr = w + r * ldw;
    uint16_t* cr = c16 + r * ldc;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 v = _mm256_mul_ps(va, _mm256_loadu_ps(wr + j));
      if (beta != 0.0f) {
        const __m256 old = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cr + j)));
        v = _mm256_fmadd_ps(vb, old, v);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cr + j),
                       _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; j < n; ++j) {
      float v = alpha * wr[j];
      if (beta != 0.0f) v = std::fmaf(beta, _cvtsh_ss(cr[j]), v);
      cr[j] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
  }
}

}  // namespace

const IsaOps& avx2_ops() {
  // Same scheme as AVX-512: 6 x 256 A micro-panel (6 KB) in L1, 256 x 1024 B block (1 MB) in L2.
  static const IsaOps ops{"avx2", {kMR, kNR, 96, 256, 1024}, pack_a, pack_b, kernel, epilogue};
  return ops;
}

}  // namespace optimized::cpu::packed
