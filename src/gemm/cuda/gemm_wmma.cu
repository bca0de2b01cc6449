// GEMM rung 5 of the CUDA ladder: tensor cores through WMMA (fp16/bf16 in, fp32 accumulate).
//
//   C = alpha * A @ B + beta * C      A (M, K), B (K, N), C (M, N) with leading dims; A and B
//                                     row-major or stored transposed (column-major), C row-major
//
// What this rung changes versus the register-tiled rung before it:
//   - The inner product runs on the tensor cores. One wmma::mma_sync multiplies a 16x16 tile of
//     A by a 16x16 tile of B for the whole warp (8192 multiply-adds, compiled to two HMMA
//     instructions on sm_80/sm_90) instead of one FFMA per thread per multiply-add.
//   - Each thread no longer owns named C elements: the warp owns opaque accumulator fragments
//     (here 4x2 of them, a 64x32 sub-tile) and the hardware decides which lane holds what. So
//     the epilogue first stores the fragments to shared memory, then each lane reads back
//     elements it can name, applies alpha/beta and writes C with bounds checks.
//   - Tiles of A and B are staged through shared memory (as before), with 8 elements of padding
//     per row so that the fragment loads hit distinct banks, and the next K-tile is fetched
//     into registers while the tensor cores work on the current one (double buffering).
//
// Layouts (NN, NT, TN, TT: GemmParams::trans_a / trans_b, compile-time parameters of the kernel
// dispatched once by the launcher, so the NN kernel is the one described above). WMMA fragments
// name their memory layout (wmma::row_major or wmma::col_major), so a transposed operand is
// staged in shared memory exactly as it is stored and loaded with a col_major fragment: A^T's
// K-tile is stored (32, 128), rows of M, and read as a col_major matrix_a; B^T's is stored
// (128, 32), rows of K, and read as a col_major matrix_b. The global loads stay 16-byte vectors
// along the stored rows (coalesced), the tiles keep their 8-element padding (rows of 272 and 80
// bytes, conflict-free fragment loads), and the fragment loads still compile to one ldmatrix
// each (with .trans where the layout asks). The instructions are NN's; what differs is the shape
// of the global reads: a K-tile row of A or B^T is 32 elements (64 bytes, half a line), one of B
// or A^T 128 (256 bytes). Measured on an H100 (bf16, 4096^3): TN (two long-row operands) 275
// TFLOP/s, NN 250, TT 252, NT (two short-row operands) 226. Shared memory: 34 to 40 KiB for two
// stages, against 37 for NN.
//
// Kept out on purpose, for the next rung (mma_pipeline): cp.async, ldmatrix by hand, more than
// two stages, swizzled shared memory, fragment double buffering.
//
// Block tile 128x128x32, 8 warps as 2 (M) x 4 (N), each warp 64x32 = 4x2 fragments of 16x16.
#include <mma.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

namespace wmma = nvcuda::wmma;

// ---- config ----------------------------------------------------------------------------------
constexpr int kBlockM = 128;  // rows of C per block
constexpr int kBlockN = 128;  // columns of C per block
constexpr int kBlockK = 32;   // depth of one K-tile staged in shared memory
constexpr int kWarpM = 64;    // rows of C per warp
constexpr int kWarpN = 32;    // columns of C per warp
constexpr int kFrag = 16;     // the WMMA shape: m = n = k = 16

constexpr int kWarpsM = kBlockM / kWarpM;   // 2
constexpr int kWarpsN = kBlockN / kWarpN;   // 4
constexpr int kWarps = kWarpsM * kWarpsN;   // 8
constexpr int kThreads = kWarps * 32;       // 256
constexpr int kFragsM = kWarpM / kFrag;     // 4 fragments down a warp tile
constexpr int kFragsN = kWarpN / kFrag;     // 2 fragments across a warp tile

// Shared-memory rows are padded by 8 elements (16 bytes). Row strides of 80 bytes (A) and 272
// bytes (B) put the 8 rows a fragment load reads at once in 8 different 16-byte bank groups.
constexpr int kPad = 8;
constexpr int kLdA = kBlockK + kPad;  // 40 elements: A tile is (kBlockM, kLdA)
constexpr int kLdB = kBlockN + kPad;  // 136 elements: B tile is (kBlockK, kLdB)
constexpr int kLdC = kWarpN + 4;      // 36 floats: per-warp fp32 staging of 16 rows of C

// The transposed layouts' tiles, as stored: A^T (kBlockK, kLdAT) with rows along M, B^T
// (kBlockN, kLdBT) with rows along K.
constexpr int kLdAT = kBlockM + kPad;  // 136 elements
constexpr int kLdBT = kBlockK + kPad;  // 40 elements

// Global loads move 8 16-bit elements (16 bytes) at a time.
constexpr int kVec = 8;
constexpr int kVecsPerRowA = kBlockK / kVec;                          // 4
constexpr int kVecsPerRowB = kBlockN / kVec;                          // 16
constexpr int kVecsPerThreadA = kBlockM * kBlockK / kVec / kThreads;  // 2
constexpr int kVecsPerThreadB = kBlockK * kBlockN / kVec / kThreads;  // 2
constexpr int kRowsPerPassA = kThreads / kVecsPerRowA;                // 64
constexpr int kRowsPerPassB = kThreads / kVecsPerRowB;                // 16
constexpr int kVecsPerRowAT = kBlockM / kVec;                         // 16
constexpr int kVecsPerRowBT = kBlockK / kVec;                         // 4
constexpr int kVecsPerThreadAT = kBlockK * kBlockM / kVec / kThreads;  // 2
constexpr int kVecsPerThreadBT = kBlockN * kBlockK / kVec / kThreads;  // 2
constexpr int kRowsPerPassAT = kThreads / kVecsPerRowAT;              // 16
constexpr int kRowsPerPassBT = kThreads / kVecsPerRowBT;              // 64

// Shared memory: two stages of (A tile, B tile) for the main loop; the epilogue reuses the
// same bytes for the fp32 staging of the accumulators.
constexpr int kElemBytes = 2;
constexpr int kTileABytes = kBlockM * kLdA * kElemBytes;  // 10240
constexpr int kTileBBytes = kBlockK * kLdB * kElemBytes;  // 8704
constexpr int kStageBytes = kTileABytes + kTileBBytes;    // 18944
constexpr int kStages = 2;
constexpr int kMainLoopBytes = kStages * kStageBytes;                          // 37888
constexpr int kEpilogueBytes = kWarps * kFrag * kLdC * int(sizeof(float));    // 18432
constexpr int kSmemBytes = kMainLoopBytes > kEpilogueBytes ? kMainLoopBytes : kEpilogueBytes;
// The same per layout: A^T's tile is 8704 bytes, B^T's 10240 (NT: 40960 bytes for two stages).
constexpr int kTileATBytes = kBlockK * kLdAT * kElemBytes;  // 8704
constexpr int kTileBTBytes = kBlockN * kLdBT * kElemBytes;  // 10240
template <bool kTransA>
constexpr int kTileABytesOf = kTransA ? kTileATBytes : kTileABytes;
template <bool kTransA, bool kTransB>
constexpr int kStageBytesOf = kTileABytesOf<kTransA> + (kTransB ? kTileBTBytes : kTileBBytes);
template <bool kTransA, bool kTransB>
constexpr int kSmemBytesOf = kStages * kStageBytesOf<kTransA, kTransB> > kEpilogueBytes
                                 ? kStages * kStageBytesOf<kTransA, kTransB>
                                 : kEpilogueBytes;

static_assert(kBlockM % kWarpM == 0 && kBlockN % kWarpN == 0, "warp tiles must cover the block");
static_assert(kWarpM % kFrag == 0 && kWarpN % kFrag == 0 && kBlockK % kFrag == 0,
              "warp tile and K-tile must be multiples of the 16x16x16 WMMA shape");
static_assert(kWarpN == 32, "the epilogue maps lane i to column i of the warp tile");
static_assert(kThreads % kVecsPerRowA == 0 && kThreads % kVecsPerRowB == 0,
              "a pass of the block over a tile must cover whole rows");
static_assert(kBlockM * kBlockK % (kVec * kThreads) == 0 &&
                  kBlockK * kBlockN % (kVec * kThreads) == 0,
              "every thread must load the same number of 16-byte vectors per tile");
static_assert(kLdA % 8 == 0 && kLdB % 8 == 0,
              "wmma::load_matrix_sync needs ldm a multiple of 8 for 16-bit types");
static_assert(kLdC % 4 == 0, "wmma::store_matrix_sync needs ldm a multiple of 4 for float");
static_assert((kFrag * kLdA * kElemBytes) % 32 == 0 && (kFrag * kElemBytes) % 32 == 0 &&
                  (kFrag * kLdB * kElemBytes) % 32 == 0 && kTileABytes % 32 == 0 &&
                  kStageBytes % 32 == 0 && (kFrag * kLdC * 4) % 32 == 0,
              "every fragment pointer into shared memory must be 256-bit aligned");
static_assert(kSmemBytes <= 48 * 1024, "static shared memory is capped at 48 KiB");
static_assert(kSmemBytesOf<false, true> <= 48 * 1024 && kSmemBytesOf<true, true> <= 48 * 1024 &&
                  kSmemBytesOf<true, false> <= 48 * 1024,
              "static shared memory is capped at 48 KiB (transposed layouts)");
static_assert(kSmemBytesOf<false, false> == kSmemBytes, "NN is the layout above");
static_assert(kLdAT % 8 == 0 && kLdBT % 8 == 0,
              "wmma::load_matrix_sync needs ldm a multiple of 8 for 16-bit types");
static_assert((kFrag * kLdAT * kElemBytes) % 32 == 0 && (kFrag * kLdBT * kElemBytes) % 32 == 0 &&
                  kTileATBytes % 32 == 0 && kTileBTBytes % 32 == 0,
              "every fragment pointer into shared memory must be 256-bit aligned (transposed layouts)");
static_assert(kThreads % kVecsPerRowAT == 0 && kThreads % kVecsPerRowBT == 0 &&
                  kVecsPerThreadAT * kVec * kThreads == kBlockK * kBlockM &&
                  kVecsPerThreadBT * kVec * kThreads == kBlockN * kBlockK,
              "every thread must load the same number of whole-row 16-byte vectors per tile");

// ---- device helpers --------------------------------------------------------------------------

// 8 consecutive elements starting at `src`, which is column `col` of a row of a matrix `cols`
// wide, as one 16-byte vector. Elements outside the matrix (row_ok false, or columns >= cols)
// read as zero (bit pattern 0 is +0.0 in fp16 and bf16), so partial tiles at the M, N and K edges
// contribute nothing. `vec_ok` says the base pointer and the leading dimension allow one aligned
// 16-byte load; otherwise, and at the right edge, the elements are loaded one by one.
__device__ __forceinline__ uint4 load_vec8(const uint16_t* src, bool row_ok, int64_t col,
                                           int64_t cols, bool vec_ok) {
  if (!row_ok) return make_uint4(0, 0, 0, 0);
  if (vec_ok && col + kVec <= cols) return *reinterpret_cast<const uint4*>(src);
  uint32_t word[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = col + 2 * i < cols ? src[2 * i] : 0u;
    const uint32_t hi = col + 2 * i + 1 < cols ? src[2 * i + 1] : 0u;
    word[i] = lo | (hi << 16);  // little-endian: the lower address is the lower half
  }
  return make_uint4(word[0], word[1], word[2], word[3]);
}

// A 16x16 fragment of A or B from shared memory (ldm in elements), row-major (the NN tiles) or
// column-major (the transposed layouts' tiles, as stored).
// fp16: plain wmma::load_matrix_sync, which compiles to one ldmatrix (LDSM) per fragment.
// bf16: nvcc 13.0 emits wmma.load...bf16 in the generic address space (it marks the fp16 loads
// .shared, but not these), and ptxas then lowers each fragment to four generic 32-bit loads
// (plus MOVM transposes for B) instead of one ldmatrix. Spelling out the same PTX instruction
// with the .shared state space gets ldmatrix for bf16 too. The bf16 fragment holds 8 elements
// in 4 registers, exactly the 4 .b32 operands of wmma.load for m16n16k16 bf16.
template <typename Use, typename T, typename Layout>
__device__ __forceinline__ void load_fragment(wmma::fragment<Use, kFrag, kFrag, kFrag, T, Layout>& frag,
                                              const T* smem_ptr, unsigned ldm) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    static_assert(wmma::fragment<Use, kFrag, kFrag, kFrag, T, Layout>::num_elements == 8,
                  "a 16x16 bf16 fragment is 4 registers of 2 elements");
    uint32_t* reg = reinterpret_cast<uint32_t*>(frag.x);
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
    constexpr bool kA = std::is_same_v<Use, wmma::matrix_a>;
    if constexpr (std::is_same_v<Layout, wmma::row_major>) {
      if constexpr (kA) {
        asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(reg[0]), "=r"(reg[1]), "=r"(reg[2]), "=r"(reg[3])
                     : "r"(addr), "r"(ldm)
                     : "memory");
      } else {
        asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(reg[0]), "=r"(reg[1]), "=r"(reg[2]), "=r"(reg[3])
                     : "r"(addr), "r"(ldm)
                     : "memory");
      }
    } else {
      if constexpr (kA) {
        asm volatile("wmma.load.a.sync.aligned.col.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(reg[0]), "=r"(reg[1]), "=r"(reg[2]), "=r"(reg[3])
                     : "r"(addr), "r"(ldm)
                     : "memory");
      } else {
        asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(reg[0]), "=r"(reg[1]), "=r"(reg[2]), "=r"(reg[3])
                     : "r"(addr), "r"(ldm)
                     : "memory");
      }
    }
  } else {
    wmma::load_matrix_sync(frag, smem_ptr, ldm);
  }
}

// ---- the kernel ------------------------------------------------------------------------------
// grid: (tiles_m * tiles_n, 1, batches in this launch); block: kThreads.
// blockIdx.x walks the tiles of one row of C tiles before moving down, so blocks running at the
// same time share their A row panel in L2.
template <typename T, bool kTransA, bool kTransB>
__global__ void __launch_bounds__(kThreads, 2)
    gemm_wmma_kernel(GemmParams p, int64_t batch_offset, int64_t tiles_n, bool vec_a, bool vec_b) {
  constexpr int kStageBytesL = kStageBytesOf<kTransA, kTransB>;
  constexpr int kTileABytesL = kTileABytesOf<kTransA>;
  // The fragments' memory layouts: a transposed operand's tile is read column-major.
  using LayoutA = std::conditional_t<kTransA, wmma::col_major, wmma::row_major>;
  using LayoutB = std::conditional_t<kTransB, wmma::col_major, wmma::row_major>;
  __shared__ __align__(128) unsigned char smem[kSmemBytesOf<kTransA, kTransB>];

  const BatchOperands<T> ops = batch_operands<T>(p, batch_offset + blockIdx.z);
  // The main loop only moves bits; the tensor cores read them as T from shared memory.
  const uint16_t* a = reinterpret_cast<const uint16_t*>(ops.a);
  const uint16_t* b = reinterpret_cast<const uint16_t*>(ops.b);

  const int64_t m0 = static_cast<int64_t>(blockIdx.x) / tiles_n * kBlockM;  // block's first row
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) % tiles_n * kBlockN;  // block's first col
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_row = warp / kWarpsN * kWarpM;  // warp tile's first row within the block tile
  const int warp_col = warp % kWarpsN * kWarpN;  // warp tile's first column within the block

  auto tile_a = [&](int stage) { return reinterpret_cast<T*>(smem + stage * kStageBytesL); };
  auto tile_b = [&](int stage) {
    return reinterpret_cast<T*>(smem + stage * kStageBytesL + kTileABytesL);
  };

  // Each operand's tile as stored: A (128, 32) or A^T (32, 128); B (32, 128) or B^T (128, 32).
  // Per operand: vectors across a stored row, vectors per thread, stored rows per pass, and
  // the tile's row stride in shared memory.
  constexpr int kVecsPerRowSA = kTransA ? kVecsPerRowAT : kVecsPerRowA;
  constexpr int kVecsPerRowSB = kTransB ? kVecsPerRowBT : kVecsPerRowB;
  constexpr int kVecsPerThreadSA = kTransA ? kVecsPerThreadAT : kVecsPerThreadA;
  constexpr int kVecsPerThreadSB = kTransB ? kVecsPerThreadBT : kVecsPerThreadB;
  constexpr int kRowsPerPassSA = kTransA ? kRowsPerPassAT : kRowsPerPassA;
  constexpr int kRowsPerPassSB = kTransB ? kRowsPerPassBT : kRowsPerPassB;
  constexpr int kLdSA = kTransA ? kLdAT : kLdA;
  constexpr int kLdSB = kTransB ? kLdBT : kLdB;

  // Global -> registers. Thread t loads the 16-byte vectors t and t + kThreads of each tile:
  // stored rows a_row and a_row + kRowsPerPassSA at element a_col along them (A: rows of A,
  // columns of K; A^T: rows of K, columns of M), the same for B (B: rows of K; B^T: rows of N).
  // a_src / b_src point at the thread's first vector of the next K-tile to load; each load
  // moves them one K-tile on (32 columns of A, 32 rows of B; rows of A^T, columns of B^T).
  const int a_row = threadIdx.x / kVecsPerRowSA, a_col = threadIdx.x % kVecsPerRowSA * kVec;
  const int b_row = threadIdx.x / kVecsPerRowSB, b_col = threadIdx.x % kVecsPerRowSB * kVec;
  const uint16_t* a_src = kTransA ? a + static_cast<int64_t>(a_row) * p.lda + m0 + a_col
                                  : a + (m0 + a_row) * p.lda + a_col;
  const uint16_t* b_src = kTransB ? b + (n0 + b_row) * p.ldb + b_col
                                  : b + static_cast<int64_t>(b_row) * p.ldb + n0 + b_col;

  uint4 a_regs[kVecsPerThreadSA];
  uint4 b_regs[kVecsPerThreadSB];
  // Loads the K-tile of columns (A) / rows (B) [k0, k0 + 32). Called once per K-tile, in order.
  auto load_tile = [&](int64_t k0) {
#pragma unroll
    for (int i = 0; i < kVecsPerThreadSA; ++i) {
      const int row = a_row + i * kRowsPerPassSA;  // in the (128, 32) tile, or A^T's (32, 128)
      if constexpr (kTransA)
        a_regs[i] = load_vec8(a_src + i * kRowsPerPassSA * p.lda, k0 + row < p.k, m0 + a_col, p.m, vec_a);
      else
        a_regs[i] = load_vec8(a_src + i * kRowsPerPassSA * p.lda, m0 + row < p.m, k0 + a_col, p.k,
                              vec_a);
    }
#pragma unroll
    for (int i = 0; i < kVecsPerThreadSB; ++i) {
      const int row = b_row + i * kRowsPerPassSB;  // in the (32, 128) tile, or B^T's (128, 32)
      if constexpr (kTransB)
        b_regs[i] = load_vec8(b_src + i * kRowsPerPassSB * p.ldb, n0 + row < p.n, k0 + b_col, p.k, vec_b);
      else
        b_regs[i] = load_vec8(b_src + i * kRowsPerPassSB * p.ldb, k0 + row < p.k, n0 + b_col, p.n,
                              vec_b);
    }
    a_src += kTransA ? kBlockK * p.lda : kBlockK;
    b_src += kTransB ? kBlockK : kBlockK * p.ldb;
  };
  // Registers -> shared memory stage `stage`: the vectors are rows of the stored tiles.
  auto store_tile = [&](int stage) {
#pragma unroll
    for (int i = 0; i < kVecsPerThreadSA; ++i)
      *reinterpret_cast<uint4*>(tile_a(stage) + (a_row + i * kRowsPerPassSA) * kLdSA + a_col) =
          a_regs[i];
#pragma unroll
    for (int i = 0; i < kVecsPerThreadSB; ++i)
      *reinterpret_cast<uint4*>(tile_b(stage) + (b_row + i * kRowsPerPassSB) * kLdSB + b_col) =
          b_regs[i];
  };

  // The warp's 64x32 slice of C: 4x2 fp32 accumulator fragments of 16x16.
  wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc[kFragsM][kFragsN];
#pragma unroll
  for (int i = 0; i < kFragsM; ++i)
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  // ---- main loop: one __syncthreads per K-tile --------------------------------------------
  // Iteration kt computes on stage kt % 2 while the loads of K-tile kt + 1 are in flight; those
  // land in the other stage, which every warp finished reading before the previous barrier.
  const int64_t k_tiles = (p.k + kBlockK - 1) / kBlockK;
  load_tile(0);
  store_tile(0);
  __syncthreads();
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int stage = static_cast<int>(kt & 1);
    const bool has_next = kt + 1 < k_tiles;
    if (has_next) load_tile((kt + 1) * kBlockK);  // global loads issue now, are used below

    const T* sa = tile_a(stage);  // (kBlockM, kLdA), A^T: (kBlockK, kLdAT)
    const T* sb = tile_b(stage);  // (kBlockK, kLdB), B^T: (kBlockN, kLdBT)
#pragma unroll
    for (int kk = 0; kk < kBlockK; kk += kFrag) {
      wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, LayoutA> a_frag[kFragsM];
      wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, LayoutB> b_frag[kFragsN];
      // A rows [warp_row + 16i, +16), cols [kk, kk + 16): at (row, kk) of A's tile, or at
      // (kk, row) of A^T's, read column-major.
#pragma unroll
      for (int i = 0; i < kFragsM; ++i) {
        if constexpr (kTransA)
          load_fragment(a_frag[i], sa + kk * kLdAT + warp_row + i * kFrag, kLdAT);
        else
          load_fragment(a_frag[i], sa + (warp_row + i * kFrag) * kLdA + kk, kLdA);
      }
      // B rows [kk, kk + 16), cols [warp_col + 16j, +16): at (kk, col) of B's tile, or at
      // (col, kk) of B^T's, read column-major.
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        if constexpr (kTransB)
          load_fragment(b_frag[j], sb + (warp_col + j * kFrag) * kLdBT + kk, kLdBT);
        else
          load_fragment(b_frag[j], sb + kk * kLdB + warp_col + j * kFrag, kLdB);
      }
#pragma unroll
      for (int i = 0; i < kFragsM; ++i)
#pragma unroll
        for (int j = 0; j < kFragsN; ++j)  // acc[i][j] += a_frag[i] @ b_frag[j]
          wmma::mma_sync(acc[i][j], a_frag[i], b_frag[j], acc[i][j]);
    }

    if (has_next) store_tile(stage ^ 1);
    __syncthreads();
  }
  // The loop's last barrier means no warp reads the A/B tiles any more: reuse the bytes.

  // ---- epilogue: fragments -> shared (fp32) -> alpha/beta -> C ----------------------------
  // Each warp stages one 16x32 row of fragments at a time in its own (16, kLdC) float area;
  // lane i then owns column i of it and walks its 16 rows (a warp writes 32 consecutive
  // elements of one C row per step).
  float* staging = reinterpret_cast<float*>(smem) + warp * kFrag * kLdC;
  const int64_t col = n0 + warp_col + lane;
#pragma unroll
  for (int i = 0; i < kFragsM; ++i) {
#pragma unroll
    for (int j = 0; j < kFragsN; ++j)
      wmma::store_matrix_sync(staging + j * kFrag, acc[i][j], kLdC, wmma::mem_row_major);
    __syncwarp();
    const int64_t row0 = m0 + warp_row + i * kFrag;
#pragma unroll 4
    for (int r = 0; r < kFrag; ++r) {
      const int64_t row = row0 + r;
      if (row < p.m && col < p.n)
        store_alpha_beta(ops.c + row * p.ldc + col, staging[r * kLdC + lane], p.alpha, p.beta);
    }
    __syncwarp();  // the next fragment row overwrites the staging area
  }
}

template <typename T, bool kTransA, bool kTransB>
const char* kernel_name() {
  static const std::string name = std::string("gemm_wmma<") + (std::is_same_v<T, __half> ? "fp16" : "bf16") +
                                  ", 128x128x32, warp 64x32, 2 stages" + kLayoutSuffix<kTransA, kTransB> + ">";
  return name.c_str();
}

}  // namespace

// ---- launcher --------------------------------------------------------------------------------
cudaError_t gemm_wmma(const GemmParams& p, const Workspace&, cudaStream_t stream) {
  const int64_t tiles_m = ceil_div(p.m, kBlockM);
  const int64_t tiles_n = ceil_div(p.n, kBlockN);
  if (tiles_m * tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;  // grid.x limit
  // A single aligned 16-byte load is allowed for an operand when every stored row of every batch
  // starts on a 16-byte boundary (gemm_common.cuh); the vectors run along the stored rows.
  const bool vec_a = a_rows_aligned16(p);
  const bool vec_b = b_rows_aligned16(p);
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      return launch_batch_chunks(p.batch, [&](int64_t first, unsigned count) {
        const dim3 grid(static_cast<unsigned>(tiles_m * tiles_n), 1, count);
        gemm_wmma_kernel<T, kTransA, kTransB><<<grid, kThreads, 0, stream>>>(p, first, tiles_n, vec_a, vec_b);
      });
    });
  });
}

cudaError_t gemm_wmma_resources(const GemmParams& p, KernelResources* out) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
      return describe_kernel(reinterpret_cast<const void*>(&gemm_wmma_kernel<T, kTransA, kTransB>),
                             kernel_name<T, kTransA, kTransB>(), kThreads, /*dynamic_smem_bytes=*/0, out);
    });
  });
}

}  // namespace optimized::cuda
