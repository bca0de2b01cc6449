"""Drop-in ``nn`` modules on the library's kernels: :class:`LayerNorm` and :class:`RMSNorm` (the fused
family), :class:`Linear` (the linear family: bias and activation fused into the GEMM).

Each is a subclass of its torch counterpart (:class:`torch.nn.LayerNorm`,
:class:`torch.nn.RMSNorm`, :class:`torch.nn.Linear`): the same constructor arguments, attributes
(``normalized_shape``, ``eps``, ``elementwise_affine``; ``in_features``, ``out_features``), parameters
(``weight``, ``bias``), ``reset_parameters`` and
state_dict keys, so checkpoints load both ways, ``isinstance(m, torch.nn.LayerNorm)`` still holds
for code that looks for norms (weight-decay groups, wrapping policies), and a model switches by
replacing the class. Only ``forward`` differs: it runs :func:`optimized_ops.layer_norm` /
:func:`optimized_ops.rms_norm` / :func:`optimized_ops.linear`, with the rung chosen by the
keyword-only ``variant``.

>>> import torch, optimized_ops
>>> ours, theirs = optimized_ops.nn.RMSNorm(512), torch.nn.RMSNorm(512)
>>> theirs.load_state_dict(ours.state_dict())
<All keys matched successfully>
"""

from __future__ import annotations

from typing import Optional

import torch

from .fused import _VARIANTS, _normalized_shape, _ShapeLike, layer_norm, rms_norm
from .linear import _VARIANTS as _LINEAR_VARIANTS, ACTIVATIONS as _ACTIVATIONS, linear

__all__ = ["LayerNorm", "RMSNorm", "Linear"]


def _check_variant(variant: str, choices=_VARIANTS) -> str:
    if variant not in choices:
        raise ValueError(f"variant: expected one of {', '.join(choices)}; given {variant!r}")
    return variant


class LayerNorm(torch.nn.LayerNorm):
    r"""Layer normalization over the trailing ``normalized_shape`` dimensions, on the fused kernels;
    a drop-in for :class:`torch.nn.LayerNorm`.

    .. math::  y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    Parameters
    ----------
    normalized_shape : int or sequence of int
        The trailing dimensions of the input to normalize over.
    eps : float
        Added to the variance. Default ``1e-5``.
    elementwise_affine : bool
        Learnable ``weight`` (ones) and, with ``bias``, ``bias`` (zeros) of shape
        ``normalized_shape``. Default True.
    bias : bool
        Whether the affine transform has a bias. Default True.
    device, dtype : optional
        Of the parameters, as in torch.
    variant : str, keyword-only
        The rung of the ladder (``"auto"``, ``"cpu"``, ``"unfused"``, ``"fused_streaming"``,
        ``"fused_registers"``); not part of the state_dict.

    Notes
    -----
    Parameters of a dtype other than the input's (float32 parameters with bfloat16 activations)
    are cast to the input's dtype for the kernel; the output has the input's dtype, as torch's
    does, and the gradients reach the parameters in their own dtype.

    Examples
    --------
    >>> norm = optimized_ops.nn.LayerNorm(1024, device="cuda", dtype=torch.bfloat16)
    >>> norm(torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)).shape
    torch.Size([8, 1024])
    """

    def __init__(self, normalized_shape: _ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, *, variant: str = "auto") -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.variant = _check_variant(variant)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalizes ``input`` (shape ``(*, *normalized_shape)``); returns a new tensor of its shape."""
        return layer_norm(input, _normalized_shape(self.normalized_shape), self.weight, self.bias, self.eps,
                          variant=self.variant)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.variant == "auto" else f", variant={self.variant!r}")


class RMSNorm(torch.nn.RMSNorm):
    r"""Root-mean-square normalization over the trailing ``normalized_shape`` dimensions, on the
    fused kernels; a drop-in for :class:`torch.nn.RMSNorm`.

    .. math::  y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot \gamma

    Parameters
    ----------
    normalized_shape : int or sequence of int
        The trailing dimensions of the input to normalize over.
    eps : float, optional
        Added to the mean square; ``None`` (the default) takes ``torch.finfo(input.dtype).eps``,
        as torch does.
    elementwise_affine : bool
        A learnable ``weight`` (ones) of shape ``normalized_shape``. Default True.
    device, dtype : optional
        Of the parameter, as in torch.
    variant : str, keyword-only
        The rung of the ladder, as for :class:`LayerNorm`.

    Notes
    -----
    A ``weight`` of another dtype than the input is cast to the input's dtype, and the output has
    the input's dtype (torch's RMSNorm would promote the output to the wider dtype).

    Examples
    --------
    >>> norm = optimized_ops.nn.RMSNorm(4096, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    """

    def __init__(self, normalized_shape: _ShapeLike, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None, *, variant: str = "auto") -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.variant = _check_variant(variant)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalizes ``input`` (shape ``(*, *normalized_shape)``); returns a new tensor of its shape."""
        return rms_norm(input, _normalized_shape(self.normalized_shape), self.weight, self.eps, variant=self.variant)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.variant == "auto" else f", variant={self.variant!r}")


class Linear(torch.nn.Linear):
    r"""A linear layer with an optional fused activation, on the linear family's kernels; a drop-in
    for :class:`torch.nn.Linear` (followed by the activation).

    .. math::  y = \mathrm{act}(x W^T + b)

    Parameters
    ----------
    in_features, out_features : int
        K and N (both at least 1: the kernels take no empty layer).
    bias : bool
        A learnable ``bias`` of ``out_features``. Default True.
    activation : str, optional
        ``None`` (the default) or ``"none"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``:
        applied in the GEMM's epilogue. Not part of the state_dict.
    device, dtype : optional
        Of the parameters, as in torch.
    variant : str, keyword-only
        The rung of the ladder (``"auto"``, ``"cpu"``, ``"naive"``, ``"fused"``, ``"persistent"``);
        not part of the state_dict.
    fp8 : bool, keyword-only
        The GEMMs on fp8 copies with per-tensor current scaling (:func:`optimized_ops.linear`'s
        ``fp8``); the parameters stay in their dtype. Not part of the state_dict.

    Notes
    -----
    The parameters and the input must share a dtype (as for :func:`torch.nn.functional.linear`);
    the kernels accumulate in float32 (float64 for float64).

    Examples
    --------
    >>> ours, theirs = optimized_ops.nn.Linear(64, 32, activation="gelu"), torch.nn.Linear(64, 32)
    >>> theirs.load_state_dict(ours.state_dict())
    <All keys matched successfully>
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, activation: Optional[str] = None,
                 device=None, dtype=None, *, variant: str = "auto", fp8: bool = False) -> None:
        act = "none" if activation is None else activation
        if act not in _ACTIVATIONS:
            raise ValueError(f"activation: expected None or one of {', '.join(_ACTIVATIONS)}; given {activation!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = activation
        self.variant = _check_variant(variant, _LINEAR_VARIANTS)
        self.fp8 = bool(fp8)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``act(input @ weight.T + bias)``: input ``(*, in_features)``; a new ``(*, out_features)`` tensor."""
        return linear(input, self.weight, self.bias, self.activation, variant=self.variant, fp8=self.fp8)

    def extra_repr(self) -> str:
        extra = "" if self.activation in (None, "none") else f", activation={self.activation!r}"
        return (super().extra_repr() + extra + ("" if self.variant == "auto" else f", variant={self.variant!r}") +
                (", fp8=True" if self.fp8 else ""))
