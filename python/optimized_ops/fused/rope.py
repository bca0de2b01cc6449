"""Rotary position embedding (RoPE) from PyTorch: :func:`rope`, over ``torch.ops.optimized.rope_fwd``
/ ``rope_bwd`` / ``rope_fwd_`` of the C++ library (``src/torch/rope_ops.cpp``), with their fake
kernels (``torch.compile(fullgraph=True)``, ``torch.export``, meta tensors) and autograd.

The rotation is linear and orthogonal in q and k: its gradient is the transpose (the rotation by
``-angle``, ``rope_bwd``: the same kernel with the sines negated), the transpose's gradient the
rotation again, and its forward-mode derivative the rotation of the tangents. So both ops are
differentiable to any order, forward and reverse mode. ``cos_sin`` is a constant (no gradient).
The in-place form (``inplace=True``) is for inference: it refuses inputs that require grad.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._autograd import bump_version, register_autograd
from .._fakes import one_device
from .._library import load
from .._variants import register_family

load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized

__all__ = ["rope", "rope_variants"]


def rope_variants() -> list[str]:
    """Names of the RoPE variants (``"auto"`` excluded): ``["cpu", "cuda"]``, from the C++ table; the
    same list as ``optimized_ops.variants("rope")``."""
    return list(_ops.rope_variants())


register_family("rope", rope_variants)


def rope(q: torch.Tensor, k: Optional[torch.Tensor], positions: torch.Tensor, *, theta: float = 10000.0,
         layout: str = "neox", rotary_dim: Optional[int] = None, inplace: bool = False,
         cos_sin: Optional[torch.Tensor] = None, variant: str = "auto"):
    """Rotary position embedding of q and k (``(q_out, k_out)``), forward and backward.

    For pair ``i`` (``i < rotary_dim / 2``) of a row at position ``p``: ``angle = p * theta^(-2i /
    rotary_dim)``, ``(x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin)``; the dims past ``rotary_dim``
    pass through. The same result as HF's ``apply_rotary_pos_emb`` (neox) with ``cos``/``sin`` built
    from ``positions``, and as vLLM's ``rotary_embedding(positions, query, key, head_size,
    cos_sin_cache, is_neox)`` with (B, S, H, D) tensors.

    Parameters
    ----------
    q : Tensor
        ``(B, S, H_q, D)``, or ``(T, H_q, D)`` (packed tokens, positions ``(T,)``); float32, float16,
        bfloat16 (math in float32) or float64 (CPU). Any strides with unit stride along ``D`` (slices
        of a fused qkv tensor rotate without a copy; out of place, other views are copied first).
    k : Tensor or None
        ``(B, S, H_k, D)`` (``H_k`` may differ from ``H_q``: GQA / MQA), or ``(T, H_k, D)``; None: q only.
    positions : Tensor
        ``(B, S)`` or ``(S,)`` (shared by the sequences), int32 or int64; any values (packed / varlen
        sequences, decode steps; negative ones rotate backwards).
    theta : float
        The base of the frequencies.
    layout : str
        ``"neox"``: pairs ``(x[i], x[i + rotary_dim / 2])`` (GPT-NeoX, HF Llama's ``rotate_half``);
        ``"interleaved"``: pairs ``(x[2i], x[2i + 1])`` (GPT-J, Meta's Llama).
    rotary_dim : int, optional
        The rotated dims (even, ``2 <= rotary_dim <= D``); None: ``D``. Partial rotary (GPT-NeoX,
        Phi): the rest passes through.
    inplace : bool
        Write into q and k and return them (inference: refused when grad is needed).
    cos_sin : Tensor, optional
        A cache ``(max_pos, rotary_dim)`` = ``[cos | sin]`` of each position's angles (vLLM's
        ``cos_sin_cache``), float32 (float64 for float64 q), used instead of computing them; a position
        outside ``[0, max_pos)`` gives NaN in its rotated dims. A constant: no gradient flows to it.
    variant : str
        ``"auto"`` (the device's), ``"cpu"`` or ``"cuda"``.

    Returns
    -------
    (Tensor, Tensor or None)
        ``(q_out, k_out)``: fresh contiguous tensors, or q and k themselves with ``inplace=True``.

    Precision: the angle is formed and reduced modulo 2 pi in float64, then cos / sin in float32
    (float64 for float64), so that large positions (1e5 and beyond) keep float32 accuracy; HF's and
    vLLM's float32 ``positions * inv_freq`` carries errors up to ~6e-8 * angle (6e-3 rad at 1e5).
    Outputs are within a few float32 ulps of a float64 reference (after rounding to the dtype).

    Raises
    ------
    ValueError
        Shapes, dtypes, devices, layout, rotary_dim, theta or aliasing not as above (the message names
        the argument); ``RuntimeError`` for ``inplace=True`` on tensors that require grad.
    """
    rd = 0 if rotary_dim is None else int(rotary_dim)
    if inplace:
        if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
            raise RuntimeError("optimized_ops.rope: inplace=True rotates q and k in place, which autograd "
                               "cannot differentiate; given inputs that require grad (use inplace=False, "
                               "or run under torch.no_grad())")
        _ops.rope_fwd_(q, k, positions, theta, layout, rd, cos_sin, variant=variant)
        bump_version(q, k)
        return q, k
    return _ops.rope_fwd(q, k, positions, theta, layout, rd, cos_sin, variant=variant)


# ---- fake kernels ----------------------------------------------------------------------------------

def _fake(op: str):
    def fake(q, k, positions, theta=10000.0, layout="neox", rotary_dim=0, cos_sin=None, *, variant="auto"):
        one_device(op, q=q, k=k, positions=positions, cos_sin=cos_sin)
        return q.new_empty(q.shape), (k.new_empty(k.shape) if k is not None else None)
    return fake


torch.library.register_fake("optimized::rope_fwd")(_fake("rope_fwd"))
torch.library.register_fake("optimized::rope_bwd")(_fake("rope_bwd"))


@torch.library.register_fake("optimized::rope_fwd_")
def _rope_fwd_inplace_fake(q, k, positions, theta=10000.0, layout="neox", rotary_dim=0, cos_sin=None, *,
                           variant="auto"):
    one_device("rope_fwd_", q=q, k=k, positions=positions, cos_sin=cos_sin)


# ---- autograd: rope_fwd and rope_bwd are each other's transpose --------------------------------------

def _rope_autograd(name: str, transpose: str):
    op = getattr(_ops, name).default
    op_t = getattr(_ops, transpose).default

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        _, k, positions, theta, layout, rotary_dim, cos_sin = inputs
        ctx.args = (theta, layout, rotary_dim)
        ctx.has_k = k is not None
        ctx.variant = keyword_only_inputs.get("variant", "auto")
        ctx.save_for_backward(positions, cos_sin)

    def backward(ctx, gq, gk):
        positions, cos_sin = ctx.saved_tensors
        if not ctx.has_k:
            gk = None
        dq, dk = op_t(gq, gk, positions, *ctx.args, cos_sin, variant=ctx.variant)
        return dq, dk, None, None, None, None, None

    def jvp(inputs, keyword_only_inputs, output, tangents):
        q, k, positions, theta, layout, rotary_dim, cos_sin = inputs
        tq, tk = tangents[0], tangents[1]
        if tq is None and tk is None:
            return None, None
        tq = torch.zeros_like(q) if tq is None else tq
        if k is not None and tk is None:
            tk = torch.zeros_like(k)
        return op(tq, tk, positions, theta, layout, rotary_dim, cos_sin,
                  variant=keyword_only_inputs.get("variant", "auto"))

    register_autograd(f"optimized::{name}", backward, setup_context=setup_context, jvp=jvp, batching=True)


_rope_autograd("rope_fwd", "rope_bwd")
_rope_autograd("rope_bwd", "rope_fwd")
