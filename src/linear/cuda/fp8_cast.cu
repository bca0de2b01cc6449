// The linear family's fp8 kernels (linear_fp8.h): the amax pass and the cast to fp8 with the scale
// that amax gives, for up to kMaxFp8Jobs tensors a launch (grid.z or grid.y picks the job).
//
//   fp8_amax_kernel   block of 256 threads over rows (grid-stride), the threads along a row, 16
//                     bytes a load when the rows allow; max |v| as float bits, raised into the job's
//                     amax one atomicMax a warp (kernels::warp_raise_max_bits).
//   fp8_cast_kernel   one 64 x 64 tile a block: thread (r, c8) reads 8 neighbouring elements of rows
//                     r and r + 32 (16 bytes of fp16 / bf16), converts v * q with saturation
//                     (__nv_cvt_float_to_fp8, SATFINITE, round to nearest even), writes the 8 bytes
//                     of the plain copy as one access, and the bytes into a shared tile [col][row]
//                     from which the transposed copy leaves 8 bytes a thread along its rows.
// Unaligned rows, and the ragged edges, take the element-wise path of the same code.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/dispatch.cuh"
#include "kernels/dtype.cuh"
#include "kernels/reduce.cuh"
#include "linear/launchers.h"
#include "linear/linear_fp8.h"

namespace optimized::cuda {
namespace {

using namespace optimized::kernels;

constexpr int kThreads = 256;
constexpr int kTile = 64;      // cast tile: 64 x 64
constexpr int kTilePad = 72;   // a shared row of the transposed tile: 8-byte aligned, banks spread
constexpr int64_t kMaxGridY = 65535;

struct AmaxJobs {
  Fp8AmaxJob job[kMaxFp8Jobs];
};
struct CastJobs {
  Fp8CastJob job[kMaxFp8Jobs];
};

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// Whether rows of T starting at p, ld apart, take kVec-element accesses at every multiple of kVec.
template <typename T, int kVec>
bool vector_rows(const void* p, int64_t ld) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kVec) == 0 && ld % kVec == 0;
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) fp8_amax_kernel(const __grid_constant__ AmaxJobs jobs) {
  const Fp8AmaxJob& j = jobs.job[blockIdx.y];
  const T* src = static_cast<const T*>(j.src);
  unsigned m = 0;
  // kVec > 1: the launcher checked alignment and cols % kVec == 0 for this instance.
  for (int64_t r = blockIdx.x; r < j.rows; r += gridDim.x) {
    const T* row = src + r * j.ld;
    for (int64_t c = int64_t(threadIdx.x) * kVec; c < j.cols; c += int64_t(kThreads) * kVec) {
      const Vec<T, kVec> v = load_vec_once<T, kVec>(row + c);
#pragma unroll
      for (int e = 0; e < kVec; ++e) m = max(m, abs_bits(to_float(v.v[e])));
    }
  }
  warp_raise_max_bits(j.amax_bits, m);
}

__device__ __forceinline__ uint8_t to_fp8(float v, bool e5m2) {
  return e5m2 ? __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2) : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) fp8_cast_kernel(const __grid_constant__ CastJobs jobs) {
  __shared__ __align__(16) uint8_t tile[kTile][kTilePad];  // [col][row] of the transposed copy
  const Fp8CastJob& j = jobs.job[blockIdx.z];
  const int64_t c0 = int64_t(blockIdx.x) * kTile;
  if (c0 >= j.cols) return;  // uniform over the block
  const bool e5m2 = j.format == DType::kF8E5M2;
  const float q = fp8_quant_scale(__uint_as_float(*j.amax_bits), fp8_max_finite(j.format));
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *j.dequant = 1.0f / q;
  const T* src = static_cast<const T*>(j.src);
  const int tr = threadIdx.x / 8, c8 = (threadIdx.x % 8) * 8;  // rows tr, tr + 32; columns c8 .. c8 + 7
  const bool full_cols = c0 + kTile <= j.cols;
  const bool vec_in = full_cols && reinterpret_cast<uintptr_t>(src) % (8 * sizeof(T)) == 0 && j.ld % 8 == 0;
  const bool vec_out = full_cols && reinterpret_cast<uintptr_t>(j.out) % 8 == 0 && j.ld_out % 8 == 0;
  const bool vec_out_t = reinterpret_cast<uintptr_t>(j.out_t) % 8 == 0 && j.ld_out_t % 8 == 0;
  for (int64_t r0 = int64_t(blockIdx.y) * kTile; r0 < j.rows; r0 += int64_t(gridDim.y) * kTile) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = tr + 32 * h;
      const int64_t r = r0 + rr;
      uint8_t b[8];
      if (r < j.rows) {
        const T* row = src + r * j.ld + c0 + c8;
        if (vec_in) {
          const Vec<T, 8> v = load_vec_once<T, 8>(row);
#pragma unroll
          for (int e = 0; e < 8; ++e) b[e] = to_fp8(to_float(v.v[e]) * q, e5m2);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) b[e] = c0 + c8 + e < j.cols ? to_fp8(to_float(row[e]) * q, e5m2) : 0;
        }
        if (j.out) {
          uint8_t* o = j.out + r * j.ld_out + c0 + c8;
          if (vec_out) {
            uint2 w;
            w.x = b[0] | (b[1] << 8) | (b[2] << 16) | (unsigned(b[3]) << 24);
            w.y = b[4] | (b[5] << 8) | (b[6] << 16) | (unsigned(b[7]) << 24);
            *reinterpret_cast<uint2*>(o) = w;
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
              if (c0 + c8 + e < j.cols) o[e] = b[e];
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) b[e] = 0;
      }
      if (j.out_t) {
#pragma unroll
        for (int e = 0; e < 8; ++e) tile[c8 + e][rr] = b[e];
      }
    }
    if (!j.out_t) continue;  // uniform
    __syncthreads();
    // The transposed copy: output row c0 + oc holds input rows r0 .. r0 + 63; 8 bytes a thread.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int oc = threadIdx.x / 8 + 32 * h, r8 = (threadIdx.x % 8) * 8;
      const int64_t c = c0 + oc;
      if (c < j.cols) {
        uint8_t* o = j.out_t + c * j.ld_out_t + r0 + r8;
        if (vec_out_t && r0 + r8 + 8 <= j.rows) {
          *reinterpret_cast<uint2*>(o) = *reinterpret_cast<const uint2*>(&tile[oc][r8]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (r0 + r8 + e < j.rows) o[e] = tile[oc][r8 + e];
        }
      }
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t linear_fp8_amax(const Fp8AmaxJob* jobs, int count, cudaStream_t stream) {
  if (count < 1 || count > kMaxFp8Jobs) return cudaErrorInvalidValue;
  // One launch per (dtype, vector width) group would be more general; the jobs of a call share
  // their dtype, so one instance runs them all, vectorized when every job's rows allow it.
  AmaxJobs all{};
  int64_t rows = 1;
  bool vector = true;
  for (int i = 0; i < count; ++i) {
    if (jobs[i].dtype != jobs[0].dtype || !jobs[i].amax_bits) return cudaErrorInvalidValue;
    all.job[i] = jobs[i];
    rows = std::max(rows, jobs[i].rows);
  }
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, 4096));
  return dispatch_float_dtype(jobs[0].dtype, [&]<typename T>() -> cudaError_t {
    constexpr int kVec = kVec16<T>;
    for (int i = 0; i < count; ++i)
      vector = vector && jobs[i].cols % kVec == 0 && vector_rows<T, kVec>(jobs[i].src, jobs[i].ld);
    if (vector)
      fp8_amax_kernel<T, kVec><<<dim3(blocks, count), kThreads, 0, stream>>>(all);
    else
      fp8_amax_kernel<T, 1><<<dim3(blocks, count), kThreads, 0, stream>>>(all);
    return cudaGetLastError();
  });
}

cudaError_t linear_fp8_cast(const Fp8CastJob* jobs, int count, cudaStream_t stream) {
  if (count < 1 || count > kMaxFp8Jobs) return cudaErrorInvalidValue;
  CastJobs all{};
  int64_t rows = 1, cols = 1;
  for (int i = 0; i < count; ++i) {
    if (jobs[i].dtype != jobs[0].dtype || !jobs[i].amax_bits || !jobs[i].dequant) return cudaErrorInvalidValue;
    all.job[i] = jobs[i];
    rows = std::max(rows, jobs[i].rows);
    cols = std::max(cols, jobs[i].cols);
  }
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  if (col_tiles > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(std::min((rows + kTile - 1) / kTile, kMaxGridY)),
                  count);
  return dispatch_float_dtype(jobs[0].dtype, [&]<typename T>() -> cudaError_t {
    fp8_cast_kernel<T><<<grid, kThreads, 0, stream>>>(all);
    return cudaGetLastError();
  });
}

}  // namespace optimized::cuda
