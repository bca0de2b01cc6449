"""Finding and loading ``liboptimized_ops.so``: the torch ops it registers and its C API."""

from __future__ import annotations

import ctypes
import os
import pathlib
from functools import lru_cache

import torch

_ENV = "OPTIMIZED_OPS_LIBRARY"
_NAME = "liboptimized_ops.so"


def library_path() -> str:
    """Path of the shared library that holds the kernels and the torch ops.

    ``torch.ops.load_library(optimized_ops.library_path())`` in a fresh Python registers
    ``torch.ops.optimized.*`` on its own (without autograd and fake kernels, which
    ``import optimized_ops`` adds).

    Looked up, in order: the file named by the environment variable ``OPTIMIZED_OPS_LIBRARY``;
    ``lib/liboptimized_ops.so`` inside the installed package (``pip install .``).

    Returns
    -------
    str
        Absolute path of ``liboptimized_ops.so``.

    Raises
    ------
    FileNotFoundError
        When neither place holds the library.
    """
    override = os.environ.get(_ENV)
    if override:
        path = pathlib.Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{_ENV}={override}: no such file")
        return str(path.resolve())
    path = pathlib.Path(__file__).resolve().parent / "lib" / _NAME
    if path.is_file():
        return str(path)
    raise FileNotFoundError(
        f"{_NAME} not found at {path}: install the package with `pip install .` from the repository "
        f"root, or point {_ENV} at a library built with -DOPTIMIZED_WITH_TORCH=ON")


@lru_cache(maxsize=None)
def load() -> ctypes.CDLL:
    """Loads the library once: registers the torch ops and returns the C API handle."""
    path = library_path()
    torch.ops.load_library(path)
    lib = ctypes.CDLL(path)  # the same handle: dlopen of a loaded path returns it
    lib.optimized_gemm_variant_name.restype = ctypes.c_char_p
    lib.optimized_gemm_variant_name.argtypes = [ctypes.c_int32]
    lib.optimized_gemm_variant_check.restype = ctypes.c_int
    lib.optimized_gemm_variant_check.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32]
    lib.optimized_last_error.restype = ctypes.c_char_p
    lib.optimized_last_error.argtypes = []
    lib.optimized_built_with_cuda.restype = ctypes.c_int32
    lib.optimized_cuda_device_count.restype = ctypes.c_int32
    return lib
