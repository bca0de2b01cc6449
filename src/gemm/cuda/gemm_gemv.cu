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
//
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernels
// dispatched once by the launcher, so the NN kernel is the one described above).
//   A^T (TN, TT): A is at most 8 rows of K and stays in L1/L2. Stored (K, M), the kRows values of
//     one k are contiguous (A^T's stored row k), so a chunk of 8 k is 8 vector loads of the row
//     tile (one load of kRows elements, two for 8 fp32 rows) when the stored rows are aligned for
//     it, element loads otherwise (and for a row tile cut by M). Each lane's loads touch 8 lines
//     of its own, against one or two 16-byte loads per row along a row-major A: measured on an
//     H100 (bf16, N = K = 4096, warm L2), TN runs at NN's speed, TT at ~65% of NT at M = 8 and
//     at NT's speed for M <= 2. B's side is unchanged.
//   B^T (NT, TT): B is stored (N, K), each column of C a dot product with a contiguous stored row,
//     so reading B^T with the kernel above would walk down columns. A second kernel reads it along
//     its rows instead: the same block (256 threads, 32 columns of C, kRows rows) as 8 warps of 4
//     columns each; lane l of a warp takes the k-chunks l, l + 32, l + 64, ... of 8 elements of
//     its 4 stored rows (a warp reads 4 x 512 contiguous bytes per step, 16-byte loads when
//     aligned, with 2 or 4 chunks unrolled for small kRows) and of the kRows rows of A, and the
//     warp sums its lanes by shuffles (xor 16, 8, 4, 2, 1: the same bits every run, no shared
//     memory). B is still read exactly once, coalesced, and the grid is the same N / 32 blocks
//     (measured as above: from 1.2x NN's speed at M = 1 to 0.8x at M = 8, where each lane holds
//     only 4 x 16 bytes of B in flight against NN's 8).
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

// 8 elements of A^T's row m at k .. k + 7 (stored (K, M), so `stride` = lda apart) as floats,
// zero beyond `valid`.
template <typename T>
__device__ __forceinline__ void load8_strided(const T* p, int64_t stride, int64_t valid, float (&out)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = e < valid ? to_float(p[e * stride]) : 0.0f;
}

// A^T's vector loads: the kRows values A(row0 .. row0 + kRows - 1, k) are contiguous in A^T's
// stored row k, read kAVecT elements (at most 16 bytes) at a time.
template <typename T, int kRows>
constexpr int kAVecT = kRows < kernels::kVec16<T> ? kRows : kernels::kVec16<T>;

// A's values for kUnroll chunks of kRows rows, loaded before any FMA. Row-major A: raw 16-byte
// words of A's rows (one or two loads per row and chunk). A^T: per k, the kRows values of A^T's
// stored row k, as vectors of kAVecT elements when kAVec (the launcher checked the alignment; the
// whole row tile lies inside M), else element by element. `a` points at A(row0, 0).
template <typename T, int kRows, int kUnroll, bool kTransA, bool kAVec = false>
struct ARegs {
  uint4 w[kUnroll][kRows][kWords<T>];
  __device__ __forceinline__ void load(const T* a, int64_t lda, int64_t k, int u, int rows) {
#pragma unroll
    for (int m = 0; m < kRows; ++m)
#pragma unroll
      for (int i = 0; i < kWords<T>; ++i)
        w[u][m][i] = m < rows ? __ldg(reinterpret_cast<const uint4*>(a + m * lda + k) + i) : make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void get(int u, int m, float (&out)[8]) const { words_to_floats<T>(w[u][m], out); }
};
template <typename T, int kRows, int kUnroll, bool kAVec>
struct ARegs<T, kRows, kUnroll, true, kAVec> {
  T v[kUnroll][kRows][8];  // 16-bit values stay packed two to a register
  __device__ __forceinline__ void load(const T* a, int64_t lda, int64_t k, int u, int rows) {
    constexpr int kW = kAVecT<T, kRows>;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (kAVec) {
#pragma unroll
        for (int m0 = 0; m0 < kRows; m0 += kW) {
          const kernels::Vec<T, kW> x = kernels::load_vec<T, kW>(a + (k + e) * lda + m0);
#pragma unroll
          for (int m = 0; m < kW; ++m) v[u][m0 + m][e] = x.v[m];
        }
      } else {
#pragma unroll
        for (int m = 0; m < kRows; ++m) v[u][m][e] = m < rows ? __ldg(a + (k + e) * lda + m) : from_float<T>(0.0f);
      }
    }
  }
  __device__ __forceinline__ void get(int u, int m, float (&out)[8]) const {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = to_float(v[u][m][e]);
  }
};

// The fast path of one thread: kUnroll chunks at once (c, c + 64, ...), every row, column and k
// inside the matrices and 16-byte aligned, all loads issued before any FMA so that
// kUnroll * (8 + kRows) 16-byte loads are in flight (B streamed once: evict-first).
template <typename T, int kRows, int kUnroll, bool kTransA, bool kAVec>
__device__ __forceinline__ void gemv_chunks_fast(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t c,
                                                 int rows, float (&acc)[kRows][8]) {
  uint4 bw[kUnroll][8][kWords<T>];
  ARegs<T, kRows, kUnroll, kTransA, kAVec> ar;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t k = 8 * (c + int64_t(u) * kKLanes);
#pragma unroll
    for (int r = 0; r < 8; ++r)
#pragma unroll
      for (int w = 0; w < kWords<T>; ++w) bw[u][r][w] = __ldcs(reinterpret_cast<const uint4*>(b + (k + r) * ldb) + w);
    ar.load(a, lda, k, u, rows);
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
        ar.get(u, m, av);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(av[r], bv[e], acc[m][e]);
      }
    }
}

template <typename T, int kRows, bool kTransA>
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
    if ((kTransA || vec_a) && vec_b && cols_valid >= 8) {
      constexpr int kUnroll = kRows <= 2 ? 4 : (kRows == 4 ? 2 : 1);
      const int rows = static_cast<int>(p.m - row0 < kRows ? p.m - row0 : kRows);
      const T* b_cols = ops.b + col0;
      const T* a_rows = kTransA ? ops.a + row0 : ops.a + row0 * p.lda;
      if (kTransA && vec_a && rows == kRows) {
        for (; c + (kUnroll - 1) * kKLanes < p.k / 8; c += kUnroll * kKLanes)
          gemv_chunks_fast<T, kRows, kUnroll, kTransA, true>(a_rows, p.lda, b_cols, p.ldb, c, rows, acc);
      } else {
        for (; c + (kUnroll - 1) * kKLanes < p.k / 8; c += kUnroll * kKLanes)
          gemv_chunks_fast<T, kRows, kUnroll, kTransA, false>(a_rows, p.lda, b_cols, p.ldb, c, rows, acc);
      }
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
        if (row0 + m < p.m && kTransA)
          load8_strided(ops.a + k * p.lda + row0 + m, p.lda, k_valid, a);
        else if (row0 + m < p.m)
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

// ---- B^T: a warp per 4 columns of C, K split over its lanes ------------------------------------
constexpr int kColsPerWarpT = 4;
static_assert(kThreads / 32 * kColsPerWarpT == kColsPerBlock, "the B^T kernel's block covers the same columns");

// The fast path of one lane: kUnroll chunks (c, c + 32, ...) of 8 k of the warp's 4 stored rows
// of B^T and of the kRows rows of A, every one inside the matrices and 16-byte aligned; all loads
// issued before any FMA (B streamed once: evict-first). `b` points at the warp's first stored row,
// `a` at A(row0, 0).
template <typename T, int kRows, int kUnroll, bool kTransA, bool kAVec>
__device__ __forceinline__ void gemv_bt_chunks_fast(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t c,
                                                    int rows, float (&acc)[kRows][kColsPerWarpT]) {
  uint4 bw[kUnroll][kColsPerWarpT][kWords<T>];
  ARegs<T, kRows, kUnroll, kTransA, kAVec> ar;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t k = 8 * (c + int64_t(u) * 32);
#pragma unroll
    for (int j = 0; j < kColsPerWarpT; ++j)
#pragma unroll
      for (int w = 0; w < kWords<T>; ++w) bw[u][j][w] = __ldcs(reinterpret_cast<const uint4*>(b + j * ldb + k) + w);
    ar.load(a, lda, k, u, rows);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      float av[8];
      ar.get(u, m, av);
#pragma unroll
      for (int j = 0; j < kColsPerWarpT; ++j) {
        float bv[8];
        words_to_floats<T>(bw[u][j], bv);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[m][j] = fmaf(av[e], bv[e], acc[m][j]);
      }
    }
}

template <typename T, int kRows, bool kTransA>
__global__ void __launch_bounds__(kThreads, 1) gemm_gemv_bt_kernel(const GemmParams p, int64_t z_base, bool vec_a,
                                                                bool vec_b) {
  const BatchOperands<T> ops = batch_operands<T>(p, z_base + blockIdx.z);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col0 = int64_t(blockIdx.x) * kColsPerBlock + warp * kColsPerWarpT;
  if (col0 >= p.n) return;  // no barrier in this kernel: a warp past N has nothing to do
  const int cols = static_cast<int>(p.n - col0 < kColsPerWarpT ? p.n - col0 : kColsPerWarpT);  // 1..4
  const T* b_rows = ops.b + col0 * p.ldb;  // the warp's stored rows of B^T: columns col0.. of B
  const int64_t chunks = (p.k + 7) / 8;
  const int64_t row_tiles = (p.m + kRows - 1) / kRows;

  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const int64_t row0 = tile * kRows;
    const int rows = static_cast<int>(p.m - row0 < kRows ? p.m - row0 : kRows);
    float acc[kRows][kColsPerWarpT] = {};
    int64_t c = lane;
    if ((kTransA || vec_a) && vec_b && cols == kColsPerWarpT) {
      // 16 bytes of B per lane and column per chunk (32 for fp32): 4 x kUnroll loads in flight.
      constexpr int kUnroll = kRows <= 2 ? 4 : (kRows == 4 ? 2 : 1);
      const T* a_rows = kTransA ? ops.a + row0 : ops.a + row0 * p.lda;
      if (kTransA && vec_a && rows == kRows) {
        for (; c + (kUnroll - 1) * 32 < p.k / 8; c += kUnroll * 32)
          gemv_bt_chunks_fast<T, kRows, kUnroll, kTransA, true>(a_rows, p.lda, b_rows, p.ldb, c, rows, acc);
      } else {
        for (; c + (kUnroll - 1) * 32 < p.k / 8; c += kUnroll * 32)
          gemv_bt_chunks_fast<T, kRows, kUnroll, kTransA, false>(a_rows, p.lda, b_rows, p.ldb, c, rows, acc);
      }
    }
    for (; c < chunks; c += 32) {  // what the fast path leaves: edges, tails, misaligned rows
      const int64_t k = 8 * c;
      const int64_t k_valid = p.k - k;
      float b[kColsPerWarpT][8];
#pragma unroll
      for (int j = 0; j < kColsPerWarpT; ++j) {
        if (j < cols)
          load8(b_rows + j * p.ldb + k, k_valid, vec_b, b[j]);
        else
#pragma unroll
          for (int e = 0; e < 8; ++e) b[j][e] = 0.0f;
      }
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        float a[8];
        if (m < rows && kTransA)
          load8_strided(ops.a + k * p.lda + row0 + m, p.lda, k_valid, a);
        else if (m < rows)
          load8(ops.a + (row0 + m) * p.lda + k, k_valid, vec_a, a);
        else
#pragma unroll
          for (int e = 0; e < 8; ++e) a[e] = 0.0f;
#pragma unroll
        for (int j = 0; j < kColsPerWarpT; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m][j] = fmaf(a[e], b[j][e], acc[m][j]);
      }
    }
    // Sum the 32 lanes; lane 4m + j then writes C(row0 + m, col0 + j).
#pragma unroll
    for (int m = 0; m < kRows; ++m)
#pragma unroll
      for (int j = 0; j < kColsPerWarpT; ++j) {
        float v = acc[m][j];
#pragma unroll
        for (int x = 16; x >= 1; x /= 2) v += __shfl_xor_sync(0xffffffffu, v, x);
        if (lane == kColsPerWarpT * m + j && m < rows && j < cols)
          store_alpha_beta(ops.c + (row0 + m) * p.ldc + col0 + j, v, p.alpha, p.beta);
      }
  }
}

template <typename T, int kRows, bool kTransA, bool kTransB>
const void* kernel_ptr() {
  if constexpr (kTransB)
    return reinterpret_cast<const void*>(&gemm_gemv_bt_kernel<T, kRows, kTransA>);
  else
    return reinterpret_cast<const void*>(&gemm_gemv_kernel<T, kRows, kTransA>);
}

// kRows for M: 1, 2, 4, then 8.
template <typename F>
cudaError_t with_rows(int64_t m, F&& body) {
  if (m <= 1) return body.template operator()<1>();
  if (m <= 2) return body.template operator()<2>();
  if (m <= 4) return body.template operator()<4>();
  return body.template operator()<8>();
}

// Whether A^T's stored rows allow the vector loads of kAVecT<T, kRows> elements (ARegs): base,
// lda and the batch stride multiples of the vector; a single row (kRows = 1) gains nothing.
template <typename T, int kRows>
bool a_t_vectorizable(const GemmParams& p) {
  constexpr int64_t kW = kAVecT<T, kRows>;
  return kRows > 1 && reinterpret_cast<uintptr_t>(p.a) % (kW * sizeof(T)) == 0 && p.lda % kW == 0 &&
         (p.batch <= 1 || p.batch_stride_a % kW == 0);
}

// vec_a / vec_b: the kernels' 16-byte loads along A's and B's stored rows are allowed. For A^T,
// vec_a says instead whether A^T's stored rows take the vector loads of a_t_vectorizable.
template <typename T>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  const bool vec_b = b_rows_aligned16(p);
  const int64_t blocks_x = ceil_div(p.n, int64_t(kColsPerBlock));
  if (blocks_x > INT32_MAX) return cudaErrorInvalidValue;
  return with_rows(p.m, [&]<int kRows>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      const bool vec_a = kTransA ? a_t_vectorizable<T, kRows>(p) : a_rows_aligned16(p);
      const int64_t row_tiles = ceil_div(p.m, int64_t(kRows));
      if (cudaError_t e = launch_batch_chunks(p.batch, [&](int64_t z0, unsigned count) {
            const dim3 grid(static_cast<unsigned>(blocks_x),
                            static_cast<unsigned>(std::min<int64_t>(row_tiles, kMaxGridY)), count);
            if constexpr (kTransB)
              gemm_gemv_bt_kernel<T, kRows, kTransA><<<grid, kThreads, 0, stream>>>(p, z0, vec_a, vec_b);
            else
              gemm_gemv_kernel<T, kRows, kTransA><<<grid, kThreads, 0, stream>>>(p, z0, vec_a, vec_b);
          });
          e != cudaSuccess)
        return e;
      return cudaSuccess;
    });
  });
}

}  // namespace

cudaError_t gemm_gemv(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t { return launch<T>(p, stream); });
}

cudaError_t gemm_gemv_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return with_rows(p.m, [&]<int kRows>() -> cudaError_t {
      return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
        static const std::string name =
            "gemm_gemv<" + std::string(dtype_name(kernels::kDTypeOf<T>)) + ", 32 columns x " + std::to_string(kRows) +
            (kTransB ? " rows, a warp per 4 columns" : " rows, 64 k-lanes") + kLayoutSuffix<kTransA, kTransB> + ">";
        return describe_kernel(kernel_ptr<T, kRows, kTransA, kTransB>(), name.c_str(), kThreads, 0, out);
      });
    });
  });
}

}  // namespace optimized::cuda
