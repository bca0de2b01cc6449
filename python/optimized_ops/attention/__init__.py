"""Attention from PyTorch: ``flash_attention``, ``flash_attention_varlen`` and
``scaled_dot_product_attention`` over the ``torch.ops.optimized.attention_fwd`` / ``_bwd`` and
``attention_varlen_fwd`` / ``_bwd`` ops of the C++ library (``src/torch/attention_ops.cpp``;
semantics in ``include/optimized/attention.h``).

``out = softmax(S) V`` with ``S = scale * Q Kᵀ`` (then soft-capped, ALiBi, masked, windowed), the
log-sum-exp of every row kept for the backward. The functions take a keyword-only ``variant`` that
picks the rung of the ladder:

=============  ======  ======================================================================
variant        device  what runs
=============  ======  ======================================================================
``"auto"``     any     ``cpu`` on the CPU; on CUDA ``flash2`` where it runs the call (float16,
                       bfloat16, 16-byte aligned rows), else ``flash``
``"cpu"``      CPU     threads over (batch, head, query rows); float32 / float64 math, any D
``"naive"``    CUDA    S and P materialized in global memory: the O(N²) baseline
``"flash"``    CUDA    tiled, online softmax, S never leaves the chip (FlashAttention-1, SIMT)
``"flash2"``   CUDA    mma.sync tensor cores, cp.async double buffering (FlashAttention-2)
``"hopper"``   CUDA    sm_90a (H100 / H200 only): wgmma + TMA, a producer warp and two
                       consumer warpgroups; forward (fixed length or varlen, causal or not,
                       sliding windows) and backward (the same: fixed length or varlen,
                       causal or not, sliding windows), D 64 or 128, GQA / MQA;
                       float16 / bfloat16, 16-byte aligned rows; auto runs it for the
                       forward on an H100 / H200 from 1024 tokens with S_q = S_k, fixed
                       length (the measured rule: src/attention/attention_config.h);
                       the backward of auto is flash2's (hopper's v1 is slower)
``"triton"``   CUDA    FlashAttention-2 written in Triton (optimized_ops/triton/attention.py):
                       causal or not, softmax_scale, GQA / MQA, forward and backward
                       (``flash_attention`` only; CPU tensors under ``TRITON_INTERPRET=1``; not
                       in the C++ table: ``variants("attention", detail=True)`` lists it)
=============  ======  ======================================================================

The package is split by what torch needs around the C++ ops:

* ``attention/__init__.py`` (here): the functions and the ladder's queries;
* ``attention/_fakes.py``: fake kernels (``register_fake``), so that ``torch.compile(fullgraph=True)``,
  ``torch.export`` and meta tensors trace through the ops;
* ``attention/_autograd.py``: autograd (``optimized_ops._autograd.register_autograd``): the backward
  of every forward op is the matching ``*_bwd`` op on the same variant, from the saved out and lse.
  Forward-mode AD and double backward raise NotImplementedError.

``torch.ops.optimized.flash_attention(q, k, v)`` (the op users were promised) is a composite over
``attention_fwd`` that returns ``out``; it works after ``torch.ops.load_library`` alone (forward),
and with autograd once ``optimized_ops`` is imported.
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

__all__ = ["attention_variants", "attention_head_dims", "resolve_attention_variant", "flash_attention",
           "flash_attention_varlen", "scaled_dot_product_attention"]


# ---- the ladder ------------------------------------------------------------------------------

def attention_variants() -> list[str]:
    """Names of the variants of the attention family, naive to best (``"auto"`` excluded): the C++
    table, through ``torch.ops.optimized.attention_variants()``; the same list as
    ``optimized_ops.variants("attention")``.

    Returns
    -------
    list of str
        ``["cpu", "naive", "flash", "flash2", "hopper"]``.
    """
    return list(_ops.attention_variants())


register_family("attention", attention_variants)
register_rung("attention", "triton", "triton", _triton.availability)


def attention_head_dims() -> list[int]:
    """The head dims the CUDA rungs are compiled for, ascending (``[64, 96, 128, 256]``); any
    multiple of 8 up to 256 runs on the next of them. The ``cpu`` variant takes any head dim."""
    return list(_ops.attention_head_dims())


def resolve_attention_variant(dtype: torch.dtype, device: Union[str, torch.device], head_dim: int) -> str:
    """The variant ``"auto"`` runs for q of ``dtype`` and ``head_dim`` on ``device`` (rows aligned to
    16 bytes).

    Parameters
    ----------
    dtype : torch.dtype
        q's dtype.
    device : str or torch.device
        ``"cpu"`` or ``"cuda"`` (presence is not checked).
    head_dim : int
        D.

    Returns
    -------
    str
        ``"cpu"``, ``"flash"`` or ``"flash2"``.
    """
    return _ops.resolve_attention_variant(dtype, str(torch.device(device)), head_dim)


# ---- helpers ---------------------------------------------------------------------------------

def _window(fn: str, window_size: Sequence[int]) -> tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"optimized_ops.{fn}: window_size: expected a pair (left, right) of ints (-1: unbounded); "
                         f"given {window_size!r}") from None
    return int(left), int(right)


# ---- the functions -----------------------------------------------------------------------------

def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                    return_lse: bool = False,
                    variant: str = "auto") -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    r"""Attention with flash-attn's conventions (``flash_attn_func``): q ``(B, S_q, H_q, D)``.

    .. math::  \mathrm{out}_i = \sum_j \mathrm{softmax}_j(s_{ij}) \, v_j, \qquad
               s_{ij} = \mathrm{scale} \cdot q_i \cdot k_j \ (\text{soft-capped, ALiBi, windowed})

    Computed in float32 (float64 for float64 inputs), rounded once to the dtype.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, S_q, H_q, D)``: float16 or bfloat16 (every variant), float32 (``cpu``, ``naive``,
        ``flash``), float64 (``cpu``). Any strides with a unit-stride last dimension run without a
        copy: a ``(B, H, S, D)`` tensor passed as ``x.transpose(1, 2)`` too.
    k, v : torch.Tensor
        ``(B, S_k, H_kv, D)``, q's dtype and device; H_q a multiple of H_kv (GQA / MQA: query head
        ``h`` reads key/value head ``h // (H_q // H_kv)``).
    causal : bool
        Query ``i`` sees keys ``j <= i + S_k - S_q`` (aligned bottom-right, as flash-attn: the last
        query sees every key).
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    window_size : (int, int)
        Sliding window ``(left, right)`` around the aligned diagonal; -1: unbounded.
    softcap : float
        ``> 0``: ``s = softcap * tanh(s / softcap)`` (Gemma 2, Grok); 0: off.
    alibi_slopes : torch.Tensor, optional
        float32 ``(H_q,)`` or ``(B, H_q)``: ``s -= slope * |i + S_k - S_q - j|``.
    deterministic : bool
        The backward gives the same bits on every run (no atomics in dq; flash2 only differs).
    return_lse : bool
        Also return the log-sum-exp of every row, ``(B, H_q, S_q)`` float32 (float64 for float64
        inputs), without gradient.
    variant : str
        ``"auto"``, ``"cpu"``, ``"naive"``, ``"flash"``, ``"flash2"``, ``"hopper"`` (sm_90a; see
        the table above) or ``"triton"`` (causal,
        softmax_scale and GQA only: window_size, softcap and alibi_slopes raise
        NotImplementedError there; deterministic always).

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out`` of q's shape and dtype, laid out as q (``torch.empty_like``); with ``return_lse``,
        ``(out, lse)``. Rows that see no key (a window or causal mask with S_q > S_k) give 0 and lse
        ``-inf``.

    Raises
    ------
    ValueError
        Shapes that do not match (heads, head dims, batch), a bad window, softcap or scale, slopes of
        another shape or dtype, tensors on different devices, an unknown variant or one of the other
        device. The message names the op and the argument.
    NotImplementedError
        A dtype the variant does not run, a head dim the CUDA rungs do not take, CUDA tensors with a
        CPU-only build; forward-mode AD and double backward.

    Notes
    -----
    Autograd gives q, k and v their gradients through ``torch.ops.optimized.attention_bwd`` on the
    same variant, from the saved out and lse (dk and dv summed over each GQA group).

    Examples
    --------
    >>> q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
    >>> k = v = torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16)
    >>> optimized_ops.flash_attention(q, k, v, causal=True).shape
    torch.Size([2, 1024, 16, 128])
    """
    left, right = _window("flash_attention", window_size)
    if variant == "triton":
        out, lse = _triton.ops.flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                               window_size=(left, right), softcap=softcap, alibi_slopes=alibi_slopes)
        return (out, lse) if return_lse else out
    out, lse = _ops.attention_fwd.default(q, k, v, softmax_scale=softmax_scale, causal=causal, window_left=left,
                                          window_right=right, softcap=softcap, alibi_slopes=alibi_slopes,
                                          deterministic=deterministic, variant=variant)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           causal: bool = False, softmax_scale: Optional[float] = None,
                           window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, deterministic: bool = False,
                           return_lse: bool = False,
                           variant: str = "auto") -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed sequences of different lengths (flash-attn's ``flash_attn_varlen_func``).

    Parameters
    ----------
    q : torch.Tensor
        ``(total_q, H_q, D)``: the queries of every sequence, one after the other (no padding).
    k, v : torch.Tensor
        ``(total_k, H_kv, D)``.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor
        int32 ``(B + 1,)`` on q's device: sequence ``b`` is rows ``cu[b] .. cu[b + 1] - 1``
        (``cu[0] = 0``, non-decreasing, ``cu[B]`` the total). Sequences may be empty or of length 1.
    max_seqlen_q, max_seqlen_k : int
        At least the longest sequence (the CUDA grids are sized by them).
    causal, softmax_scale, window_size, softcap, alibi_slopes, deterministic, variant
        As for :func:`flash_attention`, per sequence (causal aligned bottom-right in each).
    return_lse : bool
        Also return lse ``(H_q, total_q)``.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        ``out`` of q's shape and dtype; with ``return_lse``, ``(out, lse)``.

    Raises
    ------
    ValueError
        As for :func:`flash_attention`; cu_seqlens not int32, of another length than each other, not
        starting at 0, decreasing or not ending at the total (checked on the CPU, and on CUDA outside
        CUDA-graph capture, which reads them back to the host).
    NotImplementedError
        As for :func:`flash_attention`.

    Examples
    --------
    >>> cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)  # lengths 3, 0, 7
    >>> q = k = v = torch.randn(10, 4, 64)
    >>> optimized_ops.flash_attention_varlen(q, k, v, cu, cu, 7, 7, causal=True).shape
    torch.Size([10, 4, 64])
    """
    left, right = _window("flash_attention_varlen", window_size)
    out, lse = _ops.attention_varlen_fwd.default(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 softmax_scale=softmax_scale, causal=causal, window_left=left,
                                                 window_right=right, softcap=softcap, alibi_slopes=alibi_slopes,
                                                 deterministic=deterministic, variant=variant)
    return (out, lse) if return_lse else out


def _sdpa_error(arg: str, text: str) -> str:
    return f"optimized_ops.scaled_dot_product_attention: {arg}: {text}"


def _as_4d(t: torch.Tensor, lead: tuple, rank: int) -> torch.Tensor:
    """t (..., H, S, E) with its leading dimensions broadcast to `lead`, as a 4-D (B, H, S, E) tensor: a
    view (stride 0 where broadcast) for rank <= 4, a reshape (a copy where the strides need one) above."""
    if rank == 2:
        return t[None, None]
    if rank == 3:
        return t[None]
    t = t.expand(*lead, *t.shape[-3:])
    return t if rank == 4 else t.reshape(-1, *t.shape[-3:])


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                                 *, variant: str = "auto") -> torch.Tensor:
    """A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` on the optimized-ops
    kernels: the (..., H, S, E) layout, top-left causal, boolean and additive masks, GQA.

    Parameters
    ----------
    query : torch.Tensor
        ``(B, H_q, L, E)`` (also ``(H_q, L, E)``, ``(L, E)`` and more leading batch dimensions, as
        torch); dtypes as for :func:`flash_attention`. Passed to the kernels as a transposed view (no
        copy, any strides with a unit-stride last dimension).
    key, value : torch.Tensor
        ``(B, H_kv, S, E)``, the rank of query; leading (batch) dimensions broadcast against query's
        (by stride-0 views). ``value``'s last dimension must equal ``E``.
    attn_mask : torch.Tensor, optional
        Broadcastable to ``(B, H_q, L, S)``: bool (True: attend) or additive (query's dtype or
        float32). Read where it lies, as a broadcast view (no O(L·S) copy for rank <= 4). A row that
        attends to no key gives 0 (and lse -inf). A mask that requires grad is refused
        (no gradient flows to the mask).
    dropout_p : float
        Must be 0: dropout is not implemented (NotImplementedError).
    is_causal : bool
        Query ``i`` sees keys ``j <= i`` (aligned top-left, as torch); not with ``attn_mask``.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    enable_gqa : bool
        Allow ``H_q`` a multiple of ``H_kv`` (query head ``h`` reads key/value head
        ``h // (H_q // H_kv)``, as torch). Without it the heads must be equal.
    variant : str, keyword-only
        As for :func:`flash_attention`.

    Returns
    -------
    torch.Tensor
        ``(B, H_q, L, E)`` (query's leading dimensions), query's dtype: a transposed view of the
        kernel's ``(B, L, H_q, E)`` output, laid out as query (contiguous for a contiguous query).

    Raises
    ------
    ValueError
        Ranks that differ or are below 2, unequal heads without ``enable_gqa``, ``attn_mask`` with
        ``is_causal``, a mask that does not broadcast, a negative ``dropout_p``; and what
        :func:`flash_attention` raises.
    NotImplementedError
        ``dropout_p > 0``; a mask that requires grad; and what :func:`flash_attention` raises.

    Examples
    --------
    >>> q = torch.randn(2, 8, 128, 64)
    >>> k = v = torch.randn(2, 8, 128, 64)
    >>> torch.testing.assert_close(optimized_ops.scaled_dot_product_attention(q, k, v, is_causal=True),
    ...                            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    """
    if dropout_p != 0.0:
        if dropout_p < 0.0:
            raise ValueError(_sdpa_error("dropout_p", f"expected a probability in [0, 1); given {dropout_p}"))
        raise NotImplementedError(_sdpa_error(
            "dropout_p", f"dropout is not implemented by the optimized-ops attention kernels; given {dropout_p} "
            "(pass dropout_p=0.0, e.g. `dropout_p if self.training else 0.0` at inference, or use "
            "torch.nn.functional.scaled_dot_product_attention for training with attention dropout)"))
    if is_causal and attn_mask is not None:
        raise ValueError(_sdpa_error("attn_mask", "expected None with is_causal=True (torch's rule: one or the "
                                                  "other); given a mask"))
    rank = query.dim()
    if rank < 2 or key.dim() != rank or value.dim() != rank:
        raise ValueError(_sdpa_error("query", f"expected query, key and value of one rank >= 2 ((..., H, L, E)); "
                                              f"given ranks {query.dim()}, {key.dim()}, {value.dim()}"))
    if rank >= 3 and not enable_gqa:
        for name, t in (("key", key), ("value", value)):
            if t.shape[-3] != query.shape[-3]:
                raise ValueError(_sdpa_error(name, f"expected {query.shape[-3]} heads (query's; pass "
                                                   f"enable_gqa=True for grouped-query attention); given "
                                                   f"{t.shape[-3]}"))
    lead = ()
    if rank >= 4:
        try:
            lead = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3]))
        except RuntimeError:
            raise ValueError(_sdpa_error("key", f"expected batch dimensions that broadcast against query's "
                                                f"{list(query.shape[:-3])}; given {list(key.shape[:-3])} "
                                                f"(value {list(value.shape[:-3])})")) from None
    q4, k4, v4 = (_as_4d(t, lead, rank) for t in (query, key, value))
    mask4 = None
    if attn_mask is not None:
        if attn_mask.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError(_sdpa_error("attn_mask", "gradients of the mask are not implemented; given a "
                                                               "mask that requires grad (detach it)"))
        heads, length_q, length_k = q4.shape[1], q4.shape[2], k4.shape[2]
        full = (*lead, heads, length_q, length_k) if rank >= 3 else (length_q, length_k)
        try:  # broadcastable *to* full: never larger than it in any dimension
            ok = attn_mask.dim() <= len(full) and torch.broadcast_shapes(attn_mask.shape, full) == torch.Size(full)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(_sdpa_error("attn_mask", f"expected a shape broadcastable to {list(full)}; given "
                                                      f"{list(attn_mask.shape)}"))
        mask4 = _as_4d(attn_mask.expand(full), lead, rank) if rank >= 4 else attn_mask.expand(full)
        mask4 = mask4 if rank >= 4 else (mask4[None] if rank == 3 else mask4[None, None])
    out, _ = _ops.attention_fwd.default(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2),
                                        softmax_scale=scale, causal=is_causal, top_left=True, attn_mask=mask4,
                                        deterministic=torch.are_deterministic_algorithms_enabled(),
                                        variant=variant)
    out = out.transpose(1, 2)  # (B, H_q, L, E)
    if rank == 2:
        return out[0, 0]
    if rank == 3:
        return out[0]
    return out if rank == 4 else out.reshape(*lead, *out.shape[1:])


# The registrations around the C++ ops: fake kernels, then autograd.
from . import _fakes, _autograd  # noqa: E402,F401
