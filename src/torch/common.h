// What every torch glue file (<family>_ops.cpp) shares: messages, the translation of the C++ API's
// errors into torch's exceptions, torch dtypes and devices as the C++ API's, the current stream under
// a device guard, and N-D tensors as the (rows, width) views the row-wise ops take.
//
// Who checks what. The C++ API (include/optimized/*.h) owns every semantic check -- shapes of its
// views, dtypes, devices, variants, aliasing, scalar ranges -- with messages that name the argument.
// The glue checks torch facts only: a defined, strided tensor; a torch dtype or device type the C++
// API has a counterpart for; the N-D shape relations that the views it passes no longer show
// (torch.matmul's broadcasting, x ending in normalized_shape, dy of y's shape, ...); whatever it
// needs to allocate the outputs. It prefixes the op's name ("optimized::<op>: ") to the C++ API's
// messages, so that every message reads "optimized::<op>: <argument>: expected ...; given ...".
//
// Messages are built as one std::string here (numbers through std::to_string) rather than by
// streaming integers through c10::str: on the GPU machine's toolchain (g++ 13), a TORCH_CHECK
// message that streamed an int64 or a size list segfaulted while the error was raised.
//
// The current CUDA stream is read through c10's device-generic stream API (which, in a CUDA build of
// torch, is at::cuda::getCurrentCUDAStream), so the glue needs neither the CUDA headers nor
// libtorch_cuda, and one build serves CPU-only and CUDA builds of torch alike.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorUtils.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "optimized/core.h"

namespace optimized::torch_glue {

// ---- messages ---------------------------------------------------------------------------------

inline std::string str(int64_t v) { return std::to_string(v); }
inline std::string str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

// "float32", "bfloat16": the names Python users know (torch.float32), not c10's "Float".
inline std::string dtype_str(at::ScalarType t) { return c10::getDtypeNames(t).first; }

// Whether a (rows, cols) matrix with strides (rs, cs) is one the C++ GEMM APIs take as it is:
// row-major (unit stride along a row unless one column, rows at least a row apart unless one row)
// or column-major (the same with rows and columns swapped). Strides of size-1 dimensions carry no
// information.
inline bool row_major_strides(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  return (cols == 1 || cs == 1) && (rows == 1 || rs >= cols);
}
inline bool column_major_strides(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  return (rows == 1 || rs == 1) && (cols == 1 || cs >= rows);
}

// "optimized::<op>": where a message comes from.
inline std::string op_name(std::string_view op) { return "optimized::" + std::string(op); }

// "optimized::<op>: <arg>: ", the start of a message about one argument.
inline std::string arg_prefix(std::string_view op, std::string_view arg) {
  return op_name(op) + ": " + std::string(arg) + ": ";
}

// ---- errors -----------------------------------------------------------------------------------

// Raises the torch error that matches the C++ status: ValueError for invalid arguments,
// NotImplementedError for valid inputs this variant or build cannot take, RuntimeError otherwise
// (with the status). `where` ("optimized::matmul") prefixes the message; empty: the message as is.
[[noreturn]] inline void rethrow(const std::string& where, const Error& e) {
  const std::string text = where.empty() ? std::string(e.what()) : where + ": " + e.what();
  switch (e.status()) {
    case Status::kInvalidArgument: TORCH_CHECK_VALUE(false, text);
    case Status::kUnsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, text);
    default: break;
  }
  TORCH_CHECK(false, text + " (" + std::string(status_name(e.status())) + ")");
}

// f() with the C++ API's errors raised as torch's (rethrow).
template <class F>
decltype(auto) call_api(const std::string& where, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const Error& e) {
    rethrow(where, e);
  }
}

// ---- tensors, dtypes, devices -------------------------------------------------------------------

// A defined, strided (dense) tensor: what the glue can turn into a TensorView.
inline void check_tensor(const at::Tensor& t, std::string_view op, std::string_view arg) {
  TORCH_CHECK_VALUE(t.defined(), arg_prefix(op, arg) + "expected a tensor; given an undefined tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided,
                    arg_prefix(op, arg) + "expected a strided (dense) tensor; given a non-strided layout");
}

// The C++ dtype of a torch dtype. Which dtypes an op takes is the C++ API's to say; a torch dtype
// that has no C++ counterpart at all (bool, int8, complex, ...) is refused here, as the C++ API
// refuses the dtypes it has but an op does not take (NotImplementedError). `prefix`: "optimized::<op>:
// <arg>: ".
inline DType to_dtype(at::ScalarType t, const std::string& prefix) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kDouble: return DType::kF64;
    case c10::ScalarType::Float8_e4m3fn: return DType::kF8E4M3;
    case c10::ScalarType::Float8_e5m2: return DType::kF8E5M2;
    case at::kInt: return DType::kI32;
    case at::kLong: return DType::kI64;
    case at::kBool: return DType::kBool;
    default: break;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, prefix +
                                         "expected a dtype of the library (float32, float16, bfloat16, float64, "
                                         "float8_e4m3fn, float8_e5m2, int32, int64, bool); given " + dtype_str(t));
}

// The C++ device of a torch device: cpu or cuda (an index of -1, "cuda", is device 0). Any other
// type (meta, xpu, ...) is refused with a ValueError that starts with `prefix`. Tensors of other
// types reach the kernels only beside a CPU or CUDA tensor (only those dispatch keys are
// registered); a device named by a query can be anything.
inline Device to_device(const at::Device& d, const std::string& prefix) {
  if (d.is_cuda()) return Device::cuda(d.index() < 0 ? 0 : d.index());
  TORCH_CHECK_VALUE(d.is_cpu(), prefix + "expected a cpu or cuda device; given " + d.str());
  return Device::cpu();
}

// The C++ view of a tensor as it is: its data, dtype, device, sizes and strides (rank <= 6).
inline TensorView view_of(const at::Tensor& t, std::string_view op, std::string_view arg) {
  const std::string prefix = arg_prefix(op, arg);
  TORCH_CHECK_VALUE(t.dim() <= TensorView::kMaxRank, prefix + "expected at most " + str(TensorView::kMaxRank) +
                                                         " dimensions; given " + str(t.dim()));
  TensorView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type(), prefix);
  v.device = to_device(t.device(), prefix);
  v.rank = static_cast<int>(t.dim());
  for (int i = 0; i < v.rank; ++i) {
    v.shape[i] = t.size(i);
    v.strides[i] = t.stride(i);
  }
  return v;
}

// ---- N-D tensors as rows ------------------------------------------------------------------------

// t as a (rows, width) tensor, rows = numel / width (width > 0): a view of t when its strides allow
// one with unit stride along the width and rows at least a row apart (slices such as x[..., :k] of a
// wider tensor, x[::2]), else a view of a contiguous copy (transposes, expanded rows). No rows: a
// fresh empty (0, width) tensor (torch calls any empty tensor contiguous, whatever its strides).
inline at::Tensor as_rows(const at::Tensor& t, int64_t width) {
  const int64_t rows = t.numel() / width;
  if (rows == 0) return at::empty({0, width}, t.options());
  const std::vector<int64_t> shape{rows, width};
  if (at::detail::computeStride(t.sizes(), t.strides(), shape).has_value()) {
    at::Tensor v = t.view(shape);
    if ((width == 1 || v.stride(1) == 1) && (rows == 1 || v.stride(0) >= width)) return v;
  }
  return t.contiguous().view(shape);
}

// A vector (a weight, a bias, per-row statistics) as a contiguous 1-D tensor.
inline at::Tensor as_vector(const at::Tensor& t) { return t.reshape({-1}).contiguous(); }

// ---- the call -----------------------------------------------------------------------------------

// The current stream of a CUDA device, as a cudaStream_t.
inline void* current_cuda_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle();
}

// Where a call runs: on a CUDA device, under a device guard, on its current stream; on the CPU,
// with torch's intra-op thread count (torch.set_num_threads).
// One op of a family's glue: its messages ("optimized::<op>: <argument>: ...") and its C++ API
// calls. The families' op structs (Op, KvOp, LinearOp) derive from it and add their own checks.
struct GlueOp {
  const char* name;  // "layer_norm_fwd", "paged_attention_decode", ...

  std::string prefix(const char* arg) const { return arg_prefix(name, arg); }

  // A tensor argument the glue can view: defined, strided.
  void tensor(const at::Tensor& t, const char* arg) const { check_tensor(t, name, arg); }
  // An optional one (absent: undefined): strided when given.
  void optional(const at::Tensor& t, const char* arg) const {
    if (t.defined()) check_tensor(t, name, arg);
  }

  // The C++ view of a tensor; absent (rank 0) when undefined. Built in the order of the arguments
  // (std::array{...} evaluates left to right), so that a dtype the C++ API has no type for is
  // reported for the first operand that has it.
  TensorView view(const at::Tensor& t, const char* arg) const {
    return t.defined() ? view_of(t, name, arg) : TensorView{};
  }

  // f() with the C++ API's errors raised as torch's, prefixed with the op.
  template <class F>
  decltype(auto) api(F&& f) const {
    return call_api(op_name(name), std::forward<F>(f));
  }

  // A name parsed by the C++ API's parser (a variant, an activation), its Error raised as torch's.
  template <class E>
  E parse(c10::string_view text, E (*parser)(std::string_view)) const {
    return api([&] { return parser(std::string_view(text.data(), text.size())); });
  }
};

struct Launch {
  c10::OptionalDeviceGuard guard;
  ExecutionContext ctx;
  at::Device device;
  at::Tensor workspace_buffer;  // the memory behind ctx.workspace, alive until the op is queued

  // CUDA: `bytes` of scratch from torch's caching allocator, on the current stream, handed to the op
  // as ExecutionContext::workspace (so the C++ API allocates nothing itself: no cudaMallocAsync per
  // call, and a CUDA graph capture records no allocation node). Freed when the Launch goes: the
  // caching allocator reuses a block only in stream order after the op it was queued with.
  void provide_workspace(size_t bytes) {
    if (!device.is_cuda() || bytes == 0) return;
    workspace_buffer = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
    ctx.workspace = {workspace_buffer.data_ptr(), bytes};
  }

  explicit Launch(const at::Device& on) : device(on) {
    if (device.is_cuda()) {
      guard.reset_device(device);
      ctx.cuda_stream = current_cuda_stream(device);
    } else {
      ctx.cpu_threads = at::get_num_threads();
    }
  }
};

// The names of a family's variants, in the order of its table (naive to best), for the
// <family>_variants() -> str[] queries.
template <class Variant, class Name>
std::vector<std::string> variant_names(std::span<const Variant> all, Name name) {
  std::vector<std::string> names;
  for (Variant v : all) names.emplace_back(name(v));
  return names;
}

}  // namespace optimized::torch_glue
