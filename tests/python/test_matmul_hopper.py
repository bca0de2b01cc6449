"""The Hopper GEMM rungs from Python (wgmma_tma, wgmma_ws, wgmma_persistent): parity with float64 on
shapes TMA can describe (rows 16-byte aligned), batched and broadcast, strided views, autograd
through the forced rung, auto's choice, and the refusal of operands TMA cannot describe. The
generic matmul tests run these rungs only through auto (conftest.variants_for)."""

from __future__ import annotations

import pytest
import torch

import optimized_ops
from conftest import HOPPER_GEMM, gemm_error_ratio, rand


def _hopper_skip_reason() -> str:
    if not optimized_ops.built_with_cuda():
        return "built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cc = torch.cuda.get_device_capability()
    if cc != (9, 0):
        return f"the Hopper rungs are sm_90a code (compute capability 9.0); given {cc[0]}.{cc[1]}"
    x = torch.zeros(8, 8, dtype=torch.bfloat16, device="cuda")
    try:
        optimized_ops.matmul(x, x, variant="wgmma_tma")
    except Exception as e:  # noqa: BLE001 - the build's own reason
        if "not in this build" in str(e):
            return str(e)
    return ""


REASON = _hopper_skip_reason()
requires_hopper = pytest.mark.skipif(bool(REASON), reason=REASON or "Hopper present")
HALF = [torch.float16, torch.bfloat16]

SHAPES = [
    ((128, 256), (256, 512)),
    ((1, 64), (64, 64)),              # M = 1
    ((257, 1032), (1032, 136)),       # M, N, K not multiples of the 128 x 256 x 64 tile
    ((3, 40, 8), (3, 8, 24)),         # K = 8: one k-block, mostly zero-filled
    ((4, 24, 16), (16, 16)),          # b shared by every batch
    ((16, 8), (5, 8, 24)),            # a shared by every batch
    ((2, 1, 72, 64), (3, 64, 40)),    # broadcast batch dimensions
    ((64,), (64, 8)),                 # 1-D a
]


def _ids(pair):
    return "x".join(map(str, pair[0])) + "@" + "x".join(map(str, pair[1]))


@requires_hopper
@pytest.mark.parametrize("variant", HOPPER_GEMM)
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shapes", SHAPES, ids=_ids)
def test_parity_with_float64(variant, dtype, shapes, rng):
    a = rand(shapes[0], dtype, "cuda", rng)
    b = rand(shapes[1], dtype, "cuda", rng)
    out = optimized_ops.matmul(a, b, variant=variant)
    assert out.shape == torch.matmul(a, b).shape and out.dtype == dtype
    assert gemm_error_ratio(out, a, b) <= 1.0


@requires_hopper
@pytest.mark.parametrize("variant", HOPPER_GEMM)
def test_strided_views(variant, rng):
    # Row-padded slices (ld > width, still 16-byte aligned) and every other batch: no copies needed.
    big_a = rand((6, 72, 136), torch.bfloat16, "cuda", rng)
    big_b = rand((128, 264), torch.bfloat16, "cuda", rng)
    a, b = big_a[::2, :, :128], big_b[:, 8:248]
    out = optimized_ops.matmul(a, b, variant=variant)
    assert gemm_error_ratio(out, a, b) <= 1.0


@requires_hopper
@pytest.mark.parametrize("variant", HOPPER_GEMM)
def test_autograd_through_the_rung(variant, rng):
    a = rand((3, 40, 64), torch.bfloat16, "cuda", rng).requires_grad_()
    b = rand((64, 48), torch.bfloat16, "cuda", rng).requires_grad_()
    gy = rand((3, 40, 48), torch.bfloat16, "cuda", rng)
    ga, gb = torch.autograd.grad(optimized_ops.matmul(a, b, variant=variant), (a, b), gy)
    assert gemm_error_ratio(ga, gy, b.detach().mT) <= 1.0
    # grad_b sums three products: compare with float64 at the bound of a K = 120 product.
    gb_ref = torch.matmul(a.detach().double().reshape(120, 64).mT, gy.double().reshape(120, 48))
    torch.testing.assert_close(gb.double(), gb_ref, atol=0.05, rtol=0.02)


@requires_hopper
@pytest.mark.parametrize("variant", HOPPER_GEMM)
def test_refuses_what_tma_cannot_describe(variant, rng):
    a = rand((37, 45), torch.bfloat16, "cuda", rng)  # rows of 90 bytes
    b = rand((45, 24), torch.bfloat16, "cuda", rng)
    with pytest.raises(ValueError, match=r"a: expected a row stride .* for TMA"):
        optimized_ops.matmul(a, b, variant=variant)
    # auto falls back to a rung that takes them
    assert gemm_error_ratio(optimized_ops.matmul(a, b), a, b) <= 1.0


@requires_hopper
def test_cuda_graph_capture(rng):
    a = rand((3, 40, 64), torch.float16, "cuda", rng)
    b = rand((64, 48), torch.float16, "cuda", rng)
    for variant in HOPPER_GEMM:
        optimized_ops.matmul(a, b, variant=variant)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = optimized_ops.matmul(a, b, variant=variant)
        a.copy_(rand(a.shape, torch.float16, "cuda", rng))
        graph.replay()
        torch.cuda.synchronize()
        assert gemm_error_ratio(out, a, b) <= 1.0
