// The cpu rung of the attention family through the public API (and once directly), forward, lse
// and backward, fp32 / fp64 / fp16 / bf16, against the float64 reference with flash-attention's
// rule (src/testing/attention_check.h), on fresh random inputs with poisoned outputs, padding and
// guard zones: sizes 1, 7, 33, 113 and S_q != S_k both ways, B > 1, GQA ratios 1 / 2 / 4 and MQA,
// head dims 8, 64, 72, 128 (and odd ones: the cpu rung takes any), causal (both alignments) x
// window x soft-cap x ALiBi, explicit bool and additive masks with broadcasting, varlen batches with
// empty and length-1 sequences, (B, S, H, D) and (B, H, S, D) storage, NaN / Inf inputs, rows with
// no visible key, results independent of the thread count. fp64 is held to fp64's rounding (the
// rung is what torch's float64 gradcheck runs against).
// Kept small enough for CI (the whole cpu label of the family well under a minute on 2 cores).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention_test_util.h"

namespace optimized::testing {
namespace {

const Device kCpu = Device::cpu();
constexpr AttentionVariant kCpuRung = AttentionVariant::kCpu;
const std::vector<DType> kAllDtypes = {DType::kF32, DType::kF64, DType::kF16, DType::kBF16};

AttnCase base(bool backward, DType dtype, int64_t sq = 7, int64_t sk = 7) {
  return make_case(backward, dtype, kCpuRung, kCpu, 2, sq, sk, 4, 2, 16);
}

// ---- the rule itself ----------------------------------------------------------------------------

// fp64: the cpu rung runs exact fp64 math, so its error stays at fp64's rounding.
TEST(AttentionCpu, Fp64IsTight) {
  for (bool bwd : {false, true}) {
    AttnCase c = base(bwd, DType::kF64, 33, 29);
    c.causal = true;
    c.softcap = 2.0;
    c.alibi = Alibi::kPerHead;
    const AttnCheck r = expect_attention_ok(c);
    EXPECT_LT(r.result.max_rel_error, 1e-12) << c.describe();
  }
}

// The rule catches real bugs: a scale off by 1%, a key dropped from the softmax, dk summed over
// half the group. Each corrupted run must fail the check.
TEST(AttentionCpu, ToleranceCatchesBugs) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kF64}) {
    for (bool bwd : {false, true}) {
      AttnCase c = base(bwd, dt, 33, 33);
      c.heads_q = 4;
      c.heads_kv = 1;
      const AttnOperands o(c);
      const AttentionExpected ex = attention_expected(o.host_params());
      auto corrupted_fails = [&](const char* what, auto&& corrupt) {
        std::array<Buffer, kRoles> after;
        std::array<void*, kRoles> bases{};
        for (int r = 0; r < kRoles; ++r) {
          if (!o.ops[r].present) continue;
          after[r] = Buffer(o.ops[r].dtype, o.ops[r].host.count(), kCpu);
          std::memcpy(after[r].data(), o.ops[r].host.data(), o.ops[r].host.bytes());
          bases[static_cast<size_t>(r)] = after[r].data();
        }
        AttentionParams p = o.params(bases);
        corrupt(p);
        cpu_attention(p, 1);
        const AttentionParams good = o.params(bases);
        EXPECT_FALSE(check_attention(good, ex).passed) << c.describe() << ": the check missed " << what;
      };
      const double off = dt == DType::kBF16 ? 1.05 : 1.01;
      corrupted_fails("a scale 1% (bf16: 5%) off", [&](AttentionParams& p) { p.scale *= off; });
      corrupted_fails("a dropped last key", [](AttentionParams& p) { p.window_right = 31, p.top_left = true; });
      if (bwd) corrupted_fails("dk / dv over half the group", [](AttentionParams& p) { p.heads_q = 2; });
    }
  }
}

// ---- shapes -------------------------------------------------------------------------------------

TEST(AttentionCpu, Sizes) {
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{1, 1}, {7, 7}, {33, 33}, {113, 113}, {7, 33},
                                                         {33, 7}, {1, 113}, {113, 1}, {5, 0}};
  for (DType dt : kAllDtypes)
    for (bool bwd : {false, true})
      for (auto [sq, sk] : sizes) {
        if (sq * sk > 1000 && dt != DType::kF32 && dt != DType::kF16) continue;  // the long ones: two dtypes
        expect_attention_ok(base(bwd, dt, sq, sk));
      }
}

TEST(AttentionCpu, GqaAndMqa) {
  for (DType dt : {DType::kF32, DType::kBF16})
    for (bool bwd : {false, true})
      for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {4, 2}, {4, 1}, {8, 2}, {3, 1}}) {
        AttnCase c = base(bwd, dt, 13, 17);
        c.heads_q = hq;
        c.heads_kv = hkv;
        expect_attention_ok(c);
      }
}

TEST(AttentionCpu, HeadDims) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kF64})
    for (bool bwd : {false, true})
      for (int64_t d : {1, 3, 8, 64, 72, 128}) {
        AttnCase c = base(bwd, dt, 9, 11);
        c.head_dim = d;
        c.heads_q = 2;
        c.heads_kv = 1;
        c.batch = 1;
        expect_attention_ok(c);
      }
}

TEST(AttentionCpu, ExplicitScale) {
  for (bool bwd : {false, true}) {
    AttnCase c = base(bwd, DType::kF32, 9, 12);
    c.scale = 0.3;
    expect_attention_ok(c);
    c.scale = -0.1;
    expect_attention_ok(c);
  }
}

// ---- score options ------------------------------------------------------------------------------

TEST(AttentionCpu, FeatureMatrix) {
  for (const Feature& f : feature_matrix())
    for (DType dt : {DType::kF32, DType::kF16, DType::kF64})
      for (bool bwd : {false, true})
        for (auto [sq, sk] : std::vector<std::pair<int64_t, int64_t>>{{13, 29}, {29, 13}, {17, 17}}) {
          if (dt != DType::kF32 && sq != 13) continue;
          SCOPED_TRACE(f.name);
          expect_attention_ok(with_feature(base(bwd, dt, sq, sk), f));
        }
}

// ---- explicit masks -----------------------------------------------------------------------------

TEST(AttentionCpu, Masks) {
  const std::vector<std::array<bool, 4>> shapes = {
      {true, true, true, true}, {false, false, true, true}, {true, false, false, true}, {false, true, true, false}};
  for (MaskKind kind : {MaskKind::kBool, MaskKind::kAdditive})
    for (DType dt : {DType::kF32, DType::kBF16})
      for (bool bwd : {false, true})
        for (const auto& full : shapes)
          for (bool stride0 : {false, true}) {
            AttnCase c = base(bwd, dt, 11, 19);
            c.mask = kind;
            c.mask_dtype = dt;
            c.mask_full = full;
            c.mask_stride0 = stride0;
            expect_attention_ok(c);
          }
}

TEST(AttentionCpu, MasksWithOptions) {
  for (bool bwd : {false, true}) {
    AttnCase c = base(bwd, DType::kF16, 12, 20);
    c.mask = MaskKind::kAdditive;
    c.mask_dtype = DType::kF32;  // an fp32 additive mask on fp16 q
    c.causal = true;
    c.softcap = 2.0;
    c.alibi = Alibi::kPerHead;
    expect_attention_ok(c);
    c.mask = MaskKind::kBool;
    c.window_left = 3;
    expect_attention_ok(c);
    AttnCase d = base(bwd, DType::kF64, 12, 20);
    d.mask = MaskKind::kAdditive;
    d.mask_dtype = DType::kF64;
    expect_attention_ok(d);
  }
}

// ---- varlen -------------------------------------------------------------------------------------

TEST(AttentionCpu, Varlen) {
  for (const VarlenLens& lens : varlen_batches())
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF64})
      for (bool bwd : {false, true})
        for (int opt = 0; opt < 3; ++opt) {
          AttnCase c = base(bwd, dt);
          c.lens_q = lens.q;
          c.lens_k = lens.k;
          if (opt == 1) c.causal = true;
          if (opt == 2) c.window_left = 2, c.window_right = 1, c.alibi = Alibi::kPerBatchHead, c.softcap = 1.5;
          expect_attention_ok(c);
        }
}

// max_seqlen is only a bound: a loose one (2^40) neither sizes the CPU rung's buffers nor its loops.
TEST(AttentionCpu, VarlenLooseMaxSeqlen) {
  for (bool bwd : {false, true}) {
    AttnCase c = base(bwd, DType::kF32);
    c.lens_q = {3, 0, 5};
    c.lens_k = {4, 2, 6};
    c.max_seqlen_bound = int64_t{1} << 40;
    expect_attention_ok(c);
  }
}

// A window side wider than 2^40 is unbounded: the same bits as -1 (no overflow of i + offset +- w).
TEST(AttentionCpu, HugeWindowIsUnbounded) {
  for (bool bwd : {false, true}) {
    AttnCase c = base(bwd, DType::kF32, 9, 5);
    const AttnOperands o(c);
    const AttnRun unbounded = run_attention(o);
    AttnCase huge = c;
    huge.window_left = huge.window_right = std::numeric_limits<int64_t>::max();
    const AttnRun wide = run_attention(o, &huge);
    ASSERT_TRUE(unbounded.ok && wide.ok) << unbounded.error << wide.error;
    EXPECT_TRUE(same_output_bits(o, unbounded, wide)) << c.describe();
  }
}

TEST(AttentionCpu, VarlenStrided) {
  for (bool bwd : {false, true}) {
    AttnCase c = base(bwd, DType::kF32);
    c.lens_q = {6, 0, 1, 9};
    c.lens_k = {3, 2, 1, 11};
    c.layout = DataLayout::kBHSD;
    c.pad = 3;
    c.offset = 5;
    c.causal = true;
    expect_attention_ok(c);
  }
}

// ---- views --------------------------------------------------------------------------------------

TEST(AttentionCpu, StridedViews) {
  for (DType dt : {DType::kF32, DType::kF16})
    for (bool bwd : {false, true})
      for (DataLayout layout : {DataLayout::kBSHD, DataLayout::kBHSD})
        for (auto [pad, offset] : std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {5, 3}, {8, 16}}) {
          AttnCase c = base(bwd, dt, 10, 14);
          c.layout = layout;
          c.pad = pad;
          c.offset = offset;
          c.causal = true;
          expect_attention_ok(c);
        }
}

TEST(AttentionCpu, WithoutLse) {
  AttnCase c = base(false, DType::kF32, 9, 9);
  c.with_lse = false;
  expect_attention_ok(c);
}

TEST(AttentionCpu, BackendDirectMatchesApi) {
  for (bool bwd : {false, true}) {
    AttnCase c = base(bwd, DType::kBF16, 9, 13);
    c.alibi = Alibi::kPerHead;
    c.mask = MaskKind::kBool;
    const AttnOperands o(c);
    const AttnRun api = run_attention(o);
    AttnCase direct_case = c;
    direct_case.backend_direct = true;
    const AttnRun direct = run_attention(o, &direct_case);
    EXPECT_TRUE(same_output_bits(o, api, direct)) << c.describe();
  }
}

// ---- special values -----------------------------------------------------------------------------

// Rows with no visible key: out 0, lse -inf, zero gradients. Bottom-right causal with S_q > S_k
// leaves the first S_q - S_k rows without keys; a bool mask row of false; a window beyond the keys.
TEST(AttentionCpu, RowsWithNoVisibleKey) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kF64})
    for (bool bwd : {false, true}) {
      {
        AttnCase c = base(bwd, dt, 9, 4);
        c.causal = true;
        const AttnCheck r = expect_attention_ok(c);
        if (!bwd && r.passed) {
          const std::vector<double>& lse = r.values[static_cast<size_t>(AttentionOutput::kLse)];
          const std::vector<double>& out = r.values[static_cast<size_t>(AttentionOutput::kOut)];
          for (int64_t i = 0; i < 5; ++i) {
            EXPECT_EQ(lse[static_cast<size_t>(i * c.heads_q)], -INFINITY) << "row " << i;
            for (int64_t d = 0; d < c.head_dim; ++d) EXPECT_EQ(out[static_cast<size_t>(i * c.heads_q * c.head_dim + d)], 0.0);
          }
          EXPECT_TRUE(std::isfinite(lse[static_cast<size_t>(5 * c.heads_q)]));
        }
        if (bwd && r.passed) {
          const std::vector<double>& dq = r.values[static_cast<size_t>(AttentionOutput::kDq)];
          for (int64_t d = 0; d < c.head_dim; ++d) EXPECT_EQ(dq[static_cast<size_t>(d)], 0.0);
        }
      }
      {
        AttnCase c = base(bwd, dt, 6, 8);
        c.mask = MaskKind::kBool;
        c.mask_density = 0.3;  // with 8 keys some rows are all false
        AttnOperands o(c);
        for (int64_t j = 0; j < 8; ++j) o.set(kMask, {0, 0, 2, j}, 0.0);  // row 2 of (0, 0): no key
        o.refresh_forward();
        expect_operands_ok(o);
      }
      {
        AttnCase c = base(bwd, dt, 6, 8);
        c.mask = MaskKind::kAdditive;
        c.mask_dtype = DType::kF32;
        c.mask_density = 0.5;  // -inf entries; a row of only -inf has no visible key
        AttnOperands o(c);
        for (int64_t j = 0; j < 8; ++j) o.set(kMask, {1, 1, 3, j}, -INFINITY);
        o.refresh_forward();
        expect_operands_ok(o);
      }
      {
        AttnCase c = base(bwd, dt, 6, 8);
        c.top_left = true;
        c.window_left = 0;
        c.window_right = 0;  // only the diagonal: rows see key i
        expect_attention_ok(c);
      }
    }
}

// NaN in q reaches its row only; NaN in k or v every row that sees that key; an infinite q makes
// its row NaN (inf - inf in the softmax). The last row's output stays finite.
TEST(AttentionCpu, NanAndInf) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kF64})
    for (bool bwd : {false, true}) {
      AttnCase c = base(bwd, dt, 8, 8);
      c.heads_q = 2;
      c.heads_kv = 1;
      c.causal = true;
      AttnOperands o(c);
      o.set_data(kQ, 1, 0, 3, std::nan(""));   // (b 0, row 1, head 0)
      o.set_data(kQ, 7, 1, 0, INFINITY);       // (b 0, row 7, head 1): s_70 = +inf (k[0, 0] > 0)
      o.set_data(kK, 0, 0, 0, 0.5);
      o.set_data(kK, 8 + 5, 0, 2, std::nan(""));  // (b 1, key 5): rows 5.. of batch 1
      o.set_data(kV, 6, 0, 1, std::nan(""));      // (b 0, key 6): rows 6.. of batch 0
      o.refresh_forward();
      const AttnCheck r = expect_operands_ok(o);
      if (bwd || !r.passed) continue;
      const std::vector<double>& out = r.values[static_cast<size_t>(AttentionOutput::kOut)];
      auto at = [&](int64_t row, int64_t h, int64_t d) { return out[static_cast<size_t>((row * 2 + h) * c.head_dim + d)]; };
      EXPECT_TRUE(std::isnan(at(1, 0, 0)));
      EXPECT_FALSE(std::isnan(at(1, 1, 0)));
      EXPECT_TRUE(std::isnan(at(7, 1, 5)));
      EXPECT_TRUE(std::isnan(at(8 + 5, 0, 0)) && std::isnan(at(8 + 7, 1, 0)));
      EXPECT_FALSE(std::isnan(at(8 + 4, 0, 0)));
      EXPECT_TRUE(std::isnan(at(6, 0, 1)));
      EXPECT_FALSE(std::isnan(at(5, 0, 1)));
    }
}

// ---- threads ------------------------------------------------------------------------------------

// The same bits whatever the thread count (the backward's dk / dv sums stay in one thread).
TEST(AttentionCpu, ThreadCountIndependent) {
  for (DType dt : {DType::kF32, DType::kBF16})
    for (bool bwd : {false, true}) {
      AttnCase c = base(bwd, dt, 21, 17);
      c.heads_q = 4;
      c.heads_kv = 2;
      c.causal = true;
      c.cpu_threads = 1;
      const AttnOperands o(c);
      AttnRun one;
      expect_operands_ok(o, &one);
      for (int threads : {2, 3, 0}) {
        AttnCase other = c;
        other.cpu_threads = threads;
        const AttnRun run = run_attention(o, &other);
        EXPECT_TRUE(same_output_bits(o, one, run)) << c.describe() << " vs threads=" << threads;
      }
    }
}

}  // namespace
}  // namespace optimized::testing
