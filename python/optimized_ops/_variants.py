"""``optimized_ops.variants(family)``: the ladder of every op family, from the library's tables.

Each family's module registers how to list its variants (:func:`register_family`) when it is imported:
``gemm``, ``scaled_gemm``, ``fused``, ``attention``, ``kv_cache`` and ``linear`` from the ``torch.ops.optimized.<family>_variants()`` query of their glue, which
reads the C++ variant table; ``loader`` likewise (``optimized_ops.data``). The families are listed in
the order the package imports them.

Rungs written in Python (the Triton rungs, ``optimized_ops/triton/``) are not in the C++ tables:
:func:`register_rung` adds one to a family with a function that says whether it can run here, and
``variants(family, detail=True)`` lists every rung, the C++ table's then the Python ones, each with
its availability and, where unavailable, the reason. ``variants(family)`` stays the C++ table's
names (what the library's ``variant=`` parser takes, and the listing the C API shares).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_family", "register_rung", "variants"]

_FAMILIES: dict[str, Callable[[], list[str]]] = {}
_RUNGS: dict[str, list[tuple[str, str, Callable[[], tuple[bool, str]]]]] = {}


def register_family(family: str, listing: Callable[[], list[str]]) -> None:
    """Makes ``variants(family)`` call ``listing()``: the family's variant names, naive to best."""
    _FAMILIES[family] = listing


def register_rung(family: str, name: str, backend: str, availability: Callable[[], tuple[bool, str]]) -> None:
    """Adds a rung written in Python (``backend``, e.g. ``"triton"``) to ``variants(family, detail=True)``;
    ``availability()`` gives ``(True, how it runs)`` or ``(False, why it cannot run here)``."""
    rungs = _RUNGS.setdefault(family, [])
    if all(r[0] != name for r in rungs):
        rungs.append((name, backend, availability))


def _library_rung(name: str) -> dict:
    """A rung of a C++ table: CPU rungs run everywhere, the others need a CUDA build and device."""
    if name == "cpu" or name.startswith("cpu_") or name in ("synchronous", "pipelined"):
        return {"name": name, "backend": "cpu" if name.startswith("cpu") else "host", "available": True, "reason": ""}
    import torch

    from ._library import load
    if not bool(load().optimized_built_with_cuda()):
        reason = "liboptimized_ops was built without CUDA"
    elif not torch.cuda.is_available():
        reason = "no CUDA device visible to torch"
    else:
        reason = ""
    return {"name": name, "backend": "cuda", "available": not reason, "reason": reason}


def variants(family: str = "gemm", *, detail: bool = False) -> list:
    """Names of the variants of an op family, naive to best (``"auto"`` excluded).

    Parameters
    ----------
    family : str
        ``"gemm"`` (the default, so that ``variants()`` still lists GEMM's rungs as it always did),
        ``"scaled_gemm"`` (the fp8 GEMM, ``scaled_mm``), ``"fused"``, ``"loader"``, ``"attention"``,
        ``"kv_cache"`` or ``"linear"``.

    detail : bool, keyword-only
        ``False`` (the default): the names of the library's table, as below. ``True``: every rung,
        the table's then those written in Python (``"triton"`` for ``fused``, ``gemm``), each a
        dict ``{"name", "backend", "available", "reason"}`` -- ``available`` whether it can run on
        this machine and build, ``reason`` why not (empty where it can), e.g.
        ``{"name": "triton", "backend": "triton", "available": False, "reason": "no CUDA device
        visible to torch (set TRITON_INTERPRET=1 ...)"}``.

    Returns
    -------
    list of str (list of dict with ``detail=True``)
        The names ``variant=`` takes, from the library's table for the family, in the order of its
        ladder: ``variants("gemm")`` is the CPU rungs then the CUDA rungs (``["cpu_naive",
        "cpu_blocked", "cpu_packed", "naive", ..., "mma_pipeline"]``), ``variants("fused")``
        ``["cpu", "unfused", "fused_streaming", "fused_registers"]``, ``variants("scaled_gemm")``
        ``["cpu", "naive", "wgmma_fp8"]``, ``variants("loader")``
        ``["synchronous", "pipelined"]`` (``StreamingLoader(variant=...)``), ``variants("attention")``
        ``["cpu", "naive", "flash", "flash2", "hopper"]``, ``variants("linear")`` ``["cpu", "naive", "fused",
        "persistent"]``, ``variants("kv_cache")``
        ``["cpu", "contiguous_naive", "paged", "paged_split", "paged_mma"]``. Every variant is listed,
        whatever this build and machine can run.

    Raises
    ------
    ValueError
        An unknown family; the message names the families.

    Examples
    --------
    >>> optimized_ops.variants("fused")
    ['cpu', 'unfused', 'fused_streaming', 'fused_registers']
    """
    listing = _FAMILIES.get(family) if isinstance(family, str) else None
    if listing is None:
        raise ValueError(f"optimized_ops.variants: family: expected one of {', '.join(_FAMILIES)}; given {family!r}")
    if not detail:
        return list(listing())
    out = [_library_rung(name) for name in listing()]
    for name, backend, availability in _RUNGS.get(family, []):
        ok, why = availability()
        out.append({"name": name, "backend": backend, "available": bool(ok), "reason": "" if ok else why})
    return out
