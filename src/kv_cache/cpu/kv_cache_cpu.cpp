// cpu_kv_append / cpu_kv_decode: the CPU rung of the KV-cache family (include/optimized/kv_cache.h),
// the readable statement of what the CUDA rungs will do. fp64 runs in fp64 throughout.
//
// Append, one new token (b, s) at a time, threads (OpenMP) over all of them:
//   position p = positions[b][s] (< 0: padding, skipped); page = page_table[b][p / page_size],
//   slot = p % page_size (a page index past the row or outside [0, num_pages): skipped, never
//   written, so that the unchecked mode stays inside the cache);
//   k row widened to the math type A, rotated (RoPE: angle = p * theta^(-2i / rotary_dim), formed in fp64),
//   stored rounded to the cache dtype, or for fp8 as e4m3(x / scale) with x / scale saturated to
//   +-448 (NaN kept); v stored alike (no rotation); q rotated in place when given.
//
// Decode, one (sequence b, kv head g) at a time, threads over them (the group's query heads share
// each K / V row read, as the GPU rungs do):
//   query t sits at position pos_t = seq_len - q_len + t and sees keys j in
//   [max(0, pos_t - window_left), min(pos_t + 1, L)), L = seq_len clipped to the table's pages;
//   a key whose page index is outside [0, num_pages) is masked (unchecked mode: never read);
//   s = scale q . k_j; soft-cap; minus slope |pos_t - j|; m = max (NaN propagates);
//   m = -inf (nothing visible): out 0, lse -inf; else p_j = exp(s_j - m), out = sum p_j v_j / sum p_j,
//   lse = m + log(sum p_j) (fp32).
#include "core/cpu_loops.h"
#include "kv_cache/cpu/kv_cache_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/host_dtype.h"
#include "kernels/rope.h"
#include "optimized/buffer.h"

namespace optimized {
namespace {

using namespace host;  // F32, F64, F16, BF16

// The cache page of token position `pos` of sequence b; -1 when the table or the cache has none.
int64_t page_of(const KvCachePages& c, const KvPageTable& t, int64_t b, int64_t pos) {
  const int64_t p = pos / c.page_size;
  if (pos < 0 || p >= t.max_pages) return -1;
  const int64_t e = t.entries[b * t.row + p];
  return (e < 0 || e >= c.num_pages) ? -1 : e;
}

// One row (head_dim values) of K or V of the cache, widened to A (fp8: dequantized with `scale`).
template <class D>
void load_cache_row(const KvCachePages& c, const void* pages, int64_t at, float scale, typename D::Acc* dst) {
  using A = typename D::Acc;
  if (c.dtype == DType::kF8E4M3) {
    const auto* src = static_cast<const uint8_t*>(pages) + at;
    for (int64_t d = 0; d < c.head_dim; ++d) dst[d] = static_cast<A>(fp8_e4m3_to_float(src[d]) * scale);
  } else {
    const auto* src = static_cast<const typename D::T*>(pages) + at;
    for (int64_t d = 0; d < c.head_dim; ++d) dst[d] = D::load(src[d]);
  }
}

template <class D>
void store_cache_row(const KvCachePages& c, void* pages, int64_t at, float scale, const typename D::Acc* src) {
  if (c.dtype == DType::kF8E4M3) {
    auto* dst = static_cast<uint8_t*>(pages) + at;
    for (int64_t d = 0; d < c.head_dim; ++d) {
      double x = static_cast<double>(src[d]) / static_cast<double>(scale);
      if (x > 448.0) x = 448.0;  // saturate (NaN fails both comparisons: kept)
      if (x < -448.0) x = -448.0;
      dst[d] = float_to_fp8_e4m3(x);
    }
  } else {
    auto* dst = static_cast<typename D::T*>(pages) + at;
    for (int64_t d = 0; d < c.head_dim; ++d) dst[d] = D::store(src[d]);
  }
}

// RoPE on x (head_dim values) in place, in A: the angles of src/kernels/rope.h (formed and reduced
// in fp64, shared with the fused family's rope), cos / sin rounded to A.
template <class A>
void rope(A* x, int64_t pos, RopeLayout layout, double theta, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  const bool neox = layout == RopeLayout::kNeox;
  for (int64_t i = 0; i < half; ++i) {
    const double r = kernels::rope_reduced_angle(pos, kernels::rope_inv_freq(i, rotary_dim, theta));
    const A c = static_cast<A>(std::cos(r)), s = static_cast<A>(std::sin(r));
    const int64_t i0 = kernels::rope_first(neox, i), i1 = kernels::rope_second(neox, i, half);
    kernels::rope_rotate<A>(x[i0], x[i1], c, s, &x[i0], &x[i1]);
  }
}

template <class D>
void append(const KvAppendParams& p, int threads) {
  using A = typename D::Acc;
  const KvCachePages& c = p.cache;
  const int64_t Dh = c.head_dim, S = p.new_tokens, items = p.table.batch * S;
  const bool rotate = p.rope != RopeLayout::kNone;
  const int nth = cpu_thread_count(threads, items);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> x(static_cast<size_t>(Dh));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / S, s = item % S;
      const int64_t pos = p.positions[b * p.pos_b + s];
      if (pos < 0) continue;  // padding
      if (rotate && p.q) {  // q rotates whatever the cache holds for the token
        for (int64_t h = 0; h < p.heads_q; ++h) {
          auto* q = static_cast<typename D::T*>(p.q) + b * p.q_b + s * p.q_s + h * p.q_h;
          for (int64_t d = 0; d < Dh; ++d) x[d] = D::load(q[d]);
          rope(x.data(), pos, p.rope, p.rope_theta, p.rotary_dim);
          for (int64_t d = 0; d < Dh; ++d) q[d] = D::store(x[d]);
        }
      }
      const int64_t page = page_of(c, p.table, b, pos);
      if (page < 0) continue;  // unchecked mode: outside the table or the cache
      const int64_t slot = pos % c.page_size;
      for (int64_t h = 0; h < c.heads_kv; ++h) {
        const auto* k = static_cast<const typename D::T*>(p.k) + b * p.k_b + s * p.k_s + h * p.k_h;
        for (int64_t d = 0; d < Dh; ++d) x[d] = D::load(k[d]);
        if (rotate) rope(x.data(), pos, p.rope, p.rope_theta, p.rotary_dim);
        store_cache_row<D>(c, c.k_pages, page * c.k_page + slot * c.k_slot + h * c.k_head,
                           c.k_scale ? c.k_scale[h] : 1.0f, x.data());
        const auto* v = static_cast<const typename D::T*>(p.v) + b * p.v_b + s * p.v_s + h * p.v_h;
        for (int64_t d = 0; d < Dh; ++d) x[d] = D::load(v[d]);
        store_cache_row<D>(c, c.v_pages, page * c.v_page + slot * c.v_slot + h * c.v_head,
                           c.v_scale ? c.v_scale[h] : 1.0f, x.data());
      }
    }
  }
}

template <class D>
void decode(const KvDecodeParams& p, int threads) {
  using A = typename D::Acc;
  const KvCachePages& c = p.cache;
  const int64_t Dh = c.head_dim, G = p.group(), Q = p.q_len, rows = G * Q;
  const int64_t capacity = p.table.max_pages * c.page_size;
  const int64_t items = p.batch * c.heads_kv;
  const int nth = cpu_thread_count(threads, items);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> q(static_cast<size_t>(rows * Dh)), o(static_cast<size_t>(rows * Dh)), kv(static_cast<size_t>(Dh));
    std::vector<A> s, m(static_cast<size_t>(rows)), l(static_cast<size_t>(rows)), slope(static_cast<size_t>(G));
    std::vector<int64_t> lo(static_cast<size_t>(rows)), hi(static_cast<size_t>(rows)), pos(static_cast<size_t>(rows));
    std::vector<int64_t> pages;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / c.heads_kv, g = item % c.heads_kv;
      const int64_t seq_len = p.seq_lens[b];
      const int64_t L = std::clamp<int64_t>(seq_len, 0, capacity);
      // Key range of every (head, query) row r = hh * Q + t; the union [klo, khi).
      int64_t klo = L, khi = 0;
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        slope[hh] = p.alibi ? static_cast<A>(p.alibi[b * p.alibi_b + h]) : A(0);
        for (int64_t t = 0; t < Q; ++t) {
          const int64_t r = hh * Q + t, pt = seq_len - Q + t;
          pos[r] = pt;
          lo[r] = p.window_left >= 0 ? std::max<int64_t>(0, pt - p.window_left) : 0;
          hi[r] = std::max(lo[r], std::min(pt + 1, L));
          if (hi[r] > lo[r]) klo = std::min(klo, lo[r]), khi = std::max(khi, hi[r]);
          const auto* qr = static_cast<const typename D::T*>(p.q) + b * p.q_b + t * p.q_t + h * p.q_h;
          for (int64_t d = 0; d < Dh; ++d) q[r * Dh + d] = D::load(qr[d]);
        }
      }
      const int64_t n = std::max<int64_t>(0, khi - klo);
      pages.assign(static_cast<size_t>(n), -1);
      for (int64_t j = klo; j < khi; ++j) pages[j - klo] = page_of(c, p.table, b, j);
      s.assign(static_cast<size_t>(rows * std::max<int64_t>(n, 1)), -INFINITY);
      const A scale = static_cast<A>(p.scale), cap = static_cast<A>(p.softcap);
      const float ks = c.k_scale ? c.k_scale[g] : 1.0f, vs = c.v_scale ? c.v_scale[g] : 1.0f;
      // Scores: each K row read once for the whole group.
      for (int64_t j = klo; j < khi; ++j) {
        const int64_t page = pages[j - klo];
        if (page < 0) continue;  // masked
        load_cache_row<D>(c, c.k_pages, page * c.k_page + (j % c.page_size) * c.k_slot + g * c.k_head, ks, kv.data());
        for (int64_t r = 0; r < rows; ++r) {
          if (j < lo[r] || j >= hi[r]) continue;
          A dot = 0;
          for (int64_t d = 0; d < Dh; ++d) dot += q[r * Dh + d] * kv[d];
          A v = scale * dot;
          if (cap > A(0)) v = cap * std::tanh(v / cap);
          const A sl = slope[r / Q];
          if (sl != A(0)) v -= sl * static_cast<A>(std::llabs(pos[r] - j));
          s[r * n + (j - klo)] = v;
        }
      }
      // Row maxima (NaN propagates, as torch's max does).
      for (int64_t r = 0; r < rows; ++r) {
        A mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) {
          const A v = s[r * n + j];
          if (std::isnan(v)) { mx = v; break; }
          if (v > mx) mx = v;
        }
        m[r] = mx;
        l[r] = 0;
      }
      std::fill(o.begin(), o.end(), A(0));
      for (int64_t j = klo; j < khi; ++j) {
        const int64_t page = pages[j - klo];
        if (page < 0) continue;
        bool loaded = false;
        for (int64_t r = 0; r < rows; ++r) {
          if (j < lo[r] || j >= hi[r] || m[r] == -INFINITY) continue;
          if (!loaded) {
            load_cache_row<D>(c, c.v_pages, page * c.v_page + (j % c.page_size) * c.v_slot + g * c.v_head, vs,
                              kv.data());
            loaded = true;
          }
          const A pj = std::exp(s[r * n + (j - klo)] - m[r]);
          l[r] += pj;
          for (int64_t d = 0; d < Dh; ++d) o[r * Dh + d] += pj * kv[d];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t hh = r / Q, t = r % Q, h = g * G + hh;
        float lse = -INFINITY;
        if (!(m[r] == -INFINITY)) {
          const A inv = A(1) / l[r];
          for (int64_t d = 0; d < Dh; ++d) o[r * Dh + d] *= inv;
          lse = static_cast<float>(m[r] + std::log(l[r]));
        }
        auto* orow = static_cast<typename D::T*>(p.out) + b * p.out_b + t * p.out_t + h * p.out_h;
        for (int64_t d = 0; d < Dh; ++d) orow[d] = D::store(o[r * Dh + d]);
        if (p.lse) p.lse[b * p.lse_b + h * p.lse_h + t] = lse;
      }
    }
  }
}

// The gather of prefill's attention path, as cuda/gather.cu: the offsets cu_q / cu_k, then key j of
// sequence b (j < L_b = seq_lens[b] clipped to [0, len]) at packed row cu_k[b] + j, zeros where the
// key has no page. fp8 dequantized (e4m3 * scale), then rounded to the buffers' dtype.
template <class D>
void gather(const KvGatherParams& g, int threads) {
  using A = typename D::Acc;
  const KvCachePages& c = g.cache;
  const int64_t Dh = c.head_dim, HD = c.heads_kv * Dh;
  auto clipped = [&](int64_t b) { return std::clamp<int64_t>(g.seq_lens[b], 0, g.len); };
  int64_t total = 0;
  for (int64_t b = 0; b <= g.batch; ++b) {
    g.cu_q[b] = static_cast<int32_t>(b * g.q_len);  // the caller keeps batch * len, batch * q_len < 2^31
    g.cu_k[b] = static_cast<int32_t>(total);
    if (b < g.batch) total += clipped(b);
  }
  const int64_t rows = g.batch * g.len;
  const int nth = cpu_thread_count(threads, rows);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> x(static_cast<size_t>(Dh));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t b = row / g.len, j = row % g.len;
      if (j >= clipped(b)) continue;
      const int64_t page = page_of(c, g.table, b, j);
      auto* ko = static_cast<typename D::T*>(g.k_out) + (g.cu_k[b] + j) * HD;
      auto* vo = static_cast<typename D::T*>(g.v_out) + (g.cu_k[b] + j) * HD;
      for (int64_t h = 0; h < c.heads_kv; ++h) {
        for (int pass = 0; pass < 2; ++pass) {
          auto* dst = (pass == 0 ? ko : vo) + h * Dh;
          if (page < 0) {
            for (int64_t d = 0; d < Dh; ++d) dst[d] = D::store(A(0));
            continue;
          }
          const int64_t slot = j % c.page_size;
          if (pass == 0)
            load_cache_row<D>(c, c.k_pages, page * c.k_page + slot * c.k_slot + h * c.k_head,
                              c.k_scale ? c.k_scale[h] : 1.0f, x.data());
          else
            load_cache_row<D>(c, c.v_pages, page * c.v_page + slot * c.v_slot + h * c.v_head,
                              c.v_scale ? c.v_scale[h] : 1.0f, x.data());
          for (int64_t d = 0; d < Dh; ++d) dst[d] = D::store(x[d]);
        }
      }
    }
  }
}

}  // namespace

void cpu_kv_append(const KvAppendParams& params, int threads) {
  if (params.table.batch <= 0 || params.new_tokens <= 0 || params.cache.heads_kv <= 0) return;
  host::visit_traits(params.dtype, [&]<class D>() { append<D>(params, threads); });
}

void cpu_kv_gather(const KvGatherParams& params, int threads) {
  if (params.batch <= 0) return;
  host::visit_traits(params.dtype, [&]<class D>() { gather<D>(params, threads); });
}

void cpu_kv_decode(const KvDecodeParams& params, int threads) {
  if (params.batch <= 0 || params.heads_q <= 0 || params.cache.heads_kv <= 0) return;
  host::visit_traits(params.dtype, [&]<class D>() { decode<D>(params, threads); });
}

}  // namespace optimized
