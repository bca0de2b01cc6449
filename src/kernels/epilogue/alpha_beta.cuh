// The alpha/beta epilogue of a GEMM: C = alpha * acc + beta * C, in fp32, rounded once to C's
// type. C is not read when beta == 0 (BLAS convention: NaN in the old C does not propagate).
//
// The store of the rungs that take no epilogue (the ladder's teaching rungs and gemv); the rungs
// that do use the fused epilogue functor (fused_epilogue.cuh), which starts with the same alpha /
// beta arithmetic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/dtype.cuh"

namespace optimized::kernels {

template <typename T>
__device__ __forceinline__ void store_alpha_beta(T* c, float acc, float alpha, float beta) {
  float out = alpha * acc;
  if (beta != 0.0f) out = fmaf(beta, to_float(*c), out);
  *c = from_float<T>(out);
}

// The same as a functor at (batch, row, column) of C (row-major, type TC), with the interface of
// FusedEpilogue (fused_epilogue.cuh) but nothing else to read or write: the small store the
// Hopper rungs use when no epilogue is asked for (the fused one's extra branches, inlined at every
// element of a 64 x 256 tile, would only cost code size and compile time there).
template <typename TC>
struct AlphaBetaOutput {
  float alpha, beta;
  TC* c;
  int64_t ldc, batch_stride_c;
  bool pairs;          // two neighbouring columns (even col) are one aligned access
  bool quads = false;  // four (col a multiple of 4) are one aligned access too

  __device__ __forceinline__ float store(int64_t z, int64_t row, int64_t col, float acc) const {
    TC* p = c + z * batch_stride_c + row * ldc + col;
    float out = alpha * acc;
    if (beta != 0.0f) out = fmaf(beta, to_float(*p), out);
    *p = from_float<TC>(out);
    return out;
  }
  // The interface of FusedEpilogue's staged walk (no bias here; the only input is C).
  struct Inputs {
    float c0 = 0.0f, c1 = 0.0f;
  };
  struct Cursor {
    TC* c;
  };
  __device__ __forceinline__ float2 column_bias(int64_t, bool) const { return make_float2(0.0f, 0.0f); }
  __device__ __forceinline__ Cursor cursor(int64_t z, int64_t row, int64_t col) const {
    return {c + z * batch_stride_c + row * ldc + col};
  }
  __device__ __forceinline__ void advance(Cursor& at, int rows) const { at.c += rows * ldc; }
  __device__ __forceinline__ Inputs load2(const Cursor& at) const {
    Inputs in;
    if (beta != 0.0f) {
      if (pairs) {
        using Pair = std::conditional_t<sizeof(TC) == 2, uint32_t, float2>;
        const Pair w = *reinterpret_cast<const Pair*>(at.c);
        const TC* v = reinterpret_cast<const TC*>(&w);
        in.c0 = to_float(v[0]);
        in.c1 = to_float(v[1]);
      } else {
        in.c0 = to_float(at.c[0]);
        in.c1 = to_float(at.c[1]);
      }
    }
    return in;
  }
  __device__ __forceinline__ void finish2(const Cursor& at, float acc0, float acc1, const Inputs& in, float2,
                                          float* out0, float* out1) const {
    const float o0 = fmaf(beta, in.c0, alpha * acc0), o1 = fmaf(beta, in.c1, alpha * acc1);
    if (pairs) {
      using Pair = std::conditional_t<sizeof(TC) == 2, uint32_t, float2>;
      Pair w;
      TC* wv = reinterpret_cast<TC*>(&w);
      wv[0] = from_float<TC>(o0);
      wv[1] = from_float<TC>(o1);
      *reinterpret_cast<Pair*>(at.c) = w;
    } else {
      at.c[0] = from_float<TC>(o0);
      at.c[1] = from_float<TC>(o1);
    }
    *out0 = o0;
    *out1 = o1;
  }

  __device__ __forceinline__ void store2(int64_t z, int64_t row, int64_t col, float acc0, float acc1, float* out0,
                                         float* out1) const {
    if (!pairs) {
      *out0 = store(z, row, col, acc0);
      *out1 = store(z, row, col + 1, acc1);
      return;
    }
    using Pair = std::conditional_t<sizeof(TC) == 2, uint32_t, float2>;
    Pair* p = reinterpret_cast<Pair*>(c + z * batch_stride_c + row * ldc + col);
    float o0 = alpha * acc0, o1 = alpha * acc1;
    if (beta != 0.0f) {
      const Pair old = *p;
      const TC* ov = reinterpret_cast<const TC*>(&old);
      o0 = fmaf(beta, to_float(ov[0]), o0);
      o1 = fmaf(beta, to_float(ov[1]), o1);
    }
    Pair w;
    TC* wv = reinterpret_cast<TC*>(&w);
    wv[0] = from_float<TC>(o0);
    wv[1] = from_float<TC>(o1);
    *p = w;
    *out0 = o0;
    *out1 = o1;
  }
  __device__ __forceinline__ void store4(int64_t z, int64_t row, int64_t col, float4 acc, float4* out) const {
    if (!quads) {
      store2(z, row, col, acc.x, acc.y, &out->x, &out->y);
      store2(z, row, col + 2, acc.z, acc.w, &out->z, &out->w);
      return;
    }
    using Quad = std::conditional_t<sizeof(TC) == 2, uint2, float4>;
    Quad* p = reinterpret_cast<Quad*>(c + z * batch_stride_c + row * ldc + col);
    float o[4] = {alpha * acc.x, alpha * acc.y, alpha * acc.z, alpha * acc.w};
    if (beta != 0.0f) {
      const Quad old = *p;
      const TC* ov = reinterpret_cast<const TC*>(&old);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = fmaf(beta, to_float(ov[e]), o[e]);
    }
    Quad w;
    TC* wv = reinterpret_cast<TC*>(&w);
#pragma unroll
    for (int e = 0; e < 4; ++e) wv[e] = from_float<TC>(o[e]);
    *p = w;
    *out = make_float4(o[0], o[1], o[2], o[3]);
  }
};

}  // namespace optimized::kernels
