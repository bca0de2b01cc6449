// The attention family on CUDA through the public API: the rungs naive, flash and flash2 (and
// auto), forward and backward, and the hopper forward (its own suite at the end, the subset it runs), fp32 (naive, flash) / fp16 / bf16, against the float64 reference with
// flash-attention's rule (src/testing/attention_check.h), on fresh random inputs with poisoned
// outputs, padded rows, view offsets and guard zones: S in {1, 7, 113, 1000} and S_q != S_k both
// ways, B > 1, GQA ratios 1 / 2 / 4 / 8 and MQA, head dims 64, 96, 128, 256 and the rounded-up ones
// (40, 72), causal (both alignments) x window x soft-cap x ALiBi, bool and additive masks with
// broadcasting, varlen batches with empty and length-1 sequences, (B, H, S, D) views, NaN / Inf,
// rows with no visible key, a deterministic backward (the same bits twice), the workspace query
// honoured (an explicit workspace of exactly attention_workspace_bytes), an own stream.
// A plain C++ file, built in every configuration: without a CUDA device every test skips with the
// reason. Tests named *Big* hold S = 4097 (the compute-sanitizer run filters them out).
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "attention_test_util.h"

namespace optimized::testing {
namespace {

const std::vector<AttentionVariant> kCudaVariants = {AttentionVariant::kNaive, AttentionVariant::kFlash,
                                                     AttentionVariant::kFlash2, AttentionVariant::kAuto};

// variant, backward; each test runs every dtype the variant takes.
using Param = std::tuple<AttentionVariant, bool>;

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [variant, backward] = info.param;
  return std::string(attention_variant_name(variant)) + (backward ? "_bwd" : "_fwd");
}

class CudaAttention : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA(); }
  AttentionVariant variant() const { return std::get<0>(GetParam()); }
  bool backward() const { return std::get<1>(GetParam()); }
  // fp32 on naive and flash (auto picks flash for it); fp16 / bf16 everywhere.
  std::vector<DType> dtypes() const {
    if (variant() == AttentionVariant::kFlash2) return {DType::kF16, DType::kBF16};
    return {DType::kF32, DType::kF16, DType::kBF16};
  }
  AttnCase base(DType dtype, int64_t batch, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d) const {
    return make_case(backward(), dtype, variant(), Device::cuda(0), batch, sq, sk, hq, hkv, d);
  }
};

TEST_P(CudaAttention, Sizes) {
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{1, 1}, {7, 7}, {113, 113}, {7, 113}, {113, 7}, {1, 113}, {113, 1}};
  for (DType dt : dtypes()) {
    for (auto [sq, sk] : sizes) expect_attention_ok(base(dt, 2, sq, sk, 4, 2, 64));
    expect_attention_ok(base(dt, 1, 1000, 1000, 2, 1, 64));
    expect_attention_ok(base(dt, 1, 300, 1000, 2, 2, 128));
  }
}

TEST_P(CudaAttention, HeadDims) {
  for (DType dt : dtypes())
    for (int64_t d : {64, 96, 128, 256, 72, 40, 8}) expect_attention_ok(base(dt, 2, 33, 47, 2, 1, d));
}

TEST_P(CudaAttention, GqaAndMqa) {
  for (DType dt : dtypes())
    for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}, {8, 2}, {8, 1}, {16, 2}, {3, 1}})
      expect_attention_ok(base(dt, 2, 37, 53, hq, hkv, 64));
}

TEST_P(CudaAttention, FeatureMatrix) {
  for (DType dt : dtypes())
    for (const Feature& f : feature_matrix())
      for (auto [sq, sk] : std::vector<std::pair<int64_t, int64_t>>{{77, 130}, {130, 77}}) {
        SCOPED_TRACE(f.name);
        expect_attention_ok(with_feature(base(dt, 2, sq, sk, 4, 2, 64), f));
      }
}

TEST_P(CudaAttention, Masks) {
  const std::vector<std::array<bool, 4>> shapes = {
      {true, true, true, true}, {false, false, true, true}, {true, false, false, true}, {false, true, true, false}};
  for (DType dt : dtypes())
    for (MaskKind kind : {MaskKind::kBool, MaskKind::kAdditive})
      for (const auto& full : shapes)
        for (bool stride0 : {false, true}) {
          AttnCase c = base(dt, 2, 45, 70, 4, 2, 64);
          c.mask = kind;
          c.mask_dtype = stride0 ? DType::kF32 : dt;
          c.mask_full = full;
          c.mask_stride0 = stride0;
          expect_attention_ok(c);
        }
  // With the score options.
  AttnCase c = base(dtypes().back(), 2, 64, 96, 4, 1, 128);
  c.mask = MaskKind::kAdditive;
  c.mask_dtype = DType::kF32;
  c.causal = true;
  c.softcap = 2.0;
  c.alibi = Alibi::kPerHead;
  expect_attention_ok(c);
}

TEST_P(CudaAttention, Varlen) {
  for (DType dt : dtypes())
    for (const VarlenLens& lens : varlen_batches())
      for (int opt = 0; opt < 3; ++opt) {
        AttnCase c = base(dt, 1, 1, 1, 4, 2, 64);
        c.lens_q = lens.q;
        c.lens_k = lens.k;
        if (opt == 1) c.causal = true;
        if (opt == 2) c.window_left = 2, c.window_right = 1, c.alibi = Alibi::kPerBatchHead, c.softcap = 1.5;
        expect_attention_ok(c);
      }
  // Longer sequences across tile boundaries.
  AttnCase c = base(dtypes().front(), 1, 1, 1, 4, 1, 128);
  c.lens_q = {130, 0, 1, 257, 64};
  c.lens_k = {200, 5, 1, 100, 64};
  c.causal = true;
  expect_attention_ok(c);
}

TEST_P(CudaAttention, StridedViews) {
  for (DType dt : dtypes())
    for (DataLayout layout : {DataLayout::kBSHD, DataLayout::kBHSD})
      for (auto [pad, offset] : std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {8, 16}, {3, 5}}) {
        // flash2 needs 16-byte rows: the misaligned views go to the other rungs.
        if (variant() == AttentionVariant::kFlash2 && (pad % 8 || offset % 8)) continue;
        AttnCase c = base(dt, 2, 50, 61, 4, 2, 64);
        c.layout = layout;
        c.pad = pad;
        c.offset = offset;
        c.causal = true;
        expect_attention_ok(c);
      }
}

TEST_P(CudaAttention, RowsWithNoVisibleKey) {
  for (DType dt : dtypes()) {
    AttnCase c = base(dt, 2, 90, 40, 2, 1, 64);
    c.causal = true;  // bottom-right: the first 50 rows see no key
    expect_attention_ok(c);
    AttnCase m = base(dt, 1, 20, 30, 2, 2, 64);
    m.mask = MaskKind::kBool;
    AttnOperands o(m);
    for (int64_t j = 0; j < 30; ++j) o.set(kMask, {0, 1, 7, j}, 0.0);
    o.refresh_forward();
    expect_operands_ok(o);
  }
}

TEST_P(CudaAttention, NanAndInf) {
  for (DType dt : dtypes()) {
    AttnCase c = base(dt, 2, 40, 40, 2, 1, 64);
    c.causal = true;
    AttnOperands o(c);
    // flash2 multiplies whole tiles: a pair a row does not see has P = dS = 0, and 0 times a NaN
    // or Inf of q, k or v in the same tile is still NaN (as in torch's math path and FlashAttention;
    // attention.h). So on flash2 (and auto, which picks it for 16-bit data) each special value sits
    // where both rules agree: v and k at key 0, which every causal row sees, q in the last row,
    // which sees every key. The other rungs hold the stricter rule (only the rows and keys that see
    // a value get NaN) with the values in the middle of the sequences.
    const bool whole_tiles = (variant() == AttentionVariant::kFlash2 || variant() == AttentionVariant::kAuto) &&
                             dt != DType::kF32;
    o.set_data(kQ, whole_tiles ? 39 : 3, 0, 7, std::nan(""));
    o.set_data(kK, 0, 0, 0, 0.5);
    o.set_data(kQ, whole_tiles ? 39 : 30, 1, 0, INFINITY);
    o.set_data(kK, 40 + (whole_tiles ? 0 : 20), 0, 2, std::nan(""));
    o.set_data(kV, whole_tiles ? 0 : 33, 0, 1, std::nan(""));
    o.refresh_forward();
    expect_operands_ok(o);
  }
}

TEST_P(CudaAttention, WorkspaceAndStream) {
  OwnStream stream;
  for (DType dt : dtypes()) {
    AttnCase c = base(dt, 2, 129, 77, 4, 2, 64);
    c.explicit_workspace = true;
    expect_attention_ok(c);
    c.stream = stream.get();
    expect_attention_ok(c);
    c.lens_q = {17, 0, 90};
    c.lens_k = {40, 3, 1};
    expect_attention_ok(c);
  }
}

// deterministic: the same bits on two runs (and right); otherwise right (atomics may reorder sums).
TEST_P(CudaAttention, DeterministicBackward) {
  if (!backward()) GTEST_SKIP() << "the deterministic option is the backward's";
  for (DType dt : dtypes())
    for (bool det : {true, false}) {
      AttnCase c = base(dt, 2, 200, 150, 8, 2, 64);
      c.deterministic = det;
      c.causal = det;
      const AttnOperands o(c);
      AttnRun first;
      const AttnCheck r = expect_operands_ok(o, &first);
      if (!det || !r.passed) continue;
      const AttnRun second = run_attention(o);
      ASSERT_TRUE(second.ok) << second.error;
      EXPECT_TRUE(same_output_bits(o, first, second)) << c.describe();
    }
}

// S = 4097: past every tile and grid size.
TEST_P(CudaAttention, BigSequences) {
  const DType dt = dtypes().back();
  AttnCase c = base(dt, 1, 4097, 4097, 2, 1, 64);
  c.causal = true;
  expect_attention_ok(c);
  AttnCase d = base(dt, 1, 257, 4097, 1, 1, 128);
  expect_attention_ok(d);
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaAttention,
                         ::testing::Combine(::testing::ValuesIn(kCudaVariants), ::testing::Bool()), param_name);

TEST(CudaAttentionAuto, PicksFlash2ForHalfAndFlashForFp32) {
  SKIP_WITHOUT_CUDA();
  EXPECT_EQ(resolve_attention_variant(DType::kF16, 128, Device::cuda(0)), AttentionVariant::kFlash2);
  EXPECT_EQ(resolve_attention_variant(DType::kBF16, 64, Device::cuda(0)), AttentionVariant::kFlash2);
  EXPECT_EQ(resolve_attention_variant(DType::kF32, 64, Device::cuda(0)), AttentionVariant::kFlash);
}

TEST(CudaAttentionWorkspace, NaiveNeedsTheMaterializedScores) {
  SKIP_WITHOUT_CUDA();
  AttentionShape s;
  s.batch = 2, s.seqlen_q = 100, s.seqlen_k = 300, s.heads_q = 4, s.heads_kv = 2, s.head_dim = 64;
  const size_t fwd = attention_workspace_bytes(s, DType::kF16, Device::cuda(0), false, {}, AttentionVariant::kNaive);
  EXPECT_GE(fwd, static_cast<size_t>(2 * 4 * 100 * 300) * sizeof(float));
  // A workspace one byte short is refused, naming it.
  AttnCase c = make_case(false, DType::kF16, AttentionVariant::kNaive, Device::cuda(0), 2, 100, 300, 4, 2, 64);
  const AttnOperands o(c);
  Buffer ws(DType::kI32, static_cast<int64_t>(fwd / 4 + 1), Device::cuda(0));
  std::vector<Buffer> dev;
  std::array<void*, kRoles> bases{};
  for (int r = 0; r < kRoles; ++r) {
    if (!o.ops[r].present) continue;
    dev.emplace_back(o.ops[r].dtype, o.ops[r].host.count(), Device::cuda(0));
    dev.back().copy_from_host(o.ops[r].host.data());
    bases[static_cast<size_t>(r)] = dev.back().data();
  }
  ExecutionContext ctx;
  ctx.workspace = {ws.data(), fwd - 1};
  const Caught e = call([&] { call_attention(o, c, bases, Device::cuda(0), ctx); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "workspace");
}


// ---- hopper: the sm_90a forward (wgmma / TMA, warp-specialized) --------------------------------
// What it runs (attention.h): the forward, fp16 / bf16, fixed length, head dims 64 and 128, causal
// (both alignments) or unmasked, GQA / MQA, any softmax_scale; the same reference, tolerance rule,
// poisoned outputs, odd sizes, strided views and special values as the grid above. The rest it
// refuses (test_attention_errors.cpp; here on the device too). Skips with the reason without a
// device of compute capability 9.0 or in a build without the sm_90a sources.

// Why hopper cannot run here; empty when it can.
const std::string& hopper_unavailable() {
  static const std::string why = []() -> std::string {
    if (cuda_device_count() == 0) return "no CUDA device: " + cuda_unavailable_reason();
    if (!hopper_device()) return "hopper is sm_90a code: it runs on compute capability 9.0 only";
    const AttnOperands o(make_case(false, DType::kBF16, AttentionVariant::kHopper, Device::cuda(0), 1, 1, 1, 1, 1, 64));
    const AttnRun r = run_attention(o);
    if (!r.ok && r.error.find("not in this build") != std::string::npos) return r.error;
    return "";
  }();
  return why;
}

class HopperAttention : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (!hopper_unavailable().empty()) GTEST_SKIP() << hopper_unavailable();
  }
  AttnCase base(int64_t batch, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d) const {
    return make_case(false, GetParam(), AttentionVariant::kHopper, Device::cuda(0), batch, sq, sk, hq, hkv, d);
  }
  // Every case unmasked, causal bottom-right and causal top-left.
  void expect_all_masks(AttnCase c) const {
    for (int m = 0; m < 3; ++m) {
      c.causal = m > 0;
      c.top_left = m == 2;
      expect_attention_ok(c);
    }
  }
};

// Odd sizes around the 128-row tiles (1, primes, 127 / 128 / 129, 255 / 256 / 257), S_q != S_k both
// ways, both head dims.
TEST_P(HopperAttention, Sizes) {
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{1, 1},     {7, 7},     {113, 113}, {7, 113},
                                                          {113, 7},   {1, 113},   {113, 1},   {127, 129},
                                                          {128, 128}, {129, 127}, {255, 257}, {256, 256}};
  for (int64_t d : {64, 128}) {
    for (auto [sq, sk] : sizes) expect_all_masks(base(2, sq, sk, 4, 2, d));
    expect_all_masks(base(1, 1000, 1000, 2, 1, d));
    expect_all_masks(base(1, 300, 1000, 2, 2, d));
  }
}

TEST_P(HopperAttention, GqaAndMqa) {
  for (int64_t d : {64, 128})
    for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}, {8, 2}, {8, 1}, {16, 2}, {3, 1}})
      expect_all_masks(base(2, 137, 201, hq, hkv, d));
}

TEST_P(HopperAttention, Scale) {
  for (double scale : {0.3, 1.0, -0.2}) {
    AttnCase c = base(2, 150, 190, 4, 2, 128);
    c.scale = scale;
    expect_all_masks(c);
  }
}

TEST_P(HopperAttention, WithoutLse) {
  AttnCase c = base(2, 129, 77, 4, 2, 128);
  c.with_lse = false;
  expect_all_masks(c);
}

// TMA takes any 16-byte-aligned strides: (B, H, S, D) views, padded rows, offset views.
TEST_P(HopperAttention, StridedViews) {
  for (DataLayout layout : {DataLayout::kBSHD, DataLayout::kBHSD})
    for (auto [pad, offset] : std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {8, 16}, {24, 8}}) {
      AttnCase c = base(2, 150, 161, 4, 2, 128);
      c.layout = layout;
      c.pad = pad;
      c.offset = offset;
      expect_all_masks(c);
    }
}

TEST_P(HopperAttention, RowsWithNoVisibleKey) {
  for (int64_t d : {64, 128}) {
    AttnCase c = base(2, 290, 40, 2, 1, d);
    c.causal = true;  // bottom-right: the first 250 rows see no key, whole 128-row blocks of them
    expect_attention_ok(c);
  }
}

// hopper multiplies whole tiles (as flash2): the special values sit where every rule agrees (see
// CudaAttention.NanAndInf).
TEST_P(HopperAttention, NanAndInf) {
  AttnCase c = base(2, 40, 40, 2, 1, 128);
  c.causal = true;
  AttnOperands o(c);
  o.set_data(kQ, 39, 0, 7, std::nan(""));
  o.set_data(kK, 0, 0, 0, 0.5);
  o.set_data(kQ, 39, 1, 0, INFINITY);
  o.set_data(kK, 40, 0, 2, std::nan(""));
  o.set_data(kV, 0, 0, 1, std::nan(""));
  o.refresh_forward();
  expect_operands_ok(o);
}

TEST_P(HopperAttention, OwnStream) {
  OwnStream stream;
  AttnCase c = base(2, 129, 77, 4, 2, 64);
  c.stream = stream.get();
  expect_all_masks(c);
}

TEST_P(HopperAttention, BigSequences) {
  AttnCase c = base(1, 4097, 4097, 2, 1, 128);
  c.causal = true;
  expect_attention_ok(c);
  expect_attention_ok(base(1, 257, 4097, 1, 1, 128));
}

// Sliding windows (the tiles outside every row's window skipped, masks only on the tiles an edge
// crosses): left and right edges, one-sided, with the causal diagonal, both alignments, across the
// 128-row / 128-key tiles, both head dims, GQA; and varlen with a window.
TEST_P(HopperAttention, Windows) {
  const std::vector<std::pair<int64_t, int64_t>> windows = {{0, 0},  {16, 0},  {127, 0}, {128, 0}, {300, 0},
                                                            {5, 3},  {100, 50}, {-1, 7}, {40, -1}, {0, 200}};
  for (int64_t d : {64, 128})
    for (auto [sq, sk] : std::vector<std::pair<int64_t, int64_t>>{{300, 300}, {129, 700}, {700, 129}})
      for (auto [wl, wr] : windows)
        for (bool top_left : {false, true}) {
          AttnCase c = base(1, sq, sk, 4, 2, d);
          c.window_left = wl, c.window_right = wr, c.top_left = top_left;
          expect_attention_ok(c);
        }
  AttnCase c = base(1, 1, 1, 4, 1, 64);
  c.lens_q = {130, 0, 1, 257, 64, 300};
  c.lens_k = {200, 5, 1, 100, 64, 129};
  c.window_left = 33, c.window_right = 0;
  expect_attention_ok(c);
}

// Varlen: packed sequences of mixed lengths (empty, length 1, across the 128-row tiles, S_q != S_k both
// ways), both head dims, GQA, each unmasked, causal bottom-right and top-left.
TEST_P(HopperAttention, Varlen) {
  for (int64_t d : {64, 128}) {
    for (const VarlenLens& lens : varlen_batches()) {
      AttnCase c = base(1, 1, 1, 4, 2, d);
      c.lens_q = lens.q;
      c.lens_k = lens.k;
      expect_all_masks(c);
    }
    AttnCase c = base(1, 1, 1, 4, 1, d);
    c.lens_q = {130, 0, 1, 257, 64, 300};
    c.lens_k = {200, 5, 1, 100, 64, 129};
    expect_all_masks(c);
  }
}

// Varlen: sequence 0's last key tile (keys 128..255 of the packed k / v) runs into sequence 1's rows,
// which TMA loads too. Sequence 1's keys 0 and 1 (packed rows 130 and 131: a NaN and an Inf in v, an
// Inf in k) and its last query row (a NaN in q; packed row 109, inside sequence 0's query tile) must
// stay out of sequence 0; every row of sequence 1 sees its key 0 (a finite score), its last row every
// key, so there both rules of CudaAttention.NanAndInf agree. (The Inf in k sits on key 1: on key 0 it
// could make the top-left row 0's only score -inf, a row the reference calls empty (out 0) while
// P = 0 times v's NaN gives NaN.)
TEST_P(HopperAttention, VarlenNeighboursSpecialValues) {
  for (int64_t d : {64, 128}) {
    AttnCase c = base(1, 1, 1, 2, 1, d);
    c.lens_q = {50, 60};
    c.lens_k = {130, 70};
    for (int m = 0; m < 3; ++m) {
      c.causal = m > 0;
      c.top_left = m == 2;
      AttnOperands o(c);
      o.set_data(kV, 130, 0, 3, std::nan(""));
      o.set_data(kV, 130, 0, 9, INFINITY);
      o.set_data(kK, 131, 0, 1, INFINITY);
      o.set_data(kQ, 109, 1, 0, std::nan(""));
      expect_operands_ok(o);
    }
  }
}

// auto runs the hopper forward where the measured rule says (attention_config.h): N >= 1024, S_q = S_k,
// both head dims, causal or not, GQA; the results through that path against the reference.
TEST_P(HopperAttention, AutoRunsIt) {
  for (int64_t d : {64, 128}) {
    AttnCase c = base(1, 1024, 1024, 4, 2, d);
    c.variant = AttentionVariant::kAuto;
    expect_all_masks(c);
    c = base(2, 1031, 1031, 2, 1, d);
    c.variant = AttentionVariant::kAuto;
    expect_all_masks(c);
  }
}

// The backward (hopper_bwd.cuh): dq, dk, dv against the float64 reference, sizes around the 128-key and
// 64-query tiles, both head dims, all masks, GQA / MQA, S_q != S_k both ways, both modes (fast: dq by
// reductions; deterministic: flash2's dq kernel, the same bits twice).
TEST_P(HopperAttention, Backward) {
  const std::vector<std::pair<int64_t, int64_t>> sizes = {{1, 1},     {7, 7},     {63, 65},  {64, 64},
                                                          {113, 113}, {129, 127}, {1, 200}, {200, 1},
                                                          {255, 257}, {300, 1000}};
  for (int64_t d : {64, 128})
    for (auto [sq, sk] : sizes) {
      AttnCase c = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 2, sq, sk, 4, 2, d);
      expect_all_masks(c);
    }
}

// The backward with sliding windows (the query tiles outside every key's window skipped).
TEST_P(HopperAttention, BackwardWindows) {
  for (int64_t d : {64, 128})
    for (auto [wl, wr] : std::vector<std::pair<int64_t, int64_t>>{{16, 0}, {100, 50}, {-1, 7}, {40, -1}, {0, 0}})
      for (bool top_left : {false, true}) {
        AttnCase c = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 1, 300, 260, 4, 2, d);
        c.window_left = wl, c.window_right = wr, c.top_left = top_left;
        expect_attention_ok(c);
      }
}

TEST_P(HopperAttention, BackwardGqaStridedAndDeterministic) {
  for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{8, 1}, {6, 3}, {2, 2}}) {
    AttnCase c = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 1, 190, 190, hq, hkv, 128);
    c.causal = true;
    expect_attention_ok(c);
  }
  AttnCase c = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 2, 150, 150, 4, 2, 64);
  c.layout = DataLayout::kBHSD;
  expect_attention_ok(c);
  for (bool det : {false, true}) {
    AttnCase e = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 2, 200, 150, 8, 2, 64);
    e.deterministic = det;
    e.causal = true;
    const AttnOperands o(e);
    AttnRun first;
    const AttnCheck r = expect_operands_ok(o, &first);
    if (!det || !r.passed) continue;
    const AttnRun second = run_attention(o);
    ASSERT_TRUE(second.ok) << second.error;
    EXPECT_TRUE(same_output_bits(o, first, second)) << e.describe();
  }
}

// The varlen backward: the family's varlen batches (empty and length-1 sequences, lengths across the
// 128-key / 64-query tiles), both head dims, GQA, unmasked, causal and a window; and NaN / Inf in the
// next sequence's q, k, v, dout (loaded by TMA into a sequence's last tiles) kept out of it.
TEST_P(HopperAttention, VarlenBackward) {
  for (int64_t d : {64, 128}) {
    for (const VarlenLens& lens : varlen_batches())
      for (int m = 0; m < 3; ++m) {
        AttnCase c = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 1, 1, 1, 4, 2, d);
        c.lens_q = lens.q;
        c.lens_k = lens.k;
        c.causal = m == 1;
        if (m == 2) c.window_left = 3, c.window_right = 1;
        expect_attention_ok(c);
      }
    AttnCase c = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 1, 1, 1, 4, 1, d);
    c.lens_q = {130, 0, 1, 257, 64, 300};
    c.lens_k = {200, 5, 1, 100, 64, 129};
    c.causal = true;
    expect_attention_ok(c);
  }
}

TEST_P(HopperAttention, VarlenBackwardNeighboursSpecialValues) {
  for (int64_t d : {64, 128}) {
    AttnCase c = make_case(true, GetParam(), AttentionVariant::kHopper, Device::cuda(0), 1, 1, 1, 2, 1, d);
    c.lens_q = {50, 60};
    c.lens_k = {130, 70};
    AttnOperands o(c);
    // Sequence 1's key 0 (packed row 130) and its last query row (packed row 109), which every row of
    // sequence 1 sees / which sees every key of it: both rules agree there (CudaAttention.NanAndInf).
    o.set_data(kV, 130, 0, 3, std::nan(""));
    o.set_data(kK, 131, 0, 1, INFINITY);
    o.set_data(kQ, 109, 1, 0, std::nan(""));
    o.set_data(kDout, 109, 0, 2, INFINITY);
    o.refresh_forward();
    expect_operands_ok(o);
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, HopperAttention, ::testing::Values(DType::kF16, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

}  // namespace
}  // namespace optimized::testing
