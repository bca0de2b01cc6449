// GPU side of the harness: CUDA error checks, event timing, the cold-L2 flush and facts about
// the device. Everything here exists only when the build has CUDA (OPTIMIZED_WITH_CUDA); the
// CUDA-free parts (GpuInfo, query_gpu) also compile without it and then report "no GPU".
#pragma once

#include <cstdint>
#include <string>

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace bench {

struct GpuInfo {
  bool available = false;
  std::string name;        // "NVIDIA H100 80GB HBM3"
  std::string key;         // "h100"
  int sm_count = 0;
  int64_t l2_bytes = 0;
  int64_t memory_bytes = 0;
  int cuda_runtime = 0;    // cudaRuntimeGetVersion
  int cuda_driver = 0;     // cudaDriverGetVersion
  int cc_major = 0, cc_minor = 0;
};

// Device 0 when optimized::cuda_device_count() > 0; otherwise available == false.
GpuInfo query_gpu();
// Lowercase short key from a device name: "NVIDIA H100 80GB HBM3" -> "h100".
std::string gpu_key_from_name(const std::string& name);

#if OPTIMIZED_WITH_CUDA

// Throws std::runtime_error("<what>: <cudaGetErrorString>") on failure.
void check_cuda(cudaError_t status, const char* what);

// Owns a non-blocking stream.
class CudaStream {
 public:
  CudaStream();
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Enqueue a read of 2x the L2 size on `stream` (l2_flush.cu: a kernel that reads and writes
// nothing back, so that no dirty line's write-back lands in the next timed sample), so the next
// kernel finds none of its inputs in L2. The buffer is allocated once per process.
void flush_l2(cudaStream_t stream);

#endif

}  // namespace bench
