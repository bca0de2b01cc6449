"""Where a model's time goes: ``optimized_ops.models.profile(model, ...)``.

Runs ``torch.profiler`` (CPU and CUDA activities) over a few training steps (forward, backward,
AdamW step; bf16 autocast on CUDA) and a few decode steps (:func:`optimized_ops.models.generation.generate`:
prefill then ``decode_steps`` new tokens, greedy; on CUDA with the paged KV cache and CUDA graphs for our
model), and writes, under ``out_dir``:

* ``trace-train.json``, ``trace-decode.json`` -- Chrome traces (open in ``chrome://tracing`` or Perfetto);
* ``profile.json`` (schema ``optimized-ops-profile/1``) and ``profile.md`` -- the time per kernel family
  and phase, per step: each GPU kernel, memcpy and memset of the trace (on the CPU: each operator's self
  time, i.e. its time minus that of the operators it called) classified by :func:`classify`;
* ``profile.png`` -- a bar plot of the same, where matplotlib is installed;
* the "Memory Usage Analysis" table (``memory_table``): peak memory of naive vs optimized MatMul 4096x4096,
  attention at sequence 8192 and an MoE layer with 8 experts, measured in this run (``memory=False`` skips it).

>>> from optimized_ops.models import OptimizedTransformer, profile
>>> model = OptimizedTransformer().cuda()                             # doctest: +SKIP
>>> result = profile(model, train_steps=3, decode_steps=16, out_dir="profile-124m")  # doctest: +SKIP
>>> print(open(result["markdown"]).read())                             # doctest: +SKIP

The command line: ``python -m optimized_ops.models.profile [--smoke] [--moe] [--reference] [--out DIR]``.

Kernel families (:data:`FAMILIES`, :func:`classify`): a name is matched, lower-cased, against one rule per
family in this order (the first match wins): torch's optimizer, reduction-norm and random kernels
(``multi_tensor_apply``, ``foreach``, ``normal`` ...: "torch-native other", checked first so that "norm" in
them is not a normalization); moe (``moe``, ``grouped_mm``/``grouped_gemm``, the router); kv_cache/decode
(paged attention, the KV append and gather kernels, ``KvDecodeParams``, ``index_copy`` of a static cache);
cross-entropy (ours, ``nll_loss``, ``log_softmax``: in a language model the log-softmax is the loss's);
rope; attention (ours, FlashAttention, memory-efficient, cuDNN SDPA: checked before gemm because their
names carry ``cutlass``); gemm/linear (ours, cuBLAS ``nvjet``/``xmma``/``gemm``, CUTLASS, ``aten::mm``...);
fused norms/activations (norms, GELU, SiLU, softmax); loader/copies (memcpy, memset, copy and cast kernels,
fills, ``cat``, the loader's kernels); everything else is "torch-native other" (element-wise arithmetic,
reductions, the embedding, the optimizer, sampling). Our kernels are named in the ``optimized::``
namespace; the table also gives the share of each family's time spent in them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import pathlib
import platform
import re
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Callable, Optional

import torch

__all__ = ["profile", "classify", "is_ours", "FAMILIES", "FAMILY_LABELS", "family_times", "memory_table",
           "peak_memory_bytes", "render_markdown", "main"]

SCHEMA = "optimized-ops-profile/1"

# (key, label), in the order of the tables
FAMILIES = [
    ("gemm_linear", "gemm/linear"),
    ("attention", "attention"),
    ("kv_cache_decode", "kv_cache/decode"),
    ("fused_norm_act", "fused norms/activations"),
    ("cross_entropy", "cross-entropy"),
    ("rope", "rope"),
    ("moe", "moe"),
    ("loader_copies", "loader/copies"),
    ("other", "torch-native other"),
]
FAMILY_LABELS = dict(FAMILIES)

# The first rule that matches the lower-cased name wins (see the module docstring for why this order).
_RULES = [
    ("other", r"multi_tensor_apply|foreach|fusedadam|adamw?(math)?functor|optimizer|\badamw?\b|normtwo|"
              r"vector_norm|linalg_|normal|distribution_|uniform_|random_|bernoulli|multinomial"),
    ("moe", r"moe|grouped_(mm|gemm|wgmma|forward|weight_grad)|groupedgemmparams|router|"
            r"route_(warp|backward)_kernel|expert"),
    ("kv_cache_decode", r"kv_?cache|paged|kv(gather|decode|append)params|decode|merge_splits|split_?kv|"
                        r"append_kv|index_copy|lse_unpack|static_cache"),
    ("cross_entropy", r"cross_?entropy|crossentropyparams|(?<![a-z])ce_(row|partial|finish|scale|registers)_kernel|"
                      r"nll_?loss|log_?softmax"),
    ("rope", r"(?<![a-z])rope(?![a-z])|ropeparams|rotary"),
    ("attention", r"attention|flash|fmha|sdpa|scaled_dot_product|mem_?eff"),
    ("gemm_linear", r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|wgmma|tensorop|s16816|h16816|splitkreduce|"
                    r"(?<![a-z])(addmm|baddbmm|bmm|mm|addmv|mv|linear|dot)(?![a-z])|mmbackward|"
                    r"act_grad_kernel|store_bias_grad|column_sums"),
    ("fused_norm_act", r"norm|gelu|silu|swiglu|softmax|rowwisemoments|gammabeta|computeinternalgradients|"
                       r"fusedparams|optimized::cuda::fused|row_(streaming|registers)_kernel|tanh|sigmoid"),
    ("loader_copies", r"memcpy|memset|copy|optimized::loader|loader|shard|catarray|(?<![a-z])cat(?![a-z])|fill|"
                      r"(?<![a-z])to(?![a-z])|clone|contiguous|zero_|pin_memory"),
]
_COMPILED = [(family, re.compile(rx)) for family, rx in _RULES]


def classify(name: str) -> str:
    """The family key (:data:`FAMILIES`) of a CUDA kernel, memcpy/memset or operator name."""
    s = name.lower()
    for family, rx in _COMPILED:
        if rx.search(s):
            return family
    return "other"


def is_ours(name: str) -> bool:
    """Whether a kernel or operator name is the library's: its kernels (the ``optimized::`` namespace), its
    ``torch.ops.optimized`` ops and the autograd functions of ``optimized_ops`` (``optimized_<op>_Function``,
    ``_LinearCrossEntropy``)."""
    return "optimized::" in name or name.startswith("optimized") or name.startswith("_LinearCrossEntropy")


# ---- the trace -> time per family --------------------------------------------------------------------------

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _events(trace) -> list:
    if isinstance(trace, (str, os.PathLike)):
        trace = json.loads(pathlib.Path(trace).read_text())
    return trace.get("traceEvents", []) if isinstance(trace, dict) else list(trace)


def _cpu_self_times(events: list) -> list[tuple[str, float]]:
    """(name, self time in us) of every ``cpu_op`` event: its duration minus its direct children's (on the
    same thread, nested by time)."""
    by_thread: dict[tuple, list] = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X" and "dur" in e:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        selfs = [float(e["dur"]) for e in evs]
        stack: list[tuple[float, int]] = []  # (end, index)
        for i, e in enumerate(evs):
            ts, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            while stack and stack[-1][0] <= ts + 1e-3:
                stack.pop()
            if stack:
                selfs[stack[-1][1]] -= float(e["dur"])
            stack.append((end, i))
        out += [(e["name"], max(s, 0.0)) for e, s in zip(evs, selfs)]
    return out


def family_times(trace, device: str = "cuda") -> dict:
    """Time per family of a Chrome trace (a path, the parsed JSON or its event list).

    ``device="cuda"``: the GPU's kernels, memcpys and memsets (their durations); ``"cpu"``: every operator's
    self time. Returns ``{"total_us", "families": {key: {"us", "count", "ours_us", "top": [(name, us)]}}}``."""
    events = _events(trace)
    if device == "cuda":
        items = [(e["name"], float(e.get("dur", 0.0))) for e in events
                 if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"]
    else:
        items = _cpu_self_times(events)
    fams = {k: {"us": 0.0, "count": 0, "ours_us": 0.0, "names": Counter()} for k, _ in FAMILIES}
    for name, us in items:
        f = fams[classify(name)]
        f["us"] += us
        f["count"] += 1
        if is_ours(name):
            f["ours_us"] += us
        f["names"][name] += us
    total = sum(f["us"] for f in fams.values())
    for f in fams.values():
        f["top"] = [(n, us) for n, us in f.pop("names").most_common(3)]
    return {"total_us": total, "families": fams}


def _short(name: str, width: int = 90) -> str:
    """A kernel name without its argument list and template arguments, shortened for a table cell."""
    s = name.replace("(anonymous namespace)::", "")
    depth, out = 0, []
    for ch in s:
        if ch == "<":
            depth += 1
            if depth == 1:
                out.append("<...>")
            continue
        if ch == ">" and depth:
            depth -= 1
            continue
        if depth == 0:
            out.append(ch)
    s = "".join(out)
    if not s.startswith("Memcpy") and not s.startswith("Memset"):
        s = s.split("(", 1)[0]
    s = s.replace("void ", "").replace("|", "/").strip()
    return s if len(s) <= width else s[: width - 3] + "..."


# ---- peak memory ------------------------------------------------------------------------------------------

def _cpu_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak CPU bytes allocated by torch during fn() above what was allocated before it (the profiler's
    memory events: 'Total Allocated' after each allocation and free)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mem.json")
        prof.export_chrome_trace(path)
        events = _events(path)
    mem = [e["args"] for e in events if e.get("name") == "[memory]" and int(e.get("args", {}).get("Device Type", -1)) == 0]
    if not mem:
        return 0
    start = float(mem[0]["Total Allocated"]) - float(mem[0]["Bytes"])
    return int(max(float(m["Total Allocated"]) for m in mem) - start)


def peak_memory_bytes(fn: Callable[[], Any], device: str) -> int:
    """Peak bytes allocated during one fn() call above those allocated before it: on CUDA
    ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``; on the CPU the profiler's
    memory events. fn runs once before, untimed and unmeasured (workspaces, handles, lazy init)."""
    if device == "cuda":
        out = fn()
        del out
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        torch.cuda.empty_cache()
        return int(peak)
    out = fn()
    del out
    return _cpu_peak_bytes(fn)


# ---- the memory table (the seed's "Memory Usage Analysis", measured) ----------------------------------

MEMORY_SHAPES = {
    # matmul: M=N=K; attention: B, H, N, D (non-causal, as bench/benchmark_attention.py --memory); moe: T tokens,
    # d_model, d_ff, experts, top_k (bench/benchmark_moe.py's layer shape)
    "cuda": {"dtype": torch.bfloat16, "matmul": 4096, "attention": (1, 16, 8192, 128),
             "moe": (8192, 4096, 14336, 8, 2)},
    "cpu": {"dtype": torch.float32, "matmul": 64, "attention": (1, 2, 128, 32), "moe": (64, 32, 64, 8, 2)},
}


def _naive_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v with the (B, H, N, N) scores and probabilities materialized, in q's dtype
    (the textbook form; q, k, v (B, H, N, D))."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _dense_mask_moe(x, router_weight, w13, w2, top_k):
    """An MoE layer as a loop over the experts with dense masks: every expert runs on every token and its
    output is multiplied by the token's routing weight (0 where the expert was not chosen)."""
    logits = x.float() @ router_weight.float().t()
    probs = torch.softmax(logits, -1)
    top_w, top_i = probs.topk(top_k, -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    dense = torch.zeros_like(probs).scatter(1, top_i, top_w).to(x.dtype)  # (T, E), zero where not chosen
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e]).chunk(2, -1)
        out = out + dense[:, e:e + 1] * ((torch.nn.functional.silu(gate) * up) @ w2[e])
    return out


def memory_table(device: str = "cuda", *, shapes: Optional[dict] = None, directions=("fwd", "fwd+bwd"),
                 log: Callable[[str], None] = print) -> list[dict]:
    """Peak memory above the inputs of naive vs optimized implementations of three ops, measured here.

    Rows: ``{"op", "impl", "role" ("naive" | "optimized" | "peer"), "direction", "shape", "dtype",
    "peak_bytes", "status", "reason", "what"}``. ``fwd`` runs under ``torch.no_grad()``; ``fwd+bwd`` is the
    forward with autograd and ``torch.autograd.grad`` of every input (the weights included: their gradients
    count). Inputs are allocated before the measurement and not counted."""
    import optimized_ops as oo

    cfg = dict(MEMORY_SHAPES["cuda" if device == "cuda" else "cpu"])
    cfg.update(shapes or {})
    dtype = cfg["dtype"]
    dname = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    gen = torch.Generator(device=device).manual_seed(20)
    rows: list[dict] = []

    def rand(*shape, scale=1.0, grad=False):
        t = (torch.rand(*shape, generator=gen, device=device, dtype=torch.float32) * 2 - 1).mul_(scale).to(dtype)
        return t.requires_grad_(grad)

    def measure(op, impl, role, direction, shape, what, fn, inputs):
        r = {"op": op, "impl": impl, "role": role, "direction": direction, "shape": shape, "dtype": dname,
             "device": device, "peak_bytes": None, "status": "ok", "reason": "", "what": what}
        grads = [t for t in inputs if t.requires_grad]

        def call():
            if direction == "fwd":
                with torch.no_grad():
                    return fn()
            out = fn()
            g = torch.autograd.grad(out, grads, torch.ones_like(out))
            return (out, g)

        try:
            r["peak_bytes"] = peak_memory_bytes(call, device)
            log(f"  memory {op} {impl:>26} {direction:>7}: {r['peak_bytes'] / 2**20:10.1f} MiB above the inputs")
        except Exception as e:  # noqa: BLE001 - out of memory or an unsupported rung: reported in the row
            r["status"] = "skipped" if isinstance(e, torch.cuda.OutOfMemoryError) else "failed"
            r["reason"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            log(f"  memory {op} {impl} {direction}: {r['reason']}")
        if device == "cuda":
            torch.cuda.empty_cache()
        rows.append(r)

    # -- MatMul N x N x N
    n = cfg["matmul"]
    a, b = rand(n, n), rand(n, n)
    shape = f"{n}x{n}x{n}"
    measure("matmul", "torch fp32 upcast", "naive", "fwd", shape,
            "(a.float() @ b.float()).to(dtype): the inputs copied to fp32, an fp32 result, rounded",
            lambda: (a.float() @ b.float()).to(dtype), [a, b])
    ok, why = oo.variant_supports("naive" if device == "cuda" else "cpu_naive", dtype, device)
    naive_rung = "naive" if device == "cuda" else "cpu_naive"
    if ok:
        measure("matmul", f"ours {naive_rung} rung", "naive", "fwd", shape,
                f"optimized_ops.matmul(a, b, variant='{naive_rung}'): a thread per output",
                lambda: oo.matmul(a, b, variant=naive_rung), [a, b])
    measure("matmul", "ours auto", "optimized", "fwd", shape, "optimized_ops.matmul(a, b)",
            lambda: oo.matmul(a, b), [a, b])
    measure("matmul", "torch.matmul", "peer", "fwd", shape, "torch.matmul(a, b) (cuBLAS on CUDA)",
            lambda: torch.matmul(a, b), [a, b])
    del a, b

    # -- attention B x H x N x D, non-causal
    bb, h, nn_, d = cfg["attention"]
    shape = f"B{bb} H{h} N{nn_} D{d}"
    for direction in directions:
        grad = direction != "fwd"
        q, k, v = (rand(bb, nn_, h, d, grad=grad) for _ in range(3))  # (B, S, H, D): flash-attn's layout
        measure("attention", "torch materialized", "naive", direction, shape,
                "softmax(q k^T / sqrt(d)) v in torch: the (B, H, N, N) scores and probabilities in memory",
                lambda: _naive_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2),
                [q, k, v])
        if device == "cuda" and "naive" in oo.attention_variants():
            measure("attention", "ours naive rung", "naive", direction, shape,
                    "optimized_ops.flash_attention(variant='naive'): fp32 scores in a workspace",
                    lambda: oo.flash_attention(q, k, v, variant="naive"), [q, k, v])
        measure("attention", "ours flash (auto)", "optimized", direction, shape,
                "optimized_ops.flash_attention(q, k, v): tiles in on-chip memory, O(N) state",
                lambda: oo.flash_attention(q, k, v), [q, k, v])
        del q, k, v

    # -- MoE: T tokens, E experts, top-k, SwiGLU experts
    t, dm, dff, e, topk = cfg["moe"]
    shape = f"T{t} d{dm} d_ff{dff} E{e} top{topk}"
    for direction in directions:
        grad = direction != "fwd"
        x = rand(t, dm, grad=grad)
        rw = rand(e, dm, scale=dm ** -0.5, grad=grad)
        w13 = rand(e, dm, 2 * dff, scale=dm ** -0.5, grad=grad)
        w2 = rand(e, dff, dm, scale=dff ** -0.5, grad=grad)
        measure("moe", "torch dense-mask loop", "naive", direction, shape,
                "a loop over the experts, each on every token, times a dense (T, E) routing weight",
                lambda: _dense_mask_moe(x, rw, w13, w2, topk), [x, rw, w13, w2])
        measure("moe", "ours moe_layer", "optimized", direction, shape,
                "optimized_ops.moe_layer: routed tokens permuted, grouped GEMMs over T*k rows",
                lambda: oo.moe_layer(x, rw, w13, w2, topk)[0], [x, rw, w13, w2])
        del x, rw, w13, w2
    return rows


def memory_pivot(rows: list[dict]) -> list[dict]:
    """One line per (op, direction): the naive and optimized headline rows and the ratio naive / optimized."""
    out = []
    keys = list(dict.fromkeys((r["op"], r["direction"]) for r in rows))
    for op, direction in keys:
        sel = [r for r in rows if (r["op"], r["direction"]) == (op, direction) and r["status"] == "ok"]
        naive = next((r for r in sel if r["role"] == "naive"), None)
        best = next((r for r in sel if r["role"] == "optimized"), None)
        line = {"op": op, "direction": direction, "shape": (naive or best or {"shape": "-"})["shape"],
                "naive": naive["impl"] if naive else None, "naive_bytes": naive["peak_bytes"] if naive else None,
                "optimized": best["impl"] if best else None,
                "optimized_bytes": best["peak_bytes"] if best else None, "reduction": None}
        if naive and best and best["peak_bytes"]:
            line["reduction"] = naive["peak_bytes"] / best["peak_bytes"]
        out.append(line)
    return out


# ---- the profile ------------------------------------------------------------------------------------------

def _model_device(model) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _vocab(model, vocab_size) -> int:
    if vocab_size:
        return int(vocab_size)
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if v is None:
        raise ValueError("profile: vocab_size: the model has no config.vocab_size; pass vocab_size=")
    return int(v)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device, enabled):
    if enabled:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss_of(out, targets):
    if isinstance(out, (tuple, list)):
        out = out[0]
    if out.dim() == 0:
        return out.float()
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), targets.reshape(-1))


def _generate_call(model, prompt, new_tokens, generate_kwargs):
    from .generation import generate  # the models' decode loop (paged KV + CUDA graphs for ours)

    import inspect

    kwargs = {"temperature": 0.0, "top_k": None, "top_p": None}  # greedy
    if getattr(model, "reference", False) and getattr(getattr(model, "config", None), "moe", None) is not None:
        kwargs["cuda_graphs"] = False  # the reference MoE's host-side expert loop cannot be captured
    kwargs.update(generate_kwargs or {})
    params = inspect.signature(generate).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return generate(model, prompt, new_tokens, **kwargs)


def _release_graphs(model):
    try:
        from .generation import release_decode_graphs
    except ImportError:
        return
    release_decode_graphs(model)


def _phase_table(ft: dict, steps: int) -> list[dict]:
    total = ft["total_us"] or 1.0
    rows = []
    for key, label in FAMILIES:
        f = ft["families"][key]
        rows.append({"family": key, "label": label, "ms_per_step": f["us"] / 1e3 / max(steps, 1),
                     "total_ms": f["us"] / 1e3, "share": f["us"] / total, "count": f["count"],
                     "ours_share": (f["ours_us"] / f["us"]) if f["us"] else None,
                     "top": [{"name": n, "short": _short(n), "ms": us / 1e3} for n, us in f["top"]]})
    return rows


def _machine(device) -> dict:
    m = {"device": device.type, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
         "cpu_threads": os.cpu_count()}
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
    return m


def _count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # (parameters() yields a tied weight once)


def profile(model: torch.nn.Module, *, train_steps: int = 3, decode_steps: int = 16, batch: int = 4,
            seq: int = 256, prompt_len: Optional[int] = None, decode_batch: Optional[int] = None,
            out_dir: str = "profile", warmup_steps: int = 1, lr: float = 1e-4, bf16: Optional[bool] = None,
            decode_dtype: Optional[torch.dtype] = None, generate_kwargs: Optional[dict] = None,
            memory: bool = True, memory_shapes: Optional[dict] = None, vocab_size: Optional[int] = None,
            restore: bool = True, seed: int = 0, log: Callable[[str], None] = print) -> dict:
    """Profiles training and decode steps of ``model`` and writes the traces, the family tables and plot.

    Parameters
    ----------
    model : torch.nn.Module
        The :class:`optimized_ops.models.Transformer` contract: ``model(tokens, targets)`` -> scalar mean
        loss (or logits (B, S, V)); decoded through ``optimized_ops.models.generation.generate``. Its device
        is that of its parameters.
    train_steps : int
        Training steps profiled (forward, backward, AdamW step); 0 skips the phase. ``warmup_steps`` run
        before the profiler starts (lazy initialization, cuBLAS handles, the allocator's pools).
    decode_steps : int
        New tokens generated in the profiled decode (greedy); 0 skips the phase. One untimed ``generate``
        call runs first (it captures the CUDA graphs of our model), then the profiled one.
    batch, seq : int
        Training batch (sequences) and sequence length (tokens uniform in [0, vocab)).
    prompt_len, decode_batch : int, optional
        Decode prompt length (default ``seq // 2``) and batch (default ``batch``).
    out_dir : str
        Created; receives ``trace-train.json``, ``trace-decode.json``, ``profile.json``, ``profile.md`` and
        ``profile.png`` (matplotlib permitting).
    bf16 : bool, optional
        Train under bf16 autocast (default: on CUDA).
    decode_dtype : torch.dtype, optional
        The model is cast to it for the decode phase (default bf16 on CUDA, its own dtype on the CPU) and
        cast back afterwards.
    generate_kwargs : dict, optional
        Passed to ``generate`` (default greedy: ``temperature=0``).
    memory : bool
        Also measure the memory table (:func:`memory_table`; ``memory_shapes`` overrides its shapes).
    restore : bool
        Put the parameters back as they were after the (weight-updating) training steps.

    Returns
    -------
    dict
        The report written to ``profile.json``, with the paths written (``"trace_train"``,
        ``"trace_decode"``, ``"json"``, ``"markdown"``, ``"plot"``).
    """
    from torch.profiler import ProfilerActivity, profile as tprofile, record_function

    device = _model_device(model)
    is_cuda = device.type == "cuda"
    bf16 = is_cuda if bf16 is None else bool(bf16)
    vocab = _vocab(model, vocab_size)
    prompt_len = prompt_len or max(seq // 2, 1)
    decode_batch = decode_batch or batch
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    kind = "cuda" if is_cuda else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    report: dict = {"schema": SCHEMA, "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "machine": _machine(device),
                    "model": {"class": type(model).__name__, "parameters": _count_params(model),
                              "config": _config_dict(model)},
                    "settings": {"train_steps": train_steps, "decode_steps": decode_steps, "batch": batch,
                                 "seq": seq, "prompt_len": prompt_len, "decode_batch": decode_batch,
                                 "bf16_autocast": bf16, "warmup_steps": warmup_steps,
                                 "time_source": ("GPU kernels, memcpys and memsets of the trace" if is_cuda else
                                                 "CPU operators' self time (the trace's cpu_op events)")},
                    "phases": {}, "memory": [], "notes": []}
    saved = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if restore else None
    was_training = model.training

    # -- training steps
    if train_steps > 0:
        model.train()
        opt_kwargs = {"lr": lr}
        if is_cuda:
            opt_kwargs["fused"] = True
        params = [p for p in model.parameters() if p.requires_grad]
        try:
            opt = torch.optim.AdamW(params, **opt_kwargs)
        except (RuntimeError, ValueError, TypeError):
            opt = torch.optim.AdamW(params, lr=lr)
        batches = [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(2)]

        def step(i):
            tok = batches[i % len(batches)]
            inputs, targets = tok[:, :-1], tok[:, 1:]
            with _autocast(device, bf16):
                loss = _loss_of(model(inputs, targets), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for i in range(warmup_steps):
            step(i)
        _sync(device)
        log(f"profile: {train_steps} training steps (batch {batch} x seq {seq}) on {device}")
        with tprofile(activities=activities) as prof:
            t0 = time.perf_counter()
            for i in range(train_steps):
                with record_function(f"train_step_{i}"):
                    step(i)
            _sync(device)
            wall = time.perf_counter() - t0
        path = out / "trace-train.json"
        prof.export_chrome_trace(str(path))
        ft = family_times(path, kind)
        report["phases"]["train"] = {"steps": train_steps, "tokens_per_step": batch * seq,
                                     "wall_ms_per_step": wall * 1e3 / train_steps,
                                     "busy_ms_per_step": ft["total_us"] / 1e3 / train_steps,
                                     "families": _phase_table(ft, train_steps), "trace": str(path)}
        report["trace_train"] = str(path)
        del opt, batches, prof
        if is_cuda:
            torch.cuda.empty_cache()

    # -- decode steps
    if decode_steps > 0:
        model.eval()
        cast = decode_dtype if decode_dtype is not None else (torch.bfloat16 if is_cuda else None)
        orig_dtype = next(iter(model.parameters())).dtype
        cast = None if cast == orig_dtype else cast
        pre_cast = None
        if cast is not None:
            pre_cast = {k: v.detach().clone() for k, v in model.state_dict().items()}  # a round trip would round
            model.to(cast)
        prompt = torch.randint(0, vocab, (decode_batch, prompt_len), generator=gen).to(device)
        try:
            with torch.no_grad():
                _generate_call(model, prompt, decode_steps, generate_kwargs)  # warm-up: graphs captured here
                _sync(device)
                log(f"profile: decode of {decode_steps} tokens (batch {decode_batch}, prompt {prompt_len})")
                with tprofile(activities=activities) as prof:
                    t0 = time.perf_counter()
                    with record_function("generate"):
                        _generate_call(model, prompt, decode_steps, generate_kwargs)
                    _sync(device)
                    wall = time.perf_counter() - t0
            path = out / "trace-decode.json"
            prof.export_chrome_trace(str(path))
            ft = family_times(path, kind)
            report["phases"]["decode"] = {"steps": decode_steps, "tokens_per_step": decode_batch,
                                          "prompt_len": prompt_len,
                                          "wall_ms_per_step": wall * 1e3 / decode_steps,
                                          "busy_ms_per_step": ft["total_us"] / 1e3 / decode_steps,
                                          "families": _phase_table(ft, decode_steps), "trace": str(path),
                                          "note": "one generate call: the prefill of the prompt, then "
                                                  f"{decode_steps} decode steps; per step = total / {decode_steps}"}
            report["trace_decode"] = str(path)
            del prof
        finally:
            _release_graphs(model)
            if cast is not None:
                model.to(orig_dtype)
                model.load_state_dict(pre_cast)
                del pre_cast
    if saved is not None:
        model.load_state_dict(saved)
    model.train(was_training)

    # -- memory table
    if memory:
        log("profile: memory table (peak bytes above the inputs)")
        rows = memory_table(kind, shapes=memory_shapes, log=log)
        report["memory"] = rows
        report["memory_pivot"] = memory_pivot(rows)
        report["notes"].append(
            "memory: peak = " + ("torch.cuda.max_memory_allocated() after reset_peak_memory_stats()" if is_cuda else
                                 "the highest 'Total Allocated' of the profiler's CPU memory events")
            + " during one call, minus the bytes allocated before it (the inputs); one unmeasured call first; "
              "fwd under torch.no_grad(), fwd+bwd = forward + torch.autograd.grad of every input")

    json_path = out / "profile.json"
    md_path = out / "profile.md"
    report["json"], report["markdown"] = str(json_path), str(md_path)
    try:
        png = _plot(report, out / "profile.png")
        if not png:
            report["notes"].append("no plot: matplotlib is not installed")
    except Exception as e:  # noqa: BLE001 - a plot must not lose the measurements
        png = None
        report["notes"].append(f"no plot: {type(e).__name__}: {e}")
    report["plot"] = str(png) if png else None
    json_path.write_text(json.dumps(_clean(report), indent=2) + "\n")
    md_path.write_text(render_markdown(report) + "\n")
    log(f"profile: wrote {md_path}, {json_path}" + (f", {png}" if png else "")
        + "".join(f", {report[k]}" for k in ("trace_train", "trace_decode") if report.get(k)))
    return report


def _config_dict(model) -> Optional[dict]:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    import dataclasses

    if dataclasses.is_dataclass(cfg):
        try:
            return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
        except (TypeError, ValueError):
            pass
    return {"repr": repr(cfg)}


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


# ---- output -----------------------------------------------------------------------------------------------

def _mib(b):
    if b is None:
        return "-"
    mib = b / 2**20
    return f"{mib:.1f}" if mib >= 10 else f"{mib:.3g}"


def render_markdown(report: dict) -> str:
    m = report["machine"]
    where = m.get("gpu") or f"CPU ({m.get('cpu')}, {m.get('cpu_threads')} threads)"
    mod = report["model"]
    out = [f"# Profile of {mod['class']} ({mod['parameters'] / 1e6:.1f}M parameters) on {where}", "",
           f"Run {report['created']}, torch {m['torch']}; time: {report['settings']['time_source']}.", ""]
    for phase, ph in report["phases"].items():
        what = (f"{ph['steps']} training steps of {ph['tokens_per_step']} tokens" if phase == "train" else
                f"a prompt of {ph['prompt_len']} then {ph['steps']} decode steps of {ph['tokens_per_step']} tokens")
        busy = ph["busy_ms_per_step"]
        out += [f"## {phase}: {what}", "",
                f"Per step: {busy:.3f} ms in the families below, {ph['wall_ms_per_step']:.3f} ms of wall time "
                "under the profiler"
                + (f" ({busy / ph['wall_ms_per_step'] * 100:.0f}% busy)" if ph["wall_ms_per_step"] else "") + ".",
                "", "| family | ms / step | share | ours | count | top kernels (ms) |", "|---|---:|---:|---:|---:|---|"]
        for r in ph["families"]:
            if not r["count"]:
                continue
            top = "; ".join(f"`{t['short']}` {t['ms']:.3f}" for t in r["top"])
            ours = "-" if r["ours_share"] is None else f"{r['ours_share'] * 100:.0f}%"
            out.append(f"| {r['label']} | {r['ms_per_step']:.3f} | {r['share'] * 100:.1f}% | {ours} | {r['count']} "
                       f"| {top} |")
        if ph.get("note"):
            out += ["", ph["note"]]
        out += ["", f"Trace: `{ph['trace']}`", ""]
    if report.get("memory"):
        out += ["## Memory Usage Analysis (peak above the inputs, measured)", "",
                "| op | shape | direction | naive | naive MiB | optimized | optimized MiB | reduction |",
                "|---|---|---|---|---:|---|---:|---:|"]
        for p in report.get("memory_pivot", []):
            red = "-" if p["reduction"] is None else f"{p['reduction']:.1f}x"
            out.append(f"| {p['op']} | {p['shape']} | {p['direction']} | {p['naive'] or '-'} | {_mib(p['naive_bytes'])} "
                       f"| {p['optimized'] or '-'} | {_mib(p['optimized_bytes'])} | {red} |")
        out += ["", "Every implementation measured:", "", "| op | impl | role | direction | dtype | MiB | what |",
                "|---|---|---|---|---|---:|---|"]
        for r in report["memory"]:
            mib = _mib(r["peak_bytes"]) if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            out.append(f"| {r['op']} | {r['impl']} | {r['role']} | {r['direction']} | {r['dtype']} | {mib} | {r['what']} |")
        out.append("")
    if report.get("notes"):
        out += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(out).rstrip()


def _plot(report: dict, path: pathlib.Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    phases = list(report["phases"].items())
    panels = len(phases) + (1 if report.get("memory_pivot") else 0)
    if not panels:
        return None
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    for ax, (phase, ph) in zip(axes[0], phases):
        rows = [r for r in ph["families"] if r["count"]]
        labels = [r["label"] for r in rows]
        ours = [r["ms_per_step"] * (r["ours_share"] or 0.0) for r in rows]
        rest = [r["ms_per_step"] - o for r, o in zip(rows, ours)]
        ys = range(len(rows))
        ax.barh(ys, ours, color="#1f77b4", label="optimized_ops kernels")
        ax.barh(ys, rest, left=ours, color="#ff7f0e", label="torch / cuBLAS / other")
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step")
        ax.set_title(f"{phase} ({ph['busy_ms_per_step']:.2f} ms busy / {ph['wall_ms_per_step']:.2f} ms wall per step)",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="x", alpha=0.3)
    if report.get("memory_pivot"):
        ax = axes[0][-1]
        piv = report["memory_pivot"]
        xs = range(len(piv))
        ax.bar([x - 0.2 for x in xs], [(p["naive_bytes"] or 0) / 2**20 for p in piv], 0.4, label="naive",
               color="#d62728")
        ax.bar([x + 0.2 for x in xs], [(p["optimized_bytes"] or 0) / 2**20 for p in piv], 0.4, label="optimized",
               color="#2ca02c")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{p['op']}\n{p['direction']}" for p in piv], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("MiB above the inputs (log)")
        ax.set_title("peak memory", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']['class']} on {report['machine'].get('gpu') or 'CPU'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---- command line -----------------------------------------------------------------------------------------

SMOKE_CONFIG = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128, vocab_size=256, max_seq_len=64)


def _build_model(args, device):
    from . import Transformer, TransformerConfig
    from .config import MoEConfig

    moe = MoEConfig(num_experts=8, top_k=2) if args.moe else None
    if args.smoke:
        cfg = TransformerConfig(**SMOKE_CONFIG, moe=moe)
    else:
        from . import OptimizedTransformer

        base = OptimizedTransformer(moe=moe) if moe is not None else OptimizedTransformer()
        cfg = base.config
        if not args.reference:
            return base.to(device)
        del base
    return Transformer(cfg, reference=args.reference).to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m optimized_ops.models.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, seconds (the test)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where present; cpu with --smoke)")
    p.add_argument("--moe", action="store_true", help="the MoE variant (8 experts, top-2)")
    p.add_argument("--reference", action="store_true", help="profile the plain-torch reference model")
    p.add_argument("--train-steps", type=int, default=None)
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--decode-batch", type=int, default=None)
    p.add_argument("--no-memory", action="store_true", help="leave out the memory table")
    p.add_argument("--memory-only", action="store_true", help="only the memory table")
    p.add_argument("--out", default=None, help="output directory (default profile-results/<device>)")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda"))
    kind = device.type
    out_dir = args.out or os.path.join("profile-results", kind)
    if args.memory_only:
        rows = memory_table(kind)
        report = {"schema": SCHEMA, "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "machine": _machine(device), "model": {"class": "-", "parameters": 0},
                  "settings": {"time_source": "-"}, "phases": {}, "memory": rows, "memory_pivot": memory_pivot(rows),
                  "notes": []}
        pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(out_dir) / "memory.json").write_text(json.dumps(_clean(report), indent=2) + "\n")
        (pathlib.Path(out_dir) / "memory.md").write_text(render_markdown(report) + "\n")
        print(render_markdown(report))
        return 1 if any(r["status"] == "failed" for r in rows) else 0
    if smoke_threads := (args.smoke and device.type == "cpu" and torch.get_num_threads() > 1):
        torch.set_num_threads(1)  # a tiny model: OpenMP barriers cost more than its work (see bench/benchmark_models.py)
    torch.manual_seed(0)
    model = _build_model(args, device)
    smoke = args.smoke
    report = profile(model, train_steps=args.train_steps or (2 if smoke else 3),
                     decode_steps=args.decode_steps or (4 if smoke else 32),
                     batch=args.batch or (2 if smoke else 16), seq=args.seq or (32 if smoke else 1024),
                     prompt_len=args.prompt_len or (8 if smoke else 512),
                     decode_batch=args.decode_batch or (2 if smoke else 32), warmup_steps=1,
                     out_dir=out_dir, memory=not args.no_memory)
    if smoke_threads:
        report["notes"].append("the smoke run profiles on one CPU thread")
    print(render_markdown(report))
    return 1 if any(r["status"] == "failed" for r in report.get("memory", [])) else 0


if __name__ == "__main__":
    sys.exit(main())
