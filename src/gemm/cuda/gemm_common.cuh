// What the GEMM rungs share beyond src/kernels: the pointers of one batch of the operands, the
// dispatch of the operand layouts (GemmParams::trans_a / trans_b) to compile-time constants, and
// the 16-byte alignment test of the stored rows. Each gemm_*.cu includes this and the launcher
// declarations; the conversions, the dtype dispatch, the alpha/beta store and the grid limits come
// from the ground floor (src/kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "gemm/gemm_params.h"
#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/epilogue/alpha_beta.cuh"
#include "kernels/epilogue/column_sums.cuh"
#include "kernels/epilogue/fused_epilogue.cuh"

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

// ---- epilogues (GemmParams::epi, c_dtype) ----------------------------------------------------

// The fused epilogue of the rungs that take one (gemm_variants.h): C of type TC.
template <typename TC>
using GemmEpilogueOp = kernels::FusedEpilogue<TC, GemmEpilogueParams>;

// Runs body.template operator()<TC>() with C's element type: T, or float for an fp32 C from
// 16-bit operands.
template <typename T, typename F>
cudaError_t dispatch_c_dtype(const GemmParams& p, F&& body) {
  if constexpr (!std::is_same_v<T, float>)
    if (p.c_dtype == DType::kF32) return body.template operator()<float>();
  return body.template operator()<T>();
}

// Whether two neighbouring columns (col even) of a row-major matrix form one aligned access of
// 2 * bytes: base, row stride and (batched) batch stride.
inline bool pair_aligned(const void* base, int64_t ld, int64_t batch_stride, int64_t batch, size_t bytes) {
  return reinterpret_cast<uintptr_t>(base) % (2 * bytes) == 0 && ld % 2 == 0 && (batch <= 1 || batch_stride % 2 == 0);
}

// Whether the epilogue may access two neighbouring columns (col even) of C, aux, residual and a
// bias along N as one access each.
inline bool epilogue_pairs(const GemmParams& p) {
  const size_t e = dtype_size(p.c_dtype);
  bool pairs = pair_aligned(p.c, p.ldc, p.batch_stride_c, p.batch, e);
  if (p.epi.aux) pairs = pairs && pair_aligned(p.epi.aux, p.epi.ld_aux, p.epi.batch_stride_aux, p.batch, e);
  if (p.epi.residual)
    pairs = pairs && pair_aligned(p.epi.residual, p.epi.ld_residual, p.epi.batch_stride_residual, p.batch, e);
  if (p.epi.bias && !p.epi.bias_along_m) pairs = pairs && reinterpret_cast<uintptr_t>(p.epi.bias) % (2 * e) == 0;
  return pairs;
}

// The epilogue functor of p (host side, passed to the kernels by value).
template <typename TC>
GemmEpilogueOp<TC> make_gemm_epilogue(const GemmParams& p) {
  return {p.alpha, p.beta, static_cast<TC*>(p.c), p.ldc, p.batch_stride_c, p.epi, epilogue_pairs(p)};
}

// Runs body(out) with p's output functor: AlphaBetaOutput<T> when p asks for nothing beyond
// alpha / beta (so the plain kernels carry no epilogue code: a rung whose registers are tight keeps
// its register allocation), else GemmEpilogueOp<TC>. The functor's type names the kernel.
template <typename T, typename F>
cudaError_t dispatch_epilogue(const GemmParams& p, F&& body) {
  if (!p.needs_epilogue_rung()) {
    const size_t e = sizeof(T);
    const bool quads = reinterpret_cast<uintptr_t>(p.c) % (4 * e) == 0 && p.ldc % 4 == 0 &&
                       (p.batch <= 1 || p.batch_stride_c % 4 == 0);
    return body(kernels::AlphaBetaOutput<T>{p.alpha, p.beta, static_cast<T*>(p.c), p.ldc, p.batch_stride_c,
                                            epilogue_pairs(p), quads});
  }
  return dispatch_c_dtype<T>(p, [&]<typename TC>() -> cudaError_t { return body(make_gemm_epilogue<TC>(p)); });
}

// Column sums (p.epi.column_sums): a rung writes fp32 partial sums, one row of N per group of
// output rows it owns (`rows` such rows per batch), into its workspace; finish_column_sums
// (kernels/epilogue/column_sums.cuh) adds them in a fixed order. The bytes of those partials (0
// without column sums), 256-byte aligned.
inline size_t column_sum_bytes(const GemmParams& p, int64_t rows) {
  if (!p.epi.column_sums) return 0;
  return static_cast<size_t>((p.batch * rows * p.n * 4 + 255) / 256 * 256);
}
inline cudaError_t finish_column_sums(const GemmParams& p, const float* partials, int64_t rows, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, int64_t(kernels::kColumnSumCols))),
                  static_cast<unsigned>(p.batch < kMaxGridY ? p.batch : kMaxGridY));
  kernels::finish_column_sums<<<grid, dim3(kernels::kColumnSumCols, kernels::kColumnSumSlices), 0, stream>>>(
      partials, rows, p.n, p.batch, p.epi.column_sums);
  return cudaGetLastError();
}

}  // namespace optimized::cuda
