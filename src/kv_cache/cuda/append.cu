// append_kv on CUDA: one kernel, used by every CUDA variant of the KV-cache family.
//
// One block per new token (b, s) (grid-stride over the tokens past 2^20 blocks). The RoPE angle
// depends only on (position, pair index), so the block computes cos / sin of its token's
// rotary_dim / 2 pairs once, into shared memory, and every row of the token uses that table: the
// H_kv K rows written to the cache, and the H_q q rows rotated in place (when q is given with RoPE).
// The V rows need no table: they are copied while the table is being computed (phase 1), then one
// barrier, then the K and q rows (phase 2). Each thread moves one 16-byte vector of a row per step
// (for neox: a vector and its rotation partner half a rotary_dim further), the (row, vector) items
// of a phase spread over all threads of the block. Compared with the former warp per (token, head)
// -- half the lanes idle at D = 128 bf16, powf + cosf + sinf per element pair of every row, 64-bit
// div / mod per row -- the trig is done (H_kv + H_q) times less often and every thread moves a
// full vector; indices inside a token are 32-bit. Measured on the H100 (bench/benchmark_kv_cache.py,
// bench/results/h100/python-kv_cache.json): B = 16, S_new = 1024, H_kv = 8, H_q = 32, D = 128,
// bf16, neox on K and q: 162 us for 403 MB, 2.49 TB/s, 0.84x the copy ceiling (the former kernel:
// 1199 us); one token per sequence, B = 1..128: 9-15 us (one launch). A standalone harness also
// timed the same chunk into an fp8 cache at 219 us (likely the fp64 division per element; not
// profiled).
// Output bit-identical to the former kernel on every tested shape (aligned, scalar fallbacks).
//
// Semantics those of cpu/kv_cache_cpu.cpp:
//   position p = positions[b][s] < 0: padding, nothing happens (q not rotated either);
//   page = page_table[b][p / page_size] outside the table or [0, num_pages): the K / V rows are not
//   written (unchecked mode stays inside the cache), q is still rotated;
//   RoPE as the cpu rung, the angles of src/kernels/rope.h (shared with the fused family's rope):
//   p * theta^(-2i / rotary_dim) formed and reduced modulo 2 pi in fp64, then sincosf (full
//   precision) of the reduced fp32 argument -- exact to fp32 at any position (the former fp32
//   angle carried a few 1e-3 rad at p ~ 32k);
//   rotary_dim < head_dim: the tail passes through; RopeLayout::kNone: no trig at all;
//   fp8: e4m3(x / scale) with the division in fp64 (as the cpu rung) and the saturating conversion
//   (__NV_SATFINITE: +-448, NaN kept).
// Vectors are used per tensor (k, v, q) when the launcher finds every row of it 16-byte aligned
// (pointer and strides; cache rows aligned to the converted vector) and the rotary split on vector
// boundaries; otherwise that tensor's rows go one element (one rotation pair) per item.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/rope.h"
#include "kv_cache/cuda/kv_cache_common.cuh"
#include "kv_cache/kv_cache_config.h"
#include "kv_cache/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using namespace optimized::cuda::kv_cache_cuda;

constexpr int kThreads = 128;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr int kMaxPairs = static_cast<int>(kv_cache_config::kMaxHeadDim / 2);

// x (fp32) to the cache element type.
template <typename C>
__device__ __forceinline__ C to_cache(float x, float scale) {
  if constexpr (std::is_same_v<C, Fp8>) {
    const double y = static_cast<double>(x) / static_cast<double>(scale);
    return static_cast<Fp8>(__nv_cvt_double_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
  } else {
    return from_float<C>(x);
  }
}

// What the launcher works out once: which tensors go by vectors, and the row geometry.
struct Plan {
  bool k_vec, v_vec, q_vec;  // rows of k / v / q moved as 16-byte vectors
  bool rope, neox;
  int D, rd, half;           // head_dim, rotary_dim (0 without RoPE), rotary_dim / 2
};

// Items of one row: vector path: rotation vectors (neox: the first half only, each with its partner)
// then pass-through vectors; scalar path: rotation pairs then pass-through elements.
template <typename T>
__device__ __forceinline__ int row_items(const Plan& g, bool vec, bool rotate) {
  constexpr int kVec = kVec16<T>;
  if (vec) return rotate ? (g.neox ? g.half : g.rd) / kVec + (g.D - g.rd) / kVec : g.D / kVec;
  return rotate ? g.half + (g.D - g.rd) : g.D;
}

// Item j of a row: reads src (T), rotates with the table (cs, sn) when `rotate`, writes dst as C
// (dst may alias src for q).
template <typename T, typename C>
__device__ __forceinline__ void move_item(const T* src, C* dst, int j, const Plan& g, bool vec, bool rotate,
                                          float scale, const float* cs, const float* sn) {
  constexpr int kVec = kVec16<T>;
  if (vec) {
    const int nrot = rotate ? (g.neox ? g.half : g.rd) / kVec : 0;
    if (j < nrot) {
      const int c = j * kVec;
      const Vec<T, kVec> a = load_vec_once<T, kVec>(src + c);
      Vec<C, kVec> out;
      if (g.neox) {
        const Vec<T, kVec> b = load_vec_once<T, kVec>(src + c + g.half);
        Vec<C, kVec> out_b;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float co = cs[c + i], si = sn[c + i];
          const float x0 = to_float(a.v[i]), x1 = to_float(b.v[i]);
          out.v[i] = to_cache<C>(x0 * co - x1 * si, scale);
          out_b.v[i] = to_cache<C>(x1 * co + x0 * si, scale);
        }
        store_vec<C, kVec>(dst + c + g.half, out_b);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; i += 2) {
          const float co = cs[(c + i) / 2], si = sn[(c + i) / 2];
          const float x0 = to_float(a.v[i]), x1 = to_float(a.v[i + 1]);
          out.v[i] = to_cache<C>(x0 * co - x1 * si, scale);
          out.v[i + 1] = to_cache<C>(x1 * co + x0 * si, scale);
        }
      }
      store_vec<C, kVec>(dst + c, out);
      return;
    }
    const int c = (rotate ? g.rd : 0) + (j - nrot) * kVec;
    const Vec<T, kVec> a = load_vec_once<T, kVec>(src + c);
    Vec<C, kVec> out;
#pragma unroll
    for (int i = 0; i < kVec; ++i) out.v[i] = to_cache<C>(to_float(a.v[i]), scale);
    store_vec<C, kVec>(dst + c, out);
    return;
  }
  const int npairs = rotate ? g.half : 0;
  if (j < npairs) {
    const int i0 = g.neox ? j : 2 * j, i1 = g.neox ? j + g.half : 2 * j + 1;
    const float co = cs[j], si = sn[j];
    const float x0 = to_float(src[i0]), x1 = to_float(src[i1]);
    dst[i0] = to_cache<C>(x0 * co - x1 * si, scale);
    dst[i1] = to_cache<C>(x1 * co + x0 * si, scale);
    return;
  }
  const int d = (rotate ? g.rd : 0) + (j - npairs);
  dst[d] = to_cache<C>(to_float(src[d]), scale);
}

// The items of two groups of rows (rows0 rows of per0 items, then rows1 rows of per1 items) spread
// over the block's threads: f0(row, item), f1(row, item).
template <class F0, class F1>
__device__ __forceinline__ void for_items(int rows0, int per0, const F0& f0, int rows1, int per1, const F1& f1) {
  const int n0 = rows0 * per0, n = n0 + rows1 * per1;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kThreads) {
    if (i < n0) {
      const int r = i / per0;
      f0(r, i - r * per0);
    } else {
      const int k = i - n0, r = k / per1;
      f1(r, k - r * per1);
    }
  }
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) append_kernel(const __grid_constant__ KvAppendParams p, const Plan g) {
  __shared__ float cs[kMaxPairs], sn[kMaxPairs];
  const KvCachePages& c = p.cache;
  const int64_t tokens = p.table.batch * p.new_tokens;
  const int heads_kv = static_cast<int>(c.heads_kv);
  const int heads_q = p.q && g.rope ? static_cast<int>(p.heads_q) : 0;
  const int k_per = row_items<T>(g, g.k_vec, g.rope), v_per = row_items<T>(g, g.v_vec, false);
  const int q_per = row_items<T>(g, g.q_vec, true);
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    int64_t b, s;
    if (tokens <= INT32_MAX) {
      const uint32_t t32 = static_cast<uint32_t>(token), n32 = static_cast<uint32_t>(p.new_tokens);
      b = t32 / n32, s = t32 - static_cast<uint32_t>(b) * n32;
    } else {
      b = token / p.new_tokens, s = token - b * p.new_tokens;
    }
    const int32_t pos = p.positions[b * p.pos_b + s];
    if (pos < 0) continue;  // padding (block-uniform)
    // The page: page_of's rule, with a 32-bit division (pos < 2^31).
    int64_t page = -1, slot = 0;
    {
      int64_t pi;
      if (c.page_size <= INT32_MAX) {
        const uint32_t ps = static_cast<uint32_t>(c.page_size);
        const uint32_t q32 = static_cast<uint32_t>(pos) / ps;
        pi = q32, slot = static_cast<uint32_t>(pos) - q32 * ps;
      } else {
        pi = 0, slot = pos;
      }
      if (pi < p.table.max_pages) {
        const int64_t e = p.table.entries[b * p.table.row + pi];
        if (e >= 0 && e < c.num_pages) page = e;
      }
    }
    const bool write_kv = page >= 0;  // unchecked mode: outside the table or the cache
    const bool table = g.rope && (write_kv || heads_q > 0);
    if (table) {  // cos / sin of the token's rotation pairs, shared by all its rows
      for (int i = static_cast<int>(threadIdx.x); i < g.half; i += kThreads) {
        const double r = rope_reduced_angle(pos, rope_inv_freq(i, g.rd, p.rope_theta));  // kernels/rope.h
        sincosf(static_cast<float>(r), &sn[i], &cs[i]);
      }
    }
    const T* k = static_cast<const T*>(p.k) + b * p.k_b + s * p.k_s;
    const T* v = static_cast<const T*>(p.v) + b * p.v_b + s * p.v_s;
    const int64_t pg = write_kv ? page : 0;  // no K / V row is touched when !write_kv
    C* kd = static_cast<C*>(c.k_pages) + pg * c.k_page + slot * c.k_slot;
    C* vd = static_cast<C*>(c.v_pages) + pg * c.v_page + slot * c.v_slot;
    T* q = p.q ? static_cast<T*>(p.q) + b * p.q_b + s * p.q_s : nullptr;
    const auto k_row = [&](int h, int j) {
      move_item<T, C>(k + h * p.k_h, kd + h * c.k_head, j, g, g.k_vec, g.rope, c.k_scale ? c.k_scale[h] : 1.0f,
                      cs, sn);
    };
    const auto v_row = [&](int h, int j) {
      move_item<T, C>(v + h * p.v_h, vd + h * c.v_head, j, g, g.v_vec, false, c.v_scale ? c.v_scale[h] : 1.0f,
                      cs, sn);
    };
    const auto q_row = [&](int h, int j) {
      T* r = q + h * p.q_h;
      move_item<T, T>(r, r, j, g, g.q_vec, true, 1.0f, cs, sn);
    };
    const int kv_rows = write_kv ? heads_kv : 0;
    if (!g.rope) {  // no table: K and V in one pass
      for_items(kv_rows, k_per, k_row, kv_rows, v_per, v_row);
      continue;
    }
    // Phase 1: V (needs no table) while the table is computed; phase 2: K and q.
    for_items(kv_rows, v_per, v_row, 0, 1, v_row);
    if (!table) continue;
    __syncthreads();
    for_items(kv_rows, k_per, k_row, heads_q, q_per, q_row);
    if (token + gridDim.x < tokens) __syncthreads();  // the next token rewrites the table
  }
}

// Whether every row base + sum_i idx_i * stride_i (idx_i < count_i; strides in elements of `elem`
// bytes) is aligned to `bytes`: the base and the stride of each dimension of more than one entry.
bool rows_aligned(const void* base, size_t elem, int64_t bytes, std::initializer_list<std::pair<int64_t, int64_t>> dims) {
  if (reinterpret_cast<uintptr_t>(base) % static_cast<uintptr_t>(bytes) != 0) return false;
  for (const auto& [count, stride] : dims)
    if (count > 1 && (stride * static_cast<int64_t>(elem)) % bytes != 0) return false;
  return true;
}

}  // namespace

cudaError_t kv_cache_append(const KvAppendParams& p, const Workspace&, cudaStream_t stream) {
  const KvCachePages& c = p.cache;
  const int64_t tokens = p.table.batch * p.new_tokens;
  if (tokens <= 0 || c.heads_kv <= 0) return cudaSuccess;
  if (c.head_dim > kv_cache_config::kMaxHeadDim || c.head_dim <= 0) return cudaErrorInvalidValue;
  const bool rope = p.rope != RopeLayout::kNone;
  if (rope && (p.rotary_dim < 2 || p.rotary_dim > c.head_dim || p.rotary_dim % 2 != 0)) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(tokens < kMaxBlocks ? tokens : kMaxBlocks);
  const bool fp8 = c.dtype == DType::kF8E4M3;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    constexpr int kVec = kVec16<T>;
    const size_t cache_elem = fp8 ? 1 : sizeof(T);
    Plan g;
    g.rope = rope;
    g.neox = p.rope == RopeLayout::kNeox;
    g.D = static_cast<int>(c.head_dim);
    g.rd = rope ? static_cast<int>(p.rotary_dim) : 0;
    g.half = g.rd / 2;
    const bool d_ok = g.D % kVec == 0;
    const bool rot_ok = !rope || (g.rd % kVec == 0 && (!g.neox || g.half % kVec == 0));
    const int64_t cache_bytes = static_cast<int64_t>(kVec * cache_elem);
    const int64_t B = p.table.batch, S = p.new_tokens, H = c.heads_kv;
    const bool k_cache = rows_aligned(c.k_pages, cache_elem, cache_bytes,
                                      {{c.num_pages, c.k_page}, {c.page_size, c.k_slot}, {H, c.k_head}});
    const bool v_cache = rows_aligned(c.v_pages, cache_elem, cache_bytes,
                                      {{c.num_pages, c.v_page}, {c.page_size, c.v_slot}, {H, c.v_head}});
    g.k_vec = d_ok && rot_ok && k_cache && rows_aligned(p.k, sizeof(T), 16, {{B, p.k_b}, {S, p.k_s}, {H, p.k_h}});
    g.v_vec = d_ok && v_cache && rows_aligned(p.v, sizeof(T), 16, {{B, p.v_b}, {S, p.v_s}, {H, p.v_h}});
    g.q_vec = d_ok && rot_ok && p.q != nullptr &&
              rows_aligned(p.q, sizeof(T), 16, {{B, p.q_b}, {S, p.q_s}, {p.heads_q, p.q_h}});
    if (fp8) append_kernel<T, Fp8><<<grid, kThreads, 0, stream>>>(p, g);
    else append_kernel<T, T><<<grid, kThreads, 0, stream>>>(p, g);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
