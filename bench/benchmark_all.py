#!/usr/bin/env python3
"""Python benchmark runner: every optimized_ops op against its PyTorch counterpart, in one run.

    python bench/benchmark_all.py [--device cuda|cpu] [--ops matmul,fused] [--dtypes bf16,fp16,fp32]
                                  [--variants all|auto|NAME,...] [--shapes 4096,4097x4095x4093,8x1024x1024x1024]
                                  [--out bench/results] [--quick]
    python bench/benchmark_all.py --ops fused [--fused-ops rms_norm,...] [--directions fwd,bwd,fwd+bwd]
                                  [--shapes 16384x8192] [--no-compile]     # see bench/benchmark_fused.py
    python bench/benchmark_all.py plot RESULT.json      # the PNG again, from a JSON file

Op families: matmul (every GEMM variant vs torch.matmul) and fused (bench/benchmark_fused.py: the
fused memory-bound ops vs torch eager and torch.compile). --shapes, --dtypes and --variants apply
to the families being run; without them each family has its own defaults.

Measurement (the statistics of the C++ harness, bench/harness.h, ported):
  * validate first: every variant and the baseline run once on the first input set and are
    checked against float64 with the bound of the C++ check (src/gemm/gemm_check.h); a row that
    fails is reported "failed" and not timed;
  * warm-up until warmup_s or max_warmup runs; then samples, each timed with CUDA events around
    the op on the current stream (CPU: perf_counter around the call), with a cold cache before
    every sample (GPU: a write of 2x the L2 size enqueued before the start event; CPU: a write of
    2x the last-level cache) and rotating input sets (enough to cover 2x the cache, at most 8);
  * stopping rule: at least min_samples and min_time_s, then stop when the relative standard
    error of the mean (CV / sqrt(n)) is below target_rse, or at max_samples / max_time_s;
  * statistics: median, p10, p90 (linear interpolation), CV with the n-1 standard deviation.

Output, under OUT/<machine key>/ ("h100", or "cpu"), one set per family: python-<family>.json in
the schema "optimized-ops-bench/1" of the C++ benchmark (so scripts/render_results.py renders it),
python-<family>.md (its markdown table) and python-<family>.png (matmul: TFLOP/s of every variant
and of torch, per shape and dtype; fused: GB/s per op and direction, see benchmark_fused.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import benchmark_fused  # noqa: E402 - the fused family (imports this module back, lazily)

SCHEMA = "optimized-ops-bench/1"
ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNIT_ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}

DEFAULT_SHAPES = {
    # cubes, the awkward shape of the anchors, a short K, a decode-like skinny M, and a batch
    "cuda": ["4096", "8192", "4097x4095x4093", "4096x4096x1024", "32x14336x4096", "8x1024x1024x1024"],
    "cpu": ["256", "511x513x257", "768", "4x128x256x512"],
}
QUICK_SHAPES = {"cuda": ["2048", "4097x4095x4093", "8x512x512x512"], "cpu": ["128", "257x131x263"]}
DEFAULT_DTYPES = {"cuda": ["bf16", "fp16", "fp32"], "cpu": ["fp32", "bf16"]}


# ---- statistics and the stopping rule (bench/harness.cpp) -------------------------------------

class Options:
    def __init__(self, args):
        self.min_samples = args.min_samples
        self.max_samples = args.max_samples
        self.min_time_s = args.min_time_s
        self.max_time_s = args.max_time_s
        self.target_rse = args.target_rse
        self.warmup_s = args.warmup_s
        self.max_warmup = args.max_warmup
        self.flush_cache = not args.no_flush

    def as_json(self):
        return {"min_samples": self.min_samples, "max_samples": self.max_samples,
                "min_time_s": self.min_time_s, "max_time_s": self.max_time_s,
                "target_rse": self.target_rse, "warmup_s": self.warmup_s, "flush_cache": self.flush_cache,
                "roofline": "max(flops / peak, min_bytes / bandwidth) / time; peak: the torch.matmul "
                            "(cuBLAS on GPU) rate of the dtype among the ceilings, bandwidth: device_copy "
                            "(GPU) or host_copy (CPU), all measured in this run"}


HARD_MIN_SAMPLES = 3


def percentile(sorted_xs, q):
    if not sorted_xs:
        return 0.0
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    frac = pos - lo
    return sorted_xs[lo] * (1 - frac) + sorted_xs[hi] * frac


def summarize(samples):
    xs = sorted(samples)
    n = len(xs)
    if n == 0:
        return {"median": 0.0, "p10": 0.0, "p90": 0.0, "mean": 0.0, "cv": 0.0, "samples": 0}
    mean = sum(xs) / n
    cv = 0.0
    if n > 1 and mean > 0:
        cv = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) / mean
    return {"median": percentile(xs, 0.5), "p10": percentile(xs, 0.1), "p90": percentile(xs, 0.9),
            "mean": mean, "cv": cv, "samples": n}


def should_stop(samples, elapsed_s, opt):
    n = len(samples)
    if n >= max(opt.max_samples, 1):
        return True
    if elapsed_s >= opt.max_time_s and n >= HARD_MIN_SAMPLES:
        return True
    if n < opt.min_samples or elapsed_s < opt.min_time_s:
        return False
    return summarize(samples)["cv"] / math.sqrt(n) < opt.target_rse


def host_llc_bytes():
    best = 0
    for index in range(8):
        try:
            text = pathlib.Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        m = re.match(r"(\d+)([KkMm]?)", text)
        if m:
            v = int(m.group(1)) * {"": 1, "K": 1024, "k": 1024, "M": 1 << 20, "m": 1 << 20}[m.group(2)]
            best = max(best, v)
    return best or 32 << 20


class Timer:
    """Times run_once(i) on one device with the harness rules."""

    def __init__(self, device, opt):
        self.device, self.opt = device, opt
        if device == "cuda":
            l2 = torch.cuda.get_device_properties(0).L2_cache_size
            self.cache_bytes = l2
            self.flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
        else:
            self.cache_bytes = host_llc_bytes()
            self.flush_buf = torch.empty(2 * self.cache_bytes, dtype=torch.uint8)
        self.flush_value = 0

    def flush(self):
        self.flush_value = (self.flush_value + 1) % 251
        self.flush_buf.fill_(self.flush_value)

    def measure(self, run_once, before=None):
        """before(i), when given, runs untimed ahead of sample i (and of each warm-up run): on the GPU
        its work is enqueued before the cache flush and the start event."""
        before = before or (lambda i: None)
        return self._measure_gpu(run_once, before) if self.device == "cuda" else self._measure_cpu(run_once, before)

    def _measure_gpu(self, run_once, before):
        opt = self.opt
        stream = torch.cuda.current_stream()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        it, warm_ms = 0, 0.0
        for _ in range(max(opt.max_warmup, 1)):
            before(it)
            start.record(stream)
            run_once(it)
            it += 1
            stop.record(stream)
            stop.synchronize()
            warm_ms += start.elapsed_time(stop)
            if warm_ms >= opt.warmup_s * 1e3:
                break
        samples, t0 = [], time.perf_counter()
        while True:
            # The flush is enqueued before the start event: the GPU runs it while the host enqueues
            # the sample, so neither the flush nor the launch overhead lands in the timed region.
            before(it)
            if opt.flush_cache:
                self.flush()
            start.record(stream)
            run_once(it)
            it += 1
            stop.record(stream)
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
            if should_stop(samples, time.perf_counter() - t0, opt):
                break
        return summarize(samples)

    def _measure_cpu(self, run_once, before):
        opt = self.opt
        it, w0 = 0, time.perf_counter()
        for _ in range(max(opt.max_warmup, 1)):
            before(it)
            run_once(it)
            it += 1
            if time.perf_counter() - w0 >= opt.warmup_s:
                break
        samples, t0 = [], time.perf_counter()
        while True:
            before(it)
            if opt.flush_cache:
                self.flush()
            s0 = time.perf_counter()
            run_once(it)
            it += 1
            samples.append((time.perf_counter() - s0) * 1e3)
            if should_stop(samples, time.perf_counter() - t0, opt):
                break
        return summarize(samples)


def rotating_set_count(set_bytes, cache_bytes, budget_bytes, max_sets=8):
    if set_bytes <= 0:
        return 2
    want = -(-2 * cache_bytes // set_bytes)
    want = min(max(want, 2), max(max_sets, 2))
    while want > 1 and want * set_bytes > budget_bytes:
        want -= 1
    return int(want)


# ---- machine and ceilings ---------------------------------------------------------------------

def gpu_key_from_name(name):
    """The C++ harness's key: a model token ("h100"), else the name's tokens joined."""
    tokens = re.findall(r"[a-z0-9]+", name.lower())
    for t in tokens:
        m = re.match(r"([a-z]+)(\d)", t)
        if m and 0 < len(m.group(1)) < 4 and t != "nvidia":
            return t
    key = "".join(t for t in tokens if t not in ("nvidia", "geforce", "tesla", "quadro"))
    return key or "gpu"


def cpu_model_name():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def query_machine(device):
    m = {"gpu": None, "gpu_key": "cpu", "sm_count": 0, "l2_bytes": 0, "cuda_runtime": 0, "cuda_driver": 0,
         "cpu": cpu_model_name(), "cpu_threads": os.cpu_count() or 1, "cpu_isa": "n/a (python runner)",
         "cpu_llc_bytes": host_llc_bytes(), "torch": torch.__version__}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, gpu_key=gpu_key_from_name(p.name), sm_count=p.multi_processor_count,
                 l2_bytes=p.L2_cache_size)
        if torch.version.cuda:
            major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
            m["cuda_runtime"] = major * 1000 + minor * 10
    return m


def measure_ceilings(device, timer, dtypes, log, matmul=True):
    """Copy bandwidth and (when `matmul`) the torch.matmul rate per dtype, measured in this run."""
    ceilings = []
    if device == "cuda":
        n = 1 << 28  # 256 MiB each way
        src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
        st = timer.measure(lambda i: dst.copy_(src))
        ceilings.append({"name": "device_copy", "unit": "GB/s", "bytes": 2 * n,
                         "value": 2 * n / (st["median"] * 1e-3) / 1e9, "time_ms": _stats_json(st)})
        sizes = {"bf16": 8192, "fp16": 8192, "fp32": 4096}
    else:
        n = 1 << 27
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        st = timer.measure(lambda i: dst.copy_(src))
        ceilings.append({"name": "host_copy", "unit": "GB/s", "bytes": 2 * n, "threads": torch.get_num_threads(),
                         "value": 2 * n / (st["median"] * 1e-3) / 1e9, "time_ms": _stats_json(st)})
        sizes = {"bf16": 1024, "fp16": 1024, "fp32": 1024}
    del src, dst
    log(f"ceiling {ceilings[0]['name']}: {ceilings[0]['value']:.4g} GB/s")
    for name in (dtypes if matmul else []):
        s = sizes[name]
        a = torch.randn(s, s, device=device).to(DTYPES[name])
        b = torch.randn(s, s, device=device).to(DTYPES[name])
        st = timer.measure(lambda i: torch.matmul(a, b))
        rate = 2.0 * s**3 / (st["median"] * 1e-3) / 1e12
        c = {"name": f"torch_matmul_{name}", "unit": "TFLOP/s", "shape": f"{s}x{s}x{s}", "value": rate,
             "time_ms": _stats_json(st)}
        if device == "cpu":
            c["threads"] = torch.get_num_threads()
        ceilings.append(c)
        log(f"ceiling {c['name']} {c['shape']}: {rate:.3g} TFLOP/s")
    return ceilings


# ---- GEMM -------------------------------------------------------------------------------------

class GemmShape:
    def __init__(self, text):
        parts = [int(p) for p in re.split(r"[xX]", text)]
        if len(parts) == 1:
            parts = parts * 3
        if len(parts) == 3:
            parts = [1] + parts
        if len(parts) != 4 or min(parts) < 1:
            raise argparse.ArgumentTypeError(f"--shapes: expected N, MxNxK or BxMxNxK; given '{text}'")
        self.batch, self.m, self.n, self.k = parts

    def label(self):
        s = f"{self.m}x{self.n}x{self.k}"
        return s if self.batch == 1 else f"{self.batch}x{s}"

    def a_shape(self):
        return (self.m, self.k) if self.batch == 1 else (self.batch, self.m, self.k)

    def b_shape(self):
        return (self.k, self.n) if self.batch == 1 else (self.batch, self.k, self.n)


def validate_gemm(out, a, b, dtype_name, max_elements=1 << 22):
    """The C++ check's bound: out_eps*|ref| + 8*sqrt(K)*2^-24*sum|a b|, on (up to) every element."""
    a64, b64 = a.double(), b.double()
    rows = out.shape[-2]
    if out.numel() > max_elements:  # a fixed subset of rows (first, last and evenly spaced)
        take = max(1, max_elements // (out.numel() // rows))
        idx = torch.linspace(0, rows - 1, take, device=a.device).round().long().unique()
        a64, out = a64.index_select(-2, idx), out.index_select(-2, idx)
    ref = torch.matmul(a64, b64)
    mag = torch.matmul(a64.abs(), b64.abs())
    k = a.shape[-1]
    allowed = UNIT_ROUNDOFF[dtype_name] * ref.abs() + 8 * math.sqrt(k) * 2.0**-24 * mag + 1e-30
    err = (out.double() - ref).abs()
    ratio = err / allowed
    worst = math.inf if torch.isnan(ratio).any() else ratio.max().item()
    max_rel = err.max().item() / max(ref.abs().max().item(), 1e-300)
    return {"passed": bool(worst <= 1.0), "max_rel_error": max_rel, "worst_ratio": worst,
            "checked": int(ref.numel())}


def gemm_rows(args, device, timer, ceilings, log, notes):
    import optimized_ops

    rows = []
    peaks = {c["name"].removeprefix("torch_matmul_"): c for c in ceilings if c["name"].startswith("torch_matmul_")}
    bw = next((c for c in ceilings if c["unit"] == "GB/s"), None)
    all_variants = ["auto"] + optimized_ops.variants()
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for text in args.shapes:
            shape = GemmShape(text)
            es = torch.tensor([], dtype=dtype).element_size()
            set_bytes = (shape.m * shape.k + shape.k * shape.n + shape.m * shape.n) * es * shape.batch
            if device == "cuda":
                free, _ = torch.cuda.mem_get_info()
                budget = free // 2
            else:
                budget = 2 << 30
            nsets = rotating_set_count(set_bytes, timer.cache_bytes, budget)
            gen = torch.Generator(device="cpu").manual_seed(1234)
            sets = [((torch.rand(shape.a_shape(), generator=gen) * 2 - 1).to(device=device, dtype=dtype),
                     (torch.rand(shape.b_shape(), generator=gen) * 2 - 1).to(device=device, dtype=dtype))
                    for _ in range(nsets)]
            flops = 2.0 * shape.m * shape.n * shape.k * shape.batch
            min_bytes = set_bytes

            def base_row(variant):
                return {"op": "matmul", "variant": variant, "backend": device, "dtype": dname,
                        "shape": {"m": shape.m, "n": shape.n, "k": shape.k, "batch": shape.batch},
                        "shape_label": shape.label(), "threads": torch.get_num_threads() if device == "cpu" else None,
                        "status": "ok", "reason": "", "validation": None, "time_ms": None, "flops": flops,
                        "min_bytes": min_bytes, "tflops": None, "gbps": None, "baseline": None,
                        "vs_baseline": None, "roofline_fraction": None, "roofline_peak": None,
                        "roofline_bandwidth": None, "kernel": None}

            # The baseline: validated, then timed, once per (dtype, shape).
            a0, b0 = sets[0]
            base_val = validate_gemm(torch.matmul(a0, b0), a0, b0, dname)
            log(f"matmul torch.matmul {dname} {shape.label()} ({nsets} input sets)")
            base_stats = timer.measure(lambda i: torch.matmul(*sets[i % nsets]))
            baseline = {"name": "torch.matmul", "time_ms": _stats_json(base_stats),
                        "tflops": flops / (base_stats["median"] * 1e-3) / 1e12, "validation": base_val}

            for variant in all_variants:
                if args.variants != ["all"] and variant not in args.variants:
                    continue
                ok, why = optimized_ops.variant_supports(variant, dtype, device)
                if not ok:
                    if why and "runs on" not in why:  # other device's rungs are not rows at all
                        r = base_row(variant)
                        r.update(status="skipped", reason=why)
                        rows.append(r)
                    continue
                r = base_row(variant)
                run = lambda i, v=variant: optimized_ops.matmul(*sets[i % nsets], variant=v)  # noqa: E731
                try:
                    out = run(0)
                    r["validation"] = validate_gemm(out, a0, b0, dname)
                    del out
                except Exception as e:  # noqa: BLE001 - reported in the row
                    r.update(status="failed", reason=f"{type(e).__name__}: {e}".splitlines()[0])
                    rows.append(r)
                    log(f"  {variant}: FAILED {r['reason']}")
                    continue
                if not r["validation"]["passed"]:
                    r.update(status="failed", reason=f"validation: worst error / allowed = "
                                                     f"{r['validation']['worst_ratio']:.3g}")
                    rows.append(r)
                    log(f"  {variant}: FAILED {r['reason']}")
                    continue
                if args.skip_slow and _too_slow(variant, device, flops):
                    r.update(status="skipped", reason="--skip-slow: naive rung at this size")
                    rows.append(r)
                    continue
                st = timer.measure(run)
                r["time_ms"] = _stats_json(st)
                r["tflops"] = flops / (st["median"] * 1e-3) / 1e12
                r["gbps"] = min_bytes / (st["median"] * 1e-3) / 1e9
                r["baseline"] = baseline
                r["vs_baseline"] = base_stats["median"] / st["median"]
                peak = peaks.get(dname)
                if peak:
                    r["roofline_peak"] = {"name": f"{peak['name']} {peak['shape']}", "value": peak["value"],
                                          "unit": "TFLOP/s"}
                    ideal = flops / (peak["value"] * 1e12)
                    if bw:
                        r["roofline_bandwidth"] = {"name": bw["name"], "value": bw["value"], "unit": "GB/s"}
                        ideal = max(ideal, min_bytes / (bw["value"] * 1e9))
                    r["roofline_fraction"] = ideal / (st["median"] * 1e-3)
                rows.append(r)
                log(f"  {variant:>15}: {st['median']:.4g} ms [{st['p10']:.4g}-{st['p90']:.4g}] "
                    f"{r['tflops']:.3g} TFLOP/s, {r['vs_baseline']:.2f}x torch.matmul")
            del sets
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _too_slow(variant, device, flops):
    limit = 2.0 * 4096**3 if device == "cuda" else 2.0 * 512**3
    return variant in ("naive", "cpu_naive") and flops > limit


def _stats_json(st):
    return {k: st[k] for k in ("median", "p10", "p90", "cv", "samples")}


OPS = {"matmul": gemm_rows, "fused": benchmark_fused.fused_rows}


# ---- output -----------------------------------------------------------------------------------

def load_renderer():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "scripts" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plot(report, path_for_op):
    """One PNG per op family: TFLOP/s of each variant and of torch, grouped by shape, a panel per
    dtype (the fused family: benchmark_fused.plot_fused). Returns the written paths ([] when
    matplotlib is missing)."""
    if any(r.get("family") == "fused" for r in report["results"]):
        fused = dict(report, results=[r for r in report["results"] if r.get("family") == "fused"])
        written = benchmark_fused.plot_fused(fused, path_for_op("fused"))
        rest = [r for r in report["results"] if r.get("family") != "fused"]
        if not rest:
            return written
        return written + plot(dict(report, results=rest), path_for_op)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmark_all: matplotlib is not installed: no plot (run `benchmark_all.py plot JSON` "
              "where it is)", file=sys.stderr)
        return []
    written = []
    machine = report["machine"].get("gpu") or f"CPU ({report['machine'].get('cpu')})"
    for op in sorted({r["op"] for r in report["results"]}):
        rows = [r for r in report["results"] if r["op"] == op and r["status"] == "ok"]
        dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
        if not dtypes:
            continue
        fig, axes = plt.subplots(len(dtypes), 1, figsize=(13, 3.6 * len(dtypes)), squeeze=False)
        for ax, dname in zip(axes[:, 0], dtypes):
            drows = [r for r in rows if r["dtype"] == dname]
            shapes = list(dict.fromkeys(r["shape_label"] for r in drows))
            variants = list(dict.fromkeys(r["variant"] for r in drows)) + ["torch.matmul"]
            width = 0.8 / len(variants)
            cmap = plt.get_cmap("viridis")
            for vi, variant in enumerate(variants):
                ys = []
                for s in shapes:
                    if variant == "torch.matmul":
                        match = next((r for r in drows if r["shape_label"] == s and r.get("baseline")), None)
                        ys.append(match["baseline"]["tflops"] if match else 0)
                    else:
                        match = next((r for r in drows if r["shape_label"] == s and r["variant"] == variant), None)
                        ys.append(match["tflops"] if match else 0)
                xs = [i + (vi - (len(variants) - 1) / 2) * width for i in range(len(shapes))]
                color = "#d62728" if variant == "torch.matmul" else cmap(vi / max(len(variants) - 1, 1))
                ax.bar(xs, ys, width, label=variant, color=color,
                       edgecolor="black" if variant == "torch.matmul" else None)
            ax.set_xticks(range(len(shapes)))
            ax.set_xticklabels(shapes)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{op} {dname} on {machine}: median TFLOP/s per variant vs torch")
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=7, ncol=min(len(variants), 6), loc="upper left")
        fig.tight_layout()
        path = path_for_op(op)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def family_of(row):
    return row.get("family") or row["op"]


def write_outputs(report, out_dir):
    """python-<family>.json / .md / .png per op family of the results (each with the ceilings)."""
    key = report["machine"]["gpu_key"] or "cpu"
    dest = pathlib.Path(out_dir) / key
    dest.mkdir(parents=True, exist_ok=True)
    families = list(dict.fromkeys(family_of(r) for r in report["results"])) or ["ceilings"]
    written = []
    for family in families:
        part = dict(report, results=[r for r in report["results"] if family_of(r) == family])
        stem = f"python-{family}"
        json_path = dest / f"{stem}.json"
        json_path.write_text(json.dumps(part, indent=2, allow_nan=False) + "\n")
        md_path = dest / f"{stem}.md"
        md_path.write_text(load_renderer().run_markdown(part) + "\n")
        written += [json_path, md_path, *plot(part, lambda op: dest / f"python-{op}.png")]
    return written


def _clean(x):
    """NaN/inf -> None, so that the JSON is strict."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when torch sees a GPU and the library has CUDA, else cpu")
    p.add_argument("--ops", default="all", help=f"comma list of {', '.join(OPS)} (default all)")
    p.add_argument("--dtypes", default=None, help="comma list of fp32, fp16, bf16 (default: per family)")
    p.add_argument("--variants", default=None,
                   help="all, or a comma list (auto, naive, ...) (default: matmul all, fused auto)")
    p.add_argument("--shapes", default=None,
                   help="comma list: matmul N (cube), MxNxK or BxMxNxK; fused ROWSxWIDTH (default: per family)")
    p.add_argument("--fused-ops", default=None, help=f"fused: comma list of {', '.join(benchmark_fused.FUSED_OPS)}")
    p.add_argument("--directions", default=None, help="fused: comma list of fwd, bwd, fwd+bwd (default all)")
    p.add_argument("--gelu", default="none", choices=["none", "tanh"], help="fused: bias_gelu's form")
    p.add_argument("--no-compile", action="store_true", help="fused: leave out the torch.compile rows")
    p.add_argument("--quick", action="store_true", help="small shapes and short measurements")
    p.add_argument("--skip-slow", action="store_true", help="skip naive rungs on large shapes")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    p.add_argument("--min-samples", type=int, default=10)
    p.add_argument("--max-samples", type=int, default=200)
    p.add_argument("--min-time-s", type=float, default=0.2)
    p.add_argument("--max-time-s", type=float, default=2.0)
    p.add_argument("--target-rse", type=float, default=0.01)
    p.add_argument("--warmup-s", type=float, default=0.05)
    p.add_argument("--max-warmup", type=int, default=10)
    p.add_argument("--no-flush", action="store_true", help="keep caches warm between samples")
    args = p.parse_args(argv)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        if len(argv) != 2:
            sys.exit("usage: benchmark_all.py plot RESULT.json")
        path = pathlib.Path(argv[1])
        report = json.loads(path.read_text())
        if report.get("schema") != SCHEMA:
            sys.exit(f"{path}: expected schema {SCHEMA}")
        for w in plot(report, lambda op: path.parent / f"python-{op}.png"):
            print(f"wrote {w}")
        return 0
    args = parse_args(argv)
    import optimized_ops

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and optimized_ops.built_with_cuda() else "cpu"
    if device == "cuda" and not (torch.cuda.is_available() and optimized_ops.built_with_cuda()):
        sys.exit("--device cuda: torch sees no GPU or the library was built without CUDA")
    ops = list(OPS) if args.ops == "all" else args.ops.split(",")
    for op in ops:
        if op not in OPS:
            sys.exit(f"--ops: expected some of {', '.join(OPS)}; given '{op}'")
    # The raw filters (each family resolves its own defaults), and matmul's resolved ones.
    args.dtypes_arg = args.dtypes.split(",") if args.dtypes else None
    args.shapes_arg = args.shapes.split(",") if args.shapes else None
    args.variants_arg = args.variants.split(",") if args.variants else None
    args.fused_ops = args.fused_ops.split(",") if args.fused_ops else None
    args.directions = args.directions.split(",") if args.directions else None
    args.dtypes = args.dtypes_arg or DEFAULT_DTYPES[device]
    for d in args.dtypes:
        if d not in DTYPES:
            sys.exit(f"--dtypes: expected fp32, fp16 or bf16; given '{d}'")
    args.shapes = args.shapes_arg or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)[device]
    if "matmul" in ops:
        for s in args.shapes:
            GemmShape(s)
    args.variants = args.variants_arg or ["all"]
    if args.quick:
        args.min_time_s, args.max_time_s, args.min_samples = 0.05, 0.3, 5

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    opt = Options(args)
    timer = Timer(device, opt)
    log(f"benchmark_all: {device}, torch {torch.__version__}, library {optimized_ops.library_path()}")
    report = {"schema": SCHEMA,
              "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "python bench/benchmark_all.py " + " ".join(argv),
              "machine": query_machine(device), "options": opt.as_json()}
    report["ceilings"] = measure_ceilings(device, timer, args.dtypes, log, matmul="matmul" in ops)
    results = []
    notes = ["Python runner (bench/benchmark_all.py): each op through torch.ops.optimized "
             "(including its output allocation from the caching allocator, as torch's ops)"]
    if "matmul" in ops:
        notes.append("matmul: baseline torch.matmul (cuBLAS on CUDA) measured in the same run")
    for op in ops:
        results += OPS[op](args, device, timer, report["ceilings"], log, notes)
    report["results"] = results
    report["notes"] = notes
    report = _clean(report)
    for path in write_outputs(report, args.out):
        print(f"wrote {path}")
    failed = [r for r in results if r["status"] == "failed"]
    if failed:
        log(f"benchmark_all: {len(failed)} rows failed validation or raised")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
