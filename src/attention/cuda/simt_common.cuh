// What the two SIMT rungs of the attention ladder (naive.cu, flash.cu) share beyond src/kernels: the
// score of one (query, key) pair as a device object built once per (sequence, batch, head), the
// tile-level range tests that let flash skip or stop guarding whole tiles, fp32 staging of a tile
// of rows into shared memory, the row sums D_i = dout_i . out_i of the backward, and the overflow-
// checked size of a per-(batch, head, query row) scratch. Namespace optimized::cuda::attention_simt.
//
// Visibility, the one rule both rungs follow (and what they promise about NaN): query i of a
// sequence sees key j when i < len_q and j lies in AttentionScore's [key_lo(i), key_hi(i)) (the
// window and causal range, clipped to the sequence). A pair that is not visible is never read: its
// probability and its dS are set to 0 by a select, never by multiplying, and the sums of the
// forward (P V) and of the backward (P dO, dS Q, dS K) skip it. So a NaN in q, k, v or dout
// reaches exactly the rows (keys) that see it. A pair that is visible but whose explicit mask is
// -inf (false) has probability 0 and is summed as 0 * value, as torch's math path does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention/attention_params.h"
#include "kernels/common.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"

namespace optimized::cuda::attention_simt {

using namespace optimized::kernels;

// ---- addressing -----------------------------------------------------------------------------
// Row 0 of sequence b (rows start at `start`, the packed offset of varlen or 0), head h, of a
// tensor with strides s (attention_params.h: X + b * batch + (start + i) * row + h * head).
template <typename T>
__device__ __forceinline__ const T* head_rows(const void* x, const AttentionStrides& s, int64_t b, int64_t start,
                                              int64_t h) {
  return static_cast<const T*>(x) + b * s.batch + start * s.row + h * s.head;
}
template <typename T>
__device__ __forceinline__ T* head_rows_mut(void* x, const AttentionStrides& s, int64_t b, int64_t start, int64_t h) {
  return static_cast<T*>(x) + b * s.batch + start * s.row + h * s.head;
}
// lse of (b, h): element i of the sequence at the returned pointer + i.
__device__ __forceinline__ float* lse_row(const AttentionParams& p, int64_t b, int64_t h, int64_t start_q) {
  return static_cast<float*>(p.lse) + b * p.lse_batch + h * p.lse_head + start_q;
}

// ---- the score --------------------------------------------------------------------------------
// AttentionScore<float> (the one definition of scale, softcap, ALiBi and the range) plus the
// explicit mask and the sequence's query count, for one (sequence, b, h).
struct ScoreRule {
  AttentionScore<float> sc;
  int64_t len_q;
  const unsigned char* mask;  // element (b, h, 0, 0) of the mask; null: none
  int64_t mask_row, mask_col;  // bytes between rows i and keys j
  DType mask_dtype;

  __device__ ScoreRule(const AttentionParams& p, const AttentionSeq& seq, int64_t b, int64_t h)
      : sc(p, seq, b, h), len_q(seq.len_q), mask(nullptr), mask_row(0), mask_col(0), mask_dtype(p.mask_dtype) {
    if (p.mask) {
      const int64_t bytes = p.mask_dtype == DType::kBool ? 1 : (p.mask_dtype == DType::kF32 ? 4 : 2);
      mask = static_cast<const unsigned char*>(p.mask) + (b * p.mask_s[0] + h * p.mask_s[1]) * bytes;
      mask_row = p.mask_s[2] * bytes;
      mask_col = p.mask_s[3] * bytes;
    }
  }

  // Query i sees key j (both indices within the sequence; j >= 0).
  __device__ __forceinline__ bool visible(int64_t i, int64_t j) const {
    return i < len_q && j >= sc.key_lo(i) && j < sc.key_hi(i);
  }

  // The explicit mask's additive term at (i, j): 0 or -inf for a bool mask.
  __device__ __forceinline__ float mask_term(int64_t i, int64_t j) const {
    const unsigned char* at = mask + i * mask_row + j * mask_col;
    switch (mask_dtype) {
      case DType::kBool: return *at ? 0.0f : -INFINITY;
      case DType::kF32: return *reinterpret_cast<const float*>(at);
      case DType::kF16: return __half2float(*reinterpret_cast<const __half*>(at));
      case DType::kBF16: return __bfloat162float(*reinterpret_cast<const __nv_bfloat16*>(at));
      default: return 0.0f;  // the API admits no other mask dtype
    }
  }

  // The score of a visible pair from its dot product q_i . k_j: AttentionScore::value, then the mask.
  __device__ __forceinline__ float value(float dot, int64_t i, int64_t j) const {
    float s = sc.value(dot, i, j);
    if (mask) s += mask_term(i, j);
    return s;
  }
  // -inf where the pair is not visible.
  __device__ __forceinline__ float masked_value(float dot, int64_t i, int64_t j) const {
    return visible(i, j) ? value(dot, i, j) : -INFINITY;
  }

  // d score / d dot: scale, times (1 - t^2) through the soft-cap, t = tanh(scale * dot / softcap)
  // (the same fp32 operations as AttentionScore::value, so t is the t of the forward's score).
  // ALiBi and the mask are constants.
  __device__ __forceinline__ float dot_grad(float dot) const {
    if (!(sc.softcap > 0.0f)) return sc.scale;
    const float t = tanhf(sc.scale * dot / sc.softcap);
    return sc.scale * AttentionScore<float>::softcap_grad_from_tanh(t);
  }

  // Tile tests for query rows [i0, i1) and keys [j0, j1), both non-empty and within the sequence
  // (i1 <= len_q, j1 <= len_k). key_lo and key_hi do not decrease with i, so
  //   some pair may be visible  only if  [max(j0, key_lo(i0)), min(j1, key_hi(i1 - 1))) is non-empty
  //   every pair is visible     if       key_lo(i1 - 1) <= j0 and key_hi(i0) >= j1.
  // The first is conservative (a tile it admits may still hold no visible pair: its terms are 0).
  __device__ __forceinline__ bool tile_may_see(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    const int64_t lo = sc.key_lo(i0), hi = sc.key_hi(i1 - 1);
    return (j0 > lo ? j0 : lo) < (j1 < hi ? j1 : hi);
  }
  __device__ __forceinline__ bool tile_sees_all(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return sc.key_lo(i1 - 1) <= j0 && sc.key_hi(i0) >= j1;
  }
};

// exp(s - lse) of the backward's recompute: 0 for a row whose lse is -inf (it saw no key).
__device__ __forceinline__ float prob_from_lse(float s, float lse) {
  return lse == -INFINITY ? 0.0f : expf(s - lse);
}

// ---- staging --------------------------------------------------------------------------------
// Rows [row0, row0 + kRows) of one head (rows: row 0 of the head, stride `row_stride` elements)
// into an fp32 tile of kRows x kD with row stride kLd; rows from `valid` on (past the sequence) and
// columns from `dim` on (past the head dim) are 0. Consecutive threads take consecutive columns:
// coalesced reads, consecutive banks on the writes. Scalar loads (rows need no alignment).
template <typename T, int kRows, int kD, int kLd, int kThreads>
__device__ __forceinline__ void load_rows(float* tile, const T* rows, int64_t row_stride, int64_t row0, int64_t valid,
                                          int dim) {
  static_assert(kRows * kD % kThreads == 0, "tile elements must split evenly over the threads");
#pragma unroll 4
  for (int e = threadIdx.x; e < kRows * kD; e += kThreads) {
    const int r = e / kD, d = e % kD;
    float x = 0.0f;
    if (r < valid && d < dim) x = to_float(rows[(row0 + r) * row_stride + d]);
    tile[r * kLd + d] = x;
  }
}

// ---- sizes ----------------------------------------------------------------------------------
// a * b * c * d as an element count, or -1 when it exceeds 2^60 (no allocation could hold it, and
// the arena's byte arithmetic stays far from overflow). Every factor >= 0.
inline int64_t checked_count(int64_t a, int64_t b, int64_t c, int64_t d) {
  constexpr uint64_t kMax = uint64_t{1} << 60;
  uint64_t n = 1;
  for (int64_t f : {a, b, c, d}) {
    if (f < 0) return -1;
    uint64_t next = 0;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(f), &next) || next > kMax) return -1;
    n = next;
  }
  return static_cast<int64_t>(n);
}

// ---- the backward's row sums ---------------------------------------------------------------
// D[(b * H_q + h) * seqlen_q + i] = sum_d dout[i, d] * out[i, d] (fp32) for every row of every
// sequence (rows past a varlen sequence's end are not written). One warp per row, lanes over d;
// a grid-stride loop over the rows.
namespace {
template <typename T>
__global__ void __launch_bounds__(256) row_dot_kernel(const __grid_constant__ AttentionParams p, float* D) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t i = r % p.seqlen_q, bh = r / p.seqlen_q, h = bh % p.heads_q, b = bh / p.heads_q;
    const AttentionSeq seq = attention_seq(p, b);
    if (i >= seq.len_q) continue;  // the whole warp: r is the warp's
    const T* o = head_rows<T>(p.out, p.out_s, b, seq.start_q, h) + i * p.out_s.row;
    const T* g = head_rows<T>(p.dout, p.dout_s, b, seq.start_q, h) + i * p.dout_s.row;
    float acc = 0.0f;
    for (int64_t d = lane; d < p.head_dim; d += 32) acc = fmaf(to_float(g[d]), to_float(o[d]), acc);
    acc = warp_reduce<SumOp>(acc);
    if (lane == 0) D[r] = acc;
  }
}

// Launches row_dot_kernel over B * H_q * seqlen_q rows (nothing when there are none).
template <typename T>
cudaError_t launch_row_dot(const AttentionParams& p, float* D, cudaStream_t stream) {
  constexpr int kThreads = 256, kWarps = kThreads / 32;
  constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // the loop strides past this
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  if (rows == 0) return cudaSuccess;
  const int64_t need = ceil_div(rows, kWarps);
  row_dot_kernel<T><<<static_cast<unsigned>(need < kMaxBlocks ? need : kMaxBlocks), kThreads, 0, stream>>>(p, D);
  return cudaGetLastError();
}
}  // namespace

}  // namespace optimized::cuda::attention_simt
