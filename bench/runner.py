#!/usr/bin/env python3
"""The Python benchmark runner: the harness of bench/harness (statistics, the stopping rule, cold-cache
timing with CUDA events, rotating inputs, ceilings, the report in the schema of the C++ benchmark),
ported, and the one registry of the op families it runs.

    families register themselves:   runner.register(runner.Family("fused", rows=fused_rows, ...))
    the entry points import them:   bench/benchmark_all.py (every family), bench/benchmark_fused.py
                                    (the fused family alone), bench/loader_bench.py (the loader: a
                                    standalone run over a dataset on disk)

Imports go one way: the family modules import this one, never each other, and this one imports no
family (no cycle). A family's rows(args, device, timer, ceilings, log, notes) returns result rows
(dicts of the schema "optimized-ops-bench/1"); its options are added by add_arguments(parser); the
torch.matmul ceilings it needs by ceiling_dtypes(args, device); its PNG by plot(report, path).

Measurement (the statistics of the C++ harness, bench/harness/harness.h, ported):
  * validate first: every variant and the baseline run once on the first input set and are
    checked against float64 with the family's tolerance rule (bench/tolerance.py, the mirror of
    src/testing/tolerance.h); a row that fails is reported "failed" and not timed;
  * warm-up until warmup_s or max_warmup runs; then samples, each timed with CUDA events around
    the op on the current stream (CPU: perf_counter around the call; --launch-cover-us N: a GPU spin
    of about N us before the start event, for host launch paths longer than the flush), with a cold cache before
    every sample (GPU: a write of 2x the L2 size enqueued before the start event; CPU: a write of
    2x the last-level cache) and rotating input sets (enough to cover 2x the cache, at most 8);
  * stopping rule: at least min_samples and min_time_s, then stop when the relative standard
    error of the mean (CV / sqrt(n)) is below target_rse, or at max_samples / max_time_s;
  * statistics: median, p10, p90 (linear interpolation), CV with the n-1 standard deviation.

Output, under OUT/<machine key>/ ("h100", or "cpu"), one set per family: python-<family>.json in
the schema "optimized-ops-bench/1" of the C++ benchmark (so scripts/render_results.py renders it),
python-<family>.md (its markdown table) and python-<family>.png (the family's plot).

--metrics (bench/ncu_metrics.py, issue 23): after the timed run, one child run under Nsight Compute
(--metrics-child) profiles one extra call of every measurement; each row (and ceiling) gets a `metrics`
object: achieved occupancy, DRAM bytes and memory_efficiency (min_bytes / DRAM bytes), L2 / L1 / shared
traffic, tensor-pipe utilization, the top stall reasons, registers and local (spill) bytes; or
{"status": "skipped", "reason": ...} where ncu is absent or the run is on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from typing import Callable

import torch

SCHEMA = "optimized-ops-bench/1"
ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---- the registry ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Family:
    name: str                                 # --ops name; results python-<name>.json
    rows: Callable | None = None              # (args, device, timer, ceilings, log, notes) -> [row]
    add_arguments: Callable | None = None     # (argparse parser) -> None: the family's options
    prepare: Callable | None = None           # (args, device) -> None: resolve / check its options
    ceiling_dtypes: Callable | None = None    # (args, device) -> dtype names whose torch.matmul rate it needs
    plot: Callable | None = None              # (report, path) -> [written paths]
    standalone: Callable | None = None        # (argv) -> exit code: a family with its own run (the loader)
    summary: str = ""


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


# ---- statistics and the stopping rule (bench/harness/harness.cpp) -------------------------------------

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
        self.launch_cover_us = float(getattr(args, "launch_cover_us", 0.0) or 0.0)

    def as_json(self):
        return {"min_samples": self.min_samples, "max_samples": self.max_samples,
                "min_time_s": self.min_time_s, "max_time_s": self.max_time_s,
                "target_rse": self.target_rse, "warmup_s": self.warmup_s, "flush_cache": self.flush_cache,
                "launch_cover_us": self.launch_cover_us,
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
        # --launch-cover-us: a GPU spin of about that long after the flush, before the start event, so that a
        # host whose launch path (Python wrapper, dispatcher, launcher) takes longer than the flush still has
        # every kernel of the sample enqueued before the GPU reaches the start event (the timed region is then
        # the kernels' alone). The clock rate turns microseconds into the spin's cycles.
        cover_us = float(getattr(opt, "launch_cover_us", 0.0) or 0.0)
        self.cover_cycles = 0
        if device == "cuda" and cover_us > 0:
            mhz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) / 1e3 or 1980.0
            self.cover_cycles = int(cover_us * mhz)
        # --metrics-child (ncu_metrics.py): every measurement ends with one profiled call.
        self.metrics_child = False
        self.measures = 0     # measurements so far (their ids)
        self.profiled = []    # the ids whose profiled call ran, in order

    def flush(self):
        self.flush_value = (self.flush_value + 1) % 251
        self.flush_buf.fill_(self.flush_value)

    def measure(self, run_once, before=None):
        """before(i), when given, runs untimed ahead of sample i (and of each warm-up run): on the GPU
        its work is enqueued before the cache flush and the start event."""
        before = before or (lambda i: None)
        measure_id = self.measures
        self.measures += 1
        st = self._measure_gpu(run_once, before) if self.device == "cuda" else self._measure_cpu(run_once, before)
        if self.metrics_child:
            if self.device == "cuda":
                self._profiled_call(run_once, before, st["samples"] + max(self.opt.max_warmup, 1), measure_id)
            st["_measure"] = measure_id
        return st

    def _profiled_call(self, run_once, before, it, measure_id):
        """One more call, untimed, between profiler start and stop, after the marker kernel (ncu_metrics.py):
        ncu (--profile-from-start off) profiles exactly its kernels."""
        before(it)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        try:
            torch.cuda._sleep(1)  # the marker: "spin_kernel" opens this measurement's segment
            run_once(it)
            torch.cuda.synchronize()
        finally:
            torch.cuda.profiler.stop()
        self.profiled.append(measure_id)

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
            if self.cover_cycles:  # --launch-cover-us: the GPU spins while the host enqueues the sample
                torch.cuda._sleep(self.cover_cycles)
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


_MEASURED = []  # (stats_json's dict, measurement id), in --metrics-child runs: which measurement a row timed


def stats_json(st):
    out = {k: st[k] for k in ("median", "p10", "p90", "cv", "samples")}
    if "_measure" in st:
        _MEASURED.append((out, st["_measure"]))
    return out


def measure_of(time_json):
    """The measurement id behind a row's time_ms (the same dict stats_json returned), or None."""
    return next((m for d, m in _MEASURED if d is time_json), None)


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


def measure_ceilings(device, timer, dtypes, log):
    """Copy bandwidth and the torch.matmul rate of each of `dtypes`, measured in this run."""
    ceilings = []
    if device == "cuda":
        n = 1 << 28  # 256 MiB each way
        src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
        st = timer.measure(lambda i: dst.copy_(src))
        ceilings.append({"name": "device_copy", "unit": "GB/s", "bytes": 2 * n,
                         "value": 2 * n / (st["median"] * 1e-3) / 1e9, "time_ms": stats_json(st)})
        sizes = {"bf16": 8192, "fp16": 8192, "fp32": 4096}
    else:
        n = 1 << 27
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        st = timer.measure(lambda i: dst.copy_(src))
        ceilings.append({"name": "host_copy", "unit": "GB/s", "bytes": 2 * n, "threads": torch.get_num_threads(),
                         "value": 2 * n / (st["median"] * 1e-3) / 1e9, "time_ms": stats_json(st)})
        sizes = {"bf16": 1024, "fp16": 1024, "fp32": 1024}
    del src, dst
    log(f"ceiling {ceilings[0]['name']}: {ceilings[0]['value']:.4g} GB/s")
    for name in dtypes:
        s = sizes[name]
        a = torch.randn(s, s, device=device).to(DTYPES[name])
        b = torch.randn(s, s, device=device).to(DTYPES[name])
        st = timer.measure(lambda i: torch.matmul(a, b))
        rate = 2.0 * s**3 / (st["median"] * 1e-3) / 1e12
        c = {"name": f"torch_matmul_{name}", "unit": "TFLOP/s", "shape": f"{s}x{s}x{s}", "value": rate,
             "time_ms": stats_json(st)}
        if device == "cpu":
            c["threads"] = torch.get_num_threads()
        ceilings.append(c)
        log(f"ceiling {c['name']} {c['shape']}: {rate:.3g} TFLOP/s")
    return ceilings


# ---- output -----------------------------------------------------------------------------------

def load_renderer():
    spec = importlib.util.spec_from_file_location("render_results", ROOT / "scripts" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_ncu_metrics():
    """bench/ncu_metrics.py (the --metrics side), by path: the runner is imported from several places."""
    if "ncu_metrics" in sys.modules:
        return sys.modules["ncu_metrics"]
    spec = importlib.util.spec_from_file_location("ncu_metrics", ROOT / "bench" / "ncu_metrics.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ncu_metrics"] = mod
    spec.loader.exec_module(mod)
    return mod


def plot(report, path_for_op):
    """One PNG per family of the results (the family's plot function), at path_for_op(family).
    Returns the written paths ([] where matplotlib is missing)."""
    written = []
    for name in dict.fromkeys(family_of(r) for r in report["results"]):
        family = FAMILIES.get(name)
        if family is None or family.plot is None:
            continue
        part = dict(report, results=[r for r in report["results"] if family_of(r) == name])
        written += family.plot(part, path_for_op(name))
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
    rows = [f for f in FAMILIES.values() if f.rows]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="families: " + "; ".join(f"{f.name}: {f.summary}" for f in FAMILIES.values())
                                + "; `benchmark_all.py NAME ...` runs a standalone family with its own options")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when torch sees a GPU and the library has CUDA, else cpu")
    p.add_argument("--ops", default="all", help=f"comma list of {', '.join(f.name for f in rows)} (default all)")
    p.add_argument("--dtypes", default=None, help="comma list of fp32, fp16, bf16 (default: per family)")
    p.add_argument("--variants", default=None,
                   help="all, or a comma list (auto, naive, ...) (default: matmul all, fused auto)")
    p.add_argument("--shapes", default=None,
                   help="comma list: matmul N (cube), MxNxK or BxMxNxK; fused ROWSxWIDTH (default: per family)")
    for f in rows:
        if f.add_arguments:
            f.add_arguments(p)
    p.add_argument("--quick", action="store_true", help="small shapes and short measurements")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    p.add_argument("--min-samples", type=int, default=10)
    p.add_argument("--max-samples", type=int, default=200)
    p.add_argument("--min-time-s", type=float, default=0.2)
    p.add_argument("--max-time-s", type=float, default=2.0)
    p.add_argument("--target-rse", type=float, default=0.01)
    p.add_argument("--warmup-s", type=float, default=0.05)
    p.add_argument("--max-warmup", type=int, default=10)
    p.add_argument("--no-flush", action="store_true", help="keep caches warm between samples")
    p.add_argument("--launch-cover-us", type=float, default=0.0,
                   help="CUDA: a GPU spin of about this long before each sample's start event, covering a host launch "
                        "path longer than the cache flush (0: none, the default; rows measured with it say so)")
    p.add_argument("--metrics", action="store_true",
                   help="after the timed run, profile one call of every measurement under Nsight Compute (ncu on "
                        "PATH or $OPTIMIZED_NCU) and add the counters to the rows (`metrics`; bench/ncu_metrics.py)")
    p.add_argument("--metrics-child", default=None, help=argparse.SUPPRESS)  # the run under ncu: its row map
    return p.parse_args(argv)


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
    if argv[:1] and argv[0] in FAMILIES and FAMILIES[argv[0]].standalone:
        return FAMILIES[argv[0]].standalone(argv[1:])
    args = parse_args(argv)
    import optimized_ops

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and optimized_ops.built_with_cuda() else "cpu"
    if device == "cuda" and not (torch.cuda.is_available() and optimized_ops.built_with_cuda()):
        sys.exit("--device cuda: torch sees no GPU or the library was built without CUDA")
    runnable = [name for name, f in FAMILIES.items() if f.rows]
    ops = runnable if args.ops == "all" else args.ops.split(",")
    for op in ops:
        if op not in runnable:
            sys.exit(f"--ops: expected some of {', '.join(runnable)}; given '{op}'")
    # The raw filters; each family resolves its own defaults.
    args.dtypes_arg = args.dtypes.split(",") if args.dtypes else None
    args.shapes_arg = args.shapes.split(",") if args.shapes else None
    args.variants_arg = args.variants.split(",") if args.variants else None
    for d in args.dtypes_arg or []:
        if d not in DTYPES:
            sys.exit(f"--dtypes: expected fp32, fp16 or bf16; given '{d}'")
    for op in ops:
        if FAMILIES[op].prepare:
            FAMILIES[op].prepare(args, device)
    if args.quick:
        args.min_time_s, args.max_time_s, args.min_samples = 0.05, 0.3, 5

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    opt = Options(args)
    timer = Timer(device, opt)
    timer.metrics_child = bool(args.metrics_child)
    log(f"benchmark_all: {device}, torch {torch.__version__}, library {optimized_ops.library_path()}")
    report = {"schema": SCHEMA,
              "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "python bench/benchmark_all.py " + " ".join(argv),
              "machine": query_machine(device), "options": opt.as_json()}
    ceiling_dtypes = []
    for op in ops:
        if FAMILIES[op].ceiling_dtypes:
            ceiling_dtypes += [d for d in FAMILIES[op].ceiling_dtypes(args, device) if d not in ceiling_dtypes]
    report["ceilings"] = measure_ceilings(device, timer, ceiling_dtypes, log)
    results = []
    notes = ["Python runner (bench/benchmark_all.py): each op through torch.ops.optimized "
             "(including its output allocation from the caching allocator, as torch's ops)"]
    for op in ops:
        results += FAMILIES[op].rows(args, device, timer, report["ceilings"], log, notes)
    report["results"] = results
    report["notes"] = notes
    if args.metrics_child:  # the child under ncu: which measurement each row (and ceiling) timed
        ncu_metrics = load_ncu_metrics()
        pathlib.Path(args.metrics_child).write_text(json.dumps({
            "profiled": timer.profiled,
            "rows": [{"key": ncu_metrics.row_key(r), "measure": measure_of(r.get("time_ms")),
                      "baseline_measure": measure_of((r.get("baseline") or {}).get("time_ms"))} for r in results],
            "ceilings": {c["name"]: measure_of(c.get("time_ms")) for c in report["ceilings"]}}))
    elif args.metrics:
        ncu_metrics = load_ncu_metrics()
        ncu_metrics.attach(report, argv, ROOT / "bench" / "benchmark_all.py", log, device)
    report = _clean(report)
    for path in write_outputs(report, args.out):
        print(f"wrote {path}")
    failed = [r for r in results if r["status"] == "failed"]
    if failed:
        log(f"benchmark_all: {len(failed)} rows failed validation or raised")
        return 1
    return 0
