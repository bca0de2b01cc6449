#!/usr/bin/env python3
"""Turns benchmark JSON (schema optimized-ops-bench/1) into markdown.

  render_results.py table RESULT.json                 markdown tables of one run, to stdout
  render_results.py place RESULT.json --results DIR   copy into DIR/<machine>/<family>.json (+ .md), one
                                                      file per op family of the run (matmul, fused); a
                                                      Python runner's JSON becomes python-<family>.json
  render_results.py docs --results DIR --out FILE     docs/performance.md from every committed run, and the
                                                      generated blocks of docs/perf-notes/*.md

The docs are generated from the JSON the benchmark wrote, never typed by hand.

Generated blocks in docs/perf-notes/*.md (filled by `docs`, between the marker and
`<!-- end generated -->`); a spec is `key=value` pairs, machine= required, file= the JSON's name
without .json (e.g. fused, python-fused); any other key filters the rows by that field
(op, direction, dtype, shape, variant, backend, threads, rows, width):
  <!-- generated: ladder file=matmul machine=h100 op=matmul dtype=bf16 shape=4096x4096x4096 -->
        one row per variant (GEMM columns; fused rows get the fused columns)
  <!-- generated: fused-table file=fused machine=h100 op=rms_norm dtype=bf16 -->
        the fused pivot: one line per (op, direction, dtype, shape), GB/s per variant
  <!-- generated: grid file=fused machine=h100 dtype=bf16 direction=fwd variant=auto rows=16384 metric=roofline -->
        ops down, widths across; metric: gbps | roofline (fraction of copy) | vs_baseline | vs_copy
  <!-- generated: attention-table file=python-attention machine=h100 direction=fwd dtype=bf16 -->
        the attention pivot: one line per (direction, dtype, shape, causal), TFLOP/s per implementation,
        the headline rung vs FA2 (sdpa_flash) and vs cuDNN, the target (issue 13)
  <!-- generated: attention-ladder file=python-attention machine=h100 direction=fwd dtype=bf16 -->
        the ladder: each rung and peer as "TFLOP/s (ratio to cuDNN)", one line per shape
  <!-- generated: attention-memory file=python-attention-memory machine=h100 -->
        the peak-memory table: MiB above the inputs per implementation, one line per (N, direction)
  <!-- generated: kv-cache file=python-kv_cache machine=h100 case=decode -->
        the KV-cache tables (bench/benchmark_kv_cache.py), one per case (decode, page_size, fp8, append,
        graph; filter case= for one): GB/s of K/V read, ratios to SDPA, to the copy ceiling, targets (issue 14)
  <!-- generated: models-table file=python-models machine=h100 case=train -->
        the models table (bench/benchmark_models.py): per (case, shape, implementation) the time per step or
        generate call, tokens/s, MFU, vs torch eager and torch.compile, the targets (issue 20)
  <!-- generated: metrics-table file=matmul machine=h100 op=matmul dtype=bf16 shape=4096x4096x4096 -->
        the hardware counters of each selected row (a run with --metrics, issue 23): achieved occupancy,
        DRAM bytes, memory efficiency (min bytes / DRAM bytes), DRAM % of peak, L2 bytes, tensor-pipe %,
        registers, local (spill) bytes, the top stall reasons (docs/perf-notes/metrics.md)
  <!-- generated: choosing-table machine=h100 file=python-matmul-triton,matmul-cutlass op=matmul dtype=bf16 -->
        one op's implementations side by side (issue 22, docs/perf-notes/choosing.md): file= a comma list of runs,
        filters may be comma lists; per row the kind (CUDA (ours), Triton (ours), CUTLASS, vendor, torch), time,
        samples, TFLOP/s, GB/s, the ratio to each peer of the same run (peers=baseline, the default: the run's
        baseline -- cuBLAS, torch eager, SDPA-flash; or variant names: peers=sdpa_flash,sdpa_cudnn) and, for
        memory-bound ops, the fraction of the run's measured copy bandwidth; a vendor baseline that is not a row
        (cuBLAS, cuBLASLt) gets its own row, from the run's baseline measurement
  <!-- generated: choosing-targets machine=h100 -->
        issue 22's targets for the Triton rungs (python-matmul-triton, python-fused-triton, python-attention-triton):
        GEMM bf16 4096^3 >= 0.85x cuBLAS, softmax / norms >= 0.85x copy bandwidth, attention fwd >= 0.8x SDPA-flash;
        per line the Triton ratio, our CUDA rung's, met / missed and the gap
  <!-- generated: build-cost file=build-cost machine=cpu -->
        lines of code and compile time per implementation, from scripts/build_cost.py's JSON
        (schema optimized-ops-build-cost/1, skipped by `docs`'s run listing)

Rows that carry a `metrics` object with status ok (optimized-bench / benchmark_all.py --metrics) also get
four columns in the ladder and results tables: achieved occupancy, DRAM bytes, memory efficiency and
tensor-pipe %; tables without such rows are rendered as before.
"""
import argparse
import json
import os
import re
import pathlib
import shutil
import sys

SCHEMA = "optimized-ops-bench/1"


def load(path):
    data = json.loads(pathlib.Path(path).read_text())
    if data.get("schema") != SCHEMA:
        sys.exit(f"{path}: expected schema {SCHEMA}, found {data.get('schema')!r}")
    return data


def machine_key(data):
    return data["machine"].get("gpu_key") or "cpu"


def fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e6:
        x = int(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 10:
            return f"{x:.1f}"
        return f"{x:.{digits}g}"
    return str(x)


def ceilings_table(data):
    rows = ["| ceiling | shape | value | unit |", "|---|---|---:|---|"]
    for c in data.get("ceilings", []):
        rows.append(f"| {c['name']} | {c.get('shape') or '-'} | {fmt(c['value'])} | {c['unit']} |")
    return "\n".join(rows)


# ---- hardware counters (--metrics, issue 23) ------------------------------------------------------

def has_metrics(results):
    """Whether any row carries counters (a --metrics run whose ncu ran): the tables gain their columns."""
    return any((r.get("metrics") or {}).get("status") == "ok" for r in results)


def human_bytes(x):
    if x is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= scale:
            return f"{fmt(x / scale)} {unit}"
    return f"{fmt(x)} B"


def _pct_value(x):
    return "-" if x is None else f"{fmt(x)}%"


METRIC_COLUMNS = ("achieved occupancy", "DRAM bytes", "memory efficiency", "tensor pipe")


def metric_cells(r):
    """The four columns the ladder tables gain (occupancy, DRAM bytes, memory efficiency, tensor pipe)."""
    m = r.get("metrics") or {}
    if m.get("status") != "ok":
        return ["-"] * 4 if not m else [m.get("status", "-")] + ["-"] * 3
    eff = m.get("memory_efficiency")
    return [_pct_value(m.get("achieved_occupancy_pct")), human_bytes(m.get("dram_bytes")),
            fmt(eff), _pct_value(m.get("tensor_pipe_pct"))]


def metrics_table(results):
    """One line per row: its counters, or why it has none."""
    head = ("| variant | op | dir | dtype | shape | median ms | achieved occupancy | DRAM bytes (read + written) "
            "| memory efficiency | DRAM % of peak | L2 bytes | tensor pipe | regs | local bytes | top stalls |")
    rows = [head, "|" + "---|" * 15]
    for r in results:
        lead = (f"| {r['variant']} | {r['op']} | {r.get('direction', '')} | {r['dtype']} | "
                f"{r.get('shape_label', '')} ")
        m = r.get("metrics") or {}
        if r.get("status") != "ok" or m.get("status") != "ok":
            why = (f"{r['status']}: {r.get('reason', '')}" if r.get("status") != "ok"
                   else f"no counters: {m.get('reason', 'not collected (run with --metrics)')}"
                   if not m or m.get("status") == "skipped" else f"counters {m['status']}: {m.get('reason', '')}")
            rows.append(lead + f"| {why} |" + " |" * 9)
            continue
        occ, dram, eff, tensor = metric_cells(r)
        stalls = ", ".join(f"{s['reason']} {fmt(s['warps_per_issue'])}" for s in m.get("top_stalls", [])) or "-"
        regs = fmt(m.get("registers_per_thread"))
        rows.append(lead + f"| {fmt(r['time_ms']['median'])} | {occ} | {dram} | {eff} "
                    f"| {_pct_value(m.get('dram_throughput_pct'))} | {human_bytes(m.get('l2_bytes'))} | {tensor} "
                    f"| {regs} | {human_bytes(m.get('local_bytes'))} | {stalls} |")
    return "\n".join(rows)


def ceiling_metrics_lines(data):
    """The ceilings the counters saw (the Python runner profiles its device copy: a known-bytes check)."""
    out = []
    for c in data.get("ceilings", []):
        m = c.get("metrics") or {}
        if m.get("status") == "ok" and m.get("dram_bytes"):
            eff = m.get("memory_efficiency")
            out.append(f"- {c['name']}: DRAM {human_bytes(m['dram_bytes'])} counted for {human_bytes(c.get('bytes'))} "
                       f"moved" + (f" (efficiency {eff:.3f})" if eff is not None else ""))
    return out


def results_table(results):
    with_metrics = has_metrics(results)
    head = ("| variant | backend | dtype | shape | threads | median ms [p10-p90] | CV | TFLOP/s | GB/s "
            "| vs baseline | roofline | regs / smem / occ |")
    rows = [head, "|" + "---|" * 12]
    if with_metrics:
        rows = [head + "".join(f" {c} |" for c in METRIC_COLUMNS), "|" + "---|" * 16]
    extra = (lambda r: "".join(f" {c} |" for c in metric_cells(r))) if with_metrics else (lambda r: "")
    for r in results:
        shape = r.get("shape_label", "")
        if r.get("status") != "ok":
            rows.append(f"| {r['variant']} | {r['backend']} | {r['dtype']} | {shape} | {fmt(r.get('threads'))} "
                        f"| {r['status']}: {r.get('reason', '')} | | | | | | |" + (" |" * 4 if with_metrics else ""))
            continue
        t = r["time_ms"]
        base = r.get("baseline")
        vs = f"{r['vs_baseline']:.2f}x {base['name']}" if base and r.get("vs_baseline") else "-"
        k = r.get("kernel")
        res = "-"
        if k:
            smem = (k.get("static_smem") or 0) + (k.get("dynamic_smem") or 0)
            res = f"{k['registers']} / {smem // 1024} KiB / {k['occupancy'] * 100:.0f}%"
        roof = f"{r['roofline_fraction'] * 100:.0f}%" if r.get("roofline_fraction") else "-"
        rows.append(
            f"| {r['variant']} | {r['backend']} | {r['dtype']} | {shape} | {fmt(r.get('threads'))} "
            f"| {fmt(t['median'])} [{fmt(t['p10'])}-{fmt(t['p90'])}] | {t['cv'] * 100:.1f}% | {fmt(r['tflops'])} | {fmt(r.get('gbps'))} "
            f"| {vs} | {roof} | {res} |" + extra(r))
    return "\n".join(rows)


# ---- the fused family ----------------------------------------------------------------------

def family_of(r):
    return r.get("family") or r["op"]


def pct(x):
    return "-" if x is None else f"{x * 100:.0f}%"


def in_target_scope(r):
    """The issue's target shapes: bf16, >= 4096 rows, widths 1024 to 32768 (CUDA rows)."""
    sh = r.get("shape", {})
    return (r.get("dtype") == "bf16" and r.get("backend") == "cuda" and sh.get("rows", 0) >= 4096
            and 1024 <= sh.get("width", 0) <= 32768)


def headline_variant(variants):
    """The variant a fused line is judged by: ours at auto, else the best rung present."""
    for v in ("auto", "fused_registers", "fused_streaming", "cpu"):
        if v in variants:
            return v
    return next((v for v in variants if not v.startswith("torch")), variants[0])


def fused_line_key(r):
    return (r["op"], r.get("direction", ""), r["backend"], r["dtype"], r["shape_label"], fmt(r.get("threads")))


def fused_pivot(results):
    """One line per (op, direction, backend, dtype, shape): GB/s of every variant, then the
    headline variant's fraction of the copy bandwidth, of a same-size copy, its ratio to the
    baseline, and the target (>= 90% of copy on the target shapes; Python rows: and >= torch.compile)."""
    lce = [r for r in results if r["op"] == "linear_cross_entropy"]
    results = [r for r in results if r["op"] != "linear_cross_entropy"]
    if not results:
        return linear_cross_entropy_table(lce)
    lines = {}
    for r in results:
        lines.setdefault(fused_line_key(r), []).append(r)
    variants = list(dict.fromkeys(r["variant"] for r in results))
    python = any(v.startswith("torch") for v in variants)
    head = ("| op | dir | backend | dtype | shape | " + " | ".join(f"{v} GB/s" for v in variants) +
            " | headline | % of copy | vs same-size copy | vs baseline | target |")
    out = [head, "|" + "---|" * (5 + len(variants)) + "---|---:|---:|---:|---|"]
    failures = []
    for key, rows in lines.items():
        by_v = {r["variant"]: r for r in rows}
        cells = []
        for v in variants:
            r = by_v.get(v)
            if r is None:
                cells.append("")
            elif r["status"] == "ok":
                cells.append(fmt(r.get("gbps")))
            else:
                cells.append("skip" if r["status"] == "skipped" else "FAILED")
                if r["status"] == "failed":
                    failures.append(f"- {' '.join(key[:5])} {v}: {r.get('reason', '')}")
        hv = headline_variant([v for v in variants if v in by_v])
        h = by_v.get(hv)
        ok = h is not None and h["status"] == "ok"
        hname = hv + (f" ({h['resolved_variant']})" if ok and h.get("resolved_variant") else "")
        base = h.get("baseline") if ok else None
        vs = f"{h['vs_baseline']:.2f}x {base['name']}" if ok and base and h.get("vs_baseline") else "-"
        target = ""
        if ok:
            goals = []
            if in_target_scope(h) and h.get("roofline_fraction") is not None:
                goals.append(h["roofline_fraction"] >= 0.9)
            if python and h.get("vs_baseline") is not None and base and "compile" in base["name"]:
                goals.append(h["vs_baseline"] >= 1.0)
            target = "" if not goals else ("met" if all(goals) else "**missed**")
        elif h is not None:
            target = "**missed**" if h["status"] == "failed" else ""
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | " + " | ".join(cells) +
                   f" | {hname} | {pct(h.get('roofline_fraction')) if ok else '-'} "
                   f"| {pct(h.get('vs_copy_same_size')) if ok else '-'} | {vs} | {target} |")
    text = "\n".join(out)
    if failures:
        text += "\n\nFailed:\n" + "\n".join(failures)
    if lce:
        text += "\n\n" + linear_cross_entropy_table(lce)
    return text


def linear_cross_entropy_table(results):
    """Fused linear + cross-entropy: per (direction, dtype, shape) and implementation, TFLOP/s of the GEMMs'
    flops, the peak memory beyond the inputs (fwd+bwd), and the target (issue 17): ours at <= 1/4 of torch
    eager's peak memory and >= 0.95x its speed."""
    out = ["| linear_cross_entropy | dir | dtype | T x V x d | implementation | ms | TFLOP/s | peak MiB | "
           "eager's time / ours | eager's peak / ours | target |", "|---|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    groups = {}
    for r in results:
        groups.setdefault((r.get("direction", ""), r["dtype"], r["shape_label"]), []).append(r)
    for (direction, dtype, label), rows in groups.items():
        eager = next((r for r in rows if r["variant"] == "torch_eager" and r["status"] == "ok"), None)
        for r in rows:
            if r["status"] != "ok":
                out.append(f"| | {direction} | {dtype} | {label} | {r['variant']} | {r['status']} | | | | | |")
                continue
            t = r["time_ms"]["median"]
            peak = r.get("peak_memory_bytes")
            vs_t = eager["time_ms"]["median"] / t if eager else None
            vs_m = r.get("memory_vs_torch_eager")
            target = ""
            if r.get("backend") == "cuda" and not r["variant"].startswith(("torch", "liger")) and vs_t is not None:
                goals = [vs_t >= 0.95] + ([vs_m >= 4.0] if vs_m is not None else [])
                target = "met" if all(goals) else "**missed**"
            out.append(f"| | {direction} | {dtype} | {label} | {r['variant']} | {t:.3g} | {fmt(r.get('tflops'))} | "
                       f"{'-' if peak is None else f'{peak / 2**20:.0f}'} | "
                       f"{'-' if vs_t is None else f'{vs_t:.2f}x'} | {'-' if vs_m is None else f'{vs_m:.2f}x'} | "
                       f"{target} |")
    return "\n".join(out)


def fused_target_summary(results):
    """A line on the issue's targets, from the headline rows."""
    lines = {}
    for r in results:
        lines.setdefault(fused_line_key(r), []).append(r)
    scoped, met, worst = 0, 0, None
    compile_total, compile_met = 0, 0
    for rows in lines.values():
        by_v = {r["variant"]: r for r in rows}
        h = by_v.get(headline_variant(list(by_v)))
        if h is None:
            continue
        if in_target_scope(h):
            scoped += 1
            f = h.get("roofline_fraction") if h["status"] == "ok" else None
            if f is not None and f >= 0.9:
                met += 1
            if f is not None and (worst is None or f < worst[0]):
                worst = (f, f"{h['op']} {h.get('direction', '')} {h['shape_label']}")
        base = h.get("baseline") or {}
        if h["status"] == "ok" and "compile" in base.get("name", "") and h.get("vs_baseline") is not None:
            compile_total += 1
            compile_met += h["vs_baseline"] >= 1.0
    parts = []
    if scoped:
        parts.append(f"{met} of {scoped} target lines (bf16, >= 4096 rows, width 1024-32768) at >= 90% of the "
                     f"measured copy bandwidth" + (f"; lowest {worst[0] * 100:.0f}% ({worst[1]})" if worst else ""))
    if compile_total:
        parts.append(f"{compile_met} of {compile_total} lines at or above torch.compile")
    return ("Targets (issue 4): " + "; ".join(parts) + ".") if parts else ""


def fused_rows_table(results):
    """One row per result with the fused columns (the ladder block of a fused shape)."""
    with_metrics = has_metrics(results)
    rows = ["| variant | op | dir | dtype | shape | median ms [p10-p90] | CV | GB/s | % of copy | vs same-size copy "
            "| vs baseline |", "|" + "---|" * 11]
    if with_metrics:
        rows = [rows[0] + "".join(f" {c} |" for c in METRIC_COLUMNS), "|" + "---|" * 15]
    extra = (lambda r: "".join(f" {c} |" for c in metric_cells(r))) if with_metrics else (lambda r: "")
    for r in results:
        lead = f"| {r['variant']} | {r['op']} | {r.get('direction', '')} | {r['dtype']} | {r['shape_label']} "
        if r.get("status") != "ok":
            rows.append(lead + f"| {r['status']}: {r.get('reason', '')} | | | | | |" + (" |" * 4 if with_metrics else ""))
            continue
        t = r["time_ms"]
        base = r.get("baseline")
        vs = f"{r['vs_baseline']:.2f}x {base['name']}" if base and r.get("vs_baseline") else "-"
        variant_note = f" ({r['resolved_variant']})" if r.get("resolved_variant") else ""
        rows.append(lead.replace(f"| {r['variant']} |", f"| {r['variant']}{variant_note} |", 1) +
                    f"| {fmt(t['median'])} [{fmt(t['p10'])}-{fmt(t['p90'])}] | {t['cv'] * 100:.1f}% "
                    f"| {fmt(r.get('gbps'))} | {pct(r.get('roofline_fraction'))} | {pct(r.get('vs_copy_same_size'))} "
                    f"| {vs} |" + extra(r))
    return "\n".join(rows)


def fused_formulas(data):
    notes = [n for n in data.get("notes", []) if n.startswith("min_bytes ")]
    return "\n".join(f"- `{n.removeprefix('min_bytes ')}`" for n in notes)


# ---- the attention family ------------------------------------------------------------------

ATTENTION_HEADLINE = ("flash2", "auto", "flash", "naive", "cpu")  # the rung a line is judged by, in order


def attention_line_key(r):
    sh = r.get("shape", {})
    return (r.get("direction", ""), r["backend"], r["dtype"], r["shape_label"], "causal" if r.get("causal") else "-",
            str(sh.get("head_dim", "")))


def attention_cell(r, ratio=None):
    if r is None:
        return ""
    if r["status"] != "ok":
        return "skip" if r["status"] == "skipped" else "FAILED"
    text = fmt(r.get("tflops"))
    if ratio is not None:
        text += f" ({r[ratio]:.2f}x)" if r.get(ratio) is not None else " (-)"
    return text


def attention_target(h):
    """Issue 13: flash2 >= 1.0x SDPA-flash at d64/d128 (fixed length); varlen within 10% of fixed length."""
    if h is None or h["status"] != "ok" or h["variant"] not in ("flash2", "auto") or h.get("backend") != "cuda":
        return ""
    if h.get("varlen"):
        return "" if h.get("vs_fixed") is None else ("met" if h["vs_fixed"] >= 0.9 else "**missed**")
    if h.get("vs_mha") is not None:  # issue 18: a GQA forward at least as fast per query head as MHA
        return "met" if h["vs_mha"] >= 1.0 else "**missed**"
    if h.get("shape", {}).get("head_dim") not in (64, 128) or h.get("vs_baseline") is None:
        return ""
    return "met" if h["vs_baseline"] >= 1.0 else "**missed**"


def attention_pivot(results, ladder=False):
    """One line per (direction, backend, dtype, shape, causal): TFLOP/s of every implementation, then the
    headline rung's ratio to FA2 and cuDNN (and, varlen, to the same rung at fixed length) and the target.
    ladder=True: every cell "TFLOP/s (x cuDNN)" and no headline columns (the perf-notes ladder table)."""
    lines = {}
    for r in results:
        lines.setdefault(attention_line_key(r), []).append(r)
    variants = list(dict.fromkeys(r["variant"] for r in results))
    ours = [v for v in variants if not v.startswith("sdpa_")]
    variants = ours + [v for v in variants if v.startswith("sdpa_")]
    if ladder:
        head = "| dir | dtype | shape BxSxHxD | causal | " + " | ".join(variants) + " |"
        out = [head, "|---|---|---|---|" + "---:|" * len(variants)]
    else:
        head = ("| dir | dtype | shape BxSxHxD | causal | " + " | ".join(f"{v} TFLOP/s" for v in variants) +
                " | headline | vs FA2 | vs cuDNN | vs fixed / MHA | target |")
        out = [head, "|---|---|---|---|" + "---:|" * len(variants) + "---|---:|---:|---:|---|"]
    failures = []
    for key, rows in lines.items():
        by_v = {r["variant"]: r for r in rows}
        cells = [attention_cell(by_v.get(v), "vs_cudnn" if ladder else None) for v in variants]
        for v in variants:
            r = by_v.get(v)
            if r is not None and r["status"] == "failed":
                failures.append(f"- {key[0]} {key[2]} {key[3]} {key[4]} {v}: {r.get('reason', '')}")
        lead = f"| {key[0]} | {key[2]} | {key[3]} | {key[4]} | "
        if ladder:
            out.append(lead + " | ".join(cells) + " |")
            continue
        hv = next((v for v in ATTENTION_HEADLINE if v in by_v), None)
        h = by_v.get(hv) if hv else None
        ok = h is not None and h["status"] == "ok"

        def ratio(name):
            return f"{h[name]:.2f}x" if ok and h.get(name) is not None else "-"

        # varlen rows: vs the same rung at fixed length; GQA rows: vs the same shape's MHA row
        vs_other = ratio("vs_fixed") if ok and h.get("vs_fixed") is not None else ratio("vs_mha")
        out.append(lead + " | ".join(cells) + f" | {hv or '-'} | {ratio('vs_baseline')} | {ratio('vs_cudnn')} "
                   f"| {vs_other} | {attention_target(h)} |")
    text = "\n".join(out)
    if failures:
        text += "\n\nFailed:\n" + "\n".join(failures)
    return text


def attention_target_summary(results):
    lines = {}
    for r in results:
        lines.setdefault(attention_line_key(r), []).append(r)
    fixed, fixed_met, var, var_met, worst = 0, 0, 0, 0, None
    for rows in lines.values():
        by_v = {r["variant"]: r for r in rows}
        h = next((by_v[v] for v in ("flash2", "auto") if v in by_v), None)
        t = attention_target(h)
        if not t:
            continue
        if h.get("varlen"):
            var, var_met = var + 1, var_met + (t == "met")
        else:
            fixed, fixed_met = fixed + 1, fixed_met + (t == "met")
            if h.get("vs_baseline") is not None and (worst is None or h["vs_baseline"] < worst[0]):
                worst = (h["vs_baseline"], f"{h['direction']} {h['shape_label']}{' causal' if h.get('causal') else ''}")
    parts = []
    if fixed:
        parts.append(f"{fixed_met} of {fixed} fixed-length lines with flash2 >= 1.0x SDPA-flash (FA2)"
                     + (f"; lowest {worst[0]:.2f}x ({worst[1]})" if worst else ""))
    if var:
        parts.append(f"{var_met} of {var} varlen lines within 10% of fixed length (TFLOP/s)")
    return ("Targets (issue 13): " + "; ".join(parts) + ".") if parts else ""


def attention_memory_table(results):
    """One line per (dtype, shape, direction): MiB above the inputs per implementation, and naive's predicted
    O(N^2) workspace (B*H*S^2*4 bytes, x2 with the backward)."""
    lines = {}
    for r in results:
        lines.setdefault((r["dtype"], r["shape_label"], r.get("direction", "")), []).append(r)
    variants = list(dict.fromkeys(r["variant"] for r in results))
    out = ["| dtype | shape BxSxHxD | dir | " + " | ".join(f"{v} MiB" for v in variants) + " | naive predicted MiB |",
           "|---|---|---|" + "---:|" * (len(variants) + 1)]
    notes = {}  # reason: the lines it applies to
    for (dname, label, direction), rows in lines.items():
        by_v = {r["variant"]: r for r in rows}
        cells = []
        for v in variants:
            r = by_v.get(v)
            if r is None:
                cells.append("")
            elif r["status"] == "ok":
                cells.append(fmt(r.get("peak_mib")))
            else:
                cells.append("skip" if r["status"] == "skipped" else "FAILED")
                notes.setdefault(f"{v}: {r['status']}: {r.get('reason', '')}", []).append(f"{label} {direction}")
        pred = rows[0].get("naive_predicted_bytes")
        out.append(f"| {dname} | {label} | {direction} | " + " | ".join(cells) +
                   f" | {fmt(pred / (1 << 20)) if pred else '-'} |")
    text = "\n".join(out)
    if notes:
        text += "\n\n" + "\n".join(f"- {why} ({', '.join(where)})" for why, where in notes.items())
    return text


# ---- the kv_cache family (bench/benchmark_kv_cache.py) --------------------------------------

def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def _kv_cell(r):
    if r is None:
        return ""
    if r["status"] != "ok":
        return "skip" if r["status"] == "skipped" else "FAILED"
    return fmt(r.get("gbps"))


def kv_cache_tables(results):
    """One table per case; decode: GB/s of K/V read per rung and SDPA, the headline rung (auto) vs SDPA and vs
    copy, the issue 14 target."""
    out, failures = [], []
    for r in results:
        if r["status"] == "failed":
            failures.append(f"- {r.get('case')} {r['shape_label']} page {r.get('page_size')} {r['variant']}: "
                            f"{r.get('reason', '')}")
    by_case = {}
    for r in results:
        by_case.setdefault(r.get("case", "decode"), []).append(r)
    dec = by_case.get("decode", [])
    if dec:
        variants = list(dict.fromkeys(r["variant"] for r in dec))
        variants = [v for v in variants if v != "sdpa"] + (["sdpa"] if "sdpa" in variants else [])
        out += ["Decode, K/V GB/s (bytes read = 2*B*L*H_kv*D*E):", "",
                "| dtype | B x L | page | " + " | ".join(variants) + " | auto vs sdpa | auto vs copy | target |",
                "|---|---|---:|" + "---:|" * len(variants) + "---:|---:|---|"]
        lines = {}
        for r in dec:
            lines.setdefault((r["dtype"], r["shape_label"], r.get("page_size")), {})[r["variant"]] = r
        for (dname, label, page), by_v in lines.items():
            h = by_v.get("auto") or by_v.get("cpu")
            ok = h is not None and h["status"] == "ok"
            target = ""
            if ok and h["backend"] == "cuda" and h.get("vs_baseline") is not None:
                b = h["shape"]["batch"]
                want = 1.3 if (b == 1 and h["shape"]["seqlen"] >= 32768) else 1.0
                met = h["vs_baseline"] >= want and (b < 16 or (h.get("vs_copy") or 0) >= 0.9)
                target = ("met" if met else "**missed**") + f" (>= {want}x sdpa" + (", >= 0.9x copy)" if b >= 16 else ")")
            out.append(f"| {dname} | {label} | {page} | " + " | ".join(_kv_cell(by_v.get(v)) for v in variants) +
                       f" | {_x(h.get('vs_baseline')) if ok else '-'} | {_x(h.get('vs_copy')) if ok else '-'} "
                       f"| {target} |")
        out.append("")
    extra = {"page_size": ("Page sizes (target: within 15% of page 16)", "vs_page16", "vs page 16",
                           lambda r: "" if r.get("vs_page16") is None else
                           ("met" if r["vs_page16"] >= 0.85 else "**missed**")),
             "fp8": ("fp8 e4m3 cache (target: auto >= 1.8x the bf16 tokens/s)", "vs_bf16", "vs bf16",
                     lambda r: "" if r.get("vs_bf16") is None or r["variant"] != "auto" or r["backend"] != "cuda"
                     else ("met" if r["vs_bf16"] >= 1.8 else "**missed**")),
             "append": ("Append, one token per sequence (and a prefill chunk), RoPE neox (target >= 0.85x copy)",
                        "vs_copy_same_size", "vs same-size copy",
                        lambda r: "" if r.get("vs_copy") is None or r["backend"] != "cuda"
                        else ("met" if r["vs_copy"] >= 0.85 else "**missed**"))}
    def case_table(title, head, rows, lead, cells):
        """title, the table's header (head: its column titles, then the alignment row), and a line per
        row: lead(r)'s cells, then cells(r)'s for an ok row, else its status and blanks."""
        out.extend([title + ":", ""] + head)
        for r in rows:
            first = lead(r)
            if r["status"] != "ok":
                n = len(head[0].split("|")) - 2 - len(first)  # the cells after the lead
                out.append("| " + " | ".join(first + [f"{r['status']}: {r.get('reason', '')}"]) + " |" + " |" * (n - 1))
            else:
                out.append("| " + " | ".join(first + cells(r)) + " |")
        out.append("")

    for case, (title, key, name, target) in extra.items():
        if by_case.get(case):
            case_table(title,
                       [f"| variant | dtype | cache | B x L | page | median us | GB/s | tokens/s | vs copy | {name} | target |",
                        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"], by_case[case],
                       lambda r: [r["variant"], r["dtype"], str(r.get("cache_dtype")), r["shape_label"],
                                  str(r.get("page_size"))],
                       lambda r, key=key, target=target: [
                           fmt(r["time_ms"]["median"] * 1e3), fmt(r.get("gbps")), fmt(r.get("tokens_per_s")),
                           _x(r.get("vs_copy")), _x(r.get(key)), target(r)])
    if by_case.get("prefill"):
        case_table("Prefill over the cache (chunk over a cached prefix; the peer: flash_attention on contiguous K/V)",
                   ["| variant | dtype | B x prefix+chunk | page | median us | TFLOP/s | vs flash_attention |",
                    "|---|---|---|---:|---:|---:|---:|"], by_case["prefill"],
                   lambda r: [r["variant"], r["dtype"], r["shape_label"], str(r.get("page_size"))],
                   lambda r: [fmt(r["time_ms"]["median"] * 1e3), fmt(r.get("tflops")), _x(r.get("vs_baseline"))])
    if by_case.get("graph"):
        case_table("One decode step (CUDA graph replay vs eager; us)",
                   ["| impl | B x L | events us (cold L2) | wall us/step | plan us | vs sdpa (events) | vs sdpa (wall) |",
                    "|---|---|---:|---:|---:|---:|---:|"], by_case["graph"],
                   lambda r: [r["variant"], r["shape_label"]],
                   lambda r: [fmt(r["time_ms"]["median"] * 1e3), fmt(r.get("wall_us")), fmt(r.get("plan_us")),
                              _x(r.get("vs_baseline")), _x(r.get("vs_baseline_wall"))])
    text = "\n".join(out).rstrip()
    if failures:
        text += "\n\nFailed:\n" + "\n".join(failures)
    return text


def models_table(results):
    """The models family (bench/benchmark_models.py): one line per (case, shape, implementation): time per
    training step or per generate call, tokens/s, MFU, the ratios to torch eager and torch.compile, the targets."""
    head = ("| case | impl | shape | median ms [p10-p90] | CV | tokens/s | MFU | vs eager | vs compile "
            "| targets | validation |")
    out = [head, "|" + "---|" * 11]
    for r in results:
        label = r.get("shape_label", "")
        if r.get("status") != "ok":
            out.append(f"| {r.get('case', r['op'])} | {r['variant']} | {label} | {r['status']}: {r.get('reason', '')} "
                       "| | | | | | | |")
            continue
        t = r["time_ms"]
        targets = "; ".join(f"{k} >= {v['target']}: {'met' if v['met'] else 'NOT met' if v['met'] is False else '-'}"
                            for k, v in (r.get("targets") or {}).items())
        v = r.get("validation")
        val = "-" if not v else ("pass" if v.get("passed") else "FAIL")
        vs_eager = r.get("vs_eager", r.get("vs_baseline"))
        extra = f" ({fmt(r['loader_wait_ms_per_step'])} ms/step wait)" if r.get("loader_wait_ms_per_step") is not None \
            else ""
        out.append(f"| {r.get('case', r['op'])} | {r['variant']} | {label} | {fmt(t['median'])} [{fmt(t['p10'])}-"
                   f"{fmt(t['p90'])}] | {t['cv'] * 100:.1f}% | {fmt(r.get('tokens_per_s'))}{extra} "
                   f"| {pct(r.get('mfu'))} | {_x(vs_eager)} | {_x(r.get('vs_compile'))} | {targets or '-'} | {val} |")
    return "\n".join(out)


def run_markdown(data, heading_level=2):
    h = "#" * heading_level
    m = data["machine"]
    fams = {family_of(r) for r in data["results"]}
    titles = {"fused": "Fused ops", "attention": "Attention", "attention-memory": "Attention peak memory",
              "kv_cache": "KV cache", "models": "Models"}
    only = next(iter(fams)) if len(fams) == 1 else None
    what = (titles[only] + (", Python runner" if is_python_run(data) else "") + ": ") if only in titles else ""
    out = [f"{h} {what}{m.get('gpu') or 'CPU only'} ({m.get('cpu')}, {m.get('cpu_threads')} threads, "
           f"CPU microkernel {m.get('cpu_isa')})",
           "", f"Run {data['created']}: `{data['command']}`", "", f"{h}# Ceilings measured in the same run", "",
           ceilings_table(data), ""]
    groups = {}
    for r in data["results"]:
        groups.setdefault((family_of(r), r["backend"]), []).append(r)
    for (family, backend), rows in groups.items():
        if family == "fused":
            out += [f"{h}# fused ops on {backend}", ""]
            summary = fused_target_summary(rows)
            out += [summary, ""] if summary else []
            out += [fused_pivot(rows), ""]
        elif family == "attention":
            out += [f"{h}# attention on {backend}", ""]
            summary = attention_target_summary(rows)
            out += [summary, ""] if summary else []
            out += [attention_pivot(rows), ""]
        elif family == "attention-memory":
            out += [f"{h}# attention peak memory on {backend} (MiB above the inputs)", "",
                    attention_memory_table(rows), ""]
        elif family == "kv_cache":
            out += [f"{h}# kv_cache on {backend}", "", kv_cache_tables(rows), ""]
        elif family == "models":
            out += [f"{h}# models on {backend} (train/loader: per optimizer step; decode: per generate call)", "",
                    models_table(rows), ""]
        else:
            out += [f"{h}# {family} on {backend}", "", results_table(rows), ""]
        if has_metrics(rows):  # a --metrics run: each row's counters
            out += [f"{h}# {family} on {backend}: hardware counters (Nsight Compute, one profiled call per row)", "",
                    metrics_table(rows), ""]
    ceiling_counters = ceiling_metrics_lines(data)
    if ceiling_counters:
        out += [f"{h}# Ceilings: hardware counters", ""] + ceiling_counters + [""]
    if any(family_of(r) == "fused" for r in data["results"]):
        formulas = fused_formulas(data)
        if formulas:
            out += [f"{h}# Minimum bytes (GB/s = min_bytes / median time)", "", formulas, ""]
        other = [n for n in data.get("notes", []) if not n.startswith("min_bytes ")]
        if other:
            out += [f"{h}# Notes", ""] + [f"- {n}" for n in other] + [""]
    if any(family_of(r) == "kv_cache" for r in data["results"]):
        notes = [n for n in data.get("notes", []) if n.startswith("kv_cache")]
        if notes:
            out += [f"{h}# KV-cache notes", ""] + [f"- {n}" for n in notes] + [""]
    if any(family_of(r) == "models" for r in data["results"]):
        notes = [n for n in data.get("notes", []) if n.startswith("models")]
        if notes:
            out += [f"{h}# Models notes", ""] + [f"- {n}" for n in notes] + [""]
    if any(family_of(r).startswith("attention") for r in data["results"]):
        notes = [n for n in data.get("notes", []) if n.startswith("attention")]
        if notes:
            out += [f"{h}# Attention notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(out)


def cmd_table(args):
    print(run_markdown(load(args.json)))


def is_python_run(data):
    return any(name in data.get("command", "") for name in ("benchmark_all.py", "benchmark_fused.py",
                                                            "benchmark_attention.py", "benchmark_kv_cache.py"))


def cmd_place(args):
    """One file per op family of the run: DIR/<machine>/<family>.json (+ .md), each holding the run's
    ceilings and notes and that family's rows; a single-family run is copied as it is."""
    data = load(args.json)
    dest = pathlib.Path(args.results) / machine_key(data)
    dest.mkdir(parents=True, exist_ok=True)
    prefix = "python-" if is_python_run(data) else ""
    families = list(dict.fromkeys(family_of(r) for r in data["results"])) or ["ceilings"]
    for family in families:
        name = prefix + family
        if len(families) == 1:
            shutil.copyfile(args.json, dest / f"{name}.json")
            part = data
        else:
            part = dict(data, results=[r for r in data["results"] if family_of(r) == family])
            if family != "fused":  # the fused notes (byte formulas) belong to the fused file
                part["notes"] = [n for n in data.get("notes", []) if not n.startswith(("min_bytes ", "fused "))]
            (dest / f"{name}.json").write_text(json.dumps(part, indent=2) + "\n")
        (dest / f"{name}.md").write_text(run_markdown(part) + "\n")
        print(f"placed {dest / (name + '.json')}")
        png = pathlib.Path(args.json).with_name(f"{name}.png")  # the Python runner's plot, beside its JSON
        if png.is_file() and png.resolve() != (dest / png.name).resolve():
            shutil.copyfile(png, dest / png.name)
            print(f"placed {dest / png.name}")


BLOCK = re.compile(r"(<!-- generated: (?P<kind>ladder|fused-table|grid|attention-table|attention-ladder|attention-memory|kv-cache|"
                   r"models-table|metrics-table|choosing-table|choosing-targets|build-cost)"
                   r" (?P<spec>[^>]*?) -->\n)(?P<body>.*?)"
                   r"(<!-- end generated -->)", re.S)
SPEC_KEYS = {"machine", "file", "metric"}  # every other key of a spec filters the rows


def row_field(r, key):
    if key in ("shape",):
        return r["shape_label"]
    if key in ("rows", "width"):
        return str(r.get("shape", {}).get(key))
    if key == "threads":
        return str(fmt(r.get("threads")))
    if key == "family":
        return family_of(r)
    if key in ("head_dim", "seqlen", "batch", "heads", "heads_q", "heads_kv"):
        return str(r.get("shape", {}).get(key))
    return str(r.get(key))


OTHER_SCHEMAS = {"optimized-ops-build-cost/1", "optimized-ops-scaling/1"}  # JSON under bench/results that holds no benchmark run


def is_run(path):
    """Whether path holds a benchmark run (not e.g. scripts/build_cost.py's line and compile counts)."""
    return json.loads(pathlib.Path(path).read_text()).get("schema") not in OTHER_SCHEMAS


def select_rows(root, want):
    rows = []
    for path in sorted((root / want["machine"]).glob(want.get("file", "*") + ".json")):
        if not is_run(path):
            continue
        for r in load(path)["results"]:
            if all(row_field(r, k) == v for k, v in want.items() if k not in SPEC_KEYS):
                rows.append(r)
    return rows


def ladder_block(root, spec):
    """A ladder table for `machine=KEY op=OP dtype=D shape=S [file=F] [backend=B] [threads=T] [...]` from
    the committed JSON (file: the JSON's name without .json, e.g. matmul for the C++ runner's output)."""
    want = dict(kv.split("=", 1) for kv in spec.split())
    rows = select_rows(root, want)
    if not rows:
        return f"(no results for {spec} under {root})\n"
    table = fused_rows_table(rows) if all(family_of(r) == "fused" for r in rows) else results_table(rows)
    return f"Measured: `{spec}` (from `{root.as_posix()}/{want['machine']}/`)\n\n" + table + "\n"


def family_block(family, table):
    """A generated block of one family's selected rows, laid out by table(rows)."""
    def block(root, spec):
        want = dict(kv.split("=", 1) for kv in spec.split())
        rows = [r for r in select_rows(root, want) if family_of(r) == family]
        if not rows:
            return f"(no results for {spec} under {root})\n"
        return f"Measured: `{spec}` (from `{root.as_posix()}/{want['machine']}/`)\n\n" + table(rows) + "\n"
    return block


GRID_METRICS = {"gbps": ("GB/s", lambda r: fmt(r.get("gbps"))),
                "roofline": ("fraction of the measured copy bandwidth", lambda r: pct(r.get("roofline_fraction"))),
                "vs_baseline": ("baseline time / ours", lambda r: f"{r['vs_baseline']:.2f}x"
                                if r.get("vs_baseline") else "-"),
                "vs_copy": ("same-size copy time / ours", lambda r: pct(r.get("vs_copy_same_size")))}


def grid_block(root, spec):
    """ops down, widths across, one metric of the selected rows (one per cell: filter variant=,
    direction=, dtype=, rows= so that each (op, width) has one row)."""
    want = dict(kv.split("=", 1) for kv in spec.split())
    metric = want.get("metric", "gbps")
    if metric not in GRID_METRICS:
        return f"(unknown metric '{metric}' in {spec}: expected {', '.join(GRID_METRICS)})\n"
    rows = select_rows(root, want)
    if not rows:
        return f"(no results for {spec} under {root})\n"
    what, value = GRID_METRICS[metric]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    widths = sorted({r.get("shape", {}).get("width", 0) for r in rows})
    out = ["| op | " + " | ".join(str(w) for w in widths) + " |", "|---|" + "---:|" * len(widths)]
    for op in ops:
        cells = []
        for w in widths:
            m = [r for r in rows if r["op"] == op and r.get("shape", {}).get("width") == w]
            cells.append("" if not m else (value(m[0]) if m[0]["status"] == "ok" else m[0]["status"]))
        out.append(f"| {op} | " + " | ".join(cells) + " |")
    return (f"Measured: `{spec}` (from `{root.as_posix()}/{want['machine']}/`): {what}, columns = width\n\n" +
            "\n".join(out) + "\n")


def attention_block(kind):
    def block(root, spec):
        want = dict(kv.split("=", 1) for kv in spec.split())
        rows = select_rows(root, want)
        if not rows:
            return f"(no results for {spec} under {root})\n"
        if kind == "attention-memory":
            body = attention_memory_table(rows)
        else:
            body = attention_pivot(rows, ladder=kind == "attention-ladder")
            summary = attention_target_summary(rows) if kind == "attention-table" else ""
            body = (summary + "\n\n" + body) if summary else body
        what = " (cells: TFLOP/s (ratio to sdpa_cudnn's time))" if kind == "attention-ladder" else ""
        return f"Measured: `{spec}` (from `{root.as_posix()}/{want['machine']}/`){what}\n\n" + body + "\n"
    return block


BLOCK_KINDS = {"ladder": ladder_block, "fused-table": family_block("fused", fused_pivot), "grid": grid_block,
               "attention-table": attention_block("attention-table"),
               "attention-ladder": attention_block("attention-ladder"),
               "attention-memory": attention_block("attention-memory"),
               "kv-cache": family_block("kv_cache", kv_cache_tables),
               "models-table": family_block("models", models_table),
               "metrics-table": lambda root, spec: metrics_block(root, spec),
               "choosing-table": lambda root, spec: choosing_block(root, spec),
               "choosing-targets": lambda root, spec: choosing_targets_block(root, spec),
               "build-cost": lambda root, spec: build_cost_block(root, spec)}


def metrics_block(root, spec):
    """The hardware counters of the selected rows (filters as the ladder's)."""
    want = dict(kv.split("=", 1) for kv in spec.split())
    rows = select_rows(root, want)
    if not rows:
        return f"(no results for {spec} under {root})\n"
    note = "" if has_metrics(rows) else (" -- no counters in these results yet (run the benchmark with "
                                          "--metrics on the GPU machine)")
    return (f"Measured: `{spec}` (from `{root.as_posix()}/{want['machine']}/`): Nsight Compute counters{note}\n\n"
            + metrics_table(rows) + "\n")


# ---- choosing between implementations (issue 22, docs/perf-notes/choosing.md) ---------------------

VENDOR_BASELINES = {"torch.matmul": "vendor: cuBLAS (torch.matmul)", "cublas_bf16": "vendor: cuBLAS",
                    "cublas_fp16": "vendor: cuBLAS", "cublaslt_fp8_tensor": "vendor: cuBLASLt (fp8)"}
KIND_ORDER = ("CUDA (ours)", "Triton (ours)", "Triton (Liger-Kernel)", "CUTLASS", "vendor", "torch")


def impl_kind(variant, backend=""):
    """What an implementation is: ours in CUDA or Triton, CUTLASS, the vendor's library, or torch."""
    if variant in VENDOR_BASELINES:
        return VENDOR_BASELINES[variant]
    if variant.startswith("cutlass"):
        return "CUTLASS"
    if variant.startswith("triton"):
        return "Triton (ours)"
    if variant == "liger":
        return "Triton (Liger-Kernel)"
    named = {"sdpa_cudnn": "vendor: cuDNN (through SDPA)", "sdpa_flash": "torch: SDPA FlashAttention-2",
             "sdpa_efficient": "torch: SDPA memory-efficient", "sdpa_math": "torch: SDPA math",
             "torch_eager": "torch eager", "torch_compile": "torch.compile (Inductor)"}
    if variant in named:
        return named[variant]
    return "CPU (ours)" if backend == "cpu" else "CUDA (ours)"


def kind_rank(kind):
    return next((i for i, k in enumerate(KIND_ORDER) if kind.startswith(k)), len(KIND_ORDER))


def choosing_line_key(r):
    return (r["op"], r.get("shape_label", ""), r.get("direction", ""), r.get("causal"))


def spec_match(r, want):
    """The spec's filters, each value a comma list of accepted values."""
    return all(row_field(r, k) in v.split(",") for k, v in want.items() if k not in SPEC_KEYS | {"peers"})


def choosing_rows(root, want):
    """The selected rows of each run named by file= (a comma list), tagged with their run, and a row for each
    run's vendor baseline that is not itself a row (cuBLAS, cuBLASLt), from the baseline measured in that run."""
    rows, runs = [], {}
    for name in want.get("file", "*").split(","):
        for path in sorted((root / want["machine"]).glob(name + ".json")):
            if not is_run(path):
                continue
            data = load(path)
            copy = next((c["value"] for c in data.get("ceilings", []) if c["name"] == "device_copy"), None)
            picked = [dict(r, _run=path.stem, _copy=copy) for r in data["results"] if spec_match(r, want)]
            runs[path.stem] = next((r["baseline"]["name"] for r in picked if r.get("baseline")), None)
            seen = set()
            for r in picked:
                b = r.get("baseline")
                key = choosing_line_key(r)
                if b and b["name"] in VENDOR_BASELINES and key not in seen:
                    seen.add(key)
                    t = b["time_ms"]["median"]
                    rows.append({"variant": b["name"], "backend": r["backend"], "op": r["op"], "dtype": r["dtype"],
                                 "shape_label": r.get("shape_label", ""), "direction": r.get("direction"),
                                 "causal": r.get("causal"), "status": "ok", "time_ms": b["time_ms"],
                                 "tflops": b.get("tflops"), "family": r.get("family"),
                                 "gbps": r["min_bytes"] / t / 1e6 if r.get("min_bytes") else None,
                                 "baseline": b, "_run": path.stem, "_copy": copy})
            rows += picked
    return rows, runs


def choosing_table(rows, runs, peers):
    """One op's implementations: kind, run, time, samples, rates, the ratio to each peer of the same run
    (a peer's median time over the row's) and, memory-bound, the fraction of the run's copy bandwidth."""
    memory_bound = any(family_of(r) == "fused" for r in rows)
    has_dir = any(r.get("direction") for r in rows)
    has_causal = any(r.get("causal") is not None for r in rows)
    has_op = len({r["op"] for r in rows}) > 1
    lines = list(dict.fromkeys(choosing_line_key(r) for r in rows))
    run_order = list(runs)
    order = {id(r): i for i, r in enumerate(rows)}
    rows = sorted(rows, key=lambda r: (lines.index(choosing_line_key(r)),
                                       kind_rank(impl_kind(r["variant"], r.get("backend", ""))),
                                       run_order.index(r["_run"]), order[id(r)]))

    def peer_time(r, peer):
        group = [x for x in rows if x["_run"] == r["_run"] and choosing_line_key(x) == choosing_line_key(r)]
        if peer == "baseline":
            b = next((x["baseline"] for x in group if x.get("baseline")), None)
            return b["time_ms"]["median"] if b else None
        p = next((x for x in group if x["variant"] == peer and x["status"] == "ok"), None)
        return p["time_ms"]["median"] if p else None

    head = "| implementation | kind | run |" + (" op |" if has_op else "") + " shape |" + \
        (" dir |" if has_dir else "") + \
        (" causal |" if has_causal else "") + " median ms [p10-p90] | samples (CV) | " + \
        ("GB/s |" if memory_bound else "TFLOP/s |") + \
        "".join(f" {'baseline' if p == 'baseline' else p}'s time / this |" for p in peers) + \
        (" % of copy |" if memory_bound else "")
    ncols = head.count("|") - 1
    lead_cols = 4 + has_op + has_dir + has_causal
    out = [head, "|---" * lead_cols + "|" + "---:|" * (ncols - lead_cols)]
    for r in rows:
        name = r["variant"] + (f" ({r['resolved_variant']})" if r.get("resolved_variant") else "")
        lead = (f"| {name} | {impl_kind(r['variant'], r.get('backend', ''))} | {r['_run']} | " +
                (f"{r['op']} | " if has_op else "") + f"{r.get('shape_label', '')} |" +
                (f" {r.get('direction') or ''} |" if has_dir else "") +
                (f" {'causal' if r.get('causal') else '-'} |" if has_causal else ""))
        if r["status"] != "ok":
            why = r.get("reason", "").split(":")[0]
            out.append(lead + f" {r['status']}: {why} |" + " |" * (ncols - lead_cols - 1))
            continue
        t = r["time_ms"]
        cells = [f"{fmt(t['median'])} [{fmt(t['p10'])}-{fmt(t['p90'])}]", f"{t['samples']} ({t['cv'] * 100:.1f}%)",
                 fmt(r.get("gbps") if memory_bound else r.get("tflops"))]
        for p in peers:
            pt = peer_time(r, p)
            cells.append(f"{pt / t['median']:.2f}x" if pt else "-")
        if memory_bound:
            cells.append(pct(r["gbps"] * 1e9 / (r["_copy"] * 1e9)) if r.get("gbps") and r.get("_copy") else "-")
        out.append(lead + " " + " | ".join(cells) + " |")
    return "\n".join(out)


def choosing_block(root, spec):
    want = dict(kv.split("=", 1) for kv in spec.split())
    peers = want.get("peers", "baseline").split(",")
    rows, runs = choosing_rows(root, want)
    if not rows:
        return f"(no results for {spec} under {root})\n"
    base = "; ".join(f"{run}: {name or '-'}" for run, name in runs.items())
    return (f"Measured: `{spec}` (from `{root.as_posix()}/{want['machine']}/`; each ratio within one run; "
            f"the baseline of each run: {base})\n\n" + choosing_table(rows, runs, peers) + "\n")


def _ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def choosing_targets_block(root, spec):
    """Issue 22's targets for the Triton rungs, each line with our CUDA rung beside it (same run)."""
    want = dict(kv.split("=", 1) for kv in spec.split())
    files = {"matmul": want.get("matmul", "python-matmul-triton"), "fused": want.get("fused", "python-fused-triton"),
             "attention": want.get("attention", "python-attention-triton")}
    out = ["| target | line | Triton | ours (CUDA) | met | Triton speed-up still needed | "
           "ours (CUDA) vs Triton (Triton's time / ours) |", "|---|---|---:|---:|---|---:|---:|"]
    measured = []

    def line(target, label, tri, ours, goal, value_of, in_scope=True):
        tv, ov = value_of(tri), value_of(ours) if ours else None
        met = "-" if not in_scope or tv is None else ("met" if tv >= goal else "**missed**")
        need = "-" if not in_scope or tv is None or tv >= goal else f"{goal / tv:.2f}x"
        vs = (f"{tri['time_ms']['median'] / ours['time_ms']['median']:.2f}x"
              if ours and ours["status"] == "ok" and tri["status"] == "ok" else "-")
        out.append(f"| {target if in_scope else '(not a target shape)'} | {label} | {value_fmt(tv)} | "
                   f"{value_fmt(ov)} | {met} | {need} | {vs} |")

    def rows_of(name):
        path = root / want["machine"] / f"{name}.json"
        if not path.is_file():
            return []
        data = load(path)
        measured.append(f"`{name}` ({data['created']}, `--min-samples {data['options'].get('min_samples')} "
                        f"--max-time-s {data['options'].get('max_time_s')}`)")
        return data["results"]

    value_fmt = _ratio
    mm = rows_of(files["matmul"])
    for r in mm:
        if r["variant"].startswith("triton") and r["dtype"] == "bf16":
            ours = next((o for o in mm if o["variant"] == "auto" and o["shape_label"] == r["shape_label"]), None)
            line("GEMM bf16 >= 0.85x cuBLAS (torch.matmul)", f"{r['variant']} {r['shape_label']}", r, ours, 0.85,
                 lambda x: x.get("vs_baseline") if x and x["status"] == "ok" else None,
                 in_scope=r["shape_label"] == "4096x4096x4096")
    value_fmt = pct
    fu = rows_of(files["fused"])
    for r in fu:
        if r["variant"] == "triton" and r["op"] in ("softmax", "layer_norm", "rms_norm"):
            ours = next((o for o in fu if o["variant"] == "auto" and fused_line_key(o)[:2] == fused_line_key(r)[:2]
                         and o["shape_label"] == r["shape_label"]), None)
            line("softmax / norms >= 85% of copy bandwidth", f"{r['op']} {r['direction']} {r['shape_label']}", r, ours,
                 0.85, lambda x: x.get("roofline_fraction") if x and x["status"] == "ok" else None)
    value_fmt = _ratio
    at = rows_of(files["attention"])
    for r in at:
        if r["variant"] == "triton" and r.get("direction") == "fwd":
            ours = next((o for o in at if o["variant"] == "hopper" and attention_line_key(o) == attention_line_key(r)),
                        None)
            line("attention fwd >= 0.8x SDPA-flash (FA2)",
                 f"{r['shape_label']}{' causal' if r.get('causal') else ''}", r, ours, 0.8,
                 lambda x: x.get("vs_baseline") if x and x["status"] == "ok" else None)
    if not measured:
        return f"(no results for {spec} under {root})\n"
    return ("Measured (H100, Python runner; ours (CUDA) = `auto` for GEMM and the fused ops, `hopper` for attention): "
            + ", ".join(measured) + "\n\n" + "\n".join(out) + "\n")


def build_cost_block(root, spec):
    """Lines of code and compile times (scripts/build_cost.py)."""
    want = dict(kv.split("=", 1) for kv in spec.split())
    path = root / want["machine"] / (want.get("file", "build-cost") + ".json")
    if not path.is_file():
        return f"(no {path.as_posix()}: run scripts/build_cost.py)\n"
    data = json.loads(path.read_text())

    def cell(entry, part):
        p = entry["parts"].get(part)
        return "-" if not p else f"{p['code_lines']} ({p['lines']}) in {len(p['files'])}"

    out = [f"From `{path.as_posix()}` (`{data['command']}`, {data['created']}, commit {data['commit']}). Cells: code "
           "lines (all lines) in N files; code = neither blank nor only a comment (Python docstrings count as "
           "comments). CUDA and CUTLASS columns are the translation unit's real include closure (the build's "
           "dependency log).", "",
           "| op | implementation | kind | its own files | shared device primitives (src/kernels) | library "
           "infrastructure (core, params, config) | library it instantiates | own files |",
           "|---|---|---|---:|---:|---:|---:|---|"]
    for e in data["loc"]:
        own = e["parts"].get("own", {}).get("files", [])
        out.append(f"| {e['op']} | {e['implementation']} | {e['kind']} | {cell(e, 'own')} | {cell(e, 'shared')} | "
                   f"{cell(e, 'infra')} | {cell(e, 'library')} | "
                   f"{', '.join('`' + pathlib.PurePosixPath(f).name + '`' for f in own)} |")
    for c in data.get("closed_source", []):
        out.append(f"| {c['op']} | {c['implementation']} | vendor | 0 (closed source) | - | - | - | - |")
    if data.get("compile"):
        out += ["", f"Compile time of one translation unit, as the build compiles it (ccache off), on "
                    f"{data['machine']['cpu']} ({data['machine']['cpu_threads']} threads):", "",
                "| source | build | flags | seconds |", "|---|---|---|---:|"]
        for c in data["compile"]:
            out.append(f"| `{c['source']}` | {c['build_dir']} | `{c['flags']}` | {fmt(c['seconds'])} |")
    for n in data.get("notes", []):
        out += ["", f"- {n}"]
    return "\n".join(out) + "\n"


def refresh_generated_blocks(root, notes_dir):
    for path in sorted(pathlib.Path(notes_dir).glob("*.md")):
        text = path.read_text()
        new = BLOCK.sub(lambda m: m.group(1) + BLOCK_KINDS[m.group("kind")](root, m.group("spec")) + m.group(5),
                        text)
        if new != text:
            path.write_text(new)
            print(f"refreshed {path}")


def cmd_docs(args):
    root = pathlib.Path(args.results)
    parts = ["# Performance", "",
             "Generated by `scripts/render_results.py docs` from the JSON under `bench/results/`; do not edit.",
             "Each row is validated against the float64 reference before it is timed. Times are medians over",
             "cold-L2 samples with rotating inputs; 'vs baseline' is the baseline's median time over ours (>1 is",
             "faster), measured in the same run; 'roofline' is the time the measured ceilings allow over ours.", ""]
    out_dir = pathlib.Path(args.out).resolve().parent
    for path in sorted(root.glob("*/*.json")):
        if not is_run(path):
            continue
        parts += [f"<!-- {path.as_posix()} -->", run_markdown(load(path)), ""]
        for png in sorted(path.parent.glob(path.stem + "*.png")):  # plots written beside the JSON
            rel = pathlib.Path(os.path.relpath(png.resolve(), out_dir)).as_posix()
            parts += [f"![{png.stem}]({rel})", ""]
    pathlib.Path(args.out).write_text("\n".join(parts) + "\n")
    print(f"wrote {args.out}")
    refresh_generated_blocks(root, pathlib.Path(args.out).parent / "perf-notes")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("json")
    t.set_defaults(fn=cmd_table)
    pl = sub.add_parser("place")
    pl.add_argument("json")
    pl.add_argument("--results", default="bench/results")
    pl.set_defaults(fn=cmd_place)
    d = sub.add_parser("docs")
    d.add_argument("--results", default="bench/results")
    d.add_argument("--out", default="docs/performance.md")
    d.set_defaults(fn=cmd_docs)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
