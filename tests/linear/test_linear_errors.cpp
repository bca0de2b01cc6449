// Error paths of the linear family's public API (src/linear/linear.cpp): each asserts the status
// and that the message names the argument. Views "on cuda:0" over host memory reach the checks that
// come before any device work. Decided here: an activation with pre absent recomputes pre from
// input, weight and bias, and an absent bias then means the forward had none (not an error); pre
// or bias given without an activation are checked but not read.
#include <gtest/gtest.h>

#include "linear_test_util.h"

namespace optimized::testing {
namespace {

class LinearErrors : public ::testing::Test {
 protected:
  std::mt19937_64 rng = test_rng();
  LinearCase c = [] {
    LinearCase x;
    x.lead = {2, 3}, x.k = 5, x.n = 7, x.act = Activation::kGeluErf;
    return x;
  }();
  LinearData d{c, rng};
  Device cpu = Device::cpu();
  TensorView x = d.xv(d.x.data(), cpu), w = d.wv(d.w.data(), cpu), b = d.bv(d.b.data(), cpu, c.dtype);
  TensorView y = d.yv(d.y.data(), cpu), pre = d.yv(d.pre.data(), cpu), dy = d.dyv(d.dy.data(), cpu);
  TensorView gi = d.giv(d.gi.data(), cpu), gw = d.gwv(d.gw.data(), cpu), gb = d.bv(d.gb.data(), cpu, c.dtype);

  Caught fwd(TensorView x_, TensorView w_, TensorView b_, TensorView y_, TensorView p_,
             LinearVariant v = LinearVariant::kAuto, Activation a = Activation::kGeluErf) {
    return call([&] { linear_forward(x_, w_, b_, y_, p_, a, v); });
  }
  Caught fwd_default() { return fwd(x, w, b, y, pre); }
  Caught bwd(TensorView gi_, TensorView gw_, TensorView gb_, TensorView dy_, TensorView x_, TensorView w_,
             TensorView p_, TensorView b_, LinearVariant v = LinearVariant::kAuto, Activation a = Activation::kGeluErf) {
    LinearBackwardOptions o;
    o.activation = a;
    return call([&] { linear_backward(gi_, gw_, gb_, dy_, x_, w_, p_, b_, o, v); });
  }
  Caught bwd_default() { return bwd(gi, gw, gb, dy, x, w, pre, b); }
};

TEST_F(LinearErrors, ValidCallsPass) {
  EXPECT_FALSE(fwd_default().thrown);
  EXPECT_FALSE(bwd_default().thrown);
  EXPECT_FALSE(bwd(gi, gw, gb, dy, x, w, {}, b).thrown);  // recomputed
  EXPECT_FALSE(bwd(gi, gw, gb, dy, x, w, {}, {}).thrown);  // recomputed without a bias: the forward had none
  EXPECT_FALSE(bwd({}, {}, {}, dy, x, w, {}, {}).thrown);  // nothing asked
}

TEST_F(LinearErrors, Variants) {
  EXPECT_EQ(parse_linear_variant("auto"), LinearVariant::kAuto);
  for (LinearVariant v : all_linear_variants()) EXPECT_EQ(parse_linear_variant(linear_variant_name(v)), v);
  ASSERT_EQ(all_linear_variants().size(), 4u);
  EXPECT_EQ(linear_variant_name(all_linear_variants()[0]), "cpu");
  EXPECT_EQ(linear_variant_name(all_linear_variants()[3]), "persistent");
  EXPECT_FALSE(linear_variant_is_cuda(LinearVariant::kCpu));
  EXPECT_TRUE(linear_variant_is_cuda(LinearVariant::kPersistent));
  EXPECT_TRUE(linear_variant_rejects_dtype(LinearVariant::kCpu, DType::kF64).empty());
  EXPECT_FALSE(linear_variant_rejects_dtype(LinearVariant::kFused, DType::kF32).empty());
  EXPECT_FALSE(linear_variant_rejects_dtype(LinearVariant::kNaive, DType::kF64).empty());
  EXPECT_TRUE(linear_variant_rejects_dtype(LinearVariant::kAuto, DType::kBF16).empty());
  Caught r = call([] { parse_linear_variant("fastest"); });
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "variant");
  EXPECT_TRUE(contains_all(r.message, {"cpu", "naive", "fused", "persistent", "fastest"}));
  r = fwd(x, w, b, y, pre, static_cast<LinearVariant>(17));
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "variant");
  r = bwd(gi, gw, gb, dy, x, w, pre, b, static_cast<LinearVariant>(17));
  EXPECT_MENTIONS(r, "variant");
  // A CUDA variant with CPU tensors.
  r = fwd(x, w, b, y, pre, LinearVariant::kNaive);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "variant");
  r = bwd_default();
  EXPECT_FALSE(r.thrown);
  // fused takes fp16 / bf16 only.
  r = fwd(on(x, Device::cuda(0)), on(w, Device::cuda(0)), on(b, Device::cuda(0)), on(y, Device::cuda(0)),
          on(pre, Device::cuda(0)), LinearVariant::kFused);
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "variant");
  EXPECT_CONTAINS(r, "fp32");
  r = call([&] { linear_forward(x, w, b, y, pre, static_cast<Activation>(9)); });
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "activation");
}

TEST_F(LinearErrors, ForwardShapes) {
  Caught r = fwd({}, w, b, y, pre);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "x");
  TensorView t = w;
  t.shape[1] = 4;
  r = fwd(x, t, b, y, pre);
  EXPECT_MENTIONS(r, "weight");
  r = fwd(x, raw(d.w.data(), c.dtype, cpu, {7, 5, 1}, {5, 1, 1}), b, y, pre);
  EXPECT_MENTIONS(r, "weight");
  r = fwd(x, raw(d.w.data(), c.dtype, cpu, {7, 5}, {1, 7}), b, y, pre);  // column-major
  EXPECT_MENTIONS(r, "weight");
  EXPECT_CONTAINS(r, "row-major");
  r = fwd(x, w, raw(d.b.data(), c.dtype, cpu, {6}, {1}), y, pre);
  EXPECT_MENTIONS(r, "bias");
  r = fwd(x, w, raw(d.b.data(), c.dtype, cpu, {3}, {2}), y, pre);
  EXPECT_MENTIONS(r, "bias");
  r = fwd(x, w, b, raw(d.y.data(), c.dtype, cpu, {6, 7}, {7, 1}), pre);
  EXPECT_MENTIONS(r, "y");
  r = fwd(x, w, b, {}, pre);
  EXPECT_MENTIONS(r, "y");
  r = fwd(x, w, b, y, raw(d.pre.data(), c.dtype, cpu, {2, 3, 6}, {18, 6, 1}));
  EXPECT_MENTIONS(r, "pre");
  // Rows that do not flatten uniformly: dimension 0's stride is not 3 rows.
  r = fwd(raw(d.x.data(), c.dtype, cpu, {2, 3, 5}, {16, 5, 1}), w, b, y, pre);
  EXPECT_MENTIONS(r, "x");
  EXPECT_CONTAINS(r, "uniformly strided rows");
  r = fwd(raw(d.x.data(), c.dtype, cpu, {2, 3, 5}, {15, 5, 2}), w, b, y, pre);
  EXPECT_MENTIONS(r, "x");
  EXPECT_CONTAINS(r, "unit stride");
  r = fwd(raw(d.x.data(), c.dtype, cpu, {2, 3, 5}, {12, 4, 1}), w, b, y, pre);  // rows overlap
  EXPECT_MENTIONS(r, "x");
  r = fwd(raw(d.x.data(), c.dtype, cpu, {2, 3, 0}, {0, 0, 1}), raw(d.w.data(), c.dtype, cpu, {7, 0}, {1, 1}), b, y, pre);
  EXPECT_MENTIONS(r, "x");
  EXPECT_CONTAINS(r, ">= 1");
  r = fwd(x, raw(d.w.data(), c.dtype, cpu, {0, 5}, {5, 1}), b, y, pre);
  EXPECT_MENTIONS(r, "weight");
  r = fwd(x, w, b, raw(d.y.data(), c.dtype, cpu, {2, 3, 7}, {0, 7, 1}), pre);  // elements alias
  EXPECT_MENTIONS(r, "y");
}

TEST_F(LinearErrors, WeightShapeMessage) {
  TensorView t = w;
  t.shape[1] = 4;
  const Caught r = fwd(x, t, b, y, pre);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_TRUE(contains_all(r.message, {"weight", "(N, 5)", "(7, 4)"}));
}

TEST_F(LinearErrors, DtypesAndDevices) {
  Caught r = fwd(x, as(w, DType::kF16), b, y, pre);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "weight");
  r = fwd(x, w, as(b, DType::kF64), y, pre);
  EXPECT_MENTIONS(r, "bias");
  r = fwd(x, w, b, as(y, DType::kBF16), pre);
  EXPECT_MENTIONS(r, "y");
  r = fwd(x, w, b, y, as(pre, DType::kF16));
  EXPECT_MENTIONS(r, "pre");
  r = fwd(as(x, DType::kI32), as(w, DType::kI32), as(b, DType::kI32), as(y, DType::kI32), as(pre, DType::kI32));
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "x");
  r = fwd(x, on(w, Device::cuda(0)), b, y, pre);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "weight");
  r = bwd(gi, gw, on(gb, Device::cuda(0)), dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_bias");
  // fp64 on CUDA (auto): only the cpu variant runs it.
  auto cu = [](TensorView t) { return on(as(t, DType::kF64), Device::cuda(0)); };
  r = fwd(cu(x), cu(w), cu(b), cu(y), cu(pre));
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "x");
  EXPECT_CONTAINS(r, "cpu");
  // Gradients: the dtype or fp32 for 16-bit inputs; fp32 inputs take fp32 only.
  r = bwd(gi, as(gw, DType::kF16), gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_weight");
  r = bwd(gi, gw, as(gb, DType::kBF16), dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_bias");
  r = bwd(as(gi, DType::kF16), gw, gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_input");
  r = bwd(gi, gw, gb, as(dy, DType::kF64), x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_output");
}

TEST_F(LinearErrors, BackwardShapes) {
  Caught r = bwd(gi, gw, gb, raw(d.dy.data(), c.dtype, cpu, {2, 3, 6}, {18, 6, 1}), x, w, pre, b);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "grad_output");
  r = bwd(raw(d.gi.data(), c.dtype, cpu, {6, 5}, {5, 1}), gw, gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_input");
  r = bwd(gi, raw(d.gw.data(), c.dtype, cpu, {7, 4}, {4, 1}), gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_weight");
  r = bwd(gi, raw(d.gw.data(), c.dtype, cpu, {6, 5}, {5, 1}), gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_weight");
  r = bwd(gi, raw(d.gw.data(), c.dtype, cpu, {7, 5}, {1, 7}), gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_weight");
  r = bwd(gi, gw, raw(d.gb.data(), c.dtype, cpu, {8}, {1}), dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_bias");
  r = bwd(gi, gw, gb, dy, x, w, raw(d.pre.data(), c.dtype, cpu, {6, 7}, {7, 1}), b);
  EXPECT_MENTIONS(r, "pre");
  r = bwd(gi, gw, gb, dy, x, w, pre, raw(d.b.data(), c.dtype, cpu, {5}, {1}));
  EXPECT_MENTIONS(r, "bias");
  r = bwd(gi, gw, gb, dy, {}, w, pre, b);
  EXPECT_MENTIONS(r, "input");
}

TEST_F(LinearErrors, OutputsMayNotOverlap) {
  // y over x's storage.
  Caught r = fwd(x, w, b, d.yv(d.x.data(), cpu), pre);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "y");
  EXPECT_MENTIONS(r, "x");
  r = fwd(x, w, b, y, d.yv(d.y.data(), cpu));  // pre = y
  EXPECT_MENTIONS(r, "pre");
  r = fwd(x, w, b, y, raw(d.w.data(), c.dtype, cpu, {2, 3, 7}, {0, 0, 0}));
  EXPECT_MENTIONS(r, "pre");
  r = bwd(gi, gw, gb, dy, x, w, pre, b);
  EXPECT_FALSE(r.thrown);
  r = bwd(d.giv(d.dy.data(), cpu), gw, gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_input");
  EXPECT_MENTIONS(r, "grad_output");
  r = bwd(gi, d.gwv(d.w.data(), cpu), gb, dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_weight");
  EXPECT_MENTIONS(r, "weight");
  r = bwd(gi, gw, d.bv(d.b.data(), cpu, c.dtype), dy, x, w, pre, b);
  EXPECT_MENTIONS(r, "grad_bias");
  r = bwd(gi, gw, d.bv(d.gw.data(), cpu, c.dtype), dy, x, w, pre, b);  // grad_bias inside grad_weight
  EXPECT_MENTIONS(r, "grad_weight");
}

TEST_F(LinearErrors, NullAndMisaligned) {
  TensorView t = x;
  t.data = nullptr;
  Caught r = fwd(t, w, b, y, pre);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "x");
  TensorView mis = y;
  mis.data = static_cast<char*>(d.y.data()) + 1;
  r = fwd(x, w, b, mis, pre);
  EXPECT_MENTIONS(r, "y");
}

#if !OPTIMIZED_WITH_CUDA
TEST_F(LinearErrors, CudaTensorsInACpuBuild) {
  const Caught r = fwd(on(x, Device::cuda(0)), on(w, Device::cuda(0)), on(b, Device::cuda(0)), on(y, Device::cuda(0)),
                       on(pre, Device::cuda(0)));
  EXPECT_ERROR(r, Status::kUnsupported);
}
#else
// Without a device, CUDA tensors are refused before any launch, naming the first operand.
TEST_F(LinearErrors, CudaTensorsWithoutADevice) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  Caught r = fwd(on(x, Device::cuda(0)), on(w, Device::cuda(0)), on(b, Device::cuda(0)), on(y, Device::cuda(0)),
                 on(pre, Device::cuda(0)), LinearVariant::kNaive);
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "x");
  r = bwd(on(gi, Device::cuda(0)), on(gw, Device::cuda(0)), on(gb, Device::cuda(0)), on(dy, Device::cuda(0)),
          on(x, Device::cuda(0)), on(w, Device::cuda(0)), {}, on(b, Device::cuda(0)));
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "input");
}
#endif

// fp8: fp64 inputs and the fused variant are refused (kUnsupported) before any work, by name.
TEST_F(LinearErrors, Fp8Refusals) {
  LinearCase c64 = c;
  c64.dtype = DType::kF64;
  LinearData d64{c64, rng};
  const TensorView x64 = d64.xv(d64.x.data(), cpu), w64 = d64.wv(d64.w.data(), cpu), y64 = d64.yv(d64.y.data(), cpu);
  Caught r = call([&] { linear_forward(x64, w64, {}, y64, {}, LinearForwardOptions{Activation::kNone, true}); });
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "fp8 quantizes fp32, fp16 or bf16 inputs; given fp64");
  LinearBackwardOptions o;
  o.fp8 = true;
  r = call([&] {
    linear_backward(d64.giv(d64.gi.data(), cpu), {}, {}, d64.dyv(d64.dy.data(), cpu), x64, w64, {}, {}, o);
  });
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "input: fp8 quantizes");
  // fused names the variants that run fp8 (checked before the device: views "on cuda:0" of host memory)
  const Device gpu = Device::cuda(0);
  LinearCase ch = c;
  ch.dtype = DType::kBF16;
  LinearData dh{ch, rng};
  r = call([&] {
    linear_forward(dh.xv(dh.x.data(), gpu), dh.wv(dh.w.data(), gpu), {}, dh.yv(dh.y.data(), gpu), {},
                   LinearForwardOptions{Activation::kNone, true}, LinearVariant::kFused);
  });
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "fp8 runs on auto, cpu, naive and persistent (fused has no fp8 GEMM)");
}

}  // namespace
}  // namespace optimized::testing
