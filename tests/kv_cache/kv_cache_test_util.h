// Shared machinery of the KV-cache tests: a host cache with scattered (shuffled) pages, random
// data seeded from the test's name, and the params the public API would build (for the checks).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/test_util.h"
#include "kv_cache/kv_cache_params.h"
#include "optimized/buffer.h"
#include "optimized/kv_cache.h"
#include "testing/kv_cache_reference.h"

namespace optimized::testing {

inline void fill_random(Buffer& b, std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t i = 0; i < b.count(); ++i) store_from_double(b.data(), b.dtype(), i, u(rng));
}

// A cache of num_pages pages, with a page table giving each sequence enough pages for `capacity`
// tokens, the pages shuffled; fp8 caches get power-of-two scales.
struct HostCache {
  int64_t num_pages, page_size, heads_kv, head_dim, batch, max_pages;
  DType dtype;
  Buffer k, v, k_scale, v_scale, table;

  HostCache(DType dt, int64_t page_size_, int64_t heads_kv_, int64_t head_dim_, std::vector<int64_t> capacity,
            std::mt19937_64& rng)
      : page_size(page_size_), heads_kv(heads_kv_), head_dim(head_dim_), dtype(dt) {
    batch = static_cast<int64_t>(capacity.size());
    max_pages = 1;
    for (int64_t c : capacity) max_pages = std::max(max_pages, (c + page_size - 1) / page_size);
    num_pages = batch * max_pages + 3;  // spare pages nobody uses
    k = Buffer(dt, num_pages * page_size * heads_kv * head_dim, Device::cpu());
    v = Buffer(dt, k.count(), Device::cpu());
    if (dt == DType::kF8E4M3) {
      for (int64_t i = 0; i < k.count(); ++i) {
        std::uniform_int_distribution<int> bits(0, 255);
        uint8_t x = static_cast<uint8_t>(bits(rng));
        if ((x & 0x7F) == 0x7F) x = 0x30;  // no NaN
        static_cast<uint8_t*>(k.data())[i] = x;
        x = static_cast<uint8_t>(bits(rng));
        if ((x & 0x7F) == 0x7F) x = 0x38;
        static_cast<uint8_t*>(v.data())[i] = x;
      }
      k_scale = Buffer(DType::kF32, heads_kv, Device::cpu());
      v_scale = Buffer(DType::kF32, heads_kv, Device::cpu());
      for (int64_t h = 0; h < heads_kv; ++h) {
        static_cast<float*>(k_scale.data())[h] = std::ldexp(1.0f, -6 - static_cast<int>(h % 3));
        static_cast<float*>(v_scale.data())[h] = std::ldexp(1.0f, -7 + static_cast<int>(h % 2));
      }
    } else {
      fill_random(k, rng);
      fill_random(v, rng);
    }
    std::vector<int32_t> pages(static_cast<size_t>(num_pages));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    table = Buffer(DType::kI32, batch * max_pages, Device::cpu());
    for (int64_t i = 0; i < batch * max_pages; ++i) static_cast<int32_t*>(table.data())[i] = pages[static_cast<size_t>(i)];
  }
  int32_t* entries() { return static_cast<int32_t*>(table.data()); }
  PagedKVCacheView view() const {
    PagedKVCacheView c;
    c.k_pages = k.view({num_pages, page_size, heads_kv, head_dim});
    c.v_pages = v.view({num_pages, page_size, heads_kv, head_dim});
    if (dtype == DType::kF8E4M3) c.k_scale = k_scale.view({heads_kv}), c.v_scale = v_scale.view({heads_kv});
    return c;
  }
  TensorView table_view() const { return table.view({batch, max_pages}); }
  KvCachePages pages() const {
    KvCachePages p;
    p.dtype = dtype, p.num_pages = num_pages, p.page_size = page_size, p.heads_kv = heads_kv, p.head_dim = head_dim;
    p.k_pages = k.data(), p.v_pages = v.data();
    p.k_page = page_size * heads_kv * head_dim, p.k_slot = heads_kv * head_dim, p.k_head = head_dim;
    p.v_page = p.k_page, p.v_slot = p.k_slot, p.v_head = p.k_head;
    if (dtype == DType::kF8E4M3)
      p.k_scale = static_cast<const float*>(k_scale.data()), p.v_scale = static_cast<const float*>(v_scale.data());
    return p;
  }
  KvPageTable table_params() const {
    return {static_cast<const int32_t*>(table.data()), batch, max_pages, max_pages};
  }
};

// One append case (the CPU and CUDA tests share it): a cache of page size 7, B = 3 sequences of S
// new tokens each at positions b * 5 + s * 3 (the last token of sequence 0 padding), H = 2 kv and
// Hq = 4 query heads, random k / v / q; the params the API builds, the float64 reference of the
// append and the cache's K bytes before it.
// A decode (or prefill) made on host copies, as check_kv_decode reads it: q and out (B, q_len,
// heads_q, head_dim) with heads `row` elements apart (0: head_dim) and `gap` rows of padding after
// each sequence's q_len, lse (B, heads_q, q_len) contiguous, the cache's pages and table; alibi
// (H_q) or, alibi_per_batch, (B, H_q).
struct HostDecode {
  DType dtype = DType::kF32;
  int64_t q_len = 1, heads_q = 1, row = 0;
  const Buffer* q = nullptr;
  const Buffer* out = nullptr;
  const Buffer* lse = nullptr;
  const Buffer* lens = nullptr;
  int64_t window = -1;
  double softcap = 0;
  const Buffer* alibi = nullptr;
  bool alibi_per_batch = false;
  int64_t gap = 0;
};

// Expects the call's out and lse to match the float64 reference (scale 1 / sqrt(head_dim)).
inline void expect_decode_matches(const HostCache& cache, const HostDecode& d) {
  const int64_t D = cache.head_dim, row = d.row ? d.row : D, Q = d.q_len, Hq = d.heads_q;
  KvDecodeParams p;
  p.cache = cache.pages(), p.table = cache.table_params();
  p.dtype = d.dtype, p.batch = cache.batch, p.q_len = Q, p.heads_q = Hq;
  p.q = d.q->data(), p.q_b = (Q + d.gap) * Hq * row, p.q_t = Hq * row, p.q_h = row;
  p.out = d.out->data(), p.out_b = p.q_b, p.out_t = p.q_t, p.out_h = p.q_h;
  p.lse = static_cast<float*>(d.lse->data()), p.lse_b = Hq * Q, p.lse_h = Q;
  p.seq_lens = static_cast<const int32_t*>(d.lens->data());
  p.scale = 1.0 / std::sqrt(double(D)), p.window_left = d.window, p.softcap = d.softcap;
  if (d.alibi) p.alibi = static_cast<const float*>(d.alibi->data()), p.alibi_b = d.alibi_per_batch ? Hq : 0;
  const CheckResult r = check_kv_decode(p);
  EXPECT_TRUE(r.passed) << r.first_failure;
}

struct AppendCase {
  static constexpr int64_t B = 3, H = 2, Hq = 4, P = 7;
  int64_t S, D;
  HostCache cache;
  Buffer k, v, q, pos;
  RopeOptions rope;
  KvAppendParams p;
  KvAppendReference ref;
  std::vector<uint8_t> before;

  AppendCase(DType dt, DType cache_dt, RopeLayout layout, int64_t rotary_dim, int64_t S_, int64_t D_,
             std::mt19937_64& rng)
      : S(S_), D(D_), cache(cache_dt, P, H, D_, {64, 64, 64}, rng), k(dt, B * S_ * H * D_, Device::cpu()),
        v(dt, k.count(), Device::cpu()), q(dt, B * S_ * Hq * D_, Device::cpu()), pos(DType::kI32, B * S_, Device::cpu()) {
    fill_random(k, rng, -2, 2), fill_random(v, rng, -2, 2), fill_random(q, rng, -2, 2);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) static_cast<int32_t*>(pos.data())[b * S + s] = static_cast<int32_t>(b * 5 + s * 3);
    static_cast<int32_t*>(pos.data())[S - 1] = -1;  // padding
    rope.layout = layout, rope.rotary_dim = rotary_dim;
    p.cache = cache.pages(), p.table = cache.table_params(), p.dtype = dt, p.new_tokens = S;
    p.k = k.data(), p.v = v.data(), p.k_b = S * H * D, p.k_s = H * D, p.k_h = D, p.v_b = p.k_b, p.v_s = p.k_s, p.v_h = D;
    p.positions = static_cast<const int32_t*>(pos.data()), p.pos_b = S;
    p.q = q.data(), p.q_b = S * Hq * D, p.q_s = Hq * D, p.q_h = D, p.heads_q = Hq;
    p.rope = layout, p.rope_theta = 10000.0, p.rotary_dim = rotary_dim == 0 ? D : rotary_dim;
    ref = kv_append_reference_f64(p);
    before.resize(cache.k.bytes());
    std::memcpy(before.data(), cache.k.data(), before.size());
  }

  // After the append (the cache and q back on the host): the reference's rule, and every slot the
  // append did not write keeps its bytes.
  void check() const {
    const CheckResult r = check_kv_append(p, ref);
    EXPECT_TRUE(r.passed) << r.first_failure;
    EXPECT_GT(r.checked, 0);
    const int64_t slot_bytes = H * D * static_cast<int64_t>(dtype_size(cache.dtype));
    for (int64_t i = 0; i < cache.num_pages * P; ++i)
      if (!ref.written[static_cast<size_t>(i)]) {
        ASSERT_EQ(0, std::memcmp(before.data() + i * slot_bytes, static_cast<const uint8_t*>(cache.k.data()) + i * slot_bytes,
                                 static_cast<size_t>(slot_bytes)))
            << "slot " << i << " changed";
      }
  }
};

}  // namespace optimized::testing
