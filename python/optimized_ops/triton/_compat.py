"""Two fixes for Triton 3.6's interpreter, applied only in interpreter mode (the compiled GPU path
does not use the interpreter and is untouched).

Triton 3.6's interpreter holds scalars as one-element 1-D arrays and turns them into Python ints
with ``int(array)`` (``tensor.__index__``, used by ``range(n)`` over a runtime argument in a
kernel). NumPy 2.4 made ``int()`` of a 1-D array an error ("only 0-dimensional arrays can be
converted to Python scalars"), so every kernel loop over a runtime bound failed on the CPU. The
patch gives ``__index__`` ``int(array.reshape(-1)[0])`` for one-element arrays.

2. float32 -> bfloat16 casts truncate in the interpreter (its ``cast_impl`` converts with no rounding
mode), where the GPU rounds to nearest even: every bf16 result was up to one unit low in magnitude.
The patch rounds to nearest even (NaN kept quiet), so the interpreter gives the GPU's bits.

3. ``tl.dot`` of bfloat16 tiles multiplies the raw uint16 bit patterns in the interpreter (bf16 is
stored as uint16 there and only fp8 operands are widened): the patch widens bf16 operands to float32
(exact) before the product, as the tensor cores do.
"""

from __future__ import annotations

import triton  # noqa: F401

from . import interpreter


def _apply() -> None:
    if not interpreter():
        return
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:  # a Triton without the interpreter module: nothing to patch
        return
    original = getattr(_interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_optimized_ops_patched", False):
        return

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)

        def _index(self):
            data = self.handle.data
            return int(data.reshape(-1)[0]) if getattr(data, "size", 0) == 1 else int(data)

        scope.set_attr(tensor, "__index__", _index)

    _patch_lang_tensor._optimized_ops_patched = True
    _interp._patch_lang_tensor = _patch_lang_tensor

    builder = getattr(_interp, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl"):
        return
    import numpy as np
    import triton.language as tl
    cast_impl = builder.cast_impl

    def _cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            u = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
            nan = np.isnan(src.data)
            if nan.any():
                out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
            return _interp.TensorHandle(out, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = _cast_impl

    create_dot = builder.create_dot

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            def widen(h):
                if h.dtype.scalar != tl.bfloat16:
                    return h
                bits = np.ascontiguousarray(h.data).view(np.uint16).astype(np.uint32) << np.uint32(16)
                return _interp.TensorHandle(bits.view(np.float32), tl.float32)
            a, b = widen(a), widen(b)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = _create_dot


_apply()
