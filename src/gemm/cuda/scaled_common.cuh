// What the scaled (fp8) GEMM's CUDA rungs share: the dispatch on the operands' fp8 formats and the
// output dtype. Each scaled_gemm_*.cu includes this and the launcher declarations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "gemm/scaled_params.h"

namespace optimized::cuda {

// Calls f.template operator()<FA, FB, TC>() for p's dtypes: FA / FB __nv_fp8_e4m3 or
// __nv_fp8_e5m2 (the combinations scaled_matmul takes: not both e5m2), TC float, __half or
// __nv_bfloat16.
template <typename F>
cudaError_t dispatch_scaled_dtypes(const ScaledGemmParams& p, F&& f) {
  const auto with_c = [&]<typename FA, typename FB>() -> cudaError_t {
    switch (p.c_dtype) {
      case DType::kF32: return f.template operator()<FA, FB, float>();
      case DType::kF16: return f.template operator()<FA, FB, __half>();
      default: return f.template operator()<FA, FB, __nv_bfloat16>();
    }
  };
  if (p.a_dtype == DType::kF8E5M2) return with_c.template operator()<__nv_fp8_e5m2, __nv_fp8_e4m3>();
  if (p.b_dtype == DType::kF8E5M2) return with_c.template operator()<__nv_fp8_e4m3, __nv_fp8_e5m2>();
  return with_c.template operator()<__nv_fp8_e4m3, __nv_fp8_e4m3>();
}

}  // namespace optimized::cuda
