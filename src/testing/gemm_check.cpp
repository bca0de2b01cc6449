// GEMM result validation against float64 dot products (see gemm_check.h for the bound).
#include "testing/gemm_check.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "optimized/buffer.h"
#include "testing/gemm_reference.h"
#include "testing/tolerance.h"

namespace optimized::testing {

namespace {

// The check of the elements (z, i, j) that for_each(visit) visits.
template <typename ForEach>
CheckResult check_elements(const TensorView& a, const TensorView& b, const TensorView* c0, const TensorView& c_out,
                           float alpha, float beta, const ForEach& for_each) {
  const int64_t k = a.shape[a.rank - 1];
  CheckResult r;
  double max_err = 0, max_ref = 0;
  for_each([&](int64_t z, int64_t i, int64_t j) {
    double dot = 0, magnitude = 0;
    for (int64_t p = 0; p < k; ++p) {
      const double x = load_as_double(a.data, a.dtype, element_offset(a, z, i, p));
      const double y = load_as_double(b.data, b.dtype, element_offset(b, z, p, j));
      dot += x * y;
      magnitude += std::fabs(x * y);
    }
    double ref = static_cast<double>(alpha) * dot;
    magnitude *= std::fabs(alpha);
    if (beta != 0.0f) {
      const double old = load_as_double(c0->data, c0->dtype, element_offset(*c0, z, i, j));
      ref += static_cast<double>(beta) * old;
      magnitude += std::fabs(beta * old);
    }
    const double got = load_as_double(c_out.data, c_out.dtype, element_offset(c_out, z, i, j));
    const double allowed = gemm_allowed_error(c_out.dtype, k, ref, magnitude);
    ++r.checked;
    double ratio = 0;
    const bool ok = element_ok(got, ref, allowed, &ratio);
    if (std::isfinite(ref)) {
      r.worst_ratio = std::max(r.worst_ratio, ratio);
      if (std::isfinite(got)) max_err = std::max(max_err, std::fabs(got - ref));
      max_ref = std::max(max_ref, std::fabs(ref));
    }
    if (!ok && r.failures++ == 0) {
      std::ostringstream s;
      s << "C[" << z << ", " << i << ", " << j << "] = " << got << ", expected " << ref << " (allowed error "
        << allowed << ")";
      r.first_failure = s.str();
    }
  });
  r.max_rel_error = max_ref > 0 ? max_err / max_ref : max_err;
  r.passed = r.failures == 0 && r.checked > 0;
  return r;
}

// Rows [first, first + rows) of a rank-2/3 view.
TensorView row_block(const TensorView& t, int64_t first, int64_t rows) {
  TensorView v = t;
  const int r = t.rank;
  v.data = static_cast<char*>(t.data) + first * t.strides[r - 2] * static_cast<int64_t>(dtype_size(t.dtype));
  v.shape[r - 2] = rows;
  return v;
}

}  // namespace

CheckResult check_gemm(const TensorView& a, const TensorView& b, const TensorView* c0, const TensorView& c_out,
                       float alpha, float beta, int64_t samples) {
  for (const TensorView* t : {&a, &b, &c_out, c0})
    if (t && (t->device.is_cuda() || (t->rank != 2 && t->rank != 3)))
      throw Error(Status::kInvalidArgument, "check_gemm: expected rank-2/3 host views; given " + t->describe());
  if (beta != 0.0f && !c0)
    throw Error(Status::kInvalidArgument, "c0: expected the input C when beta != 0; given null");
  const int64_t m = a.shape[a.rank - 2], k = a.shape[a.rank - 1], n = b.shape[b.rank - 1];
  const int64_t batch = c_out.rank == 3 ? c_out.shape[0] : 1;
  const int64_t total = batch * m * n;

  if (samples > 0 && samples < total) {  // the corners of every batch plus a fixed-seed sample
    std::vector<std::array<int64_t, 3>> where;
    for (int64_t z = 0; z < batch; ++z)
      for (auto [i, j] : {std::pair{0L, 0L}, {0L, n - 1}, {m - 1, 0L}, {m - 1, n - 1}}) where.push_back({z, i, j});
    std::mt19937_64 rng(0x5eed);
    for (int64_t s = 0; s < samples; ++s)
      where.push_back({static_cast<int64_t>(rng() % batch), static_cast<int64_t>(rng() % m),
                       static_cast<int64_t>(rng() % n)});
    return check_elements(a, b, c0, c_out, alpha, beta, [&](const auto& visit) {
      for (const auto& [z, i, j] : where) visit(z, i, j);
    });
  }

  // Every element, over row blocks in parallel threads when the problem is large.
  const int64_t threads = total * k < (int64_t{1} << 22)
                              ? 1
                              : std::min<int64_t>({std::max(1u, std::thread::hardware_concurrency()), 16, m});
  std::vector<CheckResult> parts(static_cast<size_t>(threads));
  const auto part = [&](int64_t t) {
    const int64_t i0 = m * t / threads, rows = m * (t + 1) / threads - i0;
    const TensorView c0_block = c0 ? row_block(*c0, i0, rows) : TensorView();
    parts[static_cast<size_t>(t)] = check_elements(
        row_block(a, i0, rows), b, c0 ? &c0_block : nullptr, row_block(c_out, i0, rows), alpha, beta,
        [&](const auto& visit) {
          for (int64_t z = 0; z < batch; ++z)
            for (int64_t i = 0; i < rows; ++i)
              for (int64_t j = 0; j < n; ++j) visit(z, i, j);
        });
    if (!parts[static_cast<size_t>(t)].first_failure.empty() && threads > 1)
      parts[static_cast<size_t>(t)].first_failure =
          "(rows from " + std::to_string(i0) + ") " + parts[static_cast<size_t>(t)].first_failure;
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(part, t);
  part(0);
  for (std::thread& th : pool) th.join();
  CheckResult r;
  for (const CheckResult& p : parts) r.merge(p);
  r.passed = r.passed && r.checked > 0;
  return r;
}

}  // namespace optimized::testing
