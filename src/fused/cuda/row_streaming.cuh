// fused_streaming: the long-row design. One kernel per op; a block of 512 threads takes a whole
// row and streams it from global memory in passes, so a row of any length fits:
//
//   softmax fwd    pass 1: running max and rescaled sum (online softmax)   pass 2: write y
//   norm fwd       pass 1: (add form: write h) sum of h   pass 2: sum of (h - mean)^2
//                  pass 3: write y (rms_norm: passes 1 and 2 are one)
//   softmax bwd    pass 1: sum(dy * y) or sum(dy)                           pass 2: write dx
//   norm bwd       pass 1: sum(g * xhat), sum(g)    pass 2: write dx, add dweight / dbias terms
//
// The second pass re-reads the row, mostly from L2 (a block's row is at most a few hundred KB and
// a few hundred blocks are resident), so the DRAM bytes stay near the minimum while the row is
// far longer than registers could hold. The variance is summed around the exact mean in its own
// pass: a one-pass E[h^2] - E[h]^2 (even shifted) cancels when the mean is large against the spread.
// dweight / dbias: each block keeps an fp32 row of partial sums in global memory for its columns
// (read-modify-write per row it visits: acceptable because this design serves long rows, which
// are few), summed by column_sum_kernel at the end.
//
// The build instantiates fused_streaming_dtype once per dtype of OPTIMIZED_DTYPES, each in its own
// generated translation unit (cmake/dtype_instance.cu.in).
#pragma once

#include <algorithm>

#include "fused/cuda/fused_common.cuh"
#include "kernels/online_softmax.cuh"

namespace optimized::cuda::fused {

namespace {

// ---- config (src/fused/fused_config.h) -----------------------------------------------------
constexpr int kThreads = kConfig.streaming_threads;
constexpr int kWarps = kThreads / 32;
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, one block");

// Block-wide sums of N values (kernels/reduce.cuh); every thread gets the totals, and `scratch`
// (kWarps * N floats) is reusable at once.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float* scratch) {
  block_reduce<SumOp, N>(v, kThreads, reinterpret_cast<float(*)[N]>(scratch));
}

template <typename T, int kVec, FusedKernel kKind>
__global__ void __launch_bounds__(kThreads) row_streaming_kernel(const FusedParams p, const FusedScalarsF32 sc,
                                                                  float* __restrict__ partial) {
  __shared__ float scratch[kWarps * 2];
  const int64_t width = p.width;
  const int64_t vecs = width / kVec;  // kVec divides the width (else kVec == 1)
  const float inv_width = 1.0f / static_cast<float>(width);
  const bool layer = p.is_layer_norm();
  const bool log = p.op == FusedOp::kLogSoftmax;
  const T* wp = static_cast<const T*>(p.weight);
  const T* bp = static_cast<const T*>(p.bias);
  float* my_partial = partial ? partial + static_cast<int64_t>(blockIdx.x) * 2 * width : nullptr;
  bool first_row_of_block = true;

  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    if constexpr (kKind == FusedKernel::kSoftmaxFwd) {
      const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
      MaxSum ms;  // online softmax (kernels/online_softmax.cuh): NaN propagates through m and s
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> xv = load_vec<T, kVec>(xr + v * kVec);
        float x[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) x[j] = __fmul_rn(sc.scale, to_float(xv.v[j]));
        ms = merge(ms, max_sum_of<kVec>(x));
      }
      ms = block_merge(ms, kThreads, scratch);
      const float inv_s = 1.0f / ms.s, log_s = logf(ms.s);
      T* yr = static_cast<T*>(p.y) + row * p.ld_y;
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> xv = load_vec<T, kVec>(xr + v * kVec);
        Vec<T, kVec> yv;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = __fmul_rn(sc.scale, to_float(xv.v[j])) - ms.m;  // no fma: the max was rounded
          yv.v[j] = from_float<T>(log ? d - log_s : expf(d) * inv_s);
        }
        store_vec<T, kVec>(yr + v * kVec, yv);
      }
    } else if constexpr (kKind == FusedKernel::kNormFwd) {
      const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
      const T* rr = static_cast<const T*>(p.residual) + row * p.ld_residual;
      T* hr = static_cast<T*>(p.residual_out) + row * p.ld_residual_out;
      // Pass 1: h (add form: x + residual, rounded and written to residual_out) and its sum.
      float sums[1] = {0.0f}, sq[1] = {0.0f};  // sum(h); rms_norm: sum(h^2)
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        Vec<T, kVec> hv = load_vec<T, kVec>(xr + v * kVec);
        if (p.residual) {
          const Vec<T, kVec> rv = load_vec<T, kVec>(rr + v * kVec);
#pragma unroll
          for (int j = 0; j < kVec; ++j) hv.v[j] = from_float<T>(to_float(hv.v[j]) + to_float(rv.v[j]));
          store_vec<T, kVec>(hr + v * kVec, hv);
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float h = to_float(hv.v[j]);
          sums[0] += h;
          sq[0] += h * h;
        }
      }
      const T* src = p.residual ? hr : xr;  // later passes read h back (this thread wrote it)
      float mean = 0.0f;
      if (layer) {
        block_sum<1>(sums, scratch);
        mean = sums[0] * inv_width;
      }
      // Pass 2 (from L2; layer_norm only): the sum of squared deviations from the exact mean.
      if (layer) sq[0] = 0.0f;
      for (int64_t v = threadIdx.x; layer && v < vecs; v += kThreads) {
        const Vec<T, kVec> hv = load_vec<T, kVec>(src + v * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float d = to_float(hv.v[j]) - mean;
          sq[0] += d * d;
        }
      }
      block_sum<1>(sq, scratch);
      const float rstd = 1.0f / sqrtf(sq[0] * inv_width + sc.eps);
      if (threadIdx.x == 0) {
        if (p.mean) p.mean[row] = mean;
        if (p.rstd) p.rstd[row] = rstd;
      }
      T* yr = static_cast<T*>(p.y) + row * p.ld_y;
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> hv = load_vec<T, kVec>(src + v * kVec);
        Vec<T, kVec> wv, bv, yv;
        if (wp) wv = load_vec<T, kVec>(wp + v * kVec);
        if (bp) bv = load_vec<T, kVec>(bp + v * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float w = wp ? to_float(wv.v[j]) : 1.0f, b = bp ? to_float(bv.v[j]) : 0.0f;
          yv.v[j] = from_float<T>((to_float(hv.v[j]) - mean) * rstd * w + b);
        }
        store_vec<T, kVec>(yr + v * kVec, yv);
      }
    } else if constexpr (kKind == FusedKernel::kSoftmaxBwd) {
      const T* yr = static_cast<const T*>(p.x) + row * p.ld_x;  // the forward output
      const T* dyr = static_cast<const T*>(p.dy) + row * p.ld_dy;
      float s[1] = {0.0f};
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> yv = load_vec<T, kVec>(yr + v * kVec), gv = load_vec<T, kVec>(dyr + v * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) s[0] += log ? to_float(gv.v[j]) : to_float(gv.v[j]) * to_float(yv.v[j]);
      }
      block_sum<1>(s, scratch);
      T* dxr = static_cast<T*>(p.dx) + row * p.ld_dx;
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> yv = load_vec<T, kVec>(yr + v * kVec), gv = load_vec<T, kVec>(dyr + v * kVec);
        Vec<T, kVec> dv;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float y = to_float(yv.v[j]), g = to_float(gv.v[j]);
          dv.v[j] = from_float<T>(log ? sc.scale * (g - expf(y) * s[0]) : sc.scale * y * (g - s[0]));
        }
        store_vec<T, kVec>(dxr + v * kVec, dv);
      }
    } else {  // kNormBwd
      const T* hr = static_cast<const T*>(p.x) + row * p.ld_x;
      const T* dyr = static_cast<const T*>(p.dy) + row * p.ld_dy;
      const float mean = layer ? p.mean[row] : 0.0f, rstd = p.rstd[row];
      float sums[2] = {0.0f, 0.0f};  // sum(g * xhat), sum(g)
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> hv = load_vec<T, kVec>(hr + v * kVec), gv = load_vec<T, kVec>(dyr + v * kVec);
        Vec<T, kVec> wv;
        if (wp) wv = load_vec<T, kVec>(wp + v * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float g = to_float(gv.v[j]) * (wp ? to_float(wv.v[j]) : 1.0f);
          sums[0] += g * (to_float(hv.v[j]) - mean) * rstd;
          sums[1] += g;
        }
      }
      block_sum<2>(sums, scratch);
      const float mean_gx = sums[0] * inv_width, mean_g = layer ? sums[1] * inv_width : 0.0f;
      const T* dror = static_cast<const T*>(p.dresidual_out) + row * p.ld_dresidual_out;
      T* dxr = static_cast<T*>(p.dx) + row * p.ld_dx;
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> hv = load_vec<T, kVec>(hr + v * kVec), gv = load_vec<T, kVec>(dyr + v * kVec);
        Vec<T, kVec> wv, ev, dv;
        if (wp) wv = load_vec<T, kVec>(wp + v * kVec);
        if (p.dresidual_out) ev = load_vec<T, kVec>(dror + v * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float dy = to_float(gv.v[j]), xhat = (to_float(hv.v[j]) - mean) * rstd;
          float d = rstd * (dy * (wp ? to_float(wv.v[j]) : 1.0f) - mean_g - xhat * mean_gx);
          if (p.dresidual_out) d += to_float(ev.v[j]);
          dv.v[j] = from_float<T>(d);
          if (my_partial) {
            const int64_t c = v * kVec + j;
            float* pw = my_partial + c;
            float* pb = my_partial + width + c;
            if (p.dweight) *pw = (first_row_of_block ? 0.0f : *pw) + dy * xhat;
            if (p.dbias) *pb = (first_row_of_block ? 0.0f : *pb) + dy;
          }
        }
        store_vec<T, kVec>(dxr + v * kVec, dv);
      }
    }
    first_row_of_block = false;
  }
}

template <typename T, int kVec, FusedKernel kKind>
cudaError_t launch_instance(const FusedParams& p, const Workspace& workspace, cudaStream_t stream, size_t* measure) {
  // dweight / dbias: one fp32 partial row each per block, (block, which, column).
  const bool wants_partials = kKind == FusedKernel::kNormBwd && (p.dweight || p.dbias);
  if (measured_without_scratch(wants_partials, measure)) return cudaSuccess;
  auto kernel = row_streaming_kernel<T, kVec, kKind>;
  int64_t resident = 0;
  if (cudaError_t e = resident_blocks(kernel, kThreads, 0, &resident); e != cudaSuccess) return e;
  const int64_t blocks = std::min<int64_t>(p.rows, resident);
  const PartialRows partial = partial_rows(workspace, measure, wants_partials ? blocks * 2 * p.width : 0);
  if (!partial.launch) return partial.status;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, scalars_f32(p), partial.data);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return wants_partials ? launch_parameter_sums<T>(partial.data, blocks, p, stream) : cudaSuccess;
}

}  // namespace

}  // namespace optimized::cuda::fused

namespace optimized::cuda {

template <DType kDType>
cudaError_t fused_streaming_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream,
                                  size_t* measure) {
  using T = kernels::cuda_type_t<kDType>;
  using fused::FusedKernel;
  return fused::dispatch_kernel<T, FusedKernel::kSoftmaxFwd, FusedKernel::kNormFwd, FusedKernel::kSoftmaxBwd,
                                FusedKernel::kNormBwd>(p, [&]<FusedKernel kKind, int kVec>() {
    return fused::launch_instance<T, kVec, kKind>(p, workspace, stream, measure);
  });
}

}  // namespace optimized::cuda
