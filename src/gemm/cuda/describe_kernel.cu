// Kernel resource report shared by every GEMM launcher: what the compiler allotted (registers,
// shared and local memory) and what the occupancy calculator makes of it on the current device.
#include "core/device_facts.h"
#include "gemm/launchers.h"

namespace optimized::cuda {

cudaError_t describe_kernel(const void* kernel, const char* name, int threads_per_block,
                            int dynamic_smem_bytes, KernelResources* out) {
  cudaFuncAttributes attr{};
  if (cudaError_t e = cudaFuncGetAttributes(&attr, kernel); e != cudaSuccess) return e;
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
  int blocks = 0;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel,
                                                                    threads_per_block,
                                                                    dynamic_smem_bytes);
      e != cudaSuccess)
    return e;
  out->kernel_name = name;
  out->registers_per_thread = attr.numRegs;
  out->static_smem_bytes = static_cast<int>(attr.sharedSizeBytes);
  out->dynamic_smem_bytes = dynamic_smem_bytes;
  out->threads_per_block = threads_per_block;
  out->blocks_per_sm = blocks;
  const int warps_per_block = (threads_per_block + facts->warp_size - 1) / facts->warp_size;
  out->theoretical_occupancy = static_cast<double>(blocks * warps_per_block) /
                               (facts->max_threads_per_sm / facts->warp_size);
  out->local_bytes_per_thread = static_cast<int>(attr.localSizeBytes);
  return cudaSuccess;
}

}  // namespace optimized::cuda
