// GEMM rung 1 of the CUDA ladder: naive, one thread per element of C.
//
//   C = alpha * A @ B + beta * C      A (M, K), B (K, N), C (M, N) with leading dims; A and B
//                                     row-major or stored transposed (column-major), C row-major
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
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernel
// dispatched once by the launcher, so the NN kernel is the one described above). A thread reads
// A(row, k) and B(k, col) through the stored layout: a pointer to the first element and a step
// per k (1 along a stored row, ld down a stored column). The access pattern follows the storage:
// with A^T the 32 lanes read A^T's stored row k at 32 consecutive rows of A, which is coalesced
// (the "wrong" mapping happens to suit A^T); with B^T every lane still reads the same element
// (a broadcast), now walking along a stored row. There is no extra arithmetic for any layout.
//
// Epilogue (GemmEpilogue: bias, activation, aux, residual, an fp32 C from 16-bit operands, column
// sums): each thread hands its sum to the epilogue functor (kernels/epilogue/fused_epilogue.cuh),
// which reads and writes the extra tensors of that one element. Column sums, the readable way:
// every thread also writes its fp32 output into an M x N scratch in the workspace, and
// finish_column_sums adds the M rows of each column in order.
//
// Block 32 x 8 threads: x -> 32 rows of C, y -> 8 columns. Grid x covers M (it may go to
// 2^31 - 1 blocks), grid y covers N but is capped at 65535 (the CUDA limit), so the kernel walks
// columns with a grid-stride loop; grid z carries the batch, in launches of at most 65535.
#include <cstdint>
#include <string>
#include <type_traits>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kBlockX = 32;  // rows of C per block (the lanes of a warp)
constexpr int kBlockY = 8;   // columns of C per block
constexpr int kThreads = kBlockX * kBlockY;

template <typename T, typename TC, bool kTransA, bool kTransB>
__global__ void __launch_bounds__(kThreads)
    gemm_naive_kernel(GemmParams p, int64_t batch_offset, GemmEpilogueOp<TC> epi, float* outs) {
  const int64_t z = batch_offset + blockIdx.z;
  const BatchOperands<T> ops = batch_operands<T>(p, z);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kBlockX + threadIdx.x;
  if (row >= p.m) return;
  // A(row, k) = a_row[k * a_step] and B(k, col) = b_col[k * b_step] (int64: row * lda may
  // exceed 2^31).
  const T* a_row = ops.a + (kTransA ? row : row * p.lda);
  const int64_t a_step = kTransA ? p.lda : 1;
  const int64_t b_step = kTransB ? 1 : p.ldb;
  const int64_t col_step = static_cast<int64_t>(gridDim.y) * kBlockY;
  for (int64_t col = static_cast<int64_t>(blockIdx.y) * kBlockY + threadIdx.y; col < p.n;
       col += col_step) {
    const T* b_col = ops.b + (kTransB ? col * p.ldb : col);
    float acc = 0.0f;
    for (int64_t k = 0; k < p.k; ++k)
      acc = fmaf(to_float(a_row[k * a_step]), to_float(b_col[k * b_step]), acc);
    const float out = epi.store(z, row, col, acc);
    if (outs) outs[(z * p.m + row) * p.n + col] = out;
  }
}

template <typename T, typename TC, bool kTransA, bool kTransB>
const char* kernel_name() {
  static const std::string name = std::string("naive<") + dtype_label<T>() +
                                  (std::is_same_v<T, TC> ? "" : ", fp32 out") + ", 32x8 threads, x->row" +
                                  kLayoutSuffix<kTransA, kTransB> + ">";
  return name.c_str();
}

}  // namespace

cudaError_t gemm_naive(const GemmParams& p, const Workspace& workspace, cudaStream_t stream) {
  const int64_t blocks_x = ceil_div(p.m, kBlockX);
  if (blocks_x > INT32_MAX) return cudaErrorInvalidConfiguration;  // grid.x limit (M > 6.8e10)
  const int64_t blocks_y_needed = ceil_div(p.n, kBlockY);
  const int64_t blocks_y = blocks_y_needed < kMaxGridY ? blocks_y_needed : kMaxGridY;
  // Column sums: every output row is its own row of partials.
  float* outs = nullptr;
  if (p.epi.column_sums) {
    if (workspace.data == nullptr || workspace.bytes < column_sum_bytes(p, p.m)) return cudaErrorInvalidValue;
    outs = static_cast<float*>(workspace.data);
  }
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_c_dtype<T>(p, [&]<typename TC>() -> cudaError_t {
      const GemmEpilogueOp<TC> epi = make_gemm_epilogue<TC>(p);
      if (cudaError_t e = dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
            return launch_batch_chunks(p.batch, [&](int64_t first, unsigned count) {
              const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y), count);
              gemm_naive_kernel<T, TC, kTransA, kTransB><<<grid, dim3(kBlockX, kBlockY), 0, stream>>>(p, first, epi, outs);
            });
          });
          e != cudaSuccess)
        return e;
      return outs ? finish_column_sums(p, outs, p.m, stream) : cudaSuccess;
    });
  });
}

cudaError_t gemm_naive_workspace(const GemmParams& p, size_t* bytes) {
  *bytes = column_sum_bytes(p, p.m);
  return cudaSuccess;
}

cudaError_t gemm_naive_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_c_dtype<T>(p, [&]<typename TC>() -> cudaError_t {
      return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
        return describe_kernel(reinterpret_cast<const void*>(&gemm_naive_kernel<T, TC, kTransA, kTransB>),
                               kernel_name<T, TC, kTransA, kTransB>(), kThreads, /*dynamic_smem_bytes=*/0, out);
      });
    });
  });
}

}  // namespace optimized::cuda
