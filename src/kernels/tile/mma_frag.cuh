// Tensor-core tile helpers for mma.sync kernels: how a 16-bit operand tile sits in shared memory
// (the 128-byte XOR swizzle), how a cooperative cp.async copy fills it (zero-filling what lies
// outside the tensor), how a warp reads mma.sync m16n8k16 fragments out of it with ldmatrix, how a
// C fragment becomes the A fragment of the next product (the FlashAttention-2 trick), and the
// MUFU exp2 / log2 and quad reductions that an online softmax on C fragments needs. Used by the
// attention family's flash2 rung and the KV-cache family's paged_mma rung.
//
// Shared-memory tile (SmemTile<kRows, kCols>): kRows rows of kCols 16-bit elements, row-major,
// kCols * 2 bytes per row (kCols a multiple of 64: a head dim of 96 is stored in 128 columns, the
// last 32 never loaded nor read). The 16-byte chunk c of row r sits at chunk c ^ (r % 8)
// (tile/swizzle.cuh): the XOR permutes the 8 chunks of each 128-byte line, so the 8 rows of one
// 8x8 ldmatrix matrix, and the 8 chunks a group of 8 threads copies into one row, fall into 8
// distinct 16-byte bank groups (one wavefront, no conflict).
//
// Fragments (mma.sync.m16n8k16, ptx/mma_sync.cuh; g = lane / 4, t = lane % 4):
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
// 16s+8..16s+15) are exactly the A fragment of k-step s once rounded to 16 bits (c_to_a).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/ldmatrix.cuh"
#include "kernels/ptx/mma_sync.cuh"
#include "kernels/tile/swizzle.cuh"

namespace optimized::kernels {

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
    return swizzled_offset<kRowBytes>(row, chunk);
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

}  // namespace optimized::kernels
