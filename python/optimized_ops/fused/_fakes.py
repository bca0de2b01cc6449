"""Fake kernels of the fused ops (``torch.library.register_fake``): the outputs of every
``torch.ops.optimized.<op>_fwd`` / ``_bwd`` op as the C++ kernels allocate them (fresh, contiguous;
softmax over another dimension than the last: a permuted view of a contiguous buffer), without
running anything, for ``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors.

They compute shapes and dtypes only. Checking the arguments (dtypes, devices, the shapes of dy,
residual, weight and bias, eps, the variant, approximate) is the library's (its torch glue and its
C++ API, src/torch/common.h says which): under ``torch.compile`` it happens when the compiled graph
runs the real kernel. A fake checks only what
its output shapes are computed from, where a wrong argument leaves no shape to give -- no C++ runs
while a graph is traced, so such an argument must raise here -- with the words of the C++ glue:

* softmax's ``dim``: the output's layout puts that dimension last;
* the norms' ``normalized_shape`` against ``x`` (forward): the statistics have one value per row of
  ``x`` over its trailing ``normalized_shape``;
* ``silu_and_mul_fwd``'s ``x``: the output is ``(..., d)`` from ``(..., 2 * d)``;
* ``bias_gelu_bwd``'s ``compute_dbias`` for a 0-D ``x``: ``dbias`` would have no dimension to be;
* one device for every tensor, the outputs' (``optimized_ops._fakes.one_device``).
"""

from __future__ import annotations

import torch

from .._fakes import one_device
from .._library import load

load()  # registers torch.ops.optimized.* before the registrations below


def _msg(op: str, arg: str, text: str) -> str:
    return f"optimized::{op}: {arg}: {text}"


# ---- softmax / log_softmax --------------------------------------------------------------------------

def _softmax_like(x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    """A fresh tensor of x's shape, laid out with `dim` last (as the kernels write it)."""
    n = max(x.dim(), 1)
    torch._check_value(-n <= dim < n, lambda: _msg(op, "dim", f"expected a dimension in [{-n}, {n - 1}]; given {dim}"))
    if x.dim() == 0:
        return x.new_empty(())
    d = dim % n
    shape = list(x.shape)
    moved = shape[:d] + shape[d + 1:] + [shape[d]]
    return x.new_empty(moved).movedim(-1, d)


def _fake_softmax_fwd(op):
    def fake(x, dim=-1, scale=1.0, *, variant="auto"):
        return _softmax_like(x, dim, op)
    return fake


def _fake_softmax_bwd(op):
    def fake(y, dy, dim=-1, scale=1.0, *, variant="auto"):
        one_device(op, y=y, dy=dy)
        return _softmax_like(y, dim, op)
    return fake


for _name in ("softmax", "log_softmax"):
    torch.library.register_fake(f"optimized::{_name}_fwd", _fake_softmax_fwd(f"{_name}_fwd"))
    torch.library.register_fake(f"optimized::{_name}_bwd", _fake_softmax_bwd(f"{_name}_bwd"))


# ---- layer_norm / rms_norm ------------------------------------------------------------------------

def _row_shape(op: str, x: torch.Tensor, normalized_shape) -> list:
    """The statistics' shape: x.shape without its trailing normalized_shape (which x must end in)."""
    ns = list(normalized_shape)
    k = len(ns)
    torch._check_value(k >= 1, lambda: _msg(op, "normalized_shape", "expected at least one dimension; given []"))
    torch._check_value(x.dim() >= k and list(x.shape[x.dim() - k:]) == ns, lambda: _msg(
        op, "x", f"expected a shape ending in {ns} (normalized_shape); given {list(x.shape)}"))
    return list(x.shape[:x.dim() - k])


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """The statistics' dtype, as the C++ glue allocates them: float64 for float64 x, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.register_fake("optimized::layer_norm_fwd")
def _layer_norm_fwd_fake(x, residual, normalized_shape, weight, bias, eps, *, variant="auto"):
    one_device("layer_norm_fwd", x=x, residual=residual, weight=weight, bias=bias)
    rows = _row_shape("layer_norm_fwd", x, normalized_shape)
    residual_out = x.new_empty(x.shape) if residual is not None else None
    return (x.new_empty(x.shape), residual_out, x.new_empty(rows, dtype=_stat_dtype(x)),
            x.new_empty(rows, dtype=_stat_dtype(x)))


@torch.library.register_fake("optimized::rms_norm_fwd")
def _rms_norm_fwd_fake(x, residual, normalized_shape, weight, eps, *, variant="auto"):
    one_device("rms_norm_fwd", x=x, residual=residual, weight=weight)
    rows = _row_shape("rms_norm_fwd", x, normalized_shape)
    residual_out = x.new_empty(x.shape) if residual is not None else None
    return x.new_empty(x.shape), residual_out, x.new_empty(rows, dtype=_stat_dtype(x))


@torch.library.register_fake("optimized::layer_norm_bwd")
def _layer_norm_bwd_fake(dy, h, normalized_shape, weight, mean, rstd, dresidual_out, compute_dweight,
                         compute_dbias, *, variant="auto"):
    one_device("layer_norm_bwd", h=h, dy=dy, weight=weight, mean=mean, rstd=rstd, dresidual_out=dresidual_out)
    ns = list(normalized_shape)
    return (h.new_empty(h.shape), h.new_empty(ns) if compute_dweight else None,
            h.new_empty(ns) if compute_dbias else None)


@torch.library.register_fake("optimized::rms_norm_bwd")
def _rms_norm_bwd_fake(dy, h, normalized_shape, weight, rstd, dresidual_out, compute_dweight, *, variant="auto"):
    one_device("rms_norm_bwd", h=h, dy=dy, weight=weight, rstd=rstd, dresidual_out=dresidual_out)
    return h.new_empty(h.shape), h.new_empty(list(normalized_shape)) if compute_dweight else None


# ---- bias + GELU, SiLU-and-mul --------------------------------------------------------------------

@torch.library.register_fake("optimized::bias_gelu_fwd")
def _bias_gelu_fwd_fake(x, bias, approximate="none", *, variant="auto"):
    one_device("bias_gelu_fwd", x=x, bias=bias)
    return x.new_empty(x.shape)


@torch.library.register_fake("optimized::bias_gelu_bwd")
def _bias_gelu_bwd_fake(dy, x, bias, approximate, compute_dbias, *, variant="auto"):
    one_device("bias_gelu_bwd", x=x, dy=dy, bias=bias)
    torch._check_value(not compute_dbias or x.dim() >= 1, lambda: _msg(
        "bias_gelu_bwd", "compute_dbias", "expected False for a 0-D x (no bias dimension); given True"))
    return x.new_empty(x.shape), x.new_empty([x.shape[-1]]) if compute_dbias else None


@torch.library.register_fake("optimized::silu_and_mul_fwd")
def _silu_and_mul_fwd_fake(x, *, variant="auto"):
    op = "silu_and_mul_fwd"
    torch._check_value(x.dim() >= 1, lambda: _msg(
        op, "x", "expected at least 1 dimension (..., 2 * d); given a 0-D tensor"))
    torch._check_value(x.shape[-1] % 2 == 0, lambda: _msg(
        op, "x", f"expected an even last dimension (2 * d, the halves [a | b]); given shape {list(x.shape)}"))
    return x.new_empty([*x.shape[:-1], x.shape[-1] // 2])


@torch.library.register_fake("optimized::silu_and_mul_bwd")
def _silu_and_mul_bwd_fake(dy, x, *, variant="auto"):
    one_device("silu_and_mul_bwd", x=x, dy=dy)
    return x.new_empty(x.shape)
