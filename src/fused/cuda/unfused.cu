// Fused memory-bound family, CUDA rung 1: UNFUSED -- what an eager framework launches.
//
// Every op is spelled out as the chain of elementary kernels a naive PyTorch-style program runs:
// each kernel reads its operands from global memory and writes its result to global memory, so
// the chain pays one full read + write of the (rows, width) tensor per step. That traffic is what
// the fused rungs (row_streaming.cu, row_registers.cu, elementwise.cu) remove; this file is the
// "before" of that comparison, so each step is simple but not artificially slow: coalesced, 64-bit
// indexing, grid-stride, one block per row for row reductions.
//
// Three generic kernels do all the work; a step is one of them plus a small functor:
//   map_kernel          out(r, c) = op(in_1(r, c), ..., in_k(r, c))   elementwise, grid-stride over
//                       the flat (row, col) index; operands are (rows, cols) matrices with a row
//                       stride, per-row values (statistics) or per-column values (weight, bias)
//   row_reduce_kernel   out[r] = finish(reduce_c elem(in(r, c)...))    one block per row (the grid
//                       walks the rows), block reduction through warp shuffles
//   column_partial_kernel -> column_finish_kernel
//                       out[c] = sum_r in(r, c): slices of rows -> fp32 partials -> one sum
//
// The chains (T = the dtype; "tmp" = a stream-ordered fp32 temporary of (rows, width) unless it
// says (rows); the last step present writes the output in T):
//   softmax fwd       row max of scale*x -> e = exp(scale*x - max) [tmp] -> row sum of e (rows)
//                     -> y = e / sum
//   log_softmax fwd   row max -> e [tmp] -> row sum -> y = scale*x - max - log(sum)
//   softmax bwd       p = dy*y [tmp] -> row sum of p (rows) -> dx = scale*y*(dy - sum)
//   log_softmax bwd   row sum of dy (rows) -> e = exp(y) [tmp] -> dx = scale*(dy - e*sum)
//   layer_norm fwd    [add form: h = x + residual, rounded to T, into residual_out (a T temporary
//                     when residual_out is absent)] -> row mean (into `mean` or a (rows) tmp)
//                     -> row variance mean((h - mean)^2) (rows) -> rstd = rsqrt(var + eps) (into
//                     `rstd` or a tmp) -> xhat = (h - mean)*rstd -> *weight -> +bias
//   rms_norm fwd      [add form as above] -> row mean of h^2 (rows) -> rstd -> xhat = h*rstd
//                     -> *weight
//   layer/rms bwd     g = dy*weight [tmp; g = dy when weight is absent] -> xhat [tmp] -> g*xhat
//                     [tmp] -> row mean of g*xhat (rows) -> row mean of g (rows; layer_norm)
//                     -> dweight: dy*xhat [tmp] -> column sum; dbias: column sum of dy
//                     -> dx = rstd*(g - mean(g) - xhat*mean(g*xhat)) (rms: no mean(g) term)
//                     -> dx += dresidual_out (a separate add kernel; dx goes through a tmp)
//   bias_gelu fwd     z = x + bias [tmp; z = x when bias is absent] -> y = gelu(z)
//   bias_gelu bwd     z [tmp] -> d = gelu'(z) [tmp] -> d = dy*d -> dbias: column sum of d -> dx = d
//   silu_and_mul fwd  s = silu(a) [tmp] -> y = s*b                         (x = [a | b])
//   silu_and_mul bwd  sig = sigmoid(a) [tmp] -> s = silu(a) [tmp]
//                     -> da = dy*b*sig*(1 + a*(1 - sig)) -> db = dy*s
// Temporaries are fp32 (eager torch would keep them in the dtype and round at every step; fp32
// keeps this rung's numerics comparable to the fused ones, and the traffic lesson is the same).
//
// In place (y = x, dx = dy, dx = x, residual_out = x or residual): every step reads element
// (r, c) of its inputs before it writes element (r, c) of its output and never touches another
// element, and every read of an input that the output may alias happens in or before the step
// that writes that output: the parameter gradients (which read dy) are reduced before dx is
// written, and silu_and_mul's db reads only dy and the silu temporary.
//
// Temporaries come from cudaMallocAsync on the stream and go back with cudaFreeAsync as soon as
// their last reader is enqueued, so everything is stream-ordered and CUDA-graph capturable.
// Every allocation and launch is checked; a failure throws optimized::Error.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "core/cuda_device_guard.h"
#include "fused/cuda/fused_common.cuh"
#include "fused/fused_params.h"

namespace optimized {
namespace {

using fused_cuda::from_float;
using fused_cuda::scalars_f32;
using fused_cuda::to_float;

// ---- config --------------------------------------------------------------------------------
constexpr int kMapThreads = 256;
// Grid-stride cap for elementwise kernels: ~16 resident-block waves on an H100 (132 SMs x 8
// blocks of 256), enough to hide latency; more blocks would only add scheduling.
constexpr int64_t kMaxMapBlocks = 16384;
constexpr int kRowThreads = 256;           // at most; narrower rows get fewer (a multiple of 32)
constexpr int64_t kMaxRowBlocks = 65536;   // blocks walk the rows beyond this
constexpr int kColX = 32;                  // column-partial tile: 32 columns (one warp) ...
constexpr int kColY = 8;                   // ... by 8 row lanes
constexpr int64_t kColTargetBlocks = 2048; // split the rows until about this many blocks run
constexpr int64_t kColMinRowsPerSplit = 64;

static_assert(kMapThreads % 32 == 0 && kRowThreads % 32 == 0 && kRowThreads <= 1024,
              "block reductions assume whole warps and at most 32 warps");
static_assert(kColX == 32, "a column tile row is one warp, so that its loads coalesce");

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- operands ------------------------------------------------------------------------------
// (rows, cols) matrix with row stride ld: element (r, c) = p[r * ld + c]. T: the dtype (const for
// inputs) or float for temporaries.
template <typename T>
struct Mat {
  T* p;
  int64_t ld;
  __device__ __forceinline__ float load(int64_t r, int64_t c) const { return to_float(p[r * ld + c]); }
  __device__ __forceinline__ void store(int64_t r, int64_t c, float v) const {
    p[r * ld + c] = from_float<std::remove_const_t<T>>(v);
  }
};
// One fp32 value per row (mean, rstd, row sums): element (r, c) = p[r].
struct PerRow {
  const float* p;
  __device__ __forceinline__ float load(int64_t r, int64_t) const { return p[r]; }
};
// One value per column (weight, bias): element (r, c) = p[c].
template <typename T>
struct PerCol {
  const T* p;
  __device__ __forceinline__ float load(int64_t, int64_t c) const { return to_float(p[c]); }
};

// ---- step functors (the algebra of each kernel) ---------------------------------------------
struct Identity {
  __device__ float operator()(float v) const { return v; }
};
struct Scaled {
  float scale;
  __device__ float operator()(float v) const { return scale * v; }
};
struct Square {
  __device__ float operator()(float v) const { return v * v; }
};
struct SquaredDeviation {
  __device__ float operator()(float h, float mean) const { return (h - mean) * (h - mean); }
};
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Multiply {
  __device__ float operator()(float a, float b) const { return a * b; }
};
struct Divide {
  __device__ float operator()(float a, float b) const { return a / b; }
};
struct Exp {
  __device__ float operator()(float v) const { return expf(v); }
};
struct ExpShifted {  // exp(scale*x - max): max is of scale*x, so any sign of scale is safe
  float scale;
  __device__ float operator()(float x, float max) const { return expf(__fmul_rn(scale, x) - max); }
};
struct LogSoftmaxOut {
  float scale;
  // __fmul_rn: the product rounds exactly as it did for the max, so a row's maximum gives 0 - log(sum)
  // (contracted into an fma, scale * x - max leaves the max's rounding error behind).
  __device__ float operator()(float x, float max, float sum) const { return (__fmul_rn(scale, x) - max) - logf(sum); }
};
struct SoftmaxGrad {
  float scale;
  __device__ float operator()(float y, float dy, float sum) const { return scale * y * (dy - sum); }
};
struct LogSoftmaxGrad {
  float scale;
  __device__ float operator()(float dy, float e, float sum) const { return scale * (dy - e * sum); }
};
struct RsqrtPlusEps {
  float eps;
  __device__ float operator()(float v) const { return rsqrtf(v + eps); }
};
struct Normalize {
  __device__ float operator()(float h, float mean, float rstd) const { return (h - mean) * rstd; }
};
struct LayerNormGrad {
  __device__ float operator()(float g, float xhat, float rstd, float mean_g, float mean_gx) const {
    return rstd * (g - mean_g - xhat * mean_gx);
  }
};
struct RmsNormGrad {
  __device__ float operator()(float g, float xhat, float rstd, float mean_gx) const {
    return rstd * (g - xhat * mean_gx);
  }
};
struct Gelu {
  bool tanh_form;
  __device__ float operator()(float z) const { return fused_cuda::gelu(z, tanh_form); }
};
struct GeluGrad {
  bool tanh_form;
  __device__ float operator()(float z) const { return fused_cuda::gelu_grad(z, tanh_form); }
};
struct Sigmoid {
  __device__ float operator()(float a) const { return fused_cuda::sigmoid(a); }
};
struct Silu {  // a / (1 + exp(-a)), as fused.h defines it
  __device__ float operator()(float a) const { return a / (1.0f + expf(-a)); }
};
struct SiluAndMulGradA {
  __device__ float operator()(float dy, float a, float b, float sig) const {
    return dy * b * sig * (1.0f + a * (1.0f - sig));
  }
};

// Row-reduction combiners and finishers.
struct SumOp {
  static __device__ __forceinline__ float identity() { return 0.0f; }
  static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};
struct MaxOp {  // propagates NaN, as torch's max does (fmaxf would drop it)
  static __device__ __forceinline__ float identity() { return -INFINITY; }
  static __device__ __forceinline__ float apply(float a, float b) { return (a > b || a != a) ? a : b; }
};
struct Total {
  __device__ float operator()(float total, int64_t) const { return total; }
};
struct MeanOf {
  __device__ float operator()(float total, int64_t n) const { return total / static_cast<float>(n); }
};

// ---- kernels -------------------------------------------------------------------------------
// out(r, c) = op(in(r, c)...) for every element of a (rows, cols) grid.
template <typename Op, typename Out, typename... In>
__global__ void __launch_bounds__(kMapThreads)
    map_kernel(int64_t rows, int64_t cols, Op op, Out out, In... in) {
  const int64_t total = rows * cols;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kMapThreads;
  int64_t i = static_cast<int64_t>(blockIdx.x) * kMapThreads + threadIdx.x;
  if (i >= total) return;
  // One division per thread; the loop then advances (r, c) by the fixed (step / cols, step % cols).
  int64_t r = i / cols;
  int64_t c = i % cols;
  const int64_t dr = step / cols;
  const int64_t dc = step % cols;
  for (; i < total; i += step) {
    out.store(r, c, op(in.load(r, c)...));
    r += dr;
    c += dc;
    if (c >= cols) {
      c -= cols;
      ++r;
    }
  }
}

// Reduces one value per thread over the 1-D block (a multiple of 32 threads); all threads get it.
template <typename Reduce>
__device__ __forceinline__ float block_reduce(float v, float* scratch /* [32] */) {
  for (int offset = 16; offset > 0; offset >>= 1) v = Reduce::apply(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();  // the previous row's readers of scratch are done
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = threadIdx.x % 32 < blockDim.x / 32 ? scratch[threadIdx.x % 32] : Reduce::identity();
  for (int offset = 16; offset > 0; offset >>= 1) v = Reduce::apply(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// out[r] = finish(reduce over c of elem(in(r, c)...), cols); one block per row, blocks walk rows.
template <typename Reduce, typename Elem, typename Finish, typename... In>
__global__ void __launch_bounds__(kRowThreads)
    row_reduce_kernel(int64_t rows, int64_t cols, Elem elem, Finish finish, float* out, In... in) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float acc = Reduce::identity();
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) acc = Reduce::apply(acc, elem(in.load(r, c)...));
    acc = block_reduce<Reduce>(acc, scratch);
    if (threadIdx.x == 0) out[r] = finish(acc, cols);
  }
}

// partial[s, c] = sum of in(r, c) over the rows of slice s (rows_per_split rows). A warp reads 32
// consecutive columns of one row (coalesced); the 8 row lanes meet in shared memory.
template <typename In>
__global__ void __launch_bounds__(kColX * kColY)
    column_partial_kernel(int64_t rows, int64_t cols, int64_t rows_per_split, In in, float* partial) {
  __shared__ float lanes[kColY][kColX + 1];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColX + threadIdx.x;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_split;
  const int64_t r_end = min(rows, r_begin + rows_per_split);
  float acc = 0.0f;
  if (c < cols)
    for (int64_t r = r_begin + threadIdx.y; r < r_end; r += kColY) acc += in.load(r, c);
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float sum = 0.0f;
    for (int y = 0; y < kColY; ++y) sum += lanes[y][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.y) * cols + c] = sum;
  }
}

// out[c] = sum over s < splits of partial[s, c], in T; threads walk the columns (coalesced).
template <typename T>
__global__ void __launch_bounds__(kMapThreads)
    column_finish_kernel(int64_t splits, int64_t cols, const float* partial, T* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kMapThreads;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kMapThreads + threadIdx.x; c < cols; c += step) {
    float sum = 0.0f;
    for (int64_t s = 0; s < splits; ++s) sum += partial[s * cols + c];
    out[c] = from_float<T>(sum);
  }
}

// ---- host side -----------------------------------------------------------------------------
// A stream-ordered temporary of `count` elements of E. release() frees it with a checked
// cudaFreeAsync once its last reader is enqueued; the destructor frees (unchecked, it may not
// throw) only when an exception left the scope early.
template <typename E>
class Temp {
 public:
  Temp(int64_t count, cudaStream_t stream, const char* what) : stream_(stream), what_(what) {
    void* p = nullptr;
    check_cuda(cudaMallocAsync(&p, static_cast<size_t>(count) * sizeof(E), stream),
               std::string("unfused: cudaMallocAsync for ") + what_);
    ptr_ = static_cast<E*>(p);
  }
  ~Temp() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  Temp(const Temp&) = delete;
  Temp& operator=(const Temp&) = delete;

  E* get() const { return ptr_; }
  void release() {
    E* p = ptr_;
    ptr_ = nullptr;
    if (p != nullptr) check_cuda(cudaFreeAsync(p, stream_), std::string("unfused: cudaFreeAsync of ") + what_);
  }

 private:
  E* ptr_ = nullptr;
  cudaStream_t stream_;
  const char* what_;
};

template <typename Op, typename Out, typename... In>
void launch_map(cudaStream_t stream, const char* what, int64_t rows, int64_t cols, Op op, Out out,
                In... in) {
  const int64_t blocks = std::min(ceil_div(rows * cols, kMapThreads), kMaxMapBlocks);
  map_kernel<<<static_cast<unsigned>(blocks), kMapThreads, 0, stream>>>(rows, cols, op, out, in...);
  check_cuda(cudaGetLastError(), std::string("unfused: launch of ") + what);
}

template <typename Reduce, typename Elem, typename Finish, typename... In>
void launch_row_reduce(cudaStream_t stream, const char* what, int64_t rows, int64_t cols, Elem elem,
                       Finish finish, float* out, In... in) {
  // Short rows get a block just wide enough (whole warps), long rows kRowThreads.
  const int threads = static_cast<int>(std::min<int64_t>(kRowThreads, ceil_div(cols, 32) * 32));
  const int64_t blocks = std::min(rows, kMaxRowBlocks);
  row_reduce_kernel<Reduce><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(rows, cols, elem, finish,
                                                                                   out, in...);
  check_cuda(cudaGetLastError(), std::string("unfused: launch of ") + what);
}

// out[c] = sum over rows of in(r, c), written in T: row slices -> fp32 partials -> column sum.
template <typename T, typename In>
void launch_column_sum(cudaStream_t stream, const char* what, int64_t rows, int64_t cols, In in, void* out) {
  const int64_t col_tiles = ceil_div(cols, kColX);
  if (col_tiles > INT32_MAX)
    throw Error(Status::kUnsupported, std::string("unfused: ") + what + ": width " + std::to_string(cols) +
                                          " exceeds the column-sum grid");
  // Enough row slices to fill the GPU when there are few columns, none thinner than 64 rows.
  int64_t splits = std::max<int64_t>(1, ceil_div(kColTargetBlocks, col_tiles));
  splits = std::min({splits, ceil_div(rows, kColMinRowsPerSplit), int64_t{65535}});
  const int64_t rows_per_split = ceil_div(rows, splits);
  splits = ceil_div(rows, rows_per_split);
  Temp<float> partial(splits * cols, stream, what);
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(splits));
  column_partial_kernel<<<grid, dim3(kColX, kColY), 0, stream>>>(rows, cols, rows_per_split, in, partial.get());
  check_cuda(cudaGetLastError(), std::string("unfused: launch of ") + what + " (partials)");
  const int64_t finish_blocks = std::min(ceil_div(cols, kMapThreads), kMaxMapBlocks);
  column_finish_kernel<T><<<static_cast<unsigned>(finish_blocks), kMapThreads, 0, stream>>>(
      splits, cols, partial.get(), static_cast<T*>(out));
  check_cuda(cudaGetLastError(), std::string("unfused: launch of ") + what + " (final sum)");
  partial.release();
}

// ---- softmax / log_softmax -----------------------------------------------------------------
template <typename T>
void softmax_forward(const FusedParams& p, cudaStream_t stream) {
  const bool log = p.op == FusedOp::kLogSoftmax;
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};
  Temp<float> row_max(rows, stream, "softmax row max");
  Temp<float> e(rows * n, stream, "softmax exp");
  Temp<float> row_sum(rows, stream, "softmax row sum");
  const Mat<float> e_mat{e.get(), n};
  launch_row_reduce<MaxOp>(stream, "softmax row max", rows, n, Scaled{scalars_f32(p).scale}, Total{}, row_max.get(), x);
  launch_map(stream, "softmax exp", rows, n, ExpShifted{scalars_f32(p).scale}, e_mat, x, PerRow{row_max.get()});
  launch_row_reduce<SumOp>(stream, "softmax row sum", rows, n, Identity{}, Total{}, row_sum.get(), e_mat);
  if (log) {
    e.release();
    launch_map(stream, "log_softmax output", rows, n, LogSoftmaxOut{scalars_f32(p).scale}, y, x, PerRow{row_max.get()},
               PerRow{row_sum.get()});
  } else {
    launch_map(stream, "softmax divide", rows, n, Divide{}, y, e_mat, PerRow{row_sum.get()});
    e.release();
  }
  row_max.release();
  row_sum.release();
}

// params.x holds the forward OUTPUT y here.
template <typename T>
void softmax_backward(const FusedParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> y{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> dx{static_cast<T*>(p.dx), p.ld_dx};
  Temp<float> row_sum(rows, stream, "softmax backward row sum");
  if (p.op == FusedOp::kSoftmax) {
    Temp<float> prod(rows * n, stream, "softmax backward dy*y");
    const Mat<float> prod_mat{prod.get(), n};
    launch_map(stream, "softmax backward dy*y", rows, n, Multiply{}, prod_mat, dy, y);
    launch_row_reduce<SumOp>(stream, "softmax backward row sum", rows, n, Identity{}, Total{}, row_sum.get(),
                             prod_mat);
    prod.release();
    launch_map(stream, "softmax backward dx", rows, n, SoftmaxGrad{scalars_f32(p).scale}, dx, y, dy, PerRow{row_sum.get()});
  } else {
    Temp<float> e(rows * n, stream, "log_softmax backward exp");
    const Mat<float> e_mat{e.get(), n};
    launch_row_reduce<SumOp>(stream, "log_softmax backward row sum", rows, n, Identity{}, Total{},
                             row_sum.get(), dy);
    launch_map(stream, "log_softmax backward exp", rows, n, Exp{}, e_mat, y);
    launch_map(stream, "log_softmax backward dx", rows, n, LogSoftmaxGrad{scalars_f32(p).scale}, dx, dy, e_mat,
               PerRow{row_sum.get()});
    e.release();
  }
  row_sum.release();
}

// ---- layer_norm / rms_norm (and their add forms) -------------------------------------------
template <typename T>
void norm_forward(const FusedParams& p, cudaStream_t stream) {
  const bool layer = p.is_layer_norm();
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};

  // h: x, or (add form) x + residual rounded to T, written where the caller wants it.
  Mat<const T> h = x;
  std::optional<Temp<T>> h_temp;
  if (p.is_add_form()) {
    Mat<T> h_out{static_cast<T*>(p.residual_out), p.ld_residual_out};
    if (h_out.p == nullptr) {
      h_temp.emplace(rows * n, stream, "norm h = x + residual");
      h_out = {h_temp->get(), n};
    }
    if (p.residual != nullptr) {
      launch_map(stream, "norm residual add", rows, n, Add{}, h_out, x,
                 Mat<const T>{static_cast<const T*>(p.residual), p.ld_residual});
    } else {  // no residual: h = x (the public API sends plain norms as kLayerNorm / kRmsNorm)
      launch_map(stream, "norm residual copy", rows, n, Identity{}, h_out, x);
    }
    h = {h_out.p, h_out.ld};
  }

  // Statistics: into the caller's mean / rstd when given, else (rows) temporaries.
  std::optional<Temp<float>> mean_temp, rstd_temp;
  float* mean = p.mean;
  if (layer && mean == nullptr) mean = mean_temp.emplace(rows, stream, "norm mean").get();
  float* rstd = p.rstd != nullptr ? p.rstd : rstd_temp.emplace(rows, stream, "norm rstd").get();
  Temp<float> moment(rows, stream, "norm variance");  // var (layer_norm) or mean(h^2) (rms_norm)
  if (layer) {
    launch_row_reduce<SumOp>(stream, "layer_norm row mean", rows, n, Identity{}, MeanOf{}, mean, h);
    launch_row_reduce<SumOp>(stream, "layer_norm row variance", rows, n, SquaredDeviation{}, MeanOf{},
                             moment.get(), h, PerRow{mean});
  } else {
    launch_row_reduce<SumOp>(stream, "rms_norm row mean square", rows, n, Square{}, MeanOf{}, moment.get(), h);
  }
  // A (rows, 1) map: rstd per row.
  launch_map(stream, "norm rstd", rows, 1, RsqrtPlusEps{scalars_f32(p).eps}, Mat<float>{rstd, 1},
             Mat<float>{moment.get(), 1});
  moment.release();

  // normalize -> scale -> shift; the last step present writes y.
  const bool has_weight = p.weight != nullptr;
  const bool has_bias = layer && p.bias != nullptr;
  auto normalize = [&](auto out) {
    if (layer)
      launch_map(stream, "layer_norm normalize", rows, n, Normalize{}, out, h, PerRow{mean}, PerRow{rstd});
    else
      launch_map(stream, "rms_norm normalize", rows, n, Multiply{}, out, h, PerRow{rstd});
  };
  if (!has_weight && !has_bias) {
    normalize(y);
  } else {
    Temp<float> t(rows * n, stream, "norm xhat");
    const Mat<float> t_mat{t.get(), n};
    normalize(t_mat);
    if (has_weight) {
      const PerCol<T> weight{static_cast<const T*>(p.weight)};
      if (has_bias)
        launch_map(stream, "norm weight", rows, n, Multiply{}, t_mat, t_mat, weight);
      else
        launch_map(stream, "norm weight", rows, n, Multiply{}, y, t_mat, weight);
    }
    if (has_bias)
      launch_map(stream, "layer_norm bias", rows, n, Add{}, y, t_mat, PerCol<T>{static_cast<const T*>(p.bias)});
    t.release();
  }
  if (h_temp) h_temp->release();
  if (mean_temp) mean_temp->release();
  if (rstd_temp) rstd_temp->release();
}

// The backward once g = dy * weight exists (G: a fp32 temporary, or dy itself without weight).
template <typename T, typename G>
void norm_backward_from_g(const FusedParams& p, cudaStream_t stream, G g) {
  const bool layer = p.is_layer_norm();
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> h{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> dx{static_cast<T*>(p.dx), p.ld_dx};
  const PerRow rstd{p.rstd};
  const PerRow mean{p.mean};

  Temp<float> xhat(rows * n, stream, "norm backward xhat");
  const Mat<float> xhat_mat{xhat.get(), n};
  if (layer)
    launch_map(stream, "layer_norm backward xhat", rows, n, Normalize{}, xhat_mat, h, mean, rstd);
  else
    launch_map(stream, "rms_norm backward xhat", rows, n, Multiply{}, xhat_mat, h, rstd);

  Temp<float> mean_gx(rows, stream, "norm backward mean(g*xhat)");
  {
    Temp<float> gx(rows * n, stream, "norm backward g*xhat");
    const Mat<float> gx_mat{gx.get(), n};
    launch_map(stream, "norm backward g*xhat", rows, n, Multiply{}, gx_mat, g, xhat_mat);
    launch_row_reduce<SumOp>(stream, "norm backward row mean(g*xhat)", rows, n, Identity{}, MeanOf{},
                             mean_gx.get(), gx_mat);
    gx.release();
  }
  std::optional<Temp<float>> mean_g;
  if (layer) {
    mean_g.emplace(rows, stream, "layer_norm backward mean(g)");
    launch_row_reduce<SumOp>(stream, "layer_norm backward row mean(g)", rows, n, Identity{}, MeanOf{},
                             mean_g->get(), g);
  }

  // Parameter gradients before dx: dx may be dy's very buffer.
  if (p.dweight != nullptr) {
    Temp<float> prod(rows * n, stream, "norm backward dy*xhat");
    const Mat<float> prod_mat{prod.get(), n};
    launch_map(stream, "norm backward dy*xhat", rows, n, Multiply{}, prod_mat, dy, xhat_mat);
    launch_column_sum<T>(stream, "norm backward dweight", rows, n, prod_mat, p.dweight);
    prod.release();
  }
  if (layer && p.dbias != nullptr) launch_column_sum<T>(stream, "layer_norm backward dbias", rows, n, dy, p.dbias);

  auto input_grad = [&](auto out) {
    if (layer)
      launch_map(stream, "layer_norm backward dx", rows, n, LayerNormGrad{}, out, g, xhat_mat, rstd,
                 PerRow{mean_g->get()}, PerRow{mean_gx.get()});
    else
      launch_map(stream, "rms_norm backward dx", rows, n, RmsNormGrad{}, out, g, xhat_mat, rstd,
                 PerRow{mean_gx.get()});
  };
  if (p.dresidual_out == nullptr) {
    input_grad(dx);
  } else {
    Temp<float> dh(rows * n, stream, "norm backward dh");
    const Mat<float> dh_mat{dh.get(), n};
    input_grad(dh_mat);
    launch_map(stream, "norm backward dx += dresidual_out", rows, n, Add{}, dx, dh_mat,
               Mat<const T>{static_cast<const T*>(p.dresidual_out), p.ld_dresidual_out});
    dh.release();
  }
  xhat.release();
  mean_gx.release();
  if (mean_g) mean_g->release();
}

template <typename T>
void norm_backward(const FusedParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  if (p.weight == nullptr) {
    norm_backward_from_g<T>(p, stream, dy);
    return;
  }
  Temp<float> g(rows * n, stream, "norm backward g = dy*weight");
  const Mat<float> g_mat{g.get(), n};
  launch_map(stream, "norm backward dy*weight", rows, n, Multiply{}, g_mat, dy,
             PerCol<T>{static_cast<const T*>(p.weight)});
  norm_backward_from_g<T>(p, stream, g_mat);
  g.release();
}

// ---- bias + GELU ---------------------------------------------------------------------------
template <typename T>
void bias_gelu_forward(const FusedParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};
  const Gelu gelu{p.gelu == GeluApproximation::kTanh};
  if (p.bias == nullptr) {
    launch_map(stream, "gelu", rows, n, gelu, y, x);
    return;
  }
  Temp<float> z(rows * n, stream, "bias_gelu x + bias");  // fp32: x + bias is not rounded
  const Mat<float> z_mat{z.get(), n};
  launch_map(stream, "bias_gelu bias add", rows, n, Add{}, z_mat, x, PerCol<T>{static_cast<const T*>(p.bias)});
  launch_map(stream, "bias_gelu gelu", rows, n, gelu, y, z_mat);
  z.release();
}

template <typename T>
void bias_gelu_backward(const FusedParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> dx{static_cast<T*>(p.dx), p.ld_dx};
  const GeluGrad gelu_grad{p.gelu == GeluApproximation::kTanh};
  Temp<float> d(rows * n, stream, "bias_gelu backward gelu'");
  const Mat<float> d_mat{d.get(), n};
  if (p.bias == nullptr) {
    launch_map(stream, "gelu backward gelu'", rows, n, gelu_grad, d_mat, x);
  } else {
    Temp<float> z(rows * n, stream, "bias_gelu backward x + bias");
    const Mat<float> z_mat{z.get(), n};
    launch_map(stream, "bias_gelu backward bias add", rows, n, Add{}, z_mat, x,
               PerCol<T>{static_cast<const T*>(p.bias)});
    launch_map(stream, "bias_gelu backward gelu'", rows, n, gelu_grad, d_mat, z_mat);
    z.release();
  }
  // dx in fp32 first (in place over gelu'), so that dbias sums the unrounded values like the other
  // variants; then dx is written in T by its own kernel.
  launch_map(stream, "bias_gelu backward dy * gelu'", rows, n, Multiply{}, d_mat, dy, d_mat);
  if (p.dbias != nullptr)
    launch_column_sum<T>(stream, "bias_gelu backward dbias", rows, n, Mat<const float>{d.get(), n}, p.dbias);
  launch_map(stream, "bias_gelu backward dx", rows, n, Identity{}, dx, d_mat);
  d.release();
}

// ---- SiLU-and-mul --------------------------------------------------------------------------
// x = [a | b]: a is columns [0, d) of x, b columns [d, 2d); width = d.
template <typename T>
void silu_and_mul_forward(const FusedParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows, d = p.width;
  const Mat<const T> a{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> b{static_cast<const T*>(p.x) + d, p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};
  Temp<float> s(rows * d, stream, "silu_and_mul silu(a)");
  const Mat<float> s_mat{s.get(), d};
  launch_map(stream, "silu_and_mul silu", rows, d, Silu{}, s_mat, a);
  launch_map(stream, "silu_and_mul mul", rows, d, Multiply{}, y, s_mat, b);
  s.release();
}

template <typename T>
void silu_and_mul_backward(const FusedParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows, d = p.width;
  const Mat<const T> a{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> b{static_cast<const T*>(p.x) + d, p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> da{static_cast<T*>(p.dx), p.ld_dx};
  const Mat<T> db{static_cast<T*>(p.dx) + d, p.ld_dx};
  Temp<float> sig(rows * d, stream, "silu_and_mul backward sigmoid(a)");
  Temp<float> s(rows * d, stream, "silu_and_mul backward silu(a)");
  const Mat<float> sig_mat{sig.get(), d};
  const Mat<float> s_mat{s.get(), d};
  launch_map(stream, "silu_and_mul backward sigmoid", rows, d, Sigmoid{}, sig_mat, a);
  launch_map(stream, "silu_and_mul backward silu", rows, d, Silu{}, s_mat, a);
  // da reads a and b; db reads neither, so dx may be x's very buffer.
  launch_map(stream, "silu_and_mul backward da", rows, d, SiluAndMulGradA{}, da, dy, a, b, sig_mat);
  launch_map(stream, "silu_and_mul backward db", rows, d, Multiply{}, db, dy, s_mat);
  sig.release();
  s.release();
}

template <typename T>
void run(const FusedParams& p, cudaStream_t stream) {
  switch (p.op) {
    case FusedOp::kSoftmax:
    case FusedOp::kLogSoftmax:
      return p.backward ? softmax_backward<T>(p, stream) : softmax_forward<T>(p, stream);
    case FusedOp::kLayerNorm:
    case FusedOp::kRmsNorm:
    case FusedOp::kAddLayerNorm:
    case FusedOp::kAddRmsNorm:
      return p.backward ? norm_backward<T>(p, stream) : norm_forward<T>(p, stream);
    case FusedOp::kBiasGelu:
      return p.backward ? bias_gelu_backward<T>(p, stream) : bias_gelu_forward<T>(p, stream);
    case FusedOp::kSiluAndMul:
      return p.backward ? silu_and_mul_backward<T>(p, stream) : silu_and_mul_forward<T>(p, stream);
  }
  throw Error(Status::kInternal, "launch_fused_unfused: unknown FusedOp " +
                                     std::to_string(static_cast<int>(p.op)));
}

}  // namespace

void launch_fused_unfused(const FusedParams& params, void* stream) {
  if (params.rows <= 0 || params.width <= 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (params.dtype) {
    case DType::kF32: return run<float>(params, s);
    case DType::kF16: return run<__half>(params, s);
    case DType::kBF16: return run<__nv_bfloat16>(params, s);
    default: break;
  }
  throw Error(Status::kUnsupported, "launch_fused_unfused: dtype " + std::string(dtype_name(params.dtype)) +
                                        " (supported: fp32, fp16, bf16)");
}

}  // namespace optimized
