#!/usr/bin/env python3
"""The matmul family of the Python benchmark runner (bench/runner.py): every GEMM variant of
optimized_ops.matmul against torch.matmul (cuBLAS on CUDA), per shape and dtype, validated with the
GEMM rule (bench/tolerance.py) before timing.

    python bench/benchmark_all.py --ops matmul [--dtypes bf16,fp16,fp32] [--variants all|auto|NAME,...]
                                  [--shapes 4096,4097x4095x4093,8x1024x1024x1024] [--skip-slow] [--quick]

Shapes: N (cube), MxNxK or BxMxNxK. python-matmul.png: TFLOP/s of every variant and of torch, per
shape, a panel per dtype.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
from tolerance import gemm_allowed_error  # noqa: E402

DEFAULT_SHAPES = {
    # cubes, the awkward shape of the anchors, a short K, a decode-like skinny M, and a batch
    "cuda": ["4096", "8192", "4097x4095x4093", "4096x4096x1024", "32x14336x4096", "8x1024x1024x1024"],
    "cpu": ["256", "511x513x257", "768", "4x128x256x512"],
}
QUICK_SHAPES = {"cuda": ["2048", "4097x4095x4093", "8x512x512x512"], "cpu": ["128", "257x131x263"]}
DEFAULT_DTYPES = {"cuda": ["bf16", "fp16", "fp32"], "cpu": ["fp32", "bf16"]}


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
    """The GEMM rule (bench/tolerance.py, the C++ check's bound), on (up to) every element."""
    a64, b64 = a.double(), b.double()
    rows = out.shape[-2]
    if out.numel() > max_elements:  # a fixed subset of rows (first, last and evenly spaced)
        take = max(1, max_elements // (out.numel() // rows))
        idx = torch.linspace(0, rows - 1, take, device=a.device).round().long().unique()
        a64, out = a64.index_select(-2, idx), out.index_select(-2, idx)
    ref = torch.matmul(a64, b64)
    allowed = gemm_allowed_error(dtype_name, a.shape[-1], ref, torch.matmul(a64.abs(), b64.abs()))
    err = (out.double() - ref).abs()
    ratio = torch.where(err == 0, torch.zeros_like(err), err / allowed)
    worst = math.inf if torch.isnan(ratio).any() else ratio.max().item()
    max_rel = err.max().item() / max(ref.abs().max().item(), 1e-300)
    return {"passed": bool(worst <= 1.0), "max_rel_error": max_rel, "worst_ratio": worst,
            "checked": int(ref.numel())}


def gemm_rows(args, device, timer, ceilings, log, notes):
    import optimized_ops

    notes.append("matmul: baseline torch.matmul (cuBLAS on CUDA) measured in the same run")
    rows = []
    peaks = {c["name"].removeprefix("torch_matmul_"): c for c in ceilings if c["name"].startswith("torch_matmul_")}
    bw = next((c for c in ceilings if c["unit"] == "GB/s"), None)
    all_variants = ["auto"] + optimized_ops.variants() + ["triton", "triton_tma"]  # + the Triton rungs
    for dname in args.dtypes:
        dtype = runner.DTYPES[dname]
        for text in args.shapes:
            shape = GemmShape(text)
            es = torch.tensor([], dtype=dtype).element_size()
            set_bytes = (shape.m * shape.k + shape.k * shape.n + shape.m * shape.n) * es * shape.batch
            if device == "cuda":
                free, _ = torch.cuda.mem_get_info()
                budget = free // 2
            else:
                budget = 2 << 30
            nsets = runner.rotating_set_count(set_bytes, timer.cache_bytes, budget)
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
            baseline = {"name": "torch.matmul", "time_ms": runner.stats_json(base_stats),
                        "tflops": flops / (base_stats["median"] * 1e-3) / 1e12, "validation": base_val}

            for variant in all_variants:
                if args.variants != ["all"] and variant not in args.variants:
                    continue
                ok, why = (_triton_supports(variant, dtype, device, shape) if variant.startswith("triton")
                           else optimized_ops.variant_supports(variant, dtype, device))
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
                r["time_ms"] = runner.stats_json(st)
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


def _triton_supports(variant, dtype, device, shape):
    """variant_supports for the Triton rungs (optimized_ops/triton/), which the C++ table does not hold:
    CUDA tensors where Triton is available; triton: fp32 / fp16 / bf16; triton_tma: fp16 / bf16, compute
    capability 9.0+, K and N multiples of 8 (TMA's 16-byte rows). Otherwise a skipped row with the reason."""
    import optimized_ops.triton as ot

    if device != "cuda":
        return False, f"{variant} runs on CUDA tensors"  # another device's rung: no row, as for the CUDA rungs
    halves = (torch.float16, torch.bfloat16)
    if dtype not in ((torch.float32,) + halves if variant == "triton" else halves):
        return False, f"{variant} supports {'fp32, ' if variant == 'triton' else ''}fp16, bf16; given {dtype}"
    if variant == "triton_tma" and (shape.k % 8 or shape.n % 8):
        return False, f"triton_tma needs K and N multiples of 8 (TMA's 16-byte rows); given K={shape.k} N={shape.n}"
    ok, why = ot.tma_availability() if variant == "triton_tma" else ot.availability()
    return ok, "" if ok else f"Triton unavailable: {why}"


def _too_slow(variant, device, flops):
    limit = 2.0 * 4096**3 if device == "cuda" else 2.0 * 512**3
    return variant in ("naive", "cpu_naive") and flops > limit


def plot_matmul(report, path):
    """TFLOP/s of each variant and of torch, grouped by shape, a panel per dtype. Returns the written
    paths ([] when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmark_matmul: matplotlib is not installed: no plot (run `benchmark_all.py plot JSON` "
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
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def prepare(args, device):
    """matmul's dtypes, shapes and variants: as given, else its defaults for the device."""
    args.dtypes = args.dtypes_arg or DEFAULT_DTYPES[device]
    args.shapes = args.shapes_arg or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)[device]
    for s in args.shapes:
        GemmShape(s)
    args.variants = args.variants_arg or ["all"]


def add_arguments(p):
    p.add_argument("--skip-slow", action="store_true", help="matmul: skip naive rungs on large shapes")


FAMILY = runner.register(runner.Family(
    "matmul", rows=gemm_rows, add_arguments=add_arguments, prepare=prepare,
    ceiling_dtypes=lambda args, device: args.dtypes, plot=plot_matmul,
    summary="every GEMM variant vs torch.matmul (bench/benchmark_matmul.py)"))

if __name__ == "__main__":
    sys.exit(runner.main(["--ops", "matmul", *sys.argv[1:]]))
