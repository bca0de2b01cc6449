// Core types of optimized-ops: dtypes, devices, the non-owning tensor view, the error type and
// the execution context. Torch-free and CUDA-free so that any C++ program can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>

namespace optimized {

// kF64 comes last so that the C API's dtype values stay what they were.
// kBool (one byte, 0 or 1) is taken only where an op says so (attention masks).
enum class DType : uint8_t { kF32, kF16, kBF16, kF8E4M3, kI32, kI64, kF64, kF8E5M2, kBool };

std::string_view dtype_name(DType dtype);  // "fp32", "fp16", "bf16", "fp8_e4m3", "int32", "int64", "fp64", "fp8_e5m2", "bool"
size_t dtype_size(DType dtype);             // bytes per element
DType parse_dtype(std::string_view name);   // inverse of dtype_name; throws Error on unknown names

enum class DeviceType : uint8_t { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {DeviceType::kCpu, 0}; }
  static Device cuda(int ordinal = 0) { return {DeviceType::kCuda, ordinal}; }
  bool is_cuda() const { return type == DeviceType::kCuda; }
  bool operator==(const Device&) const = default;
};

std::string device_name(Device device);  // "cpu", "cuda:0"

// What went wrong, for callers that branch on it (the C API maps these to status codes).
enum class Status : int {
  kOk = 0,
  kInvalidArgument = 1,  // a shape, dtype, device, stride or alignment the op cannot take
  kUnsupported = 2,      // valid input, but not for this variant or this build (e.g. no CUDA)
  kCudaError = 3,        // a CUDA runtime or library call failed
  kOutOfMemory = 4,
  kInternal = 5,
};

std::string_view status_name(Status status);

// The one error type. Messages name the argument, what was expected and what was given.
class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

// Non-owning view of a strided tensor. Shape and strides are in elements.
struct TensorView {
  static constexpr int kMaxRank = 6;

  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::cpu();
  int rank = 0;
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};

  TensorView() = default;
  // Contiguous row-major view. Throws Error (kInvalidArgument, naming the shape) when a stride
  // overflows int64.
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);
  // Explicit strides (same length as shape).
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape,
             std::initializer_list<int64_t> strides);
  // Row-major matrix (rows, cols) whose rows are `ld` elements apart.
  static TensorView matrix(void* data, DType dtype, Device device, int64_t rows, int64_t cols,
                           int64_t ld);

  // The element count (0 when a size is 0). Throws Error (kInvalidArgument, naming the shape) when
  // it overflows int64.
  int64_t numel() const;
  bool is_contiguous() const;
  std::string describe() const;  // "bf16[17, 33] strides [40, 1] on cuda:0"
};

// What a view reaches in memory, relative to its data pointer, in elements and bytes.
struct ViewExtent {
  int64_t numel = 0;    // elements
  int64_t lowest = 0;   // element offset of the lowest element reached (< 0 only with negative strides)
  int64_t highest = 0;  // element offset of the highest element reached
  int64_t bytes = 0;    // from the lowest element's first byte to the highest's last; 0 with no element
  // The addresses [begin, end) of those bytes; both data with no element, both 0 for null data.
  uintptr_t begin = 0, end = 0;
};
// The extent of `t`, checked: every size >= 0; the element count, every (size - 1) * stride, the
// offsets and the byte span fit int64; the bytes lie inside the address space. Otherwise throws
// Error (kInvalidArgument) whose message starts with `name` (the argument) and shows the view.
// Every path that turns a view's shape and strides into an element count, an offset range or a
// byte span (overlap checks, copies, memsets) goes through here.
ViewExtent view_extent(const TensorView& t, std::string_view name);

// Device memory an op may use as scratch (partial sums, temporaries). Each op says how much it
// needs: <op>_workspace_bytes (matmul_workspace_bytes in gemm.h, fused_workspace_bytes in fused.h).
struct Workspace {
  void* data = nullptr;  // on the op's CUDA device, aligned to 256 bytes (cudaMalloc's alignment)
  size_t bytes = 0;
};

// Where and how an op runs. cuda_stream is a cudaStream_t (nullptr: the legacy default stream);
// cpu_threads = 0 lets the CPU backend use all hardware threads.
// workspace: scratch the caller provides (e.g. from its own allocator, or once for a CUDA graph).
// The op uses it on cuda_stream only, so the caller may reuse it for work ordered after the op on
// that stream. Given but smaller than the op needs: Error kInvalidArgument naming "workspace".
// Absent (data == nullptr): an op that needs scratch allocates it on cuda_stream (cudaMallocAsync)
// and frees it there after its last kernel (cudaFreeAsync); ops that need none never allocate.
struct ExecutionContext {
  void* cuda_stream = nullptr;
  int cpu_threads = 0;
  Workspace workspace;
};

// Build and machine facts.
bool built_with_cuda();
// Number of CUDA devices usable by this process; 0 when the build has no CUDA, no driver is
// loaded or no device is present. Never throws.
int cuda_device_count();
// Why no CUDA device can be used ("built without CUDA", "cudaGetDeviceCount: no CUDA-capable
// device is detected"); empty when cuda_device_count() > 0.
std::string cuda_unavailable_reason();

}  // namespace optimized
