// The GEMM plug-in of optimized-bench (`optimized-bench matmul`, and the GEMM rows of `all`): for
// each (shape, dtype, device) a group of variants on random operands (uniform [-1, 1], a fixed seed
// per rotating set), each run once through optimized::matmul and checked with check_gemm against
// float64 (optimized_ops_testing), then timed by the driver (harness/driver.h) next to the baseline
// of the same dtype and shape measured in the same run: cuBLAS on the GPU, OpenBLAS sgemm on the CPU.
// flops = 2 M N K batch; min_bytes = (M K + K N + M N (x2 when beta != 0)) E batch.
// --layout NN,NT,TN,TT runs each shape with A and/or B stored column-major (cuBLAS gets the same
// layouts through its op flags).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "harness/driver.h"
#include "harness/harness.h"
#include "optimized/core.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include "gemm/launchers.h"
#endif

namespace bench {

struct GemmShape {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  // The layouts: A stored column-major ((K, M) in memory) and B stored column-major ((N, K)).
  bool trans_a = false, trans_b = false;
  std::string layout() const;  // "NN", "NT", "TN" or "TT"
  // "4096x4096x4096", "8x1024x1024x1024" with a batch; " NT" etc. appended unless NN
  std::string label() const;
};

// "4096" (cube) or "4097x4095x4093" (MxNxK) or "8x1024x1024x1024" (batch x M x N x K).
// Throws std::invalid_argument naming the text.
GemmShape parse_gemm_shape(const std::string& text);

// --variant's items, each once: "all", "cpu" or "cuda" (the table's variants of that backend that
// `keep` accepts, null: all of them; auto too for "all" and "cuda" when `with_auto`), or names
// (parse_gemm_variant: throws optimized::Error naming the choices).
std::vector<optimized::GemmVariant> parse_gemm_variants(const std::vector<std::string>& items,
                                                        bool (*keep)(optimized::GemmVariant) = nullptr,
                                                        bool with_auto = false);

struct GemmBenchConfig {
  std::vector<GemmShape> shapes;
  std::vector<optimized::DType> dtypes;
  std::vector<optimized::GemmVariant> variants;  // kAuto allowed (runs on the GPU when there is one)
  // Peers timed as rows of the GPU groups after ours (parse_cutlass_peers: "cutlass_ws_128x128", ...),
  // in the groups whose dtype they are built for; each validated like a row before it is timed.
  std::vector<std::string> peers;
  std::vector<int> threads;                      // CPU thread counts (each CPU variant runs at each)
  float alpha = 1.0f;
  float beta = 0.0f;
  // CPU rungs that are too slow at large sizes run only up to M*N*K <= cap^3.
  int64_t cpu_naive_max = 1024;
  int64_t cpu_blocked_max = 2048;
  bool baselines = true;
  MeasureOptions measure;
};

// The config's groups, planned for a machine with or without a GPU.
Groups gemm_groups(const GemmBenchConfig& config, bool gpu_available);

#if OPTIMIZED_WITH_CUDA
// A launcher's kernel report as the report's kernel columns (the GEMM and scaled GEMM rows).
KernelInfo kernel_info_of(const optimized::cuda::KernelResources& res);
#endif

}  // namespace bench
