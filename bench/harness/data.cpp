#include "harness/data.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "harness/gpu_timer.h"

namespace bench {

namespace {
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline float uniform(uint64_t seed, int64_t i) {
  const uint64_t bits = splitmix64(seed * 0x100000001B3ull + static_cast<uint64_t>(i));
  return static_cast<float>((bits >> 40) * (2.0 / 16777216.0) - 1.0);  // 24 bits -> [-1, 1)
}
}  // namespace

void fill_random(void* host, optimized::DType dtype, int64_t count, uint64_t seed) {
  using optimized::DType;
  switch (dtype) {
    case DType::kF32: {
      float* p = static_cast<float*>(host);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) p[i] = uniform(seed, i);
      return;
    }
    case DType::kF16: {
      uint16_t* p = static_cast<uint16_t*>(host);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) p[i] = optimized::float_to_half(uniform(seed, i));
      return;
    }
    case DType::kBF16: {
      uint16_t* p = static_cast<uint16_t*>(host);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < count; ++i) p[i] = optimized::float_to_bf16(uniform(seed, i));
      return;
    }
    default:
      for (int64_t i = 0; i < count; ++i)
        optimized::store_from_double(host, dtype, i, uniform(seed, i));
  }
}

std::vector<uint8_t> random_host(optimized::DType dtype, int64_t count, uint64_t seed) {
  std::vector<uint8_t> out(static_cast<size_t>(count) * optimized::dtype_size(dtype));
  fill_random(out.data(), dtype, count, seed);
  return out;
}

optimized::Buffer random_buffer(optimized::DType dtype, int64_t count, optimized::Device device,
                                uint64_t seed, std::vector<uint8_t>* host_copy) {
  optimized::Buffer buffer(dtype, count, device);
  if (!device.is_cuda()) {
    fill_random(buffer.data(), dtype, count, seed);
    if (host_copy) {
      host_copy->resize(buffer.bytes());
      std::memcpy(host_copy->data(), buffer.data(), buffer.bytes());
    }
    return buffer;
  }
  std::vector<uint8_t> host = random_host(dtype, count, seed);
  buffer.copy_from_host(host.data());
  if (host_copy) *host_copy = std::move(host);
  return buffer;
}

std::vector<uint8_t> read_rows(const optimized::Buffer& b, const std::vector<int64_t>& rows, bool contiguous,
                               int64_t cols, int64_t ld, size_t es) {
  std::vector<uint8_t> out(rows.size() * static_cast<size_t>(cols) * es);
  const size_t row_bytes = static_cast<size_t>(cols) * es, pitch = static_cast<size_t>(ld) * es;
  const auto* base = static_cast<const uint8_t*>(b.data());
  if (!b.device().is_cuda()) {
    for (size_t i = 0; i < rows.size(); ++i)
      std::memcpy(out.data() + i * row_bytes, base + static_cast<size_t>(rows[i]) * pitch, row_bytes);
    return out;
  }
#if OPTIMIZED_WITH_CUDA
  if (contiguous && !rows.empty()) {
    check_cuda(cudaMemcpy2D(out.data(), row_bytes, base + static_cast<size_t>(rows.front()) * pitch, pitch, row_bytes,
                            rows.size(), cudaMemcpyDeviceToHost),
               "cudaMemcpy2D (reading outputs back)");
  } else {
    for (size_t i = 0; i < rows.size(); ++i)
      check_cuda(cudaMemcpy(out.data() + i * row_bytes, base + static_cast<size_t>(rows[i]) * pitch, row_bytes,
                            cudaMemcpyDeviceToHost),
                 "cudaMemcpy (reading outputs back)");
  }
#else
  (void)contiguous;
  throw std::runtime_error("read_rows: device buffer in a build without CUDA");
#endif
  return out;
}

std::vector<uint8_t> read_all(const optimized::Buffer& b) {
  std::vector<uint8_t> out(b.bytes());
  b.copy_to_host(out.data());
  return out;
}

}  // namespace bench
