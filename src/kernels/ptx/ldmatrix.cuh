// ldmatrix (sm_75+): a warp loads four 8x8 matrices of 16-bit elements from shared memory into the
// register fragments mma.sync takes. Lanes 8i..8i+7 give the 8 row addresses of matrix i; register
// i of every lane receives matrix i, lane l holding row l/4, columns 2(l%4) and 2(l%4)+1. .trans
// delivers the transpose (row 2(l%4) and 2(l%4)+1, column l/4).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace optimized::kernels::ptx {

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                                  uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

}  // namespace optimized::kernels::ptx
