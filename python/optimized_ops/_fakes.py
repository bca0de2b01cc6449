"""What the fake kernels of every family (``<family>/_fakes.py``) share."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["one_device"]


def one_device(op: str, **tensors: Optional[torch.Tensor]) -> None:
    """Checks that the given tensors (``None``: absent) are on the device of the first one, which is
    the outputs' device. A fake computes its outputs' device as well as their shapes: real tensors
    reach it only beside meta tensors (the Meta dispatch key wins over CPU), where it would otherwise
    return uninitialized memory on the first one's device instead of raising. The message is the
    C++ library's check of the same thing, named by the op and the argument."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    first, ref = given[0]
    for name, t in given[1:]:
        torch._check_value(t.device == ref.device, lambda: (
            f"optimized::{op}: {name}: expected device {ref.device} (same as {first}); given {t.device}"))
