// Shared machinery of the GEMM tests: one GemmCase describes a problem (sizes, leading dimensions,
// batch layout, alpha/beta, variant, where it runs); run_gemm_case() builds poisoned operands with
// fresh random values, runs optimized::matmul, and checks
//   1. every element of C against the float64 reference (optimized::testing::check_gemm), and
//   2. that no byte of C's storage outside the view (row padding, gaps between batches, a guard
//      zone after the end) was written.
// A and B are poisoned with NaN outside their views, so a kernel that reads row padding or past
// the end of an operand produces NaN where the reference is finite and fails the check.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/test_util.h"
#include "testing/gemm_check.h"
#include "testing/gemm_reference.h"
#include "testing/tolerance.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized::testing {

// ---- operands ---------------------------------------------------------------------------------

enum class Broadcast {
  kNone,     // one matrix per batch
  kStride0,  // a rank-3 view (batch, rows, cols) with batch stride 0
  kRank2,    // a rank-2 view that broadcasts over C's batch
};

inline const char* broadcast_name(Broadcast b) {
  switch (b) {
    case Broadcast::kNone: return "none";
    case Broadcast::kStride0: return "stride0";
    case Broadcast::kRank2: return "rank2";
  }
  return "?";
}

using Layout = GuardedLayout;

// The view of `data` with layout `l` as the operand of a GEMM with `batch` (0: rank-2 problem).
inline TensorView make_view(void* base, DType dtype, Device device, const Layout& l, int64_t batch,
                            Broadcast bc) {
  char* data = static_cast<char*>(base) + l.offset * static_cast<int64_t>(dtype_size(dtype));
  const int64_t row_stride = l.col_major ? 1 : l.ld, col_stride = l.col_major ? l.ld : 1;
  if (batch == 0 || bc == Broadcast::kRank2)
    return TensorView(data, dtype, device, {l.rows, l.cols}, {row_stride, col_stride});
  const int64_t bs = bc == Broadcast::kStride0 ? 0 : l.batch_stride;
  return TensorView(data, dtype, device, {batch, l.rows, l.cols}, {bs, row_stride, col_stride});
}

// Fills the view elements of `l` in host memory with uniform [-1, 1] values of `dtype`. Large
// operands are filled by several threads, each row from its own generator seeded from `rng`, so
// the values depend only on the seed.
inline void fill_random(void* host, DType dtype, const Layout& l, std::mt19937_64& rng) {
  const uint64_t seed = rng();
  const int64_t rows = l.batches * l.rows;
  const auto fill_rows = [&](int64_t first, int64_t last) {
    std::uniform_real_distribution<double> dist(-1.0, 1.0);
    for (int64_t r = first; r < last; ++r) {
      std::mt19937_64 row_rng(seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(r + 1)));
      const int64_t z = r / l.rows, i = r % l.rows;
      for (int64_t j = 0; j < l.cols; ++j) store_from_double(host, dtype, l.at(z, i, j), dist(row_rng));
    }
  };
  const int64_t elements = rows * l.cols;
  const int64_t threads =
      elements < (int64_t{1} << 20) ? 1 : std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), 16);
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(fill_rows, rows * t / threads, rows * (t + 1) / threads);
  fill_rows(0, rows / threads);
  for (std::thread& th : pool) th.join();
}

// ---- the case ---------------------------------------------------------------------------------

struct GemmCase {
  DType dtype = DType::kF32;
  GemmVariant variant = GemmVariant::kAuto;
  Device device = Device::cpu();
  int64_t m = 1, n = 1, k = 1;
  int64_t batch = 0;            // 0: rank-2 operands; >= 1: rank-3 C of this batch
  int64_t lda_pad = 0, ldb_pad = 0, ldc_pad = 0;  // leading dimension = stored width + pad
  bool a_col_major = false, b_col_major = false, c_col_major = false;  // the layouts (NN when all false)
  int64_t batch_gap = 0;        // extra elements between batches (all operands)
  int64_t offset = 0;           // elements from the buffer's (256-byte aligned) start to each view
  Broadcast a_bcast = Broadcast::kNone, b_bcast = Broadcast::kNone;
  float alpha = 1.0f, beta = 0.0f;
  int cpu_threads = 0;
  void* stream = nullptr;       // cudaStream_t for CUDA runs (nullptr: legacy default stream)
  int64_t samples = 0;          // 0: check every element

  std::string describe() const {
    std::ostringstream s;
    s << gemm_variant_name(variant) << " " << dtype_name(dtype) << " on " << device_name(device) << " M=" << m
      << " N=" << n << " K=" << k;
    if (batch) s << " batch=" << batch << " (a " << broadcast_name(a_bcast) << ", b " << broadcast_name(b_bcast) << ")";
    if (a_col_major || b_col_major || c_col_major)
      s << " layout " << (a_col_major ? "T" : "N") << (b_col_major ? "T" : "N") << (c_col_major ? " (C col-major)" : "");
    s << " lda=" << layout_a().ld << " ldb=" << layout_b().ld << " ldc=" << layout_c().ld;
    if (batch_gap) s << " batch_gap=" << batch_gap;
    if (offset) s << " offset=" << offset;
    s << " alpha=" << alpha << " beta=" << beta;
    if (cpu_threads) s << " threads=" << cpu_threads;
    if (stream) s << " (own stream)";
    if (samples) s << " samples=" << samples;
    return s.str();
  }

  Layout layout_a() const { return layout(m, k, lda_pad, a_col_major, a_bcast); }
  Layout layout_b() const { return layout(k, n, ldb_pad, b_col_major, b_bcast); }
  Layout layout_c() const { return layout(m, n, ldc_pad, c_col_major, Broadcast::kNone); }

 private:
  Layout layout(int64_t rows, int64_t cols, int64_t pad, bool col_major, Broadcast bc) const {
    Layout l;
    l.batches = (batch == 0 || bc != Broadcast::kNone) ? 1 : batch;
    l.rows = rows;
    l.cols = cols;
    l.col_major = col_major;
    l.ld = l.stored_cols() + pad;
    l.batch_stride = l.stored_rows() * l.ld + batch_gap;
    l.offset = offset;
    return l;
  }
};

// Host operands of a case, filled and poisoned. Tests may edit a/b/c0 (e.g. plant NaN) before
// running.
struct GemmOperands {
  GemmCase cs;
  Layout la, lb, lc;
  Buffer a, b, c0;  // host; c0 is C before the run (NaN-poisoned everywhere when beta == 0)

  explicit GemmOperands(const GemmCase& c)
      : cs(c), la(c.layout_a()), lb(c.layout_b()), lc(c.layout_c()),
        a(c.dtype, la.storage(), Device::cpu()), b(c.dtype, lb.storage(), Device::cpu()),
        c0(c.dtype, lc.storage(), Device::cpu()) {
    std::mt19937_64 rng = test_rng();
    a.fill_bytes(0xFF);  // NaN outside the views: reading padding or past the end shows up
    b.fill_bytes(0xFF);
    c0.fill_bytes(0xFF);  // NaN: an unwritten element, or one read when beta == 0, shows up
    fill_random(a.data(), c.dtype, la, rng);
    fill_random(b.data(), c.dtype, lb, rng);
    if (c.beta != 0.0f) fill_random(c0.data(), c.dtype, lc, rng);
  }

  TensorView host_a() const { return make_view(a.data(), cs.dtype, Device::cpu(), la, cs.batch, cs.a_bcast); }
  TensorView host_b() const { return make_view(b.data(), cs.dtype, Device::cpu(), lb, cs.batch, cs.b_bcast); }
  TensorView host_c(const Buffer& c) const {
    return make_view(c.data(), cs.dtype, Device::cpu(), lc, cs.batch, Broadcast::kNone);
  }
  void set_a(int64_t z, int64_t i, int64_t j, double v) { store_from_double(a.data(), cs.dtype, la.at(z, i, j), v); }
  void set_b(int64_t z, int64_t i, int64_t j, double v) { store_from_double(b.data(), cs.dtype, lb.at(z, i, j), v); }
};

struct GemmRun {
  Buffer c;  // host copy of C's whole storage after the run
  CheckResult check;
  int64_t bytes_written_outside = 0;  // elements outside the view whose bytes changed
  std::string first_outside;
};

// Runs the case on `ops`; throws what matmul throws. Fails the test (ADD_FAILURE) on CUDA errors.
// matmul on device copies `d` (a, b, c) of the case's operands.
inline void matmul_on_device(const GemmOperands& ops, const std::vector<void*>& d, const ExecutionContext& ctx) {
  const GemmCase& cs = ops.cs;
  matmul(make_view(d[0], cs.dtype, cs.device, ops.la, cs.batch, cs.a_bcast),
         make_view(d[1], cs.dtype, cs.device, ops.lb, cs.batch, cs.b_bcast),
         make_view(d[2], cs.dtype, cs.device, ops.lc, cs.batch, Broadcast::kNone), cs.alpha, cs.beta, cs.variant, ctx);
}

inline GemmRun run_gemm(GemmOperands& ops) {
  const GemmCase& cs = ops.cs;
  GemmRun run;
  run.c = Buffer(cs.dtype, ops.lc.storage(), Device::cpu());
  if (!cs.device.is_cuda()) {
    std::memcpy(run.c.data(), ops.c0.data(), ops.c0.bytes());
    ExecutionContext ctx;
    ctx.cpu_threads = cs.cpu_threads;
    matmul(ops.host_a(), ops.host_b(), ops.host_c(run.c), cs.alpha, cs.beta, cs.variant, ctx);
  } else {
    ExecutionContext ctx;
    ctx.cuda_stream = cs.stream;
    std::vector<Buffer> after;
    const std::string error = run_on_cuda({&ops.a, &ops.b, &ops.c0}, cs.device, cs.stream,
                                          [&](const std::vector<void*>& d) { matmul_on_device(ops, d, ctx); }, after);
    if (!error.empty()) {
      ADD_FAILURE() << cs.describe() << ": " << error;
      run.check.first_failure = "CUDA error";
      return run;
    }
    run.c = std::move(after[2]);
  }
  const TensorView a = ops.host_a(), b = ops.host_b(), c0 = ops.host_c(ops.c0), c = ops.host_c(run.c);
  run.check = check_gemm(a, b, cs.beta != 0.0f ? &c0 : nullptr, c, cs.alpha, cs.beta, cs.samples);

  int64_t first = -1;
  run.bytes_written_outside = changed_elements(ops.lc, dtype_size(cs.dtype), ops.c0.data(), run.c.data(), true, &first);
  if (run.bytes_written_outside) run.first_outside = "element " + std::to_string(first) + " of C's storage";
  return run;
}

// Runs and asserts: matmul does not throw, C matches the reference, nothing outside C's view changed.
inline void expect_gemm_ok(const GemmCase& cs) {
  SCOPED_TRACE(cs.describe());
  GemmOperands ops(cs);
  GemmRun run;
  try {
    run = run_gemm(ops);
  } catch (const Error& e) {
    FAIL() << cs.describe() << ": matmul threw (" << status_name(e.status()) << "): " << e.what();
  }
  EXPECT_TRUE(run.check.passed) << cs.describe() << ": " << run.check.failures << " of " << run.check.checked
                                << " elements wrong; first: " << run.check.first_failure
                                << "; worst error/allowed = " << run.check.worst_ratio;
  EXPECT_EQ(run.bytes_written_outside, 0)
      << cs.describe() << ": wrote outside C's view, first at " << run.first_outside;
}

// The error matmul throws for cs on CUDA (empty when it ran): for refusals a rung must give.
inline std::string gemm_cuda_error(const GemmCase& cs) {
  GemmOperands ops(cs);
  ExecutionContext ctx;
  ctx.cuda_stream = cs.stream;
  std::vector<Buffer> after;
  try {
    const std::string cuda_error = run_on_cuda({&ops.a, &ops.b, &ops.c0}, cs.device, cs.stream,
                                               [&](const std::vector<void*>& d) { matmul_on_device(ops, d, ctx); },
                                               after);
    ADD_FAILURE() << cs.describe() << ": expected matmul to throw; it ran (" << cuda_error << ")";
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// Whether TMA can describe A and B of cs (what the Hopper rungs need), decided here from the
// case's layout, independently of the library: 16-byte aligned views, row strides and (batched,
// not broadcast) batch strides in multiples of 16 bytes.
inline bool gemm_case_tma_describable(const GemmCase& cs) {
  const int64_t e = static_cast<int64_t>(dtype_size(cs.dtype));
  if ((cs.offset * e) % 16 != 0) return false;
  const auto ok = [&](const Layout& l, Broadcast bc) {
    // A vector with unit stride along its length is one contiguous row, whatever its layout says.
    const bool vector = (l.rows == 1 || l.cols == 1) && l.ld == 1;
    if (!vector && l.stored_rows() > 1 && (l.ld * e) % 16 != 0) return false;
    const bool batched = cs.batch > 1 && bc == Broadcast::kNone;
    return !batched || (l.batch_stride * e) % 16 == 0;
  };
  return ok(cs.layout_a(), cs.a_bcast) && ok(cs.layout_b(), cs.b_bcast);
}

// ---- NaN / Inf propagation --------------------------------------------------------------------

// Plants NaN in A row `nan_row` and +Inf in A row `inf_row` and -Inf in B column `inf_col`, runs,
// checks against the reference (NaN where it has NaN, Inf matched exactly) and that the whole NaN
// row of C is NaN.
inline void expect_nan_inf_propagation(GemmCase cs) {
  SCOPED_TRACE(cs.describe());
  GemmOperands ops(cs);
  const int64_t nan_row = cs.m > 2 ? cs.m / 2 : 0;
  const int64_t inf_row = cs.m > 2 ? cs.m - 1 : (cs.m - 1);
  const int64_t inf_col = cs.n > 1 ? 1 : 0;
  const int64_t batches = ops.la.batches;
  for (int64_t z = 0; z < batches; ++z) {
    ops.set_a(z, nan_row, cs.k / 3, std::nan(""));
    if (inf_row != nan_row) ops.set_a(z, inf_row, cs.k - 1, INFINITY);
  }
  for (int64_t z = 0; z < ops.lb.batches; ++z) ops.set_b(z, cs.k / 2, inf_col, -INFINITY);
  GemmRun run;
  try {
    run = run_gemm(ops);
  } catch (const Error& e) {
    FAIL() << cs.describe() << ": matmul threw (" << status_name(e.status()) << "): " << e.what();
  }
  EXPECT_TRUE(run.check.passed) << cs.describe() << ": " << run.check.failures << " of " << run.check.checked
                                << " elements wrong; first: " << run.check.first_failure;
  EXPECT_EQ(run.bytes_written_outside, 0) << cs.describe() << ": wrote outside C's view";
  const int64_t c_batches = ops.lc.batches;
  int64_t not_nan = 0, infs = 0;
  for (int64_t z = 0; z < c_batches; ++z) {
    for (int64_t j = 0; j < cs.n; ++j)
      if (!std::isnan(load_as_double(run.c.data(), cs.dtype, ops.lc.at(z, nan_row, j)))) ++not_nan;
    for (int64_t i = 0; i < cs.m; ++i)
      if (std::isinf(load_as_double(run.c.data(), cs.dtype, ops.lc.at(z, i, inf_col)))) ++infs;
  }
  EXPECT_EQ(not_nan, 0) << cs.describe() << ": a NaN in A row " << nan_row
                        << " must make every element of C row " << nan_row << " NaN";
  if (cs.m > 2) {
    EXPECT_GT(infs, 0) << cs.describe() << ": an Inf in B must give Inf in C's column";
  }
}

// ---- sizes ------------------------------------------------------------------------------------

struct Mnk {
  int64_t m, n, k;
};

inline std::string mnk_name(const Mnk& s) {
  return std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
}

// Odd sizes: 1, primes, non-multiples of every tile, and a few round ones.
inline std::vector<Mnk> odd_sizes() {
  return {{1, 1, 1},      {1, 257, 1},       {257, 1, 129},     {2, 3, 4},         {17, 33, 65},
          {31, 1, 97},    {64, 64, 64},      {127, 129, 131},   {255, 257, 100},   {512, 512, 512}};
}

inline std::string dtype_label(DType d) { return std::string(dtype_name(d)); }

// The operand layouts a test walks: A and B each row- or column-major (NN, NT, TN, TT), and with
// `with_c` the same four again with a column-major C (which the library computes as C^T = B^T A^T).
struct GemmLayout {
  bool a_col_major, b_col_major, c_col_major;
  std::string name() const {
    return std::string(a_col_major ? "T" : "N") + (b_col_major ? "T" : "N") + (c_col_major ? "_Ccol" : "");
  }
  void apply(GemmCase& cs) const {
    cs.a_col_major = a_col_major;
    cs.b_col_major = b_col_major;
    cs.c_col_major = c_col_major;
  }
};

inline std::vector<GemmLayout> gemm_layouts(bool with_c) {
  std::vector<GemmLayout> out;
  for (int c = 0; c < (with_c ? 2 : 1); ++c)
    for (int ab = 0; ab < 4; ++ab) out.push_back({(ab & 2) != 0, (ab & 1) != 0, c != 0});
  return out;
}

}  // namespace optimized::testing

namespace optimized::testing {

// Per-element tolerance of a GEMM output of `ops` (the check_gemm bound), with the float64
// reference: used to compare two variants' outputs with each other.
struct Reference {
  std::vector<double> ref;      // (batch, M, N)
  std::vector<double> allowed;  // check_gemm's per-element bound
};

inline Reference reference_with_bounds(const GemmOperands& ops) {
  const GemmCase& cs = ops.cs;
  const int64_t nb = ops.lc.batches;
  Reference r;
  r.ref.resize(static_cast<size_t>(nb * cs.m * cs.n));
  std::vector<double> scale(r.ref.size());
  const TensorView c0 = ops.host_c(ops.c0);
  matmul_reference_f64(ops.host_a(), ops.host_b(), cs.beta != 0.0f ? &c0 : nullptr, cs.alpha, cs.beta,
                       r.ref.data());
  // sum_k |a_ik b_kj| as the reference product of |A| and |B|.
  Buffer abs_a(cs.dtype, ops.la.storage(), Device::cpu()), abs_b(cs.dtype, ops.lb.storage(), Device::cpu());
  std::memcpy(abs_a.data(), ops.a.data(), ops.a.bytes());
  std::memcpy(abs_b.data(), ops.b.data(), ops.b.bytes());
  for (auto [buf, l] : {std::pair{&abs_a, ops.la}, std::pair{&abs_b, ops.lb}})
    for (int64_t z = 0; z < l.batches; ++z)
      for (int64_t i = 0; i < l.rows; ++i)
        for (int64_t j = 0; j < l.cols; ++j)
          store_from_double(buf->data(), cs.dtype, l.at(z, i, j),
                            std::fabs(load_as_double(buf->data(), cs.dtype, l.at(z, i, j))));
  matmul_reference_f64(make_view(abs_a.data(), cs.dtype, Device::cpu(), ops.la, cs.batch, cs.a_bcast),
                       make_view(abs_b.data(), cs.dtype, Device::cpu(), ops.lb, cs.batch, cs.b_bcast), nullptr,
                       1.0, 0.0, scale.data());
  r.allowed.resize(r.ref.size());
  for (int64_t z = 0; z < nb; ++z)
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < cs.n; ++j) {
        const size_t o = static_cast<size_t>((z * cs.m + i) * cs.n + j);
        double s = std::fabs(cs.alpha) * scale[o];
        if (cs.beta != 0.0f) s += std::fabs(cs.beta * load_as_double(ops.c0.data(), cs.dtype, ops.lc.at(z, i, j)));
        r.allowed[o] = gemm_allowed_error(cs.dtype, cs.k, r.ref[o], s);
      }
  return r;
}

// Runs every variant in `variants` on the same operands; each must pass the reference check, be
// finite everywhere, and agree with every other within the sum of their allowed errors.
inline void expect_variants_agree(GemmCase cs, const std::vector<GemmVariant>& variants) {
  SCOPED_TRACE(cs.describe());
  GemmOperands ops(cs);
  const Reference ref = reference_with_bounds(ops);
  std::vector<std::vector<double>> outs;
  for (GemmVariant v : variants) {
    ops.cs.variant = v;
    GemmRun run;
    try {
      run = run_gemm(ops);
    } catch (const Error& e) {
      ADD_FAILURE() << ops.cs.describe() << ": matmul threw: " << e.what();
      outs.emplace_back();
      continue;
    }
    EXPECT_TRUE(run.check.passed) << ops.cs.describe() << ": " << run.check.first_failure;
    std::vector<double> out(ref.ref.size());
    int64_t non_finite = 0;
    for (int64_t z = 0; z < ops.lc.batches; ++z)
      for (int64_t i = 0; i < cs.m; ++i)
        for (int64_t j = 0; j < cs.n; ++j) {
          double x = load_as_double(run.c.data(), cs.dtype, ops.lc.at(z, i, j));
          non_finite += !std::isfinite(x);
          out[static_cast<size_t>((z * cs.m + i) * cs.n + j)] = x;
        }
    EXPECT_EQ(non_finite, 0) << ops.cs.describe() << ": non-finite outputs";
    outs.push_back(std::move(out));
  }
  for (size_t x = 0; x < variants.size(); ++x)
    for (size_t y = x + 1; y < variants.size(); ++y) {
      if (outs[x].empty() || outs[y].empty()) continue;
      int64_t bad = 0;
      std::string first;
      for (size_t e = 0; e < ref.ref.size(); ++e) {
        const double d = std::fabs(outs[x][e] - outs[y][e]);
        if (!(d <= 2 * ref.allowed[e] + 1e-300)) {
          if (bad++ == 0)
            first = "element " + std::to_string(e) + ": " + std::to_string(outs[x][e]) + " vs " +
                    std::to_string(outs[y][e]) + " (allowed " + std::to_string(2 * ref.allowed[e]) + ")";
        }
      }
      EXPECT_EQ(bad, 0) << gemm_variant_name(variants[x]) << " and " << gemm_variant_name(variants[y])
                        << " disagree on " << bad << " elements; first " << first;
    }
}

}  // namespace optimized::testing
