// The torch glue of RoPE (rope_forward / rope_backward, include/optimized/fused.h):
//
//   rope_fwd(q, k?, positions, theta, layout, rotary_dim, cos_sin?) -> (q_out, k_out?)   fresh outputs
//   rope_bwd(dq_out, dk_out?, positions, ...) -> (dq, dk?)                            the transpose
//   rope_fwd_(q!, k!?, positions, ...) -> ()                                          in place
//   rope_variants() -> str[]
//
// q, k: (B, S, H, D), or (T, H, D) with positions (T) (packed tokens, vLLM's layout: viewed as B = 1).
// Out of place, a q / k whose last dimension is not of unit stride is copied first (the C++ API
// takes unit stride along D); in place, it is the C++ API's to refuse. Outputs are fresh contiguous
// tensors from torch's allocator. rotary_dim 0: D. Everything else (shapes against q, dtypes,
// devices, layout, rotary_dim, theta, aliasing, the variant) the C++ API checks; its messages arrive
// prefixed "optimized::<op>: ". Autograd and fakes: python/optimized_ops/fused/rope.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/fused.h"
#include "optimized/rope.h"

namespace optimized::torch_glue {

namespace {

using OptTensor = std::optional<at::Tensor>;

struct RopeOp : GlueOp {
  // q / k as the 4-D (B, S, H, D) the C++ API takes: a 3-D (T, H, D) gains B = 1.
  at::Tensor four_d(const at::Tensor& t, const char* arg) const {
    TORCH_CHECK_VALUE(t.dim() == 3 || t.dim() == 4,
                      prefix(arg) + "expected 4 dimensions (B, S, H, D) or 3 (T, H, D); given shape " + str(t.sizes()));
    return t.dim() == 3 ? t.unsqueeze(0) : t;
  }
  RopeOptions options(double theta, c10::string_view layout, int64_t rotary_dim) const {
    RopeOptions o;
    o.layout = parse<RopeLayout>(layout, &parse_rope_layout);
    o.theta = theta;
    o.rotary_dim = rotary_dim;
    return o;
  }
  RopeVariant variant(c10::string_view v) const { return parse<RopeVariant>(v, &parse_rope_variant); }
};

// Out of place: fresh outputs, the forward or the transpose.
std::tuple<at::Tensor, OptTensor> rope_out_of_place(const char* name, bool inverse, const at::Tensor& q,
                                                     const OptTensor& k_opt, const at::Tensor& positions,
                                                     double theta, c10::string_view layout, int64_t rotary_dim,
                                                     const OptTensor& cos_sin_opt, c10::string_view variant_name) {
  const RopeOp op{name};
  const char* qn = inverse ? "dq_out" : "q";
  const char* kn = inverse ? "dk_out" : "k";
  const at::Tensor k = k_opt ? *k_opt : at::Tensor();
  const at::Tensor cos_sin = cos_sin_opt ? *cos_sin_opt : at::Tensor();
  op.tensor(q, qn);
  op.optional(k, kn);
  op.tensor(positions, "positions");
  op.optional(cos_sin, "cos_sin");
  const RopeOptions rope = op.options(theta, layout, rotary_dim);
  const RopeVariant variant = op.variant(variant_name);
  at::Tensor q4 = op.four_d(q, qn);
  at::Tensor k4 = k.defined() ? op.four_d(k, kn) : at::Tensor();
  if (q4.size(-1) > 1 && q4.stride(-1) != 1) q4 = q4.contiguous();
  if (k4.defined() && k4.size(-1) > 1 && k4.stride(-1) != 1) k4 = k4.contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = k.defined() ? at::empty(k.sizes(), k.options()) : at::Tensor();
  const at::Tensor q_out4 = q.dim() == 3 ? q_out.unsqueeze(0) : q_out;
  const at::Tensor k_out4 = k_out.defined() && k.dim() == 3 ? k_out.unsqueeze(0) : k_out;
  Launch launch(q.device());
  op.api([&] {
    const auto [qv, kv, pv, qov, kov, cv] =
        std::array{op.view(q4, qn), op.view(k4, kn), op.view(positions, "positions"),
                   op.view(q_out4, inverse ? "dq" : "q_out"), op.view(k_out4, inverse ? "dk" : "k_out"),
                   op.view(cos_sin, "cos_sin")};
    if (inverse)
      rope_backward(qv, kv, pv, rope, qov, kov, cv, variant, launch.ctx);
    else
      rope_forward(qv, kv, pv, rope, qov, kov, cv, variant, launch.ctx);
  });
  return {q_out, k_out.defined() ? OptTensor(k_out) : std::nullopt};
}

std::tuple<at::Tensor, OptTensor> rope_fwd(const at::Tensor& q, const OptTensor& k, const at::Tensor& positions,
                                           double theta, c10::string_view layout, int64_t rotary_dim,
                                           const OptTensor& cos_sin, c10::string_view variant) {
  return rope_out_of_place("rope_fwd", false, q, k, positions, theta, layout, rotary_dim, cos_sin, variant);
}

std::tuple<at::Tensor, OptTensor> rope_bwd(const at::Tensor& dq_out, const OptTensor& dk_out,
                                           const at::Tensor& positions, double theta, c10::string_view layout,
                                           int64_t rotary_dim, const OptTensor& cos_sin, c10::string_view variant) {
  return rope_out_of_place("rope_bwd", true, dq_out, dk_out, positions, theta, layout, rotary_dim, cos_sin, variant);
}

void rope_fwd_(const at::Tensor& q, const OptTensor& k_opt, const at::Tensor& positions, double theta,
               c10::string_view layout, int64_t rotary_dim, const OptTensor& cos_sin_opt,
               c10::string_view variant_name) {
  const RopeOp op{"rope_fwd_"};
  const at::Tensor k = k_opt ? *k_opt : at::Tensor();
  const at::Tensor cos_sin = cos_sin_opt ? *cos_sin_opt : at::Tensor();
  op.tensor(q, "q");
  op.optional(k, "k");
  op.tensor(positions, "positions");
  op.optional(cos_sin, "cos_sin");
  const RopeOptions rope = op.options(theta, layout, rotary_dim);
  const RopeVariant variant = op.variant(variant_name);
  const at::Tensor q4 = op.four_d(q, "q");
  const at::Tensor k4 = k.defined() ? op.four_d(k, "k") : at::Tensor();
  Launch launch(q.device());
  op.api([&] {
    const auto [qv, kv, pv, cv] = std::array{op.view(q4, "q"), op.view(k4, "k"), op.view(positions, "positions"),
                                             op.view(cos_sin, "cos_sin")};
    rope_forward(qv, kv, pv, rope, qv, kv, cv, variant, launch.ctx);
  });
}

std::vector<std::string> rope_variants() { return variant_names(all_rope_variants(), rope_variant_name); }

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // Rotary embedding of q (and k) at positions; rope_bwd is the transpose (the gradient), rope_fwd_
  // rotates q and k in place.
  m.def(
      "rope_fwd(Tensor q, Tensor? k, Tensor positions, float theta=10000., str layout='neox', int rotary_dim=0, "
      "Tensor? cos_sin=None, *, str variant='auto') -> (Tensor q_out, Tensor? k_out)",
      tags);
  m.def(
      "rope_bwd(Tensor dq_out, Tensor? dk_out, Tensor positions, float theta=10000., str layout='neox', "
      "int rotary_dim=0, Tensor? cos_sin=None, *, str variant='auto') -> (Tensor dq, Tensor? dk)",
      tags);
  m.def(
      "rope_fwd_(Tensor(a!) q, Tensor(b!)? k, Tensor positions, float theta=10000., str layout='neox', "
      "int rotary_dim=0, Tensor? cos_sin=None, *, str variant='auto') -> ()",
      tags);
  m.def("rope_variants() -> str[]", &optimized::torch_glue::rope_variants);
}

namespace {
void register_rope_kernels(torch::Library& m) {
  using namespace optimized::torch_glue;
  m.impl("rope_fwd", &rope_fwd);
  m.impl("rope_bwd", &rope_bwd);
  m.impl("rope_fwd_", &rope_fwd_);
}
}  // namespace

TORCH_LIBRARY_IMPL(optimized, CPU, m) { register_rope_kernels(m); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { register_rope_kernels(m); }
