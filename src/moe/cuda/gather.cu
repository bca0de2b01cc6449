// The gather of token rows into slot order on CUDA (moe.h's moe_gather): xs[s] = x[sorted_pairs[s] / k],
// zeros for an unused slot. A warp per slot row: 16-byte pieces when the rows allow them (the row's bytes
// and both row strides whole 16-byte units, the bases aligned), else one element per lane. Memory-bound:
// S N e bytes read and written.
#include <algorithm>
#include <cstdint>

#include "kernels/dispatch.cuh"
#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kWarps = 8;

template <typename Unit>
__global__ void __launch_bounds__(32 * kWarps) gather_kernel(const MoeGatherParams p, int64_t units, int64_t ld_x,
                                                            int64_t ld_xs) {
  const int lane = threadIdx.x % 32;
  for (int64_t s = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; s < p.slots; s += int64_t(gridDim.x) * kWarps) {
    const int32_t pair = p.sorted_pairs[s];
    const bool used = pair >= 0 && pair < p.tokens * p.k;
    const Unit* src = static_cast<const Unit*>(p.x) + (used ? (pair / p.k) * ld_x : 0);
    Unit* dst = static_cast<Unit*>(p.xs) + s * ld_xs;
    for (int64_t u = lane; u < units; u += 32) dst[u] = used ? src[u] : Unit{};
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t moe_gather(const MoeGatherParams& p, const Workspace&, cudaStream_t stream) {
  if (p.slots == 0 || p.n == 0) return cudaSuccess;
  const int64_t es = static_cast<int64_t>(dtype_size(p.dtype));
  const int64_t blocks = std::min<int64_t>((p.slots + kWarps - 1) / kWarps, 65535 * 8);
  if ((p.n * es) % 16 == 0 && (p.ld_x * es) % 16 == 0 && (p.ld_xs * es) % 16 == 0 && aligned16(p.x) && aligned16(p.xs)) {
    gather_kernel<uint4><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(p, p.n * es / 16, p.ld_x * es / 16,
                                                                                   p.ld_xs * es / 16);
    return cudaGetLastError();
  }
  return kernels::dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    gather_kernel<T><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(p, p.n, p.ld_x, p.ld_xs);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
