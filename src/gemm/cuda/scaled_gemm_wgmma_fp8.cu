// The Hopper rung of the scaled (fp8) GEMM: the persistent warp-specialized kernel of
// wgmma_persistent (gemm_wgmma_ws.cuh) rebuilt around fp8 wgmma (QGMMA), with the scales and
// the promotion of partial sums in the consumers.
//
//   * operands: A (M, K) row-major and B stored (N, K) (column-major B), both K-major: 8-bit wgmma
//     reads nothing else. A k-block is 128 fp8 values (one 128-byte swizzled row per M or N
//     index), so a stage is the same 128-byte rows as the 16-bit rungs' (WgmmaTile, kElemBytes 1).
//     Other layouts, and rows TMA cannot describe, are first copied K-major into the workspace
//     (to_k_major below: one pass over the operand, a transposing copy through shared memory).
//   * promotion: the tensor cores add fp8 products with about 14 bits of mantissa, which loses
//     accuracy over long K (DeepSeek-V3 measured ~2^-13 relative error at K = 4096). Each
//     consumer therefore accumulates one k-block (128 of K, four m64n128k32 steps) into a partial
//     accumulator that starts at zero, waits for it, and adds it into its fp32 total: two
//     accumulators of 64 registers each per thread, which is why the tile is 128 x 128 (a 64 x 256
//     warpgroup tile would need 256 accumulator registers). While one consumer promotes, the
//     other's wgmma keeps the tensor cores busy.
//   * block scales (1x128 for A, 128x128 for A or B) multiply the partial as it is promoted: the
//     k-block is exactly one scale block along K, a 128-row tile one block of A, a 128-column tile
//     one block of B. Per-tensor, per-row and per-column scales, and the bias, are applied once,
//     in the epilogue.
//   * clusters of 2 tiles along M share B through TMA multicast (half of B's boxes each), as in
//     wgmma_persistent: 24 KiB per k-block from L2 instead of 32.
//
//   block tile 128 x 128 x 128, 6 stages (192 KiB), producer + 2 consumers, persistent, cluster 2x1.
#include <cuda_fp8.h>

#include <string>
#include <type_traits>

#include "core/device_facts.h"
#include "core/tensor_map.h"
#include "gemm/cuda/gemm_wgmma_ws.cuh"
#include "gemm/cuda/scaled_common.cuh"
#include "gemm/launchers.h"
#include "gemm/scaled_params.h"

namespace optimized::cuda {
namespace {

constexpr int kConsumers = 2, kCluster = 2;
using Tile = kernels::WgmmaTile<128, 128, 6, 0, false, true, 1>;
using Scheduler = kernels::PersistentTiles<8, kCluster>;
using Shape = WgmmaWsShape<Tile, kConsumers>;

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
};

// The block-scale factor of k-block kb for the thread's two rows (row_lo, row_lo + 8, clamped to
// the matrix) of the tile at (tile_m, tile_n): 1 where neither operand has block scales.
__device__ __forceinline__ void block_factors(const Fp8Args& args, int kb, int row_lo, int tile_m, int tile_n,
                                              float* f0, float* f1) {
  float a0 = 1.0f, a1 = 1.0f, b = 1.0f;
  if (args.layout_a == ScaleLayout::kBlock1x128) {
    const int r0 = min(row_lo, args.m - 1), r1 = min(row_lo + 8, args.m - 1);
    a0 = __ldg(args.scale_a + int64_t(r0) * args.a_blocks_k + kb);
    a1 = __ldg(args.scale_a + int64_t(r1) * args.a_blocks_k + kb);
  } else if (args.layout_a == ScaleLayout::kBlock128x128) {
    // A cluster's second tile may lie past the last row block (an odd number of tile rows).
    a0 = a1 = __ldg(args.scale_a + int64_t(min(tile_m, (args.m - 1) / 128)) * args.a_blocks_k + kb);
  }
  if (args.layout_b == ScaleLayout::kBlock128x128) b = __ldg(args.scale_b + int64_t(kb) * args.b_blocks_n + tile_n);
  *f0 = a0 * b;
  *f1 = a1 * b;
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

// The epilogue of one consumer's 64 x 128 total at (m0, n0): outer scales (per tensor, row,
// column), bias, rounding to C's type, ragged edges skipped.
template <typename T>
__device__ __forceinline__ void store_tile(const float (&acc)[64], const Fp8Args& args, int m0, int n0) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const float ta = args.layout_a == ScaleLayout::kTensor ? __ldg(args.scale_a) : 1.0f;
  const float tb = args.layout_b == ScaleLayout::kTensor ? __ldg(args.scale_b) : 1.0f;
  T* c = static_cast<T*>(args.c);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + 16 * warp + lane / 4 + 8 * h;
    if (row >= args.m) continue;
    const float ra = ta * (args.layout_a == ScaleLayout::kRowwise ? __ldg(args.scale_a + row) : 1.0f);
    T* c_row = c + int64_t(row) * args.ldc;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = n0 + 8 * j + 2 * (lane % 4);
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int cc = min(col + e, args.n - 1);
        float s = ra * tb;
        if (args.layout_b == ScaleLayout::kRowwise) s *= __ldg(args.scale_b + cc);
        v[e] = acc[4 * j + 2 * h + e] * s;
        if (args.bias) v[e] += kernels::to_float(static_cast<const T*>(args.bias)[cc]);
      }
      if (args.c_pairs && col + 1 < args.n) {
        store_pair(c_row + col, v[0], v[1]);
      } else {
        if (col < args.n) c_row[col] = kernels::from_float<T>(v[0]);
        if (col + 1 < args.n) c_row[col + 1] = kernels::from_float<T>(v[1]);
      }
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
  const int warpgroup = threadIdx.x / 128;
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
  float total[64], partial[64];
  for (int i = 0; sched.next(i, &t); ++i) {
#pragma unroll
    for (int j = 0; j < 64; ++j) total[j] = 0.0f;
    const int row_lo = t.m * Tile::kBM + rows + 16 * warp + lane / 4;
    for (int kb = 0; kb < args.k_blocks; ++kb) {
      float f0, f1;  // loaded before the wait, used after the k-block's wgmma: their latency hides
      block_factors(args, kb, row_lo, t.m, t.n, &f0, &f1);
      kernels::ptx::mbarrier_wait(&ring.full[cur.stage], cur.phase);
      kernels::ptx::wgmma_fence();
      const unsigned char* a_rows = ring.a(cur.stage) + rows * 128;
      const unsigned char* b = ring.b(cur.stage);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        kernels::ptx::wgmma_m64n128k32(partial, kernels::ptx::make_smem_desc_k_major_sw128(a_rows + kk * 32),
                                       kernels::ptx::make_smem_desc_k_major_sw128(b + kk * 32), kk > 0 ? 1 : 0,
                                       QgmmaTag<FA>{}, QgmmaTag<FB>{});
      kernels::ptx::wgmma_commit();
      kernels::ptx::wgmma_wait<0>();
      kernels::ptx::wgmma_hold(partial);
      if (releaser) release<kCluster>(&ring.empty[cur.stage]);
      cur.advance();
      // Promotion: the k-block's partial sums into the fp32 totals, times the block scales.
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        total[4 * j + 0] = fmaf(partial[4 * j + 0], f0, total[4 * j + 0]);
        total[4 * j + 1] = fmaf(partial[4 * j + 1], f0, total[4 * j + 1]);
        total[4 * j + 2] = fmaf(partial[4 * j + 2], f1, total[4 * j + 2]);
        total[4 * j + 3] = fmaf(partial[4 * j + 3], f1, total[4 * j + 3]);
      }
    }
    store_tile<T>(total, args, t.m * Tile::kBM + rows, t.n * Tile::kBN);
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
  c.a = !p.a_k_major() || !tma_rejects({p.a, p.m, p.k, p.a_ld(), 1, 0, 1}, "a").empty();
  c.b = !p.b_k_major() || !tma_rejects({p.b, p.n, p.k, p.b_ld(), 1, 0, 1}, "b").empty();
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
  if (cudaError_t e = make_tma_map_sw128(&map_a, {a, p.m, p.k, lda, 1, 0, 1}, 128, Tile::kBM); e != cudaSuccess)
    return e;
  if (cudaError_t e = make_tma_map_sw128(&map_b, {b, p.n, p.k, ldb, 1, 0, 1}, 128, 64); e != cudaSuccess) return e;
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
  const Scheduler sched{static_cast<int>(ceil_div(p.m, int64_t(Tile::kBM))),
                        static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN))), 1, 1};
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
        "scaled_gemm_wgmma_fp8<128x128x128, 6 stages, producer + 2 consumers, cluster 2x1, promotion every 128 K>";
    return describe_kernel(kernel, name.c_str(), Shape::kThreads, Tile::kSmemBytes, out);
  });
}

}  // namespace optimized::cuda
