"""Linear layers from PyTorch: ``optimized_ops.linear`` over ``torch.ops.optimized.linear_forward`` /
``linear_backward`` of the C++ library (``src/torch/linear_ops.cpp``, include/optimized/linear.h):
``y = act(x W^T + b)`` with the bias and the activation fused into the GEMM's epilogue, and a backward
that computes ``g = dy * act'(pre)`` and the bias gradient in one pass, then the two GEMMs.

The ladder (``optimized_ops.variants("linear")``), naive to best:

================  ======  ===============================================================
variant           device  what runs
================  ======  ===============================================================
``"auto"``        any     ``cpu`` on the CPU; on CUDA the GEMM family's choice + epilogue
``"cpu"``         CPU     the packed CPU GEMM with its epilogue (float64 too)
``"naive"``       CUDA    one thread per output (float32, float16, bfloat16)
``"fused"``       CUDA    the mma.sync pipeline, epilogue fused (float16, bfloat16)
``"persistent"``  CUDA    Hopper: the persistent warp-specialized wgmma GEMM (float16, bfloat16)
================  ======  ===============================================================

The package is split by what torch needs around the C++ ops:

* ``linear/__init__.py`` (here): the function and the ladder's query;
* ``linear/_fakes.py``: fake kernels (``register_fake``), the outputs' shapes and dtypes, for
  ``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors;
* ``linear/_autograd.py``: autograd of ``linear_forward`` (``optimized_ops._autograd.register_autograd``):
  its backward is ``linear_backward`` (same kernels, same variant), its jvp rule gives
  ``torch.autograd.forward_ad`` and ``torch.func`` real tangents; double backward goes through a
  composite formula on ``optimized_ops.matmul``.

The drop-in module is ``optimized_ops.nn.Linear``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._library import load
from .._variants import register_family

_lib = load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")


def linear_variants() -> list[str]:
    """Names of the variants of the linear family, CPU then CUDA, naive to best (``"auto"`` excluded):
    the C++ table, through ``torch.ops.optimized.linear_variants()``; the same list as
    ``optimized_ops.variants("linear")``.

    Returns
    -------
    list of str
        ``["cpu", "naive", "fused", "persistent"]``. Every variant is listed, whatever this build and
        machine can run.
    """
    return list(_ops.linear_variants())


_VARIANTS = ("auto", *linear_variants())
register_family("linear", linear_variants)


def _activation(activation: Optional[str]) -> str:
    return "none" if activation is None else activation


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           activation: Optional[str] = None, variant: str = "auto", fp8: bool = False) -> torch.Tensor:
    r"""A linear layer with a fused activation: ``act(x @ weight.T + bias)``, as
    ``act(torch.nn.functional.linear(x, weight, bias))``.

    .. math::  y = \mathrm{act}(x W^T + b)

    Products accumulate in float32 (float64 for float64 inputs); the bias and the activation are
    applied to the float32 sum, and ``y`` is rounded once to the inputs' dtype.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., K)``, any number of leading dimensions (zero rows too); float32, float16 or bfloat16
        on CPU or CUDA, float64 on the CPU (``"cpu"`` and ``"auto"``). Leading dimensions that flatten
        into uniformly strided rows with a unit-stride last dimension are read in place
        (``x[..., :k]``, ``x[::2]``); other layouts are copied first.
    weight : torch.Tensor
        ``(N, K)`` as :class:`torch.nn.Linear` stores it; same dtype and device as ``x``.
    bias : torch.Tensor, optional
        ``(N,)``, same dtype; None: no bias.
    activation : str, optional
        ``None`` or ``"none"``, ``"relu"``, ``"gelu"`` (erf: torch's ``approximate='none'``),
        ``"gelu_tanh"`` (``approximate='tanh'``), ``"silu"``.
    variant : str
        ``"auto"`` or a rung of :func:`linear_variants` (see the package's table).
    fp8 : bool
        Run the GEMMs (forward and backward) on fp8 copies with per-tensor current scaling: ``x`` and
        ``weight`` quantized to e4m3, the gradient ``g`` to e5m2, each with the scale
        ``fp8_max / max|t|`` of its own values in this call (rounded to nearest even, saturated), the
        products accumulated in float32 and the epilogue as without fp8. On ``"auto"``, ``"cpu"``,
        ``"naive"`` and ``"persistent"`` (Hopper: the fp8 wgmma GEMM); float32, float16, bfloat16
        inputs. A NaN or infinity in an operand gives a NaN product (its scale is NaN).

    Returns
    -------
    torch.Tensor
        A new contiguous ``(..., N)`` tensor of ``x``'s dtype and device.

    Raises
    ------
    ValueError
        A 0-D ``x``, a ``weight`` that is not 2-D or whose K differs from ``x``'s, a bias not of N
        elements, K or N of 0, different dtypes or devices, an unknown activation or variant, a variant
        of the other device. The message names the op (``optimized::linear_forward``) and the argument.
    NotImplementedError
        A dtype the variant does not take (float64 on CUDA, float32 on ``fused`` / ``persistent``), a
        CUDA variant this build or GPU cannot run.

    Notes
    -----
    *Autograd.* The backward is one ``optimized::linear_backward`` call on the same variant:
    ``g = dy * act'(pre)``, ``grad_x = g W``, ``grad_W = g^T x``, ``grad_b = sum of g over the rows``
    (a fixed order: the same bits every run), only the gradients that are needed. With an activation
    the forward keeps ``pre = x W^T + b`` for it when a gradient will be needed. Forward mode
    (``torch.func.jvp``, ``forward_ad``) and double backward work.

    *torch.compile and CUDA graphs.* The ops have fake kernels (``torch.compile(fullgraph=True)``
    traces them); on CUDA they run on the current stream, allocate through torch's caching allocator
    and never synchronize the host.

    Examples
    --------
    >>> x, w, b = torch.randn(8, 64), torch.randn(32, 64), torch.randn(32)
    >>> optimized_ops.linear(x, w, b, activation="gelu").shape
    torch.Size([8, 32])
    """
    act = _activation(activation)
    save_pre = act != "none" and _needs_grad(x, weight, bias)
    y, _ = _ops.linear_forward.default(x, weight, bias, activation=act, save_pre=save_pre, variant=variant,
                                       fp8=bool(fp8))
    return y


# The registrations around the C++ ops: the fake kernels, then autograd.
from . import _fakes, _autograd  # noqa: E402,F401
