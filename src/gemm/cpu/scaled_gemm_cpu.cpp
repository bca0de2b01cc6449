// The scaled (fp8) GEMM on the CPU: the readable baseline of the scaled ladder, and what
// scaled_matmul runs on CPU tensors. Each element is decoded through a 256-entry table and scaled
// as it is read (dequantize on load): B once into an fp32 (N, K) panel with its scales applied,
// then, per row of A, the row dequantized the same way and one fp32 dot product per output (eight
// partial sums, so that the loop vectorizes).
// Threads (OpenMP) take rows of C. Any strides, every scale layout.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "core/host_dtype.h"
#include "gemm/cpu/activation.h"
#include "gemm/scaled_params.h"
#include "optimized/buffer.h"

namespace optimized::cpu {
namespace {

using Table = std::array<float, 256>;

const Table& decode_table(DType dtype) {
  static const Table e4m3 = [] {
    Table t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  static const Table e5m2 = [] {
    Table t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8_e5m2_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  return dtype == DType::kF8E5M2 ? e5m2 : e4m3;
}

void store(void* c, int64_t i, DType dtype, float v) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(c)[i] = v; return;
    case DType::kF16: static_cast<uint16_t*>(c)[i] = float_to_half(v); return;
    default: static_cast<uint16_t*>(c)[i] = float_to_bf16(v); return;
  }
}

// Element j of a vector or matrix of dtype, as fp32 (the bias; C read back for beta).
float load_bias(const void* bias, int64_t j, DType dtype) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(bias)[j];
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(bias)[j]);
    default: return bf16_to_float(static_cast<const uint16_t*>(bias)[j]);
  }
}

}  // namespace

void scaled_gemm(const ScaledGemmParams& p, int threads) {
  const Table& ta = decode_table(p.a_dtype);
  const Table& tb = decode_table(p.b_dtype);
  const auto* a = static_cast<const uint8_t*>(p.a);
  const auto* b = static_cast<const uint8_t*>(p.b);
  // B dequantized and transposed: bt[j * K + kk] = B(kk, j) * scale_b(kk, j).
  std::vector<float> bt(static_cast<size_t>(p.n * p.k));
  const int all = threads > 0 ? threads : omp_get_max_threads();
  const auto capped = [all](int64_t work) { return std::max(1, static_cast<int>(std::min<int64_t>(all, work))); };
  const int nth = capped(p.m);
#pragma omp parallel for num_threads(capped(p.n)) schedule(static)
  for (int64_t j = 0; j < p.n; ++j)
    for (int64_t kk = 0; kk < p.k; ++kk)
      bt[j * p.k + kk] = tb[b[kk * p.b_row_stride + j * p.b_col_stride]] * scaled_gemm_scale_b(p, kk, j);

#pragma omp parallel num_threads(nth)
  {
    std::vector<float> row(static_cast<size_t>(p.k));
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t kk = 0; kk < p.k; ++kk)
        row[kk] = ta[a[i * p.a_row_stride + kk * p.a_col_stride]] * scaled_gemm_scale_a(p, i, kk);
      for (int64_t j = 0; j < p.n; ++j) {
        const float* y = &bt[j * p.k];
        // Eight independent partial sums (a strict-order sum would wait on each add's latency and
        // never vectorize), added in a fixed order at the end: deterministic.
        float part[8] = {};
        int64_t kk = 0;
        for (; kk + 8 <= p.k; kk += 8)
          for (int l = 0; l < 8; ++l) part[l] += row[kk + l] * y[kk + l];
        for (; kk < p.k; ++kk) part[0] += row[kk] * y[kk];
        float acc = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        if (p.bias) acc += load_bias(p.bias, j, p.c_dtype);
        if (p.beta != 0.0f) acc += p.beta * load_bias(p.c, i * p.ldc + j, p.c_dtype);
        if (p.aux) store(p.aux, i * p.ld_aux + j, p.c_dtype, acc);
        store(p.c, i * p.ldc + j, p.c_dtype, activate(p.activation, acc));
      }
    }
  }
}

}  // namespace optimized::cpu
