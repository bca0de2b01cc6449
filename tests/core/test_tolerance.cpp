// The tolerance rules of optimized_ops_testing (src/testing/tolerance.h) and their application:
//   - on the fixed numbers of tests/common/tolerance_vectors.txt, which pytest recomputes with the
//     Python mirror (bench/tolerance.py, tests/python/test_tolerance.py): C++ and Python agree;
//   - the NaN / Inf rules, rounding, and the per-unit reduction check (a unit passes at the
//     same-dtype reference's error and fails beyond the bound);
//   - the parameters the fused check takes per output (reduction length, accumulation unit).
// Each family's own tests prove its rule rejects wrong results (test_gemm_cpu's CheckGemm.*,
// test_fused_cpu's ToleranceCatches.*).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "testing/check.h"
#include "testing/fused_check.h"
#include "testing/tolerance.h"

namespace optimized::testing {
namespace {

::testing::AssertionResult close(double got, double want) {
  if (got == want || std::fabs(got - want) <= 1e-12 * std::fabs(want)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << got << " != " << want;
}

TEST(ToleranceVectors, TheCppRulesGiveTheListedBounds) {
  std::ifstream in(OPTIMIZED_TOLERANCE_VECTORS);
  ASSERT_TRUE(in) << "cannot read " << OPTIMIZED_TOLERANCE_VECTORS;
  std::string line;
  int gemm = 0, reduction = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream s(line);
    std::string kind, dtype;
    s >> kind >> dtype;
    const DType d = parse_dtype(dtype);
    if (kind == "gemm") {
      int64_t k = 0;
      double ref = 0, magnitude = 0, want = 0;
      ASSERT_TRUE(s >> k >> ref >> magnitude >> want) << line;
      EXPECT_TRUE(close(gemm_allowed_error(d, k, ref, magnitude), want)) << line;
      ++gemm;
    } else if (kind == "reduction") {
      int64_t n = 0;
      double same_error = 0, max_ref = 0, terms = 0, u_acc = 0, want = 0;
      ASSERT_TRUE(s >> n >> same_error >> max_ref >> terms >> u_acc >> want) << line;
      EXPECT_TRUE(close(reduction_allowed_error(d, n, same_error, max_ref, terms, u_acc), want)) << line;
      ++reduction;
    } else {
      ADD_FAILURE() << "unknown rule '" << kind << "': " << line;
    }
  }
  EXPECT_GT(gemm, 0);
  EXPECT_GT(reduction, 0);
}

TEST(Tolerance, DtypeFacts) {
  EXPECT_EQ(unit_roundoff(DType::kF32), std::ldexp(1.0, -24));
  EXPECT_EQ(unit_roundoff(DType::kF16), std::ldexp(1.0, -11));
  EXPECT_EQ(unit_roundoff(DType::kBF16), std::ldexp(1.0, -8));
  EXPECT_EQ(unit_roundoff(DType::kF64), std::ldexp(1.0, -53));
  EXPECT_EQ(accumulation_unit(DType::kBF16), std::ldexp(1.0, -24));
  EXPECT_EQ(accumulation_unit(DType::kF64), std::ldexp(1.0, -53));
  EXPECT_EQ(round_to(DType::kBF16, 1.0 + std::ldexp(1.0, -9)), 1.0);  // a tie: to even
  EXPECT_EQ(round_to(DType::kF16, 1.0 + std::ldexp(1.0, -10)), 1.0 + std::ldexp(1.0, -10));
  EXPECT_TRUE(std::isnan(round_to(DType::kF32, std::nan(""))));
  EXPECT_EQ(round_to(DType::kF64, 0.1), 0.1);
}

TEST(Tolerance, NanAndInfRules) {
  double ratio = 0;
  EXPECT_TRUE(element_ok(std::nan(""), std::nan(""), 0.0, &ratio));
  EXPECT_FALSE(element_ok(1.0, std::nan(""), 1.0, &ratio));
  EXPECT_FALSE(element_ok(std::nan(""), 1.0, 1e300, &ratio));
  EXPECT_TRUE(element_ok(INFINITY, INFINITY, 0.0, &ratio));
  EXPECT_FALSE(element_ok(-INFINITY, INFINITY, 1e300, &ratio));
  EXPECT_FALSE(element_ok(1e300, INFINITY, 1e300, &ratio));
  EXPECT_FALSE(element_ok(INFINITY, 1.0, 1e300, &ratio));  // a finite reference: Inf is an error
  EXPECT_TRUE(element_ok(1.5, 1.0, 0.5, &ratio));
  EXPECT_EQ(ratio, 1.0);
  EXPECT_FALSE(element_ok(1.5, 1.0, 0.49, &ratio));
}

TEST(Tolerance, ReductionUnitPassesAtTheSameDtypeErrorAndFailsBeyond) {
  // A bf16 unit whose same-dtype reference is off by 0.01 at one element: an output off by 2x
  // that passes, one off by 0.03 + the noise fails.
  const ReductionRule rule{DType::kBF16, 64, std::ldexp(1.0, -24)};
  const std::vector<double> ref = {1.0, -0.5, 0.25, 2.0};
  const std::vector<double> same = {1.0, -0.5, 0.25, 2.0 + 0.01};
  const double allowed = reduction_allowed_error(DType::kBF16, 64, round_to(DType::kBF16, 2.01) - 2.0, 2.0, 0.0,
                                                 std::ldexp(1.0, -24));
  auto check = [&](double off) {
    std::vector<double> got = ref;
    got[1] += off;
    CheckResult r;
    check_reduction_unit(rule, got.data(), ref.data(), same.data(), 4, 0.0,
                         [](int64_t j) { return "y[" + std::to_string(j) + "]"; }, r);
    return r;
  };
  EXPECT_TRUE(check(0.99 * allowed).passed);
  const CheckResult bad = check(1.01 * allowed);
  EXPECT_FALSE(bad.passed);
  EXPECT_EQ(bad.failures, 1);
  EXPECT_TRUE(contains(bad.first_failure, "y[1]")) << bad.first_failure;
  // The terms raise the scale of the accumulation noise (a result that cancels far below its terms).
  CheckResult with_terms;
  std::vector<double> got = ref;
  got[1] += 1.01 * allowed;
  check_reduction_unit(rule, got.data(), ref.data(), same.data(), 4, 1e5, [](int64_t) { return ""; },
                       with_terms);
  EXPECT_TRUE(with_terms.passed);
}

TEST(Tolerance, MergeKeepsTheFirstFailure) {
  CheckResult total;
  CheckResult ok;
  ok.passed = true;
  ok.checked = 3;
  total.merge(ok);
  EXPECT_TRUE(total.passed);
  CheckResult bad;
  bad.checked = 2;
  bad.failures = 1;
  bad.worst_ratio = 4;
  bad.first_failure = "y[0, 1] = 3";
  total.merge(bad, "(rows from 8) ");
  EXPECT_FALSE(total.passed);
  EXPECT_EQ(total.checked, 5);
  EXPECT_EQ(total.failures, 1);
  EXPECT_EQ(total.worst_ratio, 4);
  EXPECT_EQ(total.first_failure, "(rows from 8) y[0, 1] = 3");
}

TEST(FusedRule, ReductionLengthAndAccumulationUnitPerOutput) {
  FusedParams p;
  p.op = FusedOp::kLayerNorm;
  p.dtype = DType::kBF16;
  p.rows = 100;
  p.width = 4096;
  EXPECT_EQ(fused_rule(p, FusedOutput::kY).n, 4096);
  EXPECT_EQ(fused_rule(p, FusedOutput::kMean).out, DType::kF32);
  p.op = FusedOp::kAddRmsNorm;
  EXPECT_EQ(fused_rule(p, FusedOutput::kResidualOut).n, 1);  // h = x + residual: no reduction
  p.backward = true;
  p.dtype = DType::kF64;
  EXPECT_EQ(fused_rule(p, FusedOutput::kDweight).n, 100);  // a sum over rows
  EXPECT_EQ(fused_rule(p, FusedOutput::kDx).u_acc, std::ldexp(1.0, -53));  // fp64 data: fp64 statistics
  EXPECT_EQ(fused_rule(p, FusedOutput::kRstd).out, DType::kF64);
  p.dtype = DType::kF32;
  EXPECT_EQ(fused_rule(p, FusedOutput::kDx).u_acc, std::ldexp(1.0, -24));  // reads fp32 statistics
  EXPECT_EQ(fused_rule(p, FusedOutput::kRstd).out, DType::kF32);
  p.dtype = DType::kF64;
  p.op = FusedOp::kSoftmax;
  EXPECT_EQ(fused_rule(p, FusedOutput::kDx).u_acc, std::ldexp(1.0, -53));
  p.op = FusedOp::kBiasGelu;
  EXPECT_EQ(fused_rule(p, FusedOutput::kDx).n, 1);
  EXPECT_EQ(fused_rule(p, FusedOutput::kDbias).n, 100);
}

}  // namespace
}  // namespace optimized::testing
