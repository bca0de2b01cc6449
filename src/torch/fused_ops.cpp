// The torch glue of the fused memory-bound family (include/optimized/fused.h):
//
//   TORCH_LIBRARY_FRAGMENT(optimized, m)    the schemas of torch.ops.optimized.<op>_fwd / _bwd
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) kernels that check their inputs (messages name the
//                                           argument), flatten them to the (rows, width) views the
//                                           C++ API takes, allocate fresh outputs with torch (the
//                                           caching allocator, so CUDA graphs capture them) and
//                                           run on the current stream of the device, under a
//                                           device guard.
//
// Conventions shared with gemm_ops.cpp (the GEMM glue): error messages are built as one
// std::string (integers through std::to_string, never streamed through c10::str, which segfaulted
// on the GPU machine's toolchain); ValueError for shapes, devices and names, TypeError for dtypes,
// NotImplementedError for what a variant or build cannot take; the stream comes from c10's
// device-generic API, so this file needs neither the CUDA headers nor libtorch_cuda.
//
// Layout. Every op works on rows. An N-D operand is viewed as (rows, width) -- width the product
// of the trailing (normalized) dimensions, rows the product of the leading ones -- without a copy
// when its strides allow it (the trailing dimensions are dense with a unit last stride and the
// leading ones collapse to a single row stride >= width: slices such as x[..., :k] of a wider
// tensor, or x[::2]); other layouts (transposes, expanded rows) are copied to a contiguous tensor
// first. Softmax over a dimension other than the last moves that dimension last (a copy unless it
// already has unit stride) and returns a permuted view of a contiguous result.
//
// Autograd, fake kernels and the double backward are registered from Python
// (python/optimized_ops/fused.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorUtils.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "optimized/core.h"
#include "optimized/fused.h"

namespace optimized::torch_glue {

namespace {

using OptTensor = std::optional<at::Tensor>;

// ---- messages -------------------------------------------------------------------------------

std::string str(int64_t v) { return std::to_string(v); }
std::string str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}
// "float32", "bfloat16": the names Python users know (torch.float32), not c10's "Float".
std::string dtype_str(at::ScalarType t) { return c10::getDtypeNames(t).first; }

// The checks of one op: every message starts with "optimized::<op>: <argument>: ".
struct Checker {
  std::string op;  // "layer_norm_fwd"

  std::string prefix(const char* arg) const { return "optimized::" + op + ": " + arg + ": "; }

  // A defined dense tensor of a floating dtype the family takes.
  void tensor(const at::Tensor& t, const char* arg) const {
    TORCH_CHECK_VALUE(t.defined(), prefix(arg) + "expected a tensor; given an undefined tensor");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided,
                      prefix(arg) + "expected a strided (dense) tensor; given a non-strided layout");
    const auto st = t.scalar_type();
    // float64 runs on the CPU variant only (the C++ API says so for the others).
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
                     prefix(arg) + "expected dtype float32, float16, bfloat16 or float64; given " + dtype_str(st));
  }

  // Same dtype and device as `ref` (named `ref_arg`).
  void like(const at::Tensor& t, const char* arg, const at::Tensor& ref, const char* ref_arg) const {
    tensor(t, arg);
    TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(),
                     prefix(arg) + "expected dtype " + dtype_str(ref.scalar_type()) + " (same as " + ref_arg +
                         "); given " + dtype_str(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == ref.device(), prefix(arg) + "expected device " + ref.device().str() +
                                                      " (same as " + ref_arg + "); given " + t.device().str());
  }

  // Same dtype, device and shape as `ref`.
  void same(const at::Tensor& t, const char* arg, const at::Tensor& ref, const char* ref_arg) const {
    like(t, arg, ref, ref_arg);
    TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), prefix(arg) + "expected shape " + str(ref.sizes()) + " (same as " +
                                                    ref_arg + "); given " + str(t.sizes()));
  }

  // A float32 statistic (mean or rstd) of the rows: shape `rows_shape`, on ref's device.
  void stats(const at::Tensor& t, const char* arg, at::IntArrayRef rows_shape, const at::Tensor& ref) const {
    TORCH_CHECK_VALUE(t.defined(), prefix(arg) + "expected a tensor; given an undefined tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat,
                     prefix(arg) + "expected dtype float32 (the statistics saved by the forward); given " +
                         dtype_str(t.scalar_type()));
    TORCH_CHECK_VALUE(t.device() == ref.device(),
                      prefix(arg) + "expected device " + ref.device().str() + "; given " + t.device().str());
    TORCH_CHECK_VALUE(t.sizes() == rows_shape, prefix(arg) + "expected shape " + str(rows_shape) +
                                                   " (the leading dimensions); given " + str(t.sizes()));
  }
};

// Raises the torch error that matches the C++ status: ValueError for invalid arguments,
// NotImplementedError for valid inputs this variant or build cannot take, RuntimeError otherwise.
[[noreturn]] void rethrow(const std::string& op, const Error& e) {
  const std::string where = "optimized::" + op;
  switch (e.status()) {
    case Status::kInvalidArgument: TORCH_CHECK_VALUE(false, where + ": " + e.what());
    case Status::kUnsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, where + ": " + e.what());
    default: break;
  }
  TORCH_CHECK(false, where + " (" + std::string(status_name(e.status())) + "): " + e.what());
}

FusedVariant parse_variant(const std::string& op, c10::string_view name) {
  try {
    return parse_fused_variant(std::string_view(name.data(), name.size()));
  } catch (const Error& e) {
    rethrow(op, e);
  }
}

GeluApproximation parse_approximate(const Checker& c, c10::string_view name) {
  const std::string s(name.data(), name.size());
  if (s == "none") return GeluApproximation::kNone;
  if (s == "tanh") return GeluApproximation::kTanh;
  TORCH_CHECK_VALUE(false, c.prefix("approximate") + "expected 'none' or 'tanh'; given '" + s + "'");
}

// ---- views ------------------------------------------------------------------------------------

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kDouble: return DType::kF64;
    default: break;
  }
  TORCH_CHECK_TYPE(false, std::string("unreachable: dtype ") + dtype_str(t) + " was not checked");
}

// The C++ device of a torch device the family runs on (cpu, cuda); any other type (meta, xpu, ...)
// is refused with a ValueError that starts with `prefix` ("optimized::<op>: <argument>: ") and
// lists the supported types. Tensors of other types never reach these kernels (only the CPU and
// CUDA dispatch keys are registered); a device named by a query can be anything.
Device to_device(const at::Device& d, const std::string& prefix = "optimized: device: ") {
  if (d.is_cuda()) return Device::cuda(d.index() < 0 ? 0 : d.index());
  TORCH_CHECK_VALUE(d.is_cpu(), prefix + "expected a cpu or cuda device; given " + d.str());
  return Device::cpu();
}

// t as a (rows, width) tensor the C++ API takes: unit stride along the width, rows at least a row
// apart. A view of t when its strides allow it, else a view of a contiguous copy. numel > 0.
at::Tensor as_rows(const at::Tensor& t, int64_t width) {
  const int64_t rows = t.numel() / width;
  const std::vector<int64_t> shape{rows, width};
  if (at::detail::computeStride(t.sizes(), t.strides(), shape).has_value()) {
    at::Tensor v = t.view(shape);
    if ((width == 1 || v.stride(1) == 1) && (rows == 1 || v.stride(0) >= width)) return v;
  }
  return t.contiguous().view(shape);
}

// The C++ view of a (rows, width) tensor from as_rows or a fresh contiguous output.
TensorView rows_view(const at::Tensor& v) {
  const int64_t rows = v.size(0), width = v.size(1);
  const int64_t ld = rows > 1 ? v.stride(0) : width;  // one row: its stride is never used
  return TensorView::matrix(v.data_ptr(), to_dtype(v.scalar_type()), to_device(v.device()), rows, width, ld);
}

// A vector (width) -- weight, bias and their gradients -- as a contiguous 1-D view.
at::Tensor as_vector(const at::Tensor& t) { return t.reshape({-1}).contiguous(); }
TensorView vector_view(const at::Tensor& v) {
  return TensorView(v.data_ptr(), to_dtype(v.scalar_type()), to_device(v.device()), {v.numel()});
}
TensorView stats_view(const at::Tensor& v) {  // float32 (rows), contiguous
  return TensorView(v.data_ptr(), DType::kF32, to_device(v.device()), {v.numel()});
}
TensorView absent() { return TensorView{}; }

// The device guard and the execution context of a call: the current stream of the tensor's CUDA
// device, torch's intra-op thread count on the CPU.
struct Launch {
  c10::OptionalDeviceGuard guard;
  ExecutionContext ctx;

  explicit Launch(const at::Tensor& t) {
    if (t.is_cuda()) {
      guard.reset_device(t.device());
      const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(t.device());
      ctx.cuda_stream = stream.native_handle();
    } else {
      ctx.cpu_threads = at::get_num_threads();
    }
  }
};

// ---- shapes -----------------------------------------------------------------------------------

// Checks that x's trailing dimensions are normalized_shape; returns the width (their product).
int64_t normalized_width(const Checker& c, const at::Tensor& x, const char* x_arg, at::IntArrayRef normalized_shape) {
  const int64_t k = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK_VALUE(k >= 1, c.prefix("normalized_shape") + "expected at least one dimension; given []");
  for (int64_t d : normalized_shape)
    TORCH_CHECK_VALUE(d >= 0, c.prefix("normalized_shape") + "expected sizes >= 0; given " + str(normalized_shape));
  bool ok = x.dim() >= k;
  for (int64_t i = 0; ok && i < k; ++i) ok = x.size(x.dim() - k + i) == normalized_shape[i];
  TORCH_CHECK_VALUE(ok, c.prefix(x_arg) + "expected a shape ending in " + str(normalized_shape) +
                            " (normalized_shape); given " + str(x.sizes()));
  int64_t width = 1;
  for (int64_t d : normalized_shape) width *= d;
  return width;
}

// The leading (row) dimensions of x: x.shape[:-k].
std::vector<int64_t> rows_shape(const at::Tensor& x, size_t k) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - static_cast<int64_t>(k));
}

// A weight or bias: normalized_shape, x's dtype and device.
void check_affine(const Checker& c, const at::Tensor& t, const char* arg, const at::Tensor& x,
                  at::IntArrayRef normalized_shape) {
  c.like(t, arg, x, "x");
  TORCH_CHECK_VALUE(t.sizes() == normalized_shape, c.prefix(arg) + "expected shape " + str(normalized_shape) +
                                                       " (normalized_shape); given " + str(t.sizes()));
}

int64_t wrap_dim(const Checker& c, int64_t dim, int64_t ndim) {
  const int64_t n = ndim < 1 ? 1 : ndim;  // a 0-D tensor has one (implicit) dimension
  TORCH_CHECK_VALUE(dim >= -n && dim < n, c.prefix("dim") + "expected a dimension in [" + str(-n) + ", " +
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

at::Tensor softmax_fwd_impl(const std::string& op, bool log, const at::Tensor& x, int64_t dim, double scale,
                            c10::string_view variant_name) {
  const Checker c{op};
  c.tensor(x, "x");
  const int64_t d = wrap_dim(c, dim, x.dim());
  const FusedVariant variant = parse_variant(op, variant_name);
  const at::Tensor xm = dim_last(x, d);
  at::Tensor ym = at::empty(xm.sizes(), x.options());  // contiguous, dim last
  if (xm.numel() > 0) {
    const int64_t width = xm.size(-1);
    Launch launch(x);
    try {
      softmax_forward(rows_view(as_rows(xm, width)), rows_view(ym.view({-1, width})), scale, log, variant,
                      launch.ctx);
    } catch (const Error& e) {
      rethrow(op, e);
    }
  }
  return dim_back(ym, d, x.dim());
}

at::Tensor softmax_bwd_impl(const std::string& op, bool log, const at::Tensor& y, const at::Tensor& dy, int64_t dim,
                            double scale, c10::string_view variant_name) {
  const Checker c{op};
  c.tensor(y, "y");
  c.same(dy, "dy", y, "y");
  const int64_t d = wrap_dim(c, dim, y.dim());
  const FusedVariant variant = parse_variant(op, variant_name);
  const at::Tensor ym = dim_last(y, d), dym = dim_last(dy, d);
  at::Tensor dxm = at::empty(ym.sizes(), y.options());
  if (ym.numel() > 0) {
    const int64_t width = ym.size(-1);
    Launch launch(y);
    try {
      softmax_backward(rows_view(as_rows(ym, width)), rows_view(as_rows(dym, width)),
                       rows_view(dxm.view({-1, width})), scale, log, variant, launch.ctx);
    } catch (const Error& e) {
      rethrow(op, e);
    }
  }
  return dim_back(dxm, d, y.dim());
}

at::Tensor softmax_fwd(const at::Tensor& x, int64_t dim, double scale, c10::string_view variant) {
  return softmax_fwd_impl("softmax_fwd", false, x, dim, scale, variant);
}
at::Tensor log_softmax_fwd(const at::Tensor& x, int64_t dim, double scale, c10::string_view variant) {
  return softmax_fwd_impl("log_softmax_fwd", true, x, dim, scale, variant);
}
at::Tensor softmax_bwd(const at::Tensor& y, const at::Tensor& dy, int64_t dim, double scale,
                       c10::string_view variant) {
  return softmax_bwd_impl("softmax_bwd", false, y, dy, dim, scale, variant);
}
at::Tensor log_softmax_bwd(const at::Tensor& y, const at::Tensor& dy, int64_t dim, double scale,
                           c10::string_view variant) {
  return softmax_bwd_impl("log_softmax_bwd", true, y, dy, dim, scale, variant);
}

// ---- layer_norm / rms_norm (with the residual-add forms) -----------------------------------

// The operands of a norm forward, checked, with the outputs allocated.
struct NormForward {
  int64_t width = 0;
  std::vector<int64_t> stat_shape;
  at::Tensor y, residual_out, mean, rstd;  // residual_out, mean: undefined when not produced
};

NormForward norm_forward(const Checker& c, bool layer, const at::Tensor& x, const OptTensor& residual,
                         at::IntArrayRef normalized_shape, const OptTensor& weight, const OptTensor& bias,
                         c10::string_view variant_name, double eps) {
  c.tensor(x, "x");
  NormForward f;
  f.width = normalized_width(c, x, "x", normalized_shape);
  f.stat_shape = rows_shape(x, normalized_shape.size());
  if (residual) c.same(*residual, "residual", x, "x");
  if (weight) check_affine(c, *weight, "weight", x, normalized_shape);
  if (bias) check_affine(c, *bias, "bias", x, normalized_shape);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0,
                    c.prefix("eps") + "expected a finite value >= 0; given " + std::to_string(eps));
  const FusedVariant variant = parse_variant(c.op, variant_name);

  f.y = at::empty(x.sizes(), x.options());
  if (residual) f.residual_out = at::empty(x.sizes(), x.options());
  const auto stat_options = x.options().dtype(at::kFloat);
  if (layer) f.mean = at::empty(f.stat_shape, stat_options);
  f.rstd = at::empty(f.stat_shape, stat_options);
  if (x.numel() == 0) {
    // No element to read. Rows of width 0 have no mean (0 / 0), as torch's reductions say.
    if (f.width == 0) {
      if (residual) f.residual_out.zero_();
      if (layer) f.mean.fill_(std::numeric_limits<double>::quiet_NaN());
      f.rstd.fill_(std::numeric_limits<double>::quiet_NaN());
    }
    return f;
  }
  const int64_t w = f.width;
  const at::Tensor xr = as_rows(x, w);
  const at::Tensor rr = residual ? as_rows(*residual, w) : at::Tensor();
  const at::Tensor wv = weight ? as_vector(*weight) : at::Tensor();
  const at::Tensor bv = bias ? as_vector(*bias) : at::Tensor();
  Launch launch(x);
  try {
    if (layer) {
      layer_norm_forward(rows_view(xr), residual ? rows_view(rr) : absent(), weight ? vector_view(wv) : absent(),
                         bias ? vector_view(bv) : absent(), eps, rows_view(f.y.view({-1, w})),
                         residual ? rows_view(f.residual_out.view({-1, w})) : absent(), stats_view(f.mean),
                         stats_view(f.rstd), variant, launch.ctx);
    } else {
      rms_norm_forward(rows_view(xr), residual ? rows_view(rr) : absent(), weight ? vector_view(wv) : absent(),
                       eps, rows_view(f.y.view({-1, w})),
                       residual ? rows_view(f.residual_out.view({-1, w})) : absent(), stats_view(f.rstd), variant,
                       launch.ctx);
    }
  } catch (const Error& e) {
    rethrow(c.op, e);
  }
  return f;
}

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

std::tuple<at::Tensor, OptTensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const OptTensor& residual, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
    const OptTensor& bias, double eps, c10::string_view variant) {
  const Checker c{"layer_norm_fwd"};
  NormForward f = norm_forward(c, true, x, residual, C10_AS_INTARRAYREF_SLOW(normalized_shape), weight, bias, variant,
                               eps);
  return {f.y, opt(f.residual_out), f.mean, f.rstd};
}

std::tuple<at::Tensor, OptTensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const OptTensor& residual,
                                                           c10::SymIntArrayRef normalized_shape,
                                                           const OptTensor& weight, double eps,
                                                           c10::string_view variant) {
  const Checker c{"rms_norm_fwd"};
  NormForward f = norm_forward(c, false, x, residual, C10_AS_INTARRAYREF_SLOW(normalized_shape), weight,
                               std::nullopt, variant, eps);
  return {f.y, opt(f.residual_out), f.rstd};
}

// The gradients of a norm: dx (of x, and of residual for the add forms), dweight, dbias.
struct NormBackward {
  at::Tensor dx, dweight, dbias;
};

NormBackward norm_backward(const Checker& c, bool layer, const at::Tensor& dy, const at::Tensor& h,
                           at::IntArrayRef normalized_shape, const OptTensor& weight, const at::Tensor* mean,
                           const at::Tensor& rstd, const OptTensor& dresidual_out, bool want_dweight,
                           bool want_dbias, c10::string_view variant_name) {
  c.tensor(h, "h");
  c.same(dy, "dy", h, "h");
  const int64_t w = normalized_width(c, h, "h", normalized_shape);
  const std::vector<int64_t> stat_shape = rows_shape(h, normalized_shape.size());
  if (weight) check_affine(c, *weight, "weight", h, normalized_shape);
  if (mean) c.stats(*mean, "mean", stat_shape, h);
  c.stats(rstd, "rstd", stat_shape, h);
  if (dresidual_out) c.same(*dresidual_out, "dresidual_out", h, "h");
  const FusedVariant variant = parse_variant(c.op, variant_name);

  NormBackward g;
  g.dx = at::empty(h.sizes(), h.options());
  if (want_dweight) g.dweight = at::empty(normalized_shape, h.options());
  if (want_dbias) g.dbias = at::empty(normalized_shape, h.options());
  if (h.numel() == 0) {  // nothing to read: sums over no rows are 0
    if (want_dweight) g.dweight.zero_();
    if (want_dbias) g.dbias.zero_();
    return g;
  }
  const at::Tensor dyr = as_rows(dy, w), hr = as_rows(h, w);
  const at::Tensor dr = dresidual_out ? as_rows(*dresidual_out, w) : at::Tensor();
  const at::Tensor wv = weight ? as_vector(*weight) : at::Tensor();
  const at::Tensor mv = mean ? mean->reshape({-1}).contiguous() : at::Tensor();
  const at::Tensor rv = rstd.reshape({-1}).contiguous();
  Launch launch(h);
  try {
    if (layer) {
      layer_norm_backward(rows_view(dyr), rows_view(hr), weight ? vector_view(wv) : absent(), stats_view(mv),
                          stats_view(rv), dresidual_out ? rows_view(dr) : absent(), rows_view(g.dx.view({-1, w})),
                          want_dweight ? vector_view(g.dweight) : absent(),
                          want_dbias ? vector_view(g.dbias) : absent(), variant, launch.ctx);
    } else {
      rms_norm_backward(rows_view(dyr), rows_view(hr), weight ? vector_view(wv) : absent(), stats_view(rv),
                        dresidual_out ? rows_view(dr) : absent(), rows_view(g.dx.view({-1, w})),
                        want_dweight ? vector_view(g.dweight) : absent(), variant, launch.ctx);
    }
  } catch (const Error& e) {
    rethrow(c.op, e);
  }
  return g;
}

std::tuple<at::Tensor, OptTensor, OptTensor> layer_norm_bwd(
    const at::Tensor& dy, const at::Tensor& h, c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd, const OptTensor& dresidual_out, bool compute_dweight,
    bool compute_dbias, c10::string_view variant) {
  const Checker c{"layer_norm_bwd"};
  NormBackward g = norm_backward(c, true, dy, h, C10_AS_INTARRAYREF_SLOW(normalized_shape), weight, &mean, rstd,
                                 dresidual_out, compute_dweight, compute_dbias, variant);
  return {g.dx, opt(g.dweight), opt(g.dbias)};
}

std::tuple<at::Tensor, OptTensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& h,
                                               c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                                               const at::Tensor& rstd, const OptTensor& dresidual_out,
                                               bool compute_dweight, c10::string_view variant) {
  const Checker c{"rms_norm_bwd"};
  NormBackward g = norm_backward(c, false, dy, h, C10_AS_INTARRAYREF_SLOW(normalized_shape), weight, nullptr, rstd,
                                 dresidual_out, compute_dweight, false, variant);
  return {g.dx, opt(g.dweight)};
}

// ---- bias + GELU --------------------------------------------------------------------------------

// The width of an elementwise op's rows: the last dimension (a 0-D tensor is one element).
int64_t last_width(const at::Tensor& x) { return x.dim() == 0 ? 1 : x.size(-1); }

void check_bias(const Checker& c, const at::Tensor& bias, const at::Tensor& x) {
  c.like(bias, "bias", x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, c.prefix("x") + "expected at least 1 dimension with a bias; given a 0-D tensor");
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == x.size(-1),
                    c.prefix("bias") + "expected shape [" + str(x.size(-1)) + "] (x's last dimension); given " +
                        str(bias.sizes()));
}

at::Tensor bias_gelu_fwd(const at::Tensor& x, const OptTensor& bias, c10::string_view approximate,
                         c10::string_view variant_name) {
  const Checker c{"bias_gelu_fwd"};
  c.tensor(x, "x");
  if (bias) check_bias(c, *bias, x);
  const GeluApproximation approx = parse_approximate(c, approximate);
  const FusedVariant variant = parse_variant(c.op, variant_name);
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  const int64_t w = last_width(x);
  const at::Tensor bv = bias ? as_vector(*bias) : at::Tensor();
  Launch launch(x);
  try {
    bias_gelu_forward(rows_view(as_rows(x, w)), bias ? vector_view(bv) : absent(), approx,
                      rows_view(y.view({-1, w})), variant, launch.ctx);
  } catch (const Error& e) {
    rethrow(c.op, e);
  }
  return y;
}

std::tuple<at::Tensor, OptTensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x, const OptTensor& bias,
                                                c10::string_view approximate, bool compute_dbias,
                                                c10::string_view variant_name) {
  const Checker c{"bias_gelu_bwd"};
  c.tensor(x, "x");
  c.same(dy, "dy", x, "x");
  if (bias) check_bias(c, *bias, x);
  TORCH_CHECK_VALUE(!compute_dbias || x.dim() >= 1,
                    c.prefix("compute_dbias") + "expected False for a 0-D x (no bias dimension); given True");
  const GeluApproximation approx = parse_approximate(c, approximate);
  const FusedVariant variant = parse_variant(c.op, variant_name);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dbias = compute_dbias ? at::empty({x.size(-1)}, x.options()) : at::Tensor();
  if (x.numel() == 0) {
    if (compute_dbias) dbias.zero_();
    return {dx, opt(dbias)};
  }
  const int64_t w = last_width(x);
  const at::Tensor bv = bias ? as_vector(*bias) : at::Tensor();
  Launch launch(x);
  try {
    bias_gelu_backward(rows_view(as_rows(dy, w)), rows_view(as_rows(x, w)), bias ? vector_view(bv) : absent(), approx,
                       rows_view(dx.view({-1, w})), compute_dbias ? vector_view(dbias) : absent(), variant,
                       launch.ctx);
  } catch (const Error& e) {
    rethrow(c.op, e);
  }
  return {dx, opt(dbias)};
}

// ---- SiLU-and-mul -------------------------------------------------------------------------------

// d, the width of the halves [a | b] of x's last dimension.
int64_t half_width(const Checker& c, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, c.prefix("x") + "expected at least 1 dimension (..., 2 * d); given a 0-D tensor");
  TORCH_CHECK_VALUE(x.size(-1) % 2 == 0,
                    c.prefix("x") + "expected an even last dimension (2 * d, the halves [a | b]); given shape " +
                        str(x.sizes()));
  return x.size(-1) / 2;
}

at::Tensor silu_and_mul_fwd(const at::Tensor& x, c10::string_view variant_name) {
  const Checker c{"silu_and_mul_fwd"};
  c.tensor(x, "x");
  const int64_t d = half_width(c, x);
  const FusedVariant variant = parse_variant(c.op, variant_name);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = d;
  at::Tensor y = at::empty(out_shape, x.options());
  if (y.numel() == 0) return y;
  Launch launch(x);
  try {
    silu_and_mul_forward(rows_view(as_rows(x, 2 * d)), rows_view(y.view({-1, d})), variant, launch.ctx);
  } catch (const Error& e) {
    rethrow(c.op, e);
  }
  return y;
}

at::Tensor silu_and_mul_bwd(const at::Tensor& dy, const at::Tensor& x, c10::string_view variant_name) {
  const Checker c{"silu_and_mul_bwd"};
  c.tensor(x, "x");
  const int64_t d = half_width(c, x);
  c.like(dy, "dy", x, "x");
  std::vector<int64_t> dy_shape(x.sizes().begin(), x.sizes().end());
  dy_shape.back() = d;
  TORCH_CHECK_VALUE(dy.sizes() == at::IntArrayRef(dy_shape), c.prefix("dy") + "expected shape " + str(dy_shape) +
                                                                 " (x's with the last dimension halved); given " +
                                                                 str(dy.sizes()));
  const FusedVariant variant = parse_variant(c.op, variant_name);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  if (dx.numel() == 0) return dx;
  Launch launch(x);
  try {
    silu_and_mul_backward(rows_view(as_rows(dy, d)), rows_view(as_rows(x, 2 * d)), rows_view(dx.view({-1, 2 * d})),
                          variant, launch.ctx);
  } catch (const Error& e) {
    rethrow(c.op, e);
  }
  return dx;
}

// ---- queries (no tensors: registered as catch-all kernels) ------------------------------------

std::vector<std::string> fused_variants() {
  std::vector<std::string> names;
  for (FusedVariant v : all_fused_variants()) names.emplace_back(fused_variant_name(v));
  return names;
}

FusedOp parse_op(const std::string& query, c10::string_view name) {
  try {
    return parse_fused_op(std::string_view(name.data(), name.size()));
  } catch (const Error& e) {
    rethrow(query, e);
  }
}

DType query_dtype(const std::string& query, at::ScalarType t) {
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble,
                   "optimized::" + query + ": dtype: expected float32, float16, bfloat16 or float64; given " +
                       dtype_str(t));
  return to_dtype(t);
}

int64_t fused_registers_max_width_op(c10::string_view op, at::ScalarType dtype, bool backward) {
  const std::string q = "fused_registers_max_width";
  const FusedOp fop = parse_op(q, op);
  const DType dt = query_dtype(q, dtype);
  try {
    return fused_registers_max_width(fop, dt, backward);
  } catch (const Error& e) {
    rethrow(q, e);
  }
}

std::string resolve_variant_op(c10::string_view op, at::ScalarType dtype, c10::string_view device,
                                  int64_t width, bool backward) {
  const std::string q = "resolve_fused_variant";
  const FusedOp fop = parse_op(q, op);
  const DType dt = query_dtype(q, dtype);
  const std::string dev(device.data(), device.size());
  const at::Device d(dev);  // throws torch's own error for malformed names
  const Device where = to_device(d, "optimized::" + q + ": device: ");  // a torch fact: cpu or cuda
  try {
    // The width (and what the family takes on the device) is the C++ API's to check.
    return std::string(fused_variant_name(resolve_fused_variant(fop, dt, where, width, backward)));
  } catch (const Error& e) {
    rethrow(q, e);
  }
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
  // normalized and returned as residual_out. mean / rstd: float32, x.shape[:-len(normalized_shape)].
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
