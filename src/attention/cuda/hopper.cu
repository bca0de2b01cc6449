// The hopper rung's launcher (src/attention/launchers.h): the forward on wgmma / TMA, warp
// specialized (hopper_fwd.cuh), fp16 and bf16, head dims 64 and 128. sm_90a code (SM90A_SOURCES).
//
// This file only dispatches: p.dtype to the element type (fp16 -> __half, bf16 -> __nv_bfloat16;
// any other, or one this build did not compile, is cudaErrorInvalidValue) and p.head_dim (64 or
// 128 exactly) to hopper::run_forward. The backward is not written yet: p.backward is
// cudaErrorInvalidValue here, and the API refuses it first naming flash2, which has one.
// Workspace: none.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attention/cuda/hopper.h"
#include "attention/launchers.h"

namespace optimized::cuda {

cudaError_t attention_hopper(const AttentionParams& p, const Workspace&, cudaStream_t stream) {
  if (p.backward) return cudaErrorInvalidValue;
  auto by_dim = [&]<typename T>() -> cudaError_t {
    if (p.head_dim == 64) return hopper::run_forward<T, 64>(p, stream);
    if (p.head_dim == 128) return hopper::run_forward<T, 128>(p, stream);
    return cudaErrorInvalidValue;
  };
  switch (p.dtype) {
#ifdef OPTIMIZED_BUILT_F16
    case DType::kF16: return by_dim.template operator()<__half>();
#endif
#ifdef OPTIMIZED_BUILT_BF16
    case DType::kBF16: return by_dim.template operator()<__nv_bfloat16>();
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace optimized::cuda
