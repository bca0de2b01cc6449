"""Hardware-counter metrics of the Python runner's rows, from Nsight Compute (issue 23): the Python
mirror of bench/metrics.{h,cpp} (the same metric set per architecture, the same CSV parsing, the same
`metrics` object in the rows).

    python bench/benchmark_all.py --ops matmul --metrics

How a row's kernels are found: after the timed run, the runner starts ONE child under ncu,

    ncu --csv --page raw --print-units base --profile-from-start off --target-processes all
        --metrics <metric_set(arch)> --log-file RUN.csv
        python bench/benchmark_all.py <the same arguments> --metrics-child MAP.json (+ one short sample)

In the child every Timer.measure() (a row's, a peer's, a ceiling's) ends with one more untimed call of
what it timed, between torch.cuda.profiler.start() and stop(), that call's kernels preceded by a
marker kernel (torch.cuda._sleep: "spin_kernel"). ncu, which profiles only inside start/stop, lists
the kernels in launch order; the markers cut that list into one segment per measurement. The child
writes MAP.json: which measurement each of its rows' (and ceilings') time came from. The parent
matches its rows to the child's by their identity (family, op, variant, dtype, shape, direction, ...)
and sums each segment's counters into the row's `metrics`.

Absent metrics (not collected on this architecture, "n/a") are absent, never 0. Where ncu is absent
(not on PATH, no $OPTIMIZED_NCU) or the run is on the CPU, every row gets
{"status": "skipped", "reason": ...} and the run goes on.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: the start of each profiled measurement

DURATION = "gpu__time_duration.sum"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
DRAM_READ = "dram__bytes_read.sum"
DRAM_WRITE = "dram__bytes_write.sum"
DRAM_PCT = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
HMMA = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
GMMA = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
REGISTERS = "launch__registers_per_thread"
LOCAL_LD = "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"
LOCAL_ST = "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"
SUMS = {  # key in the metrics object -> metric summed over the row's kernels
    "l2_bytes": "lts__t_bytes.sum",
    "l1_bytes": "l1tex__t_bytes.sum",
    "global_load_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "global_store_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "shared_load_instructions": "smsp__inst_executed_op_shared_ld.sum",
    "shared_store_instructions": "smsp__inst_executed_op_shared_st.sum",
    "shared_load_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "shared_store_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
    "shared_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
}
STALL_REASONS = ["barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
                 "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc", "no_instruction",
                 "not_selected", "selected", "short_scoreboard", "sleeping", "tex_throttle", "wait"]


def stall_metric(reason):
    return f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio"


def metric_set(cc):
    """The fixed set for compute capability cc (major*10 + minor; 0 unknown), as bench/metrics.cpp."""
    m = [DURATION, OCCUPANCY, DRAM_READ, DRAM_WRITE, DRAM_PCT, "lts__t_bytes.sum", "l1tex__t_bytes.sum",
         SUMS["global_load_sectors"], SUMS["global_store_sectors"], SUMS["shared_load_instructions"],
         SUMS["shared_store_instructions"], SUMS["shared_load_wavefronts"], SUMS["shared_store_wavefronts"],
         SUMS["shared_bank_conflicts"], LOCAL_LD, LOCAL_ST, REGISTERS]
    if 70 <= cc < 100:
        m.append(HMMA)
    if 90 <= cc < 100:
        m.append(GMMA)
    return m + [stall_metric(r) for r in STALL_REASONS]


# ---- ncu's CSV -----------------------------------------------------------------------------------------

INFO_COLUMNS = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
                "Grid Size", "Device", "CC", "Section Name", "Kernel Time", "Function Name", "Demangled Name",
                "Mangled Name", "Estimated Speedup", "Launch Name", "Range Name"}
UNIT_SCALE = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6, "GB": 1e9,
              "TB": 1e12, "nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "ns": 1, "us": 1e3,
              "ms": 1e6, "s": 1e9, "Kcycle": 1e3, "Mcycle": 1e6, "Ksector": 1e3, "Msector": 1e6, "Gsector": 1e9,
              "Kinst": 1e3, "Minst": 1e6, "Ginst": 1e9}


def _number(cell):
    s = cell.strip().replace(",", "")
    if not s:
        return None
    try:
        v = float(s)
    except ValueError:
        return None
    return v if v == v and abs(v) != float("inf") else None


def parse_csv(text):
    """ncu --csv --page raw output (the whole log) -> list of kernels {"id", "name", "values", "absent"},
    values in base units. Raises ValueError when there is no header line."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"') or l.startswith("ID,")), None)
    if start is None:
        raise ValueError('ncu CSV: no header line ("ID",...) found')
    body = [l for l in lines[start:] if l.strip() and not l.startswith("==")
            and (l.startswith('"') or "," in l)]
    rows = list(csv.reader(io.StringIO("\n".join(body))))
    header = rows[0]
    metric_cols = [c for c, h in enumerate(header) if h and h not in INFO_COLUMNS]
    name_col = header.index("Kernel Name") if "Kernel Name" in header else None
    scale = [1.0] * len(header)
    first = 1
    if len(rows) > 1 and rows[1] and not rows[1][0].strip():
        scale = [UNIT_SCALE.get(u.strip(), 1.0) for u in rows[1]] + [1.0] * max(0, len(header) - len(rows[1]))
        first = 2
    kernels = []
    for cells in rows[first:]:
        if len(cells) < len(header):
            continue
        k = {"id": cells[0], "name": cells[name_col] if name_col is not None else "", "values": {}, "absent": []}
        for c in metric_cols:
            v = _number(cells[c])
            if v is None:
                k["absent"].append(header[c])
            else:
                k["values"][header[c]] = v * scale[c]
        kernels.append(k)
    return kernels


def unknown_metrics(log):
    """Names ncu refused ("==ERROR== Failed to find metric X")."""
    out = []
    # ncu names a metric as given, or as the regex it made of it ("regex:^name\.(sum|avg|...)$"): the
    # identifier, unescaped, without a trailing dot.
    pattern = (r"Failed to find metric\s+(?:regex:\^?)?([A-Za-z0-9_.\\]+)"
               r"|ERROR.*?[Mm]etric\s+(?:regex:\^?)?([A-Za-z0-9_.\\]+)\s+not found")
    for m in re.finditer(pattern, log):
        name = (m.group(1) or m.group(2)).replace("\\", "").rstrip(".")
        if name not in out:
            out.append(name)
    return out


def split_segments(kernels, marker=MARKER):
    """The kernels cut at each marker kernel (markers dropped): one list per profiled measurement.
    Kernels before the first marker (none expected) are dropped."""
    segments = []
    for k in kernels:
        if marker in k["name"]:
            segments.append([])
        elif segments:
            segments[-1].append(k)
    return segments


# ---- the row's metrics object ------------------------------------------------------------------------------

def memory_efficiency(min_bytes, dram_read, dram_write):
    if dram_read is None or dram_write is None or not min_bytes or min_bytes <= 0:
        return None
    total = dram_read + dram_write
    return min_bytes / total if total > 0 else None


def _sum(kernels, m):
    vals = [k["values"][m] for k in kernels if m in k["values"]]
    return sum(vals) if vals else None


def _max(kernels, m):
    vals = [k["values"][m] for k in kernels if m in k["values"]]
    return max(vals) if vals else None


def _weighted(kernels, m):
    """Duration-weighted mean over the kernels that have m (plain mean where durations are missing)."""
    have = [k for k in kernels if m in k["values"]]
    if not have:
        return None
    durations = [k["values"].get(DURATION) for k in have]
    if all(d is not None and d > 0 for d in durations):
        return sum(k["values"][m] * d for k, d in zip(have, durations)) / sum(durations)
    return sum(k["values"][m] for k in have) / len(have)


def summarize(kernels, min_bytes, requested, cc):
    """The `metrics` object of a row (bench/metrics.cpp's summarize)."""
    if not kernels:
        return failed("ncu profiled no kernel of the row")
    j = {"status": "ok", "tool": "ncu", "arch": f"sm_{cc}" if cc else "unknown", "kernels": len(kernels),
         "kernel_names": list(dict.fromkeys(k["name"] for k in kernels))}

    def put(key, v):
        if v is not None:
            j[key] = v

    put("duration_ns", _sum(kernels, DURATION))
    put("achieved_occupancy_pct", _weighted(kernels, OCCUPANCY))
    rd, wr = _sum(kernels, DRAM_READ), _sum(kernels, DRAM_WRITE)
    put("dram_read_bytes", rd)
    put("dram_write_bytes", wr)
    if rd is not None and wr is not None:
        j["dram_bytes"] = rd + wr
    if min_bytes and min_bytes > 0:
        j["min_bytes"] = min_bytes
    put("memory_efficiency", memory_efficiency(min_bytes, rd, wr))
    put("dram_throughput_pct", _weighted(kernels, DRAM_PCT))
    for key, m in SUMS.items():
        put(key, _sum(kernels, m))
    tensor = []
    for k in kernels:
        v = [k["values"][m] for m in (HMMA, GMMA) if m in k["values"]]
        tensor.append({"values": ({"tensor": max(v)} if v else {}) | (
            {DURATION: k["values"][DURATION]} if DURATION in k["values"] else {})})
    put("tensor_pipe_pct", _weighted(tensor, "tensor"))
    put("tensor_pipe_hmma_pct", _weighted(kernels, HMMA))
    put("tensor_pipe_gmma_pct", _weighted(kernels, GMMA))
    put("registers_per_thread", _max(kernels, REGISTERS))
    lld, lst = _sum(kernels, LOCAL_LD), _sum(kernels, LOCAL_ST)
    if lld is not None or lst is not None:
        j["local_bytes"] = (lld or 0) + (lst or 0)
    stalls = [(v, r) for r in STALL_REASONS if (v := _weighted(kernels, stall_metric(r))) is not None]
    stalls.sort(key=lambda x: -x[0])
    if stalls:
        j["top_stalls"] = [{"reason": r, "warps_per_issue": v} for v, r in stalls[:3]]
    j["absent"] = [m for m in requested if not any(m in k["values"] for k in kernels)]
    return j


def skipped(reason):
    return {"status": "skipped", "reason": reason}


def failed(reason):
    return {"status": "failed", "reason": reason}


# ---- ncu -----------------------------------------------------------------------------------------------------

def find_ncu():
    env = os.environ.get("OPTIMIZED_NCU")
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else ""
    return shutil.which("ncu") or ""


def ncu_missing_reason():
    env = os.environ.get("OPTIMIZED_NCU")
    if env:
        return f"OPTIMIZED_NCU={env} is not an executable file: no hardware counters collected"
    return "Nsight Compute (ncu) not found on PATH (or set OPTIMIZED_NCU): no hardware counters collected"


def ncu_arguments(ncu, metrics, log_file):
    return [ncu, "--csv", "--page", "raw", "--print-units", "base", "--profile-from-start", "off",
            "--target-processes", "all", "--metrics", ",".join(metrics), "--log-file", str(log_file)]


# The child's measurement: one short sample per measurement (the profiled call comes after it).
CHILD_MEASURE = ["--min-samples", "1", "--max-samples", "1", "--min-time-s", "0", "--max-time-s", "0",
                 "--warmup-s", "0", "--max-warmup", "1"]
_PARENT_ONLY = {"--metrics": 0, "--out": 1, "--metrics-child": 1, "--min-samples": 1, "--max-samples": 1,
                "--min-time-s": 1, "--max-time-s": 1, "--warmup-s": 1, "--max-warmup": 1}


def child_arguments(argv, out_dir, map_file):
    """argv without --metrics / --out / the measurement options, plus the child's."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in _PARENT_ONLY:
            skip = _PARENT_ONLY[name] if "=" not in a else 0
            continue
        out.append(a)
    return out + ["--out", str(out_dir), "--metrics-child", str(map_file)] + CHILD_MEASURE


IDENTITY = ("family", "op", "variant", "backend", "dtype", "shape_label", "direction", "threads", "case", "causal",
            "varlen", "activation", "cache_dtype", "page_size")


def row_key(row):
    return json.dumps({k: row.get(k) for k in IDENTITY if k in row}, sort_keys=True)


def run_child(ncu, script, argv, cc, log):
    """Runs the child under ncu; returns (kernel segments, the child's map, requested metrics) or raises
    RuntimeError with the reason."""
    requested = metric_set(cc)
    refused = []
    work = pathlib.Path(tempfile.mkdtemp(prefix="optimized-metrics-"))
    csv_path, map_path = work / "run.csv", work / "map.json"
    for attempt in range(2):
        cmd = ncu_arguments(ncu, requested, csv_path) + [sys.executable, str(script)] + child_arguments(
            argv, work / "out", map_path)
        log("--metrics: " + " ".join(shlex.quote(c) for c in cmd))
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        text = csv_path.read_text(errors="replace") if csv_path.exists() else ""
        unknown = unknown_metrics(text + "\n" + proc.stdout)
        if unknown and attempt == 0:
            gone = [m for m in requested if any(m == u or m.startswith(u + ".") for u in unknown)]
            refused += gone
            requested = [m for m in requested if m not in gone]
            continue
        if not map_path.exists():
            tail = " | ".join((proc.stdout + "\n" + text).strip().splitlines()[-4:])
            raise RuntimeError(f"the child under ncu wrote no row map (exit {proc.returncode}; {work}): {tail}")
        # ncu writes its CSV to --log-file; should a version print it to stdout instead, it is there.
        try:
            kernels = parse_csv(text if '"ID"' in text else proc.stdout)
        except ValueError as e:  # ncu profiled nothing: its own words say why (e.g. ERR_NVGPUCTRPERM)
            tail = " | ".join(l for l in (text + "\n" + proc.stdout).strip().splitlines() if "==" in l)[-600:]
            raise RuntimeError(f"{e} (exit {proc.returncode}; {work}): {tail}") from e
        mapping = json.loads(map_path.read_text())
        shutil.rmtree(work, ignore_errors=True)  # kept (named in the reason) when something failed
        return split_segments(kernels), mapping, requested + refused
    raise RuntimeError("ncu refused the metric set twice")


def attach(report, argv, script, log, device):
    """The parent's side: every row (and ceiling) of `report` gets its `metrics` object."""
    rows = report["results"]
    if device != "cuda":
        for r in rows:
            r["metrics"] = skipped("CPU run: no GPU counters")
        return
    ncu = find_ncu()
    if not ncu:
        reason = ncu_missing_reason()
        log(f"benchmark_all: --metrics: {reason}")
        report["notes"].append("--metrics: " + reason)
        for r in rows:
            r["metrics"] = skipped("CPU row: no GPU counters" if r.get("backend") == "cpu" else reason)
        return
    import torch
    major, minor = torch.cuda.get_device_capability(0)
    cc = major * 10 + minor
    try:
        segments, mapping, requested = run_child(ncu, script, argv, cc, log)
    except (RuntimeError, ValueError, OSError) as e:
        for r in rows:
            r["metrics"] = failed(str(e))
        return
    profiled = mapping["profiled"]  # measurement ids in the order their segments appear

    def metrics_of(measure, min_bytes):
        if measure is None or measure not in profiled:
            return skipped("no profiled measurement of this row in the child")
        i = profiled.index(measure)
        if i >= len(segments):
            return failed(f"ncu listed {len(segments)} marked measurements, the child profiled {len(profiled)}")
        return summarize(segments[i], min_bytes, requested, cc)

    child_rows = {}
    for entry in mapping["rows"]:
        child_rows.setdefault(entry["key"], []).append(entry)
    seen = {}
    for r in rows:
        if r.get("status") != "ok":
            r["metrics"] = skipped(f"the row did not run ({r.get('status')})")
            continue
        if r.get("backend") == "cpu" or r.get("device") == "cpu":
            r["metrics"] = skipped("CPU row: no GPU counters")
            continue
        key = row_key(r)
        n = seen.get(key, 0)
        seen[key] = n + 1
        entries = child_rows.get(key, [])
        entry = entries[n] if n < len(entries) else {}
        r["metrics"] = metrics_of(entry.get("measure"), r.get("min_bytes") or 0)
        base = r.get("baseline")
        if isinstance(base, dict) and entry.get("baseline_measure") is not None:  # the peer timed beside it
            base["metrics"] = metrics_of(entry["baseline_measure"], r.get("min_bytes") or 0)
    for c in report.get("ceilings", []):
        m = mapping.get("ceilings", {}).get(c["name"])
        if m is None:
            continue
        if m in profiled and profiled.index(m) < len(segments) and not segments[profiled.index(m)]:
            # a ceiling measured by a driver call, e.g. the device copy (torch's contiguous copy_ is a
            # cudaMemcpyAsync): no kernel for ncu to profile
            c["metrics"] = skipped("no kernel in the measurement (a cudaMemcpyAsync device-to-device copy: the "
                                   "driver's, not a kernel ncu profiles)")
        else:
            c["metrics"] = metrics_of(m, c.get("bytes") or 0)
    report["notes"].append(f"--metrics: Nsight Compute ({ncu}), one profiled call of each measurement in a child "
                           "process; memory_efficiency = min_bytes / (DRAM bytes read + written)")
