// The torch glue of cross-entropy (include/optimized/fused.h, "cross-entropy"):
//
//   cross_entropy_fwd(logits, target, ignore_index, label_smoothing, z_loss, compute_grad, grad_scale?,
//                     *, variant)
//       -> (loss, lse, grad?)   loss, lse: per row, float32 (float64 for float64 logits), target's
//                                shape; grad: logits' shape and dtype, contiguous, for a unit upstream
//                                gradient of each row's loss times grad_scale (one element or one
//                                per row, loss's dtype; None: 1) (compute_grad), else None
//   cross_entropy_fwd_(logits!, target, ignore_index, label_smoothing, z_loss, grad_scale?, *, variant)
//       -> (loss, lse)           the same, the gradient written over the logits (in place)
//   cross_entropy_bwd_(grad!, grad_loss) -> ()
//                                grad (..., V) *= grad_loss (one element, or grad.shape[:-1]) in place;
//                                rows whose factor is exactly 1 are not touched (no sync: CUDA reads
//                                the factor on the device)
//
// logits (..., V): rows are the leading dimensions, viewed as (rows, V) without a copy when the
// strides allow it (as_rows), else copied (the in-place op refuses such logits: its gradient must
// land in the caller's tensor). target: logits.shape[:-1], int64 or int32. Reductions, autograd and
// fake kernels are Python's (python/optimized_ops/fused/cross_entropy.py). The C++ API checks the
// rest (dtypes, devices, the scalars, the variant, targets on the CPU) and its messages arrive
// prefixed "optimized::<op>: ".
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "optimized/core.h"
#include "optimized/fused.h"

namespace optimized::torch_glue {

namespace {

struct CeOp : GlueOp {
  FusedVariant variant(c10::string_view v) const {
    return api([&] { return parse_fused_variant(std::string_view(v.data(), v.size())); });
  }

  // The vocabulary size of logits (..., V) and the check of target's shape (logits.shape[:-1]).
  int64_t vocab(const at::Tensor& logits, const at::Tensor& target) const {
    tensor(logits, "logits");
    tensor(target, "target");
    TORCH_CHECK_VALUE(logits.dim() >= 1, prefix("logits") + "expected at least one dimension (..., vocab); given a 0-D tensor");
    const auto rows_shape = logits.sizes().slice(0, logits.dim() - 1);
    TORCH_CHECK_VALUE(target.sizes() == rows_shape, prefix("target") + "expected shape " + str(rows_shape) +
                                                        " (logits.shape[:-1]); given " + str(target.sizes()));
    const int64_t v = logits.size(-1);
    TORCH_CHECK_VALUE(v >= 1, prefix("logits") + "expected a vocabulary (last dimension) >= 1; given 0");
    return v;
  }

  // A factor tensor (grad_scale, grad_loss): one element or `shape`, of `dtype`, as a (1) or (rows) view.
  at::Tensor factor(const at::Tensor& f, const char* name, at::IntArrayRef shape, at::ScalarType dtype) const {
    tensor(f, name);
    TORCH_CHECK_VALUE(f.scalar_type() == dtype, prefix(name) + "expected dtype " + std::string(c10::toString(dtype)) +
                                                    "; given " + std::string(c10::toString(f.scalar_type())));
    TORCH_CHECK_VALUE(f.numel() == 1 || f.sizes() == shape, prefix(name) + "expected one element or shape " +
                                                                str(shape) + "; given " + str(f.sizes()));
    return f.numel() == 1 ? f.reshape({1}) : f.reshape({-1});
  }

  // Runs the C++ API; grad: the (rows, V) view written, or undefined.
  void run(const at::Tensor& rows_view, const at::Tensor& target, int64_t ignore_index, double label_smoothing,
           double z_loss, const at::Tensor& loss, const at::Tensor& lse, const at::Tensor& grad, bool in_place,
           const at::Tensor& grad_scale, FusedVariant v) const {
    const int64_t rows = rows_view.size(0), vocab = rows_view.size(1);
    const at::Tensor t = target.reshape({rows});
    Launch launch(rows_view.device());
    api([&] {
      const TensorView xv = view(rows_view, "logits"), tv = view(t, "target");
      const TensorView lv = view(loss.view({rows}), "loss"), sv = view(lse.view({rows}), "lse");
      const TensorView gv = in_place ? xv : view(grad, "grad");
      if (rows_view.device().is_cuda()) {
        size_t bytes = 0;
        try {
          bytes = cross_entropy_workspace_bytes(xv.dtype, xv.device, rows, vocab, v);
        } catch (const Error&) {
          bytes = 0;  // the call below refuses it with its own words
        }
        launch.provide_workspace(bytes);
      }
      CrossEntropyOptions options;
      options.ignore_index = ignore_index;
      options.label_smoothing = label_smoothing;
      options.z_loss = z_loss;
      if (grad_scale.defined()) options.grad_scale = view(grad_scale, "grad_scale");
      cross_entropy_forward(xv, tv, options, lv, sv, gv, v, launch.ctx);
    });
  }
};

at::ScalarType loss_dtype(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> cross_entropy_fwd(
    const at::Tensor& logits, const at::Tensor& target, int64_t ignore_index, double label_smoothing, double z_loss,
    bool compute_grad, const std::optional<at::Tensor>& grad_scale, c10::string_view variant) {
  const CeOp op{"cross_entropy_fwd"};
  const int64_t vocab = op.vocab(logits, target);
  const FusedVariant v = op.variant(variant);
  TORCH_CHECK_VALUE(!grad_scale || compute_grad, op.prefix("grad_scale") +
                                                     "given with compute_grad=False (it multiplies the gradient)");
  const at::Tensor scale = grad_scale ? op.factor(*grad_scale, "grad_scale", target.sizes(), loss_dtype(logits))
                                      : at::Tensor();
  const auto opts = logits.options().dtype(loss_dtype(logits));
  at::Tensor loss = at::empty(target.sizes(), opts), lse = at::empty(target.sizes(), opts);
  at::Tensor grad = compute_grad ? at::empty(logits.sizes(), logits.options()) : at::Tensor();
  const at::Tensor rows = as_rows(logits, vocab);
  op.run(rows, target, ignore_index, label_smoothing, z_loss, loss, lse,
         compute_grad ? grad.view({-1, vocab}) : at::Tensor(), false, scale, v);
  return {loss, lse, compute_grad ? std::optional<at::Tensor>(grad) : std::nullopt};
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd_(const at::Tensor& logits, const at::Tensor& target,
                                                      int64_t ignore_index, double label_smoothing, double z_loss,
                                                      const std::optional<at::Tensor>& grad_scale,
                                                      c10::string_view variant) {
  const CeOp op{"cross_entropy_fwd_"};
  const int64_t vocab = op.vocab(logits, target);
  const FusedVariant v = op.variant(variant);
  const at::Tensor scale = grad_scale ? op.factor(*grad_scale, "grad_scale", target.sizes(), loss_dtype(logits))
                                      : at::Tensor();
  const auto opts = logits.options().dtype(loss_dtype(logits));
  at::Tensor loss = at::empty(target.sizes(), opts), lse = at::empty(target.sizes(), opts);
  const at::Tensor rows = as_rows(logits, vocab);
  TORCH_CHECK_VALUE(rows.numel() == 0 || rows.data_ptr() == logits.data_ptr(),
                    op.prefix("logits") + "expected logits viewable as (rows, vocab) without a copy (unit stride "
                                          "along the vocabulary, rows at least a row apart) to write the gradient "
                                          "in place; given strides " + str(logits.strides()));
  op.run(rows, target, ignore_index, label_smoothing, z_loss, loss, lse, at::Tensor(), true, scale, v);
  return {loss, lse};
}

void cross_entropy_bwd_(const at::Tensor& grad, const at::Tensor& grad_loss) {
  const CeOp op{"cross_entropy_bwd_"};
  op.tensor(grad, "grad");
  TORCH_CHECK_VALUE(grad.dim() >= 1, op.prefix("grad") + "expected at least one dimension (..., vocab); given a 0-D tensor");
  const int64_t vocab = grad.size(-1);
  const at::Tensor rows = as_rows(grad, vocab);
  TORCH_CHECK_VALUE(rows.numel() == 0 || rows.data_ptr() == grad.data_ptr(),
                    op.prefix("grad") + "expected a tensor viewable as (rows, vocab) without a copy (unit stride "
                                        "along the vocabulary, rows at least a row apart) to scale in place; given "
                                        "strides " + str(grad.strides()));
  const at::Tensor f = op.factor(grad_loss, "grad_loss", grad.sizes().slice(0, grad.dim() - 1), loss_dtype(grad));
  if (rows.numel() == 0) return;
  Launch launch(rows.device());
  op.api([&] { cross_entropy_backward(op.view(f, "grad_loss"), op.view(rows, "grad"), launch.ctx); });
}

}  // namespace

}  // namespace optimized::torch_glue

TORCH_LIBRARY_FRAGMENT(optimized, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // Per-row cross-entropy of logits (..., V) against target (...): loss and lse (float32; float64 for
  // float64 logits) and, with compute_grad, the gradient for a unit upstream gradient of each row.
  m.def(
      "cross_entropy_fwd(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0., "
      "float z_loss=0., bool compute_grad=False, Tensor? grad_scale=None, *, str variant='auto') -> "
      "(Tensor loss, Tensor lse, Tensor? grad)",
      tags);
  // The same, the gradient written over logits.
  m.def(
      "cross_entropy_fwd_(Tensor(a!) logits, Tensor target, int ignore_index=-100, float label_smoothing=0., "
      "float z_loss=0., Tensor? grad_scale=None, *, str variant='auto') -> (Tensor loss, Tensor lse)",
      tags);
  // The backward through a stored gradient: grad *= grad_loss in place (rows whose factor is 1 untouched).
  m.def("cross_entropy_bwd_(Tensor(a!) grad, Tensor grad_loss) -> ()", tags);
}

TORCH_LIBRARY_IMPL(optimized, CPU, m) {
  m.impl("cross_entropy_fwd", &optimized::torch_glue::cross_entropy_fwd);
  m.impl("cross_entropy_fwd_", &optimized::torch_glue::cross_entropy_fwd_);
  m.impl("cross_entropy_bwd_", &optimized::torch_glue::cross_entropy_bwd_);
}

TORCH_LIBRARY_IMPL(optimized, CUDA, m) {
  m.impl("cross_entropy_fwd", &optimized::torch_glue::cross_entropy_fwd);
  m.impl("cross_entropy_fwd_", &optimized::torch_glue::cross_entropy_fwd_);
  m.impl("cross_entropy_bwd_", &optimized::torch_glue::cross_entropy_bwd_);
}
