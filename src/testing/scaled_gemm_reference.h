// The float64 reference of a scaled (fp8) GEMM, and the bound its outputs are held to. Host only;
// part of optimized_ops_testing, for the fp8 rungs of the Hopper GEMM and their tests.
//
//   out[i, j] = sum_k (A[i, k] * scale_a(i, k)) * (B[k, j] * scale_b(k, j))
//
// A is M x K, B is K x N, each fp8 (e4m3 or e5m2) at any strides (wgmma reads both K-major: A
// row-major, B stored N x K, as torch._scaled_mm takes mat2 column-major). Scales are fp32, one of
// the layouts torch._scaled_mm and DeepSeek-V3 training use:
//   kTensor        one scale for the operand
//   kRowwise       A: one per row (M); B: one per column (N)
//   kBlock1x128    one per row (A) or column (B) and per 128 of K: A's scales (M, ceil(K/128)),
//                  B's (N, ceil(K/128)), row-major (the activations' layout in DeepSeek-V3)
//   kBlock128x128  one per 128 x 128 block: A's (ceil(M/128), ceil(K/128)), B's
//                  (ceil(K/128), ceil(N/128)), row-major (the weights' layout)
//
// The bound (scaled_gemm_allowed_error): products of two fp8 values are exact in fp32, and
// Hopper's fp8 wgmma accumulates them with about 14 bits of mantissa before the kernel promotes
// the partial sum into fp32 registers every `promotion` k-steps (DeepSeek-V3 measured 2^-13-ish
// relative error over 4096 terms without promotion). So, per element,
//   |out - ref| <= u_out * |ref| + floor_out + 8 * (sqrt(P) * 2^-13 + sqrt(K) * 2^-24) * magnitude
//   magnitude = sum_k |deq(A)[i, k] * deq(B)[k, j]|, P = min(promotion, K)
// the GEMM rule (tolerance.h) with one more term for the reduced-precision partial sums; a kernel
// that never promotes (P = K) is held to its full length. Loose on purpose until measured on the
// H100: rounding errors that cancel would allow ~100x less, but a truncating accumulator adds
// them up linearly. It still fails a kernel that drops one K-block of 32 (tested).
#pragma once

#include <cstdint>

#include "optimized/core.h"
#include "optimized/gemm.h"
#include "testing/check.h"

namespace optimized::testing {

enum class Fp8Format : uint8_t { kE4M3, kE5M2 };
// The scale layouts are the library's (optimized::ScaleLayout, optimized::scale_count in gemm.h).

double fp8_to_double(uint8_t bits, Fp8Format format);

// One fp8 operand: element (r, c) at data[r * row_stride + c * col_stride]; A is (M, K), B (K, N).
struct ScaledOperand {
  const uint8_t* data = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;
  ScaleLayout layout = ScaleLayout::kTensor;
};

// The scale of element (r, c) of the operand.
double scale_at(const ScaledOperand& op, int64_t r, int64_t c, bool a);

// out (M x N, row-major doubles) = deq(A) @ deq(B) in float64; magnitude (optional, same shape):
// sum_k |deq(A)[i, k] deq(B)[k, j]|. Errors (kInvalidArgument) name the operand for mismatched
// sizes or a missing scale.
void scaled_matmul_reference_f64(const ScaledOperand& a, const ScaledOperand& b, double* out, double* magnitude);

// The allowed error of one output element (above). out: the output dtype (bf16, fp16, fp32).
// promotion 0: a kernel that accumulates in fp32 throughout (the plain GEMM rule, no
// reduced-precision term).
double scaled_gemm_allowed_error(DType out, int64_t k, int64_t promotion, double ref, double magnitude);

// Checks an output c (host, (M, N) row-major, rows ldc apart, dtype out) of scaled_matmul against
// the reference, + bias (host, N doubles, or null), with the bound above for `promotion`.
// samples == 0 checks every element; otherwise the first and last rows and columns and `samples`
// elements from a fixed-seed generator (only those are computed: large problems stay cheap).
CheckResult check_scaled_gemm(const ScaledOperand& a, const ScaledOperand& b, const double* bias, const void* c,
                              DType out, int64_t ldc, int64_t promotion, int64_t samples = 0);

}  // namespace optimized::testing
