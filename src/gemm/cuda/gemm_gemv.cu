// The decode rung: a GEMM with few rows (M = 1 .. a few, the tokens of a decode step) is a
// matrix-vector product in disguise. It is bound by reading B once (K x N elements) and nothing
// of the tensor-core rungs helps: a 64- or 128-row tile computes mostly padding, and a tile grid
// of M / 128 x N / 256 leaves most SMs without work unless K is split (with a workspace and a
// second pass). This rung streams B through CUDA cores instead, with every SM reading:
//
//   block: 32 columns of C x kRows rows (1, 2, 4 or 8: M rounded up, 8 past that), kThreads
//     threads = kThreads / 4 k-lanes x 4 column groups (512 for NN at M <= 2, else 256: StreamConfig).
//     Thread (k-lane l, group g) owns columns 8g .. 8g + 7 and the k-chunks l, l + kThreads / 4,
//     ... of 8 rows of B each: per chunk 8 loads of 16 bytes of B (a warp covers 8 rows x 64
//     contiguous bytes) and kRows of A, then 8 x 8 x kRows FMAs.
//   stream: a thread's chunks go in batches (stream_batches): the loads of up to 8 chunks in order,
//     then their FMAs in order. ptxas schedules a batch as a rolling window (checked in the SASS):
//     ~10-15 loads of 16 bytes issued at once, then one more after every ~8 FMAs, so a thread keeps
//     that many in flight until the batch's last loads, and drains only where the loop branches
//     back. At N = K = 4096, M = 1, a thread's 4 chunks are one batch: the stream drains once, at
//     its end, with 16 warps per SM and ~100 KiB of loads in flight per SM before that.
//   reduction: the 8 k-lanes of a warp by a reduce-scatter of shuffles (xor 16, 8, 4: 8 values
//     halve to one per lane, 7 shuffles a row), the warps through shared memory summed in warp
//     order: the same bits every run, no atomics.
//   grid: N / 32 blocks across, M / kRows down (a grid-stride loop past 65535), batch over z.
// B is read with 16-byte evict-first loads (ld.global.cs, as kernels::load_vec_once): each line is
// read once, and evict-first lines are the first victims of their L2 set, so the stream displaces
// little of what L2 holds. bf16 becomes fp32 in one instruction per element (a shift or a mask: its
// bits are the top half of an fp32). Any alignment: rows of A and B that are not 16-byte aligned,
// columns past N and the last K % 8 rows take element loads (the slow loop after the stream).
//
// Versions, on an H100 at 1 x 4096 x 4096 bf16 (L2 flushed, copy rate ~2975 GB/s):
//   v1 one chunk at a time: 657 GB/s.
//   v2 256 threads, batches of up to 4 chunks: 1.78 TB/s, 0.60x of the copy rate, 1.11x cuBLAS
//     (ncu: 15.6 us for 11.3 us of bytes at the copy rate). At K = 4096 each thread ran two batches
//     and the window drained between them, with all warps in step; 8 warps per SM held ~10 loads
//     each, ~40 KiB per SM, against the ~24 KiB that ~3 TB/s x ~1 us of loaded HBM latency needs on
//     each of 128 SMs: little margin when the latency grows under load. 204 instructions per chunk
//     (bf16 converted in two instructions per element), 24 shuffles a row.
//   v3 (this) 512 threads for NN at M <= 2 (twice the warps and loads in flight per SM), batches
//     sized per layout and dtype to the largest that compiles without spills (one batch per thread
//     at K = 4096 and M <= 2: no drain before the end), 170 instructions per chunk (bf16 to fp32 in
//     one), a 7-shuffle reduction, A^T's values packed two to a register. Predicted at M = 1:
//     ~12.5 us in ncu, ~15.5 us event-timed (~2.15 TB/s, ~0.73x of copy); at M = 8 ~20 us;
//     measured: (to be filled).
//
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernels
// dispatched once by the launcher, so the NN kernel is the one described above).
//   A^T (TN, TT): A is at most 8 rows of K and stays in L1/L2. Stored (K, M), the kRows values of
//     one k are contiguous (A^T's stored row k), so a chunk of 8 k is 8 vector loads of the row
//     tile (one load of kRows elements, two for 8 fp32 rows), kept packed two 16-bit values to a
//     register, when the stored rows are aligned for it, element loads otherwise (and for a row
//     tile cut by M). Each lane's loads touch 8 lines of its own, against one or two 16-byte loads
//     per row along a row-major A: measured on an H100 (bf16, N = K = 4096, warm L2, v2), TN runs
//     at NN's speed, TT at ~65% of NT at M = 8 and at NT's speed for M <= 2. B's side is unchanged;
//     the batches are smaller (more registers per chunk).
//   B^T (NT, TT): B is stored (N, K), each column of C a dot product with a contiguous stored row,
//     so reading B^T with the kernel above would walk down columns. A second kernel reads it along
//     its rows instead: the same block (256 threads, 32 columns of C, kRows rows) as 8 warps of 4
//     columns each; lane l of a warp takes the k-chunks l, l + 32, l + 64, ... of 8 elements of
//     its 4 stored rows (a warp reads 4 x 512 contiguous bytes per chunk, 16-byte loads when
//     aligned) and of the kRows rows of A, in batches as above, and the warp sums its lanes by a
//     reduce-scatter of shuffles over its 4 x kRows sums (the same bits every run, no shared
//     memory). B is still read exactly once, coalesced, and the grid is the same N / 32 blocks
//     (v2, measured as above: from 1.2x NN's speed at M = 1 to 0.8x at M = 8).
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

constexpr int kThreadsT = 256;  // the B^T kernel: 8 warps of 4 columns
constexpr int kColsPerBlock = 32;  // 4 column groups x 8
constexpr int kColsPerWarpT = 4;   // the B^T kernel: columns of C per warp
static_assert(kThreadsT / 32 * kColsPerWarpT == kColsPerBlock, "the B^T kernel's block covers the same columns");

// Per layout, dtype and kRows (StreamConfig): threads per block and blocks per SM of the kernel
// (__launch_bounds__), and chunks per batch of a thread's stream (stream_batches; a chunk: NN, 8 rows
// x 8 columns of B, 8 loads of 16 bytes, 16 for fp32; B^T, 4 stored rows x 8 k, 4 or 8 loads; plus
// A's kRows x 8 values). The batch: the largest of up to 8 chunks that compiles without spilling
// (ptxas 13.0, cuobjdump -res-usage). NN at M <= 2 takes 512 threads within 128 registers: the 128
// blocks of N = 4096 hold 16 warps per SM, ~100 KiB of loads in flight per SM, where v2's 8 warps
// held ~40 KiB (in v2 the kernels with more in flight ran faster: fp32 NN, ~80 KiB per SM, at 0.76x
// of copy against bf16's 0.60x; NT, ~64 KiB, 1.2x NN's speed with L2 warm). The alternative is
// kThreads = 256 with kMinBlocks = 2: the same 128 registers, v2's in-flight volume at N = 4096,
// and fewer lines of B waiting in L2 at once.
template <typename T, int kRows, bool kTransA, bool kTransB>
struct StreamConfig {
  static constexpr bool k16 = sizeof(T) == 2;
  static constexpr int kThreads = !kTransB && !kTransA && kRows <= 2 ? 512 : 256;
  static constexpr int kMinBlocks = 1;
  static constexpr int kBatch =
      !kTransB ? (kTransA ? (kRows <= 4 ? 2 : 1)                                          // TN
                          : (k16 ? (kRows == 1 ? 8 : (kRows <= 4 ? 4 : 2))                 // NN
                                 : (kRows <= 2 ? 4 : (kRows == 4 ? 2 : 1))))
               : (kTransA ? (k16 ? (kRows <= 2 ? 8 : (kRows == 4 ? 4 : 2)) : (kRows <= 2 ? 2 : 1))  // TT
                          : (k16 ? (kRows <= 4 ? 8 : 4) : (kRows <= 4 ? 4 : 2)));                    // NT
  static_assert(kTransB ? kThreads == kThreadsT : kThreads % 32 == 0 && kThreads >= kRows * kColsPerBlock,
                "whole warps of 8 k-lanes x 4 column groups, a thread per output of the block");
};

// ---- vectors of 8 elements -----------------------------------------------------------------------
template <typename T>
constexpr int kV = kernels::kVec16<T>;  // elements per 16 bytes
template <typename T>
using Vec16 = kernels::Vec<T, kV<T>>;

// Element e of values of T packed in 32-bit words, as float: for bf16 one shift or mask (its bits
// are the top half of an fp32), for fp16 one conversion, for fp32 none.
template <typename T>
__device__ __forceinline__ float unpack(const uint32_t* words, int e) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(words[e]);
  } else {
    const uint32_t w = words[e / 2];
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return __uint_as_float(e % 2 ? w & 0xffff0000u : w << 16);
    else
      return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 ? w >> 16 : w & 0xffffu)));
  }
}

// 8 consecutive elements of a stored row held as raw 16-byte words (one for 16-bit types, two for
// fp32: 16-bit values stay packed two to a register), converted to float when used.
template <typename T>
struct Row8 {
  static constexpr int kWords = 8 / kV<T>;
  uint4 w[kWords];
  // B: read exactly once, evict-first (ld.global.cs, as kernels::load_vec_once).
  __device__ __forceinline__ void load_once(const T* p) {
#pragma unroll
    for (int h = 0; h < kWords; ++h) w[h] = __ldcs(reinterpret_cast<const uint4*>(p) + h);
  }
  // A: read by every block, through the read-only path (cached); zeros unless `on`.
  __device__ __forceinline__ void load_cached(const T* p, bool on) {
#pragma unroll
    for (int h = 0; h < kWords; ++h) w[h] = on ? __ldg(reinterpret_cast<const uint4*>(p) + h) : make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ float operator[](int e) const {
    return unpack<T>(reinterpret_cast<const uint32_t*>(w), e);
  }
};

// 8 elements at p (cols < limit of them valid) as floats: one or two 16-byte loads when `vec`.
template <typename T>
__device__ __forceinline__ void load8(const T* p, int64_t valid, bool vec, float (&out)[8]) {
  if (vec && valid >= 8) {
#pragma unroll
    for (int h = 0; h < 8 / kV<T>; ++h) {
      const Vec16<T> v = kernels::load_vec<T, kV<T>>(p + h * kV<T>);
#pragma unroll
      for (int e = 0; e < kV<T>; ++e) out[h * kV<T> + e] = to_float(v.v[e]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = e < valid ? to_float(p[e]) : 0.0f;
  }
}

// 8 elements of A^T's row m at k .. k + 7 (stored (K, M), so `stride` = lda apart) as floats,
// zero beyond `valid`.
template <typename T>
__device__ __forceinline__ void load8_strided(const T* p, int64_t stride, int64_t valid, float (&out)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = e < valid ? to_float(p[e * stride]) : 0.0f;
}

// ---- A's values of one chunk -------------------------------------------------------------------
// A^T's vector loads: the kRows values A(row0 .. row0 + kRows - 1, k) are contiguous in A^T's
// stored row k, read kAVecT elements (at most 16 bytes) at a time.
template <typename T, int kRows>
constexpr int kAVecT = kRows < kV<T> ? kRows : kV<T>;

// A(row0 + m, k + r) for m < kRows, r < 8 (zero for the rows at and past `rows`), `a` pointing at
// A(row0, 0). Row-major A: the 8 k of each row, one or two 16-byte loads
// per row. A^T: per k, the kRows values of A^T's stored row k, packed in 32-bit words, loaded as
// vectors of kAVecT elements when kAVec (the launcher checked the alignment; the whole row tile lies
// inside M), else element by element.
template <typename T, int kRows, bool kTransA, bool kAVec>
struct AChunk {
  Row8<T> row[kRows];
  __device__ __forceinline__ void load(const T* a, int64_t lda, int64_t k, int rows) {
#pragma unroll
    for (int m = 0; m < kRows; ++m) row[m].load_cached(a + m * lda + k, m < rows);
  }
  __device__ __forceinline__ float at(int m, int r) const { return row[m][r]; }
};
template <typename T, int kRows, bool kAVec>
struct AChunk<T, kRows, true, kAVec> {
  static constexpr int kWords = (kRows * static_cast<int>(sizeof(T)) + 3) / 4;  // per k: kRows values, packed
  uint32_t w[8][kWords];
  __device__ __forceinline__ void load(const T* a, int64_t lda, int64_t k, int rows) {
    constexpr int kW = kAVecT<T, kRows>;
    constexpr int kBytes = kW * static_cast<int>(sizeof(T));  // 4, 8 or 16
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const T* row = a + (k + e) * lda;  // A^T's stored row k + e: A(row0 .., k + e)
      if constexpr (kAVec) {
#pragma unroll
        for (int m0 = 0; m0 < kRows; m0 += kW) {
          uint32_t* dst = &w[e][m0 * static_cast<int>(sizeof(T)) / 4];
          if constexpr (kBytes == 16) {
            const uint4 x = __ldg(reinterpret_cast<const uint4*>(row + m0));
            dst[0] = x.x, dst[1] = x.y, dst[2] = x.z, dst[3] = x.w;
          } else if constexpr (kBytes == 8) {
            const uint2 x = __ldg(reinterpret_cast<const uint2*>(row + m0));
            dst[0] = x.x, dst[1] = x.y;
          } else {
            dst[0] = __ldg(reinterpret_cast<const unsigned int*>(row + m0));
          }
        }
      } else if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int m = 0; m < kRows; ++m) w[e][m] = m < rows ? __ldg(reinterpret_cast<const unsigned int*>(row + m)) : 0u;
      } else {
#pragma unroll
        for (int i = 0; i < kWords; ++i) {
          using U16 = unsigned short;
          const uint32_t lo = 2 * i < rows ? __ldg(reinterpret_cast<const U16*>(row + 2 * i)) : 0u;
          const uint32_t hi =
              2 * i + 1 < kRows && 2 * i + 1 < rows ? __ldg(reinterpret_cast<const U16*>(row + 2 * i + 1)) : 0u;
          w[e][i] = lo | hi << 16;
        }
      }
    }
  }
  __device__ __forceinline__ float at(int m, int r) const { return unpack<T>(w[r], m); }
};

// One chunk of a thread's stream: kB stored rows of B (NN: 8 rows of k, 8 columns each; B^T: 4
// stored rows = columns of C, 8 k each) and A's kRows x 8 values.
template <typename T, int kB, int kRows, bool kTransA, bool kAVec>
struct Chunk {
  Row8<T> b[kB];
  AChunk<T, kRows, kTransA, kAVec> a;
};

// ---- the stream and the reduction ----------------------------------------------------------------
// One batch: the loads of chunks j .. j + kB - 1 in order (load(buffer, j) issues those of chunk j),
// then their FMAs in order (use(buffer) adds a chunk into the caller's accumulators).
template <int kB, typename Buffer, typename Load, typename Use>
__device__ __forceinline__ void stream_batch(int64_t j, Load& load, Use& use) {
  Buffer batch[kB];
#pragma unroll
  for (int u = 0; u < kB; ++u) load(batch[u], j + u);
#pragma unroll
  for (int u = 0; u < kB; ++u) use(batch[u]);
}

// The chunks j .. n - 1, fewer than 2 * kB: one batch of kB if there are that many, then the rest
// the same way with kB / 2.
template <int kB, typename Buffer, typename Load, typename Use>
__device__ __forceinline__ void stream_rest(int64_t j, int64_t n, Load& load, Use& use) {
  if (j + kB <= n) {
    stream_batch<kB, Buffer>(j, load, use);
    j += kB;
  }
  if constexpr (kB > 1) stream_rest<kB / 2, Buffer>(j, n, load, use);
}

// Streams chunks j = 0 .. n - 1 in batches of kBatch (see the header: ptxas makes each batch a
// rolling window of loads, which drains where the loop branches back). The chunks left after the
// whole batches (fewer than kBatch) go through batches of kBatch / 2, kBatch / 4, ..., 1, each at
// most once; not one batch with its loads past n predicated off, which ptxas schedules as most of
// the batch's loads at once (twice the registers).
template <int kBatch, typename Buffer, typename Load, typename Use>
__device__ __forceinline__ void stream_batches(int64_t n, Load&& load, Use&& use) {
  int64_t j = 0;
#pragma unroll 1
  for (; j + kBatch <= n; j += kBatch) stream_batch<kBatch, Buffer>(j, load, use);
  if constexpr (kBatch > 1) stream_rest<kBatch / 2, Buffer>(j, n, load, use);
}

// A reduce-scatter over the lanes of a warp: sums v[0 .. kCount) over the lanes that differ in the
// lane bits kMask, kMask / 2, ..., kLast (masks, powers of two). While more than one value is left,
// a step halves them: the lanes with the step's bit set keep the upper half and send the lower half
// to their partner, which does the opposite; once one is left, a step is a plain xor-sum. Returns
// the sum of element idx, whose bits from the top are the lane's bits of the halving steps (for 8
// values over masks 16, 8, 4: idx = (lane >> 2) & 7). A fixed order: the same bits every run.
template <int kCount, int kMask, int kLast, int kN>
__device__ __forceinline__ float warp_reduce_scatter(float (&v)[kN], int lane) {
  if constexpr (kMask < kLast) {
    return v[0];
  } else if constexpr (kCount > 1) {
    constexpr int kHalf = kCount / 2;
    const bool upper = (lane & kMask) != 0;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      const float send = upper ? v[i] : v[i + kHalf];
      const float keep = upper ? v[i + kHalf] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
    }
    return warp_reduce_scatter<kHalf, kMask / 2, kLast>(v, lane);
  } else {
    v[0] += __shfl_xor_sync(0xffffffffu, v[0], kMask);
    return warp_reduce_scatter<1, kMask / 2, kLast>(v, lane);
  }
}

// ---- NN / TN: B row-major ------------------------------------------------------------------------
// The fast path of one thread: its chunks c0, c0 + kKLanes, ... (n of them), every row, column and k
// inside the matrices and 16-byte aligned, in batches. `b` points at B(0, col0), `a` at
// A(row0, 0) (A^T: at its stored element (0, row0)).
template <typename T, int kRows, bool kTransA, bool kAVec, int kKLanes>
__device__ __forceinline__ void gemv_stream(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t c0, int64_t n,
                                            int rows, float (&acc)[kRows][8]) {
  using Ch = Chunk<T, 8, kRows, kTransA, kAVec>;  // 8 rows of B x 8 columns, A's kRows x 8 k
  const T* b_first = b + 8 * c0 * ldb;             // row 8 * c0 of the thread's 8 columns
  const int64_t b_step = int64_t(8 * kKLanes) * ldb;  // from one of the thread's chunks to the next
  stream_batches<StreamConfig<T, kRows, kTransA, false>::kBatch, Ch>(
      n,
      [&](Ch& ch, int64_t j) {
        const T* bj = b_first + j * b_step;
#pragma unroll
        for (int r = 0; r < 8; ++r) ch.b[r].load_once(bj + r * ldb);
        ch.a.load(a, lda, 8 * (c0 + j * kKLanes), rows);
      },
      [&](const Ch& ch) {
#pragma unroll
        for (int r = 0; r < 8; ++r)
#pragma unroll
          for (int m = 0; m < kRows; ++m) {
            const float av = ch.a.at(m, r);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[m][e] = fmaf(av, ch.b[r][e], acc[m][e]);
          }
      });
}

template <typename T, int kRows, bool kTransA>
__global__ void __launch_bounds__(StreamConfig<T, kRows, kTransA, false>::kThreads,
                                  StreamConfig<T, kRows, kTransA, false>::kMinBlocks)
    gemm_gemv_kernel(const GemmParams p, int64_t z_base, bool vec_a, bool vec_b) {
  constexpr int kThreads = StreamConfig<T, kRows, kTransA, false>::kThreads;
  constexpr int kWarps = kThreads / 32, kKLanes = kThreads / 4;
  __shared__ float partial[kWarps][kRows][kColsPerBlock];
  const BatchOperands<T> ops = batch_operands<T>(p, z_base + blockIdx.z);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = threadIdx.x % 4, k_lane = threadIdx.x / 4;
  const int64_t col0 = int64_t(blockIdx.x) * kColsPerBlock + 8 * group;
  const int64_t cols_valid = p.n - col0;  // may be <= 0: this thread's columns lie past N
  const int64_t chunks = (p.k + 7) / 8;
  const int64_t full_chunks = p.k / 8;  // the chunks whose 8 rows all lie inside K
  const int64_t row_tiles = (p.m + kRows - 1) / kRows;

  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const int64_t row0 = tile * kRows;
    const int rows = static_cast<int>(p.m - row0 < kRows ? p.m - row0 : kRows);
    float acc[kRows][8] = {};
    int64_t c = k_lane;
    if ((kTransA || vec_a) && vec_b && cols_valid >= 8) {
      const int64_t n = k_lane < full_chunks ? (full_chunks - 1 - k_lane) / kKLanes + 1 : 0;
      const T* b_cols = ops.b + col0;
      const T* a_rows = kTransA ? ops.a + row0 : ops.a + row0 * p.lda;
      if constexpr (kTransA && kRows > 1) {  // A^T's vector loads (a_t_vectorizable) need a whole row tile
        if (vec_a && rows == kRows)
          gemv_stream<T, kRows, kTransA, true, kKLanes>(a_rows, p.lda, b_cols, p.ldb, k_lane, n, rows, acc);
        else
          gemv_stream<T, kRows, kTransA, false, kKLanes>(a_rows, p.lda, b_cols, p.ldb, k_lane, n, rows, acc);
      } else {
        gemv_stream<T, kRows, kTransA, false, kKLanes>(a_rows, p.lda, b_cols, p.ldb, k_lane, n, rows, acc);
      }
      c += n * kKLanes;
    }
    for (; c < chunks; c += kKLanes) {  // what the stream leaves: edges, the K tail, misaligned rows
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
        if (m < rows && kTransA)
          load8_strided(ops.a + k * p.lda + row0 + m, p.lda, k_valid, a);
        else if (m < rows)
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
    // The 8 k-lanes of this warp (lane bits 2..4): lane (k-lane l, group g) ends with the warp's
    // sum of column 8g + l; then the 8 warps in order.
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      partial[warp][m][8 * group + lane / 4] = warp_reduce_scatter<8, 16, 4>(acc[m], lane);
    __syncthreads();
    if (threadIdx.x < kRows * kColsPerBlock) {
      const int m = threadIdx.x / kColsPerBlock, col = threadIdx.x % kColsPerBlock;
      const int64_t row = row0 + m, out_col = int64_t(blockIdx.x) * kColsPerBlock + col;
      if (row < p.m && out_col < p.n) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += partial[w][m][col];
        store_alpha_beta(ops.c + row * p.ldc + out_col, sum, p.alpha, p.beta);
      }
    }
    __syncthreads();  // partial[] is rewritten by the next row tile
  }
}

// ---- NT / TT: B^T, a warp per 4 columns of C, K split over its lanes -----------------------------
// The fast path of one lane: its chunks c0, c0 + 32, ... (n of them) of 8 k of the warp's 4 stored
// rows of B^T and of the kRows rows of A, every one inside the matrices and 16-byte aligned, in
// batches. `b` points at the warp's first stored row, `a` at A(row0, 0). acc[kColsPerWarpT * m + j]:
// row row0 + m, column col0 + j.
template <typename T, int kRows, bool kTransA, bool kAVec>
__device__ __forceinline__ void gemv_bt_stream(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t c0,
                                               int64_t n, int rows, float (&acc)[kRows * kColsPerWarpT]) {
  using Ch = Chunk<T, kColsPerWarpT, kRows, kTransA, kAVec>;  // 4 stored rows x 8 k, A's kRows x 8 k
  stream_batches<StreamConfig<T, kRows, kTransA, true>::kBatch, Ch>(
      n,
      [&](Ch& ch, int64_t j) {
        const int64_t k = 8 * (c0 + j * 32);
#pragma unroll
        for (int i = 0; i < kColsPerWarpT; ++i) ch.b[i].load_once(b + i * ldb + k);
        ch.a.load(a, lda, k, rows);
      },
      [&](const Ch& ch) {
#pragma unroll
        for (int m = 0; m < kRows; ++m)
#pragma unroll
          for (int i = 0; i < kColsPerWarpT; ++i)
#pragma unroll
            for (int e = 0; e < 8; ++e)
              acc[kColsPerWarpT * m + i] = fmaf(ch.a.at(m, e), ch.b[i][e], acc[kColsPerWarpT * m + i]);
      });
}

// log2 of a power of two.
constexpr int log2i(int x) { return x <= 1 ? 0 : 1 + log2i(x / 2); }

template <typename T, int kRows, bool kTransA>
__global__ void __launch_bounds__(StreamConfig<T, kRows, kTransA, true>::kThreads,
                                  StreamConfig<T, kRows, kTransA, true>::kMinBlocks)
    gemm_gemv_bt_kernel(const GemmParams p, int64_t z_base, bool vec_a, bool vec_b) {
  constexpr int kSums = kRows * kColsPerWarpT;  // 4 .. 32: a power of two
  constexpr int kSpread = 5 - log2i(kSums);     // low lane bits that hold copies of one sum
  static_assert((1 << log2i(kSums)) == kSums && kSums <= 32, "one sum per group of 2^kSpread lanes");
  const BatchOperands<T> ops = batch_operands<T>(p, z_base + blockIdx.z);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col0 = int64_t(blockIdx.x) * kColsPerBlock + warp * kColsPerWarpT;
  if (col0 >= p.n) return;  // no barrier in this kernel: a warp past N has nothing to do
  const int cols = static_cast<int>(p.n - col0 < kColsPerWarpT ? p.n - col0 : kColsPerWarpT);  // 1..4
  const T* b_rows = ops.b + col0 * p.ldb;  // the warp's stored rows of B^T: columns col0.. of B
  const int64_t chunks = (p.k + 7) / 8;
  const int64_t full_chunks = p.k / 8;
  const int64_t row_tiles = (p.m + kRows - 1) / kRows;

  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const int64_t row0 = tile * kRows;
    const int rows = static_cast<int>(p.m - row0 < kRows ? p.m - row0 : kRows);
    float acc[kSums] = {};
    int64_t c = lane;
    if ((kTransA || vec_a) && vec_b && cols == kColsPerWarpT) {
      const int64_t n = lane < full_chunks ? (full_chunks - 1 - lane) / 32 + 1 : 0;
      const T* a_rows = kTransA ? ops.a + row0 : ops.a + row0 * p.lda;
      if constexpr (kTransA && kRows > 1) {  // A^T's vector loads (a_t_vectorizable) need a whole row tile
        if (vec_a && rows == kRows)
          gemv_bt_stream<T, kRows, kTransA, true>(a_rows, p.lda, b_rows, p.ldb, lane, n, rows, acc);
        else
          gemv_bt_stream<T, kRows, kTransA, false>(a_rows, p.lda, b_rows, p.ldb, lane, n, rows, acc);
      } else {
        gemv_bt_stream<T, kRows, kTransA, false>(a_rows, p.lda, b_rows, p.ldb, lane, n, rows, acc);
      }
      c += n * 32;
    }
    for (; c < chunks; c += 32) {  // what the stream leaves: edges, the K tail, misaligned rows
      const int64_t k = 8 * c;
      const int64_t k_valid = p.k - k;
      float b[kColsPerWarpT][8];
#pragma unroll
      for (int i = 0; i < kColsPerWarpT; ++i) {
        if (i < cols)
          load8(b_rows + i * p.ldb + k, k_valid, vec_b, b[i]);
        else
#pragma unroll
          for (int e = 0; e < 8; ++e) b[i][e] = 0.0f;
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
        for (int i = 0; i < kColsPerWarpT; ++i)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[kColsPerWarpT * m + i] = fmaf(a[e], b[i][e], acc[kColsPerWarpT * m + i]);
      }
    }
    // Sum the 32 lanes: lane l ends with sum number l >> kSpread (row m = that / 4, column j = that
    // % 4); the first lane of each group of 2^kSpread writes C(row0 + m, col0 + j).
    const float sum = warp_reduce_scatter<kSums, 16, 1>(acc, lane);
    const int s = lane >> kSpread, m = s / kColsPerWarpT, j = s % kColsPerWarpT;
    if (lane % (1 << kSpread) == 0 && m < rows && j < cols)
      store_alpha_beta(ops.c + (row0 + m) * p.ldc + col0 + j, sum, p.alpha, p.beta);
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

// Whether A^T's stored rows allow the vector loads of kAVecT<T, kRows> elements (AChunk): base,
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
            constexpr int kThreads = StreamConfig<T, kRows, kTransA, kTransB>::kThreads;
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
        using Config = StreamConfig<T, kRows, kTransA, kTransB>;
        static const std::string name =
            "gemm_gemv<" + std::string(dtype_name(kernels::kDTypeOf<T>)) + ", 32 columns x " + std::to_string(kRows) +
            (kTransB ? std::string(" rows, a warp per 4 columns")
                     : " rows, " + std::to_string(Config::kThreads / 4) + " k-lanes") +
            ", batches of " + std::to_string(Config::kBatch) + " chunks" + kLayoutSuffix<kTransA, kTransB> + ">";
        return describe_kernel(kernel_ptr<T, kRows, kTransA, kTransB>(), name.c_str(), Config::kThreads, 0, out);
      });
    });
  });
}

}  // namespace optimized::cuda
