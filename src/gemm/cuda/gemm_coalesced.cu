// GEMM rung 2 of the CUDA ladder: one thread per element of C, coalesced.
//
//   C = alpha * A @ B + beta * C      A (M, K), B (K, N), C (M, N), row-major with leading dims
//
// What this rung changes versus naive: only the mapping of threads to C. threadIdx.x (the 32
// lanes of a warp) now walks along a *row* of C, so at each k the warp
//
//   - reads B[k, col .. col + 31]: 32 consecutive elements, one or a few full sectors (coalesced),
//   - reads A[row, k] once for all lanes (a broadcast), and
//   - writes C[row, col .. col + 31] as one coalesced store.
//
// The arithmetic is the same, but each warp load now moves 128 useful bytes in 4 sectors (fp32)
// instead of 32 sectors, so the kernel stops drowning in memory transactions. What remains: every
// multiply-add still needs two loads from the memory system (L1/L2), and each element of A and B
// is fetched by many warps separately. Rung 3 (smem_tiled) shares them through shared memory.
//
// Block 32 x 8 threads: x -> 32 columns of C, y -> 8 rows. Grid x covers N, grid y covers M but
// is capped at 65535 (the CUDA limit), so the kernel walks rows with a grid-stride loop; grid z
// carries the batch, in launches of at most 65535.
#include <cstdint>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kBlockX = 32;  // columns of C per block (the lanes of a warp)
constexpr int kBlockY = 8;   // rows of C per block
constexpr int kThreads = kBlockX * kBlockY;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gemm_coalesced_kernel(GemmParams p, int64_t batch_offset) {
  const BatchOperands<T> ops = batch_operands<T>(p, batch_offset + blockIdx.z);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kBlockX + threadIdx.x;
  if (col >= p.n) return;
  const T* b_col = ops.b + col;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * kBlockY;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * kBlockY + threadIdx.y; row < p.m;
       row += row_step) {
    const T* a_row = ops.a + row * p.lda;  // int64: row * lda may exceed 2^31
    float acc = 0.0f;
    for (int64_t k = 0; k < p.k; ++k) acc = fmaf(to_float(a_row[k]), to_float(b_col[k * p.ldb]), acc);
    store_alpha_beta(ops.c + row * p.ldc + col, acc, p.alpha, p.beta);
  }
}

template <typename T> constexpr const char* kKernelName = "";
template <> constexpr const char* kKernelName<float> = "coalesced<fp32, 32x8 threads, x->col>";
template <> constexpr const char* kKernelName<__half> = "coalesced<fp16, 32x8 threads, x->col>";
template <> constexpr const char* kKernelName<__nv_bfloat16> =
    "coalesced<bf16, 32x8 threads, x->col>";

}  // namespace

cudaError_t gemm_coalesced(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    const int64_t blocks_x = ceil_div(p.n, kBlockX);
    if (blocks_x > INT32_MAX) return cudaErrorInvalidConfiguration;  // grid.x limit (N > 6.8e10)
    const int64_t blocks_y_needed = ceil_div(p.m, kBlockY);
    const int64_t blocks_y = blocks_y_needed < kMaxGridY ? blocks_y_needed : kMaxGridY;
    for (int64_t first = 0; first < p.batch; first += kMaxGridZ) {
      const int64_t count = p.batch - first < kMaxGridZ ? p.batch - first : kMaxGridZ;
      const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y),
                      static_cast<unsigned>(count));
      gemm_coalesced_kernel<T><<<grid, dim3(kBlockX, kBlockY), 0, stream>>>(p, first);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  });
}

cudaError_t gemm_coalesced_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return describe_kernel(reinterpret_cast<const void*>(&gemm_coalesced_kernel<T>),
                           kKernelName<T>, kThreads, /*dynamic_smem_bytes=*/0, out);
  });
}

}  // namespace optimized::cuda
