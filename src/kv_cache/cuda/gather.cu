// The gather of prefill's attention path (kv_cache.cpp, paged_attention_prefill on CUDA): the K/V
// of every sequence copied out of its pages into contiguous (B, len, H_kv, D) buffers of q's dtype,
// right-aligned (sequence b's key j lands at row len - L_b + j, L_b = seq_lens[b] clipped to the
// pages), with a bool mask (B, len): true where a row holds a key that has a page. The rows before a
// sequence's start, and keys whose page is outside the table or the cache (unchecked mode), are
// zeros and masked: attention_forward (flash2, causal bottom-right) then sees each sequence's keys
// where the decode rule puts them, with the same positions relative to the chunk's queries.
// fp8 e4m3 pages are dequantized (e4m3 * scale, rounded once to q's type).
//
// One warp per (sequence, row): lane 0 looks the page up, the lanes move the row's H_kv * D
// elements (consecutive lanes, consecutive elements: coalesced), grid-stride past 2^20 blocks.
#include <cuda_runtime.h>

#include <cstdint>

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
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ KvGatherParams g) {
  const KvCachePages& c = g.cache;
  const int64_t rows = g.batch * g.len, HD = c.heads_kv * c.head_dim;
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t b = row / g.len, r = row % g.len;
    const int64_t capacity = g.table.max_pages * c.page_size;
    int64_t L = g.seq_lens[b];
    L = L < 0 ? 0 : (L > capacity ? capacity : L);
    const int64_t j = r - (g.len - L);  // the key this row holds (< 0: before the sequence's start)
    const int64_t page = j >= 0 ? page_of(c, g.table, b, j) : -1;
    T* ko = static_cast<T*>(g.k_out) + row * HD;
    T* vo = static_cast<T*>(g.v_out) + row * HD;
    if (lane == 0) g.mask[row] = page >= 0;
    if (page < 0) {
      for (int64_t i = lane; i < HD; i += 32) ko[i] = from_float<T>(0.0f), vo[i] = from_float<T>(0.0f);
      continue;
    }
    const int64_t slot = j % c.page_size;
    for (int64_t i = lane; i < HD; i += 32) {
      const int64_t h = i / c.head_dim, d = i % c.head_dim;
      const float ks = c.k_scale ? c.k_scale[h] : 1.0f, vs = c.v_scale ? c.v_scale[h] : 1.0f;
      const C kx = cache_ptr<C>(c.k_pages, page * c.k_page + slot * c.k_slot + h * c.k_head)[d];
      const C vx = cache_ptr<C>(c.v_pages, page * c.v_page + slot * c.v_slot + h * c.v_head)[d];
      ko[i] = from_float<T>(cache_to_float<C>(kx, ks));
      vo[i] = from_float<T>(cache_to_float<C>(vx, vs));
    }
  }
}

}  // namespace

cudaError_t kv_cache_gather(const KvGatherParams& g, cudaStream_t stream) {
  const int64_t rows = g.batch * g.len;
  if (rows <= 0) return cudaSuccess;
  const int64_t need = ceil_div(rows, int64_t{kWarps});
  const unsigned grid = static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks);
  const bool fp8 = g.cache.dtype == DType::kF8E4M3;
  return dispatch_float_dtype(g.dtype, [&]<typename T>() -> cudaError_t {
    if (fp8) gather_kernel<T, Fp8><<<grid, kThreads, 0, stream>>>(g);
    else gather_kernel<T, T><<<grid, kThreads, 0, stream>>>(g);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
