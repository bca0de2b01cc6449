// Third Hopper rung: the warp-specialized kernel of wgmma_ws on a persistent grid. One block per
// SM walks the tiles of every batch (kernels/sched/persistent_tiles.cuh, grouped rasterization
// for L2 reuse), so
//   * the producer starts the next tile's loads while the consumers run this tile's epilogue
//     (the epilogue overlaps the next mainloop's first kStages k-blocks);
//   * a block's setup (barrier init, descriptor prefetch, register moves) happens once per SM,
//     not once per tile;
//   * the last wave is the only partial one, and it is one tile deep.
//
//   block tile 128 x 256 x 64, 4 stages (192 KiB), grid = min(tiles, SMs).
#include <type_traits>

#include "core/device_facts.h"
#include "gemm/cuda/gemm_wgmma_ws.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

using Tile = kernels::WgmmaTile<128, 256, 4>;
constexpr int kConsumers = 2;
using Scheduler = kernels::PersistentTiles<8>;
using Shape = WgmmaWsShape<Tile, kConsumers>;

template <typename T>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&gemm_wgmma_ws_kernel<T, Tile, kConsumers, Scheduler>);
}

template <typename T>
const char* kernel_name() {
  return std::is_same_v<T, __half> ? "gemm_wgmma_persistent<fp16, 128x256x64, 4 stages, producer + 2 consumers>"
                                   : "gemm_wgmma_persistent<bf16, 128x256x64, 4 stages, producer + 2 consumers>";
}

template <typename T>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  CUtensorMap map_a, map_b;
  HopperGemmArgs args;
  if (cudaError_t e = make_hopper_args(p, Tile::kBM, &map_a, &map_b, &args); e != cudaSuccess) return e;
  if (cudaError_t e = cudaFuncSetAttribute(kernel_ptr<T>(), cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      e != cudaSuccess)
    return e;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = device_facts(device, &facts); e != cudaSuccess) return e;
  const Scheduler sched{static_cast<int>(ceil_div(p.m, int64_t(Tile::kBM))),
                        static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN))), p.batch};
  const int64_t blocks = std::min<int64_t>(sched.total(), facts->sm_count);
  gemm_wgmma_ws_kernel<T, Tile, kConsumers, Scheduler><<<static_cast<unsigned>(blocks), Shape::kThreads,
                                                         Tile::kSmemBytes, stream>>>(map_a, map_b, args, sched);
  return cudaGetLastError();
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
