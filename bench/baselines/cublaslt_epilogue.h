// cuBLASLt with its own fused epilogues: the peer of the `linear` rows (bench/gemm/epilogue_bench.cpp),
// what a user (PyTorch's addmm / _addmm_activation, Transformer Engine, nvmath) would call for a
// linear layer's GEMMs.
//
// The problem is stated in the benchmark's row-major terms: C (M, N) row-major = alpha * A @ B +
// beta * C, A (M, K) row-major or stored column-major ((K, M) in memory, a_col_major), B (K, N)
// row-major or stored column-major ((N, K), b_col_major), C's row stride N. cuBLASLt is
// column-major, so the call computes C^T (N, M) = B^T A^T: cuBLASLt's "A" is our B (op N when B is
// row-major, op T when column-major), its "B" is our A (op N when A is row-major, op T when
// column-major), its D is our C^T (rows N, ld N). Consequences for the epilogues, in our terms:
//   - its bias (one per row of D) is one per column of C: length N, broadcast over the M rows;
//   - its GELU aux (a matrix shaped like D, ld N) is a row-major (M, N) matrix with row stride N;
//   - DGELU_BGRAD's bias gradient (one per row of D, the reduction over D's columns) is the sum
//     over the rows of C for each column: our column_sums;
//   - BGRADB's bias gradient (one per column of D, the reduction of its B over the GEMM's k) is the
//     sum over K of each row of our A: length M (with A = dY^T in a weight-gradient GEMM, the
//     bias gradient sum_t dY[t, :]).
// Its GELU is the tanh approximation (gelu_tanh here). The bias and the bias gradient have D's
// dtype (cuBLASLt's rule outside the int8 / fp8 kernels); aux has D's dtype.
//
// Each problem's descriptors and algorithm (cublasLtMatmulAlgoGetHeuristic's first choice with a
// 32 MiB workspace, asked with the pointers of the first call, whose alignment it reads) are cached
// per problem: a timed call sets the pointers and launches, as a framework's cached plan would.
// Only with CUDA (OPTIMIZED_WITH_CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "baselines/cublaslt_common.h"
#include "optimized/core.h"

namespace bench {

// The epilogues used here, in the row-major terms above.
enum class LtEpilogue : uint8_t {
  kDefault,       // CUBLASLT_EPILOGUE_DEFAULT
  kBias,          // C = A @ B + bias                     CUBLASLT_EPILOGUE_BIAS
  kReluBias,      // C = relu(A @ B + bias)               CUBLASLT_EPILOGUE_RELU_BIAS
  kGeluAuxBias,   // aux = A @ B + bias, C = gelu(aux)    CUBLASLT_EPILOGUE_GELU_AUX_BIAS
  kDGeluBGrad,    // C = (A @ B) * gelu'(aux), bgrad[j] = sum_i C[i, j]   CUBLASLT_EPILOGUE_DGELU_BGRAD
  kBGradRowsOfA,  // C = A @ B (+ beta C), bgrad[i] = sum_k A[i, k]      CUBLASLT_EPILOGUE_BGRADB
};
// "CUBLASLT_EPILOGUE_GELU_AUX_BIAS", ...
std::string lt_epilogue_name(LtEpilogue e);

struct LtProblem {
  optimized::DType ab = optimized::DType::kBF16;  // A and B
  optimized::DType c = optimized::DType::kBF16;   // C (D = C): ab's dtype, or fp32
  int64_t m = 0, n = 0, k = 0;
  bool a_col_major = false, b_col_major = false;
  float alpha = 1.0f, beta = 0.0f;
  LtEpilogue epilogue = LtEpilogue::kDefault;
  bool operator==(const LtProblem&) const = default;
};

// Device pointers of one call. bias: kBias, kReluBias, kGeluAuxBias (N elements of C's dtype);
// aux: kGeluAuxBias (written), kDGeluBGrad (read), (M, N) of C's dtype, row stride N; bgrad:
// kDGeluBGrad (N) and kBGradRowsOfA (M) elements of C's dtype (written).
struct LtPointers {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  const void* bias = nullptr;
  void* aux = nullptr;
  void* bgrad = nullptr;
};

#if OPTIMIZED_WITH_CUDA
class CublasLtEpilogue {
 public:
  explicit CublasLtEpilogue(void* stream);  // cudaStream_t
  ~CublasLtEpilogue();
  CublasLtEpilogue(const CublasLtEpilogue&) = delete;
  CublasLtEpilogue& operator=(const CublasLtEpilogue&) = delete;

  // Enqueues the problem on the stream. Throws CublasLtUnsupported when cuBLASLt has no algorithm
  // for it, std::runtime_error naming the call and the cuBLASLt status on other failures.
  void run(const LtProblem& problem, const LtPointers& ptr);

  struct Plan;  // descriptors, layouts and algorithm of one problem

 private:
  Plan& plan_for(const LtProblem& problem, const LtPointers& ptr);

  std::unique_ptr<LtHandle> handle_;
  void* stream_ = nullptr;
  std::vector<std::unique_ptr<Plan>> plans_;
};
#endif

}  // namespace bench
