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
import operator
import os
import warnings
from typing import Any, Iterator, NamedTuple

import torch
import torch.utils.data

from ._library import load
from ._variants import register_family

_lib = load()  # registers torch.classes.optimized.* and torch.ops.optimized.*
# StreamingLoader(variant=...): "synchronous", "pipelined" (the C++ LoaderVariant's names).
register_family("loader", lambda: list(torch.ops.optimized.loader_variants()))
_lib.optimized_loader_wait.restype = ctypes.c_int
_lib.optimized_loader_wait.argtypes = [ctypes.c_void_p]

_TORCH_DTYPES = {
    torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.uint16: "uint16",
    torch.int32: "int32", torch.uint32: "uint32", torch.int64: "int64", torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
}
_BY_NAME = {v: k for k, v in _TORCH_DTYPES.items()}

__all__ = ["StreamingLoader", "ShardWriter", "DatasetInfo", "write_shards", "dataset_info", "verify_shards"]


def _int_arg(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int, refusing what is not one (as ``torch.utils.data.DataLoader`` does for
    ``batch_size``): a float (even 2.0), a bool, a string. TypeError or ValueError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int; given a bool ({value!r})")
    try:
        v = operator.index(value)  # int, numpy integers, anything with __index__; not float
    except TypeError:
        raise TypeError(f"{name}: expected an int; given {type(value).__name__} {value!r}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{name}: expected >= {minimum}; given {v}")
    return v


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

    The dataset is complete only once :meth:`close` (or the end of the ``with`` block) has finished
    it. Until then the directory holds a ``shards.incomplete`` marker, and opening it raises
    ``ValueError`` saying it is incomplete. An exception that leaves the ``with`` block, :meth:`abort`,
    or dropping the writer without closing it leaves it so: a failure half-way never looks like a
    valid, shorter dataset.

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
        self.record_shape = tuple(_int_arg(f"record_shape[{i}]", d) for i, d in enumerate(record_shape))
        records_per_shard = _int_arg("records_per_shard", records_per_shard)
        self._impl = torch.classes.optimized.ShardWriter(str(path), name, list(self.record_shape),
                                                         records_per_shard, bool(overwrite))
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
        """Finishes every header and removes the incomplete marker; returns what was written."""
        self._impl.close()
        return dataset_info(self.path)

    def abort(self, why: str = "") -> None:
        """Stops writing and leaves the dataset visibly incomplete (opening it raises ``ValueError``
        that says so, with ``why``). No effect once closed or aborted."""
        self._impl.abort(str(why))

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._impl.records_written() < 0:
            return  # closed or aborted already
        if exc_type is not None:
            self.abort(f"{exc_type.__name__} raised inside the with block: {exc}")
            return  # the exception propagates
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
    if records_per_shard is not None:
        records_per_shard = _int_arg("records_per_shard", records_per_shard, 1)
    shard_bytes = _int_arg("shard_bytes", shard_bytes, 1)
    t = _as_tensor(records)
    if t.dim() < 1:
        raise ValueError(f"records: expected shape (N, *record_shape); given a 0-d {type(records).__name__}")
    if t.dtype not in _TORCH_DTYPES:
        raise TypeError(f"records: expected dtype one of {sorted(_TORCH_DTYPES.values())}; given {t.dtype}")
    record_bytes = max(1, t[0].numel() * t.element_size()) if len(t) else t.element_size()
    if records_per_shard is None:
        records_per_shard = max(1, shard_bytes // record_bytes)
    with ShardWriter(path, t.dtype, t.shape[1:], records_per_shard, overwrite) as writer:
        if len(t):
            writer.append(t)
    return dataset_info(path)


class StreamingLoader(torch.utils.data.IterableDataset):
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
    resume in a new process (on the same dataset: its fingerprint is checked).

    Processes. A CPU loader used in a forked child (``multiprocessing`` with the "fork" start
    method) starts afresh there (its own threads and files) where the parent's loader was at the
    fork, and gives the child the batches the parent would have read next. It is also an
    ``IterableDataset``: in ``torch.utils.data.DataLoader(loader, batch_size=None, num_workers=n)``
    worker ``k`` reads batches ``k, k + n, ...`` of each epoch, so that the DataLoader yields the
    loader's own sequence, each batch once (with ``persistent_workers=True`` each pass over the
    DataLoader is the next epoch; without, every pass starts again where the parent's loader is).
    The loader's own threads already overlap reading with training: workers add nothing but copies.
    A CUDA loader cannot be used in a forked child (CUDA does not survive fork): create it in the
    process that uses it, or start processes with "spawn".

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
        Worker threads (pread, checksums); 0: three quarters of the hardware threads, 2 to 32.
    io : str
        ``"auto"``: on CUDA, ``"mmap"`` when the page cache holds at least 90% of the dataset and it is at
        most a quarter of the physical memory, else (and on the CPU) io_uring for O_DIRECT, else a pread
        pool; ``notes`` says what was picked and why. ``"io_uring"``, ``"pread"``, or ``"mmap"`` (the
        shards mapped and, on CUDA, pinned while the loader lives: page cache only; a shard truncated while
        mapped is a ``ValueError``, as with the others) force one. Where io_uring is unavailable the pread
        pool is used and the loader says so once.
    direct_io : str
        ``"auto"`` (O_DIRECT where the filesystem takes it), ``"on"`` or ``"off"`` (page cache).
    gds : str
        GPUDirect Storage: ``"auto"`` (where the nvidia-fs driver is loaded), ``"on"`` or ``"off"``.
    queue_depth, chunk_bytes : int
        io_uring reads in flight and the largest single read (a multiple of 4096). 0 (the default):
        automatic, from the block device under the dataset: with O_DIRECT, 4 MiB reads (1 MiB where the
        device's requests are under 256 KiB) and 128 MiB in flight (32 to 128 reads); through the page
        cache, 32 x 1 MiB. :attr:`notes` says what was picked and whether the staging buffers are
        registered with io_uring (fixed buffers; ``OPTIMIZED_LOADER_FIXED_BUFFERS=off`` in the
        environment turns that off).
    verify : bool
        Check each record's CRC32C as it arrives.
    variant : str
        ``"pipelined"``, or ``"synchronous"`` (read on demand, no overlap: for comparison);
        ``optimized_ops.variants("loader")`` lists them.
    return_indices : bool
        Yield ``(batch, indices)``: the dataset index of each record, an int64 CPU tensor.
    staging_bytes : int
        The most host memory (pinned on CUDA) the read-ahead buffers may take; default 1 GiB. Each of
        the ``prefetch`` buffers holds one batch as read: at most ``min(batch_size, records per
        epoch of this rank)`` records, plus the 4 KiB widening of O_DIRECT reads (never more than the
        dataset). If they do not fit, ``direct_io="auto"`` reads through the page cache (no
        widening) where that fits, else fewer batches are read ahead (both said in :attr:`notes`);
        if one batch does not fit, ``ValueError`` names ``batch_size`` and the bytes.

    Every integer argument must be an int (a float such as ``2.5`` or ``2.0``, or a bool, raises
    ``TypeError`` naming it); ranges are checked by the library (``ValueError``).
    """

    def __init__(self, path: str, batch_size: int, device="cuda", shuffle: bool = False, seed: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False, epochs: int | None = None,
                 prefetch: int = 4, threads: int = 0, io: str = "auto", direct_io: str = "auto",
                 gds: str = "auto", verify: bool = True, variant: str = "pipelined",
                 chunk_bytes: int = 0, queue_depth: int = 0, return_indices: bool = False,
                 staging_bytes: int = 1 << 30):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.path = str(path)
        self.batch_size = _int_arg("batch_size", batch_size)
        self.device = device
        self.shuffle = bool(shuffle)
        self.seed = _int_arg("seed", seed)
        self.rank = _int_arg("rank", rank)
        self.world_size = _int_arg("world_size", world_size)
        self.drop_last = bool(drop_last)
        self.return_indices = bool(return_indices)
        # Everything the C++ loader is made from (a DataLoader worker makes its own from it).
        self._args = dict(
            epochs=0 if epochs is None else _int_arg("epochs", epochs, 0), variant=str(variant),
            prefetch=_int_arg("prefetch", prefetch), threads=_int_arg("threads", threads), io=str(io),
            direct_io=str(direct_io), gds=str(gds), verify=bool(verify),
            chunk_bytes=_int_arg("chunk_bytes", chunk_bytes), queue_depth=_int_arg("queue_depth", queue_depth),
            staging_bytes=_int_arg("staging_bytes", staging_bytes))
        self._impl = self._make_impl(0, 0, 0, 1)
        self._pid = os.getpid()
        self._closed = False
        self.dtype = _BY_NAME[self._impl.dtype()]
        self.record_shape = tuple(self._impl.record_shape())
        self.num_records = self._impl.num_records()

    def _make_impl(self, start_epoch: int, start_batch: int, worker: int, num_workers: int):
        a = self._args
        return torch.classes.optimized.StreamingLoader(
            self.path, self.batch_size, str(self.device), self.shuffle, self.seed, self.rank, self.world_size,
            self.drop_last, a["epochs"], start_epoch, start_batch, a["variant"], a["prefetch"], a["threads"],
            a["io"], a["direct_io"], a["gds"], a["verify"], a["chunk_bytes"], a["queue_depth"], a["staging_bytes"],
            worker, num_workers)

    def _check_process(self) -> None:
        """In a forked child: a CUDA loader refuses; a CPU one goes on (the C++ loader starts its own
        threads there), and in a DataLoader worker takes that worker's share of the batches."""
        pid = os.getpid()
        if pid == self._pid:
            return
        if self.device.type == "cuda":
            raise RuntimeError(
                f"StreamingLoader: this loader delivers to {self.device} and was created in process {self._pid}; "
                f"process {pid} is a fork of it, and CUDA cannot be used in a forked child. Create the loader in "
                "the process that uses it (in the child's function, or in a DataLoader worker: in the dataset's "
                "__iter__ or worker_init_fn), or start the child with the 'spawn' or 'forkserver' method "
                "(multiprocessing.get_context('spawn'), DataLoader(multiprocessing_context='spawn')).")
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            epoch, batch = self._impl.position()  # where the parent's loader was at the fork
            self._impl = self._make_impl(epoch, batch, info.id, info.num_workers)
        self._pid = pid
    def __getstate__(self):
        raise TypeError("StreamingLoader cannot be pickled (it owns threads, files and buffers of this process): "
                        "create the loader in the process that uses it (for a 'spawn' DataLoader worker: in the "
                        "dataset's __iter__ or worker_init_fn), or use the 'fork' start method on the CPU")

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
        self._check_process()
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
        self._check_process()
        return self._impl.position()[0]

    @property
    def fingerprint(self) -> str:
        """What identifies the dataset's contents (16 hex digits): a hash of its dtype, record shape,
        shard layout and every shard's checksum (so of every record's bytes). The same for a copy of
        the files; different once any record changes."""
        return self._impl.fingerprint()

    def state_dict(self) -> dict:
        """Where the loader is, with what fixes the order and the dataset's :attr:`fingerprint`:
        resume with :meth:`load_state_dict`."""
        self._check_process()
        epoch, batch = self._impl.position()
        return {"epoch": epoch, "batch": batch, "num_records": self.num_records, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "seed": self.seed, "rank": self.rank, "world_size": self.world_size,
                "drop_last": self.drop_last, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continues from a :meth:`state_dict`. The order-fixing fields must match this loader's
        (else some records would be skipped or repeated), and so must the dataset's fingerprint (a
        dataset rewritten or modified since the state was saved holds other records at the same
        positions): ``ValueError`` names the one that differs. A state saved before fingerprints
        were recorded is accepted with a warning."""
        for key in ("num_records", "batch_size", "shuffle", "seed", "rank", "world_size", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"load_state_dict: {key} is {state.get(key)!r} in the state and "
                                 f"{getattr(self, key)!r} in this loader; resuming would skip or repeat records")
        saved = state.get("fingerprint")
        if saved is None:
            warnings.warn("load_state_dict: the state has no dataset fingerprint (saved by an older version); "
                          f"cannot check that {self.path} is the dataset it was saved with", stacklevel=2)
        elif saved != self.fingerprint:
            raise ValueError(f"load_state_dict: the state was saved for a dataset with fingerprint {saved}; "
                             f"{self.path} has fingerprint {self.fingerprint}: its records differ (rewritten or "
                             "modified since the state was saved), so resuming would read other records")
        epoch = _int_arg("state['epoch']", state["epoch"], 0)
        batch = _int_arg("state['batch']", state["batch"], 0)
        self._check_open()
        self._check_process()
        self._impl.seek(epoch, batch)

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

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the read-ahead buffers (see the ``staging_bytes`` argument)."""
        return self._impl.staging_bytes()

    @property
    def prefetch(self) -> int:
        """Batches read ahead (the ``prefetch`` argument, or fewer to fit ``staging_bytes``)."""
        return self._impl.prefetch()

    def stats(self) -> dict:
        self._check_process()
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
