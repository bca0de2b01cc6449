// Which dtypes the per-dtype CUDA translation units were built for: the build option
// OPTIMIZED_DTYPES (default "f32;f16;bf16"; e.g. -DOPTIMIZED_DTYPES=bf16 while working on bf16
// kernels), handed to the library's sources as OPTIMIZED_BUILT_<DTYPE> and OPTIMIZED_DTYPES_LIST
// (cmake/optimized_family.cmake). Families whose kernels are generated per dtype (fused) refuse the
// others with cuda_dtype_not_built's message and dispatch through dispatch_built_dtype.
#pragma once

#include <string>
#include <string_view>

#include "optimized/core.h"

namespace optimized {

// What the library was built with (answered by the library: core.cpp).
bool cuda_dtype_built(DType dtype);
// Empty when `dtype` was built; otherwise "<family> CUDA kernels for fp16 were not built
// (OPTIMIZED_DTYPES=bf16; ...)". For dtypes the family takes at all (the caller checks that first).
std::string cuda_dtype_not_built(std::string_view family, DType dtype);

#ifdef OPTIMIZED_DTYPES_LIST  // the library's own sources
// body.template operator()<kDType>() for a built dtype; `not_built` for any other.
template <typename R, typename Body>
R dispatch_built_dtype(DType dtype, R not_built, Body&& body) {
  switch (dtype) {
#ifdef OPTIMIZED_BUILT_F32
    case DType::kF32: return body.template operator()<DType::kF32>();
#endif
#ifdef OPTIMIZED_BUILT_F16
    case DType::kF16: return body.template operator()<DType::kF16>();
#endif
#ifdef OPTIMIZED_BUILT_BF16
    case DType::kBF16: return body.template operator()<DType::kBF16>();
#endif
    default: return not_built;
  }
}
#endif

}  // namespace optimized
