// Public entry of the MoE family (include/optimized/moe.h): validates the operands (messages name
// the argument, what was expected and what was given), builds the params (moe_params.h) and runs the
// CPU backend (cpu/moe_cpu.h) or the CUDA launchers (launchers.h) on the operands' device.
#include <algorithm>
#include <cmath>
#include <string>

#include "core/arg_checks.h"
#include "moe/moe_checks.h"
#include "moe/cpu/moe_cpu.h"
#include "moe/moe_params.h"
#include "optimized/moe.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#include "moe/launchers.h"
#endif

namespace optimized {

namespace {

using arg::dname;
using arg::invalid;
using arg::present;
using arg::shape_string;
using arg::unsupported;
using moe_checks::add_exact;
using moe_checks::check_dtype;
using moe_checks::check_float;
using moe_checks::cuda_prelude;


}  // namespace

std::string_view moe_scoring_name(MoeScoring scoring) {
  switch (scoring) {
    case MoeScoring::kSoftmax: return "softmax";
    case MoeScoring::kSigmoid: return "sigmoid";
  }
  return "unknown";
}

MoeScoring parse_moe_scoring(std::string_view name) {
  for (MoeScoring s : {MoeScoring::kSoftmax, MoeScoring::kSigmoid})
    if (moe_scoring_name(s) == name) return s;
  invalid("scoring: expected one of softmax, sigmoid; given '" + std::string(name) + "'");
}

int64_t moe_capacity(double capacity_factor, int64_t tokens, int64_t top_k, int64_t experts) {
  if (!(capacity_factor > 0) || !std::isfinite(capacity_factor))
    invalid("capacity_factor: expected a finite number > 0; given " + arg::number(capacity_factor));
  if (tokens < 0 || top_k < 1 || experts < 1)
    invalid("moe_capacity: expected tokens >= 0, top_k >= 1, experts >= 1; given " + std::to_string(tokens) + ", " +
            std::to_string(top_k) + ", " + std::to_string(experts));
  return static_cast<int64_t>(std::ceil(capacity_factor * static_cast<double>(tokens) * static_cast<double>(top_k) /
                                        static_cast<double>(experts)));
}

// ---- routing -------------------------------------------------------------------------------------

namespace {

// The router's logits (T, E) (recorded as an input of ops) and the options (the forward's rules, which
// the backward shares so that any options the forward takes it takes too).
void check_route_logits(arg::OperandSet& ops, const TensorView& logits) {
  if (logits.rank != 2)
    invalid("logits: expected rank 2 (tokens T, experts E); given " +
            (logits.rank ? "rank " + std::to_string(logits.rank) + " " + shape_string(logits) : std::string("absent")));
  ops.add(logits, "logits", false);
  const int64_t T = logits.shape[0], E = logits.shape[1];
  check_float(logits, "logits");
  if (E < 1 || E > kMoeMaxExperts)
    invalid("logits: expected 1 <= E <= " + std::to_string(kMoeMaxExperts) + " experts (its last dimension); given " +
            shape_string(logits));
  if (E > 1 && logits.strides[1] != 1)
    invalid("logits: expected unit stride along the experts; given " + logits.describe());
  if (T > 1 && logits.strides[0] < E)
    invalid("logits: expected rows at least E = " + std::to_string(E) + " elements apart; given " + logits.describe());
}

void check_route_options(const MoeRouteOptions& o, int64_t E) {
  const int k = o.top_k;
  if (k < 1 || k > E || k > kMoeMaxTopK)
    invalid("top_k: expected 1 <= k <= min(E, " + std::to_string(kMoeMaxTopK) + ") = " +
            std::to_string(std::min<int64_t>(E, kMoeMaxTopK)) + "; given " + std::to_string(k));
  if (o.scoring != MoeScoring::kSoftmax && o.scoring != MoeScoring::kSigmoid)
    invalid("scoring: expected softmax or sigmoid; given value " + std::to_string(static_cast<unsigned>(o.scoring)));
  if (o.topk_softmax && o.scoring != MoeScoring::kSoftmax)
    invalid("topk_softmax: expected softmax scoring (the softmax over the chosen logits); given sigmoid");
  if (o.n_groups < 1 || o.n_groups > kMoeMaxGroups || E % o.n_groups != 0)
    invalid("n_groups: expected 1 <= n_groups <= " + std::to_string(kMoeMaxGroups) + " dividing E = " +
            std::to_string(E) + "; given " + std::to_string(o.n_groups));
  if (o.topk_groups < 1 || o.topk_groups > o.n_groups)
    invalid("topk_groups: expected 1 <= topk_groups <= n_groups = " + std::to_string(o.n_groups) + "; given " +
            std::to_string(o.topk_groups));
  if (static_cast<int64_t>(o.topk_groups) * (E / o.n_groups) < k)
    invalid("topk_groups: expected the chosen groups to hold at least k = " + std::to_string(k) + " experts (" +
            std::to_string(o.topk_groups) + " groups of " + std::to_string(E / o.n_groups) + ")");
  if (!std::isfinite(o.routed_scale))
    invalid("routed_scale: expected a finite number; given " + arg::number(o.routed_scale));
}

}  // namespace

void moe_route(const TensorView& logits, const TensorView& bias, const TensorView& topk_ids,
               const TensorView& topk_weights, const TensorView& lse, const MoeRouteOptions& o,
               const ExecutionContext& ctx) {
  arg::OperandSet ops;
  check_route_logits(ops, logits);
  const int64_t T = logits.shape[0], E = logits.shape[1];
  check_route_options(o, E);
  const int k = o.top_k;
  if (present(bias))
    add_exact(ops, bias, "bias", false, DType::kF32, {E}, "(E) = (" + std::to_string(E) + ")");
  const std::string tk = "(T, k) = (" + std::to_string(T) + ", " + std::to_string(k) + ")";
  add_exact(ops, topk_ids, "topk_ids", true, DType::kI32, {T, k}, tk);
  add_exact(ops, topk_weights, "topk_weights", true, DType::kF32, {T, k}, tk);
  if (present(lse))
    add_exact(ops, lse, "lse", true, DType::kF32, {T}, "(T) = (" + std::to_string(T) + ")");
  ops.check_overlaps();
  const Device device = ops.device();
  cuda_prelude(device, "logits");
  if (T == 0) return;

  MoeRouteParams p;
  p.logits = logits.data, p.dtype = logits.dtype, p.tokens = T, p.experts = E;
  p.ld = T > 1 ? logits.strides[0] : E;
  p.bias = present(bias) ? static_cast<const float*>(bias.data) : nullptr;
  p.ids = static_cast<int32_t*>(topk_ids.data);
  p.weights = static_cast<float*>(topk_weights.data);
  p.lse = present(lse) ? static_cast<float*>(lse.data) : nullptr;
  p.k = k, p.scoring = static_cast<int>(o.scoring), p.topk_softmax = o.topk_softmax, p.normalize = o.normalize;
  p.n_groups = o.n_groups, p.topk_groups = o.topk_groups, p.routed_scale = o.routed_scale;
  if (!device.is_cuda()) {
    cpu::moe_route(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  check_cuda(cuda::moe_route(p, {}, static_cast<cudaStream_t>(ctx.cuda_stream)), "moe_route");
#endif
}

void moe_route_backward(const TensorView& logits, const TensorView& topk_ids, const TensorView& grad_weights,
                        const TensorView& grad_lse, const TensorView& grad_logits, const MoeRouteOptions& o,
                        const ExecutionContext& ctx) {
  arg::OperandSet ops;
  check_route_logits(ops, logits);
  const int64_t T = logits.shape[0], E = logits.shape[1];
  check_route_options(o, E);
  const int k = o.top_k;
  const std::string tk = "(T, k) = (" + std::to_string(T) + ", " + std::to_string(k) + ")";
  add_exact(ops, topk_ids, "topk_ids", false, DType::kI32, {T, k}, tk);
  if (present(grad_weights))
    add_exact(ops, grad_weights, "grad_weights", false, DType::kF32, {T, k}, tk);
  if (present(grad_lse))
    add_exact(ops, grad_lse, "grad_lse", false, DType::kF32, {T}, "(T) = (" + std::to_string(T) + ")");
  const int64_t ld_grad = moe_checks::row_stride(grad_logits, "grad_logits", T, E,
                                                 "(T, E) = (" + std::to_string(T) + ", " + std::to_string(E) + ")");
  ops.add(grad_logits, "grad_logits", true);
  if (grad_logits.dtype != logits.dtype && grad_logits.dtype != DType::kF32)
    invalid("grad_logits: expected dtype " + dname(logits.dtype) + " (the logits') or fp32; given " +
            dname(grad_logits.dtype));
  ops.check_overlaps();
  const Device device = ops.device();
  cuda_prelude(device, "logits");
  if (T == 0) return;

  MoeRouteBackwardParams p;
  p.logits = logits.data, p.dtype = logits.dtype, p.tokens = T, p.experts = E;
  p.ld = T > 1 ? logits.strides[0] : E;
  p.ids = static_cast<const int32_t*>(topk_ids.data);
  p.grad_weights = present(grad_weights) ? static_cast<const float*>(grad_weights.data) : nullptr;
  p.grad_lse = present(grad_lse) ? static_cast<const float*>(grad_lse.data) : nullptr;
  p.grad_logits = grad_logits.data, p.grad_dtype = grad_logits.dtype, p.ld_grad = ld_grad;
  p.k = k, p.scoring = static_cast<int>(o.scoring), p.topk_softmax = o.topk_softmax, p.normalize = o.normalize;
  p.routed_scale = o.routed_scale;
  if (!device.is_cuda()) {
    cpu::moe_route_backward(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  check_cuda(cuda::moe_route_backward(p, {}, static_cast<cudaStream_t>(ctx.cuda_stream)), "moe_route_backward");
#endif
}

// ---- permutation ---------------------------------------------------------------------------------

size_t moe_permute_workspace_bytes(int64_t pairs, int64_t experts, Device device) {
  if (pairs < 0 || experts < 1)
    invalid("moe_permute_workspace_bytes: expected pairs >= 0 and experts >= 1; given " + std::to_string(pairs) + ", " +
            std::to_string(experts));
  if (!device.is_cuda()) return 0;
#if OPTIMIZED_WITH_CUDA
  return cuda::moe_permute_workspace_bytes(pairs, experts);
#else
  return 0;
#endif
}

void moe_permute(const TensorView& topk_ids, int64_t num_experts, int64_t capacity, const TensorView& counts,
                 const TensorView& offsets, const TensorView& sorted_pairs, const TensorView& slot_of,
                 const TensorView& dropped, const ExecutionContext& ctx) {
  arg::OperandSet ops;
  if (topk_ids.rank != 2)
    invalid("topk_ids: expected rank 2 (tokens T, k); given " + (topk_ids.rank ? shape_string(topk_ids) : std::string("absent")));
  ops.add(topk_ids, "topk_ids", false);
  check_dtype(topk_ids, "topk_ids", DType::kI32);
  const int64_t T = topk_ids.shape[0], k = topk_ids.shape[1], P = T * k;
  if (!topk_ids.is_contiguous()) invalid("topk_ids: expected a contiguous tensor; given " + topk_ids.describe());
  if (k < 1) invalid("topk_ids: expected k >= 1; given " + shape_string(topk_ids));
  if (num_experts < 1 || num_experts > kMoeMaxExperts)
    invalid("num_experts: expected 1 <= E <= " + std::to_string(kMoeMaxExperts) + "; given " + std::to_string(num_experts));
  if (capacity < 0) invalid("capacity: expected >= 0 (0: dropless); given " + std::to_string(capacity));
  if (P >= (int64_t(1) << 31)) invalid("topk_ids: expected fewer than 2^31 pairs (int32 slots); given " + shape_string(topk_ids));
  const int64_t E = num_experts;
  const auto out = [&](const TensorView& t, const char* name, std::initializer_list<int64_t> shape, const std::string& what) {
    add_exact(ops, t, name, true, DType::kI32, shape, what);
  };
  out(counts, "counts", {E}, "(E) = (" + std::to_string(E) + ")");
  out(offsets, "offsets", {E + 1}, "(E + 1) = (" + std::to_string(E + 1) + ")");
  out(sorted_pairs, "sorted_pairs", {P}, "(T k) = (" + std::to_string(P) + ")");
  out(slot_of, "slot_of", {T, k}, "(T, k) = (" + std::to_string(T) + ", " + std::to_string(k) + ")");
  if (present(dropped)) out(dropped, "dropped", {1}, "(1)");
  ops.check_overlaps();
  const Device device = ops.device();
  cuda_prelude(device, "topk_ids");

  MoePermuteParams p;
  p.ids = static_cast<const int32_t*>(topk_ids.data);
  p.pairs = P, p.experts = E, p.capacity = capacity;
  p.counts = static_cast<int32_t*>(counts.data);
  p.offsets = static_cast<int32_t*>(offsets.data);
  p.sorted_pairs = static_cast<int32_t*>(sorted_pairs.data);
  p.slot_of = static_cast<int32_t*>(slot_of.data);
  p.dropped = present(dropped) ? static_cast<int32_t*>(dropped.data) : nullptr;
  if (!device.is_cuda()) {
    cpu::moe_permute(p);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
  const std::string what = "moe_permute";
  CallWorkspace ws(ctx, cuda::moe_permute_workspace_bytes(P, E), what, device.index, stream);
  check_cuda(cuda::moe_permute(p, ws.get(), stream), what);
  ws.release(what);
#else
  (void)ctx;
#endif
}

// ---- combine -------------------------------------------------------------------------------------

namespace {

// A (rows, cols) operand of `dtype` with unit stride along cols: added to ops, its row stride.
int64_t matrix_rows(arg::OperandSet& ops, const TensorView& t, const char* name, int64_t rows, int64_t cols,
                    DType dtype, const std::string& what, bool output) {
  const int64_t ld = moe_checks::row_stride(t, name, rows, cols, what);
  ops.add(t, name, output);
  check_dtype(t, name, dtype);
  return ld;
}

void run_combine(const MoeCombineParams& p, const Device& device, const ExecutionContext& ctx, const char* what) {
  if (!device.is_cuda()) {
    cpu::moe_combine(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  check_cuda(cuda::moe_combine(p, {}, static_cast<cudaStream_t>(ctx.cuda_stream)), what);
#else
  (void)what;
#endif
}

// slot_of and weights (T, k): T and k.
void check_pairs(arg::OperandSet& ops, const TensorView& slot_of, const TensorView& weights, int64_t* T, int64_t* k) {
  if (slot_of.rank != 2)
    invalid("slot_of: expected rank 2 (tokens T, k); given " + (slot_of.rank ? shape_string(slot_of) : std::string("absent")));
  *T = slot_of.shape[0], *k = slot_of.shape[1];
  const std::string tk = "(T, k) = (" + std::to_string(*T) + ", " + std::to_string(*k) + ")";
  add_exact(ops, slot_of, "slot_of", false, DType::kI32, {*T, *k}, tk);
  add_exact(ops, weights, "weights", false, DType::kF32, {*T, *k}, tk);
}

// y (S, N) and the pairs (slot_of, weights (T, k)): the params the combine and its backward share.
MoeCombineParams combine_params(arg::OperandSet& ops, const TensorView& y, const TensorView& slot_of,
                                const TensorView& weights) {
  if (y.rank != 2) invalid("y: expected rank 2 (slots S, N); given " + (y.rank ? shape_string(y) : std::string("absent")));
  check_float(y, "y");
  MoeCombineParams p;
  p.dtype = y.dtype, p.slots = y.shape[0], p.n = y.shape[1];
  if (p.n < 1) invalid("y: expected N >= 1 columns; given " + shape_string(y));
  p.ld_y = matrix_rows(ops, y, "y", p.slots, p.n, y.dtype, "(S, N)", false);
  check_pairs(ops, slot_of, weights, &p.tokens, &p.k);
  p.y = y.data, p.slot_of = static_cast<const int32_t*>(slot_of.data), p.weights = static_cast<const float*>(weights.data);
  return p;
}

std::string tn(const MoeCombineParams& p) {
  return "(T, N) = (" + std::to_string(p.tokens) + ", " + std::to_string(p.n) + ")";
}

}  // namespace

void moe_combine(const TensorView& y, const TensorView& slot_of, const TensorView& weights, const TensorView& out,
                 const ExecutionContext& ctx) {
  arg::OperandSet ops;
  MoeCombineParams p = combine_params(ops, y, slot_of, weights);
  p.ld_out = matrix_rows(ops, out, "out", p.tokens, p.n, y.dtype, tn(p), true);
  p.out = out.data;
  ops.check_overlaps();
  const Device device = ops.device();
  cuda_prelude(device, "y");
  run_combine(p, device, ctx, "moe_combine");
}

void moe_combine_backward(const TensorView& dout, const TensorView& y, const TensorView& slot_of,
                          const TensorView& sorted_pairs, const TensorView& weights, const TensorView& grad_y,
                          const TensorView& grad_weights, const ExecutionContext& ctx) {
  arg::OperandSet ops;
  MoeCombineParams p = combine_params(ops, y, slot_of, weights);
  const int64_t S = p.slots, N = p.n;
  p.ld_out = matrix_rows(ops, dout, "dout", p.tokens, N, y.dtype, tn(p), false);
  add_exact(ops, sorted_pairs, "sorted_pairs", false, DType::kI32, {S}, "(S) = (" + std::to_string(S) + ") (y's rows)");
  if (present(grad_y))
    p.ld_gy = matrix_rows(ops, grad_y, "grad_y", S, N, y.dtype, "(S, N) = (" + std::to_string(S) + ", " +
                          std::to_string(N) + ") (y's)", true);
  if (present(grad_weights))
    add_exact(ops, grad_weights, "grad_weights", true, DType::kF32, {p.tokens, p.k},
              "(T, k) = (" + std::to_string(p.tokens) + ", " + std::to_string(p.k) + ")");
  ops.check_overlaps();
  const Device device = ops.device();
  cuda_prelude(device, "dout");
  if (!present(grad_y) && !present(grad_weights)) return;
  p.sorted_pairs = static_cast<const int32_t*>(sorted_pairs.data);
  p.dout = dout.data;
  p.grad_y = present(grad_y) ? grad_y.data : nullptr;
  p.grad_weights = present(grad_weights) ? static_cast<float*>(grad_weights.data) : nullptr;
  run_combine(p, device, ctx, "moe_combine_backward");
}

}  // namespace optimized
