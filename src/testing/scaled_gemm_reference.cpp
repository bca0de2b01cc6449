// The float64 reference of a scaled (fp8) GEMM and its bound (scaled_gemm_reference.h).
#include "testing/scaled_gemm_reference.h"

#include <algorithm>
#include <random>
#include <utility>
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
  if (promotion <= 0) return gemm_allowed_error(out, k, ref, magnitude);  // fp32 accumulation throughout
  const double p = static_cast<double>(std::max<int64_t>(1, std::min(promotion, k)));
  const double partial = 8.0 * std::sqrt(p) * std::ldexp(1.0, -13) * magnitude;
  return gemm_allowed_error(out, k, ref, magnitude) + partial;
}

CheckResult check_scaled_gemm(const ScaledOperand& a, const ScaledOperand& b, const double* bias, const void* c,
                              DType out, int64_t ldc, int64_t promotion, int64_t samples) {
  if (a.cols != b.rows)
    invalid("b: expected " + std::to_string(a.cols) + " rows (K, a's columns); given " + std::to_string(b.rows));
  const int64_t m = a.rows, n = b.cols, k = a.cols;
  std::vector<std::pair<int64_t, int64_t>> elements;
  if (samples > 0 && samples < m * n) {
    std::mt19937_64 rng(0x5ca1ed);
    for (int64_t s = 0; s < samples; ++s)
      elements.emplace_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(m)),
                            static_cast<int64_t>(rng() % static_cast<uint64_t>(n)));
    // The first and last rows and columns whole (the tiles' edges), then the sample.
    for (int64_t j = 0; j < n; ++j) elements.insert(elements.end(), {{0, j}, {m - 1, j}});
    for (int64_t i = 0; i < m; ++i) elements.insert(elements.end(), {{i, 0}, {i, n - 1}});
  } else {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) elements.emplace_back(i, j);
  }
  // Dequantized rows of A and columns of B, on demand.
  std::vector<std::vector<double>> rows(static_cast<size_t>(m)), cols(static_cast<size_t>(n));
  const auto row = [&](int64_t i) -> const std::vector<double>& {
    std::vector<double>& r = rows[static_cast<size_t>(i)];
    if (r.empty()) {
      r.resize(static_cast<size_t>(k));
      for (int64_t kk = 0; kk < k; ++kk)
        r[kk] = fp8_to_double(a.data[i * a.row_stride + kk * a.col_stride], a.format) * scale_at(a, i, kk, true);
    }
    return r;
  };
  const auto col = [&](int64_t j) -> const std::vector<double>& {
    std::vector<double>& r = cols[static_cast<size_t>(j)];
    if (r.empty()) {
      r.resize(static_cast<size_t>(k));
      for (int64_t kk = 0; kk < k; ++kk)
        r[kk] = fp8_to_double(b.data[kk * b.row_stride + j * b.col_stride], b.format) * scale_at(b, kk, j, false);
    }
    return r;
  };
  CheckResult result;
  result.passed = true;
  double max_err = 0, max_ref = 0;
  for (auto [i, j] : elements) {
    const std::vector<double>& x = row(i);
    const std::vector<double>& y = col(j);
    double ref = 0, mag = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
      ref += x[kk] * y[kk];
      mag += std::fabs(x[kk] * y[kk]);
    }
    if (bias) {
      ref += bias[j];
      mag += std::fabs(bias[j]);
    }
    const double got = load_as_double(c, out, i * ldc + j);
    double ratio = 0;
    const bool ok = element_ok(got, ref, scaled_gemm_allowed_error(out, k, promotion, ref, mag), &ratio);
    ++result.checked;
    result.worst_ratio = std::max(result.worst_ratio, ratio);
    if (std::isfinite(got) && std::isfinite(ref)) {
      max_err = std::max(max_err, std::fabs(got - ref));
      max_ref = std::max(max_ref, std::fabs(ref));
    }
    if (!ok) {
      if (result.failures++ == 0)
        result.first_failure = "C[" + std::to_string(i) + ", " + std::to_string(j) + "] = " + std::to_string(got) +
                               ", expected " + std::to_string(ref) + " (allowed " +
                               std::to_string(scaled_gemm_allowed_error(out, k, promotion, ref, mag)) + ")";
      result.passed = false;
    }
  }
  result.max_rel_error = max_ref > 0 ? max_err / max_ref : max_err;
  return result;
}

}  // namespace optimized::testing
