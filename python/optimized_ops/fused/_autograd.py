"""Autograd of the fused ops, reverse mode and forward mode: the rules, registered through
``optimized_ops._autograd.register_autograd`` (the mechanism, shared with GEMM).

* every forward op (``<op>_fwd``): its backward is the matching ``*_bwd`` op, on the same kernels and
  variant (``fused_registers`` becomes ``auto``: :func:`_backward_variant`), and its jvp rule gives
  ``torch.autograd.forward_ad`` and ``torch.func`` real tangents;
* every backward op (``<op>_bwd``), for double backward: the vector-Jacobian product of a composite
  torch formula of the same math, differentiable once more, not twice; and a jvp rule;
* a batching rule (a loop over the batch) for every op (``batching=True``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .._autograd import compute_dtype, has_tangent, kernel_scalar, register_autograd
from .._library import load

load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized


def _needs(ctx, n: int) -> tuple:
    """ctx.needs_input_grad padded to the op's n positional arguments: the dispatcher drops trailing
    arguments equal to their defaults before autograd sees them."""
    needs = tuple(ctx.needs_input_grad)
    return needs + (False,) * (n - len(needs))


def _backward_variant(variant: str) -> str:
    # fused_registers keeps fewer elements per thread in the backward: rows it held in the forward
    # may need fused_streaming there, which is what "auto" picks (same rung whenever it fits).
    return "auto" if variant == "fused_registers" else variant


# ---- forward mode: the jvp rules ---------------------------------------------------------------
# jvp(inputs, keyword_only_inputs, output, tangents) -> output tangents (see _autograd.py), for every
# forward and backward op, so that torch.func.jvp / jacfwd / hessian and torch.autograd.forward_ad
# give real tangents. softmax's rule is softmax_bwd itself: its Jacobian is symmetric, so its vjp
# (what softmax_bwd computes, on the same kernels and variant) is its jvp. The others are formulas in
# float32 (float64 for float64 operands), rounded once to the output's dtype. A tangent that is None
# counts as zero. Norms: mean / rstd are outputs without tangent (non-differentiable, as in the
# backward); the rules of the *_bwd ops read them as the statistics of h (which they are), so their
# dependence on h is differentiated through h, as the double backward does.

def _add(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """a + b where None is zero."""
    return b if a is None else a if b is None else a + b


def _mul(a: Optional[torch.Tensor], b: torch.Tensor) -> Optional[torch.Tensor]:
    return None if a is None else a * b


def _to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def _full(t: Optional[torch.Tensor], shape) -> Optional[torch.Tensor]:
    """t broadcast to the output's shape (a bias's tangent alone has the bias's shape)."""
    return t if t is None or t.shape == shape else t.expand(shape)


def _softmax_jvp(log: bool):
    def jvp(inputs, keyword_only_inputs, y, tangents):
        _, dim, scale = inputs
        tx = tangents[0]
        if tx is None:
            return None
        if not log:
            # s * y * (tx - sum(y * tx)): exactly what softmax_bwd computes for dy = tx.
            return _ops.softmax_bwd.default(y, tx, dim, scale,
                                            variant=_backward_variant(keyword_only_inputs.get("variant", "auto")))
        c = compute_dtype(y)
        # log_softmax: s * (tx - sum(softmax * tx)), softmax = exp(y)
        txc = tx.to(c)
        return (kernel_scalar(scale, c) * (txc - (y.to(c).exp() * txc).sum(dim, keepdim=True))).to(y.dtype)
    return jvp


def _norm_jvp(layer: bool):
    """y = xhat * w + b with xhat = (h - mean(h)) * rstd (layer) or h * rstd (rms), h = x (+ residual):
    t_xhat = rstd * (t_hc - xhat * mean(xhat * t_h)) with t_hc = t_h - mean(t_h) (layer) or t_h (rms),
    t_y = t_xhat * w + xhat * t_w + t_b, t_residual_out = t_h. The statistics are recomputed from h
    in the compute dtype (float64 ones for float64)."""
    def jvp(inputs, keyword_only_inputs, output, tangents):
        if layer:
            x, residual, ns, weight, bias, eps = inputs
            tx, tr, _, tw, tb, _ = tangents
        else:
            x, residual, ns, weight, eps = inputs
            tx, tr, _, tw, _ = tangents
            tb = None
        residual_out = output[1]
        h = residual_out if residual is not None else x
        th = _add(tx, tr) if residual is not None else tx
        dims = tuple(range(-len(ns), 0))
        c = compute_dtype(h)
        hc = h.to(c)
        centered = hc - hc.mean(dims, keepdim=True) if layer else hc
        rstd = ((centered * centered).mean(dims, keepdim=True) + kernel_scalar(eps, c)).rsqrt()
        xhat = centered * rstd
        ty = None
        if th is not None:
            thc = th.to(c)
            thc_centered = thc - thc.mean(dims, keepdim=True) if layer else thc
            ty = rstd * (thc_centered - xhat * (xhat * thc).mean(dims, keepdim=True))
            if weight is not None:
                ty = ty * weight.to(c)
        ty = _add(ty, _mul(_to(tw, c), xhat))
        ty = _add(ty, _to(tb, c))
        ty = _full(_to(ty, x.dtype), x.shape)
        t_residual_out = None if residual is None else th
        return (ty, t_residual_out, None, None) if layer else (ty, t_residual_out, None)
    return jvp


def _bias_gelu_jvp(inputs, keyword_only_inputs, y, tangents):
    """gelu'(z) * (t_x + t_bias), z = x + bias (the kernel's math: z not rounded). bias_gelu_bwd computes
    the same product, but returns (dx, None), which the legacy vmap of gradcheck's batched checks and
    torch.autograd.functional cannot batch: a formula here."""
    x, bias, approximate = inputs
    tz = _add(tangents[0], tangents[1])
    if tz is None:
        return None
    c = compute_dtype(x)
    z = x.to(c) if bias is None else x.to(c) + bias.to(c)
    return _full((_gelu_derivatives(z, approximate)[0] * tz.to(c)).to(x.dtype), x.shape)


def _silu_derivatives(a: torch.Tensor):
    """silu(a), silu'(a), silu''(a)."""
    s = torch.sigmoid(a)
    return a * s, s * (1 + a * (1 - s)), s * (1 - s) * (2 + a * (1 - 2 * s))


def _silu_and_mul_jvp(inputs, keyword_only_inputs, y, tangents):
    x, tx = inputs[0], tangents[0]
    if tx is None:
        return None
    c = compute_dtype(x)
    a, b = x.to(c).chunk(2, dim=-1)
    ta, tb = tx.to(c).chunk(2, dim=-1)
    silu, dsilu, _ = _silu_derivatives(a)
    return (dsilu * b * ta + silu * tb).to(x.dtype)


def _softmax_bwd_jvp(log: bool):
    """softmax_bwd: dx = s * y * (dy - sum(dy * y)); log_softmax_bwd: dx = s * (dy - exp(y) * sum(dy))."""
    def jvp(inputs, keyword_only_inputs, dx, tangents):
        y, dy, dim, scale = inputs
        ty, tdy = tangents[0], tangents[1]
        if ty is None and tdy is None:
            return None
        c = compute_dtype(y)
        yc, dyc = y.to(c), dy.to(c)
        tyc, tdyc = _to(ty, c), _to(tdy, c)

        def total(t):
            return t.sum(dim, keepdim=True)

        t = None
        if log:
            p = yc.exp()
            if tyc is not None:
                t = -p * tyc * total(dyc)
            if tdyc is not None:
                t = _add(t, tdyc - p * total(tdyc))
        else:
            if tyc is not None:
                t = tyc * (dyc - total(dyc * yc)) - yc * total(dyc * tyc)
            if tdyc is not None:
                t = _add(t, yc * (tdyc - total(tdyc * yc)))
        return (kernel_scalar(scale, t.dtype) * t).to(dx.dtype)
    return jvp


def _norm_bwd_jvp(layer: bool):
    """dx = r * A + dresidual_out with A = g - mean(g) - xhat * mean(g * xhat) (rms: no mean(g) term),
    g = dy * w, xhat = (h - mean(h)) * r (rms: h * r), r the saved rstd; dweight = sum_rows(dy * xhat),
    dbias = sum_rows(dy). The tangents, with r a function of h (t_r = -r^2 * mean(xhat * t_h)):
    t_xhat = r * (t_hc - xhat * mean(xhat * t_h)), t_g = t_dy * w + dy * t_w,
    t_A = t_g - mean(t_g) - t_xhat * mean(g * xhat) - xhat * mean(t_g * xhat + g * t_xhat),
    t_dx = t_r * A + r * t_A + t_dresidual_out."""
    def jvp(inputs, keyword_only_inputs, output, tangents):
        if layer:
            dy, h, ns, weight, _, rstd, dresidual_out, _, _ = inputs
            tdy, th, _, tw, _, _, tdres, _, _ = tangents
        else:
            dy, h, ns, weight, rstd, dresidual_out, _ = inputs
            tdy, th, _, tw, _, tdres, _ = tangents
        k = len(ns)
        dims = tuple(range(-k, 0))
        rows = tuple(range(h.dim() - k))
        c = compute_dtype(h)

        def mean(t):
            return t.mean(dims, keepdim=True)

        hc, dyc = h.to(c), dy.to(c)
        w = _to(weight, c)
        r = rstd.to(c).reshape(*rstd.shape, *([1] * k))
        xhat = (hc - mean(hc) if layer else hc) * r
        g = dyc * w if w is not None else dyc
        mgx = mean(g * xhat)
        a = g - xhat * mgx
        if layer:
            a = a - mean(g)
        txhat = tr = None
        if th is not None:
            thc = th.to(c)
            m = mean(xhat * thc)
            txhat = r * ((thc - mean(thc) if layer else thc) - xhat * m)
            tr = -r * r * m
        tdyc = _to(tdy, c)
        tg = _add(tdyc if w is None else _mul(tdyc, w), _mul(_to(tw, c), dyc))
        ta = None
        if tg is not None:
            ta = tg - xhat * mean(tg * xhat)
            if layer:
                ta = ta - mean(tg)
        if txhat is not None:
            ta = _add(ta, -txhat * mgx - xhat * mean(g * txhat))
        tdx = _add(_mul(tr, a), _mul(ta, r))
        tdx = _add(tdx, _to(tdres, c))
        tdx = _full(_to(tdx, h.dtype), h.shape)
        dweight = output[1]
        tdweight = None
        if dweight is not None:
            tdweight = _add(_mul(tdyc, xhat), _mul(txhat, dyc))
            tdweight = None if tdweight is None else tdweight.sum(rows).to(dweight.dtype)
        if not layer:
            return tdx, tdweight
        dbias = output[2]
        tdbias = None if dbias is None or tdy is None else tdy.sum(rows).to(dbias.dtype)
        return tdx, tdweight, tdbias
    return jvp


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_A = 0.044715


def _gelu_derivatives(z: torch.Tensor, approximate: str):
    """gelu'(z), gelu''(z): erf form Phi + z phi and phi * (2 - z^2); tanh form with
    u = k (z + a z^3), T = tanh(u): 0.5 (1 + T) + 0.5 z (1 - T^2) u' and (1 - T^2) (u' - z T u'^2 + 0.5 z u'')."""
    if approximate == "tanh":
        du = _SQRT_2_OVER_PI * (1 + 3 * _GELU_TANH_A * z * z)
        d2u = _SQRT_2_OVER_PI * 6 * _GELU_TANH_A * z
        t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_A * z * z * z))
        sech2 = 1 - t * t
        return 0.5 * (1 + t) + 0.5 * z * sech2 * du, sech2 * (du - z * t * du * du + 0.5 * z * d2u)
    phi = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2.0)))
    return cdf + z * phi, phi * (2 - z * z)


def _bias_gelu_bwd_jvp(inputs, keyword_only_inputs, output, tangents):
    """dx = dy * gelu'(z), z = x + bias; dbias = sum_rows(dx):
    t_dx = t_dy * gelu'(z) + dy * gelu''(z) * (t_x + t_bias)."""
    dy, x, bias, approximate, _ = inputs
    tdy, tx, tb = tangents[:3]
    tz = _add(tx, tb)
    if tdy is None and tz is None:
        return None, None
    c = compute_dtype(x)
    z = x.to(c) if bias is None else x.to(c) + bias.to(c)
    d1, d2 = _gelu_derivatives(z, approximate)
    tdx = _add(_mul(_to(tdy, c), d1), _mul(_to(tz, c), dy.to(c) * d2))
    tdbias = None if output[1] is None else tdx.sum(tuple(range(x.dim() - 1))).to(output[1].dtype)
    return _full(tdx.to(x.dtype), x.shape), tdbias


def _silu_and_mul_bwd_jvp(inputs, keyword_only_inputs, dx, tangents):
    """dx = [dy * b * silu'(a) | dy * silu(a)] for x = [a | b]."""
    dy, x = inputs
    tdy, tx = tangents
    if tdy is None and tx is None:
        return None
    c = compute_dtype(x)
    dyc = dy.to(c)
    a, b = x.to(c).chunk(2, dim=-1)
    silu, d1, d2 = _silu_derivatives(a)
    tda = tdb = None
    if tdy is not None:
        tdyc = tdy.to(c)
        tda, tdb = tdyc * b * d1, tdyc * silu
    if tx is not None:
        ta, tb = tx.to(c).chunk(2, dim=-1)
        tda = _add(tda, dyc * (tb * d1 + b * d2 * ta))
        tdb = _add(tdb, dyc * d1 * ta)
    return torch.cat([tda, tdb], dim=-1).to(x.dtype)


# ---- autograd of the forward ops: backward on the *_bwd ops ------------------------------------

def _softmax_autograd(name: str):
    bwd = getattr(_ops, f"{name}_bwd").default

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        _, ctx.dim, ctx.scale = inputs
        ctx.variant = _backward_variant(keyword_only_inputs.get("variant", "auto"))
        ctx.save_for_backward(output)  # the backward works from the output y

    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return bwd(y, dy, ctx.dim, ctx.scale, variant=ctx.variant), None, None

    register_autograd(f"optimized::{name}_fwd", backward, setup_context=setup_context,
                      jvp=_softmax_jvp(name == "log_softmax"), batching=True)


_softmax_autograd("softmax")
_softmax_autograd("log_softmax")


def _norm_setup(layer: bool):
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        if layer:
            _, residual, ns, weight, _, _ = inputs
            _, residual_out, mean, rstd = output
        else:
            _, residual, ns, weight, _ = inputs
            _, residual_out, rstd = output
            mean = None
        x = inputs[0]
        ctx.normalized_shape = list(ns)
        ctx.variant = _backward_variant(keyword_only_inputs.get("variant", "auto"))
        # The backward normalizes what the forward normalized: x, or h = x + residual as rounded.
        h = residual_out if residual is not None else x
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
        ctx.set_materialize_grads(False)  # a None gradient (output unused) costs no zeros
    return setup_context


def _layer_norm_backward(ctx, dy, dresidual_out, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    need_x, need_residual, _, need_weight, need_bias, _ = _needs(ctx, 6)
    dweight = dbias = None
    if dy is None:  # only residual_out was used
        dx = dresidual_out
    else:
        dx, dweight, dbias = _ops.layer_norm_bwd.default(
            dy, h, ctx.normalized_shape, weight, mean, rstd, dresidual_out, need_weight and weight is not None,
            need_bias, variant=ctx.variant)
    return dx if need_x else None, dx if need_residual else None, None, dweight, dbias, None


def _rms_norm_backward(ctx, dy, dresidual_out, _drstd):
    h, weight, _, rstd = ctx.saved_tensors
    need_x, need_residual, _, need_weight, _ = _needs(ctx, 5)
    dweight = None
    if dy is None:
        dx = dresidual_out
    else:
        dx, dweight = _ops.rms_norm_bwd.default(dy, h, ctx.normalized_shape, weight, rstd, dresidual_out,
                                                need_weight and weight is not None, variant=ctx.variant)
    return dx if need_x else None, dx if need_residual else None, None, dweight, None


register_autograd("optimized::layer_norm_fwd", _layer_norm_backward, setup_context=_norm_setup(True),
                  jvp=_norm_jvp(True), batching=True)
register_autograd("optimized::rms_norm_fwd", _rms_norm_backward, setup_context=_norm_setup(False),
                  jvp=_norm_jvp(False), batching=True)


def _bias_gelu_setup(ctx, inputs, keyword_only_inputs, output):
    x, bias, ctx.approximate = inputs
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.save_for_backward(x, bias)


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    need_x, need_bias, _ = _needs(ctx, 3)
    dx, dbias = _ops.bias_gelu_bwd.default(dy, x, bias, ctx.approximate, need_bias, variant=ctx.variant)
    return dx if need_x else None, dbias, None


register_autograd("optimized::bias_gelu_fwd", _bias_gelu_backward, setup_context=_bias_gelu_setup,
                  jvp=_bias_gelu_jvp, batching=True)


def _silu_and_mul_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.save_for_backward(inputs[0])


def _silu_and_mul_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _ops.silu_and_mul_bwd.default(dy, x, variant=ctx.variant)


register_autograd("optimized::silu_and_mul_fwd", _silu_and_mul_backward, setup_context=_silu_and_mul_setup,
                  jvp=_silu_and_mul_jvp, batching=True)


# ---- autograd of the backward ops (double backward) --------------------------------------------
# The derivative of each *_bwd op is the vector-Jacobian product of a composite formula of the same
# math, taken by torch's autograd in float32 (float64 for float64 operands). The norms' formulas
# recompute the statistics from h, except that rstd keeps the saved value
# (r = rsqrt(var - var.detach() + rstd^-2): the saved rstd, with the derivative of rsqrt(var + eps)).

_NO_THIRD_DERIVATIVE = ("optimized_ops: the fused ops are differentiable twice in reverse mode (their double "
                        "backward is a composite formula); a third derivative is not supported through it (forward "
                        "mode over forward mode and forward mode over one backward are)")


class _NoThirdDerivative(torch.autograd.Function):
    """Passes the second-order gradients through (copies, tied to the tensors that carry the graph)
    and raises if they are differentiated again (in the style torch.func requires: setup_context, and
    a vmap rule, as jacrev vmaps over the backward)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(count, *tensors):
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_NO_THIRD_DERIVATIVE)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(_NO_THIRD_DERIVATIVE)


def _differentiable_once_more(backward):
    """For the backward of a *_bwd op: under create_graph, or with forward-mode tangents, ties its
    results to the saved operands and incoming gradients through _NoThirdDerivative, so that a third
    derivative raises instead of silently missing terms (torch's once_differentiable does not catch
    this case: its error node hangs off fresh leaves, which autograd.grad(..., inputs) prunes)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        operands = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor)]
        grad_mode = torch.is_grad_enabled()
        tracked = [t for t in operands if (grad_mode and t.requires_grad) or has_tangent((t,))]
        present = [t for t in outputs if t is not None]
        if not tracked or not present:
            return outputs
        tied = iter(_NoThirdDerivative.apply(len(present), *present, *tracked))
        return tuple(None if t is None else next(tied) for t in outputs)
    return wrapper


def _vjp(fn, primals, cotangents):
    """The vector-Jacobian product of fn at primals (torch.func.vjp: it works inside the torch.func
    transforms too, where requires_grad_ and autograd.grad do not)."""
    _, vjp_fn = torch.func.vjp(fn, *primals)
    return vjp_fn(cotangents)


def _composite_vjp(fn, tensors, needs, grads):
    """Gradients of ``fn(*tensors)`` (a tuple of tensors or None) with respect to the tensors whose
    ``needs`` is True, given ``grads`` for its outputs; in the dtypes of ``tensors``."""
    compute = torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    values = [None if t is None else t.detach().to(compute) for t in tensors]
    wrt = [k for k, (v, need) in enumerate(zip(values, needs)) if need and v is not None and v.dtype.is_floating_point]
    result = [None] * len(tensors)
    if not wrt:
        return result

    present = []  # which outputs fn returns (the others are None)

    def of_wrt(*diff):
        full = list(values)
        for k, d in zip(wrt, diff):
            full[k] = d
        outs = fn(*full)
        present[:] = [o is not None for o in outs]
        return tuple(o for o in outs if o is not None)

    outs, vjp_fn = torch.func.vjp(of_wrt, *(values[k] for k in wrt))
    given = [g for g, p in zip(grads, present) if p]
    cotangents = tuple(torch.zeros_like(o) if g is None else g.to(compute) for o, g in zip(outs, given))
    for k, g in zip(wrt, vjp_fn(cotangents)):
        result[k] = g.to(tensors[k].dtype)
    return result


def _softmax_bwd_math(log: bool, dim: int, scale: float):
    def fn(y, dy):
        if log:
            return (scale * (dy - y.exp() * dy.sum(dim, keepdim=True)),)
        return (scale * y * (dy - (dy * y).sum(dim, keepdim=True)),)
    return fn


def _register_softmax_double_backward(name: str, log: bool):
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        y, dy, ctx.dim, ctx.scale = inputs
        ctx.save_for_backward(y, dy)

    @_differentiable_once_more
    def backward(ctx, g):
        y, dy = ctx.saved_tensors
        fn = _softmax_bwd_math(log, ctx.dim, ctx.scale)
        gy, gdy = _composite_vjp(fn, (y, dy), _needs(ctx, 4)[:2], (g,))
        return gy, gdy, None, None

    register_autograd(f"optimized::{name}_bwd", backward, setup_context=setup_context, jvp=_softmax_bwd_jvp(log),
                      batching=True)


_register_softmax_double_backward("softmax", False)
_register_softmax_double_backward("log_softmax", True)


def _norm_bwd_math(layer: bool, k: int, want_dweight: bool, want_dbias: bool):
    dims = tuple(range(-k, 0))

    def fn(dy, h, weight, rstd, dresidual_out):
        def normalized(h, *weight):
            c = h - h.mean(dims, keepdim=True) if layer else h
            var = (c * c).mean(dims, keepdim=True)
            r = (var - var.detach() + rstd.reshape(*rstd.shape, *([1] * k)).pow(-2)).rsqrt()
            return c * r * weight[0] if weight else c * r

        grads = _vjp(normalized, (h, weight) if weight is not None else (h,), dy)
        dx = grads[0] if dresidual_out is None else grads[0] + dresidual_out
        dweight = grads[1] if want_dweight and weight is not None else None
        dbias = dy.sum(tuple(range(dy.dim() - k))) if want_dbias else None
        return dx, dweight, dbias
    return fn


def _layer_norm_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    dy, h, ns, weight, mean, rstd, dresidual_out, ctx.want_dweight, ctx.want_dbias = inputs
    ctx.k = len(ns)
    ctx.save_for_backward(dy, h, weight, rstd, dresidual_out)


@_differentiable_once_more
def _layer_norm_bwd_backward(ctx, gdx, gdweight, gdbias):
    dy, h, weight, rstd, dresidual_out = ctx.saved_tensors
    n = _needs(ctx, 9)
    fn = _norm_bwd_math(True, ctx.k, ctx.want_dweight, ctx.want_dbias)
    g_dy, g_h, g_w, _, g_dres = _composite_vjp(fn, (dy, h, weight, rstd, dresidual_out),
                                               (n[0], n[1], n[3], False, n[6]), (gdx, gdweight, gdbias))
    return g_dy, g_h, None, g_w, None, None, g_dres, None, None


def _rms_norm_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    dy, h, ns, weight, rstd, dresidual_out, ctx.want_dweight = inputs
    ctx.k = len(ns)
    ctx.save_for_backward(dy, h, weight, rstd, dresidual_out)


@_differentiable_once_more
def _rms_norm_bwd_backward(ctx, gdx, gdweight):
    dy, h, weight, rstd, dresidual_out = ctx.saved_tensors
    n = _needs(ctx, 7)
    fn = _norm_bwd_math(False, ctx.k, ctx.want_dweight, False)
    g_dy, g_h, g_w, _, g_dres = _composite_vjp(fn, (dy, h, weight, rstd, dresidual_out),
                                               (n[0], n[1], n[3], False, n[5]), (gdx, gdweight, None))
    return g_dy, g_h, None, g_w, None, g_dres, None


register_autograd("optimized::layer_norm_bwd", _layer_norm_bwd_backward, setup_context=_layer_norm_bwd_setup,
                  jvp=_norm_bwd_jvp(True), batching=True)
register_autograd("optimized::rms_norm_bwd", _rms_norm_bwd_backward, setup_context=_rms_norm_bwd_setup,
                  jvp=_norm_bwd_jvp(False), batching=True)


def _bias_gelu_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    dy, x, bias, ctx.approximate, ctx.want_dbias = inputs
    ctx.save_for_backward(dy, x, bias)


@_differentiable_once_more
def _bias_gelu_bwd_backward(ctx, gdx, gdbias):
    dy, x, bias = ctx.saved_tensors
    approximate, want_dbias = ctx.approximate, ctx.want_dbias

    def fn(dy, x, bias):
        (dx,) = _vjp(lambda x: F.gelu(x if bias is None else x + bias, approximate=approximate), (x,), dy)
        return dx, dx.sum(tuple(range(dx.dim() - 1))) if want_dbias else None

    n = _needs(ctx, 5)
    g_dy, g_x, g_b = _composite_vjp(fn, (dy, x, bias), n[:3], (gdx, gdbias))
    return g_dy, g_x, g_b, None, None


register_autograd("optimized::bias_gelu_bwd", _bias_gelu_bwd_backward, setup_context=_bias_gelu_bwd_setup,
                  jvp=_bias_gelu_bwd_jvp, batching=True)


def _silu_mul_of(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def _silu_and_mul_bwd_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)


@_differentiable_once_more
def _silu_and_mul_bwd_backward(ctx, gdx):
    dy, x = ctx.saved_tensors

    def fn(dy, x):
        (dx,) = _vjp(_silu_mul_of, (x,), dy)
        return (dx,)

    g_dy, g_x = _composite_vjp(fn, (dy, x), _needs(ctx, 2), (gdx,))
    return g_dy, g_x


register_autograd("optimized::silu_and_mul_bwd", _silu_and_mul_bwd_backward, setup_context=_silu_and_mul_bwd_setup,
                  jvp=_silu_and_mul_bwd_jvp, batching=True)
