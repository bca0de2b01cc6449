// The fused family on CUDA through the public API: every op, forward and backward, fp32 / fp16 /
// bf16, on every CUDA rung (unfused, fused_streaming, fused_registers) and kAuto, against the
// float64 reference with the tolerance rule of fused_test_util.h, on fresh random inputs with
// poisoned outputs, padded and misaligned rows and guard zones. fused_registers on rows longer
// than fused_registers_max_width() must refuse with kUnsupported.
// A plain C++ file, built in every configuration: without a CUDA device every test skips with the
// reason. Tests named *Big* hold the long rows (the compute-sanitizer run filters them out).
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "fused_test_util.h"

namespace optimized::testing {
namespace {

const std::vector<DType> kDtypes = {DType::kF32, DType::kF16, DType::kBF16};
const std::vector<FusedVariant> kVariants = {FusedVariant::kCudaUnfused, FusedVariant::kCudaFusedStreaming,
                                             FusedVariant::kCudaFusedRegisters, FusedVariant::kAuto};

// op, backward, variant; each test runs every dtype (fewer test processes: each one starts a CUDA
// context under ctest).
using Param = std::tuple<OpSpec, bool, FusedVariant>;

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [spec, backward, variant] = info.param;
  return op_label(spec) + (backward ? "_bwd_" : "_fwd_") + std::string(fused_variant_name(variant));
}

// Whether every row of every operand of the case starts on a 16-byte boundary and rows are whole
// 16-byte vectors (fused_rows_aligned's condition; buffers are 256-byte aligned).
bool case_aligned(const FusedCase& cs) {
  const int64_t es = static_cast<int64_t>(dtype_size(cs.dtype));
  return (cs.offset * es) % 16 == 0 && ((cs.width + cs.pad) * es) % 16 == 0 &&
         ((cs.x_cols() + cs.pad) * es) % 16 == 0 && (cs.width * es) % 16 == 0;
}

class CudaFused : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA(); }
  FusedCase base(DType dtype, Size size) const {
    const auto& [spec, backward, variant] = GetParam();
    return make_case(spec, backward, dtype, variant, Device::cuda(0), size);
  }
  FusedOp op() const { return std::get<0>(GetParam()).op; }
  bool backward() const { return std::get<1>(GetParam()); }
  // fused_registers refuses rows longer than it holds.
  static bool too_long_for_registers(const FusedCase& cs) {
    if (cs.variant != FusedVariant::kCudaFusedRegisters || !reduces(cs.op)) return false;
    return cs.width > fused_registers_max_width(cs.op, cs.dtype, cs.backward, case_aligned(cs));
  }
  // The case matches the reference, or (fused_registers, too long a row) is refused with
  // kUnsupported naming the variant.
  static void expect_ok(const FusedCase& cs) {
    if (!too_long_for_registers(cs)) {
      expect_fused_ok(cs);
      return;
    }
    SCOPED_TRACE(cs.describe());
    FusedOperands o(cs);
    try {
      run_fused(o);
      ADD_FAILURE() << cs.describe() << ": fused_registers ran a row longer than fused_registers_max_width ("
                    << fused_registers_max_width(cs.op, cs.dtype, cs.backward, case_aligned(cs)) << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kUnsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("fused_registers"), std::string::npos) << e.what();
    }
  }
};

TEST_P(CudaFused, Shapes) {
  for (DType d : kDtypes) {
    for (const Size& s : odd_sizes()) expect_ok(base(d, s));
    // More rows than a wave of blocks, short and medium rows.
    for (Size s : {Size{4097, 1}, Size{1000, 129}}) expect_ok(base(d, s));
    for (int64_t w : {1, 7, 1024, 3000}) {  // 1-D views: one row
      FusedCase cs = base(d, {1, w});
      cs.one_d = true;
      expect_ok(cs);
    }
    for (int64_t w : {1, 64}) {  // 0 rows: nothing is done (dweight / dbias: zeros)
      FusedCase cs = base(d, {0, w});
      SCOPED_TRACE(cs.describe());
      FusedOperands o(cs);
      FusedRun run;
      ASSERT_NO_THROW(run = run_fused(o));
      ASSERT_TRUE(run.ok) << run.error;
      expect_zero_rows_result(o, run);
    }
  }
}

TEST_P(CudaFused, BigRows) {
  for (DType d : kDtypes) {
    for (const Size& s : big_sizes()) expect_ok(base(d, s));
    if (!reduces(op())) continue;
    // The longest row fused_registers holds, and one vector more (auto streams that one).
    const int64_t max_width = fused_registers_max_width(op(), d, backward(), true);
    for (int64_t w : {max_width, max_width + 8}) expect_ok(base(d, {2, w}));
    EXPECT_EQ(resolve_fused_variant(op(), d, Device::cuda(0), max_width + 8, backward(), true),
              FusedVariant::kCudaFusedStreaming);
  }
}

TEST_P(CudaFused, LayoutsAndStreams) {
  OwnStream stream;
  for (DType d : kDtypes) {
    const int64_t vec = 16 / static_cast<int64_t>(dtype_size(d));
    for (Size s : {Size{17, 256}, Size{3, 1000}, Size{5, 1}, Size{1, 33}, Size{64, 1024}}) {
      FusedCase cs = base(d, s);
      cs.pad = 1;  // rows an odd number of elements apart: vector loads must fall back
      expect_ok(cs);
      cs.pad = 2 * vec;  // padded, rows still 16-byte aligned
      expect_ok(cs);
      cs.offset = 1;  // every view one element past a 256-byte boundary
      expect_ok(cs);
    }
    for (Size s : {Size{33, 1000}, Size{4097, 64}}) {
      FusedCase cs = base(d, s);
      cs.stream = stream.get();  // a launcher on another stream reads NaN and fails the check
      expect_ok(cs);
    }
  }
}

TEST_P(CudaFused, InPlace) {
  if (op() == FusedOp::kSiluAndMul) GTEST_SKIP() << "silu_and_mul's output has another shape than its input";
  for (DType d : kDtypes)
    for (Size s : {Size{17, 256}, Size{3, 1000}, Size{4, 1}, Size{2, 4099}}) {
      FusedCase cs = base(d, s);
      expect_in_place_ok(cs);
      cs.pad = 5;
      expect_in_place_ok(cs);
    }
}

TEST_P(CudaFused, OptionalOperandsAndScalars) {
  for (DType d : kDtypes) {
    for (int mask = 0; mask < 8; ++mask) {
      FusedCase cs = base(d, {17, 1024});
      cs.with_weight = mask & 1;
      cs.with_bias = mask & 2;
      cs.with_stats = cs.with_dweight = cs.with_dbias = mask & 4;
      expect_ok(cs);
    }
    for (float v : {-0.5f, 3.0f}) {
      FusedCase cs = base(d, {9, 1000});
      cs.scale = v;  // softmax, log_softmax
      cs.eps = v * v;  // norms: an eps that dominates some rows' variance
      expect_ok(cs);
    }
  }
}

TEST_P(CudaFused, SpecialValues) {
  for (DType d : kDtypes) {
    // Rows of all-equal values: finite, and as the reference says.
    for (int64_t w : {1, 100, 4096}) {
      FusedCase cs = base(d, {6, w});
      FusedOperands o(cs);
      for (int64_t i = 0; i < cs.rows; ++i)
        for (int64_t j = 0; j < cs.x_cols(); ++j) o.set(kX, i, j, 0.75 * static_cast<double>(i) - 1.5);
      o.refresh_stats();
      const FusedCheck c = expect_operands_ok(o);
      for (double v : c.values[cs.backward ? kDx : kY]) ASSERT_TRUE(std::isfinite(v)) << cs.describe();
    }
    // NaN / Inf as torch; backward: a NaN in dy.
    for (Size s : {Size{7, 33}, Size{6, 2048}}) {
      FusedCase cs = base(d, s);
      if (!cs.backward) {
        expect_nan_inf_behaviour(cs);
        continue;
      }
      FusedOperands o(cs);
      o.set(kDy, 2, 5, std::nan(""));
      expect_operands_ok(o);
    }
    // layer_norm: the first element 1000 away from the rest. A variance from sums shifted by h[0]
    // cancels (E[d^2] and E[d]^2 ~ 1e6 against a variance ~ 1e3); two passes or Welford do not.
    if (is_layer(op()) && !backward())
      for (Size s : {Size{4, 1000}, Size{2, 20000}}) {
        FusedCase cs = base(d, s);
        FusedOperands o(cs);
        for (int64_t i = 0; i < cs.rows; ++i) o.set(kX, i, 0, i % 2 ? -1000.0 : 1000.0);
        expect_operands_ok(o);
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaFused,
                         ::testing::Combine(::testing::ValuesIn(all_op_specs()), ::testing::Bool(),
                                            ::testing::ValuesIn(kVariants)),
                         param_name);

TEST(CudaFusedAuto, PicksTheMeasuredDesign) {
  // resolve_fused_variant's table (fused_config.h, from the measured sweep): registers for short
  // rows, streaming past the registers' limit, for unaligned rows past 1024 columns, for the norms'
  // forward from 16384 (bf16/fp16) or 4096 (fp32) columns, softmax forward from 32768 and softmax
  // backward from 32768 (bf16/fp16) or 16384 (fp32); the norms' backward stays on registers;
  // element-wise ops have one fused kernel for both.
  const auto cuda = Device::cuda(0);
  for (FusedOp op : all_fused_ops())
    for (DType d : kDtypes)
      for (bool bwd : {false, true}) {
        const int64_t max_width = fused_registers_max_width(op, d, bwd, true);
        EXPECT_EQ(resolve_fused_variant(op, d, cuda, 1024, bwd), FusedVariant::kCudaFusedRegisters);
        EXPECT_EQ(resolve_fused_variant(op, d, cuda, 65, bwd, false), FusedVariant::kCudaFusedRegisters);
        if (max_width == 0) continue;
        EXPECT_EQ(resolve_fused_variant(op, d, cuda, max_width + 1, bwd), FusedVariant::kCudaFusedStreaming);
        EXPECT_EQ(resolve_fused_variant(op, d, cuda, 1024, bwd, false), FusedVariant::kCudaFusedRegisters);
        EXPECT_EQ(resolve_fused_variant(op, d, cuda, 1027, bwd, false), FusedVariant::kCudaFusedStreaming);
      }
  const auto pick = [&](FusedOp op, DType d, int64_t width, bool bwd) { return resolve_fused_variant(op, d, cuda, width, bwd); };
  constexpr auto R = FusedVariant::kCudaFusedRegisters;
  constexpr auto S = FusedVariant::kCudaFusedStreaming;
  for (FusedOp op : {FusedOp::kRmsNorm, FusedOp::kLayerNorm, FusedOp::kAddRmsNorm}) {
    EXPECT_EQ(pick(op, DType::kBF16, 8192, false), R);
    EXPECT_EQ(pick(op, DType::kF16, 16384, false), S);
    EXPECT_EQ(pick(op, DType::kF32, 2048, false), R);
    EXPECT_EQ(pick(op, DType::kF32, 4096, false), S);
    EXPECT_EQ(pick(op, DType::kBF16, 32768, true), R);
    EXPECT_EQ(pick(op, DType::kF32, 16384, true), R);
  }
  for (FusedOp op : {FusedOp::kSoftmax, FusedOp::kLogSoftmax}) {
    EXPECT_EQ(pick(op, DType::kBF16, 16384, false), R);
    EXPECT_EQ(pick(op, DType::kF32, 16384, false), R);
    EXPECT_EQ(pick(op, DType::kBF16, 32768, false), S);
    EXPECT_EQ(pick(op, DType::kF32, 32768, false), S);
    EXPECT_EQ(pick(op, DType::kBF16, 16384, true), R);
    EXPECT_EQ(pick(op, DType::kBF16, 32768, true), S);
    EXPECT_EQ(pick(op, DType::kF32, 8192, true), R);
    EXPECT_EQ(pick(op, DType::kF32, 16384, true), S);
  }
}

}  // namespace
}  // namespace optimized::testing
