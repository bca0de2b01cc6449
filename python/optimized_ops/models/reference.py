"""The plain-PyTorch math of ``Transformer(config, reference=True)``: the same architecture as the optimized
model, written with :mod:`torch.nn.functional` only, to be the yardstick of the parity tests (in float64) and
the torch peer of the benchmarks (eager, ``torch.compile``).

* :func:`rope`: rotary embedding, neox layout (HF's ``rotate_half``), angles ``position * inv_freq`` in float32
  (float64 for float64 tensors), as HF and vLLM compute them;
* :func:`causal_attention`: ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=...)``;
* :func:`cached_attention`: attention of new tokens over a static KV cache, with an explicit mask;
* :func:`swiglu`: ``F.silu(gate) * up`` between two ``F.linear``;
* :func:`moe`: the Mixture-of-Experts layer with the routing of :func:`optimized_ops.moe_layer` (below),
  computed by a loop over the experts, and its balancing losses.

The MoE routing, as ``optimized_ops.moe_route`` (``topk_softmax=False``) documents it: the router logits in
float32 (float64 for float64 inputs); softmax scoring takes the softmax over the E logits **then** the top k
(the weights are the chosen probabilities), sigmoid scoring the sigmoid of each logit then the top k; the k
weights are divided by their sum when ``normalize`` (default: ``top_k > 1``); capacity mode keeps each expert's
first ``capacity`` pairs in pair order ``p = t * k + j``. The losses: ``aux = E * sum_i f_i P_i`` (``f`` the
fraction of the T k pairs routed to expert i, before the capacity; ``P`` the mean router probability: the
softmax, or the sigmoids normalized to sum 1) and ``z = mean_t logsumexp(logits_t)^2``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["rope", "causal_attention", "cached_attention", "swiglu", "moe"]


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` ``(B, S, H, D)`` at ``positions`` ``(B, S)`` or ``(S,)``, neox layout (pairs
    ``(x[i], x[i + D/2])``), computed in float32 (float64 for float64 ``x``) and rounded once to ``x``'s dtype.

    Parameters
    ----------
    x : torch.Tensor
        ``(B, S, H, D)``, D even.
    positions : torch.Tensor
        ``(B, S)`` or ``(S,)``, integers.
    theta : float
        The base of the frequencies: ``inv_freq[i] = theta ** (-2 i / D)``.

    Returns
    -------
    torch.Tensor
        A new tensor of ``x``'s shape and dtype.
    """
    ct = _math_dtype(x.dtype)
    d = x.shape[-1]
    half = d // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=ct, device=x.device) / d))   # (D/2,)
    angle = positions.to(ct)[..., None] * inv_freq                                      # (B?, S, D/2)
    if angle.dim() == 2:
        angle = angle[None]
    cos, sin = angle.cos()[:, :, None, :], angle.sin()[:, :, None, :]                   # (B, S, 1, D/2)
    x1, x2 = x[..., :half].to(ct), x[..., half:].to(ct)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention in the ``(B, S, H, D)`` layout through ``F.scaled_dot_product_attention`` (GQA by
    ``enable_gqa``); returns ``(B, S, H_q, D)``."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, L, H_kv, D) -> (B, L, H_kv * groups, D), head h reading kv head h // groups (an expand + reshape:
    no host synchronisation, unlike repeat_interleave's general path)."""
    if groups == 1:
        return t
    b, length, h, d = t.shape
    return t[:, :, :, None, :].expand(b, length, h, groups, d).reshape(b, length, h * groups, d)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     length: int) -> torch.Tensor:
    """Attention of new queries over a static cache: ``q`` ``(B, S, H_q, D)`` at ``positions`` ``(B, S)``
    sees the cache slots ``j <= position`` (``j < length``: the last slot of ``k_cache`` ``(B, length + 1,
    H_kv, D)`` is the padding tokens' scratch slot, never read). A padding query (position < 0) reads slot 0
    (finite; its output is never used). Returns ``(B, S, H_q, D)``."""
    groups = q.shape[2] // k_cache.shape[2]
    j = torch.arange(length + 1, device=q.device)
    pos = positions.long()[:, :, None]                                     # (B, S, 1)
    mask = (j <= pos) & (j < length)                                       # (B, S, L + 1)
    mask = mask | ((~mask.any(-1, keepdim=True)) & (j == 0))
    k = _expand_kv(k_cache, groups).transpose(1, 2)                        # (B, H_q, L + 1, D)
    v = _expand_kv(v_cache, groups).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None])
    return out.transpose(1, 2)


def swiglu(x: torch.Tensor, w13: torch.Tensor, b13: Optional[torch.Tensor], w2: torch.Tensor,
           b2: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, w2, b2)`` with ``[gate | up] = F.linear(x, w13, b13)``."""
    gate, up = F.linear(x, w13, b13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2, b2)


def moe(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        scoring: str = "softmax", normalize: bool = True, capacity_factor: Optional[float] = None,
        aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001, topk_ids: Optional[torch.Tensor] = None):
    """The MoE layer of the module docstring, in plain torch: a loop over the experts, each a SwiGLU MLP
    (``w13[e]`` ``(d, 2 d_ff)`` = ``[gate | up]``, ``w2[e]`` ``(d_ff, d)``) on the tokens routed to it.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., d)``.
    router_weight, w13, w2 : torch.Tensor
        ``(E, d)``, ``(E, d, 2 d_ff)``, ``(E, d_ff, d)``.
    top_k : int
    scoring, normalize, capacity_factor, aux_loss_coef, z_loss_coef
        As :class:`optimized_ops.models.MoEConfig` (``normalize`` resolved to a bool).
    topk_ids : torch.Tensor, optional
        ``(T, k)``: the experts to use instead of this function's own top k (their weights are still the
        scores at those experts): for tests that compare implementations whose routing differs by rounding
        (16-bit activations) -- the choice of the implementation under test, checked apart.

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor)
        ``out`` (``x``'s shape and dtype), ``loss = aux_loss_coef * aux + z_loss_coef * z`` (0-D, in the
        router's math dtype: float32, float64 for float64) and the chosen experts ``topk_ids`` ``(T, k)``
        int64.

    Notes
    -----
    Each expert's rows are found with ``torch.where`` (a host synchronisation): this reference is not
    capturable in a CUDA graph.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    t, e, k = x2.shape[0], router_weight.shape[0], top_k
    ct = _math_dtype(x.dtype)
    no_autocast = torch.autocast(x.device.type, enabled=False) if x.device.type in ("cpu", "cuda") \
        else contextlib.nullcontext()
    with no_autocast:                                                      # the router in float32, always
        logits = F.linear(x2.to(ct), router_weight.to(ct))                # (T, E)
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    if topk_ids is None:
        weights, ids = torch.topk(scores, k, dim=-1)                       # (T, k), best first
    else:
        ids = topk_ids.to(device=scores.device, dtype=torch.int64).reshape(t, k)
        weights = scores.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    keep = torch.ones_like(ids, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = int(math.ceil(float(capacity_factor) * t * k / e))
        flat = ids.reshape(-1)
        # rank of each pair among its expert's pairs, in pair order p = t k + j
        onehot = F.one_hot(flat, e)                                        # (T k, E)
        rank = (onehot.cumsum(0) - onehot).gather(1, flat[:, None])[:, 0]
        keep = (rank < capacity).reshape(t, k)
    out = torch.zeros(t, shape[-1], dtype=ct, device=x.device)
    for expert in range(e):
        tok, j = torch.where((ids == expert) & keep)
        if tok.numel() == 0:
            continue
        gate, up = (x2[tok] @ w13[expert]).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[expert]
        out = out.index_add(0, tok, y.to(ct) * weights[tok, j, None])
    out = out.to(x.dtype).reshape(shape)

    load = torch.bincount(ids.reshape(-1), minlength=e).to(ct) / max(t * k, 1)
    if scoring == "softmax":
        probs = logits.softmax(dim=-1)
    else:
        s = logits.sigmoid()
        probs = s / s.sum(dim=-1, keepdim=True)
    aux = e * (load * probs.mean(dim=0)).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return out, aux_loss_coef * aux + z_loss_coef * z, ids
