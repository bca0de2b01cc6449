// What the cuBLASLt baselines (cublaslt_fp8, cublaslt_epilogue) share: the status check, the data
// types, a handle with the workspace its heuristics are asked with, and one problem's plan (the
// matmul descriptor, the three layouts and the algorithm, destroyed together). Only with CUDA
// (OPTIMIZED_WITH_CUDA), but for the exception a caller catches.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include "optimized/core.h"

#if OPTIMIZED_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#endif

namespace bench {

// cuBLASLt cannot run this problem (no algorithm for it, or CUBLAS_STATUS_NOT_SUPPORTED).
struct CublasLtUnsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#if OPTIMIZED_WITH_CUDA
// Throws CublasLtUnsupported for CUBLAS_STATUS_NOT_SUPPORTED, std::runtime_error naming `what` and
// the status for any other failure.
void check_lt(cublasStatus_t status, const std::string& what);

// The cuBLASLt type of fp8 (e4m3, e5m2), fp16, bf16 and fp32; std::invalid_argument otherwise.
cudaDataType_t lt_data_type(optimized::DType d);

// A cuBLASLt handle and the workspace (32 MiB) its calls and heuristics get.
class LtHandle {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  LtHandle();
  ~LtHandle();
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  cublasLtHandle_t get() const { return handle_; }
  void* workspace() const { return workspace_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

// One problem: D = alpha * op(A) op(B) + beta * C with C = D (column-major, cuBLASLt's terms).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;  // compute fp32, scale fp32
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo = {};

  LtPlan();
  ~LtPlan();
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;

  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value, const char* name) {
    check_lt(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), std::string("cuBLASLt ") + name);
  }
  // The layout of a column-major rows x cols matrix with leading dimension ld, of dtype d.
  static void layout(cublasLtMatrixLayout_t* out, optimized::DType d, int64_t rows, int64_t cols, int64_t ld,
                     const char* name);
  // The heuristic's first algorithm for the descriptor and layouts as they are set now (pointers
  // included, whose alignment it reads); CublasLtUnsupported naming `what` when there is none.
  void choose_algorithm(const LtHandle& handle, const std::string& what);
  // Enqueues the product with cuBLASLt's A = a, B = b, C = D = c.
  void run(const LtHandle& handle, const float* alpha, const void* a, const void* b, const float* beta, void* c,
           cudaStream_t stream, const std::string& what) const;
};
#endif

}  // namespace bench
