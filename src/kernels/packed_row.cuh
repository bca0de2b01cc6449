// Rows held in registers in their packed storage type, and the loads and stores that keep them so:
// the helpers of the register-resident designs (fused/cuda/row_registers.cuh, cross-entropy's
// registers rung in fused/cuda/cross_entropy.cu).
#pragma once

#include <cstring>

#include "kernels/dtype.cuh"

namespace optimized::kernels {

// A row kept in registers in its storage type (a 16-byte vector is 4 registers for any dtype; its
// fp32 values are 8 for bf16 / fp16) and converted at each use. The compiler would rather keep the
// fp32 values of the first pass live across a reduction than convert again; keep_packed hides the
// vector's value behind an empty asm, so every pass after it converts anew (the same values: the
// conversions are exact).
template <typename T, int kVec>
__device__ __forceinline__ void keep_packed(Vec<T, kVec>& v) {
  if constexpr (sizeof(Vec<T, kVec>) % 4 == 0) {
    unsigned words[sizeof(Vec<T, kVec>) / 4];
    memcpy(words, &v, sizeof(words));
#pragma unroll
    for (unsigned& w : words) asm volatile("" : "+r"(w));
    memcpy(&v, words, sizeof(words));
  } else {
    static_assert(sizeof(Vec<T, kVec>) == 2, "one 16-bit element");
    unsigned short half;
    memcpy(&half, &v, sizeof(half));
    asm volatile("" : "+h"(half));
    memcpy(&v, &half, sizeof(half));
  }
}
template <typename T, int kVec, int kV>
__device__ __forceinline__ void keep_packed(Vec<T, kVec> (&v)[kV]) {
#pragma unroll
  for (int i = 0; i < kV; ++i) keep_packed(v[i]);
}

// Stores one vector of a row as one 16-byte store. Built element by element (from_float), a Vec
// reaches memory in 16- or 32-bit pieces otherwise (SASS: STG.E.U16 / STG.E for part of the
// softmax output and all of residual_out, also through a uint4), and partial stores cost L2
// read-modify-writes. A plain weak store; no memory clobber: the kernel never reads what it
// stores, and an in-place row's store depends on its loads through the data.
template <typename T, int kVec>
__device__ __forceinline__ void store_row_vec(T* p, const Vec<T, kVec>& v) {
  if constexpr (sizeof(Vec<T, kVec>) == 16) {
    unsigned w[4];
    memcpy(w, &v, sizeof(w));
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]));
  } else {
    store_vec<T, kVec>(p, v);
  }
}

// One vector of a row where `ok`, else zeros: a streaming (evict-first) load like load_vec_once,
// predicated rather than branched over for 16-byte vectors. Behind a branch the compiler unpacked
// the vector into its elements inside the branch, which waited for the data there: the next
// vector's loads came one memory latency later (norms' backward, 64 registers).
template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> load_row_vec_if(bool ok, const T* p) {
  if constexpr (sizeof(Vec<T, kVec>) == 16) {
    unsigned w[4];
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t"
        "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
        "@p ld.global.cs.v4.b32 {%0, %1, %2, %3}, [%4];\n\t}"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
        : "l"(p), "r"(static_cast<int>(ok)));
    Vec<T, kVec> v;
    memcpy(&v, w, sizeof(w));
    return v;
  } else {
    return ok ? load_vec_once<T, kVec>(p) : Vec<T, kVec>{};
  }
}

}  // namespace optimized::kernels
