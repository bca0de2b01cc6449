// The scaled (fp8) GEMM's first CUDA rung: one thread per element of C, the dot product over K on
// the CUDA cores in fp32, each fp8 element decoded (cuda_fp8.h) and multiplied by its scale as it
// is read. Slow on purpose, like the GEMM ladder's naive rung, and general: any layout of A and B,
// every scale layout, any GPU (compute capability 5.0; the fp8 conversions are emulated below
// 8.9). It is what auto runs where wgmma_fp8 cannot, and the yardstick the Hopper rung is read
// against. Threads of a warp walk along a row of C (coalesced stores, B read along its rows).
#include <cstdint>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/cuda/scaled_common.cuh"
#include "kernels/epilogue/fused_epilogue.cuh"
#include "gemm/launchers.h"
#include "gemm/scaled_params.h"

namespace optimized::cuda {
namespace {

constexpr int kBlockX = 32, kBlockY = 8;

template <typename F8>
__device__ __forceinline__ float decode(uint8_t bits) {
  F8 v;
  v.__x = bits;
  return static_cast<float>(v);
}

template <typename FA, typename FB, typename TC>
__global__ void __launch_bounds__(kBlockX * kBlockY) scaled_gemm_naive_kernel(ScaledGemmParams p) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kBlockX + threadIdx.x;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * kBlockY;
  if (col >= p.n) return;
  const auto* a = static_cast<const uint8_t*>(p.a);
  const auto* b = static_cast<const uint8_t*>(p.b);
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * kBlockY + threadIdx.y; row < p.m; row += row_step) {
    float acc = 0.0f;
    for (int64_t kk = 0; kk < p.k; ++kk) {
      const float x = decode<FA>(a[row * p.a_row_stride + kk * p.a_col_stride]) * scaled_gemm_scale_a(p, row, kk);
      const float y = decode<FB>(b[kk * p.b_row_stride + col * p.b_col_stride]) * scaled_gemm_scale_b(p, kk, col);
      acc = fmaf(x, y, acc);
    }
    if (p.bias) acc += kernels::to_float(static_cast<const TC*>(p.bias)[col]);
    TC* c = static_cast<TC*>(p.c) + row * p.ldc + col;
    if (p.beta != 0.0f) acc += p.beta * kernels::to_float(*c);
    if (p.aux) static_cast<TC*>(p.aux)[row * p.ld_aux + col] = kernels::from_float<TC>(acc);
    *c = kernels::from_float<TC>(kernels::activate(p.activation, acc));
  }
}

}  // namespace

cudaError_t scaled_gemm_naive(const ScaledGemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_scaled_dtypes(p, [&]<typename FA, typename FB, typename TC>() -> cudaError_t {
    const int64_t blocks_x = ceil_div(p.n, int64_t(kBlockX));
    if (blocks_x > INT32_MAX) return cudaErrorInvalidConfiguration;
    const int64_t blocks_y = std::min<int64_t>(ceil_div(p.m, int64_t(kBlockY)), kMaxGridY);
    scaled_gemm_naive_kernel<FA, FB, TC><<<dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y)),
                                           dim3(kBlockX, kBlockY), 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t scaled_gemm_naive_resources(const ScaledGemmParams& p, KernelResources* out) {
  return dispatch_scaled_dtypes(p, [&]<typename FA, typename FB, typename TC>() -> cudaError_t {
    return describe_kernel(reinterpret_cast<const void*>(&scaled_gemm_naive_kernel<FA, FB, TC>),
                           "scaled_gemm_naive<one thread per output, fp32 accumulation>", kBlockX * kBlockY, 0, out);
  });
}

}  // namespace optimized::cuda
