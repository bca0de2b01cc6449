// Error paths of the KV-cache family's public API (src/kv_cache/kv_cache.cpp): each asserts the
// status and that the message names the argument. Views "on cuda:0" over host memory reach the
// checks that come before any device work.
#include <gtest/gtest.h>

#include "kv_cache_test_util.h"

namespace optimized::testing {
namespace {

class KvCacheErrors : public ::testing::Test {
 protected:
  std::mt19937_64 rng = test_rng();
  HostCache cache{DType::kF32, 4, 2, 8, {12, 12}, rng};
  Buffer q{DType::kF32, 2 * 2 * 4 * 8, Device::cpu()}, out{DType::kF32, 2 * 2 * 4 * 8, Device::cpu()};
  Buffer k{DType::kF32, 2 * 3 * 2 * 8, Device::cpu()}, v{DType::kF32, 2 * 3 * 2 * 8, Device::cpu()};
  Buffer lens{DType::kI32, 2, Device::cpu()}, pos{DType::kI32, 6, Device::cpu()}, lse{DType::kF32, 16, Device::cpu()};
  void SetUp() override {
    fill_random(q, rng), fill_random(k, rng), fill_random(v, rng);
    static_cast<int32_t*>(lens.data())[0] = 12, static_cast<int32_t*>(lens.data())[1] = 5;
    for (int i = 0; i < 6; ++i) static_cast<int32_t*>(pos.data())[i] = i % 3 + 4;
  }
  Caught decode(TensorView qv, PagedKVCacheView c, TensorView table, TensorView sl, TensorView ov, TensorView lv = {},
                DecodeOptions o = {}, KvCacheVariant var = KvCacheVariant::kAuto) {
    return call([&] { paged_attention_decode(qv, c, table, sl, ov, lv, o, var); });
  }
  Caught decode_default(DecodeOptions o = {}) {
    return decode(q.view({2, 2, 4, 8}), cache.view(), cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}),
                  lse.view({2, 4, 2}), o);
  }
  Caught append(TensorView kv, TensorView vv, TensorView pv, RopeOptions r = {}, PagedKVCacheView c = {}, TensorView qv = {}) {
    if (c.k_pages.rank == 0) c = cache.view();
    return call([&] { append_kv(c, kv, vv, cache.table_view(), pv, qv, r); });
  }
  // The cache's pages labelled CUDA (host memory: for checks that refuse before any launch).
  static PagedKVCacheView on_cuda(PagedKVCacheView c) {
    c.k_pages = on(c.k_pages, Device::cuda(0)), c.v_pages = on(c.v_pages, Device::cuda(0));
    return c;
  }
  Caught append_default(RopeOptions r = {}) { return append(k.view({2, 3, 2, 8}), v.view({2, 3, 2, 8}), pos.view({2, 3}), r); }
};

TEST_F(KvCacheErrors, ValidCallsPass) {
  EXPECT_FALSE(decode_default().thrown);
  EXPECT_FALSE(append_default().thrown);
}

TEST_F(KvCacheErrors, CacheViews) {
  PagedKVCacheView c = cache.view();
  c.k_pages.rank = 3;
  auto r = decode(q.view({2, 2, 4, 8}), c, cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "k_pages");
  c = cache.view();
  c.v_pages = as(c.v_pages, DType::kF16);
  r = decode(q.view({2, 2, 4, 8}), c, cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "v_pages");
  c = cache.view();
  c.v_pages.shape[3] = 4;
  r = decode(q.view({2, 2, 4, 8}), c, cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "v_pages");
  c = cache.view();
  c.k_pages.strides[3] = 2, c.k_pages.shape[0] = 1;
  r = decode(q.view({2, 2, 4, 8}), c, cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "k_pages");
  c = cache.view();
  c.k_scale = cache.k.view({2});
  r = decode(q.view({2, 2, 4, 8}), c, cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "k_scale");
  HostCache big(DType::kF32, 300, 1, 2, {1}, rng);
  r = decode(q.view({1, 1, 1, 2}), big.view(), big.table_view(), lens.view({1}), out.view({1, 1, 1, 2}));
  EXPECT_MENTIONS(r, "k_pages");
  EXPECT_CONTAINS(r, "page_size");
  HostCache f8(DType::kF8E4M3, 4, 2, 8, {12, 12}, rng);
  c = f8.view();
  c.v_scale = {};
  r = decode(q.view({2, 2, 4, 8}), c, f8.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "v_scale");
  c = f8.view();
  c.k_scale = as(c.k_scale, DType::kF16);
  r = decode(q.view({2, 2, 4, 8}), c, f8.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "k_scale");
  r = decode(as(q.view({1, 1, 1, 8}), DType::kF64), f8.view(), f8.table_view(), lens.view({1}), as(out.view({1, 1, 1, 8}), DType::kF64));
  EXPECT_ERROR(r, Status::kUnsupported);  // fp64 q into an fp8 cache
  EXPECT_MENTIONS(r, "q");
}

TEST_F(KvCacheErrors, DecodeOperands) {
  auto r = decode(q.view({2, 9, 4, 1}), cache.view(), cache.table_view(), lens.view({2}), out.view({2, 9, 4, 1}));
  EXPECT_MENTIONS(r, "q");
  r = decode(q.view({2, 2, 3, 8}), cache.view(), cache.table_view(), lens.view({2}), out.view({2, 2, 3, 8}));
  EXPECT_MENTIONS(r, "q");  // 3 heads, H_kv 2
  r = decode(as(q.view({2, 2, 4, 8}), DType::kF16), cache.view(), cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "q");
  r = decode(q.view({2, 2, 4, 8}), cache.view(), as(cache.table_view(), DType::kF32), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "page_table");
  r = decode(q.view({2, 2, 4, 8}), cache.view(), cache.table.view({2, 2}, {1, 2}), lens.view({2}), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "page_table");
  r = decode(q.view({2, 2, 4, 8}), cache.view(), cache.table_view(), as(lens.view({2}), DType::kI64), out.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "seq_lens");
  r = decode(q.view({2, 2, 4, 8}), cache.view(), cache.table_view(), lens.view({2}), out.view({2, 2, 4, 7}));
  EXPECT_MENTIONS(r, "out");
  r = decode(q.view({2, 2, 4, 8}), cache.view(), cache.table_view(), lens.view({2}), q.view({2, 2, 4, 8}));
  EXPECT_MENTIONS(r, "out");  // overlaps q
  r = decode(q.view({2, 2, 4, 8}), cache.view(), cache.table_view(), lens.view({2}), out.view({2, 2, 4, 8}), lse.view({2, 4, 1}));
  EXPECT_MENTIONS(r, "lse");
  r = decode(q.view({2, 2, 4, 8}), cache.view(), cache.table_view(), lens.view({2}), on(out.view({2, 2, 4, 8}), Device::cuda(0)));
  EXPECT_MENTIONS(r, "out");
  DecodeOptions o;
  o.window_left = -2;
  EXPECT_MENTIONS(decode_default(o), "window_left");
  o = {};
  o.softcap = -1;
  EXPECT_MENTIONS(decode_default(o), "softcap");
  o = {};
  o.softmax_scale = INFINITY;
  EXPECT_MENTIONS(decode_default(o), "softmax_scale");
  o = {};
  o.alibi_slopes = lse.view({3});
  EXPECT_MENTIONS(decode_default(o), "alibi_slopes");
  EXPECT_MENTIONS(call([] { parse_kv_cache_variant("hopper"); }), "variant");
  EXPECT_EQ(parse_kv_cache_variant("paged_split"), KvCacheVariant::kPagedSplit);
  // decode takes 1-8 new tokens and says where longer chunks go.
  {
    Buffer q9(DType::kF32, 2 * 9 * 4 * 8, Device::cpu()), o9(DType::kF32, q9.count(), Device::cpu());
    Caught r9 = decode(q9.view({2, 9, 4, 8}), cache.view(), cache.table_view(), lens.view({2}), o9.view({2, 9, 4, 8}));
    EXPECT_ERROR(r9, Status::kInvalidArgument);
    EXPECT_MENTIONS(r9, "paged_attention_prefill");
  }
  EXPECT_EQ(parse_kv_cache_variant("paged_mma"), KvCacheVariant::kPagedMma);
  EXPECT_EQ(kv_cache_variant_name(KvCacheVariant::kCpu), "cpu");
}

TEST_F(KvCacheErrors, ValidateCatchesBadTables) {
  cache.entries()[1] = static_cast<int32_t>(cache.num_pages);  // sequence 0, page 1 (tokens 4..7)
  auto r = decode_default();
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "page_table");
  cache.entries()[1] = -1;
  EXPECT_MENTIONS(decode_default(), "page_table");
  cache.entries()[1] = 0;
  static_cast<int32_t*>(lens.data())[1] = 13;  // beyond 3 pages of 4
  EXPECT_MENTIONS(decode_default(), "seq_lens");
  static_cast<int32_t*>(lens.data())[1] = 1;  // shorter than q_len 2
  EXPECT_MENTIONS(decode_default(), "seq_lens");
  static_cast<int32_t*>(lens.data())[1] = -3;
  EXPECT_MENTIONS(decode_default(), "seq_lens");
  static_cast<int32_t*>(lens.data())[1] = 0;  // empty sequence: fine
  EXPECT_FALSE(decode_default().thrown);
  // Append: a position beyond the table, a bad page, two tokens into one slot.
  static_cast<int32_t*>(pos.data())[0] = 12;
  EXPECT_MENTIONS(append_default(), "positions");
  static_cast<int32_t*>(pos.data())[0] = 4;
  static_cast<int32_t*>(pos.data())[1] = 4;
  EXPECT_MENTIONS(append_default(), "positions");
  static_cast<int32_t*>(pos.data())[1] = 5;
  cache.entries()[1] = 999;
  EXPECT_MENTIONS(append_default(), "page_table");
}

TEST_F(KvCacheErrors, AppendOperands) {
  EXPECT_MENTIONS(append(k.view({2, 3, 2, 4}), v.view({2, 3, 2, 4}), pos.view({2, 3})), "k");
  EXPECT_MENTIONS(append(k.view({2, 3, 2, 8}), v.view({2, 3, 1, 8}), pos.view({2, 3})), "v");
  EXPECT_MENTIONS(append(k.view({2, 3, 2, 8}), v.view({2, 3, 2, 8}), pos.view({2, 2})), "positions");
  EXPECT_MENTIONS(append(k.view({2, 3, 2, 8}), v.view({2, 3, 2, 8}), as(pos.view({2, 3}), DType::kF32)), "positions");
  EXPECT_MENTIONS(append(k.view({2, 3, 2, 8}), v.view({2, 3, 2, 8}), pos.view({2, 3}), {}, {}, k.view({2, 3, 2, 8})), "q");
  RopeOptions r;
  r.layout = RopeLayout::kNeox;
  r.rotary_dim = 3;
  EXPECT_MENTIONS(append_default(r), "rope.rotary_dim");
  r.rotary_dim = 10;
  EXPECT_MENTIONS(append_default(r), "rope.rotary_dim");
  r.rotary_dim = 0, r.theta = -1;
  EXPECT_MENTIONS(append_default(r), "rope.theta");
  PagedKVCacheView c = cache.view();
  c.k_pages.strides[0] = 0;
  EXPECT_MENTIONS(append(k.view({2, 3, 2, 8}), v.view({2, 3, 2, 8}), pos.view({2, 3}), {}, c), "k_pages");
  // k overlapping the cache (an output).
  PagedKVCacheView c2 = cache.view();
  EXPECT_ERROR(append(cache.k.view({2, 3, 2, 8}), v.view({2, 3, 2, 8}), pos.view({2, 3}), {}, c2), Status::kInvalidArgument);
}

// paged_mma refuses what its tensor cores do not take, before touching the device: fp32 q, a head
// dim other than 64 / 128 / 256 (a call and a plan), a cache whose rows are not 16-byte aligned.
TEST_F(KvCacheErrors, PagedMmaRefusals) {
  const Device g = Device::cuda(0);
  DecodeOptions o;
  o.validate = false;
  Caught r = decode(on(q.view({2, 2, 4, 8}), g), on_cuda(cache.view()), on(cache.table_view(), g), on(lens.view({2}), g),
                    on(out.view({2, 2, 4, 8}), g), {}, o, KvCacheVariant::kPagedMma);
  EXPECT_ERROR(r, Status::kUnsupported);  // fp32
  // fp16, head_dim 8.
  std::mt19937_64 rng2 = test_rng();
  HostCache c16(DType::kF16, 4, 2, 8, {12, 12}, rng2);
  Buffer q16(DType::kF16, 2 * 2 * 4 * 8, Device::cpu()), o16(DType::kF16, 2 * 2 * 4 * 8, Device::cpu());
  r = decode(on(q16.view({2, 2, 4, 8}), g), on_cuda(c16.view()), on(c16.table_view(), g), on(lens.view({2}), g),
             on(o16.view({2, 2, 4, 8}), g), {}, o, KvCacheVariant::kPagedMma);
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "head_dim");
  r = call([&] { plan_paged_decode(2, 4, 2, 40, 1, 16, 100, DType::kBF16, DType::kBF16, g, KvCacheVariant::kPagedMma); });
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "head_dim");
  // fp16, head_dim 64, pages viewed with a slot stride of 66 elements (rows not 16-byte aligned).
  std::mt19937_64 rng3 = test_rng();
  HostCache c64(DType::kF16, 4, 2, 64, {12, 12}, rng3);
  Buffer q64(DType::kF16, 2 * 2 * 4 * 64, Device::cpu()), o64(DType::kF16, 2 * 2 * 4 * 64, Device::cpu());
  Buffer bk(DType::kF16, c64.num_pages * 4 * 2 * 66, Device::cpu()), bv(DType::kF16, bk.count(), Device::cpu());
  PagedKVCacheView cv = c64.view();
  cv.k_pages = bk.view({c64.num_pages, 4, 2, 64}, {4 * 2 * 66, 2 * 66, 66, 1});
  cv.v_pages = bv.view({c64.num_pages, 4, 2, 64}, {4 * 2 * 66, 2 * 66, 66, 1});
  r = decode(on(q64.view({2, 2, 4, 64}), g), on_cuda(cv), on(c64.table_view(), g), on(lens.view({2}), g),
             on(o64.view({2, 2, 4, 64}), g), {}, o, KvCacheVariant::kPagedMma);
  EXPECT_ERROR(r, Status::kUnsupported);
  EXPECT_MENTIONS(r, "16-byte");
}

// CUDA tensors: the cpu variant refuses them; auto runs paged_split, which without a device fails
// with the CUDA error (never a crash), and fp64 is refused whatever the device.
TEST_F(KvCacheErrors, CudaTensorsVariants) {
  const Device g = Device::cuda(0);
  DecodeOptions o;
  o.validate = false;
  Caught r;
  if (cuda_device_count() == 0) {  // (host memory labelled CUDA: only without a device)
    r = decode(on(q.view({2, 2, 4, 8}), g), on_cuda(cache.view()), on(cache.table_view(), g), on(lens.view({2}), g),
               on(out.view({2, 2, 4, 8}), g), {}, o, KvCacheVariant::kPagedSplit);
    EXPECT_TRUE(r.thrown);  // the CUDA error of a launch without a device
  }
  r = decode(on(q.view({2, 2, 4, 8}), g), on_cuda(cache.view()), on(cache.table_view(), g), on(lens.view({2}), g),
             on(out.view({2, 2, 4, 8}), g), {}, o, KvCacheVariant::kCpu);
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "variant");
}

}  // namespace
}  // namespace optimized::testing
