// flash2 forward: FlashAttention-2 on mma.sync tensor cores (Dao, "FlashAttention-2: Faster
// Attention with Better Parallelism and Work Partitioning", 2023), for fp16 and bf16.
//
// The story, from the flash rung (one thread per query row, SIMT fp32 dot products):
//  1. Tensor cores. S = Q Kᵀ and O += P V run as mma.sync.m16n8k16 (fp32 accumulators) with the
//     operands read from XOR-swizzled shared memory by ldmatrix (conflict-free; flash2_common.cuh).
//  2. FlashAttention-2's work partitioning. A block owns kBlockM query rows of one (batch, head)
//     and walks over the key tiles; its 4 warps (8 at d = 256) split the query rows, never the
//     keys, so the online softmax (row max, row sum, rescale of O) stays inside a warp: a row's
//     statistics live in the 4 lanes of a quad and combine with two shuffles. No shared-memory
//     reduction, no barrier for the softmax.
//  3. P never leaves registers. The C fragment of S has the layout of the A fragment of P V
//     (c_to_a): the probabilities are rounded to 16 bits in registers and fed to the next mma.
//  4. The loads hide behind the math (FA2's pipeline): Q arrives once with cp.async; K and V have
//     one buffer each and alternate: V[n] is copied while S = Q K[n]ᵀ and the softmax run, K of
//     the next tile while P V[n] runs. Two barriers per key tile.
//  5. Only what can be visible is touched. AttentionScore's key_lo / key_hi of the block's first
//     and last rows bound the key tiles (causal and sliding windows skip whole tiles); tiles are
//     walked from the last to the first, and only the tiles that cross some row's boundary (or
//     the sequence end) test keys element by element. Softcap, ALiBi and an explicit mask are a
//     second instance of the kernel (kScoreMod), so the common case pays nothing for them.
//  6. Epilogue: O / l is rounded to 16 bits into the warp's own rows of the Q tile (no block
//     barrier: a warp only ever reads its own Q rows) and written out in 16-byte stores, whole
//     rows per lane group; lse = (m + log2 l) ln 2 in fp32. A row without a visible key has l = 0:
//     out 0, lse -inf.
// The grid is (query tiles, heads, batch) with the query tiles in reverse order: causal's heavy
// tiles (the last query rows see the most keys) start first and the light ones fill the tail.
//
// Scores are kept in the log2 domain (s * log2 e; ex2.approx), max and sum as fp32 per row.
// Rows past the sequence are computed on zero-filled Q rows and never written; keys past it are
// zero-filled (so that 0 * V stays 0) and masked to -inf.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_params.h"
#include "attention/cuda/flash2.h"
#include "attention/cuda/flash2_common.cuh"

namespace optimized::cuda::flash2 {

// ---- config ------------------------------------------------------------------------------------
// Tiles per head dim (H100, mma.sync). The block's rows are split over the warps; each warp owns
// kBlockM / kWarps rows (2 m-tiles of 16 with 4 warps: every K / V fragment read from shared
// memory feeds two mma). Per thread the O accumulator is kBlockM * D / (32 * kWarps) floats and S
// kBlockM * kBlockN / (32 * kWarps): the 255-register file bounds kBlockN as D grows.
//   d = 64:  128 x 64, 4 warps: O 64 + S 64 floats; smem 16 + 8 + 8 KiB. (FA2's 128 x 128 needs
//            S 128 floats and spilled 84 bytes here: ptxas -v, CUDA 13.0.)
//   d = 96:  128 x 64, 4 warps (rows stored in 128 columns): O 96 + S 64; 32 + 16 + 16 KiB.
//   d = 128: 128 x 64, 4 warps: O 128 + S 64, 255 registers, 2 blocks per SM; 64 KiB.
//   d = 256: 128 x 64, 8 warps of 16 rows: O 128 + S 32; Q 64 KiB + K 32 + V 32 = 128 KiB, one
//            block per SM (8 warps keep the tensor pipe fed).
// The score-mod instance (softcap / ALiBi / explicit mask: a longer per-score rule with its own
// live values) halves kBlockN at d >= 96 so that S takes half the registers: at 128 x 64 it
// spilled 180 bytes at d = 128.
struct FwdConfig {
  int block_m, block_n, warps;
};
constexpr FwdConfig fwd_config(int head_dim, bool score_mod) {
  if (head_dim <= 64) return {128, 64, 4};
  if (head_dim <= 128) return {128, score_mod ? 32 : 64, 4};
  return {128, score_mod ? 32 : 64, 8};
}

template <typename T, int kHeadDim, bool kScoreMod>
struct FwdTraits {
  static constexpr FwdConfig kCfg = fwd_config(kHeadDim, kScoreMod);
  static constexpr int kBlockM = kCfg.block_m;
  static constexpr int kBlockN = kCfg.block_n;
  static constexpr int kWarps = kCfg.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpRows = kBlockM / kWarps;  // query rows per warp
  static constexpr int kMT = kWarpRows / 16;           // m-tiles per warp
  static constexpr int kNT = kBlockN / 8;              // n-tiles of S (keys)
  static constexpr int kDT = kHeadDim / 8;             // n-tiles of O (head dim)
  static constexpr int kQKSteps = kHeadDim / 16;       // k-steps of Q Kᵀ
  static constexpr int kPVSteps = kBlockN / 16;        // k-steps of P V
  static constexpr int kCols = smem_cols(kHeadDim);
  using QTile = SmemTile<kBlockM, kCols>;  // [query][d]
  using KTile = SmemTile<kBlockN, kCols>;  // [key][d]  (V alike)
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = QTile::kBytes;
  static constexpr int kVOffset = QTile::kBytes + KTile::kBytes;
  static constexpr int kSmemBytes = QTile::kBytes + 2 * KTile::kBytes;

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "instantiated head dims: 64, 96, 128, 256");
  static_assert(kWarpRows % 16 == 0 && kMT >= 1, "a warp owns whole m-tiles");
  static_assert(kNT % 2 == 0 && kDT % 2 == 0, "ldmatrix.x4 reads n-tiles in pairs");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per block");
};

// ---- kernel --------------------------------------------------------------------------------------
template <typename T, int kHeadDim, bool kScoreMod>
__global__ void __launch_bounds__(FwdTraits<T, kHeadDim, kScoreMod>::kThreads)
    flash2_fwd_kernel(const __grid_constant__ AttentionParams p) {
  using K = FwdTraits<T, kHeadDim, kScoreMod>;
  extern __shared__ __align__(128) unsigned char smem[];

  const int m_block = static_cast<int>(gridDim.x - 1 - blockIdx.x);  // heavy (late) query tiles first
  const int64_t h = blockIdx.y;
  const int64_t b = blockIdx.z;
  const AttentionSeq seq = attention_seq(p, b);
  const int len_q = static_cast<int>(seq.len_q);
  const int len_k = static_cast<int>(seq.len_k);
  const int m0 = m_block * K::kBlockM;
  if (m0 >= len_q) return;  // varlen: this sequence is shorter than the grid's longest

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int warp_row0 = warp * K::kWarpRows;  // first block row of this warp

  const int64_t hk = h / p.group();
  const T* q = static_cast<const T*>(p.q) + b * p.q_s.batch + (seq.start_q + m0) * p.q_s.row + h * p.q_s.head;
  const T* k = static_cast<const T*>(p.k) + b * p.k_s.batch + seq.start_k * p.k_s.row + hk * p.k_s.head;
  const T* v = static_cast<const T*>(p.v) + b * p.v_s.batch + seq.start_k * p.v_s.row + hk * p.v_s.head;
  const int d_chunks = static_cast<int>(p.head_dim / 8);  // valid 16-byte chunks of a row

  const ScoreRule rule(p, seq, b, h);

  // The key tiles the block may see: [n_begin, n_end). Rows' ranges grow with i, so the union is
  // [key_lo(first row), key_hi(last row)) and every row sees all of [key_lo(last), key_hi(first)).
  const int m_last = (m0 + K::kBlockM < len_q ? m0 + K::kBlockM : len_q) - 1;
  const int key_begin = rule.key_lo(m0);
  const int key_end = rule.key_hi(m_last);
  const int full_lo = rule.key_lo(m_last);
  const int full_hi = rule.key_hi(m0);
  const int n_begin = key_begin / K::kBlockN;
  const int n_end = key_end > key_begin ? (key_end + K::kBlockN - 1) / K::kBlockN : n_begin;

  float o[K::kMT][K::kDT][4];  // O accumulator, C fragments (rows, head dim)
#pragma unroll
  for (int mt = 0; mt < K::kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < K::kDT; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.0f;
  float row_max[K::kMT][2];  // running max of the log2 scores (-inf: nothing seen yet)
  float row_sum[K::kMT][2];  // this lane's part of the running sum (quad-reduced at the end)
#pragma unroll
  for (int mt = 0; mt < K::kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mt][r] = kNegInf;
      row_sum[mt][r] = 0.0f;
    }

  const uint32_t smem_base = ptx::smem_u32(smem);
  const uint32_t q_smem = smem_base + K::kQOffset;
  const uint32_t k_smem = smem_base + K::kKOffset;
  const uint32_t v_smem = smem_base + K::kVOffset;

  if (n_begin < n_end) {
    // Prologue: Q and the last key tile in one group.
    load_tile<typename K::QTile, K::kThreads, K::kDT>(q_smem, q, p.q_s.row, len_q - m0, d_chunks, tid);
    {
      const int n0 = (n_end - 1) * K::kBlockN;
      load_tile<typename K::KTile, K::kThreads, K::kDT>(k_smem, k + int64_t(n0) * p.k_s.row, p.k_s.row, len_k - n0,
                                                        d_chunks, tid);
    }
    ptx::cp_async_commit();

    for (int nb = n_end - 1; nb >= n_begin; --nb) {
      const int n0 = nb * K::kBlockN;
      // K[nb] (and Q) landed for every thread; every warp is done with V[nb + 1].
      ptx::cp_async_wait<0>();
      __syncthreads();
      load_tile<typename K::KTile, K::kThreads, K::kDT>(v_smem, v + int64_t(n0) * p.v_s.row, p.v_s.row, len_k - n0,
                                                        d_chunks, tid);
      ptx::cp_async_commit();

      // S = Q K[nb]ᵀ: (kMT x 16) x kBlockN per warp.
      float s[K::kMT][K::kNT][4];
#pragma unroll
      for (int mt = 0; mt < K::kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < K::kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < K::kQKSteps; ++ks) {
        uint32_t a[K::kMT][4];
#pragma unroll
        for (int mt = 0; mt < K::kMT; ++mt)
          ldsm_a<typename K::QTile>(a[mt], q_smem, warp_row0 + 16 * mt, 2 * ks, lane);
#pragma unroll
        for (int np = 0; np < K::kNT / 2; ++np) {
          uint32_t bf[2][2];
          ldsm_b_nk<typename K::KTile>(bf, k_smem, 16 * np, 2 * ks, lane);
#pragma unroll
          for (int mt = 0; mt < K::kMT; ++mt) {
            mma<T>(s[mt][2 * np], a[mt], bf[0]);
            mma<T>(s[mt][2 * np + 1], a[mt], bf[1]);
          }
        }
      }

      // Scores. The score-mod instance turns the dot products into log2-domain scores here; the
      // plain one keeps them raw (scale > 0: the row max of the raw dots is the max of the
      // scores) and folds scale * log2(e) into the exponent's FFMA below, as FlashAttention-2 does:
      // one instruction per score fewer on the softmax's critical path. The per-key range test
      // runs only on tiles that cross a boundary.
      auto scores = [&]<bool kRange>() {
#pragma unroll
        for (int mt = 0; mt < K::kMT; ++mt)
#pragma unroll
          for (int nt = 0; nt < K::kNT; ++nt) {
            const int i0 = m0 + warp_row0 + 16 * mt + g, j0 = n0 + 8 * nt + 2 * t;
            if constexpr (kScoreMod) {
              rule.apply<true, kRange>(s[mt][nt], i0, j0);
            } else if constexpr (kRange) {
#pragma unroll
              for (int e = 0; e < 4; ++e)
                if (!rule.visible(i0 + 8 * (e >> 1), j0 + (e & 1))) s[mt][nt][e] = kNegInf;
            }
          }
      };
      if (n0 < full_lo || n0 + K::kBlockN > full_hi) scores.template operator()<true>();
      else scores.template operator()<false>();

      // Online softmax: new row max, rescale O and the sum, P = 2^(s - max) in place. `unit`: what
      // turns s into the log2 domain (1 for the score-mod instance, scale * log2 e for the plain one).
      const float unit = kScoreMod ? 1.0f : rule.scale_log2;
#pragma unroll
      for (int mt = 0; mt < K::kMT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float tile_max = kNegInf;
#pragma unroll
          for (int nt = 0; nt < K::kNT; ++nt)
            tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          const float mx = fmaxf(row_max[mt][r], quad_max(tile_max) * unit);
          // A row with nothing visible yet keeps max -inf; subtract 0 then (2^-inf = 0).
          const float base = mx == kNegInf ? 0.0f : mx;
          const float alpha = exp2_approx(row_max[mt][r] - base);
          row_max[mt][r] = mx;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < K::kNT; ++nt) {
            const float p0 = exp2_approx(fmaf(s[mt][nt][2 * r], unit, -base));
            const float p1 = exp2_approx(fmaf(s[mt][nt][2 * r + 1], unit, -base));
            s[mt][nt][2 * r] = p0;
            s[mt][nt][2 * r + 1] = p1;
            sum += p0 + p1;
          }
          row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < K::kDT; ++dt) {
            o[mt][dt][2 * r] *= alpha;
            o[mt][dt][2 * r + 1] *= alpha;
          }
        }

      // V[nb] landed for every thread; every warp is done with K[nb]: fetch the next key tile.
      ptx::cp_async_wait<0>();
      __syncthreads();
      if (nb > n_begin) {
        const int n1 = n0 - K::kBlockN;
        load_tile<typename K::KTile, K::kThreads, K::kDT>(k_smem, k + int64_t(n1) * p.k_s.row, p.k_s.row, len_k - n1,
                                                          d_chunks, tid);
        ptx::cp_async_commit();
      }

      // O += P V[nb].
#pragma unroll
      for (int kk = 0; kk < K::kPVSteps; ++kk) {
        uint32_t a[K::kMT][4];
#pragma unroll
        for (int mt = 0; mt < K::kMT; ++mt) c_to_a<T>(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < K::kDT / 2; ++dp) {
          uint32_t bf[2][2];
          ldsm_b_kn<typename K::KTile>(bf, v_smem, 16 * kk, 2 * dp, lane);
#pragma unroll
          for (int mt = 0; mt < K::kMT; ++mt) {
            mma<T>(o[mt][2 * dp], a[mt], bf[0]);
            mma<T>(o[mt][2 * dp + 1], a[mt], bf[1]);
          }
        }
      }
    }
  }

  // ---- epilogue --------------------------------------------------------------------------------
  // Every copy has landed (the last iteration waited for all and issued none). O / l into this
  // warp's own rows of the Q tile, then 16-byte stores of whole rows.
  float* lse = static_cast<float*>(p.lse);
  if (lse) lse += b * p.lse_batch + h * p.lse_head + seq.start_q + m0;
#pragma unroll
  for (int mt = 0; mt < K::kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[mt][r]);
      const bool empty = l == 0.0f;  // no visible key (NaN l is not empty: it propagates)
      const float inv = empty ? 0.0f : 1.0f / l;
      const int row = warp_row0 + 16 * mt + g + 8 * r;
#pragma unroll
      for (int dt = 0; dt < K::kDT; ++dt) {
        const float x0 = empty ? 0.0f : o[mt][dt][2 * r] * inv;
        const float x1 = empty ? 0.0f : o[mt][dt][2 * r + 1] * inv;
        const uint32_t addr = q_smem + K::QTile::offset(row, dt) + 4 * t;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(pack2<T>(x0, x1)) : "memory");
      }
      if (lse && t == 0 && m0 + row < len_q) {
        const float mx = row_max[mt][r];
        lse[row] = empty ? kNegInf : (mx + log2_approx(l)) * kLn2;
      }
    }
  __syncwarp();
  T* out = static_cast<T*>(p.out) + b * p.out_s.batch + (seq.start_q + m0) * p.out_s.row + h * p.out_s.head;
  constexpr int kRowChunks = K::kDT;  // 16-byte chunks of an output row (instance width)
#pragma unroll
  for (int idx = lane; idx < K::kWarpRows * kRowChunks; idx += 32) {
    const int row = warp_row0 + idx / kRowChunks;
    const int c = idx % kRowChunks;
    if (m0 + row < len_q && c < d_chunks) {
      uint4 val;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(q_smem + K::QTile::offset(row, c)));
      *reinterpret_cast<uint4*>(out + int64_t(row) * p.out_s.row + c * 8) = val;
    }
  }
}

// ---- launcher ------------------------------------------------------------------------------------
template <typename T, int kHeadDim, bool kScoreMod>
cudaError_t launch_forward(const AttentionParams& p, cudaStream_t stream) {
  using K = FwdTraits<T, kHeadDim, kScoreMod>;
  const auto kernel = &flash2_fwd_kernel<T, kHeadDim, kScoreMod>;
  // Above 48 KiB a block needs the opt-in; cheap enough to repeat per launch (and correct when the
  // current device changes between calls).
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, K::kSmemBytes);
      e != cudaSuccess)
    return e;
  const int64_t m_blocks = (p.seqlen_q + K::kBlockM - 1) / K::kBlockM;
  if (m_blocks > INT32_MAX || p.heads_q > 65535 || p.batch > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch));
  kernel<<<grid, K::kThreads, K::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kHeadDim>
cudaError_t run_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.heads_q <= 0) return cudaSuccess;  // nothing to write
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0 || p.head_dim > kHeadDim || p.head_dim % 8 != 0)
    return cudaErrorInvalidValue;
  // The plain instance folds the scale into the exponent after the row max (a max of raw dot
  // products): right for scale > 0 only; any other scale takes the score-mod instance.
  const bool score_mod = p.softcap > 0.0 || p.alibi != nullptr || p.mask != nullptr || !(p.scale > 0.0);
  return score_mod ? launch_forward<T, kHeadDim, true>(p, stream) : launch_forward<T, kHeadDim, false>(p, stream);
}

}  // namespace optimized::cuda::flash2
