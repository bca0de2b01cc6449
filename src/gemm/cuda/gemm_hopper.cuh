// What the Hopper GEMM rungs (wgmma_tma, wgmma_ws, wgmma_persistent) share beyond src/kernels: the
// arguments their kernels take besides the two TMA maps, and the host code that builds both from
// GemmParams. sm_90a sources only.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "core/tensor_map.h"
#include "gemm/cuda/gemm_common.cuh"

namespace optimized::cuda {

// The epilogue's view of C and the sizes the kernel needs besides the maps.
struct HopperGemmArgs {
  void* c;
  int m, n, k_blocks;   // k_blocks: ceil(K / 64)
  int64_t ldc, batch_stride_c;
  bool a_batched, b_batched;  // false: batch stride 0, every batch reads batch 0 of the map
  bool c_pairs;               // two neighbouring columns of C (and aux, residual, bias) are one access
  bool c_tma;                 // the TMA-store epilogue may run: beta == 0, 16-bit C and C's map was made
  // The register epilogue may run (c_tma, and an epilogue of a bias along N, an activation and an
  // aux written through its own map, nothing else): the consumers apply it to their accumulators
  // and store C (and aux) by TMA, reading nothing but the bias.
  bool epi_regs = false;
  float alpha, beta;
  GemmEpilogueParams epi;     // bias, activation, aux, residual, column sums (GemmParams::epi)
  // Column sums: the warps' rows of partials, (batch, tiles_m * block_m / 16, N) fp32.
  float* column_partials = nullptr;
  // Split-K (splits > 1): unit (tile, split) writes its fp32 partial, rows [0, slot_rows) x the
  // tile's columns, to partials[(tile * splits + split) * slot_rows * block_n ...]; counters[tile]
  // counts the finished splits (zeroed by the launcher before the kernel).
  int splits = 1;
  int tiles_m = 0, tiles_n = 0;
  int slot_rows = 0;
  float* partials = nullptr;
  unsigned* counters = nullptr;
};

// Split-K scratch of p with `splits` ranges and tiles of block_m x block_n: fp32 partial slots of
// min(M, block_m) rows, then one counter per tile (256-byte aligned).
inline size_t hopper_split_bytes(const GemmParams& p, int block_m, int block_n, int splits, size_t* counters_offset) {
  *counters_offset = 0;
  if (splits <= 1) return 0;
  const int64_t tiles = ceil_div(p.m, int64_t(block_m)) * ceil_div(p.n, int64_t(block_n)) * p.batch;
  const int64_t slot_rows = p.m < block_m ? p.m : block_m;
  const size_t partial_bytes = static_cast<size_t>(tiles * splits * slot_rows * block_n) * sizeof(float);
  *counters_offset = (partial_bytes + 255) / 256 * 256;
  return *counters_offset + static_cast<size_t>(tiles) * sizeof(unsigned);
}

// The maps of the stored A and B (kernels/gemm/wgmma_mainloop.cuh: a row-major A in boxes of 64 K
// x block_m rows, every other operand in 64 x 64 boxes) and the arguments of p, for tiles of
// block_m x 64k (args->tiles_m: M's tiles of block_m rows). The launcher has checked gemm_hopper_rejects(p) (gemm.cpp) is empty; the
// driver can still refuse a map (cudaErrorInvalidValue). map_c (optional): C's map (box 64 x 64)
// for a TMA-store epilogue, made when beta == 0 (TMA stores, it does not read C), N is a multiple
// of 8 and TMA can describe C; args->c_tma says whether it was. map_aux (optional, with map_c):
// aux's map, made when the epilogue is one the register epilogue takes (HopperGemmArgs::epi_regs).
inline cudaError_t make_hopper_args(const GemmParams& p, int block_m, CUtensorMap* map_a, CUtensorMap* map_b,
                                    HopperGemmArgs* args, CUtensorMap* map_c = nullptr,
                                    CUtensorMap* map_aux = nullptr) {
  const TmaMatrix a{p.a, p.a_stored_rows(), p.a_stored_cols(), p.lda, p.batch, p.batch_stride_a, 2};
  const TmaMatrix b{p.b, p.b_stored_rows(), p.b_stored_cols(), p.ldb, p.batch, p.batch_stride_b, 2};
  if (cudaError_t e = make_tma_map_sw128(map_a, a, 64, p.trans_a ? 64 : block_m); e != cudaSuccess) return e;
  if (cudaError_t e = make_tma_map_sw128(map_b, b, 64, 64); e != cudaSuccess) return e;
  args->c = p.c;
  args->m = static_cast<int>(p.m);
  args->n = static_cast<int>(p.n);
  args->k_blocks = static_cast<int>(ceil_div(p.k, int64_t(64)));
  args->ldc = p.ldc;
  args->batch_stride_c = p.batch_stride_c;
  args->a_batched = p.batch > 1 && p.batch_stride_a != 0;
  args->b_batched = p.batch > 1 && p.batch_stride_b != 0;
  args->c_pairs = epilogue_pairs(p);
  args->alpha = p.alpha;
  args->beta = p.beta;
  args->epi = p.epi;
  args->tiles_m = static_cast<int>(ceil_div(p.m, int64_t(block_m)));
  args->c_tma = false;
  // C's rows a whole number of 16-byte units too: a TMA store clips a box at the tensor's edge in
  // 16-byte units, and would write the padding after the last column otherwise (seen on the H100
  // with N = 257). A 16-bit C only (an fp32 C leaves from registers).
  if (map_c && p.beta == 0.0f && p.n % 8 == 0 && p.c_dtype == p.dtype) {
    const TmaMatrix c{p.c, p.m, p.n, p.ldc, p.batch, p.batch_stride_c, 2};
    if (tma_rejects(c, "c").empty() && make_tma_map_sw128(map_c, c, 64, 64) == cudaSuccess) args->c_tma = true;
  }
  const GemmEpilogueParams& e = p.epi;
  if (args->c_tma && map_aux && !e.act_grad && !e.residual && !e.column_sums && !(e.bias && e.bias_along_m)) {
    args->epi_regs = true;
    if (e.aux) {
      const TmaMatrix aux{e.aux, p.m, p.n, e.ld_aux, p.batch, e.batch_stride_aux, 2};
      args->epi_regs = tma_rejects(aux, "aux").empty() && make_tma_map_sw128(map_aux, aux, 64, 64) == cudaSuccess;
    }
  }
  return cudaSuccess;
}

// The launch of a persistent grid of clusters (wgmma_persistent, wgmma_fp8): a launch config with
// the cluster-dimension attribute (not copyable: the config points at the attribute), and a grid of
// as many clusters as fit on the device at once, asked once per kernel and device (the GPCs
// decide, not just the SM count), and no more than the units of work.
struct ClusterLaunch {
  cudaLaunchAttribute attr{};
  cudaLaunchConfig_t config{};
  int cluster;

  ClusterLaunch(int cluster_size, int threads, int smem_bytes, cudaStream_t stream) : cluster(cluster_size) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(cluster_size);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    config.attrs = &attr;
    config.numAttrs = 1;
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
    config.stream = stream;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;

  cudaError_t size_grid(const void* kernel, int64_t units) {
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    static std::mutex mutex;
    static std::map<std::pair<const void*, int>, int> fit;
    int clusters = 0;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (auto it = fit.find({kernel, device}); it != fit.end()) clusters = it->second;
    }
    if (clusters == 0) {
      config.gridDim = dim3(static_cast<unsigned>(cluster));
      if (cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config); e != cudaSuccess) return e;
      if (clusters < 1) return cudaErrorInvalidConfiguration;
      std::lock_guard<std::mutex> lock(mutex);
      fit[{kernel, device}] = clusters;
    }
    config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(units, clusters) * cluster));
    return cudaSuccess;
  }
};

// "NN", "NT", "TN" or "TT" (A's layout, then B's), for the Hopper kernels' names (one instantiation
// per layout, picked by gemm_common.cuh's dispatch_layout: the layout decides the TMA boxes and
// wgmma's transpose immediates).
template <bool kTransA, bool kTransB>
constexpr const char* kLayoutName = kTransA ? (kTransB ? "TT" : "TN") : (kTransB ? "NT" : "NN");

}  // namespace optimized::cuda
