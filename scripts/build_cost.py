#!/usr/bin/env python3
"""What each implementation of an op costs to own: lines of code and compile time (issue 22).

  build_cost.py [--out bench/results/cpu/build-cost.json] [--no-compile]

Writes one JSON (schema optimized-ops-build-cost/1) that `render_results.py docs` renders into the
`build-cost` block of docs/perf-notes/choosing.md:
- loc: per implementation, the files it is made of and their lines (all, and code: neither blank nor
  only a comment; Python docstrings count as comments). A CUDA / CUTLASS translation unit's files are
  its real include closure, read from the build's dependency log (`ninja -t deps`), split by where
  they live: the kernel's own files, the shared device primitives (src/kernels), the library's
  infrastructure (src/core, include/, params, config, launcher declarations) and, for CUTLASS, the
  CUTLASS / CuTe headers it instantiates (the library's lines: not ours to write, ours to depend on).
  Triton rungs: their Python files (one per op; the shared glue -- checks, autograd, custom ops -- apart).
- compile: wall time of one translation unit compiled as the build compiles it (the exact command
  from `ninja -t commands`, ccache disabled, output to a scratch directory so that no build tree or
  source timestamp changes), serialised with the other builds of this machine by /tmp/oo-build.lock.
cuBLAS / cuDNN are closed source: no lines of ours. Triton kernels compile at their first call on
the GPU (not measurable here).
"""
import argparse
import datetime
import fcntl
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEMA = "optimized-ops-build-cost/1"
LOCK = "/tmp/oo-build.lock"

# (implementation, op, kind, build dir, ninja object): a translation unit whose include closure is counted
CUDA_UNITS = [
    ("wgmma_persistent", "matmul", "CUDA (ours)", "build-torch",
     "src/gemm/CMakeFiles/optimized_ops_sm90a.dir/cuda/gemm_wgmma_persistent.cu.o"),
    ("cutlass_ws_128x128", "matmul", "CUTLASS", "build-cutlass",
     "bench/CMakeFiles/optimized_bench_cutlass.dir/gemm/cutlass/bf16_ws_128x128.cu.o"),
    ("fused_registers (bf16: every fused op, fwd + bwd)", "softmax / layer_norm / rms_norm", "CUDA (ours)",
     "build-torch", "CMakeFiles/optimized_ops.dir/src/fused/generated/fused_registers_dtype_bf16.cu.o"),
    ("hopper fwd (d128)", "attention", "CUDA (ours)", "build-torch",
     "src/gemm/CMakeFiles/optimized_ops_sm90a.dir/__/attention/cuda/hopper_fwd_d128.cu.o"),
    ("flash2 fwd (d128)", "attention", "CUDA (ours)", "build-torch",
     "CMakeFiles/optimized_ops.dir/src/attention/cuda/flash2_fwd_d128.cu.o"),
]
# (implementation, op, files): the Triton rungs, one file per op family
TRITON_FILES = [
    ("triton", "matmul", ["python/optimized_ops/triton/matmul.py"]),
    ("triton_tma", "matmul", ["python/optimized_ops/triton/matmul_tma.py"]),
    ("triton (fwd + bwd)", "softmax", ["python/optimized_ops/triton/softmax.py"]),
    ("triton (fwd + bwd, both norms)", "layer_norm / rms_norm", ["python/optimized_ops/triton/norms.py"]),
    ("triton (fwd + bwd)", "attention", ["python/optimized_ops/triton/attention.py"]),
    ("triton glue (checks, autograd, custom ops, availability)", "all",
     ["python/optimized_ops/triton/ops.py", "python/optimized_ops/triton/__init__.py",
      "python/optimized_ops/triton/_compat.py"]),
]
# the translation units whose compile is timed (build dir, ninja object)
COMPILE_UNITS = [
    ("build-cutlass", "bench/CMakeFiles/optimized_bench_cutlass.dir/gemm/cutlass/bf16_ws_128x128.cu.o"),
    ("build-torch", "src/gemm/CMakeFiles/optimized_ops_sm90a.dir/cuda/gemm_wgmma_persistent.cu.o"),
    ("build-torch", "src/gemm/CMakeFiles/optimized_ops_sm90a.dir/__/attention/cuda/hopper_fwd_d128.cu.o"),
    ("build-torch", "CMakeFiles/optimized_ops.dir/src/fused/generated/fused_registers_dtype_bf16.cu.o"),
]


# ---- counting lines ----------------------------------------------------------------------------

def c_code_lines(text):
    """Lines holding code in C / C++ / CUDA text: comments (// and /* */) removed, string literals kept."""
    out, i, n, in_block, line_has_code, count = [], 0, len(text), False, False, 0
    while i < n:
        ch = text[i]
        if ch == "\n":
            count += line_has_code
            line_has_code = False
            i += 1
            continue
        if in_block:
            if text.startswith("*/", i):
                in_block = False
                i += 2
            else:
                i += 1
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if text.startswith("/*", i):
            in_block = True
            i += 2
            continue
        if ch in "\"'":
            j = i + 1
            while j < n and text[j] != ch and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            line_has_code = True
            i = j + 1
            continue
        if not ch.isspace():
            line_has_code = True
        i += 1
    return count + line_has_code


def py_code_lines(path):
    """Lines holding Python code: comments, blank lines and docstrings (a string alone as a statement) left out."""
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}
    with open(path, "rb") as f:
        toks = list(tokenize.tokenize(f.readline))
    for i, t in enumerate(toks):
        if t.type in skip:
            continue
        if t.type == tokenize.STRING:
            prev = next((p for p in reversed(toks[:i]) if p.type not in (tokenize.NL, tokenize.COMMENT)), None)
            nxt = toks[i + 1] if i + 1 < len(toks) else None
            starts = prev is None or prev.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                   tokenize.ENCODING)
            if starts and nxt is not None and nxt.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                continue  # a docstring
        lines.update(range(t.start[0], t.end[0] + 1))
    return len(lines)


def count_file(path):
    path = pathlib.Path(path)
    text = path.read_text(errors="replace")
    total = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    code = py_code_lines(path) if path.suffix == ".py" else c_code_lines(text)
    return total, code


def rel(p):
    p = pathlib.Path(p)
    try:
        return p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return p.as_posix()


def part_of(path, kind):
    """Where an included file belongs: own (the kernel's family files), shared (src/kernels), infra, cutlass."""
    r = rel(path)
    if "/_deps/cutlass/" in path or r.startswith("build-cutlass/_deps"):
        return "library"
    if r.startswith("src/kernels/"):
        return "shared"
    if r.startswith(("src/core/", "include/")) or re.search(r"_(params|config)\.h$|/launchers\.h$", r):
        return "infra"
    return "own"


def unit_deps(build, target):
    out = subprocess.run(["ninja", "-C", str(ROOT / build), "-t", "deps", target], capture_output=True, text=True,
                         check=True).stdout
    deps = [line.strip() for line in out.splitlines()[1:] if line.startswith("    ")]
    if not deps:
        sys.exit(f"{build}: no dependency record for {target} (build it once first: ninja -C {build} {target})")
    return [d if d.startswith("/") else str(ROOT / build / d) for d in deps]


def loc_entries():
    entries = []
    for name, op, kind, build, target in CUDA_UNITS:
        parts = {}
        for d in unit_deps(build, target):
            if not (d.startswith(str(ROOT) + "/")):
                continue  # system and CUDA toolkit headers
            total, code = count_file(d)
            p = parts.setdefault(part_of(d, kind), {"files": [], "lines": 0, "code_lines": 0})
            p["files"].append(rel(d))
            p["lines"] += total
            p["code_lines"] += code
        entries.append({"implementation": name, "op": op, "kind": kind, "unit": target, "parts": parts})
    for name, op, files in TRITON_FILES:
        p = {"files": files, "lines": 0, "code_lines": 0}
        for f in files:
            total, code = count_file(ROOT / f)
            p["lines"] += total
            p["code_lines"] += code
        entries.append({"implementation": name, "op": op, "kind": "Triton (ours)", "parts": {"own": p}})
    return entries


# ---- timing compiles ---------------------------------------------------------------------------

def compile_command(build, target, scratch):
    cmd = subprocess.run(["ninja", "-C", str(ROOT / build), "-t", "commands", target], capture_output=True,
                         text=True, check=True).stdout.strip().splitlines()[-1]
    args = shlex.split(cmd)
    if args and os.path.basename(args[0]) == "ccache":
        args = args[1:]
    out = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT"):
            out += [a, str(scratch / ("unit.o" if a == "-o" else "unit.d" if a == "-MF" else "unit.o"))]
            skip = True
            continue
        out.append(a)
    return out


def time_compile(build, target):
    with tempfile.TemporaryDirectory() as tmp:
        args = compile_command(build, target, pathlib.Path(tmp))
        with open(LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one heavy build at a time on this machine
            start = time.monotonic()
            run = subprocess.run(args, cwd=ROOT / build, capture_output=True, text=True,
                                 env=dict(os.environ, CCACHE_DISABLE="1"))
            seconds = time.monotonic() - start
    if run.returncode:
        sys.exit(f"compile of {target} failed:\n{run.stderr[-2000:]}")
    flags = [a for a in args if a.startswith(("-O", "--generate-code", "-std="))]
    source = next((a for a in args if a.endswith((".cu", ".cpp"))), "")
    return {"unit": target, "source": rel(source) if source else "", "build_dir": build,
            "seconds": round(seconds, 1), "flags": " ".join(flags)}


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench/results/cpu/build-cost.json"))
    p.add_argument("--no-compile", action="store_true", help="count lines only; keep the compile times already "
                                                              "in --out")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    data = {"schema": SCHEMA, "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": "scripts/build_cost.py" + (" --no-compile" if args.no_compile else ""),
            "commit": commit + " (+ working tree)",
            "machine": {"cpu": cpu_name(), "cpu_threads": os.cpu_count()},
            "loc": loc_entries(),
            "closed_source": [{"implementation": "cuBLAS / cuBLASLt", "op": "matmul, scaled_mm"},
                              {"implementation": "cuDNN (SDPA cuDNN backend)", "op": "attention"}],
            "compile": old.get("compile", []) if args.no_compile else [],
            "notes": ["Triton kernels are compiled by Triton's JIT at their first call on the GPU (one compile per "
                      "autotune config and constexpr specialization); not measurable on this CPU machine"]}
    if not args.no_compile:
        for build, target in COMPILE_UNITS:
            entry = time_compile(build, target)
            print(f"{entry['seconds']:7.1f} s  {entry['source']}", flush=True)
            data["compile"].append(entry)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
