"""The fused memory-bound ops (optimized_ops.softmax, log_softmax, layer_norm, rms_norm, add_layer_norm,
add_rms_norm, gelu, bias_gelu, silu_and_mul; torch.ops.optimized.*_fwd / *_bwd) against
torch.nn.functional and a float64 reference: every dtype and variant, forward and backward, odd
and N-D shapes, strided views, gradcheck and gradgradcheck, opcheck, torch.compile, CUDA graphs,
the nn modules, NaN / Inf, and every error path.

Tolerance (design.md, flash-attention's rule): error(ours vs float64) <= 2 * error(torch in the same
dtype vs float64) + rounding noise, where float64 is torch itself run in float64 and the noise is
two units of the output dtype's rounding plus float32 accumulation over the reduced length."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import optimized_ops
from conftest import DEVICES, accumulation_unit, rand, reduction_allowed_error, requires_cuda

ops = torch.ops.optimized

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def variants_on(device: str) -> list[str]:
    """'auto' and the rungs of the device: cpu on the CPU; unfused, fused_streaming, fused_registers on CUDA."""
    return ["auto"] + [v for v in optimized_ops.fused_variants() if (v == "cpu") == (device == "cpu")]


def dtypes_on(device: str) -> list[torch.dtype]:
    return ALL_DTYPES if device == "cpu" else ALL_DTYPES[:3]  # float64 runs on the cpu variant only


def _device_variant_dtype_params():
    for device in DEVICES:
        dev = device if isinstance(device, str) else device.values[0]
        marks = () if isinstance(device, str) else device.marks
        for dtype in dtypes_on(dev):
            for variant in variants_on(dev):
                yield pytest.param(dev, dtype, variant, marks=marks, id=f"{dev}-{_dname(dtype)}-{variant}")


# ---- the ops under test ---------------------------------------------------------------------------
# Each case builds its inputs for rows of a given width, calls ours (with a variant) and torch's
# (in any dtype, for the same-dtype and the float64 references); outputs are tuples.

@dataclass(frozen=True)
class Case:
    name: str
    op: str  # the C++ op (fused_registers_max_width)
    make: Callable  # (rows, width, dtype, device, rng) -> dict of input tensors
    ours: Callable  # (inputs, variant) -> tuple of outputs
    ref: Callable  # (inputs, dtype of the test) -> tuple of outputs, computed in the inputs' dtype
    # The magnitudes of the terms each input gradient is made of (name -> float, from float64 inputs
    # and output gradients): the scale of the rounding noise where terms cancel and the result is
    # far smaller than they are (a norm over a row of width 1, a softmax row with near-constant dy).
    terms: Callable = None
    norm: bool = False  # the backward reads the forward's statistics (float32; float64 for float64)


def _f32(v: float) -> float:
    """v rounded to float32, as the float32 math sees it (float64 inputs take eps and scale as given)."""
    return float(torch.tensor(v, dtype=torch.float32))


def _norm_terms(layer: bool, eps):
    """dx is rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w, and xhat carries the
    rounding of the float32 mean and rstd relative to |h| * rstd; dweight sums dy * xhat over rows."""
    def fn(i, g, dtype):
        h = i["x"] + i["r"] if "r" in i else i["x"]
        c = h - h.mean(-1, keepdim=True) if layer else h
        rstd = (c.pow(2).mean(-1, keepdim=True) + _f32(eps(dtype) if callable(eps) else eps)).rsqrt()
        hr = (h.abs() * rstd).max().clamp(min=1).item()  # |h| * rstd: what xhat's error is relative to
        gw = g[0] * i["w"] if "w" in i else g[0]
        dx = 3 * (rstd * gw.abs()).max().item() * hr
        dw = 3 * (g[0].abs() * h.abs() * rstd).sum(0).max().item()
        return dict(x=dx, r=dx, w=dw)
    return fn


def _softmax_terms(log: bool, scale: float):
    def fn(i, g, dtype):
        y = (F.log_softmax if log else F.softmax)(i["x"] * scale, -1)
        if log:
            return dict(x=scale * (g[0].abs().max() + (y.exp() * g[0].abs().sum(-1, keepdim=True)).max()).item())
        return dict(x=2 * scale * (y * g[0].abs().max()).max().item())
    return fn


def _x(rows, width, dtype, device, rng):
    return dict(x=rand((rows, width), dtype, device, rng))


def _x_w(rows, width, dtype, device, rng):
    return dict(x=rand((rows, width), dtype, device, rng), w=rand((width,), dtype, device, rng))


def _x_w_b(rows, width, dtype, device, rng):
    return dict(x=rand((rows, width), dtype, device, rng), w=rand((width,), dtype, device, rng),
                b=rand((width,), dtype, device, rng))


def _x_r_w(rows, width, dtype, device, rng):
    return dict(x=rand((rows, width), dtype, device, rng), r=rand((rows, width), dtype, device, rng),
                w=rand((width,), dtype, device, rng))


def _x_r_w_b(rows, width, dtype, device, rng):
    return dict(_x_r_w(rows, width, dtype, device, rng), b=rand((width,), dtype, device, rng))


def _x_b(rows, width, dtype, device, rng):
    return dict(x=rand((rows, width), dtype, device, rng) * 3, b=rand((width,), dtype, device, rng))


def _x2(rows, width, dtype, device, rng):
    return dict(x=rand((rows, 2 * width), dtype, device, rng) * 4)


def _rms_eps(dtype):
    return torch.finfo(dtype).eps  # torch's default for eps=None, from the dtype under test


def _silu_mul(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


CASES = [
    Case("softmax", "softmax", _x, lambda i, v: (optimized_ops.softmax(i["x"], -1, variant=v),),
         lambda i, d: (F.softmax(i["x"], -1),), _softmax_terms(False, 1.0)),
    Case("softmax_scaled", "softmax", _x, lambda i, v: (optimized_ops.softmax(i["x"], 1, scale=0.375, variant=v),),
         lambda i, d: (F.softmax(i["x"] * 0.375, 1),), _softmax_terms(False, 0.375)),
    Case("log_softmax", "log_softmax", _x, lambda i, v: (optimized_ops.log_softmax(i["x"], -1, variant=v),),
         lambda i, d: (F.log_softmax(i["x"], -1),), _softmax_terms(True, 1.0)),
    Case("log_softmax_scaled", "log_softmax", _x,
         lambda i, v: (optimized_ops.log_softmax(i["x"], -1, scale=2.5, variant=v),),
         lambda i, d: (F.log_softmax(i["x"] * 2.5, -1),), _softmax_terms(True, 2.5)),
    Case("layer_norm", "layer_norm", _x_w_b,
         lambda i, v: (optimized_ops.layer_norm(i["x"], i["x"].shape[-1:], i["w"], i["b"], 2**-17, variant=v),),
         lambda i, d: (F.layer_norm(i["x"], i["x"].shape[-1:], i["w"], i["b"], 2**-17),), _norm_terms(True, 2**-17),
         norm=True),
    Case("layer_norm_weight_only", "layer_norm", _x_w,
         lambda i, v: (optimized_ops.layer_norm(i["x"], i["x"].shape[-1], i["w"], eps=2**-10, variant=v),),
         lambda i, d: (F.layer_norm(i["x"], i["x"].shape[-1:], i["w"], None, 2**-10),), _norm_terms(True, 2**-10),
         norm=True),
    Case("layer_norm_no_affine", "layer_norm", _x,
         lambda i, v: (optimized_ops.layer_norm(i["x"], i["x"].shape[-1:], variant=v),),
         lambda i, d: (F.layer_norm(i["x"], i["x"].shape[-1:], eps=1e-5),), _norm_terms(True, 1e-5), norm=True),
    Case("rms_norm", "rms_norm", _x_w,
         lambda i, v: (optimized_ops.rms_norm(i["x"], i["x"].shape[-1:], i["w"], variant=v),),
         lambda i, d: (F.rms_norm(i["x"], i["x"].shape[-1:], i["w"], _rms_eps(d)),), _norm_terms(False, _rms_eps),
         norm=True),
    Case("rms_norm_no_weight", "rms_norm", _x,
         lambda i, v: (optimized_ops.rms_norm(i["x"], [i["x"].shape[-1]], eps=2**-20, variant=v),),
         lambda i, d: (F.rms_norm(i["x"], i["x"].shape[-1:], None, 2**-20),), _norm_terms(False, 2**-20), norm=True),
    Case("add_layer_norm", "add_layer_norm", _x_r_w_b,
         lambda i, v: optimized_ops.add_layer_norm(i["x"], i["r"], i["x"].shape[-1:], i["w"], i["b"], variant=v),
         lambda i, d: (F.layer_norm(i["x"] + i["r"], i["x"].shape[-1:], i["w"], i["b"], 1e-5), i["x"] + i["r"]),
         _norm_terms(True, 1e-5), norm=True),
    Case("add_rms_norm", "add_rms_norm", _x_r_w,
         lambda i, v: optimized_ops.add_rms_norm(i["x"], i["r"], i["x"].shape[-1:], i["w"], variant=v),
         lambda i, d: (F.rms_norm(i["x"] + i["r"], i["x"].shape[-1:], i["w"], _rms_eps(d)), i["x"] + i["r"]),
         _norm_terms(False, _rms_eps), norm=True),
    Case("gelu", "bias_gelu", _x2, lambda i, v: (optimized_ops.gelu(i["x"], variant=v),),
         lambda i, d: (F.gelu(i["x"]),)),
    Case("gelu_tanh", "bias_gelu", _x2, lambda i, v: (optimized_ops.gelu(i["x"], "tanh", variant=v),),
         lambda i, d: (F.gelu(i["x"], approximate="tanh"),)),
    Case("bias_gelu", "bias_gelu", _x_b, lambda i, v: (optimized_ops.bias_gelu(i["x"], i["b"], variant=v),),
         lambda i, d: (F.gelu(i["x"] + i["b"]),)),
    Case("bias_gelu_tanh", "bias_gelu", _x_b,
         lambda i, v: (optimized_ops.bias_gelu(i["x"], i["b"], approximate="tanh", variant=v),),
         lambda i, d: (F.gelu(i["x"] + i["b"], approximate="tanh"),)),
    Case("silu_and_mul", "silu_and_mul", _x2, lambda i, v: (optimized_ops.silu_and_mul(i["x"], variant=v),),
         lambda i, d: (_silu_mul(i["x"]),)),
]
CASE_BY_NAME = {c.name: c for c in CASES}

# (rows, width): one element, one row, width 1, primes, a row longer than a block's threads.
SHAPES = [(1, 1), (1, 7), (5, 1), (3, 13), (6, 257), (2, 1031), (3, 4099)]


# ---- the comparison --------------------------------------------------------------------------------

def assert_parity(ours: torch.Tensor, theirs: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, n: int,
                  what: str, terms: float = 0.0, acc_unit: float = None) -> None:
    """ours and theirs (torch, same dtype) against ref (float64) under the fused family's one rule
    (reduction_allowed_error: src/testing/tolerance.h, mirrored in bench/tolerance.py): max |ours - ref|
    within 2 * max |theirs - ref| plus the dtype's rounding of max |ref| and the accumulation noise over
    n terms (float32's unit, float64's for float64 unless `acc_unit` says otherwise) relative to
    max |ref| or `terms`, the magnitude of what was summed, where larger."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert ours.dtype == dtype, f"{what}: dtype {ours.dtype} != {dtype}"
    if ref.numel() == 0:
        return
    ours64, theirs64, ref64 = (t.detach().double().cpu() for t in (ours, theirs, ref))
    assert torch.isfinite(ours64).all(), f"{what}: non-finite values {ours64[~torch.isfinite(ours64)][:5].tolist()}"
    if acc_unit is None:
        acc_unit = accumulation_unit(dtype)
    err = (ours64 - ref64).abs().max().item()
    err_torch = (theirs64 - ref64).abs().max().item()
    max_ref = ref64.abs().max().item()
    allowed = reduction_allowed_error(dtype, n, err_torch, max_ref, terms, acc_unit)
    assert err <= allowed, (
        f"{what}: max error {err:.3g} vs torch's {err_torch:.3g} (allowed {allowed:.3g}; "
        f"max |ref| {max_ref:.3g}, terms {terms:.3g})")


def _run(case: Case, inputs: dict, variant: str, dtype: torch.dtype, grads_out=None, rng=None):
    """Forward and backward of ours, of torch in the same dtype and of torch in float64; returns
    ((ours, torch, ref) outputs, (ours, torch, ref) input gradients)."""
    results = []
    for kind in ("ours", "torch", "ref"):
        leaves = {k: (t.detach().double() if kind == "ref" else t.detach()).requires_grad_()
                  for k, t in inputs.items()}
        out = case.ours(leaves, variant) if kind == "ours" else case.ref(leaves, dtype)
        if grads_out is None:
            grads_out = [rand(o.shape, dtype, o.device, rng) for o in out]
        gs = [g.double() if kind == "ref" else g for g in grads_out]
        grads = torch.autograd.grad(out, list(leaves.values()), gs)
        results.append((out, dict(zip(leaves, grads))))
    return (*results, grads_out)


def check_case(case: Case, inputs: dict, variant: str, dtype: torch.dtype, rng, n: int, label: str = "") -> None:
    """Outputs and input gradients of ours against torch and float64; n: the longest reduction
    (the row width, or the rows summed into a weight or bias gradient)."""
    (o_out, o_grad), (t_out, t_grad), (r_out, r_grad), grads_out = _run(case, inputs, variant, dtype, rng=rng)
    assert len(o_out) == len(r_out)
    for k, (o, t, r) in enumerate(zip(o_out, t_out, r_out)):
        assert_parity(o, t, r, dtype, n, f"{label}{case.name} output {k}")
    i64 = {k: t.detach().double() for k, t in inputs.items()}
    terms = case.terms(i64, [g.double() for g in grads_out], dtype) if case.terms else {}
    # The norms' backward reads float32 statistics (float64 ones for float64): float32's unit there.
    acc_unit = 2.0**-24 if case.norm and dtype != torch.float64 else None
    for name in inputs:
        assert_parity(o_grad[name], t_grad[name], r_grad[name], dtype, n, f"{label}{case.name} d{name}",
                      terms=terms.get(name, 0.0), acc_unit=acc_unit)


def _skip_if_too_wide(case: Case, variant: str, dtype: torch.dtype, width: int) -> None:
    if variant == "fused_registers":
        limit = optimized_ops.fused_registers_max_width(case.op, dtype)
        if limit and width > limit:
            pytest.skip(f"width {width} beyond fused_registers' {limit} (test_fused_registers_too_wide)")


# ---- parity: every op, dtype, variant and odd shape --------------------------------------------------

@pytest.mark.parametrize("device,dtype,variant", list(_device_variant_dtype_params()))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity_forward_backward(case, shape, device, dtype, variant, rng):
    rows, width = shape
    _skip_if_too_wide(case, variant, dtype, width)
    inputs = case.make(rows, width, dtype, device, rng)
    check_case(case, inputs, variant, dtype, rng, max(rows, width))


@requires_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES[:3], ids=_dname)
@pytest.mark.parametrize("case", [c for c in CASES if c.op in ("softmax", "layer_norm", "rms_norm", "add_rms_norm")],
                         ids=lambda c: c.name)
def test_long_rows_cuda(case, dtype, rng):
    """Rows beyond what fused_registers holds (forward and backward): auto switches to
    fused_streaming, both give the right answer, and fused_registers says why it cannot."""
    limit = optimized_ops.fused_registers_max_width(case.op, dtype)
    width = limit + 8  # rows stay 16-byte aligned, where the limit applies
    assert optimized_ops.resolve_fused_variant(case.op, dtype, "cuda", width) == "fused_streaming"
    assert optimized_ops.resolve_fused_variant(case.op, dtype, "cuda", 1024) == "fused_registers"
    inputs = case.make(2, width, dtype, "cuda", rng)
    for variant in ("auto", "fused_streaming", "unfused"):
        check_case(case, inputs, variant, dtype, rng, width, label=f"{variant}: ")
    with pytest.raises(NotImplementedError, match=rf"fused_registers holds rows up to {limit}"):
        case.ours(inputs, "fused_registers")


@requires_cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES[:3], ids=_dname)
def test_fused_registers_too_wide(dtype, rng):
    limit = optimized_ops.fused_registers_max_width("layer_norm", dtype)
    x = rand((2, limit + 1), dtype, "cuda", rng)
    with pytest.raises(NotImplementedError, match=r"fused_registers holds rows up to .*use fused_streaming or auto"):
        optimized_ops.layer_norm(x, limit + 1, variant="fused_registers")
    assert optimized_ops.fused_registers_max_width("silu_and_mul", dtype) == 0  # no row reduction: any width


@pytest.mark.parametrize("device,dtype,variant", list(_device_variant_dtype_params()))
def test_backward_ops_called_directly(device, dtype, variant, rng):
    """Every *_bwd op with the variant itself (the autograd path maps fused_registers to auto in the
    backward), against float64 autograd of torch and torch's same-dtype gradients."""
    width = 300
    x = rand((5, width), dtype, device, rng)
    dy = rand((5, width), dtype, device, rng)

    def torch_grads(fn, *leaves, dtype_of):
        ls = [t.detach().to(dtype_of).requires_grad_() for t in leaves]
        out = fn(*ls)
        return torch.autograd.grad(out, ls, dy.to(dtype_of))

    def check(got, fn, leaves, what, norm=False):
        theirs = torch_grads(fn, *leaves, dtype_of=dtype)
        ref = torch_grads(fn, *leaves, dtype_of=torch.float64)
        terms = {}
        if norm:  # the magnitudes of the terms (see Case.terms); float32 statistics
            terms = _norm_terms("layer" in what, 1e-5)(dict(x=leaves[0].double(), w=leaves[1].double()),
                                                       [dy.double()], dtype)
        for g, t, r, name in zip(got, theirs, ref, ("x", "w", "b")):
            assert_parity(g, t, r, dtype, width, f"{what} d{name}", terms=terms.get(name, 0.0),
                          acc_unit=2.0**-24 if norm and dtype != torch.float64 else None)

    for log in (False, True):
        y = (F.log_softmax if log else F.softmax)(x.double(), -1).to(dtype)
        bwd = ops.log_softmax_bwd if log else ops.softmax_bwd
        dx = bwd(y, dy, -1, 1.0, variant=variant)
        # the same gradient from the float64 formula, on the rounded y the op saw
        y64 = y.double()
        ref = dy.double() - y64.exp() * dy.double().sum(-1, keepdim=True) if log else \
            y64 * (dy.double() - (dy.double() * y64).sum(-1, keepdim=True))
        theirs = torch._log_softmax_backward_data(dy, y, -1, dtype) if log else \
            torch._softmax_backward_data(dy, y, -1, dtype)
        assert_parity(dx, theirs, ref, dtype, width, f"{'log_' if log else ''}softmax_bwd")

    w, b = rand((width,), dtype, device, rng), rand((width,), dtype, device, rng)
    _, _, mean, rstd = ops.layer_norm_fwd(x, None, [width], w, b, 1e-5, variant="auto")
    got = ops.layer_norm_bwd(dy, x, [width], w, mean, rstd, None, True, True, variant=variant)
    check(got, lambda x, w, b: F.layer_norm(x, (width,), w, b, 1e-5), (x, w, b), "layer_norm_bwd", norm=True)
    _, _, rstd = ops.rms_norm_fwd(x, None, [width], w, 1e-5, variant="auto")
    got = ops.rms_norm_bwd(dy, x, [width], w, rstd, None, True, variant=variant)
    check(got, lambda x, w: F.rms_norm(x, (width,), w, 1e-5), (x, w), "rms_norm_bwd", norm=True)
    for approximate in ("none", "tanh"):
        got = ops.bias_gelu_bwd(dy, x, b, approximate, True, variant=variant)
        check(got, lambda x, b: F.gelu(x + b, approximate=approximate), (x, b), f"bias_gelu_bwd {approximate}")
    x2 = rand((5, 2 * width), dtype, device, rng)
    got = (ops.silu_and_mul_bwd(dy, x2, variant=variant),)
    check(got, _silu_mul, (x2,), "silu_and_mul_bwd")


# ---- shapes and layouts ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
def test_n_dimensional_inputs(device, dtype, rng):
    x = rand((2, 3, 5, 7), dtype, device, rng)
    r = rand((2, 3, 5, 7), dtype, device, rng)
    w, b = rand((5, 7), dtype, device, rng), rand((5, 7), dtype, device, rng)

    def check(name, fn, ref_fn, *tensors):
        got = fn(*tensors)
        got = got if isinstance(got, tuple) else (got,)
        theirs = ref_fn(*tensors)
        ref = ref_fn(*(t.double() for t in tensors))
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        ref = ref if isinstance(ref, tuple) else (ref,)
        for k, (o, t, f) in enumerate(zip(got, theirs, ref)):
            assert_parity(o, t, f, dtype, 35, f"{name} output {k}")

    # normalized_shape over two trailing dimensions, flattened into rows of 35
    check("layer_norm (5, 7)", lambda x, w, b: optimized_ops.layer_norm(x, (5, 7), w, b),
          lambda x, w, b: F.layer_norm(x, (5, 7), w, b), x, w, b)
    check("rms_norm (5, 7)", lambda x, w: optimized_ops.rms_norm(x, (5, 7), w, 1e-6),
          lambda x, w: F.rms_norm(x, (5, 7), w, 1e-6), x, w)
    check("add_layer_norm (5, 7)", lambda x, r, w, b: optimized_ops.add_layer_norm(x, r, (5, 7), w, b),
          lambda x, r, w, b: (F.layer_norm(x + r, (5, 7), w, b), x + r), x, r, w, b)
    check("add_rms_norm (5, 7)", lambda x, r, w: optimized_ops.add_rms_norm(x, r, (5, 7), w, 1e-6),
          lambda x, r, w: (F.rms_norm(x + r, (5, 7), w, 1e-6), x + r), x, r, w)
    # softmax over every dimension (the last in place; the others moved last)
    for dim in range(-4, 4):
        check(f"softmax dim {dim}", lambda x: optimized_ops.softmax(x, dim), lambda x: F.softmax(x, dim), x)
        check(f"log_softmax dim {dim}", lambda x: optimized_ops.log_softmax(x, dim),
              lambda x: F.log_softmax(x, dim), x)
    check("bias_gelu 4-D", lambda x, b: optimized_ops.bias_gelu(x, b), lambda x, b: F.gelu(x + b), x, b[0])
    check("silu_and_mul 4-D", optimized_ops.silu_and_mul, _silu_mul, rand((2, 3, 4, 10), dtype, device, rng))
    assert optimized_ops.silu_and_mul(rand((2, 3, 4, 10), dtype, device, rng)).shape == (2, 3, 4, 5)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_other_dim_layout_and_gradient(device, rng):
    x = rand((6, 5, 4), torch.float32, device, rng).requires_grad_()
    y = optimized_ops.softmax(x, 1)
    assert y.shape == x.shape
    assert y.movedim(1, -1).is_contiguous()  # a permuted view of a buffer with dim 1 last
    torch.testing.assert_close(y, F.softmax(x, 1))
    g = rand(y.shape, torch.float32, device, rng)
    (ours,) = torch.autograd.grad(y, x, g)
    (theirs,) = torch.autograd.grad(F.softmax(x, 1), x, g)
    torch.testing.assert_close(ours, theirs)
    # 0-D input: one element in one dimension
    s = torch.tensor(3.0, device=device)
    assert optimized_ops.softmax(s, 0).shape == () and optimized_ops.softmax(s, -1).item() == 1.0
    assert optimized_ops.log_softmax(s, 0).item() == 0.0


def _strided_layouts(shape, dtype, device, rng):
    """(name, tensor) views of `shape` in the layouts the glue meets."""
    rows, width = shape
    yield "contiguous", rand(shape, dtype, device, rng)
    yield "row-padded slice", rand((rows, width + 5), dtype, device, rng)[:, :width]
    yield "offset slice (unaligned rows)", rand((rows, width + 1), dtype, device, rng)[:, 1:]
    yield "every other row", rand((2 * rows, width), dtype, device, rng)[::2]
    yield "transposed (copied)", rand((width, rows), dtype, device, rng).t()
    yield "expanded rows (copied)", rand((1, width), dtype, device, rng).expand(rows, width)
    yield "3-D strided batch", rand((rows, 2, width), dtype, device, rng)[:, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_strided_inputs(case, device, dtype, rng):
    """Non-contiguous inputs of every kind, x and residual, forward and backward; inputs untouched."""
    rows, width = 7, 67
    for name, view in _strided_layouts((rows, 2 * width if case.make is _x2 else width), dtype, device, rng):
        inputs = case.make(rows, width, dtype, device, rng)
        inputs["x"] = view
        if "r" in inputs:
            inputs["r"] = rand((rows, 3 * width), dtype, device, rng)[:, width:2 * width]
        before = {k: t.clone() for k, t in inputs.items()}
        check_case(case, inputs, "auto", dtype, rng, width, label=f"{name}: ")
        for k, t in inputs.items():
            assert torch.equal(t, before[k]), f"{name}: input {k} changed"


@pytest.mark.parametrize("device", DEVICES)
def test_strided_gradients_and_leading_dims_collapse(device, rng):
    """A view whose leading dimensions collapse into one row stride goes to the kernel as it is;
    the result equals that of its contiguous copy, bit for bit (same rows, same kernel)."""
    base = rand((4, 3, 40), torch.float32, device, rng)
    x = base[:, :, :32]  # rows 40 apart, leading dims (4, 3) collapse to 12 rows
    for fn in (lambda t: optimized_ops.rms_norm(t, 32), lambda t: optimized_ops.softmax(t, -1),
               lambda t: optimized_ops.layer_norm(t, 32), lambda t: optimized_ops.gelu(t)):
        assert torch.equal(fn(x), fn(x.contiguous()))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_inputs(device):
    f32 = dict(device=device, dtype=torch.float32)
    assert optimized_ops.softmax(torch.empty(0, 5, **f32), -1).shape == (0, 5)
    assert optimized_ops.softmax(torch.empty(3, 0, **f32), -1).shape == (3, 0)
    assert optimized_ops.layer_norm(torch.empty(0, 5, **f32), 5).shape == (0, 5)
    y, h = optimized_ops.add_rms_norm(torch.empty(0, 4, 5, **f32), torch.empty(0, 4, 5, **f32), 5)
    assert y.shape == h.shape == (0, 4, 5)
    assert optimized_ops.gelu(torch.empty(0, **f32)).shape == (0,)
    assert optimized_ops.silu_and_mul(torch.empty(2, 0, **f32)).shape == (2, 0)
    # gradients of parameters over no rows are zeros
    x = torch.empty(0, 5, **f32, requires_grad=True)
    w = torch.ones(5, **f32, requires_grad=True)
    b = torch.ones(5, **f32, requires_grad=True)
    gx, gw, gb = torch.autograd.grad(optimized_ops.layer_norm(x, 5, w, b).sum(), (x, w, b))
    assert gx.shape == (0, 5) and torch.equal(gw, torch.zeros(5, **f32)) and torch.equal(gb, torch.zeros(5, **f32))
    (gbias,) = torch.autograd.grad(optimized_ops.bias_gelu(x, b).sum(), (b,))
    assert torch.equal(gbias, torch.zeros(5, **f32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
def test_rows_of_equal_values_and_width_one(device, dtype):
    x = torch.full((4, 32), 0.75, device=device, dtype=dtype)
    w = torch.linspace(-1, 1, 32, device=device, dtype=dtype)
    b = torch.linspace(2, 3, 32, device=device, dtype=dtype)
    for variant in variants_on(device):
        # zero variance: y = bias, no NaN (rstd = 1 / sqrt(eps))
        torch.testing.assert_close(optimized_ops.layer_norm(x, 32, w, b, variant=variant), b.expand(4, 32))
        torch.testing.assert_close(optimized_ops.softmax(x, -1, variant=variant), torch.full_like(x, 1 / 32))
        torch.testing.assert_close(optimized_ops.rms_norm(x, 32, eps=0.0, variant=variant), torch.ones_like(x))
    one = torch.tensor([[2.0], [-3.0]], device=device, dtype=dtype)
    assert torch.equal(optimized_ops.softmax(one, -1), torch.ones_like(one))
    assert torch.equal(optimized_ops.log_softmax(one, -1), torch.zeros_like(one))
    assert torch.equal(optimized_ops.layer_norm(one, 1), torch.zeros_like(one))


# ---- NaN and Inf -----------------------------------------------------------------------------------

def _nonfinite_cases():
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, nan, 0.5, -2.0], [inf, 1.0, 0.0, 3.0], [-inf, 1.0, 2.0, 0.5], [-inf, -inf, -inf, -inf],
            [0.25, -0.5, 1.0, 2.0]]
    x = torch.tensor(rows)
    yield "softmax", lambda t: optimized_ops.softmax(t, -1), lambda t: F.softmax(t, -1), x
    yield "log_softmax", lambda t: optimized_ops.log_softmax(t, -1), lambda t: F.log_softmax(t, -1), x
    yield "layer_norm", lambda t: optimized_ops.layer_norm(t, 4), lambda t: F.layer_norm(t, (4,)), x
    yield "rms_norm", lambda t: optimized_ops.rms_norm(t, 4, eps=1e-6), lambda t: F.rms_norm(t, (4,), eps=1e-6), x
    # Elementwise ops: NaN propagates element by element. Infinities through GELU are left out:
    # torch's own kernels disagree there (gelu(+-inf) is NaN on the CPU); silu(-inf) is NaN in both.
    xe = torch.tensor([[1.0, nan, 0.25, 0.5], [nan, 2.0, 1.0, -1.0]])
    yield "gelu", optimized_ops.gelu, F.gelu, xe
    a = torch.tensor([[1.0, nan, -inf, 0.5], [nan, 2.0, inf, -1.0]])
    b = torch.tensor([[1.0, 2.0, inf, nan], [3.0, 4.0, 5.0, 6.0]])
    yield "silu_and_mul", optimized_ops.silu_and_mul, _silu_mul, torch.cat([a, b], 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
def test_nan_and_inf_propagate_as_in_torch(device, dtype):
    for name, ours_fn, torch_fn, x in _nonfinite_cases():
        x = x.to(device=device, dtype=dtype)
        ours, theirs = ours_fn(x), torch_fn(x)
        assert torch.equal(torch.isnan(ours), torch.isnan(theirs)), f"{name}: NaN at {ours} vs torch {theirs}"
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), f"{name}: Inf at {ours} vs torch {theirs}"
        finite = torch.isfinite(theirs)
        torch.testing.assert_close(ours[finite], theirs[finite], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device,dtype,variant", [p for p in _device_variant_dtype_params()
                                                  if p.values[1] == torch.float32])
def test_nan_rows_every_variant(device, dtype, variant):
    """A NaN poisons its row (row ops) or its element (elementwise ops), in every variant."""
    x = torch.ones(3, 300, device=device, dtype=dtype)
    x[1, 17] = float("nan")
    for fn in (lambda t: optimized_ops.softmax(t, -1, variant=variant),
               lambda t: optimized_ops.layer_norm(t, 300, variant=variant),
               lambda t: optimized_ops.rms_norm(t, 300, variant=variant)):
        y = fn(x)
        assert torch.isnan(y[1]).all() and not torch.isnan(y[0]).any() and not torch.isnan(y[2]).any()
    y = optimized_ops.gelu(x, variant=variant)
    assert torch.isnan(y).sum().item() == 1 and torch.isnan(y[1, 17])


# ---- autograd --------------------------------------------------------------------------------------

# name: (ours, torch's, input names, norm: whether the backward reads the forward's statistics)
GRAD_FNS = {
    "softmax": (lambda x: optimized_ops.softmax(x, -1, scale=0.75, variant="cpu"),
                lambda x: F.softmax(x * 0.75, -1), ("x",), False),
    "softmax_dim0": (lambda x: optimized_ops.softmax(x, 0), lambda x: F.softmax(x, 0), ("x",), False),
    "log_softmax": (lambda x: optimized_ops.log_softmax(x, -1, scale=1.25, variant="cpu"),
                    lambda x: F.log_softmax(x * 1.25, -1), ("x",), False),
    "layer_norm": (lambda x, w, b: optimized_ops.layer_norm(x, 6, w, b, 2**-16, variant="cpu"),
                   lambda x, w, b: F.layer_norm(x, (6,), w, b, 2**-16), ("x", "w", "b"), True),
    "layer_norm_2d_shape": (lambda x, w: optimized_ops.layer_norm(x.view(5, 2, 3), (2, 3), w.view(2, 3), eps=2**-16),
                            lambda x, w: F.layer_norm(x.view(5, 2, 3), (2, 3), w.view(2, 3), eps=2**-16),
                            ("x", "w"), True),
    "rms_norm": (lambda x, w: optimized_ops.rms_norm(x, 6, w, 2**-16, variant="cpu"),
                 lambda x, w: F.rms_norm(x, (6,), w, 2**-16), ("x", "w"), True),
    "rms_norm_no_weight": (lambda x: optimized_ops.rms_norm(x, 6), lambda x: F.rms_norm(x, (6,)), ("x",), True),
    "add_layer_norm": (lambda x, r, w, b: optimized_ops.add_layer_norm(x, r, 6, w, b, 2**-16, variant="cpu"),
                       lambda x, r, w, b: (F.layer_norm(x + r, (6,), w, b, 2**-16), x + r), ("x", "r", "w", "b"),
                       True),
    "add_rms_norm": (lambda x, r, w: optimized_ops.add_rms_norm(x, r, 6, w, variant="cpu"),
                     lambda x, r, w: (F.rms_norm(x + r, (6,), w), x + r), ("x", "r", "w"), True),
    "gelu": (lambda x: optimized_ops.gelu(x, variant="cpu"), F.gelu, ("x",), False),
    "bias_gelu": (lambda x, b: optimized_ops.bias_gelu(x, b, variant="cpu"), lambda x, b: F.gelu(x + b),
                  ("x", "b"), False),
    "bias_gelu_tanh": (lambda x, b: optimized_ops.bias_gelu(x, b, "tanh"),
                       lambda x, b: F.gelu(x + b, approximate="tanh"), ("x", "b"), False),
    "silu_and_mul": (lambda x: optimized_ops.silu_and_mul(x, variant="cpu"), _silu_mul, ("x",), False),
}


def _grad_inputs(names, rng):
    shapes = dict(x=(5, 6), r=(5, 6), w=(6,), b=(6,))
    return tuple(rand(shapes[n], torch.float64, "cpu", rng).requires_grad_() for n in names)


@pytest.mark.parametrize("name", list(GRAD_FNS))
def test_gradcheck_float64(name, rng):
    """gradcheck in float64 with torch's default tolerances, on the library's own kernels: the cpu
    variant computes float64 in float64 (the norms' backward from float32 mean / rstd, see
    include/optimized/fused.h, well within gradcheck's tolerance)."""
    fn, _, names, _ = GRAD_FNS[name]
    assert torch.autograd.gradcheck(fn, _grad_inputs(names, rng))


@pytest.mark.parametrize("name", list(GRAD_FNS))
def test_gradgradcheck_float64(name, rng):
    """gradgradcheck: the double backward (the autograd of the *_bwd ops, torch's autograd on a
    composite formula, see fused/_autograd.py) against finite differences of the first backward (the
    kernels). The norms included: their first backward reads the float64 statistics a float64
    forward saves (float32 ones made its finite differences noise)."""
    fn, _, names, _ = GRAD_FNS[name]
    assert torch.autograd.gradgradcheck(fn, _grad_inputs(names, rng))


@pytest.mark.parametrize("name", list(GRAD_FNS))
def test_double_backward_against_torch(name, rng):
    """Second-order vector-Jacobian products of every op (all inputs and the incoming gradient)
    against torch's own double backward in float64."""
    fn, ref_fn, names, norm = GRAD_FNS[name]
    inputs = _grad_inputs(names, rng)
    results = []
    for f in (fn, ref_fn):
        out = f(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        gys = [rand(o.shape, torch.float64, "cpu", torch.Generator().manual_seed(k)).requires_grad_()
               for k, o in enumerate(out)]
        firsts = torch.autograd.grad(out, inputs, gys, create_graph=True)
        cots = [rand(g.shape, torch.float64, "cpu", torch.Generator().manual_seed(10 + k))
                for k, g in enumerate(firsts)]
        used = [(g, c) for g, c in zip(firsts, cots) if g.requires_grad]
        seconds = torch.autograd.grad([g for g, _ in used], (*inputs, *gys), [c for _, c in used], allow_unused=True)
        results.append([torch.zeros_like(t) if g is None else g for g, t in zip(seconds, (*inputs, *gys))])
    tol = 1e-5 if norm else 1e-10  # float32 statistics in the norms' backward
    for k, (got, want) in enumerate(zip(*results)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()),
                                   msg=lambda m: f"{name}: second-order gradient {k}: {m}")


def test_third_derivative_raises(rng):
    x = rand((3, 5), torch.float64, "cpu", rng).requires_grad_()
    (g,) = torch.autograd.grad(optimized_ops.layer_norm(x, 5).pow(2).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="a third derivative is not supported"):
        torch.autograd.grad(gg.sum(), x)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_only_where_needed_and_unused_outputs(device, rng):
    x = rand((4, 8), torch.float32, device, rng)
    r = rand((4, 8), torch.float32, device, rng)
    w = rand((8,), torch.float32, device, rng).requires_grad_()
    # weight only: x does not require grad
    (gw,) = torch.autograd.grad(optimized_ops.rms_norm(x, 8, w).sum(), (w,))
    w64 = w.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(F.rms_norm(x.double(), (8,), w64, torch.finfo(torch.float32).eps).sum(), (w64,))
    torch.testing.assert_close(gw.double(), ref, rtol=1e-5, atol=1e-5)
    # add form where only residual_out is used: x and residual get its gradient unchanged
    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
    _, h = optimized_ops.add_layer_norm(xg, rg, 8, w)
    g = rand((4, 8), torch.float32, device, rng)
    gx, gr, gw2 = torch.autograd.grad(h, (xg, rg, w), g, allow_unused=True)
    assert torch.equal(gx, g) and torch.equal(gr, g) and gw2 is None
    # the same tensor as x and residual: its gradient counts twice
    xs = x.clone().requires_grad_()
    y, h = optimized_ops.add_rms_norm(xs, xs, 8)
    (gs,) = torch.autograd.grad((y * g).sum() + h.sum(), (xs,))
    x64 = x.double().requires_grad_()
    h64 = x64 + x64
    (ref,) = torch.autograd.grad((F.rms_norm(h64, (8,), None, torch.finfo(torch.float32).eps) * g.double()).sum()
                                 + h64.sum(), (x64,))
    torch.testing.assert_close(gs.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_of_another_dtype_is_cast(device, rng):
    """float32 parameters with bfloat16 activations: the weight is cast to bfloat16 for the kernel,
    the output is bfloat16 (as F.layer_norm's), the weight's gradient arrives in float32."""
    x = rand((6, 64), torch.bfloat16, device, rng).requires_grad_()
    w = rand((64,), torch.float32, device, rng).requires_grad_()
    b = rand((64,), torch.float32, device, rng).requires_grad_()
    y = optimized_ops.layer_norm(x, 64, w, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.layer_norm(x, (64,), w.bfloat16(), b.bfloat16()))
    gx, gw, gb = torch.autograd.grad(y.float().sum(), (x, w, b))
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32 and gb.dtype == torch.float32
    assert optimized_ops.rms_norm(x, 64, w).dtype == torch.bfloat16
    assert optimized_ops.bias_gelu(x, b).dtype == torch.bfloat16
    # the torch op itself does not cast: it says what it expected
    with pytest.raises(ValueError, match=r"optimized::rms_norm_fwd: weight: expected dtype bf16; given fp32"):
        ops.rms_norm_fwd(x.detach(), None, [64], w.detach(), 1e-6)


def test_eps_defaults_follow_torch(rng):
    x = rand((3, 16), torch.bfloat16, "cpu", rng) * 1e-2  # small values: eps matters
    torch.testing.assert_close(optimized_ops.rms_norm(x, 16), F.rms_norm(x.float(), (16,), eps=torch.finfo(
        torch.bfloat16).eps).bfloat16(), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(optimized_ops.rms_norm(x, 16).float(), optimized_ops.rms_norm(x, 16, eps=1e-12).float())
    torch.testing.assert_close(optimized_ops.softmax(x, -1, dtype=torch.float32),
                               F.softmax(x, -1, dtype=torch.float32))


# ---- torch.library: opcheck, fake kernels, compile, export -------------------------------------------

def _opcheck_cases(device, dtype, rng):
    def t(*shape, grad=True):
        return rand(shape, dtype, device, rng).requires_grad_(grad)

    x, r, w, b = t(3, 4, 6), t(3, 4, 6), t(4, 6), t(4, 6)
    yield ops.softmax_fwd.default, (x, 1, 0.5), {"variant": "auto"}
    yield ops.log_softmax_fwd.default, (x, -1, 1.0), {}
    yield ops.layer_norm_fwd.default, (x, r, [4, 6], w, b, 1e-5), {}
    yield ops.layer_norm_fwd.default, (x, None, [6], None, None, 1e-5), {}
    yield ops.rms_norm_fwd.default, (x, r, [4, 6], w, 1e-5), {}
    yield ops.rms_norm_fwd.default, (x, None, [6], None, 1e-5), {}
    yield ops.bias_gelu_fwd.default, (x, b[0], "tanh"), {}
    yield ops.bias_gelu_fwd.default, (x, None, "none"), {}
    yield ops.silu_and_mul_fwd.default, (t(5, 8),), {}
    # backward ops, with operands as the forward saves them
    y = F.softmax(x.detach().float(), 1).to(dtype).requires_grad_()
    yield ops.softmax_bwd.default, (y, t(3, 4, 6), 1, 0.5), {}
    yield ops.log_softmax_bwd.default, (y.detach().log().requires_grad_(), t(3, 4, 6), 1, 1.0), {}
    _, h, mean, rstd = ops.layer_norm_fwd(x.detach(), r.detach(), [4, 6], w.detach(), b.detach(), 1e-5)
    yield ops.layer_norm_bwd.default, (t(3, 4, 6), h.requires_grad_(), [4, 6], w, mean, rstd, t(3, 4, 6), True,
                                       True), {}
    yield ops.layer_norm_bwd.default, (t(3, 4, 6), x, [4, 6], None, mean, rstd, None, False, False), {}
    _, _, rstd = ops.rms_norm_fwd(x.detach(), None, [6], w.detach()[0], 1e-5)
    yield ops.rms_norm_bwd.default, (t(3, 4, 6), x, [6], w[0], rstd, None, True), {}
    yield ops.bias_gelu_bwd.default, (t(3, 4, 6), x, b[0], "none", True), {}
    yield ops.bias_gelu_bwd.default, (t(3, 4, 6), x, None, "tanh", False), {}
    yield ops.silu_and_mul_bwd.default, (t(5, 4), t(5, 8)), {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
def test_opcheck_every_op(device, dtype, rng):
    seen = set()
    for op, args, kwargs in _opcheck_cases(device, dtype, rng):
        torch.library.opcheck(op, args, kwargs)
        seen.add(op.name())
    fused_ops = {f"optimized::{n}_{d}" for n in ("softmax", "log_softmax", "layer_norm", "rms_norm", "bias_gelu",
                                                 "silu_and_mul") for d in ("fwd", "bwd")}
    assert seen == fused_ops


def test_fake_kernels_on_meta_tensors():
    meta = dict(device="meta")
    x = torch.empty(2, 3, 4, 5, **meta)
    for dim in range(4):
        fake = ops.softmax_fwd(x, dim)
        real = ops.softmax_fwd(torch.zeros(2, 3, 4, 5), dim)
        assert fake.shape == real.shape and fake.stride() == real.stride()
    y, h, mean, rstd = ops.layer_norm_fwd(x, x, [4, 5], torch.empty(4, 5, **meta), None, 1e-5)
    assert y.shape == h.shape == x.shape and mean.shape == rstd.shape == (2, 3) and mean.dtype == torch.float32
    y, h, rstd = ops.rms_norm_fwd(x, None, [5], None, 1e-5)
    assert h is None and rstd.shape == (2, 3, 4)
    assert optimized_ops.silu_and_mul(x.new_empty(3, 8)).shape == (3, 4)
    dx, dw, db = ops.layer_norm_bwd(x, x, [5], None, rstd.new_empty(2, 3, 4), rstd.new_empty(2, 3, 4), None, False,
                                    True)
    assert dx.shape == x.shape and dw is None and db.shape == (5,)
    # What the output shapes are computed from raises in the fake, with the glue's words ...
    with pytest.raises(ValueError,
                       match=r"x: expected a shape ending in \[6\] \(normalized_shape\); given \[2, 3, 4, 5\]"):
        optimized_ops.layer_norm(x, 6)
    with pytest.raises(ValueError, match=r"x: expected an even last dimension"):
        optimized_ops.silu_and_mul(x)
    with pytest.raises(ValueError, match=r"optimized::softmax_fwd: dim: expected a dimension in \[-4, 3\]; given 4"):
        optimized_ops.softmax(x, 4)
    with pytest.raises(ValueError, match=r"optimized::layer_norm_fwd: weight: expected device meta \(same as x\); "
                                         r"given cpu"):
        ops.layer_norm_fwd(x, None, [5], torch.ones(5), None, 1e-5)
    # ... the rest is the C++ library's, checked when a kernel runs (under torch.compile: when the
    # compiled graph runs): a fake gives the outputs of any dtype, variant name, dy, weight or eps.
    assert optimized_ops.gelu(torch.empty(3, dtype=torch.int32, **meta)).dtype == torch.int32
    assert optimized_ops.softmax(x, -1, variant="fastest").shape == x.shape
    assert ops.softmax_bwd(x, x[..., :2], -1, 1.0).shape == x.shape
    assert optimized_ops.layer_norm(x, 5, torch.empty(7, **meta), eps=-1.0).shape == x.shape
    with pytest.raises(NotImplementedError, match=r"optimized::bias_gelu_fwd: x: expected dtype fp32, fp16, bf16"):
        optimized_ops.gelu(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"optimized::softmax_fwd: variant: expected one of auto, cpu, unfused"):
        optimized_ops.softmax(torch.ones(2, 3), -1, variant="fastest")


def _model(x, r, w, b, bias):
    y, h = optimized_ops.add_rms_norm(x, r, 16, w)
    z = optimized_ops.layer_norm(y, 16, w, b)
    z = optimized_ops.bias_gelu(z, bias, "tanh")
    z = optimized_ops.silu_and_mul(torch.cat([z, y], -1))
    z = optimized_ops.softmax(z, -1, scale=0.5) + optimized_ops.log_softmax(z, 0)
    return z.sum(-1) + optimized_ops.gelu(h).sum(-1) + optimized_ops.rms_norm(h, 16).sum(-1)


def _model_args(device, rng, rows=4):
    return [rand((rows, 16), torch.float32, device, rng).requires_grad_() for _ in range(2)] + \
           [rand((16,), torch.float32, device, rng).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, rng):
    torch._dynamo.reset()
    args = _model_args(device, rng)
    explanation = torch._dynamo.explain(_model)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(_model, fullgraph=True)
    out, expected = compiled(*args), _model(*args)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out.sum(), args), torch.autograd.grad(expected.sum(), args)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_dynamic_shapes(device, rng):
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 7, 11):
        args = _model_args(device, rng, rows)
        out, expected = compiled(*args), _model(*args)
        torch.testing.assert_close(out, expected)
        for got, want in zip(torch.autograd.grad(out.sum(), args), torch.autograd.grad(expected.sum(), args)):
            torch.testing.assert_close(got, want)


def test_torch_export(rng):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = optimized_ops.nn.RMSNorm(16)

        def forward(self, x, r):
            y, h = optimized_ops.add_layer_norm(x, r, 16)
            return optimized_ops.silu_and_mul(torch.cat([self.norm(y), h], -1))

    args = (rand((3, 16), torch.float32, "cpu", rng), rand((3, 16), torch.float32, "cpu", rng))
    program = torch.export.export(Block(), args)
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert {ops.layer_norm_fwd.default, ops.rms_norm_fwd.default, ops.silu_and_mul_fwd.default} <= targets
    torch.testing.assert_close(program.module()(*args), Block()(*args))


# ---- CUDA: graphs, streams ------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cuda_graph_capture_and_replay(case, dtype, rng):
    """Forward and backward of every op captured in a CUDA graph (every variant), replayed on new
    inputs written into the same memory."""
    for variant in variants_on("cuda"):
        inputs = {k: t.requires_grad_() for k, t in case.make(9, 515, dtype, "cuda", rng).items()}
        grads_out = None

        def step():
            out = case.ours(inputs, variant)
            return out, torch.autograd.grad(out, list(inputs.values()), grads_out)

        out = case.ours(inputs, variant)
        grads_out = [rand(o.shape, dtype, "cuda", rng) for o in out]
        # No autograd graph of an eager call may outlive the capture: its AccumulateGrad nodes were
        # made on the legacy default stream, and a backward through them inside the capture would
        # make the legacy stream wait on the capturing one (cudaErrorStreamCaptureImplicit), with
        # torch's own ops too (bench/results/h100/logs/graph-capture-diagnosis.log).
        del out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture (a few steps, as torch advises)
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_grads = step()
        for _ in range(2):
            with torch.no_grad():
                for k, t in inputs.items():
                    t.copy_(case.make(9, 515, dtype, "cuda", rng)[k])
            graph.replay()
            torch.cuda.synchronize()
            (e_out, e_grads) = step()
            for got, want in zip((*g_out, *g_grads), (*e_out, *e_grads)):
                torch.testing.assert_close(got, want, msg=lambda m: f"{case.name} {variant} after replay: {m}")


@requires_cuda
def test_runs_on_the_current_stream(rng):
    x = rand((256, 4096), torch.bfloat16, "cuda", rng)
    new_x = rand((256, 4096), torch.bfloat16, "cuda", rng)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.copy_(new_x)
        outs = [optimized_ops.rms_norm(x, 4096, variant=v) for v in variants_on("cuda")]
    side.synchronize()
    expected = F.rms_norm(new_x.float(), (4096,), eps=torch.finfo(torch.bfloat16).eps).bfloat16()
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_device_guard_second_gpu(rng):
    x = rand((33, 300), torch.bfloat16, "cuda:1", rng)
    with torch.cuda.device(0):
        y = optimized_ops.layer_norm(x, 300)
    assert y.device == x.device
    torch.testing.assert_close(y, F.layer_norm(x, (300,)))


# ---- nn modules --------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", [dict(), dict(elementwise_affine=False), dict(bias=False), dict(eps=1e-3)],
                         ids=["default", "no_affine", "no_bias", "eps"])
def test_layer_norm_module_is_drop_in(device, kwargs, rng):
    torch.manual_seed(0)
    ours = optimized_ops.nn.LayerNorm((3, 8), device=device, **kwargs)
    theirs = torch.nn.LayerNorm((3, 8), device=device, **kwargs)
    assert isinstance(ours, torch.nn.LayerNorm)
    assert ours.normalized_shape == theirs.normalized_shape == (3, 8)
    assert ours.eps == theirs.eps and ours.elementwise_affine == theirs.elementwise_affine
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert repr(ours) == repr(theirs)
    with torch.no_grad():  # non-trivial parameters, then the round trip both ways
        for p in theirs.parameters():
            p.copy_(rand(p.shape, p.dtype, device, rng))
    ours.load_state_dict(theirs.state_dict())
    theirs2 = torch.nn.LayerNorm((3, 8), device=device, **kwargs)
    theirs2.load_state_dict(ours.state_dict())
    for a, b in zip(theirs.parameters(), theirs2.parameters()):
        assert torch.equal(a, b)
    x = rand((4, 5, 3, 8), torch.float32, device, rng).requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x))
    g = rand((4, 5, 3, 8), torch.float32, device, rng)
    got = torch.autograd.grad(ours(x), (x, *ours.parameters()), g)
    want = torch.autograd.grad(theirs(x), (x, *theirs.parameters()), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    ours.reset_parameters()
    if ours.weight is not None:
        assert torch.equal(ours.weight, torch.ones_like(ours.weight))
    if ours.bias is not None:
        assert torch.equal(ours.bias, torch.zeros_like(ours.bias))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", [dict(), dict(elementwise_affine=False), dict(eps=1e-6)],
                         ids=["default", "no_affine", "eps"])
def test_rms_norm_module_is_drop_in(device, kwargs, rng):
    ours = optimized_ops.nn.RMSNorm(24, device=device, **kwargs)
    theirs = torch.nn.RMSNorm(24, device=device, **kwargs)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert ours.normalized_shape == theirs.normalized_shape == (24,)
    assert ours.eps == theirs.eps and repr(ours) == repr(theirs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(rand(p.shape, p.dtype, device, rng))
    ours.load_state_dict(theirs.state_dict())
    torch.nn.RMSNorm(24, device=device, **kwargs).load_state_dict(ours.state_dict())
    x = rand((2, 7, 24), torch.float32, device, rng).requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x))
    g = rand((2, 7, 24), torch.float32, device, rng)
    got = torch.autograd.grad(ours(x), (x, *ours.parameters()), g)
    want = torch.autograd.grad(theirs(x), (x, *theirs.parameters()), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # bfloat16: the module is the functional op with its eps default (finfo(bfloat16).eps) and its
    # weight (the numerics against torch are test_parity_forward_backward's)
    ours.to(torch.bfloat16)
    xb = x.detach().bfloat16()
    expected = optimized_ops.rms_norm(xb, 24, ours.weight, eps=kwargs.get("eps", torch.finfo(torch.bfloat16).eps))
    assert torch.equal(ours(xb), expected) and ours(xb).dtype == torch.bfloat16


def test_nn_modules_variant_and_repr():
    m = optimized_ops.nn.RMSNorm(8, variant="cpu")
    assert "variant='cpu'" in repr(m) and m.variant == "cpu"
    assert "variant" not in repr(optimized_ops.nn.LayerNorm(8))
    assert "variant" not in m.state_dict()
    with pytest.raises(ValueError, match=r"variant: expected one of auto, cpu, .*; given 'best'"):
        optimized_ops.nn.LayerNorm(8, variant="best")
    m = optimized_ops.nn.LayerNorm([4, 8], dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16 and m.weight.shape == (4, 8)
    assert m(torch.randn(2, 4, 8, dtype=torch.bfloat16)).shape == (2, 4, 8)


def test_nn_module_in_a_model_compiles(rng):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), optimized_ops.nn.LayerNorm(16), torch.nn.Linear(16, 16),
                                optimized_ops.nn.RMSNorm(16))
    x = rand((5, 16), torch.float32, "cpu", rng)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x))


# ---- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_name_the_argument(device):
    f32 = dict(device=device, dtype=torch.float32)
    x = torch.ones(3, 8, **f32)
    w = torch.ones(8, **f32)
    cases = [
        (ValueError, r"optimized::softmax_fwd: dim: expected a dimension in \[-2, 1\]; given 2",
         lambda: optimized_ops.softmax(x, 2)),
        (NotImplementedError, r"optimized::softmax_fwd: x: expected dtype fp32, fp16, bf16 \(or fp64 on the cpu "
                              r"variant\); given int64", lambda: optimized_ops.softmax(x.long(), -1)),
        (NotImplementedError, r"optimized::softmax_fwd: x: expected a dtype of the library \(float32, .*\); given "
                              r"int8", lambda: optimized_ops.softmax(x.to(torch.int8), -1)),
        (NotImplementedError, r"optimized::softmax_fwd: x: expected dtype fp32, fp16, bf16 \(or fp64 on the cpu "
                              r"variant\); given bool", lambda: optimized_ops.softmax(x.bool(), -1)),
        (ValueError, r"optimized::softmax_bwd: dy: expected shape \[3, 8\] \(same as y\); given \[3, 7\]",
         lambda: ops.softmax_bwd(x, x[:, :7], -1, 1.0)),
        (ValueError, r"optimized::layer_norm_fwd: x: expected a shape ending in \[4\] \(normalized_shape\); "
                     r"given \[3, 8\]", lambda: optimized_ops.layer_norm(x, 4)),
        (ValueError, r"optimized::layer_norm_fwd: normalized_shape: expected at least one dimension; given \[\]",
         lambda: optimized_ops.layer_norm(x, [])),
        (ValueError, r"optimized::layer_norm_fwd: weight: expected shape \[8\] \(normalized_shape\); given \[7\]",
         lambda: optimized_ops.layer_norm(x, 8, w[:7])),
        (ValueError, r"optimized::layer_norm_fwd: bias: expected shape \[8\] \(normalized_shape\); given \[3, 8\]",
         lambda: optimized_ops.layer_norm(x, 8, w, x)),
        (ValueError, r"optimized::layer_norm_fwd: eps: expected >= 0; given -1",
         lambda: optimized_ops.layer_norm(x, 8, eps=-1.0)),
        (ValueError, r"optimized::rms_norm_fwd: eps: expected >= 0; given nan",
         lambda: optimized_ops.rms_norm(x, 8, eps=math.nan)),
        (ValueError, r"optimized::layer_norm_fwd: eps: expected >= 0; given -1",  # zero rows: checked all the same
         lambda: optimized_ops.layer_norm(x[:0], 8, eps=-1.0)),
        (ValueError, r"optimized::rms_norm_fwd: residual: expected shape \[3, 8\] \(same as x\); given \[3, 4\]",
         lambda: optimized_ops.add_rms_norm(x, x[:, :4], 8)),
        (ValueError, r"optimized::rms_norm_fwd: residual: expected dtype fp32; given fp16",
         lambda: optimized_ops.add_rms_norm(x, x.half(), 8)),
        (ValueError, r"optimized::layer_norm_bwd: rstd: expected dtype fp32; given fp64",
         lambda: ops.layer_norm_bwd(x, x, [8], None, x[:, 0], x[:, 0].double(), None, False, False)),
        (ValueError, r"optimized::rms_norm_bwd: rstd: expected shape \(3\) \(one per row\); given \(4\)",
         lambda: ops.rms_norm_bwd(x, x, [8], None, torch.ones(4, **f32), None, False)),
        (ValueError, r"optimized::rms_norm_bwd: dweight: asked for without weight",
         lambda: ops.rms_norm_bwd(x, x, [8], None, torch.ones(3, **f32), None, True)),
        (ValueError, r"optimized::softmax_bwd: dy: expected dtype fp32; given fp16",
         lambda: ops.softmax_bwd(x, x.half(), -1, 1.0)),
        (ValueError, r"optimized::bias_gelu_fwd: approximate: expected 'none' or 'tanh'; given 'fast'",
         lambda: optimized_ops.gelu(x, "fast")),
        (ValueError, r"optimized::bias_gelu_fwd: bias: expected shape \[8\] \(x's last dimension\); given \[3\]",
         lambda: optimized_ops.bias_gelu(x, x[:, 0])),
        (ValueError, r"optimized::silu_and_mul_fwd: x: expected an even last dimension \(2 \* d, the halves "
                     r"\[a \| b\]\); given shape \[3, 7\]", lambda: optimized_ops.silu_and_mul(x[:, :7])),
        (ValueError, r"optimized::silu_and_mul_bwd: dy: expected shape \[3, 4\] \(x's with the last dimension "
                     r"halved\); given \[3, 8\]", lambda: ops.silu_and_mul_bwd(x, x)),
        (ValueError, r"optimized::layer_norm_fwd: variant: expected one of auto, cpu, unfused, fused_streaming, "
                     r"fused_registers; given 'fastest'", lambda: optimized_ops.layer_norm(x, 8, variant="fastest")),
    ]
    if device == "cpu":
        cases.append((ValueError, r"optimized::softmax_fwd: variant fused_streaming runs on CUDA devices; "
                                  r"given operands on cpu",
                      lambda: optimized_ops.softmax(x, -1, variant="fused_streaming")))
    else:
        cases += [
            (ValueError, r"variant cpu runs on the CPU; given operands on cuda:0",
             lambda: optimized_ops.rms_norm(x, 8, variant="cpu")),
            (NotImplementedError, r"fp64 runs on the cpu variant only",
             lambda: optimized_ops.layer_norm(x.double(), 8)),
            (ValueError, r"optimized::layer_norm_fwd: weight: expected device cuda:0 \(same as the first operand\); "
                         r"given cpu", lambda: optimized_ops.layer_norm(x, 8, w.cpu())),
        ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()


def test_query_errors():
    with pytest.raises(ValueError, match=r"op: expected one of softmax, log_softmax, .*; given 'matmul'"):
        optimized_ops.fused_registers_max_width("matmul", torch.float32)
    with pytest.raises(NotImplementedError, match=r"optimized::resolve_fused_variant: dtype: expected fp32, fp16, bf16, "
                                                  r"fp64 \(fp64 on the cpu variant\); given int32"):
        optimized_ops.resolve_fused_variant("softmax", torch.int32, "cuda", 100)
    with pytest.raises(NotImplementedError, match=r"optimized::resolve_fused_variant: dtype: expected a dtype of the "
                                                  r"library \(.*\); given int8"):
        optimized_ops.resolve_fused_variant("softmax", torch.int8, "cuda", 100)
    assert optimized_ops.fused_registers_max_width("softmax", torch.int32) == 0  # no CUDA rung holds int32
    assert optimized_ops.resolve_fused_variant("layer_norm", torch.float32, "cpu", 100) == "cpu"
    assert optimized_ops.fused_variants() == ["cpu", "unfused", "fused_streaming", "fused_registers"]


def test_cuda_tensors_with_a_cpu_only_build():
    if optimized_ops.built_with_cuda() or not torch.cuda.is_available():
        pytest.skip("needs CUDA tensors and a CPU-only build of the library")
    with pytest.raises(NotImplementedError, match="this build has no CUDA backend"):
        optimized_ops.softmax(torch.ones(2, 2, device="cuda"), -1)


# ---- loading -----------------------------------------------------------------------------------------

def test_fused_ops_from_the_library_alone():
    """torch.ops.load_library on the .so alone registers the fused ops (forward and backward)."""
    script = textwrap.dedent(f"""
        import torch
        torch.ops.load_library({optimized_ops.library_path()!r})
        x = torch.randn(4, 9)
        y, h, mean, rstd = torch.ops.optimized.layer_norm_fwd(x, None, [9], None, None, 1e-5)
        assert h is None and torch.allclose(y, torch.nn.functional.layer_norm(x, (9,)), atol=1e-5)
        assert torch.allclose(torch.ops.optimized.softmax_fwd(x, -1), torch.softmax(x, -1), atol=1e-6)
        print(torch.ops.optimized.layer_norm_fwd.default._schema)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "optimized::layer_norm_fwd(Tensor x, Tensor? residual, SymInt[] normalized_shape" in result.stdout


# ---- float64 statistics ----------------------------------------------------------------------------

def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_float64_statistics_give_float64_gradients(op):
    """float64 input (CPU): the forward saves float64 mean / rstd and the backward reads them, so the
    gradients match torch's float64 autograd to ~1e-12 relative (float32 statistics gave ~1e-8)."""
    g = torch.Generator().manual_seed(7)
    rows, width, eps = 37, 301, 1e-5
    layer, add = "layer" in op, op.startswith("add")
    x = (torch.randn(rows, width, generator=g, dtype=torch.float64) * 3 + 2).requires_grad_()
    r = torch.randn(rows, width, generator=g, dtype=torch.float64).requires_grad_()
    w = (torch.rand(width, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(width, generator=g, dtype=torch.float64).requires_grad_()
    dy = torch.randn(rows, width, generator=g, dtype=torch.float64)
    leaves = [x] + ([r] if add else []) + [w] + ([b] if layer else [])

    def ours():
        if op == "layer_norm":
            return optimized_ops.layer_norm(x, (width,), w, b, eps, variant="cpu")
        if op == "rms_norm":
            return optimized_ops.rms_norm(x, (width,), w, eps, variant="cpu")
        if op == "add_layer_norm":
            return optimized_ops.add_layer_norm(x, r, (width,), w, b, eps, variant="cpu")[0]
        return optimized_ops.add_rms_norm(x, r, (width,), w, eps, variant="cpu")[0]

    def reference():
        h = x + r if add else x
        return F.layer_norm(h, (width,), w, b, eps) if layer else F.rms_norm(h, (width,), w, eps)

    got = torch.autograd.grad(ours(), leaves, dy)
    want = torch.autograd.grad(reference(), leaves, dy)
    for name, a, e in zip(["x", "residual", "weight", "bias"] if add else ["x", "weight", "bias"], got, want):
        assert _rel_err(a, e) < 1e-12, f"{op} d{name}: relative error {_rel_err(a, e):.3g}"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=_dname)
def test_saved_statistics_dtype(dtype):
    """mean / rstd are float64 for float64 input, float32 for every other dtype (forward ops and fakes)."""
    want = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(5, 16).to(dtype)
    _, _, mean, rstd = ops.layer_norm_fwd(x, None, [16], None, None, 1e-5, variant="cpu")
    _, _, rstd2 = ops.rms_norm_fwd(x, x, [16], None, 1e-5, variant="cpu")
    assert mean.dtype == want and rstd.dtype == want and rstd2.dtype == want
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        _, _, fmean, frstd = ops.layer_norm_fwd(fx, None, [16], None, None, 1e-5)
        _, _, frstd2 = ops.rms_norm_fwd(fx, fx, [16], None, 1e-5)
    assert fmean.dtype == want and frstd.dtype == want and frstd2.dtype == want
