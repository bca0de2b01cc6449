// What the CUDA kernel of a GEMM variant would use for given operands (registers, shared memory,
// occupancy), for the benchmark's report. Internal: CUDA builds only.
#pragma once

#include "gemm/launchers.h"
#include "optimized/gemm.h"

namespace optimized {

// Validates the operands and resolves the variant exactly as matmul does (throws Error the same
// way), then asks the rung's launcher which kernel it would run. Launches nothing.
cuda::KernelResources describe_gemm_kernel(const TensorView& a, const TensorView& b, const TensorView& c,
                                           float alpha, float beta, GemmVariant variant,
                                           const GemmEpilogue* epilogue = nullptr);

// The same for scaled_matmul (validated and resolved as scaled_matmul does; CUDA variants only).
cuda::KernelResources describe_scaled_gemm_kernel(const TensorView& a, const TensorView& b, const TensorView& c,
                                                  const TensorView& scale_a, ScaleLayout scale_a_layout,
                                                  const TensorView& scale_b, ScaleLayout scale_b_layout,
                                                  const TensorView* bias, ScaledGemmVariant variant);

}  // namespace optimized
