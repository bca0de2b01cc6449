// Shared-memory addresses as the 32-bit operands PTX instructions (cp.async, ldmatrix) take, and
// named barriers (a subset of a block's threads).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Barrier `id` (1..15; 0 is __syncthreads') among `count` threads (a multiple of 32): lets a
// warpgroup synchronise without the rest of the block.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace optimized::kernels::ptx
