// CPU GEMM: every CPU rung of the ladder (cpu_naive, cpu_blocked, cpu_packed) and kAuto, for fp32,
// fp16 and bf16, against the float64 reference on fresh random inputs, with poisoned outputs and
// padding (see gemm_test_util.h).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string_view>
#include <tuple>

#include "gemm/cpu/cpu_gemm.h"
#include "gemm_test_util.h"

namespace optimized::testing {
namespace {

const std::vector<GemmVariant> kCpuVariants = {GemmVariant::kCpuNaive, GemmVariant::kCpuBlocked,
                                               GemmVariant::kCpuPacked, GemmVariant::kAuto};
const std::vector<DType> kDtypes = {DType::kF32, DType::kF16, DType::kBF16};
// fp64 (accumulated in fp64) runs on the two plain CPU rungs and on auto, which picks cpu_blocked.
const std::vector<GemmVariant> kF64Variants = {GemmVariant::kCpuNaive, GemmVariant::kCpuBlocked, GemmVariant::kAuto};

std::string variant_label(GemmVariant v) { return std::string(gemm_variant_name(v)); }

// ---- every odd size, every variant, every dtype -------------------------------------------------

using SizeParam = std::tuple<GemmVariant, DType, Mnk>;

class CpuGemmSizes : public ::testing::TestWithParam<SizeParam> {};

TEST_P(CpuGemmSizes, MatchesReference) {
  const auto& [variant, dtype, s] = GetParam();
  GemmCase cs;
  cs.variant = variant;
  cs.dtype = dtype;
  cs.m = s.m;
  cs.n = s.n;
  cs.k = s.k;
  expect_gemm_ok(cs);
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuGemmSizes,
                         ::testing::Combine(::testing::ValuesIn(kCpuVariants), ::testing::ValuesIn(kDtypes),
                                            ::testing::ValuesIn(odd_sizes())),
                         [](const ::testing::TestParamInfo<SizeParam>& info) {
                           return variant_label(std::get<0>(info.param)) + "_" +
                                  dtype_label(std::get<1>(info.param)) + "_" + mnk_name(std::get<2>(info.param));
                         });
INSTANTIATE_TEST_SUITE_P(CpuF64, CpuGemmSizes,
                         ::testing::Combine(::testing::ValuesIn(kF64Variants), ::testing::Values(DType::kF64),
                                            ::testing::ValuesIn(odd_sizes())),
                         [](const ::testing::TestParamInfo<SizeParam>& info) {
                           return variant_label(std::get<0>(info.param)) + "_" +
                                  dtype_label(std::get<1>(info.param)) + "_" + mnk_name(std::get<2>(info.param));
                         });

// ---- strides, alpha/beta, batches, threads, NaN/Inf, per variant and dtype ------------------------

using VariantParam = std::tuple<GemmVariant, DType>;

class CpuGemm : public ::testing::TestWithParam<VariantParam> {
 protected:
  GemmCase base(int64_t m, int64_t n, int64_t k) const {
    GemmCase cs;
    cs.variant = std::get<0>(GetParam());
    cs.dtype = std::get<1>(GetParam());
    cs.m = m;
    cs.n = n;
    cs.k = k;
    return cs;
  }
};

TEST_P(CpuGemm, LeadingDimsLargerThanWidth) {
  for (Mnk s : {Mnk{17, 33, 65}, Mnk{127, 129, 131}, Mnk{1, 257, 1}, Mnk{257, 1, 129}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.lda_pad = 3;
    cs.ldb_pad = 5;
    cs.ldc_pad = 7;
    expect_gemm_ok(cs);
    cs.lda_pad = 16;  // rows aligned again, but still padded
    cs.ldb_pad = 1;
    cs.ldc_pad = 32;
    expect_gemm_ok(cs);
  }
}

TEST_P(CpuGemm, ViewsNotAtBufferStart) {
  // Each view starts one element into its buffer: SIMD loads must not assume alignment.
  for (Mnk s : {Mnk{17, 33, 65}, Mnk{64, 64, 64}, Mnk{127, 129, 131}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.offset = 1;
    cs.lda_pad = 1;
    cs.ldc_pad = 2;
    expect_gemm_ok(cs);
  }
}

TEST_P(CpuGemm, AlphaBeta) {
  for (Mnk s : {Mnk{127, 129, 131}, Mnk{31, 1, 97}, Mnk{2, 3, 4}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.alpha = 0.5f;
    cs.beta = -1.25f;
    expect_gemm_ok(cs);
    cs.ldc_pad = 3;
    cs.alpha = -2.0f;
    cs.beta = 1.0f;
    expect_gemm_ok(cs);
  }
}

TEST_P(CpuGemm, BetaZeroDoesNotReadNanC) {
  // C is all NaN bytes before the run; beta == 0 must not read it: every element finite.
  for (Mnk s : {Mnk{17, 33, 65}, Mnk{127, 129, 131}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    cs.alpha = 0.75f;
    cs.beta = 0.0f;
    cs.ldc_pad = 5;
    GemmOperands ops(cs);
    GemmRun run = run_gemm(ops);
    EXPECT_TRUE(run.check.passed) << cs.describe() << ": " << run.check.first_failure;
    int64_t non_finite = 0;
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = 0; j < cs.n; ++j)
        non_finite += !std::isfinite(load_as_double(run.c.data(), cs.dtype, ops.lc.at(0, i, j)));
    EXPECT_EQ(non_finite, 0) << cs.describe() << ": beta == 0 must not propagate NaN from the old C";
  }
}

TEST_P(CpuGemm, BetaNonZeroReadsC) {
  GemmCase cs = base(31, 33, 17);
  cs.alpha = 0.0f;  // C = beta * C exactly
  cs.beta = 1.0f;
  expect_gemm_ok(cs);
  cs.alpha = 1.0f;
  cs.beta = 2.0f;
  expect_gemm_ok(cs);
  cs.alpha = 0.0f;  // C = 0 exactly, even over a NaN-poisoned C
  cs.beta = 0.0f;
  expect_gemm_ok(cs);
}

TEST_P(CpuGemm, BatchedBroadcastBStride0) {
  GemmCase cs = base(37, 41, 29);
  cs.batch = 3;
  cs.b_bcast = Broadcast::kStride0;
  expect_gemm_ok(cs);
  cs.lda_pad = 2;
  cs.ldb_pad = 3;
  cs.ldc_pad = 1;
  cs.batch_gap = 5;
  cs.alpha = 0.5f;
  cs.beta = -1.25f;
  expect_gemm_ok(cs);
}

TEST_P(CpuGemm, BatchedBroadcastBRank2) {
  GemmCase cs = base(37, 41, 29);
  cs.batch = 3;
  cs.b_bcast = Broadcast::kRank2;
  expect_gemm_ok(cs);
}

TEST_P(CpuGemm, BatchedBroadcastA) {
  GemmCase cs = base(37, 41, 29);
  cs.batch = 3;
  cs.a_bcast = Broadcast::kStride0;
  expect_gemm_ok(cs);
  cs.a_bcast = Broadcast::kRank2;
  cs.batch_gap = 3;
  expect_gemm_ok(cs);
}

TEST_P(CpuGemm, BatchedNoBroadcast) {
  GemmCase cs = base(65, 31, 47);
  cs.batch = 4;
  cs.batch_gap = 7;
  cs.ldc_pad = 2;
  expect_gemm_ok(cs);
  cs.batch = 1;  // rank 3 with a batch of one
  expect_gemm_ok(cs);
}

TEST_P(CpuGemm, Threads) {
  for (int threads : {1, 2, 3}) {
    for (Mnk s : {Mnk{127, 129, 131}, Mnk{255, 257, 100}, Mnk{3, 300, 5}}) {
      GemmCase cs = base(s.m, s.n, s.k);
      cs.cpu_threads = threads;
      expect_gemm_ok(cs);
    }
    GemmCase cs = base(37, 41, 29);
    cs.batch = 3;
    cs.cpu_threads = threads;
    expect_gemm_ok(cs);
  }
}

TEST_P(CpuGemm, AliasedInputsAreFine) {
  // A and B may be the same memory (only C must not overlap them).
  const GemmCase cs0 = base(45, 45, 45);
  GemmOperands ops(cs0);
  Buffer c(cs0.dtype, ops.lc.storage(), Device::cpu());
  c.fill_bytes(0xFF);
  const TensorView a = ops.host_a();
  matmul(a, a, ops.host_c(c), 1.0f, 0.0f, cs0.variant);
  const CheckResult r = check_gemm(a, a, nullptr, ops.host_c(c), 1.0f, 0.0f);
  EXPECT_TRUE(r.passed) << r.first_failure;
}

TEST_P(CpuGemm, Layouts) {
  // Every layout of A, B and C, on sizes with a dimension of 1 (where a view's stride along it
  // does not matter), odd sizes, padded leading dimensions, batches with a broadcast operand.
  for (const GemmLayout& l : gemm_layouts(true)) {
    SCOPED_TRACE(l.name());
    for (Mnk s : {Mnk{17, 33, 65}, Mnk{1, 257, 1}, Mnk{257, 1, 129}, Mnk{127, 129, 131}, Mnk{1, 1, 1}}) {
      GemmCase cs = base(s.m, s.n, s.k);
      l.apply(cs);
      expect_gemm_ok(cs);
      cs.lda_pad = 3;
      cs.ldb_pad = 5;
      cs.ldc_pad = 7;
      cs.alpha = 0.5f;
      cs.beta = -1.25f;
      expect_gemm_ok(cs);
    }
    GemmCase cs = base(37, 41, 29);
    l.apply(cs);
    cs.batch = 3;
    cs.batch_gap = 5;
    cs.a_bcast = Broadcast::kStride0;
    expect_gemm_ok(cs);
    cs.a_bcast = Broadcast::kNone;
    cs.b_bcast = Broadcast::kRank2;
    expect_nan_inf_propagation(cs);
  }
}

TEST_P(CpuGemm, NanAndInfPropagate) {
  for (Mnk s : {Mnk{17, 33, 65}, Mnk{127, 129, 131}, Mnk{2, 3, 4}, Mnk{1, 257, 1}}) {
    GemmCase cs = base(s.m, s.n, s.k);
    expect_nan_inf_propagation(cs);
  }
  GemmCase cs = base(37, 41, 29);
  cs.batch = 2;
  cs.b_bcast = Broadcast::kStride0;
  cs.alpha = 0.5f;
  expect_nan_inf_propagation(cs);
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuGemm,
                         ::testing::Combine(::testing::ValuesIn(kCpuVariants), ::testing::ValuesIn(kDtypes)),
                         [](const ::testing::TestParamInfo<VariantParam>& info) {
                           return variant_label(std::get<0>(info.param)) + "_" + dtype_label(std::get<1>(info.param));
                         });
INSTANTIATE_TEST_SUITE_P(CpuF64, CpuGemm,
                         ::testing::Combine(::testing::ValuesIn(kF64Variants), ::testing::Values(DType::kF64)),
                         [](const ::testing::TestParamInfo<VariantParam>& info) {
                           return variant_label(std::get<0>(info.param)) + "_" + dtype_label(std::get<1>(info.param));
                         });

// ---- big sizes: cpu_packed only (sampled check) -----------------------------------------------

class CpuGemmBig : public ::testing::TestWithParam<DType> {};

TEST_P(CpuGemmBig, BigPacked1024) {
  GemmCase cs;
  cs.variant = GemmVariant::kCpuPacked;
  cs.dtype = GetParam();
  cs.m = cs.n = cs.k = 1024;
  cs.samples = 4096;
  expect_gemm_ok(cs);
}

TEST_P(CpuGemmBig, BigPackedOdd1031x1033x1021) {
  GemmCase cs;
  cs.variant = GemmVariant::kCpuPacked;
  cs.dtype = GetParam();
  cs.m = 1031;
  cs.n = 1033;
  cs.k = 1021;
  cs.samples = 4096;
  cs.ldc_pad = 3;
  cs.alpha = 0.5f;
  cs.beta = -1.25f;
  expect_gemm_ok(cs);
}

TEST_P(CpuGemmBig, BigPackedTransposedOperands) {
  // The packed rung's panels from column-major A and B (and a column-major C).
  for (const GemmLayout& l : {GemmLayout{true, true, false}, GemmLayout{false, true, true}}) {
    GemmCase cs;
    cs.variant = GemmVariant::kCpuPacked;
    cs.dtype = GetParam();
    cs.m = 531;
    cs.n = 1033;
    cs.k = 1021;
    cs.samples = 4096;
    cs.lda_pad = 3;
    l.apply(cs);
    expect_gemm_ok(cs);
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuGemmBig, ::testing::ValuesIn(kDtypes),
                         [](const ::testing::TestParamInfo<DType>& info) { return dtype_label(info.param); });

// ---- every CPU variant gives the same results on the same inputs ------------------------------

class CpuGemmAgree : public ::testing::TestWithParam<DType> {};

TEST_P(CpuGemmAgree, AllCpuVariants) {
  GemmCase cs;
  cs.dtype = GetParam();
  cs.m = 131;
  cs.n = 137;
  cs.k = 139;
  cs.alpha = 0.5f;
  cs.beta = -1.25f;
  expect_variants_agree(cs, {GemmVariant::kCpuNaive, GemmVariant::kCpuBlocked, GemmVariant::kCpuPacked,
                             GemmVariant::kAuto});
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuGemmAgree, ::testing::ValuesIn(kDtypes),
                         [](const ::testing::TestParamInfo<DType>& info) { return dtype_label(info.param); });

// ---- kAuto on the CPU picks a CPU rung -------------------------------------------------------

TEST(CpuGemmAuto, ResolvesToACpuVariant) {
  Buffer a(DType::kF32, 64 * 64, Device::cpu()), b(DType::kF32, 64 * 64, Device::cpu()),
      c(DType::kF32, 64 * 64, Device::cpu());
  const GemmVariant v = resolve_gemm_variant(a.view({64, 64}), b.view({64, 64}), c.view({64, 64}));
  EXPECT_NE(v, GemmVariant::kAuto);
  EXPECT_FALSE(gemm_variant_is_cuda(v)) << gemm_variant_name(v);
}

// ---- the checker itself ---------------------------------------------------------------------

// A 1x1x1 product a*b, checked with C given as `c` (fp16).
CheckResult check_scalar_f16(uint16_t a, uint16_t b, uint16_t c) {
  uint16_t av = a, bv = b, cv = c;
  const TensorView A(&av, DType::kF16, Device::cpu(), {1, 1}), B(&bv, DType::kF16, Device::cpu(), {1, 1}),
      C(&cv, DType::kF16, Device::cpu(), {1, 1});
  return check_gemm(A, B, nullptr, C, 1.0f, 0.0f);
}

TEST(CheckGemm, RejectsWrongAndUnwrittenResults) {
  const uint16_t a = float_to_half(0.75f), b = float_to_half(-1.5f);
  EXPECT_TRUE(check_scalar_f16(a, b, float_to_half(-1.125f)).passed);
  EXPECT_FALSE(check_scalar_f16(a, b, float_to_half(-1.25f)).passed);
  EXPECT_FALSE(check_scalar_f16(a, b, 0x7E00).passed);  // NaN: never written
  EXPECT_FALSE(check_scalar_f16(a, b, 0xFC00).passed);  // -Inf for a finite result
  EXPECT_FALSE(check_scalar_f16(a, b, float_to_half(-1.125f) + 2).passed);  // two ulps off
}

TEST(CheckGemm, AcceptsCorrectlyRoundedSubnormalOutputs) {
  // Products in fp16's subnormal range (< 2^-14) round to a multiple of 2^-24: an absolute error
  // up to 2^-25, larger than fp16's relative unit roundoff times the result. A correctly rounded
  // output must pass the check.
  int tried = 0;
  for (uint16_t bh = float_to_half(0.001f); bh < float_to_half(0.008f) && tried < 200; ++bh) {
    const uint16_t ah = float_to_half(0.01f);
    const double ref = static_cast<double>(half_to_float(ah)) * half_to_float(bh);
    const uint16_t rounded = float_to_half(static_cast<float>(ref));
    const double err = std::fabs(half_to_float(rounded) - ref);
    if (err <= std::ldexp(1.0, -11) * ref * 1.01) continue;  // within the relative bound anyway
    ++tried;
    const CheckResult r = check_scalar_f16(ah, bh, rounded);
    ASSERT_TRUE(r.passed) << "a = " << half_to_float(ah) << ", b = " << half_to_float(bh) << ": fp16 output "
                          << half_to_float(rounded) << " is a*b = " << ref
                          << " correctly rounded (subnormal, error " << err << " <= 2^-25), but check_gemm says: "
                          << r.first_failure;
  }
  EXPECT_GT(tried, 0);
}

}  // namespace
}  // namespace optimized::testing

namespace optimized::testing {
namespace {

// Under the ctest entries cpu_packed_avx2 / cpu_packed_portable: the forced microkernel is the one
// that ran (otherwise those entries would silently retest the best one).
TEST(CpuPackedIsa, HonoursTheRequestedMicrokernel) {
  const char* want = std::getenv("OPTIMIZED_CPU_ISA");
  if (want == nullptr) GTEST_SKIP() << "OPTIMIZED_CPU_ISA is not set (the run-time choice is in use)";
  if (std::string_view(want) == "avx2" && !__builtin_cpu_supports("avx2"))
    GTEST_SKIP() << "this CPU has no AVX2";
  EXPECT_STREQ(cpu::packed_microkernel_isa(), want);
}

}  // namespace
}  // namespace optimized::testing
