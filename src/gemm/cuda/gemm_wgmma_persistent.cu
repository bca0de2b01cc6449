// Third Hopper rung: the warp-specialized kernel of wgmma_ws (gemm_wgmma_ws.cuh) on a persistent
// grid of clusters, with a TMA-store epilogue. Three steps, each measured in
// docs/perf-notes/gemm.md:
//   * persistent: one block per SM walks the tiles of every batch (kernels/sched/
//     persistent_tiles.cuh, grouped rasterization for L2 reuse); the producer starts the next
//     tile's loads while the consumers run this tile's epilogue, a block's setup happens once per
//     SM, and only the last wave is partial.
//   * clusters of 2 blocks take two vertically adjacent tiles, which need the same 256 columns of
//     B: each block loads half of B's boxes and TMA multicasts them to both, so per k-block a block
//     brings 16 KiB of A + 16 KiB of B from L2 instead of 16 + 32. Less L2 traffic is less power,
//     and under the H100's power limit that is clock speed.
//   * TMA-store epilogue (beta == 0, C describable): each consumer warpgroup writes its 64 x 256
//     tile as four swizzled 64 x 64 chunks into two staging buffers and one thread hands each to
//     the TMA unit, so the consumers return to the tensor cores after ~64 shared-memory stores per
//     thread instead of waiting on 64 global ones.
//
//   block tile 128 x 256 x 64, 4 stages (192 KiB) + 32 KiB of C staging, clusters of 2 along M,
//   grid = min(tile pairs, the clusters that fit at once) x 2.
#include <atomic>
#include <type_traits>

#include "gemm/cuda/gemm_wgmma_ws.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kConsumers = 2;
using Tile = kernels::WgmmaTile<128, 256, 4, kTmaStoreStagingBytes<kConsumers>>;
constexpr int kCluster = 2;
using Scheduler = kernels::PersistentTiles<8, kCluster>;

using Shape = WgmmaWsShape<Tile, kConsumers>;
constexpr int kMaxDevices = 64;

template <typename T>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&gemm_wgmma_ws_kernel<T, Tile, kConsumers, Scheduler, kCluster, true>);
}

template <typename T>
const char* kernel_name() {
  return std::is_same_v<T, __half> ? "gemm_wgmma_persistent<fp16, 128x256x64, 4 stages, producer + 2 consumers, cluster 2x1>"
                                   : "gemm_wgmma_persistent<bf16, 128x256x64, 4 stages, producer + 2 consumers, cluster 2x1>";
}

template <typename T>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  CUtensorMap map_a, map_b, map_c{};
  HopperGemmArgs args;
  if (cudaError_t e = make_hopper_args(p, Tile::kBM, &map_a, &map_b, &args, &map_c); e != cudaSuccess) return e;
  const void* kp = kernel_ptr<T>();
  if (cudaError_t e = cudaFuncSetAttribute(kp, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      e != cudaSuccess)
    return e;
  const Scheduler sched{static_cast<int>(ceil_div(p.m, int64_t(Tile::kBM))),
                        static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN))), p.batch};
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  config.blockDim = dim3(Shape::kThreads);
  config.dynamicSmemBytes = Tile::kSmemBytes;
  config.stream = stream;
  // As many clusters as fit on the device at once (the GPCs decide, not just the SM count), asked
  // once per device.
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  static std::atomic<int> fit[kMaxDevices] = {};
  int clusters = device < kMaxDevices ? fit[device].load(std::memory_order_relaxed) : 0;
  if (clusters == 0) {
    config.gridDim = dim3(kCluster);
    if (cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kp, &config); e != cudaSuccess)
      return e;
    if (clusters < 1) return cudaErrorInvalidConfiguration;
    if (device < kMaxDevices) fit[device].store(clusters, std::memory_order_relaxed);
  }
  config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(sched.total(), clusters) * kCluster));
  return cudaLaunchKernelEx(&config, &gemm_wgmma_ws_kernel<T, Tile, kConsumers, Scheduler, kCluster, true>, map_a, map_b,
                            map_c, args, sched);
}

}  // namespace

cudaError_t gemm_wgmma_persistent(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t { return launch<T>(p, stream); });
}

cudaError_t gemm_wgmma_persistent_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    if (cudaError_t e = cudaFuncSetAttribute(kernel_ptr<T>(), cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
        e != cudaSuccess)
      return e;
    return describe_kernel(kernel_ptr<T>(), kernel_name<T>(), Shape::kThreads, Tile::kSmemBytes, out);
  });
}

}  // namespace optimized::cuda
