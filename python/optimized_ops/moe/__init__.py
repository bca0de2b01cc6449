"""Mixture of Experts from PyTorch (include/optimized/moe.h): the router, the permutation of the
(token, expert) pairs by expert, the gather, the grouped GEMM and the combine, each a
``torch.ops.optimized`` op of the C++ library (``src/torch/moe_ops.cpp``), on CPU and CUDA tensors, with
no host synchronisation (ids and offsets stay on the device). The layer built from them:
:func:`optimized_ops.moe_layer` (``moe/layer.py``) and ``optimized_ops.nn.MoE``.

* :func:`moe_route`: router logits ``(T, E)`` -> ``(topk_ids, topk_weights, lse)``, with autograd
  (``topk_weights`` and ``lse`` to the logits: ``torch.ops.optimized.moe_route_backward``).
* :func:`moe_permute`: ``topk_ids`` -> ``(counts, offsets, sorted_pairs, slot_of, dropped)``.
* :func:`moe_combine` (also :func:`moe_unpermute`): the weighted sum of each token's expert outputs, with
  autograd.
* :func:`moe_gather`: the token rows in slot order (the dispatch), with autograd.
* :func:`grouped_mm`: ``torch._grouped_mm``'s 2-D x 3-D case, with autograd (its backward is
  ``grouped_mm`` on ``w.transpose(-2, -1)`` and ``grouped_mm_weight_grad``).
* :func:`grouped_mm_swiglu`: the expert MLP's up projection with SwiGLU in the GEMM's epilogue, with autograd.

The grouped GEMM's ladder (``optimized_ops.variants("grouped_gemm")``): ``cpu``, ``naive`` (one thread
per output), ``loop`` (one GEMM per group: reads ``offs`` to the host, a synchronisation, not
capturable in a CUDA graph), ``wgmma`` (Hopper: the GEMM family's wgmma mainloop under a persistent
scheduler over every group's tiles, one launch, offsets read on the device only). ``auto`` takes
``wgmma`` where it applies (a 9.0 device, 16-bit operands TMA can describe), else ``loop``, or ``naive``
while the stream is being captured.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._library import load
from .._variants import register_family

_lib = load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized


def grouped_gemm_variants() -> list[str]:
    """Names of the grouped GEMM's variants, naive to best (``"auto"`` excluded): ``["cpu", "naive", "loop", "wgmma"]``."""
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
    score ranks below every number; a NaN logit makes that token's softmax weights and lse NaN.

    Autograd: ``topk_weights`` and ``lse`` carry gradients to ``logits`` (in the logits' dtype, computed in
    float32 by ``torch.ops.optimized.moe_route_backward``) for the experts the forward chose: the
    derivative of the scoring rule (softmax, the softmax over the chosen k, sigmoid; normalize and
    routed_scale) plus ``grad_lse * softmax(logits)``. The choice has no gradient: ``topk_ids`` are
    integers and ``bias`` gets none. A zero incoming gradient adds exact zeros (an unused output never
    turns a NaN logit's row NaN); otherwise NaN propagates: with softmax scoring, a NaN logit makes its
    token's gradient row NaN. No double backward yet.
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


# The unpermute step of an MoE layer under the name frameworks give it: the combine (slot order back to token
# order, weighted), which :func:`moe_combine` documents.
moe_unpermute = moe_combine


def moe_gather(x: torch.Tensor, sorted_pairs: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """The token rows in slot order, what the experts' grouped GEMM reads: ``xs[s] = x[sorted_pairs[s] // k]``
    (``k = slot_of.shape[1]``) for the slots that hold a pair, zero rows for the others (``sorted_pairs`` and
    ``slot_of`` are :func:`moe_permute`'s). ``x`` ``(T, N)`` float32 / float16 / bfloat16; returns ``(S, N)``,
    ``S = sorted_pairs.numel()``. Autograd: ``x``, through :func:`moe_combine` with unit weights (each token's
    slots summed in pair order, no atomics: the same bits every run, where ``index_add`` would not be).
    """
    return _ops.moe_gather.default(x, sorted_pairs, slot_of)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, variant: str = "auto") -> torch.Tensor:
    """``torch._grouped_mm(x, w, offs)`` for 2-D ``x`` and 3-D ``w``: ``out[r] = x[r] @ w[g]`` for the rows
    ``offs[g-1] <= r < offs[g]`` of group g; rows from ``offs[-1]`` on are zeros.

    ``x`` ``(M, K)`` (rows sorted by group), ``w`` ``(E, K, N)`` (any strides: ``w.transpose(-2, -1)`` of an
    ``(E, N, K)`` tensor too), ``offs`` ``(E,)`` int32 cumulative ends, read on the device only; one dtype
    (float32, float16, bfloat16), products accumulated in float32. Autograd: ``x`` and ``w`` (not offs).
    """
    return _ops.grouped_mm.default(x, w, offs, variant=variant)


def grouped_mm_swiglu(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, variant: str = "auto") -> torch.Tensor:
    """The expert MLP's up projection with SwiGLU: ``w`` ``(E, K, 2F)`` holds ``[gate | up]`` of each group, and
    ``out[r] = silu(x[r] @ w[g][:, :F]) * (x[r] @ w[g][:, F:])`` for the rows of group g (``offs`` as in
    :func:`grouped_mm`; rows from ``offs[-1]`` on are zeros); ``out`` is ``(M, F)``.

    The same as ``silu_and_mul(grouped_mm(x, w, offs))``, in one pass on the ``wgmma`` rung: the SwiGLU runs on
    the float32 accumulators in the GEMM's epilogue (each tile holds 128 gate columns and the same 128 up
    columns), so the ``(M, 2F)`` product is written only when autograd needs it (the backward's input) and
    never read back in the forward. Autograd: ``x`` and ``w``.
    """
    save = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    return _ops.grouped_mm_swiglu.default(x, w, offs, save_pre=save, variant=variant)[0]


# The registrations around the C++ ops: the fake kernels, then autograd.
from . import _fakes, _autograd  # noqa: E402,F401
