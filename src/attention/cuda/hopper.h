// The hopper rung's pieces (host declarations): hopper.cu dispatches the launcher of launchers.h
// on (dtype, head dim 64 / 128) to run_forward, which hopper_fwd_d<D>.cu instantiates for __half
// and __nv_bfloat16 (the kernel: hopper_fwd.cuh).
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_params.h"
#include "optimized/core.h"

namespace optimized::cuda::hopper {

// Forward: out (and lse when p.lse) for every (batch, head, query row). No workspace. Fixed length
// or varlen, head_dim == kHeadDim, causal, sliding windows or unmasked, no softcap, ALiBi or mask;
// q, k, v rows on 16-byte boundaries (TMA). cudaErrorInvalidValue otherwise.
template <typename T, int kHeadDim>
cudaError_t run_forward(const AttentionParams& p, cudaStream_t stream);

// Backward: dq, dk, dv (hopper_bwd.cuh). Scratch: flash2's backward workspace (the same layout and
// size: flash2::backward_workspace_bytes). Fixed length or varlen, head_dim == kHeadDim, causal,
// sliding windows or unmasked, no softcap, ALiBi or mask; q, k, v, dout rows on 16-byte boundaries
// (TMA).
// cudaErrorInvalidValue otherwise.
template <typename T, int kHeadDim>
cudaError_t run_backward(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream);

}  // namespace optimized::cuda::hopper
