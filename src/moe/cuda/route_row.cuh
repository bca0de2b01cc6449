// What the router's forward (route.cu) and backward (route_backward.cu) share: a warp per token, lane l
// holding the token's logits l, l + 32, ... (kPer = ceil(E / 32) of them; -inf past E), and the row's
// softmax statistics from warp reductions: the max of the numbers (a NaN logit stays out of it) and the
// sum of exp(logit - max), NaN when any logit is NaN.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"

namespace optimized::cuda::route {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kAll = 0xffffffffu;

template <int kPer>
struct Row {
  float l[kPer];
  float m;    // max of the numbers
  float sum;  // sum of exp(l - m); NaN with a NaN logit
  bool nan;   // some logit of the row is NaN (the same on every lane)
};

template <typename T, int kPer>
__device__ __forceinline__ Row<kPer> load_row(const T* row, int experts, int lane) {
  Row<kPer> r;
  r.nan = false;
  r.m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    r.l[i] = e < experts ? kernels::to_float(row[e]) : -INFINITY;
    if (r.l[i] != r.l[i]) r.nan = true;
    else r.m = fmaxf(r.m, r.l[i]);
  }
  r.nan = __any_sync(kAll, r.nan);
  r.m = kernels::warp_reduce<kernels::MaxOp>(r.m);
  r.sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (lane + 32 * i < experts) r.sum += expf(r.l[i] - r.m);
  r.sum = kernels::warp_reduce<kernels::SumOp>(r.sum);
  if (r.nan) r.sum = NAN;
  return r;
}

// The launch of a warp-per-token kernel over `tokens` rows of `experts` logits of `dtype`: calls
// f.template operator()<T, kPer>(grid, block) with the element type and the row width the kernels are
// instantiated for (the smallest of 1, 2, 4, 8, 16, 32 lanes' worth of experts that holds E:
// kMoeMaxExperts = 1024 = 32 x 32), then returns the launch's error.
template <typename F>
__host__ cudaError_t launch_rows(DType dtype, int64_t tokens, int64_t experts, F&& f) {
  const int64_t blocks = (tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks)), block(32 * kWarpsPerBlock);
  const int64_t per = (experts + 31) / 32;
  return kernels::dispatch_float_dtype(dtype, [&]<typename T>() -> cudaError_t {
    if (per <= 1) f.template operator()<T, 1>(grid, block);
    else if (per <= 2) f.template operator()<T, 2>(grid, block);
    else if (per <= 4) f.template operator()<T, 4>(grid, block);
    else if (per <= 8) f.template operator()<T, 8>(grid, block);
    else if (per <= 16) f.template operator()<T, 16>(grid, block);
    else f.template operator()<T, 32>(grid, block);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda::route
