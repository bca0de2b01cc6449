// The torch glue of the scaled (fp8) GEMM (include/optimized/gemm.h, "Scaled (fp8) GEMM"):
//
//   TORCH_LIBRARY_FRAGMENT(optimized, m)    the schemas of torch.ops.optimized.scaled_mm and
//                                           scaled_gemm_variants (TORCH_LIBRARY(optimized) is
//                                           gemm_ops.cpp's)
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) the kernel: torch._scaled_mm's arguments on top of the C++
//                                           API's scaled_matmul; the output (and, on CUDA, the
//                                           workspace) from torch's caching allocator; the current
//                                           stream of the device, under a device guard.
//
//   out (M, N) = (scale_a . a) @ (scale_b . b) + bias    a (M, K), b (K, N) fp8; out of out_dtype
//
// Scale layouts: 'auto' reads the layout from the shape of the scale tensor (infer_layout below:
// torch._scaled_mm's tensor-wise and row-wise shapes, and DeepSeek-V3's 1x128 / 128x128 block
// shapes); an explicit name (tensor, rowwise, block_1x128, block_128x128) overrides it, and the C++
// API then checks the scale count. Scales and bias are made contiguous (copied if needed); a and b
// go to the C++ API with their strides when they are row- or column-major matrices (b = w.t(), the
// torch._scaled_mm convention, is column-major), otherwise as contiguous copies.
//
// Checks (see common.h for who checks what): the glue checks the torch facts (defined, strided
// tensors; 2-D operands; K, which the zero-size shortcuts need; out_dtype, which it allocates; the
// layout names and the inference). Dtypes of a, b, scales and bias, devices, scale counts and
// variants are the C++ API's, and its messages arrive prefixed "optimized::scaled_mm: ".
//
// No autograd: the package registers a backward that raises (python/optimized_ops/gemm/_autograd.py),
// and the fake (meta) kernel (python/optimized_ops/gemm/_fakes.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized::torch_glue {

namespace {

constexpr const char* kOp = "scaled_mm";
constexpr std::array<ScaleLayout, 4> kLayouts = {ScaleLayout::kTensor, ScaleLayout::kRowwise,
                                                 ScaleLayout::kBlock1x128, ScaleLayout::kBlock128x128};

int64_t blocks128(int64_t x) { return (x + 127) / 128; }

std::string shape_str(std::initializer_list<int64_t> dims) { return str(at::IntArrayRef(dims)); }

// Whether the C++ API takes the 2-D t as it is (common.h).
bool row_major(const at::Tensor& t) { return row_major_strides(t.size(0), t.size(1), t.stride(0), t.stride(1)); }
bool column_major(const at::Tensor& t) {
  return column_major_strides(t.size(0), t.size(1), t.stride(0), t.stride(1));
}

// The layout `name` names ("auto": nullopt, inferred from the scale's shape).
std::optional<ScaleLayout> layout_named(c10::string_view name, const char* arg) {
  const std::string_view n(name.data(), name.size());
  if (n == "auto") return std::nullopt;
  for (ScaleLayout l : kLayouts)
    if (scale_layout_name(l) == n) return l;
  TORCH_CHECK_VALUE(false, arg_prefix(kOp, arg) +
                               "expected one of auto, tensor, rowwise, block_1x128, block_128x128; given '" +
                               std::string(n) + "'");
}

// The layout of a scale tensor read from its shape (a: scale_a of the (M, K) operand; else scale_b
// of the (K, N) one):
//   one element                                  tensor
//   A (M, 1) or (M);  B (1, N) or (N)            rowwise (and B (N, 1) when K <= 128: the same
//                                                scales as block_1x128 then, and the Hopper rung
//                                                takes them as rowwise)
//   A (M, ceil(K/128));  B (N, ceil(K/128))      block_1x128 (before block_128x128 when both match)
//   A (ceil(M/128), ceil(K/128));  B (ceil(K/128), ceil(N/128))   block_128x128
// Anything else: ValueError naming the argument and listing the shapes it takes.
ScaleLayout infer_layout(const at::Tensor& s, bool a, int64_t m, int64_t n, int64_t k) {
  if (s.numel() == 1) return ScaleLayout::kTensor;
  const at::IntArrayRef shape = s.sizes();
  const auto is = [&](std::initializer_list<int64_t> dims) { return shape.equals(at::IntArrayRef(dims)); };
  const int64_t kb = blocks128(k), outer = a ? m : n;
  if (a) {
    if (is({m, 1}) || is({m})) return ScaleLayout::kRowwise;
    if (is({m, kb})) return ScaleLayout::kBlock1x128;
    if (is({blocks128(m), kb})) return ScaleLayout::kBlock128x128;
  } else {
    if (is({1, n}) || is({n}) || (kb == 1 && is({n, 1}))) return ScaleLayout::kRowwise;
    if (is({kb, blocks128(n)})) return ScaleLayout::kBlock128x128;
    if (is({n, kb})) return ScaleLayout::kBlock1x128;
  }
  const char* arg = a ? "scale_a" : "scale_b";
  const std::string rowwise = a ? "(M, 1) = " + shape_str({m, 1}) + " or (M,) = " + shape_str({m})
                                : "(1, N) = " + shape_str({1, n}) + " or (N,) = " + shape_str({n});
  const std::string block1 = std::string(a ? "(M, ceil(K/128))" : "(N, ceil(K/128))") + " = " + shape_str({outer, kb});
  const std::string block128 = a ? "(ceil(M/128), ceil(K/128)) = " + shape_str({blocks128(m), kb})
                                 : "(ceil(K/128), ceil(N/128)) = " + shape_str({kb, blocks128(n)});
  TORCH_CHECK_VALUE(false, arg_prefix(kOp, arg) + "expected a shape that names a scale layout (M = " + str(m) +
                               ", K = " + str(k) + ", N = " + str(n) + "): one element (tensor), " + rowwise +
                               " (rowwise), " + block1 + " (block_1x128), " + block128 +
                               " (block_128x128), or pass " + arg + "_layout; given shape " + str(shape));
}

}  // namespace

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                     const std::optional<at::Tensor>& bias_opt, std::optional<at::ScalarType> out_dtype,
                     c10::string_view scale_a_layout, c10::string_view scale_b_layout, c10::string_view variant_name) {
  check_tensor(a, kOp, "a");
  check_tensor(b, kOp, "b");
  check_tensor(scale_a, kOp, "scale_a");
  check_tensor(scale_b, kOp, "scale_b");
  const bool has_bias = bias_opt.has_value() && bias_opt->defined();
  if (has_bias) check_tensor(*bias_opt, kOp, "bias");
  TORCH_CHECK_VALUE(a.dim() == 2, arg_prefix(kOp, "a") + "expected a 2-D tensor (M, K); given shape " + str(a.sizes()));
  TORCH_CHECK_VALUE(b.dim() == 2, arg_prefix(kOp, "b") + "expected a 2-D tensor (K, N); given shape " + str(b.sizes()));
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TORCH_CHECK_VALUE(b.size(0) == k, arg_prefix(kOp, "b") + "expected " + str(k) +
                                        " rows to match a's columns (K); given shape " + str(b.sizes()) +
                                        " with a of shape " + str(a.sizes()));
  const at::ScalarType out_type = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK_NOT_IMPLEMENTED(out_type == at::kFloat || out_type == at::kHalf || out_type == at::kBFloat16,
                              arg_prefix(kOp, "out_dtype") + "expected float32, float16 or bfloat16; given " +
                                  dtype_str(out_type));
  const std::string where = op_name(kOp);
  const ScaledGemmVariant variant = call_api(where, [&] {
    return parse_scaled_gemm_variant(std::string_view(variant_name.data(), variant_name.size()));
  });
  const std::optional<ScaleLayout> named_a = layout_named(scale_a_layout, "scale_a_layout");
  const std::optional<ScaleLayout> named_b = layout_named(scale_b_layout, "scale_b_layout");
  const ScaleLayout la = named_a ? *named_a : infer_layout(scale_a, true, m, n, k);
  const ScaleLayout lb = named_b ? *named_b : infer_layout(scale_b, false, m, n, k);

  at::Tensor out = at::empty({m, n}, a.options().dtype(out_type));
  if (out.numel() == 0) return out;
  // The C++ API takes dimensions >= 1 only: an empty sum (K = 0) is the glue's: the bias alone.
  if (k == 0) {
    out.zero_();
    if (has_bias) {
      TORCH_CHECK_VALUE(bias_opt->scalar_type() == out_type && bias_opt->numel() == n,
                        arg_prefix(kOp, "bias") + "expected " + str(n) + " elements (N) of dtype " +
                            dtype_str(out_type) + " (out_dtype); given shape " + str(bias_opt->sizes()) +
                            " of dtype " + dtype_str(bias_opt->scalar_type()));
      out.add_(bias_opt->reshape({1, n}));
    }
    return out;
  }

  // Operands that are neither row- nor column-major (expanded rows, other strides) are copied.
  const at::Tensor av = row_major(a) || column_major(a) ? a : a.contiguous();
  const at::Tensor bv = row_major(b) || column_major(b) ? b : b.contiguous();
  const at::Tensor sa = scale_a.contiguous(), sb = scale_b.contiguous();
  const at::Tensor bias = has_bias ? bias_opt->contiguous() : at::Tensor();

  Launch launch(a.device());
  call_api(where, [&] {
    // In order (std::array{...} evaluates left to right): a dtype without a C++ type is a's first.
    const auto [va, vb, vc, vsa, vsb] = std::array{view_of(av, kOp, "a"), view_of(bv, kOp, "b"),
                                                   view_of(out, kOp, "out"), view_of(sa, kOp, "scale_a"),
                                                   view_of(sb, kOp, "scale_b")};
    TensorView vbias;
    if (has_bias) vbias = view_of(bias, kOp, "bias");
    const TensorView* pbias = has_bias ? &vbias : nullptr;
    // The Hopper rung's K-major copies, from torch's caching allocator (the C++ API says how much).
    if (a.is_cuda())
      launch.provide_workspace(optimized::scaled_matmul_workspace_bytes(va, vb, vc, vsa, la, vsb, lb, pbias, variant));
    optimized::scaled_matmul(va, vb, vc, vsa, la, vsb, lb, pbias, variant, launch.ctx);
  });
  return out;
}

// The scaled ladder (naive to best, "auto" excluded), from the C++ API's table.
std::vector<std::string> scaled_gemm_variants() {
  return variant_names(all_scaled_gemm_variants(), scaled_gemm_variant_name);
}

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  m.def(
      "scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, *, Tensor? bias=None, "
      "ScalarType? out_dtype=None, str scale_a_layout='auto', str scale_b_layout='auto', str variant='auto') "
      "-> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def("scaled_gemm_variants() -> str[]", &optimized::torch_glue::scaled_gemm_variants);
}

TORCH_LIBRARY_IMPL(optimized, CPU, m) { m.impl("scaled_mm", &optimized::torch_glue::scaled_mm); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { m.impl("scaled_mm", &optimized::torch_glue::scaled_mm); }
