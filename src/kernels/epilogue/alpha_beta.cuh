// The alpha/beta epilogue of a GEMM: C = alpha * acc + beta * C, in fp32, rounded once to C's
// type. C is not read when beta == 0 (BLAS convention: NaN in the old C does not propagate).
//
// An epilogue functor takes fp32 results of the mainloop and writes them to C: store() one element,
// store2() / store4() two / four consecutive ones (4- / 8-byte aligned, 16-bit C). Linear's bias / activation epilogue
// plugs in the same way.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

  // Two neighbouring 16-bit elements as one 4-byte access (4-byte aligned).
  template <typename T>
  __device__ __forceinline__ void store2(T* c, float v0, float v1) const {
    static_assert(sizeof(T) == 2, "store2 moves two 16-bit elements as one 4-byte access");
    float o0 = alpha * v0, o1 = alpha * v1;
    if (beta != 0.0f) {
      const uint32_t old = *reinterpret_cast<const uint32_t*>(c);
      const T* ov = reinterpret_cast<const T*>(&old);
      o0 = fmaf(beta, to_float(ov[0]), o0);
      o1 = fmaf(beta, to_float(ov[1]), o1);
    }
    uint32_t out;
    T* outv = reinterpret_cast<T*>(&out);
    outv[0] = from_float<T>(o0);
    outv[1] = from_float<T>(o1);
    *reinterpret_cast<uint32_t*>(c) = out;
  }

  template <typename T>
  __device__ __forceinline__ void store4(T* c, float4 v) const {
    static_assert(sizeof(T) == 2, "store4 moves four 16-bit elements as one 8-byte access");
    float o[4] = {alpha * v.x, alpha * v.y, alpha * v.z, alpha * v.w};
    if (beta != 0.0f) {
      const uint2 old = *reinterpret_cast<const uint2*>(c);
      const T* ov = reinterpret_cast<const T*>(&old);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = fmaf(beta, to_float(ov[e]), o[e]);
    }
    uint2 out;
    T* outv = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < 4; ++e) outv[e] = from_float<T>(o[e]);
    *reinterpret_cast<uint2*>(c) = out;
  }
};

}  // namespace optimized::kernels
