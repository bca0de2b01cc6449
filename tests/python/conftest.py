"""Shared fixtures of the Python tests: devices (CPU always; CUDA where present, skipped with the
reason where not), fresh random inputs, and the tolerance rules shared with the C++ tests.

The rules (one per family) are those of optimized_ops_testing (src/testing/tolerance.h), mirrored in
bench/tolerance.py, which the Python benchmark uses too; test_tolerance.py checks the mirror against
the fixed numbers the C++ test checks (tests/common/tolerance_vectors.txt)."""

from __future__ import annotations

import math
import os
import pathlib
import sys

import pytest
import torch

import optimized_ops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
from tolerance import (accumulation_unit, dtype_name, gemm_allowed_error,  # noqa: E402,F401 - re-exported
                       reduction_allowed_error, unit_roundoff)


def cuda_skip_reason() -> str:
    if not optimized_ops.built_with_cuda():
        return "liboptimized_ops was built without CUDA (no nvcc at configure time)"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    return ""


CUDA_REASON = cuda_skip_reason()
requires_cuda = pytest.mark.skipif(bool(CUDA_REASON), reason=CUDA_REASON or "CUDA present")

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


HOPPER_GEMM = ("wgmma_tma", "wgmma_ws", "wgmma_persistent")


def variants_for(device: str, dtype: torch.dtype, hopper: bool = False) -> list[str]:
    """'auto' and every rung of the device that takes the dtype. The Hopper GEMM rungs load through
    TMA and refuse operands whose rows are not 16-byte aligned (odd K or N), which most shapes of
    the generic tests are: they come only with hopper=True (test_matmul_hopper.py), and 'auto'
    runs them wherever the operands allow."""
    out = ["auto"]
    for v in optimized_ops.variants():
        if v in HOPPER_GEMM and not hopper:
            continue
        ok, _ = optimized_ops.variant_supports(v, dtype, device)
        if ok:
            out.append(v)
    return out


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: fresh inputs per test, reproducible failures."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**31)
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype, device, rng) -> torch.Tensor:
    """Uniform [-1, 1) values (never zeros), made on the CPU for reproducibility."""
    return (torch.rand(shape, generator=rng, dtype=torch.float64) * 2 - 1).to(dtype).to(device)


def gemm_error_ratio(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst |out - ref| / allowed over all elements, with ref = a @ b in float64 and the GEMM rule
    (src/testing/tolerance.h; bench/tolerance.py):
        u_out * |ref| + floor_out + 8 * sqrt(K) * 2^-24 * sum_k |a_ik b_kj|
    i.e. one rounding to the output dtype plus fp32 accumulation in any order. <= 1 passes."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    ref = torch.matmul(a64, b64)
    mag = torch.matmul(a64.abs(), b64.abs())
    allowed = gemm_allowed_error(out.dtype, a.shape[-1], ref, mag)
    err = (out.detach().double().cpu() - ref).abs()
    assert err.shape == ref.shape, f"output shape {tuple(err.shape)} != reference {tuple(ref.shape)}"
    ratio = torch.where(err == 0, torch.zeros_like(err), err / allowed)  # fp64's floor is 0
    if torch.isnan(ratio).any():
        return math.inf
    return ratio.max().item() if ratio.numel() else 0.0


def pytest_report_header(config):
    return [f"optimized_ops library: {optimized_ops.library_path()}",
            f"torch {torch.__version__}; CUDA tests: {'run' if not CUDA_REASON else 'skipped: ' + CUDA_REASON}",
            f"threads: {torch.get_num_threads()}; OPTIMIZED_OPS_LIBRARY={os.environ.get('OPTIMIZED_OPS_LIBRARY', '')}"]
