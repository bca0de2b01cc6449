// The tolerance rules (see tolerance.h).
#include "testing/tolerance.h"

#include <cmath>

#include "optimized/buffer.h"

namespace optimized::testing {

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kF16: return std::ldexp(1.0, -11);
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kF64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}

double accumulation_unit(DType dtype) { return dtype == DType::kF64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24); }

double half_subnormal_step(DType dtype) {
  switch (dtype) {
    case DType::kF16: return std::ldexp(1.0, -25);
    case DType::kBF16: return std::ldexp(1.0, -134);
    case DType::kF64: return std::ldexp(1.0, -1075);
    default: return std::ldexp(1.0, -150);
  }
}

double reduction_floor(DType dtype) {
  switch (dtype) {
    case DType::kF16: return std::ldexp(1.0, -24);
    case DType::kF64: return std::ldexp(1.0, -1022);
    default: return std::ldexp(1.0, -126);
  }
}

double round_to(DType dtype, double v) {
  if (dtype == DType::kF64 || !std::isfinite(v)) return v;
  unsigned char bytes[8];
  store_from_double(bytes, dtype, 0, v);
  return load_as_double(bytes, dtype, 0);
}

double gemm_allowed_error(DType out, int64_t k, double ref, double magnitude) {
  const double acc = 8.0 * std::sqrt(static_cast<double>(k)) * accumulation_unit(out);
  return unit_roundoff(out) * std::fabs(ref) + half_subnormal_step(out) + acc * magnitude;
}

double reduction_allowed_error(DType out, int64_t n, double same_error, double max_ref, double terms, double u_acc) {
  const double scale = std::max(max_ref, terms);
  return 2.0 * same_error + 2.0 * unit_roundoff(out) * max_ref + 16.0 * std::sqrt(static_cast<double>(n)) * u_acc * scale +
         reduction_floor(out);
}

}  // namespace optimized::testing
