// The attention family's CUDA launchers, one per rung (CUDA builds only), under the launcher
// contract (src/core/cuda_launch.h): never throw, never allocate, never synchronize. Each runs the
// forward or the backward by p.backward. Params have passed the API's checks: batch >= 1, the
// sequence lengths and head dims the rung takes, 16-byte-aligned rows where the rung needs them.
// Scratch (naive's materialized S and P, flash2's fp32 dq accumulator and row sums) comes from the
// workspace, whose size attention_<rung>_workspace says for the same params; a launch refuses a
// smaller one with cudaErrorInvalidValue (the C++ API checks first and names it).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "attention/attention_params.h"
#include "optimized/core.h"

namespace optimized::cuda {

cudaError_t attention_naive(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t attention_flash(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream);
cudaError_t attention_flash2(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream);
// sm_90a builds only (OPTIMIZED_WITH_SM90A): forward and backward on wgmma / TMA (the backward's
// workspace: attention_hopper_workspace). Params the API's hopper checks passed (attention.cpp:
// head dim 64 / 128, no softcap / ALiBi / mask, TMA-describable rows); anything else is
// cudaErrorInvalidValue.
cudaError_t attention_hopper(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream);

cudaError_t attention_naive_workspace(const AttentionParams& p, size_t* bytes);
cudaError_t attention_flash_workspace(const AttentionParams& p, size_t* bytes);
cudaError_t attention_flash2_workspace(const AttentionParams& p, size_t* bytes);
cudaError_t attention_hopper_workspace(const AttentionParams& p, size_t* bytes);  // sm_90a builds only

}  // namespace optimized::cuda
