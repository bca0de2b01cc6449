// The GEMM params struct: what every backend and launcher receives once the public API has
// validated the operands. Raw pointers, sizes and strides (in elements); no tensor view, no torch.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "optimized/core.h"

namespace optimized {

// The epilogue of a GEMM (gemm.h, GemmEpilogue) as raw pointers and strides in elements: bias,
// aux and residual have C's dtype (GemmParams::c_dtype), column_sums is fp32 (batch, N).
// act: Activation as its integer value (0 none).
struct GemmEpilogueParams {
  const void* bias = nullptr;
  bool bias_along_m = false;  // bias (M) instead of (N)
  int act = 0;
  bool act_grad = false;      // out = pre * act'(aux) instead of act(pre), aux read
  void* aux = nullptr;        // (batch, M, N) row-major: written with pre (forward) or read
  int64_t ld_aux = 0, batch_stride_aux = 0;
  const void* residual = nullptr;  // (batch, M, N) row-major, added last
  int64_t ld_residual = 0, batch_stride_residual = 0;
  float* column_sums = nullptr;    // (batch, N) fp32, contiguous

  // Anything beyond alpha / beta.
  OPTIMIZED_HOST_DEVICE bool any() const {
    return bias != nullptr || act != 0 || act_grad || aux != nullptr || residual != nullptr || column_sums != nullptr;
  }
};

// Layouts (BLAS's op flags): A is (M, K) and B is (K, N) as the product sees them; each is stored
// row-major (trans_* false: element (i, j) at i * ld + j, ld >= its columns) or column-major
// (trans_* true: stored as its transpose, element (i, j) at j * ld + i, ld >= its rows). C is
// always row-major here: the public API turns a column-major C into the transposed product
// C^T = B^T A^T before building the params.
struct GemmParams {
  const void* a = nullptr;  // (batch, M, K); leading dimension lda, batch stride batch_stride_a
  const void* b = nullptr;  // (batch, K, N); leading dimension ldb, batch stride batch_stride_b
  void* c = nullptr;        // (batch, M, N) row-major; row stride ldc, batch stride batch_stride_c
  int64_t m = 0, n = 0, k = 0;  // all >= 1
  int64_t batch = 1;            // >= 1
  int64_t lda = 0;  // >= K (>= M when trans_a)
  int64_t ldb = 0;  // >= N (>= K when trans_b)
  int64_t ldc = 0;  // >= N
  bool trans_a = false;  // A stored column-major: (K, M) rows of M elements
  bool trans_b = false;  // B stored column-major: (N, K) rows of K elements
  int64_t batch_stride_a = 0;  // elements between batches of A; 0 broadcasts one A
  int64_t batch_stride_b = 0;  // elements between batches of B; 0 broadcasts one B
  int64_t batch_stride_c = 0;  // elements between batches of C; >= M*ldc when batch > 1
  float alpha = 1.0f;
  float beta = 0.0f;   // 0: C is write-only
  DType dtype = DType::kF32;  // of A and B (and C unless c_dtype says otherwise): kF32, kF16 or kBF16
                             // (kF64: CPU naive and blocked)
  DType c_dtype = DType::kF32;  // of C: dtype, or kF32 with 16-bit A and B (the rungs that take epilogues)
  GemmEpilogueParams epi;       // bias, activation, aux, residual, column sums (none by default)

  // Element offsets of A(i, kk) and B(kk, j) within one batch, whatever the layout.
  OPTIMIZED_HOST_DEVICE int64_t a_index(int64_t i, int64_t kk) const { return trans_a ? kk * lda + i : i * lda + kk; }
  OPTIMIZED_HOST_DEVICE int64_t b_index(int64_t kk, int64_t j) const { return trans_b ? j * ldb + kk : kk * ldb + j; }
  // The stored matrices' shapes: rows and columns of A's and B's storage (row-major, ld apart).
  OPTIMIZED_HOST_DEVICE int64_t a_stored_rows() const { return trans_a ? k : m; }
  OPTIMIZED_HOST_DEVICE int64_t a_stored_cols() const { return trans_a ? m : k; }
  OPTIMIZED_HOST_DEVICE int64_t b_stored_rows() const { return trans_b ? n : k; }
  OPTIMIZED_HOST_DEVICE int64_t b_stored_cols() const { return trans_b ? k : n; }
  // What only the rungs that take epilogues run: an epilogue, or an fp32 C from 16-bit operands.
  OPTIMIZED_HOST_DEVICE bool needs_epilogue_rung() const { return epi.any() || c_dtype != dtype; }
};

}  // namespace optimized
