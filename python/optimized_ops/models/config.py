"""The configuration of :class:`optimized_ops.models.Transformer`: :class:`TransformerConfig` (the shape of the
decoder-only model) and :class:`MoEConfig` (its Mixture-of-Experts feed-forward layers, when it has them).

Both are dataclasses that check themselves when made (``__post_init__``): a bad field raises a ValueError (a
TypeError for ``moe`` of another type) whose message names the class, the field, what was expected and what
was given, e.g. ``TransformerConfig: n_kv_heads: expected an int that divides n_heads = 12; given 5``.

>>> cfg = TransformerConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=97, max_seq_len=32)
>>> cfg.head_dim, cfg.d_ff
(16, 192)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

__all__ = ["MoEConfig", "TransformerConfig", "swiglu_hidden_dim"]

_NORMS = ("rms", "layer")
_SCORINGS = ("softmax", "sigmoid")


def swiglu_hidden_dim(d_model: int, multiple_of: int = 64) -> int:
    """The default ``d_ff`` of a SwiGLU MLP: ``8/3 * d_model`` (the width that gives the three SwiGLU
    matrices the parameters of a 4x GELU MLP's two), rounded **up** to a multiple of ``multiple_of``
    (LLaMA's rule; 16-byte aligned rows and whole GEMM tiles).

    Parameters
    ----------
    d_model : int
        The model width.
    multiple_of : int
        The rounding unit; default 64.

    Returns
    -------
    int
        ``multiple_of * ceil(8 * d_model / (3 * multiple_of))``: 2048 for d_model 768, 192 for 64, 10944 for
        4096.
    """
    return multiple_of * math.ceil(8 * d_model / (3 * multiple_of))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _error(cls: str, field: str, expected: str, given: Any) -> ValueError:
    return ValueError(f"{cls}: {field}: expected {expected}; given {given!r}")


@dataclasses.dataclass
class MoEConfig:
    """The Mixture-of-Experts feed-forward layers of a :class:`TransformerConfig` (every block's MLP becomes
    an :class:`optimized_ops.nn.MoE`: a top-k router over SwiGLU experts).

    Parameters
    ----------
    num_experts : int
        E, 1 to 1024.
    top_k : int
        Experts per token, ``1 <= top_k <= min(num_experts, 32)``.
    d_ff : int, optional
        Each expert's hidden width; None: the model's ``d_ff`` (every expert the size of the dense MLP, as
        Mixtral).
    capacity_factor : float, optional
        None (dropless, the default) or each expert's capacity ``ceil(capacity_factor * T * top_k / E)``
        pairs of the ``T`` tokens of a forward (:func:`optimized_ops.moe_layer`). Applied in training mode
        only: in eval mode and in generation the layers run dropless (what a token gets then never depends
        on the other tokens of the batch).
    scoring : str
        ``"softmax"`` (over the E logits, then the top k) or ``"sigmoid"`` (of each logit, then the top k).
    normalize : bool, optional
        Divide each token's k weights by their sum; None: for ``top_k > 1``.
    aux_loss_coef, z_loss_coef : float
        The weights of the load-balancing loss and the router z-loss that the model adds to the task loss
        (``>= 0``; 0 turns a loss off).
    """

    num_experts: int
    top_k: int
    d_ff: Optional[int] = None
    capacity_factor: Optional[float] = None
    scoring: str = "softmax"
    normalize: Optional[bool] = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        c = "MoEConfig"
        if not (_is_int(self.num_experts) and 1 <= self.num_experts <= 1024):
            raise _error(c, "num_experts", "an int 1 <= E <= 1024", self.num_experts)
        k_max = min(self.num_experts, 32)
        if not (_is_int(self.top_k) and 1 <= self.top_k <= k_max):
            raise _error(c, "top_k", f"an int 1 <= k <= min(num_experts, 32) = {k_max}", self.top_k)
        if self.d_ff is not None and not (_is_int(self.d_ff) and self.d_ff >= 1):
            raise _error(c, "d_ff", "None or an int >= 1", self.d_ff)
        if self.capacity_factor is not None and not (_is_number(self.capacity_factor) and self.capacity_factor > 0):
            raise _error(c, "capacity_factor", "None or a finite number > 0", self.capacity_factor)
        if self.scoring not in _SCORINGS:
            raise _error(c, "scoring", f"one of {', '.join(_SCORINGS)}", self.scoring)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise _error(c, "normalize", "None or a bool", self.normalize)
        for name in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            if not (_is_number(v) and v >= 0):
                raise _error(c, name, "a finite number >= 0", v)

    @property
    def normalize_weights(self) -> bool:
        """Whether each token's k weights are divided by their sum (``normalize``, resolved for None)."""
        return self.top_k > 1 if self.normalize is None else self.normalize


@dataclasses.dataclass
class TransformerConfig:
    """The shape of a decoder-only transformer (:class:`optimized_ops.models.Transformer`): pre-norm blocks of
    grouped-query attention with rotary embeddings and a SwiGLU MLP (or a Mixture of Experts), a final norm
    and an LM head. The defaults are GPT-2 small's shape (124M parameters with tied embeddings).

    Parameters
    ----------
    d_model : int
        The model width; a multiple of ``n_heads`` whose head dim ``d_model / n_heads`` is even (RoPE rotates
        pairs). The CUDA attention kernels take head dims that are multiples of 8 up to 256; the CPU any.
    n_heads : int
        Query heads.
    n_layers : int
        Blocks, >= 1.
    vocab_size : int
        Tokens, >= 1.
    max_seq_len : int
        The longest sequence the model takes (tokens of a forward; prompt plus new tokens in generation).
    n_kv_heads : int, optional
        Key/value heads: None (the default) means ``n_heads`` (multi-head attention); fewer is grouped-query
        attention (1: multi-query); must divide ``n_heads``. Resolved to an int when the config is made.
    d_ff : int, optional
        The MLP's hidden width; None: :func:`swiglu_hidden_dim` ``(d_model)``, i.e. ``8/3 * d_model`` rounded
        up to a multiple of 64 (2048 for 768). Resolved to an int when the config is made.
    norm : str
        ``"rms"`` (RMSNorm, the default) or ``"layer"`` (LayerNorm).
    norm_eps : float
        The norms' epsilon, ``>= 0``; default 1e-5.
    rope_theta : float
        RoPE's base, ``> 0``; default 10000 (neox layout: pairs ``(x[i], x[i + head_dim / 2])``).
    tie_embeddings : bool
        The LM head reuses the token embedding's weight (GPT-2); default True.
    bias : bool
        Biases on the linear layers of attention and the dense MLP, and on LayerNorm; default False (the
        LM head and the MoE experts never have one).
    moe : MoEConfig, optional
        None (a dense SwiGLU MLP in every block) or the experts that replace it (a dict is converted).
    init_std : float
        The standard deviation of the GPT-2 initialization (``> 0``; default 0.02).

    Raises
    ------
    ValueError
        A field out of its range; the message names the field and the value given.
    TypeError
        ``moe`` neither None, a :class:`MoEConfig` nor a dict.
    """

    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    vocab_size: int = 50257
    max_seq_len: int = 1024
    n_kv_heads: Optional[int] = None
    d_ff: Optional[int] = None
    norm: str = "rms"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    bias: bool = False
    moe: Optional[MoEConfig] = None
    init_std: float = 0.02

    def __post_init__(self) -> None:
        c = "TransformerConfig"
        for name in ("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len"):
            v = getattr(self, name)
            if not (_is_int(v) and v >= 1):
                raise _error(c, name, "an int >= 1", v)
        if self.d_model % self.n_heads:
            raise _error(c, "d_model", f"a multiple of n_heads = {self.n_heads}", self.d_model)
        if (self.d_model // self.n_heads) % 2:
            raise _error(c, "d_model", f"an even head dim d_model / n_heads (RoPE rotates pairs); the head dim is "
                                       f"{self.d_model // self.n_heads} with n_heads = {self.n_heads}", self.d_model)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if not (_is_int(self.n_kv_heads) and 1 <= self.n_kv_heads <= self.n_heads
                and self.n_heads % self.n_kv_heads == 0):
            raise _error(c, "n_kv_heads", f"None or an int that divides n_heads = {self.n_heads}", self.n_kv_heads)
        if self.d_ff is None:
            self.d_ff = swiglu_hidden_dim(self.d_model)
        if not (_is_int(self.d_ff) and self.d_ff >= 1):
            raise _error(c, "d_ff", "None or an int >= 1", self.d_ff)
        if self.norm not in _NORMS:
            raise _error(c, "norm", f"one of {', '.join(repr(n) for n in _NORMS)}", self.norm)
        if not (_is_number(self.norm_eps) and self.norm_eps >= 0):
            raise _error(c, "norm_eps", "a finite number >= 0", self.norm_eps)
        if not (_is_number(self.rope_theta) and self.rope_theta > 0):
            raise _error(c, "rope_theta", "a finite number > 0", self.rope_theta)
        for name in ("tie_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise _error(c, name, "a bool", getattr(self, name))
        if isinstance(self.moe, dict):
            self.moe = MoEConfig(**self.moe)
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"{c}: moe: expected None, an optimized_ops.models.MoEConfig or a dict of its fields; "
                            f"given {type(self.moe).__name__}")
        if not (_is_number(self.init_std) and self.init_std > 0):
            raise _error(c, "init_std", "a finite number > 0", self.init_std)

    @property
    def head_dim(self) -> int:
        """``d_model // n_heads``."""
        return self.d_model // self.n_heads

    @property
    def expert_d_ff(self) -> Optional[int]:
        """Each expert's hidden width (``moe.d_ff`` or ``d_ff``); None without experts."""
        if self.moe is None:
            return None
        return self.d_ff if self.moe.d_ff is None else self.moe.d_ff

    def to_dict(self) -> dict:
        """The fields as plain Python values (``moe`` as a dict): for checkpoints and logs;
        ``TransformerConfig(**d)`` makes the config again."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Union[dict, "TransformerConfig"]) -> "TransformerConfig":
        """The config of :meth:`to_dict`'s dict (or a config, returned as is)."""
        return d if isinstance(d, cls) else cls(**d)
