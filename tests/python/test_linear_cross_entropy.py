"""optimized_ops.linear_cross_entropy against the unfused torch path in float64 (F.linear + F.cross_entropy with
label smoothing, + the z-loss term by hand): the loss and the gradients of hidden, weight and bias, for every
reduction, chunk sizes that do not divide T (1, 7, T, the default), ignore_index rows, an all-ignored batch,
float32 / bfloat16 / float64, strided and multi-dimensional hidden, both accumulation dtypes, the errors,
torch.compile(fullgraph=True), and (CUDA) peak memory against F.linear + F.cross_entropy. CUDA cases skip
without a device.

Tolerances follow the house rule (flash-attention's): error(ours vs float64) <= 2 x error(torch's same-dtype
unfused path vs float64) + one unit of rounding of the largest value; where the weight's gradient is summed
in its own 16-bit dtype over n chunks, n - 1 more roundings of the running sum are allowed (n - 1 half-ulps).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import optimized_ops
from optimized_ops.fused.linear_cross_entropy import linear_cross_entropy_chunk_size

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")

T, V, D = 37, 131, 48  # a prime number of tokens and classes; d a multiple of 8 (16-byte rows in bf16)


def inputs(rows, vocab, d, dtype, device, *, bias=True, ignored=(), pad=0, seed=0):
    """hidden (rows, d) (rows `pad` elements apart: a strided view when pad > 0), weight (vocab, d), bias,
    target; logits ~ N(0, ~4), so that the softmax is neither flat nor one-hot."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d + pad, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64) * (2 / math.sqrt(d))
    b = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, vocab, (rows,), generator=g)
    for r in ignored:
        t[r] = -100
    hidden = h.to(dtype).to(device)[:, :d]
    return hidden, w.to(dtype).to(device), (b.to(dtype).to(device) if bias else None), t.to(device)


def unfused(hidden, weight, bias, target, *, dtype, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
            reduction="mean"):
    """F.linear + F.cross_entropy (+ z_loss * lse^2 on the rows not ignored) in `dtype` on copies of the inputs:
    float64 for the reference, the inputs' dtype for torch's own error. Returns (loss, leaves)."""
    leaves = [None if x is None else x.detach().to(dtype).requires_grad_(True) for x in (hidden, weight, bias)]
    logits = F.linear(*leaves)
    per_row = F.cross_entropy(logits, target.long(), ignore_index=ignore_index, label_smoothing=label_smoothing,
                              reduction="none")
    keep = target != ignore_index
    if z_loss:
        per_row = per_row + z_loss * torch.logsumexp(logits, -1) ** 2 * keep
    if reduction == "none":
        return per_row, leaves
    total = per_row.sum()
    return (total / keep.sum() if reduction == "mean" else total), leaves


def grads(loss, leaves, upstream):
    wanted = [x for x in leaves if x is not None and x.requires_grad]
    got = torch.autograd.grad(loss, wanted, upstream.to(loss.dtype))
    it = iter(got)
    return [next(it) if x is not None and x.requires_grad else None for x in leaves]


def check(name, got, want, torch_same, dtype, extra_roundings=0):
    """|got - want| <= 2 |torch_same - want| + (1 + extra_roundings / 2) ulp-of-the-largest, elementwise max."""
    want = want.detach()
    scale = want.abs().max().item() if want.numel() else 0.0
    eps = torch.finfo(dtype).eps * (64 if dtype == torch.float64 else 1)
    err = (got.detach().double() - want).abs().max().item() if want.numel() else 0.0
    base = (torch_same.detach().double() - want).abs().max().item() if want.numel() else 0.0
    bound = 2 * base + (1 + extra_roundings / 2) * eps * scale + 1e-30
    assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (torch's own error {base:.3g}, max {scale:.3g})"


def run_case(device, dtype, reduction, chunk, with_bias, ls, z, *, rows=T, ignored=(1, 20), pad=0,
             accumulation_dtype=None):
    hidden, weight, bias, target = inputs(rows, V, D, dtype, device, bias=with_bias, ignored=ignored, pad=pad)
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (hidden, weight, bias)]
    if pad:  # keep the strided layout for the call: a leaf with the padded row stride
        base = hidden.detach().new_zeros(rows, D + pad)
        base[:, :D] = hidden
        leaves[0] = base[:, :D].requires_grad_(True)
        assert leaves[0].stride(0) == D + pad
    got = optimized_ops.linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], label_smoothing=ls,
                                             z_loss=z, reduction=reduction, chunk_size=chunk,
                                             accumulation_dtype=accumulation_dtype)
    want, ref_leaves = unfused(hidden, weight, bias, target, dtype=torch.float64, label_smoothing=ls, z_loss=z,
                               reduction=reduction)
    same, same_leaves = unfused(hidden, weight, bias, target, dtype=dtype, label_smoothing=ls, z_loss=z,
                                reduction=reduction)
    assert got.dtype == dtype and got.shape == want.shape
    check("loss", got, want, same, dtype)
    upstream = (torch.rand(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5).to(device)
    g_got = grads(got, leaves, upstream.to(dtype))
    g_want = grads(want, ref_leaves, upstream)
    g_same = grads(same, same_leaves, upstream.to(dtype))
    chunks = -(-rows // (chunk or rows))
    sixteen_bit_acc = dtype in (torch.float16, torch.bfloat16) and accumulation_dtype is None
    for name, a, b, c in zip(("d_hidden", "d_weight", "d_bias"), g_got, g_want, g_same):
        if b is None:
            continue
        assert a.shape == b.shape and a.dtype == dtype
        # mean / sum: the gradients for a unit upstream are rounded, then scaled by the upstream (one more
        # rounding than torch's, which scales before its GEMMs)
        scaled_after = 1 if reduction != "none" else 0
        # label smoothing / z-loss: the kernel's logit gradient p (1 + 2 z lse) - (1 - ls) onehot - ls / V is one
        # expression, torch's a sum of the terms' own gradients: the terms are rounded in other places (measured
        # on the H100: fp32 d_hidden with reduction="none" at 1.002x the bound without this half ulp)
        reordered = 1 if (ls or z) else 0
        check(name, a, b, c, dtype,
              extra_roundings=(chunks - 1 if name == "d_weight" and sixteen_bit_acc else 0) + scaled_after + reordered)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [1, 7, T, None])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("ls,z", [(0.0, 0.0), (0.1, 1e-3)])
def test_matches_unfused_float64(device, dtype, reduction, chunk, with_bias, ls, z):
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 runs on the cpu variants only")
    acc = torch.float32 if (dtype == torch.bfloat16 and chunk == 1) else None  # 37 bf16 roundings: see below
    run_case(device, dtype, reduction, chunk, with_bias, ls, z, accumulation_dtype=acc)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 7])
def test_bf16_weight_gradient_accumulation(device, chunk):
    # The default sums dW in bf16 (one rounding per chunk: the bound grows with the chunks); float32 keeps
    # torch's single rounding.
    for acc in (None, torch.float32):
        run_case(device, torch.bfloat16, "mean", chunk, True, 0.1, 1e-4, accumulation_dtype=acc)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_hidden(device, dtype):
    run_case(device, dtype, "mean", 7, True, 0.1, 0.0, pad=5)


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dimensions(device):
    # hidden (B, S, d) from a permuted tensor (the rows are not uniformly strided: reshaped by a copy).
    hidden, weight, bias, target = inputs(3 * 5, V, D, torch.float32, device, ignored=(4,))
    h3 = hidden.view(5, 3, D).transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(True)  # (5, 3, D)
    assert not h3.is_contiguous()
    t2 = target.view(5, 3)
    w = weight.clone().requires_grad_(True)
    for reduction in ("none", "mean"):
        got = optimized_ops.linear_cross_entropy(h3, w, t2, bias=bias, reduction=reduction, chunk_size=4)
        want = F.cross_entropy(F.linear(h3, w, bias).reshape(-1, V), t2.reshape(-1), reduction=reduction)
        if reduction == "none":
            want = want.view(5, 3)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        up = torch.rand_like(want)
        g_got = torch.autograd.grad(got, (h3, w), up)
        g_want = torch.autograd.grad(want, (h3, w), up)
        for a, b in zip(g_got, g_want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_all_ignored(device):
    hidden, weight, bias, target = inputs(9, V, D, torch.float32, device)
    ignored = torch.full_like(target, -100)
    leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    loss = optimized_ops.linear_cross_entropy(leaves[0], leaves[1], ignored, bias=leaves[2], chunk_size=4)
    ref = F.cross_entropy(F.linear(*leaves), ignored)
    assert torch.isnan(loss) and torch.isnan(ref)  # 0 / 0, as torch
    got = torch.autograd.grad(loss, leaves)
    want = torch.autograd.grad(ref, leaves)
    for a, b in zip(got, want):  # torch gives zero gradients, not NaN: so do we
        assert torch.equal(a, torch.zeros_like(a)) and torch.equal(b, torch.zeros_like(b))
    assert optimized_ops.linear_cross_entropy(hidden, weight, ignored, reduction="sum") == 0
    none = optimized_ops.linear_cross_entropy(hidden, weight, ignored, reduction="none")
    assert torch.equal(none, torch.zeros_like(none))


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_int32_target(device):
    hidden, weight, bias, target = inputs(T, V, D, torch.float32, device, ignored=(3,))
    want = F.cross_entropy(F.linear(hidden, weight, bias), target, label_smoothing=0.2)
    for t in (target, target.int()):
        got = optimized_ops.linear_cross_entropy(hidden, weight, t, bias=bias, label_smoothing=0.2, chunk_size=10)
        assert got.grad_fn is None
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    with torch.no_grad():
        h = hidden.clone().requires_grad_(True)
        got = optimized_ops.linear_cross_entropy(h, weight, target, bias=bias, label_smoothing=0.2, chunk_size=10)
    assert got.grad_fn is None
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_only_some_inputs_need_grad(device):
    hidden, weight, bias, target = inputs(T, V, D, torch.float32, device, ignored=(0,))
    for needs in [(True, False, False), (False, True, False), (False, False, True)]:
        leaves = [x.clone().requires_grad_(n) for x, n in zip((hidden, weight, bias), needs)]
        ref = [x.clone().requires_grad_(n) for x, n in zip((hidden, weight, bias), needs)]
        optimized_ops.linear_cross_entropy(leaves[0], leaves[1], target, bias=leaves[2], chunk_size=8).backward()
        F.cross_entropy(F.linear(*ref), target).backward()
        for a, b in zip(leaves, ref):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_scales_in_place_once(device):
    hidden, weight, _, target = inputs(T, V, D, torch.float32, device)
    h = hidden.clone().requires_grad_(True)
    loss = optimized_ops.linear_cross_entropy(h, weight, target, chunk_size=16)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # reduction="none" recomputes in its backward: it can run twice.
    h.grad = None
    loss = optimized_ops.linear_cross_entropy(h, weight, target, chunk_size=16, reduction="none")
    loss.sum().backward(retain_graph=True)
    first = h.grad.clone()
    loss.sum().backward()
    torch.testing.assert_close(h.grad, 2 * first)


@pytest.mark.parametrize("device", DEVICES)
def test_variant(device):
    hidden, weight, bias, target = inputs(T, V, D, torch.float32, device)
    want = optimized_ops.linear_cross_entropy(hidden, weight, target, bias=bias)
    if device == "cpu":
        torch.testing.assert_close(optimized_ops.linear_cross_entropy(hidden, weight, target, bias=bias,
                                                                      variant="cpu"), want)
    with pytest.raises(ValueError, match="variant"):
        optimized_ops.linear_cross_entropy(hidden, weight, target, variant="no_such_rung")


def test_errors():
    hidden, weight, bias, target = inputs(5, 11, 8, torch.float32, "cpu")
    call = optimized_ops.linear_cross_entropy
    with pytest.raises(ValueError, match="reduction"):
        call(hidden, weight, target, reduction="avg")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            call(hidden, weight, target, chunk_size=bad)
    with pytest.raises(ValueError, match="target: expected shape"):
        call(hidden, weight, target[:4])
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        call(hidden, weight[0], target)
    with pytest.raises(ValueError, match="hidden: expected a tensor of at least 1"):
        call(hidden[0, 0], weight, target[0])
    with pytest.raises(ValueError, match="accumulation_dtype"):
        call(hidden, weight, target, accumulation_dtype=torch.float16)
    with pytest.raises(ValueError, match="optimized::linear_forward"):  # d mismatch: the op's own check
        call(hidden, weight[:, :7], target)
    target[2] = 11
    with pytest.raises(ValueError, match="target"):  # out of range: the cross-entropy op's check (CPU)
        call(hidden, weight, target)


def test_default_chunk_size():
    bf16 = torch.bfloat16
    assert linear_cross_entropy_chunk_size(8192, 128256, bf16) == 1024  # 250.5 MiB of logits
    assert linear_cross_entropy_chunk_size(8192, 32000, bf16) == 4096
    assert linear_cross_entropy_chunk_size(8192, 262144, bf16) == 512
    assert linear_cross_entropy_chunk_size(8192, 128256, torch.float32) == 512
    assert linear_cross_entropy_chunk_size(100, 32000, bf16) == 100  # at most T
    assert linear_cross_entropy_chunk_size(0, 32000, bf16) == 1
    assert linear_cross_entropy_chunk_size(8192, 1 << 30, bf16) == 1  # at least one row
    for rows, vocab in [(8192, 128256), (5000, 50257), (8192, 151936)]:
        c = linear_cross_entropy_chunk_size(rows, vocab, bf16)
        assert c * vocab * 2 <= 256 << 20 and c % 128 == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile(device, reduction):
    hidden, weight, bias, target = inputs(20, 50, 16, torch.float32, device, ignored=(2,))

    def f(h, w, b, t):
        return optimized_ops.linear_cross_entropy(h, w, t, bias=b, label_smoothing=0.1, z_loss=1e-4, chunk_size=7,
                                                  reduction=reduction)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    a = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    b = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
    la, lb = compiled(*a, target), f(*b, target)
    torch.testing.assert_close(la, lb)
    la.sum().backward()
    lb.sum().backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad)


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensors the ops allocate while the mode is on (the CPU has no allocator statistics):
    every op's output storages are tracked by weak reference until they die; storages that existed before
    (the inputs, seen again through their views) are not counted."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in existing}
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s.data_ptr()
                if key not in self.skip and (key not in self.live or self.live[key][0].expired()):
                    self.live[key] = (StorageWeakRef(s), s.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def test_peak_memory_cpu():
    """Forward + backward, float32, T = 1024, V = 4096, d = 128, chunk 128, beyond the inputs: torch's path
    holds 3 T V 4 bytes (48 MiB) at its peak; this V d 4 (dW, 2 MiB) + T d 4 (d_hidden, 0.5 MiB) + c V 4 (a
    chunk's logits, 2 MiB) + small ones (a chunk's d_hidden, per-row losses): 4.5 MiB."""
    rows, vocab, d, chunk = 1024, 4096, 128, 128
    hidden, weight, _, target = inputs(rows, vocab, d, torch.float32, "cpu", bias=False, ignored=(3,))
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    peaks = {}
    for name, fn in [("torch", lambda: F.cross_entropy(F.linear(h, w), target)),
                     ("fused", lambda: optimized_ops.linear_cross_entropy(h, w, target, chunk_size=chunk)),
                     ("fused none", lambda: optimized_ops.linear_cross_entropy(h, w, target, chunk_size=chunk,
                                                                              reduction="none").sum())]:
        h.grad = w.grad = None
        with PeakMemory(h, w, target) as mode:
            fn().backward()
        peaks[name] = mode.peak
    expected = (vocab * d + rows * d + chunk * vocab) * 4
    assert peaks["torch"] >= 3 * rows * vocab * 4
    for name in ("fused", "fused none"):
        assert peaks[name] <= peaks["torch"] / 4, peaks
        assert expected <= peaks[name] <= expected * 1.05 + (64 << 10), (name, peaks[name], expected)


@needs_cuda
def test_cuda_peak_memory():
    """Peak memory beyond the inputs, forward + backward, bf16, T = 8192, V = 32000, d = 1024 (default chunk:
    4096 rows): torch's F.linear + F.cross_entropy keep ~3 T V 2 bytes (1500 MiB) at their peak; this keeps dW
    (V d 2 = 62.5 MiB), d_hidden (16 MiB) and one chunk's logits (250 MiB): <= 1/4 of torch's."""
    rows, vocab, d = 8192, 32000, 1024
    hidden, weight, _, target = inputs(rows, vocab, d, torch.bfloat16, "cuda", bias=False, ignored=(5, 77))

    def peak(fn):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn(h, w)
        loss.backward()
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        return used, loss.detach().float(), h.grad, w.grad

    torch_peak, torch_loss, torch_dh, torch_dw = peak(lambda h, w: F.cross_entropy(F.linear(h, w), target))
    ours_peak, ours_loss, ours_dh, ours_dw = peak(lambda h, w: optimized_ops.linear_cross_entropy(h, w, target))
    mib = 1 << 20
    print(f"peak beyond the inputs: torch {torch_peak / mib:.0f} MiB, fused {ours_peak / mib:.0f} MiB, "
          f"ratio {ours_peak / torch_peak:.3f}")
    assert ours_peak <= torch_peak / 4, (ours_peak / mib, torch_peak / mib)
    torch.testing.assert_close(ours_loss, torch_loss, rtol=1e-2, atol=1e-2)
    for a, b in ((ours_dh, torch_dh), (ours_dw, torch_dw)):
        err = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert err < 3e-2, err.item()
