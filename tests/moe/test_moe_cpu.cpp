// The MoE family on the CPU (routing, permutation) against the references of moe_test_util.h, and
// the error paths of the public API (views "on cuda:0" over host memory reach the checks first).
#include <gtest/gtest.h>

#include "moe_tests.h"

namespace optimized::testing {
namespace {

TEST(MoeCpu, RouteSweep) { route_sweep(false); }
TEST(MoeCpu, RouteTies) { route_ties(false); }
TEST(MoeCpu, RouteNan) { route_nan(false); }
TEST(MoeCpu, PermuteSweep) { permute_sweep(false); }
TEST(MoeCpu, PermuteEdges) { permute_edges(false); }
TEST(MoeCpu, GroupedSweep) { grouped_sweep(false); }
TEST(MoeCpu, Combine) { combine_checks(false); }
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
  if (!built_with_cuda())
    EXPECT_MENTIONS(route(TensorView(logits.data(), DType::kF32, gpu, {7, 8}), {},
                          TensorView(ids.data(), DType::kI32, gpu, {7, 2}), TensorView(w.data(), DType::kF32, gpu, {7, 2}), o),
                    "logits: CUDA tensors given but this build is CPU-only");
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
