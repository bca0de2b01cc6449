#!/usr/bin/env python3
"""Python benchmark of the models family (issue 20's targets): optimized_ops.models.Transformer trained and decoded
against the same architecture in torch eager (Transformer(config, reference=True)) and torch.compile of it, and
training from the streaming loader against training from tensors already in GPU memory, in one run.

    python bench/benchmark_models.py [--device cuda|cpu] [--models-cases train,train_moe,decode,loader]
        [--models-steps 4] [--no-compile] [--quick] [--smoke] [--out bench/results]

is `python bench/benchmark_all.py --ops models ...` (bench/runner.py: the harness, statistics, CUDA-event timing,
ceilings, output files, the registry). `--smoke` = `--device cpu --quick --models-smoke`: tiny configs on the CPU,
seconds (the test); a CPU run always uses the tiny configs (a 124M model does not train on a CPU in a benchmark).

Cases (the row field "case"; CUDA shapes, bf16 autocast on fp32 parameters for training, bf16 weights for decode):
  train      one training step (forward, backward, AdamW step: fused=True on CUDA, lr 1e-4, same for every
             implementation) of the 124M model, GPT-2 small's shape (TransformerConfig() defaults: d_model 768,
             12 heads, 12 layers, vocab 50257, SwiGLU d_ff 2048, RMSNorm, RoPE, tied embeddings), batch 16 x seq 1024:
               ours           Transformer(config): the library's modules (flash attention, fused norms, RoPE, linear +
                              cross-entropy ...)
               torch_eager    Transformer(config, reference=True): the same architecture in plain torch
                              (the baseline: vs_baseline = vs_eager = its time / the row's; target >= 1.5x)
               torch_compile  torch.compile(the reference) (mode default; compiled by the validation step, outside
                              the timed region): vs_compile = its time / the row's (target >= 1.1x)
  train_moe  the same with moe=MoEConfig(num_experts=8, top_k=2) (each expert the dense MLP's size, dropless):
             ours vs torch_eager (the reference's loop over the experts; target >= 2x); torch.compile of it only with
             --models-moe-compile (a data-dependent loop: graph breaks, not a target)
  decode     greedy generation, B = 1 and 32, a prompt of 512 random tokens, 256 new tokens, the weights in bf16:
               ours           optimized_ops.models.generate(model, ...): prefill, then decode steps on the paged KV
                              cache, each step a CUDA-graph replay (cuda_graphs=True)
               torch_eager    generate() of the reference model: a static KV cache (index_copy_ + mask), eager steps
                              (cuda_graphs=False) (the baseline; target >= 2x)
               torch_compile  the reference with model.forward_cached (prefill and decode step) compiled by
                              torch.compile(mode="reduce-overhead", dynamic=False) (CUDA graphs by inductor), as
                              generation.py prescribes; target >= 1.0x
             Both references keep one static cache across generate calls (allocated by the first, as ours keeps its
             paged cache with its graph; for torch.compile a new cache per call would recompile: its tensors are
             marked static addresses, which dynamo guards by identity).
             time = one generate call (prefill + 256 steps); tokens/s = B x 256 / time; ms_per_token = time / 256
  loader     the train case's step of ours fed from (a) gpu_tensors: batches sliced from the token records already on
             the GPU (the baseline), (b) loader: optimized_ops.data.StreamingLoader over the same records written as
             shards (optimized_ops.models.training.write_token_shards of synthetic_corpus: no download), shuffled,
             prefetch 4, uint16 records converted to int64 on the GPU; vs_baseline = gpu_tensors time / loader time
             (target: the same tokens/s, ~1.0); loader_wait_ms = the loader's consumer wait per step (0: the input
             never stalled the step). The shards are just written, so io=auto reads them from the page cache (the
             loader's notes say what it picked); --models-data DIR reads an existing dataset of seq+1-token records
             instead (at most 8 GiB: the baseline holds all of it in GPU memory), e.g. one on NVMe dropped from the
             page cache, to feed the step from the disk.

--models-merge keeps the other cases' rows of the python-models.json already under --out, so that the cases can be run
as separate commands (e.g. train,train_moe then decode,loader) into one file.

A sample of the train and loader cases is --models-steps consecutive optimizer steps (default 4 on CUDA, 1 on the
CPU; rotating batches, one synchronisation at the end), reported per step; the runner's stopping rule decides the
sample count. tokens/s = tokens per step / median step time.

MFU (train cases) = model flops per step / step time / the GPU's dense bf16 peak from its datasheet (H100 SXM and
H200: 989.4 TFLOP/s; H100 PCIe 756; H100 NVL 835; A100 312; else none), flops per step = 6 N T + 12 L d S T (PaLM's
appendix B, as nanoGPT: T tokens per step, S the sequence length, L layers, d = n_heads x head_dim; attention counted
without the causal half), N the parameters in matmuls: every weight of >= 2 dimensions except the token embedding's
lookup, the LM head counted once (tied or not), expert weights times top_k / num_experts (the active parameters).
roofline_fraction = the same flops / time / the torch.matmul bf16 rate measured in this run (8192^3 on CUDA).

Validation (before timing):
  train, train_moe  the loss of each implementation's first step (from the same initial weights, on input set 0)
                    against the reference in float64 (Transformer(config, reference=True).double(), same weights, same
                    tokens) with the reduction rule (design.md): |loss - loss64| <= 2 |loss_eager - loss64| +
                    2 u |loss64| + 16 sqrt(n) 2^-24 |loss64| + floor, u = bf16's unit roundoff (fp32 on the CPU),
                    n = the tokens averaged; torch_eager is the same-dtype torch of the rule
  decode            each implementation's generated tokens, teacher-forced through the float64 reference (no cache):
                    every token must be the argmax up to the rounding: max logit - the token's logit <= 2 x the
                    rule's bound on a logit's error (2 max |logits of the reference in the decode dtype (bf16) -
                    float64 logits| + 2 u max |logits|): the chosen and the best logit may each be off by the bound
                    (on up to 4 sequences of the batch)
  loader            the first batch equals the records at the indices the loader reports (last_indices)
A failing row of ours is "failed" and not timed; a failing peer is noted and timed anyway.

Output: python-models.{json,md} (and .png with matplotlib) under --out/<gpu>/.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import math
import os
import pathlib
import re
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
from tolerance import reduction_allowed_error, unit_roundoff  # noqa: E402

CASES = ["train", "train_moe", "decode", "loader"]
LR = 1e-4

# The GPU's dense bf16 tensor-core peak (datasheets, without sparsity), matched on the device name in this order.
GPU_BF16_PEAKS = [
    (r"h100.*pcie", 756.0, "H100 PCIe dense bf16 (datasheet)"),
    (r"h100.*nvl", 835.0, "H100 NVL dense bf16 (datasheet)"),
    (r"h100|h800", 989.4, "H100 SXM dense bf16 (datasheet)"),
    (r"h200|gh200", 989.4, "H200 dense bf16 (datasheet)"),
    (r"a100", 312.0, "A100 dense bf16 (datasheet)"),
    (r"b200", 2250.0, "B200 dense bf16 (datasheet)"),
]

# Model shapes: "full" = the issue's (GPT-2 small's shape: TransformerConfig()'s defaults), "smoke" = tiny, for the CPU.
SMOKE_MODEL = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128, vocab_size=256, max_seq_len=64)
PLANS = {
    "full": {"model": {}, "train": (16, 1024), "decode": ([1, 32], 512, 256), "moe": (8, 2), "steps": 4,
             "decode_check_rows": 4, "corpus_batches": 64},
    "smoke": {"model": SMOKE_MODEL, "train": (2, 32), "decode": ([1, 2], 8, 4), "moe": (8, 2), "steps": 1,
              "decode_check_rows": 2, "corpus_batches": 8},
}


def _reason(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _autocast(device, bf16):
    return torch.autocast(device_type=device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def gpu_peak(device):
    """(TFLOP/s, label) of the device's dense bf16 peak, or (None, why)."""
    if device != "cuda":
        return None, "no datasheet peak on the CPU"
    name = torch.cuda.get_device_name(0)
    for rx, value, label in GPU_BF16_PEAKS:
        if re.search(rx, name.lower()):
            return value, f"{label}: {value} TFLOP/s ({name})"
    return None, f"no datasheet bf16 peak known for {name}"


def matmul_params(model, cfg) -> float:
    """N of the MFU's 6 N T: the parameters that take part in a matmul per token (see the module docstring)."""
    v, d = cfg.vocab_size, cfg.d_model
    seen, n = set(), 0.0
    for p in model.parameters():
        if id(p) in seen or p.dim() < 2:
            continue
        seen.add(id(p))
        if cfg.moe is not None and p.dim() == 3 and p.shape[0] == cfg.moe.num_experts:
            n += p.numel() * cfg.moe.top_k / cfg.moe.num_experts
        elif tuple(p.shape) in ((v, d), (d, v)):
            continue  # the embedding table and/or the LM head: the head's matmul is added once below
        else:
            n += p.numel()
    return n + v * d


def total_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # (parameters() yields a tied weight once)


def params_label(n) -> str:
    return f"{n / 1e6:.0f}M" if n >= 10e6 else f"{n / 1e6:.2g}M"


def step_flops(model, cfg, batch, seq):
    tokens = batch * seq
    n = matmul_params(model, cfg)
    attn = 12.0 * cfg.n_layers * cfg.n_heads * (cfg.d_model // cfg.n_heads) * seq * tokens
    return 6.0 * n * tokens + attn, n


def base_row(case, variant, device, dname, shape, label):
    return {"op": case, "family": "models", "case": case, "direction": "decode" if case == "decode" else "train_step",
            "variant": variant, "backend": device, "dtype": dname, "shape": shape, "shape_label": label,
            "threads": torch.get_num_threads() if device == "cpu" else None, "status": "ok", "reason": "",
            "validation": None, "time_ms": None, "flops": 0.0, "min_bytes": 0, "tflops": None, "gbps": None,
            "baseline": None, "vs_baseline": None, "roofline_fraction": None, "roofline_peak": None,
            "roofline_bandwidth": None, "kernel": None, "tokens_per_s": None, "mfu": None, "targets": {}}


def scale_stats(st, k):
    """Statistics of a sample of k steps as per-step statistics."""
    out = dict(st)
    for key in ("median", "p10", "p90", "mean"):
        if key in out:
            out[key] = out[key] / k
    return out


def models_api():
    """(optimized_ops.models, "") or (None, why it cannot be imported)."""
    try:
        import optimized_ops.models as m
        for name in ("Transformer", "TransformerConfig", "MoEConfig", "generate"):
            getattr(m, name)
    except Exception as e:  # noqa: BLE001
        return None, f"optimized_ops.models is not importable: {_reason(e)}"
    return m, ""


def make_config(m, plan, moe=False):
    cfg = dict(plan["model"])
    if moe:
        e, k = plan["moe"]
        cfg["moe"] = m.MoEConfig(num_experts=e, top_k=k)
    return m.TransformerConfig(**cfg)


# ---- training steps ----------------------------------------------------------------------------------------

class Trainer:
    """One implementation's model, optimizer and step."""

    def __init__(self, model, device, bf16, compiled=False):
        self.model = model
        self.fn = torch.compile(model) if compiled else model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = None
        if device == "cuda":
            try:
                self.opt = torch.optim.AdamW(params, lr=LR, fused=True)
            except (RuntimeError, ValueError, TypeError):
                self.opt = None
        self.opt = self.opt or torch.optim.AdamW(params, lr=LR)
        self.device, self.bf16 = device, bf16

    def step(self, tok):
        inputs, targets = tok[:, :-1], tok[:, 1:]
        with _autocast(self.device, self.bf16):
            out = self.fn(inputs, targets)
        loss = out if out.dim() == 0 else F.cross_entropy(out.float().flatten(0, 1), targets.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def new_model(m, cfg, state, device, reference):
    model = m.Transformer(cfg, reference=reference, device=device)
    model.load_state_dict(state)
    model.train()
    return model


def loss64(m, cfg, state, tok, device):
    """The float64 reference's loss on the batch (no autograd), from the same weights."""
    ref = m.Transformer(cfg, reference=True, device=device, dtype=torch.float64)
    ref.load_state_dict({k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state.items()})
    ref.train()
    with torch.no_grad():
        out = ref(tok[:, :-1], tok[:, 1:])
        if out.dim() != 0:
            out = F.cross_entropy(out.flatten(0, 1), tok[:, 1:].flatten())
    value = float(out)
    del ref, out
    _free(device)
    return value


def check_loss(loss, ref64, same, dname, n):
    err = abs(loss - ref64)
    same_err = abs(same - ref64)
    allowed = reduction_allowed_error(dname, n, same_err, abs(ref64), 0.0, 2.0**-24)
    return {"passed": bool(err <= allowed), "loss": loss, "loss_fp64": ref64, "error": err, "allowed": allowed,
            "same_dtype_error": same_err, "ratio": err / allowed if allowed else math.inf,
            "rule": "|loss - fp64| <= 2 |eager - fp64| + 2u|fp64| + 16 sqrt(n) 2^-24 |fp64| + floor"}


def token_sets(vocab, batch, seq, n, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(n)]


def train_rows(m, args, device, timer, ceilings, log, notes, plan, case):
    moe = case == "train_moe"
    cfg = make_config(m, plan, moe=moe)
    batch, seq = plan["train"]
    bf16 = device == "cuda"
    dname = "bf16" if bf16 else "fp32"
    k = args.models_steps or plan["steps"]
    torch.manual_seed(2020 + moe)
    init = m.Transformer(cfg, device=device)
    state = {key: v.detach().clone() for key, v in init.state_dict().items()}
    flops, n_params = step_flops(init, cfg, batch, seq)
    n_total = total_params(init)
    del init
    sets = token_sets(cfg.vocab_size, batch, seq, 3, device, 77 + moe)
    impls = ["ours", "torch_eager"]
    skip = {}
    if not moe or args.models_moe_compile:
        impls.append("torch_compile")
        if args.no_compile:
            skip["torch_compile"] = "--no-compile"
        elif args.models_smoke and not args.models_compile:
            skip["torch_compile"] = "left out of the smoke run (tiny CPU config; --models-compile forces it)"
    shape = {"batch": batch, "seq": seq, "d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
             "n_layers": cfg.n_layers, "d_ff": cfg.d_ff, "vocab": cfg.vocab_size,
             "experts": cfg.moe.num_experts if cfg.moe else 0, "top_k": cfg.moe.top_k if cfg.moe else 0,
             "matmul_params": n_params, "parameters": n_total, "steps_per_sample": k}
    label = (f"{params_label(n_total)}{' MoE E%d top%d' % (cfg.moe.num_experts, cfg.moe.top_k) if cfg.moe else ''} "
             f"B{batch} S{seq}")
    log(f"models {case}: {label} ({dname}, {k} steps per sample)")
    ref = loss64(m, cfg, state, sets[0], device)
    peak_tf, peak_label = gpu_peak(device)
    measured = next((c for c in ceilings if c["name"] == f"torch_matmul_{dname}"), None)

    # eager first: its first-step loss is the same-dtype torch of the validation rule
    order = [n for n in ("torch_eager", "ours", "torch_compile") if n in impls]
    rows = {name: base_row(case, name, device, dname, shape, label) for name in impls}
    same = None
    for name in order:
        r = rows[name]
        r["flops"] = flops
        r["flops_formula"] = "6 N T + 12 L d S T (PaLM; N = matmul parameters, active experts only)"
        if name in skip:
            r.update(status="skipped", reason=skip[name])
            continue
        tr = None
        try:
            if name == "torch_compile":
                torch._dynamo.reset()
            tr = Trainer(new_model(m, cfg, state, device, name != "ours"), device, bf16,
                         compiled=name == "torch_compile")
            first = float(tr.step(sets[0]))  # the validation step (and compilation, warm-up)
            tr.step(sets[1])
            _sync(device)
        except Exception as e:  # noqa: BLE001 - reported in the row
            r.update(status="failed" if name == "ours" else "skipped", reason=_reason(e))
            log(f"  {name}: {r['status']} {r['reason']}")
            del tr
            _free(device)
            continue
        if name == "torch_eager":
            same = first
        elif same is None:
            notes.append(f"models {case}: no torch_eager loss for the rule's same-dtype error: taken as 0")
            same = ref
        v = check_loss(first, ref, same, dname, batch * seq)
        r["validation"] = v
        log(f"  {name:>14}: first-step loss {first:.6g} (fp64 {ref:.6g}, error {v['error']:.3g}, "
            f"allowed {v['allowed']:.3g})")
        if not v["passed"]:
            if name == "ours":
                r.update(status="failed", reason=f"validation: loss {first:.6g} vs fp64 {ref:.6g}, error "
                                                 f"{v['error']:.3g} > allowed {v['allowed']:.3g}")
                del tr
                _free(device)
                continue
            notes.append(f"models {case} {name} failed validation (error {v['error']:.3g} > {v['allowed']:.3g}): "
                         "timed anyway")
        n = len(sets)
        cursor = {"i": 0}

        def run(i, tr=tr):
            for _ in range(k):
                tr.step(sets[cursor["i"] % n])
                cursor["i"] += 1

        try:
            st = scale_stats(timer.measure(run), k)
        except Exception as e:  # noqa: BLE001
            r.update(status="failed" if name == "ours" else "skipped", reason=_reason(e))
            log(f"  {name}: {r['status']} {r['reason']}")
            continue
        finally:
            del tr, run  # run's default holds the trainer: the next model must not share the memory with it
            if name == "torch_compile":
                torch._dynamo.reset()
            _free(device)
        finish_train_row(r, st, flops, batch * seq, peak_tf, peak_label, measured)
        log(f"  {name:>14}: {st['median']:.4g} ms/step [{st['p10']:.4g}-{st['p90']:.4g}] "
            f"{r['tokens_per_s']:,.0f} tokens/s" + (f", MFU {r['mfu'] * 100:.1f}%" if r["mfu"] else ""))
    targets = {"vs_eager": 2.0} if moe else {"vs_eager": 1.5, "vs_compile": 1.1}
    ratios(rows, targets, "torch_eager (Transformer(config, reference=True))")
    del sets, state
    _free(device)
    return list(rows.values())


def finish_train_row(r, st, flops, tokens, peak_tf, peak_label, measured):
    r["time_ms"] = runner.stats_json(st)
    sec = st["median"] * 1e-3
    r["tokens_per_s"] = tokens / sec
    r["tflops"] = flops / sec / 1e12
    if peak_tf:
        r["mfu"] = r["tflops"] / peak_tf
        r["mfu_peak"] = {"name": peak_label, "value": peak_tf, "unit": "TFLOP/s"}
    if measured:
        r["roofline_peak"] = {"name": f"{measured['name']} {measured['shape']}", "value": measured["value"],
                              "unit": "TFLOP/s"}
        r["roofline_fraction"] = r["tflops"] / measured["value"]


def ratios(rows, targets, baseline_name):
    """vs_eager (= vs_baseline), vs_compile and whether each target is met, on ours' rows and the peers'."""
    def ok(name):
        r = rows.get(name)
        return r if r and r["status"] == "ok" and r["time_ms"] else None

    eager, comp = ok("torch_eager"), ok("torch_compile")
    for name, r in rows.items():
        if not ok(name):
            continue
        t = r["time_ms"]["median"]
        if eager and name != "torch_eager":
            r["baseline"] = {"name": baseline_name, "time_ms": eager["time_ms"], "tflops": eager.get("tflops"),
                             "validation": eager["validation"]}
            r["vs_baseline"] = r["vs_eager"] = eager["time_ms"]["median"] / t
        if comp and name != "torch_compile":
            r["vs_compile"] = comp["time_ms"]["median"] / t
        if name == "ours" or name.startswith("ours"):
            r["targets"] = {key: {"target": value, "value": r.get(key),
                                  "met": None if r.get(key) is None else bool(r[key] >= value)}
                            for key, value in targets.items()}


# ---- decode -----------------------------------------------------------------------------------------------

def _generate_kwargs(generate, wanted):
    params = inspect.signature(generate).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return dict(wanted)
    missing = [k for k in wanted if k not in params]
    if missing:
        raise TypeError(f"generate() takes no {', '.join(missing)} (its parameters: {', '.join(params)})")
    return dict(wanted)


def new_tokens_of(out, batch, prompt, new):
    """The (B, new) generated tokens from generate's result (the whole sequences or only the new tokens)."""
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 2:
        out = out[0]
    if hasattr(out, "tokens") and not isinstance(out, torch.Tensor):
        out = out.tokens
    if isinstance(out, torch.Tensor):
        if out.shape == (batch, prompt + new):
            return out[:, prompt:]
        if out.shape == (batch, new):
            return out
    if isinstance(out, (list, tuple)) and len(out) == batch:
        rows = [torch.as_tensor(o).reshape(-1) for o in out]
        rows = [r_[prompt:] if r_.numel() == prompt + new else r_ for r_ in rows]
        if all(r_.numel() == new for r_ in rows):
            return torch.stack(rows)
    raise ValueError(f"generate returned {type(out).__name__} {getattr(out, 'shape', '')}: expected (B, P + N) or "
                     f"(B, N) tokens")


def check_decode(m, cfg, state32, prompt, gen_tokens, device, rows_checked, dtype):
    """Teacher-forced check of greedy tokens against the float64 reference (see the module docstring)."""
    b = min(rows_checked, prompt.shape[0])
    seqs = torch.cat([prompt[:b], gen_tokens[:b].to(prompt.device)], 1)
    p, n = prompt.shape[1], gen_tokens.shape[1]
    ref = m.Transformer(cfg, reference=True, device=device)
    ref.load_state_dict(state32)
    ref.eval()
    with torch.no_grad():
        ref.to(torch.float64)
        hi = ref(seqs)[:, p - 1:p - 1 + n]
        ref.to(dtype)
        lo = ref(seqs)[:, p - 1:p - 1 + n].double()
    del ref
    same = float((lo - hi).abs().max())
    # the rule's bound on a logit's error is 2 same + 2 u max|logit|; the chosen and the best logit may each be off
    # by it, so a greedy choice is right when its margin is within twice that
    allowed = 2.0 * (2.0 * same + 2.0 * unit_roundoff(dtype) * float(hi.abs().max()))
    chosen = hi.gather(-1, seqs[:, p:, None].long()).squeeze(-1)
    margin = hi.max(-1).values - chosen
    worst = float(margin.max())
    bad = (margin > allowed).nonzero()
    first = None
    if len(bad):
        first = f"sequence {int(bad[0][0])} token {int(bad[0][1])}: margin {float(margin[tuple(bad[0])]):.4g}"
    del hi, lo
    _free(device)
    return {"passed": worst <= allowed, "worst_margin": worst, "allowed": allowed, "same_dtype_error": same,
            "checked_sequences": b, "first_failure": first,
            "rule": "max logit - chosen logit (float64 reference, teacher-forced) <= 2 x (2 max |same-dtype "
                    "reference - float64| + 2u max |logit|): twice the rule's bound on a logit's error"}


def reuse_static_cache(model):
    """Makes ``model.make_cache`` return one StaticDecodeCache per (batch, length) for the model's life, as ours
    keeps its paged cache with its captured graph: the reference's cache is allocated once, not in every generate
    call (its reads are masked to each sequence's positions, so earlier contents are never seen). For
    torch.compile it is required: the cache's tensors are marked static (dynamo guards on their identity), so a new
    cache per call would recompile the step every call."""
    make = model.make_cache
    caches = {}

    def make_cache(batch_size, max_len=None, **kw):
        key = (batch_size, max_len, tuple(sorted(kw.items())))
        if key not in caches:
            caches[key] = make(batch_size, max_len, **kw)
        return caches[key]

    model.make_cache = make_cache


def decode_impls(m, args):
    """name -> (reference?, compile the decode step?, generate's keyword arguments), and name -> skip reason.

    torch_compile follows generation.py's recipe: ``model.forward_cached`` (the prefill and each decode step)
    compiled with ``mode="reduce-overhead"`` (inductor's CUDA graphs; the static cache's tensors are marked static
    for dynamo) and ``generate(..., cuda_graphs=False)``; dynamic=False, so the prefill and the decode step are two
    static graphs."""
    impls = {"ours": (False, False, {"use_cache": True, "cuda_graphs": True}),
             "torch_eager": (True, False, {"use_cache": True, "cuda_graphs": False}),
             "torch_compile": (True, True, {"use_cache": True, "cuda_graphs": False})}
    skip = {}
    if args.no_compile:
        skip["torch_compile"] = "--no-compile"
    elif args.models_smoke and not args.models_compile:
        skip["torch_compile"] = "left out of the smoke run (tiny CPU config; --models-compile forces it)"
    return impls, skip


def decode_rows(m, args, device, timer, ceilings, log, notes, plan):
    cfg = make_config(m, plan)
    batches, prompt_len, new = plan["decode"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dname = "bf16" if device == "cuda" else "fp32"
    torch.manual_seed(2021)
    init = m.Transformer(cfg, device=device)
    state32 = {key: v.detach().clone() for key, v in init.state_dict().items()}
    del init
    impls, skip = decode_impls(m, args)
    greedy = {"temperature": 0.0}
    rows = []
    for batch in batches:
        shape = {"batch": batch, "prompt": prompt_len, "new_tokens": new, "d_model": cfg.d_model,
                 "n_layers": cfg.n_layers, "vocab": cfg.vocab_size}
        label = f"B{batch} prompt{prompt_len} new{new}"
        gen = torch.Generator().manual_seed(300 + batch)
        prompts = [torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).to(device) for _ in range(2)]
        log(f"models decode: {label} ({dname})")
        group = {}
        for name, (reference, compiled, kw) in impls.items():
            r = base_row("decode", name, device, dname, shape, label)
            group[name] = r
            if name in skip:
                r.update(status="skipped", reason=skip[name])
                continue
            model = call = None
            try:
                model = m.Transformer(cfg, reference=reference, device=device)
                model.load_state_dict(state32)
                model.to(dtype).eval()
                kwargs = _generate_kwargs(m.generate, {**greedy, **kw})
                if reference:
                    reuse_static_cache(model)
                if compiled:
                    torch._dynamo.reset()
                    model.forward_cached = torch.compile(model.forward_cached, mode="reduce-overhead", dynamic=False)

                def call(i, model=model, kwargs=kwargs):
                    with torch.no_grad():
                        return m.generate(model, prompts[i % len(prompts)], new, **kwargs)

                toks = new_tokens_of(call(0), batch, prompt_len, new)  # warm-up: graphs captured, compiled
                if compiled:
                    call(1)  # inductor's CUDA graph trees record on a later call than the first
                _sync(device)
                v = check_decode(m, cfg, state32, prompts[0], toks, device, plan["decode_check_rows"], dtype)
                r["validation"] = v
                log(f"  {name:>14}: greedy tokens {'pass' if v['passed'] else 'FAIL'} (worst margin "
                    f"{v['worst_margin']:.3g}, allowed {v['allowed']:.3g})")
                if not v["passed"]:
                    if name == "ours":
                        r.update(status="failed", reason="validation: " + str(v["first_failure"]))
                        log(f"  {name}: FAILED {r['reason']}")
                        continue
                    notes.append(f"models decode {name} {label} failed validation ({v['first_failure']}): timed anyway")
                st = timer.measure(call)
            except Exception as e:  # noqa: BLE001 - reported in the row
                r.update(status="failed" if name == "ours" else "skipped", reason=_reason(e))
                log(f"  {name}: {r['status']} {r['reason']}")
                continue
            finally:
                if model is not None:
                    m.release_decode_graphs(model)
                del model, call
                if compiled:
                    torch._dynamo.reset()
                _free(device)
            r["time_ms"] = runner.stats_json(st)
            sec = st["median"] * 1e-3
            r["tokens_per_s"] = batch * new / sec
            r["ms_per_token"] = st["median"] / new
            log(f"  {name:>14}: {st['median']:.4g} ms [{st['p10']:.4g}-{st['p90']:.4g}] "
                f"{r['tokens_per_s']:,.0f} tokens/s, {r['ms_per_token']:.3g} ms per step")
        ratios(group, {"vs_eager": 2.0, "vs_compile": 1.0}, "torch_eager (reference, static KV cache, eager)")
        rows += list(group.values())
    return rows


# ---- training from the loader -------------------------------------------------------------------------------

def loader_rows(m, args, device, timer, ceilings, log, notes, plan):
    from optimized_ops import data
    from optimized_ops.models import training

    cfg = make_config(m, plan)
    batch, seq = plan["train"]
    bf16 = device == "cuda"
    dname = "bf16" if bf16 else "fp32"
    k = args.models_steps or plan["steps"]
    tmp = None
    if args.models_data:
        path = args.models_data
        info = data.dataset_info(path)
        if tuple(info.record_shape) != (seq + 1,):
            raise SystemExit(f"--models-data: expected records of seq + 1 = {seq + 1} tokens; {path} holds "
                             f"{info.record_shape}")
        if info.num_records * info.record_bytes > 8 << 30:
            raise SystemExit(f"--models-data: {path} holds {info.num_records * info.record_bytes / 2**30:.1f} GiB; the "
                             "baseline holds every record in GPU memory: give a dataset of at most 8 GiB")
        source = f"the dataset at {path}"
    else:
        tmp = tempfile.TemporaryDirectory(prefix="models-bench-")
        path = os.path.join(tmp.name, "tokens")
        records = plan["corpus_batches"] * batch
        corpus = training.synthetic_corpus(records * seq + 1, vocab_size=cfg.vocab_size, seed=5)
        info = training.write_token_shards(path, corpus, seq_len=seq)
        source = f"synthetic_corpus written by write_token_shards to {path} (temporary)"
    # every record in GPU memory, int64: the baseline's batches
    with data.StreamingLoader(path, batch_size=info.num_records, device="cpu", shuffle=False) as all_loader:
        everything = training._to_long(next(iter(all_loader))).to(device)
    n_batches = everything.shape[0] // batch
    torch.manual_seed(2022)
    init = m.Transformer(cfg, device=device)
    state = {key: v.detach().clone() for key, v in init.state_dict().items()}
    flops, n_params = step_flops(init, cfg, batch, seq)
    n_total = total_params(init)
    del init
    peak_tf, peak_label = gpu_peak(device)
    measured = next((c for c in ceilings if c["name"] == f"torch_matmul_{dname}"), None)
    shape = {"batch": batch, "seq": seq, "records": int(info.num_records), "record_dtype": info.dtype,
             "steps_per_sample": k, "matmul_params": n_params, "parameters": n_total}
    label = f"{params_label(n_total)} B{batch} S{seq}"
    log(f"models loader: {label}, {info.num_records} records ({info.dtype}) from {source}")
    rows = {}
    loader = None
    try:
        for name in ("gpu_tensors", "loader"):
            r = base_row("loader", name, device, dname, shape, label)
            r["flops"] = flops
            r["input"] = ("batches sliced from every record held in GPU memory (int64)" if name == "gpu_tensors" else
                          f"optimized_ops.data.StreamingLoader over {source}, shuffled, prefetch 4")
            rows[name] = r
            if name == "gpu_tensors":
                cursor = {"i": 0}

                def next_batch():
                    i = cursor["i"] % n_batches
                    cursor["i"] += 1
                    return everything[i * batch:(i + 1) * batch]
            else:
                loader = data.StreamingLoader(path, batch_size=batch, device=device, shuffle=True, seed=0,
                                              drop_last=True, prefetch=4)
                first = loader.next()
                idx = loader.last_indices
                want = everything.index_select(0, idx.to(device))
                got = training._to_long(first)
                passed = bool(torch.equal(got, want))
                r["validation"] = {"passed": passed, "checked_records": int(idx.numel()),
                                   "rule": "the first batch equals the records at the loader's indices"}
                if not passed:
                    r.update(status="failed", reason="validation: the loader's first batch differs from its records")
                    continue

                def next_batch():
                    item = loader.next()
                    if item is None:  # the end of an epoch: the next call starts the next one
                        item = loader.next()
                    return training._to_long(item)

            tr = Trainer(new_model(m, cfg, state, device, False), device, bf16)
            run = None
            try:
                tr.step(next_batch())
                tr.step(next_batch())
                _sync(device)
                wait0 = loader.stats()["consumer_wait_s"] if name == "loader" else 0.0
                counted = {"steps": 0}

                def run(i, tr=tr, next_batch=next_batch):
                    for _ in range(k):
                        tr.step(next_batch())
                        counted["steps"] += 1

                st = scale_stats(timer.measure(run), k)
            except Exception as e:  # noqa: BLE001
                r.update(status="failed", reason=_reason(e))
                log(f"  {name}: FAILED {r['reason']}")
                continue
            finally:
                del tr, run
                _free(device)
            finish_train_row(r, st, flops, batch * seq, peak_tf, peak_label, measured)
            if name == "loader":
                stats = loader.stats()
                r["loader_wait_ms_per_step"] = (stats["consumer_wait_s"] - wait0) * 1e3 / max(counted["steps"], 1)
                r["loader_io"] = loader.io_backend
                r["loader_notes"] = list(loader.notes)
            log(f"  {name:>14}: {st['median']:.4g} ms/step [{st['p10']:.4g}-{st['p90']:.4g}] "
                f"{r['tokens_per_s']:,.0f} tokens/s"
                + (f", loader wait {r['loader_wait_ms_per_step']:.3g} ms/step" if name == "loader" else ""))
    finally:
        if loader is not None:
            loader.close()
        del everything
        if tmp is not None:
            tmp.cleanup()
        _free(device)
    base, ld = rows.get("gpu_tensors"), rows.get("loader")
    if base and ld and base["status"] == "ok" and ld["status"] == "ok":
        ld["baseline"] = {"name": "gpu_tensors (batches already in GPU memory)", "time_ms": base["time_ms"],
                          "tflops": base["tflops"], "validation": None}
        ld["vs_baseline"] = base["time_ms"]["median"] / ld["time_ms"]["median"]
        ld["targets"] = {"vs_baseline": {"target": 0.97, "value": ld["vs_baseline"],
                                         "met": bool(ld["vs_baseline"] >= 0.97)}}
    return list(rows.values())


# ---- the family ---------------------------------------------------------------------------------------------

def models_rows(args, device, timer, ceilings, log, notes):
    m, why = models_api()
    if m is None:
        r = base_row("models", "ours", device, "bf16" if device == "cuda" else "fp32", {}, "-")
        r.update(status="skipped", reason=why)
        log(f"models: skipped: {why}")
        return [r]
    plan = PLANS["smoke" if (args.models_smoke or device == "cpu") else "full"]
    peak_tf, peak_label = gpu_peak(device)
    notes += [
        "models rows (bench/benchmark_models.py): train / train_moe = one optimizer step (forward, backward, AdamW) "
        "(bf16 autocast on CUDA), ours = optimized_ops.models.Transformer(config), torch_eager = Transformer(config, "
        "reference=True) (the same architecture in plain torch; vs_baseline = vs_eager), torch_compile = "
        "torch.compile of it (vs_compile); decode = one greedy generate call (prefill + new tokens), ours = paged KV "
        "+ CUDA graphs, torch_eager = the reference's static KV cache, torch_compile = its decode step under "
        "torch.compile(mode='reduce-overhead'); loader = ours' training step fed by the StreamingLoader vs by "
        "batches already in GPU memory (issue 20 targets: train >= 1.5x eager and >= 1.1x compile; MoE >= 2x "
        "eager; decode >= 2x eager and >= 1.0x compile; loader = the same tokens/s)",
        "models MFU: flops per step = 6 N T + 12 L d S T (PaLM appendix B; N = parameters in matmuls, the LM head "
        "once, experts x top_k / E; attention without the causal half) / time / "
        + (peak_label if peak_tf else f"(no peak: {peak_label})")
        + "; roofline_fraction = the same over the torch.matmul bf16 rate measured in this run",
        "models validation: train = the first step's loss vs the float64 reference on the same weights and tokens "
        "(reduction rule, n = tokens, the eager reference as the same-dtype torch); decode = every greedy token is the "
        "float64 reference's argmax up to twice the rule's logit error bound (teacher-forced); loader = the first "
        "batch equals its records"]
    if plan is PLANS["smoke"]:
        notes.append("models: the tiny smoke configs (" + ", ".join(f"{k}={v}" for k, v in SMOKE_MODEL.items())
                     + "): a test of the machinery, not a measurement of the targets")
    threads = torch.get_num_threads()
    if plan is PLANS["smoke"] and device == "cpu" and threads > 1:
        # OpenMP barriers of 2+ threads cost more than a tiny model's work, and on a shared machine a descheduled
        # thread stalls every parallel region (measured here: 2.3 ms per step on one thread, 560-620 ms on two
        # beside another busy process)
        torch.set_num_threads(1)
        notes.append(f"models: the smoke configs run on one CPU thread (of {threads})")
    try:
        rows = _case_rows(m, args, device, timer, ceilings, log, notes, plan)
    finally:
        torch.set_num_threads(threads)
    if args.models_merge:
        rows += merged_rows(args, device, log, notes)
    return sorted(rows, key=lambda r: CASES.index(r["case"]) if r.get("case") in CASES else len(CASES))


def merged_rows(args, device, log, notes):
    """--models-merge: the rows of the other cases from the python-models.json already under --out (a run split
    into several commands builds one file); each keeps its own run's time stamp in "merged_from"."""
    import json

    path = pathlib.Path(args.out) / runner.query_machine(device)["gpu_key"] / "python-models.json"
    if not path.is_file():
        log(f"models: --models-merge: no {path} yet")
        return []
    old = json.loads(path.read_text())
    kept = [dict(r, merged_from=r.get("merged_from") or {"created": old.get("created"), "command": old.get("command"),
                                                          "ceilings": old.get("ceilings")})
            for r in old.get("results", []) if r.get("family") == "models" and r.get("case") not in args.models_cases]
    if kept:
        cases = sorted({r["case"] for r in kept})
        notes.append(f"models: the rows of {', '.join(cases)} are merged from an earlier run ({old.get('created')}, "
                     f"`{old.get('command')}`; its ceilings are in each row's merged_from); every ratio is within one "
                     "case, measured in one run")
        notes += [n for n in old.get("notes", []) if n.startswith("models") and n not in notes
                  and "merged from" not in n]
        log(f"models: merged {len(kept)} rows of {', '.join(cases)} from {path}")
    return kept


def _case_rows(m, args, device, timer, ceilings, log, notes, plan):
    rows = []
    for case in args.models_cases:
        try:
            if case in ("train", "train_moe"):
                rows += train_rows(m, args, device, timer, ceilings, log, notes, plan, case)
            elif case == "decode":
                rows += decode_rows(m, args, device, timer, ceilings, log, notes, plan)
            elif case == "loader":
                rows += loader_rows(m, args, device, timer, ceilings, log, notes, plan)
        except SystemExit:
            raise
        except Exception as e:  # noqa: BLE001 - a case that cannot even start is one failed row
            r = base_row(case, "ours", device, "bf16" if device == "cuda" else "fp32", {}, "-")
            r.update(status="failed", reason=_reason(e))
            log(f"models {case}: FAILED {r['reason']}")
            rows.append(r)
        _free(device)
    return rows


def plot_models(report, path):
    """tokens/s per implementation, a panel per case. Returns [path] or [] (no matplotlib, no rows, or a failure:
    the JSON and the table are written before the plot, and a plot must not fail the run)."""
    try:
        return _plot_models(report, path)
    except Exception as e:  # noqa: BLE001
        print(f"benchmark_models: no plot: {type(e).__name__}: {e}", file=sys.stderr)
        return []


def _plot_models(report, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmark_models: matplotlib is not installed: no plot", file=sys.stderr)
        return []
    rows = [r for r in report["results"] if r.get("family") == "models" and r["status"] == "ok"]
    if not rows:
        return []
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.8 * len(cases), 3.6), squeeze=False)
    colors = {"ours": "#1f77b4", "torch_eager": "#ff7f0e", "torch_compile": "#d62728", "gpu_tensors": "#7f7f7f",
              "loader": "#1f77b4"}
    for ax, case in zip(axes[0], cases):
        sel = [r for r in rows if r["case"] == case]
        groups = list(dict.fromkeys(r["shape_label"] for r in sel))
        impls = list(dict.fromkeys(r["variant"] for r in sel))
        width = 0.8 / max(len(impls), 1)
        for vi, v in enumerate(impls):
            ys = [next((r["tokens_per_s"] for r in sel if r["shape_label"] == g and r["variant"] == v), 0) or 0
                  for g in groups]
            xs = [gi + (vi - (len(impls) - 1) / 2) * width for gi in range(len(groups))]
            ax.bar(xs, ys, width, label=v, color=colors.get(v))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=7)
        ax.set_title(case, fontsize=9)
        ax.set_ylabel("tokens/s", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    machine = report["machine"].get("gpu") or "CPU"
    fig.suptitle(f"optimized_ops.models on {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def add_arguments(p):
    p.add_argument("--models-cases", dest="models_cases_text", default=None,
                   help=f"models: comma list of {', '.join(CASES)} (default all)")
    p.add_argument("--models-steps", type=int, default=None,
                   help="models: optimizer steps per timed sample of train/loader (default 4 on CUDA, 1 on the CPU)")
    p.add_argument("--models-smoke", action="store_true", help="models: the tiny configs (any device)")
    p.add_argument("--models-compile", action="store_true",
                   help="models: keep the torch.compile rows in a smoke run")
    p.add_argument("--models-moe-compile", action="store_true", help="models: also torch.compile the MoE reference")
    p.add_argument("--models-merge", action="store_true",
                   help="models: keep the rows of the cases not run from the python-models.json under --out (a run "
                        "split into several commands, one file)")
    p.add_argument("--models-data", default=None,
                   help="models: a dataset directory of seq+1-token records for the loader case (default: written "
                        "to a temporary directory)")
    try:  # shared with the fused and linear families: added by whichever registers first
        p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    except argparse.ArgumentError:
        pass


def prepare(args, device):
    t = getattr(args, "models_cases_text", None)
    args.models_cases = t.split(",") if t else list(CASES)
    for c in args.models_cases:
        if c not in CASES:
            raise SystemExit(f"--models-cases: expected some of {', '.join(CASES)}; given '{c}'")


def ceiling_dtypes(args, device):
    return ["bf16"] if device == "cuda" else ["fp32"]


FAMILY = runner.register(runner.Family(
    "models", rows=models_rows, add_arguments=add_arguments, prepare=prepare, ceiling_dtypes=ceiling_dtypes,
    plot=plot_models,
    summary="optimized_ops.models: training step (dense and MoE) vs the torch reference eager and torch.compile, "
            "greedy decode (paged KV + CUDA graphs) vs a static-cache reference, training from the loader "
            "(bench/benchmark_models.py)"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--smoke" in argv:
        argv = [a for a in argv if a != "--smoke"]
        argv = ["--device", "cpu", "--quick", "--models-smoke"] + argv
    return runner.main(["--ops", "models", *argv])


if __name__ == "__main__":
    sys.exit(main())
