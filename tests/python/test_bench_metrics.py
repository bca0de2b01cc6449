"""The Python runner's --metrics (bench/ncu_metrics.py, issue 23) and render_results' metrics columns:
ncu's CSV parsed from captured samples, the measurement segments cut at the marker kernel, the row
summary (sums, duration-weighted means, memory_efficiency), absent metrics absent (never 0), the
skipped paths (no ncu, CPU run), the parent's matching of rows through a stand-in ncu; and on the GPU
machine with ncu the counters themselves (skipped elsewhere, with the reason)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import ncu_metrics as nm  # noqa: E402


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_results_for_tests", ROOT / "scripts" / "render_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rr = _load_renderer()

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum",'
          '"launch__registers_per_thread","sm__warps_active.avg.pct_of_peak_sustained_active",'
          '"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",'
          '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
          '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"')
UNITS = '"","","","","","","","","","","","byte","byte","nsecond","register/thread","%","%","",""'


def kernel_line(i, name, rd, wr, ns, regs, occ, hmma, lsb, bar):
    return (f'"{i}","77","python3","h","{name}","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","{rd}","{wr}","{ns}",'
            f'"{regs}","{occ}","{hmma}","{lsb}","{bar}"')


# A child's log: ncu's lines, then two measurements, each opened by the marker kernel.
SAMPLE = "\n".join([
    "==PROF== Connected to process 77 (/usr/bin/python3.12)",
    '==PROF== Profiling "spin_kernel": 0%....50%....100% - 9 passes',
    HEADER, UNITS,
    kernel_line(0, "spin_kernel(long)", "0", "0", "1,000", "16", "1", "0", "0", "0"),
    kernel_line(1, "void copy_kernel<float>(Params)", "268,435,456", "268,435,456", "190,000", "32", "90.0", "n/a",
                "9.5", "0.1"),
    kernel_line(2, "spin_kernel(long)", "0", "0", "1,000", "16", "1", "0", "0", "0"),
    kernel_line(3, "gemm_naive(float const*)", "3,000,000", "1,000,000", "3,000", "40", "80.0", "0", "12.0", "1.0"),
    kernel_line(4, "gemm_reduce(float*)", "1,000,000", "1,000,000", "1,000", "72", "40.0", "n/a", "4.0", "5.0"),
    "==PROF== Disconnected from process 77",
])


def test_parse_csv_base_units_and_absent():
    ks = nm.parse_csv(SAMPLE)
    assert len(ks) == 5
    assert ks[1]["values"]["dram__bytes_read.sum"] == 268435456  # thousands separators dropped
    assert nm.HMMA not in ks[1]["values"] and nm.HMMA in ks[1]["absent"]  # "n/a": absent, not 0


def test_parse_csv_scales_auto_units():
    text = "\n".join(['"ID","Kernel Name","dram__bytes_read.sum","gpu__time_duration.sum"', '"","","Mbyte","usecond"',
                      '"0","k","268.44","181.25"'])
    k = nm.parse_csv(text)[0]
    assert k["values"]["dram__bytes_read.sum"] == pytest.approx(268.44e6)
    assert k["values"]["gpu__time_duration.sum"] == pytest.approx(181250)


def test_parse_csv_without_header_raises():
    with pytest.raises(ValueError):
        nm.parse_csv("==PROF== Connected\n==ERROR== the application returned an error code (1)\n")


def test_segments_cut_at_the_marker():
    segs = nm.split_segments(nm.parse_csv(SAMPLE))
    assert [len(s) for s in segs] == [1, 2]
    assert segs[1][1]["name"] == "gemm_reduce(float*)"


def test_summary_of_a_segment():
    seg = nm.split_segments(nm.parse_csv(SAMPLE))[1]
    j = nm.summarize(seg, 2.5e6, nm.metric_set(90), 90)
    assert j["status"] == "ok" and j["kernels"] == 2 and j["arch"] == "sm_90"
    assert j["dram_bytes"] == 6e6
    assert j["memory_efficiency"] == pytest.approx(2.5e6 / 6e6)
    assert j["achieved_occupancy_pct"] == pytest.approx((80 * 3 + 40 * 1) / 4)  # duration-weighted
    assert j["tensor_pipe_pct"] == 0  # only the kernel that has it
    assert j["registers_per_thread"] == 72
    assert [s["reason"] for s in j["top_stalls"]] == ["long_scoreboard", "barrier"]
    assert j["top_stalls"][0]["warps_per_issue"] == pytest.approx((12 * 3 + 4) / 4)
    assert "l2_bytes" not in j and "lts__t_bytes.sum" in j["absent"]  # never asked of ncu here: absent
    assert nm.GMMA in j["absent"]


def test_memory_efficiency_arithmetic():
    assert nm.memory_efficiency(2e9, 1e9, 1e9) == 1.0
    assert nm.memory_efficiency(1e9, 3e9, 1e9) == 0.25
    assert nm.memory_efficiency(1e9, None, 1e9) is None
    assert nm.memory_efficiency(1e9, 0.0, 0.0) is None
    assert nm.memory_efficiency(0, 1e9, 1e9) is None


def test_metric_set_matches_the_cpp_driver():
    """bench/metrics.cpp and bench/ncu_metrics.py ask ncu for the same names."""
    cpp = (ROOT / "bench" / "metrics.cpp").read_text()
    for name in nm.metric_set(90):
        if name.startswith("smsp__average_warps_issue_stalled_"):
            assert "smsp__average_warps_issue_stalled_" in cpp
            reason = name.removeprefix("smsp__average_warps_issue_stalled_").removesuffix("_per_issue_active.ratio")
            assert f'"{reason}"' in cpp, reason
        else:
            assert f'"{name}"' in cpp, name
    assert nm.GMMA not in nm.metric_set(80) and nm.HMMA in nm.metric_set(80)


def test_unknown_metrics_and_child_arguments():
    assert nm.unknown_metrics("==ERROR== Failed to find metric sm__foo.sum\n==PROF== x\n") == ["sm__foo.sum"]
    regex_form = ("==ERROR== Failed to find metric regex:^flop_count_sp\\.(sum|min|max|avg|pct|ratio|max_rate)$\n"
                  "==ERROR== Failed to find metric regex:^lts__t_bytes\\.sum$\n")
    assert nm.unknown_metrics(regex_form) == ["flop_count_sp", "lts__t_bytes.sum"]
    args = nm.child_arguments(["--ops", "matmul", "--metrics", "--out", "r", "--min-samples=5", "--quick"],
                              "/t/out", "/t/map.json")
    assert args[:3] == ["--ops", "matmul", "--quick"]
    assert args[3:7] == ["--out", "/t/out", "--metrics-child", "/t/map.json"]
    assert "--metrics" not in args and "r" not in args and "--min-samples=5" not in args


def _report():
    rows = [{"family": "matmul", "op": "matmul", "variant": "naive", "backend": "cuda", "dtype": "fp32",
             "shape_label": "64x64x64", "status": "ok", "min_bytes": 3e6, "time_ms": {"median": 1.0}},
            {"family": "matmul", "op": "matmul", "variant": "tiled", "backend": "cuda", "dtype": "fp32",
             "shape_label": "64x64x64", "status": "failed", "reason": "validation"}]
    return {"results": rows, "notes": [], "ceilings": [{"name": "device_copy", "bytes": 2 ** 29}]}


def test_attach_without_ncu_skips_every_row(monkeypatch):
    monkeypatch.setenv("OPTIMIZED_NCU", "/nonexistent/ncu")
    rep = _report()
    nm.attach(rep, [], ROOT / "bench" / "benchmark_all.py", lambda m: None, "cuda")
    assert all(r["metrics"]["status"] == "skipped" and "OPTIMIZED_NCU" in r["metrics"]["reason"]
               for r in rep["results"])
    cpu_row = dict(rep["results"][0], backend="cpu")
    rep2 = dict(rep, results=[cpu_row], notes=[])
    nm.attach(rep2, [], ROOT / "bench" / "benchmark_all.py", lambda m: None, "cuda")
    assert cpu_row["metrics"] == {"status": "skipped", "reason": "CPU row: no GPU counters"}
    assert any("--metrics" in n for n in rep["notes"])
    monkeypatch.delenv("OPTIMIZED_NCU")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert nm.find_ncu() == ""
    assert "PATH" in nm.ncu_missing_reason()


def test_attach_on_the_cpu_skips():
    rep = _report()
    nm.attach(rep, [], ROOT / "bench" / "benchmark_all.py", lambda m: None, "cpu")
    assert {r["metrics"]["status"] for r in rep["results"]} == {"skipped"}


def test_attach_matches_rows_through_a_stand_in_ncu(tmp_path, monkeypatch):
    """A fake ncu: writes the captured CSV to --log-file and the child's map to --metrics-child."""
    rep = _report()
    key = nm.row_key(rep["results"][0])
    (tmp_path / "sample.csv").write_text(SAMPLE)
    rep["results"][0]["baseline"] = {"name": "torch.matmul", "time_ms": {"median": 0.5}}
    (tmp_path / "map.json").write_text(json.dumps({"profiled": [0, 1], "rows": [{"key": key, "measure": 1,
                                                                                  "baseline_measure": 0}],
                                                   "ceilings": {"device_copy": 0}}))
    fake = tmp_path / "ncu"
    fake.write_text(f"""#!{sys.executable}
import shutil, sys
a = sys.argv
shutil.copy({str(tmp_path / 'sample.csv')!r}, a[a.index('--log-file') + 1])
shutil.copy({str(tmp_path / 'map.json')!r}, a[a.index('--metrics-child') + 1])
""")
    fake.chmod(0o755)
    monkeypatch.setenv("OPTIMIZED_NCU", str(fake))
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    nm.attach(rep, ["--ops", "matmul", "--metrics"], ROOT / "bench" / "benchmark_all.py", lambda m: None, "cuda")
    m = rep["results"][0]["metrics"]
    assert m["status"] == "ok", m
    assert m["dram_bytes"] == 6e6 and m["memory_efficiency"] == pytest.approx(0.5)
    assert rep["results"][1]["metrics"]["status"] == "skipped"  # failed rows are not profiled
    assert rep["results"][0]["baseline"]["metrics"]["dram_bytes"] == 2 ** 29  # the peer's own measurement
    copy = rep["ceilings"][0]["metrics"]
    assert copy["dram_bytes"] == 2 ** 29 and copy["memory_efficiency"] == 1.0


# ---- render_results ------------------------------------------------------------------------------------------

def _row(variant, metrics=None):
    r = {"op": "matmul", "variant": variant, "backend": "cuda", "dtype": "fp32", "shape_label": "64x64x64",
         "status": "ok", "time_ms": {"median": 1.0, "p10": 0.9, "p90": 1.1, "cv": 0.01}, "tflops": 1.0, "gbps": 2.0,
         "roofline_fraction": 0.5}
    if metrics is not None:
        r["metrics"] = metrics
    return r


OK = {"status": "ok", "achieved_occupancy_pct": 62.5, "dram_bytes": 1.5e9, "memory_efficiency": 0.25,
      "tensor_pipe_pct": 40.0, "registers_per_thread": 128, "dram_throughput_pct": 71.0, "l2_bytes": 3e9,
      "local_bytes": 0, "top_stalls": [{"reason": "long_scoreboard", "warps_per_issue": 3.5}]}


def test_render_tables_unchanged_without_metrics():
    plain = rr.results_table([_row("naive")])
    skipped = rr.results_table([_row("naive", {"status": "skipped", "reason": "no ncu"})])
    assert plain == skipped  # a run whose ncu was absent renders as before
    assert "achieved occupancy" not in plain


def test_render_tables_gain_the_metric_columns():
    t = rr.results_table([_row("naive", OK), _row("tiled", {"status": "skipped", "reason": "no ncu"})])
    head, sep, first, second = t.splitlines()
    assert head.endswith("| achieved occupancy | DRAM bytes | memory efficiency | tensor pipe |")
    assert head.count("|") == first.count("|") == second.count("|") == sep.count("|")
    assert "| 62.5% | 1.5 GB | 0.25 | 40% |" in first
    assert second.endswith("| skipped | - | - | - |")
    f = rr.fused_rows_table([dict(_row("auto", OK), direction="fwd")])
    assert "| 62.5% | 1.5 GB | 0.25 | 40% |" in f


def test_metrics_table_block(tmp_path):
    d = tmp_path / "h100"
    d.mkdir()
    data = {"schema": rr.SCHEMA, "machine": {"gpu_key": "h100"}, "results": [_row("naive", OK), _row("tiled")]}
    (d / "matmul.json").write_text(json.dumps(data))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "x.md").write_text("a\n<!-- generated: metrics-table file=matmul machine=h100 op=matmul -->\n"
                                "old\n<!-- end generated -->\nb\n")
    rr.refresh_generated_blocks(tmp_path, notes)
    text = (notes / "x.md").read_text()
    assert "\nold\n" not in text and "long_scoreboard 3.5" in text and "| 62.5% | 1.5 GB | 0.25 | 71% | 3 GB | 40% |" in text
    assert "no counters: not collected (run with --metrics)" in text


# ---- on the GPU machine ------------------------------------------------------------------------------------

def _gpu_reason():
    try:
        import torch
        if not torch.cuda.is_available():
            return "no CUDA device visible to torch: the hardware counters need the GPU machine"
    except ImportError:
        return "torch not importable"
    if not nm.find_ncu():
        return nm.ncu_missing_reason()
    return ""


GPU_REASON = _gpu_reason()


@pytest.mark.skipif(bool(GPU_REASON), reason=GPU_REASON or "GPU and ncu present")
def test_gpu_one_pass_bytes_and_gemm_ladder(tmp_path):
    """The one-pass softmax (bf16 16384 x 8192: auto reads x once and writes y once, 2 R W E bytes, known
    exactly) counts within 5% of its bytes; the naive GEMM moves more DRAM bytes per useful byte than the
    register-tiled rung. The device-copy ceiling is a cudaMemcpyAsync, no kernel: it says so."""
    def run(*args):
        out = tmp_path / args[1]
        cmd = [sys.executable, str(ROOT / "bench" / "benchmark_all.py"), *args, "--quick", "--metrics",
               "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        [path] = list(out.glob(f"*/python-{args[1]}.json"))
        return json.loads(path.read_text())

    rep = run("--ops", "fused", "--fused-ops", "softmax", "--directions", "fwd", "--dtypes", "bf16",
              "--shapes", "16384x8192", "--variants", "auto", "--no-liger", "--no-compile")
    rows = [r for r in rep["results"] if r["variant"] == "auto" and r["status"] == "ok"]
    assert rows, rep["results"]
    for r in rows:
        assert r["metrics"]["status"] == "ok", r["metrics"]
        assert r["metrics"]["dram_bytes"] / (2 * 16384 * 8192 * 2) == pytest.approx(1.0, abs=0.05), r["metrics"]
    copy = next(c for c in rep["ceilings"] if c["name"] == "device_copy")
    assert copy["metrics"]["status"] == "skipped" and "cudaMemcpyAsync" in copy["metrics"]["reason"]
    rep = run("--ops", "matmul", "--shapes", "4096", "--dtypes", "fp32", "--variants", "naive,register_tiled")
    eff = {r["variant"]: r["metrics"].get("memory_efficiency") for r in rep["results"]
           if r["status"] == "ok" and r.get("metrics", {}).get("status") == "ok"}
    assert eff.get("naive") and eff.get("register_tiled"), rep["results"]
    assert eff["naive"] < eff["register_tiled"]


def test_child_run_maps_rows_to_measurements(tmp_path):
    """The child's side on the CPU: the run writes its map, each timed row tied to its own measurement
    (nothing profiled: no GPU), and its outputs go to --out."""
    env = dict(os.environ)
    cmd = [sys.executable, str(ROOT / "bench" / "benchmark_all.py"), "--device", "cpu", "--ops", "matmul",
           "--shapes", "32", "--dtypes", "fp32", "--variants", "cpu_naive,cpu_blocked",
           *nm.child_arguments(["--metrics"], tmp_path / "out", tmp_path / "map.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mapping = json.loads((tmp_path / "map.json").read_text())
    assert mapping["profiled"] == []
    [out] = list((tmp_path / "out").glob("*/python-matmul.json"))
    rows = json.loads(out.read_text())["results"]
    timed = [e for e, r in zip(mapping["rows"], rows) if r["status"] == "ok"]
    assert len(timed) >= 2
    measures = [e["measure"] for e in timed]
    assert None not in measures and len(set(measures)) == len(measures)
    assert mapping["ceilings"]["host_copy"] is not None
    assert all("_measure" not in json.dumps(r) for r in rows)  # the tag stays out of the JSON


def test_attach_reports_ncus_own_failure(tmp_path, monkeypatch):
    """ncu ran the child but profiled nothing (no permission to the counters): every row says so, in ncu's words."""
    rep = _report()
    fake = tmp_path / "ncu"
    fake.write_text(f"""#!{sys.executable}
import json, sys
a = sys.argv
open(a[a.index('--log-file') + 1], 'w').write(
    '==PROF== Connected to process 1\\n==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access '
    'NVIDIA GPU Performance Counters on the target device 0.\\n')
open(a[a.index('--metrics-child') + 1], 'w').write(json.dumps({{"profiled": [0], "rows": [], "ceilings": {{}}}}))
""")
    fake.chmod(0o755)
    monkeypatch.setenv("OPTIMIZED_NCU", str(fake))
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    nm.attach(rep, ["--ops", "matmul", "--metrics"], ROOT / "bench" / "benchmark_all.py", lambda m: None, "cuda")
    for r in rep["results"]:
        assert r["metrics"]["status"] == "failed" and "ERR_NVGPUCTRPERM" in r["metrics"]["reason"]
