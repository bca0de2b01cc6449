// Device helpers shared by the GEMM kernels: element conversion, the batch offset, and the
// alpha/beta epilogue. Header-only; included by each gemm_*.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gemm/gemm_params.h"

namespace optimized::cuda {

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// C element = alpha * acc + beta * C element; C is not read when beta == 0 (BLAS convention).
template <typename T>
__device__ __forceinline__ void store_epilogue(T* c, float acc, float alpha, float beta) {
  float out = alpha * acc;
  if (beta != 0.0f) out = fmaf(beta, to_float(*c), out);
  *c = from_float<T>(out);
}

// Pointers to the operands of batch `z` (blockIdx.z in every kernel).
template <typename T>
struct BatchOperands {
  const T* a;
  const T* b;
  T* c;
};

template <typename T>
__device__ __forceinline__ BatchOperands<T> batch_operands(const GemmParams& p, int64_t z) {
  return {static_cast<const T*>(p.a) + z * p.batch_stride_a,
          static_cast<const T*>(p.b) + z * p.batch_stride_b,
          static_cast<T*>(p.c) + z * p.batch_stride_c};
}

// Runs `body.template operator()<T>()` with T the CUDA element type of p.dtype (fp32/fp16/bf16).
// Returns cudaErrorInvalidValue for any other dtype (the public API rejects those first).
template <typename Body>
cudaError_t dispatch_float_dtype(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::kF32: return body.template operator()<float>();
    case DType::kF16: return body.template operator()<__half>();
    case DType::kBF16: return body.template operator()<__nv_bfloat16>();
    default: return cudaErrorInvalidValue;
  }
}
template <typename Body>
cudaError_t dispatch_half_dtype(DType dtype, Body&& body) {
  switch (dtype) {
    case DType::kF16: return body.template operator()<__half>();
    case DType::kBF16: return body.template operator()<__nv_bfloat16>();
    default: return cudaErrorInvalidValue;
  }
}

// Grid dimension z carries the batch; CUDA caps it at 65535.
constexpr int64_t kMaxGridZ = 65535;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace optimized::cuda
