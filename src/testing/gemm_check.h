// Validation of a GEMM result against the float64 reference, shared by the tests and the
// benchmark (which validates every result before timing it). The bound is the GEMM rule of
// tolerance.h, per element:
//   |out - ref| <= u_out * |ref| + floor_out + 8 * sqrt(K) * u_acc * (|alpha| * sum_k |a_ik b_kj| + |beta * c0_ij|)
// NaN must be where the reference has NaN, and an infinite reference must be matched exactly.
#pragma once

#include <cstdint>

#include "optimized/core.h"
#include "testing/check.h"

namespace optimized::testing {

// a, b, c_out: host views (same dtype rules as matmul); c0: the C passed in (host view; may be
// null when beta == 0). samples == 0 checks every element (large problems in parallel threads over
// row blocks); otherwise `samples` elements drawn from a fixed-seed generator plus the four corners
// of every batch.
CheckResult check_gemm(const TensorView& a, const TensorView& b, const TensorView* c0, const TensorView& c_out,
                       float alpha, float beta, int64_t samples = 0);

}  // namespace optimized::testing
