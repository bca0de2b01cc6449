// The linear family's fp8 path (LinearForwardOptions::fp8, LinearBackwardOptions::fp8): per-tensor
// current scaling. Each operand of a GEMM is quantized with the scale its own amax gives, computed
// in the same call (no history, no delayed scale):
//
//   amax   = max |t|                         (as float bits: the max of non-negative floats is the
//                                             max of their bits, so atomics give the same result
//                                             in any order; NaN's bits are above every number's)
//   q      = fp8_max / amax                  (fp8_quant_scale below: 1 for an all-zero tensor, NaN
//                                             when amax is not finite, so that the output is NaN
//                                             rather than silently wrong)
//   t8     = fp8(saturate(t * q))            (round to nearest even, clamped to +-fp8_max)
//   GEMM   on t8 with the dequantization scale 1 / q (scaled_matmul's per-tensor scale)
//
// x and W are e4m3 (largest 448), the gradient g = dy * act'(pre) is e5m2 (largest 57344: the
// range gradients need). Where the pass that writes a tensor exists (g, in act_grad), its amax is
// taken in that pass; x, W and dy get an amax pass of their own. The casts write the K-major
// copies the fp8 GEMM reads (x, W for the forward; g, W^T for dgrad; g^T, x^T for wgrad), a plain
// and a transposed copy in one pass when both are needed.
#pragma once

#include <cfloat>
#include <cstdint>

#include "core/host_device.h"
#include "optimized/core.h"

namespace optimized {

OPTIMIZED_HOST_DEVICE inline float fp8_max_finite(DType format) {
  return format == DType::kF8E5M2 ? 57344.0f : 448.0f;
}

// The quantization scale of a tensor whose |max| is amax.
OPTIMIZED_HOST_DEVICE inline float fp8_quant_scale(float amax, float fp8_max) {
  if (amax == 0.0f) return 1.0f;
  if (!(amax <= FLT_MAX)) return amax - amax;  // inf or NaN: NaN
  const float q = fp8_max / amax;
  return q <= FLT_MAX ? q : FLT_MAX;  // a denormal amax: the largest finite scale
}

// One tensor to quantize: src (rows, cols) of dtype (fp32, fp16, bf16), rows ld apart, unit stride
// along cols; into out (rows, cols, rows ld_out apart) and / or out_t (cols, rows: the transpose,
// rows ld_out_t apart), either null when not wanted. amax_bits: the tensor's amax (float bits),
// already computed; dequant: where 1 / q is written (one float).
struct Fp8CastJob {
  const void* src = nullptr;
  DType dtype = DType::kBF16;
  int64_t rows = 0, cols = 0, ld = 0;
  DType format = DType::kF8E4M3;
  const unsigned* amax_bits = nullptr;
  uint8_t* out = nullptr;
  int64_t ld_out = 0;
  uint8_t* out_t = nullptr;
  int64_t ld_out_t = 0;
  float* dequant = nullptr;
};

// One tensor's amax pass: src as in Fp8CastJob, max |src| (as bits) into *amax_bits (which holds
// 0 or an earlier max: the pass only raises it).
struct Fp8AmaxJob {
  const void* src = nullptr;
  DType dtype = DType::kBF16;
  int64_t rows = 0, cols = 0, ld = 0;
  unsigned* amax_bits = nullptr;
};

constexpr int kMaxFp8Jobs = 4;

}  // namespace optimized
