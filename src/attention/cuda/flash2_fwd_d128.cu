// flash2 forward, head dim 128 (and every multiple of 8 that rounds up to it): the instances of
// run_forward for fp16 and bf16 (each dtype only when the build has it: core/dtypes_built.h).
// One translation unit per head dim so that the heavy kernels compile in parallel.
#include "attention/cuda/flash2_fwd.cuh"

namespace optimized::cuda::flash2 {

#ifdef OPTIMIZED_BUILT_F16
template cudaError_t run_forward<__half, 128>(const AttentionParams& p, cudaStream_t stream);
#endif
#ifdef OPTIMIZED_BUILT_BF16
template cudaError_t run_forward<__nv_bfloat16, 128>(const AttentionParams& p, cudaStream_t stream);
#endif

}  // namespace optimized::cuda::flash2
