// The cpu rung of the KV-cache family against the float64 reference (kv_cache_reference.h).
#include <gtest/gtest.h>

#include "kv_cache_test_util.h"
#include "optimized/attention.h"
#include "testing/kv_cache_reference.h"

namespace optimized::testing {
namespace {

struct DecodeCase {
  DType dtype = DType::kF32, cache = DType::kF32;
  int64_t page_size = 16, hq = 4, hkv = 2, d = 16, q_len = 1;
  std::vector<int64_t> lens = {17, 5};
  int64_t window = -1;
  double softcap = 0;
  int alibi = 0;  // 1: (H_q), 2: (B, H_q)
  int64_t pad = 0;  // strided q / out
  int64_t gap = 0;  // rows between sequences of q / out (a slice of a longer prompt)
  bool prefill = false;  // paged_attention_prefill (any q_len; seq_lens below it allowed)
};

void run_decode(const DecodeCase& cs) {
  auto rng = test_rng();
  std::vector<int64_t> cap = cs.lens;
  HostCache cache(cs.cache, cs.page_size, cs.hkv, cs.d, cap, rng);
  const int64_t B = cache.batch, Q = cs.q_len, row = cs.d + cs.pad, seq = (Q + cs.gap) * cs.hq * row;
  Buffer q(cs.dtype, B * seq, Device::cpu()), out(cs.dtype, q.count(), Device::cpu());
  fill_random(q, rng, -1.5, 1.5);
  out.fill_bytes(0xFF);  // poison
  Buffer lse(DType::kF32, B * cs.hq * Q, Device::cpu()), lens(DType::kI32, B, Device::cpu()),
      alibi(DType::kF32, B * cs.hq, Device::cpu());
  lse.fill_bytes(0xFF);
  for (int64_t b = 0; b < B; ++b) static_cast<int32_t*>(lens.data())[b] = static_cast<int32_t>(cs.lens[b]);
  fill_random(alibi, rng, 0.0, 0.5);
  const TensorView qv = q.view({B, Q, cs.hq, cs.d}, {seq, cs.hq * row, row, 1});
  const TensorView ov = out.view({B, Q, cs.hq, cs.d}, {seq, cs.hq * row, row, 1});
  DecodeOptions o;
  o.window_left = cs.window;
  o.softcap = cs.softcap;
  if (cs.alibi == 1) o.alibi_slopes = alibi.view({cs.hq});
  if (cs.alibi == 2) o.alibi_slopes = alibi.view({B, cs.hq});
  if (cs.prefill) paged_attention_prefill(qv, cache.view(), cache.table_view(), lens.view({B}), ov, lse.view({B, cs.hq, Q}), o);
  else paged_attention_decode(qv, cache.view(), cache.table_view(), lens.view({B}), ov, lse.view({B, cs.hq, Q}), o);
  expect_decode_matches(cache, {cs.dtype, Q, cs.hq, row, &q, &out, &lse, &lens, cs.window, cs.softcap,
                               cs.alibi ? &alibi : nullptr, cs.alibi == 2, cs.gap});
}

TEST(KvCacheCpu, PageSizes) {
  for (int64_t ps : {1, 7, 16, 64, 256}) {
    DecodeCase cs;
    cs.page_size = ps;
    cs.lens = {300, 17, 1, 0};
    SCOPED_TRACE(ps);
    run_decode(cs);
  }
}

TEST(KvCacheCpu, MixedLongAndShort) {
  DecodeCase cs;
  cs.lens = {1, 2000};
  cs.hq = 8, cs.hkv = 2, cs.d = 64;
  run_decode(cs);
}

TEST(KvCacheCpu, GqaAndMqa) {
  for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {8, 2}, {16, 2}, {8, 1}}) {
    DecodeCase cs;
    cs.hq = hq, cs.hkv = hkv;
    SCOPED_TRACE(hq);
    run_decode(cs);
  }
}

TEST(KvCacheCpu, QLenCausal) {
  for (int64_t ql = 1; ql <= 8; ++ql) {
    DecodeCase cs;
    cs.q_len = ql;
    cs.lens = {40, 8, 0};
    cs.page_size = 7;
    SCOPED_TRACE(ql);
    run_decode(cs);
  }
}

// Prefill over the cache: chunks longer than decode's 8, right-aligned to each sequence's end; a
// sequence shorter than the chunk (20 < 37) leaves rows at negative positions (out 0, lse -inf).
TEST(KvCacheCpu, PrefillChunks) {
  for (int64_t ql : {9, 37, 70}) {  // 70: auto's gather + attention_forward path
    DecodeCase cs;
    cs.prefill = true, cs.q_len = ql, cs.lens = {100, 37, 20, 0}, cs.page_size = 7, cs.hq = 8, cs.hkv = 2;
    SCOPED_TRACE(ql);
    run_decode(cs);
    cs.window = 11, cs.softcap = 3.0, cs.alibi = 2;
    run_decode(cs);
    cs.gap = 5;  // q and out sliced out of longer prompts: auto copies them into packed rows and back
    run_decode(cs);
  }
}

TEST(KvCacheCpu, SoftcapWindowAlibi) {
  DecodeCase cs;
  cs.q_len = 3, cs.lens = {100, 33}, cs.window = 20, cs.softcap = 5.0, cs.alibi = 1;
  run_decode(cs);
  cs.alibi = 2, cs.window = 0;
  run_decode(cs);
}

TEST(KvCacheCpu, DtypesAndStrides) {
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF64, DType::kF32}) {
    DecodeCase cs;
    cs.dtype = cs.cache = dt;
    cs.pad = 3;
    cs.q_len = 2;
    SCOPED_TRACE(std::string(dtype_name(dt)));
    run_decode(cs);
  }
}

TEST(KvCacheCpu, Fp8Cache) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    DecodeCase cs;
    cs.dtype = dt, cs.cache = DType::kF8E4M3;
    cs.lens = {77, 300};
    cs.q_len = 2;
    SCOPED_TRACE(std::string(dtype_name(dt)));
    run_decode(cs);
  }
}

// Append with RoPE against the float64 reference.
void run_append(DType dt, DType cache_dt, RopeLayout layout, int64_t rotary_dim, int64_t S) {
  auto rng = test_rng();
  AppendCase c(dt, cache_dt, layout, rotary_dim, S, 16, rng);
  const int64_t B = c.B, H = c.H, Hq = c.Hq, D = c.D;
  append_kv(c.cache.view(), c.k.view({B, S, H, D}), c.v.view({B, S, H, D}), c.cache.table_view(), c.pos.view({B, S}),
            c.q.view({B, S, Hq, D}), c.rope);
  c.check();
}

TEST(KvCacheCpu, AppendRope) {
  for (RopeLayout l : {RopeLayout::kNone, RopeLayout::kNeox, RopeLayout::kInterleaved})
    for (int64_t rd : {0, 8}) {
      SCOPED_TRACE(static_cast<int>(l) * 100 + rd);
      run_append(DType::kF32, DType::kF32, l, rd, 5);
      run_append(DType::kBF16, DType::kBF16, l, rd, 1);
      run_append(DType::kF64, DType::kF64, l, rd, 3);
      run_append(DType::kF16, DType::kF8E4M3, l, rd, 4);
    }
}

// Append a prefix and new tokens, decode: equals attention_forward (cpu) on the contiguous K / V.
TEST(KvCacheCpu, AppendThenDecodeEqualsAttention) {
  auto rng = test_rng();
  const int64_t B = 2, L = 45, Q = 3, H = 2, Hq = 8, D = 32, P = 16;
  HostCache cache(DType::kF32, P, H, D, {L, L}, rng);
  Buffer k(DType::kF32, B * L * H * D, Device::cpu()), v(DType::kF32, k.count(), Device::cpu());
  fill_random(k, rng), fill_random(v, rng);
  Buffer pos(DType::kI32, B * L, Device::cpu());
  for (int64_t i = 0; i < B * L; ++i) static_cast<int32_t*>(pos.data())[i] = static_cast<int32_t>(i % L);
  // Two appends: the prefix, then the new tokens (views into k / v / pos).
  const int64_t pre = L - Q;
  append_kv(cache.view(), k.view({B, pre, H, D}, {L * H * D, H * D, D, 1}), v.view({B, pre, H, D}, {L * H * D, H * D, D, 1}),
            cache.table_view(), pos.view({B, pre}, {L, 1}));
  append_kv(cache.view(), shifted(k.view({B, Q, H, D}, {L * H * D, H * D, D, 1}), pre * H * D),
            shifted(v.view({B, Q, H, D}, {L * H * D, H * D, D, 1}), pre * H * D), cache.table_view(),
            shifted(pos.view({B, Q}, {L, 1}), pre));
  Buffer q(DType::kF32, B * Q * Hq * D, Device::cpu()), out(DType::kF32, q.count(), Device::cpu()),
      ref(DType::kF32, q.count(), Device::cpu()), lens(DType::kI32, B, Device::cpu());
  fill_random(q, rng, -1.5, 1.5);
  out.fill_bytes(0xFF);
  for (int64_t b = 0; b < B; ++b) static_cast<int32_t*>(lens.data())[b] = L;
  paged_attention_decode(q.view({B, Q, Hq, D}), cache.view(), cache.table_view(), lens.view({B}), out.view({B, Q, Hq, D}));
  AttentionOptions ao;
  ao.causal = true;
  attention_forward(q.view({B, Q, Hq, D}), k.view({B, L, H, D}), v.view({B, L, H, D}), ref.view({B, Q, Hq, D}), {}, ao,
                    AttentionVariant::kCpu);
  for (int64_t i = 0; i < q.count(); ++i) {
    const float a = static_cast<float*>(out.data())[i], b = static_cast<float*>(ref.data())[i];
    ASSERT_NEAR(a, b, 1e-5 * std::max(1.0f, std::fabs(b))) << i;
  }
}

// Unchecked mode: an out-of-range page index reads as masked keys, never out of bounds.
TEST(KvCacheCpu, UncheckedBadPageMasked) {
  DecodeCase cs;
  auto rng = test_rng();
  HostCache cache(DType::kF32, 8, 2, 16, {40}, rng);
  cache.entries()[2] = 1 << 30;  // tokens 16..23
  cache.entries()[3] = -5;       // tokens 24..31
  Buffer q(DType::kF32, 2 * 4 * 16, Device::cpu()), out(DType::kF32, q.count(), Device::cpu()),
      lens(DType::kI32, 1, Device::cpu()), lse(DType::kF32, 4 * 2, Device::cpu());
  fill_random(q, rng);
  out.fill_bytes(0xFF);
  static_cast<int32_t*>(lens.data())[0] = 40;
  DecodeOptions o;
  EXPECT_THROW(paged_attention_decode(q.view({1, 2, 4, 16}), cache.view(), cache.table_view(), lens.view({1}),
                                      out.view({1, 2, 4, 16}), lse.view({1, 4, 2}), o),
               Error);
  o.validate = false;
  paged_attention_decode(q.view({1, 2, 4, 16}), cache.view(), cache.table_view(), lens.view({1}), out.view({1, 2, 4, 16}),
                         lse.view({1, 4, 2}), o);
  expect_decode_matches(cache, {DType::kF32, 2, 4, 0, &q, &out, &lse, &lens});
}

}  // namespace
}  // namespace optimized::testing
