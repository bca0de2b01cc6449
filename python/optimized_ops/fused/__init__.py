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
``"triton"``            CUDA    softmax, layer_norm, rms_norm written in Triton
                                (``optimized_ops/triton/``; CPU tensors under
                                ``TRITON_INTERPRET=1``); not in the C++ table:
                                ``variants("fused", detail=True)`` lists it with its
                                availability
======================  ======  ===========================================================

The package is split by what torch needs around the C++ ops:

* ``fused/__init__.py`` (here): the functions and the ladder's queries;
* ``fused/_fakes.py``: fake kernels (``register_fake``) for every op, so that
  ``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors trace through them. They
  compute the outputs' shapes, dtypes and layouts; checking the arguments is the C++ library's;
* ``fused/_autograd.py``: autograd (``optimized_ops._autograd.register_autograd``) for every forward
  op, whose backward calls the matching ``*_bwd`` op (the same kernels, the same variant), and whose
  forward-mode rule (jvp) gives ``torch.autograd.forward_ad`` and ``torch.func`` (jvp, jacfwd,
  hessian, vmap) real tangents; autograd for every ``*_bwd`` op as well, so that double backward
  works (``gradgradcheck``): the derivative of a backward is the vector-Jacobian product of a
  composite formula of the same math (in float32, or float64 for float64 inputs), differentiable
  once more, not twice: third-order gradients through it raise. The ``*_bwd`` ops have jvp rules too
  (``hessian`` is forward mode over them), and forward mode composes to any order; batching rules (a
  loop over the batch) for every op: torch's vmap fallback cannot stack their optional outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

from .. import triton as _triton
from .._library import load
from .._variants import register_family, register_rung

_lib = load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized

_ShapeLike = Union[int, Sequence[int], torch.Size]


# ---- the ladder ------------------------------------------------------------------------------

def fused_variants() -> list[str]:
    """Names of the variants of the fused family, CPU then CUDA, naive to best (``"auto"`` excluded):
    the C++ table, through ``torch.ops.optimized.fused_variants()``; the same list as
    ``optimized_ops.variants("fused")``.

    Returns
    -------
    list of str
        ``["cpu", "unfused", "fused_streaming", "fused_registers"]``.
    """
    return list(_ops.fused_variants())


_VARIANTS = ("auto", *fused_variants())
register_family("fused", fused_variants)
register_rung("fused", "triton", "triton", _triton.availability)

_TRITON_OPS = "softmax, layer_norm, rms_norm"


def _no_triton(op: str, variant: str) -> None:
    """A clear error for variant="triton" of an op that has no Triton rung (yet)."""
    if variant == "triton":
        raise ValueError(f"optimized::{op}: variant triton: this op has no Triton rung (the fused family's "
                         f"Triton rungs: {_TRITON_OPS}); use auto, cpu, unfused, fused_streaming or fused_registers")


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

def _normalized_shape(normalized_shape: _ShapeLike) -> list:
    if isinstance(normalized_shape, (int, torch.SymInt)):
        return [normalized_shape]
    return list(normalized_shape)


def _cast_like(t: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
    """weight / bias in x's dtype (a differentiable cast; the kernels take one dtype per call)."""
    if t is None or t.dtype == x.dtype or not (t.dtype.is_floating_point and x.dtype.is_floating_point):
        return t
    return t.to(x.dtype)


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
        ``"auto"``, ``"cpu"``, ``"unfused"``, ``"fused_streaming"``, ``"fused_registers"`` or
        ``"triton"`` (optimized_ops/triton/softmax.py; NotImplementedError with the reason where
        Triton cannot run).

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
    NotImplementedError
        A dtype other than float32, float16, bfloat16 and float64; float64 on a CUDA variant; a
        width beyond ``fused_registers``; CUDA tensors with a CPU-only build.

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
    if variant == "triton":
        return _triton.ops.softmax(input, dim, scale)
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
    ValueError, NotImplementedError
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
    _no_triton("log_softmax_fwd", variant)
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
        Added to the variance; >= 0.
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
        of another shape or device, an empty ``normalized_shape``, a negative or NaN ``eps``, an
        unknown variant. The message names the op and the argument.
    NotImplementedError
        A dtype other than float32, float16, bfloat16 and float64; float64 on a CUDA variant, a
        row too long for ``fused_registers``, CUDA tensors with a CPU-only build.

    Notes
    -----
    Autograd gives ``input``, ``weight`` and ``bias`` their gradients through
    ``torch.ops.optimized.layer_norm_bwd`` (one pass; ``dweight`` and ``dbias`` only when asked
    for), from the mean and rstd the forward saved (float32; float64 for float64 input, so float64
    gradients are float64-accurate).

    Examples
    --------
    >>> x = torch.randn(8, 128, 1024, device="cuda", dtype=torch.bfloat16)
    >>> w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    >>> optimized_ops.layer_norm(x, (1024,), w, torch.zeros_like(w)).shape
    torch.Size([8, 128, 1024])
    """
    if variant == "triton":
        return _triton.ops.layer_norm(input, _normalized_shape(normalized_shape), _cast_like(weight, input),
                                      _cast_like(bias, input), eps)
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
    ValueError, NotImplementedError
        As for :func:`layer_norm`; ``residual`` of another shape, dtype or device (ValueError).

    Notes
    -----
    Autograd: ``input`` and ``residual`` receive the same gradient, the layer norm's ``dh`` plus
    the gradient arriving at ``residual_out``, summed inside the backward kernel.

    Examples
    --------
    >>> y, residual = optimized_ops.add_layer_norm(attn_out, residual, (4096,), w, b)
    """
    _no_triton("layer_norm_fwd", variant)
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
    input, normalized_shape, variant
        As for :func:`layer_norm`.
    weight : torch.Tensor, optional
        ``normalized_shape``; a floating dtype other than ``input``'s is cast to ``input``'s, and
        the result has ``input``'s dtype (torch would promote to the wider dtype instead).
    eps : float, optional
        Added to the mean square; ``None`` (the default) takes ``torch.finfo(input.dtype).eps``,
        as torch does.

    Returns
    -------
    torch.Tensor
        As for :func:`layer_norm`: a new contiguous tensor of ``input``'s shape and dtype.

    Raises
    ------
    ValueError, NotImplementedError
        As for :func:`layer_norm`.

    Notes
    -----
    Autograd through ``torch.ops.optimized.rms_norm_bwd``, from the rstd the forward saved (float32;
    float64 for float64 input).

    Examples
    --------
    >>> x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    >>> optimized_ops.rms_norm(x, 4096, torch.ones(4096, device="cuda", dtype=torch.bfloat16))
    """
    if variant == "triton":
        return _triton.ops.rms_norm(input, _normalized_shape(normalized_shape), _cast_like(weight, input),
                                    _rms_eps(input, eps))
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
    ValueError, NotImplementedError
        As for :func:`add_layer_norm`.

    Notes
    -----
    Autograd: ``input`` and ``residual`` receive the same gradient (the norm's ``dh`` plus the
    gradient arriving at ``residual_out``).

    Examples
    --------
    >>> h, residual = optimized_ops.add_rms_norm(mlp_out, residual, 4096, w)
    """
    _no_triton("rms_norm_fwd", variant)
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
    NotImplementedError
        Unsupported dtypes (as for :func:`softmax`).

    Examples
    --------
    >>> optimized_ops.gelu(torch.randn(3, 5), approximate="tanh").shape
    torch.Size([3, 5])
    """
    _no_triton("bias_gelu_fwd", variant)
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
    NotImplementedError
        Unsupported dtypes (as for :func:`softmax`).

    Notes
    -----
    Autograd: ``dx = dy * gelu'(x + bias)`` and ``dbias`` (the sum of ``dx`` over the rows) in one
    backward kernel, ``torch.ops.optimized.bias_gelu_bwd``.

    Examples
    --------
    >>> h = optimized_ops.bias_gelu(x @ w1.t(), b1, approximate="tanh")
    """
    _no_triton("bias_gelu_fwd", variant)
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
    NotImplementedError
        Unsupported dtypes (as for :func:`softmax`).

    Examples
    --------
    >>> gate_up = x @ w_gate_up.t()           # (tokens, 2 * ffn)
    >>> h = optimized_ops.silu_and_mul(gate_up)  # (tokens, ffn)
    """
    _no_triton("silu_and_mul_fwd", variant)
    return _ops.silu_and_mul_fwd.default(input, variant=variant)


# The registrations around the C++ ops: fake kernels, then autograd (reverse and forward mode).
from . import _fakes, _autograd  # noqa: E402,F401
from .cross_entropy import cross_entropy  # noqa: E402,F401  (its own fakes and autograd)
from .rope import rope, rope_variants  # noqa: E402,F401  (RoPE: its own fakes and autograd)
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402,F401  (chunked LM head + cross-entropy)
