// Attention rung 2 of the CUDA ladder: flash, the FlashAttention-1 structure in SIMT fp32. S never
// leaves the chip.
//
// Forward (flash_forward_kernel): one block per (query tile of 64 rows, head, batch). The block
// stages its Q tile in shared memory once, then streams the sequence's keys through in tiles of
// 64: the K tile into shared memory, S = Q Kᵀ for the 64 x 64 pairs in registers, the score rule
// (scale, soft-cap, ALiBi, mask, range), the online softmax (each row keeps its running max m and
// sum l; a new tile max rescales l and the output accumulator by exp(m_old - m_new)), P of the
// tile into shared memory, then the V tile into the same shared buffer and acc += P V. At the end
// out = acc / l and lse = m + log l. Key tiles wholly outside the rows' window / causal range are
// never visited; tiles where every pair is visible run without per-pair guards.
//
//   thread layout: 16 threads per row group ("lanes" tx = 0..15), kThreads / 16 row groups ty.
//   Thread (ty, tx) owns rows ty + kRowGroups * a and, of S, keys tx + 16 c; of the output, dims
//   tx + 16 c. Row max and row sum are 16-lane shuffles (the 16 lanes of a row group are half a
//   warp). Shared tiles have a row stride of D + 1 floats (64 + 1 for P), so the 16 lanes that read
//   16 different rows at one column hit 16 different banks.
//   Blocks of 128 threads at D = 64, 256 at D >= 128 (at D = 128 with 128 threads each thread held
//   8 rows x 8 dims of output, 8 x 4 scores and the softmax state: 255 registers and spills; with
//   256 threads, 4 rows: 180 registers, no spills).
//
// Backward (FlashAttention's recompute from lse, deterministic: no atomics):
//   row_dot_kernel (simt_common.cuh)  D_i = dout_i . out_i into the workspace (fp32)
//   flash_bwd_dkdv_kernel             one block per (key tile, kv head, batch): K and V tiles stay in
//                                     shared memory while the block loops over the group's query
//                                     heads and their query tiles (Q, dO, lse, D staged), recomputes
//                                     Pᵀ = exp(K Qᵀ score - lse) and dSᵀ = Pᵀ (V dOᵀ - D) ds', and
//                                     accumulates dV += Pᵀ dO and dK += dSᵀ Q in registers
//   flash_bwd_dq_kernel               one block per (query tile, head, batch): Q, dO staged, loops over
//                                     the key tiles, recomputes dS the same way, dQ += dS K
// ds' = d score / d dot = scale (1 - tanh²) with the soft-cap, else scale (ScoreRule::dot_grad). S
// and dP are computed twice (once per kernel): the price of determinism without atomics.
//
// Why it is faster than naive: naive writes and rereads S (4 bytes per pair, three times) through
// global memory; here a pair's score lives in a register and its probability in shared memory,
// and q, k, v are read from global memory once per tile instead of once per output. Memory is O(N):
// no workspace in the forward, B * H_q * seqlen_q floats (D) in the backward. Why it is slower than
// flash2: every multiply-add is a SIMT fp32 FFMA fed by a shared-memory load (no tensor cores, no
// register reuse across the k dimension beyond the thread's micro-tile), loads are scalar and not
// overlapped with compute (one shared buffer, four barriers per K/V tile), and fp16/bf16 inputs are
// converted to fp32 when staged.
//
// Semantics (simt_common.cuh): a pair that is not visible (window, causal, past a sequence) is never
// read, its P and dS are 0 by a select, and guarded tiles skip it in the sums, so NaN reaches exactly
// the rows that see it; a row with no visible key gives out 0, lse -inf and zero gradients. Head
// dims are instantiated at 64, 128, 256 (any multiple of 8 up to 256 runs on the next one; staged
// columns past head_dim are 0 and not written). Shared memory (fp32):
//   forward   (64 (Q) + 64 (K or V)) x (D + 1) + 64 x 65 (P):  D=64 49920 B, 128 82688 B, 256 148224 B
//   backward  D <= 128: tiles of 64 queries and 64 keys; D = 256: 32 and 32 (shared memory):
//     dkdv    2 x 64 (K, V) + 2 x 64 (Q, dO) rows of D + 1, Pᵀ and dSᵀ 64 x 65, lse and D: 100352 B
//             at D=64, 165888 B at 128; 140288 B at 256 (32-row tiles)
//     dq      Q, dO, K, V rows of D + 1 and dS 64 x 65: 83200 B at 64, 148736 B at 128, 135808 B
//             at 256
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention/attention_params.h"
#include "attention/cuda/simt_common.cuh"
#include "attention/launchers.h"
#include "core/workspace.h"
#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using attention_simt::head_rows;
using attention_simt::head_rows_mut;
using attention_simt::load_rows;
using attention_simt::lse_row;
using attention_simt::prob_from_lse;
using attention_simt::ScoreRule;

// ---- config ---------------------------------------------------------------------------------
constexpr int kLanes = 16;  // threads that share a row group (half a warp)
// Every tile fits sm_80's opt-in per block (163 KiB; the H100 has 227 KiB). sm_86 / sm_89 (99 KiB)
// refuse the D >= 128 kernels at launch (cudaFuncSetAttribute's error).
constexpr size_t kMaxSmemBytes = 163 * 1024;

template <int kD>
struct FwdTile {
  static constexpr int kThreads = kD <= 64 ? 128 : 256;
  static constexpr int kBlockM = 64;                   // query rows per block
  static constexpr int kBlockN = 64;                   // keys per K / V tile
  static constexpr int kRowGroups = kThreads / kLanes;  // ty
  static constexpr int kRows = kBlockM / kRowGroups;   // query rows per thread
  static constexpr int kKeys = kBlockN / kLanes;       // keys of S per thread
  static constexpr int kDims = kD / kLanes;            // output dims per thread
  static constexpr int kLd = kD + 1;                   // shared row stride of Q, K, V tiles
  static constexpr int kPLd = kBlockN + 1;             // shared row stride of P
  static constexpr size_t kSmemBytes = sizeof(float) * ((kBlockM + kBlockN) * kLd + kBlockM * kPLd);
  static_assert(kBlockM % kRowGroups == 0 && kBlockN % kLanes == 0 && kD % kLanes == 0, "tiles must split evenly");
  static_assert(kSmemBytes <= kMaxSmemBytes, "forward tiles exceed shared memory");
};

template <int kD>
struct BwdTile {
  static constexpr int kThreads = kD <= 64 ? 128 : 256;
  static constexpr int kBlockM = kD <= 128 ? 64 : 32;  // query rows per tile
  static constexpr int kBlockN = kD <= 128 ? 64 : 32;  // keys per tile
  static constexpr int kRowGroups = kThreads / kLanes;
  static constexpr int kDims = kD / kLanes;            // dims of dk / dv / dq per thread
  static constexpr int kLd = kD + 1;
  // dkdv: thread rows are keys, thread columns queries.
  static constexpr int kKeyRows = kBlockN / kRowGroups;
  static constexpr int kQueryCols = kBlockM / kLanes;
  static constexpr int kSLd = kBlockM + 1;  // Pᵀ, dSᵀ: (kBlockN, kBlockM + 1)
  static constexpr size_t kDkdvSmemBytes =
      sizeof(float) * (2 * (kBlockN + kBlockM) * kLd + 2 * kBlockN * kSLd + 2 * kBlockM);
  // dq: thread rows are queries, thread columns keys.
  static constexpr int kQueryRows = kBlockM / kRowGroups;
  static constexpr int kKeyCols = kBlockN / kLanes;
  static constexpr int kDsLd = kBlockN + 1;  // dS: (kBlockM, kBlockN + 1)
  static constexpr size_t kDqSmemBytes = sizeof(float) * (2 * (kBlockM + kBlockN) * kLd + kBlockM * kDsLd);
  static_assert(kBlockM % kRowGroups == 0 && kBlockN % kRowGroups == 0, "tiles must split over the row groups");
  static_assert(kBlockM % kLanes == 0 && kBlockN % kLanes == 0 && kD % kLanes == 0, "tiles must split over lanes");
  static_assert(kDkdvSmemBytes <= kMaxSmemBytes && kDqSmemBytes <= kMaxSmemBytes, "backward tiles exceed shared memory");
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// The keys [key_lo(i), key_hi(i)) of row i relative to a tile starting at key j0, clipped to
// [0, n]; empty for rows past the sequence. A guarded sum adds key jj only when lo <= jj < hi.
struct TileRange {
  int lo, hi;
};
__device__ __forceinline__ TileRange tile_range(const ScoreRule& rule, int64_t i, int64_t j0, int n) {
  if (i >= rule.len_q) return {0, 0};
  auto clip = [n](int64_t x) { return static_cast<int>(x < 0 ? 0 : (x > n ? n : x)); };
  return {clip(rule.sc.key_lo(i) - j0), clip(rule.sc.key_hi(i) - j0)};
}

// ---- forward --------------------------------------------------------------------------------
template <typename T, int kD>
__global__ void __launch_bounds__(FwdTile<kD>::kThreads)
    flash_forward_kernel(const __grid_constant__ AttentionParams p) {
  using C = FwdTile<kD>;
  extern __shared__ float smem[];
  float* q_s = smem;                         // (kBlockM, kLd)   the query tile
  float* kv_s = q_s + C::kBlockM * C::kLd;   // (kBlockN, kLd)   a K tile, then the V tile
  float* p_s = kv_s + C::kBlockN * C::kLd;   // (kBlockM, kPLd)  P of the tile

  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
  const int64_t h = blockIdx.y, hk = h / p.group();
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * C::kBlockM;

  for (int64_t b = blockIdx.z; b < p.batch; b += gridDim.z) {
    const AttentionSeq seq = attention_seq(p, b);
    if (i0 >= seq.len_q) continue;  // the whole block
    const int64_t i1 = min64(i0 + C::kBlockM, seq.len_q);
    const ScoreRule rule(p, seq, b, h);
    const T* q = head_rows<T>(p.q, p.q_s, b, seq.start_q, h);
    const T* k = head_rows<T>(p.k, p.k_s, b, seq.start_k, hk);
    const T* v = head_rows<T>(p.v, p.v_s, b, seq.start_k, hk);

    __syncthreads();  // the previous batch's readers of the tiles are done
    load_rows<T, C::kBlockM, kD, C::kLd, C::kThreads>(q_s, q, p.q_s.row, i0, i1 - i0, static_cast<int>(p.head_dim));

    float m[C::kRows], l[C::kRows], acc[C::kRows][C::kDims];
#pragma unroll
    for (int a = 0; a < C::kRows; ++a) {
      m[a] = -INFINITY;
      l[a] = 0.0f;
#pragma unroll
      for (int c = 0; c < C::kDims; ++c) acc[a][c] = 0.0f;
    }

    // The keys some row of the tile may see: [key_lo(i0), key_hi(i1 - 1)) (both grow with i).
    const int64_t key_lo = rule.sc.key_lo(i0), key_hi = rule.sc.key_hi(i1 - 1);
    for (int64_t j0 = key_lo / C::kBlockN * C::kBlockN; j0 < key_hi; j0 += C::kBlockN) {
      const int64_t j1 = min64(j0 + C::kBlockN, seq.len_k);
      const bool guarded = !rule.tile_sees_all(i0, i1, j0, j1);

      __syncthreads();  // Q staged; the previous tile's P V is done with kv_s and p_s
      load_rows<T, C::kBlockN, kD, C::kLd, C::kThreads>(kv_s, k, p.k_s.row, j0, j1 - j0, static_cast<int>(p.head_dim));
      __syncthreads();

      // S = Q Kᵀ for rows ty + kRowGroups a, keys tx + 16 c.  (kRows, kKeys)
      float s[C::kRows][C::kKeys];
#pragma unroll
      for (int a = 0; a < C::kRows; ++a)
#pragma unroll
        for (int c = 0; c < C::kKeys; ++c) s[a][c] = 0.0f;
#pragma unroll 2
      for (int d = 0; d < kD; ++d) {
        float qv[C::kRows], kv[C::kKeys];
#pragma unroll
        for (int a = 0; a < C::kRows; ++a) qv[a] = q_s[(ty + C::kRowGroups * a) * C::kLd + d];
#pragma unroll
        for (int c = 0; c < C::kKeys; ++c) kv[c] = kv_s[(tx + kLanes * c) * C::kLd + d];
#pragma unroll
        for (int a = 0; a < C::kRows; ++a)
#pragma unroll
          for (int c = 0; c < C::kKeys; ++c) s[a][c] = fmaf(qv[a], kv[c], s[a][c]);
      }

      // The online softmax of each row over this tile; P into shared memory.
#pragma unroll
      for (int a = 0; a < C::kRows; ++a) {
        const int row = ty + C::kRowGroups * a;
        const int64_t i = i0 + row;
        float tile_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < C::kKeys; ++c) {
          s[a][c] = rule.masked_value(s[a][c], i, j0 + tx + kLanes * c);
          tile_max = MaxOp::apply(tile_max, s[a][c]);
        }
        tile_max = warp_reduce<MaxOp>(tile_max, kLanes);
        const float m_new = MaxOp::apply(m[a], tile_max);
        const bool none = m_new == -INFINITY;  // nothing visible so far: keep everything 0
        const float alpha = none ? 1.0f : expf(m[a] - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < C::kKeys; ++c) {
          const float pr = none ? 0.0f : expf(s[a][c] - m_new);
          p_s[row * C::kPLd + tx + kLanes * c] = pr;
          sum += pr;
        }
        sum = warp_reduce<SumOp>(sum, kLanes);
        l[a] = l[a] * alpha + sum;
        m[a] = m_new;
#pragma unroll
        for (int c = 0; c < C::kDims; ++c) acc[a][c] *= alpha;
      }

      __syncthreads();  // every thread is done with the K tile; P is complete
      load_rows<T, C::kBlockN, kD, C::kLd, C::kThreads>(kv_s, v, p.v_s.row, j0, j1 - j0, static_cast<int>(p.head_dim));
      __syncthreads();

      // acc += P V. Guarded tiles add key jj to row a only where the row sees it.
      TileRange range[C::kRows];
      if (guarded)
#pragma unroll
        for (int a = 0; a < C::kRows; ++a) range[a] = tile_range(rule, i0 + ty + C::kRowGroups * a, j0, C::kBlockN);
#pragma unroll 2
      for (int jj = 0; jj < C::kBlockN; ++jj) {
        float pv[C::kRows], vv[C::kDims];
#pragma unroll
        for (int a = 0; a < C::kRows; ++a) pv[a] = p_s[(ty + C::kRowGroups * a) * C::kPLd + jj];
#pragma unroll
        for (int c = 0; c < C::kDims; ++c) vv[c] = kv_s[jj * C::kLd + tx + kLanes * c];
#pragma unroll
        for (int a = 0; a < C::kRows; ++a) {
          const bool add = !guarded || (jj >= range[a].lo && jj < range[a].hi);
#pragma unroll
          for (int c = 0; c < C::kDims; ++c) acc[a][c] = add ? fmaf(pv[a], vv[c], acc[a][c]) : acc[a][c];
        }
      }
    }

    // out = acc / l, lse = m + log l; a row that saw nothing: 0 and -inf.
    T* out = head_rows_mut<T>(p.out, p.out_s, b, seq.start_q, h);
    float* lse = p.lse ? lse_row(p, b, h, seq.start_q) : nullptr;
#pragma unroll
    for (int a = 0; a < C::kRows; ++a) {
      const int64_t i = i0 + ty + C::kRowGroups * a;
      if (i >= i1) continue;
      const bool none = m[a] == -INFINITY;
      const float inv = none ? 0.0f : 1.0f / l[a];
#pragma unroll
      for (int c = 0; c < C::kDims; ++c) {
        const int d = tx + kLanes * c;
        if (d < p.head_dim) out[i * p.out_s.row + d] = from_float<T>(none ? 0.0f : acc[a][c] * inv);
      }
      if (lse && tx == 0) lse[i] = none ? -INFINITY : m[a] + logf(l[a]);
    }
  }
}

// ---- backward: dk, dv -----------------------------------------------------------------------
template <typename T, int kD>
__global__ void __launch_bounds__(BwdTile<kD>::kThreads)
    flash_bwd_dkdv_kernel(const __grid_constant__ AttentionParams p, const float* row_dot) {
  using C = BwdTile<kD>;
  extern __shared__ float smem[];
  float* k_s = smem;                          // (kBlockN, kLd)  K tile
  float* v_s = k_s + C::kBlockN * C::kLd;     // (kBlockN, kLd)  V tile
  float* q_s = v_s + C::kBlockN * C::kLd;     // (kBlockM, kLd)  Q tile
  float* do_s = q_s + C::kBlockM * C::kLd;    // (kBlockM, kLd)  dO tile
  float* pt_s = do_s + C::kBlockM * C::kLd;   // (kBlockN, kSLd) Pᵀ
  float* dst_s = pt_s + C::kBlockN * C::kSLd; // (kBlockN, kSLd) dSᵀ
  float* lse_s = dst_s + C::kBlockN * C::kSLd;  // (kBlockM)
  float* d_s = lse_s + C::kBlockM;              // (kBlockM)     D of the tile's rows

  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
  const int64_t hk = blockIdx.y, group = p.group();
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * C::kBlockN;

  for (int64_t b = blockIdx.z; b < p.batch; b += gridDim.z) {
    const AttentionSeq seq = attention_seq(p, b);
    if (j0 >= seq.len_k) continue;  // the whole block
    const int64_t j1 = min64(j0 + C::kBlockN, seq.len_k);

    __syncthreads();  // the previous batch's readers of the tiles are done
    load_rows<T, C::kBlockN, kD, C::kLd, C::kThreads>(k_s, head_rows<T>(p.k, p.k_s, b, seq.start_k, hk), p.k_s.row, j0,
                                                      j1 - j0, static_cast<int>(p.head_dim));
    load_rows<T, C::kBlockN, kD, C::kLd, C::kThreads>(v_s, head_rows<T>(p.v, p.v_s, b, seq.start_k, hk), p.v_s.row, j0,
                                                      j1 - j0, static_cast<int>(p.head_dim));

    float dk[C::kKeyRows][C::kDims], dv[C::kKeyRows][C::kDims];
#pragma unroll
    for (int a = 0; a < C::kKeyRows; ++a)
#pragma unroll
      for (int c = 0; c < C::kDims; ++c) dk[a][c] = dv[a][c] = 0.0f;

    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const ScoreRule rule(p, seq, b, h);
      const T* q = head_rows<T>(p.q, p.q_s, b, seq.start_q, h);
      const T* g = head_rows<T>(p.dout, p.dout_s, b, seq.start_q, h);
      const float* lse = lse_row(p, b, h, seq.start_q);
      const float* drow = row_dot + (b * p.heads_q + h) * p.seqlen_q;

      for (int64_t i0 = 0; i0 < seq.len_q; i0 += C::kBlockM) {
        const int64_t i1 = min64(i0 + C::kBlockM, seq.len_q);
        if (!rule.tile_may_see(i0, i1, j0, j1)) continue;  // the whole block
        const bool guarded = !rule.tile_sees_all(i0, i1, j0, j1);

        __syncthreads();  // K, V staged; the previous query tile's readers are done
        load_rows<T, C::kBlockM, kD, C::kLd, C::kThreads>(q_s, q, p.q_s.row, i0, i1 - i0, static_cast<int>(p.head_dim));
        load_rows<T, C::kBlockM, kD, C::kLd, C::kThreads>(do_s, g, p.dout_s.row, i0, i1 - i0,
                                                          static_cast<int>(p.head_dim));
        for (int r = threadIdx.x; r < C::kBlockM; r += C::kThreads) {
          const bool in = i0 + r < i1;
          lse_s[r] = in ? lse[i0 + r] : 0.0f;
          d_s[r] = in ? drow[i0 + r] : 0.0f;
        }
        __syncthreads();

        // Sᵀ = K Qᵀ (dots) and dPᵀ = V dOᵀ for keys ty + kRowGroups a, queries tx + 16 c.
        float s[C::kKeyRows][C::kQueryCols], dp[C::kKeyRows][C::kQueryCols];
#pragma unroll
        for (int a = 0; a < C::kKeyRows; ++a)
#pragma unroll
          for (int c = 0; c < C::kQueryCols; ++c) s[a][c] = dp[a][c] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < kD; ++d) {
          float kv[C::kKeyRows], vv[C::kKeyRows], qv[C::kQueryCols], ov[C::kQueryCols];
#pragma unroll
          for (int a = 0; a < C::kKeyRows; ++a) {
            kv[a] = k_s[(ty + C::kRowGroups * a) * C::kLd + d];
            vv[a] = v_s[(ty + C::kRowGroups * a) * C::kLd + d];
          }
#pragma unroll
          for (int c = 0; c < C::kQueryCols; ++c) {
            qv[c] = q_s[(tx + kLanes * c) * C::kLd + d];
            ov[c] = do_s[(tx + kLanes * c) * C::kLd + d];
          }
#pragma unroll
          for (int a = 0; a < C::kKeyRows; ++a)
#pragma unroll
            for (int c = 0; c < C::kQueryCols; ++c) {
              s[a][c] = fmaf(kv[a], qv[c], s[a][c]);
              dp[a][c] = fmaf(vv[a], ov[c], dp[a][c]);
            }
        }

        // Pᵀ = exp(score - lse), dSᵀ = Pᵀ (dPᵀ - D) ds'; 0 where the pair is not visible.
#pragma unroll
        for (int a = 0; a < C::kKeyRows; ++a) {
          const int key = ty + C::kRowGroups * a;
#pragma unroll
          for (int c = 0; c < C::kQueryCols; ++c) {
            const int query = tx + kLanes * c;
            const int64_t i = i0 + query, j = j0 + key;
            float pr = 0.0f, ds = 0.0f;
            if (rule.visible(i, j)) {
              pr = prob_from_lse(rule.value(s[a][c], i, j), lse_s[query]);
              ds = pr * (dp[a][c] - d_s[query]) * rule.dot_grad(s[a][c]);
            }
            pt_s[key * C::kSLd + query] = pr;
            dst_s[key * C::kSLd + query] = ds;
          }
        }
        __syncthreads();

        // dV += Pᵀ dO, dK += dSᵀ Q. Guarded tiles add query row qq only to the keys it sees.
#pragma unroll 2
        for (int qq = 0; qq < C::kBlockM; ++qq) {
          int64_t lo = 0, hi = 0;  // the keys query i0 + qq sees (none past the sequence)
          if (guarded && i0 + qq < i1) {
            lo = rule.sc.key_lo(i0 + qq);
            hi = rule.sc.key_hi(i0 + qq);
          }
          float pa[C::kKeyRows], sa[C::kKeyRows], ov[C::kDims], qv[C::kDims];
#pragma unroll
          for (int a = 0; a < C::kKeyRows; ++a) {
            pa[a] = pt_s[(ty + C::kRowGroups * a) * C::kSLd + qq];
            sa[a] = dst_s[(ty + C::kRowGroups * a) * C::kSLd + qq];
          }
#pragma unroll
          for (int c = 0; c < C::kDims; ++c) {
            ov[c] = do_s[qq * C::kLd + tx + kLanes * c];
            qv[c] = q_s[qq * C::kLd + tx + kLanes * c];
          }
#pragma unroll
          for (int a = 0; a < C::kKeyRows; ++a) {
            const int64_t j = j0 + ty + C::kRowGroups * a;
            const bool add = !guarded || (j >= lo && j < hi);
#pragma unroll
            for (int c = 0; c < C::kDims; ++c) {
              dv[a][c] = add ? fmaf(pa[a], ov[c], dv[a][c]) : dv[a][c];
              dk[a][c] = add ? fmaf(sa[a], qv[c], dk[a][c]) : dk[a][c];
            }
          }
        }
      }
    }

    // dk and dv of the tile's keys (0 for a key no query sees).
    T* dk_out = head_rows_mut<T>(p.dk, p.dk_s, b, seq.start_k, hk);
    T* dv_out = head_rows_mut<T>(p.dv, p.dv_s, b, seq.start_k, hk);
#pragma unroll
    for (int a = 0; a < C::kKeyRows; ++a) {
      const int64_t j = j0 + ty + C::kRowGroups * a;
      if (j >= j1) continue;
#pragma unroll
      for (int c = 0; c < C::kDims; ++c) {
        const int d = tx + kLanes * c;
        if (d >= p.head_dim) continue;
        dk_out[j * p.dk_s.row + d] = from_float<T>(dk[a][c]);
        dv_out[j * p.dv_s.row + d] = from_float<T>(dv[a][c]);
      }
    }
  }
}

// ---- backward: dq ---------------------------------------------------------------------------
template <typename T, int kD>
__global__ void __launch_bounds__(BwdTile<kD>::kThreads)
    flash_bwd_dq_kernel(const __grid_constant__ AttentionParams p, const float* row_dot) {
  using C = BwdTile<kD>;
  extern __shared__ float smem[];
  float* q_s = smem;                          // (kBlockM, kLd)   Q tile
  float* do_s = q_s + C::kBlockM * C::kLd;    // (kBlockM, kLd)   dO tile
  float* k_s = do_s + C::kBlockM * C::kLd;    // (kBlockN, kLd)   K tile
  float* v_s = k_s + C::kBlockN * C::kLd;     // (kBlockN, kLd)   V tile
  float* ds_s = v_s + C::kBlockN * C::kLd;    // (kBlockM, kDsLd) dS

  const int tx = threadIdx.x % kLanes, ty = threadIdx.x / kLanes;
  const int64_t h = blockIdx.y, hk = h / p.group();
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * C::kBlockM;

  for (int64_t b = blockIdx.z; b < p.batch; b += gridDim.z) {
    const AttentionSeq seq = attention_seq(p, b);
    if (i0 >= seq.len_q) continue;  // the whole block
    const int64_t i1 = min64(i0 + C::kBlockM, seq.len_q);
    const ScoreRule rule(p, seq, b, h);
    const T* k = head_rows<T>(p.k, p.k_s, b, seq.start_k, hk);
    const T* v = head_rows<T>(p.v, p.v_s, b, seq.start_k, hk);

    __syncthreads();  // the previous batch's readers of the tiles are done
    load_rows<T, C::kBlockM, kD, C::kLd, C::kThreads>(q_s, head_rows<T>(p.q, p.q_s, b, seq.start_q, h), p.q_s.row, i0,
                                                      i1 - i0, static_cast<int>(p.head_dim));
    load_rows<T, C::kBlockM, kD, C::kLd, C::kThreads>(do_s, head_rows<T>(p.dout, p.dout_s, b, seq.start_q, h),
                                                      p.dout_s.row, i0, i1 - i0, static_cast<int>(p.head_dim));

    // lse and D of the thread's rows (0 past the sequence: those rows see nothing).
    const float* lse = lse_row(p, b, h, seq.start_q);
    const float* drow = row_dot + (b * p.heads_q + h) * p.seqlen_q;
    float row_lse[C::kQueryRows], row_d[C::kQueryRows], dq[C::kQueryRows][C::kDims];
#pragma unroll
    for (int a = 0; a < C::kQueryRows; ++a) {
      const int64_t i = i0 + ty + C::kRowGroups * a;
      row_lse[a] = i < i1 ? lse[i] : 0.0f;
      row_d[a] = i < i1 ? drow[i] : 0.0f;
#pragma unroll
      for (int c = 0; c < C::kDims; ++c) dq[a][c] = 0.0f;
    }

    const int64_t key_lo = rule.sc.key_lo(i0), key_hi = rule.sc.key_hi(i1 - 1);
    for (int64_t j0 = key_lo / C::kBlockN * C::kBlockN; j0 < key_hi; j0 += C::kBlockN) {
      const int64_t j1 = min64(j0 + C::kBlockN, seq.len_k);
      const bool guarded = !rule.tile_sees_all(i0, i1, j0, j1);

      __syncthreads();  // Q, dO staged; the previous tile's dS K is done with k_s and ds_s
      load_rows<T, C::kBlockN, kD, C::kLd, C::kThreads>(k_s, k, p.k_s.row, j0, j1 - j0, static_cast<int>(p.head_dim));
      load_rows<T, C::kBlockN, kD, C::kLd, C::kThreads>(v_s, v, p.v_s.row, j0, j1 - j0, static_cast<int>(p.head_dim));
      __syncthreads();

      // S = Q Kᵀ (dots) and dP = dO Vᵀ for rows ty + kRowGroups a, keys tx + 16 c.
      float s[C::kQueryRows][C::kKeyCols], dp[C::kQueryRows][C::kKeyCols];
#pragma unroll
      for (int a = 0; a < C::kQueryRows; ++a)
#pragma unroll
        for (int c = 0; c < C::kKeyCols; ++c) s[a][c] = dp[a][c] = 0.0f;
#pragma unroll 4
      for (int d = 0; d < kD; ++d) {
        float qv[C::kQueryRows], ov[C::kQueryRows], kv[C::kKeyCols], vv[C::kKeyCols];
#pragma unroll
        for (int a = 0; a < C::kQueryRows; ++a) {
          qv[a] = q_s[(ty + C::kRowGroups * a) * C::kLd + d];
          ov[a] = do_s[(ty + C::kRowGroups * a) * C::kLd + d];
        }
#pragma unroll
        for (int c = 0; c < C::kKeyCols; ++c) {
          kv[c] = k_s[(tx + kLanes * c) * C::kLd + d];
          vv[c] = v_s[(tx + kLanes * c) * C::kLd + d];
        }
#pragma unroll
        for (int a = 0; a < C::kQueryRows; ++a)
#pragma unroll
          for (int c = 0; c < C::kKeyCols; ++c) {
            s[a][c] = fmaf(qv[a], kv[c], s[a][c]);
            dp[a][c] = fmaf(ov[a], vv[c], dp[a][c]);
          }
      }

      // dS = P (dP - D) ds', P = exp(score - lse); 0 where the pair is not visible.
#pragma unroll
      for (int a = 0; a < C::kQueryRows; ++a) {
        const int row = ty + C::kRowGroups * a;
#pragma unroll
        for (int c = 0; c < C::kKeyCols; ++c) {
          const int key = tx + kLanes * c;
          const int64_t i = i0 + row, j = j0 + key;
          float ds = 0.0f;
          if (rule.visible(i, j)) {
            const float pr = prob_from_lse(rule.value(s[a][c], i, j), row_lse[a]);
            ds = pr * (dp[a][c] - row_d[a]) * rule.dot_grad(s[a][c]);
          }
          ds_s[row * C::kDsLd + key] = ds;
        }
      }
      __syncthreads();

      // dq += dS K. Guarded tiles add key kk to row a only where the row sees it.
      TileRange range[C::kQueryRows];
      if (guarded)
#pragma unroll
        for (int a = 0; a < C::kQueryRows; ++a)
          range[a] = tile_range(rule, i0 + ty + C::kRowGroups * a, j0, C::kBlockN);
#pragma unroll 2
      for (int kk = 0; kk < C::kBlockN; ++kk) {
        float da[C::kQueryRows], kv[C::kDims];
#pragma unroll
        for (int a = 0; a < C::kQueryRows; ++a) da[a] = ds_s[(ty + C::kRowGroups * a) * C::kDsLd + kk];
#pragma unroll
        for (int c = 0; c < C::kDims; ++c) kv[c] = k_s[kk * C::kLd + tx + kLanes * c];
#pragma unroll
        for (int a = 0; a < C::kQueryRows; ++a) {
          const bool add = !guarded || (kk >= range[a].lo && kk < range[a].hi);
#pragma unroll
          for (int c = 0; c < C::kDims; ++c) dq[a][c] = add ? fmaf(da[a], kv[c], dq[a][c]) : dq[a][c];
        }
      }
    }

    // dq of the tile's rows (0 for a row that sees no key).
    T* dq_out = head_rows_mut<T>(p.dq, p.dq_s, b, seq.start_q, h);
#pragma unroll
    for (int a = 0; a < C::kQueryRows; ++a) {
      const int64_t i = i0 + ty + C::kRowGroups * a;
      if (i >= i1) continue;
#pragma unroll
      for (int c = 0; c < C::kDims; ++c) {
        const int d = tx + kLanes * c;
        if (d < p.head_dim) dq_out[i * p.dq_s.row + d] = from_float<T>(dq[a][c]);
      }
    }
  }
}

// ---- the launch ---------------------------------------------------------------------------------
// The head dim the kernels are compiled for: head_dim rounded up to 64, 128 or 256.
template <typename Body>
cudaError_t dispatch_head_dim(int64_t head_dim, Body&& body) {
  if (head_dim <= 64) return body.template operator()<64>();
  if (head_dim <= 128) return body.template operator()<128>();
  if (head_dim <= 256) return body.template operator()<256>();
  return cudaErrorInvalidValue;  // the API admits D <= 256 only
}

// A grid of `tiles` x `heads` x batch (batch chunked over grid z by the kernels' loop); refuses
// extents past CUDA's limits.
bool make_grid(int64_t tiles, int64_t heads, int64_t batch, dim3* grid) {
  if (tiles > INT32_MAX || heads > kMaxGridY) return false;
  *grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(heads),
               static_cast<unsigned>(batch < kMaxGridZ ? batch : kMaxGridZ));
  return true;
}

// Launches kernel(args...) on the grid with `smem` bytes of dynamic shared memory (opted in).
template <typename Kernel, typename... Args>
cudaError_t launch(Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream, Args... args) {
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      e != cudaSuccess)
    return e;
  kernel<<<grid, threads, smem, stream>>>(args...);
  return cudaGetLastError();
}

template <typename T, int kD>
cudaError_t flash_forward(const AttentionParams& p, cudaStream_t stream) {
  using C = FwdTile<kD>;
  if (p.seqlen_q == 0) return cudaSuccess;
  dim3 grid;
  if (!make_grid(ceil_div(p.seqlen_q, C::kBlockM), p.heads_q, p.batch, &grid)) return cudaErrorInvalidConfiguration;
  return launch(flash_forward_kernel<T, kD>, grid, C::kThreads, C::kSmemBytes, stream, p);
}

template <typename T, int kD>
cudaError_t flash_backward(const AttentionParams& p, float* row_dot, cudaStream_t stream) {
  using C = BwdTile<kD>;
  if (cudaError_t e = attention_simt::launch_row_dot<T>(p, row_dot, stream); e != cudaSuccess) return e;
  if (p.seqlen_k > 0) {  // dk, dv (0 for keys no query sees, also when seqlen_q = 0)
    dim3 grid;
    if (!make_grid(ceil_div(p.seqlen_k, C::kBlockN), p.heads_kv, p.batch, &grid)) return cudaErrorInvalidConfiguration;
    if (cudaError_t e = launch(flash_bwd_dkdv_kernel<T, kD>, grid, C::kThreads, C::kDkdvSmemBytes, stream, p,
                               static_cast<const float*>(row_dot));
        e != cudaSuccess)
      return e;
  }
  if (p.seqlen_q > 0) {  // dq (0 for rows that see no key, also when seqlen_k = 0)
    dim3 grid;
    if (!make_grid(ceil_div(p.seqlen_q, C::kBlockM), p.heads_q, p.batch, &grid)) return cudaErrorInvalidConfiguration;
    if (cudaError_t e = launch(flash_bwd_dq_kernel<T, kD>, grid, C::kThreads, C::kDqSmemBytes, stream, p,
                               static_cast<const float*>(row_dot));
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

// The backward's scratch: D, B * H_q * seqlen_q floats. False when the count passes 2^60.
bool carve(WorkspaceArena& arena, const AttentionParams& p, float** row_dot) {
  *row_dot = nullptr;
  if (!p.backward) return true;
  const int64_t rows = attention_simt::checked_count(p.batch, p.heads_q, p.seqlen_q, 1);
  if (rows < 0) return false;
  *row_dot = arena.take<float>(rows);
  return true;
}

}  // namespace

cudaError_t attention_flash(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream) {
  WorkspaceArena arena(workspace);
  float* row_dot = nullptr;
  if (!carve(arena, p, &row_dot) || !arena.ok()) return cudaErrorInvalidValue;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_head_dim(p.head_dim, [&]<int kD>() -> cudaError_t {
      return p.backward ? flash_backward<T, kD>(p, row_dot, stream) : flash_forward<T, kD>(p, stream);
    });
  });
}

cudaError_t attention_flash_workspace(const AttentionParams& p, size_t* bytes) {
  WorkspaceArena arena;  // counting
  float* row_dot = nullptr;
  *bytes = carve(arena, p, &row_dot) ? arena.peak() : SIZE_MAX;
  return cudaSuccess;
}

}  // namespace optimized::cuda
