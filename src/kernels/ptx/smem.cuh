// Shared-memory addresses as the 32-bit operands PTX instructions (cp.async, ldmatrix) take, and
// named barriers (a subset of a block's threads).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels::ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 8 bytes of shared memory at `addr` (smem_u32), as ld.shared / st.shared: for a pointer the
// compiler cannot see is shared (carved out of dynamic shared memory by integer arithmetic), which
// would otherwise be a generic access.
__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_f2(uint32_t addr, float2 v) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(v.x), "f"(v.y) : "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads') among `count` threads (a multiple of 32): lets a
// warpgroup synchronise without the rest of the block.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Arrives on barrier `id` without waiting: `count` counts these arrivals and the bar.sync waiters
// together (a producer / consumer hand-off between warpgroups, e.g. attention's ping-pong).
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace optimized::kernels::ptx
