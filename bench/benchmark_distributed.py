#!/usr/bin/env python3
"""The distributed family: one GPU against N GPUs, launched by torchrun; strong or weak scaling.

    torchrun --nproc_per_node 2 bench/benchmark_distributed.py [--cases ep,tp,ddp] [--directions fwd,fwd+bwd]
        [--scaling strong|weak] [--ep-shape deepseek]
        [--ep-tokens 16384 --ep-experts 16 --ep-top-k 2 --ep-d-model 4096 --ep-d-ff 14336]
        [--tp-tokens 8192 --tp-d-model 8192 --tp-d-ff 28672] [--ddp-batch 8 --ddp-seq 1024 --ddp-model 124m]
        [--quick] [--device cuda|cpu] [--out bench/results]
    # smoke test on a CPU (gloo), small shapes:
    torchrun --nproc_per_node 2 bench/benchmark_distributed.py --device cpu --quick
    # issue 24's weak-scaling runs (scripts/run-scaling runs them for N = 1, 2, 4, 8 and plots them):
    torchrun --nproc_per_node N bench/benchmark_distributed.py --scaling weak --ep-shape deepseek

Cases (the issue's targets are the defaults; every shape is a flag):

* ``ep``: the MoE layer, E experts top-k, ``--ep-tokens`` tokens **per GPU**: one GPU holding all E experts on the
  N x tokens of the global problem (``optimized_ops.nn.MoE``) against N GPUs with the experts partitioned
  (``nn.MoE(process_group=...)``), overlap on and off; tokens/s of the whole group, and the all-to-alls' share of
  the non-overlapped layer's time (the dispatch and combine exchanges timed alone with the same splits).
  ``--ep-shape deepseek``: the DeepSeekMoE-style fine-grained experts of issue 24, 64 experts top-8, d_model 2048,
  d_ff 1408 (flags given explicitly win over the preset).
* ``tp``: the SwiGLU MLP ``d_model -> d_ff -> d_model`` on ``--tp-tokens`` tokens (the global problem; every rank
  gets all of them): one GPU against ``TensorParallelSwiGLU`` (one all-reduce forward, one backward); the
  all-reduce(s) of the same size timed alone give ``allreduce_share``.
* ``ddp``: a training step (forward, backward, clip, AdamW) of ``OptimizedTransformer`` (the 124M model) on a
  global batch of N x ``--ddp-batch`` sequences: one GPU on all of it against DDP with ``--ddp-batch`` per GPU;
  DDP's gradient buckets all-reduced alone give ``allreduce_share``.

``--scaling weak`` (issue 24): every per-GPU problem stays fixed as N grows, and the one-GPU baseline runs ONE
GPU's share: ep: ``--ep-tokens`` per GPU, the baseline the one-GPU layer (all E experts) on ep_tokens tokens; tp:
``--tp-tokens`` tokens PER GPU (the N-GPU MLP runs N x tp_tokens tokens, each rank holding 1/N of the weights; the
baseline the full weights on tp_tokens tokens); ddp: ``--ddp-batch`` sequences per GPU, the baseline one GPU's step
on ddp_batch sequences. ``scaling_efficiency`` = tokens_per_s(N GPUs) / (N x tokens_per_s(baseline)) (strong:
vs_baseline / N, as before). Validation in weak mode has no global problem on one rank: ep, each rank's outputs
against the one-GPU layer (the same weights on every rank) on its own tokens (dropless only: with
``--ep-capacity-factor`` the group's capacity counts every rank's tokens, so it is not compared); tp, the N-GPU MLP
against the one-GPU MLP on the first tp_tokens tokens. Outputs ``python-distributed-weak-w<N>.json`` / ``.md`` in
``OUT/<gpu><x visible GPUs>/`` (e.g. ``h200x8``; ``--machine-key`` overrides), so the runs at 1, 2, 4 and 8 GPUs sit
side by side for ``scripts/plot_scaling.py``.

Timing: a warm-up, then samples until ``--min-samples`` and ``--min-time-s`` (at most ``--max-samples``); each
N-GPU sample starts after a barrier and a device synchronisation on every rank and ends at every rank's
synchronisation; its time is the slowest rank's (all-reduce MAX). One-GPU samples run on rank 0 while the others
wait. Validation first: strong mode, the N-GPU outputs against the one-GPU layer's (its output broadcast from rank
0). Communication shares (``a2a_share`` for ep, ``allreduce_share`` for tp and ddp): the collectives of the same
sizes timed alone with the same machinery, over the parallel layer's median; 0 at world size 1 (no communication,
not timed).

Output (rank 0): ``OUT/<machine>/python-distributed.json`` (schema ``optimized-ops-bench/1``, rows as the other
Python benchmarks', family ``distributed``, plus ``scaling``, ``role`` (baseline / parallel / comm), ``series``,
``world_size``, ``tokens_per_s``, ``scaling_efficiency``, ``comm_bytes``, ``a2a_share``, ``allreduce_share``)
and ``python-distributed.md``. NVLink multicast is forced off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``) before the process group starts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import pathlib
import sys
import time

# Before torch.distributed or NCCL start: forced, not setdefault (a caller's 1 must not survive).
for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


EP_SHAPES = {  # --ep-shape presets (flags given explicitly win)
    "deepseek": {"ep_experts": 64, "ep_top_k": 8, "ep_d_model": 2048, "ep_d_ff": 1408},  # DeepSeekMoE-style
}
QUICK = {"ep_tokens": 256, "ep_experts": 8, "ep_d_model": 256, "ep_d_ff": 512,
         "tp_tokens": 256, "tp_d_model": 256, "tp_d_ff": 1024,
         "ddp_batch": 2, "ddp_seq": 64, "ddp_model": "tiny",
         "min_samples": 3, "max_samples": 10, "min_time_s": 0.05, "warmup": 1}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="ep,tp,ddp")
    p.add_argument("--directions", default="fwd,fwd+bwd", help="ep and tp: fwd, fwd+bwd")
    p.add_argument("--scaling", choices=["strong", "weak"], default="strong",
                   help="strong: one GPU on the global problem against N GPUs; weak: the per-GPU problem fixed, "
                        "the baseline one GPU on one GPU's share (issue 24)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--ep-shape", choices=list(EP_SHAPES), default=None,
                   help="deepseek: 64 experts top-8, d_model 2048, d_ff 1408 (fine-grained experts)")
    p.add_argument("--ep-tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--ep-experts", type=int, default=16)
    p.add_argument("--ep-top-k", type=int, default=2)
    p.add_argument("--ep-d-model", type=int, default=4096)
    p.add_argument("--ep-d-ff", type=int, default=14336)
    p.add_argument("--ep-capacity-factor", type=float, default=None)
    p.add_argument("--tp-tokens", type=int, default=8192,
                   help="strong: tokens of the global problem; weak: tokens per GPU")
    p.add_argument("--tp-d-model", type=int, default=8192)
    p.add_argument("--tp-d-ff", type=int, default=28672)
    p.add_argument("--ddp-batch", type=int, default=8, help="sequences per GPU")
    p.add_argument("--ddp-seq", type=int, default=1024)
    p.add_argument("--ddp-model", choices=["124m", "tiny"], default="124m")
    p.add_argument("--quick", action="store_true",
                   help="small shapes and short measurements (flags given explicitly win)")
    p.add_argument("--min-samples", type=int, default=10)
    p.add_argument("--max-samples", type=int, default=100)
    p.add_argument("--min-time-s", type=float, default=0.5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="ddp: after the timing, 3 more steps under torch.profiler on every rank: DIR/ddp-rank<r>.json "
                        "(a Chrome trace) and DIR/ddp-rank<r>.txt (time per kernel / operator, the NCCL kernels "
                        "and the gaps between kernels where the GPU waited)")
    p.add_argument("--machine-key", default=None,
                   help="weak mode: the results folder under OUT (default: the GPU's key, e.g. h100, plus "
                        "x<visible GPUs> on a host of several, e.g. h200x8; the CPU: cpu)")
    p.add_argument("--out", default=str(runner.ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    # the flags given explicitly: parsed again with every default suppressed
    for x in p._actions:
        x.default = argparse.SUPPRESS
    given = set(vars(p.parse_args(argv)))
    preset = dict(EP_SHAPES.get(args.ep_shape) or {})
    if args.quick:
        quick = dict(QUICK)
        if args.ep_shape:  # keep the preset's routing (experts, top-k); the sizes shrink
            quick.pop("ep_experts")
            quick["ep_d_model"], quick["ep_d_ff"] = 128, 64
        preset.update(quick)
    for k, v in preset.items():
        if k not in given:
            setattr(args, k, v)
    return args


def _broadcast_obj(obj):
    """rank 0's ``obj`` on every rank (a Python object)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Bench:
    def __init__(self, args, device, world, rank):
        self.args, self.device, self.world, self.rank = args, device, world, rank

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sample_all(self, fn):
        dist.barrier()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                         device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item()) * 1e3

    def _sample_one(self, fn):
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def measure(self, fn, everyone: bool):
        """ms statistics (runner.summarize) of fn: on every rank (everyone) or on rank 0 alone (the others wait at
        a barrier). Every rank returns the same statistics."""
        a = self.args
        stats = None
        if everyone or self.rank == 0:
            sample = self._sample_all if everyone else self._sample_one
            for _ in range(a.warmup):
                sample(fn)
            xs, t0 = [], time.perf_counter()
            while True:
                xs.append(sample(fn))
                n, el = len(xs), time.perf_counter() - t0
                done = n >= a.max_samples or (n >= a.min_samples and el >= a.min_time_s)
                if everyone:  # every rank stops at the same sample
                    flag = torch.tensor([1.0 if done else 0.0], device=self.device if self.device.type == "cuda"
                                        else "cpu")
                    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                    done = bool(flag.item())
                if done:
                    break
            stats = runner.summarize(xs)
        return _broadcast_obj(stats)


def row(op, case, direction, variant, dname, shape, label, world, flops, min_bytes, comm_bytes, formulas, *,
        scaling="strong", role="parallel", series=None):
    """A result row. role: "baseline" (the one-GPU reference), "parallel" (the N-GPU layer / step: scaling_efficiency
    against the baseline) or "comm" (the collectives alone); series: the name of the parallel layout ("EP", "EP
    overlap", "TP", "DDP") that scripts/plot_scaling.py draws as one line across world sizes."""
    return {"op": op, "family": "distributed", "case": case, "direction": direction, "variant": variant,
            "backend": "cuda" if torch.cuda.is_available() else "cpu", "dtype": dname, "shape": shape,
            "shape_label": f"{label}, {direction}", "threads": None, "status": "ok", "reason": "", "validation": None,
            "time_ms": None,
            "flops": flops, "flops_formula": formulas[0], "min_bytes": min_bytes, "bytes_formula": formulas[1],
            "tflops": None, "gbps": None, "baseline": None, "vs_baseline": None, "roofline_fraction": None,
            "roofline_peak": None, "roofline_bandwidth": None, "kernel": None, "world_size": world,
            "comm_bytes": comm_bytes, "tokens_per_s": None, "scaling": scaling, "role": role, "series": series,
            "scaling_efficiency": None}


def finish(r, st, tokens):
    r["time_ms"] = runner.stats_json(st)
    sec = st["median"] * 1e-3
    if r["flops"]:
        r["tflops"] = r["flops"] / sec / 1e12
    if r["min_bytes"]:
        r["gbps"] = r["min_bytes"] / sec / 1e9
    if tokens:
        r["tokens"] = tokens
        r["tokens_per_s"] = tokens / sec


def set_baseline(r, base):
    """vs_baseline (the baseline's median time over this row's) and scaling_efficiency: strong, vs_baseline / N (the
    same problem on N GPUs); weak, tokens_per_s(N GPUs) / (N x tokens_per_s(baseline)) (the baseline runs one GPU's
    share, so the ideal group is N times its rate)."""
    if base and base["status"] == "ok" and r["status"] == "ok":
        r["baseline"] = {"name": base["variant"], "time_ms": base["time_ms"], "tokens_per_s": base["tokens_per_s"]}
        r["vs_baseline"] = base["time_ms"]["median"] / r["time_ms"]["median"]
        if r["scaling"] == "weak":
            r["scaling_efficiency"] = r["tokens_per_s"] / (r["world_size"] * base["tokens_per_s"])
        else:
            r["scaling_efficiency"] = r["vs_baseline"] / r["world_size"]


def set_share(layer, comm_row, key):
    """layer[key] = the collectives' median time alone over the layer's median (comm_row None: world size 1, no
    communication: 0)."""
    if layer["status"] != "ok":
        return
    if comm_row is None:
        layer[key] = 0.0
    else:
        layer[key] = comm_row[key] = comm_row["time_ms"]["median"] / layer["time_ms"]["median"]


def check(got, want, rel):
    """Validation record: max |got - want| <= rel * max |want|."""
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    ref = want.float().abs().max().item() if want.numel() else 0.0
    return {"passed": bool(err <= rel * max(ref, 1e-30)), "max_abs_err": err, "max_abs_ref": ref,
            "rule": f"max |N GPUs - 1 GPU| <= {rel} max |1 GPU|"}


def _all_ok(v):
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1.0 if v["passed"] else 0.0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _measure_one(b: Bench, base, fn, tokens):
    """The baseline row timed on rank 0 alone (skipped where one GPU runs out of memory)."""
    try:
        finish(base, b.measure(fn, everyone=False), tokens)
        base["validation"] = {"passed": True, "note": "the reference"}
    except torch.cuda.OutOfMemoryError as ex:  # one GPU may not hold the global problem
        base.update(status="skipped", reason=f"out of memory on one GPU: {ex}"[:300])


# ---- expert parallelism --------------------------------------------------------------------------------------------

def ep_rows(b: Bench, dname, log):
    import optimized_ops
    from optimized_ops.distributed import ExpertParallelMoE
    from optimized_ops.distributed._comm import all_to_all_single
    a, dev, w, rank = b.args, b.device, b.world, b.rank
    weak = a.scaling == "weak"
    dtype = DTYPES[dname]
    e, k, d, f, t = a.ep_experts, a.ep_top_k, a.ep_d_model, a.ep_d_ff, a.ep_tokens
    tg = t * w
    t1 = t if weak else tg                                                       # the baseline's tokens
    torch.manual_seed(0)
    dense = optimized_ops.nn.MoE(d, f, e, k, capacity_factor=a.ep_capacity_factor, device=dev, dtype=dtype)
    ep = {ov: ExpertParallelMoE.from_dense(dense, overlap=ov) for ov in (True, False)}
    if weak:  # each rank its own tokens; no global problem anywhere
        gen = torch.Generator(device=dev).manual_seed(1 + 1000 * rank)
        x_all = None
        x = torch.randn(t, d, device=dev, dtype=dtype, generator=gen)
    else:
        gen = torch.Generator(device=dev).manual_seed(1)
        x_all = torch.randn(tg, d, device=dev, dtype=dtype, generator=gen)       # the same on every rank
        x = x_all[rank * t:(rank + 1) * t].contiguous()
    if rank != 0 and not weak:  # weak: every rank validates against its own copy of the one-GPU layer
        del dense
        dense = None
    elem = ELEM[dname]
    label = f"E={e} top{k} T={t}/GPU d={d} d_ff={f}"
    shape = {"experts": e, "top_k": k, "tokens_per_gpu": t, "tokens": tg, "d_model": d, "d_ff": f,
             "capacity_factor": a.ep_capacity_factor}
    kw = {"scaling": a.scaling}
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    rows = []
    for direction in a.directions.split(","):
        bwd = direction == "fwd+bwd"
        mult = 3 if bwd else 1
        weights = 3 * e * d * f * elem

        def flops_of(n):
            return mult * 6.0 * n * k * d * f

        def bytes_of(n):
            return (weights + 2 * n * d * elem) * (3 if bwd else 1)
        comm = 2 * tg * k * d * elem * (w - 1) / w * (2 if bwd else 1)         # over every link, both exchanges
        formulas = (f"{mult} x 6 T k d d_ff (T = {tg} tokens of all GPUs; the weak baseline: {t1})",
                    "3 E d d_ff (weights) + 2 T d (x, out), x3 fwd+bwd; comm_bytes: the all-to-alls' off-rank rows "
                    "(2 T k d (W-1)/W per direction of the layer)")
        xg = x.detach().clone().requires_grad_(bwd)
        dy = torch.randn_like(x) if bwd else None

        def run_ep(m):
            def fn():
                y = m(xg)
                if bwd:
                    (y.float() * dy.float()).sum().add(m.last_metrics.loss).backward()
            return fn

        # validation: N GPUs vs the one-GPU layer on the same tokens
        vals = {}
        if weak:  # this rank's tokens through its copy of the one-GPU layer
            with torch.no_grad():
                want = dense(x)
            for ov, m in ep.items():
                with torch.no_grad():
                    got = m(x)
                if a.ep_capacity_factor is None:
                    vals[ov] = check(got, want, tol)
                else:
                    vals[ov] = {"passed": True, "compared": False,
                                "note": "capacity mode: the group's capacity counts every rank's tokens, a one-GPU "
                                        "layer on one rank's tokens drops other pairs; not compared in weak mode"}
        else:
            with torch.no_grad():
                want = dense(x_all) if rank == 0 else torch.empty(tg, d, device=dev, dtype=dtype)
            dist.broadcast(want, src=0)
            for ov, m in ep.items():
                with torch.no_grad():
                    vals[ov] = check(m(x), want[rank * t:(rank + 1) * t], tol)
        del want

        base = row("moe_layer", "ep", direction, "1 GPU (all experts)" + (", one GPU's tokens" if weak else ""),
                   dname, shape, label, 1, flops_of(t1), bytes_of(t1), 0, formulas, role="baseline", **kw)
        xb = None
        if rank == 0:
            xin = x if weak else x_all
            xb = xin.detach().clone().requires_grad_(bwd)
            dyb = torch.randn_like(xin) if bwd else None

            def fn1():
                y = dense(xb)
                if bwd:
                    (y.float() * dyb.float()).sum().add(dense.last_metrics.loss).backward()
            base_fn = fn1
        else:
            base_fn = None
        _measure_one(b, base, base_fn, t1)
        rows.append(base)
        del xb
        for ov, m in ep.items():
            r = row("moe_layer", "ep", direction, f"{w} GPUs EP" + (" overlap" if ov else ""), dname, shape, label,
                    w, flops_of(tg), bytes_of(tg), comm, formulas, series="EP" + (" overlap" if ov else ""), **kw)
            r["validation"] = vals[ov]
            if not _all_ok(vals[ov]):
                r.update(status="failed", reason="validation failed on some rank")
            else:
                finish(r, b.measure(run_ep(m), everyone=True), tg)
                set_baseline(r, base)
            rows.append(r)
        lay = next(x_ for x_ in rows if x_["variant"] == f"{w} GPUs EP" and x_["direction"] == direction)
        if w == 1:  # no exchange off the GPU: the share is 0, not timed
            set_share(lay, None, "a2a_share")
        else:  # the all-to-alls alone, with the splits of the non-overlapped layer
            stats = {}
            from optimized_ops.distributed.expert_parallel import moe_layer_ep
            m = ep[False]
            with torch.no_grad():
                moe_layer_ep(x, m.router.weight, m.w13, m.w2, k, group=None, capacity_factor=a.ep_capacity_factor,
                             stats=stats, overlap=False)
            send, recv = stats["send"], stats["recv"]
            xs = torch.randn(sum(send), d, device=dev, dtype=dtype)
            xr = torch.empty(sum(recv), d, device=dev, dtype=dtype)
            n_ex = 4 if bwd else 2

            def a2a():
                for i in range(n_ex // 2):
                    all_to_all_single(xr, xs, recv, send)
                    all_to_all_single(xs, xr, send, recv)
            r = row("all_to_all", "ep", direction, f"{w} GPUs: dispatch + combine all-to-alls alone", dname, shape,
                    label, w, 0.0, 0, comm, formulas, role="comm", series="EP", **kw)
            finish(r, b.measure(a2a, everyone=True), 0)
            r["validation"] = {"passed": True, "note": "communication only"}
            r["gbps"] = comm / (r["time_ms"]["median"] * 1e-3) / 1e9 / max(w, 1)  # per GPU, both directions
            set_share(lay, r, "a2a_share")
            rows.append(r)
        log(f"ep {direction}: " + "; ".join(f"{x_['variant']} {x_['time_ms']['median']:.3f} ms" for x_ in rows
                                            if x_["direction"] == direction and x_["time_ms"]))
    return rows


# ---- tensor parallelism --------------------------------------------------------------------------------------------

def _allreduce_row(b: Bench, op, case, direction, variant, dname, shape, label, comm, formulas, buffers, series):
    """The all-reduce(s) of ``buffers`` (zeros: the sums stay finite however many samples), timed alone on every
    rank, in order (as the layer issues them on one stream)."""
    from optimized_ops.distributed._comm import all_reduce_sum

    def fn():
        for buf in buffers:
            all_reduce_sum(buf)
    r = row(op, case, direction, variant, dname, shape, label, b.world, 0.0, 0, comm, formulas, role="comm",
            series=series, scaling=b.args.scaling)
    finish(r, b.measure(fn, everyone=True), 0)
    r["validation"] = {"passed": True, "note": "communication only"}
    r["gbps"] = comm / (r["time_ms"]["median"] * 1e-3) / 1e9 if comm else None  # per GPU (ring bytes)
    r["allreduce_bytes"] = [buf.numel() * buf.element_size() for buf in buffers]
    return r


def tp_rows(b: Bench, dname, log):
    from optimized_ops.distributed import TensorParallelSwiGLU
    from optimized_ops.models import TransformerConfig
    from optimized_ops.models.transformer import SwiGLU
    a, dev, w, rank = b.args, b.device, b.world, b.rank
    weak = a.scaling == "weak"
    dtype = DTYPES[dname]
    t, d, f = a.tp_tokens, a.tp_d_model, a.tp_d_ff
    tg = t * w if weak else t                              # the N-GPU MLP's tokens (every rank gets all of them)
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=d, n_heads=1, d_ff=f, vocab_size=1, n_layers=1)
    dense = SwiGLU(cfg, reference=False).to(dev, dtype)
    tp = TensorParallelSwiGLU.from_dense(dense)
    gen = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(tg, d, device=dev, dtype=dtype, generator=gen)
    x1 = x[:t]                                             # the baseline's tokens (weak: one GPU's share)
    elem = ELEM[dname]
    label = f"T={t}/GPU {d}->{f}->{d}" if weak else f"T={t} {d}->{f}->{d}"
    shape = {"tokens": tg, "d_model": d, "d_ff": f}
    if weak:
        shape["tokens_per_gpu"] = t
    kw = {"scaling": a.scaling}
    rows = []
    for direction in a.directions.split(","):
        bwd = direction == "fwd+bwd"
        mult = 3 if bwd else 1

        def flops_of(n):
            return mult * 6.0 * n * d * f

        def bytes_of(n):
            return (3 * d * f * elem + 2 * n * d * elem) * (3 if bwd else 1)
        n_ar = 2 if bwd else 1
        comm = 2 * (w - 1) / w * tg * d * elem * n_ar                         # ring all-reduce bytes per GPU
        formulas = (f"{mult} x 6 T d d_ff", "3 d d_ff (weights) + 2 T d, x3 fwd+bwd; comm_bytes: ring all-reduce "
                    "2 (W-1)/W T d per GPU, one forward and one backward")
        with torch.no_grad():  # weak: on the first tp_tokens tokens (bounded: one GPU's problem)
            want = dense(x1)
            val = check(tp(x1), want, 2e-2 if dtype != torch.float32 else 1e-4)
        del want
        xg = x.detach().clone().requires_grad_(bwd)
        dy = torch.randn_like(x) if bwd else None
        xb = x1.detach().clone().requires_grad_(bwd) if rank == 0 else None
        dyb = torch.randn_like(x1) if bwd and rank == 0 else None

        def make(m, xin, dyin):
            def fn():
                y = m(xin)
                if bwd:
                    y.backward(dyin)
            return fn

        base = row("swiglu_mlp", "tp", direction, "1 GPU" + (" (full weights, one GPU's tokens)" if weak else ""),
                   dname, shape, label, 1, flops_of(t), bytes_of(t), 0, formulas, role="baseline", **kw)
        _measure_one(b, base, make(dense, xb, dyb) if rank == 0 else None, t)
        r = row("swiglu_mlp", "tp", direction, f"{w} GPUs TP", dname, shape, label, w, flops_of(tg), bytes_of(tg),
                comm, formulas, series="TP", **kw)
        r["validation"] = val
        if weak:
            val["rule"] += f" (on the first {t} tokens)"
        if _all_ok(val):
            finish(r, b.measure(make(tp, xg, dy), everyone=True), tg)
            set_baseline(r, base)
        else:
            r.update(status="failed", reason="validation failed on some rank")
        rows += [base, r]
        if w == 1:
            set_share(r, None, "allreduce_share")
        elif r["status"] == "ok":  # the forward's all-reduce of (T, d) and, fwd+bwd, the backward's of dx
            bufs = [torch.zeros(tg, d, device=dev, dtype=dtype) for _ in range(n_ar)]
            c = _allreduce_row(b, "all_reduce", "tp", direction, f"{w} GPUs: all-reduce{'s' if n_ar > 1 else ''} "
                               f"of ({tg}, {d}) alone", dname, shape, label, comm, formulas, bufs, "TP")
            set_share(r, c, "allreduce_share")
            rows.append(c)
            del bufs
        del xg, dy, xb, dyb
        log(f"tp {direction}: 1 GPU {(base['time_ms'] or {}).get('median', float('nan')):.3f} ms; {w} GPUs "
            f"{(r['time_ms'] or {}).get('median', float('nan')):.3f} ms"
            + (f"; all-reduce share {r['allreduce_share']:.3f}" if r.get("allreduce_share") is not None else ""))
    return rows


# ---- data parallelism ----------------------------------------------------------------------------------------------

def profile_steps(fn, out_dir, stem, dev, steps=3):
    """``steps`` calls of ``fn`` under torch.profiler (CPU, and CUDA on a GPU): a Chrome trace and a table of the
    time per kernel (operator on the CPU) under ``out_dir``; on CUDA also the step's GPU busy time against its wall
    time (the rest: the GPU waited on the host or on another rank)."""
    from torch.profiler import ProfilerActivity, profile
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    prof.export_chrome_trace(str(out / f"{stem}.json"))
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    lines = [f"{steps} steps, {wall_ms:.2f} ms per step (wall, profiler on)"]
    if dev.type == "cuda":
        events = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in events) / 1e3 / steps
        nccl = sum(e.time_range.elapsed_us() for e in events if "nccl" in e.name.lower()) / 1e3 / steps
        lines.append(f"GPU kernels {busy:.2f} ms per step (NCCL {nccl:.2f} ms; overlapping kernels count twice); "
                     f"the GPU idle for at most {max(wall_ms - busy, 0):.2f} ms")
    lines.append(prof.key_averages().table(sort_by=key, row_limit=40))
    (out / f"{stem}.txt").write_text("\n".join(lines) + "\n")


def _ddp_bucket_bytes(model, nparams):
    """The byte sizes of DDP's gradient buckets (after the first steps DDP rebuilds them in the order the
    gradients became ready), from its logging data; else one bucket of all the fp32 gradients."""
    try:
        sizes = [int(x) for x in str(model._get_ddp_logging_data().get("bucket_sizes", "")).split(",") if x.strip()]
    except Exception:  # noqa: BLE001 - a private torch API: fall back to one all-reduce of every gradient
        sizes = []
    return sizes if sizes and all(n > 0 for n in sizes) else [nparams * 4]


def ddp_rows(b: Bench, dname, log):
    from optimized_ops.distributed import wrap_ddp
    from optimized_ops.models import OptimizedTransformer
    a, dev, w, rank = b.args, b.device, b.world, b.rank
    weak = a.scaling == "weak"
    bs, s = a.ddp_batch, a.ddp_seq
    kw = {} if a.ddp_model == "124m" else dict(d_model=128, n_heads=4, n_layers=2, vocab_size=512)
    kw["max_seq_len"] = max(s, 64)

    def make():
        torch.manual_seed(0)
        return OptimizedTransformer(**kw).to(dev)

    gen = torch.Generator().manual_seed(3)
    vocab = 50257 if a.ddp_model == "124m" else 512
    tokens = torch.randint(0, vocab, (bs * w, s + 1), generator=gen).to(dev)
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=dname == "bf16")

    def step_fn(model, opt, batch):
        params = [p for p in model.parameters()]

        def fn():
            with torch.autocast(**amp):
                loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return fn

    fused = dev.type == "cuda"
    nparams = sum(p.numel() for p in make().parameters())
    label = f"{a.ddp_model} B={bs}/GPU S={s}"
    shape = {"model": a.ddp_model, "parameters": nparams, "batch_per_gpu": bs, "seq_len": s, "global_batch": bs * w}
    tg = bs * w * s
    t1 = bs * s if weak else tg                                                 # the baseline's tokens
    comm = 2 * (w - 1) / w * nparams * 4                                        # fp32 gradients, ring all-reduce
    formulas = ("6 N T (N parameters, T tokens of the global batch, or the baseline's; attention's quadratic term "
                "left out)", "comm_bytes: ring all-reduce of the fp32 gradients, 2 (W-1)/W N 4 per GPU")
    kws = {"scaling": a.scaling}
    base = row("train_step", "ddp", "fwd+bwd+step", "1 GPU (one GPU's batch)" if weak else "1 GPU (global batch)",
               dname, shape, label, 1, 6.0 * nparams * t1, 0, 0, formulas, role="baseline", **kws)
    if rank == 0:
        m1 = make()
        o1 = torch.optim.AdamW(m1.parameters(), lr=1e-4, fused=fused)
        fn1 = step_fn(m1, o1, tokens[:bs] if weak else tokens)
    else:
        fn1 = None
    _measure_one(b, base, fn1, t1)
    if rank == 0:
        del m1, o1, fn1
    mw = wrap_ddp(make(), dev)
    ow = torch.optim.AdamW(mw.parameters(), lr=1e-4, fused=fused)
    r = row("train_step", "ddp", "fwd+bwd+step", f"{w} GPUs DDP", dname, shape, label, w, 6.0 * nparams * tg, 0, comm,
            formulas, series="DDP", **kws)
    finish(r, b.measure(step_fn(mw, ow, tokens[rank * bs:(rank + 1) * bs]), everyone=True), tg)
    flat = torch.cat([p.detach().reshape(-1).float() for p in mw.parameters()])
    summary = torch.stack([flat.sum(), flat.square().sum()]).double()
    ref = summary.clone()
    dist.broadcast(ref, src=0)
    same = bool(torch.equal(ref, summary))
    r["validation"] = {"passed": _all_ok({"passed": same}), "rule": "the ranks' parameters identical after the steps"}
    set_baseline(r, base)
    rows = [base, r]
    if w == 1:
        set_share(r, None, "allreduce_share")
    else:  # DDP's buckets (rank 0's layout, the same on every rank) all-reduced alone, one after another
        sizes = [int(x) for x in _broadcast_obj(_ddp_bucket_bytes(mw, nparams))]
        del flat, summary, ref
        bufs = [torch.zeros(n // 4, device=dev, dtype=torch.float32) for n in sizes]
        c = _allreduce_row(b, "all_reduce", "ddp", "fwd+bwd+step", f"{w} GPUs: gradient all-reduce alone "
                           f"({len(bufs)} bucket{'s' if len(bufs) > 1 else ''}, {sum(sizes) / 1e6:.1f} MB)", dname,
                           shape, label, comm, formulas, bufs, "DDP")
        set_share(r, c, "allreduce_share")
        rows.append(c)
        del bufs
    if a.profile:  # last: after every timed collective (the profiler's threads stay out of the timings)
        profile_steps(step_fn(mw, ow, tokens[rank * bs:(rank + 1) * bs]), a.profile, f"ddp-rank{rank}", dev)
    log(f"ddp: 1 GPU {(base['time_ms'] or {}).get('median', float('nan')):.2f} ms; {w} GPUs "
        f"{r['time_ms']['median']:.2f} ms"
        + (f"; all-reduce share {r['allreduce_share']:.3f}" if r.get("allreduce_share") is not None else ""))
    return rows


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import optimized_ops
    from optimized_ops.distributed import init_process_group
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and optimized_ops.built_with_cuda() else "cpu"
    rank, world = init_process_group("nccl" if device == "cuda" else "gloo",
                                     timeout=dt.timedelta(seconds=args.timeout_s))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    dname = args.dtype or ("bf16" if device == "cuda" else "fp32")

    def log(msg):
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    b = Bench(args, dev, world, rank)
    weak = args.scaling == "weak"
    log(f"benchmark_distributed ({args.scaling} scaling): {world} x {device}, {dname}, torch {torch.__version__}, "
        f"library {optimized_ops.library_path()}")
    results = []
    for case in args.cases.split(","):
        fn = {"ep": ep_rows, "tp": tp_rows, "ddp": ddp_rows}.get(case)
        if fn is None:
            sys.exit(f"--cases: expected some of ep, tp, ddp; given {case!r}")
        results += fn(b, dname, log)
        if device == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        report = {"schema": runner.SCHEMA,
                  "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "command": f"torchrun --nproc_per_node {world} bench/benchmark_distributed.py "
                             + " ".join(sys.argv[1:] if argv is None else argv),
                  "machine": dict(runner.query_machine(device), world_size=world,
                                  nccl=".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else None,
                                  env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",
                                                                      "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                      "NVSHMEM_DISABLE_NVLS")}),
                  "options": {"min_samples": args.min_samples, "max_samples": args.max_samples,
                              "min_time_s": args.min_time_s, "warmup": args.warmup,
                              "timing": "N GPUs: barrier + sync, then the slowest rank's wall time to its sync; "
                                        "1 GPU: CUDA events on rank 0"},
                  "ceilings": [], "results": results,
                  "notes": [WEAK_NOTE if weak else
                            "bench/benchmark_distributed.py: one GPU against N GPUs on the same global problem"]}
        report = runner._clean(report)
        if weak:
            key = args.machine_key or report["machine"]["gpu_key"] or "cpu"
            if not args.machine_key and device == "cuda" and torch.cuda.device_count() > 1:
                key += f"x{torch.cuda.device_count()}"
            report["machine"]["results_key"] = key
            for path in write_weak(report, pathlib.Path(args.out) / key, world):
                print(f"wrote {path}")
        else:
            write_strong(report, args.out)
    dist.barrier()
    dist.destroy_process_group()
    failed = [r for r in results if r["status"] == "failed"]
    return 1 if failed else 0


def write_strong(report, out):
    """python-distributed.json / .md under OUT/<gpu key>/ (runner.write_outputs)."""
    try:
        for path in runner.write_outputs(report, out):
            print(f"wrote {path}")
    except Exception as ex:  # noqa: BLE001 - the JSON is what matters; the renderer may not know the family
        dest = pathlib.Path(out) / report["machine"]["gpu_key"]
        dest.mkdir(parents=True, exist_ok=True)
        import json
        (dest / "python-distributed.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {dest / 'python-distributed.json'} (markdown skipped: {ex})")


WEAK_NOTE = ("bench/benchmark_distributed.py --scaling weak: the per-GPU problem fixed; the baseline one GPU on one "
             "GPU's share; scaling_efficiency = tokens_per_s(N GPUs) / (N x tokens_per_s(baseline)); a2a_share / "
             "allreduce_share: the collectives of the same sizes timed alone over the parallel layer's median")


def fmt_share(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def weak_table(rows):
    """Markdown: one line per parallel row (tokens/s of the group, the baseline's, the efficiency, the shares)."""
    out = ["| case | direction | series | N | tokens/s | 1 GPU tokens/s | efficiency | a2a share | all-reduce share "
           "| validation |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("role") != "parallel":
            continue
        base = (r.get("baseline") or {}).get("tokens_per_s")
        eff = r.get("scaling_efficiency")
        out.append(f"| {r['case']} | {r['direction']} | {r.get('series')} | {r['world_size']} | "
                   + (f"{r['tokens_per_s']:.4g}" if r.get("tokens_per_s") else "-") + " | "
                   + (f"{base:.4g}" if base else "-") + " | " + ("-" if eff is None else f"{100 * eff:.1f}%")
                   + f" | {fmt_share(r.get('a2a_share'))} | {fmt_share(r.get('allreduce_share'))} | "
                   + ("passed" if (r.get("validation") or {}).get("passed") else r["status"]) + " |")
    return "\n".join(out)


def write_weak(report, dest, world):
    """python-distributed-weak-w<N>.json and .md under dest (the results folder of one machine)."""
    import json
    dest.mkdir(parents=True, exist_ok=True)
    stem = f"python-distributed-weak-w{world}"
    json_path = dest / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    written = [json_path]
    md = [f"## Weak scaling, {world} {'GPU' if world == 1 else 'GPUs'} "
          f"({report['machine'].get('gpu') or 'CPU only'})", "", f"Run {report['created']}: `{report['command']}`",
          "", WEAK_NOTE + ".", "", weak_table(report["results"]), ""]
    try:
        md += [runner.load_renderer().run_markdown(report, heading_level=3), ""]
    except Exception as ex:  # noqa: BLE001 - the JSON and the summary matter; the renderer may not know the family
        md += [f"(the full table was skipped: {ex})", ""]
    md_path = dest / f"{stem}.md"
    md_path.write_text("\n".join(md))
    return written + [md_path]


if __name__ == "__main__":
    rc = main()
    if "--profile" in sys.argv:
        # After --profile, leave without the interpreter's teardown: once in CI a rank aborted there
        # ("terminate called without an active exception", every file already written), from a thread
        # left by torch.profiler's backend on a CPU-only machine.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
