// The Hopper rung of the scaled (fp8) GEMM: the persistent warp-specialized kernel of
// wgmma_persistent (gemm_wgmma_ws.cuh) rebuilt around fp8 wgmma (QGMMA), with the scales and
// the promotion of partial sums in the consumers.
//
//   * operands: A (M, K) row-major and B stored (N, K) (column-major B), both K-major: 8-bit wgmma
//     reads nothing else. A k-block is 128 fp8 values (one 128-byte swizzled row per M or N
//     index), so a stage is the same 128-byte rows as the 16-bit rungs' (WgmmaTile, kElemBytes 1).
//     Other layouts, and rows TMA cannot describe, are first copied K-major into the workspace
//     (to_k_major below: one pass over the operand, a transposing copy through shared memory).
//   * tile 128 x 256: each consumer warpgroup owns 64 rows x 256 columns, 128 fp32 totals per
//     thread. Per stage a block brings A (16 KiB) and half of B (16 KiB; the cluster peer
//     multicasts the other half): 32 KiB of L2 traffic per 8.4 MFLOP, against 24 KiB per 4.2 MFLOP
//     of a 128 x 128 tile (1.5x fewer bytes per FLOP: ~5.7 TB/s from L2 at 1450 TFLOP/s instead of
//     ~8.5), and wgmma reads 96 instead of 128 bytes of shared memory per 64 columns x 32 K.
//   * promotion: the tensor cores add fp8 products with about 14 bits of mantissa, which loses
//     accuracy over long K (DeepSeek-V3 measured ~2^-13 relative error at K = 4096). Each consumer
//     therefore multiplies a k-block (128 of K) one 128-column half at a time: four m64n128k32
//     steps into a 64-register partial that starts at zero (one wgmma group), waits for it, and
//     adds it into its fp32 totals. 128 totals + 64 partials fit the consumers' 232 registers; two
//     partials (one in flight while the other is promoted) would not, so the overlap comes from
//     the other consumer: its group runs on the tensor cores while this one waits for and promotes
//     its own. (Passing turns between the consumers with named barriers, to force that order,
//     measured the same on the H100: they already interleave; docs/perf-notes/gemm.md.)
//   * block scales (1x128 for A, 128x128 for A or B) multiply the partial as it is promoted: the
//     k-block is exactly one scale block along K, a 128-row tile one block of A, a 128-column half
//     one block of B (its own block column: 2 * tile column + half). They are loaded one k-block
//     ahead, so their latency hides behind a whole k-block of math. Per-tensor, per-row and
//     per-column scales, and the bias, are applied once, in the epilogue.
//   * clusters of 2 tiles along M share B through TMA multicast (two of B's four 64-row boxes
//     each), as in wgmma_persistent.
//
//   block tile 128 x 256 x 128, 4 stages (192 KiB), producer + 2 consumers (64 x 256 each, in two
//   128-column wgmma groups), persistent, cluster 2x1.
#include <cuda_fp8.h>

#include <string>
#include <type_traits>

#include "core/device_facts.h"
#include "core/tensor_map.h"
#include "gemm/cuda/gemm_wgmma_ws.cuh"
#include "gemm/cuda/scaled_common.cuh"
#include "gemm/launchers.h"
#include "gemm/scaled_params.h"
#include "kernels/epilogue/fused_epilogue.cuh"

namespace optimized::cuda {
namespace {

constexpr int kConsumers = 2, kCluster = 2;
using Tile = kernels::WgmmaTile<128, 256, 4, 0, false, true, 1>;  // (BLK_M, BLK_N, stages): BLK_K 128
// Groups of 16 tile rows: a wave of 132 tiles 128 x 256 covers ~16 x 8 of them (2048 rows of A,
// ~2100 columns of B) rather than 8 x 16 (1024 x ~4200): fewer distinct bytes in L2 at a time.
using Scheduler = kernels::PersistentTiles<16, kCluster>;
using Shape = WgmmaWsShape<Tile, kConsumers>;
constexpr int kHalfN = 128;                    // columns per wgmma group and per promotion
constexpr int kHalves = Tile::kBN / kHalfN;    // 2
constexpr int kTotals = Tile::kBN / 2;         // 128 fp32 totals per consumer thread (64 x 256)
constexpr int kPartials = kHalfN / 2;          // 64 fp32 partials (64 x 128)
static_assert(Tile::kBK == 128, "a k-block is one 128-wide scale block along K");
static_assert(Tile::kBM == 128, "a tile row is one 128-row scale block of A");
static_assert(kHalfN == 128 && Tile::kBN % kHalfN == 0, "a half is one 128-column scale block of B");
static_assert(Tile::kSmemBytes <= 227 * 1024, "the ring fits one block's shared memory");

// What the kernel takes besides the maps.
struct Fp8Args {
  void* c;
  int m, n, k_blocks;
  int64_t ldc;
  bool c_pairs;  // two neighbouring elements of C form one aligned access
  const float* scale_a;
  const float* scale_b;
  ScaleLayout layout_a, layout_b;
  int a_blocks_k;  // ceil(K / 128): scales per row of A's block layouts, and rows of B's 128x128
  int b_blocks_n;  // ceil(N / 128): scales per row of B's 128x128 layout
  const void* bias;
  int epilogue;     // -1: bias only; else optimized::Activation, with beta and aux
  void* aux;        // pre (before the activation), rows ld_aux apart; null: none
  int64_t ld_aux;
  bool aux_pairs;   // as c_pairs, for aux
  float beta;       // 0: C is not read
};

// Where a consumer thread's block scales are, fixed for a tile: its two rows (row_lo, row_lo + 8,
// clamped to the matrix), the tile's row block of A (clamped: a cluster's second tile may lie past
// the last row block) and the first of its two column blocks of B.
struct ScaleSite {
  int r0, r1;
  int a_block;
  int b_block;
};

// The block scales of one k-block: A's for the thread's two rows, B's for each half of the tile; 1
// where the operand has no block scales.
struct KScales {
  float a0, a1;
  float b[kHalves];
};

__device__ __forceinline__ KScales load_kscales(const Fp8Args& args, const ScaleSite& at, int kb) {
  KScales s;
  s.a0 = s.a1 = 1.0f;
  if (args.layout_a == ScaleLayout::kBlock1x128) {
    s.a0 = __ldg(args.scale_a + int64_t(at.r0) * args.a_blocks_k + kb);
    s.a1 = __ldg(args.scale_a + int64_t(at.r1) * args.a_blocks_k + kb);
  } else if (args.layout_a == ScaleLayout::kBlock128x128) {
    s.a0 = s.a1 = __ldg(args.scale_a + int64_t(at.a_block) * args.a_blocks_k + kb);
  }
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    s.b[h] = 1.0f;
    // The second half of the last tile column may lie past N (no block of its own): clamped.
    if (args.layout_b == ScaleLayout::kBlock128x128)
      s.b[h] = __ldg(args.scale_b + int64_t(kb) * args.b_blocks_n + min(at.b_block + h, args.b_blocks_n - 1));
  }
  return s;
}

template <typename T>
__device__ __forceinline__ void store_pair(T* c, float v0, float v1) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float2*>(c) = make_float2(v0, v1);
  } else {
    uint32_t packed;
    T* pv = reinterpret_cast<T*>(&packed);
    pv[0] = kernels::from_float<T>(v0);
    pv[1] = kernels::from_float<T>(v1);
    *reinterpret_cast<uint32_t*>(c) = packed;
  }
}

// Two neighbouring elements of a row (the second only when col + 1 < n): one access when `pairs`.
template <typename T>
__device__ __forceinline__ void store_two(T* row, int col, int n, bool pairs, float v0, float v1) {
  if (pairs && col + 1 < n) {
    store_pair(row + col, v0, v1);
  } else {
    row[col] = kernels::from_float<T>(v0);
    if (col + 1 < n) row[col + 1] = kernels::from_float<T>(v1);
  }
}

// The epilogue of one consumer's 64 x kN total at (m0, n0) (the m64nNk32 accumulator layout: d[4j +
// 2h + e] is row 16 warp + lane/4 + 8h, column 8j + 2 (lane%4) + e): outer scales (per tensor, row,
// column), bias, and with kAct >= 0 beta * C, aux = that value, C = activation kAct of it; each
// rounded to C's type, ragged edges skipped. A column's scale and bias are loaded once for the
// thread's two rows.
//
// Code size: the plain epilogue (kAct < 0) is unrolled over the 32 column groups, as it always was.
// The full one walks them in a loop of 4 groups a trip, the totals shifted down 16 registers after
// each (register moves: the array stays in registers), so that its code stays small: unrolled 64
// values deep with an activation inline, the epilogue is thousands of instructions that every
// tile fetches once, and it measured ~1 ms of instruction fetch at 4096 x 16384 x 4096 (a runtime
// activation switch per value inside that unrolled code made even the plain GEMM 2.4x slower).
// kAct is a template argument for the same reason: one activation's code per instance.
template <typename T, int kN, int kAct>
__device__ __forceinline__ void store_tile(float (&acc)[kN / 2], const Fp8Args& args, int m0, int n0) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const float ta = args.layout_a == ScaleLayout::kTensor ? __ldg(args.scale_a) : 1.0f;
  const float tb = args.layout_b == ScaleLayout::kTensor ? __ldg(args.scale_b) : 1.0f;
  T* c = static_cast<T*>(args.c);
  T* aux = kAct >= 0 ? static_cast<T*>(args.aux) : nullptr;
  const T* bias = static_cast<const T*>(args.bias);
  int row[2];
  float rs[2];  // the row's scale: per tensor times per row
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row[h] = m0 + 16 * warp + lane / 4 + 8 * h;
    rs[h] = ta * (args.layout_a == ScaleLayout::kRowwise ? __ldg(args.scale_a + min(row[h], args.m - 1)) : 1.0f);
  }
  // Column group j (8 columns of the tile), d: its 4 totals (d[2h + e]).
  const auto group = [&](int j, const float* d) {
    const int col = n0 + 8 * j + 2 * (lane % 4);
    if (col >= args.n) return;
    float cs[2], cb[2];  // the columns' scales (per column of B) and bias
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int cc = min(col + e, args.n - 1);
      cs[e] = args.layout_b == ScaleLayout::kRowwise ? __ldg(args.scale_b + cc) : 1.0f;
      cb[e] = bias ? kernels::to_float(bias[cc]) : 0.0f;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] >= args.m) continue;
      T* c_row = c + int64_t(row[h]) * args.ldc;
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float s = rs[h] * tb;
        if (args.layout_b == ScaleLayout::kRowwise) s *= cs[e];
        v[e] = d[2 * h + e] * s;
        if (bias) v[e] += cb[e];
        if (kAct >= 0 && args.beta != 0.0f) v[e] += args.beta * kernels::to_float(c_row[min(col + e, args.n - 1)]);
      }
      if (aux) store_two(aux + int64_t(row[h]) * args.ld_aux, col, args.n, args.aux_pairs, v[0], v[1]);
      if constexpr (kAct > 0) {
        v[0] = kernels::activate(kAct, v[0]);
        v[1] = kernels::activate(kAct, v[1]);
      }
      store_two(c_row, col, args.n, args.c_pairs, v[0], v[1]);
    }
  };
  if constexpr (kAct < 0) {
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) group(j, acc + 4 * j);
  } else {
    constexpr int kGroups = 4;  // column groups a trip: 16 totals
#pragma unroll 1
    for (int j0 = 0; j0 < kN / 8; j0 += kGroups) {
#pragma unroll
      for (int jj = 0; jj < kGroups; ++jj) group(j0 + jj, acc + 4 * jj);
#pragma unroll
      for (int i = 0; i + 4 * kGroups < kN / 2; ++i) acc[i] = acc[i + 4 * kGroups];
    }
  }
}

// The QGMMA operand tag of an fp8 storage type.
template <typename F8>
using QgmmaTag = std::conditional_t<std::is_same_v<F8, __nv_fp8_e5m2>, kernels::ptx::E5m2Tag, kernels::ptx::E4m3Tag>;

template <typename FA, typename FB, typename T>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    scaled_gemm_wgmma_fp8_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                 const Fp8Args args, const Scheduler sched) {
  extern __shared__ unsigned char smem[];
  const auto ring = kernels::WgmmaRing<Tile>::carve(smem);
  // The same in every lane (the shuffle tells the compiler so: what derives from it may live in
  // uniform registers).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  if (threadIdx.x == 0) {
    kernels::ptx::tma_prefetch_descriptor(&map_a);
    kernels::ptx::tma_prefetch_descriptor(&map_b);
    ring.init(kConsumers * 4 * kCluster);
  }
  kernels::ptx::cluster_sync();

  kernels::RingCursor<Tile::kStages> cur;
  kernels::ScheduledTile t;
  if (warpgroup == 0) {
    kernels::ptx::setmaxnreg_dec<Shape::kProducerRegs>();
    if (threadIdx.x == 0) {
      const int rank = static_cast<int>(kernels::ptx::cluster_block_rank());
      for (int i = 0; sched.next(i, &t); ++i) {
        const int m0 = t.m * Tile::kBM, n0 = t.n * Tile::kBN;
        for (int kb = 0; kb < args.k_blocks; ++kb) {
          kernels::ptx::mbarrier_wait(&ring.empty[cur.stage], cur.phase ^ 1);
          kernels::wgmma_load_kblock<Tile, kCluster>(ring, cur.stage, &map_a, &map_b, m0, n0, kb * Tile::kBK, 0, 0,
                                                     rank);
          cur.advance();
        }
      }
    }
    __syncwarp();
    kernels::ptx::cluster_sync();
    return;
  }

  kernels::ptx::setmaxnreg_inc<Shape::kConsumerRegs>();
  const int rows = 64 * (warpgroup - 1);  // this consumer's rows of the tile
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const bool releaser = lane == 0;

  float total[kTotals], partial[kPartials];
  for (int i = 0; sched.next(i, &t); ++i) {
#pragma unroll
    for (int j = 0; j < kTotals; ++j) total[j] = 0.0f;
    const int row_lo = t.m * Tile::kBM + rows + 16 * warp + lane / 4;
    const ScaleSite site{min(row_lo, args.m - 1), min(row_lo + 8, args.m - 1), min(t.m, (args.m - 1) / 128),
                         t.n * kHalves};
    KScales next = load_kscales(args, site, 0);
    for (int kb = 0; kb < args.k_blocks; ++kb) {
      // This k-block's scales arrived during the previous one; the next k-block's load now.
      const KScales s = next;
      next = load_kscales(args, site, min(kb + 1, args.k_blocks - 1));
      kernels::ptx::mbarrier_wait(&ring.full[cur.stage], cur.phase);
      // The descriptors of this consumer's A rows and of B's first row; a k-step moves 32 bytes
      // along the rows and a half 128 rows of 128 bytes down (descriptor addresses count 16 bytes:
      // adding to the start-address field, whose 14 bits hold every shared-memory address).
      const uint64_t desc_a = kernels::ptx::make_smem_desc_k_major_sw128(ring.a(cur.stage) + rows * 128);
      const uint64_t desc_b = kernels::ptx::make_smem_desc_k_major_sw128(ring.b(cur.stage));
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
        kernels::ptx::wgmma_fence();  // the previous promotion's reads of `partial` come first
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)  // (64 x 32) x (32 x 128): A's rows, B's rows of half h
          kernels::ptx::wgmma_m64n128k32(partial, desc_a + (kk * 32) / 16,
                                         desc_b + (h * kHalfN * 128 + kk * 32) / 16, kk > 0 ? 1 : 0,
                                         QgmmaTag<FA>{}, QgmmaTag<FB>{});
        kernels::ptx::wgmma_commit();
        kernels::ptx::wgmma_wait<0>();
        kernels::ptx::wgmma_hold(partial);
        // The stage is free once this consumer's last group on it has completed.
        if (h == kHalves - 1 && releaser) release<kCluster>(&ring.empty[cur.stage]);
        // Promotion: the half's partial sums into the fp32 totals, times the block scales.
        const float f0 = s.a0 * s.b[h], f1 = s.a1 * s.b[h];
#pragma unroll
        for (int j = 0; j < kPartials / 4; ++j) {
          float* tot = total + h * kPartials + 4 * j;
          tot[0] = fmaf(partial[4 * j + 0], f0, tot[0]);
          tot[1] = fmaf(partial[4 * j + 1], f0, tot[1]);
          tot[2] = fmaf(partial[4 * j + 2], f1, tot[2]);
          tot[3] = fmaf(partial[4 * j + 3], f1, tot[3]);
        }
      }
      cur.advance();
    }
    // The epilogue's instance: bias only (-1), or beta / aux / the activation (uniform over the grid).
    const int m0 = t.m * Tile::kBM + rows, n0 = t.n * Tile::kBN;
    switch (args.epilogue) {
      case -1: store_tile<T, Tile::kBN, -1>(total, args, m0, n0); break;
      case kernels::kActRelu: store_tile<T, Tile::kBN, kernels::kActRelu>(total, args, m0, n0); break;
      case kernels::kActGeluErf: store_tile<T, Tile::kBN, kernels::kActGeluErf>(total, args, m0, n0); break;
      case kernels::kActGeluTanh: store_tile<T, Tile::kBN, kernels::kActGeluTanh>(total, args, m0, n0); break;
      case kernels::kActSilu: store_tile<T, Tile::kBN, kernels::kActSilu>(total, args, m0, n0); break;
      default: store_tile<T, Tile::kBN, kernels::kActNone>(total, args, m0, n0); break;
    }
  }
  kernels::ptx::cluster_sync();
}

// ---- host ---------------------------------------------------------------------------------------

// The K-major copy of an operand: rows x k, element (r, kk) read at src[r * rs + kk * cs], written
// to dst[r * ld + kk]. 32 x 32 tiles through shared memory, so that both the reads (along the
// source's unit-stride dimension, whichever it is) and the writes (along K) are coalesced.
__global__ void to_k_major(const uint8_t* src, int64_t rs, int64_t cs, int64_t rows, int64_t k, uint8_t* dst,
                           int64_t ld) {
  __shared__ uint8_t tile[32][33];
  const int64_t k0 = int64_t(blockIdx.x) * 32;
  const bool k_fast = cs == 1;  // the source's unit stride runs along K
  // Row tiles in a grid-stride loop (grid.y stops at 65535).
  for (int64_t r0 = int64_t(blockIdx.y) * 32; r0 < rows; r0 += int64_t(gridDim.y) * 32) {
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
      // k_fast: lanes walk K; otherwise lanes walk the rows.
      const int64_t r = r0 + (k_fast ? i : threadIdx.x), kk = k0 + (k_fast ? threadIdx.x : i);
      if (r < rows && kk < k) tile[k_fast ? i : threadIdx.x][k_fast ? threadIdx.x : i] = src[r * rs + kk * cs];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
      const int64_t r = r0 + i, kk = k0 + threadIdx.x;
      if (r < rows && kk < k) dst[r * ld + kk] = tile[i][threadIdx.x];
    }
    __syncthreads();
  }
}

int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }
size_t round256(size_t x) { return (x + 255) / 256 * 256; }

// Which operands need a K-major copy: a layout that is not K-major, or rows TMA cannot describe.
struct Copies {
  bool a = false, b = false;
  size_t b_offset = 0, bytes = 0;
};

Copies copies_for(const ScaledGemmParams& p) {
  Copies c;
  c.a = !p.a_k_major() || !tma_rejects(TmaMatrix{p.a, p.m, p.k, p.a_ld(), 1, 0, 1}, "a").empty();
  c.b = !p.b_k_major() || !tma_rejects(TmaMatrix{p.b, p.n, p.k, p.b_ld(), 1, 0, 1}, "b").empty();
  c.b_offset = c.a ? round256(static_cast<size_t>(p.m * round16(p.k))) : 0;
  c.bytes = c.b_offset + (c.b ? round256(static_cast<size_t>(p.n * round16(p.k))) : 0);
  return c;
}

template <typename FA, typename FB, typename T>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&scaled_gemm_wgmma_fp8_kernel<FA, FB, T>);
}

}  // namespace

cudaError_t scaled_gemm_wgmma_fp8_workspace(const ScaledGemmParams& p, size_t* bytes) {
  *bytes = copies_for(p).bytes;
  return cudaSuccess;
}

cudaError_t scaled_gemm_wgmma_fp8(const ScaledGemmParams& p, const Workspace& workspace, cudaStream_t stream) {
  // K-major copies where needed, at the front of the workspace.
  const Copies cp = copies_for(p);
  if (cp.bytes > 0 && (workspace.data == nullptr || workspace.bytes < cp.bytes)) return cudaErrorInvalidValue;
  const void* a = p.a;
  const void* b = p.b;
  int64_t lda = p.a_ld(), ldb = p.b_ld();
  const dim3 copy_block(32, 8);
  if (cp.a) {
    auto* dst = static_cast<uint8_t*>(workspace.data);
    lda = round16(p.k);
    to_k_major<<<dim3(static_cast<unsigned>(ceil_div(p.k, int64_t(32))),
                      static_cast<unsigned>(std::min<int64_t>(ceil_div(p.m, int64_t(32)), kMaxGridY))),
                 copy_block, 0, stream>>>(static_cast<const uint8_t*>(p.a), p.a_row_stride, p.a_col_stride, p.m, p.k,
                                          dst, lda);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    a = dst;
  }
  if (cp.b) {
    auto* dst = static_cast<uint8_t*>(workspace.data) + cp.b_offset;
    ldb = round16(p.k);
    // B's columns are the rows of the K-major copy: element (j, kk) = B(kk, j).
    to_k_major<<<dim3(static_cast<unsigned>(ceil_div(p.k, int64_t(32))),
                      static_cast<unsigned>(std::min<int64_t>(ceil_div(p.n, int64_t(32)), kMaxGridY))),
                 copy_block, 0, stream>>>(static_cast<const uint8_t*>(p.b), p.b_col_stride, p.b_row_stride, p.n, p.k,
                                          dst, ldb);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    b = dst;
  }
  CUtensorMap map_a, map_b;
  if (cudaError_t e = make_tma_map_sw128(&map_a, TmaMatrix{a, p.m, p.k, lda, 1, 0, 1}, 128, Tile::kBM); e != cudaSuccess)
    return e;
  if (cudaError_t e = make_tma_map_sw128(&map_b, TmaMatrix{b, p.n, p.k, ldb, 1, 0, 1}, 128, 64); e != cudaSuccess) return e;
  Fp8Args args;
  args.c = p.c;
  args.m = static_cast<int>(p.m);
  args.n = static_cast<int>(p.n);
  args.k_blocks = static_cast<int>(ceil_div(p.k, int64_t(Tile::kBK)));
  args.ldc = p.ldc;
  const int64_t pair_bytes = 2 * static_cast<int64_t>(dtype_size(p.c_dtype));
  args.c_pairs = reinterpret_cast<uintptr_t>(p.c) % pair_bytes == 0 && p.ldc % 2 == 0;
  args.scale_a = p.scale_a;
  args.scale_b = p.scale_b;
  args.layout_a = p.scale_a_layout;
  args.layout_b = p.scale_b_layout;
  args.a_blocks_k = static_cast<int>(ceil_div(p.k, int64_t(128)));
  args.b_blocks_n = static_cast<int>(ceil_div(p.n, int64_t(128)));
  args.bias = p.bias;
  args.epilogue = p.activation == 0 && !p.aux && p.beta == 0.0f ? -1 : p.activation;
  args.aux = p.aux;
  args.ld_aux = p.ld_aux;
  args.aux_pairs = reinterpret_cast<uintptr_t>(p.aux) % pair_bytes == 0 && p.ld_aux % 2 == 0;
  args.beta = p.beta;
  const Scheduler sched{static_cast<int>(ceil_div(p.m, int64_t(Tile::kBM))),
                        static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN))), 1, 1};
  if (!sched.fits()) return cudaErrorInvalidConfiguration;
  return dispatch_scaled_dtypes(p, [&]<typename FA, typename FB, typename T>() -> cudaError_t {
    if (cudaError_t e = cudaFuncSetAttribute(kernel_ptr<FA, FB, T>(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             Tile::kSmemBytes);
        e != cudaSuccess)
      return e;
    ClusterLaunch grid(kCluster, Shape::kThreads, Tile::kSmemBytes, stream);
    if (cudaError_t e = grid.size_grid(kernel_ptr<FA, FB, T>(), sched.total()); e != cudaSuccess) return e;
    return cudaLaunchKernelEx(&grid.config, &scaled_gemm_wgmma_fp8_kernel<FA, FB, T>, map_a, map_b, args, sched);
  });
}

cudaError_t scaled_gemm_wgmma_fp8_resources(const ScaledGemmParams& p, KernelResources* out) {
  return dispatch_scaled_dtypes(p, [&]<typename FA, typename FB, typename T>() -> cudaError_t {
    const void* kernel = kernel_ptr<FA, FB, T>();
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
        e != cudaSuccess)
      return e;
    static const std::string name =
        "scaled_gemm_wgmma_fp8<128x256x128, 4 stages, producer + 2 consumers (64x256, two 128-column wgmma groups), "
        "cluster 2x1, promotion every 128 K>";
    return describe_kernel(kernel, name.c_str(), Shape::kThreads, Tile::kSmemBytes, out);
  });
}

}  // namespace optimized::cuda
