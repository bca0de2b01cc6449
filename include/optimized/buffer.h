// Owning, typed buffer on the host or a CUDA device: for tests, benchmarks and examples.
// Library ops never allocate through it; they take TensorViews.
#pragma once

#include <cstdint>
#include <vector>

#include "optimized/core.h"

namespace optimized {

class Buffer {
 public:
  Buffer() = default;
  // Uninitialized storage for `count` elements of `dtype` on `device` (256-byte aligned).
  Buffer(DType dtype, int64_t count, Device device);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int64_t count() const { return count_; }
  size_t bytes() const { return static_cast<size_t>(count_) * dtype_size(dtype_); }

  // Synchronous copies between this buffer and host memory of `bytes()` bytes.
  void copy_from_host(const void* src);
  void copy_to_host(void* dst) const;
  // Every byte set to `byte` (0xFF poisons float data with NaN).
  void fill_bytes(uint8_t byte);

  // View of the first rows*ld elements as a (rows, cols) row-major matrix with leading dim ld.
  TensorView matrix(int64_t rows, int64_t cols, int64_t ld) const;
  TensorView view(std::initializer_list<int64_t> shape) const;
  TensorView view(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides) const;

 private:
  void release() noexcept;

  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  int64_t count_ = 0;
  Device device_ = Device::cpu();
};

// Host-side conversions used by references, tests and the CPU backend (round to nearest even).
float half_to_float(uint16_t bits);
uint16_t float_to_half(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_bf16(float value);
// fp8 (OCP FP8, as torch.float8_e4m3fn and torch.float8_e5m2), round to nearest even:
//   e4m3: bias 7, 3 mantissa bits, no infinities, 0x7F / 0xFF NaN, largest finite 448; a value
//         that rounds past 448 (|x| > 464) becomes NaN, as torch's conversion does.
//   e5m2: bias 15, 2 mantissa bits, IEEE-style infinities and NaN, largest finite 57344; overflow
//         rounds to +-inf.
float fp8_e4m3_to_float(uint8_t bits);
uint8_t float_to_fp8_e4m3(double value);
float fp8_e5m2_to_float(uint8_t bits);
uint8_t float_to_fp8_e5m2(double value);
// Element `index` of host memory `data` of `dtype`, as double (fp64, fp32, fp16, bf16, fp8_e4m3,
// int32, int64).
double load_as_double(const void* data, DType dtype, int64_t index);
// Store `value` rounded to `dtype` at element `index` of host memory `data`.
void store_from_double(void* data, DType dtype, int64_t index, double value);

}  // namespace optimized
