// What the CUDA rungs of the KV-cache family share (namespace optimized::cuda::kv_cache_cuda): the
// page lookup, the visible key range of a query, the score rule and reading one cache element or
// one 16-byte vector of a cache row as fp32 (fp8 e4m3 dequantized: fp8 * scale in fp32, as the cpu
// rung). Semantics exactly those of cpu/kv_cache_cpu.cpp:
//   query t of sequence b sits at pos_t = seq_len - q_len + t and sees keys j in
//   [max(0, pos_t - window_left), min(pos_t + 1, L)), L = seq_len clipped to [0, max_pages * page_size];
//   a key whose page index is outside [0, num_pages) is masked and never read;
//   s = scale * (q . k); soft-cap s = cap * tanh(s / cap); s -= slope * |pos_t - j|.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/common.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "kv_cache/kv_cache_params.h"

namespace optimized::cuda::kv_cache_cuda {

using namespace optimized::kernels;

// The byte of an fp8 e4m3 cache element (the pages' storage type on the fp8 path).
using Fp8 = uint8_t;

// The cache page of token `pos` of sequence b; -1 when the table or the cache has none.
__device__ __forceinline__ int64_t page_of(const KvCachePages& c, const KvPageTable& t, int64_t b, int64_t pos) {
  const int64_t p = pos / c.page_size;
  if (pos < 0 || p >= t.max_pages) return -1;
  const int64_t e = t.entries[b * t.row + p];
  return (e < 0 || e >= c.num_pages) ? -1 : e;
}

// The key range of one query and the sequence facts every rung needs.
struct QueryRange {
  int64_t pos, lo, hi;  // position; visible keys [lo, hi) (empty: lo >= hi)
};
__device__ __forceinline__ int64_t visible_len(const KvDecodeParams& p, int64_t b) {
  const int64_t capacity = p.table.max_pages * p.cache.page_size;
  const int64_t len = p.seq_lens[b];
  return len < 0 ? 0 : (len > capacity ? capacity : len);
}
__device__ __forceinline__ QueryRange query_range(const KvDecodeParams& p, int64_t seq_len, int64_t L, int64_t t) {
  QueryRange r;
  r.pos = seq_len - p.q_len + t;
  r.lo = p.window_left >= 0 ? (r.pos - p.window_left > 0 ? r.pos - p.window_left : 0) : 0;
  const int64_t top = r.pos + 1 < L ? r.pos + 1 : L;
  r.hi = top > r.lo ? top : r.lo;
  return r;
}

// The keys block `split` of `splits` reads for query rows r0 .. r0 + nrows - 1 (row r: query
// r % q_len): the union of the rows' visible ranges (a prefill chunk's row group sees the keys up to
// its last query only), cut into `splits` chunks of whole `tile`s, this split's [lo, hi) (empty: lo
// >= hi). The chunk is computed from the sequence's current length, so a launch planned once serves
// sequences that grow (a CUDA graph).
struct KeyChunk {
  int64_t lo, hi;
};
__device__ __forceinline__ KeyChunk block_key_chunk(const KvDecodeParams& p, int64_t seq_len, int64_t L, int64_t r0,
                                                    int64_t nrows, int64_t split, int64_t splits, int64_t tile) {
  int64_t klo = L, khi = 0;
  for (int64_t r = 0; r < nrows; ++r) {
    const QueryRange qr = query_range(p, seq_len, L, (r0 + r) % p.q_len);
    if (qr.hi > qr.lo) klo = qr.lo < klo ? qr.lo : klo, khi = qr.hi > khi ? qr.hi : khi;
  }
  const int64_t n = khi > klo ? khi - klo : 0;
  const int64_t chunk = ceil_div(ceil_div(n, splits), tile) * tile;
  const int64_t lo = klo + split * chunk;
  return {lo, lo + chunk < khi ? lo + chunk : khi};
}

// The score of dot = q . k for a query at `pos` and key j.
__device__ __forceinline__ float score(const KvDecodeParams& p, float dot, float slope, int64_t pos, int64_t j) {
  float s = static_cast<float>(p.scale) * dot;
  if (p.softcap > 0) {
    const float cap = static_cast<float>(p.softcap);
    s = cap * tanhf(s / cap);
  }
  if (slope != 0.0f) s -= slope * static_cast<float>(pos > j ? pos - j : j - pos);
  return s;
}

__device__ __forceinline__ float alibi_slope(const KvDecodeParams& p, int64_t b, int64_t h) {
  return p.alibi ? p.alibi[b * p.alibi_b + h] : 0.0f;
}

// One cache element as fp32.
template <typename C>
__device__ __forceinline__ float cache_to_float(C v, float scale) {
  if constexpr (std::is_same_v<C, Fp8>) {
    __nv_fp8_e4m3 f;
    f.__x = static_cast<__nv_fp8_storage_t>(v);
    return static_cast<float>(f) * scale;
  } else {
    return to_float(v);
  }
}

// The rows of a cache tensor: element `at` (elements of C).
template <typename C>
__device__ __forceinline__ const C* cache_ptr(const void* pages, int64_t at) {
  return static_cast<const C*>(pages) + at;
}

// Reads head_dim values of a cache row into dst (fp32, shared memory), `threads` threads from
// `tid`, 16-byte vectors when the row start is 16-byte aligned and head_dim a multiple of the vector.
template <typename C>
__device__ __forceinline__ void load_row(const C* src, int64_t head_dim, float scale, float* dst, int tid, int threads) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(C));
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 && head_dim % kVec == 0) {
    for (int64_t c = static_cast<int64_t>(tid) * kVec; c < head_dim; c += static_cast<int64_t>(threads) * kVec) {
      const Vec<C, kVec> v = load_vec<C, kVec>(src + c);
#pragma unroll
      for (int i = 0; i < kVec; ++i) dst[c + i] = cache_to_float<C>(v.v[i], scale);
    }
  } else {
    for (int64_t d = tid; d < head_dim; d += threads) dst[d] = cache_to_float<C>(src[d], scale);
  }
}

}  // namespace optimized::cuda::kv_cache_cuda
