// The scaled (fp8) GEMM's params: what every backend and launcher of scaled_matmul receives once
// the public API (scaled_gemm.cpp) has validated the operands. Raw pointers, sizes and strides (in
// elements); no tensor view, no torch.
//
//   pre = (scale_a . A) @ (scale_b . B) + bias + beta * C      (fp32)
//   aux = pre (when given);  C = act(pre)                        (each rounded once to c_dtype)
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized {

struct ScaledGemmParams {
  const void* a = nullptr;  // (M, K) fp8: element (i, kk) at a[i * a_row_stride + kk * a_col_stride]
  const void* b = nullptr;  // (K, N) fp8: element (kk, j) at b[kk * b_row_stride + j * b_col_stride]
  void* c = nullptr;        // (M, N) row-major, rows ldc apart
  int64_t m = 0, n = 0, k = 0;  // all >= 1
  int64_t a_row_stride = 0, a_col_stride = 1;
  int64_t b_row_stride = 0, b_col_stride = 1;
  int64_t ldc = 0;
  DType a_dtype = DType::kF8E4M3, b_dtype = DType::kF8E4M3;  // fp8_e4m3 or fp8_e5m2 (not both e5m2)
  DType c_dtype = DType::kBF16;                               // fp32, bf16 or fp16
  // Contiguous fp32 scales of the layouts in gemm.h (block layouts row-major as documented there).
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  ScaleLayout scale_a_layout = ScaleLayout::kTensor;
  ScaleLayout scale_b_layout = ScaleLayout::kTensor;
  const void* bias = nullptr;  // (N) of c_dtype, or null
  int activation = 0;          // optimized::Activation, applied last
  void* aux = nullptr;         // (M, N) of c_dtype, rows ld_aux apart: pre (before the activation); null: none
  int64_t ld_aux = 0;
  float beta = 0.0f;           // 0: C is not read

  // Whether each operand is K-major (K contiguous), the layout fp8 wgmma reads.
  OPTIMIZED_HOST_DEVICE bool a_k_major() const { return a_col_stride == 1 || k == 1; }
  OPTIMIZED_HOST_DEVICE bool b_k_major() const { return b_row_stride == 1 || k == 1; }
  // K-major leading dimensions (the stride between rows of A, between columns of B).
  OPTIMIZED_HOST_DEVICE int64_t a_ld() const { return m == 1 ? k : a_row_stride; }
  OPTIMIZED_HOST_DEVICE int64_t b_ld() const { return n == 1 ? k : b_col_stride; }
};

// The scale of element (i, kk) of A and of element (kk, j) of B (host or device).
OPTIMIZED_HOST_DEVICE inline float scaled_gemm_scale_a(const ScaledGemmParams& p, int64_t i, int64_t kk) {
  const int64_t kb = (p.k + 127) / 128;
  switch (p.scale_a_layout) {
    case ScaleLayout::kTensor: return p.scale_a[0];
    case ScaleLayout::kRowwise: return p.scale_a[i];
    case ScaleLayout::kBlock1x128: return p.scale_a[i * kb + kk / 128];
    case ScaleLayout::kBlock128x128: return p.scale_a[(i / 128) * kb + kk / 128];
  }
  return 0.0f;
}
OPTIMIZED_HOST_DEVICE inline float scaled_gemm_scale_b(const ScaledGemmParams& p, int64_t kk, int64_t j) {
  const int64_t kb = (p.k + 127) / 128, nb = (p.n + 127) / 128;
  switch (p.scale_b_layout) {
    case ScaleLayout::kTensor: return p.scale_b[0];
    case ScaleLayout::kRowwise: return p.scale_b[j];
    case ScaleLayout::kBlock1x128: return p.scale_b[j * kb + kk / 128];
    case ScaleLayout::kBlock128x128: return p.scale_b[(kk / 128) * nb + j / 128];
  }
  return 0.0f;
}

}  // namespace optimized
