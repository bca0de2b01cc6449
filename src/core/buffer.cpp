// Owning host/device buffer, and the host-side fp16/bf16 conversions.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "optimized/buffer.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_device_guard.h"
#endif

namespace optimized {

namespace {


void require_cuda_build() {
#if !OPTIMIZED_WITH_CUDA
  throw Error(Status::kUnsupported, "device: a CUDA buffer needs a CUDA build; this build is CPU-only");
#endif
}

}  // namespace

Buffer::Buffer(DType dtype, int64_t count, Device device) : dtype_(dtype), count_(count), device_(device) {
  if (count < 0)
    throw Error(Status::kInvalidArgument, "count: expected >= 0; given " + std::to_string(count));
  // The host allocation rounds up to 256 bytes: that must fit too.
  if (count > (INT64_MAX - 255) / std::max<int64_t>(1, static_cast<int64_t>(dtype_size(dtype))))
    throw Error(Status::kInvalidArgument, "count: expected a byte size that fits int64; given " +
                                              std::to_string(count) + " elements of " + std::string(dtype_name(dtype)));
  const size_t size = bytes() == 0 ? 1 : bytes();
  if (device.is_cuda()) {
    require_cuda_build();
#if OPTIMIZED_WITH_CUDA
    DeviceGuard guard(device.index);
    check_cuda(cudaMalloc(&data_, size), "cudaMalloc");
#endif
  } else {
    const size_t rounded = (size + 255) / 256 * 256;
    data_ = std::aligned_alloc(256, rounded);
    if (!data_)
      throw Error(Status::kOutOfMemory, "host allocation of " + std::to_string(rounded) + " bytes failed");
  }
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(other.data_), dtype_(other.dtype_), count_(other.count_), device_(other.device_) {
  other.data_ = nullptr;
  other.count_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    dtype_ = other.dtype_;
    count_ = other.count_;
    device_ = other.device_;
    other.data_ = nullptr;
    other.count_ = 0;
  }
  return *this;
}

void Buffer::release() noexcept {
  if (!data_) return;
#if OPTIMIZED_WITH_CUDA
  if (device_.is_cuda()) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_.index);
    cudaFree(data_);
    cudaSetDevice(previous);
    data_ = nullptr;
    return;
  }
#endif
  std::free(data_);
  data_ = nullptr;
}

void Buffer::copy_from_host(const void* src) {
  if (device_.is_cuda()) {
#if OPTIMIZED_WITH_CUDA
    DeviceGuard guard(device_.index);
    check_cuda(cudaMemcpy(data_, src, bytes(), cudaMemcpyHostToDevice), "cudaMemcpy to device");
#endif
  } else {
    std::memcpy(data_, src, bytes());
  }
}

void Buffer::copy_to_host(void* dst) const {
  if (device_.is_cuda()) {
#if OPTIMIZED_WITH_CUDA
    DeviceGuard guard(device_.index);
    check_cuda(cudaMemcpy(dst, data_, bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy to host");
#endif
  } else {
    std::memcpy(dst, data_, bytes());
  }
}

void Buffer::fill_bytes(uint8_t byte) {
  if (device_.is_cuda()) {
#if OPTIMIZED_WITH_CUDA
    DeviceGuard guard(device_.index);
    check_cuda(cudaMemset(data_, byte, bytes()), "cudaMemset");
#endif
  } else {
    std::memset(data_, byte, bytes());
  }
}

TensorView Buffer::matrix(int64_t rows, int64_t cols, int64_t ld) const {
  const TensorView v = TensorView::matrix(data_, dtype_, device_, rows, cols, ld);
  const ViewExtent e = view_extent(v, "matrix");
  if (e.numel > 0 && (e.lowest < 0 || e.highest >= count_))
    throw Error(Status::kInvalidArgument, "matrix: a (" + std::to_string(rows) + ", " +
                                              std::to_string(cols) + ") view with ld " +
                                              std::to_string(ld) + " needs more than the " +
                                              std::to_string(count_) + " elements of the buffer");
  return v;
}

TensorView Buffer::view(std::initializer_list<int64_t> shape) const {
  TensorView v(data_, dtype_, device_, shape);
  const ViewExtent e = view_extent(v, "view");
  if (e.numel > count_)
    throw Error(Status::kInvalidArgument, "view: shape needs " + std::to_string(e.numel) +
                                              " elements; the buffer holds " + std::to_string(count_));
  return v;
}

TensorView Buffer::view(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides) const {
  TensorView v(data_, dtype_, device_, shape, strides);
  const ViewExtent e = view_extent(v, "view");
  if (e.numel > 0 && (e.lowest < 0 || e.highest >= count_))
    throw Error(Status::kInvalidArgument, "view: strided view reaches elements " + std::to_string(e.lowest) + " to " +
                                              std::to_string(e.highest) + "; the buffer holds " + std::to_string(count_));
  return v;
}

// ---- fp16 / bf16 <-> float, round to nearest even ---------------------------------------------

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));  // Inf/NaN
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t float_to_half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return sign | 0x7e00 | static_cast<uint16_t>((absx >> 13) & 0x3ff);  // NaN stays NaN
  if (absx >= 0x477ff000u) return sign | 0x7c00;  // rounds to >= 65520: Inf
  if (absx < 0x38800000u) {                       // below the smallest normal 2^-14: subnormal or zero
    // value / 2^-24, rounded to nearest even by the FPU.
    const float scaled = std::bit_cast<float>(absx) * 16777216.0f;  // exact (power of two)
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  // Normal: drop 13 mantissa bits with round-to-nearest-even; a carry rolls into the exponent.
  const uint32_t rounded = absx + 0xfffu + ((absx >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

float bf16_to_float(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// ---- fp8 <-> float, round to nearest even ------------------------------------------------------

namespace {

// An 8-bit float with kExp exponent bits (bias 2^(kExp-1) - 1) and kMan mantissa bits.
template <int kExp, int kMan>
struct Fp8Format {
  static constexpr int kBias = (1 << (kExp - 1)) - 1;
  static constexpr int kMaxExpField = (1 << kExp) - 1;

  static double decode_magnitude(uint8_t bits) {  // sign stripped; exponent field not all ones
    const int e = (bits >> kMan) & kMaxExpField;
    const int m = bits & ((1 << kMan) - 1);
    if (e == 0) return std::ldexp(static_cast<double>(m), 1 - kBias - kMan);  // subnormal
    return std::ldexp(static_cast<double>((1 << kMan) + m), e - kBias - kMan);
  }

  // |x| (finite, >= 0) rounded to nearest even, as exponent and mantissa fields packed without the
  // sign; may return a code with the exponent field all ones (the caller's overflow rule).
  static unsigned encode_magnitude(double a) {
    const double min_normal = std::ldexp(1.0, 1 - kBias);
    if (a < min_normal) {
      // Multiples of the subnormal step; rounding up to 2^kMan steps is the smallest normal, whose
      // code is that same integer.
      return static_cast<unsigned>(std::nearbyint(std::ldexp(a, kBias - 1 + kMan)));
    }
    int e2 = 0;
    const double frac = std::frexp(a, &e2);  // a = frac * 2^e2, frac in [0.5, 1)
    int e = e2 - 1;                          // a = (2 * frac) * 2^e, 2 * frac in [1, 2)
    double m = std::nearbyint((2.0 * frac - 1.0) * (1 << kMan));  // exact before rounding
    if (m == (1 << kMan)) m = 0, ++e;
    const int field = e + kBias;
    if (field > kMaxExpField) return (static_cast<unsigned>(kMaxExpField) << kMan) | ((1u << kMan) - 1);
    return (static_cast<unsigned>(field) << kMan) | static_cast<unsigned>(m);
  }
};
using E4M3 = Fp8Format<4, 3>;
using E5M2 = Fp8Format<5, 2>;

}  // namespace

float fp8_e4m3_to_float(uint8_t bits) {
  const bool negative = bits & 0x80;
  const uint8_t mag = bits & 0x7f;
  if (mag == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  const auto v = static_cast<float>(E4M3::decode_magnitude(mag));
  return negative ? -v : v;
}

uint8_t float_to_fp8_e4m3(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x) || std::isinf(x)) return sign | 0x7f;
  const unsigned code = E4M3::encode_magnitude(std::fabs(x));
  return sign | static_cast<uint8_t>(code >= 0x7f ? 0x7f : code);  // past 448: NaN (no infinity)
}

float fp8_e5m2_to_float(uint8_t bits) {
  const bool negative = bits & 0x80;
  const uint8_t mag = bits & 0x7f;
  float v;
  if ((mag >> 2) == 0x1f) v = (mag & 3) ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = static_cast<float>(E5M2::decode_magnitude(mag));
  return negative ? -v : v;
}

uint8_t float_to_fp8_e5m2(double x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7f;
  if (std::isinf(x)) return sign | 0x7c;
  const unsigned code = E5M2::encode_magnitude(std::fabs(x));
  return sign | static_cast<uint8_t>(code >= 0x7c ? 0x7c : code);  // past 57344: infinity
}

double load_as_double(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(data)[i];
    case DType::kF64: return static_cast<const double*>(data)[i];
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kI32: return static_cast<const int32_t*>(data)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(data)[i]);
    case DType::kF8E4M3: return fp8_e4m3_to_float(static_cast<const uint8_t*>(data)[i]);
    case DType::kF8E5M2: return fp8_e5m2_to_float(static_cast<const uint8_t*>(data)[i]);
    case DType::kBool: return static_cast<const uint8_t*>(data)[i] != 0 ? 1.0 : 0.0;
  }
  throw Error(Status::kUnsupported, "dtype: load_as_double does not read " + std::string(dtype_name(dtype)));
}

void store_from_double(void* data, DType dtype, int64_t i, double v) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(data)[i] = static_cast<float>(v); return;
    case DType::kF64: static_cast<double*>(data)[i] = v; return;
    case DType::kF16: static_cast<uint16_t*>(data)[i] = float_to_half(static_cast<float>(v)); return;
    case DType::kBF16: static_cast<uint16_t*>(data)[i] = float_to_bf16(static_cast<float>(v)); return;
    case DType::kI32: static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v); return;
    case DType::kI64: static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v); return;
    case DType::kF8E4M3: static_cast<uint8_t*>(data)[i] = float_to_fp8_e4m3(v); return;
    case DType::kF8E5M2: static_cast<uint8_t*>(data)[i] = float_to_fp8_e5m2(v); return;
    case DType::kBool: static_cast<uint8_t*>(data)[i] = v != 0.0 ? 1 : 0; return;
  }
  throw Error(Status::kUnsupported, "dtype: store_from_double does not write " + std::string(dtype_name(dtype)));
}

}  // namespace optimized
