// Machine ceilings measured in the same run as the results they bound:
//   GPU: device_copy (cudaMemcpyAsync device to device of 1 GiB, bytes read + written, GB/s) and
//        cuBLAS GEMM rates at 4096^3 and 8192^3 for bf16, fp16, tf32 (CUBLAS_COMPUTE_32F_FAST_TF32)
//        and fp32 (CUBLAS_COMPUTE_32F, no TF32), in TFLOP/s;
//   CPU: host_copy (memcpy over all threads, bytes read + written, GB/s) and OpenBLAS sgemm at
//        2048^3 with all threads (GFLOP/s), when OpenBLAS is present.
#pragma once

#include <cstdint>
#include <vector>

#include "baselines/cublas_gemm.h"
#include "harness/gpu_timer.h"
#include "harness/harness.h"
#include "harness/report.h"

namespace bench {

struct CeilingPlan {
  bool device_copy = false;
  std::vector<CublasMode> cublas_modes;              // each measured at every size below
  std::vector<int64_t> cublas_sizes = {4096, 8192};
  bool host_copy = false;
  bool openblas = false;                             // skipped (no entry) when not available
  int64_t openblas_size = 2048;
  int cpu_threads = 0;                               // 0: all hardware threads
  int64_t device_copy_bytes = int64_t{1} << 30;
  int64_t host_copy_bytes = int64_t{256} << 20;

  static CeilingPlan everything(bool gpu);
  int count() const;  // measurements, for the progress total
};

// Measures what the plan names (GPU parts only when a GPU is usable). Failures of one ceiling
// become a note, not an exception.
std::vector<Ceiling> measure_ceilings(const CeilingPlan& plan, const MeasureOptions& opt,
                                      Progress& progress, std::vector<std::string>& notes);

#if OPTIMIZED_WITH_CUDA
// A device copy of `bytes` (half read, half written) on `stream`, rotating through enough buffer
// pairs to cover 2x the L2, timed like the rows (memory-bound rows' "same-size copy": what launch
// and ramp-up cost at their size).
Stats measure_copy_of(double bytes, const MeasureOptions& opt, cudaStream_t stream);
#endif

}  // namespace bench
