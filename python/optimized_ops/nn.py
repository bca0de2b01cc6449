"""Drop-in ``nn`` modules on the library's kernels: :class:`LayerNorm` and :class:`RMSNorm` (the fused
family), :class:`Linear` (the linear family: bias and activation fused into the GEMM), and
:class:`MoE` (a Mixture-of-Experts feed-forward layer, the moe family; a module of its own, torch has
none to replace).

The first three are subclasses of their torch counterparts (:class:`torch.nn.LayerNorm`,
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

import math
from typing import Optional

import torch

from .fused import _VARIANTS, _normalized_shape, _ShapeLike, layer_norm, rms_norm
from .linear import _VARIANTS as _LINEAR_VARIANTS, ACTIVATIONS as _ACTIVATIONS, linear
from .moe import grouped_gemm_variants
from .moe.layer import MoEMetrics, moe_layer

__all__ = ["LayerNorm", "RMSNorm", "Linear", "MoE"]


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


class MoE(torch.nn.Module):
    r"""A Mixture-of-Experts feed-forward layer: a top-k router over ``num_experts`` SwiGLU experts, on
    :func:`optimized_ops.moe_layer` (the routing, the permutation, the grouped GEMMs and the combine of
    the moe family; no host synchronisation).

    .. math::
        \mathrm{out}_t = \sum_{j < k} w_{tj}\,
            \big(\mathrm{silu}(x_t G_{e_{tj}}) \odot (x_t U_{e_{tj}})\big) D_{e_{tj}}

    Parameters
    ----------
    d_model, d_ff : int
        The model width and each expert's hidden width.
    num_experts : int
        E, 1 to 1024.
    top_k : int
        Experts per token, 1 <= k <= min(E, 32).
    activation : str, keyword-only
        ``"swiglu"`` (the only one: the experts' gate and up projections are ``w13``'s two halves).
    capacity_factor : float, optional, keyword-only
        ``None`` (dropless, the default) or each expert's capacity ``ceil(cf * T * k / E)`` pairs
        (:func:`optimized_ops.moe_layer`).
    aux_loss_coef, z_loss_coef : float, keyword-only
        The weights of the load-balancing loss and the router z-loss in ``last_metrics.loss``.
    scoring : str, keyword-only
        ``"softmax"`` or ``"sigmoid"``.
    normalize : bool, optional, keyword-only
        Divide each token's k weights by their sum; ``None``: for k > 1.
    device, dtype : optional, keyword-only
        Of the parameters, as in torch; the input must have ``dtype``.
    variant : str, keyword-only
        The grouped GEMM's rung (``"auto"`` or one of ``optimized_ops.variants("grouped_gemm")``); not
        part of the state_dict.
    process_group : torch.distributed.ProcessGroup, optional, keyword-only
        ``None`` (the default): every expert here. A process group of W ranks (E a multiple of W): expert
        parallelism (:mod:`optimized_ops.distributed.expert_parallel`): this rank holds experts
        ``[r E/W, (r+1) E/W)`` (``w13`` / ``w2`` of ``E / W`` experts), the router is replicated, tokens travel to
        their experts' ranks and back by all-to-all; every rank must run each forward. ``last_metrics`` are the
        whole group's. The attribute ``overlap`` (default True) overlaps the dispatch with the local experts.

    Attributes
    ----------
    router : torch.nn.Linear
        ``router.weight`` ``(E, d_model)``, no bias: the logits are computed in float32 from it.
    w13 : torch.nn.Parameter
        ``(E, d_model, 2 * d_ff)``: each expert's gate and up projections, columns ``[gate | up]``.
    w2 : torch.nn.Parameter
        ``(E, d_ff, d_model)``: each expert's down projection.
    last_metrics : MoEMetrics or None
        The :class:`optimized_ops.MoEMetrics` of the last forward (device tensors): loads, utilization,
        dropped pairs and the losses. **Add** ``last_metrics.loss`` **to the task loss**: the forward
        returns only the output.

    Notes
    -----
    Initialization (:meth:`reset_parameters`), as ``torch.nn.Linear`` initializes each projection:
    ``router.weight`` and ``w13`` uniform in :math:`\pm 1/\sqrt{d_\mathrm{model}}`, ``w2`` uniform in
    :math:`\pm 1/\sqrt{d_\mathrm{ff}}` (each expert as an ``nn.Linear(d_model, d_ff)`` pair and an
    ``nn.Linear(d_ff, d_model)`` would be), so that the logits and the experts' pre-activations are
    O(1) for inputs of unit scale.

    Examples
    --------
    >>> moe = optimized_ops.nn.MoE(512, 1024, num_experts=8, top_k=2)
    >>> y = moe(torch.randn(4, 128, 512))
    >>> loss = y.square().mean() + moe.last_metrics.loss
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *, activation: str = "swiglu",
                 capacity_factor: Optional[float] = None, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001,
                 scoring: str = "softmax", normalize: Optional[bool] = None, device=None, dtype=None,
                 variant: str = "auto", process_group=None) -> None:
        super().__init__()
        for name, v in (("d_model", d_model), ("d_ff", d_ff)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}: expected an int >= 1; given {v!r}")
        if not (isinstance(num_experts, int) and 1 <= num_experts <= 1024):
            raise ValueError(f"num_experts: expected an int 1 <= E <= 1024; given {num_experts!r}")
        if not (isinstance(top_k, int) and 1 <= top_k <= min(num_experts, 32)):
            raise ValueError(f"top_k: expected an int 1 <= k <= min(E, 32) = {min(num_experts, 32)}; given {top_k!r}")
        if activation != "swiglu":
            raise ValueError(f"activation: expected 'swiglu' (the only expert activation so far); given {activation!r}")
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float))
                                                and math.isfinite(capacity_factor) and capacity_factor > 0):
            raise ValueError(f"capacity_factor: expected None or a finite number > 0; given {capacity_factor!r}")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring: expected one of softmax, sigmoid; given {scoring!r}")
        factory = {"device": device, "dtype": dtype}
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, num_experts, top_k
        self.activation, self.capacity_factor = activation, capacity_factor
        self.scoring, self.normalize = scoring, normalize
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.variant = _check_variant(variant, ("auto", *grouped_gemm_variants()))
        self.router = torch.nn.Linear(d_model, num_experts, bias=False, **factory)
        local_experts = num_experts
        self.process_group = process_group
        if process_group is not None:  # expert parallelism: this rank's experts only
            from .distributed.expert_parallel import expert_range
            self.expert_offset, local_experts = expert_range(num_experts, process_group)
            self.overlap = True
        self.w13 = torch.nn.Parameter(torch.empty(local_experts, d_model, 2 * d_ff, **factory))
        self.w2 = torch.nn.Parameter(torch.empty(local_experts, d_ff, d_model, **factory))
        self.last_metrics: Optional[MoEMetrics] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initialization of the Notes: ``nn.Linear``'s bound ``1 / sqrt(fan_in)`` for each projection."""
        self.router.reset_parameters()
        with torch.no_grad():
            bound = 1.0 / math.sqrt(self.d_model)
            self.w13.uniform_(-bound, bound)
            bound = 1.0 / math.sqrt(self.d_ff)
            self.w2.uniform_(-bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` ``(*, d_model)`` -> a new tensor of its shape; sets :attr:`last_metrics`."""
        if self.process_group is not None:
            from .distributed.expert_parallel import moe_layer_ep
            out, self.last_metrics = moe_layer_ep(
                input, self.router.weight, self.w13, self.w2, self.top_k, group=self.process_group,
                capacity_factor=self.capacity_factor, scoring=self.scoring, normalize=self.normalize,
                aux_loss_coef=self.aux_loss_coef, z_loss_coef=self.z_loss_coef, variant=self.variant,
                overlap=self.overlap)
            return out
        out, self.last_metrics = moe_layer(
            input, self.router.weight, self.w13, self.w2, self.top_k, capacity_factor=self.capacity_factor,
            scoring=self.scoring, normalize=self.normalize, aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef, variant=self.variant)
        return out

    def extra_repr(self) -> str:
        extra = [f"d_model={self.d_model}", f"d_ff={self.d_ff}", f"num_experts={self.num_experts}",
                 f"top_k={self.top_k}"]
        if self.capacity_factor is not None:
            extra.append(f"capacity_factor={self.capacity_factor}")
        if self.scoring != "softmax":
            extra.append(f"scoring={self.scoring!r}")
        if self.normalize is not None:
            extra.append(f"normalize={self.normalize}")
        if self.variant != "auto":
            extra.append(f"variant={self.variant!r}")
        if self.process_group is not None:
            extra.append(f"expert_parallel=experts [{self.expert_offset}, {self.expert_offset + self.w13.shape[0]})")
        return ", ".join(extra)
