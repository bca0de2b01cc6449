// The flash2 backward (flash2_bwd.cuh) for head dim 64: one translation unit per head dim so the
// heavy templates compile in parallel, holding the fp16 and bf16 instances this build has
// (OPTIMIZED_DTYPES, src/core/dtypes_built.h). It also defines the host function
// backward_workspace_bytes (flash2.h), the same for every instance.
#include "attention/cuda/flash2_bwd.cuh"

namespace optimized::cuda::flash2 {

// The workspace run_backward carves (the same for every dtype and head dim): measured by running
// the same carve on a counting arena.
size_t backward_workspace_bytes(const AttentionParams& p) {
  WorkspaceArena arena;
  float* dvec = nullptr;
  float* dq_acc = nullptr;
  bwd::carve_workspace(arena, p, &dvec, &dq_acc);
  return arena.peak();
}

#ifdef OPTIMIZED_BUILT_F16
template cudaError_t run_backward<__half, 64>(const AttentionParams&, const Workspace&, cudaStream_t);
template cudaError_t backward_prologue<__half, 64>(const AttentionParams&, const Workspace&, float**, float**,
                                                       int64_t*, cudaStream_t);
template cudaError_t backward_dq<__half, 64>(const AttentionParams&, const Workspace&, cudaStream_t);
#endif
#ifdef OPTIMIZED_BUILT_BF16
template cudaError_t run_backward<__nv_bfloat16, 64>(const AttentionParams&, const Workspace&, cudaStream_t);
template cudaError_t backward_prologue<__nv_bfloat16, 64>(const AttentionParams&, const Workspace&, float**, float**,
                                                       int64_t*, cudaStream_t);
template cudaError_t backward_dq<__nv_bfloat16, 64>(const AttentionParams&, const Workspace&, cudaStream_t);
#endif

}  // namespace optimized::cuda::flash2
