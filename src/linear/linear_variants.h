// The linear family's variants: one constexpr table, the only place a rung's name, backend, dtypes,
// minimum compute capability and launcher are written. linear_variants.cpp generates the public
// name / parse / list / dtype functions from it, linear.cpp dispatches through it.
//
// A linear rung is a GEMM rung with the epilogue (linear_gemm_variant below) plus the family's one
// kernel, g = dy * act'(pre) with the bias gradient (cpu: cpu::linear_act_grad; CUDA: every rung
// runs cuda::linear_act_grad). The rows' dtypes and compute capabilities are their GEMM rungs':
// naive needs 8.0 for the bf16 conversions of act_grad, fused is mma_pipeline (tensor cores,
// cp.async, ldmatrix: 8.0), persistent is wgmma_persistent: sm_90a code (kArchSpecific), present
// only in builds with the sm_90a sources -- as the GEMM table gates its Hopper rungs,
// OPTIMIZED_SM90A_FN leaves its launcher null otherwise and a call says it is not in this build.
#pragma once

#include <array>
#include <cstddef>

#include "core/variant_table.h"
#include "linear/cpu/linear_cpu.h"
#include "linear/linear_params.h"
#include "optimized/gemm.h"
#include "optimized/linear.h"

#if OPTIMIZED_WITH_CUDA
#include "linear/launchers.h"
#endif

namespace optimized {

using LinearVariantInfo = VariantInfo<LinearVariant, CpuBackendFn<LinearGradParams>, LauncherFn<LinearGradParams>,
                                      WorkspaceQueryFn<LinearGradParams>, std::nullptr_t>;

namespace linear_table {
constexpr DTypeSet kFloat = {DType::kF32, DType::kF16, DType::kBF16};
constexpr DTypeSet kHalf = {DType::kF16, DType::kBF16};
}  // namespace linear_table

// In ladder order.
inline constexpr std::array<LinearVariantInfo, 4> kLinearVariants = {{
    {LinearVariant::kCpu, "cpu", Backend::kCpu, {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}, 0, "",
     [](const LinearGradParams& p, int threads) { cpu::linear_act_grad(p, threads); }, nullptr, nullptr, nullptr},
    {LinearVariant::kNaive, "naive", Backend::kCuda, linear_table::kFloat, 80, "", nullptr,
     OPTIMIZED_CUDA_FN(cuda::linear_act_grad), OPTIMIZED_CUDA_FN(cuda::linear_act_grad_workspace), nullptr},
    {LinearVariant::kFused, "fused", Backend::kCuda, linear_table::kHalf, 80, "tensor cores", nullptr,
     OPTIMIZED_CUDA_FN(cuda::linear_act_grad), OPTIMIZED_CUDA_FN(cuda::linear_act_grad_workspace), nullptr},
    {LinearVariant::kPersistent, "persistent", Backend::kCuda, linear_table::kHalf, 90, "tensor cores", nullptr,
     OPTIMIZED_SM90A_FN(cuda::linear_act_grad), OPTIMIZED_SM90A_FN(cuda::linear_act_grad_workspace), nullptr,
     kArchSpecific},
}};

// The GEMM rung each linear rung runs (forward, recomputed pre, dgrad, wgrad); kAuto: the GEMM
// family's choice (on the CPU: cpu_packed, cpu_blocked for fp64).
constexpr GemmVariant linear_gemm_variant(LinearVariant v, DType dtype) {
  switch (v) {
    case LinearVariant::kCpu: return dtype == DType::kF64 ? GemmVariant::kCpuBlocked : GemmVariant::kCpuPacked;
    case LinearVariant::kNaive: return GemmVariant::kCudaNaive;
    case LinearVariant::kFused: return GemmVariant::kCudaMmaPipeline;
    case LinearVariant::kPersistent: return GemmVariant::kCudaWgmmaPersistent;
    default: return GemmVariant::kAuto;
  }
}

// The row of `variant` (not kAuto).
const LinearVariantInfo& linear_variant_info(LinearVariant variant);

}  // namespace optimized
