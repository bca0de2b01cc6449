"""Fused memory-bound ops from PyTorch: softmax, log_softmax, layer_norm, rms_norm, residual add +
norm, bias + GELU and SiLU-and-mul, over the ``torch.ops.optimized.<op>_fwd`` / ``<op>_bwd`` ops of
the C++ library (``src/torch/fused_ops.cpp``).

The functions follow :mod:`torch.nn.functional` (same names, arguments and results where torch has
the op) and add a keyword-only ``variant`` that picks the rung of the ladder:

======================  ======  ===========================================================
variant                 device  what runs
======================  ======  ===========================================================
``"auto"``              any     ``cpu`` on the CPU; on CUDA the fused design measured faster
                                for the op, width and alignment (resolve_fused_variant)
``"cpu"``               CPU     plain loops, threads over rows (float64 too)
``"unfused"``           CUDA    one kernel per elementary step, temporaries in global memory
``"fused_streaming"``   CUDA    one kernel, a block streams its row in passes (any width)
``"fused_registers"``   CUDA    one kernel, the row read once into registers (short rows)
======================  ======  ===========================================================

This module registers, through :mod:`torch.library`, what torch needs around the C++ ops:

* fake kernels (``register_fake``) for every op, so that ``torch.compile(fullgraph=True)``,
  ``torch.export`` and meta tensors trace through them;
* autograd (``_autograd.register_autograd``) for every forward op, whose backward calls the
  matching ``*_bwd`` op (the same kernels, the same variant), and whose forward-mode rule (jvp)
  gives ``torch.autograd.forward_ad`` and ``torch.func`` (jvp, jacfwd, hessian, vmap) real tangents;
* autograd for every ``*_bwd`` op as well, so that double backward works (``gradgradcheck``): the
  derivative of a backward is the vector-Jacobian product of a composite formula of the same math
  (in float32, or float64 for float64 inputs), differentiable once more, not twice: third-order
  gradients through it raise. The ``*_bwd`` ops have jvp rules too (``hessian`` is forward mode
  over them), and forward mode composes to any order;
* batching rules (a loop over the batch) for every op: torch's vmap fallback cannot stack their
  optional outputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ._autograd import compute_dtype, kernel_scalar, has_tangent, register_autograd
from ._library import load

_lib = load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ShapeLike = Union[int, Sequence[int], torch.Size]


# ---- the ladder ------------------------------------------------------------------------------

def fused_variants() -> list[str]:
    """Names of the variants of the fused family, CPU then CUDA, naive to best (``"auto"`` excluded).

    Returns
    -------
    list of str
        ``["cpu", "unfused", "fused_streaming", "fused_registers"]``.
    """
    return list(_ops.fused_variants())


_VARIANTS = ("auto", *fused_variants())
_OPS = ("softmax", "log_softmax", "layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "bias_gelu",
        "silu_and_mul")


def fused_registers_max_width(op: str, dtype: torch.dtype, backward: bool = False) -> int:
    """The longest row (in elements) the ``fused_registers`` rung holds, for rows whose every
    operand starts on a 16-byte boundary.

    Parameters
    ----------
    op : str
        One of ``softmax``, ``log_softmax``, ``layer_norm``, ``rms_norm``, ``add_layer_norm``,
        ``add_rms_norm``, ``bias_gelu``, ``silu_and_mul``.
    dtype : torch.dtype
        float32, float16 or bfloat16 (float64 has no CUDA rung: 0).
    backward : bool
        The backward kernel (which keeps fewer elements per thread) instead of the forward.

    Returns
    -------
    int
        The width limit; 0 for the elementwise ops (``bias_gelu``, ``silu_and_mul``), which have
        no row reduction and take any width.
    """
    return int(_ops.fused_registers_max_width(op, dtype, backward))


def resolve_fused_variant(op: str, dtype: torch.dtype, device: Union[str, torch.device], width: int,
                          backward: bool = False) -> str:
    """The variant ``"auto"`` runs for rows of ``width`` elements (rows aligned to 16 bytes).

    Parameters
    ----------
    op : str
        An op name, as for :func:`fused_registers_max_width`.
    dtype : torch.dtype
        The dtype of the data operands.
    device : str or torch.device
        ``"cpu"`` or ``"cuda"`` (presence is not checked).
    width : int
        The row length: the product of the normalized dimensions, the softmax dimension, the last
        dimension of ``bias_gelu``, half the last dimension of ``silu_and_mul``.
    backward : bool
        The backward instead of the forward.

    Returns
    -------
    str
        ``"cpu"``, ``"fused_registers"`` or ``"fused_streaming"``.
    """
    return _ops.resolve_fused_variant(op, dtype, str(torch.device(device)), width, backward)


# ---- helpers ---------------------------------------------------------------------------------

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # "float32", as the C++ glue prints it


def _normalized_shape(normalized_shape: _ShapeLike) -> list:
    if isinstance(normalized_shape, (int, torch.SymInt)):
        return [normalized_shape]
    return list(normalized_shape)


def _cast_like(t: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
    """weight / bias in x's dtype (a differentiable cast; the kernels take one dtype per call)."""
    if t is None or t.dtype == x.dtype or not (t.dtype.is_floating_point and x.dtype.is_floating_point):
        return t
    return t.to(x.dtype)


def _needs(ctx, n: int) -> tuple:
    """ctx.needs_input_grad padded to the op's n positional arguments: the dispatcher drops trailing
    arguments equal to their defaults before autograd sees them."""
    needs = tuple(ctx.needs_input_grad)
    return needs + (False,) * (n - len(needs))


def _backward_variant(variant: str) -> str:
    # fused_registers keeps fewer elements per thread in the backward: rows it held in the forward
    # may need fused_streaming there, which is what "auto" picks (same rung whenever it fits).
    return "auto" if variant == "fused_registers" else variant


# ---- the functions -----------------------------------------------------------------------------

def softmax(input: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None, *, scale: float = 1.0,
            variant: str = "auto") -> torch.Tensor:
    r"""Softmax along ``dim`` of ``scale * input``, as :func:`torch.nn.functional.softmax`.

    .. math::  y_i = \frac{\exp(s x_i - \max_j s x_j)}{\sum_k \exp(s x_k - \max_j s x_j)}

    Computed in float32 (float64 for float64 input), rounded once to the dtype.

    Parameters
    ----------
    input : torch.Tensor
        Any shape; float32, float16 or bfloat16 on CPU or CUDA, float64 on the CPU (``"cpu"``
        and ``"auto"``).
    dim : int
        The dimension to normalize (negative counts from the end). Required (torch's implicit
        choice of dimension is deprecated).
    dtype : torch.dtype, optional
        As in torch: the input is cast to this dtype first, and the result has it.
    scale : float, keyword-only
        Multiplies the input before the softmax (e.g. attention's ``1 / sqrt(d)``), at no cost.
    variant : str, keyword-only
        ``"auto"``, ``"cpu"``, ``"unfused"``, ``"fused_streaming"`` or ``"fused_registers"``.

    Returns
    -------
    torch.Tensor
        A new tensor of ``input``'s shape and dtype. For ``dim`` the last dimension it is
        contiguous; for another ``dim`` it is a permuted view of a contiguous buffer in which
        ``dim`` is last (call ``.contiguous()`` where a contiguous result is needed).

    Raises
    ------
    ValueError
        ``dim`` out of range, an unknown variant, or one of the other device.
    TypeError
        A dtype other than float32, float16, bfloat16 and float64.
    NotImplementedError
        float64 on a CUDA variant; a width beyond ``fused_registers``; CUDA tensors with a
        CPU-only build.

    Notes
    -----
    The last dimension is read in place when its stride is 1 (strided rows such as ``x[:, :k]``
    too); another ``dim`` is moved last by a copy unless its stride is already 1. Autograd:
    ``dx = s * y * (dy - sum(dy * y))``, by ``torch.ops.optimized.softmax_bwd`` with the same
    variant.

    Examples
    --------
    >>> x = torch.randn(4, 1000, device="cuda", dtype=torch.bfloat16)
    >>> optimized_ops.softmax(x, -1).sum(-1)
    tensor([1., 1., 1., 1.], device='cuda:0', dtype=torch.bfloat16)
    """
    if dtype is not None:
        input = input.to(dtype)
    return _ops.softmax_fwd.default(input, dim, scale, variant=variant)


def log_softmax(input: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None, *, scale: float = 1.0,
                variant: str = "auto") -> torch.Tensor:
    r"""Log-softmax along ``dim`` of ``scale * input``, as :func:`torch.nn.functional.log_softmax`.

    .. math::  y_i = s x_i - \max_j s x_j - \log \sum_k \exp(s x_k - \max_j s x_j)

    Parameters
    ----------
    input, dim, dtype, scale, variant
        As for :func:`softmax`.

    Returns
    -------
    torch.Tensor
        A new tensor of ``input``'s shape and dtype, laid out as :func:`softmax`'s.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As for :func:`softmax`.

    Notes
    -----
    Autograd: ``dx = s * (dy - exp(y) * sum(dy))``, by ``torch.ops.optimized.log_softmax_bwd``.

    Examples
    --------
    >>> logits = torch.randn(8, 32000)
    >>> optimized_ops.log_softmax(logits, dim=-1).exp().sum(-1)  # ones
    """
    if dtype is not None:
        input = input.to(dtype)
    return _ops.log_softmax_fwd.default(input, dim, scale, variant=variant)


def layer_norm(input: torch.Tensor, normalized_shape: _ShapeLike, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, *, variant: str = "auto") -> torch.Tensor:
    r"""Layer normalization over the trailing ``normalized_shape`` dimensions, as
    :func:`torch.nn.functional.layer_norm`.

    .. math::  y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot w + b

    with the biased variance; statistics in float32 (float64 for float64 input).

    Parameters
    ----------
    input : torch.Tensor
        ``(*, *normalized_shape)``; float32, float16 or bfloat16 on CPU or CUDA, float64 on the
        CPU.
    normalized_shape : int or sequence of int
        The trailing dimensions to normalize over, flattened into one row (several allowed).
    weight, bias : torch.Tensor, optional
        ``normalized_shape``, on ``input``'s device. A floating dtype other than ``input``'s is
        cast to ``input``'s (the kernels take one dtype per call; the result has ``input``'s
        dtype, as torch's does); gradients flow back to the original dtype.
    eps : float
        Added to the variance; finite and >= 0.
    variant : str, keyword-only
        ``"auto"``, ``"cpu"``, ``"unfused"``, ``"fused_streaming"`` or ``"fused_registers"``.

    Returns
    -------
    torch.Tensor
        A new contiguous tensor of ``input``'s shape and dtype.

    Raises
    ------
    ValueError
        ``input`` whose trailing dimensions are not ``normalized_shape``, ``weight`` or ``bias``
        of another shape or device, an empty ``normalized_shape``, negative ``eps``, an unknown
        variant. The message names the argument.
    TypeError
        Unsupported dtypes.
    NotImplementedError
        float64 on a CUDA variant, a row too long for ``fused_registers``, CUDA tensors with a
        CPU-only build.

    Notes
    -----
    Autograd gives ``input``, ``weight`` and ``bias`` their gradients through
    ``torch.ops.optimized.layer_norm_bwd`` (one pass; ``dweight`` and ``dbias`` only when asked
    for), from the mean and rstd the forward saved.

    Examples
    --------
    >>> x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16)
    >>> w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    >>> optimized_ops.layer_norm(x, (1024,), w, torch.zeros_like(w)).shape
    torch.Size([8, 128, 1024])
    """
    y, _, _, _ = _ops.layer_norm_fwd.default(input, None, _normalized_shape(normalized_shape),
                                             _cast_like(weight, input), _cast_like(bias, input), eps,
                                             variant=variant)
    return y


def add_layer_norm(input: torch.Tensor, residual: torch.Tensor, normalized_shape: _ShapeLike,
                   weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, eps: float = 1e-5,
                   *, variant: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    r"""Residual add + layer normalization in one pass: ``h = input + residual``, then
    ``(layer_norm(h), h)``.

    ``h`` is rounded to the dtype before it is normalized, so the result equals
    ``F.layer_norm(input + residual, ...)`` computed in the same dtype (up to the rounding of the
    normalization itself).

    Parameters
    ----------
    input : torch.Tensor
        ``(*, *normalized_shape)``, as for :func:`layer_norm`.
    residual : torch.Tensor
        The running residual stream: ``input``'s shape, dtype and device.
    normalized_shape, weight, bias, eps, variant
        As for :func:`layer_norm`.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``(y, residual_out)``: the normalized ``h`` and ``h`` itself (the residual for the next
        block), both new contiguous tensors of ``input``'s shape and dtype.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As for :func:`layer_norm`; ``residual`` of another shape, device (ValueError) or dtype
        (TypeError).

    Notes
    -----
    Autograd: ``input`` and ``residual`` receive the same gradient, the layer norm's ``dh`` plus
    the gradient arriving at ``residual_out``, summed inside the backward kernel.

    Examples
    --------
    >>> y, residual = optimized_ops.add_layer_norm(attn_out, residual, (4096,), w, b)
    """
    y, residual_out, _, _ = _ops.layer_norm_fwd.default(input, residual, _normalized_shape(normalized_shape),
                                                        _cast_like(weight, input), _cast_like(bias, input), eps,
                                                        variant=variant)
    return y, residual_out


def _rms_eps(input: torch.Tensor, eps: Optional[float]) -> float:
    if eps is not None:
        return eps
    # torch's default: the machine epsilon of the input's dtype (non-float dtypes are refused by the op).
    return torch.finfo(input.dtype).eps if input.dtype.is_floating_point else 0.0


def rms_norm(input: torch.Tensor, normalized_shape: _ShapeLike, weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None, *, variant: str = "auto") -> torch.Tensor:
    r"""Root-mean-square normalization over the trailing ``normalized_shape`` dimensions, as
    :func:`torch.nn.functional.rms_norm`.

    .. math::  y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot w

    Parameters
    ----------
    input : torch.Tensor
        ``(*, *normalized_shape)``; float32, float16 or bfloat16 on CPU or CUDA, float64 on the
        CPU.
    normalized_shape : int or sequence of int
        The trailing dimensions to normalize over (several allowed).
    weight : torch.Tensor, optional
        ``normalized_shape``; a floating dtype other than ``input``'s is cast to ``input``'s, and
        the result has ``input``'s dtype (torch would promote to the wider dtype instead).
    eps : float, optional
        Added to the mean square; ``None`` (the default) takes ``torch.finfo(input.dtype).eps``,
        as torch does.
    variant : str, keyword-only
        ``"auto"``, ``"cpu"``, ``"unfused"``, ``"fused_streaming"`` or ``"fused_registers"``.

    Returns
    -------
    torch.Tensor
        A new contiguous tensor of ``input``'s shape and dtype.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As for :func:`layer_norm`.

    Notes
    -----
    Autograd through ``torch.ops.optimized.rms_norm_bwd``, from the rstd the forward saved.

    Examples
    --------
    >>> x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    >>> optimized_ops.rms_norm(x, 4096, torch.ones(4096, device="cuda", dtype=torch.bfloat16))
    """
    y, _, _ = _ops.rms_norm_fwd.default(input, None, _normalized_shape(normalized_shape), _cast_like(weight, input),
                                        _rms_eps(input, eps), variant=variant)
    return y


def add_rms_norm(input: torch.Tensor, residual: torch.Tensor, normalized_shape: _ShapeLike,
                 weight: Optional[torch.Tensor] = None, eps: Optional[float] = None, *,
                 variant: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    r"""Residual add + RMS normalization in one pass: ``h = input + residual``, then
    ``(rms_norm(h), h)``.

    Parameters
    ----------
    input : torch.Tensor
        ``(*, *normalized_shape)``, as for :func:`rms_norm`.
    residual : torch.Tensor
        ``input``'s shape, dtype and device.
    normalized_shape, weight, eps, variant
        As for :func:`rms_norm`.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``(y, residual_out)``: ``rms_norm(h)`` and ``h`` (rounded to the dtype, and normalized as
        rounded), new contiguous tensors.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As for :func:`add_layer_norm`.

    Notes
    -----
    Autograd: ``input`` and ``residual`` receive the same gradient (the norm's ``dh`` plus the
    gradient arriving at ``residual_out``).

    Examples
    --------
    >>> h, residual = optimized_ops.add_rms_norm(mlp_out, residual, 4096, w)
    """
    y, residual_out, _ = _ops.rms_norm_fwd.default(input, residual, _normalized_shape(normalized_shape),
                                                   _cast_like(weight, input), _rms_eps(input, eps), variant=variant)
    return y, residual_out


def gelu(input: torch.Tensor, approximate: str = "none", *, variant: str = "auto") -> torch.Tensor:
    r"""GELU, as :func:`torch.nn.functional.gelu`: ``x * Phi(x)`` (``approximate="none"``, with
    ``erf``) or its ``tanh`` form.

    Parameters
    ----------
    input : torch.Tensor
        Any shape; float32, float16 or bfloat16 on CPU or CUDA, float64 on the CPU.
    approximate : str
        ``"none"`` or ``"tanh"``.
    variant : str, keyword-only
        ``"auto"``, ``"cpu"``, ``"unfused"``, ``"fused_streaming"`` or ``"fused_registers"`` (the
        two fused rungs run the same elementwise kernel).

    Returns
    -------
    torch.Tensor
        A new contiguous tensor of ``input``'s shape and dtype.

    Raises
    ------
    ValueError
        An unknown ``approximate`` or variant.
    TypeError
        Unsupported dtypes.

    Examples
    --------
    >>> optimized_ops.gelu(torch.randn(3, 5), approximate="tanh").shape
    torch.Size([3, 5])
    """
    return _ops.bias_gelu_fwd.default(input, None, approximate, variant=variant)


def bias_gelu(input: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "none", *,
              variant: str = "auto") -> torch.Tensor:
    r"""Bias add + GELU in one pass: ``gelu(input + bias)``, the epilogue of a linear layer.

    ``input + bias`` is not rounded to the dtype before the GELU (torch's two-op version rounds
    it).

    Parameters
    ----------
    input : torch.Tensor
        ``(*, n)``; float32, float16 or bfloat16 on CPU or CUDA, float64 on the CPU.
    bias : torch.Tensor or None
        ``(n,)``, broadcast over the rows; a floating dtype other than ``input``'s is cast to it.
        ``None``: plain :func:`gelu`.
    approximate : str
        ``"none"`` (erf) or ``"tanh"``.
    variant : str, keyword-only
        As for :func:`gelu`.

    Returns
    -------
    torch.Tensor
        A new contiguous tensor of ``input``'s shape and dtype.

    Raises
    ------
    ValueError
        ``bias`` not of shape ``(input.shape[-1],)``, another device, an unknown ``approximate``
        or variant.
    TypeError
        Unsupported dtypes.

    Notes
    -----
    Autograd: ``dx = dy * gelu'(x + bias)`` and ``dbias`` (the sum of ``dx`` over the rows) in one
    backward kernel, ``torch.ops.optimized.bias_gelu_bwd``.

    Examples
    --------
    >>> h = optimized_ops.bias_gelu(x @ w1.t(), b1, approximate="tanh")
    """
    return _ops.bias_gelu_fwd.default(input, _cast_like(bias, input), approximate, variant=variant)


def silu_and_mul(input: torch.Tensor, *, variant: str = "auto") -> torch.Tensor:
    r"""SwiGLU's gate: the last dimension is split into halves ``[a | b]``, and
    ``silu(a) * b`` is returned.

    Equal to ``F.silu(a) * b`` with ``a, b = input.chunk(2, dim=-1)``, computed in float32 and
    rounded once (torch's two-op version rounds ``silu(a)`` too).

    Parameters
    ----------
    input : torch.Tensor
        ``(*, 2 * d)``; float32, float16 or bfloat16 on CPU or CUDA, float64 on the CPU.
    variant : str, keyword-only
        As for :func:`gelu`.

    Returns
    -------
    torch.Tensor
        A new contiguous tensor ``(*, d)`` of ``input``'s dtype.

    Raises
    ------
    ValueError
        An odd last dimension, a 0-D input, an unknown variant.
    TypeError
        Unsupported dtypes.

    Examples
    --------
    >>> gate_up = x @ w_gate_up.t()           # (tokens, 2 * ffn)
    >>> h = optimized_ops.silu_and_mul(gate_up)  # (tokens, ffn)
    """
    return _ops.silu_and_mul_fwd.default(input, variant=variant)


# ---- fake kernels ------------------------------------------------------------------------------
# They check what the shapes and dtypes must satisfy, with the messages of the C++ glue, and
# describe the outputs exactly as the C++ kernels allocate them (contiguous, fresh).

def _msg(op: str, arg: str, text: str) -> str:
    return f"optimized::{op}: {arg}: {text}"


def _check_float(t: torch.Tensor, op: str, arg: str) -> None:
    torch._check_type(t.dtype in _FLOAT_DTYPES, lambda: _msg(
        op, arg, f"expected dtype float32, float16, bfloat16 or float64; given {_dtype_name(t.dtype)}"))


def _check_like(t: torch.Tensor, op: str, arg: str, ref: torch.Tensor, ref_arg: str, shape: bool = True) -> None:
    _check_float(t, op, arg)
    torch._check_type(t.dtype == ref.dtype, lambda: _msg(
        op, arg, f"expected dtype {_dtype_name(ref.dtype)} (same as {ref_arg}); given {_dtype_name(t.dtype)}"))
    torch._check_value(t.device == ref.device, lambda: _msg(
        op, arg, f"expected device {ref.device} (same as {ref_arg}); given {t.device}"))
    if shape:
        torch._check_value(t.shape == ref.shape, lambda: _msg(
            op, arg, f"expected shape {list(ref.shape)} (same as {ref_arg}); given {list(t.shape)}"))


def _check_variant(op: str, variant: str) -> None:
    torch._check_value(variant in _VARIANTS, lambda: _msg(
        op, "variant", f"expected one of {', '.join(_VARIANTS)}; given '{variant}'"))


def _check_approximate(op: str, approximate: str) -> None:
    torch._check_value(approximate in ("none", "tanh"), lambda: _msg(
        op, "approximate", f"expected 'none' or 'tanh'; given '{approximate}'"))


def _softmax_like(x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
    n = max(x.dim(), 1)
    torch._check_value(-n <= dim < n, lambda: _msg(
        op, "dim", f"expected a dimension in [{-n}, {n - 1}]; given {dim}"))
    if x.dim() == 0:
        return x.new_empty(())
    d = dim % n
    shape = list(x.shape)
    moved = shape[:d] + shape[d + 1:] + [shape[d]]
    return x.new_empty(moved).movedim(-1, d)


def _fake_softmax_fwd(op):
    def fake(x, dim=-1, scale=1.0, *, variant="auto"):
        _check_float(x, op, "x")
        _check_variant(op, variant)
        return _softmax_like(x, dim, op)
    return fake


def _fake_softmax_bwd(op):
    def fake(y, dy, dim=-1, scale=1.0, *, variant="auto"):
        _check_float(y, op, "y")
        _check_like(dy, op, "dy", y, "y")
        _check_variant(op, variant)
        return _softmax_like(y, dim, op)
    return fake


for _name in ("softmax", "log_softmax"):
    torch.library.register_fake(f"optimized::{_name}_fwd", _fake_softmax_fwd(f"{_name}_fwd"))
    torch.library.register_fake(f"optimized::{_name}_bwd", _fake_softmax_bwd(f"{_name}_bwd"))


def _check_norm(op: str, x: torch.Tensor, x_arg: str, normalized_shape, weight, bias=None) -> list:
    """Checks a norm's operands; returns the row dimensions x.shape[:-len(normalized_shape)]."""
    ns = list(normalized_shape)
    k = len(ns)
    torch._check_value(k >= 1, lambda: _msg(op, "normalized_shape", "expected at least one dimension; given []"))
    torch._check_value(x.dim() >= k and list(x.shape[x.dim() - k:]) == ns, lambda: _msg(
        op, x_arg, f"expected a shape ending in {ns} (normalized_shape); given {list(x.shape)}"))
    for t, arg in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check_like(t, op, arg, x, "x", shape=False)
            torch._check_value(list(t.shape) == ns, lambda: _msg(
                op, arg, f"expected shape {ns} (normalized_shape); given {list(t.shape)}"))
    return list(x.shape[:x.dim() - k])


def _check_stats(op: str, t: torch.Tensor, arg: str, rows: list, ref: torch.Tensor) -> None:
    torch._check_type(t.dtype == torch.float32, lambda: _msg(
        op, arg, f"expected dtype float32 (the statistics saved by the forward); given {_dtype_name(t.dtype)}"))
    torch._check_value(list(t.shape) == rows, lambda: _msg(
        op, arg, f"expected shape {rows} (the leading dimensions); given {list(t.shape)}"))
    torch._check_value(t.device == ref.device, lambda: _msg(
        op, arg, f"expected device {ref.device}; given {t.device}"))


@torch.library.register_fake("optimized::layer_norm_fwd")
def _layer_norm_fwd_fake(x, residual, normalized_shape, weight, bias, eps, *, variant="auto"):
    op = "layer_norm_fwd"
    _check_float(x, op, "x")
    rows = _check_norm(op, x, "x", normalized_shape, weight, bias)
    if residual is not None:
        _check_like(residual, op, "residual", x, "x")
    _check_variant(op, variant)
    residual_out = x.new_empty(x.shape) if residual is not None else None
    stats = dict(dtype=torch.float32)
    return x.new_empty(x.shape), residual_out, x.new_empty(rows, **stats), x.new_empty(rows, **stats)


@torch.library.register_fake("optimized::rms_norm_fwd")
def _rms_norm_fwd_fake(x, residual, normalized_shape, weight, eps, *, variant="auto"):
    op = "rms_norm_fwd"
    _check_float(x, op, "x")
    rows = _check_norm(op, x, "x", normalized_shape, weight)
    if residual is not None:
        _check_like(residual, op, "residual", x, "x")
    _check_variant(op, variant)
    residual_out = x.new_empty(x.shape) if residual is not None else None
    return x.new_empty(x.shape), residual_out, x.new_empty(rows, dtype=torch.float32)


@torch.library.register_fake("optimized::layer_norm_bwd")
def _layer_norm_bwd_fake(dy, h, normalized_shape, weight, mean, rstd, dresidual_out, compute_dweight,
                         compute_dbias, *, variant="auto"):
    op = "layer_norm_bwd"
    _check_float(h, op, "h")
    _check_like(dy, op, "dy", h, "h")
    rows = _check_norm(op, h, "h", normalized_shape, weight)
    _check_stats(op, mean, "mean", rows, h)
    _check_stats(op, rstd, "rstd", rows, h)
    if dresidual_out is not None:
        _check_like(dresidual_out, op, "dresidual_out", h, "h")
    _check_variant(op, variant)
    ns = list(normalized_shape)
    return (h.new_empty(h.shape), h.new_empty(ns) if compute_dweight else None,
            h.new_empty(ns) if compute_dbias else None)


@torch.library.register_fake("optimized::rms_norm_bwd")
def _rms_norm_bwd_fake(dy, h, normalized_shape, weight, rstd, dresidual_out, compute_dweight, *, variant="auto"):
    op = "rms_norm_bwd"
    _check_float(h, op, "h")
    _check_like(dy, op, "dy", h, "h")
    rows = _check_norm(op, h, "h", normalized_shape, weight)
    _check_stats(op, rstd, "rstd", rows, h)
    if dresidual_out is not None:
        _check_like(dresidual_out, op, "dresidual_out", h, "h")
    _check_variant(op, variant)
    return h.new_empty(h.shape), h.new_empty(list(normalized_shape)) if compute_dweight else None


def _check_bias(op: str, bias: torch.Tensor, x: torch.Tensor) -> None:
    _check_like(bias, op, "bias", x, "x", shape=False)
    torch._check_value(x.dim() >= 1, lambda: _msg(
        op, "x", "expected at least 1 dimension with a bias; given a 0-D tensor"))
    torch._check_value(bias.dim() == 1 and bias.shape[0] == x.shape[-1], lambda: _msg(
        op, "bias", f"expected shape [{x.shape[-1]}] (x's last dimension); given {list(bias.shape)}"))


@torch.library.register_fake("optimized::bias_gelu_fwd")
def _bias_gelu_fwd_fake(x, bias, approximate="none", *, variant="auto"):
    op = "bias_gelu_fwd"
    _check_float(x, op, "x")
    if bias is not None:
        _check_bias(op, bias, x)
    _check_approximate(op, approximate)
    _check_variant(op, variant)
    return x.new_empty(x.shape)


@torch.library.register_fake("optimized::bias_gelu_bwd")
def _bias_gelu_bwd_fake(dy, x, bias, approximate, compute_dbias, *, variant="auto"):
    op = "bias_gelu_bwd"
    _check_float(x, op, "x")
    _check_like(dy, op, "dy", x, "x")
    if bias is not None:
        _check_bias(op, bias, x)
    torch._check_value(not compute_dbias or x.dim() >= 1, lambda: _msg(
        op, "compute_dbias", "expected False for a 0-D x (no bias dimension); given True"))
    _check_approximate(op, approximate)
    _check_variant(op, variant)
    return x.new_empty(x.shape), x.new_empty([x.shape[-1]]) if compute_dbias else None


def _check_halves(op: str, x: torch.Tensor) -> list:
    torch._check_value(x.dim() >= 1, lambda: _msg(
        op, "x", "expected at least 1 dimension (..., 2 * d); given a 0-D tensor"))
    torch._check_value(x.shape[-1] % 2 == 0, lambda: _msg(
        op, "x", f"expected an even last dimension (2 * d, the halves [a | b]); given shape {list(x.shape)}"))
    return [*x.shape[:-1], x.shape[-1] // 2]


@torch.library.register_fake("optimized::silu_and_mul_fwd")
def _silu_and_mul_fwd_fake(x, *, variant="auto"):
    op = "silu_and_mul_fwd"
    _check_float(x, op, "x")
    out = _check_halves(op, x)
    _check_variant(op, variant)
    return x.new_empty(out)


@torch.library.register_fake("optimized::silu_and_mul_bwd")
def _silu_and_mul_bwd_fake(dy, x, *, variant="auto"):
    op = "silu_and_mul_bwd"
    _check_float(x, op, "x")
    out = _check_halves(op, x)
    _check_like(dy, op, "dy", x, "x", shape=False)
    torch._check_value(list(dy.shape) == out, lambda: _msg(
        op, "dy", f"expected shape {out} (x's with the last dimension halved); given {list(dy.shape)}"))
    _check_variant(op, variant)
    return x.new_empty(x.shape)


# ---- forward mode: the jvp rules ---------------------------------------------------------------
# jvp(inputs, keyword_only_inputs, output, tangents) -> output tangents (see _autograd.py), for every
# forward and backward op, so that torch.func.jvp / jacfwd / hessian and torch.autograd.forward_ad
# give real tangents. softmax's rule is softmax_bwd itself: its Jacobian is symmetric, so its vjp
# (what softmax_bwd computes, on the same kernels and variant) is its jvp. The others are formulas in
# float32 (float64 for float64 operands), rounded once to the output's dtype. A tangent that is None
# counts as zero. Norms: mean / rstd are outputs without tangent (non-differentiable, as in the
# backward); the rules of the *_bwd ops read them as the statistics of h (which they are), so their
# dependence on h is differentiated through h, as the double backward does.

def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """a + b where None is zero."""
    return b if a is None else a if b is None else a + b


def _mul(a: Optional[torch.Tensor], b: torch.Tensor) -> Optional[torch.Tensor]:
    return None if a is None else a * b


def _to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def _full(t: Optional[torch.Tensor], shape) -> Optional[torch.Tensor]:
    """t broadcast to the output's shape (a bias's tangent alone has the bias's shape)."""
    return t if t is None or t.shape == shape else t.expand(shape)


def _softmax_jvp(log: bool):
    def jvp(inputs, keyword_only_inputs, y, tangents):
        _, dim, scale = inputs
        tx = tangents[0]
        if tx is None:
            return None
        if not log:
            # s * y * (tx - sum(y * tx)): exactly what softmax_bwd computes for dy = tx.
            return _ops.softmax_bwd.default(y, tx, dim, scale,
                                            variant=_backward_variant(keyword_only_inputs.get("variant", "auto")))
        c = compute_dtype(y)
        # log_softmax: s * (tx - sum(softmax * tx)), softmax = exp(y)
        txc = tx.to(c)
        return (kernel_scalar(scale, c) * (txc - (y.to(c).exp() * txc).sum(dim, keepdim=True))).to(y.dtype)
    return jvp


def _norm_jvp(layer: bool):
    """y = xhat * w + b with xhat = (h - mean(h)) * rstd (layer) or h * rstd (rms), h = x (+ residual):
    t_xhat = rstd * (t_hc - xhat * mean(xhat * t_h)) with t_hc = t_h - mean(t_h) (layer) or t_h (rms),
    t_y = t_xhat * w + xhat * t_w + t_b, t_residual_out = t_h. The statistics are recomputed from h
    in the compute dtype (float64 ones for float64)."""
    def jvp(inputs, keyword_only_inputs, output, tangents):
        if layer:
            x, residual, ns, weight, bias, eps = inputs
            tx, tr, _, tw, tb, _ = tangents
        else:
            x, residual, ns, weight, eps = inputs
            tx, tr, _, tw, _ = tangents
            tb = None
        residual_out = output[1]
        h = residual_out if residual is not None else x
        th = _add(tx, tr) if residual is not None else tx
        dims = tuple(range(-len(ns), 0))
        c = compute_dtype(h)
        hc = h.to(c)
        centered = hc - hc.mean(dims, keepdim=True) if layer else hc
        rstd = ((centered * centered).mean(dims, keepdim=True) + kernel_scalar(eps, c)).rsqrt()
        xhat = centered * rstd
        ty = None
        if th is not None:
            thc = th.to(c)
            thc_centered = thc - thc.mean(dims, keepdim=True) if layer else thc
            ty = rstd * (thc_centered - xhat * (xhat * thc).mean(dims, keepdim=True))
            if weight is not None:
                ty = ty * weight.to(c)
        ty = _add(ty, _mul(_to(tw, c), xhat))
        ty = _add(ty, _to(tb, c))
        ty = _full(_to(ty, x.dtype), x.shape)
        t_residual_out = None if residual is None else th
        return (ty, t_residual_out, None, None) if layer else (ty, t_residual_out, None)
    return jvp


def _bias_gelu_jvp(inputs, keyword_only_inputs, y, tangents):
    """gelu'(z) * (t_x + t_bias), z = x + bias (the kernel's math: z not rounded). bias_gelu_bwd computes
    the same product, but returns (dx, None), which the legacy vmap of gradcheck's batched checks and
    torch.autograd.functional cannot batch: a formula here."""
    x, bias, approximate = inputs
    tz = _add(tangents[0], tangents[1])
    if tz is None:
        return None
    c = compute_dtype(x)
    z = x.to(c) if bias is None else x.to(c) + bias.to(c)
    return _full((_gelu_derivatives(z, approximate)[0] * tz.to(c)).to(x.dtype), x.shape)


def _silu_derivatives(a: torch.Tensor):
    """silu(a), silu'(a), silu''(a)."""
    s = torch.sigmoid(a)
    return a * s, s * (1 + a * (1 - s)), s * (1 - s) * (2 + a * (1 - 2 * s))


def _silu_and_mul_jvp(inputs, keyword_only_inputs, y, tangents):
    x, tx = inputs[0], tangents[0]
    if tx is None:
        return None
    c = compute_dtype(x)
    a, b = x.to(c).chunk(2, dim=-1)
    ta, tb = tx.to(c).chunk(2, dim=-1)
    silu, dsilu, _ = _silu_derivatives(a)
    return (dsilu * b * ta + silu * tb).to(x.dtype)


def _softmax_bwd_jvp(log: bool):
    """softmax_bwd: dx = s * y * (dy - sum(dy * y)); log_softmax_bwd: dx = s * (dy - exp(y) * sum(dy))."""
    def jvp(inputs, keyword_only_inputs, dx, tangents):
        y, dy, dim, scale = inputs
        ty, tdy = tangents[0], tangents[1]
        if ty is None and tdy is None:
            return None
        c = compute_dtype(y)
        yc, dyc = y.to(c), dy.to(c)
        tyc, tdyc = _to(ty, c), _to(tdy, c)

        def total(t):
            return t.sum(dim, keepdim=True)

        t = None
        if log:
            p = yc.exp()
            if tyc is not None:
                t = -p * tyc * total(dyc)
            if tdyc is not None:
                t = _add(t, tdyc - p * total(tdyc))
        else:
            if tyc is not None:
                t = tyc * (dyc - total(dyc * yc)) - yc * total(dyc * tyc)
            if tdyc is not None:
                t = _add(t, yc * (tdyc - total(tdyc * yc)))
        return (kernel_scalar(scale, t.dtype) * t).to(dx.dtype)
    return jvp


def _norm_bwd_jvp(layer: bool):
    """dx = r * A + dresidual_out with A = g - mean(g) - xhat * mean(g * xhat) (rms: no mean(g) term),
    g = dy * w, xhat = (h - mean(h)) * r (rms: h * r), r the saved rstd; dweight = sum_rows(dy * xhat),
    dbias = sum_rows(dy). The tangents, with r a function of h (t_r = -r^2 * mean(xhat * t_h)):
    t_xhat = r * (t_hc - xhat * mean(xhat * t_h)), t_g = t_dy * w + dy * t_w,
    t_A = t_g - mean(t_g) - t_xhat * mean(g * xhat) - xhat * mean(t_g * xhat + g * t_xhat),
    t_dx = t_r * A + r * t_A + t_dresidual_out."""
    def jvp(inputs, keyword_only_inputs, output, tangents):
        if layer:
            dy, h, ns, weight, _, rstd, dresidual_out, _, _ = inputs
            tdy, th, _, tw, _, _, tdres, _, _ = tangents
        else:
            dy, h, ns, weight, rstd, dresidual_out, _ = inputs
            tdy, th, _, tw, _, tdres, _ = tangents
        k = len(ns)
        dims = tuple(range(-k, 0))
        rows = tuple(range(h.dim() - k))
        c = compute_dtype(h)

        def mean(t):
            return t.mean(dims, keepdim=True)

        hc, dyc = h.to(c), dy.to(c)
        w = _to(weight, c)
        r = rstd.to(c).reshape(*rstd.shape, *([1] * k))
        xhat = (hc - mean(hc) if layer else hc) * r
        g = dyc * w if w is not None else dyc
        mgx = mean(g * xhat)
        a = g - xhat * mgx
        if layer:
            a = a - mean(g)
        txhat = tr = None
        if th is not None:
            thc = th.to(c)
            m = mean(xhat * thc)
            txhat = r * ((thc - mean(thc) if layer else thc) - xhat * m)
            tr = -r * r * m
        tdyc = _to(tdy, c)
        tg = _add(tdyc if w is None else _mul(tdyc, w), _mul(_to(tw, c), dyc))
        ta = None
        if tg is not None:
            ta = tg - xhat * mean(tg * xhat)
            if layer:
                ta = ta - mean(tg)
        if txhat is not None:
            ta = _add(ta, -txhat * mgx - xhat * mean(g * txhat))
        tdx = _add(_mul(tr, a), _mul(ta, r))
        tdx = _add(tdx, _to(tdres, c))
        tdx = _full(_to(tdx, h.dtype), h.shape)
        dweight = output[1]
        tdweight = None
        if dweight is not None:
            tdweight = _add(_mul(tdyc, xhat), _mul(txhat, dyc))
            tdweight = None if tdweight is None else tdweight.sum(rows).to(dweight.dtype)
        if not layer:
            return tdx, tdweight
        dbias = output[2]
        tdbias = None if dbias is None or tdy is None else tdy.sum(rows).to(dbias.dtype)
        return tdx, tdweight, tdbias
    return jvp


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_A = 0.044715


def _gelu_derivatives(z: torch.Tensor, approximate: str):
    """gelu'(z), gelu''(z): erf form Phi + z phi and phi * (2 - z^2); tanh form with
    u = k (z + a z^3), T = tanh(u): 0.5 (1 + T) + 0.5 z (1 - T^2) u' and (1 - T^2) (u' - z T u'^2 + 0.5 z u'')."""
    if approximate == "tanh":
        du = _SQRT_2_OVER_PI * (1 + 3 * _GELU_TANH_A * z * z)
        d2u = _SQRT_2_OVER_PI * 6 * _GELU_TANH_A * z
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_A * z * z * z))
        sech2 = 1 - t * t
        return 0.5 * (1 + t) + 0.5 * z * sech2 * du, sech2 * (du - z * t * du * du + 0.5 * z * d2u)
    phi = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2.0)))
    return cdf + z * phi, phi * (2 - z * z)


def _bias_gelu_bwd_jvp(inputs, keyword_only_inputs, output, tangents):
    """dx = dy * gelu'(z), z = x + bias; dbias = sum_rows(dx):
    t_dx = t_dy * gelu'(z) + dy * gelu''(z) * (t_x + t_bias)."""
    dy, x, bias, approximate, _ = inputs
    tdy, tx, tb = tangents[:3]
    tz = _add(tx, tb)
    if tdy is None and tz is None:
        return None, None
    c = compute_dtype(x)
    z = x.to(c) if bias is None else x.to(c) + bias.to(c)
    d1, d2 = _gelu_derivatives(z, approximate)
    tdx = _add(_mul(_to(tdy, c), d1), _mul(_to(tz, c), dy.to(c) * d2))
    tdbias = None if output[1] is None else tdx.sum(tuple(range(x.dim() - 1))).to(output[1].dtype)
    return _full(tdx.to(x.dtype), x.shape), tdbias


def _silu_and_mul_bwd_jvp(inputs, keyword_only_inputs, dx, tangents):
    """dx = [dy * b * silu'(a) | dy * silu(a)] for x = [a | b]."""
    dy, x = inputs
    tdy, tx = tangents
    if tdy is None and tx is None:
        return None
    c = compute_dtype(x)
    dyc = dy.to(c)
    a, b = x.to(c).chunk(2, dim=-1)
    silu, d1, d2 = _silu_derivatives(a)
    tda = tdb = None
    if tdy is not None:
        tdyc = tdy.to(c)
        tda, tdb = tdyc * b * d1, tdyc * silu
    if tx is not None:
        ta, tb = tx.to(c).chunk(2, dim=-1)
        tda = _add(tda, dyc * (tb * d1 + b * d2 * ta))
        tdb = _add(tdb, dyc * d1 * ta)
    return torch.cat([tda, tdb], dim=-1).to(x.dtype)


# ---- autograd of the forward ops: backward on the *_bwd ops ------------------------------------

def _softmax_autograd(name: str):
    bwd = getattr(_ops, f"{name}_bwd").default

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        _, ctx.dim, ctx.scale = inputs
        ctx.variant = _backward_variant(keyword_only_inputs.get("variant", "auto"))
        ctx.save_for_backward(output)  # the backward works from the output y

    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return bwd(y, dy, ctx.dim, ctx.scale, variant=ctx.variant), None, None

    register_autograd(f"optimized::{name}_fwd", backward, setup_context=setup_context,
                      jvp=_softmax_jvp(name == "log_softmax"), batching=True)


_softmax_autograd("softmax")
_softmax_autograd("log_softmax")


def _norm_setup(layer: bool):
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        if layer:
            _, residual, ns, weight, _, _ = inputs
            _, residual_out, mean, rstd = output
        else:
            _, residual, ns, weight, _ = inputs
            _, residual_out, rstd = output
            mean = None
        x = inputs[0]
        ctx.normalized_shape = list(ns)
        ctx.variant = _backward_variant(keyword_only_inputs.get("variant", "auto"))
        # The backward normalizes what the forward normalized: x, or h = x + residual as rounded.
        h = residual_out if residual is not None else x
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
        ctx.set_materialize_grads(False)  # a None gradient (output unused) costs no zeros
    return setup_context


def _layer_norm_backward(ctx, dy, dresidual_out, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    need_x, need_residual, _, need_weight, need_bias, _ = _needs(ctx, 6)
    dweight = dbias = None
    if dy is None:  # only residual_out was used
        dx = dresidual_out
    else:
        dx, dweight, dbias = _ops.layer_norm_bwd.default(
            dy, h, ctx.normalized_shape, weight, mean, rstd, dresidual_out, need_weight and weight is not None,
            need_bias, variant=ctx.variant)
    return dx if need_x else None, dx if need_residual else None, None, dweight, dbias, None


def _rms_norm_backward(ctx, dy, dresidual_out, _drstd):
    h, weight, _, rstd = ctx.saved_tensors
    need_x, need_residual, _, need_weight, _ = _needs(ctx, 5)
    dweight = None
    if dy is None:
        dx = dresidual_out
    else:
        dx, dweight = _ops.rms_norm_bwd.default(dy, h, ctx.normalized_shape, weight, rstd, dresidual_out,
                                                need_weight and weight is not None, variant=ctx.variant)
    return dx if need_x else None, dx if need_residual else None, None, dweight, None


register_autograd("optimized::layer_norm_fwd", _layer_norm_backward, setup_context=_norm_setup(True),
                  jvp=_norm_jvp(True), batching=True)
register_autograd("optimized::rms_norm_fwd", _rms_norm_backward, setup_context=_norm_setup(False),
                  jvp=_norm_jvp(False), batching=True)


def _bias_gelu_setup(ctx, inputs, keyword_only_inputs, output):
    x, bias, ctx.approximate = inputs
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.save_for_backward(x, bias)


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    need_x, need_bias, _ = _needs(ctx, 3)
    dx, dbias = _ops.bias_gelu_bwd.default(dy, x, bias, ctx.approximate, need_bias, variant=ctx.variant)
    return dx if need_x else None, dbias, None


register_autograd("optimized::bias_gelu_fwd", _bias_gelu_backward, setup_context=_bias_gelu_setup,
                  jvp=_bias_gelu_jvp, batching=True)


def _silu_and_mul_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.save_for_backward(inputs[0])


def _silu_and_mul_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _ops.silu_and_mul_bwd.default(dy, x, variant=ctx.variant)


register_autograd("optimized::silu_and_mul_fwd", _silu_and_mul_backward, setup_context=_silu_and_mul_setup,
                  jvp=_silu_and_mul_jvp, batching=True)


# ---- autograd of the backward ops (double backward) --------------------------------------------
# The derivative of each *_bwd op is the vector-Jacobian product of a composite formula of the same
# math, taken by torch's autograd in float32 (float64 for float64 operands). The norms' formulas
# recompute the statistics from h, except that rstd keeps the saved value
# (r = rsqrt(var - var.detach() + rstd^-2): the saved rstd, with the derivative of rsqrt(var + eps)).

_NO_THIRD_DERIVATIVE = ("optimized_ops: the fused ops are differentiable twice in reverse mode (their double "
                        "backward is a composite formula); a third derivative is not supported through it (forward "
                        "mode over forward mode and forward mode over one backward are)")


class _NoThirdDerivative(torch.autograd.Function):
    """Passes the second-order gradients through (copies, tied to the tensors that carry the graph)
    and raises if they are differentiated again (in the style torch.func requires: setup_context, and
    a vmap rule, as jacrev vmaps over the backward)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(count, *tensors):
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_THIRD_DERIVATIVE)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_THIRD_DERIVATIVE)


def _differentiable_once_more(backward):
    """For the backward of a *_bwd op: under create_graph, or with forward-mode tangents, ties its
    results to the saved operands and incoming gradients through _NoThirdDerivative, so that a third
    derivative raises instead of silently missing terms (torch's once_differentiable does not catch
    this case: its error node hangs off fresh leaves, which autograd.grad(..., inputs) prunes)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        operands = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor)]
        grad_mode = torch.is_grad_enabled()
        tracked = [t for t in operands if (grad_mode and t.requires_grad) or has_tangent((t,))]
        present = [t for t in outputs if t is not None]
        if not tracked or not present:
            return outputs
        tied = iter(_NoThirdDerivative.apply(len(present), *present, *tracked))
        return tuple(None if t is None else next(tied) for t in outputs)
    return wrapper


def _vjp(fn, primals, cotangents):
    """The vector-Jacobian product of fn at primals (torch.func.vjp: it works inside the torch.func
    transforms too, where requires_grad_ and autograd.grad do not)."""
    _, vjp_fn = torch.func.vjp(fn, *primals)
    return vjp_fn(cotangents)


def _composite_vjp(fn, tensors, needs, grads):
    """Gradients of ``fn(*tensors)`` (a tuple of tensors or None) with respect to the tensors whose
    ``needs`` is True, given ``grads`` for its outputs; in the dtypes of ``tensors``."""
    compute = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    values = [None if t is None else t.detach().to(compute) for t in tensors]
    wrt = [k for k, (v, need) in enumerate(zip(values, needs)) if need and v is not None and v.dtype.is_floating_point]
    result = [None] * len(tensors)
    if not wrt:
        return result

    present = []  # which outputs fn returns (the others are None)

    def of_wrt(*diff):
        full = list(values)
        for k, d in zip(wrt, diff):
            full[k] = d
        outs = fn(*full)
        present[:] = [o is not None for o in outs]
        return tuple(o for o in outs if o is not None)

    outs, vjp_fn = torch.func.vjp(of_wrt, *(values[k] for k in wrt))
    given = [g for g, p in zip(grads, present) if p]
    cotangents = tuple(torch.zeros_like(o) if g is None else g.to(compute) for o, g in zip(outs, given))
    for k, g in zip(wrt, vjp_fn(cotangents)):
        result[k] = g.to(tensors[k].dtype)
    return result


def _softmax_bwd_math(log: bool, dim: int, scale: float):
    def fn(y, dy):
        if log:
            return (scale * (dy - y.exp() * dy.sum(dim, keepdim=True)),)
        return (scale * y * (dy - (dy * y).sum(dim, keepdim=True)),)
    return fn


def _register_softmax_double_backward(name: str, log: bool):
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        y, dy, ctx.dim, ctx.scale = inputs
        ctx.save_for_backward(y, dy)

    @_differentiable_once_more
    def backward(ctx, g):
        y, dy = ctx.saved_tensors
        fn = _softmax_bwd_math(log, ctx.dim, ctx.scale)
        gy, gdy = _composite_vjp(fn, (y, dy), _needs(ctx, 4)[:2], (g,))
        return gy, gdy, None, None

    register_autograd(f"optimized::{name}_bwd", backward, setup_context=setup_context, jvp=_softmax_bwd_jvp(log),
                      batching=True)


_register_softmax_double_backward("softmax", False)
_register_softmax_double_backward("log_softmax", True)


def _norm_bwd_math(layer: bool, k: int, want_dweight: bool, want_dbias: bool):
    dims = tuple(range(-k, 0))

    def fn(dy, h, weight, rstd, dresidual_out):
        def normalized(h, *weight):
            c = h - h.mean(dims, keepdim=True) if layer else h
            var = (c * c).mean(dims, keepdim=True)
            r = (var - var.detach() + rstd.reshape(*rstd.shape, *([1] * k)).pow(-2)).rsqrt()
            return c * r * weight[0] if weight else c * r

        grads = _vjp(normalized, (h, weight) if weight is not None else (h,), dy)
        dx = grads[0] if dresidual_out is None else grads[0] + dresidual_out
        dweight = grads[1] if want_dweight and weight is not None else None
        dbias = dy.sum(tuple(range(dy.dim() - k))) if want_dbias else None
        return dx, dweight, dbias
    return fn


def _layer_norm_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    dy, h, ns, weight, mean, rstd, dresidual_out, ctx.want_dweight, ctx.want_dbias = inputs
    ctx.k = len(ns)
    ctx.save_for_backward(dy, h, weight, rstd, dresidual_out)


@_differentiable_once_more
def _layer_norm_bwd_backward(ctx, gdx, gdweight, gdbias):
    dy, h, weight, rstd, dresidual_out = ctx.saved_tensors
    n = _needs(ctx, 9)
    fn = _norm_bwd_math(True, ctx.k, ctx.want_dweight, ctx.want_dbias)
    g_dy, g_h, g_w, _, g_dres = _composite_vjp(fn, (dy, h, weight, rstd, dresidual_out),
                                               (n[0], n[1], n[3], False, n[6]), (gdx, gdweight, gdbias))
    return g_dy, g_h, None, g_w, None, None, g_dres, None, None


def _rms_norm_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    dy, h, ns, weight, rstd, dresidual_out, ctx.want_dweight = inputs
    ctx.k = len(ns)
    ctx.save_for_backward(dy, h, weight, rstd, dresidual_out)


@_differentiable_once_more
def _rms_norm_bwd_backward(ctx, gdx, gdweight):
    dy, h, weight, rstd, dresidual_out = ctx.saved_tensors
    n = _needs(ctx, 7)
    fn = _norm_bwd_math(False, ctx.k, ctx.want_dweight, False)
    g_dy, g_h, g_w, _, g_dres = _composite_vjp(fn, (dy, h, weight, rstd, dresidual_out),
                                               (n[0], n[1], n[3], False, n[5]), (gdx, gdweight, None))
    return g_dy, g_h, None, g_w, None, g_dres, None


register_autograd("optimized::layer_norm_bwd", _layer_norm_bwd_backward, setup_context=_layer_norm_bwd_setup,
                  jvp=_norm_bwd_jvp(True), batching=True)
register_autograd("optimized::rms_norm_bwd", _rms_norm_bwd_backward, setup_context=_rms_norm_bwd_setup,
                  jvp=_norm_bwd_jvp(False), batching=True)


def _bias_gelu_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    dy, x, bias, ctx.approximate, ctx.want_dbias = inputs
    ctx.save_for_backward(dy, x, bias)


@_differentiable_once_more
def _bias_gelu_bwd_backward(ctx, gdx, gdbias):
    dy, x, bias = ctx.saved_tensors
    approximate, want_dbias = ctx.approximate, ctx.want_dbias

    def fn(dy, x, bias):
        (dx,) = _vjp(lambda x: F.gelu(x if bias is None else x + bias, approximate=approximate), (x,), dy)
        return dx, dx.sum(tuple(range(dx.dim() - 1))) if want_dbias else None

    n = _needs(ctx, 5)
    g_dy, g_x, g_b = _composite_vjp(fn, (dy, x, bias), n[:3], (gdx, gdbias))
    return g_dy, g_x, g_b, None, None


register_autograd("optimized::bias_gelu_bwd", _bias_gelu_bwd_backward, setup_context=_bias_gelu_bwd_setup,
                  jvp=_bias_gelu_bwd_jvp, batching=True)


def _silu_mul_of(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def _silu_and_mul_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)


@_differentiable_once_more
def _silu_and_mul_bwd_backward(ctx, gdx):
    dy, x = ctx.saved_tensors

    def fn(dy, x):
        (dx,) = _vjp(_silu_mul_of, (x,), dy)
        return (dx,)

    g_dy, g_x = _composite_vjp(fn, (dy, x), _needs(ctx, 2), (gdx,))
    return g_dy, g_x


register_autograd("optimized::silu_and_mul_bwd", _silu_and_mul_bwd_backward, setup_context=_silu_and_mul_bwd_setup,
                  jvp=_silu_and_mul_bwd_jvp, batching=True)
