// Every error path of the public GEMM API. Each test asserts the Error's status and that the
// message names the argument and shows what was expected and/or what was given (house rule 2),
// and that a rejected call did not write C.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/core.h"
#include "optimized/gemm.h"

namespace optimized {
namespace {

using namespace optimized::testing;

// Valid operands A (7, 11), B (11, 13), C (7, 13) in host buffers with room to spare; C is filled
// with a pattern that must survive every rejected call.
class GemmErrors : public ::testing::Test {
 protected:
  static constexpr int64_t M = 7, K = 11, N = 13;
  static constexpr int64_t kRoom = 4096;  // elements per buffer

  void SetUp() override {
    for (Buffer* b : {&a_, &b_, &c_, &a16_, &b16_, &c16_}) b->fill_bytes(0);
    for (int64_t i = 0; i < kRoom; ++i) {
      store_from_double(a_.data(), DType::kF32, i, 0.25);
      store_from_double(b_.data(), DType::kF32, i, 0.5);
      store_from_double(a16_.data(), DType::kF16, i, 0.25);
      store_from_double(b16_.data(), DType::kF16, i, 0.5);
    }
    c_.fill_bytes(0x5A);
    c16_.fill_bytes(0x5A);
  }
  void TearDown() override {
    const auto* c = static_cast<const unsigned char*>(c_.data());
    const auto* c16 = static_cast<const unsigned char*>(c16_.data());
    for (size_t i = 0; i < c_.bytes(); ++i) ASSERT_EQ(c[i], 0x5A) << "a rejected call wrote C (byte " << i << ")";
    for (size_t i = 0; i < c16_.bytes(); ++i) ASSERT_EQ(c16[i], 0x5A) << "a rejected call wrote C (byte " << i << ")";
  }

  TensorView A() const { return a_.matrix(M, K, K); }
  TensorView B() const { return b_.matrix(K, N, N); }
  TensorView C() const { return c_.matrix(M, N, N); }
  TensorView A16() const { return a16_.matrix(M, K, K); }
  TensorView B16() const { return b16_.matrix(K, N, N); }
  TensorView C16() const { return c16_.matrix(M, N, N); }

  Buffer a_{DType::kF32, kRoom, Device::cpu()}, b_{DType::kF32, kRoom, Device::cpu()},
      c_{DType::kF32, kRoom, Device::cpu()};
  Buffer a16_{DType::kF16, kRoom, Device::cpu()}, b16_{DType::kF16, kRoom, Device::cpu()},
      c16_{DType::kF16, kRoom, Device::cpu()};
};

TEST_F(GemmErrors, ValidOperandsRun) {
  // The baseline every other test breaks one thing of.
  Buffer c(DType::kF32, M * N, Device::cpu());
  matmul(A(), B(), c.matrix(M, N, N));
  for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(load_as_double(c.data(), DType::kF32, i), 0.25 * 0.5 * K);
}

TEST_F(GemmErrors, NullDataPointer) {
  for (int which = 0; which < 3; ++which) {
    TensorView a = A(), b = B(), c = C();
    TensorView* t[] = {&a, &b, &c};
    t[which]->data = nullptr;
    const char* name[] = {"a", "b", "c"};
    SCOPED_TRACE(name[which]);
    Caught e = call([&] { matmul(a, b, c); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, name[which]);
    EXPECT_CONTAINS(e, "null");
  }
}

TEST_F(GemmErrors, StridesWhoseExtentOverflows) {
  // A row stride of 2^62 passes every per-dimension check (unit inner stride, ld >= cols) but its
  // extent, (rows - 1) * ld elements, overflows int64: refused, naming the operand, never read.
  const int64_t huge = int64_t{1} << 62;
  for (int which = 0; which < 3; ++which) {
    const char* name[] = {"a", "b", "c"};
    SCOPED_TRACE(name[which]);
    TensorView a = A(), b = B(), c = C();
    TensorView* t[] = {&a, &b, &c};
    t[which]->strides[0] = huge;
    Caught e = call([&] { matmul(a, b, c); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, name[which]);
  }
}

TEST_F(GemmErrors, RankNotTwoOrThree) {
  {
    Caught e = call([&] { matmul(raw(a_.data(), DType::kF32, Device::cpu(), {K}, {1}), B(), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "a");
    EXPECT_CONTAINS(e, "rank");
    EXPECT_MENTIONS(e, "1");  // given
  }
  {
    Caught e = call([&] {
      matmul(A(), raw(b_.data(), DType::kF32, Device::cpu(), {1, 1, K, N}, {K * N, K * N, N, 1}), C());
    });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "b");
    EXPECT_CONTAINS(e, "rank");
    EXPECT_MENTIONS(e, "4");
  }
  {
    Caught e = call([&] { matmul(A(), B(), raw(c_.data(), DType::kF32, Device::cpu(), {M * N}, {1})); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "rank");
  }
  {
    Caught e = call([&] { matmul(raw(a_.data(), DType::kF32, Device::cpu(), {}, {}), B(), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "a");
    EXPECT_CONTAINS(e, "rank");
  }
}

TEST_F(GemmErrors, InnerDimensionMismatch) {
  // a (7, 11) @ b (12, 13): K differs.
  Caught e = call([&] { matmul(A(), b_.matrix(K + 1, N, N), C()); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_TRUE(mentions(e.message, "a") || mentions(e.message, "b")) << e.message;
  EXPECT_MENTIONS(e, "11");  // what a has
  EXPECT_MENTIONS(e, "12");  // what b has
}

TEST_F(GemmErrors, OutputShapeMismatch) {
  {
    Caught e = call([&] { matmul(A(), B(), c_.matrix(M, N + 1, N + 1)); });  // (7, 14) for (7, 13)
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_MENTIONS(e, "13");  // expected
    EXPECT_MENTIONS(e, "14");  // given
  }
  {
    Caught e = call([&] { matmul(A(), B(), c_.matrix(M + 1, N, N)); });  // (8, 13) for (7, 13)
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_MENTIONS(e, "7");
    EXPECT_MENTIONS(e, "8");
  }
  {
    Caught e = call([&] { matmul(A(), B(), c_.matrix(N, M, M)); });  // transposed
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
  }
}

TEST_F(GemmErrors, BatchMismatch) {
  const auto a3 = [&](int64_t batch) { return a_.view({batch, M, K}); };
  const auto b3 = [&](int64_t batch) { return b_.view({batch, K, N}); };
  const auto c3 = [&](int64_t batch) { return c_.view({batch, M, N}); };
  {
    Caught e = call([&] { matmul(a3(2), B(), c3(3)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "a");
    EXPECT_MENTIONS(e, "2");
    EXPECT_MENTIONS(e, "3");
  }
  {
    Caught e = call([&] { matmul(a3(3), b3(2), c3(3)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "b");
    EXPECT_MENTIONS(e, "2");
    EXPECT_MENTIONS(e, "3");
  }
  {
    // A batched A cannot write a rank-2 C (C's batch is 1).
    Caught e = call([&] { matmul(a3(3), B(), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "a");
    EXPECT_MENTIONS(e, "3");
  }
}

TEST_F(GemmErrors, DtypeMismatch) {
  {
    Caught e = call([&] { matmul(A(), B16(), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "b");
    EXPECT_CONTAINS(e, "fp32");  // expected (a's)
    EXPECT_CONTAINS(e, "fp16");  // given
  }
  {
    // fp16 operands take an fp16 or fp32 C (the latter on the rungs that fuse epilogues); not bf16.
    TensorView c = C();
    c.dtype = DType::kBF16;
    Caught e = call([&] { matmul(A16(), B16(), c); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "fp16 (same as a) or fp32");
    EXPECT_CONTAINS(e, "bf16");
  }
  {
    // fp32 operands: only an fp32 C.
    Caught e = call([&] { matmul(A(), B(), C16()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "expected dtype fp32 (same as a); given fp16");
  }
  {
    TensorView bf = B16();
    bf.dtype = DType::kBF16;
    Caught e = call([&] { matmul(A16(), bf, C16()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "b");
    EXPECT_CONTAINS(e, "bf16");
  }
}

TEST_F(GemmErrors, Fp64OnlyOnThePlainCpuRungs) {
  TensorView a = A(), b = B(), c = C();  // labels only: every call below is rejected before running
  a.dtype = b.dtype = c.dtype = DType::kF64;
  Caught e = call([&] { matmul(a, b, c, 1.0f, 0.0f, GemmVariant::kCpuPacked); });
  EXPECT_ERROR(e, Status::kUnsupported);
  EXPECT_MENTIONS(e, "variant");
  EXPECT_CONTAINS(e, "fp64");
  EXPECT_CONTAINS(e, "cpu_blocked");
}

TEST_F(GemmErrors, UnsupportedDtype) {
  for (DType d : {DType::kI32, DType::kF8E4M3, DType::kI64}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    TensorView a = A(), b = B(), c = C();
    a.dtype = b.dtype = c.dtype = d;
    Caught e = call([&] { matmul(a, b, c); });
    EXPECT_ERROR(e, Status::kUnsupported);
    EXPECT_TRUE(mentions(e.message, "a") || mentions(e.message, "dtype")) << e.message;
    EXPECT_CONTAINS(e, std::string(dtype_name(d)));  // given
    EXPECT_CONTAINS(e, "fp32");                     // expected
    EXPECT_CONTAINS(e, "bf16");
  }
}

TEST_F(GemmErrors, NonUnitInnerStride) {
  {
    Caught e = call([&] { matmul(raw(a_.data(), DType::kF32, Device::cpu(), {M, K}, {2 * K, 2}), B(), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "a");
    EXPECT_CONTAINS(e, "stride");
  }
  {
    // Unit stride along the rows, but columns closer together than a column's length: neither
    // row- nor column-major.
    Caught e = call([&] { matmul(A(), raw(b_.data(), DType::kF32, Device::cpu(), {K, N}, {1, K - 1}), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "b");
    EXPECT_CONTAINS(e, "stride");
  }
  {
    Caught e = call([&] {
      matmul(A(), B(), raw(c_.data(), DType::kF32, Device::cpu(), {2, M, N}, {M * N * 2, N * 2, 2}));
    });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "stride");
  }
}

TEST_F(GemmErrors, LeadingDimensionSmallerThanWidth) {
  {
    Caught e = call([&] { matmul(a_.matrix(M, K, K - 1), B(), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "a");
    EXPECT_MENTIONS(e, "11");  // expected >= K
    EXPECT_MENTIONS(e, "10");  // given
  }
  {
    Caught e = call([&] { matmul(A(), b_.matrix(K, N, 5), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "b");
    EXPECT_MENTIONS(e, "13");
    EXPECT_MENTIONS(e, "5");
  }
  {
    Caught e = call([&] { matmul(A(), B(), c_.matrix(M, N, N - 1)); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_MENTIONS(e, "13");
    EXPECT_MENTIONS(e, "12");
  }
  {
    // Zero and negative row strides.
    Caught e = call([&] { matmul(raw(a_.data(), DType::kF32, Device::cpu(), {M, K}, {0, 1}), B(), C()); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "a");
    Caught e2 = call([&] {
      matmul(A(), B(), raw(static_cast<float*>(c_.data()) + 2000, DType::kF32, Device::cpu(), {M, N}, {-N, 1}));
    });
    EXPECT_ERROR(e2, Status::kInvalidArgument);
    EXPECT_MENTIONS(e2, "c");
  }
}

TEST_F(GemmErrors, ZeroAndNegativeSizes) {
  {
    Caught e = call([&] {
      matmul(raw(a_.data(), DType::kF32, Device::cpu(), {0, K}, {K, 1}), B(),
             raw(c_.data(), DType::kF32, Device::cpu(), {0, N}, {N, 1}));
    });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_TRUE(mentions(e.message, "a") || mentions(e.message, "c")) << e.message;
    EXPECT_MENTIONS(e, "0");
  }
  {
    Caught e = call([&] {
      matmul(raw(a_.data(), DType::kF32, Device::cpu(), {M, 0}, {1, 1}),
             raw(b_.data(), DType::kF32, Device::cpu(), {0, N}, {N, 1}), C());
    });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_TRUE(mentions(e.message, "a") || mentions(e.message, "b")) << e.message;
    EXPECT_MENTIONS(e, "0");
  }
  {
    Caught e = call([&] {
      matmul(A(), raw(b_.data(), DType::kF32, Device::cpu(), {K, -3}, {N, 1}),
             raw(c_.data(), DType::kF32, Device::cpu(), {M, -3}, {N, 1}));
    });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_TRUE(mentions(e.message, "b") || mentions(e.message, "c")) << e.message;
    EXPECT_CONTAINS(e, "-3");
  }
  {
    Caught e = call([&] {
      matmul(raw(a_.data(), DType::kF32, Device::cpu(), {0, M, K}, {M * K, K, 1}), B(),
             raw(c_.data(), DType::kF32, Device::cpu(), {0, M, N}, {M * N, N, 1}));
    });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_TRUE(mentions(e.message, "a") || mentions(e.message, "c")) << e.message;
  }
}

TEST_F(GemmErrors, MisalignedDataPointer) {
  // A pointer that is not a multiple of the element size cannot be an fp32 tensor.
  void* odd = static_cast<char*>(a_.data()) + 1;
  Caught e = call([&] { matmul(TensorView::matrix(odd, DType::kF32, Device::cpu(), M, K, K), B(), C()); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "a");
}

TEST_F(GemmErrors, DeviceMismatch) {
  // C labelled as CUDA memory while A and B are on the CPU (the memory is never touched).
  {
    TensorView c = C();
    c.device = Device::cuda(0);
    Caught e = call([&] { matmul(A(), B(), c); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "cpu");     // expected (a's device)
    EXPECT_CONTAINS(e, "cuda:0");  // given
  }
  {
    TensorView b = B();
    b.device = Device::cuda(0);
    Caught e = call([&] { matmul(A(), b, C(), 1.0f, 0.0f, GemmVariant::kCpuNaive); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "b");
    EXPECT_CONTAINS(e, "cuda:0");
  }
  {
    TensorView a = A(), b = B(), c = C();
    a.device = b.device = Device::cuda(0);
    c.device = Device::cuda(1);
    Caught e = call([&] { matmul(a, b, c); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "cuda:1");
  }
}

TEST_F(GemmErrors, CpuVariantOnCudaTensors) {
  // Host memory labelled CUDA: a CPU variant must refuse before touching it.
  for (GemmVariant v : {GemmVariant::kCpuNaive, GemmVariant::kCpuBlocked, GemmVariant::kCpuPacked}) {
    SCOPED_TRACE(std::string(gemm_variant_name(v)));
    TensorView a = A(), b = B(), c = C();
    a.device = b.device = c.device = Device::cuda(0);
    Caught e = call([&] { matmul(a, b, c, 1.0f, 0.0f, v); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_TRUE(mentions(e.message, "variant") || contains(e.message, std::string(gemm_variant_name(v))))
        << e.message;
    EXPECT_CONTAINS(e, "cuda");
  }
}

TEST_F(GemmErrors, CudaVariantOnCpuTensors) {
  for (GemmVariant v : {GemmVariant::kCudaNaive, GemmVariant::kCudaCoalesced, GemmVariant::kCudaSmemTiled,
                        GemmVariant::kCudaRegisterTiled, GemmVariant::kCudaWmma, GemmVariant::kCudaMmaPipeline,
                        GemmVariant::kCudaWgmmaTma, GemmVariant::kCudaWgmmaWs, GemmVariant::kCudaWgmmaPersistent,
                        GemmVariant::kCudaGemv}) {
    SCOPED_TRACE(std::string(gemm_variant_name(v)));
    Caught e = call([&] { matmul(A16(), B16(), C16(), 1.0f, 0.0f, v); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_TRUE(mentions(e.message, "variant") || contains(e.message, std::string(gemm_variant_name(v))))
        << e.message;
    EXPECT_CONTAINS(e, "cpu");
  }
}

TEST_F(GemmErrors, TensorCoreVariantsRejectFp32) {
  for (GemmVariant v : {GemmVariant::kCudaWmma, GemmVariant::kCudaMmaPipeline, GemmVariant::kCudaWgmmaTma,
                        GemmVariant::kCudaWgmmaWs, GemmVariant::kCudaWgmmaPersistent}) {
    const std::string why = gemm_variant_rejects_dtype(v, DType::kF32);
    EXPECT_TRUE(contains(why, "fp32")) << gemm_variant_name(v) << ": '" << why << "'";
    EXPECT_TRUE(contains(why, "fp16") && contains(why, "bf16")) << "should say what it takes: " << why;
    EXPECT_EQ(gemm_variant_rejects_dtype(v, DType::kF16), "");
    EXPECT_EQ(gemm_variant_rejects_dtype(v, DType::kBF16), "");
  }
}

TEST_F(GemmErrors, TensorCoreVariantsRejectFp32OnDevice) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda_unavailable_reason();
  Buffer a(DType::kF32, M * K, Device::cuda()), b(DType::kF32, K * N, Device::cuda()),
      c(DType::kF32, M * N, Device::cuda());
  for (GemmVariant v : {GemmVariant::kCudaWmma, GemmVariant::kCudaMmaPipeline, GemmVariant::kCudaWgmmaTma,
                        GemmVariant::kCudaWgmmaWs, GemmVariant::kCudaWgmmaPersistent}) {
    SCOPED_TRACE(std::string(gemm_variant_name(v)));
    Caught e = call([&] { matmul(a.matrix(M, K, K), b.matrix(K, N, N), c.matrix(M, N, N), 1.0f, 0.0f, v); });
    EXPECT_ERROR(e, Status::kUnsupported);
    EXPECT_TRUE(mentions(e.message, "variant") || contains(e.message, std::string(gemm_variant_name(v))))
        << e.message;
    EXPECT_CONTAINS(e, "fp32");
  }
}

TEST(GemmVariants, RejectsDtypeTable) {
  for (GemmVariant v : all_gemm_variants()) {
    SCOPED_TRACE(std::string(gemm_variant_name(v)));
    const bool tensor_core = v == GemmVariant::kCudaWmma || v == GemmVariant::kCudaMmaPipeline ||
                             v == GemmVariant::kCudaWgmmaTma || v == GemmVariant::kCudaWgmmaWs ||
                             v == GemmVariant::kCudaWgmmaPersistent;
    EXPECT_EQ(gemm_variant_rejects_dtype(v, DType::kF16), "");
    EXPECT_EQ(gemm_variant_rejects_dtype(v, DType::kBF16), "");
    EXPECT_EQ(gemm_variant_rejects_dtype(v, DType::kF32).empty(), !tensor_core);
    const bool takes_f64 = v == GemmVariant::kCpuNaive || v == GemmVariant::kCpuBlocked;
    EXPECT_EQ(gemm_variant_rejects_dtype(v, DType::kF64).empty(), takes_f64);
    if (!takes_f64) {
      EXPECT_TRUE(contains(gemm_variant_rejects_dtype(v, DType::kF64), "fp64"));
    }
    for (DType d : {DType::kI32, DType::kI64, DType::kF8E4M3}) {
      const std::string why = gemm_variant_rejects_dtype(v, d);
      EXPECT_TRUE(contains(why, std::string(dtype_name(d)))) << "'" << why << "'";
    }
  }
}

TEST_F(GemmErrors, CudaTensorsWithoutCuda) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  // Host memory labelled CUDA (never touched): no usable CUDA here, so kUnsupported with a reason.
  for (GemmVariant v : {GemmVariant::kAuto, GemmVariant::kCudaNaive, GemmVariant::kCudaMmaPipeline}) {
    SCOPED_TRACE(std::string(gemm_variant_name(v)));
    TensorView a = A16(), b = B16(), c = C16();
    a.device = b.device = c.device = Device::cuda(0);
    Caught e = call([&] { matmul(a, b, c, 1.0f, 0.0f, v); });
    EXPECT_ERROR(e, Status::kUnsupported);
    EXPECT_CONTAINS(e, "CUDA");
    EXPECT_GT(e.message.size(), 20u) << "a reason, not just a word: " << e.message;
    if (built_with_cuda()) {
      const std::string reason = cuda_unavailable_reason();
      EXPECT_CONTAINS(e, reason);
    }
  }
}

TEST_F(GemmErrors, OutputOverlapsInput) {
  const int64_t S = 9;  // square, so C fits A's shape exactly
  {
    Buffer x(DType::kF32, S * S * 2, Device::cpu());
    x.fill_bytes(0);
    TensorView a = x.matrix(S, S, S);
    Caught e = call([&] { matmul(a, b_.matrix(S, S, S), a); });  // C is A
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "overlap");
  }
  {
    Buffer x(DType::kF32, S * S * 2, Device::cpu());
    x.fill_bytes(0);
    TensorView b = x.matrix(S, S, S);
    TensorView c = TensorView::matrix(static_cast<float*>(x.data()) + S * S - 1, DType::kF32, Device::cpu(), S, S, S);
    Caught e = call([&] { matmul(a_.matrix(S, S, S), b, c); });  // C starts on B's last element
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "overlap");
  }
  {
    Buffer x(DType::kF32, S * S * 2, Device::cpu());
    x.fill_bytes(0);
    TensorView a = TensorView::matrix(static_cast<float*>(x.data()) + 5, DType::kF32, Device::cpu(), S, S, S);
    TensorView c = x.matrix(S, S, S);  // A starts inside C
    Caught e = call([&] { matmul(a, b_.matrix(S, S, S), c); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "overlap");
    for (int64_t i = 0; i < 2 * S * S; ++i) ASSERT_EQ(static_cast<const float*>(x.data())[i], 0.0f) << i;
  }
  {
    // A batched, broadcast A (stride 0) that lies inside the second batch of C.
    Buffer x(DType::kF32, 3 * S * S, Device::cpu());
    x.fill_bytes(0);
    TensorView a = TensorView(static_cast<float*>(x.data()) + S * S, DType::kF32, Device::cpu(), {3, S, S},
                              {0, S, 1});
    TensorView c = x.view({3, S, S});
    Caught e = call([&] { matmul(a, b_.matrix(S, S, S), c); });
    EXPECT_ERROR(e, Status::kInvalidArgument);
    EXPECT_MENTIONS(e, "c");
    EXPECT_CONTAINS(e, "overlap");
  }
}

TEST_F(GemmErrors, OutputBatchesOverlapEachOther) {
  // C with batch stride 0 would have every batch write the same elements.
  TensorView a = a_.view({3, M, K});
  TensorView c = raw(c_.data(), DType::kF32, Device::cpu(), {3, M, N}, {0, N, 1});
  Caught e = call([&] { matmul(a, B(), c); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "c");
  TensorView c2 = raw(c_.data(), DType::kF32, Device::cpu(), {3, M, N}, {N, N, 1});  // batches share rows
  Caught e2 = call([&] { matmul(a, B(), c2); });
  EXPECT_ERROR(e2, Status::kInvalidArgument);
  EXPECT_MENTIONS(e2, "c");
}

TEST(GemmVariants, ParseBogusListsTheChoices) {
  Caught e = call([] { parse_gemm_variant("bogus"); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "variant");
  EXPECT_CONTAINS(e, "bogus");
  for (GemmVariant v : all_gemm_variants()) EXPECT_CONTAINS(e, std::string(gemm_variant_name(v)));
  EXPECT_CONTAINS(e, "auto");
  Caught e2 = call([] { parse_gemm_variant(""); });
  EXPECT_ERROR(e2, Status::kInvalidArgument);
  Caught e3 = call([] { parse_gemm_variant("Naive"); });  // names are exact
  EXPECT_ERROR(e3, Status::kInvalidArgument);
}

TEST(GemmVariants, NamesRoundTripAndOrder) {
  const std::vector<GemmVariant> expected = {
      GemmVariant::kCpuNaive,      GemmVariant::kCpuBlocked,   GemmVariant::kCpuPacked,
      GemmVariant::kCudaNaive,     GemmVariant::kCudaCoalesced, GemmVariant::kCudaSmemTiled,
      GemmVariant::kCudaRegisterTiled, GemmVariant::kCudaWmma, GemmVariant::kCudaMmaPipeline,
      GemmVariant::kCudaWgmmaTma, GemmVariant::kCudaWgmmaWs, GemmVariant::kCudaWgmmaPersistent,
      GemmVariant::kCudaGemv};
  const auto all = all_gemm_variants();
  ASSERT_EQ(std::vector<GemmVariant>(all.begin(), all.end()), expected);
  EXPECT_EQ(parse_gemm_variant("auto"), GemmVariant::kAuto);
  EXPECT_EQ(gemm_variant_name(GemmVariant::kAuto), "auto");
  EXPECT_EQ(gemm_variant_name(GemmVariant::kCpuNaive), "cpu_naive");
  EXPECT_EQ(gemm_variant_name(GemmVariant::kCudaMmaPipeline), "mma_pipeline");
  EXPECT_EQ(gemm_variant_name(GemmVariant::kCudaWgmmaPersistent), "wgmma_persistent");
  std::vector<std::string> seen;
  for (GemmVariant v : all) {
    const std::string name(gemm_variant_name(v));
    EXPECT_EQ(parse_gemm_variant(name), v) << name;
    for (const std::string& s : seen) EXPECT_NE(s, name);
    seen.push_back(name);
    const bool cpu = v == GemmVariant::kCpuNaive || v == GemmVariant::kCpuBlocked || v == GemmVariant::kCpuPacked;
    EXPECT_EQ(gemm_variant_is_cuda(v), !cpu) << name;
  }
  EXPECT_FALSE(gemm_variant_is_cuda(GemmVariant::kAuto));
}

TEST(DTypeErrors, ParseUnknown) {
  Caught e = call([] { parse_dtype("fp128"); });
  EXPECT_ERROR(e, Status::kInvalidArgument);
  EXPECT_MENTIONS(e, "dtype");
  EXPECT_CONTAINS(e, "fp128");
  EXPECT_CONTAINS(e, "bf16");
}

}  // namespace
}  // namespace optimized
