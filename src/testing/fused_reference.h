// The references of the fused memory-bound family, the yardsticks every test and the benchmark's
// validation hold the CPU backend and the CUDA kernels against (the rule: tolerance.h, applied by
// fused_check.h).
//
// Both read the host operands of a FusedParams (any of fp32, fp16, bf16, fp64; row strides
// honoured) and compute straight from the formulas of optimized/fused.h:
//
// fused_reference_f64: every value widened to double, double math (long double for fp64 operands,
// so that the reference stays more precise than what it judges), no rounding anywhere:
//   - the add forms compute h = x + residual in double (not rounded to the dtype as the library
//     does; the same-dtype reference's error carries that one rounding into the tolerance);
//   - backward recomputes mean / rstd from the saved input in double and ignores p.mean / p.rstd;
//   - softmax / log_softmax backward read the forward OUTPUT y from p.x, as the library does.
// NaN and Inf follow from the formulas as torch evaluates them (max-subtracted softmax: a row
// holding +inf or only -inf is NaN; a -inf entry among finite ones gives 0 / -inf).
//
// fused_reference_same_dtype: the same formulas the plain way in the dtype's working precision,
// what torch in that dtype computes: float math for fp32 / fp16 / bf16 (double for fp64),
// sequential sums, h = x + residual rounded to the dtype, the norms' backward reading the saved
// p.mean / p.rstd (fp32; p.mean64 / p.rstd64 for fp64 data; recomputed when absent). Its outputs are NOT rounded to their dtype: the check rounds them, so that
// the parameter gradients of row chunks add up before their one rounding.
//
// Outputs are contiguous, rows * width (dx of silu_and_mul: rows * 2 * width); a field the op
// does not produce stays empty. Slow and obvious on purpose: never timed.
#pragma once

#include <vector>

#include "fused/fused_params.h"

namespace optimized::testing {

// GELU's constants, for the references and the check's terms (fused_check.cpp).
constexpr double kGeluSqrtHalf = 0.70710678118654752440;     // 1 / sqrt(2)
constexpr double kGeluSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluInvSqrt2Pi = 0.39894228040143267794;   // 1 / sqrt(2 pi)
constexpr double kGeluCubic = 0.044715;                      // the tanh form's cubic coefficient

struct FusedReference {
  // forward
  std::vector<double> y;             // (rows, width)
  std::vector<double> residual_out;  // (rows, width): add forms
  // statistics of the normalized rows, forward and backward (recomputed): mean for the
  // layer_norm forms, rstd for every norm
  std::vector<double> mean;  // (rows)
  std::vector<double> rstd;  // (rows)
  // backward
  std::vector<double> dx;       // (rows, width) [(rows, 2 * width) for silu_and_mul]
  std::vector<double> dweight;  // (width): norms (the gradient of a weight of ones when absent)
  std::vector<double> dbias;    // (width): layer_norm forms, bias_gelu
};

// p: as the public API hands it to a backend, with HOST pointers. p.rows may be 0.
FusedReference fused_reference_f64(const FusedParams& p);
FusedReference fused_reference_same_dtype(const FusedParams& p);

}  // namespace optimized::testing
