// Machine ceilings (see ceilings.h).
#include "harness/ceilings.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>

#include <omp.h>

#include "baselines/openblas_gemm.h"
#include "harness/data.h"
#include "harness/gpu_timer.h"
#include "optimized/buffer.h"
#include "optimized/core.h"

namespace bench {

namespace {

std::string cube_label(int64_t s) {
  return std::to_string(s) + "x" + std::to_string(s) + "x" + std::to_string(s);
}

#if OPTIMIZED_WITH_CUDA
Ceiling device_copy(int64_t bytes, const MeasureOptions& opt) {
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  bytes = std::min<int64_t>(bytes, static_cast<int64_t>(free_b / 4));
  bytes &= ~int64_t{4095};
  optimized::Buffer src(optimized::DType::kF32, bytes / 4, optimized::Device::cuda());
  optimized::Buffer dst(optimized::DType::kF32, bytes / 4, optimized::Device::cuda());
  src.fill_bytes(0x3C);
  dst.fill_bytes(0);
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  CudaStream stream;
  MeasureOptions o = opt;
  o.flush_cache = false;  // 1 GiB is 20x any L2
  const Stats s = measure_gpu(
      [&](int) {
        check_cuda(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream.get()),
                   "cudaMemcpyAsync");
      },
      stream.get(), o);
  Ceiling c;
  c.name = "device_copy";
  c.unit = "GB/s";
  c.bytes = 2 * bytes;
  c.time = s;
  c.value = 2.0 * bytes / (s.median * 1e-3) / 1e9;
  return c;
}

}  // namespace

Stats measure_copy_of(double bytes, const MeasureOptions& opt, cudaStream_t st) {
  const int64_t half = std::max<int64_t>(static_cast<int64_t>(bytes / 2) & ~int64_t{15}, 16);
  size_t free_b = 0, total_b = 0;
  check_cuda(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  int l2 = 0;
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), "cudaDeviceGetAttribute");
  const int npairs = rotating_set_count(2 * half, l2, static_cast<int64_t>(free_b / 2));
  std::vector<optimized::Buffer> src, dst;
  for (int i = 0; i < npairs; ++i) {
    src.emplace_back(optimized::DType::kF32, (half + 3) / 4, optimized::Device::cuda());
    dst.emplace_back(optimized::DType::kF32, (half + 3) / 4, optimized::Device::cuda());
    src.back().fill_bytes(0x3C);
    dst.back().fill_bytes(0);
  }
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return measure_gpu(
      [&](int i) {
        const size_t k = static_cast<size_t>(i % npairs);
        check_cuda(cudaMemcpyAsync(dst[k].data(), src[k].data(), static_cast<size_t>(half), cudaMemcpyDeviceToDevice, st),
                   "cudaMemcpyAsync (same-size copy)");
      },
      st, opt);
}

namespace {

Ceiling cublas_rate(CublasMode mode, int64_t size, const MeasureOptions& opt) {
  const optimized::DType dtype = cublas_mode_dtype(mode);
  const int64_t count = size * size;
  optimized::Buffer a = random_buffer(dtype, count, optimized::Device::cuda(), 9001);
  optimized::Buffer b = random_buffer(dtype, count, optimized::Device::cuda(), 9002);
  optimized::Buffer c(dtype, count, optimized::Device::cuda());
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  CudaStream stream;
  CublasGemm gemm(stream.get());
  const Stats s = measure_gpu(
      [&](int) { gemm.run(mode, size, size, size, 1, a.data(), b.data(), c.data(), 1.0f, 0.0f); },
      stream.get(), opt);
  Ceiling r;
  r.name = cublas_mode_name(mode);
  r.unit = "TFLOP/s";
  r.shape = cube_label(size);
  r.time = s;
  r.value = 2.0 * size * size * size / (s.median * 1e-3) / 1e12;
  return r;
}
#endif

Ceiling host_copy(int64_t bytes, int threads, const MeasureOptions& opt) {
  std::unique_ptr<unsigned char[]> src(new unsigned char[bytes]);
  std::unique_ptr<unsigned char[]> dst(new unsigned char[bytes]);
  // First touch from the threads that will copy.
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < bytes; i += 4096) {
    std::memset(src.get() + i, 0x5A, std::min<int64_t>(4096, bytes - i));
    std::memset(dst.get() + i, 0, std::min<int64_t>(4096, bytes - i));
  }
  MeasureOptions o = opt;
  o.flush_cache = false;
  const Stats s = measure_cpu(
      [&](int) {
        const int64_t chunk = (bytes / threads + 4095) & ~int64_t{4095};
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int t = 0; t < threads; ++t) {
          const int64_t lo = std::min(bytes, t * chunk), hi = std::min(bytes, lo + chunk);
          if (hi > lo) std::memcpy(dst.get() + lo, src.get() + lo, hi - lo);
        }
      },
      o);
  Ceiling c;
  c.name = "host_copy";
  c.unit = "GB/s";
  c.bytes = 2 * bytes;
  c.threads = threads;
  c.time = s;
  c.value = 2.0 * bytes / (s.median * 1e-3) / 1e9;
  return c;
}

Ceiling openblas_rate(int64_t size, int threads, const MeasureOptions& opt) {
  const int64_t count = size * size;
  std::vector<uint8_t> a = random_host(optimized::DType::kF32, count, 9101);
  std::vector<uint8_t> b = random_host(optimized::DType::kF32, count, 9102);
  std::vector<float> c(count);
  const Stats s = measure_cpu(
      [&](int) {
        openblas_sgemm(size, size, size, 1, reinterpret_cast<const float*>(a.data()),
                       reinterpret_cast<const float*>(b.data()), c.data(), 1.0f, 0.0f, threads);
      },
      opt);
  Ceiling r;
  r.name = "openblas_sgemm";
  r.unit = "GFLOP/s";
  r.shape = cube_label(size);
  r.threads = threads;
  r.time = s;
  r.value = 2.0 * size * size * size / (s.median * 1e-3) / 1e9;
  return r;
}

}  // namespace

CeilingPlan CeilingPlan::everything(bool gpu) {
  CeilingPlan p;
  p.device_copy = gpu;
  if (gpu) p.cublas_modes = {CublasMode::kBf16, CublasMode::kFp16, CublasMode::kTf32, CublasMode::kFp32};
  p.host_copy = true;
  p.openblas = true;
  return p;
}

int CeilingPlan::count() const {
  return (device_copy ? 1 : 0) + static_cast<int>(cublas_modes.size() * cublas_sizes.size()) +
         (host_copy ? 1 : 0) + (openblas && openblas_available() ? 1 : 0);
}

std::vector<Ceiling> measure_ceilings(const CeilingPlan& plan, const MeasureOptions& opt,
                                      Progress& progress, std::vector<std::string>& notes) {
  std::vector<Ceiling> out;
  auto attempt = [&](const std::string& what, const auto& fn) {
    progress.step("ceiling " + what);
    try {
      out.push_back(fn());
    } catch (const std::exception& e) {
      notes.push_back("ceiling " + what + " failed: " + e.what());
    }
  };
  const int threads = plan.cpu_threads > 0 ? plan.cpu_threads : all_threads();
#if OPTIMIZED_WITH_CUDA
  const bool gpu = optimized::cuda_device_count() > 0;
  if (gpu && plan.device_copy)
    attempt("device_copy", [&] { return device_copy(plan.device_copy_bytes, opt); });
  if (gpu) {
    for (CublasMode mode : plan.cublas_modes)
      for (int64_t size : plan.cublas_sizes)
        attempt(cublas_mode_name(mode) + " " + cube_label(size),
                [&] { return cublas_rate(mode, size, opt); });
  }
#endif
  if (plan.host_copy)
    attempt("host_copy", [&] { return host_copy(plan.host_copy_bytes, threads, opt); });
  if (plan.openblas && openblas_available())
    attempt("openblas_sgemm " + cube_label(plan.openblas_size),
            [&] { return openblas_rate(plan.openblas_size, threads, opt); });
  return out;
}

}  // namespace bench
