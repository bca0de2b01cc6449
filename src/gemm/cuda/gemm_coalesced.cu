// GEMM rung 2 of the CUDA ladder: one thread per element of C, coalesced.
//
//   C = alpha * A @ B + beta * C      A (M, K), B (K, N), C (M, N) with leading dims; A and B
//                                     row-major or stored transposed (column-major), C row-major
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
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernel
// dispatched once by the launcher, so the NN kernel is the one described above). A thread reads
// A(row, k) and B(k, col) through the stored layout: a pointer and a step per k. Coalescing is a
// property of the storage, so it changes with it: A^T(row, k) is still one element for the whole
// warp (a broadcast, now down a stored column), but with B^T the 32 lanes read 32 stored rows ldb
// apart at each k: 32 sectors per warp load, the naive rung's pattern moved to B. Each lane then
// walks its own stored row, so L1 serves the next few k from the lines already fetched; the cost
// is in the number of transactions, and rung 3 removes it by staging tiles through shared memory.
// Measured on an H100 (fp32, 2048^3): NN 2.5 ms, TN 5.4 (A^T's broadcast moves to a new line at
// every k), NT and TT 34.
//
// Block 32 x 8 threads: x -> 32 columns of C, y -> 8 rows. Grid x covers N, grid y covers M but
// is capped at 65535 (the CUDA limit), so the kernel walks rows with a grid-stride loop; grid z
// carries the batch, in launches of at most 65535.
#include <cstdint>
#include <string>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kBlockX = 32;  // columns of C per block (the lanes of a warp)
constexpr int kBlockY = 8;   // rows of C per block
constexpr int kThreads = kBlockX * kBlockY;

template <typename T, bool kTransA, bool kTransB>
__global__ void __launch_bounds__(kThreads)
    gemm_coalesced_kernel(GemmParams p, int64_t batch_offset) {
  const BatchOperands<T> ops = batch_operands<T>(p, batch_offset + blockIdx.z);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kBlockX + threadIdx.x;
  if (col >= p.n) return;
  // B(k, col) = b_col[k * b_step] and A(row, k) = a_row[k * a_step] (int64: row * lda may
  // exceed 2^31).
  const T* b_col = ops.b + (kTransB ? col * p.ldb : col);
  const int64_t b_step = kTransB ? 1 : p.ldb;
  const int64_t a_step = kTransA ? p.lda : 1;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * kBlockY;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * kBlockY + threadIdx.y; row < p.m;
       row += row_step) {
    const T* a_row = ops.a + (kTransA ? row : row * p.lda);
    float acc = 0.0f;
    for (int64_t k = 0; k < p.k; ++k)
      acc = fmaf(to_float(a_row[k * a_step]), to_float(b_col[k * b_step]), acc);
    store_alpha_beta(ops.c + row * p.ldc + col, acc, p.alpha, p.beta);
  }
}

template <typename T, bool kTransA, bool kTransB>
const char* kernel_name() {
  static const std::string name = std::string("coalesced<") + dtype_label<T>() + ", 32x8 threads, x->col" +
                                  kLayoutSuffix<kTransA, kTransB> + ">";
  return name.c_str();
}

}  // namespace

cudaError_t gemm_coalesced(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  const int64_t blocks_x = ceil_div(p.n, kBlockX);
  if (blocks_x > INT32_MAX) return cudaErrorInvalidConfiguration;  // grid.x limit (N > 6.8e10)
  const int64_t blocks_y_needed = ceil_div(p.m, kBlockY);
  const int64_t blocks_y = blocks_y_needed < kMaxGridY ? blocks_y_needed : kMaxGridY;
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      return launch_batch_chunks(p.batch, [&](int64_t first, unsigned count) {
        const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y), count);
        gemm_coalesced_kernel<T, kTransA, kTransB><<<grid, dim3(kBlockX, kBlockY), 0, stream>>>(p, first);
      });
    });
  });
}

cudaError_t gemm_coalesced_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      return describe_kernel(reinterpret_cast<const void*>(&gemm_coalesced_kernel<T, kTransA, kTransB>),
                             kernel_name<T, kTransA, kTransB>(), kThreads, /*dynamic_smem_bytes=*/0, out);
    });
  });
}

}  // namespace optimized::cuda
