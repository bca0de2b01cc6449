// The torch glue of the KV-cache family (include/optimized/kv_cache.h):
//
//   TORCH_LIBRARY_FRAGMENT(optimized, m)    the schemas of torch.ops.optimized.kv_cache_append (writes
//                                           new tokens into the pages, RoPE fused, q rotated in place),
//                                           paged_attention_decode (attention of q over the cached
//                                           tokens: (out, lse)), paged_attention_prefill (the same for
//                                           a chunk of any length) and kv_cache_variants (the ladder)
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) kernels that pass their operands to the C++ API as views,
//                                           allocate decode's outputs with torch and run on the current
//                                           stream of the device, under a device guard (common.h).
//
// Mutation. kv_cache_append writes k_pages and v_pages (and q, when given) in place; its schema says
// so (Tensor(a!), Tensor(b!), Tensor(c!)?) and returns nothing, so that functionalization
// (torch.compile, torch.export) turns it into auto_functionalized and keeps the writes in order. The
// mutated tensors go to the C++ API as they are -- never a copy, which would drop the writes -- so a
// cache or q whose last dimension is strided is refused by the C++ API rather than copied.
//
// Checks (common.h says who checks what). The glue checks the torch facts it needs: defined, strided
// tensors; q of decode of rank 4 (B, q_len, H_q, D), to allocate out and lse (B, H_q, q_len) fp32;
// the rope name (a string the C++ API takes as an enum). Everything else -- shapes of the pages, page
// table, positions and seq_lens, dtypes, scales, devices, the window, softcap, ALiBi, the variant,
// the page table's entries when validate is on -- is the C++ API's, whose messages arrive prefixed
// "optimized::<op>: ".
//
// No autograd: these are inference ops (python/optimized_ops/kv_cache/ says what happens to a q that
// requires grad). Fake kernels and the Python functions are registered from Python
// (python/optimized_ops/kv_cache/).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/kv_cache.h"

namespace optimized::torch_glue {

namespace {

using OptTensor = std::optional<at::Tensor>;

at::Tensor or_undefined(const OptTensor& t) { return t ? *t : at::Tensor(); }

// One op of the family: its messages ("optimized::<op>: <argument>: ...") and its C++ API calls.
struct KvOp : GlueOp {
  KvCacheVariant variant(c10::string_view v) const { return parse(v, &parse_kv_cache_variant); }
};

bool last_dim_contiguous(const at::Tensor& t) { return t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1; }

// A read-only operand: itself, or a contiguous copy when its last dimension is strided.
at::Tensor operand(const at::Tensor& t) {
  return !t.defined() || last_dim_contiguous(t) ? t : t.contiguous();
}

// A fresh output laid out as t (torch.empty_like), contiguous where t's layout would leave the last
// dimension strided (attention_ops.cpp's rule; python/optimized_ops/kv_cache/_fakes.py follows it).
at::Tensor output_like(const at::Tensor& t) {
  if (!last_dim_contiguous(t)) return at::empty(t.sizes(), t.options());
  at::Tensor out = at::empty_like(t);
  return last_dim_contiguous(out) ? out : at::empty(t.sizes(), t.options());
}

RopeLayout rope_layout(const KvOp& op, c10::string_view name) {
  const std::string_view s(name.data(), name.size());
  if (s == "none") return RopeLayout::kNone;
  if (s == "neox") return RopeLayout::kNeox;
  if (s == "interleaved") return RopeLayout::kInterleaved;
  TORCH_CHECK_VALUE(false, op.prefix("rope") + "expected one of none, neox, interleaved; given '" + std::string(s) + "'");
}

// ---- append ---------------------------------------------------------------------------------------

void kv_cache_append(const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& k_in,
                     const at::Tensor& v_in, const at::Tensor& page_table_in, const at::Tensor& positions_in,
                     const OptTensor& k_scale_opt, const OptTensor& v_scale_opt, const OptTensor& q_opt,
                     c10::string_view rope, double rope_theta, int64_t rotary_dim, bool validate,
                     c10::string_view variant_name) {
  const KvOp op{"kv_cache_append"};
  const at::Tensor k_scale = or_undefined(k_scale_opt), v_scale = or_undefined(v_scale_opt), q = or_undefined(q_opt);
  op.tensor(k_pages, "k_pages");
  op.tensor(v_pages, "v_pages");
  op.tensor(k_in, "k");
  op.tensor(v_in, "v");
  op.tensor(page_table_in, "page_table");
  op.tensor(positions_in, "positions");
  op.optional(k_scale, "k_scale");
  op.optional(v_scale, "v_scale");
  op.optional(q, "q");
  RopeOptions ro;
  ro.layout = rope_layout(op, rope);
  ro.theta = rope_theta;
  ro.rotary_dim = rotary_dim;
  const KvCacheVariant variant = op.variant(variant_name);
  const at::Tensor k = operand(k_in), v = operand(v_in), page_table = operand(page_table_in),
                   positions = operand(positions_in);
  Launch launch(k_pages.device());
  op.api([&] {
    const auto [kpv, vpv, ksv, vsv, kv, vv, ptv, posv, qv] =
        std::array{op.view(k_pages, "k_pages"), op.view(v_pages, "v_pages"), op.view(k_scale, "k_scale"),
                   op.view(v_scale, "v_scale"),  op.view(k, "k"),             op.view(v, "v"),
                   op.view(page_table, "page_table"), op.view(positions, "positions"), op.view(q, "q")};
    const PagedKVCacheView cache{kpv, vpv, ksv, vsv};
    append_kv(cache, kv, vv, ptv, posv, qv, ro, validate, variant, launch.ctx);
  });
}

// ---- decode ---------------------------------------------------------------------------------------

// decode (prefill false) and prefill (true: any S_new, run unplanned: the C++ API's split rule, its
// workspace from the library's stream-ordered pool when a split needs one).
std::tuple<at::Tensor, at::Tensor> attention_over_cache(
    bool prefill, const at::Tensor& q_in, const at::Tensor& k_pages_in, const at::Tensor& v_pages_in,
    const at::Tensor& page_table_in, const at::Tensor& seq_lens_in, const OptTensor& k_scale_opt,
    const OptTensor& v_scale_opt, std::optional<double> softmax_scale, int64_t window_left, double softcap,
    const OptTensor& alibi_opt, bool validate, c10::string_view variant_name, int64_t max_seq_len) {
  const KvOp op{prefill ? "paged_attention_prefill" : "paged_attention_decode"};
  const at::Tensor k_scale = or_undefined(k_scale_opt), v_scale = or_undefined(v_scale_opt),
                   alibi = or_undefined(alibi_opt);
  op.tensor(q_in, "q");
  op.tensor(k_pages_in, "k_pages");
  op.tensor(v_pages_in, "v_pages");
  op.tensor(page_table_in, "page_table");
  op.tensor(seq_lens_in, "seq_lens");
  op.optional(k_scale, "k_scale");
  op.optional(v_scale, "v_scale");
  op.optional(alibi, "alibi_slopes");
  TORCH_CHECK_VALUE(q_in.dim() == 4, op.prefix("q") + "expected 4 dimensions (B, " + (prefill ? "S_new" : "q_len") +
                                         ", H_q, D); given " +
                                         str(q_in.dim()) + " (shape " + str(q_in.sizes()) + ")");
  const KvCacheVariant variant = op.variant(variant_name);
  const at::Tensor q = operand(q_in), k_pages = operand(k_pages_in), v_pages = operand(v_pages_in),
                   page_table = operand(page_table_in), seq_lens = operand(seq_lens_in);
  at::Tensor out = output_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  Launch launch(q.device());
  // CUDA: the call runs as a planned step (plan_paged_decode for this shape; max_seq_len -1: the page
  // table's capacity, the unplanned call's split rule), its workspace from torch's caching allocator
  // on the current stream, so that the C++ API allocates nothing (CUDA-graph safe). A shape the plan
  // refuses runs unplanned: the C++ API's entry, the one owner of the checks, refuses it in its words.
  std::optional<DecodePlan> plan;
  if (!prefill && q.device().is_cuda() && k_pages.dim() == 4 && page_table.dim() == 2) {
    try {
      const at::ScalarType cache_type = k_pages.scalar_type();
      const DType dt = to_dtype(q.scalar_type(), op.prefix("q")), ct = to_dtype(cache_type, op.prefix("k_pages"));
      plan = plan_paged_decode(q.size(0), q.size(2), k_pages.size(2), q.size(3), q.size(1), k_pages.size(1),
                               max_seq_len >= 0 ? max_seq_len : page_table.size(1) * k_pages.size(1), dt, ct,
                               Device::cuda(q.device().index()), variant);
      launch.provide_workspace(plan->workspace_bytes);
    } catch (const Error&) {
      plan.reset();
    } catch (const c10::Error&) {
      plan.reset();
    }
  }
  op.api([&] {
    const auto [qv, kpv, vpv, ptv, slv, ksv, vsv, av, ov, lv] =
        std::array{op.view(q, "q"),          op.view(k_pages, "k_pages"), op.view(v_pages, "v_pages"),
                   op.view(page_table, "page_table"), op.view(seq_lens, "seq_lens"), op.view(k_scale, "k_scale"),
                   op.view(v_scale, "v_scale"), op.view(alibi, "alibi_slopes"), op.view(out, "out"),
                   op.view(lse, "lse")};
    DecodeOptions o;
    o.softmax_scale = softmax_scale ? *softmax_scale : std::numeric_limits<double>::quiet_NaN();
    o.window_left = window_left;
    o.softcap = softcap;
    o.alibi_slopes = av;
    o.validate = validate;
    const PagedKVCacheView cache{kpv, vpv, ksv, vsv};
    if (prefill) paged_attention_prefill(qv, cache, ptv, slv, ov, lv, o, variant, launch.ctx);
    else if (plan) paged_attention_decode(qv, cache, ptv, slv, ov, lv, o, *plan, launch.ctx);
    else paged_attention_decode(qv, cache, ptv, slv, ov, lv, o, variant, launch.ctx);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> paged_attention_decode_op(
    const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& page_table,
    const at::Tensor& seq_lens, const OptTensor& k_scale, const OptTensor& v_scale, std::optional<double> softmax_scale,
    int64_t window_left, double softcap, const OptTensor& alibi, bool validate, c10::string_view variant_name,
    int64_t max_seq_len) {
  return attention_over_cache(false, q, k_pages, v_pages, page_table, seq_lens, k_scale, v_scale, softmax_scale,
                              window_left, softcap, alibi, validate, variant_name, max_seq_len);
}

std::tuple<at::Tensor, at::Tensor> paged_attention_prefill_op(
    const at::Tensor& q, const at::Tensor& k_pages, const at::Tensor& v_pages, const at::Tensor& page_table,
    const at::Tensor& seq_lens, const OptTensor& k_scale, const OptTensor& v_scale, std::optional<double> softmax_scale,
    int64_t window_left, double softcap, const OptTensor& alibi, bool validate, c10::string_view variant_name) {
  return attention_over_cache(true, q, k_pages, v_pages, page_table, seq_lens, k_scale, v_scale, softmax_scale,
                              window_left, softcap, alibi, validate, variant_name, -1);
}

// ---- plan -------------------------------------------------------------------------------------------

// plan_paged_decode for Python's DecodePlan: (the resolved variant's name, splits, workspace_bytes).
// Host only (the device's SM count); the glue's decode replans from the same facts (deterministic).
std::tuple<std::string, int64_t, int64_t> kv_cache_plan_decode(int64_t batch, int64_t heads_q, int64_t heads_kv,
                                                               int64_t head_dim, int64_t q_len, int64_t page_size,
                                                               int64_t max_seq_len, at::ScalarType dtype,
                                                               at::ScalarType cache_dtype, c10::Device device,
                                                               c10::string_view variant_name) {
  const KvOp op{"kv_cache_plan_decode"};
  const KvCacheVariant variant = op.variant(variant_name);
  const DType dt = to_dtype(dtype, op.prefix("dtype")), ct = to_dtype(cache_dtype, op.prefix("cache_dtype"));
  const Device dev = device.is_cuda() ? Device::cuda(device.has_index() ? device.index() : 0) : Device::cpu();
  const DecodePlan plan = op.api([&] {
    return plan_paged_decode(batch, heads_q, heads_kv, head_dim, q_len, page_size, max_seq_len, dt, ct, dev, variant);
  });
  return {std::string(kv_cache_variant_name(plan.variant)), plan.splits, static_cast<int64_t>(plan.workspace_bytes)};
}

// ---- queries ----------------------------------------------------------------------------------------

std::vector<std::string> kv_cache_variants() {
  return variant_names(all_kv_cache_variants(), kv_cache_variant_name);
}

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // The cache (include/optimized/kv_cache.h): k_pages, v_pages (num_pages, page_size, H_kv, D), fp8
  // e4m3 pages with fp32 (H_kv) k_scale / v_scale; page_table int32 (B, max_pages_per_seq).
  // append: k, v (B, S_new, H_kv, D) at positions int32 (B, S_new) (< 0: padding); rope 'none', 'neox'
  // or 'interleaved' (rotary_dim 0: D), k rotated before it is stored, q (B, S_new, H_q, D) rotated in
  // place when given. validate: read the page table back and check it.
  m.def(
      "kv_cache_append(Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor k, Tensor v, Tensor page_table, "
      "Tensor positions, *, Tensor? k_scale=None, Tensor? v_scale=None, Tensor(c!)? q=None, str rope='none', "
      "float rope_theta=10000., int rotary_dim=0, bool validate=True, str variant='auto') -> ()",
      tags);
  // decode: q (B, q_len, H_q, D) (the last q_len tokens of each sequence, already appended), seq_lens
  // int32 (B); out like q, lse (B, H_q, q_len) fp32. softmax_scale None: 1/sqrt(D); window_left -1:
  // none; softcap 0: off; alibi_slopes fp32 (H_q) or (B, H_q).
  m.def(
      "paged_attention_decode(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor seq_lens, *, "
      "Tensor? k_scale=None, Tensor? v_scale=None, float? softmax_scale=None, int window_left=-1, "
      "float softcap=0., Tensor? alibi_slopes=None, bool validate=True, str variant='auto', "
      "int max_seq_len=-1) -> (Tensor out, Tensor lse)",
      tags);
  // prefill: decode's rule with any S_new (the chunk right-aligned to each sequence's end; q
  // (B, S_new, H_q, D), out like q, lse (B, H_q, S_new)).
  m.def(
      "paged_attention_prefill(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor seq_lens, *, "
      "Tensor? k_scale=None, Tensor? v_scale=None, float? softmax_scale=None, int window_left=-1, "
      "float softcap=0., Tensor? alibi_slopes=None, bool validate=True, str variant='auto') -> (Tensor out, Tensor lse)",
      tags);
  // plan (include/optimized/kv_cache.h, plan_paged_decode): the resolved variant, the split and the
  // workspace bytes of a decode step of this shape; max_seq_len tunes the split (the plan stays
  // correct for any length). decode's max_seq_len (-1: the page table's capacity) picks the same plan.
  m.def(
      "kv_cache_plan_decode(int batch, int heads_q, int heads_kv, int head_dim, int q_len, int page_size, "
      "int max_seq_len, ScalarType dtype, ScalarType cache_dtype, Device device, str variant='auto') "
      "-> (str variant, int splits, int workspace_bytes)",
      &optimized::torch_glue::kv_cache_plan_decode);
  m.def("kv_cache_variants() -> str[]", &optimized::torch_glue::kv_cache_variants);
}

namespace {
void register_kv_cache_kernels(torch::Library& m) {
  using namespace optimized::torch_glue;
  m.impl("kv_cache_append", &kv_cache_append);
  m.impl("paged_attention_decode", &paged_attention_decode_op);
  m.impl("paged_attention_prefill", &paged_attention_prefill_op);
}
}  // namespace

TORCH_LIBRARY_IMPL(optimized, CPU, m) { register_kv_cache_kernels(m); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { register_kv_cache_kernels(m); }
