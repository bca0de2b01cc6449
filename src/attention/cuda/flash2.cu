// The flash2 rung's launcher (src/attention/launchers.h): mma.sync FlashAttention-2, forward and
// backward, fp16 and bf16.
//
// This file only dispatches: p.dtype to the element type (fp16 -> __half, bf16 -> __nv_bfloat16;
// any other, or one this build did not compile (OPTIMIZED_BUILT_F16 / _BF16), is
// cudaErrorInvalidValue), p.head_dim rounded up to the instantiated size (64, 96, 128, 256: a head
// dim of any multiple of 8 up to 256 runs on the next one, its extra columns read as zeros and
// never written), and p.backward to flash2::run_forward / run_backward (flash2.h). The kernels
// live in flash2_fwd.cuh and flash2_bwd*.cuh and are compiled once per head dim in
// flash2_fwd_d<D>.cu / flash2_bwd_d<D>.cu.
//
// Workspace: none for the forward; the backward's fp32 row sums and dq accumulator
// (flash2::backward_workspace_bytes). A smaller workspace than that is refused with
// cudaErrorInvalidValue.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "attention/cuda/flash2.h"
#include "attention/launchers.h"

namespace optimized::cuda {

namespace {

// body.template operator()<kHeadDim>() for the instantiated head dim that runs `head_dim`.
template <typename Body>
cudaError_t dispatch_head_dim(int64_t head_dim, Body&& body) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return cudaErrorInvalidValue;
  if (head_dim <= 64) return body.template operator()<64>();
  if (head_dim <= 96) return body.template operator()<96>();
  if (head_dim <= 128) return body.template operator()<128>();
  return body.template operator()<256>();
}

// body.template operator()<T>() for p.dtype's element type, when this build has it.
template <typename Body>
cudaError_t dispatch_half(DType dtype, Body&& body) {
  switch (dtype) {
#ifdef OPTIMIZED_BUILT_F16
    case DType::kF16: return body.template operator()<__half>();
#endif
#ifdef OPTIMIZED_BUILT_BF16
    case DType::kBF16: return body.template operator()<__nv_bfloat16>();
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t attention_flash2(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream) {
  if (p.backward) {
    const size_t needed = flash2::backward_workspace_bytes(p);
    if (needed > 0 && (workspace.data == nullptr || workspace.bytes < needed)) return cudaErrorInvalidValue;
  }
  return dispatch_half(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_head_dim(p.head_dim, [&]<int kHeadDim>() -> cudaError_t {
      return p.backward ? flash2::run_backward<T, kHeadDim>(p, workspace, stream)
                        : flash2::run_forward<T, kHeadDim>(p, stream);
    });
  });
}

cudaError_t attention_flash2_workspace(const AttentionParams& p, size_t* bytes) {
  *bytes = p.backward ? flash2::backward_workspace_bytes(p) : 0;
  return cudaSuccess;
}

}  // namespace optimized::cuda
