"""Training a language model from token shards on local storage: ``train_from_nvme(model, path, config)``.

Three pieces, usable apart:

* :func:`synthetic_corpus` -- a deterministic, text-like token stream with learnable structure (a
  sparse second-order Markov chain over a Zipf vocabulary, in documents separated by token 0), so
  that examples and tests need no download and their loss curves fall;
* :func:`write_token_shards` -- a 1-D token stream (any corpus, tokenized) written as a dataset of
  the streaming loader's format (:mod:`optimized_ops.data`): records of ``seq_len + 1`` tokens, the
  inputs and the targets shifted by one;
* :func:`train_from_nvme` -- the training loop: :class:`optimized_ops.data.StreamingLoader` feeds
  batches to the device (read ahead, on CUDA copied on the loader's own stream), bf16 autocast on
  CUDA, AdamW (fused on CUDA), gradient accumulation, gradient clipping, warm-up then cosine (or
  linear) decay, and checkpoints that resume exactly: the model, the optimizer, the step, the RNG
  states and the loader's position are saved, so a run stopped and resumed gives the loss curve of
  a run that did not stop (bit for bit on the CPU).

>>> import tempfile, torch
>>> from optimized_ops.models.training import synthetic_corpus, write_token_shards
>>> tokens = synthetic_corpus(10_000, vocab_size=256, seed=0)
>>> info = write_token_shards(tempfile.mkdtemp() + "/tokens", tokens, seq_len=64)
>>> (info.num_records, info.record_shape, info.dtype)
(156, (65,), 'uint16')

The model is anything with the ``optimized_ops.models.Transformer`` contract:
``model(tokens, targets)`` with ``tokens`` and ``targets`` of shape (B, S), int64, returns the
scalar mean cross-entropy (``ignore_index=-100``); a model that returns logits (B, S, V) instead is
accepted too (the loop takes the cross-entropy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import random
import re
import time
import warnings
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import data

__all__ = ["TrainConfig", "TrainResult", "train_from_nvme", "write_token_shards", "synthetic_corpus",
           "lr_at", "latest_checkpoint"]

_CHECKPOINT_FORMAT = "optimized_ops.models.training/1"
_CHECKPOINT_RE = re.compile(r"^step_(\d+)\.pt$")


# ---- argument checks ------------------------------------------------------------------------------

def _int_field(name: str, value, minimum: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an int; given {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}; given {value}")
    return value


def _float_field(name: str, value, minimum: float | None = None, allow_none: bool = False,
                 strict: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: expected a number; given {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number; given {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name}: expected {'>' if strict else '>='} {minimum}; given {value}")
    return value


def _choice_field(name: str, value, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}; given {value!r}")
    return value


# ---- the corpus -----------------------------------------------------------------------------------

def synthetic_corpus(num_tokens: int, vocab_size: int, seed: int = 0, *, branching: int = 4,
                     doc_len: tuple[int, int] = (64, 512), dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A deterministic, text-like token stream with structure a small model learns in a few steps.

    The process (all of it drawn from ``numpy.random.default_rng(seed)``):

    * token 0 is the end of a document; documents have a length drawn uniformly from ``doc_len``;
    * the other ``vocab_size - 1`` tokens have Zipf frequencies (``p ~ 1 / (rank + 2.7)^1.1``) over a
      random permutation of the ids, as words in text do;
    * each token ``a`` has a pool of ``2 * branching`` successors drawn from those frequencies; the
      next token after ``(b, a)`` is drawn from ``a``'s pool with weights that depend on the pair: a
      row, chosen by a hash of ``(b, a)``, of 4096 rows of Dirichlet(0.25) weights.

    So a unigram model, a bigram model (which knows ``a``'s pool) and a trigram model (which also
    knows the weights for ``(b, a)``) reach successively lower losses. Measured on 2M tokens with
    ``vocab_size=256``: unigram entropy 4.29 nats (ln 256 = 5.55 is where an untrained model starts),
    bigram 1.68, trigram 1.16 (the floor, up to the document ends). With ``vocab_size=50257``:
    unigram 5.81, bigram 1.59.

    Documents are generated 256 at a time, so ``synthetic_corpus(n, ...)`` is a prefix of
    ``synthetic_corpus(m, ...)`` for ``n < m`` (same vocabulary, seed and options). About a million
    tokens take 0.2 s.

    Parameters
    ----------
    num_tokens : int
        Length of the stream (>= 1).
    vocab_size : int
        Tokens are in ``[0, vocab_size)``; >= 2.
    seed : int
        Fixes the chain and the stream.
    branching : int
        Half the number of successors of a token (>= 1).
    doc_len : (int, int)
        Smallest and largest document length in tokens (1 <= low <= high).
    dtype : torch.dtype
        An integer dtype of the result that holds ``vocab_size - 1``.

    Returns
    -------
    torch.Tensor
        1-D, ``num_tokens`` long, on the CPU.
    """
    num_tokens = _int_field("num_tokens", num_tokens, 1)
    vocab_size = _int_field("vocab_size", vocab_size, 2)
    seed = _int_field("seed", seed, 0)
    branching = _int_field("branching", branching, 1)
    if not (isinstance(doc_len, (tuple, list)) and len(doc_len) == 2):
        raise ValueError(f"doc_len: expected (low, high); given {doc_len!r}")
    low = _int_field("doc_len[0]", doc_len[0], 1)
    high = _int_field("doc_len[1]", doc_len[1], low)
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"dtype: expected an integer dtype; given {dtype}")
    if vocab_size - 1 > torch.iinfo(dtype).max:
        raise ValueError(f"dtype: {dtype} cannot hold token {vocab_size - 1} (vocab_size {vocab_size})")

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab_size, dtype=np.float64)
    freq = 1.0 / (ranks + 2.7) ** 1.1
    freq /= freq.sum()
    ids = rng.permutation(np.arange(1, vocab_size, dtype=np.int64))
    k = 2 * branching
    pool = ids[rng.choice(vocab_size - 1, size=(vocab_size, k), p=freq)]      # (V, K) successors of each token
    rows = 4096
    weights = np.cumsum(rng.dirichlet(np.full(k, 0.25), size=rows), axis=1)    # (rows, K) cumulative
    weights[:, -1] = 1.0

    docs_per_round = 256
    pieces, total = [], 0
    while total < num_tokens:
        lens = rng.integers(low, high + 1, size=docs_per_round)
        u = rng.random((high, docs_per_round))
        prev2 = np.zeros(docs_per_round, np.int64)   # every document starts after an end token
        prev1 = np.zeros(docs_per_round, np.int64)
        toks = np.empty((high, docs_per_round), np.int64)
        for t in range(high):
            row = (prev2 * 0x9E3779B1 + prev1 * 0x85EBCA77) % rows
            choice = np.minimum((weights[row] < u[t][:, None]).sum(axis=1), k - 1)
            nxt = pool[prev1, choice]
            toks[t] = nxt
            prev2, prev1 = prev1, nxt
        for d in range(docs_per_round):
            pieces.append(toks[:lens[d], d])
            pieces.append(np.zeros(1, np.int64))
            total += int(lens[d]) + 1
            if total >= num_tokens:
                break
    out = np.concatenate(pieces)[:num_tokens]
    return torch.from_numpy(out).to(dtype)


# ---- shards ---------------------------------------------------------------------------------------

def write_token_shards(path: str, tokens, *, seq_len: int, records_per_shard: int | None = None,
                       dtype: torch.dtype | str | None = None, overwrite: bool = False) -> data.DatasetInfo:
    """Writes a 1-D token stream as a shard dataset of training sequences for :func:`train_from_nvme`.

    Record ``i`` holds ``tokens[i * seq_len : i * seq_len + seq_len + 1]``: the inputs are its first
    ``seq_len`` tokens and the targets its last ``seq_len``, so consecutive records share one token
    and every token after the first is a target exactly once. ``(len(tokens) - 1) // seq_len``
    records are written; the tokens after the last whole record are dropped.

    The stream is converted and written in pieces (through :class:`optimized_ops.data.ShardWriter`),
    so a ``numpy.memmap`` of a corpus larger than memory can be passed.

    Parameters
    ----------
    path : str
        The dataset directory (created; existing shards are an error unless ``overwrite``).
    tokens : torch.Tensor or numpy.ndarray
        1-D integer tokens, all >= 0.
    seq_len : int
        Tokens a model sees per sequence (>= 1); records are ``seq_len + 1`` long.
    records_per_shard : int, optional
        Records per shard file; default: as many as fit in 256 MiB.
    dtype : torch.dtype or str, optional
        ``torch.uint16`` / ``"uint16"`` (tokens < 65536: half the bytes) or ``torch.int32`` /
        ``"int32"``; default: uint16 where the largest token fits, else int32.
    overwrite : bool
        Replace the shards already in ``path``.

    Returns
    -------
    optimized_ops.data.DatasetInfo
    """
    seq_len = _int_field("seq_len", seq_len, 1)
    if records_per_shard is not None:
        records_per_shard = _int_field("records_per_shard", records_per_shard, 1)
    if isinstance(tokens, torch.Tensor):
        src = tokens.detach().cpu()
        is_int = not (src.dtype.is_floating_point or src.dtype.is_complex or src.dtype == torch.bool)
    elif isinstance(tokens, np.ndarray):
        src = tokens
        is_int = np.issubdtype(src.dtype, np.integer)
    else:
        raise TypeError(f"tokens: expected a 1-D torch.Tensor or numpy.ndarray; given {type(tokens).__name__}")
    if not is_int:
        raise TypeError(f"tokens: expected an integer dtype; given {src.dtype}")
    if src.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D stream; given shape {tuple(src.shape)}")
    n = int(src.shape[0])
    num_records = (n - 1) // seq_len if n else 0
    if num_records < 1:
        raise ValueError(f"tokens: {n} tokens make no record of seq_len + 1 = {seq_len + 1} tokens")

    def as_numpy(piece) -> np.ndarray:
        return piece.numpy() if isinstance(piece, torch.Tensor) else np.asarray(piece)

    names = {torch.uint16: "uint16", torch.int32: "int32", "uint16": "uint16", "int32": "int32"}
    if dtype is None:
        hi, lo = 0, 0
        step = 1 << 24
        for start in range(0, n, step):
            piece = as_numpy(src[start:start + step])
            hi, lo = max(hi, int(piece.max())), min(lo, int(piece.min()))
        if lo < 0:
            raise ValueError(f"tokens: expected token ids >= 0; the stream holds {lo}")
        name = "uint16" if hi < (1 << 16) else "int32"
    elif dtype in names:
        name = names[dtype]
    else:
        raise ValueError(f"dtype: expected torch.uint16 or torch.int32; given {dtype!r}")
    np_dtype = np.uint16 if name == "uint16" else np.int32
    limit = np.iinfo(np_dtype).max
    if records_per_shard is None:
        records_per_shard = max(1, (256 << 20) // ((seq_len + 1) * np.dtype(np_dtype).itemsize))

    per_piece = max(1, (32 << 20) // (seq_len + 1))  # records converted at a time: ~32M tokens
    with data.ShardWriter(path, name, (seq_len + 1,), records_per_shard, overwrite=overwrite) as writer:
        for r0 in range(0, num_records, per_piece):
            r1 = min(num_records, r0 + per_piece)
            piece = as_numpy(src[r0 * seq_len: r1 * seq_len + 1])
            lo, hi = int(piece.min()), int(piece.max())
            if lo < 0 or hi > limit:
                bad = lo if lo < 0 else hi
                raise ValueError(f"tokens: token {bad} (in records {r0}..{r1 - 1}) does not fit dtype {name} "
                                 f"(0..{limit})")
            piece = piece.astype(np_dtype, copy=False)
            rec = np.lib.stride_tricks.as_strided(piece, shape=(r1 - r0, seq_len + 1),
                                                  strides=(seq_len * piece.itemsize, piece.itemsize),
                                                  writeable=False)
            writer.append(np.ascontiguousarray(rec))
    return data.dataset_info(path)


# ---- the configuration ----------------------------------------------------------------------------

_SCHEDULES = ("cosine", "linear", "constant")
_DTYPES = ("auto", "bf16", "fp32")


@dataclasses.dataclass
class TrainConfig:
    """What :func:`train_from_nvme` does. Every field is checked when the config is made (and again
    by :func:`train_from_nvme`): a bad value raises ``ValueError`` naming the field.

    Parameters
    ----------
    batch_size : int
        Sequences per micro-batch (default 8).
    seq_len : int, optional
        Tokens per sequence; must be the dataset's (records of ``seq_len + 1`` tokens). None: the
        dataset's.
    steps : int, optional
        Optimizer steps of the run (the schedule's length).
    epochs : int, optional
        Instead of ``steps``: ``epochs * batches_per_epoch // grad_accum_steps`` steps. Neither set:
        one epoch.
    stop_after : int, optional
        End this call after that many steps (with a checkpoint), as a preempted job would; the
        schedule still spans ``steps``.
    lr, min_lr : float
        The peak learning rate (default 6e-4) and the one the decay ends at (None: ``lr / 10``).
    weight_decay : float
        AdamW's decoupled weight decay, on the parameters of 2 or more dimensions only (not on norms
        and biases); default 0.1.
    betas, eps : (float, float), float
        AdamW's; default (0.9, 0.95) and 1e-8.
    warmup_steps : int
        Steps of linear warm-up to ``lr`` (step ``s`` uses ``lr * (s + 1) / warmup_steps``).
    schedule : str
        After the warm-up: ``"cosine"`` (default), ``"linear"`` or ``"constant"`` (see :func:`lr_at`).
    grad_accum_steps : int
        Micro-batches per optimizer step, each loss scaled by ``1 / grad_accum_steps``: a step sees
        ``batch_size * grad_accum_steps * seq_len`` tokens.
    grad_clip : float, optional
        The largest global gradient norm (default 1.0); None: no clipping.
    fused : bool or str
        ``"auto"`` (fused AdamW on CUDA, torch's default implementation on the CPU), True or False.
    dtype : str
        ``"auto"`` (bf16 autocast on CUDA, fp32 on the CPU), ``"bf16"`` (autocast on any device) or
        ``"fp32"``. Parameters and optimizer states stay fp32.
    compile : bool
        Run the model through ``torch.compile``.
    seed : int
        Seeds torch (CPU and CUDA) at the start of a fresh run (a resumed run restores the saved RNG
        states instead); the loader's order too unless ``loader_seed`` is set.
    device : str, optional
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"``; None: ``"cuda"`` where available, else ``"cpu"``.
    checkpoint_dir : str, optional
        Where checkpoints ``step_NNNNNNNN.pt`` go: every ``checkpoint_every`` steps (0: only at the
        end) and at the end of the call.
    checkpoint_every : int
        Steps between checkpoints; needs ``checkpoint_dir``.
    keep_checkpoints : int
        The newest checkpoints kept (default 2; 0: all).
    resume : bool or str
        True (default): resume from the newest checkpoint in ``checkpoint_dir`` when there is one; a
        path: from that file; False: start afresh.
    log_every : int
        Print a line every that many steps (0: silent).
    shuffle : bool
        A permutation of the records per epoch (from ``loader_seed``); default True.
    loader_seed : int, optional
        The loader's order; None: ``seed``.
    prefetch : int
        Micro-batches the loader reads ahead (default 4).
    loader_options : dict
        More :class:`optimized_ops.data.StreamingLoader` arguments: ``io``, ``threads``, ``direct_io``,
        ``verify``, ``staging_bytes``, ...
    rank, world_size : int
        Data parallelism: each rank reads its part of every epoch; wrapping the model in
        ``DistributedDataParallel`` is the caller's (the loop skips the all-reduce of all but the last
        micro-batch of a step); rank 0 writes the checkpoints.
    return_indices : bool
        Keep the dataset index of every record trained on (:attr:`TrainResult.indices`).
    """

    batch_size: int = 8
    seq_len: int | None = None
    steps: int | None = None
    epochs: int | None = None
    stop_after: int | None = None
    lr: float = 6e-4
    min_lr: float | None = None
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "cosine"
    grad_accum_steps: int = 1
    grad_clip: float | None = 1.0
    fused: bool | str = "auto"
    dtype: str = "auto"
    compile: bool = False
    seed: int = 0
    device: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool | str = True
    log_every: int = 10
    shuffle: bool = True
    loader_seed: int | None = None
    prefetch: int = 4
    loader_options: dict = dataclasses.field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    return_indices: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "TrainConfig":
        """Checks every field (``ValueError`` naming the first bad one); returns ``self``."""
        _int_field("batch_size", self.batch_size, 1)
        _int_field("seq_len", self.seq_len, 1, allow_none=True)
        _int_field("steps", self.steps, 1, allow_none=True)
        _int_field("epochs", self.epochs, 1, allow_none=True)
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"steps: set steps or epochs, not both (given steps={self.steps}, epochs={self.epochs})")
        _int_field("stop_after", self.stop_after, 1, allow_none=True)
        _float_field("lr", self.lr, 0.0, strict=True)
        _float_field("min_lr", self.min_lr, 0.0, allow_none=True)
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"min_lr: expected <= lr ({self.lr}); given {self.min_lr}")
        _float_field("weight_decay", self.weight_decay, 0.0)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"betas: expected (beta1, beta2); given {self.betas!r}")
        for i, b in enumerate(self.betas):
            b = _float_field(f"betas[{i}]", b, 0.0)
            if b >= 1.0:
                raise ValueError(f"betas[{i}]: expected in [0, 1); given {b}")
        self.betas = tuple(float(b) for b in self.betas)
        _float_field("eps", self.eps, 0.0, strict=True)
        _int_field("warmup_steps", self.warmup_steps, 0)
        if self.steps is not None and self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps: expected <= steps ({self.steps}); given {self.warmup_steps}")
        _choice_field("schedule", self.schedule, _SCHEDULES)
        _int_field("grad_accum_steps", self.grad_accum_steps, 1)
        _float_field("grad_clip", self.grad_clip, 0.0, allow_none=True, strict=True)
        if self.fused not in (True, False, "auto"):
            raise ValueError(f"fused: expected True, False or 'auto'; given {self.fused!r}")
        _choice_field("dtype", self.dtype, _DTYPES)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile: expected a bool; given {self.compile!r}")
        _int_field("seed", self.seed, 0)
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"device: expected a torch device such as 'cuda', 'cuda:1' or 'cpu'; "
                                 f"given {self.device!r} ({e})") from None
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, (str, os.PathLike)):
            raise ValueError(f"checkpoint_dir: expected a path; given {self.checkpoint_dir!r}")
        _int_field("checkpoint_every", self.checkpoint_every, 0)
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError(f"checkpoint_every: {self.checkpoint_every} needs a checkpoint_dir (given None)")
        _int_field("keep_checkpoints", self.keep_checkpoints, 0)
        if not isinstance(self.resume, (bool, str, os.PathLike)):
            raise ValueError(f"resume: expected True, False or a checkpoint file; given {self.resume!r}")
        _int_field("log_every", self.log_every, 0)
        if not isinstance(self.shuffle, bool):
            raise ValueError(f"shuffle: expected a bool; given {self.shuffle!r}")
        _int_field("loader_seed", self.loader_seed, 0, allow_none=True)
        _int_field("prefetch", self.prefetch, 1)
        if not isinstance(self.loader_options, dict):
            raise ValueError(f"loader_options: expected a dict; given {type(self.loader_options).__name__}")
        allowed = set(inspect.signature(data.StreamingLoader.__init__).parameters) - {
            "self", "path", "batch_size", "device", "shuffle", "seed", "rank", "world_size", "drop_last",
            "epochs", "prefetch", "return_indices"}
        for key in self.loader_options:
            if key not in allowed:
                raise ValueError(f"loader_options: {key!r} is not a StreamingLoader option this config leaves "
                                 f"open (those are: {', '.join(sorted(allowed))})")
        _int_field("world_size", self.world_size, 1)
        _int_field("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank: expected < world_size ({self.world_size}); given {self.rank}")
        if not isinstance(self.return_indices, bool):
            raise ValueError(f"return_indices: expected a bool; given {self.return_indices!r}")
        return self

    @property
    def final_lr(self) -> float:
        """``min_lr``, or ``lr / 10`` when it is None."""
        return self.lr / 10 if self.min_lr is None else float(self.min_lr)


def lr_at(step: int, total_steps: int, config: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``: linear warm-up over
    ``config.warmup_steps`` steps (``lr * (step + 1) / warmup_steps``), then ``config.schedule``
    from ``lr`` towards ``config.final_lr`` (reached after the last step)."""
    lr, low, warm = float(config.lr), config.final_lr, config.warmup_steps
    if step < warm:
        return lr * (step + 1) / warm
    if config.schedule == "constant":
        return lr
    progress = min(1.0, (step - warm) / max(1, total_steps - warm))
    if config.schedule == "linear":
        return lr - (lr - low) * progress
    return low + 0.5 * (lr - low) * (1.0 + math.cos(math.pi * progress))


# ---- the result -----------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainResult:
    """What :func:`train_from_nvme` did.

    Attributes
    ----------
    losses, lrs, grad_norms : list of float
        One entry per optimizer step from the first (those before a resume come from the
        checkpoint): the mean loss over the step's micro-batches, the learning rate, the global
        gradient norm before clipping (NaN without ``grad_clip``).
    steps : int
        Optimizer steps done in all.
    start_step : int
        The step this call began at (0 unless resumed).
    tokens : int
        Target tokens trained on in this call.
    elapsed_s, tokens_per_s : float
        This call's training time (checkpoint writing left out) and rate.
    steady_tokens_per_s : float
        The rate without this call's first step (compilation, warm-up); NaN for one step.
    data_wait_s : float
        Time the loop waited for the loader (zero when the input keeps ahead of the model).
    checkpoints : list of str
        The checkpoint files this call wrote (some may have been pruned since).
    checkpoint : str or None
        The newest checkpoint (written by this call, else the one it resumed from).
    resumed_from : str or None
        The checkpoint this call resumed from.
    device, dtype, io : str
        Where it trained, ``"bf16"`` or ``"fp32"``, the loader's I/O backend.
    num_parameters : int
        Parameters the optimizer updates.
    notes : list of str
        What was chosen and why (the optimizer, the loader's I/O).
    indices : list of torch.Tensor or None
        With ``config.return_indices``: the dataset index of each record of each micro-batch, in order.
    """

    losses: list[float]
    lrs: list[float]
    grad_norms: list[float]
    steps: int
    start_step: int
    tokens: int
    elapsed_s: float
    tokens_per_s: float
    steady_tokens_per_s: float
    data_wait_s: float
    checkpoints: list[str]
    checkpoint: str | None
    resumed_from: str | None
    device: str
    dtype: str
    io: str
    num_parameters: int
    notes: list[str] = dataclasses.field(default_factory=list)
    indices: list[torch.Tensor] | None = None

    def to_dict(self) -> dict:
        """Everything but ``indices``, as JSON-ready values."""
        out = dataclasses.asdict(dataclasses.replace(self, indices=None))
        out.pop("indices")
        return out


# ---- checkpoints ----------------------------------------------------------------------------------

def latest_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest ``step_NNNNNNNN.pt`` in ``checkpoint_dir`` (by step), or None."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(checkpoint_dir)
             if (m := _CHECKPOINT_RE.match(name))]
    return os.path.join(checkpoint_dir, max(found)[1]) if found else None


def _rng_state(device: torch.device) -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                       int(np_state[3]), float(np_state[4])]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# What changes the loss curve of a resumed run if it differs from the checkpoint's.
_CURVE_FIELDS = ("batch_size", "grad_accum_steps", "lr", "min_lr", "weight_decay", "betas", "eps",
                 "warmup_steps", "schedule", "grad_clip", "dtype", "shuffle", "loader_seed", "seed")


def _config_record(config: TrainConfig, seq_len: int) -> dict:
    """The config as plain values (paths as str: a checkpoint loads with ``weights_only=True``)."""
    out = dataclasses.asdict(config)
    for key, value in out.items():
        if isinstance(value, os.PathLike):
            out[key] = os.fspath(value)
    out["loader_options"] = {k: os.fspath(v) if isinstance(v, os.PathLike) else v
                             for k, v in out["loader_options"].items()}
    out["seq_len"] = seq_len
    return out


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``DistributedDataParallel`` (checkpoints hold its parameter names, without DDP's
    ``module.`` prefix, so they load into the bare model too)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _without_ddp_prefix(state: dict, model: torch.nn.Module) -> dict:
    """A model state_dict with DDP's ``module.`` prefix removed (checkpoints written by DDP runs before the
    prefix was dropped), unless ``model``'s own names carry it."""
    own = model.state_dict().keys()
    if state and all(k.startswith("module.") for k in state) and not all(k.startswith("module.") for k in own):
        return {k[len("module."):]: v for k, v in state.items()}
    return state


def _save_checkpoint(file: str, state: dict) -> None:
    tmp = file + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, file)  # a checkpoint file is whole or absent


def _prune(checkpoint_dir: str, keep: int) -> None:
    if keep <= 0:
        return
    found = sorted((int(m.group(1)), name) for name in os.listdir(checkpoint_dir)
                   if (m := _CHECKPOINT_RE.match(name)))
    for _, name in found[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(checkpoint_dir, name))


# ---- the loop -------------------------------------------------------------------------------------

def _to_long(batch: torch.Tensor) -> torch.Tensor:
    """Token records as int64. Unsigned 16/32-bit ids go through their signed view (every op takes
    int16/int32), masked back to their unsigned values."""
    if batch.dtype == torch.uint16:
        return batch.view(torch.int16).long() & 0xFFFF
    if batch.dtype == torch.uint32:
        return batch.view(torch.int32).long() & 0xFFFFFFFF
    return batch.long()


def _as_loss(out, targets: torch.Tensor) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"model: expected model(tokens, targets) to return the loss (a scalar tensor) or logits "
                        f"(B, S, V); it returned {type(out).__name__}")
    if out.dim() == 0:
        return out.float()
    if out.dim() == 3 and out.shape[:2] == targets.shape:
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1), ignore_index=-100)
    raise ValueError(f"model: expected model(tokens, targets) to return a scalar loss or logits of shape "
                     f"({targets.shape[0]}, {targets.shape[1]}, vocab); it returned shape {tuple(out.shape)}")


def _next_batch(loader: data.StreamingLoader) -> torch.Tensor:
    batch = loader.next()
    if batch is None:  # the end of an epoch: the next call starts the next one
        batch = loader.next()
        if batch is None:
            raise RuntimeError(f"train_from_nvme: the loader of {loader.path} yields no batch")
    return batch


def _make_optimizer(model: torch.nn.Module, config: TrainConfig, device: torch.device, notes: list[str]):
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("model: has no parameter that requires a gradient")
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = config.fused
    if fused == "auto":
        fused = device.type == "cuda" and all(p.is_floating_point() for p in decay + no_decay)
    kwargs = dict(lr=config.lr, betas=config.betas, eps=config.eps)
    if fused:
        try:
            opt = torch.optim.AdamW(groups, fused=True, **kwargs)
            notes.append("optimizer: fused AdamW")
            return opt
        except (RuntimeError, ValueError, TypeError) as e:
            if config.fused is True:
                raise
            notes.append(f"optimizer: AdamW (fused AdamW refused: {e})")
    return torch.optim.AdamW(groups, **kwargs)


def _autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _resolve_config(config) -> TrainConfig:
    if config is None:
        return TrainConfig()
    if isinstance(config, dict):
        return TrainConfig(**config)
    if isinstance(config, TrainConfig):
        return config.validate()  # fields may have been changed since it was made
    raise TypeError(f"config: expected a TrainConfig or a dict; given {type(config).__name__}")


def _resolve_device(config: TrainConfig) -> torch.device:
    device = torch.device(config.device if config.device is not None else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device} requested, but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _token_dataset(path: str, config: TrainConfig, model: torch.nn.Module) -> tuple[data.DatasetInfo, int]:
    """The dataset's header and its ``seq_len``, checked against the config and the model."""
    info = data.dataset_info(path)
    if info.torch_dtype.is_floating_point or len(info.record_shape) != 1 or info.record_shape[0] < 2:
        raise ValueError(f"path: {path} holds records of shape {info.record_shape} and dtype {info.dtype}; "
                         "expected token sequences (1-D integer records of seq_len + 1 tokens, "
                         "see write_token_shards)")
    seq_len = info.record_shape[0] - 1
    if config.seq_len is not None and config.seq_len != seq_len:
        raise ValueError(f"seq_len: {config.seq_len} given, but the records of {path} hold {seq_len + 1} "
                         f"tokens (seq_len {seq_len})")
    inner = getattr(model, "module", model)  # DistributedDataParallel's wrapped model
    model_max = getattr(getattr(inner, "config", None), "max_seq_len", None)
    if isinstance(model_max, int) and seq_len > model_max:
        raise ValueError(f"seq_len: the dataset's sequences are {seq_len} tokens; the model's max_seq_len is "
                         f"{model_max}")
    return info, seq_len


def _total_steps(config: TrainConfig, loader: data.StreamingLoader, path: str) -> int:
    per_epoch = len(loader)
    if per_epoch == 0:
        raise ValueError(f"batch_size: {config.batch_size} records per micro-batch, but rank {config.rank} of "
                         f"{config.world_size} gets {loader.records_per_epoch} records of {path} per epoch")
    if config.steps is not None:
        total = config.steps
    else:
        epochs = config.epochs or 1
        total = epochs * per_epoch // config.grad_accum_steps
        if total < 1:
            raise ValueError(f"grad_accum_steps: {config.grad_accum_steps} micro-batches per step, but {epochs} "
                             f"epoch(s) of {path} hold only {epochs * per_epoch} micro-batches of "
                             f"{config.batch_size}")
    if config.warmup_steps > total:
        raise ValueError(f"warmup_steps: expected <= the {total} steps; given {config.warmup_steps}")
    return total


def _resume_file(config: TrainConfig) -> str | None:
    if config.resume is True and config.checkpoint_dir is not None:
        return latest_checkpoint(os.fspath(config.checkpoint_dir))
    if isinstance(config.resume, (str, os.PathLike)):
        file = os.fspath(config.resume)
        if not os.path.isfile(file):
            raise ValueError(f"resume: no checkpoint file {file}")
        return file
    return None


def train_from_nvme(model: torch.nn.Module, path: str, config: TrainConfig | dict | None = None) -> TrainResult:
    """Trains ``model`` on the token shards at ``path``, streamed by the library's loader.

    Each optimizer step reads ``config.grad_accum_steps`` micro-batches of ``config.batch_size``
    records from :class:`optimized_ops.data.StreamingLoader` (on the training device, read ahead;
    ``drop_last``, so every micro-batch is whole and weighs the same), runs
    ``model(inputs, targets)`` under bf16 autocast on CUDA (:class:`TrainConfig` ``dtype``), scales
    each loss by ``1 / grad_accum_steps``, clips the global gradient norm, sets the learning rate of
    the schedule and steps AdamW. The loop does not synchronise with the GPU except after its first
    step (to time the rest), to log, to checkpoint and at the end.

    Checkpoints hold the model, the optimizer, the step, the loss history, the RNG states of torch
    (CPU and the CUDA device), Python and numpy, the loader's position and the dataset's
    fingerprint. Resuming (``config.resume``) continues as if the run had not stopped: on the CPU the
    losses and the final parameters equal those of an uninterrupted run bit for bit (same torch build
    and thread count); on CUDA they are as close as two runs of the same kernels are (bit for bit
    where every kernel is deterministic). With ``world_size > 1`` every rank resumes from rank 0's
    checkpoint, RNG states included. A checkpoint of another dataset (other records at the same
    positions) is refused with ``ValueError`` naming both.

    Parameters
    ----------
    model : torch.nn.Module
        ``model(tokens, targets)``, both (B, S) int64 on the device, returns the scalar mean loss
        (or logits (B, S, V)). Moved to the device; its parameters stay fp32.
    path : str
        A dataset of token records of ``seq_len + 1`` tokens (:func:`write_token_shards`), an integer
        dtype.
    config : TrainConfig or dict, optional
        A dict is passed to :class:`TrainConfig`.

    Returns
    -------
    TrainResult
        The time spent writing checkpoints is left out of ``elapsed_s`` and the rates.
    """
    config = _resolve_config(config)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module; given {type(model).__name__}")
    path = os.fspath(path)
    device = _resolve_device(config)
    amp = config.dtype if config.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    info, seq_len = _token_dataset(path, config, model)
    notes: list[str] = []

    model.to(device)
    model.train()
    forward = torch.compile(model) if config.compile else model
    optimizer = _make_optimizer(model, config, device, notes)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    k = config.grad_accum_steps

    loader = data.StreamingLoader(
        path, batch_size=config.batch_size, device=device, shuffle=config.shuffle,
        seed=config.seed if config.loader_seed is None else config.loader_seed, rank=config.rank,
        world_size=config.world_size, drop_last=True, prefetch=config.prefetch,
        return_indices=config.return_indices, **config.loader_options)
    with loader:
        total_steps = _total_steps(config, loader, path)
        losses: list[float] = []
        lrs: list[float] = []
        norms: list[float] = []
        start_step = 0
        resumed_from = _resume_file(config)
        if resumed_from is not None:
            state = _load_checkpoint(resumed_from, path, loader, model, optimizer, config, seq_len, total_steps,
                                     device)
            start_step = int(state["step"])
            losses, lrs, norms = list(state["losses"]), list(state["lrs"]), list(state["grad_norms"])
        else:
            torch.manual_seed(config.seed)  # CPU and every CUDA device

        end_step = total_steps if config.stop_after is None else min(total_steps, config.stop_after)
        tokens_per_step = config.batch_size * k * seq_len
        indices: list[torch.Tensor] | None = [] if config.return_indices else None
        checkpoints: list[str] = []
        pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # device scalars not read back yet
        writer = config.checkpoint_dir is not None and config.rank == 0
        if writer:
            os.makedirs(config.checkpoint_dir, exist_ok=True)
        checkpoint_s = 0.0  # time spent writing checkpoints, left out of the rates

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def flush() -> None:
            for loss, norm in pending:
                losses.append(loss.item())
                norms.append(norm.item() if norm is not None else math.nan)
            pending.clear()

        def checkpoint(step: int) -> None:
            nonlocal checkpoint_s
            t = time.perf_counter()
            flush()
            state = {"format": _CHECKPOINT_FORMAT, "step": step, "total_steps": total_steps,
                     "model": _unwrapped(model).state_dict(), "optimizer": optimizer.state_dict(),
                     "loader": loader.state_dict(), "rng": _rng_state(device),
                     "config": _config_record(config, seq_len),
                     "losses": list(losses), "lrs": list(lrs), "grad_norms": list(norms),
                     "dataset": {"path": os.path.abspath(path), "fingerprint": loader.fingerprint,
                                 "num_records": info.num_records, "record_shape": list(info.record_shape),
                                 "dtype": info.dtype}}
            file = os.path.join(os.fspath(config.checkpoint_dir), f"step_{step:08d}.pt")
            _save_checkpoint(file, state)
            checkpoints.append(file)
            _prune(os.fspath(config.checkpoint_dir), config.keep_checkpoints)
            checkpoint_s += time.perf_counter() - t

        wait0 = loader.stats()["consumer_wait_s"]
        sync()
        t0 = time.perf_counter()
        t_first = None  # the end of this call's first step
        step = start_step
        while step < end_step:
            lr = lr_at(step, total_steps, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = None
            for micro in range(k):
                batch = _next_batch(loader)  # (B, S + 1) on the device, ready on the current stream
                if indices is not None:
                    indices.append(loader.last_indices.clone())
                tokens = _to_long(batch)
                inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
                # DDP: all-reduce the gradients once per step, on the last micro-batch.
                no_sync = model.no_sync() if ddp and micro < k - 1 else contextlib.nullcontext()
                with no_sync:
                    with _autocast(device, amp):
                        out = forward(inputs, targets)
                    loss = _as_loss(out, targets)
                    (loss / k).backward()
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
            norm = None
            if config.grad_clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip).detach()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append((step_loss / k, norm))
            lrs.append(lr)
            step += 1
            if t_first is None:
                sync()
                t_first = time.perf_counter()
            if config.log_every and step % config.log_every == 0:
                flush()
                if config.rank == 0:
                    rate = (step - start_step) * tokens_per_step / max(1e-9, time.perf_counter() - t0 - checkpoint_s)
                    print(f"step {step}/{total_steps} | loss {losses[-1]:.4f} | lr {lr:.3e} | {rate:,.0f} tokens/s",
                          flush=True)
            if writer and config.checkpoint_every and step % config.checkpoint_every == 0:
                checkpoint(step)
        sync()
        elapsed = time.perf_counter() - t0 - checkpoint_s
        flush()
        if writer and step > start_step and not (checkpoints and checkpoints[-1].endswith(f"_{step:08d}.pt")):
            checkpoint(step)
        data_wait = loader.stats()["consumer_wait_s"] - wait0
        io = loader.io_backend
        notes += loader.notes

    tokens = (step - start_step) * tokens_per_step
    steady = math.nan
    if t_first is not None and step - start_step > 1:
        steady = (tokens - tokens_per_step) / max(1e-9, t0 + elapsed - t_first)
    return TrainResult(losses=losses, lrs=lrs, grad_norms=norms, steps=step, start_step=start_step,
                       tokens=tokens, elapsed_s=elapsed, tokens_per_s=tokens / elapsed if elapsed > 0 else math.nan,
                       steady_tokens_per_s=steady, data_wait_s=data_wait, checkpoints=checkpoints,
                       checkpoint=checkpoints[-1] if checkpoints else resumed_from, resumed_from=resumed_from,
                       device=str(device), dtype=amp, io=io, num_parameters=sum(p.numel() for p in params),
                       notes=notes, indices=indices)


def _load_checkpoint(file: str, path: str, loader: data.StreamingLoader, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, config: TrainConfig, seq_len: int, total_steps: int,
                     device: torch.device) -> dict:
    """Restores everything from ``file`` after checking it is a checkpoint of this dataset."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is named
        raise ValueError(f"resume: {file} is not a readable checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"resume: {file} is not a train_from_nvme checkpoint (format "
                         f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}; "
                         f"expected {_CHECKPOINT_FORMAT!r})")
    saved = state["dataset"]
    if saved["fingerprint"] != loader.fingerprint:
        raise ValueError(f"resume: checkpoint {file} was written for the dataset {saved['path']} (fingerprint "
                         f"{saved['fingerprint']}, {saved['num_records']} records); the dataset "
                         f"{os.path.abspath(path)} has fingerprint {loader.fingerprint} ({loader.num_records} "
                         "records): another dataset, or "
                         "one rewritten since, so resuming would train on other records. Pass resume=False or a "
                         "new checkpoint_dir to start afresh")
    if state["config"].get("seq_len") != seq_len:
        raise ValueError(f"resume: checkpoint {file} trained on sequences of {state['config'].get('seq_len')} "
                         f"tokens; {path} holds sequences of {seq_len}")
    loader_state = dict(state["loader"])
    loader_state["rank"] = config.rank  # rank 0 wrote it; every rank's position is the same (drop_last)
    try:
        _unwrapped(model).load_state_dict(_without_ddp_prefix(state["model"], _unwrapped(model)))
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(loader_state)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"resume: checkpoint {file} does not fit this run: {e}") from e
    for key in _CURVE_FIELDS:
        old, new = state["config"].get(key), getattr(config, key)
        if isinstance(old, list):
            old = tuple(old)
        if old != new:
            warnings.warn(f"resume: {key} is {new!r} here and was {old!r} in {file}: the loss curve will "
                          "differ from that of an uninterrupted run", stacklevel=3)
    if state.get("total_steps") != total_steps:
        warnings.warn(f"resume: this run has {total_steps} steps and {file} was written by a run of "
                      f"{state.get('total_steps')}: the schedule (and so the loss curve) differs from that of an "
                      "uninterrupted run", stacklevel=3)
    _set_rng_state(state["rng"], device)
    return state
