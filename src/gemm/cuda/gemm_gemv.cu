// The decode rung: a GEMM with few rows (M = 1 .. a few, the tokens of a decode step) is a
// matrix-vector product in disguise. It is bound by reading B once (K x N elements) and nothing
// of the tensor-core rungs helps: a 64- or 128-row tile computes mostly padding, and a tile grid
// of M / 128 x N / 256 leaves most SMs without work unless K is split (with a workspace and a
// second pass). This rung streams B through CUDA cores instead, with every SM reading:
//
//   block: 32 columns of C x kRows rows (1, 2, 4 or 8: M rounded up, 8 past that), 256 threads =
//     64 k-lanes x 4 column groups. Thread (k-lane l, group g) owns columns 8g .. 8g + 7 and the
//     k-chunks l, l + 64, l + 128, ... of 8 rows of B each: per chunk 8 loads of 16 bytes of B
//     (a warp covers 8 rows x 64 contiguous bytes) and kRows of A, then 8 x 8 x kRows FMAs.
//   reduction: the 8 k-lanes of a warp by shuffles (xor 4, 8, 16), the 8 warps through shared
//     memory summed in warp order: the same bits every run, no atomics.
//   grid: N / 32 blocks across, M / kRows down (a grid-stride loop past 65535), batch over z.
// At N = 4096 that is 128 blocks of 256 threads with up to 16 loads of 16 bytes in flight each
// (two chunks unrolled): ~8 MiB requested at once, what HBM3 needs to stream at full speed.
// Any alignment: rows of A and B that are not 16-byte aligned take element loads.
#include <algorithm>
#include <cstdint>
#include <string>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kColsPerBlock = 32;  // 4 column groups x 8
constexpr int kKLanes = kThreads / 4;

// 8 elements at p (cols < limit of them valid) as floats: one or two 16-byte loads when `vec`.
template <typename T>
__device__ __forceinline__ void load8(const T* p, int64_t valid, bool vec, float (&out)[8]) {
  if (vec && valid >= 8) {
    constexpr int kV = kernels::kVec16<T>;
#pragma unroll
    for (int h = 0; h < 8 / kV; ++h) {
      const kernels::Vec<T, kV> v = kernels::load_vec<T, kV>(p + h * kV);
#pragma unroll
      for (int e = 0; e < kV; ++e) out[h * kV + e] = to_float(v.v[e]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = e < valid ? to_float(p[e]) : 0.0f;
  }
}

// 8 elements of T as 16-byte words (one for 16-bit types, two for fp32), and back to floats.
template <typename T>
constexpr int kWords = 8 * static_cast<int>(sizeof(T)) / 16;
template <typename T>
__device__ __forceinline__ void words_to_floats(const uint4 (&w)[kWords<T>], float (&out)[8]) {
  const T* e = reinterpret_cast<const T*>(&w[0]);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_float(e[i]);
}

// The fast path of one thread: kUnroll chunks at once (c, c + 64, ...), every row, column and k
// inside the matrices and 16-byte aligned, all loads issued before any FMA so that
// kUnroll * (8 + kRows) 16-byte loads are in flight (B streamed once: evict-first).
template <typename T, int kRows, int kUnroll>
__device__ __forceinline__ void gemv_chunks_fast(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t c,
                                                 int rows, float (&acc)[kRows][8]) {
  uint4 bw[kUnroll][8][kWords<T>];
  uint4 aw[kUnroll][kRows][kWords<T>];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t k = 8 * (c + int64_t(u) * kKLanes);
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int w = 0; w < kWords<T>; ++w) bw[u][r][w] = __ldcs(reinterpret_cast<const uint4*>(b + (k + r) * ldb) + w);
#pragma unroll
    for (int m = 0; m < kRows; ++m)
#pragma unroll
      for (int w = 0; w < kWords<T>; ++w)
        aw[u][m][w] = m < rows ? __ldg(reinterpret_cast<const uint4*>(a + m * lda + k) + w) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      float bv[8];
      words_to_floats<T>(bw[u][r], bv);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        float av[8];
        words_to_floats<T>(aw[u][m], av);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(av[r], bv[e], acc[m][e]);
      }
    }
}

template <typename T, int kRows>
__global__ void __launch_bounds__(kThreads) gemm_gemv_kernel(const GemmParams p, int64_t z_base, bool vec_a,
                                                             bool vec_b) {
  __shared__ float partial[kThreads / 32][kRows][kColsPerBlock];
  const BatchOperands<T> ops = batch_operands<T>(p, z_base + blockIdx.z);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = threadIdx.x % 4, k_lane = threadIdx.x / 4;
  const int64_t col0 = int64_t(blockIdx.x) * kColsPerBlock + 8 * group;
  const int64_t cols_valid = p.n - col0;  // may be <= 0: this thread's columns lie past N
  const int64_t chunks = (p.k + 7) / 8;
  const int64_t row_tiles = (p.m + kRows - 1) / kRows;

  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const int64_t row0 = tile * kRows;
    float acc[kRows][8] = {};
    int64_t c = k_lane;
    if (vec_a && vec_b && cols_valid >= 8) {
      constexpr int kUnroll = kRows <= 2 ? 4 : (kRows == 4 ? 2 : 1);
      const int rows = static_cast<int>(p.m - row0 < kRows ? p.m - row0 : kRows);
      const T* b_cols = ops.b + col0;
      const T* a_rows = ops.a + row0 * p.lda;
      for (; c + (kUnroll - 1) * kKLanes < p.k / 8; c += kUnroll * kKLanes)
        gemv_chunks_fast<T, kRows, kUnroll>(a_rows, p.lda, b_cols, p.ldb, c, rows, acc);
    }
    for (; c < chunks; c += kKLanes) {  // what the fast path leaves: edges, tails, misaligned rows
      const int64_t k = 8 * c;
      const int64_t k_valid = p.k - k;
      float b[8][8];
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        if (r < k_valid && cols_valid > 0)
          load8(ops.b + (k + r) * p.ldb + col0, cols_valid, vec_b, b[r]);
        else
#pragma unroll
          for (int e = 0; e < 8; ++e) b[r][e] = 0.0f;
      }
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        float a[8];
        if (row0 + m < p.m)
          load8(ops.a + (row0 + m) * p.lda + k, k_valid, vec_a, a);
        else
#pragma unroll
          for (int e = 0; e < 8; ++e) a[e] = 0.0f;
#pragma unroll
        for (int r = 0; r < 8; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(a[r], b[r][e], acc[m][e]);
      }
    }
    // The 8 k-lanes of this warp (lane bits 2..4), then the 8 warps in order.
#pragma unroll
    for (int m = 0; m < kRows; ++m)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float v = acc[m][e];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (lane < 4) partial[warp][m][8 * group + e] = v;
      }
    __syncthreads();
    if (threadIdx.x < kRows * kColsPerBlock) {
      const int m = threadIdx.x / kColsPerBlock, col = threadIdx.x % kColsPerBlock;
      const int64_t row = row0 + m, out_col = int64_t(blockIdx.x) * kColsPerBlock + col;
      if (row < p.m && out_col < p.n) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) sum += partial[w][m][col];
        store_alpha_beta(ops.c + row * p.ldc + out_col, sum, p.alpha, p.beta);
      }
    }
    __syncthreads();  // partial[] is rewritten by the next row tile
  }
}

template <typename T, int kRows>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&gemm_gemv_kernel<T, kRows>);
}

// kRows for M: 1, 2, 4, then 8.
template <typename F>
cudaError_t with_rows(int64_t m, F&& body) {
  if (m <= 1) return body.template operator()<1>();
  if (m <= 2) return body.template operator()<2>();
  if (m <= 4) return body.template operator()<4>();
  return body.template operator()<8>();
}

template <typename T>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  const bool vec_a = rows_aligned16(p.a, p.lda, p.batch_stride_a, p.batch, p.dtype);
  const bool vec_b = rows_aligned16(p.b, p.ldb, p.batch_stride_b, p.batch, p.dtype);
  const int64_t blocks_x = ceil_div(p.n, int64_t(kColsPerBlock));
  if (blocks_x > INT32_MAX) return cudaErrorInvalidValue;
  return with_rows(p.m, [&]<int kRows>() -> cudaError_t {
    const int64_t row_tiles = ceil_div(p.m, int64_t(kRows));
    for (int64_t z0 = 0; z0 < p.batch; z0 += kMaxGridZ) {
      const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(std::min<int64_t>(row_tiles, kMaxGridY)),
                      static_cast<unsigned>(std::min<int64_t>(p.batch - z0, kMaxGridZ)));
      gemm_gemv_kernel<T, kRows><<<grid, kThreads, 0, stream>>>(p, z0, vec_a, vec_b);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  });
}

}  // namespace

cudaError_t gemm_gemv(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t { return launch<T>(p, stream); });
}

cudaError_t gemm_gemv_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return with_rows(p.m, [&]<int kRows>() -> cudaError_t {
      static const std::string name = "gemm_gemv<" + std::string(dtype_name(kernels::kDTypeOf<T>)) +
                                      ", 32 columns x " + std::to_string(kRows) + " rows, 64 k-lanes>";
      return describe_kernel(kernel_ptr<T, kRows>(), name.c_str(), kThreads, 0, out);
    });
  });
}

}  // namespace optimized::cuda
