// The GEMM benchmark: for each (shape, dtype, variant) allocate random operands (uniform [-1, 1],
// fixed seed per rotating set), run the variant once through optimized::matmul, validate it with
// optimized::check_gemm against float64, then time it with the harness next to the baseline of the
// same dtype and shape measured in the same run (cuBLAS on the GPU, OpenBLAS sgemm on the CPU).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "harness.h"
#include "optimized/core.h"
#include "optimized/gemm.h"
#include "report.h"

namespace bench {

struct GemmShape {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  std::string label() const;  // "4096x4096x4096", "8x1024x1024x1024" with a batch
};

// "4096" (cube) or "4097x4095x4093" (MxNxK) or "8x1024x1024x1024" (batch x M x N x K).
// Throws std::invalid_argument naming the text.
GemmShape parse_gemm_shape(const std::string& text);

struct GemmBenchConfig {
  std::vector<GemmShape> shapes;
  std::vector<optimized::DType> dtypes;
  std::vector<optimized::GemmVariant> variants;  // kAuto allowed (runs on the GPU when there is one)
  std::vector<int> threads;                      // CPU thread counts (each CPU variant runs at each)
  float alpha = 1.0f;
  float beta = 0.0f;
  // CPU rungs that are too slow at large sizes run only up to M*N*K <= cap^3.
  int64_t cpu_naive_max = 1024;
  int64_t cpu_blocked_max = 2048;
  bool baselines = true;
  MeasureOptions measure;
};

// Measurements the config will make (rows + baselines), for the progress total.
int count_gemm_tasks(const GemmBenchConfig& config, bool gpu_available);

// Runs the config; appends rows to `results` (and notes). Rows that fail validation have status
// "failed"; the caller turns that into the exit code.
void run_gemm_bench(const GemmBenchConfig& config, const std::vector<Ceiling>& ceilings,
                    Progress& progress, std::vector<Result>& results, std::vector<std::string>& notes);

}  // namespace bench
