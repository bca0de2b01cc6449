// The flash2 rung's pieces (host declarations): flash2.cu dispatches the launcher of launchers.h
// on (dtype, head dim rounded up to 64 / 96 / 128 / 256) to these bodies, which the instance files
// flash2_fwd_d<D>.cu / flash2_bwd_d<D>.cu instantiate for __half and __nv_bfloat16.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attention/attention_params.h"
#include "optimized/core.h"

namespace optimized::cuda::flash2 {

// Forward: out (and lse when p.lse) for every (batch, head, query row). No workspace.
template <typename T, int kHeadDim>
cudaError_t run_forward(const AttentionParams& p, cudaStream_t stream);

// Backward: dq, dk, dv. Scratch from `workspace` (at least backward_workspace_bytes(p) bytes,
// 256-byte aligned): the fp32 row sums D = rowsum(dout * out), and for the non-deterministic path
// the fp32 dq accumulator.
template <typename T, int kHeadDim>
cudaError_t run_backward(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream);

// The exact workspace bytes run_backward needs for p: a host function, the same for every dtype
// and head dim, defined in flash2_bwd_d64.cu.
size_t backward_workspace_bytes(const AttentionParams& p);

// The pieces of run_backward the hopper rung's backward reuses (hopper_bwd.cuh), instantiated in
// the flash2_bwd_d<D>.cu units (so that their kernels are built for every architecture of the
// build, not only sm_90a) for head dims 64 and 128. Both carve `workspace` as run_backward does.
//   backward_prologue: D = rowsum(dout * out) into the workspace (and the fp32 dq accumulator
//     zeroed unless p.deterministic); *dvec, *dq_acc (null when deterministic) and *rows (the
//     [rows] dimension: B * S_q) say where they are.
//   backward_dq: dq from the accumulator (dq = scale * acc), or, deterministic, flash2's own dq
//     kernel (recomputing S, dP and dS per query tile; it needs the prologue's D).
template <typename T, int kHeadDim>
cudaError_t backward_prologue(const AttentionParams& p, const Workspace& workspace, float** dvec, float** dq_acc,
                              int64_t* rows, cudaStream_t stream);
template <typename T, int kHeadDim>
cudaError_t backward_dq(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream);

}  // namespace optimized::cuda::flash2
