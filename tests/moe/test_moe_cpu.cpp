// The MoE family on the CPU (routing and its backward, permutation) against the references of moe_test_util.h, and
// the error paths of the public API (views "on cuda:0" over host memory reach the checks first).
#include <gtest/gtest.h>

#include "moe_tests.h"

namespace optimized::testing {
namespace {

TEST(MoeCpu, RouteSweep) { route_sweep(false); }
TEST(MoeCpu, RouteTies) { route_ties(false); }
TEST(MoeCpu, RouteNan) { route_nan(false); }
TEST(MoeCpu, RouteBackwardSweep) { route_backward_sweep(false); }
TEST(MoeCpu, RouteBackwardNan) { route_backward_nan(false); }
TEST(MoeCpu, RouteBackwardEdges) { route_backward_edges(false); }
TEST(MoeCpu, RouteBackwardWidest) { route_backward_widest(false); }

// The backward's float64 reference is the derivative of the forward's (route_ref's weights and lse):
// central differences of sum_j g_j w_j + gl lse in float64, every scoring mode, on random tokens.
TEST(MoeCpu, RouteBackwardReferenceIsTheDerivative) {
  std::mt19937_64 rng = test_rng();
  std::uniform_real_distribution<double> u(-3.0, 3.0);
  for (int mode = 0; mode < 6; ++mode)
    for (int trial = 0; trial < 4; ++trial) {
      MoeRouteOptions o;
      o.top_k = 3;
      o.topk_softmax = mode == 2 || mode == 3;
      o.normalize = mode == 1 || mode == 3 || mode == 5;
      o.scoring = mode >= 4 ? MoeScoring::kSigmoid : MoeScoring::kSoftmax;
      o.routed_scale = trial % 2 ? 2.5f : 1.0f;
      std::vector<double> l(8), g(3);
      for (double& v : l) v = u(rng);
      for (double& v : g) v = u(rng);
      const double gl = trial == 3 ? 0.0 : u(rng);
      const std::vector<int> ids{5, 1, 6};
      const auto f = [&](const std::vector<double>& x) {
        const RouteRef r = route_ref(x, {}, o);
        const std::vector<double> w = r.weights_for(ids);
        double v = gl * r.lse;
        for (size_t j = 0; j < ids.size(); ++j) v += g[j] * w[j];
        return v;
      };
      const RouteGradRef ref = route_backward_ref(l, ids, g, gl, o);
      for (size_t e = 0; e < l.size(); ++e) {
        std::vector<double> hi = l, lo = l;
        const double h = 1e-5;
        hi[e] += h, lo[e] -= h;
        const double fd = (f(hi) - f(lo)) / (2 * h);
        EXPECT_NEAR(ref.grad[e], fd, 1e-7 * (1 + std::fabs(fd))) << "mode " << mode << " trial " << trial << " expert " << e;
      }
    }
}
TEST(MoeCpu, PermuteSweep) { permute_sweep(false); }
TEST(MoeCpu, PermuteEdges) { permute_edges(false); }
TEST(MoeCpu, GroupedSweep) { grouped_sweep(false); }
TEST(MoeCpu, Combine) { combine_checks(false); }
TEST(MoeCpu, Gather) {
  gather_checks(false);
}
TEST(MoeCpu, GroupedSwiglu) {
  grouped_swiglu(false);
}
TEST(MoeCpu, GroupedOffsets) { grouped_offsets(false); }

TEST(MoeCpu, CapacityAndScoringNames) {
  EXPECT_EQ(moe_capacity(1.0, 4096, 2, 8), 1024);
  EXPECT_EQ(moe_capacity(1.25, 7, 2, 8), 3);  // ceil(2.1875)
  EXPECT_EQ(parse_moe_scoring("sigmoid"), MoeScoring::kSigmoid);
  EXPECT_EQ(moe_scoring_name(MoeScoring::kSoftmax), "softmax");
  Caught r = call([] { parse_moe_scoring("relu"); });
  EXPECT_ERROR(r, Status::kInvalidArgument);
  EXPECT_MENTIONS(r, "scoring: expected one of softmax, sigmoid; given 'relu'");
  r = call([] { moe_capacity(0.0, 1, 1, 1); });
  EXPECT_MENTIONS(r, "capacity_factor: expected a finite number > 0");
}

TEST(MoeErrors, RouteArgumentsAreNamed) {
  const Device cpu = Device::cpu();
  std::vector<float> logits(7 * 8), w(7 * 2), lse(7);
  std::vector<int32_t> ids(7 * 2);
  const TensorView L(logits.data(), DType::kF32, cpu, {7, 8}), I(ids.data(), DType::kI32, cpu, {7, 2}),
      W(w.data(), DType::kF32, cpu, {7, 2});
  const auto route = [&](const TensorView& l, const TensorView& b, const TensorView& i, const TensorView& wt,
                         MoeRouteOptions o) { return call([&] { moe_route(l, b, i, wt, {}, o); }); };
  MoeRouteOptions o;
  EXPECT_FALSE(route(L, {}, I, W, o).thrown);
  o.top_k = 9;
  EXPECT_MENTIONS(route(L, {}, I, W, o), "top_k: expected 1 <= k <= min(E, 32) = 8; given 9");
  o = {};
  o.n_groups = 3;
  EXPECT_MENTIONS(route(L, {}, I, W, o), "n_groups: expected 1 <= n_groups <= 64 dividing E = 8; given 3");
  o = {};
  o.n_groups = 4, o.topk_groups = 5;
  EXPECT_MENTIONS(route(L, {}, I, W, o), "topk_groups: expected 1 <= topk_groups <= n_groups = 4; given 5");
  o = {};
  o.n_groups = 8, o.topk_groups = 1;
  EXPECT_MENTIONS(route(L, {}, I, W, o), "topk_groups: expected the chosen groups to hold at least k = 2 experts");
  o = {};
  o.scoring = MoeScoring::kSigmoid, o.topk_softmax = true;
  EXPECT_MENTIONS(route(L, {}, I, W, o), "topk_softmax: expected softmax scoring");
  o = {};
  EXPECT_MENTIONS(route(L, {}, W, W, o), "topk_ids: expected dtype int32; given fp32");
  EXPECT_MENTIONS(route(L, {}, I, TensorView(w.data(), DType::kF32, cpu, {2, 7}), o),
                  "topk_weights: expected shape (T, k) = (7, 2); given (2, 7)");
  EXPECT_MENTIONS(route(L, TensorView(lse.data(), DType::kF32, cpu, {7}), I, W, o), "bias: expected shape (E) = (8)");
  EXPECT_MENTIONS(route(TensorView(logits.data(), DType::kF32, cpu, {8, 7}, {1, 8}), {}, I, W, o),
                  "logits: expected unit stride along the experts");
  EXPECT_MENTIONS(route(TensorView(ids.data(), DType::kI32, cpu, {7, 2}), {}, I, W, o),
                  "logits: expected dtype fp32, fp16 or bf16; given int32");
  EXPECT_MENTIONS(route(L, {}, I, TensorView(ids.data(), DType::kF32, cpu, {7, 2}), o),
                  "topk_ids: expected an output that does not overlap topk_weights");
  const Device gpu = Device::cuda(0);
  if (!built_with_cuda()) {
    EXPECT_MENTIONS(route(TensorView(logits.data(), DType::kF32, gpu, {7, 8}), {},
                          TensorView(ids.data(), DType::kI32, gpu, {7, 2}), TensorView(w.data(), DType::kF32, gpu, {7, 2}), o),
                    "logits: CUDA tensors given but this build is CPU-only");
  }
}

TEST(MoeErrors, RouteBackwardArgumentsAreNamed) {
  const Device cpu = Device::cpu();
  std::vector<float> logits(7 * 8, 0.5f), gw(7 * 2, 1.0f), gl(7, 1.0f), grad(7 * 8 + 8);
  std::vector<int32_t> ids(7 * 2, 1);
  std::vector<uint16_t> half(7 * 8);
  const TensorView L(logits.data(), DType::kF32, cpu, {7, 8}), I(ids.data(), DType::kI32, cpu, {7, 2}),
      W(gw.data(), DType::kF32, cpu, {7, 2}), S(gl.data(), DType::kF32, cpu, {7}), G(grad.data(), DType::kF32, cpu, {7, 8});
  const auto bwd = [&](const TensorView& l, const TensorView& i, const TensorView& w, const TensorView& s,
                       const TensorView& g, MoeRouteOptions o) {
    return call([&] { moe_route_backward(l, i, w, s, g, o); });
  };
  MoeRouteOptions o;
  EXPECT_FALSE(bwd(L, I, W, S, G, o).thrown);
  EXPECT_FALSE(bwd(L, I, {}, {}, G, o).thrown);
  EXPECT_FALSE(bwd(L, I, W, S, TensorView(grad.data(), DType::kF32, cpu, {7, 8}, {9, 1}), o).thrown);  // padded rows
  EXPECT_FALSE(bwd(as(L, DType::kBF16), I, W, S, TensorView(half.data(), DType::kBF16, cpu, {7, 8}), o).thrown);
  EXPECT_FALSE(bwd(as(L, DType::kBF16), I, W, S, G, o).thrown);  // fp32 gradients of bf16 logits
  o.top_k = 3;
  EXPECT_MENTIONS(bwd(L, I, W, S, G, o), "topk_ids: expected shape (T, k) = (7, 3); given (7, 2)");
  o = {};
  o.top_k = 9;
  EXPECT_MENTIONS(bwd(L, I, W, S, G, o), "top_k: expected 1 <= k <= min(E, 32) = 8; given 9");
  o = {};
  o.scoring = MoeScoring::kSigmoid, o.topk_softmax = true;
  EXPECT_MENTIONS(bwd(L, I, W, S, G, o), "topk_softmax: expected softmax scoring");
  o = {};
  o.routed_scale = INFINITY;
  EXPECT_MENTIONS(bwd(L, I, W, S, G, o), "routed_scale: expected a finite number");
  o = {};
  EXPECT_MENTIONS(bwd(L, as(I, DType::kF32), W, S, G, o), "topk_ids: expected dtype int32; given fp32");
  EXPECT_MENTIONS(bwd(L, I, as(W, DType::kI32), S, G, o), "grad_weights: expected dtype fp32; given int32");
  EXPECT_MENTIONS(bwd(L, I, TensorView(gw.data(), DType::kF32, cpu, {2, 7}), S, G, o),
                  "grad_weights: expected shape (T, k) = (7, 2); given (2, 7)");
  EXPECT_MENTIONS(bwd(L, I, W, TensorView(gl.data(), DType::kF32, cpu, {6}), G, o), "grad_lse: expected shape (T) = (7)");
  EXPECT_MENTIONS(bwd(L, I, W, S, {}, o), "grad_logits: expected shape (T, E) = (7, 8); given absent");
  EXPECT_MENTIONS(bwd(L, I, W, S, TensorView(grad.data(), DType::kF32, cpu, {8, 7}, {1, 8}), o),
                  "grad_logits: expected shape (T, E) = (7, 8); given (8, 7)");
  EXPECT_MENTIONS(bwd(L, I, W, S, TensorView(grad.data(), DType::kF32, cpu, {7, 8}, {1, 7}), o),
                  "grad_logits: expected unit stride in the last dimension");
  EXPECT_MENTIONS(bwd(L, I, W, S, TensorView(half.data(), DType::kF16, cpu, {7, 8}), o),
                  "grad_logits: expected dtype fp32 (the logits') or fp32; given fp16");
  EXPECT_MENTIONS(bwd(as(L, DType::kBF16), I, W, S, TensorView(half.data(), DType::kF16, cpu, {7, 8}), o),
                  "grad_logits: expected dtype bf16 (the logits') or fp32; given fp16");
  EXPECT_MENTIONS(bwd(L, I, W, S, L, o), "grad_logits: expected an output that does not overlap logits");
  EXPECT_MENTIONS(bwd(TensorView(logits.data(), DType::kF32, cpu, {8, 7}, {1, 8}), I, W, S, G, o),
                  "logits: expected unit stride along the experts");
  EXPECT_MENTIONS(bwd(TensorView(logits.data(), DType::kF32, cpu, {7, 8}, {4, 1}), I, W, S, G, o),
                  "logits: expected rows at least E = 8 elements apart");
  EXPECT_MENTIONS(bwd(L, I, W, S, on(G, Device::cuda(0)), o), "grad_logits: expected device cpu");
  if (!built_with_cuda()) {
    const Device gpu = Device::cuda(0);
    EXPECT_MENTIONS(bwd(on(L, gpu), on(I, gpu), on(W, gpu), on(S, gpu), on(G, gpu), o),
                    "logits: CUDA tensors given but this build is CPU-only");
  }
}

TEST(MoeErrors, PermuteArgumentsAreNamed) {
  const Device cpu = Device::cpu();
  std::vector<int32_t> ids(7 * 2), counts(8), offsets(9), sorted(14), slot(14), dropped(1);
  const TensorView I(ids.data(), DType::kI32, cpu, {7, 2}), C(counts.data(), DType::kI32, cpu, {8}),
      O(offsets.data(), DType::kI32, cpu, {9}), S(sorted.data(), DType::kI32, cpu, {14}),
      L(slot.data(), DType::kI32, cpu, {7, 2}), D(dropped.data(), DType::kI32, cpu, {1});
  const auto permute = [&](const TensorView& i, int64_t e, int64_t cap, const TensorView& c, const TensorView& o) {
    return call([&] { moe_permute(i, e, cap, c, o, S, L, D); });
  };
  EXPECT_FALSE(permute(I, 8, 0, C, O).thrown);
  EXPECT_MENTIONS(permute(I, 0, 0, C, O), "num_experts: expected 1 <= E <= 1024; given 0");
  EXPECT_MENTIONS(permute(I, 8, -1, C, O), "capacity: expected >= 0 (0: dropless); given -1");
  EXPECT_MENTIONS(permute(I, 8, 0, O, O), "counts: expected shape (E) = (8); given (9)");
  EXPECT_MENTIONS(permute(I, 8, 0, C, C), "offsets: expected shape (E + 1) = (9); given (8)");
  EXPECT_MENTIONS(permute(TensorView(ids.data(), DType::kI32, cpu, {7, 2}, {1, 7}), 8, 0, C, O),
                  "topk_ids: expected a contiguous tensor");
  EXPECT_MENTIONS(call([&] { moe_permute(I, 8, 0, C, O, S, I, D); }), "slot_of: expected an output that does not overlap topk_ids");
}

}  // namespace
}  // namespace optimized::testing
