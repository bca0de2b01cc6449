"""The Triton rungs as torch ops: ``torch.ops.optimized.triton_*`` (custom ops: opaque to
``torch.compile``, traced through their fake kernels), the argument checks of the C++ ops (same
words: the message names the op, the argument, what was expected and what was given), and autograd
Functions whose backward runs the Triton backward kernels.

The ops take rows: ``(rows, n)`` with a unit column stride (any row stride); the functions here
(``softmax``, ``layer_norm``, ``rms_norm``, called by ``optimized_ops.<op>(..., variant="triton")``)
check the arguments, flatten to rows and back, and attach autograd. Importing this module does not
import ``triton``: the kernels are imported on the first call.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import require
from .._library import load

load()  # the C++ library defines the optimized namespace first; the ops here are fragments of it

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _msg(op: str, arg: str, text: str) -> str:
    return f"optimized::{op}: {arg}: {text}"


def check_dtype(op: str, arg: str, t: torch.Tensor) -> None:
    if t.dtype == torch.float64:
        raise NotImplementedError(_msg(op, arg, "expected dtype fp32, fp16, bf16 on the triton variant "
                                                "(fp64 runs on the cpu variant only); given fp64"))
    if t.dtype not in _DTYPES:
        raise NotImplementedError(_msg(op, arg, "expected dtype fp32, fp16, bf16 (or fp64 on the cpu variant); "
                                                f"given {dtype_name(t.dtype)}"))


def _check_param(op: str, arg: str, t: Optional[torch.Tensor], x: torch.Tensor, ns: list) -> None:
    if t is None:
        return
    if list(t.shape) != ns:
        raise ValueError(_msg(op, arg, f"expected shape {ns} (normalized_shape); given {list(t.shape)}"))
    if t.device != x.device:
        raise ValueError(_msg(op, arg, f"expected device {x.device} (same as the first operand); given {t.device}"))
    if t.dtype != x.dtype:
        raise ValueError(_msg(op, arg, f"expected dtype {dtype_name(x.dtype)}; given {dtype_name(t.dtype)}"))


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as (rows, n) with a unit column stride: a view where the leading dimensions collapse."""
    x2 = x.reshape(-1, n) if n else x.reshape(math.prod(x.shape[:-1]) if x.dim() else 1, 0)
    if n > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


# ---- the torch ops ----------------------------------------------------------------------------------

@torch.library.custom_op("optimized::triton_softmax_fwd", mutates_args=())
def triton_softmax_fwd(x: torch.Tensor, scale: float) -> torch.Tensor:
    require("triton_softmax_fwd", x)
    from .softmax import softmax_fwd
    return softmax_fwd(x, scale)


@triton_softmax_fwd.register_fake
def _(x, scale):
    return x.new_empty(x.shape)


@torch.library.custom_op("optimized::triton_softmax_bwd", mutates_args=())
def triton_softmax_bwd(y: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    require("triton_softmax_bwd", y, dy)
    from .softmax import softmax_bwd
    return softmax_bwd(y, dy, scale)


@triton_softmax_bwd.register_fake
def _(y, dy, scale):
    return y.new_empty(y.shape)


@torch.library.custom_op("optimized::triton_norm_fwd", mutates_args=())
def triton_norm_fwd(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                    rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require("triton_norm_fwd", x, weight, bias)
    from .norms import norm_fwd
    return norm_fwd(x, weight, bias, eps, rms)


@triton_norm_fwd.register_fake
def _(x, weight, bias, eps, rms):
    rows = x.shape[0]
    return (x.new_empty(x.shape), x.new_empty((0 if rms else rows,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


@torch.library.custom_op("optimized::triton_norm_bwd", mutates_args=())
def triton_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], mean: torch.Tensor,
                    rstd: torch.Tensor, rms: bool, compute_dweight: bool, compute_dbias: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require("triton_norm_bwd", dy, x, weight)
    from .norms import norm_bwd
    return norm_bwd(dy, x, weight, mean, rstd, rms, compute_dweight, compute_dbias,
                    weight.dtype if weight is not None else x.dtype)


@triton_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, rms, compute_dweight, compute_dbias):
    n = x.shape[1]
    dt = weight.dtype if weight is not None else x.dtype
    return (x.new_empty(x.shape), x.new_empty((n if compute_dweight else 0,), dtype=dt),
            x.new_empty((n if compute_dbias else 0,), dtype=dt))


# ---- autograd ---------------------------------------------------------------------------------------

class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, scale):
        y = torch.ops.optimized.triton_softmax_fwd(x2, scale)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dy = dy if dy.dim() < 2 or dy.stride(-1) == 1 else dy.contiguous()
        return torch.ops.optimized.triton_softmax_bwd(y, dy, ctx.scale), None


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, eps, rms):
        y, mean, rstd = torch.ops.optimized.triton_norm_fwd(x2, weight, bias, eps, rms)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.rms, ctx.has_bias = rms, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        need_dw = weight is not None and ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        if dy.stride(-1) != 1 and dy.shape[-1] > 1:
            dy = dy.contiguous()
        dx, dw, db = torch.ops.optimized.triton_norm_bwd(dy, x2, weight, mean, rstd, ctx.rms, need_dw, need_db)
        return (dx if ctx.needs_input_grad[0] else None, dw if need_dw else None, db if need_db else None,
                None, None)


# ---- the functions (variant="triton" of optimized_ops.softmax / layer_norm / rms_norm) ----------------

def softmax(input: torch.Tensor, dim: int, scale: float = 1.0) -> torch.Tensor:
    op = "softmax_fwd"
    check_dtype(op, "x", input)
    nd = max(input.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(_msg(op, "dim", f"expected a dimension in [{-nd}, {nd - 1}]; given {dim}"))
    require(op, input)
    if input.dim() == 0:
        return softmax(input.reshape(1), 0, scale).reshape(())
    d = dim % nd
    moved = input.movedim(d, -1)  # the softmax dimension last (a view)
    n = moved.shape[-1]
    y = _Softmax.apply(_rows(moved, n), float(scale))
    return y.reshape(moved.shape).movedim(-1, d)


def _norm(op: str, input, normalized_shape, weight, bias, eps, rms: bool) -> torch.Tensor:
    check_dtype(op, "x", input)
    ns = [int(s) for s in normalized_shape]
    if not ns:
        raise ValueError(_msg(op, "normalized_shape", "expected at least one dimension; given []"))
    if input.dim() < len(ns) or list(input.shape[input.dim() - len(ns):]) != ns:
        raise ValueError(_msg(op, "x", f"expected a shape ending in {ns} (normalized_shape); "
                                       f"given {list(input.shape)}"))
    _check_param(op, "weight", weight, input, ns)
    _check_param(op, "bias", bias, input, ns)
    if math.isnan(eps) or eps < 0:
        raise ValueError(_msg(op, "eps", f"expected >= 0; given {eps:g}"))
    require(op, input, weight, bias)
    n = math.prod(ns)
    w = weight.reshape(n).contiguous() if weight is not None else None
    b = bias.reshape(n).contiguous() if bias is not None else None
    y = _Norm.apply(_rows(input, n), w, b, float(eps), rms)
    return y.reshape(input.shape)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    return _norm("layer_norm_fwd", input, normalized_shape, weight, bias, eps, rms=False)


def rms_norm(input, normalized_shape, weight=None, eps: float = 1e-6) -> torch.Tensor:
    return _norm("rms_norm_fwd", input, normalized_shape, weight, None, eps, rms=True)


# ---- matmul (variant="triton" of optimized_ops.matmul) ------------------------------------------------

@torch.library.custom_op("optimized::triton_matmul", mutates_args=())
def triton_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, M, K) @ (B, K, N) -> (B, M, N), any strides, by the tiled Triton GEMM (matmul.py)."""
    require("triton_matmul", a, b)
    from .matmul import matmul_3d
    return matmul_3d(a, b)


@triton_matmul.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


@torch.library.custom_op("optimized::triton_matmul_tma", mutates_args=())
def triton_matmul_tma(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, M, K) @ (B, K, N) -> (B, M, N) by the persistent TMA GEMM (matmul_tma.py); rows of a and b
    16-byte aligned with unit stride."""
    require("triton_matmul_tma", a, b, tma=True)
    from .matmul_tma import matmul_tma_3d
    return matmul_tma_3d(a, b)


@triton_matmul_tma.register_fake
def _(a, b):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a3, b3, tma):
        ctx.save_for_backward(a3 if ctx.needs_input_grad[1] else None, b3 if ctx.needs_input_grad[0] else None)
        ctx.tma = tma
        if tma:
            return torch.ops.optimized.triton_matmul_tma(a3, b3)
        return torch.ops.optimized.triton_matmul(a3, b3)

    @staticmethod
    def backward(ctx, g):
        a3, b3 = ctx.saved_tensors

        def mm(x, y):
            # TMA reads rows: the transposes are copied (contiguous) for it, and a product whose rows
            # are not 16 bytes long (a^T's M) runs on the tiled kernel, which reads any strides in place.
            es = x.element_size()
            if ctx.tma and (x.shape[-1] * es) % 16 == 0 and (y.shape[-1] * es) % 16 == 0:
                return torch.ops.optimized.triton_matmul_tma(x.contiguous(), y.contiguous())
            return torch.ops.optimized.triton_matmul(x, y)

        ga = mm(g, b3.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        gb = mm(a3.transpose(1, 2), g) if ctx.needs_input_grad[1] else None
        return ga, gb, None


def _matmul_checks(a: torch.Tensor, b: torch.Tensor) -> None:
    op = "matmul"
    if a.dim() == 0:
        raise ValueError(_msg(op, "a", "expected a tensor of at least 1 dimension, (K,) or (..., M, K); given 0-D "
                                       "(a scalar)"))
    if b.dim() == 0:
        raise ValueError(_msg(op, "b", "expected a tensor of at least 1 dimension, (K,) or (..., K, N); given 0-D "
                                       "(a scalar)"))
    if a.dtype not in _DTYPES:
        raise NotImplementedError(_msg(op, "a", "expected dtype fp32, fp16, bf16 on the triton variant (fp64 runs on "
                                                f"cpu_naive and cpu_blocked); given {dtype_name(a.dtype)}"))
    if b.dtype != a.dtype:
        raise ValueError(_msg(op, "b", f"expected dtype {dtype_name(a.dtype)} (same as a); "
                                       f"given {dtype_name(b.dtype)}"))
    if b.device != a.device:
        raise ValueError(_msg(op, "b", f"expected device {a.device} (same as a); given {b.device}"))
    k = a.shape[-1]
    kb = b.shape[0] if b.dim() == 1 else b.shape[-2]
    if kb != k:
        what = f"length {k}" if b.dim() == 1 else f"{k} rows"
        theirs = "a's length" if a.dim() == 1 else "a's columns"
        raise ValueError(_msg(op, "b", f"expected {what} to match {theirs} (K); given shape {list(b.shape)} with a "
                                       f"of shape {list(a.shape)}"))
    ba, bb = list(a.shape[:-2]), list(b.shape[:-2])
    try:
        torch.broadcast_shapes(tuple(ba), tuple(bb))
    except RuntimeError:
        raise ValueError(_msg(op, "b", f"expected batch dimensions broadcastable with a's {ba} (each equal, or 1 in "
                                       f"either); given {bb} (b of shape {list(b.shape)}, a of shape "
                                       f"{list(a.shape)})")) from None


def _tma_checks(a3: torch.Tensor, b3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands as the TMA rung reads them: fp16 / bf16 (tensor cores), unit-stride rows, K and N
    rows 16-byte long (copies where only the layout is in the way)."""
    if a3.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(_msg("matmul", "variant", f"triton_tma supports fp16, bf16 (tensor cores); given "
                                                            f"{dtype_name(a3.dtype)}"))
    es = a3.element_size()
    for name, dim, t in (("a", "K", a3), ("b", "N", b3)):
        if (t.shape[-1] * es) % 16:
            raise ValueError(_msg("matmul", name, f"expected {dim} a multiple of {16 // es} for triton_tma (TMA reads "
                                                  f"rows of a multiple of 16 bytes); given {dim} = {t.shape[-1]}"))
    # unit-stride rows at 16-byte strides, else a copy (the base addresses: matmul_tma_3d, per batch index)
    out = [t if (t.shape[-1] <= 1 or t.stride(-1) == 1) and all((s * es) % 16 == 0 for s in t.stride()[1:-1])
           else t.contiguous() for t in (a3, b3)]
    return out[0], out[1]


def matmul(a: torch.Tensor, b: torch.Tensor, tma: bool = False) -> torch.Tensor:
    """torch.matmul's shape rules (1-D operands, broadcast batch dimensions) over the 3-D op; tma: the
    persistent TMA GEMM (variant="triton_tma") instead of the tiled one."""
    _matmul_checks(a, b)
    require("matmul", a, b, tma=tma)
    a_1d, b_1d = a.dim() == 1, b.dim() == 1
    a_m = a.unsqueeze(0) if a_1d else a
    b_m = b.unsqueeze(-1) if b_1d else b
    batch = tuple(torch.broadcast_shapes(tuple(a_m.shape[:-2]), tuple(b_m.shape[:-2])))
    (m, k), n = a_m.shape[-2:], b_m.shape[-1]
    nb = math.prod(batch)
    a3 = a_m.expand(*batch, m, k).reshape(nb, m, k)  # a view where the batch dimensions fold, else a copy
    b3 = b_m.expand(*batch, k, n).reshape(nb, k, n)
    if tma and a3.numel() and b3.numel():
        a3, b3 = _tma_checks(a3, b3)
    out = _Matmul.apply(a3, b3, tma).reshape(*batch, m, n)
    if a_1d:
        out = out.squeeze(-2)
    if b_1d:
        out = out.squeeze(-1)
    return out


# ---- attention (variant="triton" of optimized_ops.flash_attention) -------------------------------------

@torch.library.custom_op("optimized::triton_attention_fwd", mutates_args=())
def triton_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of FlashAttention in Triton (attention.py): q (B, S_q, H_q, D), k, v (B, S_k, H_kv, D)."""
    require("triton_attention_fwd", q, k, v)
    from .attention import attention_fwd
    return attention_fwd(q, k, v, scale, causal)


@triton_attention_fwd.register_fake
def _(q, k, v, scale, causal):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


@torch.library.custom_op("optimized::triton_attention_bwd", mutates_args=())
def triton_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, scale: float, causal: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    require("triton_attention_bwd", dout, q, k, v)
    from .attention import attention_bwd
    return attention_bwd(dout, q, k, v, out, lse, scale, causal)


@triton_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        out, lse = torch.ops.optimized.triton_attention_fwd(q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = torch.ops.optimized.triton_attention_bwd(dout, q, k, v, out, lse, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None


def _attention_checks(q, k, v, softmax_scale, window_size, softcap, alibi_slopes) -> None:
    op = "attention_fwd"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(_msg(op, name, f"expected 4 dimensions (B, S_q, H_q, D); given {t.dim()}"))
    if q.dtype not in _DTYPES:
        raise NotImplementedError(_msg(op, "q", "expected dtype fp16, bf16, fp32 (fp64 on the cpu variant); given "
                                                f"{dtype_name(q.dtype)}"))
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(_msg(op, name, f"expected dtype {dtype_name(q.dtype)} (q's); given {dtype_name(t.dtype)}"))
        if t.device != q.device:
            raise ValueError(_msg(op, name, f"expected device {q.device} (q's); given {t.device}"))
    b, s_q, h_q, d = q.shape
    if k.shape[0] != b:
        raise ValueError(_msg(op, "k", f"expected batch {b} (q's); given {list(k.shape)}"))
    if k.shape[3] != d:
        raise ValueError(_msg(op, "k", f"expected head_dim {d} (q's); given {list(k.shape)}"))
    if k.shape[2] < 1 or h_q % k.shape[2] != 0:
        raise ValueError(_msg(op, "k", f"expected a number of heads that divides q's {h_q} (GQA / MQA: H_q a multiple "
                                       f"of H_kv); given {k.shape[2]}"))
    if v.shape != k.shape:
        raise ValueError(_msg(op, "v", f"expected shape {list(k.shape)} (k's); given {list(v.shape)}"))
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(_msg(op, "softmax_scale", f"expected a finite value > 0; given {softmax_scale}"))
    unsupported = [name for name, on in (("window_size", tuple(window_size) != (-1, -1)), ("softcap", softcap != 0.0),
                                         ("alibi_slopes", alibi_slopes is not None)) if on]
    if unsupported:
        raise NotImplementedError(_msg(op, unsupported[0], "not implemented on the triton variant (it runs "
                                                           "causal or not, softmax_scale, GQA / MQA); use auto, "
                                                           "cpu, naive, flash or flash2"))


def flash_attention(q, k, v, causal: bool = False, softmax_scale=None, window_size=(-1, -1), softcap: float = 0.0,
                    alibi_slopes=None):
    """(out, lse) of optimized_ops.flash_attention(..., variant="triton")."""
    _attention_checks(q, k, v, softmax_scale, window_size, softcap, alibi_slopes)
    require("attention_fwd", q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    q, k, v = (t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous() for t in (q, k, v))
    return _Attention.apply(q, k, v, scale, bool(causal))
