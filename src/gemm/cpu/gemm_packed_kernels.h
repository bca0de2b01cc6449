// Private to the gemm_packed*.cpp files: the interface between the ISA-neutral driver
// (gemm_packed.cpp: loops, blocking, threads) and the per-ISA pieces (packing, microkernel,
// epilogue), each compiled in its own file with its own -m flags.
//
// Everything defined (not just declared) in this header lives in an anonymous namespace, so each
// translation unit gets its own copy compiled for its own ISA. Without that, the linker could keep
// one TU's AVX-512 instantiation of an inline template and call it from the portable path: an
// illegal instruction on a machine without AVX-512.
#pragma once

#include <bit>
#include <cstdint>
#include <type_traits>

#include "optimized/core.h"

namespace optimized::cpu::packed {

// Register tile MR x NR of the microkernel and the cache blocks (in elements):
//   KC: depth of one rank-KC update (packed A micro-panel MR x KC, packed B micro-panel KC x NR);
//   MC: rows of A packed per block (MC x KC, one per thread, meant to stay in L2);
//   NC: columns of B packed per block (KC x NC, shared by all threads).
struct Blocking {
  int mr, nr;
  int64_t mc, kc, nc;
};

// One ISA's pieces. Packed panels are fp32, whatever the input dtype (fp16/bf16 are widened while
// packing), so the microkernel is fp32 only.
struct IsaOps {
  const char* name;  // "avx512", "avx2", "portable"
  Blocking blk;
  // Pack rows [0, mc) x cols [0, kc) of A (element (i, k) at a[i * rs + k * cs], elements of
  // `dtype`: rs = lda, cs = 1 row-major; rs = 1, cs = lda column-major) into ceil(mc/MR)
  // micro-panels, each k-major (MR values per k), rows past mc zero-filled. Packing is where the
  // layouts meet: whatever A's layout, the panels are the same.
  void (*pack_a)(DType dtype, const void* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* ap);
  // Pack rows [0, kc) x cols [0, nc) of B (element (k, j) at b[k * rs + j * cs]) into ceil(nc/NR)
  // micro-panels, each k-major (NR values per k), columns past nc zero-filled.
  void (*pack_b)(DType dtype, const void* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, float* bp);
  // C[0:m, 0:n] = alpha * (Ap @ Bp) + beta * C for m <= MR, n <= NR; beta == 0: C is not read.
  void (*kernel)(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, float alpha,
                 float beta, int m, int n);
  // For fp16/bf16 C: C[r, 0:n] = round(alpha * W[r, 0:n] + beta * C[r, 0:n]) for r in [0, rows);
  // W is the fp32 accumulator workspace. beta == 0: C is not read.
  void (*epilogue)(DType dtype, const float* w, int64_t ldw, void* c, int64_t ldc, int64_t rows,
                   int64_t n, float alpha, float beta);
};

const IsaOps& avx512_ops();    // gemm_packed_avx512.cpp; call only where avx512f is supported
const IsaOps& avx2_ops();      // gemm_packed_avx2.cpp; call only where avx2 and fma are supported
const IsaOps& portable_ops();  // gemm_packed.cpp

namespace {  // per-TU copies, see the note at the top

// Exact fp16 -> fp32 without a table or a call (subnormals through one exact multiply).
inline float h2f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return std::bit_cast<float>(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  const float mag = std::bit_cast<float>(em << 13) * 0x1p112f;  // exact for normals and subnormals
  return std::bit_cast<float>(std::bit_cast<uint32_t>(mag) | sign);
}
inline float bf2f(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }
// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f2bf(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

struct LoadF32 {
  using T = float;
  static float load(float v) { return v; }
};
struct LoadF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return h2f(v); }
};
struct LoadBF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return bf2f(v); }
};

// The packing loops with A's (B's) strides; Cs is int64_t, or std::integral_constant<int64_t, 1>
// for the row-major case so that the compiler sees unit-stride loads.
template <int MR, class L, class Cs>
void pack_a_strided(const typename L::T* a, int64_t rs, Cs cs, int64_t mc, int64_t kc, float* ap) {
  for (int64_t i0 = 0; i0 < mc; i0 += MR) {
    const int64_t rows = mc - i0 < MR ? mc - i0 : MR;
    const typename L::T* src = a + i0 * rs;
    if (rows == MR) {
      for (int64_t k = 0; k < kc; ++k) {
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) ap[k * MR + i] = L::load(src[i * rs + k * cs]);
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        for (int i = 0; i < MR; ++i) ap[k * MR + i] = i < rows ? L::load(src[i * rs + k * cs]) : 0.0f;
      }
    }
    ap += MR * kc;
  }
}

template <int NR, class L, class Cs>
void pack_b_strided(const typename L::T* b, int64_t rs, Cs cs, int64_t kc, int64_t nc, float* bp) {
  for (int64_t j0 = 0; j0 < nc; j0 += NR) {
    const int64_t cols = nc - j0 < NR ? nc - j0 : NR;
    const typename L::T* src = b + j0 * cs;
    if (cols == NR) {
      for (int64_t k = 0; k < kc; ++k) {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) bp[k * NR + j] = L::load(src[k * rs + j * cs]);
      }
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        for (int j = 0; j < NR; ++j) bp[k * NR + j] = j < cols ? L::load(src[k * rs + j * cs]) : 0.0f;
      }
    }
    bp += NR * kc;
  }
}

using Unit = std::integral_constant<int64_t, 1>;

template <int MR, class L>
void pack_a_generic(const typename L::T* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* ap) {
  if (cs == 1) return pack_a_strided<MR, L>(a, rs, Unit{}, mc, kc, ap);
  pack_a_strided<MR, L>(a, rs, cs, mc, kc, ap);
}

template <int NR, class L>
void pack_b_generic(const typename L::T* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, float* bp) {
  if (cs == 1) return pack_b_strided<NR, L>(b, rs, Unit{}, kc, nc, bp);
  pack_b_strided<NR, L>(b, rs, cs, kc, nc, bp);
}

template <int MR>
void pack_a_dispatch(DType dtype, const void* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* ap) {
  switch (dtype) {
    case DType::kF16:
      return pack_a_generic<MR, LoadF16>(static_cast<const uint16_t*>(a), rs, cs, mc, kc, ap);
    case DType::kBF16:
      return pack_a_generic<MR, LoadBF16>(static_cast<const uint16_t*>(a), rs, cs, mc, kc, ap);
    default:
      return pack_a_generic<MR, LoadF32>(static_cast<const float*>(a), rs, cs, mc, kc, ap);
  }
}

template <int NR>
void pack_b_dispatch(DType dtype, const void* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, float* bp) {
  switch (dtype) {
    case DType::kF16:
      return pack_b_generic<NR, LoadF16>(static_cast<const uint16_t*>(b), rs, cs, kc, nc, bp);
    case DType::kBF16:
      return pack_b_generic<NR, LoadBF16>(static_cast<const uint16_t*>(b), rs, cs, kc, nc, bp);
    default:
      return pack_b_generic<NR, LoadF32>(static_cast<const float*>(b), rs, cs, kc, nc, bp);
  }
}

// Partial tile: the full MR x NR tile goes to a local buffer (beta 0, alpha 1), then its valid
// part is merged into C. `full` is the ISA's full-tile kernel.
template <int MR, int NR, class Full>
void kernel_edge(Full full, int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc,
                 float alpha, float beta, int m, int n) {
  alignas(64) float tmp[MR * NR];
  full(kc, ap, bp, tmp, NR, 1.0f, 0.0f);
  for (int i = 0; i < m; ++i) {
    float* crow = c + i * ldc;
    const float* t = tmp + i * NR;
    if (beta == 0.0f) {
      for (int j = 0; j < n; ++j) crow[j] = alpha * t[j];
    } else {
      for (int j = 0; j < n; ++j) crow[j] = alpha * t[j] + beta * crow[j];
    }
  }
}

// bf16 epilogue (the fp16 one needs a converter per ISA); the loop auto-vectorizes.
inline void epilogue_bf16(const float* w, int64_t ldw, uint16_t* c, int64_t ldc, int64_t rows,
                          int64_t n, float alpha, float beta) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* wr = w + r * ldw;
    uint16_t* cr = c + r * ldc;
    if (beta == 0.0f) {
      for (int64_t j = 0; j < n; ++j) cr[j] = f2bf(alpha * wr[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) cr[j] = f2bf(alpha * wr[j] + beta * bf2f(cr[j]));
    }
  }
}

}  // namespace
}  // namespace optimized::cpu::packed
