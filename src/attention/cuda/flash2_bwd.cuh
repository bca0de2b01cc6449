// The flash2 rung's backward: dq, dk, dv of softmax(S) V by the FlashAttention-2 algorithm
// (Dao 2023, Algorithm 2) on mma.sync tensor cores, for every feature of the score rule.
//
// Given the forward's lse (fp32, natural log) the softmax never has to be renormalised:
//   P = exp(s - lse)  (s = the score rule on q_i . k_j, attention_params.h)
//   dV = Pᵀ dO    dP = dO Vᵀ    dS = P ∘ (dP - D),  D_i = rowsum(dO_i ∘ O_i)
//   dK = scale Σ dSᵀ Q    dQ = scale Σ dS K     (softcap: dS ∘= 1 - tanh², recomputed)
// Three kernels (four in deterministic mode), in stream order:
//  1. preprocess: D_i into the workspace (fp32, [H_q][rows]); the non-deterministic path also
//     zeroes the fp32 dq accumulator here ([rows][H_q][head_dim], rows = b * S_q + i, or the
//     packed row for varlen).
//  2. dkdv_kernel, one block per (key tile of kBlockN keys, kv head, batch). K and V of the tile
//     stay in shared memory, dK and dV in registers. The block walks the group's query heads and,
//     for each, the query tiles of 64 rows that can see some key of the tile (window / causal
//     ranges from AttentionScore; everything else is skipped), Q, dO, lse and D double-buffered
//     by cp.async. Warp w owns 16 keys (key strip w / kSplitD) and kHeadDim / kSplitD columns of
//     dK and dV. It computes Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for its 16 keys x 64 queries: transposed,
//     so that P and dS come out of the mma as C fragments whose rows are the warp's keys, which
//     are exactly the A fragments of dV += Pᵀ dO and dK += dSᵀ Q (c_to_a): P and dS never touch
//     shared memory on the way to dK and dV, and no two warps share an accumulator. Then dSᵀ goes
//     to shared memory (the one exchange), and the 8 warps as 4 (query rows) x 2 (columns) compute
//     dQ_tile = dS K and add it into the fp32 accumulator with vector reductions (red.v2.f32). The
//     epilogue stores dK * scale and dV in the dtype.
//  3. convert: dq = scale * accumulator, in the dtype.
// Deterministic mode (p.deterministic) replaces the atomics: dkdv_kernel skips dQ, and dq_kernel,
// one block per (query tile of 64 rows, query head, batch), walks the key tiles the rows can see
// and recomputes S, dP and dS for them (4 warps of 16 query rows; dS is the A fragment of dQ +=
// dS K from its C fragment), so every dq element is one fixed sequence of adds: the same bits on
// every run. dk and dv are deterministic in both modes (the group's query heads are summed inside
// one block, in order).
//
// Tiles per head dim (bwd_config): 8 warps, 64 query rows per step. dK + dV take 2 * 16 *
// kHeadDim / kSplitD fp32 registers per lane-row, and Sᵀ, dPᵀ another 64: 192 at d = 128, the
// most the 255-register file holds beside the fragments; d = 64 and 96 run the same shape
// (kBlockN = 128: Q and dO, the streamed operands, are reused by 128 keys). d = 256 cannot hold
// 16 x 256 x 2 accumulators per warp, so two warps share each 16-key strip, each owning 128
// columns (kSplitD = 2, kBlockN = 64) and both computing the strip's Sᵀ and dPᵀ (40% more mma,
// the price of keeping P and dS in registers; shared memory holds K, V, Q and dO at 192 KiB).
//
// The score rule: the fast path (no softcap, ALiBi nor explicit mask: kGeneral false) costs an
// FMA and an ex2 per score; range masks (window, causal, the last key tile) are a per-element
// test only in tiles that cross a boundary (decided per tile, uniform across the block). Rows
// without any visible key have lse -inf: it is read as +inf, so P = exp2(s - inf) = 0 and every
// gradient from the row is 0. Query rows past the sequence read as lse -inf and D 0 likewise;
// key rows past it are range-masked. Columns >= head_dim are loaded as zeros and never written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention/attention_params.h"
#include "attention/cuda/flash2.h"
#include "attention/cuda/flash2_common.cuh"
#include "core/workspace.h"
#include "kernels/common.cuh"
#include "kernels/ptx/atomics.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/smem.cuh"

namespace optimized::cuda::flash2 {
namespace bwd {

// ---- config ------------------------------------------------------------------------------------
struct BwdConfig {
  int block_n;     // dkdv_kernel: keys per block (16 per key strip)
  int split_d;     // dkdv_kernel: warps per 16-key strip (each owns head_dim / split_d columns)
  int dq_split_d;  // dq_kernel: warps per 16-row strip (each owns head_dim / dq_split_d columns)
};
// d <= 128: 8 strips of 16 keys, one warp each (192 accumulator registers at d = 128: see the
// header). d = 256: 4 strips, two warps each (the accumulators of a whole strip would need 256).
// The deterministic dq kernel holds 16 x head_dim / dq_split_d fp32 per warp: 64 at d = 128;
// d = 256 splits the columns over two warps for the same reason.
constexpr BwdConfig bwd_config(int head_dim) {
  return head_dim <= 128 ? BwdConfig{128, 1, 1} : BwdConfig{64, 2, 2};
}

constexpr int kBlockM = 64;     // query rows per step (both kernels)
constexpr int kDqBlockN = 64;   // keys per step of dq_kernel
constexpr int kPrepThreads = 256;

template <int kHeadDim>
struct Shape {
  static constexpr BwdConfig kCfg = bwd_config(kHeadDim);
  static constexpr int kD = kHeadDim;
  static constexpr int kCols = smem_cols(kHeadDim);  // stored width (96 -> 128)
  static constexpr int kLoadChunks = kD / 8;
  static constexpr int kKSteps = kD / 16;            // mma k-steps over the head dim

  // dkdv_kernel
  static constexpr int kBlockN = kCfg.block_n;
  static constexpr int kSplitD = kCfg.split_d;
  static constexpr int kStrips = kBlockN / 16;
  static constexpr int kThreads = 32 * kStrips * kSplitD;
  static constexpr int kDW = kD / kSplitD;            // dK / dV columns per warp
  static constexpr int kDWTiles = kDW / 8;
  static constexpr int kDqCols = kD / 2;              // dQ columns per warp (4 x 2 warps)
  static constexpr int kDqTiles = kDqCols / 8;
  using KVTile = SmemTile<kBlockN, kCols>;            // K, V: (keys, d)
  using QTile = SmemTile<kBlockM, kCols>;             // Q, dO: (queries, d)
  using DSTile = SmemTile<kBlockN, kBlockM>;          // dSᵀ: (keys, queries)
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + KVTile::kBytes;
  static constexpr int kOffQ = kOffV + KVTile::kBytes;          // 2 buffers
  static constexpr int kOffDO = kOffQ + 2 * QTile::kBytes;      // 2 buffers
  static constexpr int kOffLse = kOffDO + 2 * QTile::kBytes;    // 2 x kBlockM fp32
  static constexpr int kOffD = kOffLse + 2 * kBlockM * 4;       // 2 x kBlockM fp32
  static constexpr int kOffDS = kOffD + 2 * kBlockM * 4;
  static constexpr int smem_bytes(bool accum_dq) { return kOffDS + (accum_dq ? DSTile::kBytes : 0); }

  // dq_kernel
  static constexpr int kDqSplit = kCfg.dq_split_d;
  static constexpr int kDqThreads = 128 * kDqSplit;   // 4 strips of 16 rows x kDqSplit
  static constexpr int kDqW = kD / kDqSplit;          // dQ columns per warp
  static constexpr int kDqWTiles = kDqW / 8;
  using DqKVTile = SmemTile<kDqBlockN, kCols>;
  static constexpr int kDqOffQ = 0;
  static constexpr int kDqOffDO = kDqOffQ + QTile::kBytes;
  static constexpr int kDqOffK = kDqOffDO + QTile::kBytes;       // 2 buffers
  static constexpr int kDqOffV = kDqOffK + 2 * DqKVTile::kBytes;  // 2 buffers
  static constexpr int kDqSmemBytes = kDqOffV + 2 * DqKVTile::kBytes;

  static_assert(kD % 16 == 0 && kD <= 256, "head dim: a multiple of 16 up to 256");
  static_assert(kThreads == 256, "dQ in dkdv_kernel: 8 warps as 4 (rows) x 2 (columns)");
  static_assert(kDWTiles % 2 == 0 && kDqTiles % 2 == 0 && kDqWTiles % 2 == 0,
                "ldmatrix.x4.trans feeds n-tiles in pairs");
  static_assert(kBlockM == 64 && kDqBlockN == 64, "P / dS as A fragments: 4 k-steps of 16");
  static_assert(smem_bytes(true) <= 227 * 1024 && kDqSmemBytes <= 227 * 1024, "sm_90 shared memory per block");
};

// What the kernels take beside the params: the workspace pieces and where the launch's batch
// starts (grids cover at most 65535 batches per launch).
struct BwdArgs {
  float* dvec = nullptr;    // D: [H_q][rows]
  float* dq_acc = nullptr;  // [rows][H_q][head_dim] fp32; null in deterministic mode
  int64_t rows = 0;         // rows of the [rows] dimension: B * S_q, or total_q (varlen)
  int64_t batch_base = 0;
};

// The workspace of run_backward: carved here (launch) and measured here (backward_workspace_bytes),
// so the two cannot disagree. 256-byte aligned pieces (WorkspaceArena).
inline int64_t query_rows(const AttentionParams& p) { return p.varlen() ? p.total_q : p.batch * p.seqlen_q; }
inline void carve_workspace(WorkspaceArena& arena, const AttentionParams& p, float** dvec, float** dq_acc) {
  const int64_t rows = query_rows(p);
  *dvec = arena.take<float>(rows * p.heads_q);
  *dq_acc = p.deterministic ? nullptr : arena.take<float>(rows * p.heads_q * p.head_dim);
}

// ---- device helpers ----------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// lse * log2(e), with a row that sees no key (lse -inf) read as +inf: exp2(s - inf) = 0.
__device__ __forceinline__ float lse_log2(float lse) { return lse == kNegInf ? INFINITY : lse * kLog2e; }

// Does tile [m0, m0 + rows) x [n0, n0 + cols) (query rows x keys, sequence indices) need the
// per-element range test: some key past the sequence, or some (i, j) outside [key_lo(i), key_hi(i))
// (AttentionScore). The rows past the sequence need none (their P is 0 through lse).
__device__ __forceinline__ bool tile_needs_range_mask(const AttentionScore<float>& sc, int64_t m0, int rows,
                                                      int64_t n0, int cols) {
  if (n0 + cols > sc.len_k) return true;
  if (sc.window_left >= 0 && m0 + rows - 1 + sc.offset - sc.window_left > n0) return true;
  if (sc.window_right >= 0 && m0 + sc.offset + sc.window_right < n0 + cols - 1) return true;
  return false;
}

// The range rule of AttentionScore (key_lo / key_hi) as int32 bounds on the diagonal distance:
// key j is visible to query i iff lo <= j - i <= hi and j < len_k (j >= 0 always holds).
struct RangeBounds {
  int lo, hi, len_k;
  __device__ __forceinline__ explicit RangeBounds(const AttentionScore<float>& sc) {
    constexpr int64_t kBig = int64_t(1) << 31;  // beyond any j - i (lengths < 2^31)
    const int64_t l = sc.window_left < 0 ? -kBig : sc.offset - sc.window_left;
    const int64_t h = sc.window_right < 0 ? kBig : sc.offset + sc.window_right;
    lo = static_cast<int>(l < -kBig ? -kBig : (l > kBig - 1 ? kBig - 1 : l));
    hi = static_cast<int>(h < -kBig ? -kBig : (h > kBig - 1 ? kBig - 1 : h));
    len_k = static_cast<int>(sc.len_k);
  }
  __device__ __forceinline__ bool visible(int i, int j) const {
    const int d = j - i;
    return d >= lo && d <= hi && j < len_k;
  }
};

// One score's P and dS (before the scale, which dK and dQ take at the end). The fast path is
// exp2(dot * scale * log2e - lse * log2e); the general one is AttentionScore::value (scale,
// softcap, ALiBi) plus the explicit mask (ScoreRule::mask_term), written out here to keep the
// softcap's t = tanh(scale * dot / softcap) for the gradient d value / d (scale dot) = 1 - t².
// With kRange, P = 0 outside [key_lo(i), key_hi(i)) (RangeBounds).
template <bool kGeneral, bool kRange>
__device__ __forceinline__ void p_and_ds(const ScoreRule& rule, const RangeBounds& rb, float dot, float dp, float lse2, float dd, int i,
                                         int j, float& p_out, float& ds_out) {
  float pr;
  float grad = 1.0f;
  if constexpr (!kGeneral) {
    pr = exp2_approx(fmaf(dot, rule.scale_log2, -lse2));
  } else {
    const AttentionScore<float>& sc = rule.sc;
    float s = sc.scale * dot;
    if (sc.softcap > 0.0f) {
      const float t = tanhf(s / sc.softcap);
      s = sc.softcap * t;
      grad = AttentionScore<float>::softcap_grad_from_tanh(t);
    }
    if (sc.slope != 0.0f) {
      const int64_t d = int64_t(i) + sc.offset - j;
      s -= sc.slope * static_cast<float>(d < 0 ? -d : d);
    }
    if (rule.mask && i < rule.len_q && j < sc.len_k) s += rule.mask_term(i, j);
    pr = exp2_approx(fmaf(s, kLog2e, -lse2));
  }
  if constexpr (kRange) {
    if (!rb.visible(i, j)) pr = 0.0f;
  }
  p_out = pr;
  ds_out = pr * (dp - dd) * grad;
}

// ---- 1. preprocess: D = rowsum(dO ∘ O), zero the dq accumulator ------------------------------
// Grid (row blocks, H_q, batches); kTPR threads per row, each summing 16-byte chunks.
template <int kHeadDim>
constexpr int threads_per_row() {
  return kHeadDim / 8 <= 8 ? 8 : (kHeadDim / 8 <= 16 ? 16 : 32);
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kPrepThreads) preprocess_kernel(const AttentionParams p, const BwdArgs a) {
  constexpr int kTPR = threads_per_row<kHeadDim>();
  constexpr int kRowsPerBlock = kPrepThreads / kTPR;
  const int64_t b = a.batch_base + blockIdx.z;
  const int h = blockIdx.y;
  const AttentionSeq seq = attention_seq(p, b);
  const int sub = threadIdx.x % kTPR;
  const int64_t i = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kTPR;
  const bool active = i < seq.len_q;
  const int chunks = static_cast<int>(p.head_dim / 8);
  const int64_t row = (p.varlen() ? seq.start_q : b * p.seqlen_q) + i;
  float acc = 0.0f;
  if (active) {
    const T* o = static_cast<const T*>(p.out) + b * p.out_s.batch + (seq.start_q + i) * p.out_s.row + h * p.out_s.head;
    const T* d = static_cast<const T*>(p.dout) + b * p.dout_s.batch + (seq.start_q + i) * p.dout_s.row +
                 h * p.dout_s.head;
    float* zero = a.dq_acc ? a.dq_acc + (row * p.heads_q + h) * p.head_dim : nullptr;
    for (int c = sub; c < chunks; c += kTPR) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c * 8);
      const uint4 dv = *reinterpret_cast<const uint4*>(d + c * 8);
      const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w};
      const uint32_t dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 of = unpack2<T>(ow[e]);
        const float2 df = unpack2<T>(dw[e]);
        acc = fmaf(of.x, df.x, acc);
        acc = fmaf(of.y, df.y, acc);
      }
      if (zero) {
        reinterpret_cast<float4*>(zero + c * 8)[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        reinterpret_cast<float4*>(zero + c * 8)[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
#pragma unroll
  for (int off = kTPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (active && sub == 0) a.dvec[h * a.rows + row] = acc;
}

// ---- 3. convert: dq = scale * accumulator ------------------------------------------------------
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kPrepThreads) convert_dq_kernel(const AttentionParams p, const BwdArgs a) {
  constexpr int kTPR = threads_per_row<kHeadDim>();
  constexpr int kRowsPerBlock = kPrepThreads / kTPR;
  const int64_t b = a.batch_base + blockIdx.z;
  const int h = blockIdx.y;
  const AttentionSeq seq = attention_seq(p, b);
  const int64_t i = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kTPR;
  if (i >= seq.len_q) return;
  const int chunks = static_cast<int>(p.head_dim / 8);
  const int64_t row = (p.varlen() ? seq.start_q : b * p.seqlen_q) + i;
  const float* src = a.dq_acc + (row * p.heads_q + h) * p.head_dim;
  T* dst = static_cast<T*>(p.dq) + b * p.dq_s.batch + (seq.start_q + i) * p.dq_s.row + h * p.dq_s.head;
  const float scale = static_cast<float>(p.scale);
  for (int c = threadIdx.x % kTPR; c < chunks; c += kTPR) {
    const float4 x = reinterpret_cast<const float4*>(src + c * 8)[0];
    const float4 y = reinterpret_cast<const float4*>(src + c * 8)[1];
    uint4 out;
    out.x = pack2<T>(scale * x.x, scale * x.y);
    out.y = pack2<T>(scale * x.z, scale * x.w);
    out.z = pack2<T>(scale * y.x, scale * y.y);
    out.w = pack2<T>(scale * y.z, scale * y.w);
    *reinterpret_cast<uint4*>(dst + c * 8) = out;
  }
}

// ---- 2. dK, dV (and dQ by atomics) per key tile ---------------------------------------------------
template <typename T, int kHeadDim, bool kGeneral, bool kAccumDq>
__global__ void __launch_bounds__(Shape<kHeadDim>::kThreads, 1)
    dkdv_kernel(const AttentionParams p, const BwdArgs a) {
  using S = Shape<kHeadDim>;
  using KVTile = typename S::KVTile;
  using QTile = typename S::QTile;
  using DSTile = typename S::DSTile;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = ptx::smem_u32(smem);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;

  const int b = static_cast<int>(a.batch_base + blockIdx.z);  // batches < 2^31 (int: one register)
  const int hk = blockIdx.y;
  const AttentionSeq seq = attention_seq(p, b);
  const int len_q = static_cast<int>(seq.len_q);
  const int len_k = static_cast<int>(seq.len_k);
  const int n0 = blockIdx.x * S::kBlockN;
  if (n0 >= len_k) return;  // the whole block: no key of this tile exists
  const int group = static_cast<int>(p.group());
  const int valid_chunks = static_cast<int>(p.head_dim / 8);

  // The query rows that see some key of [n0, n1) (window / causal; the same for every head):
  // i + offset + wr >= n0 and i + offset - wl <= n1 - 1.
  int m_first = 0, m_tiles = 0;
  {
    const AttentionScore<float> sc(p, seq, b, int64_t(hk) * group);
    const int64_t n1 = n0 + S::kBlockN < len_k ? n0 + S::kBlockN : len_k;
    int64_t i_min = sc.window_right < 0 ? 0 : n0 - sc.offset - sc.window_right;
    int64_t i_max = sc.window_left < 0 ? len_q : n1 - sc.offset + sc.window_left;
    if (i_min < 0) i_min = 0;
    if (i_max > len_q) i_max = len_q;
    if (i_min < i_max) {
      m_first = static_cast<int>(i_min / kBlockM);
      m_tiles = static_cast<int>((i_max + kBlockM - 1) / kBlockM) - m_first;
    }
  }
  const int n_iters = group * m_tiles;

  const uint32_t sK = base + S::kOffK;
  const uint32_t sV = base + S::kOffV;
  auto sQ = [&](int buf) { return base + S::kOffQ + buf * QTile::kBytes; };
  auto sDO = [&](int buf) { return base + S::kOffDO + buf * QTile::kBytes; };
  auto sLse = [&](int buf) { return base + S::kOffLse + buf * kBlockM * 4; };
  auto sD = [&](int buf) { return base + S::kOffD + buf * kBlockM * 4; };
  const uint32_t sDS = base + S::kOffDS;

  // Q, dO, lse and D of step `it` (head hk * group + it / m_tiles, query tile m_first + it % m_tiles)
  // into buffer `buf`; the caller commits.
  // (The sequence's offsets are re-read here and in the epilogue rather than kept live across the
  // loop: registers are the scarce resource; the re-read is free for fixed length, L1 for varlen.)
  auto issue = [&](int it, int buf) {
    const AttentionSeq seq = attention_seq(p, b);
    const int64_t q_row0 = p.varlen() ? seq.start_q : b * p.seqlen_q;
    const int h = hk * group + it / m_tiles;
    const int m0 = (m_first + it % m_tiles) * kBlockM;
    const int rows = len_q - m0;
    const T* q = static_cast<const T*>(p.q) + b * p.q_s.batch + (seq.start_q + m0) * p.q_s.row + int64_t(h) * p.q_s.head;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_s.batch + (seq.start_q + m0) * p.dout_s.row +
                    int64_t(h) * p.dout_s.head;
    load_tile<QTile, S::kThreads, S::kLoadChunks>(sQ(buf), q, p.q_s.row, rows, valid_chunks, tid);
    load_tile<QTile, S::kThreads, S::kLoadChunks>(sDO(buf), dout, p.dout_s.row, rows, valid_chunks, tid);
    if (tid < 2 * kBlockM) {
      const int r = tid & (kBlockM - 1);
      if (tid < kBlockM) {
        const uint32_t dst = sLse(buf) + r * 4;
        if (r < rows)
          ptx::cp_async_4(dst, static_cast<const float*>(p.lse) + b * p.lse_batch + int64_t(h) * p.lse_head +
                                   seq.start_q + m0 + r);
        else
          st_shared_f32(dst, kNegInf);
      } else {
        const uint32_t dst = sD(buf) + r * 4;
        if (r < rows) ptx::cp_async_4(dst, a.dvec + int64_t(h) * a.rows + q_row0 + m0 + r);
        else st_shared_f32(dst, 0.0f);
      }
    }
  };

  if (n_iters > 0) {
    const T* k = static_cast<const T*>(p.k) + b * p.k_s.batch + (seq.start_k + n0) * p.k_s.row + int64_t(hk) * p.k_s.head;
    const T* v = static_cast<const T*>(p.v) + b * p.v_s.batch + (seq.start_k + n0) * p.v_s.row + int64_t(hk) * p.v_s.head;
    load_tile<KVTile, S::kThreads, S::kLoadChunks>(sK, k, p.k_s.row, len_k - n0, valid_chunks, tid);
    load_tile<KVTile, S::kThreads, S::kLoadChunks>(sV, v, p.v_s.row, len_k - n0, valid_chunks, tid);
    issue(0, 0);
  }
  ptx::cp_async_commit();

  // Warp roles. dK / dV: key strip kw (keys kr0 .. kr0 + 15 of the tile), columns [dh * kDW, +kDW).
  // dQ: rows 16 * qm .. + 15 of the query tile, columns [qd * kDqCols, +kDqCols).
  const int kw = warp / S::kSplitD;
  const int dh = warp % S::kSplitD;
  const int kr0 = 16 * kw;
  const int qm = warp >> 1;
  const int qd = warp & 1;

  float dk[S::kDWTiles][4];
  float dv[S::kDWTiles][4];
#pragma unroll
  for (int j = 0; j < S::kDWTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.0f;

  for (int it = 0; it < n_iters; ++it) {
    const int buf = it & 1;
    // Step it's tiles have landed (this thread's copies, then everyone's), and every warp is done
    // with step it - 1, whose buffer the prefetch below refills.
    ptx::cp_async_wait<0>();
    __syncthreads();
    if (it + 1 < n_iters) issue(it + 1, buf ^ 1);
    ptx::cp_async_commit();

    const int h = hk * group + it / m_tiles;
    const int m0 = (m_first + it % m_tiles) * kBlockM;
    AttentionSeq lens;  // the score rule reads only the lengths
    lens.len_q = len_q;
    lens.len_k = len_k;
    const ScoreRule rule(p, lens, b, h);
    const RangeBounds rb(rule.sc);
    const bool range = tile_needs_range_mask(rule.sc, m0, kBlockM, n0, S::kBlockN);

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for the strip: 16 keys x 64 queries each (8 n-tiles of queries).
    float st[8][4];
    float dpt[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < S::kKSteps; ++ks) {
      uint32_t ak[4], av[4];
      ldsm_a<KVTile>(ak, sK, kr0, 2 * ks, lane);
      ldsm_a<KVTile>(av, sV, kr0, 2 * ks, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bq[2][2], bo[2][2];
        ldsm_b_nk<QTile>(bq, sQ(buf), 16 * np, 2 * ks, lane);
        ldsm_b_nk<QTile>(bo, sDO(buf), 16 * np, 2 * ks, lane);
        mma<T>(st[2 * np], ak, bq[0]);
        mma<T>(st[2 * np + 1], ak, bq[1]);
        mma<T>(dpt[2 * np], av, bo[0]);
        mma<T>(dpt[2 * np + 1], av, bo[1]);
      }
    }

    // P and dS in place: element (key kr0 + g + 8 (e / 2), query 8 j + 2 t + e % 2).
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int qc = 8 * j + 2 * t;
      const float2 lse = ptx::ld_shared_f2(sLse(buf) + qc * 4);
      const float2 dd = ptx::ld_shared_f2(sD(buf) + qc * 4);
      const float lse2[2] = {lse_log2(lse.x), lse_log2(lse.y)};
      const float ddv[2] = {dd.x, dd.y};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = m0 + qc + (e & 1);
        const int jk = n0 + kr0 + g + 8 * (e >> 1);
        if (range)
          p_and_ds<kGeneral, true>(rule, rb, st[j][e], dpt[j][e], lse2[e & 1], ddv[e & 1], i, jk, st[j][e], dpt[j][e]);
        else
          p_and_ds<kGeneral, false>(rule, rb, st[j][e], dpt[j][e], lse2[e & 1], ddv[e & 1], i, jk, st[j][e], dpt[j][e]);
      }
    }

    // Pᵀ and dSᵀ as A fragments (m = the strip's keys, k = queries): 4 k-steps of 16 queries.
    uint32_t pa[4][4], dsa[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      c_to_a<T>(pa[kk], st[2 * kk], st[2 * kk + 1]);
      c_to_a<T>(dsa[kk], dpt[2 * kk], dpt[2 * kk + 1]);
    }

    // dSᵀ to shared memory for dQ (one writer per strip): row kr0 + g (+ 8), query chunk j, word t.
    if constexpr (kAccumDq) {
      if (dh == 0) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          st_shared_b32(sDS + DSTile::offset(kr0 + g, j) + 4 * t, dsa[j >> 1][(j & 1) * 2]);
          st_shared_b32(sDS + DSTile::offset(kr0 + g + 8, j) + 4 * t, dsa[j >> 1][(j & 1) * 2 + 1]);
        }
      }
    }

    // dV += Pᵀ dO and dK += dSᵀ Q over the warp's columns (B: dO, Q stored [query = k][d = n]).
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int np = 0; np < S::kDWTiles / 2; ++np) {
        uint32_t bo[2][2], bq[2][2];
        const int chunk = dh * (S::kDW / 8) + 2 * np;
        ldsm_b_kn<QTile>(bo, sDO(buf), 16 * kk, chunk, lane);
        ldsm_b_kn<QTile>(bq, sQ(buf), 16 * kk, chunk, lane);
        mma<T>(dv[2 * np], pa[kk], bo[0]);
        mma<T>(dv[2 * np + 1], pa[kk], bo[1]);
        mma<T>(dk[2 * np], dsa[kk], bq[0]);
        mma<T>(dk[2 * np + 1], dsa[kk], bq[1]);
      }
    }

    if constexpr (kAccumDq) {
      __syncthreads();  // dSᵀ of every strip is in shared memory
      // dQ (64 x kHeadDim) = dS (A from dSᵀ stored [key = k][query = m]) K (B stored [key = k][d = n]).
      float dq[S::kDqTiles][4];
#pragma unroll
      for (int j = 0; j < S::kDqTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[j][e] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < S::kBlockN / 16; ++kk) {
        uint32_t af[4];
        ldsm_a_t<DSTile>(af, sDS, 16 * kk, 2 * qm, lane);
#pragma unroll
        for (int np = 0; np < S::kDqTiles / 2; ++np) {
          uint32_t bk[2][2];
          ldsm_b_kn<KVTile>(bk, sK, 16 * kk, qd * (S::kDqCols / 8) + 2 * np, lane);
          mma<T>(dq[2 * np], af, bk[0]);
          mma<T>(dq[2 * np + 1], af, bk[1]);
        }
      }
      // Rows m0 + 16 qm + g (+ 8), columns qd * kDqCols + 8 j + 2 t (+ 1): vector reductions.
      const int r0 = m0 + 16 * qm + g;
      const int64_t q_row0 = p.varlen() ? int64_t(p.cu_seqlens_q[b]) : b * p.seqlen_q;
      float* acc0 = a.dq_acc + ((q_row0 + r0) * p.heads_q + h) * p.head_dim;
      const int64_t row8 = int64_t(8) * p.heads_q * p.head_dim;
#pragma unroll
      for (int j = 0; j < S::kDqTiles; ++j) {
        const int col = qd * S::kDqCols + 8 * j + 2 * t;
        if (col < p.head_dim) {
          if (r0 < len_q) ptx::red_add_v2_f32(acc0 + col, dq[j][0], dq[j][1]);
          if (r0 + 8 < len_q) ptx::red_add_v2_f32(acc0 + row8 + col, dq[j][2], dq[j][3]);
        }
      }
    }
  }
  ptx::cp_async_wait<0>();

  // Epilogue: dK * scale and dV, rows n0 + kr0 + g (+ 8) < len_k, columns < head_dim.
  const float scale = static_cast<float>(p.scale);
  const int64_t start_k = attention_seq(p, b).start_k;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = n0 + kr0 + g + 8 * half;
    if (row >= len_k) continue;
    T* dkr = static_cast<T*>(p.dk) + b * p.dk_s.batch + (start_k + row) * p.dk_s.row + int64_t(hk) * p.dk_s.head;
    T* dvr = static_cast<T*>(p.dv) + b * p.dv_s.batch + (start_k + row) * p.dv_s.row + int64_t(hk) * p.dv_s.head;
#pragma unroll
    for (int j = 0; j < S::kDWTiles; ++j) {
      const int col = dh * S::kDW + 8 * j + 2 * t;
      if (col < p.head_dim) {
        *reinterpret_cast<uint32_t*>(dkr + col) = pack2<T>(scale * dk[j][2 * half], scale * dk[j][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(dvr + col) = pack2<T>(dv[j][2 * half], dv[j][2 * half + 1]);
      }
    }
  }
}

// ---- 4. deterministic dQ per query tile ----------------------------------------------------------
template <typename T, int kHeadDim, bool kGeneral>
__global__ void __launch_bounds__(Shape<kHeadDim>::kDqThreads) dq_kernel(const AttentionParams p, const BwdArgs a) {
  using S = Shape<kHeadDim>;
  using QTile = typename S::QTile;
  using KVTile = typename S::DqKVTile;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = ptx::smem_u32(smem);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;

  const int64_t b = a.batch_base + blockIdx.z;
  const int h = blockIdx.y;
  const int hk = h / static_cast<int>(p.group());
  const AttentionSeq seq = attention_seq(p, b);
  const int len_q = static_cast<int>(seq.len_q);
  const int len_k = static_cast<int>(seq.len_k);
  const int m0 = blockIdx.x * kBlockM;
  if (m0 >= len_q) return;
  const int valid_chunks = static_cast<int>(p.head_dim / 8);
  const int64_t q_row0 = p.varlen() ? seq.start_q : b * p.seqlen_q;
  const ScoreRule rule(p, seq, b, h);
  const RangeBounds rb(rule.sc);

  // The keys some row of the tile sees: [key_lo(m0), key_hi(last row)) (both non-decreasing in i).
  const int i_last = m0 + kBlockM - 1 < len_q - 1 ? m0 + kBlockM - 1 : len_q - 1;
  const int j_lo = rule.key_lo(m0);
  const int j_hi = rule.key_hi(i_last);
  const int n_first = j_lo / kDqBlockN;
  const int n_tiles = j_lo < j_hi ? (j_hi + kDqBlockN - 1) / kDqBlockN - n_first : 0;

  const uint32_t sQ = base + S::kDqOffQ;
  const uint32_t sDO = base + S::kDqOffDO;
  auto sK = [&](int buf) { return base + S::kDqOffK + buf * KVTile::kBytes; };
  auto sV = [&](int buf) { return base + S::kDqOffV + buf * KVTile::kBytes; };
  auto issue = [&](int it, int buf) {
    const int n0 = (n_first + it) * kDqBlockN;
    const T* k = static_cast<const T*>(p.k) + b * p.k_s.batch + (seq.start_k + n0) * p.k_s.row + int64_t(hk) * p.k_s.head;
    const T* v = static_cast<const T*>(p.v) + b * p.v_s.batch + (seq.start_k + n0) * p.v_s.row + int64_t(hk) * p.v_s.head;
    load_tile<KVTile, S::kDqThreads, S::kLoadChunks>(sK(buf), k, p.k_s.row, len_k - n0, valid_chunks, tid);
    load_tile<KVTile, S::kDqThreads, S::kLoadChunks>(sV(buf), v, p.v_s.row, len_k - n0, valid_chunks, tid);
  };

  const int qm = warp % 4;  // rows 16 qm .. + 15 of the tile
  const int qd = warp / 4;  // columns [qd * kDqW, + kDqW)
  if (n_tiles > 0) {
    const T* q = static_cast<const T*>(p.q) + b * p.q_s.batch + (seq.start_q + m0) * p.q_s.row + int64_t(h) * p.q_s.head;
    const T* dout = static_cast<const T*>(p.dout) + b * p.dout_s.batch + (seq.start_q + m0) * p.dout_s.row +
                    int64_t(h) * p.dout_s.head;
    load_tile<QTile, S::kDqThreads, S::kLoadChunks>(sQ, q, p.q_s.row, len_q - m0, valid_chunks, tid);
    load_tile<QTile, S::kDqThreads, S::kLoadChunks>(sDO, dout, p.dout_s.row, len_q - m0, valid_chunks, tid);
    issue(0, 0);
  }
  ptx::cp_async_commit();

  // lse (log2 domain) and D of the lane's rows i0 = m0 + 16 qm + g and i0 + 8.
  const int i0 = m0 + 16 * qm + g;
  float lse2[2], ddv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + 8 * r;
    const bool ok = i < len_q;
    lse2[r] = lse_log2(ok ? static_cast<const float*>(p.lse)[b * p.lse_batch + int64_t(h) * p.lse_head + seq.start_q + i]
                          : kNegInf);
    ddv[r] = ok ? a.dvec[int64_t(h) * a.rows + q_row0 + i] : 0.0f;
  }

  float dq[S::kDqWTiles][4];
#pragma unroll
  for (int j = 0; j < S::kDqWTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[j][e] = 0.0f;

  for (int it = 0; it < n_tiles; ++it) {
    const int buf = it & 1;
    ptx::cp_async_wait<0>();
    __syncthreads();
    if (it + 1 < n_tiles) issue(it + 1, buf ^ 1);
    ptx::cp_async_commit();
    const int n0 = (n_first + it) * kDqBlockN;
    const bool range = tile_needs_range_mask(rule.sc, m0, kBlockM, n0, kDqBlockN);

    // S = Q Kᵀ and dP = dO Vᵀ: the warp's 16 rows x 64 keys (8 n-tiles of keys).
    float s[8][4];
    float dp[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < S::kKSteps; ++ks) {
      uint32_t aq[4], ao[4];
      ldsm_a<QTile>(aq, sQ, 16 * qm, 2 * ks, lane);
      ldsm_a<QTile>(ao, sDO, 16 * qm, 2 * ks, lane);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bk[2][2], bv[2][2];
        ldsm_b_nk<KVTile>(bk, sK(buf), 16 * np, 2 * ks, lane);
        ldsm_b_nk<KVTile>(bv, sV(buf), 16 * np, 2 * ks, lane);
        mma<T>(s[2 * np], aq, bk[0]);
        mma<T>(s[2 * np + 1], aq, bk[1]);
        mma<T>(dp[2 * np], ao, bv[0]);
        mma<T>(dp[2 * np + 1], ao, bv[1]);
      }
    }

    // dS in place of dP: element (row i0 + 8 (e / 2), key n0 + 8 j + 2 t + e % 2).
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + 8 * (e >> 1);
        const int jk = n0 + 8 * j + 2 * t + (e & 1);
        float pr;
        if (range) p_and_ds<kGeneral, true>(rule, rb, s[j][e], dp[j][e], lse2[e >> 1], ddv[e >> 1], i, jk, pr, dp[j][e]);
        else p_and_ds<kGeneral, false>(rule, rb, s[j][e], dp[j][e], lse2[e >> 1], ddv[e >> 1], i, jk, pr, dp[j][e]);
      }

    // dQ += dS K: dS's C fragments are the A fragments (m = rows, k = keys); B = K stored [key][d].
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t af[4];
      c_to_a<T>(af, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int np = 0; np < S::kDqWTiles / 2; ++np) {
        uint32_t bk[2][2];
        ldsm_b_kn<KVTile>(bk, sK(buf), 16 * kk, qd * (S::kDqW / 8) + 2 * np, lane);
        mma<T>(dq[2 * np], af, bk[0]);
        mma<T>(dq[2 * np + 1], af, bk[1]);
      }
    }
  }
  ptx::cp_async_wait<0>();

  // dq = scale * acc: rows i0 (+ 8) < len_q, columns qd * kDqW + 8 j + 2 t < head_dim.
  const float scale = static_cast<float>(p.scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + 8 * r;
    if (i >= len_q) continue;
    T* dst = static_cast<T*>(p.dq) + b * p.dq_s.batch + (seq.start_q + i) * p.dq_s.row + int64_t(h) * p.dq_s.head;
#pragma unroll
    for (int j = 0; j < S::kDqWTiles; ++j) {
      const int col = qd * S::kDqW + 8 * j + 2 * t;
      if (col < p.head_dim)
        *reinterpret_cast<uint32_t*>(dst + col) = pack2<T>(scale * dq[j][2 * r], scale * dq[j][2 * r + 1]);
    }
  }
}

// ---- launch --------------------------------------------------------------------------------------
// Launches `kernel` over (x_blocks, y_blocks, batches) in slices of at most 65535 batches (grid z),
// opting in to `smem` bytes of dynamic shared memory first. Returns the first error.
template <class Kernel>
cudaError_t launch_batched(Kernel kernel, int64_t x_blocks, int64_t y_blocks, int threads, int smem,
                           const AttentionParams& p, BwdArgs args, cudaStream_t stream) {
  if (x_blocks <= 0 || y_blocks <= 0 || p.batch <= 0) return cudaSuccess;
  if (x_blocks > 0x7fffffff || y_blocks > kernels::kMaxGridY) return cudaErrorInvalidValue;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  for (int64_t b0 = 0; b0 < p.batch; b0 += kernels::kMaxGridZ) {
    const int64_t nb = p.batch - b0 < kernels::kMaxGridZ ? p.batch - b0 : kernels::kMaxGridZ;
    args.batch_base = b0;
    kernel<<<dim3(static_cast<unsigned>(x_blocks), static_cast<unsigned>(y_blocks), static_cast<unsigned>(nb)),
             threads, smem, stream>>>(p, args);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Whether the scores take the general path (soft-cap, ALiBi or a mask) of the kGeneral kernels.
inline bool general_scores(const AttentionParams& p) {
  return p.softcap > 0.0 || p.alibi != nullptr || p.mask != nullptr;
}

// The workspace's D and dq accumulator and the rows they hold, into args; false when the workspace is
// too small.
inline bool workspace_args(const AttentionParams& p, const Workspace& workspace, BwdArgs* args) {
  WorkspaceArena arena(workspace);
  carve_workspace(arena, p, &args->dvec, &args->dq_acc);
  args->rows = query_rows(p);
  return arena.ok();
}

// The first step of every backward: D = rowsum(dout * out) into the workspace, the dq accumulator zeroed.
template <typename T, int kHeadDim>
cudaError_t launch_preprocess(const AttentionParams& p, const BwdArgs& args, cudaStream_t stream) {
  constexpr int kRowsPerPrep = kPrepThreads / threads_per_row<kHeadDim>();
  return launch_batched(preprocess_kernel<T, kHeadDim>, kernels::ceil_div(p.seqlen_q, kRowsPerPrep), p.heads_q,
                        kPrepThreads, 0, p, args, stream);
}

// The last step: dq from the accumulator (dq = scale * acc), or, deterministic, the dq kernel.
template <typename T, int kHeadDim, bool kGeneral>
cudaError_t launch_dq_step(const AttentionParams& p, const BwdArgs& args, cudaStream_t stream) {
  using S = Shape<kHeadDim>;
  if (p.deterministic)
    return launch_batched(dq_kernel<T, kHeadDim, kGeneral>, kernels::ceil_div(p.seqlen_q, kBlockM), p.heads_q,
                          S::kDqThreads, S::kDqSmemBytes, p, args, stream);
  constexpr int kRowsPerPrep = kPrepThreads / threads_per_row<kHeadDim>();
  return launch_batched(convert_dq_kernel<T, kHeadDim>, kernels::ceil_div(p.seqlen_q, kRowsPerPrep), p.heads_q,
                        kPrepThreads, 0, p, args, stream);
}

template <typename T, int kHeadDim, bool kGeneral>
cudaError_t run_backward_impl(const AttentionParams& p, const BwdArgs& args, cudaStream_t stream) {
  using S = Shape<kHeadDim>;
  cudaError_t err = launch_preprocess<T, kHeadDim>(p, args, stream);
  if (err != cudaSuccess) return err;
  // dK, dV (and, in the fast mode, dq into the accumulator by atomics), then the dq step.
  const bool accum = !p.deterministic;
  err = accum ? launch_batched(dkdv_kernel<T, kHeadDim, kGeneral, true>, kernels::ceil_div(p.seqlen_k, S::kBlockN),
                               p.heads_kv, S::kThreads, S::smem_bytes(true), p, args, stream)
              : launch_batched(dkdv_kernel<T, kHeadDim, kGeneral, false>, kernels::ceil_div(p.seqlen_k, S::kBlockN),
                               p.heads_kv, S::kThreads, S::smem_bytes(false), p, args, stream);
  if (err != cudaSuccess) return err;
  return launch_dq_step<T, kHeadDim, kGeneral>(p, args, stream);
}

}  // namespace bwd

template <typename T, int kHeadDim>
cudaError_t run_backward(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream) {
  bwd::BwdArgs args;
  if (!bwd::workspace_args(p, workspace, &args)) return cudaErrorInvalidValue;
  return bwd::general_scores(p) ? bwd::run_backward_impl<T, kHeadDim, true>(p, args, stream)
                                : bwd::run_backward_impl<T, kHeadDim, false>(p, args, stream);
}

template <typename T, int kHeadDim>
cudaError_t backward_prologue(const AttentionParams& p, const Workspace& workspace, float** dvec, float** dq_acc,
                              int64_t* rows, cudaStream_t stream) {
  bwd::BwdArgs args;
  if (!bwd::workspace_args(p, workspace, &args)) return cudaErrorInvalidValue;
  *dvec = args.dvec, *dq_acc = args.dq_acc, *rows = args.rows;
  return bwd::launch_preprocess<T, kHeadDim>(p, args, stream);
}

template <typename T, int kHeadDim>
cudaError_t backward_dq(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream) {
  bwd::BwdArgs args;
  if (!bwd::workspace_args(p, workspace, &args)) return cudaErrorInvalidValue;
  return bwd::general_scores(p) ? bwd::launch_dq_step<T, kHeadDim, true>(p, args, stream)
                                : bwd::launch_dq_step<T, kHeadDim, false>(p, args, stream);
}

}  // namespace optimized::cuda::flash2
