// Reductions into global memory (red: an atomic add whose old value nobody reads, so the SM does
// not wait for it), and the small cp.async that the 16-byte form in cp_async.cuh does not cover.
//
//   red_add_f32(p, x)        *p += x                      any sm_60+
//   red_add_v2_f32(p, x, y)  p[0] += x, p[1] += y         one vector reduction (sm_90+); p 8-byte aligned
//   cp_async_4(dst, src)     4 bytes global -> shared      (cp.async.ca; 4-byte aligned)
//
// The vector form halves the number of reduction messages of an fp32 accumulator updated from mma
// C fragments, whose lanes own adjacent column pairs (ptx/mma_sync.cuh: c0, c1 = (g, 2t..2t+1)).
// Each element of the pair is still added atomically on its own; the order of the adds between
// blocks is not fixed, so a sum built this way is not bitwise reproducible.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels::ptx {

__device__ __forceinline__ void red_add_f32(float* p, float x) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(x) : "memory");
}

__device__ __forceinline__ void red_add_v2_f32(float* p, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
#else
  red_add_f32(p, x);
  red_add_f32(p + 1, y);
#endif
}

// 4 bytes global -> shared through L1 (.ca: the only cache mode of the small sizes). dst: shared
// address (smem_u32), 4-byte aligned; src 4-byte aligned. Waited on with cp_async_wait like the rest.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

}  // namespace optimized::kernels::ptx
