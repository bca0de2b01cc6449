// The linear family's own kernel: g = dy * act'(pre) and the bias gradient (the column sums of g),
// in one pass over dy and pre. Everything else in the family is the GEMM family's matmul with its
// epilogue (linear.cpp). Torch-free and CUDA-free; filled by linear.cpp after validation.
#pragma once

#include <cstdint>

#include "optimized/core.h"

namespace optimized {

struct LinearGradParams {
  DType dtype = DType::kF32;  // dy, pre and g
  int act = 0;                // optimized::Activation; 0 (none): g = dy, pre not read
  int64_t m = 0, n = 0;       // rows (tokens), columns (out_features); m >= 1, n >= 1

  const void* dy = nullptr;   // (m, n), rows ld_dy apart, unit stride along n
  int64_t ld_dy = 0;
  const void* pre = nullptr;  // (m, n), rows ld_pre apart (read when act != 0)
  int64_t ld_pre = 0;
  void* g = nullptr;          // (m, n), rows ld_g apart, dy's dtype; null: not written
  int64_t ld_g = 0;

  // The column sums of the fp32 values of g (before they are rounded to dtype), in a fixed order:
  // bias_grad[j] = sum_i g[i, j] (+ bias_grad[j] with accumulate), rounded once. Null: not computed.
  void* bias_grad = nullptr;  // (n), contiguous
  DType bias_grad_dtype = DType::kF32;  // dtype, or fp32 for 16-bit dtype
  bool accumulate = false;

  // The fp8 path: max |v| over the values g holds (the rounded ones; dy's when there is no
  // activation), raised into *amax_bits as float bits (linear_fp8.h). Null: not computed.
  unsigned* amax_bits = nullptr;
};

}  // namespace optimized
