// The linear family's CPU backend: g = dy * act'(pre) and the bias gradient (linear_params.h), on
// host memory. The GEMMs of the cpu variant are the GEMM family's CPU rungs (linear.cpp).
#pragma once

#include "linear/linear_params.h"

namespace optimized::cpu {

// One pass over dy and pre: threads over blocks of columns, each block walking the rows in order,
// so that every column's sum has one fixed order whatever the thread count (the same bits every
// run). Products in fp32 (fp64 for fp64) with the GEMM epilogue's act' (gemm/cpu/activation.h); the
// column sums in fp64 (as the CPU GEMM epilogue's column sums), rounded once into bias_grad.
void linear_act_grad(const LinearGradParams& p, int cpu_threads);

}  // namespace optimized::cpu
