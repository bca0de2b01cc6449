// AVX-512 pieces of gemm_packed: a 14 x 32 fp32 microkernel (28 zmm accumulators, 2 zmm of B,
// A broadcast from memory), packing and the fp16/bf16 epilogue. Compiled with -mavx512f ... ;
// gemm_packed.cpp calls into this file only when cpuid reports avx512f.
#include <immintrin.h>

#include "gemm/cpu/gemm_packed_kernels.h"

namespace optimized::cpu::packed {
namespace {

constexpr int kMR = 14;
constexpr int kNR = 32;

// Full MR x NR tile. Ap: kc groups of MR floats; Bp: kc groups of NR floats (64-byte aligned).
void kernel_full(int64_t kc, const float* __restrict ap, const float* __restrict bp, float* c,
                 int64_t ldc, float alpha, float beta) {
  __m512 c0[kMR], c1[kMR];
#pragma GCC unroll 14
  for (int i = 0; i < kMR; ++i) {
    c0[i] = _mm512_setzero_ps();
    c1[i] = _mm512_setzero_ps();
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + 31), _MM_HINT_T0);
  }
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(bp);
    const __m512 b1 = _mm512_load_ps(bp + 16);
    _mm_prefetch(reinterpret_cast<const char*>(bp + 8 * kNR), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bp + 8 * kNR + 16), _MM_HINT_T0);
#pragma GCC unroll 14
    for (int i = 0; i < kMR; ++i) {
      const __m512 a = _mm512_set1_ps(ap[i]);
      c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
    }
    ap += kMR;
    bp += kNR;
  }
  const __m512 va = _mm512_set1_ps(alpha);
  if (beta == 0.0f) {
#pragma GCC unroll 14
    for (int i = 0; i < kMR; ++i) {
      _mm512_storeu_ps(c + i * ldc, _mm512_mul_ps(va, c0[i]));
      _mm512_storeu_ps(c + i * ldc + 16, _mm512_mul_ps(va, c1[i]));
    }
  } else {
    const __m512 vb = _mm512_set1_ps(beta);
#pragma GCC unroll 14
    for (int i = 0; i < kMR; ++i) {
      float* r = c + i * ldc;
      _mm512_storeu_ps(r, _mm512_fmadd_ps(vb, _mm512_loadu_ps(r), _mm512_mul_ps(va, c0[i])));
      _mm512_storeu_ps(r + 16,
                       _mm512_fmadd_ps(vb, _mm512_loadu_ps(r + 16), _mm512_mul_ps(va, c1[i])));
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

// fp32 B panels: one or two 16-wide (masked at the edge) copies per row.
void pack_b(DType dtype, const void* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, float* bp) {
  if (dtype != DType::kF16 || cs != 1) return pack_b_dispatch<kNR>(dtype, b, rs, cs, kc, nc, bp);
  // Row-major fp16: widen 16 at a time with vcvtph2ps (exact).
  const int64_t ldb = rs;
  const uint16_t* src = static_cast<const uint16_t*>(b);
  for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
    const int64_t cols = nc - j0 < kNR ? nc - j0 : kNR;
    const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
    for (int64_t k = 0; k < kc; ++k) {
      const uint16_t* s = src + k * ldb + j0;
      const __m256i h0 = _mm256_maskz_loadu_epi16(m0, s);
      const __m256i h1 = _mm256_maskz_loadu_epi16(m1, s + 16);
      _mm512_store_ps(bp + k * kNR, _mm512_maskz_cvtph_ps(0xffff, h0));
      _mm512_store_ps(bp + k * kNR + 16, _mm512_maskz_cvtph_ps(0xffff, h1));
    }
    bp += kNR * kc;
  }
}

void epilogue(DType dtype, const float* w, int64_t ldw, void* c, int64_t ldc, int64_t rows,
              int64_t n, float alpha, float beta) {
  uint16_t* c16 = static_cast<uint16_t*>(c);
  if (dtype == DType::kBF16) return epilogue_bf16(w, ldw, c16, ldc, rows, n, alpha, beta);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int64_t r = 0; r < rows; ++r) {
    const float* wr = w + r * ldw;
    uint16_t* cr = c16 + r * ldc;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 mk = n - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - j)) - 1);
      __m512 v = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(mk, wr + j));
      if (beta != 0.0f) {
        const __m512 old = _mm512_maskz_cvtph_ps(mk, _mm256_maskz_loadu_epi16(mk, cr + j));
        v = _mm512_fmadd_ps(vb, old, v);
      }
      const __m256i h = _mm512_maskz_cvtps_ph(0xffff, v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_mask_storeu_epi16(cr + j, mk, h);
    }
  }
}

}  // namespace

const IsaOps& avx512_ops() {
  // KC = 256: one 14 x 256 A micro-panel (14 KB) stays in the 48 KB L1 while 32-wide B
  // micro-panels (32 KB each) stream from L2; the 256 x 1024 B block (1 MB) fits the 2 MB L2.
  // MC = 112 (8 micro-panels) only sets the size of a unit of work. Measured against
  // KC/NC = 384/768 and 512/512 (same L2 footprint): all within noise, 256/1024 best at 1 thread.
  static const IsaOps ops{"avx512", {kMR, kNR, 112, 256, 1024}, pack_a, pack_b, kernel, epilogue};
  return ops;
}

}  // namespace optimized::cpu::packed
