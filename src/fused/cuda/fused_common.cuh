// What the fused family's CUDA designs share beyond src/kernels: the fp32 scalars, which kernel an
// op runs, the number of resident blocks a row-striding grid needs, the column sum that turns
// per-block partial sums (dweight, dbias) into the gradient, and the workspace arena of a launch.
// Namespace optimized::cuda::fused (the family's CUDA internals), which sees the ground floor.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/device_facts.h"
#include "core/workspace.h"
#include "fused/cuda/dtype_entries.h"
#include "fused/fused_config.h"
#include "fused/fused_params.h"
#include "kernels/common.cuh"
#include "kernels/dtype.cuh"
#include "kernels/math.cuh"
#include "kernels/reduce.cuh"

namespace optimized::cuda::fused {

using namespace optimized::kernels;

constexpr FusedConfig kConfig = kFusedConfig;

// ---- scalars --------------------------------------------------------------------------------
// eps and scale as every kernel computes with them: fp32, rounded once on the host at the launch
// (FusedParams carries the caller's doubles, which the fp64 CPU path needs). Kernels read these,
// never p.eps / p.scale, which would pull fp64 arithmetic onto the device.
struct FusedScalarsF32 {
  float eps;
  float scale;
};
inline FusedScalarsF32 scalars_f32(const FusedParams& p) {
  return {static_cast<float>(p.eps), static_cast<float>(p.scale)};
}

// ---- which kernel ---------------------------------------------------------------------------
// The kernels of the fused designs: one per (op group, direction). The row designs (streaming,
// registers) have the first four, the element-wise kernel the last four.
enum class FusedKernel : int { kSoftmaxFwd, kNormFwd, kSoftmaxBwd, kNormBwd, kGeluFwd, kGeluBwd, kSiluFwd, kSiluBwd };
inline FusedKernel fused_kernel_of(const FusedParams& p) {
  if (p.is_softmax()) return p.backward ? FusedKernel::kSoftmaxBwd : FusedKernel::kSoftmaxFwd;
  if (p.is_norm()) return p.backward ? FusedKernel::kNormBwd : FusedKernel::kNormFwd;
  if (p.op == FusedOp::kBiasGelu) return p.backward ? FusedKernel::kGeluBwd : FusedKernel::kGeluFwd;
  return p.backward ? FusedKernel::kSiluBwd : FusedKernel::kSiluFwd;
}
constexpr bool is_backward(FusedKernel k) {
  return k == FusedKernel::kSoftmaxBwd || k == FusedKernel::kNormBwd || k == FusedKernel::kGeluBwd ||
         k == FusedKernel::kSiluBwd;
}

// ---- grids ----------------------------------------------------------------------------------
// Blocks of `kernel` (with this block size and dynamic shared memory) that the current device
// holds at once: what a grid that strides over rows needs to fill the GPU, no more.
template <typename Kernel>
cudaError_t resident_blocks(Kernel kernel, int threads, size_t dynamic_smem, int64_t* out) {
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
  int per_sm = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem);
      e != cudaSuccess)
    return e;
  *out = static_cast<int64_t>(facts->sm_count) * (per_sm > 0 ? per_sm : 1);
  return cudaSuccess;
}

// Runs body.template operator()<kKind, kVec>() with kKind the kernel of p among kKinds (else
// cudaErrorInvalidValue: another design runs it) and kVec the elements per vector: 16 bytes when
// every row is aligned (fused_rows_aligned), else 1.
template <typename T, FusedKernel... kKinds, typename Body>
cudaError_t dispatch_kernel(const FusedParams& p, Body&& body) {
  const FusedKernel kind = fused_kernel_of(p);
  const bool aligned = fused_rows_aligned(p);
  cudaError_t result = cudaErrorInvalidValue;
  (void)((kind == kKinds ? (result = aligned ? body.template operator()<kKinds, kVec16<T>>()
                                             : body.template operator()<kKinds, 1>(),
                            true)
                         : false) ||
         ...);
  return result;
}

// ---- workspace ------------------------------------------------------------------------------
// The arena of one launcher call: counting when measuring (dtype_entries.h), carving otherwise.
inline WorkspaceArena arena_for(const Workspace& workspace, size_t* measure) {
  return measure ? WorkspaceArena() : WorkspaceArena(workspace);
}

// Measuring a launch that takes no workspace: 0 bytes, found without asking the device anything
// (the occupancy query of the grid is for the launch alone).
inline bool measured_without_scratch(bool needs_scratch, size_t* measure) {
  if (!measure || needs_scratch) return false;
  *measure = 0;
  return true;
}

// The fp32 partial-sum rows of one launch (dweight / dbias per block), `floats` of the workspace.
// launch false: return `status` (measuring: the bytes are in *measure; or the workspace is too small).
struct PartialRows {
  float* data;
  bool launch;
  cudaError_t status;
};
inline PartialRows partial_rows(const Workspace& workspace, size_t* measure, int64_t floats) {
  WorkspaceArena arena = arena_for(workspace, measure);
  float* data = floats > 0 ? arena.take<float>(floats) : nullptr;
  if (measure) {
    *measure = arena.peak();
    return {nullptr, false, cudaSuccess};
  }
  if (!arena.ok()) return {nullptr, false, cudaErrorInvalidValue};
  return {data, true, cudaSuccess};
}

// ---- column sums ---------------------------------------------------------------------------
// out[c] = sum over p < parts of partial[p * row_stride + c], written in T. A block covers 32
// columns with 32 slices of the parts; the slices meet in shared memory.
template <typename T>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* __restrict__ partial, int64_t parts,
                                                          int64_t width, int64_t row_stride, T* __restrict__ out) {
  __shared__ float slice_sums[32][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float sum = 0.0f;
  if (col < width)
    for (int64_t p = threadIdx.y; p < parts; p += 32) sum += partial[p * row_stride + col];
  slice_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < width) {
    float total = 0.0f;
    for (int s = 0; s < 32; ++s) total += slice_sums[s][threadIdx.x];
    out[col] = from_float<T>(total);
  }
}

// Sums `parts` fp32 rows of `width` columns spaced `row_stride` apart into `out` (T elements).
template <typename T>
cudaError_t launch_column_sum(const float* partial, int64_t parts, int64_t width, int64_t row_stride, void* out,
                              cudaStream_t stream) {
  const dim3 block(32, 32);
  const dim3 grid(static_cast<unsigned>(ceil_div(width, 32)));
  column_sum_kernel<T><<<grid, block, 0, stream>>>(partial, parts, width, row_stride, static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace optimized::cuda::fused

namespace optimized::cuda::fused {

// dweight and dbias (when p asks for them) from `parts` partial rows laid out (part, which, column):
// dweight at which 0, dbias at which 1.
template <typename T>
cudaError_t launch_parameter_sums(const float* partial, int64_t parts, const FusedParams& p, cudaStream_t stream) {
  if (p.dweight)
    if (cudaError_t e = launch_column_sum<T>(partial, parts, p.width, 2 * p.width, p.dweight, stream); e != cudaSuccess)
      return e;
  if (p.dbias) return launch_column_sum<T>(partial + p.width, parts, p.width, 2 * p.width, p.dbias, stream);
  return cudaSuccess;
}

}  // namespace optimized::cuda::fused
