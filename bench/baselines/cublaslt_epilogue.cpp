// cuBLASLt epilogue baseline (see cublaslt_epilogue.h).
#include "baselines/cublaslt_epilogue.h"

#include <string>

#if OPTIMIZED_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#endif

namespace bench {

std::string lt_epilogue_name(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::kDefault: return "CUBLASLT_EPILOGUE_DEFAULT";
    case LtEpilogue::kBias: return "CUBLASLT_EPILOGUE_BIAS";
    case LtEpilogue::kReluBias: return "CUBLASLT_EPILOGUE_RELU_BIAS";
    case LtEpilogue::kGeluAuxBias: return "CUBLASLT_EPILOGUE_GELU_AUX_BIAS";
    case LtEpilogue::kDGeluBGrad: return "CUBLASLT_EPILOGUE_DGELU_BGRAD";
    case LtEpilogue::kBGradRowsOfA: return "CUBLASLT_EPILOGUE_BGRADB";
  }
  return "?";
}

#if OPTIMIZED_WITH_CUDA

namespace {
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

std::string status_text(cublasStatus_t status) {
  return std::string(cublasGetStatusName(status)) + " (" + cublasGetStatusString(status) + ")";
}

void check_lt(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) throw CublasLtUnsupported(what + ": " + status_text(status));
  if (status != CUBLAS_STATUS_SUCCESS) throw std::runtime_error(what + ": " + status_text(status));
}

cudaDataType_t cuda_type(optimized::DType d) {
  switch (d) {
    case optimized::DType::kF16: return CUDA_R_16F;
    case optimized::DType::kBF16: return CUDA_R_16BF;
    case optimized::DType::kF32: return CUDA_R_32F;
    default:
      throw std::invalid_argument("cuBLASLt epilogue baseline: expected fp16, bf16 or fp32; given " +
                                  std::string(optimized::dtype_name(d)));
  }
}

cublasLtEpilogue_t lt_epilogue(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::kDefault: return CUBLASLT_EPILOGUE_DEFAULT;
    case LtEpilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::kReluBias: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case LtEpilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case LtEpilogue::kDGeluBGrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case LtEpilogue::kBGradRowsOfA: return CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool uses_bias_pointer(LtEpilogue e) { return e != LtEpilogue::kDefault; }  // bias or bias gradient
bool uses_aux(LtEpilogue e) { return e == LtEpilogue::kGeluAuxBias || e == LtEpilogue::kDGeluBGrad; }
bool writes_bgrad(LtEpilogue e) { return e == LtEpilogue::kDGeluBGrad || e == LtEpilogue::kBGradRowsOfA; }

template <typename T>
void set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value, const char* name) {
  check_lt(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), std::string("cuBLASLt ") + name);
}
}  // namespace

struct CublasLtEpilogue::Plan {
  LtProblem problem;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLASLt's A (our B), B (our A), C = D
  cublasLtMatmulAlgo_t algo = {};
  ~Plan() {
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  // The pointers of one call (they change with the rotating input set).
  void set_pointers(const LtPointers& ptr) const {
    const LtEpilogue e = problem.epilogue;
    if (uses_bias_pointer(e)) {
      const void* bias = writes_bgrad(e) ? static_cast<const void*>(ptr.bgrad) : ptr.bias;
      set_attr(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias, "BIAS_POINTER");
    }
    if (uses_aux(e)) set_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, ptr.aux, "EPILOGUE_AUX_POINTER");
  }
};

CublasLtEpilogue::CublasLtEpilogue(void* stream) : stream_(stream) {
  cublasLtHandle_t handle = nullptr;
  check_lt(cublasLtCreate(&handle), "cublasLtCreate");
  handle_ = handle;
  if (cudaMalloc(&workspace_, kWorkspaceBytes) != cudaSuccess) {
    cublasLtDestroy(handle);
    handle_ = nullptr;
    throw std::runtime_error("cudaMalloc (cuBLASLt workspace, 32 MiB)");
  }
}

CublasLtEpilogue::~CublasLtEpilogue() {
  plans_.clear();
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

CublasLtEpilogue::Plan& CublasLtEpilogue::plan_for(const LtProblem& q, const LtPointers& ptr) {
  for (auto& p : plans_)
    if (p->problem == q) return *p;
  const LtEpilogue e = q.epilogue;
  if (uses_bias_pointer(e) && !(writes_bgrad(e) ? ptr.bgrad : ptr.bias))
    throw std::invalid_argument("cuBLASLt " + lt_epilogue_name(e) + ": expected a " +
                                (writes_bgrad(e) ? "bias gradient" : "bias") + " pointer; given null");
  if (uses_aux(e) && !ptr.aux)
    throw std::invalid_argument("cuBLASLt " + lt_epilogue_name(e) + ": expected an aux pointer; given null");

  auto p = std::make_unique<Plan>();
  p->problem = q;
  check_lt(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // C^T = B^T A^T (header): cuBLASLt's A is our B, its B our A.
  const cublasOperation_t op_a = q.b_col_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = q.a_col_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_attr(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a, "TRANSA");
  set_attr(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b, "TRANSB");
  const uint32_t epilogue = lt_epilogue(e);
  set_attr(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue, "EPILOGUE");
  if (uses_aux(e)) {
    const int64_t aux_ld = q.n;  // D's leading dimension: our row stride
    const int32_t aux_type = cuda_type(q.c);
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_ld, "EPILOGUE_AUX_LD");
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, aux_type, "EPILOGUE_AUX_DATA_TYPE");
  }
  if (uses_bias_pointer(e)) {
    const int32_t bias_type = cuda_type(q.c);  // D's type (the default, stated)
    set_attr(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type, "BIAS_DATA_TYPE");
  }
  // The pointers are part of the heuristic's question (their alignment): set them before asking.
  p->set_pointers(ptr);

  // Column-major layouts as stored: cuBLASLt's A = our B: (N, K) op N (B row-major, ld N) or
  // (K, N) op T (B stored (N, K) row-major = column-major (K, N), ld K); its B = our A likewise.
  const cudaDataType_t ab = cuda_type(q.ab), c = cuda_type(q.c);
  if (q.b_col_major) check_lt(cublasLtMatrixLayoutCreate(&p->la, ab, q.k, q.n, q.k), "cuBLASLt layout A (our B)");
  else check_lt(cublasLtMatrixLayoutCreate(&p->la, ab, q.n, q.k, q.n), "cuBLASLt layout A (our B)");
  if (q.a_col_major) check_lt(cublasLtMatrixLayoutCreate(&p->lb, ab, q.m, q.k, q.m), "cuBLASLt layout B (our A)");
  else check_lt(cublasLtMatrixLayoutCreate(&p->lb, ab, q.k, q.m, q.k), "cuBLASLt layout B (our A)");
  check_lt(cublasLtMatrixLayoutCreate(&p->lc, c, q.n, q.m, q.n), "cuBLASLt layout C/D (our C^T)");

  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const size_t ws = kWorkspaceBytes;
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), p->desc, p->la, p->lb, p->lc, p->lc,
                                       pref, 1, &heuristic, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  const std::string what = "cublasLtMatmulAlgoGetHeuristic (" + lt_epilogue_name(e) + ", " +
                           std::string(optimized::dtype_name(q.ab)) + " -> " + std::string(optimized::dtype_name(q.c)) +
                           ", " + std::to_string(q.m) + "x" + std::to_string(q.n) + "x" + std::to_string(q.k) + ")";
  check_lt(s, what);
  if (found == 0) throw CublasLtUnsupported(what + ": no algorithm");
  p->algo = heuristic.algo;
  plans_.push_back(std::move(p));
  return *plans_.back();
}

void CublasLtEpilogue::run(const LtProblem& q, const LtPointers& ptr) {
  const Plan& p = plan_for(q, ptr);
  p.set_pointers(ptr);
  check_lt(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.desc, &q.alpha, ptr.b, p.la, ptr.a, p.lb, &q.beta,
                          ptr.c, p.lc, ptr.c, p.lc, &p.algo, workspace_, kWorkspaceBytes,
                          static_cast<cudaStream_t>(stream_)),
           "cublasLtMatmul (" + lt_epilogue_name(q.epilogue) + ")");
}

#endif

}  // namespace bench
