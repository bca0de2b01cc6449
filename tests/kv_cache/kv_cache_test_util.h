// Shared machinery of the KV-cache tests: a host cache with scattered (shuffled) pages, random
// data seeded from the test's name, and the params the public API would build (for the checks).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "common/test_util.h"
#include "kv_cache/kv_cache_params.h"
#include "optimized/buffer.h"
#include "optimized/kv_cache.h"

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

}  // namespace optimized::testing
