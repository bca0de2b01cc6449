// Public entry of RoPE in the fused family (rope_forward / rope_backward, include/optimized/fused.h):
// validates the operands (messages name the argument, what was expected and what was given), fills
// RopeParams, resolves the variant and dispatches through kRopeVariants (rope_params.h) to the CPU
// backend (cpu/rope_cpu.cpp) or the CUDA launcher (cuda/rope.cu). Also the names of the shared
// RopeLayout (include/optimized/rope.h).
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>

#include "core/arg_checks.h"
#include "core/dtypes_built.h"
#include "fused/rope_params.h"
#include "optimized/fused.h"
#include "optimized/rope.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_launch.h"
#endif

namespace optimized {

// ---- names ---------------------------------------------------------------------------------

std::string_view rope_layout_name(RopeLayout layout) {
  switch (layout) {
    case RopeLayout::kNone: return "none";
    case RopeLayout::kNeox: return "neox";
    case RopeLayout::kInterleaved: return "interleaved";
  }
  return "?";
}

RopeLayout parse_rope_layout(std::string_view name) {
  for (RopeLayout l : {RopeLayout::kNeox, RopeLayout::kInterleaved, RopeLayout::kNone})
    if (rope_layout_name(l) == name) return l;
  arg::invalid("layout: expected one of neox, interleaved, none; given '" + std::string(name) + "'");
}

std::string_view rope_variant_name(RopeVariant variant) { return variant_name(kRopeVariants, variant); }

RopeVariant parse_rope_variant(std::string_view name) {
  return parse_variant(kRopeVariants, name, RopeVariant::kAuto);
}

std::span<const RopeVariant> all_rope_variants() {
  static constexpr auto kAll = variant_enums(kRopeVariants);
  return kAll;
}

int64_t rope_cuda_max_rotary_dim() { return kRopeCudaMaxRotaryDim; }

namespace {

using arg::invalid;
using arg::number;
using arg::present;
using arg::shape_string;

std::string dname(DType d) { return std::string(dtype_name(d)); }

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int i = 0; i < a.rank; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
  return true;
}

// Whether two views may share an element. Disjoint byte ranges: no. Two (B, S, H, D) views of one
// dtype with the same (B, S) sizes and strides -- q and k (or their outputs) sliced from one fused
// qkv tensor -- are told apart exactly: every token's elements lie at t + [0, span] of its view
// (non-negative strides), the token offsets t are multiples of g = gcd of the (B, S) strides, so the
// views meet only if some multiple of g falls in [-span_b - delta, span_a - delta], delta the offset
// of b's data from a's. Anything else that overlaps in bytes counts as overlapping.
bool may_overlap(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  const ViewExtent ea = view_extent(a, a_name), eb = view_extent(b, b_name);
  if (ea.numel == 0 || eb.numel == 0) return false;
  if (!(ea.begin < eb.end && eb.begin < ea.end)) return false;
  if (a.dtype != b.dtype || a.rank != 4 || b.rank != 4 || a.shape[0] != b.shape[0] || a.shape[1] != b.shape[1])
    return true;
  const auto elem = static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t bytes = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data) - reinterpret_cast<uintptr_t>(a.data));
  if (bytes % elem != 0) return true;
  const int64_t delta = bytes / elem;
  int64_t g = 0;
  for (int d = 0; d < 2; ++d) {
    if (a.shape[d] <= 1) continue;
    if (a.strides[d] != b.strides[d]) return true;
    g = std::gcd(g, a.strides[d]);
  }
  auto span = [](const TensorView& t) { return (t.shape[2] - 1) * t.strides[2] + (t.shape[3] - 1) * t.strides[3]; };
  const int64_t lo = -span(b) - delta, hi = span(a) - delta;
  if (g == 0) return lo <= 0 && 0 <= hi;
  const int64_t m = lo >= 0 ? (lo + g - 1) / g : -((-lo) / g);  // ceil(lo / g)
  return m * g <= hi;
}

// The names of one call's operands: forward (q, k, q_out, k_out) or backward (dq_out, dk_out, dq, dk).
struct Names {
  const char *q, *k, *q_out, *k_out;
};

// A (B, S, H, D) operand: rank, sizes against (B, S, D) of q when `ref` is given, dtype and device,
// unit stride along D, non-negative strides. Fills t's part of `rt` (x or out).
void check_heads(const TensorView& t, const char* name, const TensorView* ref, const char* ref_name) {
  if (t.rank != 4)
    invalid(std::string(name) + ": expected rank 4 (B, S, H, D); given rank " + std::to_string(t.rank) +
            (t.rank == 0 ? " (absent)" : " " + shape_string(t)));
  const ViewExtent e = view_extent(t, name);
  if (!t.data && e.numel > 0) invalid(std::string(name) + ": expected a non-null data pointer; given null");
  if (ref) {
    if (t.dtype != ref->dtype)
      invalid(std::string(name) + ": expected dtype " + dname(ref->dtype) + " (same as " + ref_name + "); given " +
              dname(t.dtype));
    if (!(t.device == ref->device))
      invalid(std::string(name) + ": expected device " + device_name(ref->device) + " (same as " + ref_name +
              "); given " + device_name(t.device));
    if (t.shape[0] != ref->shape[0] || t.shape[1] != ref->shape[1] || t.shape[3] != ref->shape[3])
      invalid(std::string(name) + ": expected shape (" + std::to_string(ref->shape[0]) + ", " +
              std::to_string(ref->shape[1]) + ", H, " + std::to_string(ref->shape[3]) + ") (B, S and D of " +
              ref_name + "); given " + shape_string(t));
  } else if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16 && t.dtype != DType::kF64) {
    throw Error(Status::kUnsupported, std::string(name) + ": expected dtype fp32, fp16, bf16 (or fp64 on the cpu "
                                                          "variant); given " + dname(t.dtype));
  }
  arg::check_element_aligned(t, name);
  if (t.shape[3] > 1 && t.strides[3] != 1)
    invalid(std::string(name) + ": expected unit stride along D (the last dimension); given " + t.describe());
  for (int d = 0; d < 3; ++d)
    if (t.shape[d] > 1 && t.strides[d] < 0)
      invalid(std::string(name) + ": expected non-negative strides; given " + t.describe());
}

void fill(RopeTensor& r, const TensorView& x, const TensorView& out) {
  r.x = x.data;
  r.out = out.data;
  r.heads = x.shape[2];
  r.x_b = x.strides[0], r.x_s = x.strides[1], r.x_h = x.strides[2];
  r.out_b = out.strides[0], r.out_s = out.strides[1], r.out_h = out.strides[2];
}

void rope_run(bool inverse, const Names& n, const TensorView& q, const TensorView& k, const TensorView& positions,
              const RopeOptions& rope, const TensorView& q_out, const TensorView& k_out, const TensorView& cos_sin,
              RopeVariant variant, const ExecutionContext& ctx) {
  const std::string what = std::string("rope ") + (inverse ? "backward" : "forward");
  RopeParams p;
  p.inverse = inverse;
  // ---- q, k and their outputs ----
  check_heads(q, n.q, nullptr, nullptr);
  check_heads(q_out, n.q_out, &q, n.q);
  if (q_out.shape[2] != q.shape[2])
    invalid(std::string(n.q_out) + ": expected shape " + shape_string(q) + " (same as " + n.q + "); given " +
            shape_string(q_out));
  arg::check_distinct_elements(q_out, n.q_out);
  fill(p.q, q, q_out);
  if (present(k)) {
    check_heads(k, n.k, &q, n.q);
    if (!present(k_out)) invalid(std::string(n.k_out) + ": required with " + n.k + "; given absent");
    check_heads(k_out, n.k_out, &k, n.k);
    if (k_out.shape[2] != k.shape[2])
      invalid(std::string(n.k_out) + ": expected shape " + shape_string(k) + " (same as " + n.k + "); given " +
              shape_string(k_out));
    arg::check_distinct_elements(k_out, n.k_out);
    fill(p.k, k, k_out);
  } else if (present(k_out)) {
    invalid(std::string(n.k_out) + ": given without " + n.k);
  }
  p.dtype = q.dtype;
  p.batch = q.shape[0];
  p.seq = q.shape[1];
  p.head_dim = q.shape[3];
  const Device device = q.device;

  // ---- positions ----
  if (positions.rank != 1 && positions.rank != 2)
    invalid("positions: expected rank 2 (B, S) or 1 (S); given rank " + std::to_string(positions.rank) +
            (positions.rank == 0 ? " (absent)" : " " + shape_string(positions)));
  const ViewExtent pe = view_extent(positions, "positions");
  if (positions.dtype != DType::kI32 && positions.dtype != DType::kI64)
    invalid("positions: expected dtype int32 or int64; given " + dname(positions.dtype));
  if (!(positions.device == device))
    invalid("positions: expected device " + device_name(device) + " (same as " + n.q + "); given " +
            device_name(positions.device));
  const bool pos_2d = positions.rank == 2;
  if ((pos_2d && (positions.shape[0] != p.batch || positions.shape[1] != p.seq)) ||
      (!pos_2d && positions.shape[0] != p.seq))
    invalid("positions: expected shape (" + std::to_string(p.batch) + ", " + std::to_string(p.seq) + ") or (" +
            std::to_string(p.seq) + ") (B, S of " + n.q + "); given " + shape_string(positions));
  if (!positions.data && pe.numel > 0) invalid("positions: expected a non-null data pointer; given null");
  arg::check_element_aligned(positions, "positions");
  p.positions = positions.data;
  p.positions_i64 = positions.dtype == DType::kI64;
  p.pos_b = pos_2d ? positions.strides[0] : 0;
  p.pos_s = positions.strides[positions.rank - 1];

  // ---- options ----
  if (rope.layout != RopeLayout::kNeox && rope.layout != RopeLayout::kInterleaved)
    invalid("rope.layout: expected kNeox or kInterleaved; given " + std::string(rope_layout_name(rope.layout)));
  p.neox = rope.layout == RopeLayout::kNeox;
  const int64_t D = p.head_dim;
  const int64_t rd = rope.rotary_dim == 0 ? D : rope.rotary_dim;
  if (rd < 2 || rd > D || rd % 2 != 0)
    invalid("rope.rotary_dim: expected 0 (D) or an even value from 2 to D = " + std::to_string(D) + "; given " +
            std::to_string(rope.rotary_dim) + (rope.rotary_dim == 0 ? " (D is odd or < 2)" : ""));
  p.rotary_dim = rd;
  if (!std::isfinite(rope.theta) || !(rope.theta > 0))
    invalid("rope.theta: expected a finite value > 0; given " + number(rope.theta));
  p.theta = rope.theta;

  // ---- cos_sin ----
  if (present(cos_sin)) {
    const DType want = p.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    const ViewExtent ce = view_extent(cos_sin, "cos_sin");
    if (cos_sin.rank != 2 || cos_sin.shape[1] != rd || cos_sin.shape[0] < 1)
      invalid("cos_sin: expected shape (max_pos, " + std::to_string(rd) + ") = [cos | sin] of rotary_dim " +
              std::to_string(rd) + ", max_pos >= 1; given " + shape_string(cos_sin));
    if (cos_sin.dtype != want)
      invalid("cos_sin: expected dtype " + dname(want) + " (for " + dname(p.dtype) + " operands); given " +
              dname(cos_sin.dtype));
    if (!(cos_sin.device == device))
      invalid("cos_sin: expected device " + device_name(device) + " (same as " + n.q + "); given " +
              device_name(cos_sin.device));
    if (!cos_sin.data && ce.numel > 0) invalid("cos_sin: expected a non-null data pointer; given null");
    arg::check_element_aligned(cos_sin, "cos_sin");
    if (cos_sin.strides[1] != 1 || (cos_sin.shape[0] > 1 && cos_sin.strides[0] < rd))
      invalid("cos_sin: expected unit stride along rotary_dim and rows at least rotary_dim apart; given " +
              cos_sin.describe());
    p.cos_sin = cos_sin.data;
    p.cos_sin_rows = cos_sin.shape[0];
    p.ld_cos_sin = cos_sin.shape[0] > 1 ? cos_sin.strides[0] : rd;
  }

  // ---- aliasing: outputs against every other operand ----
  struct Operand {
    const TensorView* t;
    const char* name;
  };
  const Operand inputs[] = {{&q, n.q}, {&k, n.k}, {&positions, "positions"}, {&cos_sin, "cos_sin"}};
  const Operand outputs[] = {{&q_out, n.q_out}, {&k_out, n.k_out}};
  for (const auto& [out, out_name] : outputs) {
    if (!present(*out)) continue;
    for (const auto& [in, in_name] : inputs) {
      if (!present(*in) || same_view(*out, *in)) continue;  // the very same view: in place
      if (may_overlap(*out, out_name, *in, in_name))
        invalid(std::string(out_name) + ": expected an output that does not overlap " + in_name +
                " (in place is allowed only as the very same view)" + "; given overlapping memory");
    }
  }
  if (present(k_out) && may_overlap(q_out, n.q_out, k_out, n.k_out))
    invalid(std::string(n.k_out) + ": expected an output that does not overlap " + n.q_out + "; given overlapping memory");

  // ---- variant ----
  if (variant == RopeVariant::kAuto) variant = device.is_cuda() ? RopeVariant::kCuda : RopeVariant::kCpu;
  const RopeVariantInfo& row = variant_row(kRopeVariants, variant);
  const bool on_cuda = row.backend == Backend::kCuda;
  if (on_cuda != device.is_cuda())
    invalid("variant " + std::string(row.name) + " runs on " + (device.is_cuda() ? "the CPU" : "CUDA devices") +
            "; given operands on " + device_name(device));
  if (!row.dtypes.has(p.dtype))
    throw Error(Status::kUnsupported, what + ": " + n.q + ": " + dname(p.dtype) + " runs on the " +
                                          variants_running(kRopeVariants, p.dtype) + " variant only; given " +
                                          dname(p.dtype) + " on " + device_name(device));
  if (on_cuda) {
    if (rd > kRopeCudaMaxRotaryDim)
      throw Error(Status::kUnsupported, what + ": rope.rotary_dim: the cuda variant takes up to " +
                                            std::to_string(kRopeCudaMaxRotaryDim) + "; given " + std::to_string(rd));
    if (std::string why = cuda_dtype_not_built("fused", p.dtype); !why.empty())
      throw Error(Status::kUnsupported, what + ": " + why);
    if (cuda_device_count() == 0)
      throw Error(Status::kUnsupported, what + ": operands on " + device_name(device) +
                                            " but no CUDA device can be used: " + cuda_unavailable_reason());
  }
  if (p.tokens() == 0 || p.q.heads + p.k.heads == 0) return;
  if (!on_cuda) {
    row.cpu(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  launch_on_cuda(row, p, device.index, ctx, what + " (" + std::string(row.name) + ")");
#else
  throw Error(Status::kUnsupported, what + ": this build has no CUDA backend (built without CUDA)");
#endif
}

}  // namespace

void rope_forward(const TensorView& q, const TensorView& k, const TensorView& positions, const RopeOptions& rope,
                  const TensorView& q_out, const TensorView& k_out, const TensorView& cos_sin, RopeVariant variant,
                  const ExecutionContext& ctx) {
  rope_run(false, {"q", "k", "q_out", "k_out"}, q, k, positions, rope, q_out, k_out, cos_sin, variant, ctx);
}

void rope_backward(const TensorView& dq_out, const TensorView& dk_out, const TensorView& positions,
                   const RopeOptions& rope, const TensorView& dq, const TensorView& dk, const TensorView& cos_sin,
                   RopeVariant variant, const ExecutionContext& ctx) {
  rope_run(true, {"dq_out", "dk_out", "dq", "dk"}, dq_out, dk_out, positions, rope, dq, dk, cos_sin, variant, ctx);
}

}  // namespace optimized
