"""optimized_ops.rope (torch.ops.optimized.rope_fwd / rope_bwd / rope_fwd_) against a float64 reference
written the way HF's apply_rotary_pos_emb computes (cos / sin of positions * inv_freq, rotate_half for
neox; pairs (2i, 2i + 1) for interleaved), in float64: both layouts, partial rotary, GQA, (T, H, D)
packed tokens, positions of every kind (random, 0, 100000, int32 / int64, (S,)), fused-qkv slices in
place and out of place, the cos_sin cache; gradients (the transpose), gradcheck / gradgradcheck, forward
mode; opcheck; torch.compile(fullgraph=True); error paths.

Tolerance, per element: |ours - ref| <= u * |ref| + (8 * 2^-24 + 2e-16 * p) * (|x0| + |x1|) (+ fp16's
subnormal spacing), u the unit roundoff of the output dtype (the C++ test's rule, tests/fused/test_rope.cpp).
"""

from __future__ import annotations

import pytest
import torch

import optimized_ops
from conftest import DEVICES, rand, requires_cuda

ops = torch.ops.optimized

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 0.0}


def dtypes_on(device: str) -> list[torch.dtype]:
    return ALL_DTYPES if device == "cpu" else ALL_DTYPES[:3]


def _device_dtype_params():
    for device in DEVICES:
        dev = device if isinstance(device, str) else device.values[0]
        marks = () if isinstance(device, str) else device.marks
        for dtype in dtypes_on(dev):
            yield pytest.param(dev, dtype, marks=marks, id=f"{dev}-{str(dtype).removeprefix('torch.')}")


def _pairs(layout: str, rd: int):
    half = rd // 2
    i = torch.arange(half)
    return (i, i + half) if layout == "neox" else (2 * i, 2 * i + 1)


def reference(x: torch.Tensor, positions: torch.Tensor, *, theta=10000.0, layout="neox", rotary_dim=None,
              inverse=False) -> torch.Tensor:
    """float64 RoPE of x (B, S, H, D) at positions (B, S) or (S,): HF's formulas in float64."""
    x = x.double().cpu()
    d = x.shape[-1]
    rd = rotary_dim or d
    inv_freq = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    pos = positions.cpu().to(torch.float64)
    angle = pos[..., None] * inv_freq  # (B, S, half) or (S, half)
    cos, sin = angle.cos(), angle.sin() * (-1 if inverse else 1)
    if pos.dim() == 1:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    i0, i1 = _pairs(layout, rd)
    y = x.clone()
    x0, x1 = x[..., i0], x[..., i1]
    y[..., i0] = x0 * cos - x1 * sin
    y[..., i1] = x1 * cos + x0 * sin
    return y


def assert_rope_close(got: torch.Tensor, x: torch.Tensor, positions, dtype: torch.dtype, **kw):
    ref = reference(x, positions, **kw)
    got = got.detach().double().cpu()
    x = x.detach().double().cpu()
    rd = kw.get("rotary_dim") or x.shape[-1]
    i0, i1 = _pairs(kw.get("layout", "neox"), rd)
    scale = torch.zeros_like(x)
    pair = x[..., i0].abs() + x[..., i1].abs()
    scale[..., i0], scale[..., i1] = pair, pair
    p = positions.cpu().double().abs()
    p = p[None] if p.dim() == 1 else p
    u = _U[dtype]
    fp = 1e-12 if u == 0.0 else 8 * 2.0**-24
    floor = 2.0**-24 if dtype == torch.float16 else 0.0  # fp16's subnormal spacing
    tol = u * ref.abs() + (fp + 2e-16 * p[:, :, None, None]) * scale + floor
    bad = (got - ref).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off; max error {(got - ref).abs().max():.3e}"
    # the pass-through dims, bit for bit
    assert torch.equal(got[..., rd:], x[..., rd:])


def _check(got, x, positions, dtype, **kw):
    assert_rope_close(got, x, positions, dtype, **kw)


# ---- forward against float64 -----------------------------------------------------------------------

@pytest.mark.parametrize("device,dtype", list(_device_dtype_params()))
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("shape", [(2, 5, 4, 2, 64, None), (1, 7, 3, 1, 128, 64), (3, 3, 5, 5, 80, None),
                                   (1, 1, 1, 1, 2, None), (2, 11, 8, 1, 80, 32)])
def test_forward_matches_float64(device, dtype, layout, shape, rng):
    B, S, Hq, Hk, D, rd = shape
    q, k = rand((B, S, Hq, D), dtype, device, rng), rand((B, S, Hk, D), dtype, device, rng)
    positions = torch.randint(0, 100001, (B, S), generator=rng).to(device)
    q_out, k_out = optimized_ops.rope(q, k, positions, layout=layout, rotary_dim=rd)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    _check(q_out, q, positions, dtype, layout=layout, rotary_dim=rd)
    _check(k_out, k, positions, dtype, layout=layout, rotary_dim=rd)


@pytest.mark.parametrize("device,dtype", list(_device_dtype_params()))
@pytest.mark.parametrize("kind", ["zero", "large", "int64-1d", "huge"])
def test_positions(device, dtype, kind, rng):
    B, S, D = 2, 6, 64
    q, k = rand((B, S, 4, D), dtype, device, rng), rand((B, S, 2, D), dtype, device, rng)
    if kind == "zero":
        positions = torch.zeros(B, S, dtype=torch.int32)
    elif kind == "large":
        positions = 100000 + torch.arange(B * S, dtype=torch.int32).view(B, S)
    elif kind == "int64-1d":
        positions = torch.randint(0, 2**20, (S,), generator=rng)
    else:
        positions = (2**33 + 977 * torch.arange(B * S)).view(B, S)
    positions = positions.to(device)
    q_out, k_out = optimized_ops.rope(q, k, positions, theta=500000.0)
    _check(q_out, q, positions, dtype, theta=500000.0)
    _check(k_out, k, positions, dtype, theta=500000.0)


@pytest.mark.parametrize("device,dtype", list(_device_dtype_params()))
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_fused_qkv_slices_in_place_and_not(device, dtype, layout, rng):
    B, S, Hq, Hk, D = 2, 9, 8, 2, 128
    qkv = rand((B, S, Hq + 2 * Hk, D), dtype, device, rng)
    q, k, v = qkv.split([Hq, Hk, Hk], dim=2)
    positions = torch.randint(0, 100000, (B, S), generator=rng).to(device)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    q_out, k_out = optimized_ops.rope(q, k, positions, layout=layout)  # strided inputs, out of place
    assert torch.equal(q, q0) and torch.equal(k, k0)
    _check(q_out, q0, positions, dtype, layout=layout)
    r_q, r_k = optimized_ops.rope(q, k, positions, layout=layout, inplace=True)
    assert r_q is q and r_k is k
    assert torch.equal(q, q_out) and torch.equal(k, k_out)
    assert torch.equal(v, v0)  # the v heads between them untouched


@pytest.mark.parametrize("device,dtype", list(_device_dtype_params()))
def test_packed_tokens_and_cos_sin_cache(device, dtype, rng):
    T, H, D, rd = 13, 3, 80, 48
    q = rand((T, H, D), dtype, device, rng)
    positions = torch.randint(0, 512, (T,), generator=rng).to(device)
    cache_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv = 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(512, dtype=torch.float64)[:, None] * inv
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).to(cache_dtype).to(device)
    q_out, k_out = optimized_ops.rope(q, None, positions, rotary_dim=rd, cos_sin=cos_sin)
    assert k_out is None and q_out.shape == (T, H, D)
    _check(q_out[None], q[None], positions, dtype, rotary_dim=rd)
    q_out2, _ = optimized_ops.rope(q, None, positions, rotary_dim=rd)
    # The cache and the computed angles agree to the output's last units. Outputs reach |x| + |y| < 2, where a
    # unit is 2 u: 16-bit outputs differ by at most that one rounding; float32 ones carry the fp32 math too
    # (cos and sin rounded, a product and a sum: ~2 units each way; measured on the H100 up to 1.6 x 2^-23).
    atol = {torch.float64: 1e-12, torch.float32: 8 * _U[dtype]}.get(dtype, 2 * _U[dtype])
    torch.testing.assert_close(q_out, q_out2, rtol=0, atol=atol)


# ---- gradients --------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,dtype", list(_device_dtype_params()))
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_gradients_are_the_transpose(device, dtype, layout, rng):
    B, S, D = 2, 5, 80
    q = rand((B, S, 4, D), dtype, device, rng).requires_grad_()
    k = rand((B, S, 2, D), dtype, device, rng).requires_grad_()
    positions = torch.randint(0, 100000, (B, S), generator=rng).to(device)
    q_out, k_out = optimized_ops.rope(q, k, positions, layout=layout, rotary_dim=64)
    gq, gk = rand(q.shape, dtype, device, rng), rand(k.shape, dtype, device, rng)
    dq, dk = torch.autograd.grad((q_out * gq).sum() + (k_out * gk).sum(), (q, k))
    _check(dq, gq, positions, dtype, layout=layout, rotary_dim=64, inverse=True)
    _check(dk, gk, positions, dtype, layout=layout, rotary_dim=64, inverse=True)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_gradgradcheck_forward_mode(device, rng):
    q = rand((1, 3, 2, 6), torch.float64, "cpu", rng).requires_grad_()
    k = rand((1, 3, 1, 6), torch.float64, "cpu", rng).requires_grad_()
    positions = torch.tensor([[0, 7, 100000]])
    for layout in ("neox", "interleaved"):
        def f(q, k):
            return optimized_ops.rope(q, k, positions, layout=layout, rotary_dim=4)
        assert torch.autograd.gradcheck(f, (q, k))
        assert torch.autograd.gradgradcheck(f, (q, k))
        assert torch.autograd.gradcheck(f, (q, k), check_forward_ad=True, check_backward_ad=False,
                                        check_undefined_grad=False)
    # The transpose in float64: <rope(x), g> == <x, rope_bwd(g)>.
    g = rand(q.shape, torch.float64, "cpu", rng)
    y, _ = ops.rope_fwd(q.detach(), None, positions)
    z, _ = ops.rope_bwd(g, None, positions)
    torch.testing.assert_close((y * g).sum(), (q.detach() * z).sum(), rtol=1e-13, atol=1e-13)


def test_inplace_refuses_grad(rng):
    q = rand((1, 2, 1, 8), torch.float32, "cpu", rng).requires_grad_()
    with pytest.raises(RuntimeError, match="inplace=True"):
        optimized_ops.rope(q, None, torch.tensor([[1, 2]]), inplace=True)
    with torch.no_grad():
        optimized_ops.rope(q, None, torch.tensor([[1, 2]]), inplace=True)


def test_inplace_marks_inputs_modified(rng):
    """In place, q and k count as modified for autograd: an op that saved them for its backward raises
    rather than differentiating with the rotated values."""
    q = rand((1, 2, 1, 8), torch.float32, "cpu", rng)
    w = torch.ones(8, requires_grad=True)
    y = (q * w).sum()  # saves q for w's gradient
    v = q._version
    optimized_ops.rope(q, None, torch.tensor([[1, 2]]), inplace=True)
    assert q._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


# ---- torch.library: opcheck, compile ---------------------------------------------------------------

@pytest.mark.parametrize("device,dtype", list(_device_dtype_params()))
def test_opcheck(device, dtype, rng):
    q, k = rand((2, 3, 4, 16), dtype, device, rng), rand((2, 3, 2, 16), dtype, device, rng)
    positions = torch.randint(0, 1000, (2, 3), generator=rng).to(device)
    torch.library.opcheck(ops.rope_fwd, (q, k, positions, 10000.0, "interleaved", 8, None), {"variant": "auto"})
    torch.library.opcheck(ops.rope_bwd, (q, None, positions), {})
    torch.library.opcheck(ops.rope_fwd_, (q.clone(), k.clone(), positions), {},
                          test_utils=("test_schema", "test_faketensor"))


def _attention_ish(q, k, positions):
    q, k = optimized_ops.rope(q, k, positions, layout="neox", rotary_dim=8)
    return (q[:, :, :2] * k).sum()


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, rng):
    torch._dynamo.reset()
    q = rand((2, 5, 2, 16), torch.float32, device, rng).requires_grad_()
    k = rand((2, 5, 2, 16), torch.float32, device, rng).requires_grad_()
    positions = torch.randint(0, 1000, (2, 5), generator=rng).to(device)
    explanation = torch._dynamo.explain(_attention_ish)(q, k, positions)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(_attention_ish, fullgraph=True)
    out, expected = compiled(q, k, positions), _attention_ish(q, k, positions)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, (q, k)), torch.autograd.grad(expected, (q, k))):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_in_place(device, rng):
    torch._dynamo.reset()

    def f(qkv, positions):
        q, k, _ = qkv.split([4, 2, 2], dim=2)
        optimized_ops.rope(q, k, positions, inplace=True)
        return qkv * 2

    qkv = rand((2, 3, 8, 16), torch.float32, device, rng)
    positions = torch.randint(0, 1000, (2, 3), generator=rng).to(device)
    expected = f(qkv.clone(), positions)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(qkv.clone(), positions)
    torch.testing.assert_close(got, expected)


# ---- errors -----------------------------------------------------------------------------------------

def test_errors_name_the_argument(rng):
    q, k = rand((2, 3, 4, 16), torch.float32, "cpu", rng), rand((2, 3, 2, 16), torch.float32, "cpu", rng)
    pos = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="rope.rotary_dim"):
        optimized_ops.rope(q, k, pos, rotary_dim=5)
    with pytest.raises(ValueError, match="layout"):
        optimized_ops.rope(q, k, pos, layout="gptj")
    with pytest.raises(ValueError, match="positions"):
        optimized_ops.rope(q, k, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions"):
        optimized_ops.rope(q, k, pos.float())
    with pytest.raises(ValueError, match="k: expected"):
        optimized_ops.rope(q, k[..., :8], pos)
    with pytest.raises(ValueError, match="cos_sin"):
        optimized_ops.rope(q, k, pos, cos_sin=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="variant"):
        optimized_ops.rope(q, k, pos, variant="fast")
    with pytest.raises(ValueError, match="q: expected 4 dimensions"):
        optimized_ops.rope(q[0, 0], k, pos)
    assert optimized_ops.variants("rope") == ["cpu", "cuda"] == optimized_ops.rope_variants()


@requires_cuda
def test_cuda_refuses_float64():
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64, device="cuda")
    with pytest.raises(NotImplementedError, match="cpu"):
        optimized_ops.rope(q, None, torch.zeros(1, 2, dtype=torch.int32, device="cuda"))
