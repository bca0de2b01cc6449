// What the GEMM rungs share beyond src/kernels: the pointers of one batch of the operands, the
// dispatch of the operand layouts (GemmParams::trans_a / trans_b) to compile-time constants, and
// the 16-byte alignment test of the stored rows. Each gemm_*.cu includes this and the launcher
// declarations; the conversions, the dtype dispatch, the alpha/beta store and the grid limits come
// from the ground floor (src/kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

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

// Grid z carries the batch and stops at kMaxGridZ: launch(first, count) for the batches in chunks
// of at most that many (first: the chunk's first batch), stopping at the first launch error.
template <typename F>
cudaError_t launch_batch_chunks(int64_t batch, F&& launch) {
  for (int64_t first = 0; first < batch; first += kMaxGridZ) {
    launch(first, static_cast<unsigned>(batch - first < kMaxGridZ ? batch - first : kMaxGridZ));
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Runs body.template operator()<kTransA, kTransB>() with the layouts of p as compile-time
// constants. The launchers dispatch once on the host, so a kernel instantiation indexes its
// operands without a run-time test, and the NN instantiation is the row-major kernel unchanged.
template <typename F>
cudaError_t dispatch_layout(const GemmParams& p, F&& body) {
  if (p.trans_a)
    return p.trans_b ? body.template operator()<true, true>() : body.template operator()<true, false>();
  return p.trans_b ? body.template operator()<false, true>() : body.template operator()<false, false>();
}

// The dtype of a kernel's T as it appears in kernel names ("fp32", "fp16", "bf16").
template <typename T>
std::string dtype_label() {
  return std::string(dtype_name(kernels::kDTypeOf<T>));
}

// The layout as it appears in kernel names: nothing for NN (the names of the row-major kernels),
// else BLAS's letters for A and B (T: stored transposed, i.e. column-major).
template <bool kTransA, bool kTransB>
constexpr const char* kLayoutSuffix = kTransA ? (kTransB ? ", TT" : ", TN") : (kTransB ? ", NT" : "");

// Whether every stored row of an operand starts on a 16-byte boundary (what 16-byte vector loads
// and cp.async chunks need): base pointer, row stride and, when batched, batch stride. `ld` is the
// stride of the stored rows, whatever the layout: rows of K elements for a row-major A, rows of M
// for A^T (and of N, or K for B^T), so the 16-byte vectors then run along the stored row.
inline bool rows_aligned16(const void* base, int64_t ld, int64_t batch_stride, int64_t batch, DType dtype) {
  const int64_t per16 = 16 / static_cast<int64_t>(dtype_size(dtype));
  return (reinterpret_cast<uintptr_t>(base) & 15) == 0 && ld % per16 == 0 && (batch <= 1 || batch_stride % per16 == 0);
}
inline bool a_rows_aligned16(const GemmParams& p) {
  return rows_aligned16(p.a, p.lda, p.batch_stride_a, p.batch, p.dtype);
}
inline bool b_rows_aligned16(const GemmParams& p) {
  return rows_aligned16(p.b, p.ldb, p.batch_stride_b, p.batch, p.dtype);
}

}  // namespace optimized::cuda
