// The attention family's variants: one constexpr table, the only place a rung's name, backend,
// dtypes, minimum compute capability and launcher (with its workspace query) are written.
// attention_variants.cpp generates the public name / parse / list / dtype functions from it,
// attention.cpp dispatches through it.
#pragma once

#include <array>
#include <cstddef>

#include "attention/attention_params.h"
#include "attention/cpu/attention_cpu.h"
#include "core/variant_table.h"
#include "optimized/attention.h"

#if OPTIMIZED_WITH_CUDA
#include "attention/launchers.h"
#endif

namespace optimized {

using AttentionVariantInfo = VariantInfo<AttentionVariant, CpuBackendFn<AttentionParams>, LauncherFn<AttentionParams>,
                                         WorkspaceQueryFn<AttentionParams>, std::nullptr_t>;

namespace attention_table {
constexpr DTypeSet kFloat = {DType::kF32, DType::kF16, DType::kBF16};
constexpr DTypeSet kHalf = {DType::kF16, DType::kBF16};
constexpr CpuBackendFn<AttentionParams> kNoCpu = nullptr;
}  // namespace attention_table

// In ladder order. naive and flash use shared memory and warp shuffles (5.0 would do; 8.0 for the
// bf16 conversions they share with flash2); flash2 needs mma.sync m16n8k16 with bf16, ldmatrix and
// cp.async (8.0); hopper is sm_90a code (wgmma, setmaxnreg, TMA), which runs on compute
// capability 9.0 alone (kArchSpecific) and exists only in builds with the sm_90a sources
// (OPTIMIZED_SM90A_FN: a null launcher otherwise, which a call reports as not in this build).
inline constexpr std::array<AttentionVariantInfo, 5> kAttentionVariants = {{
    {AttentionVariant::kCpu, "cpu", Backend::kCpu, {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}, 0, "",
     &cpu_attention, nullptr, nullptr, nullptr},
    {AttentionVariant::kNaive, "naive", Backend::kCuda, attention_table::kFloat, 80, "", attention_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::attention_naive), OPTIMIZED_CUDA_FN(cuda::attention_naive_workspace), nullptr},
    {AttentionVariant::kFlash, "flash", Backend::kCuda, attention_table::kFloat, 80, "", attention_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::attention_flash), OPTIMIZED_CUDA_FN(cuda::attention_flash_workspace), nullptr},
    {AttentionVariant::kFlash2, "flash2", Backend::kCuda, attention_table::kHalf, 80, "tensor cores",
     attention_table::kNoCpu, OPTIMIZED_CUDA_FN(cuda::attention_flash2),
     OPTIMIZED_CUDA_FN(cuda::attention_flash2_workspace), nullptr},
    {AttentionVariant::kHopper, "hopper", Backend::kCuda, attention_table::kHalf, 90, "tensor cores",
     attention_table::kNoCpu, OPTIMIZED_SM90A_FN(cuda::attention_hopper),
     OPTIMIZED_SM90A_FN(cuda::attention_hopper_workspace), nullptr, kArchSpecific},
}};

const AttentionVariantInfo& attention_variant_info(AttentionVariant variant);

}  // namespace optimized
