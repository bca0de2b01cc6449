// cuBLAS GEMM baseline on row-major operands (C = alpha * A @ B + beta * C), for the benchmark's
// "vs cuBLAS" column and the GEMM ceilings. Row-major C (M, N) is column-major C^T (N, M), so the
// call computes C^T = B^T A^T: cublasGemmEx(N, N, n, m, k, B, ldb=n, A, lda=k, C, ldc=n).
//
// Modes: fp32 (CUBLAS_COMPUTE_32F, default math: no TF32), tf32 (fp32 data,
// CUBLAS_COMPUTE_32F_FAST_TF32), fp16 / bf16 (data in the dtype, fp32 compute, C in the dtype).
// Only with CUDA (OPTIMIZED_WITH_CUDA).
#pragma once

#include <cstdint>
#include <string>

#include "optimized/core.h"

namespace bench {

enum class CublasMode { kFp32, kTf32, kFp16, kBf16 };

// The mode that is the baseline for our kernels of `dtype` (fp32 -> kFp32, not TF32).
CublasMode cublas_mode_for(optimized::DType dtype);
// Data dtype of a mode (kTf32 -> fp32).
optimized::DType cublas_mode_dtype(CublasMode mode);
// "cublas_fp32", "cublas_tf32", "cublas_fp16", "cublas_bf16".
std::string cublas_mode_name(CublasMode mode);

#if OPTIMIZED_WITH_CUDA
// One cuBLAS handle bound to a stream (cudaStream_t), created on first use.
class CublasGemm {
 public:
  explicit CublasGemm(void* stream);
  ~CublasGemm();
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;

  // Contiguous operands, C row-major; A row-major (M, K), or stored column-major as (K, M) when
  // trans_a; B (K, N), or stored (N, K) when trans_b. batch > 1 uses strided batches (M*K, K*N,
  // M*N apart). Throws std::runtime_error naming the cuBLAS status on failure.
  void run(CublasMode mode, int64_t m, int64_t n, int64_t k, int64_t batch, const void* a,
           const void* b, void* c, float alpha, float beta, bool trans_a = false, bool trans_b = false);

 private:
  void* handle_ = nullptr;  // cublasHandle_t
};
#endif

}  // namespace bench
