"""Expert parallelism: the MoE layer with its experts partitioned over the ranks of a process group, tokens sent to
their experts' ranks and back by all-to-all (:func:`moe_layer_ep`; the module is ``optimized_ops.nn.MoE(...,
process_group=group)`` or :class:`ExpertParallelMoE`).

Rank ``r`` of ``W`` holds experts ``[r E/W, (r + 1) E/W)`` (``E`` a multiple of ``W``) and the whole router
(replicated); every rank brings its own tokens (any number, 0 included). One forward, on rank ``r``:

==========================  ==========================================================================
step                        what runs
==========================  ==========================================================================
route, permute              as the single-GPU layer (:mod:`optimized_ops.moe.layer`), on this rank's tokens:
                            the (token, expert) pairs sorted by expert, so grouped by destination rank
counts exchange             ``all_gather`` of each rank's ``(E,)`` counts: the ``(W, E)`` table, read to the
                            host once (the splits of the all-to-alls; the layer's only host synchronisation)
capacity                    from the table: expert ``e`` keeps its first ``C = ceil(cf T k / E)`` pairs in
                            the order of the concatenated ranks' tokens (rank 0's first), ``T`` the tokens of
                            all ranks: exactly the pairs the single-GPU layer keeps on the concatenation
dispatch                    ``moe_gather``, then ``all_to_all`` with variable splits (no padding): rows arrive
                            ordered (source rank, local expert), reordered to (local expert, source rank)
experts                     ``grouped_mm_swiglu`` then ``grouped_mm`` over the local experts
combine                     the reverse reorder, the reverse ``all_to_all``, ``moe_combine`` with the weights
metrics and losses          :class:`~optimized_ops.MoEMetrics` of the whole group's tokens (one all-reduce of
                            the router's probability sums and z-loss sum): the values of the single-GPU layer
==========================  ==========================================================================

**Overlap** (``overlap=True``, the default for ``W > 1``): the pairs a rank routes to its own experts never
leave it. The dispatch all-to-all carries only the other ranks' rows and starts asynchronously; the local
experts run on the rank's own rows while it is in flight, then on the received rows. (On CUDA the exchange runs
on NCCL's stream and the wait only orders the compute stream after it; the host never blocks.) With W ranks and
a balanced router, 1/W of the rows skip the network and their expert GEMMs hide the dispatch; the combine
all-to-all and the backward's all-to-alls are not overlapped (the autograd engine orders them).
``overlap=False``: one all-to-all of every row (self included) and one grouped GEMM per projection.

**Gradients**: ``x`` and the local experts' ``w13`` / ``w2`` get exactly their parts of the single-GPU layer's
gradients (the all-to-all's backward is the all-to-all with the splits swapped). The router is replicated: each
rank's ``router.weight.grad`` is its tokens' share; their **sum** over the group is the single-GPU gradient.
``metrics.loss`` (the same value on every rank) passes its gradient through the all-reduce as Megatron's g
operator (identity backward), so when every rank adds it to its own loss, the summed router gradient counts it
once. Data parallelism over the ranks averages instead of summing (``DistributedDataParallel``): a constant
factor ``1 / W`` on the router's gradient, as on every replicated parameter.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..moe import grouped_mm, grouped_mm_swiglu, moe_combine, moe_gather, moe_permute, moe_route
from ..moe.layer import MoEMetrics, _check, moe_capacity, router_logits
from ._comm import all_gather_rows, all_to_all, group_rank, group_size, reduce_from_parallel_region, wait

__all__ = ["moe_layer_ep", "ExpertParallelMoE", "expert_range"]


def expert_range(num_experts: int, group=None) -> tuple[int, int]:
    """``(first, count)``: the experts this rank of ``group`` holds (``num_experts`` a multiple of its size)."""
    w, r = group_size(group), group_rank(group)
    if num_experts % w:
        raise ValueError(f"num_experts: expected a multiple of the expert-parallel group's size {w}; "
                         f"given {num_experts}")
    n = num_experts // w
    return r * n, n


def _expert_major(m: torch.Tensor) -> Optional[torch.Tensor]:
    """The rows of a buffer in (source, expert) order, ``m[s, e]`` rows each, listed in (expert, source) order:
    the index that regroups received rows by expert (host int64). None where the two orders agree."""
    ws, ne = m.shape
    if ws <= 1 or ne <= 1:
        return None
    flat = m.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ws, ne).t().reshape(-1)      # (expert, source) segments' starts
    lengths = m.t().reshape(-1)
    total = int(flat.sum())
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.cumsum(lengths, 0) - lengths
    return starts[seg] + (torch.arange(total) - pos[seg])


class _Experts:
    """The local experts' MLP on rows sorted by local expert (``counts`` host ints per expert)."""

    def __init__(self, w13, w2, variant):
        self.w13, self.w2, self.variant = w13, w2, variant

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32).to(xs.device, non_blocking=True)
        h = grouped_mm_swiglu(xs, self.w13, offs, variant=self.variant)
        return grouped_mm(h, self.w2, offs, variant=self.variant)

    def regrouped(self, xr: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """Rows received in (source, expert) order ``m`` -> the experts' outputs in the same order."""
        perm = _expert_major(m)
        if perm is None:
            return self(xr, m.sum(0))
        perm = perm.to(xr.device, non_blocking=True)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return self(xr.index_select(0, perm), m.sum(0)).index_select(0, inv)


def moe_layer_ep(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
                 group=None, capacity_factor: Optional[float] = None, scoring: str = "softmax",
                 normalize: Optional[bool] = None, aux_loss_coef: float = 0.01, z_loss_coef: float = 0.001,
                 variant: str = "auto", overlap: bool = True, stats: Optional[dict] = None
                 ) -> tuple[torch.Tensor, MoEMetrics]:
    """:func:`optimized_ops.moe_layer` with the experts partitioned over ``group`` (module notes).

    ``x`` ``(..., d_model)``: this rank's tokens (any count, 0 included); ``router_weight`` ``(E, d_model)``
    (the same on every rank); ``w13`` ``(E / W, d_model, 2 d_ff)`` and ``w2`` ``(E / W, d_ff, d_model)``: this
    rank's experts (:func:`expert_range`). Every rank of ``group`` must call it (a collective), with the same
    ``top_k``, ``capacity_factor``, ``scoring`` and ``normalize``. Returns this rank's output (``x``'s shape) and
    the :class:`~optimized_ops.MoEMetrics` of the whole group's tokens (the same on every rank; a device tensor
    each). ``stats`` (a dict): filled with the host splits (``send``, ``recv``: rows to / from each rank) and the
    rows kept, for the benchmark.
    """
    w, r = group_size(group), group_rank(group)
    d, e = _check(x, router_weight, w13, w2, top_k, scoring, lambda e: expert_range(e, group)[1])
    first, ne = expert_range(e, group)
    k = top_k
    shape = x.shape
    x2 = x.reshape(-1, d)
    t = x2.shape[0]
    if normalize is None:
        normalize = k > 1

    logits = router_logits(x2, router_weight)                                    # (t, E) fp32
    ids, weights, lse = moe_route(logits, k, scoring=scoring, normalize=normalize)
    counts, offsets, sorted_pairs, slot_of, _ = moe_permute(ids, e, 0)

    # Counts first: the (W, E) table of every rank's pairs per expert, on the host.
    table = all_gather_rows(counts.view(1, e), group).cpu().long()              # (W, E)
    routed = table.sum(0)                                                        # (E,) pairs per expert
    t_all = int(table.sum()) // k                                                # the group's tokens
    kept = table
    if capacity_factor is not None:
        cap = moe_capacity(capacity_factor, t_all, k, e)
        before = torch.cumsum(table, 0) - table                                  # pairs of the ranks before
        kept = torch.minimum((cap - before).clamp(min=0), table)
        if bool((kept[r] < table[r]).any()):
            # Drop this rank's pairs past its share of each expert's capacity: their ids become -1, which
            # moe_permute drops (rank within the expert = slot - the expert's first slot, by pair order).
            flat = ids.reshape(-1).long()
            rank_in_expert = slot_of.reshape(-1).long() - offsets.long()[flat]
            drop = rank_in_expert >= kept[r].to(ids.device)[flat]
            ids_kept = torch.where(drop.view_as(ids), torch.full_like(ids, -1), ids)
            counts, offsets, sorted_pairs, slot_of, _ = moe_permute(ids_kept, e, 0)
    send = kept[r].view(w, ne).sum(1)                                            # rows to each rank
    recv_m = kept[:, first:first + ne]                                           # (W, ne) from each rank
    recv = recv_m.sum(1)
    rows = int(send.sum())
    if stats is not None:
        stats.update(send=send.tolist(), recv=recv.tolist(), rows_sent=rows, rows_received=int(recv.sum()),
                     tokens=t, group_tokens=t_all)

    sorted_pairs = sorted_pairs[:rows]
    xs = moe_gather(x2, sorted_pairs, slot_of)                                   # (rows, d), by destination
    experts = _Experts(w13, w2, variant)
    if w == 1:
        y = experts(xs, recv_m[0])
    elif not overlap:
        xr = all_to_all(xs, recv.tolist(), send.tolist(), group)                 # (source, expert) order
        y = all_to_all(experts.regrouped(xr, recv_m), send.tolist(), recv.tolist(), group)
    else:
        # The rows for this rank's own experts stay here; the others travel while the local experts run.
        a = int(send[:r].sum())
        b = a + int(send[r])
        send_o, recv_o = send.clone(), recv.clone()
        send_o[r] = recv_o[r] = 0
        remote = torch.cat([xs[:a], xs[b:]]) if a or b < rows else xs[:0]
        pending: list = []
        xr = all_to_all(remote, recv_o.tolist(), send_o.tolist(), group, pending)
        y_local = experts(xs[a:b], recv_m[r])                                   # overlaps the dispatch
        xr = wait(xr, pending)
        others = torch.cat([recv_m[:r], recv_m[r + 1:]])
        y_remote = all_to_all(experts.regrouped(xr, others), send_o.tolist(), recv_o.tolist(), group)
        y = torch.cat([y_remote[:a], y_local, y_remote[a:]])
    out = moe_combine(y, slot_of, sorted_pairs, weights)                         # (t, d)

    # Metrics of the whole group: the router's probability sums and the z-loss sum all-reduced (g: identity
    # backward, so each rank's gradient is its tokens' share).
    if scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
    else:
        s = torch.sigmoid(logits)
        probs = s / s.sum(dim=-1, keepdim=True)
    sums = reduce_from_parallel_region(torch.cat([probs.sum(0), lse.square().sum().view(1)]), group)
    dev = x.device
    load = (routed.float() / max(t_all * k, 1)).to(dev)
    p_mean = sums[:e] / t_all if t_all else sums[:e] * math.nan
    z_loss = sums[e] / t_all if t_all else sums[e] * math.nan
    aux_loss = e * (load * p_mean).sum()
    tokens_per_expert = kept.sum(0)
    kept_f = tokens_per_expert.float()
    metrics = MoEMetrics(
        tokens_per_expert=tokens_per_expert.to(torch.int32).to(dev),
        load=load,
        utilization=(kept_f.mean() / kept_f.max().clamp(min=1.0)).to(dev),
        active_experts=(tokens_per_expert > 0).float().mean().to(dev),
        imbalance=(e * load.max()),
        dropped=torch.tensor(int(table.sum() - kept.sum()), dtype=torch.int32, device=dev),
        aux_loss=aux_loss,
        z_loss=z_loss,
        loss=aux_loss_coef * aux_loss + z_loss_coef * z_loss)
    return out.reshape(shape), metrics


def _moe_base():
    from ..nn import MoE  # nn imports this module lazily; the reverse import happens at call time
    return MoE


def _default_group(process_group):
    import torch.distributed as dist
    return dist.group.WORLD if process_group is None else process_group


class ExpertParallelMoE:
    """The constructors of an expert-parallel ``optimized_ops.nn.MoE`` (what ``nn.MoE(..., process_group=g)``
    makes; ``process_group`` None here: the default group), with the ``overlap`` option (module notes).

    >>> moe = ExpertParallelMoE(4096, 14336, 16, 2)                                # doctest: +SKIP
    >>> moe = ExpertParallelMoE.from_dense(dense_moe, group)                       # doctest: +SKIP
    """

    def __new__(cls, d_model: int, d_ff: int, num_experts: int, top_k: int, *, process_group=None,
                overlap: bool = True, **kwargs):
        moe = _moe_base()(d_model, d_ff, num_experts, top_k, process_group=_default_group(process_group), **kwargs)
        moe.overlap = overlap
        return moe

    @staticmethod
    def from_dense(dense, process_group=None, *, overlap: bool = True):
        """An expert-parallel copy of the single-GPU ``optimized_ops.nn.MoE`` ``dense``: its options, its router,
        and this rank's slice of ``w13`` / ``w2``. With the same ``dense`` on every rank, the group computes what
        ``dense`` computes on the ranks' tokens concatenated in rank order."""
        group = _default_group(process_group)
        first, n = expert_range(dense.num_experts, group)
        p = dense.w13
        moe = _moe_base()(dense.d_model, dense.d_ff, dense.num_experts, dense.top_k, activation=dense.activation,
                          capacity_factor=dense.capacity_factor, aux_loss_coef=dense.aux_loss_coef,
                          z_loss_coef=dense.z_loss_coef, scoring=dense.scoring, normalize=dense.normalize,
                          device=p.device, dtype=p.dtype, variant=dense.variant, process_group=group)
        with torch.no_grad():
            moe.router.weight.copy_(dense.router.weight)
            moe.w13.copy_(dense.w13[first:first + n])
            moe.w2.copy_(dense.w2[first:first + n])
        moe.overlap = overlap
        return moe
