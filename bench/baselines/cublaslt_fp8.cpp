// cuBLASLt fp8 baseline (see cublaslt_fp8.h).
#include "baselines/cublaslt_fp8.h"

#include <memory>

namespace bench {

#if OPTIMIZED_WITH_CUDA

struct CublasLtFp8::Plan : LtPlan {
  optimized::DType a_dtype, b_dtype, c_dtype;
  int64_t m = 0, n = 0, k = 0;
  bool rowwise = false;
};

CublasLtFp8::CublasLtFp8(void* stream) : handle_(std::make_unique<LtHandle>()), stream_(stream) {}

CublasLtFp8::~CublasLtFp8() = default;

void CublasLtFp8::run(optimized::DType a_dtype, optimized::DType b_dtype, optimized::DType c_dtype, int64_t m,
                      int64_t n, int64_t k, const void* a, const void* b, void* c, const float* scale_a,
                      const float* scale_b, bool rowwise) {
  Plan* p = plan_.get();
  if (!p || p->a_dtype != a_dtype || p->b_dtype != b_dtype || p->c_dtype != c_dtype || p->m != m || p->n != n ||
      p->k != k || p->rowwise != rowwise) {
    plan_.reset();
    auto fresh = std::make_unique<Plan>();
    p = fresh.get();
    p->a_dtype = a_dtype, p->b_dtype = b_dtype, p->c_dtype = c_dtype, p->m = m, p->n = n, p->k = k;
    p->rowwise = rowwise;
    p->set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "TRANSA");
    p->set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "TRANSB");
    if (rowwise) {
      const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      p->set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode, "A_SCALE_MODE");
      p->set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode, "B_SCALE_MODE");
    }
    p->set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{0}, "FAST_ACCUM");
    // The scale pointers are part of the heuristic's question: set them before asking (cuBLASLt's
    // A is our B, its B our A: the scales swap).
    p->set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b, "A_SCALE_POINTER");
    p->set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_a, "B_SCALE_POINTER");
    LtPlan::layout(&p->la, b_dtype, k, n, k, "A (our B stored (N, K))");
    LtPlan::layout(&p->lb, a_dtype, k, m, k, "B (our A stored (M, K))");
    LtPlan::layout(&p->lc, c_dtype, n, m, n, "C (our C^T)");
    p->choose_algorithm(*handle_, "fp8");
    plan_ = std::move(fresh);
  }
  p->set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b, "A_SCALE_POINTER");
  p->set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_a, "B_SCALE_POINTER");
  const float one = 1.0f, zero = 0.0f;
  p->run(*handle_, &one, b, a, &zero, c, static_cast<cudaStream_t>(stream_), "fp8");
}

#endif

}  // namespace bench
