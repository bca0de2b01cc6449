// The MoE family on CUDA (routing and its backward, permutation) against the references of
// moe_test_util.h; every test skips without a CUDA device.
#include <gtest/gtest.h>

#include "moe_tests.h"

namespace optimized::testing {
namespace {

TEST(MoeCuda, RouteSweep) {
  SKIP_WITHOUT_CUDA();
  route_sweep(true);
}
TEST(MoeCuda, RouteTies) {
  SKIP_WITHOUT_CUDA();
  route_ties(true);
}
TEST(MoeCuda, RouteNan) {
  SKIP_WITHOUT_CUDA();
  route_nan(true);
}
TEST(MoeCuda, RouteBackwardSweep) {
  SKIP_WITHOUT_CUDA();
  route_backward_sweep(true);
}
TEST(MoeCuda, RouteBackwardNan) {
  SKIP_WITHOUT_CUDA();
  route_backward_nan(true);
}
TEST(MoeCuda, RouteBackwardEdges) {
  SKIP_WITHOUT_CUDA();
  route_backward_edges(true);
}
TEST(MoeCuda, RouteBackwardWidest) {
  SKIP_WITHOUT_CUDA();
  route_backward_widest(true);
}
TEST(MoeCuda, PermuteSweep) {
  SKIP_WITHOUT_CUDA();
  permute_sweep(true);
}
TEST(MoeCuda, PermuteEdges) {
  SKIP_WITHOUT_CUDA();
  permute_edges(true);
}

TEST(MoeCuda, GroupedSweep) {
  SKIP_WITHOUT_CUDA();
  grouped_sweep(true);
}
TEST(MoeCuda, Gather) {
  SKIP_WITHOUT_CUDA();
  gather_checks(true);
}
TEST(MoeCuda, GroupedSwiglu) {
  SKIP_WITHOUT_CUDA();
  grouped_swiglu(true);
}
TEST(MoeCuda, GroupedOffsets) {
  SKIP_WITHOUT_CUDA();
  grouped_offsets(true);
}

TEST(MoeCuda, Combine) {
  SKIP_WITHOUT_CUDA();
  combine_checks(true);
}

// Twice on the same ids: every output the same bits (no atomic decides an order).
TEST(MoeCuda, PermuteIsDeterministic) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng = test_rng();
  const std::vector<int32_t> ids = make_ids(8192 * 8, 256, 2, rng);
  for (int i = 0; i < 2; ++i) run_and_check_permute(ids, 8192, 8, 256, moe_capacity(1.0, 8192, 8, 256), true, "run " + std::to_string(i));
}

}  // namespace
}  // namespace optimized::testing
