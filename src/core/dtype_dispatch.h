// The one dtype dispatch: from a DType value to code templated on it.
//
//   visit_dtype<DType::kF32, DType::kBF16>(dtype, otherwise, [&]<DType kDType>() { ... });
//
// runs the body for `dtype` when it is one of the listed values and returns `otherwise` for any
// other, so that the caller's default says what is supported (launchers return an error code, the
// C++ API throws naming the choices). kernels/dispatch.cuh maps DTypes to CUDA element types on top
// of it; core/dtypes_built.h lists the dtypes a build has. Host and device code; CUDA-free.
#pragma once

#include "optimized/core.h"

namespace optimized {

template <DType... kDTypes, typename R, typename Body>
R visit_dtype(DType dtype, R otherwise, Body&& body) {
  R result = otherwise;
  (void)((dtype == kDTypes ? (result = body.template operator()<kDTypes>(), true) : false) || ...);
  return result;
}

}  // namespace optimized
