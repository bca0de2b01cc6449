// The torch glue: the only code in optimized-ops that includes torch.
//
//   TORCH_LIBRARY(optimized, m)            the schemas of torch.ops.optimized.*
//   TORCH_LIBRARY_IMPL(optimized, CPU|CUDA) kernels that check their inputs (messages name the
//                                           argument), allocate the output with torch (so CUDA
//                                           memory comes from the caching allocator and graph
//                                           capture works), and call the torch-free C++ API on
//                                           TensorViews, on the current stream of the device.
//
// Autograd and the fake (meta) kernels are registered from Python (python/optimized_ops), through
// torch.library.register_autograd and torch.library.register_fake.
//
// The current CUDA stream is read through c10's device-generic stream API (which, in a CUDA build
// of torch, is at::cuda::getCurrentCUDAStream), so this file needs neither the CUDA headers nor
// libtorch_cuda, and one build serves CPU-only and CUDA builds of torch alike.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <string>

#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized::torch_glue {

namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kDouble: return DType::kF64;
    default: break;
  }
  TORCH_CHECK_TYPE(false, std::string("unreachable: dtype ") + c10::toString(t) + " was not checked");
}

// "float32", "bfloat16": the names Python users know (torch.float32), not c10's "Float".
std::string dtype_str(at::ScalarType t) { return c10::getDtypeNames(t).first; }

// Messages are built as one std::string here (numbers through std::to_string) rather than by
// streaming integers through c10::str: on the GPU machine's toolchain, a TORCH_CHECK message that
// streamed an int64 or a size list segfaulted while the error was raised.
std::string str(int64_t v) { return std::to_string(v); }
std::string str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

Device to_device(const at::Device& d) {
  if (d.is_cuda()) return Device::cuda(d.index() < 0 ? 0 : d.index());
  return Device::cpu();
}

// The view of a 2-D or 3-D tensor that the C++ API takes, or nothing when the tensor's layout does
// not qualify (the last dimension must have unit stride, rows must be at least a row apart).
// Strides of size-1 dimensions carry no information; they are normalized so that layouts torch
// considers contiguous always qualify.
bool qualifies(const at::Tensor& t) {
  const int64_t r = t.dim();
  const int64_t rows = t.size(r - 2), cols = t.size(r - 1);
  if (cols > 1 && t.stride(r - 1) != 1) return false;
  if (rows > 1 && t.stride(r - 2) < cols) return false;
  return true;
}

TensorView view_of(const at::Tensor& t) {
  const int r = static_cast<int>(t.dim());
  const int64_t rows = t.size(r - 2), cols = t.size(r - 1);
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type());
  v.device = to_device(t.device());
  v.rank = r;
  for (int i = 0; i < r; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  v.strides[r - 1] = 1;                                   // unit (or, for one column, meaningless)
  if (rows == 1) v.strides[r - 2] = cols;                 // one row: its stride is never used
  if (r == 3 && t.size(0) == 1) v.strides[0] = 0;         // one batch: its stride is never used
  return v;
}

// Raises the torch error that matches the C++ status: ValueError for invalid arguments,
// NotImplementedError for valid inputs this variant or build cannot take, RuntimeError otherwise.
[[noreturn]] void rethrow(const Error& e) {
  switch (e.status()) {
    case Status::kInvalidArgument: TORCH_CHECK_VALUE(false, std::string("optimized::matmul: ") + e.what());
    case Status::kUnsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, std::string("optimized::matmul: ") + e.what());
    default: break;
  }
  TORCH_CHECK(false, "optimized::matmul (" + std::string(status_name(e.status())) + "): " + e.what());
}

void check_operand(const at::Tensor& t, const char* name, const char* shape2, const char* shape3) {
  TORCH_CHECK_VALUE(t.defined(), std::string("optimized::matmul: ") + name + ": expected a tensor; given an undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, std::string("optimized::matmul: ") + name +
                                                    ": expected a strided (dense) tensor; given a non-strided layout");
  TORCH_CHECK_VALUE(t.dim() == 2 || t.dim() == 3,
                    std::string("optimized::matmul: ") + name + ": expected a 2-D " + shape2 + " or 3-D " + shape3 +
                        " tensor; given " + str(t.dim()) + "-D of shape " + str(t.sizes()));
  const auto st = t.scalar_type();
  // float64 runs on the plain CPU rungs only (the C++ API says so for other variants and CUDA).
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || st == at::kDouble,
                   std::string("optimized::matmul: ") + name +
                       ": expected dtype float32, float16, bfloat16 or float64; given " + dtype_str(st));
}

}  // namespace

// out = a @ b. a: (M, K) or (Ba, M, K); b: (K, N) or (Bb, K, N); out: (M, N) when both are 2-D,
// else (B, M, N) with B = Ba, or Bb when Ba is 1: a batch of 1 (or a 2-D operand) is broadcast.
at::Tensor matmul(const at::Tensor& a, const at::Tensor& b, c10::string_view variant_name) {
  check_operand(a, "a", "(M, K)", "(batch, M, K)");
  check_operand(b, "b", "(K, N)", "(batch, K, N)");
  TORCH_CHECK_TYPE(b.scalar_type() == a.scalar_type(), "optimized::matmul: b: expected dtype " +
                                                           dtype_str(a.scalar_type()) + " (same as a); given " +
                                                           dtype_str(b.scalar_type()));
  TORCH_CHECK_VALUE(b.device() == a.device(), "optimized::matmul: b: expected device " + a.device().str() +
                                                   " (same as a); given " + b.device().str());
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  TORCH_CHECK_VALUE(b.size(-2) == k, "optimized::matmul: b: expected " + str(k) +
                                         " rows to match a's columns (K); given shape " + str(b.sizes()) +
                                         " with a of shape " + str(a.sizes()));
  const int64_t batch_a = a.dim() == 3 ? a.size(0) : 1, batch_b = b.dim() == 3 ? b.size(0) : 1;
  TORCH_CHECK_VALUE(batch_a == batch_b || batch_a == 1 || batch_b == 1,
                    "optimized::matmul: b: expected batch " + str(batch_a) + " (a's) or 1; given batch " +
                        str(batch_b) + " (shape " + str(b.sizes()) + ")");
  GemmVariant variant = GemmVariant::kAuto;
  try {
    variant = parse_gemm_variant(std::string_view(variant_name.data(), variant_name.size()));
  } catch (const Error& e) {
    rethrow(e);
  }

  const bool batched = a.dim() == 3 || b.dim() == 3;
  const int64_t batch = batch_a == 1 ? batch_b : batch_a;  // broadcast a batch of 1 (also over 0)
  at::Tensor out = batched ? at::empty({batch, m, n}, a.options()) : at::empty({m, n}, a.options());
  if (out.numel() == 0) return out;
  if (k == 0) return out.zero_();  // an empty sum; the C++ API takes dimensions >= 1 only

  // The C++ API takes unit-stride rows with a leading dimension >= the width: strided views that
  // qualify go through as they are, others (transposed, expanded rows) are copied first.
  const at::Tensor a_in = qualifies(a) ? a : a.contiguous();
  const at::Tensor b_in = qualifies(b) ? b : b.contiguous();

  ExecutionContext ctx;
  c10::OptionalDeviceGuard guard;
  if (a.is_cuda()) {
    guard.reset_device(a.device());
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(a.device());
    ctx.cuda_stream = stream.native_handle();
  }
  try {
    optimized::matmul(view_of(a_in), view_of(b_in), view_of(out), 1.0f, 0.0f, variant, ctx);
  } catch (const Error& e) {
    rethrow(e);
  }
  return out;
}

}  // namespace optimized::torch_glue

TORCH_LIBRARY(optimized, m) {
  m.def(
      "matmul(Tensor a, Tensor b, *, str variant='auto') -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(optimized, CPU, m) { m.impl("matmul", &optimized::torch_glue::matmul); }

TORCH_LIBRARY_IMPL(optimized, CUDA, m) { m.impl("matmul", &optimized::torch_glue::matmul); }
