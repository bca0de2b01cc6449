// Public scaled (fp8) GEMM entry (include/optimized/gemm.h): validates the operands and scales,
// builds ScaledGemmParams, picks a variant from the table (scaled_variants.h) and dispatches to the
// CPU backend or a CUDA launcher.
#include <algorithm>
#include <string>

#include "gemm/gemm_operands.h"
#include "gemm/scaled_params.h"
#include "gemm/scaled_variants.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_launch.h"
#include "core/device_facts.h"
#include "core/tensor_map.h"
#include "gemm/gemm_describe.h"
#endif

namespace optimized {

namespace {

using gemm_detail::as_matrix;
using gemm_detail::invalid;
using gemm_detail::Operand;
using gemm_detail::overlaps;
using gemm_detail::shape_string;

constexpr auto kVariantEnums = variant_enums(kScaledGemmVariants);
constexpr const char* kOp = "scaled_matmul";

int64_t blocks128(int64_t x) { return (x + 127) / 128; }

bool is_fp8(DType d) { return d == DType::kF8E4M3 || d == DType::kF8E5M2; }

// The scale tensor of an operand: fp32, contiguous, on the operands' device, with the count its
// layout needs (gemm.h).
const float* checked_scale(const TensorView& s, ScaleLayout layout, int64_t rows, int64_t cols, bool a,
                           Device device) {
  const char* name = a ? "scale_a" : "scale_b";
  if (!s.data) invalid(std::string(name) + ": expected a non-null data pointer; given null");
  if (s.dtype != DType::kF32)
    invalid(std::string(name) + ": expected dtype fp32; given " + std::string(dtype_name(s.dtype)));
  if (!(s.device == device))
    invalid(std::string(name) + ": expected device " + device_name(device) + " (the operands'); given " +
            device_name(s.device));
  if (!s.is_contiguous()) invalid(std::string(name) + ": expected a contiguous tensor; given " + s.describe());
  const int64_t want = scale_count(layout, rows, cols, a);
  if (s.numel() != want) {
    std::string shape;
    switch (layout) {
      case ScaleLayout::kTensor: shape = "1"; break;
      case ScaleLayout::kRowwise: shape = a ? "M = " + std::to_string(rows) : "N = " + std::to_string(cols); break;
      case ScaleLayout::kBlock1x128:
        shape = a ? "(M, ceil(K/128)) = (" + std::to_string(rows) + ", " + std::to_string(blocks128(cols)) + ")"
                  : "(N, ceil(K/128)) = (" + std::to_string(cols) + ", " + std::to_string(blocks128(rows)) + ")";
        break;
      case ScaleLayout::kBlock128x128:
        shape = "(" + std::to_string(blocks128(rows)) + ", " + std::to_string(blocks128(cols)) + ")";
        break;
    }
    invalid(std::string(name) + ": expected " + std::to_string(want) + " scales for layout " +
            std::string(scale_layout_name(layout)) + " (" + shape + "); given " + s.describe());
  }
  if (reinterpret_cast<uintptr_t>(s.data) % 4 != 0) invalid(std::string(name) + ": expected 4-byte aligned data");
  return static_cast<const float*>(s.data);
}

ScaledGemmParams make_params(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& sa,
                             ScaleLayout la, const TensorView& sb, ScaleLayout lb, const TensorView* bias) {
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}})
    if (!is_fp8(t->dtype))
      throw Error(Status::kUnsupported, std::string(name) + ": expected dtype fp8_e4m3 or fp8_e5m2; given " +
                                            std::string(dtype_name(t->dtype)));
  if (a.dtype == DType::kF8E5M2 && b.dtype == DType::kF8E5M2)
    throw Error(Status::kUnsupported,
                "b: expected fp8_e4m3 when a is fp8_e5m2 (e5m2 x e5m2 is not a supported combination, as in "
                "torch._scaled_mm); given fp8_e5m2");
  if (c.dtype != DType::kF32 && c.dtype != DType::kBF16 && c.dtype != DType::kF16)
    throw Error(Status::kUnsupported,
                "c: expected dtype fp32, bf16 or fp16; given " + std::string(dtype_name(c.dtype)));
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}, std::pair{&c, "c"}})
    if (t->rank != 2)
      invalid(std::string(name) + ": expected rank 2 (a scaled matmul takes matrices); given rank " +
              std::to_string(t->rank) + " " + shape_string(*t));
  const Operand A = as_matrix(a, "a"), B = as_matrix(b, "b"), C = as_matrix(c, "c");
  for (const auto& [t, name] : {std::pair{&b, "b"}, std::pair{&c, "c"}})
    if (!(t->device == a.device))
      invalid(std::string(name) + ": expected device " + device_name(a.device) + " (same as a); given " +
              device_name(t->device));
  if (A.cols != B.rows)
    invalid("b: expected " + std::to_string(A.cols) + " rows to match a's columns (K); given shape " +
            shape_string(b) + " with a " + shape_string(a));
  if (C.rows != A.rows || C.cols != B.cols)
    invalid("c: expected (" + std::to_string(A.rows) + ", " + std::to_string(B.cols) +
            ") rows x cols (M from a, N from b); given " + shape_string(c));
  // Row-major C; a single column with unit stride reads as column-major too (gemm_operands.h).
  if (C.col_major && C.cols > 1)
    invalid("c: expected a row-major output (unit stride in the last dimension); given strides of " + c.describe());
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}})
    if (overlaps(c, "c", *t, name))
      invalid(std::string("c: expected an output that does not overlap ") + name + "; given overlapping memory");
  ScaledGemmParams p;
  p.a = a.data;
  p.b = b.data;
  p.c = c.data;
  p.m = A.rows;
  p.n = B.cols;
  p.k = A.cols;
  p.a_row_stride = A.col_major ? 1 : A.ld;
  p.a_col_stride = A.col_major ? A.ld : 1;
  p.b_row_stride = B.col_major ? 1 : B.ld;
  p.b_col_stride = B.col_major ? B.ld : 1;
  p.ldc = C.col_major ? 1 : C.ld;  // one column: its elements are one apart
  p.a_dtype = a.dtype;
  p.b_dtype = b.dtype;
  p.c_dtype = c.dtype;
  p.scale_a = checked_scale(sa, la, p.m, p.k, true, a.device);
  p.scale_b = checked_scale(sb, lb, p.k, p.n, false, a.device);
  p.scale_a_layout = la;
  p.scale_b_layout = lb;
  for (const auto& [t, name] : {std::pair{&sa, "scale_a"}, std::pair{&sb, "scale_b"}})
    if (overlaps(c, "c", *t, name))
      invalid(std::string("c: expected an output that does not overlap ") + name + "; given overlapping memory");
  if (bias) {
    if (!bias->data) invalid("bias: expected a non-null data pointer; given null");
    if (bias->dtype != c.dtype)
      invalid("bias: expected dtype " + std::string(dtype_name(c.dtype)) + " (c's); given " +
              std::string(dtype_name(bias->dtype)));
    if (reinterpret_cast<uintptr_t>(bias->data) % dtype_size(bias->dtype) != 0)
      invalid("bias: expected data aligned to " + std::to_string(dtype_size(bias->dtype)) +
              " bytes (the element size); given address " + std::to_string(reinterpret_cast<uintptr_t>(bias->data)));
    if (!(bias->device == a.device))
      invalid("bias: expected device " + device_name(a.device) + "; given " + device_name(bias->device));
    if (!bias->is_contiguous() || bias->numel() != p.n)
      invalid("bias: expected " + std::to_string(p.n) + " contiguous elements (N); given " + bias->describe());
    if (overlaps(c, "c", *bias, "bias")) invalid("c: expected an output that does not overlap bias; given overlapping memory");
    p.bias = bias->data;
  }
  return p;
}

// make_params with GemmEpilogue's bias (along N), activation and aux, and beta; what else the
// epilogue names is refused.
ScaledGemmParams make_params(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& sa,
                             ScaleLayout la, const TensorView& sb, ScaleLayout lb, const GemmEpilogue& e, float beta) {
  if (e.bias_along_m || e.activation_grad || e.residual || e.column_sums)
    throw Error(Status::kUnsupported,
                "epilogue: scaled_matmul takes a bias along N, an activation and aux; given " +
                    std::string(e.bias_along_m ? "bias_along_m" : e.activation_grad ? "activation_grad"
                                                              : e.residual          ? "residual"
                                                                                    : "column_sums"));
  if (static_cast<unsigned>(e.activation) > static_cast<unsigned>(Activation::kSilu))
    invalid("activation: expected one of none, relu, gelu, gelu_tanh, silu; given value " +
            std::to_string(static_cast<unsigned>(e.activation)));
  if (!(beta == beta)) invalid("beta: expected a number; given NaN");
  ScaledGemmParams p = make_params(a, b, c, sa, la, sb, lb, e.bias);
  p.activation = static_cast<int>(e.activation);
  p.beta = beta;
  if (e.aux) {
    const TensorView& x = *e.aux;
    if (!x.data) invalid("aux: expected a non-null data pointer; given null");
    if (x.dtype != c.dtype)
      invalid("aux: expected dtype " + std::string(dtype_name(c.dtype)) + " (c's); given " +
              std::string(dtype_name(x.dtype)));
    if (!(x.device == a.device))
      invalid("aux: expected device " + device_name(a.device) + "; given " + device_name(x.device));
    if (x.rank != 2 || x.shape[0] != p.m || x.shape[1] != p.n)
      invalid("aux: expected shape (" + std::to_string(p.m) + ", " + std::to_string(p.n) + ") (c's); given " +
              shape_string(x));
    const Operand X = as_matrix(x, "aux");
    if (X.col_major && X.cols > 1)
      invalid("aux: expected a row-major view (unit stride in the last dimension); given " + x.describe());
    if (reinterpret_cast<uintptr_t>(x.data) % dtype_size(x.dtype) != 0)
      invalid("aux: expected data aligned to " + std::to_string(dtype_size(x.dtype)) + " bytes (the element size)");
    for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}, std::pair{&c, "c"}, std::pair{&sa, "scale_a"},
                                  std::pair{&sb, "scale_b"}})
      if (overlaps(x, "aux", *t, name))
        invalid(std::string("aux: expected an output that does not overlap ") + name + "; given overlapping memory");
    if (e.bias && overlaps(x, "aux", *e.bias, "bias"))
      invalid("aux: expected an output that does not overlap bias; given overlapping memory");
    p.aux = x.data;
    p.ld_aux = X.col_major ? 1 : X.ld;
  }
  return p;
}

#if OPTIMIZED_WITH_CUDA && OPTIMIZED_WITH_SM90A
// Empty when wgmma_fp8 can run p (with K-major copies of A or B made in its workspace when they
// are not K-major); otherwise why not, naming the argument.
std::string wgmma_fp8_rejects(const ScaledGemmParams& p) {
  if (p.scale_b_layout == ScaleLayout::kBlock1x128)
    return "scale_b: wgmma_fp8 takes B's scales per tensor, per column or per 128x128 block; given block_1x128 "
           "(the naive rung takes it)";
  if (p.m >= (int64_t(1) << 31) || p.n >= (int64_t(1) << 31) || p.k >= (int64_t(1) << 31))
    return "a: expected M, N and K below 2^31 for TMA";
  return "";
}
#endif

ScaledGemmVariant auto_variant(const ScaledGemmParams& p, Device device) {
  if (!device.is_cuda()) return ScaledGemmVariant::kCpu;
#if OPTIMIZED_WITH_CUDA && OPTIMIZED_WITH_SM90A
  const DeviceFacts* facts = nullptr;
  if (device_facts(device.index, &facts) == cudaSuccess && facts->compute_capability == 90 &&
      wgmma_fp8_rejects(p).empty())
    return ScaledGemmVariant::kCudaWgmmaFp8;
#else
  (void)p;
#endif
  return ScaledGemmVariant::kCudaNaive;
}

ScaledGemmVariant checked_variant(ScaledGemmVariant variant, const ScaledGemmParams& p, Device device) {
  if (variant == ScaledGemmVariant::kAuto) return auto_variant(p, device);
  if (std::string why = variant_rejects_device(variant_row(kScaledGemmVariants, variant), device); !why.empty())
    invalid(why);
#if OPTIMIZED_WITH_CUDA && OPTIMIZED_WITH_SM90A
  if (variant == ScaledGemmVariant::kCudaWgmmaFp8)
    if (std::string why = wgmma_fp8_rejects(p); !why.empty()) throw Error(Status::kUnsupported, why);
#endif
  return variant;
}

}  // namespace

std::string_view scale_layout_name(ScaleLayout layout) {
  switch (layout) {
    case ScaleLayout::kTensor: return "tensor";
    case ScaleLayout::kRowwise: return "rowwise";
    case ScaleLayout::kBlock1x128: return "block_1x128";
    case ScaleLayout::kBlock128x128: return "block_128x128";
  }
  return "unknown";
}

ScaleLayout parse_scale_layout(std::string_view name) {
  for (ScaleLayout l : {ScaleLayout::kTensor, ScaleLayout::kRowwise, ScaleLayout::kBlock1x128, ScaleLayout::kBlock128x128})
    if (scale_layout_name(l) == name) return l;
  throw Error(Status::kInvalidArgument, "scale layout: expected one of tensor, rowwise, block_1x128, block_128x128; given '" +
                                            std::string(name) + "'");
}

int64_t scale_count(ScaleLayout layout, int64_t rows, int64_t cols, bool a) {
  // A: rows = M, cols = K; B: rows = K, cols = N.
  const int64_t outer = a ? rows : cols, k = a ? cols : rows;
  switch (layout) {
    case ScaleLayout::kTensor: return 1;
    case ScaleLayout::kRowwise: return outer;
    case ScaleLayout::kBlock1x128: return outer * blocks128(k);
    case ScaleLayout::kBlock128x128: return blocks128(rows) * blocks128(cols);
  }
  return 0;
}

std::string_view scaled_gemm_variant_name(ScaledGemmVariant variant) {
  return variant_name(kScaledGemmVariants, variant);
}
ScaledGemmVariant parse_scaled_gemm_variant(std::string_view name) {
  return parse_variant(kScaledGemmVariants, name, ScaledGemmVariant::kAuto);
}
std::span<const ScaledGemmVariant> all_scaled_gemm_variants() { return kVariantEnums; }
bool scaled_gemm_variant_is_cuda(ScaledGemmVariant variant) { return variant_is_cuda(kScaledGemmVariants, variant); }
std::string scaled_gemm_variant_rejects_dtype(ScaledGemmVariant variant, DType dtype) {
  return variant_or_auto_rejects_dtype(kScaledGemmVariants, variant, dtype, kOp);
}

ScaledGemmVariant resolve_scaled_gemm_variant(const TensorView& a, const TensorView& b, const TensorView& c) {
  // What auto picks depends on the device and the sizes, not on the scales' values; B's 1x128
  // block scales (which wgmma_fp8 refuses) are resolved in scaled_matmul itself.
  const Operand A = as_matrix(a, "a"), B = as_matrix(b, "b");
  as_matrix(c, "c");
  const float one = 1.0f;
  ScaledGemmParams p;
  p.m = A.rows, p.n = B.cols, p.k = A.cols;
  p.scale_a = p.scale_b = &one;
  return auto_variant(p, a.device);
}

size_t scaled_matmul_workspace_bytes(int64_t m, int64_t n, int64_t k, Device device, bool a_k_major, bool b_k_major,
                                     ScaledGemmVariant variant) {
  for (const auto& [value, name] : {std::pair{m, "m"}, std::pair{n, "n"}, std::pair{k, "k"}})
    if (value < 1) invalid(std::string(name) + ": expected >= 1; given " + std::to_string(value));
  if (!device.is_cuda()) return 0;
  ScaledGemmParams p;
  p.m = m, p.n = n, p.k = k;
  p.a_row_stride = a_k_major ? k : 1, p.a_col_stride = a_k_major ? 1 : m;
  p.b_row_stride = b_k_major ? 1 : n, p.b_col_stride = b_k_major ? k : 1;
  const ScaledGemmVariant v = variant == ScaledGemmVariant::kAuto ? auto_variant(p, device) : variant;
  const ScaledGemmVariantInfo& row = variant_row(kScaledGemmVariants, v);
  if (row.backend == Backend::kCpu) return 0;
#if OPTIMIZED_WITH_CUDA
  return launcher_workspace_bytes(row, p, std::string(kOp) + " (" + std::string(row.name) + ")");
#else
  return 0;
#endif
}

size_t scaled_matmul_workspace_bytes(const TensorView& a, const TensorView& b, const TensorView& c,
                                     const TensorView& scale_a, ScaleLayout scale_a_layout, const TensorView& scale_b,
                                     ScaleLayout scale_b_layout, const TensorView* bias, ScaledGemmVariant variant) {
  const ScaledGemmParams p = make_params(a, b, c, scale_a, scale_a_layout, scale_b, scale_b_layout, bias);
  const ScaledGemmVariantInfo& row = variant_row(kScaledGemmVariants, checked_variant(variant, p, a.device));
  if (row.backend == Backend::kCpu) return 0;
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(a.device.index);
  return launcher_workspace_bytes(row, p, std::string(kOp) + " (" + std::string(row.name) + ")");
#else
  return 0;
#endif
}

void scaled_matmul(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& scale_a,
                   ScaleLayout scale_a_layout, const TensorView& scale_b, ScaleLayout scale_b_layout,
                   const TensorView* bias, ScaledGemmVariant variant, const ExecutionContext& ctx) {
  GemmEpilogue e;
  e.bias = bias;
  scaled_matmul(a, b, c, scale_a, scale_a_layout, scale_b, scale_b_layout, e, 0.0f, variant, ctx);
}

void scaled_matmul(const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& scale_a,
                   ScaleLayout scale_a_layout, const TensorView& scale_b, ScaleLayout scale_b_layout,
                   const GemmEpilogue& epilogue, float beta, ScaledGemmVariant variant, const ExecutionContext& ctx) {
  const ScaledGemmParams p =
      make_params(a, b, c, scale_a, scale_a_layout, scale_b, scale_b_layout, epilogue, beta);
  const ScaledGemmVariantInfo& row = variant_row(kScaledGemmVariants, checked_variant(variant, p, a.device));
  if (row.backend == Backend::kCpu) {
    row.cpu(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  static const std::string no_cuda = cuda_unavailable_reason();
  if (!no_cuda.empty()) throw Error(Status::kUnsupported, "a: CUDA tensors given but " + no_cuda);
  launch_on_cuda(row, p, a.device.index, ctx, std::string(kOp) + " (" + std::string(row.name) + ")");
#else
  throw Error(Status::kUnsupported, "a: CUDA tensors given but this build is CPU-only (built without CUDA)");
#endif
}

#if OPTIMIZED_WITH_CUDA
cuda::KernelResources describe_scaled_gemm_kernel(const TensorView& a, const TensorView& b, const TensorView& c,
                                                  const TensorView& scale_a, ScaleLayout scale_a_layout,
                                                  const TensorView& scale_b, ScaleLayout scale_b_layout,
                                                  const TensorView* bias, ScaledGemmVariant variant) {
  const ScaledGemmParams p = make_params(a, b, c, scale_a, scale_a_layout, scale_b, scale_b_layout, bias);
  const ScaledGemmVariantInfo& row = variant_row(kScaledGemmVariants, checked_variant(variant, p, a.device));
  if (row.backend != Backend::kCuda || !row.resources)
    invalid("variant: " + std::string(row.name) + " has no CUDA kernel to describe");
  cuda::KernelResources out;
  DeviceGuard guard(a.device.index);
  check_cuda(row.resources(p, &out), "describe_scaled_gemm_kernel (" + std::string(row.name) + ")");
  return out;
}
#endif

}  // namespace optimized
