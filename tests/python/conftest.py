"""Shared fixtures of the Python tests: devices (CPU always; CUDA where present, skipped with the
reason where not), fresh random inputs, and the float64 check shared with the C++ tests."""

from __future__ import annotations

import math
import os

import pytest
import torch

import optimized_ops


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


def variants_for(device: str, dtype: torch.dtype) -> list[str]:
    """'auto' and every rung of the device that takes the dtype."""
    out = ["auto"]
    for v in optimized_ops.variants():
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


_UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def gemm_error_ratio(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """Worst |out - ref| / allowed over all elements, with ref = a @ b in float64 and the bound of
    the C++ check (src/gemm/gemm_check.h):
        out_eps * |ref| + 8 * sqrt(K) * 2^-24 * sum_k |a_ik b_kj|
    i.e. one rounding to the output dtype plus fp32 accumulation in any order. <= 1 passes."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    ref = torch.matmul(a64, b64)
    mag = torch.matmul(a64.abs(), b64.abs())
    k = a.shape[-1]
    allowed = _UNIT_ROUNDOFF[out.dtype] * ref.abs() + 8 * math.sqrt(k) * 2.0**-24 * mag + 1e-30
    err = (out.detach().double().cpu() - ref).abs()
    assert err.shape == ref.shape, f"output shape {tuple(err.shape)} != reference {tuple(ref.shape)}"
    ratio = err / allowed
    if torch.isnan(ratio).any():
        return math.inf
    return ratio.max().item() if ratio.numel() else 0.0


def pytest_report_header(config):
    return [f"optimized_ops library: {optimized_ops.library_path()}",
            f"torch {torch.__version__}; CUDA tests: {'run' if not CUDA_REASON else 'skipped: ' + CUDA_REASON}",
            f"threads: {torch.get_num_threads()}; OPTIMIZED_OPS_LIBRARY={os.environ.get('OPTIMIZED_OPS_LIBRARY', '')}"]
