"""Inputs at the edges of the fused family, through optimized_ops and torch.ops.optimized: queries with
arguments outside their domain (negative widths, devices the family does not run on), float64 scalars
that float32 cannot hold (eps, scale), and rows long enough (2^20) for the CPU sums' rounding to show,
held to torch's own accuracy (design.md's rule: error(ours vs float64) <= 2 * error(torch in the
same dtype vs float64) + rounding noise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import optimized_ops

ops = torch.ops.optimized


# ---- resolve_fused_variant: the argument's domain -------------------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("width", [-5, -1])
def test_resolve_refuses_negative_widths(device, width):
    with pytest.raises(ValueError, match=rf"optimized::resolve_fused_variant: width: expected a row length >= 0; "
                                         rf"given {width}"):
        optimized_ops.resolve_fused_variant("softmax", torch.float32, device, width)
    # An empty row is still answered.
    assert optimized_ops.resolve_fused_variant("softmax", torch.float32, device, 0) in ("cpu", "fused_registers")


@pytest.mark.parametrize("device", ["meta", "xpu", torch.device("meta")])
def test_resolve_refuses_devices_the_family_does_not_run_on(device):
    name = str(torch.device(device))
    with pytest.raises(ValueError, match=rf"optimized::resolve_fused_variant: device: expected a cpu or cuda device; "
                                         rf"given {name}"):
        optimized_ops.resolve_fused_variant("layer_norm", torch.float32, device, 1024)
    with pytest.raises(ValueError, match=r"resolve_fused_variant: device: "):
        ops.resolve_fused_variant("layer_norm", torch.float32, name, 1024)


def test_resolve_refuses_float64_on_cuda():
    # float64 runs on the cpu variant only: no CUDA design to name.
    with pytest.raises(NotImplementedError, match=r"resolve_fused_variant: dtype: fp64 runs on the cpu variant only"):
        optimized_ops.resolve_fused_variant("rms_norm", torch.float64, "cuda", 1024)
    assert optimized_ops.resolve_fused_variant("rms_norm", torch.float64, "cpu", 1024) == "cpu"


# ---- float64 scalars ----------------------------------------------------------------------------------

def test_float64_eps_below_float32_range():
    """eps = 1e-50 is 0 in float32: a constant row would give 0 * inf = NaN. In float64, as torch."""
    rows = torch.tensor([0.1, 3.0, 0.0], dtype=torch.float64)[:, None].expand(3, 1000).contiguous()
    bias = torch.linspace(-1, 1, 1000, dtype=torch.float64)
    for variant in ("auto", "cpu"):
        got = optimized_ops.layer_norm(rows, (1000,), None, bias, eps=1e-50, variant=variant)
        want = F.layer_norm(rows, (1000,), None, bias, eps=1e-50)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        zeros = torch.zeros(2, 1000, dtype=torch.float64)
        got = optimized_ops.rms_norm(zeros, (1000,), eps=1e-50, variant=variant)
        torch.testing.assert_close(got, F.rms_norm(zeros, (1000,), eps=1e-50), rtol=0, atol=0)


@pytest.mark.parametrize("scale", [0.1, -1.0 / 3.0])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_float64_softmax_scale_is_not_rounded_to_float32(scale, log, rng):
    """scale 0.1 is 0.10000000149... in float32: ~1e-9 relative on these logits, far above float64's
    rounding. Forward and backward against torch in float64 on scale * x."""
    assert float(torch.tensor(scale, dtype=torch.float32)) != scale
    x = (torch.rand(5, 257, generator=rng, dtype=torch.float64) * 8 - 4).requires_grad_()
    dy = torch.rand(5, 257, generator=rng, dtype=torch.float64) * 2 - 1
    ours_fn = optimized_ops.log_softmax if log else optimized_ops.softmax
    theirs_fn = torch.log_softmax if log else torch.softmax
    ours = ours_fn(x, -1, scale=scale, variant="cpu")
    (gx,) = torch.autograd.grad(ours, x, dy)
    theirs = theirs_fn(scale * x, -1)
    (tx,) = torch.autograd.grad(theirs, x, dy)
    torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(gx, tx, rtol=1e-14, atol=1e-15)


# ---- long rows: torch's accuracy ----------------------------------------------------------------------

_WIDTH = 1 << 20


def _max_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).abs().max().item()


@pytest.mark.parametrize("mean", [0.0, 100.0])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_long_rows_match_torch_accuracy(op, mean, rng):
    """Rows of 2^20 float32 N(mean, 1) values on the cpu variant: y and dx within 2x torch's error
    (vs float64) plus two units of float32 rounding of the output. With 8 running accumulators
    per row, y was 15x (layer_norm, mean 100) to 130x (rms_norm, mean 0) less accurate than torch's."""
    x = torch.randn(2, _WIDTH, generator=rng, dtype=torch.float64) + mean
    dy = torch.randn(2, _WIDTH, generator=rng, dtype=torch.float64)
    x32 = x.float()

    def run(fn, xin, dyin):
        xin = xin.clone().requires_grad_()
        y = fn(xin)
        (dx,) = torch.autograd.grad(y, xin, dyin)
        return y.detach(), dx

    if op == "layer_norm":
        ours = run(lambda t: optimized_ops.layer_norm(t, (_WIDTH,), eps=1e-5, variant="cpu"), x32, dy.float())
        theirs = run(lambda t: F.layer_norm(t, (_WIDTH,), eps=1e-5), x32, dy.float())
        ref = run(lambda t: F.layer_norm(t, (_WIDTH,), eps=1e-5), x32.double(), dy)
    else:
        ours = run(lambda t: optimized_ops.rms_norm(t, (_WIDTH,), eps=1e-5, variant="cpu"), x32, dy.float())
        theirs = run(lambda t: F.rms_norm(t, (_WIDTH,), eps=1e-5), x32, dy.float())
        ref = run(lambda t: F.rms_norm(t, (_WIDTH,), eps=1e-5), x32.double(), dy)
    for name, o, t, r in zip(("y", "dx"), ours, theirs, ref):
        noise = 2 * 2.0**-24 * r.abs().max().item()
        e_ours, e_torch = _max_error(o, r), _max_error(t, r)
        assert e_ours <= 2 * e_torch + noise, f"{op} {name} (mean {mean}): error {e_ours:.3g}, torch's {e_torch:.3g}"
