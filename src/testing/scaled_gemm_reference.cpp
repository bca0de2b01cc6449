// The float64 reference of a scaled (fp8) GEMM and its bound (scaled_gemm_reference.h).
#include "testing/scaled_gemm_reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "optimized/buffer.h"
#include "testing/tolerance.h"

namespace optimized::testing {

namespace {
int64_t blocks128(int64_t n) { return (n + 127) / 128; }
[[noreturn]] void invalid(const std::string& message) { throw Error(Status::kInvalidArgument, message); }
}  // namespace

double fp8_to_double(uint8_t bits, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? fp8_e4m3_to_float(bits) : fp8_e5m2_to_float(bits);
}

double scale_at(const ScaledOperand& op, int64_t r, int64_t c, bool a) {
  const int64_t outer = a ? r : c, k = a ? c : r, k_blocks = blocks128(a ? op.cols : op.rows);
  switch (op.layout) {
    case ScaleLayout::kTensor: return op.scale[0];
    case ScaleLayout::kRowwise: return op.scale[outer];
    case ScaleLayout::kBlock1x128: return op.scale[outer * k_blocks + k / 128];
    case ScaleLayout::kBlock128x128: return op.scale[(r / 128) * blocks128(op.cols) + c / 128];
  }
  return 0;
}

void scaled_matmul_reference_f64(const ScaledOperand& a, const ScaledOperand& b, double* out, double* magnitude) {
  if (!a.data || !a.scale) invalid("a: expected data and scales; given a null pointer");
  if (!b.data || !b.scale) invalid("b: expected data and scales; given a null pointer");
  if (a.cols != b.rows)
    invalid("b: expected " + std::to_string(a.cols) + " rows (K, a's columns); given " + std::to_string(b.rows));
  const int64_t m = a.rows, n = b.cols, k = a.cols;
  // Dequantize once: A row-major (M, K), B transposed (N, K), so the inner loop is contiguous.
  std::vector<double> da(static_cast<size_t>(m * k)), db(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t kk = 0; kk < k; ++kk)
      da[i * k + kk] = fp8_to_double(a.data[i * a.row_stride + kk * a.col_stride], a.format) * scale_at(a, i, kk, true);
  for (int64_t kk = 0; kk < k; ++kk)
    for (int64_t j = 0; j < n; ++j)
      db[j * k + kk] = fp8_to_double(b.data[kk * b.row_stride + j * b.col_stride], b.format) * scale_at(b, kk, j, false);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      const double* x = &da[i * k];
      const double* y = &db[j * k];
      for (int64_t kk = 0; kk < k; ++kk) {
        sum += x[kk] * y[kk];
        mag += std::fabs(x[kk] * y[kk]);
      }
      out[i * n + j] = sum;
      if (magnitude) magnitude[i * n + j] = mag;
    }
}

double scaled_gemm_allowed_error(DType out, int64_t k, int64_t promotion, double ref, double magnitude) {
  const double p = static_cast<double>(std::max<int64_t>(1, std::min(promotion, k)));
  const double partial = 8.0 * std::sqrt(p) * std::ldexp(1.0, -13) * magnitude;
  return gemm_allowed_error(out, k, ref, magnitude) + partial;
}

}  // namespace optimized::testing
