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
#include <algorithm>

#include "fused/cuda/fused_common.cuh"

namespace optimized::fused_cuda {

namespace {

constexpr int kThreads = 256;

enum class Kind : int { kGeluFwd, kGeluBwd, kSiluFwd, kSiluBwd };

template <typename T, int kVec, Kind kKind>
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
  if constexpr (kKind == Kind::kGeluFwd || kKind == Kind::kGeluBwd) {
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
    if constexpr (kKind == Kind::kGeluFwd) {
      const Vec<T, kVec> xv = load_vec_once<T, kVec>(xr + col);
      Vec<T, kVec> yv;
#pragma unroll
      for (int j = 0; j < kVec; ++j) yv.v[j] = from_float<T>(gelu(to_float(xv.v[j]) + bias[j], tanh_form));
      store_vec<T, kVec>(static_cast<T*>(p.y) + row * p.ld_y + col, yv);
    } else if constexpr (kKind == Kind::kGeluBwd) {
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
    } else if constexpr (kKind == Kind::kSiluFwd) {
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
  if constexpr (kKind == Kind::kGeluBwd) {
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

Kind kind_of(const FusedParams& p) {
  if (p.op == FusedOp::kBiasGelu) return p.backward ? Kind::kGeluBwd : Kind::kGeluFwd;
  return p.backward ? Kind::kSiluBwd : Kind::kSiluFwd;
}

template <typename T, int kVec, Kind kKind>
void launch_instance(const FusedParams& p, cudaStream_t stream) {
  auto kernel = elementwise_kernel<T, kVec, kKind>;
  const int64_t vecs = p.width / kVec;
  int threads_x = 1;
  while (threads_x < vecs && threads_x < kThreads) threads_x *= 2;
  const int threads_y = kThreads / threads_x;
  const int64_t col_blocks = (vecs + threads_x - 1) / threads_x;
  // Rows split so that the grid fills the GPU a few times over (grid.y <= 65535).
  const int64_t want_blocks = resident_blocks(kernel, kThreads, 0, "elementwise") * 4;
  const int64_t row_blocks_needed = (p.rows + threads_y - 1) / threads_y;
  const int64_t row_blocks =
      std::clamp<int64_t>(want_blocks / std::max<int64_t>(col_blocks, 1), 1, std::min<int64_t>(row_blocks_needed, 65535));
  if (col_blocks > 0x7fffffff)
    throw Error(Status::kUnsupported, "fused elementwise: width " + std::to_string(p.width) + " is too large");
  const bool wants_partials = kKind == Kind::kGeluBwd && p.dbias;
  StreamScratch partial(wants_partials ? static_cast<size_t>(row_blocks) * p.width * sizeof(float) : 0, stream);
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks));
  kernel<<<grid, dim3(threads_x, threads_y), 0, stream>>>(p, partial.floats());
  check_launch("elementwise_kernel launch");
  if (wants_partials) launch_column_sum(partial.floats(), row_blocks, p.width, p.width, p.dbias, p.dtype, stream);
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

void launch_fused_elementwise(const FusedParams& p, void* stream_ptr) {
  using fused_cuda::Kind;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  fused_cuda::dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (fused_cuda::kind_of(p)) {
      case Kind::kGeluFwd: fused_cuda::launch_kind<T, Kind::kGeluFwd>(p, stream); break;
      case Kind::kGeluBwd: fused_cuda::launch_kind<T, Kind::kGeluBwd>(p, stream); break;
      case Kind::kSiluFwd: fused_cuda::launch_kind<T, Kind::kSiluFwd>(p, stream); break;
      case Kind::kSiluBwd: fused_cuda::launch_kind<T, Kind::kSiluBwd>(p, stream); break;
    }
  });
}

}  // namespace optimized
