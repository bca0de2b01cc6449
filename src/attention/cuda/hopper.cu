// The hopper rung's launcher (src/attention/launchers.h): the forward on wgmma / TMA, warp
// specialized (hopper_fwd.cuh), fp16 and bf16, head dims 64 and 128. sm_90a code (SM90A_SOURCES).
//
// This file only dispatches: p.dtype to the element type (fp16 -> __half, bf16 -> __nv_bfloat16;
// any other, or one this build did not compile, is cudaErrorInvalidValue) and p.head_dim (64 or
// 128 exactly) to hopper::run_forward or, for p.backward, hopper::run_backward. Workspace: the
// backward's is flash2's (attention_hopper_workspace); the forward needs none.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "attention/cuda/flash2.h"
#include "attention/cuda/hopper.h"
#include "attention/launchers.h"

namespace optimized::cuda {

cudaError_t attention_hopper(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream) {
  auto by_dim = [&]<typename T>() -> cudaError_t {
    if (p.head_dim == 64)
      return p.backward ? hopper::run_backward<T, 64>(p, workspace, stream) : hopper::run_forward<T, 64>(p, stream);
    if (p.head_dim == 128)
      return p.backward ? hopper::run_backward<T, 128>(p, workspace, stream) : hopper::run_forward<T, 128>(p, stream);
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

// The backward's scratch is flash2's (hopper_bwd.cuh reuses its prologue and dq steps); the forward
// needs none.
cudaError_t attention_hopper_workspace(const AttentionParams& p, size_t* bytes) {
  *bytes = p.backward ? flash2::backward_workspace_bytes(p) : 0;
  return cudaSuccess;
}

}  // namespace optimized::cuda
