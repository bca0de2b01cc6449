// The flash2 backward (flash2_bwd.cuh) for head dim 128: one translation unit per head dim so the
// heavy templates compile in parallel, holding the fp16 and bf16 instances this build has
// (OPTIMIZED_DTYPES, src/core/dtypes_built.h), and the pieces the hopper backward reuses (flash2.h).
#include "attention/cuda/flash2_bwd.cuh"

namespace optimized::cuda::flash2 {

#ifdef OPTIMIZED_BUILT_F16
template cudaError_t run_backward<__half, 128>(const AttentionParams&, const Workspace&, cudaStream_t);
template cudaError_t backward_prologue<__half, 128>(const AttentionParams&, const Workspace&, float**, float**,
                                                       int64_t*, cudaStream_t);
template cudaError_t backward_dq<__half, 128>(const AttentionParams&, const Workspace&, cudaStream_t);
#endif
#ifdef OPTIMIZED_BUILT_BF16
template cudaError_t run_backward<__nv_bfloat16, 128>(const AttentionParams&, const Workspace&, cudaStream_t);
template cudaError_t backward_prologue<__nv_bfloat16, 128>(const AttentionParams&, const Workspace&, float**, float**,
                                                       int64_t*, cudaStream_t);
template cudaError_t backward_dq<__nv_bfloat16, 128>(const AttentionParams&, const Workspace&, cudaStream_t);
#endif

}  // namespace optimized::cuda::flash2
