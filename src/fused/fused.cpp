// Public entry of the fused memory-bound family: validates the operands of every op (messages name
// the argument, what was expected and what was given), fills FusedParams, resolves the variant and
// dispatches through the variant table (fused_variants.h) to the CPU backend or a CUDA launcher.
#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/arg_checks.h"
#include "core/dtypes_built.h"
#include "fused/fused_params.h"
#include "fused/fused_variants.h"
#include "optimized/fused.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#endif

namespace optimized {

namespace {

using arg::invalid;
using arg::number;
using arg::present;
using arg::shape_string;

// Byte range [first, last) a view touches (empty for a view with no element); checked (view_extent)
// when the operand was collected.
std::pair<uintptr_t, uintptr_t> byte_range(const TensorView& t, const char* name) {
  const ViewExtent e = view_extent(t, name);
  return {e.begin, e.end};
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.dtype != b.dtype || a.rank != b.rank) return false;
  for (int i = 0; i < a.rank; ++i)
    if (a.shape[i] != b.shape[i] || (a.shape[i] > 1 && a.strides[i] != b.strides[i])) return false;
  return true;
}

// Collects and checks the operands of one call against the first ("anchor") operand: its dtype,
// device and (rows, width) are what the others must match.
class Operands {
 public:
  // A required (rows, width) operand; the first one fixes rows and dtype/device.
  // `width_factor`: 2 for silu_and_mul's x and dx, whose rows hold both halves.
  const void* rows_in(const TensorView& t, const char* name, int64_t* ld, int64_t width_factor = 1) {
    check_rows(t, name, ld, width_factor);
    inputs_.push_back({&t, name});
    return t.data;
  }
  void* rows_out(const TensorView& t, const char* name, int64_t* ld, int64_t width_factor = 1) {
    check_rows(t, name, ld, width_factor);
    outputs_.push_back({&t, name});
    return t.data;
  }
  // Optional (width) vectors of the data dtype: weight, bias, dweight, dbias.
  const void* vector_in(const TensorView& t, const char* name) {
    if (!present(t)) return nullptr;
    check_vector(t, name);
    inputs_.push_back({&t, name});
    return t.data;
  }
  void* vector_out(const TensorView& t, const char* name) {
    if (!present(t)) return nullptr;
    check_vector(t, name);
    outputs_.push_back({&t, name});
    return t.data;
  }
  // (rows) statistics, contiguous: fp32, or fp64 for fp64 data (the dtype of the first operand).
  void* stats(const TensorView& t, const char* name, bool output, bool required) {
    const DType want = dtype_ == DType::kF64 ? DType::kF64 : DType::kF32;
    if (!present(t)) {
      if (required)
        invalid(std::string(name) + ": required (" + std::string(dtype_name(want)) +
                " (rows) as saved by the forward); given absent");
      return nullptr;
    }
    check_common(t, name, want);
    const bool one_d = t.rank == 1 && t.shape[0] == rows_;
    const bool col = t.rank == 2 && t.shape[0] == rows_ && t.shape[1] == 1;
    if (!one_d && !col)
      invalid(std::string(name) + ": expected shape (" + std::to_string(rows_) + ") (one per row); given " +
              shape_string(t));
    if (rows_ > 1 && t.strides[0] != 1)
      invalid(std::string(name) + ": expected a contiguous vector; given " + t.describe());
    (output ? outputs_ : inputs_).push_back({&t, name});
    return t.data;
  }

  int64_t rows() const { return rows_; }
  int64_t width() const { return width_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  // Outputs may not overlap any other operand, except an input of the very same view where the op
  // computes in place (`in_place_ok`).
  void check_overlaps(bool in_place_ok) const {
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const auto& [out, out_name] = outputs_[i];
      auto [o0, o1] = byte_range(*out, out_name);
      auto clash = [&](const TensorView& other, const char* other_name, bool allow_same) {
        auto [b0, b1] = byte_range(other, other_name);
        if (!(o0 < b1 && b0 < o1)) return;
        if (allow_same && same_view(*out, other)) return;
        invalid(std::string(out_name) + ": expected an output that does not overlap " + other_name +
                (allow_same ? " (in place is allowed only as the very same view)" : "") +
                "; given overlapping memory");
      };
      for (const auto& [in, in_name] : inputs_) clash(*in, in_name, in_place_ok);
      for (size_t j = 0; j < outputs_.size(); ++j)
        if (j != i) clash(*outputs_[j].first, outputs_[j].second, false);
    }
  }

  // A caller's workspace is scratch the kernels write: it may not overlap any operand.
  void check_workspace(const Workspace& ws) const {
    if (!ws.data || ws.bytes == 0) return;
    const auto w0 = reinterpret_cast<uintptr_t>(ws.data), w1 = w0 + ws.bytes;
    for (const auto* list : {&inputs_, &outputs_})
      for (const auto& [t, name] : *list) {
        auto [b0, b1] = byte_range(*t, name);
        if (w0 < b1 && b0 < w1)
          invalid(std::string("workspace: expected memory that does not overlap ") + name + "; given overlapping memory");
      }
  }

 private:
  void check_common(const TensorView& t, const char* name, DType want) {
    // Sizes, strides and the byte span fit int64 (and the address space): the extents below are exact.
    const ViewExtent extent = view_extent(t, name);
    if (!t.data && extent.numel > 0) invalid(std::string(name) + ": expected a non-null data pointer; given null");
    if (t.dtype != want)
      invalid(std::string(name) + ": expected dtype " + std::string(dtype_name(want)) + "; given " +
              std::string(dtype_name(t.dtype)));
    if (!(t.device == device_))
      invalid(std::string(name) + ": expected device " + device_name(device_) +
              " (same as the first operand); given " + device_name(t.device));
    arg::check_element_aligned(t, name);
  }

  void check_rows(const TensorView& t, const char* name, int64_t* ld, int64_t width_factor) {
    if (t.rank != 1 && t.rank != 2)
      invalid(std::string(name) + ": expected rank 1 (width) or 2 (rows, width); given rank " +
              std::to_string(t.rank) + (t.rank == 0 ? " (absent)" : " " + shape_string(t)));
    const int64_t rows = t.rank == 2 ? t.shape[0] : 1;
    const int64_t cols = t.shape[t.rank - 1];
    if (rows < 0 || cols < 1)
      invalid(std::string(name) + ": expected a width >= 1 and rows >= 0; given shape " + shape_string(t));
    if (first_) {
      first_ = false;
      dtype_ = t.dtype;
      device_ = t.device;
      rows_ = rows;
      if (cols % width_factor != 0)
        invalid(std::string(name) + ": expected an even last dimension (two halves [a | b]); given " +
                std::to_string(cols));
      width_ = cols / width_factor;
      const bool fp64_cpu = t.dtype == DType::kF64;
      if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16 && !fp64_cpu)
        throw Error(Status::kUnsupported, std::string(name) + ": expected dtype fp32, fp16, bf16 (or fp64 on the "
                                          "cpu variant); given " + std::string(dtype_name(t.dtype)));
    } else if (rows != rows_ || cols != width_ * width_factor) {
      invalid(std::string(name) + ": expected shape (" + std::to_string(rows_) + ", " +
              std::to_string(width_ * width_factor) + ") to match the first operand; given " + shape_string(t));
    }
    check_common(t, name, dtype_);
    if (t.strides[t.rank - 1] != 1 && cols > 1)
      invalid(std::string(name) + ": expected unit stride in the last dimension; given " + t.describe());
    *ld = cols;
    if (t.rank == 2 && rows > 1) {
      if (t.strides[0] < cols)
        invalid(std::string(name) + ": expected a row stride >= the row length " + std::to_string(cols) +
                "; given " + std::to_string(t.strides[0]));
      *ld = t.strides[0];
    }
  }

  void check_vector(const TensorView& t, const char* name) {
    check_common(t, name, dtype_);
    if (t.rank != 1 || t.shape[0] != width_)
      invalid(std::string(name) + ": expected shape (" + std::to_string(width_) + ") (one per column); given " +
              shape_string(t));
    if (width_ > 1 && t.strides[0] != 1)
      invalid(std::string(name) + ": expected a contiguous vector; given " + t.describe());
  }

  bool first_ = true;
  DType dtype_ = DType::kF32;
  Device device_ = Device::cpu();
  int64_t rows_ = 0, width_ = 0;
  std::vector<std::pair<const TensorView*, const char*>> inputs_, outputs_;
};

// dweight / dbias of a backward over zero rows: zeros.
void zero_parameter_gradients(const FusedParams& p, Device device, const ExecutionContext& ctx) {
  const size_t bytes = static_cast<size_t>(p.width) * dtype_size(p.dtype);
  for (void* grad : {p.dweight, p.dbias}) {
    if (!grad) continue;
    if (!device.is_cuda()) {
      std::memset(grad, 0, bytes);
      continue;
    }
#if OPTIMIZED_WITH_CUDA
    DeviceGuard guard(device.index);
    check_cuda(cudaMemsetAsync(grad, 0, bytes, static_cast<cudaStream_t>(ctx.cuda_stream)),
               "cudaMemsetAsync (zero-row parameter gradient)");
#else
    (void)ctx;
#endif
  }
}

// Resolves the variant, checks it can run the call, and runs it.
void run(FusedParams& p, const Operands& ops, FusedVariant variant, const ExecutionContext& ctx) {
  p.dtype = ops.dtype();
  p.rows = ops.rows();
  p.width = ops.width();
  const Device device = ops.device();
  const bool aligned = fused_rows_aligned(p);
  const std::string what = std::string(fused_op_name(p.op)) + (p.backward ? " backward" : " forward");
  if (device.is_cuda() && !fused_variant_supports_dtype(FusedVariant::kCudaFusedStreaming, p.dtype))
    throw Error(Status::kUnsupported, what + ": x: " + std::string(dtype_name(p.dtype)) + " runs on the " +
                                          variants_running(kFusedVariants, p.dtype) + " variant only; given " +
                                          std::string(dtype_name(p.dtype)) + " on " + device_name(device));
  if (variant == FusedVariant::kAuto)
    variant = resolve_fused_variant(p.op, p.dtype, device, p.width, p.backward, aligned);
  if (fused_variant_is_cuda(variant) != device.is_cuda())
    invalid("variant " + std::string(fused_variant_name(variant)) + " runs on " +
            (device.is_cuda() ? "the CPU" : "CUDA devices") + "; given operands on " + device_name(device));
  if (variant == FusedVariant::kCudaFusedRegisters) {
    const int64_t max_width = fused_registers_max_width(p.op, p.dtype, p.backward, aligned);
    if (max_width > 0 && p.width > max_width)
      throw Error(Status::kUnsupported, what + ": fused_registers holds rows up to " + std::to_string(max_width) +
                                            " " + std::string(dtype_name(p.dtype)) + " elements" +
                                            (aligned ? "" : " when rows are not 16-byte aligned") +
                                            "; given width " + std::to_string(p.width) +
                                            " (use fused_streaming or auto)");
  }
  if (device.is_cuda()) {
    if (std::string why = cuda_dtype_not_built("fused", p.dtype); !why.empty())
      throw Error(Status::kUnsupported, what + ": " + why);
    ops.check_workspace(ctx.workspace);
  }
  // After the argument checks, so that a bad argument is named on machines without a GPU too.
  if (device.is_cuda() && cuda_device_count() == 0)
    throw Error(Status::kUnsupported, what + ": operands on " + device_name(device) +
                                          " but no CUDA device can be used: " + cuda_unavailable_reason());
  if (p.rows == 0) {
    zero_parameter_gradients(p, device, ctx);  // a sum over no rows is 0, as torch gives
    return;
  }
  const FusedVariantInfo& row = fused_variant_info(variant);
  if (row.backend == Backend::kCpu) {
    row.cpu(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  launch_on_cuda(row, p, device.index, ctx, what + " (" + std::string(row.name) + ")");
#else
  throw Error(Status::kUnsupported, what + ": this build has no CUDA backend (built without CUDA)");
#endif
}

}  // namespace

// ---- softmax -------------------------------------------------------------------------------

void softmax_forward(const TensorView& x, const TensorView& y, double scale, bool log, FusedVariant variant,
                     const ExecutionContext& ctx) {
  FusedParams p;
  p.op = log ? FusedOp::kLogSoftmax : FusedOp::kSoftmax;
  Operands ops;
  p.x = ops.rows_in(x, "x", &p.ld_x);
  p.y = ops.rows_out(y, "y", &p.ld_y);
  ops.check_overlaps(true);
  p.scale = scale;
  run(p, ops, variant, ctx);
}

void softmax_backward(const TensorView& y, const TensorView& dy, const TensorView& dx, double scale, bool log,
                      FusedVariant variant, const ExecutionContext& ctx) {
  FusedParams p;
  p.op = log ? FusedOp::kLogSoftmax : FusedOp::kSoftmax;
  p.backward = true;
  Operands ops;
  p.x = ops.rows_in(y, "y", &p.ld_x);
  p.dy = ops.rows_in(dy, "dy", &p.ld_dy);
  p.dx = ops.rows_out(dx, "dx", &p.ld_dx);
  ops.check_overlaps(true);
  p.scale = scale;
  run(p, ops, variant, ctx);
}

// ---- norms ---------------------------------------------------------------------------------

namespace {

// The statistics Operands::stats checked: fp64 ones for fp64 data, fp32 ones otherwise.
void set_stats(FusedParams& p, const Operands& ops, void* mean, void* rstd) {
  if (ops.dtype() == DType::kF64) {
    p.mean64 = static_cast<double*>(mean);
    p.rstd64 = static_cast<double*>(rstd);
  } else {
    p.mean = static_cast<float*>(mean);
    p.rstd = static_cast<float*>(rstd);
  }
}

void layer_or_rms_norm_forward(bool layer, const TensorView& x, const TensorView& residual, const TensorView& weight,
                  const TensorView& bias, double eps, const TensorView& y, const TensorView& residual_out,
                  const TensorView& mean, const TensorView& rstd, FusedVariant variant,
                  const ExecutionContext& ctx) {
  FusedParams p;
  const bool add = present(residual);
  p.op = layer ? (add ? FusedOp::kAddLayerNorm : FusedOp::kLayerNorm)
               : (add ? FusedOp::kAddRmsNorm : FusedOp::kRmsNorm);
  Operands ops;
  p.x = ops.rows_in(x, "x", &p.ld_x);
  if (add) {
    p.residual = ops.rows_in(residual, "residual", &p.ld_residual);
    if (!present(residual_out))
      invalid("residual_out: required with residual (it receives x + residual); given absent");
    p.residual_out = ops.rows_out(residual_out, "residual_out", &p.ld_residual_out);
  } else if (present(residual_out)) {
    invalid("residual_out: given without residual (only the add form writes it)");
  }
  p.weight = ops.vector_in(weight, "weight");
  if (layer) p.bias = ops.vector_in(bias, "bias");
  p.y = ops.rows_out(y, "y", &p.ld_y);
  void* const mean_data = layer ? ops.stats(mean, "mean", true, false) : nullptr;  // mean checked first
  set_stats(p, ops, mean_data, ops.stats(rstd, "rstd", true, false));
  ops.check_overlaps(true);
  if (!(eps >= 0.0)) invalid("eps: expected >= 0; given " + number(eps));
  p.eps = eps;
  run(p, ops, variant, ctx);
}

void layer_or_rms_norm_backward(bool layer, const TensorView& dy, const TensorView& h, const TensorView& weight,
                   const TensorView& mean, const TensorView& rstd, const TensorView& dresidual_out,
                   const TensorView& dx, const TensorView& dweight, const TensorView& dbias, FusedVariant variant,
                   const ExecutionContext& ctx) {
  FusedParams p;
  const bool add = present(dresidual_out);
  p.op = layer ? (add ? FusedOp::kAddLayerNorm : FusedOp::kLayerNorm)
               : (add ? FusedOp::kAddRmsNorm : FusedOp::kRmsNorm);
  p.backward = true;
  Operands ops;
  p.dy = ops.rows_in(dy, "dy", &p.ld_dy);
  p.x = ops.rows_in(h, "h", &p.ld_x);
  if (add) p.dresidual_out = ops.rows_in(dresidual_out, "dresidual_out", &p.ld_dresidual_out);
  p.weight = ops.vector_in(weight, "weight");
  void* const mean_data = layer ? ops.stats(mean, "mean", false, true) : nullptr;  // mean checked first
  set_stats(p, ops, mean_data, ops.stats(rstd, "rstd", false, true));
  p.dx = ops.rows_out(dx, "dx", &p.ld_dx);
  p.dweight = ops.vector_out(dweight, "dweight");
  if (p.dweight && !p.weight) invalid("dweight: asked for without weight (the forward had no weight)");
  if (layer) p.dbias = ops.vector_out(dbias, "dbias");
  ops.check_overlaps(true);
  run(p, ops, variant, ctx);
}

}  // namespace

void layer_norm_forward(const TensorView& x, const TensorView& residual, const TensorView& weight,
                        const TensorView& bias, double eps, const TensorView& y, const TensorView& residual_out,
                        const TensorView& mean, const TensorView& rstd, FusedVariant variant,
                        const ExecutionContext& ctx) {
  layer_or_rms_norm_forward(true, x, residual, weight, bias, eps, y, residual_out, mean, rstd, variant, ctx);
}

void layer_norm_backward(const TensorView& dy, const TensorView& h, const TensorView& weight,
                         const TensorView& mean, const TensorView& rstd, const TensorView& dresidual_out,
                         const TensorView& dx, const TensorView& dweight, const TensorView& dbias,
                         FusedVariant variant, const ExecutionContext& ctx) {
  layer_or_rms_norm_backward(true, dy, h, weight, mean, rstd, dresidual_out, dx, dweight, dbias, variant, ctx);
}

void rms_norm_forward(const TensorView& x, const TensorView& residual, const TensorView& weight, double eps,
                      const TensorView& y, const TensorView& residual_out, const TensorView& rstd,
                      FusedVariant variant, const ExecutionContext& ctx) {
  layer_or_rms_norm_forward(false, x, residual, weight, TensorView{}, eps, y, residual_out, TensorView{}, rstd, variant, ctx);
}

void rms_norm_backward(const TensorView& dy, const TensorView& h, const TensorView& weight, const TensorView& rstd,
                       const TensorView& dresidual_out, const TensorView& dx, const TensorView& dweight,
                       FusedVariant variant, const ExecutionContext& ctx) {
  layer_or_rms_norm_backward(false, dy, h, weight, TensorView{}, rstd, dresidual_out, dx, dweight, TensorView{}, variant, ctx);
}

// ---- bias + GELU, SiLU-and-mul -------------------------------------------------------------

void bias_gelu_forward(const TensorView& x, const TensorView& bias, GeluApproximation approximate,
                       const TensorView& y, FusedVariant variant, const ExecutionContext& ctx) {
  FusedParams p;
  p.op = FusedOp::kBiasGelu;
  Operands ops;
  p.x = ops.rows_in(x, "x", &p.ld_x);
  p.bias = ops.vector_in(bias, "bias");
  p.y = ops.rows_out(y, "y", &p.ld_y);
  ops.check_overlaps(true);
  p.gelu = approximate;
  run(p, ops, variant, ctx);
}

void bias_gelu_backward(const TensorView& dy, const TensorView& x, const TensorView& bias,
                        GeluApproximation approximate, const TensorView& dx, const TensorView& dbias,
                        FusedVariant variant, const ExecutionContext& ctx) {
  FusedParams p;
  p.op = FusedOp::kBiasGelu;
  p.backward = true;
  Operands ops;
  p.dy = ops.rows_in(dy, "dy", &p.ld_dy);
  p.x = ops.rows_in(x, "x", &p.ld_x);
  p.bias = ops.vector_in(bias, "bias");
  p.dx = ops.rows_out(dx, "dx", &p.ld_dx);
  p.dbias = ops.vector_out(dbias, "dbias");
  ops.check_overlaps(true);
  p.gelu = approximate;
  run(p, ops, variant, ctx);
}

void silu_and_mul_forward(const TensorView& x, const TensorView& y, FusedVariant variant,
                          const ExecutionContext& ctx) {
  FusedParams p;
  p.op = FusedOp::kSiluAndMul;
  Operands ops;
  p.x = ops.rows_in(x, "x", &p.ld_x, 2);
  p.y = ops.rows_out(y, "y", &p.ld_y);
  ops.check_overlaps(true);
  run(p, ops, variant, ctx);
}

void silu_and_mul_backward(const TensorView& dy, const TensorView& x, const TensorView& dx, FusedVariant variant,
                           const ExecutionContext& ctx) {
  FusedParams p;
  p.op = FusedOp::kSiluAndMul;
  p.backward = true;
  Operands ops;
  p.x = ops.rows_in(x, "x", &p.ld_x, 2);
  p.dy = ops.rows_in(dy, "dy", &p.ld_dy);
  p.dx = ops.rows_out(dx, "dx", &p.ld_dx, 2);
  ops.check_overlaps(true);
  run(p, ops, variant, ctx);
}

// ---- workspace -----------------------------------------------------------------------------

namespace {

// The params of a call with every optional operand that can grow a launcher's workspace: weight,
// bias, dweight, dbias, dresidual_out present, forward statistics absent (the unfused rung then
// keeps them in temporaries). Pointers are placeholders (launchers measure without reading them):
// 16-byte aligned or, for `aligned` false, one element off.
FusedParams worst_case_params(FusedOp op, bool backward, DType dtype, int64_t rows, int64_t width, bool aligned) {
  FusedParams p;
  p.op = op;
  p.backward = backward;
  p.dtype = dtype;
  p.rows = rows;
  p.width = width;
  const int64_t ld = op == FusedOp::kSiluAndMul ? 2 * width : width;
  void* at = reinterpret_cast<void*>(uintptr_t{4096} + (aligned ? 0 : dtype_size(dtype)));
  p.x = at;
  p.ld_x = ld;
  p.weight = p.bias = at;
  if (backward) {
    p.dy = at;
    p.ld_dy = width;
    p.dx = at;
    p.ld_dx = ld;
    p.dweight = p.dbias = at;
    p.dresidual_out = at;
    p.ld_dresidual_out = width;
    p.mean = p.rstd = static_cast<float*>(at);
  } else {
    p.y = at;
    p.ld_y = width;
    if (p.is_add_form()) {
      p.residual = p.residual_out = at;
      p.ld_residual = p.ld_residual_out = width;
    }
  }
  return p;
}

}  // namespace

size_t fused_workspace_bytes(FusedOp op, bool backward, DType dtype, Device device, int64_t rows, int64_t width,
                             FusedVariant variant, bool aligned_rows) {
  if (rows < 0) invalid("rows: expected >= 0; given " + std::to_string(rows));
  if (width < 1) invalid("width: expected >= 1; given " + std::to_string(width));
  resolve_fused_variant(op, dtype, device, width, backward, aligned_rows);  // checks the device and the dtype
  if (variant != FusedVariant::kAuto && fused_variant_is_cuda(variant) != device.is_cuda())
    invalid("variant " + std::string(fused_variant_name(variant)) + " runs on " +
            (device.is_cuda() ? "the CPU" : "CUDA devices") + "; given " + device_name(device));
  if (!device.is_cuda() || rows == 0) return 0;
#if OPTIMIZED_WITH_CUDA
  if (std::string why = cuda_dtype_not_built("fused", dtype); !why.empty())
    throw Error(Status::kUnsupported, "fused_workspace_bytes: " + why);
  DeviceGuard guard(device.index);
  size_t need = 0;
  // Rows that may not be aligned: the larger of both layouts (kAuto may pick another design too).
  for (bool aligned : {true, false}) {
    if (!aligned && aligned_rows) break;
    const FusedVariant v =
        variant == FusedVariant::kAuto ? resolve_fused_variant(op, dtype, device, width, backward, aligned) : variant;
    const int64_t max_width = fused_registers_max_width(op, dtype, backward, aligned);
    if (v == FusedVariant::kCudaFusedRegisters && max_width > 0 && width > max_width) continue;  // refused anyway
    const FusedVariantInfo& row = fused_variant_info(v);
    const FusedParams p = worst_case_params(op, backward, dtype, rows, width, aligned);
    need = std::max(need, launcher_workspace_bytes(row, p, "fused_workspace_bytes (" + std::string(row.name) + ")"));
  }
  return need;
#else
  throw Error(Status::kUnsupported, "fused_workspace_bytes: " + device_name(device) +
                                        " given but this build has no CUDA backend (built without CUDA)");
#endif
}

}  // namespace optimized
