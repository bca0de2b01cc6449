"""optimized_ops.moe_route, moe_permute and grouped_mm (the MoE family, in progress) against torch: the
router against torch's softmax / sigmoid + topk in float64, the permutation against a stable argsort,
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
