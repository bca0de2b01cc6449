// The MoE layer's forward (include/optimized/moe.h: moe_forward): the family's pieces composed into one
// layer with SwiGLU experts -- router logits (the GEMM family's matmul, fp32 out), moe_route,
// moe_permute, moe_gather, grouped_mm_swiglu, grouped_mm, moe_combine -- with every intermediate carved
// from one workspace (core/workspace.h): one CallWorkspace on the call's stream on CUDA, one host
// buffer on the CPU. Every argument is validated before the first step runs, so a refused call
// enqueues nothing. No step synchronises the host (the grouped GEMM's `loop` rung, when picked, is
// that rung's own business: it reads its offsets back).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "core/arg_checks.h"
#include "core/workspace.h"
#include "moe/grouped_variants.h"
#include "moe/moe_checks.h"
#include "optimized/buffer.h"
#include "optimized/gemm.h"
#include "optimized/moe.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#endif

namespace optimized {

namespace {

using arg::dname;
using arg::invalid;
using arg::present;
using arg::shape_string;
using arg::unsupported;
using moe_checks::add_exact;
using moe_checks::check_float;
using moe_checks::row_stride;

// The layer's sizes: T tokens of width d, E experts of hidden width F, k choices per token; P = T k
// pairs, the capacity (0: dropless) and S, the slots the experts compute (P, or at most E capacity).
struct LayerShape {
  int64_t tokens = 0, d = 0, f = 0, experts = 0, k = 0;
  DType dtype = DType::kF32;
  int64_t pairs = 0, capacity = 0, slots = 0;
};

// a * b, refused (naming `name`) where the layer's intermediates would not fit int64 bytes.
int64_t product(int64_t a, int64_t b, const char* name) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r) || r > (int64_t(1) << 56))
    invalid(std::string(name) + ": expected sizes whose intermediates (logits, xs, a, y) fit in memory; given " +
            std::to_string(a) + " x " + std::to_string(b) + " elements");
  return r;
}

// The options' rules (moe_route's and the capacity's), named; the variant's table entry is checked
// against the dtype here and against the device by the caller.
void check_options(const MoeLayerOptions& o, int64_t E, DType dtype) {
  const int64_t k_max = std::min<int64_t>(E, kMoeMaxTopK);
  if (o.top_k < 1 || o.top_k > k_max)
    invalid("top_k: expected 1 <= k <= min(E, " + std::to_string(kMoeMaxTopK) + ") = " + std::to_string(k_max) +
            " (E = " + std::to_string(E) + " experts); given " + std::to_string(o.top_k));
  if (o.scoring != MoeScoring::kSoftmax && o.scoring != MoeScoring::kSigmoid)
    invalid("scoring: expected softmax or sigmoid; given value " + std::to_string(static_cast<unsigned>(o.scoring)));
  if (o.topk_softmax && o.scoring != MoeScoring::kSoftmax)
    invalid("topk_softmax: expected softmax scoring (the softmax over the chosen logits); given sigmoid");
  if (!std::isfinite(o.routed_scale))
    invalid("routed_scale: expected a finite number; given " + arg::number(o.routed_scale));
  if (!std::isfinite(o.capacity_factor))
    invalid("capacity_factor: expected a finite number (<= 0: dropless; > 0: the capacity factor); given " +
            arg::number(o.capacity_factor));
  if (o.variant != GroupedGemmVariant::kAuto) {
    if (!find_variant(kGroupedGemmVariants, o.variant))
      invalid("variant: expected one of " + variant_choices(kGroupedGemmVariants) + "; given value " +
              std::to_string(static_cast<unsigned>(o.variant)));
    const GroupedGemmVariantInfo& row = variant_row(kGroupedGemmVariants, o.variant);
    if (std::string why = variant_rejects_dtype(kGroupedGemmVariants, row, dtype, "grouped_mm"); !why.empty())
      unsupported("variant: " + why);
  }
}

LayerShape layer_shape(int64_t T, int64_t d, int64_t F, int64_t E, DType dtype, const MoeLayerOptions& o) {
  LayerShape s;
  s.tokens = T, s.d = d, s.f = F, s.experts = E, s.k = o.top_k, s.dtype = dtype;
  s.pairs = product(T, s.k, "x");
  if (s.pairs >= (int64_t(1) << 31))
    invalid("x: expected fewer than 2^31 (token, expert) pairs T k (int32 slots); given T = " + std::to_string(T) +
            ", k = " + std::to_string(s.k));
  if (o.capacity_factor > 0 && T > 0) {
    // A capacity of T k or more drops nothing: pass T k (also where ceil(cf T k / E) would not fit int64).
    const double c = o.capacity_factor * static_cast<double>(T) * static_cast<double>(s.k) / static_cast<double>(E);
    s.capacity = c >= static_cast<double>(s.pairs) ? s.pairs : moe_capacity(o.capacity_factor, T, s.k, E);
  }
  s.slots = s.capacity > 0 ? std::min(s.pairs, E * s.capacity) : s.pairs;
  product(product(T, std::max(d, E), "x"), 4, "x");
  product(product(s.slots, std::max(d, F), "x"), static_cast<int64_t>(dtype_size(dtype)), "x");
  return s;
}

// The intermediates, carved from one workspace (WorkspaceArena: 256-byte aligned slices; null when
// counting). y (S, d) reuses xs: the gather's rows are dead once grouped_mm_swiglu has read them.
struct LayerSlices {
  float* logits = nullptr;       // (T, E) fp32
  int32_t* ids = nullptr;        // (T, k)
  float* weights = nullptr;      // (T, k)
  int32_t* counts = nullptr;     // (E): used when the caller wants no tokens_per_expert
  int32_t* offsets = nullptr;    // (E + 1)
  int32_t* sorted_pairs = nullptr;  // (T k)
  int32_t* slot_of = nullptr;    // (T, k)
  void* xs = nullptr;            // (S, d) x's dtype; then y (S, d)
  void* a = nullptr;             // (S, F) x's dtype
  float* x32 = nullptr;          // (T, d) fp32: x converted for an fp32 router (CPU only)
  Workspace permute;             // moe_permute's scratch
};

void carve(WorkspaceArena& arena, const LayerShape& s, bool x_to_fp32, size_t permute_bytes, LayerSlices* p) {
  const int64_t es = static_cast<int64_t>(dtype_size(s.dtype));
  p->logits = arena.take<float>(s.tokens * s.experts);
  p->ids = arena.take<int32_t>(s.pairs);
  p->weights = arena.take<float>(s.pairs);
  p->counts = arena.take<int32_t>(s.experts);
  p->offsets = arena.take<int32_t>(s.experts + 1);
  p->sorted_pairs = arena.take<int32_t>(s.pairs);
  p->slot_of = arena.take<int32_t>(s.pairs);
  p->xs = arena.take<std::byte>(s.slots * s.d * es);
  p->a = arena.take<std::byte>(s.slots * s.f * es);
  p->x32 = x_to_fp32 ? arena.take<float>(s.tokens * s.d) : nullptr;
  std::byte* scratch = arena.take<std::byte>(static_cast<int64_t>(permute_bytes));
  p->permute = permute_bytes ? Workspace{scratch, permute_bytes} : Workspace{};
}

size_t workspace_size(const LayerShape& s, bool x_to_fp32, Device device) {
  WorkspaceArena counting;
  LayerSlices unused;
  carve(counting, s, x_to_fp32, moe_permute_workspace_bytes(s.pairs, s.experts, device), &unused);
  return counting.peak();
}

// x converted to fp32 (T, d) contiguous, for an fp32 router on the CPU: x.float(), exactly.
void widen_rows(const TensorView& x, int64_t ld, float* out) {
  const int64_t T = x.shape[0], d = x.shape[1];
  const auto* bits = static_cast<const uint16_t*>(x.data);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < d; ++j) {
      const uint16_t b = bits[t * ld + j];
      out[t * d + j] = x.dtype == DType::kBF16 ? bf16_to_float(b) : half_to_float(b);
    }
}

}  // namespace

bool grouped_gemm_variant_is_cuda(GroupedGemmVariant variant) { return variant_is_cuda(kGroupedGemmVariants, variant); }

size_t moe_forward_workspace_bytes(int64_t tokens, int64_t d_model, int64_t d_ff, int64_t experts, DType dtype,
                                   const MoeLayerOptions& options, Device device) {
  if (tokens < 0 || d_model < 1 || d_ff < 1)
    invalid("moe_forward_workspace_bytes: expected tokens >= 0, d_model >= 1, d_ff >= 1; given " +
            std::to_string(tokens) + ", " + std::to_string(d_model) + ", " + std::to_string(d_ff));
  if (experts < 1 || experts > kMoeMaxExperts)
    invalid("experts: expected 1 <= E <= " + std::to_string(kMoeMaxExperts) + "; given " + std::to_string(experts));
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16)
    unsupported("dtype: expected fp32, fp16 or bf16; given " + dname(dtype));
  check_options(options, experts, dtype);
  const LayerShape s = layer_shape(tokens, d_model, d_ff, experts, dtype, options);
  return device.is_cuda() ? workspace_size(s, false, device) : 0;
}

void moe_forward(const TensorView& x, const TensorView& router_weight, const TensorView& w13, const TensorView& w2,
                 const MoeLayerOptions& o, const TensorView& out, const TensorView& tokens_per_expert,
                 const TensorView& dropped, const ExecutionContext& ctx) {
  // ---- validation: every argument, before anything runs ----
  arg::OperandSet ops;
  if (x.rank != 2)
    invalid("x: expected rank 2 (tokens T, d_model); given " + (x.rank ? shape_string(x) : std::string("absent")));
  ops.add(x, "x", false);
  check_float(x, "x");
  const int64_t T = x.shape[0], d = x.shape[1];
  if (d < 1) invalid("x: expected d_model >= 1 columns; given " + shape_string(x));
  const int64_t ld_x = row_stride(x, "x", T, d, "(T, d)");
  const DType dt = x.dtype;

  if (router_weight.rank != 2)
    invalid("router_weight: expected rank 2 (experts E, d_model); given " +
            (router_weight.rank ? shape_string(router_weight) : std::string("absent")));
  ops.add(router_weight, "router_weight", false);
  const int64_t E = router_weight.shape[0];
  if (router_weight.shape[1] != d)
    invalid("router_weight: expected shape (E, " + std::to_string(d) + ") (d_model = x's columns); given " +
            shape_string(router_weight));
  if (E < 1 || E > kMoeMaxExperts)
    invalid("router_weight: expected 1 <= E <= " + std::to_string(kMoeMaxExperts) + " experts (its rows); given " +
            shape_string(router_weight));
  if (router_weight.dtype != dt && router_weight.dtype != DType::kF32)
    invalid("router_weight: expected dtype " + dname(dt) + " (x's)" + (dt == DType::kF32 ? "" : " or fp32") +
            "; given " + dname(router_weight.dtype));
  const int64_t ld_rw = row_stride(router_weight, "router_weight", E, d, "(E, d)");

  if (w13.rank != 3)
    invalid("w13: expected rank 3 (experts E, d_model, 2 d_ff: [gate | up]); given " +
            (w13.rank ? shape_string(w13) : std::string("absent")));
  ops.add(w13, "w13", false);
  if (w13.shape[0] != E || w13.shape[1] != d || w13.shape[2] < 2 || w13.shape[2] % 2 != 0)
    invalid("w13: expected shape (" + std::to_string(E) + ", " + std::to_string(d) +
            ", 2F) with F >= 1 (E = router_weight's rows, d_model = x's columns); given " + shape_string(w13));
  if (w13.dtype != dt) invalid("w13: expected dtype " + dname(dt) + " (x's); given " + dname(w13.dtype));
  const int64_t F = w13.shape[2] / 2;

  if (w2.rank != 3)
    invalid("w2: expected rank 3 (experts E, d_ff, d_model); given " + (w2.rank ? shape_string(w2) : std::string("absent")));
  ops.add(w2, "w2", false);
  if (w2.shape[0] != E || w2.shape[1] != F || w2.shape[2] != d)
    invalid("w2: expected shape (" + std::to_string(E) + ", " + std::to_string(F) + ", " + std::to_string(d) +
            ") (E, d_ff = half of w13's last dimension, d_model); given " + shape_string(w2));
  if (w2.dtype != dt) invalid("w2: expected dtype " + dname(dt) + " (x's); given " + dname(w2.dtype));

  row_stride(out, "out", T, d, "(T, d) = (" + std::to_string(T) + ", " + std::to_string(d) + ")");
  ops.add(out, "out", true);
  if (out.dtype != dt) invalid("out: expected dtype " + dname(dt) + " (x's); given " + dname(out.dtype));

  if (present(tokens_per_expert)) {
    add_exact(ops, tokens_per_expert, "tokens_per_expert", true, DType::kI32, {E}, "(E) = (" + std::to_string(E) + ")");
  }
  if (present(dropped)) {
    add_exact(ops, dropped, "dropped", true, DType::kI32, {1}, "(1)");
  }
  check_options(o, E, dt);
  ops.check_overlaps();
  const Device device = ops.device();
  if (o.variant != GroupedGemmVariant::kAuto)
    if (std::string why = variant_rejects_device(variant_row(kGroupedGemmVariants, o.variant), device); !why.empty())
      invalid(why);
  const bool x_to_fp32 = router_weight.dtype != dt;  // an fp32 router with 16-bit x
  if (x_to_fp32 && device.is_cuda())
    unsupported("router_weight: fp32 with " + dname(dt) + " x runs on the CPU only (the GEMM takes one operand dtype " +
                "and the family has no cast kernel yet); on CUDA pass router_weight in x's dtype (the logits are " +
                "fp32 either way)");
  moe_checks::cuda_prelude(device, "x");
  const LayerShape s = layer_shape(T, d, F, E, dt, o);

  // ---- the steps, on the slices of one workspace ----
  const auto run = [&](const LayerSlices& w) {
    ExecutionContext inner = ctx;  // the caller's workspace holds the slices: the inner calls get none
    inner.workspace = {};
    const int64_t k = s.k, P = s.pairs, S = s.slots;
    if (T > 0) {
      // logits (T, E) = x (T, d) @ router_weight^T (d, E): fp32 out, router_weight read column-major
      const TensorView xa = x_to_fp32 ? TensorView(w.x32, DType::kF32, device, {T, d}) : x;
      const TensorView rw_t(router_weight.data, router_weight.dtype, device, {d, E}, {1, ld_rw});
      if (x_to_fp32) widen_rows(x, ld_x, w.x32);
      matmul(xa, rw_t, TensorView(w.logits, DType::kF32, device, {T, E}), 1.0f, 0.0f, GemmVariant::kAuto, inner);
      MoeRouteOptions ro;
      ro.top_k = o.top_k, ro.scoring = o.scoring, ro.topk_softmax = o.topk_softmax, ro.normalize = o.normalize;
      ro.routed_scale = o.routed_scale;
      moe_route(TensorView(w.logits, DType::kF32, device, {T, E}), {}, TensorView(w.ids, DType::kI32, device, {T, k}),
                TensorView(w.weights, DType::kF32, device, {T, k}), {}, ro, inner);
    }
    ExecutionContext permute_ctx = inner;
    permute_ctx.workspace = w.permute;
    const TensorView counts = present(tokens_per_expert) ? tokens_per_expert
                                                         : TensorView(w.counts, DType::kI32, device, {E});
    const TensorView slot_of(w.slot_of, DType::kI32, device, {T, k});
    moe_permute(TensorView(w.ids, DType::kI32, device, {T, k}), E, s.capacity, counts,
                TensorView(w.offsets, DType::kI32, device, {E + 1}), TensorView(w.sorted_pairs, DType::kI32, device, {P}),
                slot_of, dropped, permute_ctx);
    if (T == 0) return;
    const TensorView offs(w.offsets + 1, DType::kI32, device, {E});  // cumulative ends: offsets[1:]
    const TensorView xs(w.xs, dt, device, {S, d}), a(w.a, dt, device, {S, F});
    moe_gather(x, TensorView(w.sorted_pairs, DType::kI32, device, {S}), k, xs, inner);
    grouped_mm_swiglu(xs, w13, offs, a, {}, o.variant, inner);
    const TensorView& y = xs;  // (S, d): xs is dead now
    grouped_mm(a, w2, offs, y, o.variant, inner);
    moe_combine(y, slot_of, TensorView(w.weights, DType::kF32, device, {T, k}), out, inner);
  };

  if (!device.is_cuda()) {
    std::vector<std::byte> storage(workspace_size(s, x_to_fp32, device));
    WorkspaceArena arena(Workspace{storage.data(), storage.size()});
    LayerSlices w;
    carve(arena, s, x_to_fp32, 0, &w);
    if (!arena.ok()) throw Error(Status::kInternal, "moe_forward: the host scratch is smaller than its own layout");
    run(w);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
  const size_t permute_bytes = moe_permute_workspace_bytes(s.pairs, E, device);
  CallWorkspace ws(ctx, workspace_size(s, false, device), "moe_forward", device.index, stream);
  WorkspaceArena arena(ws.get());
  LayerSlices w;
  carve(arena, s, false, permute_bytes, &w);
  if (!arena.ok()) throw Error(Status::kInternal, "moe_forward: the workspace is smaller than its own layout");
  run(w);
  ws.release("moe_forward");
#endif
}

}  // namespace optimized
