// Every error path of the fused family's public API (src/fused/fused.cpp). Each test asserts the
// Error's status and that the message names the argument and shows what was expected and/or what
// was given (house rule 2), and the fixture checks that a rejected call wrote none of its outputs.
// Also the names, lists and the variant choice of fused.h.
#include <gtest/gtest.h>

#include <cmath>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/fused.h"

namespace optimized {
namespace {

using namespace optimized::testing;

const TensorView kAbsent{};

// Valid operands of every op, (R, W) rows (silu_and_mul: x and dx (R, 2W)), in host buffers with
// room to spare. Outputs hold a pattern that every rejected call must leave alone.
class FusedErrors : public ::testing::Test {
 protected:
  static constexpr int64_t R = 5, W = 8;
  static constexpr int64_t kRoom = 1024;  // elements per buffer

  void SetUp() override {
    for (Buffer* b : {&x_, &res_, &w_, &b_, &dy_, &dres_, &x16_, &x64_, &w16_}) {
      for (int64_t i = 0; i < kRoom; ++i) store_from_double(b->data(), b->dtype(), i, 0.25 + 0.01 * (i % 7));
    }
    for (int64_t i = 0; i < kRoom; ++i) {
      store_from_double(mean_in_.data(), DType::kF32, i, 0.25);
      store_from_double(rstd_in_.data(), DType::kF32, i, 2.0);
    }
    for (Buffer* b : outputs()) b->fill_bytes(0x5A);
  }
  void TearDown() override {
    if (!check_untouched_) return;
    for (Buffer* b : outputs()) {
      const auto* p = static_cast<const unsigned char*>(b->data());
      for (size_t i = 0; i < b->bytes(); ++i)
        ASSERT_EQ(p[i], 0x5A) << "a rejected call wrote an output (byte " << i << ")";
    }
  }
  std::vector<Buffer*> outputs() { return {&y_, &ro_, &mean_, &rstd_, &dx_, &dw_, &db_, &y16_, &y64_}; }

  // (R, cols) views, rows `cols` apart.
  static TensorView rows(const Buffer& b, int64_t cols = W, Device d = Device::cpu()) {
    return raw(b.data(), b.dtype(), d, {R, cols}, {cols, 1});
  }
  static TensorView vec(const Buffer& b, int64_t n = W) { return raw(b.data(), b.dtype(), Device::cpu(), {n}, {1}); }

  TensorView X() const { return rows(x_); }
  TensorView Res() const { return rows(res_); }
  TensorView Y() const { return rows(y_); }
  TensorView RO() const { return rows(ro_); }
  TensorView Wt() const { return vec(w_); }
  TensorView B() const { return vec(b_); }
  TensorView Mean() const { return vec(mean_, R); }
  TensorView Rstd() const { return vec(rstd_, R); }
  TensorView MeanIn() const { return vec(mean_in_, R); }
  TensorView RstdIn() const { return vec(rstd_in_, R); }
  TensorView Dy() const { return rows(dy_); }
  TensorView Dres() const { return rows(dres_); }
  TensorView Dx() const { return rows(dx_); }
  TensorView Dw() const { return vec(dw_); }
  TensorView Db() const { return vec(db_); }

  void ln_fwd(const TensorView& x, const TensorView& res, const TensorView& w, const TensorView& b,
              const TensorView& y, const TensorView& ro, const TensorView& mean, const TensorView& rstd,
              FusedVariant v = FusedVariant::kAuto, float eps = 1e-5f) {
    layer_norm_forward(x, res, w, b, eps, y, ro, mean, rstd, v);
  }

  Buffer x_{DType::kF32, kRoom, Device::cpu()}, res_{DType::kF32, kRoom, Device::cpu()},
      w_{DType::kF32, kRoom, Device::cpu()}, b_{DType::kF32, kRoom, Device::cpu()},
      dy_{DType::kF32, kRoom, Device::cpu()}, dres_{DType::kF32, kRoom, Device::cpu()};
  Buffer mean_in_{DType::kF32, kRoom, Device::cpu()}, rstd_in_{DType::kF32, kRoom, Device::cpu()};
  Buffer y_{DType::kF32, kRoom, Device::cpu()}, ro_{DType::kF32, kRoom, Device::cpu()},
      mean_{DType::kF32, kRoom, Device::cpu()}, rstd_{DType::kF32, kRoom, Device::cpu()},
      dx_{DType::kF32, kRoom, Device::cpu()}, dw_{DType::kF32, kRoom, Device::cpu()},
      db_{DType::kF32, kRoom, Device::cpu()};
  Buffer x16_{DType::kF16, kRoom, Device::cpu()}, y16_{DType::kF16, kRoom, Device::cpu()},
      w16_{DType::kF16, kRoom, Device::cpu()};
  Buffer x64_{DType::kF64, kRoom, Device::cpu()}, y64_{DType::kF64, kRoom, Device::cpu()};
  bool check_untouched_ = true;
};

TEST_F(FusedErrors, ValidCallsRun) {
  // The baseline every other test breaks one thing of: each op, forward and backward.
  check_untouched_ = false;
  const TensorView x2 = rows(x_, 2 * W), dx2 = rows(dx_, 2 * W);
  EXPECT_NO_THROW(softmax_forward(X(), Y()));
  EXPECT_NO_THROW(softmax_backward(X(), Dy(), Dx(), 1.0f, true));
  EXPECT_NO_THROW(ln_fwd(X(), Res(), Wt(), B(), Y(), RO(), Mean(), Rstd()));
  EXPECT_NO_THROW(layer_norm_backward(Dy(), X(), Wt(), MeanIn(), RstdIn(), Dres(), Dx(), Dw(), Db()));
  EXPECT_NO_THROW(rms_norm_forward(X(), kAbsent, Wt(), 1e-6f, Y(), kAbsent, Rstd()));
  EXPECT_NO_THROW(rms_norm_backward(Dy(), X(), Wt(), RstdIn(), kAbsent, Dx(), Dw()));
  EXPECT_NO_THROW(bias_gelu_forward(X(), B(), GeluApproximation::kTanh, Y()));
  EXPECT_NO_THROW(bias_gelu_backward(Dy(), X(), B(), GeluApproximation::kNone, Dx(), Db()));
  EXPECT_NO_THROW(silu_and_mul_forward(x2, Y()));
  EXPECT_NO_THROW(silu_and_mul_backward(Dy(), x2, dx2));
  // Statistics may also come as a (rows, 1) column.
  EXPECT_NO_THROW(ln_fwd(X(), kAbsent, Wt(), B(), Y(), kAbsent, raw(mean_.data(), DType::kF32, Device::cpu(), {R, 1}, {1, 1}),
                         Rstd()));
}

TEST_F(FusedErrors, NullData) {
  {
    TensorView x = X();
    x.data = nullptr;
    Caught e = call([&] { softmax_forward(x, Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, "null");
  }
  {
    TensorView y = Y();
    y.data = nullptr;
    Caught e = call([&] { rms_norm_forward(X(), kAbsent, Wt(), 1e-5f, y, kAbsent, Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "null");
  }
  {
    TensorView w = Wt();
    w.data = nullptr;
    Caught e = call([&] { ln_fwd(X(), kAbsent, w, B(), Y(), kAbsent, Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "weight");
  }
  {
    TensorView dy = Dy();
    dy.data = nullptr;
    Caught e = call([&] { bias_gelu_backward(dy, X(), B(), GeluApproximation::kNone, Dx(), Db()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dy");
  }
}

TEST_F(FusedErrors, WrongRank) {
  {
    Caught e = call([&] { softmax_forward(raw(x_.data(), DType::kF32, Device::cpu(), {2, R, W}, {R * W, W, 1}), Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, "rank 3");
  }
  {
    Caught e = call([&] { softmax_forward(X(), kAbsent); });  // a required output absent
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "rank 0");
  }
  {
    Caught e = call([&] { layer_norm_backward(kAbsent, X(), Wt(), MeanIn(), RstdIn(), kAbsent, Dx(), Dw(), Db()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dy");
  }
  {
    // weight must be (width); a (1, width) matrix is not a vector.
    Caught e = call([&] { ln_fwd(X(), kAbsent, raw(w_.data(), DType::kF32, Device::cpu(), {1, W}, {W, 1}), B(), Y(),
                                 kAbsent, Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "weight");
  }
}

TEST_F(FusedErrors, ShapeMismatch) {
  const std::string want = "(" + std::to_string(R) + ", " + std::to_string(W) + ")";
  {
    Caught e = call([&] { softmax_forward(X(), rows(y_, W + 1)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, want);
    EXPECT_CONTAINS(e, "(5, 9)");
  }
  {
    TensorView res = raw(res_.data(), DType::kF32, Device::cpu(), {R + 1, W}, {W, 1});
    Caught e = call([&] { ln_fwd(X(), res, Wt(), B(), Y(), RO(), Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "residual");
    EXPECT_CONTAINS(e, "(6, 8)");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, vec(w_, W + 1), B(), Y(), kAbsent, Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "weight");
    EXPECT_CONTAINS(e, "(8)");
    EXPECT_CONTAINS(e, "(9)");
  }
  {
    Caught e = call([&] { bias_gelu_forward(X(), vec(b_, W - 1), GeluApproximation::kNone, Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "bias");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, Wt(), B(), Y(), kAbsent, vec(mean_, R + 1), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "mean");
    EXPECT_CONTAINS(e, "(5)");
  }
  {
    Caught e = call([&] { rms_norm_backward(Dy(), X(), Wt(), vec(rstd_in_, R - 1), kAbsent, Dx(), Dw()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "rstd");
  }
  {
    Caught e = call([&] { layer_norm_backward(Dy(), rows(x_, W + 2), Wt(), MeanIn(), RstdIn(), kAbsent, Dx(), Dw(), Db()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "h");
  }
  {
    Caught e = call([&] { layer_norm_backward(Dy(), X(), Wt(), MeanIn(), RstdIn(), kAbsent, Dx(), vec(dw_, 3), Db()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dweight");
  }
  {
    // silu_and_mul: y holds one half of x's row.
    Caught e = call([&] { silu_and_mul_forward(rows(x_, 2 * W), rows(y_, 2 * W)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, want);
  }
  {
    // silu_and_mul backward: dx has x's shape, (R, 2W).
    Caught e = call([&] { silu_and_mul_backward(Dy(), rows(x_, 2 * W), Dx()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dx");
    EXPECT_CONTAINS(e, "(5, 16)");
  }
}

TEST_F(FusedErrors, DtypeMismatch) {
  {
    Caught e = call([&] { softmax_forward(X(), rows(y16_)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "fp32");
    EXPECT_CONTAINS(e, "fp16");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, vec(w16_), B(), Y(), kAbsent, Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "weight");
    EXPECT_CONTAINS(e, "fp16");
  }
  {
    // Statistics are fp32 whatever the data dtype.
    Caught e = call([&] { ln_fwd(rows(x16_), kAbsent, vec(w16_), kAbsent, rows(y16_), kAbsent, as(Mean(), DType::kF16),
                                 Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "mean");
    EXPECT_CONTAINS(e, "fp32");
  }
  {
    Caught e = call([&] { rms_norm_backward(Dy(), X(), Wt(), as(RstdIn(), DType::kBF16), kAbsent, Dx(), Dw()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "rstd");
    EXPECT_CONTAINS(e, "bf16");
  }
  {
    // fp64 data (CPU only) takes fp64 statistics, and only those; other data dtypes take only fp32.
    Caught e = call([&] { ln_fwd(rows(x64_), kAbsent, kAbsent, kAbsent, rows(y64_), kAbsent, Mean(), Rstd(),
                                 FusedVariant::kCpu); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "mean");
    EXPECT_CONTAINS(e, "expected dtype fp64");
  }
  {
    Caught e = call([&] { rms_norm_backward(rows(x64_), rows(x64_), kAbsent, RstdIn(), kAbsent, rows(y64_), kAbsent,
                                            FusedVariant::kCpu); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "rstd");
    EXPECT_CONTAINS(e, "expected dtype fp64");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, Wt(), B(), Y(), kAbsent, as(Mean(), DType::kF64), as(Rstd(), DType::kF64)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "mean");
    EXPECT_CONTAINS(e, "expected dtype fp32");
  }
  {
    Caught e = call([&] { softmax_forward(rows(x64_), rows(y16_)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "fp64");
  }
}

TEST_F(FusedErrors, UnsupportedDtype) {
  for (DType d : {DType::kI32, DType::kI64, DType::kF8E4M3}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    Caught e = call([&] { softmax_forward(as(X(), d), as(Y(), d)); });
    EXPECT_ERROR(e, Status::kUnsupported);
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, std::string(dtype_name(d)));
    EXPECT_CONTAINS(e, "bf16");  // what it takes
  }
}

TEST_F(FusedErrors, Fp64OnCudaVariants) {
  // fp64 CUDA tensors (host memory labelled CUDA; rejected before any launch).
  const Device gpu = Device::cuda(0);
  for (FusedVariant v : {FusedVariant::kAuto, FusedVariant::kCudaUnfused, FusedVariant::kCudaFusedStreaming,
                         FusedVariant::kCudaFusedRegisters}) {
    SCOPED_TRACE(std::string(fused_variant_name(v)));
    Caught e = call([&] { softmax_forward(on(rows(x64_), gpu), on(rows(y64_), gpu), 1.0f, false, v); });
    EXPECT_ERROR(e, Status::kUnsupported);
    EXPECT_CONTAINS(e, "fp64");
    EXPECT_CONTAINS(e, "cpu");  // where fp64 runs
  }
  // fp64 host tensors with a CUDA variant: the variant does not run on the CPU.
  Caught e = call([&] { softmax_forward(rows(x64_), rows(y64_), 1.0f, false, FusedVariant::kCudaUnfused); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "variant");
}

TEST_F(FusedErrors, NonUnitLastStride) {
  {
    Caught e = call([&] { softmax_forward(raw(x_.data(), DType::kF32, Device::cpu(), {R, W}, {2 * W, 2}), Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, "unit stride");
  }
  {
    Caught e = call([&] { softmax_backward(X(), raw(dy_.data(), DType::kF32, Device::cpu(), {R, W}, {W, 3}), Dx()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dy");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, raw(w_.data(), DType::kF32, Device::cpu(), {W}, {2}), B(), Y(), kAbsent,
                                 Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "weight");
    EXPECT_CONTAINS(e, "contiguous");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, Wt(), B(), Y(), kAbsent, raw(mean_.data(), DType::kF32, Device::cpu(), {R}, {2}),
                                 Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "mean");
    EXPECT_CONTAINS(e, "contiguous");
  }
}

TEST_F(FusedErrors, RowStrideBelowWidth) {
  {
    Caught e = call([&] { softmax_forward(raw(x_.data(), DType::kF32, Device::cpu(), {R, W}, {W - 1, 1}), Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, "stride");
    EXPECT_CONTAINS(e, std::to_string(W));
    EXPECT_CONTAINS(e, std::to_string(W - 1));
  }
  {
    Caught e = call([&] { rms_norm_forward(X(), kAbsent, Wt(), 1e-5f, raw(y_.data(), DType::kF32, Device::cpu(), {R, W}, {3, 1}),
                                           kAbsent, Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
  }
  {
    // silu_and_mul's x rows hold 2W elements: a stride of W + 1 is too short.
    Caught e = call([&] { silu_and_mul_forward(raw(x_.data(), DType::kF32, Device::cpu(), {R, 2 * W}, {W + 1, 1}), Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, std::to_string(2 * W));
  }
}

TEST_F(FusedErrors, ZeroWidthOrNegativeRows) {
  {
    Caught e = call([&] { softmax_forward(raw(x_.data(), DType::kF32, Device::cpu(), {R, 0}, {1, 1}), Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, "width");
  }
  {
    Caught e = call([&] { softmax_forward(raw(x_.data(), DType::kF32, Device::cpu(), {-1, W}, {W, 1}), Y()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "x");
  }
}

TEST_F(FusedErrors, Misaligned) {
  TensorView x = X();
  x.data = static_cast<char*>(x.data) + 1;  // not on a 4-byte boundary
  Caught e = call([&] { softmax_forward(x, Y()); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "x");
  EXPECT_CONTAINS(e, "aligned");
}

TEST_F(FusedErrors, DeviceMismatch) {
  // Host memory labelled CUDA is never touched: the mismatch is found first.
  {
    Caught e = call([&] { softmax_forward(X(), on(Y(), Device::cuda(0))); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "cpu");
    EXPECT_CONTAINS(e, "cuda:0");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, on(Wt(), Device::cuda(0)), B(), Y(), kAbsent, Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "weight");
    EXPECT_CONTAINS(e, "cuda:0");
  }
  {
    const Device d0 = Device::cuda(0), d1 = Device::cuda(1);
    Caught e = call([&] { rms_norm_forward(on(X(), d0), kAbsent, on(Wt(), d0), 1e-5f, on(Y(), d0), kAbsent, on(Rstd(), d1)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "rstd");
    EXPECT_CONTAINS(e, "cuda:1");
  }
}

TEST_F(FusedErrors, CpuVariantOnCudaTensors) {
  const Device gpu = Device::cuda(0);
  Caught e = call([&] { softmax_forward(on(X(), gpu), on(Y(), gpu), 1.0f, false, FusedVariant::kCpu); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "variant");
  EXPECT_CONTAINS(e, "cuda:0");
}

TEST_F(FusedErrors, CudaVariantOnCpuTensors) {
  for (FusedVariant v : {FusedVariant::kCudaUnfused, FusedVariant::kCudaFusedStreaming, FusedVariant::kCudaFusedRegisters}) {
    SCOPED_TRACE(std::string(fused_variant_name(v)));
    Caught e = call([&] { rms_norm_forward(X(), kAbsent, Wt(), 1e-5f, Y(), kAbsent, Rstd(), v); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "variant");
    EXPECT_CONTAINS(e, std::string(fused_variant_name(v)));
    EXPECT_CONTAINS(e, "cpu");
  }
}

TEST_F(FusedErrors, OutputOverlapsInput) {
  {
    // y one element past x: a partial overlap (in place is only the very same view).
    Caught e = call([&] { softmax_forward(X(), shifted(rows(x_), 1)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_MENTIONS(e, "x");
    EXPECT_CONTAINS(e, "overlap");
  }
  {
    // Same start, another row stride: not the same view.
    Caught e = call([&] { softmax_forward(X(), raw(x_.data(), DType::kF32, Device::cpu(), {R, W}, {W + 1, 1})); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "overlap");
  }
  {
    // dx over h in the norm backward.
    Caught e = call([&] { layer_norm_backward(Dy(), X(), Wt(), MeanIn(), RstdIn(), kAbsent, shifted(rows(x_), W), Dw(), Db()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dx");
    EXPECT_MENTIONS(e, "h");
  }
  {
    // dweight over weight.
    Caught e = call([&] { rms_norm_backward(Dy(), X(), Wt(), RstdIn(), kAbsent, Dx(), shifted(Wt(), 2)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dweight");
    EXPECT_MENTIONS(e, "weight");
  }
  {
    // silu_and_mul's y inside x's second half.
    Caught e = call([&] { silu_and_mul_forward(rows(x_, 2 * W), raw(static_cast<float*>(x_.data()) + W, DType::kF32,
                                                                      Device::cpu(), {R, W}, {2 * W, 1})); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "overlap");
  }
}

TEST_F(FusedErrors, OutputsOverlapEachOther) {
  {
    Caught e = call([&] { ln_fwd(X(), Res(), Wt(), B(), Y(), shifted(Y(), 3), Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "residual_out");
    EXPECT_MENTIONS(e, "y");
    EXPECT_CONTAINS(e, "overlap");
  }
  {
    Caught e = call([&] { ln_fwd(X(), kAbsent, Wt(), B(), Y(), kAbsent, Mean(), shifted(Mean(), 2)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "mean");
    EXPECT_MENTIONS(e, "rstd");
  }
  {
    Caught e = call([&] { layer_norm_backward(Dy(), X(), Wt(), MeanIn(), RstdIn(), kAbsent, Dx(), Dw(), Dw()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "dweight");
    EXPECT_MENTIONS(e, "dbias");
  }
}

TEST_F(FusedErrors, SiluOddWidth) {
  Caught e = call([&] { silu_and_mul_forward(rows(x_, 7), rows(y_, 3)); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "x");
  EXPECT_CONTAINS(e, "even");
  EXPECT_CONTAINS(e, "7");
  Caught b = call([&] { silu_and_mul_backward(rows(dy_, 3), rows(x_, 7), rows(dx_, 7)); });
  EXPECT_ERROR(b, Status::kInvalidArgument);
  EXPECT_MENTIONS(b, "x");
}

TEST_F(FusedErrors, EpsInvalid) {
  for (float eps : {-1.0f, std::nanf("")}) {
    Caught e = call([&] { ln_fwd(X(), kAbsent, Wt(), B(), Y(), kAbsent, Mean(), Rstd(), FusedVariant::kAuto, eps); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "eps");
    Caught r = call([&] { rms_norm_forward(X(), kAbsent, Wt(), eps, Y(), kAbsent, Rstd()); });
    EXPECT_ERROR(r, Status::kInvalidArgument);
    EXPECT_MENTIONS(r, "eps");
  }
}

TEST_F(FusedErrors, ResidualAndResidualOutGoTogether) {
  {
    Caught e = call([&] { ln_fwd(X(), Res(), Wt(), B(), Y(), kAbsent, Mean(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "residual_out");
    EXPECT_CONTAINS(e, "absent");
  }
  {
    Caught e = call([&] { rms_norm_forward(X(), kAbsent, Wt(), 1e-5f, Y(), RO(), Rstd()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "residual_out");
  }
}

TEST_F(FusedErrors, Fp64DataTakesFp64Statistics) {
  check_untouched_ = false;
  const TensorView m64 = as(Mean(), DType::kF64), r64 = as(Rstd(), DType::kF64);
  EXPECT_NO_THROW(ln_fwd(rows(x64_), kAbsent, kAbsent, kAbsent, rows(y64_), kAbsent, m64, r64, FusedVariant::kCpu));
  EXPECT_NO_THROW(layer_norm_backward(rows(x64_), rows(x64_), kAbsent, m64, r64, kAbsent, rows(y64_), kAbsent,
                                      kAbsent, FusedVariant::kCpu));
  EXPECT_NO_THROW(rms_norm_forward(rows(x64_), kAbsent, kAbsent, 1e-6, rows(y64_), kAbsent, r64, FusedVariant::kCpu));
  Caught e = call([&] { rms_norm_backward(rows(x64_), rows(x64_), kAbsent, kAbsent, kAbsent, rows(y64_), kAbsent,
                                          FusedVariant::kCpu); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "rstd");
  EXPECT_CONTAINS(e, "fp64 (rows)");
}

TEST_F(FusedErrors, BackwardNeedsSavedStatistics) {
  {
    Caught e = call([&] { layer_norm_backward(Dy(), X(), Wt(), kAbsent, RstdIn(), kAbsent, Dx(), Dw(), Db()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "mean");
    EXPECT_CONTAINS(e, "absent");
  }
  {
    Caught e = call([&] { layer_norm_backward(Dy(), X(), Wt(), MeanIn(), kAbsent, kAbsent, Dx(), Dw(), Db()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "rstd");
  }
  {
    Caught e = call([&] { rms_norm_backward(Dy(), X(), Wt(), kAbsent, Dres(), Dx(), Dw()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "rstd");
  }
}

TEST_F(FusedErrors, DweightWithoutWeight) {
  Caught e = call([&] { rms_norm_backward(Dy(), X(), kAbsent, RstdIn(), kAbsent, Dx(), Dw()); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "dweight");
  EXPECT_MENTIONS(e, "weight");
}

// The registers design holds rows up to fused_registers_max_width(); longer ones are kUnsupported
// with the limit, the width and the way out named. CUDA tensors: real device memory where a GPU
// is present (nothing is launched either way), host memory labelled CUDA where none is.
TEST_F(FusedErrors, RegistersOnTooLongRows) {
  const bool gpu = cuda_device_count() > 0;
  const Device dev = Device::cuda(0);
  for (DType d : {DType::kF32, DType::kBF16}) {
    for (bool aligned : {true, false}) {
      const int64_t max_fwd = fused_registers_max_width(FusedOp::kRmsNorm, d, false, aligned);
      ASSERT_GT(max_fwd, 0);
      // Aligned: the next multiple of 8 elements past the limit; unaligned: an odd width.
      const int64_t width = aligned ? max_fwd + 8 : (max_fwd + 1) | 1;
      SCOPED_TRACE(std::string(dtype_name(d)) + (aligned ? " aligned" : " unaligned") + " width " + std::to_string(width));
      Buffer x(d, width, gpu ? dev : Device::cpu()), y(d, width, gpu ? dev : Device::cpu()),
          w(d, width, gpu ? dev : Device::cpu());
      auto view = [&](const Buffer& b) { return raw(b.data(), d, dev, {1, width}, {width, 1}); };
      Caught e = call([&] {
        rms_norm_forward(view(x), kAbsent, raw(w.data(), d, dev, {width}, {1}), 1e-5f, view(y), kAbsent, kAbsent,
                         FusedVariant::kCudaFusedRegisters);
      });
      EXPECT_ERROR(e, Status::kUnsupported);
      EXPECT_CONTAINS(e, "fused_registers");
      EXPECT_CONTAINS(e, std::to_string(width));
      EXPECT_CONTAINS(e, std::to_string(max_fwd));
      EXPECT_CONTAINS(e, "fused_streaming");  // the way out
      // kAuto takes the streaming design instead (not run here: resolve only).
      EXPECT_EQ(resolve_fused_variant(FusedOp::kRmsNorm, d, dev, width, false, aligned), FusedVariant::kCudaFusedStreaming);
    }
  }
}

// Shapes and strides whose element count, offsets or byte span overflow int64 are refused before
// anything is computed from them (the overlap check, the kernels' row offsets), naming the operand.
TEST_F(FusedErrors, ExtentsThatOverflowInt64) {
  const int64_t big = int64_t{1} << 40;
  struct Bad {
    std::vector<int64_t> shape, strides;
    const char* what;
  };
  for (const Bad& b : {Bad{{big, big}, {big, 1}, "2^80 elements"},       // and offsets past int64
                       Bad{{4, W}, {int64_t{1} << 62, 1}, "offsets"},       // row 3 at 3 * 2^62: past int64
                       Bad{{2, W}, {int64_t{1} << 61, 1}, "byte span"}}) { // 2^61 + 8 fp32 elements: 2^63 + 32 bytes
    SCOPED_TRACE(b.what);
    const TensorView bad_x = raw(x_.data(), DType::kF32, Device::cpu(), b.shape, b.strides);
    Caught first = call([&] { softmax_forward(bad_x, Y()); });  // the first operand
    EXPECT_ERROR(first, Status::kInvalidArgument);
    EXPECT_MENTIONS(first, "x");
    EXPECT_CONTAINS(first, "int64");
    EXPECT_CONTAINS(first, std::to_string(b.strides[0]));  // what was given
    if (b.shape[0] == big) continue;  // no valid first operand has this shape
    // A later input (dy) and an output (y), next to a valid x of the same shape.
    const TensorView x = raw(x_.data(), DType::kF32, Device::cpu(), b.shape, {W, 1});
    const TensorView dx = raw(dx_.data(), DType::kF32, Device::cpu(), b.shape, {W, 1});
    Caught in = call([&] { softmax_backward(x, raw(dy_.data(), DType::kF32, Device::cpu(), b.shape, b.strides), dx); });
    EXPECT_ERROR(in, Status::kInvalidArgument);
    EXPECT_MENTIONS(in, "dy");
    EXPECT_CONTAINS(in, "int64");
    Caught out = call([&] { softmax_forward(x, raw(y_.data(), DType::kF32, Device::cpu(), b.shape, b.strides)); });
    EXPECT_ERROR(out, Status::kInvalidArgument);
    EXPECT_MENTIONS(out, "y");
    EXPECT_CONTAINS(out, "int64");
  }
}

TEST_F(FusedErrors, CudaTensorsWithoutCuda) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  // Host memory labelled CUDA, valid shapes: no usable CUDA here. The status is kUnsupported or,
  // where the library asks the runtime, kCudaError; either way with a reason.
  const Device gpu = Device::cuda(0);
  for (FusedVariant v : {FusedVariant::kAuto, FusedVariant::kCudaUnfused, FusedVariant::kCudaFusedStreaming}) {
    SCOPED_TRACE(std::string(fused_variant_name(v)));
    Caught e = call([&] { softmax_forward(on(X(), gpu), on(Y(), gpu), 1.0f, false, v); });
    ASSERT_TRUE(e.thrown);
    EXPECT_TRUE(e.status == Status::kUnsupported || e.status == Status::kCudaError)
        << status_name(e.status) << ": " << e.message;
    EXPECT_GT(e.message.size(), 20u) << "a reason, not just a word: " << e.message;
  }
}

// ---- names, lists, the variant choice -----------------------------------------------------------

TEST(FusedNames, Variants) {
  const std::vector<FusedVariant> expected = {FusedVariant::kCpu, FusedVariant::kCudaUnfused,
                                              FusedVariant::kCudaFusedStreaming, FusedVariant::kCudaFusedRegisters};
  const auto all = all_fused_variants();
  ASSERT_EQ(std::vector<FusedVariant>(all.begin(), all.end()), expected);
  EXPECT_EQ(fused_variant_name(FusedVariant::kAuto), "auto");
  EXPECT_EQ(parse_fused_variant("auto"), FusedVariant::kAuto);
  EXPECT_EQ(fused_variant_name(FusedVariant::kCpu), "cpu");
  EXPECT_EQ(fused_variant_name(FusedVariant::kCudaUnfused), "unfused");
  EXPECT_EQ(fused_variant_name(FusedVariant::kCudaFusedStreaming), "fused_streaming");
  EXPECT_EQ(fused_variant_name(FusedVariant::kCudaFusedRegisters), "fused_registers");
  for (FusedVariant v : all) {
    EXPECT_EQ(parse_fused_variant(fused_variant_name(v)), v);
    EXPECT_EQ(fused_variant_is_cuda(v), v != FusedVariant::kCpu) << fused_variant_name(v);
  }
  EXPECT_FALSE(fused_variant_is_cuda(FusedVariant::kAuto));
}

TEST(FusedNames, UnknownVariantName) {
  Caught e = call([] { parse_fused_variant("fastest"); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "variant");
  EXPECT_CONTAINS(e, "'fastest'");
  for (const char* choice : {"auto", "cpu", "unfused", "fused_streaming", "fused_registers"}) EXPECT_MENTIONS(e, choice);
}

TEST(FusedNames, Ops) {
  const std::vector<std::string> expected = {"softmax",        "log_softmax",  "layer_norm", "rms_norm",
                                             "add_layer_norm", "add_rms_norm", "bias_gelu",  "silu_and_mul"};
  std::vector<std::string> names;
  for (FusedOp op : all_fused_ops()) {
    names.emplace_back(fused_op_name(op));
    EXPECT_EQ(parse_fused_op(fused_op_name(op)), op);
  }
  EXPECT_EQ(names, expected);
  Caught e = call([] { parse_fused_op("gelu"); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "op");
  EXPECT_CONTAINS(e, "'gelu'");
  EXPECT_MENTIONS(e, "bias_gelu");
}

TEST(FusedNames, ResolveRefusesNegativeWidths) {
  for (Device d : {Device::cuda(0), Device::cpu()}) {
    for (int64_t width : {int64_t{-5}, int64_t{-1}, INT64_MIN}) {
      SCOPED_TRACE(device_name(d) + " width " + std::to_string(width));
      Caught e = call([&] { resolve_fused_variant(FusedOp::kSoftmax, DType::kF32, d, width, false); });
      EXPECT_ERROR(e, Status::kInvalidArgument);
      EXPECT_MENTIONS(e, "width");
      EXPECT_CONTAINS(e, ">= 0");
      EXPECT_CONTAINS(e, std::to_string(width));
    }
  }
  // A width of 0 (an empty row: nothing to run) is still answered.
  EXPECT_EQ(resolve_fused_variant(FusedOp::kSoftmax, DType::kF32, Device::cpu(), 0, false), FusedVariant::kCpu);
  EXPECT_NO_THROW(resolve_fused_variant(FusedOp::kRmsNorm, DType::kBF16, Device::cuda(0), 0, true));
}

TEST(FusedNames, ResolveRefusesUnsupportedDevices) {
  {
    Device other;
    other.type = static_cast<DeviceType>(7);  // neither kCpu nor kCuda (e.g. a value from C)
    Caught e = call([&] { resolve_fused_variant(FusedOp::kLayerNorm, DType::kF32, other, 1024, false); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "device");
    EXPECT_MENTIONS(e, "cpu");
    EXPECT_MENTIONS(e, "cuda");
    EXPECT_CONTAINS(e, "7");
  }
  {
    Caught e = call([&] { resolve_fused_variant(FusedOp::kLayerNorm, DType::kF32, Device::cuda(-1), 1024, false); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "device");
    EXPECT_CONTAINS(e, "cuda:-1");
  }
}

TEST(FusedNames, ResolveRefusesDtypesTheDeviceDoesNotRun) {
  for (DType d : {DType::kI32, DType::kI64, DType::kF8E4M3}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    Caught e = call([&] { resolve_fused_variant(FusedOp::kSoftmax, d, Device::cuda(0), 1024, false); });
    EXPECT_ERROR(e, Status::kUnsupported);
    EXPECT_MENTIONS(e, "dtype");
    EXPECT_CONTAINS(e, std::string(dtype_name(d)));
    EXPECT_CONTAINS(e, "bf16");  // what it takes
  }
  // fp64 runs on the cpu variant only: no CUDA design to name.
  Caught e = call([&] { resolve_fused_variant(FusedOp::kLayerNorm, DType::kF64, Device::cuda(0), 1024, false); });
  EXPECT_ERROR(e, Status::kUnsupported);
  EXPECT_MENTIONS(e, "dtype");
  EXPECT_MENTIONS(e, "fp64");
  EXPECT_MENTIONS(e, "cpu");
  EXPECT_EQ(resolve_fused_variant(FusedOp::kLayerNorm, DType::kF64, Device::cpu(), 1024, false), FusedVariant::kCpu);
}

TEST(FusedNames, RegistersWidthAndAuto) {
  for (FusedOp op : all_fused_ops()) {
    SCOPED_TRACE(std::string(fused_op_name(op)));
    const bool reduces = op != FusedOp::kBiasGelu && op != FusedOp::kSiluAndMul;
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (bool backward : {false, true}) {
        const int64_t aligned = fused_registers_max_width(op, d, backward, true);
        const int64_t unaligned = fused_registers_max_width(op, d, backward, false);
        if (!reduces) {
          EXPECT_EQ(aligned, 0);
          EXPECT_EQ(resolve_fused_variant(op, d, Device::cuda(0), 1 << 20, backward), FusedVariant::kCudaFusedRegisters);
          continue;
        }
        EXPECT_GE(aligned, 1024) << "the registers design should hold the common row sizes";
        EXPECT_GE(aligned, unaligned);
        EXPECT_GT(unaligned, 0);
        EXPECT_EQ(resolve_fused_variant(op, d, Device::cuda(0), 1024, backward, true), FusedVariant::kCudaFusedRegisters);
        EXPECT_EQ(resolve_fused_variant(op, d, Device::cuda(0), aligned + 1, backward, true),
                  FusedVariant::kCudaFusedStreaming);
      }
      EXPECT_EQ(resolve_fused_variant(op, d, Device::cpu(), 4096, false), FusedVariant::kCpu);
    }
  }
}

}  // namespace
}  // namespace optimized
