#!/usr/bin/env python3
"""The distributed family: one GPU against N GPUs on the same global problem, launched by torchrun.

    torchrun --nproc_per_node 2 bench/benchmark_distributed.py [--cases ep,tp,ddp] [--directions fwd,fwd+bwd]
        [--ep-tokens 16384 --ep-experts 16 --ep-top-k 2 --ep-d-model 4096 --ep-d-ff 14336]
        [--tp-tokens 8192 --tp-d-model 8192 --tp-d-ff 28672] [--ddp-batch 8 --ddp-seq 1024 --ddp-model 124m]
        [--quick] [--device cuda|cpu] [--out bench/results]
    # smoke test on a CPU (gloo), small shapes:
    torchrun --nproc_per_node 2 bench/benchmark_distributed.py --device cpu --quick

Cases (the issue's targets are the defaults; every shape is a flag):

* ``ep``: the MoE layer, E experts top-k, ``--ep-tokens`` tokens **per GPU**: one GPU holding all E experts on the
  N x tokens of the global problem (``optimized_ops.nn.MoE``) against N GPUs with the experts partitioned
  (``nn.MoE(process_group=...)``), overlap on and off; tokens/s of the whole group, and the all-to-alls' share of
  the non-overlapped layer's time (the dispatch and combine exchanges timed alone with the same splits).
* ``tp``: the SwiGLU MLP ``d_model -> d_ff -> d_model`` on ``--tp-tokens`` tokens (the global problem; every rank
  gets all of them): one GPU against ``TensorParallelSwiGLU`` (one all-reduce forward, one backward).
* ``ddp``: a training step (forward, backward, clip, AdamW) of ``OptimizedTransformer`` (the 124M model) on a
  global batch of N x ``--ddp-batch`` sequences: one GPU on all of it against DDP with ``--ddp-batch`` per GPU.

Timing: a warm-up, then samples until ``--min-samples`` and ``--min-time-s`` (at most ``--max-samples``); each
N-GPU sample starts after a barrier and a device synchronisation on every rank and ends at every rank's
synchronisation; its time is the slowest rank's (all-reduce MAX). One-GPU samples run on rank 0 while the others
wait. Validation first: the N-GPU outputs against the one-GPU layer's (its output broadcast from rank 0).

Output (rank 0): ``OUT/<machine>/python-distributed.json`` (schema ``optimized-ops-bench/1``, rows as the other
Python benchmarks', family ``distributed``, plus ``world_size``, ``tokens_per_s``, ``comm_bytes``, ``a2a_share``)
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


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="ep,tp,ddp")
    p.add_argument("--directions", default="fwd,fwd+bwd", help="ep and tp: fwd, fwd+bwd")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--ep-tokens", type=int, default=16384, help="tokens per GPU")
    p.add_argument("--ep-experts", type=int, default=16)
    p.add_argument("--ep-top-k", type=int, default=2)
    p.add_argument("--ep-d-model", type=int, default=4096)
    p.add_argument("--ep-d-ff", type=int, default=14336)
    p.add_argument("--ep-capacity-factor", type=float, default=None)
    p.add_argument("--tp-tokens", type=int, default=8192, help="tokens of the global problem")
    p.add_argument("--tp-d-model", type=int, default=8192)
    p.add_argument("--tp-d-ff", type=int, default=28672)
    p.add_argument("--ddp-batch", type=int, default=8, help="sequences per GPU")
    p.add_argument("--ddp-seq", type=int, default=1024)
    p.add_argument("--ddp-model", choices=["124m", "tiny"], default="124m")
    p.add_argument("--quick", action="store_true", help="small shapes and short measurements")
    p.add_argument("--min-samples", type=int, default=10)
    p.add_argument("--max-samples", type=int, default=100)
    p.add_argument("--min-time-s", type=float, default=0.5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="ddp: after the timing, 3 more steps under torch.profiler on every rank: DIR/ddp-rank<r>.json "
                        "(a Chrome trace) and DIR/ddp-rank<r>.txt (time per kernel / operator, the NCCL kernels "
                        "and the gaps between kernels where the GPU waited)")
    p.add_argument("--out", default=str(runner.ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.ep_tokens, args.ep_experts, args.ep_d_model, args.ep_d_ff = 256, 8, 256, 512
        args.tp_tokens, args.tp_d_model, args.tp_d_ff = 256, 256, 1024
        args.ddp_batch, args.ddp_seq, args.ddp_model = 2, 64, "tiny"
        args.min_samples, args.max_samples, args.min_time_s, args.warmup = 3, 10, 0.05, 1
    return args


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
        obj = [stats]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]


def row(op, case, direction, variant, dname, shape, label, world, flops, min_bytes, comm_bytes, formulas):
    return {"op": op, "family": "distributed", "case": case, "direction": direction, "variant": variant,
            "backend": "cuda" if torch.cuda.is_available() else "cpu", "dtype": dname, "shape": shape,
            "shape_label": f"{label}, {direction}", "threads": None, "status": "ok", "reason": "", "validation": None,
            "time_ms": None,
            "flops": flops, "flops_formula": formulas[0], "min_bytes": min_bytes, "bytes_formula": formulas[1],
            "tflops": None, "gbps": None, "baseline": None, "vs_baseline": None, "roofline_fraction": None,
            "roofline_peak": None, "roofline_bandwidth": None, "kernel": None, "world_size": world,
            "comm_bytes": comm_bytes, "tokens_per_s": None}


def finish(r, st, tokens):
    r["time_ms"] = runner.stats_json(st)
    sec = st["median"] * 1e-3
    if r["flops"]:
        r["tflops"] = r["flops"] / sec / 1e12
    if r["min_bytes"]:
        r["gbps"] = r["min_bytes"] / sec / 1e9
    if tokens:
        r["tokens_per_s"] = tokens / sec


def set_baseline(r, base):
    if base and base["status"] == "ok" and r["status"] == "ok":
        r["baseline"] = {"name": base["variant"], "time_ms": base["time_ms"], "tokens_per_s": base["tokens_per_s"]}
        r["vs_baseline"] = base["time_ms"]["median"] / r["time_ms"]["median"]
        r["scaling_efficiency"] = r["vs_baseline"] / r["world_size"]


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


# ---- expert parallelism --------------------------------------------------------------------------------------------

def ep_rows(b: Bench, dname, log):
    import optimized_ops
    from optimized_ops.distributed import ExpertParallelMoE
    from optimized_ops.distributed._comm import all_to_all_single
    a, dev, w, rank = b.args, b.device, b.world, b.rank
    dtype = DTYPES[dname]
    e, k, d, f, t = a.ep_experts, a.ep_top_k, a.ep_d_model, a.ep_d_ff, a.ep_tokens
    tg = t * w
    torch.manual_seed(0)
    dense = optimized_ops.nn.MoE(d, f, e, k, capacity_factor=a.ep_capacity_factor, device=dev, dtype=dtype)
    ep = {ov: ExpertParallelMoE.from_dense(dense, overlap=ov) for ov in (True, False)}
    gen = torch.Generator(device=dev).manual_seed(1)
    x_all = torch.randn(tg, d, device=dev, dtype=dtype, generator=gen)           # the same on every rank
    x = x_all[rank * t:(rank + 1) * t].contiguous()
    if rank != 0:
        del dense
        dense = None
    elem = ELEM[dname]
    label = f"E={e} top{k} T={t}/GPU d={d} d_ff={f}"
    shape = {"experts": e, "top_k": k, "tokens_per_gpu": t, "tokens": tg, "d_model": d, "d_ff": f,
             "capacity_factor": a.ep_capacity_factor}
    rows = []
    for direction in a.directions.split(","):
        bwd = direction == "fwd+bwd"
        mult = 3 if bwd else 1
        flops = mult * 6.0 * tg * k * d * f
        weights = 3 * e * d * f * elem
        min_bytes = (weights + 2 * tg * d * elem) * (3 if bwd else 1)
        comm = 2 * tg * k * d * elem * (w - 1) / w * (2 if bwd else 1)         # over every link, both exchanges
        formulas = (f"{mult} x 6 T k d d_ff (T = {tg} tokens of all GPUs)",
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
        with torch.no_grad():
            want = dense(x_all) if rank == 0 else torch.empty(tg, d, device=dev, dtype=dtype)
        dist.broadcast(want, src=0)
        vals = {}
        for ov, m in ep.items():
            with torch.no_grad():
                vals[ov] = check(m(x), want[rank * t:(rank + 1) * t], 2e-2 if dtype != torch.float32 else 1e-4)
        del want

        base = row("moe_layer", "ep", direction, "1 GPU (all experts)", dname, shape, label, 1, flops, min_bytes,
                   0, formulas)
        xb = None
        if rank == 0:
            xb = x_all.detach().clone().requires_grad_(bwd)
            dyb = torch.randn_like(x_all) if bwd else None

            def fn1():
                y = dense(xb)
                if bwd:
                    (y.float() * dyb.float()).sum().add(dense.last_metrics.loss).backward()
            base_fn = fn1
        else:
            base_fn = None
        try:
            st = b.measure(base_fn, everyone=False)
            finish(base, st, tg)
            base["validation"] = {"passed": True, "note": "the reference"}
        except torch.cuda.OutOfMemoryError as ex:  # one GPU may not hold the global problem
            base.update(status="skipped", reason=f"out of memory on one GPU: {ex}"[:300])
        rows.append(base)
        del xb
        for ov, m in ep.items():
            r = row("moe_layer", "ep", direction, f"{w} GPUs EP" + (" overlap" if ov else ""), dname, shape, label,
                    w, flops, min_bytes, comm, formulas)
            r["validation"] = vals[ov]
            if not _all_ok(vals[ov]):
                r.update(status="failed", reason="validation failed on some rank")
            else:
                finish(r, b.measure(run_ep(m), everyone=True), tg)
                set_baseline(r, base)
            rows.append(r)
        # the all-to-alls alone, with the splits of the non-overlapped layer
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
        r = row("all_to_all", "ep", direction, f"{w} GPUs: dispatch + combine all-to-alls alone", dname, shape, label,
                w, 0.0, 0, comm, formulas)
        finish(r, b.measure(a2a, everyone=True), 0)
        r["validation"] = {"passed": True, "note": "communication only"}
        r["gbps"] = comm / (r["time_ms"]["median"] * 1e-3) / 1e9 / max(w, 1)  # per GPU, both directions
        lay = next(x_ for x_ in rows if x_["variant"] == f"{w} GPUs EP" and x_["direction"] == direction)
        if lay["status"] == "ok":
            r["a2a_share"] = lay["a2a_share"] = r["time_ms"]["median"] / lay["time_ms"]["median"]
        rows.append(r)
        log(f"ep {direction}: " + "; ".join(f"{x_['variant']} {x_['time_ms']['median']:.3f} ms" for x_ in rows
                                            if x_["direction"] == direction and x_["time_ms"]))
    return rows


# ---- tensor parallelism --------------------------------------------------------------------------------------------

def tp_rows(b: Bench, dname, log):
    from optimized_ops.distributed import TensorParallelSwiGLU
    from optimized_ops.models import TransformerConfig
    from optimized_ops.models.transformer import SwiGLU
    a, dev, w, rank = b.args, b.device, b.world, b.rank
    dtype = DTYPES[dname]
    t, d, f = a.tp_tokens, a.tp_d_model, a.tp_d_ff
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=d, n_heads=1, d_ff=f, vocab_size=1, n_layers=1)
    dense = SwiGLU(cfg, reference=False).to(dev, dtype)
    tp = TensorParallelSwiGLU.from_dense(dense)
    gen = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(t, d, device=dev, dtype=dtype, generator=gen)
    elem = ELEM[dname]
    label = f"T={t} {d}->{f}->{d}"
    shape = {"tokens": t, "d_model": d, "d_ff": f}
    rows = []
    for direction in a.directions.split(","):
        bwd = direction == "fwd+bwd"
        mult = 3 if bwd else 1
        flops = mult * 6.0 * t * d * f
        min_bytes = (3 * d * f * elem + 2 * t * d * elem) * (3 if bwd else 1)
        comm = 2 * (w - 1) / w * t * d * elem * (2 if bwd else 1)           # ring all-reduce bytes per GPU
        formulas = (f"{mult} x 6 T d d_ff", "3 d d_ff (weights) + 2 T d, x3 fwd+bwd; comm_bytes: ring all-reduce "
                    "2 (W-1)/W T d per GPU, one forward and one backward")
        with torch.no_grad():
            want = dense(x)
            val = check(tp(x), want, 2e-2 if dtype != torch.float32 else 1e-4)
        xg = x.detach().clone().requires_grad_(bwd)
        dy = torch.randn_like(x) if bwd else None

        def make(m):
            def fn():
                y = m(xg)
                if bwd:
                    y.backward(dy)
            return fn

        base = row("swiglu_mlp", "tp", direction, "1 GPU", dname, shape, label, 1, flops, min_bytes, 0, formulas)
        finish(base, b.measure(make(dense) if rank == 0 else None, everyone=False), t)
        base["validation"] = {"passed": True, "note": "the reference"}
        r = row("swiglu_mlp", "tp", direction, f"{w} GPUs TP", dname, shape, label, w, flops, min_bytes, comm,
                formulas)
        r["validation"] = val
        if _all_ok(val):
            finish(r, b.measure(make(tp), everyone=True), t)
            set_baseline(r, base)
        else:
            r.update(status="failed", reason="validation failed on some rank")
        rows += [base, r]
        log(f"tp {direction}: 1 GPU {base['time_ms']['median']:.3f} ms; {w} GPUs "
            f"{(r['time_ms'] or {}).get('median', float('nan')):.3f} ms")
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


def ddp_rows(b: Bench, dname, log):
    from optimized_ops.distributed import wrap_ddp
    from optimized_ops.models import OptimizedTransformer
    a, dev, w, rank = b.args, b.device, b.world, b.rank
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
    flops = 6.0 * nparams * tg
    comm = 2 * (w - 1) / w * nparams * 4                                        # fp32 gradients, ring all-reduce
    formulas = ("6 N T (N parameters, T tokens of the global batch; attention's quadratic term left out)",
                "comm_bytes: ring all-reduce of the fp32 gradients, 2 (W-1)/W N 4 per GPU")
    base = row("train_step", "ddp", "fwd+bwd+step", "1 GPU (global batch)", dname, shape, label, 1, flops, 0, 0,
               formulas)
    if rank == 0:
        m1 = make()
        o1 = torch.optim.AdamW(m1.parameters(), lr=1e-4, fused=fused)
        fn1 = step_fn(m1, o1, tokens)
    else:
        fn1 = None
    try:
        finish(base, b.measure(fn1, everyone=False), tg)
        base["validation"] = {"passed": True, "note": "the reference"}
    except torch.cuda.OutOfMemoryError as ex:
        base.update(status="skipped", reason=f"out of memory on one GPU: {ex}"[:300])
    if rank == 0:
        del m1, o1, fn1
    mw = wrap_ddp(make(), dev)
    ow = torch.optim.AdamW(mw.parameters(), lr=1e-4, fused=fused)
    r = row("train_step", "ddp", "fwd+bwd+step", f"{w} GPUs DDP", dname, shape, label, w, flops, 0, comm, formulas)
    finish(r, b.measure(step_fn(mw, ow, tokens[rank * bs:(rank + 1) * bs]), everyone=True), tg)
    if a.profile:
        profile_steps(step_fn(mw, ow, tokens[rank * bs:(rank + 1) * bs]), a.profile, f"ddp-rank{rank}", dev)
    flat = torch.cat([p.detach().reshape(-1).float() for p in mw.parameters()])
    summary = torch.stack([flat.sum(), flat.square().sum()]).double()
    ref = summary.clone()
    dist.broadcast(ref, src=0)
    same = bool(torch.equal(ref, summary))
    r["validation"] = {"passed": _all_ok({"passed": same}), "rule": "the ranks' parameters identical after the steps"}
    set_baseline(r, base)
    log(f"ddp: 1 GPU {(base['time_ms'] or {}).get('median', float('nan')):.2f} ms; {w} GPUs "
        f"{r['time_ms']['median']:.2f} ms")
    return [base, r]


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
    log(f"benchmark_distributed: {world} x {device}, {dname}, torch {torch.__version__}, library "
        f"{optimized_ops.library_path()}")
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
                  "notes": ["bench/benchmark_distributed.py: one GPU against N GPUs on the same global problem"]}
        report = runner._clean(report)
        try:
            for path in runner.write_outputs(report, args.out):
                print(f"wrote {path}")
        except Exception as ex:  # noqa: BLE001 - the JSON is what matters; the renderer may not know the family
            dest = pathlib.Path(args.out) / report["machine"]["gpu_key"]
            dest.mkdir(parents=True, exist_ok=True)
            import json
            (dest / "python-distributed.json").write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {dest / 'python-distributed.json'} (markdown skipped: {ex})")
    dist.barrier()
    dist.destroy_process_group()
    failed = [r for r in results if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
