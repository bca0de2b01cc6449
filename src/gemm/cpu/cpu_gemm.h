// CPU backend for GEMM: the ladder's CPU rungs. Each takes validated GemmParams on host memory.
#pragma once

#include "gemm/gemm_params.h"

namespace optimized::cpu {

// Triple loop, fp32 accumulate. Single-threaded: the baseline every other rung is measured against.
void gemm_naive(const GemmParams& p);
// Cache-blocked loops (blocks of M, N, K sized for L1/L2), fp32 accumulate, threads over M blocks.
void gemm_blocked(const GemmParams& p, int threads);
// Packed A/B panels, register-blocked microkernel in AVX-512 or AVX2+FMA (chosen at run time from
// cpuid; a portable C++ kernel when neither is present), threads over the macro-tiles.
void gemm_packed(const GemmParams& p, int threads);

// Which microkernel gemm_packed uses on this machine: "avx512", "avx2", or "portable".
const char* packed_microkernel_isa();

}  // namespace optimized::cpu
