// append_kv on CUDA: one kernel, used by every CUDA variant of the KV-cache family.
//
// One warp per row: (token (b, s), head) with head < H_kv a K and V row into the cache, head >= H_kv
// a q row rotated in place (when q is given with RoPE). Semantics those of cpu/kv_cache_cpu.cpp:
//   position p = positions[b][s] < 0: padding, nothing happens (q not rotated either);
//   page = page_table[b][p / page_size] outside the table or [0, num_pages): the K / V rows are not
//   written (unchecked mode stays inside the cache), q is still rotated;
//   RoPE in fp32 exactly as the cpu rung: inv_freq = powf(theta, -(2i) / rotary_dim),
//   angle = float(p) * inv_freq, cosf / sinf (full-precision, not the __cosf intrinsics; at p ~ 32k
//   the fp32 angle carries an absolute error of a few 1e-3 rad, the same as the cpu rung's);
//   fp8: e4m3(x / scale) with the division in fp64 (as the cpu rung) and the saturating conversion
//   (__NV_SATFINITE: +-448, NaN kept).
// Lanes move 16-byte vectors of the row when the rows are 16-byte aligned and the rotary split
// falls on vector boundaries; otherwise one element (one rotation pair) per lane and step.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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

struct Rope {
  bool on;
  bool neox;
  int64_t half, rotary_dim;
  float theta;
  float pos;
  // cos / sin of pair i.
  __device__ __forceinline__ void angle(int64_t i, float& c, float& s) const {
    const float inv_freq = powf(theta, -static_cast<float>(2 * i) / static_cast<float>(rotary_dim));
    const float a = pos * inv_freq;
    c = cosf(a);
    s = sinf(a);
  }
};

// Reads a row of T, rotates it, writes it as C (dst may alias src for q).
template <typename T, typename C>
__device__ void move_row(const T* src, C* dst, int64_t D, const Rope& r, float scale, int lane) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // 4 (fp32) or 8 (fp16 / bf16)
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % (kVec * sizeof(C)) == 0 && D % kVec == 0 &&
                       (!r.on || (r.rotary_dim % kVec == 0 && (!r.neox || r.half % kVec == 0)));
  if (aligned) {
    for (int64_t c = static_cast<int64_t>(lane) * kVec; c < D; c += 32 * kVec) {
      if (r.on && r.neox && c >= r.half && c < r.rotary_dim) continue;  // done with its partner chunk
      const Vec<T, kVec> a = load_vec<T, kVec>(src + c);
      float x[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) x[i] = to_float(a.v[i]);
      Vec<C, kVec> out;
      if (r.on && r.neox && c < r.half) {
        const Vec<T, kVec> b = load_vec<T, kVec>(src + c + r.half);
        Vec<C, kVec> out_b;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          float co, si;
          r.angle(c + i, co, si);
          const float x0 = x[i], x1 = to_float(b.v[i]);
          out.v[i] = to_cache<C>(x0 * co - x1 * si, scale);
          out_b.v[i] = to_cache<C>(x1 * co + x0 * si, scale);
        }
        store_vec<C, kVec>(dst + c + r.half, out_b);
      } else if (r.on && !r.neox && c < r.rotary_dim) {
#pragma unroll
        for (int i = 0; i < kVec; i += 2) {
          float co, si;
          r.angle((c + i) / 2, co, si);
          const float x0 = x[i], x1 = x[i + 1];
          out.v[i] = to_cache<C>(x0 * co - x1 * si, scale);
          out.v[i + 1] = to_cache<C>(x1 * co + x0 * si, scale);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) out.v[i] = to_cache<C>(x[i], scale);
      }
      store_vec<C, kVec>(dst + c, out);
    }
    return;
  }
  // Scalar: rotation pairs, then the dimensions that pass through.
  const int64_t rd = r.on ? r.rotary_dim : 0;
  for (int64_t i = lane; i < rd / 2; i += 32) {
    const int64_t i0 = r.neox ? i : 2 * i, i1 = r.neox ? i + r.half : 2 * i + 1;
    float co, si;
    r.angle(i, co, si);
    const float x0 = to_float(src[i0]), x1 = to_float(src[i1]);
    dst[i0] = to_cache<C>(x0 * co - x1 * si, scale);
    dst[i1] = to_cache<C>(x1 * co + x0 * si, scale);
  }
  for (int64_t d = rd + lane; d < D; d += 32) dst[d] = to_cache<C>(to_float(src[d]), scale);
}

template <typename T, typename C>
__global__ void __launch_bounds__(kThreads) append_kernel(const __grid_constant__ KvAppendParams p) {
  const KvCachePages& c = p.cache;
  const int64_t heads = c.heads_kv + ((p.q && p.rope != RopeLayout::kNone) ? p.heads_q : 0);
  const int64_t rows = p.table.batch * p.new_tokens * heads;
  const int lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t h = row % heads, token = row / heads;
    const int64_t b = token / p.new_tokens, s = token % p.new_tokens;
    const int64_t pos = p.positions[b * p.pos_b + s];
    if (pos < 0) continue;  // padding (warp-uniform)
    Rope r;
    r.on = p.rope != RopeLayout::kNone;
    r.neox = p.rope == RopeLayout::kNeox;
    r.rotary_dim = p.rotary_dim;
    r.half = p.rotary_dim / 2;
    r.theta = static_cast<float>(p.rope_theta);
    r.pos = static_cast<float>(pos);
    if (h >= c.heads_kv) {  // q, in place, whatever the cache holds for the token
      T* q = static_cast<T*>(p.q) + b * p.q_b + s * p.q_s + (h - c.heads_kv) * p.q_h;
      move_row<T, T>(q, q, c.head_dim, r, 1.0f, lane);
      continue;
    }
    const int64_t page = page_of(c, p.table, b, pos);
    if (page < 0) continue;  // unchecked mode: outside the table or the cache
    const int64_t slot = pos % c.page_size;
    const T* k = static_cast<const T*>(p.k) + b * p.k_b + s * p.k_s + h * p.k_h;
    const T* v = static_cast<const T*>(p.v) + b * p.v_b + s * p.v_s + h * p.v_h;
    C* kd = static_cast<C*>(c.k_pages) + page * c.k_page + slot * c.k_slot + h * c.k_head;
    C* vd = static_cast<C*>(c.v_pages) + page * c.v_page + slot * c.v_slot + h * c.v_head;
    move_row<T, C>(k, kd, c.head_dim, r, c.k_scale ? c.k_scale[h] : 1.0f, lane);
    Rope none = r;
    none.on = false;
    move_row<T, C>(v, vd, c.head_dim, none, c.v_scale ? c.v_scale[h] : 1.0f, lane);
  }
}

}  // namespace

cudaError_t kv_cache_append(const KvAppendParams& p, const Workspace&, cudaStream_t stream) {
  const int64_t heads = p.cache.heads_kv + ((p.q && p.rope != RopeLayout::kNone) ? p.heads_q : 0);
  const int64_t rows = p.table.batch * p.new_tokens * heads;
  if (rows <= 0) return cudaSuccess;
  const int64_t need = ceil_div(rows, kWarps);
  const unsigned grid = static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks);
  const bool fp8 = p.cache.dtype == DType::kF8E4M3;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    if (fp8) append_kernel<T, Fp8><<<grid, kThreads, 0, stream>>>(p);
    else append_kernel<T, T><<<grid, kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
