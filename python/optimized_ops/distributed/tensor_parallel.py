"""Tensor parallelism, Megatron-LM style (Shoeybi et al. 2019; sequence parallelism: Korthikanti et al. 2022), on
the library's ``linear``, ``silu_and_mul``, ``rope`` and ``flash_attention``.

* :class:`ColumnParallelLinear`: ``W`` ``(N, K)`` split by rows (output features): rank r computes
  ``y_r = x W_r^T + b_r``. Its input goes through f (identity forward, all-reduce backward), or, with sequence
  parallelism, an all-gather of the sequence shards (reduce-scatter backward).
* :class:`RowParallelLinear`: ``W`` split by columns (input features): ``y = sum_r x_r W_r^T`` by g (all-reduce
  forward, identity backward), or a reduce-scatter to the sequence shards (all-gather backward); the bias is
  added once, after the reduction.
* :class:`TensorParallelSwiGLU`: the MLP, up projection column-parallel (each rank's ``[gate_r | up_r]``: the
  gate and up halves split alike, so SwiGLU runs locally) and down projection row-parallel: **one all-reduce per
  block in the forward (g after the down projection) and one in the backward (f before the up projection)**.
* :class:`TensorParallelAttention`: heads split over the ranks, GQA groups kept whole (rank r holds kv heads
  ``[r H_kv/W, (r+1) H_kv/W)`` and the query heads that read them): QKV column-parallel, attention local, the
  output projection row-parallel; one all-reduce forward and one backward.
* ``sequence_parallel=True`` on either block: its input and output are this rank's shard of the sequence
  (dim ``-2``: ``(B, S/W, d)`` or ``(T/W, d)``), so the norms and residual adds between blocks run on ``1/W`` of
  the tokens; the all-reduce becomes an all-gather before and a reduce-scatter after (the same bytes). The norm
  weights are then replicated parameters with partial gradients: :func:`allreduce_sequence_parallel_grads`.
* :func:`parallelize_transformer`: an ``optimized_ops.models.Transformer``'s attention and dense MLPs replaced in
  place by their tensor-parallel versions (without sequence parallelism; embeddings, norms and the LM head stay
  replicated and get identical full gradients on every rank).

Every module has ``from_dense(module, group)``: this rank's shard of a single-GPU module, so that the group
computes exactly what the module computes (the tests check forward and gradients against it).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..attention import flash_attention
from ..fused import silu_and_mul
from ..fused.rope import rope
from ..linear import linear
from ._comm import (all_gather_last_dim, all_reduce_sum, copy_to_parallel_region, gather_from_sequence_region,
                    group_rank, group_size, reduce_from_parallel_region, scatter_to_sequence_region)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelSwiGLU", "TensorParallelAttention",
           "parallelize_transformer", "allreduce_sequence_parallel_grads", "sequence_parallel_params"]

_SEQ_DIM = -2


def _amp(t, amp):
    return t if (t is None or amp is None or t.dtype == amp) else t.to(amp)


def _split(n: int, w: int, what: str) -> int:
    if n % w:
        raise ValueError(f"{what}: expected a multiple of the tensor-parallel group's size {w}; given {n}")
    return n // w


class ColumnParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` ``(out_features, in_features)`` split by rows over ``process_group``: this rank
    holds ``weight`` ``(out_features / W, in_features)`` and ``bias`` ``(out_features / W,)``.

    ``forward(x)``: ``x`` ``(..., in_features)`` (with ``sequence_parallel``: this rank's shard along dim -2) ->
    this rank's ``(..., out_features / W)`` (``gather_output``: every rank's, concatenated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, process_group=None,
                 gather_output: bool = False, sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.process_group = process_group
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _split(out_features, group_size(process_group), "out_features")
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(self.local_out, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(self.local_out, device=device, dtype=dtype)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_dense(cls, layer: torch.nn.Linear, process_group=None, *, rows: Optional[torch.Tensor] = None,
                   **kwargs) -> "ColumnParallelLinear":
        """This rank's shard of ``layer``: its rows ``[r N/W, (r+1) N/W)``, or ``rows`` (an index of
        ``N / W`` rows, for layouts such as ``[gate | up]``)."""
        w, r = group_size(process_group), group_rank(process_group)
        n, k = layer.weight.shape
        m = cls(k, n, layer.bias is not None, process_group=process_group, device=layer.weight.device,
                dtype=layer.weight.dtype, **kwargs)
        if rows is None:
            rows = torch.arange(r * (n // w), (r + 1) * (n // w))
        rows = rows.to(layer.weight.device)
        with torch.no_grad():
            m.weight.copy_(layer.weight.index_select(0, rows))
            if m.bias is not None:
                m.bias.copy_(layer.bias.index_select(0, rows))
        return m

    def forward(self, x: torch.Tensor, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, _SEQ_DIM, self.process_group)
        else:
            x = copy_to_parallel_region(x, self.process_group)
        y = linear(_amp(x, amp), _amp(self.weight, amp), _amp(self.bias, amp))
        return all_gather_last_dim(y, self.process_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.local_out} here), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` ``(out_features, in_features)`` split by columns over ``process_group``: this
    rank holds ``weight`` ``(out_features, in_features / W)``; ``bias`` ``(out_features,)`` is replicated and added
    after the reduction.

    ``forward(x)``: ``x`` this rank's ``(..., in_features / W)`` (``input_is_parallel=False``: the whole
    ``(..., in_features)``, of which this rank takes its slice) -> ``(..., out_features)`` summed over the group
    (with ``sequence_parallel``: this rank's shard of it along dim -2)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, process_group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.process_group = process_group
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _split(in_features, group_size(process_group), "in_features")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(out_features, self.local_in, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # added on a sequence shard: its gradient is partial
        torch.nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_dense(cls, layer: torch.nn.Linear, process_group=None, **kwargs) -> "RowParallelLinear":
        """This rank's shard of ``layer``: its columns ``[r K/W, (r+1) K/W)`` and the whole bias."""
        w, r = group_size(process_group), group_rank(process_group)
        n, k = layer.weight.shape
        m = cls(k, n, layer.bias is not None, process_group=process_group, device=layer.weight.device,
                dtype=layer.weight.dtype, **kwargs)
        with torch.no_grad():
            m.weight.copy_(layer.weight[:, r * (k // w):(r + 1) * (k // w)])
            if m.bias is not None:
                m.bias.copy_(layer.bias)
        return m

    def forward(self, x: torch.Tensor, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        if not self.input_is_parallel:  # f, then the slice: the backward all-reduce of zero-padded slices
            r = group_rank(self.process_group)
            x = copy_to_parallel_region(x, self.process_group)[..., r * self.local_in:(r + 1) * self.local_in]
        y = linear(_amp(x, amp), _amp(self.weight, amp))
        if self.sequence_parallel:
            y = scatter_to_sequence_region(y, _SEQ_DIM, self.process_group)
        else:
            y = reduce_from_parallel_region(y, self.process_group)
        return y if self.bias is None else y + _amp(self.bias, amp)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.local_in} here), out_features={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class TensorParallelSwiGLU(torch.nn.Module):
    """The dense SwiGLU MLP ``w2(silu(gate) * up)``, ``[gate | up] = w13(x)``, over a tensor-parallel group: ``w13``
    column-parallel (this rank: ``[gate_r | up_r]``, ``2 d_ff / W`` rows), ``w2`` row-parallel. The call signature of
    ``optimized_ops.models``' MLP (``forward(x, dropless=False, amp=None)``)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False, *, process_group=None,
                 sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.process_group, self.d_model, self.d_ff = process_group, d_model, d_ff
        _split(d_ff, group_size(process_group), "d_ff")
        factory = {"device": device, "dtype": dtype}
        self.w13 = ColumnParallelLinear(d_model, 2 * d_ff, bias, process_group=process_group,
                                        sequence_parallel=sequence_parallel, **factory)
        self.w2 = RowParallelLinear(d_ff, d_model, bias, process_group=process_group,
                                    sequence_parallel=sequence_parallel, **factory)

    @classmethod
    def from_dense(cls, mlp: torch.nn.Module, process_group=None, *, sequence_parallel: bool = False
                   ) -> "TensorParallelSwiGLU":
        """From a module with ``w13`` (``nn.Linear(d_model, 2 d_ff)``, rows ``[gate | up]``) and ``w2``
        (``nn.Linear(d_ff, d_model)``): ``optimized_ops.models``' SwiGLU."""
        w, r = group_size(process_group), group_rank(process_group)
        two_f, d = mlp.w13.weight.shape
        f = two_f // 2
        fl = _split(f, w, "d_ff")
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.process_group, m.d_model, m.d_ff = process_group, d, f
        rows = torch.cat([torch.arange(r * fl, (r + 1) * fl), f + torch.arange(r * fl, (r + 1) * fl)])
        m.w13 = ColumnParallelLinear.from_dense(mlp.w13, process_group, rows=rows, sequence_parallel=sequence_parallel)
        m.w2 = RowParallelLinear.from_dense(mlp.w2, process_group, sequence_parallel=sequence_parallel)
        return m

    def forward(self, x: torch.Tensor, dropless: bool = False, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        return self.w2(silu_and_mul(self.w13(x, amp)), amp)


class TensorParallelAttention(torch.nn.Module):
    """Causal GQA self-attention with RoPE (``optimized_ops.models``' ``Attention``) with its heads split over a
    tensor-parallel group: this rank holds ``H / W`` query heads and the ``H_kv / W`` kv heads they read (GQA
    groups whole; ``H_kv`` a multiple of ``W``). ``forward(x, positions, amp=None)``: ``x`` ``(B, S, d)`` (with
    ``sequence_parallel``: ``(B, S / W, d)``, this rank's part of the sequence; ``positions`` always the whole
    sequence's)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, bias: bool = False,
                 rope_theta: float = 10000.0, process_group=None, sequence_parallel: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        w = group_size(process_group)
        self.process_group = process_group
        self.n_heads, self.n_kv_heads, self.head_dim = _split(n_heads, w, "n_heads"), _split(n_kv_heads, w,
                                                                                              "n_kv_heads"), head_dim
        self.rope_theta = float(rope_theta)
        factory = {"device": device, "dtype": dtype}
        self.qkv = ColumnParallelLinear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias,
                                        process_group=process_group, sequence_parallel=sequence_parallel, **factory)
        self.proj = RowParallelLinear(n_heads * head_dim, d_model, bias, process_group=process_group,
                                      sequence_parallel=sequence_parallel, **factory)

    @classmethod
    def from_dense(cls, attn: torch.nn.Module, process_group=None, *, sequence_parallel: bool = False
                   ) -> "TensorParallelAttention":
        """From ``optimized_ops.models``' ``Attention`` (``qkv`` rows ``[q heads | k heads | v heads]``, ``proj``)."""
        w, r = group_size(process_group), group_rank(process_group)
        h, hkv, dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
        hl, kl = _split(h, w, "n_heads"), _split(hkv, w, "n_kv_heads")
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.process_group, m.n_heads, m.n_kv_heads, m.head_dim = process_group, hl, kl, dh
        m.rope_theta = float(attn.rope_theta)
        rows = torch.cat([torch.arange(r * hl * dh, (r + 1) * hl * dh),
                          h * dh + torch.arange(r * kl * dh, (r + 1) * kl * dh),
                          (h + hkv) * dh + torch.arange(r * kl * dh, (r + 1) * kl * dh)])
        m.qkv = ColumnParallelLinear.from_dense(attn.qkv, process_group, rows=rows, sequence_parallel=sequence_parallel)
        m.proj = RowParallelLinear.from_dense(attn.proj, process_group, sequence_parallel=sequence_parallel)
        return m

    def forward(self, x: torch.Tensor, positions: torch.Tensor, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        qkv = self.qkv(x, amp)                                                   # (B, S, (Hl + 2 Kl) D)
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        q, k = rope(q, k, positions, theta=self.rope_theta, layout="neox")
        o = flash_attention(q, k, v, causal=True)                                # (B, S, Hl, D)
        return self.proj(o.reshape(b, s, self.n_heads * self.head_dim), amp)


def parallelize_transformer(model: torch.nn.Module, process_group=None) -> torch.nn.Module:
    """Replaces, in place, every block's ``attn`` and dense ``ffn`` of an ``optimized_ops.models.Transformer``
    (``reference=False``) by :class:`TensorParallelAttention` / :class:`TensorParallelSwiGLU` shards of them;
    returns ``model``. Call it with the same model on every rank (same seed or the same state_dict). MoE layers are
    left as they are (expert parallelism is ``optimized_ops.nn.MoE(process_group=...)``)."""
    from ..models.transformer import Attention, SwiGLU
    for block in model.layers:
        if isinstance(block.attn, Attention):
            if block.attn.reference:
                raise ValueError("parallelize_transformer: expected the optimized model (reference=False)")
            block.attn = TensorParallelAttention.from_dense(block.attn, process_group)
        if isinstance(block.ffn, SwiGLU):
            block.ffn = TensorParallelSwiGLU.from_dense(block.ffn, process_group)
    return model


def sequence_parallel_params(module: torch.nn.Module) -> list:
    """The parameters of ``module`` marked ``sequence_parallel`` (the row-parallel biases of sequence-parallel
    blocks: replicated, applied to a sequence shard, so each rank's gradient is partial)."""
    return [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(params, process_group=None) -> None:
    """Sums over the group the gradients of parameters replicated across a sequence-parallel region: the norms'
    weights between sequence-parallel blocks and the blocks' row-parallel biases (each rank saw only its shard of
    the tokens). ``params``: parameters, or modules (their :func:`sequence_parallel_params`). Call after backward
    (one all-reduce per parameter; before the optimizer step)."""
    if group_size(process_group) == 1:
        return
    for p in params:
        for q in (sequence_parallel_params(p) if isinstance(p, torch.nn.Module) else [p]):
            if q.grad is not None:
                all_reduce_sum(q.grad, process_group)
