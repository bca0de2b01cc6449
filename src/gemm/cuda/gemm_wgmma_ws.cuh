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
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "gemm/cuda/gemm_hopper.cuh"
#include "kernels/epilogue/wgmma_store.cuh"
#include "kernels/gemm/wgmma_mainloop.cuh"
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

template <typename T, typename Tile, int kConsumers, typename Scheduler>
__global__ void __launch_bounds__(WgmmaWsShape<Tile, kConsumers>::kThreads, 1)
    gemm_wgmma_ws_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                         const HopperGemmArgs args, const Scheduler sched) {
  using Shape = WgmmaWsShape<Tile, kConsumers>;
  extern __shared__ unsigned char smem[];
  const auto ring = kernels::WgmmaRing<Tile>::carve(smem);
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    kernels::ptx::tma_prefetch_descriptor(&map_a);
    kernels::ptx::tma_prefetch_descriptor(&map_b);
    ring.init(kConsumers * 4);  // a stage is empty once every consumer warp has released it
  }
  __syncthreads();

  kernels::RingCursor<Tile::kStages> cur;
  kernels::ScheduledTile t;
  if (warpgroup == 0) {
    kernels::ptx::setmaxnreg_dec<Shape::kProducerRegs>();
    if (threadIdx.x != 0) return;
    for (int i = 0; sched.next(i, &t); ++i) {
      const int m0 = t.m * Tile::kBM, n0 = t.n * Tile::kBN;
      const int za = args.a_batched ? static_cast<int>(t.batch) : 0;
      const int zb = args.b_batched ? static_cast<int>(t.batch) : 0;
      for (int kb = 0; kb < args.k_blocks; ++kb) {
        kernels::ptx::mbarrier_wait(&ring.empty[cur.stage], cur.phase ^ 1);
        kernels::wgmma_load_kblock(ring, cur.stage, &map_a, &map_b, m0, n0, kb * 64, za, zb);
        cur.advance();
      }
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
    for (int kb = 0; kb < args.k_blocks; ++kb) {
      kernels::ptx::mbarrier_wait(&ring.full[cur.stage], cur.phase);
      kernels::ptx::wgmma_fence();
      kernels::wgmma_kblock<T, Tile::kBN>(acc, ring.a(cur.stage) + rows * 128, ring.b(cur.stage));
      kernels::ptx::wgmma_commit();
      kernels::ptx::wgmma_wait<1>();  // the previous k-block's group is done with its stage
      if (held >= 0 && releaser) kernels::ptx::mbarrier_arrive(&ring.empty[held]);
      held = cur.stage;
      cur.advance();
    }
    kernels::ptx::wgmma_wait<0>();
    if (held >= 0 && releaser) kernels::ptx::mbarrier_arrive(&ring.empty[held]);
    kernels::ptx::wgmma_hold(acc);

    const int m0 = t.m * Tile::kBM + rows, n0 = t.n * Tile::kBN;
    T* c = static_cast<T*>(args.c) + t.batch * args.batch_stride_c + int64_t(m0) * args.ldc + n0;
    kernels::store_wgmma_tile<Tile::kBN>(acc, c, args.ldc, args.m - m0, args.n - n0, args.c_pairs, args.epi);
  }
}

}  // namespace optimized::cuda
