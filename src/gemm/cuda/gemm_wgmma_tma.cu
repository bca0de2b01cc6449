// First Hopper rung: TMA + wgmma, one warpgroup. What changes from mma_pipeline:
//   * loads: one thread asks the TMA unit for a whole (64 x 128) box per operand and k-block
//     (cp.async.bulk.tensor); the copy engine does the address math, the 128-byte swizzle and the
//     zero fill past the matrix edges, and counts the bytes on an mbarrier. No thread of the
//     block moves data.
//   * math: wgmma.m64n128k16 reads A and B straight from shared memory (no ldmatrix, no register
//     fragments) and runs asynchronously; one warpgroup (4 warps) owns a 128 x 128 tile as two
//     m64 halves, 128 fp32 accumulators per thread.
// What it does not do yet (the next rungs): the same threads wait for data and compute, and every
// k-block ends with a full wait for the tensor cores and a block barrier before its stage is
// refilled, so loads and math overlap only through the ring's depth.
//
// Layouts: A and B may each be row- or column-major; TMA copies the stored boxes as they are and
// wgmma's transpose immediates say which way each operand runs (wgmma_mainloop.cuh), so the four
// layouts are four instantiations of the same kernel with the same work.
//
//   block tile 128 x 128 x 64, 3 stages (96 KiB: two blocks per SM), grouped rasterization.
#include <string>
#include <type_traits>

#include "gemm/cuda/gemm_hopper.cuh"
#include "gemm/launchers.h"
#include "kernels/epilogue/wgmma_store.cuh"
#include "kernels/gemm/wgmma_mainloop.cuh"
#include "kernels/sched/persistent_tiles.cuh"

namespace optimized::cuda {
namespace {

template <bool kTransA, bool kTransB>
using TileFor = kernels::WgmmaTile<128, 128, 3, 0, kTransA, kTransB>;
using Scheduler = kernels::OneTilePerBlock<8>;
constexpr int kThreads = 128;

template <typename T, typename Tile>
__global__ void __launch_bounds__(kThreads) gemm_wgmma_tma_kernel(const __grid_constant__ CUtensorMap map_a,
                                                                  const __grid_constant__ CUtensorMap map_b,
                                                                  const HopperGemmArgs args, const Scheduler sched) {
  extern __shared__ unsigned char smem[];
  const auto ring = kernels::WgmmaRing<Tile>::carve(smem);
  kernels::ScheduledTile t;
  sched.next(0, &t);
  const int m0 = t.m * Tile::kBM, n0 = t.n * Tile::kBN;
  const int za = args.a_batched ? static_cast<int>(t.batch) : 0;
  const int zb = args.b_batched ? static_cast<int>(t.batch) : 0;
  const int k_blocks = args.k_blocks;

  if (threadIdx.x == 0) {
    kernels::ptx::tma_prefetch_descriptor(&map_a);
    kernels::ptx::tma_prefetch_descriptor(&map_b);
    ring.init(1);  // empty[] unused here: the block barrier frees a stage
    for (int s = 0; s < Tile::kStages && s < k_blocks; ++s)
      kernels::wgmma_load_kblock(ring, s, &map_a, &map_b, m0, n0, s * 64, za, zb);
  }
  __syncthreads();

  float acc[2][Tile::kBN / 2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < Tile::kBN / 2; ++i) acc[h][i] = 0.0f;

  kernels::RingCursor<Tile::kStages> cur;
  for (int kb = 0; kb < k_blocks; ++kb) {
    kernels::ptx::mbarrier_wait(&ring.full[cur.stage], cur.phase);
    kernels::ptx::wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h)
      kernels::wgmma_kblock<T, Tile>(acc[h], ring.a(cur.stage) + h * 64 * 128, ring.b(cur.stage));
    kernels::ptx::wgmma_commit();
    kernels::ptx::wgmma_wait<0>();
    __syncthreads();  // every warp's wgmma has read the stage: refill it
    if (threadIdx.x == 0 && kb + Tile::kStages < k_blocks)
      kernels::wgmma_load_kblock(ring, cur.stage, &map_a, &map_b, m0, n0, (kb + Tile::kStages) * 64, za, zb);
    cur.advance();
  }
  kernels::ptx::wgmma_hold(acc[0]);
  kernels::ptx::wgmma_hold(acc[1]);

  const kernels::AlphaBetaOutput<T> out{args.alpha, args.beta, static_cast<T*>(args.c), args.ldc,
                                        args.batch_stride_c, args.c_pairs};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row0 = m0 + 64 * h;
    kernels::store_wgmma_tile<Tile::kBN>(acc[h], t.batch, row0, n0, args.m - row0, args.n - n0, out);
  }
}

template <typename T, bool kTransA, bool kTransB>
const std::string& kernel_name() {
  static const std::string name = std::string("gemm_wgmma_tma<") + dtype_label<T>() +
                                  ", " + kLayoutName<kTransA, kTransB> + ", 128x128x64, 3 stages, 1 warpgroup>";
  return name;
}

template <typename T, bool kTransA, bool kTransB>
cudaError_t prepare_kernel(const void** kernel) {
  using Tile = TileFor<kTransA, kTransB>;
  const void* k = reinterpret_cast<const void*>(&gemm_wgmma_tma_kernel<T, Tile>);
  if (cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      e != cudaSuccess)
    return e;
  *kernel = k;
  return cudaSuccess;
}

template <typename T, bool kTransA, bool kTransB>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  using Tile = TileFor<kTransA, kTransB>;
  CUtensorMap map_a, map_b;
  HopperGemmArgs args;
  if (cudaError_t e = make_hopper_args(p, Tile::kBM, &map_a, &map_b, &args); e != cudaSuccess) return e;
  const void* kernel = nullptr;
  if (cudaError_t e = prepare_kernel<T, kTransA, kTransB>(&kernel); e != cudaSuccess) return e;
  Scheduler sched{static_cast<int>(ceil_div(p.m, int64_t(Tile::kBM))), static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN))), 0};
  return launch_batch_chunks(p.batch, [&](int64_t z0, unsigned count) {
    sched.z_base = z0;
    const dim3 grid(static_cast<unsigned>(sched.tiles_m * sched.tiles_n), 1, count);
    gemm_wgmma_tma_kernel<T, Tile><<<grid, kThreads, Tile::kSmemBytes, stream>>>(map_a, map_b, args, sched);
  });
}

}  // namespace

cudaError_t gemm_wgmma_tma(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() { return launch<T, kTransA, kTransB>(p, stream); });
  });
}

cudaError_t gemm_wgmma_tma_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      const void* kernel = nullptr;
      if (cudaError_t e = prepare_kernel<T, kTransA, kTransB>(&kernel); e != cudaSuccess) return e;
      return describe_kernel(kernel, kernel_name<T, kTransA, kTransB>().c_str(), kThreads,
                             TileFor<kTransA, kTransB>::kSmemBytes, out);
    });
  });
}

}  // namespace optimized::cuda
