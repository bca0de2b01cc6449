// The router's backward on CUDA (moe.h's moe_route_backward): one warp per token, as the forward
// (cuda/route.cu) lays it out -- lane l holds experts l, l + 32, ... (kPer = ceil(E / 32) of them) --
// and lane j < k holds the token's pair j (k <= 32 = the warp):
//
//   1. the softmax statistics of the row (max of the numbers, sum of exp; NaN when a logit is NaN)
//   2. lane j: its pair's id, logit and g_j = routed_scale grad_weights[t, j]; whether any g_j of the
//      token is nonzero (a zero row adds nothing, moe.h)
//   3. the pair's term add_j (added at expert id_j) from warp sums over the pairs: q_j (g_j - sum g q)
//      for the softmax over the chosen logits, g_j p[id_j] for the plain softmax (whose - sum g s
//      goes into the coefficient of p[e] with grad_lse), h_j s_j sigmoid(-l) for sigmoid
//   4. every lane its experts: p[e] coef (where a softmax term is live) plus, for each pair j in
//      order (broadcast from lane j), add_j where id_j = e; one rounding to the output's dtype
//
// The CPU backend (cpu/moe_cpu.cpp, route_backward_token) is the same rule a thread a token, with the
// same fp32 formulas and the pairs added in the same order; the sums over E and over the k run in a
// different order, so results may differ in the last bits.
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "moe/cuda/route_row.cuh"
#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

using kernels::MaxOp;
using kernels::SumOp;
using kernels::warp_reduce;

using route::kAll;
using route::kWarpsPerBlock;

static_assert(kMoeMaxTopK <= 32, "a token's pairs are one per lane of its warp");

__device__ __forceinline__ void store_as(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kF16: static_cast<__half*>(base)[i] = kernels::from_float<__half>(v); return;
    case DType::kBF16: static_cast<__nv_bfloat16*>(base)[i] = kernels::from_float<__nv_bfloat16>(v); return;
    default: static_cast<float*>(base)[i] = v;
  }
}

template <typename T, int kPer>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) route_backward_kernel(const MoeRouteBackwardParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= p.tokens) return;  // uniform over the warp
  const int E = static_cast<int>(p.experts);
  const T* row = static_cast<const T*>(p.logits) + t * p.ld;
  // 1. softmax statistics
  const route::Row<kPer> r = route::load_row<T, kPer>(row, E, lane);
  const float(&l)[kPer] = r.l;
  const float m = r.m, sum = r.sum;
  const bool nan = r.nan;
  // 2. lane j: pair j (an id out of range leaves its pair out)
  int id = -1;
  if (lane < p.k) id = p.ids[t * p.k + lane];
  const bool valid = id >= 0 && id < E;
  const float g = valid && p.grad_weights ? p.grad_weights[t * p.k + lane] * p.routed_scale : 0.0f;
  const float lj = valid ? kernels::to_float(row[id]) : 0.0f;
  const bool has_w = __any_sync(kAll, g != 0.0f);  // a NaN gradient counts: it propagates
  const float gl = p.grad_lse ? p.grad_lse[t] : 0.0f;
  bool dense = gl != 0.0f;
  float coef = dense ? gl : 0.0f;
  float add = 0.0f;
  // 3. the pair's term (has_w is uniform over the warp: every lane takes the same branch)
  const bool softmax = p.scoring == 0;
  if (has_w && softmax && (p.topk_softmax || p.normalize)) {
    // q = the softmax over the chosen logits (normalize's p[id_j] / sum_i p[id_i] is the same q)
    const float mk = warp_reduce<MaxOp>(valid && lj == lj ? lj : -INFINITY);
    const float x = valid ? expf(lj - mk) : 0.0f;
    const float q = x / warp_reduce<SumOp>(x);
    add = q * (g - warp_reduce<SumOp>(g * q));
  } else if (has_w && softmax) {
    // s_j = p[id_j]: grad[e] = p[e] (g at e) - p[e] sum_j g_j s_j
    const float s = valid ? expf(lj - m) / sum : 0.0f;
    add = g * s;
    coef -= warp_reduce<SumOp>(add), dense = true;
  } else if (has_w) {
    // s_j = sigmoid(l[id_j]); normalize: h_j = (g_j - sum_i g_i s_i / S) / S. The derivative s (1 - s)
    // takes 1 - s as sigmoid(-l): no cancellation where s is near 1.
    const float s = valid ? 1.0f / (1.0f + expf(-lj)) : 0.0f;
    float h = g;
    if (p.normalize) {
      const float total = warp_reduce<SumOp>(s);
      h = (g - warp_reduce<SumOp>(g * s) / total) / total;
    }
    add = valid ? h * s * (1.0f / (1.0f + expf(lj))) : 0.0f;
  }
  // 4. the row: p[e] coef, then each pair's term in order, one rounding
  float v[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = dense ? expf(l[i] - m) / sum * coef : 0.0f;
  for (int j = 0; j < p.k; ++j) {
    const int idj = __shfl_sync(kAll, valid ? id : -1, j);
    const float addj = __shfl_sync(kAll, add, j);
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (idj == lane + 32 * i) v[i] += addj;
  }
  const bool all_nan = softmax && nan && has_w;  // the weights were NaN: so is their gradient
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    if (e < E) store_as(p.grad_logits, p.grad_dtype, t * p.ld_grad + e, all_nan ? NAN : v[i]);
  }
}

}  // namespace

cudaError_t moe_route_backward(const MoeRouteBackwardParams& p, const Workspace&, cudaStream_t stream) {
  if (p.tokens < 1) return cudaSuccess;
  if (p.experts < 1 || p.experts > kMoeMaxExperts || p.k < 1 || p.k > kMoeMaxTopK) return cudaErrorInvalidValue;
  return route::launch_rows(p.dtype, p.tokens, p.experts, [&]<typename T, int kPer>(dim3 grid, dim3 block) {
    route_backward_kernel<T, kPer><<<grid, block, 0, stream>>>(p);
  });
}

}  // namespace optimized::cuda
