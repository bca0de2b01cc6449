// The fused family's check: the reduction rule of tolerance.h applied to every output of a call,
// the one oracle of the C++ tests and of the benchmark's validation (pytest applies the same rule
// with torch in the same dtype as the same-dtype reference: tests/python/conftest.py).
//
// Units: a row of a row output (y, residual_out, dx), one rule per row; each row's statistic (mean,
// rstd: fp32, n = width); the whole of a parameter gradient (dweight, dbias: n = rows).
// n: the row width for the row-reducing ops (softmax, log_softmax, the norms), 1 for the
// element-wise ones (bias_gelu, silu_and_mul, residual_out). u_acc: fp32's unit, fp64's for fp64
// (the norms' backward included: fp64 data saves fp64 statistics).
// The terms (the magnitude of what was summed, where a result can cancel far below its terms):
//   layer_norm y  mean |h| rstd max |w|  (h - mean cancels when the row's mean is far from 0)
//   softmax bwd   2 |scale| max y max |dy|;  log_softmax bwd  |scale| (max |dy| + max e^y sum |dy|)
//   norm bwd dx   3 rstd max |dy w| + max |dresidual_out|
//   dweight       3 sum_rows |dy xhat|;  mean  mean |h| (per row)
//   bias_gelu y   0.5 |h| (1 + |erf|) (tanh: |tanh|), where 1 + erf(h / sqrt 2) cancels for h < 0
//   bias_gelu dx  |dy| (0.5 (1 + |erf|) + |h| phi(h)) (tanh likewise); dbias: its sum over rows
// (the backward ones as tests/python/test_fused.py's _softmax_terms and _norm_terms; there the norms' terms take
// |h| rstd for |xhat|, at least 1, as torch's backward reads torch's statistics and ours ours,
// while here the same-dtype reference reads the very statistics the library reads).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "fused/fused_params.h"
#include "testing/check.h"
#include "testing/fused_reference.h"

namespace optimized::testing {

enum class FusedOutput : uint8_t { kY, kResidualOut, kMean, kRstd, kDx, kDweight, kDbias };

std::string_view fused_output_name(FusedOutput o);
std::vector<double>& field(FusedReference& r, FusedOutput o);
const std::vector<double>& field(const FusedReference& r, FusedOutput o);
// y, residual_out, dx: (rows, cols), one unit per row.
bool is_row_output(FusedOutput o);
// Values per row of a row output (2 * width for silu_and_mul's dx), else the output's length.
int64_t output_cols(const FusedParams& p, FusedOutput o);
// The rule's parameters for output o of the call p (p.rows: every row the output covers).
ReductionRule fused_rule(const FusedParams& p, FusedOutput o);

// Everything the check needs of one call (p: host pointers, as for fused_reference_f64).
struct FusedExpected {
  FusedReference ref;    // float64
  FusedReference same;   // same-dtype, unrounded
  FusedReference terms;  // row outputs: one value per row; mean, dweight: per element; empty: none
};
FusedExpected fused_expected(const FusedParams& p);

// Adds the parameter gradients (dweight, dbias) of another chunk of rows into `total`: their
// reference, same-dtype values and terms are all sums over rows.
void add_parameter_gradients(FusedExpected& total, const FusedExpected& chunk);

// Output o of the call against `e`: got in the order of field(e.ref, o). Row outputs and statistics
// may hold any run of whole rows of e; first_row names them in the first failure ("y[4096, 17]").
CheckResult check_fused_output(const FusedParams& p, const FusedExpected& e, FusedOutput o,
                               const std::vector<double>& got, int64_t first_row = 0);

}  // namespace optimized::testing
