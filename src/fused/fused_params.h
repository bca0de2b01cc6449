// The params struct of the fused memory-bound family: what every backend, launcher and the
// float64 reference receive once the public API (src/fused/fused.cpp) has validated the operands.
// Raw pointers, sizes and row strides (in elements); no tensor view, no torch.
//
// One struct serves forward and backward of every op; each field says which ops read it.
// Absent optional operands are null pointers.
#pragma once

#include <cstdint>

#include "core/host_device.h"  // the predicates below are used by the kernels too
#include "optimized/core.h"
#include "optimized/fused.h"

namespace optimized {

struct FusedParams {
  FusedOp op = FusedOp::kSoftmax;
  bool backward = false;
  DType dtype = DType::kF32;  // of every data operand (kF32, kF16, kBF16; kF64 on the CPU only)
  int64_t rows = 0;   // >= 1 (the API returns early on 0 rows)
  int64_t width = 0;  // >= 1: normalized length; for silu_and_mul, d (x and dx hold 2 * d)

  // ---- forward inputs (backward: what the forward saw) --------------------------------------
  // forward: the input; backward: the input of the forward (h for the add forms), except for
  // softmax / log_softmax backward, where it is the forward OUTPUT y.
  const void* x = nullptr;         // (rows, width) [(rows, 2 * width) for silu_and_mul]
  int64_t ld_x = 0;
  const void* residual = nullptr;  // (rows, width): add forms, forward only
  int64_t ld_residual = 0;
  const void* weight = nullptr;    // (width): norms, optional
  const void* bias = nullptr;      // (width): layer_norm (optional), bias_gelu (optional)

  // ---- forward outputs ----------------------------------------------------------------------
  void* y = nullptr;               // (rows, width)
  int64_t ld_y = 0;
  void* residual_out = nullptr;    // (rows, width): add forms, forward only
  int64_t ld_residual_out = 0;
  // Statistics (rows), contiguous. Forward: written when non-null. Backward of the norms: read
  // (required; rstd always, mean for layer_norm). fp32 for fp32 / fp16 / bf16 data (mean, rstd:
  // what the CUDA kernels read and write); fp64 for fp64 data, which runs on the CPU only
  // (mean64, rstd64; mean and rstd stay null then).
  float* mean = nullptr;
  float* rstd = nullptr;
  double* mean64 = nullptr;
  double* rstd64 = nullptr;

  // ---- backward -----------------------------------------------------------------------------
  const void* dy = nullptr;        // (rows, width)
  int64_t ld_dy = 0;
  const void* dresidual_out = nullptr;  // (rows, width): add forms, optional, added into dx
  int64_t ld_dresidual_out = 0;
  void* dx = nullptr;              // (rows, width) [(rows, 2 * width) for silu_and_mul]
  int64_t ld_dx = 0;
  void* dweight = nullptr;         // (width): norms, optional
  void* dbias = nullptr;           // (width): layer_norm, bias_gelu, optional

  // ---- scalars ------------------------------------------------------------------------------
  // As the caller gave them: the fp64 CPU path computes with these doubles; fp32 math (the CPU
  // path for fp32 / fp16 / bf16, and every CUDA kernel) rounds them to fp32 once (CUDA: at the
  // launch, FusedScalarsF32 in src/fused/cuda/fused_common.cuh).
  double eps = 1e-5;     // norms
  double scale = 1.0;    // softmax, log_softmax: the input is scale * x
  GeluApproximation gelu = GeluApproximation::kNone;

  OPTIMIZED_HOST_DEVICE bool is_add_form() const { return op == FusedOp::kAddLayerNorm || op == FusedOp::kAddRmsNorm; }
  OPTIMIZED_HOST_DEVICE bool is_layer_norm() const { return op == FusedOp::kLayerNorm || op == FusedOp::kAddLayerNorm; }
  OPTIMIZED_HOST_DEVICE bool is_rms_norm() const { return op == FusedOp::kRmsNorm || op == FusedOp::kAddRmsNorm; }
  OPTIMIZED_HOST_DEVICE bool is_softmax() const { return op == FusedOp::kSoftmax || op == FusedOp::kLogSoftmax; }
  OPTIMIZED_HOST_DEVICE bool is_norm() const { return is_layer_norm() || is_rms_norm(); }
  // Ops with a reduction over the row (the ones the short-row / long-row designs differ on).
  OPTIMIZED_HOST_DEVICE bool has_row_reduction() const { return is_softmax() || is_norm(); }
};

// Whether every row of every operand starts on a 16-byte boundary and rows are whole 16-byte
// vectors: the condition of the CUDA kernels' vector loads.
inline bool fused_rows_aligned(const FusedParams& p) {
  const int64_t elem = static_cast<int64_t>(dtype_size(p.dtype));
  auto ok = [&](const void* ptr, int64_t ld) {
    return !ptr || (reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (ld * elem) % 16 == 0);
  };
  const int64_t w = p.width * elem;
  return ok(p.x, p.ld_x) && ok(p.residual, p.ld_residual) && ok(p.y, p.ld_y) &&
         ok(p.residual_out, p.ld_residual_out) && ok(p.dy, p.ld_dy) && ok(p.dresidual_out, p.ld_dresidual_out) &&
         ok(p.dx, p.ld_dx) && ok(p.weight, 0) && ok(p.bias, 0) && ok(p.dweight, 0) && ok(p.dbias, 0) && w % 16 == 0;
}

}  // namespace optimized

