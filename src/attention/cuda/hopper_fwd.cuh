// The hopper rung's forward (sm_90a): FlashAttention on wgmma and TMA, warp-specialized.
//
// Versions of this file (the ladder inside the rung; each line what it adds):
//   v1: a producer warp issuing TMA into a K ring and a V ring on mbarriers; two consumer
//      warpgroups, each S = Q Kᵀ with wgmma from shared memory, online softmax in registers, P
//      converted in registers and O += P V with wgmma taking A from registers; causal masks only
//      on the tiles that cross the diagonal or the sequence's end; rows normalized and stored
//      from registers, lse written.
//   v2: ping-pong between the two consumer warpgroups (kPingPong: named barriers make them take
//      turns issuing S, so that one's softmax overlaps the other's GEMMs).
//   v3: the intra-warpgroup overlap (kIntraOverlap): S of tile n and P V of tile n + 1 issued
//      together, the softmax of S_n computed while the PV group runs. Measured on the H100: d128
//      N = 16k 526 -> 592 TFLOP/s (docs/perf-notes/attention.md).
//   v4: varlen (packed tensor maps, the sequence found on the device from cu_seqlens) and a
//      persistent schedule (kPersistent: one block per SM walks the (m block, head, sequence)
//      tiles in L2 chunks, longest first within a chunk, and loads the next tile's Q while its
//      consumers finish the current one).
//   v5: the output staged in shared memory (a tile per consumer warpgroup, the 128-byte swizzle of
//      a TMA box) and written by TMA for fixed-length batches (tma_store), so a warpgroup starts its
//      next tile while the copy runs; varlen keeps the stores from registers. v4 + v5 measured on
//      the H100: d128 0.89-0.95x cuDNN unmasked, 0.76-0.90x causal (N = 1k unmasked 443 -> 531).
//
// The block (kThreads = 384: three warpgroups; __launch_bounds__(384, 1), one block per SM):
//   warpgroup 0, the producer: setmaxnreg.dec to 24 registers; one thread loads, per tile, Q (once
//     the consumers have released the previous tile's: q_empty) and then, for each key tile, K into
//     the K ring and V into the V ring (each full/empty barrier pairs; the rings run on across tiles).
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
//   Q (128 x D) | K ring: kStages x (128 x D) | V ring: kStages x (128 x D) | O staging (128 x D) |
//   barriers
// D = 128: 32 + 2 x 2 x 32 + 32 = 192 KiB (2 stages); D = 64: 16 + 2 x 3 x 16 + 16 = 128 KiB (3 stages).
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
// sequence's ragged end: keys >= len_k; causal / a window's right edge: keys past i + offset +
// window_right) come first and the rest run unmasked, but for the tiles a window's left edge
// (i + offset - window_left) crosses, at the end; tiles wholly outside every row's window are never
// loaded (key_tiles). Rows past len_q read zeros (TMA fills boxes outside the tensor with zeros) and are
// not written.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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
  static constexpr int kOOffset = kVOffset + kStages * kTileBytes;  // the output staging (TMA store)
  static constexpr int kOBoxBytes = 64 * 128;                         // 64 rows x 128 bytes
  static constexpr int kBarOffset = kOOffset + kConsumers * kBoxes * kOBoxBytes;
  static constexpr int kBarriers = 2 + 4 * kStages;       // q_full, q_empty, k_full, k_empty, v_full, v_empty
  static constexpr int kSmemBytes = kBarOffset + kBarriers * 8 + 1024;  // + slack to align to 1024
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // Ping-pong: the consumer warpgroups take turns issuing S = Q Kᵀ (named barriers kPingPongBarrier
  // + c), so that one's softmax runs while the other's GEMMs do, instead of both softmaxes falling
  // into step with the tensor cores idle. false: the warpgroups run freely (for an A/B).
  static constexpr bool kPingPong = true;
  static constexpr int kPingPongBarrier = 1;  // ids 1, 2 (0 is __syncthreads)
  static constexpr int kZeroBarrier = 3;      // the consumers, after zeroing a varlen tail (below)
  static constexpr int kStoreBarrier = 4;     // ids 4, 5: each consumer warpgroup's output staging
  // Intra-warpgroup overlap: the softmax of key tile n runs while the tensor cores do the PV
  // product of tile n + 1 (the previous one in visiting order); false: S, softmax, PV in turn.
  static constexpr bool kIntraOverlap = true;
  // Persistent: one block per SM walks the tiles longest first (tile_of) and loads the next tile's
  // Q while its consumers finish the last one (q_empty); false: one block per tile (for an A/B).
  static constexpr bool kPersistent = true;
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
  int len_q, len_k;    // fixed length: S_q, S_k; varlen: the longest (the grid's)
  int group;           // query heads per kv head
  int window_left;     // query i sees keys j >= i + offset - window_left (-1: unbounded)
  int window_right;    // ... and j <= i + offset + window_right (-1: unbounded; 0: causal)
  int top_left;        // the diagonal aligned top-left (offset 0) or bottom-right (S_k - S_q)
  float scale_log2;    // scale * log2(e)
  const int32_t* cu_seqlens_q;  // varlen (B + 1 device ints); null: fixed length
  const int32_t* cu_seqlens_k;
  int m_blocks, heads, batch;   // the work tiles: (m block, head, sequence)
  int chunk;                    // (head, sequence) pairs per L2 chunk of the persistent schedule (tile_of)
  int tma_store;                // out written by TMA from a staging tile (fixed length, out TMA-describable)
};

// The persistent schedule: tile t of m_blocks x heads x batch, each block taking tiles blockIdx.x,
// + gridDim.x, ... (static: the producer and the consumers walk the same list without talking).
// The (head, sequence) pairs go in chunks of `chunk` pairs whose K and V fit in L2 together (the
// query heads of one kv head adjacent); within a chunk the tiles go longest first (the m blocks from
// the last, which under a causal mask visit the most key tiles), all pairs of one m block before the
// next. So the ~SM-count tiles in flight share a few heads' K / V from L2, instead of every tile
// streaming its head's K / V from DRAM (all heads of one m block first: 0.55-0.9x of the
// one-block-per-tile grid on the H100, bench/results/h100/logs/issue18/v4). The chunk's size: the
// launcher's (run_forward).
struct FwdTile {
  int m_block, h, b;
};
__device__ __forceinline__ FwdTile tile_of(const FwdArgs& a, int t) {
  const int hb = a.heads * a.batch, per_chunk = a.chunk * a.m_blocks;
  const int c = t / per_chunk, r = t - c * per_chunk;
  const int first = c * a.chunk, size = hb - first < a.chunk ? hb - first : a.chunk;  // the last chunk may be short
  const int pair = first + r % size;
  return {a.m_blocks - 1 - r / size, pair % a.heads, pair / a.heads};
}

// One sequence of the call: where its rows start in the packed tensors (0 for fixed length, whose
// sequences are the tensor maps' batch coordinate instead), its lengths and its causal diagonal
// (query i sees keys j <= i + offset).
struct FwdSeq {
  int start_q, start_k, len_q, len_k, offset, batch_coord;
};
__device__ __forceinline__ FwdSeq sequence(const FwdArgs& a, int b) {
  FwdSeq q{0, 0, a.len_q, a.len_k, 0, b};
  if (a.cu_seqlens_q) {
    q.start_q = a.cu_seqlens_q[b], q.len_q = a.cu_seqlens_q[b + 1] - q.start_q;
    q.start_k = a.cu_seqlens_k[b], q.len_k = a.cu_seqlens_k[b + 1] - q.start_k;
    q.batch_coord = 0;  // one packed (D, total, H, 1) map
  }
  q.offset = a.top_left ? 0 : q.len_k - q.len_q;
  return q;
}

// The key tiles the block of query rows [m0, m0 + kBlockM) visits: [n_begin, n_end): those holding a
// key some row of the block sees (the window's right edge of the block's last row, its left edge of
// the first row; the rows past S_q count too: they are computed and not stored).
struct KeyTiles {
  int begin, end;
};
template <typename C>
__device__ __forceinline__ KeyTiles key_tiles(const FwdArgs& a, const FwdSeq& sq, int m0) {
  int n_end = (sq.len_k + C::kBlockN - 1) / C::kBlockN, n_begin = 0;
  if (a.window_right >= 0) {
    const int last_key = m0 + C::kBlockM - 1 + sq.offset + a.window_right;  // the last row's right edge
    const int n_diag = last_key < 0 ? 0 : last_key / C::kBlockN + 1;
    n_end = n_end < n_diag ? n_end : n_diag;
  }
  if (a.window_left >= 0) {
    const int first_key = m0 + sq.offset - a.window_left;  // the first row's left edge
    n_begin = first_key <= 0 ? 0 : first_key / C::kBlockN;
  }
  return {n_begin, n_end > n_begin ? n_end : n_begin};
}

// Whether key column col is outside row's window (or past the sequence's keys).
__device__ __forceinline__ bool key_hidden(const FwdArgs& a, const FwdSeq& sq, int row, int col) {
  return col >= sq.len_k || (a.window_right >= 0 && col > row + sq.offset + a.window_right) ||
         (a.window_left >= 0 && col < row + sq.offset - a.window_left);
}

// ---- kernel ----------------------------------------------------------------------------------
// Grid: min(tiles, SMs) persistent blocks (kPersistent) or one block per tile; block kThreads;
// dynamic shared memory kSmemBytes.
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(FwdConfig<kHeadDim>::kThreads, 1)
    forward_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                   const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_o,
                   const __grid_constant__ FwdArgs args) {
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
  uint64_t* q_empty = bars + 1;  // every S = Q K^T of a tile is done: the next tile's Q may land
  uint64_t* k_full = bars + 2;
  uint64_t* k_empty = k_full + C::kStages;
  uint64_t* v_full = k_empty + C::kStages;
  uint64_t* v_empty = v_full + C::kStages;

  const int warpgroup = threadIdx.x / 128;
  const int tiles = args.m_blocks * args.heads * args.batch;

  if (threadIdx.x == 0) {
    ptx::mbarrier_init(q_full, 1);
    ptx::mbarrier_init(q_empty, C::kReleases);
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
      kernels::RingCursor<C::kStages> ring;
      uint32_t q_phase = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const FwdTile w = tile_of(args, t);
        const FwdSeq sq = sequence(args, w.b);
        const int m0 = w.m_block * C::kBlockM;
        if (m0 >= sq.len_q) continue;  // varlen: past this sequence's end (the consumers skip it too)
        const KeyTiles kt = key_tiles<C>(args, sq, m0);
        const int h_kv = w.h / args.group;
        // A fresh empty barrier satisfies the opposite parity: the first waits pass.
        ptx::mbarrier_wait(q_empty, q_phase ^ 1);
        ptx::mbarrier_arrive_expect_tx(q_full, C::kTileBytes);
#pragma unroll
        for (int x = 0; x < C::kBoxes; ++x)
          ptx::tma_load_4d(q_tile + x * C::kBoxBytes, &map_q, q_full, x * C::kBoxCols, sq.start_q + m0, w.h,
                           sq.batch_coord);
        q_phase ^= 1;
        for (int n = kt.end - 1; n >= kt.begin; --n) {
          ptx::mbarrier_wait(&k_empty[ring.stage], ring.phase ^ 1);
          ptx::mbarrier_arrive_expect_tx(&k_full[ring.stage], C::kTileBytes);
#pragma unroll
          for (int x = 0; x < C::kBoxes; ++x)
            ptx::tma_load_4d(k_tile(ring.stage) + x * C::kBoxBytes, &map_k, &k_full[ring.stage], x * C::kBoxCols,
                             sq.start_k + n * C::kBlockN, h_kv, sq.batch_coord);
          ptx::mbarrier_wait(&v_empty[ring.stage], ring.phase ^ 1);
          ptx::mbarrier_arrive_expect_tx(&v_full[ring.stage], C::kTileBytes);
#pragma unroll
          for (int x = 0; x < C::kBoxes; ++x)
            ptx::tma_load_4d(v_tile(ring.stage) + x * C::kBoxBytes, &map_v, &v_full[ring.stage], x * C::kBoxCols,
                             sq.start_k + n * C::kBlockN, h_kv, sq.batch_coord);
          ring.advance();
        }
      }
    }
  } else {
    // ---- consumers ----
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    const int c = warpgroup - 1;                   // rows [64c, 64c + 64) of the Q tile
    const int tid = threadIdx.x % 128;
    const int warp = tid / 32, lane = tid % 32;
    const int col_in = 2 * (lane % 4);                    // + 8j + e: its columns of a tile
    const unsigned char* q_rows = q_tile + 64 * c * 128;  // 64 rows x 128 bytes into each box

    // The tile being computed (set at the top of each; the lambdas below read them).
    FwdSeq sq{};
    int m0 = 0, row0 = 0;          // row0: this thread's rows are row0, row0 + 8 (of the sequence)
    int n_begin = 0, n_end = 0;    // the key tiles the tile visits
    float o[kHeadDim / 2];            // O: 64 x D per warpgroup, accumulator layout
    float row_max[2], row_sum[2];     // log2 domain; this thread's partial sums
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
      // A tile needs the per-element test where it crosses S_k or an edge of some row's window: keys
      // past the first row's right edge, or before the last row's left edge.
      const bool masked = n0 + C::kBlockN > sq.len_k ||
                          (args.window_right >= 0 && n0 + C::kBlockN - 1 > m0 + sq.offset + args.window_right) ||
                          (args.window_left >= 0 && n0 < m0 + C::kBlockM - 1 + sq.offset - args.window_left);
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
              if (key_hidden(args, sq, row, col)) s[4 * j + 2 * hh + e] = -INFINITY;
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
    uint32_t q_phase = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
      const FwdTile w = tile_of(args, t);
      sq = sequence(args, w.b);
      m0 = w.m_block * C::kBlockM;
      if (m0 >= sq.len_q) continue;  // varlen: past this sequence's end (the producer skips it too)
      const KeyTiles kt = key_tiles<C>(args, sq, m0);
      n_begin = kt.begin, n_end = kt.end;
      row0 = m0 + 64 * c + 16 * warp + lane / 4;
      const int h = w.h, b = w.b;
#pragma unroll
      for (int i = 0; i < kHeadDim / 2; ++i) o[i] = 0.f;
      row_max[0] = row_max[1] = -INFINITY;
      row_sum[0] = row_sum[1] = 0.f;
      ptx::mbarrier_wait(q_full, q_phase);
      q_phase ^= 1;

      // Varlen: the last key tile of a sequence (the first visited) may run into the next sequence's
      // rows, which TMA loads like any others. Their scores are masked (selected to -inf), but P = 0
      // times a NaN or Inf of their V would still reach O: the consumers zero those V rows (each a
      // whole 128-byte row of every box: the swizzle permutes 16-byte chunks within a row) before any
      // PV reads them, then order the writes before the tensor cores' reads (proxy fence) and wait for
      // each other. Fixed-length batches need none of it: past S_k the map's bounds zero-fill.
      if (args.cu_seqlens_q && n_end > n_begin && sq.len_k - (n_end - 1) * C::kBlockN < C::kBlockN) {
        const int valid = sq.len_k - (n_end - 1) * C::kBlockN;  // rows of the tile in the sequence
        const int rows = C::kBlockN - valid, chunks = rows * 8;  // 16-byte chunks per box
        ptx::mbarrier_wait(&v_full[ring.stage], ring.phase);     // the first tile visited: the ring's next
        unsigned char* vt = v_tile(ring.stage);
        for (int i = threadIdx.x - 128; i < chunks * C::kBoxes; i += 128 * C::kConsumers) {
          const int box = i / chunks, r = (i % chunks) / 8, chunk = i % 8;
          *reinterpret_cast<uint4*>(vt + box * C::kBoxBytes + (valid + r) * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
        }
        ptx::fence_proxy_async_shared();
        ptx::named_barrier_sync(C::kZeroBarrier, 128 * C::kConsumers);
      }
      if constexpr (C::kIntraOverlap) {
        // Two tiles in flight per warpgroup: while the tensor cores run S_n = Q K_nᵀ and O += P_{n+1}
        // V_{n+1}, this warpgroup's threads wait only for S_n and compute its softmax; O is rescaled
        // once the PV group is done. The first tile's S comes alone; the last PV alone.
        float s[C::kBlockN / 2];
        uint32_t pa[C::kBlockN / 16][4];
        float alpha[2];
        if (n_end > n_begin) {
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
        for (int n = n_end - 2; n >= n_begin; --n) {
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
        if (lane == 0) ptx::mbarrier_arrive(q_empty);  // every S of the tile is done: Q may be replaced
        if (n_end > n_begin) {
          ptx::mbarrier_wait(&v_full[ring.stage], ring.phase);
          issue_pv(pa, ring.stage);
          ptx::wgmma_wait<0>();
          ptx::wgmma_hold(o);
          ptx::wgmma_hold(pa);
          if (lane == 0) ptx::mbarrier_arrive(&v_empty[ring.stage]);
          ring.advance();
        }
      } else {
        for (int n = n_end - 1; n >= n_begin; --n) {
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
        if (lane == 0) ptx::mbarrier_arrive(q_empty);
      }

      // Epilogue: l over the row's 4 lanes, O / l, lse. Fixed length with a TMA-describable out
      // (args.tma_store): O goes through this warpgroup's staging tile in shared memory (the 128-byte
      // swizzle a TMA box has) and one thread stores it by TMA, which clips the rows past S_q; the
      // warpgroup goes on to the next tile while the copy runs (the staging is reused only once the
      // previous store has read it). Otherwise (varlen: a tile's last rows are the next sequence's)
      // rows < len_q are stored from registers.
      unsigned char* stage = smem + C::kOOffset + c * C::kBoxes * C::kOBoxBytes;
      if (args.tma_store) {
        if (tid == 0) ptx::bulk_wait_group_read<0>();  // this thread issued the previous store
        ptx::named_barrier_sync(C::kStoreBarrier + c, 128);
      }
      T* out = static_cast<T*>(args.out) + b * args.out_batch + sq.start_q * args.out_row + h * args.out_head;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float l = row_sum[hh];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const bool empty = l == 0.f;  // no visible key (a NaN l is not empty: it propagates, as in flash2)
        const float inv = empty ? 0.f : 1.f / l;
        const int row = row0 + 8 * hh;
        if (args.tma_store) {
          const int r = 16 * warp + lane / 4 + 8 * hh;  // row of the warpgroup's 64
#pragma unroll
          for (int j = 0; j < kHeadDim / 8; ++j) {
            const uint32_t v = kernels::pack2<T>(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
            *reinterpret_cast<uint32_t*>(stage + (j / 8) * C::kOBoxBytes + r * 128 + (((j % 8) ^ (r % 8)) * 16) +
                                         col_in * 2) = v;
          }
        } else if (row < sq.len_q) {
          T* out_row = out + static_cast<int64_t>(row) * args.out_row;
#pragma unroll
          for (int j = 0; j < kHeadDim / 8; ++j) {
            const uint32_t v = kernels::pack2<T>(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
            *reinterpret_cast<uint32_t*>(out_row + 8 * j + col_in) = v;
          }
        }
        if (row < sq.len_q && args.lse && lane % 4 == 0)
          args.lse[b * args.lse_batch + h * args.lse_head + sq.start_q + row] =
              empty ? -INFINITY : (row_max[hh] + kernels::log2_approx(l)) * 0.69314718055994531f;
      }
      if (args.tma_store) {
        ptx::fence_proxy_async_shared();
        ptx::named_barrier_sync(C::kStoreBarrier + c, 128);
        if (tid == 0) {
#pragma unroll
          for (int x = 0; x < C::kBoxes; ++x)
            ptx::tma_store_4d(&map_o, stage + x * C::kOBoxBytes, x * C::kBoxCols, m0 + 64 * c, h, b);
          ptx::bulk_commit_group();
        }
      }
    }
    if (args.tma_store && tid == 0) ptx::bulk_wait_group<0>();  // the staging stays until the stores are done
  }
}

// Launches the forward for validated params (head dim kHeadDim exactly, no softcap / ALiBi / mask),
// the maps made by the launcher (hopper.cu).
template <typename T, int kHeadDim>
cudaError_t launch_forward(const CUtensorMap& map_q, const CUtensorMap& map_k, const CUtensorMap& map_v,
                           const CUtensorMap& map_o, const FwdArgs& args, cudaStream_t stream) {
  using C = FwdConfig<kHeadDim>;
  auto kernel = forward_kernel<T, kHeadDim>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t tiles = static_cast<int64_t>(args.m_blocks) * args.heads * args.batch;
  int64_t blocks = tiles;  // one tile each when not persistent
  if constexpr (C::kPersistent) {
    int device = 0, sms = 0;
    err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    blocks = tiles < sms ? tiles : sms;  // one block per SM (the shared memory takes it whole)
  }
  kernel<<<static_cast<unsigned>(blocks), C::kThreads, C::kSmemBytes, stream>>>(map_q, map_k, map_v, map_o, args);
  return cudaGetLastError();
}

// The host side for one (dtype, head dim): Q, K, V as 4-D tensor maps (D, S, H, B) with boxes of
// 64 columns x 128 rows, the scalars, the launch. cudaErrorInvalidValue for what the rung does not
// run (the API refuses it first, with a message).
template <typename T, int kHeadDim>
cudaError_t run_forward(const AttentionParams& p, cudaStream_t stream) {
  using C = FwdConfig<kHeadDim>;
  if (p.backward || p.head_dim != kHeadDim || p.softcap > 0 || p.alibi || p.mask) return cudaErrorInvalidValue;
  // Fixed length: (D, S, H, B) maps, the sequence is the batch coordinate. Varlen: one packed
  // (D, total, H, 1) map, the sequence's rows found from cu_seqlens on the device.
  const bool varlen = p.varlen();
  auto map_of = [&](CUtensorMap* map, const void* data, const AttentionStrides& st, int64_t rows, int64_t heads) {
    const TmaTensor4 t = varlen ? TmaTensor4{data, {p.head_dim, rows, heads, 1}, {st.row, st.head, 0}, 2}
                                : TmaTensor4{data, {p.head_dim, rows, heads, p.batch}, {st.row, st.head, st.batch}, 2};
    if (!tma_rejects(t, "").empty()) return cudaErrorInvalidValue;
    return make_tma_map_sw128(map, t, C::kBoxCols, C::kBlockN);
  };
  CUtensorMap map_q, map_k, map_v;
  if (p.batch <= 0 || p.seqlen_q <= 0 || p.heads_q <= 0 || (varlen && p.total_q == 0)) return cudaSuccess;  // no row
  cudaError_t err = map_of(&map_q, p.q, p.q_s, varlen ? p.total_q : p.seqlen_q, p.heads_q);
  if (err != cudaSuccess) return err;
  if (p.seqlen_k == 0 || (varlen && p.total_k == 0)) {
    map_k = map_v = map_q;  // no key tile is ever loaded (out 0, lse -inf); k and v may be null
  } else {
    const int64_t rows_k = varlen ? p.total_k : p.seqlen_k;
    err = map_of(&map_k, p.k, p.k_s, rows_k, p.heads_kv);
    if (err == cudaSuccess) err = map_of(&map_v, p.v, p.v_s, rows_k, p.heads_kv);
    if (err != cudaSuccess) return err;
  }
  FwdArgs a{};
  a.out = p.out;
  a.out_batch = p.out_s.batch, a.out_row = p.out_s.row, a.out_head = p.out_s.head;
  a.lse = static_cast<float*>(p.lse);
  a.lse_batch = p.lse_batch, a.lse_head = p.lse_head;
  a.len_q = static_cast<int>(p.seqlen_q), a.len_k = static_cast<int>(p.seqlen_k);
  a.group = static_cast<int>(p.group());
  a.window_left = static_cast<int>(p.window_left < 0 ? -1 : p.window_left);
  a.window_right = static_cast<int>(p.window_right < 0 ? -1 : p.window_right);
  a.top_left = p.top_left ? 1 : 0;
  a.cu_seqlens_q = p.cu_seqlens_q, a.cu_seqlens_k = p.cu_seqlens_k;
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  a.m_blocks = static_cast<int>((p.seqlen_q + C::kBlockM - 1) / C::kBlockM);
  a.heads = static_cast<int>(p.heads_q), a.batch = static_cast<int>(p.batch);
  if (static_cast<int64_t>(a.m_blocks) * a.heads * a.batch > INT32_MAX) return cudaErrorInvalidValue;
  // Pairs per L2 chunk: their K and V (S_k x D x 2 tensors x 2 bytes per kv head, shared by `group`
  // query heads) within a budget, whole kv groups. Tiles of one length (no mask, fixed length):
  // 8 MiB, about one wave of tiles (the SM-count tiles in flight share them). Tiles of many lengths
  // (causal, windows, varlen): 32 MiB, so that longest first runs over more of the work -- with a
  // chunk about one wave long, the static stride hands each block the same place in every chunk,
  // the longest tiles to the same blocks. H100, d128 (bench/results/h100/logs/issue18/v4): 8 MiB
  // gave 539 / 578 TFLOP/s unmasked at N = 1k / 16k (32 MiB: 463 / 559) but 263 / 393 causal (32 MiB:
  // 350 / 499).
  {
    const bool uneven = a.window_left >= 0 || a.window_right >= 0 || varlen;
    const int64_t budget = (uneven ? int64_t{32} : int64_t{8}) << 20;
    const int64_t kv_bytes = std::max<int64_t>(1, p.seqlen_k) * kHeadDim * 2 * 2;
    const int64_t kv_heads = std::max<int64_t>(1, budget / kv_bytes);
    a.chunk = static_cast<int>(std::min<int64_t>(kv_heads * a.group, static_cast<int64_t>(a.heads) * a.batch));
  }
  // The output by TMA (boxes of 64 columns x 64 rows: one consumer warpgroup's rows) where its rows
  // are 16-byte aligned and the batch is fixed-length; else from registers.
  CUtensorMap map_o = map_q;
  a.tma_store = 0;
  if (!varlen) {
    const TmaTensor4 o{p.out, {p.head_dim, p.seqlen_q, p.heads_q, p.batch}, {p.out_s.row, p.out_s.head, p.out_s.batch}, 2};
    if (tma_rejects(o, "").empty() && make_tma_map_sw128(&map_o, o, C::kBoxCols, 64) == cudaSuccess) a.tma_store = 1;
  }
  return launch_forward<T, kHeadDim>(map_q, map_k, map_v, map_o, a, stream);
}

}  // namespace optimized::cuda::hopper
