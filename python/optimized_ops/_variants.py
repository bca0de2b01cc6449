"""``optimized_ops.variants(family)``: the ladder of every op family, from the library's tables.

Each family's module registers how to list its variants (:func:`register_family`) when it is imported:
``gemm``, ``scaled_gemm``, ``fused``, ``attention``, ``kv_cache`` and ``linear`` from the ``torch.ops.optimized.<family>_variants()`` query of their glue, which
reads the C++ variant table; ``loader`` likewise (``optimized_ops.data``). The families are listed in
the order the package imports them.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["register_family", "variants"]

_FAMILIES: dict[str, Callable[[], list[str]]] = {}


def register_family(family: str, listing: Callable[[], list[str]]) -> None:
    """Makes ``variants(family)`` call ``listing()``: the family's variant names, naive to best."""
    _FAMILIES[family] = listing


def variants(family: str = "gemm") -> list[str]:
    """Names of the variants of an op family, naive to best (``"auto"`` excluded).

    Parameters
    ----------
    family : str
        ``"gemm"`` (the default, so that ``variants()`` still lists GEMM's rungs as it always did),
        ``"scaled_gemm"`` (the fp8 GEMM, ``scaled_mm``), ``"fused"``, ``"loader"``, ``"attention"``,
        ``"kv_cache"`` or ``"linear"``.

    Returns
    -------
    list of str
        The names ``variant=`` takes, from the library's table for the family, in the order of its
        ladder: ``variants("gemm")`` is the CPU rungs then the CUDA rungs (``["cpu_naive",
        "cpu_blocked", "cpu_packed", "naive", ..., "mma_pipeline"]``), ``variants("fused")``
        ``["cpu", "unfused", "fused_streaming", "fused_registers"]``, ``variants("scaled_gemm")``
        ``["cpu", "naive", "wgmma_fp8"]``, ``variants("loader")``
        ``["synchronous", "pipelined"]`` (``StreamingLoader(variant=...)``), ``variants("attention")``
        ``["cpu", "naive", "flash", "flash2"]``, ``variants("linear")`` ``["cpu", "naive", "fused",
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
    return list(listing())
