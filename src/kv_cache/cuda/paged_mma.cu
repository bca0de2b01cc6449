// Decode attention, CUDA rung 4: paged_mma. paged_split's work split (block = sequence, kv head,
// row group of up to 16 query rows, key chunk; the LSE merge of split_merge.cuh), with a mainloop
// built for the memory's speed:
//
//   block   4 warps; the block's query rows (the GQA group's heads x q_len, r = hh * q_len + t) form
//           one m16 tile Q (16 x D, 16-bit, swizzled in shared memory, zero rows past the group),
//           whose mma.sync A fragments each warp keeps in registers (D <= 128) or re-reads (D = 256)
//   warps   split the chunk's keys: warp w takes the 16-key tiles w, w + 4, w + 8, ... and runs its
//           own cp.async pipeline of kStages tiles (16 K rows + 16 V rows each) with its own
//           online-softmax state; no block barrier inside the mainloop, only __syncwarp
//   a tile  page lookup by lanes 0-15 (one key each, 32-bit division), shuffled to the lanes that
//           copy its 16-byte chunks straight from the page into the swizzled tile (a key whose page
//           is outside the table or the cache: zeros, masked; never read); the copies of tile
//           i + kStages - 1 are in flight while tile i is computed
//           S = Q K^T: D / 16 k-steps x 2 n-tiles of mma.sync.m16n8k16 (fp32 accumulators), K's
//           B fragments by ldmatrix; scores in the log2 domain (scale * log2 e, softcap, ALiBi, the
//           row's key range [lo, hi) and the page mask applied on the C fragment); online softmax
//           on the fragment (quad max / exp2); P (rounded to 16 bits, the FlashAttention-2 trick)
//           times V: D / 8 n-tiles, V's B fragments by ldmatrix.trans
//   fp8     the pages are copied as bytes, then each warp converts its tile to f16 (e4m3 -> f16 is
//           exact, one cvt per pair) in a tile of its own, and the products run in f16 whatever
//           q's type: q enters scaled by a power of two that puts the block's largest |q| near
//           2^14 (no overflow for any bf16 q; the power joins the score scale); the per-head scales
//           are not applied to the elements: k_scale joins the softmax scale, v_scale the output
//   end     the 4 warps' (m, l, O) meet in shared memory (the pipeline's, reused): out = O / l and
//           lse (splits == 1), or the split's normalized partial for the merge
//
// What changed from paged_split, and why it is faster: paged_split stages each tile as fp32 through
// a block-wide barrier per step and computes on CUDA cores one (row, key) dot product per thread,
// so a block spends most of its time waiting on barriers and shared-memory loads with one tile in
// flight. Here each warp keeps kStages - 1 tiles of its own in flight and does the arithmetic on
// tensor cores (about 2 mma.sync per key for 16 rows), so the loads stream; the split rule
// (kv_cache_config.h, mma_decode_splits) sizes the grid to whole waves of resident blocks.
// Measured on the H100 (GQA 32/8, d = 128, bf16, pages scattered): 1.7-2.6 TB/s against
// paged_split's 0.28-0.52, 0.78-0.92x SDPA on contiguous K/V (docs/perf-notes/kv_cache.md).
//
// Limits: q fp16 / bf16 (the cache of q's type or fp8 e4m3), head_dim 64, 128 or 256, cache rows
// 16-byte aligned (kv_cache.cpp checks; auto runs paged_split otherwise). Numerics: P is rounded
// to the products' 16-bit type (q's; f16 with an fp8 cache) before P V (fp32 accumulation), as
// FlashAttention does; a key a row does not see still shares its tile with the rows that do, so a
// NaN or Inf in such a key's V row reaches the row's output through 0 * V (the cpu and SIMT rungs
// skip it): the tensor-core rungs' whole-tile semantics, as attention's flash2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/device_facts.h"
#include "core/workspace.h"
#include "kernels/common.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/ldmatrix.cuh"
#include "kernels/ptx/smem.cuh"
#include "kernels/tile/mma_frag.cuh"
#include "kv_cache/cuda/kv_cache_common.cuh"
#include "kv_cache/cuda/split_merge.cuh"
#include "kv_cache/kv_cache_config.h"
#include "kv_cache/launchers.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;
using namespace optimized::cuda::kv_cache_cuda;
namespace ptx = optimized::kernels::ptx;
namespace cfg = optimized::kv_cache_config;

constexpr int kWarps = cfg::kMmaWarps;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = cfg::kMmaRows;  // query rows of a block: one m16 tile
constexpr int kKeys = 16;             // keys of a warp's tile: one k-step of P V
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kRows == 16, "one m16 tile of query rows");

// The shared-memory layout of an instance. A stage holds a warp's 16-key tile of K then of V as
// the pages store them: 16-bit rows in the swizzled SmemTile layout, fp8 rows unpadded (converted
// by the warp into a swizzled 16-bit tile of its own before use).
template <int D, typename C>
struct MmaShape {
  static constexpr bool kFp8 = std::is_same_v<C, Fp8>;
  using Tile = SmemTile<kKeys, D>;  // 16 rows of D 16-bit elements, swizzled (Q, and fp8 converted)
  static constexpr int kStages = cfg::mma_stages(D, kFp8);
  static constexpr int kRowBytes = D * static_cast<int>(sizeof(C));  // a cache row
  static constexpr int kRawTileBytes = kKeys * kRowBytes;  // K or V of a tile as stored
  static constexpr int kStageBytes = 2 * kRawTileBytes;     // K, then V
  static constexpr int kWarpBytes = kStages * kStageBytes + (kFp8 ? 2 * Tile::kBytes : 0);
  static constexpr int kQBytes = Tile::kBytes;
  static constexpr int kWarpsOffset = kQBytes;
  static constexpr int kMaskOffset = kWarpsOffset + kWarps * kWarpBytes;  // (warp, stage) key masks
  static constexpr int kSmemBytes = kMaskOffset + kWarps * kStages * 4;
  // The combine area (after the mainloop, over the warps' areas): O (warp, row, D + 4 floats), m, l.
  static constexpr int kOStride = D + 4;
  static constexpr int kCombineBytes = (kWarps * kRows * kOStride + 2 * kWarps * kRows) * 4;
  static_assert(kCombineBytes <= kWarps * kWarpBytes, "the combine area fits the pipelines'");
  static_assert(kRawTileBytes % 128 == 0 && kQBytes % 128 == 0, "tiles start 128-byte aligned");
  static_assert(D % 64 == 0, "the swizzle permutes the 16-byte chunks of 128-byte lines");
};

// Two e4m3 bytes (lo in the low byte) as an f16 pair (exact: e4m3 fits f16; one cvt on sm_89+).
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint16_t v) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

// A warp converts a raw fp8 tile (kKeys rows of D bytes, row-major) into a swizzled f16
// tile.
template <int D>
__device__ __forceinline__ void convert_fp8_tile(const unsigned char* raw, uint32_t tile, int lane) {
  using Tile = SmemTile<kKeys, D>;
  constexpr int kChunks = kKeys * D / 16;  // 16-byte chunks of the raw tile
#pragma unroll
  for (int q = lane; q < kChunks; q += 32) {
    const int r = q / (D / 16), c16 = q % (D / 16);
    const uint4 v = *reinterpret_cast<const uint4*>(raw + r * D + c16 * 16);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = fp8x2_to_f16x2(static_cast<uint16_t>(w[i] & 0xffffu));
      o[2 * i + 1] = fp8x2_to_f16x2(static_cast<uint16_t>(w[i] >> 16));
    }
    const uint32_t a0 = tile + Tile::offset(r, 2 * c16), a1 = tile + Tile::offset(r, 2 * c16 + 1);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a0), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3])
                 : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(a1), "r"(o[4]), "r"(o[5]), "r"(o[6]), "r"(o[7])
                 : "memory");
  }
}

template <typename T, typename C, int D>
__global__ void __launch_bounds__(kThreads)
    paged_mma_kernel(const __grid_constant__ KvDecodeParams p, SplitOut split_out) {
  using S = MmaShape<D, C>;
  using Tile = typename S::Tile;
  // The tensor cores' input type: q's, or f16 for an fp8 cache (e4m3 -> f16 is one exact cvt).
  using M = std::conditional_t<S::kFp8, __half, T>;
  constexpr int kStages = S::kStages;
  constexpr bool kQRegs = D <= 128;  // Q's A fragments held in registers (D = 256: re-read per tile)
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sbase = ptx::smem_u32(smem);
  const KvCachePages& c = p.cache;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t G = p.group(), Q = p.q_len;
  const int64_t b = blockIdx.x / c.heads_kv, g = blockIdx.x % c.heads_kv;
  const int r0 = static_cast<int>(blockIdx.y) * kRows;
  const int nrows = static_cast<int>(G * Q - r0 < kRows ? G * Q - r0 : kRows);
  const int64_t split = blockIdx.z, splits = gridDim.z;
  const int64_t seq_len = p.seq_lens[b], L = visible_len(p, b);

  // The keys of the block's rows, this split's chunk of them (whole tiles).
  const KeyChunk keys = block_key_chunk(p, seq_len, L, r0, nrows, split, splits, kKeys);
  const int64_t s_lo = keys.lo, s_hi = keys.hi;
  const int ntiles = s_hi > s_lo ? static_cast<int>(ceil_div(s_hi - s_lo, int64_t{kKeys})) : 0;
  const int my_tiles = ntiles > warp ? (ntiles - warp + kWarps - 1) / kWarps : 0;

  // Q as the MMA type M (swizzled; rows past the group are zeros). fp8 cache: q * qscale in f16,
  // qscale the power of two that brings the block's largest |q| to [2^13, 2^14) (f16's range holds
  // any bf16 q, exactly up to f16's rounding); 1 / qscale joins the score scale.
  const uint32_t sq = sbase;
  auto q_at = [&](int r, int d) -> float {
    const int64_t rg = r0 + r, t = rg % Q, h = g * G + rg / Q;
    return to_float(static_cast<const T*>(p.q)[b * p.q_b + t * p.q_t + h * p.q_h + d]);
  };
  float qscale = 1.0f;
  if constexpr (S::kFp8) {
    __shared__ float slots[kWarps][1];
    float mx = 0.0f;
    for (int i = tid; i < nrows * D; i += kThreads) mx = fmaxf(mx, fabsf(q_at(i / D, i % D)));  // (NaN dropped)
    mx = block_reduce<MaxOp>(mx, kThreads, slots);
    if (mx > 0.0f && mx <= 3.0e38f) {
      int e = 0;
      frexpf(mx, &e);  // mx < 2^e
      qscale = ldexpf(1.0f, min(14 - e, 126));
    }
  }
  for (int i = tid; i < kRows * D; i += kThreads) {
    const int r = i / D, d = i % D;
    const float x = r < nrows ? q_at(r, d) * qscale : 0.0f;
    *reinterpret_cast<M*>(smem + Tile::offset(r, d / 8) + (d % 8) * 2) = from_float<M>(x);
  }

  // This thread's two rows of the C fragments (g = lane / 4 and g + 8): key range, position, slope.
  int64_t lo[2], hi[2], pos[2];
  float slope[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lane / 4 + 8 * i;
    lo[i] = hi[i] = pos[i] = 0, slope[i] = 0.0f;
    if (r < nrows) {
      const int64_t rg = r0 + r, t = rg % Q, h = g * G + rg / Q;
      const QueryRange qr = query_range(p, seq_len, L, t);
      lo[i] = qr.lo, hi[i] = qr.hi, pos[i] = qr.pos;
      slope[i] = alibi_slope(p, b, h);
    }
  }
  const float ks = c.k_scale ? c.k_scale[g] : 1.0f, vs = c.v_scale ? c.v_scale[g] : 1.0f;
  const float scale_nat = static_cast<float>(p.scale) * ks / qscale;
  const float scale_log2 = scale_nat * kLog2e;
  const bool mod = p.softcap > 0 || p.alibi != nullptr;
  const float cap = p.softcap > 0 ? static_cast<float>(p.softcap) : 1.0f;
  __syncthreads();  // Q is in shared memory

  uint32_t qa[kQRegs ? D / 16 : 1][4];
  if constexpr (kQRegs) {
#pragma unroll
    for (int ks16 = 0; ks16 < D / 16; ++ks16) ldsm_a<Tile>(qa[ks16], sq, 0, 2 * ks16, lane);
  }

  // The warp's pipeline.
  const uint32_t wbase = sbase + S::kWarpsOffset + warp * S::kWarpBytes;
  uint32_t* smask = reinterpret_cast<uint32_t*>(smem + S::kMaskOffset) + warp * kStages;
  const char* k_bytes = static_cast<const char*>(c.k_pages);
  const char* v_bytes = static_cast<const char*>(c.v_pages);
  const bool wide = s_hi > 0x7fffffff;  // key indices past 2^31 - 1: 64-bit page arithmetic
  // The page of the key of lane l < 16 in tile i of the warp (-1: no page, or no such key) and its
  // slot, read one tile ahead of the copies that need them (the table read is off the critical path).
  struct PageSlot {
    int page, slot;
  };
  auto fetch = [&](int i) -> PageSlot {
    PageSlot ps{-1, 0};
    const int64_t j = s_lo + static_cast<int64_t>(warp + kWarps * i) * kKeys + (lane % kKeys);
    if (i < my_tiles && lane < kKeys && j < s_hi) {
      int64_t pi, sl;
      if (!wide) {
        const uint32_t j32 = static_cast<uint32_t>(j), size = static_cast<uint32_t>(c.page_size);
        const uint32_t q32 = j32 / size;
        pi = q32, sl = j32 - q32 * size;
      } else {
        pi = j / c.page_size, sl = j % c.page_size;
      }
      if (pi < p.table.max_pages) {
        const int64_t e = p.table.entries[b * p.table.row + pi];
        if (e >= 0 && e < c.num_pages) ps.page = static_cast<int>(e), ps.slot = static_cast<int>(sl);
      }
    }
    return ps;
  };
  // Copies tile i of the warp (if any; its pages in ps) into stage i % kStages in 16-byte chunks,
  // the lanes of a pass covering whole rows (32 / (row bytes / 16) rows a pass: each copy instruction
  // reads whole contiguous row segments; the row's page and slot come by shuffle from the key's
  // lane), and commits a group (always: the waits count groups). A key without a page: zeros,
  // never read. (Measured: one lane pair per row instead, 16 rows of 32 bytes an instruction, was
  // 10-15% slower at B = 64 and 128.)
  auto issue = [&](int i, PageSlot ps) {
    if (i < my_tiles) {
      const int stage = i % kStages;
      const uint32_t valid = __ballot_sync(0xffffffffu, ps.page >= 0) & 0xffffu;
      if (lane == 0) smask[stage] = valid;
      constexpr int kCpr = S::kRowBytes / 16;  // 16-byte chunks per row
      constexpr int kRowsPerPass = 32 / kCpr;
      const int cc = lane % kCpr;
      const uint32_t kt = wbase + stage * S::kStageBytes, vt = kt + S::kRawTileBytes;
#pragma unroll
      for (int pass = 0; pass < kKeys / kRowsPerPass; ++pass) {
        const int r = lane / kCpr + pass * kRowsPerPass;
        const int pg = __shfl_sync(0xffffffffu, ps.page, r);
        const int sl = __shfl_sync(0xffffffffu, ps.slot, r);
        const uint32_t off = S::kFp8 ? static_cast<uint32_t>(r * D + cc * 16) : Tile::offset(r, cc);
        if (pg >= 0) {
          const int64_t ko = (static_cast<int64_t>(pg) * c.k_page + sl * c.k_slot + g * c.k_head) * sizeof(C);
          const int64_t vo = (static_cast<int64_t>(pg) * c.v_page + sl * c.v_slot + g * c.v_head) * sizeof(C);
          ptx::cp_async_16(kt + off, k_bytes + ko + cc * 16);
          ptx::cp_async_16(vt + off, v_bytes + vo + cc * 16);
        } else {
          st_shared_zero16(kt + off);
          st_shared_zero16(vt + off);
        }
      }
    }
    ptx::cp_async_commit();
  };

  float o[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  PageSlot next = fetch(0);
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    issue(i, next);
    next = fetch(i + 1);
  }
  for (int i = 0; i < my_tiles; ++i) {
    ptx::cp_async_wait<kStages - 2>();
    __syncwarp();  // every lane's copies of tile i landed; every lane is done with tile i - 1
    issue(i + kStages - 1, next);  // into tile i - 1's stage
    next = fetch(i + kStages);
    const int stage = i % kStages;
    uint32_t kt = wbase + stage * S::kStageBytes, vt = kt + S::kRawTileBytes;
    if constexpr (S::kFp8) {
      const uint32_t ck = wbase + kStages * S::kStageBytes, cv = ck + Tile::kBytes;
      const unsigned char* raw = smem + (kt - sbase);
      convert_fp8_tile<D>(raw, ck, lane);
      convert_fp8_tile<D>(raw + S::kRawTileBytes, cv, lane);
      __syncwarp();
      kt = ck, vt = cv;
    }
    const uint32_t valid = smask[stage];
    const int64_t j0 = s_lo + static_cast<int64_t>(warp + kWarps * i) * kKeys;

    // S = Q K^T (16 rows x 16 keys).
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int ks16 = 0; ks16 < D / 16; ++ks16) {
      uint32_t bk[2][2];
      ldsm_b_nk<Tile>(bk, kt, 0, 2 * ks16, lane);
      if constexpr (kQRegs) {
        mma<M>(s[0], qa[ks16], bk[0]);
        mma<M>(s[1], qa[ks16], bk[1]);
      } else {
        uint32_t a[4];
        ldsm_a<Tile>(a, sq, 0, 2 * ks16, lane);
        mma<M>(s[0], a, bk[0]);
        mma<M>(s[1], a, bk[1]);
      }
    }

    // Scores (log2 domain), masked: -inf outside the row's range or on a key without a page.
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      const int64_t lo_rel = lo[i2] - j0, hi_rel = hi[i2] - j0;
      const float dpos = static_cast<float>(pos[i2] - j0);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = nt * 8 + 2 * (lane % 4) + e;
          float x = s[nt][2 * i2 + e];
          if (!mod) {
            x *= scale_log2;
          } else {
            x *= scale_nat;
            if (p.softcap > 0) x = cap * tanhf(x / cap);
            if (slope[i2] != 0.0f) x -= slope[i2] * fabsf(dpos - static_cast<float>(key));
            x *= kLog2e;
          }
          const bool vis = ((valid >> key) & 1u) && key >= lo_rel && key < hi_rel;
          s[nt][2 * i2 + e] = vis ? x : -INFINITY;
        }
    }

    // Online softmax on the fragment: rows g (i2 = 0) and g + 8 (i2 = 1).
    float alphas[2];
#pragma unroll
    for (int i2 = 0; i2 < 2; ++i2) {
      float mx = fmaxf(fmaxf(s[0][2 * i2], s[0][2 * i2 + 1]), fmaxf(s[1][2 * i2], s[1][2 * i2 + 1]));
      mx = quad_max(mx);
      const float m_new = fmaxf(m[i2], mx);
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = exp2_approx(m[i2] - base);
      m[i2] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2_approx(s[nt][2 * i2 + e] - base);
          s[nt][2 * i2 + e] = pe;
          sum += pe;
        }
      l[i2] = l[i2] * alpha + sum;
      alphas[i2] = alpha;
    }
    // O *= alpha, skipped when no row of the warp's tile raised its max (alpha = 1; or both maxima
    // -inf: O is 0): after the first tiles of a long sequence the max rarely moves.
    if (!__all_sync(0xffffffffu, alphas[0] == 1.0f && alphas[1] == 1.0f)) {
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt)
        o[nt][0] *= alphas[0], o[nt][1] *= alphas[0], o[nt][2] *= alphas[1], o[nt][3] *= alphas[1];
    }

    // O += P V.
    uint32_t pa[4];
    c_to_a<M>(pa, s[0], s[1]);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t bv[2][2];
      ldsm_b_kn<Tile>(bv, vt, 0, 2 * dp, lane);
      mma<M>(o[2 * dp], pa, bv[0]);
      mma<M>(o[2 * dp + 1], pa, bv[1]);
    }
  }
  ptx::cp_async_wait<0>();  // the trailing groups are empty; nothing may land after the reuse below

  // The warps meet: (m, l, O) of each into the combine area (the pipelines' shared memory).
  l[0] = quad_sum(l[0]);
  l[1] = quad_sum(l[1]);
  __syncthreads();
  float* cO = reinterpret_cast<float*>(smem + S::kWarpsOffset);
  float* cM = cO + kWarps * kRows * S::kOStride;
  float* cL = cM + kWarps * kRows;
#pragma unroll
  for (int i2 = 0; i2 < 2; ++i2) {
    const int r = lane / 4 + 8 * i2;
    float* orow = cO + (warp * kRows + r) * S::kOStride + 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) *reinterpret_cast<float2*>(orow + nt * 8) = make_float2(o[nt][2 * i2], o[nt][2 * i2 + 1]);
    if (lane % 4 == 0) cM[warp * kRows + r] = m[i2], cL[warp * kRows + r] = l[i2];
  }
  __syncthreads();

  for (int idx = tid; idx < nrows * D; idx += kThreads) {
    const int r = idx / D, d = idx % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, cM[w * kRows + r]);
    float val = 0.0f, lsum = 0.0f;
    if (M != -INFINITY) {
      float acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wt = exp2f(cM[w * kRows + r] - M);
        lsum = fmaf(wt, cL[w * kRows + r], lsum);
        acc = fmaf(wt, cO[(w * kRows + r) * S::kOStride + d], acc);
      }
      val = acc / lsum * vs;
    }
    const int64_t rg = r0 + r, t = rg % Q, h = g * G + rg / Q;
    if (split_out.o) {
      const int64_t row = (b * p.heads_q + h) * Q + t;
      split_out.o[(row * splits + split) * D + d] = val;
      if (d == 0) split_out.lse[row * splits + split] = M == -INFINITY ? -INFINITY : (M + log2f(lsum)) * kLn2;
    } else {
      static_cast<T*>(p.out)[b * p.out_b + t * p.out_t + h * p.out_h + d] = from_float<T>(val);
      if (d == 0 && p.lse) p.lse[b * p.lse_b + h * p.lse_h + t] = M == -INFINITY ? -INFINITY : (M + log2f(lsum)) * kLn2;
    }
  }
}

// The opt-in above 48 KiB of shared memory, once per device for an instance (a function attribute,
// not a stream operation: also legal while a stream is being captured).
template <typename T, typename C, int D>
cudaError_t opt_in(const DeviceFacts& facts) {
  using S = MmaShape<D, C>;
  static std::atomic<uint64_t> opted{0};
  const uint64_t bit = uint64_t{1} << (facts.ordinal & 63);
  if (opted.load(std::memory_order_relaxed) & bit) return cudaSuccess;
  if (static_cast<size_t>(S::kSmemBytes) > static_cast<size_t>(facts.max_smem_per_block_optin)) return cudaErrorInvalidValue;
  if (cudaError_t e = cudaFuncSetAttribute(paged_mma_kernel<T, C, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           S::kSmemBytes);
      e != cudaSuccess)
    return e;
  opted.fetch_or(bit, std::memory_order_relaxed);
  return cudaSuccess;
}

// Calls body.template operator()<T, C, D>() for p's dtypes and head_dim; cudaErrorInvalidValue for
// what the rungs do not take.
template <typename Body>
cudaError_t dispatch_mma(DType dtype, DType cache_dtype, int64_t head_dim, Body&& body) {
  auto by_dim = [&]<typename T, typename C>() -> cudaError_t {
    switch (head_dim) {
      case 64: return body.template operator()<T, C, 64>();
      case 128: return body.template operator()<T, C, 128>();
      case 256: return body.template operator()<T, C, 256>();
      default: return cudaErrorInvalidValue;
    }
  };
  const bool fp8 = cache_dtype == DType::kF8E4M3;
  if (dtype == DType::kF16) return fp8 ? by_dim.template operator()<__half, Fp8>() : by_dim.template operator()<__half, __half>();
  if (dtype == DType::kBF16)
    return fp8 ? by_dim.template operator()<__nv_bfloat16, Fp8>() : by_dim.template operator()<__nv_bfloat16, __nv_bfloat16>();
  return cudaErrorInvalidValue;
}

int64_t splits_of(const KvDecodeParams& p) { return p.splits < 1 ? 1 : p.splits; }

cudaError_t splits_for(const KvDecodeParams& p, int64_t max_seq_len, int64_t* splits) {
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
  int per_sm = 0;
  const cudaError_t e = dispatch_mma(p.dtype, p.cache.dtype, p.cache.head_dim, [&]<typename T, typename C, int D>() {
    // The occupancy of an instance on a device never changes: asked once (every unplanned decode
    // and every plan needs it, on the host path of a step).
    static std::atomic<int> known[64] = {};
    std::atomic<int>& slot = known[facts->ordinal & 63];
    if ((per_sm = slot.load(std::memory_order_relaxed)) > 0) return cudaSuccess;
    if (cudaError_t e2 = opt_in<T, C, D>(*facts); e2 != cudaSuccess) return e2;
    const cudaError_t e3 = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, paged_mma_kernel<T, C, D>, kThreads,
                                                                         MmaShape<D, C>::kSmemBytes);
    if (e3 == cudaSuccess && per_sm > 0) slot.store(per_sm, std::memory_order_relaxed);
    return e3;
  });
  if (e != cudaSuccess) return e;
  const int64_t row_groups = ceil_div(p.group() * p.q_len, int64_t{kRows});
  *splits = cfg::mma_decode_splits(p.batch * p.cache.heads_kv * row_groups, kRows, max_seq_len,
                                   static_cast<int64_t>(facts->sm_count) * (per_sm < 1 ? 1 : per_sm));
  return cudaSuccess;
}

cudaError_t run(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream) {
  if (p.batch <= 0 || p.heads_q <= 0) return cudaSuccess;
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
  const int64_t splits = splits_of(p);
  if (!split_count_ok(splits)) return cudaErrorInvalidValue;
  SplitOut part;
  if (splits > 1) {
    WorkspaceArena arena(workspace);
    part = carve_split_out(p, splits, arena);
    if (!arena.ok()) return cudaErrorInvalidValue;
  }
  const int64_t row_groups = ceil_div(p.group() * p.q_len, int64_t{kRows});
  const int64_t x = p.batch * p.cache.heads_kv;
  if (x > 0x7fffffff || row_groups > kMaxGridY || splits > kMaxGridZ) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(x), static_cast<unsigned>(row_groups), static_cast<unsigned>(splits));
  return dispatch_mma(p.dtype, p.cache.dtype, p.cache.head_dim, [&]<typename T, typename C, int D>() -> cudaError_t {
    if (cudaError_t e = opt_in<T, C, D>(*facts); e != cudaSuccess) return e;
    paged_mma_kernel<T, C, D><<<grid, kThreads, MmaShape<D, C>::kSmemBytes, stream>>>(p, part);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    return splits > 1 ? launch_merge_splits<T>(p, splits, part, stream) : cudaSuccess;
  });
}

}  // namespace

cudaError_t kv_cache_paged_mma_workspace(const KvDecodeParams& p, size_t* bytes) {
  *bytes = split_workspace_bytes(p, splits_of(p));
  return cudaSuccess;
}

cudaError_t kv_cache_paged_mma_splits(const KvDecodeParams& p, int64_t max_seq_len, int64_t* splits) {
  return splits_for(p, max_seq_len, splits);
}

cudaError_t kv_cache_paged_mma(const KvDecodeParams& p, const Workspace& workspace, cudaStream_t stream) {
  return run(p, workspace, stream);
}

}  // namespace optimized::cuda
