// The fused family's launchers, one per CUDA design (CUDA builds only), under the launcher
// contract (src/core/cuda_launch.h). Params have rows >= 1. Scratch (per-block partial sums of
// dweight / dbias, the unfused rung's fp32 temporaries) comes from the workspace, whose size
// fused_<variant>_workspace says for the same params; a launch refuses a smaller one with
// cudaErrorInvalidValue (the C++ API checks first and names it). fused_streaming and
// fused_registers differ on the ops that reduce over the row; for bias_gelu and silu_and_mul both
// run the one element-wise kernel (fused_elementwise).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "fused/fused_params.h"
#include "optimized/core.h"

namespace optimized::cuda {

cudaError_t fused_unfused(const FusedParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t fused_streaming(const FusedParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t fused_registers(const FusedParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t fused_elementwise(const FusedParams& p, const Workspace& workspace, cudaStream_t stream);

// The workspace bytes each launcher needs for p, on the current device (grids, and with them the
// partial sums, follow the device's size).
cudaError_t fused_unfused_workspace(const FusedParams& p, size_t* bytes);
cudaError_t fused_streaming_workspace(const FusedParams& p, size_t* bytes);
cudaError_t fused_registers_workspace(const FusedParams& p, size_t* bytes);
cudaError_t fused_elementwise_workspace(const FusedParams& p, size_t* bytes);

}  // namespace optimized::cuda
