// GPU side of the harness (see gpu_timer.h and harness.h): CUDA-event timing of samples with an
// L2 flush enqueued before each one, outside the timed region.
#include "harness/gpu_timer.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <stdexcept>
#include <vector>

#include "harness/harness.h"
#include "optimized/core.h"

namespace bench {

std::string gpu_key_from_name(const std::string& name) {
  std::string lower;
  for (char c : name) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::vector<std::string> tokens;
  std::string cur;
  for (char c : lower) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      cur += c;
    } else if (!cur.empty()) {
      tokens.push_back(cur);
      cur.clear();
    }
  }
  if (!cur.empty()) tokens.push_back(cur);
  // A model token: letters followed by digits ("h100", "a100", "l40s", "b200", "gh200").
  for (const auto& t : tokens) {
    size_t i = 0;
    while (i < t.size() && std::isalpha(static_cast<unsigned char>(t[i]))) ++i;
    if (i > 0 && i < 4 && i < t.size() && std::isdigit(static_cast<unsigned char>(t[i])) &&
        t != "nvidia")
      return t;
  }
  // "NVIDIA GeForce RTX 4090" -> "rtx4090"
  std::string key;
  for (const auto& t : tokens)
    if (t != "nvidia" && t != "geforce" && t != "tesla" && t != "quadro") key += t;
  return key.empty() ? "gpu" : key;
}

#if OPTIMIZED_WITH_CUDA

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

GpuInfo query_gpu() {
  GpuInfo info;
  if (optimized::cuda_device_count() <= 0) return info;
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  info.available = true;
  info.name = prop.name;
  info.key = gpu_key_from_name(info.name);
  info.sm_count = prop.multiProcessorCount;
  int l2 = 0;
  check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), "cudaDeviceGetAttribute(L2)");
  info.l2_bytes = l2;
  info.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  info.cc_major = prop.major;
  info.cc_minor = prop.minor;
  cudaRuntimeGetVersion(&info.cuda_runtime);
  cudaDriverGetVersion(&info.cuda_driver);
  return info;
}

CudaStream::CudaStream() {
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
}
CudaStream::~CudaStream() {
  if (stream_) cudaStreamDestroy(stream_);
}

cudaError_t launch_read_flush(const void* data, size_t bytes, unsigned* sink, int sm_count, cudaStream_t stream);

namespace {
struct FlushBuffer {
  void* data = nullptr;
  unsigned* sink = nullptr;
  size_t bytes = 0;
  int sm_count = 0;
  FlushBuffer() {
    int l2 = 0;
    check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0), "cudaDeviceGetAttribute(L2)");
    check_cuda(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), "cudaDeviceGetAttribute(SMs)");
    bytes = static_cast<size_t>(std::max(l2, 1 << 20)) * 2;
    check_cuda(cudaMalloc(&data, bytes), "cudaMalloc(L2 flush buffer)");
    check_cuda(cudaMalloc(&sink, sizeof(unsigned)), "cudaMalloc(L2 flush sink)");
    // Written once here, so that the flush reads defined data; never written again.
    check_cuda(cudaMemset(data, 0x5a, bytes), "cudaMemset(L2 flush buffer)");
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (L2 flush buffer)");
  }
  // Freed at exit by the driver; no destructor so static destruction order cannot bite.
};
FlushBuffer& flush_buffer() {
  static FlushBuffer buffer;
  return buffer;
}
}  // namespace


void flush_l2(cudaStream_t stream) {
  FlushBuffer& f = flush_buffer();
  check_cuda(launch_read_flush(f.data, f.bytes, f.sink, f.sm_count, stream), "L2 flush (read kernel)");
}

Stats measure_gpu(const std::function<void(int)>& run_once, void* stream_ptr, const MeasureOptions& opt) {
  using Clock = std::chrono::steady_clock;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cudaEvent_t start = nullptr, stop = nullptr;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  struct Guard {
    cudaEvent_t a, b;
    ~Guard() { cudaEventDestroy(a); cudaEventDestroy(b); }
  } guard{start, stop};

  int iteration = 0;
  // Warm-up: until warmup_s has passed on the GPU (events) or max_warmup runs.
  double warm_ms = 0;
  for (int w = 0; w < opt.max_warmup; ++w) {
    check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
    run_once(iteration++);
    check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "warm-up run");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    warm_ms += ms;
    if (warm_ms >= opt.warmup_s * 1e3) break;
  }

  std::vector<double> samples;
  const auto t0 = Clock::now();
  while (true) {
    // The flush is enqueued before the start event: the GPU runs it while the host enqueues
    // the sample, so neither the flush nor the launch overhead lands in the timed region.
    if (opt.flush_cache) flush_l2(stream);
    check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
    run_once(iteration++);
    check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop), "timed run");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    samples.push_back(ms);
    if (should_stop(samples, std::chrono::duration<double>(Clock::now() - t0).count(), opt)) break;
  }
  return summarize(std::move(samples));
}

#else  // !OPTIMIZED_WITH_CUDA

GpuInfo query_gpu() { return {}; }

Stats measure_gpu(const std::function<void(int)>&, void*, const MeasureOptions&) {
  throw std::runtime_error("measure_gpu: this build has no CUDA");
}

#endif

}  // namespace bench
