// The MoE family's CUDA launchers (the launcher contract, core/cuda_launch.h: never throw, never
// allocate, never synchronise).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "moe/moe_params.h"
#include "optimized/core.h"

namespace optimized::cuda {

cudaError_t moe_route(const MoeRouteParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t moe_route_backward(const MoeRouteBackwardParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t moe_permute(const MoePermuteParams& p, const Workspace& workspace, cudaStream_t stream);
size_t moe_permute_workspace_bytes(int64_t pairs, int64_t experts);
cudaError_t moe_combine(const MoeCombineParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t moe_gather(const MoeGatherParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t grouped_gemm_naive(const GroupedGemmParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t grouped_gemm_wgmma(const GroupedGemmParams& p, const Workspace& workspace, cudaStream_t stream);  // sm_90a

}  // namespace optimized::cuda
