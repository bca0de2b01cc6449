"""Attention from PyTorch (optimized_ops.flash_attention, flash_attention_varlen,
scaled_dot_product_attention; torch.ops.optimized.attention_fwd / _bwd, attention_varlen_fwd / _bwd,
flash_attention) against a float64 reference: outputs, lse and gradients; GQA / MQA, causal in both
alignments, windows, soft-capping, ALiBi, boolean / additive / broadcast masks, varlen batches with
empty and length-1 sequences, strided (B, H, S, D) views; opcheck, gradcheck, torch.compile, fake
kernels, CUDA graphs, and the error paths.

Tolerance (design.md, FlashAttention's rule): error(ours vs float64) <= 2 * error(torch math in the
same dtype vs float64) + rounding noise (a few units of the output dtype relative to the largest
reference value, plus float32 accumulation over the keys). The CPU tests run the "cpu" variant (and
"auto"); the CUDA tests every CUDA rung, and skip with the reason without a device."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import optimized_ops
from conftest import DEVICES, rand, requires_cuda, unit_roundoff

ops = torch.ops.optimized


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- the reference: torch math in any dtype ----------------------------------------------------------

def reference(q, k, v, *, scale=None, causal=False, top_left=False, window=(-1, -1), softcap=0.0, alibi=None,
              mask=None):
    """(out, lse) of include/optimized/attention.h's rule, computed by torch in q's dtype (float64 for
    the reference, the low dtype for torch's same-dtype error). q (B, S_q, H_q, D), k, v
    (B, S_k, H_kv, D); mask broadcastable to (B, H_q, S_q, S_k). Differentiable (rows without a visible
    key give 0 and lse -inf, without NaN in the gradients)."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    group = h_q // h_kv
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(group, 1)
    vh = v.transpose(1, 2).repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    offset = 0 if top_left else s_k - s_q
    i = torch.arange(s_q, device=q.device)[:, None]
    j = torch.arange(s_k, device=q.device)[None, :]
    if alibi is not None:
        slopes = alibi.to(s.dtype).reshape(-1 if alibi.dim() == 2 else 1, h_q)[:, :, None, None]
        s = s - slopes * (i + offset - j).abs().to(s.dtype)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= j >= i + offset - left
    if right >= 0:
        allowed &= j <= i + offset + right
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(lse)[..., None]
    p = torch.where(seen, torch.exp(s - torch.where(seen, lse[..., None], torch.zeros_like(lse[..., None]))),
                    torch.zeros_like(s))
    out = (p @ vh).transpose(1, 2)
    return out, lse


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))  # -inf == -inf (rows without keys)
    err = torch.where(same, torch.zeros_like(got), (got - want).abs())
    if torch.isnan(err).any():
        return math.inf
    return err.max().item() if err.numel() else 0.0


def check_rule(name: str, ours: torch.Tensor, ref64: torch.Tensor, ref_same: torch.Tensor, keys: int = 1):
    """FlashAttention's rule: |ours - float64| <= 2 |torch in the same dtype - float64| + noise."""
    err, base = _max_error(ours, ref64), _max_error(ref_same, ref64)
    finite = ref64.detach()[torch.isfinite(ref64.detach())]
    mag = max(finite.abs().max().item() if finite.numel() else 0.0, 1.0)
    acc = 2.0**-53 if ours.dtype == torch.float64 else 2.0**-24
    noise = (4 * unit_roundoff(ours.dtype) + 8 * math.sqrt(max(keys, 1)) * acc) * mag
    assert err <= 2 * base + noise, f"{name}: error {err:.3g} > 2 x torch's {base:.3g} + noise {noise:.3g}"


def _grads(outputs, inputs, dout):
    return torch.autograd.grad(outputs, inputs, dout, allow_unused=True)


def check_against_reference(ours_fn, q, k, v, ref_kwargs, *, lse_too=True, backward=True, rng=None):
    """Runs ours (returns (out, lse)) and the reference in float64 and in q's dtype; checks out, lse,
    dq, dk, dv with the rule."""
    inputs = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    out, lse = ours_fn(*inputs)
    in64 = [t.detach().double().cpu().requires_grad_(backward) for t in (q, k, v)]
    kw64 = {key: (val.cpu() if isinstance(val, torch.Tensor) else val) for key, val in ref_kwargs.items()}
    out64, lse64 = reference(*in64, **kw64)
    same_dtype = q.dtype if q.dtype != torch.float64 else torch.float64
    in_same = [t.detach().cpu().to(same_dtype).requires_grad_(backward) for t in (q, k, v)]
    out_s, lse_s = reference(*in_same, **kw64)
    keys = k.shape[1]
    check_rule("out", out, out64, out_s, keys)
    if lse_too:
        check_rule("lse", lse, lse64, lse_s.double(), keys)
    if backward:
        dout = rand(out.shape, q.dtype, "cpu", rng or torch.Generator().manual_seed(0))
        g = _grads(out, inputs, dout.to(out.device))
        g64 = _grads(out64, in64, dout.double())
        g_s = _grads(out_s, in_same, dout.to(same_dtype))
        for name, a, b, c in zip(("dq", "dk", "dv"), g, g64, g_s):
            check_rule(name, a, b, c, keys)


# ---- fixed length: every feature against the reference ----------------------------------------------

# (B, S_q, S_k, H_q, H_kv, D, options)
FIXED_CASES = [
    (1, 1, 1, 1, 1, 16, {}),
    (2, 7, 7, 4, 4, 16, dict(causal=True)),
    (2, 7, 13, 4, 2, 32, dict(causal=True)),           # S_q < S_k, bottom-right
    (1, 13, 7, 4, 1, 16, dict(causal=True)),           # S_q > S_k: rows without keys (MQA)
    (2, 9, 11, 8, 2, 24, dict(window=(3, 2))),         # GQA 4
    (1, 17, 17, 8, 1, 8, dict(causal=True, window=(4, -1))),
    (2, 5, 9, 2, 2, 16, dict(softcap=5.0, scale=0.7)),
    (2, 6, 6, 4, 2, 16, dict(alibi="heads")),
    (2, 6, 10, 4, 4, 16, dict(alibi="batch", causal=True, softcap=3.0)),
    (1, 33, 29, 2, 1, 40, dict(top_left=True, causal=True)),
]


def _case_id(case):
    b, s_q, s_k, h_q, h_kv, d, o = case
    return f"B{b}-Sq{s_q}-Sk{s_k}-H{h_q}/{h_kv}-D{d}" + "".join(f"-{k}" for k in sorted(o))


def _case_inputs(case, dtype, device, rng):
    b, s_q, s_k, h_q, h_kv, d, opts = case
    q = rand((b, s_q, h_q, d), dtype, device, rng)
    k = rand((b, s_k, h_kv, d), dtype, device, rng) * 2  # larger scores: a sharper softmax
    v = rand((b, s_k, h_kv, d), dtype, device, rng)
    opts = dict(opts)
    alibi = opts.pop("alibi", None)
    if alibi == "heads":
        opts["alibi"] = torch.rand(h_q, generator=rng).float().to(device) * 0.5
    elif alibi == "batch":
        opts["alibi"] = torch.rand(b, h_q, generator=rng).float().to(device) * 0.5
    return q, k, v, opts


def _ours(variant, opts):
    def fn(q, k, v):
        return optimized_ops.flash_attention(
            q, k, v, causal=opts.get("causal", False), softmax_scale=opts.get("scale"),
            window_size=opts.get("window", (-1, -1)), softcap=opts.get("softcap", 0.0),
            alibi_slopes=opts.get("alibi"), return_lse=True, variant=variant) if not opts.get("top_left") else \
            ops.attention_fwd(q, k, v, softmax_scale=opts.get("scale"), causal=opts.get("causal", False),
                              top_left=True, variant=variant)
    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=_dname)
@pytest.mark.parametrize("case", FIXED_CASES, ids=_case_id)
def test_fixed_length_cpu(case, dtype, rng):
    q, k, v, opts = _case_inputs(case, dtype, "cpu", rng)
    check_against_reference(_ours("cpu", opts), q, k, v, opts, rng=rng)


def test_auto_is_cpu_on_the_cpu(rng):
    q, k, v, opts = _case_inputs(FIXED_CASES[2], torch.float32, "cpu", rng)
    a = optimized_ops.flash_attention(q, k, v, causal=True, return_lse=True)
    b = optimized_ops.flash_attention(q, k, v, causal=True, return_lse=True, variant="cpu")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert optimized_ops.resolve_attention_variant(torch.float32, "cpu", 64) == "cpu"


def test_rows_without_keys_give_zero_and_minus_inf(rng):
    q, k, v = (rand((1, s, 2, 8), torch.float32, "cpu", rng) for s in (6, 3, 3))
    out, lse = optimized_ops.flash_attention(q, k, v, causal=True, return_lse=True)
    # bottom-right: query i sees keys j <= i - 3; the first three rows see none
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert torch.isneginf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    q.requires_grad_()
    (dq,) = torch.autograd.grad(optimized_ops.flash_attention(q, k, v, causal=True).sum(), q)
    assert torch.equal(dq[:, :3], torch.zeros_like(dq[:, :3])) and torch.isfinite(dq).all()


# ---- causal conventions, masks, layouts through scaled_dot_product_attention ---------------------------

def _sdpa_pair(query, key, value, **kw):
    ours = optimized_ops.scaled_dot_product_attention(query, key, value, **kw)
    want = F.scaled_dot_product_attention(query.double(), key.double(), value.double(),
                                          **{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                                 else v) for k, v in kw.items()})
    return ours, want


@pytest.mark.parametrize("s_q,s_k", [(7, 7), (5, 11), (11, 5)])
def test_sdpa_causal_is_top_left_like_torch(s_q, s_k, rng):
    q = rand((2, 3, s_q, 16), torch.float32, "cpu", rng)
    k, v = (rand((2, 3, s_k, 16), torch.float32, "cpu", rng) for _ in range(2))
    ours, want = _sdpa_pair(q, k, v, is_causal=True)
    # every row sees key 0 (top-left), so torch gives no NaN
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
    # and bottom-right through flash_attention is the reference with offset S_k - S_q
    out = optimized_ops.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    ref, _ = reference(*(t.transpose(1, 2).double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    if s_q != s_k:
        assert not torch.allclose(out.transpose(1, 2).double(), want, atol=1e-3)


MASK_SHAPES = [(2, 4, 6, 9), (6, 9), (2, 1, 1, 9), (1, 4, 6, 1), (4, 1, 9), (1, 9)]


@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "additive", "additive_f32"])
def test_sdpa_masks_broadcast(shape, kind, rng):
    dtype = torch.bfloat16 if kind == "additive_f32" else torch.float32
    q = rand((2, 4, 6, 16), dtype, "cpu", rng)
    k, v = (rand((2, 4, 9, 16), dtype, "cpu", rng) for _ in range(2))
    if kind == "bool":
        mask = torch.rand(shape, generator=rng) > 0.3
        mask[..., 0] = True  # every row sees a key (fully masked rows are tested on their own)
    else:
        mask = (torch.rand(shape, generator=rng, dtype=torch.float64) * 4 - 2).to(
            torch.float32 if kind == "additive_f32" else dtype)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ours = optimized_ops.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, variant="cpu")
    full = mask.expand(2, 4, 6, 9)
    check_against_reference(lambda a, b, c: ops.attention_fwd(a, b, c, top_left=True, attn_mask=full),
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dict(top_left=True, mask=full),
                            rng=rng)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                          attn_mask=mask if kind == "bool" else mask.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), want, rtol=tol, atol=tol)
    ours.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (qr, kr, vr))


def test_sdpa_mask_is_passed_as_a_broadcast_view(rng, monkeypatch):
    seen = {}
    real = ops.attention_fwd.default

    def spy(*args, **kwargs):
        seen.update(kwargs, q=args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(optimized_ops.attention._ops.attention_fwd, "default", spy, raising=False)
    q = rand((2, 4, 6, 16), torch.float32, "cpu", rng)
    mask = torch.rand(6, 9, generator=rng) > 0.5
    k = v = rand((2, 4, 9, 16), torch.float32, "cpu", rng)
    optimized_ops.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    m = seen["attn_mask"]
    assert m.shape == (2, 4, 6, 9) and m.stride()[:2] == (0, 0) and m.data_ptr() == mask.data_ptr()
    assert seen["q"].data_ptr() == q.data_ptr() and seen["q"].shape == (2, 6, 4, 16)  # a transposed view


@pytest.mark.parametrize("rank", [2, 3, 4, 5])
def test_sdpa_ranks_and_layouts(rank, rng):
    shape = {2: (6, 8), 3: (4, 6, 8), 4: (2, 4, 6, 8), 5: (2, 3, 4, 6, 8)}[rank]
    q, k, v = (rand(shape, torch.float32, "cpu", rng) for _ in range(3))
    ours, want = _sdpa_pair(q, k, v)
    assert ours.shape == want.shape
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
    if rank == 4:
        assert ours.is_contiguous()  # laid out as the (B, H, S, D) query


def test_sdpa_batch_broadcast(rng):
    q = rand((3, 4, 6, 8), torch.float64, "cpu", rng).requires_grad_()
    k, v = (rand((1, 4, 7, 8), torch.float64, "cpu", rng).requires_grad_() for _ in range(2))
    ours = optimized_ops.scaled_dot_product_attention(q, k, v)
    want = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(ours, want)
    g = torch.autograd.grad(ours.sum(), (q, k, v))
    h = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g, h):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("h_kv", [1, 2, 4])
def test_sdpa_enable_gqa_like_torch(h_kv, rng):
    q = rand((2, 4, 5, 8), torch.float64, "cpu", rng).requires_grad_()
    k, v = (rand((2, h_kv, 7, 8), torch.float64, "cpu", rng).requires_grad_() for _ in range(2))
    ours = optimized_ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    torch.testing.assert_close(ours, want)
    for a, b in zip(torch.autograd.grad(ours.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_strided_bhsd_views_run_in_place_and_keep_the_layout(rng):
    # (B, H, S, D) memory passed as (B, S, H, D) views: out laid out as q; gradients as their inputs
    qb, kb, vb = (rand((2, 4, s, 16), torch.float32, "cpu", rng) for s in (9, 11, 11))
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in (qb, kb, vb))
    out = optimized_ops.flash_attention(q, k, v, causal=True)
    assert out.stride() == q.stride()
    ref, _ = reference(*(t.double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # a packed qkv: (B, S, 3, H, D) sliced; and rows padded beyond D
    qkv = rand((2, 9, 3, 4, 16), torch.float32, "cpu", rng)
    padded = rand((2, 9, 4, 24), torch.float32, "cpu", rng)[..., :16]
    for qq, kk, vv in ((qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), (padded, padded, padded)):
        out = optimized_ops.flash_attention(qq, kk, vv)
        ref, _ = reference(qq.double(), kk.double(), vv.double())
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # a strided last dimension is copied, not refused
    q_t = rand((2, 16, 4, 9), torch.float32, "cpu", rng).transpose(1, 3)  # (2, 9, 4, 16), last stride != 1
    out = optimized_ops.flash_attention(q_t, q_t, q_t)
    torch.testing.assert_close(out.double(), reference(*(q_t.double(),) * 3)[0], rtol=1e-5, atol=1e-5)


def test_gradient_of_a_sum_expanded_dout(rng):
    q, k, v = (rand((1, 5, 2, 8), torch.float64, "cpu", rng).requires_grad_() for _ in range(3))
    g = torch.autograd.grad(optimized_ops.flash_attention(q, k, v).sum(), (q, k, v))  # dout: stride 0
    h = torch.autograd.grad(reference(q, k, v)[0].sum(), (q, k, v))
    for a, b in zip(g, h):
        torch.testing.assert_close(a, b)


# ---- varlen ------------------------------------------------------------------------------------------

def _varlen_inputs(lens_q, lens_k, h_q, h_kv, d, dtype, device, rng):
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = rand((sum(lens_q), h_q, d), dtype, device, rng)
    k = rand((sum(lens_k), h_kv, d), dtype, device, rng) * 2
    v = rand((sum(lens_k), h_kv, d), dtype, device, rng)
    return q, k, v, cu_q, cu_k


VARLEN_CASES = [
    ([3, 0, 7, 1], [3, 0, 7, 1], {}),
    ([3, 0, 7, 1], [5, 2, 7, 0], dict(causal=True)),
    ([1, 1, 9], [4, 1, 2], dict(causal=True, window=(2, 1))),
    ([0], [0], {}),
    ([6, 2], [6, 9], dict(softcap=4.0, alibi=True)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=_dname)
@pytest.mark.parametrize("lens_q,lens_k,opts", VARLEN_CASES, ids=lambda x: str(x))
def test_varlen_against_per_sequence_references(lens_q, lens_k, opts, dtype, rng):
    check_varlen(lens_q, lens_k, opts, dtype, rng, "cpu", "cpu")


def check_varlen(lens_q, lens_k, opts, dtype, rng, device, variant):
    """Ours on a packed batch against the reference run on each sequence alone: out, lse, dq, dk, dv."""
    h_q, h_kv, d = 4, 2, 16
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, h_q, h_kv, d, dtype, device, rng)
    opts = dict(opts)
    alibi = torch.rand(h_q, generator=rng).float().to(device) if opts.pop("alibi", False) else None
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = optimized_ops.flash_attention_varlen(
        qr, kr, vr, cu_q, cu_k, max(lens_q), max(lens_k), causal=opts.get("causal", False),
        window_size=opts.get("window", (-1, -1)), softcap=opts.get("softcap", 0.0), alibi_slopes=alibi,
        return_lse=True, variant=variant)
    assert out.shape == q.shape and lse.shape == (h_q, q.shape[0])
    dout = rand(out.shape, dtype, device, rng)
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), dout) if out.numel() else (qr, kr, vr)
    for b in range(len(lens_q)):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        kw = dict(opts, alibi=alibi.cpu() if alibi is not None else None)
        if sq.stop == sq.start:
            continue
        seq = [t[s][None].detach().cpu() for t, s in ((q, sq), (k, sk), (v, sk))]
        in64 = [t.double().requires_grad_() for t in seq]
        in_s = [t.clone().requires_grad_() for t in seq]
        o64, l64 = reference(*in64, **kw)
        o_s, l_s = reference(*in_s, **kw)
        check_rule(f"seq {b} out", out[sq][None], o64, o_s, max(sk.stop - sk.start, 1))
        check_rule(f"seq {b} lse", lse[:, sq][None], l64, l_s.double(), max(sk.stop - sk.start, 1))
        d_seq = dout[sq][None].cpu()
        g64 = _grads(o64, in64, d_seq.double())
        g_s = _grads(o_s, in_s, d_seq)
        for name, ours, a, c in zip(("dq", "dk", "dv"), (dq[sq], dk[sk], dv[sk]), g64, g_s):
            if a is None:  # no key: the gradients are 0
                continue
            check_rule(f"seq {b} {name}", ours[None], a, c, max(sk.stop - sk.start, 1))
    # keys of a sequence without queries get no gradient
    for b in range(len(lens_q)):
        if lens_q[b] == 0 and lens_k[b] > 0:
            sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
            assert torch.equal(dk[sk], torch.zeros_like(dk[sk])) and torch.equal(dv[sk], torch.zeros_like(dv[sk]))


# ---- autograd: gradcheck, what is not implemented ------------------------------------------------------

def test_gradcheck_float64_cpu(rng):
    def t(*shape):
        return rand(shape, torch.float64, "cpu", rng).requires_grad_()

    q, k, v = t(2, 4, 4, 5), t(2, 6, 2, 5), t(2, 6, 2, 5)
    alibi = torch.rand(4, generator=rng).float()
    for kw in (dict(), dict(causal=True, softcap=2.0, alibi_slopes=alibi), dict(window_size=(1, 2), softmax_scale=0.9)):
        assert torch.autograd.gradcheck(lambda a, b, c: optimized_ops.flash_attention(a, b, c, variant="cpu", **kw),
                                        (q, k, v))
    mask = torch.rand(1, 4, 4, 6, generator=rng, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b, c: optimized_ops.scaled_dot_product_attention(
        a, b, c, attn_mask=mask, enable_gqa=True), (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
    qv, kv, vv, cu_q, cu_k = _varlen_inputs([2, 0, 3], [3, 1, 2], 2, 1, 4, torch.float64, "cpu", rng)
    assert torch.autograd.gradcheck(lambda a, b, c: optimized_ops.flash_attention_varlen(
        a, b, c, cu_q, cu_k, 3, 3, causal=True), tuple(x.requires_grad_() for x in (qv, kv, vv)))


def test_forward_ad_and_double_backward_raise(rng):
    q, k, v = (rand((1, 3, 2, 4), torch.float64, "cpu", rng) for _ in range(3))
    with pytest.raises(NotImplementedError, match="forward-mode AD .* is not implemented for attention"):
        torch.func.jvp(lambda a: optimized_ops.flash_attention(a, k, v), (q,), (torch.ones_like(q),))
    q.requires_grad_()
    (g,) = torch.autograd.grad(optimized_ops.flash_attention(q, k, v).pow(2).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


def test_lse_has_no_gradient_and_deterministic_passes_through(rng):
    q, k, v = (rand((1, 5, 2, 8), torch.float32, "cpu", rng).requires_grad_() for _ in range(3))
    out, lse = optimized_ops.flash_attention(q, k, v, return_lse=True, deterministic=True)
    assert out.requires_grad and not lse.requires_grad
    a = torch.autograd.grad(out.sum(), (q, k, v))
    out2 = optimized_ops.flash_attention(q, k, v, deterministic=True)
    b = torch.autograd.grad(out2.sum(), (q, k, v))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---- torch.library: opcheck, fakes, compile, the library alone -----------------------------------------

def _opcheck_cases(device, dtype, rng):
    def t(*shape, grad=True):
        return rand(shape, dtype, device, rng).requires_grad_(grad)

    q, k, v = t(2, 5, 4, 16), t(2, 7, 2, 16), t(2, 7, 2, 16)
    alibi = torch.rand(2, 4, generator=rng).float().to(device)
    mask = (torch.rand(2, 1, 5, 7, generator=rng) > 0.2).to(device)
    mask[..., 0] = True
    yield ops.attention_fwd.default, (q, k, v), {}
    yield ops.attention_fwd.default, (q, k, v), dict(causal=True, window_left=2, softcap=3.0, alibi_slopes=alibi)
    yield ops.attention_fwd.default, (q, k, v), dict(top_left=True, attn_mask=mask, softmax_scale=0.5)
    yield ops.flash_attention.default, (q, k, v), dict(causal=True)
    out, lse = ops.attention_fwd(q.detach(), k.detach(), v.detach(), causal=True)
    # the backward ops have no double backward (it raises): their operands require no grad
    yield ops.attention_bwd.default, (t(2, 5, 4, 16, grad=False), q.detach(), k.detach(), v.detach(), out, lse), \
        dict(causal=True)
    qv, kv, vv, cu_q, cu_k = _varlen_inputs([2, 0, 5], [3, 4, 5], 4, 2, 16, dtype, device, rng)
    qv, kv, vv = (x.requires_grad_() for x in (qv, kv, vv))
    yield ops.attention_varlen_fwd.default, (qv, kv, vv, cu_q, cu_k, 5, 5), dict(causal=True)
    out, lse = ops.attention_varlen_fwd(qv.detach(), kv.detach(), vv.detach(), cu_q, cu_k, 5, 5)
    yield ops.attention_varlen_bwd.default, (t(*qv.shape, grad=False), qv.detach(), kv.detach(), vv.detach(), cu_q,
                                             cu_k, 5, 5, out, lse), {}


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device, rng):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seen = set()
    for op, args, kwargs in _opcheck_cases(device, dtype, rng):
        torch.library.opcheck(op, args, kwargs)
        seen.add(op.name())
    assert seen == {f"optimized::{n}" for n in ("attention_fwd", "attention_bwd", "attention_varlen_fwd",
                                                 "attention_varlen_bwd", "flash_attention")}


def test_fake_kernels_match_the_real_layouts(rng):
    from torch._subclasses.fake_tensor import FakeTensorMode
    qkv = rand((2, 9, 3, 4, 16), torch.float32, "cpu", rng)
    bhsd = rand((2, 4, 9, 16), torch.float32, "cpu", rng).transpose(1, 2)
    strided_d = rand((2, 16, 4, 9), torch.float32, "cpu", rng).transpose(1, 3)
    for q in (qkv[:, :, 0], bhsd, strided_d, rand((2, 9, 4, 16), torch.float32, "cpu", rng)):
        real = ops.attention_fwd(q, q, q)
        grads = ops.attention_bwd(real[0], q, q, q, *real)
        with FakeTensorMode() as mode:
            fq = mode.from_tensor(q)
            fake = ops.attention_fwd(fq, fq, fq)
            fgrads = ops.attention_bwd(fake[0], fq, fq, fq, *fake)
        for r, f in zip((*real, *grads), (*fake, *fgrads)):
            assert r.shape == f.shape and r.stride() == f.stride() and r.dtype == f.dtype
    meta = torch.empty(2, 5, 4, 8, device="meta", dtype=torch.float64)
    out, lse = ops.attention_fwd(meta, meta, meta)
    assert out.shape == meta.shape and lse.shape == (2, 4, 5) and lse.dtype == torch.float64
    out, lse = ops.attention_varlen_fwd(meta[0], meta[0], meta[0], torch.empty(3, dtype=torch.int32, device="meta"),
                                        torch.empty(3, dtype=torch.int32, device="meta"), 4, 4)
    assert out.shape == (5, 4, 8) and lse.shape == (4, 5)
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: q: expected 4 dimensions \(B, S_q, H_q, D\); "
                                         r"given 3"):
        ops.attention_fwd(meta[0], meta[0], meta[0])


def _attention_block(x, wq, wk, wv):
    b, s, _ = x.shape
    q = (x @ wq).view(b, s, 4, 8)
    k = (x @ wk).view(b, s, 2, 8)
    v = (x @ wv).view(b, s, 2, 8)
    y = optimized_ops.flash_attention(q, k, v, causal=True)
    z = optimized_ops.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   enable_gqa=True)
    return y.sum(-1) + z.transpose(1, 2).sum(-1) + torch.ops.optimized.flash_attention(q, k, v).sum(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, rng):
    torch._dynamo.reset()
    args = [rand((2, 7, 16), torch.float32, device, rng).requires_grad_()] + \
           [rand((16, n), torch.float32, device, rng).requires_grad_() for n in (32, 16, 16)]
    explanation = torch._dynamo.explain(_attention_block)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(_attention_block, fullgraph=True, backend="aot_eager", dynamic=True)
    for s in (7, 12):
        args = [rand((2, s, 16), torch.float32, device, rng).requires_grad_()] + args[1:]
        out, expected = compiled(*args), _attention_block(*args)
        torch.testing.assert_close(out, expected)
        for got, want in zip(torch.autograd.grad(out.sum(), args), torch.autograd.grad(expected.sum(), args)):
            torch.testing.assert_close(got, want)


def test_flash_attention_from_the_library_alone():
    """torch.ops.load_library on the .so alone: torch.ops.optimized.flash_attention(q, k, v) runs."""
    script = textwrap.dedent(f"""
        import torch
        torch.ops.load_library({optimized_ops.library_path()!r})
        q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
        out = torch.ops.optimized.flash_attention(q, k, v)
        want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                v.transpose(1, 2), enable_gqa=True)
        assert torch.allclose(out, want.transpose(1, 2), atol=1e-5), (out - want.transpose(1, 2)).abs().max()
        print(list(torch.ops.optimized.attention_variants()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "['cpu', 'naive', 'flash', 'flash2', 'hopper']" in result.stdout
    assert optimized_ops.variants("attention") == optimized_ops.attention_variants() == ["cpu", "naive", "flash",
                                                                                        "flash2", "hopper"]
    assert optimized_ops.attention_head_dims() == [64, 96, 128, 256]


# ---- errors --------------------------------------------------------------------------------------------

def test_errors_name_the_argument(rng):
    def t(*shape, dtype=torch.float32):
        return rand(shape, dtype, "cpu", rng)

    q = t(2, 5, 4, 16)
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: k: expected a number of heads that divides"):
        optimized_ops.flash_attention(q, t(2, 5, 3, 16), t(2, 5, 3, 16))
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: k: expected head_dim 16"):
        optimized_ops.flash_attention(q, t(2, 5, 4, 8), t(2, 5, 4, 8))
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: k: expected batch 2"):
        optimized_ops.flash_attention(q, t(3, 5, 4, 16), t(3, 5, 4, 16))
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: v: expected shape"):
        optimized_ops.flash_attention(q, t(2, 5, 4, 16), t(2, 6, 4, 16))
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: k: expected dtype fp32"):
        optimized_ops.flash_attention(q, t(2, 5, 4, 16, dtype=torch.float64), t(2, 5, 4, 16))
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: q: expected 4 dimensions"):
        optimized_ops.flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: window_left: expected -1"):
        optimized_ops.flash_attention(q, q, q, window_size=(-3, 0))
    with pytest.raises(ValueError, match=r"window_size: expected a pair"):
        optimized_ops.flash_attention(q, q, q, window_size=4)
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: softcap: expected a finite value >= 0"):
        optimized_ops.flash_attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: alibi_slopes: expected shape"):
        optimized_ops.flash_attention(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: variant: expected one of"):
        optimized_ops.flash_attention(q, q, q, variant="fastest")
    with pytest.raises(ValueError, match=r"variant: flash2 runs on CUDA"):
        optimized_ops.flash_attention(q.half(), q.half(), q.half(), variant="flash2")
    with pytest.raises(NotImplementedError, match=r"optimized::attention_fwd: q: expected dtype"):
        optimized_ops.flash_attention(q.int(), q.int(), q.int())
    # scaled_dot_product_attention's own rules
    qs = q.transpose(1, 2)
    with pytest.raises(NotImplementedError, match=r"dropout_p: dropout is not implemented"):
        optimized_ops.scaled_dot_product_attention(qs, qs, qs, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"key: expected 4 heads \(query's; pass enable_gqa=True"):
        optimized_ops.scaled_dot_product_attention(qs, qs[:, :2], qs[:, :2])
    with pytest.raises(ValueError, match=r"attn_mask: expected None with is_causal=True"):
        optimized_ops.scaled_dot_product_attention(qs, qs, qs, attn_mask=torch.ones(5, 5, dtype=torch.bool),
                                                   is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask: expected a shape broadcastable to \[2, 4, 5, 5\]"):
        optimized_ops.scaled_dot_product_attention(qs, qs, qs, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match=r"attn_mask: gradients of the mask are not implemented"):
        optimized_ops.scaled_dot_product_attention(qs, qs, qs, attn_mask=torch.zeros(5, 5, requires_grad=True))
    with pytest.raises(ValueError, match=r"optimized::attention_fwd: mask: expected dtype bool"):
        optimized_ops.scaled_dot_product_attention(qs, qs, qs, attn_mask=torch.zeros(5, 5, dtype=torch.int32))


def test_varlen_errors_name_the_argument(rng):
    q = rand((10, 4, 16), torch.float32, "cpu", rng)
    good = torch.tensor([0, 3, 10], dtype=torch.int32)
    for cu, needle in ((torch.tensor([0, 7, 3, 10], dtype=torch.int32), "cu_seqlens_q"),
                       (torch.tensor([1, 3, 10], dtype=torch.int32), "cu_seqlens_q"),
                       (torch.tensor([0, 3, 9], dtype=torch.int32), "cu_seqlens_q"),
                       (torch.tensor([0, 3, 10]), "cu_seqlens_q: expected dtype int32")):
        with pytest.raises(ValueError, match=rf"optimized::attention_varlen_fwd: {needle}"):
            optimized_ops.flash_attention_varlen(q, q, q, cu, good if cu.numel() == 3 else cu, 7, 7)
    with pytest.raises(ValueError, match=r"optimized::attention_varlen_fwd: cu_seqlens_k: expected shape \(3\)"):
        optimized_ops.flash_attention_varlen(q, q, q, good, torch.tensor([0, 10], dtype=torch.int32), 7, 10)
    with pytest.raises(ValueError, match=r"optimized::attention_varlen_fwd: q: expected 3 dimensions"):
        optimized_ops.flash_attention_varlen(q[None], q, q, good, good, 7, 7)


# ---- CUDA: every rung against the reference, graphs, streams --------------------------------------------

def _cuda_variants(dtype):
    return [v for v in ("naive", "flash", "flash2", "auto") if not (v == "flash2" and dtype == torch.float32)]


CUDA_CASES = [
    (1, 1, 1, 2, 2, 64, {}),
    (2, 113, 113, 4, 1, 64, dict(causal=True)),
    (1, 257, 129, 8, 2, 128, dict(causal=True)),
    (1, 129, 257, 4, 4, 96, dict(window=(32, 16), softcap=10.0)),
    (2, 77, 77, 4, 2, 256, dict(alibi="heads", causal=True)),
    (1, 65, 65, 2, 2, 40, {}),  # a multiple of 8 rounded up to 64
]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=_dname)
@pytest.mark.parametrize("case", CUDA_CASES, ids=_case_id)
def test_fixed_length_cuda(case, dtype, rng):
    q, k, v, opts = _case_inputs(case, dtype, "cuda", rng)
    for variant in _cuda_variants(dtype):
        check_against_reference(_ours(variant, opts), q, k, v, opts, rng=rng)


@requires_cuda
@pytest.mark.parametrize("lens_q,lens_k,opts", VARLEN_CASES, ids=lambda x: str(x))
def test_varlen_cuda(lens_q, lens_k, opts, rng):
    for variant in _cuda_variants(torch.bfloat16):
        check_varlen(lens_q, lens_k, opts, torch.bfloat16, rng, "cuda", variant)


@requires_cuda
def test_sdpa_cuda_masks_and_layout(rng):
    q = rand((2, 8, 100, 64), torch.bfloat16, "cuda", rng)
    k, v = (rand((2, 2, 120, 64), torch.bfloat16, "cuda", rng) for _ in range(2))
    mask = torch.rand(100, 120, generator=rng).cuda() > 0.3
    mask[:, 0] = True
    for variant in _cuda_variants(torch.bfloat16):
        ours = optimized_ops.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, variant=variant)
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
        assert ours.is_contiguous() and ours.shape == want.shape
        same = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                              enable_gqa=True).bfloat16()
        check_rule(f"sdpa {variant}", ours, want, same, 120)


@requires_cuda
def test_deterministic_backward_same_bits(rng):
    q, k, v = (rand((2, 300, 4, 128), torch.bfloat16, "cuda", rng).requires_grad_() for _ in range(3))
    dout = rand((2, 300, 4, 128), torch.bfloat16, "cuda", rng)
    runs = [torch.autograd.grad(optimized_ops.flash_attention(q, k, v, causal=True, deterministic=True), (q, k, v),
                                dout) for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@requires_cuda
@pytest.mark.parametrize("varlen", [False, True])
def test_cuda_graph_capture_and_replay(varlen, rng):
    """Forward and backward captured in a CUDA graph (every CUDA variant), replayed on new inputs
    written into the same memory."""
    for variant in _cuda_variants(torch.bfloat16):
        if varlen:
            q, k, v, cu_q, cu_k = _varlen_inputs([37, 0, 90, 1], [50, 3, 90, 1], 8, 2, 64, torch.bfloat16, "cuda", rng)
        else:
            q, k, v = (rand((2, s, h, 64), torch.bfloat16, "cuda", rng) for s, h in ((97, 8), (130, 2), (130, 2)))
        inputs = [t.requires_grad_() for t in (q, k, v)]
        dout = rand(q.shape, torch.bfloat16, "cuda", rng)

        def step():
            if varlen:
                out = optimized_ops.flash_attention_varlen(*inputs, cu_q, cu_k, 90, 90, causal=True, variant=variant)
            else:
                out = optimized_ops.flash_attention(*inputs, causal=True, variant=variant)
            return out, torch.autograd.grad(out, inputs, dout)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g_out, g_grads = step()
        for _ in range(2):
            with torch.no_grad():
                for t in inputs:
                    t.copy_(rand(t.shape, torch.bfloat16, "cuda", rng))
            graph.replay()
            torch.cuda.synchronize()
            e_out, e_grads = step()
            for got, want in zip((g_out, *g_grads), (e_out, *e_grads)):
                torch.testing.assert_close(got, want, msg=lambda m: f"{variant} after replay: {m}")


@requires_cuda
def test_runs_on_the_current_stream(rng):
    q = rand((1, 512, 8, 128), torch.bfloat16, "cuda", rng)
    new_q = rand((1, 512, 8, 128), torch.bfloat16, "cuda", rng)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        q.copy_(new_q)
        outs = [optimized_ops.flash_attention(q, q, q, variant=v) for v in _cuda_variants(torch.bfloat16)]
    side.synchronize()
    want = optimized_ops.flash_attention(new_q.cpu().float(), new_q.cpu().float(), new_q.cpu().float())
    for out in outs:
        torch.testing.assert_close(out.float().cpu(), want, rtol=2e-2, atol=2e-2)


def test_cuda_tensors_with_a_cpu_only_build():
    if optimized_ops.built_with_cuda() or not torch.cuda.is_available():
        pytest.skip("needs CUDA tensors and a CPU-only build of the library")
    q = torch.ones(1, 2, 2, 8, device="cuda")
    with pytest.raises(NotImplementedError, match="this build has no CUDA backend"):
        optimized_ops.flash_attention(q, q, q)


# ---- review follow-ups: gradients that cannot flow, determinism, mask shapes --------------------

def test_slopes_and_mask_that_require_grad_are_refused(rng):
    q, k, v = (rand((1, 8, 2, 16), torch.float32, "cpu", rng).requires_grad_() for _ in range(3))
    slopes = torch.rand(2, generator=rng).requires_grad_()
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        optimized_ops.flash_attention(q, k, v, alibi_slopes=slopes, variant="cpu")
    mask = torch.zeros(1, 2, 8, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        ops.attention_fwd(q, k, v, attn_mask=mask, variant="cpu")
    # Without grad they are plain inputs.
    out = optimized_ops.flash_attention(q, k, v, alibi_slopes=slopes.detach(), variant="cpu")
    out.sum().backward()
    assert q.grad is not None


def test_sdpa_follows_torch_deterministic_algorithms(rng, monkeypatch):
    seen = []
    real = ops.attention_fwd.default

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(optimized_ops.attention._ops.attention_fwd, "default", spy, raising=False)
    q = rand((1, 2, 5, 8), torch.float32, "cpu", rng)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        optimized_ops.scaled_dot_product_attention(q, q, q)
        torch.use_deterministic_algorithms(False)
        optimized_ops.scaled_dot_product_attention(q, q, q)
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [True, False]


def test_deterministic_reaches_the_backward_op(rng, monkeypatch):
    seen = []
    real = ops.attention_bwd.default

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return real(*args, **kwargs)

    monkeypatch.setattr(optimized_ops.attention._autograd._ops.attention_bwd, "default", spy, raising=False)
    q, k, v = (rand((1, 6, 2, 8), torch.float32, "cpu", rng).requires_grad_() for _ in range(3))
    for det in (True, False):
        optimized_ops.flash_attention(q, k, v, deterministic=det, variant="cpu").sum().backward()
    assert seen == [True, False]


def test_sdpa_mask_larger_than_the_scores_is_a_value_error(rng):
    q = rand((1, 4, 6, 16), torch.float32, "cpu", rng)
    k = v = rand((1, 4, 9, 16), torch.float32, "cpu", rng)
    with pytest.raises(ValueError, match="attn_mask"):
        optimized_ops.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(2, 4, 6, 9))
