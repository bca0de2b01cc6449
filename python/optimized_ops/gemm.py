"""GEMM from PyTorch: ``optimized_ops.matmul`` over ``torch.ops.optimized.matmul``.

The op itself (schema, CPU and CUDA kernels) is registered by the C++ library. This module adds
what torch needs around it, through ``torch.library``:

* a fake kernel (``register_fake``): output shape and dtype without running anything, so that
  ``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors trace through the op;
* a backward formula and a forward-mode (jvp) rule (``_autograd.register_autograd``) that call the
  op again, so gradients and tangents run on the same kernels; double backward, ``torch.func.jvp``,
  ``jacfwd`` and ``hessian`` work.
"""

from __future__ import annotations

import math

import torch

from ._autograd import register_autograd
from ._library import load

_lib = load()  # registers torch.ops.optimized.* before the registrations below

# optimized_dtype values; float64 runs on the CPU rungs cpu_naive and cpu_blocked (and auto on CPU)
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 6}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # "float32", as the C++ glue prints it


def variants() -> list[str]:
    """Names of every GEMM variant, CPU then CUDA, naive to best (``"auto"`` excluded)."""
    names = []
    while (name := _lib.optimized_gemm_variant_name(len(names))) is not None:
        names.append(name.decode())
    return names


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
        ``coalesced``, ``smem_tiled``, ``register_tiled``, ``wmma`` and ``mma_pipeline``
        (the last two: float16 and bfloat16 only).

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
        different devices, an unknown variant or one of the other device. The message names the
        argument.
    TypeError
        A dtype other than float32, float16, bfloat16 and float64, or different dtypes.
    NotImplementedError
        A variant that cannot take the dtype (``wmma`` on float32, any CUDA variant or
        ``cpu_packed`` on float64), or CUDA tensors with a CPU-only build.

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


# ---- fake kernel ---------------------------------------------------------------------------

def _check_operand(t: torch.Tensor, name: str, shapes: str) -> None:
    torch._check_value(t.dim() >= 1, lambda: (
        f"optimized::matmul: {name}: expected a tensor of at least 1 dimension, {shapes}; given 0-D (a scalar)"))
    torch._check_type(t.dtype in _DTYPES, lambda: (
        f"optimized::matmul: {name}: expected dtype float32, float16, bfloat16 or float64; given {_name(t.dtype)}"))


def _out_shape(a: torch.Tensor, b: torch.Tensor) -> list:
    """Checks the operands as the C++ glue does and returns torch.matmul's output shape.

    Works on symbolic sizes (torch.compile(dynamic=True)): every comparison goes through
    ``torch._check_value`` or a plain ``==`` that becomes a guard."""
    _check_operand(a, "a", "(K,) or (..., M, K)")
    _check_operand(b, "b", "(K,) or (..., K, N)")
    torch._check_type(b.dtype == a.dtype, lambda: (
        f"optimized::matmul: b: expected dtype {_name(a.dtype)} (same as a); given {_name(b.dtype)}"))
    torch._check_value(b.device == a.device, lambda: (
        f"optimized::matmul: b: expected device {a.device} (same as a); given {b.device}"))
    k = a.shape[-1]
    k_b = b.shape[0] if b.dim() == 1 else b.shape[-2]
    torch._check_value(k_b == k, lambda: (
        f"optimized::matmul: b: expected {f'length {k}' if b.dim() == 1 else f'{k} rows'} to match a's "
        f"{'length' if a.dim() == 1 else 'columns'} (K); given shape {list(b.shape)} with a of shape "
        f"{list(a.shape)}"))
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
    return a.new_empty(_out_shape(a, b))


# ---- autograd ------------------------------------------------------------------------------

def _setup_context(ctx, inputs, keyword_only_inputs, output):
    a, b = inputs
    ctx.variant = keyword_only_inputs.get("variant", "auto")
    ctx.a_shape, ctx.b_shape = a.shape, b.shape
    # grad_a needs b, grad_b needs a: save only what a requested gradient uses.
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    v = ctx.variant
    a_1d, b_1d = len(ctx.a_shape) == 1, len(ctx.b_shape) == 1
    # Everything as matrices: a 1-D a is the row (1, K), a 1-D b the column (K, 1), and the
    # gradient gets back the M and N dimensions the output dropped: (*batch, M, N).
    if b_1d:
        grad = grad.unsqueeze(-1)
    if a_1d:
        grad = grad.unsqueeze(-2)
    a_m = None if a is None else (a.unsqueeze(0) if a_1d else a)
    b_m = None if b is None else (b.unsqueeze(-1) if b_1d else b)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        # grad_a = grad @ b^T: (*batch, M, N) @ (.., N, K) -> (*batch, M, K), summed over the batch
        # dimensions a was broadcast along (sum_to_size), then back to a's shape (1-D: (K,)).
        a_m_shape = (1, ctx.a_shape[0]) if a_1d else ctx.a_shape
        grad_a = matmul(grad, b_m.transpose(-1, -2), variant=v).sum_to_size(a_m_shape).reshape(ctx.a_shape)
    if ctx.needs_input_grad[1]:
        b_m_shape = (ctx.b_shape[0], 1) if b_1d else ctx.b_shape
        if len(b_m_shape) == 2 and grad.dim() > 2:
            # b shared by every batch: one GEMM over the folded batch,
            # sum_p a_p^T g_p = [a_1; ..; a_B]^T [g_1; ..; g_B]: (K, B*M) @ (B*M, N) -> (K, N)
            k, n = a_m.shape[-1], grad.shape[-1]
            rows = math.prod(grad.shape[:-1])  # B*M, spelled out: reshape(-1, 0) is ambiguous
            a_all = a_m.expand(*grad.shape[:-2], a_m.shape[-2], k)
            grad_b = matmul(a_all.reshape(rows, k).transpose(0, 1), grad.reshape(rows, n), variant=v)
        else:
            # grad_b = a^T @ grad: (.., K, M) @ (*batch, M, N) -> (*batch, K, N), summed likewise
            grad_b = matmul(a_m.transpose(-1, -2), grad, variant=v).sum_to_size(b_m_shape)
        grad_b = grad_b.reshape(ctx.b_shape)
    return grad_a, grad_b


def _jvp(inputs, keyword_only_inputs, output, tangents):
    """d(a @ b) = da @ b + a @ db, both through this op (same variant, same broadcasting)."""
    (a, b), (ta, tb) = inputs, tangents
    v = keyword_only_inputs.get("variant", "auto")
    da = matmul(ta, b, variant=v) if ta is not None else None
    db = matmul(a, tb, variant=v) if tb is not None else None
    return db if da is None else da if db is None else da + db


register_autograd("optimized::matmul", _backward, setup_context=_setup_context, jvp=_jvp)
