// cuBLAS baseline (see cublas_gemm.h).
#include "baselines/cublas_gemm.h"

#include <stdexcept>

#if OPTIMIZED_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>
#endif

namespace bench {

CublasMode cublas_mode_for(optimized::DType dtype) {
  switch (dtype) {
    case optimized::DType::kF16: return CublasMode::kFp16;
    case optimized::DType::kBF16: return CublasMode::kBf16;
    default: return CublasMode::kFp32;
  }
}

optimized::DType cublas_mode_dtype(CublasMode mode) {
  switch (mode) {
    case CublasMode::kFp16: return optimized::DType::kF16;
    case CublasMode::kBf16: return optimized::DType::kBF16;
    default: return optimized::DType::kF32;
  }
}

std::string cublas_mode_name(CublasMode mode) {
  switch (mode) {
    case CublasMode::kFp32: return "cublas_fp32";
    case CublasMode::kTf32: return "cublas_tf32";
    case CublasMode::kFp16: return "cublas_fp16";
    case CublasMode::kBf16: return "cublas_bf16";
  }
  return "cublas";
}

#if OPTIMIZED_WITH_CUDA

namespace {
void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": " + cublasGetStatusName(status) + " (" +
                             cublasGetStatusString(status) + ")");
}
}  // namespace

CublasGemm::CublasGemm(void* stream) {
  cublasHandle_t handle = nullptr;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  handle_ = handle;
  check_cublas(cublasSetStream(handle, static_cast<cudaStream_t>(stream)), "cublasSetStream");
  // Default math: CUBLAS_COMPUTE_32F then means true fp32 (no TF32); TF32 only when asked for
  // through CUBLAS_COMPUTE_32F_FAST_TF32.
  check_cublas(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
}

CublasGemm::~CublasGemm() {
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

void CublasGemm::run(CublasMode mode, int64_t m, int64_t n, int64_t k, int64_t batch,
                     const void* a, const void* b, void* c, float alpha, float beta, bool trans_a, bool trans_b) {
  cudaDataType_t type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  switch (mode) {
    case CublasMode::kFp32: break;
    case CublasMode::kTf32: compute = CUBLAS_COMPUTE_32F_FAST_TF32; break;
    case CublasMode::kFp16: type = CUDA_R_16F; break;
    case CublasMode::kBf16: type = CUDA_R_16BF; break;
  }
  auto handle = static_cast<cublasHandle_t>(handle_);
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  // Column-major view: C^T (n x m) = B^T (n x k) * A^T (k x m). A row-major B is B^T column-major
  // (op N, ld n); a B stored (N, K) is column-major B, transposed by op T (ld k); likewise A.
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int ldb = trans_b ? ik : in, lda = trans_a ? im : ik;
  if (batch == 1) {
    check_cublas(cublasGemmEx(handle, op_b, op_a, in, im, ik, &alpha, b, type, ldb, a, type, lda, &beta, c, type,
                              in, compute, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  } else {
    check_cublas(cublasGemmStridedBatchedEx(handle, op_b, op_a, in, im, ik, &alpha, b, type, ldb, k * n, a, type,
                                            lda, m * k, &beta, c, type, in, m * n, static_cast<int>(batch), compute,
                                            CUBLAS_GEMM_DEFAULT),
                 "cublasGemmStridedBatchedEx");
  }
}

#endif

}  // namespace bench
