// The mainloop of the paged rungs (paged.cu, paged_split.cu): one block per (sequence b, kv head g,
// row group, split) serves a group of query rows r = hh * q_len + t (the GQA group's query heads hh
// times the q_len queries) from one read of each K / V row of its key range, with online softmax.
//
//   block    kDecodeThreads (128) threads; rows: up to kMaxRowsPerBlock of the group's G * q_len
//            (more: several row groups, grid.y, each reading the keys again); keys: the union of
//            the rows' visible ranges, cut into grid.z = p.splits chunks (split s takes chunk s,
//            a multiple of kKeyTile keys; chunk = ceil(n / splits) computed from the sequence's
//            length on the device, so one launch serves sequences that grow, as a CUDA graph does)
//   per tile of kKeyTile = 32 keys:
//     1. page lookup of each key (a page index outside the table or [0, num_pages): masked, the
//        key is never read)
//     2. K and V rows -> shared memory as fp32, one warp per key, 16-byte vector loads when the row
//        is aligned (fp8 e4m3 dequantized in registers: fp8 * scale)
//     3. scores S[r][jj] = score(q_r . k_jj), one thread per (row, key); visibility per (row, key)
//     4. online softmax, one warp per row (lane = key): m, l, and P[r][jj] = exp(S - m) in place
//     5. O[r][:] = alpha_r O[r][:] + sum over visible keys P[r][jj] V[jj][:], one thread per (r, d)
//        (a key a row does not see is skipped, never multiplied by 0: a NaN stays where it is)
//   end: out = O / l and lse = m + log l (direct, splits == 1), or the split's normalized partial
//        (out, lse) into the workspace for the merge (paged_split.cu).
// Shared memory rows have head_dim + 1 floats (odd: the (row, key) dot products of a warp hit 32
// different banks). fp32 math throughout, as the cpu rung.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/device_facts.h"
#include "kernels/common.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "kv_cache/cuda/kv_cache_common.cuh"
#include "kv_cache/cuda/split_merge.cuh"
#include "kv_cache/kv_cache_config.h"

namespace optimized::cuda::kv_cache_cuda {

using kv_cache_config::kDecodeThreads;
using kv_cache_config::kKeyTile;
using kv_cache_config::kMaxRowsPerBlock;
static_assert(kKeyTile == 32, "the softmax step gives one key to each lane of a warp");
static_assert(kDecodeThreads % 32 == 0, "whole warps");

// The shared memory of a block serving `rows` rows of head_dim D.
struct TileSmem {
  int64_t dp, rows;
  __host__ __device__ TileSmem(int64_t D, int64_t rows_) : dp(D + 1), rows(rows_) {}
  __host__ __device__ int64_t floats() const { return (2 * rows + 2 * kKeyTile) * dp + rows * kKeyTile + 3 * rows; }
  __host__ __device__ int64_t floats_even() const { return (floats() + 1) / 2 * 2; }
  __host__ __device__ size_t bytes() const {
    return static_cast<size_t>(floats_even()) * 4 + kKeyTile * 8 + static_cast<size_t>(rows) * kKeyTile;
  }
};

// The rows per block for p on a device whose blocks may use `smem_optin` bytes; 0: none fits.
inline int64_t rows_per_block(const KvDecodeParams& p, int smem_optin) {
  int64_t r = p.group() * p.q_len;
  if (r > kMaxRowsPerBlock) r = kMaxRowsPerBlock;
  while (r > 0 && TileSmem(p.cache.head_dim, r).bytes() > static_cast<size_t>(smem_optin)) --r;
  return r;
}

template <typename T, typename C>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_tile_kernel(const __grid_constant__ KvDecodeParams p, int rows_per_block, SplitOut split_out) {
  extern __shared__ __align__(16) float smem[];
  const KvCachePages& c = p.cache;
  const int64_t D = c.head_dim, G = p.group(), Q = p.q_len;
  const TileSmem lay(D, rows_per_block);
  const int64_t dp = lay.dp;
  float* sq = smem;                            // (rows, dp)
  float* so = sq + rows_per_block * dp;        // (rows, dp)
  float* sk = so + rows_per_block * dp;        // (kKeyTile, dp)
  float* sv = sk + kKeyTile * dp;              // (kKeyTile, dp)
  float* ss = sv + kKeyTile * dp;              // (rows, kKeyTile): scores, then probabilities
  float* sm = ss + rows_per_block * kKeyTile;  // (rows)
  float* sl = sm + rows_per_block;             // (rows)
  float* salpha = sl + rows_per_block;         // (rows)
  int64_t* spage = reinterpret_cast<int64_t*>(smem + lay.floats_even());  // (kKeyTile)
  unsigned char* svis = reinterpret_cast<unsigned char*>(spage + kKeyTile);  // (rows, kKeyTile)

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  constexpr int kWarps = kDecodeThreads / 32;
  const int64_t b = blockIdx.x / c.heads_kv, g = blockIdx.x % c.heads_kv;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_block;
  const int64_t nrows = G * Q - r0 < rows_per_block ? G * Q - r0 : rows_per_block;
  const int64_t split = blockIdx.z, splits = gridDim.z;
  const int64_t seq_len = p.seq_lens[b], L = visible_len(p, b);

  // The keys of the block's rows, this split's chunk of them (whole tiles).
  const KeyChunk keys = block_key_chunk(p, seq_len, L, r0, nrows, split, splits, kKeyTile);
  const int64_t s_lo = keys.lo, s_hi = keys.hi;

  // q rows (fp32), O = 0, m = -inf, l = 0.
  for (int64_t i = tid; i < nrows * D; i += kDecodeThreads) {
    const int64_t r = i / D, d = i % D, rg = r0 + r, t = rg % Q, h = g * G + rg / Q;
    sq[r * dp + d] = to_float(static_cast<const T*>(p.q)[b * p.q_b + t * p.q_t + h * p.q_h + d]);
    so[r * dp + d] = 0.0f;
  }
  for (int64_t r = tid; r < nrows; r += kDecodeThreads) sm[r] = -INFINITY, sl[r] = 0.0f;
  const float ks = c.k_scale ? c.k_scale[g] : 1.0f, vs = c.v_scale ? c.v_scale[g] : 1.0f;

  for (int64_t j0 = s_lo; j0 < s_hi; j0 += kKeyTile) {
    __syncthreads();  // the previous tile's readers are done
    // 1. pages.
    if (tid < kKeyTile) spage[tid] = j0 + tid < s_hi ? page_of(c, p.table, b, j0 + tid) : -1;
    __syncthreads();
    // 2. K and V rows, one warp per key.
    for (int jj = warp; jj < kKeyTile; jj += kWarps) {
      const int64_t page = spage[jj];
      if (page < 0) continue;
      const int64_t slot = (j0 + jj) % c.page_size;
      load_row<C>(cache_ptr<C>(c.k_pages, page * c.k_page + slot * c.k_slot + g * c.k_head), D, ks, sk + jj * dp, lane, 32);
      load_row<C>(cache_ptr<C>(c.v_pages, page * c.v_page + slot * c.v_slot + g * c.v_head), D, vs, sv + jj * dp, lane, 32);
    }
    __syncthreads();
    // 3. scores.
    for (int64_t i = tid; i < nrows * kKeyTile; i += kDecodeThreads) {
      const int64_t r = i / kKeyTile, jj = i % kKeyTile, j = j0 + jj;
      const int64_t rg = r0 + r, t = rg % Q, h = g * G + rg / Q;
      const QueryRange qr = query_range(p, seq_len, L, t);
      const bool vis = spage[jj] >= 0 && j >= qr.lo && j < qr.hi;
      float s = -INFINITY;
      if (vis) {
        float dot = 0.0f;
        const float* qrow = sq + r * dp;
        const float* krow = sk + jj * dp;
        for (int64_t d = 0; d < D; ++d) dot = fmaf(qrow[d], krow[d], dot);
        s = score(p, dot, alibi_slope(p, b, h), qr.pos, j);
      }
      ss[i] = s;
      svis[i] = vis;
    }
    __syncthreads();
    // 4. online softmax, one warp per row, lane = key.
    for (int64_t r = warp; r < nrows; r += kWarps) {
      const int64_t i = r * kKeyTile + lane;
      const bool vis = svis[i] != 0;
      const float s = ss[i];
      float mx = vis ? s : -INFINITY;
      mx = warp_reduce<MaxOp>(mx);
      const float m_old = sm[r];
      const float m_new = MaxOp::apply(m_old, mx);
      const float alpha = m_new == -INFINITY ? 1.0f : expf(m_old - m_new);
      const float pj = (vis && m_new != -INFINITY) ? expf(s - m_new) : 0.0f;
      const float sum = warp_reduce<SumOp>(pj);
      ss[i] = pj;
      __syncwarp();
      if (lane == 0) {
        sm[r] = m_new;
        sl[r] = sl[r] * alpha + sum;
        salpha[r] = alpha;
      }
    }
    __syncthreads();
    // 5. O = alpha O + P V.
    for (int64_t i = tid; i < nrows * D; i += kDecodeThreads) {
      const int64_t r = i / D, d = i % D;
      float acc = so[r * dp + d] * salpha[r];
      const float* prow = ss + r * kKeyTile;
      const unsigned char* vrow = svis + r * kKeyTile;
#pragma unroll 8
      for (int jj = 0; jj < kKeyTile; ++jj)
        if (vrow[jj]) acc = fmaf(prow[jj], sv[jj * dp + d], acc);
      so[r * dp + d] = acc;
    }
  }
  __syncthreads();

  // The block's rows: out and lse, or the split's partials.
  for (int64_t i = tid; i < nrows * D; i += kDecodeThreads) {
    const int64_t r = i / D, d = i % D, rg = r0 + r, t = rg % Q, h = g * G + rg / Q;
    const bool empty = sm[r] == -INFINITY;
    const float v = empty ? 0.0f : so[r * dp + d] / sl[r];
    if (split_out.o) {
      const int64_t row = (b * p.heads_q + h) * Q + t;
      split_out.o[(row * splits + split) * D + d] = v;
    } else {
      static_cast<T*>(p.out)[b * p.out_b + t * p.out_t + h * p.out_h + d] = from_float<T>(v);
    }
  }
  for (int64_t r = tid; r < nrows; r += kDecodeThreads) {
    const int64_t rg = r0 + r, t = rg % Q, h = g * G + rg / Q;
    const float lse = sm[r] == -INFINITY ? -INFINITY : sm[r] + logf(sl[r]);
    if (split_out.o) split_out.lse[((b * p.heads_q + h) * Q + t) * splits + split] = lse;
    else if (p.lse) p.lse[b * p.lse_b + h * p.lse_h + t] = lse;
  }
}

// Launches decode_tile_kernel for p with `splits` key chunks (1: direct to out / lse).
template <typename T, typename C>
cudaError_t launch_decode_tile(const KvDecodeParams& p, int64_t splits, SplitOut split_out, cudaStream_t stream) {
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
  const int64_t rows = rows_per_block(p, facts->max_smem_per_block_optin);
  if (rows < 1 || p.cache.head_dim > kv_cache_config::kMaxHeadDim) return cudaErrorInvalidValue;
  const size_t smem = TileSmem(p.cache.head_dim, rows).bytes();
  // The opt-in above 48 KiB, once per device for this instantiation (a function attribute, not a
  // stream operation: also legal while a stream is being captured).
  static std::atomic<uint64_t> opted{0};
  const uint64_t bit = uint64_t{1} << (facts->ordinal & 63);
  if (smem > 48 * 1024 && !(opted.load(std::memory_order_relaxed) & bit)) {
    if (cudaError_t e = cudaFuncSetAttribute(decode_tile_kernel<T, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             facts->max_smem_per_block_optin);
        e != cudaSuccess)
      return e;
    opted.fetch_or(bit, std::memory_order_relaxed);
  }
  const int64_t groups = ceil_div(p.group() * p.q_len, rows);
  const int64_t x = p.batch * p.cache.heads_kv;
  if (x > 0x7fffffff || groups > kMaxGridY || splits < 1 || splits > kMaxGridZ) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(groups), static_cast<unsigned>(splits));
  decode_tile_kernel<T, C><<<grid, kDecodeThreads, smem, stream>>>(p, static_cast<int>(rows), split_out);
  return cudaGetLastError();
}

}  // namespace optimized::cuda::kv_cache_cuda
