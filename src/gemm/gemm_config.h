// Every tuning constant of the GEMM family that depends on the GPU, and the choice of kAuto, for
// each architecture: one function per (family, architecture). The lower CUDA rungs (naive ..
// wmma) keep their tile shapes in their own files: those are the lesson of each rung, not tuning.
// Host and device code read these (constexpr); CUDA-free.
#pragma once

#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized {

// The mma_pipeline rung (src/gemm/cuda/gemm_mma_pipeline.cu): block tile, ring depth, warps, and
// the grouped rasterization's group height.
struct GemmMmaPipelineConfig {
  int block_m, block_n, block_k;
  int stages;
  int warps_m, warps_n;
  int group_m;
};

// Hopper (sm_90; measured on an H100 80GB HBM3 at 1980 MHz, 4096^3 bf16, where this config runs
// at ~460 TFLOP/s in a standalone harness; docs/perf-notes/gemm.md, "mma_pipeline"):
//  * 128x256 block / 64x64 warp tile: per 16-wide k-step a warp issues 8 ldmatrix.x4 (4 KiB of
//    smem reads) for 32 mma = 128 KFLOP, i.e. 32 FLOP per smem byte. A 64x32 or 32x64 warp tile
//    needs 6 ldmatrix.x4 for 16 mma (21 FLOP/B), and with cp.async writes on top the smem port
//    (128 B/clk/SM) would sit close to the mma.sync rate; 128x128 blocks of 4 such warps halve the
//    warps per scheduler (2 is already the least that hides HMMA/ldmatrix latency). 64x64 is the
//    largest warp tile whose 128 accumulators + double-buffered fragments (64 regs) fit in 255.
//  * block_k = 64: rows of A are exactly one 128-byte line, so one XOR swizzle serves A and B; one
//    __syncthreads per 4 k-steps (32 doubles the barriers per FLOP).
//  * 4 stages: 3 tiles (192 of K) in flight, ~3.5 us of math per SM, well above DRAM/L2 latency
//    under load. Measured: 3 stages within noise of 4; 4 kept as margin, free in occupancy
//    (registers cap it at 1 block per SM) and the fp32 epilogue staging (132 KiB) reuses the ring.
//  * group_m = 8: 132 resident blocks cover ~8 block-rows of A and all of B at 4096^2, ~40 MiB,
//    inside the 50 MiB L2. Measured 4 / 8 / 16: within noise at 4096; 4 ~2% slower at 8192.
constexpr GemmMmaPipelineConfig gemm_mma_pipeline_config_sm90() {
  return {.block_m = 128, .block_n = 256, .block_k = 64, .stages = 4, .warps_m = 2, .warps_n = 4, .group_m = 8};
}

// The Hopper persistent rung (src/gemm/cuda/gemm_wgmma_persistent.cu) picks one of two tile
// configurations and a split of K by shape:
//  * big: 128 x 256 block tiles, two consumer warpgroups, clusters of 2 sharing B (the large
//    shapes: docs/perf-notes/gemm.md, "wgmma_persistent");
//  * small_m: 64 x 128 tiles, one consumer warpgroup, no cluster: M <= 64, and larger M whose
//    big tiles fill less than one wave of clusters when the model below (kGemmHopperSmallKblock)
//    says the small tiles, split, finish first. Decode shapes are bound by reading B; a 128-row
//    tile would compute mostly padding and a 256-wide one leaves too few tiles to keep every SM
//    reading.
//  * splits: when the tiles do not fill the SMs, K is cut into `splits` ranges, each its own unit
//    of work; the last unit of a tile to finish sums the fp32 partials in split order
//    (deterministic). The model, in k-blocks of time: waves * (k-blocks per unit + 2 when split,
//    for the partial's round trip and the pipeline's ramp) + splits * (one slot's read by the
//    summing block: 128 KiB, a 128 x 256 fp32 partial, about one k-block), waves =
//    ceil(units / concurrent units); >= 4 k-blocks per unit, at most kGemmHopperMaxSplits.
//    Measured (bf16, H100): 1024x1024x8192 at 16 splits without the slot term spent longer
//    summing than computing (0.27x cuBLAS); with it, 1024^3 at 4 splits of the big tiles took
//    0.105 ms against 0.020 unsplit (16 MiB of 128 x 256 partials for a 2 GFLOP product), so
//    the big configuration does not split; the small one does (slots of at most 64 x 128). Much
//    of that summing time was latency, since fixed (the summing block's loads had been a
//    load-then-add chain per element: gemm_wgmma_ws.cuh, reduce_splits); splitting the big
//    tiles again has not been re-measured.
struct GemmHopperPlan {
  bool small_m;
  int splits;
};
constexpr int kGemmHopperMaxSplits = 16;

// The small configuration's k-block (64 x 128 x 64 on one consumer warpgroup) in the big one's
// k-blocks of time (128 x 256 x 64 on two): a quarter of the work at about 70% of the rate per SM
// (a guess, checked by the linear benchmark's seed and skinny shapes, docs/perf-notes/linear.md).
constexpr double kGemmHopperSmallKblock = 0.35;

constexpr GemmHopperPlan gemm_hopper_plan_sm90(int64_t m, int64_t n, int64_t k, int64_t batch, int sm_count) {
  const int64_t k_blocks = (k + 63) / 64;
  // The big tiles, unsplit: clusters of two 128 x 256 tiles.
  const int64_t big_slots = sm_count / 2 > 0 ? sm_count / 2 : 1;
  const int64_t big_units = ((m + 255) / 256) * ((n + 255) / 256) * batch;
  if (m > 64 && big_units >= big_slots) return {false, 1};  // a full wave of clusters or more
  const double big_cost = static_cast<double>((big_units + big_slots - 1) / big_slots) * static_cast<double>(k_blocks);
  // The small tiles (64 x 128, no cluster), split when that keeps more SMs busy.
  const int64_t slots = sm_count > 0 ? sm_count : 1;
  const int64_t units = ((m + 63) / 64) * ((n + 127) / 128) * batch;
  const double slot_kblocks = static_cast<double>(m < 64 ? m : 64) * 128.0 * 4.0 / (128.0 * 1024.0);
  int best = 1;
  double best_cost = static_cast<double>((units + slots - 1) / slots) * static_cast<double>(k_blocks);
  for (int s = 2; s <= kGemmHopperMaxSplits && 4 * s <= k_blocks; ++s) {
    const double cost = static_cast<double>((units * s + slots - 1) / slots) *
                            (static_cast<double>(k_blocks) / s + 2.0) +
                        s * slot_kblocks;
    if (cost < best_cost) best = s, best_cost = cost;
  }
  if (m > 64 && kGemmHopperSmallKblock * best_cost >= big_cost) return {false, 1};
  return {true, best};
}

// Operands TMA cannot describe (rows not 16-byte aligned: odd K or N): kAuto may still run
// wgmma_persistent on padded copies of A and B in its workspace (two strided 2-D copies) when that
// beats mma_pipeline's unaligned path. The model: the copies move (M*K + K*N) * 2 bytes twice at
// ~2.5 TB/s, plus ~10 us of launches; the product runs at ~650 TFLOP/s against ~150 for the
// unaligned mma_pipeline (H100, bf16: docs/perf-notes/gemm.md, "The odd shape").
constexpr bool gemm_hopper_staging_pays(int64_t m, int64_t n, int64_t k, int64_t batch, int64_t element_bytes) {
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) * batch;
  const double copy_bytes = 2.0 * static_cast<double>(m * k + k * n) * static_cast<double>(batch * element_bytes);
  return flops / 150e12 > copy_bytes / 2.5e12 + flops / 650e12 + 10e-6;
}

// What kAuto runs (docs/perf-notes/gemm.md, "Measured: the H100 ladder at a glance", 4096^3):
// on CUDA, fp32 -> register_tiled (45.5 TFLOP/s, the only fp32 rung past 6; the tensor-core rungs
// take no fp32), fp16/bf16 -> wgmma_persistent where it can run (`hopper`: an sm_90a build, a
// compute capability 9.0 device and operands TMA can describe), else mma_pipeline (466 TFLOP/s
// bf16 against wmma's 253); on the CPU, cpu_packed (the SIMD microkernel), fp64 -> cpu_blocked
// (cpu_packed takes no fp64).
// Decode shapes, M <= kGemvMaxRows (any dtype), take gemv: see "gemv" in the notes for the
// measured crossover with wgmma_persistent's small-M configuration.
// With an epilogue (or an fp32 C from 16-bit operands: `epilogue`), only the rungs that fuse it
// are candidates (gemm_variant_fuses_epilogue): decode shapes then go to the Hopper rung's small-M
// configuration with split-K (or mma_pipeline / register_tiled off Hopper) instead of gemv.
constexpr int64_t kGemvMaxRows = 8;
constexpr GemmVariant gemm_auto_variant_sm90(DType dtype, bool cuda, bool hopper, int64_t m, bool epilogue = false) {
  if (!cuda) return dtype == DType::kF64 ? GemmVariant::kCpuBlocked : GemmVariant::kCpuPacked;
  if (m <= kGemvMaxRows && !epilogue) return GemmVariant::kCudaGemv;
  if (dtype == DType::kF32) return GemmVariant::kCudaRegisterTiled;
  return hopper ? GemmVariant::kCudaWgmmaPersistent : GemmVariant::kCudaMmaPipeline;
}

// The configuration the kernels are compiled with: the build's target architecture (sm_90a,
// CMAKE_CUDA_ARCHITECTURES). A second architecture adds its functions and a choice here.
constexpr GemmMmaPipelineConfig kGemmMmaPipelineConfig = gemm_mma_pipeline_config_sm90();
constexpr GemmHopperPlan gemm_hopper_plan(int64_t m, int64_t n, int64_t k, int64_t batch, int sm_count) {
  return gemm_hopper_plan_sm90(m, n, k, batch, sm_count);
}
constexpr GemmVariant gemm_auto_variant(DType dtype, bool cuda, bool hopper, int64_t m, bool epilogue = false) {
  return gemm_auto_variant_sm90(dtype, cuda, hopper, m, epilogue);
}

}  // namespace optimized
