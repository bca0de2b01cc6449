"""GEMM from PyTorch: ``optimized_ops.matmul`` over ``torch.ops.optimized.matmul``.

The op itself (schema, CPU and CUDA kernels) is registered by the C++ library (``src/torch/gemm_ops.cpp``).
The package adds what torch needs around it:

* ``gemm/__init__.py`` (here): the function and the ladder's queries;
* ``gemm/_fakes.py``: a fake kernel (``register_fake``): the output's shape and dtype without running
  anything, so that ``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors trace
  through the op;
* ``gemm/_autograd.py``: a backward formula and a forward-mode (jvp) rule
  (``optimized_ops._autograd.register_autograd``) that call the op again, so gradients and tangents
  run on the same kernels; double backward, ``torch.func.jvp``, ``jacfwd`` and ``hessian`` work.
"""

from __future__ import annotations

import torch

from .._library import load
from .._variants import register_family

_lib = load()  # registers torch.ops.optimized.* before the registrations below

# optimized_dtype values; float64 runs on the CPU rungs cpu_naive and cpu_blocked (and auto on CPU)
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 6}


def variants() -> list[str]:
    """Names of every GEMM variant, CPU then CUDA, naive to best (``"auto"`` excluded): the C++ table,
    through ``torch.ops.optimized.gemm_variants()``. ``optimized_ops.variants()`` and
    ``optimized_ops.variants("gemm")`` return the same list."""
    return list(torch.ops.optimized.gemm_variants())


register_family("gemm", variants)


def variant_supports(variant: str, dtype: torch.dtype, device: str | torch.device) -> tuple[bool, str]:
    """Whether GEMM ``variant`` runs ``dtype`` tensors on ``device``'s type, and why not.

    Parameters
    ----------
    variant : str
        ``"auto"`` or a name from :func:`variants`.
    dtype : torch.dtype
        ``torch.float32``, ``torch.float16``, ``torch.bfloat16`` or ``torch.float64`` (CPU rungs
        ``cpu_naive`` and ``cpu_blocked`` only).
    device : str or torch.device
        ``"cpu"`` or ``"cuda"`` (the index is ignored; presence is not checked).

    Returns
    -------
    (bool, str)
        ``(True, "")``, or ``(False, reason)`` with the library's message.
    """
    device_type = 1 if torch.device(device).type == "cuda" else 0
    if dtype not in _DTYPES:
        return False, f"dtype: expected float32, float16, bfloat16 or float64; given {dtype}"
    status = _lib.optimized_gemm_variant_check(variant.encode(), _DTYPES[dtype], device_type)
    return status == 0, "" if status == 0 else _lib.optimized_last_error().decode()


def built_with_cuda() -> bool:
    """True when the library was compiled with its CUDA backend."""
    return bool(_lib.optimized_built_with_cuda())


def matmul(a: torch.Tensor, b: torch.Tensor, *, variant: str = "auto") -> torch.Tensor:
    r"""Matrix product on the optimized-ops kernels: ``out = a @ b`` with the shape rules of
    :func:`torch.matmul`.

    .. math::  \mathrm{out}[\ldots, i, j] = \sum_k a[\ldots, i, k] \, b[\ldots, k, j]

    Products accumulate in float32 (float64 for float64 inputs); the result is rounded once to
    the dtype of the inputs.

    Parameters
    ----------
    a : torch.Tensor
        ``(K,)`` or ``(*batch_a, M, K)`` with any number of batch dimensions (none: ``(M, K)``);
        float32, float16 or bfloat16 on CPU or CUDA; float64 on the CPU (``cpu_naive``,
        ``cpu_blocked``, and ``auto``, which picks ``cpu_blocked``). A 1-D ``a`` is the row
        ``(1, K)``, and the result has no M dimension.
    b : torch.Tensor
        ``(K,)`` or ``(*batch_b, K, N)``; same dtype and device as ``a``. A 1-D ``b`` is the column
        ``(K, 1)``, and the result has no N dimension.
    variant : str, keyword-only
        ``"auto"`` (the best rung for the device, dtype and shape) or one rung of the ladder
        (:func:`variants`): CPU ``cpu_naive``, ``cpu_blocked``, ``cpu_packed``; CUDA ``naive``,
        ``coalesced``, ``smem_tiled``, ``register_tiled``, ``wmma``, ``mma_pipeline`` and the
        Hopper rungs ``wgmma_tma``, ``wgmma_ws``, ``wgmma_persistent`` (the last five: float16 and
        bfloat16 only; the Hopper rungs run on compute capability 9.0 and load through TMA, so
        the rows of ``a`` and ``b`` must be 16-byte aligned: K and N multiples of 8 for
        contiguous operands. ``auto`` picks ``wgmma_persistent`` where it can run and
        ``mma_pipeline`` elsewhere), and ``gemv`` for decode shapes (a few rows; any dtype and
        alignment; ``auto`` takes it up to 8 rows).

    Returns
    -------
    torch.Tensor
        A new tensor of ``torch.matmul(a, b)``'s shape: ``(*batch, M, N)`` where ``batch`` is
        ``batch_a`` and ``batch_b`` broadcast (aligned on the right; a size of 1 stretches, so
        ``(2, 1, M, K) @ (7, K, N)`` gives ``(2, 7, M, N)``), without ``M`` when ``a`` is 1-D and
        without ``N`` when ``b`` is 1-D (1-D @ 1-D: a 0-D tensor). The dtype and device of ``a``;
        contiguous.

    Raises
    ------
    ValueError
        A 0-D operand, mismatched inner dimensions (K), batch shapes that do not broadcast,
        different dtypes or devices, an unknown variant or one of the other device, operands a
        forced Hopper rung cannot load through TMA. The message names the op and the argument.
    NotImplementedError
        A dtype the op does not take (other than float32, float16, bfloat16 and float64), a
        variant that cannot take the dtype (``wmma`` on float32, any CUDA variant or ``cpu_packed``
        on float64), or CUDA tensors with a CPU-only build.

    Notes
    -----
    *Layout.* The kernels take a batch of row-major matrices with one batch stride (0 for a
    broadcast operand). Matrices whose last dimension has unit stride and whose rows are at least a
    row apart (possibly with padding: slices such as ``x[..., :k]``) are passed as they are, batch
    views included (``x.expand(...)``, ``x[::2]``, permuted batch dimensions): batch dimensions that
    collapse into one stride for ``a``, ``b`` and the output are folded into the kernels' batch, and
    the others are looped over, one kernel call per index, without copying. Matrices in other
    layouts (``x.mT``, expanded rows) are first copied to a contiguous tensor, before
    broadcasting.

    *Autograd.* ``grad_a = grad @ b^T`` and ``grad_b = a^T @ grad``, both through this op (with
    the same variant), summed over the batch dimensions that were broadcast and reshaped to the
    operand's shape (1-D operands included); a ``b`` of at most 2 dimensions shared by a batch
    gets its gradient from one GEMM over the folded batch. Double backward works.

    *torch.compile and CUDA graphs.* The op has a fake kernel, so ``torch.compile(fullgraph=True)``
    (dynamic shapes too) traces it without graph breaks. On CUDA it runs on the current stream of
    the inputs' device, allocates its output through torch's caching allocator and never
    synchronizes the host, so it can be captured in a CUDA graph.

    Examples
    --------
    >>> a = torch.randn(128, 64, dtype=torch.bfloat16, device="cuda")
    >>> b = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    >>> optimized_ops.matmul(a, b).shape
    torch.Size([128, 32])
    >>> optimized_ops.matmul(a.expand(4, 128, 64), b, variant="mma_pipeline").shape
    torch.Size([4, 128, 32])
    >>> x = torch.randn(2, 1, 128, 64, dtype=torch.bfloat16, device="cuda")
    >>> optimized_ops.matmul(x, b.expand(7, 64, 32)).shape
    torch.Size([2, 7, 128, 32])
    >>> optimized_ops.matmul(a, b[:, 0]).shape  # 1-D b: a matrix-vector product
    torch.Size([128])
    """
    return torch.ops.optimized.matmul.default(a, b, variant=variant)


# The registrations around the C++ op: the fake kernel, then autograd (reverse and forward mode).
from . import _fakes, _autograd  # noqa: E402,F401
