"""The Mixture-of-Experts layer as one function on the family's ops (include/optimized/moe.h):
:func:`moe_layer` (functional) and :class:`MoEMetrics` (its load, utilization and losses, as device
tensors); ``optimized_ops.nn.MoE`` is the module around it.

One layer, step by step, every shape fixed by the arguments' shapes (no ``.item()``, no
``nonzero()``, nothing read back to the host), so that a forward and backward in dropless mode can be
captured in a CUDA graph and compiled with ``torch.compile(fullgraph=True)``:

==========================  ==========================================================================
step                        what runs
==========================  ==========================================================================
router logits               ``x.float() @ router_weight.float().T`` (T, E): float32 whatever the
                            activations' dtype, as Megatron's and DeepSpeed's fp32 routers
route                       :func:`moe_route`: ``topk_ids``, ``topk_weights`` (float32), ``lse``
permute                     :func:`moe_permute`: the T k pairs sorted by expert, stably; capacity
gather                      :func:`moe_gather`: ``xs[s] = x[sorted_pairs[s] // k]`` (zero rows for the
                            slots past the kept pairs); its backward sums each token's k slot
                            gradients with ``moe_combine`` (unit weights: fixed order, no atomics)
expert up (SwiGLU)          :func:`grouped_mm_swiglu`: SwiGLU in the grouped GEMM's epilogue
expert down                 ``grouped_mm(a, w2, offs)``
combine                     :func:`moe_combine`: ``out[t] = sum_j topk_weights[t, j] y[slot_of[t, j]]``
metrics and losses          :class:`MoEMetrics` (aux loss, z-loss, loads, dropped pairs)
==========================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from . import grouped_mm, grouped_mm_swiglu, moe_combine, moe_gather, moe_permute, moe_route

__all__ = ["MoEMetrics", "moe_layer", "moe_capacity"]

_ops = torch.ops.optimized


@dataclasses.dataclass
class MoEMetrics:
    r"""What one call of :func:`moe_layer` routed, and its balancing losses: device tensors (nothing is
    read back to the host; call ``.item()`` where a number is wanted, at the cost of a synchronisation).

    T tokens, E experts, k experts per token: T k (token, expert) pairs ``p = t k + j``.

    Attributes
    ----------
    tokens_per_expert : torch.Tensor
        ``(E,)`` int32: the pairs each expert processed (``moe_permute``'s counts: after the capacity).
    load : torch.Tensor
        ``(E,)`` float32: :math:`f_i`, the fraction of the T k pairs the router assigned to expert i
        (before the capacity; sums to 1). No gradient.
    utilization : torch.Tensor
        ``()`` float32: ``mean(tokens_per_expert) / max(tokens_per_expert)``, the share of the experts'
        work slots in use when every expert is provisioned for the busiest one (as expert parallelism
        and a grouped GEMM's wave both are): 1 when the kept pairs are spread evenly, 1/E when one
        expert takes them all, 0 with no tokens.
    active_experts : torch.Tensor
        ``()`` float32: the fraction of the experts that processed at least one pair.
    imbalance : torch.Tensor
        ``()`` float32: ``E * max_i f_i``, the router's busiest expert against an even split, before
        the capacity: 1 balanced, E all to one expert.
    dropped : torch.Tensor
        ``()`` int32: pairs dropped by the capacity (0 in dropless mode). A dropped pair adds nothing to
        its token's output.
    aux_loss : torch.Tensor
        ``()`` float32: the load-balancing loss (Switch Transformer, GShard)
        :math:`E \sum_i f_i P_i`, with :math:`P_i` the mean over the T tokens of the router's
        probability of expert i (softmax scoring: the softmax over the E logits; sigmoid scoring: the
        sigmoids normalized to sum 1 over the E experts, DeepSeek-V3's). 1 when both are uniform, up to
        E when one expert takes everything. Gradient through :math:`P` (``f`` is a count).
    z_loss : torch.Tensor
        ``()`` float32: the router z-loss (ST-MoE) ``mean_t lse_t^2``, ``lse_t`` the logsumexp of token
        t's logits; gradient through the router's ``lse``.
    loss : torch.Tensor
        ``aux_loss_coef * aux_loss + z_loss_coef * z_loss``: add it to the task loss.
    """

    tokens_per_expert: torch.Tensor
    load: torch.Tensor
    utilization: torch.Tensor
    active_experts: torch.Tensor
    imbalance: torch.Tensor
    dropped: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    loss: torch.Tensor


# Flattened and rebuilt like a tuple by torch's pytree utilities (torch.compile's outputs, CUDA-graph
# helpers, torch.utils._pytree.tree_map over a model's outputs).
torch.utils._pytree.register_dataclass(MoEMetrics)


def moe_capacity(capacity_factor: float, tokens: int, top_k: int, experts: int) -> int:
    """``ceil(capacity_factor * tokens * top_k / experts)``: the pairs each expert keeps in capacity mode,
    computed in double precision as the C++ ``optimized::moe_capacity``."""
    if not (isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor: expected None or a finite number > 0; given {capacity_factor!r}")
    return int(math.ceil(float(capacity_factor) * float(tokens) * float(top_k) / float(experts)))


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ router_weight.float().T``: the float32 router logits ``(T, E)`` of tokens ``x`` ``(T, d)``
    (the layer's first step; tests reproduce its routing bit for bit from it). (``torch.mm``'s ``out_dtype``
    would skip the float32 copy of x, ~0.15 ms of the issue's layer on the H100, but has no derivative in
    torch 2.11.)"""
    return torch.nn.functional.linear(x.float(), router_weight.float())


def _check(x, router_weight, w13, w2, top_k, scoring, local_experts=None):
    """The shapes and dtypes the steps assume, named (the ops check the rest). ``local_experts(E)``: the experts
    w13 / w2 hold (expert parallelism: this rank's ``E / W``); default all ``E``. Returns (d_model, E)."""
    if x.dim() < 1:
        raise ValueError("x: expected a tensor (..., d_model); given a 0-D tensor")
    d = x.shape[-1]
    if router_weight.dim() != 2 or router_weight.shape[1] != d:
        raise ValueError(f"router_weight: expected (E, d_model = {d}); given shape {list(router_weight.shape)}")
    e = router_weight.shape[0]
    ne, name = (e, "E") if local_experts is None else (local_experts(e), "E / W")
    if w13.dim() != 3 or w13.shape[0] != ne or w13.shape[1] != d or w13.shape[2] % 2:
        raise ValueError(f"w13: expected ({name} = {ne}, d_model = {d}, 2 * d_ff); given shape {list(w13.shape)}")
    d_ff = w13.shape[2] // 2
    if w2.dim() != 3 or tuple(w2.shape) != (ne, d_ff, d):
        raise ValueError(f"w2: expected ({name}, d_ff, d_model) = {[ne, d_ff, d]}; given shape {list(w2.shape)}")
    check_dtypes_top_k_scoring(x, w13, w2, top_k, e, scoring)
    return d, e


def _moe_forward(x, router_weight, top_k, experts, *, capacity_factor, scoring, normalize, aux_loss_coef,
                 z_loss_coef):
    """The layer around ``experts(xs, offs) -> y``: routing, permutation, gather, combine and metrics. The
    public :func:`moe_layer` passes the SwiGLU experts; the benchmark passes the identity to time the
    rest alone."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    t, e, k = x2.shape[0], router_weight.shape[0], top_k
    pairs = t * k
    if normalize is None:
        normalize = k > 1
    capacity = 0 if capacity_factor is None else moe_capacity(capacity_factor, t, k, e)
    # Slots the experts see: every pair in dropless mode; at most E * capacity with a capacity (the
    # kept pairs fill the first offsets[E] slots, at most E * capacity of them).
    slots = pairs if capacity == 0 else min(pairs, e * capacity)

    logits = router_logits(x2, router_weight)                                    # (T, E) fp32
    ids, weights, lse = moe_route(logits, k, scoring=scoring, normalize=normalize)
    counts, offsets, sorted_pairs, slot_of, dropped = moe_permute(ids, e, capacity)
    sorted_pairs = sorted_pairs[:slots]                                          # (S,)
    offs = offsets[1:]                                                           # (E,) cumulative ends
    xs = moe_gather(x2, sorted_pairs, slot_of)                                   # (S, d)
    y = experts(xs, offs)                                                        # (S, d)
    out = moe_combine(y, slot_of, sorted_pairs, weights)                         # (T, d)

    # Metrics: f from the router's assignments (before the capacity), P with its gradient.
    if capacity == 0:
        routed = counts.float()
    else:
        routed = torch.zeros(e, dtype=torch.float32, device=x.device).scatter_add_(
            0, ids.reshape(-1).long(), torch.ones(pairs, dtype=torch.float32, device=x.device))
    load = routed / max(pairs, 1)
    if scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
    else:
        s = torch.sigmoid(logits)
        probs = s / s.sum(dim=-1, keepdim=True)
    aux_loss = e * (load * probs.mean(dim=0)).sum()
    z_loss = lse.square().mean()
    kept = counts.float()
    metrics = MoEMetrics(
        tokens_per_expert=counts,
        load=load,
        utilization=kept.mean() / kept.max().clamp(min=1.0),
        active_experts=(counts > 0).float().mean(),
        imbalance=e * load.max(),
        dropped=dropped.reshape(()),
        aux_loss=aux_loss,
        z_loss=z_loss,
        loss=aux_loss_coef * aux_loss + z_loss_coef * z_loss)
    return out.reshape(shape), metrics


def check_dtypes_top_k_scoring(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k, num_experts: int,
                               scoring) -> None:
    """The checks :func:`moe_layer` and its expert-parallel form share: one dtype for ``x``, ``w13`` and ``w2``,
    ``1 <= top_k <= num_experts``, a known scoring. Raises ``ValueError`` naming the argument."""
    if not (w13.dtype == w2.dtype == x.dtype):
        raise ValueError(f"x, w13, w2: expected one dtype; given {x.dtype}, {w13.dtype}, {w2.dtype}")
    if not (isinstance(top_k, int) and 1 <= top_k <= num_experts):
        raise ValueError(f"top_k: expected an int 1 <= k <= E = {num_experts}; given {top_k!r}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring: expected one of softmax, sigmoid; given {scoring!r}")


def moe_layer(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
              capacity_factor: Optional[float] = None, scoring: str = "softmax", normalize: Optional[bool] = None,
              aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001,
              variant: str = "auto") -> tuple[torch.Tensor, MoEMetrics]:
    r"""A Mixture-of-Experts feed-forward layer with SwiGLU experts, top-k routing, optional capacity, and
    its balancing losses.

    .. math::
        \mathrm{out}_t = \sum_{j < k} w_{tj}\,
            \big(\mathrm{silu}(x_t G_{e_{tj}}) \odot (x_t U_{e_{tj}})\big) D_{e_{tj}}

    with ``w13[e] = [G_e | U_e]``, ``w2[e] = D_e``, ``e_tj`` and ``w_tj`` token t's j-th expert and weight.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., d_model)`` tokens, float32, float16 or bfloat16 (the leading dimensions are flattened
        into T tokens).
    router_weight : torch.Tensor
        ``(E, d_model)``, any floating dtype: the logits are ``x.float() @ router_weight.float().T`` in
        float32.
    w13 : torch.Tensor
        ``(E, d_model, 2 * d_ff)``, x's dtype: each expert's gate and up projections side by side,
        columns ``[gate | up]``.
    w2 : torch.Tensor
        ``(E, d_ff, d_model)``, x's dtype: each expert's down projection.
    top_k : int
        Experts per token, 1 <= k <= min(E, 32).
    capacity_factor : float, optional
        ``None`` (the default): dropless, every pair is computed. A number > 0: each expert keeps at most
        ``ceil(capacity_factor * T * k / E)`` pairs, its first in pair order ``p = t k + j`` (earlier
        tokens first, :func:`moe_permute`'s rule); the others are dropped, counted in
        ``MoEMetrics.dropped``, and add zero to their token's output.
    scoring : str
        ``"softmax"`` (over the E logits) or ``"sigmoid"`` (of each), :func:`moe_route`'s.
    normalize : bool, optional
        Divide each token's k weights by their sum. ``None`` (the default): True for k > 1 (Mixtral's
        weights, summing to 1), False for k = 1 (Switch's: the weight is the router's probability, so
        the router learns from the task loss; normalized, a single weight would be 1).
    aux_loss_coef, z_loss_coef : float
        The weights of the two losses in ``MoEMetrics.loss``.
    variant : str
        The grouped GEMM's rung for both projections, forward and backward
        (``optimized_ops.variants("grouped_gemm")`` or ``"auto"``; ``"loop"`` reads the offsets back to
        the host: not capturable in a CUDA graph).

    Returns
    -------
    tuple
        ``out`` (x's shape and dtype) and :class:`MoEMetrics`. Add ``metrics.loss`` to the task loss
        for the balancing losses to train the router.

    Notes
    -----
    Gradients reach ``x``, ``router_weight`` (through the routing weights, the aux loss's probabilities
    and the z-loss's lse), ``w13`` and ``w2``; the expert choice itself is piecewise constant. The
    routing's rules are :func:`moe_route`'s: ties go to the lower expert index, the same on every
    backend and run; a NaN logit makes its token's weights and lse NaN (so its output and the z-loss
    are NaN, never a silently finite answer) and a NaN score ranks below every number. Every sum runs
    in a fixed order (the combine and the gather's backward without atomics): the same bits every
    run on one device and variant.

    Examples
    --------
    >>> E, d, f = 8, 64, 128
    >>> x = torch.randn(2, 16, d)
    >>> out, m = optimized_ops.moe_layer(x, torch.randn(E, d), torch.randn(E, d, 2 * f) / 8,
    ...                                  torch.randn(E, f, d) / 11, top_k=2)
    >>> out.shape, m.tokens_per_expert.sum().item()
    (torch.Size([2, 16, 64]), 64)
    """
    _check(x, router_weight, w13, w2, top_k, scoring)

    def experts(xs, offs):
        return grouped_mm(grouped_mm_swiglu(xs, w13, offs, variant=variant), w2, offs, variant=variant)

    return _moe_forward(x, router_weight, top_k, experts, capacity_factor=capacity_factor, scoring=scoring,
                        normalize=normalize, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
