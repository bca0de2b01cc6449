// Shared machinery of the MoE family's tests: the float64 references of routing and of the
// permutation (written independently of the library's code: a double-precision softmax / sigmoid
// and a std::stable_sort), the checks, and a runner that calls the public API on host or device
// copies of host buffers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/test_util.h"
#include "optimized/buffer.h"
#include "optimized/moe.h"
#include "testing/tolerance.h"

namespace optimized::testing {

// ---- routing ---------------------------------------------------------------------------------------

struct RouteCase {
  int64_t tokens = 7, experts = 8;
  DType dtype = DType::kF32;
  MoeRouteOptions o;
  bool bias = false;
  int64_t pad = 0;  // extra elements between logits rows
  std::string name() const {
    return std::string(dtype_name(dtype)) + " T=" + std::to_string(tokens) + " E=" + std::to_string(experts) +
           " k=" + std::to_string(o.top_k) + " " + std::string(moe_scoring_name(o.scoring)) +
           (o.topk_softmax ? " topk_softmax" : "") + (o.normalize ? " normalize" : "") + (bias ? " bias" : "") +
           " groups=" + std::to_string(o.n_groups) + "/" + std::to_string(o.topk_groups) +
           " scale=" + std::to_string(o.routed_scale) + " pad=" + std::to_string(pad);
  }
};

// The float64 reference of one token: choice scores, weights of any expert, the chosen ids, lse.
struct RouteRef {
  std::vector<double> logits, score, choice;  // per expert
  std::vector<int> ids;                       // the reference's choice, best first
  double lse = 0;
  bool nan = false;
  MoeRouteOptions o;

  // The weights of a chosen list (normalized over it).
  std::vector<double> weights_for(const std::vector<int>& chosen) const {
    const bool topk_softmax = o.scoring == MoeScoring::kSoftmax && o.topk_softmax;
    double mk = -INFINITY, sk = 0, total = 0;
    for (int id : chosen) mk = std::max(mk, logits[id]);
    for (int id : chosen) sk += std::exp(logits[id] - mk);
    std::vector<double> w(chosen.size());
    for (size_t j = 0; j < chosen.size(); ++j) {
      w[j] = topk_softmax ? (nan ? NAN : std::exp(logits[chosen[j]] - mk) / sk) : score[chosen[j]];
      total += w[j];
    }
    for (double& x : w) x = (o.normalize ? x / total : x) * o.routed_scale;
    return w;
  }
};

inline bool ref_above(double a, double b) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a > b;
}

inline RouteRef route_ref(const std::vector<double>& l, const std::vector<double>& bias, const MoeRouteOptions& o) {
  const int64_t E = static_cast<int64_t>(l.size());
  RouteRef r;
  r.o = o;
  r.logits = l;
  double m = -INFINITY;
  for (double v : l) r.nan = r.nan || std::isnan(v), m = std::isnan(v) ? m : std::max(m, v);
  double sum = 0;
  for (double v : l) sum += std::exp(v - m);
  r.lse = r.nan ? NAN : m + std::log(sum);
  const bool softmax = o.scoring == MoeScoring::kSoftmax;
  std::vector<double>& score = r.score;
  score.resize(static_cast<size_t>(E));
  r.choice.resize(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    score[e] = softmax ? (r.nan ? NAN : std::exp(l[e] - m) / sum) : 1 / (1 + std::exp(-l[e]));
    const double b = bias.empty() ? 0.0 : bias[e];
    r.choice[e] = (softmax && (o.topk_softmax || bias.empty()) ? l[e] : score[e]) + b;
  }
  std::vector<bool> allowed(static_cast<size_t>(E), true);
  const int64_t gs = E / o.n_groups;
  if (o.n_groups > 1) {
    std::vector<double> gscore(static_cast<size_t>(o.n_groups));
    for (int g = 0; g < o.n_groups; ++g) {
      std::vector<double> c(r.choice.begin() + g * gs, r.choice.begin() + (g + 1) * gs);
      std::stable_sort(c.begin(), c.end(), ref_above);
      gscore[g] = gs == 1 ? c[0] : c[0] + c[1];
    }
    std::vector<int> order(static_cast<size_t>(o.n_groups));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ref_above(gscore[a], gscore[b]); });
    std::fill(allowed.begin(), allowed.end(), false);
    for (int j = 0; j < o.topk_groups; ++j)
      for (int64_t e = order[j] * gs; e < (order[j] + 1) * gs; ++e) allowed[e] = true;
  }
  std::vector<int> order;
  for (int64_t e = 0; e < E; ++e)
    if (allowed[e]) order.push_back(static_cast<int>(e));
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ref_above(r.choice[a], r.choice[b]); });
  r.ids.assign(order.begin(), order.begin() + o.top_k);
  return r;
}

// Runs moe_route on fresh logits (and bias), checks every token against the reference: the ids are
// distinct, allowed, and rank as the reference's do (a swap of two experts whose choice scores agree
// to 1e-5 is allowed: fp32 against float64); the weights of the chosen ids; lse.
// `fill`: the logits' values (default: uniform in [-3, 3)).
inline void run_and_check_route(const RouteCase& c, bool cuda, std::mt19937_64& rng,
                                const std::function<double(int64_t, int64_t)>& fill = nullptr) {
  SCOPED_TRACE(c.name());
  const int64_t T = c.tokens, E = c.experts, k = c.o.top_k, ld = E + c.pad;
  Buffer logits(c.dtype, std::max<int64_t>(1, T * ld), Device::cpu()), bias(DType::kF32, E, Device::cpu());
  Buffer ids(DType::kI32, std::max<int64_t>(1, T * k), Device::cpu()), w(DType::kF32, std::max<int64_t>(1, T * k), Device::cpu());
  Buffer lse(DType::kF32, std::max<int64_t>(1, T), Device::cpu());
  logits.fill_bytes(0xFF), ids.fill_bytes(0xFF), w.fill_bytes(0xFF), lse.fill_bytes(0xFF);  // padding, outputs: poison
  std::uniform_real_distribution<double> u(-3.0, 3.0), ub(-0.5, 0.5);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) store_from_double(logits.data(), c.dtype, t * ld + e, fill ? fill(t, e) : u(rng));
  for (int64_t e = 0; e < E; ++e) store_from_double(bias.data(), DType::kF32, e, ub(rng));
  std::vector<Buffer> r = run_case(cuda, {&logits, &bias, &ids, &w, &lse}, [&](const std::vector<void*>& p, Device d) {
    moe_route(raw(p[0], c.dtype, d, {T, E}, {ld, 1}), c.bias ? raw(p[1], DType::kF32, d, {E}, {1}) : TensorView{},
              raw(p[2], DType::kI32, d, {T, k}, {k, 1}), raw(p[3], DType::kF32, d, {T, k}, {k, 1}),
              raw(p[4], DType::kF32, d, {T}, {1}), c.o);
  });
  if (r.size() != 5) return;
  std::vector<double> b;
  for (int64_t e = 0; c.bias && e < E; ++e) b.push_back(load_as_double(bias.data(), DType::kF32, e));
  int failures = 0;
  for (int64_t t = 0; t < T && failures < 3; ++t) {
    std::vector<double> l(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) l[e] = load_as_double(logits.data(), c.dtype, t * ld + e);
    const RouteRef ref = route_ref(l, b, c.o);
    const auto* got_ids = static_cast<const int32_t*>(r[2].data()) + t * k;
    const auto* got_w = static_cast<const float*>(r[3].data()) + t * k;
    // the ids: in range, distinct, each as good as the reference's choice at its place
    std::vector<int> got(got_ids, got_ids + k);
    for (int64_t j = 0; j < k && failures < 3; ++j) {
      const int id = got[j], want = ref.ids[j];
      std::string why;
      if (id < 0 || id >= E) why = "id " + std::to_string(id) + " out of range";
      else if (std::count(got.begin(), got.end(), id) > 1) why = "id " + std::to_string(id) + " repeated";
      else if (id != want && !(std::fabs(ref.choice[id] - ref.choice[want]) <= 1e-5 * (1 + std::fabs(ref.choice[want]))))
        why = "id " + std::to_string(id) + " (choice score " + std::to_string(ref.choice[id]) + ") where the reference has " +
              std::to_string(want) + " (" + std::to_string(ref.choice[want]) + ")";
      if (!why.empty()) {
        ADD_FAILURE() << "token " << t << " choice " << j << ": " << why;
        ++failures;
      }
    }
    if (failures) continue;
    // the weights of the chosen list
    const std::vector<double> wr = ref.weights_for(got);
    for (int64_t j = 0; j < k; ++j) {
      const bool both_nan = std::isnan(wr[j]) && std::isnan(got_w[j]);
      if (!both_nan && !(std::fabs(got_w[j] - wr[j]) <= 2e-5 * std::fabs(wr[j]) + 1e-6)) {
        ADD_FAILURE() << "token " << t << " choice " << j << ": weight " << got_w[j] << ", expected " << wr[j];
        ++failures;
      }
    }
    const double got_lse = static_cast<const float*>(r[4].data())[t];
    if (!(std::isnan(ref.lse) && std::isnan(got_lse)) && !(std::fabs(got_lse - ref.lse) <= 1e-5 * (1 + std::fabs(ref.lse)))) {
      ADD_FAILURE() << "token " << t << ": lse " << got_lse << ", expected " << ref.lse;
      ++failures;
    }
  }
}

// The routing sweep: E in {1, 8, 64, 256, 1024}, k in {1, 2, 8}, T in {1, 7, 4097}, each scoring mode.
inline std::vector<RouteCase> route_cases() {
  std::vector<RouteCase> out;
  int i = 0;
  for (int64_t E : {1, 8, 64, 256, 1024})
    for (int k : {1, 2, 8})
      for (int64_t T : {1, 7, 4097}) {
        if (k > E || (T == 4097 && E == 1024)) continue;
        for (int mode = 0; mode < 5; ++mode) {
          RouteCase c;
          c.tokens = T, c.experts = E, c.o.top_k = k;
          c.dtype = i % 3 == 0 ? DType::kF32 : i % 3 == 1 ? DType::kBF16 : DType::kF16;
          c.pad = i % 4 == 1 ? 3 : 0;
          ++i;
          switch (mode) {
            case 0: break;                                              // softmax, then top-k
            case 1: c.o.normalize = true; break;                        // renormalized
            case 2: c.o.topk_softmax = true; break;                     // Mixtral
            case 3: c.o.scoring = MoeScoring::kSigmoid, c.o.normalize = true, c.bias = true, c.o.routed_scale = 2.5f; break;
            case 4:                                                     // DeepSeek-V3 groups
              if (E < 8) continue;
              c.o.scoring = MoeScoring::kSigmoid, c.o.normalize = true, c.bias = true;
              c.o.n_groups = 8, c.o.topk_groups = std::max(1, static_cast<int>((k * 8 + E - 1) / E) + 1);
              if (c.o.topk_groups > 8) c.o.topk_groups = 8;
              break;
          }
          out.push_back(c);
        }
      }
  return out;
}


// ---- routing's backward ------------------------------------------------------------------------------

// The float64 gradient of one token's (weights, lse) to its logits (moe.h's moe_route_backward), by the
// chain rule through the whole Jacobian, written independently of the library's reduced formulas:
//   grad[e] = sum_j sum_i routed_scale g_j (dn_j / ds_i) (ds_i / dl_e) + gl p[e]
// with s_i the pairs' scores (p[id_i], the softmax q_i over the chosen logits, or sigmoid(l[id_i])) and
// n_j = s_j / sum_i s_i with normalize (else s_j). Pairs with an id outside [0, E) are left out, a zero
// incoming gradient adds nothing, and with softmax scoring a NaN logit makes the row NaN (moe.h).
struct RouteGradRef {
  std::vector<double> grad;  // (E)
  std::vector<double> mag;   // (E): the magnitude of the terms summed into each element (before they cancel)
  std::vector<bool> live;    // (E): whether any term reaches the element (elsewhere exact zeros)
};

inline RouteGradRef route_backward_ref(const std::vector<double>& l, const std::vector<int>& ids,
                                       const std::vector<double>& gw, double gl, const MoeRouteOptions& o) {
  const int64_t E = static_cast<int64_t>(l.size());
  const size_t k = ids.size();
  bool nan = false;
  double m = -INFINITY, sum = 0;
  for (double v : l) nan = nan || std::isnan(v), m = std::isnan(v) ? m : std::max(m, v);
  for (double v : l) sum += std::exp(v - m);
  std::vector<double> p(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) p[e] = nan ? NAN : std::exp(l[e] - m) / sum;
  std::vector<size_t> valid;
  for (size_t j = 0; j < k; ++j)
    if (ids[j] >= 0 && ids[j] < E) valid.push_back(j);
  bool has_w = false;
  for (size_t j : valid) has_w = has_w || gw[j] != 0;
  const bool has_l = gl != 0;
  const bool softmax = o.scoring == MoeScoring::kSoftmax, chosen_softmax = softmax && o.topk_softmax;
  // the scores s_i and their Jacobian ds_i / dl_e (k x E; rows of left-out pairs stay zero); ds_mag: the
  // magnitude of its terms before they cancel (s_i (1 + p[e]) for s_i (1 - p[e]) at e = id_i)
  std::vector<double> s(k, 0.0);
  std::vector<std::vector<double>> ds(k, std::vector<double>(static_cast<size_t>(E), 0.0)), ds_mag = ds;
  double mk = -INFINITY, sk = 0;
  for (size_t i : valid) mk = std::max(mk, l[ids[i]]);
  for (size_t i : valid) sk += std::exp(l[ids[i]] - mk);
  for (size_t i : valid) {
    const int id = ids[i];
    if (chosen_softmax) s[i] = std::exp(l[id] - mk) / sk;
    else if (softmax) s[i] = p[id];
    else s[i] = 1 / (1 + std::exp(-l[id]));
  }
  for (size_t i : valid)
    for (int64_t e = 0; e < E; ++e) {
      const double at = ids[i] == e ? 1.0 : 0.0;
      if (chosen_softmax) {
        double q_e = 0;  // the chosen softmax's total at e (several pairs when an id repeats)
        for (size_t m2 : valid) q_e += ids[m2] == e ? s[m2] : 0.0;
        ds[i][e] = s[i] * (at - q_e), ds_mag[i][e] = s[i] * (at + q_e);
      } else if (softmax) {
        ds[i][e] = s[i] * (at - p[e]), ds_mag[i][e] = s[i] * (at + p[e]);
      } else {
        ds[i][e] = at * s[i] * (1 - s[i]), ds_mag[i][e] = std::fabs(ds[i][e]);
      }
    }
  double S = 0;
  for (size_t i : valid) S += s[i];
  RouteGradRef r;
  r.grad.assign(static_cast<size_t>(E), 0.0);
  r.mag.assign(static_cast<size_t>(E), 0.0);
  r.live.assign(static_cast<size_t>(E), has_l);
  for (int64_t e = 0; has_w && e < E; ++e)
    for (size_t j : valid)
      for (size_t i : valid) {
        const double at = i == j ? 1.0 : 0.0;
        const double dn = o.normalize ? at / S - s[j] / (S * S) : at;
        const double dn_mag = o.normalize ? at / S + s[j] / (S * S) : at;
        const double g = o.routed_scale * gw[j];
        r.grad[e] += g * dn * ds[i][e], r.mag[e] += std::fabs(g) * dn_mag * ds_mag[i][e];
      }
  if (has_w) {
    // mathematically: the plain softmax reaches every expert, the other rules only the chosen ones
    // (normalize's p[id_j] / sum_i p[id_i] is the softmax over the chosen logits)
    const bool every = softmax && !o.topk_softmax && !o.normalize;
    for (size_t j : valid) r.live[ids[j]] = true;
    for (int64_t e = 0; every && e < E; ++e) r.live[e] = true;
  }
  for (int64_t e = 0; has_l && e < E; ++e) r.grad[e] += gl * p[e], r.mag[e] += std::fabs(gl * p[e]);
  if (softmax && nan && has_w) std::fill(r.grad.begin(), r.grad.end(), NAN);
  return r;
}

struct RouteBackwardCase {
  RouteCase route;                  // the logits and options (the forward chooses the ids)
  DType grad_dtype = DType::kF32;   // the logits' dtype or fp32
  bool grad_weights = true, grad_lse = true;
  int64_t grad_pad = 0;             // extra elements between grad_logits rows
  std::string name() const {
    return route.name() + " grad=" + std::string(dtype_name(grad_dtype)) + (grad_weights ? " +gw" : "") +
           (grad_lse ? " +glse" : "") + " grad_pad=" + std::to_string(grad_pad);
  }
};

// Runs moe_route then moe_route_backward on its ids (or, given `ids`, the backward alone on those) with
// fresh logits and incoming gradients, the output poisoned; checks every token against the reference:
// NaN exactly where it has NaN, exact zeros where no term reaches, each row within the reduction rule
// of tolerance.h (n = E; no same-dtype term), and the rows' padding untouched.
// `fill`, `fill_gw`, `fill_gl`: the values of the logits, grad_weights, grad_lse (default: uniform).
inline void run_and_check_route_backward(const RouteBackwardCase& c, bool cuda, std::mt19937_64& rng,
                                         const std::function<double(int64_t, int64_t)>& fill = nullptr,
                                         const std::vector<int32_t>& ids_given = {},
                                         const std::function<double(int64_t, int64_t)>& fill_gw = nullptr,
                                         const std::function<double(int64_t)>& fill_gl = nullptr) {
  SCOPED_TRACE(c.name());
  const RouteCase& rc = c.route;
  const int64_t T = rc.tokens, E = rc.experts, k = rc.o.top_k, ld = E + rc.pad, ldg = E + c.grad_pad;
  const DType dt = rc.dtype, gdt = c.grad_dtype;
  const auto at_least_1 = [](int64_t n) { return std::max<int64_t>(1, n); };
  Buffer logits(dt, at_least_1(T * ld), Device::cpu()), bias(DType::kF32, E, Device::cpu());
  Buffer ids(DType::kI32, at_least_1(T * k), Device::cpu()), w(DType::kF32, at_least_1(T * k), Device::cpu());
  Buffer lse(DType::kF32, at_least_1(T), Device::cpu()), gw(DType::kF32, at_least_1(T * k), Device::cpu());
  Buffer gl(DType::kF32, at_least_1(T), Device::cpu()), grad(gdt, at_least_1(T * ldg), Device::cpu());
  for (Buffer* b : {&logits, &ids, &w, &lse, &grad}) b->fill_bytes(0xFF);  // padding, outputs: poison
  std::uniform_real_distribution<double> u(-3.0, 3.0), ub(-0.5, 0.5), ug(-1.0, 1.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) store_from_double(logits.data(), dt, t * ld + e, fill ? fill(t, e) : u(rng));
    for (int64_t j = 0; j < k; ++j) store_from_double(gw.data(), DType::kF32, t * k + j, fill_gw ? fill_gw(t, j) : ug(rng));
    store_from_double(gl.data(), DType::kF32, t, fill_gl ? fill_gl(t) : ug(rng));
  }
  for (int64_t e = 0; e < E; ++e) store_from_double(bias.data(), DType::kF32, e, ub(rng));
  const bool given = !ids_given.empty();
  if (given) std::memcpy(ids.data(), ids_given.data(), static_cast<size_t>(T * k) * 4);
  std::vector<Buffer> r = run_case(cuda, {&logits, &bias, &ids, &w, &lse, &gw, &gl, &grad},
                                   [&](const std::vector<void*>& p, Device d) {
    const TensorView lv = raw(p[0], dt, d, {T, E}, {ld, 1}), iv = raw(p[2], DType::kI32, d, {T, k}, {k, 1});
    if (!given)
      moe_route(lv, rc.bias ? raw(p[1], DType::kF32, d, {E}, {1}) : TensorView{}, iv,
                raw(p[3], DType::kF32, d, {T, k}, {k, 1}), raw(p[4], DType::kF32, d, {T}, {1}), rc.o);
    moe_route_backward(lv, iv, c.grad_weights ? raw(p[5], DType::kF32, d, {T, k}, {k, 1}) : TensorView{},
                       c.grad_lse ? raw(p[6], DType::kF32, d, {T}, {1}) : TensorView{},
                       raw(p[7], gdt, d, {T, E}, {ldg, 1}), rc.o);
  });
  if (r.size() != 8) return;
  int failures = 0;
  for (int64_t t = 0; t < T && failures < 3; ++t) {
    std::vector<double> l(static_cast<size_t>(E)), g(static_cast<size_t>(k), 0.0);
    for (int64_t e = 0; e < E; ++e) l[e] = load_as_double(logits.data(), dt, t * ld + e);
    const auto* got_ids = static_cast<const int32_t*>(r[2].data()) + t * k;
    const std::vector<int> chosen(got_ids, got_ids + k);
    for (int64_t j = 0; c.grad_weights && j < k; ++j) g[j] = load_as_double(gw.data(), DType::kF32, t * k + j);
    const double glv = c.grad_lse ? load_as_double(gl.data(), DType::kF32, t) : 0.0;
    const RouteGradRef ref = route_backward_ref(l, chosen, g, glv, rc.o);
    double max_ref = 0, terms = 0, max_err = 0;
    int64_t worst = -1;
    for (int64_t e = 0; e < E; ++e) {
      const double want = ref.grad[e], got = load_as_double(r[7].data(), gdt, t * ldg + e);
      std::string why;
      if (std::isnan(want) != std::isnan(got)) why = "NaN mismatch";
      else if (!std::isnan(want) && !ref.live[e] && got != 0.0) why = "expected an exact zero (no term reaches it)";
      if (!why.empty()) {
        ADD_FAILURE() << "token " << t << " expert " << e << ": got " << got << ", expected " << want << ": " << why;
        ++failures;
        break;
      }
      if (std::isnan(want)) continue;
      max_ref = std::max(max_ref, std::fabs(want)), terms = std::max(terms, ref.mag[e]);
      if (std::fabs(got - want) > max_err) max_err = std::fabs(got - want), worst = e;
    }
    const double allowed = reduction_allowed_error(gdt, E, 0.0, max_ref, terms, 0x1p-24);
    if (worst >= 0 && !(max_err <= allowed)) {
      ADD_FAILURE() << "token " << t << " expert " << worst << ": got "
                    << load_as_double(r[7].data(), gdt, t * ldg + worst) << ", expected " << ref.grad[worst]
                    << " (max error " << max_err << " > allowed " << allowed << ")";
      ++failures;
    }
    for (int64_t e = E; e < ldg; ++e)
      if (!std::isnan(load_as_double(r[7].data(), gdt, t * ldg + e))) {
        ADD_FAILURE() << "token " << t << ": grad_logits written past its columns at " << e;
        ++failures;
        break;
      }
  }
}

// The backward's sweep: E in {1, 8, 64, 256}, k in {1, 2, 8}, T in {1, 7, 4097} (3 of the 8 modes at
// 4097), every scoring mode; the dtypes, fp32 or same-dtype gradients, padded rows of the logits and of
// the gradient, and absent incoming gradients in turn.
inline std::vector<RouteBackwardCase> route_backward_cases() {
  std::vector<RouteBackwardCase> out;
  int i = 0;
  for (int64_t E : {1, 8, 64, 256})
    for (int k : {1, 2, 8})
      for (int64_t T : {1, 7, 4097}) {
        if (k > E) continue;
        for (int mode = 0; mode < 8; ++mode) {
          if (T == 4097 && mode != 0 && mode != 3 && mode != 5) continue;
          if (mode >= 6 && E < 8) continue;
          RouteBackwardCase c;
          RouteCase& rc = c.route;
          rc.tokens = T, rc.experts = E, rc.o.top_k = k;
          rc.dtype = i % 3 == 0 ? DType::kF32 : i % 3 == 1 ? DType::kBF16 : DType::kF16;
          rc.pad = i % 4 == 1 ? 3 : 0;
          c.grad_dtype = i % 2 ? DType::kF32 : rc.dtype;
          c.grad_pad = i % 5 == 2 ? 2 : 0;
          c.grad_weights = i % 7 != 6;
          c.grad_lse = i % 4 != 3;
          ++i;
          switch (mode) {
            case 0: break;                                                           // softmax, then top-k
            case 1: rc.o.normalize = true, rc.o.routed_scale = 2.5f; break;          // renormalized
            case 2: rc.o.topk_softmax = true; break;                                 // Mixtral
            case 3: rc.o.topk_softmax = true, rc.o.normalize = true; break;
            case 4: rc.o.scoring = MoeScoring::kSigmoid; break;
            case 5: rc.o.scoring = MoeScoring::kSigmoid, rc.o.normalize = true, rc.bias = true, rc.o.routed_scale = 2.5f; break;
            case 6:                                                                  // DeepSeek-V3 groups
            case 7:                                                                  // softmax, groups, bias
              rc.o.scoring = mode == 6 ? MoeScoring::kSigmoid : MoeScoring::kSoftmax;
              rc.o.normalize = mode == 6, rc.bias = true;
              rc.o.n_groups = 8, rc.o.topk_groups = std::min(8, static_cast<int>((k * 8 + E - 1) / E) + 1);
              break;
          }
          out.push_back(c);
        }
      }
  return out;
}


// ---- grouped GEMM ----------------------------------------------------------------------------------

struct GroupedCase {
  DType dtype = DType::kF32;
  int64_t m = 7, k = 5, n = 13, groups = 3;
  std::vector<int32_t> offs;   // empty: random cut points ending at m
  bool w_transposed = false;   // w as the (E, N, K) -> (E, K, N) transposed view
  int64_t pad = 0;             // extra elements between rows of x and dout
  bool accumulate = false;     // weight grad onto random dw
  DType dw_dtype = DType::kF32;
  GroupedGemmVariant variant = GroupedGemmVariant::kCpu;
  std::string name() const {
    std::string s = std::string(dtype_name(dtype)) + " " + std::string(grouped_gemm_variant_name(variant)) +
                    " M=" + std::to_string(m) + " K=" + std::to_string(k) + " N=" + std::to_string(n) +
                    " E=" + std::to_string(groups) + (w_transposed ? " w^T" : "") + " pad=" + std::to_string(pad) +
                    (accumulate ? " accumulate" : "") + " offs=";
    for (size_t i = 0; i < offs.size() && i < 8; ++i) s += std::to_string(offs[i]) + ",";
    return s;
  }
};

// E group ends over m rows at random cut points (empty groups come up), the last one m.
inline std::vector<int32_t> random_ends(int64_t m, int64_t groups, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> u(0, m);
  std::vector<int32_t> cuts;
  for (int64_t g = 0; g + 1 < groups; ++g) cuts.push_back(static_cast<int32_t>(u(rng)));
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(static_cast<int32_t>(m));
  return cuts;
}

// Group ends as moe.h documents them: clamped to [0, m], a running max.
inline std::vector<int64_t> clamped_ends(const std::vector<int32_t>& offs, int64_t m) {
  std::vector<int64_t> ends;
  int64_t cur = 0;
  for (int32_t o : offs) cur = std::max<int64_t>(cur, std::clamp<int64_t>(o, 0, m)), ends.push_back(cur);
  return ends;
}

// grouped_mm and grouped_mm_weight_grad of one case against float64, with the GEMM rule of
// tolerance.h (reductions over K, and over the group's rows); rows past the last group zero.
inline void run_and_check_grouped(GroupedCase c, bool cuda, std::mt19937_64& rng) {
  const int64_t M = c.m, K = c.k, N = c.n, E = c.groups, lx = K + c.pad, ldy = N + c.pad;
  if (c.offs.empty()) c.offs = random_ends(M, E, rng);
  SCOPED_TRACE(c.name());
  Buffer x(c.dtype, std::max<int64_t>(1, M * lx), Device::cpu()), w(c.dtype, E * K * N, Device::cpu());
  Buffer offs(DType::kI32, E, Device::cpu()), out(c.dtype, std::max<int64_t>(1, M * N), Device::cpu());
  Buffer dy(c.dtype, std::max<int64_t>(1, M * ldy), Device::cpu()), dw(c.dw_dtype, E * K * N, Device::cpu());
  x.fill_bytes(0xFF), dy.fill_bytes(0xFF), out.fill_bytes(0xFF);  // padding and the output: NaN
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t kk = 0; kk < K; ++kk) store_from_double(x.data(), c.dtype, r * lx + kk, u(rng));
    for (int64_t j = 0; j < N; ++j) store_from_double(dy.data(), c.dtype, r * ldy + j, u(rng));
  }
  for (int64_t i = 0; i < E * K * N; ++i) store_from_double(w.data(), c.dtype, i, u(rng));
  if (c.accumulate) {
    for (int64_t i = 0; i < E * K * N; ++i) store_from_double(dw.data(), c.dw_dtype, i, u(rng));
  } else {
    dw.fill_bytes(0xFF);
  }
  std::memcpy(offs.data(), c.offs.data(), static_cast<size_t>(E) * 4);
  // w[g](kk, j): stored (E, K, N) row-major, or (E, N, K) row-major seen transposed
  const auto w_index = [&](int64_t g, int64_t kk, int64_t j) {
    return c.w_transposed ? g * N * K + j * K + kk : g * K * N + kk * N + j;
  };
  std::vector<Buffer> r = run_case(cuda, {&x, &w, &offs, &out, &dy, &dw}, [&](const std::vector<void*>& p, Device d) {
    const TensorView wv = c.w_transposed ? raw(p[1], c.dtype, d, {E, K, N}, {N * K, 1, K})
                                         : raw(p[1], c.dtype, d, {E, K, N}, {K * N, N, 1});
    grouped_mm(raw(p[0], c.dtype, d, {M, K}, {lx, 1}), wv, raw(p[2], DType::kI32, d, {E}, {1}),
               raw(p[3], c.dtype, d, {M, N}, {N, 1}), c.variant);
    grouped_mm_weight_grad(raw(p[0], c.dtype, d, {M, K}, {lx, 1}), raw(p[4], c.dtype, d, {M, N}, {ldy, 1}),
                           raw(p[2], DType::kI32, d, {E}, {1}), raw(p[5], c.dw_dtype, d, {E, K, N}, {K * N, N, 1}),
                           c.accumulate, c.variant);
  });
  if (r.size() != 6) return;
  const std::vector<int64_t> ends = clamped_ends(c.offs, M);
  const auto X = [&](int64_t row, int64_t kk) { return load_as_double(x.data(), c.dtype, row * lx + kk); };
  const auto DY = [&](int64_t row, int64_t j) { return load_as_double(dy.data(), c.dtype, row * ldy + j); };
  int failures = 0;
  for (int64_t row = 0; row < M && failures < 3; ++row) {
    int64_t g = 0;
    while (g < E && ends[g] <= row) ++g;
    for (int64_t j = 0; j < N && failures < 3; ++j) {
      double ref = 0, mag = 0;
      for (int64_t kk = 0; g < E && kk < K; ++kk) {
        const double v = X(row, kk) * load_as_double(w.data(), c.dtype, w_index(g, kk, j));
        ref += v, mag += std::fabs(v);
      }
      const double got = load_as_double(r[3].data(), c.dtype, row * N + j);
      if (!(std::fabs(got - ref) <= gemm_allowed_error(c.dtype, K, ref, mag))) {
        ADD_FAILURE() << "out[" << row << ", " << j << "] = " << got << ", expected " << ref << " (group " << g << ")";
        ++failures;
      }
    }
  }
  for (int64_t g = 0; g < E && failures < 6; ++g) {
    const int64_t begin = g ? ends[g - 1] : 0;
    for (int64_t kk = 0; kk < K && failures < 6; ++kk)
      for (int64_t j = 0; j < N && failures < 6; ++j) {
        const int64_t i = g * K * N + kk * N + j;
        double ref = c.accumulate ? load_as_double(dw.data(), c.dw_dtype, i) : 0.0, mag = std::fabs(ref);
        for (int64_t row = begin; row < ends[g]; ++row) {
          const double v = X(row, kk) * DY(row, j);
          ref += v, mag += std::fabs(v);
        }
        const double got = load_as_double(r[5].data(), c.dw_dtype, i);
        if (!(std::fabs(got - ref) <= gemm_allowed_error(c.dw_dtype, std::max<int64_t>(1, ends[g] - begin) + 1, ref, mag))) {
          ADD_FAILURE() << "dw[" << g << ", " << kk << ", " << j << "] = " << got << ", expected " << ref;
          ++failures;
        }
      }
  }
}

inline std::vector<GroupedCase> grouped_cases(GroupedGemmVariant v) {
  std::vector<GroupedCase> out;
  int i = 0;
  for (int64_t E : {1, 8, 64})
    for (int64_t M : {0, 1, 7, 131})
      for (const auto& [K, N] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {5, 13}, {67, 130}}) {
        GroupedCase c;
        c.variant = v, c.groups = E, c.m = M, c.k = K, c.n = N;
        c.dtype = i % 3 == 0 ? DType::kF32 : i % 3 == 1 ? DType::kBF16 : DType::kF16;
        c.dw_dtype = i % 2 ? DType::kF32 : c.dtype;
        c.w_transposed = i % 4 == 2;
        c.pad = i % 5 == 3 ? 3 : 0;
        c.accumulate = i % 6 == 5;
        ++i;
        out.push_back(c);
      }
  return out;
}

// The wgmma rung's cases: 16-bit operands TMA can describe (rows of x, w and dout whole 16-byte units,
// padding of 8 elements), sizes that are not multiples of the 128 x 256 x 64 tiles, groups that start
// and end inside tiles, empty groups (random cuts) and many groups.
inline std::vector<GroupedCase> grouped_wgmma_cases() {
  std::vector<GroupedCase> out;
  int i = 0;
  for (int64_t E : {1, 8, 64})
    for (int64_t M : {0, 1, 7, 131, 1000})
      for (const auto& [K, N] : std::vector<std::pair<int64_t, int64_t>>{{8, 8}, {72, 136}, {200, 520}}) {
        GroupedCase c;
        c.variant = GroupedGemmVariant::kCudaWgmma, c.groups = E, c.m = M, c.k = K, c.n = N;
        c.dtype = i % 2 ? DType::kBF16 : DType::kF16;
        c.dw_dtype = i % 3 == 1 ? c.dtype : DType::kF32;
        c.w_transposed = i % 4 == 2;
        c.pad = i % 5 == 3 ? 8 : 0;
        c.accumulate = i % 6 == 5;
        ++i;
        out.push_back(c);
      }
  GroupedCase big;  // several tiles per group in every direction, K past one k-block's multiple
  big.variant = GroupedGemmVariant::kCudaWgmma, big.dtype = DType::kBF16, big.groups = 5;
  big.m = 2300, big.k = 328, big.n = 600;
  out.push_back(big);
  big.dw_dtype = DType::kBF16;  // dw by TMA stores, clipped at its edges
  out.push_back(big);
  return out;
}

// grouped_mm_swiglu of one case against float64: h = x @ w[g] (w (E, K, 2F) = [gate | up]), out =
// silu(gate) * up, pre = h; rows past the last group zeros. The error allowed in out carries the GEMM
// rule's error of gate and up through silu(g) u (|silu'| <= 1.1), plus out's own rounding.
inline void run_and_check_swiglu(GroupedCase c, bool cuda, std::mt19937_64& rng, bool with_pre) {
  const int64_t M = c.m, K = c.k, F = c.n, N = 2 * F, E = c.groups, lx = K + c.pad;
  if (c.offs.empty()) c.offs = random_ends(M, E, rng);
  SCOPED_TRACE("swiglu " + c.name() + (with_pre ? " pre" : ""));
  Buffer x(c.dtype, std::max<int64_t>(1, M * lx), Device::cpu()), w(c.dtype, E * K * N, Device::cpu());
  Buffer offs(DType::kI32, E, Device::cpu()), out(c.dtype, std::max<int64_t>(1, M * F), Device::cpu());
  Buffer pre(c.dtype, std::max<int64_t>(1, M * N), Device::cpu());
  x.fill_bytes(0xFF), out.fill_bytes(0xFF), pre.fill_bytes(0xFF);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t kk = 0; kk < K; ++kk) store_from_double(x.data(), c.dtype, r * lx + kk, u(rng));
  for (int64_t i = 0; i < E * K * N; ++i) store_from_double(w.data(), c.dtype, i, u(rng));
  std::memcpy(offs.data(), c.offs.data(), static_cast<size_t>(E) * 4);
  std::vector<Buffer> r = run_case(cuda, {&x, &w, &offs, &out, &pre}, [&](const std::vector<void*>& p, Device d) {
    grouped_mm_swiglu(raw(p[0], c.dtype, d, {M, K}, {lx, 1}), raw(p[1], c.dtype, d, {E, K, N}, {K * N, N, 1}),
                      raw(p[2], DType::kI32, d, {E}, {1}), raw(p[3], c.dtype, d, {M, F}, {F, 1}),
                      with_pre ? raw(p[4], c.dtype, d, {M, N}, {N, 1}) : TensorView{}, c.variant);
  });
  if (r.size() != 5) return;
  const std::vector<int64_t> ends = clamped_ends(c.offs, M);
  const double ud = unit_roundoff(c.dtype);
  int failures = 0;
  for (int64_t row = 0; row < M && failures < 3; ++row) {
    int64_t g = 0;
    while (g < E && ends[g] <= row) ++g;
    for (int64_t j = 0; j < F && failures < 3; ++j) {
      double h[2] = {0, 0}, mag[2] = {0, 0};
      for (int64_t kk = 0; g < E && kk < K; ++kk)
        for (int half = 0; half < 2; ++half) {
          const double v = load_as_double(x.data(), c.dtype, row * lx + kk) *
                           load_as_double(w.data(), c.dtype, g * K * N + kk * N + half * F + j);
          h[half] += v, mag[half] += std::fabs(v);
        }
      const double sg = h[0] / (1.0 + std::exp(-h[0])), ref = sg * h[1];
      const double eg = gemm_allowed_error(c.dtype, K, h[0], mag[0]), eu = gemm_allowed_error(c.dtype, K, h[1], mag[1]);
      const double allowed = 1.1 * eg * (std::fabs(h[1]) + eu) + (std::fabs(sg) + 1.1 * eg) * eu + 2 * ud * std::fabs(ref) + 1e-30;
      const double got = load_as_double(r[3].data(), c.dtype, row * F + j);
      if (!(std::fabs(got - ref) <= allowed)) {
        ADD_FAILURE() << "out[" << row << ", " << j << "] = " << got << ", expected " << ref << " (group " << g << ")";
        ++failures;
      }
      for (int half = 0; with_pre && half < 2; ++half) {
        const double got_h = load_as_double(r[4].data(), c.dtype, row * N + half * F + j);
        if (!(std::fabs(got_h - h[half]) <= (half ? eu : eg))) {
          ADD_FAILURE() << "pre[" << row << ", " << half * F + j << "] = " << got_h << ", expected " << h[half];
          ++failures;
        }
      }
    }
  }
}

// ---- permutation -----------------------------------------------------------------------------------

struct PermuteRef {
  std::vector<int32_t> counts, offsets, sorted, slot_of;
  int32_t dropped = 0;
};

// std::stable_sort of the pairs by expert, then each expert's first `capacity` kept.
inline PermuteRef permute_ref(const std::vector<int32_t>& ids, int64_t E, int64_t capacity) {
  const int64_t P = static_cast<int64_t>(ids.size());
  std::vector<int32_t> order;
  for (int64_t p = 0; p < P; ++p)
    if (ids[p] >= 0 && ids[p] < E) order.push_back(static_cast<int32_t>(p));
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  PermuteRef r;
  r.counts.assign(static_cast<size_t>(E), 0);
  r.slot_of.assign(static_cast<size_t>(P), -1);
  r.sorted.assign(static_cast<size_t>(P), -1);
  r.dropped = static_cast<int32_t>(P - static_cast<int64_t>(order.size()));
  std::vector<int32_t> kept;
  for (int32_t p : order) {
    if (capacity > 0 && r.counts[ids[p]] >= capacity) {
      ++r.dropped;
      continue;
    }
    ++r.counts[ids[p]];
    kept.push_back(p);
  }
  r.offsets.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] = r.offsets[e] + r.counts[e];
  for (size_t s = 0; s < kept.size(); ++s) r.sorted[s] = kept[s], r.slot_of[kept[s]] = static_cast<int32_t>(s);
  return r;
}

// moe_permute of ids (T, k) against the reference, every output compared exactly.
inline void run_and_check_permute(const std::vector<int32_t>& id_values, int64_t T, int64_t k, int64_t E,
                                  int64_t capacity, bool cuda, const std::string& what) {
  SCOPED_TRACE(what + " T=" + std::to_string(T) + " k=" + std::to_string(k) + " E=" + std::to_string(E) +
               " capacity=" + std::to_string(capacity));
  const int64_t P = T * k;
  Buffer ids(DType::kI32, std::max<int64_t>(1, P), Device::cpu());
  if (P) std::memcpy(ids.data(), id_values.data(), static_cast<size_t>(P) * 4);
  Buffer counts(DType::kI32, E, Device::cpu()), offsets(DType::kI32, E + 1, Device::cpu());
  Buffer sorted(DType::kI32, std::max<int64_t>(1, P), Device::cpu()), slot(DType::kI32, std::max<int64_t>(1, P), Device::cpu());
  Buffer dropped(DType::kI32, 1, Device::cpu());
  for (Buffer* b : {&counts, &offsets, &sorted, &slot, &dropped}) b->fill_bytes(0x5A);  // poison
  std::vector<Buffer> r = run_case(cuda, {&ids, &counts, &offsets, &sorted, &slot, &dropped},
                                  [&](const std::vector<void*>& p, Device d) {
                                    moe_permute(raw(p[0], DType::kI32, d, {T, k}, {k, 1}), E, capacity,
                                                raw(p[1], DType::kI32, d, {E}, {1}), raw(p[2], DType::kI32, d, {E + 1}, {1}),
                                                raw(p[3], DType::kI32, d, {P}, {1}), raw(p[4], DType::kI32, d, {T, k}, {k, 1}),
                                                raw(p[5], DType::kI32, d, {1}, {1}));
                                  });
  if (r.size() != 6) return;
  const PermuteRef ref = permute_ref(id_values, E, capacity);
  const auto same = [&](const char* name, const Buffer& got, const std::vector<int32_t>& want) {
    const auto* g = static_cast<const int32_t*>(got.data());
    for (size_t i = 0; i < want.size(); ++i)
      if (g[i] != want[i]) {
        ADD_FAILURE() << name << "[" << i << "] = " << g[i] << ", expected " << want[i];
        return;
      }
  };
  same("counts", r[1], ref.counts);
  same("offsets", r[2], ref.offsets);
  same("sorted_pairs", r[3], ref.sorted);
  same("slot_of", r[4], ref.slot_of);
  EXPECT_EQ(*static_cast<const int32_t*>(r[5].data()), ref.dropped) << "dropped";
}

// Ids of T k pairs: `mode` 0 uniform over E, 1 all to one expert, 2 Zipf-skewed (experts 0.. get most),
// 3 only even experts (odd ones empty).
inline std::vector<int32_t> make_ids(int64_t P, int64_t E, int mode, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<size_t>(P));
  std::uniform_int_distribution<int64_t> u(0, E - 1);
  for (auto& id : ids) {
    switch (mode) {
      case 1: id = static_cast<int32_t>(E - 1); break;
      case 2: {
        const double x = std::uniform_real_distribution<double>(0, 1)(rng);
        id = static_cast<int32_t>(std::min<int64_t>(E - 1, static_cast<int64_t>(std::floor(std::pow(E, x * x)) - 1)));
        break;
      }
      case 3: id = static_cast<int32_t>((u(rng) / 2) * 2); break;
      default: id = static_cast<int32_t>(u(rng));
    }
  }
  return ids;
}

}  // namespace optimized::testing
