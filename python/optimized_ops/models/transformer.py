"""A decoder-only transformer language model on the library's ops: :class:`Transformer` (from a
:class:`~optimized_ops.models.TransformerConfig`) and :class:`OptimizedTransformer` (the same, from keyword
arguments, GPT-2 small's shape by default).

One block, pre-norm (``x`` the residual stream)::

    h      = norm_1(x)                                      # RMSNorm or LayerNorm
    q,k,v  = split(linear(h, W_qkv))                        # one GEMM for the three (GQA: fewer k, v heads)
    q,k    = rope(q, k, positions)                          # neox layout
    a      = linear(attention(q, k, v, causal), W_o)        # GQA: query head i reads kv head i // (H / H_kv)
    x      = x + a;  h = norm_2(x)                          # one fused kernel: add_rms_norm / add_layer_norm
    f      = linear(silu_and_mul(linear(h, W_13)), W_2)     # SwiGLU; or the MoE layer
    x      = x + f                                          # fused into the next block's norm_1 (or the final norm)

and the LM head: ``linear(norm_f(x), W_emb or W_lm_head)`` for logits, or, given targets, the fused
``optimized_ops.linear_cross_entropy`` (the ``(T, V)`` logits never exist).

What runs (every op has a CPU path in float32 and float64, except the MoE layer's, which takes float32 /
float16 / bfloat16 only):

===================  ===================================================  ============================================
step                 optimized                                            reference (plain PyTorch)
===================  ===================================================  ============================================
embedding            ``torch.nn.Embedding``                               the same
norms                ``optimized_ops.rms_norm`` / ``layer_norm``          ``F.rms_norm`` / ``F.layer_norm``
residual add + norm  ``optimized_ops.add_rms_norm`` / ``add_layer_norm``  ``x + residual``, then the norm
QKV, output, MLP     ``optimized_ops.linear`` (``nn.Linear`` modules)     ``F.linear``
RoPE                 ``optimized_ops.rope`` (neox)                        :func:`.reference.rope` (float32 math)
attention            ``optimized_ops.flash_attention(causal=True)``       ``F.scaled_dot_product_attention``
SwiGLU               ``optimized_ops.silu_and_mul``                       ``F.silu(gate) * up``
MoE                  ``optimized_ops.nn.MoE`` (``moe_layer``)             :func:`.reference.moe` (a loop over experts)
LM head + loss       ``optimized_ops.linear_cross_entropy``               ``F.linear`` + ``F.cross_entropy``
decode (KV cache)    ``append_kv`` (RoPE fused), ``paged_attention_*``    a static cache + SDPA with a mask
===================  ===================================================  ============================================

**The residual add is fused into the next norm**: the issue's "output projection with the residual add fused"
is met by ``add_rms_norm`` / ``add_layer_norm``, which take the output projection's result and the residual
stream and return ``(norm(x + a), x + a)`` in one pass (the next norm's read of the sum is the add's write:
no separate ``x + a`` kernel). The first block's first norm is a plain norm of the embeddings; the last
block's MLP output is added inside the final norm.

Both models have **the same parameter names and shapes** (``ref.load_state_dict(opt.state_dict())`` works
both ways) and the same initialization (GPT-2's, :meth:`Transformer.reset_parameters`, from torch's global
RNG): two models made after the same ``torch.manual_seed(s)`` are identical, whatever ``reference``,
``device`` or ``dtype``.

Parameters (``L`` layers, ``H`` / ``H_kv`` heads of ``D``, ``d`` wide, ``V`` tokens, ``F`` the MLP width)::

    tok_emb.weight                      (V, d)
    layers.{i}.attn_norm.weight         (d,)          (+ .bias with norm="layer", bias=True)
    layers.{i}.attn.qkv.weight          ((H + 2 H_kv) D, d)   rows [q heads | k heads | v heads]
    layers.{i}.attn.proj.weight         (d, H D)
    layers.{i}.ffn_norm.weight          (d,)
    layers.{i}.ffn.w13.weight           (2 F, d)      rows [gate | up]          (dense)
    layers.{i}.ffn.w2.weight            (d, F)                                  (dense)
    layers.{i}.ffn.router.weight        (E, d)                                  (MoE)
    layers.{i}.ffn.w13                  (E, d, 2 F_e) columns [gate | up]        (MoE)
    layers.{i}.ffn.w2                   (E, F_e, d)                              (MoE)
    norm.weight                         (d,)
    lm_head.weight                      (V, d)        (tie_embeddings=False only)

(``.bias`` beside every linear weight of attention and the dense MLP with ``bias=True``.)
"""

from __future__ import annotations

import math
from contextlib import nullcontext as _nullcontext
from typing import Optional, Union

import torch
import torch.nn.functional as F

from .. import nn as onn
from ..attention import flash_attention
from ..fused import add_layer_norm, add_rms_norm, layer_norm, rms_norm, silu_and_mul
from ..fused.linear_cross_entropy import linear_cross_entropy
from ..fused.rope import rope
from ..kv_cache import append_kv, paged_attention_decode, paged_attention_prefill
from ..linear import linear
from ..moe.layer import moe_layer
from . import reference as ref
from .cache import PagedDecodeCache, StaticDecodeCache
from .config import MoEConfig, TransformerConfig

__all__ = ["Transformer", "OptimizedTransformer"]

IGNORE_INDEX = -100


# ---- norms -----------------------------------------------------------------------------------------------------

def _make_norm(config: TransformerConfig, reference: bool) -> torch.nn.Module:
    if config.norm == "rms":
        cls = torch.nn.RMSNorm if reference else onn.RMSNorm
        return cls(config.d_model, eps=config.norm_eps)
    cls = torch.nn.LayerNorm if reference else onn.LayerNorm
    return cls(config.d_model, eps=config.norm_eps, bias=config.bias)


def _norm(norm: torch.nn.Module, delta: Optional[torch.Tensor], residual: torch.Tensor, reference: bool):
    """``(norm(residual + delta), residual + delta)``; ``delta`` None: ``(norm(residual), residual)``. The
    optimized model runs the add and the norm in one kernel (``add_rms_norm`` / ``add_layer_norm``); under
    autocast the residual stream keeps the parameters' dtype (a 16-bit ``delta`` is widened to it)."""
    shape = norm.normalized_shape
    layer = isinstance(norm, torch.nn.LayerNorm)
    if reference:
        h = residual if delta is None else delta + residual
        if layer:
            return F.layer_norm(h, shape, norm.weight, norm.bias, norm.eps), h
        return F.rms_norm(h, shape, norm.weight, norm.eps), h
    if delta is not None and delta.dtype != residual.dtype:
        delta = delta.to(residual.dtype)
    if delta is None:
        if layer:
            return layer_norm(residual, shape, norm.weight, norm.bias, norm.eps), residual
        return rms_norm(residual, shape, norm.weight, norm.eps), residual
    if layer:
        return add_layer_norm(delta, residual, shape, norm.weight, norm.bias, norm.eps)
    return add_rms_norm(delta, residual, shape, norm.weight, norm.eps)


def _amp(t: torch.Tensor, amp: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """``t`` in the autocast dtype ``amp`` (a differentiable cast; None: as it is)."""
    return t if (t is None or amp is None or t.dtype == amp) else t.to(amp)


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast gives matmuls on ``device`` now, or None outside autocast (and for device types
    autocast does not know, such as meta)."""
    try:
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    except RuntimeError:
        return None


def _no_autocast(device: torch.device):
    """A context with autocast off on ``device`` (nothing to turn off on device types autocast does not know)."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cpu", "cuda") else _nullcontext()


def _linear(x: torch.Tensor, layer: torch.nn.Linear, reference: bool, amp: Optional[torch.dtype] = None
            ) -> torch.Tensor:
    if reference:
        return F.linear(x, layer.weight, layer.bias)
    return linear(_amp(x, amp), _amp(layer.weight, amp), _amp(layer.bias, amp))


# ---- attention -------------------------------------------------------------------------------------------------

class Attention(torch.nn.Module):
    """Grouped-query self-attention with rotary embeddings: ``qkv`` (one projection for the q, k and v heads),
    RoPE (neox), causal attention, ``proj`` (the output projection; its residual add happens in the next
    norm)."""

    def __init__(self, config: TransformerConfig, reference: bool) -> None:
        super().__init__()
        self.reference = reference
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.rope_theta = float(config.rope_theta)
        cls = torch.nn.Linear if reference else onn.Linear
        self.qkv = cls(config.d_model, (config.n_heads + 2 * config.n_kv_heads) * config.head_dim, bias=config.bias)
        self.proj = cls(config.n_heads * config.head_dim, config.d_model, bias=config.bias)

    def _split(self, x: torch.Tensor, amp: Optional[torch.dtype] = None):
        b, s, _ = x.shape
        qkv = _linear(x, self.qkv, self.reference, amp)
        qkv = qkv.view(b, s, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        return qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)   # (B, S, H*, D) views

    def _out(self, o: torch.Tensor, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        b, s = o.shape[:2]
        return _linear(o.reshape(b, s, self.n_heads * self.head_dim), self.proj, self.reference, amp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        """``x`` ``(B, S, d)`` at ``positions`` ``(S,)`` or ``(B, S)`` -> ``(B, S, d)`` (causal over the S
        tokens); ``amp``: the optimized model's autocast dtype (its GEMMs and attention run in it)."""
        q, k, v = self._split(x, amp)
        if self.reference:
            q, k = ref.rope(q, positions, self.rope_theta), ref.rope(k, positions, self.rope_theta)
            return self._out(ref.causal_attention(q, k, v))
        q, k = rope(q, k, positions, theta=self.rope_theta, layout="neox")
        return self._out(flash_attention(q, k, v, causal=True), amp)

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, cache, layer: int,
                       seq_lens: Optional[torch.Tensor]) -> torch.Tensor:
        """The new tokens ``x`` ``(B, S, d)`` at ``positions`` ``(B, S)`` int32: appended to ``cache``'s layer
        ``layer``, then attended over everything cached (``seq_lens``: the paged cache's lengths)."""
        b, s, _ = x.shape
        q, k, v = self._split(x)
        if self.reference:
            q = ref.rope(q, positions.clamp(min=0), self.rope_theta)
            k = ref.rope(k, positions.clamp(min=0), self.rope_theta)
            cache.write(layer, k, v, positions)
            o = ref.cached_attention(q, cache.k[layer][:b], cache.v[layer][:b], positions, cache.max_len)
            return self._out(o)
        pages, table = cache.layers[layer], cache.page_table[:b]
        # k rotated on its way into the pages and q rotated in place, in one kernel. q is copied out of the qkv
        # buffer first: append_kv refuses a q whose memory span overlaps k's (a slice of the same rows does),
        # and the copy is the packed (B * S, H, D) rows the prefill's fast route on CUDA reads anyway.
        q = q.contiguous()
        append_kv(pages, k, v, table, positions, q=q, rope="neox", rope_theta=self.rope_theta,
                  validate=cache.validate)
        if s == 1:
            o = paged_attention_decode(q, pages, table, seq_lens, validate=cache.validate,
                                       plan=cache.plan(b, self.n_heads, q.dtype))
        else:
            o = paged_attention_prefill(q, pages, table, seq_lens, validate=cache.validate)
        return self._out(o)


# ---- feed-forward ----------------------------------------------------------------------------------------------

class SwiGLU(torch.nn.Module):
    """The dense MLP: ``w2(silu(gate) * up)`` with ``[gate | up] = w13(x)``."""

    def __init__(self, config: TransformerConfig, reference: bool) -> None:
        super().__init__()
        self.reference = reference
        cls = torch.nn.Linear if reference else onn.Linear
        self.w13 = cls(config.d_model, 2 * config.d_ff, bias=config.bias)
        self.w2 = cls(config.d_ff, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor, dropless: bool = False, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        if self.reference:
            return ref.swiglu(x, self.w13.weight, self.w13.bias, self.w2.weight, self.w2.bias)
        return _linear(silu_and_mul(_linear(x, self.w13, False, amp)), self.w2, False, amp)


def _capacity(module, dropless: bool) -> Optional[float]:
    """The capacity factor of a forward: the configured one in training mode, None (dropless) otherwise."""
    return None if (dropless or not module.training) else module.capacity_factor


class MoE(onn.MoE):
    """:class:`optimized_ops.nn.MoE` whose capacity (when configured) applies in training mode only: in eval
    mode, and in ``forward(x, dropless=True)``, every pair is computed. ``last_loss``: the balancing losses of
    the last forward (``last_metrics.loss``)."""

    def forward(self, input: torch.Tensor, dropless: bool = False, amp: Optional[torch.dtype] = None
                ) -> torch.Tensor:
        """``input`` ``(*, d_model)`` -> its shape; ``amp``: the autocast dtype of the experts' GEMMs (the
        router stays in float32)."""
        input = _amp(input, amp)
        if input.dtype == torch.float64:
            raise NotImplementedError(
                "optimized_ops.models: the MoE layers (optimized_ops.moe_layer: moe_gather, grouped_mm) take "
                "float32, float16 or bfloat16; given float64 (the library has no float64 MoE path: use float32, or "
                "the torch reference, Transformer(config, reference=True))")
        out, self.last_metrics = moe_layer(
            input, self.router.weight, _amp(self.w13, amp), _amp(self.w2, amp), self.top_k,
            capacity_factor=_capacity(self, dropless),
            scoring=self.scoring, normalize=self.normalize, aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef, variant=self.variant)
        return out

    @property
    def last_loss(self) -> Optional[torch.Tensor]:
        return None if self.last_metrics is None else self.last_metrics.loss


class ReferenceMoE(torch.nn.Module):
    """The MoE layer in plain torch (:func:`optimized_ops.models.reference.moe`), with
    :class:`optimized_ops.nn.MoE`'s parameters (``router.weight``, ``w13``, ``w2``) and attributes.

    Attributes
    ----------
    last_loss : torch.Tensor or None
        The weighted balancing losses of the last forward.
    last_topk_ids : torch.Tensor or None
        ``(T, k)`` int64: the experts the last forward chose, best first (for tests: the routing to compare).
    forced_topk_ids : torch.Tensor or None
        Set (``(T, k)``), the experts every forward uses instead of its own top k (for tests: the routing of the
        implementation under test, where 16-bit rounding can flip near ties); None (the default): its own.
    """

    def __init__(self, d_model: int, d_ff: int, moe: MoEConfig) -> None:
        super().__init__()
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, moe.num_experts, moe.top_k
        self.capacity_factor, self.scoring, self.normalize = moe.capacity_factor, moe.scoring, moe.normalize
        self.aux_loss_coef, self.z_loss_coef = float(moe.aux_loss_coef), float(moe.z_loss_coef)
        self.router = torch.nn.Linear(d_model, moe.num_experts, bias=False)
        self.w13 = torch.nn.Parameter(torch.empty(moe.num_experts, d_model, 2 * d_ff))
        self.w2 = torch.nn.Parameter(torch.empty(moe.num_experts, d_ff, d_model))
        self.last_loss: Optional[torch.Tensor] = None
        self.last_topk_ids: Optional[torch.Tensor] = None
        self.forced_topk_ids: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, dropless: bool = False, amp: Optional[torch.dtype] = None) -> torch.Tensor:
        normalize = self.top_k > 1 if self.normalize is None else self.normalize
        out, self.last_loss, self.last_topk_ids = ref.moe(
            x, self.router.weight, self.w13, self.w2, self.top_k, scoring=self.scoring, normalize=normalize,
            capacity_factor=_capacity(self, dropless), aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef, topk_ids=self.forced_topk_ids)
        return out

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, top_k={self.top_k}"


def _make_ffn(config: TransformerConfig, reference: bool) -> torch.nn.Module:
    if config.moe is None:
        return SwiGLU(config, reference)
    m = config.moe
    if reference:
        return ReferenceMoE(config.d_model, config.expert_d_ff, m)
    return MoE(config.d_model, config.expert_d_ff, m.num_experts, m.top_k, capacity_factor=m.capacity_factor,
               aux_loss_coef=m.aux_loss_coef, z_loss_coef=m.z_loss_coef, scoring=m.scoring, normalize=m.normalize)


class Block(torch.nn.Module):
    """One pre-norm block's modules: ``attn_norm``, ``attn``, ``ffn_norm``, ``ffn``. The residual adds run
    inside the norms (:class:`Transformer`'s loop), so the block has no forward of its own."""

    def __init__(self, config: TransformerConfig, reference: bool) -> None:
        super().__init__()
        self.attn_norm = _make_norm(config, reference)
        self.attn = Attention(config, reference)
        self.ffn_norm = _make_norm(config, reference)
        self.ffn = _make_ffn(config, reference)


# ---- the model -------------------------------------------------------------------------------------------------

def _is_int_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and not t.dtype.is_complex \
        and t.dtype != torch.bool


class Transformer(torch.nn.Module):
    """A decoder-only transformer LM (the module docstring's architecture) on the library's ops, or, with
    ``reference=True``, the same model in plain PyTorch.

    Parameters
    ----------
    config : TransformerConfig
        The shape.
    reference : bool, keyword-only
        Build the plain-PyTorch model (``torch.nn.functional``; same parameters, same initialization).
    device, dtype : optional, keyword-only
        Of the parameters (default: torch's default device, float32). ``device="meta"`` makes the model
        without memory or initialization (to count parameters).

    Attributes
    ----------
    config : TransformerConfig
    reference : bool
    last_aux_loss : torch.Tensor or None
        With MoE layers: the sum over the layers of their weighted balancing losses (``aux_loss_coef * aux +
        z_loss_coef * z``) in the last forward; None for a dense model. ``forward(tokens, targets)`` adds it
        to the returned loss.

    Notes
    -----
    No dropout. The sequence dimension is causal by index: token ``s`` attends to tokens ``0 .. s`` of its row;
    ``positions`` only set the rotary angles. Inputs longer than ``config.max_seq_len`` are refused.

    *Mixed precision.* Parameters in bfloat16 / float16 run every op in that dtype. Under ``torch.autocast``
    (float32 parameters), the reference is autocast's as usual; the library's ops know no autocast, so the
    optimized model casts the operands of its GEMMs, attention, experts and LM head to the autocast dtype itself
    and keeps the embedding, the norms and the residual stream in the parameters' dtype, as autocast does for
    torch's ops (the gradients reach the float32 parameters through the casts). Two differences remain: the
    optimized loss comes back in the autocast dtype (``linear_cross_entropy`` returns its inputs' dtype; its
    per-row losses are float32 inside), and the MoE router reads the 16-bit copy of its input that the experts
    read (``moe_layer`` takes one ``x``; the logits are still float32).

    *Decoding.* :meth:`make_cache` and :meth:`forward_cached` run the model over a KV cache (prefill, decode):
    :func:`optimized_ops.models.generate` is the loop around them.

    Examples
    --------
    >>> cfg = TransformerConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=97, max_seq_len=32)
    >>> torch.manual_seed(0); model = Transformer(cfg)
    >>> torch.manual_seed(0); twin = Transformer(cfg, reference=True)
    >>> tokens = torch.randint(0, 97, (3, 13))
    >>> model(tokens).shape
    torch.Size([3, 13, 97])
    >>> loss = model(tokens[:, :-1], tokens[:, 1:])   # the mean next-token loss, fused LM head
    """

    def __init__(self, config: TransformerConfig, *, reference: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"Transformer: config: expected an optimized_ops.models.TransformerConfig; given "
                            f"{type(config).__name__}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"Transformer: dtype: expected None or a floating torch.dtype; given {dtype!r}")
        self.config = config
        self.reference = bool(reference)
        self.last_aux_loss: Optional[torch.Tensor] = None
        # The modules are made on the meta device (no memory, no draw from any RNG), then given memory and
        # initialized by reset_parameters: the same draws for both kinds of model, on any device.
        with torch.device("meta"):
            self.tok_emb = torch.nn.Embedding(config.vocab_size, config.d_model)
            self.layers = torch.nn.ModuleList([Block(config, self.reference) for _ in range(config.n_layers)])
            self.norm = _make_norm(config, self.reference)
            if not config.tie_embeddings:
                cls = torch.nn.Linear if self.reference else onn.Linear
                self.lm_head = cls(config.d_model, config.vocab_size, bias=False)
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.to_empty(device=device)
        if dtype is not None:
            self.to(dtype)
        if device.type != "meta":
            self.reset_parameters()

    # ---- parameters ----

    def _init_std(self, name: str) -> Optional[float]:
        """The standard deviation of parameter ``name``; None: a norm or bias parameter (ones / zeros)."""
        owner, _, leaf = name.rpartition(".")
        if owner.endswith("norm") or leaf == "bias":
            return None
        std = self.config.init_std
        if name.endswith(("attn.proj.weight", "ffn.w2.weight", "ffn.w2")):   # the residual projections
            return std / math.sqrt(2 * self.config.n_layers)
        return std

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialization, drawn from torch's global (CPU) RNG in float32, in the order of the sorted
        parameter names, then copied to each parameter's device and dtype: normal with std ``init_std`` (0.02)
        for the embedding, the projections, the LM head, the router and the experts; ``init_std /
        sqrt(2 n_layers)`` for the projections that end in the residual stream (the attention output
        projection, the MLP's and the experts' down projection); norm weights 1; biases 0."""
        for name, p in sorted(self.named_parameters(), key=lambda item: item[0]):
            std = self._init_std(name)
            if std is None:
                owner, _, leaf = name.rpartition(".")
                p.fill_(1.0 if owner.endswith("norm") and leaf == "weight" else 0.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std))

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's ``(V, d)`` weight: ``tok_emb.weight`` when tied, else ``lm_head.weight``."""
        return self.tok_emb.weight if self.config.tie_embeddings else self.lm_head.weight

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameters (a tied weight counted once); ``exclude_embeddings``: without the token embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.tok_emb.weight.numel() if exclude_embeddings else n

    # ---- forward ----

    def _check(self, fn: str, tokens, targets=None, positions=None) -> None:
        if not (_is_int_tensor(tokens) and tokens.dim() == 2 and tokens.shape[0] >= 1 and tokens.shape[1] >= 1):
            given = f"{tokens.dtype} shape {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) \
                else type(tokens).__name__
            raise ValueError(f"Transformer.{fn}: tokens: expected an integer tensor (B, S) with B, S >= 1; "
                             f"given {given}")
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"Transformer.{fn}: tokens: expected at most max_seq_len = {self.config.max_seq_len} "
                             f"tokens per sequence; given {tokens.shape[1]}")
        if targets is not None and not (_is_int_tensor(targets) and targets.shape == tokens.shape):
            given = f"{targets.dtype} shape {list(targets.shape)}" if isinstance(targets, torch.Tensor) \
                else type(targets).__name__
            raise ValueError(f"Transformer.{fn}: targets: expected an integer tensor of tokens' shape "
                             f"{list(tokens.shape)}; given {given}")
        if positions is not None:
            ok = _is_int_tensor(positions) and (positions.shape == tokens.shape or
                                                (positions.dim() == 1 and positions.shape[0] == tokens.shape[1]))
            if not ok:
                given = f"{positions.dtype} shape {list(positions.shape)}" if isinstance(positions, torch.Tensor) \
                    else type(positions).__name__
                raise ValueError(f"Transformer.{fn}: positions: expected an integer tensor (S,) or (B, S) = "
                                 f"{list(tokens.shape)}; given {given}")

    def _trunk(self, tokens: torch.Tensor, positions: torch.Tensor, *, cache=None,
               seq_lens: Optional[torch.Tensor] = None, dropless: bool = False, last_only: bool = False,
               amp: Optional[torch.dtype] = None):
        """The blocks and the final norm: ``(B, S, d)`` (``(B, d)`` with ``last_only``); ``amp``: the
        optimized model's autocast dtype."""
        reference = self.reference
        residual, delta = self.tok_emb(tokens), None
        losses = []
        for i, block in enumerate(self.layers):
            x, residual = _norm(block.attn_norm, delta, residual, reference)
            if cache is None:
                delta = block.attn(x, positions, amp)
            else:
                delta = block.attn.forward_cached(x, positions, cache, i, seq_lens)
            x, residual = _norm(block.ffn_norm, delta, residual, reference)   # the attention's residual add
            delta = block.ffn(x, dropless=dropless, amp=amp)
            if self.config.moe is not None:
                losses.append(block.ffn.last_loss)
        self.last_aux_loss = sum(losses[1:], losses[0]) if losses else None
        if last_only:
            delta, residual = delta[:, -1], residual[:, -1]
        x, _ = _norm(self.norm, delta, residual, reference)                   # the last MLP's residual add
        return x

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits, or the mean next-token loss.

        Parameters
        ----------
        tokens : torch.LongTensor
            ``(B, S)`` token ids in ``[0, vocab_size)``, ``S <= max_seq_len`` (any integer dtype).
        targets : torch.LongTensor, optional
            ``(B, S)``: the token that should follow each of ``tokens`` (the caller shifts: ``model(t[:, :-1],
            t[:, 1:])``); ``-100`` marks a position without a loss.
        positions : torch.Tensor, optional, keyword-only
            ``(S,)`` or ``(B, S)`` integer positions for RoPE; default ``arange(S)``.

        Returns
        -------
        torch.Tensor
            Without targets, the logits ``(B, S, vocab_size)`` in the model's dtype. With targets, the 0-D mean
            cross-entropy over the positions whose target is not -100 (NaN if there is none), plus, with MoE
            layers, :attr:`last_aux_loss`: the optimized model's LM head and loss are
            ``optimized_ops.linear_cross_entropy`` (the ``(B S, V)`` logits never exist in memory).

        Raises
        ------
        ValueError
            ``tokens``, ``targets`` or ``positions`` not as above (the message names the argument).
        """
        self._check("forward", tokens, targets, positions)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        if self.reference:  # autocast, where on, applies to torch's ops itself
            h = self._trunk(tokens, positions)
            logits = F.linear(h, self.lm_head_weight())
            if targets is None:
                return logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(),
                                   ignore_index=IGNORE_INDEX)
        else:
            # The library's ops know no autocast: under it, the model casts the operands of its GEMMs, attention
            # and LM head to the autocast dtype itself (the norms and the residual stream keep the parameters'
            # dtype, as torch's autocast does), with torch's autocast off inside (the MoE router stays float32).
            amp = _autocast_dtype(tokens.device)
            with _no_autocast(tokens.device) if amp is not None else _nullcontext():
                h = self._trunk(tokens, positions, amp=amp)
                weight = _amp(self.lm_head_weight(), amp)
                h = _amp(h, amp)
                if targets is None:
                    return linear(h, weight)
                loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1),
                                            ignore_index=IGNORE_INDEX)
        if self.last_aux_loss is not None:
            loss = loss + self.last_aux_loss.to(loss.dtype)
        return loss

    # ---- decoding with a KV cache ----

    def make_cache(self, batch_size: int, max_len: Optional[int] = None, *, page_size: int = 16,
                   validate: Optional[bool] = None) -> Union[PagedDecodeCache, StaticDecodeCache]:
        """A KV cache for :meth:`forward_cached`, on the model's device and dtype.

        Parameters
        ----------
        batch_size : int
            Sequences it holds.
        max_len : int, optional
            Tokens per sequence (prompt and generated); default ``config.max_seq_len``.
        page_size : int, keyword-only
            Tokens per page of the optimized model's :class:`PagedDecodeCache` (1 to 256; ignored by the
            reference's :class:`StaticDecodeCache`).
        validate : bool, optional, keyword-only
            The paged cache's ``validate`` (None: on the CPU only).

        Returns
        -------
        PagedDecodeCache or StaticDecodeCache
            Paged for the optimized model, static for the reference.
        """
        c = self.config
        max_len = c.max_seq_len if max_len is None else max_len
        if not (isinstance(max_len, int) and 1 <= max_len <= c.max_seq_len):
            raise ValueError(f"Transformer.make_cache: max_len: expected an int 1 <= max_len <= max_seq_len = "
                             f"{c.max_seq_len}; given {max_len!r}")
        kw = dict(batch_size=batch_size, max_len=max_len, dtype=self.dtype, device=self.device)
        if self.reference:
            return StaticDecodeCache(c.n_layers, c.n_kv_heads, c.head_dim, **kw)
        return PagedDecodeCache(c.n_layers, c.n_kv_heads, c.head_dim, page_size=page_size, validate=validate, **kw)

    def forward_cached(self, tokens: torch.Tensor, positions: torch.Tensor, cache, *,
                       all_logits: bool = False) -> torch.Tensor:
        """New tokens through the model with a KV cache (prefill or decode; inference only, no autograd).

        Each layer writes the new tokens' keys and values into ``cache`` (RoPE applied; the optimized model
        fuses the rotation into :func:`optimized_ops.append_kv`) and attends over everything cached:
        :func:`optimized_ops.paged_attention_prefill` for ``S > 1`` new tokens per sequence,
        :func:`optimized_ops.paged_attention_decode` for ``S == 1`` (with the cache's decode plan on CUDA). The
        MoE layers run dropless. Graph-safe (no host synchronisation, no shape that depends on data) when the
        cache's ``validate`` is off, as :func:`optimized_ops.models.generate` uses it.

        Parameters
        ----------
        tokens : torch.LongTensor
            ``(B, S)``: the new tokens of sequences ``0 .. B - 1`` of the cache (``B <= cache.batch_size``).
        positions : torch.Tensor
            ``(B, S)`` integers: each token's position in its sequence, consecutive and **right-aligned**
            (each row ends at its sequence's last token; the sequence's length after this call is the last
            position + 1). A negative position marks padding at the front of a row (prompts of different
            lengths): nothing is written, and its output is garbage (finite) to be ignored. A row of only
            padding holds a sequence of length 0.
        cache : PagedDecodeCache or StaticDecodeCache
            From :meth:`make_cache` of this model (of this kind).
        all_logits : bool, keyword-only
            Return the logits of every new token instead of the last.

        Returns
        -------
        torch.Tensor
            ``(B, vocab_size)``: the logits of each row's last token (the next token's distribution); with
            ``all_logits``, ``(B, S, vocab_size)``.

        Raises
        ------
        ValueError
            ``tokens`` or ``positions`` not as above; more rows than the cache holds.
        TypeError
            A cache of the other kind.
        """
        self._check("forward_cached", tokens)
        want = StaticDecodeCache if self.reference else PagedDecodeCache
        if not isinstance(cache, want):
            raise TypeError(f"Transformer.forward_cached: cache: expected a {want.__name__} "
                            f"(make_cache of this {'reference' if self.reference else 'optimized'} model); given "
                            f"{type(cache).__name__}")
        if tokens.shape[0] > cache.batch_size:
            raise ValueError(f"Transformer.forward_cached: tokens: expected at most the cache's batch_size = "
                             f"{cache.batch_size} rows; given {tokens.shape[0]}")
        if not (_is_int_tensor(positions) and positions.shape == tokens.shape):
            given = f"{positions.dtype} shape {list(positions.shape)}" if isinstance(positions, torch.Tensor) \
                else type(positions).__name__
            raise ValueError(f"Transformer.forward_cached: positions: expected an integer tensor of tokens' shape "
                             f"{list(tokens.shape)}; given {given}")
        with torch.no_grad(), _no_autocast(tokens.device):
            positions = positions.to(torch.int32)
            seq_lens = None if self.reference else (positions[:, -1] + 1).clamp(min=0)
            h = self._trunk(tokens, positions, cache=cache, seq_lens=seq_lens, dropless=True,
                            last_only=not all_logits)
            weight = self.lm_head_weight()
            return F.linear(h, weight) if self.reference else linear(h, weight)

    def extra_repr(self) -> str:
        c = self.config
        kind = "reference (plain PyTorch)" if self.reference else "optimized"
        return (f"{kind}, d_model={c.d_model}, n_heads={c.n_heads}, n_kv_heads={c.n_kv_heads}, "
                f"n_layers={c.n_layers}, d_ff={c.d_ff}, vocab_size={c.vocab_size}, norm={c.norm!r}, "
                f"tie_embeddings={c.tie_embeddings}, moe={c.moe}")


class OptimizedTransformer(Transformer):
    """:class:`Transformer` from keyword arguments: ``OptimizedTransformer(d_model=768, n_heads=12, ...)`` is
    ``Transformer(TransformerConfig(d_model=768, n_heads=12, ...))`` (GPT-2 small's shape by default).

    Parameters
    ----------
    d_model, n_heads, n_layers, vocab_size, max_seq_len : int
        As :class:`TransformerConfig` (defaults 768, 12, 12, 50257, 1024).
    reference, device, dtype : keyword-only
        As :class:`Transformer`.
    **config
        Any other :class:`TransformerConfig` field (``n_kv_heads``, ``d_ff``, ``norm``, ``moe``, ...).

    Raises
    ------
    TypeError
        A keyword that is no field of :class:`TransformerConfig` (named).
    ValueError
        A field out of range, as :class:`TransformerConfig`.

    Examples
    --------
    >>> model = OptimizedTransformer(d_model=768, n_heads=12, n_layers=12, device="meta")
    >>> model.num_parameters()
    123551232
    """

    def __init__(self, d_model: int = 768, n_heads: int = 12, n_layers: int = 12, vocab_size: int = 50257,
                 max_seq_len: int = 1024, *, reference: bool = False, device=None,
                 dtype: Optional[torch.dtype] = None, **config) -> None:
        fields = set(TransformerConfig.__dataclass_fields__)
        unknown = sorted(set(config) - fields)
        if unknown:
            raise TypeError(f"OptimizedTransformer: {unknown[0]}: not a TransformerConfig field (fields: "
                            f"{', '.join(sorted(fields))}, and reference, device, dtype)")
        cfg = TransformerConfig(d_model=d_model, n_heads=n_heads, n_layers=n_layers, vocab_size=vocab_size,
                                max_seq_len=max_seq_len, **config)
        super().__init__(cfg, reference=reference, device=device, dtype=dtype)
