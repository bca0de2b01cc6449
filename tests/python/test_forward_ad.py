"""Forward-mode AD of the fused ops (and the torch.func transforms built on it): torch.func.jvp and
torch.autograd.forward_ad dual tensors against torch's own ops, jacfwd against jacrev, hessian
(jacfwd over jacrev: forward mode over the *_bwd ops) against torch's, gradcheck with
check_forward_ad in float64, the *_bwd ops' own jvp, reverse mode over forward mode, vmap, and the
clear error where a derivative is not supported (third order through the double backward).

A bug report started this file: torch.func.jvp(optimized_ops.gelu, (x,), (t,)) gave a zero tangent
and forward_ad's unpack_dual a None one (torch.library.register_autograd has no forward-mode rule);
see python/optimized_ops/_autograd.py for the mechanism and fused/_autograd.py for the rules.

Tolerance: as test_fused.py (design.md's rule), with the magnitude of the terms of each jvp."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import optimized_ops
from conftest import rand, requires_cuda
from test_fused import CASES, GRAD_FNS, _device_variant_dtype_params, _dname, _norm_terms, _rms_eps, \
    _skip_if_too_wide, assert_parity

ops = torch.ops.optimized


# ---- helpers ----------------------------------------------------------------------------------------

def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _ours_fn(case, names, variant):
    return lambda *ts: case.ours(dict(zip(names, ts)), variant)


def _ref_fn(case, names, dtype):
    return lambda *ts: case.ref(dict(zip(names, ts)), dtype)


def _dual_tangents(fn, primals, tangents):
    """Output tangents of fn through torch.autograd.forward_ad (make_dual / unpack_dual); None where an
    output has none."""
    with fwAD.dual_level():
        out = _as_tuple(fn(*(fwAD.make_dual(p, t) for p, t in zip(primals, tangents))))
        return tuple(fwAD.unpack_dual(o).tangent for o in out)


def _layer_norm_elementary(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm in elementary ops, for the second-order references: torch's own (2.11) gets some
    second derivatives wrong, as if its saved statistics were constants: d(grad_weight)/d(input) in
    hessian, jacrev(jacrev) and jacfwd(jacfwd), and reverse mode over its forward mode."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    c = input - input.mean(dims, keepdim=True)
    y = c * (c.pow(2).mean(dims, keepdim=True) + eps).rsqrt()
    y = y * weight if weight is not None else y
    return y + bias if bias is not None else y


@pytest.fixture
def elementary_layer_norm(monkeypatch):
    """The cases' torch references (test_fused.CASES, F.layer_norm) on _layer_norm_elementary."""
    monkeypatch.setattr(F, "layer_norm", _layer_norm_elementary)


_SCALES = {"softmax_scaled": 0.375, "log_softmax_scaled": 2.5}


def _jvp_terms(case, i64: dict, t64: dict, dtype) -> float:
    """The magnitude of the terms of the case's jvp (see Case.terms): where they cancel (a norm over a
    row of width 1, a softmax row), the rounding noise is relative to them, not to the result."""
    if case.op in ("softmax", "log_softmax"):
        return _SCALES.get(case.name, 1.0) * t64["x"].abs().max().item()
    if case.norm:  # t_y = w * t_xhat + xhat * t_w + t_b; t_xhat's terms as the backward's dx (Case.terms)
        layer = "layer" in case.name
        eps = {"layer_norm": 2**-17, "layer_norm_weight_only": 2**-10, "rms_norm_no_weight": 2**-20}.get(
            case.name, _rms_eps(dtype) if not layer else 1e-5)
        th = t64["x"] + t64["r"] if "r" in t64 else t64["x"]
        h = i64["x"] + i64["r"] if "r" in i64 else i64["x"]
        c = h - h.mean(-1, keepdim=True) if layer else h
        xhat = c * (c.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        terms = _norm_terms(layer, eps)(i64, [th], dtype)["x"]
        if "w" in t64:
            terms += (t64["w"].abs() * xhat.abs()).max().item()
        if "b" in t64:
            terms += t64["b"].abs().max().item()
        return terms
    if case.op == "silu_and_mul":
        a, b = i64["x"].chunk(2, -1)
        ta, tb = t64["x"].chunk(2, -1)
        return (1.1 * b.abs() * ta.abs() + a.abs() * tb.abs()).max().item()
    tz = t64["x"] + t64["b"] if "b" in t64 else t64["x"]
    return 1.2 * tz.abs().max().item()


# ---- the bug: real tangents, both APIs ------------------------------------------------------------------

def test_gelu_tangent_is_not_zero(rng):
    """The reported case: jvp of gelu gave zeros, unpack_dual gave None."""
    x, t = rand((4, 7), torch.float64, "cpu", rng), rand((4, 7), torch.float64, "cpu", rng)
    _, ours = torch.func.jvp(optimized_ops.gelu, (x,), (t,))
    _, theirs = torch.func.jvp(F.gelu, (x,), (t,))
    torch.testing.assert_close(ours, theirs)
    (dual,) = _dual_tangents(optimized_ops.gelu, (x,), (t,))
    assert dual is not None
    torch.testing.assert_close(dual, theirs)


# ---- every op, dtype and variant: jvp and dual tensors against torch -------------------------------------

JVP_SHAPES = [(1, 1), (3, 13), (2, 1031)]


@pytest.mark.parametrize("device,dtype,variant", list(_device_variant_dtype_params()))
@pytest.mark.parametrize("shape", JVP_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_jvp_against_torch(case, shape, device, dtype, variant, rng):
    """torch.func.jvp and forward_ad dual tensors through ours, with a tangent on every input, against
    torch's op in the same dtype and in float64 (design.md's rule)."""
    rows, width = shape
    _skip_if_too_wide(case, variant, dtype, width)
    inputs = case.make(rows, width, dtype, device, rng)
    names = list(inputs)
    primals = tuple(inputs.values())
    tangents = tuple(rand(p.shape, dtype, device, rng) for p in primals)
    ours_out, ours = torch.func.jvp(_ours_fn(case, names, variant), primals, tangents)
    duals = _dual_tangents(_ours_fn(case, names, variant), primals, tangents)
    _, theirs = torch.func.jvp(_ref_fn(case, names, dtype), primals, tangents)
    _, ref = torch.func.jvp(_ref_fn(case, names, dtype), tuple(p.double() for p in primals),
                            tuple(t.double() for t in tangents))
    i64 = {k: p.double().cpu() for k, p in inputs.items()}
    t64 = {k: t.double().cpu() for k, t in zip(names, tangents)}
    terms = _jvp_terms(case, i64, t64, dtype)
    acc_unit = 2.0**-24 if case.norm and dtype != torch.float64 else None
    for k, (o, d, t, r) in enumerate(zip(_as_tuple(ours), duals, _as_tuple(theirs), _as_tuple(ref))):
        assert d is not None, f"{case.name}: forward_ad gave output {k} no tangent"
        if not torch.isfinite(t).all():  # torch's own half-precision jvp overflows (layer_norm of width 1)
            t = r.to(dtype)
        assert_parity(o, t, r, dtype, max(rows, width), f"{case.name} jvp of output {k}", terms=terms,
                      acc_unit=acc_unit)
        assert torch.equal(d, o), f"{case.name}: forward_ad and torch.func.jvp differ on output {k}"
    for o, r in zip(_as_tuple(ours_out), case.ours(inputs, variant)):
        assert torch.equal(o, r), f"{case.name}: the primal output under jvp differs from the plain call"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tangent_of_one_input_at_a_time(case, rng):
    """A tangent on one input only (the others have none: None in the rules), float64, against torch."""
    inputs = case.make(3, 11, torch.float64, "cpu", rng)
    names = list(inputs)
    for k, name in enumerate(names):
        t = rand(inputs[name].shape, torch.float64, "cpu", rng)
        # x alone through the function with the other inputs closed over
        def ours(v, k=k):
            return case.ours(dict(inputs, **{names[k]: v}), "cpu")

        def theirs(v, k=k):
            return case.ref(dict(inputs, **{names[k]: v}), torch.float64)

        got = _as_tuple(torch.func.jvp(ours, (inputs[name],), (t,))[1])
        want = _as_tuple(torch.func.jvp(theirs, (inputs[name],), (t,))[1])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{case.name} d/d{name}: {m}")


def test_softmax_over_a_leading_dim_tangent_layout(rng):
    """softmax over a dimension other than the last returns a permuted view; its tangent must have the
    same layout (forward AD's rule for views) and the right values."""
    x, t = rand((4, 5, 3), torch.float64, "cpu", rng), rand((4, 5, 3), torch.float64, "cpu", rng)
    for dim in (0, 1):
        for fn, ref in ((optimized_ops.softmax, F.softmax), (optimized_ops.log_softmax, F.log_softmax)):
            (got,) = _dual_tangents(lambda v: fn(v, dim), (x,), (t,))
            _, want = torch.func.jvp(lambda v: ref(v, dim), (x,), (t,))
            torch.testing.assert_close(got, want)


# ---- jacobians and hessians -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_jacfwd_equals_jacrev_and_torch(case, rng):
    """Full Jacobians with respect to every input, float64: jacfwd (vmap over jvp) against jacrev (vmap
    over the backward) and against torch's jacfwd. (The ~1e-7 bound on the norms dates from their float32
    statistics; float64 inputs now keep float64 ones.)"""
    inputs = case.make(3, 6, torch.float64, "cpu", rng)
    names = list(inputs)
    argnums = tuple(range(len(names)))
    primals = tuple(inputs.values())
    fwd = torch.func.jacfwd(_ours_fn(case, names, "auto"), argnums=argnums)(*primals)
    rev = torch.func.jacrev(_ours_fn(case, names, "auto"), argnums=argnums)(*primals)
    ref = torch.func.jacfwd(_ref_fn(case, names, torch.float64), argnums=argnums)(*primals)
    tol = 1e-6 if case.norm else 1e-12
    for f, r, t in zip(torch.utils._pytree.tree_leaves(fwd), torch.utils._pytree.tree_leaves(rev),
                       torch.utils._pytree.tree_leaves(ref)):
        torch.testing.assert_close(f, t, rtol=1e-10, atol=1e-10, msg=lambda m: f"{case.name} jacfwd vs torch: {m}")
        torch.testing.assert_close(f, r, rtol=tol, atol=tol, msg=lambda m: f"{case.name} jacfwd vs jacrev: {m}")


def _scalar(case, names, variant, dtype, ours: bool, weights):
    """A scalar function of every input through the case: sum of (output * weight)^2 over the outputs."""
    fn = _ours_fn(case, names, variant) if ours else _ref_fn(case, names, dtype)
    return lambda *ts: sum(((o * w) ** 2).sum() for o, w in zip(_as_tuple(fn(*ts)), weights))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hessian_against_torch(case, rng, elementary_layer_norm):
    """torch.func.hessian (jacfwd over jacrev: forward mode through the *_bwd ops), jacrev over jacrev
    (the double backward) and jacfwd over jacfwd (forward mode twice) of a scalar function of every
    input, float64, against torch's hessian. Tolerance 1e-5 for the norms, whose backward reads float32
    statistics."""
    inputs = case.make(2, 5, torch.float64, "cpu", rng)
    names = list(inputs)
    argnums = tuple(range(len(names)))
    primals = tuple(inputs.values())
    weights = [rand(o.shape, torch.float64, "cpu", rng) for o in _as_tuple(case.ours(inputs, "cpu"))]
    ours = _scalar(case, names, "cpu", torch.float64, True, weights)
    want = torch.func.hessian(_scalar(case, names, "cpu", torch.float64, False, weights), argnums=argnums)(*primals)
    tol = 1e-5 if case.norm else 1e-10
    for label, transform in (("hessian", lambda f: torch.func.hessian(f, argnums=argnums)),
                             ("jacrev(jacrev)", lambda f: torch.func.jacrev(torch.func.jacrev(f, argnums=argnums),
                                                                           argnums=argnums)),
                             ("jacfwd(jacfwd)", lambda f: torch.func.jacfwd(torch.func.jacfwd(f, argnums=argnums),
                                                                           argnums=argnums))):
        exact = label == "jacfwd(jacfwd)"  # no backward, no float32 statistics
        got = transform(ours)(*primals)
        for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            t = 1e-10 if exact else tol
            torch.testing.assert_close(g, w, rtol=t, atol=t * max(1.0, w.abs().max().item()),
                                       msg=lambda m: f"{case.name} {label}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_over_forward_distinct_tangents(case, rng, elementary_layer_norm):
    """jvp of jvp with two different tangents (a Hessian-free second directional derivative), on
    transposed (non-contiguous) inputs, against torch: the tangents a rule returns must stay visible to
    the outer level (jacfwd(jacfwd(f)) of a scalar does not see a rule that drops them: symmetry)."""
    inputs = {k: v.t().contiguous().t() if v.dim() == 2 else v  # column-major: non-contiguous rows
              for k, v in case.make(4, 6, torch.float64, "cpu", rng).items()}
    names = list(inputs)
    primals = tuple(inputs.values())
    inner = tuple(rand(p.shape, torch.float64, "cpu", rng) for p in primals)
    outer = tuple(rand(p.shape, torch.float64, "cpu", rng) for p in primals)

    def second(fn):
        def first(*ps):
            return torch.func.jvp(fn, ps, inner)[1]
        return _as_tuple(torch.func.jvp(first, primals, outer)[1])

    got = second(_ours_fn(case, names, "cpu"))
    want = second(_ref_fn(case, names, torch.float64))
    for k, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9 * max(1.0, w.abs().max().item()),
                                   msg=lambda m: f"{case.name} output {k}: {m}")


def test_hessian_of_a_block(rng, elementary_layer_norm):
    """The hessian of a loss through a small block of several ops (add + rms norm, layer norm, bias +
    GELU, SiLU-and-mul, softmax) with respect to its input, against torch's."""
    x, r = rand((3, 8), torch.float64, "cpu", rng), rand((3, 8), torch.float64, "cpu", rng)
    w, b = rand((8,), torch.float64, "cpu", rng), rand((8,), torch.float64, "cpu", rng)

    def ours(x):
        y, h = optimized_ops.add_rms_norm(x, r, 8, w)
        z = optimized_ops.bias_gelu(optimized_ops.layer_norm(y, 8, w, b), b, "tanh")
        z = optimized_ops.silu_and_mul(torch.cat([z, h], -1))
        return (optimized_ops.softmax(z, -1, scale=0.5) * z).sum() + optimized_ops.log_softmax(h, 0).sum()

    def theirs(x):
        h = x + r
        y = F.rms_norm(h, (8,), w, torch.finfo(torch.float64).eps)
        z = F.gelu(F.layer_norm(y, (8,), w, b) + b, approximate="tanh")
        a, c = torch.cat([z, h], -1).chunk(2, -1)
        z = F.silu(a) * c
        return (F.softmax(z * 0.5, -1) * z).sum() + F.log_softmax(h, 0).sum()

    got, want = torch.func.hessian(ours)(x), torch.func.hessian(theirs)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    got = torch.func.jacfwd(torch.func.jacfwd(ours))(x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * want.abs().max().item())


# ---- gradcheck with forward mode ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(GRAD_FNS))
def test_gradcheck_forward_ad_float64(name, rng):
    """gradcheck's forward-mode check (and the batched one, vmap over jvp) in float64 with torch's
    default tolerances, on the library's own kernels (the cpu variant)."""
    fn, _, names, _ = GRAD_FNS[name]
    shapes = dict(x=(5, 6), r=(5, 6), w=(6,), b=(6,))
    inputs = tuple(rand(shapes[n], torch.float64, "cpu", rng).requires_grad_() for n in names)
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_backward_ad=False,
                                    check_batched_forward_grad=True)


@pytest.mark.parametrize("name", [n for n, v in GRAD_FNS.items() if not v[3]])
def test_gradgradcheck_forward_over_reverse_float64(name, rng):
    """Forward mode over the first backward (the *_bwd ops' jvp) against finite differences of the
    backward kernels; not for the norms (their *_bwd ops take mean / rstd as operands, whose rounding to the
    statistics' dtype steps defeats finite differences)."""
    fn, _, names, _ = GRAD_FNS[name]
    shapes = dict(x=(5, 6), r=(5, 6), w=(6,), b=(6,))
    inputs = tuple(rand(shapes[n], torch.float64, "cpu", rng).requires_grad_() for n in names)
    assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True, check_rev_over_rev=False,
                                        check_undefined_grad=False)


# ---- the *_bwd ops: their own jvp ---------------------------------------------------------------------------

def _bwd_cases(rng, dtype=torch.float64, device="cpu"):
    """(name, op call on named tensors, float64 torch composite of the same math, inputs): every *_bwd
    op, with its operands as a forward would give them (mean / rstd: the statistics of h)."""
    def t(*shape):
        return rand(shape, dtype, device, rng)

    x, dy, w, b, dres = t(4, 9), t(4, 9), t(9), t(9), t(4, 9)
    y = F.softmax(x.double(), -1).to(dtype)
    for log in (False, True):
        name = "log_softmax_bwd" if log else "softmax_bwd"
        bwd = ops.log_softmax_bwd if log else ops.softmax_bwd
        yy = F.log_softmax(x.double(), -1).to(dtype) if log else y

        def composite(y, dy, log=log):
            p = y.exp() if log else y
            if log:
                return 0.75 * (dy - p * dy.sum(-1, keepdim=True))
            return 0.75 * y * (dy - (dy * y).sum(-1, keepdim=True))
        yield name, lambda y, dy, bwd=bwd: bwd(y, dy, -1, 0.75), composite, dict(y=yy, dy=dy)

    def norm_composite(layer, eps, with_weight, with_dres):
        def fn(dy, h, *rest):
            rest = list(rest)
            wt = rest.pop(0) if with_weight else torch.ones(9, dtype=h.dtype)
            dr = rest.pop(0) if with_dres else None
            f = (lambda h, wt: _layer_norm_elementary(h, (9,), wt, eps=eps)) if layer else \
                (lambda h, wt: F.rms_norm(h, (9,), wt, eps=eps))
            _, vjp = torch.func.vjp(f, h, wt)
            dx, dweight = vjp(dy)
            dx = dx + dr if dr is not None else dx
            out = (dx, dweight, dy.sum(0)) if layer else (dx, dweight)
            return out if with_weight else (out[0], *out[2:])  # the op gives no dweight without a weight
        return fn

    for with_weight in (True, False):
        for with_dres in (True, False):
            args = dict(dy=dy, h=x, **(dict(w=w) if with_weight else {}), **(dict(dres=dres) if with_dres else {}))

            def ln(dy, h, *rest, with_weight=with_weight, with_dres=with_dres):
                rest = list(rest)
                wt = rest.pop(0) if with_weight else None
                dr = rest.pop(0) if with_dres else None
                _, _, mean, rstd = ops.layer_norm_fwd(h, None, [9], None, None, 1e-5)
                return ops.layer_norm_bwd(dy, h, [9], wt, mean, rstd, dr, with_weight, True)

            def rms(dy, h, *rest, with_weight=with_weight, with_dres=with_dres):
                rest = list(rest)
                wt = rest.pop(0) if with_weight else None
                dr = rest.pop(0) if with_dres else None
                _, _, rstd = ops.rms_norm_fwd(h, None, [9], None, 1e-5)
                return ops.rms_norm_bwd(dy, h, [9], wt, rstd, dr, with_weight)

            label = f"{'w' if with_weight else 'no_w'}-{'dres' if with_dres else 'no_dres'}"
            yield f"layer_norm_bwd-{label}", ln, norm_composite(True, 1e-5, with_weight, with_dres), args
            yield f"rms_norm_bwd-{label}", rms, norm_composite(False, 1e-5, with_weight, with_dres), args
    for approximate in ("none", "tanh"):
        def gelu_composite(dy, x, b, approximate=approximate):
            _, vjp = torch.func.vjp(lambda x: F.gelu(x + b, approximate=approximate), x)
            (dx,) = vjp(dy)
            return dx, dx.sum(0)
        yield (f"bias_gelu_bwd-{approximate}", lambda dy, x, b, a=approximate: ops.bias_gelu_bwd(dy, x, b, a, True),
               gelu_composite, dict(dy=dy, x=x * 3, b=b))
    x2 = t(4, 18) * 3

    def silu_composite(dy, x):
        _, vjp = torch.func.vjp(lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], x)
        return vjp(dy)[0]
    yield "silu_and_mul_bwd", lambda dy, x: ops.silu_and_mul_bwd(dy, x), silu_composite, dict(dy=dy, x=x2)


def test_backward_ops_jvp_against_torch(rng):
    """Every *_bwd op's jvp (tangents on every operand but mean / rstd, which are the statistics of h:
    their dependence on h is differentiated through h) against forward mode over torch's float64
    vector-Jacobian product of the same math."""
    for name, op, composite, inputs in _bwd_cases(rng):
        primals = tuple(inputs.values())
        tangents = tuple(rand(p.shape, torch.float64, "cpu", rng) for p in primals)
        present = lambda *ts: tuple(o for o in _as_tuple(op(*ts)) if o is not None)  # noqa: E731 (torch.func: no None)
        got = _as_tuple(torch.func.jvp(present, primals, tangents)[1])
        duals = _dual_tangents(present, primals, tangents)
        want = _as_tuple(torch.func.jvp(composite, primals, tangents)[1])
        tol = 1e-6 if "norm" in name else 1e-12
        for k, (g, d, w) in enumerate(zip(got, duals, want)):
            torch.testing.assert_close(g, w, rtol=tol, atol=tol * max(1.0, w.abs().max().item()),
                                       msg=lambda m: f"{name} output {k}: {m}")
            assert torch.equal(d, g), f"{name}: forward_ad and torch.func.jvp differ on output {k}"


@pytest.mark.parametrize("name", ["softmax_bwd", "log_softmax_bwd", "bias_gelu_bwd-none", "bias_gelu_bwd-tanh",
                                  "silu_and_mul_bwd"])
def test_gradcheck_forward_ad_backward_ops(name, rng):
    """gradcheck's forward-mode check on the *_bwd ops that are functions of their operands alone
    (the norms' take the saved statistics of h, whose rounding steps defeat finite differences)."""
    op, inputs = next((op, inputs) for n, op, _, inputs in _bwd_cases(rng) if n == name)
    args = tuple(t.clone().requires_grad_() for t in inputs.values())
    assert torch.autograd.gradcheck(op, args, check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False)


# ---- reverse mode over forward mode; vmap --------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reverse_over_forward(case, rng, elementary_layer_norm):
    """The gradient of a function of the tangent, forward_ad on tensors that require grad (the jvp
    rules are differentiable in reverse mode), against torch.func.grad over torch.func.jvp of torch's
    ops (torch's own softmax raises in the first form, see _layer_norm_elementary for layer_norm)."""
    inputs = case.make(3, 7, torch.float64, "cpu", rng)
    names = list(inputs)
    tangents = {k: rand(v.shape, torch.float64, "cpu", rng) for k, v in inputs.items()}
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    with fwAD.dual_level():
        out = case.ours({k: fwAD.make_dual(v, tangents[k]) for k, v in leaves.items()}, "cpu")
        loss = sum((fwAD.unpack_dual(o).tangent ** 2).sum() for o in out)
    got = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)  # a bias's tangent is its own
    got = [torch.zeros_like(v) if g is None else g for g, v in zip(got, leaves.values())]

    def tangent_loss(*primals):
        _, tan = torch.func.jvp(_ref_fn(case, names, torch.float64), primals, tuple(tangents.values()))
        return sum((t ** 2).sum() for t in _as_tuple(tan))

    want = torch.func.grad(tangent_loss, argnums=tuple(range(len(names))))(*inputs.values())
    for k, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10 * max(1.0, w.abs().max().item()),
                                   msg=lambda m: f"{case.name} input {names[k]}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vmap_and_per_sample_gradients(case, rng):
    """torch.vmap over every op (a batch of inputs, weights included: the loop batching rule), and
    vmap over grad (per-sample gradients, a transform over batched primals) against torch's."""
    batch = [case.make(2, 5, torch.float64, "cpu", rng) for _ in range(3)]
    names = list(batch[0])
    stacked = tuple(torch.stack([b[n] for b in batch]) for n in names)
    got = _as_tuple(torch.vmap(_ours_fn(case, names, "cpu"))(*stacked))
    for k, g in enumerate(got):
        want = torch.stack([case.ours(b, "cpu")[k] for b in batch])
        torch.testing.assert_close(g, want, rtol=0, atol=0, msg=lambda m: f"{case.name} vmap output {k}: {m}")
    weights = [rand(o.shape, torch.float64, "cpu", rng) for o in case.ours(batch[0], "cpu")]
    argnums = tuple(range(len(names)))
    got = torch.vmap(torch.func.grad(_scalar(case, names, "cpu", torch.float64, True, weights), argnums=argnums))(
        *stacked)
    want = torch.vmap(torch.func.grad(_scalar(case, names, "cpu", torch.float64, False, weights),
                                      argnums=argnums))(*stacked)
    tol = 1e-6 if case.norm else 1e-10
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"{case.name} vmap(grad): {m}")


def test_vmap_of_backward_ops_with_optional_outputs(rng):
    """torch's vmap fallback cannot stack optional outputs (dweight, dbias, residual_out): the loop rule
    does, and keeps None where the op returns None; a batch of 0 too."""
    dy, h = rand((3, 4, 6), torch.float64, "cpu", rng), rand((3, 4, 6), torch.float64, "cpu", rng)
    w = rand((6,), torch.float64, "cpu", rng)
    _, _, mean, rstd = ops.layer_norm_fwd(h, None, [6], w, None, 1e-5)
    seen = []

    def bwd(dy, h, m, r):  # torch.vmap takes no None out of the function: the op's None stays inside
        dx, dw, db = ops.layer_norm_bwd(dy, h, [6], w, m, r, None, True, False)
        seen.append(db)
        return dx, dw

    dx, dw = torch.vmap(bwd)(dy, h, mean, rstd)
    assert seen == [None] and dx.shape == (3, 4, 6) and dw.shape == (3, 6)
    for i in range(3):
        want = ops.layer_norm_bwd(dy[i], h[i], [6], w, mean[i], rstd[i], None, True, False)
        assert torch.equal(dx[i], want[0]) and torch.equal(dw[i], want[1])
    y, res = torch.vmap(lambda x: optimized_ops.add_rms_norm(x, x, 6))(torch.empty(0, 4, 6, dtype=torch.float64))
    assert y.shape == res.shape == (0, 4, 6)


# ---- what is not supported says so ---------------------------------------------------------------------------

def test_third_derivative_through_the_double_backward_raises(rng):
    """Forward mode over the double backward (a third derivative) raises, naming the limit, rather than
    dropping the tangent; forward mode over forward mode goes on (a third derivative, exact)."""
    x, t = rand((3, 5), torch.float64, "cpu", rng), rand((3, 5), torch.float64, "cpu", rng)
    with fwAD.dual_level():
        xd = fwAD.make_dual(x.clone().requires_grad_(), t)
        (g,) = torch.autograd.grad(optimized_ops.gelu(xd).pow(2).sum(), xd, create_graph=True)
        with pytest.raises(RuntimeError, match="a third derivative is not supported through it"):
            torch.autograd.grad(g.pow(2).sum(), xd)
    with pytest.raises(RuntimeError, match="a third derivative is not supported through it"):
        torch.func.jacfwd(torch.func.jacrev(torch.func.jacrev(lambda v: optimized_ops.gelu(v).pow(2).sum())))(x)
    third = lambda f: torch.func.jacfwd(torch.func.jacfwd(torch.func.jacfwd(f)))  # noqa: E731
    got = third(lambda v: optimized_ops.softmax(v, -1).pow(3).sum())(x[0])
    want = third(lambda v: F.softmax(v, -1).pow(3).sum())(x[0])
    torch.testing.assert_close(got, want)


# ---- CUDA -----------------------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_dname)
def test_jacobians_and_hessian_cuda(dtype, rng):
    """jacfwd and jacrev on CUDA tensors (every CUDA variant) against torch in float64 on the same
    inputs, within the dtype's rounding; hessian in float32 (in bfloat16 every stage of jacfwd over
    jacrev rounds, and the Hessian's terms cancel)."""
    x = rand((3, 40), dtype, "cuda", rng)
    w, b = rand((40,), dtype, "cuda", rng), rand((40,), dtype, "cuda", rng)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for variant in ("auto", "unfused", "fused_streaming", "fused_registers"):
        for name, ours, theirs in (
                ("layer_norm", lambda v: optimized_ops.layer_norm(v, 40, w, b, variant=variant),
                 lambda v: F.layer_norm(v, (40,), w.double(), b.double())),
                ("softmax", lambda v: optimized_ops.softmax(v, -1, variant=variant), lambda v: F.softmax(v, -1)),
                ("bias_gelu", lambda v: optimized_ops.bias_gelu(v, b, variant=variant),
                 lambda v: F.gelu(v + b.double()))):
            want = torch.func.jacfwd(theirs)(x.double())
            scale = want.abs().max().item()
            for label, transform in (("jacfwd", torch.func.jacfwd), ("jacrev", torch.func.jacrev)):
                got = transform(ours)(x).double()
                torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale,
                                           msg=lambda m: f"{name} {variant} {label}: {m}")
            if dtype != torch.float32:
                continue
            scalar = (lambda f: lambda v: (f(v).double() ** 2).sum())
            got = torch.func.hessian(scalar(ours))(x).double()
            want = torch.func.hessian(scalar(theirs))(x.double())
            torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item(),
                                       msg=lambda m: f"{name} {variant} hessian: {m}")


# ---- matmul ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [((5, 7), (7, 3)), ((4, 5, 7), (7, 3)), ((5, 7), (4, 7, 3)),
                                    ((1, 5, 7), (4, 7, 3)), ((4, 5, 7), (4, 7, 3)), ((7,), (7, 3)),
                                    ((5, 7), (7,)), ((2, 1, 5, 7), (3, 7, 4))],
                         ids=lambda s: f"{list(s[0])}@{list(s[1])}")
def test_matmul_forward_ad(shapes, rng):
    a, b = rand(shapes[0], torch.float64, "cpu", rng), rand(shapes[1], torch.float64, "cpu", rng)
    ta, tb = rand(a.shape, torch.float64, "cpu", rng), rand(b.shape, torch.float64, "cpu", rng)
    _, got = torch.func.jvp(optimized_ops.matmul, (a, b), (ta, tb))
    _, want = torch.func.jvp(torch.matmul, (a, b), (ta, tb))
    torch.testing.assert_close(got, want)
    (dual,) = _dual_tangents(optimized_ops.matmul, (a, b), (ta, tb))
    torch.testing.assert_close(dual, want)


@pytest.mark.parametrize("variant", ["auto", "cpu_naive", "cpu_blocked"])
def test_matmul_forward_ad_gradcheck_and_jacobians(variant, rng):
    a = rand((2, 1, 3, 4), torch.float64, "cpu", rng).requires_grad_()
    b = rand((3, 4, 5), torch.float64, "cpu", rng).requires_grad_()
    fn = lambda x, y: optimized_ops.matmul(x, y, variant=variant)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (a, b), check_forward_ad=True, check_backward_ad=True)
    fwd = torch.func.jacfwd(fn, argnums=(0, 1))(a.detach(), b.detach())
    rev = torch.func.jacrev(fn, argnums=(0, 1))(a.detach(), b.detach())
    want = torch.func.jacrev(torch.matmul, argnums=(0, 1))(a.detach(), b.detach())
    for f, r, w in zip(fwd, rev, want):
        torch.testing.assert_close(f, w)
        torch.testing.assert_close(r, w)
    # The Hessian of a scalar function of the product (second derivatives through the op twice).
    scalar = lambda g: lambda x: g(x, b.detach()).pow(2).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.hessian(scalar(fn))(a.detach()),
                               torch.func.hessian(scalar(torch.matmul))(a.detach()))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_matmul_forward_ad_cuda(dtype, rng):
    a, b = rand((3, 17, 33), dtype, "cuda", rng), rand((33, 9), dtype, "cuda", rng)
    ta, tb = rand(a.shape, dtype, "cuda", rng), rand(b.shape, dtype, "cuda", rng)
    want = (torch.matmul(ta.double(), b.double()) + torch.matmul(a.double(), tb.double()))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for variant in ["auto", "naive", "register_tiled"] + (["mma_pipeline"] if dtype != torch.float32 else []):
        _, got = torch.func.jvp(lambda x, y: optimized_ops.matmul(x, y, variant=variant), (a, b), (ta, tb))
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item(),
                                   msg=lambda m: f"{variant}: {m}")
