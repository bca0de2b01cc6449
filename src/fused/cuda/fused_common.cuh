// Device helpers shared by the fused memory-bound kernels: dtype <-> fp32 conversion, 16-byte
// vectors of a row, the math of GELU / SiLU, a dtype dispatch, and the column-sum kernel that
// turns per-block partial sums (dweight, dbias) into the gradient.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "core/cuda_device_guard.h"
#include "fused/fused_params.h"

namespace optimized::fused_cuda {

// ---- conversions ---------------------------------------------------------------------------
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// ---- vectors -------------------------------------------------------------------------------
// kVec elements of T loaded or stored as one access: 16 bytes when rows are aligned, else 1
// element (the fallback for rows that do not start on a 16-byte boundary).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, kVec>*>(p);
}
// Streaming (evict-first) load for data read exactly once, so that it does not push out of L2 what
// will be read again.
template <typename T, int kVec>
__device__ __forceinline__ Vec<T, kVec> load_vec_once(const T* p) {
  if constexpr (sizeof(T) * kVec == 16) {
    uint4 u = __ldcs(reinterpret_cast<const uint4*>(p));
    return *reinterpret_cast<Vec<T, kVec>*>(&u);
  } else {
    return *reinterpret_cast<const Vec<T, kVec>*>(p);
  }
}
template <typename T, int kVec>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, kVec>& v) {
  *reinterpret_cast<Vec<T, kVec>*>(p) = v;
}

// 16 bytes of T, in elements.
template <typename T> constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// ---- activation math (fp32) ----------------------------------------------------------------
constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kGeluCubic = 0.044715f;

__device__ __forceinline__ float gelu(float x, bool tanh_form) {
  if (tanh_form) return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
  return 0.5f * x * (1.0f + erff(x * kSqrt1_2));
}
__device__ __forceinline__ float gelu_grad(float x, bool tanh_form) {
  if (tanh_form) {
    const float inner = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    const float t = tanhf(inner);
    const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
  }
  return 0.5f * (1.0f + erff(x * kSqrt1_2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// ---- scalars --------------------------------------------------------------------------------
// eps and scale as every kernel computes with them: fp32, rounded once on the host at the launch
// (FusedParams carries the caller's doubles, which the fp64 CPU path needs). Kernels read these,
// never p.eps / p.scale, which would pull fp64 arithmetic onto the device.
struct FusedScalarsF32 {
  float eps;
  float scale;
};
inline FusedScalarsF32 scalars_f32(const FusedParams& p) {
  return {static_cast<float>(p.eps), static_cast<float>(p.scale)};
}

// ---- dispatch ------------------------------------------------------------------------------
// Calls f(T{}) with the CUDA element type of `dtype`.
template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: f(float{}); return;
    case DType::kF16: f(__half{}); return;
    case DType::kBF16: f(__nv_bfloat16{}); return;
    default: break;
  }
  throw Error(Status::kUnsupported, "fused CUDA kernels: unsupported dtype " + std::string(dtype_name(dtype)));
}

inline void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

// Blocks of `kernel` (with this block size and dynamic shared memory) that the current device
// holds at once: what a grid that strides over rows needs to fill the GPU, no more.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads, size_t dynamic_smem, const char* what) {
  int device = 0, sms = 0, per_sm = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem),
             std::string("cudaOccupancyMaxActiveBlocksPerMultiprocessor (") + what + ")");
  return static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
}

// The four kernels of the row designs (fused_streaming and fused_registers).
enum class RowKind : int { kSoftmaxFwd, kNormFwd, kSoftmaxBwd, kNormBwd };
inline RowKind row_kind_of(const FusedParams& p) {
  if (p.is_softmax()) return p.backward ? RowKind::kSoftmaxBwd : RowKind::kSoftmaxFwd;
  return p.backward ? RowKind::kNormBwd : RowKind::kNormFwd;
}

// ---- column sums ---------------------------------------------------------------------------
// out[c] = sum over p < parts of partial[p * row_stride + c], written in T. A block covers 32
// columns with 32 slices of the parts; the slices meet in shared memory.
template <typename T>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* __restrict__ partial, int64_t parts,
                                                          int64_t width, int64_t row_stride, T* __restrict__ out) {
  __shared__ float slice_sums[32][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float sum = 0.0f;
  if (col < width)
    for (int64_t p = threadIdx.y; p < parts; p += 32) sum += partial[p * row_stride + col];
  slice_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < width) {
    float total = 0.0f;
    for (int s = 0; s < 32; ++s) total += slice_sums[s][threadIdx.x];
    out[col] = from_float<T>(total);
  }
}

// Sums `parts` fp32 rows of `width` columns spaced `row_stride` apart into `out` (dtype elements).
inline void launch_column_sum(const float* partial, int64_t parts, int64_t width, int64_t row_stride, void* out,
                              DType dtype, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const dim3 block(32, 32);
    const dim3 grid(static_cast<unsigned>((width + 31) / 32));
    column_sum_kernel<T><<<grid, block, 0, stream>>>(partial, parts, width, row_stride, static_cast<T*>(out));
    check_launch("column_sum_kernel launch");
  });
}

// Stream-ordered scratch memory (cudaMallocAsync), freed on the stream when the scope ends:
// graph-capturable and cheap once the pool is warm.
class StreamScratch {
 public:
  StreamScratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes) check_cuda(cudaMallocAsync(&ptr_, bytes, stream), "cudaMallocAsync (fused scratch)");
  }
  ~StreamScratch() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  float* floats() const { return static_cast<float*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace optimized::fused_cuda
