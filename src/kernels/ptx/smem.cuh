// Shared-memory addresses as the 32-bit operands PTX instructions (cp.async, ldmatrix) take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace optimized::kernels::ptx
