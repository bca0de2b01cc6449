// The flash2 rung's device toolbox, shared by the forward (flash2_fwd.cuh) and the backward
// (flash2_bwd*.cuh): how a 16-bit operand tile sits in shared memory, how it gets there, how the
// warps read mma.sync fragments out of it, and how a C fragment of S = Q Kᵀ becomes scores in
// the log2 domain under every feature of the score rule (AttentionScore, attention_params.h).
//
// Shared-memory tile (SmemTile<kRows, kCols>): kRows rows of kCols 16-bit elements, row-major,
// kCols * 2 bytes per row (kCols a multiple of 64: a head dim of 96 is stored in 128 columns, the
// last 32 never loaded nor read). The 16-byte chunk c of row r sits at chunk c ^ (r % 8)
// (kernels/tile/swizzle.cuh): the XOR permutes the 8 chunks of each 128-byte line, so the 8 rows
// of one 8x8 ldmatrix matrix, and the 8 chunks a group of 8 threads copies into one row, fall into
// 8 distinct 16-byte bank groups (one wavefront, no conflict).
//
// Fragments (mma.sync.m16n8k16, kernels/ptx/mma_sync.cuh; g = lane / 4, t = lane % 4):
//   A (16 x 16, m x k): a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16 x 8,  k x n): b0 = (k 2t..2t+1, n g)  b1 = (k 2t+8.., n g)
//   C (16 x 8,  m x n): c0, c1 = (g, 2t..2t+1)  c2, c3 = (g+8, 2t..2t+1)
// Every ldmatrix helper below reads with one ldmatrix.x4 (lanes 8i..8i+7 address matrix i) and
// takes tile coordinates with row0 a multiple of 8 and chunk0 even (chunk = 8 columns):
//   ldsm_a      A from a tile stored [m][k]:  rows row0..+15 (m), chunks chunk0, +1 (k)
//   ldsm_a_t    A from a tile stored [k][m]:  rows row0..+15 (k), chunks chunk0, +1 (m)   (.trans)
//   ldsm_b_nk   B of two n-tiles from a tile stored [n][k]: rows row0..+15 (n: row0.. the first
//               n-tile, row0+8.. the second), chunks chunk0, +1 (k)          (e.g. K for Q Kᵀ)
//   ldsm_b_kn   B of two n-tiles from a tile stored [k][n]: rows row0..+15 (k), chunk0 (n of the
//               first n-tile), chunk0+1 (the second)                   (.trans; e.g. V for P V)
// The C fragments of two n-tiles that are neighbours along k (c_lo: columns 16s..16s+7, c_hi:
// 16s+8..16s+15) are exactly the A fragment of k-step s once rounded to 16 bits (c_to_a): the
// trick that feeds P = softmax(S) to P V without a trip through shared memory.
//
// Scores: ScoreRule wraps AttentionScore<float> for one (sequence, batch, head) and turns a C
// fragment of dot products into s * log2(e) (the log2 domain in which the kernels call ex2), with
// -inf outside the key range and under a false bool mask. Two template switches keep the common
// case cheap: kScoreMod (softcap, ALiBi or an explicit mask present: the general per-element
// rule) and kRangeMask (the tile crosses some row's [key_lo, key_hi) boundary or the sequence end:
// per-element range test). A tile that needs neither costs one multiply per score.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention/attention_params.h"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/ldmatrix.cuh"
#include "kernels/ptx/mma_sync.cuh"
#include "kernels/ptx/smem.cuh"
#include "kernels/tile/swizzle.cuh"

namespace optimized::cuda::flash2 {

namespace ptx = ::optimized::kernels::ptx;

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kNegInf = -INFINITY;

// The shared-memory width (elements) a head dim is stored in: the next multiple of 64 (the
// swizzle permutes chunks inside 128-byte lines).
constexpr int smem_cols(int head_dim) { return (head_dim + 63) / 64 * 64; }

// ---- math ------------------------------------------------------------------------------------
// 2^x and log2(x), the MUFU approximations (relative error ~2^-22): ex2(-inf) = +0, ex2(NaN) =
// NaN, lg2(0) = -inf.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Reductions over the 4 lanes of a quad (the lanes sharing g, i.e. one row of a C fragment).
// fmaxf drops NaN: a NaN score reaches the output through exp2 and the row sum instead.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- 16-bit packing --------------------------------------------------------------------------
// Two floats rounded to T, lo in the low half (the lower column of a fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The A fragment of one k-step from the C fragments of the two n-tiles it spans (see the header).
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c_lo)[4], const float (&c_hi)[4]) {
  a[0] = pack2<T>(c_lo[0], c_lo[1]);  // (g,   2t..)
  a[1] = pack2<T>(c_lo[2], c_lo[3]);  // (g+8, 2t..)
  a[2] = pack2<T>(c_hi[0], c_hi[1]);  // (g,   2t+8..)
  a[3] = pack2<T>(c_hi[2], c_hi[3]);  // (g+8, 2t+8..)
}

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  ptx::MmaSync16816<T>::run(d, a, b);
}

// ---- shared-memory tile ------------------------------------------------------------------------
template <int kRows_, int kCols_>
struct SmemTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kRowBytes = kCols * 2;
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  static constexpr int kBytes = kRows * kRowBytes;
  static_assert(kCols % 64 == 0, "the swizzle permutes the chunks of 128-byte lines: kCols % 64 == 0");
  static_assert(kRows % 16 == 0, "fragments cover 16 rows");

  // Byte offset of (row, chunk) from the tile's base.
  static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
    return kernels::swizzled_offset<kRowBytes>(row, chunk);
  }
};

// 16 zero bytes at shared address `addr` (what cp.async would have copied from outside the tensor).
__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}

// Cooperative copy of a global tile into `tile` (shared address of a Tile) by kThreads threads
// (thread `tid`); the caller commits the cp.async group and waits. Row r of the tile is global
// src + r * row_stride (elements; row starts 16-byte aligned). Rows >= valid_rows and chunks >=
// valid_chunks (head_dim / 8) are stored as zeros instead of read (rows past the sequence,
// columns past the head dim); chunks >= kLoadChunks (kHeadDim / 8 of the instance: the padding of
// d = 96) are left untouched. One thread per 16-byte chunk of a stored row, kThreads / kChunks
// rows per pass: the 8 threads of a row segment write 8 distinct bank groups.
template <class Tile, int kThreads, int kLoadChunks, typename T>
__device__ __forceinline__ void load_tile(uint32_t tile, const T* src, int64_t row_stride, int valid_rows,
                                          int valid_chunks, int tid) {
  constexpr int kThreadsPerRow = Tile::kChunks;
  static_assert(kThreads % kThreadsPerRow == 0, "whole rows per pass");
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
  static_assert(Tile::kRows % kRowsPerPass == 0, "whole passes per tile");
  static_assert(kLoadChunks <= Tile::kChunks, "loaded chunks fit the stored row");
  const int c = tid % kThreadsPerRow;
  const int r0 = tid / kThreadsPerRow;
  if (kLoadChunks < kThreadsPerRow && c >= kLoadChunks) return;
  const bool col_ok = c < valid_chunks;
  const T* g = src + int64_t(r0) * row_stride + c * 8;
  const int64_t pass_stride = int64_t(kRowsPerPass) * row_stride;
#pragma unroll
  for (int i = 0; i < Tile::kRows / kRowsPerPass; ++i) {
    const int r = r0 + i * kRowsPerPass;
    const uint32_t dst = tile + Tile::offset(r, c);
    if (col_ok && r < valid_rows) ptx::cp_async_16(dst, g);
    else st_shared_zero16(dst);
    g += pass_stride;
  }
}

// ---- fragments from shared memory ------------------------------------------------------------
// Lane l reads matrix l / 8. The XOR key of a lane's row is l % 8 (row0 % 8 == 0); the chunk it
// addresses is chunk0 + h with chunk0 even and h in {0, 1}, so (chunk0 + h) ^ key = chunk0 ^ (h ^ key).
// The address is formed as (lane_base ^ ((chunk0 % 8) << 4)) + row0 * kRowBytes + (chunk0 / 8) * 128
// with lane_base = tile + lane_row * kRowBytes + ((h ^ key) << 4): one lane register per tile, the
// rest an XOR with an immediate and an immediate offset (exact because `tile` and every row start
// are multiples of 128 bytes, so bits 4..6 of lane_base are h ^ key alone). Tiles must therefore
// start 128-byte aligned in shared memory.
template <class Tile>
__device__ __forceinline__ uint32_t ldsm_addr(uint32_t tile, int lane_row, int lane_x, int row0, int chunk0) {
  const uint32_t lane_base = tile + lane_row * Tile::kRowBytes + (lane_x << 4);
  return (lane_base ^ ((chunk0 & 7) << 4)) + row0 * Tile::kRowBytes + ((chunk0 & ~7) << 4);
}
template <class Tile>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], uint32_t tile, int row0, int chunk0, int lane) {
  // matrices: a0 = (m 0-7, k chunk0), a1 = (m 8-15, chunk0), a2 = (m 0-7, chunk0+1), a3 = (m 8-15, chunk0+1)
  ptx::ldmatrix_x4(a, ldsm_addr<Tile>(tile, lane & 15, (lane >> 4) ^ (lane & 7), row0, chunk0));
}
template <class Tile>
__device__ __forceinline__ void ldsm_a_t(uint32_t (&a)[4], uint32_t tile, int row0, int chunk0, int lane) {
  // matrices: a0 = (k 0-7, m chunk0), a1 = (k 0-7, m chunk0+1), a2 = (k 8-15, chunk0), a3 = (k 8-15, chunk0+1)
  ptx::ldmatrix_x4_trans(a[0], a[1], a[2], a[3],
                         ldsm_addr<Tile>(tile, ((lane >> 4) << 3) + (lane & 7), ((lane >> 3) & 1) ^ (lane & 7), row0,
                                         chunk0));
}
template <class Tile>
__device__ __forceinline__ void ldsm_b_nk(uint32_t (&b)[2][2], uint32_t tile, int row0, int chunk0, int lane) {
  // matrices: (n 0-7, k chunk0) = b0 of n-tile 0, (n 0-7, chunk0+1) = b1 of n-tile 0, then n 8-15
  uint32_t r[4];
  ptx::ldmatrix_x4(r, ldsm_addr<Tile>(tile, ((lane >> 4) << 3) + (lane & 7), ((lane >> 3) & 1) ^ (lane & 7), row0,
                                      chunk0));
  b[0][0] = r[0];
  b[0][1] = r[1];
  b[1][0] = r[2];
  b[1][1] = r[3];
}
template <class Tile>
__device__ __forceinline__ void ldsm_b_kn(uint32_t (&b)[2][2], uint32_t tile, int row0, int chunk0, int lane) {
  // matrices: (k 0-7, n chunk0) = b0 of n-tile 0, (k 8-15, chunk0) = b1 of n-tile 0, then chunk0+1
  ptx::ldmatrix_x4_trans(b[0][0], b[0][1], b[1][0], b[1][1],
                         ldsm_addr<Tile>(tile, lane & 15, (lane >> 4) ^ (lane & 7), row0, chunk0));
}

// ---- the score rule on C fragments ---------------------------------------------------------------
// One (sequence, batch b, query head h). Query rows i and keys j are indices inside the sequence.
struct ScoreRule {
  AttentionScore<float> sc;  // the one definition: key_lo / key_hi / value
  float scale_log2;          // scale * log2(e): the fast path's only operation
  // Explicit mask (fixed length only), at (b, h): element (i, j) at mask + i * mask_i + j * mask_j.
  const unsigned char* mask = nullptr;  // bytes; element size by mask_dtype
  int64_t mask_i = 0, mask_j = 0;       // strides in elements
  DType mask_dtype = DType::kBool;
  int len_q = 0, len_k = 0;  // the mask is read only inside [0, len_q) x [0, len_k)
  int offset = 0;                  // the diagonal (AttentionScore::offset)
  float inv_softcap_2log2e = 0.0f;  // 2 log2(e) / softcap
  int lo_shift = 0, hi_shift = 0;  // visible(i, j): i + lo_shift <= j < min(i + hi_shift, len_k), j >= 0

  __device__ __forceinline__ ScoreRule(const AttentionParams& p, const AttentionSeq& seq, int64_t b, int64_t h)
      : sc(p, seq, b, h),
        scale_log2(static_cast<float>(p.scale * 1.4426950408889634)),
        len_q(static_cast<int>(seq.len_q)),
        len_k(static_cast<int>(seq.len_k)),
        offset(static_cast<int>(sc.offset)),
        inv_softcap_2log2e(p.softcap > 0.0 ? static_cast<float>(2.0 * 1.4426950408889634 / p.softcap) : 0.0f) {
    // key_lo(i) = max(0, i + offset - window_left) and key_hi(i) = min(len_k, i + offset +
    // window_right + 1) as two shifts of i. A window side wider than len_q + len_k is unbounded
    // (clamping it keeps the arithmetic in 32 bits and changes no comparison for 0 <= j < len_k).
    const int64_t span = seq.len_q + seq.len_k;
    const int64_t wl = sc.window_left < 0 || sc.window_left > span ? span : sc.window_left;
    const int64_t wr = sc.window_right < 0 || sc.window_right > span ? span : sc.window_right;
    lo_shift = static_cast<int>(sc.offset - wl);
    hi_shift = static_cast<int>(sc.offset + wr + 1);
    if (p.mask) {
      mask_dtype = p.mask_dtype;
      const int64_t es = mask_dtype == DType::kBool ? 1 : (mask_dtype == DType::kF32 ? 4 : 2);
      mask = static_cast<const unsigned char*>(p.mask) + (b * p.mask_s[0] + h * p.mask_s[1]) * es;
      mask_i = p.mask_s[2];
      mask_j = p.mask_s[3];
    }
  }

  // [key_lo(i), key_hi(i)): the keys row i may see, clipped to [0, len_k) (as ints: lengths < 2^31).
  __device__ __forceinline__ int key_lo(int i) const { return static_cast<int>(sc.key_lo(i)); }
  __device__ __forceinline__ int key_hi(int i) const { return static_cast<int>(sc.key_hi(i)); }
  // The same range in 32-bit shifts (for 0 <= j): j in [key_lo(i), key_hi(i)).
  __device__ __forceinline__ bool visible(int i, int j) const {
    return j >= i + lo_shift && j < i + hi_shift && j < len_k;
  }

  // The explicit mask's term for (i, j), natural units: 0 / -inf (bool) or the additive value.
  __device__ __forceinline__ float mask_term(int i, int j) const {
    const int64_t e = int64_t(i) * mask_i + int64_t(j) * mask_j;
    switch (mask_dtype) {
      case DType::kBool: return mask[e] ? 0.0f : kNegInf;
      case DType::kF32: return reinterpret_cast<const float*>(mask)[e];
      case DType::kF16: return __half2float(reinterpret_cast<const __half*>(mask)[e]);
      default: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(mask)[e]);
    }
  }

  // The log2-domain score of one dot product: AttentionScore::value, then the mask, times log2(e),
  // in 32-bit arithmetic:
  //   s = scale * dot;  s = softcap * tanh(s / softcap);  s -= slope * |i + offset - j|;  s += mask
  // with tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1) (ex2.approx: absolute error ~1e-7, which is what a
  // softmax feels; +-1 and NaN at the ends as tanh). Outside the sequence (padding rows and keys
  // of a tile) the mask is not read; those scores are never used unmasked.
  __device__ __forceinline__ float general(float dot, int i, int j) const {
    float s = sc.scale * dot;
    if (sc.softcap > 0.0f) {
      const float e = exp2_approx(s * inv_softcap_2log2e);
      s = sc.softcap * (1.0f - __fdividef(2.0f, e + 1.0f));
      if (e == INFINITY) s = sc.softcap;  // __fdividef(2, inf) is not 0 for every input range
    }
    if (sc.slope != 0.0f) {
      const int d = i + offset - j;
      s -= sc.slope * static_cast<float>(d < 0 ? -d : d);
    }
    if (mask && i < len_q && j < len_k) s += mask_term(i, j);
    return s * kLog2e;
  }

  // acc: a C fragment of dot products q_i . k_j with c0 at (i0, j0): c0 = (i0, j0), c1 = (i0, j0+1),
  // c2 = (i0+8, j0), c3 = (i0+8, j0+1) (j0 >= 0). Becomes log2-domain scores; with kRangeMask,
  // -inf where j is outside [key_lo(i), key_hi(i)) (visible).
  template <bool kScoreMod, bool kRangeMask>
  __device__ __forceinline__ void apply(float (&acc)[4], int i0, int j0) const {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = i0 + 8 * (e >> 1);
      const int j = j0 + (e & 1);
      float s;
      if constexpr (kScoreMod) s = general(acc[e], i, j);
      else s = acc[e] * scale_log2;
      if constexpr (kRangeMask) s = visible(i, j) ? s : kNegInf;
      acc[e] = s;
    }
  }
};

}  // namespace optimized::cuda::flash2
