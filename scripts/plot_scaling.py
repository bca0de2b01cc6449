#!/usr/bin/env python3
"""Weak-scaling plot and tables (issue 24) from the runs of bench/benchmark_distributed.py --scaling weak.

    python3 scripts/plot_scaling.py bench/results/h200x8 [DIR ...] [--out DIR]

Reads every python-distributed-weak-w<N>.json of one machine's results folder (any subset of world sizes: 1, 2, 4
only is fine) and writes beside them (or under --out):

* scaling.json: per series (case, direction, parallel layout: "EP", "EP overlap", "TP", "DDP"), one point per world
  size N: tokens/s of the group, the run's one-GPU baseline tokens/s, the ideal N x ref, scaling_efficiency (the
  row's own: tokens_per_s(N) / (N x its run's baseline tokens/s)), efficiency against the ideal line, the
  all-to-all share (ep) and the all-reduce share (tp, ddp); the target and whether it is met at the largest N.
* scaling.md: the same as one table per series.
* scaling.png (where matplotlib is installed; else skipped with a message, the JSON and markdown still written):
  left, tokens/s against N with the ideal line N x ref dashed (ref: the one-GPU baseline of the smallest-N run,
  i.e. of the w1 run where present); right, the efficiency (%) with the targets drawn.

Targets (issue 24, weak scaling at 8 GPUs): expert parallelism (ep) and DDP >= 85%, tensor parallelism (tp) >= 75%.
A verdict at a largest N below 8 is given for that N and says so.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

TARGETS = {"ep": 0.85, "ddp": 0.85, "tp": 0.75}
TARGET_N = 8
PATTERN = re.compile(r"python-distributed-weak-w(\d+)\.json$")
COMM_OPS = ("all_to_all", "all_reduce")


def load_runs(folder):
    """[(N, report, path)] of the weak-scaling runs in folder, by N."""
    runs = []
    for path in sorted(pathlib.Path(folder).glob("python-distributed-weak-w*.json")):
        m = PATTERN.search(path.name)
        if not m:
            continue
        report = json.loads(path.read_text())
        n = int(m.group(1))
        got = (report.get("machine") or {}).get("world_size")
        if got is not None and got != n:
            raise SystemExit(f"{path}: world_size {got} in the file, w{n} in its name")
        runs.append((n, report, path))
    return sorted(runs, key=lambda x: x[0])


def series_name(r):
    if r.get("series"):
        return r["series"]
    return re.sub(r"^\d+ GPUs? ", "", r["variant"])


def is_parallel(r, n):
    if "role" in r:
        return r["role"] == "parallel"
    return r["op"] not in COMM_OPS and r.get("world_size") == n and not r["variant"].startswith("1 GPU")


def collect(runs):
    """{(case, direction, series): [point per N]} from the parallel rows of every run."""
    out = {}
    for n, report, path in runs:
        for r in report["results"]:
            if r.get("family", "distributed") != "distributed" or not is_parallel(r, n):
                continue
            ok = r["status"] == "ok"
            base = r.get("baseline") or {}
            out.setdefault((r["case"], r["direction"], series_name(r)), []).append({
                "world_size": n, "status": r["status"], "file": path.name,
                "tokens_per_s": r.get("tokens_per_s") if ok else None,
                "baseline_tokens_per_s": base.get("tokens_per_s") if ok else None,
                "time_ms": (r.get("time_ms") or {}).get("median") if ok else None,
                "scaling_efficiency": r.get("scaling_efficiency") if ok else None,
                "a2a_share": r.get("a2a_share"), "allreduce_share": r.get("allreduce_share"),
                "validation_passed": (r.get("validation") or {}).get("passed"),
                "shape_label": r.get("shape_label")})
    for pts in out.values():
        pts.sort(key=lambda p: p["world_size"])
    return out


def summarize(key, pts):
    case, direction, series = key
    ref = next((p["baseline_tokens_per_s"] for p in pts if p["baseline_tokens_per_s"]), None)
    for p in pts:
        p["ideal_tokens_per_s"] = p["world_size"] * ref if ref else None
        p["efficiency_vs_ideal"] = (p["tokens_per_s"] / p["ideal_tokens_per_s"]
                                    if p["tokens_per_s"] and p["ideal_tokens_per_s"] else None)
    target = TARGETS.get(case)
    measured = [p for p in pts if p["scaling_efficiency"] is not None]
    last = measured[-1] if measured else None
    if target is None or last is None:
        verdict = "no target" if target is None else "not measured"
    else:
        verdict = "met" if last["scaling_efficiency"] >= target else "missed"
        if last["world_size"] < TARGET_N:
            verdict += f" at N={last['world_size']} (the target is for N={TARGET_N})"
    return {"case": case, "direction": direction, "series": series, "label": f"{series} {direction}",
            "target": target, "target_world_size": TARGET_N, "reference_tokens_per_s": ref,
            "largest_world_size": last["world_size"] if last else None,
            "efficiency_at_largest": last["scaling_efficiency"] if last else None, "verdict": verdict,
            "points": pts}


def pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def num(v):
    return "-" if v is None else f"{v:.4g}"


def markdown(summary, folder, files):
    out = [f"# Weak scaling: {folder}", "",
           "From " + ", ".join(f"`{f}`" for f in files) + " (bench/benchmark_distributed.py --scaling weak; "
           "scripts/plot_scaling.py). Efficiency: tokens/s of N GPUs over N x the one-GPU baseline of the same run "
           "(one GPU on one GPU's share); ideal: N x the baseline of the smallest-N run; shares: the all-to-alls "
           "(EP) or all-reduces (TP, DDP) of the same sizes timed alone, over the parallel step's median time.", ""]
    for s in summary["series"]:
        tgt = "-" if s["target"] is None else f"{100 * s['target']:.0f}% at N={s['target_world_size']}"
        out += [f"## {s['case']}: {s['label']}", "", f"Target {tgt}: **{s['verdict']}**.", "",
                "| N | tokens/s | 1 GPU tokens/s (this run) | ideal tokens/s | efficiency | vs ideal line | a2a share "
                "| all-reduce share | validation |",
                "|---|---|---|---|---|---|---|---|---|"]
        for p in s["points"]:
            val = {True: "passed", False: "failed"}.get(p["validation_passed"], p["status"])
            out.append(f"| {p['world_size']} | {num(p['tokens_per_s'])} | {num(p['baseline_tokens_per_s'])} | "
                       f"{num(p['ideal_tokens_per_s'])} | {pct(p['scaling_efficiency'])} | "
                       f"{pct(p['efficiency_vs_ideal'])} | {pct(p['a2a_share'])} | {pct(p['allreduce_share'])} | "
                       f"{val} |")
        out.append("")
    return "\n".join(out)


def plot(summary, path, title):
    """Tokens/s against N (log-log, the ideal dashed) and the efficiency (%) with the targets. Returns [path], or []
    without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_scaling: matplotlib is not installed: no scaling.png (the JSON and markdown are written; rerun "
              "where it is: pip install matplotlib)", file=sys.stderr)
        return []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    ns = sorted({p["world_size"] for s in summary["series"] for p in s["points"]})
    colors = plt.get_cmap("tab10")
    for i, s in enumerate(summary["series"]):
        c = colors(i % 10)
        pts = [p for p in s["points"] if p["tokens_per_s"]]
        if pts:
            ax1.plot([p["world_size"] for p in pts], [p["tokens_per_s"] for p in pts], "o-", color=c,
                     label=s["label"])
        ideal = [p for p in s["points"] if p["ideal_tokens_per_s"]]
        if ideal:
            ax1.plot([p["world_size"] for p in ideal], [p["ideal_tokens_per_s"] for p in ideal], "--", color=c,
                     alpha=0.6, linewidth=1)
        eff = [p for p in s["points"] if p["scaling_efficiency"] is not None]
        if eff:
            ax2.plot([p["world_size"] for p in eff], [100 * p["scaling_efficiency"] for p in eff], "o-", color=c,
                     label=s["label"])
    cases = {s["case"] for s in summary["series"]}
    for value, names in sorted({(v, tuple(sorted(k for k, t in TARGETS.items() if t == v and k in cases)))
                                for v in TARGETS.values()}):
        if names:
            ax2.axhline(100 * value, color="black", linestyle=":", linewidth=1)
            ax2.text(ns[0] if ns else 1, 100 * value, f" target {'/'.join(n.upper() for n in names)} "
                     f"{100 * value:.0f}%", va="bottom", ha="left", fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xlabel("GPUs (N)")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("tokens/s of the group")
    ax1.set_title("tokens/s (dashed: ideal, N x one GPU)")
    ax2.set_ylabel("weak-scaling efficiency (%)")
    top = max([110] + [100 * p["scaling_efficiency"] + 5 for s in summary["series"] for p in s["points"]
                       if p["scaling_efficiency"] is not None])
    ax2.set_ylim(0, min(top, 150))  # an outlier above 150% (a noisy baseline) is clipped; the table has it
    ax2.set_title("efficiency: tokens/s(N) / (N x tokens/s(1 GPU))")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def run(folder, out=None):
    folder = pathlib.Path(folder)
    runs = load_runs(folder)
    if not runs:
        raise SystemExit(f"plot_scaling: no python-distributed-weak-w*.json in {folder}")
    dest = pathlib.Path(out) if out else folder
    dest.mkdir(parents=True, exist_ok=True)
    machine = dict(runs[-1][1].get("machine") or {})
    summary = {"schema": "optimized-ops-scaling/1", "scaling": "weak", "folder": str(folder),
               "files": [p.name for _, _, p in runs], "world_sizes": [n for n, _, _ in runs],
               "machine": {k: machine.get(k) for k in ("gpu", "gpu_key", "results_key", "cpu", "torch", "nccl", "env")},
               "targets": dict(TARGETS, world_size=TARGET_N),
               "series": [summarize(k, v) for k, v in collect(runs).items()]}
    written = []
    (dest / "scaling.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    written.append(dest / "scaling.json")
    (dest / "scaling.md").write_text(markdown(summary, folder.name, summary["files"]) + "\n")
    written.append(dest / "scaling.md")
    gpu = machine.get("gpu") or "CPU"
    written += plot(summary, dest / "scaling.png",
                    f"Weak scaling on {gpu} ({machine.get('results_key') or folder.name}), N = "
                    + ", ".join(map(str, summary["world_sizes"])))
    return written


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="a machine's results folder (e.g. bench/results/h200x8)")
    p.add_argument("--out", default=None, help="where to write (default: each folder itself; one folder only)")
    args = p.parse_args(argv)
    if args.out and len(args.folders) > 1:
        p.error("--out takes one folder")
    for folder in args.folders:
        for path in run(folder, args.out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
