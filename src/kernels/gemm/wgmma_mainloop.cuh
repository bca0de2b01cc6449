// The Hopper GEMM mainloop pieces (sm_90a): a ring of shared-memory stages that TMA fills and
// mbarriers guard, and the wgmma k-block that consumes one stage. The GEMM rungs (wgmma_tma,
// wgmma_ws, wgmma_persistent) compose these with a scheduler and an epilogue; linear, grouped
// (MoE) GEMM and attention reuse them.
//
// One stage holds the k-block [k0, k0 + 64) of the block tile, in the layout the operand has in
// global memory (TMA copies boxes as they are stored; wgmma reads either layout of 16-bit
// operands, told by its transpose immediates):
//   A row-major (kTransA false): kBM rows x 64 K, K-major (a row of A per M index, 128 bytes,
//      128-byte swizzle): one TMA box (64 K x kBM rows).
//   A column-major (kTransA true, stored (K, M)): 64 K rows x kBM, MN-major (M contiguous):
//      kBM / 64 boxes of (64 M x 64 K), 8 KiB each, one after the other.
//   B row-major (kTransB false): 64 K rows x kBN, MN-major (N contiguous): kBN / 64 boxes of
//      (64 N x 64 K), 8 KiB each.
//   B column-major (kTransB true, stored (N, K)): kBN rows x 64 K, K-major: kBN / 64 boxes of
//      (64 K x 64 N rows), 8 KiB each.
// Either way a stage has the same bytes, the 64 rows of A a consumer warpgroup multiplies start
// 64 * 128 bytes apart (one box), and B comes in kBN / 64 boxes (what the cluster multicast
// splits). 64 16-bit elements per k-block or per 64 columns make each row exactly one 128-byte
// swizzle row (the widest TMA swizzle), which keeps shared-memory reads of wgmma conflict-free.
//
// Barriers: full[s] completes when the producer's arrive (with the stage's byte count) and the
// TMA bytes have all landed; empty[s] completes when every consumer warp has released the stage.
// The k-th use of a slot waits on full parity (k & 1); the producer waits on empty with the
// opposite parity, which a fresh barrier already satisfies (its "previous phase" is complete).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/ptx/mbarrier.cuh"
#include "kernels/ptx/tma.cuh"
#include "kernels/ptx/wgmma.cuh"

namespace optimized::kernels {

// kExtraBytes: room after the ring (1024-aligned, e.g. an epilogue's staging buffers).
// kTransA / kTransB: the operands' layouts in global memory (GemmParams' trans_a / trans_b).
// kElemBytes: 2 for 16-bit operands (k-blocks of 64), 1 for fp8 (k-blocks of 128, both operands
// K-major: A row-major, B column-major); a stage row is 128 bytes either way.
template <int kBM_, int kBN_, int kStages_, int kExtraBytes_ = 0, bool kTransA_ = false, bool kTransB_ = false,
          int kElemBytes_ = 2>
struct WgmmaTile {
  static constexpr int kElemBytes = kElemBytes_;
  static constexpr int kBM = kBM_, kBN = kBN_, kBK = 128 / kElemBytes, kStages = kStages_, kExtraBytes = kExtraBytes_;
  static constexpr bool kTransA = kTransA_, kTransB = kTransB_;
  static_assert(kElemBytes == 2 || (kElemBytes == 1 && !kTransA && kTransB), "8-bit operands are K-major only");
  static_assert(kExtraBytes % 1024 == 0, "the extra region keeps 1024-byte alignment");
  static_assert(kBM % 64 == 0 && kBN % 64 == 0 && kBN <= 256, "wgmma tiles: M in 64s, N in 64s up to 256");
  static constexpr int kBoxBytes = 64 * 128;           // one (64 x 64) box of 16-bit elements
  static constexpr int kABytes = kBM * 128;            // kBM rows of 128 bytes, or kBM / 64 boxes
  static constexpr int kBBytes = (kBN / 64) * kBoxBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kRingBytes = kStages * kStageBytes;
  // Ring, extra region, then the 2 * kStages barriers; 1024 bytes of slack to align the ring
  // (128-byte swizzle).
  static constexpr int kSmemBytes = kRingBytes + kExtraBytes + 2 * kStages * 8 + 1024;
};

// The ring in a block's dynamic shared memory.
template <typename Tile>
struct WgmmaRing {
  unsigned char* base;  // 1024-byte aligned
  uint64_t* full;
  uint64_t* empty;

  __device__ __forceinline__ static WgmmaRing carve(unsigned char* smem) {
    unsigned char* base = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem) + 1023) & ~uintptr_t(1023));
    uint64_t* bars = reinterpret_cast<uint64_t*>(base + Tile::kRingBytes + Tile::kExtraBytes);
    return {base, bars, bars + Tile::kStages};
  }
  __device__ __forceinline__ unsigned char* a(int s) const { return base + s * Tile::kStageBytes; }
  __device__ __forceinline__ unsigned char* b(int s) const { return base + s * Tile::kStageBytes + Tile::kABytes; }
  __device__ __forceinline__ unsigned char* extra() const { return base + Tile::kRingBytes; }

  // One thread, before any use; `consumer_arrivals` releases make a stage empty.
  __device__ __forceinline__ void init(uint32_t consumer_arrivals) const {
    for (int s = 0; s < Tile::kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], consumer_arrivals);
    }
    ptx::fence_barrier_init();
  }
};

// Where the ring is: stage index and the parity of its current use.
template <int kStages>
struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The producer's part (one thread): the k-block at k0 of the tile at (m0, n0) in batch za / zb of
// A / B (3-D tensor maps of the stored matrices: inner, outer, batch; boxes of 128-byte rows: A's
// kBM rows when row-major, 64 otherwise; B's 64) into stage s, counted on full[s].
// kCluster > 1: the blocks of a cluster hold tiles of the same columns (n0) and share B: this
// block loads its A and every kCluster-th box of B, multicast to all of them, so each brings
// 1 / kCluster of B from L2; every block's full[s] still expects the whole stage.
template <typename Tile, int kCluster = 1>
__device__ __forceinline__ void wgmma_load_kblock(const WgmmaRing<Tile>& ring, int s, const CUtensorMap* map_a,
                                                  const CUtensorMap* map_b, int m0, int n0, int k0, int za, int zb,
                                                  int cluster_rank = 0) {
  ptx::mbarrier_arrive_expect_tx(&ring.full[s], Tile::kStageBytes);
  if constexpr (!Tile::kTransA) {
    ptx::tma_load_3d(ring.a(s), map_a, &ring.full[s], k0, m0, za);
  } else {
#pragma unroll
    for (int j = 0; j < Tile::kBM / 64; ++j)
      ptx::tma_load_3d(ring.a(s) + j * Tile::kBoxBytes, map_a, &ring.full[s], m0 + 64 * j, k0, za);
  }
#pragma unroll
  for (int j = 0; j < Tile::kBN / 64; ++j) {
    // Box j: columns [n0 + 64j, n0 + 64j + 64) of B, whichever way B is stored.
    const int inner = Tile::kTransB ? k0 : n0 + 64 * j, outer = Tile::kTransB ? n0 + 64 * j : k0;
    if constexpr (kCluster == 1) {
      ptx::tma_load_3d(ring.b(s) + j * Tile::kBoxBytes, map_b, &ring.full[s], inner, outer, zb);
    } else if (j % kCluster == cluster_rank) {
      ptx::tma_load_3d_multicast(ring.b(s) + j * Tile::kBoxBytes, map_b, &ring.full[s], inner, outer, zb,
                                 static_cast<uint16_t>((1u << kCluster) - 1));
    }
  }
}

// acc (64 x kBN per warpgroup) += A rows [row0, row0 + 64) of the stage (a_rows: the stage's A
// + row0 * 128, which is where those rows start in either layout) x B (64 x kBN): four k-steps of
// 16, issued asynchronously (the caller commits and waits). A k-step moves a K-major operand 32
// bytes along its swizzled rows and an MN-major one 16 rows (2048 bytes) down.
template <typename T, typename Tile>
__device__ __forceinline__ void wgmma_kblock(float (&acc)[Tile::kBN / 2], const unsigned char* a_rows,
                                             const unsigned char* b) {
  using Tag = std::conditional_t<std::is_same_v<T, __half>, ptx::F16Tag, ptx::Bf16Tag>;
  constexpr int kN = Tile::kBN;
  // wgmma's transpose immediates: 1 for an MN-major operand.
  constexpr int kTnspA = Tile::kTransA ? 1 : 0, kTnspB = Tile::kTransB ? 0 : 1;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t da = Tile::kTransA ? ptx::make_smem_desc_mn_major_sw128(a_rows + kk * 16 * 128, Tile::kBoxBytes)
                                      : ptx::make_smem_desc_k_major_sw128(a_rows + kk * 32);
    const uint64_t db = Tile::kTransB ? ptx::make_smem_desc_k_major_sw128(b + kk * 32)
                                      : ptx::make_smem_desc_mn_major_sw128(b + kk * 16 * 128, Tile::kBoxBytes);
    if constexpr (kN == 256)
      ptx::wgmma_m64n256k16<kTnspA, kTnspB>(acc, da, db, 1, Tag{});
    else if constexpr (kN == 128)
      ptx::wgmma_m64n128k16<kTnspA, kTnspB>(acc, da, db, 1, Tag{});
    else
      ptx::wgmma_m64n64k16<kTnspA, kTnspB>(acc, da, db, 1, Tag{});
  }
}

}  // namespace optimized::kernels
