// cuBLASLt fp8 baseline of the scaled GEMM rows: C (M, N) row-major = (scale_a . A) @ (scale_b . B)
// with A (M, K) row-major and B stored (N, K) (both K-major, what cuBLASLt's fp8 kernels take, as
// torch._scaled_mm passes them), fp32 accumulation without fast accumulation (torch's default),
// output bf16 / fp16 / fp32. Scales: per tensor (SCALAR_32F) or per row of A and column of B
// (OUTER_VEC_32F). Row-major C is column-major C^T, so the call computes C^T = B^T A^T: cuBLASLt's
// "A" is our B (op T), its "B" our A (op N), and their scales swap too.
// Only with CUDA (OPTIMIZED_WITH_CUDA).
#pragma once

#include <cstdint>
#include <memory>

#include "baselines/cublaslt_common.h"
#include "optimized/core.h"

namespace bench {

#if OPTIMIZED_WITH_CUDA
class CublasLtFp8 {
 public:
  explicit CublasLtFp8(void* stream);  // cudaStream_t
  ~CublasLtFp8();
  CublasLtFp8(const CublasLtFp8&) = delete;
  CublasLtFp8& operator=(const CublasLtFp8&) = delete;

  // rowwise: scale_a has M values and scale_b N; else one each (device pointers). Throws
  // std::runtime_error naming the cuBLASLt status (e.g. a combination it does not support).
  void run(optimized::DType a_dtype, optimized::DType b_dtype, optimized::DType c_dtype, int64_t m, int64_t n,
           int64_t k, const void* a, const void* b, void* c, const float* scale_a, const float* scale_b, bool rowwise);

  // The descriptors and the algorithm of the last problem, kept between calls (a timed call then
  // only sets the scale pointers and launches, as a framework's cached plan would).
  struct Plan;

 private:
  std::unique_ptr<LtHandle> handle_;
  void* stream_ = nullptr;
  std::unique_ptr<Plan> plan_;
};
#endif

}  // namespace bench
