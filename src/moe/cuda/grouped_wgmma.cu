// The grouped GEMM's Hopper rung (sm_90a): the warp-specialized wgmma mainloop of the GEMM family
// (kernels/gemm/wgmma_mainloop.cuh: TMA into a 4-stage ring on mbarriers, a producer warpgroup and
// two consumer warpgroups of 64 x 256 accumulators each, setmaxnreg) under a persistent scheduler over
// the tiles of every group (kernels/sched/ragged_tiles.cuh), in one launch whose offsets never leave
// the device: a CUDA graph can hold it, and an empty group costs nothing.
//
//   forward       out rows [b_g, e_g) = x rows [b_g, e_g) @ w[g]: tiles of 128 rows x 256 columns
//                 from each group's first row; A's TMA box starts at the group's row (any row: TMA
//                 takes any coordinate), B's is batch g of w's 3-D map (w row-major (K, N) per group,
//                 or column-major: the backward's w^T). The rows of a tile past the group's end are
//                 computed from the next group's rows and not stored; rows past the last group are a
//                 tail of tiles with no k-blocks, stored as zeros.
//   SwiGLU        the forward with w[g] = [gate | up] (K, 2F): a tile's 256 columns are 128 of gate and
//                 the same 128 of up (the producer points B's four boxes at columns n0, n0 + 64, F + n0,
//                 F + n0 + 64), so each thread holds gate and up of the same outputs and stores
//                 silu(gate) * up (out (M, F)), and the pre-activations (pre (M, 2F)) for the backward.
//                 F is a multiple of 8 (grouped_gemm.cpp refuses others): the up boxes start at column F,
//                 and a box whose start is not on a 16-byte boundary was an illegal instruction on the H100.
//   weight grad   dw[g] (K, N) = x[b_g:e_g]^T @ dout[b_g:e_g]: tiles of dw, reduced over the group's
//                 rows in k-blocks of 64 from b_g; the last k-block's rows past e_g (the next group's
//                 tokens, or anything) are zeroed in shared memory by the consumers before the wgmma,
//                 since TMA only zero-fills past the tensor's edge. An empty group's tiles have no
//                 k-blocks and store zeros (none with accumulate).
//
// Epilogues: a consumer's 64 rows wholly inside the group leave by TMA stores through two staging chunks
// (16-bit outputs TMA can describe); the rows of a group's last, partial tile leave from registers
// (kernels/epilogue/wgmma_store.cuh), row-limited, since a TMA store would write the next group's rows.
// The weight gradient's tiles leave by TMA stores into dw's batch g (TMA clips them at dw's edges) when dw
// is 16-bit and written, from registers otherwise (fp32, accumulating).
#include <cuda.h>

#include <algorithm>
#include <type_traits>

#include "core/device_facts.h"
#include "core/tensor_map.h"
#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/epilogue/alpha_beta.cuh"
#include "kernels/epilogue/wgmma_store.cuh"
#include "kernels/gemm/wgmma_mainloop.cuh"
#include "kernels/math.cuh"
#include "kernels/ptx/smem.cuh"
#include "kernels/sched/ragged_tiles.cuh"
#include "moe/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;

enum class Mode { kForward, kSwiglu, kWeightGrad };

constexpr int kConsumers = 2, kStages = 4;
constexpr int kThreads = 128 * (kConsumers + 1);
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536, "the register file of one SM");
constexpr int kZeroBarrier = 1;  // the consumers' named barrier after zeroing a k-block's tail

// The TMA-store epilogue's staging: per consumer two 64 x 64 chunks of 16-bit output (8 KiB each), so that
// one chunk is written while the other's store still reads it.
constexpr int kChunkBytes = 64 * 128;
constexpr int kStagingBytes = kConsumers * 2 * kChunkBytes;
template <Mode kMode, bool kTransB>
using TileOf = WgmmaTile<128, 256, kStages, kStagingBytes, kMode == Mode::kWeightGrad, kTransB>;
using Sched = RaggedTiles<128>;

struct Args {
  void* c;
  int64_t ldc, c_gs;  // forward: out rows ldc apart; weight grad: dw[g] at g c_gs, rows ldc apart
  void* pre;          // SwiGLU: the pre-activations (M, 2F), rows ld_pre apart, or null
  int64_t ld_pre;
  int n;              // forward: out's columns; weight grad: dw's columns
  int f;              // SwiGLU: F
  int k_blocks;       // forward: ceil(K / 64)
  int out_rows;       // weight grad: K (dw's rows)
  float beta;         // weight grad: 1 to accumulate into dw
  bool pairs;         // two neighbouring columns of every output are one aligned access
  bool c_tma;         // forward: out (and pre) have TMA maps; a consumer's 64 rows wholly inside the group
                      // leave by TMA stores
};

// A consumer warpgroup's 64 rows x 64 (kQ1 - kQ0) columns by TMA: chunk q (64 columns) holds the
// fragment values value(i) of n8 blocks 8q .. 8q + 7 (wgmma's layout), staged swizzled in one of the two
// staging chunks (alternating: an even number of chunks per call keeps the alternation across calls),
// stored at (col(q), row0) of map. Before a chunk is rewritten, the store that read it two stores ago has
// finished reading (bulk_wait_group_read<1>).
template <typename T, int kQ0, int kQ1, typename Value, typename Col>
__device__ __forceinline__ void tma_store_chunks(const Value& value, const Col& col, unsigned char* staging,
                                                 const CUtensorMap* map, int row0, int barrier, int z = 0) {
  static_assert((kQ1 - kQ0) % 2 == 0, "an even number of chunks");
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const bool leader = threadIdx.x % 128 == 0;
#pragma unroll
  for (int q = kQ0; q < kQ1; ++q) {
    unsigned char* chunk = staging + ((q - kQ0) % 2) * kChunkBytes;
    if (leader) ptx::bulk_wait_group_read<1>();
    ptx::named_barrier_sync(barrier, 128);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int j = 8 * q + u;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        stage_pair_sw128<T>(chunk, 16 * warp + lane / 4 + 8 * h, u, lane, value(4 * j + 2 * h), value(4 * j + 2 * h + 1));
    }
    ptx::fence_proxy_async_shared();  // the writes, before the TMA unit reads them
    ptx::named_barrier_sync(barrier, 128);
    if (leader) {
      ptx::tma_store_3d(map, chunk, col(q), row0, z);
      ptx::bulk_commit_group();
    }
  }
}

// The weight gradient's last k-block of a group holds `valid` < 64 rows of the group: every box of the
// stage (A's two, B's four, each 64 token rows of 128 bytes) gets rows [valid, 64) zeroed. A whole
// 128-byte row is zeroed, which the 128-byte swizzle (a permutation inside each row) leaves in place.
// The 256 consumer threads share the stores, then fence them to the async proxy (wgmma reads through
// it) and meet on a named barrier.
template <typename Tile>
__device__ __forceinline__ void zero_tail_rows(unsigned char* stage, int valid) {
  constexpr int kBoxes = Tile::kStageBytes / Tile::kBoxBytes;
  const int per_box = (64 - valid) * 8;  // 16-byte units
  const int tid = static_cast<int>(threadIdx.x) - 128;
  const uint32_t base = ptx::smem_u32(stage);
  for (int u = tid; u < kBoxes * per_box; u += 128 * kConsumers) {
    const int box = u / per_box, r = u - box * per_box;
    const uint32_t addr = base + box * Tile::kBoxBytes + (valid + r / 8) * 128 + (r % 8) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(kZeroBarrier, 128 * kConsumers);
}

// SwiGLU's store of a consumer's 64 rows: accumulator columns 0..127 are gate, 128..255 up, of the
// same 128 outputs from n0.
template <typename TC>
__device__ __forceinline__ void store_swiglu(const float (&acc)[128], const Args& a, int64_t m0, int rows_left, int n0) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row0 = 16 * warp + lane / 4, col0 = 2 * (lane % 4);
  TC* out = static_cast<TC*>(a.c);
  TC* pre = static_cast<TC*>(a.pre);
  const auto put = [&](TC* p, float v0, float v1, bool both) {
    if (both && a.pairs) {
      uint32_t w;
      TC* wv = reinterpret_cast<TC*>(&w);
      wv[0] = from_float<TC>(v0);
      wv[1] = from_float<TC>(v1);
      *reinterpret_cast<uint32_t*>(p) = w;
    } else {
      p[0] = from_float<TC>(v0);
      if (both) p[1] = from_float<TC>(v1);
    }
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + 8 * h;
    if (row >= rows_left) continue;
    TC* orow = out + (m0 + row) * a.ldc;
    TC* prow = pre ? pre + (m0 + row) * a.ld_pre : nullptr;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = n0 + 8 * j + col0;
      if (col >= a.f) continue;
      const bool both = col + 1 < a.f;
      const float g0 = acc[4 * j + 2 * h], g1 = acc[4 * j + 2 * h + 1];
      const float u0 = acc[4 * (j + 16) + 2 * h], u1 = acc[4 * (j + 16) + 2 * h + 1];
      put(orow + col, silu(g0) * u0, silu(g1) * u1, both);
      if (prow) {
        put(prow + col, g0, g1, both);
        put(prow + a.f + col, u0, u1, both);
      }
    }
  }
}

template <typename T, typename TC, Mode kMode, bool kTransB>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                         const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_pre,
                         const Args args, const Sched sched) {
  using Tile = TileOf<kMode, kTransB>;
  constexpr bool kWgrad = kMode == Mode::kWeightGrad;
  extern __shared__ unsigned char smem[];
  const auto ring = WgmmaRing<Tile>::carve(smem);
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    ptx::tma_prefetch_descriptor(&map_a);
    ptx::tma_prefetch_descriptor(&map_b);
    ring.init(kConsumers * 4);  // empty once every consumer warp released it
  }
  __syncthreads();

  // The k-blocks of a tile: the forward's K, or the weight gradient's rows of the group.
  const auto k_blocks = [&](const RaggedTile& t) {
    if constexpr (kWgrad) return (t.end - t.begin + 63) / 64;
    else return t.g < sched.groups ? args.k_blocks : 0;
  };

  RingCursor<kStages> cur;
  Sched::Cursor walk;
  RaggedTile t;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      for (int i = 0; sched.next(static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x), &walk, &t); ++i) {
        const int kbs = k_blocks(t);
        for (int kb = 0; kb < kbs; ++kb) {
          ptx::mbarrier_wait(&ring.empty[cur.stage], cur.phase ^ 1);
          uint64_t* full = &ring.full[cur.stage];
          ptx::mbarrier_arrive_expect_tx(full, Tile::kStageBytes);
          if constexpr (kWgrad) {
            // A = x^T: boxes of 64 x-columns (dw rows) x 64 group rows; B = dout's 64 group rows.
            const int k0 = t.begin + 64 * kb;
#pragma unroll
            for (int j = 0; j < Tile::kBM / 64; ++j)
              ptx::tma_load_3d(ring.a(cur.stage) + j * Tile::kBoxBytes, &map_a, full, t.m * Tile::kBM + 64 * j, k0, 0);
#pragma unroll
            for (int j = 0; j < Tile::kBN / 64; ++j)
              ptx::tma_load_3d(ring.b(cur.stage) + j * Tile::kBoxBytes, &map_b, full, t.n * Tile::kBN + 64 * j, k0, 0);
          } else {
            ptx::tma_load_3d(ring.a(cur.stage), &map_a, full, 64 * kb, t.begin + t.m * Tile::kBM, 0);
#pragma unroll
            for (int j = 0; j < Tile::kBN / 64; ++j) {
              int col = t.n * Tile::kBN + 64 * j;
              if constexpr (kMode == Mode::kSwiglu)
                col = (j < 2 ? 0 : args.f) + t.n * (Tile::kBN / 2) + 64 * (j % 2);
              const int inner = kTransB ? 64 * kb : col, outer = kTransB ? col : 64 * kb;
              ptx::tma_load_3d(ring.b(cur.stage) + j * Tile::kBoxBytes, &map_b, full, inner, outer, t.g);
            }
          }
          cur.advance();
        }
      }
    }
    return;
  }

  ptx::setmaxnreg_inc<kConsumerRegs>();
  const int rows = 64 * (warpgroup - 1);  // this consumer's rows of the tile
  const bool releaser = threadIdx.x % 32 == 0;
  float acc[Tile::kBN / 2];
  for (int i = 0; sched.next(static_cast<int>(blockIdx.x) + i * static_cast<int>(gridDim.x), &walk, &t); ++i) {
#pragma unroll
    for (int j = 0; j < Tile::kBN / 2; ++j) acc[j] = 0.0f;
    const int kbs = k_blocks(t);
    int held = -1;  // the stage the in-flight wgmma group reads
    for (int kb = 0; kb < kbs; ++kb) {
      ptx::mbarrier_wait(&ring.full[cur.stage], cur.phase);
      if constexpr (kWgrad) {
        const int valid = t.end - t.begin - 64 * kb;
        if (valid < 64) zero_tail_rows<Tile>(ring.a(cur.stage), valid);
      }
      ptx::wgmma_fence();
      wgmma_kblock<T, Tile>(acc, ring.a(cur.stage) + rows * 128, ring.b(cur.stage));
      ptx::wgmma_commit();
      ptx::wgmma_wait<1>();  // the previous k-block's group is done with its stage
      if (held >= 0 && releaser) ptx::mbarrier_arrive(&ring.empty[held]);
      held = cur.stage;
      cur.advance();
    }
    ptx::wgmma_wait<0>();
    if (held >= 0 && releaser) ptx::mbarrier_arrive(&ring.empty[held]);
    ptx::wgmma_hold(acc);

    if constexpr (kWgrad) {
      const int m0 = t.m * Tile::kBM + rows, n0 = t.n * Tile::kBN;
      if constexpr (sizeof(TC) == 2) {
        if (args.c_tma) {  // dw[g] is its own batch of the map: TMA clips the tile at dw's edges
          tma_store_chunks<T, 0, 4>([&](int i) { return acc[i]; }, [&](int q) { return n0 + 64 * q; },
                                    ring.extra() + (warpgroup - 1) * 2 * kChunkBytes, &map_c, m0, 1 + warpgroup, t.g);
          continue;
        }
      }
      const AlphaBetaOutput<TC> out{1.0f, args.beta, static_cast<TC*>(args.c), args.ldc, args.c_gs, args.pairs};
      store_wgmma_tile<Tile::kBN>(acc, t.g, m0, n0, args.out_rows - m0, args.n - n0, out);
    } else {
      const int m0 = t.begin + t.m * Tile::kBM + rows;
      const int rows_left = t.end - m0;
      unsigned char* staging = ring.extra() + (warpgroup - 1) * 2 * kChunkBytes;
      const int barrier = 1 + warpgroup;  // 2, 3: one per consumer (1 is kZeroBarrier)
      if constexpr (kMode == Mode::kSwiglu) {
        const int n0 = t.n * (Tile::kBN / 2);
        if (args.c_tma && rows_left >= 64) {
          tma_store_chunks<T, 0, 2>([&](int i) { return silu(acc[i]) * acc[i + 64]; }, [&](int q) { return n0 + 64 * q; },
                                    staging, &map_c, m0, barrier);
          if (args.pre) {
            tma_store_chunks<T, 0, 2>([&](int i) { return acc[i]; }, [&](int q) { return n0 + 64 * q; }, staging,
                                      &map_pre, m0, barrier);
            tma_store_chunks<T, 2, 4>([&](int i) { return acc[i]; }, [&](int q) { return args.f + n0 + 64 * (q - 2); },
                                      staging, &map_pre, m0, barrier);
          }
        } else {
          store_swiglu<TC>(acc, args, m0, rows_left, n0);
        }
      } else {
        const int n0 = t.n * Tile::kBN;
        if (args.c_tma && rows_left >= 64) {
          tma_store_chunks<T, 0, 4>([&](int i) { return acc[i]; }, [&](int q) { return n0 + 64 * q; }, staging, &map_c,
                                    m0, barrier);
        } else {
          const AlphaBetaOutput<TC> out{1.0f, 0.0f, static_cast<TC*>(args.c), args.ldc, 0, args.pairs};
          store_wgmma_tile<Tile::kBN>(acc, 0, m0, n0, rows_left, args.n - n0, out);
        }
      }
    }
  }
  if (args.c_tma && threadIdx.x % 128 == 0) ptx::bulk_wait_group<0>();  // the stores are done
}

// Whether p holds two elements of TC as one aligned access.
template <typename TC>
bool pair_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % (2 * sizeof(TC)) == 0; }

template <typename T, typename TC, Mode kMode, bool kTransB>
cudaError_t launch(const GroupedGemmParams& p, cudaStream_t stream) {
  using Tile = TileOf<kMode, kTransB>;
  constexpr bool kWgrad = kMode == Mode::kWeightGrad;
  CUtensorMap map_a, map_b, map_c{}, map_pre{};
  Args args{};
  args.c = p.c;
  args.ldc = p.c_rs;
  args.c_gs = p.c_gs;
  args.pre = p.pre;
  args.ld_pre = p.pre_rs;
  args.beta = p.accumulate ? 1.0f : 0.0f;
  Sched sched{p.offs, static_cast<int>(p.groups), static_cast<int>(p.m), 0, 0, !kWgrad, kWgrad && p.accumulate};
  int64_t tile_bound;  // at least the tiles of the list, whatever the offsets
  if constexpr (kWgrad) {
    const TmaMatrix a{p.a, p.m, p.k, p.a_rs, 1, 0, 2}, b{p.b, p.m, p.n, p.b_rs, 1, 0, 2};
    if (cudaError_t e = make_tma_map_sw128(&map_a, a, 64, 64); e != cudaSuccess) return e;
    if (cudaError_t e = make_tma_map_sw128(&map_b, b, 64, 64); e != cudaSuccess) return e;
    args.n = static_cast<int>(p.n);
    args.out_rows = static_cast<int>(p.k);
    args.pairs = p.c_rs % 2 == 0 && p.c_gs % 2 == 0 && pair_aligned<TC>(p.c);
    // TMA stores of a 16-bit dw written (not accumulated), rows of whole 16-byte units.
    if (sizeof(TC) == 2 && !p.accumulate && p.n % 8 == 0) {
      const TmaMatrix c{p.c, p.k, p.n, p.c_rs, p.groups, p.c_gs, 2};
      args.c_tma = tma_rejects(c, "dw").empty() && make_tma_map_sw128(&map_c, c, 64, 64) == cudaSuccess;
    }
    sched.tiles_m_fixed = static_cast<int>(ceil_div(p.k, int64_t(Tile::kBM)));
    sched.tiles_n = static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN)));
    tile_bound = p.groups * sched.tiles_m_fixed * sched.tiles_n;
  } else {
    const TmaMatrix a{p.a, p.m, p.k, p.a_rs, 1, 0, 2};
    const TmaMatrix b = kTransB ? TmaMatrix{p.b, p.n, p.k, p.b_cs, p.groups, p.b_gs, 2}
                                : TmaMatrix{p.b, p.k, p.n, p.b_rs, p.groups, p.b_gs, 2};
    if (cudaError_t e = make_tma_map_sw128(&map_a, a, 64, Tile::kBM); e != cudaSuccess) return e;
    if (cudaError_t e = make_tma_map_sw128(&map_b, b, 64, 64); e != cudaSuccess) return e;
    args.k_blocks = static_cast<int>(ceil_div(p.k, int64_t(64)));
    if constexpr (kMode == Mode::kSwiglu) {
      args.f = static_cast<int>(p.n / 2);
      args.n = args.f;
      args.pairs = args.f % 2 == 0 && p.c_rs % 2 == 0 && pair_aligned<TC>(p.c) &&
                   (!p.pre || (p.pre_rs % 2 == 0 && pair_aligned<TC>(p.pre)));
      sched.tiles_n = static_cast<int>(ceil_div(int64_t(args.f), int64_t(Tile::kBN / 2)));
    } else {
      args.n = static_cast<int>(p.n);
      args.pairs = p.c_rs % 2 == 0 && pair_aligned<TC>(p.c);
      sched.tiles_n = static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN)));
    }
    // TMA stores: out (and pre) describable, with rows of whole 16-byte units (a TMA store clips a box at the
    // tensor's edge in 16-byte units).
    const int64_t out_cols = kMode == Mode::kSwiglu ? p.n / 2 : p.n;
    const TmaMatrix c{p.c, p.m, out_cols, p.c_rs, 1, 0, 2};
    args.c_tma = out_cols % 8 == 0 && tma_rejects(c, "out").empty() && make_tma_map_sw128(&map_c, c, 64, 64) == cudaSuccess;
    if (args.c_tma && p.pre) {
      const TmaMatrix pre{p.pre, p.m, p.n, p.pre_rs, 1, 0, 2};
      args.c_tma = tma_rejects(pre, "pre").empty() && make_tma_map_sw128(&map_pre, pre, 64, 64) == cudaSuccess;
    }
    // Each group's partial tile row, and the tail's.
    tile_bound = (ceil_div(p.m, int64_t(Tile::kBM)) + p.groups + 1) * sched.tiles_n;
  }
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
  const void* kernel = reinterpret_cast<const void*>(&grouped_wgmma_kernel<T, TC, kMode, kTransB>);
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      e != cudaSuccess)
    return e;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(facts->sm_count, tile_bound));
  grouped_wgmma_kernel<T, TC, kMode, kTransB>
      <<<static_cast<unsigned>(blocks), kThreads, Tile::kSmemBytes, stream>>>(map_a, map_b, map_c, map_pre, args, sched);
  return cudaGetLastError();
}

}  // namespace

cudaError_t grouped_gemm_wgmma(const GroupedGemmParams& p, const Workspace&, cudaStream_t stream) {
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    if (p.weight_grad) {
      if (p.c_dtype == DType::kF32) return launch<T, float, Mode::kWeightGrad, false>(p, stream);
      return launch<T, T, Mode::kWeightGrad, false>(p, stream);
    }
    if (p.swiglu) return launch<T, T, Mode::kSwiglu, false>(p, stream);
    if (p.b_cs == 1) return launch<T, T, Mode::kForward, false>(p, stream);
    return launch<T, T, Mode::kForward, true>(p, stream);
  });
}

}  // namespace optimized::cuda
