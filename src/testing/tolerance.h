// The tolerance rules of optimized_ops_testing: one per family, used by the C++ tests, the C++
// benchmark's validation and (mirrored in bench/tolerance.py, checked against the same numbers by
// tests/common/tolerance_vectors.txt) by pytest and the Python benchmark.
//
// GEMM (every element on its own; check_gemm in gemm_check.h applies it):
//   |out - ref| <= u_out * |ref| + floor_out + 8 * sqrt(K) * u_acc * magnitude
//   magnitude = |alpha| * sum_k |a_ik b_kj| + |beta * c0_ij|; u_acc = 2^-24 (fp32 accumulation),
//   2^-53 for fp64. One rounding of the result plus fp32 accumulation in any summation order (a
//   statistical bound, far below what a wrong index or a dropped tile produces).
//
// Reductions and element-wise ops (the fused family; design.md: flash-attention's rule), per
// checked unit -- a row of a row output, one row's statistic, the whole of a parameter gradient:
//   max |out - ref| <= 2 * max |same - ref| + 2 * u_out * max |ref| + 16 * sqrt(n) * u_acc * scale + floor_out
//   same   the same-dtype reference: the op computed the plain way in the dtype's working
//          precision (fp32 math for fp32 / fp16 / bf16, fp64 for fp64), rounded to the output
//          dtype -- what torch in that dtype gets (fused_reference.h)
//   n      the length of the reduction behind an element (the row width; the rows for a
//          parameter gradient; 1 for element-wise ops)
//   scale  max(max |ref|, the magnitude of the terms summed into the unit), so that a result that
//          cancels to far less than its terms is held to the fp32 rounding of those terms (the
//          output's own rounding, 2 u_out, is relative to the output)
// NaN must be where the reference has NaN, and an infinite reference matched exactly.
#pragma once

#include <cstdint>

#include "optimized/core.h"

namespace optimized::testing {

// Unit roundoff of a dtype (fp32 2^-24, fp16 2^-11, bf16 2^-8, fp64 2^-53).
double unit_roundoff(DType dtype);
// The accumulation unit of fp32 math (2^-24), or of fp64 math for fp64 (2^-53).
double accumulation_unit(DType dtype);
// The smallest magnitude an output of the dtype resolves: half its subnormal spacing (fp32 2^-150,
// fp16 2^-25, bf16 2^-134, fp64 2^-1075).
double half_subnormal_step(DType dtype);
// The floor of a reduction's output: the smallest normal where GPUs may flush fp32 subnormals
// (fp32 and bf16 2^-126), fp16's subnormal spacing (2^-24), fp64's smallest normal (2^-1022).
double reduction_floor(DType dtype);
// v rounded to the nearest value of the dtype (NaN and Inf kept).
double round_to(DType dtype, double v);

// GEMM: the allowed error of one element of C (above). out: C's dtype.
double gemm_allowed_error(DType out, int64_t k, double ref, double magnitude);

// Reductions: the allowed max error of one unit (above). same_error = max |same - ref| and max_ref =
// max |ref| over the unit's finite reference values; terms: the magnitude of what was summed (0:
// none); u_acc: accumulation_unit(), or 2^-24 where the op reads fp32 statistics (the norms'
// backward) whatever the dtype.
double reduction_allowed_error(DType out, int64_t n, double same_error, double max_ref, double terms, double u_acc);

}  // namespace optimized::testing
