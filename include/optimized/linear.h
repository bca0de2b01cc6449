// Linear layers: y = act(x W^T + b), forward and backward (the seed's backprop_optimized family).
//
//   x (..., K): the leading dimensions flattened to M rows (a view whose rows are uniformly
//               strided: rows at least K apart, unit stride along K), M may be 0
//   W (N, K):   the weight, as torch.nn.Linear stores it (row-major; a transposed view is taken)
//   b (N):      the bias, or absent (rank 0)
//   y (..., N): x's leading dimensions, rows uniformly strided, unit stride along N
//   pre (..., N): the pre-activation x W^T + b, written by the forward when given (the backward's
//               input for act'(pre)); absent: the backward recomputes it (one more GEMM)
//
// Activations as the GEMM epilogues' (include/optimized/gemm.h, Activation): none, ReLU, GELU (erf,
// tanh), SiLU. Every operand of a call shares one dtype (fp32, fp16, bf16; fp64 on the cpu
// variant), except the gradients of W and b, which may also be fp32 for 16-bit inputs (master
// gradients); products accumulate in fp32 (fp64 for fp64) and each output is rounded once.
//
// Backward, with g = dy (no activation) or g = dy * act'(pre):
//   grad_input  dX = g W            (M, K)  (absent: not computed)
//   grad_weight dW = g^T X          (N, K)  (absent: not computed)
//   grad_bias   db = sum over rows of g (N) (absent: not computed), in a fixed order: the same bits
//               every run (no atomics)
// With accumulate (LinearBackwardOptions), dW and db are added to what grad_weight / grad_bias hold
// (gradient accumulation in one pass: an fp32 master gradient from 16-bit activations, say).
//
// Variants, from naive to best: cpu (the CPU GEMM with its epilogue, and loops for g and db),
// naive (one thread per output: the GEMM family's naive rung with its epilogue), fused (GEMM with
// bias and activation in the epilogue: the mma.sync pipeline), persistent (Hopper: the persistent
// warp-specialized wgmma GEMM; bias, activation and pre applied to the accumulators and stored by
// TMA, the next tile's loads running meanwhile; the tensor cores still wait for that epilogue:
// docs/perf-notes/linear.md), auto (the GEMM family's choice). The backward
// runs the same GEMM rung for dgrad and wgrad, g and db in one pass over dy and pre.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized {

enum class LinearVariant : uint8_t {
  kAuto,        // CPU: kCpu; CUDA: the GEMM family's auto with the epilogue (persistent on an H100)
  kCpu,         // the CPU GEMM (packed, threads) with the epilogue; loops for g and db
  kNaive,       // CUDA: one thread per output (GemmVariant::kCudaNaive + epilogue)
  kFused,       // CUDA: mma.sync pipeline with bias + activation in the epilogue (fp16 / bf16)
  kPersistent,  // CUDA, Hopper: persistent warp-specialized wgmma GEMM + epilogue (fp16 / bf16, sm_90a)
};

std::string_view linear_variant_name(LinearVariant variant);  // "cpu", "naive", "fused", "persistent"
LinearVariant parse_linear_variant(std::string_view name);    // throws Error naming the choices
std::span<const LinearVariant> all_linear_variants();          // every variant but kAuto, in order
bool linear_variant_is_cuda(LinearVariant variant);
std::string linear_variant_rejects_dtype(LinearVariant variant, DType dtype);  // empty: runs it

// fp8 (the options' fp8 flag): the GEMMs run on fp8 operands with per-tensor current scaling --
// each operand quantized with the scale its own amax gives, in the same call (no history):
//   q = fp8_max / max|t| (1 for an all-zero tensor);  t8 = fp8(clamp(t * q, +-fp8_max)), rounded
//   to nearest even;  the GEMM (scaled_matmul) on t8 with the dequantization scale 1 / q.
// x and W are e4m3 (largest 448), the gradient g e5m2 (largest 57344); products accumulate in
// fp32 and the epilogue (bias, activation, pre, accumulate) is the 16-bit path's. A NaN or an
// infinity in an operand makes the whole product NaN (its scale is NaN), never silently finite.
// Inputs fp32, fp16 or bf16; variants auto, cpu (the CPU scaled GEMM), naive (its one-thread-per-
// output rung) and persistent (Hopper: the fp8 wgmma GEMM); fused has no fp8 GEMM (kUnsupported).
// amax of g is taken in the pass that writes g; x, W (and dy without an activation) get an amax
// pass of their own, then one cast pass writes the K-major fp8 copies each GEMM reads.
struct LinearForwardOptions {
  Activation activation = Activation::kNone;
  bool fp8 = false;
};

// y = act(x W^T + b); pre = x W^T + b when given (absent: rank 0).
void linear_forward(const TensorView& x, const TensorView& weight, const TensorView& bias, const TensorView& y,
                    const TensorView& pre, const LinearForwardOptions& options,
                    LinearVariant variant = LinearVariant::kAuto, const ExecutionContext& ctx = {});
inline void linear_forward(const TensorView& x, const TensorView& weight, const TensorView& bias, const TensorView& y,
                           const TensorView& pre = {}, Activation activation = Activation::kNone,
                           LinearVariant variant = LinearVariant::kAuto, const ExecutionContext& ctx = {}) {
  linear_forward(x, weight, bias, y, pre, LinearForwardOptions{activation, false}, variant, ctx);
}

struct LinearBackwardOptions {
  Activation activation = Activation::kNone;
  bool accumulate = false;  // dW, db added to grad_weight / grad_bias instead of written
  bool fp8 = false;         // dX = g8 W8, dW = g8^T x8 (above); a recomputed pre as the fp8 forward's
};

// The gradients named (any of them absent: not computed). pre: the forward's, required with an
// activation unless absent and recomputed from x, W and b (then `bias` must be the forward's: an
// absent bias means the forward had none). Without an activation pre and bias are checked, not read.
// No rows (M = 0): grad_weight and grad_bias are zeroed (left as they are with accumulate).
// persistent loads x, W and g through TMA: rows of x and W must be 16-byte aligned (K a multiple of
// 8 for 16-bit data), else the GEMM refuses with an Error (auto stages such operands itself).
void linear_backward(const TensorView& grad_input, const TensorView& grad_weight, const TensorView& grad_bias,
                     const TensorView& grad_output, const TensorView& input, const TensorView& weight,
                     const TensorView& pre, const TensorView& bias, const LinearBackwardOptions& options = {},
                     LinearVariant variant = LinearVariant::kAuto, const ExecutionContext& ctx = {});

// The seed's entries, for the ladder's readers: linear_forward with the named rung.
inline void linear_forward_naive(const TensorView& x, const TensorView& w, const TensorView& b, const TensorView& y,
                                 Activation a = Activation::kNone, const ExecutionContext& ctx = {}) {
  linear_forward(x, w, b, y, {}, a, LinearVariant::kNaive, ctx);
}
inline void linear_forward_fused(const TensorView& x, const TensorView& w, const TensorView& b, const TensorView& y,
                                 Activation a = Activation::kNone, const ExecutionContext& ctx = {}) {
  linear_forward(x, w, b, y, {}, a, LinearVariant::kFused, ctx);
}
inline void linear_forward_persistent(const TensorView& x, const TensorView& w, const TensorView& b,
                                      const TensorView& y, Activation a = Activation::kNone,
                                      const ExecutionContext& ctx = {}) {
  linear_forward(x, w, b, y, {}, a, LinearVariant::kPersistent, ctx);
}
inline void linear_backward_optimized(const TensorView& grad_input, const TensorView& grad_weight,
                                      const TensorView& grad_bias, const TensorView& grad_output,
                                      const TensorView& input, const TensorView& weight, const TensorView& pre,
                                      const TensorView& bias, const LinearBackwardOptions& options = {},
                                      const ExecutionContext& ctx = {}) {
  linear_backward(grad_input, grad_weight, grad_bias, grad_output, input, weight, pre, bias, options,
                  LinearVariant::kAuto, ctx);
}

}  // namespace optimized
