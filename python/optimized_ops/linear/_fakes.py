"""Fake kernels of the linear ops (``torch.library.register_fake``): the outputs of
``torch.ops.optimized.linear_forward`` / ``linear_backward`` as the C++ kernels allocate them (fresh,
contiguous; ``None`` where an output is not asked for), without running anything, for
``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors.

They compute shapes and dtypes only. Checking the arguments (dtypes, K, the bias, the activation,
the variant) is the library's (its torch glue and its C++ API, src/torch/common.h says which): under
``torch.compile`` it happens when the compiled graph runs the real kernel. A fake checks only what its
output shapes are computed from, with the words of the C++ glue: ``x`` of at least one dimension,
``weight`` of two, and one device for every tensor (``optimized_ops._fakes.one_device``).
"""

from __future__ import annotations

import torch

from .._fakes import one_device
from .._library import load

load()  # registers torch.ops.optimized.* before the registrations below


def _out_shape(op: str, x: torch.Tensor, x_name: str, weight: torch.Tensor) -> list:
    torch._check_value(x.dim() >= 1, lambda: (
        f"optimized::{op}: {x_name}: expected a tensor of at least 1 dimension (..., in_features K); "
        "given 0-D (a scalar)"))
    torch._check_value(weight.dim() == 2, lambda: (
        f"optimized::{op}: weight: expected a 2-D tensor (out_features N, in_features K); given shape "
        f"{list(weight.shape)}"))
    return list(x.shape[:-1]) + [weight.shape[0]]


@torch.library.register_fake("optimized::linear_forward")
def _linear_forward_fake(x, weight, bias, *, activation="none", save_pre=False, variant="auto", fp8=False):
    one_device("linear_forward", x=x, weight=weight, bias=bias)
    shape = _out_shape("linear_forward", x, "x", weight)
    return x.new_empty(shape), (x.new_empty(shape) if save_pre else None)


@torch.library.register_fake("optimized::linear_backward")
def _linear_backward_fake(grad_output, input, weight, pre, bias, *, activation="none", output_mask=(True, True, True),
                          variant="auto", fp8=False):
    one_device("linear_backward", grad_output=grad_output, input=input, weight=weight, pre=pre, bias=bias)
    _out_shape("linear_backward", input, "input", weight)
    return (input.new_empty(input.shape) if output_mask[0] else None,
            input.new_empty(weight.shape) if output_mask[1] else None,
            input.new_empty((weight.shape[0],)) if output_mask[2] else None)
