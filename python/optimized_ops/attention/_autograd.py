"""Autograd of the attention ops, registered through ``optimized_ops._autograd.register_autograd`` (the
mechanism shared with GEMM and the fused ops):

* ``attention_fwd`` / ``attention_varlen_fwd``: the backward is ``attention_bwd`` /
  ``attention_varlen_bwd`` on the same variant, from the saved q, k, v, out and lse, with the
  forward's score options and ``deterministic``. Gradients go to q, k and v; lse is an output
  without gradient (non-differentiable, as in flash-attn); the explicit mask and the ALiBi slopes
  get none (the Python functions refuse a mask that requires grad).
* ``attention_bwd`` / ``attention_varlen_bwd``: no double backward; differentiating through them
  raises NotImplementedError instead of giving a silent zero.
* forward mode (``torch.autograd.forward_ad``, ``torch.func.jvp``): not implemented; the jvp raises
  NotImplementedError with the reason.
"""

from __future__ import annotations

import torch

from .._autograd import register_autograd
from .._library import load

load()  # registers torch.ops.optimized.* before the registrations below
_ops = torch.ops.optimized

# The score options of the forward ops, handed to the backward as they were given.
_OPTIONS = ("softmax_scale", "causal", "top_left", "window_left", "window_right", "softcap", "deterministic",
            "variant")


def _no_jvp(op: str):
    def jvp(inputs, keyword_only_inputs, output, tangents):
        raise NotImplementedError(
            f"optimized::{op}: forward-mode AD (torch.autograd.forward_ad, torch.func.jvp / jacfwd) is not "
            "implemented for attention; use reverse mode (torch.autograd.grad, .backward(), torch.func.grad / "
            "jacrev)")
    return jvp


def _needs(ctx, n: int) -> tuple:
    """ctx.needs_input_grad padded to the op's n positional arguments."""
    needs = tuple(ctx.needs_input_grad)
    return needs + (False,) * (n - len(needs))


# ---- fixed length ---------------------------------------------------------------------------------

def _no_grad_for(keyword_only_inputs, op, names):
    """alibi_slopes and attn_mask are keyword-only: the autograd mechanism gives them no gradient, so
    one that requires grad is refused rather than silently left without one."""
    for name in names:
        t = keyword_only_inputs.get(name)
        if t is not None and t.requires_grad:
            raise NotImplementedError(f"optimized::{op}: {name}: gradients of {name} are not implemented; given a "
                                      f"tensor that requires grad (detach it)")


def _fwd_setup(ctx, inputs, keyword_only_inputs, output):
    _no_grad_for(keyword_only_inputs, "attention_fwd", ("alibi_slopes", "attn_mask"))
    q, k, v = inputs
    out, lse = output
    ctx.options = {name: keyword_only_inputs[name] for name in _OPTIONS}
    ctx.save_for_backward(q, k, v, out, lse, keyword_only_inputs["alibi_slopes"], keyword_only_inputs["attn_mask"])
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, _dlse):
    if dout is None:  # out unused (only lse was): no gradient
        return None, None, None
    q, k, v, out, lse, alibi, mask = ctx.saved_tensors
    dq, dk, dv = _ops.attention_bwd.default(dout, q, k, v, out, lse, alibi_slopes=alibi, attn_mask=mask,
                                            **ctx.options)
    nq, nk, nv = _needs(ctx, 3)
    return dq if nq else None, dk if nk else None, dv if nv else None


register_autograd("optimized::attention_fwd", _fwd_backward, setup_context=_fwd_setup, jvp=_no_jvp("attention_fwd"))


# ---- variable length ------------------------------------------------------------------------------

def _varlen_setup(ctx, inputs, keyword_only_inputs, output):
    _no_grad_for(keyword_only_inputs, "attention_varlen_fwd", ("alibi_slopes",))
    q, k, v, cu_q, cu_k, ctx.max_seqlen_q, ctx.max_seqlen_k = inputs
    out, lse = output
    ctx.options = {name: keyword_only_inputs[name] for name in _OPTIONS}
    ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, keyword_only_inputs["alibi_slopes"])
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 7
    q, k, v, cu_q, cu_k, out, lse, alibi = ctx.saved_tensors
    dq, dk, dv = _ops.attention_varlen_bwd.default(dout, q, k, v, cu_q, cu_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                                                   out, lse, alibi_slopes=alibi, **ctx.options)
    nq, nk, nv = _needs(ctx, 3)[:3]
    return dq if nq else None, dk if nk else None, dv if nv else None, None, None, None, None


register_autograd("optimized::attention_varlen_fwd", _varlen_backward, setup_context=_varlen_setup,
                  jvp=_no_jvp("attention_varlen_fwd"))


# ---- the backward ops: no double backward ---------------------------------------------------------

def _no_double_backward(op: str):
    def setup(ctx, inputs, keyword_only_inputs, output):
        pass

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"optimized::{op}: double backward (gradients of attention's gradients: create_graph=True, "
            "gradgradcheck, torch.func.hessian) is not implemented")

    return setup, backward


for _op in ("attention_bwd", "attention_varlen_bwd"):
    _setup, _backward = _no_double_backward(_op)
    register_autograd(f"optimized::{_op}", _backward, setup_context=_setup, jvp=_no_jvp(_op))
