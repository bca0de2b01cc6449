// Public entry of the linear family (include/optimized/linear.h): validates the operands (messages
// name the argument, what was expected and what was given; the one owner of the family's checks:
// the GEMMs below only meet views built from checked operands), resolves the variant through the
// table (linear_variants.h), then composes the GEMM family's public matmul with its epilogue:
//
//   forward   y = act(x W^T + b), pre = x W^T + b      one matmul: A = x (M, K), B = W^T (K, N) (W's
//                                                       transposed view), C = y, epilogue {bias,
//                                                       activation, aux = pre}
//   backward  g = dy, or dy * act'(pre)                the family's kernel (cpu::linear_act_grad /
//             db = column sums of g (fixed order)      cuda::linear_act_grad), one pass over dy, pre
//             pre recomputed when absent               matmul(x, W^T) + bias into scratch (dtype)
//             dX = g W                                 matmul: A = g (M, N), B = W (N, K), C = dX
//             dW = g^T X (+ dW with accumulate)        matmul: A = g^T (N, M) (g's transposed view),
//                                                       B = x (M, K), C = dW, beta = accumulate
//
// fp32 gradients from 16-bit inputs: matmul takes an fp32 C from fp16 / bf16 A and B on its
// epilogue rungs (cpu_*, naive, mma_pipeline, wgmma_persistent: every rung a linear variant runs);
// the dW GEMM goes through the epilogue overload with an empty GemmEpilogue, which the GEMM routes to
// those rungs whenever C's dtype differs from A's. The bias gradient's dtype is handled by the
// family's kernel (fp32 partial sums, rounded once into grad_bias).
//
// fp8 (LinearForwardOptions / LinearBackwardOptions::fp8, linear_fp8.h): the same composition on
// scaled_matmul (the GEMM family's fp8 GEMM, with its bias / activation / aux / beta epilogue) over
// fp8 copies the family's passes write: an amax pass (x, W; dy without an activation; g's amax comes
// from the act_grad pass) and one cast pass writing each GEMM's K-major operands (x8, W8; g8 and W8^T
// for dX; g8^T and x8^T for dW). Fp8Call holds that scratch (host memory or a CallWorkspace) and runs
// the passes on either backend.
//
// Scratch: on the CPU plain vectors (pre, g); on CUDA one CallWorkspace (the caller's, or allocated
// on the stream) holding pre, g (rows padded to 16 bytes, so that every GEMM rung's loads take them)
// and the act_grad launcher's partial sums. With a caller's workspace, what is left after those
// goes to the GEMMs (which say when it is too small, naming the workspace).
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/arg_checks.h"
#include "core/workspace.h"
#include "linear/cpu/linear_cpu.h"
#include "linear/linear_fp8.h"
#include "linear/linear_params.h"
#include "linear/linear_variants.h"
#include "optimized/gemm.h"
#include "optimized/linear.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#include "linear/launchers.h"
#endif

namespace optimized {

namespace {

using arg::dname;
using arg::invalid;
using arg::present;
using arg::shape_string;
using arg::unsupported;

bool is_half(DType d) { return d == DType::kF16 || d == DType::kBF16; }
int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// A (..., width) view as rows: its leading dimensions flattened to `rows`, uniformly `ld` apart.
struct Rows {
  int64_t rows = 0, cols = 0, ld = 0;
};

// The call's operands (core/arg_checks.h's OperandSet: one device, extent, alignment, outputs
// that overlap nothing else) and the rows view the family takes.
class Operands : public arg::OperandSet {
 public:
  // `t` (..., width) as uniformly strided rows: unit stride along the last dimension, leading
  // dimensions that flatten (each outer one's stride continues the inner ones), rows >= width apart.
  Rows rows(const TensorView& t, const char* name, const char* width, bool output) {
    if (t.rank < 1)
      invalid(std::string(name) + ": expected rank >= 1 (..., " + width + "); given rank 0 (absent)");
    add(t, name, output);
    Rows r;
    r.cols = t.shape[t.rank - 1];
    r.rows = 1;
    for (int d = 0; d + 1 < t.rank; ++d) r.rows *= t.shape[d];  // fits: view_extent counted the elements
    if (r.cols > 1 && r.rows > 0 && t.strides[t.rank - 1] != 1)
      invalid(std::string(name) + ": expected unit stride in the last dimension (" + width + "); given " + t.describe());
    int64_t ld = -1, next = 0;  // the row stride; the stride the next outer dimension must have
    if (r.rows > 1)
      for (int d = t.rank - 2; d >= 0; --d) {
        if (t.shape[d] == 1) continue;
        if (ld >= 0 && t.strides[d] != next)
          invalid(std::string(name) + ": expected leading dimensions that flatten into uniformly strided rows (stride " +
                  std::to_string(next) + " in dimension " + std::to_string(d) + "); given " + t.describe());
        if (ld < 0) ld = t.strides[d];
        next = t.strides[d] * t.shape[d];
      }
    if (ld < 0) ld = std::max<int64_t>(r.cols, 1);  // one row or none: any stride
    if (r.rows > 1 && ld < r.cols)
      invalid(std::string(name) + ": expected rows at least " + std::to_string(r.cols) + " elements apart (" + width +
              "); given " + t.describe());
    r.ld = ld;
    return r;
  }
};

void check_dtype(const TensorView& t, const char* name, DType want, const char* whose) {
  if (t.dtype != want)
    invalid(std::string(name) + ": expected dtype " + dname(want) + " (" + whose + "); given " + dname(t.dtype));
}

// grad_weight / grad_bias: the inputs' dtype, or fp32 for 16-bit inputs (master gradients).
void check_grad_dtype(const TensorView& t, const char* name, DType dtype) {
  if (t.dtype == dtype || (is_half(dtype) && t.dtype == DType::kF32)) return;
  invalid(std::string(name) + ": expected dtype " + dname(dtype) + (is_half(dtype) ? " or fp32" : "") +
          " (input's); given " + dname(t.dtype));
}

// x's leading dimensions with `last` as the last: the shape y, pre, grad_output must have.
void check_like(const TensorView& t, const char* name, const TensorView& x, const char* x_name, int64_t last,
                const char* last_name) {
  bool same = t.rank == x.rank && t.rank > 0 && t.shape[t.rank - 1] == last;
  for (int d = 0; same && d + 1 < x.rank; ++d) same = t.shape[d] == x.shape[d];
  if (!same) {
    std::string want = "(";
    for (int d = 0; d + 1 < x.rank; ++d) want += std::to_string(x.shape[d]) + ", ";
    invalid(std::string(name) + ": expected shape " + want + std::to_string(last) + ") (" + x_name +
            "'s leading dimensions, " + last_name + "); given " + (t.rank == 0 ? "absent" : shape_string(t)));
  }
}

// weight (N, K), row-major; returns N.
int64_t check_weight(Operands& ops, const TensorView& w, const char* name, int64_t k, DType dtype, bool output,
                     const std::string& x_name) {
  if (w.rank != 2)
    invalid(std::string(name) + ": expected rank 2 (out_features N, in_features K); given " +
            (w.rank == 0 ? std::string("rank 0 (absent)") : "rank " + std::to_string(w.rank) + " " + shape_string(w)));
  ops.add(w, name, output);
  if (output)
    check_grad_dtype(w, name, dtype);
  else
    check_dtype(w, name, dtype, (x_name + "'s").c_str());
  if (w.shape[1] != k)
    invalid(std::string(name) + ": expected shape (N, " + std::to_string(k) + ") (K = " + x_name + "'s last dimension); given " +
            shape_string(w));
  if (w.shape[0] < 1) invalid(std::string(name) + ": expected out_features N >= 1; given " + shape_string(w));
  if (w.shape[0] > 0 && k > 1 && w.strides[1] != 1)
    invalid(std::string(name) + ": expected a row-major view (unit stride along K, as torch.nn.Linear stores it); given " +
            w.describe());
  if (w.shape[0] > 1 && w.strides[0] < k)
    invalid(std::string(name) + ": expected rows at least " + std::to_string(k) + " elements apart (K); given " +
            w.describe());
  return w.shape[0];
}

// bias / grad_bias: a contiguous vector of n.
void check_vector(const TensorView& b, const char* name, int64_t n) {
  if (b.rank != 1 || b.shape[0] != n || (n > 1 && b.strides[0] != 1))
    invalid(std::string(name) + ": expected a contiguous vector of " + std::to_string(n) + " elements (N); given " +
            b.describe());
}

// A data operand shaped like x with `last` as its last dimension, x's dtype: its rows.
Rows rows_like(Operands& ops, const TensorView& t, const char* name, const TensorView& x, const char* x_name,
               int64_t last, const char* last_name, bool output) {
  check_like(t, name, x, x_name, last, last_name);
  const Rows r = ops.rows(t, name, last_name, output);
  check_dtype(t, name, x.dtype, (std::string(x_name) + "'s").c_str());
  return r;
}

// The bias (N), x's dtype, when present.
void check_bias(Operands& ops, const TensorView& bias, const TensorView& x, const char* x_name, int64_t n) {
  if (!present(bias)) return;
  ops.add(bias, "bias", false);
  check_dtype(bias, "bias", x.dtype, (std::string(x_name) + "'s").c_str());
  check_vector(bias, "bias", n);
}

void check_activation(Activation a) {
  if (static_cast<unsigned>(a) > static_cast<unsigned>(Activation::kSilu))
    invalid("activation: expected one of none, relu, gelu, gelu_tanh, silu; given value " +
            std::to_string(static_cast<unsigned>(a)));
}

// The variant a call runs: auto resolved on the CPU (cpu), kept on CUDA (the GEMM family's auto);
// its row (null for CUDA auto) and GEMM rung, checked against the dtype and the device.
struct Plan {
  LinearVariant variant = LinearVariant::kAuto;
  const LinearVariantInfo* row = nullptr;
  GemmVariant gemm = GemmVariant::kAuto;
};

Plan resolve(LinearVariant variant, DType dtype, const Device& device, const char* first) {
  if (variant != LinearVariant::kAuto && !find_variant(kLinearVariants, variant))
    invalid("variant: expected one of " + variant_choices(kLinearVariants) + "; given value " +
            std::to_string(static_cast<unsigned>(variant)));
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16 && dtype != DType::kF64)
    unsupported(std::string(first) + ": expected dtype fp32, fp16, bf16 or fp64 (the cpu variant); given " + dname(dtype));
  Plan plan;
  plan.variant = variant == LinearVariant::kAuto && !device.is_cuda() ? LinearVariant::kCpu : variant;
  if (plan.variant == LinearVariant::kAuto) {
    if (dtype == DType::kF64)
      unsupported(std::string(first) + ": expected dtype fp32, fp16 or bf16 on CUDA (fp64 runs on the cpu variant); given fp64");
  } else {
    plan.row = &linear_variant_info(plan.variant);
    if (std::string why = variant_rejects_dtype(kLinearVariants, *plan.row, dtype, "linear"); !why.empty())
      unsupported("variant: " + why);
    if (std::string why = variant_rejects_device(*plan.row, device); !why.empty()) invalid(why);
  }
  plan.gemm = linear_gemm_variant(plan.variant, dtype);
  return plan;
}

// Before any device work on CUDA: a usable device, the variant in this build, its compute capability.
void cuda_prelude([[maybe_unused]] const Plan& plan, [[maybe_unused]] const Device& device, const char* first) {
#if OPTIMIZED_WITH_CUDA
  static const std::string no_cuda = cuda_unavailable_reason();
  if (!no_cuda.empty()) unsupported(std::string(first) + ": CUDA tensors given but " + no_cuda);
  if (!plan.row) return;
  if (!plan.row->launch)
    unsupported("variant: " + std::string(plan.row->name) +
                " is not in this build (its GEMM rung's sm_90a sources were not compiled: configure with "
                "OPTIMIZED_SM90A=ON and an sm_90a-capable nvcc)");
  DeviceGuard guard(device.index);
  check_compute_capability(plan.row->min_compute_capability, plan.row->arch, plan.row->name, device.index);
#else
  unsupported(std::string(first) + ": CUDA tensors given but this build is CPU-only (built without CUDA)");
#endif
}

TensorView matrix_view(void* data, DType dtype, Device device, int64_t rows, int64_t cols, int64_t row_stride,
                       int64_t col_stride) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = 2;
  t.shape[0] = rows, t.shape[1] = cols;
  t.strides[0] = row_stride, t.strides[1] = col_stride;
  return t;
}
TensorView rows_view(const TensorView& t, const Rows& r) {
  return matrix_view(t.data, t.dtype, t.device, r.rows, r.cols, r.ld, 1);
}
// W (N, K) seen as W^T (K, N): the strides swapped (column-major B).
TensorView transposed(const TensorView& w) {
  return matrix_view(w.data, w.dtype, w.device, w.shape[1], w.shape[0], w.strides[1], w.strides[0]);
}

// One GEMM of the composition; its errors (what the GEMM rung refuses of checked operands, e.g.
// rows TMA cannot load on persistent) name the GEMM's operands, so `what` says which they are.
void gemm(const char* what, const TensorView& a, const TensorView& b, const TensorView& c, const GemmEpilogue& epilogue,
          float beta, GemmVariant variant, const ExecutionContext& ctx) {
  try {
    matmul(a, b, c, epilogue, 1.0f, beta, variant, ctx);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(what) + ": " + e.what());
  }
}

// ---- fp8 (linear_fp8.h) ----------------------------------------------------------------------------

// The scaled GEMM rung an fp8 call runs for the linear variant (CUDA auto: the scaled family's).
ScaledGemmVariant fp8_gemm_variant(LinearVariant v, DType dtype, const char* first) {
  if (dtype == DType::kF64)
    unsupported(std::string(first) + ": fp8 quantizes fp32, fp16 or bf16 inputs; given fp64");
  switch (v) {
    case LinearVariant::kAuto: return ScaledGemmVariant::kAuto;
    case LinearVariant::kCpu: return ScaledGemmVariant::kCpu;
    case LinearVariant::kNaive: return ScaledGemmVariant::kCudaNaive;
    case LinearVariant::kPersistent: return ScaledGemmVariant::kCudaWgmmaFp8;
    default:
      unsupported("variant: fp8 runs on auto, cpu, naive and persistent (fused has no fp8 GEMM); given " +
                  std::string(linear_variant_name(v)));
  }
}

int64_t round16(int64_t v) { return round_up(v, 16); }

// One fp32 scale (scaled_matmul's per-tensor layout) at `p`.
TensorView scale_view(float* p, Device device) {
  TensorView t;
  t.data = p;
  t.dtype = DType::kF32;
  t.device = device;
  t.rank = 1;
  t.shape[0] = 1;
  t.strides[0] = 1;
  return t;
}

// The scratch and the passes of one fp8 call: host memory and the CPU twins on the CPU, a
// CallWorkspace and the CUDA launchers on CUDA. carve() runs the call's carving code twice
// (counting, then on the memory); the scaled GEMMs get the caller's workspace past it.
class Fp8Call {
 public:
  Fp8Call(Device device, const ExecutionContext& ctx, std::string what)
      : device_(device), ctx_(ctx), what_(std::move(what)) {}

  template <typename Carve>
  void carve(Carve&& body) {
    WorkspaceArena counting;
    body(counting);
    mine_ = counting.peak();
    Workspace mem;
    if (!device_.is_cuda()) {
      host_.resize(mine_ / sizeof(std::max_align_t) + 1);
      mem = {host_.data(), mine_};
    }
#if OPTIMIZED_WITH_CUDA
    else {
      guard_.emplace(device_.index);
      ws_.emplace(ctx_, mine_, what_, device_.index, stream());
      mem = ws_->get();
    }
#endif
    WorkspaceArena arena(mem);
    body(arena);
    if (!arena.ok()) throw Error(Status::kInternal, what_ + ": the workspace carve overran its own size");
    gemm_ctx_ = ctx_;
    gemm_ctx_.workspace = {};
    if (device_.is_cuda() && ctx_.workspace.data && ctx_.workspace.bytes > mine_)
      gemm_ctx_.workspace = {static_cast<char*>(ctx_.workspace.data) + mine_, ctx_.workspace.bytes - mine_};
  }
  void finish() {
#if OPTIMIZED_WITH_CUDA
    if (ws_) ws_->release(what_);
#endif
  }

  Device device() const { return device_; }
  const std::string& what() const { return what_; }

  void zero(unsigned* bits, int count) const {
    if (!device_.is_cuda()) {
      std::memset(bits, 0, sizeof(unsigned) * static_cast<size_t>(count));
      return;
    }
#if OPTIMIZED_WITH_CUDA
    check_cuda(cudaMemsetAsync(bits, 0, sizeof(unsigned) * static_cast<size_t>(count), stream()), what_ + ": amax zeroed");
#endif
  }
  // The jobs with a source (the others are skipped).
  void amax(std::initializer_list<Fp8AmaxJob> jobs) const {
    std::vector<Fp8AmaxJob> run;
    for (const Fp8AmaxJob& j : jobs)
      if (j.src && j.rows > 0) run.push_back(j);
    if (run.empty()) return;
    if (!device_.is_cuda()) {
      for (const Fp8AmaxJob& j : run) cpu::linear_fp8_amax(j, ctx_.cpu_threads);
      return;
    }
#if OPTIMIZED_WITH_CUDA
    check_cuda(cuda::linear_fp8_amax(run.data(), static_cast<int>(run.size()), stream()), what_ + ": fp8 amax");
#endif
  }
  void cast(std::initializer_list<Fp8CastJob> jobs) const {
    std::vector<Fp8CastJob> run;
    for (const Fp8CastJob& j : jobs)
      if (j.src && j.rows > 0 && (j.out || j.out_t)) run.push_back(j);
    if (run.empty()) return;
    if (!device_.is_cuda()) {
      for (const Fp8CastJob& j : run) cpu::linear_fp8_cast(j, ctx_.cpu_threads);
      return;
    }
#if OPTIMIZED_WITH_CUDA
    check_cuda(cuda::linear_fp8_cast(run.data(), static_cast<int>(run.size()), stream()), what_ + ": fp8 cast");
#endif
  }
  // One scaled GEMM of the composition (errors say which, as gemm() does).
  void gemm(const char* what, const TensorView& a, const TensorView& b, const TensorView& c, float* scale_a,
            float* scale_b, const GemmEpilogue& e, float beta, ScaledGemmVariant variant) const {
    try {
      scaled_matmul(a, b, c, scale_view(scale_a, device_), ScaleLayout::kTensor, scale_view(scale_b, device_),
                    ScaleLayout::kTensor, e, beta, variant, gemm_ctx_);
    } catch (const Error& err) {
      throw Error(err.status(), std::string(what) + ": " + err.what());
    }
  }

 private:
#if OPTIMIZED_WITH_CUDA
  cudaStream_t stream() const { return static_cast<cudaStream_t>(ctx_.cuda_stream); }
  std::optional<DeviceGuard> guard_;
  std::optional<CallWorkspace> ws_;
#endif
  Device device_;
  ExecutionContext ctx_, gemm_ctx_;
  std::string what_;
  size_t mine_ = 0;
  std::vector<std::max_align_t> host_;
};

// The fp8 forward: out = act(x8 W8^T * sx * sw + b) (aux = pre), x (m, k) rows, W (n, k).
struct Fp8Forward {
  int64_t m, k, n, ldk;
  unsigned* amax = nullptr;   // x's, W's
  float* dequant = nullptr;   // x's, W's
  uint8_t* xq = nullptr;      // (m, k), rows ldk apart
  uint8_t* wq = nullptr;      // (n, k), rows ldk apart: W^T as a column-major B
  Fp8Forward(int64_t m_, int64_t k_, int64_t n_) : m(m_), k(k_), n(n_), ldk(round16(k_)) {}
  void carve(WorkspaceArena& arena) {
    amax = arena.take<unsigned>(2);
    dequant = arena.take<float>(2);
    xq = arena.take<uint8_t>(m * ldk);
    wq = arena.take<uint8_t>(n * ldk);
  }
  void run(const Fp8Call& call, const TensorView& x2d, const TensorView& w, const TensorView& out,
           const GemmEpilogue& e, ScaledGemmVariant variant) const {
    const DType dtype = x2d.dtype;
    call.zero(amax, 2);
    call.amax({{x2d.data, dtype, m, k, x2d.strides[0], amax},
               {w.data, dtype, n, k, w.shape[0] > 1 ? w.strides[0] : k, amax + 1}});
    Fp8CastJob jx, jw;
    jx.src = x2d.data, jx.dtype = dtype, jx.rows = m, jx.cols = k, jx.ld = x2d.strides[0];
    jx.format = DType::kF8E4M3, jx.amax_bits = amax, jx.out = xq, jx.ld_out = ldk, jx.dequant = dequant;
    jw.src = w.data, jw.dtype = dtype, jw.rows = n, jw.cols = k, jw.ld = w.shape[0] > 1 ? w.strides[0] : k;
    jw.format = DType::kF8E4M3, jw.amax_bits = amax + 1, jw.out = wq, jw.ld_out = ldk, jw.dequant = dequant + 1;
    call.cast({jx, jw});
    const Device d = call.device();
    call.gemm("linear_forward (fp8: scaled_matmul a = x8, b = weight8^T, c = y, aux = pre)",
              matrix_view(xq, DType::kF8E4M3, d, m, k, ldk, 1), matrix_view(wq, DType::kF8E4M3, d, k, n, 1, ldk), out,
              dequant, dequant + 1, e, 0.0f, variant);
  }
};

}  // namespace

// ---- forward -------------------------------------------------------------------------------------

void linear_forward(const TensorView& x, const TensorView& weight, const TensorView& bias, const TensorView& y,
                    const TensorView& pre, const LinearForwardOptions& options, LinearVariant variant,
                    const ExecutionContext& ctx) {
  Operands ops;
  const Rows X = ops.rows(x, "x", "in_features K", false);
  const DType dtype = x.dtype;
  if (X.cols < 1) invalid("x: expected in_features K (the last dimension) >= 1; given " + shape_string(x));
  const int64_t n = check_weight(ops, weight, "weight", X.cols, dtype, false, "x");
  check_bias(ops, bias, x, "x", n);
  const Rows Y = rows_like(ops, y, "y", x, "x", n, "out_features N", true);
  const Rows P = present(pre) ? rows_like(ops, pre, "pre", x, "x", n, "out_features N", true) : Rows{};
  const Activation activation = options.activation;
  check_activation(activation);
  ops.check_overlaps();
  const Device device = ops.device();
  const Plan plan = resolve(variant, dtype, device, "x");
  const ScaledGemmVariant fp8_variant = options.fp8 ? fp8_gemm_variant(plan.variant, dtype, "x") : ScaledGemmVariant::kAuto;
  if (device.is_cuda()) cuda_prelude(plan, device, "x");
  if (X.rows == 0) return;

  const TensorView y2d = rows_view(y, Y), pre2d = present(pre) ? rows_view(pre, P) : TensorView{};
  GemmEpilogue e;
  e.bias = present(bias) ? &bias : nullptr;
  e.activation = activation;
  e.aux = present(pre) ? &pre2d : nullptr;
  if (options.fp8) {
    Fp8Call call(device, ctx, "linear_forward (fp8)");
    Fp8Forward f(X.rows, X.cols, n);
    call.carve([&](WorkspaceArena& arena) { f.carve(arena); });
    f.run(call, rows_view(x, X), weight, y2d, e, fp8_variant);
    call.finish();
    return;
  }
  gemm("linear_forward (y = act(x W^T + b): matmul a = x, b = weight^T, c = y, aux = pre)", rows_view(x, X),
       transposed(weight), y2d, e, 0.0f, plan.gemm, ctx);
}

// ---- backward ------------------------------------------------------------------------------------

void linear_backward(const TensorView& grad_input, const TensorView& grad_weight, const TensorView& grad_bias,
                     const TensorView& grad_output, const TensorView& input, const TensorView& weight,
                     const TensorView& pre, const TensorView& bias, const LinearBackwardOptions& options,
                     LinearVariant variant, const ExecutionContext& ctx) {
  Operands ops;
  const Rows X = ops.rows(input, "input", "in_features K", false);
  const DType dtype = input.dtype;
  if (X.cols < 1) invalid("input: expected in_features K (the last dimension) >= 1; given " + shape_string(input));
  const int64_t n = check_weight(ops, weight, "weight", X.cols, dtype, false, "input");
  const Rows DY = rows_like(ops, grad_output, "grad_output", input, "input", n, "out_features N", false);
  const Rows P = present(pre) ? rows_like(ops, pre, "pre", input, "input", n, "out_features N", false) : Rows{};
  check_bias(ops, bias, input, "input", n);
  const Rows GI = present(grad_input)
                      ? rows_like(ops, grad_input, "grad_input", input, "input", X.cols, "in_features K", true)
                      : Rows{};
  if (present(grad_weight)) check_weight(ops, grad_weight, "grad_weight", X.cols, dtype, true, "input");
  if (present(grad_weight) && grad_weight.shape[0] != n)
    invalid("grad_weight: expected shape " + shape_string(weight) + " (weight's); given " + shape_string(grad_weight));
  if (present(grad_bias)) {
    ops.add(grad_bias, "grad_bias", true);
    check_grad_dtype(grad_bias, "grad_bias", dtype);
    check_vector(grad_bias, "grad_bias", n);
  }
  const Activation activation = options.activation;
  check_activation(activation);
  ops.check_overlaps();
  const Device device = ops.device();
  const Plan plan = resolve(variant, dtype, device, "input");
  const ScaledGemmVariant fp8_variant =
      options.fp8 ? fp8_gemm_variant(plan.variant, dtype, "input") : ScaledGemmVariant::kAuto;
  if (device.is_cuda()) cuda_prelude(plan, device, "input");

  const bool want_gi = present(grad_input), want_gw = present(grad_weight), want_gb = present(grad_bias);
  const bool act = activation != Activation::kNone;
  const int64_t m = X.rows, k = X.cols;
  if (!want_gi && !want_gw && !want_gb) return;

  // No rows: dX is empty, dW and db are sums of nothing (zeros, or unchanged with accumulate).
  if (m == 0) {
    if (options.accumulate) return;
    const size_t gw_elem = dtype_size(grad_weight.dtype), gb_elem = dtype_size(grad_bias.dtype);
    if (!device.is_cuda()) {
      if (want_gw)
        for (int64_t r = 0; r < n; ++r)
          std::memset(static_cast<char*>(grad_weight.data) + r * grad_weight.strides[0] * int64_t(gw_elem), 0,
                      static_cast<size_t>(k) * gw_elem);
      if (want_gb) std::memset(grad_bias.data, 0, static_cast<size_t>(n) * gb_elem);
      return;
    }
#if OPTIMIZED_WITH_CUDA
    DeviceGuard guard(device.index);
    const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
    if (want_gw) {
      const size_t pitch = static_cast<size_t>(n > 1 ? grad_weight.strides[0] : k) * gw_elem;
      check_cuda(cudaMemset2DAsync(grad_weight.data, pitch, 0, static_cast<size_t>(k) * gw_elem, static_cast<size_t>(n),
                                   stream),
                 "linear_backward (grad_weight zeroed, no rows)");
    }
    if (want_gb)
      check_cuda(cudaMemsetAsync(grad_bias.data, 0, static_cast<size_t>(n) * gb_elem, stream),
                 "linear_backward (grad_bias zeroed, no rows)");
#endif
    return;
  }

  // What the call needs: g materialized (an activation and a GEMM to feed), pre recomputed (an
  // activation and no pre given), the family's pass (g or db).
  const bool need_g = act && (want_gi || want_gw);
  const bool recompute = act && !present(pre);
  const bool pass = need_g || want_gb;
  const size_t elem = dtype_size(dtype);
  // Scratch rows padded to 16 bytes (TMA's row alignment on persistent; harmless elsewhere).
  const int64_t ld_scratch = round_up(n, static_cast<int64_t>(16 / std::min<size_t>(elem, 16)));

  LinearGradParams gp;
  gp.dtype = dtype;
  gp.act = static_cast<int>(activation);
  gp.m = m, gp.n = n;
  gp.dy = grad_output.data, gp.ld_dy = DY.ld;
  if (act && present(pre)) gp.pre = pre.data, gp.ld_pre = P.ld;
  gp.bias_grad = want_gb ? grad_bias.data : nullptr;
  gp.bias_grad_dtype = grad_bias.dtype;
  gp.accumulate = options.accumulate;

  const TensorView x2d = rows_view(input, X);
  if (options.fp8) {
    // g (act: written by the pass, with its amax; else dy, whose amax the pass takes) cast to e5m2
    // as g8 (dX's A) and g8^T (dW's A); W cast to e4m3 as W8^T (dX's B, K-major), x as x8^T (dW's B).
    const bool gemms = want_gi || want_gw;
    const int64_t ldn = round16(n), ldm = round16(m);
    Fp8Call call(device, ctx, "linear_backward (fp8)");
    Fp8Forward fwd(m, k, n);  // a recomputed pre, as the fp8 forward computed it
    unsigned* amax = nullptr;  // g's, x's, W's
    float* dequant = nullptr;
    uint8_t *gq = nullptr, *gq_t = nullptr, *wq_t = nullptr, *xq_t = nullptr;
    Workspace act_ws;
    call.carve([&](WorkspaceArena& arena) {
      amax = arena.take<unsigned>(3);
      dequant = arena.take<float>(3);
      const int64_t scratch = m * ld_scratch * static_cast<int64_t>(elem);
      if (recompute) gp.pre = arena.take<unsigned char>(scratch), gp.ld_pre = ld_scratch;
      if (need_g) gp.g = arena.take<unsigned char>(scratch), gp.ld_g = ld_scratch;
      if (want_gi) gq = arena.take<uint8_t>(m * ldn), wq_t = arena.take<uint8_t>(k * ldn);
      if (want_gw) gq_t = arena.take<uint8_t>(n * ldm), xq_t = arena.take<uint8_t>(k * ldm);
      gp.amax_bits = gemms ? amax : nullptr;
      size_t act_bytes = 0;
#if OPTIMIZED_WITH_CUDA
      if (device.is_cuda()) {
        const LinearVariantInfo& row = plan.row ? *plan.row : linear_variant_info(LinearVariant::kNaive);
        act_bytes = launcher_workspace_bytes(row, gp, call.what() + ": act_grad");
      }
#endif
      act_ws = {arena.take<unsigned char>(static_cast<int64_t>(act_bytes)), act_bytes};
      if (recompute) {
        ArenaScope scope(arena);  // the forward's scratch is free once pre is written
        fwd.carve(arena);
      }
    });
    if (recompute) {
      GemmEpilogue e;
      e.bias = present(bias) ? &bias : nullptr;
      fwd.run(call, x2d, weight, matrix_view(const_cast<void*>(gp.pre), dtype, device, m, n, ld_scratch, 1), e,
              fp8_variant);
    }
    call.zero(amax, 3);
    if (pass || gemms) {
      if (!device.is_cuda()) {
        linear_variant_info(LinearVariant::kCpu).cpu(gp, ctx.cpu_threads);
      }
#if OPTIMIZED_WITH_CUDA
      else {
        const LinearVariantInfo& row = plan.row ? *plan.row : linear_variant_info(LinearVariant::kNaive);
        check_cuda(row.launch(gp, act_ws, static_cast<cudaStream_t>(ctx.cuda_stream)), call.what() + ": act_grad");
      }
#endif
    }
    if (!gemms) {
      call.finish();
      return;
    }
    const void* g_src = need_g ? gp.g : grad_output.data;
    const int64_t ld_g = need_g ? gp.ld_g : DY.ld;
    const int64_t ld_w = n > 1 ? weight.strides[0] : k;
    call.amax({{want_gw ? x2d.data : nullptr, dtype, m, k, X.ld, amax + 1},
               {want_gi ? weight.data : nullptr, dtype, n, k, ld_w, amax + 2}});
    Fp8CastJob jg, jx, jw;
    jg.src = g_src, jg.dtype = dtype, jg.rows = m, jg.cols = n, jg.ld = ld_g, jg.format = DType::kF8E5M2;
    jg.amax_bits = amax, jg.dequant = dequant, jg.out = gq, jg.ld_out = ldn, jg.out_t = gq_t, jg.ld_out_t = ldm;
    jx.src = want_gw ? x2d.data : nullptr, jx.dtype = dtype, jx.rows = m, jx.cols = k, jx.ld = X.ld;
    jx.format = DType::kF8E4M3, jx.amax_bits = amax + 1, jx.dequant = dequant + 1, jx.out_t = xq_t, jx.ld_out_t = ldm;
    jw.src = want_gi ? weight.data : nullptr, jw.dtype = dtype, jw.rows = n, jw.cols = k, jw.ld = ld_w;
    jw.format = DType::kF8E4M3, jw.amax_bits = amax + 2, jw.dequant = dequant + 2, jw.out_t = wq_t, jw.ld_out_t = ldn;
    call.cast({jg, jx, jw});
    if (want_gi)
      call.gemm("linear_backward (fp8: grad_input = g8 W8: scaled_matmul a = g8, b = weight8, c = grad_input)",
                matrix_view(gq, DType::kF8E5M2, device, m, n, ldn, 1),
                matrix_view(wq_t, DType::kF8E4M3, device, n, k, 1, ldn), rows_view(grad_input, GI), dequant,
                dequant + 2, GemmEpilogue{}, 0.0f, fp8_variant);
    if (want_gw)
      call.gemm("linear_backward (fp8: grad_weight = g8^T x8: scaled_matmul a = g8^T, b = input8, c = grad_weight)",
                matrix_view(gq_t, DType::kF8E5M2, device, n, m, ldm, 1),
                matrix_view(xq_t, DType::kF8E4M3, device, m, k, 1, ldm), grad_weight, dequant, dequant + 1,
                GemmEpilogue{}, options.accumulate ? 1.0f : 0.0f, fp8_variant);
    call.finish();
    return;
  }
  // The GEMMs after the pass, on g (M, N) with rows ld_g apart.
  auto gemms = [&](void* g_data, int64_t ld_g, const ExecutionContext& gctx) {
    const TensorView g = matrix_view(g_data, dtype, device, m, n, ld_g, 1);
    if (want_gi)
      gemm("linear_backward (grad_input = g W: matmul a = g, b = weight, c = grad_input)", g, weight,
           rows_view(grad_input, GI), GemmEpilogue{}, 0.0f, plan.gemm, gctx);
    if (want_gw)
      gemm("linear_backward (grad_weight = g^T x: matmul a = g^T, b = input, c = grad_weight)",
           matrix_view(g_data, dtype, device, n, m, 1, ld_g), x2d, grad_weight, GemmEpilogue{},
           options.accumulate ? 1.0f : 0.0f, plan.gemm, gctx);
  };
  // pre = x W^T + b into `data` (m, n), rows ld_scratch apart.
  auto recompute_pre = [&](void* data, const ExecutionContext& gctx) {
    GemmEpilogue e;
    e.bias = present(bias) ? &bias : nullptr;
    gemm("linear_backward (pre recomputed = x W^T + b: matmul a = input, b = weight^T, c = pre)", x2d,
         transposed(weight), matrix_view(data, dtype, device, m, n, ld_scratch, 1), e, 0.0f, plan.gemm, gctx);
  };

  if (!device.is_cuda()) {
    const size_t scratch_bytes = static_cast<size_t>(m * ld_scratch) * elem;
    std::vector<double> pre_buf, g_buf;  // doubles: aligned for every dtype
    if (recompute) {
      pre_buf.resize(scratch_bytes / sizeof(double) + 1);
      recompute_pre(pre_buf.data(), ctx);
      gp.pre = pre_buf.data(), gp.ld_pre = ld_scratch;
    }
    if (need_g) {
      g_buf.resize(scratch_bytes / sizeof(double) + 1);
      gp.g = g_buf.data(), gp.ld_g = ld_scratch;
    }
    if (pass) plan.row->cpu(gp, ctx.cpu_threads);
    if (need_g)
      gemms(g_buf.data(), ld_scratch, ctx);
    else
      gemms(grad_output.data, DY.ld, ctx);
    return;
  }

#if OPTIMIZED_WITH_CUDA
  const LinearVariantInfo& row = plan.row ? *plan.row : linear_variant_info(LinearVariant::kNaive);
  const std::string what = "linear_backward (" + std::string(plan.row ? plan.row->name : "auto") + ")";
  DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
  // The call's scratch, carved twice by the same code: counting, then from the workspace.
  const auto carve = [&](WorkspaceArena& arena, LinearGradParams& q, Workspace* act_ws) {
    const int64_t scratch = m * ld_scratch * static_cast<int64_t>(elem);
    if (recompute) q.pre = arena.take<unsigned char>(scratch), q.ld_pre = ld_scratch;
    if (need_g) q.g = arena.take<unsigned char>(scratch), q.ld_g = ld_scratch;
    size_t act_bytes = 0;
    if (pass) act_bytes = launcher_workspace_bytes(row, q, what + ": act_grad");
    act_ws->data = arena.take<unsigned char>(static_cast<int64_t>(act_bytes));
    act_ws->bytes = act_bytes;
  };
  WorkspaceArena counting;
  {
    LinearGradParams q = gp;
    Workspace unused;
    carve(counting, q, &unused);
  }
  const size_t mine = counting.peak();
  CallWorkspace ws(ctx, mine, what, device.index, stream);
  WorkspaceArena arena(ws.get());
  Workspace act_ws;
  carve(arena, gp, &act_ws);
  if (!arena.ok()) throw Error(Status::kInternal, what + ": the workspace carve overran its own size");
  // The GEMMs get what the caller's workspace holds past this call's scratch (or allocate their own).
  ExecutionContext gctx = ctx;
  gctx.workspace = {};
  if (ctx.workspace.data && ctx.workspace.bytes > mine)
    gctx.workspace = {static_cast<char*>(ctx.workspace.data) + mine, ctx.workspace.bytes - mine};
  if (recompute) recompute_pre(const_cast<void*>(gp.pre), gctx);
  if (pass) check_cuda(row.launch(gp, act_ws, stream), what + ": act_grad");
  if (need_g)
    gemms(gp.g, gp.ld_g, gctx);
  else
    gemms(grad_output.data, DY.ld, gctx);
  ws.release(what);
#else
  (void)plan;
#endif
}

}  // namespace optimized
