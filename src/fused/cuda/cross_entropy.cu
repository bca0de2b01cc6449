// cross_entropy_fused: cross-entropy forward, and the gradient for a unit upstream gradient, in one
// pass over the logits (include/optimized/fused.h, "cross-entropy"; CPU reference:
// cpu/cross_entropy_cpu.cpp).
//
// Versions (the ladder of this op; the CPU rung is the first):
//   1. ce_row_kernel -- a block per row. Pass 1 streams the row once from DRAM into an online
//      softmax (kernels/online_softmax.cuh: running max m and rescaled sum s, merged per 16-byte
//      vector) and sum(x) (label smoothing); the block merges them. Pass 2 (only when the gradient is
//      wanted) re-reads the row and writes the gradient with 16-byte streaming stores. The re-read was
//      meant to hit L2; on the H100 (T = 8192, V = 128256 bf16: 250 KB rows, 4 blocks of 512 per SM)
//      only a third does (ncu: L2 hits 34%, 2.16 ms against the 1.42 ms of the minimum bytes), and
//      fewer rows in flight (a grid of 66 to 528 blocks) did not raise it: pass 2 costs DRAM reads.
//      DRAM bytes: the loss alone reads the logits once; with the gradient ~1.5 reads and a write.
//   2. ce_partial_kernel + ce_finish_kernel -- long rows and few of them (vocab >= kSplitMinVocab and
//      fewer rows than kWaves x the SMs): a row is split into chunks of >= kChunkMin elements over
//      several blocks, so that one long row fills the GPU. Stage one: each block writes its chunk's
//      (m, s, sum(x)) -- and x[t], for the chunk holding the target -- into the workspace. Stage
//      two: each block folds its row's partials in chunk order (one thread, then shared memory), the
//      same fixed order for every block and every run: DETERMINISTIC (for a given GPU: the number
//      of chunks follows its SM count), and writes its chunk's gradient (re-read from L2: the rows
//      split are few by construction). Two launches instead of a grid-wide barrier: nothing waits
//      on blocks that may not be resident.
// Rows of any alignment and length: an aligned body of 16-byte vectors between a scalar head and
// tail (kernels/aligned_row.cuh); the gradient is stored with vectors when its row has the logits'
// alignment modulo 16 (always in place), else element by element.
// In place (grad == logits): every element is read and then written by the same thread in pass 2,
// and x[t] is read before the first barrier (version 1) or in stage one (version 2), so no thread
// reads what another has overwritten.
// Targets: ignore_index: loss 0, lse 0, a zero gradient row, the logits not read. Outside
// [0, vocab): NaN loss, lse and gradient row, the logits not read (no access out of bounds; the
// device cannot raise without a sync). Math in fp32; the scalars rounded to fp32 once on the host.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/device_facts.h"
#include "core/dtypes_built.h"
#include "core/workspace.h"
#include "fused/cross_entropy_params.h"
#include "kernels/aligned_row.cuh"
#include "kernels/common.cuh"
#include "kernels/dtype.cuh"
#include "kernels/online_softmax.cuh"
#include "kernels/packed_row.cuh"
#include "kernels/ptx/cluster.cuh"
#include "kernels/reduce.cuh"

namespace optimized::cuda {

namespace {

using namespace optimized::kernels;

// ---- config --------------------------------------------------------------------------------
// Not yet measured on the H100 (docs/perf-notes/fused.md): the values follow the family's
// streaming design (512 threads per row) and the split rule of long single rows.
constexpr int kMaxThreads = 512;             // threads of a block on one row (or one chunk)
constexpr int kMaxWarps = kMaxThreads / 32;
constexpr int64_t kSplitMinVocab = 32768;    // shorter rows: always a block per row
constexpr int64_t kChunkMin = 8192;          // elements per block, at least, when a row is split
constexpr int64_t kMaxSplits = 64;           // blocks per row, at most
constexpr int kWaves = 2;                    // split until rows x chunks >= kWaves x SMs
constexpr int64_t kMaxRowBlocks = int64_t{1} << 24;  // version 1's grid; more rows: grid-stride
static_assert(kMaxThreads % 32 == 0 && kMaxThreads <= 1024, "whole warps, one block");
static_assert(kChunkMin % 16 == 0, "chunks keep the row's alignment modulo 16 bytes for every dtype");

// The scalars as the kernels compute with them: fp32, rounded once here.
struct CeScalars {
  float ls;            // label smoothing
  float one_minus_ls;
  float ls_over_v;     // ls / vocab
  float inv_v;         // 1 / vocab
  float z;             // z-loss coefficient
};
CeScalars scalars_of(const CrossEntropyParams& p) {
  const float ls = static_cast<float>(p.label_smoothing), v = static_cast<float>(p.vocab);
  return {ls, 1.0f - ls, ls / v, 1.0f / v, static_cast<float>(p.z_loss)};
}

// A (max, sum of exp, sum of x, x[t]) partial of one chunk (version 2's workspace).
struct CePartial {
  float m, s, sum_x, x_t;
};

template <typename I>
__device__ __forceinline__ int64_t target_of(const CrossEntropyParams& p, int64_t row) {
  return static_cast<int64_t>(static_cast<const I*>(p.target)[row * p.target_stride]);
}

// A row that is not computed: ignored (0) or with a target out of range (NaN).
__device__ __forceinline__ bool skipped_row(const CrossEntropyParams& p, int64_t t, float* fill) {
  if (t == p.ignore_index) {
    *fill = 0.0f;
    return true;
  }
  if (t < 0 || t >= p.vocab) {
    *fill = __int_as_float(0x7fc00000);  // NaN
    return true;
  }
  return false;
}

// Writes `value` to n gradient elements at g (this block's threads).
template <typename T>
__device__ __forceinline__ void fill_gradient(T* g, int64_t n, float value) {
  const T v = from_float<T>(value);
  for_each_aligned(g, n, true, threadIdx.x, blockDim.x, [&]<int kVec>(int64_t i) {
    Vec<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = v;
    store_vec<T, kVec>(g + i, out);
  });
}

// Pass 1 over n logits at x: this thread's online-softmax state and sum(x).
template <typename T>
__device__ __forceinline__ void row_stats(const T* x, int64_t n, MaxSum* ms, float* sum_x) {
  for_each_aligned(x, n, true, threadIdx.x, blockDim.x, [&]<int kVec>(int64_t i) {
    const Vec<T, kVec> xv = load_vec<T, kVec>(x + i);
    float f[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      f[j] = to_float(xv.v[j]);
      *sum_x += f[j];
    }
    *ms = merge(*ms, max_sum_of<kVec>(f));
  });
}

// The row's loss from its merged state (one thread).
__device__ __forceinline__ float row_loss(MaxSum ms, float sum_x, float x_t, const CeScalars& sc, float* lse) {
  const float log_s = logf(ms.s);
  *lse = ms.m + log_s;
  float l = log_s;  // lse - ((1 - ls) x_t + ls mean(x)) regrouped: no cancellation of lse - x_t
  if (sc.ls != 1.0f) l += sc.one_minus_ls * (ms.m - x_t);
  if (sc.ls != 0.0f) l += sc.ls * (ms.m - sum_x * sc.inv_v);
  if (sc.z != 0.0f) l += sc.z * *lse * *lse;
  return l;
}

// The gradient's factor of `row` (1 without grad_scale).
__device__ __forceinline__ float grad_factor(const CrossEntropyParams& p, int64_t row) {
  return p.grad_scale ? static_cast<const float*>(p.grad_scale)[row * p.grad_scale_stride] : 1.0f;
}

// Pass 2 over n logits at x (offset `base` into the row): the gradient times k into g. The logits'
// last read and the gradient's store are streaming (evict-first): the rows still to be re-read keep
// their place in L2.
template <typename T>
__device__ __forceinline__ void write_gradient(const T* x, T* g, int64_t n, int64_t base, int64_t t, MaxSum ms,
                                               float lse, float k, const CeScalars& sc) {
  const float inv_s = 1.0f / ms.s;
  const float c = sc.z != 0.0f ? 1.0f + 2.0f * sc.z * lse : 1.0f;
  const int64_t t_local = t - base;  // may be outside [0, n)
  for_each_aligned(x, n, same_alignment(x, g), threadIdx.x, blockDim.x, [&]<int kVec>(int64_t i) {
    const Vec<T, kVec> xv = load_vec_once<T, kVec>(x + i);
    Vec<T, kVec> gv;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float d = expf(to_float(xv.v[j]) - ms.m) * inv_s * c - sc.ls_over_v;
      if (i + j == t_local) d -= sc.one_minus_ls;
      gv.v[j] = from_float<T>(d * k);
    }
    store_vec_once<T, kVec>(g + i, gv);
  });
}

// ---- version 1: a block per row ----------------------------------------------------------------
template <typename T, typename I>
__global__ void __launch_bounds__(kMaxThreads) ce_row_kernel(const CrossEntropyParams p, const CeScalars sc) {
  __shared__ float scratch[kMaxWarps * 2];
  const int threads = static_cast<int>(blockDim.x);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.logits) + row * p.ld_logits;
    T* g = p.grad ? static_cast<T*>(p.grad) + row * p.ld_grad : nullptr;
    float* loss = static_cast<float*>(p.loss) + row;
    float* lse_out = p.lse ? static_cast<float*>(p.lse) + row : nullptr;
    const int64_t t = target_of<I>(p, row);
    float fill;
    if (skipped_row(p, t, &fill)) {  // the same branch for the whole block
      if (threadIdx.x == 0) {
        *loss = fill;
        if (lse_out) *lse_out = fill;
      }
      if (g) fill_gradient(g, p.vocab, fill);
      continue;
    }
    const float x_t = threadIdx.x == 0 ? to_float(x[t]) : 0.0f;  // before any barrier: in place safe
    MaxSum ms;
    float sum_x = 0.0f;
    row_stats(x, p.vocab, &ms, &sum_x);
    ms = block_merge(ms, threads, scratch);  // ends with a barrier: scratch free again
    if (sc.ls != 0.0f) sum_x = block_reduce<SumOp>(sum_x, threads, reinterpret_cast<float(*)[1]>(scratch));
    float lse = 0.0f;
    if (threadIdx.x == 0) {
      *loss = row_loss(ms, sum_x, x_t, sc, &lse);
      if (lse_out) *lse_out = lse;
    }
    if (!g) continue;
    lse = ms.m + logf(ms.s);  // every thread (thread 0's value above is the same)
    write_gradient(x, g, p.vocab, 0, t, ms, lse, grad_factor(p, row), sc);
  }
}

// ---- version 2: several blocks per row, two stages ---------------------------------------------
// Grid (chunks, rows): block (c, row) takes elements [c chunk, min(vocab, (c + 1) chunk)).
template <typename T, typename I>
__global__ void __launch_bounds__(kMaxThreads) ce_partial_kernel(const CrossEntropyParams p, const CeScalars sc,
                                                                 int64_t chunk, CePartial* __restrict__ partial) {
  __shared__ float scratch[kMaxWarps * 2];
  const int64_t row = blockIdx.y, c = blockIdx.x, chunks = gridDim.x;
  const int64_t t = target_of<I>(p, row);
  float fill;
  if (skipped_row(p, t, &fill)) return;  // stage two handles the row alone
  const int64_t begin = c * chunk, n = std::min(chunk, p.vocab - begin);
  const T* x = static_cast<const T*>(p.logits) + row * p.ld_logits + begin;
  MaxSum ms;
  float sum_x = 0.0f;
  row_stats(x, n, &ms, &sum_x);
  ms = block_merge(ms, static_cast<int>(blockDim.x), scratch);
  if (sc.ls != 0.0f) sum_x = block_reduce<SumOp>(sum_x, static_cast<int>(blockDim.x), reinterpret_cast<float(*)[1]>(scratch));
  if (threadIdx.x == 0) {
    const bool holds_t = t >= begin && t < begin + n;
    partial[row * chunks + c] = {ms.m, ms.s, sum_x, holds_t ? to_float(x[t - begin]) : 0.0f};
  }
}

// Grid (chunks, rows) with a gradient, (1, rows) without: the fold of the row's partials in chunk
// order, then block (c, row)'s chunk of the gradient.
template <typename T, typename I>
__global__ void __launch_bounds__(kMaxThreads) ce_finish_kernel(const CrossEntropyParams p, const CeScalars sc,
                                                                int64_t chunk, int64_t chunks,
                                                                const CePartial* __restrict__ partial) {
  __shared__ float folded[2];
  const int64_t row = blockIdx.y, c = blockIdx.x;
  const int64_t begin = c * chunk, n = std::min(chunk, p.vocab - begin);
  T* g = p.grad ? static_cast<T*>(p.grad) + row * p.ld_grad + begin : nullptr;
  float* lse_out = p.lse ? static_cast<float*>(p.lse) + row : nullptr;
  const int64_t t = target_of<I>(p, row);
  float fill;
  if (skipped_row(p, t, &fill)) {
    if (c == 0 && threadIdx.x == 0) {
      static_cast<float*>(p.loss)[row] = fill;
      if (lse_out) *lse_out = fill;
    }
    if (g) fill_gradient(g, n, fill);
    return;
  }
  if (threadIdx.x == 0) {  // one fixed order: deterministic
    const CePartial* mine = partial + row * chunks;
    MaxSum ms;
    float sum_x = 0.0f;
    for (int64_t k = 0; k < chunks; ++k) {
      ms = merge(ms, {mine[k].m, mine[k].s});
      sum_x += mine[k].sum_x;
    }
    float lse;
    const float loss = row_loss(ms, sum_x, mine[t / chunk].x_t, sc, &lse);
    if (c == 0) {
      static_cast<float*>(p.loss)[row] = loss;
      if (lse_out) *lse_out = lse;
    }
    folded[0] = ms.m;
    folded[1] = ms.s;
  }
  if (!g) return;  // the same for the whole block
  __syncthreads();
  const MaxSum ms{folded[0], folded[1]};
  const T* x = static_cast<const T*>(p.logits) + row * p.ld_logits + begin;
  write_gradient(x, g, n, begin, t, ms, ms.m + logf(ms.s), grad_factor(p, row), sc);
}

// ---- version 3: the row in registers, over a cluster ---------------------------------------------
// A cluster of C blocks (1, 2, 4 or 8; C = 1 without the cluster launch) of kRegThreads threads holds
// one row: thread (rank r, lane l) keeps the 16-byte vectors i * C * kRegThreads + r * kRegThreads + l,
// i < kV, PACKED (4 registers each), so the row is read from DRAM once and the gradient written from
// registers: the minimum bytes, without version 1's re-read (which missed L2 on the H100: 34% hits,
// 2.2 ms for a 1.4 ms minimum at T = 8192, V = 128256 bf16). Reductions: the max, then (sum of exp,
// sum of x), each over the block (warp shuffles, shared memory) and the cluster (distributed shared
// memory, one cluster barrier), slots alternating by parity. Clusters stride over the rows.
// Measured on the H100 (T = 8192, V = 128256 bf16, clusters of 8, kV = 4, 64 registers): SLOWER than
// version 1 -- 1247 GB/s forward + backward against 1695 -- because only 30 clusters of 8 are resident
// (cudaOccupancyMaxActiveClusters), so 30 rows are in flight and each waits through its loads, two
// cluster reductions and its stores with nothing to overlap (ncu: DRAM 37%, 3.4 ms). To win it would
// need the next row's loads in flight during the reductions, which the 64-register budget does not
// hold (kV = 4 packed vectors + the next row's = 32 registers of data). Kept as the measured rung.
// Rows it takes: vocab a multiple of a vector, rows and gradient 16-byte aligned, at most
// kRegMaxCluster * kRegThreads * kRegMaxVectors vectors (512 KB), enough rows to give every SM a block.
constexpr int kRegThreads = 512;
constexpr int kRegMaxCluster = 8;
constexpr int kRegMaxVectors = 8;   // per thread
constexpr int kRegTargetVectors = 4;  // per thread, before a larger cluster is taken
constexpr int kRegWarps = kRegThreads / 32;

struct RegPlan {
  int cluster = 1;
  int kv = 1;
  int64_t vecs = 0;  // vectors per row
};

using RegSlots = RowReduceSlots<2, kRegWarps, kRegMaxCluster>;

template <typename T, typename I, int kV, bool kCluster>
__global__ void __launch_bounds__(kRegThreads, 2) ce_registers_kernel(const CrossEntropyParams p, const CeScalars sc,
                                                                      const RegPlan plan) {
  constexpr int kVec = kVec16<T>;
  __shared__ RegSlots slots;
  int parity = 0;
  if constexpr (kCluster) ptx::cluster_arrive_relaxed();  // every peer runs before the first DSMEM write
  const int rank = kCluster ? static_cast<int>(ptx::cluster_block_rank()) : 0;
  const int64_t groups = gridDim.x / plan.cluster, group = blockIdx.x / plan.cluster;
  // 32-bit offsets: a row holds at most kRegMaxCluster * kRegThreads * kRegMaxVectors vectors.
  const int span = plan.cluster * kRegThreads, first = rank * kRegThreads + static_cast<int>(threadIdx.x);
  const int vecs = static_cast<int>(plan.vecs);
  const bool lead = rank == 0 && threadIdx.x == 0;
  auto owned = [&](int i) { return first + i * span < vecs; };
  auto at = [&](int i) { return (first + i * span) * kVec; };
  if constexpr (kCluster) ptx::cluster_wait();

  for (int64_t row = group; row < p.rows; row += groups) {
    const T* x = static_cast<const T*>(p.logits) + row * p.ld_logits;
    T* g = p.grad ? static_cast<T*>(p.grad) + row * p.ld_grad : nullptr;
    const int64_t t = target_of<I>(p, row);
    float fill;
    if (skipped_row(p, t, &fill)) {  // the same branch for every thread of the cluster: no reduction
      if (lead) {
        static_cast<float*>(p.loss)[row] = fill;
        if (p.lse) static_cast<float*>(p.lse)[row] = fill;
      }
      if (g) {
        Vec<T, kVec> fv;
#pragma unroll
        for (int j = 0; j < kVec; ++j) fv.v[j] = from_float<T>(fill);
#pragma unroll
        for (int i = 0; i < kV; ++i)
          if (owned(i)) store_vec_once<T, kVec>(g + at(i), fv);
      }
      continue;
    }
    const float x_t = lead ? to_float(x[t]) : 0.0f;  // before the first barrier: in place safe
    Vec<T, kVec> v[kV];
    float m = -INFINITY, sum_x = 0.0f;
#pragma unroll
    for (int i = 0; i < kV; ++i)
      if (owned(i)) {
        v[i] = load_vec_once<T, kVec>(x + at(i));
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float f = to_float(v[i].v[j]);
          m = MaxOp::apply(m, f);  // NaN propagates
          sum_x += f;
        }
      }
    float red[2] = {m, 0.0f};
    row_reduce<MaxOp, kCluster>(red, kRegThreads, plan.cluster, slots, parity);
    m = red[0];
#pragma unroll
    for (int i = 0; i < kV; ++i) keep_packed(v[i]);
    float s = 0.0f;
    if (m != -INFINITY) {  // only -inf: s = 0, lse = -inf (as the CPU rung; exp(-inf - -inf) is NaN)
#pragma unroll
      for (int i = 0; i < kV; ++i)
        if (owned(i))
#pragma unroll
          for (int j = 0; j < kVec; ++j) s += expf(to_float(v[i].v[j]) - m);
    }
    red[0] = s;
    red[1] = sc.ls != 0.0f ? sum_x : 0.0f;
    row_reduce<SumOp, kCluster>(red, kRegThreads, plan.cluster, slots, parity);
    s = red[0];
#pragma unroll
    for (int i = 0; i < kV; ++i) keep_packed(v[i]);
    const MaxSum ms{m, s};
    float lse = 0.0f;
    if (lead) {
      static_cast<float*>(p.loss)[row] = row_loss(ms, red[1], x_t, sc, &lse);
      if (p.lse) static_cast<float*>(p.lse)[row] = lse;
    }
    if (!g) continue;
    lse = m + logf(s);
    const float inv_s = 1.0f / s, c = sc.z != 0.0f ? 1.0f + 2.0f * sc.z * lse : 1.0f, k = grad_factor(p, row);
#pragma unroll
    for (int i = 0; i < kV; ++i)
      if (owned(i)) {
        const int col = at(i);
        Vec<T, kVec> gv;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          float d = expf(to_float(v[i].v[j]) - m) * inv_s * c - sc.ls_over_v;
          if (col + j == t) d -= sc.one_minus_ls;
          gv.v[j] = from_float<T>(d * k);
        }
        store_vec_once<T, kVec>(g + col, gv);
      }
  }
}

// The registers plan for p, or false when version 3 cannot take the call (the streaming versions do).
template <typename T>
bool registers_plan(const CrossEntropyParams& p, const DeviceFacts& facts, RegPlan* out) {
  constexpr int kVec = kVec16<T>;
  auto aligned = [](const void* ptr, int64_t ld) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (ld * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  };
  if (p.vocab % kVec != 0 || !aligned(p.logits, p.ld_logits) || (p.grad && !aligned(p.grad, p.ld_grad))) return false;
  RegPlan plan;
  plan.vecs = p.vocab / kVec;
  if (plan.vecs < kRegThreads) return false;  // short rows: version 1 holds several per SM
  for (plan.cluster = 1;; plan.cluster *= 2) {
    plan.kv = pow2_ceil(ceil_div(plan.vecs, static_cast<int64_t>(plan.cluster) * kRegThreads));
    if (plan.kv <= kRegTargetVectors || plan.cluster == kRegMaxCluster) break;
  }
  if (plan.kv > kRegMaxVectors) return false;
  if (plan.cluster > 1 && facts.compute_capability < 90) return false;  // clusters: sm_90
  if (p.rows * plan.cluster < facts.sm_count) return false;  // few rows: version 2 splits them wider
  *out = plan;
  return true;
}

template <typename T, typename I, int kV, bool kCluster>
cudaError_t launch_registers(const CrossEntropyParams& p, const RegPlan& plan, cudaStream_t stream) {
  auto kernel = ce_registers_kernel<T, I, kV, kCluster>;
  cudaLaunchConfig_t config = {};
  config.blockDim = dim3(kRegThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  int64_t groups = 0;
  if constexpr (kCluster) {
    ptx::set_cluster_dims(config, attribute, static_cast<unsigned>(plan.cluster));
    config.gridDim = dim3(static_cast<unsigned>(plan.cluster));
    int clusters = 0;
    if (cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config); e != cudaSuccess) return e;
    groups = std::max(1, clusters);
  } else {
    const DeviceFacts* facts = nullptr;
    if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
    int per_sm = 0;
    if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kRegThreads, 0); e != cudaSuccess)
      return e;
    groups = static_cast<int64_t>(facts->sm_count) * std::max(1, per_sm);
  }
  groups = std::min(groups, p.rows);
  config.gridDim = dim3(static_cast<unsigned>(groups * plan.cluster));
  if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, p, scalars_of(p), plan); e != cudaSuccess) return e;
  return cudaGetLastError();
}

template <typename T, typename I>
cudaError_t launch_registers_kv(const CrossEntropyParams& p, const RegPlan& plan, cudaStream_t stream) {
  auto go = [&]<int kV>() {
    if constexpr (kV > kRegTargetVectors)  // only on the largest cluster (registers_plan)
      return launch_registers<T, I, kV, true>(p, plan, stream);
    else
      return plan.cluster > 1 ? launch_registers<T, I, kV, true>(p, plan, stream)
                              : launch_registers<T, I, kV, false>(p, plan, stream);
  };
  switch (plan.kv) {
    case 1: return go.template operator()<1>();
    case 2: return go.template operator()<2>();
    case 4: return go.template operator()<4>();
    case 8: return go.template operator()<8>();
    default: return cudaErrorInvalidValue;  // registers_plan caps kv
  }
}

// ---- launch ------------------------------------------------------------------------------------

// Threads for about v work items: a power of two, at most kMaxThreads.
int block_threads(int64_t v) { return std::min(pow2_ceil(v), kMaxThreads); }

// How a call runs: threads per block, and chunks per row (1: version 1).
struct CePlan {
  int threads = 32;
  int64_t chunks = 1;
  int64_t chunk = 0;
};

template <typename T>
cudaError_t plan_of(const CrossEntropyParams& p, CePlan* plan) {
  plan->chunks = 1;
  plan->chunk = p.vocab;
  if (p.vocab >= kSplitMinVocab && p.rows <= kMaxGridY) {
    const DeviceFacts* facts = nullptr;
    if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
    const int64_t want = static_cast<int64_t>(kWaves) * facts->sm_count;
    if (p.rows < want) {
      int64_t chunks = std::min({ceil_div(want, p.rows), ceil_div(p.vocab, kChunkMin), kMaxSplits});
      if (chunks > 1) {
        plan->chunk = ceil_div(ceil_div(p.vocab, chunks), 16) * 16;  // a multiple of 16 elements
        plan->chunks = ceil_div(p.vocab, plan->chunk);
      }
    }
  }
  // Threads: about two 16-byte vectors each, whole warps, at most kMaxThreads.
  plan->threads = std::max(32, block_threads(ceil_div(ceil_div(plan->chunk, kVec16<T>), 2)));
  return cudaSuccess;
}

// registers: version 3 where it takes the call (a workspace query answers for versions 1 and 2: the
// most any call of those sizes needs).
template <typename T, typename I>
cudaError_t launch(const CrossEntropyParams& p, const Workspace& workspace, cudaStream_t stream, size_t* measure,
                   bool registers) {
  if (registers && !measure) {
    const DeviceFacts* facts = nullptr;
    if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
    if (RegPlan rp; registers_plan<T>(p, *facts, &rp)) return launch_registers_kv<T, I>(p, rp, stream);
  }
  CePlan plan;
  if (cudaError_t e = plan_of<T>(p, &plan); e != cudaSuccess) return e;
  WorkspaceArena arena = measure ? WorkspaceArena() : WorkspaceArena(workspace);
  CePartial* partial = plan.chunks > 1 ? arena.take<CePartial>(p.rows * plan.chunks) : nullptr;
  if (measure) {
    *measure = arena.peak();
    return cudaSuccess;
  }
  if (!arena.ok()) return cudaErrorInvalidValue;
  const CeScalars sc = scalars_of(p);
  if (plan.chunks == 1) {
    const unsigned blocks = static_cast<unsigned>(std::min(p.rows, kMaxRowBlocks));
    ce_row_kernel<T, I><<<blocks, plan.threads, 0, stream>>>(p, sc);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>(plan.chunks), static_cast<unsigned>(p.rows));
  ce_partial_kernel<T, I><<<grid, plan.threads, 0, stream>>>(p, sc, plan.chunk, partial);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const dim3 finish(p.grad ? static_cast<unsigned>(plan.chunks) : 1u, static_cast<unsigned>(p.rows));
  ce_finish_kernel<T, I><<<finish, plan.threads, 0, stream>>>(p, sc, plan.chunk, plan.chunks, partial);
  return cudaGetLastError();
}

cudaError_t route(const CrossEntropyParams& p, const Workspace& workspace, cudaStream_t stream, size_t* measure,
                  bool registers) {
  return dispatch_built_dtype(p.dtype, cudaErrorInvalidValue, [&]<DType kD>() {
    using T = cuda_type_t<kD>;
    if (p.target_dtype == DType::kI32) return launch<T, int32_t>(p, workspace, stream, measure, registers);
    if (p.target_dtype == DType::kI64) return launch<T, int64_t>(p, workspace, stream, measure, registers);
    return cudaErrorInvalidValue;
  });
}

// ---- the backward: a stored gradient times the upstream gradient, in place ---------------------
// Work items (row, chunk of kScaleChunk elements) strided over the grid; an item whose factor is
// exactly 1 is skipped unread, and with one factor for every row (stride 0) a block that meets a 1
// stops at once: loss.backward()'s usual upstream 1 costs a launch.
constexpr int64_t kScaleChunk = 8192;  // a multiple of 16 elements: chunks keep the row's alignment
constexpr int kScaleBlocksPerSm = 8;

template <typename T>
__global__ void __launch_bounds__(kMaxThreads) ce_scale_kernel(const CrossEntropyParams p, int64_t chunk,
                                                               int64_t chunks) {
  const float* factor = static_cast<const float*>(p.grad_scale);
  for (int64_t item = blockIdx.x; item < p.rows * chunks; item += gridDim.x) {
    const int64_t row = item / chunks, c = item % chunks;
    const float f = factor[row * p.grad_scale_stride];
    if (f == 1.0f) {
      if (p.grad_scale_stride == 0) return;  // the same for every item
      continue;
    }
    const int64_t begin = c * chunk;
    T* g = static_cast<T*>(p.grad) + row * p.ld_grad + begin;
    for_each_aligned(g, std::min(chunk, p.vocab - begin), true, threadIdx.x, blockDim.x, [&]<int kVec>(int64_t i) {
      Vec<T, kVec> v = load_vec_once<T, kVec>(g + i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v.v[j] = from_float<T>(to_float(v.v[j]) * f);
      store_vec_once<T, kVec>(g + i, v);
    });
  }
}

template <typename T>
cudaError_t launch_scale(const CrossEntropyParams& p, cudaStream_t stream) {
  const DeviceFacts* facts = nullptr;
  if (cudaError_t e = current_device_facts(&facts); e != cudaSuccess) return e;
  const int64_t chunk = std::min(p.vocab, kScaleChunk), chunks = ceil_div(p.vocab, chunk);
  const int64_t blocks = std::min(p.rows * chunks, static_cast<int64_t>(kScaleBlocksPerSm) * facts->sm_count);
  const int threads = std::max(32, block_threads(ceil_div(ceil_div(chunk, kVec16<T>), 4)));
  ce_scale_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, chunk, chunks);
  return cudaGetLastError();
}

}  // namespace

cudaError_t cross_entropy_scale_grad(const CrossEntropyParams& p, cudaStream_t stream) {
  return dispatch_built_dtype(p.dtype, cudaErrorInvalidValue,
                              [&]<DType kD>() { return launch_scale<cuda_type_t<kD>>(p, stream); });
}

cudaError_t cross_entropy_fused(const CrossEntropyParams& p, const Workspace& workspace, cudaStream_t stream) {
  return route(p, workspace, stream, nullptr, false);
}

cudaError_t cross_entropy_fused_workspace(const CrossEntropyParams& p, size_t* bytes) {
  return route(p, {}, nullptr, bytes, false);
}

cudaError_t cross_entropy_registers(const CrossEntropyParams& p, const Workspace& workspace, cudaStream_t stream) {
  return route(p, workspace, stream, nullptr, true);
}

cudaError_t cross_entropy_registers_workspace(const CrossEntropyParams& p, size_t* bytes) {
  return route(p, {}, nullptr, bytes, true);
}

}  // namespace optimized::cuda
