// The online-softmax state: a running maximum m and the sum s of exp(x - m) over what was seen,
// and its merge, so that a row (or a tile of attention scores) is reduced in one pass over chunks
// seen in any order and split over any threads.
//
//   merge((m1, s1), (m2, s2)) = (m, s1 exp(m1 - m) + s2 exp(m2 - m)),  m = max(m1, m2)
//
// NaN propagates (MaxOp): a NaN anywhere makes m and s NaN. Only -inf seen so far: (-inf, 0).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/reduce.cuh"

namespace optimized::kernels {

struct MaxSum {
  float m = -INFINITY;
  float s = 0.0f;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = MaxOp::apply(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};  // exp(-inf - -inf) would be NaN
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// The state of kVec values (a vector of a row): m their maximum, s the sum of exp(x - m).
template <int kVec>
__device__ __forceinline__ MaxSum max_sum_of(const float (&x)[kVec]) {
  MaxSum r;
#pragma unroll
  for (int j = 0; j < kVec; ++j) r.m = MaxOp::apply(r.m, x[j]);
  if (r.m != -INFINITY)
#pragma unroll
    for (int j = 0; j < kVec; ++j) r.s += expf(x[j] - r.m);  // +inf - +inf: NaN, as torch
  return r;
}

// Merges the states of the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
  for (int o = 16; o > 0; o /= 2) v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}

// Merges the states of the `threads` threads of the block (a multiple of 32); every thread gets the
// result. scratch: 2 floats per warp of shared memory, reusable when it returns.
__device__ __forceinline__ MaxSum block_merge(MaxSum v, int threads, float* scratch) {
  v = warp_merge(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    scratch[2 * warp] = v.m;
    scratch[2 * warp + 1] = v.s;
  }
  __syncthreads();
  MaxSum t;
  for (int w = 0; w < threads / 32; ++w) t = merge(t, {scratch[2 * w], scratch[2 * w + 1]});
  __syncthreads();
  return t;
}

}  // namespace optimized::kernels
