#!/usr/bin/env python3
"""Streaming loader benchmark: bytes per second delivered into GPU memory, against the ceilings and
the usual alternative, all measured in the same run on the same files.

  ceilings   the disk's own O_DIRECT sequential read (1 and 8 reads in flight, 4 MiB each, cold:
             O_DIRECT bypasses the page cache); pinned host-to-device copy bandwidth (the page
             cache path's ceiling); a GPU compute load alone (bf16 matmuls, TFLOP/s)
  from disk  the loader (O_DIRECT, sequential and shuffled; pipelined with the compute load running
             on another stream, and without it; the synchronous rung) and
             torch.utils.data.DataLoader(pin_memory=True, workers reading records with pread), and
             kvikio (CuFile.pread into GPU tensors, O_DIRECT; sequential and shuffled), each from a
             cold page cache (posix_fadvise DONTNEED before each run)
  from cache the same with every file in the page cache (loader direct_io="off", kvikio buffered)

kvikio comes from the environment, else from the wheels scripts/fetch-wheels puts in .whl/ (unpacked
into .whl/unpacked/); where it cannot import or read, its rows are "skipped" with the reason
(--no-kvikio skips them). Without nvidia-fs it runs in its compatibility mode (POSIX reads into
pinned bounce buffers, then a copy to the GPU); each row's io column says which mode it ran in.

Each loader/DataLoader/kvikio row is one pass (time-capped) over the dataset: GB/s = record bytes delivered
/ seconds from the first batch to the last one's arrival on the GPU (the first batch is excluded, so
start-up costs are not counted for either), p10/p90 from the per-batch intervals. A few batches are
checked byte-exact first (record i starts with the 8-byte index i).

    PYTHONPATH=build-py/site python3 bench/loader_bench.py            # writes bench/results/<gpu>/loader.{json,md}
    python3 bench/loader_bench.py --out DIR --gib 8 --budget-s 200   # flat DIR/loader.json, loader.md
    python3 bench/loader_bench.py --out DIR --gib 4 --cap-s 6 --only disk   # the disk rows only (about 2 min)

Targets (issue 5, on the H100): >= 0.9x the disk's O_DIRECT read with compute running; from page
cache >= 0.8x pinned H2D; faster than DataLoader(pin_memory=True); issue 19: >= 1.0x kvikio.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import datetime
import json
import math
import mmap
import os
import pathlib
import platform
import shutil
import signal
import statistics
import struct
import sys
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
GiB = 1 << 30
START = time.perf_counter()
DEV = "cuda"  # "cpu" with --smoke: the whole script on a machine without a GPU, tiny, for testing it


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per quarter otherwise."""

    def __init__(self, label: str, total: float, unit: str = "GiB"):
        self.label, self.total, self.unit = label, total, unit
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.next_mark = 0.25

    def update(self, done: float) -> None:
        frac = min(1.0, done / self.total) if self.total else 1.0
        rate = done / max(1e-9, time.perf_counter() - self.t0)
        if self.tty:
            bar = "#" * int(frac * 30)
            print(f"\r  {self.label:<34} [{bar:<30}] {done:6.2f}/{self.total:.2f} {self.unit} {rate:6.2f} {self.unit}/s",
                  end="", file=sys.stderr, flush=True)
        elif frac >= self.next_mark:
            print(f"  {self.label}: {frac * 100:3.0f}% ({rate:.2f} {self.unit}/s)", file=sys.stderr, flush=True)
            while self.next_mark <= frac:
                self.next_mark += 0.25

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


# ---- the machine -------------------------------------------------------------------------------

def machine() -> dict:
    m = {"gpu": None, "gpu_key": None, "cpu": runner.cpu_model_name(), "cpu_threads": os.cpu_count(), "cpu_isa": "-",
         "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "kernel": platform.release(),
         "torch": torch.__version__}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        m.update(gpu=name, gpu_key=runner.gpu_key_from_name(name), cuda_runtime=torch.version.cuda)
    return m


def direct_io_works(d: pathlib.Path) -> str:
    """'' when O_DIRECT reads work in d, else why not."""
    probe = d / ".odirect-probe"
    try:
        probe.write_bytes(b"\1" * 4096)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 4096)
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        return ""
    except OSError as e:
        return f"{e.strerror}"
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def pick_data_dir(requested: str | None, need_bytes: int) -> tuple[pathlib.Path, list[str]]:
    """The first candidate with O_DIRECT and room for the dataset."""
    notes = []
    cands = [requested] if requested else [os.environ.get("LOADER_BENCH_DIR"),
                                           str(ROOT / os.environ.get("OPTIMIZED_BUILD_DIR", "build")),
                                           "/var/tmp", "/tmp", os.path.expanduser("~")]
    for c in [c for c in cands if c]:
        d = pathlib.Path(c) / "loader-bench-data"
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            notes.append(f"{d}: {e.strerror}")
            continue
        free = shutil.disk_usage(d).free
        why = direct_io_works(d)
        if why:
            notes.append(f"{d}: no O_DIRECT ({why})")
            continue
        existing = sum(f.stat().st_size for f in d.glob("*/*.osh"))
        if free + existing < need_bytes * 1.1:
            notes.append(f"{d}: {free / GiB:.1f} GiB free, {need_bytes / GiB:.1f} GiB needed")
            continue
        return d, notes
    raise SystemExit("no data directory with O_DIRECT and enough room: " + "; ".join(notes))


# ---- the dataset -------------------------------------------------------------------------------

def make_dataset(path: pathlib.Path, records: int, record_bytes: int, per_shard: int) -> dict:
    """Records of pseudo-random bytes whose first 8 bytes hold their index; reused when present."""
    from optimized_ops import data
    try:
        info = data.dataset_info(str(path))
        if info.num_records == records and info.record_bytes == record_bytes:
            log(f"dataset {path}: reusing {records} records of {record_bytes} bytes")
            return {"written_s": None}
    except (ValueError, RuntimeError):
        pass
    base = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    chunk = max(1, (64 << 20) // record_bytes)
    t0 = time.perf_counter()
    prog = Progress("writing shards", records * record_bytes / GiB)
    with data.ShardWriter(str(path), torch.uint8, (record_bytes,), per_shard, overwrite=True) as w:
        for first in range(0, records, chunk):
            n = min(chunk, records - first)
            block = torch.empty((n, record_bytes), dtype=torch.uint8)
            for k in range(n):
                off = ((first + k) * 7919 * 64) % (base.numel() - record_bytes)
                block[k] = base[off:off + record_bytes]
            block[:, :8] = torch.arange(first, first + n, dtype=torch.int64).view(torch.uint8).view(n, 8)
            w.append(block)
            prog.update((first + n) * record_bytes / GiB)
    prog.close()
    return {"written_s": time.perf_counter() - t0}


def shard_files(path: pathlib.Path) -> list[pathlib.Path]:
    return sorted(path.glob("shard-*.osh"))


def evict(path: pathlib.Path) -> None:
    """Drops the files' pages from the page cache (clean pages: no root needed)."""
    for f in shard_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(path: pathlib.Path, threads: int, chunk: int, direct: bool, cap_bytes: int, cap_s: float,
               label: str) -> dict:
    """Reads the shard files front to back in `chunk` pieces, `threads` in flight; GB/s."""
    files = shard_files(path)
    pieces = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]
    lock = threading.Lock()
    state = {"next": 0, "bytes": 0, "stop": False}
    prog = Progress(label, min(cap_bytes, sum(f.stat().st_size for f in files)) / GiB)
    fds = {f: os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for f in files}
    t0 = time.perf_counter()

    def worker():
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        while True:
            with lock:
                i = state["next"]
                if i >= len(pieces) or state["stop"]:
                    return
                state["next"] += 1
            f, off = pieces[i]
            n = os.preadv(fds[f], [buf], off)
            with lock:
                state["bytes"] += n
                if state["bytes"] >= cap_bytes or time.perf_counter() - t0 > cap_s:
                    state["stop"] = True

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    while any(t.is_alive() for t in ts):
        time.sleep(0.1)
        prog.update(state["bytes"] / GiB)
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    prog.close()
    for fd in fds.values():
        os.close(fd)
    return {"bytes": state["bytes"], "seconds": elapsed, "gbps": state["bytes"] / elapsed / 1e9}


def read_ceiling(path, io, depth, chunk, max_bytes, direct) -> dict:
    """The storage ceiling through the loader's own engines (optimized::measure_read_bandwidth)."""
    nbytes, seconds = torch.ops.optimized.loader_read_bandwidth(str(path), io, depth, chunk, max_bytes, direct)
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9}


# ---- GPU side ----------------------------------------------------------------------------------

def pinned_h2d(bytes_: int = 256 << 20, reps: int = 20) -> dict:
    src = torch.empty(bytes_, dtype=torch.uint8).pin_memory()
    dst = torch.empty(bytes_, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    med = statistics.median(times)
    return {"gbps": bytes_ / (med / 1e3) / 1e9, "time_ms": stats_ms(times)}


class ComputeLoad:
    """bf16 matmuls (8192^3) on their own stream in a background thread, 8 per synchronize; the
    GIL is released while it waits, so it runs beside the consumer loop."""

    def __init__(self, n: int = 8192):
        self.n = n
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            self.b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            self.c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        self.stream.synchronize()
        self.flops = 0.0
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                for _ in range(8):
                    torch.matmul(self.a, self.b, out=self.c)
                self.stream.synchronize()
                self.flops += 8 * 2.0 * self.n ** 3

    def __enter__(self):
        self.flops = 0.0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.tflops = self.flops / (time.perf_counter() - self._t0) / 1e12


class TrainStep:
    """A stand-in for a training step that consumes each batch: bf16 matmuls on the current stream
    after the batch arrives, `count` of them, sized to take about as long as reading the batch."""

    def __init__(self, seconds: float, n: int = 8192):
        self.a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        torch.matmul(self.a, self.a, out=self.c)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            torch.matmul(self.a, self.a, out=self.c)
        torch.cuda.synchronize()
        one = (time.perf_counter() - t) / 5
        self.count = max(1, round(seconds / one))
        self.seconds = self.count * one

    def __call__(self, batch: torch.Tensor) -> None:
        self.c[0, :8].copy_(batch[0, :8])  # depends on the batch
        for _ in range(self.count):
            torch.matmul(self.a, self.a, out=self.c)


class NoCompute:
    """--smoke: no GPU, no compute load."""
    tflops = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def stats_ms(samples_ms: list[float]) -> dict:
    if not samples_ms:
        return {"median": None, "p10": None, "p90": None, "cv": 0.0, "samples": 0}
    s = sorted(samples_ms)
    q = lambda p: s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))]
    mean = sum(s) / len(s)
    cv = statistics.pstdev(s) / mean if mean else 0.0
    return {"median": statistics.median(s), "p10": q(0.1), "p90": q(0.9), "cv": cv, "samples": len(s)}


def check_batch(batch: torch.Tensor, ids: torch.Tensor) -> None:
    """Record i starts with its index (little-endian int64)."""
    head = batch[:, :8].contiguous().cpu().view(torch.int64).flatten()
    if not torch.equal(head, ids):
        bad = (head != ids).nonzero()[0].item()
        raise AssertionError(f"batch record {bad}: starts with {head[bad].item()}, expected {ids[bad].item()}")


def run_loader(path, label, batch_size, cap_bytes, cap_s, compute=None, validate=3, step=None, **kw) -> dict:
    """One (capped) pass of StreamingLoader; GB/s from the first batch to the last one's arrival."""
    from optimized_ops import data
    loader = data.StreamingLoader(str(path), batch_size=batch_size, device=DEV, return_indices=True, **kw)
    info = {"io": loader.io_backend, "direct_io": loader.direct_io, "gds": loader.gds, "notes": loader.notes}
    total = min(cap_bytes, loader.records_per_epoch * loader._impl.record_bytes())
    prog = Progress(label, total / GiB)
    ctx = compute if compute is not None else _Null()
    arrivals, nbytes, first_bytes, checked = [], 0, 0, 0
    stream = torch.cuda.current_stream() if DEV == "cuda" else None
    with ctx:
        t_start = time.perf_counter()
        for batch, ids in loader:
            if checked < validate:
                check_batch(batch, ids)
                checked += 1
            if step is not None:
                step(batch)  # the training step: on the current stream, after the batch's copy
            if stream is not None:
                # The arrival of the batch in GPU memory, not just its hand-off: wait for its copy
                # (and the step, when there is one).
                stream.synchronize()
            now = time.perf_counter()
            if not arrivals:
                first_bytes = batch.numel()
            arrivals.append(now)
            nbytes += batch.numel()
            del batch
            prog.update(nbytes / GiB)
            if nbytes >= cap_bytes or now - t_start > cap_s:
                break
    prog.close()
    st = loader.stats()
    loader.close()
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else float("nan")
    intervals = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    out = {"bytes": nbytes, "seconds": span, "gbps": (nbytes - first_bytes) / span / 1e9 if span > 0 else None,
           "batches": len(arrivals), "first_batch_s": arrivals[0] - t_start if arrivals else None,
           "consumer_wait_s": st["consumer_wait_s"], "read_bytes": st["read_bytes"], "time_ms": stats_ms(intervals),
           **info}
    if compute is not None:
        out["compute_tflops"] = compute.tflops
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def run_dataloader(path, label, batch_size, cap_bytes, cap_s, workers, per_shard, compute=None,
                   shuffle=False) -> dict:
    """torch.utils.data.DataLoader(pin_memory=True): map-style dataset, one pread per record."""
    from torch.utils.data import DataLoader
    ds = ShardRecords(path, per_shard)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=workers, pin_memory=DEV == "cuda",
                        prefetch_factor=4, persistent_workers=False, drop_last=False)
    # The workers are forked here, before the compute thread starts (forking beside a running
    # thread that may hold a lock is how such benchmarks hang).
    batches = iter(loader)
    total = min(cap_bytes, len(ds) * ds.record_bytes)
    prog = Progress(label, total / GiB)
    ctx = compute if compute is not None else _Null()
    arrivals, nbytes, first_bytes, checked = [], 0, 0, 0
    stream = torch.cuda.current_stream() if DEV == "cuda" else None
    with ctx:
        t_start = time.perf_counter()
        for cpu_batch, ids in batches:
            batch = cpu_batch.to(DEV, non_blocking=True)
            if checked < 3:
                check_batch(batch, ids)
                checked += 1
            if stream is not None:
                stream.synchronize()
            now = time.perf_counter()
            if not arrivals:
                first_bytes = batch.numel()
            arrivals.append(now)
            nbytes += batch.numel()
            del batch, cpu_batch
            prog.update(nbytes / GiB)
            if nbytes >= cap_bytes or now - t_start > cap_s:
                break
    prog.close()
    del batches, loader
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else float("nan")
    intervals = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    out = {"bytes": nbytes, "seconds": span, "gbps": (nbytes - first_bytes) / span / 1e9 if span > 0 else None,
           "batches": len(arrivals), "first_batch_s": arrivals[0] - t_start if arrivals else None,
           "workers": workers, "time_ms": stats_ms(intervals)}
    if compute is not None:
        out["compute_tflops"] = compute.tflops
    return out


class ShardRecords(torch.utils.data.Dataset):
    """The shard files as a map-style dataset: record i with one pread (through the page cache, as
    such datasets do). Shards hold `per_shard` records each, the last one the rest."""

    def __init__(self, path, per_shard):
        from optimized_ops import data
        info = data.dataset_info(str(path))
        self.record_bytes, self.per_shard, self.total = info.record_bytes, per_shard, info.num_records
        self.files = [str(f) for f in shard_files(path)]
        self.fds = None

    def __len__(self):
        return self.total

    def __getitem__(self, i):
        if self.fds is None:  # opened in each worker
            self.fds = [os.open(f, os.O_RDONLY) for f in self.files]
        s, k = divmod(i, self.per_shard)
        buf = os.pread(self.fds[s], self.record_bytes, 4096 + k * self.record_bytes)
        return torch.frombuffer(bytearray(buf), dtype=torch.uint8), i


# ---- the kvikio peer ---------------------------------------------------------------------------
# kvikio (RAPIDS: files -> GPU memory through its own thread pool; GPUDirect Storage where the nvidia-fs
# driver is loaded, else its compatibility mode: POSIX reads into pinned bounce buffers, then a copy to
# the GPU) reading the same shard files in batches of the same bytes as the loader's.

# The wheels it is imported from where the environment lacks it (scripts/fetch-wheels downloads these
# versions into .whl/): kvikio (Python + Cython), libkvikio (libkvikio.so) and rapids_logger
# (librapids_logger.so, which libkvikio.so links). Not needed for reads into torch tensors, so not
# carried: cupy, numpy, packaging, cuda-pathfinder, cuda-toolkit[cufile] (scripts/fetch-wheels says why).
KVIKIO_WHEELS = {"kvikio_cu13": "26.10.0", "libkvikio_cu13": "26.10.0", "rapids_logger": "0.3.0"}
KVIKIO_TASK_BYTES = 4 << 20  # kvikio's default task: a multiple of 4 KiB, so O_DIRECT tasks stay aligned
KVIKIO_DEPTH = 3  # batches in flight: the next ones are read while one is consumed (the loader prefetches too)


def _first_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]


def _forget(prefixes) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in prefixes]:
        del sys.modules[name]


class Kvikio:
    """The kvikio module and how it was found, or why it cannot run here (`reason`)."""

    def __init__(self, mod=None, source: str = "", reason: str = "", threads: int = 0):
        self.mod, self.source, self.reason, self.threads = mod, source, reason, threads
        self.notes: list[str] = []

    def configure(self, direct: bool) -> dict:
        """kvikio's global settings for the next files opened: its thread pool, a task size, no
        synchronous shortcut for small reads (gds_threshold 0: a record's read goes to the pool too),
        O_DIRECT for POSIX reads or not; GDS only for O_DIRECT reads where nvidia-fs is loaded."""
        k = self.mod
        gds = direct and os.path.exists("/proc/driver/nvidia-fs")
        k.defaults.set({"compat_mode": k.CompatMode.AUTO if gds else k.CompatMode.ON,
                        "num_threads": self.threads, "task_size": KVIKIO_TASK_BYTES, "gds_threshold": 0,
                        "auto_direct_io_read": direct})
        compat = k.defaults.is_compat_mode_preferred()
        mode = ("compat mode (POSIX pread into pinned bounce buffers, then a copy to the GPU)" if compat
                else "GDS (cuFile)")
        requested = k.defaults.get("compat_mode")
        return {"kvikio_mode": mode, "compat_mode": getattr(requested, "name", str(requested)),
                "threads": k.defaults.get("num_threads"), "task_bytes": k.defaults.get("task_size"),
                "bounce_buffer_bytes": k.defaults.get("bounce_buffer_size")}


def load_kvikio(threads: int) -> Kvikio:
    """Imports kvikio: from the environment, else from the wheels in .whl/ (unpacked under
    .whl/unpacked/, put first on sys.path; nothing is installed). Never raises."""
    # Read once, when kvikio's settings are first created: O_DIRECT device reads widened to whole
    # pages (a record is 36.75 pages) instead of buffered reads for the unaligned ends.
    os.environ.setdefault("KVIKIO_AUTO_DIRECT_IO_READ_OVERREAD", "1")
    try:
        import kvikio
        import kvikio.defaults  # noqa: F401
        return Kvikio(kvikio, f"kvikio {kvikio.__version__} from the environment", threads=threads)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "kvikio":
            return Kvikio(reason=f"kvikio failed to import: {_first_line(e)}")
        _forget({"kvikio"})
    except Exception as e:  # noqa: BLE001 - any failure is a skip reason, never the run's end
        return Kvikio(reason=f"kvikio failed to import: {_first_line(e)}")

    wheels, missing = [], []
    for name, version in KVIKIO_WHEELS.items():
        found = sorted((ROOT / ".whl").glob(f"{name}-*.whl"))
        pinned = [w for w in found if w.name.startswith(f"{name}-{version}-")]
        (wheels.append((pinned or found)[-1]) if found else missing.append(f"{name}-{version}"))
    if missing:
        return Kvikio(reason=f"kvikio is not installed and .whl/ lacks {', '.join(missing)} "
                             "(scripts/fetch-wheels downloads them where PyPI is reachable)")
    added = []
    try:
        from benchmark_fused import _unpack  # the same .whl/unpacked/<wheel stem>/ as Liger's
        added = [str(_unpack(w)) for w in wheels]
        sys.path[:0] = added
        import importlib
        importlib.invalidate_caches()
        import libkvikio
        import rapids_logger
        # libkvikio.load_library() loads librapids_logger.so only when cuda.pathfinder imports, and then
        # fails where pathfinder finds no libcufile (needed only for GDS). So: the logger first, by hand,
        # and libkvikio.so even where that lookup fails (the cuFile shim dlopens libcufile.so.0 itself).
        rapids_logger.load_library()
        wheel_loader = libkvikio.load_library
        kv_notes = []

        def load_library():
            try:
                return wheel_loader()
            except Exception as e:  # noqa: BLE001
                kv_notes.append(f"libkvikio's library lookup failed ({_first_line(e)}): loaded libkvikio.so "
                                "without it (libcufile is needed only for GPUDirect Storage)")
                return libkvikio.load._load_library("libkvikio.so")

        libkvikio.load_library = load_library
        import kvikio
        import kvikio.defaults  # noqa: F401
    except Exception as e:  # noqa: BLE001
        _forget({"kvikio", "libkvikio", "rapids_logger"})
        for p in added:
            if p in sys.path:
                sys.path.remove(p)
        return Kvikio(reason=f"kvikio from .whl/ failed to import: {_first_line(e)}")
    kv = Kvikio(kvikio, f"kvikio {kvikio.__version__} from .whl/ ({', '.join(w.name for w in wheels)})",
                threads=threads)
    kv.notes += kv_notes
    return kv


def shard_layout(path: pathlib.Path) -> tuple[list[tuple], int]:
    """[(file, first record, records, data offset)] from the shard headers, and the record bytes
    (the format: docs/perf-notes/loader.md)."""
    shards, r_bytes = [], 0
    for f in shard_files(path):
        with open(f, "rb") as fh:
            head = fh.read(80)
        if head[:8] != b"OPTSHARD":
            raise ValueError(f"{f}: not a shard file")
        first, count, _total, r_bytes, data_offset = struct.unpack_from("<5Q", head, 32)
        shards.append((f, first, count, data_offset))
    return shards, r_bytes


class _DeviceSpan:
    """GPU bytes [ptr, ptr + n) as kvikio takes them (__cuda_array_interface__): one read per record
    into its place in the batch, without a torch view (and its Python cost) per record."""
    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


def run_kvikio(kv: Kvikio, path, label, batch_size, cap_bytes, cap_s, compute, shuffle: bool, direct: bool,
               validate: int = 3) -> dict:
    """kvikio's CuFile.pread into GPU batches of batch_size records: sequential, one read per batch
    (per shard where a batch spans two); shuffled, one read per record at its offset. KVIKIO_DEPTH
    batches in flight; epochs repeat until cap_bytes or cap_s. GB/s from the first batch to the last,
    as for the loader rows (a batch has arrived when its reads are done: kvikio returns after the copy
    to the GPU)."""
    shards, r_bytes = shard_layout(path)
    n_records = sum(s[2] for s in shards)
    starts = [s[1] for s in shards]
    info = kv.configure(direct)
    handles = [kv.mod.CuFile(str(s[0]), "r") for s in shards]
    reads_as = "buffered"
    if direct:
        info["direct_io"] = all(h.is_direct_io_supported() for h in handles)
        reads_as = "O_DIRECT" if info["direct_io"] else "buffered (O_DIRECT not supported here)"
    info["io"] = (f"kvikio {info['kvikio_mode'].split(' (')[0]}, {reads_as}, {info['threads']} threads"
                  + (", into host memory (--smoke)" if DEV != "cuda" else ""))
    gen = torch.Generator().manual_seed(1)

    def batches():
        while True:
            order = torch.randperm(n_records, generator=gen) if shuffle else torch.arange(n_records)
            for b0 in range(0, n_records, batch_size):
                yield order[b0:b0 + batch_size]

    def reads(ids):
        """(shard, file offset, bytes, offset in the batch) for the batch's records."""
        out = []
        if shuffle:
            for k, i in enumerate(ids.tolist()):
                s = bisect.bisect_right(starts, i) - 1
                out.append((s, shards[s][3] + (i - shards[s][1]) * r_bytes, r_bytes, k * r_bytes))
            return out
        a, left, k = int(ids[0]), len(ids), 0
        while left:
            s = bisect.bisect_right(starts, a) - 1
            _, first, count, offset = shards[s]
            m = min(left, first + count - a)
            out.append((s, offset + (a - first) * r_bytes, m * r_bytes, k * r_bytes))
            a, left, k = a + m, left - m, k + m
        return out

    def target(buf, at, n):
        if DEV == "cuda":
            return _DeviceSpan(buf.data_ptr() + at, n)
        return buf.numpy()[at:at + n]

    bufs = [torch.empty(batch_size * r_bytes, dtype=torch.uint8, device=DEV) for _ in range(KVIKIO_DEPTH)]
    prog = Progress(label, cap_bytes / GiB)
    arrivals, nbytes, first_bytes, checked, submitted = [], 0, 0, 0, 0
    inflight = collections.deque()
    it = batches()

    def submit(buf):
        nonlocal submitted
        ids = next(it)
        futures = [handles[s].pread(target(buf, at, n), n, off) for s, off, n, at in reads(ids)]
        inflight.append((buf, ids, futures))
        submitted += len(ids) * r_bytes

    try:
        with compute:
            t_start = time.perf_counter()
            for buf in bufs:
                if submitted < cap_bytes:
                    submit(buf)
            while inflight:
                buf, ids, futures = inflight.popleft()
                want = len(ids) * r_bytes
                got = sum(f.get() for f in futures)
                if got != want:
                    raise RuntimeError(f"kvikio read {got} bytes of a {want}-byte batch")
                batch = buf[:want].view(len(ids), r_bytes)
                if checked < validate:
                    check_batch(batch, ids)
                    checked += 1
                now = time.perf_counter()
                if not arrivals:
                    first_bytes = want
                arrivals.append(now)
                nbytes += want
                del batch
                if len(arrivals) % 8 == 0:
                    prog.update(nbytes / GiB)
                if now - t_start > cap_s:
                    break
                if submitted < cap_bytes:
                    submit(buf)
    finally:
        for _, _, futures in inflight:  # no read may land in freed memory
            for f in futures:
                try:
                    f.get()
                except Exception:  # noqa: BLE001
                    pass
        inflight.clear()
        for h in handles:
            h.close()
    prog.close()
    if direct:
        try:  # after a pass from a cold cache, what the reads left in the page cache (~0 when O_DIRECT)
            cached = [kv.mod.get_page_cache_info(str(s[0])) for s in shards]
            info["page_cache_after"] = sum(c for c, _ in cached) / max(1, sum(t for _, t in cached))
            info["io"] += f"; {info['page_cache_after']:.1%} of the files in page cache after"
        except Exception as e:  # noqa: BLE001
            info["page_cache_after"] = f"unknown: {_first_line(e)}"
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else float("nan")
    intervals = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    return {"bytes": nbytes, "seconds": span, "gbps": (nbytes - first_bytes) / span / 1e9 if span > 0 else None,
            "batches": len(arrivals), "time_ms": stats_ms(intervals),
            "compute_tflops": getattr(compute, "tflops", None), "shuffle": shuffle, "source": kv.source, **info}


def measure_kvikio(kv: Kvikio, *a, **k) -> dict:
    """run_kvikio, or {"skipped": why} where kvikio cannot run here (not importable; --smoke: no GPU, and
    kvikio needs the CUDA driver even for host memory), or {"error": ...} where it fails on the GPU."""
    if kv.mod is None:
        return {"skipped": kv.reason}
    try:
        return run_kvikio(kv, *a, **k)
    except Exception as e:  # noqa: BLE001 - a failed measurement becomes a row, the run goes on
        log(f"kvikio FAILED: {_first_line(e)}")
        if DEV != "cuda":
            return {"skipped": f"kvikio cannot read on this machine without a GPU: {_first_line(e)}"}
        return {"error": _first_line(e)}


# ---- the report ---------------------------------------------------------------------------------

def row(variant: str, source: str, m: dict, shape: str, baseline: dict | None, ceiling: tuple | None,
        threads=None) -> dict:
    ok = m.get("gbps") is not None and not m.get("error") and not m.get("skipped")
    status = "ok" if ok else "skipped" if m.get("skipped") else "failed"
    r = {"op": "loader", "family": "loader", "variant": variant, "backend": source, "dtype": "uint8",
         "shape": {}, "shape_label": shape, "threads": threads, "status": status,
         "reason": m.get("error") or m.get("skipped") or "", "time_ms": m.get("time_ms") or stats_ms([]),
         "tflops": None,
         "gbps": m.get("gbps"), "measurement": m}
    if ok and baseline and baseline.get("gbps"):
        r["baseline"] = {"name": baseline["name"], "gbps": baseline["gbps"]}
        r["vs_baseline"] = m["gbps"] / baseline["gbps"]
    if ok and ceiling and ceiling[1]:
        r["roofline_fraction"] = m["gbps"] / ceiling[1]
        r["roofline_bandwidth"] = {"name": ceiling[0], "value": ceiling[1], "unit": "GB/s"}
    return r


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"## Streaming loader: {m.get('gpu') or 'CPU only'} ({m['cpu']}, {m['cpu_threads']} threads, "
             f"{m['ram_bytes'] / GiB:.0f} GiB RAM)", "",
             f"Run {doc['created']}: `{doc['command']}`", "",
             f"Dataset: {doc['options']['dataset']}", "",
             "### Ceilings measured in the same run", "", "| ceiling | value | unit |", "|---|---:|---|"]
    for c in doc["ceilings"]:
        lines.append(f"| {c['name']} | {c['value']:.2f} | {c['unit']} |")
    lines += ["", "### Delivered into GPU memory", "",
              "| what | source | GB/s | batch interval ms median [p10-p90] | vs ceiling | vs DataLoader | vs kvikio "
              "| compute TFLOP/s beside it | io |",
              "|---|---|---:|---|---:|---:|---:|---:|---|"]
    for r in doc["results"]:
        meas = r["measurement"]
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['backend']} | {r['status']}: {r['reason']} | | | | | | |")
            continue
        t = r["time_ms"]
        roof = f"{r['roofline_fraction']:.2f}x {r['roofline_bandwidth']['name']}" if r.get("roofline_fraction") else "-"
        vs = f"{r['vs_baseline']:.2f}x" if r.get("vs_baseline") else "-"
        tf = f"{meas['compute_tflops']:.0f}" if meas.get("compute_tflops") else "-"
        vk = f"{r['vs_kvikio']:.2f}x" if r.get("vs_kvikio") else "-"
        io = meas.get("io", f"{meas.get('workers', '')} workers")
        ti = f"{t['median']:.2f} [{t['p10']:.2f}-{t['p90']:.2f}]" if t.get("median") is not None else "-"
        lines.append(f"| {r['variant']} | {r['backend']} | {r['gbps']:.2f} | {ti} | {roof} | {vs} | {vk} | {tf} "
                     f"| {io} |")
    lines += ["", "### Targets (issues 5 and 19)", ""] + [f"- {t}" for t in doc["targets"]]
    if doc.get("notes"):
        lines += ["", "### Notes", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


# ---- main --------------------------------------------------------------------------------------

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for loader.json and loader.md (default bench/results/<gpu>/)")
    p.add_argument("--data-dir", help="where to write the dataset (must take O_DIRECT)")
    p.add_argument("--gib", type=float, default=8.0, help="dataset size")
    p.add_argument("--record-bytes", type=int, default=3 * 224 * 224, help="a record (default: a 224x224 RGB image, not a multiple of 4 KiB)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (0: half the cores)")
    p.add_argument("--cap-s", type=float, default=12.0, help="longest single pass")
    p.add_argument("--kvikio-threads", type=int, default=0,
                   help="kvikio's thread pool (0: the CPU threads, at least 4, at most 16)")
    p.add_argument("--no-kvikio", action="store_true", help="skip the kvikio rows (reported as skipped)")
    p.add_argument("--keep-data", action="store_true")
    p.add_argument("--smoke", action="store_true", help="run everything on the CPU device, tiny (tests the script)")
    p.add_argument("--only", choices=("all", "disk"), default="all",
                   help="disk: the ceilings and the rows from disk only (DataLoader, kvikio, ours), no page-cache rows")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    global DEV
    if args.smoke:
        DEV = "cpu"
    elif not torch.cuda.is_available():
        print("loader_bench: needs a CUDA GPU (the loader's CPU path is tested by ctest/pytest)", file=sys.stderr)
        return 0
    from optimized_ops import data  # noqa: F401  (registers the classes)

    mach = machine()
    r_bytes = args.record_bytes
    records = int(args.gib * GiB) // r_bytes
    size = records * r_bytes
    data_root, dir_notes = pick_data_dir(args.data_dir, size)
    path = data_root / f"r{r_bytes}-n{records}"
    notes = [f"data directory {data_root} (skipped: {'; '.join(dir_notes)})" if dir_notes else f"data directory {data_root}"]
    workers = args.workers or max(2, (os.cpu_count() or 4) // 2)
    log(f"{mach['gpu']}, {mach['cpu_threads']} CPU threads; dataset {records} records x {r_bytes} B = "
        f"{size / GiB:.2f} GiB in {path}")
    per_shard = max(1, (1 << 30) // r_bytes)
    written = make_dataset(path, records, r_bytes, per_shard)
    if args.no_kvikio:
        kv = Kvikio(reason="--no-kvikio")
    else:
        kv = load_kvikio(args.kvikio_threads or max(4, min(16, os.cpu_count() or 4)))
    log(f"kvikio: {kv.source or 'skipped: ' + kv.reason}")
    shape = f"{size / GiB:.1f}GiB r{r_bytes} b{args.batch}"
    cap, cap_s = size, args.cap_s
    results, ceilings = [], []

    def safe(fn, *a, **k):
        try:
            return fn(*a, **k)
        except Exception as e:  # a failed measurement becomes a failed row, the run goes on
            log(f"FAILED: {type(e).__name__}: {e}")
            return {"error": f"{type(e).__name__}: {e}"}

    h2d, compute, disk_ceiling, dl_cold, dl_warm = {"gbps": None}, NoCompute(), 0.0, {}, {}
    def save(partial: bool = False) -> None:
        """loader.json and loader.md from what was measured so far (a later crash keeps them)."""
        def get(variant, source):
            return next((r for r in results if r["variant"] == variant and r["backend"] == source and r["status"] == "ok"), None)

        for r in results:  # our rows against kvikio's of the same source and order
            peer = get("kvikio, shuffled" if "shuffled" in r["variant"] else "kvikio, sequential", r["backend"])
            is_ours = r["variant"].startswith("loader") and "training step" not in r["variant"]
            if is_ours and r["status"] == "ok" and peer:
                r["kvikio"] = {"name": peer["variant"], "gbps": peer["gbps"]}
                r["vs_kvikio"] = r["gbps"] / peer["gbps"]
        targets = []
        runs = [r for r in (get("loader pipelined, sequential", "disk"),
                            get("loader pipelined, sequential (repeat)", "disk")) if r]
        if runs and disk_ceiling:
            f = sum(r["gbps"] for r in runs) / len(runs) / disk_ceiling
            each = " and ".join(f"{r['gbps']:.2f}" for r in runs)
            targets.append(f"disk: {each} GB/s with compute running (mean {f:.2f}x the disk's best O_DIRECT read in "
                           f"this run, {disk_ceiling:.2f} GB/s): {'met' if f >= 0.95 else 'missed'} (>= 0.95x, issue 19)")
        for order in ("sequential", "shuffled"):  # issue 19: the defaults, >= 0.9x pinned H2D
            c = get(f"loader pipelined, {order}", "page cache")
            if c and h2d["gbps"]:
                f = c["gbps"] / h2d["gbps"]
                targets.append(f"page cache, {order}, default settings (io={c['measurement'].get('io', '?')}): "
                               f"{c['gbps']:.2f} GB/s = {f:.2f}x pinned H2D ({h2d['gbps']:.2f} GB/s): "
                               f"{'met' if f >= 0.9 else 'missed'} (>= 0.9x, issue 19)")
        seq, shuf = get("loader pipelined, sequential", "page cache"), get("loader pipelined, shuffled", "page cache")
        if seq and shuf:
            cost = 1 - shuf["gbps"] / seq["gbps"]
            targets.append(f"page cache: shuffling costs {cost * 100:.0f}% against sequential "
                           f"({shuf['gbps']:.2f} vs {seq['gbps']:.2f} GB/s): {'met' if cost < 0.1 else 'missed'} "
                           f"(< 10%, issue 19)")
        for source, base in (("disk", dl_cold), ("page cache", dl_warm)):
            s = get("loader pipelined, sequential", source)
            if s and base.get("gbps"):
                f = s["gbps"] / base["gbps"]
                targets.append(f"{source}: {f:.2f}x DataLoader(pin_memory=True) ({base['gbps']:.2f} GB/s): "
                               f"{'met' if f > 1 else 'missed'} (faster)")
        for source in ("disk", "page cache"):
            for order in ("sequential", "shuffled"):
                ours = get(f"loader pipelined, {order}", source)
                if ours and ours.get("vs_kvikio"):
                    targets.append(f"{source}, {order}: {ours['vs_kvikio']:.2f}x kvikio ({ours['kvikio']['gbps']:.2f} "
                                   f"GB/s): {'met' if ours['vs_kvikio'] >= 1 else 'missed'} (>= 1.0x, issue 19)")
        all_notes = list(notes)
        for r in results:
            meas = r["measurement"]
            for n in meas.get("notes", []) or []:
                if n not in all_notes:
                    all_notes.append(n)
        if kv.mod is not None:
            all_notes.append(f"kvikio: {kv.source}; CuFile.pread into GPU tensors, {kv.threads} threads, "
                             f"{KVIKIO_TASK_BYTES >> 20} MiB tasks, {KVIKIO_DEPTH} batches in flight, gds_threshold 0 "
                             "(every read through its thread pool); sequential: one read per batch (per shard where "
                             "a batch spans two), shuffled: one read per record; O_DIRECT rows: auto_direct_io_read "
                             "with KVIKIO_AUTO_DIRECT_IO_READ_OVERREAD="
                             f"{os.environ.get('KVIKIO_AUTO_DIRECT_IO_READ_OVERREAD')}"
                             " (unaligned records read widened to whole pages); page cache rows: buffered. The mode "
                             "each row ran in is in its io column and measurement")
            all_notes += [n for n in kv.notes if n not in all_notes]
        all_notes.append("GB/s = record bytes delivered into GPU memory (the consumer synchronizes on each batch's arrival) "
                     "/ seconds from the first batch to the last; time_ms = intervals between batch arrivals")
        if compute_tf := next((c["value"] for c in ceilings if c["name"].startswith("compute")), None):
            all_notes.append(f"compute load: bf16 8192^3 matmuls on another stream, {compute_tf:.0f} TFLOP/s alone; the "
                         "'compute TFLOP/s beside it' column is what it kept while the loader ran")
        doc = {"schema": "optimized-ops-bench/1",
               "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "bench/loader_bench.py " + " ".join(argv),
               "machine": mach,
               "options": {"dataset": f"{records} records x {r_bytes} bytes = {size / GiB:.2f} GiB in "
                                      f"{len(shard_files(path))} shards; batch {args.batch}",
                           "records": records, "record_bytes": r_bytes, "batch": args.batch, "written": written},
               "ceilings": ceilings, "results": results, "targets": targets, "notes": all_notes,
               "partial": partial}
        out = pathlib.Path(args.out) if args.out else ROOT / "bench" / "results" / (mach["gpu_key"] or "cpu")
        if args.smoke and not args.out:
            raise SystemExit("--smoke needs --out (its numbers are not results)")
        out.mkdir(parents=True, exist_ok=True)
        (out / "loader.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        (out / "loader.md").write_text(markdown(doc))
        if not partial:
            print(markdown(doc))
        log(f"wrote {out / 'loader.json'} and loader.md" + (" (partial)" if partial else ""))

    # A timeout (SIGTERM) still leaves the report of what was measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        # ---- ceilings
        if DEV == "cuda":
            log("pinned host-to-device copy")
            h2d = pinned_h2d()
            ceilings.append({"name": "pinned_h2d", "unit": "GB/s", "value": h2d["gbps"], "time_ms": h2d["time_ms"],
                             "bytes": 256 << 20})
            compute = ComputeLoad()
            log("compute load alone")
            with compute:
                time.sleep(2.0)
            ceilings.append({"name": "compute_alone_bf16_matmul", "unit": "TFLOP/s", "value": compute.tflops,
                             "shape": "8192x8192x8192"})
        else:
            h2d, compute = {"gbps": None}, NoCompute()
        evict(path)

        def disk_sweep(when):
            """The disk's own O_DIRECT sequential read (the loader's engine and nothing else) at a few
            depths and request sizes; the best of the run is the ceiling."""
            # (32 x 4 MiB: what the loader picks by default on the H100 host's virtio disk since issue 19)
            for depth, chunk in ((1, 4 << 20), (8, 4 << 20), (32, 1 << 20), (32, 4 << 20)):
                label = f"disk_odirect_io_uring_{depth}x{chunk >> 20}MiB_{when}"
                log(f"disk O_DIRECT sequential read, {depth} x {chunk >> 20} MiB in flight ({when})")
                m = safe(read_ceiling, path, "io_uring", depth, chunk, min(cap, 2 * GiB), True)
                if m.get("gbps"):
                    ceilings.append({"name": label, "unit": "GB/s", "value": m["gbps"]})
            if when == "first":  # and as a plain program would read: one 4 MiB read at a time, from Python
                m = safe(read_files, path, 1, 4 << 20, True, min(cap, 2 * GiB), cap_s, "dd-like read")
                if m.get("gbps"):
                    ceilings.append({"name": "disk_odirect_python_1x4MiB", "unit": "GB/s", "value": m["gbps"]})

        def disk_best():
            return max([c["value"] for c in ceilings if c["name"].startswith("disk_odirect")] or [0.0])

        disk_sweep("first")
        disk_ceiling = disk_best()
        dc = ("disk O_DIRECT", disk_ceiling)
        hc = ("pinned H2D", h2d["gbps"])

        # ---- from disk (cold)
        def cold(fn, *a, **k):
            evict(path)
            return safe(fn, *a, **k)

        log("DataLoader(pin_memory=True), cold, compute running")
        dl_cold = cold(run_dataloader, path, "DataLoader cold + compute", args.batch, cap, cap_s, workers, per_shard,
                       compute)
        dl_base = {"name": "DataLoader(pin_memory=True)", "gbps": dl_cold.get("gbps")}
        results.append(row(f"torch DataLoader(pin_memory, {workers} workers)", "disk", dl_cold, shape, None, dc))
        log("loader, O_DIRECT sequential, compute running")
        seq = cold(run_loader, path, "loader seq + compute", args.batch, cap, cap_s, compute=compute, shuffle=False)
        results.append(row("loader pipelined, sequential", "disk", seq, shape, dl_base, dc))
        log("loader, O_DIRECT shuffled, compute running")
        shuf = cold(run_loader, path, "loader shuffled + compute", args.batch, cap, cap_s, compute=compute, shuffle=True)
        results.append(row("loader pipelined, shuffled", "disk", shuf, shape, dl_base, dc))
        log("loader, O_DIRECT sequential, no compute")
        alone = cold(run_loader, path, "loader seq alone", args.batch, min(cap, 4 * GiB), cap_s, shuffle=False)
        results.append(row("loader pipelined, sequential, no compute", "disk", alone, shape, dl_base, dc))
        log("loader, synchronous rung, compute running")
        sync = cold(run_loader, path, "loader synchronous + compute", args.batch, min(cap, 3 * GiB), cap_s,
                    compute=compute, variant="synchronous")
        results.append(row("loader synchronous (no prefetch)", "disk", sync, shape, dl_base, dc))
        for order in ("sequential", "shuffled"):
            if kv.mod is not None:
                log(f"kvikio, O_DIRECT {order}, compute running")
                evict(path)
            m = measure_kvikio(kv, path, f"kvikio {order} + compute", args.batch, cap, cap_s, compute,
                               shuffle=order == "shuffled", direct=True)
            results.append(row(f"kvikio, {order}", "disk", m, shape, dl_base, dc))
        if DEV == "cuda":
            # Overlap where it matters: the consumer itself runs a step per batch, as long as the
            # batch takes to read. Pipelined: max(read, step) per batch; synchronous: read + step.
            step = TrainStep(0.8 * args.batch * r_bytes / ((disk_ceiling or 1.5) * 1e9))
            notes.append(f"training step: {step.count} bf16 8192^3 matmuls per batch on the consumer's stream, "
                         f"{step.seconds * 1e3:.1f} ms (0.8x a batch's read time at the disk ceiling)")
            for variant in ("pipelined", "synchronous"):
                log(f"loader {variant} with a training step per batch")
                m = cold(run_loader, path, f"loader {variant} + step", args.batch, min(cap, 2 * GiB), cap_s,
                         step=step, variant=variant)
                results.append(row(f"loader {variant}, sequential, training step per batch", "disk", m, shape,
                                   dl_base, dc))
            del step
        if os.path.exists("/proc/driver/nvidia-fs") or os.environ.get("LOADER_BENCH_GDS"):
            log("loader, GPUDirect Storage, compute running")
            gds = cold(run_loader, path, "loader GDS + compute", args.batch, cap, cap_s, compute=compute, gds="on")
            results.append(row("loader pipelined, GPUDirect Storage", "disk", gds, shape, dl_base, dc))

        # Issue 19, item 3, A/B in the same run: the read settings before it (32 x 1 MiB) and the staging
        # not registered with io_uring (plain reads), against the defaults above.
        log("loader, O_DIRECT sequential, 32 x 1 MiB (the defaults before issue 19), compute running")
        old = cold(run_loader, path, "loader seq 32x1MiB + compute", args.batch, cap, cap_s, compute=compute,
                   shuffle=False, queue_depth=32, chunk_bytes=1 << 20)
        results.append(row("loader pipelined, sequential, 32 x 1 MiB reads (before issue 19)", "disk", old, shape,
                           dl_base, dc))
        log("loader, O_DIRECT shuffled, 32 x 1 MiB, compute running")
        old = cold(run_loader, path, "loader shuffled 32x1MiB + compute", args.batch, cap, cap_s, compute=compute,
                   shuffle=True, queue_depth=32, chunk_bytes=1 << 20)
        results.append(row("loader pipelined, shuffled, 32 x 1 MiB reads (before issue 19)", "disk", old, shape,
                           dl_base, dc))
        log("loader, O_DIRECT sequential, fixed buffers off, compute running")
        os.environ["OPTIMIZED_LOADER_FIXED_BUFFERS"] = "off"
        try:
            nofix = cold(run_loader, path, "loader seq no fixed buffers + compute", args.batch, cap, cap_s,
                         compute=compute, shuffle=False)
        finally:
            del os.environ["OPTIMIZED_LOADER_FIXED_BUFFERS"]
        results.append(row("loader pipelined, sequential, io_uring fixed buffers off", "disk", nofix, shape, dl_base,
                           dc))
        log("loader, O_DIRECT sequential, compute running (repeat, at the end of the disk runs)")
        rep = cold(run_loader, path, "loader seq + compute (repeat)", args.batch, cap, cap_s, compute=compute,
                   shuffle=False)
        results.append(row("loader pipelined, sequential (repeat)", "disk", rep, shape, dl_base, dc))
        disk_sweep("last")
        disk_ceiling = disk_best()
        dc = ("disk O_DIRECT", disk_ceiling)
        for r in results:  # against the best disk read seen in the whole run
            if r["backend"] == "disk" and r["status"] == "ok":
                r["roofline_fraction"] = r["gbps"] / disk_ceiling
                r["roofline_bandwidth"] = {"name": dc[0], "value": disk_ceiling, "unit": "GB/s"}
        save(partial=True)
        if args.only == "disk":
            raise _SkipCache

        # ---- from the page cache
        log("page cache: loading the files")
        warm = safe(read_files, path, 8, 4 << 20, False, size, 120.0, "buffered read (fills the cache)")
        notes.append(f"buffered cold read with 8 x 4 MiB in flight (fills the page cache): {warm.get('gbps', 0):.2f} GB/s")
        for threads in (8, 16):
            log(f"page cache pread ceiling, {threads} threads")
            m = safe(read_ceiling, path, "pread", threads, 4 << 20, 0, False)
            if m.get("gbps"):
                ceilings.append({"name": f"page_cache_pread_{threads}_threads", "unit": "GB/s", "value": m["gbps"]})
        log("DataLoader(pin_memory=True), page cache, compute running")
        dl_warm = safe(run_dataloader, path, "DataLoader cached + compute", args.batch, cap, cap_s, workers,
                       per_shard, compute)
        dl_wbase = {"name": "DataLoader(pin_memory=True)", "gbps": dl_warm.get("gbps")}
        results.append(row(f"torch DataLoader(pin_memory, {workers} workers)", "page cache", dl_warm, shape, None, hc))
        cache_cap = 4 * size  # several epochs: one takes a fraction of a second
        for order in ("sequential", "shuffled"):
            if kv.mod is not None:
                log(f"kvikio, page cache {order}, compute running")
            m = measure_kvikio(kv, path, f"kvikio {order} (cache)", args.batch, cache_cap, min(cap_s, 5.0), compute,
                               shuffle=order == "shuffled", direct=False)
            results.append(row(f"kvikio, {order}", "page cache", m, shape, dl_wbase, hc))
        save(partial=True)
        # the defaults (io=auto, threads=0: what the loader picks, said in its notes), then the pread pool
        # forced (the engine the defaults took before issue 19, at 8 and 12 threads), and mmap without checksums
        for label, kw in [("loader pipelined, sequential", {}),
                          ("loader pipelined, shuffled", {"shuffle": True}),
                          ("loader pipelined, sequential, io=pread, 8 threads", {"io": "pread", "threads": 8}),
                          ("loader pipelined, sequential, io=pread, 12 threads", {"io": "pread", "threads": 12}),
                          ("loader pipelined, shuffled, io=pread, 12 threads",
                           {"io": "pread", "threads": 12, "shuffle": True}),
                          ("loader pipelined, sequential, io=mmap, verify off", {"io": "mmap", "verify": False})]:
            log(f"{label}, page cache, compute running")
            m = safe(run_cached_epochs, path, label, args.batch, cache_cap, min(cap_s, 5.0), compute, kw)
            results.append(row(label, "page cache", m, shape, dl_wbase, hc, kw.get("threads")))
            save(partial=True)
    except _SkipCache:
        pass
    finally:
        save()
        if not args.keep_data:
            shutil.rmtree(path, ignore_errors=True)
    return 0


class _SkipCache(Exception):
    """--only disk: the page-cache rows are not run."""


def run_cached_epochs(path, label, batch, cap_bytes, cap_s, compute, kw) -> dict:
    """Page-cache passes: several epochs in one loader (direct_io off), until cap_bytes or cap_s."""
    from optimized_ops import data
    t0 = time.perf_counter()
    loader = data.StreamingLoader(str(path), batch_size=batch, device=DEV, direct_io="off",
                                  return_indices=True, **kw)
    info = {"io": loader.io_backend, "direct_io": loader.direct_io, "notes": loader.notes,
            "setup_s": time.perf_counter() - t0}
    prog = Progress(label + " (cache)", cap_bytes / GiB)
    arrivals, nbytes, first_bytes, checked = [], 0, 0, 0
    stream = torch.cuda.current_stream() if DEV == "cuda" else None
    with compute:
        t_start = time.perf_counter()
        done = False
        while not done:
            for b, ids in loader:
                if checked < 3:
                    check_batch(b, ids)
                    checked += 1
                if stream is not None:
                    stream.synchronize()
                now = time.perf_counter()
                if not arrivals:
                    first_bytes = b.numel()
                arrivals.append(now)
                nbytes += b.numel()
                del b
                if len(arrivals) % 16 == 0:
                    prog.update(nbytes / GiB)
                if nbytes >= cap_bytes or now - t_start > cap_s:
                    done = True
                    break
    prog.close()
    loader.close()
    span = arrivals[-1] - arrivals[0]
    intervals = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    return {"bytes": nbytes, "seconds": span, "gbps": (nbytes - first_bytes) / span / 1e9, "batches": len(arrivals),
            "time_ms": stats_ms(intervals), "compute_tflops": getattr(compute, "tflops", None), **info}


FAMILY = runner.register(runner.Family(
    "loader", standalone=main,
    summary="the streaming loader vs DataLoader and the disk, standalone (bench/loader_bench.py)"))

if __name__ == "__main__":
    sys.exit(main())
