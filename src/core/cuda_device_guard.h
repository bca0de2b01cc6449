// Host-side CUDA helpers shared by the library's C++ layer (CUDA builds only): turning a CUDA
// error into optimized::Error, and making a device current for a scope.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "optimized/core.h"

namespace optimized {

// Throws Error (kOutOfMemory or kCudaError) naming `what` when `e` is not cudaSuccess.
inline void check_cuda(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that later calls start clean
  throw Error(e == cudaErrorMemoryAllocation ? Status::kOutOfMemory : Status::kCudaError,
              what + ": " + cudaGetErrorString(e));
}

// Makes `device` current for the duration of a scope, restoring the previous one after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace optimized
