// The linear family's CUDA launcher (CUDA builds only), under the launcher contract
// (src/core/cuda_launch.h): never throws, never allocates, never synchronizes; returns the first
// CUDA error. Params have passed linear.cpp's checks (dtype fp32 / fp16 / bf16, m, n >= 1).
//
//   linear_act_grad  (cuda/act_grad.cu): g = dy * act'(pre) written in dy's dtype and the bias
//                    gradient from fp32 partial column sums per block of rows, added in a fixed
//                    order (no atomics): the same bits every run. Every CUDA variant runs it; the
//                    GEMMs around it are the variant's GEMM rung.
//
// The workspace (the partial sums, when p.bias_grad is set) is what linear_act_grad_workspace says
// for the same params; a launch refuses a smaller one with cudaErrorInvalidValue.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "linear/linear_fp8.h"
#include "linear/linear_params.h"
#include "optimized/core.h"

namespace optimized::cuda {

cudaError_t linear_act_grad(const LinearGradParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t linear_act_grad_workspace(const LinearGradParams& p, size_t* bytes);

// The fp8 path's passes (linear_fp8.h), count jobs a launch (1 .. kMaxFp8Jobs, one source dtype).
cudaError_t linear_fp8_amax(const Fp8AmaxJob* jobs, int count, cudaStream_t stream);
cudaError_t linear_fp8_cast(const Fp8CastJob* jobs, int count, cudaStream_t stream);

}  // namespace optimized::cuda
