// The CUDA rungs of the linear family (naive, fused, persistent, auto) against the float64
// reference (src/testing/linear_reference.h): the cpu sweep's cases (every activation, M = 0, 1, 7,
// 37, K and N from 1 to 130, padded rows, pre kept and recomputed) for each rung's dtypes, leading
// batch dimensions, fp32 gradients from 16-bit inputs, accumulate (exactly 2x), grad_bias the same
// bits across runs, absent gradients untouched, a caller's workspace. persistent loads x, W and g
// through TMA (16-byte aligned rows): its sweep keeps K and N multiples of 8 and unpadded rows, and
// a misaligned case must refuse with an Error. Every test skips without a CUDA device.
#include <gtest/gtest.h>

#include "linear_test_util.h"

namespace optimized::testing {
namespace {

struct RungDtype {
  LinearVariant variant;
  DType dtype;
};

class LinearCudaSweep : public ::testing::TestWithParam<RungDtype> {};

// The rung runs on this device (persistent: sm_90a build and a 9.0 device), else skip.
bool runs_here(LinearVariant v) {
  if (v != LinearVariant::kPersistent) return true;
  LinearCase c;
  c.dtype = DType::kBF16, c.variant = v, c.k = 64, c.n = 64;
  std::mt19937_64 rng(1);
  const LinearData d(c, rng);
  std::vector<Buffer> after;
  bool ok = true;
  run_on_cuda(d.all(), Device::cuda(0), nullptr,
              [&](const std::vector<void*>& p) {
                try {
                  d.forward(p, Device::cuda(0));
                } catch (const Error& e) {
                  ok = e.status() != Status::kUnsupported;
                }
              },
              after);
  return ok;
}

TEST_P(LinearCudaSweep, EveryActivationAndSize) {
  SKIP_WITHOUT_CUDA();
  const RungDtype rd = GetParam();
  if (!runs_here(rd.variant)) GTEST_SKIP() << "persistent does not run here (sm_90a build and a 9.0 device)";
  std::mt19937_64 rng = test_rng();
  for (LinearCase c : sweep_cases(rd.dtype, rd.variant)) {
    if (rd.variant == LinearVariant::kPersistent) {
      c.k = (c.k + 7) / 8 * 8, c.n = (c.n + 7) / 8 * 8, c.pad = 0;
    }
    run_and_check(c, true, rng);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rungs, LinearCudaSweep,
    ::testing::Values(RungDtype{LinearVariant::kNaive, DType::kF32}, RungDtype{LinearVariant::kNaive, DType::kF16},
                      RungDtype{LinearVariant::kNaive, DType::kBF16}, RungDtype{LinearVariant::kFused, DType::kF16},
                      RungDtype{LinearVariant::kFused, DType::kBF16}, RungDtype{LinearVariant::kPersistent, DType::kF16},
                      RungDtype{LinearVariant::kPersistent, DType::kBF16}, RungDtype{LinearVariant::kAuto, DType::kF32},
                      RungDtype{LinearVariant::kAuto, DType::kBF16}),
    [](const auto& info) {
      return std::string(linear_variant_name(info.param.variant)) + "_" + std::string(dtype_name(info.param.dtype));
    });

std::vector<LinearVariant> half_rungs() {
  return {LinearVariant::kNaive, LinearVariant::kFused, LinearVariant::kPersistent, LinearVariant::kAuto};
}

TEST(LinearCuda, LeadingDimsFp32GradientsAndAccumulate) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  for (LinearVariant v : half_rungs()) {
    if (!runs_here(v)) continue;
    for (Activation act : {Activation::kNone, Activation::kGeluTanh, Activation::kSilu})
      for (bool accumulate : {false, true}) {
        LinearCase c;
        c.dtype = DType::kBF16, c.variant = v, c.lead = {2, 3}, c.k = 64, c.n = 136, c.act = act;
        c.same_grad_dtype = false, c.grad_dtype = DType::kF32, c.accumulate = accumulate, c.keep_pre = !accumulate;
        run_and_check(c, true, rng);
      }
  }
}

// Twice with accumulate onto zeros: exactly 2x once; grad_bias the same bits on every run.
TEST(LinearCuda, AccumulateExactAndDeterministic) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  for (LinearVariant v : half_rungs()) {
    if (!runs_here(v)) continue;
    LinearCase c;
    c.dtype = DType::kF16, c.variant = v, c.lead = {300}, c.k = 64, c.n = 200, c.act = Activation::kGeluErf;
    c.same_grad_dtype = false, c.grad_dtype = DType::kF32, c.accumulate = true, c.want_gi = false;
    SCOPED_TRACE(c.name());
    LinearData d(c, rng);
    d.gw.fill_bytes(0), d.gb.fill_bytes(0);
    std::vector<Buffer> once = run_case(true, d.all(), [&](const std::vector<void*>& p, Device dev) {
      d.forward(p, dev);
      d.backward(p, dev);
    });
    std::vector<Buffer> twice = run_case(true, d.all(), [&](const std::vector<void*>& p, Device dev) {
      d.forward(p, dev);
      d.backward(p, dev);
      d.backward(p, dev);
    });
    std::vector<Buffer> again = run_case(true, d.all(), [&](const std::vector<void*>& p, Device dev) {
      d.forward(p, dev);
      d.backward(p, dev);
    });
    ASSERT_EQ(once.size(), 9u);
    ASSERT_EQ(twice.size(), 9u);
    for (size_t i : {LinearData::kGw, LinearData::kGb})
      for (int64_t e = 0; e < once[i].count(); ++e)
        ASSERT_EQ(load_as_double(twice[i].data(), DType::kF32, e), 2 * load_as_double(once[i].data(), DType::kF32, e));
    EXPECT_TRUE(same_bytes(once[LinearData::kGb], again[LinearData::kGb]));
    EXPECT_TRUE(same_bytes(once[LinearData::kGw], again[LinearData::kGw]));
  }
}

TEST(LinearCuda, AbsentGradientsAndNoRows) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  for (int mask = 0; mask < 8; ++mask) {
    LinearCase c;
    c.dtype = DType::kBF16, c.variant = LinearVariant::kFused, c.lead = {37}, c.k = 64, c.n = 72;
    c.act = Activation::kRelu, c.keep_pre = mask % 2 == 1;
    c.want_gi = mask & 1, c.want_gw = mask & 2, c.want_gb = mask & 4;
    run_and_check(c, true, rng);
  }
  LinearCase c;
  c.dtype = DType::kF16, c.variant = LinearVariant::kNaive, c.lead = {0}, c.k = 5, c.n = 7, c.act = Activation::kSilu;
  LinearData d(c, rng);
  std::vector<Buffer> r = run_case(true, d.all(), [&](const std::vector<void*>& p, Device dev) { d.backward(p, dev); });
  ASSERT_EQ(r.size(), 9u);
  for (int64_t i = 0; i < d.gw.count(); ++i) EXPECT_EQ(load_as_double(r[LinearData::kGw].data(), c.dtype, i), 0.0);
  for (int64_t i = 0; i < d.gb.count(); ++i) EXPECT_EQ(load_as_double(r[LinearData::kGb].data(), c.dtype, i), 0.0);
}

// persistent loads through TMA: rows that are not 16-byte aligned are refused with an Error.
TEST(LinearCuda, PersistentRefusesMisalignedRows) {
  SKIP_WITHOUT_CUDA();
  if (!runs_here(LinearVariant::kPersistent)) GTEST_SKIP() << "persistent does not run here";
  std::mt19937_64 rng = test_rng();
  LinearCase c;
  c.dtype = DType::kBF16, c.variant = LinearVariant::kPersistent, c.lead = {7}, c.k = 67, c.n = 64;
  const LinearData d(c, rng);
  bool thrown = false;
  std::vector<Buffer> after;
  run_on_cuda(d.all(), Device::cuda(0), nullptr,
              [&](const std::vector<void*>& p) {
                const Caught r = call([&] { d.forward(p, Device::cuda(0)); });
                thrown = r.thrown;
                EXPECT_MENTIONS(r, "linear_forward");
              },
              after);
  EXPECT_TRUE(thrown);
}

// A caller's workspace: the scratch of the backward (pre, g, partial sums) and the GEMMs' come from it.
TEST(LinearCuda, CallersWorkspace) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  LinearCase c;
  c.dtype = DType::kBF16, c.variant = LinearVariant::kAuto, c.lead = {37}, c.k = 130, c.n = 64;
  c.act = Activation::kGeluErf, c.keep_pre = false;
  const LinearData d(c, rng);
  Buffer ws(DType::kF32, 16 << 20, Device::cuda(0));
  std::vector<Buffer> with = run_case(true, d.all(), [&](const std::vector<void*>& p, Device dev) {
    ExecutionContext ctx;
    ctx.workspace = {ws.data(), ws.bytes()};
    d.backward(p, dev, ctx);
  });
  std::vector<Buffer> without = run_case(true, d.all(), [&](const std::vector<void*>& p, Device dev) { d.backward(p, dev); });
  ASSERT_EQ(with.size(), 9u);
  for (size_t i : {LinearData::kGi, LinearData::kGw, LinearData::kGb}) EXPECT_TRUE(same_bytes(with[i], without[i])) << i;
}

// fp8 on the CUDA rungs that take it (naive: the scaled naive GEMM; persistent: wgmma_fp8; auto),
// against the emulated reference; any K and N (the GEMMs read the cast's own 16-byte rows).
class LinearCudaFp8 : public ::testing::TestWithParam<RungDtype> {};

TEST_P(LinearCudaFp8, EveryActivationAndSize) {
  SKIP_WITHOUT_CUDA();
  const RungDtype rd = GetParam();
  if (!runs_here(rd.variant)) GTEST_SKIP() << "persistent does not run here (sm_90a build and a 9.0 device)";
  std::mt19937_64 rng = test_rng();
  for (const LinearCase& c : fp8_cases(rd.dtype, rd.variant)) run_and_check_fp8(c, true, rng);
}

INSTANTIATE_TEST_SUITE_P(
    Rungs, LinearCudaFp8,
    ::testing::Values(RungDtype{LinearVariant::kNaive, DType::kBF16}, RungDtype{LinearVariant::kNaive, DType::kF32},
                      RungDtype{LinearVariant::kPersistent, DType::kBF16},
                      RungDtype{LinearVariant::kPersistent, DType::kF16}, RungDtype{LinearVariant::kAuto, DType::kBF16},
                      RungDtype{LinearVariant::kAuto, DType::kF32}),
    [](const auto& info) {
      return std::string(linear_variant_name(info.param.variant)) + "_" + std::string(dtype_name(info.param.dtype));
    });

// Larger shapes (several tiles of the fp8 GEMM, K over many 128-blocks), fp32 gradients with
// accumulate, absent gradients; then every output the same bits on a second run.
TEST(LinearCuda, Fp8LargeAccumulateAndDeterministic) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  for (LinearVariant v : {LinearVariant::kPersistent, LinearVariant::kAuto}) {
    if (!runs_here(v)) continue;
    for (bool accumulate : {false, true}) {
      LinearCase c;
      c.dtype = DType::kBF16, c.variant = v, c.lead = {3, 101}, c.k = 1000, c.n = 520, c.act = Activation::kGeluErf;
      c.same_grad_dtype = false, c.grad_dtype = DType::kF32, c.accumulate = accumulate, c.keep_pre = !accumulate;
      run_and_check_fp8(c, true, rng);
    }
    for (int mask = 1; mask < 8; ++mask) {
      LinearCase c;
      c.dtype = DType::kBF16, c.variant = v, c.lead = {37}, c.k = 72, c.n = 90, c.act = Activation::kSilu;
      c.want_gi = mask & 1, c.want_gw = mask & 2, c.want_gb = mask & 4;
      run_and_check_fp8(c, true, rng);
    }
    LinearCase c;
    c.dtype = DType::kBF16, c.variant = v, c.lead = {300}, c.k = 264, c.n = 200, c.act = Activation::kGeluTanh;
    c.fp8 = true, c.keep_pre = false;
    const LinearData d(c, rng);
    const auto both = [&](const std::vector<void*>& p, Device dev) {
      d.forward(p, dev);
      d.backward(p, dev);
    };
    std::vector<Buffer> r1 = run_case(true, d.all(), both), r2 = run_case(true, d.all(), both);
    ASSERT_EQ(r1.size(), 9u);
    for (size_t i = 0; i < r1.size(); ++i) EXPECT_TRUE(same_bytes(r1[i], r2[i])) << "buffer " << i;
  }
}

// fused has no fp8 GEMM: refused with an Error that says which variants run fp8.
TEST(LinearCuda, Fp8RefusedOnFused) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  LinearCase c;
  c.dtype = DType::kBF16, c.variant = LinearVariant::kFused, c.lead = {7}, c.k = 64, c.n = 64, c.fp8 = true;
  const LinearData d(c, rng);
  std::vector<Buffer> after;
  bool thrown = false;
  run_on_cuda(d.all(), Device::cuda(0), nullptr,
              [&](const std::vector<void*>& p) {
                const Caught r = call([&] { d.forward(p, Device::cuda(0)); });
                thrown = r.thrown;
                EXPECT_MENTIONS(r, "fp8 runs on auto, cpu, naive and persistent");
              },
              after);
  EXPECT_TRUE(thrown);
}

}  // namespace
}  // namespace optimized::testing
