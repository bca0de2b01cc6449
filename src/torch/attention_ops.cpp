// The torch glue of the attention family (include/optimized/attention.h):
//
//   TORCH_LIBRARY_FRAGMENT(optimized, m)    the schemas of torch.ops.optimized.attention_fwd / _bwd,
//                                           attention_varlen_fwd / _bwd, flash_attention (the name
//                                           users were promised: a composite that calls
//                                           attention_fwd and returns out) and the ladder's queries
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) kernels that pass their operands to the C++ API as views,
//                                           allocate the outputs with torch (the caching allocator,
//                                           so CUDA graphs capture them) and run on the current
//                                           stream of the device, under a device guard (common.h).
//
// Checks (common.h says who checks what). The glue checks the torch facts it needs to allocate the
// outputs: defined, strided tensors; q of rank 4 (fixed length: (B, S_q, H_q, D), lse is
// (B, H_q, S_q)) or 3 (varlen: (total_q, H_q, D), lse is (H_q, total_q)). Everything else -- k and v
// against q, heads, head dims, dtypes, devices, the mask, the ALiBi slopes, cu_seqlens, the window,
// softcap, the variant -- is the C++ API's, whose messages arrive prefixed "optimized::<op>: ".
//
// Layout. q, k, v (and dout, out in the backward) go to the C++ API as the views they are: any
// strides, last dimension contiguous, so (B, S, H, D) tensors and (B, H, S, D) tensors viewed as
// (B, S, H, D) run without a copy. Only an operand whose last dimension does not have unit stride
// (a transposed head dimension, a gradient expanded from a sum) is copied to a contiguous tensor
// first. Outputs (out, dq, dk, dv) are laid out as their operand (torch.empty_like: the same
// strides for a dense operand, a dense layout in the operand's dimension order otherwise), so that
// a (B, H, S, D) caller gets (B, H, S, D) results; contiguous where that would leave the last
// dimension strided. lse is a fresh contiguous fp32 tensor (fp64 for fp64 inputs). The explicit mask
// and the ALiBi slopes are passed as they are (a mask broadcast with stride 0 is read in place).
//
// CUDA graphs: nothing here synchronizes with the host; the workspace comes from the caching
// allocator. The varlen ops ask the C++ API to check cu_seqlens (check_cu_seqlens), which reads them
// back to the host outside a capture and skips the check inside one.
//
// Autograd, fake kernels and the Python functions are registered from Python
// (python/optimized_ops/attention/).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "optimized/attention.h"
#include "optimized/core.h"

namespace optimized::torch_glue {

namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor or_undefined(const OptTensor& t) { return t ? *t : at::Tensor(); }

// One op of the family: its messages ("optimized::<op>: <argument>: ...") and its C++ API calls.
struct Op : GlueOp {
  // The rank the glue needs to allocate the outputs (the C++ API checks the sizes).
  void rank(const at::Tensor& t, const char* arg, int64_t rank, const char* layout) const {
    TORCH_CHECK_VALUE(t.dim() == rank, prefix(arg) + "expected " + str(rank) + " dimensions " + layout + "; given " +
                                           str(t.dim()) + " (shape " + str(t.sizes()) + ")");
  }

  AttentionVariant variant(c10::string_view v) const { return parse(v, &parse_attention_variant); }

  // The op's scratch from torch's caching allocator (CUDA): what attention_workspace_bytes says for
  // this call, handed over as the context's workspace, so that the C++ API allocates nothing itself
  // (naive's S and P, flash2's dq accumulator). A call the query refuses gets none: the C++ API's
  // entry, the one owner of the checks, then refuses it with its own wording.
  void workspace(Launch& launch, const AttentionShape& shape, const TensorView& q, bool backward,
                 const AttentionOptions& options, AttentionVariant v) const {
    if (!q.device.is_cuda()) return;
    size_t bytes = 0;
    try {
      bytes = attention_workspace_bytes(shape, q.dtype, q.device, backward, options, v);
    } catch (const Error&) {
      return;
    }
    launch.provide_workspace(bytes);
  }
};

// Whether the C++ API can take t as a view: its last dimension has unit stride (or one element).
bool last_dim_contiguous(const at::Tensor& t) { return t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1; }

// t as an operand: itself, or a contiguous copy when its last dimension is strided.
at::Tensor operand(const at::Tensor& t) { return last_dim_contiguous(t) ? t : t.contiguous(); }

// The incoming gradient: its layout is whatever the graph downstream made (a slice, a cat), which
// the caller does not choose. flash2 reads rows with 16-byte copies, so a dout whose rows do not
// start on 16-byte boundaries is copied (contiguous) rather than refused or sent to a slower rung.
at::Tensor gradient_operand(const at::Tensor& t) {
  bool aligned = last_dim_contiguous(t) && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t i = 0; aligned && i + 1 < t.dim(); ++i)
    if (t.size(i) > 1 && (t.stride(i) * t.element_size()) % 16 != 0) aligned = false;
  return aligned ? t : t.contiguous();
}

// A fresh output laid out as t (torch.empty_like), contiguous where t's layout would leave the last
// dimension strided. python/optimized_ops/attention/_fakes.py follows the same rule.
at::Tensor output_like(const at::Tensor& t) {
  if (!last_dim_contiguous(t)) return at::empty(t.sizes(), t.options());
  at::Tensor out = at::empty_like(t);
  return last_dim_contiguous(out) ? out : at::empty(t.sizes(), t.options());
}

// lse's dtype: fp64 for fp64 inputs, fp32 otherwise (the C++ API refuses any other pairing).
at::TensorOptions lse_options(const at::Tensor& q) {
  return q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

// The score options of a call (include/optimized/attention.h, AttentionOptions), with the views of
// the ALiBi slopes and the mask (absent: rank 0). The C++ API checks every value.
AttentionOptions make_options(std::optional<double> softmax_scale, bool causal, bool top_left, int64_t window_left,
                              int64_t window_right, double softcap, const TensorView& alibi, const TensorView& mask,
                              bool deterministic) {
  AttentionOptions o;
  o.softmax_scale = softmax_scale ? *softmax_scale : std::numeric_limits<double>::quiet_NaN();
  o.causal = causal;
  o.alignment = top_left ? CausalAlignment::kTopLeft : CausalAlignment::kBottomRight;
  o.window_left = window_left;
  o.window_right = window_right;
  o.softcap = softcap;
  o.alibi_slopes = alibi;
  o.mask = mask;
  o.deterministic = deterministic;
  o.check_cu_seqlens = true;  // the C++ API skips the read-back while a CUDA graph is being captured
  return o;
}

// The sizes of a fixed-length call, for the workspace query (q's views: (B, S_q, H_q, D), k's
// (B, S_k, H_kv, D)).
AttentionShape fixed_shape(const TensorView& q, const TensorView& k) {
  AttentionShape s;
  s.batch = q.shape[0];
  s.seqlen_q = q.shape[1];
  s.heads_q = q.shape[2];
  s.head_dim = q.shape[3];
  if (k.rank == 4) {
    s.seqlen_k = k.shape[1];
    s.heads_kv = k.shape[2];
  }
  return s;
}

// The sizes of a varlen call: batch = the number of sequences, seqlen_* = the max_seqlen_* given.
AttentionShape varlen_shape(const TensorView& q, const TensorView& k, const TensorView& cu_q, int64_t max_q,
                            int64_t max_k) {
  AttentionShape s;
  s.batch = cu_q.rank >= 1 && cu_q.shape[0] > 0 ? cu_q.shape[0] - 1 : 0;
  s.seqlen_q = max_q;
  s.seqlen_k = max_k;
  s.heads_q = q.shape[1];
  s.head_dim = q.shape[2];
  s.total_q = q.shape[0];
  if (k.rank == 3) s.heads_kv = k.shape[1];
  return s;
}

// ---- fixed length -----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, std::optional<double> softmax_scale,
                                                 bool causal, bool top_left, int64_t window_left, int64_t window_right,
                                                 double softcap, const OptTensor& alibi_opt, const OptTensor& mask_opt,
                                                 bool deterministic, c10::string_view variant_name) {
  const Op op{"attention_fwd"};
  const at::Tensor alibi = or_undefined(alibi_opt), mask = or_undefined(mask_opt);
  op.tensor(q_in, "q");
  op.tensor(k_in, "k");
  op.tensor(v_in, "v");
  op.optional(alibi, "alibi_slopes");
  op.optional(mask, "attn_mask");
  op.rank(q_in, "q", 4, "(B, S_q, H_q, D)");
  const AttentionVariant variant = op.variant(variant_name);
  const at::Tensor q = operand(q_in), k = operand(k_in), v = operand(v_in);
  at::Tensor out = output_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, lse_options(q));
  Launch launch(q.device());
  op.api([&] {
    const auto [qv, kv, vv, ov, lv, av, mv] =
        std::array{op.view(q, "q"), op.view(k, "k"), op.view(v, "v"), op.view(out, "out"), op.view(lse, "lse"),
                   op.view(alibi, "alibi_slopes"), op.view(mask, "attn_mask")};
    const AttentionOptions o =
        make_options(softmax_scale, causal, top_left, window_left, window_right, softcap, av, mv, deterministic);
    op.workspace(launch, fixed_shape(qv, kv), qv, false, o, variant);
    attention_forward(qv, kv, vv, ov, lv, o, variant, launch.ctx);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, std::optional<double> softmax_scale, bool causal, bool top_left,
    int64_t window_left, int64_t window_right, double softcap, const OptTensor& alibi_opt, const OptTensor& mask_opt,
    bool deterministic, c10::string_view variant_name) {
  const Op op{"attention_bwd"};
  const at::Tensor alibi = or_undefined(alibi_opt), mask = or_undefined(mask_opt);
  op.tensor(dout_in, "dout");
  op.tensor(q_in, "q");
  op.tensor(k_in, "k");
  op.tensor(v_in, "v");
  op.tensor(out_in, "out");
  op.tensor(lse, "lse");
  op.optional(alibi, "alibi_slopes");
  op.optional(mask, "attn_mask");
  const AttentionVariant variant = op.variant(variant_name);
  const at::Tensor dout = gradient_operand(dout_in), q = operand(q_in), k = operand(k_in), v = operand(v_in);
  const at::Tensor out = operand(out_in);
  at::Tensor dq = output_like(q), dk = output_like(k), dv = output_like(v);
  Launch launch(q.device());
  op.api([&] {
    const auto [dov, qv, kv, vv, ov, lv, av, mv, dqv, dkv, dvv] =
        std::array{op.view(dout, "dout"),         op.view(q, "q"),          op.view(k, "k"),
                   op.view(v, "v"),               op.view(out, "out"),      op.view(lse, "lse"),
                   op.view(alibi, "alibi_slopes"), op.view(mask, "attn_mask"), op.view(dq, "dq"),
                   op.view(dk, "dk"),             op.view(dv, "dv")};
    const AttentionOptions o =
        make_options(softmax_scale, causal, top_left, window_left, window_right, softcap, av, mv, deterministic);
    if (qv.rank == 4) op.workspace(launch, fixed_shape(qv, kv), qv, true, o, variant);
    attention_backward(dov, qv, kv, vv, ov, lv, dqv, dkv, dvv, o, variant, launch.ctx);
  });
  return {dq, dk, dv};
}

// ---- variable length (packed) ---------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale,
    bool causal, bool top_left, int64_t window_left, int64_t window_right, double softcap, const OptTensor& alibi_opt,
    bool deterministic, c10::string_view variant_name) {
  const Op op{"attention_varlen_fwd"};
  const at::Tensor alibi = or_undefined(alibi_opt);
  op.tensor(q_in, "q");
  op.tensor(k_in, "k");
  op.tensor(v_in, "v");
  op.tensor(cu_seqlens_q, "cu_seqlens_q");
  op.tensor(cu_seqlens_k, "cu_seqlens_k");
  op.optional(alibi, "alibi_slopes");
  op.rank(q_in, "q", 3, "(total_q, H_q, D)");
  const AttentionVariant variant = op.variant(variant_name);
  const at::Tensor q = operand(q_in), k = operand(k_in), v = operand(v_in);
  at::Tensor out = output_like(q);
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, lse_options(q));
  Launch launch(q.device());
  op.api([&] {
    const auto [qv, kv, vv, cqv, ckv, ov, lv, av] =
        std::array{op.view(q, "q"),     op.view(k, "k"),     op.view(v, "v"),     op.view(cu_seqlens_q, "cu_seqlens_q"),
                   op.view(cu_seqlens_k, "cu_seqlens_k"),   op.view(out, "out"), op.view(lse, "lse"),
                   op.view(alibi, "alibi_slopes")};
    const AttentionOptions o = make_options(softmax_scale, causal, top_left, window_left, window_right, softcap, av,
                                            TensorView{}, deterministic);
    op.workspace(launch, varlen_shape(qv, kv, cqv, max_seqlen_q, max_seqlen_k), qv, false, o, variant);
    attention_varlen_forward(qv, kv, vv, cqv, ckv, max_seqlen_q, max_seqlen_k, ov, lv, o, variant, launch.ctx);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    const at::Tensor& out_in, const at::Tensor& lse, std::optional<double> softmax_scale, bool causal, bool top_left,
    int64_t window_left, int64_t window_right, double softcap, const OptTensor& alibi_opt, bool deterministic,
    c10::string_view variant_name) {
  const Op op{"attention_varlen_bwd"};
  const at::Tensor alibi = or_undefined(alibi_opt);
  op.tensor(dout_in, "dout");
  op.tensor(q_in, "q");
  op.tensor(k_in, "k");
  op.tensor(v_in, "v");
  op.tensor(cu_seqlens_q, "cu_seqlens_q");
  op.tensor(cu_seqlens_k, "cu_seqlens_k");
  op.tensor(out_in, "out");
  op.tensor(lse, "lse");
  op.optional(alibi, "alibi_slopes");
  const AttentionVariant variant = op.variant(variant_name);
  const at::Tensor dout = gradient_operand(dout_in), q = operand(q_in), k = operand(k_in), v = operand(v_in);
  const at::Tensor out = operand(out_in);
  at::Tensor dq = output_like(q), dk = output_like(k), dv = output_like(v);
  Launch launch(q.device());
  op.api([&] {
    const auto [dov, qv, kv, vv, cqv, ckv, ov, lv, av, dqv, dkv, dvv] = std::array{
        op.view(dout, "dout"), op.view(q, "q"),     op.view(k, "k"),     op.view(v, "v"),
        op.view(cu_seqlens_q, "cu_seqlens_q"),      op.view(cu_seqlens_k, "cu_seqlens_k"),
        op.view(out, "out"),   op.view(lse, "lse"), op.view(alibi, "alibi_slopes"),
        op.view(dq, "dq"),     op.view(dk, "dk"),   op.view(dv, "dv")};
    const AttentionOptions o = make_options(softmax_scale, causal, top_left, window_left, window_right, softcap, av,
                                            TensorView{}, deterministic);
    if (qv.rank == 3) op.workspace(launch, varlen_shape(qv, kv, cqv, max_seqlen_q, max_seqlen_k), qv, true, o, variant);
    attention_varlen_backward(dov, qv, kv, vv, cqv, ckv, max_seqlen_q, max_seqlen_k, ov, lv, dqv, dkv, dvv, o,
                              variant, launch.ctx);
  });
  return {dq, dk, dv};
}

// ---- flash_attention: the promised name -------------------------------------------------------

// A composite (CompositeImplicitAutograd) over attention_fwd through the dispatcher: its output is
// attention_fwd's, so autograd (registered on attention_fwd by the Python package), fake kernels and
// torch.compile come through it; with the library alone (torch.ops.load_library) the forward runs.
at::Tensor flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
                           double softcap, const OptTensor& alibi_slopes, bool deterministic,
                           c10::string_view variant) {
  static const auto fwd = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("optimized::attention_fwd", "")
                              .typed<decltype(attention_fwd)>();
  return std::get<0>(fwd.call(q, k, v, softmax_scale, causal, /*top_left=*/false, window_left, window_right, softcap,
                              alibi_slopes, std::nullopt, deterministic, variant));
}

// ---- queries (no tensors: registered as catch-all kernels) ------------------------------------

// The ladder (naive to best, "auto" excluded), from the C++ API's table.
std::vector<std::string> attention_variants() {
  return variant_names(all_attention_variants(), attention_variant_name);
}

std::vector<int64_t> attention_head_dims_op() {
  const auto dims = attention_head_dims();
  return std::vector<int64_t>(dims.begin(), dims.end());
}

std::string resolve_attention_variant_op(at::ScalarType dtype, c10::string_view device, int64_t head_dim) {
  const Op op{"resolve_attention_variant"};
  const DType dt = to_dtype(dtype, op.prefix("dtype"));
  const at::Device d(std::string(device.data(), device.size()));  // torch's own error for malformed names
  const Device where = to_device(d, op.prefix("device"));
  return op.api([&] { return std::string(attention_variant_name(resolve_attention_variant(dt, head_dim, where))); });
}

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // The score options every op takes (include/optimized/attention.h): softmax_scale None is
  // 1/sqrt(D); causal; top_left: torch SDPA's alignment instead of flash-attn's bottom-right;
  // window (left, right), -1 unbounded; softcap 0 off; alibi_slopes fp32 (H_q) or (B, H_q);
  // attn_mask (fixed length only) bool or additive, 4-D broadcastable to (B, H_q, S_q, S_k).
  // deterministic is the backward's (the forward op takes it so that autograd hands it over).
  // q (B, S_q, H_q, D), k, v (B, S_k, H_kv, D); out like q; lse (B, H_q, S_q) fp32 (fp64 for fp64).
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, *, float? softmax_scale=None, bool causal=False, "
      "bool top_left=False, int window_left=-1, int window_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? attn_mask=None, bool deterministic=False, str variant='auto') -> (Tensor out, Tensor lse)",
      tags);
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, *, "
      "float? softmax_scale=None, bool causal=False, bool top_left=False, int window_left=-1, int window_right=-1, "
      "float softcap=0., Tensor? alibi_slopes=None, Tensor? attn_mask=None, bool deterministic=False, "
      "str variant='auto') -> (Tensor dq, Tensor dk, Tensor dv)",
      tags);
  // Packed sequences: q (total_q, H_q, D), k, v (total_k, H_kv, D), cu_seqlens int32 (B + 1);
  // lse (H_q, total_q).
  m.def(
      "attention_varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, *, float? softmax_scale=None, bool causal=False, bool top_left=False, "
      "int window_left=-1, int window_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
      "bool deterministic=False, str variant='auto') -> (Tensor out, Tensor lse)",
      tags);
  m.def(
      "attention_varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, Tensor out, Tensor lse, *, float? softmax_scale=None, "
      "bool causal=False, bool top_left=False, int window_left=-1, int window_right=-1, float softcap=0., "
      "Tensor? alibi_slopes=None, bool deterministic=False, str variant='auto') "
      "-> (Tensor dq, Tensor dk, Tensor dv)",
      tags);
  // torch.ops.optimized.flash_attention(q, k, v): out of attention_fwd (flash-attn's conventions).
  m.def(
      "flash_attention(Tensor q, Tensor k, Tensor v, *, float? softmax_scale=None, bool causal=False, "
      "int window_left=-1, int window_right=-1, float softcap=0., Tensor? alibi_slopes=None, "
      "bool deterministic=False, str variant='auto') -> Tensor",
      &optimized::torch_glue::flash_attention, tags);
  // Queries about the ladder (no tensors).
  m.def("attention_variants() -> str[]", &optimized::torch_glue::attention_variants);
  m.def("attention_head_dims() -> int[]", &optimized::torch_glue::attention_head_dims_op);
  m.def("resolve_attention_variant(ScalarType dtype, str device, int head_dim) -> str",
        &optimized::torch_glue::resolve_attention_variant_op);
}

namespace {
void register_attention_kernels(torch::Library& m) {
  using namespace optimized::torch_glue;
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
  m.impl("attention_varlen_fwd", &attention_varlen_fwd);
  m.impl("attention_varlen_bwd", &attention_varlen_bwd);
}
}  // namespace

TORCH_LIBRARY_IMPL(optimized, CPU, m) { register_attention_kernels(m); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { register_attention_kernels(m); }
