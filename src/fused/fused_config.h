// Every tuning constant of the fused family's CUDA designs and every threshold of kAuto, for each
// GPU architecture: one function per (family, architecture). The kernels (src/fused/cuda/) and the
// C++ API (fused.cpp: fused_registers_max_width, resolve_fused_variant) read the same values, so a
// limit is written once. The unfused rung keeps its launch shapes in its own file: it is the
// "before" of the comparison (what an eager framework launches), not a tuned design.
// Host and device code read these (constexpr); CUDA-free.
#pragma once

#include <cstdint>

namespace optimized {

struct FusedConfig {
  // ---- fused_registers (the short-row design, cuda/row_registers.cuh) ------------------------
  int registers_max_threads_per_row;  // threads of one block holding one row
  int registers_max_cluster;          // blocks of a cluster holding one row (rows longer than a block)
  int registers_short_row_block;      // threads of a block holding several short rows
  int registers_forward_vectors;      // 16-byte vectors of the row per thread, forward (target and cap)
  int registers_backward_vectors;     // the same, backward
  // ---- fused_streaming (the long-row design, cuda/row_streaming.cuh) -------------------------
  int streaming_threads;              // threads of the block that streams one row
  // ---- the element-wise ops' kernel (cuda/elementwise.cuh) -----------------------------------
  int elementwise_threads;
  int elementwise_waves;              // grid = this many waves of resident blocks (rows split to fill it)
  // ---- kAuto (resolve_fused_variant) ---------------------------------------------------------
  // A width threshold for 16-bit elements (bf16, fp16) and one for fp32.
  struct Width {
    int64_t two_byte, four_byte;
    constexpr int64_t for_element_size(int64_t bytes) const { return bytes <= 2 ? two_byte : four_byte; }
  };
  Width auto_unaligned_registers_max_width;     // unaligned rows wider than this: fused_streaming
  Width auto_norm_forward_streaming_from;       // norms forward from this width: fused_streaming
  Width auto_softmax_forward_streaming_from;    // softmax forward from this width: fused_streaming
  Width auto_softmax_backward_streaming_from;   // softmax backward from this width: fused_streaming
};

// Hopper (sm_90, H100 80GB HBM3; measurements in docs/perf-notes/fused.md, "Measured (H100)", bf16,
// 4096 and 16384 rows). Where no alternative was measured, the comment says so.
//
// fused_registers
//  * 512 threads per row in one block, then clusters of up to 8 blocks (8: the portable cluster
//    size; 16 needs the non-portable opt-in) with distributed shared memory.
//  * 4 vectors per thread forward, 2 backward: forward holds one row, and 8 vectors spilled (64 fp32
//    values and the softmax temporaries exceed the 128 registers of a 512-thread block); backward
//    holds two rows and the dweight / dbias sums. Fewer vectors per thread mean fewer bytes in
//    flight per thread (not measured against this choice).
//  * short rows: 256-thread blocks holding 256 / threads-per-row rows (not measured against 128
//    or 512).
// fused_streaming: 512 threads per row (not measured against other block sizes).
// elementwise: 256 threads; the rows are split so that the grid is 4 waves of resident blocks
// (not measured against other counts).
// kAuto: from the sweep of both designs over widths 65 ... 262144 in bf16 and fp32 (softmax,
// layer_norm, rms_norm, forward and backward, 2^26 elements per shape; bench/results/h100/
// fused-auto-sweep.json, the table in docs/perf-notes/fused.md, "Choosing the design").
//  * Unaligned rows (not starting on 16-byte boundaries): the registers design won by 4-20x at 65
//    columns, the streaming one by 1.3-2.2x at 1027 in the norms (softmax forward: registers by
//    1.5x) and by 3-7x at 4099. The limit sits at 1024, between the two measured widths.
//  * Norms forward: registers up to 8192 bf16 columns (rms_norm 8192: 2379 GB/s against 2192),
//    streaming from 16384 (2423 against 2216); in fp32, streaming from 4096 (2793 against 2534;
//    at 16384 the registers design is ahead by 1-15%, at 32768 behind again).
//  * Softmax forward: registers up to 16384 columns (bf16 2219 against 1712), streaming from 32768
//    (1865 against 1706; 65536: 1857 against 1146), both dtypes.
//  * Softmax backward: registers up to 16384 bf16 columns (2354 against 2013), streaming from
//    32768 (1822 against 1489); fp32 streaming from 16384 (1818 against 1624).
//  * Norms backward: the registers design wherever it holds the row, by 1.6-9x (layer_norm bwd bf16
//    16384x4096: 2157 GB/s against 282: the streaming design's dweight partials cost more traffic
//    than the row itself).
constexpr FusedConfig fused_config_sm90() {
  return {
      .registers_max_threads_per_row = 512,
      .registers_max_cluster = 8,
      .registers_short_row_block = 256,
      .registers_forward_vectors = 4,
      .registers_backward_vectors = 2,
      .streaming_threads = 512,
      .elementwise_threads = 256,
      .elementwise_waves = 4,
      .auto_unaligned_registers_max_width = {1024, 1024},
      .auto_norm_forward_streaming_from = {16384, 4096},
      .auto_softmax_forward_streaming_from = {32768, 32768},
      .auto_softmax_backward_streaming_from = {32768, 16384},
  };
}

// The configuration the kernels are compiled with: the build's target architecture (sm_90a,
// CMAKE_CUDA_ARCHITECTURES). A second architecture adds its function and a choice here.
constexpr FusedConfig kFusedConfig = fused_config_sm90();

}  // namespace optimized
