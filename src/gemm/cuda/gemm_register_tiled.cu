// GEMM rung 4 of the CUDA ladder: 2D register tiling on the CUDA cores (SIMT), 16-byte loads.
//
//   C = alpha * A @ B + beta * C      A (M, K), B (K, N), C (M, N) with leading dims; A and B
//                                     row-major or stored transposed (column-major), C row-major
//
// What this rung changes versus smem_tiled, and why:
//   - Each thread computes an 8x8 patch of C instead of one element. Per step k it reads 8
//     values of A and 8 of B from shared memory into registers and does 8 x 8 = 64 FFMAs on
//     them: 16 shared loads feed 64 FFMAs (1 load : 4 FFMA, and as 4 LDS.128 instructions
//     1 : 16), where smem_tiled needed ~1 load per FFMA. The kernel moves from "bound by shared
//     memory" to "bound by the FFMA pipe", which is where a SIMT GEMM should be.
//   - The block tile grows to 128x128 (256 threads x 64 outputs), so each element fetched from
//     global memory is used 128 times per block instead of 32: global/L2 traffic per FFMA drops
//     another 4x.
//   - The A tile is stored transposed in shared memory (As[k][m]), so a thread's 4 consecutive
//     rows of A at one k are 4 consecutive floats: one LDS.128, like B's 4 consecutive columns.
//     Rows of As are padded by 4 floats (132) so the transposing scalar stores hit 32 different
//     banks; the 16-byte reads stay aligned and conflict-free.
//   - Warp tiling: the 8 warps are laid out 2 (M) x 4 (N), each owning a 64x32 piece of the
//     block tile; inside it lane (lm, ln) = (lane / 4, lane % 4) owns rows {4lm..4lm+3,
//     32+4lm..32+4lm+3} and columns {4ln..4ln+3, 16+4ln..16+4ln+3} (2 x 2 quads of 4x4). A
//     warp's LDS.128 of A touches 8 distinct 16-byte words, of B 4, each read by several lanes
//     (broadcast): no bank conflicts (ncu: ~0 shared-load conflicts at 4096^3).
//   - Global loads are 16 bytes per thread (LDG.128: 4 floats, or 8 halves/bfloat16s) when the
//     operands allow it (base pointer, leading dimension and batch stride all multiples of 16
//     bytes; chosen at launch, a template parameter); otherwise a scalar path loads element by
//     element. Either way the edge vectors (past M, N or K) are zero-filled per element, so any
//     M, N, K >= 1 work. 16-bit inputs are converted to fp32 when stored to shared memory, so
//     the inner loop is the same for all three dtypes. BK = 8 (fp32) or 16 (16-bit) so that one
//     16-byte vector of A and one of B per thread covers a whole K-tile.
//   - Double buffering, twice: two shared-memory stages (the next K-tile's global loads are in
//     flight in registers while the FFMAs run on the current one; one __syncthreads per
//     K-tile), and two register sets of fragments (step k + 1's LDS.128s are in flight while
//     step k's 64 FFMAs run, also across the K-tile boundary). See the main loop.
//   - Register budget: __launch_bounds__(256, 2) caps the kernel at 128 registers so that two
//     blocks (16 warps) share an SM; 64 accumulators + 2 x 16 fragments + 8 prefetch registers
//     + addressing just fit, with no spills (checked with ptxas -v; 1 block/SM with up to 167
//     registers measured ~7% slower).
//
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernel
// dispatched once by the launcher, so the NN kernel is the one described above). The shared-memory
// tiles and the compute loop are the same for every layout: As[k][m] and Bs[k][n]. Only the
// global -> shared step changes, because 16-byte vectors must run along the stored contiguous
// dimension. A row-major A is loaded along K and transposed by the scalar stores described
// above; A^T is stored (K, M), so its vectors run along M and land in As[k][m] as they are, with
// float4 stores (as B's do). B^T is stored (N, K): its vectors run along K and are transposed into
// Bs[k][n] by scalar stores, like A's; Bs then gets A's row padding (132 floats) so that those
// stores spread over the banks. Per thread and K-tile it is still one vector of each operand, so
// a transposed layout costs nothing in the inner loop: the difference is in which operand pays
// the scalar transposing stores (none for TN, both for NT), a few instructions per K-tile against
// 64 FFMAs per k step. Measured on an H100 at 4096^3: 44.6 to 45.7 TFLOP/s (fp32) and 46.3 to
// 47.0 (bf16) across the four layouts, NN in between.
//
// Epilogue (GemmEpilogue; an fp32 C from 16-bit operands): each of the thread's 64 results goes
// through the epilogue functor (kernels/epilogue/fused_epilogue.cuh). Column sums: the thread adds
// its 8 rows of each of its 8 columns in row order and writes them as one row of partials (16 per
// 128-row tile: 2 warp rows x 8 lane rows), which finish_column_sums adds in order. A K past the
// per-launch slice (2^30) would need C in fp32 between slices: with an epilogue the launcher
// refuses it (cudaErrorInvalidValue) rather than applying the epilogue per slice.
//
// Not here (the next rungs): tensor cores, cp.async, more than two stages.
//
// Grid: x -> tiles of C (tiles_m * tiles_n, in groups of 8 tile rows for L2 reuse), z -> batch
// (launches of at most 65535). K is walked in slices of < 2^30 per launch (32-bit counters).
#include <cstdint>
#include <string>
#include <type_traits>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"
#include "kernels/tile/raster.cuh"

namespace optimized::cuda {
namespace {

// ---- config ----------------------------------------------------------------------------------
constexpr int kBlockM = 128;  // rows of C per block
constexpr int kBlockN = 128;  // columns of C per block
constexpr int kThreads = 256;
constexpr int kWarpsN = 4;                 // warps laid out 2 (M) x 4 (N)
constexpr int kWarpsM = kThreads / 32 / kWarpsN;
constexpr int kWarpM = kBlockM / kWarpsM;  // 64 rows of C per warp
constexpr int kWarpN = kBlockN / kWarpsN;  // 32 columns of C per warp
constexpr int kQuad = 4;                   // a thread owns 2 x 2 quads of 4 x 4
constexpr int kLanesN = kWarpN / (2 * kQuad);  // lanes laid out 8 (M) x 4 (N) in a warp
constexpr int kQuadStrideM = kWarpM / 2;   // 32: rows between a thread's two row quads
constexpr int kQuadStrideN = kWarpN / 2;   // 16: columns between its two column quads
constexpr int kThreadM = 2 * kQuad;        // 8 rows of C per thread
constexpr int kThreadN = 2 * kQuad;        // 8 columns of C per thread
constexpr int kLdA = kBlockM + 4;          // transposed A tile row: 132 floats (padding: banks)
constexpr int kLdB = kBlockN;              // B tile row: 128 floats
constexpr int kGroupM = 8;                 // tile rows per group of the block order (L2)
constexpr int64_t kMaxKPerLaunch = int64_t{1} << 30;  // the kernel counts K in an int

static_assert((kBlockM / kWarpM) * (kBlockN / kWarpN) * 32 == kThreads, "8 warps cover the tile");
static_assert((kWarpM / kThreadM) * (kWarpN / kThreadN) == 32, "32 lanes cover the warp tile");
static_assert(kWarpN / kThreadN == kLanesN, "lane layout");
static_assert(kLdA % 4 == 0 && kLdB % 4 == 0, "rows of the tiles must keep float4 alignment");

// Per dtype: a 16-byte vector holds kVec elements. A K-tile of A is (128, kBlockK) and of B
// (kBlockK, 128); each of the 256 threads moves kVecsA vectors of A and kVecsB of B per K-tile.
template <typename T>
struct Tiling {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // 4 (fp32) or 8 (fp16/bf16)
  // fp32: BK = 8, one float4 of A and one of B per thread; 16-bit: BK = 16, one vector of 8 each.
  // (BK = 16 for fp32 needs 8 more prefetch registers; with the fragment double buffer it
  // spilled at the 128-register cap and ran at 34.5 TFLOP/s against 43.5 for BK = 8, measured
  // on an earlier version of this kernel.)
  static constexpr int kBlockK = 2 * kVec;
  // The k step at which the prefetched K-tile is written to the other shared-memory stage. As
  // late as possible gives the global loads the most time (fp32: measured 45.5 TFLOP/s at
  // 4096^3 against 42.3 at step BK/2); for 16-bit the unpacking needs registers that, at the
  // last step, push ptxas into a small spill, so there it happens halfway (8 steps x 64 FFMAs
  // after the loads were issued, still ample).
  static constexpr int kStoreStep = sizeof(T) == 4 ? kBlockK - 1 : kBlockK / 2;
  static constexpr int kVecsPerRowA = kBlockK / kVec;             // vectors across a row of A tile
  static constexpr int kVecsPerRowB = kBlockN / kVec;             // vectors across a row of B tile
  static constexpr int kVecsA = kBlockM * kVecsPerRowA / kThreads;  // per thread per K-tile
  static constexpr int kVecsB = kBlockK * kVecsPerRowB / kThreads;
  static constexpr int kRowStepA = kThreads / kVecsPerRowA;  // rows between a thread's A vectors
  static constexpr int kRowStepB = kThreads / kVecsPerRowB;  // rows between its B vectors
  static_assert(kBlockK % kVec == 0 && kVecsA >= 1 && kVecsB >= 1 &&
                    kVecsA * kThreads == kBlockM * kVecsPerRowA &&
                    kVecsB * kThreads == kBlockK * kVecsPerRowB,
                "every thread moves the same whole number of vectors");
  // The transposed layouts: A^T's K-tile is stored (kBlockK, 128), vectors along M; B^T's is
  // stored (128, kBlockK), vectors along K.
  static constexpr int kVecsPerRowAT = kBlockM / kVec;
  static constexpr int kVecsPerRowBT = kBlockK / kVec;
  static constexpr int kVecsAT = kBlockK * kVecsPerRowAT / kThreads;
  static constexpr int kVecsBT = kBlockN * kVecsPerRowBT / kThreads;
  static constexpr int kRowStepAT = kThreads / kVecsPerRowAT;
  static constexpr int kRowStepBT = kThreads / kVecsPerRowBT;
  static_assert(kVecsAT >= 1 && kVecsBT >= 1 && kVecsAT * kThreads == kBlockK * kVecsPerRowAT &&
                    kVecsBT * kThreads == kBlockN * kVecsPerRowBT,
                "every thread moves the same whole number of vectors (transposed layouts)");
};

// ---- element bits <-> float ------------------------------------------------------------------
// The register double buffer holds raw 16-byte vectors (4 registers), converted when staged.
template <typename T> __device__ __forceinline__ uint32_t to_bits(T x);
template <> __device__ __forceinline__ uint32_t to_bits<float>(float x) { return __float_as_uint(x); }
template <> __device__ __forceinline__ uint32_t to_bits<__half>(__half x) { return __half_as_ushort(x); }
template <> __device__ __forceinline__ uint32_t to_bits<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}

template <typename T> __device__ __forceinline__ float from_bits(uint32_t w);  // low bits
template <> __device__ __forceinline__ float from_bits<float>(uint32_t w) { return __uint_as_float(w); }
template <> __device__ __forceinline__ float from_bits<__half>(uint32_t w) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
}
template <> __device__ __forceinline__ float from_bits<__nv_bfloat16>(uint32_t w) {
  return __uint_as_float(w << 16);  // bf16 is the top half of an fp32
}

// Element i (little-endian order) of a 16-byte vector of T, as float. i is a compile-time
// constant after unrolling, so this is register selection, not indexing.
template <typename T>
__device__ __forceinline__ float vec_elem(const uint4& v, int i) {
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));  // 1 or 2
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  return from_bits<T>(words[i / kPerWord] >> (16 * (i % kPerWord)));
}

// kVec consecutive elements starting at `src`, as one raw 16-byte vector. `row_ok` false: the
// row lies outside the matrix; `valid` < kVec: only the first `valid` elements lie inside (the
// right edge of the row). Elements outside read as 0 (bit pattern 0 is +0.0 in every dtype), so
// edge tiles contribute nothing. kVecLoads: the launcher checked that every row start is 16-byte
// aligned, so a full vector is one LDG.128; edge vectors, and all vectors on the scalar path,
// are loaded element by element.
template <typename T, bool kVecLoads>
__device__ __forceinline__ uint4 load_vec(const T* __restrict__ src, bool row_ok, int64_t valid) {
  constexpr int kVec = Tiling<T>::kVec;
  constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
  if (!row_ok) return make_uint4(0u, 0u, 0u, 0u);
  if (kVecLoads && valid >= kVec) return __ldg(reinterpret_cast<const uint4*>(src));
  uint32_t words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < kVec; ++i)
    if (i < valid) words[i / kPerWord] |= to_bits<T>(src[i]) << (16 * (i % kPerWord));
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// ---- the kernel ------------------------------------------------------------------------------
// grid: (tiles_m * tiles_n, 1, batches in this launch); block: kThreads.
// Rows of column-sum partials per 128-row tile: one per (warp row, lane row) of the thread grid.
constexpr int kPartialRowsPerTile = kWarpsM * (kWarpM / kThreadM);

template <typename T, typename TC, bool kTransA, bool kTransB, bool kVecLoads>
__global__ void __launch_bounds__(kThreads, 2)  // <= 128 registers: 2 blocks (16 warps) per SM
    gemm_register_tiled_kernel(GemmParams p, int64_t batch_offset, uint32_t tiles_m, uint32_t tiles_n,
                               GemmEpilogueOp<TC> epi, float* partials) {
  constexpr int kVec = Tiling<T>::kVec;
  constexpr int kBlockK = Tiling<T>::kBlockK;
  // Per operand: vectors across a stored row of its K-tile, vectors per thread, and stored rows
  // between a thread's vectors (the stored rows are M or K for A, K or N for B; see Tiling).
  constexpr int kVecsPerRowA = kTransA ? Tiling<T>::kVecsPerRowAT : Tiling<T>::kVecsPerRowA;
  constexpr int kVecsPerRowB = kTransB ? Tiling<T>::kVecsPerRowBT : Tiling<T>::kVecsPerRowB;
  constexpr int kVecsA = kTransA ? Tiling<T>::kVecsAT : Tiling<T>::kVecsA;
  constexpr int kVecsB = kTransB ? Tiling<T>::kVecsBT : Tiling<T>::kVecsB;
  constexpr int kRowStepA = kTransA ? Tiling<T>::kRowStepAT : Tiling<T>::kRowStepA;
  constexpr int kRowStepB = kTransB ? Tiling<T>::kRowStepBT : Tiling<T>::kRowStepB;
  // B^T is transposed into Bs by scalar stores, so its rows get A's padding (banks).
  constexpr int kLdBs = kTransB ? kLdA : kLdB;
  // Two stages; fp32: 2 x (8 x 132 + 8 x 128) x 4 B = 16.3 KiB, 16-bit: 32.5 KiB (B^T: 16.5 and
  // 33 KiB).
  __shared__ __align__(16) float As[2][kBlockK][kLdA];   // As[s][k][m] = A(m0 + m, k0 + k)
  __shared__ __align__(16) float Bs[2][kBlockK][kLdBs];  // Bs[s][k][n] = B(k0 + k, n0 + n)

  const BatchOperands<T> ops = batch_operands<T>(p, batch_offset + blockIdx.z);
  const int tid = threadIdx.x;

  // Block -> tile of C, in groups of kGroupM tile rows: consecutive blocks walk down a group's
  // column of tiles before moving right, so the blocks running at the same time share A row
  // panels and B column panels in L2 (kernels/tile/raster.cuh).
  const kernels::TileCoord<uint32_t> tile =
      kernels::grouped_tile<uint32_t>(blockIdx.x, tiles_m, tiles_n, static_cast<uint32_t>(kGroupM));
  const int64_t m0 = static_cast<int64_t>(tile.m) * kBlockM;
  const int64_t n0 = static_cast<int64_t>(tile.n) * kBlockN;
  const int rows_left = static_cast<int>(min(p.m - m0, static_cast<int64_t>(kBlockM)));  // 1..128
  const int cols_left = static_cast<int>(min(p.n - n0, static_cast<int64_t>(kBlockN)));  // 1..128

  // Which vectors of each K-tile this thread moves from global to shared memory: stored rows
  // a_row + i * kRowStepA of A's tile, elements [a_col, a_col + kVec) along them; stored rows
  // b_row + i * kRowStepB of B's, elements [b_col, b_col + kVec). Stored rows are M and the
  // vectors run along K for A, the other way round for A^T; for B stored rows are K (N for B^T).
  const int a_row = tid / kVecsPerRowA;
  const int a_col = tid % kVecsPerRowA * kVec;
  const int b_row = tid / kVecsPerRowB;
  const int b_col = tid % kVecsPerRowB * kVec;
  const int b_valid = cols_left - b_col;  // columns of the B vectors inside the matrix
  const int a_valid = rows_left - a_col;  // A^T: rows of A of its vectors inside the matrix
  // int64 offsets; dereferenced only for rows inside the matrix.
  const T* a_src = kTransA ? ops.a + static_cast<int64_t>(a_row) * p.lda + m0 + a_col
                           : ops.a + (m0 + a_row) * p.lda + a_col;
  const T* b_src = kTransB ? ops.b + (n0 + b_row) * p.ldb + b_col
                           : ops.b + static_cast<int64_t>(b_row) * p.ldb + n0 + b_col;
  int k_left = static_cast<int>(p.k);  // K - k0 of the K-tile to load next (launcher: K < 2^30)

  // Which 8x8 patch of the block tile this thread computes (see the header).
  const int warp = tid / 32, lane = tid % 32;
  const int tm = warp / kWarpsN * kWarpM + lane / kLanesN * kQuad;  // first row (of 2 quads)
  const int tn = warp % kWarpsN * kWarpN + lane % kLanesN * kQuad;  // first column

  uint4 a_next[kVecsA], b_next[kVecsB];  // the next K-tile's vectors, in flight during the math
  // A vector is inside the matrix when its stored row is (row_ok) and for its first `valid`
  // elements: for A, rows of A and the K left; for A^T, K rows and the rows of A left; for B
  // (B^T) the same with columns of B.
  auto load_tile = [&]() {
#pragma unroll
    for (int i = 0; i < kVecsA; ++i) {
      if constexpr (kTransA)
        a_next[i] = load_vec<T, kVecLoads>(a_src + i * kRowStepA * p.lda, a_row + i * kRowStepA < k_left, a_valid);
      else
        a_next[i] = load_vec<T, kVecLoads>(a_src + i * kRowStepA * p.lda,
                                           a_row + i * kRowStepA < rows_left, k_left - a_col);
    }
#pragma unroll
    for (int i = 0; i < kVecsB; ++i) {
      if constexpr (kTransB)
        b_next[i] = load_vec<T, kVecLoads>(b_src + i * kRowStepB * p.ldb, b_row + i * kRowStepB < cols_left,
                                           k_left - b_col);
      else
        b_next[i] = load_vec<T, kVecLoads>(b_src + i * kRowStepB * p.ldb,
                                           b_row + i * kRowStepB < k_left, b_valid);
    }
    a_src += kTransA ? kBlockK * p.lda : kBlockK;
    b_src += kTransB ? kBlockK : kBlockK * p.ldb;
    k_left -= kBlockK;
  };
  // Vectors along K (A, B^T) are transposed into the tile element by element; vectors along M or
  // N (A^T, B) are already rows of it and go as float4s.
  auto store_tile = [&](int s) {
#pragma unroll
    for (int i = 0; i < kVecsA; ++i) {
      if constexpr (kTransA) {
#pragma unroll
        for (int e = 0; e < kVec; e += 4)
          *reinterpret_cast<float4*>(&As[s][a_row + i * kRowStepA][a_col + e]) =
              make_float4(vec_elem<T>(a_next[i], e), vec_elem<T>(a_next[i], e + 1),
                          vec_elem<T>(a_next[i], e + 2), vec_elem<T>(a_next[i], e + 3));
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) As[s][a_col + e][a_row + i * kRowStepA] = vec_elem<T>(a_next[i], e);
      }
    }
#pragma unroll
    for (int i = 0; i < kVecsB; ++i) {
      if constexpr (kTransB) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) Bs[s][b_col + e][b_row + i * kRowStepB] = vec_elem<T>(b_next[i], e);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; e += 4)
          *reinterpret_cast<float4*>(&Bs[s][b_row + i * kRowStepB][b_col + e]) =
              make_float4(vec_elem<T>(b_next[i], e), vec_elem<T>(b_next[i], e + 1),
                          vec_elem<T>(b_next[i], e + 2), vec_elem<T>(b_next[i], e + 3));
      }
    }
  };

  float acc[kThreadM][kThreadN];
#pragma unroll
  for (int i = 0; i < kThreadM; ++i)
#pragma unroll
    for (int j = 0; j < kThreadN; ++j) acc[i][j] = 0.0f;

  // ---- main loop ---------------------------------------------------------------------------
  // Two pipelines overlap with the FFMAs. Global -> shared: the next K-tile's vectors are loaded
  // into registers at the top of an iteration and stored to the other stage just before its
  // last k step; then one __syncthreads per K-tile. Shared -> registers: the fragments of step
  // k + 1 (4 LDS.128) are loaded while the 64 FFMAs of step k run (frag[2] double buffer),
  // including across the K-tile boundary: step 0 of the next tile is read right after the
  // barrier, before the last step's FFMAs, so no warp waits on shared-memory latency there.
  //
  // Why the store to stage s ^ 1 is safe: its last reads (steps 1..BK-1 of the previous tile)
  // all come before the previous iteration's barrier, which every thread has passed. Why the
  // reads of stage s are safe: its stores came before that same barrier.
  constexpr int kStoreStep = Tiling<T>::kStoreStep;
  float4 frag[2][4];  // [buffer][a_lo, a_hi, b_lo, b_hi]
  auto load_frags = [&](int buf, int s, int k) {
    frag[buf][0] = *reinterpret_cast<const float4*>(&As[s][k][tm]);
    frag[buf][1] = *reinterpret_cast<const float4*>(&As[s][k][tm + kQuadStrideM]);
    frag[buf][2] = *reinterpret_cast<const float4*>(&Bs[s][k][tn]);
    frag[buf][3] = *reinterpret_cast<const float4*>(&Bs[s][k][tn + kQuadStrideN]);
  };
  load_tile();
  store_tile(0);
  __syncthreads();
  load_frags(0, 0, 0);
  for (int s = 0;; s ^= 1) {
    const bool has_next = k_left > 0;
    if (has_next) load_tile();
#pragma unroll
    for (int k = 0; k < kBlockK; ++k) {
      if (k == kStoreStep && has_next) store_tile(s ^ 1);
      if (k < kBlockK - 1) {
        load_frags((k + 1) & 1, s, k + 1);
      } else if (has_next) {
        __syncthreads();
        load_frags((k + 1) & 1, s ^ 1, 0);
      }
      const float4* f = frag[k & 1];
      const float a[kThreadM] = {f[0].x, f[0].y, f[0].z, f[0].w, f[1].x, f[1].y, f[1].z, f[1].w};
      const float b[kThreadN] = {f[2].x, f[2].y, f[2].z, f[2].w, f[3].x, f[3].y, f[3].z, f[3].w};
#pragma unroll
      for (int i = 0; i < kThreadM; ++i)
#pragma unroll
        for (int j = 0; j < kThreadN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    if (!has_next) break;
  }

  // ---- epilogue, guarded at the M and N edges ----------------------------------------------
  const int64_t z = batch_offset + blockIdx.z;
#pragma unroll
  for (int i = 0; i < kThreadM; ++i) {
    const int r = tm + i / kQuad * kQuadStrideM + i % kQuad;
#pragma unroll
    for (int j = 0; j < kThreadN; ++j) {
      const int c = tn + j / kQuad * kQuadStrideN + j % kQuad;
      // The result replaces the accumulator (0 outside C), for the column sums.
      acc[i][j] = r < rows_left && c < cols_left ? epi.store(z, m0 + r, n0 + c, acc[i][j]) : 0.0f;
    }
  }
  if (partials) {
    // This thread's row of partials: (warp row, lane row) of the thread grid.
    const int64_t prow = int64_t(tile.m) * kPartialRowsPerTile + tm / kWarpM * (kWarpM / kThreadM) + tm % kWarpM / kQuad;
    float* out = partials + (z * tiles_m * kPartialRowsPerTile + prow) * p.n + n0;
#pragma unroll
    for (int j = 0; j < kThreadN; ++j) {
      const int c = tn + j / kQuad * kQuadStrideN + j % kQuad;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kThreadM; ++i) sum += acc[i][j];
      if (c < cols_left) out[c] = sum;
    }
  }
}

// A 16-byte load is allowed for an operand when every stored row of every batch starts on a
// 16-byte boundary (gemm_common.cuh): the vectors then run along the stored rows.
bool use_vector_loads(const GemmParams& p) { return a_rows_aligned16(p) && b_rows_aligned16(p); }

template <typename T, typename TC, bool kTransA, bool kTransB, bool kVecLoads>
const char* kernel_name() {
  static const std::string name = std::string("register_tiled<") + dtype_label<T>() +
                                  (std::is_same_v<T, TC> ? "" : ", fp32 out") + ", 128x128x" +
                                  std::to_string(Tiling<T>::kBlockK) + ", 8x8, warp 64x32, " +
                                  (kVecLoads ? "vec16" : "scalar") + kLayoutSuffix<kTransA, kTransB> + ">";
  return name.c_str();
}

template <typename T, typename TC, bool kTransA, bool kTransB, bool kVecLoads>
cudaError_t launch(const GemmParams& p, float* partials, cudaStream_t stream) {
  const int64_t tiles_m = ceil_div(p.m, kBlockM);
  const int64_t tiles_n = ceil_div(p.n, kBlockN);
  // grid.x limit; also keeps the tile arithmetic in the kernel within 32 bits
  if (tiles_m * tiles_n + kGroupM * tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;
  if (p.needs_epilogue_rung() && p.k > kMaxKPerLaunch) return cudaErrorInvalidValue;  // see the header
  const GemmEpilogueOp<TC> epi = make_gemm_epilogue<TC>(p);
  // The kernel counts K in 32 bits. A K of 2^30 or more (rows of A over 2 GiB) runs as several
  // launches over K slices, the later ones accumulating into C (beta = 1); C is then rounded to
  // T between slices.
  for (int64_t k0 = 0; k0 < p.k; k0 += kMaxKPerLaunch) {
    GemmParams q = p;
    q.k = p.k - k0 < kMaxKPerLaunch ? p.k - k0 : kMaxKPerLaunch;
    q.a = static_cast<const T*>(p.a) + p.a_index(0, k0);
    q.b = static_cast<const T*>(p.b) + p.b_index(k0, 0);
    GemmEpilogueOp<TC> slice_epi = epi;
    if (k0 > 0) q.beta = slice_epi.beta = 1.0f;
    if (cudaError_t e = launch_batch_chunks(p.batch, [&](int64_t first, unsigned count) {
          const dim3 grid(static_cast<unsigned>(tiles_m * tiles_n), 1, count);
          gemm_register_tiled_kernel<T, TC, kTransA, kTransB, kVecLoads><<<grid, kThreads, 0, stream>>>(
              q, first, static_cast<uint32_t>(tiles_m), static_cast<uint32_t>(tiles_n), slice_epi, partials);
        });
        e != cudaSuccess)
      return e;
  }
  return partials ? finish_column_sums(p, partials, tiles_m * kPartialRowsPerTile, stream) : cudaSuccess;
}

size_t partial_bytes(const GemmParams& p) { return column_sum_bytes(p, ceil_div(p.m, kBlockM) * kPartialRowsPerTile); }

}  // namespace

// ---- launcher --------------------------------------------------------------------------------
cudaError_t gemm_register_tiled(const GemmParams& p, const Workspace& workspace, cudaStream_t stream) {
  const bool vec = use_vector_loads(p);
  float* partials = nullptr;
  if (p.epi.column_sums) {
    if (workspace.data == nullptr || workspace.bytes < partial_bytes(p)) return cudaErrorInvalidValue;
    partials = static_cast<float*>(workspace.data);
  }
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_c_dtype<T>(p, [&]<typename TC>() -> cudaError_t {
      return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
        return vec ? launch<T, TC, kTransA, kTransB, true>(p, partials, stream)
                   : launch<T, TC, kTransA, kTransB, false>(p, partials, stream);
      });
    });
  });
}

cudaError_t gemm_register_tiled_workspace(const GemmParams& p, size_t* bytes) {
  *bytes = partial_bytes(p);
  return cudaSuccess;
}

cudaError_t gemm_register_tiled_resources(const GemmParams& p, KernelResources* out) {
  const bool vec = use_vector_loads(p);
  return dispatch_float_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_c_dtype<T>(p, [&]<typename TC>() -> cudaError_t {
      return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
        const void* kernel =
            vec ? reinterpret_cast<const void*>(&gemm_register_tiled_kernel<T, TC, kTransA, kTransB, true>)
                : reinterpret_cast<const void*>(&gemm_register_tiled_kernel<T, TC, kTransA, kTransB, false>);
        const char* name =
            vec ? kernel_name<T, TC, kTransA, kTransB, true>() : kernel_name<T, TC, kTransA, kTransB, false>();
        return describe_kernel(kernel, name, kThreads, /*dynamic_smem_bytes=*/0, out);
      });
    });
  });
}

}  // namespace optimized::cuda
