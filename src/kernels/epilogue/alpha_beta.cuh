// The alpha/beta epilogue of a GEMM: C = alpha * acc + beta * C, in fp32, rounded once to C's
// type. C is not read when beta == 0 (BLAS convention: NaN in the old C does not propagate).
//
// An epilogue functor takes fp32 results of the mainloop and writes them to C: store() one element,
// store2() / store4() two / four consecutive ones (4- / 8-byte aligned, 16-bit C). Linear's bias / activation epilogue
// plugs in the same way.
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

struct AlphaBetaEpilogue {
  float alpha;
  float beta;

  template <typename T>
  __device__ __forceinline__ void store(T* c, float acc) const {
    store_alpha_beta(c, acc, alpha, beta);
  }

  // kN consecutive 16-bit elements as one access (4 or 8 bytes, aligned to it).
  template <int kN, typename T>
  __device__ __forceinline__ void store_n(T* c, const float (&v)[kN]) const {
    static_assert(sizeof(T) == 2 && (kN == 2 || kN == 4), "two or four 16-bit elements as one access");
    using Word = std::conditional_t<kN == 2, uint32_t, uint2>;
    float o[kN];
#pragma unroll
    for (int e = 0; e < kN; ++e) o[e] = alpha * v[e];
    if (beta != 0.0f) {
      const Word old = *reinterpret_cast<const Word*>(c);
      const T* ov = reinterpret_cast<const T*>(&old);
#pragma unroll
      for (int e = 0; e < kN; ++e) o[e] = fmaf(beta, to_float(ov[e]), o[e]);
    }
    Word out;
    T* outv = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < kN; ++e) outv[e] = from_float<T>(o[e]);
    *reinterpret_cast<Word*>(c) = out;
  }
  template <typename T>
  __device__ __forceinline__ void store2(T* c, float v0, float v1) const {
    const float v[2] = {v0, v1};
    store_n<2>(c, v);
  }
  template <typename T>
  __device__ __forceinline__ void store4(T* c, float4 v) const {
    const float f[4] = {v.x, v.y, v.z, v.w};
    store_n<4>(c, f);
  }
};

}  // namespace optimized::kernels
