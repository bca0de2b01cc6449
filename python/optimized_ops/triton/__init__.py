"""The Triton rungs (issue 22): the same ops as the CUDA ladders, written in Triton by us.

Each kernel file reads as one story (header comment: what the kernel does and how; the kernel; its
launcher), from the first kernel a learner writes to the ones that race the CUDA rungs:

========================  ========================================================================
file                      what
========================  ========================================================================
``vector_add_kernel.py``  ``out = x + y``: one program per block of elements, masks for the tail
``softmax.py``            row softmax, forward and backward: a row in registers, or streamed
                          (online max)
``norms.py``              layer_norm and rms_norm, forward and backward; dweight / dbias reduced
                          in two deterministic stages (partials per group of rows, a column sum)
``matmul.py``             tiled GEMM, fp32 accumulation, grouped rasterization, autotuned
``matmul_tma.py``         persistent GEMM loading through TMA descriptors (Hopper), autotuned
``attention.py``          FlashAttention forward and backward: causal or not, GQA / MQA
``ops.py``                the torch ops, their fakes and autograd, the argument checks
``_compat.py``            fixes for Triton's interpreter (the CPU tests), interpreter mode only
========================  ========================================================================

They are ``variant="triton"`` of their op: ``optimized_ops.softmax(x, -1, variant="triton")``,
``layer_norm``, ``rms_norm``, ``matmul`` and ``flash_attention``, and ``matmul(..., variant="triton_tma")``;
the torch ops are ``torch.ops.optimized.triton_*``
(``ops.py``: custom ops with fake kernels, so that ``torch.compile(fullgraph=True)`` traces through
them, and autograd Functions whose backward runs the Triton backward kernels).

Where they run: CUDA tensors on a CUDA device, or CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1`` set before the kernels are first used: how the tests run without a GPU).
:func:`availability` says whether they can run here and, where not, why; the kernel modules import
``triton`` only when a Triton rung is first called.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["availability", "available", "interpreter", "require", "tma_availability", "vector_add"]


def interpreter() -> bool:
    """True where Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_HAS_TRITON = importlib.util.find_spec("triton") is not None  # once: find_spec is not traceable


def availability() -> tuple[bool, str]:
    """``(True, how)`` where the Triton rungs can run, else ``(False, why not)``."""
    if not _HAS_TRITON:
        return False, "the triton package is not installed (pip install triton)"
    if interpreter():
        return True, "Triton's interpreter (TRITON_INTERPRET=1): CPU tensors"
    if not torch.cuda.is_available():
        return False, ("no CUDA device visible to torch (set TRITON_INTERPRET=1 to run the Triton rungs "
                       "on CPU tensors in Triton's interpreter)")
    return True, "compiled for the CUDA device"


def tma_availability() -> tuple[bool, str]:
    """availability() for the TMA rung (matmul_tma.py): TMA descriptors need compute capability 9.0
    or later (Hopper); the interpreter emulates them on the CPU."""
    ok, why = availability()
    if not ok:
        return ok, why
    try:
        import triton.tools.tensor_descriptor  # noqa: F401
    except ImportError:
        return False, "this Triton has no host tensor descriptors (triton.tools.tensor_descriptor; Triton >= 3.4)"
    if interpreter():
        return True, "Triton's interpreter (TRITON_INTERPRET=1): CPU tensors, TMA emulated"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return False, f"TMA needs compute capability 9.0 or later (Hopper); this device is {major}.{minor}"
    return True, "compiled for the CUDA device (TMA)"


def available() -> bool:
    return availability()[0]


def require(op: str, *tensors, tma: bool = False) -> None:
    """Raises where ``variant="triton"`` of ``op`` cannot run on these tensors: NotImplementedError
    where Triton is unavailable (with the reason), ValueError for tensors on a device the rung does
    not run on (CUDA compiled; CPU only in the interpreter). While torch.compile traces, nothing:
    the custom ops check again when the compiled graph runs them."""
    if torch.compiler.is_compiling():
        return
    ok, why = tma_availability() if tma else availability()
    if not ok:
        raise NotImplementedError(f"optimized::{op}: variant {'triton_tma' if tma else 'triton'} is unavailable: {why}")
    devices = {t.device for t in tensors if t is not None}
    if not devices:
        return
    dev = next(iter(sorted(devices, key=str)))
    if interpreter():
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"optimized::{op}: variant triton runs on CPU tensors in Triton's interpreter; "
                             f"given operands on {dev}")
    elif dev.type != "cuda":
        raise ValueError(f"optimized::{op}: variant triton runs on CUDA devices (CPU tensors only under "
                         f"TRITON_INTERPRET=1); given operands on {dev}")


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` by the first Triton kernel (vector_add_kernel.py): same shape, dtype and device."""
    require("triton_vector_add", x, y)
    from .vector_add_kernel import vector_add as _vector_add
    return _vector_add(x, y)


from . import ops  # noqa: E402,F401  (the torch ops: custom ops, fakes, autograd; no triton import)
