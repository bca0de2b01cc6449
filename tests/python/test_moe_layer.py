"""optimized_ops.moe_layer and optimized_ops.nn.MoE (the MoE layer on the family's ops) against the same layer in
plain torch in float64 (bench/benchmark_moe.py's reference_layer, with the expert choice of our router, checked to
be a top-k of the float64 logits): the output, the aux and z losses, the metrics, and the gradients of x, the
router weight, w13 and w2 (of the output, and of each loss); E in {1, 8, 64, 256}, k in {1, 2, 8}, T in {1, 7,
4097}; capacity mode dropping exactly the documented pairs; empty experts; every token to one expert; NaN logits;
the same bits across runs; the module's state_dict; torch.compile(fullgraph=True); CUDA-graph capture of forward
+ backward; the torch peers of the benchmark against the same reference. CUDA tests skip without a GPU.

Tolerance: the reduction rule (design.md, flash-attention's): per tensor, max |ours - fp64| <= 2 max |same -
fp64| + 2 u max |fp64| + 16 sqrt(n) 2^-24 max |fp64| + floor, with `same` the torch reference run in the inputs'
dtype and n = max(T, d, d_ff) (benchmark_moe.layer_check)."""

from __future__ import annotations

import math

import pytest
import torch

import optimized_ops
from conftest import requires_cuda
from optimized_ops.moe.layer import moe_capacity, router_logits

import benchmark_moe as bm  # bench/ is on sys.path (conftest.py): the reference and the torch peers

DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _uniform(shape, scale, dtype, device, rng):
    """U(-scale, scale) drawn in float64 on the CPU (reproducible), rounded once to dtype."""
    return ((torch.rand(shape, generator=rng, dtype=torch.float64) * 2 - 1) * scale).to(dtype).to(device)


def make_inputs(e, t, d, f, dtype, device, rng, router_scale=3.0):
    """x U(-1, 1); router weight U(+-router_scale / sqrt(d)) (logits O(1): a real choice among the experts);
    w13 U(+-1/sqrt(d)), w2 U(+-1/sqrt(d_ff)); all leaves requiring grad."""
    x = _uniform((t, d), 1.0, dtype, device, rng)
    rw = _uniform((e, d), router_scale / math.sqrt(d), dtype, device, rng)
    w13 = _uniform((e, d, 2 * f), 1 / math.sqrt(d), dtype, device, rng)
    w2 = _uniform((e, f, d), 1 / math.sqrt(f), dtype, device, rng)
    return [t_.requires_grad_() for t_ in (x, rw, w13, w2)]


def our_choice(x, rw, k, scoring="softmax"):
    """The layer's own expert choice: its router logits (bit for bit) through moe_route."""
    with torch.no_grad():
        return optimized_ops.moe_route(router_logits(x.reshape(-1, x.shape[-1]), rw), k, scoring=scoring)[0]


def check_layer(leaves, k, dtype, rng, *, capacity_factor=None, scoring="softmax", normalize=None, grads=True):
    """Runs the layer on leaves (x, router weight, w13, w2) and checks it against the float64 reference: out,
    the losses, the metrics, and (grads) the gradients of <out, dout>, of aux_loss and of z_loss."""
    x, rw, w13, w2 = leaves
    t, d = x.shape
    e, f = rw.shape[0], w2.shape[1]
    out, m = optimized_ops.moe_layer(x, rw, w13, w2, k, capacity_factor=capacity_factor, scoring=scoring,
                                     normalize=normalize)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    ids = our_choice(x, rw, k, scoring).cpu()
    assert bm.choice_is_topk(ids, x.cpu(), rw.cpu()), "the router's choice is not a top-k of the float64 logits"
    capacity = 0 if capacity_factor is None else moe_capacity(capacity_factor, t, k, e)

    def reference(dt):
        lv = [t_.detach().cpu().to(dt).requires_grad_() for t_ in leaves]
        return lv, bm.reference_layer(*lv, k, ids, capacity=capacity, scoring=scoring, normalize=normalize,
                                      dtype=dt)

    (rlv, (rout, raux, rz)), (slv, (sout, saux, sz)) = reference(torch.float64), reference(dtype)
    n = max(t, d, f)
    v = bm.layer_check(["out", "aux_loss", "z_loss"], [out.cpu(), m.aux_loss.cpu(), m.z_loss.cpu()],
                       [rout, raux, rz], [sout, saux, sz], dtype, n)
    assert v["passed"], v["first_failure"]
    torch.testing.assert_close(m.loss.cpu(), (0.01 * m.aux_loss + 0.001 * m.z_loss).cpu())

    # metrics: the documented definitions, from the choice
    kept = bm.reference_kept(ids, e, capacity)
    flat = ids.reshape(-1).long()
    want_counts = torch.bincount(flat[kept], minlength=e)
    assert m.tokens_per_expert.dtype == torch.int32 and m.tokens_per_expert.shape == (e,)
    assert m.tokens_per_expert.cpu().tolist() == want_counts.tolist()
    assert int(m.dropped) == t * k - int(kept.sum())
    load = torch.bincount(flat, minlength=e).double() / (t * k)
    torch.testing.assert_close(m.load.cpu().double(), load)
    torch.testing.assert_close(m.utilization.cpu().double(),
                               want_counts.double().mean() / want_counts.double().max().clamp(min=1))
    assert m.active_experts.item() == pytest.approx((want_counts > 0).double().mean().item())
    assert m.imbalance.item() == pytest.approx(e * load.max().item(), rel=1e-6)
    if not grads:
        return out, m

    # gradients: of <out, dout> (every leaf), of aux_loss and of z_loss (x and the router weight)
    dout = _uniform((t, d), 1.0, dtype, "cpu", rng)
    cases = [("out", out, rout, sout, dout, 4), ("aux_loss", m.aux_loss, raux, saux, None, 2),
             ("z_loss", m.z_loss, rz, sz, None, 2)]
    for what, y, ry, sy, dy, nleaves in cases:
        g = torch.autograd.grad(y, leaves[:nleaves], None if dy is None else dy.to(x.device), retain_graph=True,
                                allow_unused=True)
        rg = torch.autograd.grad(ry, rlv[:nleaves], None if dy is None else dy.double(), retain_graph=True)
        sg = torch.autograd.grad(sy, slv[:nleaves], None if dy is None else dy.to(sy.dtype), retain_graph=True)
        names = [f"d{what}/d{name}" for name in ("x", "router_weight", "w13", "w2")[:nleaves]]
        got = [torch.zeros_like(r) if gg is None else gg.cpu() for gg, r in zip(g, rg)]
        v = bm.layer_check(names, got, rg, sg, dtype, n)
        assert v["passed"], v["first_failure"]
    return out, m


# (E, k, T, d_model, d_ff): the E in {1, 8, 64, 256}, k in {1, 2, 8}, T in {1, 7, 4097}; the big T at small
# widths (the float64 reference is a per-expert loop); odd widths everywhere.
SHAPES = [(1, 1, 1, 23, 37), (1, 1, 7, 23, 37), (8, 1, 7, 23, 37), (8, 2, 1, 23, 37), (8, 2, 7, 23, 37),
          (8, 8, 7, 23, 37), (8, 2, 4097, 12, 20), (64, 2, 7, 23, 37), (64, 8, 7, 23, 37), (64, 8, 4097, 6, 10),
          (256, 8, 1, 23, 37), (256, 8, 7, 23, 37), (256, 1, 4097, 6, 10)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}k{}T{}d{}f{}".format(*s))
def test_layer_matches_float64(device, shape, rng):
    e, k, t, d, f = shape
    check_layer(make_inputs(e, t, d, f, torch.float32, device, rng), k, torch.float32, rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_layer_low_precision(device, dtype, rng):
    check_layer(make_inputs(8, 97, 32, 48, dtype, device, rng), 2, dtype, rng)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scoring,normalize", [("sigmoid", True), ("sigmoid", False), ("softmax", False)])
def test_layer_scoring_options(device, scoring, normalize, rng):
    check_layer(make_inputs(16, 31, 23, 37, torch.float32, device, rng), 4, torch.float32, rng, scoring=scoring,
                normalize=normalize)


def test_leading_dimensions_flatten(rng):
    x, rw, w13, w2 = make_inputs(8, 15, 16, 24, torch.float32, "cpu", rng)
    out, m = optimized_ops.moe_layer(x.reshape(3, 5, 16), rw, w13, w2, 2)
    flat, _ = optimized_ops.moe_layer(x, rw, w13, w2, 2)
    assert out.shape == (3, 5, 16) and torch.equal(out.reshape(15, 16), flat)


# ---- capacity, empty experts, one expert, NaN -------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25])
def test_capacity_matches_float64(device, capacity_factor, rng):
    """Random routing at 8 experts top-2: the reference keeps each expert's first ceil(cf T k / E) pairs in pair
    order, drops the rest (adding zero); outputs, metrics and gradients agree."""
    leaves = make_inputs(8, 53, 23, 37, torch.float32, device, rng)
    out, m = check_layer(leaves, 2, torch.float32, rng, capacity_factor=capacity_factor)
    if capacity_factor == 0.5:
        assert int(m.dropped) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_capacity_drops_later_tokens_exactly(device, rng):
    """Every token prefers experts 0 and 1: with capacity ceil(0.5 * 37 * 2 / 8) = 5 they keep tokens 0..4 and
    drop the rest, whose outputs are exact zeros (and whose inputs get exact zero gradients)."""
    t, e, k, d, f = 37, 8, 2, 16, 24
    x, rw, w13, w2 = (t_.detach() for t_ in make_inputs(e, t, d, f, torch.float32, "cpu", rng, router_scale=0.1))
    x[:, 0] = 1.0
    rw[:, 0] = torch.tensor([10.0, 9.0] + [0.0] * (e - 2))
    leaves = [t_.to(device).requires_grad_() for t_ in (x, rw, w13, w2)]
    cap = moe_capacity(0.5, t, k, e)
    assert cap == 5
    out, m = optimized_ops.moe_layer(*leaves, k, capacity_factor=0.5)
    assert m.tokens_per_expert.cpu().tolist() == [5, 5] + [0] * (e - 2)
    assert int(m.dropped) == t * k - 10
    assert (out[cap:] == 0).all() and (out[:cap] != 0).any(dim=1).all()
    gx, = torch.autograd.grad(out, leaves[0], torch.ones_like(out))
    assert (gx[cap:] == 0).all()
    assert m.utilization.item() == 2 / e and m.active_experts.item() == 2 / e  # mean / max = (10 / 8) / 5
    assert m.imbalance.item() == pytest.approx(e / 2)
    check_layer(leaves, k, torch.float32, rng, capacity_factor=0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_all_tokens_to_one_expert(device, rng):
    t, e, d, f = 29, 8, 16, 24
    x, rw, w13, w2 = (t_.detach() for t_ in make_inputs(e, t, d, f, torch.float32, "cpu", rng, router_scale=0.1))
    x[:, 0] = 1.0
    rw[3, 0] = 20.0
    leaves = [t_.to(device).requires_grad_() for t_ in (x, rw, w13, w2)]
    out, m = check_layer(leaves, 1, torch.float32, rng)
    assert m.tokens_per_expert.cpu().tolist() == [0, 0, 0, t, 0, 0, 0, 0]
    assert m.utilization.item() == pytest.approx(1 / e) and m.active_experts.item() == 1 / e
    assert m.imbalance.item() == pytest.approx(e) and int(m.dropped) == 0
    assert m.aux_loss.item() == pytest.approx(e * m.load[3].item() * 1.0, rel=1e-3)  # P_3 ~ 1


@pytest.mark.parametrize("device", DEVICES)
def test_empty_experts(device, rng):
    """7 tokens top-2 over 64 experts: at least 50 experts get nothing; their weight gradients are zeros."""
    x, rw, w13, w2 = make_inputs(64, 7, 23, 37, torch.float32, device, rng)
    out, m = check_layer([x, rw, w13, w2], 2, torch.float32, rng)
    empty = (m.tokens_per_expert == 0).cpu()
    assert int(empty.sum()) >= 50 and m.active_experts.item() == pytest.approx(1 - empty.double().mean().item())
    out, m = optimized_ops.moe_layer(x, rw, w13, w2, 2)
    g13, g2 = torch.autograd.grad(out.sum(), (w13, w2))
    assert (g13.cpu()[empty] == 0).all() and (g2.cpu()[empty] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_nan_input_stays_in_its_token(device, rng):
    """moe_route's rule: a NaN logit makes its token's weights and lse NaN: its output row and the z-loss are NaN,
    the other tokens' outputs stay finite."""
    x, rw, w13, w2 = (t_.detach() for t_ in make_inputs(8, 11, 16, 24, torch.float32, device, rng))
    x[4, 3] = float("nan")
    out, m = optimized_ops.moe_layer(x, rw, w13, w2, 2)
    assert torch.isnan(out[4]).all()
    assert torch.isfinite(out[torch.arange(11, device=device) != 4]).all()
    assert torch.isnan(m.z_loss) and int(m.tokens_per_expert.sum()) == 22


# ---- determinism, module, compile, CUDA graphs -------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_same_bits_across_runs(device, capacity_factor, rng):
    leaves = make_inputs(16, 301, 32, 48, torch.bfloat16 if device == "cuda" else torch.float32, device, rng)
    dout = torch.randn(301, 32, device=device).to(leaves[0].dtype)

    def run():
        out, m = optimized_ops.moe_layer(*leaves, 2, capacity_factor=capacity_factor)
        grads = torch.autograd.grad([out, m.loss], leaves, [dout, torch.ones_like(m.loss)])
        return [out, m.aux_loss, m.z_loss, m.tokens_per_expert, *grads]

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_module_state_dict_and_forward(rng):
    torch.manual_seed(0)
    moe = optimized_ops.nn.MoE(24, 40, num_experts=8, top_k=2, capacity_factor=1.5)
    assert set(moe.state_dict()) == {"router.weight", "w13", "w2"}
    assert moe.w13.shape == (8, 24, 80) and moe.w2.shape == (8, 40, 24) and moe.router.weight.shape == (8, 24)
    assert moe.w13.abs().max() <= 1 / math.sqrt(24) and moe.w2.abs().max() <= 1 / math.sqrt(40)
    other = optimized_ops.nn.MoE(24, 40, num_experts=8, top_k=2, capacity_factor=1.5)
    other.load_state_dict(moe.state_dict())
    x = _uniform((3, 5, 24), 1.0, torch.float32, "cpu", rng)
    y = moe(x)
    assert y.shape == x.shape and torch.equal(y, other(x))
    want, m = optimized_ops.moe_layer(x, moe.router.weight, moe.w13, moe.w2, 2, capacity_factor=1.5)
    assert torch.equal(y, want) and torch.equal(moe.last_metrics.aux_loss, m.aux_loss)
    (y.square().mean() + moe.last_metrics.loss).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in moe.parameters())
    assert "num_experts=8" in repr(moe) and "capacity_factor=1.5" in repr(moe)


def test_module_and_layer_refuse_bad_arguments():
    with pytest.raises(ValueError, match="activation: expected 'swiglu'"):
        optimized_ops.nn.MoE(8, 16, 4, 2, activation="gelu")
    with pytest.raises(ValueError, match=r"top_k: expected an int 1 <= k <= min\(E, 32\) = 4; given 5"):
        optimized_ops.nn.MoE(8, 16, 4, 5)
    with pytest.raises(ValueError, match="capacity_factor"):
        optimized_ops.nn.MoE(8, 16, 4, 2, capacity_factor=0)
    with pytest.raises(ValueError, match="variant: expected one of auto"):
        optimized_ops.nn.MoE(8, 16, 4, 2, variant="fast")
    x, rw, w13, w2 = torch.randn(5, 8), torch.randn(4, 8), torch.randn(4, 8, 32), torch.randn(4, 16, 8)
    with pytest.raises(ValueError, match=r"router_weight: expected \(E, d_model = 8\)"):
        optimized_ops.moe_layer(x, torch.randn(4, 7), w13, w2, 2)
    with pytest.raises(ValueError, match=r"w2: expected \(E, d_ff, d_model\) = \[4, 16, 8\]"):
        optimized_ops.moe_layer(x, rw, w13, torch.randn(4, 8, 16), 2)
    with pytest.raises(ValueError, match="x, w13, w2: expected one dtype"):
        optimized_ops.moe_layer(x.double(), rw, w13, w2, 2)
    with pytest.raises(ValueError, match="top_k"):
        optimized_ops.moe_layer(x, rw, w13, w2, 5)
    with pytest.raises(ValueError, match="capacity_factor"):
        optimized_ops.moe_layer(x, rw, w13, w2, 2, capacity_factor=-1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_torch_compile_fullgraph(device, capacity_factor, rng):
    torch._dynamo.reset()
    leaves = make_inputs(8, 37, 16, 24, torch.float32, device, rng)

    def layer(x, rw, w13, w2):
        out, m = optimized_ops.moe_layer(x, rw, w13, w2, 2, capacity_factor=capacity_factor)
        return out, m

    compiled = torch.compile(layer, fullgraph=True)
    (out, m), (want, wm) = compiled(*leaves), layer(*leaves)
    torch.testing.assert_close(out, want)
    assert isinstance(m, optimized_ops.MoEMetrics)
    for name in ("tokens_per_expert", "dropped", "aux_loss", "z_loss", "utilization"):
        torch.testing.assert_close(getattr(m, name), getattr(wm, name))
    got = torch.autograd.grad([out, m.loss], leaves, [torch.ones_like(out), torch.ones_like(m.loss)])
    exp = torch.autograd.grad([want, wm.loss], leaves, [torch.ones_like(want), torch.ones_like(wm.loss)])
    for g, e_ in zip(got, exp):
        torch.testing.assert_close(g, e_)


@pytest.mark.parametrize("device", DEVICES)
def test_module_compiles_with_its_metrics(device, rng):
    """torch.compile(fullgraph=True) of nn.MoE: the forward's attribute write (last_metrics) is replayed by the
    compiled module, and the losses' gradients flow through it."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    moe = optimized_ops.nn.MoE(16, 24, num_experts=8, top_k=2, device=device)
    x = _uniform((2, 9, 16), 1.0, torch.float32, device, rng).requires_grad_()
    y = torch.compile(moe, fullgraph=True)(x)
    m = moe.last_metrics
    want = moe(x)
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(m.aux_loss, moe.last_metrics.aux_loss)
    got = torch.autograd.grad(y.sum() + m.loss, [x, *moe.parameters()])
    exp = torch.autograd.grad(want.sum() + moe.last_metrics.loss, [x, *moe.parameters()])
    for g, e_ in zip(got, exp):
        torch.testing.assert_close(g, e_)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_cuda_graph_forward_backward(dtype, rng):
    """Dropless forward and backward (every leaf's gradient, the losses included) captured once in a
    torch.cuda.CUDAGraph, replayed over fresh inputs copied into the static tensors: each replay equals an eager
    run bitwise (nothing is read back to the host, every sum has a fixed order)."""
    t, e, k, d, f = 203, 16, 2, 64, 96
    leaves = [torch.zeros(s, dtype=dtype, device="cuda", requires_grad=True)
              for s in ((t, d), (e, d), (e, d, 2 * f), (e, f, d))]
    dout = torch.zeros(t, d, dtype=dtype, device="cuda")

    def step():
        out, m = optimized_ops.moe_layer(*leaves, k)
        grads = torch.autograd.grad([out, m.loss], leaves, [dout, torch.ones_like(m.loss)])
        return (out, m.tokens_per_expert, m.aux_loss, m.z_loss, *grads)

    def fill():
        fresh = make_inputs(e, t, d, f, dtype, "cpu", rng)
        with torch.no_grad():
            for dst, src in zip(leaves, fresh):
                dst.copy_(src)
            dout.copy_(_uniform((t, d), 1.0, dtype, "cpu", rng))

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before capture (torch's rule)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    names = ("out", "tokens_per_expert", "aux_loss", "z_loss", "dx", "drouter", "dw13", "dw2")
    for i in range(4):
        fill()
        graph.replay()
        eager = step()
        for name, g, e_ in zip(names, captured, eager):
            assert torch.equal(g, e_), f"replay {i}: {name}: graph != eager"


# ---- the benchmark's torch peers are the same layer --------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("peer", ["torch_loop_layer", "torch_grouped_mm_layer"])
def test_torch_peers_match_float64(device, peer, rng):
    if peer == "torch_grouped_mm_layer" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    dtype = torch.float32
    if device == "cuda" and peer == "torch_grouped_mm_layer":
        if torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("torch._grouped_mm needs a 9.0 device")
        dtype = torch.bfloat16  # its CUDA kernels take bfloat16
    leaves = make_inputs(8, 67, 32, 48, dtype, device, rng)
    x, rw = leaves[:2]
    out, aux, z = getattr(bm, peer)(*leaves, 2)
    ids = our_choice(x, rw, 2).cpu()
    lv64 = [t_.detach().cpu().double().requires_grad_() for t_ in leaves]
    lvs = [t_.detach().cpu().requires_grad_() for t_ in leaves]
    rout, raux, rz = bm.reference_layer(*lv64, 2, ids)
    sout, saux, sz = bm.reference_layer(*lvs, 2, ids, dtype=dtype)
    dout = _uniform((67, 32), 1.0, dtype, "cpu", rng)
    g = torch.autograd.grad([out, 0.01 * aux + 0.001 * z], leaves, [dout.to(device), torch.ones_like(aux)])
    rg = torch.autograd.grad([rout, 0.01 * raux + 0.001 * rz], lv64, [dout.double(), torch.ones_like(raux)])
    sg = torch.autograd.grad([sout, 0.01 * saux + 0.001 * sz], lvs, [dout, torch.ones_like(saux)])
    v = bm.layer_check(["out", "aux", "z", "dx", "drouter", "dw13", "dw2"],
                       [out.cpu(), aux.cpu(), z.cpu(), *(t_.cpu() for t_ in g)], [rout, raux, rz, *rg],
                       [sout, saux, sz, *sg], dtype, max(67, 32, 48))
    assert v["passed"], v["first_failure"]


def test_benchmark_group_sizes():
    assert bm.group_sizes(8, 2, 8192, "balanced") == [2048] * 8
    sizes = bm.group_sizes(8, 2, 8192, "zipf")
    assert sum(sizes) == 16384 and sizes[0] == max(sizes) <= 8192 and min(sizes) > 0
    assert sizes == bm.group_sizes(8, 2, 8192, "zipf")  # seeded
