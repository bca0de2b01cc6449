// Element types on the device: conversions to and from the fp32 every kernel computes in, the
// CUDA type of each DType, and vectors of a row loaded or stored as one access.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "optimized/core.h"

namespace optimized::kernels {

// ---- conversions ---------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// Round to nearest even.
template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// ---- DType <-> CUDA type -------------------------------------------------------------------
template <typename T> constexpr DType kDTypeOf = DType::kF64;  // no CUDA kernel takes fp64
template <> constexpr DType kDTypeOf<float> = DType::kF32;
template <> constexpr DType kDTypeOf<__half> = DType::kF16;
template <> constexpr DType kDTypeOf<__nv_bfloat16> = DType::kBF16;

template <DType kDType> struct CudaTypeOf;
template <> struct CudaTypeOf<DType::kF32> { using type = float; };
template <> struct CudaTypeOf<DType::kF16> { using type = __half; };
template <> struct CudaTypeOf<DType::kBF16> { using type = __nv_bfloat16; };
template <DType kDType> using cuda_type_t = typename CudaTypeOf<kDType>::type;

// ---- vectors -------------------------------------------------------------------------------
// kVec elements of T loaded or stored as one access: 16 bytes when rows are aligned, else 1
// element (the fallback for rows that do not start on a 16-byte boundary).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};

// 16 bytes of T, in elements.
template <typename T> constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, kVec>*>(p);
}
// Streaming (evict-first) load for data read exactly once, so that it does not push out of L2 what
// will be read again.
template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> load_vec_once(const T* p) {
  if constexpr (sizeof(T) * kVec == 16) {
    uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<Vec<T, kVec>*>(&u);
  } else {
    return *reinterpret_cast<const Vec<T, kVec>*>(p);
  }
}
template <typename T, int kVec>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, kVec>& v) {
  *reinterpret_cast<Vec<T, kVec>*>(p) = v;
}
// Streaming (evict-first) store for output that is not read again soon, so that it does not push out
// of L2 what will be.
template <typename T, int kVec>
__device__ __forceinline__ void store_vec_once(T* p, const Vec<T, kVec>& v) {
  if constexpr (sizeof(T) * kVec == 16) {
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<const uint4*>(&v));
  } else {
    *reinterpret_cast<Vec<T, kVec>*>(p) = v;
  }
}

}  // namespace optimized::kernels
