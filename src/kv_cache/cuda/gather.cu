// The gather of prefill's attention path (kv_cache.cpp, paged_attention_prefill on CUDA): the K/V
// of every sequence copied out of its pages into packed (rows, H_kv, D) buffers of q's dtype for
// attention_varlen_forward (sequence b's key j at row cu_k[b] + j, L_b = seq_lens[b] clipped to
// [0, len]), and the offsets cu_q / cu_k themselves, written on the device so that an unvalidated
// call never reads seq_lens back. A key whose page is outside the table or the cache (unchecked
// mode) is gathered as zeros. fp8 e4m3 pages are dequantized (e4m3 * scale, rounded once to q's type).
//
// offsets_kernel: one block of 256 threads, a block-wide exclusive scan of the clipped lengths
// (cub::BlockScan) in slices of 256 sequences, a running carry between slices.
// gather_kernel: one warp per (sequence, row < len): the lanes move the row's H_kv * D elements
// (consecutive lanes, consecutive 16-byte vectors where the pages' strides allow, else elements:
// coalesced); rows past the sequence's length leave at once. Grid-stride past 2^20 blocks.
// lse_unpack_kernel: varlen's (H_q, B * q_len) lse into the caller's (B, H_q, q_len) view.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kv_cache/cuda/kv_cache_common.cuh"
#include "kv_cache/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using namespace optimized::cuda::kv_cache_cuda;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

__device__ __forceinline__ int64_t clipped_len(const KvGatherParams& g, int64_t b) {
  const int64_t L = g.seq_lens[b];
  return L < 0 ? 0 : (L > g.len ? g.len : L);
}

__global__ void __launch_bounds__(kScanThreads) offsets_kernel(const __grid_constant__ KvGatherParams g) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scratch;
  int64_t carry = 0;
  for (int64_t base = 0; base <= g.batch; base += kScanThreads) {  // b = batch writes the totals
    const int64_t b = base + threadIdx.x;
    const int64_t L = b < g.batch ? clipped_len(g, b) : 0;
    int64_t before = 0, slice = 0;
    Scan(scratch).ExclusiveSum(L, before, slice);
    if (b <= g.batch) {
      g.cu_k[b] = static_cast<int32_t>(carry + before);  // the host keeps batch * len < 2^31
      g.cu_q[b] = static_cast<int32_t>(b * g.q_len);
    }
    carry += slice;
    __syncthreads();  // the scratch is reused by the next slice
  }
}

// kVector: 8 elements a lane per access (16 bytes of T; 16 bytes of fp16 / bf16 pages, 8 of fp8), when
// head_dim and every page stride are multiples of 8 and the pages' bases aligned to the access.
template <typename T, typename C, bool kVector>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ KvGatherParams g) {
  const KvCachePages& c = g.cache;
  const int64_t rows = g.batch * g.len, HD = c.heads_kv * c.head_dim;
  const int lane = threadIdx.x % 32;
  constexpr int kVec = kVector ? 8 : 1;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t b = row / g.len, j = row % g.len;
    if (j >= clipped_len(g, b)) continue;
    const int64_t page = page_of(c, g.table, b, j);
    const int64_t dst = (g.cu_k[b] + j) * HD;
    T* ko = static_cast<T*>(g.k_out) + dst;
    T* vo = static_cast<T*>(g.v_out) + dst;
    const int64_t slot = j % c.page_size;
    for (int64_t i = lane * kVec; i < HD; i += 32 * kVec) {
      Vec<T, kVec> ky, vy;
      if (page < 0) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) ky.v[e] = vy.v[e] = from_float<T>(0.0f);
      } else {
        const int64_t h = i / c.head_dim, d = i % c.head_dim;
        const float ks = c.k_scale ? c.k_scale[h] : 1.0f, vs = c.v_scale ? c.v_scale[h] : 1.0f;
        const Vec<C, kVec> kx = load_vec<C, kVec>(cache_ptr<C>(c.k_pages, page * c.k_page + slot * c.k_slot + h * c.k_head) + d);
        const Vec<C, kVec> vx = load_vec<C, kVec>(cache_ptr<C>(c.v_pages, page * c.v_page + slot * c.v_slot + h * c.v_head) + d);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          ky.v[e] = from_float<T>(cache_to_float<C>(kx.v[e], ks));
          vy.v[e] = from_float<T>(cache_to_float<C>(vx.v[e], vs));
        }
      }
      store_vec<T, kVec>(ko + i, ky);
      store_vec<T, kVec>(vo + i, vy);
    }
  }
}

__global__ void __launch_bounds__(kThreads) lse_unpack_kernel(const float* packed, float* lse, int64_t batch,
                                                              int64_t heads, int64_t q_len, int64_t lse_b,
                                                              int64_t lse_h) {
  const int64_t n = heads * batch * q_len;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t h = i / (batch * q_len), r = i % (batch * q_len), b = r / q_len, t = r % q_len;
    lse[b * lse_b + h * lse_h + t] = packed[i];
  }
}

unsigned grid_for(int64_t items, int64_t per_block) {
  const int64_t need = ceil_div(items, per_block);
  return static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks);
}

}  // namespace

cudaError_t kv_cache_gather(const KvGatherParams& g, cudaStream_t stream) {
  if (g.batch <= 0) return cudaSuccess;
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(g);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int64_t rows = g.batch * g.len;
  if (rows <= 0) return cudaSuccess;
  const unsigned grid = grid_for(rows, kWarps);
  const KvCachePages& c = g.cache;
  const bool fp8 = c.dtype == DType::kF8E4M3;
  const auto access = static_cast<uintptr_t>(fp8 ? 8 : 8 * dtype_size(c.dtype));
  bool vector = c.head_dim % 8 == 0 && reinterpret_cast<uintptr_t>(c.k_pages) % access == 0 &&
                reinterpret_cast<uintptr_t>(c.v_pages) % access == 0;
  for (int64_t stride : {c.k_page, c.k_slot, c.k_head, c.v_page, c.v_slot, c.v_head}) vector = vector && stride % 8 == 0;
  return dispatch_float_dtype(g.dtype, [&]<typename T>() -> cudaError_t {
    if (fp8 && vector) gather_kernel<T, Fp8, true><<<grid, kThreads, 0, stream>>>(g);
    else if (fp8) gather_kernel<T, Fp8, false><<<grid, kThreads, 0, stream>>>(g);
    else if (vector) gather_kernel<T, T, true><<<grid, kThreads, 0, stream>>>(g);
    else gather_kernel<T, T, false><<<grid, kThreads, 0, stream>>>(g);
    return cudaGetLastError();
  });
}

cudaError_t kv_cache_lse_unpack(const float* packed, float* lse, int64_t batch, int64_t heads, int64_t q_len,
                                int64_t lse_b, int64_t lse_h, cudaStream_t stream) {
  const int64_t n = heads * batch * q_len;
  if (n <= 0) return cudaSuccess;
  lse_unpack_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(packed, lse, batch, heads, q_len, lse_b, lse_h);
  return cudaGetLastError();
}

}  // namespace optimized::cuda
