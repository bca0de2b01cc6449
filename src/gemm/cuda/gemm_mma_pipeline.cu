// Top rung of the pre-Hopper tensor-core ladder: mma.sync.m16n8k16 (fp32 accumulate) fed by
// ldmatrix from an XOR-swizzled, multi-stage shared-memory ring that cp.async fills.
//
//   block tile 128x256x64, 8 warps as 2 (M) x 4 (N), warp tile 64x64 = 4 x 8 mma tiles,
//   128 fp32 accumulators per thread, 4-stage cp.async ring (192 KiB of dynamic smem),
//   grouped (GROUP_M) rasterization of the tile grid for L2 reuse, epilogue staged through
//   shared memory as fp32 so that C is read and written in full, coalesced rows.
//
// This file composes the kernel from the ground floor (src/kernels), the way linear, MoE and
// attention compose theirs:
//   scheduler  kernels/sched/grouped_tiles.cuh     which tile (grouped rasterization), which batch
//   mainloop   kernels/gemm/mma_sync_mainloop.cuh  the tile's A @ B in fp32 accumulators: the
//              swizzled cp.async ring, ldmatrix, mma.sync (its header has the layouts)
//   epilogue   kernels/epilogue/staged_tile.cuh + fused_epilogue.cuh   C = alpha * acc + beta * C, or
//              the GEMM epilogue (bias, activation, aux, residual, fp32 C, column sums per 32 rows)
// The tile shape and the group height are tuning: src/gemm/gemm_config.h says why these won.
//
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernel
// dispatched once by the launcher). NN runs the ground floor's mainloop unchanged. The others
// run the same pipeline (ring, stages, copy schedule, fragment double buffer, mma order, defined
// below in this file) with each operand's tile kept in shared memory as it is stored: cp.async
// copies 16-byte chunks along the stored contiguous dimension, as for NN, so a transposed
// operand is read from global memory in full coalesced lines too:
//   A^T: [kBK rows (k)][kBM m]  = 256 B per row;  B^T: [kBN rows (n)][kBK k] = 128 B per row;
// both XOR-swizzled like the NN tiles (chunk' = chunk ^ (row & 7), inside 128-byte lines). The
// mma wants the same fragments whatever the storage, and ldmatrix makes them: A^T's 8x8
// matrices are (k, m) in shared memory, so ldmatrix .trans delivers the (m, k) fragment the
// row-major A operand needs; B^T's are (n, k), which is the "col" B operand as it stands, so B^T
// takes a plain ldmatrix where NN's B takes .trans. Same number of ldmatrix.x4, cp.async and
// mma per k-tile as NN, and every ldmatrix phase and cp.async group still hits 8 distinct
// 16-byte bank groups; only the address arithmetic differs (240 to 254 registers, no spills;
// NN 244 and 254). Measured on an H100 (bf16, 4096^3): NN 470 TFLOP/s, NT 485, TN 469, TT 473;
// at 4097x4095x4093 (the unaligned kernel) 151, 165, 143 and 146.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/gemm_config.h"
#include "gemm/launchers.h"
#include "kernels/epilogue/staged_tile.cuh"
#include "kernels/gemm/mma_sync_mainloop.cuh"
#include "kernels/sched/grouped_tiles.cuh"

namespace optimized::cuda {
namespace {

// ---- config (src/gemm/gemm_config.h) ----------------------------------------------------------
constexpr GemmMmaPipelineConfig kConfig = kGemmMmaPipelineConfig;
using Tile = kernels::MmaSyncTile<kConfig.block_m, kConfig.block_n, kConfig.block_k, kConfig.stages,
                                  kConfig.warps_m, kConfig.warps_n>;
using Scheduler = kernels::GroupedTileScheduler<kConfig.group_m>;
using Staging = kernels::StagedTile<Tile>;
// The mainloop's ring and the epilogue's fp32 staging share the dynamic shared memory.
constexpr int kSmemBytes = Tile::kSmemBytes > Staging::kBytes ? Tile::kSmemBytes : Staging::kBytes;
static_assert(kSmemBytes <= 227 * 1024, "dynamic shared memory of one block (sm_90 opt-in limit)");

// ---- the transposed layouts' mainloop ----------------------------------------------------------
// One operand's tile in shared memory, as stored in global memory: kRows stored rows of kCols
// 16-bit elements (rows of 128, 256 or 512 bytes), 16-byte chunks XOR-swizzled. kIsA picks the
// operand (A at the start of a stage, B after it), kTrans its layout:
//   A (kBM, kBK), A^T (kBK, kBM), B (kBK, kBN), B^T (kBN, kBK)   [stored rows, elements per row]
// K runs along the stored rows for A and B^T (kKAlongRows) and down them for A^T and B.
// Thread t owns the chunks (row t / kChunksPerRow + i * kRowStride, chunk t % kChunksPerRow),
// i < kChunksPerThread: consecutive threads fill one stored row, so a warp's copies read whole
// 128-byte lines of global memory.
template <typename T, bool kAligned, bool kIsA, bool kTrans>
struct StoredTileLoader {
  using C = Tile;
  static constexpr int kRows = kIsA ? (kTrans ? C::kBK : C::kBM) : (kTrans ? C::kBN : C::kBK);
  static constexpr int kCols = kIsA ? (kTrans ? C::kBM : C::kBK) : (kTrans ? C::kBK : C::kBN);
  static constexpr bool kKAlongRows = kIsA != kTrans;  // A, B^T: K along the stored rows
  static constexpr int kRowBytes = kCols * 2;
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kRowStride = C::kThreads / kChunksPerRow;  // rows between a thread's chunks
  static constexpr int kChunksPerThread = kRows * kChunksPerRow / C::kThreads;
  static constexpr uint32_t kTileOffset = kIsA ? 0 : C::kATileBytes;  // in a stage
  static_assert(kRowBytes % 128 == 0, "the swizzle permutes chunks inside 128-byte lines");
  static_assert(C::kThreads % kChunksPerRow == 0 && kChunksPerThread * kRowStride == kRows,
                "every thread copies the same number of chunks, whole rows per pass");
  static_assert(kRowStride % 8 == 0, "a thread's rows share the swizzle key (row & 7)");
  static_assert(kRows * kRowBytes == (kIsA ? C::kATileBytes : C::kBTileBytes), "the stage's layout");

  const char* cur;  // byte address of this thread's chunk 0 in the next k-tile (fast path)
  uint32_t step;    // bytes between this thread's chunks

  static __device__ __forceinline__ int64_t ld(const GemmParams& p) { return kIsA ? p.lda : p.ldb; }
  static __device__ __forceinline__ int64_t extent(const GemmParams& p) { return kIsA ? p.m : p.n; }  // M or N

  // mn0: the block's first row of A (m0) or column of B (n0).
  __device__ __forceinline__ void init(const GemmParams& p, const T* src, int64_t mn0, int tid) {
    const int row = unsigned(tid) / kChunksPerRow, chunk = unsigned(tid) % kChunksPerRow;
    step = static_cast<uint32_t>(kRowStride * ld(p) * 2);
    cur = reinterpret_cast<const char*>(kKAlongRows ? src + (mn0 + row) * ld(p) + chunk * 8
                                                    : src + int64_t(row) * ld(p) + mn0 + chunk * 8);
  }

  // Chunks [i0, i1) of k-tile kt into the stage at stage_addr / stage_ptr; the last part
  // advances to the next k-tile. fast: the whole tile lies inside the operand and kAligned.
  template <int i0, int i1>
  __device__ __forceinline__ void load(const GemmParams& p, const T* src, int64_t mn0, int kt, int tid, bool fast,
                                       uint32_t stage_addr, unsigned char* stage_ptr) {
    const int row = unsigned(tid) / kChunksPerRow, chunk = unsigned(tid) % kChunksPerRow;
    const uint32_t dst = kTileOffset + kernels::swizzled_offset<kRowBytes>(row, chunk);
    if (kAligned && fast) {
#pragma unroll
      for (int i = i0; i < i1; ++i)
        kernels::ptx::cp_async_16(stage_addr + dst + i * kRowStride * kRowBytes, cur + uint64_t(step) * i);
    } else {
      // Stored row gr, elements [gc, gc + 8) of it; zeros outside the operand.
      const int64_t k0 = int64_t(kt) * C::kBK;
      const int64_t gc = kKAlongRows ? k0 + chunk * 8 : mn0 + chunk * 8;
      const int64_t cols = kKAlongRows ? p.k : extent(p);
      const int64_t rows = kKAlongRows ? extent(p) : p.k;
      const int cvalid = gc < cols ? static_cast<int>(cols - gc < 8 ? cols - gc : 8) : 0;
#pragma unroll
      for (int i = i0; i < i1; ++i) {
        const int64_t gr = (kKAlongRows ? mn0 : k0) + row + i * kRowStride;
        const int valid = gr < rows ? cvalid : 0;
        kernels::MmaSyncTileLoader<T, Tile, kAligned>::copy_chunk(
            stage_addr, stage_ptr, dst + i * kRowStride * kRowBytes, valid > 0 ? src + gr * ld(p) + gc : src, valid);
      }
    }
    if (i1 == kChunksPerThread) cur += kKAlongRows ? int64_t(C::kBK) * 2 : int64_t(C::kBK) * ld(p) * 2;
  }
};

// acc (zeroed here) = the block's tile of A @ B for the layouts kTransA, kTransB (not both
// false: NN is kernels::mma_sync_mainloop). The same pipeline as that one, step for step; what
// differs is the operands' loaders (above) and the ldmatrix addressing of the fragments.
template <typename T, bool kAligned, bool kTransA, bool kTransB>
__device__ __forceinline__ void layout_mainloop(float (&acc)[Tile::kMT][Tile::kNT][4], const GemmParams& p,
                                                bool fast_ok, const T* a, const T* b, int64_t m0, int64_t n0,
                                                unsigned char* smem) {
  using C = Tile;
  using LoaderA = StoredTileLoader<T, kAligned, true, kTransA>;
  using LoaderB = StoredTileLoader<T, kAligned, false, kTransB>;
  const uint32_t smem_base = kernels::ptx::smem_u32(smem);
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / C::kWarpsN;
  const int wn = warp % C::kWarpsN;
  const int ktiles = static_cast<int>((p.k + C::kBK - 1) / C::kBK);
  // k-tiles [0, fast_tiles) take the fast path (whole tiles inside M, N and K; kAligned).
  const bool inside = m0 + C::kBM <= p.m && n0 + C::kBN <= p.n;
  const int fast_tiles = kAligned && fast_ok && inside ? static_cast<int>(p.k / C::kBK) : 0;

  LoaderA la;
  LoaderB lb;
  la.init(p, a, m0, tid);
  lb.init(p, b, n0, tid);

#pragma unroll
  for (int i = 0; i < C::kMT; ++i)
#pragma unroll
    for (int j = 0; j < C::kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // Per-lane ldmatrix addresses. Every matrix reads 8 consecutive stored rows whose first row is
  // a multiple of 8, so lane & 7 is the swizzle key of the row the lane addresses, and a
  // logical chunk 2s + h (s from the loop, h from the lane) sits at physical chunk 2s ^ (h ^ key).
  //   A (kBM, kBK): lane l -> m row l % 16, k chunk 2 ks + l / 16 (ldmatrix: a0 a1 a2 a3).
  //   A^T (kBK, kBM): lane l -> k row 16 ks + 8 (l / 16) + l % 8, m chunk kWM / 8 wm + 2 mi + (l / 8) % 2
  //     (ldmatrix .trans: matrix (k 0-7, m 0-7) -> a0, (k 0-7, m 8-15) -> a1, (k 8-15, m 0-7) ->
  //     a2, (k 8-15, m 8-15) -> a3, each transposed into the (m, k) fragment).
  //   B (kBK, kBN): lane l -> k row l % 16, n chunk kWN / 8 wn + 2 q + l / 16 (ldmatrix .trans: b0, b1
  //     of n-tile 2q, then of 2q + 1).
  //   B^T (kBN, kBK): lane l -> n row kWN wn + 16 q + 8 (l / 16) + l % 8, k chunk 2 ks + (l / 8) % 2
  //     (plain ldmatrix: (n 0-7, k 0-7) is b0 of n-tile 2q, (n 0-7, k 8-15) its b1, then 2q + 1).
  constexpr int kRowBytesA = LoaderA::kRowBytes, kRowBytesB = LoaderB::kRowBytes;
  const int key = lane & 7;
  const int a_xor = (kTransA ? (lane >> 3) & 1 : lane >> 4) ^ key;
  const int b_xor = (kTransB ? (lane >> 3) & 1 : lane >> 4) ^ key;
  const uint32_t a_lane = kTransA ? ((lane >> 4) * 8 + key) * kRowBytesA + wm * (C::kWM / 8) * 16
                                  : (wm * C::kWM + (lane & 15)) * kRowBytesA;
  const uint32_t b_lane = C::kATileBytes + (kTransB ? (wn * C::kWN + (lane >> 4) * 8 + key) * kRowBytesB
                                                    : (lane & 15) * kRowBytesB + wn * (C::kWN / 8) * 16);
  static_assert(C::kMT * 2 <= 8 && C::kNT <= 8 && C::kKSteps * 2 <= 8 && C::kWM % 64 == 0 && C::kWN % 64 == 0,
                "a warp's fragments start on a 128-byte line (8 chunks) and their chunks 2s + h stay in it");

  // Prologue: tiles 0 .. kStages-2. Every step commits a group (empty ones too) so that
  // wait_group<kStages-2> always means "the next tile to be read has landed".
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < ktiles) {
      const uint32_t off = s * C::kStageBytes;
      la.template load<0, LoaderA::kChunksPerThread>(p, a, m0, s, tid, s < fast_tiles, smem_base + off, smem + off);
      lb.template load<0, LoaderB::kChunksPerThread>(p, b, n0, s, tid, s < fast_tiles, smem_base + off, smem + off);
    }
    kernels::ptx::cp_async_commit();
  }
  kernels::ptx::cp_async_wait<C::kStages - 2>();
  __syncthreads();

  uint32_t af[2][C::kMT][4];
  uint32_t bf[2][C::kNT][2];
  auto load_frags = [&](int buf, uint32_t stage_addr, int ks) {
#pragma unroll
    for (int mi = 0; mi < C::kMT; ++mi) {
      if constexpr (kTransA)
        kernels::ptx::ldmatrix_x4_trans(af[buf][mi][0], af[buf][mi][1], af[buf][mi][2], af[buf][mi][3],
                                        stage_addr + a_lane + ks * 16 * kRowBytesA + (((2 * mi) ^ a_xor) << 4));
      else
        kernels::ptx::ldmatrix_x4(af[buf][mi],
                                  stage_addr + a_lane + mi * 16 * kRowBytesA + (((2 * ks) ^ a_xor) << 4));
    }
#pragma unroll
    for (int q = 0; q < C::kNT / 2; ++q) {
      if constexpr (kTransB) {
        uint32_t r[4];
        kernels::ptx::ldmatrix_x4(r, stage_addr + b_lane + q * 16 * kRowBytesB + (((2 * ks) ^ b_xor) << 4));
        bf[buf][2 * q][0] = r[0];
        bf[buf][2 * q][1] = r[1];
        bf[buf][2 * q + 1][0] = r[2];
        bf[buf][2 * q + 1][1] = r[3];
      } else {
        kernels::ptx::ldmatrix_x4_trans(bf[buf][2 * q][0], bf[buf][2 * q][1], bf[buf][2 * q + 1][0],
                                        bf[buf][2 * q + 1][1],
                                        stage_addr + b_lane + ks * 16 * kRowBytesB + (((2 * q) ^ b_xor) << 4));
      }
    }
  };

  int read_stage = 0;                // the ring's stage the fragments come from
  int write_stage = C::kStages - 1;  // the ring's stage the copies go to
  load_frags(0, smem_base, 0);

  // Main loop, as in kernels::mma_sync_mainloop: the fragments of k-step ks+1 are loaded before
  // the mma of k-step ks; the copies of tile kt + kStages - 1 are spread over the first k-steps
  // (A at step 0, B's halves at steps 1 and 2); at the last k-step the block waits for tile kt+1
  // and loads its first fragments while the last mma of tile kt are still in the tensor pipe.
  for (int kt = 0; kt < ktiles; ++kt) {
    const int nt = kt + C::kStages - 1;  // the k-tile whose copies this iteration issues
    const bool issue = nt < ktiles;
    const bool fast = nt < fast_tiles;
    const uint32_t woff = write_stage * C::kStageBytes;
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      if (ks == C::kKSteps - 1) {
        // Tile kt+1 has landed (for this thread), and after the barrier for every thread; it
        // also tells the next iteration that every warp is done with the stage it will refill.
        kernels::ptx::cp_async_wait<C::kStages - 2>();
        __syncthreads();
        read_stage = kernels::ring_next<C::kStages>(read_stage);
      }
      load_frags((ks + 1) & 1, smem_base + read_stage * C::kStageBytes, (ks + 1) % C::kKSteps);

      if (ks == 0 && issue)
        la.template load<0, LoaderA::kChunksPerThread>(p, a, m0, nt, tid, fast, smem_base + woff, smem + woff);
      if (ks == 1 && issue)
        lb.template load<0, LoaderB::kChunksPerThread / 2>(p, b, n0, nt, tid, fast, smem_base + woff, smem + woff);
      if (ks == 2) {
        if (issue)
          lb.template load<LoaderB::kChunksPerThread / 2, LoaderB::kChunksPerThread>(p, b, n0, nt, tid, fast,
                                                                                     smem_base + woff, smem + woff);
        kernels::ptx::cp_async_commit();
        write_stage = kernels::ring_next<C::kStages>(write_stage);
      }

#pragma unroll
      for (int mi = 0; mi < C::kMT; ++mi)
#pragma unroll
        for (int ni = 0; ni < C::kNT; ++ni) {
          // Serpentine over ni so consecutive mma reuse the B fragment in hand.
          const int nj = (mi & 1) ? C::kNT - 1 - ni : ni;
          kernels::ptx::MmaSync16816<T>::run(acc[mi][nj], af[ks & 1][mi], bf[ks & 1][nj]);
        }
    }
  }
  kernels::ptx::cp_async_wait<0>();
  __syncthreads();  // every warp is done reading the ring
}

// ---- kernel -----------------------------------------------------------------------------------
// Column sums: rows of partials per 128-row tile (kernels/epilogue/staged_tile.cuh).
constexpr int kPartialRowsPerTile = kernels::kStagedPartialRows<Tile>;

// Epi: the output functor (gemm_common.cuh's dispatch_epilogue): AlphaBetaOutput<T> for the plain
// GEMM, GemmEpilogueOp<TC> with an epilogue. The plain kernels are the ones measured before the
// epilogues existed: with the fused functor inlined into every kernel, ptxas spilled 32-40 bytes
// in the transposed-A (TN, TT) mainloops, which sit at 254 registers.
template <typename Epi>
struct LaunchArgs {
  GemmParams p;
  Scheduler sched;  // tiles and the first batch of this launch
  bool fast_ok;     // per-chunk byte strides of A and B fit in 32 bits (fast loader allowed)
  Epi epi;
  float* partials;  // column sums: (batch, tiles_m * kPartialRowsPerTile, N), or null
};

template <typename T, typename Epi, bool kTransA, bool kTransB, bool kAligned>
__global__ void __launch_bounds__(Tile::kThreads, 1) gemm_mma_pipeline_kernel(const LaunchArgs<Epi> args) {
  extern __shared__ __align__(128) unsigned char smem[];

  const kernels::TileCoord<int> tile = args.sched.tile();
  const int64_t m0 = int64_t(tile.m) * Tile::kBM;
  const int64_t n0 = int64_t(tile.n) * Tile::kBN;
  const BatchOperands<T> ops = batch_operands<T>(args.p, args.sched.batch());

  float acc[Tile::kMT][Tile::kNT][4];
  if constexpr (kTransA || kTransB)
    layout_mainloop<T, kAligned, kTransA, kTransB>(acc, args.p, args.fast_ok, ops.a, ops.b, m0, n0, smem);
  else
    kernels::mma_sync_mainloop<T, Tile, kAligned>(acc, args.p, args.fast_ok, ops.a, ops.b, m0, n0, smem);

  const int64_t z = args.sched.batch();
  float* partials = nullptr;
  if (args.partials) {
    const int64_t rows = ceil_div(args.p.m, int64_t(Tile::kBM)) * kPartialRowsPerTile;
    partials = args.partials + (z * rows + int64_t(tile.m) * kPartialRowsPerTile) * args.p.n;
  }
  constexpr bool kFused = !std::is_same_v<Epi, kernels::AlphaBetaOutput<T>>;
  kernels::store_staged_tile<Tile, kFused>(acc, reinterpret_cast<float*>(smem), z, args.p.m, args.p.n, m0, n0,
                                           args.epi, partials);
}

// ---- host side --------------------------------------------------------------------------------
template <typename T, typename Epi, bool kTransA, bool kTransB, bool kAligned>
const char* kernel_name() {
  using TC = std::remove_pointer_t<decltype(Epi::c)>;
  constexpr bool kFused = !std::is_same_v<Epi, kernels::AlphaBetaOutput<T>>;
  static const std::string name = std::string("gemm_mma_pipeline<") + (std::is_same_v<T, __half> ? "fp16" : "bf16") +
                                  (std::is_same_v<T, TC> ? "" : ", fp32 out") + (kFused ? ", epilogue" : "") +
                                  ", 128x256x64, 4 stages, " + (kAligned ? "cp.async" : "unaligned ld/st") +
                                  kLayoutSuffix<kTransA, kTransB> + ">";
  return name.c_str();
}

// The cp.async path needs every 16-byte chunk it copies to start on a 16-byte boundary: base
// pointers aligned, and the stored rows' and batches' strides multiples of 8 elements (2-byte
// types), whatever the layout (the chunks run along the stored rows).
bool operands_aligned(const GemmParams& p) { return a_rows_aligned16(p) && b_rows_aligned16(p); }

size_t partial_bytes(const GemmParams& p) { return column_sum_bytes(p, ceil_div(p.m, Tile::kBM) * kPartialRowsPerTile); }

template <typename T, typename Epi, bool kTransA, bool kTransB, bool kAligned>
cudaError_t prepare_kernel(const void** kernel) {
  const void* k = reinterpret_cast<const void*>(&gemm_mma_pipeline_kernel<T, Epi, kTransA, kTransB, kAligned>);
  // Above 48 KiB a block needs the opt-in; cheap enough to repeat per launch (and correct when
  // the current device changes between calls).
  if (cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
      e != cudaSuccess)
    return e;
  *kernel = k;
  return cudaSuccess;
}

template <typename T, typename Epi, bool kTransA, bool kTransB, bool kAligned>
cudaError_t launch(const GemmParams& p, const Epi& epi, float* partials, cudaStream_t stream) {
  const void* kernel = nullptr;
  if (cudaError_t e = prepare_kernel<T, Epi, kTransA, kTransB, kAligned>(&kernel); e != cudaSuccess) return e;
  const int64_t tiles_m = ceil_div(p.m, Tile::kBM);
  const int64_t tiles_n = ceil_div(p.n, Tile::kBN);
  if (!Scheduler::fits(tiles_m, tiles_n)) return cudaErrorInvalidValue;
  // The fast loader steps between a thread's chunks with 32-bit byte strides: its stored rows
  // are kThreads / (16-byte chunks per stored row of the tile) apart (NN: 32 rows of A, 8 of B;
  // A^T 16, B^T 32).
  const int64_t a_rows = Tile::kThreads / ((kTransA ? Tile::kBM : Tile::kBK) / 8);
  const int64_t b_rows = Tile::kThreads / ((kTransB ? Tile::kBK : Tile::kBN) / 8);
  const bool fast_ok = a_rows * p.lda * 2 <= UINT32_MAX && b_rows * p.ldb * 2 <= UINT32_MAX;
  LaunchArgs<Epi> args{p, Scheduler::make(tiles_m, tiles_n), fast_ok, epi, partials};
  if (cudaError_t e = launch_batch_chunks(p.batch, [&](int64_t z0, unsigned) {
        args.sched.z_base = z0;
        gemm_mma_pipeline_kernel<T, Epi, kTransA, kTransB, kAligned>
            <<<args.sched.grid(z0, p.batch), Tile::kThreads, kSmemBytes, stream>>>(args);
      });
      e != cudaSuccess)
    return e;
  return partials ? finish_column_sums(p, partials, tiles_m * kPartialRowsPerTile, stream) : cudaSuccess;
}

}  // namespace

cudaError_t gemm_mma_pipeline(const GemmParams& p, const Workspace& workspace, cudaStream_t stream) {
  const bool aligned = operands_aligned(p);
  float* partials = nullptr;
  if (p.epi.column_sums) {
    if (workspace.data == nullptr || workspace.bytes < partial_bytes(p)) return cudaErrorInvalidValue;
    partials = static_cast<float*>(workspace.data);
  }
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_epilogue<T>(p, [&](const auto& epi) -> cudaError_t {
      using Epi = std::decay_t<decltype(epi)>;
      return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
        return aligned ? launch<T, Epi, kTransA, kTransB, true>(p, epi, partials, stream)
                       : launch<T, Epi, kTransA, kTransB, false>(p, epi, partials, stream);
      });
    });
  });
}

cudaError_t gemm_mma_pipeline_workspace(const GemmParams& p, size_t* bytes) {
  *bytes = partial_bytes(p);
  return cudaSuccess;
}

cudaError_t gemm_mma_pipeline_resources(const GemmParams& p, KernelResources* out) {
  const bool aligned = operands_aligned(p);
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_epilogue<T>(p, [&](const auto& epi) -> cudaError_t {
      using Epi = std::decay_t<decltype(epi)>;
      return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
        const void* kernel = nullptr;
        const char* name = aligned ? kernel_name<T, Epi, kTransA, kTransB, true>()
                                   : kernel_name<T, Epi, kTransA, kTransB, false>();
        if (cudaError_t e = aligned ? prepare_kernel<T, Epi, kTransA, kTransB, true>(&kernel)
                                    : prepare_kernel<T, Epi, kTransA, kTransB, false>(&kernel);
            e != cudaSuccess)
          return e;
        return describe_kernel(kernel, name, Tile::kThreads, kSmemBytes, out);
      });
    });
  });
}

}  // namespace optimized::cuda
