// The float64 GEMM reference every test and benchmark validates against: inputs widened to double,
// double accumulation, no rounding of the output. Host views only; not part of the shipped library.
#pragma once

#include "optimized/core.h"

namespace optimized::testing {

// C = alpha * A @ B + beta * C on host memory with double accumulation and double output.
// a, b: rank-2/3 host views of any supported dtype (rank 2 broadcasts over the batch); c_in may be
// null when beta == 0. c_out: (batch, M, N) contiguous doubles.
void matmul_reference_f64(const TensorView& a, const TensorView& b, const TensorView* c_in, double alpha,
                          double beta, double* c_out);

// Element (z, i, j) of a rank-2 or rank-3 host view, in elements from its data (rank 2 broadcasts over z).
int64_t element_offset(const TensorView& t, int64_t z, int64_t i, int64_t j);

}  // namespace optimized::testing
