"""The Triton rungs (optimized_ops/triton/, issue 22) through the checks of their families' tests:
parity with float64 and with torch in the same dtype under the family's tolerance rule (the helpers
of test_fused.py and conftest.py, imported, not copied), odd sizes (1, primes, rows longer than a
block, rows streamed in chunks), strided views, gradients (dweight / dbias deterministic), the
argument errors of the C++ ops, torch.compile, and the rung's availability.

Where the kernels run: on CUDA, compiled, in this process. Without a CUDA device they run in Triton's
interpreter on CPU tensors, which is chosen when Triton decorates a kernel (TRITON_INTERPRET read
then): rather than set it in this pytest process (where other files' kernels could be decorated
after it), test_in_the_interpreter runs this file again in a subprocess with TRITON_INTERPRET=1, and
the kernel tests here skip with that reason. The argument checks and the availability tests run
in-process everywhere (they raise before any kernel)."""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import optimized_ops
from optimized_ops import triton as ot
from conftest import gemm_error_ratio, rand
from test_fused import CASE_BY_NAME, check_case, _dname, _strided_layouts
from test_attention import check_against_reference, reference
from test_matmul import (GRAD_ND_SHAPES, GRAD_SHAPES, ND_SHAPES, SHAPES as GEMM_SHAPES, _ids, _poison_allocator,
                         check_gradients_against_float64, check_parity_with_float64_and_torch)

ops = torch.ops.optimized

OK, WHY = ot.availability()
DEVICE = "cpu" if ot.interpreter() else "cuda"
requires_triton = pytest.mark.skipif(not OK, reason=(
    "Triton runs in the interpreter subprocess (test_in_the_interpreter)"
    if not OK and "TRITON_INTERPRET" in WHY else WHY))
TMA_OK, TMA_WHY = ot.tma_availability()
requires_tma = pytest.mark.skipif(not TMA_OK, reason=(
    "Triton runs in the interpreter subprocess (test_in_the_interpreter)"
    if not OK and "TRITON_INTERPRET" in WHY else TMA_WHY))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TRITON_CASES = ["softmax", "softmax_scaled", "layer_norm", "layer_norm_weight_only", "layer_norm_no_affine",
                "rms_norm", "rms_norm_no_weight"]
# (rows, width): one element, one row, width 1, primes, rows spanning several backward groups with a
# masked tail, a row past a power of two, a row streamed in chunks (> kMaxSingle = 8192).
SHAPES = [(1, 1), (1, 7), (5, 1), (3, 13), (6, 257), (2, 1031), (1, 8209)]


# ---- the interpreter run (CPU-only machines) -----------------------------------------------------------

def test_in_the_interpreter():
    if OK:
        pytest.skip(f"the kernels run in this process ({WHY})")
    if "TRITON_INTERPRET" not in WHY:
        pytest.skip(WHY)  # no triton at all
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             str(pathlib.Path(__file__).resolve())],
                            cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and " failed" not in result.stdout, tail


# ---- availability -------------------------------------------------------------------------------------

def test_variants_list_the_triton_rung_with_its_availability():
    assert "triton" not in optimized_ops.variants("fused")  # the C++ table, unchanged
    detail = optimized_ops.variants("fused", detail=True)
    assert [d["name"] for d in detail] == optimized_ops.variants("fused") + ["triton"]
    (rung,) = [d for d in detail if d["name"] == "triton"]
    assert rung["backend"] == "triton" and rung["available"] == OK
    assert rung["reason"] == ("" if OK else WHY)
    for family in ("gemm", "attention"):
        rungs = optimized_ops.variants(family, detail=True)
        assert [d for d in rungs if d["name"] == "triton"] == [
            {"name": "triton", "backend": "triton", "available": OK, "reason": "" if OK else WHY}]
    (tma,) = [d for d in optimized_ops.variants("gemm", detail=True) if d["name"] == "triton_tma"]
    assert tma["available"] == TMA_OK and tma["reason"] == ("" if TMA_OK else TMA_WHY)


@pytest.mark.skipif(OK, reason="Triton can run here")
def test_unavailable_variant_says_why():
    x = torch.randn(3, 8)
    for call in (lambda: optimized_ops.softmax(x, -1, variant="triton"),
                 lambda: optimized_ops.layer_norm(x, 8, variant="triton"),
                 lambda: optimized_ops.rms_norm(x, 8, variant="triton"),
                 lambda: optimized_ops.matmul(x, x.t(), variant="triton"),
                 lambda: optimized_ops.flash_attention(*(torch.randn(1, 3, 2, 8),) * 3, variant="triton")):
        with pytest.raises(NotImplementedError, match=r"variant triton is unavailable: " + WHY.split(" (")[0]):
            call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiled mode)")
def test_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"optimized::softmax_fwd: variant triton runs on CUDA devices"):
        optimized_ops.softmax(torch.randn(3, 8), -1, variant="triton")


def test_ops_without_a_triton_rung_say_so():
    x = torch.randn(3, 8)
    for call in (lambda: optimized_ops.log_softmax(x, -1, variant="triton"),
                 lambda: optimized_ops.add_rms_norm(x, x, 8, variant="triton"),
                 lambda: optimized_ops.gelu(x, variant="triton")):
        with pytest.raises(ValueError, match=r"variant triton: this op has no Triton rung"):
            call()


# ---- errors: the C++ ops' words, before any kernel (in-process everywhere) -------------------------------

def test_bad_inputs_name_the_argument():
    x = torch.ones(3, 8)
    w = torch.ones(8)
    t = dict(variant="triton")
    cases = [
        (ValueError, r"optimized::softmax_fwd: dim: expected a dimension in \[-2, 1\]; given 2",
         lambda: optimized_ops.softmax(x, 2, **t)),
        (NotImplementedError, r"optimized::softmax_fwd: x: expected dtype fp32, fp16, bf16 \(or fp64 on the cpu "
                              r"variant\); given int64", lambda: optimized_ops.softmax(x.long(), -1, **t)),
        (NotImplementedError, r"optimized::softmax_fwd: x: expected dtype fp32, fp16, bf16 .*given bool",
         lambda: optimized_ops.softmax(x.bool(), -1, **t)),
        (NotImplementedError, r"optimized::layer_norm_fwd: x: .*fp64 runs on the cpu variant only",
         lambda: optimized_ops.layer_norm(x.double(), 8, **t)),
        (ValueError, r"optimized::layer_norm_fwd: x: expected a shape ending in \[4\] \(normalized_shape\); "
                     r"given \[3, 8\]", lambda: optimized_ops.layer_norm(x, 4, **t)),
        (ValueError, r"optimized::layer_norm_fwd: normalized_shape: expected at least one dimension; given \[\]",
         lambda: optimized_ops.layer_norm(x, [], **t)),
        (ValueError, r"optimized::layer_norm_fwd: weight: expected shape \[8\] \(normalized_shape\); given \[7\]",
         lambda: optimized_ops.layer_norm(x, 8, w[:7], **t)),
        (ValueError, r"optimized::layer_norm_fwd: bias: expected shape \[8\] \(normalized_shape\); given \[3, 8\]",
         lambda: optimized_ops.layer_norm(x, 8, w, x, **t)),
        (ValueError, r"optimized::layer_norm_fwd: eps: expected >= 0; given -1",
         lambda: optimized_ops.layer_norm(x, 8, eps=-1.0, **t)),
        (ValueError, r"optimized::rms_norm_fwd: eps: expected >= 0; given nan",
         lambda: optimized_ops.rms_norm(x, 8, eps=math.nan, **t)),
        (ValueError, r"optimized::layer_norm_fwd: eps: expected >= 0; given -1",  # zero rows: checked all the same
         lambda: optimized_ops.layer_norm(x[:0], 8, eps=-1.0, **t)),
        (ValueError, r"optimized::rms_norm_fwd: weight: expected device cpu \(same as the first operand\); "
                     r"given meta", lambda: optimized_ops.rms_norm(x, 8, torch.empty(8, device="meta"), **t)),
        (ValueError, r"optimized::matmul: b: expected 8 rows to match a's columns \(K\); given shape \[7, 5\] "
                     r"with a of shape \[3, 8\]",
         lambda: optimized_ops.matmul(x, torch.ones(7, 5), **t)),
        (ValueError, r"optimized::matmul: b: expected dtype fp32 \(same as a\); given fp16",
         lambda: optimized_ops.matmul(x, torch.ones(8, 5).half(), **t)),
        (NotImplementedError, r"optimized::matmul: a: expected dtype fp32, fp16, bf16 .*given int64",
         lambda: optimized_ops.matmul(x.long(), x.long().t(), **t)),
    ]
    q = torch.ones(2, 5, 4, 16)
    cases += [
        (ValueError, r"optimized::attention_fwd: k: expected a number of heads that divides q's 4",
         lambda: optimized_ops.flash_attention(q, q[:, :, :3], q[:, :, :3], **t)),
        (ValueError, r"optimized::attention_fwd: k: expected head_dim 16", lambda: optimized_ops.flash_attention(
            q, q[..., :8], q[..., :8], **t)),
        (ValueError, r"optimized::attention_fwd: k: expected batch 2", lambda: optimized_ops.flash_attention(
            q, torch.ones(3, 5, 4, 16), torch.ones(3, 5, 4, 16), **t)),
        (ValueError, r"optimized::attention_fwd: v: expected shape", lambda: optimized_ops.flash_attention(
            q, q, torch.ones(2, 6, 4, 16), **t)),
        (ValueError, r"optimized::attention_fwd: k: expected dtype fp32", lambda: optimized_ops.flash_attention(
            q, q.double(), q, **t)),
        (ValueError, r"optimized::attention_fwd: q: expected 4 dimensions \(B, S_q, H_q, D\); given 3",
         lambda: optimized_ops.flash_attention(q[0], q[0], q[0], **t)),
        (NotImplementedError, r"optimized::attention_fwd: q: expected dtype fp16, bf16, fp32",
         lambda: optimized_ops.flash_attention(q.int(), q.int(), q.int(), **t)),
        (ValueError, r"window_size: expected a pair",
         lambda: optimized_ops.flash_attention(q, q, q, window_size=4, **t)),
        (NotImplementedError, r"optimized::attention_fwd: window_size: not implemented on the triton variant",
         lambda: optimized_ops.flash_attention(q, q, q, window_size=(3, 0), **t)),
        (NotImplementedError, r"optimized::attention_fwd: softcap: not implemented on the triton variant",
         lambda: optimized_ops.flash_attention(q, q, q, softcap=5.0, **t)),
        (NotImplementedError, r"optimized::attention_fwd: alibi_slopes: not implemented on the triton variant",
         lambda: optimized_ops.flash_attention(q, q, q, alibi_slopes=torch.ones(4), **t)),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()


# ---- vector add: the first kernel ------------------------------------------------------------------------

@requires_triton
@pytest.mark.parametrize("n", [1, 7, 1023, 1025, 4099])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
def test_vector_add(n, dtype, rng):
    x, y = rand((n,), dtype, DEVICE, rng), rand((n,), dtype, DEVICE, rng)
    assert torch.equal(ot.vector_add(x, y), x + y)  # one rounding of an exact sum: torch's bits
    m = rand((5, 2 * n), dtype, DEVICE, rng)[:, ::2]  # strided: copied, then added
    assert torch.equal(ot.vector_add(m, m), m + m)


# ---- the fused family: parity, forward and backward -------------------------------------------------------

@requires_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", TRITON_CASES)
def test_parity_forward_backward(name, shape, dtype, rng):
    case = CASE_BY_NAME[name]
    rows, width = shape
    inputs = case.make(rows, width, dtype, DEVICE, rng)
    check_case(case, inputs, "triton", dtype, rng, max(rows, width))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
@pytest.mark.parametrize("name", ["softmax", "layer_norm", "rms_norm"])
def test_strided_inputs(name, dtype, rng):
    case = CASE_BY_NAME[name]
    rows, width = 7, 67
    for label, view in _strided_layouts((rows, width), dtype, DEVICE, rng):
        inputs = case.make(rows, width, dtype, DEVICE, rng)
        inputs["x"] = view
        before = {k: t.clone() for k, t in inputs.items()}
        check_case(case, inputs, "triton", dtype, rng, width, label=f"{label}: ")
        for k, t in inputs.items():
            assert torch.equal(t, before[k]), f"{label}: input {k} changed"


@requires_triton
def test_softmax_other_dim_layout_and_gradient(rng):
    x = rand((3, 5, 7), torch.float32, DEVICE, rng).requires_grad_()
    y = optimized_ops.softmax(x, 1, scale=0.5, variant="triton")
    ref = optimized_ops.softmax(x.detach(), 1, scale=0.5, variant="auto" if DEVICE == "cuda" else "cpu")
    assert y.shape == ref.shape and y.stride() == ref.stride()  # a permuted view of a buffer with dim last
    torch.testing.assert_close(y, F.softmax(x * 0.5, 1))
    g = rand(y.shape, torch.float32, DEVICE, rng)
    (gx,) = torch.autograd.grad(y, x, g)
    xr = x.detach().requires_grad_()
    (gr,) = torch.autograd.grad(F.softmax(xr * 0.5, 1), xr, g)
    torch.testing.assert_close(gx, gr)
    s = torch.tensor(3.0, device=DEVICE)
    assert optimized_ops.softmax(s, 0, variant="triton").item() == 1.0


@requires_triton
def test_n_dimensional_norms(rng):
    x = rand((2, 3, 5, 7), torch.float32, DEVICE, rng)
    w, b = rand((5, 7), torch.float32, DEVICE, rng), rand((5, 7), torch.float32, DEVICE, rng)
    torch.testing.assert_close(optimized_ops.layer_norm(x, (5, 7), w, b, variant="triton"),
                               F.layer_norm(x, (5, 7), w, b))
    torch.testing.assert_close(optimized_ops.rms_norm(x, (5, 7), w, 1e-6, variant="triton"),
                               F.rms_norm(x, (5, 7), w, 1e-6))


@requires_triton
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_weight_gradients_deterministic_over_many_rows(rms, rng):
    """Rows over several groups of the two-stage reduction (a masked tail in the last): dweight and
    dbias within the rule against float64, and the same bits on a second run."""
    rows, width = 37, 45
    dtype = torch.bfloat16
    case = CASE_BY_NAME["rms_norm" if rms else "layer_norm"]
    inputs = case.make(rows, width, dtype, DEVICE, rng)
    check_case(case, inputs, "triton", dtype, rng, rows)
    runs = []
    for _ in range(2):
        leaves = {k: t.detach().requires_grad_() for k, t in inputs.items()}
        y = case.ours(leaves, "triton")[0]
        runs.append(torch.autograd.grad(y, list(leaves.values()), torch.ones_like(y)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@requires_triton
def test_empty_inputs_and_weight_of_another_dtype(rng):
    f32 = dict(device=DEVICE, dtype=torch.float32)
    assert optimized_ops.softmax(torch.empty(0, 5, **f32), -1, variant="triton").shape == (0, 5)
    assert optimized_ops.softmax(torch.empty(3, 0, **f32), -1, variant="triton").shape == (3, 0)
    x = torch.empty(0, 5, **f32, requires_grad=True)
    w = torch.ones(5, **f32, requires_grad=True)
    b = torch.ones(5, **f32, requires_grad=True)
    gx, gw, gb = torch.autograd.grad(optimized_ops.layer_norm(x, 5, w, b, variant="triton").sum(), (x, w, b))
    assert gx.shape == (0, 5) and torch.equal(gw, torch.zeros(5, **f32)) and torch.equal(gb, torch.zeros(5, **f32))
    # a float32 weight on bf16 input: cast (the result is bf16), the gradient arrives in float32
    xb = rand((4, 9), torch.bfloat16, DEVICE, rng)
    w32 = rand((9,), torch.float32, DEVICE, rng).requires_grad_()
    y = optimized_ops.rms_norm(xb, 9, w32, variant="triton")
    assert y.dtype == torch.bfloat16
    (g,) = torch.autograd.grad(y.float().sum(), (w32,))
    assert g.dtype == torch.float32


# ---- torch ops, fakes, compile -------------------------------------------------------------------------

@requires_triton
def test_opcheck_and_fakes(rng):
    x = rand((4, 9), torch.float32, DEVICE, rng)
    w = rand((9,), torch.float32, DEVICE, rng)
    torch.library.opcheck(ops.triton_softmax_fwd.default, (x, 0.5))
    torch.library.opcheck(ops.triton_softmax_bwd.default, (x.softmax(-1), x, 0.5))
    torch.library.opcheck(ops.triton_norm_fwd.default, (x, w, w, 1e-5, False))
    y, mean, rstd = ops.triton_norm_fwd(x, w, None, 1e-5, False)
    torch.library.opcheck(ops.triton_norm_bwd.default, (x, x, w, mean, rstd, False, True, True))
    meta = torch.empty(4, 9, device="meta")
    assert ops.triton_norm_fwd(meta, None, None, 1e-5, True)[2].shape == (4,)


@requires_triton
def test_torch_compile_fullgraph(rng):
    def model(x, w, b):
        h = optimized_ops.layer_norm(x, 16, w, b, variant="triton")
        h = optimized_ops.rms_norm(h, 16, w, variant="triton")
        return optimized_ops.softmax(h, -1, scale=0.5, variant="triton")

    torch._dynamo.reset()
    args = [rand((4, 16), torch.float32, DEVICE, rng).requires_grad_()] + \
           [rand((16,), torch.float32, DEVICE, rng).requires_grad_() for _ in range(2)]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    ref = model(*args)
    torch.testing.assert_close(out, ref)
    g = rand(out.shape, torch.float32, DEVICE, rng)
    for a, b in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(ref, args, g)):
        torch.testing.assert_close(a, b)


# ---- matmul: the tiled, autotuned GEMM ------------------------------------------------------------------

# The GEMM family's shapes (odd sizes, batched, broadcast either way) and tiles' tails: M, N, K past
# a multiple of the 32-wide interpreter tile and of the compiled tiles (64, 128).
TRITON_GEMM_SHAPES = GEMM_SHAPES + [((33, 65), (65, 129)), ((130, 31), (31, 67))]


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
@pytest.mark.parametrize("shapes", TRITON_GEMM_SHAPES + ND_SHAPES, ids=_ids)
def test_matmul_parity_with_float64_and_torch(shapes, dtype, rng):
    """test_matmul.py's two checks: the GEMM rule element by element (fp32 products and
    accumulation, one rounding), and no worse than twice torch's own error plus accumulation noise."""
    check_parity_with_float64_and_torch(rand(shapes[0], dtype, DEVICE, rng), rand(shapes[1], dtype, DEVICE, rng),
                                        "triton", poison=True)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
def test_matmul_strided_operands(dtype, rng):
    """Transposed, sliced, every-other-row and expanded operands: read in place through their
    strides (the kernel takes any strides), the result the same GEMM."""
    m, k, n = 23, 37, 19
    layouts = [
        ("a.t()", rand((k, m), dtype, DEVICE, rng).t(), rand((k, n), dtype, DEVICE, rng)),
        ("b.t()", rand((m, k), dtype, DEVICE, rng), rand((n, k), dtype, DEVICE, rng).t()),
        ("row-padded slices", rand((m, k + 5), dtype, DEVICE, rng)[:, :k], rand((k, n + 3), dtype, DEVICE, rng)[:, 1:]),
        ("every other row", rand((2 * m, k), dtype, DEVICE, rng)[::2], rand((2 * k, n), dtype, DEVICE, rng)[::2]),
        ("expanded batch", rand((1, m, k), dtype, DEVICE, rng).expand(3, m, k), rand((3, k, n), dtype, DEVICE, rng)),
    ]
    for label, a, b in layouts:
        out = optimized_ops.matmul(a, b, variant="triton")
        assert out.shape == torch.matmul(a, b).shape, label
        ratio = gemm_error_ratio(out, a, b)
        assert ratio <= 1.0, f"{label}: worst error / allowed = {ratio}"


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
@pytest.mark.parametrize("shapes", GRAD_SHAPES + GRAD_ND_SHAPES, ids=_ids)
def test_matmul_gradients_against_float64(shapes, dtype, rng):
    """test_matmul.py's gradient check: each gradient a GEMM of the Triton kernel (on transposed
    views), batch sums of broadcast operands by autograd."""
    check_gradients_against_float64(shapes, dtype, DEVICE, rng, variant="triton")


@requires_triton
def test_matmul_empty_dimensions_opcheck_and_compile(rng):
    f32 = dict(device=DEVICE, dtype=torch.float32)
    assert optimized_ops.matmul(torch.ones(0, 4, **f32), torch.ones(4, 5, **f32), variant="triton").shape == (0, 5)
    z = optimized_ops.matmul(torch.ones(3, 0, **f32), torch.ones(0, 5, **f32), variant="triton")
    assert torch.equal(z, torch.zeros(3, 5, **f32))  # K = 0: zeros, written
    a, b = rand((2, 5, 7), torch.float32, DEVICE, rng), rand((2, 7, 3), torch.float32, DEVICE, rng)
    torch.library.opcheck(ops.triton_matmul.default, (a, b))
    assert ops.triton_matmul(a.to("meta"), b.to("meta")).shape == (2, 5, 3)

    def model(x, w):
        return optimized_ops.matmul(x, w, variant="triton").relu().sum()

    torch._dynamo.reset()
    x = rand((6, 7), torch.float32, DEVICE, rng).requires_grad_()
    w = rand((7, 5), torch.float32, DEVICE, rng).requires_grad_()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), model(x, w))
    for got, want in zip(torch.autograd.grad(compiled(x, w), (x, w)), torch.autograd.grad(model(x, w), (x, w))):
        torch.testing.assert_close(got, want)


# ---- attention: FlashAttention forward and backward --------------------------------------------------------

# (B, S_q, S_k, H_q, H_kv, D, options): test_attention.py's fixed cases the Triton rung takes (causal or
# not, scale, GQA / MQA), and tiles' tails (the interpreter's 16-row tiles; 64 / 128 compiled).
ATTENTION_CASES = [
    (1, 1, 1, 1, 1, 16, {}),
    (2, 7, 7, 4, 4, 16, dict(causal=True)),
    (2, 7, 13, 4, 2, 32, dict(causal=True)),           # S_q < S_k, bottom-right
    (1, 13, 7, 4, 1, 16, dict(causal=True)),           # S_q > S_k: rows without keys (MQA)
    (2, 9, 11, 8, 2, 24, {}),                          # GQA 4, a head dim that is not a power of two
    (2, 5, 9, 2, 2, 16, dict(scale=0.7)),
    (1, 33, 29, 2, 1, 40, dict(causal=True)),
    (1, 70, 67, 2, 2, 64, {}),
]


def _attention_inputs(case, dtype, rng):
    b, s_q, s_k, h_q, h_kv, d, opts = case
    q = rand((b, s_q, h_q, d), dtype, DEVICE, rng)
    k = rand((b, s_k, h_kv, d), dtype, DEVICE, rng) * 2  # larger scores: a sharper softmax
    v = rand((b, s_k, h_kv, d), dtype, DEVICE, rng)
    return q, k, v, opts


def _triton_attention(opts):
    def fn(q, k, v):
        return optimized_ops.flash_attention(q, k, v, causal=opts.get("causal", False),
                                             softmax_scale=opts.get("scale"), return_lse=True, variant="triton")
    return fn


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=_dname)
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"B{c[0]}-Sq{c[1]}-Sk{c[2]}-H{c[3]}/{c[4]}-D{c[5]}"
                         + "".join(f"-{k}" for k in sorted(c[6])))
def test_attention_against_the_reference(case, dtype, rng):
    """test_attention.py's check: out, lse, dq, dk, dv within FlashAttention's rule against float64
    (rows without keys: out 0, lse -inf, no NaN in the gradients)."""
    q, k, v, opts = _attention_inputs(case, dtype, rng)
    check_against_reference(_triton_attention(opts), q, k, v, opts, rng=rng)


@requires_triton
def test_attention_strided_views_and_layout(rng):
    """(B, H, S, D) memory passed as (B, S, H, D) views runs in place, out laid out as q; a packed
    qkv's slices; a strided last dimension is copied."""
    qb, kb, vb = (rand((2, 4, s, 16), torch.float32, DEVICE, rng) for s in (9, 11, 11))
    q, k, v = (t.transpose(1, 2).requires_grad_() for t in (qb, kb, vb))
    out = optimized_ops.flash_attention(q, k, v, causal=True, variant="triton")
    assert out.stride() == q.stride()
    ref, _ = reference(*(t.double() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(reference(*(t.double() for t in (q, k, v)), causal=True)[0].sum(), (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    qkv = rand((2, 9, 3, 4, 16), torch.float32, DEVICE, rng)
    q_t = rand((2, 16, 4, 9), torch.float32, DEVICE, rng).transpose(1, 3)  # last stride != 1
    for qq, kk, vv in ((qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), (q_t, q_t, q_t)):
        out = optimized_ops.flash_attention(qq, kk, vv, variant="triton")
        torch.testing.assert_close(out.double(), reference(qq.double(), kk.double(), vv.double())[0],
                                   rtol=1e-5, atol=1e-5)


@requires_triton
def test_attention_deterministic_opcheck_and_compile(rng):
    q, k, v = (rand((1, 19, 4, 16), torch.bfloat16, DEVICE, rng).requires_grad_() for _ in range(3))
    runs = [torch.autograd.grad(optimized_ops.flash_attention(q, k[:, :, :2], v[:, :, :2], causal=True,
                                                              variant="triton").float().sum(), (q, k, v))
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)  # dk, dv summed over the GQA group without atomics: the same bits
    a = [t.detach().float() for t in (q, k, v)]
    torch.library.opcheck(ops.triton_attention_fwd.default, (*a, 0.25, True))
    out, lse = ops.triton_attention_fwd(*a, 0.25, True)
    torch.library.opcheck(ops.triton_attention_bwd.default, (torch.ones_like(out), *a, out, lse, 0.25, True))

    def model(q, k, v):
        return optimized_ops.flash_attention(q, k, v, causal=True, variant="triton").sum()

    torch._dynamo.reset()
    leaves = [t.requires_grad_() for t in a]
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*leaves), model(*leaves))
    for got, want in zip(torch.autograd.grad(compiled(*leaves), leaves), torch.autograd.grad(model(*leaves), leaves)):
        torch.testing.assert_close(got, want)


# ---- matmul: the persistent TMA GEMM (Hopper; emulated by the interpreter) ----------------------------------

# K and N multiples of 8 (TMA's 16-byte rows for fp16 / bf16); M anything; tails of every tile.
TMA_SHAPES = [((1, 8), (8, 8)), ((37, 40), (40, 72)), ((130, 64), (64, 200)), ((3, 5, 24), (24, 16)),
              ((2, 33, 16), (2, 16, 40))]


@requires_tma
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_dname)
@pytest.mark.parametrize("shapes", TMA_SHAPES, ids=_ids)
def test_matmul_tma_parity_and_gradients(shapes, dtype, rng):
    a = rand(shapes[0], dtype, DEVICE, rng).requires_grad_()
    b = rand(shapes[1], dtype, DEVICE, rng).requires_grad_()
    _poison_allocator(torch.matmul(a, b).shape, dtype, DEVICE)
    out = optimized_ops.matmul(a, b, variant="triton_tma")
    assert out.shape == torch.matmul(a, b).shape and out.dtype == dtype and out.is_contiguous()
    ratio = gemm_error_ratio(out, a, b)
    assert ratio <= 1.0, f"worst error / allowed = {ratio}"
    g = rand(out.shape, dtype, DEVICE, rng)
    grad_a, grad_b = torch.autograd.grad(out, (a, b), g)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref_a, ref_b = torch.autograd.grad(torch.matmul(a64, b64), (a64, b64), g.double())
    for got, ref, name in ((grad_a, ref_a, "grad_a"), (grad_b, ref_b, "grad_b")):
        err = (got.double().cpu() - ref.cpu()).abs().max().item()
        scale = ref.abs().max().item()
        eps = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
        assert err <= 4 * eps * scale + 1e-5 * scale, f"{name}: max error {err} (scale {scale})"


@requires_tma
def test_matmul_tma_layouts_and_errors(rng):
    dtype = torch.bfloat16
    m, k, n = 19, 24, 32
    layouts = [("b.t() (copied: TMA reads rows)", rand((m, k), dtype, DEVICE, rng),
                rand((n, k), dtype, DEVICE, rng).t()),
               ("row-padded slices", rand((m, k + 8), dtype, DEVICE, rng)[:, :k], rand((k, n), dtype, DEVICE, rng)),
               ("unaligned base (copied)", rand((m, k + 1), dtype, DEVICE, rng)[:, 1:],
                rand((k, n), dtype, DEVICE, rng))]
    for label, a, b in layouts:
        ratio = gemm_error_ratio(optimized_ops.matmul(a, b, variant="triton_tma"), a, b)
        assert ratio <= 1.0, f"{label}: worst error / allowed = {ratio}"
    with pytest.raises(ValueError, match=r"optimized::matmul: a: expected K a multiple of 8 for triton_tma"):
        optimized_ops.matmul(rand((4, 5), dtype, DEVICE, rng), rand((5, 8), dtype, DEVICE, rng), variant="triton_tma")
    with pytest.raises(NotImplementedError, match=r"optimized::matmul: variant: triton_tma supports fp16, bf16"):
        optimized_ops.matmul(rand((4, 8), torch.float32, DEVICE, rng), rand((8, 8), torch.float32, DEVICE, rng),
                             variant="triton_tma")
