#!/usr/bin/env python3
"""Turns benchmark JSON (schema optimized-ops-bench/1) into markdown.

  render_results.py table RESULT.json                 markdown tables of one run, to stdout
  render_results.py place RESULT.json --results DIR   copy into DIR/<machine>/<op>.json (+ .md)
  render_results.py docs --results DIR --out FILE     docs/performance.md from every committed run

The docs are generated from the JSON the benchmark wrote, never typed by hand.
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


def results_table(results):
    head = ("| variant | backend | dtype | shape | threads | median ms [p10-p90] | CV | TFLOP/s | GB/s "
            "| vs baseline | roofline | regs / smem / occ |")
    rows = [head, "|" + "---|" * 12]
    for r in results:
        shape = r.get("shape_label", "")
        if r.get("status") != "ok":
            rows.append(f"| {r['variant']} | {r['backend']} | {r['dtype']} | {shape} | {fmt(r.get('threads'))} "
                        f"| {r['status']}: {r.get('reason', '')} | | | | | | |")
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
            f"| {vs} | {roof} | {res} |")
    return "\n".join(rows)


def run_markdown(data, heading_level=2):
    h = "#" * heading_level
    m = data["machine"]
    out = [f"{h} {m.get('gpu') or 'CPU only'} ({m.get('cpu')}, {m.get('cpu_threads')} threads, "
           f"CPU microkernel {m.get('cpu_isa')})",
           "", f"Run {data['created']}: `{data['command']}`", "", f"{h}# Ceilings measured in the same run", "",
           ceilings_table(data), ""]
    groups = {}
    for r in data["results"]:
        groups.setdefault((r["op"], r["backend"]), []).append(r)
    for (op, backend), rows in groups.items():
        out += [f"{h}# {op} on {backend}", "", results_table(rows), ""]
    return "\n".join(out)


def cmd_table(args):
    print(run_markdown(load(args.json)))


def cmd_place(args):
    data = load(args.json)
    dest = pathlib.Path(args.results) / machine_key(data)
    dest.mkdir(parents=True, exist_ok=True)
    ops = sorted({r["op"] for r in data["results"]}) or ["ceilings"]
    name = "-".join(ops)
    shutil.copyfile(args.json, dest / f"{name}.json")
    (dest / f"{name}.md").write_text(run_markdown(data) + "\n")
    print(f"placed {dest / (name + '.json')}")


BLOCK = re.compile(r"(<!-- generated: ladder (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def ladder_block(root, spec):
    """A ladder table for `machine=KEY op=OP dtype=D shape=S [file=F] [backend=B] [threads=T]` from the
    committed JSON (file: the JSON's name without .json, e.g. matmul for the C++ runner's output)."""
    want = dict(kv.split("=", 1) for kv in spec.split())
    rows = []
    for path in sorted((root / want["machine"]).glob(want.get("file", "*") + ".json")):
        for r in load(path)["results"]:
            if r["op"] != want["op"] or r["dtype"] != want["dtype"] or r["shape_label"] != want["shape"]:
                continue
            if "backend" in want and r["backend"] != want["backend"]:
                continue
            if "threads" in want and str(fmt(r.get("threads"))) != want["threads"]:
                continue
            rows.append(r)
    if not rows:
        return f"(no results for {spec} under {root})\n"
    return f"Measured: `{spec}` (from `{root.as_posix()}/{want['machine']}/`)\n\n" + results_table(rows) + "\n"


def refresh_generated_blocks(root, notes_dir):
    for path in sorted(pathlib.Path(notes_dir).glob("*.md")):
        text = path.read_text()
        new = BLOCK.sub(lambda m: m.group(1) + ladder_block(root, m.group("spec")) + m.group(4), text)
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
