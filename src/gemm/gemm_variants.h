// The GEMM family's variants: one constexpr table, the only place a rung's name, backend, dtypes,
// minimum compute capability and launcher are written. gemm_variants.cpp generates the public name
// / parse / list / dtype functions from it, gemm.cpp dispatches through it.
#pragma once

#include <array>
#include <cstddef>

#include "core/variant_table.h"
#include "gemm/cpu/cpu_gemm.h"
#include "gemm/gemm_params.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include "gemm/launchers.h"
#endif

namespace optimized {

namespace cuda {
struct KernelResources;  // launchers.h (CUDA builds)
}
using GemmVariantInfo = VariantInfo<GemmVariant, CpuBackendFn<GemmParams>, LauncherFn<GemmParams>,
                                    WorkspaceQueryFn<GemmParams>,  // split-K's partials (wgmma_persistent)
                                    ResourcesFn<GemmParams, cuda::KernelResources>>;
using GemmWorkspaceFn = decltype(GemmVariantInfo::workspace);

namespace gemm_table {
constexpr DTypeSet kFloat = {DType::kF32, DType::kF16, DType::kBF16};
constexpr DTypeSet kFloatAndF64 = {DType::kF32, DType::kF16, DType::kBF16, DType::kF64};
constexpr DTypeSet kHalf = {DType::kF16, DType::kBF16};
constexpr CpuBackendFn<GemmParams> kNoCpu = nullptr;
}  // namespace gemm_table

// In ladder order (all_gemm_variants() and the benchmark's --variant all list them so); gemv,
// the decode path beside the ladder, last.
// Compute capabilities: the CUDA-core rungs run anywhere (5.0); wmma's bf16 fragments and
// mma_pipeline's cp.async / ldmatrix / bf16 mma.sync need 8.0; the wgmma rungs are sm_90a code,
// which runs on compute capability 9.0 alone (kArchSpecific; they are also the rungs that load A and
// B through TMA, which gemm.cpp checks for), and exist only in builds with the sm_90a sources
// (OPTIMIZED_SM90A_FN: null launcher otherwise).
inline constexpr std::array<GemmVariantInfo, 13> kGemmVariants = {{
    {GemmVariant::kCpuNaive, "cpu_naive", Backend::kCpu, gemm_table::kFloatAndF64, 0, "",
     [](const GemmParams& p, int) { cpu::gemm_naive(p); }, nullptr, nullptr, nullptr},
    {GemmVariant::kCpuBlocked, "cpu_blocked", Backend::kCpu, gemm_table::kFloatAndF64, 0, "",
     [](const GemmParams& p, int threads) { cpu::gemm_blocked(p, threads); }, nullptr, nullptr, nullptr},
    {GemmVariant::kCpuPacked, "cpu_packed", Backend::kCpu, gemm_table::kFloat, 0, "",
     [](const GemmParams& p, int threads) { cpu::gemm_packed(p, threads); }, nullptr, nullptr, nullptr},
    {GemmVariant::kCudaNaive, "naive", Backend::kCuda, gemm_table::kFloat, 50, "", gemm_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::gemm_naive), OPTIMIZED_CUDA_FN(cuda::gemm_naive_workspace),
     OPTIMIZED_CUDA_FN(cuda::gemm_naive_resources)},
    {GemmVariant::kCudaCoalesced, "coalesced", Backend::kCuda, gemm_table::kFloat, 50, "", gemm_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::gemm_coalesced), nullptr, OPTIMIZED_CUDA_FN(cuda::gemm_coalesced_resources)},
    {GemmVariant::kCudaSmemTiled, "smem_tiled", Backend::kCuda, gemm_table::kFloat, 50, "", gemm_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::gemm_smem_tiled), nullptr, OPTIMIZED_CUDA_FN(cuda::gemm_smem_tiled_resources)},
    {GemmVariant::kCudaRegisterTiled, "register_tiled", Backend::kCuda, gemm_table::kFloat, 50, "",
     gemm_table::kNoCpu, OPTIMIZED_CUDA_FN(cuda::gemm_register_tiled), OPTIMIZED_CUDA_FN(cuda::gemm_register_tiled_workspace),
     OPTIMIZED_CUDA_FN(cuda::gemm_register_tiled_resources)},
    {GemmVariant::kCudaWmma, "wmma", Backend::kCuda, gemm_table::kHalf, 80, "tensor cores", gemm_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::gemm_wmma), nullptr, OPTIMIZED_CUDA_FN(cuda::gemm_wmma_resources)},
    {GemmVariant::kCudaMmaPipeline, "mma_pipeline", Backend::kCuda, gemm_table::kHalf, 80, "tensor cores",
     gemm_table::kNoCpu, OPTIMIZED_CUDA_FN(cuda::gemm_mma_pipeline), OPTIMIZED_CUDA_FN(cuda::gemm_mma_pipeline_workspace),
     OPTIMIZED_CUDA_FN(cuda::gemm_mma_pipeline_resources)},
    {GemmVariant::kCudaWgmmaTma, "wgmma_tma", Backend::kCuda, gemm_table::kHalf, 90, "tensor cores",
     gemm_table::kNoCpu, OPTIMIZED_SM90A_FN(cuda::gemm_wgmma_tma), nullptr,
     OPTIMIZED_SM90A_FN(cuda::gemm_wgmma_tma_resources), kArchSpecific},
    {GemmVariant::kCudaWgmmaWs, "wgmma_ws", Backend::kCuda, gemm_table::kHalf, 90, "tensor cores",
     gemm_table::kNoCpu, OPTIMIZED_SM90A_FN(cuda::gemm_wgmma_ws), nullptr,
     OPTIMIZED_SM90A_FN(cuda::gemm_wgmma_ws_resources), kArchSpecific},
    {GemmVariant::kCudaWgmmaPersistent, "wgmma_persistent", Backend::kCuda, gemm_table::kHalf, 90, "tensor cores",
     gemm_table::kNoCpu, OPTIMIZED_SM90A_FN(cuda::gemm_wgmma_persistent),
     OPTIMIZED_SM90A_FN(cuda::gemm_wgmma_persistent_workspace),
     OPTIMIZED_SM90A_FN(cuda::gemm_wgmma_persistent_resources), kArchSpecific},
    {GemmVariant::kCudaGemv, "gemv", Backend::kCuda, gemm_table::kFloat, 50, "", gemm_table::kNoCpu,
     OPTIMIZED_CUDA_FN(cuda::gemm_gemv), nullptr, OPTIMIZED_CUDA_FN(cuda::gemm_gemv_resources)},
}};

// The rungs that fuse GEMM epilogues (bias, activation, aux, residual, column sums) and write an
// fp32 C from fp16/bf16 operands: the CPU rungs (one shared post-pass over an fp32 product,
// cpu/gemm_epilogue.cpp), naive (the readable version), register_tiled (fp32), mma_pipeline and
// wgmma_persistent (fused into their stores, column sums from registers). The other rungs keep
// their lesson (a mapping, a tiling, WMMA fragments, the Hopper steps, decode) and refuse.
constexpr bool gemm_variant_fuses_epilogue(GemmVariant v) {
  switch (v) {
    case GemmVariant::kCpuNaive:
    case GemmVariant::kCpuBlocked:
    case GemmVariant::kCpuPacked:
    case GemmVariant::kCudaNaive:
    case GemmVariant::kCudaRegisterTiled:
    case GemmVariant::kCudaMmaPipeline:
    case GemmVariant::kCudaWgmmaPersistent: return true;
    default: return false;
  }
}

// The row of `variant` (not kAuto).
const GemmVariantInfo& gemm_variant_info(GemmVariant variant);

}  // namespace optimized
