// The dtype dispatch of the launchers: runs a body templated on the CUDA element type of a DType.
//
//   return dispatch_dtype<float, __half, __nv_bfloat16>(p.dtype, [&]<typename T>() -> cudaError_t {
//     ... launch kernel<T> ...
//   });
//
// A dtype outside the list returns cudaErrorInvalidValue: launchers never throw, and the C++ API
// refuses such dtypes first with a message naming what is supported (the family's variant table).
// Built on core/dtype_dispatch.h's visit_dtype, the one DType dispatch.
#pragma once

#include <cuda_runtime.h>

#include "core/dtype_dispatch.h"
#include "kernels/dtype.cuh"

namespace optimized::kernels {

template <typename... Ts, typename Body>
cudaError_t dispatch_dtype(DType dtype, Body&& body) {
  return visit_dtype<kDTypeOf<Ts>...>(dtype, cudaErrorInvalidValue,
                                      [&]<DType kDType>() { return body.template operator()<cuda_type_t<kDType>>(); });
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
