// The combine and its backward on CUDA (moe.h), memory-bound passes with fixed summation orders:
//
//   combine_kernel       out[t, c] = sum_j weights[t, j] y[slot_of[t, j], c]: a thread per (t, c),
//                        the k terms in order (threads of a warp along c: coalesced rows of y)
//   grad_y_kernel        grad_y[s, c] = weights[p] dout[p / k, c] for the pair p in slot s
//   grad_weights_kernel  grad_weights[p] = <dout[t], y[slot_of[p]]>: a warp per pair, lanes along c,
//                        a butterfly reduction (the same order every run)
// No atomics; a slot outside [0, slots) or a pair outside [0, T k) counts as dropped / unused.
#include <algorithm>

#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;

constexpr int kBlockX = 32, kBlockY = 8;
constexpr int64_t kMaxGridY = 65535;

template <typename T>
__global__ void __launch_bounds__(kBlockX * kBlockY) combine_kernel(const MoeCombineParams p) {
  const int64_t c = int64_t(blockIdx.x) * kBlockX + threadIdx.x;
  if (c >= p.n) return;
  const T* y = static_cast<const T*>(p.y);
  for (int64_t t = int64_t(blockIdx.y) * kBlockY + threadIdx.y; t < p.tokens; t += int64_t(gridDim.y) * kBlockY) {
    float acc = 0.0f;
    for (int64_t j = 0; j < p.k; ++j) {
      const int32_t s = p.slot_of[t * p.k + j];
      if (s < 0 || s >= p.slots) continue;
      acc += p.weights[t * p.k + j] * to_float(y[s * p.ld_y + c]);
    }
    static_cast<T*>(p.out)[t * p.ld_out + c] = from_float<T>(acc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlockX * kBlockY) grad_y_kernel(const MoeCombineParams p) {
  const int64_t c = int64_t(blockIdx.x) * kBlockX + threadIdx.x;
  if (c >= p.n) return;
  const T* dout = static_cast<const T*>(p.dout);
  for (int64_t s = int64_t(blockIdx.y) * kBlockY + threadIdx.y; s < p.slots; s += int64_t(gridDim.y) * kBlockY) {
    const int64_t pair = p.sorted_pairs[s];
    const bool used = pair >= 0 && pair < p.tokens * p.k;
    const float v = used ? p.weights[pair] * to_float(dout[(pair / p.k) * p.ld_out + c]) : 0.0f;
    static_cast<T*>(p.grad_y)[s * p.ld_gy + c] = from_float<T>(v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlockX * kBlockY) grad_weights_kernel(const MoeCombineParams p) {
  const int64_t pair = int64_t(blockIdx.x) * kBlockY + threadIdx.y;  // a warp per pair
  if (pair >= p.tokens * p.k) return;                                 // uniform over the warp
  const int32_t s = p.slot_of[pair];
  const int64_t t = pair / p.k;
  const T* dout = static_cast<const T*>(p.dout);
  const T* y = static_cast<const T*>(p.y);
  float acc = 0.0f;
  if (s >= 0 && s < p.slots)
    for (int64_t c = threadIdx.x; c < p.n; c += kBlockX) acc += to_float(dout[t * p.ld_out + c]) * to_float(y[s * p.ld_y + c]);
  acc = warp_reduce<SumOp>(acc);
  if (threadIdx.x == 0) p.grad_weights[pair] = acc;
}

dim3 rows_grid(int64_t n, int64_t rows) {
  return dim3(static_cast<unsigned>((n + kBlockX - 1) / kBlockX),
              static_cast<unsigned>(std::max<int64_t>(1, std::min((rows + kBlockY - 1) / kBlockY, kMaxGridY))));
}

}  // namespace

cudaError_t moe_combine(const MoeCombineParams& p, const Workspace&, cudaStream_t stream) {
  if ((p.n + kBlockX - 1) / kBlockX > 0x7fffffff || (p.tokens * p.k + kBlockY - 1) / kBlockY > 0x7fffffff)
    return cudaErrorInvalidConfiguration;
  const dim3 block(kBlockX, kBlockY);
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    if (p.out) {
      if (p.tokens > 0) combine_kernel<T><<<rows_grid(p.n, p.tokens), block, 0, stream>>>(p);
      return cudaGetLastError();
    }
    if (p.grad_y && p.slots > 0) grad_y_kernel<T><<<rows_grid(p.n, p.slots), block, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    if (p.grad_weights && p.tokens * p.k > 0)
      grad_weights_kernel<T><<<static_cast<unsigned>((p.tokens * p.k + kBlockY - 1) / kBlockY), block, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
