// Routing on CUDA: one warp per token, the token's E scores in registers (lane l holds experts
// l, l + 32, ...; kPer = ceil(E / 32) of them), every step a warp reduction:
//
//   1. max of the logits (NaN aside) and the sum of exp: the softmax statistics and lse
//   2. each expert's score (softmax probability or sigmoid) and choice score (+ bias), as moe.h
//      defines them (the CPU backend's route_token, cpu/moe_cpu.cpp, is the same rule a thread a token)
//   3. group-limited routing: per group, the two best choice scores merged across the warp; the
//      topk_groups best groups (lower index on ties) stay allowed
//   4. k rounds of a warp arg-max over the allowed, unchosen experts (NaN below every number, the
//      lower index on ties), carrying the winner's logit and score
//   5. lane 0: the weights (softmax over the chosen logits, or their scores), normalize, scale
//
// The CPU backend runs route_token, one thread per token: the same rule, the same fp32 formulas;
// sums run in a different order, so weights may differ in the last bits, never the choice (up to
// exact ties of sums, which the rule breaks by index on both).
//
// Version 1 was that same function on the GPU (a thread per token walking E logits k + 3 times):
// at T = 4096, E = 256, k = 8 it took 963 us against 75 for torch's softmax + topk (32 blocks of
// threads on 132 SMs); logs/issue16/moe-timing.log.

#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "moe/cuda/route_row.cuh"
#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

using route::kAll;
using route::kWarpsPerBlock;

struct Best {
  float choice, score, logit;
  int e;  // -1: none
};

// a ranks above b: a number above NaN, the higher value, then the lower index; none (-1) below all.
__device__ __forceinline__ bool better(float ca, int ea, float cb, int eb) {
  if (ea < 0) return false;
  if (eb < 0) return true;
  const bool na = ca != ca, nb = cb != cb;
  if (na != nb) return nb;
  if (!na && ca != cb) return ca > cb;
  return ea < eb;
}

__device__ __forceinline__ Best warp_best(Best b) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    Best o;
    o.choice = __shfl_xor_sync(kAll, b.choice, s);
    o.score = __shfl_xor_sync(kAll, b.score, s);
    o.logit = __shfl_xor_sync(kAll, b.logit, s);
    o.e = __shfl_xor_sync(kAll, b.e, s);
    if (better(o.choice, o.e, b.choice, b.e)) b = o;
  }
  return b;
}

template <typename T, int kPer>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) route_warp_kernel(const MoeRouteParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= p.tokens) return;  // uniform over the warp
  const int E = static_cast<int>(p.experts);
  const T* row = static_cast<const T*>(p.logits) + t * p.ld;
  const route::Row<kPer> r = route::load_row<T, kPer>(row, E, lane);
  const float(&l)[kPer] = r.l;
  const float m = r.m, sum = r.sum;
  const bool nan = r.nan;
  if (p.lse && lane == 0) p.lse[t] = nan ? NAN : m + logf(sum);
  const bool softmax = p.scoring == 0;
  const bool choose_on_logits = softmax && (p.topk_softmax || !p.bias);
  float score[kPer], choice[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    score[i] = softmax ? expf(l[i] - m) / sum : 1.0f / (1.0f + expf(-l[i]));
    const float b = p.bias && e < E ? p.bias[e] : 0.0f;
    choice[i] = (choose_on_logits ? l[i] : score[i]) + b;
  }
  // group-limited routing: the allowed groups as bits
  uint64_t allowed = ~uint64_t(0);
  const int gsize = E / p.n_groups;
  if (p.n_groups > 1) {
    float gscore_mine = NAN;  // lane g holds group g's score (n_groups <= 64: lanes g and g + 32)
    float gscore_hi = NAN;
    for (int g = 0; g < p.n_groups; ++g) {
      // the group's two best: this lane's, then merged across the warp
      Best b1{NAN, 0, 0, -1}, b2{NAN, 0, 0, -1};
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int e = lane + 32 * i;
        if (e >= E || e / gsize != g) continue;
        if (better(choice[i], e, b1.choice, b1.e)) b2 = b1, b1 = Best{choice[i], 0, 0, e};
        else if (better(choice[i], e, b2.choice, b2.e)) b2 = Best{choice[i], 0, 0, e};
      }
      const Best top = warp_best(b1);
      // the second: the best of everything but the top one (this lane's b2 if its b1 was the top)
      const Best second = warp_best(b1.e == top.e ? b2 : b1);
      const float gs = gsize == 1 ? top.choice : top.choice + second.choice;
      if (lane == g) gscore_mine = gs;
      if (lane + 32 == g) gscore_hi = gs;
    }
    allowed = 0;
    for (int j = 0; j < p.topk_groups; ++j) {
      Best b{NAN, 0, 0, -1};
      if (lane < p.n_groups && !(allowed >> lane & 1)) b = Best{gscore_mine, 0, 0, lane};
      if (lane + 32 < p.n_groups && !(allowed >> (lane + 32) & 1) && better(gscore_hi, lane + 32, b.choice, b.e))
        b = Best{gscore_hi, 0, 0, lane + 32};
      const Best w = warp_best(b);
      allowed |= uint64_t(1) << w.e;
    }
  }
  // top-k: k rounds of the warp's arg-max over the allowed, unchosen experts
  unsigned chosen = 0;  // bit i: this lane's expert lane + 32 i was chosen
  int32_t* ids = p.ids + t * p.k;
  float* w = p.weights + t * p.k;
  float wl[kMoeMaxTopK];  // lane 0: the chosen experts' weights (scores, or logits for topk_softmax)
  for (int j = 0; j < p.k; ++j) {
    Best b{NAN, 0, 0, -1};
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      if (e >= E || (chosen >> i & 1)) continue;
      if (p.n_groups > 1 && !(allowed >> (e / gsize) & 1)) continue;
      if (better(choice[i], e, b.choice, b.e)) b = Best{choice[i], score[i], l[i], e};
    }
    const Best top = warp_best(b);
    if (top.e % 32 == lane) chosen |= 1u << (top.e / 32);
    if (lane == 0) {
      ids[j] = top.e;
      wl[j] = softmax && p.topk_softmax ? top.logit : top.score;
    }
  }
  if (lane != 0) return;
  if (softmax && p.topk_softmax) {
    float mk = -INFINITY;
    for (int j = 0; j < p.k; ++j) mk = fmaxf(mk, wl[j]);
    float s = 0.0f;
    for (int j = 0; j < p.k; ++j) s += expf(wl[j] - mk);
    for (int j = 0; j < p.k; ++j) wl[j] = nan ? NAN : expf(wl[j] - mk) / s;
  }
  float total = 0.0f;
  for (int j = 0; j < p.k; ++j) total += wl[j];
  for (int j = 0; j < p.k; ++j) w[j] = (p.normalize ? wl[j] / total : wl[j]) * p.routed_scale;
}

}  // namespace

cudaError_t moe_route(const MoeRouteParams& p, const Workspace&, cudaStream_t stream) {
  if (p.tokens < 1) return cudaSuccess;
  if (p.experts > kMoeMaxExperts || p.k > kMoeMaxTopK || p.n_groups > kMoeMaxGroups) return cudaErrorInvalidValue;
  return route::launch_rows(p.dtype, p.tokens, p.experts, [&]<typename T, int kPer>(dim3 grid, dim3 block) {
    route_warp_kernel<T, kPer><<<grid, block, 0, stream>>>(p);
  });
}

}  // namespace optimized::cuda
