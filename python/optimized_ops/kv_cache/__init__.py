"""The paged KV cache and decode attention from PyTorch: ``PagedKVCache``, ``append_kv`` and
``paged_attention_decode`` over the ``torch.ops.optimized.kv_cache_append`` and
``paged_attention_decode`` ops of the C++ library (``src/torch/kv_cache_ops.cpp``; semantics in
``include/optimized/kv_cache.h``).

The cache keeps K and V in fixed-size pages (PagedAttention): ``k_pages``, ``v_pages`` of shape
``(num_pages, page_size, H_kv, D)``. Which pages a sequence owns is the caller's business, as in vLLM
and FlashInfer: a page table ``(B, max_pages_per_seq)`` int32 maps page ``p`` of sequence ``b`` to a
cache page, and token ``t`` of sequence ``b`` lives in page ``page_table[b, t // page_size]``, slot
``t % page_size``; ``seq_lens`` ``(B,)`` int32 says how many tokens each sequence holds.

=============  ======  ======================================================================
variant        device  what runs
=============  ======  ======================================================================
``"auto"``     any     ``cpu`` on the CPU; on CUDA ``paged_mma`` where it runs, else ``paged_split``
``"cpu"``      CPU     threads over (sequence, kv head): the readable reference rung
``"contiguous_naive"`` CUDA  one block per (sequence, query head, query), two passes
``"paged"``    CUDA    one block per (sequence, kv head), GQA packed, online softmax
``"paged_split"`` CUDA paged over key chunks (flash-decoding) + an LSE merge
``"paged_mma"`` CUDA  paged_split's split, per-warp cp.async rings and tensor cores (fp16 / bf16 q,
                      head_dim 64 / 128 / 256, 16-byte aligned cache rows)
=============  ======  ======================================================================

CUDA graphs: ``plan = plan_paged_decode(...)`` once, then ``paged_attention_decode(..., plan=plan,
validate=False)`` and ``append_kv(..., validate=False)`` capture in ``torch.cuda.graphs`` (no host
sync; decode's workspace comes from torch's caching allocator on the current stream).

No autograd. These are inference ops: the cache is state written in place, and decode has no
backward. ``paged_attention_decode`` refuses a ``q`` that requires grad while grad mode is on
(RuntimeError: call it under ``torch.no_grad()`` / ``torch.inference_mode()``, or pass
``q.detach()``); ``torch.ops.optimized.paged_attention_decode`` called directly has no autograd
kernel, so torch's fallback for such ops applies (its outputs carry no usable gradient).

The package:

* ``kv_cache/__init__.py`` (here): the cache, the functions and the ladder's query;
* ``kv_cache/_fakes.py``: fake kernels, so that ``torch.compile(fullgraph=True)`` traces a decode step
  (append's writes into the pages are tracked by functionalization through the schema's mutation
  annotations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional, Union

import torch

from .._library import load
from .._variants import register_family
from . import _fakes  # noqa: F401 - registers the fake kernels

_lib = load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized

__all__ = ["PagedKVCache", "append_kv", "paged_attention_decode", "paged_attention_prefill", "kv_cache_variants",
           "DecodePlan",
           "plan_paged_decode"]

_FP8 = torch.float8_e4m3fn


def kv_cache_variants() -> list[str]:
    """Names of the variants of the KV-cache family, naive to best (``"auto"`` excluded): the C++ table,
    through ``torch.ops.optimized.kv_cache_variants()``; the same list as
    ``optimized_ops.variants("kv_cache")``.

    Returns
    -------
    list of str
        ``["cpu"]`` for now.
    """
    return list(_ops.kv_cache_variants())


register_family("kv_cache", kv_cache_variants)


class PagedKVCache:
    """K and V pages of a paged KV cache, zero-initialised.

    Parameters
    ----------
    num_pages : int
        Pages in the cache (shared by every sequence; the caller assigns them through page tables).
    page_size : int
        Tokens per page, 1 to 256.
    num_kv_heads : int
        H_kv.
    head_dim : int
        D.
    dtype : torch.dtype
        Of the pages: float16, bfloat16 (default), float32, float64 (``cpu`` variant), or
        ``torch.float8_e4m3fn`` (values stored as ``round(x / scale)``, read back as ``fp8 * scale``).
    device : torch.device or str, optional
        Default: torch's default device.
    k_scale, v_scale : torch.Tensor, optional
        float32 ``(H_kv,)`` per-head scales of an fp8 cache; default ones. Refused for other dtypes.

    Attributes
    ----------
    k_pages, v_pages : torch.Tensor
        ``(num_pages, page_size, H_kv, D)``.
    k_scale, v_scale : torch.Tensor or None
        The fp8 scales (None for other dtypes).

    Examples
    --------
    >>> cache = optimized_ops.PagedKVCache(64, 16, 8, 128, dtype=torch.bfloat16, device="cpu")
    >>> cache.k_pages.shape
    torch.Size([64, 16, 8, 128])
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: Optional[Union[str, torch.device]] = None,
                 k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None):
        for name, value, low in (("num_pages", num_pages, 1), ("page_size", page_size, 1),
                                 ("num_kv_heads", num_kv_heads, 1), ("head_dim", head_dim, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"optimized_ops.PagedKVCache: {name}: expected an int >= {low}; given {value!r}")
        if page_size > 256:
            raise ValueError(f"optimized_ops.PagedKVCache: page_size: expected 1 to 256; given {page_size}")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)
        if dtype == _FP8:
            self.k_scale = self._scale("k_scale", k_scale, num_kv_heads)
            self.v_scale = self._scale("v_scale", v_scale, num_kv_heads)
        else:
            if k_scale is not None or v_scale is not None:
                raise ValueError(f"optimized_ops.PagedKVCache: k_scale, v_scale: expected None for a {dtype} cache "
                                 "(scales belong to float8_e4m3fn caches)")
            self.k_scale = self.v_scale = None

    def _scale(self, name: str, scale: Optional[torch.Tensor], heads: int) -> torch.Tensor:
        if scale is None:
            return torch.ones(heads, dtype=torch.float32, device=self.k_pages.device)
        if not isinstance(scale, torch.Tensor):
            scale = torch.tensor(scale, dtype=torch.float32)
        return scale.to(device=self.k_pages.device, dtype=torch.float32).expand(heads).contiguous()

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_pages.dtype

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens of one sequence."""
        return -(-int(num_tokens) // self.page_size)

    def gather(self, page_table: torch.Tensor, seq_lens: torch.Tensor,
               dtype: Optional[torch.dtype] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached K and V of every sequence as contiguous ``(seq_len, H_kv, D)`` tensors (a copy,
        dequantized for an fp8 cache; ``dtype`` defaults to the cache's, float32 for fp8): for
        inspection and references, not for speed."""
        out = []
        table, lens = page_table.cpu().long(), seq_lens.cpu().long()
        want = dtype or (torch.float32 if self.dtype == _FP8 else self.dtype)
        for b in range(table.shape[0]):
            n = int(lens[b])
            t = torch.arange(n)
            pages = table[b, t // self.page_size].to(self.device)
            slots = (t % self.page_size).to(self.device)
            k, v = self.k_pages[pages, slots], self.v_pages[pages, slots]
            if self.dtype == _FP8:
                k = k.float() * self.k_scale[:, None]
                v = v.float() * self.v_scale[:, None]
            out.append((k.to(want), v.to(want)))
        return out

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device})")


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A decode step fixed once on the host (``include/optimized/kv_cache.h``, ``plan_paged_decode``):
    the shape, the resolved variant, the split of ``paged_split`` / ``paged_mma`` and the workspace it needs. Made by
    ``plan_paged_decode``; passed to ``paged_attention_decode(..., plan=plan)``, which refuses a call of
    another shape and runs with the plan's variant and split (a plan stays correct for any length:
    ``max_seq_len`` only tunes the split)."""

    batch: int
    num_heads_q: int
    num_kv_heads: int
    head_dim: int
    q_len: int
    page_size: int
    max_seq_len: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    device: torch.device
    variant: str
    splits: int
    workspace_bytes: int


def plan_paged_decode(batch: int, num_heads_q: int, num_kv_heads: int, head_dim: int, *, page_size: int,
                      max_seq_len: int, dtype: torch.dtype, cache_dtype: Optional[torch.dtype] = None,
                      q_len: int = 1, device: Union[str, torch.device] = "cuda",
                      variant: str = "auto") -> DecodePlan:
    """Plans a decode step (host only: reads the device's SM count). ``cache_dtype`` defaults to
    ``dtype``. Raises ValueError / NotImplementedError naming the argument, as the C++ API."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    name, splits, ws = _ops.kv_cache_plan_decode.default(int(batch), int(num_heads_q), int(num_kv_heads),
                                                         int(head_dim), int(q_len), int(page_size),
                                                         int(max_seq_len), dtype, cache_dtype, device, variant)
    return DecodePlan(int(batch), int(num_heads_q), int(num_kv_heads), int(head_dim), int(q_len), int(page_size),
                      int(max_seq_len), dtype, cache_dtype, device, name, int(splits), int(ws))


def _check_plan(plan, q4: torch.Tensor, cache) -> None:
    if not isinstance(plan, DecodePlan):
        raise TypeError("optimized_ops.paged_attention_decode: plan: expected an optimized_ops.DecodePlan "
                        f"(plan_paged_decode); given {type(plan).__name__}")
    given = (q4.shape[0], q4.shape[2], cache.num_kv_heads, q4.shape[3], q4.shape[1], cache.page_size, q4.dtype,
             cache.dtype, q4.device)
    want = (plan.batch, plan.num_heads_q, plan.num_kv_heads, plan.head_dim, plan.q_len, plan.page_size, plan.dtype,
            plan.cache_dtype, plan.device)
    names = ("batch", "heads_q", "heads_kv", "head_dim", "q_len", "page_size", "dtype", "cache_dtype", "device")
    for name, g, w in zip(names, given, want):
        if g != w:
            raise ValueError(f"optimized_ops.paged_attention_decode: plan: expected {name} {w} (the plan's); "
                             f"given {g}")


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Index tensors: int64 (torch's default) converted to the int32 the library takes."""
    return t.to(torch.int32) if isinstance(t, torch.Tensor) and t.dtype == torch.int64 else t


def _check_cache(fn: str, cache) -> None:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"optimized_ops.{fn}: cache: expected an optimized_ops.PagedKVCache; given "
                        f"{type(cache).__name__}")


def append_kv(cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor, page_table: torch.Tensor,
              positions: torch.Tensor, *, q: Optional[torch.Tensor] = None, rope: Optional[str] = None,
              rope_theta: float = 10000.0, rotary_dim: Optional[int] = None, validate: bool = True,
              variant: str = "auto") -> Optional[torch.Tensor]:
    """Writes new tokens into the cache's pages (in place), with rotary embedding fused.

    Parameters
    ----------
    cache : PagedKVCache
    k, v : torch.Tensor
        ``(B, S_new, H_kv, D)`` (or ``(B, H_kv, D)``: one token per sequence): the cache's dtype, or
        float16 / bfloat16 / float32 into a float8_e4m3fn cache (quantized with the cache's scales,
        saturated to e4m3's range).
    page_table : torch.Tensor
        int32 ``(B, max_pages_per_seq)`` (int64 is converted).
    positions : torch.Tensor
        int32 ``(B, S_new)`` (or ``(B,)``): the position of each new token in its sequence; a
        negative position marks padding (skipped). int64 is converted.
    q : torch.Tensor, optional
        ``(B, S_new, H_q, D)`` (or ``(B, H_q, D)``): with ``rope``, rotated **in place** at the same
        positions and returned.
    rope : None, "neox" or "interleaved"
        Rotary embedding of k (and q): angle ``position * theta^(-2i / rotary_dim)`` for pair ``i``;
        ``"neox"`` pairs ``(x[i], x[i + rotary_dim / 2])`` (GPT-NeoX, HF Llama), ``"interleaved"``
        ``(x[2i], x[2i + 1])`` (GPT-J). Dimensions past ``rotary_dim`` pass through.
    rope_theta : float
    rotary_dim : int, optional
        Even, at most D; default D.
    validate : bool
        Read the page table and positions back and refuse a page index out of range (a host sync; off:
        CUDA-graph safe, out-of-range pages are skipped).
    variant : str
        ``"auto"``, ``"cpu"`` or a CUDA variant (one append kernel serves every CUDA variant).

    Returns
    -------
    torch.Tensor or None
        q (rotated in place) when given, else None.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that do not match, a bad page table or position (``validate``), an
        unknown rope layout or variant. The message names the op and the argument.
    NotImplementedError
        Dtypes or devices the variant does not take.
    """
    _check_cache("append_kv", cache)
    if rope not in (None, "none", "neox", "interleaved"):
        raise ValueError(f"optimized_ops.append_kv: rope: expected None, 'neox' or 'interleaved'; given {rope!r}")
    one_token = k.dim() == 3
    if one_token:
        k, v = k.unsqueeze(1), v.unsqueeze(1)
        if positions.dim() == 1:
            positions = positions.unsqueeze(1)
    q_op = None
    if q is not None and rope not in (None, "none"):
        q_op = q.unsqueeze(1) if q.dim() == 3 else q
    _ops.kv_cache_append.default(cache.k_pages, cache.v_pages, k, v, _int32(page_table), _int32(positions),
                                 k_scale=cache.k_scale, v_scale=cache.v_scale, q=q_op, rope=rope or "none",
                                 rope_theta=float(rope_theta), rotary_dim=int(rotary_dim or 0), validate=validate,
                                 variant=variant)
    return q


def _check_call(name: str, q: torch.Tensor, cache: PagedKVCache, window_size: Sequence[int]) -> int:
    """The checks of decode and prefill that the ops cannot make; returns the window's left side."""
    _check_cache(name, cache)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"optimized_ops.{name}: window_size: expected a pair (left, right) of ints; "
                         f"given {window_size!r}") from None
    if int(right) not in (-1, 0):
        raise ValueError(f"optimized_ops.{name}: window_size: only the left side is supported "
                         f"(right -1 or 0: no key lies after a query); given {tuple(window_size)!r}")
    if q.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(f"optimized_ops.{name}: q requires grad, but the KV-cache ops are "
                           "inference-only (no autograd): call under torch.no_grad() / torch.inference_mode(), or "
                           "pass q.detach()")
    return int(left)


def paged_attention_decode(q: torch.Tensor, cache: PagedKVCache, page_table: torch.Tensor, seq_lens: torch.Tensor,
                           *, softmax_scale: Optional[float] = None, softcap: float = 0.0,
                           window_size: Sequence[int] = (-1, -1), alibi_slopes: Optional[torch.Tensor] = None,
                           return_lse: bool = False, validate: bool = True, variant: str = "auto",
                           plan: Optional[DecodePlan] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    r"""Attention of a few new query tokens per sequence over everything cached (decode; speculative
    decoding with up to 8 query tokens).

    The ``q_len`` new tokens are the last ``q_len`` of each sequence (already appended): query ``t`` of
    sequence ``b`` sits at position ``seq_lens[b] - q_len + t`` and sees the cached keys at positions
    ``<=`` its own (causal inside the new tokens), within the window when one is given. Scores as in
    ``flash_attention`` (scale, softcap, ALiBi ``s -= slope * (i - j)``). Computed in float32 (float64
    for float64), rounded once to q's dtype.

    Parameters
    ----------
    q : torch.Tensor
        ``(B, H_q, D)`` (one token per sequence) or ``(B, q_len, H_q, D)``, ``q_len`` 1 to 8; the cache's
        dtype (float16 / bfloat16 / float32 with a float8_e4m3fn cache). H_q a multiple of H_kv (GQA /
        MQA).
    cache : PagedKVCache
    page_table : torch.Tensor
        int32 ``(B, max_pages_per_seq)`` (int64 is converted).
    seq_lens : torch.Tensor
        int32 ``(B,)``: tokens cached per sequence, new ones included (int64 is converted).
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``.
    softcap : float
        ``> 0``: ``s = softcap * tanh(s / softcap)``; 0: off.
    window_size : (int, int)
        ``(left, right)``: keys more than ``left`` positions before a query are masked (-1: none). Only
        the left side is supported: the right must be -1 or 0 (keys after a query never exist).
    alibi_slopes : torch.Tensor, optional
        float32 ``(H_q,)`` or ``(B, H_q)``.
    return_lse : bool
        Also return the log-sum-exp of every row: float32 ``(B, H_q)`` for 3-D q, ``(B, H_q, q_len)``
        for 4-D.
    validate : bool
        Read page_table and seq_lens back and check them (a host sync; off: CUDA-graph safe, and an
        out-of-range page reads as an empty page).
    variant : str
        ``"auto"``, ``"cpu"``, ``"contiguous_naive"``, ``"paged"``, ``"paged_split"`` or ``"paged_mma"``.
    plan : DecodePlan, optional
        From ``plan_paged_decode``: the call must have its shape; runs the plan's variant and split
        (``variant`` is then ignored). With ``validate=False``, capturable in a CUDA graph.

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        out of q's shape and dtype (a sequence of length 0, or a query that sees no key, gives 0 and
        lse ``-inf``); with ``return_lse``, ``(out, lse)``.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that do not match, a bad page table or seq_len (``validate``), a
        window with a right side, an unknown variant.
    NotImplementedError
        Dtypes or devices the variant does not take.
    RuntimeError
        q requires grad under grad mode (no autograd: these are inference ops).
    """
    left = _check_call("paged_attention_decode", q, cache, window_size)
    single = q.dim() == 3
    q4 = q.unsqueeze(1) if single else q
    max_seq_len = -1
    if plan is not None:
        _check_plan(plan, q4, cache)
        variant, max_seq_len = plan.variant, plan.max_seq_len
    out, lse = _ops.paged_attention_decode.default(
        q4, cache.k_pages, cache.v_pages, _int32(page_table), _int32(seq_lens), k_scale=cache.k_scale,
        v_scale=cache.v_scale, softmax_scale=softmax_scale, window_left=left, softcap=float(softcap),
        alibi_slopes=alibi_slopes, validate=validate, variant=variant,
        max_seq_len=max_seq_len)
    if single:
        out, lse = out.squeeze(1), lse.squeeze(-1)
    return (out, lse) if return_lse else out


def paged_attention_prefill(q: torch.Tensor, cache: PagedKVCache, page_table: torch.Tensor, seq_lens: torch.Tensor,
                            *, softmax_scale: Optional[float] = None, softcap: float = 0.0,
                            window_size: Sequence[int] = (-1, -1), alibi_slopes: Optional[torch.Tensor] = None,
                            return_lse: bool = False, validate: bool = True,
                            variant: str = "auto") -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    r"""Attention of a chunk of new tokens per sequence over the cache: chunked prefill and prefix
    caching (the cached prefix and the chunk, causal inside the chunk).

    Append the chunk first (``append_kv``); then ``q`` ``(B, S_new, H_q, D)`` holds the chunk's
    queries, right-aligned to each sequence's end: query ``t`` of sequence ``b`` sits at position
    ``seq_lens[b] - S_new + t``. A sequence whose chunk is shorter than ``S_new`` (or whose length is
    below ``S_new``) leaves its first rows at positions before its chunk (they attend as those
    positions would) or below 0 (they see no key: out 0, lse ``-inf``): chunks of different lengths
    share one padded q. Everything else as ``paged_attention_decode`` (scores, options, variants,
    validate), with any ``S_new >= 1``; no plan (a split, when the rule picks one, takes its workspace
    from the library's stream-ordered pool). ``variant="auto"`` runs chunks of 64 or more queries on
    ``flash_attention``'s varlen kernels (float16 / bfloat16 on CUDA): the sequences' K/V are gathered
    out of the pages into packed buffers first (2 x B x len x H_kv x D elements at most; len = the
    longest sequence with ``validate=True``, else the page table's capacity, max_pages x page_size).
    That route reads q and writes out as packed ``(B * S_new, H_q, D)`` rows: a q sliced out of a
    longer prompt is copied into such rows first (a q whose heads are not contiguous runs the
    ``paged_mma`` rung instead).

    Returns
    -------
    torch.Tensor or (torch.Tensor, torch.Tensor)
        out of q's shape and dtype; with ``return_lse``, ``(out, lse)`` with lse float32
        ``(B, H_q, S_new)``.
    """
    left = _check_call("paged_attention_prefill", q, cache, window_size)
    out, lse = _ops.paged_attention_prefill.default(
        q, cache.k_pages, cache.v_pages, _int32(page_table), _int32(seq_lens), k_scale=cache.k_scale,
        v_scale=cache.v_scale, softmax_scale=softmax_scale, window_left=left, softcap=float(softcap),
        alibi_slopes=alibi_slopes, validate=validate, variant=variant)
    return (out, lse) if return_lse else out
