// Top rung of the pre-Hopper tensor-core ladder: mma.sync.m16n8k16 (fp32 accumulate) fed by
// ldmatrix from an XOR-swizzled, multi-stage shared-memory ring that cp.async fills.
//
//   block tile 128x256x64, 8 warps as 2 (M) x 4 (N), warp tile 64x64 = 4 x 8 mma tiles,
//   128 fp32 accumulators per thread, 4-stage cp.async ring (192 KiB of dynamic smem),
//   grouped (GROUP_M) rasterization of the tile grid for L2 reuse, epilogue staged through
//   shared memory as fp32 so that C is read and written in full, coalesced rows.
//
// Shared-memory layout (both operands row-major, 16-byte chunks, chunk index XOR (row % 8)):
//   A stage: [128 rows (m)][64 k]  = 128 B per row =  8 chunks;  chunk' = chunk ^ (row & 7)
//   B stage: [ 64 rows (k)][256 n] = 512 B per row = 32 chunks;  chunk' = chunk ^ (row & 7)
//            (the XOR touches the low 3 bits only: it permutes chunks inside each 128 B line)
// An 8x8 ldmatrix matrix reads 8 consecutive rows at one logical chunk: after the XOR they sit
// in 8 distinct 16-byte bank groups, so every ldmatrix phase is one conflict-free wavefront.
// A cp.async group of 8 threads writes one row's 8 consecutive chunks: again 8 distinct groups.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4 and t = lane % 4:
//   A (16x16, row): a0 = (g, 2t..2t+1)  a1 = (g+8, 2t..)  a2 = (g, 2t+8..)  a3 = (g+8, 2t+8..)
//   B (16x8,  col): b0 = (k 2t..2t+1, n g)  b1 = (k 2t+8.., n g)
//   C (16x8):       c0,c1 = (g, 2t..2t+1)  c2,c3 = (g+8, 2t..2t+1)
// ldmatrix.x4: lanes 8i..8i+7 give the 8 row addresses of matrix i; register i of every lane
// receives matrix i with lane l holding row l/4, columns 2(l%4), 2(l%4)+1 (.trans: row 2(l%4)
// and 2(l%4)+1, column l/4, i.e. the transpose).
//   A: lane l addresses row (l % 16), k chunk (l / 16)  -> registers a0, a1, a2, a3.
//   B: lane l addresses k row (l % 16), n chunk 2p + (l / 16), with .trans -> b0, b1 of n-tile
//      2p and b0, b1 of n-tile 2p+1 (B is row-major K x N in smem, the mma wants it "col").
//
// Two load paths, one layout: kAligned (16-byte aligned bases, lda and ldb multiples of 8
// elements) fills the ring with cp.async.cg 16-byte copies, and the partial or empty chunks at
// the M, N and K edges with predicated element loads plus st.shared of the chunk (zeros beyond
// the edge); otherwise every chunk takes that element path (correct for any lda/ldb/alignment).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "gemm/cuda/gemm_common.cuh"
#include "gemm/cuda/gemm_launchers.h"

namespace optimized::cuda {
namespace {

// ---- tuning constants (one place) -------------------------------------------------------------
// Why these (reasoning in docs/perf-notes/gemm-mma-draft.md; "measured" = standalone harness on
// an H100 80GB HBM3 at 1980 MHz, 4096^3 bf16, where this config runs at ~460 TFLOP/s):
//  * 128x256 block / 64x64 warp tile: per 16-wide k-step a warp issues 8 ldmatrix.x4 (4 KiB of
//    smem reads) for 32 mma = 128 KFLOP, i.e. 32 FLOP per smem byte. A 64x32 or 32x64 warp tile
//    needs 6 ldmatrix.x4 for 16 mma (21 FLOP/B), and with cp.async writes on top the smem port
//    (128 B/clk/SM) would sit close to the mma.sync rate; 128x128 blocks of 4 such warps halve the
//    warps per scheduler (2 is already the least that hides HMMA/ldmatrix latency). 64x64 is the
//    largest warp tile whose 128 accumulators + double-buffered fragments (64 regs) fit in 255.
//  * BK = 64: rows of A are exactly one 128-byte line, so one XOR swizzle serves A and B; one
//    __syncthreads per 4 k-steps (BK = 32 doubles the barriers per FLOP).
//  * 4 stages: 3 tiles (192 of K) in flight, ~3.5 us of math per SM, well above DRAM/L2 latency
//    under load. Measured: 3 stages within noise of 4; 4 kept as margin, free in occupancy
//    (registers cap it at 1 block per SM) and the fp32 epilogue staging (132 KiB) reuses the ring.
//  * kGroupM = 8: 132 resident blocks cover ~8 block-rows of A and all of B at 4096^2, ~40 MiB,
//    inside the 50 MiB L2. Measured 4 / 8 / 16: within noise at 4096; 4 ~2% slower at 8192.
struct Cfg {
  static constexpr int kBM = 128;
  static constexpr int kBN = 256;
  static constexpr int kBK = 64;
  static constexpr int kStages = 4;
  static constexpr int kWarpsM = 2;
  static constexpr int kWarpsN = 4;
  static constexpr int kGroupM = 8;

  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;  // 256
  static constexpr int kWM = kBM / kWarpsM;                 // 64
  static constexpr int kWN = kBN / kWarpsN;                 // 64
  static constexpr int kMT = kWM / 16;                      // 4 mma tiles along M per warp
  static constexpr int kNT = kWN / 8;                       // 8 mma tiles along N per warp
  static constexpr int kKSteps = kBK / 16;                  // 4
  static constexpr int kARowBytes = kBK * 2;                // 128
  static constexpr int kBRowBytes = kBN * 2;                // 512
  static constexpr int kATileBytes = kBM * kARowBytes;      // 16 KiB
  static constexpr int kBTileBytes = kBK * kBRowBytes;      // 32 KiB
  static constexpr int kStageBytes = kATileBytes + kBTileBytes;
  static constexpr int kAChunksPerThread = kBM * kBK / 8 / kThreads;  // 4
  static constexpr int kBChunksPerThread = kBK * kBN / 8 / kThreads;  // 8
  static constexpr int kEpiStride = kBN + 8;  // floats; +8 keeps the float2 writes conflict-free
  static constexpr int kEpiBytes = kBM * kEpiStride * 4;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kSmemBytes = kPipeBytes > kEpiBytes ? kPipeBytes : kEpiBytes;

  static_assert(kARowBytes == 128, "the A swizzle assumes one 128-byte line per row");
  static_assert(kBN % 64 == 0, "the B swizzle permutes chunks inside 128-byte lines");
  static_assert(kMT * 16 == kWM && kNT * 8 == kWN && kNT % 2 == 0, "warp tile");
  static_assert(kBM * kBK / 8 % kThreads == 0 && kBK * kBN / 8 % kThreads == 0, "loader");
  static_assert(kBK / 8 == 8 && kBN / 8 == 32, "loader: 8 threads per A row, a warp per B row");
  static_assert(kThreads / 8 % 8 == 0, "A loader rows advance by multiples of 8");
  static_assert(kThreads / 32 % 8 == 0, "B loader rows advance by multiples of 8");
  static_assert((kBM * kBN / 4) % kThreads == 0, "epilogue");
};

// ---- PTX wrappers -----------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy, global -> shared, bypassing L1 (.cg).
__device__ __forceinline__ void cp_async_16_full(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T> struct MmaOp;
template <> struct MmaOp<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};
template <> struct MmaOp<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// ---- kernel -----------------------------------------------------------------------------------
struct LaunchArgs {
  GemmParams p;
  int64_t z_base;   // first batch of this launch (batches beyond kMaxGridZ take several launches)
  int tiles_m;
  int tiles_n;
  bool c_vec4;      // C base 8-byte aligned and ldc, batch_stride_c multiples of 4 elements
  bool fast_ok;     // per-chunk byte strides of A and B fit in 32 bits (fast loader allowed)
};

// Fills one stage of the ring with k-tile kt. Each thread owns kAChunksPerThread 16-byte chunks
// of the A tile (rows ar + 32 i, chunk ac: 8 consecutive threads fill one 128-byte row) and
// kBChunksPerThread of the B tile (k rows br + 8 i, chunk bc: 32 threads fill one 512-byte row).
//
// Two ways to fill a stage:
//  * fast (kAligned, the block lies inside M and N, and the k-tile lies inside K): running
//    byte pointers plus a 32-bit stride per chunk, no bounds checks -- a handful of integer ops
//    per tile, so the copies hide inside the mma stream (this is nearly every tile of a large
//    product; recomputing 64-bit addresses and predicates per chunk cost ~250 instructions per
//    tile against 128 mma per warp and measurably starved the tensor pipe);
//  * general (any tile): row, column and K checks per chunk; whole chunks by cp.async
//    (kAligned), the rest element by element through registers, zeros outside the matrix.
template <typename T, bool kAligned>
struct TileLoader {
  using C = Cfg;
  static constexpr int kARowStride = C::kThreads / 8;   // rows between a thread's A chunks
  static constexpr int kBRowStride = C::kThreads / 32;  // rows between a thread's B chunks

  const char* a_cur;  // byte address of this thread's A chunk 0 in the next tile (fast path)
  const char* b_cur;  // byte address of this thread's B chunk 0 in the next tile (fast path)
  uint32_t a_step;    // bytes between this thread's A chunks
  uint32_t b_step;    // bytes between this thread's B chunks
  int fast_tiles;     // k-tiles [0, fast_tiles) take the fast path

  __device__ __forceinline__ void init(const LaunchArgs& args, const T* a, const T* b, int64_t m0,
                                       int64_t n0, int tid) {
    const GemmParams& p = args.p;
    const int ar = tid >> 3, ac = tid & 7, br = tid >> 5, bc = tid & 31;
    const bool inside = m0 + C::kBM <= p.m && n0 + C::kBN <= p.n;
    fast_tiles = kAligned && args.fast_ok && inside ? static_cast<int>(p.k / C::kBK) : 0;
    a_step = static_cast<uint32_t>(kARowStride * p.lda * 2);
    b_step = static_cast<uint32_t>(kBRowStride * p.ldb * 2);
    const int64_t gm = m0 + ar < p.m ? m0 + ar : p.m - 1;   // clamped: only used when inside
    const int64_t gn = n0 + bc * 8 < p.n ? n0 + bc * 8 : 0;
    const int64_t gk = br < p.k ? br : 0;
    a_cur = reinterpret_cast<const char*>(a + gm * p.lda + ac * 8);
    b_cur = reinterpret_cast<const char*>(b + gk * p.ldb + gn);
  }

  static __device__ __forceinline__ uint32_t a_dst(int tid) {
    const int ar = tid >> 3, ac = tid & 7;
    return ar * C::kARowBytes + ((ac ^ (ar & 7)) << 4);
  }
  static __device__ __forceinline__ uint32_t b_dst(int tid) {
    const int br = tid >> 5, bc = tid & 31;
    return C::kATileBytes + br * C::kBRowBytes + ((bc ^ (br & 7)) << 4);
  }

  // 8 elements (zero beyond `valid`) into the 16-byte slot at byte offset `dst` of the stage.
  // Whole chunks of the aligned kernel go by cp.async; partial and empty chunks (the M, N and K
  // edges only) and every chunk of the unaligned kernel are loaded element by element with
  // bounds checks and stored with st.shared. (The cp.async src-size zero-fill form would do the
  // edges too, but compute-sanitizer counts its full 16-byte source as accessed and reports the
  // tail of an allocation as out of bounds; a plain store of the zeros costs nothing here.)
  static __device__ __forceinline__ void copy_chunk(uint32_t stage_addr, unsigned char* stage_ptr,
                                                    uint32_t dst, const T* src, int valid) {
    if constexpr (kAligned) {
      if (valid == 8) {
        cp_async_16_full(stage_addr + dst, src);
        return;
      }
    }
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    uint16_t v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = e < valid ? s[e] : uint16_t(0);
    uint4 pk;
    pk.x = v[0] | (uint32_t(v[1]) << 16);
    pk.y = v[2] | (uint32_t(v[3]) << 16);
    pk.z = v[4] | (uint32_t(v[5]) << 16);
    pk.w = v[6] | (uint32_t(v[7]) << 16);
    *reinterpret_cast<uint4*>(stage_ptr + dst) = pk;
  }

  __device__ __forceinline__ void load_a(const LaunchArgs& args, const T* a, int64_t m0, int kt,
                                         int tid, uint32_t stage_addr, unsigned char* stage_ptr) {
    const uint32_t dst = a_dst(tid);
    if (kAligned && kt < fast_tiles) {
#pragma unroll
      for (int i = 0; i < C::kAChunksPerThread; ++i)
        cp_async_16_full(stage_addr + dst + i * kARowStride * C::kARowBytes, a_cur + uint64_t(a_step) * i);
    } else {
      const GemmParams& p = args.p;
      const int ar = tid >> 3, ac = tid & 7;
      const int64_t gk = int64_t(kt) * C::kBK + ac * 8;
      const int kvalid = gk < p.k ? static_cast<int>(p.k - gk < 8 ? p.k - gk : 8) : 0;
#pragma unroll
      for (int i = 0; i < C::kAChunksPerThread; ++i) {
        const int64_t gm = m0 + ar + i * kARowStride;
        const int valid = gm < p.m ? kvalid : 0;
        copy_chunk(stage_addr, stage_ptr, dst + i * kARowStride * C::kARowBytes,
                   valid > 0 ? a + gm * p.lda + gk : a, valid);
      }
    }
    a_cur += C::kBK * 2;
  }

  // B chunks [i0, i1) of k-tile kt; the last part advances to the next tile.
  template <int i0, int i1>
  __device__ __forceinline__ void load_b(const LaunchArgs& args, const T* b, int64_t n0, int kt,
                                         int tid, uint32_t stage_addr, unsigned char* stage_ptr) {
    const uint32_t dst = b_dst(tid);
    if (kAligned && kt < fast_tiles) {
#pragma unroll
      for (int i = i0; i < i1; ++i)
        cp_async_16_full(stage_addr + dst + i * kBRowStride * C::kBRowBytes, b_cur + uint64_t(b_step) * i);
    } else {
      const GemmParams& p = args.p;
      const int br = tid >> 5, bc = tid & 31;
      const int64_t gn = n0 + bc * 8;
      const int nvalid = gn < p.n ? static_cast<int>(p.n - gn < 8 ? p.n - gn : 8) : 0;
#pragma unroll
      for (int i = i0; i < i1; ++i) {
        const int64_t gk = int64_t(kt) * C::kBK + br + i * kBRowStride;
        const int valid = gk < p.k ? nvalid : 0;
        copy_chunk(stage_addr, stage_ptr, dst + i * kBRowStride * C::kBRowBytes,
                   valid > 0 ? b + gk * p.ldb + gn : b, valid);
      }
    }
    if (i1 == C::kBChunksPerThread) b_cur += int64_t(C::kBK) * args.p.ldb * 2;
  }
};

template <typename T, bool kAligned>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_mma_pipeline_kernel(const LaunchArgs args) {
  using C = Cfg;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = smem_u32(smem);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp / C::kWarpsN;  // 0..1
  const int wn = warp % C::kWarpsN;  // 0..3

  // Grouped rasterization: kGroupM block-rows walk N together, so neighbouring blocks share A
  // rows and B columns in L2.
  int tm, tn;
  {
    const int t = blockIdx.x;
    const int per_group = C::kGroupM * args.tiles_n;
    const int group = t / per_group;
    const int first_m = group * C::kGroupM;
    const int rows = min(args.tiles_m - first_m, C::kGroupM);
    const int in_group = t - group * per_group;
    tm = first_m + in_group % rows;
    tn = in_group / rows;
  }
  const int64_t m0 = int64_t(tm) * C::kBM;
  const int64_t n0 = int64_t(tn) * C::kBN;
  const BatchOperands<T> ops = batch_operands<T>(args.p, args.z_base + blockIdx.z);
  const int ktiles = static_cast<int>((args.p.k + C::kBK - 1) / C::kBK);

  TileLoader<T, kAligned> loader;
  loader.init(args, ops.a, ops.b, m0, n0, tid);

  float acc[C::kMT][C::kNT][4];
#pragma unroll
  for (int i = 0; i < C::kMT; ++i)
#pragma unroll
    for (int j = 0; j < C::kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  // Per-lane ldmatrix offsets (see the header comment). x = lane & 7 is the row's swizzle key,
  // h = lane >> 4 the chunk half; since chunk = 2s + h with 2s even, chunk ^ x = 2s ^ (h ^ x).
  const int lane_xor = (lane >> 4) ^ (lane & 7);
  const uint32_t a_lane = (wm * C::kWM + (lane & 15)) * C::kARowBytes;
  const uint32_t b_lane = C::kATileBytes + (lane & 15) * C::kBRowBytes + wn * (C::kWN / 8) * 16;

  // Prologue: tiles 0 .. kStages-2. Every step commits a group (empty ones too) so that
  // wait_group<kStages-2> always means "the next tile to be read has landed".
#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < ktiles) {
      const uint32_t off = s * C::kStageBytes;
      loader.load_a(args, ops.a, m0, s, tid, smem_base + off, smem + off);
      loader.template load_b<0, C::kBChunksPerThread>(args, ops.b, n0, s, tid, smem_base + off,
                                                      smem + off);
    }
    cp_async_commit();
  }
  cp_async_wait<C::kStages - 2>();
  __syncthreads();

  uint32_t af[2][C::kMT][4];
  uint32_t bf[2][C::kNT][2];
  auto load_frags = [&](int buf, uint32_t stage_addr, int ks) {
#pragma unroll
    for (int mi = 0; mi < C::kMT; ++mi)
      ldmatrix_x4(af[buf][mi], stage_addr + a_lane + mi * 16 * C::kARowBytes +
                                   (((2 * ks) ^ lane_xor) << 4));
#pragma unroll
    for (int p = 0; p < C::kNT / 2; ++p)
      ldmatrix_x4_trans(bf[buf][2 * p][0], bf[buf][2 * p][1], bf[buf][2 * p + 1][0],
                        bf[buf][2 * p + 1][1],
                        stage_addr + b_lane + ks * 16 * C::kBRowBytes + (((2 * p) ^ lane_xor) << 4));
  };

  int read_stage = 0;
  int write_stage = C::kStages - 1;
  load_frags(0, smem_base, 0);

  // Main loop, CUTLASS-multistage order: the fragments of k-step ks+1 are loaded before the mma
  // of k-step ks; the copies of tile kt + kStages - 1 are spread over the first k-steps; at the
  // last k-step the block waits for tile kt+1 and loads its first fragments while the last
  // mma of tile kt are still in the tensor pipe.
  static_assert(C::kKSteps % 2 == 0 && C::kKSteps >= 3, "fragment double buffer / load slots");
  for (int kt = 0; kt < ktiles; ++kt) {
    const bool issue = kt + C::kStages - 1 < ktiles;
    const uint32_t woff = write_stage * C::kStageBytes;
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      if (ks == C::kKSteps - 1) {
        // Tile kt+1 has landed (for this thread), and after the barrier for every thread; it
        // also tells the next iteration that every warp is done with the stage it will refill.
        cp_async_wait<C::kStages - 2>();
        __syncthreads();
        read_stage = read_stage + 1 == C::kStages ? 0 : read_stage + 1;
      }
      load_frags((ks + 1) & 1, smem_base + read_stage * C::kStageBytes, (ks + 1) % C::kKSteps);

      if (ks == 0 && issue)
        loader.load_a(args, ops.a, m0, kt + C::kStages - 1, tid, smem_base + woff, smem + woff);
      if (ks == 1 && issue)
        loader.template load_b<0, C::kBChunksPerThread / 2>(args, ops.b, n0, kt + C::kStages - 1,
                                                            tid, smem_base + woff, smem + woff);
      if (ks == 2) {
        if (issue)
          loader.template load_b<C::kBChunksPerThread / 2, C::kBChunksPerThread>(
              args, ops.b, n0, kt + C::kStages - 1, tid, smem_base + woff, smem + woff);
        cp_async_commit();
        write_stage = write_stage + 1 == C::kStages ? 0 : write_stage + 1;
      }

#pragma unroll
      for (int mi = 0; mi < C::kMT; ++mi)
#pragma unroll
        for (int ni = 0; ni < C::kNT; ++ni) {
          // Serpentine over ni so consecutive mma reuse the B fragment in hand.
          const int nj = (mi & 1) ? C::kNT - 1 - ni : ni;
          MmaOp<T>::run(acc[mi][nj], af[ks & 1][mi], bf[ks & 1][nj]);
        }
    }
  }

  // ---- epilogue: stage the fp32 tile in smem, then write whole rows of C ----------------------
  cp_async_wait<0>();
  __syncthreads();  // every warp is done reading the ring; reuse it
  float* epi = reinterpret_cast<float*>(smem);
  {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < C::kMT; ++mi)
#pragma unroll
      for (int ni = 0; ni < C::kNT; ++ni) {
        const int r = wm * C::kWM + mi * 16 + g;
        const int c = wn * C::kWN + ni * 8 + 2 * t;
        *reinterpret_cast<float2*>(epi + r * C::kEpiStride + c) =
            make_float2(acc[mi][ni][0], acc[mi][ni][1]);
        *reinterpret_cast<float2*>(epi + (r + 8) * C::kEpiStride + c) =
            make_float2(acc[mi][ni][2], acc[mi][ni][3]);
      }
  }
  __syncthreads();

  const int64_t M = args.p.m, N = args.p.n, ldc = args.p.ldc;
  const float alpha = args.p.alpha, beta = args.p.beta;
  constexpr int kVecPerRow = C::kBN / 4;  // 64 threads cover one row, 4 columns each
#pragma unroll 4
  for (int it = 0; it < C::kBM * C::kBN / 4 / C::kThreads; ++it) {
    const int idx = it * C::kThreads + tid;
    const int r = idx / kVecPerRow;
    const int c = (idx % kVecPerRow) * 4;
    const int64_t gm = m0 + r, gn = n0 + c;
    if (gm >= M || gn >= N) continue;
    const float4 v = *reinterpret_cast<const float4*>(epi + r * C::kEpiStride + c);
    T* cp = ops.c + gm * ldc + gn;
    if (args.c_vec4 && gn + 4 <= N) {
      float o[4] = {alpha * v.x, alpha * v.y, alpha * v.z, alpha * v.w};
      if (beta != 0.0f) {
        const uint2 old = *reinterpret_cast<const uint2*>(cp);
        const T* ov = reinterpret_cast<const T*>(&old);
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = fmaf(beta, to_float(ov[e]), o[e]);
      }
      uint2 out;
      T* outv = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int e = 0; e < 4; ++e) outv[e] = from_float<T>(o[e]);
      *reinterpret_cast<uint2*>(cp) = out;
    } else {
      const float vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (gn + e < N) store_epilogue(cp + e, vv[e], alpha, beta);
    }
  }
}

// ---- host side --------------------------------------------------------------------------------
template <typename T, bool kAligned>
const char* kernel_name() {
  if constexpr (std::is_same_v<T, __half>)
    return kAligned ? "gemm_mma_pipeline<fp16, 128x256x64, 4 stages, cp.async>"
                    : "gemm_mma_pipeline<fp16, 128x256x64, 4 stages, unaligned ld/st>";
  else
    return kAligned ? "gemm_mma_pipeline<bf16, 128x256x64, 4 stages, cp.async>"
                    : "gemm_mma_pipeline<bf16, 128x256x64, 4 stages, unaligned ld/st>";
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// The cp.async path needs every 16-byte chunk it copies to start on a 16-byte boundary: base
// pointers aligned, and row and batch strides multiples of 8 elements (2-byte types).
bool operands_aligned(const GemmParams& p) {
  const bool batched = p.batch > 1;
  return aligned16(p.a) && aligned16(p.b) && p.lda % 8 == 0 && p.ldb % 8 == 0 &&
         (!batched || (p.batch_stride_a % 8 == 0 && p.batch_stride_b % 8 == 0));
}

bool c_vectorizable(const GemmParams& p) {
  return (reinterpret_cast<uintptr_t>(p.c) & 7) == 0 && p.ldc % 4 == 0 &&
         (p.batch <= 1 || p.batch_stride_c % 4 == 0);
}

template <typename T, bool kAligned>
cudaError_t prepare_kernel(const void** kernel) {
  const void* k = reinterpret_cast<const void*>(&gemm_mma_pipeline_kernel<T, kAligned>);
  // Above 48 KiB a block needs the opt-in; cheap enough to repeat per launch (and correct when
  // the current device changes between calls).
  if (cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           Cfg::kSmemBytes);
      e != cudaSuccess)
    return e;
  *kernel = k;
  return cudaSuccess;
}

template <typename T, bool kAligned>
cudaError_t launch(const GemmParams& p, cudaStream_t stream) {
  const void* kernel = nullptr;
  if (cudaError_t e = prepare_kernel<T, kAligned>(&kernel); e != cudaSuccess) return e;
  const int64_t tiles_m = ceil_div(p.m, Cfg::kBM);
  const int64_t tiles_n = ceil_div(p.n, Cfg::kBN);
  // Tile ids (and the rasterization's products) are int on the device.
  if (tiles_m * tiles_n > INT32_MAX / 2 || Cfg::kGroupM * tiles_n > INT32_MAX / 2)
    return cudaErrorInvalidValue;
  // The fast loader steps between a thread's chunks with 32-bit byte strides.
  const bool fast_ok = (Cfg::kThreads / 8) * p.lda * 2 <= UINT32_MAX &&
                       (Cfg::kThreads / 32) * p.ldb * 2 <= UINT32_MAX;
  LaunchArgs args{p, 0, static_cast<int>(tiles_m), static_cast<int>(tiles_n), c_vectorizable(p),
                  fast_ok};
  for (int64_t z0 = 0; z0 < p.batch; z0 += kMaxGridZ) {
    args.z_base = z0;
    const dim3 grid(static_cast<unsigned>(tiles_m * tiles_n), 1,
                    static_cast<unsigned>(std::min<int64_t>(p.batch - z0, kMaxGridZ)));
    gemm_mma_pipeline_kernel<T, kAligned><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(args);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t gemm_mma_pipeline(const GemmParams& p, cudaStream_t stream) {
  const bool aligned = operands_aligned(p);
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return aligned ? launch<T, true>(p, stream) : launch<T, false>(p, stream);
  });
}

cudaError_t gemm_mma_pipeline_resources(const GemmParams& p, KernelResources* out) {
  const bool aligned = operands_aligned(p);
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    const void* kernel = nullptr;
    const char* name = aligned ? kernel_name<T, true>() : kernel_name<T, false>();
    if (cudaError_t e = aligned ? prepare_kernel<T, true>(&kernel) : prepare_kernel<T, false>(&kernel);
        e != cudaSuccess)
      return e;
    return describe_kernel(kernel, name, Cfg::kThreads, Cfg::kSmemBytes, out);
  });
}

}  // namespace optimized::cuda
