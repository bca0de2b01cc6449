// g = dy * act'(pre) and the bias gradient on the host (cpu/linear_cpu.h).
#include "linear/cpu/linear_cpu.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/cpu_loops.h"
#include "core/host_dtype.h"
#include "gemm/cpu/activation.h"
#include "optimized/buffer.h"

namespace optimized::cpu {
namespace {

constexpr int64_t kColumnsPerBlock = 64;  // one thread's columns: 64 running sums stay in L1

// max(m, |v|) as the device compares them: by float bits (NaN above every number).
float max_abs(float m, float v) {
  const float a = std::fabs(v);
  uint32_t ba, bm;
  std::memcpy(&ba, &a, 4);
  std::memcpy(&bm, &m, 4);
  return ba > bm ? a : m;
}
void raise_amax(unsigned* bits, float m) {
  uint32_t b;
  std::memcpy(&b, &m, 4);
  std::atomic_ref<unsigned> target(*bits);
  unsigned seen = target.load();
  while (b > seen && !target.compare_exchange_weak(seen, b)) {
  }
}

// Element i of a row of fp32 / fp16 / bf16 as float.
float load_float(const void* row, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(row)[i];
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(row)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(row)[i]);
  }
}

template <typename H>
void act_grad(const LinearGradParams& p, int threads) {
  using T = typename H::T;
  using Acc = typename H::Acc;
  const auto* dy = static_cast<const T*>(p.dy);
  const auto* pre = static_cast<const T*>(p.pre);
  auto* g = static_cast<T*>(p.g);
  const int64_t blocks = (p.n + kColumnsPerBlock - 1) / kColumnsPerBlock;
#pragma omp parallel for num_threads(cpu_thread_count(threads, blocks)) schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t j0 = block * kColumnsPerBlock, j1 = std::min(p.n, j0 + kColumnsPerBlock);
    std::array<double, kColumnsPerBlock> sums{};
    float amax = 0.0f;  // NaN wins (as the kernel's bits do)
    for (int64_t i = 0; i < p.m; ++i) {
      const T* dy_row = dy + i * p.ld_dy;
      for (int64_t j = j0; j < j1; ++j) {
        Acc v = H::load(dy_row[j]);
        if (p.act != 0) v *= activate_grad<Acc>(p.act, H::load(pre[i * p.ld_pre + j]));
        const T stored = H::store(v);
        if (g) g[i * p.ld_g + j] = stored;
        if (p.amax_bits) amax = max_abs(amax, static_cast<float>(H::load(stored)));
        sums[static_cast<size_t>(j - j0)] += static_cast<double>(v);
      }
    }
    if (p.amax_bits) raise_amax(p.amax_bits, amax);
    if (!p.bias_grad) continue;
    for (int64_t j = j0; j < j1; ++j) {
      double s = sums[static_cast<size_t>(j - j0)];
      if (p.accumulate) s += load_as_double(p.bias_grad, p.bias_grad_dtype, j);
      store_from_double(p.bias_grad, p.bias_grad_dtype, j, s);
    }
  }
}

}  // namespace

void linear_fp8_amax(const Fp8AmaxJob& job, int cpu_threads) {
  const size_t elem = dtype_size(job.dtype);
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, job.rows)) schedule(static)
  for (int64_t r = 0; r < job.rows; ++r) {
    const void* row = static_cast<const char*>(job.src) + r * job.ld * static_cast<int64_t>(elem);
    float m = 0.0f;
    for (int64_t c = 0; c < job.cols; ++c) m = max_abs(m, load_float(row, job.dtype, c));
    raise_amax(job.amax_bits, m);
  }
}

void linear_fp8_cast(const Fp8CastJob& job, int cpu_threads) {
  const size_t elem = dtype_size(job.dtype);
  float amax;
  std::memcpy(&amax, job.amax_bits, 4);
  const float fmax = fp8_max_finite(job.format);
  const float q = fp8_quant_scale(amax, fmax);
  *job.dequant = 1.0f / q;
  const bool e5m2 = job.format == DType::kF8E5M2;
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, job.rows)) schedule(static)
  for (int64_t r = 0; r < job.rows; ++r) {
    const void* row = static_cast<const char*>(job.src) + r * job.ld * static_cast<int64_t>(elem);
    for (int64_t c = 0; c < job.cols; ++c) {
      float v = load_float(row, job.dtype, c) * q;  // fp32 product, as the kernel's
      if (v == v) v = std::min(fmax, std::max(-fmax, v));  // saturate (NaN stays NaN)
      const uint8_t b = e5m2 ? float_to_fp8_e5m2(v) : float_to_fp8_e4m3(v);
      if (job.out) job.out[r * job.ld_out + c] = b;
      if (job.out_t) job.out_t[c * job.ld_out_t + r] = b;
    }
  }
}

void linear_act_grad(const LinearGradParams& p, int cpu_threads) {
  switch (p.dtype) {
    case DType::kF32: return act_grad<host::F32>(p, cpu_threads);
    case DType::kF64: return act_grad<host::F64>(p, cpu_threads);
    case DType::kF16: return act_grad<host::F16>(p, cpu_threads);
    case DType::kBF16: return act_grad<host::BF16>(p, cpu_threads);
    default: break;
  }
}

}  // namespace optimized::cpu
