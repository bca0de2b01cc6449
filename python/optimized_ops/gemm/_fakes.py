"""The fake kernel of ``optimized::matmul`` (``torch.library.register_fake``): the output's shape and
dtype, as the C++ kernel allocates it (fresh, contiguous), without running anything, for
``torch.compile(fullgraph=True)`` (dynamic shapes too), ``torch.export`` and meta tensors.

It computes torch.matmul's output shape only. Checking the arguments (dtypes, devices, K, the
variant) is the library's (its torch glue and its C++ API, src/torch/common.h says which): under
``torch.compile`` it happens when the compiled graph runs the real kernel. The fake checks what the
shape is computed from, where a wrong argument leaves no shape to give -- no C++ runs while a graph
is traced, so such an argument must raise here -- with the words of the C++ glue: an operand of at
least one dimension (a 0-D operand has no M, K or N), batch dimensions that broadcast (the result's
batch shape), and one device for both operands (the result's: ``optimized_ops._fakes.one_device``).

The fake of ``optimized::scaled_mm`` (below) likewise: the ``(M, N)`` output of ``out_dtype``, from
2-D operands with one K, on one device.
"""

from __future__ import annotations

import torch

from .._fakes import one_device
from .._library import load

load()  # registers torch.ops.optimized.* before the registrations below


def _out_shape(a: torch.Tensor, b: torch.Tensor) -> list:
    """torch.matmul's output shape. Works on symbolic sizes (torch.compile(dynamic=True)): every
    comparison goes through ``torch._check_value`` or a plain ``==`` that becomes a guard."""
    for t, name, shapes in ((a, "a", "(K,) or (..., M, K)"), (b, "b", "(K,) or (..., K, N)")):
        torch._check_value(t.dim() >= 1, lambda: (
            f"optimized::matmul: {name}: expected a tensor of at least 1 dimension, {shapes}; given 0-D (a scalar)"))
    # Batch dimensions: everything before the last two, broadcast from the right.
    batch_a, batch_b = list(a.shape[:-2]), list(b.shape[:-2])
    rank = max(len(batch_a), len(batch_b))
    padded_a = [1] * (rank - len(batch_a)) + batch_a
    padded_b = [1] * (rank - len(batch_b)) + batch_b
    batch = []
    for sa, sb in zip(padded_a, padded_b):
        torch._check_value(sa == sb or sa == 1 or sb == 1, lambda: (
            f"optimized::matmul: b: expected batch dimensions broadcastable with a's {batch_a} (each equal, "
            f"or 1 in either); given {batch_b} (b of shape {list(b.shape)}, a of shape {list(a.shape)})"))
        batch.append(sb if sa == 1 else sa)  # a size of 1 stretches (also to 0)
    return batch + ([a.shape[-2]] if a.dim() > 1 else []) + ([b.shape[-1]] if b.dim() > 1 else [])


@torch.library.register_fake("optimized::matmul")
def _matmul_fake(a, b, *, variant="auto"):
    one_device("matmul", a=a, b=b)
    return a.new_empty(_out_shape(a, b))


_SCALED_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@torch.library.register_fake("optimized::scaled_mm")
def _scaled_mm_fake(a, b, scale_a, scale_b, *, bias=None, out_dtype=None, scale_a_layout="auto",
                    scale_b_layout="auto", variant="auto"):
    """The (M, N) output of ``out_dtype`` (bfloat16 by default) on a's device. What the shape and
    dtype are computed from is checked here, in the words of the C++ glue (src/torch/scaled_ops.cpp):
    2-D operands, K, out_dtype, one device. The scale layouts, the fp8 dtypes, the bias and the
    variant are checked when the compiled graph runs the kernel."""
    one_device("scaled_mm", a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    for t, name, shape in ((a, "a", "(M, K)"), (b, "b", "(K, N)")):
        torch._check_value(t.dim() == 2, lambda: (
            f"optimized::scaled_mm: {name}: expected a 2-D tensor {shape}; given shape {list(t.shape)}"))
    torch._check_value(b.shape[0] == a.shape[1], lambda: (
        f"optimized::scaled_mm: b: expected {a.shape[1]} rows to match a's columns (K); given shape "
        f"{list(b.shape)} with a of shape {list(a.shape)}"))
    dtype = torch.bfloat16 if out_dtype is None else out_dtype
    if dtype not in _SCALED_OUT_DTYPES:
        raise NotImplementedError(f"optimized::scaled_mm: out_dtype: expected float32, float16 or bfloat16; "
                                  f"given {str(dtype).removeprefix('torch.')}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)
