// The fused kernels of the elementwise ops (both fused variants run them: with no reduction over
// the row there is no short-row / long-row distinction):
//   bias_gelu fwd:     y = gelu(x + bias)                   read x, bias; write y
//   bias_gelu bwd:     dx = dy * gelu'(x + bias); dbias     read dy, x, bias; write dx
//   silu_and_mul fwd:  y = silu(a) * b                      read a, b; write y
//   silu_and_mul bwd:  da = dy * b * silu'(a), db = dy * silu(a)
// One pass, 16-byte vectors where rows allow, x + bias kept in fp32 (never rounded in between).
//
// Work layout: a block is threads_x columns (vectors) by threads_y rows; blocks tile the columns
// along grid.x and stride over the rows along grid.y. A thread's columns never change, so
// dbias accumulates in registers over every row the thread visits; the threads_y rows of a block
// meet in shared memory and each block row of the grid leaves one fp32 partial row, summed by
// column_sum_kernel.
//
// The build instantiates fused_elementwise_dtype once per dtype of OPTIMIZED_DTYPES, each in its
// own generated translation unit (cmake/dtype_instance.cu.in).
#pragma once

#include <algorithm>

#include "fused/cuda/fused_common.cuh"

namespace optimized::cuda::fused {

namespace {

// ---- config (src/fused/fused_config.h) -----------------------------------------------------
constexpr int kThreads = kConfig.elementwise_threads;
constexpr int kWaves = kConfig.elementwise_waves;
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, one block");

template <typename T, int kVec, FusedKernel kKind>
__global__ void __launch_bounds__(kThreads) elementwise_kernel(const FusedParams p, float* __restrict__ partial) {
  const int64_t vecs = p.width / kVec;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool live_col = v < vecs;
  const int64_t col = v * kVec;
  const bool tanh_form = p.gelu == GeluApproximation::kTanh;
  float bias[kVec], dbias[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    bias[j] = 0.0f;
    dbias[j] = 0.0f;
  }
  if constexpr (kKind == FusedKernel::kGeluFwd || kKind == FusedKernel::kGeluBwd) {
    if (p.bias && live_col) {
      const Vec<T, kVec> bv = load_vec<T, kVec>(static_cast<const T*>(p.bias) + col);
#pragma unroll
      for (int j = 0; j < kVec; ++j) bias[j] = to_float(bv.v[j]);
    }
  }
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; live_col && row < p.rows;
       row += row_step) {
    const T* xr = static_cast<const T*>(p.x) + row * p.ld_x;
    if constexpr (kKind == FusedKernel::kGeluFwd) {
      const Vec<T, kVec> xv = load_vec_once<T, kVec>(xr + col);
      Vec<T, kVec> yv;
#pragma unroll
      for (int j = 0; j < kVec; ++j) yv.v[j] = from_float<T>(gelu(to_float(xv.v[j]) + bias[j], tanh_form));
      store_vec<T, kVec>(static_cast<T*>(p.y) + row * p.ld_y + col, yv);
    } else if constexpr (kKind == FusedKernel::kGeluBwd) {
      const Vec<T, kVec> xv = load_vec_once<T, kVec>(xr + col);
      const Vec<T, kVec> gv = load_vec_once<T, kVec>(static_cast<const T*>(p.dy) + row * p.ld_dy + col);
      Vec<T, kVec> dv;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = to_float(gv.v[j]) * gelu_grad(to_float(xv.v[j]) + bias[j], tanh_form);
        dv.v[j] = from_float<T>(d);
        dbias[j] += d;
      }
      store_vec<T, kVec>(static_cast<T*>(p.dx) + row * p.ld_dx + col, dv);
    } else if constexpr (kKind == FusedKernel::kSiluFwd) {
      const Vec<T, kVec> av = load_vec_once<T, kVec>(xr + col);
      const Vec<T, kVec> bv = load_vec_once<T, kVec>(xr + p.width + col);
      Vec<T, kVec> yv;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float a = to_float(av.v[j]);
        yv.v[j] = from_float<T>(a * sigmoid(a) * to_float(bv.v[j]));
      }
      store_vec<T, kVec>(static_cast<T*>(p.y) + row * p.ld_y + col, yv);
    } else {  // kSiluBwd
      const Vec<T, kVec> av = load_vec_once<T, kVec>(xr + col);
      const Vec<T, kVec> bv = load_vec_once<T, kVec>(xr + p.width + col);
      const Vec<T, kVec> gv = load_vec_once<T, kVec>(static_cast<const T*>(p.dy) + row * p.ld_dy + col);
      Vec<T, kVec> dav, dbv;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float a = to_float(av.v[j]), b = to_float(bv.v[j]), g = to_float(gv.v[j]);
        const float s = sigmoid(a);
        dav.v[j] = from_float<T>(g * b * s * (1.0f + a * (1.0f - s)));
        dbv.v[j] = from_float<T>(g * a * s);
      }
      T* dxr = static_cast<T*>(p.dx) + row * p.ld_dx;
      store_vec<T, kVec>(dxr + col, dav);
      store_vec<T, kVec>(dxr + p.width + col, dbv);
    }
  }
  if constexpr (kKind == FusedKernel::kGeluBwd) {
    if (partial) {
      // The block's rows meet in shared memory; row 0 of the block writes the block's partial.
      __shared__ float collect[kThreads * (16 / sizeof(T))];
      const int tid = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
      for (int j = 0; j < kVec; ++j) collect[j * kThreads + tid] = dbias[j];
      __syncthreads();
      if (threadIdx.y == 0 && live_col) {
        for (int r = 1; r < static_cast<int>(blockDim.y); ++r)
#pragma unroll
          for (int j = 0; j < kVec; ++j) dbias[j] += collect[j * kThreads + r * blockDim.x + threadIdx.x];
        float* out = partial + static_cast<int64_t>(blockIdx.y) * p.width + col;
#pragma unroll
        for (int j = 0; j < kVec; ++j) out[j] = dbias[j];
      }
    }
  }
}

template <typename T, int kVec, FusedKernel kKind>
cudaError_t launch_instance(const FusedParams& p, const Workspace& workspace, cudaStream_t stream, size_t* measure) {
  // dbias: one fp32 partial row per block row of the grid.
  const bool wants_partials = kKind == FusedKernel::kGeluBwd && p.dbias;
  if (measured_without_scratch(wants_partials, measure)) return cudaSuccess;
  auto kernel = elementwise_kernel<T, kVec, kKind>;
  const int64_t vecs = p.width / kVec;
  int threads_x = 1;
  while (threads_x < vecs && threads_x < kThreads) threads_x *= 2;
  const int threads_y = kThreads / threads_x;
  const int64_t col_blocks = (vecs + threads_x - 1) / threads_x;
  if (col_blocks > 0x7fffffff) return cudaErrorInvalidValue;  // grid.x (a width of 2^31 vectors)
  // Rows split so that the grid fills the GPU a few times over (grid.y <= 65535).
  int64_t resident = 0;
  if (cudaError_t e = resident_blocks(kernel, kThreads, 0, &resident); e != cudaSuccess) return e;
  const int64_t want_blocks = resident * kWaves;
  const int64_t row_blocks_needed = (p.rows + threads_y - 1) / threads_y;
  const int64_t row_blocks = std::clamp<int64_t>(want_blocks / std::max<int64_t>(col_blocks, 1), 1,
                                                 std::min<int64_t>(row_blocks_needed, kMaxGridY));
  const PartialRows partial = partial_rows(workspace, measure, wants_partials ? row_blocks * p.width : 0);
  if (!partial.launch) return partial.status;
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks));
  kernel<<<grid, dim3(threads_x, threads_y), 0, stream>>>(p, partial.data);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (wants_partials) return launch_column_sum<T>(partial.data, row_blocks, p.width, p.width, p.dbias, stream);
  return cudaSuccess;
}

}  // namespace

}  // namespace optimized::cuda::fused

namespace optimized::cuda {

template <DType kDType>
cudaError_t fused_elementwise_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream,
                                    size_t* measure) {
  using T = kernels::cuda_type_t<kDType>;
  using fused::FusedKernel;
  return fused::dispatch_kernel<T, FusedKernel::kGeluFwd, FusedKernel::kGeluBwd, FusedKernel::kSiluFwd,
                                FusedKernel::kSiluBwd>(p, [&]<FusedKernel kKind, int kVec>() {
    return fused::launch_instance<T, kVec, kKind>(p, workspace, stream, measure);
  });
}

}  // namespace optimized::cuda
