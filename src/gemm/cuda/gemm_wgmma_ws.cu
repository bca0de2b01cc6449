// Second Hopper rung: warp specialization (gemm_wgmma_ws.cuh has the kernel). A producer
// warpgroup only loads, two consumer warpgroups only compute, and they meet on the ring's full /
// empty mbarriers, so the TMA copies of later k-blocks run while the tensor cores work and a
// consumer never waits for a whole wgmma group before issuing the next (one group stays in
// flight). setmaxnreg moves the producer's registers to the consumers, which is what lets each
// consumer hold a 64 x 256 accumulator (128 registers) and the block tile grow to 128 x 256.
//
// One instantiation per layout of A and B (row- or column-major each; wgmma_mainloop.cuh).
//
//   block tile 128 x 256 x 64, 4 stages (192 KiB), one tile per block, grouped rasterization.
#include <string>
#include <type_traits>

#include "gemm/cuda/gemm_wgmma_ws.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

template <bool kTransA, bool kTransB>
using TileFor = kernels::WgmmaTile<128, 256, 4, 0, kTransA, kTransB>;
constexpr int kConsumers = 2;
using Scheduler = kernels::OneTilePerBlock<8>;
using Shape = WgmmaWsShape<TileFor<false, false>, kConsumers>;  // the same for every layout
constexpr int kSmemBytes = TileFor<false, false>::kSmemBytes;

template <typename T, bool kTransA, bool kTransB>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(
      &gemm_wgmma_ws_kernel<T, T, TileFor<kTransA, kTransB>, kConsumers, Scheduler>);
}

template <typename T, bool kTransA, bool kTransB>
const std::string& kernel_name() {
  static const std::string name = std::string("gemm_wgmma_ws<") + dtype_label<T>() +
                                  ", " + kLayoutName<kTransA, kTransB> +
                                  ", 128x256x64, 4 stages, producer + 2 consumers>";
  return name;
}

template <typename T, bool kTransA, bool kTransB>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  using Tile = TileFor<kTransA, kTransB>;
  CUtensorMap map_a, map_b, map_c{}, map_aux{};
  HopperGemmArgs args;
  if (cudaError_t e = make_hopper_args(p, Tile::kBM, &map_a, &map_b, &args); e != cudaSuccess) return e;
  if (cudaError_t e = cudaFuncSetAttribute(kernel_ptr<T, kTransA, kTransB>(),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      e != cudaSuccess)
    return e;
  Scheduler sched{static_cast<int>(ceil_div(p.m, int64_t(Tile::kBM))), static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN))), 0};
  return launch_batch_chunks(p.batch, [&](int64_t z0, unsigned count) {
    sched.z_base = z0;
    const dim3 grid(static_cast<unsigned>(sched.tiles_m * sched.tiles_n), 1, count);
    gemm_wgmma_ws_kernel<T, T, Tile, kConsumers, Scheduler><<<grid, Shape::kThreads, Tile::kSmemBytes, stream>>>(
        map_a, map_b, map_c, map_aux, args, sched);
  });
}

}  // namespace

cudaError_t gemm_wgmma_ws(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() { return launch<T, kTransA, kTransB>(p, stream); });
  });
}

cudaError_t gemm_wgmma_ws_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      const void* kernel = kernel_ptr<T, kTransA, kTransB>();
      if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
          e != cudaSuccess)
        return e;
      return describe_kernel(kernel, kernel_name<T, kTransA, kTransB>().c_str(), Shape::kThreads, kSmemBytes, out);
    });
  });
}

}  // namespace optimized::cuda
