// Fused memory-bound ops: row-wise softmax / log_softmax, layer_norm, rms_norm, residual add +
// norm, bias + GELU, SiLU-and-mul; forward and backward.
//
// Every op works on rows: a 2-D view (rows, width) whose last dimension has unit stride and whose
// rows may be further apart than the width (row stride >= width); a 1-D view is one row. Rows may
// number 0 (nothing is done) to any count; the width may be 1 to 262144 and beyond.
// Tensors: fp32, fp16 or bf16, one dtype for every data operand of a call (x, residual, weight,
// bias, y, dy, dx, dweight, dbias); statistics (mean, rstd) are fp32 and every op computes in fp32.
// fp64 is taken by the CPU variant only (computing in fp64, with fp64 statistics), so that
// gradients can be checked in float64 on the library's own code.
//
// Scalars (softmax's scale, the norms' eps) are taken as double: the fp64 CPU path computes with
// them as given; fp32 / fp16 / bf16 round them to fp32 once, as the fp32 math they run in needs.
//
// Optional operands are passed as an empty view (`TensorView{}`, rank 0): "absent".
// An output may be the very same view as an input of the same shape (in place: y = x,
// residual_out = residual, dx = dy); any other overlap between an output and another operand is
// rejected. A backward over zero rows writes zeros to dweight / dbias.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "optimized/core.h"
#include "optimized/rope.h"

namespace optimized {

// The ladder, from what a naive implementation launches to the fused kernels.
enum class FusedVariant : uint8_t {
  kAuto,             // CPU: kCpu; CUDA: the fused design measured faster for the op, width and
                     // alignment (resolve_fused_variant), kCudaFusedStreaming past the registers' limit
  kCpu,              // plain loops on the host, threads over rows (fp32 math; fp64 for fp64)
  kCudaUnfused,      // one kernel per elementary step, temporaries in global memory
  kCudaFusedStreaming,// one kernel; a block per row streams the row from global memory in passes
                     // (any width: the long-row design)
  kCudaFusedRegisters,// one kernel; the row is read once into registers, reduced, written once
                     // (rows up to fused_registers_max_width(): the short-row design)
};

std::string_view fused_variant_name(FusedVariant variant);  // "cpu", "unfused", "fused_streaming", "fused_registers"
FusedVariant parse_fused_variant(std::string_view name);    // throws Error naming the choices
std::span<const FusedVariant> all_fused_variants();          // every variant but kAuto, in order
bool fused_variant_is_cuda(FusedVariant variant);
// Empty when `variant` can run this dtype; otherwise why not ("unfused supports fp32, fp16, bf16
// (fp64 runs on cpu); given fp64"). kAuto: whatever some variant runs.
std::string fused_variant_rejects_dtype(FusedVariant variant, DType dtype);
bool fused_variant_supports_dtype(FusedVariant variant, DType dtype);
// The CUDA compute capability (major * 10 + minor) a variant needs; 0 for cpu and kAuto.
int fused_variant_min_compute_capability(FusedVariant variant);

// The ops of the family (for the benchmark, for describing and for error messages).
enum class FusedOp : uint8_t {
  kSoftmax,      // y = softmax(scale * x) over the row
  kLogSoftmax,   // y = log_softmax(scale * x) over the row
  kLayerNorm,    // y = (x - mean) * rstd * weight + bias
  kRmsNorm,      // y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps)
  kAddLayerNorm, // h = x + residual; residual_out = h; y = layer_norm(h)
  kAddRmsNorm,   // h = x + residual; residual_out = h; y = rms_norm(h)
  kBiasGelu,     // y = gelu(x + bias), erf or tanh form
  kSiluAndMul,   // x = [a | b] (halves of the row); y = silu(a) * b
};
std::string_view fused_op_name(FusedOp op);  // "softmax", "log_softmax", "layer_norm", ...
FusedOp parse_fused_op(std::string_view name);
std::span<const FusedOp> all_fused_ops();

enum class GeluApproximation : uint8_t { kNone, kTanh };  // torch's approximate='none' | 'tanh'

// The longest row (in elements) kCudaFusedRegisters holds for this op and dtype; longer rows
// need kCudaFusedStreaming (kAuto switches by itself). 0 when the op has no row reduction.
// `aligned_rows`: every row of every operand starts on a 16-byte boundary (vector loads); other
// rows are loaded element by element and fewer fit.
int64_t fused_registers_max_width(FusedOp op, DType dtype, bool backward, bool aligned_rows = true);

// The variant kAuto resolves to for an op on (rows, width) rows of `dtype` on `device`.
// Throws Error kInvalidArgument for a width < 0 or a device that is neither the CPU nor a CUDA
// ordinal >= 0, kUnsupported for a dtype the family does not take there (fp64 runs on the CPU only);
// each message names the argument.
FusedVariant resolve_fused_variant(FusedOp op, DType dtype, Device device, int64_t width,
                                   bool backward, bool aligned_rows = true);

// Bytes of ExecutionContext::workspace an op needs on (rows, width) rows of `dtype` on `device`
// (forward or backward, `variant`; kAuto: what it resolves to). The most any call of these sizes
// needs, whichever optional operands it has (the unfused rung's temporaries, the fused designs'
// per-block dweight / dbias partial sums); 0 on the CPU and for zero rows. aligned_rows = false: the
// most over aligned and unaligned rows (valid for any call); true: for calls whose rows are 16-byte
// aligned (fused_rows_aligned). The size depends on the device (grids follow its SM count): ask for
// the device the op will run on. Throws Error as the ops do for a bad width, dtype or device.
size_t fused_workspace_bytes(FusedOp op, bool backward, DType dtype, Device device, int64_t rows, int64_t width,
                             FusedVariant variant = FusedVariant::kAuto, bool aligned_rows = false);

// ---- softmax -------------------------------------------------------------------------------
// y = softmax(scale * x) (log_softmax when `log`). x, y: (rows, width).
void softmax_forward(const TensorView& x, const TensorView& y, double scale = 1.0, bool log = false,
                     FusedVariant variant = FusedVariant::kAuto, const ExecutionContext& ctx = {});
// dx from the forward output y and the incoming gradient dy (all (rows, width)):
//   softmax:     dx = scale * y * (dy - sum(dy * y))
//   log_softmax: dx = scale * (dy - exp(y) * sum(dy))
void softmax_backward(const TensorView& y, const TensorView& dy, const TensorView& dx,
                      double scale = 1.0, bool log = false,
                      FusedVariant variant = FusedVariant::kAuto, const ExecutionContext& ctx = {});

// ---- layer_norm and residual add + layer_norm -----------------------------------------------
// y = (h - mean) * rstd * weight + bias over each row, rstd = 1 / sqrt(var + eps) (biased
// variance), h = x, or h = x + residual when `residual` is present; then h (rounded to the dtype)
// is written to residual_out and the normalization reads that rounded h, so that forward and
// backward see the same h. weight, bias: (width) or absent. mean, rstd: fp32 (rows), contiguous,
// or absent (inference); backward needs them. For fp64 data (CPU only) mean and rstd are fp64
// instead (fp32 ones are refused then, as fp64 ones are for fp32 / fp16 / bf16 data), so that the
// fp64 backward is fp64-accurate.
void layer_norm_forward(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        const TensorView& bias, double eps, const TensorView& y,
                        const TensorView& residual_out, const TensorView& mean,
                        const TensorView& rstd, FusedVariant variant = FusedVariant::kAuto,
                        const ExecutionContext& ctx = {});
// Gradients of layer_norm_forward. h: what was normalized (x, or residual_out of the add form);
// mean, rstd: as saved by the forward. dresidual_out: the gradient arriving at residual_out (add
// form), added into dx, or absent. dx: (rows, width) -- for the add form it is the gradient of
// both x and residual. dweight, dbias: (width), or absent when not wanted.
void layer_norm_backward(const TensorView& dy, const TensorView& h, const TensorView& weight,
                         const TensorView& mean, const TensorView& rstd,
                         const TensorView& dresidual_out, const TensorView& dx,
                         const TensorView& dweight, const TensorView& dbias,
                         FusedVariant variant = FusedVariant::kAuto,
                         const ExecutionContext& ctx = {});

// ---- rms_norm and residual add + rms_norm ---------------------------------------------------
// y = h * rstd * weight, rstd = 1 / sqrt(mean(h^2) + eps); h as for layer_norm_forward.
void rms_norm_forward(const TensorView& x, const TensorView& residual, const TensorView& weight,
                      double eps, const TensorView& y, const TensorView& residual_out,
                      const TensorView& rstd, FusedVariant variant = FusedVariant::kAuto,
                      const ExecutionContext& ctx = {});
void rms_norm_backward(const TensorView& dy, const TensorView& h, const TensorView& weight,
                       const TensorView& rstd, const TensorView& dresidual_out,
                       const TensorView& dx, const TensorView& dweight,
                       FusedVariant variant = FusedVariant::kAuto, const ExecutionContext& ctx = {});

// ---- bias + GELU ---------------------------------------------------------------------------
// y = gelu(x + bias), bias (width) or absent; x + bias is not rounded before the GELU.
void bias_gelu_forward(const TensorView& x, const TensorView& bias, GeluApproximation approximate,
                       const TensorView& y, FusedVariant variant = FusedVariant::kAuto,
                       const ExecutionContext& ctx = {});
// dx = dy * gelu'(x + bias); dbias = sum over rows of dx (absent: not computed).
void bias_gelu_backward(const TensorView& dy, const TensorView& x, const TensorView& bias,
                        GeluApproximation approximate, const TensorView& dx,
                        const TensorView& dbias, FusedVariant variant = FusedVariant::kAuto,
                        const ExecutionContext& ctx = {});

// ---- SiLU-and-mul (SwiGLU's gate) -----------------------------------------------------------
// x: (rows, 2 * d) = [a | b]; y: (rows, d) = silu(a) * b, silu(a) = a / (1 + exp(-a)).
void silu_and_mul_forward(const TensorView& x, const TensorView& y,
                          FusedVariant variant = FusedVariant::kAuto,
                          const ExecutionContext& ctx = {});
// dy: (rows, d); x: the forward input (rows, 2 * d); dx: (rows, 2 * d).
void silu_and_mul_backward(const TensorView& dy, const TensorView& x, const TensorView& dx,
                           FusedVariant variant = FusedVariant::kAuto,
                           const ExecutionContext& ctx = {});

// ---- cross-entropy --------------------------------------------------------------------------
// Per row of logits (rows, vocab), target t, ls = label_smoothing, V = vocab, lse = log(sum(exp(logits))):
//   loss = lse - ((1 - ls) * logits[t] + ls / V * sum(logits)) + z_loss * lse^2
// (torch's label smoothing: (1 - ls) * nll + ls * mean(-log_softmax); the z-loss of PaLM / Megatron);
// a term whose coefficient is 0 is dropped (ls = 0: a -inf logit elsewhere in the row leaves the loss
// finite, as torch). Rows with t == ignore_index: loss 0, lse 0 and a zero gradient row, and the
// logits are not read. ±inf and NaN logits give what the same float64 formulas give (a +inf logit:
// NaN; a -inf logits[t]: +inf; NaN propagates).
// The gradient for a unit upstream gradient of the row's loss:
//   grad = softmax * (1 + 2 z_loss lse) - ls / V - (1 - ls) onehot(t)    (0 for ignored rows)
// Math in fp32 (fp64 for fp64 logits, on the CPU variant only).
//   logits: (rows, vocab) fp32 / fp16 / bf16 (fp64 on cpu), unit stride along the vocabulary, rows
//           any distance >= vocab apart; vocab >= 1 (up to 262144 and beyond);
//   target: (rows) int64 or int32, any stride; values in [0, vocab) or ignore_index. Out of range:
//           on the CPU an Error (kInvalidArgument naming the row and the value); on CUDA (which
//           cannot raise without a sync) that row's loss, lse and gradient are NaN, with no access
//           out of bounds;
//   loss, lse: (rows) contiguous, fp32 (fp64 for fp64 logits); lse absent: not written;
//   grad_logits: (rows, vocab) of the logits' dtype, or absent (the forward alone: one read of the
//           logits). It may be the very same view as logits: the gradient then overwrites the logits
//           (each row is read whole before its gradient is written);
//   variant: kAuto (cpu on the CPU, fused_streaming on CUDA), kCpu, kCudaFusedStreaming (a block per
//           row, which reads the row a second time for the gradient) or kCudaFusedRegisters (a cluster of
//           blocks holds the row in registers: one read, but slower on the H100, see
//           docs/perf-notes/fused.md; calls it cannot hold -- vocab not a multiple of 16 bytes, rows off
//           16-byte alignment, rows over 512 KB, fewer rows than fill the GPU -- run the streaming
//           kernels); kCudaUnfused has no cross-entropy (kUnsupported).
// Reductions (mean over the rows whose target is not ignore_index, sum) are the caller's: a sum of
// `rows` floats. CUDA: a workspace of cross_entropy_workspace_bytes (0 unless long rows are split
// over several blocks; the C++ API allocates one on the stream when ctx gives none).
// grad_scale: absent, or the gradient's factor: one element (every row) or (rows) (one per row), fp32
// (fp64 for fp64 logits), on the logits' device, any stride. The gradient written is the unit one times
// the factor, formed in fp32 and rounded once: a mean reduction passes 1 / (rows not ignored) computed
// on the device, so the backward has nothing left to do for an upstream gradient of 1 (see
// cross_entropy_backward). Given without grad_logits: an error.
struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;  // in [0, 1]
  double z_loss = 0.0;           // >= 0
  TensorView grad_scale;         // absent: 1
};
void cross_entropy_forward(const TensorView& logits, const TensorView& target, const CrossEntropyOptions& options,
                           const TensorView& loss, const TensorView& lse, const TensorView& grad_logits,
                           FusedVariant variant = FusedVariant::kAuto, const ExecutionContext& ctx = {});
// Bytes of ExecutionContext::workspace cross_entropy_forward needs for (rows, vocab) logits of `dtype`
// on `device` (any alignment, with or without a gradient); 0 on the CPU. Throws Error as the op does
// for a bad dtype, device or variant.
size_t cross_entropy_workspace_bytes(DType dtype, Device device, int64_t rows, int64_t vocab,
                                     FusedVariant variant = FusedVariant::kAuto);
// The backward through a gradient the forward stored (grad_logits above, for the upstream gradient the
// forward assumed): grad_logits[r, :] *= grad_loss[r], in place, with fp32 math (fp64 for fp64) rounded
// once. grad_loss: one element (a reduced loss's upstream gradient, every row) or (rows), fp32 (fp64 for
// fp64 gradients), on grad_logits' device, any stride. A row whose factor is exactly 1 is neither read
// nor written -- on CUDA the factor is read on the device, so loss.backward() with its usual upstream 1
// costs a launch and no pass over the (rows, vocab) gradient, without a host sync.
//   grad_logits: (rows, vocab) or (vocab), fp32 / fp16 / bf16 (fp64 on the CPU), unit stride along the
//                vocabulary, rows any distance >= vocab apart.
void cross_entropy_backward(const TensorView& grad_loss, const TensorView& grad_logits,
                            const ExecutionContext& ctx = {});


// ---- rotary position embedding (RoPE) ------------------------------------------------------
// q (B, S, H_q, D) and k (B, S, H_k, D) (H_k may differ from H_q: GQA / MQA; k may be absent) are
// rotated at positions (B, S) or (S) (the same for every sequence), int32 or int64, any values
// (packed / varlen and decode positions; negative ones rotate backwards): for pair i of the first
// rotary_dim dims of every row at position p, angle = p * theta^(-2i / rotary_dim), in the layout
// rope.layout (kNeox or kInterleaved; include/optimized/rope.h); the dims past rotary_dim pass
// through. rope.rotary_dim: 0 (D) or even, 2..D.
// Precision: the angle is formed and reduced to [-pi, pi] in fp64 (inv_freq = pow(theta, -2i / rotary_dim),
// p * inv_freq, minus the nearest multiple of 2 pi), then cos / sin in the math
// precision (fp32; fp64 for fp64), so that large positions (100000 and beyond) keep fp32 accuracy:
// the plain fp32 product p * inv_freq would carry errors up to ~|angle| * 6e-8 rad (6e-3 at p = 1e5).
// cos_sin: optional cache (max_pos, rotary_dim) = [cos | sin] of every position's angles (vLLM's
// cos_sin_cache layout; row stride >= rotary_dim, unit stride along it), fp32 (fp64 for fp64
// operands), used instead of computing them; a position outside [0, max_pos) then yields NaN in its
// rotated dims (read back nothing out of bounds; no host check, which would synchronise).
// Views: unit stride along D; any non-negative strides along B, S, H (slices of a fused qkv tensor,
// (B, S) or (S, B) orders). q_out / k_out: the shapes and dtype of q / k, elements that do not
// overlap one another; the very same view as q / k computes in place; otherwise no overlap with
// another operand (q and k slices of one qkv tensor are told apart exactly, head ranges per token).
// Dtypes: fp32, fp16, bf16 (math in fp32), fp64 on the cpu variant. B, S, H may be 0.
enum class RopeVariant : uint8_t {
  kAuto,  // the operands' device: kCpu or kCuda
  kCpu,   // threads over tokens; cos / sin once per token, shared by its rows
  kCuda,  // a block per token: the cos / sin table in shared memory, its H_q + H_k rows as 16-byte vectors
};
std::string_view rope_variant_name(RopeVariant variant);  // "cpu", "cuda" ("auto")
RopeVariant parse_rope_variant(std::string_view name);    // throws Error naming the choices
std::span<const RopeVariant> all_rope_variants();          // kCpu, kCuda
// The longest rotary_dim the cuda variant takes (its table lives in shared memory).
int64_t rope_cuda_max_rotary_dim();

// q_out = rope(q), k_out = rope(k).
void rope_forward(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeOptions& rope,
                  const TensorView& q_out, const TensorView& k_out, const TensorView& cos_sin = {},
                  RopeVariant variant = RopeVariant::kAuto, const ExecutionContext& ctx = {});
// The gradients: the rotation is orthogonal, its transpose the rotation by -angle, so dq = rope^T(dq_out),
// dk = rope^T(dk_out) (the same kernel with sin negated; also the inverse of rope_forward).
void rope_backward(const TensorView& dq_out, const TensorView& dk_out, const TensorView& positions,
                   const RopeOptions& rope, const TensorView& dq, const TensorView& dk,
                   const TensorView& cos_sin = {}, RopeVariant variant = RopeVariant::kAuto,
                   const ExecutionContext& ctx = {});

}  // namespace optimized
