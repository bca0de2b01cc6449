// The grouped GEMM's first CUDA rung: one thread per output, fp32 accumulation on the CUDA cores,
// the group of a row found on the device by walking the (clamped, running-max) offsets: slow on
// purpose, like the GEMM ladder's naive rung, and the yardstick the grouped Hopper rung is read
// against. Threads of a warp walk along a row of the output (coalesced stores).
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;

constexpr int kBlockX = 32, kBlockY = 8;

template <typename T, typename TC>
__global__ void __launch_bounds__(kBlockX * kBlockY) grouped_forward(const GroupedGemmParams p) {
  const int64_t j = int64_t(blockIdx.x) * kBlockX + threadIdx.x;
  if (j >= p.n) return;
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  for (int64_t r = int64_t(blockIdx.y) * kBlockY + threadIdx.y; r < p.m; r += int64_t(gridDim.y) * kBlockY) {
    // the row's group: the first whose end passes r (ends clamped to [0, m], a running max)
    int64_t g = 0, end = 0;
    for (; g < p.groups; ++g) {
      int64_t o = p.offs[g];
      o = o < 0 ? 0 : (o > p.m ? p.m : o);
      end = o > end ? o : end;
      if (end > r) break;
    }
    float acc = 0.0f;
    if (g < p.groups)
      for (int64_t kk = 0; kk < p.k; ++kk)
        acc = fmaf(to_float(a[r * p.a_rs + kk]), to_float(b[g * p.b_gs + kk * p.b_rs + j * p.b_cs]), acc);
    static_cast<TC*>(p.c)[r * p.c_rs + j] = from_float<TC>(acc);
  }
}

// One thread per (g, kk, j) of dw: grid (ceil(n / 32), ceil(k / 8), groups).
template <typename T, typename TC>
__global__ void __launch_bounds__(kBlockX * kBlockY) grouped_weight_grad(const GroupedGemmParams p) {
  const int64_t j = int64_t(blockIdx.x) * kBlockX + threadIdx.x;
  const int64_t kk = int64_t(blockIdx.y) * kBlockY + threadIdx.y;
  const int64_t g = blockIdx.z;
  if (j >= p.n || kk >= p.k) return;
  int64_t begin, end;
  grouped_rows(p, g, &begin, &end);
  const T* x = static_cast<const T*>(p.a);
  const T* dy = static_cast<const T*>(p.b);
  float acc = 0.0f;
  for (int64_t r = begin; r < end; ++r) acc = fmaf(to_float(x[r * p.a_rs + kk]), to_float(dy[r * p.b_rs + j]), acc);
  TC* c = static_cast<TC*>(p.c) + g * p.c_gs + kk * p.c_rs + j;
  *c = from_float<TC>(p.accumulate ? to_float(*c) + acc : acc);
}

}  // namespace

cudaError_t grouped_gemm_naive(const GroupedGemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_float_dtype(p.c_dtype, [&]<typename TC>() -> cudaError_t {
      const int64_t bx = (p.n + kBlockX - 1) / kBlockX;
      if (bx > 0x7fffffff) return cudaErrorInvalidConfiguration;
      if (!p.weight_grad) {
        const int64_t by = std::min<int64_t>((p.m + kBlockY - 1) / kBlockY, 65535);
        grouped_forward<T, TC><<<dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by)), dim3(kBlockX, kBlockY), 0,
                                 stream>>>(p);
      } else {
        const int64_t by = (p.k + kBlockY - 1) / kBlockY;
        if (by > 65535 || p.groups > 65535) return cudaErrorInvalidConfiguration;
        grouped_weight_grad<T, TC><<<dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by),
                                          static_cast<unsigned>(p.groups)),
                                     dim3(kBlockX, kBlockY), 0, stream>>>(p);
      }
      return cudaGetLastError();
    });
  });
}

}  // namespace optimized::cuda
