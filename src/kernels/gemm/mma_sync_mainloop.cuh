// The mma.sync mainloop: a block computes a kBM x kBN tile of A @ B in fp32 accumulators with
// mma.sync.m16n8k16, fed by ldmatrix from an XOR-swizzled, kStages-deep shared-memory ring that
// cp.async fills. It knows nothing of the op around it: the caller (a rung's kernel) picks the tile
// (a scheduler), hands A and B of its batch, and passes the accumulators to an epilogue.
//
// Shared-memory layout of a stage (both operands row-major, 16-byte chunks, tile/swizzle.cuh):
//   A: [kBM rows (m)][kBK k]  = 128 B per row (kBK = 64);   chunk' = chunk ^ (row & 7)
//   B: [kBK rows (k)][kBN n]  = 2 kBN B per row;            chunk' = chunk ^ (row & 7)
// An 8x8 ldmatrix matrix reads 8 consecutive rows at one logical chunk: after the XOR they sit in 8
// distinct 16-byte bank groups, so every ldmatrix phase is one conflict-free wavefront. A cp.async
// group of 8 threads writes one row's 8 consecutive chunks: again 8 distinct groups.
//
// Warps: kWarpsM x kWarpsN, each a (kBM / kWarpsM) x (kBN / kWarpsN) warp tile = kMT x kNT mma
// tiles of 16x8; per lane kMT * kNT * 4 fp32 accumulators, laid out as the mma C fragment
// (ptx/mma_sync.cuh). ldmatrix.x4 per k-step of 16:
//   A: lane l addresses row (l % 16), k chunk (l / 16)  -> registers a0, a1, a2, a3.
//   B: lane l addresses k row (l % 16), n chunk 2p + (l / 16), with .trans -> b0, b1 of n-tile
//      2p and b0, b1 of n-tile 2p+1 (B is row-major K x N in smem, the mma wants it "col").
//
// Two load paths, one layout: kAligned (16-byte aligned bases, lda and ldb multiples of 8
// elements) fills the ring with cp.async.cg 16-byte copies, and the partial or empty chunks at
// the M, N and K edges with predicated element loads plus st.shared of the chunk (zeros beyond
// the edge); otherwise every chunk takes that element path (correct for any lda/ldb/alignment).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/ldmatrix.cuh"
#include "kernels/ptx/mma_sync.cuh"
#include "kernels/ptx/smem.cuh"
#include "kernels/tile/smem_ring.cuh"
#include "kernels/tile/swizzle.cuh"

namespace optimized::kernels {

// The block tile of the mainloop and what follows from it. 16-bit operands.
template <int kBM_, int kBN_, int kBK_, int kStages_, int kWarpsM_, int kWarpsN_>
struct MmaSyncTile {
  static constexpr int kBM = kBM_;  // rows of C per block
  static constexpr int kBN = kBN_;  // columns of C per block
  static constexpr int kBK = kBK_;  // depth of one k-tile (one stage of the ring)
  static constexpr int kStages = kStages_;
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;

  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kWM = kBM / kWarpsM;                 // warp tile rows
  static constexpr int kWN = kBN / kWarpsN;                 // warp tile columns
  static constexpr int kMT = kWM / 16;                      // mma tiles along M per warp
  static constexpr int kNT = kWN / 8;                       // mma tiles along N per warp
  static constexpr int kKSteps = kBK / 16;                  // mma k-steps per k-tile
  static constexpr int kARowBytes = kBK * 2;
  static constexpr int kBRowBytes = kBN * 2;
  static constexpr int kATileBytes = kBM * kARowBytes;
  static constexpr int kBTileBytes = kBK * kBRowBytes;
  static constexpr int kStageBytes = kATileBytes + kBTileBytes;
  static constexpr int kAChunksPerThread = kBM * kBK / 8 / kThreads;
  static constexpr int kBChunksPerThread = kBK * kBN / 8 / kThreads;
  static constexpr int kSmemBytes = kStages * kStageBytes;  // the ring

  static_assert(kARowBytes == 128, "the A swizzle assumes one 128-byte line per row");
  static_assert(kBN % 64 == 0, "the B swizzle permutes chunks inside 128-byte lines");
  static_assert(kMT * 16 == kWM && kNT * 8 == kWN && kNT % 2 == 0, "warp tile");
  static_assert(kBM * kBK / 8 % kThreads == 0 && kBK * kBN / 8 % kThreads == 0, "loader");
  static_assert(kBK / 8 == 8 && kBN / 8 == 32, "loader: 8 threads per A row, a warp per B row");
  static_assert(kThreads / 8 % 8 == 0, "A loader rows advance by multiples of 8");
  static_assert(kThreads / 32 % 8 == 0, "B loader rows advance by multiples of 8");
  static_assert(kKSteps % 2 == 0 && kKSteps >= 3, "fragment double buffer / load slots");
};

// Fills one stage of the ring with k-tile kt. Each thread owns kAChunksPerThread 16-byte chunks
// of the A tile (rows ar + 32 i, chunk ac: 8 consecutive threads fill one 128-byte row) and
// kBChunksPerThread of the B tile (k rows br + 8 i, chunk bc: 32 threads fill one 512-byte row).
//
// Two ways to fill a stage:
//  * fast (kAligned, the block lies inside M and N, and the k-tile lies inside K): running
//    byte pointers plus a 32-bit stride per chunk, no bounds checks -- a handful of integer ops
//    per tile, so the copies hide inside the mma stream (this is nearly every tile of a large
//    product; recomputing 64-bit addresses and predicates per chunk cost ~250 instructions per
//    tile against 128 mma per warp and measurably starved the tensor pipe);
//  * general (any tile): row, column and K checks per chunk; whole chunks by cp.async
//    (kAligned), the rest element by element through registers, zeros outside the matrix.
//
// Problem: anything with m, n, k, lda, ldb (elements; row-major A (m, k), B (k, n)).
template <typename T, class Tile, bool kAligned>
struct MmaSyncTileLoader {
  using C = Tile;
  static constexpr int kARowStride = C::kThreads / 8;   // rows between a thread's A chunks
  static constexpr int kBRowStride = C::kThreads / 32;  // rows between a thread's B chunks

  const char* a_cur;  // byte address of this thread's A chunk 0 in the next tile (fast path)
  const char* b_cur;  // byte address of this thread's B chunk 0 in the next tile (fast path)
  uint32_t a_step;    // bytes between this thread's A chunks
  uint32_t b_step;    // bytes between this thread's B chunks
  int fast_tiles;     // k-tiles [0, fast_tiles) take the fast path

  // fast_ok: the launcher checked that the per-chunk byte strides fit 32 bits.
  template <class Problem>
  __device__ __forceinline__ void init(const Problem& p, bool fast_ok, const T* a, const T* b, int64_t m0,
                                       int64_t n0, int tid) {
    const int ar = tid >> 3, ac = tid & 7, br = tid >> 5, bc = tid & 31;
    const bool inside = m0 + C::kBM <= p.m && n0 + C::kBN <= p.n;
    fast_tiles = kAligned && fast_ok && inside ? static_cast<int>(p.k / C::kBK) : 0;
    a_step = static_cast<uint32_t>(kARowStride * p.lda * 2);
    b_step = static_cast<uint32_t>(kBRowStride * p.ldb * 2);
    const int64_t gm = m0 + ar < p.m ? m0 + ar : p.m - 1;   // clamped: only used when inside
    const int64_t gn = n0 + bc * 8 < p.n ? n0 + bc * 8 : 0;
    const int64_t gk = br < p.k ? br : 0;
    a_cur = reinterpret_cast<const char*>(a + gm * p.lda + ac * 8);
    b_cur = reinterpret_cast<const char*>(b + gk * p.ldb + gn);
  }

  static __device__ __forceinline__ uint32_t a_dst(int tid) {
    return swizzled_offset<C::kARowBytes>(tid >> 3, tid & 7);
  }
  static __device__ __forceinline__ uint32_t b_dst(int tid) {
    return C::kATileBytes + swizzled_offset<C::kBRowBytes>(tid >> 5, tid & 31);
  }

  // 8 elements (zero beyond `valid`) into the 16-byte slot at byte offset `dst` of the stage.
  // Whole chunks of the aligned kernel go by cp.async; partial and empty chunks (the M, N and K
  // edges only) and every chunk of the unaligned kernel are loaded element by element with
  // bounds checks and stored with st.shared. (The cp.async src-size zero-fill form would do the
  // edges too, but compute-sanitizer counts its full 16-byte source as accessed and reports the
  // tail of an allocation as out of bounds; a plain store of the zeros costs nothing here.)
  static __device__ __forceinline__ void copy_chunk(uint32_t stage_addr, unsigned char* stage_ptr,
                                                    uint32_t dst, const T* src, int valid) {
    if constexpr (kAligned) {
      if (valid == 8) {
        ptx::cp_async_16(stage_addr + dst, src);
        return;
      }
    }
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint16_t v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = e < valid ? s[e] : uint16_t(0);
    uint4 pk;
    pk.x = v[0] | (uint32_t(v[1]) << 16);
    pk.y = v[2] | (uint32_t(v[3]) << 16);
    pk.z = v[4] | (uint32_t(v[5]) << 16);
    pk.w = v[6] | (uint32_t(v[7]) << 16);
    *reinterpret_cast<uint4*>(stage_ptr + dst) = pk;
  }

  template <class Problem>
  __device__ __forceinline__ void load_a(const Problem& p, const T* a, int64_t m0, int kt, int tid,
                                         uint32_t stage_addr, unsigned char* stage_ptr) {
    const uint32_t dst = a_dst(tid);
    if (kAligned && kt < fast_tiles) {
#pragma unroll
      for (int i = 0; i < C::kAChunksPerThread; ++i)
        ptx::cp_async_16(stage_addr + dst + i * kARowStride * C::kARowBytes, a_cur + uint64_t(a_step) * i);
    } else {
      const int ar = tid >> 3, ac = tid & 7;
      const int64_t gk = int64_t(kt) * C::kBK + ac * 8;
      const int kvalid = gk < p.k ? static_cast<int>(p.k - gk < 8 ? p.k - gk : 8) : 0;
#pragma unroll
      for (int i = 0; i < C::kAChunksPerThread; ++i) {
        const int64_t gm = m0 + ar + i * kARowStride;
        const int valid = gm < p.m ? kvalid : 0;
        copy_chunk(stage_addr, stage_ptr, dst + i * kARowStride * C::kARowBytes,
                   valid > 0 ? a + gm * p.lda + gk : a, valid);
      }
    }
    a_cur += C::kBK * 2;
  }

  // B chunks [i0, i1) of k-tile kt; the last part advances to the next tile.
  template <int i0, int i1, class Problem>
  __device__ __forceinline__ void load_b(const Problem& p, const T* b, int64_t n0, int kt, int tid,
                                         uint32_t stage_addr, unsigned char* stage_ptr) {
    const uint32_t dst = b_dst(tid);
    if (kAligned && kt < fast_tiles) {
#pragma unroll
      for (int i = i0; i < i1; ++i)
        ptx::cp_async_16(stage_addr + dst + i * kBRowStride * C::kBRowBytes, b_cur + uint64_t(b_step) * i);
    } else {
      const int br = tid >> 5, bc = tid & 31;
      const int64_t gn = n0 + bc * 8;
      const int nvalid = gn < p.n ? static_cast<int>(p.n - gn < 8 ? p.n - gn : 8) : 0;
#pragma unroll
      for (int i = i0; i < i1; ++i) {
        const int64_t gk = int64_t(kt) * C::kBK + br + i * kBRowStride;
        const int valid = gk < p.k ? nvalid : 0;
        copy_chunk(stage_addr, stage_ptr, dst + i * kBRowStride * C::kBRowBytes,
                   valid > 0 ? b + gk * p.ldb + gn : b, valid);
      }
    }
    if (i1 == C::kBChunksPerThread) b_cur += int64_t(C::kBK) * p.ldb * 2;
  }
};

// acc (zeroed here) = the block's tile of A @ B: rows [m0, m0 + kBM) of A, columns [n0, n0 + kBN)
// of B, all of K. smem: Tile::kSmemBytes of dynamic shared memory, 128-byte aligned. Returns with
// every copy landed and every warp past the ring: the caller may reuse the shared memory at once.
template <typename T, class Tile, bool kAligned, class Problem>
__device__ __forceinline__ void mma_sync_mainloop(float (&acc)[Tile::kMT][Tile::kNT][4], const Problem& p,
                                                  bool fast_ok, const T* a, const T* b, int64_t m0, int64_t n0,
                                                  unsigned char* smem) {
  using C = Tile;
  const uint32_t smem_base = ptx::smem_u32(smem);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / C::kWarpsN;
  const int wn = warp % C::kWarpsN;
  const int ktiles = static_cast<int>((p.k + C::kBK - 1) / C::kBK);

  MmaSyncTileLoader<T, Tile, kAligned> loader;
  loader.init(p, fast_ok, a, b, m0, n0, tid);

#pragma unroll
  for (int i = 0; i < C::kMT; ++i)
#pragma unroll
    for (int j = 0; j < C::kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // Per-lane ldmatrix offsets (see the header). x = lane & 7 is the row's swizzle key, h = lane >> 4
  // the chunk half; since chunk = 2s + h with 2s even, swizzle128(chunk, row) = 2s ^ (h ^ x).
  const int lane_xor = (lane >> 4) ^ (lane & 7);
  const uint32_t a_lane = (wm * C::kWM + (lane & 15)) * C::kARowBytes;
  const uint32_t b_lane = C::kATileBytes + (lane & 15) * C::kBRowBytes + wn * (C::kWN / 8) * 16;

  // Prologue: tiles 0 .. kStages-2. Every step commits a group (empty ones too) so that
  // wait_group<kStages-2> always means "the next tile to be read has landed".
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < ktiles) {
      const uint32_t off = s * C::kStageBytes;
      loader.load_a(p, a, m0, s, tid, smem_base + off, smem + off);
      loader.template load_b<0, C::kBChunksPerThread>(p, b, n0, s, tid, smem_base + off, smem + off);
    }
    ptx::cp_async_commit();
  }
  ptx::cp_async_wait<C::kStages - 2>();
  __syncthreads();

  uint32_t af[2][C::kMT][4];
  uint32_t bf[2][C::kNT][2];
  auto load_frags = [&](int buf, uint32_t stage_addr, int ks) {
#pragma unroll
    for (int mi = 0; mi < C::kMT; ++mi)
      ptx::ldmatrix_x4(af[buf][mi], stage_addr + a_lane + mi * 16 * C::kARowBytes + (((2 * ks) ^ lane_xor) << 4));
#pragma unroll
    for (int q = 0; q < C::kNT / 2; ++q)
      ptx::ldmatrix_x4_trans(bf[buf][2 * q][0], bf[buf][2 * q][1], bf[buf][2 * q + 1][0], bf[buf][2 * q + 1][1],
                             stage_addr + b_lane + ks * 16 * C::kBRowBytes + (((2 * q) ^ lane_xor) << 4));
  };

  int read_stage = 0;                 // the ring's stage the fragments come from
  int write_stage = C::kStages - 1;   // the ring's stage the copies go to
  load_frags(0, smem_base, 0);

  // Main loop, CUTLASS-multistage order: the fragments of k-step ks+1 are loaded before the mma
  // of k-step ks; the copies of tile kt + kStages - 1 are spread over the first k-steps; at the
  // last k-step the block waits for tile kt+1 and loads its first fragments while the last
  // mma of tile kt are still in the tensor pipe.
  for (int kt = 0; kt < ktiles; ++kt) {
    const bool issue = kt + C::kStages - 1 < ktiles;
    const uint32_t woff = write_stage * C::kStageBytes;
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      if (ks == C::kKSteps - 1) {
        // Tile kt+1 has landed (for this thread), and after the barrier for every thread; it
        // also tells the next iteration that every warp is done with the stage it will refill.
        ptx::cp_async_wait<C::kStages - 2>();
        __syncthreads();
        read_stage = ring_next<C::kStages>(read_stage);
      }
      load_frags((ks + 1) & 1, smem_base + read_stage * C::kStageBytes, (ks + 1) % C::kKSteps);

      if (ks == 0 && issue) loader.load_a(p, a, m0, kt + C::kStages - 1, tid, smem_base + woff, smem + woff);
      if (ks == 1 && issue)
        loader.template load_b<0, C::kBChunksPerThread / 2>(p, b, n0, kt + C::kStages - 1, tid, smem_base + woff,
                                                            smem + woff);
      if (ks == 2) {
        if (issue)
          loader.template load_b<C::kBChunksPerThread / 2, C::kBChunksPerThread>(p, b, n0, kt + C::kStages - 1, tid,
                                                                                 smem_base + woff, smem + woff);
        ptx::cp_async_commit();
        write_stage = ring_next<C::kStages>(write_stage);
      }

#pragma unroll
      for (int mi = 0; mi < C::kMT; ++mi)
#pragma unroll
        for (int ni = 0; ni < C::kNT; ++ni) {
          // Serpentine over ni so consecutive mma reuse the B fragment in hand.
          const int nj = (mi & 1) ? C::kNT - 1 - ni : ni;
          ptx::MmaSync16816<T>::run(acc[mi][nj], af[ks & 1][mi], bf[ks & 1][nj]);
        }
    }
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // every warp is done reading the ring
}

}  // namespace optimized::kernels
