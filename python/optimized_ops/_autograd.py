"""Autograd for the C++ ops, reverse mode and forward mode, eager and under torch.func.

Why not ``torch.library.register_autograd``: the autograd.Function it generates has no ``jvp``, and
its kernel takes the no-grad path whenever no input requires grad, so dual tensors
(``torch.autograd.forward_ad``, ``torch.func.jvp``) lose their tangents there: a silent zero. Its
Function is also in the old style (``forward(ctx, ...)``), which the torch.func transforms refuse.

:func:`register_autograd` registers the same kind of kernel, for the Autograd dispatch key
(``Library.impl(..., "Autograd", with_keyset=True)``), around a Function that has
``forward``, ``setup_context``, ``backward`` and ``jvp``:

* the kernel applies the Function when grad mode is on and an input requires grad (as torch's does)
  *or* when an input carries a forward-mode tangent; otherwise it redispatches below autograd;
* ``forward`` runs the op below autograd, ``op.redispatch(keyset & after_autograd_keyset)``, as
  torch's does;
* ``setup_context`` calls the op's with torch's signature (``inputs`` with the trailing defaults
  the dispatcher dropped filled in) and keeps the primals for the jvp, when there is one;
* ``backward`` calls the op's (``ctx.needs_input_grad`` of the op's own arguments);
* ``jvp`` calls the op's forward-mode rule ``jvp(inputs, keyword_only_inputs, output, tangents)``:
  a pure function of the primals and the input tangents (``None`` where an input has none) that
  returns the output tangents (``None``: none).

torch.func: the Function is applied as a ``_SingleLevelFunction`` (autograd.Function.apply would
hand it to torch.func's ``custom_function_call``, which cannot run from inside a kernel). The kernel
then does what an ATen op's autograd kernel does under torch.func: it records the graph and the
tangents of the transform level it is called at, on that level's tensors, and redispatches below
autograd, where torch.func unwraps them and calls the op again at the next level; the kernel runs
once per grad / jvp level. For that, ``forward`` and ``jvp`` run in the grad modes of the call
(autograd.Function turns both off around them, which would hide them from the levels below), the
jvp on the primals without their tangents. vmap levels reach the op's batching rule instead:
:func:`register_vmap_loop` (torch's fallback cannot stack optional outputs; jacrev and hessian vmap
over the backward ops).

Wiring an op takes its backward, its setup_context and a jvp rule
``jvp(inputs, keyword_only_inputs, output, tangents) -> output tangents``: see ``_jvp`` and the
``register_autograd`` call at the end of gemm/_autograd.py (matmul), and the rules in fused/_autograd.py.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable
from typing import Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch import _C
from torch._functorch.utils import enable_single_level_autograd_function

__all__ = ["register_autograd", "register_vmap_loop", "has_tangent", "compute_dtype", "kernel_scalar"]

_keep_alive: list = []  # the Library fragments holding the registrations


def _library(namespace: str) -> torch.library.Library:
    lib = torch.library.Library(namespace, "FRAGMENT")
    _keep_alive.append(lib)
    return lib


def _lookup(qualname: str) -> torch._ops.OpOverload:
    namespace, name = qualname.split("::")
    name, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


# ---- small helpers for the rules --------------------------------------------------------------------

def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """float64 when any operand is float64, else float32: the precision the rules compute in."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def bump_version(*tensors: Optional[torch.Tensor]) -> None:
    """Marks tensors a library op wrote in place as modified. The C++ ops' ``Tensor(a!)`` schemas do not
    bump autograd's version counters (no ADInplaceOrView kernel), so without this an op that saved one of
    them for its backward would silently use the overwritten values; with it, autograd raises. Under
    torch.compile the graph's functionalization tracks the mutation instead."""
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version([t for t in tensors if t is not None])


def kernel_scalar(v: float, dtype: torch.dtype) -> float:
    """eps or scale as the kernels use it for math in `dtype`: as given (a double) in float64, rounded
    to float32 otherwise (the float32 math and the CUDA kernels)."""
    return v if dtype == torch.float64 else struct.unpack("f", struct.pack("f", v))[0]


# ---- a loop over the batch, for vmap ----------------------------------------------------------------

def _loop_over_batch(op, batch_size: int, in_dims, args, kwargs):
    """(output, out_dims): op applied to each slice of the batched arguments, outputs stacked along 0
    (``None`` outputs stay ``None``)."""
    def batched(a, d):
        return isinstance(a, torch.Tensor) and isinstance(d, int)

    if batch_size == 0:  # no slice to run: one on zeros gives the shapes of the empty stacks
        one = op(*(a.new_zeros(a.shape[:d] + a.shape[d + 1:]) if batched(a, d) else a
                   for a, d in zip(args, in_dims)), **kwargs)
        outs = [one]
        stack = lambda ts: ts[0].new_empty((0, *ts[0].shape))  # noqa: E731
    else:
        outs = [op(*(a.select(d, i) if batched(a, d) else a for a, d in zip(args, in_dims)), **kwargs)
                for i in range(batch_size)]
        stack = torch.stack
    if not isinstance(outs[0], tuple):
        return stack(outs), 0
    result = tuple(None if outs[0][k] is None else stack([o[k] for o in outs]) for k in range(len(outs[0])))
    return result, tuple(None if r is None else 0 for r in result)


def register_vmap_loop(qualname: str) -> None:
    """Registers a batching rule (torch.vmap; jacrev, jacfwd and hessian vmap) that calls the op once
    per slice of the batch and stacks the outputs; ``None`` outputs stay ``None``."""
    op = _lookup(qualname)

    def rule(info, in_dims, *args, **kwargs):
        return _loop_over_batch(op, info.batch_size, in_dims, args, kwargs)

    torch.library.register_vmap(qualname, rule, lib=_library(qualname.split("::")[0]))


# ---- the autograd kernel ------------------------------------------------------------------------------

class _Meta:
    """The Function's last argument (not a tensor): how the op was called."""
    __slots__ = ("keyset", "kwargs", "tangents", "functorch", "grad_mode", "fwd_grad_mode")

    def __init__(self, keyset, kwargs: dict, tangents: bool):
        self.keyset, self.kwargs, self.tangents = keyset, kwargs, tangents
        self.functorch = _C._are_functorch_transforms_active()
        self.grad_mode, self.fwd_grad_mode = _C.is_grad_enabled(), _C._is_fwd_grad_enabled()

    def modes(self):
        """The grad modes the op was called with (autograd.Function turns both off around forward
        and jvp)."""
        return _Modes(self.grad_mode, self.fwd_grad_mode)


class _Modes:
    def __init__(self, grad: bool, fwd_grad: bool):
        self.grad, self.fwd_grad = grad, fwd_grad

    def __enter__(self):
        self.saved = _C.is_grad_enabled(), _C._is_fwd_grad_enabled()
        _C._set_grad_enabled(self.grad)
        _C._set_fwd_grad_enabled(self.fwd_grad)

    def __exit__(self, *exc):
        _C._set_grad_enabled(self.saved[0])
        _C._set_fwd_grad_enabled(self.saved[1])


def has_tangent(args) -> bool:
    """Whether a tensor argument is a dual tensor of the forward-AD level (level 0: torch.func.jvp
    uses it too, on the wrappers of its own transform level)."""
    if fwAD._current_level < 0:
        return False
    for a in args:
        if isinstance(a, torch.Tensor):
            try:
                if torch._VF._unpack_dual(a, 0).tangent is not None:
                    return True
            except RuntimeError:  # a tensor of a vmap level (no batching rule): it may carry one
                return True
    return False


def _primal(a):
    return torch._VF._unpack_dual(a, 0).primal if isinstance(a, torch.Tensor) else a


def _like(tangent: Optional[torch.Tensor], output: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tangent as a tensor of its own laid out as its output (forward AD requires the layout of
    outputs that are views, such as softmax's over a dimension other than the last; a tangent that is
    a view of something else confuses nested forward mode)."""
    if tangent is None or output is None or (tangent.stride() == output.stride() and not tangent._is_view()):
        return tangent
    return tangent.new_empty_strided(output.shape, output.stride()).copy_(tangent)  # (vmap: from the tangent)


def _defaults_filler(schema) -> Callable:
    """``fill(args, kwargs) -> (args, kwargs)`` with every argument of ``schema``: the positional ones the
    dispatcher dropped (trailing, equal to their defaults) and the kwarg-only ones absent from ``kwargs`` put
    back with their defaults (what ``torch._library.utils.fill_defaults`` does, with the schema read once here
    instead of on every call: that read was the largest Python cost of a call through autograd, ~18 us)."""
    positional = tuple(a.default_value for a in schema.arguments if not a.kwarg_only)
    keywords = tuple((a.name, a.default_value) for a in schema.arguments if a.kwarg_only)

    def fill(args, kwargs):
        args = tuple(args)
        if len(args) < len(positional):
            args = args + positional[len(args):]
        return args, {name: kwargs[name] if name in kwargs else default for name, default in keywords}
    return fill


def register_autograd(qualname: str, backward: Callable, *, setup_context: Callable, jvp: Callable,
                      batching: bool = False) -> None:
    """Registers reverse- and forward-mode autograd for a C++ op (an Autograd-key kernel).

    Parameters
    ----------
    qualname : str
        ``"namespace::op"``; the op must have no kwarg-only tensors and no tensor-list arguments.
    backward : callable
        ``backward(ctx, *grads) -> grads of the inputs``, as for ``torch.library.register_autograd``.
    setup_context : callable
        ``setup_context(ctx, inputs, keyword_only_inputs, output)`` (``(ctx, inputs, output)`` for an
        op without kwarg-only arguments), as for ``torch.library.register_autograd``; ``inputs`` has
        every positional argument (defaults filled in).
    jvp : callable
        ``jvp(inputs, keyword_only_inputs, output, tangents) -> output tangents``: ``inputs`` and
        ``output`` as for ``setup_context``; ``tangents`` has one entry per input (``None`` for
        non-tensors and for tensors without a tangent). Returns a tensor (one output) or a tuple with
        one entry per output, each of the output's shape and dtype, or ``None`` (no tangent: an absent
        output, one marked non-differentiable, or a zero tangent).
    batching : bool
        Also register :func:`register_vmap_loop` (for ops whose outputs torch's vmap fallback cannot
        stack: optional tensors).
    """
    op = _lookup(qualname)
    schema = op._schema
    kwarg_only = any(a.kwarg_only for a in schema.arguments)
    fill_defaults = _defaults_filler(schema)

    def forward(*args):
        meta = args[-1]
        # Under torch.func the redispatch reaches the op again at the next level, which must see the
        # grad modes of the call, not the ones autograd.Function sets for forward (off): else the
        # levels below would record no graph and no tangent (jvp(grad(f)), hessian).
        with meta.modes() if meta.functorch else contextlib.nullcontext(), _C._AutoDispatchBelowAutograd():
            return op.redispatch(meta.keyset & _C._after_autograd_keyset, *args[:-1], **meta.kwargs)

    def setup(ctx, inputs, output):
        meta = inputs[-1]
        # The dispatcher drops trailing arguments equal to their defaults: put them back.
        args, kwargs = fill_defaults(inputs[:-1], meta.kwargs)
        if kwarg_only:
            setup_context(ctx=ctx, inputs=args, keyword_only_inputs=kwargs, output=output)
        else:
            setup_context(ctx=ctx, inputs=args, output=output)
        if meta.tangents:  # the jvp follows, once, during apply (it drops them): kept for it only
            fixed = {id(o) for o in getattr(ctx, "non_differentiable", None) or ()}  # mark_non_differentiable
            ctx._jvp_primals = (args, kwargs, output, meta, fixed)

    def backward_(ctx, *grads):
        needs = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = needs[:-1]
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (*result, None) if isinstance(result, tuple) else (result, None)

    def jvp_(ctx, *tangents):
        primals = getattr(ctx, "_jvp_primals", None)
        if primals is None:
            raise RuntimeError(f"{qualname}: forward-mode AD reached the jvp without the primals "
                               "(please report this as a bug of optimized_ops)")
        ctx._jvp_primals = None
        args, kwargs, output, meta, fixed = primals
        tangents = tuple(tangents[:-1]) + (None,) * (len(args) - (len(tangents) - 1))
        # The rule runs on the primals without their tangents (views), in the grad modes of the call:
        # torch turns forward AD off around a jvp so that the rule is not differentiated at its own
        # level, which the views ensure; off, it would also hide the rule from the torch.func levels
        # below (jacfwd(jacfwd(f))), and grad mode off from reverse mode over forward mode.
        args = tuple(_primal(a) for a in args)
        outputs = output if isinstance(output, tuple) else (output,)
        primal_outputs = tuple(_primal(o) for o in outputs)
        with meta.modes():
            result = jvp(args, kwargs, primal_outputs if isinstance(output, tuple) else primal_outputs[0], tangents)
            result = result if isinstance(output, tuple) else (result,)
            # A None tangent of a differentiable output beside others that have one trips torch (an
            # internal assert): zeros there. Outputs marked non-differentiable keep None.
            result = tuple(_like(t, p) if t is not None or o is None or id(o) in fixed or not o.is_floating_point()
                           else torch.zeros_like(p) for t, o, p in zip(result, outputs, primal_outputs))
        return result if isinstance(output, tuple) else result[0]

    # A _SingleLevelFunction, applied by the C++ autograd directly (see the module's notes on torch.func).
    function = type(f"{qualname.replace('::', '_')}_Function", (torch.autograd.function._SingleLevelFunction,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup),
        "backward": staticmethod(backward_), "jvp": staticmethod(jvp_)})

    def autograd_kernel(keyset, *args, **kwargs):
        tangents = has_tangent(args)
        if tangents or (_C.is_grad_enabled() and _C._any_requires_grad(*args)):
            meta = _Meta(keyset, kwargs, tangents)
            if meta.functorch:
                with enable_single_level_autograd_function():
                    return function.apply(*args, meta)
            return function.apply(*args, meta)
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _C._after_autograd_keyset, *args, **kwargs)

    namespace, opname = qualname.split("::")
    _library(namespace).impl(opname, autograd_kernel, "Autograd", with_keyset=True)
    if batching:
        register_vmap_loop(qualname)
