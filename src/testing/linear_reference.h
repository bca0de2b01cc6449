// The linear family's float64 reference (include/optimized/linear.h) and its checks (host data).
//
//   forward:  pre = x W^T + b, y = act(pre)
//   backward: g = dy * act'(pre_used), dX = g W, dW = c0_w + g^T X, db = c0_b + sum_i g
// in double, with the activation and its derivative in double (the same formulas as the GEMM
// epilogue's). pre_used is what the op evaluates act' at: the pre given to the backward (read back,
// exact), or the recomputed one (the reference's pre rounded to the dtype).
//
// Bounds, per element (u_out = unit_roundoff of the output, u_acc = accumulation_unit of the inputs'
// dtype, floor = half_subnormal_step of the output; tolerance.h):
//   pre  the GEMM rule: gemm_allowed_error(dtype, K, pre, mag), mag = sum_k |x w| + |b|
//   y    1.2 e_acc + u_out |y| + floor + 8 u_acc (|pre| + |act(pre)|)   (e_acc = 8 sqrt(K) u_acc mag;
//        |act'| <= 1.2: the accumulation error carried through the activation, then one rounding)
//   g    e_g = |dy| (dpre + 8 u_acc (1 + |pre_used|)) before rounding, + u |g| when g is materialized
//        in the dtype (an activation): dpre = 0 with pre given, e_acc + u |pre| when recomputed (a
//        one-ulp difference of the recomputed pre; |act''| <= 1 for every activation here)
//   dX   u_out |ref| + floor + sum_j e_g |w| + 8 sqrt(N) u_acc sum_j |g w|
//   dW   u_out |ref| + floor + sum_i e_g |x| + 8 sqrt(M) u_acc (sum_i |g x| + |c0|)
//   db   u_out |ref| + floor + sum_i e_g + M u_acc (sum_i |g| + |c0|)  (fp32 sums in a fixed order)
// The GEMM rule of tolerance.h plus what the intermediate g's rounding carries into each product.
#pragma once

#include <cstdint>
#include <vector>

#include "optimized/gemm.h"
#include "testing/check.h"

namespace optimized::testing {

double activation_f64(Activation act, double x);
double activation_grad_f64(Activation act, double x);

// A problem in double: x (m, k), w (n, k), b (n) or empty, dy (m, n); all dense row-major.
struct LinearProblemF64 {
  int64_t m = 0, n = 0, k = 0;
  Activation act = Activation::kNone;
  std::vector<double> x, w, b, dy;
};

struct LinearForwardF64 {
  std::vector<double> pre, y, magnitude;  // (m, n); magnitude = sum_k |x w| + |b|
};
LinearForwardF64 linear_forward_f64(const LinearProblemF64& p);

struct LinearBackwardF64 {
  std::vector<double> g, grad_input, grad_weight, grad_bias;  // c0 included in grad_weight / grad_bias
  std::vector<double> grad_input_bound, grad_weight_bound, grad_bias_bound;
};
// pre_used: the pre the op evaluates act' at (m, n) (ignored without an activation); recomputed:
// whether the op recomputed it (the dpre term); c0_w (n, k) / c0_b (n): what accumulate adds to
// (empty: zeros). Output dtypes: gi_dtype for dX, gw_dtype / gb_dtype for dW / db; dtype: the inputs'.
LinearBackwardF64 linear_backward_f64(const LinearProblemF64& p, const std::vector<double>& pre_used, bool recomputed,
                                      DType dtype, DType gi_dtype, DType gw_dtype, DType gb_dtype,
                                      const std::vector<double>& c0_w = {}, const std::vector<double>& c0_b = {});

// The forward's outputs (m, n) dense (pre_got may be null) against the reference.
CheckResult check_linear_forward(const LinearProblemF64& p, DType dtype, const std::vector<double>& y_got,
                                 const std::vector<double>* pre_got);
// One gradient (dense, as the reference's) against ref with per-element bounds; name: "grad_input".
CheckResult check_linear_gradient(const char* name, const std::vector<double>& got, const std::vector<double>& ref,
                                  const std::vector<double>& bound, int64_t cols);

}  // namespace optimized::testing
