"""optimized_ops.data: shards written from numpy and torch, and StreamingLoader end to end on the
CPU (always) and CUDA (where present): every record exactly once per epoch in the expected order or
permutation, byte-exact; odd record sizes; one shard and many; rank sharding; epochs; resume;
broken datasets named in the error; closing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from optimized_ops import data

from conftest import DEVICES, requires_cuda


def records(n: int, shape, dtype=np.uint8, seed: int = 0) -> np.ndarray:
    """Distinct records: never all zeros, each different from the others."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal((n, *shape)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -1000), min(info.max, 1000) + 1, size=(n, *shape), dtype=dtype)


def epoch(loader) -> tuple[torch.Tensor, torch.Tensor]:
    """One epoch: the batches concatenated (on the CPU) and the dataset indices in order."""
    batches, ids = [], []
    for batch, idx in loader:
        batches.append(batch.cpu())
        ids.append(idx)
    if not batches:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    return torch.cat(batches), torch.cat(ids)


@pytest.fixture
def tmp(tmp_path):
    return str(tmp_path)


# ---- the format ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.int32, np.int64, np.float16, np.float32,
                                   np.float64])
def test_write_shards_from_numpy(tmp, dtype):
    src = records(37, (3, 5), dtype)
    info = data.write_shards(tmp + "/ds", src, records_per_shard=10)
    assert info == data.dataset_info(tmp + "/ds")
    assert (info.num_records, info.record_shape, info.num_shards) == (37, (3, 5), 4)
    assert info.dtype == np.dtype(dtype).name
    assert info.record_bytes == 15 * np.dtype(dtype).itemsize
    data.verify_shards(tmp + "/ds")


def test_write_shards_from_torch_bfloat16_and_writer(tmp):
    src = torch.randn(20, 6).to(torch.bfloat16)
    info = data.write_shards(tmp + "/ds", src)
    assert (info.torch_dtype, info.num_shards) == (torch.bfloat16, 1)
    with data.ShardWriter(tmp + "/w", torch.int32, (4,), records_per_shard=3) as w:
        w.append(np.arange(20, dtype=np.int32).reshape(5, 4))
        w.append(torch.arange(20, 28, dtype=torch.int32).reshape(2, 4))
    assert data.dataset_info(tmp + "/w").num_records == 7
    with pytest.raises(ValueError, match="already holds"):
        data.write_shards(tmp + "/w", np.zeros((2, 4), np.int32))
    data.write_shards(tmp + "/w", np.ones((2, 4), np.int32), overwrite=True)
    assert data.dataset_info(tmp + "/w").num_records == 2
    with pytest.raises(TypeError, match="dtype"):
        w = data.ShardWriter(tmp + "/x", torch.int32, (4,), 3)
        w.append(np.zeros((1, 4), np.float32))


# ---- the loader, every device ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,dtype,per_shard", [((7,), np.uint8, 1000), ((3, 7), np.uint8, 9),
                                                   ((1001,), np.int8, 5), ((1024,), np.int32, 1),
                                                   ((3, 224, 224), np.uint8, 7)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_record_once_byte_exact(tmp, device, shape, dtype, per_shard, shuffle):
    n = 40 if len(shape) < 3 else 12
    src = records(n, shape, dtype, seed=len(shape) + per_shard)
    data.write_shards(tmp + "/ds", src, records_per_shard=per_shard)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=6, device=device, shuffle=shuffle, seed=3,
                                  return_indices=True)
    assert len(loader) == (n + 5) // 6
    seen = []
    for e in range(2):
        got, ids = epoch(loader)
        assert got.dtype == torch.from_numpy(src).dtype and tuple(got.shape) == (n, *shape)
        assert sorted(ids.tolist()) == list(range(n)), "a record is missing or repeated"
        if not shuffle:
            assert ids.tolist() == list(range(n))
        assert torch.equal(got, torch.from_numpy(src)[ids])
        seen.append(ids.tolist())
    if shuffle:
        assert seen[0] != seen[1], "each epoch has its own permutation"
    loader.close()


@pytest.mark.parametrize("device", DEVICES)
def test_batches_are_on_the_device(tmp, device):
    data.write_shards(tmp + "/ds", records(10, (5,)))
    with data.StreamingLoader(tmp + "/ds", batch_size=4, device=device) as loader:
        batch = next(iter(loader))
        assert batch.device.type == device
        assert tuple(batch.shape) == (4, 5)


def test_rank_sharding_covers_without_overlap(tmp):
    n = 103
    src = records(n, (9,))
    data.write_shards(tmp + "/ds", src, records_per_shard=20)
    for shuffle in (False, True):
        all_ids = []
        for rank in range(4):
            loader = data.StreamingLoader(tmp + "/ds", batch_size=5, device="cpu", shuffle=shuffle, seed=1,
                                          rank=rank, world_size=4, return_indices=True)
            got, ids = epoch(loader)
            assert torch.equal(got, torch.from_numpy(src)[ids])
            assert len(ids) in (n // 4, n // 4 + 1)
            all_ids += ids.tolist()
        assert sorted(all_ids) == list(range(n))


def test_drop_last_same_batches_on_every_rank(tmp):
    data.write_shards(tmp + "/ds", records(50, (3,)))
    counts = set()
    for rank in range(3):
        loader = data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", rank=rank, world_size=3,
                                      drop_last=True)
        sizes = [len(b) for b in loader]
        assert sizes == [4] * len(sizes)
        counts.add(len(sizes))
    assert counts == {50 // 3 // 4}


def test_epochs_limit_and_continue_after_break(tmp):
    src = records(30, (4,))
    data.write_shards(tmp + "/ds", src)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", shuffle=True, epochs=2,
                                  return_indices=True)
    first = []
    for i, (_, ids) in enumerate(loader):
        first += ids.tolist()
        if i == 2:
            break  # iterating again continues with batch 3
    for _, ids in loader:
        first += ids.tolist()
    assert sorted(first) == list(range(30))
    assert loader.epoch == 1
    _, ids = epoch(loader)
    assert sorted(ids.tolist()) == list(range(30))
    assert list(loader) == []  # epochs=2: done


def test_resume_from_state_dict(tmp):
    src = records(45, (11,))
    data.write_shards(tmp + "/ds", src, records_per_shard=8)
    kwargs = dict(batch_size=4, device="cpu", shuffle=True, seed=7, return_indices=True)
    full = data.StreamingLoader(tmp + "/ds", **kwargs)
    expect = []
    for _ in range(2):
        expect += [ids.tolist() for _, ids in full]

    a = data.StreamingLoader(tmp + "/ds", **kwargs)
    got = []
    it = iter(a)
    for _ in range(5):
        got.append(next(it)[1].tolist())
    state = a.state_dict()
    a.close()
    b = data.StreamingLoader(tmp + "/ds", **kwargs)
    b.load_state_dict(state)
    for _ in range(2 - state["epoch"]):
        got += [ids.tolist() for _, ids in b]
    assert got == expect

    c = data.StreamingLoader(tmp + "/ds", **{**kwargs, "seed": 8})
    with pytest.raises(ValueError, match="seed"):
        c.load_state_dict(state)


def test_synchronous_variant_same_batches(tmp):
    src = records(20, (100,))
    data.write_shards(tmp + "/ds", src, records_per_shard=6)
    a = [b for b in data.StreamingLoader(tmp + "/ds", batch_size=3, device="cpu", shuffle=True)]
    b = [b for b in data.StreamingLoader(tmp + "/ds", batch_size=3, device="cpu", shuffle=True,
                                         variant="synchronous")]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def test_io_backends_and_page_cache(tmp):
    src = records(25, (5000,))
    data.write_shards(tmp + "/ds", src, records_per_shard=7)
    for io in ("pread", "io_uring", "mmap"):
        for direct in ("auto", "off"):
            loader = data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", shuffle=True, io=io,
                                          direct_io=direct, return_indices=True)
            assert loader.io_backend in ("pread", "io_uring", "mmap")
            if io in ("pread", "mmap"):
                assert loader.io_backend == io
            got, ids = epoch(loader)
            assert torch.equal(got, torch.from_numpy(src)[ids])
            assert "direct_io" in repr(loader)


# ---- errors ---------------------------------------------------------------------------------

def test_missing_dataset_names_the_path(tmp):
    with pytest.raises(ValueError, match="does not exist"):
        data.StreamingLoader(tmp + "/nope", batch_size=2, device="cpu")
    os.makedirs(tmp + "/empty")
    with pytest.raises(ValueError, match="no shard files"):
        data.dataset_info(tmp + "/empty")


def test_corrupted_record_names_file_and_record(tmp):
    src = records(20, (1000,))
    data.write_shards(tmp + "/ds", src, records_per_shard=8)
    shard = tmp + "/ds/shard-00001.osh"
    with open(shard, "r+b") as f:  # shard 1, record 2 = dataset record 10
        f.seek(4096 + 2 * 1000 + 17)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    loader = data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", return_indices=True)
    seen = []
    with pytest.raises(ValueError, match=r"shard-00001\.osh: record 2 \(dataset record 10.*checksum mismatch"):
        for _, ids in loader:
            seen += ids.tolist()
    assert seen == list(range(8)), "batches before the broken one, and none after it"
    with pytest.raises(ValueError, match="checksum mismatch"):
        loader.next()  # it keeps failing: nothing is skipped
    with pytest.raises(ValueError, match=r"shard-00001\.osh: record 2"):
        data.verify_shards(tmp + "/ds")


def test_truncated_and_missing_shards(tmp):
    data.write_shards(tmp + "/ds", records(20, (1000,)), records_per_shard=8)
    shard = tmp + "/ds/shard-00001.osh"
    os.truncate(shard, 4096 + 3500)
    with pytest.raises(ValueError, match=r"shard-00001\.osh: truncated.*record 3 \(dataset record 11\)"):
        data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu")
    os.remove(shard)
    with pytest.raises(ValueError, match=r"shard-00001\.osh: missing"):
        data.dataset_info(tmp + "/ds")
    with open(tmp + "/ds/shard-00000.osh", "r+b") as f:
        f.write(b"NOTSHARD")
    with pytest.raises(ValueError, match="bad magic"):
        data.dataset_info(tmp + "/ds")


def test_bad_arguments(tmp):
    data.write_shards(tmp + "/ds", records(10, (3,)))
    with pytest.raises(ValueError, match="batch_size"):
        data.StreamingLoader(tmp + "/ds", batch_size=0, device="cpu")
    with pytest.raises(ValueError, match="rank"):
        data.StreamingLoader(tmp + "/ds", batch_size=2, device="cpu", rank=3, world_size=2)
    with pytest.raises(ValueError, match="io"):
        data.StreamingLoader(tmp + "/ds", batch_size=2, device="cpu", io="aio")


def test_close_releases_and_tensors_stay_valid(tmp):
    src = records(40, (64,))
    data.write_shards(tmp + "/ds", src)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=8, device="cpu", prefetch=4, return_indices=True)
    kept = [next(iter(loader))]
    loader.close()
    batch, ids = kept[0]
    assert torch.equal(batch, torch.from_numpy(src)[ids])
    with pytest.raises(RuntimeError, match="closed"):
        loader.next()


# ---- the disk (O_DIRECT) path: fixed buffers, coalescing, automatic read sizes (issue 19) ------

def _direct_io_works(d: str) -> bool:
    f = os.path.join(d, ".probe")
    with open(f, "wb") as fh:
        fh.write(b"x" * 4096)
    try:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        import mmap
        buf = mmap.mmap(-1, 4096)
        return os.preadv(fd, [buf], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(f)


@pytest.mark.parametrize("shape,shuffle", [((13,), True), ((4097,), False), ((4097,), True), ((3, 7, 11), True)])
def test_fixed_buffers_on_off_refused_same_bytes_and_order(tmp, monkeypatch, shape, shuffle):
    if not _direct_io_works(tmp):
        pytest.skip("O_DIRECT unavailable here")
    src = records(61, shape, seed=3)
    data.write_shards(tmp + "/ds", src, records_per_shard=9)
    got = {}
    for mode in ("on", "off", "fail"):
        monkeypatch.setenv("OPTIMIZED_LOADER_FIXED_BUFFERS", mode)
        loader = data.StreamingLoader(tmp + "/ds", batch_size=5, device="cpu", shuffle=shuffle, seed=4, io="io_uring",
                                      direct_io="on", chunk_bytes=8192, epochs=2, return_indices=True)
        if loader.io_backend != "io_uring":
            pytest.skip(f"io_uring unavailable: {loader.notes}")
        said = "\n".join(loader.notes)
        assert "loader reads: io_uring with O_DIRECT" in said and "up to 8 KiB" in said, said
        if mode == "off":
            assert "staging not registered (OPTIMIZED_LOADER_FIXED_BUFFERS=off)" in said, said
        elif mode == "fail":
            assert "fixed buffers unavailable (io_uring_register_buffers failed: forced by" in said, said
        else:
            assert ("staging registered as io_uring fixed buffers" in said
                    or "io_uring_register_buffers failed" in said), said
        b0, i0 = epoch(loader)
        b1, i1 = epoch(loader)
        loader.close()
        batches, ids = torch.cat([b0, b1]), torch.cat([i0, i1])
        assert torch.equal(batches.reshape(len(ids), -1), torch.from_numpy(src).reshape(len(src), -1)[ids])
        got[mode] = ids
    assert torch.equal(got["on"], got["off"]) and torch.equal(got["on"], got["fail"])
    assert sorted(got["on"][:61].tolist()) == list(range(61))


def test_automatic_queue_depth_and_read_size(tmp):
    if not _direct_io_works(tmp):
        pytest.skip("O_DIRECT unavailable here")
    src = records(30, (5000,))
    data.write_shards(tmp + "/ds", src, records_per_shard=10)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", io="io_uring", direct_io="on")
    if loader.io_backend != "io_uring":
        pytest.skip(f"io_uring unavailable: {loader.notes}")
    said = "\n".join(loader.notes)
    assert "reads in flight of up to" in said and "(automatic: " in said, said
    loader.close()
    explicit = data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", io="io_uring", direct_io="on",
                                    queue_depth=3, chunk_bytes=4096)
    said = "\n".join(explicit.notes)
    assert "3 reads in flight of up to 4 KiB" in said and "(automatic: " not in said, said
    explicit.close()
    with pytest.raises(ValueError, match="queue_depth"):
        data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", queue_depth=-1)
    with pytest.raises(ValueError, match="chunk_bytes"):
        data.StreamingLoader(tmp + "/ds", batch_size=4, device="cpu", chunk_bytes=5000)


# ---- CUDA specifics ---------------------------------------------------------------------------

@requires_cuda
def test_cuda_batches_feed_work_on_the_current_stream(tmp):
    src = records(64, (4096 + 12,))
    data.write_shards(tmp + "/ds", src, records_per_shard=20)
    side = torch.cuda.Stream()
    loader = data.StreamingLoader(tmp + "/ds", batch_size=8, device="cuda", shuffle=True, return_indices=True)
    with torch.cuda.stream(side):
        sums = [(batch.to(torch.int64).sum(dim=1), ids) for batch, ids in loader]
    torch.cuda.synchronize()
    ref = torch.from_numpy(src).to(torch.int64).sum(dim=1)
    for s, ids in sums:
        assert torch.equal(s.cpu(), ref[ids])


@requires_cuda
def test_cuda_bfloat16_and_held_batches(tmp):
    src = torch.randn(50, 3, 33).to(torch.bfloat16)
    data.write_shards(tmp + "/ds", src, records_per_shard=16)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=7, device="cuda", shuffle=True, prefetch=2,
                                  return_indices=True)
    held = list(loader)  # more batches than the prefetch depth, all alive at once
    loader.close()
    for batch, ids in held:
        assert batch.dtype == torch.bfloat16
        assert torch.equal(batch.cpu(), src[ids])


@requires_cuda
def test_cuda_mmap_registered_page_cache(tmp):
    src = records(40, (5000,))
    data.write_shards(tmp + "/ds", src, records_per_shard=15)
    loader = data.StreamingLoader(tmp + "/ds", batch_size=6, device="cuda", shuffle=True, io="mmap",
                                  return_indices=True)
    assert loader.io_backend == "mmap", loader.notes
    got, ids = epoch(loader)
    assert torch.equal(got, torch.from_numpy(src)[ids])
    assert sorted(ids.tolist()) == list(range(40))
