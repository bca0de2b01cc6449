// Public entry of cross-entropy (include/optimized/fused.h, "cross-entropy"): validates the operands
// (messages name the argument, what was expected and what was given), checks the targets on the
// CPU, fills CrossEntropyParams, resolves the variant and dispatches through cross-entropy's rows of
// the fused ladder (kCrossEntropyVariants, cross_entropy_params.h) to the CPU backend or the CUDA
// launcher.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "core/arg_checks.h"
#include "core/dtypes_built.h"
#include "fused/cross_entropy_params.h"
#include "optimized/fused.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#endif

namespace optimized {

namespace {

using arg::dname;
using arg::invalid;
using arg::number;
using arg::present;
using arg::shape_string;

const char* const kWhat = "cross_entropy forward";

// The variant that runs on `device`: kAuto resolved; a rung without cross-entropy or of the other
// device refused by name.
FusedVariant resolve_variant(FusedVariant variant, Device device) {
  if (variant == FusedVariant::kAuto) return device.is_cuda() ? FusedVariant::kCudaFusedStreaming : FusedVariant::kCpu;
  const CrossEntropyVariantInfo* row = find_variant(kCrossEntropyVariants, variant);
  if (!row)
    throw Error(Status::kUnsupported, "variant: cross_entropy runs on " + variant_choices(kCrossEntropyVariants) +
                                          "; given " + std::string(fused_variant_name(variant)));
  if ((row->backend == Backend::kCuda) != device.is_cuda())
    invalid("variant " + std::string(row->name) + " runs on " + (device.is_cuda() ? "the CPU" : "CUDA devices") +
            "; given operands on " + device_name(device));
  return variant;
}

// The dtype checks of the logits on `device` (the one owner of them, for the op and the workspace query).
void check_logits_dtype(DType dtype, Device device, const char* name) {
  const bool fp = dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
  if (!fp && dtype != DType::kF64)
    throw Error(Status::kUnsupported, std::string(name) + ": expected dtype fp32, fp16, bf16 (or fp64 on the cpu "
                                      "variant); given " + dname(dtype));
  if (device.is_cuda() && !fp)
    throw Error(Status::kUnsupported, std::string(name) + ": " + dname(dtype) + " runs on the " +
                                          variants_running(kCrossEntropyVariants, dtype) + " variant only; given " +
                                          dname(dtype) + " on " + device_name(device));
}

// A (rows) vector of `dtype`, contiguous unless `any_stride`.
void check_vector(const TensorView& t, const char* name, int64_t rows, DType dtype, bool any_stride) {
  if (t.dtype != dtype) invalid(std::string(name) + ": expected dtype " + dname(dtype) + "; given " + dname(t.dtype));
  if (t.rank != 1 || t.shape[0] != rows)
    invalid(std::string(name) + ": expected shape (" + std::to_string(rows) + ") (one per row of logits); given " +
            shape_string(t));
  if (!any_stride && rows > 1 && t.strides[0] != 1)
    invalid(std::string(name) + ": expected a contiguous vector; given " + t.describe());
}

// The first target outside [0, vocab) other than ignore_index, on the host: a clear error.
template <typename I>
void check_targets_on_host(const CrossEntropyParams& p) {
  const I* t = static_cast<const I*>(p.target);
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t v = static_cast<int64_t>(t[r * p.target_stride]);
    if (v != p.ignore_index && (v < 0 || v >= p.vocab))
      invalid("target: expected values in [0, " + std::to_string(p.vocab) + ") or ignore_index " +
              std::to_string(p.ignore_index) + "; given " + std::to_string(v) + " at row " + std::to_string(r));
  }
}

// The distance between rows of a (rows, vocab) or (vocab) view with unit stride along the vocabulary.
int64_t row_stride(const TensorView& t, const char* name, int64_t rows, int64_t vocab) {
  if (t.strides[t.rank - 1] != 1 && vocab > 1)
    invalid(std::string(name) + ": expected unit stride along the vocabulary (last dimension); given " + t.describe());
  if (t.rank != 2 || rows <= 1) return vocab;
  if (t.strides[0] < vocab)
    invalid(std::string(name) + ": expected a row stride >= the vocabulary " + std::to_string(vocab) + "; given " +
            std::to_string(t.strides[0]));
  return t.strides[0];
}

// grad_scale / grad_loss: one element (stride 0 for the kernels) or (rows), of the stat dtype, any stride.
void set_scale(const TensorView& s, const char* name, int64_t rows, DType stat, arg::OperandSet& ops,
               CrossEntropyParams& p) {
  if (s.dtype != stat) invalid(std::string(name) + ": expected dtype " + dname(stat) + "; given " + dname(s.dtype));
  if (s.rank != 1 || (s.shape[0] != 1 && s.shape[0] != rows))
    invalid(std::string(name) + ": expected shape (1) (one factor for every row) or (" + std::to_string(rows) +
            ") (one per row); given " + (s.rank == 0 ? std::string("a 0-D view") : shape_string(s)));
  ops.add(s, name, false);
  p.grad_scale = s.data;
  p.grad_scale_stride = s.shape[0] == 1 ? 0 : s.strides[0];
}

// The CUDA checks every entry makes once its operands are valid: the dtype built, no workspace over
// an operand, a usable device.
void check_cuda_call(const arg::OperandSet& ops, DType dtype, const ExecutionContext& ctx, const char* what) {
  if (std::string why = cuda_dtype_not_built("fused", dtype); !why.empty())
    throw Error(Status::kUnsupported, std::string(what) + ": " + why);
  ops.check_workspace(ctx.workspace);
  // After the argument checks, so that a bad argument is named on machines without a GPU too.
  if (cuda_device_count() == 0)
    throw Error(Status::kUnsupported, std::string(what) + ": operands on " + device_name(ops.device()) +
                                          " but no CUDA device can be used: " + cuda_unavailable_reason());
}

}  // namespace

void cross_entropy_forward(const TensorView& logits, const TensorView& target, const CrossEntropyOptions& options,
                           const TensorView& loss, const TensorView& lse, const TensorView& grad_logits,
                           FusedVariant variant, const ExecutionContext& ctx) {
  CrossEntropyParams p;
  arg::OperandSet ops;
  // logits: (rows, vocab) or (vocab), unit stride along the vocabulary.
  if (logits.rank != 1 && logits.rank != 2)
    invalid("logits: expected rank 1 (vocab) or 2 (rows, vocab); given rank " + std::to_string(logits.rank) +
            (logits.rank == 0 ? " (absent)" : " " + shape_string(logits)));
  const int64_t rows = logits.rank == 2 ? logits.shape[0] : 1;
  const int64_t vocab = logits.shape[logits.rank - 1];
  if (rows < 0 || vocab < 1)
    invalid("logits: expected a vocabulary >= 1 and rows >= 0; given shape " + shape_string(logits));
  ops.add(logits, "logits", false);
  check_logits_dtype(logits.dtype, logits.device, "logits");
  p.ld_logits = row_stride(logits, "logits", rows, vocab);
  p.dtype = logits.dtype;
  p.rows = rows;
  p.vocab = vocab;
  p.logits = logits.data;

  // target: (rows) int64 / int32, any stride.
  if (!present(target)) invalid("target: required ((rows) int64 or int32 class indices); given absent");
  if (target.dtype != DType::kI64 && target.dtype != DType::kI32)
    invalid("target: expected dtype int64 or int32; given " + dname(target.dtype));
  check_vector(target, "target", rows, target.dtype, true);
  ops.add(target, "target", false);
  p.target = target.data;
  p.target_dtype = target.dtype;
  p.target_stride = rows > 1 ? target.strides[0] : 1;

  // loss, lse: fp32 (fp64 for fp64 logits), contiguous.
  const DType stat = p.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  if (!present(loss)) invalid("loss: required ((rows) " + dname(stat) + "); given absent");
  check_vector(loss, "loss", rows, stat, false);
  ops.add(loss, "loss", true);
  p.loss = loss.data;
  if (present(lse)) {
    check_vector(lse, "lse", rows, stat, false);
    ops.add(lse, "lse", true);
    p.lse = lse.data;
  }

  // grad_logits: (rows, vocab) of the logits' dtype, unit stride along the vocabulary; or the very
  // same view as logits (in place).
  if (present(grad_logits)) {
    const TensorView& g = grad_logits;
    const bool shape_ok = g.rank == logits.rank && g.shape[0] == logits.shape[0] &&
                          (g.rank == 1 || g.shape[1] == logits.shape[1]);
    if (!shape_ok)
      invalid("grad_logits: expected shape " + shape_string(logits) + " (same as logits); given " + shape_string(g));
    if (g.dtype != p.dtype)
      invalid("grad_logits: expected dtype " + dname(p.dtype) + " (same as logits); given " + dname(g.dtype));
    p.ld_grad = row_stride(g, "grad_logits", rows, vocab);
    ops.add(g, "grad_logits", true);
    p.grad = g.data;
    const bool in_place = g.data == logits.data && p.ld_grad == p.ld_logits;
    if (!in_place) {
      const ViewExtent a = view_extent(g, "grad_logits"), b = view_extent(logits, "logits");
      if (a.bytes > 0 && b.bytes > 0 && a.begin < b.end && b.begin < a.end)
        invalid("grad_logits: expected an output that does not overlap logits (in place is allowed only as the "
                "very same view); given overlapping memory");
    }
  }
  if (present(options.grad_scale)) {
    if (!present(grad_logits))
      invalid("grad_scale: given without grad_logits (it multiplies the gradient; the forward alone writes none)");
    set_scale(options.grad_scale, "grad_scale", rows, stat, ops, p);
  }
  ops.check_overlaps([](const char* out, const char* in) {
    return std::strcmp(out, "grad_logits") == 0 && std::strcmp(in, "logits") == 0;  // checked above
  });

  // Scalars.
  if (!(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0))
    invalid("label_smoothing: expected a value in [0, 1]; given " + number(options.label_smoothing));
  if (!(options.z_loss >= 0.0) || options.z_loss == INFINITY)
    invalid("z_loss: expected a finite value >= 0; given " + number(options.z_loss));
  p.ignore_index = options.ignore_index;
  p.label_smoothing = options.label_smoothing;
  p.z_loss = options.z_loss;

  const Device device = ops.device();
  variant = resolve_variant(variant, device);
  const CrossEntropyVariantInfo& row = variant_row(kCrossEntropyVariants, variant);
  if (device.is_cuda()) check_cuda_call(ops, p.dtype, ctx, kWhat);
  if (rows == 0) return;
  if (row.backend == Backend::kCpu) {
    if (p.target_dtype == DType::kI64) check_targets_on_host<int64_t>(p);
    else check_targets_on_host<int32_t>(p);
    row.cpu(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  launch_on_cuda(row, p, device.index, ctx, std::string(kWhat) + " (" + std::string(row.name) + ")");
#else
  throw Error(Status::kUnsupported, std::string(kWhat) + ": this build has no CUDA backend (built without CUDA)");
#endif
}

void cross_entropy_backward(const TensorView& grad_loss, const TensorView& grad_logits, const ExecutionContext& ctx) {
  const char* const what = "cross_entropy backward";
  CrossEntropyParams p;
  arg::OperandSet ops;
  const TensorView& g = grad_logits;
  if (g.rank != 1 && g.rank != 2)
    invalid("grad_logits: expected rank 1 (vocab) or 2 (rows, vocab); given rank " + std::to_string(g.rank) +
            (g.rank == 0 ? " (absent)" : " " + shape_string(g)));
  p.rows = g.rank == 2 ? g.shape[0] : 1;
  p.vocab = g.shape[g.rank - 1];
  if (p.rows < 0 || p.vocab < 1)
    invalid("grad_logits: expected a vocabulary >= 1 and rows >= 0; given shape " + shape_string(g));
  check_logits_dtype(g.dtype, g.device, "grad_logits");
  p.dtype = g.dtype;
  p.ld_grad = p.ld_logits = row_stride(g, "grad_logits", p.rows, p.vocab);
  ops.add(g, "grad_logits", true);
  p.grad = g.data;
  p.logits = g.data;
  if (!present(grad_loss)) invalid("grad_loss: required (the upstream gradient of the loss); given absent");
  set_scale(grad_loss, "grad_loss", p.rows, p.dtype == DType::kF64 ? DType::kF64 : DType::kF32, ops, p);
  ops.check_overlaps();
  const Device device = ops.device();
  if (device.is_cuda()) check_cuda_call(ops, p.dtype, ctx, what);
  if (p.rows == 0) return;
  if (!device.is_cuda()) {
    cpu_cross_entropy_scale_grad(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  DeviceGuard guard(device.index);
  check_cuda(cuda::cross_entropy_scale_grad(p, static_cast<cudaStream_t>(ctx.cuda_stream)), what);
#else
  throw Error(Status::kUnsupported, std::string(what) + ": this build has no CUDA backend (built without CUDA)");
#endif
}

size_t cross_entropy_workspace_bytes(DType dtype, Device device, int64_t rows, int64_t vocab, FusedVariant variant) {
  if (rows < 0) invalid("rows: expected >= 0; given " + std::to_string(rows));
  if (vocab < 1) invalid("vocab: expected >= 1; given " + std::to_string(vocab));
  if (device.is_cuda() && device.index < 0)
    invalid("device: expected the CPU or a CUDA ordinal >= 0; given " + device_name(device));
  check_logits_dtype(dtype, device, "dtype");
  variant = resolve_variant(variant, device);
  if (!device.is_cuda() || rows == 0) return 0;
#if OPTIMIZED_WITH_CUDA
  if (std::string why = cuda_dtype_not_built("fused", dtype); !why.empty())
    throw Error(Status::kUnsupported, "cross_entropy_workspace_bytes: " + why);
  DeviceGuard guard(device.index);
  const CrossEntropyVariantInfo& row = variant_row(kCrossEntropyVariants, variant);
  CrossEntropyParams p;  // placeholders: the launcher measures from the sizes alone
  p.dtype = dtype;
  p.rows = rows;
  p.vocab = vocab;
  p.ld_logits = p.ld_grad = vocab;
  return launcher_workspace_bytes(row, p, "cross_entropy_workspace_bytes (" + std::string(row.name) + ")");
#else
  throw Error(Status::kUnsupported, "cross_entropy_workspace_bytes: " + device_name(device) +
                                        " given but this build has no CUDA backend (built without CUDA)");
#endif
}

}  // namespace optimized
