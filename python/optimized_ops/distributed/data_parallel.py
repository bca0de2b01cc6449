"""Data parallelism: the end-to-end model (``optimized_ops.models``) trained on every rank of a process group with
``torch.nn.parallel.DistributedDataParallel``, on the library's kernels, fed by the streaming loader sharded by
rank, with checkpoints that resume on the same world size.

What was already in place and is used as it is: :func:`optimized_ops.models.training.train_from_nvme` takes
``rank`` / ``world_size`` (:class:`~optimized_ops.models.training.TrainConfig`): the loader
(:class:`optimized_ops.data.StreamingLoader`) gives rank r the r-th of ``world_size`` contiguous parts of each
epoch's order (every record once per epoch across the ranks, the same number of batches on every rank), the loop
skips DDP's all-reduce on all but the last micro-batch of a step (``no_sync``), rank 0 writes the checkpoints and
every rank resumes from them (the loader's state records ``rank`` and ``world_size`` and refuses another world size
with ``ValueError``).

What this module adds: :func:`wrap_ddp` (the model on its device, wrapped), :func:`train_data_parallel` (fills in
``rank`` / ``world_size`` from the group, wraps, trains, and ends with a barrier so that rank 0's last checkpoint
is on disk before any rank returns, so an immediate resume on every rank sees it).

The gradients equal the single-process gradients of the concatenated batch: each rank's loss is the mean over its
micro-batch and DDP averages over the ranks, so with equal micro-batches the average is the mean over the global
batch (the tests check it in float64 on the CPU).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ._comm import _run, group_rank, group_size

__all__ = ["wrap_ddp", "train_data_parallel"]


def wrap_ddp(model: torch.nn.Module, device: Optional[torch.device] = None, process_group=None,
             **ddp_kwargs) -> torch.nn.parallel.DistributedDataParallel:
    """``model`` moved to ``device`` (default: ``cuda:<current device>`` where CUDA is available, else the CPU) and
    wrapped in ``DistributedDataParallel`` (``device_ids`` set on CUDA; ``gradient_as_bucket_view=True`` unless
    given). The parameters are broadcast from rank 0 when it is made, so every rank starts from rank 0's."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    model.to(device)
    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index if device.index is not None else torch.cuda.current_device()])
    return _run("DistributedDataParallel (parameter broadcast)", process_group,
                lambda: torch.nn.parallel.DistributedDataParallel(model, process_group=process_group, **ddp_kwargs))


def train_data_parallel(model: torch.nn.Module, path: str, config=None, *, process_group=None):
    """:func:`~optimized_ops.models.training.train_from_nvme` on every rank of the group: ``config``'s ``rank`` and
    ``world_size`` set from the group, ``model`` wrapped by :func:`wrap_ddp` (unless it is a DDP model already) on
    ``config.device``; ends with a barrier. Returns this rank's :class:`~optimized_ops.models.training.TrainResult`
    (its losses are this rank's micro-batches')."""
    from ..models.training import TrainConfig, _resolve_config, _resolve_device, train_from_nvme
    config = _resolve_config(config)
    config = dataclasses.replace(config, rank=group_rank(process_group), world_size=group_size(process_group))
    if isinstance(config, TrainConfig):
        config.validate()
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) and group_size(process_group) > 1:
        model = wrap_ddp(model, _resolve_device(config), process_group)
    result = train_from_nvme(model, path, config)
    if group_size(process_group) > 1:
        _run("barrier (after training)", process_group, lambda: dist.barrier(group=process_group))
    return result
