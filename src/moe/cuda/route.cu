// Routing on CUDA: one thread per token running moe_route_token (moe_params.h), the same code the
// CPU backend runs, so that both choose the same experts by the same rule. First version: the
// thread walks its token's E logits k + 3 times (L1 / L2 hits after the first); a warp per token
// with the scores in registers is the next step (docs/perf-notes/moe.md).
#include <algorithm>

#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) route_kernel(const MoeRouteParams p) {
  const int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (t < p.tokens) moe_route_token(p, t);
}

}  // namespace

cudaError_t moe_route(const MoeRouteParams& p, const Workspace&, cudaStream_t stream) {
  if (p.tokens < 1) return cudaSuccess;
  const int64_t blocks = (p.tokens + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  route_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace optimized::cuda
