"""optimized_ops.data against what a demanding user does to it (CPU, so CI runs it; the CUDA cases
skip without a GPU): the loader in a forked child and in DataLoader workers (it continues, never
hangs: every wait has a deadline), a shard truncated under io="mmap" (an error, never SIGBUS: run in
a subprocess, so that a crash fails the test instead of pytest), staging sized by the dataset,
integer arguments that are not integers, an exception inside ``with ShardWriter``, more shards than
RLIMIT_NOFILE allows (a subprocess with a lowered limit), and resuming against a rewritten dataset."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from optimized_ops import data

from conftest import requires_cuda


def records(n: int, shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


@pytest.fixture
def tmp(tmp_path):
    return str(tmp_path)


def epoch_ids(loader) -> list[list[int]]:
    """One epoch as the list of each batch's dataset indices (the loader has return_indices)."""
    return [ids.tolist() for _, ids in loader]


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (PYTHONPATH as ours): a crash there is a failed test here."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


# ---- 1. fork -----------------------------------------------------------------------------------

def _child_reads(loader, queue):
    try:
        queue.put(("ok", epoch_ids(loader), epoch_ids(loader)))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        queue.put(("error", f"{type(e).__name__}: {e}", None))


def test_forked_child_continues_where_the_parent_was(tmp):
    src = records(47, (33,))
    data.write_shards(tmp + "/ds", src, records_per_shard=8)
    kwargs = dict(batch_size=5, device="cpu", shuffle=True, seed=2, prefetch=3, return_indices=True)
    expected = data.StreamingLoader(tmp + "/ds", **kwargs)
    epoch0, epoch1 = epoch_ids(expected), epoch_ids(expected)

    loader = data.StreamingLoader(tmp + "/ds", **kwargs)
    it = iter(loader)
    first = [next(it)[1].tolist() for _ in range(3)]  # more batches are in flight at the fork
    assert first == epoch0[:3]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_reads, args=(loader, queue))
    child.start()
    try:
        status, got0, got1 = queue.get(timeout=60)
    except Exception:  # noqa: BLE001
        status, got0, got1 = "hung", None, None
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join()
    assert status == "ok", f"the forked child: {status} {got0 or ''}"
    assert child.exitcode == 0
    assert got0 == epoch0[3:] and got1 == epoch1, "the child reads what the parent would have read next"
    # The parent's loader goes on as if nothing happened.
    assert epoch_ids(loader) == epoch0[3:]
    assert epoch_ids(loader) == epoch1


@pytest.mark.parametrize("workers,persistent", [(1, False), (2, False), (2, True)])
def test_dataloader_workers_yield_every_batch_once_in_order(tmp, workers, persistent):
    src = records(61, (17,))
    data.write_shards(tmp + "/ds", src, records_per_shard=10)
    kwargs = dict(batch_size=4, device="cpu", shuffle=True, seed=9, return_indices=True)
    expected = data.StreamingLoader(tmp + "/ds", **kwargs)
    epochs = [epoch_ids(expected), epoch_ids(expected)]

    loader = data.StreamingLoader(tmp + "/ds", **kwargs)
    dl = torch.utils.data.DataLoader(loader, batch_size=None, num_workers=workers, timeout=60,
                                     multiprocessing_context="fork", persistent_workers=persistent)
    for e in range(2 if persistent else 1):
        got = []
        for batch, ids in dl:
            assert torch.equal(batch, torch.from_numpy(src)[ids])
            got.append(ids.tolist())
        assert got == epochs[e], f"epoch {e}: each batch once, in the loader's order"


def test_spawn_explains_itself(tmp):
    data.write_shards(tmp + "/ds", records(10, (3,)))
    loader = data.StreamingLoader(tmp + "/ds", batch_size=2, device="cpu")
    import pickle
    with pytest.raises(TypeError, match="create the loader in the process that uses it"):
        pickle.dumps(loader)


@requires_cuda
def test_cuda_loader_in_a_forked_child_raises_a_clear_error(tmp):
    data.write_shards(tmp + "/ds", records(20, (64,)))
    loader = data.StreamingLoader(tmp + "/ds", batch_size=4, device="cuda")
    next(iter(loader))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_reads, args=(loader, queue))
    child.start()
    status, message, _ = queue.get(timeout=60)
    child.join(timeout=30)
    assert status == "error"
    assert "RuntimeError" in message and "fork" in message and "spawn" in message, message
    assert len(list(loader)) == 4  # the parent goes on


# ---- 2. a shard truncated under io="mmap" --------------------------------------------------------

@pytest.mark.parametrize("io", ["mmap", "pread", "auto"])
def test_truncated_shard_is_an_error_not_a_crash(tmp, io):
    data.write_shards(tmp + "/ds", records(40, (1000,)), records_per_shard=10)
    result = run_python(f"""
        import os, sys
        from optimized_ops import data
        loader = data.StreamingLoader({tmp + '/ds'!r}, batch_size=5, device="cpu", io={io!r}, prefetch=2)
        it = iter(loader)
        next(it)
        os.truncate({tmp + '/ds/shard-00003.osh'!r}, 4096 + 2500)   # overwritten in place, shorter
        try:
            for _ in it:
                pass
        except ValueError as e:
            print("ValueError:", e)
            sys.exit(0)
        sys.exit(3)
    """)
    assert result.returncode == 0, (f"exit {result.returncode} (negative: killed by signal {-result.returncode})\n"
                                    f"{result.stdout}{result.stderr}")
    assert "shard-00003.osh: record 2 (dataset record 32" in result.stdout and "truncated" in result.stdout


# ---- 3. staging ----------------------------------------------------------------------------------

def test_staging_is_sized_by_the_dataset_not_batch_size(tmp):
    src = records(20, (8192,))
    data.write_shards(tmp + "/ds", src)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=10**7, device="cpu", return_indices=True)
    (batch, ids), = list(loader)
    assert torch.equal(batch, torch.from_numpy(src)[ids]) and len(ids) == 20
    assert loader.staging_bytes <= 4 * (20 * 8192 + 8192)

    data.write_shards(tmp + "/small", records(1000, (8,)), overwrite=True)
    loader = data.StreamingLoader(tmp + "/small", batch_size=65536, device="cpu", shuffle=True)
    assert loader.staging_bytes <= 4 * 8192, "8-byte records: the dataset's two pages, not 2 GiB"
    assert sum(len(b) for b in loader) == 1000


def test_staging_budget_errors_name_batch_size(tmp):
    data.write_shards(tmp + "/ds", records(64, (65536,)), records_per_shard=16)
    with pytest.raises(ValueError, match=r"batch_size: a batch of 16 records of 65536 bytes.*1048576 bytes.*"
                                         r"staging_bytes = 102400"):
        data.StreamingLoader(tmp + "/ds", batch_size=16, device="cpu", direct_io="off", staging_bytes=100 * 1024)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=16, device="cpu", direct_io="off",
                                  staging_bytes=5 * 2**20 // 2)
    assert loader.prefetch == 2 and any("prefetching 2 batches" in n for n in loader.notes)
    assert len(list(loader)) == 4


# ---- 4. integer arguments -----------------------------------------------------------------------

_INT_ARGS = ["batch_size", "seed", "rank", "world_size", "epochs", "prefetch", "threads", "chunk_bytes",
             "queue_depth", "staging_bytes"]


@pytest.mark.parametrize("name", _INT_ARGS)
@pytest.mark.parametrize("value", [2.5, 2.0, True, "2"])
def test_integer_arguments_refuse_what_is_not_an_int(tmp, name, value):
    data.write_shards(tmp + "/ds", records(10, (3,)))
    kwargs = dict(batch_size=2, device="cpu")
    kwargs[name] = value
    with pytest.raises(TypeError, match=rf"{name}: expected an int"):
        data.StreamingLoader(tmp + "/ds", **kwargs)


def test_integer_arguments_take_integers_of_any_kind(tmp):
    data.write_shards(tmp + "/ds", records(10, (3,)))
    loader = data.StreamingLoader(tmp + "/ds", batch_size=np.int64(3), seed=np.uint32(1), device="cpu",
                                  epochs=np.int16(1))
    assert loader.batch_size == 3 and type(loader.batch_size) is int
    assert [len(b) for b in loader] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="epochs: expected >= 0"):
        data.StreamingLoader(tmp + "/ds", batch_size=2, device="cpu", epochs=-1)


@pytest.mark.parametrize("call", [
    lambda p: data.write_shards(p, np.zeros((4, 2), np.uint8), records_per_shard=2.5),
    lambda p: data.write_shards(p, np.zeros((4, 2), np.uint8), shard_bytes=1e6),
    lambda p: data.ShardWriter(p, torch.uint8, (2,), records_per_shard=True),
    lambda p: data.ShardWriter(p, torch.uint8, (2.5,), records_per_shard=2),
])
def test_writer_integer_arguments(tmp, call):
    with pytest.raises(TypeError, match=r"(records_per_shard|shard_bytes|record_shape\[0\]): expected an int"):
        call(tmp + "/w")


def test_load_state_dict_positions_are_ints(tmp):
    data.write_shards(tmp + "/ds", records(10, (3,)))
    loader = data.StreamingLoader(tmp + "/ds", batch_size=2, device="cpu")
    state = loader.state_dict()
    with pytest.raises(TypeError, match=r"state\['batch'\]: expected an int"):
        loader.load_state_dict({**state, "batch": 1.5})


# ---- 5. an exception inside `with ShardWriter` ----------------------------------------------------

def test_exception_in_the_writer_leaves_the_dataset_incomplete(tmp):
    path = tmp + "/ds"
    with pytest.raises(RuntimeError, match="source failed"):
        with data.ShardWriter(path, torch.int32, (4,), records_per_shard=3) as w:
            w.append(np.arange(28, dtype=np.int32).reshape(7, 4))
            raise RuntimeError("the source failed")
    with pytest.raises(ValueError, match=r"incomplete dataset.*aborted after 7 records.*RuntimeError.*source failed"):
        data.dataset_info(path)
    with pytest.raises(ValueError, match="incomplete"):
        data.StreamingLoader(path, batch_size=2, device="cpu")
    with pytest.raises(ValueError, match="incomplete"):
        data.verify_shards(path)
    # Written again: whole.
    data.write_shards(path, np.zeros((5, 4), np.int32), overwrite=True)
    assert data.dataset_info(path).num_records == 5
    assert not os.path.exists(path + "/shards.incomplete")


def test_writer_dropped_or_aborted_without_close_is_incomplete(tmp):
    w = data.ShardWriter(tmp + "/a", torch.uint8, (2,), records_per_shard=2)
    w.append(np.ones((3, 2), np.uint8))
    with pytest.raises(ValueError, match="being written"):
        data.dataset_info(tmp + "/a")
    del w
    with pytest.raises(ValueError, match="deleted without close"):
        data.dataset_info(tmp + "/a")
    w = data.ShardWriter(tmp + "/b", torch.uint8, (2,), records_per_shard=2)
    w.append(np.ones((3, 2), np.uint8))
    w.abort("changed my mind")
    with pytest.raises(ValueError, match="aborted after 3 records: changed my mind"):
        data.dataset_info(tmp + "/b")
    with data.ShardWriter(tmp + "/d", torch.uint8, (2,), records_per_shard=2) as w:
        w.append(np.ones((3, 2), np.uint8))
    assert data.dataset_info(tmp + "/d").num_records == 3


# ---- 6. more shards than descriptors ------------------------------------------------------------

@pytest.mark.parametrize("io", ["auto", "pread", "mmap"])
def test_more_shards_than_the_open_file_limit(tmp, io):
    src = records(400, (50,))
    data.write_shards(tmp + "/ds", src, records_per_shard=2)  # 200 shards
    np.save(tmp + "/src.npy", src)
    result = run_python(f"""
        import resource, sys
        import numpy as np, torch
        from optimized_ops import data
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))   # fewer than the 200 shards
        src = torch.from_numpy(np.load({tmp + '/src.npy'!r}))
        for shuffle in (False, True):
            loader = data.StreamingLoader({tmp + '/ds'!r}, batch_size=7, device="cpu", io={io!r}, shuffle=shuffle,
                                          return_indices=True)
            seen = []
            for batch, ids in loader:
                assert torch.equal(batch, src[ids])
                seen += ids.tolist()
            assert sorted(seen) == list(range(400)), len(seen)
        print("ok")
    """)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


# ---- 7. resuming against another dataset ------------------------------------------------------------

def test_resume_refuses_a_rewritten_dataset(tmp):
    a, b = records(45, (11,), seed=1), records(45, (11,), seed=2)
    data.write_shards(tmp + "/ds", a, records_per_shard=8)
    kwargs = dict(batch_size=4, device="cpu", shuffle=True, seed=7)
    loader = data.StreamingLoader(tmp + "/ds", **kwargs)
    for _, _ in zip(range(3), loader):
        pass
    state = loader.state_dict()
    assert len(state["fingerprint"]) == 16
    loader.close()

    # A copy of the same files, or the same records written again: resumes.
    shutil.copytree(tmp + "/ds", tmp + "/copy")
    data.StreamingLoader(tmp + "/copy", **kwargs).load_state_dict(state)
    data.write_shards(tmp + "/ds", a, records_per_shard=8, overwrite=True)
    data.StreamingLoader(tmp + "/ds", **kwargs).load_state_dict(state)
    # The same record count, other records: refused, naming the fingerprints.
    data.write_shards(tmp + "/ds", b, records_per_shard=8, overwrite=True)
    other = data.StreamingLoader(tmp + "/ds", **kwargs)
    assert other.fingerprint != state["fingerprint"]
    with pytest.raises(ValueError, match=rf"fingerprint {state['fingerprint']}.*{other.fingerprint}.*records differ"):
        other.load_state_dict(state)
    # A state from before fingerprints: accepted, with a warning.
    old = {k: v for k, v in state.items() if k != "fingerprint"}
    with pytest.warns(UserWarning, match="no dataset fingerprint"):
        other.load_state_dict(old)
