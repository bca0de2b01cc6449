// The fp8 (scaled) GEMM reference of optimized_ops_testing and its bound, on the CPU: each scale
// layout against the unscaled reference composed by hand (tensor and row scales factor out, block
// scales over K are sums of per-block products), strides, known values, the refusals, and the
// bound: an emulated fp8 kernel (14-bit partial sums promoted to fp32 every 128 k-steps, bf16
// output) stays inside it, a kernel that drops a K-block does not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "optimized/buffer.h"
#include "testing/scaled_gemm_reference.h"
#include "testing/tolerance.h"

namespace optimized::testing {
namespace {

// Random finite codes of the format (NaN codes skipped), magnitudes spread over the range.
std::vector<uint8_t> random_fp8(int64_t count, Fp8Format format, std::mt19937_64& rng) {
  std::vector<uint8_t> v(static_cast<size_t>(count));
  for (auto& x : v) {
    do {
      x = static_cast<uint8_t>(rng() & 0xff);
    } while (!std::isfinite(fp8_to_double(x, format)));
  }
  return v;
}

std::vector<float> random_scales(int64_t count, std::mt19937_64& rng) {
  std::vector<float> s(static_cast<size_t>(count));
  for (auto& x : s) x = std::ldexp(1.0f + static_cast<float>(rng() % 1000) / 1000.0f, static_cast<int>(rng() % 9) - 4);
  return s;
}

struct Problem {
  int64_t m, n, k;
  std::vector<uint8_t> a, b;  // A (M, K) row-major, B (K, N) row-major
};

Problem make_problem(int64_t m, int64_t n, int64_t k, Fp8Format fa, Fp8Format fb, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return {m, n, k, random_fp8(m * k, fa, rng), random_fp8(k * n, fb, rng)};
}

ScaledOperand op_a(const Problem& p, Fp8Format f, const float* scale, ScaleLayout layout) {
  return {p.a.data(), p.m, p.k, p.k, 1, f, scale, layout};
}
ScaledOperand op_b(const Problem& p, Fp8Format f, const float* scale, ScaleLayout layout) {
  return {p.b.data(), p.k, p.n, p.n, 1, f, scale, layout};
}

// The unscaled product of A's rows [.., ..) and K range [k0, k1) with B: by the reference itself on
// sub-operands (a K slice is a pointer offset and a smaller K).
std::vector<double> unscaled(const Problem& p, Fp8Format fa, Fp8Format fb, int64_t k0, int64_t k1) {
  const float one = 1.0f;
  ScaledOperand a{p.a.data() + k0, p.m, k1 - k0, p.k, 1, fa, &one, ScaleLayout::kTensor};
  ScaledOperand b{p.b.data() + k0 * p.n, k1 - k0, p.n, p.n, 1, fb, &one, ScaleLayout::kTensor};
  std::vector<double> out(static_cast<size_t>(p.m * p.n));
  scaled_matmul_reference_f64(a, b, out.data(), nullptr);
  return out;
}

TEST(ScaledReference, KnownValues) {
  // A = [[1, 2], [0.5, -4]] (e4m3 0x38, 0x40, 0x30, 0xC8), B = [[1, 0], [0, 2]] (e5m2 0x3C, 0, 0, 0x40).
  const uint8_t a[] = {0x38, 0x40, 0x30, 0xC8};
  const uint8_t b[] = {0x3C, 0x00, 0x00, 0x40};
  const float sa = 0.5f, sb[] = {1.0f, 3.0f};  // B per column
  ScaledOperand A{a, 2, 2, 2, 1, Fp8Format::kE4M3, &sa, ScaleLayout::kTensor};
  ScaledOperand B{b, 2, 2, 2, 1, Fp8Format::kE5M2, sb, ScaleLayout::kRowwise};
  double out[4], mag[4];
  scaled_matmul_reference_f64(A, B, out, mag);
  // deq(A) = [[0.5, 1], [0.25, -2]], deq(B) = [[1, 0], [0, 6]]
  EXPECT_EQ(out[0], 0.5);
  EXPECT_EQ(out[1], 6.0);
  EXPECT_EQ(out[2], 0.25);
  EXPECT_EQ(out[3], -12.0);
  EXPECT_EQ(mag[3], 12.0);
}

TEST(ScaledReference, TensorAndRowScalesFactorOut) {
  const Problem p = make_problem(37, 29, 300, Fp8Format::kE4M3, Fp8Format::kE5M2, 1);
  std::mt19937_64 rng(2);
  const std::vector<float> sa = random_scales(p.m, rng), sb = random_scales(p.n, rng);
  std::vector<double> out(static_cast<size_t>(p.m * p.n));
  scaled_matmul_reference_f64(op_a(p, Fp8Format::kE4M3, sa.data(), ScaleLayout::kRowwise),
                              op_b(p, Fp8Format::kE5M2, sb.data(), ScaleLayout::kRowwise), out.data(), nullptr);
  const std::vector<double> base = unscaled(p, Fp8Format::kE4M3, Fp8Format::kE5M2, 0, p.k);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      const double want = base[i * p.n + j] * sa[i] * sb[j];
      EXPECT_NEAR(out[i * p.n + j], want, 1e-12 * (1 + std::fabs(want))) << i << "," << j;
    }
}

TEST(ScaledReference, BlockScalesAreSumsOverKBlocks) {
  // K = 300: blocks of 128, 128, 44; M = 130 and N = 140 cross a 128 boundary too.
  const Problem p = make_problem(130, 140, 300, Fp8Format::kE4M3, Fp8Format::kE4M3, 3);
  std::mt19937_64 rng(4);
  const int64_t kb = 3;
  const std::vector<float> sa = random_scales(p.m * kb, rng);   // 1x128: (M, K/128)
  const std::vector<float> sb = random_scales(kb * 2, rng);     // 128x128: (K/128, N/128)
  EXPECT_EQ(scale_count(ScaleLayout::kBlock1x128, p.m, p.k, true), p.m * kb);
  EXPECT_EQ(scale_count(ScaleLayout::kBlock128x128, p.k, p.n, false), kb * 2);
  std::vector<double> out(static_cast<size_t>(p.m * p.n));
  scaled_matmul_reference_f64(op_a(p, Fp8Format::kE4M3, sa.data(), ScaleLayout::kBlock1x128),
                              op_b(p, Fp8Format::kE4M3, sb.data(), ScaleLayout::kBlock128x128), out.data(), nullptr);
  std::vector<double> want(out.size(), 0.0);
  for (int64_t b = 0; b < kb; ++b) {
    const std::vector<double> part = unscaled(p, Fp8Format::kE4M3, Fp8Format::kE4M3, 128 * b, std::min<int64_t>(p.k, 128 * (b + 1)));
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t j = 0; j < p.n; ++j) want[i * p.n + j] += part[i * p.n + j] * sa[i * kb + b] * sb[b * 2 + j / 128];
  }
  for (size_t e = 0; e < out.size(); ++e) EXPECT_NEAR(out[e], want[e], 1e-9 * (1 + std::fabs(want[e]))) << e;
}

TEST(ScaledReference, KMajorBIsTheSameProduct) {
  // B stored N x K (K contiguous, what wgmma and torch._scaled_mm's column-major mat2 are).
  const Problem p = make_problem(9, 17, 65, Fp8Format::kE4M3, Fp8Format::kE4M3, 5);
  std::vector<uint8_t> bt(p.b.size());
  for (int64_t kk = 0; kk < p.k; ++kk)
    for (int64_t j = 0; j < p.n; ++j) bt[j * p.k + kk] = p.b[kk * p.n + j];
  const float one = 1.0f;
  ScaledOperand b_k_major{bt.data(), p.k, p.n, 1, p.k, Fp8Format::kE4M3, &one, ScaleLayout::kTensor};
  std::vector<double> out(static_cast<size_t>(p.m * p.n));
  scaled_matmul_reference_f64(op_a(p, Fp8Format::kE4M3, &one, ScaleLayout::kTensor), b_k_major, out.data(), nullptr);
  EXPECT_EQ(out, unscaled(p, Fp8Format::kE4M3, Fp8Format::kE4M3, 0, p.k));
}

TEST(ScaledReference, RefusalsNameTheOperand) {
  const Problem p = make_problem(4, 4, 8, Fp8Format::kE4M3, Fp8Format::kE4M3, 6);
  const float one = 1.0f;
  std::vector<double> out(16);
  ScaledOperand a = op_a(p, Fp8Format::kE4M3, &one, ScaleLayout::kTensor);
  ScaledOperand b = op_b(p, Fp8Format::kE4M3, &one, ScaleLayout::kTensor);
  b.rows = 7;
  try {
    scaled_matmul_reference_f64(a, b, out.data(), nullptr);
    ADD_FAILURE() << "a K mismatch was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()).rfind("b: ", 0), 0u) << e.what();
  }
  b = op_b(p, Fp8Format::kE4M3, nullptr, ScaleLayout::kTensor);
  try {
    scaled_matmul_reference_f64(a, b, out.data(), nullptr);
    ADD_FAILURE() << "a missing scale was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("b: ", 0), 0u) << e.what();
  }
}

// x with its mantissa cut to `bits` bits (round to nearest): the reduced-precision accumulator.
float keep_bits(float x, int bits) {
  if (x == 0.0f || !std::isfinite(x)) return x;
  int e = 0;
  const float f = std::frexp(x, &e);
  return std::ldexp(std::nearbyint(std::ldexp(f, bits)), e - bits);
}

// An emulated fp8 GEMM: exact fp8 products, 14-bit partial sums within `promotion` k-steps, fp32
// across them, the result scaled and rounded to bf16. drop_block: skip the K-block at that index.
std::vector<double> emulated_kernel(const Problem& p, const std::vector<float>& sa, const std::vector<float>& sb,
                                    int64_t promotion, int64_t drop_block) {
  std::vector<double> out(static_cast<size_t>(p.m * p.n));
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      float total = 0.0f;
      for (int64_t k0 = 0; k0 < p.k; k0 += promotion) {
        if (k0 / promotion == drop_block) continue;
        float partial = 0.0f;
        for (int64_t kk = k0; kk < std::min(p.k, k0 + promotion); ++kk)
          partial = keep_bits(partial + fp8_e4m3_to_float(p.a[i * p.k + kk]) * fp8_e4m3_to_float(p.b[kk * p.n + j]), 14);
        total += partial;
      }
      out[i * p.n + j] = round_to(DType::kBF16, static_cast<double>(total) * sa[i] * sb[j]);
    }
  return out;
}

TEST(ScaledReference, BoundHoldsAnEmulatedKernelAndCatchesADroppedBlock) {
  const Problem p = make_problem(24, 40, 4096, Fp8Format::kE4M3, Fp8Format::kE4M3, 7);
  std::mt19937_64 rng(8);
  const std::vector<float> sa = random_scales(p.m, rng), sb = random_scales(p.n, rng);
  std::vector<double> ref(static_cast<size_t>(p.m * p.n)), mag(ref.size());
  scaled_matmul_reference_f64(op_a(p, Fp8Format::kE4M3, sa.data(), ScaleLayout::kRowwise),
                              op_b(p, Fp8Format::kE4M3, sb.data(), ScaleLayout::kRowwise), ref.data(), mag.data());
  const std::vector<double> good = emulated_kernel(p, sa, sb, 128, -1);
  const std::vector<double> bad = emulated_kernel(p, sa, sb, 128, 5);
  int64_t good_fail = 0, bad_fail = 0;
  for (size_t e = 0; e < ref.size(); ++e) {
    const double allowed = scaled_gemm_allowed_error(DType::kBF16, p.k, 128, ref[e], mag[e]);
    good_fail += std::fabs(good[e] - ref[e]) > allowed;
    bad_fail += std::fabs(bad[e] - ref[e]) > allowed;
  }
  EXPECT_EQ(good_fail, 0) << "the emulated kernel must pass";
  // One K-block of 32 dropped: a check of every element fails it (here about 40% of them).
  EXPECT_GT(bad_fail, static_cast<int64_t>(ref.size()) / 10) << "a dropped K-block must fail";
}

}  // namespace
}  // namespace optimized::testing
