// The hopper rung's backward (sm_90a): dK and dV per key tile on wgmma and TMA, warp-specialized;
// dQ by fp32 vector reductions into flash2's accumulator (fast mode) or by flash2's per-query-tile
// kernel (deterministic mode). v1: correct on the H100, and slower than flash2's backward (d128
// N = 16k: the backward alone ~180 TFLOP/s; each thread's lse / D loads sit on the critical path,
// docs/perf-notes/attention.md); `auto` keeps flash2's backward.
//
// The algebra (flash2_bwd.cuh, FlashAttention-2 Algorithm 2): with the forward's lse,
//   P = exp(s - lse)   dV = Pᵀ dO   dP = dO Vᵀ   dS = P ∘ (dP - D), D_i = rowsum(dO_i ∘ O_i)
//   dK = scale Σ dSᵀ Q   dQ = scale Σ dS K
// Kernels, in stream order: flash2's preprocess (D into the workspace, the dq accumulator zeroed),
// this file's dkdv_kernel, then flash2's convert (dq = scale * accumulator) -- or, deterministic,
// dkdv_kernel without dQ and flash2's dq_kernel. The workspace is flash2's (the same layout).
//
// dkdv_kernel: one block per (key tile of 128 keys, kv head, batch); 3 warpgroups:
//   warpgroup 0, the producer (setmaxnreg 24): one thread loads the block's K and V tiles once
//     (TMA boxes of 64 columns x 128 rows), then, for each query head of the group and each
//     64-row query tile that sees a key of the tile, Q and dO into a 2-stage ring (boxes of 64 x 64).
//   warpgroups 1 and 2, the consumers (setmaxnreg 240): warpgroup c owns keys [64c, 64c + 64) of
//     the tile and their dK, dV accumulators (64 x D each, in registers). Per query tile:
//       Sᵀ = K_c Qᵀ and dPᵀ = V_c dOᵀ   (wgmma m64n64, both operands K-major from shared memory:
//                                        transposed, so that Pᵀ and dSᵀ come out in the layout of
//                                        a register A operand with the warpgroup's keys as rows)
//       Pᵀ = exp2(Sᵀ scale log2e - lse log2e), dSᵀ = Pᵀ ∘ (dPᵀ - D)    (masks only on edge tiles)
//       dV_c += Pᵀ dO,  dK_c += dSᵀ Q    (wgmma with A from registers, B = dO / Q MN-major)
//       dQ (fast mode): dSᵀ_c to shared memory (64 keys x 64 queries, 128-byte swizzle), then
//       dQ_c = dS_c K_c (A = dS MN-major from that tile, B = K_c MN-major) in 64-column chunks,
//       each added into the fp32 accumulator by red.global.add.v2.f32: each warpgroup adds the
//       contribution of its own 64 keys (no exchange between the warpgroups).
//   The epilogue stores dK * scale and dV (keys < S_k) from registers.
// GQA: the block walks every query head of its kv head's group, so dK and dV are the group's sums
// in registers (deterministic in both modes, as flash2's).
//
// Shared memory (1024-byte aligned, 128-byte swizzle): K (128 x D) | V (128 x D) | Q ring 2 x
// (64 x D) | dO ring 2 x (64 x D) | dSᵀ 2 x (64 x 64) | barriers. D = 128: 32 + 32 + 32 + 32 + 16 =
// 144 KiB; D = 64: 80 KiB.
//
// Fixed length or varlen (packed maps, the sequence found from cu_seqlens on the device; the rows TMA
// loads from the next sequence are zeroed in shared memory), no softcap / ALiBi / mask; causal, sliding
// windows (either alignment) or unmasked; head dims 64 and 128; fp16 / bf16.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_params.h"
#include "attention/cuda/flash2.h"
#include "core/tensor_map.h"
#include "kernels/gemm/wgmma_mainloop.cuh"
#include "kernels/ptx/atomics.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/smem.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "kernels/tile/mma_frag.cuh"

namespace optimized::cuda::hopper {

template <int kHeadDim_>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = 128;  // keys per block: kConsumers x 64
  static constexpr int kBlockM = 64;   // query rows per step
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = 2;
  static constexpr int kBoxCols = 64;                   // 16-bit elements per 128-byte swizzle row
  static constexpr int kBoxes = kHeadDim / kBoxCols;    // boxes per tile (along D)
  static constexpr int kKvBoxBytes = kBlockN * 128;     // 128 rows x 128 bytes
  static constexpr int kKvTileBytes = kBoxes * kKvBoxBytes;
  static constexpr int kQBoxBytes = kBlockM * 128;      // 64 rows x 128 bytes
  static constexpr int kQTileBytes = kBoxes * kQBoxBytes;
  static constexpr int kDsBytes = 64 * 128;             // one warpgroup's dSᵀ: 64 keys x 64 queries
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKvTileBytes;
  static constexpr int kQOffset = 2 * kKvTileBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kQTileBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kQTileBytes;
  static constexpr int kBarOffset = kDsOffset + kConsumers * kDsBytes;
  static constexpr int kBarriers = 1 + 2 * kStages;     // kv_full, qdo_full[s], qdo_empty[s]
  static constexpr int kSmemBytes = kBarOffset + kBarriers * 8 + 1024;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kReleases = kConsumers * 4;      // lane 0 of every consumer warp
  static constexpr int kDsBarrier = 1;                  // ids 1, 2: each consumer warpgroup's own
  static constexpr int kZeroBarrier = 3;                // the consumers, after zeroing varlen tail rows

  static_assert(kHeadDim == 64 || kHeadDim == 128, "hopper backward: head dims 64 and 128");
  static_assert(kBlockN == 64 * kConsumers, "one m64 wgmma row block of keys per consumer warpgroup");
  static_assert(kSmemBytes <= 227 * 1024, "over the 227 KiB of shared memory a block may have");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "register file");
};

// What dkdv_kernel reads besides the four tensor maps.
struct BwdKernelArgs {
  void* dk;
  void* dv;
  int64_t dk_batch, dk_row, dk_head, dv_batch, dv_row, dv_head;  // elements
  const float* lse;                                               // natural log; -inf: no visible key
  int64_t lse_batch, lse_head;
  const float* dvec;   // D: [H_q][rows], rows = b * S_q + i
  float* dq_acc;       // [rows][H_q][head_dim] fp32; null: deterministic mode (no dQ here)
  int64_t rows;
  int len_q, len_k, heads_q, group;  // fixed length: S_q, S_k; varlen: the longest (the grid's)
  int top_left;                    // query i's diagonal key: i + offset, offset 0 (top-left) or S_k - S_q
  int window_left, window_right;   // i sees keys [i + offset - left, i + offset + right]; an unbounded
                                   // edge is S_q + S_k (past every key: no test, and no int overflow
                                   // since S_q + 2 S_k < 2^31)
  float scale_log2;    // scale * log2(e)
  float scale;
  const int32_t* cu_seqlens_q;  // varlen (B + 1 device ints); null: fixed length
  const int32_t* cu_seqlens_k;
};

// One sequence of the call (as the forward's FwdSeq): where its rows start in the packed tensors
// (varlen; 0 for fixed length, whose sequences are the maps' batch coordinate), its lengths, its
// diagonal, and where its rows start in the [rows] dimension of flash2's D and dq accumulator.
struct BwdSeq {
  int start_q, start_k, len_q, len_k, offset, batch_coord;
  int64_t row0;
};
__device__ __forceinline__ BwdSeq bwd_sequence(const BwdKernelArgs& a, int b) {
  BwdSeq q{0, 0, a.len_q, a.len_k, 0, b, static_cast<int64_t>(b) * a.len_q};
  if (a.cu_seqlens_q) {
    q.start_q = a.cu_seqlens_q[b], q.len_q = a.cu_seqlens_q[b + 1] - q.start_q;
    q.start_k = a.cu_seqlens_k[b], q.len_k = a.cu_seqlens_k[b + 1] - q.start_k;
    q.batch_coord = 0;
    q.row0 = q.start_q;
  }
  q.offset = a.top_left ? 0 : q.len_k - q.len_q;
  return q;
}

// Zeroes rows [from, rows) of a tile of kBoxes boxes of `box_bytes` (128-byte rows: the swizzle
// permutes 16-byte chunks within a row) by the 256 consumer threads, then orders the writes before the
// tensor cores' reads and waits for both consumer warpgroups (varlen: rows TMA loaded from the next
// sequence, whose values must not reach this one's sums through a 0 x Inf).
template <int kBoxes>
__device__ __forceinline__ void zero_tail_rows(unsigned char* tile, int box_bytes, int from, int rows, int barrier) {
  const int chunks = (rows - from) * 8;
#pragma unroll 1
  for (int i = threadIdx.x - 128; i < chunks * kBoxes; i += 256) {
    const int box = i / chunks, r = (i % chunks) / 8, chunk = i % 8;
    *reinterpret_cast<uint4*>(tile + box * box_bytes + (from + r) * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
  kernels::ptx::fence_proxy_async_shared();
  kernels::ptx::named_barrier_sync(barrier, 256);
}

// The query tiles [m_begin, m_end) that see some key of the tile [n0, n0 + kBlockN): query i sees
// key j iff i + offset - window_left <= j <= i + offset + window_right, i.e. the queries
// [n0 - offset - window_right, n0 + kBlockN - 1 - offset + window_left] (an unbounded edge: all).
template <typename C>
__device__ __forceinline__ void query_tiles(const BwdKernelArgs& a, const BwdSeq& sq, int n0, int& m_begin,
                                            int& m_end) {
  const int64_t first = int64_t{n0} - sq.offset - a.window_right;
  const int64_t last = int64_t{n0} + C::kBlockN - 1 - sq.offset + a.window_left;
  const int64_t tiles = (sq.len_q + C::kBlockM - 1) / C::kBlockM;
  const int64_t end = last < 0 ? 0 : last / C::kBlockM + 1;
  m_begin = first > 0 ? static_cast<int>(first / C::kBlockM) : 0;
  m_end = static_cast<int>(end < tiles ? end : tiles);
  if (n0 >= sq.len_k || m_begin > m_end) m_begin = m_end;
}

// ---- dK, dV (and dQ by reductions) per key tile ------------------------------------------------
// Grid (ceil(S_k / 128), H_kv, B); block kThreads; dynamic shared memory kSmemBytes.
template <typename T, int kHeadDim, bool kAccumDq>
__global__ void __launch_bounds__(BwdConfig<kHeadDim>::kThreads, 1)
    dkdv_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                const __grid_constant__ BwdKernelArgs args) {
  using C = BwdConfig<kHeadDim>;
  using Tag = std::conditional_t<std::is_same_v<T, __half>, kernels::ptx::F16Tag, kernels::ptx::Bf16Tag>;
  namespace ptx = kernels::ptx;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* k_tile = smem + C::kKOffset;
  unsigned char* v_tile = smem + C::kVOffset;
  auto q_tile = [&](int s) { return smem + C::kQOffset + s * C::kQTileBytes; };
  auto do_tile = [&](int s) { return smem + C::kDoOffset + s * C::kQTileBytes; };
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kBarOffset);
  uint64_t* kv_full = bars;
  uint64_t* qdo_full = bars + 1;
  uint64_t* qdo_empty = qdo_full + C::kStages;

  const int warpgroup = threadIdx.x / 128;
  const int n_block = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;
  const int n0 = n_block * C::kBlockN;
  const BwdSeq sq = bwd_sequence(args, b);
  if (n0 >= sq.len_k) return;  // varlen: past this sequence's keys (the whole block; none to write)
  int m_begin, m_end;
  query_tiles<C>(args, sq, n0, m_begin, m_end);

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(kv_full, 1);
    for (int s = 0; s < C::kStages; ++s) {
      ptx::mbarrier_init(&qdo_full[s], 1);
      ptx::mbarrier_init(&qdo_empty[s], C::kReleases);
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer ----
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) {
      ptx::tma_prefetch_descriptor(&map_q);
      ptx::tma_prefetch_descriptor(&map_k);
      ptx::tma_prefetch_descriptor(&map_v);
      ptx::tma_prefetch_descriptor(&map_do);
      ptx::mbarrier_arrive_expect_tx(kv_full, 2 * C::kKvTileBytes);
#pragma unroll
      for (int x = 0; x < C::kBoxes; ++x) {
        ptx::tma_load_4d(k_tile + x * C::kKvBoxBytes, &map_k, kv_full, x * C::kBoxCols, sq.start_k + n0, h_kv,
                         sq.batch_coord);
        ptx::tma_load_4d(v_tile + x * C::kKvBoxBytes, &map_v, kv_full, x * C::kBoxCols, sq.start_k + n0, h_kv,
                         sq.batch_coord);
      }
      kernels::RingCursor<C::kStages> ring;
      for (int g = 0; g < args.group; ++g) {
        const int h = h_kv * args.group + g;
        for (int m = m_begin; m < m_end; ++m) {
          // A fresh empty barrier satisfies the opposite parity: the first kStages waits pass.
          ptx::mbarrier_wait(&qdo_empty[ring.stage], ring.phase ^ 1);
          ptx::mbarrier_arrive_expect_tx(&qdo_full[ring.stage], 2 * C::kQTileBytes);
#pragma unroll
          for (int x = 0; x < C::kBoxes; ++x) {
            ptx::tma_load_4d(q_tile(ring.stage) + x * C::kQBoxBytes, &map_q, &qdo_full[ring.stage],
                             x * C::kBoxCols, sq.start_q + m * C::kBlockM, h, sq.batch_coord);
            ptx::tma_load_4d(do_tile(ring.stage) + x * C::kQBoxBytes, &map_do, &qdo_full[ring.stage],
                             x * C::kBoxCols, sq.start_q + m * C::kBlockM, h, sq.batch_coord);
          }
          ring.advance();
        }
      }
    }
  } else {
    // ---- consumers ----
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    const int c = warpgroup - 1;  // keys [64c, 64c + 64) of the tile
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32;
    const int key0 = n0 + 64 * c + 16 * warp + lane / 4;  // this thread's keys: key0, key0 + 8
    const int col_in = 2 * (lane % 4);                    // + 8j + e: its query columns of a tile
    unsigned char* ds_tile = smem + C::kDsOffset + c * C::kDsBytes;
    constexpr float kLog2e = 1.4426950408889634f;

    float dv[kHeadDim / 2], dk[kHeadDim / 2];  // 64 keys x D per warpgroup, accumulator layout
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) dv[i] = dk[i] = 0.f;

    ptx::mbarrier_wait(kv_full, 0);
    // Varlen: K rows past this sequence's keys are the next sequence's (their dS is 0, but dQ = dS K
    // would still take 0 x an Inf of theirs).
    if (args.cu_seqlens_q && n0 + C::kBlockN > sq.len_k)
      zero_tail_rows<C::kBoxes>(k_tile, C::kKvBoxBytes, sq.len_k - n0, C::kBlockN, C::kZeroBarrier);
    kernels::RingCursor<C::kStages> ring;
    for (int g = 0; g < args.group; ++g) {
      const int h = h_kv * args.group + g;
      for (int m = m_begin; m < m_end; ++m) {
        const int m0 = m * C::kBlockM;
        ptx::mbarrier_wait(&qdo_full[ring.stage], ring.phase);
        const unsigned char* qt = q_tile(ring.stage);
        const unsigned char* dot = do_tile(ring.stage);
        // Varlen: the sequence's last query tile holds the next sequence's rows of Q and dO (their P
        // is 0, but dV += Pᵀ dO and dK += dSᵀ Q would still take 0 x an Inf of theirs).
        if (args.cu_seqlens_q && m0 + C::kBlockM > sq.len_q) {
          zero_tail_rows<C::kBoxes>(q_tile(ring.stage), C::kQBoxBytes, sq.len_q - m0, C::kBlockM, C::kZeroBarrier);
          zero_tail_rows<C::kBoxes>(do_tile(ring.stage), C::kQBoxBytes, sq.len_q - m0, C::kBlockM, C::kZeroBarrier);
        }

        // Sᵀ = K_c Qᵀ and dPᵀ = V_c dOᵀ (64 keys x 64 queries each), two groups.
        float st[32], dpt[32];
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          const int box = kk / 4, in_row = (kk % 4) * 32;
          const uint64_t da = ptx::make_smem_desc_k_major_sw128(k_tile + box * C::kKvBoxBytes + 64 * c * 128 + in_row);
          const uint64_t db = ptx::make_smem_desc_k_major_sw128(qt + box * C::kQBoxBytes + in_row);
          ptx::wgmma_m64n64k16<0, 0>(st, da, db, kk > 0 ? 1 : 0, Tag{});
        }
        ptx::wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 16; ++kk) {
          const int box = kk / 4, in_row = (kk % 4) * 32;
          const uint64_t da = ptx::make_smem_desc_k_major_sw128(v_tile + box * C::kKvBoxBytes + 64 * c * 128 + in_row);
          const uint64_t db = ptx::make_smem_desc_k_major_sw128(dot + box * C::kQBoxBytes + in_row);
          ptx::wgmma_m64n64k16<0, 0>(dpt, da, db, kk > 0 ? 1 : 0, Tag{});
        }
        ptx::wgmma_commit();

        ptx::wgmma_wait<0>();
        ptx::wgmma_hold(st);
        ptx::wgmma_hold(dpt);
        const float* lse_h = args.lse + b * args.lse_batch + h * args.lse_head + sq.start_q;
        const float* d_h = args.dvec + static_cast<int64_t>(h) * args.rows + sq.row0;
        // lse (log2 domain; +inf past S_q and for rows that saw no key, so P = 0) and D of this
        // thread's 16 query columns (read once the GEMMs are done: loaded while they run, the 32
        // values pushed the d128 kernel past its 240 registers).
        float lse2[16], dd[16];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int q = m0 + 8 * j + col_in + e;
            float l = INFINITY, dval = 0.f;
            if (q < sq.len_q) {
              const float raw = lse_h[q];
              l = raw == -INFINITY ? INFINITY : raw * kLog2e;
              dval = d_h[q];
            }
            lse2[2 * j + e] = l;
            dd[2 * j + e] = dval;
          }


        // Pᵀ and dSᵀ; masks only where the tile crosses S_k, S_q or an edge of some query's window.
        const bool masked = n0 + C::kBlockN > sq.len_k || m0 + C::kBlockM > sq.len_q ||
                            n0 + C::kBlockN - 1 > m0 + sq.offset + args.window_right ||
                            n0 < m0 + C::kBlockM - 1 + sq.offset - args.window_left;
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = 4 * j + 2 * hh + e;
              float pv = kernels::exp2_approx(st[i] * args.scale_log2 - lse2[2 * j + e]);
              float ds = pv * (dpt[i] - dd[2 * j + e]);
              if (masked) {  // hidden pairs: P = dS = 0 selected (a NaN of a hidden key's dP stays out)
                const int key = key0 + 8 * hh, q = m0 + 8 * j + col_in + e;
                const int diag = q + sq.offset;
                if (key >= sq.len_k || q >= sq.len_q || key > diag + args.window_right || key < diag - args.window_left)
                  pv = ds = 0.f;
              }
              st[i] = pv;
              dpt[i] = ds;
            }

        // Pᵀ and dSᵀ as register A operands (4 k-steps of 16 queries).
        uint32_t pa[4][4], sa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            pa[kk][r] = kernels::pack2<T>(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
            sa[kk][r] = kernels::pack2<T>(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
          }

        // dV_c += Pᵀ dO and dK_c += dSᵀ Q (B = dO / Q: 64 queries x D, MN-major).
        ptx::wgmma_hold(dv);
        ptx::wgmma_hold(dk);
        ptx::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t db = ptx::make_smem_desc_mn_major_sw128(dot + kk * 16 * 128, C::kQBoxBytes);
          if constexpr (kHeadDim == 128)
            ptx::wgmma_m64n128k16_rs<1>(dv, pa[kk], db, 1, Tag{});
          else
            ptx::wgmma_m64n64k16_rs<1>(dv, pa[kk], db, 1, Tag{});
        }
        ptx::wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t db = ptx::make_smem_desc_mn_major_sw128(qt + kk * 16 * 128, C::kQBoxBytes);
          if constexpr (kHeadDim == 128)
            ptx::wgmma_m64n128k16_rs<1>(dk, sa[kk], db, 1, Tag{});
          else
            ptx::wgmma_m64n64k16_rs<1>(dk, sa[kk], db, 1, Tag{});
        }
        ptx::wgmma_commit();

        if constexpr (kAccumDq) {
          // dSᵀ_c into this warpgroup's tile: row = key (64), 64 queries in a 128-byte row, the
          // 16-byte chunks swizzled by the row (what TMA's 128-byte swizzle writes), as wgmma reads
          // an MN-major A. The previous query tile's dQ GEMMs read it: the warpgroup waits for all
          // of its warps first.
          ptx::named_barrier_sync(C::kDsBarrier + c, 128);
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int row = 16 * warp + lane / 4 + 8 * hh, col = 8 * j + col_in;
              const uint32_t v = kernels::pack2<T>(dpt[4 * j + 2 * hh], dpt[4 * j + 2 * hh + 1]);
              *reinterpret_cast<uint32_t*>(ds_tile + row * 128 + ((j ^ (row % 8)) * 16) + (col % 8) * 2) = v;
            }
          ptx::fence_proxy_async_shared();
          ptx::named_barrier_sync(C::kDsBarrier + c, 128);
          // The dV / dK groups are done before the dQ accumulators are live: Pᵀ and dSᵀ's registers
          // are free by then (the register file holds dV, dK and one dQ chunk, not all five).
          ptx::wgmma_wait<0>();
          ptx::wgmma_hold(dv);
          ptx::wgmma_hold(dk);
          ptx::wgmma_hold(pa);
          ptx::wgmma_hold(sa);

          // dQ_c = dS_c K_c (64 queries x D) in 64-column chunks, each added into the accumulator.
          const int64_t q_row0 = sq.row0 + m0;
#pragma unroll
          for (int cg = 0; cg < C::kBoxes; ++cg) {
            float dq[32];
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
              const uint64_t da = ptx::make_smem_desc_mn_major_sw128(ds_tile + kk * 16 * 128, C::kDsBytes);
              const uint64_t db = ptx::make_smem_desc_mn_major_sw128(
                  k_tile + cg * C::kKvBoxBytes + (64 * c + 16 * kk) * 128, C::kKvBoxBytes);
              ptx::wgmma_m64n64k16<1, 1>(dq, da, db, kk > 0 ? 1 : 0, Tag{});
            }
            ptx::wgmma_commit();
            ptx::wgmma_wait<0>();
            ptx::wgmma_hold(dq);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int q = m0 + 16 * warp + lane / 4 + 8 * hh;
              if (q >= sq.len_q) continue;
              float* dst = args.dq_acc + ((q_row0 + 16 * warp + lane / 4 + 8 * hh) * args.heads_q + h) * kHeadDim +
                           cg * 64 + col_in;
#pragma unroll
              for (int j = 0; j < 8; ++j) ptx::red_add_v2_f32(dst + 8 * j, dq[4 * j + 2 * hh], dq[4 * j + 2 * hh + 1]);
            }
          }
        }
        ptx::wgmma_wait<0>();
        ptx::wgmma_hold(dv);
        ptx::wgmma_hold(dk);
        ptx::wgmma_hold(pa);
        ptx::wgmma_hold(sa);
        if (lane == 0) ptx::mbarrier_arrive(&qdo_empty[ring.stage]);  // Q and dO are read
        ring.advance();
      }
    }

    // Epilogue: dK * scale and dV for keys < S_k, from registers.
    T* dk_out = static_cast<T*>(args.dk) + b * args.dk_batch + sq.start_k * args.dk_row + h_kv * args.dk_head;
    T* dv_out = static_cast<T*>(args.dv) + b * args.dv_batch + sq.start_k * args.dv_row + h_kv * args.dv_head;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int key = key0 + 8 * hh;
      if (key >= sq.len_k) continue;
      T* dk_row = dk_out + static_cast<int64_t>(key) * args.dk_row;
      T* dv_row = dv_out + static_cast<int64_t>(key) * args.dv_row;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        *reinterpret_cast<uint32_t*>(dk_row + 8 * j + col_in) =
            kernels::pack2<T>(dk[4 * j + 2 * hh] * args.scale, dk[4 * j + 2 * hh + 1] * args.scale);
        *reinterpret_cast<uint32_t*>(dv_row + 8 * j + col_in) = kernels::pack2<T>(dv[4 * j + 2 * hh], dv[4 * j + 2 * hh + 1]);
      }
    }
  }
}

// The host side for one (dtype, head dim): flash2's prologue (D, the zeroed dq accumulator: its
// workspace, the same layout and size), dkdv_kernel (with dQ in fast mode), then flash2's dq step
// (the convert, or its deterministic dq kernel). flash2's kernels run from its own units, built
// for every architecture of the build (flash2.h).
template <typename T, int kHeadDim>
cudaError_t run_backward(const AttentionParams& p, const Workspace& workspace, cudaStream_t stream) {
  using C = BwdConfig<kHeadDim>;
  if (!p.backward || p.head_dim != kHeadDim || p.softcap > 0 || p.alibi || p.mask) return cudaErrorInvalidValue;
  const bool varlen = p.varlen();
  if (p.batch <= 0 || p.heads_q <= 0 || (p.seqlen_q <= 0 && p.seqlen_k <= 0)) return cudaSuccess;
  // Varlen: packed (D, total, H, 1) maps, the rows of each sequence found from cu_seqlens on the device.
  const int64_t rows_q = varlen ? p.total_q : p.seqlen_q, rows_k = varlen ? p.total_k : p.seqlen_k;
  float* dvec = nullptr;
  float* dq_acc = nullptr;
  int64_t rows = 0;
  cudaError_t err = flash2::backward_prologue<T, kHeadDim>(p, workspace, &dvec, &dq_acc, &rows, stream);
  if (err != cudaSuccess) return err;

  if (p.seqlen_k > 0 && rows_k > 0) {
    auto map_of = [&](CUtensorMap* map, const void* data, const AttentionStrides& st, int64_t rows_, int64_t heads,
                      int box_rows) {
      const TmaTensor4 t = varlen ? TmaTensor4{data, {p.head_dim, rows_, heads, 1}, {st.row, st.head, 0}, 2}
                                  : TmaTensor4{data, {p.head_dim, rows_, heads, p.batch}, {st.row, st.head, st.batch}, 2};
      if (!tma_rejects(t, "").empty()) return cudaErrorInvalidValue;
      return make_tma_map_sw128(map, t, C::kBoxCols, box_rows);
    };
    CUtensorMap map_q, map_k, map_v, map_do;
    err = map_of(&map_k, p.k, p.k_s, rows_k, p.heads_kv, C::kBlockN);
    if (err == cudaSuccess) err = map_of(&map_v, p.v, p.v_s, rows_k, p.heads_kv, C::kBlockN);
    if (p.seqlen_q > 0 && rows_q > 0) {
      if (err == cudaSuccess) err = map_of(&map_q, p.q, p.q_s, rows_q, p.heads_q, C::kBlockM);
      if (err == cudaSuccess) err = map_of(&map_do, p.dout, p.dout_s, rows_q, p.heads_q, C::kBlockM);
    } else {
      map_q = map_do = map_k;  // no query tile is ever loaded (dk = dv = 0)
    }
    if (err != cudaSuccess) return err;
    BwdKernelArgs a{};
    a.dk = p.dk, a.dv = p.dv;
    a.dk_batch = p.dk_s.batch, a.dk_row = p.dk_s.row, a.dk_head = p.dk_s.head;
    a.dv_batch = p.dv_s.batch, a.dv_row = p.dv_s.row, a.dv_head = p.dv_s.head;
    a.lse = static_cast<const float*>(p.lse);
    a.lse_batch = p.lse_batch, a.lse_head = p.lse_head;
    a.dvec = dvec;
    a.dq_acc = p.deterministic ? nullptr : dq_acc;
    a.rows = rows;
    a.len_q = static_cast<int>(p.seqlen_q), a.len_k = static_cast<int>(p.seqlen_k);
    a.heads_q = static_cast<int>(p.heads_q), a.group = static_cast<int>(p.group());
    a.top_left = p.top_left ? 1 : 0;
    a.cu_seqlens_q = p.cu_seqlens_q, a.cu_seqlens_k = p.cu_seqlens_k;
    const int64_t unbounded = p.seqlen_q + p.seqlen_k;
    if (2 * unbounded + 2 * C::kBlockN >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // the int window tests
    a.window_left = static_cast<int>(p.window_left < 0 ? unbounded : p.window_left);
    a.window_right = static_cast<int>(p.window_right < 0 ? unbounded : p.window_right);
    a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
    a.scale = static_cast<float>(p.scale);
    const dim3 grid(static_cast<unsigned>((p.seqlen_k + C::kBlockN - 1) / C::kBlockN),
                    static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.batch));
    auto launch = [&](auto kernel) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
      if (e != cudaSuccess) return e;
      kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(map_q, map_k, map_v, map_do, a);
      return cudaGetLastError();
    };
    err = p.deterministic ? launch(dkdv_kernel<T, kHeadDim, false>) : launch(dkdv_kernel<T, kHeadDim, true>);
    if (err != cudaSuccess) return err;
  }
  if (p.seqlen_q <= 0) return cudaSuccess;
  return flash2::backward_dq<T, kHeadDim>(p, workspace, stream);
}

}  // namespace optimized::cuda::hopper
