"""Mixture of Experts from PyTorch (in progress with the family, include/optimized/moe.h): the router,
the permutation of the (token, expert) pairs by expert, and the grouped GEMM, each a
``torch.ops.optimized`` op of the C++ library (``src/torch/moe_ops.cpp``), on CPU and CUDA tensors, with
no host synchronisation (ids and offsets stay on the device).

* :func:`moe_route`: router logits ``(T, E)`` -> ``(topk_ids, topk_weights, lse)``.
* :func:`moe_permute`: ``topk_ids`` -> ``(counts, offsets, sorted_pairs, slot_of, dropped)``.
* :func:`moe_combine`: the weighted sum of each token's expert outputs, with autograd.
* :func:`grouped_mm`: ``torch._grouped_mm``'s 2-D x 3-D case, with autograd (its backward is
  ``grouped_mm`` on ``w.transpose(-2, -1)`` and ``grouped_mm_weight_grad``).

The grouped GEMM's ladder (``optimized_ops.variants("grouped_gemm")``): ``cpu``, ``naive`` (one thread
per output), ``loop`` (one GEMM per group: reads ``offs`` to the host, a synchronisation, not
capturable in a CUDA graph); the Hopper grouped rung comes next.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._library import load
from .._variants import register_family

_lib = load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized


def grouped_gemm_variants() -> list[str]:
    """Names of the grouped GEMM's variants, naive to best (``"auto"`` excluded): ``["cpu", "naive", "loop"]``."""
    return list(_ops.grouped_gemm_variants())


register_family("grouped_gemm", grouped_gemm_variants)


def moe_route(logits: torch.Tensor, top_k: int, *, bias: Optional[torch.Tensor] = None, scoring: str = "softmax",
              topk_softmax: bool = False, normalize: bool = False, n_groups: int = 1, topk_groups: int = 1,
              routed_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights, from router logits.

    Parameters
    ----------
    logits : torch.Tensor
        ``(T, E)``, float32, float16 or bfloat16 (rows may be strided; unit stride along E); E <= 1024.
    top_k : int
        Experts per token, 1 <= k <= min(E, 32).
    bias : torch.Tensor, optional
        ``(E,)`` float32: added to the scores for the choice only (DeepSeek-V3's balancing bias).
    scoring : str
        ``"softmax"`` (over the E logits) or ``"sigmoid"`` (of each).
    topk_softmax : bool
        Choose on the logits and take the softmax over the chosen k (Mixtral's order; softmax only).
    normalize : bool
        Divide the weights by their sum over the k.
    n_groups, topk_groups : int
        Group-limited routing: E in n_groups equal groups, each scored by the sum of its two best
        choice scores; only the topk_groups best groups compete.
    routed_scale : float
        Multiplies the weights (after normalize).

    Returns
    -------
    tuple of torch.Tensor
        ``topk_ids`` ``(T, k)`` int32 (best first), ``topk_weights`` ``(T, k)`` float32, ``lse`` ``(T,)``
        float32 (logsumexp of the logits: the router z-loss is ``lse.square().mean()``).

    Notes
    -----
    Ties go to the lower expert index (and group), the same on every backend and run. A NaN choice
    score ranks below every number; a NaN logit makes that token's softmax weights and lse NaN. No
    autograd yet: the weights do not carry gradients to the logits.
    """
    return _ops.moe_route.default(logits, bias, top_k=top_k, scoring=scoring, topk_softmax=topk_softmax,
                                  normalize=normalize, n_groups=n_groups, topk_groups=topk_groups,
                                  routed_scale=routed_scale)


def moe_permute(topk_ids: torch.Tensor, num_experts: int, capacity: int = 0):
    """The pairs ``p = t k + j`` sorted by expert, stably (by p within an expert), on the ids' device.

    Returns ``(counts (E,), offsets (E + 1,), sorted_pairs (T k,), slot_of (T, k), dropped (1,))``, all
    int32: ``counts[e]`` pairs kept by expert e, ``offsets`` their cumulative starts (``offsets[E]`` =
    pairs kept), ``sorted_pairs[s]`` the pair in slot s (-1 past the kept ones), ``slot_of`` the slot of
    each pair (-1: dropped), ``dropped`` the pairs dropped. ``capacity`` 0 is dropless; otherwise each
    expert keeps its first ``capacity`` pairs (earlier tokens first). Ids outside ``[0, E)`` are
    dropped and counted. ``offsets[1:]`` is :func:`grouped_mm`'s ``offs``.
    """
    return _ops.moe_permute.default(topk_ids, num_experts, capacity)


def moe_combine(y: torch.Tensor, slot_of: torch.Tensor, sorted_pairs: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[slot_of[t, j]]``: each token's expert outputs (``y`` ``(S, N)`` in
    slot order, float32 / float16 / bfloat16) weighted and summed in float32, in the order j = 0, 1, ...
    (no atomics: the same bits every run); dropped pairs (slot -1) add nothing. ``slot_of`` ``(T, k)`` and
    ``sorted_pairs`` ``(S,)`` are :func:`moe_permute`'s (``sorted_pairs`` serves the backward), ``weights``
    ``(T, k)`` float32. Autograd: ``y`` and ``weights``.
    """
    return _ops.moe_combine.default(y, slot_of, sorted_pairs, weights)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, variant: str = "auto") -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs)`` for 2-D ``x`` and 3-D ``w``: ``out[r] = x[r] @ w[g]`` for the rows
    ``offs[g-1] <= r < offs[g]`` of group g; rows from ``offs[-1]`` on are zeros.

    ``x`` ``(M, K)`` (rows sorted by group), ``w`` ``(E, K, N)`` (any strides: ``w.transpose(-2, -1)`` of an
    ``(E, N, K)`` tensor too), ``offs`` ``(E,)`` int32 cumulative ends, read on the device only; one dtype
    (float32, float16, bfloat16), products accumulated in float32. Autograd: ``x`` and ``w`` (not offs).
    """
    return _ops.grouped_mm.default(x, w, offs, variant=variant)


# The registrations around the C++ ops: the fake kernels, then autograd.
from . import _fakes, _autograd  # noqa: E402,F401
