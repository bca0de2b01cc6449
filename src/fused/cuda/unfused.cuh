// Fused memory-bound family, CUDA rung 1: UNFUSED -- what an eager framework launches.
//
// Every op is spelled out as the chain of elementary kernels a naive PyTorch-style program runs:
// each kernel reads its operands from global memory and writes its result to global memory, so
// the chain pays one full read + write of the (rows, width) tensor per step. That traffic is what
// the fused rungs (row_streaming.cuh, row_registers.cuh, elementwise.cuh) remove; this file is the
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
// Temporaries are slices of the caller's workspace (src/core/workspace.h), given back when their
// last reader is enqueued so that later temporaries reuse the bytes (stream order makes that safe).
// The same chain runs once counting, to answer the workspace query, so the sizes cannot disagree.
// The launcher never allocates and never throws: the first failed launch ends the chain and is
// returned. The build instantiates fused_unfused_dtype once per dtype of OPTIMIZED_DTYPES, each in
// its own generated translation unit (cmake/dtype_instance.cu.in).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fused/cuda/fused_common.cuh"

namespace optimized::cuda::fused {
namespace {

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
  __device__ float operator()(float z) const { return gelu(z, tanh_form); }
};
struct GeluGrad {
  bool tanh_form;
  __device__ float operator()(float z) const { return gelu_grad(z, tanh_form); }
};
struct Sigmoid {
  __device__ float operator()(float a) const { return sigmoid(a); }
};
struct Silu {  // a / (1 + exp(-a)), as fused.h defines it
  __device__ float operator()(float a) const { return silu(a); }
};
struct SiluAndMulGradA {
  __device__ float operator()(float dy, float a, float b, float sig) const {
    return dy * b * sig * (1.0f + a * (1.0f - sig));
  }
};

// Row-reduction finishers (the combiners are kernels::SumOp and kernels::MaxOp: NaN propagates).
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

// out[r] = finish(reduce over c of elem(in(r, c)...), cols); one block per row, blocks walk rows.
template <typename Reduce, typename Elem, typename Finish, typename... In>
__global__ void __launch_bounds__(kRowThreads)
    row_reduce_kernel(int64_t rows, int64_t cols, Elem elem, Finish finish, float* out, In... in) {
  __shared__ float scratch[32][1];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float acc = Reduce::identity();
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) acc = Reduce::apply(acc, elem(in.load(r, c)...));
    acc = block_reduce<Reduce>(acc, static_cast<int>(blockDim.x), scratch);
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
// One call's chain of kernels: the stream, the workspace its temporaries come from, and the first
// error. Measuring (the workspace query), it takes the same temporaries from a counting arena and
// launches nothing. After an error, or a workspace too small, the later steps do nothing.
class Chain {
 public:
  Chain(const Workspace& workspace, cudaStream_t stream, size_t* measure)
      : arena_(arena_for(workspace, measure)), stream_(stream), measure_(measure) {}

  // A temporary of `count` elements of E; it lives until the enclosing ArenaScope ends (or the call).
  template <typename E>
  E* temp(int64_t count) {
    E* p = arena_.take<E>(count);
    if (!measure_ && !p && count > 0 && status_ == cudaSuccess) status_ = cudaErrorInvalidValue;
    return p;
  }
  WorkspaceArena& arena() { return arena_; }

  // out(r, c) = op(in(r, c)...) over a (rows, cols) grid.
  template <typename Op, typename Out, typename... In>
  void map(int64_t rows, int64_t cols, Op op, Out out, In... in) {
    if (!launching()) return;
    const int64_t blocks = std::min(ceil_div(rows * cols, kMapThreads), kMaxMapBlocks);
    map_kernel<<<static_cast<unsigned>(blocks), kMapThreads, 0, stream_>>>(rows, cols, op, out, in...);
    status_ = cudaGetLastError();
  }

  // out[r] = finish(Reduce over c of elem(in(r, c)...), cols).
  template <typename Reduce, typename Elem, typename Finish, typename... In>
  void row_reduce(int64_t rows, int64_t cols, Elem elem, Finish finish, float* out, In... in) {
    if (!launching()) return;
    // Short rows get a block just wide enough (whole warps), long rows kRowThreads.
    const int threads = static_cast<int>(std::min<int64_t>(kRowThreads, ceil_div(cols, 32) * 32));
    const int64_t blocks = std::min(rows, kMaxRowBlocks);
    row_reduce_kernel<Reduce><<<static_cast<unsigned>(blocks), threads, 0, stream_>>>(rows, cols, elem, finish, out,
                                                                                       in...);
    status_ = cudaGetLastError();
  }

  // out[c] = sum over rows of in(r, c), written in T: row slices -> fp32 partials -> column sum.
  template <typename T, typename In>
  void column_sum(int64_t rows, int64_t cols, In in, void* out) {
    const int64_t col_tiles = ceil_div(cols, kColX);
    if (col_tiles > INT32_MAX && status_ == cudaSuccess) status_ = cudaErrorInvalidValue;  // grid.x
    // Enough row slices to fill the GPU when there are few columns, none thinner than 64 rows.
    int64_t splits = std::max<int64_t>(1, ceil_div(kColTargetBlocks, col_tiles));
    splits = std::min({splits, ceil_div(rows, kColMinRowsPerSplit), int64_t{65535}});
    const int64_t rows_per_split = ceil_div(rows, splits);
    splits = ceil_div(rows, rows_per_split);
    ArenaScope scope(arena_);
    float* partial = temp<float>(splits * cols);
    if (!launching()) return;
    const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(splits));
    column_partial_kernel<<<grid, dim3(kColX, kColY), 0, stream_>>>(rows, cols, rows_per_split, in, partial);
    if ((status_ = cudaGetLastError()) != cudaSuccess) return;
    const int64_t finish_blocks = std::min(ceil_div(cols, kMapThreads), kMaxMapBlocks);
    column_finish_kernel<T><<<static_cast<unsigned>(finish_blocks), kMapThreads, 0, stream_>>>(
        splits, cols, partial, static_cast<T*>(out));
    status_ = cudaGetLastError();
  }

  // The chain's result: measuring, the workspace it takes (into *measure); else the first error.
  cudaError_t finish() {
    if (measure_) *measure_ = arena_.peak();
    return status_;
  }

 private:
  bool launching() const { return !measure_ && status_ == cudaSuccess; }

  WorkspaceArena arena_;
  cudaStream_t stream_;
  size_t* measure_;
  cudaError_t status_ = cudaSuccess;
};

// ---- softmax / log_softmax -----------------------------------------------------------------
template <typename T>
void softmax_forward_chain(const FusedParams& p, Chain& chain) {
  const bool log = p.op == FusedOp::kLogSoftmax;
  const int64_t rows = p.rows, n = p.width;
  const float scale = scalars_f32(p).scale;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};
  float* row_max = chain.temp<float>(rows);
  float* row_sum = chain.temp<float>(rows);
  float* e = chain.temp<float>(rows * n);
  const Mat<float> e_mat{e, n};
  chain.row_reduce<MaxOp>(rows, n, Scaled{scale}, Total{}, row_max, x);   // row max of scale*x
  chain.map(rows, n, ExpShifted{scale}, e_mat, x, PerRow{row_max});       // e = exp(scale*x - max)
  chain.row_reduce<SumOp>(rows, n, Identity{}, Total{}, row_sum, e_mat);  // row sum of e
  if (log)
    chain.map(rows, n, LogSoftmaxOut{scale}, y, x, PerRow{row_max}, PerRow{row_sum});
  else
    chain.map(rows, n, Divide{}, y, e_mat, PerRow{row_sum});
}

// params.x holds the forward OUTPUT y here.
template <typename T>
void softmax_backward_chain(const FusedParams& p, Chain& chain) {
  const int64_t rows = p.rows, n = p.width;
  const float scale = scalars_f32(p).scale;
  const Mat<const T> y{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> dx{static_cast<T*>(p.dx), p.ld_dx};
  float* row_sum = chain.temp<float>(rows);
  if (p.op == FusedOp::kSoftmax) {
    float* prod = chain.temp<float>(rows * n);
    const Mat<float> prod_mat{prod, n};
    chain.map(rows, n, Multiply{}, prod_mat, dy, y);                              // dy*y
    chain.row_reduce<SumOp>(rows, n, Identity{}, Total{}, row_sum, prod_mat);   // row sum
    chain.map(rows, n, SoftmaxGrad{scale}, dx, y, dy, PerRow{row_sum});
  } else {
    float* e = chain.temp<float>(rows * n);
    const Mat<float> e_mat{e, n};
    chain.row_reduce<SumOp>(rows, n, Identity{}, Total{}, row_sum, dy);  // row sum of dy
    chain.map(rows, n, Exp{}, e_mat, y);                                  // e = exp(y)
    chain.map(rows, n, LogSoftmaxGrad{scale}, dx, dy, e_mat, PerRow{row_sum});
  }
}

// ---- layer_norm / rms_norm (and their add forms) -------------------------------------------
template <typename T>
void norm_forward_chain(const FusedParams& p, Chain& chain) {
  const bool layer = p.is_layer_norm();
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};

  // h: x, or (add form) x + residual rounded to T, written where the caller wants it.
  Mat<const T> h = x;
  if (p.is_add_form()) {
    Mat<T> h_out{static_cast<T*>(p.residual_out), p.ld_residual_out};
    if (h_out.p == nullptr) h_out = {chain.temp<T>(rows * n), n};
    if (p.residual != nullptr)
      chain.map(rows, n, Add{}, h_out, x, Mat<const T>{static_cast<const T*>(p.residual), p.ld_residual});
    else  // no residual: h = x (the public API sends plain norms as kLayerNorm / kRmsNorm)
      chain.map(rows, n, Identity{}, h_out, x);
    h = {h_out.p, h_out.ld};
  }

  // Statistics: into the caller's mean / rstd when given, else (rows) temporaries.
  float* mean = p.mean;
  if (layer && mean == nullptr) mean = chain.temp<float>(rows);
  float* rstd = p.rstd != nullptr ? p.rstd : chain.temp<float>(rows);
  {
    ArenaScope scope(chain.arena());
    float* moment = chain.temp<float>(rows);  // var (layer_norm) or mean(h^2) (rms_norm)
    if (layer) {
      chain.row_reduce<SumOp>(rows, n, Identity{}, MeanOf{}, mean, h);
      chain.row_reduce<SumOp>(rows, n, SquaredDeviation{}, MeanOf{}, moment, h, PerRow{mean});
    } else {
      chain.row_reduce<SumOp>(rows, n, Square{}, MeanOf{}, moment, h);
    }
    // A (rows, 1) map: rstd per row.
    chain.map(rows, 1, RsqrtPlusEps{scalars_f32(p).eps}, Mat<float>{rstd, 1}, Mat<float>{moment, 1});
  }

  // normalize -> scale -> shift; the last step present writes y.
  const bool has_weight = p.weight != nullptr;
  const bool has_bias = layer && p.bias != nullptr;
  auto normalize = [&](auto out) {
    if (layer)
      chain.map(rows, n, Normalize{}, out, h, PerRow{mean}, PerRow{rstd});
    else
      chain.map(rows, n, Multiply{}, out, h, PerRow{rstd});
  };
  if (!has_weight && !has_bias) {
    normalize(y);
    return;
  }
  const Mat<float> t_mat{chain.temp<float>(rows * n), n};  // xhat
  normalize(t_mat);
  if (has_weight) {
    const PerCol<T> weight{static_cast<const T*>(p.weight)};
    if (has_bias)
      chain.map(rows, n, Multiply{}, t_mat, t_mat, weight);
    else
      chain.map(rows, n, Multiply{}, y, t_mat, weight);
  }
  if (has_bias) chain.map(rows, n, Add{}, y, t_mat, PerCol<T>{static_cast<const T*>(p.bias)});
}

// The backward once g = dy * weight exists (G: a fp32 temporary, or dy itself without weight).
template <typename T, typename G>
void norm_backward_from_g(const FusedParams& p, Chain& chain, G g) {
  const bool layer = p.is_layer_norm();
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> h{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> dx{static_cast<T*>(p.dx), p.ld_dx};
  const PerRow rstd{p.rstd};
  const PerRow mean{p.mean};

  const Mat<float> xhat_mat{chain.temp<float>(rows * n), n};
  if (layer)
    chain.map(rows, n, Normalize{}, xhat_mat, h, mean, rstd);
  else
    chain.map(rows, n, Multiply{}, xhat_mat, h, rstd);

  float* mean_gx = chain.temp<float>(rows);
  float* mean_g = layer ? chain.temp<float>(rows) : nullptr;
  {
    ArenaScope scope(chain.arena());
    const Mat<float> gx_mat{chain.temp<float>(rows * n), n};
    chain.map(rows, n, Multiply{}, gx_mat, g, xhat_mat);                      // g*xhat
    chain.row_reduce<SumOp>(rows, n, Identity{}, MeanOf{}, mean_gx, gx_mat);  // row mean(g*xhat)
  }
  if (layer) chain.row_reduce<SumOp>(rows, n, Identity{}, MeanOf{}, mean_g, g);  // row mean(g)

  // Parameter gradients before dx: dx may be dy's very buffer.
  if (p.dweight != nullptr) {
    ArenaScope scope(chain.arena());
    const Mat<float> prod_mat{chain.temp<float>(rows * n), n};
    chain.map(rows, n, Multiply{}, prod_mat, dy, xhat_mat);  // dy*xhat
    chain.column_sum<T>(rows, n, prod_mat, p.dweight);
  }
  if (layer && p.dbias != nullptr) chain.column_sum<T>(rows, n, dy, p.dbias);

  auto input_grad = [&](auto out) {
    if (layer)
      chain.map(rows, n, LayerNormGrad{}, out, g, xhat_mat, rstd, PerRow{mean_g}, PerRow{mean_gx});
    else
      chain.map(rows, n, RmsNormGrad{}, out, g, xhat_mat, rstd, PerRow{mean_gx});
  };
  if (p.dresidual_out == nullptr) {
    input_grad(dx);
  } else {
    const Mat<float> dh_mat{chain.temp<float>(rows * n), n};
    input_grad(dh_mat);
    chain.map(rows, n, Add{}, dx, dh_mat, Mat<const T>{static_cast<const T*>(p.dresidual_out), p.ld_dresidual_out});
  }
}

template <typename T>
void norm_backward_chain(const FusedParams& p, Chain& chain) {
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  if (p.weight == nullptr) {
    norm_backward_from_g<T>(p, chain, dy);
    return;
  }
  const Mat<float> g_mat{chain.temp<float>(rows * n), n};
  chain.map(rows, n, Multiply{}, g_mat, dy, PerCol<T>{static_cast<const T*>(p.weight)});  // g = dy*weight
  norm_backward_from_g<T>(p, chain, g_mat);
}

// ---- bias + GELU ---------------------------------------------------------------------------
template <typename T>
void bias_gelu_forward_chain(const FusedParams& p, Chain& chain) {
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};
  const Gelu gelu{p.gelu == GeluApproximation::kTanh};
  if (p.bias == nullptr) {
    chain.map(rows, n, gelu, y, x);
    return;
  }
  const Mat<float> z_mat{chain.temp<float>(rows * n), n};  // fp32: x + bias is not rounded
  chain.map(rows, n, Add{}, z_mat, x, PerCol<T>{static_cast<const T*>(p.bias)});
  chain.map(rows, n, gelu, y, z_mat);
}

template <typename T>
void bias_gelu_backward_chain(const FusedParams& p, Chain& chain) {
  const int64_t rows = p.rows, n = p.width;
  const Mat<const T> x{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> dx{static_cast<T*>(p.dx), p.ld_dx};
  const GeluGrad gelu_grad{p.gelu == GeluApproximation::kTanh};
  const Mat<float> d_mat{chain.temp<float>(rows * n), n};
  if (p.bias == nullptr) {
    chain.map(rows, n, gelu_grad, d_mat, x);  // gelu'(x)
  } else {
    ArenaScope scope(chain.arena());
    const Mat<float> z_mat{chain.temp<float>(rows * n), n};
    chain.map(rows, n, Add{}, z_mat, x, PerCol<T>{static_cast<const T*>(p.bias)});  // x + bias
    chain.map(rows, n, gelu_grad, d_mat, z_mat);
  }
  // dx in fp32 first (in place over gelu'), so that dbias sums the unrounded values like the other
  // variants; then dx is written in T by its own kernel.
  chain.map(rows, n, Multiply{}, d_mat, dy, d_mat);
  if (p.dbias != nullptr) chain.column_sum<T>(rows, n, Mat<const float>{d_mat.p, n}, p.dbias);
  chain.map(rows, n, Identity{}, dx, d_mat);
}

// ---- SiLU-and-mul --------------------------------------------------------------------------
// x = [a | b]: a is columns [0, d) of x, b columns [d, 2d); width = d.
template <typename T>
void silu_and_mul_forward_chain(const FusedParams& p, Chain& chain) {
  const int64_t rows = p.rows, d = p.width;
  const Mat<const T> a{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> b{static_cast<const T*>(p.x) + d, p.ld_x};
  const Mat<T> y{static_cast<T*>(p.y), p.ld_y};
  const Mat<float> s_mat{chain.temp<float>(rows * d), d};
  chain.map(rows, d, Silu{}, s_mat, a);
  chain.map(rows, d, Multiply{}, y, s_mat, b);
}

template <typename T>
void silu_and_mul_backward_chain(const FusedParams& p, Chain& chain) {
  const int64_t rows = p.rows, d = p.width;
  const Mat<const T> a{static_cast<const T*>(p.x), p.ld_x};
  const Mat<const T> b{static_cast<const T*>(p.x) + d, p.ld_x};
  const Mat<const T> dy{static_cast<const T*>(p.dy), p.ld_dy};
  const Mat<T> da{static_cast<T*>(p.dx), p.ld_dx};
  const Mat<T> db{static_cast<T*>(p.dx) + d, p.ld_dx};
  const Mat<float> sig_mat{chain.temp<float>(rows * d), d};
  const Mat<float> s_mat{chain.temp<float>(rows * d), d};
  chain.map(rows, d, Sigmoid{}, sig_mat, a);
  chain.map(rows, d, Silu{}, s_mat, a);
  // da reads a and b; db reads neither, so dx may be x's very buffer.
  chain.map(rows, d, SiluAndMulGradA{}, da, dy, a, b, sig_mat);
  chain.map(rows, d, Multiply{}, db, dy, s_mat);
}

template <typename T>
void run_chain(const FusedParams& p, Chain& chain) {
  switch (p.op) {
    case FusedOp::kSoftmax:
    case FusedOp::kLogSoftmax:
      return p.backward ? softmax_backward_chain<T>(p, chain) : softmax_forward_chain<T>(p, chain);
    case FusedOp::kLayerNorm:
    case FusedOp::kRmsNorm:
    case FusedOp::kAddLayerNorm:
    case FusedOp::kAddRmsNorm:
      return p.backward ? norm_backward_chain<T>(p, chain) : norm_forward_chain<T>(p, chain);
    case FusedOp::kBiasGelu:
      return p.backward ? bias_gelu_backward_chain<T>(p, chain) : bias_gelu_forward_chain<T>(p, chain);
    case FusedOp::kSiluAndMul:
      return p.backward ? silu_and_mul_backward_chain<T>(p, chain) : silu_and_mul_forward_chain<T>(p, chain);
  }
}

}  // namespace
}  // namespace optimized::cuda::fused

namespace optimized::cuda {

template <DType kDType>
cudaError_t fused_unfused_dtype(const FusedParams& p, const Workspace& workspace, cudaStream_t stream, size_t* measure) {
  fused::Chain chain(workspace, stream, measure);
  if (p.rows > 0 && p.width > 0) fused::run_chain<kernels::cuda_type_t<kDType>>(p, chain);
  return chain.finish();
}

}  // namespace optimized::cuda
