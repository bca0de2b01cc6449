// A row of any length and alignment walked by the threads of a block as an aligned body of 16-byte
// vectors between a scalar head (the elements before the first 16-byte boundary) and a scalar tail:
// rows that do not start on a 16-byte boundary, or whose length is not a multiple of a vector, keep
// vector loads for all but at most 2 * (16 / sizeof(T)) - 2 elements.
//
//   for_each_aligned<T>(row, n, vectorize, threadIdx.x, blockDim.x, [&]<int kVec>(int64_t i) {
//     const Vec<T, kVec> v = load_vec<T, kVec>(row + i);  // kVec: 1 (head, tail) or kVec16<T> (body)
//     ...
//   });
//
// A second operand walked alongside (an output row) may use the same offsets with vectors only when
// it has the same address modulo 16 (same_alignment); pass vectorize = false otherwise: every
// element is then a scalar piece. Each thread gets the same pieces for the same (n, alignment,
// thread count), so a pass that reads and a later pass that writes the same offsets touch the
// same elements from the same thread.
#pragma once

#include <cstdint>

#include "kernels/dtype.cuh"

namespace optimized::kernels {

struct AlignedSplit {
  int64_t head;  // scalar elements before the body
  int64_t vecs;  // 16-byte vectors of the body, from offset head
  int64_t tail;  // first element of the scalar tail (head + vecs * kVec16)
};

// The split of n elements of T at p (p aligned to sizeof(T)); vectorize false: all head.
template <typename T>
__host__ __device__ __forceinline__ AlignedSplit aligned_split(const T* p, int64_t n, bool vectorize = true) {
  if (!vectorize) return {n, 0, n};
  const int64_t off = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16) / static_cast<int64_t>(sizeof(T));
  int64_t head = off == 0 ? 0 : kVec16<T> - off;
  if (head > n) head = n;
  const int64_t vecs = (n - head) / kVec16<T>;
  return {head, vecs, head + vecs * kVec16<T>};
}

template <typename T>
__host__ __device__ __forceinline__ bool same_alignment(const T* a, const T* b) {
  return reinterpret_cast<uintptr_t>(a) % 16 == reinterpret_cast<uintptr_t>(b) % 16;
}

// f.template operator()<kVec>(offset) for every piece of the row owned by thread `tid` of `threads`:
// head and tail elements one by one (kVec = 1), body vectors (kVec = kVec16<T>), strided by threads.
template <typename T, typename F>
__device__ __forceinline__ void for_each_aligned(const T* p, int64_t n, bool vectorize, int tid, int threads, F&& f) {
  const AlignedSplit s = aligned_split(p, n, vectorize);
  for (int64_t i = tid; i < s.head; i += threads) f.template operator()<1>(i);
#pragma unroll 4  // several 16-byte loads in flight per thread
  for (int64_t v = tid; v < s.vecs; v += threads) f.template operator()<kVec16<T>>(s.head + v * kVec16<T>);
  for (int64_t i = s.tail + tid; i < n; i += threads) f.template operator()<1>(i);
}

}  // namespace optimized::kernels
