// Every error path of the attention family's public API (src/attention/attention.cpp). Each test
// asserts the Error's status and that the message names the argument (house rule 2); the fixture
// checks that a rejected call wrote none of its outputs. Also the names, lists and choices of
// attention.h (variants, head dims). Runs without a GPU: views "on cuda:0" over host memory reach
// the checks that come before any device work (dtype and head dim of the CUDA rungs).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <cstring>
#include <string>
#include <vector>

#include "attention/attention_config.h"
#include "common/test_util.h"
#include "optimized/attention.h"
#include "optimized/buffer.h"
#include "optimized/core.h"

namespace optimized {
namespace {

using namespace optimized::testing;

const TensorView kAbsent{};
const Device kCpu = Device::cpu();

// Valid operands: q (B, Sq, Hq, D), k / v (B, Sk, Hkv, D), lse (B, Hq, Sq); varlen: the same rows
// packed, two sequences of lengths (2, 3) / (4, 2). Outputs hold a pattern every rejected call must
// leave alone.
class AttentionErrors : public ::testing::Test {
 protected:
  static constexpr int64_t B = 2, Sq = 5, Sk = 6, Hq = 4, Hkv = 2, D = 8;
  static constexpr int64_t kRoom = 4096;

  void SetUp() override {
    for (Buffer* b : inputs())
      for (int64_t i = 0; i < b->count(); ++i) store_from_double(b->data(), b->dtype(), i, 0.25 + 0.01 * (i % 7));
    for (int64_t i = 0; i < kRoom; ++i) store_from_double(lse_in_.data(), DType::kF32, i, 1.0);
    for (int64_t i = 0; i < kRoom; ++i) store_from_double(slopes_.data(), DType::kF32, i, 0.1);
    std::memset(mask_.data(), 1, mask_.bytes());
    set_cu({0, 2, 5}, {0, 4, 6});
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
  std::vector<Buffer*> inputs() { return {&q_, &k_, &v_, &dout_, &out_in_, &q16_, &k16_, &q64_}; }
  std::vector<Buffer*> outputs() { return {&out_, &lse_, &dq_, &dk_, &dv_, &out16_, &out64_}; }

  void set_cu(std::vector<int32_t> q, std::vector<int32_t> k) {
    std::memcpy(cu_q_.data(), q.data(), q.size() * sizeof(int32_t));
    std::memcpy(cu_k_.data(), k.data(), k.size() * sizeof(int32_t));
    ncu_q_ = static_cast<int64_t>(q.size());
    ncu_k_ = static_cast<int64_t>(k.size());
  }

  // (b, s, h, D) contiguous views.
  static TensorView t4(const Buffer& b, int64_t b0, int64_t s, int64_t h, int64_t d = D, Device dev = Device::cpu()) {
    return raw(b.data(), b.dtype(), dev, {b0, s, h, d}, {s * h * d, h * d, d, 1});
  }
  static TensorView t3(const Buffer& b, int64_t t, int64_t h, int64_t d = D) {
    return raw(b.data(), b.dtype(), Device::cpu(), {t, h, d}, {h * d, d, 1});
  }
  TensorView Q() const { return t4(q_, B, Sq, Hq); }
  TensorView K() const { return t4(k_, B, Sk, Hkv); }
  TensorView V() const { return t4(v_, B, Sk, Hkv); }
  TensorView Out() const { return t4(out_, B, Sq, Hq); }
  TensorView OutIn() const { return t4(out_in_, B, Sq, Hq); }
  TensorView Dout() const { return t4(dout_, B, Sq, Hq); }
  TensorView Dq() const { return t4(dq_, B, Sq, Hq); }
  TensorView Dk() const { return t4(dk_, B, Sk, Hkv); }
  TensorView Dv() const { return t4(dv_, B, Sk, Hkv); }
  TensorView Lse() const { return raw(lse_.data(), DType::kF32, kCpu, {B, Hq, Sq}, {Hq * Sq, Sq, 1}); }
  TensorView LseIn() const { return raw(lse_in_.data(), DType::kF32, kCpu, {B, Hq, Sq}, {Hq * Sq, Sq, 1}); }
  // varlen: total_q = 5, total_k = 6
  TensorView VQ() const { return t3(q_, 5, Hq); }
  TensorView VK() const { return t3(k_, 6, Hkv); }
  TensorView VV() const { return t3(v_, 6, Hkv); }
  TensorView VOut() const { return t3(out_, 5, Hq); }
  TensorView VLse() const { return raw(lse_.data(), DType::kF32, kCpu, {Hq, 5}, {5, 1}); }
  TensorView CuQ() const { return raw(cu_q_.data(), DType::kI32, kCpu, {ncu_q_}, {1}); }
  TensorView CuK() const { return raw(cu_k_.data(), DType::kI32, kCpu, {ncu_k_}, {1}); }

  void fwd(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out, const TensorView& lse,
           const AttentionOptions& o = {}, AttentionVariant var = AttentionVariant::kAuto) {
    attention_forward(q, k, v, out, lse, o, var);
  }
  void vfwd(int64_t max_q = 3, int64_t max_k = 4, const AttentionOptions& o = {}) {
    attention_varlen_forward(VQ(), VK(), VV(), CuQ(), CuK(), max_q, max_k, VOut(), VLse(), o);
  }

  Buffer q_{DType::kF32, kRoom, kCpu}, k_{DType::kF32, kRoom, kCpu}, v_{DType::kF32, kRoom, kCpu},
      dout_{DType::kF32, kRoom, kCpu}, out_in_{DType::kF32, kRoom, kCpu}, lse_in_{DType::kF32, kRoom, kCpu};
  Buffer q16_{DType::kF16, kRoom, kCpu}, k16_{DType::kF16, kRoom, kCpu}, q64_{DType::kF64, kRoom, kCpu};
  Buffer out_{DType::kF32, kRoom, kCpu}, lse_{DType::kF32, kRoom, kCpu}, dq_{DType::kF32, kRoom, kCpu},
      dk_{DType::kF32, kRoom, kCpu}, dv_{DType::kF32, kRoom, kCpu}, out16_{DType::kF16, kRoom, kCpu},
      out64_{DType::kF64, kRoom, kCpu};
  Buffer mask_{DType::kBool, kRoom, kCpu}, slopes_{DType::kF32, kRoom, kCpu};
  Buffer cu_q_{DType::kI32, 16, kCpu}, cu_k_{DType::kI32, 16, kCpu};
  int64_t ncu_q_ = 3, ncu_k_ = 3;
  bool check_untouched_ = true;
};

#define EXPECT_REJECTS(expr, status, word)        \
  do {                                            \
    const Caught caught_ = call([&] { expr; });   \
    EXPECT_ERROR(caught_, status);                \
    EXPECT_MENTIONS(caught_, word);               \
  } while (0)

TEST_F(AttentionErrors, ValidCallsRun) {
  // The baseline every other test breaks one thing of.
  check_untouched_ = false;
  EXPECT_NO_THROW(fwd(Q(), K(), V(), Out(), Lse()));
  EXPECT_NO_THROW(fwd(Q(), K(), V(), Out(), kAbsent));
  EXPECT_NO_THROW(attention_backward(Dout(), Q(), K(), V(), OutIn(), LseIn(), Dq(), Dk(), Dv()));
  EXPECT_NO_THROW(vfwd());
  EXPECT_NO_THROW(attention_varlen_backward(t3(dout_, 5, Hq), VQ(), VK(), VV(), CuQ(), CuK(), 3, 4, t3(out_in_, 5, Hq),
                                            raw(lse_in_.data(), DType::kF32, kCpu, {Hq, 5}, {5, 1}), t3(dq_, 5, Hq),
                                            t3(dk_, 6, Hkv), t3(dv_, 6, Hkv)));
  AttentionOptions o;
  o.causal = true;
  o.window_left = 2;
  o.softcap = 5.0;
  o.alibi_slopes = raw(slopes_.data(), DType::kF32, kCpu, {B, Hq}, {Hq, 1});
  o.mask = raw(mask_.data(), DType::kBool, kCpu, {1, Hq, Sq, Sk}, {0, Sq * Sk, Sk, 1});
  EXPECT_NO_THROW(fwd(Q(), K(), V(), Out(), Lse(), o));
  o.mask = raw(out_in_.data(), DType::kF32, kCpu, {B, 1, 1, Sk}, {Sk, 0, 0, 1});  // additive, broadcast
  EXPECT_NO_THROW(fwd(Q(), K(), V(), Out(), Lse(), o));
  EXPECT_NO_THROW(fwd(Q(), K(), V(), Out(), Lse(), {}, AttentionVariant::kCpu));
}

// ---- shapes, dtypes, devices of q / k / v / out -------------------------------------------------

TEST_F(AttentionErrors, MismatchedHeads) {
  // H_q = 4 is no multiple of 3.
  EXPECT_REJECTS(fwd(Q(), t4(k_, B, Sk, 3), t4(v_, B, Sk, 3), Out(), Lse()), Status::kInvalidArgument, "k");
  // v's heads differ from k's.
  EXPECT_REJECTS(fwd(Q(), K(), t4(v_, B, Sk, 1), Out(), Lse()), Status::kInvalidArgument, "v");
  // out's heads differ from q's.
  EXPECT_REJECTS(fwd(Q(), K(), V(), t4(out_, B, Sq, 2), Lse()), Status::kInvalidArgument, "out");
}

TEST_F(AttentionErrors, MismatchedBatchSeqAndHeadDim) {
  EXPECT_REJECTS(fwd(Q(), t4(k_, 1, Sk, Hkv), t4(v_, 1, Sk, Hkv), Out(), Lse()), Status::kInvalidArgument, "k");
  EXPECT_REJECTS(fwd(Q(), K(), t4(v_, 1, Sk, Hkv), Out(), Lse()), Status::kInvalidArgument, "v");
  EXPECT_REJECTS(fwd(Q(), K(), t4(v_, B, Sk - 1, Hkv), Out(), Lse()), Status::kInvalidArgument, "v");
  EXPECT_REJECTS(fwd(Q(), t4(k_, B, Sk, Hkv, 4), V(), Out(), Lse()), Status::kInvalidArgument, "k");
  EXPECT_REJECTS(fwd(Q(), K(), t4(v_, B, Sk, Hkv, 4), Out(), Lse()), Status::kInvalidArgument, "v");
  EXPECT_REJECTS(fwd(Q(), K(), V(), t4(out_, B, Sq + 1, Hq), Lse()), Status::kInvalidArgument, "out");
  EXPECT_REJECTS(fwd(Q(), K(), V(), t4(out_, B, Sq, Hq, 4), Lse()), Status::kInvalidArgument, "out");
  EXPECT_REJECTS(attention_backward(Dout(), Q(), K(), V(), OutIn(), LseIn(), Dq(), t4(dk_, B, Sk, 1), Dv()),
                 Status::kInvalidArgument, "dk");
  EXPECT_REJECTS(attention_backward(t4(dout_, B, Sq - 1, Hq), Q(), K(), V(), OutIn(), LseIn(), Dq(), Dk(), Dv()),
                 Status::kInvalidArgument, "dout");
  EXPECT_REJECTS(attention_backward(Dout(), Q(), K(), V(), OutIn(), LseIn(), t4(dq_, B, Sq, Hq, 4), Dk(), Dv()),
                 Status::kInvalidArgument, "dq");
  EXPECT_REJECTS(attention_backward(Dout(), Q(), K(), V(), OutIn(), LseIn(), Dq(), Dk(), t4(dv_, B, Sk + 1, Hkv)),
                 Status::kInvalidArgument, "dv");
}

TEST_F(AttentionErrors, WrongRankAndStrides) {
  EXPECT_REJECTS(fwd(t3(q_, Sq, Hq), K(), V(), Out(), Lse()), Status::kInvalidArgument, "q");
  EXPECT_REJECTS(fwd(Q(), K(), V(), kAbsent, Lse()), Status::kInvalidArgument, "out");
  TensorView q = Q();
  q.strides[3] = 2;  // the head dim must be contiguous
  EXPECT_REJECTS(fwd(q, K(), V(), Out(), Lse()), Status::kInvalidArgument, "q");
  TensorView k = K();
  k.data = nullptr;
  EXPECT_REJECTS(fwd(Q(), k, V(), Out(), Lse()), Status::kInvalidArgument, "k");
}

TEST_F(AttentionErrors, MismatchedDtype) {
  EXPECT_REJECTS(fwd(Q(), t4(k16_, B, Sk, Hkv), V(), Out(), Lse()), Status::kInvalidArgument, "k");
  EXPECT_REJECTS(fwd(Q(), K(), t4(k16_, B, Sk, Hkv), Out(), Lse()), Status::kInvalidArgument, "v");
  EXPECT_REJECTS(fwd(Q(), K(), V(), t4(out16_, B, Sq, Hq), Lse()), Status::kInvalidArgument, "out");
  EXPECT_REJECTS(attention_backward(as(Dout(), DType::kF16), Q(), K(), V(), OutIn(), LseIn(), Dq(), Dk(), Dv()),
                 Status::kInvalidArgument, "dout");
  // A dtype no rung takes.
  EXPECT_REJECTS(fwd(as(Q(), DType::kI32), as(K(), DType::kI32), as(V(), DType::kI32), as(Out(), DType::kI32), kAbsent),
                 Status::kUnsupported, "q");
}

TEST_F(AttentionErrors, MismatchedDevice) {
  EXPECT_REJECTS(fwd(Q(), on(K(), Device::cuda(0)), V(), Out(), Lse()), Status::kInvalidArgument, "k");
  EXPECT_REJECTS(fwd(Q(), K(), V(), on(Out(), Device::cuda(0)), Lse()), Status::kInvalidArgument, "out");
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), on(Lse(), Device::cuda(0))), Status::kInvalidArgument, "lse");
}

TEST_F(AttentionErrors, OutputOverlapsAnInput) {
  EXPECT_REJECTS(fwd(Q(), K(), V(), t4(q_, B, Sq, Hq), Lse()), Status::kInvalidArgument, "out");
}

// An output whose elements overlap one another (a zero stride, heads interleaved with rows): two
// threads would write one address.
TEST_F(AttentionErrors, SelfOverlappingOutputs) {
  EXPECT_REJECTS(fwd(Q(), K(), V(), raw(out_.data(), DType::kF32, kCpu, {B, Sq, Hq, D}, {Sq * Hq * D, Hq * D, 0, 1}),
                     Lse()),
                 Status::kInvalidArgument, "out");
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), raw(lse_.data(), DType::kF32, kCpu, {B, Hq, Sq}, {Hq * Sq, 1, 1})),
                 Status::kInvalidArgument, "lse");
}

// Operands whose data is not aligned to their element size (a kernel's scalar load would fault).
TEST_F(AttentionErrors, MisalignedSideOperands) {
  auto shifted = [](TensorView t) {
    t.data = static_cast<char*>(t.data) + 1;
    return t;
  };
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), shifted(Lse())), Status::kInvalidArgument, "lse");
  AttentionOptions o;
  o.alibi_slopes = shifted(raw(slopes_.data(), DType::kF32, kCpu, {Hq}, {1}));
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "alibi_slopes");
  EXPECT_REJECTS(attention_varlen_forward(VQ(), VK(), VV(), shifted(CuQ()), CuK(), 3, 4, VOut(), VLse()),
                 Status::kInvalidArgument, "cu_seqlens_q");
}

// Scalars fp32 math cannot hold: refused for fp32 / fp16 / bf16 inputs rather than silently made 0
// or inf.
TEST_F(AttentionErrors, ScalarsOutsideFloatRange) {
  AttentionOptions o;
  o.softmax_scale = 1e300;
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "softmax_scale");
  o = {};
  o.softcap = 1e-46;
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "softcap");
  o.softcap = 1e300;
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "softcap");
}

// ---- lse ------------------------------------------------------------------------------------------

TEST_F(AttentionErrors, LseShapeDtypeAndPresence) {
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), raw(lse_.data(), DType::kF32, kCpu, {B, Hq, Sq + 1}, {Hq * (Sq + 1), Sq + 1, 1})),
                 Status::kInvalidArgument, "lse");
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), raw(lse_.data(), DType::kF32, kCpu, {B, Hq}, {Hq, 1})),
                 Status::kInvalidArgument, "lse");
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), as(Lse(), DType::kF16)), Status::kInvalidArgument, "lse");
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), raw(lse_.data(), DType::kF32, kCpu, {B, Hq, Sq}, {Hq * Sq * 2, Sq * 2, 2})),
                 Status::kInvalidArgument, "lse");
  // fp64 calls take an fp64 lse, not fp32.
  EXPECT_REJECTS(fwd(t4(q64_, B, Sq, Hq), as(K(), DType::kF64), as(V(), DType::kF64), t4(out64_, B, Sq, Hq), Lse()),
                 Status::kInvalidArgument, "lse");
  // The backward needs the forward's lse.
  EXPECT_REJECTS(attention_backward(Dout(), Q(), K(), V(), OutIn(), kAbsent, Dq(), Dk(), Dv()), Status::kInvalidArgument,
                 "lse");
}

// ---- varlen ---------------------------------------------------------------------------------------

TEST_F(AttentionErrors, CuSeqlens) {
  {
    set_cu({0, 2, 5}, {0, 4, 5, 6});  // 3 sequences of k, 2 of q
    EXPECT_REJECTS(vfwd(), Status::kInvalidArgument, "cu_seqlens_k");
  }
  {
    set_cu({0, 3, 2, 5}, {0, 4, 4, 6});  // not monotone
    EXPECT_REJECTS(vfwd(), Status::kInvalidArgument, "cu_seqlens_q");
  }
  {
    set_cu({1, 2, 5}, {0, 4, 6});  // not starting at 0
    EXPECT_REJECTS(vfwd(), Status::kInvalidArgument, "cu_seqlens_q");
  }
  {
    set_cu({0, 2, 4}, {0, 4, 6});  // last != total_q (5)
    EXPECT_REJECTS(vfwd(), Status::kInvalidArgument, "cu_seqlens_q");
  }
  {
    set_cu({0, 2, 5}, {0, 4, 7});  // last != total_k (6)
    EXPECT_REJECTS(vfwd(), Status::kInvalidArgument, "cu_seqlens_k");
  }
  {
    set_cu({0, 2, 5}, {0, 4, 6});
    EXPECT_REJECTS(attention_varlen_forward(VQ(), VK(), VV(), as(CuQ(), DType::kI64), CuK(), 3, 4, VOut(), VLse()),
                   Status::kInvalidArgument, "cu_seqlens_q");
    EXPECT_REJECTS(attention_varlen_forward(VQ(), VK(), VV(), CuQ(), kAbsent, 3, 4, VOut(), VLse()),
                   Status::kInvalidArgument, "cu_seqlens_k");
  }
}

TEST_F(AttentionErrors, MaxSeqlen) {
  EXPECT_REJECTS(vfwd(2, 4), Status::kInvalidArgument, "max_seqlen_q");  // sequence 1 has 3 rows
  EXPECT_REJECTS(vfwd(3, 3), Status::kInvalidArgument, "max_seqlen_k");  // sequence 0 has 4 keys
  EXPECT_REJECTS(vfwd(3, -1), Status::kInvalidArgument, "max_seqlen_k");
}

TEST_F(AttentionErrors, VarlenLseShape) {
  EXPECT_REJECTS(attention_varlen_forward(VQ(), VK(), VV(), CuQ(), CuK(), 3, 4, VOut(),
                                          raw(lse_.data(), DType::kF32, kCpu, {Hq, 4}, {4, 1})),
                 Status::kInvalidArgument, "lse");
}

// ---- mask -----------------------------------------------------------------------------------------

TEST_F(AttentionErrors, Mask) {
  AttentionOptions o;
  o.mask = raw(mask_.data(), DType::kBool, kCpu, {1, 1, Sq, Sk}, {0, 0, Sk, 1});
  EXPECT_REJECTS(vfwd(3, 4, o), Status::kInvalidArgument, "mask");  // varlen takes no mask
  o.mask = raw(mask_.data(), DType::kBool, kCpu, {Sq, Sk}, {Sk, 1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "mask");  // rank 2
  o.mask = raw(mask_.data(), DType::kBool, kCpu, {1, 3, Sq, Sk}, {0, Sq * Sk, Sk, 1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "mask");  // 3 heads of 4
  o.mask = raw(mask_.data(), DType::kBool, kCpu, {1, 1, Sq, Sk + 1}, {0, 0, Sk + 1, 1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "mask");  // 7 keys of 6
  o.mask = raw(cu_q_.data(), DType::kI32, kCpu, {1, 1, 1, 1}, {1, 1, 1, 1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "mask");  // int32
  o.mask = raw(q16_.data(), DType::kF16, kCpu, {1, 1, Sq, Sk}, {0, 0, Sk, 1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "mask");  // fp16 on fp32 q
}

// ---- options --------------------------------------------------------------------------------------

TEST_F(AttentionErrors, Alibi) {
  AttentionOptions o;
  o.alibi_slopes = raw(slopes_.data(), DType::kF32, kCpu, {Hq + 1}, {1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "alibi_slopes");
  o.alibi_slopes = raw(slopes_.data(), DType::kF32, kCpu, {B + 1, Hq}, {Hq, 1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "alibi_slopes");
  o.alibi_slopes = raw(slopes_.data(), DType::kF32, kCpu, {1, 1, Hq}, {Hq, Hq, 1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "alibi_slopes");
  o.alibi_slopes = raw(q16_.data(), DType::kF16, kCpu, {Hq}, {1});
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "alibi_slopes");
}

TEST_F(AttentionErrors, WindowSoftcapScale) {
  AttentionOptions o;
  o.window_left = -2;
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "window_left");
  o = {};
  o.window_right = -5;
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "window_right");
  o = {};
  o.softcap = -1.0;
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "softcap");
  o.softcap = std::nan("");
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "softcap");
  o = {};
  o.softmax_scale = INFINITY;
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), o), Status::kInvalidArgument, "softmax_scale");
}

// ---- variants, dtypes and head dims of the rungs ------------------------------------------------

TEST_F(AttentionErrors, HeadDimOnCudaRungs) {
  // Views on cuda:0 over host memory: the head-dim check comes before any device work.
  for (int64_t d : {12, 264, 4}) {
    for (AttentionVariant var : {AttentionVariant::kAuto, AttentionVariant::kNaive, AttentionVariant::kFlash,
                                 AttentionVariant::kFlash2, AttentionVariant::kHopper}) {
      const Device dev = Device::cuda(0);
      const Caught c = call([&] {
        attention_forward(t4(q16_, 1, 3, 1, d, dev), t4(k16_, 1, 3, 1, d, dev), t4(k16_, 1, 3, 1, d, dev),
                          t4(out16_, 1, 3, 1, d, dev), kAbsent, {}, var);
      });
      SCOPED_TRACE("head_dim " + std::to_string(d) + " on " + std::string(attention_variant_name(var)));
      EXPECT_ERROR(c, Status::kUnsupported);
      EXPECT_MENTIONS(c, "head_dim");
      EXPECT_TRUE(contains_all(c.message, {"64, 96, 128, 256", "multiple of 8"}));
    }
  }
  // The cpu rung takes any head dim.
  check_untouched_ = false;
  EXPECT_NO_THROW(fwd(t4(q_, 1, 3, 1, 12), t4(k_, 1, 3, 1, 12), t4(v_, 1, 3, 1, 12), t4(out_, 1, 3, 1, 12), kAbsent));
}

TEST_F(AttentionErrors, DtypeOfTheRung) {
  const Device dev = Device::cuda(0);
  for (AttentionVariant var : {AttentionVariant::kAuto, AttentionVariant::kNaive, AttentionVariant::kFlash,
                               AttentionVariant::kFlash2, AttentionVariant::kHopper}) {
    SCOPED_TRACE(std::string(attention_variant_name(var)));
    const Caught c = call([&] {
      attention_forward(t4(q64_, 1, 3, 1, 64, dev), t4(q64_, 1, 3, 1, 64, dev), t4(q64_, 1, 3, 1, 64, dev),
                        t4(out64_, 1, 3, 1, 64, dev), kAbsent, {}, var);
    });
    EXPECT_ERROR(c, Status::kUnsupported);
    EXPECT_CONTAINS(c, "fp64");
  }
  // flash2 runs fp16 / bf16 only.
  const Caught c = call([&] {
    attention_forward(t4(q_, 1, 3, 1, 64, dev), t4(k_, 1, 3, 1, 64, dev), t4(v_, 1, 3, 1, 64, dev),
                      t4(out_, 1, 3, 1, 64, dev), kAbsent, {}, AttentionVariant::kFlash2);
  });
  EXPECT_ERROR(c, Status::kUnsupported);
  EXPECT_CONTAINS(c, "fp32");
}

TEST_F(AttentionErrors, VariantOnTheWrongDevice) {
  EXPECT_REJECTS(fwd(Q(), K(), V(), Out(), Lse(), {}, AttentionVariant::kFlash), Status::kInvalidArgument, "variant");
  const Device dev = Device::cuda(0);
  EXPECT_REJECTS(attention_forward(on(Q(), dev), on(K(), dev), on(V(), dev), on(Out(), dev), kAbsent, {},
                                   AttentionVariant::kCpu),
                 Status::kInvalidArgument, "variant");
}

// hopper (head dims 64 / 128, no softcap / ALiBi / mask, TMA rows) refuses the rest before any device work, naming the feature and the rung that runs it.
TEST_F(AttentionErrors, HopperRefusesWhatItDoesNotRunYet) {
  const Device dev = Device::cuda(0);
  const AttentionVariant hop = AttentionVariant::kHopper;
  // (1, s, 1, d) fp16 views on "cuda:0" over host memory, `off` elements into the buffer.
  auto h4 = [&](const Buffer& b, int64_t s, int64_t d, int64_t off = 0) {
    auto* base = static_cast<unsigned char*>(const_cast<void*>(static_cast<const void*>(b.data())));
    return raw(base + 2 * off, DType::kF16, dev, {1, s, 1, d}, {s * d, d, d, 1});
  };
  auto q = [&](int64_t d = 64) { return h4(q16_, 3, d); };
  auto out = [&](int64_t d = 64, int64_t off = 0) { return h4(out16_, 3, d, off); };
  auto refuses = [&](const std::function<void()>& f, Status status, const char* word, const char* text) {
    const Caught c = call(f);
    EXPECT_ERROR(c, status);
    EXPECT_MENTIONS(c, word);
    EXPECT_CONTAINS(c, text);
  };
  refuses([&] { attention_forward(q(96), q(96), q(96), out(96), kAbsent, {}, hop); }, Status::kUnsupported,
          "head_dim", "64 and 128");
  AttentionOptions o;
  o.softcap = 5.0;
  refuses([&] { attention_forward(q(), q(), q(), out(), kAbsent, o, hop); }, Status::kUnsupported, "softcap",
          "flash2");
  o = {};
  o.alibi_slopes = raw(slopes_.data(), DType::kF32, dev, {1}, {1});
  refuses([&] { attention_forward(q(), q(), q(), out(), kAbsent, o, hop); }, Status::kUnsupported, "alibi_slopes",
          "flash2");
  o = {};
  o.mask = raw(mask_.data(), DType::kBool, dev, {1, 1, 3, 3}, {9, 9, 3, 1});
  refuses([&] { attention_forward(q(), q(), q(), out(), kAbsent, o, hop); }, Status::kUnsupported, "mask", "flash2");
  // An out view one element off a 16-byte boundary: TMA-less rows are the caller's to fix.
  refuses([&] { attention_forward(q(), q(), q(), out(64, 1), kAbsent, {}, hop); }, Status::kInvalidArgument,
          "hopper", "16-byte");
}

// auto's rule for the hopper forward (attention_config.h, from the measured table): eligible forwards
// only, on compute capability 9.0 of an sm_90a build, from 1024 tokens, S_q = S_k.
TEST(AttentionAutoConfig, HopperForwardRule) {
  AttentionParams p;
  p.dtype = DType::kBF16;
  p.head_dim = 128;
  p.seqlen_q = p.seqlen_k = 1024;
  p.window_left = -1, p.window_right = -1;
  EXPECT_TRUE(auto_runs_hopper_forward(p, 90, true, true));
  p.window_right = 0;  // causal
  EXPECT_TRUE(auto_runs_hopper_forward(p, 90, true, true));
  EXPECT_FALSE(auto_runs_hopper_forward(p, 80, true, true));   // an A100
  EXPECT_FALSE(auto_runs_hopper_forward(p, 100, true, true));  // sm_90a code runs on 9.0 only
  EXPECT_FALSE(auto_runs_hopper_forward(p, 90, false, true));  // a build without the sm_90a sources
  EXPECT_FALSE(auto_runs_hopper_forward(p, 90, true, false));  // rows TMA cannot take
  auto with = [&](auto edit) {
    AttentionParams q = p;
    edit(q);
    return auto_runs_hopper_forward(q, 90, true, true);
  };
  EXPECT_TRUE(with([](AttentionParams& q) { q.head_dim = 64, q.dtype = DType::kF16; }));
  EXPECT_FALSE(with([](AttentionParams& q) { q.head_dim = 96; }));
  EXPECT_FALSE(with([](AttentionParams& q) { q.dtype = DType::kF32; }));
  EXPECT_FALSE(with([](AttentionParams& q) { q.backward = true; }));
  EXPECT_FALSE(with([](AttentionParams& q) { q.seqlen_q = q.seqlen_k = 1023; }));  // below the measured range
  EXPECT_FALSE(with([](AttentionParams& q) { q.seqlen_q = 1024, q.seqlen_k = 4096; }));
  EXPECT_FALSE(with([](AttentionParams& q) { q.window_left = 128; }));
  EXPECT_FALSE(with([](AttentionParams& q) { q.softcap = 30; }));
  static const int32_t cu[2] = {0, 1024};
  EXPECT_FALSE(with([](AttentionParams& q) { q.cu_seqlens_q = q.cu_seqlens_k = cu; }));
}

TEST(AttentionVariants, NamesAndParsing) {
  const std::vector<std::string> names = {"cpu", "naive", "flash", "flash2", "hopper"};
  ASSERT_EQ(all_attention_variants().size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const AttentionVariant v = all_attention_variants()[i];
    EXPECT_EQ(attention_variant_name(v), names[i]);
    EXPECT_EQ(parse_attention_variant(names[i]), v);
    EXPECT_EQ(attention_variant_is_cuda(v), i > 0);
  }
  const Caught c = call([] { parse_attention_variant("flash3"); });
  EXPECT_ERROR(c, Status::kInvalidArgument);
  EXPECT_CONTAINS(c, "flash3");
  EXPECT_TRUE(contains_all(c.message, {"cpu", "naive", "flash", "flash2", "hopper"}));
  const std::vector<int> dims(attention_head_dims().begin(), attention_head_dims().end());
  EXPECT_EQ(dims, (std::vector<int>{64, 96, 128, 256}));
  EXPECT_TRUE(attention_variant_supports_dtype(AttentionVariant::kCpu, DType::kF64));
  EXPECT_FALSE(attention_variant_supports_dtype(AttentionVariant::kFlash, DType::kF64));
  EXPECT_FALSE(attention_variant_supports_dtype(AttentionVariant::kFlash2, DType::kF32));
  EXPECT_TRUE(attention_variant_supports_dtype(AttentionVariant::kFlash2, DType::kBF16));
  EXPECT_FALSE(attention_variant_supports_dtype(AttentionVariant::kHopper, DType::kF32));
  EXPECT_TRUE(attention_variant_supports_dtype(AttentionVariant::kHopper, DType::kF16));
  EXPECT_EQ(attention_variant_min_compute_capability(AttentionVariant::kHopper), 90);
  EXPECT_EQ(resolve_attention_variant(DType::kF32, 12, Device::cpu()), AttentionVariant::kCpu);
}

TEST(AttentionVariants, WorkspaceQueryErrors) {
  AttentionShape s;
  s.batch = 1, s.seqlen_q = 4, s.seqlen_k = 4, s.heads_q = 3, s.heads_kv = 2, s.head_dim = 64;
  const Caught c = call([&] { attention_workspace_bytes(s, DType::kF16, Device::cuda(0), false); });
  EXPECT_ERROR(c, Status::kInvalidArgument);
  s.heads_q = 4;
  EXPECT_EQ(attention_workspace_bytes(s, DType::kF32, Device::cpu(), true), 0u);  // the cpu rung needs none
}

}  // namespace
}  // namespace optimized
