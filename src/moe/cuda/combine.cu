// The combine and its backward on CUDA (moe.h), memory-bound passes with fixed summation orders:
//
//   combine_kernel       out[t, c] = sum_j weights[t, j] y[slot_of[t, j], c]: a thread per (t, 8 or 4
//                        columns: one 16-byte access where the rows allow it, else one column), the k
//                        terms in order (threads of a warp along c: coalesced rows of y). One column per
//                        thread with 2-byte loads ran at ~0.7 TB/s on the H100; 16-byte accesses are
//                        what a memory-bound pass needs.
//   grad_y_kernel        grad_y[s, c] = weights[p] dout[p / k, c] for the pair p in slot s
//   grad_weights_kernel  grad_weights[p] = <dout[t], y[slot_of[p]]>: a warp per pair, lanes along c,
//                        a butterfly reduction (the same order every run)
// No atomics; a slot outside [0, slots) or a pair outside [0, T k) counts as dropped / unused.
#include <algorithm>
#include <cstdint>

#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;

constexpr int kBlockX = 32, kBlockY = 8;
constexpr int64_t kMaxGridY = 65535;

// V neighbouring elements of a row, one access (16 bytes for V = 16 / sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Threads of a warp along the columns, V columns each (V > 1: rows and bases allow 16-byte accesses).
template <typename T, int V>
__global__ void __launch_bounds__(kBlockX * kBlockY) combine_kernel(const MoeCombineParams p) {
  const int64_t c = (int64_t(blockIdx.x) * kBlockX + threadIdx.x) * V;
  if (c >= p.n) return;
  const T* y = static_cast<const T*>(p.y);
  for (int64_t t = int64_t(blockIdx.y) * kBlockY + threadIdx.y; t < p.tokens; t += int64_t(gridDim.y) * kBlockY) {
    float acc[V] = {};
    for (int64_t j = 0; j < p.k; ++j) {
      const int32_t s = p.slot_of[t * p.k + j];
      if (s < 0 || s >= p.slots) continue;
      const float w = p.weights[t * p.k + j];
      const Pack<T, V> in = *reinterpret_cast<const Pack<T, V>*>(y + s * p.ld_y + c);
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] += w * to_float(in.v[e]);
    }
    Pack<T, V> out;
#pragma unroll
    for (int e = 0; e < V; ++e) out.v[e] = from_float<T>(acc[e]);
    *reinterpret_cast<Pack<T, V>*>(static_cast<T*>(p.out) + t * p.ld_out + c) = out;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kBlockX * kBlockY) grad_y_kernel(const MoeCombineParams p) {
  const int64_t c = (int64_t(blockIdx.x) * kBlockX + threadIdx.x) * V;
  if (c >= p.n) return;
  const T* dout = static_cast<const T*>(p.dout);
  for (int64_t s = int64_t(blockIdx.y) * kBlockY + threadIdx.y; s < p.slots; s += int64_t(gridDim.y) * kBlockY) {
    const int64_t pair = p.sorted_pairs[s];
    const bool used = pair >= 0 && pair < p.tokens * p.k;
    Pack<T, V> out;
    if (used) {
      const float w = p.weights[pair];
      const Pack<T, V> in = *reinterpret_cast<const Pack<T, V>*>(dout + (pair / p.k) * p.ld_out + c);
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = from_float<T>(w * to_float(in.v[e]));
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) out.v[e] = from_float<T>(0.0f);
    }
    *reinterpret_cast<Pack<T, V>*>(static_cast<T*>(p.grad_y) + s * p.ld_gy + c) = out;
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

dim3 rows_grid(int64_t columns, int64_t rows) {
  return dim3(static_cast<unsigned>((columns + kBlockX - 1) / kBlockX),
              static_cast<unsigned>(std::max<int64_t>(1, std::min((rows + kBlockY - 1) / kBlockY, kMaxGridY))));
}

// Whether every row of the pass is whole 16-byte units at 16-byte aligned addresses.
bool rows_16(const MoeCombineParams& p, size_t es) {
  const auto ok = [&](const void* base, int64_t ld) {
    return base == nullptr || (reinterpret_cast<uintptr_t>(base) % 16 == 0 && (ld * es) % 16 == 0);
  };
  return (p.n * es) % 16 == 0 && ok(p.y, p.ld_y) && ok(p.out, p.ld_out) && ok(p.dout, p.ld_out) && ok(p.grad_y, p.ld_gy);
}

}  // namespace

cudaError_t moe_combine(const MoeCombineParams& p, const Workspace&, cudaStream_t stream) {
  if ((p.n + kBlockX - 1) / kBlockX > 0x7fffffff || (p.tokens * p.k + kBlockY - 1) / kBlockY > 0x7fffffff)
    return cudaErrorInvalidConfiguration;
  const dim3 block(kBlockX, kBlockY);
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    constexpr int V = 16 / sizeof(T);
    const bool vec = rows_16(p, sizeof(T));
    const int64_t columns = vec ? p.n / V : p.n;
    if (p.out) {
      if (p.tokens > 0) {
        if (vec) combine_kernel<T, V><<<rows_grid(columns, p.tokens), block, 0, stream>>>(p);
        else combine_kernel<T, 1><<<rows_grid(columns, p.tokens), block, 0, stream>>>(p);
      }
      return cudaGetLastError();
    }
    if (p.grad_y && p.slots > 0) {
      if (vec) grad_y_kernel<T, V><<<rows_grid(columns, p.slots), block, 0, stream>>>(p);
      else grad_y_kernel<T, 1><<<rows_grid(columns, p.slots), block, 0, stream>>>(p);
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    if (p.grad_weights && p.tokens * p.k > 0)
      grad_weights_kernel<T><<<static_cast<unsigned>((p.tokens * p.k + kBlockY - 1) / kBlockY), block, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
