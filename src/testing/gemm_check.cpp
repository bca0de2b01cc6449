// GEMM result validation against float64 dot products (see gemm_check.h for the bound).
#include "testing/gemm_check.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
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

namespace {

double act_ref(Activation act, double x) {
  switch (act) {
    case Activation::kRelu: return x > 0 ? x : 0.0;
    case Activation::kGeluErf: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case Activation::kGeluTanh: return 0.5 * x * (1 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case Activation::kSilu: return x / (1 + std::exp(-x));
    default: return x;
  }
}

double act_grad_ref(Activation act, double x) {
  switch (act) {
    case Activation::kRelu: return x > 0 ? 1.0 : 0.0;
    case Activation::kGeluErf: return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
    case Activation::kGeluTanh: {
      const double c = std::sqrt(2.0 / M_PI), t = std::tanh(c * (x + 0.044715 * x * x * x));
      return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
    }
    case Activation::kSilu: {
      const double sg = 1 / (1 + std::exp(-x));
      return sg * (1 + x * (1 - sg));
    }
    default: return 1.0;
  }
}

// One element into r: counted, its error / allowed kept, and a failure noted (the first with its
// place, named by where() only then).
template <typename Where>
void tally(CheckResult& r, double got, double ref, double allowed, const Where& where) {
  double ratio = 0;
  ++r.checked;
  if (!element_ok(got, ref, allowed, &ratio) && r.failures++ == 0) {
    std::ostringstream s;
    s << where() << " = " << got << ", expected " << ref << " (allowed error " << allowed << ")";
    r.first_failure = s.str();
  }
  r.worst_ratio = std::max(r.worst_ratio, ratio);
}

std::string place(const char* name, std::initializer_list<int64_t> index) {
  std::string s = std::string(name) + "[";
  for (int64_t i : index) s += (s.back() == '[' ? "" : ", ") + std::to_string(i);
  return s + "]";
}

}  // namespace

CheckResult check_gemm_epilogue(const TensorView& a, const TensorView& b, const TensorView* c0, const TensorView& c_out,
                                const GemmEpilogue& e, float alpha, float beta, int64_t samples) {
  for (const TensorView* t : {&a, &b, &c_out, c0, e.bias, e.aux, e.residual, e.column_sums})
    if (t && t->device.is_cuda())
      throw Error(Status::kInvalidArgument, "check_gemm_epilogue: expected host views; given " + t->describe());
  if (beta != 0.0f && !c0)
    throw Error(Status::kInvalidArgument, "c0: expected the input C when beta != 0; given null");
  const int64_t m = a.shape[a.rank - 2], k = a.shape[a.rank - 1], n = b.shape[b.rank - 1];
  const int64_t batch = c_out.rank == 3 ? c_out.shape[0] : 1;
  const DType out_dtype = c_out.dtype;
  const double u_out = unit_roundoff(out_dtype), u32 = std::ldexp(1.0, -24), floor = half_subnormal_step(out_dtype);

  std::vector<int64_t> columns;
  if (samples > 0 && samples + 2 < n) {
    std::mt19937_64 rng(0x5eed);
    columns = {0, n - 1};
    for (int64_t s = 0; s < samples; ++s) columns.push_back(static_cast<int64_t>(rng() % n));
    std::sort(columns.begin(), columns.end());
    columns.erase(std::unique(columns.begin(), columns.end()), columns.end());
  } else {
    for (int64_t j = 0; j < n; ++j) columns.push_back(j);
  }
  const auto at = [](const TensorView& t, int64_t z, int64_t i, int64_t j) {
    return load_as_double(t.data, t.dtype, element_offset(t, z, i, j));
  };

  // One column of one batch: every row's C (and aux), then the column's sum.
  const auto check_column = [&](int64_t z, int64_t j, CheckResult& r, double& max_err, double& max_ref) {
    double sum_ref = 0, sum_allowed = 0, sum_abs = 0;
    for (int64_t i = 0; i < m; ++i) {
      double dot = 0, magnitude = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = at(a, z, i, p), y = at(b, z, p, j);
        dot += x * y;
        magnitude += std::fabs(x * y);
      }
      double pre = static_cast<double>(alpha) * dot;
      magnitude *= std::fabs(alpha);
      if (beta != 0.0f) {
        const double old = at(*c0, z, i, j);
        pre += static_cast<double>(beta) * old;
        magnitude += std::fabs(beta * old);
      }
      if (e.bias) pre += load_as_double(e.bias->data, e.bias->dtype, (e.bias_along_m ? i : j) * e.bias->strides[0]);
      const double e_pre = 8.0 * std::sqrt(static_cast<double>(k)) * u32 * magnitude + u32 * std::fabs(pre);
      const double res = e.residual ? at(*e.residual, z, i, j) : 0.0;
      double out, slack;
      // The activations in fp32 lose to cancellation where they are small (1 + erf(x) for x << 0):
      // their absolute error scales with |x|, not with the result, hence the |pre| and |aux| terms.
      if (e.activation_grad) {
        const double x = at(*e.aux, z, i, j), d = act_grad_ref(e.activation, x);
        out = pre * d + res;
        slack = e_pre * std::fabs(d) + 8 * u32 * (std::fabs(pre) * (1 + std::fabs(x)) + std::fabs(pre * d) + std::fabs(res));
      } else {
        const double y = act_ref(e.activation, pre);
        out = y + res;
        const double act_error = e.activation == Activation::kNone ? 0.0 : 8 * u32 * std::fabs(pre);
        slack = (e.activation == Activation::kNone ? 1.0 : 1.2) * e_pre + act_error + 8 * u32 * (std::fabs(y) + std::fabs(res));
        if (e.aux)
          tally(r, at(*e.aux, z, i, j), pre, e_pre + u_out * std::fabs(pre) + floor + u32 * std::fabs(pre),
                [&] { return place("aux", {z, i, j}); });
      }
      const double got = at(c_out, z, i, j);
      tally(r, got, out, slack + u_out * std::fabs(out) + floor, [&] { return place("C", {z, i, j}); });
      if (std::isfinite(got)) max_err = std::max(max_err, std::fabs(got - out));
      max_ref = std::max(max_ref, std::fabs(out));
      sum_ref += out;
      sum_allowed += slack + u32 * std::fabs(out);
      sum_abs += std::fabs(out);
    }
    if (e.column_sums) {
      tally(r, load_as_double(e.column_sums->data, DType::kF32, z * n + j), sum_ref,
            sum_allowed + static_cast<double>(m > 1 ? m - 1 : 1) * u32 * sum_abs + std::ldexp(1.0, -126),
            [&] { return place("column_sums", {z, j}); });
    }
  };

  const int64_t units = batch * static_cast<int64_t>(columns.size());
  const int64_t threads = units * m * k < (int64_t{1} << 22)
                              ? 1
                              : std::min<int64_t>({std::max(1u, std::thread::hardware_concurrency()), 16, units});
  std::vector<CheckResult> parts(static_cast<size_t>(threads));
  std::vector<double> errs(static_cast<size_t>(threads)), refs(static_cast<size_t>(threads));
  const auto part = [&](int64_t t) {
    for (int64_t u = units * t / threads; u < units * (t + 1) / threads; ++u)
      check_column(u / static_cast<int64_t>(columns.size()), columns[static_cast<size_t>(u % static_cast<int64_t>(columns.size()))],
                   parts[static_cast<size_t>(t)], errs[static_cast<size_t>(t)], refs[static_cast<size_t>(t)]);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(part, t);
  part(0);
  for (std::thread& th : pool) th.join();
  CheckResult r;
  double max_err = 0, max_ref = 0;
  for (size_t t = 0; t < parts.size(); ++t) {
    parts[t].passed = parts[t].failures == 0;
    r.merge(parts[t]);
    max_err = std::max(max_err, errs[t]);
    max_ref = std::max(max_ref, refs[t]);
  }
  r.max_rel_error = max_ref > 0 ? max_err / max_ref : max_err;
  r.passed = r.failures == 0 && r.checked > 0;
  return r;
}

}  // namespace optimized::testing
