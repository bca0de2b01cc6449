// The warp-specialized Hopper GEMM kernel that wgmma_ws and wgmma_persistent instantiate with
// their scheduler (kernels/sched/persistent_tiles.cuh):
//
//   warpgroup 0, the producer: gives its registers back (setmaxnreg.dec to 40) and one thread
//     walks the scheduler's tiles and their k-blocks, waiting for an empty stage and issuing its
//     TMA copies. It never waits for the math, so the ring runs kStages k-blocks ahead, across
//     tile boundaries too (the persistent schedule).
//   warpgroups 1..kConsumers: take the registers (setmaxnreg.inc to 232), each owns 64 rows of
//     the kBM = 64 * kConsumers row tile and all kBN columns (m64n256k16: 128 fp32 accumulators
//     per thread). Per k-block: wait for the full stage, issue 4 wgmma k-steps, commit, wait
//     until the previous k-block's group is done (wgmma.wait_group 1: one group always in
//     flight) and release that group's stage; then the epilogue stores straight from registers
//     while the producer already fills the ring with the next tile.
// kCluster > 1 (wgmma_persistent): clusters of kCluster blocks hold vertically adjacent tiles and
// share B through TMA multicast (kernels/gemm/wgmma_mainloop.cuh). A stage of one block is then
// written by its peers too, so it is empty only once the consumers of every block of the cluster
// have released it: consumers arrive on the empty barrier of each block.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <utility>

#include "gemm/cuda/gemm_hopper.cuh"
#include "kernels/epilogue/wgmma_store.cuh"
#include "kernels/gemm/wgmma_mainloop.cuh"
#include "kernels/ptx/cluster.cuh"
#include "kernels/sched/persistent_tiles.cuh"

namespace optimized::cuda {

template <typename Tile, int kConsumers>
struct WgmmaWsShape {
  static_assert(Tile::kBM == 64 * kConsumers, "each consumer warpgroup owns 64 rows of the tile");
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536,
                "the register file of one SM");
};

// A consumer warp's release of a stage: on this block's empty barrier, or on every block's of the
// cluster (their producers multicast into this block's stage).
template <int kCluster>
__device__ __forceinline__ void release(uint64_t* empty) {
  if constexpr (kCluster == 1) {
    kernels::ptx::mbarrier_arrive(empty);
  } else {
#pragma unroll
    for (int r = 0; r < kCluster; ++r) kernels::ptx::mbarrier_arrive_cluster(empty, r);
  }
}

// The TMA-store epilogue's staging: per consumer warpgroup two 64 x 64 chunks of C (8 KiB each),
// so that one chunk is written while the other's store still reads it.
constexpr int kTmaStoreChunkBytes = 64 * 128;
template <int kConsumers>
constexpr int kTmaStoreStagingBytes = kConsumers * 2 * kTmaStoreChunkBytes;

// The TMA-store epilogue of one consumer warpgroup (thread `wg_thread` of it, named barrier
// `barrier`): the 64 x kN tile at (m0, n0) of batch z times alpha, 64 columns at a time, through two
// staging chunks; each chunk's store runs while the next is written and the next tile's mainloop
// starts.
template <typename T, int kN>
__device__ __forceinline__ void store_tile_tma(const float (&acc)[kN / 2], unsigned char* staging, const CUtensorMap* map_c,
                                               int m0, int n0, int z, float alpha, int wg_thread, int barrier) {
#pragma unroll
  for (int q = 0; q < kN / 64; ++q) {
    unsigned char* chunk = staging + (q % 2) * kTmaStoreChunkBytes;
    if (wg_thread == 0) kernels::ptx::bulk_wait_group_read<1>();  // this chunk's previous store has read it
    kernels::ptx::named_barrier_sync(barrier, 128);
    kernels::stage_wgmma_chunk_sw128<kN, T>(acc, q, chunk, alpha);
    kernels::ptx::fence_proxy_async_shared();  // the writes, before the TMA unit reads them
    kernels::ptx::named_barrier_sync(barrier, 128);
    if (wg_thread == 0) {
      kernels::ptx::tma_store_3d(map_c, chunk, n0 + 64 * q, m0, z);
      kernels::ptx::bulk_commit_group();
    }
  }
}

// Half h of chunk q's accumulators (acc[32q + 16h .. + 15]: n8 blocks 4h .. 4h + 3 of the chunk x
// 2 row halves x 2 columns) copied out with compile-time indices, one case per half, so that acc
// stays in registers while the loop over them stays rolled.
template <int kN, int... kI>
__device__ __forceinline__ void half_chunk_values(const float (&acc)[kN / 2], int i, float (&v)[16],
                                                  std::integer_sequence<int, kI...>) {
  ((i == kI ? [&] {
#pragma unroll
     for (int e = 0; e < 16; ++e) v[e] = acc[16 * kI + e];
   }()
            : void()),
   ...);
}

template <int kAct>
__device__ __forceinline__ void activate_values(float (&v)[16]) {
#pragma unroll
  for (int e = 0; e < 16; ++e) v[e] = kernels::activate(kAct, v[e]);
}

// The register epilogue (args.epi_regs): pre = alpha * acc + bias[col] on the accumulators, aux =
// pre and C = act(pre) stored by TMA (map_aux, map_c), 64 columns at a time through the two staging
// chunks: without aux they alternate between chunks (a chunk is written while the previous one's
// store still reads the other); with aux, aux takes the first and C the second, written together
// once both earlier stores have read them. A chunk is computed in two halves of 16 values per thread
// (register room: the 128 accumulators stay live). Nothing is read but the bias (columns past N
// read none; TMA clips the boxes at C's edges); the activation's switch sits outside the 16 values,
// so each activation is one rolled copy.
template <typename T, int kN>
__device__ __forceinline__ void store_tile_tma_epilogue(const float (&acc)[kN / 2], unsigned char* staging,
                                                        const CUtensorMap* map_c, const CUtensorMap* map_aux,
                                                        const HopperGemmArgs& args, int m0, int n0, int z,
                                                        int wg_thread, int barrier) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row0 = 16 * warp + lane / 4;
  const T* bias = static_cast<const T*>(args.epi.bias);
  const bool aux = args.epi.aux != nullptr;
#pragma unroll 1
  for (int q = 0; q < kN / 64; ++q) {
    unsigned char* aux_chunk = staging;
    unsigned char* c_chunk = staging + (aux ? 1 : q % 2) * kTmaStoreChunkBytes;
    if (wg_thread == 0) {
      if (aux) kernels::ptx::bulk_wait_group_read<0>();  // both chunks read by their stores
      else kernels::ptx::bulk_wait_group_read<1>();      // this chunk's previous store has read it
    }
    kernels::ptx::named_barrier_sync(barrier, 128);
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      float v[16];
      half_chunk_values<kN>(acc, 2 * q + half, v, std::make_integer_sequence<int, kN / 32>{});
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int col = n0 + 64 * q + 8 * (4 * half + u) + 2 * (lane % 4);
        const float b0 = bias && col < args.n ? to_float(bias[col]) : 0.0f;
        const float b1 = bias && col + 1 < args.n ? to_float(bias[col + 1]) : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          v[4 * u + 2 * h] = args.alpha * v[4 * u + 2 * h] + b0;
          v[4 * u + 2 * h + 1] = args.alpha * v[4 * u + 2 * h + 1] + b1;
        }
      }
      // Units 4 * half .. + 3 of rows row0 and row0 + 8 into a chunk (stage_wgmma_chunk_sw128's layout).
      const auto stage = [&](unsigned char* buf) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            kernels::stage_pair_sw128<T>(buf, row0 + 8 * h, 4 * half + u, lane, v[4 * u + 2 * h], v[4 * u + 2 * h + 1]);
        }
      };
      if (aux) stage(aux_chunk);
      switch (args.epi.act) {
        case kernels::kActRelu: activate_values<kernels::kActRelu>(v); break;
        case kernels::kActGeluErf: activate_values<kernels::kActGeluErf>(v); break;
        case kernels::kActGeluTanh: activate_values<kernels::kActGeluTanh>(v); break;
        case kernels::kActSilu: activate_values<kernels::kActSilu>(v); break;
        default: break;
      }
      stage(c_chunk);
    }
    kernels::ptx::fence_proxy_async_shared();  // the writes, before the TMA unit reads them
    kernels::ptx::named_barrier_sync(barrier, 128);
    if (wg_thread == 0) {
      if (aux) kernels::ptx::tma_store_3d(map_aux, aux_chunk, n0 + 64 * q, m0, z);
      kernels::ptx::tma_store_3d(map_c, c_chunk, n0 + 64 * q, m0, z);
      kernels::ptx::bulk_commit_group();
    }
  }
}

// The staged epilogue of one consumer warpgroup's 64 x kN tile at (m0, n0) of batch z, through its
// 16 KiB of C staging (two TMA chunks' worth): every store that is not the plain TMA one (an
// epilogue, beta != 0, an fp32 C, a C that TMA cannot describe). 64 columns at a time, the fp32
// fragments go to a 64 x 64 fp32 tile in shared memory (8-byte units XOR-swizzled by row, so the
// fragment writes take the minimum two wavefronts and the row reads one), then warp w takes rows
// w, w + 4, ..., w + 60 and lane l columns 2l, 2l + 1: every access to C, aux and residual is a
// coalesced row segment, a bias along N is loaded once per chunk, and four rows' reads are in flight
// at a time. partials: this warp's row of column-sum partials (its 16 rows summed in row order), or
// null.
//
// Code size is the constraint here. The chunk loop stays rolled: a switch picks the chunk's
// registers (each case a fixed set of acc[] indices, so acc stays in registers), and the row walk
// -- the epilogue functor, with its activations -- exists in four copies (the batch of rows), not
// sixteen. Unrolled over the 4 chunks and 4 rows, the kernel grew to 55,000 instructions and ran the
// epilogue out of the instruction cache: ncu showed its samples stalled on "no instruction", and
// bias alone ran at 0.49x of cuBLASLt.
template <int kN>
__device__ __forceinline__ void stage_fp32_chunk(const float (&acc)[kN / 2], int q, float* staging) {
  // The thread index read here (volatile), so that the compiler computes the 16 addresses below
  // when it stores, rather than hoisting the 64 of the four chunks out of the tile loop into
  // registers (which pushed the consumers past their 232 and spilled two values to the stack).
  unsigned tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  const int lane = static_cast<int>(tid % 32), warp = static_cast<int>((tid / 32) % 4);
  const int frag_row = 16 * warp + lane / 4;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int j = 8 * q + u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = frag_row + 8 * h;
      // Unit u (two floats) of row r sits at unit u ^ ((r % 8) * 4) of the row's 32.
      const int unit = (4 * u + lane % 4) ^ ((r & 7) << 2);
      kernels::ptx::st_shared_f2(kernels::ptx::smem_u32(staging + r * 64 + 2 * unit),
                                 make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
    }
  }
}

template <int kN, int... kQ>
__device__ __forceinline__ void stage_fp32_chunk_at(const float (&acc)[kN / 2], int q, float* staging,
                                                    std::integer_sequence<int, kQ...>) {
  // One case per chunk, each with compile-time register indices.
  ((q == kQ ? stage_fp32_chunk<kN>(acc, kQ, staging) : void()), ...);
}

template <typename TC, int kN, typename Epilogue>
__device__ __forceinline__ void store_tile_staged(const float (&acc)[kN / 2], float* staging, const HopperGemmArgs& args,
                                                  const Epilogue& epi, int m0, int n0, int64_t z, float* partials,
                                                  int barrier) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int rows = min(64, args.m - m0);  // rows of the tile inside C (<= 0: none)
#pragma unroll 1
  for (int q = 0; q < kN / 64; ++q) {
    kernels::ptx::named_barrier_sync(barrier, 128);  // the previous chunk's reads are done
    stage_fp32_chunk_at<kN>(acc, q, staging, std::make_integer_sequence<int, kN / 64>{});
    kernels::ptx::named_barrier_sync(barrier, 128);
    const int col = n0 + 64 * q + 2 * lane;
    if (col >= args.n) continue;  // (no barrier below: skipping is safe)
    const uint32_t stage = kernels::ptx::smem_u32(staging);
    const auto value = [&](int r) { return kernels::ptx::ld_shared_f2(stage + 4 * (r * 64 + 2 * (lane ^ ((r & 7) << 2)))); };
    float s0 = 0.0f, s1 = 0.0f;
    if (col + 1 < args.n) {
      // Two rows at a time: their reads (C, aux, residual) are all in flight before the first
      // one is used; rows past C are not touched. The cursor steps down the rows by pointer
      // arithmetic.
      const float2 bias = epi.column_bias(col, true);
      constexpr int kBatch = 2;
      typename Epilogue::Cursor at = epi.cursor(z, m0 + warp, col);
#pragma unroll 1
      for (int r0 = warp; r0 < rows; r0 += 4 * kBatch) {
        typename Epilogue::Inputs in[kBatch];
        typename Epilogue::Cursor cur = at;
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          if (r0 + 4 * k < rows) in[k] = epi.load2(cur);
          epi.advance(cur, 4);
        }
        cur = at;
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int r = r0 + 4 * k;
          if (r < rows) {
            const float2 v = value(r);
            float o0, o1;
            epi.finish2(cur, v.x, v.y, in[k], bias, &o0, &o1);
            s0 += o0;
            s1 += o1;
          }
          epi.advance(cur, 4);
        }
        at = cur;
      }
    } else {  // C's last column, alone
#pragma unroll 1
      for (int r = warp; r < rows; r += 4) s0 += epi.store(z, m0 + r, col, value(r).x);
    }
    if (partials) {
      partials[col] = s0;
      if (col + 1 < args.n) partials[col + 1] = s1;
    }
  }
}

// Split-K: this unit's partial (its consumer warpgroup's rows, `rows` .. rows + 63 of the tile)
// into its slot; the last unit of the tile to arrive (a counter per tile) then sums every slot in
// split order into acc, so the result does not depend on which split finished last. Returns
// whether this unit is that last one (and owns the epilogue). All consumer threads take part
// (named barrier kSplitBarrier).
constexpr int kSplitBarrier = 8;
template <typename Tile, int kConsumers>
__device__ __forceinline__ bool reduce_splits(float (&acc)[Tile::kBN / 2], const HopperGemmArgs& args,
                                              const kernels::ScheduledTile& t, int rows) {
  __shared__ int last;
  if (t.m >= args.tiles_m) return false;  // a cluster's block below the last tile row: nothing to add
  constexpr int kN = Tile::kBN;
  const int64_t tile = (t.batch * args.tiles_m + t.m) * args.tiles_n + t.n;
  const int64_t slot = int64_t(args.slot_rows) * kN;
  float* slots = args.partials + tile * args.splits * slot;
  const int valid = min(args.slot_rows, args.m - t.m * Tile::kBM);  // rows of the tile inside C
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row0 = rows + 16 * warp + lane / 4, col0 = 2 * (lane % 4);
  float* mine = slots + t.split * slot;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= valid) continue;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
      *reinterpret_cast<float2*>(mine + int64_t(row) * kN + 8 * j + col0) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  }
  kernels::ptx::named_barrier_sync(kSplitBarrier, 128 * kConsumers);
  if (threadIdx.x == 128) {  // the first consumer thread
    __threadfence();         // this unit's partial (ordered by the barrier) before the count
    last = atomicAdd(&args.counters[tile], 1u) == static_cast<unsigned>(args.splits - 1);
  }
  kernels::ptx::named_barrier_sync(kSplitBarrier, 128 * kConsumers);
  if (!last) return false;
  __threadfence();
  // Sums in split order (deterministic: 0 + slot 0 + slot 1 + ...). The loads of 8 n8 blocks of
  // both row halves (16 float2) are issued together before they are added, split after split. A
  // load-then-add chain per element waits out one L2 round trip per load (128 per thread at 4
  // splits): 256 x 1024 x 1024 took 35 us that way, 17 us with the loads in flight (H100).
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
  constexpr int kBatch = 8;
  static_assert((kN / 8) % kBatch == 0, "whole batches of n8 blocks");
#pragma unroll
  for (int j0 = 0; j0 < kN / 8; j0 += kBatch) {
#pragma unroll 1
    for (int sp = 0; sp < args.splits; ++sp) {
      float2 v[2][kBatch];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = min(row0 + 8 * h, valid - 1);  // rows past C read a valid row, added to nothing stored
#pragma unroll
        for (int jj = 0; jj < kBatch; ++jj)
          v[h][jj] = __ldcg(reinterpret_cast<const float2*>(slots + sp * slot + int64_t(row) * kN + 8 * (j0 + jj) + col0));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int jj = 0; jj < kBatch; ++jj) {
          acc[4 * (j0 + jj) + 2 * h] += v[h][jj].x;
          acc[4 * (j0 + jj) + 2 * h + 1] += v[h][jj].y;
        }
      }
    }
  }
  return true;
}

// kTmaStore: C leaves through the TMA-store epilogue when args.c_tma (else, and for beta != 0 or
// an fp32 C, straight from registers); the tile's extra shared memory holds kTmaStoreStagingBytes.
// With args.epi_regs the register epilogue (store_tile_tma_epilogue) takes the fused epilogue, aux
// through map_aux (unused otherwise).
// TC: C's element type (T, or float for an fp32 C). With an epilogue (args.epi; kTmaStore kernels
// only, which have the staging) the consumers store through store_tile_staged, and with column sums
// each consumer warp writes the sums of its 16 rows of the tile as one row of
// args.column_partials (row t.m * kBM / 16 + rows / 16 + warp of the batch's).
template <typename T, typename TC, typename Tile, int kConsumers, typename Scheduler, int kCluster = 1,
          bool kTmaStore = false>
__global__ void __launch_bounds__(WgmmaWsShape<Tile, kConsumers>::kThreads, 1)
    gemm_wgmma_ws_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                         const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_aux,
                         const HopperGemmArgs args, const Scheduler sched) {
  static_assert(!kTmaStore || Tile::kExtraBytes >= kTmaStoreStagingBytes<kConsumers>, "room for the C staging");
  using Shape = WgmmaWsShape<Tile, kConsumers>;
  extern __shared__ unsigned char smem[];
  const auto ring = kernels::WgmmaRing<Tile>::carve(smem);
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    kernels::ptx::tma_prefetch_descriptor(&map_a);
    kernels::ptx::tma_prefetch_descriptor(&map_b);
    ring.init(kConsumers * 4 * kCluster);  // empty once every consumer warp of the cluster released it
  }
  // Peers multicast into this block's ring and arrive on its barriers: initialised cluster-wide first.
  if constexpr (kCluster > 1)
    kernels::ptx::cluster_sync();
  else
    __syncthreads();

  kernels::RingCursor<Tile::kStages> cur;
  kernels::ScheduledTile t;
  if (warpgroup == 0) {
    kernels::ptx::setmaxnreg_dec<Shape::kProducerRegs>();
    if (threadIdx.x == 0) {
      const int rank = kCluster > 1 ? static_cast<int>(kernels::ptx::cluster_block_rank()) : 0;
      for (int i = 0; sched.next(i, &t); ++i) {
        const int m0 = t.m * Tile::kBM, n0 = t.n * Tile::kBN;
        const int za = args.a_batched ? static_cast<int>(t.batch) : 0;
        const int zb = args.b_batched ? static_cast<int>(t.batch) : 0;
        const int kb_end = kernels::split_begin(t.split + 1, args.splits, args.k_blocks);
        for (int kb = kernels::split_begin(t.split, args.splits, args.k_blocks); kb < kb_end; ++kb) {
          kernels::ptx::mbarrier_wait(&ring.empty[cur.stage], cur.phase ^ 1);
          kernels::wgmma_load_kblock<Tile, kCluster>(ring, cur.stage, &map_a, &map_b, m0, n0, kb * 64, za, zb, rank);
          cur.advance();
        }
      }
    }
    // No block leaves while a peer may still multicast into it or arrive on its barriers.
    if constexpr (kCluster > 1) {
      __syncwarp();
      kernels::ptx::cluster_sync();
    }
    return;
  }

  kernels::ptx::setmaxnreg_inc<Shape::kConsumerRegs>();
  const int rows = 64 * (warpgroup - 1);  // this consumer's rows of the tile
  const bool releaser = threadIdx.x % 32 == 0;
  float acc[Tile::kBN / 2];
  for (int i = 0; sched.next(i, &t); ++i) {
#pragma unroll
    for (int j = 0; j < Tile::kBN / 2; ++j) acc[j] = 0.0f;
    int held = -1;  // the stage the in-flight wgmma group reads
    const int kb_end = kernels::split_begin(t.split + 1, args.splits, args.k_blocks);
    for (int kb = kernels::split_begin(t.split, args.splits, args.k_blocks); kb < kb_end; ++kb) {
      kernels::ptx::mbarrier_wait(&ring.full[cur.stage], cur.phase);
      kernels::ptx::wgmma_fence();
      kernels::wgmma_kblock<T, Tile>(acc, ring.a(cur.stage) + rows * 128, ring.b(cur.stage));
      kernels::ptx::wgmma_commit();
      kernels::ptx::wgmma_wait<1>();  // the previous k-block's group is done with its stage
      if (held >= 0 && releaser) release<kCluster>(&ring.empty[held]);
      held = cur.stage;
      cur.advance();
    }
    kernels::ptx::wgmma_wait<0>();
    if (held >= 0 && releaser) release<kCluster>(&ring.empty[held]);
    kernels::ptx::wgmma_hold(acc);
    if (args.splits > 1 && !reduce_splits<Tile, kConsumers>(acc, args, t, rows)) continue;

    const int m0 = t.m * Tile::kBM + rows, n0 = t.n * Tile::kBN;
    unsigned char* staging = ring.extra() + (warpgroup - 1) * 2 * kTmaStoreChunkBytes;
    if constexpr (kTmaStore) {
      if constexpr (sizeof(TC) == 2) {
        if (args.epi_regs) {  // bias / activation / aux on the accumulators, C and aux by TMA
          store_tile_tma_epilogue<TC, Tile::kBN>(acc, staging, &map_c, &map_aux, args, m0, n0, static_cast<int>(t.batch),
                                                 threadIdx.x % 128, warpgroup);
          continue;
        }
      }
      if (args.epi.any()) {  // the fused epilogue
        // Column sums: this warp's row of partials (none for a cluster's block below the last tile row).
        float* partials = nullptr;
        if (args.column_partials && t.m < args.tiles_m) {
          const int64_t per_batch = int64_t(args.tiles_m) * (Tile::kBM / 16);
          const int64_t prow = int64_t(t.m) * (Tile::kBM / 16) + rows / 16 + (threadIdx.x / 32) % 4;
          partials = args.column_partials + (t.batch * per_batch + prow) * args.n;
        }
        const GemmEpilogueOp<TC> epi{args.alpha, args.beta, static_cast<TC*>(args.c), args.ldc, args.batch_stride_c,
                                     args.epi, args.c_pairs};
        store_tile_staged<TC, Tile::kBN>(acc, reinterpret_cast<float*>(staging), args, epi, m0, n0, t.batch,
                                         partials, warpgroup);
        continue;
      }
      if constexpr (sizeof(TC) == 2) {
        if (args.c_tma) {
          store_tile_tma<TC, Tile::kBN>(acc, staging, &map_c, m0, n0, static_cast<int>(t.batch), args.alpha,
                                        threadIdx.x % 128, warpgroup);
          continue;
        }
      }
      // beta != 0, an fp32 C or one TMA cannot take: the same staged walk with alpha / beta only
      // (coalesced rows and reads of C in flight, where the register layout would read 8-byte
      // pieces of 8 rows, each waiting for the store before it).
      const kernels::AlphaBetaOutput<TC> out{args.alpha, args.beta, static_cast<TC*>(args.c), args.ldc,
                                             args.batch_stride_c, args.c_pairs};
      store_tile_staged<TC, Tile::kBN>(acc, reinterpret_cast<float*>(staging), args, out, m0, n0, t.batch, nullptr,
                                       warpgroup);
      continue;
    }
    const kernels::AlphaBetaOutput<TC> out{args.alpha, args.beta, static_cast<TC*>(args.c), args.ldc,
                                           args.batch_stride_c, args.c_pairs};
    kernels::store_wgmma_tile<Tile::kBN>(acc, t.batch, m0, n0, args.m - m0, args.n - n0, out);
  }
  if (kTmaStore && args.c_tma && threadIdx.x % 128 == 0) kernels::ptx::bulk_wait_group<0>();  // stores done (C, aux)
  if constexpr (kCluster > 1) kernels::ptx::cluster_sync();
}

}  // namespace optimized::cuda
