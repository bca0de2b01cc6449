// The hopper rung's forward (sm_90a): FlashAttention on wgmma and TMA, warp-specialized.
//
// Versions of this file (the ladder inside the rung; each line what it adds):
//   v1: a producer warp issuing TMA into a K ring and a V ring on mbarriers; two consumer
//      warpgroups, each S = Q Kᵀ with wgmma from shared memory, online softmax in registers, P
//      converted in registers and O += P V with wgmma taking A from registers; causal masks only
//      on the tiles that cross the diagonal or the sequence's end; rows normalized and stored
//      from registers, lse written.
//   v2 (this one): ping-pong between the two consumer warpgroups (kPingPong: named barriers make
//      them take turns issuing S, so that one's softmax overlaps the other's GEMMs). No overlap
//      between a warpgroup's softmax and its own GEMMs yet.
//   next: the intra-warpgroup two-stage overlap (S of tile n+1 issued before the softmax of tile
//      n), a persistent scheduler with causal tiles longest first, the output staged in shared
//      memory and written by TMA.
//
// The block (kThreads = 384: three warpgroups; __launch_bounds__(384, 1), one block per SM):
//   warpgroup 0, the producer: setmaxnreg.dec to 24 registers; one thread loads Q once and then,
//     for each key tile, K into the K ring and V into the V ring (each full/empty barrier pairs).
//   warpgroups 1 and 2, the consumers: setmaxnreg.inc to 240; warpgroup c owns query rows
//     [64 c, 64 c + 64) of the block's 128-row Q tile.
// Why 2 x 64 rows and not 128 rows per warpgroup: wgmma's M is 64 per warpgroup, so 128 rows per
// warpgroup would be two m64 GEMMs per tile and twice the accumulators: S (64 x 128 fp32: 64
// registers per thread per m64) and O (64 x D: 64 at D = 128) would take 256 registers alone,
// past the 255 a thread has. Two warpgroups of 64 rows keep 128 accumulator registers each (plus
// 32 for P) under 240, and still share every K/V tile between 128 query rows, which halves the
// shared-memory and L2 traffic per query row against one warpgroup of 64 (the FlashAttention-3
// choice for d = 128).
//
// Shared memory (1024-byte aligned, 128-byte swizzle: TMA boxes of 64 columns x 128 rows, each
// row one 128-byte swizzle row; a 128 x D tile is D / 64 boxes of 16 KiB):
//   Q (128 x D) | K ring: kStages x (128 x D) | V ring: kStages x (128 x D) | barriers
// D = 128: 32 + 2 x 2 x 32 = 160 KiB (2 stages); D = 64: 16 + 2 x 3 x 16 = 112 KiB (3 stages).
// K and V have rings of their own (not the GEMM's WgmmaRing, whose stage is A and B together):
// the consumers release K as soon as S is computed and V after P V, so the producer refills K
// while the softmax runs.
//
// The operands as wgmma sees them (kernels/ptx/wgmma.cuh, kernels/gemm/wgmma_mainloop.cuh):
//   S = Q Kᵀ: A = Q rows [64c, 64c + 64), K-major (head dim contiguous); B = K (128 keys x D),
//     stored (N, K): K-major. k-step kk (16 of D) is box kk / 4, 32 bytes per step inside it.
//   O += P V: A = P from registers (the S accumulator's layout is the register-A layout, see
//     wgmma_m64n128k16_rs); B = V (128 keys x D), stored (K, N): MN-major, the D / 64 column groups
//     one box (16 KiB, the LBO) apart, k-step kk (16 keys) 16 rows = 2048 bytes down.
//
// Softmax (one row per 4 lanes, two rows per thread: the accumulator layout): scores are scaled
// into the log2 domain first (s * scale * log2 e, so that any sign of scale is right), masked to
// -inf, the running max m and a per-thread partial row sum l kept; exp2(s - m) is P; O and l are
// rescaled by exp2(m_old - m_new) (a row with nothing visible yet subtracts 0: 2^-inf = 0). At the
// end l is summed over the 4 lanes of the row, out = O / l (0 for a row that saw no key: l = 0),
// lse = (m + log2 l) ln 2 (-inf there), as flash2 writes it.
//
// Masks: key tiles are visited from the last to the first, so the ones that need a mask (the
// sequence's ragged end: keys >= len_k; causal: keys past a row's diagonal i + offset) come first
// and the rest run unmasked; causal tiles wholly past the diagonal of the block's last row are
// never loaded. Rows past len_q read zeros (TMA fills boxes outside the tensor with zeros) and are
// not written.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention/attention_params.h"
#include "core/tensor_map.h"
#include "kernels/gemm/wgmma_mainloop.cuh"
#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/smem.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"
#include "kernels/tile/mma_frag.cuh"

namespace optimized::cuda::hopper {

// ---- config ----------------------------------------------------------------------------------
template <int kHeadDim_>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // query rows per block: (kConsumers) x 64
  static constexpr int kBlockN = 128;  // keys per tile
  static constexpr int kConsumers = 2;  // consumer warpgroups
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kStages = kHeadDim == 64 ? 3 : 2;
  static constexpr int kBoxCols = 64;                     // 16-bit elements per 128-byte swizzle row
  static constexpr int kBoxes = kHeadDim / kBoxCols;      // boxes per tile (along D)
  static constexpr int kBoxBytes = 128 * 128;             // 128 rows x 128 bytes
  static constexpr int kTileBytes = kBoxes * kBoxBytes;   // a 128 x D tile
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kTileBytes;
  static constexpr int kVOffset = kKOffset + kStages * kTileBytes;
  static constexpr int kBarOffset = kVOffset + kStages * kTileBytes;
  static constexpr int kBarriers = 1 + 4 * kStages;       // q_full, k_full, k_empty, v_full, v_empty
  static constexpr int kSmemBytes = kBarOffset + kBarriers * 8 + 1024;  // + slack to align to 1024
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // Ping-pong: the consumer warpgroups take turns issuing S = Q Kᵀ (named barriers kPingPongBarrier
  // + c), so that one's softmax runs while the other's GEMMs do, instead of both softmaxes falling
  // into step with the tensor cores idle. false: the warpgroups run freely (for an A/B).
  static constexpr bool kPingPong = true;
  static constexpr int kPingPongBarrier = 1;  // ids 1, 2 (0 is __syncthreads)
  // Intra-warpgroup overlap: the softmax of key tile n runs while the tensor cores do the PV
  // product of tile n + 1 (the previous one in visiting order); false: S, softmax, PV in turn.
  static constexpr bool kIntraOverlap = true;
  // Releases of a stage: lane 0 of every consumer warp.
  static constexpr int kReleases = kConsumers * 4;

  static_assert(kHeadDim == 64 || kHeadDim == 128, "hopper forward: head dims 64 and 128");
  static_assert(kBlockM == 64 * kConsumers, "one m64 wgmma row block per consumer warpgroup");
  static_assert(kBlockN == 128, "S is one m64n128 accumulator per warpgroup");
  static_assert(kSmemBytes <= 227 * 1024, "over the 227 KiB of shared memory a block may have");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "register file");
  static_assert(!kPingPong || kConsumers == 2, "the ping-pong alternates two consumer warpgroups");
};

// What the kernel reads besides the three tensor maps.
struct FwdArgs {
  void* out;
  int64_t out_batch, out_row, out_head;  // elements
  float* lse;                            // null: not written
  int64_t lse_batch, lse_head;
  int len_q, len_k;
  int group;           // query heads per kv head
  int causal;          // window_right == 0, window_left unbounded
  int offset;          // causal diagonal: query i sees keys j <= i + offset
  float scale_log2;    // scale * log2(e)
};

// The key tiles the block of query rows [m0, m0 + kBlockM) visits: [0, n_end).
template <typename C>
__device__ __forceinline__ int key_tiles(const FwdArgs& a, int m0) {
  int n_end = (a.len_k + C::kBlockN - 1) / C::kBlockN;
  if (a.causal) {
    const int last_key = m0 + C::kBlockM - 1 + a.offset;  // the block's last row's diagonal
    const int n_diag = last_key < 0 ? 0 : last_key / C::kBlockN + 1;
    n_end = n_end < n_diag ? n_end : n_diag;
  }
  return n_end;
}

// ---- kernel ----------------------------------------------------------------------------------
// Grid (ceil(S_q / 128), H_q, B); block kThreads; dynamic shared memory kSmemBytes.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(FwdConfig<kHeadDim>::kThreads, 1)
    forward_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                   const __grid_constant__ CUtensorMap map_v, const __grid_constant__ FwdArgs args) {
  using C = FwdConfig<kHeadDim>;
  using Tag = std::conditional_t<std::is_same_v<T, __half>, kernels::ptx::F16Tag, kernels::ptx::Bf16Tag>;
  namespace ptx = kernels::ptx;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  unsigned char* q_tile = smem + C::kQOffset;
  auto k_tile = [&](int s) { return smem + C::kKOffset + s * C::kTileBytes; };
  auto v_tile = [&](int s) { return smem + C::kVOffset + s * C::kTileBytes; };
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kBarOffset);
  uint64_t* q_full = bars;
  uint64_t* k_full = bars + 1;
  uint64_t* k_empty = k_full + C::kStages;
  uint64_t* v_full = k_empty + C::kStages;
  uint64_t* v_empty = v_full + C::kStages;

  const int warpgroup = threadIdx.x / 128;
  const int m_block = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int h_kv = h / args.group;
  const int m0 = m_block * C::kBlockM;
  const int n_end = key_tiles<C>(args, m0);

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(q_full, 1);
    for (int s = 0; s < C::kStages; ++s) {
      ptx::mbarrier_init(&k_full[s], 1);
      ptx::mbarrier_init(&k_empty[s], C::kReleases);
      ptx::mbarrier_init(&v_full[s], 1);
      ptx::mbarrier_init(&v_empty[s], C::kReleases);
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
      ptx::mbarrier_arrive_expect_tx(q_full, C::kTileBytes);
#pragma unroll
      for (int x = 0; x < C::kBoxes; ++x)
        ptx::tma_load_4d(q_tile + x * C::kBoxBytes, &map_q, q_full, x * C::kBoxCols, m0, h, b);
      kernels::RingCursor<C::kStages> ring;
      for (int n = n_end - 1; n >= 0; --n) {
        // A fresh empty barrier satisfies the opposite parity: the first kStages waits pass.
        ptx::mbarrier_wait(&k_empty[ring.stage], ring.phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&k_full[ring.stage], C::kTileBytes);
#pragma unroll
        for (int x = 0; x < C::kBoxes; ++x)
          ptx::tma_load_4d(k_tile(ring.stage) + x * C::kBoxBytes, &map_k, &k_full[ring.stage], x * C::kBoxCols,
                           n * C::kBlockN, h_kv, b);
        ptx::mbarrier_wait(&v_empty[ring.stage], ring.phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(&v_full[ring.stage], C::kTileBytes);
#pragma unroll
        for (int x = 0; x < C::kBoxes; ++x)
          ptx::tma_load_4d(v_tile(ring.stage) + x * C::kBoxBytes, &map_v, &v_full[ring.stage], x * C::kBoxCols,
                           n * C::kBlockN, h_kv, b);
        ring.advance();
      }
    }
  } else {
    // ---- consumers ----
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    const int c = warpgroup - 1;                   // rows [64c, 64c + 64) of the Q tile
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32;
    const int row0 = m0 + 64 * c + 16 * warp + lane / 4;  // this thread's rows: row0, row0 + 8
    const int col_in = 2 * (lane % 4);                    // + 8j + e: its columns of a tile

    float o[kHeadDim / 2];  // O: 64 x D per warpgroup, accumulator layout
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
    float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain
    float row_sum[2] = {0.f, 0.f};              // this thread's partial sums

    ptx::mbarrier_wait(q_full, 0);
    const unsigned char* q_rows = q_tile + 64 * c * 128;  // 64 rows x 128 bytes into each box
    // Ping-pong: warpgroup c waits on barrier 1 + c before issuing its S and then lets the other
    // one go (arrive on 1 + (1 - c)); each barrier counts the 128 waiters and the other's 128
    // arrivals. Warpgroup 1 arrives once up front, so warpgroup 0 goes first. Both run the same
    // number of tiles, so every wait has its arrival; the last arrival is left unmatched at exit.
    if constexpr (C::kPingPong)
      if (c == 1) ptx::named_barrier_arrive(C::kPingPongBarrier, 256);

    // S = Q Kᵀ (64 x 128 per warpgroup) of the key tile in `stage`, issued (not waited for).
    auto issue_qk = [&](float (&s)[C::kBlockN / 2], int stage) {
      const unsigned char* kt = k_tile(stage);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const int off = (kk / 4) * C::kBoxBytes + (kk % 4) * 32;
        const uint64_t da = ptx::make_smem_desc_k_major_sw128(q_rows + off);
        const uint64_t db = ptx::make_smem_desc_k_major_sw128(kt + off);
        ptx::wgmma_m64n128k16<0, 0>(s, da, db, kk > 0 ? 1 : 0, Tag{});
      }
      ptx::wgmma_commit();
    };
    // O += P V of the value tile in `stage`, issued (not waited for).
    auto issue_pv = [&](uint32_t (&pa)[C::kBlockN / 16][4], int stage) {
      const unsigned char* vt = v_tile(stage);
      ptx::wgmma_hold(o);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
        const uint64_t db = ptx::make_smem_desc_mn_major_sw128(vt + kk * 16 * 128, C::kBoxBytes);
        if constexpr (kHeadDim == 128)
          ptx::wgmma_m64n128k16_rs<1>(o, pa[kk], db, 1, Tag{});
        else
          ptx::wgmma_m64n64k16_rs<1>(o, pa[kk], db, 1, Tag{});
      }
      ptx::wgmma_commit();
    };
    // The online softmax of tile n (S in s, finished): scaled into the log2 domain, the edge and
    // diagonal tiles masked, the new row max (over the row's 4 lanes), P = 2^(s - m) in s, l
    // rescaled and grown; alpha[hh] = 2^(m_old - m_new), the factor O still needs.
    auto softmax = [&](float (&s)[C::kBlockN / 2], int n, float (&alpha)[2]) {
      const int n0 = n * C::kBlockN;
      const bool masked = n0 + C::kBlockN > args.len_k || (args.causal && n0 + C::kBlockN - 1 > m0 + args.offset);
#pragma unroll
      for (int i = 0; i < C::kBlockN / 2; ++i) s[i] *= args.scale_log2;
      if (masked) {
#pragma unroll
        for (int j = 0; j < C::kBlockN / 8; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = n0 + 8 * j + col_in + e;
              const int row = row0 + 8 * hh;
              if (col >= args.len_k || (args.causal && col > row + args.offset)) s[4 * j + 2 * hh + e] = -INFINITY;
            }
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = row_max[hh];
#pragma unroll
        for (int j = 0; j < C::kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hh], s[4 * j + 2 * hh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_use = mx == -INFINITY ? 0.f : mx;  // nothing visible yet: 2^(-inf - 0) = 0
        alpha[hh] = kernels::exp2_approx(row_max[hh] - m_use);
        row_max[hh] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < C::kBlockN / 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = kernels::exp2_approx(s[4 * j + 2 * hh + e] - m_use);
            s[4 * j + 2 * hh + e] = pv;
            sum += pv;
          }
        row_sum[hh] = row_sum[hh] * alpha[hh] + sum;
      }
    };
    auto rescale_o = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          o[4 * j + 2 * hh] *= alpha[hh];
          o[4 * j + 2 * hh + 1] *= alpha[hh];
        }
    };
    // P in 16-bit registers, as wgmma's register A (8 k-steps of 16 keys).
    auto pack_p = [&](const float (&s)[C::kBlockN / 2], uint32_t (&pa)[C::kBlockN / 16][4]) {
#pragma unroll
      for (int kk = 0; kk < C::kBlockN / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = kernels::pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    };
    auto pingpong_wait = [&] {
      if constexpr (C::kPingPong) ptx::named_barrier_sync(C::kPingPongBarrier + c, 256);
    };
    auto pingpong_pass = [&] {
      if constexpr (C::kPingPong) ptx::named_barrier_arrive(C::kPingPongBarrier + 1 - c, 256);
    };

    kernels::RingCursor<C::kStages> ring;
    if constexpr (C::kIntraOverlap) {
      // Two tiles in flight per warpgroup: while the tensor cores run S_n = Q K_nᵀ and O += P_{n+1}
      // V_{n+1}, this warpgroup's threads wait only for S_n and compute its softmax; O is rescaled
      // once the PV group is done. The first tile's S comes alone; the last PV alone.
      float s[C::kBlockN / 2];
      uint32_t pa[C::kBlockN / 16][4];
      float alpha[2];
      if (n_end > 0) {
        ptx::mbarrier_wait(&k_full[ring.stage], ring.phase);
        pingpong_wait();
        issue_qk(s, ring.stage);
        pingpong_pass();
        ptx::wgmma_wait<0>();
        ptx::wgmma_hold(s);
        if (lane == 0) ptx::mbarrier_arrive(&k_empty[ring.stage]);
        softmax(s, n_end - 1, alpha);  // O is 0: no rescale
        pack_p(s, pa);
      }
      for (int n = n_end - 2; n >= 0; --n) {
        kernels::RingCursor<C::kStages> prev = ring;  // the tile whose P is in pa
        ring.advance();
        ptx::mbarrier_wait(&k_full[ring.stage], ring.phase);
        ptx::mbarrier_wait(&v_full[prev.stage], prev.phase);
        pingpong_wait();
        issue_qk(s, ring.stage);
        issue_pv(pa, prev.stage);
        pingpong_pass();
        ptx::wgmma_wait<1>();  // S_n is done (groups complete in order); PV may still run
        ptx::wgmma_hold(s);
        if (lane == 0) ptx::mbarrier_arrive(&k_empty[ring.stage]);
        softmax(s, n, alpha);
        ptx::wgmma_wait<0>();
        ptx::wgmma_hold(o);
        ptx::wgmma_hold(pa);  // read by the PV group until here
        if (lane == 0) ptx::mbarrier_arrive(&v_empty[prev.stage]);
        rescale_o(alpha);
        pack_p(s, pa);
      }
      if (n_end > 0) {
        ptx::mbarrier_wait(&v_full[ring.stage], ring.phase);
        issue_pv(pa, ring.stage);
        ptx::wgmma_wait<0>();
        ptx::wgmma_hold(o);
        ptx::wgmma_hold(pa);
        if (lane == 0) ptx::mbarrier_arrive(&v_empty[ring.stage]);
      }
    } else {
      for (int n = n_end - 1; n >= 0; --n) {
        float s[C::kBlockN / 2];
        uint32_t pa[C::kBlockN / 16][4];
        float alpha[2];
        ptx::mbarrier_wait(&k_full[ring.stage], ring.phase);
        pingpong_wait();
        issue_qk(s, ring.stage);
        pingpong_pass();
        ptx::wgmma_wait<0>();
        ptx::wgmma_hold(s);
        if (lane == 0) ptx::mbarrier_arrive(&k_empty[ring.stage]);
        softmax(s, n, alpha);
        rescale_o(alpha);
        pack_p(s, pa);
        ptx::mbarrier_wait(&v_full[ring.stage], ring.phase);
        issue_pv(pa, ring.stage);
        ptx::wgmma_wait<0>();
        ptx::wgmma_hold(o);
        ptx::wgmma_hold(pa);
        if (lane == 0) ptx::mbarrier_arrive(&v_empty[ring.stage]);
        ring.advance();
      }
    }

    // Epilogue: l over the row's 4 lanes, O / l stored (rows < len_q), lse.
    T* out = static_cast<T*>(args.out) + b * args.out_batch + h * args.out_head;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = row_sum[hh];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const bool empty = l == 0.f;  // no visible key (a NaN l is not empty: it propagates, as in flash2)
      const float inv = empty ? 0.f : 1.f / l;
      const int row = row0 + 8 * hh;
      if (row < args.len_q) {
        T* out_row = out + static_cast<int64_t>(row) * args.out_row;
#pragma unroll
        for (int j = 0; j < kHeadDim / 8; ++j) {
          const uint32_t v = kernels::pack2<T>(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
          *reinterpret_cast<uint32_t*>(out_row + 8 * j + col_in) = v;
        }
        if (args.lse && lane % 4 == 0)
          args.lse[b * args.lse_batch + h * args.lse_head + row] =
              empty ? -INFINITY : (row_max[hh] + kernels::log2_approx(l)) * 0.69314718055994531f;
      }
    }
  }
}

// Launches the forward for validated params (head dim kHeadDim exactly, fixed length, no window
// but causal, no softcap / ALiBi / mask), the maps made by the launcher (hopper.cu).
template <typename T, int kHeadDim>
cudaError_t launch_forward(const CUtensorMap& map_q, const CUtensorMap& map_k, const CUtensorMap& map_v,
                           const FwdArgs& args, int batch, int heads_q, cudaStream_t stream) {
  using C = FwdConfig<kHeadDim>;
  auto kernel = forward_kernel<T, kHeadDim>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((args.len_q + C::kBlockM - 1) / C::kBlockM, heads_q, batch);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(map_q, map_k, map_v, args);
  return cudaGetLastError();
}

// The host side for one (dtype, head dim): Q, K, V as 4-D tensor maps (D, S, H, B) with boxes of
// 64 columns x 128 rows, the scalars, the launch. cudaErrorInvalidValue for what the rung does not
// run (the API refuses it first, with a message).
template <typename T, int kHeadDim>
cudaError_t run_forward(const AttentionParams& p, cudaStream_t stream) {
  using C = FwdConfig<kHeadDim>;
  if (p.backward || p.varlen() || p.head_dim != kHeadDim || p.softcap > 0 || p.alibi || p.mask ||
      p.window_left >= 0 || p.window_right > 0)
    return cudaErrorInvalidValue;
  auto map_of = [&](CUtensorMap* map, const void* data, const AttentionStrides& st, int64_t rows, int64_t heads) {
    const TmaTensor4 t{data, {p.head_dim, rows, heads, p.batch}, {st.row, st.head, st.batch}, 2};
    if (!tma_rejects(t, "").empty()) return cudaErrorInvalidValue;
    return make_tma_map_sw128(map, t, C::kBoxCols, C::kBlockN);
  };
  CUtensorMap map_q, map_k, map_v;
  cudaError_t err = map_of(&map_q, p.q, p.q_s, p.seqlen_q, p.heads_q);
  if (err != cudaSuccess) return err;
  if (p.seqlen_k == 0) {
    map_k = map_v = map_q;  // no key tile is ever loaded (out 0, lse -inf); k and v may be null
  } else {
    err = map_of(&map_k, p.k, p.k_s, p.seqlen_k, p.heads_kv);
    if (err == cudaSuccess) err = map_of(&map_v, p.v, p.v_s, p.seqlen_k, p.heads_kv);
    if (err != cudaSuccess) return err;
  }
  FwdArgs a{};
  a.out = p.out;
  a.out_batch = p.out_s.batch, a.out_row = p.out_s.row, a.out_head = p.out_s.head;
  a.lse = static_cast<float*>(p.lse);
  a.lse_batch = p.lse_batch, a.lse_head = p.lse_head;
  a.len_q = static_cast<int>(p.seqlen_q), a.len_k = static_cast<int>(p.seqlen_k);
  a.group = static_cast<int>(p.group());
  a.causal = p.window_right == 0 ? 1 : 0;
  a.offset = p.top_left ? 0 : static_cast<int>(p.seqlen_k - p.seqlen_q);
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  return launch_forward<T, kHeadDim>(map_q, map_k, map_v, a, static_cast<int>(p.batch), static_cast<int>(p.heads_q),
                                     stream);
}

}  // namespace optimized::cuda::hopper
