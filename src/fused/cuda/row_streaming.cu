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
#include <algorithm>

#include "fused/cuda/fused_common.cuh"

namespace optimized::fused_cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

using Kind = RowKind;

// Block-wide reduction of N values (sum, or max for `kMax` on value 0); every thread gets the
// totals. `scratch` holds kWarps * N floats; the trailing barrier makes it reusable at once.
template <int N>
__device__ __forceinline__ void block_sum(float (&v)[N], float* scratch) {
#pragma unroll
  for (int k = 0; k < N; ++k)
    for (int o = 16; o > 0; o /= 2) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[warp * N + k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float t = 0.0f;
    for (int w = 0; w < kWarps; ++w) t += scratch[w * N + k];
    v[k] = t;
  }
  __syncthreads();
}

// Online-softmax state: running max m and sum s of exp(x - m).
struct MaxSum {
  float m = -INFINITY, s = 0.0f;
};
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, a.s + b.s};  // only -inf so far (0), or NaN seen: exp(-inf - -inf) is NaN
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ MaxSum block_max_sum(MaxSum v, float* scratch) {
  for (int o = 16; o > 0; o /= 2) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = combine(v, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    scratch[2 * warp] = v.m;
    scratch[2 * warp + 1] = v.s;
  }
  __syncthreads();
  MaxSum t;
  for (int w = 0; w < kWarps; ++w) t = combine(t, {scratch[2 * w], scratch[2 * w + 1]});
  __syncthreads();
  return t;
}

template <typename T, int kVec, Kind kKind>
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
    if constexpr (kKind == Kind::kSoftmaxFwd) {
      const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
      MaxSum ms;
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, kVec> xv = load_vec<T, kVec>(xr + v * kVec);
        float x[kVec], vmax = -INFINITY;
        bool nan = false;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          x[j] = __fmul_rn(sc.scale, to_float(xv.v[j]));
          vmax = fmaxf(vmax, x[j]);  // fmaxf drops NaN: it is carried in the sum instead
          nan |= isnan(x[j]);
        }
        MaxSum chunk{vmax, 0.0f};
        if (vmax != -INFINITY)
#pragma unroll
          for (int j = 0; j < kVec; ++j) chunk.s += expf(x[j] - vmax);  // +inf - +inf: NaN, as torch
        if (nan) chunk.s = NAN;
        ms = combine(ms, chunk);
      }
      ms = block_max_sum(ms, scratch);
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
    } else if constexpr (kKind == Kind::kNormFwd) {
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
    } else if constexpr (kKind == Kind::kSoftmaxBwd) {
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

template <typename T, int kVec, Kind kKind>
void launch_instance(const FusedParams& p, cudaStream_t stream) {
  auto kernel = row_streaming_kernel<T, kVec, kKind>;
  const int64_t blocks = std::min<int64_t>(p.rows, resident_blocks(kernel, kThreads, 0, "row_streaming"));
  const bool wants_partials = kKind == Kind::kNormBwd && (p.dweight || p.dbias);
  StreamScratch partial(wants_partials ? static_cast<size_t>(blocks) * 2 * p.width * sizeof(float) : 0, stream);
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, scalars_f32(p), partial.floats());
  check_launch("row_streaming_kernel launch");
  if (wants_partials) {
    if (p.dweight) launch_column_sum(partial.floats(), blocks, p.width, 2 * p.width, p.dweight, p.dtype, stream);
    if (p.dbias)
      launch_column_sum(partial.floats() + p.width, blocks, p.width, 2 * p.width, p.dbias, p.dtype, stream);
  }
}

template <typename T, Kind kKind>
void launch_kind(const FusedParams& p, cudaStream_t stream) {
  if (fused_rows_aligned(p))
    launch_instance<T, kVec16<T>, kKind>(p, stream);
  else
    launch_instance<T, 1, kKind>(p, stream);
}

}  // namespace

}  // namespace optimized::fused_cuda

namespace optimized {

void launch_fused_streaming(const FusedParams& p, void* stream_ptr) {
  using fused_cuda::Kind;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  fused_cuda::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (fused_cuda::row_kind_of(p)) {
      case Kind::kSoftmaxFwd: fused_cuda::launch_kind<T, Kind::kSoftmaxFwd>(p, stream); break;
      case Kind::kNormFwd: fused_cuda::launch_kind<T, Kind::kNormFwd>(p, stream); break;
      case Kind::kSoftmaxBwd: fused_cuda::launch_kind<T, Kind::kSoftmaxBwd>(p, stream); break;
      case Kind::kNormBwd: fused_cuda::launch_kind<T, Kind::kNormBwd>(p, stream); break;
    }
  });
}

}  // namespace optimized
