// Validation of a GEMM result against the float64 reference, shared by the tests and the
// benchmark (which validates every result before timing it). The bound is the GEMM rule of
// tolerance.h, per element:
//   |out - ref| <= u_out * |ref| + floor_out + 8 * sqrt(K) * u_acc * (|alpha| * sum_k |a_ik b_kj| + |beta * c0_ij|)
// NaN must be where the reference has NaN, and an infinite reference must be matched exactly.
#pragma once

#include <cstdint>

#include "optimized/core.h"
#include "optimized/gemm.h"
#include "testing/check.h"

namespace optimized::testing {

// a, b, c_out: host views (same dtype rules as matmul); c0: the C passed in (host view; may be
// null when beta == 0). samples == 0 checks every element (large problems in parallel threads over
// row blocks); otherwise `samples` elements drawn from a fixed-seed generator plus the four corners
// of every batch.
CheckResult check_gemm(const TensorView& a, const TensorView& b, const TensorView* c0, const TensorView& c_out,
                       float alpha, float beta, int64_t samples = 0);

// A GEMM with an epilogue (gemm.h, GemmEpilogue; every tensor a host view): C, the aux the op
// wrote (forward; in the gradient mode aux is the input) and the column sums, against float64:
//   pre = alpha * A @ B + beta * c0 + bias, out = act(pre) + residual (or pre * act'(aux) + residual)
// with the GEMM bound of pre (e_pre, the accumulation term) carried through the activation
// (|act'| <= 1.2 for every activation here), one rounding of the output, and a few fp32 units for
// the activation's own arithmetic:
//   C:           |out - ref| <= 1.2 e_pre + u_out |ref| + floor + 8 u_32 (|pre| + |act(pre)| + |residual|)
//                (gradient: e_pre |act'(aux)| + u_out |ref| + floor
//                           + 8 u_32 (|pre| (1 + |aux|) + |pre act'(aux)| + |residual|))
//                (the activations' fp32 arithmetic loses to cancellation where they are small, as
//                1 + erf(x) for x << 0: its absolute error scales with |pre| or |aux|)
//   aux:         |aux - pre| <= e_pre + u_out |pre| + floor + u_32 |pre|
//   column sums: |sum - ref| <= sum_i (C's bound without the rounding) + (M - 1) u_32 sum_i |out_i| + 2^-126
//                (the fp32 values of out before rounding to C's dtype, summed in fp32 in any fixed order)
// samples == 0 checks every column; otherwise `samples` columns from a fixed-seed generator plus
// the first and the last, each whole (every row, so that its column sum is checked too).
CheckResult check_gemm_epilogue(const TensorView& a, const TensorView& b, const TensorView* c0, const TensorView& c_out,
                                const GemmEpilogue& epilogue, float alpha, float beta, int64_t samples = 0);

}  // namespace optimized::testing
