// The per-dtype bodies of the fused launchers. Each CUDA design's templates live in its .cuh
// (unfused.cuh, row_streaming.cuh, row_registers.cuh, elementwise.cuh); the build instantiates each
// body once per dtype of OPTIMIZED_DTYPES, in its own generated translation unit
// (cmake/dtype_instance.cu.in), and launchers.cpp dispatches the launchers of launchers.h to them.
//
// measure == nullptr: launch with `workspace`. Otherwise: write the workspace bytes the launch
// needs to *measure and launch nothing (the same code runs both ways, so the two cannot disagree).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "fused/fused_params.h"
#include "optimized/core.h"

namespace optimized::cuda {

template <DType kDType>
cudaError_t fused_unfused_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream, size_t* measure);
template <DType kDType>
cudaError_t fused_streaming_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream,
                                  size_t* measure);
template <DType kDType>
cudaError_t fused_registers_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream,
                                  size_t* measure);
template <DType kDType>
cudaError_t fused_elementwise_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream,
                                    size_t* measure);

}  // namespace optimized::cuda

// The explicit instantiation a generated translation unit holds: OPTIMIZED_DTYPE_INSTANCE(
// fused_registers_dtype, kBF16).
#define OPTIMIZED_DTYPE_INSTANCE(function, dtype)                                                          \
  template cudaError_t optimized::cuda::function<optimized::DType::dtype>(                                  \
      const optimized::FusedParams&, const optimized::Workspace&, cudaStream_t, size_t*);
