"""optimized_ops.cross_entropy against torch.nn.functional.cross_entropy in float64 (+ the z-loss term added
by hand): reductions, ignore_index (an all-ignored batch too), label smoothing, z-loss, every dtype, strided
rows, gradients, inplace_backward, opcheck and torch.compile(fullgraph=True). CUDA cases skip without a
device."""

import pytest
import torch
import torch.nn.functional as F

import optimized_ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3),
       torch.bfloat16: (2e-2, 2e-2)}


def reference(logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"):
    x = logits.detach().double().requires_grad_(True)
    per_row = F.cross_entropy(x, target.long(), ignore_index=ignore_index, label_smoothing=label_smoothing,
                              reduction="none")
    keep = target != ignore_index
    per_row = per_row + z_loss * torch.logsumexp(x, -1) ** 2 * keep
    if reduction == "none":
        return per_row, x
    return (per_row.sum() if reduction == "sum" else per_row.sum() / keep.sum()), x


def inputs(rows, vocab, dtype, device, stride_pad=0, ignored=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, vocab + stride_pad, generator=g, dtype=torch.float64) * 2
    logits = full.to(dtype).to(device)[:, :vocab]
    target = torch.randint(0, vocab, (rows,), generator=g)
    for r in ignored:
        target[r] = -100
    return logits, target.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-4), (0.2, 1e-3)])
def test_matches_torch(device, dtype, reduction, ls, z):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 runs on the cpu variant only")
    for rows, vocab, pad in [(7, 1, 0), (5, 3, 0), (9, 1000, 3), (3, 32000, 0)]:
        logits, target = inputs(rows, vocab, dtype, device, pad, ignored=(1,) if rows > 2 else ())
        logits.requires_grad_(True)
        got = optimized_ops.cross_entropy(logits, target, label_smoothing=ls, z_loss=z, reduction=reduction)
        want, x = reference(logits, target, -100, ls, z, reduction)
        assert got.dtype == dtype and got.shape == want.shape
        rtol, atol = TOL[dtype]
        torch.testing.assert_close(got.double(), want.detach(), rtol=rtol, atol=atol)
        up = torch.rand_like(want)
        (gx,) = torch.autograd.grad(got, logits, up.to(got.dtype))
        (wx,) = torch.autograd.grad(want, x, up)
        torch.testing.assert_close(gx.double(), wx, rtol=rtol, atol=atol * 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored_and_int32(device):
    logits, target = inputs(4, 10, torch.float32, device)
    ignored = torch.full_like(target, -100)
    assert torch.isnan(optimized_ops.cross_entropy(logits, ignored))  # torch gives NaN too
    assert torch.isnan(F.cross_entropy(logits, ignored))
    assert optimized_ops.cross_entropy(logits, ignored, reduction="sum") == 0
    torch.testing.assert_close(optimized_ops.cross_entropy(logits, target.int()), F.cross_entropy(logits, target))


@pytest.mark.parametrize("device", DEVICES)
def test_inf_logits(device):
    logits, target = inputs(3, 8, torch.float32, device)
    logits[0, 2] = float("inf")
    logits[1, :] = float("-inf")
    logits[1, target[1]] = 0.0
    logits[2, (target[2] + 1) % 8] = float("-inf")
    got = optimized_ops.cross_entropy(logits, target, reduction="none")
    want = F.cross_entropy(logits.double(), target, reduction="none")
    torch.testing.assert_close(got.double(), want, equal_nan=True)


def test_target_out_of_range_cpu():
    logits, target = inputs(3, 8, torch.float32, "cpu")
    target[1] = 8
    with pytest.raises(ValueError, match="target"):
        optimized_ops.cross_entropy(logits, target)


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward(device):
    logits, target = inputs(6, 50, torch.float32, device, ignored=(2,))
    x = logits.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(F.cross_entropy(x, target, label_smoothing=0.1), x)
    leaf = logits.clone().requires_grad_(True)
    h = leaf * 1.0  # a non-leaf whose producer saved nothing that the overwrite breaks
    loss = optimized_ops.cross_entropy(h, target, label_smoothing=0.1, inplace_backward=True)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, label_smoothing=0.1))
    assert not torch.allclose(h.detach(), logits)  # the logits were overwritten with the gradient
    loss.backward()
    torch.testing.assert_close(leaf.grad, want)
    # Another op saved the logits for its backward: autograd refuses the overwrite.
    leaf2 = logits.clone().requires_grad_(True)
    e = leaf2.exp()  # exp saves its output
    loss = optimized_ops.cross_entropy(e, target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_forward_only(device):
    logits, target = inputs(4, 20, torch.float32, device)
    with torch.no_grad():
        loss, lse, grad = torch.ops.optimized.cross_entropy_fwd(logits, target, -100, 0.0, 0.0, False)
    assert grad is None
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    logits, target = inputs(5, 33, torch.float32, device, ignored=(0,))
    for compute_grad in (False, True):
        torch.library.opcheck(torch.ops.optimized.cross_entropy_fwd.default,
                              (logits.clone().requires_grad_(compute_grad), target, -100, 0.1, 1e-4, compute_grad))
    torch.library.opcheck(torch.ops.optimized.cross_entropy_fwd_.default, (logits.clone(), target, -100, 0.1, 1e-4),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.parametrize("device", DEVICES)
def test_compile(device):
    logits, target = inputs(6, 40, torch.float32, device, ignored=(3,))

    def f(x, t):
        return optimized_ops.cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-4)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x1 = logits.clone().requires_grad_(True)
    x2 = logits.clone().requires_grad_(True)
    a, b = compiled(x1, target), f(x2, target)
    torch.testing.assert_close(a, b)
    a.backward()
    b.backward()
    torch.testing.assert_close(x1.grad, x2.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_op_scales_in_place(device, dtype):
    """cross_entropy_bwd_: rows times their factor in place; rows whose factor is exactly 1 bit for bit."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(6, 37, generator=g, dtype=torch.float64).to(dtype).to(device)
    grad = full[:, :33]  # strided rows
    before = full.clone()
    f = torch.tensor([1.0, 0.5, -2.0, 1.0, 0.0, 3.0], dtype=torch.float32, device=device)
    torch.ops.optimized.cross_entropy_bwd_(grad, f)
    want = (before[:, :33].float() * f[:, None]).to(dtype)
    torch.testing.assert_close(grad, want, rtol=0, atol=0)
    assert torch.equal(full[[0, 3]], before[[0, 3]]) and torch.equal(full[:, 33:], before[:, 33:])
    one = torch.ones((), dtype=torch.float32, device=device)
    torch.ops.optimized.cross_entropy_bwd_(grad, one)  # an upstream 1: nothing moves
    torch.testing.assert_close(grad, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="grad_loss"):
        torch.ops.optimized.cross_entropy_bwd_(grad, f[:4])
    with pytest.raises(ValueError, match="grad_loss"):
        torch.ops.optimized.cross_entropy_bwd_(grad, f.double())


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scale_folded_into_forward(device):
    """cross_entropy_fwd's grad_scale: the gradient written is the unit one times the factor(s)."""
    logits, target = inputs(5, 40, torch.float32, device, ignored=(2,))
    _, _, unit = torch.ops.optimized.cross_entropy_fwd(logits, target, -100, 0.1, 1e-4, True)
    s = torch.tensor(0.25, device=device)
    _, _, scaled = torch.ops.optimized.cross_entropy_fwd(logits, target, -100, 0.1, 1e-4, True, s)
    torch.testing.assert_close(scaled, unit * 0.25, rtol=0, atol=0)  # a power of 2: exact
    rows = torch.tensor([1.0, -3.0, 7.0, 0.0, 0.5], device=device)
    _, _, per_row = torch.ops.optimized.cross_entropy_fwd(logits, target, -100, 0.1, 1e-4, True, rows)
    torch.testing.assert_close(per_row, unit * rows[:, None], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="grad_scale"):
        torch.ops.optimized.cross_entropy_fwd(logits, target, -100, 0.0, 0.0, False, s)
    # autograd through the raw op: the loss's gradient, whatever scale the stored gradient carries
    x = logits.clone().requires_grad_(True)
    loss, _, _ = torch.ops.optimized.cross_entropy_fwd(x, target, -100, 0.1, 1e-4, True, s)
    up = torch.rand(5, device=device)
    (g,) = torch.autograd.grad(loss, x, up)
    torch.testing.assert_close(g, unit * up[:, None], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_mean_backward_upstream_one_and_all_ignored(device, inplace):
    """loss.backward() (upstream 1): the gradient is the forward's, with the mean's 1 / count folded in; an
    all-ignored batch gives a zero gradient (its loss is NaN, as torch's)."""
    logits, target = inputs(8, 300, torch.float32, device, ignored=(0, 5))
    x = logits.clone().requires_grad_(True)
    F.cross_entropy(x, target, label_smoothing=0.1).backward()
    y = logits.clone().requires_grad_(True)
    optimized_ops.cross_entropy(y * 1.0, target, label_smoothing=0.1, inplace_backward=inplace).backward()
    torch.testing.assert_close(y.grad, x.grad)
    z = logits.clone().requires_grad_(True)
    loss = optimized_ops.cross_entropy(z * 1.0, torch.full_like(target, -100), inplace_backward=inplace)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(z.grad, torch.zeros_like(z))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_grad_scale_and_backward_op(device):
    logits, target = inputs(5, 33, torch.float32, device, ignored=(0,))
    for s in (torch.tensor(0.5, device=device), torch.rand(5, device=device)):
        torch.library.opcheck(torch.ops.optimized.cross_entropy_fwd.default,
                              (logits.clone().requires_grad_(True), target, -100, 0.1, 1e-4, True, s))
        torch.library.opcheck(torch.ops.optimized.cross_entropy_fwd_.default,
                              (logits.clone(), target, -100, 0.1, 1e-4, s),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
        torch.library.opcheck(torch.ops.optimized.cross_entropy_bwd_.default, (logits.clone(), s),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
