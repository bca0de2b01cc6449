"""Fake kernels of the MoE ops (``torch.library.register_fake``): the outputs' shapes and dtypes as the C++
kernels allocate them, for ``torch.compile(fullgraph=True)``, ``torch.export`` and meta tensors. They check
only what the shapes are computed from; everything else is checked when the real kernel runs."""

from __future__ import annotations

import torch

from .._fakes import one_device
from .._library import load

load()


def _rank(op: str, t: torch.Tensor, arg: str, want: int, shape: str) -> None:
    torch._check_value(t.dim() == want, lambda: (
        f"optimized::{op}: {arg}: expected a {want}-D tensor {shape}; given shape {list(t.shape)}"))


@torch.library.register_fake("optimized::moe_route")
def _moe_route_fake(logits, bias=None, *, top_k, scoring="softmax", topk_softmax=False, normalize=False, n_groups=1,
                    topk_groups=1, routed_scale=1.0):
    one_device("moe_route", logits=logits, bias=bias)
    _rank("moe_route", logits, "logits", 2, "(tokens T, experts E)")
    t = logits.shape[0]
    return (logits.new_empty((t, top_k), dtype=torch.int32), logits.new_empty((t, top_k), dtype=torch.float32),
            logits.new_empty((t,), dtype=torch.float32))


@torch.library.register_fake("optimized::moe_route_backward")
def _moe_route_backward_fake(logits, topk_ids, grad_weights, grad_lse, *, scoring="softmax", topk_softmax=False,
                             normalize=False, routed_scale=1.0):
    one_device("moe_route_backward", logits=logits, topk_ids=topk_ids, grad_weights=grad_weights, grad_lse=grad_lse)
    _rank("moe_route_backward", logits, "logits", 2, "(tokens T, experts E)")
    return logits.new_empty(logits.shape)


@torch.library.register_fake("optimized::moe_permute")
def _moe_permute_fake(topk_ids, num_experts, capacity=0):
    _rank("moe_permute", topk_ids, "topk_ids", 2, "(tokens T, k)")
    i32 = dict(dtype=torch.int32)
    return (topk_ids.new_empty((num_experts,), **i32), topk_ids.new_empty((num_experts + 1,), **i32),
            topk_ids.new_empty((topk_ids.numel(),), **i32), topk_ids.new_empty(topk_ids.shape, **i32),
            topk_ids.new_empty((1,), **i32))


@torch.library.register_fake("optimized::grouped_mm")
def _grouped_mm_fake(x, w, offs, *, variant="auto"):
    one_device("grouped_mm", x=x, w=w, offs=offs)
    _rank("grouped_mm", x, "x", 2, "(rows M, K)")
    _rank("grouped_mm", w, "w", 3, "(groups E, K, N)")
    return x.new_empty((x.shape[0], w.shape[2]))


@torch.library.register_fake("optimized::grouped_mm_weight_grad")
def _grouped_mm_weight_grad_fake(x, dout, offs, *, variant="auto"):
    one_device("grouped_mm_weight_grad", x=x, dout=dout, offs=offs)
    _rank("grouped_mm_weight_grad", x, "x", 2, "(rows M, K)")
    _rank("grouped_mm_weight_grad", dout, "dout", 2, "(rows M, N)")
    _rank("grouped_mm_weight_grad", offs, "offs", 1, "(groups E)")
    return x.new_empty((offs.shape[0], x.shape[1], dout.shape[1]))


@torch.library.register_fake("optimized::grouped_mm_swiglu")
def _grouped_mm_swiglu_fake(x, w, offs, *, save_pre=True, variant="auto"):
    one_device("grouped_mm_swiglu", x=x, w=w, offs=offs)
    _rank("grouped_mm_swiglu", x, "x", 2, "(rows M, K)")
    _rank("grouped_mm_swiglu", w, "w", 3, "(groups E, K, 2F: [gate | up])")
    pre = x.new_empty((x.shape[0], w.shape[2])) if save_pre else None
    return x.new_empty((x.shape[0], w.shape[2] // 2)), pre


@torch.library.register_fake("optimized::moe_gather")
def _moe_gather_fake(x, sorted_pairs, slot_of):
    one_device("moe_gather", x=x, sorted_pairs=sorted_pairs, slot_of=slot_of)
    _rank("moe_gather", x, "x", 2, "(tokens T, N)")
    _rank("moe_gather", sorted_pairs, "sorted_pairs", 1, "(slots S)")
    return x.new_empty((sorted_pairs.shape[0], x.shape[1]))


@torch.library.register_fake("optimized::moe_combine")
def _moe_combine_fake(y, slot_of, sorted_pairs, weights):
    one_device("moe_combine", y=y, slot_of=slot_of, sorted_pairs=sorted_pairs, weights=weights)
    _rank("moe_combine", y, "y", 2, "(slots S, N)")
    _rank("moe_combine", slot_of, "slot_of", 2, "(tokens T, k)")
    return y.new_empty((slot_of.shape[0], y.shape[1]))


@torch.library.register_fake("optimized::moe_combine_backward")
def _moe_combine_backward_fake(dout, y, slot_of, sorted_pairs, weights, output_mask=(True, True)):
    one_device("moe_combine_backward", dout=dout, y=y, slot_of=slot_of, sorted_pairs=sorted_pairs, weights=weights)
    _rank("moe_combine_backward", y, "y", 2, "(slots S, N)")
    return (y.new_empty(y.shape) if output_mask[0] else None,
            weights.new_empty(weights.shape) if output_mask[1] else None)
