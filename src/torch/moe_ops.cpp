// The torch glue of the MoE family (include/optimized/moe.h), in progress with the family:
//
//   TORCH_LIBRARY_FRAGMENT(optimized, m)    the schemas of torch.ops.optimized.moe_route ((topk_ids,
//                                           topk_weights, lse) from router logits) and its backward
//                                           (the gradient to the logits), moe_permute (the
//                                           stable counting sort of the pairs by expert), moe_combine
//                                           and its backward (the weighted sum of each token's expert
//                                           outputs), grouped_mm
//                                           (torch._grouped_mm's 2-D x 3-D case), grouped_mm_weight_grad
//                                           (its weight gradient) and grouped_gemm_variants (the ladder)
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) kernels that pass their operands to the C++ API as views,
//                                           allocate the outputs with torch and run on the current stream
//                                           of the device, under a device guard (common.h)
//
// Checks (common.h says who checks what): the glue checks the torch facts it needs (defined, strided
// tensors; the ranks its outputs' shapes come from); everything else is the C++ API's, whose
// messages arrive prefixed "optimized::<op>: ". Nothing here reads a device value back: offsets
// and ids stay on the device. Autograd of moe_route, moe_combine and grouped_mm and the fake kernels
// are registered from Python (python/optimized_ops/moe/).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/moe.h"

namespace optimized::torch_glue {

namespace {

struct MoeOp : GlueOp {
  void rank(const at::Tensor& t, const char* arg, int64_t want, const char* shape) const {
    TORCH_CHECK_VALUE(t.dim() == want, prefix(arg) + "expected a " + str(want) + "-D tensor " + shape +
                                           "; given shape " + str(t.sizes()));
  }
};

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route_op(const at::Tensor& logits, const std::optional<at::Tensor>& bias_opt,
                                                            int64_t top_k, c10::string_view scoring, bool topk_softmax,
                                                            bool normalize, int64_t n_groups, int64_t topk_groups,
                                                            double routed_scale) {
  const MoeOp op{"moe_route"};
  const at::Tensor bias = or_undefined(bias_opt);
  op.tensor(logits, "logits");
  op.optional(bias, "bias");
  op.rank(logits, "logits", 2, "(tokens T, experts E)");
  MoeRouteOptions o;
  o.top_k = static_cast<int>(top_k);
  o.scoring = op.parse(scoring, &parse_moe_scoring);
  o.topk_softmax = topk_softmax, o.normalize = normalize;
  o.n_groups = static_cast<int>(n_groups), o.topk_groups = static_cast<int>(topk_groups);
  o.routed_scale = static_cast<float>(routed_scale);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= kMoeMaxTopK, op.prefix("top_k") + "expected 1 <= k <= " +
                                                            str(kMoeMaxTopK) + "; given " + str(top_k));
  const int64_t T = logits.size(0);
  const auto opts = logits.options();
  at::Tensor ids = at::empty({T, top_k}, opts.dtype(at::kInt));
  at::Tensor weights = at::empty({T, top_k}, opts.dtype(at::kFloat));
  at::Tensor lse = at::empty({T}, opts.dtype(at::kFloat));
  Launch launch(logits.device());
  op.api([&] {
    const auto [lv, bv, iv, wv, sv] = std::array{op.view(logits, "logits"), op.view(bias, "bias"), op.view(ids, "topk_ids"),
                                                 op.view(weights, "topk_weights"), op.view(lse, "lse")};
    moe_route(lv, bv, iv, wv, sv, o, launch.ctx);
  });
  return {ids, weights, lse};
}

// The gradient of (topk_weights, lse) to the logits, in the logits' dtype; absent gradients are zero.
at::Tensor moe_route_backward_op(const at::Tensor& logits, const at::Tensor& topk_ids,
                                 const std::optional<at::Tensor>& grad_weights_opt,
                                 const std::optional<at::Tensor>& grad_lse_opt, c10::string_view scoring,
                                 bool topk_softmax, bool normalize, double routed_scale) {
  const MoeOp op{"moe_route_backward"};
  op.tensor(logits, "logits");
  op.tensor(topk_ids, "topk_ids");
  op.optional(or_undefined(grad_weights_opt), "grad_weights");
  op.optional(or_undefined(grad_lse_opt), "grad_lse");
  op.rank(logits, "logits", 2, "(tokens T, experts E)");
  op.rank(topk_ids, "topk_ids", 2, "(tokens T, k)");
  // top_k comes from topk_ids here: a k out of range is topk_ids' fault, not an option's
  const int64_t k = topk_ids.size(1), kmax = std::min<int64_t>(logits.size(1), kMoeMaxTopK);
  TORCH_CHECK_VALUE(kmax < 1 || (k >= 1 && k <= kmax),
                    op.prefix("topk_ids") + "expected 1 <= k <= min(E, " + str(kMoeMaxTopK) + ") = " + str(kmax) +
                        " columns; given shape " + str(topk_ids.sizes()));
  MoeRouteOptions o;
  o.top_k = static_cast<int>(k);
  o.scoring = op.parse(scoring, &parse_moe_scoring);
  o.topk_softmax = topk_softmax, o.normalize = normalize;
  o.routed_scale = static_cast<float>(routed_scale);
  // autograd's incoming gradients may be any strides (a sum's backward expands): the C++ API takes
  // contiguous ones
  const at::Tensor gw = grad_weights_opt ? grad_weights_opt->contiguous() : at::Tensor();
  const at::Tensor gl = grad_lse_opt ? grad_lse_opt->contiguous() : at::Tensor();
  at::Tensor grad = at::empty(logits.sizes(), logits.options());
  Launch launch(logits.device());
  op.api([&] {
    const auto [lv, iv, wv, sv, gv] = std::array{op.view(logits, "logits"), op.view(topk_ids, "topk_ids"),
                                                 op.view(gw, "grad_weights"), op.view(gl, "grad_lse"),
                                                 op.view(grad, "grad_logits")};
    moe_route_backward(lv, iv, wv, sv, gv, o, launch.ctx);
  });
  return grad;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute_op(const at::Tensor& topk_ids,
                                                                                     int64_t num_experts,
                                                                                     int64_t capacity) {
  const MoeOp op{"moe_permute"};
  op.tensor(topk_ids, "topk_ids");
  op.rank(topk_ids, "topk_ids", 2, "(tokens T, k)");
  TORCH_CHECK_VALUE(num_experts >= 1 && num_experts <= kMoeMaxExperts,
                    op.prefix("num_experts") + "expected 1 <= E <= " + str(kMoeMaxExperts) + "; given " + str(num_experts));
  const at::Tensor ids = topk_ids.contiguous();
  const auto opts = ids.options().dtype(at::kInt);
  at::Tensor counts = at::empty({num_experts}, opts), offsets = at::empty({num_experts + 1}, opts);
  at::Tensor sorted = at::empty({ids.numel()}, opts), slot_of = at::empty(ids.sizes(), opts), dropped = at::empty({1}, opts);
  Launch launch(ids.device());
  launch.provide_workspace(op.api([&] { return moe_permute_workspace_bytes(ids.numel(), num_experts, op.view(ids, "topk_ids").device); }));
  op.api([&] {
    const auto [iv, cv, ov, sv, lv, dv] =
        std::array{op.view(ids, "topk_ids"), op.view(counts, "counts"), op.view(offsets, "offsets"),
                   op.view(sorted, "sorted_pairs"), op.view(slot_of, "slot_of"), op.view(dropped, "dropped")};
    moe_permute(iv, num_experts, capacity, cv, ov, sv, lv, dv, launch.ctx);
  });
  return {counts, offsets, sorted, slot_of, dropped};
}

at::Tensor moe_combine_op(const at::Tensor& y, const at::Tensor& slot_of, const at::Tensor& sorted_pairs,
                          const at::Tensor& weights) {
  const MoeOp op{"moe_combine"};
  op.tensor(y, "y");
  op.tensor(slot_of, "slot_of");
  op.tensor(sorted_pairs, "sorted_pairs");
  op.tensor(weights, "weights");
  op.rank(y, "y", 2, "(slots S, N)");
  op.rank(slot_of, "slot_of", 2, "(tokens T, k)");
  at::Tensor out = at::empty({slot_of.size(0), y.size(1)}, y.options());
  Launch launch(y.device());
  op.api([&] {
    const auto [yv, sv, wv, ov] =
        std::array{op.view(y, "y"), op.view(slot_of, "slot_of"), op.view(weights, "weights"), op.view(out, "out")};
    moe_combine(yv, sv, wv, ov, launch.ctx);
  });
  return out;
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> moe_combine_backward_op(
    const at::Tensor& dout, const at::Tensor& y, const at::Tensor& slot_of, const at::Tensor& sorted_pairs,
    const at::Tensor& weights, std::array<bool, 2> output_mask) {
  const MoeOp op{"moe_combine_backward"};
  op.tensor(dout, "dout");
  op.tensor(y, "y");
  op.tensor(slot_of, "slot_of");
  op.tensor(sorted_pairs, "sorted_pairs");
  op.tensor(weights, "weights");
  op.rank(y, "y", 2, "(slots S, N)");
  at::Tensor gy = output_mask[0] ? at::empty(y.sizes(), y.options()) : at::Tensor();
  at::Tensor gw = output_mask[1] ? at::empty(weights.sizes(), weights.options()) : at::Tensor();
  const at::Tensor d = dout.contiguous();
  Launch launch(y.device());
  op.api([&] {
    const auto [dv, yv, sv, pv, wv, gyv, gwv] =
        std::array{op.view(d, "dout"), op.view(y, "y"), op.view(slot_of, "slot_of"), op.view(sorted_pairs, "sorted_pairs"),
                   op.view(weights, "weights"), op.view(gy, "grad_y"), op.view(gw, "grad_weights")};
    moe_combine_backward(dv, yv, sv, pv, wv, gyv, gwv, launch.ctx);
  });
  return {gy.defined() ? std::optional<at::Tensor>(gy) : std::nullopt,
          gw.defined() ? std::optional<at::Tensor>(gw) : std::nullopt};
}

at::Tensor moe_gather_op(const at::Tensor& x, const at::Tensor& sorted_pairs, const at::Tensor& slot_of) {
  const MoeOp op{"moe_gather"};
  op.tensor(x, "x");
  op.tensor(sorted_pairs, "sorted_pairs");
  op.tensor(slot_of, "slot_of");
  op.rank(x, "x", 2, "(tokens T, N)");
  op.rank(sorted_pairs, "sorted_pairs", 1, "(slots S)");
  op.rank(slot_of, "slot_of", 2, "(tokens T, k)");
  at::Tensor xs = at::empty({sorted_pairs.size(0), x.size(1)}, x.options());
  const at::Tensor xr = x.size(1) > 1 && x.stride(1) != 1 ? x.contiguous() : x;
  Launch launch(x.device());
  op.api([&] {
    moe_gather(op.view(xr, "x"), op.view(sorted_pairs, "sorted_pairs"), slot_of.size(1), op.view(xs, "xs"), launch.ctx);
  });
  return xs;
}

GroupedGemmVariant grouped_variant(const MoeOp& op, c10::string_view v) { return op.parse(v, &parse_grouped_gemm_variant); }

at::Tensor grouped_mm_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs, c10::string_view variant_name) {
  const MoeOp op{"grouped_mm"};
  op.tensor(x, "x");
  op.tensor(w, "w");
  op.tensor(offs, "offs");
  op.rank(x, "x", 2, "(rows M, K)");
  op.rank(w, "w", 3, "(groups E, K, N)");
  const GroupedGemmVariant variant = grouped_variant(op, variant_name);
  at::Tensor out = at::empty({x.size(0), w.size(2)}, x.options());
  const at::Tensor xr = x.size(1) > 1 && x.stride(1) != 1 ? x.contiguous() : x;
  Launch launch(x.device());
  op.api([&] {
    const auto [xv, wv, ov, yv] = std::array{op.view(xr, "x"), op.view(w, "w"), op.view(offs, "offs"), op.view(out, "out")};
    grouped_mm(xv, wv, ov, yv, variant, launch.ctx);
  });
  return out;
}

at::Tensor grouped_mm_weight_grad_op(const at::Tensor& x, const at::Tensor& dout, const at::Tensor& offs,
                                     c10::string_view variant_name) {
  const MoeOp op{"grouped_mm_weight_grad"};
  op.tensor(x, "x");
  op.tensor(dout, "dout");
  op.tensor(offs, "offs");
  op.rank(x, "x", 2, "(rows M, K)");
  op.rank(dout, "dout", 2, "(rows M, N)");
  op.rank(offs, "offs", 1, "(groups E)");
  const GroupedGemmVariant variant = grouped_variant(op, variant_name);
  at::Tensor dw = at::empty({offs.size(0), x.size(1), dout.size(1)}, x.options());
  const at::Tensor xr = x.size(1) > 1 && x.stride(1) != 1 ? x.contiguous() : x;
  const at::Tensor dr = dout.size(1) > 1 && dout.stride(1) != 1 ? dout.contiguous() : dout;
  Launch launch(x.device());
  op.api([&] {
    const auto [xv, dv, ov, wv] = std::array{op.view(xr, "x"), op.view(dr, "dout"), op.view(offs, "offs"), op.view(dw, "dw")};
    grouped_mm_weight_grad(xv, dv, ov, wv, false, variant, launch.ctx);
  });
  return dw;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> grouped_mm_swiglu_op(const at::Tensor& x, const at::Tensor& w,
                                                                       const at::Tensor& offs, bool save_pre,
                                                                       c10::string_view variant_name) {
  const MoeOp op{"grouped_mm_swiglu"};
  op.tensor(x, "x");
  op.tensor(w, "w");
  op.tensor(offs, "offs");
  op.rank(x, "x", 2, "(rows M, K)");
  op.rank(w, "w", 3, "(groups E, K, 2F: [gate | up])");
  const GroupedGemmVariant variant = grouped_variant(op, variant_name);
  at::Tensor out = at::empty({x.size(0), w.size(2) / 2}, x.options());
  at::Tensor pre = save_pre ? at::empty({x.size(0), w.size(2)}, x.options()) : at::Tensor();
  const at::Tensor xr = x.size(1) > 1 && x.stride(1) != 1 ? x.contiguous() : x;
  Launch launch(x.device());
  op.api([&] {
    const auto [xv, wv, ov, yv, pv] = std::array{op.view(xr, "x"), op.view(w, "w"), op.view(offs, "offs"),
                                                 op.view(out, "out"), op.view(pre, "pre")};
    grouped_mm_swiglu(xv, wv, ov, yv, pv, variant, launch.ctx);
  });
  return {out, pre.defined() ? std::optional<at::Tensor>(pre) : std::nullopt};
}

std::vector<std::string> grouped_gemm_variants() {
  return variant_names(all_grouped_gemm_variants(), grouped_gemm_variant_name);
}

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // Router logits (T, E) -> topk_ids (T, k) int32, topk_weights (T, k) fp32, lse (T) fp32 (moe.h).
  m.def(
      "moe_route(Tensor logits, Tensor? bias=None, *, int top_k, str scoring='softmax', bool topk_softmax=False, "
      "bool normalize=False, int n_groups=1, int topk_groups=1, float routed_scale=1.0) "
      "-> (Tensor topk_ids, Tensor topk_weights, Tensor lse)",
      tags);
  // The gradient of (topk_weights, lse) to the logits (T, E), in the logits' dtype, for the forward's
  // ids and scoring options (top_k: topk_ids' second dimension; the choice's bias and groups play no part).
  m.def(
      "moe_route_backward(Tensor logits, Tensor topk_ids, Tensor? grad_weights, Tensor? grad_lse, *, "
      "str scoring='softmax', bool topk_softmax=False, bool normalize=False, float routed_scale=1.0) -> Tensor",
      tags);
  // topk_ids (T, k) int32 -> counts (E), offsets (E + 1), sorted_pairs (T k), slot_of (T, k), dropped (1),
  // all int32 on the ids' device; capacity 0: dropless.
  m.def(
      "moe_permute(Tensor topk_ids, int num_experts, int capacity=0) "
      "-> (Tensor counts, Tensor offsets, Tensor sorted_pairs, Tensor slot_of, Tensor dropped)",
      tags);
  // out (T, N) = sum_j weights[t, j] y[slot_of[t, j]] (sorted_pairs: for the backward); no atomics.
  m.def("moe_combine(Tensor y, Tensor slot_of, Tensor sorted_pairs, Tensor weights) -> Tensor", tags);
  m.def(
      "moe_combine_backward(Tensor dout, Tensor y, Tensor slot_of, Tensor sorted_pairs, Tensor weights, "
      "bool[2] output_mask=[True, True]) -> (Tensor? grad_y, Tensor? grad_weights)",
      tags);
  // xs (S, N): xs[s] = x[sorted_pairs[s] / k] (k = slot_of's columns; slot_of serves the backward), zeros
  // for unused slots.
  m.def("moe_gather(Tensor x, Tensor sorted_pairs, Tensor slot_of) -> Tensor", tags);
  // out (M, N) = x (M, K) @ w[g] (K, N) over the rows of group g (offs (E,) int32 cumulative ends).
  m.def("grouped_mm(Tensor x, Tensor w, Tensor offs, *, str variant='auto') -> Tensor", tags);
  // dw (E, K, N): dw[g] = x[rows of g]^T @ dout[rows of g].
  m.def("grouped_mm_weight_grad(Tensor x, Tensor dout, Tensor offs, *, str variant='auto') -> Tensor", tags);
  // The expert up projection with SwiGLU: w (E, K, 2F) = [gate | up]; out (M, F) = silu(x w[g][:, :F]) *
  // (x w[g][:, F:]); pre (M, 2F) = x w[g] when save_pre (the backward's input), else None.
  m.def(
      "grouped_mm_swiglu(Tensor x, Tensor w, Tensor offs, *, bool save_pre=True, str variant='auto') "
      "-> (Tensor out, Tensor? pre)",
      tags);
  m.def("grouped_gemm_variants() -> str[]", &optimized::torch_glue::grouped_gemm_variants);
}

namespace {
void register_moe_kernels(torch::Library& m) {
  using namespace optimized::torch_glue;
  m.impl("moe_route", &moe_route_op);
  m.impl("moe_route_backward", &moe_route_backward_op);
  m.impl("moe_permute", &moe_permute_op);
  m.impl("moe_combine", &moe_combine_op);
  m.impl("moe_gather", &moe_gather_op);
  m.impl("moe_combine_backward", &moe_combine_backward_op);
  m.impl("grouped_mm", &grouped_mm_op);
  m.impl("grouped_mm_weight_grad", &grouped_mm_weight_grad_op);
  m.impl("grouped_mm_swiglu", &grouped_mm_swiglu_op);
}
}  // namespace

TORCH_LIBRARY_IMPL(optimized, CPU, m) { register_moe_kernels(m); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { register_moe_kernels(m); }
