"""GEMM from PyTorch: ``optimized_ops.matmul`` over ``torch.ops.optimized.matmul``, and the scaled (fp8)
GEMM ``optimized_ops.scaled_mm`` over ``torch.ops.optimized.scaled_mm``.

The ops themselves (schemas, CPU and CUDA kernels) are registered by the C++ library
(``src/torch/gemm_ops.cpp``, ``src/torch/scaled_ops.cpp``). The package adds what torch needs around
them (for ``scaled_mm``: the fake kernel, and an autograd kernel that raises in backward):

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

from .. import triton as _triton
from .._library import load
from .._variants import register_family, register_rung

_lib = load()  # registers torch.ops.optimized.* before the registrations below

# optimized_dtype values; float64 runs on the CPU rungs cpu_naive and cpu_blocked (and auto on CPU)
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 6}


def variants() -> list[str]:
    """Names of every GEMM variant, CPU then CUDA, naive to best (``"auto"`` excluded): the C++ table,
    through ``torch.ops.optimized.gemm_variants()``. ``optimized_ops.variants()`` and
    ``optimized_ops.variants("gemm")`` return the same list."""
    return list(torch.ops.optimized.gemm_variants())


register_family("gemm", variants)
register_rung("gemm", "triton", "triton", _triton.availability)
register_rung("gemm", "triton_tma", "triton", _triton.tma_availability)


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
        alignment; ``auto`` takes it up to 8 rows); ``"triton"``: the tiled, autotuned Triton GEMM
        (optimized_ops/triton/matmul.py; float32, float16, bfloat16; CUDA, or CPU tensors under
        ``TRITON_INTERPRET=1``; not in the C++ table, ``variants("gemm", detail=True)`` lists it
        with its availability; NotImplementedError with the reason where Triton cannot run);
        ``"triton_tma"``: the persistent Triton GEMM loading through TMA descriptors
        (optimized_ops/triton/matmul_tma.py; float16 and bfloat16, compute capability 9.0 or later,
        rows 16-byte aligned: K and N multiples of 8).

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
    if variant in ("triton", "triton_tma"):
        return _triton.ops.matmul(a, b, tma=variant == "triton_tma")
    return torch.ops.optimized.matmul.default(a, b, variant=variant)


def scaled_gemm_variants() -> list[str]:
    """Names of every scaled (fp8) GEMM variant, CPU then CUDA, naive to best (``"auto"`` excluded):
    the C++ table, through ``torch.ops.optimized.scaled_gemm_variants()``: ``["cpu", "naive",
    "wgmma_fp8"]``. Every variant is listed, whatever this build and machine can run."""
    return list(torch.ops.optimized.scaled_gemm_variants())


register_family("scaled_gemm", scaled_gemm_variants)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              scale_a_layout: str = "auto", scale_b_layout: str = "auto", variant: str = "auto") -> torch.Tensor:
    r"""Scaled (fp8) matrix product on the optimized-ops kernels, with the arguments of
    :func:`torch._scaled_mm` where they overlap:

    .. math::  \mathrm{out}[i, j] = \sum_k (a[i, k] \, s_a(i, k)) \, (b[k, j] \, s_b(k, j)) + \mathrm{bias}[j]

    Each fp8 element is multiplied by its scale (the scale of its block, row, column or operand);
    products accumulate in float32, the bias is added after the scales, and the result is rounded
    once to ``out_dtype``.

    Parameters
    ----------
    a : torch.Tensor
        ``(M, K)``, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, on CPU or CUDA. Row-major
        (contiguous) or column-major (``x.t()`` of a contiguous ``(K, M)``) views go to the kernels
        as they are, other strides are first copied with ``.contiguous()``.
    b : torch.Tensor
        ``(K, N)``, fp8 (not ``float8_e5m2`` when ``a`` is: e5m2 x e5m2 is refused, as by
        ``torch._scaled_mm``), same device. Usually the transpose of an ``(N, K)`` weight,
        ``w.t()`` (column-major, torch._scaled_mm's convention and the layout the Hopper rung
        reads); a row-major ``(K, N)`` tensor works too (the Hopper rung copies it K-major first).
    scale_a, scale_b : torch.Tensor
        float32 scales on the operands' device, in one of the layouts below (made contiguous,
        copied if needed). With ``scale_*_layout="auto"`` the layout is read from the shape:

        ==================  ===================================  ===================================
        layout              ``scale_a``                          ``scale_b``
        ==================  ===================================  ===================================
        ``tensor``          one element (``()``, ``(1,)``, ...)  one element
        ``rowwise``         ``(M, 1)`` or ``(M,)``: per row      ``(1, N)`` or ``(N,)``: per column
        ``block_1x128``     ``(M, ceil(K/128))``                 ``(N, ceil(K/128))``
        ``block_128x128``   ``(ceil(M/128), ceil(K/128))``       ``(ceil(K/128), ceil(N/128))``
        ==================  ===================================  ===================================

        Where two shapes coincide the first row wins (``tensor``, then ``rowwise``; for ``scale_a``
        ``block_1x128`` before ``block_128x128``): the scales mean the same then. A ``(N, 1)``
        ``scale_b`` with ``K <= 128`` is ``rowwise`` too (the same scales as ``block_1x128``).
        The block layouts are DeepSeek-V3's (activations 1x128, weights 128x128), row-major.
    bias : torch.Tensor, optional, keyword-only
        ``(N,)`` of ``out_dtype``, added to every row after the scales.
    out_dtype : torch.dtype, keyword-only
        ``torch.bfloat16`` (the default), ``torch.float16`` or ``torch.float32``.
    scale_a_layout, scale_b_layout : str, keyword-only
        ``"auto"`` (read from the shape, above) or ``"tensor"``, ``"rowwise"``, ``"block_1x128"``,
        ``"block_128x128"``: overrides the inference; the scale must then hold the number of
        elements that layout needs (any shape).
    variant : str, keyword-only
        ``"auto"`` or one rung of :func:`scaled_gemm_variants`: ``cpu`` (CPU tensors: dequantize on
        load, float32 dot products, threads), ``naive`` (CUDA, any GPU, any layout: one thread per
        output) and ``wgmma_fp8`` (Hopper, compute capability 9.0: TMA + fp8 tensor cores, the
        partial sums promoted into float32 every 128 of K with the block scales; it takes every
        scale layout but a ``block_1x128`` ``scale_b``). ``auto`` picks ``cpu`` on the CPU,
        ``wgmma_fp8`` on an H100 where it can run (operands in other layouts are copied K-major into
        a workspace first) and ``naive`` elsewhere.

    Returns
    -------
    torch.Tensor
        A new contiguous ``(M, N)`` tensor of ``out_dtype`` on the device of ``a``.

    Raises
    ------
    ValueError
        Operands that are not 2-D or whose K differ; a scale whose shape names no layout (the
        message names ``scale_a`` or ``scale_b`` and lists the shapes it takes) or whose element
        count does not fit an explicit layout; a scale that is not float32; an unknown layout or
        variant name, a variant of the other device; a ``bias`` of another dtype than ``out_dtype``
        or not of ``N`` elements; tensors on different devices. The message names the op and the
        argument.
    NotImplementedError
        An ``a`` or ``b`` that is not fp8, e5m2 x e5m2, an ``out_dtype`` other than float32,
        float16 and bfloat16, ``wgmma_fp8`` on a GPU other than compute capability 9.0 (or with a
        ``block_1x128`` ``scale_b``), CUDA tensors with a CPU-only build.

    Notes
    -----
    *No autograd.* The fp8 GEMM has no backward here (train with a higher-precision matmul, or
    quantize in your own autograd.Function). The forward runs with inputs that require grad, but a
    backward that reaches the output (or a forward-mode tangent) raises ``RuntimeError: derivative
    for optimized::scaled_mm is not implemented ...``, as for ``torch._scaled_mm``; so does
    ``torch.compile`` of a graph whose inputs require grad, while compiling (it traces the backward).
    Detach the inputs or run under ``torch.no_grad()``.

    *torch.compile and CUDA graphs.* The op has a fake kernel, so ``torch.compile(fullgraph=True)``
    traces it. On CUDA it runs on the current stream of the inputs' device, allocates its output
    (and the Hopper rung's workspace) through torch's caching allocator and never synchronizes
    the host, so it can be captured in a CUDA graph.

    Examples
    --------
    >>> x = torch.randn(64, 256).to(torch.float8_e4m3fn)          # activations (M, K)
    >>> w = torch.randn(32, 256).to(torch.float8_e4m3fn)          # weight (N, K)
    >>> one = torch.ones((), dtype=torch.float32)
    >>> optimized_ops.scaled_mm(x, w.t(), one, one).shape         # tensor-wise scales
    torch.Size([64, 32])
    >>> sx, sw = torch.rand(64, 2), torch.rand(2, 1)               # 1x128 and 128x128 blocks
    >>> optimized_ops.scaled_mm(x, w.t(), sx, sw, out_dtype=torch.float32).dtype
    torch.float32
    """
    return torch.ops.optimized.scaled_mm.default(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                                                 scale_a_layout=scale_a_layout, scale_b_layout=scale_b_layout,
                                                 variant=variant)


# The registrations around the C++ ops: the fake kernels, then autograd (reverse and forward mode;
# scaled_mm: a backward that raises).
from . import _fakes, _autograd  # noqa: E402,F401
