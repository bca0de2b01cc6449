// cuBLASLt fp8 baseline (see cublaslt_fp8.h).
#include "baselines/cublaslt_fp8.h"

#include <memory>
#include <stdexcept>
#include <string>

#if OPTIMIZED_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#endif

namespace bench {

#if OPTIMIZED_WITH_CUDA

namespace {
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": " + cublasGetStatusName(status) + " (" +
                             cublasGetStatusString(status) + ")");
}

cudaDataType_t cuda_type(optimized::DType d) {
  switch (d) {
    case optimized::DType::kF8E4M3: return CUDA_R_8F_E4M3;
    case optimized::DType::kF8E5M2: return CUDA_R_8F_E5M2;
    case optimized::DType::kF16: return CUDA_R_16F;
    case optimized::DType::kBF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}
}  // namespace

struct CublasLtFp8::Plan {
  optimized::DType a_dtype, b_dtype, c_dtype;
  int64_t m = 0, n = 0, k = 0;
  bool rowwise = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo = {};
  ~Plan() {
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

CublasLtFp8::CublasLtFp8(void* stream) : stream_(stream) {
  cublasLtHandle_t handle = nullptr;
  check_lt(cublasLtCreate(&handle), "cublasLtCreate");
  handle_ = handle;
  if (cudaMalloc(&workspace_, kWorkspaceBytes) != cudaSuccess) throw std::runtime_error("cudaMalloc (cuBLASLt workspace)");
}

CublasLtFp8::~CublasLtFp8() {
  delete plan_;
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

void CublasLtFp8::run(optimized::DType a_dtype, optimized::DType b_dtype, optimized::DType c_dtype, int64_t m,
                      int64_t n, int64_t k, const void* a, const void* b, void* c, const float* scale_a,
                      const float* scale_b, bool rowwise) {
  auto handle = static_cast<cublasLtHandle_t>(handle_);
  Plan* p = plan_;
  if (!p || p->a_dtype != a_dtype || p->b_dtype != b_dtype || p->c_dtype != c_dtype || p->m != m || p->n != n ||
      p->k != k || p->rowwise != rowwise) {
    delete plan_;
    plan_ = nullptr;
    auto fresh = std::make_unique<Plan>();
    p = fresh.get();
    p->a_dtype = a_dtype, p->b_dtype = b_dtype, p->c_dtype = c_dtype, p->m = m, p->n = n, p->k = k;
    p->rowwise = rowwise;
    check_lt(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)), "TRANSA");
    check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)), "TRANSB");
    if (rowwise) {
      const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof(mode)),
               "A_SCALE_MODE");
      check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof(mode)),
               "B_SCALE_MODE");
    }
    const int8_t fast = 0;
    check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
             "FAST_ACCUM");
    // The scale pointers are part of the heuristic's question: set them before asking.
    check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, sizeof(scale_b)),
             "A_SCALE_POINTER");
    check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, sizeof(scale_a)),
             "B_SCALE_POINTER");
    check_lt(cublasLtMatrixLayoutCreate(&p->la, cuda_type(b_dtype), k, n, k), "layout A");  // our B stored (N, K)
    check_lt(cublasLtMatrixLayoutCreate(&p->lb, cuda_type(a_dtype), k, m, k), "layout B");  // our A stored (M, K)
    check_lt(cublasLtMatrixLayoutCreate(&p->lc, cuda_type(c_dtype), n, m, n), "layout C");  // C^T column-major
    cublasLtMatmulPreference_t pref = nullptr;
    check_lt(cublasLtMatmulPreferenceCreate(&pref), "preference");
    const size_t ws = kWorkspaceBytes;
    cublasLtMatmulHeuristicResult_t heuristic = {};
    int found = 0;
    const cublasStatus_t s1 =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    const cublasStatus_t s2 = s1 == CUBLAS_STATUS_SUCCESS
                                  ? cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->la, p->lb, p->lc, p->lc, pref,
                                                                   1, &heuristic, &found)
                                  : s1;
    cublasLtMatmulPreferenceDestroy(pref);
    check_lt(s2, "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0) throw std::runtime_error("cublasLtMatmulAlgoGetHeuristic: no fp8 algorithm for this problem");
    p->algo = heuristic.algo;
    plan_ = fresh.release();
  }
  // cuBLASLt's A is our B, its B our A: the scales swap.
  check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_b, sizeof(scale_b)),
           "A_SCALE_POINTER");
  check_lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_a, sizeof(scale_a)),
           "B_SCALE_POINTER");
  const float one = 1.0f, zero = 0.0f;
  check_lt(cublasLtMatmul(handle, p->desc, &one, b, p->la, a, p->lb, &zero, c, p->lc, c, p->lc, &p->algo, workspace_,
                          kWorkspaceBytes, static_cast<cudaStream_t>(stream_)),
           "cublasLtMatmul");
}

#endif

}  // namespace bench
