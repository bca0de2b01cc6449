// The fused family's variants and ops: one constexpr table each, the only place a variant's name,
// backend, dtypes, minimum compute capability and launcher (with its workspace query), or an op's
// name, are written. fused_variants.cpp generates the public name / parse / list / dtype functions
// from them, fused.cpp dispatches through the variant table.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

#include "core/variant_table.h"
#include "fused/cpu/fused_cpu.h"
#include "fused/fused_params.h"
#include "optimized/fused.h"

#if OPTIMIZED_WITH_CUDA
#include "fused/launchers.h"
#endif

namespace optimized {

using FusedVariantInfo = VariantInfo<FusedVariant, CpuBackendFn<FusedParams>, LauncherFn<FusedParams>,
                                     WorkspaceQueryFn<FusedParams>, std::nullptr_t /* no kernel report yet */>;

namespace fused_table {
constexpr DTypeSet kFloat = {DType::kF32, DType::kF16, DType::kBF16};
constexpr CpuBackendFn<FusedParams> kNoCpu = nullptr;
}  // namespace fused_table

// In ladder order. Compute capabilities: unfused and fused_streaming use warp shuffles and shared
// memory only (5.0); fused_registers spreads long rows over thread-block clusters with
// distributed shared memory (9.0).
inline constexpr std::array<FusedVariantInfo, 4> kFusedVariants = {{
    {FusedVariant::kCpu, "cpu", Backend::kCpu, {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}, 0, "",
     &cpu_fused, nullptr, nullptr, nullptr},
    {FusedVariant::kCudaUnfused, "unfused", Backend::kCuda, fused_table::kFloat, 50, "", fused_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::fused_unfused), OPTIMIZED_CUDA_FN(cuda::fused_unfused_workspace), nullptr},
    {FusedVariant::kCudaFusedStreaming, "fused_streaming", Backend::kCuda, fused_table::kFloat, 50, "",
     fused_table::kNoCpu, OPTIMIZED_CUDA_FN(cuda::fused_streaming),
     OPTIMIZED_CUDA_FN(cuda::fused_streaming_workspace), nullptr},
    {FusedVariant::kCudaFusedRegisters, "fused_registers", Backend::kCuda, fused_table::kFloat, 90, "",
     fused_table::kNoCpu, OPTIMIZED_CUDA_FN(cuda::fused_registers),
     OPTIMIZED_CUDA_FN(cuda::fused_registers_workspace), nullptr},
}};

// The row of `variant` (not kAuto).
const FusedVariantInfo& fused_variant_info(FusedVariant variant);

struct FusedOpInfo {
  FusedOp op;
  std::string_view name;
  bool reduces_rows;  // a reduction over the row: the short-row / long-row designs differ on it
};
inline constexpr std::array<FusedOpInfo, 8> kFusedOps = {{
    {FusedOp::kSoftmax, "softmax", true},
    {FusedOp::kLogSoftmax, "log_softmax", true},
    {FusedOp::kLayerNorm, "layer_norm", true},
    {FusedOp::kRmsNorm, "rms_norm", true},
    {FusedOp::kAddLayerNorm, "add_layer_norm", true},
    {FusedOp::kAddRmsNorm, "add_rms_norm", true},
    {FusedOp::kBiasGelu, "bias_gelu", false},
    {FusedOp::kSiluAndMul, "silu_and_mul", false},
}};

}  // namespace optimized
