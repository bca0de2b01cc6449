// cp.async (sm_80+): asynchronous global -> shared copies, grouped and waited on by group.
//
//   cp_async_16(dst, src);   // any number of copies ...
//   cp_async_commit();       // ... close a group
//   cp_async_wait<N>();      // wait until at most N groups are still in flight (this thread's)
//
// A wait covers only the calling thread's copies: a __syncthreads after it makes every thread's
// copies visible to the block.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels::ptx {

// 16 bytes global -> shared, cached in L2 only (.cg): operand tiles are read once per block.
// dst: shared address (smem_u32), 16-byte aligned; src: 16-byte aligned.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace optimized::kernels::ptx
