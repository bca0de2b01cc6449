#include "moe/cpu/moe_cpu.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <vector>

#include "core/cpu_loops.h"
#include "optimized/buffer.h"

namespace optimized::cpu {

namespace {

float load(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}
void store(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kF16: static_cast<uint16_t*>(base)[i] = float_to_half(v); return;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); return;
    default: static_cast<float*>(base)[i] = v;
  }
}


inline float load_logit(const MoeRouteParams& p, int64_t t, int64_t e) { return load(p.logits, p.dtype, t * p.ld + e); }

inline bool is_nan(float x) { return x != x; }

// a ranks above b (NaN below every number; equal values: neither, so the earlier index stays).
inline bool ranks_above(float a, float b) {
  if (is_nan(a)) return false;
  if (is_nan(b)) return true;
  return a > b;
}

// Routes token t (moe.h's rule): one thread a token; cuda/route.cu runs the same rule a warp a token.
void route_token(const MoeRouteParams& p, int64_t t) {
  const int64_t E = p.experts;
  // softmax statistics: the max of the numbers, the sum of exp; a NaN logit makes both NaN
  float m = -INFINITY;
  bool nan = false;
  for (int64_t e = 0; e < E; ++e) {
    const float l = load_logit(p, t, e);
    if (is_nan(l)) nan = true;
    else if (l > m) m = l;
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += expf(load_logit(p, t, e) - m);
  if (nan) sum = NAN;
  if (p.lse) p.lse[t] = nan ? NAN : m + logf(sum);
  const bool softmax = p.scoring == 0;
  // The score (the weight before normalize) and the choice score of expert e.
  const auto score = [&](int64_t e) -> float {
    const float l = load_logit(p, t, e);
    if (softmax) return expf(l - m) / sum;
    return 1.0f / (1.0f + expf(-l));
  };
  const auto choice = [&](int64_t e) -> float {
    // softmax without a bias chooses on the logits (the same order as the probabilities, and a NaN
    // logit then ranks only itself last); topk_softmax always does
    if (softmax && (p.topk_softmax || !p.bias)) return load_logit(p, t, e) + (p.bias ? p.bias[e] : 0.0f);
    return score(e) + (p.bias ? p.bias[e] : 0.0f);
  };
  // group-limited routing: the groups allowed (a bit each)
  uint64_t allowed = ~uint64_t(0);
  const int64_t gsize = E / p.n_groups;
  if (p.n_groups > 1) {
    float gscore[kMoeMaxGroups];
    for (int g = 0; g < p.n_groups; ++g) {
      float b1 = NAN, b2 = NAN;  // the group's two best choice scores
      for (int64_t e = g * gsize; e < (g + 1) * gsize; ++e) {
        const float c = choice(e);
        if (ranks_above(c, b1)) b2 = b1, b1 = c;
        else if (ranks_above(c, b2)) b2 = c;
      }
      gscore[g] = gsize == 1 ? b1 : b1 + b2;
    }
    allowed = 0;
    for (int j = 0; j < p.topk_groups; ++j) {
      int best = -1;
      for (int g = 0; g < p.n_groups; ++g)
        if (!(allowed >> g & 1) && (best < 0 || ranks_above(gscore[g], gscore[best]))) best = g;
      allowed |= uint64_t(1) << best;
    }
  }
  // top-k, best first
  int32_t* ids = p.ids + t * p.k;
  float* w = p.weights + t * p.k;
  for (int j = 0; j < p.k; ++j) {
    int64_t best = -1;
    float best_c = NAN;
    for (int64_t e = 0; e < E; ++e) {
      if (p.n_groups > 1 && !(allowed >> (e / gsize) & 1)) continue;
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (taken) continue;
      const float c = choice(e);
      if (best < 0 || ranks_above(c, best_c)) best = e, best_c = c;
    }
    ids[j] = static_cast<int32_t>(best);
  }
  // weights
  float total = 0.0f;
  if (softmax && p.topk_softmax) {
    float mk = -INFINITY;
    for (int j = 0; j < p.k; ++j) {
      const float l = load_logit(p, t, ids[j]);
      if (l > mk) mk = l;
    }
    float s = 0.0f;
    for (int j = 0; j < p.k; ++j) s += expf(load_logit(p, t, ids[j]) - mk);
    for (int j = 0; j < p.k; ++j) w[j] = nan ? NAN : expf(load_logit(p, t, ids[j]) - mk) / s;
  } else {
    for (int j = 0; j < p.k; ++j) w[j] = score(ids[j]);
  }
  for (int j = 0; j < p.k; ++j) total += w[j];
  for (int j = 0; j < p.k; ++j) w[j] = (p.normalize ? w[j] / total : w[j]) * p.routed_scale;
}

// The router's backward of token t (moe.h's rule): each pair j adds add[j] at expert ids[j], and where
// a softmax term is live every expert adds p[e] coef (coef: grad_lse, minus sum_j g_j s_j for the
// plain softmax). cuda/route_backward.cu runs the same rule a warp a token.
void route_backward_token(const MoeRouteBackwardParams& p, int64_t t) {
  const int64_t E = p.experts;
  const int k = p.k;
  const auto logit = [&](int64_t e) { return load(p.logits, p.dtype, t * p.ld + e); };
  // softmax statistics, as the forward's
  float m = -INFINITY;
  bool nan = false;
  for (int64_t e = 0; e < E; ++e) {
    const float l = logit(e);
    if (is_nan(l)) nan = true;
    else if (l > m) m = l;
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < E; ++e) sum += expf(logit(e) - m);
  if (nan) sum = NAN;
  // the pairs: g_j = routed_scale grad_weights, the logit of each (pairs with an id out of range: out)
  const int32_t* ids = p.ids + t * k;
  bool valid[kMoeMaxTopK], has_w = false;
  float g[kMoeMaxTopK], lj[kMoeMaxTopK], add[kMoeMaxTopK];
  for (int j = 0; j < k; ++j) {
    valid[j] = ids[j] >= 0 && ids[j] < E;
    g[j] = valid[j] && p.grad_weights ? p.grad_weights[t * k + j] * p.routed_scale : 0.0f;
    lj[j] = valid[j] ? logit(ids[j]) : 0.0f;
    add[j] = 0.0f;
    has_w = has_w || g[j] != 0.0f;  // a NaN gradient counts: it propagates
  }
  const float gl = p.grad_lse ? p.grad_lse[t] : 0.0f;
  bool dense = gl != 0.0f;  // whether every expert gets p[e] coef
  float coef = dense ? gl : 0.0f;
  const bool softmax = p.scoring == 0;
  if (has_w && softmax && (p.topk_softmax || p.normalize)) {
    // q = the softmax over the chosen logits (normalize's p[id_j] / sum_i p[id_i] is the same q)
    float mk = -INFINITY, sk = 0.0f, dot = 0.0f, q[kMoeMaxTopK];
    for (int j = 0; j < k; ++j)
      if (valid[j] && lj[j] > mk) mk = lj[j];
    for (int j = 0; j < k; ++j) sk += valid[j] ? expf(lj[j] - mk) : 0.0f;
    for (int j = 0; j < k; ++j) q[j] = valid[j] ? expf(lj[j] - mk) / sk : 0.0f, dot += g[j] * q[j];
    for (int j = 0; j < k; ++j) add[j] = q[j] * (g[j] - dot);
  } else if (has_w && softmax) {
    // s_j = p[id_j]: grad[e] = p[e] (g at e) - p[e] sum_j g_j s_j
    float dot = 0.0f;
    for (int j = 0; j < k; ++j) {
      const float s = valid[j] ? expf(lj[j] - m) / sum : 0.0f;
      add[j] = g[j] * s, dot += g[j] * s;
    }
    coef -= dot, dense = true;
  } else if (has_w) {
    // s_j = sigmoid(l[id_j]); normalize: h_j = (g_j - sum_i g_i s_i / S) / S. The derivative s (1 - s)
    // takes 1 - s as sigmoid(-l): no cancellation where s is near 1.
    float s[kMoeMaxTopK], total = 0.0f, dot = 0.0f;
    for (int j = 0; j < k; ++j) s[j] = valid[j] ? 1.0f / (1.0f + expf(-lj[j])) : 0.0f, total += s[j], dot += g[j] * s[j];
    for (int j = 0; j < k; ++j) {
      const float h = p.normalize ? (g[j] - dot / total) / total : g[j];
      add[j] = valid[j] ? h * s[j] * (1.0f / (1.0f + expf(lj[j]))) : 0.0f;
    }
  }
  // the row in fp32, then one rounding to the output's dtype
  float row[kMoeMaxExperts];
  for (int64_t e = 0; e < E; ++e) row[e] = dense ? expf(logit(e) - m) / sum * coef : 0.0f;
  for (int j = 0; j < k; ++j)
    if (valid[j]) row[ids[j]] += add[j];
  const bool all_nan = softmax && nan && has_w;  // the weights were NaN: so is their gradient
  for (int64_t e = 0; e < E; ++e) store(p.grad_logits, p.grad_dtype, t * p.ld_grad + e, all_nan ? NAN : row[e]);
}

}  // namespace

void moe_route(const MoeRouteParams& p, int cpu_threads) {
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.tokens)) schedule(static)
  for (int64_t t = 0; t < p.tokens; ++t) route_token(p, t);
}

void moe_route_backward(const MoeRouteBackwardParams& p, int cpu_threads) {
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.tokens)) schedule(static)
  for (int64_t t = 0; t < p.tokens; ++t) route_backward_token(p, t);
}

void moe_permute(const MoePermuteParams& p) {
  const int64_t E = p.experts;
  std::vector<int64_t> total(static_cast<size_t>(E), 0), rank(static_cast<size_t>(E), 0);
  int64_t invalid = 0;
  for (int64_t i = 0; i < p.pairs; ++i) {
    const int32_t e = p.ids[i];
    if (e < 0 || e >= E) ++invalid;
    else ++total[static_cast<size_t>(e)];
  }
  int64_t dropped = invalid, at = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t kept = p.capacity > 0 ? std::min(total[e], p.capacity) : total[e];
    dropped += total[e] - kept;
    p.counts[e] = static_cast<int32_t>(kept);
    p.offsets[e] = static_cast<int32_t>(at);
    at += kept;
  }
  p.offsets[E] = static_cast<int32_t>(at);
  for (int64_t s = at; s < p.pairs; ++s) p.sorted_pairs[s] = -1;
  for (int64_t i = 0; i < p.pairs; ++i) {
    const int32_t e = p.ids[i];
    if (e < 0 || e >= E || rank[e] >= p.counts[e]) {
      if (e >= 0 && e < E) ++rank[e];
      p.slot_of[i] = -1;
      continue;
    }
    const int64_t slot = p.offsets[e] + rank[e]++;
    p.sorted_pairs[slot] = static_cast<int32_t>(i);
    p.slot_of[i] = static_cast<int32_t>(slot);
  }
  if (p.dropped) *p.dropped = static_cast<int32_t>(dropped);
}


void moe_combine(const MoeCombineParams& p, int cpu_threads) {
  const auto slot = [&](int64_t pair) -> int64_t {
    const int32_t s = p.slot_of[pair];
    return s >= 0 && s < p.slots ? s : -1;
  };
  if (p.out) {
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.tokens)) schedule(static)
    for (int64_t t = 0; t < p.tokens; ++t) {
      std::vector<float> acc(static_cast<size_t>(p.n), 0.0f);
      for (int64_t j = 0; j < p.k; ++j) {
        const int64_t s = slot(t * p.k + j);
        if (s < 0) continue;
        const float w = p.weights[t * p.k + j];
        for (int64_t c = 0; c < p.n; ++c) acc[c] += w * load(p.y, p.dtype, s * p.ld_y + c);
      }
      for (int64_t c = 0; c < p.n; ++c) store(p.out, p.dtype, t * p.ld_out + c, acc[c]);
    }
    return;
  }
  if (p.grad_y) {
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.slots)) schedule(static)
    for (int64_t s = 0; s < p.slots; ++s) {
      const int64_t pair = p.sorted_pairs[s];
      const bool used = pair >= 0 && pair < p.tokens * p.k;
      const float w = used ? p.weights[pair] : 0.0f;
      for (int64_t c = 0; c < p.n; ++c)
        store(p.grad_y, p.dtype, s * p.ld_gy + c, used ? w * load(p.dout, p.dtype, (pair / p.k) * p.ld_out + c) : 0.0f);
    }
  }
  if (p.grad_weights) {
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.tokens * p.k)) schedule(static)
    for (int64_t pair = 0; pair < p.tokens * p.k; ++pair) {
      const int64_t s = slot(pair), t = pair / p.k;
      float acc = 0.0f;
      for (int64_t c = 0; s >= 0 && c < p.n; ++c)
        acc += load(p.dout, p.dtype, t * p.ld_out + c) * load(p.y, p.dtype, s * p.ld_y + c);
      p.grad_weights[pair] = acc;
    }
  }
}

void grouped_gemm(const GroupedGemmParams& p, int cpu_threads) {
  std::vector<int64_t> begin(static_cast<size_t>(p.groups)), end(static_cast<size_t>(p.groups));
  for (int64_t g = 0; g < p.groups; ++g) grouped_rows(p, g, &begin[g], &end[g]);
  if (!p.weight_grad) {
    const int64_t last = p.groups ? end[p.groups - 1] : 0;
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.m)) schedule(static)
    for (int64_t r = 0; r < p.m; ++r) {
      int64_t g = 0;
      while (g < p.groups && end[g] <= r) ++g;
      std::vector<float> acc(static_cast<size_t>(p.n), 0.0f);
      if (r < last)
        for (int64_t kk = 0; kk < p.k; ++kk) {
          const float x = load(p.a, p.dtype, r * p.a_rs + kk);
          for (int64_t j = 0; j < p.n; ++j) acc[j] += x * load(p.b, p.dtype, g * p.b_gs + kk * p.b_rs + j * p.b_cs);
        }
      for (int64_t j = 0; j < p.n; ++j) store(p.c, p.c_dtype, r * p.c_rs + j, acc[j]);
    }
    return;
  }
  // weight grad: dw[g](kk, j) = sum over the group's rows of x(r, kk) dout(r, j)
#pragma omp parallel for collapse(2) num_threads(cpu_thread_count(cpu_threads, p.groups * p.k)) schedule(static)
  for (int64_t g = 0; g < p.groups; ++g)
    for (int64_t kk = 0; kk < p.k; ++kk) {
      std::vector<float> acc(static_cast<size_t>(p.n), 0.0f);
      for (int64_t r = begin[g]; r < end[g]; ++r) {
        const float x = load(p.a, p.dtype, r * p.a_rs + kk);
        for (int64_t j = 0; j < p.n; ++j) acc[j] += x * load(p.b, p.dtype, r * p.b_rs + j);
      }
      for (int64_t j = 0; j < p.n; ++j) {
        const int64_t i = g * p.c_gs + kk * p.c_rs + j;
        store(p.c, p.c_dtype, i, p.accumulate ? load(p.c, p.c_dtype, i) + acc[j] : acc[j]);
      }
    }
}

void moe_gather(const MoeGatherParams& p, int cpu_threads) {
  const size_t es = dtype_size(p.dtype), row = static_cast<size_t>(p.n) * es;
#pragma omp parallel for num_threads(cpu_thread_count(cpu_threads, p.slots)) schedule(static)
  for (int64_t s = 0; s < p.slots; ++s) {
    const int32_t pair = p.sorted_pairs[s];
    char* dst = static_cast<char*>(p.xs) + static_cast<size_t>(s * p.ld_xs) * es;
    if (pair >= 0 && pair < p.tokens * p.k)
      std::memcpy(dst, static_cast<const char*>(p.x) + static_cast<size_t>((pair / p.k) * p.ld_x) * es, row);
    else
      std::memset(dst, 0, row);
  }
}

}  // namespace optimized::cpu
