// The torch glue of the fused memory-bound family (include/optimized/fused.h):
//
//   TORCH_LIBRARY_FRAGMENT(optimized, m)    the schemas of torch.ops.optimized.<op>_fwd / _bwd and the
//                                           ladder's queries
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) kernels that flatten their N-D operands to the (rows,
//                                           width) views the C++ API takes, allocate fresh outputs with
//                                           torch (the caching allocator, so CUDA graphs capture them)
//                                           and run on the current stream of the device, under a device
//                                           guard (common.h).
//
// Checks (common.h says who checks what). The glue checks what its flattening needs and what the
// views no longer show: defined, strided tensors; softmax's dim; x ending in normalized_shape;
// operands of the N-D shape they must have (dy of y's shape, residual of x's, weight and bias of
// normalized_shape, bias of (x.shape[-1],), silu_and_mul's halves); GELU's approximate (no C++
// parser). The C++ API checks the rest -- dtypes, devices, the statistics, eps, the variant and what
// it can run -- and its messages arrive prefixed "optimized::<op>: ". Every call whose rows are at
// least one element wide reaches the C++ API, also with zero rows, so that its checks hold for empty
// batches too; only rows of width 0 (nothing to read, and no view the C++ API takes) stay here.
//
// Layout. Every op works on rows. An N-D operand is viewed as (rows, width) -- width the product
// of the trailing (normalized) dimensions, rows the product of the leading ones -- without a copy
// when its strides allow it (as_rows); other layouts are copied to a contiguous tensor first.
// Softmax over a dimension other than the last moves that dimension last (a copy unless it already
// has unit stride) and returns a permuted view of a contiguous result.
//
// Autograd, fake kernels and the double backward are registered from Python
// (python/optimized_ops/fused/).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/fused.h"

namespace optimized::torch_glue {

namespace {

using OptTensor = std::optional<at::Tensor>;

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }
at::Tensor or_undefined(const OptTensor& t) { return t ? *t : at::Tensor(); }

// One op of the family: its messages ("optimized::<op>: <argument>: ...") and its C++ API calls.
struct Op : GlueOp {
  // An operand that must have `shape`, named by `what` ("same as y", "normalized_shape").
  void shape(const at::Tensor& t, const char* arg, at::IntArrayRef shape, const std::string& what) const {
    if (t.defined())
      TORCH_CHECK_VALUE(t.sizes() == shape, prefix(arg) + "expected shape " + str(shape) + " (" + what + "); given " +
                                                str(t.sizes()));
  }


  // The op's scratch from torch's caching allocator (CUDA): what fused_workspace_bytes says for these
  // rows, handed over as the context's workspace, so that the C++ API allocates nothing itself.
  // A call the query refuses (a dtype, a variant of the other device) gets none: the C++ API's
  // entry, the one owner of the checks, then refuses it with its own wording.
  void workspace(Launch& launch, FusedOp fop, bool backward, const TensorView& rows, int64_t width,
                 FusedVariant v) const {
    if (!rows.device.is_cuda()) return;
    size_t bytes = 0;
    try {
      bytes = fused_workspace_bytes(fop, backward, rows.dtype, rows.device, rows.shape[0], width, v);
    } catch (const Error&) {
      return;
    }
    launch.provide_workspace(bytes);
  }

  FusedVariant variant(c10::string_view v) const {
    return api([&] { return parse_fused_variant(std::string_view(v.data(), v.size())); });
  }
};

// The norm op of a call: layer or RMS, with or without the residual add.
FusedOp norm_op(bool layer, bool add) {
  if (layer) return add ? FusedOp::kAddLayerNorm : FusedOp::kLayerNorm;
  return add ? FusedOp::kAddRmsNorm : FusedOp::kRmsNorm;
}

// torch's approximate= strings (the C++ API has the enum, not a parser).
GeluApproximation parse_approximate(const Op& op, c10::string_view name) {
  const std::string s(name.data(), name.size());
  if (s == "none") return GeluApproximation::kNone;
  if (s == "tanh") return GeluApproximation::kTanh;
  TORCH_CHECK_VALUE(false, op.prefix("approximate") + "expected 'none' or 'tanh'; given '" + s + "'");
}

// ---- shapes -----------------------------------------------------------------------------------

// Checks that x's trailing dimensions are normalized_shape; returns the width (their product).
int64_t normalized_width(const Op& op, const at::Tensor& x, const char* x_arg, at::IntArrayRef normalized_shape) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK_VALUE(k >= 1, op.prefix("normalized_shape") + "expected at least one dimension; given []");
  for (int64_t d : normalized_shape)
    TORCH_CHECK_VALUE(d >= 0, op.prefix("normalized_shape") + "expected sizes >= 0; given " + str(normalized_shape));
  bool ok = x.dim() >= k;
  for (int64_t i = 0; ok && i < k; ++i) ok = x.size(x.dim() - k + i) == normalized_shape[i];
  TORCH_CHECK_VALUE(ok, op.prefix(x_arg) + "expected a shape ending in " + str(normalized_shape) +
                            " (normalized_shape); given " + str(x.sizes()));
  int64_t width = 1;
  for (int64_t d : normalized_shape) width *= d;
  return width;
}

// The leading (row) dimensions of x: x.shape[:-k].
std::vector<int64_t> rows_shape(const at::Tensor& x, size_t k) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - static_cast<int64_t>(k));
}

int64_t wrap_dim(const Op& op, int64_t dim, int64_t ndim) {
  const int64_t n = ndim < 1 ? 1 : ndim;  // a 0-D tensor has one (implicit) dimension
  TORCH_CHECK_VALUE(dim >= -n && dim < n, op.prefix("dim") + "expected a dimension in [" + str(-n) + ", " +
                                              str(n - 1) + "]; given " + str(dim));
  return dim < 0 ? dim + n : dim;
}

// x with dimension d moved last (0-D: one element in one dimension).
at::Tensor dim_last(const at::Tensor& x, int64_t d) {
  if (x.dim() == 0) return x.reshape({1});
  return d == x.dim() - 1 ? x : x.movedim(d, -1);
}
// The inverse of dim_last for a result laid out with d last.
at::Tensor dim_back(const at::Tensor& y, int64_t d, int64_t ndim) {
  if (ndim == 0) return y.reshape({});
  return d == ndim - 1 ? y : y.movedim(-1, d);
}

// ---- softmax / log_softmax ----------------------------------------------------------------------

at::Tensor softmax_fwd_impl(const Op& op, bool log, const at::Tensor& x, int64_t dim, double scale,
                            c10::string_view variant_name) {
  op.tensor(x, "x");
  const int64_t d = wrap_dim(op, dim, x.dim());
  const FusedVariant variant = op.variant(variant_name);
  const at::Tensor xm = dim_last(x, d);
  at::Tensor ym = at::empty(xm.sizes(), x.options());  // contiguous, dim last
  if (const int64_t width = xm.size(-1); width > 0) {
    const at::Tensor xr = as_rows(xm, width);
    Launch launch(x.device());
    op.api([&] {
      const auto [xv, yv] = std::array{op.view(xr, "x"), op.view(ym.view({-1, width}), "y")};
      op.workspace(launch, log ? FusedOp::kLogSoftmax : FusedOp::kSoftmax, false, xv, width, variant);
      softmax_forward(xv, yv, scale, log, variant, launch.ctx);
    });
  }
  return dim_back(ym, d, x.dim());
}

at::Tensor softmax_bwd_impl(const Op& op, bool log, const at::Tensor& y, const at::Tensor& dy, int64_t dim,
                            double scale, c10::string_view variant_name) {
  op.tensor(y, "y");
  op.tensor(dy, "dy");
  op.shape(dy, "dy", y.sizes(), "same as y");
  const int64_t d = wrap_dim(op, dim, y.dim());
  const FusedVariant variant = op.variant(variant_name);
  const at::Tensor ym = dim_last(y, d), dym = dim_last(dy, d);
  at::Tensor dxm = at::empty(ym.sizes(), y.options());
  if (const int64_t width = ym.size(-1); width > 0) {
    const at::Tensor yr = as_rows(ym, width), dyr = as_rows(dym, width);
    Launch launch(y.device());
    op.api([&] {
      const auto [yv, dyv, dxv] =
          std::array{op.view(yr, "y"), op.view(dyr, "dy"), op.view(dxm.view({-1, width}), "dx")};
      op.workspace(launch, log ? FusedOp::kLogSoftmax : FusedOp::kSoftmax, true, yv, width, variant);
      softmax_backward(yv, dyv, dxv, scale, log, variant, launch.ctx);
    });
  }
  return dim_back(dxm, d, y.dim());
}

at::Tensor softmax_fwd(const at::Tensor& x, int64_t dim, double scale, c10::string_view variant) {
  return softmax_fwd_impl({"softmax_fwd"}, false, x, dim, scale, variant);
}
at::Tensor log_softmax_fwd(const at::Tensor& x, int64_t dim, double scale, c10::string_view variant) {
  return softmax_fwd_impl({"log_softmax_fwd"}, true, x, dim, scale, variant);
}
at::Tensor softmax_bwd(const at::Tensor& y, const at::Tensor& dy, int64_t dim, double scale,
                       c10::string_view variant) {
  return softmax_bwd_impl({"softmax_bwd"}, false, y, dy, dim, scale, variant);
}
at::Tensor log_softmax_bwd(const at::Tensor& y, const at::Tensor& dy, int64_t dim, double scale,
                           c10::string_view variant) {
  return softmax_bwd_impl({"log_softmax_bwd"}, true, y, dy, dim, scale, variant);
}

// ---- layer_norm / rms_norm (with the residual-add forms) -----------------------------------

// The outputs of a norm forward; residual_out, mean: undefined when not produced.
struct NormForward {
  at::Tensor y, residual_out, mean, rstd;
};

NormForward norm_forward(const Op& op, bool layer, const at::Tensor& x, const at::Tensor& residual,
                         at::IntArrayRef normalized_shape, const at::Tensor& weight, const at::Tensor& bias,
                         double eps, c10::string_view variant_name) {
  op.tensor(x, "x");
  op.optional(residual, "residual");
  op.optional(weight, "weight");
  op.optional(bias, "bias");
  const int64_t w = normalized_width(op, x, "x", normalized_shape);
  op.shape(residual, "residual", x.sizes(), "same as x");
  op.shape(weight, "weight", normalized_shape, "normalized_shape");
  op.shape(bias, "bias", normalized_shape, "normalized_shape");
  const FusedVariant variant = op.variant(variant_name);

  NormForward f;
  const std::vector<int64_t> stat_shape = rows_shape(x, normalized_shape.size());
  f.y = at::empty(x.sizes(), x.options());
  if (residual.defined()) f.residual_out = at::empty(x.sizes(), x.options());
  // float32 statistics, float64 ones for float64 x (the C++ API wants the data dtype's then).
  const auto stat_options = x.options().dtype(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  if (layer) f.mean = at::empty(stat_shape, stat_options);
  f.rstd = at::empty(stat_shape, stat_options);
  if (w == 0) {
    // No element to read. Rows of width 0 have no mean (0 / 0), as torch's reductions say.
    if (layer) f.mean.fill_(std::numeric_limits<double>::quiet_NaN());
    f.rstd.fill_(std::numeric_limits<double>::quiet_NaN());
    return f;
  }
  const at::Tensor xr = as_rows(x, w);
  const at::Tensor rr = residual.defined() ? as_rows(residual, w) : at::Tensor();
  const at::Tensor wv = weight.defined() ? as_vector(weight) : at::Tensor();
  const at::Tensor bv = bias.defined() ? as_vector(bias) : at::Tensor();
  const at::Tensor ro = residual.defined() ? f.residual_out.view({-1, w}) : at::Tensor();
  Launch launch(x.device());
  const at::Tensor mean = layer ? f.mean.view({-1}) : at::Tensor();
  op.api([&] {
    const auto [xv, rv, wv_, bv_, yv, rov, mv, sv] =
        std::array{op.view(xr, "x"), op.view(rr, "residual"), op.view(wv, "weight"), op.view(bv, "bias"),
                   op.view(f.y.view({-1, w}), "y"), op.view(ro, "residual_out"), op.view(mean, "mean"),
                   op.view(f.rstd.view({-1}), "rstd")};
    op.workspace(launch, norm_op(layer, residual.defined()), false, xv, w, variant);
    if (layer) {
      layer_norm_forward(xv, rv, wv_, bv_, eps, yv, rov, mv, sv, variant, launch.ctx);
    } else {
      rms_norm_forward(xv, rv, wv_, eps, yv, rov, sv, variant, launch.ctx);
    }
  });
  return f;
}

std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const OptTensor& residual, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
    const OptTensor& bias, double eps, c10::string_view variant) {
  NormForward f = norm_forward({"layer_norm_fwd"}, true, x, or_undefined(residual),
                               C10_AS_INTARRAYREF_SLOW(normalized_shape), or_undefined(weight), or_undefined(bias), eps,
                               variant);
  return {f.y, opt(f.residual_out), f.mean, f.rstd};
}

std::tuple<at::Tensor, OptTensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const OptTensor& residual,
                                                           c10::SymIntArrayRef normalized_shape,
                                                           const OptTensor& weight, double eps,
                                                           c10::string_view variant) {
  NormForward f = norm_forward({"rms_norm_fwd"}, false, x, or_undefined(residual),
                               C10_AS_INTARRAYREF_SLOW(normalized_shape), or_undefined(weight), at::Tensor(), eps,
                               variant);
  return {f.y, opt(f.residual_out), f.rstd};
}

// The gradients of a norm: dx (of x, and of residual for the add forms), dweight, dbias.
struct NormBackward {
  at::Tensor dx, dweight, dbias;
};

// mean: undefined for rms_norm. The statistics are the C++ API's to check (float32, float64 for
// float64 h; one per row, on h's device); the glue only flattens them.
NormBackward norm_backward(const Op& op, bool layer, const at::Tensor& dy, const at::Tensor& h,
                           at::IntArrayRef normalized_shape, const at::Tensor& weight, const at::Tensor& mean,
                           const at::Tensor& rstd, const at::Tensor& dresidual_out, bool want_dweight,
                           bool want_dbias, c10::string_view variant_name) {
  op.tensor(h, "h");
  op.tensor(dy, "dy");
  op.optional(weight, "weight");
  if (layer) op.tensor(mean, "mean");
  op.tensor(rstd, "rstd");
  op.optional(dresidual_out, "dresidual_out");
  const int64_t w = normalized_width(op, h, "h", normalized_shape);
  op.shape(dy, "dy", h.sizes(), "same as h");
  op.shape(dresidual_out, "dresidual_out", h.sizes(), "same as h");
  op.shape(weight, "weight", normalized_shape, "normalized_shape");
  const FusedVariant variant = op.variant(variant_name);

  NormBackward g;
  g.dx = at::empty(h.sizes(), h.options());
  if (want_dweight) g.dweight = at::empty(normalized_shape, h.options());
  if (want_dbias) g.dbias = at::empty(normalized_shape, h.options());
  if (w == 0) return g;  // no element: dx, dweight and dbias are empty
  const at::Tensor dyr = as_rows(dy, w), hr = as_rows(h, w);
  const at::Tensor dr = dresidual_out.defined() ? as_rows(dresidual_out, w) : at::Tensor();
  const at::Tensor wv = weight.defined() ? as_vector(weight) : at::Tensor();
  const at::Tensor mv = layer ? as_vector(mean) : at::Tensor();
  const at::Tensor rv = as_vector(rstd);
  const at::Tensor dw = want_dweight ? g.dweight.view({-1}) : at::Tensor();
  const at::Tensor db = want_dbias ? g.dbias.view({-1}) : at::Tensor();
  Launch launch(h.device());
  op.api([&] {
    const auto [dyv, hv, wv_, mv_, rv_, drv, dxv, dwv, dbv] =
        std::array{op.view(dyr, "dy"), op.view(hr, "h"), op.view(wv, "weight"), op.view(mv, "mean"),
                   op.view(rv, "rstd"), op.view(dr, "dresidual_out"), op.view(g.dx.view({-1, w}), "dx"),
                   op.view(dw, "dweight"), op.view(db, "dbias")};
    op.workspace(launch, norm_op(layer, dresidual_out.defined()), true, hv, w, variant);
    if (layer) {
      layer_norm_backward(dyv, hv, wv_, mv_, rv_, drv, dxv, dwv, dbv, variant, launch.ctx);
    } else {
      rms_norm_backward(dyv, hv, wv_, rv_, drv, dxv, dwv, variant, launch.ctx);
    }
  });
  return g;
}

std::tuple<at::Tensor, OptTensor, OptTensor> layer_norm_bwd(
    const at::Tensor& dy, const at::Tensor& h, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd, const OptTensor& dresidual_out, bool compute_dweight,
    bool compute_dbias, c10::string_view variant) {
  NormBackward g = norm_backward({"layer_norm_bwd"}, true, dy, h, C10_AS_INTARRAYREF_SLOW(normalized_shape),
                                 or_undefined(weight), mean, rstd, or_undefined(dresidual_out), compute_dweight,
                                 compute_dbias, variant);
  return {g.dx, opt(g.dweight), opt(g.dbias)};
}

std::tuple<at::Tensor, OptTensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& h,
                                               c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                               const at::Tensor& rstd, const OptTensor& dresidual_out,
                                               bool compute_dweight, c10::string_view variant) {
  NormBackward g = norm_backward({"rms_norm_bwd"}, false, dy, h, C10_AS_INTARRAYREF_SLOW(normalized_shape),
                                 or_undefined(weight), at::Tensor(), rstd, or_undefined(dresidual_out),
                                 compute_dweight, false, variant);
  return {g.dx, opt(g.dweight)};
}

// ---- bias + GELU --------------------------------------------------------------------------------

// The width of an elementwise op's rows: the last dimension (a 0-D tensor is one element).
int64_t last_width(const at::Tensor& x) { return x.dim() == 0 ? 1 : x.size(-1); }

// A bias runs along x's last dimension: x has one, and the bias is (x.shape[-1],).
void check_bias(const Op& op, const at::Tensor& bias, const at::Tensor& x) {
  if (!bias.defined()) return;
  TORCH_CHECK_VALUE(x.dim() >= 1, op.prefix("x") + "expected at least 1 dimension with a bias; given a 0-D tensor");
  op.shape(bias, "bias", {x.size(-1)}, "x's last dimension");
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const OptTensor& bias_opt, c10::string_view approximate,
                         c10::string_view variant_name) {
  const Op op{"bias_gelu_fwd"};
  const at::Tensor bias = or_undefined(bias_opt);
  op.tensor(x, "x");
  op.optional(bias, "bias");
  check_bias(op, bias, x);
  const GeluApproximation approx = parse_approximate(op, approximate);
  const FusedVariant variant = op.variant(variant_name);
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t w = last_width(x);
  if (w == 0) return y;
  const at::Tensor xr = as_rows(x, w);
  const at::Tensor bv = bias.defined() ? as_vector(bias) : at::Tensor();
  Launch launch(x.device());
  op.api([&] {
    const auto [xv, bv_, yv] = std::array{op.view(xr, "x"), op.view(bv, "bias"), op.view(y.view({-1, w}), "y")};
    op.workspace(launch, FusedOp::kBiasGelu, false, xv, w, variant);
    bias_gelu_forward(xv, bv_, approx, yv, variant, launch.ctx);
  });
  return y;
}

std::tuple<at::Tensor, OptTensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const OptTensor& bias_opt,
                                                c10::string_view approximate, bool compute_dbias,
                                                c10::string_view variant_name) {
  const Op op{"bias_gelu_bwd"};
  const at::Tensor bias = or_undefined(bias_opt);
  op.tensor(x, "x");
  op.tensor(dy, "dy");
  op.optional(bias, "bias");
  op.shape(dy, "dy", x.sizes(), "same as x");
  check_bias(op, bias, x);
  TORCH_CHECK_VALUE(!compute_dbias || x.dim() >= 1,
                    op.prefix("compute_dbias") + "expected False for a 0-D x (no bias dimension); given True");
  const GeluApproximation approx = parse_approximate(op, approximate);
  const FusedVariant variant = op.variant(variant_name);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dbias = compute_dbias ? at::empty({x.size(-1)}, x.options()) : at::Tensor();
  const int64_t w = last_width(x);
  if (w == 0) return {dx, opt(dbias)};
  const at::Tensor dyr = as_rows(dy, w), xr = as_rows(x, w);
  const at::Tensor bv = bias.defined() ? as_vector(bias) : at::Tensor();
  Launch launch(x.device());
  op.api([&] {
    const auto [dyv, xv, bv_, dxv, dbv] = std::array{op.view(dyr, "dy"), op.view(xr, "x"), op.view(bv, "bias"),
                                                     op.view(dx.view({-1, w}), "dx"), op.view(dbias, "dbias")};
    op.workspace(launch, FusedOp::kBiasGelu, true, xv, w, variant);
    bias_gelu_backward(dyv, xv, bv_, approx, dxv, dbv, variant, launch.ctx);
  });
  return {dx, opt(dbias)};
}

// ---- SiLU-and-mul -------------------------------------------------------------------------------

// d, the width of the halves [a | b] of x's last dimension (the output's last dimension).
int64_t half_width(const Op& op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, op.prefix("x") + "expected at least 1 dimension (..., 2 * d); given a 0-D tensor");
  TORCH_CHECK_VALUE(x.size(-1) % 2 == 0,
                    op.prefix("x") + "expected an even last dimension (2 * d, the halves [a | b]); given shape " +
                        str(x.sizes()));
  return x.size(-1) / 2;
}

// x's shape with the last dimension halved: y's and dy's.
std::vector<int64_t> halved(const at::Tensor& x, int64_t d) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  return shape;
}

at::Tensor silu_and_mul_fwd(const at::Tensor& x, c10::string_view variant_name) {
  const Op op{"silu_and_mul_fwd"};
  op.tensor(x, "x");
  const int64_t d = half_width(op, x);
  const FusedVariant variant = op.variant(variant_name);
  at::Tensor y = at::empty(halved(x, d), x.options());
  if (d == 0) return y;
  const at::Tensor xr = as_rows(x, 2 * d);
  Launch launch(x.device());
  op.api([&] {
    const auto [xv, yv] = std::array{op.view(xr, "x"), op.view(y.view({-1, d}), "y")};
    op.workspace(launch, FusedOp::kSiluAndMul, false, xv, d, variant);
    silu_and_mul_forward(xv, yv, variant, launch.ctx);
  });
  return y;
}

at::Tensor silu_and_mul_bwd(const at::Tensor& dy, const at::Tensor& x, c10::string_view variant_name) {
  const Op op{"silu_and_mul_bwd"};
  op.tensor(x, "x");
  op.tensor(dy, "dy");
  const int64_t d = half_width(op, x);
  op.shape(dy, "dy", halved(x, d), "x's with the last dimension halved");
  const FusedVariant variant = op.variant(variant_name);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  if (d == 0) return dx;
  const at::Tensor dyr = as_rows(dy, d), xr = as_rows(x, 2 * d);
  Launch launch(x.device());
  op.api([&] {
    const auto [dyv, xv, dxv] = std::array{op.view(dyr, "dy"), op.view(xr, "x"), op.view(dx.view({-1, 2 * d}), "dx")};
    op.workspace(launch, FusedOp::kSiluAndMul, true, xv, d, variant);
    silu_and_mul_backward(dyv, xv, dxv, variant, launch.ctx);
  });
  return dx;
}

// ---- queries (no tensors: registered as catch-all kernels) ------------------------------------

// The ladder (naive to best, "auto" excluded), from the C++ API's table.
std::vector<std::string> fused_variants() { return variant_names(all_fused_variants(), fused_variant_name); }

int64_t fused_registers_max_width_op(c10::string_view op_name_, at::ScalarType dtype, bool backward) {
  const Op op{"fused_registers_max_width"};
  const DType dt = to_dtype(dtype, op.prefix("dtype"));
  return op.api([&] {
    return fused_registers_max_width(parse_fused_op(std::string_view(op_name_.data(), op_name_.size())), dt,
                                     backward);
  });
}

std::string resolve_variant_op(c10::string_view op_name_, at::ScalarType dtype, c10::string_view device,
                               int64_t width, bool backward) {
  const Op op{"resolve_fused_variant"};
  const DType dt = to_dtype(dtype, op.prefix("dtype"));
  const at::Device d(std::string(device.data(), device.size()));  // torch's own error for malformed names
  const Device where = to_device(d, op.prefix("device"));          // a torch fact: cpu or cuda
  // The op, the width and what the family takes on the device are the C++ API's to check.
  return op.api([&] {
    const FusedOp fop = parse_fused_op(std::string_view(op_name_.data(), op_name_.size()));
    return std::string(fused_variant_name(resolve_fused_variant(fop, dt, where, width, backward)));
  });
}

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // softmax / log_softmax over `dim` of scale * x; backward from the forward OUTPUT y.
  m.def("softmax_fwd(Tensor x, int dim=-1, float scale=1., *, str variant='auto') -> Tensor", tags);
  m.def("softmax_bwd(Tensor y, Tensor dy, int dim=-1, float scale=1., *, str variant='auto') -> Tensor", tags);
  m.def("log_softmax_fwd(Tensor x, int dim=-1, float scale=1., *, str variant='auto') -> Tensor", tags);
  m.def("log_softmax_bwd(Tensor y, Tensor dy, int dim=-1, float scale=1., *, str variant='auto') -> Tensor", tags);
  // Norms over the trailing dimensions normalized_shape; with a residual, h = x + residual is
  // normalized and returned as residual_out. mean / rstd: float32 (float64 for float64
  // x), x.shape[:-len(normalized_shape)].
  m.def(
      "layer_norm_fwd(Tensor x, Tensor? residual, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, "
      "float eps, *, str variant='auto') -> (Tensor y, Tensor? residual_out, Tensor mean, Tensor rstd)",
      tags);
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor h, SymInt[] normalized_shape, Tensor? weight, Tensor mean, Tensor rstd, "
      "Tensor? dresidual_out, bool compute_dweight, bool compute_dbias, *, str variant='auto') "
      "-> (Tensor dx, Tensor? dweight, Tensor? dbias)",
      tags);
  m.def(
      "rms_norm_fwd(Tensor x, Tensor? residual, SymInt[] normalized_shape, Tensor? weight, float eps, *, "
      "str variant='auto') -> (Tensor y, Tensor? residual_out, Tensor rstd)",
      tags);
  m.def(
      "rms_norm_bwd(Tensor dy, Tensor h, SymInt[] normalized_shape, Tensor? weight, Tensor rstd, "
      "Tensor? dresidual_out, bool compute_dweight, *, str variant='auto') -> (Tensor dx, Tensor? dweight)",
      tags);
  // y = gelu(x + bias) over x's last dimension; bias (x.shape[-1]) or None.
  m.def("bias_gelu_fwd(Tensor x, Tensor? bias, str approximate='none', *, str variant='auto') -> Tensor", tags);
  m.def(
      "bias_gelu_bwd(Tensor dy, Tensor x, Tensor? bias, str approximate, bool compute_dbias, *, "
      "str variant='auto') -> (Tensor dx, Tensor? dbias)",
      tags);
  // x = [a | b] along the last dimension (2 * d); y = silu(a) * b (..., d).
  m.def("silu_and_mul_fwd(Tensor x, *, str variant='auto') -> Tensor", tags);
  m.def("silu_and_mul_bwd(Tensor dy, Tensor x, *, str variant='auto') -> Tensor", tags);
  // Queries about the ladder (no tensors).
  m.def("fused_variants() -> str[]", &optimized::torch_glue::fused_variants);
  m.def("fused_registers_max_width(str op, ScalarType dtype, bool backward=False) -> int",
        &optimized::torch_glue::fused_registers_max_width_op);
  m.def("resolve_fused_variant(str op, ScalarType dtype, str device, int width, bool backward=False) -> str",
        &optimized::torch_glue::resolve_variant_op);
}

namespace {
void register_fused_kernels(torch::Library& m) {
  using namespace optimized::torch_glue;
  m.impl("softmax_fwd", &softmax_fwd);
  m.impl("softmax_bwd", &softmax_bwd);
  m.impl("log_softmax_fwd", &log_softmax_fwd);
  m.impl("log_softmax_bwd", &log_softmax_bwd);
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("rms_norm_fwd", &rms_norm_fwd);
  m.impl("rms_norm_bwd", &rms_norm_bwd);
  m.impl("bias_gelu_fwd", &bias_gelu_fwd);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd);
  m.impl("silu_and_mul_fwd", &silu_and_mul_fwd);
  m.impl("silu_and_mul_bwd", &silu_and_mul_bwd);
}
}  // namespace

TORCH_LIBRARY_IMPL(optimized, CPU, m) { register_fused_kernels(m); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { register_fused_kernels(m); }
