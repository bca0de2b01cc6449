"""The Python mirror of the tolerance rules (bench/tolerance.py, re-exported by conftest.py) against the
fixed numbers of tests/common/tolerance_vectors.txt, which the C++ rules of optimized_ops_testing
reproduce too (tests/core/test_tolerance.cpp): pytest and the C++ tests hold results to the same
bounds. Plus conftest's gemm_error_ratio, which applies the GEMM rule."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from conftest import dtype_name, gemm_allowed_error, gemm_error_ratio, reduction_allowed_error

VECTORS = pathlib.Path(__file__).resolve().parents[1] / "common" / "tolerance_vectors.txt"


def _lines():
    for line in VECTORS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            yield line.split()


def test_vectors_are_there():
    kinds = {fields[0] for fields in _lines()}
    assert kinds == {"gemm", "reduction"}, kinds


@pytest.mark.parametrize("fields", list(_lines()), ids=lambda f: "-".join(f[:3]))
def test_mirror_gives_the_cpp_bounds(fields):
    kind, dtype, *numbers = fields
    want = float(numbers[-1])
    if kind == "gemm":
        got = gemm_allowed_error(dtype, int(numbers[0]), float(numbers[1]), float(numbers[2]))
    else:
        got = reduction_allowed_error(dtype, int(numbers[0]), *(float(x) for x in numbers[1:5]))
    assert got == want or math.isclose(got, want, rel_tol=1e-12), f"{fields}: {got} != {want}"


def test_dtype_names():
    assert [dtype_name(d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)] == \
        ["fp32", "fp16", "bf16", "fp64"]
    assert dtype_name("bf16") == "bf16"


def test_gemm_error_ratio_is_the_rule_elementwise():
    g = torch.Generator().manual_seed(11)
    a = torch.rand(17, 33, generator=g, dtype=torch.float64).to(torch.bfloat16)
    b = torch.rand(33, 9, generator=g, dtype=torch.float64).to(torch.bfloat16)
    ref = a.double() @ b.double()
    exact = ref.to(torch.bfloat16)
    assert gemm_error_ratio(exact, a, b) <= 1.0  # a correctly rounded result passes
    allowed = gemm_allowed_error(torch.bfloat16, 33, ref, a.double().abs() @ b.double().abs())
    off = (ref + 1.5 * allowed).to(torch.bfloat16)  # beyond the bound everywhere (after rounding)
    assert gemm_error_ratio(off, a, b) > 1.0


def test_reduction_rule_catches_an_error_beyond_twice_torchs():
    """The rule as test_fused.py applies it (ours and torch in the same dtype against float64): torch's
    own result passes, one element off by 1.5x the bound fails."""
    g = torch.Generator().manual_seed(5)
    ref = torch.rand(4, 64, generator=g, dtype=torch.float64)
    theirs = ref.to(torch.bfloat16).double()
    err_torch = (theirs - ref).abs().max().item()
    allowed = reduction_allowed_error(torch.bfloat16, 64, err_torch, ref.abs().max().item(), 0.0, 2.0**-24)
    assert err_torch <= allowed
    wrong = ref.clone()
    wrong[2, 7] += 1.5 * allowed
    assert (wrong.to(torch.bfloat16).double() - ref).abs().max().item() > allowed  # even after rounding
