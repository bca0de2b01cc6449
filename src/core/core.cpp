// Core types: dtype and device names, tensor view helpers, and what the build and machine offer.
#include <algorithm>
#include <sstream>

#include "core/dtypes_built.h"
#include "optimized/core.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "fp32";
    case DType::kF16: return "fp16";
    case DType::kBF16: return "bf16";
    case DType::kF8E4M3: return "fp8_e4m3";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kF64: return "fp64";
    case DType::kF8E5M2: return "fp8_e5m2";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kF64: return 8;
    case DType::kF8E5M2: return 1;
    case DType::kBool: return 1;
  }
  return 0;
}

DType parse_dtype(std::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2, DType::kI32, DType::kI64,
                  DType::kF64, DType::kBool})
    if (dtype_name(d) == name) return d;
  throw Error(Status::kInvalidArgument,
              "dtype: expected one of fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int32, int64, fp64, bool; given '" +
                  std::string(name) + "'");
}

std::string device_name(Device device) {
  return device.is_cuda() ? "cuda:" + std::to_string(device.index) : "cpu";
}

std::string_view status_name(Status status) {
  switch (status) {
    case Status::kOk: return "ok";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kUnsupported: return "unsupported";
    case Status::kCudaError: return "CUDA error";
    case Status::kOutOfMemory: return "out of memory";
    case Status::kInternal: return "internal error";
  }
  return "unknown";
}

namespace {
// a * b into *out; true (and *out unspecified) when the product does not fit int64.
bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }
bool add_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_add_overflow(a, b, out); }

std::string shape_string(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

void fill_shape(TensorView& t, std::initializer_list<int64_t> shape) {
  if (shape.size() > TensorView::kMaxRank)
    throw Error(Status::kInvalidArgument, "shape: expected rank <= 6; given rank " +
                                              std::to_string(shape.size()));
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
}
}  // namespace

TensorView::TensorView(void* data_, DType dtype_, Device device_, std::initializer_list<int64_t> shape_)
    : data(data_), dtype(dtype_), device(device_) {
  fill_shape(*this, shape_);
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    strides[i] = stride;
    // The last stride is never used beyond the first dimension: only the strides must fit.
    if (i > 0 && mul_overflows(stride, shape[i], &stride))
      throw Error(Status::kInvalidArgument,
                  "shape: expected contiguous strides that fit int64; given " + shape_string(*this));
  }
}

TensorView::TensorView(void* data_, DType dtype_, Device device_, std::initializer_list<int64_t> shape_,
                       std::initializer_list<int64_t> strides_)
    : data(data_), dtype(dtype_), device(device_) {
  fill_shape(*this, shape_);
  if (strides_.size() != shape_.size())
    throw Error(Status::kInvalidArgument, "strides: expected " + std::to_string(shape_.size()) +
                                              " strides (one per dimension); given " +
                                              std::to_string(strides_.size()));
  int i = 0;
  for (int64_t s : strides_) strides[i++] = s;
}

TensorView TensorView::matrix(void* data, DType dtype, Device device, int64_t rows, int64_t cols,
                              int64_t ld) {
  return TensorView(data, dtype, device, {rows, cols}, {ld, 1});
}

int64_t TensorView::numel() const {
  for (int i = 0; i < rank; ++i)
    if (shape[i] == 0) return 0;  // whatever the other sizes
  int64_t n = 1;
  for (int i = 0; i < rank; ++i)
    if (mul_overflows(n, shape[i], &n))
      throw Error(Status::kInvalidArgument, "shape: expected an element count that fits int64; given " +
                                                shape_string(*this));
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  bool past_int64 = false;  // expected no longer fits: no stride can equal it
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && (past_int64 || strides[i] != expected)) return false;
    if (!past_int64) past_int64 = mul_overflows(expected, shape[i], &expected);
  }
  return true;
}

ViewExtent view_extent(const TensorView& t, std::string_view name) {
  auto fail = [&](const std::string& what) {
    throw Error(Status::kInvalidArgument, std::string(name) + ": " + what + "; given " + t.describe());
  };
  if (t.rank < 0 || t.rank > TensorView::kMaxRank)
    fail("expected rank 0.." + std::to_string(TensorView::kMaxRank));
  ViewExtent e;
  e.numel = 1;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] < 0) fail("expected sizes >= 0 (dimension " + std::to_string(i) + ")");
    if (t.shape[i] == 0) e.numel = 0;
  }
  if (e.numel == 0) {  // no element: nothing is reached, whatever the strides
    e.begin = e.end = reinterpret_cast<uintptr_t>(t.data);
    return e;
  }
  for (int i = 0; i < t.rank; ++i)
    if (mul_overflows(e.numel, t.shape[i], &e.numel)) fail("expected an element count that fits int64");
  for (int i = 0; i < t.rank; ++i) {
    int64_t reach = 0;  // (size - 1) * stride: how far dimension i moves from its first index
    if (mul_overflows(t.shape[i] - 1, t.strides[i], &reach) ||
        add_overflows(reach < 0 ? e.lowest : e.highest, reach, reach < 0 ? &e.lowest : &e.highest))
      fail("expected strides whose offsets fit int64 (dimension " + std::to_string(i) + ")");
  }
  // (highest - lowest + 1) elements of dtype_size bytes.
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype));
  int64_t span = 0;
  if (__builtin_sub_overflow(e.highest, e.lowest, &span) || add_overflows(span, 1, &span) ||
      mul_overflows(span, elem, &e.bytes))
    fail("expected a byte span that fits int64 (" + std::to_string(elem) + "-byte elements)");
  // |lowest| * elem < bytes: no overflow. The bytes must not wrap around the address space.
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  if (base == 0) return e;  // no memory yet (a null view is the caller's to reject): begin == end == 0
  const auto below = static_cast<uintptr_t>(-(e.lowest * elem));  // bytes before data (negative strides)
  if (below > base || static_cast<uintptr_t>(e.bytes) - below > UINTPTR_MAX - base)
    fail("expected a view whose bytes lie inside the address space");
  e.begin = base - below;
  e.end = e.begin + static_cast<uintptr_t>(e.bytes);
  return e;
}

std::string TensorView::describe() const {
  std::ostringstream s;
  s << dtype_name(dtype) << "[";
  for (int i = 0; i < rank; ++i) s << (i ? ", " : "") << shape[i];
  s << "] strides [";
  for (int i = 0; i < rank; ++i) s << (i ? ", " : "") << strides[i];
  s << "] on " << device_name(device);
  return s.str();
}

bool cuda_dtype_built(DType dtype) {
  return dispatch_built_dtype(dtype, false, []<DType>() { return true; });
}

std::string cuda_dtype_not_built(std::string_view family, DType dtype) {
  if (cuda_dtype_built(dtype)) return "";
  std::string built = OPTIMIZED_DTYPES_LIST;  // "f32+bf16": CMake's list, ';' passed as '+'
  std::replace(built.begin(), built.end(), '+', ';');
  return std::string(family) + " CUDA kernels for " + std::string(dtype_name(dtype)) +
         " were not built (OPTIMIZED_DTYPES=" + built + "); add it to OPTIMIZED_DTYPES and rebuild";
}

bool built_with_cuda() {
#if OPTIMIZED_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string cuda_unavailable_reason() {
#if OPTIMIZED_WITH_CUDA
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
  }
  if (count == 0) return "no CUDA device present";
  return "";
#else
  return "built without CUDA (no nvcc at configure time)";
#endif
}

int cuda_device_count() {
#if OPTIMIZED_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

}  // namespace optimized
