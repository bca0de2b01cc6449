"""The communication the parallel layers share: starting a process group with NVLink multicast off, and the
collectives as autograd Functions (Megatron-LM's conjugate operator pairs, Shoeybi et al. 2019, section 3).

=======================================  ===========================================  ===========================
function                                 forward                                      backward
=======================================  ===========================================  ===========================
:func:`copy_to_parallel_region` (f)      identity                                     all-reduce (sum)
:func:`reduce_from_parallel_region` (g)  all-reduce (sum)                             identity
:func:`gather_from_sequence_region`      all-gather along ``dim``                     reduce-scatter along ``dim``
:func:`scatter_to_sequence_region`       reduce-scatter along ``dim``                 all-gather along ``dim``
:func:`all_gather_last_dim`              all-gather along the last dim                this rank's slice
:func:`all_to_all`                       all-to-all, variable splits                  all-to-all, splits swapped
=======================================  ===========================================  ===========================

Every collective runs through :func:`_run`, which turns a backend error (a peer that died, a timeout) into a
``RuntimeError`` naming the collective, this rank and the group size, so that a failed rank makes the others
stop with a clear message instead of hanging (the wait is bounded by the process group's ``timeout``;
:func:`init_process_group` sets one).

**NVLink multicast stays off** (NVLS / symmetric-memory multicast): :func:`force_no_multicast_env` sets
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` in
``os.environ`` (overwriting what was there: a ``setdefault`` would keep a caller's ``1``), and
:func:`init_process_group` calls it before ``torch.distributed.init_process_group``. No multicast API is used.

**All-to-all with uneven splits**: ``torch.distributed.all_to_all_single`` takes variable splits on NCCL and, in
torch 2.11, on gloo too (the CPU tests use it). Where a backend lacks it (older gloo builds, other backends),
:func:`all_to_all_single` falls back to the same exchange built from point-to-point ``isend`` / ``irecv``
(one message per peer with rows to send; the rank's own rows copied locally); the fallback is used only after
the backend refused the collective, or when ``OPTIMIZED_OPS_A2A_FALLBACK=1`` (tests).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["force_no_multicast_env", "init_process_group", "group_rank", "group_size", "all_to_all_single",
           "copy_to_parallel_region", "reduce_from_parallel_region", "gather_from_sequence_region",
           "scatter_to_sequence_region", "all_gather_last_dim", "all_to_all", "all_reduce_sum", "all_gather_rows",
           "NO_MULTICAST_ENV", "DistributedError"]

# NVLink multicast off (the lent machines' rule; KINDS.md): NCCL's NVLS algorithms, torch's symmetric memory
# multicast, and NVSHMEM's NVLS.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


class DistributedError(RuntimeError):
    """A collective of a parallel layer failed (a peer rank died, left early or timed out)."""


def force_no_multicast_env(env: Optional[dict] = None) -> dict:
    """Sets the three variables of :data:`NO_MULTICAST_ENV` in ``env`` (default ``os.environ``), overwriting any
    value they had; returns ``env``. Call it before the process group (and NCCL) start; child processes inherit
    it."""
    env = os.environ if env is None else env
    for key, value in NO_MULTICAST_ENV.items():
        env[key] = value
    return env


def init_process_group(backend: Optional[str] = None, *, timeout: Optional[datetime.timedelta] = None,
                       rank: Optional[int] = None, world_size: Optional[int] = None,
                       init_method: Optional[str] = None) -> tuple[int, int]:
    """Starts the default process group the way the examples and the benchmark do; returns ``(rank, world_size)``.

    Forces NVLink multicast off (:func:`force_no_multicast_env`), then calls
    ``torch.distributed.init_process_group`` with ``timeout`` (default 120 s: a rank whose peer died stops with
    an error within it rather than hanging). ``backend`` None: ``"nccl"`` where CUDA is available, else
    ``"gloo"``. ``rank`` / ``world_size`` None: from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``). With NCCL, the current CUDA device becomes ``LOCAL_RANK`` (or the rank
    modulo the device count) first, and the group is bound to it (``device_id``), so that NCCL starts eagerly
    and a bad setup fails here. Already initialized: returns the current group's rank and size.
    """
    force_no_multicast_env()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    kwargs = {"backend": backend, "timeout": timeout}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    if init_method is not None:
        kwargs["init_method"] = init_method
    if "nccl" in backend:
        r = rank if rank is not None else int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", r % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(**kwargs)
    return dist.get_rank(), dist.get_world_size()


def group_rank(group=None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def group_size(group=None) -> int:
    """``group``'s size (1 without a process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _run(what: str, group, fn):
    """Runs the collective ``fn()``; a backend error becomes a :class:`DistributedError` naming it."""
    try:
        return fn()
    except DistributedError:
        raise
    except (RuntimeError, ValueError, OSError) as e:  # gloo: RuntimeError / DistBackendError; NCCL: DistError
        raise DistributedError(
            f"optimized_ops.distributed: {what} failed on rank {group_rank(group)} of {group_size(group)} "
            f"(a peer rank failed, left early or timed out; the wait is bounded by the process group's timeout): "
            f"{type(e).__name__}: {e}") from e


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``x`` over the group, in place (no autograd); returns ``x``."""
    if group_size(group) > 1:
        _run("all_reduce", group, lambda: dist.all_reduce(x, group=group))
    return x


def all_gather_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    """``(W * n, ...)``: every rank's ``x`` (the same shape on every rank) stacked along dim 0 (no autograd)."""
    w = group_size(group)
    if w == 1:
        return x.clone()
    x = x.contiguous()
    out = torch.empty((w * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _run("all_gather", group, lambda: dist.all_gather_into_tensor(out, x, group=group))
    return out


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    w = group_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // w, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _run("reduce_scatter", group, lambda: dist.reduce_scatter_tensor(out, x, group=group))
    return out


_A2A_UNSUPPORTED: set = set()  # backends that refused all_to_all_single: the fallback serves them


def _a2a_p2p(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group):
    """The all-to-all from point-to-point messages: one ``isend`` / ``irecv`` per peer with rows to exchange."""
    rank, w = group_rank(group), group_size(group)
    in_off = [0]
    for s in in_splits:
        in_off.append(in_off[-1] + s)
    out_off = [0]
    for s in out_splits:
        out_off.append(out_off[-1] + s)
    out[out_off[rank]:out_off[rank + 1]].copy_(inp[in_off[rank]:in_off[rank + 1]])
    reqs = []
    for peer in range(w):
        if peer == rank:
            continue
        g = peer if group is None else dist.get_global_rank(group, peer)
        if out_splits[peer]:
            reqs.append(dist.irecv(out[out_off[peer]:out_off[peer + 1]], src=g, group=group))
        if in_splits[peer]:
            reqs.append(dist.isend(inp[in_off[peer]:in_off[peer + 1]].contiguous(), dst=g, group=group))
    for r in reqs:
        r.wait()


class _Pending:
    """An all-to-all in flight (``async_op``): :meth:`wait` makes its output safe to read."""

    def __init__(self, work, what, group):
        self.work, self.what, self.group = work, what, group

    def wait(self) -> None:
        if self.work is not None:
            work, self.work = self.work, None
            _run(self.what, self.group, work.wait)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                      group=None, async_op: bool = False) -> Optional[_Pending]:
    """``out`` (rows from each rank, in rank order) <- ``inp`` (rows for each rank, in rank order): the rows
    ``in_splits[q]`` go to rank ``q``, ``out_splits[s]`` come from rank ``s`` (host integers, any of them 0). No
    autograd (:func:`all_to_all` has it). ``async_op``: returns a handle whose ``wait()`` must come before
    ``out`` is read (on CUDA it orders the current stream after the exchange; the host does not block). The
    point-to-point fallback (module notes) runs synchronously."""
    out_splits, in_splits = [int(s) for s in out_splits], [int(s) for s in in_splits]
    backend = dist.get_backend(group)
    if os.environ.get("OPTIMIZED_OPS_A2A_FALLBACK") == "1" or backend in _A2A_UNSUPPORTED:
        _run("all_to_all (point-to-point fallback)", group, lambda: _a2a_p2p(out, inp, out_splits, in_splits, group))
        return _Pending(None, "", group) if async_op else None
    try:
        work = dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group, async_op=async_op)
    except (RuntimeError, NotImplementedError) as e:
        if "not supported" not in str(e).lower() and not isinstance(e, NotImplementedError):
            raise DistributedError(f"optimized_ops.distributed: all_to_all failed on rank {group_rank(group)} of "
                                   f"{group_size(group)} (a peer rank failed, left early or timed out): "
                                   f"{type(e).__name__}: {e}") from e
        _A2A_UNSUPPORTED.add(backend)
        return all_to_all_single(out, inp, out_splits, in_splits, group, async_op)
    if async_op:
        return _Pending(work, "all_to_all", group)
    return None


# ---- the autograd Functions ---------------------------------------------------------------------------------

class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad.contiguous().clone(), ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward (the output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _moved(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0).contiguous()


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` forward, reduce-scatter backward (sequence parallelism: into a TP region)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_rows(_moved(x, dim), group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(_moved(grad, ctx.dim), ctx.group).movedim(0, ctx.dim), None, None


class _ScatterSequence(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward, all-gather backward (sequence parallelism: out of a TP region)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_rows(_moved(x, dim), group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_rows(_moved(grad, ctx.dim), ctx.group).movedim(0, ctx.dim), None, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[-1]
        w = group_size(group)
        parts = all_gather_rows(_moved(x, -1), group)                    # (W n, ...)
        return parts.movedim(0, -1) if w > 1 else x.clone()

    @staticmethod
    def backward(ctx, grad):
        r, n = group_rank(ctx.group), ctx.n
        return grad[..., r * n:(r + 1) * n].contiguous(), None


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows with variable splits; the backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        handle = all_to_all_single(out, x, out_splits, in_splits, group, async_op=pending is not None)
        if pending is not None:
            pending.append(handle)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, ctx.group)
        return out, None, None, None, None


class _Wait(torch.autograd.Function):
    """Identity whose forward first waits for an asynchronous all-to-all (the output of :func:`all_to_all` with
    ``pending``)."""

    @staticmethod
    def forward(ctx, x, pending):
        for handle in pending:
            handle.wait()
        pending.clear()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's f: ``x`` forward; the sum of the gradients over the group backward."""
    return x if group_size(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Megatron's g: the sum of ``x`` over the group forward; the gradient as it is backward."""
    return x if group_size(group) == 1 else _ReduceFromParallel.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The ranks' shards of ``x`` along ``dim`` concatenated (rank order); backward: reduce-scatter."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, dim, group)


def scatter_to_sequence_region(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The sum of ``x`` over the group, this rank's shard along ``dim`` (its size a multiple of the group size);
    backward: all-gather."""
    if group_size(group) == 1:
        return x
    if x.shape[dim] % group_size(group):
        raise ValueError(f"sequence parallelism: dim {dim} of shape {list(x.shape)} is not a multiple of the "
                         f"group size {group_size(group)}")
    return _ScatterSequence.apply(x, dim, group)


def all_gather_last_dim(x: torch.Tensor, group=None) -> torch.Tensor:
    """The ranks' shards of ``x`` along its last dim concatenated; backward: this rank's slice."""
    return x if group_size(group) == 1 else _GatherLastDim.apply(x, group)


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group=None,
               pending: Optional[list] = None) -> torch.Tensor:
    """The rows of ``x`` exchanged (``in_splits[q]`` rows to rank ``q``; ``out_splits[s]`` rows from rank ``s``),
    with autograd. ``pending`` (a list): the exchange starts asynchronously and its handle is appended; pass the
    result through :func:`wait` before reading it (work enqueued in between overlaps the exchange)."""
    return _AllToAll.apply(x, [int(s) for s in out_splits], [int(s) for s in in_splits], group, pending)


def wait(x: torch.Tensor, pending: list) -> torch.Tensor:
    """``x`` once the asynchronous exchanges in ``pending`` are done (identity for autograd)."""
    return _Wait.apply(x, pending)
