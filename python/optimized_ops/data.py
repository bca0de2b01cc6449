"""Training data streamed from local storage into GPU memory: ``optimized_ops.data``.

A dataset is a directory of shard files of fixed-size records (token sequences, images, any
tensor of one dtype and shape), written once from a numpy array or a torch tensor:

>>> import numpy as np, tempfile, optimized_ops.data as data
>>> path = tempfile.mkdtemp() + "/tokens"
>>> info = data.write_shards(path, np.arange(1000 * 17, dtype=np.int32).reshape(1000, 17))
>>> (info.num_records, info.record_shape, info.dtype)
(1000, (17,), 'int32')

and then read in batches by :class:`StreamingLoader`, which keeps several batches in flight
(O_DIRECT reads through io_uring or a pread pool into pinned buffers, a copy to the GPU on its own
stream, checksums checked on the way) so that the training loop does not wait for storage:

>>> loader = data.StreamingLoader(path, batch_size=64, device="cpu", shuffle=True, seed=0)
>>> batch = next(iter(loader))
>>> (tuple(batch.shape), batch.dtype)
((64, 17), torch.int32)

The C++ side is ``include/optimized/loader.h``; the format and the design are in
``docs/perf-notes/loader.md``.
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterator, NamedTuple

import torch

from ._library import load

_lib = load()  # registers torch.classes.optimized.* and torch.ops.optimized.*
_lib.optimized_loader_wait.restype = ctypes.c_int
_lib.optimized_loader_wait.argtypes = [ctypes.c_void_p]

_TORCH_DTYPES = {
    torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.uint16: "uint16",
    torch.int32: "int32", torch.uint32: "uint32", torch.int64: "int64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
}
_BY_NAME = {v: k for k, v in _TORCH_DTYPES.items()}

__all__ = ["StreamingLoader", "ShardWriter", "DatasetInfo", "write_shards", "dataset_info", "verify_shards"]


class DatasetInfo(NamedTuple):
    """What a dataset directory holds."""

    dtype: str                   # "int32", "bfloat16", ... (torch_dtype gives the torch one)
    record_shape: tuple          # shape of one record
    record_bytes: int
    num_records: int
    num_shards: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _BY_NAME[self.dtype]


def dataset_info(path: str) -> DatasetInfo:
    """Reads and checks every shard header of the dataset at ``path`` (not the records).

    Raises ``ValueError`` naming the file for a missing, extra, truncated or corrupted shard."""
    dtype, shape, record_bytes, num_records, num_shards = torch.ops.optimized.shard_dataset_info(str(path))
    return DatasetInfo(dtype, tuple(shape), record_bytes, num_records, num_shards)


def verify_shards(path: str) -> None:
    """Reads every record of the dataset at ``path`` and checks its CRC32C.

    Raises ``ValueError`` naming the file and the record at the first mismatch."""
    torch.ops.optimized.verify_shards(str(path))


def _as_tensor(records: Any) -> torch.Tensor:
    if isinstance(records, torch.Tensor):
        return records.detach().cpu()
    try:
        import numpy as np
    except ImportError:  # numpy is optional: torch tensors need no conversion
        np = None
    if np is not None and isinstance(records, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(records))
    raise TypeError(f"records: expected a torch.Tensor or numpy.ndarray; given {type(records).__name__}")


class ShardWriter:
    """Writes records into a new dataset directory, shard by shard (for data larger than memory).

    >>> with ShardWriter(path, torch.int32, (2048,), records_per_shard=4096) as w:  # doctest: +SKIP
    ...     for chunk in chunks:
    ...         w.append(chunk)                      # (n, 2048) int32, numpy or torch

    Parameters
    ----------
    path : str
        Directory; created if missing. If it holds shard files already, ``overwrite=True`` deletes
        them first, else ``ValueError``.
    dtype : torch.dtype or str
        Element type of every record.
    record_shape : tuple of int
        Shape of one record.
    records_per_shard : int
        Records per shard file (the last shard may hold fewer).
    """

    def __init__(self, path: str, dtype, record_shape, records_per_shard: int, overwrite: bool = False):
        name = _TORCH_DTYPES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else str(dtype)
        if isinstance(dtype, torch.dtype) and dtype not in _TORCH_DTYPES:
            raise TypeError(f"dtype: expected one of {sorted(_TORCH_DTYPES.values())}; given {dtype}")
        self.dtype = name
        self.record_shape = tuple(int(d) for d in record_shape)
        self._impl = torch.classes.optimized.ShardWriter(str(path), name, list(self.record_shape),
                                                         int(records_per_shard), bool(overwrite))
        self.path = str(path)

    def append(self, records) -> None:
        """Appends records: an array of shape (n, *record_shape) of the writer's dtype."""
        t = _as_tensor(records)
        if t.dim() < 1:
            raise ValueError(f"records: expected shape (n, {', '.join(map(str, self.record_shape))}); given 0-d")
        # Large inputs go in pieces of about 64 MiB, so that a non-contiguous input is never copied whole.
        per = max(1, (64 << 20) // max(1, t[0].numel() * t.element_size())) if len(t) else 1
        for start in range(0, len(t), per):
            self._impl.append(t[start:start + per])

    def close(self) -> DatasetInfo:
        """Finishes every header; returns what was written."""
        self._impl.close()
        return dataset_info(self.path)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        if self._impl.records_written() >= 0:
            self.close()


def write_shards(path: str, records, records_per_shard: int | None = None, shard_bytes: int = 1 << 30,
                 overwrite: bool = False) -> DatasetInfo:
    """Writes a numpy array or torch tensor of shape (N, *record_shape) as a dataset of shards.

    Parameters
    ----------
    path : str
        The dataset directory (created; existing shards are an error unless ``overwrite``).
    records : numpy.ndarray or torch.Tensor
        N records; dtype uint8, int8, int16, uint16, int32, uint32, int64, float16, bfloat16,
        float32 or float64.
    records_per_shard : int, optional
        Records per shard file; default: as many as fit in ``shard_bytes`` (1 GiB).
    overwrite : bool
        Replace the shard files already in ``path``.

    Returns
    -------
    DatasetInfo
    """
    t = _as_tensor(records)
    if t.dim() < 1:
        raise ValueError(f"records: expected shape (N, *record_shape); given a 0-d {type(records).__name__}")
    if t.dtype not in _TORCH_DTYPES:
        raise TypeError(f"records: expected dtype one of {sorted(_TORCH_DTYPES.values())}; given {t.dtype}")
    record_bytes = max(1, t[0].numel() * t.element_size()) if len(t) else t.element_size()
    if records_per_shard is None:
        records_per_shard = max(1, shard_bytes // record_bytes)
    writer = ShardWriter(path, t.dtype, t.shape[1:], records_per_shard, overwrite)
    if len(t):
        writer.append(t)
    return writer.close()


class StreamingLoader:
    """Batches of records from a shard dataset, as tensors on ``device``, several in flight.

    Iterating gives one epoch: tensors of shape (batch_size, *record_shape) (the last one shorter
    unless ``drop_last``) and the dataset's dtype; iterate again for the next epoch. A CUDA batch is
    ready for work on the current stream when it is returned (the stream waits for its copy).

    >>> loader = StreamingLoader(path, batch_size=256, device="cuda", shuffle=True, seed=0,
    ...                          rank=rank, world_size=world_size)          # doctest: +SKIP
    >>> for epoch in range(3):                                              # doctest: +SKIP
    ...     for batch in loader:
    ...         loss = model(batch).sum(); loss.backward(); opt.step()

    Every record comes exactly once per epoch, across the ranks, in an order fixed by
    ``(seed, epoch)``; a batch holding a corrupted record raises ``ValueError`` naming the shard
    file and the record (and the loader keeps raising: nothing is skipped). Breaking out of a loop
    and iterating again continues where it stopped; :meth:`state_dict` / :meth:`load_state_dict`
    resume in a new process.

    Parameters
    ----------
    path : str
        The dataset directory (:func:`write_shards`).
    batch_size : int
        Records per batch.
    device : str or torch.device
        ``"cuda"`` (the current device), ``"cuda:N"`` or ``"cpu"``.
    shuffle, seed : bool, int
        A permutation of all records per epoch, from ``(seed, epoch)``; the same on every rank.
    rank, world_size : int
        Data-parallel sharding: rank ``r`` reads the ``r``-th of ``world_size`` contiguous parts of
        each epoch's order (sizes differ by at most one record).
    drop_last : bool
        Every rank yields ``num_records // world_size // batch_size`` full batches (the same count
        on every rank); the rest of each epoch's order is not read.
    epochs : int, optional
        Stop after this many epochs (iterating further yields nothing); default: no limit.
    prefetch : int
        Batches read ahead of the consumer.
    threads : int
        Worker threads (pread, checksums); 0 chooses from the core count.
    io : str
        ``"auto"`` (io_uring for O_DIRECT, else a pread pool), ``"io_uring"`` or ``"pread"``.
        Where io_uring is unavailable the pread pool is used and the loader says so once.
    direct_io : str
        ``"auto"`` (O_DIRECT where the filesystem takes it), ``"on"`` or ``"off"`` (page cache).
    gds : str
        GPUDirect Storage: ``"auto"`` (where the nvidia-fs driver is loaded), ``"on"`` or ``"off"``.
    verify : bool
        Check each record's CRC32C as it arrives.
    variant : str
        ``"pipelined"``, or ``"synchronous"`` (read on demand, no overlap: for comparison).
    return_indices : bool
        Yield ``(batch, indices)``: the dataset index of each record, an int64 CPU tensor.
    """

    def __init__(self, path: str, batch_size: int, device="cuda", shuffle: bool = False, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False, epochs: int | None = None,
                 prefetch: int = 4, threads: int = 0, io: str = "auto", direct_io: str = "auto",
                 gds: str = "auto", verify: bool = True, variant: str = "pipelined",
                 chunk_bytes: int = 1 << 20, queue_depth: int = 32, return_indices: bool = False):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.path = str(path)
        self.batch_size = int(batch_size)
        self.device = device
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.drop_last = bool(drop_last)
        self.return_indices = bool(return_indices)
        self._impl = torch.classes.optimized.StreamingLoader(
            self.path, self.batch_size, str(device), self.shuffle, self.seed, self.rank, self.world_size,
            self.drop_last, int(epochs or 0), 0, 0, str(variant), int(prefetch), int(threads), str(io),
            str(direct_io), str(gds), bool(verify), int(chunk_bytes), int(queue_depth))
        self._closed = False
        self.dtype = _BY_NAME[self._impl.dtype()]
        self.record_shape = tuple(self._impl.record_shape())
        self.num_records = self._impl.num_records()

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            batch = self.next()
            if batch is None:
                return
            yield (batch, self.last_indices) if self.return_indices else batch

    def next(self) -> torch.Tensor | None:
        """The next batch of the epoch, or ``None`` once at its end (the next call starts the next
        epoch)."""
        self._check_open()
        # Wait without the GIL (ctypes releases it), then take the batch that is now ready.
        _lib.optimized_loader_wait(ctypes.c_void_p(self._impl.handle()))
        return self._impl.next()

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self._impl.batches_per_epoch()

    @property
    def last_indices(self) -> torch.Tensor:
        """Dataset indices of the records of the last batch returned (int64, CPU)."""
        return self._impl.last_indices()

    @property
    def records_per_epoch(self) -> int:
        return self._impl.records_per_epoch()

    # ---- position ----------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._impl.position()[0]

    def state_dict(self) -> dict:
        """Where the loader is, with what fixes the order: resume with :meth:`load_state_dict`."""
        epoch, batch = self._impl.position()
        return {"epoch": epoch, "batch": batch, "num_records": self.num_records, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continues from a :meth:`state_dict`. The order-fixing fields must match this loader's
        (else some records would be skipped or repeated): ``ValueError`` names the one that differs."""
        for key in ("num_records", "batch_size", "shuffle", "seed", "rank", "world_size", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"load_state_dict: {key} is {state.get(key)!r} in the state and "
                                 f"{getattr(self, key)!r} in this loader; resuming would skip or repeat records")
        self._check_open()
        self._impl.seek(int(state["epoch"]), int(state["batch"]))

    # ---- what it does ------------------------------------------------------------------------
    @property
    def io_backend(self) -> str:
        """``"io_uring"``, ``"pread"`` or ``"cufile"``."""
        return self._impl.io_backend()

    @property
    def direct_io(self) -> bool:
        return self._impl.direct_io()

    @property
    def gds(self) -> bool:
        return self._impl.gds()

    @property
    def notes(self) -> list[str]:
        """Why a preferred path was not taken (io_uring, O_DIRECT, GPUDirect Storage)."""
        return list(self._impl.notes())

    def stats(self) -> dict:
        batches, record_bytes, read_bytes, wait_s = self._impl.stats()
        return {"batches": int(batches), "record_bytes": int(record_bytes), "read_bytes": int(read_bytes),
                "consumer_wait_s": wait_s}

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the threads and frees the staging buffers; tensors already returned stay valid."""
        if not self._closed:
            self._closed = True
            self._impl.stop()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("StreamingLoader: the loader is closed")

    def __enter__(self) -> "StreamingLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StreamingLoader({self.path!r}, batch_size={self.batch_size}, device='{self.device}', "
                f"records={self.num_records}, record_shape={self.record_shape}, dtype={self.dtype}, "
                f"io={self.io_backend!r}, direct_io={self.direct_io}, gds={self.gds})")
