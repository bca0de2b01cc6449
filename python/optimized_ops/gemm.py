"""GEMM from PyTorch: ``optimized_ops.matmul`` over ``torch.ops.optimized.matmul``.

The op itself (schema, CPU and CUDA kernels) is registered by the C++ library. This module adds
what torch needs around it, through ``torch.library``:

* a fake kernel (``register_fake``): output shape and dtype without running anything, so that
  ``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors trace through the op;
* a backward formula (``register_autograd``) that calls the op again, so gradients run on the
  same kernels and double backward works.
"""

from __future__ import annotations

import torch

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
    r"""Matrix product on the optimized-ops kernels: ``out = a @ b``.

    .. math::  \mathrm{out}[p, i, j] = \sum_k a[p, i, k] \, b[p, k, j]

    Products accumulate in float32 (float64 for float64 inputs); the result is rounded once to
    the dtype of the inputs.

    Parameters
    ----------
    a : torch.Tensor
        ``(M, K)`` or ``(batch_a, M, K)``; float32, float16 or bfloat16 on CPU or CUDA; float64 on
        the CPU (``cpu_naive``, ``cpu_blocked``, and ``auto``, which picks ``cpu_blocked``).
    b : torch.Tensor
        ``(K, N)`` or ``(batch_b, K, N)``; same dtype and device as ``a``. A 2-D operand, or a
        batch of 1, is broadcast over the other operand's batch.
    variant : str, keyword-only
        ``"auto"`` (the best rung for the device, dtype and shape) or one rung of the ladder
        (:func:`variants`): CPU ``cpu_naive``, ``cpu_blocked``, ``cpu_packed``; CUDA ``naive``,
        ``coalesced``, ``smem_tiled``, ``register_tiled``, ``wmma`` and ``mma_pipeline``
        (the last two: float16 and bfloat16 only).

    Returns
    -------
    torch.Tensor
        A new tensor, ``(M, N)`` when both inputs are 2-D, else ``(batch, M, N)`` with
        ``batch = max(batch_a, batch_b)``; the dtype and device of ``a``; contiguous.

    Raises
    ------
    ValueError
        Ranks other than 2 and 3, mismatched inner dimensions (K) or batches, different
        devices, an unknown variant or one of the other device. The message names the argument.
    TypeError
        A dtype other than float32, float16, bfloat16 and float64, or different dtypes.
    NotImplementedError
        A variant that cannot take the dtype (``wmma`` on float32, any CUDA variant or
        ``cpu_packed`` on float64), or CUDA tensors with a CPU-only build.

    Notes
    -----
    *Layout.* Operands whose last dimension has unit stride and whose rows are at least a row
    apart (row-major, possibly with padding: slices such as ``x[:, :k]``) are passed to the
    kernels as they are; others (``x.t()``, expanded rows) are copied to a contiguous tensor
    first.

    *Autograd.* ``grad_a = grad @ b^T`` and ``grad_b = a^T @ grad``, both through this op (with
    the same variant), summed over the batch dimensions that were broadcast.

    *torch.compile and CUDA graphs.* The op has a fake kernel, so ``torch.compile(fullgraph=True)``
    traces it without graph breaks. On CUDA it runs on the current stream of the inputs' device,
    allocates its output through torch's caching allocator and never synchronizes the host, so it
    can be captured in a CUDA graph.

    Examples
    --------
    >>> a = torch.randn(128, 64, dtype=torch.bfloat16, device="cuda")
    >>> b = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    >>> optimized_ops.matmul(a, b).shape
    torch.Size([128, 32])
    >>> optimized_ops.matmul(a.expand(4, 128, 64), b, variant="mma_pipeline").shape
    torch.Size([4, 128, 32])
    """
    return torch.ops.optimized.matmul.default(a, b, variant=variant)


# ---- fake kernel ---------------------------------------------------------------------------

def _check_operand(t: torch.Tensor, name: str, shapes: str) -> None:
    torch._check_value(t.dim() in (2, 3), lambda: (
        f"optimized::matmul: {name}: expected a 2-D {shapes} tensor; given {t.dim()}-D of shape "
        f"{list(t.shape)}"))
    torch._check_type(t.dtype in _DTYPES, lambda: (
        f"optimized::matmul: {name}: expected dtype float32, float16, bfloat16 or float64; given {_name(t.dtype)}"))


def _out_shape(a: torch.Tensor, b: torch.Tensor) -> list:
    """Checks the operands as the C++ kernel does and returns the output shape."""
    _check_operand(a, "a", "(M, K) or 3-D (batch, M, K)")
    _check_operand(b, "b", "(K, N) or 3-D (batch, K, N)")
    torch._check_type(b.dtype == a.dtype, lambda: (
        f"optimized::matmul: b: expected dtype {_name(a.dtype)} (same as a); given {_name(b.dtype)}"))
    torch._check_value(b.device == a.device, lambda: (
        f"optimized::matmul: b: expected device {a.device} (same as a); given {b.device}"))
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    torch._check_value(b.shape[-2] == k, lambda: (
        f"optimized::matmul: b: expected {k} rows to match a's columns (K); given shape "
        f"{list(b.shape)} with a of shape {list(a.shape)}"))
    if a.dim() == 2 and b.dim() == 2:
        return [m, n]
    batch_a = a.shape[0] if a.dim() == 3 else 1
    batch_b = b.shape[0] if b.dim() == 3 else 1
    if a.dim() == 3 and b.dim() == 3:
        torch._check_value(batch_a == batch_b or batch_a == 1 or batch_b == 1, lambda: (
            f"optimized::matmul: b: expected batch {batch_a} (a's) or 1; given batch {batch_b} "
            f"(shape {list(b.shape)})"))
        batch = batch_b if batch_a == 1 else batch_a
    else:
        batch = batch_a if a.dim() == 3 else batch_b
    return [batch, m, n]


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


def _sum_to(grad: torch.Tensor, shape) -> torch.Tensor:
    """Sums the gradient of a broadcast operand over the batch it was broadcast to."""
    if grad.dim() == len(shape) and grad.shape[0] == shape[0]:
        return grad
    if len(shape) == 2:  # a 2-D operand used by every batch
        return grad.sum(0)
    return grad.sum(0, keepdim=True)  # a batch of 1


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    v = ctx.variant
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        # grad_a = grad @ b^T: (.., M, N) @ (.., N, K) -> (.., M, K)
        grad_a = _sum_to(matmul(grad, b.transpose(-1, -2), variant=v), ctx.a_shape)
    if ctx.needs_input_grad[1]:
        if len(ctx.b_shape) == 2 and grad.dim() == 3:
            # b shared by every batch: one GEMM over the folded batch,
            # sum_p a_p^T g_p = [a_1; ..; a_B]^T [g_1; ..; g_B]: (K, B*M) @ (B*M, N) -> (K, N)
            k, n = a.shape[-1], grad.shape[-1]
            a3 = a.expand(grad.shape[0], a.shape[-2], k)
            grad_b = matmul(a3.reshape(-1, k).transpose(0, 1), grad.reshape(-1, n), variant=v)
        else:
            # grad_b = a^T @ grad: (.., K, M) @ (.., M, N) -> (.., K, N)
            grad_b = _sum_to(matmul(a.transpose(-1, -2), grad, variant=v), ctx.b_shape)
    return grad_a, grad_b


torch.library.register_autograd("optimized::matmul", _backward, setup_context=_setup_context)
