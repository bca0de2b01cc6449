// cuBLASLt epilogue baseline (see cublaslt_epilogue.h).
#include "baselines/cublaslt_epilogue.h"

#include <string>

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

}  // namespace

// cuBLASLt's A is our B, its B our A, C = D our C^T (header).
struct CublasLtEpilogue::Plan : LtPlan {
  LtProblem problem;
  // The pointers of one call (they change with the rotating input set).
  void set_pointers(const LtPointers& ptr) {
    const LtEpilogue e = problem.epilogue;
    if (uses_bias_pointer(e)) {
      const void* bias = writes_bgrad(e) ? static_cast<const void*>(ptr.bgrad) : ptr.bias;
      set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias, "BIAS_POINTER");
    }
    if (uses_aux(e)) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, ptr.aux, "EPILOGUE_AUX_POINTER");
  }
};

CublasLtEpilogue::CublasLtEpilogue(void* stream) : handle_(std::make_unique<LtHandle>()), stream_(stream) {}

CublasLtEpilogue::~CublasLtEpilogue() = default;

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
  // C^T = B^T A^T (header): cuBLASLt's A is our B, its B our A.
  p->set(CUBLASLT_MATMUL_DESC_TRANSA, q.b_col_major ? CUBLAS_OP_T : CUBLAS_OP_N, "TRANSA");
  p->set(CUBLASLT_MATMUL_DESC_TRANSB, q.a_col_major ? CUBLAS_OP_T : CUBLAS_OP_N, "TRANSB");
  p->set(CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(lt_epilogue(e)), "EPILOGUE");
  const int32_t c_type = lt_data_type(q.c);  // aux, bias and bias gradient: D's type (the default, stated)
  if (uses_aux(e)) {
    p->set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, int64_t{q.n}, "EPILOGUE_AUX_LD");  // D's ld: our row stride
    p->set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, c_type, "EPILOGUE_AUX_DATA_TYPE");
  }
  if (uses_bias_pointer(e)) p->set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, c_type, "BIAS_DATA_TYPE");
  // The pointers are part of the heuristic's question (their alignment): set them before asking.
  p->set_pointers(ptr);

  // Column-major layouts as stored: cuBLASLt's A = our B: (N, K) op N (B row-major, ld N) or
  // (K, N) op T (B stored (N, K) row-major = column-major (K, N), ld K); its B = our A likewise.
  if (q.b_col_major) LtPlan::layout(&p->la, q.ab, q.k, q.n, q.k, "A (our B)");
  else LtPlan::layout(&p->la, q.ab, q.n, q.k, q.n, "A (our B)");
  if (q.a_col_major) LtPlan::layout(&p->lb, q.ab, q.m, q.k, q.m, "B (our A)");
  else LtPlan::layout(&p->lb, q.ab, q.k, q.m, q.k, "B (our A)");
  LtPlan::layout(&p->lc, q.c, q.n, q.m, q.n, "C/D (our C^T)");
  p->choose_algorithm(*handle_, lt_epilogue_name(e) + ", " + std::string(optimized::dtype_name(q.ab)) + " -> " +
                                    std::string(optimized::dtype_name(q.c)) + ", " + std::to_string(q.m) + "x" +
                                    std::to_string(q.n) + "x" + std::to_string(q.k));
  plans_.push_back(std::move(p));
  return *plans_.back();
}

void CublasLtEpilogue::run(const LtProblem& q, const LtPointers& ptr) {
  Plan& p = plan_for(q, ptr);
  p.set_pointers(ptr);
  p.run(*handle_, &q.alpha, ptr.b, ptr.a, &q.beta, ptr.c, static_cast<cudaStream_t>(stream_), lt_epilogue_name(q.epilogue));
}

#endif

}  // namespace bench
