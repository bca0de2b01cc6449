// RoPE on CUDA (rope_forward / rope_backward, include/optimized/fused.h): one kernel, the "cuda"
// variant of kRopeVariants (src/fused/rope_params.h).
//
// Versions: one so far. A block per token (b, s) (grid-stride past 2^20 tokens). The angles depend
// only on (position, pair), so the block first computes the token's rotary_dim / 2 cos / sin once
// into shared memory (kernels/rope.h: angle formed and reduced to [-pi, pi] in fp64, then sincosf --
// ~50 fp64 operations per pair, done once per token instead of once per row), then, after one
// barrier, its H_q + H_k rows spread over the block's threads, each thread moving one 16-byte
// vector per item (for neox: a vector and its rotation partner half a rotary_dim further; for
// interleaved: a vector of whole pairs), reading q and k once and writing each output once. Rows
// that are not 16-byte aligned (pointer or any stride, per tensor), or rotary splits off vector
// boundaries, go one rotation pair per item. In place (out == x), the pass-through dims past
// rotary_dim are neither read nor written. Backward (the transpose) is the same kernel with the
// sines negated in the table.
//
// Bytes: read q, k (+ positions, + cos_sin rows when given), write q_out, k_out: the minimum.
// Flops: 6 per pair (4 mul + 2 add) plus the table (amortized over the token's rows).
// Not yet measured on the H100. What may limit it: the table's latency before the barrier (a
// block's loads wait on it; 16 blocks per SM overlap it), 128-thread blocks at decode sizes
// (B * S small: a few blocks, latency-bound anyway).
//
// Semantics those of cpu/rope_cpu.cpp (the float64-checked reference rung): positions int32 / int64,
// any value; with cos_sin a position outside [0, max_pos) gives NaN in its rotated dims (nothing is
// read out of bounds).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtypes_built.h"
#include "fused/rope_params.h"
#include "kernels/common.cuh"
#include "kernels/dtype.cuh"
#include "kernels/rope.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;

constexpr int kThreads = 128;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
static_assert(kRopeCudaMaxRotaryDim * sizeof(float) <= 48 * 1024, "the cos / sin table must fit 48 KiB of shared memory");

// What the launcher works out once.
struct Geom {
  int D, rd, half;
  bool neox;
  bool q_vec, k_vec;    // rows of q / k (and their outputs) moved as 16-byte vectors
  bool q_tail, k_tail;  // copy the dims past rotary_dim (out-of-place)
};

// Items of one row: vector path: rotation vectors (neox: the first half only, each with its partner)
// then pass-through vectors; scalar path: rotation pairs then pass-through elements.
template <typename T>
__device__ __forceinline__ int row_items(const Geom& g, bool vec, bool tail) {
  constexpr int kVec = kVec16<T>;
  const int rest = tail ? g.D - g.rd : 0;
  if (vec) return (g.neox ? g.half : g.rd) / kVec + rest / kVec;
  return g.half + rest;
}

// Item j of a row: reads x, rotates with the table (cs, sn), writes y (y may be x: in place).
template <typename T>
__device__ __forceinline__ void move_item(const T* x, T* y, int j, const Geom& g, bool vec, const float* cs,
                                          const float* sn) {
  constexpr int kVec = kVec16<T>;
  if (vec) {
    const int nrot = (g.neox ? g.half : g.rd) / kVec;
    if (j < nrot) {
      const int c = j * kVec;
      const Vec<T, kVec> a = load_vec_once<T, kVec>(x + c);
      Vec<T, kVec> out;
      if (g.neox) {  // pairs (c + i, c + i + half)
        const Vec<T, kVec> b = load_vec_once<T, kVec>(x + c + g.half);
        Vec<T, kVec> out_b;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          float y0, y1;
          rope_rotate(to_float(a.v[i]), to_float(b.v[i]), cs[c + i], sn[c + i], &y0, &y1);
          out.v[i] = from_float<T>(y0);
          out_b.v[i] = from_float<T>(y1);
        }
        store_vec<T, kVec>(y + c + g.half, out_b);
      } else {  // pairs (c + i, c + i + 1), pair index (c + i) / 2
#pragma unroll
        for (int i = 0; i < kVec; i += 2) {
          float y0, y1;
          rope_rotate(to_float(a.v[i]), to_float(a.v[i + 1]), cs[(c + i) / 2], sn[(c + i) / 2], &y0, &y1);
          out.v[i] = from_float<T>(y0);
          out.v[i + 1] = from_float<T>(y1);
        }
      }
      store_vec<T, kVec>(y + c, out);
      return;
    }
    const int c = g.rd + (j - nrot) * kVec;  // pass-through
    store_vec<T, kVec>(y + c, load_vec_once<T, kVec>(x + c));
    return;
  }
  if (j < g.half) {
    const int i0 = static_cast<int>(rope_first(g.neox, j)), i1 = static_cast<int>(rope_second(g.neox, j, g.half));
    float y0, y1;
    rope_rotate(to_float(x[i0]), to_float(x[i1]), cs[j], sn[j], &y0, &y1);
    y[i0] = from_float<T>(y0);
    y[i1] = from_float<T>(y1);
    return;
  }
  const int d = g.rd + (j - g.half);
  y[d] = x[d];
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeParams p, const Geom g) {
  extern __shared__ float table[];  // cos (half) then sin (half)
  float* cs = table;
  float* sn = table + g.half;
  const int64_t tokens = p.tokens();
  const int hq = static_cast<int>(p.q.heads), hk = static_cast<int>(p.k.heads);
  const int q_per = row_items<T>(g, g.q_vec, g.q_tail), k_per = row_items<T>(g, g.k_vec, g.k_tail);
  const int nq = hq * q_per, n = nq + hk * k_per;
  for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
    const int64_t b = token / p.seq, s = token - b * p.seq;
    const int64_t at = b * p.pos_b + s * p.pos_s;
    const int64_t pos = p.positions_i64 ? static_cast<const int64_t*>(p.positions)[at]
                                        : static_cast<int64_t>(static_cast<const int32_t*>(p.positions)[at]);
    // cos / sin of the token's pairs, shared by its rows.
    for (int i = static_cast<int>(threadIdx.x); i < g.half; i += kThreads) {
      float c, sv;
      if (p.cos_sin) {
        if (pos >= 0 && pos < p.cos_sin_rows) {
          const float* row = static_cast<const float*>(p.cos_sin) + pos * p.ld_cos_sin;
          c = row[i], sv = row[g.half + i];
        } else {
          c = sv = __int_as_float(0x7fc00000);  // NaN: a position outside the cache
        }
      } else {
        const double r = rope_reduced_angle(pos, rope_inv_freq(i, g.rd, p.theta));
        sincosf(static_cast<float>(r), &sv, &c);
      }
      cs[i] = c;
      sn[i] = p.inverse ? -sv : sv;
    }
    __syncthreads();
    const T* qx = static_cast<const T*>(p.q.x) + b * p.q.x_b + s * p.q.x_s;
    T* qy = static_cast<T*>(p.q.out) + b * p.q.out_b + s * p.q.out_s;
    const T* kx = hk ? static_cast<const T*>(p.k.x) + b * p.k.x_b + s * p.k.x_s : nullptr;
    T* ky = hk ? static_cast<T*>(p.k.out) + b * p.k.out_b + s * p.k.out_s : nullptr;
    for (int i = static_cast<int>(threadIdx.x); i < n; i += kThreads) {
      if (i < nq) {
        const int h = i / q_per, j = i - h * q_per;
        move_item<T>(qx + h * p.q.x_h, qy + h * p.q.out_h, j, g, g.q_vec, cs, sn);
      } else {
        const int k = i - nq, h = k / k_per, j = k - h * k_per;
        move_item<T>(kx + h * p.k.x_h, ky + h * p.k.out_h, j, g, g.k_vec, cs, sn);
      }
    }
    if (token + gridDim.x < tokens) __syncthreads();  // the next token rewrites the table
  }
}

// Whether every row (b, s, h) of a tensor starts on a 16-byte boundary: the base and the stride of
// each dimension of more than one entry.
bool rows_aligned(const void* base, size_t elem, int64_t B, int64_t sb, int64_t S, int64_t ss, int64_t H, int64_t sh) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  const int64_t dims[3][2] = {{B, sb}, {S, ss}, {H, sh}};
  for (const auto& d : dims)
    if (d[0] > 1 && (d[1] * static_cast<int64_t>(elem)) % 16 != 0) return false;
  return true;
}

}  // namespace

cudaError_t rope_cuda(const RopeParams& p, const Workspace&, cudaStream_t stream) {
  const int64_t tokens = p.tokens();
  if (tokens <= 0 || p.q.heads + p.k.heads <= 0) return cudaSuccess;
  if (p.rotary_dim < 2 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim ||
      p.rotary_dim > kRopeCudaMaxRotaryDim || p.seq <= 0)
    return cudaErrorInvalidValue;
  if ((p.q.heads + p.k.heads) * p.head_dim > INT32_MAX) return cudaErrorInvalidValue;  // 32-bit item indices
  if (p.cos_sin && p.dtype == DType::kF64) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(tokens < kMaxBlocks ? tokens : kMaxBlocks);
  return dispatch_built_dtype(p.dtype, cudaErrorInvalidValue, [&]<DType kD>() -> cudaError_t {
    using T = cuda_type_t<kD>;
    constexpr int kVec = kVec16<T>;
    Geom g;
    g.D = static_cast<int>(p.head_dim);
    g.rd = static_cast<int>(p.rotary_dim);
    g.half = g.rd / 2;
    g.neox = p.neox;
    g.q_tail = p.q.out != p.q.x;
    g.k_tail = p.k.out != p.k.x;
    const bool split_ok = g.rd % kVec == 0 && (!g.neox || g.half % kVec == 0);
    auto vec_ok = [&](const RopeTensor& r, bool tail) {
      return r.x != nullptr && split_ok && (!tail || g.D % kVec == 0) &&
             rows_aligned(r.x, sizeof(T), p.batch, r.x_b, p.seq, r.x_s, r.heads, r.x_h) &&
             rows_aligned(r.out, sizeof(T), p.batch, r.out_b, p.seq, r.out_s, r.heads, r.out_h);
    };
    g.q_vec = vec_ok(p.q, g.q_tail);
    g.k_vec = vec_ok(p.k, g.k_tail);
    const size_t smem = 2 * static_cast<size_t>(g.half) * sizeof(float);
    rope_kernel<T><<<grid, kThreads, smem, stream>>>(p, g);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
