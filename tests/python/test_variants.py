"""optimized_ops.variants(family): every family's ladder, from the library's tables, and the names
it lists are the names each family's variant= takes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import optimized_ops
from optimized_ops import data

GEMM = ["cpu_naive", "cpu_blocked", "cpu_packed", "naive", "coalesced", "smem_tiled", "register_tiled", "wmma",
        "mma_pipeline", "wgmma_tma", "wgmma_ws", "wgmma_persistent", "gemv"]
FUSED = ["cpu", "unfused", "fused_streaming", "fused_registers"]
LOADER = ["synchronous", "pipelined"]
SCALED_GEMM = ["cpu", "naive", "wgmma_fp8"]
GROUPED_GEMM = ["cpu", "naive", "loop", "wgmma"]
ROPE = ["cpu", "cuda"]


def test_every_family_naive_to_best():
    assert optimized_ops.variants("gemm") == GEMM
    assert optimized_ops.variants("fused") == FUSED
    assert optimized_ops.variants("loader") == LOADER
    assert optimized_ops.variants("scaled_gemm") == SCALED_GEMM
    assert optimized_ops.variants("grouped_gemm") == GROUPED_GEMM
    assert optimized_ops.variants("rope") == ROPE


def test_the_old_listings_are_the_same_tables():
    # variants() without a family is GEMM's, as it was before families; fused_variants() stays.
    assert optimized_ops.variants() == optimized_ops.variants("gemm")
    assert optimized_ops.fused_variants() == optimized_ops.variants("fused")
    # the torch ops of the glue, one per family, read the C++ tables
    ops = torch.ops.optimized
    assert list(ops.gemm_variants()) == GEMM
    assert list(ops.fused_variants()) == FUSED
    assert list(ops.loader_variants()) == LOADER
    assert list(ops.scaled_gemm_variants()) == SCALED_GEMM
    assert list(ops.grouped_gemm_variants()) == GROUPED_GEMM


def test_a_fresh_list_each_call():
    names = optimized_ops.variants("fused")
    names.append("mine")
    assert optimized_ops.variants("fused") == FUSED


@pytest.mark.parametrize("family", ["moe", "GEMM", "", None, 3])
def test_unknown_family_names_the_families(family):
    with pytest.raises(ValueError, match=rf"optimized_ops.variants: family: expected one of gemm, scaled_gemm, fused, rope, loader, attention, kv_cache, linear, "
                                         rf"grouped_gemm; "
                                         rf"given {re.escape(repr(family))}$"):
        optimized_ops.variants(family)


def test_gemm_names_are_what_matmul_takes():
    a, b = torch.ones(3, 4), torch.ones(4, 5)
    for name in optimized_ops.variants("gemm"):
        if name.startswith("cpu_"):
            torch.testing.assert_close(optimized_ops.matmul(a, b, variant=name), a @ b)
        else:  # parsed, then refused for CPU tensors (float16: the dtype every CUDA rung takes)
            with pytest.raises(ValueError, match=rf"variant: {name} runs on CUDA tensors"):
                optimized_ops.matmul(a.half(), b.half(), variant=name)


def test_fused_names_are_what_the_ops_take():
    x = torch.randn(3, 8)
    for name in optimized_ops.variants("fused"):
        if name == "cpu":
            torch.testing.assert_close(optimized_ops.softmax(x, -1, variant=name), torch.softmax(x, -1))
        else:  # parsed, then refused for CPU tensors
            with pytest.raises(ValueError, match=rf"variant {name} runs on CUDA devices"):
                optimized_ops.softmax(x, -1, variant=name)


def test_loader_names_are_what_the_loader_takes(tmp_path):
    records = np.arange(6 * 4, dtype=np.int32).reshape(6, 4)
    path = str(tmp_path / "ds")
    data.write_shards(path, records)
    for name in optimized_ops.variants("loader"):
        batches = list(data.StreamingLoader(path, batch_size=3, device="cpu", variant=name))
        assert torch.equal(torch.cat(batches), torch.from_numpy(records))
    with pytest.raises(ValueError, match="variant"):
        data.StreamingLoader(path, batch_size=3, device="cpu", variant="fastest")
