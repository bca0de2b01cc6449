"""The KV caches of :meth:`optimized_ops.models.Transformer.forward_cached` (made by
:meth:`~optimized_ops.models.Transformer.make_cache`):

* :class:`PagedDecodeCache` (the optimized model): one :class:`optimized_ops.PagedKVCache` per layer and one
  page table shared by the layers; tokens are written by :func:`optimized_ops.append_kv` (RoPE fused) and read
  by :func:`optimized_ops.paged_attention_prefill` / :func:`optimized_ops.paged_attention_decode`;
* :class:`StaticDecodeCache` (the reference model): a preallocated ``(B, max_len + 1, H_kv, D)`` K and V per
  layer, written with ``index_copy_`` and read through a mask (a "static KV cache", as HF's ``StaticCache``: the
  shapes never change, so a decode step can be captured in a CUDA graph or compiled with
  ``torch.compile(mode="reduce-overhead")``).

Both hold ``batch_size`` rows; a forward of ``B <= batch_size`` sequences uses rows ``0 .. B - 1``. Neither
records the sequences' lengths: a forward passes the positions of its tokens, and the lengths follow from them
(``last position + 1``), on the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kv_cache import DecodePlan, PagedKVCache, plan_paged_decode

__all__ = ["PagedDecodeCache", "StaticDecodeCache"]


class PagedDecodeCache:
    """Paged K/V of every layer of an optimized :class:`~optimized_ops.models.Transformer`.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Of the model.
    batch_size : int
        Sequences (rows of the page table).
    max_len : int
        Tokens each sequence may hold (prompt and generated).
    page_size : int
        Tokens per page, 1 to 256.
    dtype, device
        Of the pages (the model's).
    validate : bool, optional
        Whether the KV-cache ops read the page table and lengths back to check them (a host synchronisation
        per op); None: on the CPU only. Off, a step is CUDA-graph safe.

    Attributes
    ----------
    layers : list of PagedKVCache
        One per layer, ``ceil(max_len / page_size) * batch_size`` pages each.
    page_table : torch.Tensor
        int32 ``(batch_size, ceil(max_len / page_size))``: sequence ``b`` owns pages ``b * P .. b * P + P - 1``
        of every layer (a static tensor: a CUDA graph reads it where it lies).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, batch_size: int, max_len: int,
                 page_size: int = 16, dtype: torch.dtype = torch.float32, device=None,
                 validate: Optional[bool] = None) -> None:
        for name, v in (("batch_size", batch_size), ("max_len", max_len), ("page_size", page_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PagedDecodeCache: {name}: expected an int >= 1; given {v!r}")
        if page_size > 256:
            raise ValueError(f"PagedDecodeCache: page_size: expected 1 to 256; given {page_size}")
        device = torch.device(device) if device is not None else torch.get_default_device()
        pages_per_seq = -(-max_len // page_size)
        self.batch_size, self.max_len, self.page_size = batch_size, max_len, page_size
        self.layers = [PagedKVCache(batch_size * pages_per_seq, page_size, num_kv_heads, head_dim, dtype=dtype,
                                    device=device) for _ in range(num_layers)]
        self.page_table = torch.arange(batch_size * pages_per_seq, dtype=torch.int32,
                                       device=device).reshape(batch_size, pages_per_seq)
        self.validate = (device.type == "cpu") if validate is None else bool(validate)
        self._plans: dict[tuple, DecodePlan] = {}

    @property
    def device(self) -> torch.device:
        return self.page_table.device

    def plan(self, batch: int, num_heads_q: int, dtype: torch.dtype) -> Optional[DecodePlan]:
        """The decode plan (:func:`optimized_ops.plan_paged_decode`) for ``batch`` rows, made once and kept;
        None on the CPU (the CPU rung has no plan to make)."""
        if self.device.type != "cuda":
            return None
        key = (batch, num_heads_q, dtype)
        if key not in self._plans:
            c = self.layers[0]
            self._plans[key] = plan_paged_decode(batch, num_heads_q, c.num_kv_heads, c.head_dim,
                                                 page_size=self.page_size, max_seq_len=self.max_len, dtype=dtype,
                                                 cache_dtype=c.dtype, device=self.device)
        return self._plans[key]

    def __repr__(self) -> str:
        c = self.layers[0]
        return (f"PagedDecodeCache(layers={len(self.layers)}, batch_size={self.batch_size}, max_len={self.max_len}, "
                f"page_size={self.page_size}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, dtype={c.dtype}, "
                f"device={c.device})")


class StaticDecodeCache:
    """Preallocated K/V of every layer of a reference :class:`~optimized_ops.models.Transformer`.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Of the model.
    batch_size, max_len : int
        Sequences, and tokens each may hold.
    dtype, device
        Of the tensors (the model's).

    Attributes
    ----------
    k, v : list of torch.Tensor
        Per layer, zeros ``(batch_size, max_len + 1, H_kv, D)``: slot ``p`` holds position ``p``; the last slot
        takes the writes of padding tokens (position < 0) and is never read. On CUDA they are marked as static
        addresses for ``torch.compile`` (``torch._dynamo.mark_static_address``), as HF's static cache is.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, batch_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        for name, v in (("batch_size", batch_size), ("max_len", max_len)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"StaticDecodeCache: {name}: expected an int >= 1; given {v!r}")
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.batch_size, self.max_len = batch_size, max_len
        shape = (batch_size, max_len + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        if device.type == "cuda":
            try:
                import torch._dynamo as dynamo
                for t in (*self.k, *self.v):
                    dynamo.mark_static_address(t)
            except (ImportError, AttributeError):  # torch without dynamo: nothing to mark
                pass

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Writes ``k``, ``v`` ``(B, S, H_kv, D)`` at ``positions`` ``(B, S)`` of rows ``0 .. B - 1`` (in place;
        positions outside ``[0, max_len)`` go to the scratch slot)."""
        b, s = positions.shape
        slots = self.max_len + 1
        pos = positions.long()
        slot = torch.where((pos >= 0) & (pos < self.max_len), pos, self.max_len)
        index = (torch.arange(b, device=pos.device)[:, None] * slots + slot).reshape(-1)
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            cache.view(-1, *cache.shape[2:]).index_copy_(0, index, new.reshape(-1, *new.shape[2:]).to(cache.dtype))

    def __repr__(self) -> str:
        return (f"StaticDecodeCache(layers={len(self.k)}, batch_size={self.batch_size}, max_len={self.max_len}, "
                f"num_kv_heads={self.k[0].shape[2]}, head_dim={self.k[0].shape[3]}, dtype={self.k[0].dtype}, "
                f"device={self.device})")
