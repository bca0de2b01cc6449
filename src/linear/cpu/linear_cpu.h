// The linear family's CPU backend: g = dy * act'(pre) and the bias gradient (linear_params.h), on
// host memory. The GEMMs of the cpu variant are the GEMM family's CPU rungs (linear.cpp).
#pragma once

#include "linear/linear_fp8.h"
#include "linear/linear_params.h"

namespace optimized::cpu {

// One pass over dy and pre: threads over blocks of columns, each block walking the rows in order,
// so that every column's sum has one fixed order whatever the thread count (the same bits every
// run). Products in fp32 (fp64 for fp64) with the GEMM epilogue's act' (gemm/cpu/activation.h); the
// column sums in fp64 (as the CPU GEMM epilogue's column sums), rounded once into bias_grad.
// With p.amax_bits, max |g| (the values g holds, rounded to dtype) is raised into it.
void linear_act_grad(const LinearGradParams& p, int cpu_threads);

// The fp8 path's passes on host memory, as the CUDA kernels do them (linear_fp8.h): the same
// scale, the same products in fp32, the same saturating round-to-nearest-even conversion.
void linear_fp8_amax(const Fp8AmaxJob& job, int cpu_threads);
void linear_fp8_cast(const Fp8CastJob& job, int cpu_threads);

}  // namespace optimized::cpu
