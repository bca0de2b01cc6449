// GEMM result validation against float64 dot products (see gemm_check.h for the bound).
#include "gemm/gemm_check.h"

#include <array>
#include <cmath>
#include <random>
#include <sstream>
#include <vector>

#include "optimized/buffer.h"

namespace optimized {

namespace {

int64_t offset(const TensorView& t, int64_t z, int64_t i, int64_t j) {
  const int r = t.rank;
  const int64_t batch_offset = (r == 3 && t.shape[0] > 1) ? z * t.strides[0] : 0;
  return batch_offset + i * t.strides[r - 2] + j * t.strides[r - 1];
}

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kF16: return std::ldexp(1.0, -11);
    case DType::kBF16: return std::ldexp(1.0, -8);
    case DType::kF64: return std::ldexp(1.0, -53);
    default: return std::ldexp(1.0, -24);
  }
}

// Half the spacing of the dtype's subnormals: the rounding error below the normal range, where it
// no longer scales with the value.
double half_subnormal_step(DType dtype) {
  switch (dtype) {
    case DType::kF16: return std::ldexp(1.0, -25);
    case DType::kBF16: return std::ldexp(1.0, -134);
    case DType::kF64: return std::ldexp(1.0, -1075);
    default: return std::ldexp(1.0, -150);
  }
}

}  // namespace

GemmCheckResult check_gemm(const TensorView& a, const TensorView& b, const TensorView* c0,
                           const TensorView& c_out, float alpha, float beta, int64_t samples) {
  for (const TensorView* t : {&a, &b, &c_out, c0})
    if (t && (t->device.is_cuda() || (t->rank != 2 && t->rank != 3)))
      throw Error(Status::kInvalidArgument, "check_gemm: expected rank-2/3 host views; given " + t->describe());
  if (beta != 0.0f && !c0)
    throw Error(Status::kInvalidArgument, "c0: expected the input C when beta != 0; given null");
  const int64_t m = a.shape[a.rank - 2], k = a.shape[a.rank - 1], n = b.shape[b.rank - 1];
  const int64_t batch = c_out.rank == 3 ? c_out.shape[0] : 1;
  const double out_eps = unit_roundoff(c_out.dtype);
  const double out_floor = half_subnormal_step(c_out.dtype);
  // Products accumulate in fp32, or in fp64 for fp64 operands.
  const double acc_unit = c_out.dtype == DType::kF64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  const double acc_eps = 8.0 * std::sqrt(static_cast<double>(k)) * acc_unit;

  // Which elements: all, or the corners of every batch plus a fixed-seed sample.
  std::vector<std::array<int64_t, 3>> where;
  const int64_t total = batch * m * n;
  if (samples <= 0 || samples >= total) {
    where.reserve(static_cast<size_t>(total));
    for (int64_t z = 0; z < batch; ++z)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) where.push_back({z, i, j});
  } else {
    for (int64_t z = 0; z < batch; ++z)
      for (auto [i, j] : {std::pair{0L, 0L}, {0L, n - 1}, {m - 1, 0L}, {m - 1, n - 1}}) where.push_back({z, i, j});
    std::mt19937_64 rng(0x5eed);
    for (int64_t s = 0; s < samples; ++s)
      where.push_back({static_cast<int64_t>(rng() % batch), static_cast<int64_t>(rng() % m),
                       static_cast<int64_t>(rng() % n)});
  }

  GemmCheckResult r;
  double max_err = 0, max_ref = 0;
  for (const auto& [z, i, j] : where) {
    double dot = 0, scale = 0;
    for (int64_t p = 0; p < k; ++p) {
      const double x = load_as_double(a.data, a.dtype, offset(a, z, i, p));
      const double y = load_as_double(b.data, b.dtype, offset(b, z, p, j));
      dot += x * y;
      scale += std::fabs(x * y);
    }
    double ref = static_cast<double>(alpha) * dot;
    scale *= std::fabs(alpha);
    if (beta != 0.0f) {
      const double old = load_as_double(c0->data, c0->dtype, offset(*c0, z, i, j));
      ref += static_cast<double>(beta) * old;
      scale += std::fabs(beta * old);
    }
    const double got = load_as_double(c_out.data, c_out.dtype, offset(c_out, z, i, j));
    ++r.checked;
    bool ok;
    double allowed = out_eps * std::fabs(ref) + out_floor + acc_eps * scale;
    if (std::isnan(ref) || std::isnan(got) || std::isinf(ref)) {
      ok = (std::isnan(ref) && std::isnan(got)) || (std::isinf(ref) && got == ref);
    } else {
      // A finite reference beyond the dtype's range legitimately rounds to Inf.
      const double err = std::isinf(got) ? INFINITY : std::fabs(got - ref);
      ok = err <= allowed;
      r.worst_ratio = std::max(r.worst_ratio, err / allowed);
      max_err = std::max(max_err, err);
      max_ref = std::max(max_ref, std::fabs(ref));
    }
    if (!ok) {
      ++r.failures;
      if (r.first_failure.empty()) {
        std::ostringstream s;
        s << "C[" << z << ", " << i << ", " << j << "] = " << got << ", expected " << ref << " (allowed error "
          << allowed << ")";
        r.first_failure = s.str();
      }
    }
  }
  r.max_rel_error = max_ref > 0 ? max_err / max_ref : max_err;
  r.passed = r.failures == 0 && r.checked > 0;
  return r;
}

}  // namespace optimized
