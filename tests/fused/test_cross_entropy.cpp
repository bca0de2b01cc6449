// Cross-entropy (include/optimized/fused.h, "cross-entropy") through the public API, on the CPU
// always and on CUDA when a device is present (else every CUDA test skips with the reason), against a
// float64 reference computed from the logits as stored: vocabularies 1, 3, 32000, 128256, 262144 (the
// big ones with few rows, which take CUDA's split-row path), ignored rows, an all-ignored batch, label
// smoothing, z-loss, ±inf logits, strided rows, int32 targets, every dtype, in place, outputs poisoned
// (NaN bytes) and the padding of strided outputs checked untouched; the error paths.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/fused.h"

namespace optimized::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct CeCase {
  DType dtype = DType::kF32;
  DType target_dtype = DType::kI64;
  int64_t rows = 4, vocab = 33, pad = 0;  // logits and grad rows are vocab + pad apart
  double ls = 0.0, z = 0.0;
  int64_t ignore_index = -100;
  std::vector<int64_t> ignored_rows;      // rows whose target is ignore_index
  bool all_ignored = false;
  bool with_grad = true, with_lse = true, in_place = false;
  int scale = 0;  // grad_scale: 0 absent, 1 one factor for every row, 2 one per row (some exactly 1, one 0)
  std::vector<std::pair<int64_t, double>> specials;  // (flat index into row-major (rows, vocab), value)
  FusedVariant variant = FusedVariant::kAuto;
  std::string describe() const {
    return std::string(dtype_name(dtype)) + " rows " + std::to_string(rows) + " vocab " + std::to_string(vocab) +
           " pad " + std::to_string(pad) + " ls " + std::to_string(ls) + " z " + std::to_string(z) +
           (in_place ? " in place" : "") + (with_grad ? " grad" : "") + " target " + std::string(dtype_name(target_dtype)) +
           " grad_scale " + std::to_string(scale) + " variant " + std::string(fused_variant_name(variant));
  }
};

double load_elem(DType d, const void* p, int64_t i) {
  switch (d) {
    case DType::kF64: return static_cast<const double*>(p)[i];
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}
void store_elem(DType d, void* p, int64_t i, double v) {
  switch (d) {
    case DType::kF64: static_cast<double*>(p)[i] = v; break;
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = float_to_half(static_cast<float>(v)); break;
    default: static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v)); break;
  }
}

// The float64 reference of one row (the header's formulas, a zero-coefficient term dropped).
struct RowRef {
  double loss, lse;
  std::vector<double> grad;
};
RowRef reference_row(const std::vector<double>& x, int64_t t, const CeCase& cs) {
  const int64_t n = static_cast<int64_t>(x.size());
  RowRef r{0.0, 0.0, std::vector<double>(static_cast<size_t>(n), 0.0)};
  if (t == cs.ignore_index) return r;
  double m = -kInf;
  for (double v : x) m = (std::isnan(v) || std::isnan(m)) ? NAN : std::max(m, v);
  double s = 0.0, sum_x = 0.0;
  if (m != -kInf)
    for (double v : x) s += std::exp(v - m);
  for (double v : x) sum_x += v;
  r.lse = m + std::log(s);
  r.loss = std::log(s);
  if (cs.ls != 1.0) r.loss += (1.0 - cs.ls) * (m - x[static_cast<size_t>(t)]);
  if (cs.ls != 0.0) r.loss += cs.ls * (m - sum_x / static_cast<double>(n));
  if (cs.z != 0.0) r.loss += cs.z * r.lse * r.lse;
  const double c = cs.z != 0.0 ? 1.0 + 2.0 * cs.z * r.lse : 1.0;
  for (int64_t j = 0; j < n; ++j)
    r.grad[static_cast<size_t>(j)] =
        std::exp(x[static_cast<size_t>(j)] - m) / s * c - cs.ls / static_cast<double>(n) - (j == t ? 1.0 - cs.ls : 0.0);
  return r;
}

bool close(double got, double want, double rel, double abs_tol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= abs_tol + rel * std::fabs(want);
}

// The gradient's relative tolerance: the dtype's rounding of the stored gradient plus fp32 math.
double grad_rel(DType d) {
  switch (d) {
    case DType::kF64: return 1e-12;
    case DType::kF32: return 2e-5;
    case DType::kF16: return 1.0 / 1024;
    default: return 1.0 / 128;
  }
}

void run_case(const CeCase& cs, Device device) {
  SCOPED_TRACE(cs.describe() + " on " + device_name(device));
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<double> normal(0.0, 2.0);
  const int64_t ld = cs.vocab + cs.pad, storage = cs.rows * ld;
  const DType stat = cs.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  // Host: logits (the pad filled with values the kernel must never read as part of a row: +inf).
  Buffer logits(cs.dtype, storage, Device::cpu()), target(cs.target_dtype, cs.rows, Device::cpu());
  for (int64_t r = 0; r < cs.rows; ++r)
    for (int64_t j = 0; j < ld; ++j) store_elem(cs.dtype, logits.data(), r * ld + j, j < cs.vocab ? normal(rng) : kInf);
  for (auto [i, v] : cs.specials) store_elem(cs.dtype, logits.data(), i / cs.vocab * ld + i % cs.vocab, v);
  std::uniform_int_distribution<int64_t> cls(0, cs.vocab - 1);
  std::vector<int64_t> t(static_cast<size_t>(cs.rows));
  for (int64_t r = 0; r < cs.rows; ++r) {
    t[r] = cls(rng);
    for (int64_t ig : cs.ignored_rows) if (ig == r) t[r] = cs.ignore_index;
    if (cs.all_ignored) t[r] = cs.ignore_index;
    if (cs.target_dtype == DType::kI64) static_cast<int64_t*>(target.data())[r] = t[r];
    else static_cast<int32_t*>(target.data())[r] = static_cast<int32_t>(t[r]);
  }
  // The reference, from the stored logits.
  std::vector<RowRef> ref;
  for (int64_t r = 0; r < cs.rows; ++r) {
    std::vector<double> x(static_cast<size_t>(cs.vocab));
    for (int64_t j = 0; j < cs.vocab; ++j) x[j] = load_elem(cs.dtype, logits.data(), r * ld + j);
    ref.push_back(reference_row(x, t[r], cs));
  }
  // Device copies, outputs poisoned.
  Buffer d_logits(cs.dtype, storage, device), d_target(cs.target_dtype, cs.rows, device);
  Buffer d_loss(stat, cs.rows, device), d_lse(stat, cs.rows, device), d_grad(cs.dtype, storage, device);
  d_logits.copy_from_host(logits.data());
  d_target.copy_from_host(target.data());
  d_loss.fill_bytes(0xFF);
  d_lse.fill_bytes(0xFF);
  d_grad.fill_bytes(0xFF);
  const TensorView lv = TensorView::matrix(d_logits.data(), cs.dtype, device, cs.rows, cs.vocab, ld);
  const TensorView gv = cs.in_place ? lv : TensorView::matrix(d_grad.data(), cs.dtype, device, cs.rows, cs.vocab, ld);
  CrossEntropyOptions opt;
  opt.ignore_index = cs.ignore_index;
  opt.label_smoothing = cs.ls;
  opt.z_loss = cs.z;
  // grad_scale: the factor of row r (reference) and the device operand, strided when per row.
  std::vector<double> factor(static_cast<size_t>(cs.rows), 1.0);
  Buffer scale(stat, 2 * cs.rows, Device::cpu()), d_scale(stat, 2 * cs.rows, device);
  if (cs.scale != 0) {
    for (int64_t r = 0; r < cs.rows; ++r) {
      factor[r] = cs.scale == 1 ? 0.37 : (r % 3 == 0 ? 1.0 : r % 3 == 1 ? -2.5 + 0.125 * r : 0.0);
      store_elem(stat, scale.data(), 2 * r, factor[r]);
      store_elem(stat, scale.data(), 2 * r + 1, NAN);  // between the strided factors: never read
    }
    d_scale.copy_from_host(scale.data());
    opt.grad_scale = cs.scale == 1 ? d_scale.view({1}) : d_scale.view({cs.rows}, {2});
  }
  cross_entropy_forward(lv, d_target.view({cs.rows}), opt, d_loss.view({cs.rows}),
                        cs.with_lse ? d_lse.view({cs.rows}) : TensorView{}, cs.with_grad ? gv : TensorView{}, cs.variant);
  Buffer loss(stat, cs.rows, Device::cpu()), lse(stat, cs.rows, Device::cpu()), grad(cs.dtype, storage, Device::cpu());
  d_loss.copy_to_host(loss.data());
  d_lse.copy_to_host(lse.data());
  (cs.in_place ? d_logits : d_grad).copy_to_host(grad.data());
  const double loss_rel = cs.dtype == DType::kF64 ? 1e-12 : 2e-6, loss_abs = cs.dtype == DType::kF64 ? 1e-12 : 2e-5;
  int failures = 0;
  for (int64_t r = 0; r < cs.rows && failures < 8; ++r) {
    const double got = load_elem(stat, loss.data(), r);
    if (!close(got, ref[r].loss, loss_rel, loss_abs * (1 + std::fabs(ref[r].lse)))) {
      ADD_FAILURE() << "loss row " << r << ": got " << got << ", want " << ref[r].loss;
      ++failures;
    }
    if (cs.with_lse && !close(load_elem(stat, lse.data(), r), ref[r].lse, loss_rel, loss_abs)) {
      ADD_FAILURE() << "lse row " << r << ": got " << load_elem(stat, lse.data(), r) << ", want " << ref[r].lse;
      ++failures;
    }
    if (!cs.with_grad) continue;
    for (int64_t j = 0; j < ld && failures < 8; ++j) {
      const double g = load_elem(cs.dtype, grad.data(), r * ld + j);
      if (j >= cs.vocab) {  // padding: untouched (poison, or in place the logits' +inf)
        if (!(cs.in_place ? g == kInf : std::isnan(g))) {
          ADD_FAILURE() << "padding written at row " << r << " column " << j << ": " << g;
          ++failures;
        }
        continue;
      }
      const double want = ref[r].grad[static_cast<size_t>(j)] * (t[r] == cs.ignore_index ? 1.0 : factor[r]);
      if (!close(g, want, grad_rel(cs.dtype), cs.dtype == DType::kF64 ? 1e-14 : 2e-7)) {
        ADD_FAILURE() << "grad row " << r << " column " << j << ": got " << g << ", want " << want;
        ++failures;
      }
    }
  }
}

const std::vector<DType> kAllDtypes = {DType::kF32, DType::kF16, DType::kBF16, DType::kF64};
const std::vector<DType> kCudaDtypes = {DType::kF32, DType::kF16, DType::kBF16};

// The grid of cases run on `device` for `dtype`: small sizes, big vocabularies (few rows: CUDA's
// split-row path) or, `registers`, rows the CUDA registers design holds (a cluster of 1, 4 or 8 blocks,
// 1 to 8 vectors per thread; the strided cases in the sequence below take the streaming kernels).
void run_grid(DType dtype, Device device, bool big, FusedVariant variant = FusedVariant::kAuto,
              bool registers = false) {
  const std::vector<std::pair<int64_t, int64_t>> sizes =
      registers ? std::vector<std::pair<int64_t, int64_t>>{{200, 4096}, {140, 8192}, {140, 128256}, {133, 262144}}
      : big     ? std::vector<std::pair<int64_t, int64_t>>{{3, 32000}, {2, 128256}, {2, 262144}, {1, 262144}, {130, 40000}}
                : std::vector<std::pair<int64_t, int64_t>>{{5, 1}, {7, 3}, {1, 1}, {33, 127}, {300, 17}, {4, 1000}};
  for (auto [rows, vocab] : sizes) {
    CeCase cs;
    cs.variant = variant;
    cs.dtype = dtype;
    cs.rows = rows;
    cs.vocab = vocab;
    run_case(cs, device);
    cs.ls = 0.1;
    cs.z = 1e-4;
    cs.ignored_rows = {0};
    run_case(cs, device);
    cs.pad = 5;  // strided, unaligned rows
    cs.target_dtype = DType::kI32;
    run_case(cs, device);
    cs.in_place = true;
    run_case(cs, device);
    cs.scale = 2;  // a factor per row, strided, in place
    run_case(cs, device);
    cs.in_place = false;
    cs.scale = 1;  // one factor for every row
    run_case(cs, device);
    cs.scale = 0;
    cs.with_grad = false;
    cs.with_lse = false;
    run_case(cs, device);
  }
}

// cross_entropy_backward: a stored gradient (strided rows, poisoned padding) times one factor or one
// per row, in place; rows whose factor is exactly 1 come back bit for bit.
void run_backward(DType dtype, Device device) {
  const DType stat = dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<double> normal(0.0, 1.0);
  for (auto [rows, vocab] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {7, 3}, {5, 1001}, {3, 20000}, {2, 131}}) {
    for (int mode : {0, 1, 2}) {  // one factor 1 (nothing moves), one factor, one per row
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " rows " + std::to_string(rows) + " vocab " +
                   std::to_string(vocab) + " mode " + std::to_string(mode) + " on " + device_name(device));
      const int64_t ld = vocab + 3, storage = rows * ld;
      Buffer g(dtype, storage, Device::cpu()), f(stat, rows, Device::cpu());
      for (int64_t i = 0; i < storage; ++i) store_elem(dtype, g.data(), i, i % ld < vocab ? normal(rng) : kInf);
      std::vector<double> factor(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        factor[r] = mode == 0 ? 1.0 : mode == 1 ? -0.3 : (r % 2 == 0 ? 1.0 : 0.5 + r);
        store_elem(stat, f.data(), r, factor[r]);
      }
      Buffer d_g(dtype, storage, device), d_f(stat, rows, device);
      d_g.copy_from_host(g.data());
      d_f.copy_from_host(f.data());
      cross_entropy_backward(mode == 2 ? d_f.view({rows}) : d_f.view({1}),
                             TensorView::matrix(d_g.data(), dtype, device, rows, vocab, ld));
      Buffer out(dtype, storage, Device::cpu());
      d_g.copy_to_host(out.data());
      int failures = 0;
      for (int64_t i = 0; i < storage && failures < 8; ++i) {
        const int64_t r = i / ld;
        const double before = load_elem(dtype, g.data(), i), got = load_elem(dtype, out.data(), i);
        const bool same = i % ld >= vocab || factor[r] == 1.0;  // padding and unit rows: untouched
        const bool ok = same ? std::memcmp(static_cast<const char*>(g.data()) + i * dtype_size(dtype),
                                           static_cast<const char*>(out.data()) + i * dtype_size(dtype),
                                           dtype_size(dtype)) == 0
                             : close(got, before * factor[r], grad_rel(dtype), 6e-8);  // 6e-8: fp16's subnormal spacing
        if (!ok) {
          ADD_FAILURE() << "element " << i << " (row " << r << "): got " << got << ", had " << before << ", factor "
                        << factor[r];
          ++failures;
        }
      }
    }
  }
}

void run_special(DType dtype, Device device) {
  CeCase cs;
  cs.dtype = dtype;
  cs.rows = 6;
  cs.vocab = 37;
  cs.all_ignored = true;  // every row ignored: loss 0, lse 0, gradient 0
  run_case(cs, device);
  cs.all_ignored = false;
  cs.ignore_index = 5;  // an ignore_index inside [0, vocab)
  cs.ignored_rows = {1, 4};
  run_case(cs, device);
  // ±inf: row 0 a +inf logit (NaN), row 1 -inf logits (finite), row 2 only -inf (NaN), row 3 a NaN.
  cs.ignored_rows = {};
  cs.ignore_index = -100;
  cs.specials = {{0 * 37 + 3, kInf}, {1 * 37 + 2, -kInf}, {1 * 37 + 9, -kInf}, {3 * 37 + 1, NAN}};
  for (int64_t j = 0; j < 37; ++j) cs.specials.push_back({2 * 37 + j, -kInf});
  for (double ls : {0.0, 0.2}) {
    cs.ls = ls;
    run_case(cs, device);
  }
}

TEST(CrossEntropyCpu, Grid) {
  for (DType d : kAllDtypes) run_grid(d, Device::cpu(), false);
}
TEST(CrossEntropyCpu, BigVocab) {
  for (DType d : {DType::kF32, DType::kBF16}) run_grid(d, Device::cpu(), true);
}
TEST(CrossEntropyCpu, SpecialValues) {
  for (DType d : kAllDtypes) run_special(d, Device::cpu());
}

TEST(CrossEntropyCpu, Backward) {
  for (DType d : kAllDtypes) run_backward(d, Device::cpu());
}

TEST(CrossEntropyCpu, Errors) {
  Buffer x(DType::kF32, 12, Device::cpu()), t(DType::kI64, 3, Device::cpu()), loss(DType::kF32, 3, Device::cpu());
  for (int i = 0; i < 12; ++i) static_cast<float*>(x.data())[i] = 0.5f * static_cast<float>(i);
  int64_t* tv = static_cast<int64_t*>(t.data());
  tv[0] = 1, tv[1] = 4, tv[2] = -100;  // 4 is out of [0, 4)
  const TensorView xv = x.view({3, 4});
  auto status_of = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return std::string(status_name(e.status())) + ": " + e.what();
    }
    return "ok";
  };
  std::string m = status_of([&] { cross_entropy_forward(xv, t.view({3}), {}, loss.view({3}), {}, {}); });
  EXPECT_TRUE(contains_all(m, {"target", "[0, 4)", "given 4", "row 1"})) << m;
  tv[1] = 0;
  EXPECT_EQ(status_of([&] { cross_entropy_forward(xv, t.view({3}), {}, loss.view({3}), {}, {}); }), "ok");
  CrossEntropyOptions bad;
  bad.label_smoothing = 1.5;
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), bad, loss.view({3}), {}, {}); });
  EXPECT_TRUE(contains_all(m, {"label_smoothing", "1.5"})) << m;
  bad = {};
  bad.z_loss = -1;
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), bad, loss.view({3}), {}, {}); });
  EXPECT_TRUE(contains_all(m, {"z_loss"})) << m;
  m = status_of([&] { cross_entropy_forward(xv, t.view({2}), {}, loss.view({3}), {}, {}); });
  EXPECT_TRUE(contains_all(m, {"target", "(3)"})) << m;
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), {}, loss.view({3}), {}, {}, FusedVariant::kCudaUnfused); });
  EXPECT_TRUE(contains_all(m, {"variant", "fused_streaming", "unfused"})) << m;
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), {}, loss.view({3}), {}, {}, FusedVariant::kCudaFusedStreaming); });
  EXPECT_TRUE(contains_all(m, {"fused_streaming", "CUDA"})) << m;
  m = status_of([&] { cross_entropy_forward(xv, as(t.view({3}), DType::kF32), {}, loss.view({3}), {}, {}); });
  EXPECT_TRUE(contains_all(m, {"target", "int64"})) << m;
  // A gradient overlapping the logits other than as the very same view.
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), {}, loss.view({3}), {}, shifted(xv, 1)); });
  EXPECT_TRUE(contains_all(m, {"grad_logits", "overlap"})) << m;
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), {}, loss.view({3}), {}, xv); });
  EXPECT_EQ(m, "ok");
  EXPECT_EQ(cross_entropy_workspace_bytes(DType::kF32, Device::cpu(), 3, 4), 0u);
  // grad_scale: only with a gradient; one element or one per row, of the loss's dtype.
  Buffer g(DType::kF32, 12, Device::cpu()), f(DType::kF32, 3, Device::cpu()), f64(DType::kF64, 3, Device::cpu());
  CrossEntropyOptions scaled;
  scaled.grad_scale = f.view({1});
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), scaled, loss.view({3}), {}, {}); });
  EXPECT_TRUE(contains_all(m, {"grad_scale", "without grad_logits"})) << m;
  scaled.grad_scale = f.view({2});
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), scaled, loss.view({3}), {}, g.view({3, 4})); });
  EXPECT_TRUE(contains_all(m, {"grad_scale", "(1)", "(3)", "given (2)"})) << m;
  scaled.grad_scale = f64.view({3});
  m = status_of([&] { cross_entropy_forward(xv, t.view({3}), scaled, loss.view({3}), {}, g.view({3, 4})); });
  EXPECT_TRUE(contains_all(m, {"grad_scale", "fp32", "fp64"})) << m;
  scaled.grad_scale = f.view({3});
  EXPECT_EQ(status_of([&] { cross_entropy_forward(xv, t.view({3}), scaled, loss.view({3}), {}, g.view({3, 4})); }), "ok");
  // The backward's operands.
  m = status_of([&] { cross_entropy_backward({}, g.view({3, 4})); });
  EXPECT_TRUE(contains_all(m, {"grad_loss", "required"})) << m;
  m = status_of([&] { cross_entropy_backward(f.view({2}), g.view({3, 4})); });
  EXPECT_TRUE(contains_all(m, {"grad_loss", "given (2)"})) << m;
  m = status_of([&] { cross_entropy_backward(f.view({3}), {}); });
  EXPECT_TRUE(contains_all(m, {"grad_logits", "rank"})) << m;
  m = status_of([&] { cross_entropy_backward(f.view({3}), as(g.view({3, 4}), DType::kI32)); });
  EXPECT_TRUE(contains_all(m, {"grad_logits", "dtype"})) << m;
  EXPECT_EQ(status_of([&] { cross_entropy_backward(f.view({1}), g.view({3, 4})); }), "ok");
}

TEST(CrossEntropyCuda, Grid) {
  SKIP_WITHOUT_CUDA();
  for (DType d : kCudaDtypes) run_grid(d, Device::cuda(0), false);
}
TEST(CrossEntropyCuda, BigVocab) {
  SKIP_WITHOUT_CUDA();
  for (DType d : kCudaDtypes) run_grid(d, Device::cuda(0), true);
}
// Both CUDA designs by name (auto runs fused_registers), on every size set.
TEST(CrossEntropyCuda, EveryDesign) {
  SKIP_WITHOUT_CUDA();
  for (FusedVariant v : {FusedVariant::kCudaFusedStreaming, FusedVariant::kCudaFusedRegisters})
    for (DType d : kCudaDtypes) {
      run_grid(d, Device::cuda(0), false, v);
      run_grid(d, Device::cuda(0), true, v);
      run_grid(d, Device::cuda(0), false, v, true);
    }
}
TEST(CrossEntropyCuda, SpecialValues) {
  SKIP_WITHOUT_CUDA();
  for (DType d : kCudaDtypes) run_special(d, Device::cuda(0));
}
TEST(CrossEntropyCuda, Backward) {
  SKIP_WITHOUT_CUDA();
  for (DType d : kCudaDtypes) run_backward(d, Device::cuda(0));
}
// Targets outside [0, vocab) on CUDA: that row NaN (loss, lse, gradient), the others exact.
TEST(CrossEntropyCuda, OutOfRangeTargetIsNaN) {
  SKIP_WITHOUT_CUDA();
  const Device dev = Device::cuda(0);
  Buffer x(DType::kF32, 3 * 40000, Device::cpu()), t(DType::kI64, 3, Device::cpu());
  for (int64_t i = 0; i < 3 * 40000; ++i) static_cast<float*>(x.data())[i] = static_cast<float>(i % 7) * 0.25f;
  int64_t* tv = static_cast<int64_t*>(t.data());
  tv[0] = 40000, tv[1] = 3, tv[2] = -7;
  Buffer dx(DType::kF32, 3 * 40000, dev), dt(DType::kI64, 3, dev), dl(DType::kF32, 3, dev), dg(DType::kF32, 3 * 40000, dev);
  dx.copy_from_host(x.data());
  dt.copy_from_host(t.data());
  cross_entropy_forward(dx.view({3, 40000}), dt.view({3}), {}, dl.view({3}), {}, dg.view({3, 40000}));
  float loss[3];
  dl.copy_to_host(loss);
  std::vector<float> g(3 * 40000);
  dg.copy_to_host(g.data());
  EXPECT_TRUE(std::isnan(loss[0]) && std::isnan(loss[2]) && std::isfinite(loss[1]));
  EXPECT_TRUE(std::isnan(g[0]) && std::isnan(g[2 * 40000 + 39999]) && std::isfinite(g[40000]));
}

}  // namespace
}  // namespace optimized::testing
