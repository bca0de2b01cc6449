"""Whole models on the library's ops (issue 20): ``optimized_ops.models``.

* :class:`TransformerConfig`, :class:`MoEConfig` (``config.py``): the shape of a decoder-only transformer;
* :class:`Transformer`, :class:`OptimizedTransformer` (``transformer.py``): the model on the library's ops,
  or (``reference=True``) the same model in plain PyTorch, with the same parameters and initialization;
  :func:`~optimized_ops.models.reference.moe` and the other torch references live in ``reference.py``;
* :class:`PagedDecodeCache`, :class:`StaticDecodeCache` (``cache.py``): the KV caches of
  :meth:`Transformer.forward_cached`;
* :func:`generate`, :func:`sample_next` (``generation.py``): prefill then decode with the paged KV cache and
  CUDA graphs, greedy or sampled;
* ``train_from_nvme``, ``TrainConfig`` (``training.py``) and ``profile`` (``profile.py``), where present.

>>> import torch, optimized_ops
>>> from optimized_ops.models import OptimizedTransformer, generate
>>> model = OptimizedTransformer(d_model=64, n_heads=4, n_layers=2, vocab_size=97, max_seq_len=64).eval()
>>> generate(model, [[1, 2, 3], [4]], 5, temperature=0)   # two prompts of different lengths, greedy
"""

from __future__ import annotations

import importlib.util

from .cache import PagedDecodeCache, StaticDecodeCache
from .config import MoEConfig, TransformerConfig, swiglu_hidden_dim
from .generation import bucket_size, captured_decode_steps, generate, release_decode_graphs, sample_next
from .transformer import OptimizedTransformer, Transformer

__all__ = ["TransformerConfig", "MoEConfig", "swiglu_hidden_dim", "Transformer", "OptimizedTransformer",
           "PagedDecodeCache", "StaticDecodeCache", "generate", "sample_next", "release_decode_graphs",
           "captured_decode_steps", "bucket_size"]

# Written beside this package by the training and profiling work: imported where present (an error inside
# them is raised, not hidden); absent, the names are simply not here yet.
if importlib.util.find_spec(f"{__name__}.training") is not None:
    from .training import TrainConfig, train_from_nvme  # noqa: F401
    __all__ += ["train_from_nvme", "TrainConfig"]
if importlib.util.find_spec(f"{__name__}.profile") is not None:
    from .profile import profile  # noqa: F401
    __all__ += ["profile"]
