// The fused family on the CPU variant (and kAuto on host tensors, which resolves to it): every op,
// forward and backward, fp32 / fp16 / bf16 / fp64, against the float64 reference with the
// tolerance rule of fused_test_util.h, on fresh random inputs with poisoned outputs, padded rows
// and guard zones. Also: the reference's own backward against finite differences of its forward
// (so the reference is not checked only against itself), and the tolerance against deliberately
// wrong outputs (so it is known to catch real bugs).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "fused_test_util.h"

namespace optimized::testing {
namespace {

const std::vector<DType> kDtypes = {DType::kF32, DType::kF16, DType::kBF16, DType::kF64};

using Param = std::tuple<OpSpec, bool, DType>;  // op, backward, dtype

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [spec, backward, dtype] = info.param;
  return op_label(spec) + (backward ? "_bwd_" : "_fwd_") + std::string(dtype_name(dtype));
}

class CpuFused : public ::testing::TestWithParam<Param> {
 protected:
  FusedCase base(Size size, FusedVariant variant = FusedVariant::kCpu) const {
    const auto& [spec, backward, dtype] = GetParam();
    return make_case(spec, backward, dtype, variant, Device::cpu(), size);
  }
  FusedOp op() const { return std::get<0>(GetParam()).op; }
  bool backward() const { return std::get<1>(GetParam()); }
};

TEST_P(CpuFused, OddSizes) {
  for (const Size& s : odd_sizes()) expect_fused_ok(base(s));
}

TEST_P(CpuFused, BigRows) {
  for (const Size& s : big_sizes()) expect_fused_ok(base(s));
}

TEST_P(CpuFused, AutoRunsOnTheCpu) {
  EXPECT_EQ(resolve_fused_variant(op(), std::get<2>(GetParam()), Device::cpu(), 1000, backward()), FusedVariant::kCpu);
  for (Size s : {Size{17, 257}, Size{3, 4099}}) expect_fused_ok(base(s, FusedVariant::kAuto));
}

TEST_P(CpuFused, PaddedRowsAndOffsets) {
  for (Size s : {Size{17, 257}, Size{3, 1000}, Size{5, 1}, Size{1, 33}}) {
    FusedCase cs = base(s);
    cs.pad = 3;  // rows an odd number of elements apart
    expect_fused_ok(cs);
    cs.pad = 16;
    cs.offset = 1;  // views one element into their buffers
    expect_fused_ok(cs);
  }
}

TEST_P(CpuFused, OneDimensionalViews) {
  for (int64_t w : {1, 7, 1000}) {
    FusedCase cs = base({1, w});
    cs.one_d = true;
    expect_fused_ok(cs);
  }
}

TEST_P(CpuFused, ZeroRowsDoNothing) {
  // fused.h: "Rows may number 0 (nothing is done)", and a backward over zero rows writes zeros to
  // dweight / dbias: no other byte changes.
  for (int64_t w : {1, 64}) {
    FusedCase cs = base({0, w});
    SCOPED_TRACE(cs.describe());
    FusedOperands o(cs);
    FusedRun run;
    ASSERT_NO_THROW(run = run_fused(o));
    expect_zero_rows_result(o, run);
  }
}

TEST_P(CpuFused, InPlace) {
  if (op() == FusedOp::kSiluAndMul) GTEST_SKIP() << "silu_and_mul's output has another shape than its input";
  for (Size s : {Size{17, 257}, Size{3, 1000}, Size{4, 1}}) {
    FusedCase cs = base(s);
    expect_in_place_ok(cs);
    cs.pad = 5;
    expect_in_place_ok(cs);
  }
}

TEST_P(CpuFused, InPlaceBackend) {
  // The CPU backend itself, on every in-place form fused.h names (whatever the API lets through).
  if (op() == FusedOp::kSiluAndMul) GTEST_SKIP() << "silu_and_mul's output has another shape than its input";
  for (Size s : {Size{17, 257}, Size{4, 1}}) {
    FusedCase cs = base(s);
    cs.in_place = true;
    cs.backend_direct = true;
    expect_fused_ok(cs);
  }
}

TEST_P(CpuFused, OptionalOperandsAbsent) {
  for (int mask = 0; mask < 8; ++mask) {
    FusedCase cs = base({17, 129});
    cs.with_weight = mask & 1;
    cs.with_bias = mask & 2;
    cs.with_stats = cs.with_dweight = cs.with_dbias = mask & 4;
    expect_fused_ok(cs);
  }
}

TEST_P(CpuFused, ThreadCounts) {
  for (int threads : {1, 2, 3, 64}) {
    FusedCase cs = base({37, 129});
    cs.cpu_threads = threads;
    expect_fused_ok(cs);
  }
}

TEST_P(CpuFused, ScaleAndEps) {
  for (double v : {-0.5, 3.0}) {
    FusedCase cs = base({9, 100});
    cs.scale = v;       // softmax, log_softmax
    cs.eps = v * v;     // norms: an eps that dominates some rows' variance
    expect_fused_ok(cs);
  }
  FusedCase cs = base({9, 100});
  cs.eps = 0.0;  // allowed (>= 0); the random rows have non-zero variance
  expect_fused_ok(cs);
}

TEST_P(CpuFused, AllEqualRows) {
  for (int64_t w : {1, 2, 100, 4099}) {
    FusedCase cs = base({6, w});
    FusedOperands o(cs);
    for (int64_t i = 0; i < cs.rows; ++i) {
      const double c = 0.75 * static_cast<double>(i) - 1.5;  // includes 0
      for (int64_t j = 0; j < cs.x_cols(); ++j) o.set(kX, i, j, c);
    }
    o.refresh_stats();
    const FusedCheck c = expect_operands_ok(o);
    const Role out = cs.backward ? kDx : kY;
    for (double v : c.values[out]) ASSERT_TRUE(std::isfinite(v)) << cs.describe() << ": a non-finite output";
    if (!cs.backward && is_layer(cs.op) && !is_add(cs.op)) {
      // Variance 0: y = bias (the mean is exact up to fp32 rounding, amplified by 1/sqrt(eps)).
      for (int64_t i = 0; i < cs.rows; ++i)
        for (int64_t j = 0; j < w; ++j)
          EXPECT_NEAR(c.values[kY][static_cast<size_t>(i * w + j)], o.get(kBias, 0, j), 0.02) << i << ", " << j;
    }
    if (!cs.backward && cs.op == FusedOp::kSoftmax) {
      for (double v : c.values[kY]) EXPECT_NEAR(v, 1.0 / static_cast<double>(w), 0.01 / static_cast<double>(w));
    }
  }
}

TEST_P(CpuFused, NanAndInf) {
  FusedCase cs = base({7, 33});
  if (!cs.backward) {
    expect_nan_inf_behaviour(cs);
    return;
  }
  // Backward: a NaN in dy spreads to dx as the reference says (the whole row for the reductions)
  // and to the dweight / dbias column it lands in; other rows stay finite.
  FusedOperands o(cs);
  o.set(kDy, 2, 5, std::nan(""));
  const FusedCheck c = expect_operands_ok(o);
  if (!c.passed) return;
  const int64_t xc = cs.x_cols();
  for (int64_t j = 0; j < xc; ++j) EXPECT_TRUE(std::isfinite(c.values[kDx][static_cast<size_t>(6 * xc + j)]));
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuFused,
                         ::testing::Combine(::testing::ValuesIn(all_op_specs()), ::testing::Bool(),
                                            ::testing::ValuesIn(kDtypes)),
                         param_name);

// ---- the reference's backward against finite differences of its forward ------------------------

// Runs the reference forward on contiguous double operands and returns sum(dy * y) + sum(dres * h)
// (the add forms) : the scalar whose gradient the backward computes.
struct Problem {
  OpSpec spec;
  int64_t rows = 3, width = 11;
  std::vector<double> x, residual, weight, bias, dy, dres;
  double scale = 1.7, eps = 1e-3;

  FusedParams params(bool backward) const {
    FusedParams p;
    p.op = spec.op;
    p.gelu = spec.gelu;
    p.backward = backward;
    p.dtype = DType::kF64;
    p.rows = rows;
    p.width = width;
    p.scale = scale;
    p.eps = eps;
    const int64_t xc = spec.op == FusedOp::kSiluAndMul ? 2 * width : width;
    p.x = x.data();
    p.ld_x = xc;
    if (is_add(spec.op)) {
      p.residual = residual.data();
      p.ld_residual = width;
    }
    if (is_norm(spec.op)) p.weight = weight.data();
    if (is_layer(spec.op) || spec.op == FusedOp::kBiasGelu) p.bias = bias.data();
    p.dy = dy.data();
    p.ld_dy = width;
    if (is_add(spec.op)) {
      p.dresidual_out = dres.data();
      p.ld_dresidual_out = width;
    }
    return p;
  }

  double loss() const {
    const FusedReference f = fused_reference_f64(params(false));
    double l = 0;
    for (size_t k = 0; k < f.y.size(); ++k) l += dy[k] * f.y[k];
    for (size_t k = 0; k < f.residual_out.size(); ++k) l += dres[k] * f.residual_out[k];
    return l;
  }
};

TEST(FusedReferenceGradients, MatchFiniteDifferences) {
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (const OpSpec& spec : all_op_specs()) {
    SCOPED_TRACE(op_label(spec));
    Problem pb;
    pb.spec = spec;
    const int64_t xc = spec.op == FusedOp::kSiluAndMul ? 2 * pb.width : pb.width;
    auto randv = [&](int64_t n, double offset) {
      std::vector<double> v(static_cast<size_t>(n));
      for (double& e : v) e = offset + u(rng);
      return v;
    };
    pb.x = randv(pb.rows * xc, 0.3);
    pb.residual = randv(pb.rows * pb.width, 0);
    pb.weight = randv(pb.width, 0);
    pb.bias = randv(pb.width, 0);
    pb.dy = randv(pb.rows * pb.width, 0);
    pb.dres = randv(pb.rows * pb.width, 0);

    // The backward's input: the forward output y for softmax, h (= x + residual) for the norms.
    Problem back = pb;
    if (is_softmax(spec.op)) back.x = fused_reference_f64(pb.params(false)).y;
    if (is_add(spec.op)) back.x = fused_reference_f64(pb.params(false)).residual_out;
    FusedParams bp = back.params(true);
    bp.residual = nullptr;
    const FusedReference g = fused_reference_f64(bp);

    // Directional derivatives along random directions, central differences.
    const double t = 1e-6;
    auto check = [&](std::vector<double> Problem::*field, const std::vector<double>& grad, const char* name) {
      std::vector<double> dir = randv(static_cast<int64_t>((pb.*field).size()), 0);
      double analytic = 0;
      for (size_t k = 0; k < dir.size(); ++k) analytic += grad[k] * dir[k];
      Problem plus = pb, minus = pb;
      for (size_t k = 0; k < dir.size(); ++k) {
        (plus.*field)[k] += t * dir[k];
        (minus.*field)[k] -= t * dir[k];
      }
      const double numeric = (plus.loss() - minus.loss()) / (2 * t);
      EXPECT_NEAR(analytic, numeric, 1e-6 * (1 + std::fabs(numeric))) << name;
    };
    check(&Problem::x, g.dx, "dx");
    if (is_add(spec.op)) check(&Problem::residual, g.dx, "dx (as the residual's gradient)");
    if (is_norm(spec.op)) check(&Problem::weight, g.dweight, "dweight");
    if (!g.dbias.empty()) check(&Problem::bias, g.dbias, "dbias");
  }
}

// ---- the tolerance catches real bugs ------------------------------------------------------------

// Rounds `values` to the output's dtype (as a kernel would store them) and checks them.
CheckResult check_as_output(const FusedOperands& o, const FusedExpected& ex, Role r, std::vector<double> values) {
  const DType d = o.op(r).dtype;
  for (double& v : values) v = round_to(d, v);
  return check_output(o, ex, r, values);
}

class ToleranceCatches : public ::testing::TestWithParam<DType> {
 protected:
  FusedCase base(FusedOp op, bool backward, Size s) const {
    return make_case({op, GeluApproximation::kNone}, backward, GetParam(), FusedVariant::kCpu, Device::cpu(), s);
  }
  // The correct result, rounded, passes; so does the same-dtype reference; the mutant fails.
  void expect_caught(const FusedOperands& o, Role r, const std::vector<double>& mutant) {
    const FusedExpected ex = expected_outputs(o);
    FusedOutput out{};
    ASSERT_TRUE(output_of(r, &out));
    const CheckResult good = check_as_output(o, ex, r, field(ex.ref, out));
    EXPECT_EQ(good.failures, 0) << "the rounded reference itself fails: " << good.first_failure;
    const CheckResult same = check_as_output(o, ex, r, field(ex.same, out));
    EXPECT_EQ(same.failures, 0) << "the same-dtype reference fails: " << same.first_failure;
    const CheckResult bad = check_as_output(o, ex, r, mutant);
    EXPECT_GT(bad.failures, 0) << o.cs.describe() << ": the mutant passed (worst error/allowed "
                               << bad.worst_ratio << ")";
  }
};

TEST_P(ToleranceCatches, LayerNormWithoutEps) {
  FusedCase cs = base(FusedOp::kLayerNorm, false, {8, 64});
  FusedOperands o(cs);
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t i = 0; i < cs.rows; ++i)
    for (int64_t j = 0; j < cs.width; ++j) o.set(kX, i, j, 0.5 + 1e-3 * u(rng));  // variance ~ eps
  FusedParams p = o.reference_params();
  p.eps = 0.0f;
  expect_caught(o, kY, fused_reference_f64(p).y);
}

TEST_P(ToleranceCatches, LayerNormMeanOverNMinusOne) {
  FusedCase cs = base(FusedOp::kLayerNorm, false, {8, 64});
  cs.with_weight = false;
  FusedOperands o(cs);
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t i = 0; i < cs.rows; ++i)
    for (int64_t j = 0; j < cs.width; ++j) o.set(kX, i, j, 2.0 + 0.5 * u(rng));
  const FusedReference f = fused_reference_f64(o.reference_params());
  std::vector<double> y = f.y;
  for (int64_t i = 0; i < cs.rows; ++i) {
    const double mean = f.mean[static_cast<size_t>(i)], wrong = mean * 64.0 / 63.0;
    for (int64_t j = 0; j < cs.width; ++j) y[static_cast<size_t>(i * 64 + j)] -= (wrong - mean) * f.rstd[static_cast<size_t>(i)];
  }
  expect_caught(o, kY, y);
}

TEST_P(ToleranceCatches, RmsNormMeanSquareOverNMinusOne) {
  FusedCase cs = base(FusedOp::kRmsNorm, false, {8, 31});
  FusedOperands o(cs);
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t i = 0; i < cs.rows; ++i)
    for (int64_t j = 0; j < cs.width; ++j) o.set(kX, i, j, 1.0 + 0.5 * u(rng));
  std::vector<double> y = fused_reference_f64(o.reference_params()).y;
  for (double& v : y) v *= std::sqrt(30.0 / 31.0);
  expect_caught(o, kY, y);
}

TEST_P(ToleranceCatches, SoftmaxSumShortOfOneTerm) {
  FusedCase cs = base(FusedOp::kSoftmax, false, {8, 31});
  FusedOperands o(cs);
  for (int64_t i = 0; i < cs.rows; ++i) o.set(kX, i, cs.width - 1, 4.0);  // the dropped term matters
  const FusedReference f = fused_reference_f64(o.reference_params());
  std::vector<double> y = f.y;
  for (int64_t i = 0; i < cs.rows; ++i) {
    const double last = f.y[static_cast<size_t>(i * 31 + 30)];  // e_last / sum
    for (int64_t j = 0; j < cs.width; ++j) y[static_cast<size_t>(i * 31 + j)] /= (1.0 - last);
  }
  expect_caught(o, kY, y);
}

TEST_P(ToleranceCatches, LayerNormBackwardWithoutMeanTerm) {
  FusedCase cs = base(FusedOp::kLayerNorm, true, {8, 64});
  FusedOperands o(cs);
  const FusedReference f = fused_reference_f64(o.reference_params());
  std::vector<double> dx = f.dx;
  for (int64_t i = 0; i < cs.rows; ++i) {
    double mean_g = 0;
    for (int64_t j = 0; j < cs.width; ++j) mean_g += o.get(kDy, i, j) * o.get(kWeight, 0, j) / 64.0;
    for (int64_t j = 0; j < cs.width; ++j) dx[static_cast<size_t>(i * 64 + j)] += f.rstd[static_cast<size_t>(i)] * mean_g;
  }
  expect_caught(o, kDx, dx);
}

TEST_P(ToleranceCatches, DweightShortOfOneRow) {
  FusedCase cs = base(FusedOp::kRmsNorm, true, {64, 32});
  FusedOperands o(cs);
  const FusedReference f = fused_reference_f64(o.reference_params());
  std::vector<double> dw = f.dweight;
  for (int64_t j = 0; j < cs.width; ++j) dw[static_cast<size_t>(j)] -= o.get(kDy, 63, j) * o.get(kX, 63, j) * f.rstd[63];
  expect_caught(o, kDweight, dw);
}

TEST_P(ToleranceCatches, GeluOtherForm) {
  if (GetParam() != DType::kF32 && GetParam() != DType::kF64)
    GTEST_SKIP() << "tanh and erf GELU differ by less than a 16-bit dtype's rounding";
  FusedCase cs = base(FusedOp::kBiasGelu, false, {8, 64});
  FusedOperands o(cs);
  FusedParams p = o.reference_params();
  p.gelu = GeluApproximation::kTanh;
  expect_caught(o, kY, fused_reference_f64(p).y);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ToleranceCatches, ::testing::ValuesIn(kDtypes),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

// ---- specific behaviours ---------------------------------------------------------------------------

TEST(CpuFusedBehaviour, Width1) {
  // One element per row: softmax 1, log_softmax 0, layer_norm = bias, rms_norm = sign(x) w (eps
  // aside); the reference check covers these, this pins the values.
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (FusedOp op : {FusedOp::kSoftmax, FusedOp::kLogSoftmax, FusedOp::kLayerNorm}) {
      FusedCase cs = make_case({op, GeluApproximation::kNone}, false, d, FusedVariant::kCpu, Device::cpu(), {5, 1});
      FusedOperands o(cs);
      const FusedCheck c = expect_operands_ok(o);
      for (int64_t i = 0; i < cs.rows; ++i) {
        const double want = op == FusedOp::kSoftmax ? 1.0 : op == FusedOp::kLogSoftmax ? 0.0 : o.get(kBias, 0, 0);
        EXPECT_EQ(c.values[kY][static_cast<size_t>(i)], want) << fused_op_name(op) << " row " << i;
      }
    }
  }
}

TEST(CpuFusedBehaviour, SoftmaxOfLargeValuesDoesNotOverflow) {
  // exp(200) overflows fp32: the max must be subtracted.
  FusedCase cs = make_case({FusedOp::kSoftmax}, false, DType::kF32, FusedVariant::kCpu, Device::cpu(), {4, 100});
  FusedOperands o(cs);
  for (int64_t i = 0; i < cs.rows; ++i)
    for (int64_t j = 0; j < cs.width; ++j) o.set(kX, i, j, 200.0 + static_cast<double>(j % 7));
  const FusedCheck c = expect_operands_ok(o);
  for (double v : c.values[kY]) ASSERT_TRUE(std::isfinite(v));
}

TEST(CpuFusedBehaviour, LayerNormOfLargeOffsetNeedsTwoPasses) {
  // mean 1000, spread 1: E[x^2] - E[x]^2 loses everything in fp32; two passes do not.
  FusedCase cs = make_case({FusedOp::kLayerNorm}, false, DType::kF32, FusedVariant::kCpu, Device::cpu(), {4, 1000});
  FusedOperands o(cs);
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t i = 0; i < cs.rows; ++i)
    for (int64_t j = 0; j < cs.width; ++j) o.set(kX, i, j, 1000.0 + u(rng));
  expect_operands_ok(o);
}

TEST(CpuFusedBehaviour, LayerNormFirstElementFarFromTheMean) {
  // An outlier first element: no one-pass shortcut (shifted by h[0]) may cancel the variance.
  for (DType d : {DType::kF32, DType::kF64}) {
    FusedCase cs = make_case({FusedOp::kLayerNorm}, false, d, FusedVariant::kCpu, Device::cpu(), {4, 1000});
    FusedOperands o(cs);
    for (int64_t i = 0; i < cs.rows; ++i) o.set(kX, i, 0, i % 2 ? -1000.0 : 1000.0);
    expect_operands_ok(o);
  }
}

TEST(CpuFusedBehaviour, AddFormRoundsHBeforeNormalizing) {
  // residual_out is h rounded to the dtype, and y is the norm of exactly that h: y equals the plain
  // norm's output on residual_out, bit for bit.
  for (DType d : {DType::kBF16, DType::kF16}) {
    for (FusedOp add : {FusedOp::kAddLayerNorm, FusedOp::kAddRmsNorm}) {
      FusedCase cs = make_case({add}, false, d, FusedVariant::kCpu, Device::cpu(), {9, 300});
      FusedOperands o(cs);
      const FusedCheck c = expect_operands_ok(o);
      if (!c.passed) continue;
      FusedCase plain_case = cs;
      plain_case.op = add == FusedOp::kAddLayerNorm ? FusedOp::kLayerNorm : FusedOp::kRmsNorm;
      FusedOperands plain(plain_case);
      for (int64_t i = 0; i < cs.rows; ++i)
        for (int64_t j = 0; j < cs.width; ++j) plain.set(kX, i, j, c.values[kResidualOut][static_cast<size_t>(i * 300 + j)]);
      for (int64_t j = 0; j < cs.width; ++j) {
        plain.set(kWeight, 0, j, o.get(kWeight, 0, j));
        if (plain.has(kBias)) plain.set(kBias, 0, j, o.get(kBias, 0, j));
      }
      const FusedCheck pc = expect_operands_ok(plain);
      EXPECT_EQ(pc.values[kY], c.values[kY]) << fused_op_name(add) << " " << dtype_name(d);
    }
  }
}

TEST(CpuFusedBehaviour, GradientSumsAreDeterministicForAThreadCount) {
  FusedCase cs = make_case({FusedOp::kLayerNorm}, true, DType::kF32, FusedVariant::kCpu, Device::cpu(), {203, 77});
  cs.cpu_threads = 2;
  FusedOperands o(cs);
  const FusedRun a = run_fused(o), b = run_fused(o);
  for (Role r : {kDweight, kDbias, kDx})
    EXPECT_EQ(std::memcmp(a.after[r].data(), b.after[r].data(), a.after[r].bytes()), 0) << role_name(r);
}

// ---- long rows: accuracy as torch's ----------------------------------------------------------------

// The largest |ours - float64| over a norm's y (forward) or dx (backward) on (2, 2^20) fp32 rows
// of N(mean, 1) values (no weight or bias: y is xhat itself, so the error is the statistics').
// The backward reads mean / rstd from the library's own forward, as torch's autograd does.
double long_row_norm_error(bool layer, bool backward, double mean) {
  constexpr int64_t R = 2, W = int64_t{1} << 20;
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<double> normal(0.0, 1.0);
  Buffer x(DType::kF32, R * W, Device::cpu()), dy(DType::kF32, R * W, Device::cpu());
  Buffer y(DType::kF32, R * W, Device::cpu()), dx(DType::kF32, R * W, Device::cpu());
  Buffer mu(DType::kF32, R, Device::cpu()), rstd(DType::kF32, R, Device::cpu());
  for (int64_t i = 0; i < R * W; ++i) {
    store_from_double(x.data(), DType::kF32, i, mean + normal(rng));
    store_from_double(dy.data(), DType::kF32, i, normal(rng));
  }
  y.fill_bytes(0xFF);
  dx.fill_bytes(0xFF);
  const TensorView none{}, xv = x.matrix(R, W, W), yv = y.matrix(R, W, W), dyv = dy.matrix(R, W, W),
                   dxv = dx.matrix(R, W, W), muv = mu.view({R}), rv = rstd.view({R});
  const FusedOp op = layer ? FusedOp::kLayerNorm : FusedOp::kRmsNorm;
  if (layer)
    layer_norm_forward(xv, none, none, none, 1e-5, yv, none, muv, rv, FusedVariant::kCpu);
  else
    rms_norm_forward(xv, none, none, 1e-5, yv, none, rv, FusedVariant::kCpu);
  if (backward) {
    if (layer)
      layer_norm_backward(dyv, xv, none, muv, rv, none, dxv, none, none, FusedVariant::kCpu);
    else
      rms_norm_backward(dyv, xv, none, rv, none, dxv, none, FusedVariant::kCpu);
  }
  FusedParams p;
  p.op = op;
  p.backward = backward;
  p.dtype = DType::kF32;
  p.rows = R;
  p.width = W;
  p.eps = 1e-5;
  p.x = x.data();
  p.ld_x = W;
  p.dy = dy.data();
  p.ld_dy = W;
  const FusedReference ref = fused_reference_f64(p);
  const std::vector<double>& want = backward ? ref.dx : ref.y;
  const Buffer& got = backward ? dx : y;
  double worst = 0;
  for (int64_t i = 0; i < R * W; ++i) {
    const double e = std::fabs(load_as_double(got.data(), DType::kF32, i) - want[static_cast<size_t>(i)]);
    if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
  }
  return worst;
}

// The bounds: 2x torch's own fp32 error (design.md's rule, flash-attention's), torch measured in the
// same setting -- torch 2.11 on the CPU, F.layer_norm / F.rms_norm and their autograd backward,
// fp32 vs float64 on (2, 2^20) rows of N(mean, 1), no affine, eps 1e-5, the largest of 3 seeds:
//                      mean 0: fwd   bwd      mean 100: fwd    bwd
//   layer_norm              6.0e-7  7.5e-7              1.02e-5  7.9e-6
//   rms_norm                6.1e-7  9.5e-7              1.02e-7  6.3e-9
// At mean 100 the floor of layer_norm is the fp32 rounding of the mean itself (100 * 2^-24 / 2 =
// 3e-6 per unit of rstd); rms_norm has no mean to round there. Before the blocked sums (8 running
// accumulators per row) these rows gave 8x (both backwards at mean 100) to 90x (rms_norm forward at
// mean 0: 5.4e-5) torch's error: every row of the table failed.
TEST(CpuFusedLongRows, NormsMatchTorchAccuracyAtWidth2To20) {
  struct Row {
    bool layer, backward;
    double mean, torch_error;
  };
  for (const Row& r : {Row{true, false, 0.0, 6.0e-7}, Row{true, true, 0.0, 7.5e-7}, Row{true, false, 100.0, 1.02e-5},
                       Row{true, true, 100.0, 7.9e-6}, Row{false, false, 0.0, 6.1e-7}, Row{false, true, 0.0, 9.5e-7},
                       Row{false, false, 100.0, 1.02e-7}, Row{false, true, 100.0, 6.3e-9}}) {
    const double err = long_row_norm_error(r.layer, r.backward, r.mean);
    const std::string what = std::string(r.layer ? "layer_norm" : "rms_norm") + (r.backward ? " backward" : " forward") +
                             " mean " + std::to_string(r.mean);
    EXPECT_LE(err, 2.0 * r.torch_error) << what << ": error " << err << " vs torch's " << r.torch_error;
  }
}

// ---- fp64: eps and scale as given (not rounded to fp32) -------------------------------------------

TEST(CpuFusedFp64Scalars, EpsBelowFp32RangeOnConstantRows) {
  // eps = 1e-50 rounds to 0 in fp32: var + eps = 0 and y = 0 * inf = NaN. In fp64 it is 1e-50: rstd
  // = 1e25 and y = (h - mean) * rstd = 0 exactly (+ bias), as torch gives. The rows: a constant
  // whose sum is inexact in binary (0.1), one that is exact, and zeros (rms_norm's mean square 0).
  constexpr int64_t R = 3, W = 1000;
  const double value[R] = {0.1, 3.0, 0.0};
  Buffer x(DType::kF64, R * W, Device::cpu()), y(DType::kF64, R * W, Device::cpu()),
      b(DType::kF64, W, Device::cpu()), rstd(DType::kF64, R, Device::cpu()), mean(DType::kF64, R, Device::cpu());
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < W; ++j) store_from_double(x.data(), DType::kF64, i * W + j, value[i]);
  for (int64_t j = 0; j < W; ++j) store_from_double(b.data(), DType::kF64, j, 0.25 * static_cast<double>(j % 5) - 0.5);
  const TensorView none{}, xv = x.matrix(R, W, W), yv = y.matrix(R, W, W);
  for (bool layer : {true, false}) {
    SCOPED_TRACE(layer ? "layer_norm" : "rms_norm");
    y.fill_bytes(0xFF);
    if (layer)
      layer_norm_forward(xv, none, none, b.view({W}), 1e-50, yv, none, mean.view({R}), rstd.view({R}), FusedVariant::kCpu);
    else
      rms_norm_forward(xv, none, none, 1e-50, yv, none, rstd.view({R}), FusedVariant::kCpu);
    for (int64_t i = 0; i < R; ++i) {
      if (!layer && value[i] != 0.0) continue;  // rms_norm of a non-zero constant is sign(c): eps plays no part
      for (int64_t j = 0; j < W; ++j) {
        const double want = layer ? load_as_double(b.data(), DType::kF64, j) : 0.0;
        ASSERT_EQ(load_as_double(y.data(), DType::kF64, i * W + j), want) << "row " << i << " (" << value[i] << ") col " << j;
      }
      EXPECT_NEAR(load_as_double(rstd.data(), DType::kF64, i), 1e25, 1e25 * 1e-15) << "row " << i;  // 1 / sqrt(0 + 1e-50)
    }
  }
}

TEST(CpuFusedFp64Statistics, BackwardFromTheForwardsStatisticsIsFp64Accurate) {
  // fp64 data saves fp64 mean / rstd and the backward reads them: the gradients of the library's own
  // forward + backward match the float64 reference (long double, statistics recomputed from h) to
  // ~1e-15 relative. With the fp32 statistics saved before, they were off by ~1e-8 relative.
  constexpr int64_t R = 37, W = 301;
  std::mt19937_64 rng = test_rng();
  std::normal_distribution<double> normal(0.0, 1.0);
  auto filled = [&](int64_t n, double scale, double shift) {
    Buffer b(DType::kF64, n, Device::cpu());
    for (int64_t i = 0; i < n; ++i) store_from_double(b.data(), DType::kF64, i, shift + scale * normal(rng));
    return b;
  };
  Buffer x = filled(R * W, 3.0, 2.0), res = filled(R * W, 1.0, 0.0), w = filled(W, 0.25, 1.0), bias = filled(W, 1.0, 0.0);
  Buffer dy = filled(R * W, 1.0, 0.0), dres = filled(R * W, 1.0, 0.0);
  for (FusedOp op : {FusedOp::kLayerNorm, FusedOp::kRmsNorm, FusedOp::kAddLayerNorm, FusedOp::kAddRmsNorm}) {
    SCOPED_TRACE(fused_op_name(op));
    const bool layer = op == FusedOp::kLayerNorm || op == FusedOp::kAddLayerNorm;
    const bool add = op == FusedOp::kAddLayerNorm || op == FusedOp::kAddRmsNorm;
    Buffer y(DType::kF64, R * W, Device::cpu()), h(DType::kF64, R * W, Device::cpu()), dx(DType::kF64, R * W, Device::cpu());
    Buffer dw(DType::kF64, W, Device::cpu()), db(DType::kF64, W, Device::cpu());
    Buffer mean(DType::kF64, R, Device::cpu()), rstd(DType::kF64, R, Device::cpu());
    const TensorView none{}, xv = x.matrix(R, W, W), rv = add ? res.matrix(R, W, W) : none, hv = h.matrix(R, W, W);
    const TensorView ro = add ? hv : none, yv = y.matrix(R, W, W), dyv = dy.matrix(R, W, W), dxv = dx.matrix(R, W, W);
    const TensorView drv = add ? dres.matrix(R, W, W) : none;
    if (layer) {
      layer_norm_forward(xv, rv, w.view({W}), bias.view({W}), 1e-5, yv, ro, mean.view({R}), rstd.view({R}), FusedVariant::kCpu);
      layer_norm_backward(dyv, add ? hv : xv, w.view({W}), mean.view({R}), rstd.view({R}), drv, dxv, dw.view({W}),
                          db.view({W}), FusedVariant::kCpu);
    } else {
      rms_norm_forward(xv, rv, w.view({W}), 1e-5, yv, ro, rstd.view({R}), FusedVariant::kCpu);
      rms_norm_backward(dyv, add ? hv : xv, w.view({W}), rstd.view({R}), drv, dxv, dw.view({W}), FusedVariant::kCpu);
    }
    FusedParams p;
    p.op = op;
    p.backward = true;
    p.dtype = DType::kF64;
    p.rows = R;
    p.width = W;
    p.eps = 1e-5;
    p.x = add ? h.data() : x.data();
    p.ld_x = p.ld_dy = p.ld_dresidual_out = W;
    p.dy = dy.data();
    p.weight = w.data();
    p.dresidual_out = add ? dres.data() : nullptr;
    const FusedReference ref = fused_reference_f64(p);  // recomputes the statistics of h, ignores mean / rstd
    auto rel_error = [](const Buffer& got, const std::vector<double>& want) {
      double err = 0, scale = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        err = std::max(err, std::fabs(load_as_double(got.data(), DType::kF64, static_cast<int64_t>(i)) - want[i]));
        scale = std::max(scale, std::fabs(want[i]));
      }
      return err / scale;
    };
    EXPECT_LT(rel_error(dx, ref.dx), 1e-12) << "dx";
    EXPECT_LT(rel_error(dw, ref.dweight), 1e-12) << "dweight";
    if (layer) {
      EXPECT_LT(rel_error(db, ref.dbias), 1e-12) << "dbias";
      EXPECT_LT(rel_error(mean, ref.mean), 1e-14) << "mean";
    }
    EXPECT_LT(rel_error(rstd, ref.rstd), 1e-14) << "rstd";
  }
}

TEST(CpuFusedFp64Scalars, SoftmaxScaleIsNotRoundedToFp32) {
  // scale 0.1 is 0.100000001490116... in fp32: on logits of |x| up to 4 that moves fp64 outputs by
  // ~1e-9 relative, ten million times fp64's rounding. The expected values are computed here in
  // double from the double scale (not from FusedParams, whose fields would carry any rounding to the
  // reference too). Forward and backward, softmax and log_softmax.
  constexpr int64_t R = 3, W = 257;
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-4.0, 4.0);
  Buffer x(DType::kF64, R * W, Device::cpu()), dy(DType::kF64, R * W, Device::cpu()), out(DType::kF64, R * W, Device::cpu());
  auto* xp = static_cast<double*>(x.data());
  auto* dyp = static_cast<double*>(dy.data());
  const auto* op = static_cast<const double*>(out.data());
  for (int64_t i = 0; i < R * W; ++i) xp[i] = u(rng), dyp[i] = u(rng) / 4;
  for (double scale : {0.1, -1.0 / 3.0}) {
    ASSERT_NE(static_cast<double>(static_cast<float>(scale)), scale);
    for (bool log : {false, true}) {
      SCOPED_TRACE(std::string(log ? "log_softmax" : "softmax") + " scale " + std::to_string(scale));
      out.fill_bytes(0xFF);
      softmax_forward(x.matrix(R, W, W), out.matrix(R, W, W), scale, log, FusedVariant::kCpu);
      for (int64_t i = 0; i < R; ++i) {
        const double* xr = xp + i * W;
        double m = -INFINITY, total = 0;
        for (int64_t j = 0; j < W; ++j) m = std::max(m, scale * xr[j]);
        for (int64_t j = 0; j < W; ++j) total += std::exp(scale * xr[j] - m);
        for (int64_t j = 0; j < W; ++j) {
          const double want = log ? scale * xr[j] - m - std::log(total) : std::exp(scale * xr[j] - m) / total;
          ASSERT_NEAR(op[i * W + j], want, 1e-14 * (1 + std::fabs(want))) << "forward row " << i << " col " << j;
        }
      }
      // Backward from y = x (any values serve: the formula is what is checked).
      out.fill_bytes(0xFF);
      softmax_backward(x.matrix(R, W, W), dy.matrix(R, W, W), out.matrix(R, W, W), scale, log, FusedVariant::kCpu);
      for (int64_t i = 0; i < R; ++i) {
        const double *yr = xp + i * W, *gr = dyp + i * W;
        double dot = 0, sum = 0;
        for (int64_t j = 0; j < W; ++j) dot += gr[j] * yr[j], sum += gr[j];
        for (int64_t j = 0; j < W; ++j) {
          const double want = log ? scale * (gr[j] - std::exp(yr[j]) * sum) : scale * yr[j] * (gr[j] - dot);
          ASSERT_NEAR(op[i * W + j], want, 1e-13 * (1 + std::fabs(want))) << "backward row " << i << " col " << j;
        }
      }
    }
  }
}

}  // namespace
}  // namespace optimized::testing
