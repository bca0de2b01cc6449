"""Fake kernels of the attention ops (``torch.library.register_fake``): the outputs of
``torch.ops.optimized.attention_fwd`` / ``_bwd`` and ``attention_varlen_fwd`` / ``_bwd`` as the C++ glue
(``src/torch/attention_ops.cpp``) allocates them, without running anything, for
``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors. ``flash_attention`` is a
composite over ``attention_fwd`` and needs none.

Layouts, as the glue: out, dq, dk, dv are laid out as their operand (``torch.empty_like``), contiguous
where that would leave the last dimension strided (:func:`output_like`); lse is a fresh contiguous
float32 tensor (float64 for float64 inputs), (B, H_q, S_q) or, varlen, (H_q, total_q).

They check only what the output shapes are computed from, with the glue's words: q's rank (4:
(B, S_q, H_q, D); varlen 3: (total_q, H_q, D)), and one device for every tensor. The rest (k and v
against q, dtypes, the mask, the slopes, cu_seqlens, the options, the variant) is the C++ library's,
checked when the compiled graph runs the real kernel.
"""

from __future__ import annotations

import torch

from .._fakes import one_device
from .._library import load

load()  # registers torch.ops.optimized.* before the registrations below

__all__ = ["output_like", "lse_dtype"]


def _last_dim_contiguous(t: torch.Tensor) -> bool:
    return t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1


def output_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor laid out as t (torch.empty_like), contiguous where that leaves the last
    dimension strided: the glue's rule for out, dq, dk, dv."""
    if not _last_dim_contiguous(t):
        return t.new_empty(t.shape)
    out = torch.empty_like(t)
    return out if _last_dim_contiguous(out) else t.new_empty(t.shape)


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _rank(op: str, q: torch.Tensor, rank: int, layout: str) -> None:
    torch._check_value(q.dim() == rank, lambda: (
        f"optimized::{op}: q: expected {rank} dimensions {layout}; given {q.dim()} (shape {list(q.shape)})"))


@torch.library.register_fake("optimized::attention_fwd")
def _attention_fwd_fake(q, k, v, *, softmax_scale=None, causal=False, top_left=False, window_left=-1,
                        window_right=-1, softcap=0.0, alibi_slopes=None, attn_mask=None, deterministic=False,
                        variant="auto"):
    one_device("attention_fwd", q=q, k=k, v=v, alibi_slopes=alibi_slopes, attn_mask=attn_mask)
    _rank("attention_fwd", q, 4, "(B, S_q, H_q, D)")
    b, s_q, h_q, _ = q.shape
    return output_like(q), q.new_empty((b, h_q, s_q), dtype=lse_dtype(q))


@torch.library.register_fake("optimized::attention_bwd")
def _attention_bwd_fake(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, top_left=False, window_left=-1,
                        window_right=-1, softcap=0.0, alibi_slopes=None, attn_mask=None, deterministic=False,
                        variant="auto"):
    one_device("attention_bwd", q=q, dout=dout, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes,
               attn_mask=attn_mask)
    return output_like(q), output_like(k), output_like(v)


@torch.library.register_fake("optimized::attention_varlen_fwd")
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               softmax_scale=None, causal=False, top_left=False, window_left=-1, window_right=-1,
                               softcap=0.0, alibi_slopes=None, deterministic=False, variant="auto"):
    one_device("attention_varlen_fwd", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
               alibi_slopes=alibi_slopes)
    _rank("attention_varlen_fwd", q, 3, "(total_q, H_q, D)")
    total_q, h_q, _ = q.shape
    return output_like(q), q.new_empty((h_q, total_q), dtype=lse_dtype(q))


@torch.library.register_fake("optimized::attention_varlen_bwd")
def _attention_varlen_bwd_fake(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse, *,
                               softmax_scale=None, causal=False, top_left=False, window_left=-1, window_right=-1,
                               softcap=0.0, alibi_slopes=None, deterministic=False, variant="auto"):
    one_device("attention_varlen_bwd", q=q, dout=dout, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
               cu_seqlens_k=cu_seqlens_k, out=out, lse=lse, alibi_slopes=alibi_slopes)
    return output_like(q), output_like(k), output_like(v)
