// The torch glue of the linear family (include/optimized/linear.h):
//
//   TORCH_LIBRARY_FRAGMENT(optimized, m)    the schemas of torch.ops.optimized.linear_forward
//                                           (y = act(x W^T + b), and pre = x W^T + b when asked for),
//                                           linear_backward (the gradients output_mask names) and
//                                           linear_variants (the ladder)
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) kernels that flatten x (..., K) and the (..., N) operands
//                                           to the (rows, width) views the C++ API takes, allocate the
//                                           outputs with torch (the caching allocator, so CUDA graphs
//                                           capture them) and run on the current stream of the device,
//                                           under a device guard (common.h).
//
// Absent outputs are None (Tensor?), as the fused family's optional outputs: pre when save_pre is
// False, a gradient whose output_mask entry is False. An empty tensor would be ambiguous: with no
// rows (x of shape (0, K)) grad_input is a real, empty gradient.
//
// Checks (common.h says who checks what). The glue checks the torch facts it needs: defined, strided
// tensors; x of at least one dimension and weight of two (the outputs' shapes are x.shape[:-1] + (N,)
// and weight's); grad_output and pre of that (..., N) shape in the backward (flattened to rows, their
// leading dimensions would no longer show). Everything else -- dtypes (one for every operand),
// devices, K and N (>= 1: a layer with no input or output features is refused by the C++ API), the
// bias's shape, the activation's name, the variant and what it can run -- is the C++ API's, whose
// messages arrive prefixed "optimized::<op>: ".
//
// Layout. x and the (..., N) operands go to the C++ API as (rows, width) views without a copy when
// their strides allow one (as_rows: slices such as x[..., :k], x[::2]), else as contiguous copies. A
// weight that is not row-major (W.t() of a (K, N) tensor) and a bias that is not contiguous are
// copied; a bias of another rank goes as it is, for the C++ API to refuse.
//
// Autograd (linear_forward's backward is linear_backward, on the same variant), its jvp rule and the
// fake kernels are registered from Python (python/optimized_ops/linear/).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/gemm.h"
#include "optimized/linear.h"

namespace optimized::torch_glue {

namespace {

using OptTensor = std::optional<at::Tensor>;

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
at::Tensor or_undefined(const OptTensor& t) { return t ? *t : at::Tensor(); }

// One op of the family: its messages ("optimized::<op>: <argument>: ...") and its C++ API calls.
struct LinearOp : GlueOp {
  LinearVariant variant(c10::string_view v) const { return parse(v, &parse_linear_variant); }
  Activation activation(c10::string_view a) const { return parse(a, &parse_activation); }

  // x (..., K): at least one dimension (K is its last).
  void features(const at::Tensor& x, const char* arg, const char* shape) const {
    TORCH_CHECK_VALUE(x.dim() >= 1, prefix(arg) + "expected a tensor of at least 1 dimension " + shape +
                                        "; given 0-D (a scalar)");
  }
  // weight (N, K): two dimensions (N is the outputs' last).
  void weight(const at::Tensor& w) const {
    TORCH_CHECK_VALUE(w.dim() == 2, prefix("weight") + "expected a 2-D tensor (out_features N, in_features K); given shape " +
                                        str(w.sizes()));
  }
  // An operand that must have `shape`, named by `what`.
  void shape(const at::Tensor& t, const char* arg, at::IntArrayRef shape, const std::string& what) const {
    if (t.defined())
      TORCH_CHECK_VALUE(t.sizes() == shape, prefix(arg) + "expected shape " + str(shape) + " (" + what + "); given " +
                                                str(t.sizes()));
  }
};

// x.shape[:-1] + (n,): the shape of y, pre, grad_output.
std::vector<int64_t> outputs_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// t (..., width) as rows for the C++ API; width 0 (refused by the C++ API: no features) as it is.
at::Tensor rows_of(const at::Tensor& t, int64_t width) { return width > 0 ? as_rows(t, width) : t; }

// A fresh (..., width) output as the rows the C++ API writes (it is contiguous).
at::Tensor out_rows(const at::Tensor& t, int64_t width) { return width > 0 ? t.view({-1, width}) : t; }

// weight as the C++ API takes it: row-major (unit stride along K, rows at least K apart).
at::Tensor row_major_weight(const at::Tensor& w) {
  return row_major_strides(w.size(0), w.size(1), w.stride(0), w.stride(1)) ? w : w.contiguous();
}

// bias: a contiguous vector (1-D); other ranks as they are, for the C++ API to refuse.
at::Tensor vector_bias(const at::Tensor& b) { return b.defined() && b.dim() == 1 ? b.contiguous() : b; }

std::tuple<at::Tensor, OptTensor> linear_forward_op(const at::Tensor& x, const at::Tensor& weight_in,
                                                    const OptTensor& bias_opt, c10::string_view activation_name,
                                                    bool save_pre, c10::string_view variant_name, bool fp8) {
  const LinearOp op{"linear_forward"};
  op.tensor(x, "x");
  op.tensor(weight_in, "weight");
  op.optional(or_undefined(bias_opt), "bias");
  op.features(x, "x", "(..., in_features K)");
  op.weight(weight_in);
  const Activation activation = op.activation(activation_name);
  const LinearVariant variant = op.variant(variant_name);
  const int64_t k = x.size(-1), n = weight_in.size(0);
  at::Tensor y = at::empty(outputs_shape(x, n), x.options());
  at::Tensor pre = save_pre ? at::empty(outputs_shape(x, n), x.options()) : at::Tensor();
  const at::Tensor xr = rows_of(x, k), weight = row_major_weight(weight_in), bias = vector_bias(or_undefined(bias_opt));
  const at::Tensor yr = out_rows(y, n), pr = pre.defined() ? out_rows(pre, n) : at::Tensor();
  Launch launch(x.device());
  op.api([&] {
    const auto [xv, wv, bv, yv, pv] = std::array{op.view(xr, "x"), op.view(weight, "weight"), op.view(bias, "bias"),
                                                 op.view(yr, "y"), op.view(pr, "pre")};
    linear_forward(xv, wv, bv, yv, pv, LinearForwardOptions{activation, fp8}, variant, launch.ctx);
  });
  return {y, opt(pre)};
}

std::tuple<OptTensor, OptTensor, OptTensor> linear_backward_op(const at::Tensor& grad_output, const at::Tensor& input,
                                                               const at::Tensor& weight_in, const OptTensor& pre_opt,
                                                               const OptTensor& bias_opt,
                                                               c10::string_view activation_name,
                                                               std::array<bool, 3> output_mask,
                                                               c10::string_view variant_name, bool fp8) {
  const LinearOp op{"linear_backward"};
  const at::Tensor pre_in = or_undefined(pre_opt);
  op.tensor(grad_output, "grad_output");
  op.tensor(input, "input");
  op.tensor(weight_in, "weight");
  op.optional(pre_in, "pre");
  op.optional(or_undefined(bias_opt), "bias");
  op.features(input, "input", "(..., in_features K)");
  op.weight(weight_in);
  const int64_t k = input.size(-1), n = weight_in.size(0);
  const std::vector<int64_t> out_shape = outputs_shape(input, n);
  op.shape(grad_output, "grad_output", out_shape, "input's leading dimensions, out_features N");
  op.shape(pre_in, "pre", out_shape, "input's leading dimensions, out_features N");
  const Activation activation = op.activation(activation_name);
  const LinearVariant variant = op.variant(variant_name);
  const at::Tensor weight = row_major_weight(weight_in), bias = vector_bias(or_undefined(bias_opt));
  at::Tensor grad_input = output_mask[0] ? at::empty(input.sizes(), input.options()) : at::Tensor();
  at::Tensor grad_weight = output_mask[1] ? at::empty(weight_in.sizes(), input.options()) : at::Tensor();
  at::Tensor grad_bias = output_mask[2] ? at::empty({n}, input.options()) : at::Tensor();
  const at::Tensor dyr = rows_of(grad_output, n), xr = rows_of(input, k);
  const at::Tensor pr = pre_in.defined() ? rows_of(pre_in, n) : at::Tensor();
  const at::Tensor gir = grad_input.defined() ? out_rows(grad_input, k) : at::Tensor();
  Launch launch(input.device());
  op.api([&] {
    const auto [giv, gwv, gbv, dyv, xv, wv, pv, bv] =
        std::array{op.view(gir, "grad_input"), op.view(grad_weight, "grad_weight"), op.view(grad_bias, "grad_bias"),
                   op.view(dyr, "grad_output"), op.view(xr, "input"),  op.view(weight, "weight"),
                   op.view(pr, "pre"),         op.view(bias, "bias")};
    LinearBackwardOptions options;
    options.activation = activation;
    options.fp8 = fp8;
    linear_backward(giv, gwv, gbv, dyv, xv, wv, pv, bv, options, variant, launch.ctx);
  });
  return {opt(grad_input), opt(grad_weight), opt(grad_bias)};
}

// The ladder (naive to best, "auto" excluded), from the C++ API's table.
std::vector<std::string> linear_variants() { return variant_names(all_linear_variants(), linear_variant_name); }

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // y = act(x W^T + b): x (..., K), weight (N, K) (torch.nn.Linear's), bias (N) or None; y (..., N).
  // activation: 'none', 'relu', 'gelu', 'gelu_tanh', 'silu'. pre = x W^T + b (..., N) when save_pre,
  // else None.
  m.def(
      "linear_forward(Tensor x, Tensor weight, Tensor? bias, *, str activation='none', bool save_pre=False, "
      "str variant='auto', bool fp8=False) -> (Tensor y, Tensor? pre)",
      tags);
  // The gradients of linear_forward from grad_output (..., N): grad_input (input's shape), grad_weight
  // (weight's), grad_bias (N), each None where output_mask says False. pre: the forward's (None with an
  // activation: recomputed from input, weight and bias, which must then be the forward's).
  m.def(
      "linear_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor? pre, Tensor? bias, *, "
      "str activation='none', bool[3] output_mask=[True, True, True], str variant='auto', bool fp8=False) "
      "-> (Tensor? grad_input, Tensor? grad_weight, Tensor? grad_bias)",
      tags);
  m.def("linear_variants() -> str[]", &optimized::torch_glue::linear_variants);
}

namespace {
void register_linear_kernels(torch::Library& m) {
  using namespace optimized::torch_glue;
  m.impl("linear_forward", &linear_forward_op);
  m.impl("linear_backward", &linear_backward_op);
}
}  // namespace

TORCH_LIBRARY_IMPL(optimized, CPU, m) { register_linear_kernels(m); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { register_linear_kernels(m); }
