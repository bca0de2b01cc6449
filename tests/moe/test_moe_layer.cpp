// The MoE layer's forward (include/optimized/moe.h: moe_forward) against a float64 reference of the whole
// layer computed here from the stored (rounded) inputs: the logits x router_weight^T, the routing
// (moe_test_util.h's route_ref: ties to the lower expert index), the permutation and its capacity
// (permute_ref: a std::stable_sort, each expert keeping its first pairs), each kept pair's SwiGLU expert
// silu(x G_e) * (x U_e) D_e and the weighted sum over the token's pairs -- every step in double.
//
// The reference routes on its own float64 logits, not on the ids the library chose. The choice is
// discrete, so a near-tie at a token's k-th place could flip between the library's fp32 scores and the
// reference's float64 ones (and, with a capacity, change which later tokens an expert drops): random
// inputs whose reference routing has a near-tie at a top-k boundary (choice scores closer than four
// times the fp32 logits' error bound) are redrawn. Ties inside the k chosen do not matter (the output
// sums the same pairs, and a capacity ranks an expert's pairs by token). Exact ties -- logits exactly
// equal in fp32 and in float64 -- are kept, and the documented rule (the lower expert index wins)
// decides them in both (AllToOneExpertAndTies).
//
// The error allowed in out[t, n] follows the layer's roundings through its steps with the GEMM rule
// of testing/tolerance.h (u: x's dtype's unit roundoff):
//   g, u = x @ G_e, x @ U_e            eg, eu = gemm_allowed_error(dtype, d, ...)  (pre rounded or fp32)
//   a = silu(g) u, rounded             ea = 1.1 eg (|u| + eu) + (|silu(g)| + 1.1 eg) eu + 2 u |a|   (|silu'| <= 1.1)
//   y = a @ D_e, rounded               ey = sum_f ea_f |D_fn| + gemm_allowed_error(dtype, F, y, sum_f |a_f D_fn|)
//   weights (fp32 routing on fp32 logits whose error is at most el): ew = 4 (|w| + |routed_scale|) el + 1e-5 |w|
//   out = sum_j w_j y_j in fp32, rounded: sum_j (|w_j| ey_j + ew_j |y_j|) + u |out| + 8 sqrt(k) 2^-24 sum_j |w_j y_j|
// The counts and the dropped pairs are compared exactly; out's row padding must stay poisoned (NaN),
// the inputs unchanged.
//
// CPU always; the CUDA cases skip without a device (SKIP_WITHOUT_CUDA()).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "moe_test_util.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized::testing {
namespace {

struct LayerCase {
  int64_t tokens = 7, experts = 8, d = 24, f = 40;
  DType dtype = DType::kF32, router_dtype = DType::kF32;
  MoeLayerOptions o;
  int64_t pad_x = 0, pad_rw = 0, pad_out = 0, pad_w13 = 0;  // extra elements between rows (w13: between experts)
  bool w2_transposed = false;  // w2 (E, F, d) seen over (E, d, F) row-major storage
  bool metrics = true;         // tokens_per_expert and dropped passed
  bool exact_ties = false;     // the inputs tie on purpose, exactly in both precisions: keep them

  int64_t ld_x() const { return d + pad_x; }
  int64_t ld_rw() const { return d + pad_rw; }
  int64_t ld_out() const { return d + pad_out; }
  int64_t gs13() const { return d * 2 * f + pad_w13; }
  std::string name() const {
    const char* scoring = o.scoring == MoeScoring::kSoftmax ? "softmax" : "sigmoid";
    return std::string(dtype_name(dtype)) + " router " + std::string(dtype_name(router_dtype)) + " T=" +
           std::to_string(tokens) + " E=" + std::to_string(experts) + " k=" + std::to_string(o.top_k) +
           " d=" + std::to_string(d) + " F=" + std::to_string(f) + " " + scoring +
           (o.topk_softmax ? " topk_softmax" : "") + (o.normalize ? " normalize" : "") +
           " scale=" + std::to_string(o.routed_scale) + " cf=" + std::to_string(o.capacity_factor) +
           " variant=" + std::string(o.variant == GroupedGemmVariant::kAuto ? "auto" : grouped_gemm_variant_name(o.variant)) +
           " pads x/rw/out/w13=" + std::to_string(pad_x) + "/" + std::to_string(pad_rw) + "/" + std::to_string(pad_out) +
           "/" + std::to_string(pad_w13) + (w2_transposed ? " w2^T" : "") + (metrics ? "" : " no-metrics");
  }
};

// The host buffers of one case, in the order the runner passes them: x, router_weight, w13, w2, out,
// tokens_per_expert, dropped.
struct LayerData {
  Buffer x, rw, w13, w2, out, counts, dropped;
  std::vector<const Buffer*> all() const { return {&x, &rw, &w13, &w2, &out, &counts, &dropped}; }
};

// The element of w2[e] (f, n) in its storage.
int64_t w2_index(const LayerCase& c, int64_t e, int64_t f, int64_t n) {
  return c.w2_transposed ? e * c.d * c.f + n * c.f + f : e * c.f * c.d + f * c.d + n;
}

// Fresh inputs (scaled so that every step's values stay near 1), padding and outputs poisoned.
// fill_x / fill_rw: the values of x (t, j) and router_weight (e, j) instead of random ones.
LayerData make_data(const LayerCase& c, std::mt19937_64& rng,
                    const std::function<double(int64_t, int64_t)>& fill_x = nullptr,
                    const std::function<double(int64_t, int64_t)>& fill_rw = nullptr) {
  const int64_t T = c.tokens, E = c.experts, d = c.d, F = c.f;
  const auto at_least_1 = [](int64_t n) { return std::max<int64_t>(1, n); };
  LayerData b{Buffer(c.dtype, at_least_1(T * c.ld_x()), Device::cpu()),
              Buffer(c.router_dtype, E * c.ld_rw(), Device::cpu()),
              Buffer(c.dtype, E * c.gs13(), Device::cpu()),
              Buffer(c.dtype, E * F * d, Device::cpu()),
              Buffer(c.dtype, at_least_1(T * c.ld_out()), Device::cpu()),
              Buffer(DType::kI32, E, Device::cpu()),
              Buffer(DType::kI32, 1, Device::cpu())};
  b.x.fill_bytes(0xFF), b.rw.fill_bytes(0xFF), b.w13.fill_bytes(0xFF), b.out.fill_bytes(0xFF);  // NaN
  b.counts.fill_bytes(0x5A), b.dropped.fill_bytes(0x5A);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const double s_rw = 2.0 / std::sqrt(static_cast<double>(d)), s13 = 3.0 / std::sqrt(static_cast<double>(d));
  const double s2 = 2.0 / std::sqrt(static_cast<double>(F));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < d; ++j) store_from_double(b.x.data(), c.dtype, t * c.ld_x() + j, fill_x ? fill_x(t, j) : u(rng));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < d; ++j)
      store_from_double(b.rw.data(), c.router_dtype, e * c.ld_rw() + j, fill_rw ? fill_rw(e, j) : s_rw * u(rng));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < d * 2 * F; ++i) store_from_double(b.w13.data(), c.dtype, e * c.gs13() + i, s13 * u(rng));
  for (int64_t i = 0; i < E * F * d; ++i) store_from_double(b.w2.data(), c.dtype, i, s2 * u(rng));
  return b;
}

struct LayerRef {
  std::vector<double> out, allowed;  // (T, d)
  std::vector<int32_t> counts;       // (E)
  int32_t dropped = 0;
  bool near_tie = false;             // some token's k-th choice nearly ties the best one left out
};

LayerRef layer_ref(const LayerCase& c, const LayerData& b) {
  const int64_t T = c.tokens, E = c.experts, d = c.d, F = c.f, k = c.o.top_k, P = T * k;
  const DType dt = c.dtype;
  const double ud = unit_roundoff(dt), tiny = half_subnormal_step(dt);
  // the stored inputs as doubles
  std::vector<double> x(static_cast<size_t>(T * d)), rw(static_cast<size_t>(E * d));
  std::vector<double> w13(static_cast<size_t>(E * d * 2 * F)), w2(static_cast<size_t>(E * F * d));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < d; ++j) x[t * d + j] = load_as_double(b.x.data(), dt, t * c.ld_x() + j);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < d; ++j) rw[e * d + j] = load_as_double(b.rw.data(), c.router_dtype, e * c.ld_rw() + j);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < d * 2 * F; ++i) w13[e * d * 2 * F + i] = load_as_double(b.w13.data(), dt, e * c.gs13() + i);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t f = 0; f < F; ++f)
      for (int64_t n = 0; n < d; ++n) w2[(e * F + f) * d + n] = load_as_double(b.w2.data(), dt, w2_index(c, e, f, n));

  // routing: float64 logits, route_ref (ties: the lower expert index)
  MoeRouteOptions ro;
  ro.top_k = c.o.top_k, ro.scoring = c.o.scoring, ro.topk_softmax = c.o.topk_softmax, ro.normalize = c.o.normalize;
  ro.routed_scale = c.o.routed_scale;
  const bool sigmoid = c.o.scoring == MoeScoring::kSigmoid;
  LayerRef ref;
  std::vector<int32_t> ids(static_cast<size_t>(P));
  std::vector<double> weights(static_cast<size_t>(P)), weight_err(static_cast<size_t>(P));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> l(static_cast<size_t>(E));
    double logit_err = 0;
    for (int64_t e = 0; e < E; ++e) {
      double s = 0, mag = 0;
      for (int64_t j = 0; j < d; ++j) s += x[t * d + j] * rw[e * d + j], mag += std::fabs(x[t * d + j] * rw[e * d + j]);
      l[e] = s;
      logit_err = std::max(logit_err, gemm_allowed_error(DType::kF32, d, s, mag));
    }
    const RouteRef r = route_ref(l, {}, ro);
    if (k < E) {  // the k-th choice against the best one left out
      std::vector<double> ch = r.choice;
      std::sort(ch.begin(), ch.end(), [](double a, double b2) { return a > b2; });
      const double resolve = (sigmoid ? 0.25 : 1.0) * 4 * logit_err + 16 * 0x1p-24 * std::max(1.0, std::fabs(ch[k - 1]));
      if (ch[k - 1] - ch[k] <= resolve) ref.near_tie = true;
    }
    const std::vector<double> w = r.weights_for(r.ids);
    for (int64_t j = 0; j < k; ++j) {
      ids[t * k + j] = r.ids[j];
      weights[t * k + j] = w[j];
      weight_err[t * k + j] = 4 * (std::fabs(w[j]) + std::fabs(c.o.routed_scale)) * logit_err + 1e-5 * std::fabs(w[j]);
    }
  }
  // the permutation: the capacity ceil(cf T k / E), computed here
  int64_t capacity = 0;
  if (c.o.capacity_factor > 0 && T > 0)
    capacity = static_cast<int64_t>(std::ceil(c.o.capacity_factor * static_cast<double>(T * k) / static_cast<double>(E)));
  const PermuteRef pr = permute_ref(ids, E, capacity);
  ref.counts = pr.counts;
  ref.dropped = pr.dropped;

  // the experts and the combine
  ref.out.assign(static_cast<size_t>(T * d), 0.0);
  ref.allowed.assign(static_cast<size_t>(T * d), 0.0);
  std::vector<double> sum_mag(static_cast<size_t>(d));
  std::vector<double> a(static_cast<size_t>(F)), ea(static_cast<size_t>(F));
  for (int64_t t = 0; t < T; ++t) {
    std::fill(sum_mag.begin(), sum_mag.end(), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = t * k + j;
      if (pr.slot_of[p] < 0) continue;  // dropped: adds nothing
      const int64_t e = ids[p];
      const double* we = &w13[e * d * 2 * F];
      for (int64_t f = 0; f < F; ++f) {
        double g = 0, up = 0, mg = 0, mu = 0;
        for (int64_t i = 0; i < d; ++i) {
          const double xg = x[t * d + i] * we[i * 2 * F + f], xu = x[t * d + i] * we[i * 2 * F + F + f];
          g += xg, up += xu, mg += std::fabs(xg), mu += std::fabs(xu);
        }
        const double sg = g / (1.0 + std::exp(-g));
        const double eg = gemm_allowed_error(dt, d, g, mg), eu = gemm_allowed_error(dt, d, up, mu);
        a[f] = sg * up;
        ea[f] = 1.1 * eg * (std::fabs(up) + eu) + (std::fabs(sg) + 1.1 * eg) * eu + 2 * ud * std::fabs(a[f]) + tiny;
      }
      const double wj = weights[p];
      for (int64_t n = 0; n < d; ++n) {
        double y = 0, my = 0, ey = 0;
        for (int64_t f = 0; f < F; ++f) {
          const double dn = w2[(e * F + f) * d + n];
          y += a[f] * dn, my += std::fabs(a[f] * dn), ey += ea[f] * std::fabs(dn);
        }
        ey += gemm_allowed_error(dt, F, y, my);
        ref.out[t * d + n] += wj * y;
        ref.allowed[t * d + n] += std::fabs(wj) * ey + weight_err[p] * std::fabs(y);
        sum_mag[n] += std::fabs(wj * y);
      }
    }
    for (int64_t n = 0; n < d; ++n)
      ref.allowed[t * d + n] += ud * std::fabs(ref.out[t * d + n]) +
                                8 * std::sqrt(static_cast<double>(k)) * 0x1p-24 * sum_mag[n] + tiny;
  }
  return ref;
}

// The views of the case over the bases p (x, router_weight, w13, w2, out, tokens_per_expert, dropped),
// and moe_forward on them.
void call_layer(const LayerCase& c, const std::vector<void*>& p, Device dev, const ExecutionContext& ctx = {}) {
  const int64_t T = c.tokens, E = c.experts, d = c.d, F = c.f;
  const DType dt = c.dtype;
  const TensorView w2 = c.w2_transposed ? raw(p[3], dt, dev, {E, F, d}, {d * F, 1, F})
                                        : raw(p[3], dt, dev, {E, F, d}, {F * d, d, 1});
  moe_forward(raw(p[0], dt, dev, {T, d}, {c.ld_x(), 1}), raw(p[1], c.router_dtype, dev, {E, d}, {c.ld_rw(), 1}),
              raw(p[2], dt, dev, {E, d, 2 * F}, {c.gs13(), 2 * F, 1}), w2, c.o,
              raw(p[4], dt, dev, {T, d}, {c.ld_out(), 1}),
              c.metrics ? raw(p[5], DType::kI32, dev, {E}, {1}) : TensorView{},
              c.metrics ? raw(p[6], DType::kI32, dev, {1}, {1}) : TensorView{}, ctx);
}

// Compares the buffers after a call (r, in LayerData's order) with the reference.
void check_layer(const LayerCase& c, const LayerData& b, const LayerRef& ref, const std::vector<Buffer>& r) {
  ASSERT_EQ(r.size(), 7u);
  const int64_t T = c.tokens, E = c.experts, d = c.d;
  int failures = 0;
  for (int64_t t = 0; t < T && failures < 4; ++t) {
    for (int64_t n = 0; n < d && failures < 4; ++n) {
      const double got = load_as_double(r[4].data(), c.dtype, t * c.ld_out() + n), want = ref.out[t * d + n];
      if (!(std::fabs(got - want) <= ref.allowed[t * d + n])) {
        ADD_FAILURE() << "out[" << t << ", " << n << "] = " << got << ", expected " << want << " (allowed error "
                      << ref.allowed[t * d + n] << ")";
        ++failures;
      }
    }
    for (int64_t n = d; n < c.ld_out(); ++n)
      if (!std::isnan(load_as_double(r[4].data(), c.dtype, t * c.ld_out() + n))) {
        ADD_FAILURE() << "out: row " << t << " written past its columns at " << n;
        ++failures;
        break;
      }
  }
  if (c.metrics) {
    const auto* counts = static_cast<const int32_t*>(r[5].data());
    for (int64_t e = 0; e < E; ++e)
      if (counts[e] != ref.counts[e]) {
        ADD_FAILURE() << "tokens_per_expert[" << e << "] = " << counts[e] << ", expected " << ref.counts[e];
        break;
      }
    EXPECT_EQ(*static_cast<const int32_t*>(r[6].data()), ref.dropped) << "dropped";
  }
  const char* names[] = {"x", "router_weight", "w13", "w2"};
  const Buffer* inputs[] = {&b.x, &b.rw, &b.w13, &b.w2};
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(std::memcmp(r[i].data(), inputs[i]->data(), inputs[i]->bytes()), 0) << names[i] << " was written";
}

// Draws inputs (again while the reference routing has a near-tie, unless the case ties on purpose),
// runs the layer on the CPU or cuda:0 and checks it.
void run_and_check_layer(const LayerCase& c, bool cuda, std::mt19937_64& rng,
                         const std::function<double(int64_t, int64_t)>& fill_x = nullptr,
                         const std::function<double(int64_t, int64_t)>& fill_rw = nullptr) {
  SCOPED_TRACE(c.name());
  LayerData b = make_data(c, rng, fill_x, fill_rw);
  LayerRef ref = layer_ref(c, b);
  for (int tries = 0; ref.near_tie && !c.exact_ties; ++tries) {
    ASSERT_LT(tries, 20) << "could not draw inputs without a near-tie at a top-k boundary";
    b = make_data(c, rng, fill_x, fill_rw);
    ref = layer_ref(c, b);
  }
  const std::vector<Buffer> r = run_case(cuda, b.all(), [&](const std::vector<void*>& p, Device dev) { call_layer(c, p, dev); });
  if (r.size() != 7) return;
  check_layer(c, b, ref, r);
}

// The sweep: E in {1, 8, 64}, k in {1, 2, 8} (k <= E), T in {1, 7, 257}, dropless and capacity factors 1.0
// and 0.5; the dtypes, the scoring modes, (d, F) pairs (multiples of 8, so that the wgmma rung takes
// them too), padded rows, a transposed w2, an fp32 router (CPU, 16-bit x) and the metrics in turn.
std::vector<LayerCase> layer_cases(bool cuda) {
  std::vector<LayerCase> out;
  const std::vector<std::pair<int64_t, int64_t>> widths = {{8, 8}, {24, 40}, {40, 24}, {72, 56}};
  int i = 0;
  for (int64_t E : {1, 8, 64})
    for (int k : {1, 2, 8})
      for (int64_t T : {1, 7, 257})
        for (double cf : {0.0, 1.0, 0.5}) {
          if (k > E) continue;
          LayerCase c;
          c.experts = E, c.tokens = T, c.o.top_k = k, c.o.capacity_factor = cf;
          c.dtype = i % 3 == 0 ? DType::kF32 : i % 3 == 1 ? DType::kBF16 : DType::kF16;
          c.router_dtype = c.dtype;
          if (!cuda && c.dtype != DType::kF32 && i % 4 == 1) c.router_dtype = DType::kF32;
          std::tie(c.d, c.f) = widths[static_cast<size_t>(i) % widths.size()];
          switch (i % 5) {
            case 0: break;                                                              // softmax, then top-k
            case 1: c.o.normalize = true; break;                                        // renormalized
            case 2: c.o.topk_softmax = true; break;                                     // Mixtral
            case 3: c.o.scoring = MoeScoring::kSigmoid, c.o.normalize = true, c.o.routed_scale = 2.5f; break;
            case 4: c.o.scoring = MoeScoring::kSigmoid; break;
          }
          c.pad_x = i % 3 == 1 ? 8 : 0;
          c.pad_rw = i % 4 == 3 ? 8 : 0;
          c.pad_out = i % 5 == 2 ? 3 : 0;
          c.pad_w13 = i % 7 == 5 ? 8 : 0;
          c.w2_transposed = i % 6 == 4;
          c.metrics = i % 3 != 2;
          ++i;
          out.push_back(c);
        }
  return out;
}

void layer_sweep(bool cuda, GroupedGemmVariant variant = GroupedGemmVariant::kAuto, int every = 1) {
  std::mt19937_64 rng = test_rng();
  int i = 0;
  for (LayerCase c : layer_cases(cuda)) {
    if (i++ % every != 0) continue;
    if (!grouped_gemm_variant_rejects_dtype(variant, c.dtype).empty()) continue;
    c.o.variant = variant;
    run_and_check_layer(c, cuda, rng);
  }
}

// Every token prefers expert 5 (router row 5 all ones, x > 0) and ties on the other seven (rows of zeros:
// logits exactly 0 in fp32 and in float64): the lower index, expert 0, is each token's second choice.
// With a capacity of ceil(1.0 * 37 * 2 / 8) = 10, experts 5 and 0 keep tokens 0..9 and drop the rest.
void all_to_one_expert_and_ties(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (double cf : {0.0, 1.0}) {
    LayerCase c;
    c.tokens = 37, c.experts = 8, c.d = 16, c.f = 24, c.o.top_k = 2, c.o.capacity_factor = cf;
    c.dtype = c.router_dtype = DType::kBF16;
    c.exact_ties = true;
    std::uniform_real_distribution<double> pos(0.05, 1.0);
    run_and_check_layer(c, cuda, rng, [&](int64_t, int64_t) { return pos(rng); },
                        [](int64_t e, int64_t) { return e == 5 ? 1.0 : 0.0; });
  }
  // and the counts said so exactly: checked against permute_ref above; spelled out here once
  LayerCase c;
  c.tokens = 37, c.experts = 8, c.d = 16, c.f = 24, c.o.top_k = 2, c.o.capacity_factor = 1.0;
  c.exact_ties = true;
  LayerData b = make_data(c, rng, [](int64_t, int64_t) { return 0.5; }, [](int64_t e, int64_t) { return e == 5 ? 1.0 : 0.0; });
  const std::vector<Buffer> r = run_case(cuda, b.all(), [&](const std::vector<void*>& p, Device dev) { call_layer(c, p, dev); });
  ASSERT_EQ(r.size(), 7u);
  const auto* counts = static_cast<const int32_t*>(r[5].data());
  EXPECT_EQ(counts[5], 10);
  EXPECT_EQ(counts[0], 10);
  for (int e : {1, 2, 3, 4, 6, 7}) EXPECT_EQ(counts[e], 0) << "expert " << e;
  EXPECT_EQ(*static_cast<const int32_t*>(r[6].data()), 2 * 37 - 20);
}

// T = 0: the counts and dropped zeroed, nothing else written (out has no rows).
void zero_tokens(bool cuda) {
  LayerCase c;
  c.tokens = 0, c.experts = 8, c.d = 8, c.f = 8, c.o.top_k = 2, c.o.capacity_factor = 1.0;
  std::mt19937_64 rng = test_rng();
  LayerData b = make_data(c, rng);
  const std::vector<Buffer> r = run_case(cuda, b.all(), [&](const std::vector<void*>& p, Device dev) { call_layer(c, p, dev); });
  ASSERT_EQ(r.size(), 7u);
  for (int64_t e = 0; e < c.experts; ++e) EXPECT_EQ(static_cast<const int32_t*>(r[5].data())[e], 0) << "expert " << e;
  EXPECT_EQ(*static_cast<const int32_t*>(r[6].data()), 0);
  EXPECT_TRUE(std::isnan(load_as_double(r[4].data(), c.dtype, 0))) << "out has no rows: nothing to write";
}

// The same inputs twice: the same bits (no atomics decide any sum).
void same_bits(bool cuda) {
  std::mt19937_64 rng = test_rng();
  for (double cf : {0.0, 0.5}) {
    LayerCase c;
    c.tokens = 257, c.experts = 64, c.d = 40, c.f = 24, c.o.top_k = 8, c.o.capacity_factor = cf;
    c.dtype = c.router_dtype = DType::kBF16;
    c.o.normalize = true;
    SCOPED_TRACE(c.name());
    const LayerData b = make_data(c, rng);
    const auto go = [&] {
      return run_case(cuda, b.all(), [&](const std::vector<void*>& p, Device dev) { call_layer(c, p, dev); });
    };
    const std::vector<Buffer> r1 = go(), r2 = go();
    ASSERT_EQ(r1.size(), 7u);
    ASSERT_EQ(r2.size(), 7u);
    for (size_t i = 4; i < 7; ++i) EXPECT_EQ(std::memcmp(r1[i].data(), r2[i].data(), r1[i].bytes()), 0) << "buffer " << i;
  }
}

// ---- CPU ---------------------------------------------------------------------------------------------

TEST(MoeLayerCpu, Sweep) { layer_sweep(false); }
TEST(MoeLayerCpu, AllToOneExpertAndTies) { all_to_one_expert_and_ties(false); }
TEST(MoeLayerCpu, ZeroTokens) { zero_tokens(false); }
TEST(MoeLayerCpu, SameBitsEveryRun) { same_bits(false); }

// Every argument's refusal names it, and a refused call writes nothing (views "on cuda:0" over host
// memory reach the checks first: no device is touched before they pass).
TEST(MoeLayerCpu, Errors) {
  const int64_t T = 7, d = 16, F = 8, E = 4;
  const Device cpu = Device::cpu(), gpu = Device::cuda(0);
  Buffer x(DType::kF32, T * d, cpu), xb(DType::kBF16, T * d, cpu), rw(DType::kF32, 2000 * d, cpu);
  Buffer rwb(DType::kBF16, E * d, cpu), w13(DType::kF32, E * d * 2 * F, cpu), w2(DType::kF32, E * F * d, cpu);
  Buffer w13b(DType::kBF16, E * d * 2 * F, cpu), w2b(DType::kBF16, E * F * d, cpu);
  Buffer out(DType::kF32, T * d, cpu), outb(DType::kBF16, T * d, cpu), counts(DType::kI32, E, cpu), dropped(DType::kI32, 2, cpu);
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-1, 1);
  for (Buffer* b : {&x, &xb, &rw, &rwb, &w13, &w2, &w13b, &w2b})
    for (int64_t i = 0; i < b->count(); ++i) store_from_double(b->data(), b->dtype(), i, u(rng));
  out.fill_bytes(0xFF), counts.fill_bytes(0x5A), dropped.fill_bytes(0x5A);
  struct Args {
    TensorView x, rw, w13, w2, out, counts, dropped;
    MoeLayerOptions o;
  };
  const Args good{raw(x.data(), DType::kF32, cpu, {T, d}, {d, 1}),
                  raw(rw.data(), DType::kF32, cpu, {E, d}, {d, 1}),
                  raw(w13.data(), DType::kF32, cpu, {E, d, 2 * F}, {d * 2 * F, 2 * F, 1}),
                  raw(w2.data(), DType::kF32, cpu, {E, F, d}, {F * d, d, 1}),
                  raw(out.data(), DType::kF32, cpu, {T, d}, {d, 1}),
                  raw(counts.data(), DType::kI32, cpu, {E}, {1}),
                  raw(dropped.data(), DType::kI32, cpu, {1}, {1}),
                  {}};
  const auto run = [](const Args& a) {
    return call([&] { moe_forward(a.x, a.rw, a.w13, a.w2, a.o, a.out, a.counts, a.dropped); });
  };
  ASSERT_FALSE(run(good).thrown) << run(good).message;
  out.fill_bytes(0xFF), counts.fill_bytes(0x5A), dropped.fill_bytes(0x5A);

  struct Bad {
    const char* what;
    std::function<void(Args&)> edit;
    Status status;
    std::vector<std::string> words;
  };
  const std::vector<Bad> bad = {
      {"x of rank 1", [&](Args& a) { a.x = raw(x.data(), DType::kF32, cpu, {T * d}, {1}); }, Status::kInvalidArgument, {"x"}},
      {"x absent", [&](Args& a) { a.x = {}; }, Status::kInvalidArgument, {"x", "absent"}},
      {"x int32", [&](Args& a) { a.x = as(a.x, DType::kI32); }, Status::kUnsupported, {"x", "int32"}},
      {"x strided along d", [&](Args& a) { a.x = raw(x.data(), DType::kF32, cpu, {T, d / 2}, {d, 2}); },
       Status::kInvalidArgument, {"x"}},
      {"router_weight d", [&](Args& a) { a.rw = raw(rw.data(), DType::kF32, cpu, {E, d - 1}, {d, 1}); },
       Status::kInvalidArgument, {"router_weight", "(E, 16)"}},
      {"router_weight too many experts", [&](Args& a) { a.rw = raw(rw.data(), DType::kF32, cpu, {2000, d}, {d, 1}); },
       Status::kInvalidArgument, {"router_weight", "1024"}},
      {"router_weight bf16 with fp32 x", [&](Args& a) { a.rw = raw(rwb.data(), DType::kBF16, cpu, {E, d}, {d, 1}); },
       Status::kInvalidArgument, {"router_weight", "bf16"}},
      {"w13 odd last dimension", [&](Args& a) { a.w13 = raw(w13.data(), DType::kF32, cpu, {E, d, 2 * F - 1}, {d * 2 * F, 2 * F, 1}); },
       Status::kInvalidArgument, {"w13", "2F"}},
      {"w13 experts", [&](Args& a) { a.w13 = raw(w13.data(), DType::kF32, cpu, {E - 1, d, 2 * F}, {d * 2 * F, 2 * F, 1}); },
       Status::kInvalidArgument, {"w13", "(4, 16, 2F)"}},
      {"w13 dtype", [&](Args& a) { a.w13 = raw(w13b.data(), DType::kBF16, cpu, {E, d, 2 * F}, {d * 2 * F, 2 * F, 1}); },
       Status::kInvalidArgument, {"w13", "bf16"}},
      {"w13 rank 2", [&](Args& a) { a.w13 = raw(w13.data(), DType::kF32, cpu, {E * d, 2 * F}, {2 * F, 1}); },
       Status::kInvalidArgument, {"w13", "rank 3"}},
      {"w2 d_ff", [&](Args& a) { a.w2 = raw(w2.data(), DType::kF32, cpu, {E, F - 1, d}, {F * d, d, 1}); },
       Status::kInvalidArgument, {"w2", "(4, 8, 16)"}},
      {"w2 dtype", [&](Args& a) { a.w2 = raw(w2b.data(), DType::kBF16, cpu, {E, F, d}, {F * d, d, 1}); },
       Status::kInvalidArgument, {"w2", "bf16"}},
      {"w2 on another device", [&](Args& a) { a.w2 = on(a.w2, gpu); }, Status::kInvalidArgument, {"w2", "cuda:0"}},
      {"out shape", [&](Args& a) { a.out = raw(out.data(), DType::kF32, cpu, {T, d - 1}, {d, 1}); },
       Status::kInvalidArgument, {"out", "(T, d) = (7, 16)"}},
      {"out dtype", [&](Args& a) { a.out = raw(outb.data(), DType::kBF16, cpu, {T, d}, {d, 1}); },
       Status::kInvalidArgument, {"out", "bf16"}},
      {"out overlaps x", [&](Args& a) { a.out = raw(x.data(), DType::kF32, cpu, {T, d}, {d, 1}); },
       Status::kInvalidArgument, {"out", "x", "overlap"}},
      {"tokens_per_expert shape", [&](Args& a) { a.counts = raw(counts.data(), DType::kI32, cpu, {E - 1}, {1}); },
       Status::kInvalidArgument, {"tokens_per_expert", "(E) = (4)"}},
      {"tokens_per_expert dtype", [&](Args& a) { a.counts = as(a.counts, DType::kF32); },
       Status::kInvalidArgument, {"tokens_per_expert", "int32"}},
      {"dropped shape", [&](Args& a) { a.dropped = raw(dropped.data(), DType::kI32, cpu, {2}, {1}); },
       Status::kInvalidArgument, {"dropped", "(1)"}},
      {"top_k 0", [&](Args& a) { a.o.top_k = 0; }, Status::kInvalidArgument, {"top_k", "E = 4"}},
      {"top_k > E", [&](Args& a) { a.o.top_k = 5; }, Status::kInvalidArgument, {"top_k", "given 5"}},
      {"scoring value", [&](Args& a) { a.o.scoring = static_cast<MoeScoring>(7); }, Status::kInvalidArgument, {"scoring"}},
      {"topk_softmax with sigmoid", [&](Args& a) { a.o.scoring = MoeScoring::kSigmoid, a.o.topk_softmax = true; },
       Status::kInvalidArgument, {"topk_softmax"}},
      {"routed_scale NaN", [&](Args& a) { a.o.routed_scale = NAN; }, Status::kInvalidArgument, {"routed_scale", "nan"}},
      {"capacity_factor NaN", [&](Args& a) { a.o.capacity_factor = NAN; }, Status::kInvalidArgument, {"capacity_factor", "nan"}},
      {"capacity_factor inf", [&](Args& a) { a.o.capacity_factor = INFINITY; }, Status::kInvalidArgument, {"capacity_factor", "inf"}},
      {"variant naive on CPU tensors", [&](Args& a) { a.o.variant = GroupedGemmVariant::kCudaNaive; },
       Status::kInvalidArgument, {"variant", "naive", "CUDA"}},
      {"variant wgmma on fp32", [&](Args& a) { a.o.variant = GroupedGemmVariant::kCudaWgmma; },
       Status::kUnsupported, {"variant", "wgmma", "fp32"}},
      {"variant value", [&](Args& a) { a.o.variant = static_cast<GroupedGemmVariant>(200); },
       Status::kInvalidArgument, {"variant", "200"}},
      {"fp32 router with bf16 x on CUDA",
       [&](Args& a) {
         a.x = raw(xb.data(), DType::kBF16, gpu, {T, d}, {d, 1}), a.rw = on(a.rw, gpu);
         a.w13 = raw(w13b.data(), DType::kBF16, gpu, {E, d, 2 * F}, {d * 2 * F, 2 * F, 1});
         a.w2 = raw(w2b.data(), DType::kBF16, gpu, {E, F, d}, {F * d, d, 1});
         a.out = raw(outb.data(), DType::kBF16, gpu, {T, d}, {d, 1}), a.counts = on(a.counts, gpu), a.dropped = on(a.dropped, gpu);
       },
       Status::kUnsupported, {"router_weight", "CPU only"}},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    Args a = good;
    b.edit(a);
    const Caught caught = run(a);
    EXPECT_ERROR(caught, b.status);
    for (const std::string& w : b.words) EXPECT_CONTAINS(caught, w);
  }
  // nothing written by the refused calls
  for (int64_t i = 0; i < T * d; ++i) ASSERT_TRUE(std::isnan(static_cast<const float*>(out.data())[i])) << "out[" << i << "]";
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(static_cast<const int32_t*>(counts.data())[e], 0x5A5A5A5A);

  // CUDA tensors without a usable device: refused naming x, with the reason
  if (cuda_device_count() == 0) {
    Args a = good;
    for (TensorView* t : {&a.x, &a.rw, &a.w13, &a.w2, &a.out, &a.counts, &a.dropped}) *t = on(*t, gpu);
    const Caught caught = run(a);
    EXPECT_ERROR(caught, Status::kUnsupported);
    EXPECT_MENTIONS(caught, "x");
  }

  // the workspace query
  MoeLayerOptions o;
  EXPECT_EQ(moe_forward_workspace_bytes(T, d, F, E, DType::kF32, o, cpu), 0u);
  Caught q = call([&] { moe_forward_workspace_bytes(T, d, F, 0, DType::kF32, o, gpu); });
  EXPECT_ERROR(q, Status::kInvalidArgument);
  EXPECT_MENTIONS(q, "experts");
  q = call([&] { moe_forward_workspace_bytes(T, d, F, E, DType::kI32, o, gpu); });
  EXPECT_ERROR(q, Status::kUnsupported);
  EXPECT_MENTIONS(q, "dtype");
  o.top_k = 9;
  q = call([&] { moe_forward_workspace_bytes(T, d, F, E, DType::kF32, o, gpu); });
  EXPECT_ERROR(q, Status::kInvalidArgument);
  EXPECT_MENTIONS(q, "top_k");

  // the variant's device, as the C API reads it
  EXPECT_FALSE(grouped_gemm_variant_is_cuda(GroupedGemmVariant::kAuto));
  EXPECT_FALSE(grouped_gemm_variant_is_cuda(GroupedGemmVariant::kCpu));
  EXPECT_TRUE(grouped_gemm_variant_is_cuda(GroupedGemmVariant::kCudaNaive));
  EXPECT_TRUE(grouped_gemm_variant_is_cuda(GroupedGemmVariant::kCudaWgmma));
}

// ---- CUDA --------------------------------------------------------------------------------------------

TEST(MoeLayerCuda, Sweep) {
  SKIP_WITHOUT_CUDA();
  layer_sweep(true);
}

// Each CUDA rung of the grouped GEMM forced (wgmma on an H100 only; fp16 / bf16), on every third case.
TEST(MoeLayerCuda, Variants) {
  SKIP_WITHOUT_CUDA();
  std::vector<GroupedGemmVariant> rungs = {GroupedGemmVariant::kCudaNaive, GroupedGemmVariant::kCudaLoop};
  if (hopper_device()) rungs.push_back(GroupedGemmVariant::kCudaWgmma);
  for (GroupedGemmVariant v : rungs) layer_sweep(true, v, 3);
}

TEST(MoeLayerCuda, AllToOneExpertAndTies) {
  SKIP_WITHOUT_CUDA();
  all_to_one_expert_and_ties(true);
}
TEST(MoeLayerCuda, ZeroTokens) {
  SKIP_WITHOUT_CUDA();
  zero_tokens(true);
}
TEST(MoeLayerCuda, SameBitsEveryRun) {
  SKIP_WITHOUT_CUDA();
  same_bits(true);
}

// On a stream of its own (held back 50 ms, the device copies NaN until its uploads land: a step on any
// other stream reads NaN), with a workspace the caller gives (exactly the query's bytes); and a smaller
// one refused, naming the workspace.
TEST(MoeLayerCuda, OwnStreamAndCallerWorkspace) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  for (double cf : {0.0, 0.5}) {
    LayerCase c;
    c.tokens = 257, c.experts = 8, c.d = 24, c.f = 40, c.o.top_k = 2, c.o.capacity_factor = cf;
    c.dtype = c.router_dtype = DType::kBF16;
    SCOPED_TRACE(c.name());
    LayerData b = make_data(c, rng);
    LayerRef ref = layer_ref(c, b);
    for (int tries = 0; ref.near_tie; ++tries) {
      ASSERT_LT(tries, 20);
      b = make_data(c, rng);
      ref = layer_ref(c, b);
    }
    const size_t bytes = moe_forward_workspace_bytes(c.tokens, c.d, c.f, c.experts, c.dtype, c.o, Device::cuda(0));
    ASSERT_GT(bytes, 0u);
    Buffer ws(DType::kF32, static_cast<int64_t>((bytes + 3) / 4), Device::cuda(0));
    OwnStream stream;
    ExecutionContext ctx;
    ctx.cuda_stream = stream.get();
    ctx.workspace = {ws.data(), bytes};
    std::vector<Buffer> r;
    const std::string err = run_on_cuda(b.all(), Device::cuda(0), stream.get(),
                                        [&](const std::vector<void*>& p) { call_layer(c, p, Device::cuda(0), ctx); }, r);
    ASSERT_TRUE(err.empty()) << err;
    check_layer(c, b, ref, r);

    ctx.workspace = {ws.data(), bytes - 256};
    const Caught small = call([&] {
      std::vector<Buffer> unused;
      run_on_cuda(b.all(), Device::cuda(0), stream.get(),
                  [&](const std::vector<void*>& p) { call_layer(c, p, Device::cuda(0), ctx); }, unused);
    });
    EXPECT_ERROR(small, Status::kInvalidArgument);
    EXPECT_MENTIONS(small, "workspace");
  }
}

// Dropless, the whole forward captured in a CUDA graph (auto then avoids the loop rung, which reads its
// offsets back) with the workspace given: two replays give the bits of the eager call of the rung auto
// picks under capture (wgmma on an H100, else naive).
TEST(MoeLayerCuda, GraphCapture) {
  SKIP_WITHOUT_CUDA();
#if OPTIMIZED_WITH_CUDA
  std::mt19937_64 rng = test_rng();
  LayerCase c;
  c.tokens = 257, c.experts = 64, c.d = 40, c.f = 24, c.o.top_k = 8;
  c.dtype = c.router_dtype = DType::kBF16;
  const LayerData b = make_data(c, rng);
  std::vector<Buffer> dev;
  std::vector<void*> p;
  for (const Buffer* h : b.all()) {
    dev.emplace_back(h->dtype(), h->count(), Device::cuda(0));
    dev.back().copy_from_host(h->data());
    p.push_back(dev.back().data());
  }
  const size_t bytes = moe_forward_workspace_bytes(c.tokens, c.d, c.f, c.experts, c.dtype, c.o, Device::cuda(0));
  Buffer ws(DType::kF32, static_cast<int64_t>((bytes + 3) / 4), Device::cuda(0));
  OwnStream stream;
  ExecutionContext ctx;
  ctx.cuda_stream = stream.get();
  ctx.workspace = {ws.data(), bytes};
  const auto st = static_cast<cudaStream_t>(stream.get());
  LayerCase eager_case = c;  // outside capture, auto would pick loop where wgmma does not run
  if (!hopper_device()) eager_case.o.variant = GroupedGemmVariant::kCudaNaive;
  call_layer(eager_case, p, Device::cuda(0), ctx);  // eager (and warm: the pools, the kernels' attributes)
  ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
  Buffer eager(c.dtype, dev[4].count(), Device::cpu());
  dev[4].copy_to_host(eager.data());

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Caught captured = call([&] { call_layer(c, p, Device::cuda(0), ctx); });
  ASSERT_EQ(cudaStreamEndCapture(st, &graph), cudaSuccess);
  ASSERT_FALSE(captured.thrown) << captured.message;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    dev[4].fill_bytes(0xFF);  // on the legacy stream, which our non-blocking one does not wait for
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, st), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    Buffer got(c.dtype, dev[4].count(), Device::cpu());
    dev[4].copy_to_host(got.data());
    EXPECT_EQ(std::memcmp(got.data(), eager.data(), eager.bytes()), 0) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
#endif
}

}  // namespace
}  // namespace optimized::testing
