"""Fake kernels of the KV-cache ops (``torch.library.register_fake``), for
``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors:

* ``kv_cache_append`` mutates k_pages, v_pages (and q) in place and returns nothing: its fake does
  nothing but check the devices (functionalization, from the schema's ``(a!)`` annotations, tracks
  the writes);
* ``paged_attention_decode`` and ``paged_attention_prefill`` return out laid out as q (``torch.empty_like``, contiguous where that
  would leave the last dimension strided: the glue's rule) and lse ``(B, H_q, q_len)`` float32.

They check only what the outputs are computed from, with the glue's words: q's rank (4:
``(B, q_len, H_q, D)``) and one device for every tensor. The rest is the C++ library's, checked when
the compiled graph runs the real kernel.
"""

from __future__ import annotations

import torch

from .._fakes import one_device
from .._library import load
from ..attention._fakes import output_like

load()  # registers torch.ops.optimized.* before the registrations below

__all__: list[str] = []


@torch.library.register_fake("optimized::kv_cache_append")
def _kv_cache_append_fake(k_pages, v_pages, k, v, page_table, positions, *, k_scale=None, v_scale=None, q=None,
                          rope="none", rope_theta=10000.0, rotary_dim=0, validate=True, variant="auto"):
    one_device("kv_cache_append", k_pages=k_pages, v_pages=v_pages, k=k, v=v, page_table=page_table,
               positions=positions, k_scale=k_scale, v_scale=v_scale, q=q)
    return None


def _attention_over_cache(op, tokens, q, k_pages, v_pages, page_table, seq_lens, k_scale, v_scale, alibi_slopes):
    """(out, lse) of decode / prefill: out laid out as q, lse (B, H_q, tokens) float32."""
    one_device(op, q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seq_lens=seq_lens,
               k_scale=k_scale, v_scale=v_scale, alibi_slopes=alibi_slopes)
    torch._check_value(q.dim() == 4, lambda: (
        f"optimized::{op}: q: expected 4 dimensions (B, {tokens}, H_q, D); given {q.dim()} (shape {list(q.shape)})"))
    b, q_len, h_q, _ = q.shape
    return output_like(q), q.new_empty((b, h_q, q_len), dtype=torch.float32)


@torch.library.register_fake("optimized::paged_attention_decode")
def _paged_attention_decode_fake(q, k_pages, v_pages, page_table, seq_lens, *, k_scale=None, v_scale=None,
                                 softmax_scale=None, window_left=-1, softcap=0.0, alibi_slopes=None, validate=True,
                                 variant="auto", max_seq_len=-1):
    return _attention_over_cache("paged_attention_decode", "q_len", q, k_pages, v_pages, page_table, seq_lens,
                                 k_scale, v_scale, alibi_slopes)


@torch.library.register_fake("optimized::paged_attention_prefill")
def _paged_attention_prefill_fake(q, k_pages, v_pages, page_table, seq_lens, *, k_scale=None, v_scale=None,
                                  softmax_scale=None, window_left=-1, softcap=0.0, alibi_slopes=None, validate=True,
                                  variant="auto"):
    return _attention_over_cache("paged_attention_prefill", "S_new", q, k_pages, v_pages, page_table, seq_lens,
                                 k_scale, v_scale, alibi_slopes)
