// The flash2 rung's device toolbox, shared by the forward (flash2_fwd.cuh) and the backward
// (flash2_bwd*.cuh): how a 16-bit operand tile sits in shared memory, how it gets there, how the
// warps read mma.sync fragments out of it, and how a C fragment of S = Q Kᵀ becomes scores in
// the log2 domain under every feature of the score rule (AttentionScore, attention_params.h).
//
// The tile helpers (SmemTile and its swizzle, the zero-filling cp.async copy, the ldmatrix
// fragment reads, c_to_a, mma, exp2 / log2 and the quad reductions) live in
// kernels/tile/mma_frag.cuh, which the KV-cache family's paged_mma rung shares; its header
// describes the layouts and fragments.
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
#include "kernels/tile/mma_frag.cuh"
#include "kernels/tile/swizzle.cuh"

namespace optimized::cuda::flash2 {

namespace ptx = ::optimized::kernels::ptx;

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kNegInf = -INFINITY;

// The tensor-core tile helpers (kernels/tile/mma_frag.cuh), under their old names.
using ::optimized::kernels::smem_cols;
using ::optimized::kernels::exp2_approx;
using ::optimized::kernels::log2_approx;
using ::optimized::kernels::quad_max;
using ::optimized::kernels::quad_sum;
using ::optimized::kernels::pack2;
using ::optimized::kernels::c_to_a;
using ::optimized::kernels::mma;
using ::optimized::kernels::SmemTile;
using ::optimized::kernels::st_shared_zero16;
using ::optimized::kernels::load_tile;
using ::optimized::kernels::ldsm_addr;
using ::optimized::kernels::ldsm_a;
using ::optimized::kernels::ldsm_a_t;
using ::optimized::kernels::ldsm_b_nk;
using ::optimized::kernels::ldsm_b_kn;

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
