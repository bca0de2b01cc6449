// The scaled (fp8) GEMM's variants: one constexpr table, as for the GEMM ladder (gemm_variants.h).
// scaled_gemm.cpp generates the public name / parse / list functions from it and dispatches
// through it. The dtypes of a row are the fp8 input dtypes it takes.
#pragma once

#include <array>

#include "core/variant_table.h"
#include "gemm/scaled_params.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include "gemm/launchers.h"
#endif

namespace optimized {

namespace cpu {
void scaled_gemm(const ScaledGemmParams& p, int threads);  // cpu/scaled_gemm_cpu.cpp
}
namespace cuda {
struct KernelResources;  // launchers.h (CUDA builds)
}

using ScaledGemmVariantInfo =
    VariantInfo<ScaledGemmVariant, CpuBackendFn<ScaledGemmParams>, LauncherFn<ScaledGemmParams>,
                WorkspaceQueryFn<ScaledGemmParams>,  // wgmma_fp8's K-major copies of A and B
                ResourcesFn<ScaledGemmParams, cuda::KernelResources>>;

namespace scaled_table {
constexpr DTypeSet kFp8 = {DType::kF8E4M3, DType::kF8E5M2};
constexpr CpuBackendFn<ScaledGemmParams> kNoCpu = nullptr;
}  // namespace scaled_table

// In ladder order. The naive CUDA rung dequantizes on the CUDA cores (any GPU from compute
// capability 5.0); wgmma_fp8 is sm_90a code (fp8 wgmma), compute capability 9.0 alone.
inline constexpr std::array<ScaledGemmVariantInfo, 3> kScaledGemmVariants = {{
    {ScaledGemmVariant::kCpu, "cpu", Backend::kCpu, scaled_table::kFp8, 0, "",
     [](const ScaledGemmParams& p, int threads) { cpu::scaled_gemm(p, threads); }, nullptr, nullptr, nullptr},
    {ScaledGemmVariant::kCudaNaive, "naive", Backend::kCuda, scaled_table::kFp8, 50, "", scaled_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::scaled_gemm_naive), nullptr, OPTIMIZED_CUDA_FN(cuda::scaled_gemm_naive_resources)},
    {ScaledGemmVariant::kCudaWgmmaFp8, "wgmma_fp8", Backend::kCuda, scaled_table::kFp8, 90, "fp8 tensor cores",
     scaled_table::kNoCpu, OPTIMIZED_SM90A_FN(cuda::scaled_gemm_wgmma_fp8),
     OPTIMIZED_SM90A_FN(cuda::scaled_gemm_wgmma_fp8_workspace),
     OPTIMIZED_SM90A_FN(cuda::scaled_gemm_wgmma_fp8_resources), kArchSpecific},
}};

}  // namespace optimized
