// The KV-cache family's references and checks (kv_cache_reference.h).
#include "testing/kv_cache_reference.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "attention/attention_params.h"
#include "optimized/buffer.h"
#include "testing/attention_check.h"
#include "testing/attention_reference.h"
#include "testing/tolerance.h"

namespace optimized::testing {

void rope_f64(double* x, int64_t pos, RopeLayout layout, double theta, int64_t rotary_dim) {
  if (layout == RopeLayout::kNone) return;
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(i) / rotary_dim);
    const double c = std::cos(angle), s = std::sin(angle);
    const int64_t i0 = layout == RopeLayout::kNeox ? i : 2 * i, i1 = layout == RopeLayout::kNeox ? i + half : 2 * i + 1;
    const double x0 = x[i0], x1 = x[i1];
    x[i0] = x0 * c - x1 * s;
    x[i1] = x1 * c + x0 * s;
  }
}

namespace {

int64_t page_of(const KvCachePages& c, const KvPageTable& t, int64_t b, int64_t pos) {
  const int64_t p = pos / c.page_size;
  if (pos < 0 || p >= t.max_pages) return -1;
  const int64_t e = t.entries[b * t.row + p];
  return (e < 0 || e >= c.num_pages) ? -1 : e;
}

double cache_value(const KvCachePages& c, const void* pages, int64_t at, const float* scale, int64_t h) {
  if (c.dtype == DType::kF8E4M3)
    return static_cast<double>(fp8_e4m3_to_float(static_cast<const uint8_t*>(pages)[at]) * scale[h]);
  return load_as_double(pages, c.dtype, at);
}

}  // namespace

CheckResult check_kv_decode(const KvDecodeParams& p) {
  const KvCachePages& c = p.cache;
  const int64_t D = c.head_dim, Hq = p.heads_q, Hkv = c.heads_kv, Q = p.q_len;
  const int64_t capacity = p.table.max_pages * c.page_size;
  CheckResult all;
  all.passed = true;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t L = std::max<int64_t>(0, p.seq_lens[b]);
    Buffer q(p.dtype, Q * Hq * D, Device::cpu()), out(p.dtype, Q * Hq * D, Device::cpu());
    Buffer k(p.dtype, std::max<int64_t>(1, L * Hkv * D), Device::cpu()), v(p.dtype, std::max<int64_t>(1, L * Hkv * D), Device::cpu());
    std::vector<uint8_t> mask(static_cast<size_t>(std::max<int64_t>(1, L)), 1);
    bool masked = false;
    for (int64_t t = 0; t < Q; ++t)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t to = (t * Hq + h) * D + d;
          store_from_double(q.data(), p.dtype, to, load_as_double(p.q, p.dtype, b * p.q_b + t * p.q_t + h * p.q_h + d));
          store_from_double(out.data(), p.dtype, to,
                            load_as_double(p.out, p.dtype, b * p.out_b + t * p.out_t + h * p.out_h + d));
        }
    for (int64_t j = 0; j < L; ++j) {
      const int64_t page = j < capacity ? page_of(c, p.table, b, j) : -1;
      if (page < 0) masked = true, mask[static_cast<size_t>(j)] = 0;
      for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t to = (j * Hkv + g) * D + d;
          double kx = 0, vx = 0;
          if (page >= 0) {
            const int64_t slot = j % c.page_size;
            kx = cache_value(c, c.k_pages, page * c.k_page + slot * c.k_slot + g * c.k_head + d, c.k_scale, g);
            vx = cache_value(c, c.v_pages, page * c.v_page + slot * c.v_slot + g * c.v_head + d, c.v_scale, g);
          }
          store_from_double(k.data(), p.dtype, to, kx);
          store_from_double(v.data(), p.dtype, to, vx);
        }
    }
    AttentionParams a;
    a.dtype = p.dtype;
    a.batch = 1, a.seqlen_q = Q, a.seqlen_k = L, a.heads_q = Hq, a.heads_kv = Hkv, a.head_dim = D;
    a.total_q = Q, a.total_k = L;
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out.data();
    a.q_s = {0, Hq * D, D}, a.out_s = a.q_s, a.k_s = {0, Hkv * D, D}, a.v_s = a.k_s;
    a.scale = p.scale, a.causal = true, a.window_left = p.window_left, a.window_right = 0, a.softcap = p.softcap;
    a.alibi = p.alibi ? p.alibi + b * p.alibi_b : nullptr;
    if (masked) a.mask = mask.data(), a.mask_dtype = DType::kBool, a.mask_s[3] = 1;
    const AttentionExpected e = attention_expected(a);
    const std::string where = "b=" + std::to_string(b) + ": ";
    all.merge(check_attention_output(a, e, AttentionOutput::kOut, read_attention_output(a, AttentionOutput::kOut)), where);
    if (p.lse) {
      ReductionRule rule = attention_rule(a, AttentionOutput::kLse);
      rule.out = DType::kF32;
      CheckResult r;
      for (int64_t t = 0; t < Q; ++t)
        for (int64_t h = 0; h < Hq; ++h) {
          const size_t u = static_cast<size_t>(t * Hq + h);
          const double got = p.lse[b * p.lse_b + h * p.lse_h + t];
          const double terms = u < e.terms.lse.size() ? e.terms.lse[u] : 0.0;
          check_reduction_unit(rule, &got, &e.ref.lse[u], &e.same.lse[u], 1, terms,
                               [&](int64_t) { return "lse[b=" + std::to_string(b) + ", h=" + std::to_string(h) +
                                                     ", t=" + std::to_string(t) + "]"; },
                               r);
        }
      if (Q * Hq == 0) r.passed = true;
      all.merge(r);
    }
  }
  return all;
}

KvAppendReference kv_append_reference_f64(const KvAppendParams& p) {
  const KvCachePages& c = p.cache;
  const int64_t D = c.head_dim, H = c.heads_kv, P = c.page_size, S = p.new_tokens, B = p.table.batch;
  const double u_acc = p.dtype == DType::kF64 ? std::ldexp(1.0, -52) : std::ldexp(1.0, -23);
  KvAppendReference r;
  r.k.assign(static_cast<size_t>(c.num_pages * P * H * D), 0.0);
  r.v = r.k, r.k_bound = r.k;
  r.written.assign(static_cast<size_t>(c.num_pages * P), 0);
  if (p.q) r.q.assign(static_cast<size_t>(B * S * p.heads_q * D), 0.0), r.q_bound = r.q;
  std::vector<double> x(static_cast<size_t>(D));
  auto bound = [&](const std::vector<double>& in, int64_t pos, int64_t d) {
    // float angle / sin / cos errors: ~ (|pos| + 4) u_acc times the pair's magnitude.
    double m = 0;
    for (double y : in) m = std::max(m, std::fabs(y));
    return p.rope == RopeLayout::kNone || d >= p.rotary_dim ? 0.0 : 8.0 * (std::fabs(double(pos)) + 4.0) * u_acc * m;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s) {
      const int64_t pos = p.positions[b * p.pos_b + s];
      if (pos < 0) continue;
      if (p.q)  // rotated with rope; as given without
        for (int64_t h = 0; h < p.heads_q; ++h) {
          for (int64_t d = 0; d < D; ++d) x[d] = load_as_double(p.q, p.dtype, b * p.q_b + s * p.q_s + h * p.q_h + d);
          const std::vector<double> in = x;
          rope_f64(x.data(), pos, p.rope, p.rope_theta, p.rotary_dim);
          for (int64_t d = 0; d < D; ++d) {
            const size_t at = static_cast<size_t>(((b * S + s) * p.heads_q + h) * D + d);
            r.q[at] = x[d];
            r.q_bound[at] = bound(in, pos, d);
          }
        }
      const int64_t page = page_of(c, p.table, b, pos);
      if (page < 0) continue;
      const int64_t slot = pos % P;
      r.written[static_cast<size_t>(page * P + slot)] = 1;
      for (int64_t h = 0; h < H; ++h) {
        const size_t base = static_cast<size_t>(((page * P + slot) * H + h) * D);
        for (int64_t d = 0; d < D; ++d) x[d] = load_as_double(p.k, p.dtype, b * p.k_b + s * p.k_s + h * p.k_h + d);
        const std::vector<double> in = x;
        rope_f64(x.data(), pos, p.rope, p.rope_theta, p.rotary_dim);
        for (int64_t d = 0; d < D; ++d) {
          r.k[base + d] = x[d];
          r.k_bound[base + d] = bound(in, pos, d);
          r.v[base + d] = load_as_double(p.v, p.dtype, b * p.v_b + s * p.v_s + h * p.v_h + d);
        }
      }
    }
  return r;
}

namespace {

// One element: got against ref (the exact value before rounding to the storage), allowed a
// rounding of the storage (fp8: 2^-4 relative plus its subnormal step) and `extra`.
void check_element(double got, double ref, DType storage, double scale, double extra, const std::string& name,
                   CheckResult& into) {
  double allowed;
  if (storage == DType::kF8E4M3) {
    const double x = std::isnan(ref) ? ref : std::clamp(ref / scale, -448.0, 448.0);
    ref = x * scale;
    allowed = (std::ldexp(1.0, -4) * std::fabs(x) + std::ldexp(1.0, -10)) * scale + extra;
  } else {
    allowed = unit_roundoff(storage) * std::fabs(ref) + half_subnormal_step(storage) + extra;
  }
  double ratio = 0;
  const bool ok = element_ok(got, ref, std::max(allowed, 1e-300), &ratio);
  ++into.checked;
  into.worst_ratio = std::max(into.worst_ratio, ratio);
  if (!ok) {
    if (into.failures++ == 0)
      into.first_failure = name + " = " + std::to_string(got) + ", expected " + std::to_string(ref) + " (allowed " +
                           std::to_string(allowed) + ")";
  }
}

}  // namespace

CheckResult check_kv_append(const KvAppendParams& p, const KvAppendReference& ref) {
  const KvCachePages& c = p.cache;
  const int64_t D = c.head_dim, H = c.heads_kv, P = c.page_size;
  CheckResult r;
  for (int64_t page = 0; page < c.num_pages; ++page)
    for (int64_t slot = 0; slot < P; ++slot) {
      if (!ref.written[static_cast<size_t>(page * P + slot)]) continue;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const size_t at = static_cast<size_t>(((page * P + slot) * H + h) * D + d);
          const std::string where = "[page=" + std::to_string(page) + ", slot=" + std::to_string(slot) +
                                    ", h=" + std::to_string(h) + ", d=" + std::to_string(d) + "]";
          const double ks = c.k_scale ? c.k_scale[h] : 1.0, vs = c.v_scale ? c.v_scale[h] : 1.0;
          check_element(cache_value(c, c.k_pages, page * c.k_page + slot * c.k_slot + h * c.k_head + d, c.k_scale, h),
                        ref.k[at], c.dtype, ks, ref.k_bound[at], "k_pages" + where, r);
          check_element(cache_value(c, c.v_pages, page * c.v_page + slot * c.v_slot + h * c.v_head + d, c.v_scale, h),
                        ref.v[at], c.dtype, vs, 0.0, "v_pages" + where, r);
        }
    }
  if (p.q && !ref.q.empty()) {
    const int64_t S = p.new_tokens;
    for (int64_t b = 0; b < p.table.batch; ++b)
      for (int64_t s = 0; s < S; ++s) {
        if (p.positions[b * p.pos_b + s] < 0) continue;
        for (int64_t h = 0; h < p.heads_q; ++h)
          for (int64_t d = 0; d < D; ++d) {
            const size_t at = static_cast<size_t>(((b * S + s) * p.heads_q + h) * D + d);
            check_element(load_as_double(p.q, p.dtype, b * p.q_b + s * p.q_s + h * p.q_h + d), ref.q[at], p.dtype, 1.0,
                          ref.q_bound[at],
                          "q[b=" + std::to_string(b) + ", s=" + std::to_string(s) + ", h=" + std::to_string(h) +
                              ", d=" + std::to_string(d) + "]",
                          r);
          }
      }
  }
  r.passed = r.failures == 0;
  r.max_rel_error = 0;
  return r;
}

}  // namespace optimized::testing
