// The CPU backend of the fused family (cpu/fused_cpu.cpp): forward or backward of every op, by
// params.backward, on host memory; fp32 math for fp32 / fp16 / bf16 and fp64 for fp64.
#pragma once

#include "fused/fused_params.h"

namespace optimized {

// `threads` as ExecutionContext::cpu_threads (0: every hardware thread).
void cpu_fused(const FusedParams& params, int threads);

}  // namespace optimized
