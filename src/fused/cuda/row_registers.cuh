// fused_registers: the short-row design. One kernel per op reads each row ONCE into registers,
// reduces it, and writes the result ONCE: the bytes moved are the op's minimum.
//
// Layout of the work
//   - a row is spread over `tpr` threads of a block (1 .. 512, a power of two) and, for long rows,
//     over a cluster of C blocks (2, 4 or 8); a block of 256 threads holds 256 / tpr rows when
//     rows are short. Thread (cluster rank r, lane l) owns the 16-byte vectors
//     i * (C * tpr) + r * tpr + l, i < kV, so a warp reads 512 consecutive bytes.
//   - reductions over the row: warp shuffles, then shared memory across the warps of the row,
//     then (C > 1) distributed shared memory across the blocks of the cluster, one cluster barrier.
//   - a block strides over row groups; backward of the norms accumulates dweight / dbias for its
//     own columns over every row it visits, and writes one partial per block, summed by
//     column_sum_kernel. The sums are fp32 registers, or, where those would cost the instance
//     blocks per SM (bf16 / fp16 with 2 vectors per thread: nearly every aligned width), a
//     thread-private slice of dynamic shared memory (BlockSums: one read-modify-write per row,
//     no barrier; 64 KB per block at most). Partial buffers alternate by reduction parity, so one
//     barrier per reduction suffices.
//   - registers hold the row in its storage type (Vec<T, kVec>: 4 registers per 16-byte vector
//     whatever the dtype, where its fp32 values take 8 for bf16 / fp16), converted at each use;
//     every pass recomputes from it the same fp32 values (and bits) as before. The exceptions are
//     fp32 by nature: the norms' dweight / dbias sums, and softmax forward's e = exp(v - m), held
//     across its second reduction (recomputing expf for the output was slower than 128 registers
//     and half the blocks). Each vector of the output is one 16-byte store (store_row_vec).
//   - why: holding fp32 values made the kernels register-limited. On the H100 at 16384 x 8192 bf16
//     the norms' forward used 123 registers and their backward 127, softmax 70-128: 25% theoretical
//     occupancy (2 blocks of 256 or 1 of 512 threads per SM), DRAM throughput 43-45%, warps stalled
//     on L1TEX. Now each instance gets the register cap it fits without spilling (kMinBlocks: 64
//     registers, 2 blocks of 512, for the forward and softmax backward), which doubles the rows in
//     flight. The norms' backward in 2-byte types needed 121-126 (its 32 fp32 sums and 16
//     registers of row; at 64 ptxas spilled, 0.6x): its sums moved to shared memory, and it runs at
//     64 registers (fp16 56-59), 2 blocks of 512, every load of a row issued before the first use.
//
// Measured (docs/perf-notes/fused.md): 0.5-0.87x of the copy bandwidth on the H100 with fp32 rows
// in registers. Packed rows (bf16, 16384 x 8192, against that kernel on the same H100): layer_norm
// and rms_norm forward 1.36-1.39x, softmax forward 1.18x, softmax backward 1.16x; fp32 layer_norm
// backward 1.63x. The norms' backward with its sums in shared memory, against the same kernel with
// them in registers (121 registers; same H100, same run; GB/s of h, dy and dx): bf16 16384 x 8192
// layer_norm 1.33x (2126 GB/s), rms_norm 1.43x (2334 GB/s); 4096 x 8192 1.25x / 1.38x; fp16
// layer_norm 1.37x; bf16 4096 x 32768 (clusters) 1.79x, 65536 x 1024 (4 rows a block) 1.27x. A
// block does not load its next row group before the current one is written, which is the next
// thing to fix (at 64 registers there is no room left to hold the next row).
//
// This header holds the whole story (config, reductions, kernel, launch); the build instantiates
// fused_registers_dtype once per dtype of OPTIMIZED_DTYPES, each in its own generated translation
// unit (cmake/dtype_instance.cu.in), so the ~40 kernels of a dtype compile in parallel with the
// others' and a developer can build one dtype alone.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "fused/cuda/fused_common.cuh"
#include "kernels/packed_row.cuh"
#include "kernels/ptx/cluster.cuh"

namespace optimized::cuda::fused {

namespace {

// ---- config (src/fused/fused_config.h) -----------------------------------------------------
constexpr int kMaxThreadsPerRow = kConfig.registers_max_threads_per_row;  // per block; longer rows take a cluster
constexpr int kMaxCluster = kConfig.registers_max_cluster;
constexpr int kShortRowBlock = kConfig.registers_short_row_block;  // threads of a block holding several short rows
constexpr int kMaxWarpsPerRow = kMaxThreadsPerRow / 32;
static_assert(kMaxThreadsPerRow % 32 == 0 && kShortRowBlock % 32 == 0, "whole warps");
static_assert(kShortRowBlock <= kMaxThreadsPerRow, "__launch_bounds__ covers the short-row block");
static_assert(kMaxCluster <= 8, "a portable cluster holds at most 8 blocks");

struct Plan {
  int tpr = 32;            // threads per row in one block
  int rows_per_block = 1;  // rows a block holds at once
  int cluster = 1;         // blocks per row
  int kv = 1;              // vectors per thread (template)
  int64_t vecs = 0;        // vectors per row
};

// ---- reductions ----------------------------------------------------------------------------
// The row reductions of one block (kernels/reduce.cuh's row_reduce): per-warp partials and (clusters)
// the partials of every block of the cluster, each double-buffered by reduction parity. With a
// cluster every block holds one row slice (rows_per_block == 1), and the kernel's start barrier made
// sure every peer runs before the first reduction writes into it.
using ReduceSmem = RowReduceSlots<2, (kShortRowBlock / 32 > kMaxWarpsPerRow ? kShortRowBlock / 32 : kMaxWarpsPerRow),
                                  kMaxCluster>;

// ---- dweight / dbias sums ------------------------------------------------------------------
// The fp32 sums of the norms' backward, per thread and column, where they live in shared memory
// (kSumsInSmem below): the block's dynamic shared memory as [sum][warp][i][q][lane][kChunk], sum
// being dweight then dbias (those asked for), kChunk floats per access (one 16-byte access per 4
// columns): a warp reads 512 consecutive bytes, without bank conflicts, and a thread reaches all
// its entries of one sum from one address (constant offsets). Each thread touches only its own
// entries until the end of the kernel: no barrier.
template <int kV, int kVec>
struct BlockSums {
  static constexpr int kChunk = kVec % 4 == 0 ? 4 : kVec % 2 == 0 ? 2 : 1;
  static constexpr int kQ = kVec / kChunk;
  float* base;  // 16-byte aligned

  __device__ __forceinline__ float* at(int sum, int i, int q, int thread) const {
    const int warps = blockDim.x / 32;
    return base + (((sum * warps + thread / 32) * kV + i) * kQ + q) * (32 * kChunk) + (thread % 32) * kChunk;
  }
  __device__ __forceinline__ void load(int sum, int i, int thread, float (&v)[kVec]) const {
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      const float* s = at(sum, i, q, thread);
      if constexpr (kChunk == 4) {
        const float4 c = *reinterpret_cast<const float4*>(s);
        v[4 * q] = c.x, v[4 * q + 1] = c.y, v[4 * q + 2] = c.z, v[4 * q + 3] = c.w;
      } else if constexpr (kChunk == 2) {
        const float2 c = *reinterpret_cast<const float2*>(s);
        v[2 * q] = c.x, v[2 * q + 1] = c.y;
      } else {
        v[q] = *s;
      }
    }
  }
  __device__ __forceinline__ void store(int sum, int i, int thread, const float (&v)[kVec]) const {
#pragma unroll
    for (int q = 0; q < kQ; ++q) {
      float* s = at(sum, i, q, thread);
      if constexpr (kChunk == 4) {
        *reinterpret_cast<float4*>(s) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
      } else if constexpr (kChunk == 2) {
        *reinterpret_cast<float2*>(s) = make_float2(v[2 * q], v[2 * q + 1]);
      } else {
        *s = v[q];
      }
    }
  }
};

// threadIdx.x, read where it is used: the compiler would rather hold every address derived from it
// across the loop over rows (one register each) than recompute one.
__device__ __forceinline__ int thread_index_here() {
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return static_cast<int>(t);
}

// One row of `out` (width floats) per block, the columns of vector i of this thread: row slot 0
// (thread `lane`) adds the sums of the block's other row slots, kept in slot `sum` of `sums`, to
// its own `acc`, in row-slot order, and writes them. The caller has made every slot's sums visible.
template <int kV, int kVec>
__device__ __forceinline__ void write_column_sums(float (&acc)[kVec], const BlockSums<kV, kVec>& sums, int sum, int i,
                                                  int rows_per_block, int tpr, int lane, float* out) {
  for (int r = 1; r < rows_per_block; ++r) {
    float v[kVec];
    sums.load(sum, i, r * tpr + lane, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] += v[j];
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = acc[j];
}

// Sums held in registers (acc): one row of `out` (width floats) per block. The rows a block holds
// meet in shared memory first (`collect`: rows_per_block * tpr * kV * kVec floats when > 1 row, the
// dynamic shared memory; row slot 0 collects), then row slot 0 writes its columns. Called by every
// thread of the block.
template <int kV, int kVec, typename ColOf, typename InRow>
__device__ __forceinline__ void write_partial(float (&acc)[kV][kVec], float* collect, const Plan& plan, int row_slot,
                                              int lane, int tpr, float* out, ColOf col_of, InRow in_row) {
  if (plan.rows_per_block > 1) {
    __syncthreads();  // the previous use of `collect` is over
#pragma unroll
    for (int i = 0; i < kV; ++i)
#pragma unroll
      for (int j = 0; j < kVec; ++j) collect[((row_slot * kV + i) * kVec + j) * tpr + lane] = acc[i][j];
    __syncthreads();
    if (row_slot == 0)
      for (int r = 1; r < plan.rows_per_block; ++r)
#pragma unroll
        for (int i = 0; i < kV; ++i)
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[i][j] += collect[((r * kV + i) * kVec + j) * tpr + lane];
  }
  if (row_slot == 0)
#pragma unroll
    for (int i = 0; i < kV; ++i)
      if (in_row(i))
#pragma unroll
        for (int j = 0; j < kVec; ++j) out[col_of(i) + j] = acc[i][j];
}

// ---- registers -----------------------------------------------------------------------------
// 32-bit registers a thread holds across the reductions of a row: the row in its storage type (a
// 16-byte vector is 4; one element of an unaligned row 1), twice backward (y and dy, h and dy) ...
constexpr int row_registers(int element_bytes, int vec, int kv, FusedKernel kind) {
  const int per_vector = (element_bytes * vec + 3) / 4;
  const bool backward = kind == FusedKernel::kSoftmaxBwd || kind == FusedKernel::kNormBwd;
  return (backward ? 2 : 1) * kv * per_vector;
}
// ... and, backward of the norms, the fp32 dweight / dbias sums of its columns, unless they are in
// shared memory.
constexpr int sum_registers(int vec, int kv, FusedKernel kind) { return kind == FusedKernel::kNormBwd ? 2 * kv * vec : 0; }
// Blocks of kMaxThreadsPerRow threads per SM asked of ptxas (__launch_bounds__), that is the
// register cap (65536 per SM). Given any minimum, ptxas spends registers up to the cap, so each
// instance gets the smallest cap it fits without spilling (ptxas -v, sm_90a, every dtype):
//   - 3 blocks, 40 registers: unaligned rows (one element per vector) and rows of at most 4 held
//     registers (one 16-byte vector per thread);
//   - 2 blocks, 64 registers: up to 32 held registers, which covers the 16 of the forward (4
//     vectors; softmax forward then holds 32 fp32 values of e across its second reduction, which
//     fits too), of softmax backward (2 vectors, y and dy), and of the norms' backward with its
//     sums in registers (fp32; one vector of a 2-byte type) or in shared memory (2 vectors of a
//     2-byte type);
//   - 1 block: more than 32 held registers. No instance now: the one that had it, the norms'
//     backward with 2 vectors of a 2-byte type (16 registers of row and 32 fp32 sums), ran with
//     121-126 registers, 1 block of 512 threads per SM, and spilled 280-500 bytes at 64.
constexpr int min_blocks_for(int held, int vec) { return vec == 1 || held <= 4 ? 3 : held <= 32 ? 2 : 1; }
// The norms' backward keeps its sums in shared memory where, in registers, they would cost the
// instance blocks per SM (bf16 / fp16 with 2 vectors per thread: widths 4097-8192, and clusters):
// up to 64 KB per block of 512 threads (dweight and dbias, 8192 columns), 2 blocks per SM. Where
// registers hold them at the same cap, shared memory would only add traffic (a read-modify-write
// per row and column).
constexpr bool sums_in_smem_for(int element_bytes, int vec, int kv, FusedKernel kind) {
  const int row = row_registers(element_bytes, vec, kv, kind), sums = sum_registers(vec, kv, kind);
  return sums > 0 && min_blocks_for(row + sums, vec) < min_blocks_for(row, vec);
}
template <typename T, int kVec, int kV, FusedKernel kKind>
constexpr bool kSumsInSmem = sums_in_smem_for(static_cast<int>(sizeof(T)), kVec, kV, kKind);
template <typename T, int kVec, int kV, FusedKernel kKind>
constexpr int kMinBlocks = min_blocks_for(row_registers(static_cast<int>(sizeof(T)), kVec, kV, kKind) +
                                              (kSumsInSmem<T, kVec, kV, kKind> ? 0 : sum_registers(kVec, kV, kKind)),
                                          kVec);

// ---- the kernel ----------------------------------------------------------------------------
// The kernel keeps the row in registers in its storage type (a 16-byte vector is 4 registers for
// any dtype; its fp32 values are 8 for bf16 / fp16) and converts at each use, with keep_packed after
// each reduction; it stores with store_row_vec and predicates the norms' backward loads with
// load_row_vec_if (kernels/packed_row.cuh says why each).

// T: element type; kVec: elements per vector (16 bytes, or 1 for unaligned rows); kV: vectors
// per thread; kKind: which op group and direction; kCluster: rows span a cluster.
template <typename T, int kVec, int kV, FusedKernel kKind, bool kCluster>
__global__ void __launch_bounds__(kMaxThreadsPerRow, (kMinBlocks<T, kVec, kV, kKind>))
    row_registers_kernel(const FusedParams p, const Plan plan, const FusedScalarsF32 sc, float* __restrict__ partial) {
  constexpr bool kBackward = kKind == FusedKernel::kSoftmaxBwd || kKind == FusedKernel::kNormBwd;
  constexpr bool kNorm = kKind == FusedKernel::kNormFwd || kKind == FusedKernel::kNormBwd;
  constexpr bool kSmemSums = kSumsInSmem<T, kVec, kV, kKind>;
  __shared__ ReduceSmem smem;
  // Dynamic shared memory (launch_instance sizes it), backward of the norms alone: the dweight /
  // dbias sums of every thread (kSmemSums, BlockSums), or where the row slots of a multi-row block
  // meet at the end (write_partial's `collect`).
  extern __shared__ float4 dynamic_smem[];
  int parity = 0;  // of the next reduction's slots
  // Clusters: every block of the cluster must run before any writes into a peer's shared memory
  // (racecheck found the writes of a lazy start). One barrier here, its wait after this block's
  // set-up: a flag checked at every reduction (the lazy wait) cost the unaligned backward 23
  // registers and a third of its occupancy (40 -> 63, 3 -> 2 blocks per SM).
  if constexpr (kCluster) ptx::cluster_arrive_relaxed();

  const int tpr = plan.tpr;
  const int lane = threadIdx.x % tpr;
  const int row_slot = kCluster ? 0u : threadIdx.x / tpr;  // a cluster's block holds one row slice
  int rank = 0, num_groups = gridDim.x, group = blockIdx.x;
  if constexpr (kCluster) {
    rank = static_cast<int>(ptx::cluster_block_rank());
    num_groups = gridDim.x / plan.cluster;
    group = blockIdx.x / plan.cluster;
  }
  // Vector indices: 32 bits where the sums are in shared memory (a row has at most kMaxCluster *
  // kMaxThreadsPerRow * 4 vectors: make_plan); the registers it spares let that instance fit 64
  // without spilling. The other instances keep the 64-bit code they were measured with.
  using Index = std::conditional_t<kSmemSums, int, int64_t>;
  const Index stride_vecs = static_cast<Index>(plan.cluster) * tpr;
  const Index first_vec = static_cast<Index>(rank) * tpr + lane;
  const Index row_vecs = static_cast<Index>(plan.vecs);
  const int64_t width = p.width;
  const float inv_width = 1.0f / static_cast<float>(width);
  const bool layer = p.is_layer_norm();
  const bool log = p.op == FusedOp::kLogSoftmax;

  auto col_of = [&](int i) { return (first_vec + i * stride_vecs) * kVec; };
  auto in_row = [&](int i) { return first_vec + i * stride_vecs < row_vecs; };

  // weight and bias of this thread's columns, loaded where used (they stay in L1 across rows).
  const T* wp = static_cast<const T*>(p.weight);
  const T* bp = static_cast<const T*>(p.bias);
  auto load_affine = [&](const T* vp, int i, float (&out)[kVec], float absent) {
    if (vp) {
      const Vec<T, kVec> v = load_vec<T, kVec>(vp + col_of(i));
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = to_float(v.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = absent;
    }
  };
  // Backward of the norms: this thread's share of dweight / dbias over the rows it visits, in
  // registers, or (kSmemSums) in slots dw_sum and db_sum of `sums`, zeroed here.
  constexpr int kRegSums = kBackward && kNorm && !kSmemSums ? kV : 1;
  float dw[kRegSums][kVec] = {}, db[kRegSums][kVec] = {};
  const int dw_sum = 0, db_sum = p.dweight ? 1 : 0;
  const BlockSums<kV, kVec> sums{reinterpret_cast<float*>(dynamic_smem)};
  if constexpr (kSmemSums) {
    float zero[kVec] = {};
#pragma unroll
    for (int i = 0; i < kV; ++i) {
      if (p.dweight) sums.store(dw_sum, i, threadIdx.x, zero);
      if (p.dbias) sums.store(db_sum, i, threadIdx.x, zero);
    }
  }

  if constexpr (kCluster) ptx::cluster_wait();

  const int64_t rows_per_group = plan.rows_per_block;
  const int64_t iterations = (p.rows + rows_per_group * num_groups - 1) / (rows_per_group * num_groups);
  for (int64_t it = 0; it < iterations; ++it) {
    const int64_t row = (it * num_groups + group) * rows_per_group + row_slot;
    const bool live = row < p.rows;  // dead rows still join the reductions (barriers)

    if constexpr (kKind == FusedKernel::kSoftmaxFwd) {
      const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
      // x stays in the dtype; each pass recomputes v = scale * x, rounded once (__fmul_rn keeps the
      // product out of an FMA with the "- m" that follows), so every pass computes the same bits.
      Vec<T, kVec> x[kV];
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const bool ok = live && in_row(i);
        x[i] = ok ? load_vec_once<T, kVec>(xr + col_of(i)) : Vec<T, kVec>{};
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float v = ok ? __fmul_rn(sc.scale, to_float(x[i].v[j])) : -INFINITY;
          m = MaxOp::apply(m, v);  // NaN propagates
        }
      }
      float red[2] = {m, 0.0f};
      row_reduce<MaxOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      m = red[0];
      keep_packed(x);
      // exp(-inf - m) = 0 for padding; a row of all -inf, or with a NaN, gives NaN, as torch does.
      // The two ops part here (log is the same for the whole grid): softmax keeps e in fp32 for its
      // output (recomputing expf there was slower than the kernel with fp32 rows), x is dead;
      // log_softmax keeps x and writes (scale * x - m) - log(s), which stays exact where e
      // underflows.
      if (!log) {
        float e[kV][kVec];
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kV; ++i)
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const float v = live && in_row(i) ? __fmul_rn(sc.scale, to_float(x[i].v[j])) : -INFINITY;
            e[i][j] = expf(v - m);
            if (in_row(i)) s += e[i][j];
          }
        red[0] = s;
        red[1] = 0.0f;
        row_reduce<SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
        const float inv_s = 1.0f / red[0];
        T* yr = static_cast<T*>(p.y) + row * p.ld_y;
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          if (!(live && in_row(i))) continue;
          Vec<T, kVec> yv;
#pragma unroll
          for (int j = 0; j < kVec; ++j) yv.v[j] = from_float<T>(e[i][j] * inv_s);
          store_row_vec<T, kVec>(yr + col_of(i), yv);
        }
      } else {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kV; ++i)
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            const float v = live && in_row(i) ? __fmul_rn(sc.scale, to_float(x[i].v[j])) : -INFINITY;
            const float e = expf(v - m);
            if (in_row(i)) s += e;
          }
        red[0] = s;
        red[1] = 0.0f;
        row_reduce<SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
        const float log_s = logf(red[0]);
        keep_packed(x);
        T* yr = static_cast<T*>(p.y) + row * p.ld_y;
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          if (!(live && in_row(i))) continue;
          Vec<T, kVec> yv;
#pragma unroll
          for (int j = 0; j < kVec; ++j) yv.v[j] = from_float<T>((__fmul_rn(sc.scale, to_float(x[i].v[j])) - m) - log_s);
          store_row_vec<T, kVec>(yr + col_of(i), yv);
        }
      }
    } else if constexpr (kKind == FusedKernel::kNormFwd) {
      const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
      const T* rr = static_cast<const T*>(p.residual) + row * p.ld_residual;
      T* ror = static_cast<T*>(p.residual_out) + row * p.ld_residual_out;
      // h = x (+ residual, rounded to the dtype: residual_out holds it, and backward reads that), kept
      // in the dtype: to_float(h) is exactly the value every pass reads.
      Vec<T, kVec> h[kV];
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const bool ok = live && in_row(i);
        h[i] = Vec<T, kVec>{};
        if (ok) {
          h[i] = load_vec_once<T, kVec>(xr + col_of(i));
          if (p.residual) {
            const Vec<T, kVec> rv = load_vec_once<T, kVec>(rr + col_of(i));
#pragma unroll
            for (int j = 0; j < kVec; ++j) h[i].v[j] = from_float<T>(to_float(h[i].v[j]) + to_float(rv.v[j]));
            store_row_vec<T, kVec>(ror + col_of(i), h[i]);
          }
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum += ok ? to_float(h[i].v[j]) : 0.0f;
      }
      float mean = 0.0f;
      float red[2] = {sum, 0.0f};
      if (layer) {
        row_reduce<SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
        mean = red[0] * inv_width;
      }
      keep_packed(h);
      float sq = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i)
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = in_row(i) && live ? to_float(h[i].v[j]) - mean : 0.0f;
          sq += d * d;
        }
      red[0] = sq;
      red[1] = 0.0f;
      row_reduce<SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      const float rstd = 1.0f / sqrtf(red[0] * inv_width + sc.eps);
      keep_packed(h);
      if (live && lane == 0 && rank == 0) {
        if (p.mean) p.mean[row] = mean;
        if (p.rstd) p.rstd[row] = rstd;
      }
      T* yr = static_cast<T*>(p.y) + row * p.ld_y;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if (!(live && in_row(i))) continue;
        float w[kVec], b[kVec];
        load_affine(wp, i, w, 1.0f);
        load_affine(bp, i, b, 0.0f);
        Vec<T, kVec> yv;
#pragma unroll
        for (int j = 0; j < kVec; ++j) yv.v[j] = from_float<T>((to_float(h[i].v[j]) - mean) * rstd * w[j] + b[j]);
        store_row_vec<T, kVec>(yr + col_of(i), yv);
      }
    } else if constexpr (kKind == FusedKernel::kSoftmaxBwd) {
      const T* yr = static_cast<const T*>(p.x) + row * p.ld_x;  // the forward output
      const T* dyr = static_cast<const T*>(p.dy) + row * p.ld_dy;
      Vec<T, kVec> yv[kV], gv[kV];
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const bool ok = live && in_row(i);
        yv[i] = gv[i] = Vec<T, kVec>{};
        if (ok) {
          yv[i] = load_vec_once<T, kVec>(yr + col_of(i));
          gv[i] = load_vec_once<T, kVec>(dyr + col_of(i));
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float y = ok ? to_float(yv[i].v[j]) : 0.0f, g = ok ? to_float(gv[i].v[j]) : 0.0f;
          s += log ? g : g * y;
        }
      }
      float red[2] = {s, 0.0f};
      row_reduce<SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      s = red[0];
      keep_packed(yv);
      keep_packed(gv);
      T* dxr = static_cast<T*>(p.dx) + row * p.ld_dx;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if (!(live && in_row(i))) continue;
        Vec<T, kVec> dv;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float y = to_float(yv[i].v[j]), g = to_float(gv[i].v[j]);
          dv.v[j] = from_float<T>(log ? sc.scale * (g - expf(y) * s) : sc.scale * y * (g - s));
        }
        store_row_vec<T, kVec>(dxr + col_of(i), dv);
      }
    } else {  // kNormBwd
      const T* hr = static_cast<const T*>(p.x) + row * p.ld_x;
      const T* dyr = static_cast<const T*>(p.dy) + row * p.ld_dy;
      const float mean = live && layer ? p.mean[row] : 0.0f;
      const float rstd = live ? p.rstd[row] : 0.0f;
      // h and dy stay in the dtype; both passes compute xhat = (h - mean) * rstd alike (same bits).
      // kSmemSums (64 registers): every load of the row is issued before the first use
      // (load_row_vec_if); the other instances load each vector in the loop that uses it.
      Vec<T, kVec> hv[kV], gv[kV];
      if constexpr (kSmemSums) {
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          const bool ok = live && in_row(i);
          hv[i] = load_row_vec_if<T, kVec>(ok, hr + col_of(i));
          gv[i] = load_row_vec_if<T, kVec>(ok, dyr + col_of(i));
        }
      }
      float a = 0.0f, bsum = 0.0f;  // sum(g * xhat), sum(g), g = dy * weight
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const bool ok = live && in_row(i);
        if constexpr (!kSmemSums) hv[i] = gv[i] = Vec<T, kVec>{};
        float w[kVec];
        load_affine(ok ? wp : nullptr, i, w, 1.0f);
        if constexpr (!kSmemSums) {
          if (ok) {
            hv[i] = load_vec_once<T, kVec>(hr + col_of(i));
            gv[i] = load_vec_once<T, kVec>(dyr + col_of(i));
          }
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float xhat = ok ? (to_float(hv[i].v[j]) - mean) * rstd : 0.0f;
          const float dy = ok ? to_float(gv[i].v[j]) : 0.0f;
          const float g = ok ? dy * w[j] : 0.0f;
          a += g * xhat;
          bsum += g;
          if constexpr (!kSmemSums) {
            dw[i][j] += dy * xhat;
            db[i][j] += dy;
          }
        }
      }
      float red[2] = {a, bsum};
      row_reduce<SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      const float mean_gx = red[0] * inv_width, mean_g = layer ? red[1] * inv_width : 0.0f;
      keep_packed(hv);
      keep_packed(gv);
      const T* dror = static_cast<const T*>(p.dresidual_out) + row * p.ld_dresidual_out;
      T* dxr = static_cast<T*>(p.dx) + row * p.ld_dx;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if (!(live && in_row(i))) continue;
        Vec<T, kVec> extra{}, dv;
        if (p.dresidual_out) extra = load_vec_once<T, kVec>(dror + col_of(i));
        float w[kVec];
        load_affine(wp, i, w, 1.0f);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float xhat = (to_float(hv[i].v[j]) - mean) * rstd;
          float d = rstd * (to_float(gv[i].v[j]) * w[j] - mean_g - xhat * mean_gx);
          if (p.dresidual_out) d += to_float(extra.v[j]);
          dv.v[j] = from_float<T>(d);
        }
        store_row_vec<T, kVec>(dxr + col_of(i), dv);
        // The sums in shared memory, here rather than in the first pass, where the read-modify-write
        // of vector 0 held back the loads of vector 1. Dead rows and padding skip them (in registers
        // they add +0, which leaves a sum that starts at +0 bit for bit as it is).
        if constexpr (kSmemSums) {
          const int t = thread_index_here();
          if (p.dweight) {
            float s[kVec];
            sums.load(dw_sum, i, t, s);
#pragma unroll
            for (int j = 0; j < kVec; ++j) {
              const float xhat = (to_float(hv[i].v[j]) - mean) * rstd;
              s[j] += to_float(gv[i].v[j]) * xhat;
            }
            sums.store(dw_sum, i, t, s);
          }
          if (p.dbias) {
            float s[kVec];
            sums.load(db_sum, i, t, s);
#pragma unroll
            for (int j = 0; j < kVec; ++j) s[j] += to_float(gv[i].v[j]);
            sums.store(db_sum, i, t, s);
          }
        }
      }
    }
  }

  if constexpr (kBackward && kNorm) {
    float* out = partial + 2 * group * width;  // dweight, then dbias
    if constexpr (kSmemSums) {
      if (plan.rows_per_block > 1) __syncthreads();  // every row slot's sums are in
      if (row_slot == 0)
#pragma unroll
        for (int i = 0; i < kV; ++i) {
          if (!in_row(i)) continue;
          float acc[kVec];
          if (p.dweight) {
            sums.load(dw_sum, i, lane, acc);
            write_column_sums(acc, sums, dw_sum, i, plan.rows_per_block, tpr, lane, out + col_of(i));
          }
          if (p.dbias) {
            sums.load(db_sum, i, lane, acc);
            write_column_sums(acc, sums, db_sum, i, plan.rows_per_block, tpr, lane, out + width + col_of(i));
          }
        }
    } else {
      float* collect = reinterpret_cast<float*>(dynamic_smem);
      if (p.dweight) write_partial<kV, kVec>(dw, collect, plan, row_slot, lane, tpr, out, col_of, in_row);
      if (p.dbias) write_partial<kV, kVec>(db, collect, plan, row_slot, lane, tpr, out + width, col_of, in_row);
    }
  }
}

// ---- host side -----------------------------------------------------------------------------

// Threads, cluster and vectors per thread for a row of `vecs` vectors: targets the config's vectors
// per thread, one block per row up to kMaxThreadsPerRow threads, then clusters.
// cudaErrorInvalidValue when the row does not fit a cluster (the C++ API refuses such widths first:
// fused_registers_max_width).
cudaError_t make_plan(const FusedParams& p, int vec, Plan* out) {
  const int kv_per_thread = p.backward ? kConfig.registers_backward_vectors : kConfig.registers_forward_vectors;
  Plan plan;
  plan.vecs = (p.width + vec - 1) / vec;
  const int64_t threads = (plan.vecs + kv_per_thread - 1) / kv_per_thread;
  if (threads <= kMaxThreadsPerRow) {
    plan.tpr = pow2_ceil(threads);
  } else {
    plan.tpr = kMaxThreadsPerRow;
    const int64_t per_block = static_cast<int64_t>(kMaxThreadsPerRow) * kv_per_thread;
    plan.cluster = pow2_ceil((plan.vecs + per_block - 1) / per_block);
    if (plan.cluster > kMaxCluster) return cudaErrorInvalidValue;
  }
  const int64_t span = static_cast<int64_t>(plan.tpr) * plan.cluster;
  plan.kv = pow2_ceil((plan.vecs + span - 1) / span);
  plan.rows_per_block = plan.tpr < kShortRowBlock ? kShortRowBlock / plan.tpr : 1;
  *out = plan;
  return cudaSuccess;
}

template <typename T, int kVec, int kV, FusedKernel kKind, bool kCluster>
cudaError_t launch_instance(const FusedParams& p, const Plan& plan, const Workspace& workspace, cudaStream_t stream,
                            size_t* measure) {
  // Partial rows alternate dweight, dbias: (group, which, column).
  const bool wants_partials = kKind == FusedKernel::kNormBwd && (p.dweight || p.dbias);
  if (measured_without_scratch(wants_partials, measure)) return cudaSuccess;
  auto kernel = row_registers_kernel<T, kVec, kV, kKind, kCluster>;
  const int block = plan.tpr * plan.rows_per_block;
  // Dynamic shared memory: the dweight / dbias sums of every thread (kSumsInSmem: one slot per sum
  // asked for, 64 KB at most: 512 threads, 8192 columns, both sums), or one slot where the row slots
  // of a multi-row block meet (write_partial's `collect`).
  const size_t sum_slot = static_cast<size_t>(block) * kV * kVec * sizeof(float);
  const int sums_asked = (p.dweight ? 1 : 0) + (p.dbias ? 1 : 0);
  size_t dyn_smem = 0;
  if (kKind == FusedKernel::kNormBwd && sums_asked > 0) {
    if (kSumsInSmem<T, kVec, kV, kKind>)
      dyn_smem = sums_asked * sum_slot;
    else if (plan.rows_per_block > 1)
      dyn_smem = sum_slot;
  }
  if (dyn_smem > 48 * 1024)
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn_smem));
        e != cudaSuccess)
      return e;
  // Enough row groups to fill the GPU, no more (a group strides over the rows): the number of
  // dweight / dbias partials stays small.
  int64_t resident = 0;
  if (cudaError_t e = resident_blocks(kernel, block, dyn_smem, &resident); e != cudaSuccess) return e;
  const int64_t groups_needed = (p.rows + plan.rows_per_block - 1) / plan.rows_per_block;
  const int64_t groups = std::min(groups_needed, std::max<int64_t>(1, resident / plan.cluster));

  const PartialRows partial = partial_rows(workspace, measure, wants_partials ? groups * 2 * p.width : 0);
  if (!partial.launch) return partial.status;

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(groups * plan.cluster));
  config.blockDim = dim3(static_cast<unsigned>(block));
  config.dynamicSmemBytes = dyn_smem;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  if (kCluster) ptx::set_cluster_dims(config, attribute, static_cast<unsigned>(plan.cluster));
  if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, p, plan, scalars_f32(p), partial.data); e != cudaSuccess)
    return e;
  return wants_partials ? launch_parameter_sums<T>(partial.data, groups, p, stream) : cudaSuccess;
}

template <typename T, int kVec, FusedKernel kKind>
cudaError_t launch_with_vec(const FusedParams& p, const Workspace& workspace, cudaStream_t stream, size_t* measure) {
  Plan plan;
  if (cudaError_t e = make_plan(p, kVec, &plan); e != cudaSuccess) return e;
  auto go = [&](auto kv_tag) {
    constexpr int kV = decltype(kv_tag)::value;
    return plan.cluster > 1 ? launch_instance<T, kVec, kV, kKind, true>(p, plan, workspace, stream, measure)
                            : launch_instance<T, kVec, kV, kKind, false>(p, plan, workspace, stream, measure);
  };
  static_assert(kConfig.registers_forward_vectors == 4 && kConfig.registers_backward_vectors == 2,
                "the instantiated vectors per thread (1, 2, 4 forward; 1, 2 backward) follow the config");
  switch (plan.kv) {
    case 1: return go(std::integral_constant<int, 1>{});
    case 2: return go(std::integral_constant<int, 2>{});
    case 4:
      if constexpr (!is_backward(kKind)) return go(std::integral_constant<int, 4>{});
      break;
    default: break;
  }
  return cudaErrorInvalidValue;  // no kernel for this many vectors per thread (make_plan caps kv)
}

}  // namespace

}  // namespace optimized::cuda::fused

namespace optimized::cuda {

template <DType kDType>
cudaError_t fused_registers_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream,
                                  size_t* measure) {
  using T = kernels::cuda_type_t<kDType>;
  using fused::FusedKernel;
  return fused::dispatch_kernel<T, FusedKernel::kSoftmaxFwd, FusedKernel::kNormFwd, FusedKernel::kSoftmaxBwd,
                                FusedKernel::kNormBwd>(p, [&]<FusedKernel kKind, int kVec>() {
    return fused::launch_with_vec<T, kVec, kKind>(p, workspace, stream, measure);
  });
}

}  // namespace optimized::cuda
