"""optimized_ops.linear, torch.ops.optimized.linear_forward / linear_backward and optimized_ops.nn.Linear
against torch (F.linear + the activation, in float64): every activation, dtype, bias on and off, leading
batch dimensions, strided and empty inputs; gradients against torch's autograd, gradcheck and
gradgradcheck, forward mode; opcheck, fake kernels, torch.compile; the nn module's state_dict both
ways; the messages of bad inputs. CUDA: the same for every CUDA rung (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import optimized_ops
from conftest import requires_cuda, rand

ops = torch.ops.optimized
ACTIVATIONS = ["none", "relu", "gelu", "gelu_tanh", "silu"]
LINEAR = ["cpu", "naive", "fused", "persistent"]


def _dname(d):
    return str(d).removeprefix("torch.")


def torch_act(z: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return F.relu(z)
    if activation == "gelu":
        return F.gelu(z)
    if activation == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if activation == "silu":
        return F.silu(z)
    return z


def reference(x, w, b, activation):
    """act(x W^T + b) in float64 from the (rounded) inputs."""
    z = F.linear(x.double(), w.double(), None if b is None else b.double())
    return torch_act(z, activation)


def tolerance(dtype, k):
    """One rounding to the dtype, plus fp32 accumulation over k terms (inputs in [-1, 1))."""
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-6 * k)
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    return dict(rtol=2 * u, atol=2 * u)


def make(shape_x, n, dtype, device, rng, bias=True):
    k = shape_x[-1]
    x = rand(shape_x, dtype, device, rng)
    w = rand((n, k), dtype, device, rng)
    b = rand((n,), dtype, device, rng) if bias else None
    return x, w, b


# ---- forward -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=_dname)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_forward_matches_torch(activation, dtype, bias, rng):
    x, w, b = make((13, 37), 19, dtype, "cpu", rng, bias)
    y = optimized_ops.linear(x, w, b, activation)
    assert y.dtype == dtype and y.shape == (13, 19) and y.is_contiguous()
    torch.testing.assert_close(y.double(), reference(x, w, b, activation), **tolerance(dtype, 37))


@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_save_pre_and_the_op_directly(activation, rng):
    x, w, b = make((2, 5, 8), 6, torch.float64, "cpu", rng)
    y, pre = ops.linear_forward(x, w, b, activation=activation, save_pre=True)
    torch.testing.assert_close(pre, F.linear(x, w, b))
    torch.testing.assert_close(y, reference(x, w, b, activation))
    y2, none = ops.linear_forward(x, w, b, activation=activation)
    assert none is None and torch.equal(y, y2)
    assert torch.equal(y2, ops.linear_forward(x, w, b, activation=activation, variant="cpu")[0])


@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 7), (2, 1, 3, 7), (0, 7), (2, 0, 7)])
def test_leading_dimensions_and_empty_batches(shape, rng):
    x, w, b = make(shape, 5, torch.float64, "cpu", rng)
    y = optimized_ops.linear(x, w, b, "silu")
    assert y.shape == (*shape[:-1], 5)
    torch.testing.assert_close(y, reference(x, w, b, "silu"))


def test_strided_inputs(rng):
    base = rand((6, 4, 20), torch.float64, "cpu", rng)
    w_base = rand((9, 16), torch.float64, "cpu", rng)
    b_base = rand((18,), torch.float64, "cpu", rng)
    for x in (base[..., :11], base[::2, :, 3:14], base.transpose(0, 1)[..., :11], base[:, :, :11].mT.mT,
              base[..., :11].expand(2, 6, 4, 11)):
        w, b = w_base[:, :11], b_base[::2]  # a weight with padded rows; a strided bias (copied)
        torch.testing.assert_close(optimized_ops.linear(x, w, b, "gelu_tanh"), reference(x, w, b, "gelu_tanh"))
    wt = rand((11, 9), torch.float64, "cpu", rng).t()  # a column-major weight (copied)
    x = base[..., :11]
    torch.testing.assert_close(optimized_ops.linear(x, wt, None), reference(x, wt, None, "none"))


def test_variants_listing():
    assert optimized_ops.linear_variants() == LINEAR
    assert optimized_ops.variants("linear") == LINEAR
    assert list(ops.linear_variants()) == LINEAR


# ---- backward ----------------------------------------------------------------------------------------

def _grads(fn, tensors, dy):
    ts = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    out = fn(*ts)
    out.backward(dy)
    return out, [t.grad if t is not None else None for t in ts]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=_dname)
def test_gradients_match_torch(activation, bias, dtype, rng):
    x, w, b = make((3, 4, 10), 7, dtype, "cpu", rng, bias)
    dy = rand((3, 4, 7), dtype, "cpu", rng)
    ours, got = _grads(lambda x, w, b: optimized_ops.linear(x, w, b, activation), (x, w, b), dy)
    _, want = _grads(lambda x, w, b: torch_act(F.linear(x, w, b), activation),
                     (x.double(), w.double(), None if b is None else b.double()), dy.double())
    tol = tolerance(dtype, 12)
    for g, r in zip(got, want):
        assert (g is None) == (r is None)
        if g is not None:
            assert g.dtype == dtype
            torch.testing.assert_close(g.double(), r, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_dname)
def test_gradients_16_bit(dtype, rng):
    x, w, b = make((9, 16), 12, dtype, "cpu", rng)
    dy = rand((9, 12), dtype, "cpu", rng)
    _, got = _grads(lambda x, w, b: optimized_ops.linear(x, w, b, "gelu"), (x, w, b), dy)
    _, want = _grads(lambda x, w, b: F.gelu(F.linear(x, w, b)), (x.double(), w.double(), b.double()), dy.double())
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=3e-2, atol=6e-2)


def test_only_the_needed_gradients(rng):
    x, w, b = make((5, 6), 4, torch.float64, "cpu", rng)
    dy = rand((5, 4), torch.float64, "cpu", rng)
    gi, gw, gb = ops.linear_backward(dy, x, w, None, b, activation="relu", output_mask=[False, True, False])
    assert gi is None and gb is None and gw.shape == w.shape
    # through autograd: only w requires grad
    wr = w.clone().requires_grad_()
    optimized_ops.linear(x, wr, b, "relu").backward(dy)
    xr = x.clone().requires_grad_()
    wt = wr.detach().clone().requires_grad_()
    F.relu(F.linear(xr, wt, b)).backward(dy)
    torch.testing.assert_close(wr.grad, wt.grad)


@pytest.mark.parametrize("activation", ["none", "silu"])
def test_backward_with_no_rows(activation):
    x, w = torch.empty(0, 6, dtype=torch.float64, requires_grad=True), torch.randn(4, 6, dtype=torch.float64,
                                                                                     requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    optimized_ops.linear(x, w, b, activation).sum().backward()
    assert x.grad.shape == (0, 6) and torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros(4,
                                                                                                dtype=torch.float64))


def test_backward_recomputes_pre(rng):
    x, w, b = make((4, 6), 5, torch.float64, "cpu", rng)
    dy = rand((4, 5), torch.float64, "cpu", rng)
    _, pre = ops.linear_forward(x, w, b, activation="gelu", save_pre=True)
    with_pre = ops.linear_backward(dy, x, w, pre, b, activation="gelu")
    without = ops.linear_backward(dy, x, w, None, b, activation="gelu")
    for a, c in zip(with_pre, without):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation, rng):
    x, w, b = make((2, 3, 5), 4, torch.float64, "cpu", rng)
    inputs = tuple(t.requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: optimized_ops.linear(x, w, b, activation, variant="cpu"), inputs,
                                    check_forward_ad=True)


@pytest.mark.parametrize("activation", ["none", "gelu", "silu"])
def test_gradgradcheck_float64(activation, rng):
    x, w, b = make((3, 5), 4, torch.float64, "cpu", rng)
    inputs = tuple(t.requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradgradcheck(lambda x, w, b: optimized_ops.linear(x, w, b, activation), inputs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_mode_matches_torch(activation, rng):
    x, w, b = make((3, 6), 4, torch.float64, "cpu", rng)
    tx, tw, tb = (rand(t.shape, torch.float64, "cpu", rng) for t in (x, w, b))
    _, ours = torch.func.jvp(lambda x, w, b: optimized_ops.linear(x, w, b, activation), (x, w, b), (tx, tw, tb))
    _, theirs = torch.func.jvp(lambda x, w, b: torch_act(F.linear(x, w, b), activation), (x, w, b), (tx, tw, tb))
    torch.testing.assert_close(ours, theirs)


# ---- torch.library: opcheck, fakes, compile -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_dname)
def test_opcheck(dtype, rng):
    x, w, b = make((2, 3, 8), 5, dtype, "cpu", rng)
    dy = rand((2, 3, 5), dtype, "cpu", rng)
    for args, kwargs in [((x.requires_grad_(), w.requires_grad_(), b.requires_grad_()), dict(activation="gelu")),
                         ((x, w, None), dict(activation="relu", save_pre=True)),
                         ((x, w, b), dict())]:
        torch.library.opcheck(ops.linear_forward.default, args, kwargs)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    _, pre = ops.linear_forward(xd, wd, bd, activation="silu", save_pre=True)
    torch.library.opcheck(ops.linear_backward.default, (dy, xd, wd, pre, bd), dict(activation="silu"))
    torch.library.opcheck(ops.linear_backward.default, (dy, xd, wd, None, None),
                          dict(output_mask=[True, False, True]))


def test_fake_kernels_on_meta_tensors():
    meta = dict(device="meta")
    x, w, b = torch.empty(2, 3, 8, **meta), torch.empty(5, 8, **meta), torch.empty(5, **meta)
    y, pre = ops.linear_forward(x, w, b, activation="gelu", save_pre=True)
    assert y.shape == pre.shape == (2, 3, 5) and y.device.type == "meta"
    gi, gw, gb = ops.linear_backward(y, x, w, pre, b, output_mask=[True, False, True])
    assert gi.shape == x.shape and gw is None and gb.shape == (5,)
    with pytest.raises(ValueError, match=r"optimized::linear_forward: weight: expected a 2-D tensor"):
        ops.linear_forward(x, b, None)
    with pytest.raises(ValueError, match=r"optimized::linear_forward: weight: expected device meta \(same as x\)"):
        ops.linear_forward(x, torch.ones(5, 8), None)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = optimized_ops.nn.Linear(16, 32, activation="gelu")
        self.down = optimized_ops.nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.down(self.up(x)) + x


def test_torch_compile_fullgraph(rng):
    torch._dynamo.reset()
    model = _Block()
    x = rand((3, 5, 16), torch.float32, "cpu", rng).requires_grad_()
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True)
    out, expected = compiled(x), model(x)
    torch.testing.assert_close(out, expected)
    params = [x, *model.parameters()]
    for got, want in zip(torch.autograd.grad(out.sum(), params), torch.autograd.grad(expected.sum(), params)):
        torch.testing.assert_close(got, want)


def test_torch_compile_dynamic_shapes(rng):
    torch._dynamo.reset()
    model = _Block()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (2, 5, 9):
        x = rand((rows, 16), torch.float32, "cpu", rng)
        torch.testing.assert_close(compiled(x), model(x))


# ---- nn.Linear ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_nn_linear_is_drop_in(bias, rng):
    theirs = torch.nn.Linear(12, 7, bias=bias, dtype=torch.float64)
    ours = optimized_ops.nn.Linear(12, 7, bias=bias, dtype=torch.float64)
    assert isinstance(ours, torch.nn.Linear) and ours.in_features == 12 and ours.out_features == 7
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = rand((4, 12), torch.float64, "cpu", rng)
    torch.testing.assert_close(ours(x), theirs(x))
    ours.reset_parameters()
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
    act = optimized_ops.nn.Linear(12, 7, bias=bias, activation="silu", dtype=torch.float64)
    act.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(act(x), F.silu(theirs(x)))


def test_nn_linear_gradients_and_repr(rng):
    m = optimized_ops.nn.Linear(6, 3, activation="relu", variant="cpu")
    assert "activation='relu'" in repr(m) and "variant='cpu'" in repr(m)
    assert repr(optimized_ops.nn.Linear(6, 3)) == repr(torch.nn.Linear(6, 3))
    ref = torch.nn.Linear(6, 3)
    ref.load_state_dict(m.state_dict())
    x = rand((5, 6), torch.float32, "cpu", rng)
    m(x).sum().backward()
    F.relu(ref(x)).sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad)
    torch.testing.assert_close(m.bias.grad, ref.bias.grad)
    with pytest.raises(ValueError, match=r"variant: expected one of auto, cpu, naive, fused, persistent; given 'x'"):
        optimized_ops.nn.Linear(6, 3, variant="x")
    with pytest.raises(ValueError, match=r"activation: expected None or one of none, relu, gelu, gelu_tanh, silu; "
                                         r"given 'tanh'"):
        optimized_ops.nn.Linear(6, 3, activation="tanh")


# ---- errors --------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    x, w, b = torch.ones(3, 8), torch.ones(4, 8), torch.ones(4)
    cases = [
        (lambda: optimized_ops.linear(x, w, b, "tanh"),
         ValueError, r"optimized::linear_forward: activation: expected one of none, relu, gelu, gelu_tanh, silu; "
                     r"given 'tanh'"),
        (lambda: optimized_ops.linear(x, torch.ones(4, 7), b),
         ValueError, r"optimized::linear_forward: weight: expected shape \(N, 8\) \(K = x's last dimension\); "
                     r"given \(4, 7\)"),
        (lambda: optimized_ops.linear(x, torch.ones(8), b),
         ValueError, r"optimized::linear_forward: weight: expected a 2-D tensor \(out_features N, in_features K\); "
                     r"given shape \[8\]"),
        (lambda: optimized_ops.linear(torch.tensor(1.0), w, b),
         ValueError, r"optimized::linear_forward: x: expected a tensor of at least 1 dimension"),
        (lambda: optimized_ops.linear(x, w, torch.ones(5)),
         ValueError, r"optimized::linear_forward: bias: expected a contiguous vector of 4 elements \(N\)"),
        (lambda: optimized_ops.linear(x, w.double(), b),
         ValueError, r"optimized::linear_forward: weight: expected dtype fp32 \(x's\); given fp64"),
        (lambda: optimized_ops.linear(x, w, b, variant="fastest"),
         ValueError, r"optimized::linear_forward: variant: expected one of"),
        (lambda: optimized_ops.linear(x, w, b, variant="naive"),
         ValueError, r"optimized::linear_forward: .*naive runs on CUDA tensors"),
        (lambda: optimized_ops.linear(torch.ones(3, 0), torch.ones(4, 0), None),
         ValueError, r"optimized::linear_forward: x: expected in_features K \(the last dimension\) >= 1"),
        (lambda: optimized_ops.linear(x.int(), w.int(), None),
         NotImplementedError, r"optimized::linear_forward: x: expected dtype fp32, fp16, bf16 or fp64"),
        (lambda: ops.linear_backward(torch.ones(3, 5), x, w, None, b),
         ValueError, r"optimized::linear_backward: grad_output: expected shape \[3, 4\] \(input's leading "
                     r"dimensions, out_features N\); given \[3, 5\]"),
        (lambda: ops.linear_backward(torch.ones(3, 4), x, w, torch.ones(2, 4), b, activation="relu"),
         ValueError, r"optimized::linear_backward: pre: expected shape \[3, 4\]"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn()


# ---- fp8 ---------------------------------------------------------------------------------------------

def fp8_emulate(t: torch.Tensor, fmt) -> torch.Tensor:
    """t as the fp8 GEMM sees it (per-tensor current scaling, linear.h): q = fp8_max / amax in
    float32, fp8(clamp(t * q)) rounded to nearest even, times 1 / q; in float64."""
    fmax = 448.0 if fmt == torch.float8_e4m3fn else 57344.0
    t32 = t.detach().float().cpu()
    amax = t32.abs().max() if t32.numel() else torch.tensor(0.0)
    q = torch.tensor(1.0) if amax == 0 else torch.tensor(fmax, dtype=torch.float32) / amax
    return (t32 * q).clamp(-fmax, fmax).to(fmt).double() * (1.0 / q).double()


def fp8_check(x, w, b, dy, activation, variant, dtype):
    """Forward and the three gradients of optimized_ops.linear(fp8=True) against the emulated
    float64 reference (x, W e4m3; g = dy * act'(pre) e5m2; db from the unquantized g)."""
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    bs = None if b is None else b.clone().requires_grad_()
    y = optimized_ops.linear(xs, ws, bs, activation, variant=variant, fp8=True)
    y.backward(dy)
    xq, wq = fp8_emulate(x, torch.float8_e4m3fn), fp8_emulate(w, torch.float8_e4m3fn)
    pre = F.linear(xq, wq, None if b is None else b.double().cpu())
    y_ref = torch_act(pre, activation)
    # g as the op computes it: dy * act'(pre) at the op's own pre (the fp8 GEMM's accumulation moves pre
    # further than a rounding: the exact product would not do)
    if activation == "none":
        g = dy.double().cpu()
    else:
        _, pre_op = ops.linear_forward(x, w, b, activation=activation, save_pre=True, variant=variant, fp8=True)
        z = pre_op.double().cpu().requires_grad_()
        (gz,) = torch.autograd.grad(torch_act(z, activation), z, dy.double().cpu())
        g = gz.to(dtype).double()
    gq = fp8_emulate(g, torch.float8_e5m2)
    k, n = x.shape[-1], w.shape[0]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else tolerance(dtype, k)
    torch.testing.assert_close(y.double().cpu(), y_ref, **tol)
    # an act' one ulp off may move an element of g one e5m2 step (25% of |g| <= |dy|): one such step of
    # |W|'s or |x|'s largest allowed where an activation is on
    one_step = 0.25 * max(w.abs().max().item(), x.abs().max().item())
    gtol = tol if activation == "none" else dict(rtol=0.02, atol=one_step + 0.02)
    torch.testing.assert_close(xs.grad.double().cpu(), gq @ wq, **gtol)
    torch.testing.assert_close(ws.grad.double().cpu(), gq.reshape(-1, n).t() @ xq.reshape(-1, k), **gtol)
    if b is not None:
        torch.testing.assert_close(bs.grad.double().cpu(), g.reshape(-1, n).sum(0),
                                   **(tol if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)))


@pytest.mark.parametrize("activation", ["none", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
def test_fp8_matches_emulation(activation, dtype, rng):
    x, w, b = make((3, 13, 37), 29, dtype, "cpu", rng)
    dy = rand((3, 13, 29), dtype, "cpu", rng)
    fp8_check(x, w, b, dy, activation, "auto", dtype)
    fp8_check(x[:, ::2], w, None, dy[:, ::2], activation, "cpu", dtype)  # strided x, no bias


def test_fp8_module_compile_and_refusals(rng):
    torch._dynamo.reset()
    layer = optimized_ops.nn.Linear(16, 24, activation="gelu", fp8=True)
    assert "fp8=True" in repr(layer)
    x = rand((5, 16), torch.float32, "cpu", rng).requires_grad_()
    compiled = torch.compile(layer, fullgraph=True)
    out, expected = compiled(x), layer(x)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), [x, *layer.parameters()])
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), [x, *layer.parameters()])):
        torch.testing.assert_close(got, want)
    # the fp8 answer differs from the full-precision one (it is really quantized), but not by much
    full = optimized_ops.nn.Linear(16, 24, activation="gelu")
    full.load_state_dict(layer.state_dict())
    diff = (full(x) - out).abs().max().item()
    assert 0 < diff < 0.1
    torch.library.opcheck(ops.linear_forward.default, (x.detach(), layer.weight.detach(), layer.bias.detach()),
                          dict(activation="gelu", save_pre=True, fp8=True))
    with pytest.raises(NotImplementedError, match=r"fp8 quantizes fp32, fp16 or bf16 inputs; given fp64"):
        optimized_ops.linear(x.double(), layer.weight.double(), None, fp8=True)


# ---- CUDA ----------------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("variant", ["auto", "naive", "fused", "persistent"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_dname)
def test_cuda_matches_torch(variant, activation, dtype, rng):
    if variant in ("fused", "persistent") and dtype == torch.float32:
        pytest.skip("fused and persistent take float16 and bfloat16")
    if variant == "persistent" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("persistent runs on compute capability 9.0")
    x, w, b = make((4, 33, 64), 48, dtype, "cuda", rng)  # K, N multiples of 8: TMA-loadable rows
    dy = rand((4, 33, 48), dtype, "cuda", rng)
    try:
        out, got = _grads(lambda x, w, b: optimized_ops.linear(x, w, b, activation, variant=variant), (x, w, b), dy)
    except NotImplementedError as e:  # a rung this build does not have (persistent without sm_90a sources)
        pytest.skip(str(e))
    ref, want = _grads(lambda x, w, b: torch_act(F.linear(x, w, b), activation),
                       (x.double().cpu(), w.double().cpu(), b.double().cpu()), dy.double().cpu())
    tol = tolerance(dtype, 64) if dtype == torch.float32 else dict(rtol=3e-2, atol=6e-2)
    torch.testing.assert_close(out.double().cpu(), ref, **tol)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), r, **(tol if dtype == torch.float32 else
                                                             dict(rtol=3e-2, atol=0.25)))


@requires_cuda
@pytest.mark.parametrize("variant", ["auto", "naive", "persistent"])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_cuda_fp8_matches_emulation(variant, activation, rng):
    if variant == "persistent" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("persistent runs on compute capability 9.0")
    dtype = torch.bfloat16
    x, w, b = make((4, 67, 200), 136, dtype, "cuda", rng)  # odd sizes: the casts write their own rows
    dy = rand((4, 67, 136), dtype, "cuda", rng)
    try:
        fp8_check(x, w, b, dy, activation, variant, dtype)
    except NotImplementedError as e:
        pytest.skip(str(e))
    with pytest.raises(NotImplementedError, match=r"fp8 runs on auto, cpu, naive and persistent"):
        optimized_ops.linear(x, w, b, variant="fused", fp8=True)


@requires_cuda
def test_cuda_nn_linear_compiles(rng):
    torch._dynamo.reset()
    model = _Block().cuda().to(torch.bfloat16)
    x = rand((8, 16), torch.bfloat16, "cuda", rng)
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))


@requires_cuda
@pytest.mark.parametrize("variant,fp8", [("auto", False), ("fused", False), ("auto", True)],
                         ids=["auto", "fused", "auto-fp8"])
def test_cuda_graph_forward_backward(variant, fp8, rng):
    """Forward and backward (x, W and b gradients through autograd) captured once in a
    torch.cuda.CUDAGraph, replayed over fresh inputs copied into the static tensors: each replay
    equals an eager run of the same inputs bitwise (the same kernels, deterministic bias gradient)."""
    dtype, act = torch.bfloat16, "gelu"
    x = torch.zeros(3, 40, 64, dtype=dtype, device="cuda", requires_grad=True)
    w = torch.zeros(96, 64, dtype=dtype, device="cuda", requires_grad=True)
    b = torch.zeros(96, dtype=dtype, device="cuda", requires_grad=True)
    dy = torch.zeros(3, 40, 96, dtype=dtype, device="cuda")

    def step():
        y = optimized_ops.linear(x, w, b, act, variant=variant, fp8=fp8)
        return (y, *torch.autograd.grad(y, (x, w, b), dy))

    def fill():
        with torch.no_grad():
            for t in (x, w, b, dy):
                t.copy_(rand(tuple(t.shape), dtype, "cpu", rng))

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture (torch's rule)
        try:
            step()
        except NotImplementedError as e:  # a rung this build does not have
            pytest.skip(str(e))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for i in range(5):
        fill()
        graph.replay()
        eager = step()
        for name, g, e in zip(("y", "dx", "dw", "db"), captured, eager):
            assert torch.equal(g, e), f"replay {i}: {name}: graph != eager"
