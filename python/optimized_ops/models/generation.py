"""Autoregressive generation from a :class:`~optimized_ops.models.Transformer`: :func:`generate` (prefill, then
one token per step with a KV cache, greedy or sampled) and :func:`sample_next` (the sampling rule alone).

The loop, with ``use_cache=True``:

1. **prefill**: the prompts, left-padded into one ``(B, S_max)`` batch (padding at negative positions, which
   the cache ops skip), go through :meth:`Transformer.forward_cached` once: every layer appends its keys and
   values to the cache (the optimized model: :func:`optimized_ops.append_kv` with RoPE fused, then
   :func:`optimized_ops.paged_attention_prefill`) and the last position's logits give each sequence's first
   new token;
2. **decode**: each step feeds one token per sequence at its next position
   (:func:`optimized_ops.paged_attention_decode` with a :class:`optimized_ops.DecodePlan` on CUDA); the
   sequences' lengths follow from the positions on the device (no host synchronisation in a step).

**CUDA graphs** (``cuda_graphs=True`` on a CUDA model): the batch is padded to a bucket (1, 2, 4, 8, 16, ... the
next power of two; padding rows sit at position -1: nothing is written, length 0), and one decode step of that
bucket is captured in a :class:`torch.cuda.CUDAGraph` whose inputs (tokens, positions) and output (logits)
are static tensors updated in place; the page table is a static tensor of the cache, the sequences' lengths are
computed inside the graph from the static positions, and the KV-cache ops run with ``validate=False`` and the
bucket's decode plan. Each step is then a copy of the new tokens and positions, a replay and the sampling. The
captured step (with its cache, buffers and graph) is kept with the model, one per bucket, for the next call of
that bucket with the same cache capacity (rounded up to a power of two of pages, so that nearby prompt lengths
share it), dtype and device; it is captured again when the model's parameters move (the key holds their
addresses) and dropped by :func:`release_decode_graphs`.

``use_cache=False`` recomputes the whole sequences at every step (``model(tokens)``, right-padded: causal
attention keeps the padding out of every real token's view): slow, the yardstick of the cached path.

The reference model (``reference=True``) decodes the same way with its :class:`StaticDecodeCache` (a
preallocated cache read through a mask: "eager with a static KV cache"); its MoE layers find each expert's rows
on the host, so a reference MoE model cannot use CUDA graphs (``cuda_graphs=True`` is refused for it on CUDA).
For ``torch.compile(mode="reduce-overhead")``, compile ``model.forward_cached`` and pass
``cuda_graphs=False``: its cache tensors are marked static for dynamo.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["generate", "sample_next", "release_decode_graphs", "captured_decode_steps", "bucket_size"]


# ---- sampling ----------------------------------------------------------------------------------------------------

def _check_sampling(fn: str, temperature, top_k, top_p) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"{fn}: temperature: expected a finite number >= 0 (0: greedy); given {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{fn}: top_k: expected None or an int >= 1; given {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"{fn}: top_p: expected None or a number in (0, 1]; given {top_p!r}")


def sample_next(logits: torch.Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The next token of each row of ``logits``: greedy, or sampled with temperature, top-k and top-p.

    Parameters
    ----------
    logits : torch.Tensor
        ``(B, V)`` (any floating dtype; the rule runs in float32).
    temperature : float, keyword-only
        0: greedy (``argmax``, the lowest index among equal maxima; ``top_k``, ``top_p`` and ``generator``
        unused). Otherwise the logits are divided by it before the softmax.
    top_k : int, optional, keyword-only
        Keep the ``top_k`` largest logits of each row (and any equal to the k-th).
    top_p : float, optional, keyword-only
        Nucleus sampling: keep the most probable tokens whose probabilities (after temperature and top-k), in
        decreasing order, sum to at least ``top_p``: a token is dropped when the probabilities before it
        already reach ``top_p`` (the most probable token always stays).
    generator : torch.Generator, optional, keyword-only
        For ``torch.multinomial``, on ``logits``' device: the same generator state gives the same tokens.

    Returns
    -------
    torch.Tensor
        ``(B,)`` int64 on ``logits``' device.
    """
    _check_sampling("sample_next", temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / float(temperature)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs                      # mass of the tokens ranked above
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# ---- prompts -----------------------------------------------------------------------------------------------------

def _prompts(prompt_tokens, vocab_size: int, device: torch.device) -> list[torch.Tensor]:
    """The prompts as a list of 1-D int64 tensors on ``device``, checked."""
    fn = "generate"
    if isinstance(prompt_tokens, torch.Tensor):
        if prompt_tokens.dim() == 1:
            rows = [prompt_tokens]
        elif prompt_tokens.dim() == 2:
            rows = list(prompt_tokens)
        else:
            raise ValueError(f"{fn}: prompt_tokens: expected a (B, S) or (S,) tensor, or a list of 1-D tensors / "
                             f"lists of ints; given a tensor of shape {list(prompt_tokens.shape)}")
    elif isinstance(prompt_tokens, Sequence) and not isinstance(prompt_tokens, (str, bytes)):
        rows = list(prompt_tokens)
    else:
        raise ValueError(f"{fn}: prompt_tokens: expected a (B, S) tensor or a list of 1-D tensors / lists of ints; "
                         f"given {type(prompt_tokens).__name__}")
    if not rows:
        raise ValueError(f"{fn}: prompt_tokens: expected at least one prompt; given none")
    out = []
    for i, row in enumerate(rows):
        try:
            t = row if isinstance(row, torch.Tensor) else torch.as_tensor(row)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{fn}: prompt_tokens[{i}]: expected a 1-D tensor or a list of ints; given "
                             f"{type(row).__name__}") from None
        if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{fn}: prompt_tokens[{i}]: expected a non-empty 1-D sequence of integer token ids; "
                             f"given {t.dtype} shape {list(t.shape)}")
        out.append(t.to(device=device, dtype=torch.int64))
    # the ids' range, read back once for the batch (one synchronisation, not two per prompt)
    lo_hi = torch.stack([torch.stack([t.min(), t.max()]) for t in out]).cpu()
    bad = ((lo_hi[:, 0] < 0) | (lo_hi[:, 1] >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{fn}: prompt_tokens[{i}]: expected token ids in [0, vocab_size = {vocab_size}); given "
                         f"values in [{int(lo_hi[i, 0])}, {int(lo_hi[i, 1])}]")
    return out


def bucket_size(batch: int) -> int:
    """The CUDA-graph bucket of a batch: the next power of two (1, 2, 4, 8, 16, 32, ...)."""
    return 1 << max(0, int(batch) - 1).bit_length()


# ---- the steppers: prefill + decode, with or without the cache ----------------------------------------------------

class _Uncached:
    """Every step recomputes the whole sequences (right-padded; causal attention keeps the padding out)."""

    def __init__(self, model, prompts: list[torch.Tensor]) -> None:
        self.model, self.seqs = model, [p.clone() for p in prompts]

    def _last_logits(self) -> torch.Tensor:
        lens = [s.numel() for s in self.seqs]
        tokens = torch.zeros(len(self.seqs), max(lens), dtype=torch.int64, device=self.seqs[0].device)
        for b, s in enumerate(self.seqs):
            tokens[b, :s.numel()] = s
        logits = self.model(tokens)                                           # (B, S, V)
        index = torch.tensor([n - 1 for n in lens], device=logits.device)
        return logits[torch.arange(len(lens), device=logits.device), index]

    def prefill(self) -> torch.Tensor:
        return self._last_logits()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seqs = [torch.cat([s, t[None]]) for s, t in zip(self.seqs, tokens)]
        return self._last_logits()


class _GraphState:
    """A captured decode step: the cache, the static inputs and output, the graph (kept between calls)."""

    def __init__(self, key, cache, tokens, positions, logits, graph) -> None:
        self.key, self.cache, self.tokens, self.positions, self.logits, self.graph = \
            key, cache, tokens, positions, logits, graph


# Pad the eager decode batch to its bucket too (as the CUDA graphs do): for tests of the padding rows on the CPU.
PAD_EAGER_DECODE = False

# model -> {bucket: its latest _GraphState}
_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[int, _GraphState]]" = weakref.WeakKeyDictionary()


def release_decode_graphs(model: Optional[torch.nn.Module] = None) -> None:
    """Drops the captured decode steps (their graphs, KV caches and static buffers) kept for ``model`` by
    :func:`generate`, or for every model when None, so that their memory can be freed."""
    if model is None:
        _GRAPHS.clear()
    else:
        _GRAPHS.pop(model, None)


def captured_decode_steps(model: torch.nn.Module) -> dict:
    """``{bucket: state}``: the captured decode steps kept for ``model`` (for inspection and tests)."""
    return dict(_GRAPHS.get(model, {}))


class _Cached:
    """Prefill then one token per step through ``model.forward_cached``, eagerly or by replaying a CUDA graph of
    the step at a padded bucket size (``bucket``: pad the decode batch to :func:`bucket_size`)."""

    def __init__(self, model, prompts: list[torch.Tensor], capacity: int, page_size: int, graphs: bool,
                 bucket: bool) -> None:
        self.model, self.prompts = model, prompts
        self.batch = len(prompts)
        self.rows = bucket_size(self.batch) if (bucket or graphs) else self.batch
        device = prompts[0].device
        self.lens = torch.tensor([p.numel() for p in prompts], dtype=torch.int32, device=device)
        self.state: Optional[_GraphState] = None
        if graphs:
            self.state = self._graph_state(capacity, page_size)
            self.cache = self.state.cache
        else:
            validate = None if device.type == "cpu" else False
            self.cache = model.make_cache(self.rows, capacity, page_size=page_size, validate=validate)
        self.next_pos = self.lens.clone()                                         # (B,) int32

    # -- the captured step --

    def _graph_state(self, capacity: int, page_size: int) -> _GraphState:
        model = self.model
        pages = -(-capacity // page_size)
        pages = min(1 << (pages - 1).bit_length(), -(-model.config.max_seq_len // page_size))  # reuse across calls
        capacity = min(pages * page_size, model.config.max_seq_len)
        key = (self.rows, capacity, page_size, model.dtype, model.device, model.training,
               tuple(p.data_ptr() for p in model.parameters()))
        states = _GRAPHS.setdefault(model, {})
        state = states.get(self.rows)
        if state is not None and state.key == key:
            return state
        states.pop(self.rows, None)                                               # free the old one first
        cache = model.make_cache(self.rows, capacity, page_size=page_size, validate=False)
        device = model.device
        tokens = torch.zeros(self.rows, 1, dtype=torch.int64, device=device)
        positions = torch.full((self.rows, 1), -1, dtype=torch.int32, device=device)   # padding: writes nothing
        if hasattr(cache, "plan"):
            cache.plan(self.rows, model.config.n_heads, model.dtype)              # host work, before the capture
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):                                             # warm-up (torch's rule)
            for _ in range(2):
                model.forward_cached(tokens, positions, cache)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.forward_cached(tokens, positions, cache)
        state = _GraphState(key, cache, tokens, positions, logits, graph)
        states[self.rows] = state
        return state

    # -- the steps --

    def prefill(self) -> torch.Tensor:
        tokens = pad_sequence(self.prompts, batch_first=True, padding_side="left")  # (B, S_max), left padding
        smax = tokens.shape[1]
        positions = (torch.arange(smax, dtype=torch.int32, device=tokens.device)[None, :]
                     - (smax - self.lens)[:, None])                                # < 0: padding
        return self.model.forward_cached(tokens, positions, self.cache)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        b = self.batch
        if self.state is not None:
            s = self.state
            s.tokens[:b, 0].copy_(tokens)
            s.positions[:b, 0].copy_(self.next_pos)
            s.positions[b:].fill_(-1)
            s.graph.replay()
            out = s.logits[:b]
        elif self.rows == b:
            out = self.model.forward_cached(tokens[:, None], self.next_pos[:, None], self.cache)
        else:  # padded to the bucket (PAD_EAGER_DECODE): rows at position -1
            tok = torch.zeros(self.rows, 1, dtype=torch.int64, device=tokens.device)
            pos = torch.full((self.rows, 1), -1, dtype=torch.int32, device=tokens.device)
            tok[:b, 0], pos[:b, 0] = tokens, self.next_pos
            out = self.model.forward_cached(tok, pos, self.cache)[:b]
        self.next_pos += 1
        return out


# ---- generate ------------------------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model, prompt_tokens, max_new_tokens: int, *, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_token_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None, use_cache: bool = True, cuda_graphs: bool = True,
             page_size: int = 16, return_logits: bool = False
             ) -> Union[list[torch.Tensor], tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Generates up to ``max_new_tokens`` tokens after each prompt (the module docstring's loop).

    Parameters
    ----------
    model : optimized_ops.models.Transformer
        The optimized or the reference model (in its current mode: call ``model.eval()`` first when it has MoE
        layers with a capacity, which applies in training mode only).
    prompt_tokens : list of 1-D tensors or lists of ints, or torch.Tensor
        The prompts, of any lengths >= 1 (a batch), or a ``(B, S)`` tensor (B prompts of S tokens), or one 1-D
        prompt. Token ids in ``[0, vocab_size)``.
    max_new_tokens : int
        Tokens to generate per prompt (>= 0); each prompt's length plus this must fit ``max_seq_len``.
    temperature, top_k, top_p : keyword-only
        The sampling rule (:func:`sample_next`): ``temperature=0`` is greedy.
    eos_token_id : int, optional, keyword-only
        A sequence ends after producing it (it is included in that sequence's output); the loop ends when every
        sequence has (checked every 16 steps: one host synchronisation each).
    generator : torch.Generator, optional, keyword-only
        On the model's device: sampling draws from it only (the same seed gives the same tokens).
    use_cache : bool, keyword-only
        Prefill + decode with the model's KV cache (default); False recomputes the sequences at every step.
    cuda_graphs : bool, keyword-only
        On a CUDA model with the cache: replay a captured decode step (the module docstring). Ignored on the
        CPU.
    page_size : int, keyword-only
        Tokens per page of the optimized model's paged cache (1 to 256).
    return_logits : bool, keyword-only
        Also return the logits each token was chosen from.

    Returns
    -------
    list of torch.Tensor, or (list of torch.Tensor, list of torch.Tensor)
        One 1-D int64 tensor per prompt on the model's device: its new tokens only, ``max_new_tokens`` of them,
        or fewer when it ended with ``eos_token_id`` (included). With ``return_logits``, also one
        ``(n_b, vocab_size)`` float32 tensor per prompt: the logits of each of its new tokens.

    Raises
    ------
    ValueError
        An argument out of range (named): prompts (empty, not integer, ids out of the vocabulary, too long),
        ``max_new_tokens``, the sampling arguments, ``page_size``, a ``generator`` on another device,
        ``cuda_graphs=True`` on a CUDA reference model with MoE layers.
    """
    fn = "generate"
    if not (hasattr(model, "forward_cached") and hasattr(model, "config")):
        raise TypeError(f"{fn}: model: expected an optimized_ops.models.Transformer; given {type(model).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"{fn}: max_new_tokens: expected an int >= 0; given {max_new_tokens!r}")
    _check_sampling(fn, temperature, top_k, top_p)
    if eos_token_id is not None and (isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int)):
        raise ValueError(f"{fn}: eos_token_id: expected None or an int; given {eos_token_id!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 256:
        raise ValueError(f"{fn}: page_size: expected an int 1 to 256; given {page_size!r}")
    device = model.device
    if generator is not None and torch.device(generator.device).type != device.type:
        raise ValueError(f"{fn}: generator: expected a torch.Generator on the model's device ({device}); given one "
                         f"on {generator.device}")
    cfg = model.config
    prompts = _prompts(prompt_tokens, cfg.vocab_size, device)
    lens = [p.numel() for p in prompts]
    capacity = max(lens) + max_new_tokens
    if capacity > cfg.max_seq_len:
        raise ValueError(f"{fn}: max_new_tokens: the longest prompt ({max(lens)} tokens) plus max_new_tokens "
                         f"({max_new_tokens}) exceeds max_seq_len = {cfg.max_seq_len}")
    batch = len(prompts)
    if max_new_tokens == 0:
        empty = [torch.zeros(0, dtype=torch.int64, device=device) for _ in prompts]
        return (empty, [torch.zeros(0, cfg.vocab_size, device=device) for _ in prompts]) if return_logits else empty

    graphs = bool(cuda_graphs) and use_cache and device.type == "cuda"
    if graphs and model.reference and cfg.moe is not None:
        raise ValueError(f"{fn}: cuda_graphs: the reference model's MoE layers find each expert's tokens on the host "
                         "(torch.where), which a CUDA graph cannot capture; pass cuda_graphs=False")
    if use_cache:
        stepper = _Cached(model, prompts, capacity, page_size, graphs, bucket=PAD_EAGER_DECODE)
    else:
        stepper = _Uncached(model, prompts)

    out = torch.zeros(batch, max_new_tokens, dtype=torch.int64, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    recorded = []
    done = max_new_tokens
    logits = stepper.prefill()
    for i in range(max_new_tokens):
        if i > 0:
            logits = stepper.step(out[:, i - 1])
        if return_logits:
            recorded.append(logits.float().clone())
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        if eos_token_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
            finished |= nxt == eos_token_id
        out[:, i] = nxt
        if eos_token_id is not None and (i + 1) % 16 == 0 and bool(finished.all()):
            done = i + 1
            break

    out = out[:, :done]
    counts = [done] * batch
    if eos_token_id is not None:
        hit = (out == eos_token_id).cpu()
        for b in range(batch):
            where = torch.nonzero(hit[b])
            if where.numel():
                counts[b] = int(where[0]) + 1
    tokens = [out[b, :counts[b]] for b in range(batch)]
    if not return_logits:
        return tokens
    stacked = torch.stack(recorded, dim=1)                                        # (B, steps, V)
    return tokens, [stacked[b, :counts[b]] for b in range(batch)]
