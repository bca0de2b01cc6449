// The grouped GEMM's variants: one constexpr table (core/variant_table.h), the only place a rung's
// name, backend, dtypes, compute capability and launcher are written. grouped_gemm.cpp generates the
// public name / parse / list functions from it and dispatches through it. `loop` has no launcher: it is
// a host loop of GEMM calls (grouped_gemm.cpp), which reads the offsets back first. `wgmma` is sm_90a
// code (cuda/grouped_wgmma.cu), in builds with the sm_90a sources only.
#pragma once

#include <array>
#include <cstddef>

#include "core/variant_table.h"
#include "moe/cpu/moe_cpu.h"
#include "moe/moe_params.h"
#include "optimized/moe.h"

#if OPTIMIZED_WITH_CUDA
#include "moe/launchers.h"
#endif

namespace optimized {

using GroupedGemmVariantInfo = VariantInfo<GroupedGemmVariant, CpuBackendFn<GroupedGemmParams>,
                                           LauncherFn<GroupedGemmParams>, std::nullptr_t, std::nullptr_t>;

namespace grouped_table {
constexpr DTypeSet kFloat = {DType::kF32, DType::kF16, DType::kBF16};
constexpr DTypeSet kHalf = {DType::kF16, DType::kBF16};
}  // namespace grouped_table

// In ladder order.
inline constexpr std::array<GroupedGemmVariantInfo, 4> kGroupedGemmVariants = {{
    {GroupedGemmVariant::kCpu, "cpu", Backend::kCpu, grouped_table::kFloat, 0, "",
     [](const GroupedGemmParams& p, int threads) { cpu::grouped_gemm(p, threads); }, nullptr, nullptr, nullptr},
    {GroupedGemmVariant::kCudaNaive, "naive", Backend::kCuda, grouped_table::kFloat, 80, "", nullptr,
     OPTIMIZED_CUDA_FN(cuda::grouped_gemm_naive), nullptr, nullptr},
    {GroupedGemmVariant::kCudaLoop, "loop", Backend::kCuda, grouped_table::kFloat, 80, "", nullptr, nullptr, nullptr,
     nullptr},
    {GroupedGemmVariant::kCudaWgmma, "wgmma", Backend::kCuda, grouped_table::kHalf, 90, "tensor cores", nullptr,
     OPTIMIZED_SM90A_FN(cuda::grouped_gemm_wgmma), nullptr, nullptr, kArchSpecific},
}};

}  // namespace optimized
