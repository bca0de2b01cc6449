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

// A rung (one of the above, as the variant table calls it) with p's epilogue: the rung computes
// alpha * A @ B in fp32 (fp64 for fp64; 16-bit operands widened first) into a scratch, then one pass
// adds beta * C and the bias, applies the activation (or its gradient), writes aux, adds the
// residual, rounds into C and sums the columns (gemm_epilogue.cpp).
void gemm_with_epilogue(const GemmParams& p, void (*rung)(const GemmParams&, int threads), int threads);

// Which microkernel gemm_packed uses on this machine: "avx512", "avx2", or "portable".
const char* packed_microkernel_isa();

}  // namespace optimized::cpu
