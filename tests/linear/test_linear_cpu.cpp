// The cpu rung of the linear family against the float64 reference (src/testing/linear_reference.h):
// forward (y, pre) and the three gradients for fp32 / fp16 / bf16 / fp64, every activation, M = 0,
// 1, 7, 37 with K, N in {1, 5, 64, 67, 130}, padded rows of x and grad_output, leading batch
// dimensions, pre kept and recomputed, fp32 gradients from 16-bit inputs, accumulate (onto random
// gradients, and twice onto zeros = exactly 2x), grad_bias bit-identical across runs and thread
// counts, absent gradients untouched, auto = cpu.
#include <gtest/gtest.h>

#include "linear_test_util.h"

namespace optimized::testing {
namespace {

class LinearCpuSweep : public ::testing::TestWithParam<DType> {};

TEST_P(LinearCpuSweep, EveryActivationAndSize) {
  std::mt19937_64 rng = test_rng();
  for (const LinearCase& c : sweep_cases(GetParam(), LinearVariant::kCpu)) run_and_check(c, false, rng);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LinearCpuSweep, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16, DType::kF64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(LinearCpu, LeadingBatchDimensionsAndPaddedRows) {
  std::mt19937_64 rng = test_rng();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF64})
    for (Activation act : {Activation::kNone, Activation::kGeluTanh, Activation::kSilu})
      for (bool keep : {true, false}) {
        LinearCase c;
        c.dtype = dt, c.lead = {2, 3}, c.k = 67, c.n = 5, c.pad = 5, c.act = act, c.keep_pre = keep;
        run_and_check(c, false, rng);
        c.lead = {2, 1, 3}, c.k = 5, c.n = 130, c.pad = 0;
        run_and_check(c, false, rng);
        c.lead = {}, c.k = 64, c.n = 67;  // x of rank 1: one row
        run_and_check(c, false, rng);
        c.lead = {3, 0}, c.k = 5, c.n = 7;  // no rows
        run_and_check(c, false, rng);
      }
}

TEST(LinearCpu, Fp32GradientsFrom16BitInputs) {
  std::mt19937_64 rng = test_rng();
  for (DType dt : {DType::kF16, DType::kBF16})
    for (Activation act : {Activation::kNone, Activation::kRelu, Activation::kGeluErf})
      for (bool accumulate : {false, true}) {
        LinearCase c;
        c.dtype = dt, c.same_grad_dtype = false, c.grad_dtype = DType::kF32, c.lead = {37}, c.k = 67, c.n = 130;
        c.act = act, c.accumulate = accumulate, c.keep_pre = act != Activation::kRelu;
        run_and_check(c, false, rng);
      }
}

TEST(LinearCpu, AccumulateOntoGradients) {
  std::mt19937_64 rng = test_rng();
  for (DType dt : {DType::kF32, DType::kF16, DType::kF64})
    for (Activation act : {Activation::kNone, Activation::kSilu}) {
      LinearCase c;
      c.dtype = dt, c.lead = {7}, c.k = 64, c.n = 67, c.act = act, c.accumulate = true;
      run_and_check(c, false, rng);
    }
}

// Twice with accumulate onto zeros: exactly 2x once (fp32 / fp64 gradients).
TEST(LinearCpu, AccumulateAddsExactly) {
  std::mt19937_64 rng = test_rng();
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF64})
    for (Activation act : {Activation::kNone, Activation::kGeluErf}) {
      LinearCase c;
      c.dtype = dt, c.lead = {37}, c.k = 67, c.n = 130, c.act = act, c.accumulate = true, c.want_gi = false;
      if (dt == DType::kBF16) c.same_grad_dtype = false, c.grad_dtype = DType::kF32;
      SCOPED_TRACE(c.name());
      LinearData d(c, rng);
      d.gw.fill_bytes(0), d.gb.fill_bytes(0);
      std::vector<void*> p;
      for (const Buffer* b : d.all()) p.push_back(b->data());
      d.forward(p, Device::cpu());
      c.keep_pre = true;
      d.backward(p, Device::cpu());
      Buffer once_w(d.gw.dtype(), d.gw.count(), Device::cpu()), once_b(d.gb.dtype(), d.gb.count(), Device::cpu());
      std::memcpy(once_w.data(), d.gw.data(), d.gw.bytes());
      std::memcpy(once_b.data(), d.gb.data(), d.gb.bytes());
      d.backward(p, Device::cpu());
      for (int64_t i = 0; i < d.gw.count(); ++i)
        ASSERT_EQ(load_as_double(d.gw.data(), d.gw.dtype(), i), 2 * load_as_double(once_w.data(), once_w.dtype(), i)) << i;
      for (int64_t i = 0; i < d.gb.count(); ++i)
        ASSERT_EQ(load_as_double(d.gb.data(), d.gb.dtype(), i), 2 * load_as_double(once_b.data(), once_b.dtype(), i)) << i;
    }
}

// grad_bias (and the whole backward) the same bits on every run and thread count.
TEST(LinearCpu, DeterministicAcrossRunsAndThreads) {
  std::mt19937_64 rng = test_rng();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    LinearCase c;
    c.dtype = dt, c.lead = {37}, c.k = 130, c.n = 130, c.act = Activation::kGeluTanh, c.keep_pre = false;
    SCOPED_TRACE(c.name());
    const LinearData d(c, rng);
    std::vector<Buffer> first;
    for (int threads : {0, 1, 3, 0}) {
      std::vector<Buffer> r = run_case(false, d.all(), [&](const std::vector<void*>& p, Device dev) {
        ExecutionContext ctx;
        ctx.cpu_threads = threads;
        d.backward(p, dev, ctx);
      });
      if (first.empty()) {
        first = std::move(r);
        continue;
      }
      EXPECT_TRUE(same_bytes(r[LinearData::kGb], first[LinearData::kGb])) << "grad_bias, threads " << threads;
      EXPECT_TRUE(same_bytes(r[LinearData::kGi], first[LinearData::kGi])) << "grad_input, threads " << threads;
    }
  }
}

TEST(LinearCpu, AbsentGradientsAreNotComputed) {
  std::mt19937_64 rng = test_rng();
  for (int mask = 0; mask < 8; ++mask) {
    LinearCase c;
    c.lead = {7}, c.k = 5, c.n = 67, c.act = Activation::kRelu, c.keep_pre = mask % 2 == 0;
    c.want_gi = mask & 1, c.want_gw = mask & 2, c.want_gb = mask & 4;
    run_and_check(c, false, rng);  // checks the absent ones' bytes
  }
}

TEST(LinearCpu, NoRowsGiveZeroGradients) {
  std::mt19937_64 rng = test_rng();
  for (bool accumulate : {false, true}) {
    LinearCase c;
    c.lead = {0}, c.k = 5, c.n = 7, c.act = Activation::kSilu, c.accumulate = accumulate;
    LinearData d(c, rng);
    fill_uniform(d.gw, rng), fill_uniform(d.gb, rng);
    std::vector<Buffer> r = run_case(false, d.all(), [&](const std::vector<void*>& p, Device dev) { d.backward(p, dev); });
    for (int64_t i = 0; i < d.gw.count(); ++i)
      EXPECT_EQ(load_as_double(r[LinearData::kGw].data(), c.dtype, i), accumulate ? load_as_double(d.gw.data(), c.dtype, i) : 0.0);
    for (int64_t i = 0; i < d.gb.count(); ++i)
      EXPECT_EQ(load_as_double(r[LinearData::kGb].data(), c.dtype, i), accumulate ? load_as_double(d.gb.data(), c.dtype, i) : 0.0);
  }
}

// auto on CPU tensors is the cpu rung: the same bits; and the seed's entries.
TEST(LinearCpu, AutoIsCpuAndSeedEntries) {
  std::mt19937_64 rng = test_rng();
  LinearCase c;
  c.lead = {7}, c.k = 67, c.n = 64, c.act = Activation::kGeluErf;
  const LinearData d(c, rng);
  std::vector<Buffer> r1 = run_case(false, d.all(), [&](const std::vector<void*>& p, Device dev) {
    d.forward(p, dev);
    d.backward(p, dev);
  });
  std::vector<Buffer> r2 = run_case(false, d.all(), [&](const std::vector<void*>& p, Device dev) {
    linear_forward(d.xv(p[0], dev), d.wv(p[1], dev), d.bv(p[2], dev, c.dtype), d.yv(p[4], dev), d.yv(p[5], dev), c.act,
                   LinearVariant::kAuto);
    LinearBackwardOptions o;
    o.activation = c.act;
    linear_backward_optimized(d.giv(p[6], dev), d.gwv(p[7], dev), d.bv(p[8], dev, c.dtype), d.dyv(p[3], dev),
                              d.xv(p[0], dev), d.wv(p[1], dev), d.yv(p[5], dev), d.bv(p[2], dev, c.dtype), o);
  });
  for (size_t i = 0; i < r1.size(); ++i) EXPECT_TRUE(same_bytes(r1[i], r2[i])) << "buffer " << i;
}

// fp8 (per-tensor current scaling) on the cpu rung: the emulated reference, every activation and
// odd sizes, leading dimensions, fp32 gradients with accumulate, absent gradients; auto = cpu.
class LinearCpuFp8 : public ::testing::TestWithParam<DType> {};

TEST_P(LinearCpuFp8, EveryActivationAndSize) {
  std::mt19937_64 rng = test_rng();
  for (const LinearCase& c : fp8_cases(GetParam(), LinearVariant::kCpu)) run_and_check_fp8(c, false, rng);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LinearCpuFp8, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(LinearCpu, Fp8LeadingDimsGradientsAndAccumulate) {
  std::mt19937_64 rng = test_rng();
  for (LinearVariant v : {LinearVariant::kCpu, LinearVariant::kAuto})
    for (bool accumulate : {false, true}) {
      LinearCase c;
      c.dtype = DType::kBF16, c.variant = v, c.lead = {2, 3}, c.k = 67, c.n = 40, c.act = Activation::kGeluTanh;
      c.same_grad_dtype = false, c.grad_dtype = DType::kF32, c.accumulate = accumulate, c.keep_pre = !accumulate;
      run_and_check_fp8(c, false, rng);
    }
  for (int mask = 0; mask < 8; ++mask) {
    LinearCase c;
    c.dtype = DType::kF16, c.lead = {13}, c.k = 9, c.n = 11, c.act = mask % 2 ? Activation::kRelu : Activation::kNone;
    c.want_gi = mask & 1, c.want_gw = mask & 2, c.want_gb = mask & 4;
    run_and_check_fp8(c, false, rng);
  }
  LinearCase c;  // no rows
  c.dtype = DType::kBF16, c.lead = {0}, c.k = 5, c.n = 7, c.act = Activation::kSilu;
  run_and_check_fp8(c, false, rng);
}

// A NaN or an infinity in x makes y NaN everywhere (its scale is NaN), never silently finite; an
// all-zero x gives the bias (scale 1).
TEST(LinearCpu, Fp8NonFiniteAndZeroInputs) {
  std::mt19937_64 rng = test_rng();
  LinearCase c;
  c.dtype = DType::kF32, c.lead = {5}, c.k = 8, c.n = 6, c.fp8 = true, c.keep_pre = false;
  for (double bad : {std::nan(""), double(INFINITY), 0.0}) {
    LinearData d(c, rng);
    if (bad == 0.0)
      d.x.fill_bytes(0);
    else
      store_from_double(d.x.data(), c.dtype, 3, bad);
    std::vector<Buffer> r = run_case(false, d.all(), [&](const std::vector<void*>& p, Device dev) { d.forward(p, dev); });
    ASSERT_EQ(r.size(), 9u);
    for (int64_t i = 0; i < d.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) {
        const double y = load_as_double(r[LinearData::kY].data(), c.dtype, i * c.n + j);
        if (bad == 0.0)
          EXPECT_EQ(y, load_as_double(d.b.data(), c.dtype, j));
        else
          EXPECT_TRUE(std::isnan(y)) << "y[" << i << ", " << j << "] = " << y;
      }
  }
}

}  // namespace
}  // namespace optimized::testing
