// What the GEMM rungs share beyond src/kernels: the pointers of one batch of the operands. Each
// gemm_*.cu includes this and the launcher declarations; the conversions, the dtype dispatch, the
// alpha/beta store and the grid limits come from the ground floor (src/kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gemm/gemm_params.h"
#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/epilogue/alpha_beta.cuh"

namespace optimized::cuda {

using kernels::ceil_div;
using kernels::dispatch_float_dtype;
using kernels::dispatch_half_dtype;
using kernels::from_float;
using kernels::kMaxGridY;
using kernels::kMaxGridZ;
using kernels::store_alpha_beta;
using kernels::to_float;

// Pointers to the operands of batch `z` (blockIdx.z in every kernel).
template <typename T>
struct BatchOperands {
  const T* a;
  const T* b;
  T* c;
};

template <typename T>
__device__ __forceinline__ BatchOperands<T> batch_operands(const GemmParams& p, int64_t z) {
  return {static_cast<const T*>(p.a) + z * p.batch_stride_a,
          static_cast<const T*>(p.b) + z * p.batch_stride_b,
          static_cast<T*>(p.c) + z * p.batch_stride_c};
}

// Whether every row of an operand starts on a 16-byte boundary (what 16-byte vector loads and
// cp.async chunks need): base pointer, row stride and, when batched, batch stride.
inline bool rows_aligned16(const void* base, int64_t ld, int64_t batch_stride, int64_t batch, DType dtype) {
  const int64_t per16 = 16 / static_cast<int64_t>(dtype_size(dtype));
  return (reinterpret_cast<uintptr_t>(base) & 15) == 0 && ld % per16 == 0 && (batch <= 1 || batch_stride % per16 == 0);
}

}  // namespace optimized::cuda
