// Which dtypes the per-dtype CUDA translation units were built for: the build option
// OPTIMIZED_DTYPES (default "f32;f16;bf16"; e.g. -DOPTIMIZED_DTYPES=bf16 while working on bf16
// kernels), handed to the library's sources as OPTIMIZED_BUILT_<DTYPE> and OPTIMIZED_DTYPES_LIST
// (the option's text) by cmake/optimized_family.cmake. Families whose kernels are generated per dtype (fused) refuse the
// others with cuda_dtype_not_built's message and dispatch through dispatch_built_dtype.
#pragma once

#include <cstddef>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>

#include "core/dtype_dispatch.h"
#include "optimized/core.h"

namespace optimized {

// What the library was built with (answered by the library: core.cpp).
bool cuda_dtype_built(DType dtype);
// Empty when `dtype` was built; otherwise "<family> CUDA kernels for fp16 were not built
// (OPTIMIZED_DTYPES=bf16); add it to OPTIMIZED_DTYPES and rebuild". For dtypes the family takes at all (the caller checks that first).
std::string cuda_dtype_not_built(std::string_view family, DType dtype);

#ifdef OPTIMIZED_DTYPES_LIST  // the library's own sources
inline constexpr DType kBuiltDTypes[] = {
#ifdef OPTIMIZED_BUILT_F32
    DType::kF32,
#endif
#ifdef OPTIMIZED_BUILT_F16
    DType::kF16,
#endif
#ifdef OPTIMIZED_BUILT_BF16
    DType::kBF16,
#endif
};

template <typename R, typename Body, size_t... kI>
R dispatch_built_dtype(DType dtype, R not_built, Body&& body, std::index_sequence<kI...>) {
  return visit_dtype<kBuiltDTypes[kI]...>(dtype, not_built, static_cast<Body&&>(body));
}
// body.template operator()<kDType>() for a built dtype; `not_built` for any other.
template <typename R, typename Body>
R dispatch_built_dtype(DType dtype, R not_built, Body&& body) {
  return dispatch_built_dtype(dtype, not_built, static_cast<Body&&>(body),
                              std::make_index_sequence<std::size(kBuiltDTypes)>{});
}
#endif

}  // namespace optimized
