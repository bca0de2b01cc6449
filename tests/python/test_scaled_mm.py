"""optimized_ops.scaled_mm / torch.ops.optimized.scaled_mm (the scaled fp8 GEMM) against a float64
reference of the dequantized inputs: every scale layout (explicit, and read from the scale's shape),
every fp8 pair the op takes, every output dtype, bias, b column-major (w.t(), torch._scaled_mm's
convention) and row-major, strided and padded operands, odd sizes (1, primes, K not a multiple of
128), empty dimensions; against torch._scaled_mm on CUDA where the device runs it; opcheck,
torch.compile, CUDA graphs, the current stream, no autograd, and every error path.

The bound (src/testing/scaled_gemm_reference.h): per element
    |out - ref| <= u_out * |ref| + floor_out + 8 * (sqrt(P) * 2^-13 + sqrt(K) * 2^-24) * magnitude
with ref = deq(a) @ deq(b) + bias in float64, magnitude = sum_k |deq(a)_ik deq(b)_kj| (+ |bias_j|, the
float32 addition of the bias), P = min(128, K): Hopper's fp8 tensor cores add with ~14 bits of
mantissa between the promotions into float32 every 128 of K."""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import optimized_ops
from conftest import CUDA_REASON, gemm_allowed_error, requires_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LAYOUTS = ["tensor", "rowwise", "block_1x128", "block_128x128"]
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

HOPPER = not CUDA_REASON and torch.cuda.get_device_capability() == (9, 0)
requires_hopper = pytest.mark.skipif(
    not HOPPER, reason=CUDA_REASON or "wgmma_fp8 runs on compute capability 9.0 only (an H100); given "
                                      f"{'.'.join(map(str, torch.cuda.get_device_capability())) if not CUDA_REASON else ''}")

# (device, variant): auto and every rung of the device.
RUNGS = [
    pytest.param("cpu", "auto", id="cpu-auto"),
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cuda", "auto", id="cuda-auto", marks=requires_cuda),
    pytest.param("cuda", "naive", id="cuda-naive", marks=requires_cuda),
    pytest.param("cuda", "wgmma_fp8", id="cuda-wgmma_fp8", marks=[requires_cuda, requires_hopper]),
]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=requires_cuda)]

# (M, K, N): ones, primes, K below, at and across 128 (not a multiple), M and N across one block of 128.
SHAPES = [(1, 1, 1), (1, 129, 17), (13, 127, 1), (17, 13, 31), (37, 257, 53), (130, 200, 129)]


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _mkn(s):
    return "x".join(map(str, s))


def blocks(x: int) -> int:
    return (x + 127) // 128


# ---- inputs and the float64 reference -----------------------------------------------------------

def fp8(shape, dtype, device, rng, amp: float = 8.0) -> torch.Tensor:
    """Values uniform in [-amp, amp), rounded to the fp8 dtype (made on the CPU: reproducible)."""
    x = (torch.rand(shape, generator=rng, dtype=torch.float64) * 2 - 1) * amp
    return x.to(dtype).to(device)


def scales(shape, device, rng) -> torch.Tensor:
    """float32 scales in [1/4, 2)."""
    return (torch.rand(shape, generator=rng, dtype=torch.float64) * 1.75 + 0.25).float().to(device)


def scale_shape(layout: str, is_a: bool, m: int, k: int, n: int) -> tuple:
    """The shape of each layout that 'auto' reads as that layout (or one that means the same)."""
    kb = blocks(k)
    return {
        "tensor": (),
        "rowwise": (m, 1) if is_a else (1, n),
        "block_1x128": (m, kb) if is_a else (n, kb),
        "block_128x128": (blocks(m), kb) if is_a else (kb, blocks(n)),
    }[layout]


def scale_matrix(s: torch.Tensor, layout: str, rows: int, cols: int, is_a: bool) -> torch.Tensor:
    """The float64 scale of every element of the (rows, cols) operand (A: (M, K); B: (K, N))."""
    s = s.detach().cpu().double().reshape(-1)
    k = cols if is_a else rows
    if layout == "tensor":
        return s[0].expand(rows, cols)
    if layout == "rowwise":
        return s.reshape(rows, 1).expand(rows, cols) if is_a else s.reshape(1, cols).expand(rows, cols)
    if layout == "block_1x128":
        outer = rows if is_a else cols
        per_k = s.reshape(outer, blocks(k)).repeat_interleave(128, dim=1)[:, :k]  # (outer, K)
        return per_k if is_a else per_k.t()
    assert layout == "block_128x128", layout
    return (s.reshape(blocks(rows), blocks(cols)).repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
            [:rows, :cols])


def reference(a, b, sa, la, sb, lb, bias=None):
    """(ref, magnitude) in float64: deq(a) @ deq(b) + bias and sum_k |products| (+ |bias|)."""
    m, k = a.shape
    n = b.shape[1]
    da = a.detach().cpu().double() * scale_matrix(sa, la, m, k, True)
    db = b.detach().cpu().double() * scale_matrix(sb, lb, k, n, False)
    ref, mag = da @ db, da.abs() @ db.abs()
    if bias is not None:
        bias64 = bias.detach().cpu().double()
        ref, mag = ref + bias64, mag + bias64.abs()
    return ref, mag


def error_ratio(out, a, b, sa, la, sb, lb, bias=None) -> float:
    """Worst |out - ref| / allowed over all elements (the bound in the module's docstring); <= 1 passes."""
    k = a.shape[1]
    ref, mag = reference(a, b, sa, la, sb, lb, bias)
    assert tuple(out.shape) == tuple(ref.shape), f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    allowed = gemm_allowed_error(out.dtype, k, ref, mag) + 8.0 * math.sqrt(min(128, k)) * 2.0**-13 * mag
    err = (out.detach().cpu().double() - ref).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / allowed)
    if torch.isnan(ratio).any():
        return math.inf
    return ratio.max().item() if ratio.numel() else 0.0


def check(out, a, b, sa, la, sb, lb, bias=None, what=""):
    ratio = error_ratio(out, a, b, sa, la, sb, lb, bias)
    assert ratio <= 1.0, f"{what}: worst error / allowed = {ratio}"


def refuses_block_1x128_b(variant: str, lb: str) -> bool:
    """wgmma_fp8 takes B's scales per tensor, per column or per 128x128 block only."""
    return variant == "wgmma_fp8" and lb == "block_1x128"


# ---- every layout pair, explicit and inferred -------------------------------------------------------

@pytest.mark.parametrize("device,variant", RUNGS)
@pytest.mark.parametrize("shape", SHAPES, ids=_mkn)
@pytest.mark.parametrize("lb", LAYOUTS)
@pytest.mark.parametrize("la", LAYOUTS)
def test_every_scale_layout_against_float64(device, variant, shape, la, lb, rng):
    m, k, n = shape
    a = fp8((m, k), E4M3, device, rng)
    b = fp8((n, k), E4M3, device, rng).t()  # (K, N) column-major: mat2 = w.t()
    sa = scales(scale_shape(la, True, m, k, n), device, rng)
    sb = scales(scale_shape(lb, False, m, k, n), device, rng)
    explicit = dict(scale_a_layout=la, scale_b_layout=lb, variant=variant)
    if refuses_block_1x128_b(variant, lb):
        with pytest.raises(NotImplementedError, match=r"optimized::scaled_mm: scale_b: wgmma_fp8 takes B's scales"):
            optimized_ops.scaled_mm(a, b, sa, sb, **explicit)
        out_explicit = None
    else:
        out_explicit = optimized_ops.scaled_mm(a, b, sa, sb, **explicit)
        assert out_explicit.dtype == torch.bfloat16 and out_explicit.device == a.device
        assert out_explicit.is_contiguous()
        check(out_explicit, a, b, sa, la, sb, lb, what=f"{variant} explicit {la} x {lb}")
    # The same scales with the layouts read from their shapes: the same values (on the rungs whose
    # arithmetic does not depend on where a scale is applied, bit for bit). A (N, ceil(K/128)) scale_b
    # is read as block_1x128 where K > 128 (with K <= 128, (N, 1) is rowwise), which wgmma_fp8 refuses.
    if refuses_block_1x128_b(variant, lb) and blocks(k) > 1:
        with pytest.raises(NotImplementedError, match=r"optimized::scaled_mm: scale_b: wgmma_fp8 takes B's scales"):
            optimized_ops.scaled_mm(a, b, sa, sb, variant=variant)
        return
    out_auto = optimized_ops.scaled_mm(a, b, sa, sb, variant=variant)
    check(out_auto, a, b, sa, la, sb, lb, what=f"{variant} inferred {la} x {lb}")
    if out_explicit is not None and (device == "cpu" or variant == "naive"):
        assert torch.equal(out_auto, out_explicit)


@pytest.mark.parametrize("device,variant", RUNGS)
@pytest.mark.parametrize("shape", [(512, 4096, 384), (777, 1000, 999)], ids=_mkn)
@pytest.mark.parametrize("layouts", [("rowwise", "rowwise"), ("block_1x128", "block_128x128"),
                                     ("block_128x128", "tensor")], ids=lambda l: f"{l[0]}-{l[1]}")
def test_large_shapes(device, variant, shape, layouts, rng):
    """Many tiles (the Hopper rung's persistent grid and clusters, ragged last tiles), and K = 4096
    (32 promotions of the partial sums)."""
    m, k, n = shape
    la, lb = layouts
    a, b = fp8((m, k), E4M3, device, rng), fp8((n, k), E4M3, device, rng).t()
    sa = scales(scale_shape(la, True, m, k, n), device, rng)
    sb = scales(scale_shape(lb, False, m, k, n), device, rng)
    out = optimized_ops.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, variant=variant)
    check(out, a, b, sa, la, sb, lb, what=f"{variant} {la} x {lb}")


# Shapes 'auto' must read as the layout named: (scale_a shape, scale_b shape, la, lb), for
# M = 5, K = 300 (3 blocks of K), N = 7.
INFERENCE_CASES = [
    ((), (), "tensor", "tensor"),
    ((1,), (1, 1), "tensor", "tensor"),
    ((1, 1, 1), (1,), "tensor", "tensor"),
    ((5, 1), (1, 7), "rowwise", "rowwise"),
    ((5,), (7,), "rowwise", "rowwise"),
    ((5, 3), (7, 3), "block_1x128", "block_1x128"),
    ((1, 3), (3, 1), "block_128x128", "block_128x128"),
    ((5, 3), (3, 1), "block_1x128", "block_128x128"),
    ((1, 3), (7, 3), "block_128x128", "block_1x128"),
    ((5,), (3, 1), "rowwise", "block_128x128"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", INFERENCE_CASES, ids=lambda c: f"{_mkn(c[0]) or 'scalar'}-{_mkn(c[1]) or 'scalar'}")
def test_layout_inference(device, case, rng):
    shape_a, shape_b, la, lb = case
    m, k, n = 5, 300, 7
    a, b = fp8((m, k), E4M3, device, rng), fp8((n, k), E4M3, device, rng).t()
    sa, sb = scales(shape_a, device, rng), scales(shape_b, device, rng)
    variant = "auto" if device == "cpu" else "naive"  # naive: the same arithmetic for every layout
    out = optimized_ops.scaled_mm(a, b, sa, sb, variant=variant)
    explicit = optimized_ops.scaled_mm(a, b, sa, sb, scale_a_layout=la, scale_b_layout=lb, variant=variant)
    assert torch.equal(out, explicit)
    check(out, a, b, sa, la, sb, lb, what=f"{shape_a} x {shape_b}")


@pytest.mark.parametrize("device", DEVICES)
def test_inference_where_shapes_coincide(device, rng):
    """Shapes that fit two layouts name the same scales; 'auto' takes the first (tensor, rowwise, then
    for scale_a block_1x128 before block_128x128), and a (N, 1) scale_b with K <= 128 as rowwise."""
    variant = "auto" if device == "cpu" else "naive"
    # M = 1: scale_a (1, ceil(K/128)) is both block_1x128 and block_128x128.
    a, b = fp8((1, 300), E4M3, device, rng), fp8((9, 300), E4M3, device, rng).t()
    sa, sb = scales((1, 3), device, rng), scales((9,), device, rng)
    out = optimized_ops.scaled_mm(a, b, sa, sb, variant=variant)
    for la in ("block_1x128", "block_128x128"):
        assert torch.equal(out, optimized_ops.scaled_mm(a, b, sa, sb, scale_a_layout=la, variant=variant))
    # K <= 128: scale_a (M, 1) is rowwise and block_1x128; scale_b (N, 1) block_1x128, read as rowwise.
    a, b = fp8((6, 100), E4M3, device, rng), fp8((9, 100), E4M3, device, rng).t()
    sa, sb = scales((6, 1), device, rng), scales((9, 1), device, rng)
    out = optimized_ops.scaled_mm(a, b, sa, sb, variant=variant)
    for la, lb in (("rowwise", "rowwise"), ("block_1x128", "block_1x128")):
        assert torch.equal(out, optimized_ops.scaled_mm(a, b, sa, sb, scale_a_layout=la, scale_b_layout=lb,
                                                        variant=variant))
    check(out, a, b, sa, "rowwise", sb, "rowwise")


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_layouts_take_any_shape_of_the_count(device, rng):
    """An explicit layout overrides the shape: the scale needs only the element count."""
    m, k, n = 6, 260, 10
    a, b = fp8((m, k), E4M3, device, rng), fp8((n, k), E4M3, device, rng).t()
    sa = scales((m * 3,), device, rng)        # block_1x128 of A, flattened
    sb = scales((3, 1, 1), device, rng)       # block_128x128 of B: (ceil(K/128), ceil(N/128)) = (3, 1)
    out = optimized_ops.scaled_mm(a, b, sa, sb, scale_a_layout="block_1x128", scale_b_layout="block_128x128",
                                  out_dtype=torch.float32)
    check(out, a, b, sa, "block_1x128", sb, "block_128x128")
    # The same values as the inferable shapes.
    again = optimized_ops.scaled_mm(a, b, sa.reshape(m, 3), sb.reshape(3, 1), out_dtype=torch.float32)
    if device == "cpu":
        assert torch.equal(out, again)
    check(again, a, b, sa, "block_1x128", sb, "block_128x128")
    # A tensor-wise scale given as (1, 1): explicit "tensor"; rowwise scales of another shape.
    out = optimized_ops.scaled_mm(a, b, scales((1, 1), device, rng), scales((n, 1, 1), device, rng),
                                  scale_a_layout="tensor", scale_b_layout="rowwise")
    assert out.shape == (m, n)


# ---- fp8 pairs, output dtypes, bias ---------------------------------------------------------------

PAIRS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]


@pytest.mark.parametrize("device,variant", RUNGS)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{_dt(p[0])}x{_dt(p[1])}")
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=_dt)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("layouts", [("tensor", "tensor"), ("rowwise", "rowwise"), ("block_1x128", "block_128x128")],
                         ids=lambda l: f"{l[0]}-{l[1]}")
def test_dtypes_and_bias(device, variant, pair, out_dtype, with_bias, layouts, rng):
    m, k, n = 33, 300, 47
    la, lb = layouts
    a = fp8((m, k), pair[0], device, rng)
    b = fp8((n, k), pair[1], device, rng).t()
    sa = scales(scale_shape(la, True, m, k, n), device, rng)
    sb = scales(scale_shape(lb, False, m, k, n), device, rng)
    bias = (torch.rand(n, generator=rng, dtype=torch.float64) * 20 - 10).to(out_dtype).to(device) if with_bias else None
    out = optimized_ops.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype, variant=variant)
    assert out.dtype == out_dtype and out.shape == (m, n)
    check(out, a, b, sa, la, sb, lb, bias, what=f"{variant} {pair} -> {out_dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_out_dtype_defaults_to_bfloat16_and_none_is_the_default(device, rng):
    a, b = fp8((4, 32), E4M3, device, rng), fp8((8, 32), E4M3, device, rng).t()
    one = torch.ones((), device=device)
    assert optimized_ops.scaled_mm(a, b, one, one).dtype == torch.bfloat16
    out = torch.ops.optimized.scaled_mm(a, b, one, one)  # out_dtype=None
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, optimized_ops.scaled_mm(a, b, one, one))


# ---- operand layouts ------------------------------------------------------------------------------

def _operand_views(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x (R, C) as a view of the given storage kind (the values of x, another layout)."""
    r, c = x.shape
    if kind == "row":          # contiguous
        return x.contiguous()
    if kind == "col":          # column-major: the transpose of a contiguous (C, R)
        return x.t().contiguous().t()
    if kind == "padded":       # row-major with rows wider than C (a slice of a wider tensor)
        wide = torch.zeros(r, c + 13, dtype=x.dtype, device=x.device)
        wide[:, 3:3 + c] = x
        return wide[:, 3:3 + c]
    if kind == "strided":      # neither: every other column (copied before the kernel)
        wide = torch.zeros(r, 2 * c, dtype=x.dtype, device=x.device)
        wide[:, ::2] = x
        return wide[:, ::2]
    raise AssertionError(kind)


@pytest.mark.parametrize("device,variant", RUNGS)
@pytest.mark.parametrize("a_kind", ["row", "col", "padded", "strided"])
@pytest.mark.parametrize("b_kind", ["col", "row", "padded", "strided"])
@pytest.mark.parametrize("shape", [(17, 200, 23), (64, 256, 128)], ids=_mkn)
def test_operand_layouts(device, variant, a_kind, b_kind, shape, rng):
    """b as w.t() (column-major, torch._scaled_mm's convention) and as a row-major (K, N) tensor, a
    row- and column-major, padded rows (passed as they are) and other strides (copied)."""
    m, k, n = shape
    a = _operand_views(fp8((m, k), E4M3, device, rng), a_kind)
    b = _operand_views(fp8((k, n), E5M2, device, rng), b_kind)
    sa, sb = scales((m, 1), device, rng), scales((blocks(k), blocks(n)), device, rng)
    out = optimized_ops.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, variant=variant)
    check(out, a, b, sa, "rowwise", sb, "block_128x128", what=f"{variant} a {a_kind}, b {b_kind}")
    if device == "cpu":  # the CPU rung's arithmetic does not depend on the layout
        same = optimized_ops.scaled_mm(a.contiguous(), b.contiguous(), sa, sb, out_dtype=torch.float32,
                                       variant=variant)
        assert torch.equal(out, same)


@pytest.mark.parametrize("device", DEVICES)
def test_scales_and_bias_are_made_contiguous(device, rng):
    m, k, n = 9, 260, 11
    a, b = fp8((m, k), E4M3, device, rng), fp8((n, k), E4M3, device, rng).t()
    sa = scales((3, m), device, rng).t()                # (M, 3) block_1x128, transposed storage
    sb = scales((1, 2 * n), device, rng)[:, ::2]        # (1, N) rowwise, strided
    bias = torch.randn(2 * n, generator=torch.Generator().manual_seed(0)).to(device)[::2]
    out = optimized_ops.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    check(out, a, b, sa, "block_1x128", sb, "rowwise", bias)


@pytest.mark.parametrize("device", DEVICES)
def test_output_is_fresh_and_inputs_untouched(device, rng):
    a, b = fp8((7, 40), E4M3, device, rng), fp8((5, 40), E4M3, device, rng).t()
    sa, sb = scales((7, 1), device, rng), scales((1, 5), device, rng)
    copies = [t.clone() for t in (a, b, sa, sb)]
    out1 = optimized_ops.scaled_mm(a, b, sa, sb)
    out2 = optimized_ops.scaled_mm(a, b, sa, sb)
    assert out1.data_ptr() != out2.data_ptr()
    for before, after in zip(copies, (a, b, sa, sb)):
        assert torch.equal(before.view(torch.uint8) if before.element_size() == 1 else before,
                           after.view(torch.uint8) if after.element_size() == 1 else after)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_dimensions(device, rng):
    one = torch.ones((), device=device)
    e = dict(device=device, dtype=E4M3)
    assert optimized_ops.scaled_mm(torch.empty(0, 32, **e), torch.empty(32, 5, **e), one, one).shape == (0, 5)
    assert optimized_ops.scaled_mm(torch.empty(4, 32, **e), torch.empty(32, 0, **e), one, one).shape == (4, 0)
    # K = 0: an empty sum, the bias alone.
    out = optimized_ops.scaled_mm(torch.empty(4, 0, **e), torch.empty(0, 5, **e), one, one, out_dtype=torch.float32)
    assert torch.equal(out, torch.zeros(4, 5, device=device))
    bias = torch.arange(5, dtype=torch.float16, device=device)
    out = optimized_ops.scaled_mm(torch.empty(4, 0, **e), torch.empty(0, 5, **e), one, one, bias=bias,
                                  out_dtype=torch.float16)
    assert torch.equal(out, bias.expand(4, 5))


# ---- agreement with torch._scaled_mm ---------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("variant", ["auto", "naive", pytest.param("wgmma_fp8", marks=requires_hopper)])
@pytest.mark.parametrize("scaling", ["tensor", "rowwise"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=_dt)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_agrees_with_torch_scaled_mm(variant, scaling, out_dtype, with_bias, rng):
    m, k, n = 64, 256, 96  # multiples of 16: what torch._scaled_mm takes
    a, w = fp8((m, k), E4M3, "cuda", rng), fp8((n, k), E4M3, "cuda", rng)
    if scaling == "tensor":
        sa, sb = scales((), "cuda", rng), scales((), "cuda", rng)
    else:
        sa, sb = scales((m, 1), "cuda", rng), scales((1, n), "cuda", rng)
    bias = torch.randn(n, generator=rng).to(out_dtype).cuda() if with_bias else None
    try:
        expected = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        pytest.skip(f"torch._scaled_mm does not run this on {torch.cuda.get_device_name()}: {str(e)[:200]}")
    out = optimized_ops.scaled_mm(a, w.t(), sa, sb, bias=bias, out_dtype=out_dtype, variant=variant)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    # Both within the bound of the float64 reference, so within twice it of each other.
    check(out, a, w.t(), sa, scaling, sb, scaling, bias, what=f"{variant} (ours)")
    check(expected, a, w.t(), sa, scaling, sb, scaling, bias, what="torch._scaled_mm")


# ---- the torch ops: variants, opcheck, fake kernel, compile ---------------------------------------

def test_variants_are_the_table():
    assert optimized_ops.scaled_gemm_variants() == ["cpu", "naive", "wgmma_fp8"]
    assert list(torch.ops.optimized.scaled_gemm_variants()) == ["cpu", "naive", "wgmma_fp8"]
    names = optimized_ops.scaled_gemm_variants()
    names.append("mine")
    assert "mine" not in optimized_ops.scaled_gemm_variants()


def test_variant_names_are_what_scaled_mm_takes():
    a, b = torch.ones(3, 4, dtype=E4M3), torch.ones(4, 5, dtype=E4M3)
    one = torch.ones(())
    for name in optimized_ops.scaled_gemm_variants():
        if name == "cpu":
            out = optimized_ops.scaled_mm(a, b, one, one, out_dtype=torch.float32, variant=name)
            assert torch.equal(out, torch.full((3, 5), 4.0))
        else:  # parsed, then refused for CPU tensors
            with pytest.raises(ValueError, match=rf"optimized::scaled_mm: variant: {name} runs on CUDA tensors"):
                optimized_ops.scaled_mm(a, b, one, one, variant=name)


OPCHECK_CASES = [  # (M, K, N, scale_a shape, scale_b shape, bias, b column-major)
    (5, 7, 3, (), (), False, True),
    (16, 300, 9, (16, 1), (1, 9), True, True),
    (7, 260, 130, (7, 3), (3, 2), True, False),
    (1, 129, 1, (1,), (1,), False, False),
]


# opcheck's test_schema compares every input before and after the op with torch.allclose, which torch
# does not implement for fp8 ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): the other
# utils run here, and test_output_is_fresh_and_inputs_untouched checks what test_schema would (no input
# mutated, a fresh output).
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}")
def test_opcheck(device, case, rng):
    m, k, n, shape_a, shape_b, with_bias, b_col = case
    a = fp8((m, k), E4M3, device, rng)
    b = fp8((n, k), E5M2, device, rng).t() if b_col else fp8((k, n), E5M2, device, rng)
    sa, sb = scales(shape_a, device, rng), scales(shape_b, device, rng)
    kwargs = {"bias": torch.randn(n, generator=rng).to(device) if with_bias else None,
              "out_dtype": torch.float32 if with_bias else None}
    op = torch.ops.optimized.scaled_mm.default
    torch.library.opcheck(op, (a, b, sa, sb), kwargs, test_utils=OPCHECK_UTILS)
    torch.library.opcheck(op, (a, b, sa, sb), {"out_dtype": torch.float16, "scale_a_layout": "auto", "variant": "auto"},
                          test_utils=OPCHECK_UTILS)
    # With inputs that require grad (the scales, the bias): an autograd kernel is registered (the one
    # that raises in backward; test_aot_dispatch_dynamic would trace that backward: test_no_backward).
    kwargs["bias"] = None if kwargs["bias"] is None else kwargs["bias"].requires_grad_()
    torch.library.opcheck(op, (a, b, sa.requires_grad_(), sb), kwargs,
                          test_utils=("test_autograd_registration", "test_faketensor"))


def test_fake_kernel_shapes_and_errors():
    meta = dict(device="meta")
    a, b = torch.empty(3, 40, dtype=E4M3, **meta), torch.empty(40, 5, dtype=E4M3, **meta)
    s = torch.empty((), **meta)
    out = optimized_ops.scaled_mm(a, b, s, s)
    assert out.shape == (3, 5) and out.dtype == torch.bfloat16 and out.device.type == "meta"
    assert optimized_ops.scaled_mm(a, b, s, s, out_dtype=torch.float32).dtype == torch.float32
    # What the shape and dtype are computed from: 2-D operands, K, out_dtype, one device.
    with pytest.raises(ValueError, match=r"optimized::scaled_mm: a: expected a 2-D tensor \(M, K\); given shape \[2, 3, 40\]"):
        optimized_ops.scaled_mm(torch.empty(2, 3, 40, dtype=E4M3, **meta), b, s, s)
    with pytest.raises(ValueError, match=r"optimized::scaled_mm: b: expected 40 rows to match a's columns \(K\)"):
        optimized_ops.scaled_mm(a, torch.empty(41, 5, dtype=E4M3, **meta), s, s)
    with pytest.raises(NotImplementedError, match=r"optimized::scaled_mm: out_dtype: expected float32, float16 or "
                                                  r"bfloat16; given float64"):
        optimized_ops.scaled_mm(a, b, s, s, out_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"optimized::scaled_mm: scale_b: expected device meta \(same as a\); given cpu"):
        optimized_ops.scaled_mm(a, b, s, torch.ones(()))


def _model(x, w, sx, sw, bias):
    y = optimized_ops.scaled_mm(x, w.t(), sx, sw, bias=bias, out_dtype=torch.float32)
    return torch.relu(y) * 2


def test_torch_compile_fullgraph_cpu(rng):
    torch._dynamo.reset()
    m, k, n = 24, 200, 40
    x, w = fp8((m, k), E4M3, "cpu", rng), fp8((n, k), E4M3, "cpu", rng)
    sx, sw = scales((m, 2), "cpu", rng), scales((2, 1), "cpu", rng)
    bias = torch.randn(n, generator=rng)
    explanation = torch._dynamo.explain(_model)(x, w, sx, sw, bias)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(_model, fullgraph=True)
    torch.testing.assert_close(compiled(x, w, sx, sw, bias), _model(x, w, sx, sw, bias), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_dynamic_shapes(device, rng):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda x, w, sx, sw: optimized_ops.scaled_mm(x, w.t(), sx, sw) * 2, backend=counter,
                       fullgraph=True, dynamic=True)
    for m, k, n in ((5, 64, 3), (11, 300, 17), (6, 130, 4)):
        x, w = fp8((m, k), E4M3, device, rng), fp8((n, k), E4M3, device, rng)
        sx, sw = scales((m, 1), device, rng), scales((1, n), device, rng)
        torch.testing.assert_close(fn(x, w, sx, sw), optimized_ops.scaled_mm(x, w.t(), sx, sw) * 2, rtol=0, atol=0)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for one pattern"


def test_torch_export(rng):
    class Model(torch.nn.Module):
        def forward(self, x, w, sx, sw):
            return torch.relu(optimized_ops.scaled_mm(x, w.t(), sx, sw, out_dtype=torch.float32))

    m, k, n = 8, 130, 6
    args = (fp8((m, k), E4M3, "cpu", rng), fp8((n, k), E4M3, "cpu", rng), scales((m, 1), "cpu", rng),
            scales((1, n), "cpu", rng))
    program = torch.export.export(Model(), args)
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert torch.ops.optimized.scaled_mm.default in targets
    torch.testing.assert_close(program.module()(*args), Model()(*args), rtol=0, atol=0)


# ---- no autograd -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_no_backward(device, rng):
    """The fp8 GEMM has no backward: the forward runs with inputs that require grad, and backward
    through it raises, naming the op, instead of returning silent zeros."""
    m, k, n = 4, 64, 6
    a, b = fp8((m, k), E4M3, device, rng), fp8((n, k), E4M3, device, rng).t()
    sa, sb = scales((m, 1), device, rng).requires_grad_(), scales((1, n), device, rng)
    bias = torch.randn(n, generator=rng).to(device).requires_grad_()
    out = optimized_ops.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    check(out, a, b, sa, "rowwise", sb, "rowwise", bias)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"derivative for optimized::scaled_mm is not implemented: the scaled "
                                           r"\(fp8\) GEMM has no backward"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match=r"derivative for optimized::scaled_mm is not implemented"):
        torch.autograd.grad(optimized_ops.scaled_mm(a, b, sa.detach(), sb, bias=bias, out_dtype=torch.float32).sum(),
                            bias)
    # Forward mode: a tangent on a scale.
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=r"derivative for optimized::scaled_mm is not "
                                                              r"implemented: the scaled \(fp8\) GEMM has no "
                                                              r"forward-mode derivative"):
        optimized_ops.scaled_mm(a, b, fwAD.make_dual(sa.detach(), torch.ones_like(sa)), sb)
    # Without inputs that require grad, or under no_grad: a plain tensor, no autograd node.
    with torch.no_grad():
        out = optimized_ops.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
        assert not out.requires_grad and out.grad_fn is None
    out = optimized_ops.scaled_mm(a, b, sa.detach(), sb)
    assert not out.requires_grad and out.grad_fn is None


def test_compiling_a_backward_raises_as_for_torch_scaled_mm(rng):
    """As torch._scaled_mm: a compiled graph whose inputs require grad traces the backward, which
    raises while compiling; under no_grad (inference) it compiles."""
    torch._dynamo.reset()
    x, w = fp8((8, 64), E4M3, "cpu", rng), fp8((4, 64), E4M3, "cpu", rng)
    sx, sw = scales((8, 1), "cpu", rng), scales((1, 4), "cpu", rng)
    bias = torch.randn(4, generator=rng).requires_grad_()
    fn = torch.compile(_model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"derivative for optimized::scaled_mm is not implemented"):
        fn(x, w, sx, sw, bias)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(fn(x, w, sx, sw, bias), _model(x, w, sx, sw, bias), rtol=0, atol=0)


# ---- CUDA: graphs, streams ----------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("variant", ["auto", "naive", pytest.param("wgmma_fp8", marks=requires_hopper)])
@pytest.mark.parametrize("b_kind", ["col", "row"])
def test_cuda_graph_capture_and_replay(variant, b_kind, rng):
    """Captured and replayed on new inputs in the same memory; a row-major b takes wgmma_fp8's workspace
    path (a K-major copy, in a workspace from torch's caching allocator)."""
    m, k, n = 200, 320, 136
    a = fp8((m, k), E4M3, "cuda", rng)
    b = _operand_views(fp8((k, n), E4M3, "cuda", rng), b_kind)
    sa, sb = scales((m, blocks(k)), "cuda", rng), scales((blocks(k), blocks(n)), "cuda", rng)
    bias = torch.randn(n, generator=rng).to(torch.bfloat16).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch recommends
        optimized_ops.scaled_mm(a, b, sa, sb, bias=bias, variant=variant)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = optimized_ops.scaled_mm(a, b, sa, sb, bias=bias, variant=variant)
    for _ in range(2):
        a.copy_(fp8(a.shape, E4M3, "cuda", rng))
        b.copy_(fp8(b.shape, E4M3, "cuda", rng))
        sa.copy_(scales(sa.shape, "cuda", rng))
        graph.replay()
        torch.cuda.synchronize()
        check(out, a, b, sa, "block_1x128", sb, "block_128x128", bias, what=f"{variant} after replay")


@requires_cuda
def test_runs_on_the_current_stream(rng):
    """Work queued on a side stream (a long sleep, then new values into a) must precede the op."""
    m, k, n = 256, 512, 128
    a, b = fp8((m, k), E4M3, "cuda", rng), fp8((n, k), E4M3, "cuda", rng).t()
    new_a = fp8((m, k), E4M3, "cuda", rng)
    sa, sb = scales((), "cuda", rng), scales((), "cuda", rng)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        a.copy_(new_a)
        out = optimized_ops.scaled_mm(a, b, sa, sb)
    side.synchronize()
    check(out, new_a, b, sa, "tensor", sb, "tensor")


@requires_cuda
@pytest.mark.skipif(CUDA_REASON == "" and torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_device_guard_second_gpu(rng):
    a, b = fp8((33, 64), E4M3, "cuda:1", rng), fp8((9, 64), E4M3, "cuda:1", rng).t()
    sa, sb = scales((), "cuda:1", rng), scales((), "cuda:1", rng)
    with torch.cuda.device(0):
        out = optimized_ops.scaled_mm(a, b, sa, sb)
    assert out.device == a.device
    torch.cuda.synchronize(1)
    check(out, a, b, sa, "tensor", sb, "tensor")


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_name_the_argument(device, rng):
    m, k, n = 5, 300, 7
    a, b = fp8((m, k), E4M3, device, rng), fp8((n, k), E4M3, device, rng).t()
    one = torch.ones((), device=device)
    sm = lambda *s: torch.ones(s, device=device)  # noqa: E731
    op = "optimized::scaled_mm: "
    cases = [
        # scale shapes that name no layout: the argument, and the shapes it takes
        (ValueError, op + r"scale_a: expected a shape that names a scale layout \(M = 5, K = 300, N = 7\): one "
                          r"element \(tensor\), \(M, 1\) = \[5, 1\] or \(M,\) = \[5\] \(rowwise\), \(M, ceil\(K/128\)\) = "
                          r"\[5, 3\] \(block_1x128\), \(ceil\(M/128\), ceil\(K/128\)\) = \[1, 3\] \(block_128x128\), or "
                          r"pass scale_a_layout; given shape \[4, 1\]",
         lambda: optimized_ops.scaled_mm(a, b, sm(4, 1), one)),
        (ValueError, op + r"scale_b: expected a shape that names a scale layout .*\(1, N\) = \[1, 7\] or \(N,\) = \[7\] "
                          r"\(rowwise\), \(N, ceil\(K/128\)\) = \[7, 3\] \(block_1x128\), \(ceil\(K/128\), "
                          r"ceil\(N/128\)\) = \[3, 1\] \(block_128x128\), or pass scale_b_layout; given shape \[7, 1\]",
         lambda: optimized_ops.scaled_mm(a, b, one, sm(7, 1))),
        (ValueError, op + r"scale_b: expected a shape that names a scale layout .* given shape \[5\]",
         lambda: optimized_ops.scaled_mm(a, b, one, sm(5))),
        # an explicit layout whose count the scale does not have: the C++ API's words
        (ValueError, op + r"scale_a: expected 5 scales for layout rowwise \(M = 5\)",
         lambda: optimized_ops.scaled_mm(a, b, sm(7), one, scale_a_layout="rowwise")),
        (ValueError, op + r"scale_b: expected 3 scales for layout block_128x128 \(\(3, 1\)\)",
         lambda: optimized_ops.scaled_mm(a, b, one, sm(7), scale_b_layout="block_128x128")),
        (ValueError, op + r"scale_a_layout: expected one of auto, tensor, rowwise, block_1x128, block_128x128; "
                          r"given 'row'",
         lambda: optimized_ops.scaled_mm(a, b, one, one, scale_a_layout="row")),
        (ValueError, op + r"scale_b_layout: expected one of auto, .*; given 'blockwise'",
         lambda: optimized_ops.scaled_mm(a, b, one, one, scale_b_layout="blockwise")),
        # scale dtypes
        (ValueError, op + r"scale_a: expected dtype fp32; given bf16",
         lambda: optimized_ops.scaled_mm(a, b, one.bfloat16(), one)),
        (ValueError, op + r"scale_b: expected dtype fp32; given fp64",
         lambda: optimized_ops.scaled_mm(a, b, one, one.double())),
        # operand dtypes
        (NotImplementedError, op + r"b: expected fp8_e4m3 when a is fp8_e5m2 \(e5m2 x e5m2 is not a supported "
                                   r"combination",
         lambda: optimized_ops.scaled_mm(a.to(E5M2), b.to(E5M2), one, one)),
        (NotImplementedError, op + r"a: expected dtype fp8_e4m3 or fp8_e5m2; given fp32",
         lambda: optimized_ops.scaled_mm(a.float(), b, one, one)),
        (NotImplementedError, op + r"b: expected dtype fp8_e4m3 or fp8_e5m2; given bf16",
         lambda: optimized_ops.scaled_mm(a, b.bfloat16(), one, one)),
        (NotImplementedError, op + r"a: expected a dtype of the library \(.*\); given int8",
         lambda: optimized_ops.scaled_mm(torch.ones(m, k, dtype=torch.int8, device=device), b, one, one)),
        # out_dtype, bias
        (NotImplementedError, op + r"out_dtype: expected float32, float16 or bfloat16; given float64",
         lambda: optimized_ops.scaled_mm(a, b, one, one, out_dtype=torch.float64)),
        (ValueError, op + r"bias: expected dtype bf16 \(c's\); given fp32",
         lambda: optimized_ops.scaled_mm(a, b, one, one, bias=torch.ones(n, device=device))),
        (ValueError, op + r"bias: expected dtype fp32 \(c's\); given bf16",
         lambda: optimized_ops.scaled_mm(a, b, one, one, bias=torch.ones(n, device=device, dtype=torch.bfloat16),
                                         out_dtype=torch.float32)),
        (ValueError, op + r"bias: expected 7 contiguous elements \(N\)",
         lambda: optimized_ops.scaled_mm(a, b, one, one, bias=torch.ones(n + 1, device=device, dtype=torch.bfloat16))),
        # shapes
        (ValueError, op + r"a: expected a 2-D tensor \(M, K\); given shape \[300\]",
         lambda: optimized_ops.scaled_mm(a[0], b, one, one)),
        (ValueError, op + r"b: expected a 2-D tensor \(K, N\); given shape \[1, 300, 7\]",
         lambda: optimized_ops.scaled_mm(a, b.unsqueeze(0), one, one)),
        (ValueError, op + r"b: expected 300 rows to match a's columns \(K\); given shape \[299, 7\] with a of "
                          r"shape \[5, 300\]",
         lambda: optimized_ops.scaled_mm(a, b[1:], one, one)),
        # variants
        (ValueError, op + r"variant: expected one of .*given 'fastest'",
         lambda: optimized_ops.scaled_mm(a, b, one, one, variant="fastest")),
    ]
    if device == "cpu":
        cases.append((ValueError, op + r"variant: wgmma_fp8 runs on CUDA tensors; given tensors on cpu",
                      lambda: optimized_ops.scaled_mm(a, b, one, one, variant="wgmma_fp8")))
    else:
        cases += [
            (ValueError, op + r"variant: cpu runs on the CPU tensors; given tensors on cuda",
             lambda: optimized_ops.scaled_mm(a, b, one, one, variant="cpu")),
            (ValueError, op + r"scale_a: expected device cuda:0 \(the operands'\); given cpu",
             lambda: optimized_ops.scaled_mm(a, b, torch.ones(()), one)),
            (ValueError, op + r"b: expected device cuda:0 \(same as a\); given cpu",
             lambda: optimized_ops.scaled_mm(a, b.cpu(), one, one)),
        ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()


@requires_cuda
@requires_hopper
def test_wgmma_fp8_refuses_block_1x128_scale_b(rng):
    a, b = fp8((64, 256), E4M3, "cuda", rng), fp8((32, 256), E4M3, "cuda", rng).t()
    sa, sb = scales((64, 2), "cuda", rng), scales((32, 2), "cuda", rng)
    with pytest.raises(NotImplementedError, match=r"optimized::scaled_mm: scale_b: wgmma_fp8 takes B's scales per "
                                                  r"tensor, per column or per 128x128 block; given block_1x128"):
        optimized_ops.scaled_mm(a, b, sa, sb, variant="wgmma_fp8")
    out = optimized_ops.scaled_mm(a, b, sa, sb)  # auto: the naive rung takes it
    check(out, a, b, sa, "block_1x128", sb, "block_1x128")


@requires_cuda
@pytest.mark.skipif(HOPPER, reason="the device is an H100: wgmma_fp8 runs")
def test_wgmma_fp8_refused_off_hopper(rng):
    a, b = fp8((64, 256), E4M3, "cuda", rng), fp8((32, 256), E4M3, "cuda", rng).t()
    one = torch.ones((), device="cuda")
    with pytest.raises(NotImplementedError, match=r"optimized::scaled_mm: variant: wgmma_fp8"):
        optimized_ops.scaled_mm(a, b, one, one, variant="wgmma_fp8")
