"""Cross-entropy over the ``torch.ops.optimized.cross_entropy_fwd`` / ``cross_entropy_fwd_`` /
``cross_entropy_bwd_`` ops of the C++ library (``src/torch/cross_entropy_ops.cpp``): the function, its
fake kernels and its autograd.

One launch computes each row's loss and, when autograd will need it, the gradient of the reduced loss
for an upstream gradient of 1 (one read of the logits, one write of the gradient): ``"mean"``'s 1 / count
is counted on the device and folded into the gradient as it is written. The backward scales that
gradient in place by the upstream gradient, and a kernel that reads the factor on the device skips
rows whose factor is exactly 1: ``loss.backward()`` costs one launch and no pass over the gradient,
without a host sync. Without a gradient to compute, the forward reads the logits once and writes the
loss.
"""

from __future__ import annotations

import torch

from .._autograd import bump_version, compute_dtype, kernel_scalar, register_autograd
from .._fakes import one_device
from .._library import load

load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized

_REDUCTIONS = ("none", "mean", "sum")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean",
                  inplace_backward: bool = False, variant: str = "auto") -> torch.Tensor:
    """Cross-entropy of ``logits`` against class indices ``target``, with label smoothing and z-loss.

    Per row (``V`` classes, ``ls = label_smoothing``, ``lse = logsumexp(logits[row])``)::

        loss = lse - ((1 - ls) * logits[target] + ls / V * sum(logits)) + z_loss * lse**2

    which is :func:`torch.nn.functional.cross_entropy` with ``label_smoothing`` plus PaLM's z-loss term.
    Rows whose target is ``ignore_index`` give 0 and are left out of the mean's denominator; as in
    torch, a ``"mean"`` over a batch whose every row is ignored is NaN (0 / 0). ±inf logits give what
    the same float64 formulas give (a +inf logit: NaN; a -inf logit at the target: +inf).

    Parameters
    ----------
    logits : torch.Tensor
        ``(..., V)``, float32, float16 or bfloat16 (float64 on the CPU); rows may be strided (unit stride
        along ``V``). Math in float32 (float64 for float64).
    target : torch.Tensor
        ``logits.shape[:-1]``, int64 or int32: values in ``[0, V)`` or ``ignore_index``. Others: a
        ValueError on the CPU; on CUDA (which cannot raise without a synchronisation) that row's loss
        and gradient are NaN.
    ignore_index, label_smoothing, z_loss : keyword-only
        As above; ``label_smoothing`` in [0, 1], ``z_loss >= 0``.
    reduction : str, keyword-only
        ``"mean"`` (over the rows not ignored), ``"sum"`` or ``"none"`` (per row, ``target``'s shape).
    inplace_backward : bool, keyword-only
        When autograd needs the gradient, write it OVER ``logits`` during the forward instead of into a
        new tensor (saves a ``(..., V)`` buffer; Liger-Kernel's trick): ``logits`` holds the gradient
        afterwards and the backward scales it in place and returns it. Only for logits nothing else
        reads afterwards (autograd raises if another op saved them for its backward); the logits must
        be viewable as ``(rows, V)`` without a copy.
    variant : str, keyword-only
        ``"auto"``, ``"cpu"``, ``"fused_streaming"`` (CUDA, ``auto``'s choice: a block per row, which reads the
        row a second time when the gradient is wanted) or ``"fused_registers"`` (CUDA: a cluster of blocks holds
        the row in registers and reads it once, but keeps too few rows in flight and is slower on the H100;
        logits it cannot hold run the streaming kernels).

    Returns
    -------
    torch.Tensor
        The loss in ``logits``' dtype: 0-D for ``"mean"`` / ``"sum"``, ``target``'s shape for ``"none"``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"optimized_ops.cross_entropy: reduction: expected one of {', '.join(_REDUCTIONS)}; "
                         f"given '{reduction}'")
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropy.apply(logits, target, ignore_index, float(label_smoothing), float(z_loss), reduction,
                                   inplace_backward, variant)
    loss, _, _ = _ops.cross_entropy_fwd.default(logits, target, ignore_index, float(label_smoothing),
                                                float(z_loss), False, variant=variant)
    return _reduce(loss, target, ignore_index, reduction, logits.dtype)


def _reduce(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, dtype: torch.dtype,
            count: torch.Tensor = None) -> torch.Tensor:
    """The per-row losses reduced, in ``dtype``, always a new tensor (an autograd.Function whose output
    aliases an intermediate gets zero gradients under torch.compile: see linear_cross_entropy._reduce)."""
    if reduction == "none":
        return loss.to(dtype, copy=True)
    total = loss.sum()
    if reduction == "mean":
        # all rows ignored: 0 / 0 = NaN, as torch
        total = total / ((target != ignore_index).sum() if count is None else count)
    return total.to(dtype, copy=True)


# ---- fake kernels ------------------------------------------------------------------------------

def _fake_outputs(op: str, logits: torch.Tensor, target: torch.Tensor):
    one_device(op, logits=logits, target=target)
    torch._check_value(logits.dim() >= 1, lambda: (
        f"optimized::{op}: logits: expected at least one dimension (..., vocab); given a 0-D tensor"))
    torch._check_value(list(target.shape) == list(logits.shape[:-1]), lambda: (
        f"optimized::{op}: target: expected shape {list(logits.shape[:-1])} (logits.shape[:-1]); "
        f"given {list(target.shape)}"))
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty(target.shape, dtype=dtype), logits.new_empty(target.shape, dtype=dtype)


@torch.library.register_fake("optimized::cross_entropy_fwd")
def _cross_entropy_fwd_fake(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, compute_grad=False,
                            grad_scale=None, *, variant="auto"):
    loss, lse = _fake_outputs("cross_entropy_fwd", logits, target)
    return loss, lse, (logits.new_empty(logits.shape) if compute_grad else None)


@torch.library.register_fake("optimized::cross_entropy_fwd_")
def _cross_entropy_fwd_inplace_fake(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                    grad_scale=None, *, variant="auto"):
    return _fake_outputs("cross_entropy_fwd_", logits, target)


@torch.library.register_fake("optimized::cross_entropy_bwd_")
def _cross_entropy_bwd_fake(grad, grad_loss):
    one_device("cross_entropy_bwd_", grad=grad, grad_loss=grad_loss)
    return None


# ---- autograd ----------------------------------------------------------------------------------

def _scaled(grad: torch.Tensor, g_loss: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = grad * g_loss[..., None], in float32 math rounded once to grad's dtype (no float32 copy of
    grad: the multiply promotes inside the kernel and casts on the store)."""
    return torch.mul(grad, g_loss.unsqueeze(-1).to(compute_dtype(grad)), out=out)


def _setup(ctx, inputs, keyword_only_inputs, output):
    loss, lse, grad = output
    logits, target, ignore_index, label_smoothing, z_loss, compute_grad, grad_scale = inputs
    ctx.compute_grad = compute_grad
    # With a grad_scale the stored gradient is the unit one times the scale, not the loss's: the backward
    # then recomputes the unit gradient from the logits (torch formula; optimized_ops.cross_entropy never
    # differentiates through this op, it owns its backward).
    ctx.scaled = grad_scale is not None
    ctx.args = (ignore_index, label_smoothing, z_loss)
    ctx.save_for_backward(*((logits, target) if ctx.scaled else (grad,)))
    ctx.mark_non_differentiable(*(t for t in (lse, grad) if t is not None))
    ctx.set_materialize_grads(False)


def _backward(ctx, g_loss, g_lse, g_grad):
    if g_loss is None or not ctx.needs_input_grad[0]:
        return (None,) * 7
    if ctx.scaled:
        logits, target = ctx.saved_tensors
        unit = _unit_gradient(logits, target, *ctx.args)
        return (_scaled(unit, g_loss, torch.empty_like(logits)),) + (None,) * 6
    (grad,) = ctx.saved_tensors
    torch._check(grad is not None, lambda: (
        "optimized::cross_entropy_fwd: the forward ran with compute_grad=False, so it kept no gradient; "
        "call it with compute_grad=True (optimized_ops.cross_entropy does when logits require grad)"))
    return _scaled(grad, g_loss, torch.empty_like(grad)), None, None, None, None, None, None


def _unit_gradient(logits, target, ignore_index, label_smoothing, z_loss):
    """The gradient of each row's loss for a unit upstream gradient, as a torch formula (compute dtype)."""
    c = compute_dtype(logits)
    x = logits.to(c)
    v = x.shape[-1]
    lse = torch.logsumexp(x, -1, keepdim=True)
    ls, z = kernel_scalar(label_smoothing, c), kernel_scalar(z_loss, c)
    unit = torch.exp(x - lse) * (1 + 2 * z * lse) - ls / v
    keep = target != ignore_index
    onehot = torch.nn.functional.one_hot(torch.where(keep, target, 0).long(), v).to(c)
    return (unit - (1 - ls) * onehot) * keep.unsqueeze(-1).to(c)


def _jvp(inputs, keyword_only_inputs, output, tangents):
    logits, target, ignore_index, label_smoothing, z_loss, _, grad_scale = inputs
    t = tangents[0]
    if t is None:
        return None, None, None
    c = compute_dtype(logits)
    # the unit gradient: output[2] holds it times grad_scale, so recompute it when a scale was folded in
    unit = output[2].to(c) if output[2] is not None and grad_scale is None else _unit_gradient(
        logits, target, ignore_index, label_smoothing, z_loss)
    return (unit * t.to(c)).sum(-1).to(output[0].dtype), None, None


register_autograd("optimized::cross_entropy_fwd", _backward, setup_context=_setup, jvp=_jvp, batching=True)


class _CrossEntropy(torch.autograd.Function):
    """optimized_ops.cross_entropy when autograd needs the logits' gradient. The forward writes the gradient
    of the reduced loss for an upstream 1 (into a new tensor, or over the logits with inplace_backward), the
    mean's 1 / count folded in from a device count; the backward scales it in place by the upstream gradient
    (cross_entropy_bwd_: rows whose factor is exactly 1 untouched, the factor read on the device) and hands
    that memory back as the logits' gradient."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, z_loss, reduction, inplace, variant):
        count = scale = None
        if reduction == "mean":
            count = (target != ignore_index).sum()
            # all rows ignored: 1 / 0 = inf multiplies no row (ignored rows are written as 0 unscaled)
            scale = torch.reciprocal(count.to(compute_dtype(logits)))
        if inplace:
            loss, _ = _ops.cross_entropy_fwd_.default(logits, target, ignore_index, label_smoothing, z_loss, scale,
                                                      variant=variant)
            bump_version(logits)  # another op's saved logits now fail autograd's version check
            grad = logits  # now the gradient (saved after the write: its version checks later ones)
        else:
            loss, _, grad = _ops.cross_entropy_fwd.default(logits, target, ignore_index, label_smoothing, z_loss,
                                                           True, scale, variant=variant)
        ctx.save_for_backward(grad)
        ctx.set_materialize_grads(False)
        return _reduce(loss, target, ignore_index, reduction, logits.dtype, count)

    @staticmethod
    def backward(ctx, g_out):
        if g_out is None or not ctx.needs_input_grad[0]:
            return (None,) * 8
        (grad,) = ctx.saved_tensors
        _ops.cross_entropy_bwd_.default(grad, g_out.to(compute_dtype(grad)))
        return (grad,) + (None,) * 7
