// The fused family's CUDA launchers, one per design (CUDA builds only), under the launcher
// contract of every family:
//
//   cudaError_t fused_<variant>(const FusedParams&, const Workspace&, cudaStream_t)
//
// A launcher takes validated params (rows >= 1), enqueues its kernels on the stream and returns the
// first CUDA error; it never throws, never allocates and never synchronises. Scratch (per-block
// partial sums of dweight / dbias, the unfused rung's fp32 temporaries) comes from the workspace,
// whose size fused_<variant>_workspace says for the same params (the launch refuses a smaller one
// with cudaErrorInvalidValue; the C++ API checks first and names it). The C++ API (fused.cpp)
// turns errors into optimized::Error.
//
// fused_streaming and fused_registers differ on the ops that reduce over the row; for bias_gelu and
// silu_and_mul both run the one element-wise kernel (fused_elementwise).
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

// The workspace bytes each launcher needs for p, on the current device (a grid sized to the device
// sizes its partial sums).
cudaError_t fused_unfused_workspace(const FusedParams& p, size_t* bytes);
cudaError_t fused_streaming_workspace(const FusedParams& p, size_t* bytes);
cudaError_t fused_registers_workspace(const FusedParams& p, size_t* bytes);
cudaError_t fused_elementwise_workspace(const FusedParams& p, size_t* bytes);

}  // namespace optimized::cuda
