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
//     own columns in registers over every row it visits, and writes one partial per block, summed
//     by column_sum_kernel. Partial buffers alternate by reduction parity, so one barrier per
//     reduction suffices.
//
// Measured (docs/perf-notes/fused.md): 0.5-0.87x of the copy bandwidth on the H100; a block does
// not load its next row group before the current one is written, which is the next thing to fix.
//
// This header holds the whole story (config, reductions, kernel, launch); the build instantiates
// fused_registers_dtype once per dtype of OPTIMIZED_DTYPES, each in its own generated translation
// unit (cmake/dtype_instance.cu.in), so the ~40 kernels of a dtype compile in parallel with the
// others' and a developer can build one dtype alone.
#pragma once

#include <algorithm>
#include <type_traits>

#include "fused/cuda/fused_common.cuh"
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
// Shared state of the row reductions of one block: per-warp partials and (clusters) the partials
// of every block of the cluster, each double-buffered by reduction parity.
template <int N>
struct ReduceSmem {
  float warp[2][kShortRowBlock / 32 > kMaxWarpsPerRow ? kShortRowBlock / 32 : kMaxWarpsPerRow][N];
  float cluster[2][kMaxCluster][N];
};

// Reduces v[0..N) over the threads of one row (all of them: every thread of the block must call
// it, the same number of times). Returns with every thread of the row holding the totals. The
// slots alternate by parity (kernels/reduce.cuh): one barrier per reduction.
template <int N, typename Op, bool kCluster>
__device__ __forceinline__ void row_reduce(float (&v)[N], int tpr, int cluster, ReduceSmem<N>& smem,
                                           int& parity) {
  const int buf = parity;
  parity ^= 1;
  segment_reduce<Op, N>(v, tpr, smem.warp[buf]);
  if constexpr (kCluster) {
    // Every block of the cluster holds one row slice (rows_per_block == 1); the kernel's start
    // barrier made sure every peer runs before this writes into it.
    cluster_reduce<Op, N>(v, cluster, smem.cluster[buf]);
  }
}

// One row of `out` (width floats) per block: the rows a block holds meet in shared memory first
// (row slot 0 collects), then row slot 0 writes its columns. Called by every thread of the block.
template <int kV, int kVec, typename ColOf, typename InRow>
__device__ __forceinline__ void write_partial(float (&acc)[kV][kVec], const Plan& plan, int row_slot,
                                              int lane, int tpr, float* out, ColOf col_of, InRow in_row) {
  extern __shared__ float collect[];  // rows_per_block * tpr * kV * kVec floats when > 1 row
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

// ---- the kernel ----------------------------------------------------------------------------
// T: element type; kVec: elements per vector (16 bytes, or 1 for unaligned rows); kV: vectors
// per thread; kKind: which op group and direction; kCluster: rows span a cluster.
template <typename T, int kVec, int kV, FusedKernel kKind, bool kCluster>
__global__ void __launch_bounds__(kMaxThreadsPerRow) row_registers_kernel(const FusedParams p, const Plan plan,
                                                                          const FusedScalarsF32 sc,
                                                                          float* __restrict__ partial) {
  constexpr bool kBackward = kKind == FusedKernel::kSoftmaxBwd || kKind == FusedKernel::kNormBwd;
  constexpr bool kNorm = kKind == FusedKernel::kNormFwd || kKind == FusedKernel::kNormBwd;
  __shared__ ReduceSmem<2> smem;
  int parity = 0;  // of the next reduction's slots
  // Clusters: every block of the cluster must run before any writes into a peer's shared memory
  // (racecheck found the writes of a lazy start). One barrier here, its wait after this block's
  // set-up: a flag checked at every reduction (the lazy wait) cost the unaligned backward 23
  // registers and a third of its occupancy (40 -> 63, 3 -> 2 blocks per SM).
  if constexpr (kCluster) ptx::cluster_arrive_relaxed();

  const int tpr = plan.tpr;
  const int lane = threadIdx.x % tpr;
  const int row_slot = threadIdx.x / tpr;
  int rank = 0, num_groups = gridDim.x, group = blockIdx.x;
  if constexpr (kCluster) {
    rank = static_cast<int>(ptx::cluster_block_rank());
    num_groups = gridDim.x / plan.cluster;
    group = blockIdx.x / plan.cluster;
  }
  const int64_t stride_vecs = static_cast<int64_t>(plan.cluster) * tpr;
  const int64_t first_vec = static_cast<int64_t>(rank) * tpr + lane;
  const int64_t width = p.width;
  const float inv_width = 1.0f / static_cast<float>(width);
  const bool layer = p.is_layer_norm();
  const bool log = p.op == FusedOp::kLogSoftmax;

  auto col_of = [&](int i) { return (first_vec + i * stride_vecs) * kVec; };
  auto in_row = [&](int i) { return first_vec + i * stride_vecs < plan.vecs; };

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
  // Backward of the norms: this thread's share of dweight / dbias over the rows it visits.
  float dw[kBackward && kNorm ? kV : 1][kVec] = {}, db[kBackward && kNorm ? kV : 1][kVec] = {};

  if constexpr (kCluster) ptx::cluster_wait();

  const int64_t rows_per_group = plan.rows_per_block;
  const int64_t iterations = (p.rows + rows_per_group * num_groups - 1) / (rows_per_group * num_groups);
  for (int64_t it = 0; it < iterations; ++it) {
    const int64_t row = (it * num_groups + group) * rows_per_group + row_slot;
    const bool live = row < p.rows;  // dead rows still join the reductions (barriers)

    if constexpr (kKind == FusedKernel::kSoftmaxFwd) {
      const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
      float v[kV][kVec];
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        Vec<T, kVec> xv;
        const bool ok = live && in_row(i);
        if (ok) xv = load_vec_once<T, kVec>(xr + col_of(i));
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          v[i][j] = ok ? sc.scale * to_float(xv.v[j]) : -INFINITY;
          m = MaxOp::apply(m, v[i][j]);  // NaN propagates
        }
      }
      float red[2] = {m, 0.0f};
      row_reduce<2, MaxOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      m = red[0];
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i)
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          // exp(-inf - m) = 0 for padding; a row of all -inf, or with a NaN, gives NaN, as torch does.
          const float e = expf(v[i][j] - m);
          if (in_row(i)) s += e;
          // softmax keeps e; log_softmax keeps scale * x and writes (scale * x - m) - log(s), which
          // stays exact where e underflows.
          if (!log) v[i][j] = e;
        }
      red[0] = s;
      red[1] = 0.0f;
      row_reduce<2, SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      const float inv_s = 1.0f / red[0], log_s = logf(red[0]);
      T* yr = static_cast<T*>(p.y) + row * p.ld_y;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if (!(live && in_row(i))) continue;
        Vec<T, kVec> yv;
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          yv.v[j] = from_float<T>(log ? (v[i][j] - m) - log_s : v[i][j] * inv_s);
        store_vec<T, kVec>(yr + col_of(i), yv);
      }
    } else if constexpr (kKind == FusedKernel::kNormFwd) {
      const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
      const T* rr = static_cast<const T*>(p.residual) + row * p.ld_residual;
      T* ror = static_cast<T*>(p.residual_out) + row * p.ld_residual_out;
      float h[kV][kVec];
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const bool ok = live && in_row(i);
        Vec<T, kVec> xv, rv;
        if (ok) {
          xv = load_vec_once<T, kVec>(xr + col_of(i));
          if (p.residual) rv = load_vec_once<T, kVec>(rr + col_of(i));
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          float value = ok ? to_float(xv.v[j]) : 0.0f;
          if (p.residual && ok) {
            // h is rounded to the dtype: residual_out holds it, and backward reads that.
            const T hv = from_float<T>(value + to_float(rv.v[j]));
            rv.v[j] = hv;
            value = to_float(hv);
          }
          h[i][j] = value;
          sum += value;
        }
        if (p.residual && ok) store_vec<T, kVec>(ror + col_of(i), rv);
      }
      float mean = 0.0f;
      float red[2] = {sum, 0.0f};
      if (layer) {
        row_reduce<2, SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
        mean = red[0] * inv_width;
      }
      float sq = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i)
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = in_row(i) && live ? h[i][j] - mean : 0.0f;
          sq += d * d;
        }
      red[0] = sq;
      red[1] = 0.0f;
      row_reduce<2, SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      const float rstd = 1.0f / sqrtf(red[0] * inv_width + sc.eps);
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
        for (int j = 0; j < kVec; ++j) yv.v[j] = from_float<T>((h[i][j] - mean) * rstd * w[j] + b[j]);
        store_vec<T, kVec>(yr + col_of(i), yv);
      }
    } else if constexpr (kKind == FusedKernel::kSoftmaxBwd) {
      const T* yr = static_cast<const T*>(p.x) + row * p.ld_x;  // the forward output
      const T* dyr = static_cast<const T*>(p.dy) + row * p.ld_dy;
      float y[kV][kVec], g[kV][kVec];
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const bool ok = live && in_row(i);
        Vec<T, kVec> yv, gv;
        if (ok) {
          yv = load_vec_once<T, kVec>(yr + col_of(i));
          gv = load_vec_once<T, kVec>(dyr + col_of(i));
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          y[i][j] = ok ? to_float(yv.v[j]) : 0.0f;
          g[i][j] = ok ? to_float(gv.v[j]) : 0.0f;
          s += log ? g[i][j] : g[i][j] * y[i][j];
        }
      }
      float red[2] = {s, 0.0f};
      row_reduce<2, SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      s = red[0];
      T* dxr = static_cast<T*>(p.dx) + row * p.ld_dx;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if (!(live && in_row(i))) continue;
        Vec<T, kVec> dv;
#pragma unroll
        for (int j = 0; j < kVec; ++j)
          dv.v[j] = from_float<T>(log ? sc.scale * (g[i][j] - expf(y[i][j]) * s) : sc.scale * y[i][j] * (g[i][j] - s));
        store_vec<T, kVec>(dxr + col_of(i), dv);
      }
    } else {  // kNormBwd
      const T* hr = static_cast<const T*>(p.x) + row * p.ld_x;
      const T* dyr = static_cast<const T*>(p.dy) + row * p.ld_dy;
      const float mean = live && layer ? p.mean[row] : 0.0f;
      const float rstd = live ? p.rstd[row] : 0.0f;
      float xhat[kV][kVec], dy[kV][kVec];
      float a = 0.0f, bsum = 0.0f;  // sum(g * xhat), sum(g), g = dy * weight
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const bool ok = live && in_row(i);
        Vec<T, kVec> hv, gv;
        float w[kVec];
        if (ok) {
          hv = load_vec_once<T, kVec>(hr + col_of(i));
          gv = load_vec_once<T, kVec>(dyr + col_of(i));
          load_affine(wp, i, w, 1.0f);
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          xhat[i][j] = ok ? (to_float(hv.v[j]) - mean) * rstd : 0.0f;
          dy[i][j] = ok ? to_float(gv.v[j]) : 0.0f;
          const float g = ok ? dy[i][j] * w[j] : 0.0f;
          a += g * xhat[i][j];
          bsum += g;
          dw[i][j] += dy[i][j] * xhat[i][j];
          db[i][j] += dy[i][j];
        }
      }
      float red[2] = {a, bsum};
      row_reduce<2, SumOp, kCluster>(red, tpr, plan.cluster, smem, parity);
      const float mean_gx = red[0] * inv_width, mean_g = layer ? red[1] * inv_width : 0.0f;
      const T* dror = static_cast<const T*>(p.dresidual_out) + row * p.ld_dresidual_out;
      T* dxr = static_cast<T*>(p.dx) + row * p.ld_dx;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        if (!(live && in_row(i))) continue;
        Vec<T, kVec> extra, dv;
        if (p.dresidual_out) extra = load_vec_once<T, kVec>(dror + col_of(i));
        float w[kVec];
        load_affine(wp, i, w, 1.0f);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          float d = rstd * (dy[i][j] * w[j] - mean_g - xhat[i][j] * mean_gx);
          if (p.dresidual_out) d += to_float(extra.v[j]);
          dv.v[j] = from_float<T>(d);
        }
        store_vec<T, kVec>(dxr + col_of(i), dv);
      }
    }
  }

  if constexpr (kBackward && kNorm) {
    if (p.dweight) write_partial<kV, kVec>(dw, plan, row_slot, lane, tpr, partial + 2 * group * width, col_of, in_row);
    if (p.dbias) write_partial<kV, kVec>(db, plan, row_slot, lane, tpr, partial + 2 * group * width + width, col_of, in_row);
  }
}

// ---- host side -----------------------------------------------------------------------------

int pow2_ceil(int64_t v) {
  int r = 1;
  while (r < v) r *= 2;
  return r;
}

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
  const bool collects = (kKind == FusedKernel::kNormBwd) && plan.rows_per_block > 1 && (p.dweight || p.dbias);
  const size_t dyn_smem = collects ? static_cast<size_t>(block) * kV * kVec * sizeof(float) : 0;
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
  cudaLaunchAttribute attribute[1];
  if (kCluster) {
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = static_cast<unsigned>(plan.cluster);
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
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
