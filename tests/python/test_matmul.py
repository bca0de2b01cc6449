"""optimized_ops.matmul / torch.ops.optimized.matmul against float64 and torch.matmul: every dtype,
every variant, odd and batched shapes, torch.matmul's N-D shape rules (1-D operands, any number of
batch dimensions, broadcasting), strided views (and that foldable ones are not copied), autograd,
opcheck, torch.compile, CUDA graphs, the current stream, and every error path."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import optimized_ops
from conftest import DEVICES, DTYPES, gemm_error_ratio, rand, requires_cuda, variants_for

# (a shape, b shape): odd sizes (1, primes), batched, broadcast either way, batch of 1.
SHAPES = [
    ((1, 1), (1, 1)),
    ((17, 13), (13, 31)),
    ((37, 41), (41, 53)),
    ((64, 128), (128, 96)),
    ((3, 7, 29), (3, 29, 11)),
    ((4, 19, 5), (5, 23)),        # b shared by every batch
    ((19, 5), (4, 5, 23)),        # a shared by every batch
    ((1, 9, 8), (6, 8, 7)),       # batch of 1 broadcast
    ((2, 1, 97), (2, 97, 3)),
]


def _ids(shape_pair):
    a, b = shape_pair
    return "x".join(map(str, a)) + "@" + "x".join(map(str, b))


def _params():
    for device in DEVICES:
        dev = device if isinstance(device, str) else device.values[0]
        marks = () if isinstance(device, str) else device.marks
        for dtype in DTYPES:
            for variant in variants_for(dev, dtype):
                yield pytest.param(dev, dtype, variant, marks=marks,
                                   id=f"{dev}-{str(dtype).removeprefix('torch.')}-{variant}")


# ---- parity -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device,dtype,variant", list(_params()))
@pytest.mark.parametrize("shapes", SHAPES, ids=_ids)
def test_parity_with_float64_and_torch(device, dtype, variant, shapes, rng):
    check_parity_with_float64_and_torch(rand(shapes[0], dtype, device, rng), rand(shapes[1], dtype, device, rng),
                                        variant)


def check_parity_with_float64_and_torch(a, b, variant, poison=False):
    """matmul(a, b, variant=variant) against float64 and torch.matmul (also the Triton rungs' check);
    poison: the caching allocator's next block of the output's size filled with NaN first."""
    dtype = a.dtype
    expected = torch.matmul(a, b)
    if poison:
        _poison_allocator(expected.shape, dtype, a.device)
    out = optimized_ops.matmul(a, b, variant=variant)
    assert out.shape == expected.shape and out.dtype == dtype and out.device == a.device
    assert out.is_contiguous()
    # 1. Within the GEMM bound of the C++ tests, element by element.
    ratio = gemm_error_ratio(out, a, b)
    assert ratio <= 1.0, f"worst error / allowed = {ratio}"
    # 2. No worse than twice torch's own error against float64 (plus accumulation noise).
    ref = torch.matmul(a.double(), b.double())
    ours = (out.double() - ref).abs().max().item()
    theirs = (expected.double() - ref).abs().max().item()
    noise = 8 * math.sqrt(a.shape[-1]) * 2.0**-24 * torch.matmul(a.double().abs(), b.double().abs()).max().item()
    assert ours <= 2 * theirs + noise, f"max error {ours} vs torch.matmul {theirs}"


@pytest.mark.parametrize("device", DEVICES)
def test_torch_ops_entry_is_the_same_op(device, rng):
    a, b = rand((5, 6), torch.float32, device, rng), rand((6, 7), torch.float32, device, rng)
    assert torch.equal(torch.ops.optimized.matmul(a, b), optimized_ops.matmul(a, b))
    assert torch.equal(torch.ops.optimized.matmul.default(a, b, variant="auto"), optimized_ops.matmul(a, b))


# ---- layouts ----------------------------------------------------------------------------------

def _layouts(device, dtype, rng):
    """(name, a, b) with non-contiguous operands of every kind the glue sees."""
    m, k, n = 23, 17, 19
    wide = rand((m, k + 9), dtype, device, rng)
    yield "row-padded slice a", wide[:, :k], rand((k, n), dtype, device, rng)
    yield "offset slice a", rand((m + 2, k + 3), dtype, device, rng)[1:m + 1, 3:], rand((k, n), dtype, device, rng)
    yield "transposed a", rand((k, m), dtype, device, rng).t(), rand((k, n), dtype, device, rng)
    yield "transposed b", rand((m, k), dtype, device, rng), rand((n, k), dtype, device, rng).t()
    yield "both transposed", rand((k, m), dtype, device, rng).t(), rand((n, k), dtype, device, rng).t()
    yield "expanded batch a", rand((1, m, k), dtype, device, rng).expand(3, m, k), rand((3, k, n), dtype, device, rng)
    yield "expanded rows b", rand((m, k), dtype, device, rng), rand((1, n), dtype, device, rng).expand(k, n)
    yield "batch-strided a", rand((3, m, 2 * k), dtype, device, rng)[:, :, k:], rand((k, n), dtype, device, rng)
    yield "permuted batch b", rand((3, m, k), dtype, device, rng), rand((k, 3, n), dtype, device, rng).permute(1, 0, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_non_contiguous_inputs(device, dtype, rng):
    for name, a, b in _layouts(device, dtype, rng):
        a_before, b_before = a.clone(), b.clone()
        out = optimized_ops.matmul(a, b)
        assert torch.equal(a, a_before) and torch.equal(b, b_before), f"{name}: inputs changed"
        ratio = gemm_error_ratio(out, a, b)
        assert ratio <= 1.0, f"{name}: worst error / allowed = {ratio}"


@pytest.mark.parametrize("device", DEVICES)
def test_output_is_fresh_and_inputs_untouched(device, rng):
    a, b = rand((8, 8), torch.float32, device, rng), rand((8, 8), torch.float32, device, rng)
    out1, out2 = optimized_ops.matmul(a, b), optimized_ops.matmul(a, b)
    assert out1.data_ptr() != out2.data_ptr()
    assert out1.data_ptr() not in (a.data_ptr(), b.data_ptr())
    assert torch.equal(out1, out2)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_dimensions(device):
    a, b = torch.ones(0, 4, device=device), torch.ones(4, 3, device=device)
    assert optimized_ops.matmul(a, b).shape == (0, 3)
    z = optimized_ops.matmul(torch.ones(5, 0, device=device), torch.ones(0, 3, device=device))
    assert z.shape == (5, 3) and torch.equal(z, torch.zeros(5, 3, device=device))
    assert optimized_ops.matmul(torch.ones(0, 2, 4, device=device), b).shape == (0, 2, 3)


# ---- torch.matmul's N-D shape rules ------------------------------------------------------------

# (a shape, b shape), every one checked for torch.matmul's exact output shape.
ND_SHAPES = [
    ((7,), (7,)),                          # 1-D @ 1-D: a 0-D result
    ((13,), (13, 5)),                      # 1-D @ 2-D: (N,)
    ((7,), (3, 7, 5)),                     # 1-D @ N-D
    ((7,), (2, 3, 7, 5)),
    ((5, 7), (7,)),                        # 2-D @ 1-D: (M,)
    ((2, 3, 5, 7), (7,)),                  # N-D @ 1-D
    ((3, 5, 17, 19), (3, 5, 19, 23)),      # 4-D, batches fold into one
    ((2, 1, 11, 13), (7, 13, 6)),          # broadcast that does not fold: a loop over 2
    ((3, 1, 5, 7), (1, 4, 7, 2)),          # both broadcast: a loop over 3
    ((4, 1, 3, 5, 7), (2, 1, 7, 6)),       # two outer groups: a loop over 4 x 2, batch 3 inside
    ((5, 7), (2, 3, 7, 4)),                # a shared by a 2-D batch
    ((2, 3, 5, 7), (7, 4)),                # b shared by a 2-D batch
    ((1, 1, 5, 7), (1, 7, 3)),             # batch dimensions of 1 only
    ((1, 1, 1, 9, 8), (8, 1)),
    ((1,), (1, 1, 1)),
    ((2, 3, 4, 1, 1), (1, 1)),
]
# Empty results and empty sums (K = 0: zeros).
ND_EMPTY_SHAPES = [
    ((0, 5, 7), (7, 3)),
    ((2, 0, 5, 7), (1, 7, 3)),
    ((1, 5, 7), (0, 7, 3)),               # a batch of 1 broadcast to 0
    ((3, 0, 7), (7,)),
    ((0,), (0,)),
    ((0,), (0, 3)),
    ((2, 3, 5, 0), (0, 4)),
    ((4, 0), (2, 1, 0, 6)),
]


def _nd_params():
    """(device, dtype, variant): every rung that takes the dtype, float64 on the CPU rungs too."""
    for device in DEVICES:
        dev = device if isinstance(device, str) else device.values[0]
        marks = () if isinstance(device, str) else device.marks
        for dtype in DTYPES + ([torch.float64] if dev == "cpu" else []):
            for variant in variants_for(dev, dtype):
                yield pytest.param(dev, dtype, variant, marks=marks,
                                   id=f"{dev}-{str(dtype).removeprefix('torch.')}-{variant}")


def _poison_allocator(shape, dtype, device):
    """Frees a NaN-filled block of the output's size just before the op, so that the allocator
    likely hands it back as the output and an element the op does not write fails the check.
    Best effort: reliable with CUDA's caching allocator, a chance on the CPU."""
    poison = torch.full(shape, math.nan, dtype=dtype, device=device)
    del poison


def _nd_error_ratio(out, a, b) -> float:
    """gemm_error_ratio, extended to float64 (accumulation in float64 in any order)."""
    if out.dtype != torch.float64:
        return gemm_error_ratio(out, a, b)
    ref = torch.matmul(a.double().cpu(), b.double().cpu())
    mag = torch.matmul(a.double().cpu().abs(), b.double().cpu().abs())
    k = a.shape[-1]
    allowed = 8 * math.sqrt(max(k, 1)) * 2.0**-53 * mag + 1e-300
    err = (out.cpu() - ref).abs()
    return (err / allowed).max().item() if err.numel() else 0.0


@pytest.mark.parametrize("device,dtype,variant", list(_nd_params()))
@pytest.mark.parametrize("shapes", ND_SHAPES, ids=_ids)
def test_nd_parity_with_float64_and_torch(device, dtype, variant, shapes, rng):
    a = rand(shapes[0], dtype, device, rng)
    b = rand(shapes[1], dtype, device, rng)
    expected = torch.matmul(a, b)
    _poison_allocator(expected.shape, dtype, device)
    out = optimized_ops.matmul(a, b, variant=variant)
    assert out.shape == expected.shape, f"shape {tuple(out.shape)} != torch.matmul's {tuple(expected.shape)}"
    assert out.dtype == dtype and out.device == a.device and out.is_contiguous()
    ratio = _nd_error_ratio(out, a, b)
    assert ratio <= 1.0, f"worst error / allowed = {ratio}"
    # The torch.ops entry is the same op.
    assert torch.equal(torch.ops.optimized.matmul(a, b, variant=variant), out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", ND_EMPTY_SHAPES, ids=_ids)
def test_nd_empty_dimensions(device, shapes, rng):
    a = rand(shapes[0], torch.float32, device, rng)
    b = rand(shapes[1], torch.float32, device, rng)
    expected = torch.matmul(a, b)
    out = optimized_ops.matmul(a, b)
    assert out.shape == expected.shape and out.is_contiguous()
    assert torch.equal(out, torch.zeros_like(expected))  # empty, or an empty sum


def _nd_layouts(device, dtype, rng):
    """(name, a, b, copied): N-D operands in strided layouts; copied says whether the glue must
    copy an operand (its matrices are neither row- nor column-major) or must pass it as it is."""
    r = lambda *shape: rand(shape, dtype, device, rng)  # noqa: E731
    yield "batch step a[::2]", r(6, 5, 7)[::2], r(3, 7, 4), False
    yield "row-padded 4-D slice a", r(3, 5, 17, 2 * 19)[..., :19], r(3, 5, 19, 23), False
    yield "offset 4-D slice b", r(3, 5, 9), r(2, 4, 11, 8)[1:, 1:, 2:, 3:], False
    yield "(2,1,M,K) @ (7,K,N)", r(2, 1, 11, 13), r(7, 13, 6), False
    yield "expanded batch a", r(1, 5, 17, 19).expand(3, 5, 17, 19), r(3, 5, 19, 23), False
    yield "expanded batch b (stride 0 inside)", r(5, 6, 7), r(3, 1, 7, 4).expand(3, 5, 7, 4), False
    yield "permuted batch a (no fold)", r(5, 3, 7, 4).permute(1, 0, 2, 3), r(3, 5, 4, 6), False
    yield "interleaved matrices b", r(5, 4, 7), r(7, 5, 3, 2).permute(2, 1, 0, 3), False
    yield "strided 1-D b", r(3, 5, 7), r(21)[::3], False
    yield "1-D a, permuted batch b", r(7), r(2, 3, 7, 4).transpose(0, 1), False
    yield "transposed matrices a", r(3, 5, 19, 17).transpose(-1, -2), r(3, 5, 19, 23), False
    yield "transposed b, broadcast", r(2, 1, 11, 13), r(7, 6, 13).mT, False
    yield "both transposed, padded", r(3, 19, 2 * 17)[..., :17].mT, r(3, 23, 19).mT, False
    yield "strided 1-D a (a column-major row)", r(14)[::2], r(2, 7, 5), False
    yield "expanded rows b", r(2, 3, 5, 7), r(1, 4).expand(7, 4), True
    yield "rows and columns both strided a", r(3, 10, 2 * 7)[:, ::2, ::2], r(7, 4), True
    yield "expanded 1-D b", r(2, 5, 7), r(1).expand(7), True


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_nd_strided_views(device, dtype, rng):
    for name, a, b, _ in _nd_layouts(device, dtype, rng):
        a_before, b_before = a.clone(), b.clone()
        expected = torch.matmul(a, b)
        out = optimized_ops.matmul(a, b)
        assert torch.equal(a, a_before) and torch.equal(b, b_before), f"{name}: inputs changed"
        assert out.shape == expected.shape and out.is_contiguous(), f"{name}: shape {tuple(out.shape)}"
        ratio = gemm_error_ratio(out, a, b)
        assert ratio <= 1.0, f"{name}: worst error / allowed = {ratio}"


def _copies_inside(a, b) -> list[str]:
    """The copying aten ops that run inside the op (the profiler records the ops the glue calls)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        optimized_ops.matmul(a, b)
    names = [e.name for e in prof.events()]
    assert "optimized::matmul" in names, names
    return [n for n in names if n in ("aten::contiguous", "aten::clone", "aten::copy_", "aten::expand")]


@pytest.mark.parametrize("device", DEVICES)
def test_nd_foldable_views_are_not_copied(device, rng):
    """Strided batch views and transposed matrices go to the kernels as they are (folded or looped
    over), broadcast operands are not expanded into copies; only matrices that are neither row- nor
    column-major are copied."""
    for name, a, b, copied in _nd_layouts(device, torch.float32, rng):
        copies = _copies_inside(a, b)
        if copied:
            assert copies, f"{name}: expected a copy of the operand, none seen (is the check blind?)"
        else:
            assert not copies, f"{name}: copied or expanded: {copies}"


# ---- autograd ---------------------------------------------------------------------------------

GRAD_SHAPES = [((5, 7), (7, 3)), ((3, 5, 7), (3, 7, 4)), ((3, 5, 7), (7, 4)), ((5, 7), (2, 7, 4)),
               ((1, 5, 7), (3, 7, 2)), ((3, 5, 7), (1, 7, 2))]
# torch.matmul's N-D rules: 1-D operands, broadcast batch dimensions (folded and looped).
GRAD_ND_SHAPES = [((7,), (7,)), ((7,), (7, 3)), ((5, 7), (7,)), ((7,), (2, 7, 3)), ((2, 3, 5, 7), (7,)),
                  ((2, 1, 5, 7), (3, 7, 4)), ((1, 5, 7), (2, 3, 7, 4)), ((2, 3, 4, 5), (5, 2)),
                  ((3, 4, 5), (2, 1, 5, 2)), ((2, 3, 4, 5), (3, 5, 2)), ((3, 1, 4, 5), (1, 2, 5, 3))]


@pytest.mark.parametrize("variant", ["auto", "cpu_naive", "cpu_blocked"])
@pytest.mark.parametrize("shapes", GRAD_SHAPES, ids=_ids)
def test_gradcheck_cpu(variant, shapes, rng):
    """gradcheck and gradgradcheck in float64 with torch's default tolerances, on the real kernels:
    the CPU rungs cpu_naive and cpu_blocked take float64 and accumulate in float64 (auto picks
    cpu_blocked for float64 on the CPU). The other dtypes' gradients are checked against float64
    autograd in test_gradients_against_float64."""
    a = rand(shapes[0], torch.float64, "cpu", rng).requires_grad_()
    b = rand(shapes[1], torch.float64, "cpu", rng).requires_grad_()
    fn = lambda x, y: optimized_ops.matmul(x, y, variant=variant)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))


@pytest.mark.parametrize("variant", ["auto", "cpu_naive"])
@pytest.mark.parametrize("shapes", GRAD_ND_SHAPES, ids=_ids)
def test_gradcheck_cpu_nd(variant, shapes, rng):
    """As test_gradcheck_cpu, for 1-D operands and broadcast batch dimensions: the gradients are
    summed over the broadcast dimensions and reshaped to the operands' shapes."""
    a = rand(shapes[0], torch.float64, "cpu", rng).requires_grad_()
    b = rand(shapes[1], torch.float64, "cpu", rng).requires_grad_()
    fn = lambda x, y: optimized_ops.matmul(x, y, variant=variant)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))


@pytest.mark.parametrize("variant", ["cpu_packed", "register_tiled"])
def test_float64_only_on_the_plain_cpu_rungs(variant):
    a, b = torch.ones(3, 4, dtype=torch.float64), torch.ones(4, 5, dtype=torch.float64)
    if variant == "register_tiled":
        if not (torch.cuda.is_available() and optimized_ops.built_with_cuda()):
            pytest.skip("needs a CUDA device and a CUDA build")
        a, b = a.cuda(), b.cuda()
    with pytest.raises(NotImplementedError, match=rf"variant: {variant} supports fp32, fp16, bf16 .*given fp64"):
        optimized_ops.matmul(a, b, variant=variant)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shapes", GRAD_SHAPES + GRAD_ND_SHAPES, ids=_ids)
def test_gradients_against_float64(device, dtype, shapes, rng):
    check_gradients_against_float64(shapes, dtype, device, rng)


def check_gradients_against_float64(shapes, dtype, device, rng, variant="auto"):
    """matmul(a, b, variant=variant)'s gradients against float64 (also the Triton rungs' check)."""
    a = rand(shapes[0], dtype, device, rng).requires_grad_()
    b = rand(shapes[1], dtype, device, rng).requires_grad_()
    out = optimized_ops.matmul(a, b, variant=variant)
    assert out.shape == torch.matmul(a, b).shape
    g = rand(out.shape, dtype, device, rng)
    grad_a, grad_b = torch.autograd.grad(out, (a, b), g)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref_a, ref_b = torch.autograd.grad(torch.matmul(a64, b64), (a64, b64), g.double())
    assert grad_a.shape == a.shape and grad_b.shape == b.shape
    assert grad_a.dtype == dtype and grad_b.dtype == dtype
    # Each gradient is a GEMM (plus, for broadcast operands, a sum over the batch: one more
    # rounding and a longer accumulation, covered by a looser factor on the same bound).
    for got, ref, name in ((grad_a, ref_a, "grad_a"), (grad_b, ref_b, "grad_b")):
        err = (got.double().cpu() - ref.cpu()).abs().max().item()
        scale = ref.abs().max().item()
        eps = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
        assert err <= 4 * eps * scale + 1e-5 * scale, f"{name}: max error {err} (scale {scale})"


def test_grad_only_for_what_requires_it(rng):
    a = rand((4, 5), torch.float32, "cpu", rng).requires_grad_()
    b = rand((5, 6), torch.float32, "cpu", rng)
    (grad_a,) = torch.autograd.grad(optimized_ops.matmul(a, b).sum(), (a,))
    assert torch.allclose(grad_a, torch.ones(4, 6) @ b.t(), atol=1e-5)


@pytest.mark.parametrize("shapes", [((0, 4, 5), (5, 2)), ((2, 4, 0), (0, 3)), ((0,), (0,)),
                                    ((2, 0, 4, 5), (1, 5, 3)), ((3, 4, 5), (5, 0))], ids=_ids)
def test_gradients_with_empty_dimensions(shapes, rng):
    a = rand(shapes[0], torch.float64, "cpu", rng).requires_grad_()
    b = rand(shapes[1], torch.float64, "cpu", rng).requires_grad_()
    out = optimized_ops.matmul(a, b)
    g = rand(out.shape, torch.float64, "cpu", rng)
    grads = torch.autograd.grad(out, (a, b), g)
    a64, b64 = a.detach().requires_grad_(), b.detach().requires_grad_()
    refs = torch.autograd.grad(torch.matmul(a64, b64), (a64, b64), g)
    for got, ref in zip(grads, refs):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref)


# ---- torch.library: opcheck, fake kernels, compile --------------------------------------------

OPCHECK_CASES = [((5, 7), (7, 3)), ((3, 5, 7), (3, 7, 4)), ((3, 5, 7), (7, 4)), ((1, 5, 7), (3, 7, 2))]
OPCHECK_ND_CASES = [((7,), (7,)), ((7,), (3, 7, 4)), ((2, 3, 5, 7), (7,)), ((2, 1, 5, 7), (3, 7, 4)),
                    ((3, 5, 6, 7), (3, 5, 7, 2))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shapes", OPCHECK_CASES, ids=_ids)
def test_opcheck(device, dtype, shapes, rng):
    a = rand(shapes[0], dtype, device, rng).requires_grad_()
    b = rand(shapes[1], dtype, device, rng).requires_grad_()
    torch.library.opcheck(torch.ops.optimized.matmul.default, (a, b), {"variant": "auto"})
    torch.library.opcheck(torch.ops.optimized.matmul.default, (a.detach(), b.detach()), {"variant": "auto"})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", OPCHECK_ND_CASES, ids=_ids)
def test_opcheck_nd(device, shapes, rng):
    a = rand(shapes[0], torch.float32, device, rng).requires_grad_()
    b = rand(shapes[1], torch.float32, device, rng).requires_grad_()
    torch.library.opcheck(torch.ops.optimized.matmul.default, (a, b), {"variant": "auto"})
    torch.library.opcheck(torch.ops.optimized.matmul.default, (a.detach(), b.detach()), {"variant": "auto"})


def test_fake_kernel_shapes_and_errors():
    meta = dict(device="meta")
    assert optimized_ops.matmul(torch.empty(3, 4, **meta), torch.empty(4, 5, **meta)).shape == (3, 5)
    assert optimized_ops.matmul(torch.empty(2, 3, 4, **meta), torch.empty(4, 5, **meta)).shape == (2, 3, 5)
    assert optimized_ops.matmul(torch.empty(3, 4, **meta), torch.empty(6, 4, 5, **meta)).shape == (6, 3, 5)
    assert optimized_ops.matmul(torch.empty(1, 3, 4, **meta), torch.empty(6, 4, 5, **meta)).shape == (6, 3, 5)
    for sa, sb in ND_SHAPES + ND_EMPTY_SHAPES:
        got = optimized_ops.matmul(torch.empty(sa, **meta), torch.empty(sb, **meta)).shape
        assert got == torch.matmul(torch.empty(sa, **meta), torch.empty(sb, **meta)).shape, (sa, sb, got)
    # What the shape is computed from: the operands' ranks, the batch dimensions, one device.
    with pytest.raises(ValueError, match=r"a: expected a tensor of at least 1 dimension, \(K,\) or \(\.\.\., M, K\); given 0-D"):
        optimized_ops.matmul(torch.empty((), **meta), torch.empty(4, 5, **meta))
    with pytest.raises(ValueError, match=r"optimized::matmul: b: expected device meta \(same as a\); given cpu"):
        optimized_ops.matmul(torch.empty(3, 4, **meta), torch.empty(4, 5))
    # The rest is the C++ library's, checked where a kernel runs (under torch.compile: when the compiled
    # graph runs): the fake gives the shape whatever K and the dtypes are; the kernel raises.
    assert optimized_ops.matmul(torch.empty(3, 4, **meta), torch.empty(5, 6, **meta)).shape == (3, 6)
    assert optimized_ops.matmul(torch.empty(3, 4, dtype=torch.int32, **meta), torch.empty(4, 5, **meta)).shape == (3, 5)
    with pytest.raises(ValueError, match=r"optimized::matmul: b: expected 4 rows to match a's columns \(K\)"):
        optimized_ops.matmul(torch.empty(3, 4), torch.empty(5, 6))
    with pytest.raises(NotImplementedError, match="optimized::matmul: a: expected dtype fp32, fp16, bf16 or fp64"):
        optimized_ops.matmul(torch.ones(3, 4, dtype=torch.int32), torch.ones(4, 5, dtype=torch.int32))


def _model(a, b, c):
    h = torch.relu(optimized_ops.matmul(a, b))
    return optimized_ops.matmul(h, c).sum(dim=-1)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, rng):
    torch._dynamo.reset()
    a = rand((2, 9, 16), torch.float32, device, rng).requires_grad_()
    b = rand((16, 12), torch.float32, device, rng).requires_grad_()
    c = rand((12, 5), torch.float32, device, rng)
    explanation = torch._dynamo.explain(_model)(a, b, c)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(_model, fullgraph=True)
    out = compiled(a, b, c)
    expected = _model(a, b, c)
    torch.testing.assert_close(out, expected)
    # Backward through the compiled graph (the registered autograd formula).
    (ga, gb) = torch.autograd.grad(out.sum(), (a, b))
    (ea, eb) = torch.autograd.grad(expected.sum(), (a, b))
    torch.testing.assert_close(ga, ea)
    torch.testing.assert_close(gb, eb)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_dynamic_shapes(device, rng):
    torch._dynamo.reset()
    fn = torch.compile(lambda x, y: optimized_ops.matmul(x, y) * 2, fullgraph=True, dynamic=True)
    for m, k, n in ((5, 7, 3), (11, 13, 17), (2, 3, 4)):
        a, b = rand((m, k), torch.float32, device, rng), rand((k, n), torch.float32, device, rng)
        torch.testing.assert_close(fn(a, b), optimized_ops.matmul(a, b) * 2)


# Pairs of calls with the same ranks and broadcast pattern but other sizes: with dynamic shapes
# the fake kernel runs on symbolic sizes, and the second call must reuse the first graph.
DYNAMIC_ND_CASES = [
    [((7,), (7,)), ((11,), (11,))],
    [((7,), (2, 3, 7, 5)), ((9,), (4, 2, 9, 3))],
    [((2, 3, 5, 7), (7,)), ((3, 2, 4, 9), (9,))],
    [((3, 5, 17, 19), (3, 5, 19, 23)), ((2, 4, 6, 8), (2, 4, 8, 10))],
    [((2, 1, 5, 7), (3, 7, 4)), ((4, 1, 6, 9), (5, 9, 2))],
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("calls", DYNAMIC_ND_CASES, ids=lambda c: _ids(c[0]))
def test_torch_compile_dynamic_nd_shapes(device, calls, rng):
    """The fake kernel under torch.compile(fullgraph=True, dynamic=True) (aot_eager: the traced
    graph runs as it is, so this checks tracing and the shapes, not a code generator), forward and
    backward, against torch.matmul."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x, y: optimized_ops.matmul(x, y) * 2, backend=counter, fullgraph=True, dynamic=True)
    for sa, sb in calls:
        a = rand(sa, torch.float32, device, rng).requires_grad_()
        b = rand(sb, torch.float32, device, rng).requires_grad_()
        out = fn(a, b)
        expected = torch.matmul(a, b) * 2
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        grads = torch.autograd.grad(out.sum(), (a, b))
        refs = torch.autograd.grad(expected.sum(), (a, b))
        for got, ref in zip(grads, refs):
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for one shape pattern"


def test_torch_export(rng):
    class Model(torch.nn.Module):
        def forward(self, a, b):
            return torch.relu(optimized_ops.matmul(a, b))

    a, b = rand((2, 5, 7), torch.float32, "cpu", rng), rand((7, 3), torch.float32, "cpu", rng)
    program = torch.export.export(Model(), (a, b))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.optimized.matmul.default in targets
    torch.testing.assert_close(program.module()(a, b), Model()(a, b))


# ---- CUDA: graphs, streams, devices -----------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_cuda_graph_capture_and_replay(dtype, rng):
    for variant in variants_for("cuda", dtype):
        a = rand((3, 67, 45), dtype, "cuda", rng)
        b = rand((45, 71), dtype, "cuda", rng)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture, as torch recommends
            optimized_ops.matmul(a, b, variant=variant)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = optimized_ops.matmul(a, b, variant=variant)
        for _ in range(2):  # new inputs in the same memory, replayed
            a.copy_(rand(a.shape, dtype, "cuda", rng))
            b.copy_(rand(b.shape, dtype, "cuda", rng))
            graph.replay()
            torch.cuda.synchronize()
            ratio = gemm_error_ratio(out, a, b)
            assert ratio <= 1.0, f"{variant}: worst error / allowed after replay = {ratio}"


@requires_cuda
def test_cuda_graph_with_transposed_input(rng):
    """Transposed inputs (column-major, passed without a copy) under capture and replay."""
    a = rand((64, 48), torch.bfloat16, "cuda", rng)
    b = rand((80, 64), torch.bfloat16, "cuda", rng)
    optimized_ops.matmul(a.t(), b.t())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = optimized_ops.matmul(a.t(), b.t())
    a.copy_(rand(a.shape, torch.bfloat16, "cuda", rng))
    graph.replay()
    torch.cuda.synchronize()
    assert gemm_error_ratio(out, a.t(), b.t()) <= 1.0


@requires_cuda
def test_cuda_graph_with_broadcast_loop(rng):
    """A broadcast that does not fold is several launches (one per outer batch index): all captured."""
    a = rand((2, 1, 67, 45), torch.bfloat16, "cuda", rng)
    b = rand((7, 45, 33), torch.bfloat16, "cuda", rng)
    optimized_ops.matmul(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = optimized_ops.matmul(a, b)
    a.copy_(rand(a.shape, torch.bfloat16, "cuda", rng))
    b.copy_(rand(b.shape, torch.bfloat16, "cuda", rng))
    graph.replay()
    torch.cuda.synchronize()
    assert out.shape == (2, 7, 67, 33)
    assert gemm_error_ratio(out, a, b) <= 1.0


@requires_cuda
def test_runs_on_the_current_stream(rng):
    """Work queued on a side stream (a long sleep, then new values into a) must precede the op:
    an op that ran on another stream would read a's old values."""
    a = rand((512, 256), torch.float16, "cuda", rng)
    b = rand((256, 128), torch.float16, "cuda", rng)
    new_a = rand((512, 256), torch.float16, "cuda", rng)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time
        a.copy_(new_a)
        out = optimized_ops.matmul(a, b)
    side.synchronize()
    assert gemm_error_ratio(out, new_a, b) <= 1.0


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_device_guard_second_gpu(rng):
    a = rand((33, 17), torch.bfloat16, "cuda:1", rng)
    b = rand((17, 9), torch.bfloat16, "cuda:1", rng)
    with torch.cuda.device(0):
        out = optimized_ops.matmul(a, b)
    assert out.device == a.device
    torch.cuda.synchronize(1)
    assert gemm_error_ratio(out, a, b) <= 1.0


# ---- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_name_the_argument(device):
    f32 = dict(device=device, dtype=torch.float32)
    a, b = torch.ones(3, 4, **f32), torch.ones(4, 5, **f32)
    cases = [
        (ValueError, r"b: expected 4 rows to match a's columns \(K\); given shape \[5, 4\]",
         lambda: optimized_ops.matmul(a, torch.ones(5, 4, **f32))),
        (ValueError, r"b: expected batch dimensions broadcastable with a's \[3\] \(each equal, or 1 in "
                     r"either\); given \[2\] \(b of shape \[2, 4, 5\], a of shape \[3, 3, 4\]\)",
         lambda: optimized_ops.matmul(torch.ones(3, 3, 4, **f32), torch.ones(2, 4, 5, **f32))),
        (NotImplementedError, r"optimized::matmul: a: expected dtype fp32, fp16, bf16 or fp64; given int32",
         lambda: optimized_ops.matmul(a.int(), b.int())),
        (ValueError, r"optimized::matmul: b: expected dtype fp32 \(same as a\); given fp16",
         lambda: optimized_ops.matmul(a, b.half())),
        (NotImplementedError, r"optimized::matmul: a: expected a dtype of the library \(.*\); given int8",
         lambda: optimized_ops.matmul(a.to(torch.int8), b.to(torch.int8))),
        (NotImplementedError, r"optimized::matmul: a: expected dtype fp32, fp16, bf16 or fp64; given bool",
         lambda: optimized_ops.matmul(a.bool(), b.bool())),
        (ValueError, r"variant: expected one of auto, cpu_naive, .*; given 'fastest'",
         lambda: optimized_ops.matmul(a, b, variant="fastest")),
    ]
    if device == "cpu":
        cases.append((ValueError, r"variant: naive runs on CUDA tensors; given tensors on cpu",
                      lambda: optimized_ops.matmul(a, b, variant="naive")))
    else:
        cases.append((ValueError, r"variant: cpu_packed runs on the CPU tensors; given tensors on cuda:0",
                      lambda: optimized_ops.matmul(a, b, variant="cpu_packed")))
        cases.append((NotImplementedError, r"variant: wmma supports fp16, bf16 \(tensor cores\); given fp32",
                      lambda: optimized_ops.matmul(a, b, variant="wmma")))
        cases.append((ValueError, r"b: expected device cuda:0 \(same as a\); given cpu",
                      lambda: optimized_ops.matmul(a, b.cpu())))
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()


@pytest.mark.parametrize("device", ["meta"] + DEVICES)
def test_nd_bad_inputs_name_the_argument(device):
    """The rank, K and batch errors of torch.matmul's N-D rules, from the kernel; the rank and batch
    errors, which leave the output without a shape, from the fake kernel (meta) too. K and the dtypes
    are checked by the kernel only (the fake gives the shape the operands' other dimensions make)."""
    f32 = dict(device=device, dtype=torch.float32)
    ones = lambda *shape: torch.ones(shape, **f32)  # noqa: E731
    shape_cases = [
        (r"a: expected a tensor of at least 1 dimension, \(K,\) or \(\.\.\., M, K\); given 0-D \(a scalar\)",
         ones(), ones(4, 5)),
        (r"b: expected a tensor of at least 1 dimension, \(K,\) or \(\.\.\., K, N\); given 0-D \(a scalar\)",
         ones(3, 4), ones()),
        (r"a: expected a tensor of at least 1 dimension", ones(), ones()),
        (r"b: expected batch dimensions broadcastable with a's \[2, 3\] \(each equal, or 1 in either\); "
         r"given \[4\] \(b of shape \[4, 5, 6\], a of shape \[2, 3, 4, 5\]\)", ones(2, 3, 4, 5), ones(4, 5, 6)),
        (r"b: expected batch dimensions broadcastable with a's \[3, 1\] .*; given \[2, 7\]",
         ones(3, 1, 4, 5), ones(2, 7, 5, 6)),
    ]
    k_cases = [
        (r"b: expected length 4 to match a's columns \(K\); given shape \[5\] with a of shape \[3, 4\]",
         ones(3, 4), ones(5)),
        (r"b: expected 4 rows to match a's length \(K\); given shape \[2, 5, 3\] with a of shape \[4\]",
         ones(4), ones(2, 5, 3)),
        (r"b: expected length 4 to match a's length \(K\); given shape \[5\] with a of shape \[4\]",
         ones(4), ones(5)),
        (r"b: expected 5 rows to match a's columns \(K\); given shape \[3, 5, 6, 2\] with a of shape "
         r"\[3, 5, 4, 5\]", ones(3, 5, 4, 5), ones(3, 5, 6, 2)),
        (r"b: expected 4 rows to match a's columns \(K\); given shape \[5, 0\] with a of shape \[0, 4\]",
         ones(0, 4), ones(5, 0)),  # an empty result: still K's mismatch
    ]
    for pattern, a, b in shape_cases + (k_cases if device != "meta" else []):
        with pytest.raises(ValueError, match="optimized::matmul: " + pattern):
            optimized_ops.matmul(a, b)
    if device == "meta":
        for _, a, b in k_cases:
            assert optimized_ops.matmul(a, b).is_meta  # a shape all the same
        return
    with pytest.raises(ValueError, match=r"optimized::matmul: b: expected dtype fp32 \(same as a\); given fp64"):
        optimized_ops.matmul(ones(2, 3, 4), ones(4).double())


def test_cuda_tensors_with_a_cpu_only_build():
    if optimized_ops.built_with_cuda() or not torch.cuda.is_available():
        pytest.skip("needs CUDA tensors and a CPU-only build of the library")
    with pytest.raises(NotImplementedError, match="CUDA tensors given but this build is CPU-only"):
        optimized_ops.matmul(torch.ones(2, 2, device="cuda"), torch.ones(2, 2, device="cuda"))


# ---- loading ----------------------------------------------------------------------------------

def test_load_library_alone_in_a_fresh_python():
    """torch.ops.load_library on the .so, without this package, exposes torch.ops.optimized.matmul."""
    script = textwrap.dedent(f"""
        import torch
        torch.ops.load_library({optimized_ops.library_path()!r})
        a, b = torch.randn(6, 5), torch.randn(5, 4)
        out = torch.ops.optimized.matmul(a, b)
        assert torch.allclose(out, a @ b, atol=1e-5), (out, a @ b)
        print("schema:", torch.ops.optimized.matmul.default._schema)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "optimized::matmul(Tensor a, Tensor b, *, str variant=\"auto\") -> Tensor" in result.stdout


def test_variant_listing():
    names = optimized_ops.variants()
    assert names[:3] == ["cpu_naive", "cpu_blocked", "cpu_packed"] and "auto" not in names
    assert optimized_ops.variant_supports("auto", torch.float32, "cpu") == (True, "")
    ok, why = optimized_ops.variant_supports("cpu_packed", torch.float16, "cuda")
    assert not ok and "variant: cpu_packed runs on the CPU" in why
    ok, why = optimized_ops.variant_supports("nope", torch.float16, "cpu")
    assert not ok and "variant: expected one of" in why
