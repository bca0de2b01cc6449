// The dtype dispatch of the launchers: runs a body templated on the CUDA element type of a DType.
//
//   return dispatch_dtype<float, __half, __nv_bfloat16>(p.dtype, [&]<typename T>() -> cudaError_t {
//     ... launch kernel<T> ...
//   });
//
// A dtype outside the list returns cudaErrorInvalidValue: launchers never throw, and the C++ API
// refuses such dtypes first with a message naming what is supported (the family's variant table).
#pragma once

#include <cuda_runtime.h>

#include "kernels/dtype.cuh"

namespace optimized::kernels {

template <typename... Ts, typename Body>
cudaError_t dispatch_dtype(DType dtype, Body&& body) {
  cudaError_t result = cudaErrorInvalidValue;
  (void)((dtype == kDTypeOf<Ts> ? (result = body.template operator()<Ts>(), true) : false) || ...);
  return result;
}

// fp32, fp16, bf16: what the CUDA-core kernels take.
template <typename Body>
cudaError_t dispatch_float_dtype(DType dtype, Body&& body) {
  return dispatch_dtype<float, __half, __nv_bfloat16>(dtype, static_cast<Body&&>(body));
}
// fp16, bf16: what the tensor-core kernels take.
template <typename Body>
cudaError_t dispatch_half_dtype(DType dtype, Body&& body) {
  return dispatch_dtype<__half, __nv_bfloat16>(dtype, static_cast<Body&&>(body));
}

}  // namespace optimized::kernels
