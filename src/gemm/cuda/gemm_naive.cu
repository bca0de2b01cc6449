// GEMM rung 1 of the CUDA ladder: naive, one thread per element of C.
//
//   C = alpha * A @ B + beta * C      A (M, K), B (K, N), C (M, N), row-major with leading dims
//
// The textbook first kernel, kept slow on purpose so the next rungs have something to fix.
// Each thread owns one element C[row, col] and runs the whole dot product over K from global
// memory. The thread index is mapped the "wrong" way round: threadIdx.x (the fastest-varying
// index, so the 32 lanes of a warp) walks down a *column* of C:
//
//   - A: the 32 lanes read A[row .. row + 31, k], 32 different rows lda elements apart: 32
//     separate 32-byte sectors for 128 useful bytes (uncoalesced; L1 keeps some of it for the
//     next few k, which is what stops this from being even slower).
//   - B: every lane reads the same B[k, col]: one broadcast sector, no reuse across lanes.
//   - C: the 32 lanes write 32 different rows ldc apart: 32 sectors per warp store.
//
// So every fused multiply-add costs two global loads, one of them uncoalesced, and no data is
// shared between threads except through the caches. Rung 2 (coalesced) swaps the mapping.
//
// Block 32 x 8 threads: x -> 32 rows of C, y -> 8 columns. Grid x covers M (it may go to
// 2^31 - 1 blocks), grid y covers N but is capped at 65535 (the CUDA limit), so the kernel walks
// columns with a grid-stride loop; grid z carries the batch, in launches of at most 65535.
#include <cstdint>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kBlockX = 32;  // rows of C per block (the lanes of a warp)
constexpr int kBlockY = 8;   // columns of C per block
constexpr int kThreads = kBlockX * kBlockY;

template <typename T>
__global__ void __launch_bounds__(kThreads) gemm_naive_kernel(GemmParams p, int64_t batch_offset) {
  const BatchOperands<T> ops = batch_operands<T>(p, batch_offset + blockIdx.z);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kBlockX + threadIdx.x;
  if (row >= p.m) return;
  const T* a_row = ops.a + row * p.lda;  // int64: row * lda may exceed 2^31
  const int64_t col_step = static_cast<int64_t>(gridDim.y) * kBlockY;
  for (int64_t col = static_cast<int64_t>(blockIdx.y) * kBlockY + threadIdx.y; col < p.n;
       col += col_step) {
    const T* b_col = ops.b + col;
    float acc = 0.0f;
    for (int64_t k = 0; k < p.k; ++k) acc = fmaf(to_float(a_row[k]), to_float(b_col[k * p.ldb]), acc);
    store_alpha_beta(ops.c + row * p.ldc + col, acc, p.alpha, p.beta);
  }
}

template <typename T> constexpr const char* kKernelName = "";
template <> constexpr const char* kKernelName<float> = "naive<fp32, 32x8 threads, x->row>";
template <> constexpr const char* kKernelName<__half> = "naive<fp16, 32x8 threads, x->row>";
template <> constexpr const char* kKernelName<__nv_bfloat16> = "naive<bf16, 32x8 threads, x->row>";

}  // namespace

cudaError_t gemm_naive(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    const int64_t blocks_x = ceil_div(p.m, kBlockX);
    if (blocks_x > INT32_MAX) return cudaErrorInvalidConfiguration;  // grid.x limit (M > 6.8e10)
    const int64_t blocks_y_needed = ceil_div(p.n, kBlockY);
    const int64_t blocks_y = blocks_y_needed < kMaxGridY ? blocks_y_needed : kMaxGridY;
    for (int64_t first = 0; first < p.batch; first += kMaxGridZ) {
      const int64_t count = p.batch - first < kMaxGridZ ? p.batch - first : kMaxGridZ;
      const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y),
                      static_cast<unsigned>(count));
      gemm_naive_kernel<T><<<grid, dim3(kBlockX, kBlockY), 0, stream>>>(p, first);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  });
}

cudaError_t gemm_naive_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return describe_kernel(reinterpret_cast<const void*>(&gemm_naive_kernel<T>), kKernelName<T>,
                           kThreads, /*dynamic_smem_bytes=*/0, out);
  });
}

}  // namespace optimized::cuda
