"""optimized_ops.moe_route, moe_permute and grouped_mm (the MoE family, in progress) against torch: the
router against torch's softmax / sigmoid + topk in float64 and its gradients (moe_route_backward) against
autograd of the same in float64, the permutation against a stable argsort,
grouped_mm and its gradients against a per-group loop of torch.matmul in float64 (and
torch._grouped_mm on CUDA); opcheck, fake kernels, torch.compile. CUDA tests skip without a GPU."""

from __future__ import annotations

import pytest
import torch

import optimized_ops
from conftest import rand, requires_cuda

ops = torch.ops.optimized
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _route_ref(logits, k, scoring, normalize, bias=None):
    l64 = logits.double()
    s = torch.softmax(l64, -1) if scoring == "softmax" else torch.sigmoid(l64)
    choice = s + (bias.double() if bias is not None else 0)
    ids = torch.topk(choice, k, dim=-1).indices
    w = s.gather(-1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w, torch.logsumexp(l64, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scoring,normalize,use_bias", [("softmax", False, False), ("softmax", True, False),
                                                         ("sigmoid", True, True)])
def test_route_matches_torch(device, scoring, normalize, use_bias, rng):
    logits = rand((97, 64), torch.float32, device, rng) * 3
    bias = rand((64,), torch.float32, device, rng) * 0.3 if use_bias else None
    ids, w, lse = optimized_ops.moe_route(logits, 8, bias=bias, scoring=scoring, normalize=normalize)
    rids, rw, rlse = _route_ref(logits.cpu(), 8, scoring, normalize, None if bias is None else bias.cpu())
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.device.type == device
    torch.testing.assert_close(ids.long().cpu(), rids)
    torch.testing.assert_close(w.double().cpu(), rw, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(lse.double().cpu(), rlse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_route_ties_and_nan(device):
    logits = torch.zeros(3, 16, device=device)
    ids, w, _ = optimized_ops.moe_route(logits, 4)
    assert ids.cpu().tolist() == [[0, 1, 2, 3]] * 3  # ties: the lower index wins
    logits = torch.randn(4, 8, device=device)
    logits[1, 5] = float("nan")
    ids, w, lse = optimized_ops.moe_route(logits, 2)
    assert torch.isnan(w[1]).all() and torch.isnan(lse[1]) and not torch.isnan(w[[0, 2, 3]]).any()
    assert 5 not in ids[1].tolist()  # NaN ranks last


# The router's scoring modes: moe_route's keyword options (the forward's choice: the bias and groups
# change only which experts, not the gradient's formula).
ROUTE_MODES = {
    "softmax": dict(),
    "softmax-normalize": dict(normalize=True, routed_scale=2.5),
    "topk_softmax": dict(topk_softmax=True),
    "topk_softmax-normalize": dict(topk_softmax=True, normalize=True),
    "sigmoid": dict(scoring="sigmoid"),
    "sigmoid-normalize-bias": dict(scoring="sigmoid", normalize=True, routed_scale=2.5, bias=True),
    "sigmoid-groups": dict(scoring="sigmoid", normalize=True, bias=True, n_groups=8, topk_groups=3),
    "softmax-groups-bias": dict(bias=True, n_groups=8, topk_groups=3),
}


def _route_weights_ref(l64, ids, scoring="softmax", topk_softmax=False, normalize=False, routed_scale=1.0, **_):
    """(topk_weights, lse) of the chosen ids with torch ops on float64 logits: softmax then gather, softmax of
    the gathered logits, or sigmoid then gather; normalize; scale."""
    ids = ids.long()
    if scoring == "sigmoid":
        w = torch.sigmoid(l64).gather(-1, ids)
    elif topk_softmax:
        w = torch.softmax(l64.gather(-1, ids), -1)
    else:
        w = torch.softmax(l64, -1).gather(-1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w * routed_scale, torch.logsumexp(l64, -1)


def _route_options(mode, e, device, rng):
    opts = dict(ROUTE_MODES[mode])
    bias = rand((e,), torch.float32, device, rng) * 0.3 if opts.pop("bias", False) else None
    return opts, bias


# Route-backward tolerances: float32 gradients to fp32 rounding of the softmax terms; float16 and
# bfloat16 ones to one rounding of the output (relative), with a floor for the smallest elements.
_GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-6),
             torch.bfloat16: dict(rtol=1e-2, atol=1e-5)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", list(ROUTE_MODES))
def test_route_gradients_match_torch(device, dtype, mode, rng):
    """autograd through moe_route (topk_weights and lse to the logits, strided rows) against the float64
    torch reference on the same ids, the logits' dtype kept; the bias gets no gradient."""
    t, e, k = 37, 64, 8
    opts, bias = _route_options(mode, e, device, rng)
    if bias is not None:
        bias.requires_grad_()
    wide = (rand((t, e + 5), torch.float32, device, rng) * 3).to(dtype)
    logits = wide[:, :e].detach().requires_grad_()  # rows e + 5 apart
    ids, w, lse = optimized_ops.moe_route(logits, k, bias=bias, **opts)
    gw, gl = rand((t, k), torch.float32, device, rng), rand((t,), torch.float32, device, rng)
    grad, = torch.autograd.grad((w, lse), logits, (gw, gl))
    assert grad.dtype == dtype and grad.shape == logits.shape and grad.device == logits.device
    l64 = logits.detach().double().cpu().requires_grad_()
    rw, rlse = _route_weights_ref(l64, ids.cpu(), **opts)
    torch.testing.assert_close(w.double().cpu(), rw.detach(), rtol=2e-5, atol=1e-6)
    rgrad, = torch.autograd.grad((rw, rlse), l64, (gw.double().cpu(), gl.double().cpu()))
    torch.testing.assert_close(grad.double().cpu(), rgrad, **_GRAD_TOL[dtype])
    if bias is not None:
        w2 = optimized_ops.moe_route(logits, k, bias=bias, **opts)[1]
        assert torch.autograd.grad(w2.sum(), bias, allow_unused=True)[0] is None


@pytest.mark.parametrize("device", DEVICES)
def test_route_gradient_of_one_output(device, rng):
    """Only the weights, or only lse (the router z-loss), used: autograd passes zeros for the other, which
    add nothing -- a NaN logit's sigmoid row stays finite without the lse term; with softmax scoring its
    row is NaN (its weights were)."""
    t, e, k = 9, 16, 2
    logits = (rand((t, e), torch.float32, device, rng) * 3).requires_grad_()
    with torch.no_grad():
        logits[4, 7] = float("nan")
    for scoring in ("sigmoid", "softmax"):
        ids, w, lse = optimized_ops.moe_route(logits, k, scoring=scoring, normalize=True)
        c = rand((t, k), torch.float32, device, rng)
        grad, = torch.autograd.grad((w * c).sum(), logits)
        l64 = logits.detach().double().cpu().requires_grad_()
        rw, _ = _route_weights_ref(l64, ids.cpu(), scoring=scoring, normalize=True)
        rgrad, = torch.autograd.grad((rw * c.double().cpu()).sum(), l64)
        if scoring == "sigmoid":
            # the weights do not depend on the unchosen NaN logit: its gradient is 0 (torch's reference has
            # NaN there, sigmoid's element-wise backward multiplying the zero by NaN)
            assert 7 not in ids[4].tolist() and grad[4, 7].item() == 0
            assert torch.isnan(rgrad[4, 7])
            rgrad[4, 7] = 0
            torch.testing.assert_close(grad.double().cpu(), rgrad, rtol=1e-5, atol=1e-6)
        else:
            assert torch.isnan(grad[4]).all()
            keep = [i for i in range(t) if i != 4]
            torch.testing.assert_close(grad[keep].double().cpu(), rgrad[keep], rtol=1e-5, atol=1e-6)
    # the router z-loss alone: the gradient is 2 lse softmax(logits) / T, NaN for the NaN row
    _, _, lse = optimized_ops.moe_route(logits, k, scoring="sigmoid")
    grad, = torch.autograd.grad(lse.square().mean(), logits)
    l64 = logits.detach().double().cpu().requires_grad_()
    rgrad, = torch.autograd.grad(torch.logsumexp(l64, -1).square().mean(), l64)
    assert torch.isnan(grad[4]).all()
    keep = [i for i in range(t) if i != 4]
    torch.testing.assert_close(grad[keep].double().cpu(), rgrad[keep], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_route_backward_op(device, rng):
    """The backward op itself: absent gradients are zeros, incoming gradients of any strides (a sum's
    expanded ones), opcheck (schema, fake, dispatch) with and without them, and autograd's registration."""
    t, e, k = 13, 8, 2
    logits = rand((t, e), torch.bfloat16, device, rng)
    ids, _, _ = optimized_ops.moe_route(logits, k)
    gw, gl = rand((t, k), torch.float32, device, rng), rand((t,), torch.float32, device, rng)
    zero = ops.moe_route_backward(logits, ids, None, None)
    assert zero.dtype == torch.bfloat16 and (zero == 0).all()
    ones = torch.ones(1, 1, device=device).expand(t, k)
    torch.testing.assert_close(ops.moe_route_backward(logits, ids, ones, None),
                               ops.moe_route_backward(logits, ids, ones.contiguous(), None))
    for args, kwargs in [((logits, ids, gw, gl), {}), ((logits, ids, None, gl), dict(scoring="sigmoid")),
                         ((logits, ids, gw, None), dict(topk_softmax=True, normalize=True, routed_scale=2.0))]:
        torch.library.opcheck(ops.moe_route_backward.default, args, kwargs)
    # moe_route with logits that require grad: autograd's registration checked; aot_dispatch's helper sums
    # every output into one tensor starting from the int32 ids and fails casting the weights' float sum to
    # int64, so the compiled backward is test_route_gradients_compile's
    torch.library.opcheck(ops.moe_route.default, (rand((7, 8), torch.float32, device, rng).requires_grad_(), None),
                          dict(top_k=2, normalize=True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_route_gradients_compile(rng):
    """torch.compile(fullgraph=True) of a router loss, forward and backward, equals eager."""
    logits = (rand((19, 16), torch.float32, "cpu", rng) * 3).requires_grad_()
    c = rand((19, 4), torch.float32, "cpu", rng)

    def loss(logits):
        _, w, lse = optimized_ops.moe_route(logits, 4, scoring="sigmoid", normalize=True)
        return (w * c).sum() + 1e-2 * lse.square().mean()

    torch._dynamo.reset()
    want, = torch.autograd.grad(loss(logits), logits)
    got, = torch.autograd.grad(torch.compile(loss, fullgraph=True)(logits), logits)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capacity", [0, 3])
def test_permute_is_a_stable_sort(device, capacity, rng):
    t, k, e = 131, 2, 16
    ids = torch.randint(0, e, (t, k), generator=rng, dtype=torch.int32).to(device)
    counts, offsets, sorted_pairs, slot_of, dropped = optimized_ops.moe_permute(ids, e, capacity)
    flat = ids.flatten().long().cpu()
    order = torch.sort(flat, stable=True).indices
    # the reference: each expert's first `capacity` pairs in stable order
    kept = []
    for x in range(e):
        mine = order[flat[order] == x]
        kept.append(mine[:capacity] if capacity else mine)
    want_counts = torch.tensor([len(m) for m in kept])
    want_sorted = torch.cat(kept)
    assert counts.cpu().tolist() == want_counts.tolist()
    assert offsets.cpu().tolist() == [0] + torch.cumsum(want_counts, 0).tolist()
    n = len(want_sorted)
    assert sorted_pairs[:n].cpu().tolist() == want_sorted.tolist()
    assert (sorted_pairs[n:] == -1).all()
    slots = torch.full((t * k,), -1, dtype=torch.long)
    slots[want_sorted] = torch.arange(n)
    assert slot_of.flatten().cpu().tolist() == slots.tolist()
    assert dropped.item() == t * k - n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_combine_and_gradients(device, dtype, rng):
    t, k, e, n = 37, 2, 8, 24
    logits = rand((t, e), torch.float32, device, rng)
    ids, weights, _ = optimized_ops.moe_route(logits, k)
    counts, offsets, sorted_pairs, slot_of, dropped = optimized_ops.moe_permute(ids, e, 7)  # some dropped
    y = rand((t * k, n), dtype, device, rng).requires_grad_()
    weights = weights.clone().requires_grad_()
    dout = rand((t, n), dtype, device, rng)
    out = optimized_ops.moe_combine(y, slot_of, sorted_pairs, weights)
    gy, gw = torch.autograd.grad(out, (y, weights), dout)
    # the reference in float64: gather the kept slots, weight, sum
    y64, w64 = y.detach().double().cpu().requires_grad_(), weights.detach().double().cpu().requires_grad_()
    s = slot_of.long().cpu()
    kept = (s >= 0).double()
    ref = (y64[s.clamp(min=0)] * (w64 * kept).unsqueeze(-1)).sum(1)
    rgy, rgw = torch.autograd.grad(ref, (y64, w64), dout.double().cpu())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), **tol)
    torch.testing.assert_close(gy.double().cpu(), rgy, **tol)
    torch.testing.assert_close(gw.double().cpu(), rgw, **tol)


def _grouped_ref(x, w, offs):
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["auto", "loop"])
def test_grouped_mm_and_gradients(device, dtype, variant, rng):
    if variant == "loop" and device == "cpu":
        pytest.skip("loop runs on CUDA tensors")
    m, k, n, e = 67, 24, 40, 5
    x = rand((m, k), dtype, device, rng).requires_grad_()
    w = rand((e, n, k), dtype, device, rng).transpose(-2, -1).detach().requires_grad_()  # (E, K, N), column-major
    offs = torch.tensor([10, 10, 31, 60, 64], dtype=torch.int32, device=device)  # an empty group, rows 64.. zeros
    dy = rand((m, n), dtype, device, rng)
    y = optimized_ops.grouped_mm(x, w, offs, variant=variant)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    ref = _grouped_ref(x64, w64, offs.cpu())
    rgx, rgw = torch.autograd.grad(ref, (x64, w64), dy.double().cpu())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(y.double().cpu(), ref.detach(), **tol)
    assert (y[64:] == 0).all()
    torch.testing.assert_close(gx.double().cpu(), rgx, **tol)
    torch.testing.assert_close(gw.double().cpu(), rgw, **tol)


@requires_cuda
def test_grouped_mm_matches_torch_grouped_mm(rng):
    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs a 9.0 device")
    x = rand((256, 64), torch.bfloat16, "cuda", rng)
    w = rand((4, 64, 128), torch.bfloat16, "cuda", rng)
    offs = torch.tensor([64, 64, 200, 256], dtype=torch.int32, device="cuda")
    want = torch._grouped_mm(x, w, offs=offs)
    torch.testing.assert_close(optimized_ops.grouped_mm(x, w, offs), want, rtol=2e-2, atol=2e-2)


def test_opcheck_fakes_and_compile(rng):
    x = rand((19, 8), torch.float32, "cpu", rng).requires_grad_()
    w = rand((3, 8, 5), torch.float32, "cpu", rng).requires_grad_()
    offs = torch.tensor([4, 4, 19], dtype=torch.int32)
    torch.library.opcheck(ops.grouped_mm.default, (x, w, offs), {})
    torch.library.opcheck(ops.moe_route.default, (rand((7, 8), torch.float32, "cpu", rng), None), dict(top_k=2))
    ids = torch.randint(0, 3, (19, 2), generator=rng, dtype=torch.int32)
    _, _, sorted_pairs, slot_of, _ = optimized_ops.moe_permute(ids, 3)
    yy = rand((38, 5), torch.float32, "cpu", rng).requires_grad_()
    ww = rand((19, 2), torch.float32, "cpu", rng).requires_grad_()
    torch.library.opcheck(ops.moe_combine.default, (yy, slot_of, sorted_pairs, ww), {})
    torch.library.opcheck(ops.moe_permute.default, (torch.randint(0, 8, (7, 2), generator=rng, dtype=torch.int32), 8),
                          {})
    meta = torch.empty(19, 8, device="meta")
    assert optimized_ops.grouped_mm(meta, torch.empty(3, 8, 5, device="meta"), offs.to("meta")).shape == (19, 5)
    torch._dynamo.reset()

    def layer(x, w, logits):
        ids, weights, _ = optimized_ops.moe_route(logits, 2)
        counts, offsets, sorted_pairs, slot_of, dropped = optimized_ops.moe_permute(ids, 3)
        return optimized_ops.grouped_mm(x, w, offsets[1:]), weights

    logits = rand((19, 3), torch.float32, "cpu", rng)
    compiled = torch.compile(layer, fullgraph=True)
    got, want = compiled(x, w, logits), layer(x, w, logits)
    torch.testing.assert_close(got, want)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match=r"optimized::moe_route: top_k: expected 1 <= k <= min\(E, 32\) = 8; given 9"):
        optimized_ops.moe_route(torch.randn(3, 8), 9)
    with pytest.raises(ValueError, match=r"optimized::grouped_mm: offs: expected dtype int32; given int64"):
        optimized_ops.grouped_mm(torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([2, 4]))
    with pytest.raises(ValueError, match=r"optimized::grouped_mm: w: expected a 3-D tensor"):
        optimized_ops.grouped_mm(torch.randn(4, 3), torch.randn(3, 5), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"optimized::moe_route: scoring: expected one of softmax, sigmoid"):
        optimized_ops.moe_route(torch.randn(3, 8), 2, scoring="relu")
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"optimized::moe_route_backward: topk_ids: expected 1 <= k <= min\(E, 32\) = 8 "
                                         r"columns; given shape \[3, 9\]"):
        ops.moe_route_backward(torch.randn(3, 8), torch.zeros(3, 9, dtype=torch.int32), None, None)
    with pytest.raises(ValueError, match=r"optimized::moe_route_backward: grad_weights: expected shape \(T, k\) = "
                                         r"\(3, 2\); given \(3, 3\)"):
        ops.moe_route_backward(torch.randn(3, 8), ids, torch.randn(3, 3), None)
    with pytest.raises(ValueError, match=r"optimized::moe_route_backward: grad_lse: expected dtype fp32; given bf16"):
        ops.moe_route_backward(torch.randn(3, 8), ids, None, torch.randn(3, dtype=torch.bfloat16))


# ---- the expert MLP's pieces: gather, grouped_mm_swiglu ---------------------------------------------------


def _offs_random(M, E, gen):
    cuts = torch.sort(torch.randint(0, M + 1, (E - 1,), generator=gen)).values
    return torch.cat([cuts, torch.tensor([M])]).to(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["auto", "loop", "wgmma"])
def test_grouped_mm_swiglu_and_gradients(device, variant):
    if variant != "auto" and device == "cpu":
        pytest.skip(f"{variant} is a CUDA rung")
    if variant == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma is sm_90a code: needs compute capability 9.0")
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    M, K, F, E = 300, 72, 136, 5
    x = torch.randn(M, K, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(E, K, 2 * F, generator=gen) / K ** 0.5).to(device, dtype).requires_grad_()
    offs = _offs_random(M - 7, E, gen).to(device)  # 7 rows past the last group
    out = optimized_ops.moe.grouped_mm_swiglu(x, w, offs, variant=variant)
    dout = torch.randn(M, F, generator=gen).to(device, dtype)
    gx, gw = torch.autograd.grad(out, (x, w), dout)
    x64, w64 = x.detach().cpu().double().requires_grad_(), w.detach().cpu().double().requires_grad_()
    h = _grouped_ref(x64, w64, offs.cpu())
    ref = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    rx, rw, dh = torch.autograd.grad(ref, (x64, w64, h), dout.cpu().double())
    # Errors against the magnitudes each result sums (|x| |w|, |dh| |w|^T, |x|^T |dh| per group): the inputs'
    # and the saved products' rounding (u of the dtype), reduced in fp32.
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -20
    ax, aw, adh = x64.detach().abs(), w64.detach().abs(), dh.abs()
    mag_out = _grouped_ref(ax, aw, offs.cpu())
    mag_out = mag_out[:, :F] * mag_out[:, F:] + mag_out[:, F:]
    mag_x = _grouped_ref(adh, aw.transpose(-2, -1), offs.cpu())
    ends = offs.cpu().long().tolist()
    mag_w = torch.stack([ax[b:e].t() @ adh[b:e] for b, e in zip([0] + ends[:-1], ends)])
    for got, want, mag in ((out, ref, mag_out), (gx, rx, mag_x), (gw, rw, mag_w)):
        err = (got.detach().cpu().double() - want.detach()).abs()
        assert (err <= 8 * u * mag + 4 * u * want.detach().abs() + 1e-6).all(), f"max error {err.max():.3g}"
    assert (out[M - 7:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_moe_gather_and_gradient(device):
    gen = torch.Generator().manual_seed(5)
    T, k, E, N = 37, 2, 8, 24
    ids = torch.randint(0, E, (T, k), generator=gen).to(torch.int32).to(device)
    counts, offsets, sorted_pairs, slot_of, dropped = optimized_ops.moe_permute(ids, E, capacity=5)
    x = torch.randn(T, N, generator=gen).to(device).requires_grad_()
    xs = optimized_ops.moe.moe_gather(x, sorted_pairs, slot_of)
    sp = sorted_pairs.cpu().long()
    want = torch.where((sp >= 0)[:, None], x.detach().cpu()[sp.clamp(min=0) // k], 0.0)
    assert torch.equal(xs.detach().cpu(), want)
    g = torch.randn(xs.shape, generator=gen).to(device)
    (gx,) = torch.autograd.grad(xs, x, g)
    ref = torch.zeros(T, N, dtype=torch.float64)
    for s, p in enumerate(sp.tolist()):
        if p >= 0:
            ref[p // k] += g.cpu().double()[s]
    torch.testing.assert_close(gx.cpu().double(), ref, rtol=1e-6, atol=1e-6)
    torch.library.opcheck(torch.ops.optimized.moe_gather.default, (x.detach(), sorted_pairs, slot_of), {})
