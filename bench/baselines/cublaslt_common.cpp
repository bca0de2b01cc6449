// The cuBLASLt baselines' shared pieces (see cublaslt_common.h).
#include "baselines/cublaslt_common.h"

namespace bench {

#if OPTIMIZED_WITH_CUDA

void check_lt(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  const std::string text = what + ": " + cublasGetStatusName(status) + " (" + cublasGetStatusString(status) + ")";
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) throw CublasLtUnsupported(text);
  throw std::runtime_error(text);
}

cudaDataType_t lt_data_type(optimized::DType d) {
  switch (d) {
    case optimized::DType::kF8E4M3: return CUDA_R_8F_E4M3;
    case optimized::DType::kF8E5M2: return CUDA_R_8F_E5M2;
    case optimized::DType::kF16: return CUDA_R_16F;
    case optimized::DType::kBF16: return CUDA_R_16BF;
    case optimized::DType::kF32: return CUDA_R_32F;
    default:
      throw std::invalid_argument("cuBLASLt baseline: expected fp8, fp16, bf16 or fp32; given " +
                                  std::string(optimized::dtype_name(d)));
  }
}

LtHandle::LtHandle() {
  check_lt(cublasLtCreate(&handle_), "cublasLtCreate");
  if (cudaMalloc(&workspace_, kWorkspaceBytes) != cudaSuccess) {
    cublasLtDestroy(handle_);
    throw std::runtime_error("cudaMalloc (cuBLASLt workspace, 32 MiB)");
  }
}

LtHandle::~LtHandle() {
  cudaFree(workspace_);
  cublasLtDestroy(handle_);
}

LtPlan::LtPlan() { check_lt(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate"); }

LtPlan::~LtPlan() {
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (desc) cublasLtMatmulDescDestroy(desc);
}

void LtPlan::layout(cublasLtMatrixLayout_t* out, optimized::DType d, int64_t rows, int64_t cols, int64_t ld,
                    const char* name) {
  check_lt(cublasLtMatrixLayoutCreate(out, lt_data_type(d), rows, cols, ld), std::string("cuBLASLt layout ") + name);
}

void LtPlan::choose_algorithm(const LtHandle& handle, const std::string& what) {
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const size_t ws = LtHandle::kWorkspaceBytes;
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(handle.get(), desc, la, lb, lc, lc, pref, 1, &heuristic, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  check_lt(s, "cublasLtMatmulAlgoGetHeuristic (" + what + ")");
  if (found == 0) throw CublasLtUnsupported("cublasLtMatmulAlgoGetHeuristic (" + what + "): no algorithm");
  algo = heuristic.algo;
}

void LtPlan::run(const LtHandle& handle, const float* alpha, const void* a, const void* b, const float* beta, void* c,
                 cudaStream_t stream, const std::string& what) const {
  check_lt(cublasLtMatmul(handle.get(), desc, alpha, a, la, b, lb, beta, c, lc, c, lc, &algo, handle.workspace(),
                          LtHandle::kWorkspaceBytes, stream),
           "cublasLtMatmul (" + what + ")");
}

#endif

}  // namespace bench
