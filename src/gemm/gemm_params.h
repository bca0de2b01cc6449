// The GEMM params struct: what every backend and launcher receives once the public API has
// validated the operands. Raw pointers, sizes and strides (in elements); no tensor view, no torch.
#pragma once

#include <cstdint>

#include "optimized/core.h"

namespace optimized {

struct GemmParams {
  const void* a = nullptr;  // (batch, M, K) row-major; row stride lda, batch stride batch_stride_a
  const void* b = nullptr;  // (batch, K, N) row-major; row stride ldb, batch stride batch_stride_b
  void* c = nullptr;        // (batch, M, N) row-major; row stride ldc, batch stride batch_stride_c
  int64_t m = 0, n = 0, k = 0;  // all >= 1
  int64_t batch = 1;            // >= 1
  int64_t lda = 0;  // >= K
  int64_t ldb = 0;  // >= N
  int64_t ldc = 0;  // >= N
  int64_t batch_stride_a = 0;  // elements between batches of A; 0 broadcasts one A
  int64_t batch_stride_b = 0;  // elements between batches of B; 0 broadcasts one B
  int64_t batch_stride_c = 0;  // elements between batches of C; >= M*ldc when batch > 1
  float alpha = 1.0f;
  float beta = 0.0f;   // 0: C is write-only
  DType dtype = DType::kF32;  // of A, B and C: kF32, kF16 or kBF16 (kF64: CPU naive and blocked)
};

}  // namespace optimized
