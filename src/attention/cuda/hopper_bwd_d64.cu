// hopper backward, head dim 64: the instances of run_backward for fp16 and bf16 (each dtype only
// when the build has it: core/dtypes_built.h). sm_90a code (SM90A_SOURCES); one translation unit
// per head dim so that the kernels compile in parallel.
#include "attention/cuda/hopper.h"
#include "attention/cuda/hopper_bwd.cuh"

namespace optimized::cuda::hopper {

#ifdef OPTIMIZED_BUILT_F16
template cudaError_t run_backward<__half, 64>(const AttentionParams& p, const Workspace& workspace,
                                              cudaStream_t stream);
#endif
#ifdef OPTIMIZED_BUILT_BF16
template cudaError_t run_backward<__nv_bfloat16, 64>(const AttentionParams& p, const Workspace& workspace,
                                                     cudaStream_t stream);
#endif

}  // namespace optimized::cuda::hopper
