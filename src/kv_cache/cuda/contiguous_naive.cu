// Decode attention, CUDA rung 1: contiguous_naive, the lesson. One block per (sequence b, query
// head h, query t), two passes over the sequence's visible keys read through the page table:
//
//   pass 1  each thread takes keys j = tid, tid + 128, ...: s_j = score(q . k_j) with scalar loads
//           from global memory, the thread's maximum; the block's maximum m (NaN propagates);
//   pass 2  tiles of 128 keys: p_j = exp(s_j - m) (s_j computed again) into shared memory, l += p_j,
//           then the threads take the dimensions d: o_d += sum_j p_j v_j,d (scalar loads);
//           out = o / l, lse = m + log l; nothing visible (m = -inf): out 0, lse -inf.
//
// Why it is slow, and what paged fixes. Every K row is read twice (once per pass) and, with GQA,
// once for every query head and query of its group: a group of 4 heads with q_len 2 reads the
// cache 16 times where 1 would do. Loads are scalar (2 bytes per thread per step for fp16). paged
// serves the group's heads and queries from one read of each K / V row, in one pass (online
// softmax), with 16-byte loads. No workspace.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "kv_cache/cuda/kv_cache_common.cuh"
#include "kv_cache/kv_cache_config.h"
#include "kv_cache/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using namespace optimized::cuda::kv_cache_cuda;

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

template <typename T, typename C>
__device__ __forceinline__ float key_score(const KvDecodeParams& p, const T* q, int64_t b, int64_t g, int64_t page,
                                           int64_t j, float ks, float slope, int64_t pos) {
  const KvCachePages& c = p.cache;
  const C* k = cache_ptr<C>(c.k_pages, page * c.k_page + (j % c.page_size) * c.k_slot + g * c.k_head);
  float dot = 0.0f;
  for (int64_t d = 0; d < c.head_dim; ++d) dot = fmaf(to_float(q[d]), cache_to_float<C>(k[d], ks), dot);
  return score(p, dot, slope, pos, j);
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) naive_kernel(const __grid_constant__ KvDecodeParams p) {
  extern __shared__ float smem[];  // o: head_dim floats
  __shared__ float sp[kThreads];
  __shared__ unsigned char svis[kThreads];
  __shared__ int64_t spage[kThreads];
  __shared__ float scratch[kWarps][1];  // block_reduce (kernels/reduce.cuh)
  const KvCachePages& c = p.cache;
  const int64_t t = blockIdx.x % p.q_len, bh = blockIdx.x / p.q_len;
  const int64_t h = bh % p.heads_q, b = bh / p.heads_q, g = h / p.group();
  const int64_t seq_len = p.seq_lens[b], L = visible_len(p, b);
  const QueryRange qr = query_range(p, seq_len, L, t);
  const float slope = alibi_slope(p, b, h);
  const float ks = c.k_scale ? c.k_scale[g] : 1.0f, vs = c.v_scale ? c.v_scale[g] : 1.0f;
  const T* q = static_cast<const T*>(p.q) + b * p.q_b + t * p.q_t + h * p.q_h;
  const int64_t D = c.head_dim;

  // Pass 1: the maximum.
  float m = -INFINITY;
  for (int64_t j = qr.lo + threadIdx.x; j < qr.hi; j += kThreads) {
    const int64_t page = page_of(c, p.table, b, j);
    if (page < 0) continue;  // masked
    m = MaxOp::apply(m, key_score<T, C>(p, q, b, g, page, j, ks, slope, qr.pos));
  }
  m = block_reduce<MaxOp>(m, kThreads, scratch);  // NaN-propagating, every thread gets it

  // Pass 2: p_j, l, o.
  for (int64_t d = threadIdx.x; d < D; d += kThreads) smem[d] = 0.0f;
  float l = 0.0f;  // this thread's share
  if (m != -INFINITY) {
    for (int64_t j0 = qr.lo; j0 < qr.hi; j0 += kThreads) {
      const int64_t j = j0 + threadIdx.x;
      const int64_t page = j < qr.hi ? page_of(c, p.table, b, j) : -1;
      float pj = 0.0f;
      if (page >= 0) {
        pj = expf(key_score<T, C>(p, q, b, g, page, j, ks, slope, qr.pos) - m);
        l += pj;
      }
      sp[threadIdx.x] = pj;
      svis[threadIdx.x] = page >= 0;
      spage[threadIdx.x] = page;
      __syncthreads();
      const int64_t n = qr.hi - j0 < kThreads ? qr.hi - j0 : kThreads;
      for (int64_t d = threadIdx.x; d < D; d += kThreads) {
        float acc = smem[d];
        for (int64_t jj = 0; jj < n; ++jj) {
          if (!svis[jj]) continue;  // masked: never read
          const int64_t key = j0 + jj;
          const C* v = cache_ptr<C>(c.v_pages, spage[jj] * c.v_page + (key % c.page_size) * c.v_slot + g * c.v_head);
          acc = fmaf(sp[jj], cache_to_float<C>(v[d], vs), acc);
        }
        smem[d] = acc;
      }
      __syncthreads();
    }
  }
  // l over the block.
  const float total = block_reduce<SumOp>(l, kThreads, scratch);
  const bool empty = m == -INFINITY;
  T* out = static_cast<T*>(p.out) + b * p.out_b + t * p.out_t + h * p.out_h;
  const float inv = 1.0f / total;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) out[d] = from_float<T>(empty ? 0.0f : smem[d] * inv);
  if (p.lse && threadIdx.x == 0) p.lse[b * p.lse_b + h * p.lse_h + t] = empty ? -INFINITY : m + logf(total);
}

}  // namespace

cudaError_t kv_cache_contiguous_naive(const KvDecodeParams& p, const Workspace&, cudaStream_t stream) {
  const int64_t blocks = p.batch * p.heads_q * p.q_len;
  if (blocks <= 0) return cudaSuccess;
  if (blocks > 0x7fffffff || p.cache.head_dim > kv_cache_config::kMaxHeadDim) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(p.cache.head_dim) * sizeof(float);
  const bool fp8 = p.cache.dtype == DType::kF8E4M3;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    if (fp8) naive_kernel<T, Fp8><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
    else naive_kernel<T, T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
