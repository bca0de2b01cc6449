// Core types: dtype and device names, tensor view helpers, and what the build and machine offer.
#include <sstream>

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
  }
  return 0;
}

DType parse_dtype(std::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kI32, DType::kI64, DType::kF64})
    if (dtype_name(d) == name) return d;
  throw Error(Status::kInvalidArgument,
              "dtype: expected one of fp32, fp16, bf16, fp8_e4m3, int32, int64, fp64; given '" +
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
    stride *= shape[i];
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
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
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
