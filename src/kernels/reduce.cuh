// Reductions of fp32 values (and fp8 amax bits: warp_raise_max_bits) over the threads of a warp, of a segment of a block (the threads of one
// row), of a block and of a thread-block cluster, with ONE SumOp and ONE MaxOp.
//
// NaN policy (one for the library): NaN propagates, as torch's max / softmax / norms do. MaxOp is
// max.NaN (a NaN operand gives NaN), never fmaxf (which drops NaN); a sum propagates NaN by itself.
//
// Shared-memory slots: segment_reduce and cluster_reduce write per-warp / per-block partials into
// slots the caller owns and read them back after a barrier; they do not wait again before
// returning, so the caller must not rewrite the same slots until every thread has read them: use
// two sets of slots in turn (one barrier per reduction), or block_reduce, which adds the barrier.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/ptx/cluster.cuh"

namespace optimized::kernels {

struct SumOp {
  static __device__ __forceinline__ float identity() { return 0.0f; }
  static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};

struct MaxOp {
  static __device__ __forceinline__ float identity() { return -INFINITY; }
  static __device__ __forceinline__ float apply(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float r;  // one FMNMX, like fmaxf, but NaN-propagating
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return (a > b || a != a) ? a : b;
#endif
  }
};

// Combines v over each group of `width` consecutive lanes (a power of two <= 32); every lane of a
// group gets the group's total (butterfly).
template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, int width = 32) {
  for (int o = width / 2; o > 0; o /= 2) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The max over a warp of non-negative floats given as bits (__float_as_uint(|v|): the bits order as
// the values do, NaN above every number), raised into *target by lane 0 with one atomicMax: a max, so
// the result is the same in any order (an fp8 amax). Every lane of the warp must call it.
__device__ __forceinline__ void warp_raise_max_bits(unsigned* target, unsigned bits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  bits = __reduce_max_sync(0xffffffffu, bits);
#else
  for (int o = 16; o > 0; o /= 2) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
#endif
  if (threadIdx.x % 32 == 0 && bits != 0) atomicMax(target, bits);
}
template <typename Op, int N>
__device__ __forceinline__ void warp_reduce(float (&v)[N], int width = 32) {
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = warp_reduce<Op>(v[k], width);
}

// The warps of a group meet in shared memory: lane 0 of every warp writes its totals into slots
// [warp], a barrier, then every thread folds slots [first_warp, first_warp + warps). Every thread of
// the block must call it.
template <typename Op, int N>
__device__ __forceinline__ void warps_meet(float (&v)[N], float (*slots)[N], int first_warp, int warps) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < N; ++k) slots[warp][k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t = slots[first_warp][k];
    for (int w = 1; w < warps; ++w) t = Op::apply(t, slots[first_warp + w][k]);
    v[k] = t;
  }
}

// Combines v[0..N) over each segment of `seg` consecutive threads of the block (a power of two up
// to 32, or a multiple of 32: whole warps) and hands every thread its segment's totals. Every thread
// of the block must call it (it holds a __syncthreads when seg > 32). slots: float[warps of the
// block][N] in shared memory (see the header for their reuse).
template <typename Op, int N>
__device__ __forceinline__ void segment_reduce(float (&v)[N], int seg, float (*slots)[N]) {
  warp_reduce<Op, N>(v, seg < 32 ? seg : 32);
  if (seg > 32) {
    const int warps = seg / 32, first_warp = threadIdx.x / seg * warps;  // unsigned division: cheaper
    warps_meet<Op, N>(v, slots, first_warp, warps);
  }
}

// Combines v[0..N) over the `threads` threads of the block (whole warps, or one warp of a power of
// two) and hands every thread the totals. The slots (float[warps][N]) may be reused as soon as it
// returns.
template <typename Op, int N>
__device__ __forceinline__ void block_reduce(float (&v)[N], int threads, float (*slots)[N]) {
  warp_reduce<Op, N>(v, threads < 32 ? threads : 32);
  if (threads > 32) {
    warps_meet<Op, N>(v, slots, 0, threads / 32);
    __syncthreads();  // every thread has read the slots
  }
}
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, int threads, float (*slots)[1]) {
  float r[1] = {v};
  block_reduce<Op, 1>(r, threads, slots);
  return r[0];
}

// Combines v[0..N) (each block's totals, already reduced over the block) over the `cluster` blocks
// of a thread-block cluster; every thread gets the cluster's totals. Threads p < cluster of each
// block write its totals into slot [its rank] of block p (distributed shared memory), one cluster
// barrier, then every thread folds its block's slots. Every thread of every block must call it, and
// every block of the cluster must have started before the first call writes into a peer (arrive on
// ptx::cluster_arrive_relaxed() when the kernel starts, cluster_wait() before the first call).
// slots: float[cluster][N] in shared memory (reuse as above).
template <typename Op, int N>
__device__ __forceinline__ void cluster_reduce(float (&v)[N], int cluster, float (*slots)[N]) {
  const int rank = static_cast<int>(ptx::cluster_block_rank());
  if (threadIdx.x < static_cast<unsigned>(cluster)) {
    float* peer = ptx::cluster_map_shared(&slots[rank][0], static_cast<int>(threadIdx.x));
#pragma unroll
    for (int k = 0; k < N; ++k) peer[k] = v[k];
  }
  ptx::cluster_sync();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t = slots[0][k];
    for (int r = 1; r < cluster; ++r) t = Op::apply(t, slots[r][k]);
    v[k] = t;
  }
}

// Slots of the reductions over the threads of one row -- a segment of a block, and with clusters the
// blocks of a cluster -- double-buffered by parity: one barrier per reduction (see the header).
template <int N, int kWarps, int kMaxCluster>
struct RowReduceSlots {
  float warp[2][kWarps][N];
  float cluster[2][kMaxCluster][N];
};

// Reduces v[0..N) over the `seg` threads of a row of the block (segment_reduce) and, kCluster, over
// the `cluster` blocks of the cluster (cluster_reduce: every peer must have started, as it says);
// every thread of the block calls it the same number of times and gets the row's totals. `parity`
// picks the slots and flips.
template <typename Op, bool kCluster, int N, int kWarps, int kMaxCluster>
__device__ __forceinline__ void row_reduce(float (&v)[N], int seg, int cluster,
                                           RowReduceSlots<N, kWarps, kMaxCluster>& slots, int& parity) {
  const int buf = parity;
  parity ^= 1;
  segment_reduce<Op, N>(v, seg, slots.warp[buf]);
  if constexpr (kCluster) cluster_reduce<Op, N>(v, cluster, slots.cluster[buf]);
}

}  // namespace optimized::kernels
