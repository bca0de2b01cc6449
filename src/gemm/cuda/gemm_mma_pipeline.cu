// Top rung of the pre-Hopper tensor-core ladder: mma.sync.m16n8k16 (fp32 accumulate) fed by
// ldmatrix from an XOR-swizzled, multi-stage shared-memory ring that cp.async fills.
//
//   block tile 128x256x64, 8 warps as 2 (M) x 4 (N), warp tile 64x64 = 4 x 8 mma tiles,
//   128 fp32 accumulators per thread, 4-stage cp.async ring (192 KiB of dynamic smem),
//   grouped (GROUP_M) rasterization of the tile grid for L2 reuse, epilogue staged through
//   shared memory as fp32 so that C is read and written in full, coalesced rows.
//
// This file composes the kernel from the ground floor (src/kernels), the way linear, MoE and
// attention compose theirs:
//   scheduler  kernels/sched/grouped_tiles.cuh     which tile (grouped rasterization), which batch
//   mainloop   kernels/gemm/mma_sync_mainloop.cuh  the tile's A @ B in fp32 accumulators: the
//              swizzled cp.async ring, ldmatrix, mma.sync (its header has the layouts)
//   epilogue   kernels/epilogue/staged_tile.cuh + alpha_beta.cuh   C = alpha * acc + beta * C
// The tile shape and the group height are tuning: src/gemm/gemm_config.h says why these won.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/gemm_config.h"
#include "gemm/launchers.h"
#include "kernels/epilogue/alpha_beta.cuh"
#include "kernels/epilogue/staged_tile.cuh"
#include "kernels/gemm/mma_sync_mainloop.cuh"
#include "kernels/sched/grouped_tiles.cuh"

namespace optimized::cuda {
namespace {

// ---- config (src/gemm/gemm_config.h) ----------------------------------------------------------
constexpr GemmMmaPipelineConfig kConfig = kGemmMmaPipelineConfig;
using Tile = kernels::MmaSyncTile<kConfig.block_m, kConfig.block_n, kConfig.block_k, kConfig.stages,
                                  kConfig.warps_m, kConfig.warps_n>;
using Scheduler = kernels::GroupedTileScheduler<kConfig.group_m>;
using Staging = kernels::StagedTile<Tile>;
// The mainloop's ring and the epilogue's fp32 staging share the dynamic shared memory.
constexpr int kSmemBytes = Tile::kSmemBytes > Staging::kBytes ? Tile::kSmemBytes : Staging::kBytes;
static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory of one block (sm_90 opt-in limit)");

// ---- kernel -----------------------------------------------------------------------------------
struct LaunchArgs {
  GemmParams p;
  Scheduler sched;  // tiles and the first batch of this launch
  bool c_vec4;      // C base 8-byte aligned and ldc, batch_stride_c multiples of 4 elements
  bool fast_ok;     // per-chunk byte strides of A and B fit in 32 bits (fast loader allowed)
};

template <typename T, bool kAligned>
__global__ void __launch_bounds__(Tile::kThreads, 1) gemm_mma_pipeline_kernel(const LaunchArgs args) {
  extern __shared__ __align__(128) unsigned char smem[];

  const kernels::TileCoord<int> tile = args.sched.tile();
  const int64_t m0 = int64_t(tile.m) * Tile::kBM;
  const int64_t n0 = int64_t(tile.n) * Tile::kBN;
  const BatchOperands<T> ops = batch_operands<T>(args.p, args.sched.batch());

  float acc[Tile::kMT][Tile::kNT][4];
  kernels::mma_sync_mainloop<T, Tile, kAligned>(acc, args.p, args.fast_ok, ops.a, ops.b, m0, n0, smem);

  kernels::store_staged_tile<Tile>(acc, reinterpret_cast<float*>(smem), ops.c, args.p.m, args.p.n, args.p.ldc, m0,
                                   n0, args.c_vec4, kernels::AlphaBetaEpilogue{args.p.alpha, args.p.beta});
}

// ---- host side --------------------------------------------------------------------------------
template <typename T, bool kAligned>
const char* kernel_name() {
  if constexpr (std::is_same_v<T, __half>)
    return kAligned ? "gemm_mma_pipeline<fp16, 128x256x64, 4 stages, cp.async>"
                    : "gemm_mma_pipeline<fp16, 128x256x64, 4 stages, unaligned ld/st>";
  else
    return kAligned ? "gemm_mma_pipeline<bf16, 128x256x64, 4 stages, cp.async>"
                    : "gemm_mma_pipeline<bf16, 128x256x64, 4 stages, unaligned ld/st>";
}

// The cp.async path needs every 16-byte chunk it copies to start on a 16-byte boundary: base
// pointers aligned, and row and batch strides multiples of 8 elements (2-byte types).
bool operands_aligned(const GemmParams& p) {
  return rows_aligned16(p.a, p.lda, p.batch_stride_a, p.batch, p.dtype) &&
         rows_aligned16(p.b, p.ldb, p.batch_stride_b, p.batch, p.dtype);
}

bool c_vectorizable(const GemmParams& p) {
  return (reinterpret_cast<uintptr_t>(p.c) & 7) == 0 && p.ldc % 4 == 0 &&
         (p.batch <= 1 || p.batch_stride_c % 4 == 0);
}

template <typename T, bool kAligned>
cudaError_t prepare_kernel(const void** kernel) {
  const void* k = reinterpret_cast<const void*>(&gemm_mma_pipeline_kernel<T, kAligned>);
  // Above 48 KiB a block needs the opt-in; cheap enough to repeat per launch (and correct when
  // the current device changes between calls).
  if (cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      e != cudaSuccess)
    return e;
  *kernel = k;
  return cudaSuccess;
}

template <typename T, bool kAligned>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  const void* kernel = nullptr;
  if (cudaError_t e = prepare_kernel<T, kAligned>(&kernel); e != cudaSuccess) return e;
  const int64_t tiles_m = ceil_div(p.m, Tile::kBM);
  const int64_t tiles_n = ceil_div(p.n, Tile::kBN);
  if (!Scheduler::fits(tiles_m, tiles_n)) return cudaErrorInvalidValue;
  // The fast loader steps between a thread's chunks with 32-bit byte strides.
  const bool fast_ok = (Tile::kThreads / 8) * p.lda * 2 <= UINT32_MAX && (Tile::kThreads / 32) * p.ldb * 2 <= UINT32_MAX;
  LaunchArgs args{p, Scheduler::make(tiles_m, tiles_n), c_vectorizable(p), fast_ok};
  for (int64_t z0 = 0; z0 < p.batch; z0 += kMaxGridZ) {
    args.sched.z_base = z0;
    gemm_mma_pipeline_kernel<T, kAligned><<<args.sched.grid(z0, p.batch), Tile::kThreads, kSmemBytes, stream>>>(args);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t gemm_mma_pipeline(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  const bool aligned = operands_aligned(p);
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return aligned ? launch<T, true>(p, stream) : launch<T, false>(p, stream);
  });
}

cudaError_t gemm_mma_pipeline_resources(const GemmParams& p, KernelResources* out) {
  const bool aligned = operands_aligned(p);
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    const void* kernel = nullptr;
    const char* name = aligned ? kernel_name<T, true>() : kernel_name<T, false>();
    if (cudaError_t e = aligned ? prepare_kernel<T, true>(&kernel) : prepare_kernel<T, false>(&kernel);
        e != cudaSuccess)
      return e;
    return describe_kernel(kernel, name, Tile::kThreads, kSmemBytes, out);
  });
}

}  // namespace optimized::cuda
