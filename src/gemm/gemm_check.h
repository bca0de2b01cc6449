// Validation of a GEMM result against the float64 reference, shared by the tests and the
// benchmark (which validates every result before timing it).
//
// Per element the allowed error is
//   out_eps * |ref| + out_floor + 8 * sqrt(K) * 2^-24 * (|alpha| * sum_k |a_ik b_kj| + |beta * c0_ij|)
// out_eps is the output dtype's unit roundoff (2^-24 fp32, 2^-11 fp16, 2^-8 bf16, 2^-53 fp64) and
// out_floor half its subnormal spacing (2^-150, 2^-25, 2^-134, 2^-1075): one rounding of the result; the second term is fp32 accumulation in any summation order (a statistical
// bound, far below the magnitude a wrong index or a dropped tile produces; 2^-53 in place of 2^-24
// for fp64, which accumulates in fp64). NaN must be where the
// reference has NaN, and an infinite reference must be matched exactly.
#pragma once

#include <cstdint>
#include <string>

#include "optimized/core.h"

namespace optimized {

struct GemmCheckResult {
  bool passed = false;
  double worst_ratio = 0;  // max over checked elements of error / allowed (<= 1 passes)
  double max_rel_error = 0;  // ||out - ref||_inf / ||ref||_inf over checked elements
  int64_t checked = 0;       // elements compared
  int64_t failures = 0;      // elements over their bound or with mismatched NaN/Inf
  std::string first_failure; // "C[0, 3, 17] = nan, expected 1.25 (allowed 1e-6)"; empty if passed
};

// a, b, c_out: host views (same dtype rules as matmul); c0: the C passed in (host view; may be
// null when beta == 0). samples == 0 checks every element; otherwise `samples` elements drawn from
// a fixed-seed generator plus the four corners of every batch.
GemmCheckResult check_gemm(const TensorView& a, const TensorView& b, const TensorView* c0,
                           const TensorView& c_out, float alpha, float beta, int64_t samples = 0);

}  // namespace optimized
