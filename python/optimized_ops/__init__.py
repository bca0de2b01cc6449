"""optimized-ops from PyTorch.

``import optimized_ops`` loads ``liboptimized_ops.so`` (which registers ``torch.ops.optimized.*``)
and adds autograd and fake kernels to its ops, so that they work with ``torch.autograd``,
``torch.compile(fullgraph=True)`` and CUDA graphs.

>>> import torch, optimized_ops
>>> a, b = torch.randn(64, 32), torch.randn(32, 16)
>>> torch.allclose(optimized_ops.matmul(a, b), a @ b, atol=1e-5)
True

The scaled (fp8) GEMM, ``optimized_ops.scaled_mm(a, b, scale_a, scale_b, ...)``, takes the arguments
of ``torch._scaled_mm`` (per-tensor, per-row and DeepSeek-V3's block scales; forward only).

Attention: ``optimized_ops.flash_attention(q, k, v, causal=True)`` (flash-attn's (B, S, H, D) layout),
``optimized_ops.flash_attention_varlen`` (packed sequences) and
``optimized_ops.scaled_dot_product_attention`` (a drop-in for torch's), forward and backward.

The KV cache (inference only, no autograd): ``optimized_ops.PagedKVCache`` (K/V pages),
``optimized_ops.append_kv`` (new tokens into their pages, RoPE fused) and
``optimized_ops.paged_attention_decode`` (attention of the new tokens over the cache) and
``optimized_ops.paged_attention_prefill`` (the same for a chunk of any length: chunked prefill).

Linear layers: ``optimized_ops.linear(x, weight, bias, activation="gelu")`` (bias and activation fused
into the GEMM's epilogue; forward and backward) and the drop-in ``optimized_ops.nn.Linear``.

The ops are also reachable as ``torch.ops.optimized.<op>``; without this package,
``torch.ops.load_library(optimized_ops.library_path())`` registers them (forward only).

Every op family shows its ladder of variants, naive to best: ``optimized_ops.variants(family)``
(``"gemm"``, the default; ``"fused"``; ``"loader"``; ``"attention"``; ``"kv_cache"``; ``"linear"``).

The package, one folder per op family with autograd and fake kernels (``gemm/``, ``fused/``,
``attention/``, ``kv_cache/``, ``linear/``: the
functions in ``__init__.py``, the fake kernels in ``_fakes.py``, the autograd rules in
``_autograd.py``), the loader (``data.py``), the ``nn`` modules (``nn.py``), and what they share:
``_library.py`` (loading the library), ``_autograd.py`` (the autograd mechanism) and
``_variants.py`` (``variants(family)``).
"""

from ._library import library_path
from ._variants import variants
from .gemm import built_with_cuda, matmul, scaled_gemm_variants, scaled_mm, variant_supports
from .fused import (add_layer_norm, add_rms_norm, bias_gelu, fused_registers_max_width, fused_variants, gelu,
                    layer_norm, log_softmax, resolve_fused_variant, rms_norm, silu_and_mul, softmax)
from .fused import cross_entropy  # noqa: F401  (issue 17: cross-entropy, fwd + bwd in one pass)
from .fused.rope import rope, rope_variants  # noqa: F401  (rotary embedding, forward and backward)
from .fused import linear_cross_entropy  # noqa: F401  (issue 17: LM head + cross-entropy, chunked over tokens)
from . import data  # the streaming loader: optimized_ops.data.StreamingLoader
from .attention import (attention_head_dims, attention_variants, flash_attention, flash_attention_varlen,
                        resolve_attention_variant, scaled_dot_product_attention)
from .kv_cache import (DecodePlan, PagedKVCache, append_kv, kv_cache_variants, paged_attention_decode,
                       paged_attention_prefill, plan_paged_decode)
from .linear import linear, linear_variants
from .moe import (grouped_gemm_variants, grouped_mm, grouped_mm_swiglu, moe_combine, moe_gather, moe_permute, moe_route,
                  moe_unpermute)
from .moe.layer import MoEMetrics, moe_layer
from . import nn  # the modules (LayerNorm, RMSNorm, Linear, MoE): after the families they run on
from . import models  # whole models on the modules and ops above (Transformer, generate): after nn
from . import distributed  # expert / tensor / data parallelism on torch.distributed: after models

__version__ = "0.1.0"
__all__ = ["library_path", "matmul", "variants", "variant_supports", "built_with_cuda", "__version__",
           "softmax", "log_softmax", "layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "gelu",
           "bias_gelu", "silu_and_mul", "fused_variants", "fused_registers_max_width", "resolve_fused_variant",
           "nn", "models", "distributed"]
__all__ += ["data"]
__all__ += ["scaled_mm", "scaled_gemm_variants"]
__all__ += ["flash_attention", "flash_attention_varlen", "scaled_dot_product_attention", "attention_variants",
            "attention_head_dims", "resolve_attention_variant"]
__all__ += ["linear", "linear_variants"]
__all__ += ["moe_route", "moe_permute", "moe_gather", "moe_combine", "moe_unpermute", "grouped_mm", "grouped_mm_swiglu",
            "grouped_gemm_variants"]
__all__ += ["moe_layer", "MoEMetrics"]
__all__ += ["PagedKVCache", "append_kv", "paged_attention_decode", "paged_attention_prefill", "kv_cache_variants",
            "DecodePlan", "plan_paged_decode"]
