"""The Python mirror of the tolerance rules of optimized_ops_testing (src/testing/tolerance.h), one per
family, for pytest (tests/python/conftest.py re-exports them) and the Python benchmark runners.

    GEMM, per element:
        |out - ref| <= u_out * |ref| + floor_out + 8 * sqrt(K) * u_acc * magnitude
        magnitude = |alpha| * sum_k |a_ik b_kj| + |beta * c0_ij|

    reductions and element-wise ops (the fused family; design.md: flash-attention's rule), per unit:
        max |out - ref| <= 2 * max |same - ref| + 2 * u_out * max |ref| + 16 * sqrt(n) * u_acc * scale + floor_out
        same: the same computation in the output's dtype (torch in that dtype, in Python);
        n: the reduction length; scale: max(max |ref|, terms), terms the magnitude of what was summed

    attention (out, dq, dk, dv; bench/benchmark_attention.py): the reduction rule per tensor with n the
        sequence length reduced over and no terms (attention_allowed_error)

tests/common/tolerance_vectors.txt holds both rules on fixed numbers with the bounds they give; the
C++ test (tests/core/test_tolerance.cpp) and pytest (tests/python/test_tolerance.py) each recompute
every line, so this mirror and the C++ rule agree. Pure arithmetic: the values may be floats or
torch tensors (abs() and arithmetic only), dtypes names ("bf16") or torch dtypes.
"""

from __future__ import annotations

import math

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8, "fp64": 2.0**-53}
HALF_SUBNORMAL_STEP = {"fp32": 2.0**-150, "fp16": 2.0**-25, "bf16": 2.0**-134, "fp64": 2.0**-1075}
REDUCTION_FLOOR = {"fp32": 2.0**-126, "fp16": 2.0**-24, "bf16": 2.0**-126, "fp64": 2.0**-1022}
_TORCH_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


def dtype_name(dtype) -> str:
    """'fp32', 'fp16', 'bf16' or 'fp64' for a name or a torch dtype."""
    if isinstance(dtype, str):
        return _TORCH_NAMES.get(dtype, dtype)
    return _TORCH_NAMES[str(dtype).removeprefix("torch.")]


def unit_roundoff(dtype) -> float:
    return UNIT_ROUNDOFF[dtype_name(dtype)]


def accumulation_unit(dtype) -> float:
    """fp32 math's unit (2^-24), or fp64's for fp64."""
    return 2.0**-53 if dtype_name(dtype) == "fp64" else 2.0**-24


def gemm_allowed_error(dtype, k: int, ref, magnitude):
    """The GEMM bound of one element (or of every element of tensors ref and magnitude)."""
    d = dtype_name(dtype)
    acc = 8.0 * math.sqrt(k) * accumulation_unit(d)
    return UNIT_ROUNDOFF[d] * abs(ref) + HALF_SUBNORMAL_STEP[d] + acc * magnitude


def reduction_allowed_error(dtype, n: int, same_error: float, max_ref: float, terms: float, u_acc: float) -> float:
    """The allowed max error of one unit under the reduction rule (terms 0: none)."""
    d = dtype_name(dtype)
    scale = max(max_ref, terms)
    return (2.0 * same_error + 2.0 * UNIT_ROUNDOFF[d] * max_ref + 16.0 * math.sqrt(n) * u_acc * scale
            + REDUCTION_FLOOR[d])


def attention_allowed_error(dtype, seqlen: int, same_error: float, max_ref: float) -> float:
    """The allowed max error of one attention output or gradient (flash-attention's rule, design.md):
    2 x the error of the same-dtype torch math path against float64 + rounding noise, i.e. the reduction rule
    with n = the reduction length (seqlen: S_k for out and dq, S_q x the GQA group for dk and dv; the longest
    sequence for varlen), fp32 accumulation (fp64's unit for fp64), as attention_rule in
    src/testing/attention_check.cpp; applied per tensor with scale = max |ref| (the C++ check goes per row and
    also takes the summed terms' magnitude)."""
    return reduction_allowed_error(dtype, max(int(seqlen), 1), same_error, max_ref, 0.0, accumulation_unit(dtype))
