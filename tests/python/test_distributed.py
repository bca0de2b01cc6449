"""optimized_ops.distributed: every parallel layer against its single-process layer, forward and gradients, for world
sizes 1, 2 and 4 on the CPU with gloo (one job of W processes per world size runs every case of
tests/python/distributed_worker.py on one process group; each case is reported as its own test here), and on 2 GPUs
with NCCL (skipped with the reason where fewer than 2 CUDA devices are visible). A failed rank (dead, or alive but
not taking part) makes the others stop with DistributedError within the process group's timeout.

The cases (distributed_worker.py): expert parallelism (float32: the MoE ops have no float64 path; against the
single-GPU nn.MoE, itself checked against float64 by test_moe_layer.py) with uneven token splits, a rank with no
tokens, experts with no tokens, capacity mode dropping pairs, sigmoid top-1, overlap on and off, the point-to-point
all-to-all fallback, nn.MoE(process_group=...); tensor parallelism in float64 against the float64 single-process
modules (column / row linear, SwiGLU MLP, GQA attention, a sequence-parallel block, a whole Transformer);
data parallelism (DDP gradients of a Transformer in float64 against the full batch; train_data_parallel stopped and
resumed against an uninterrupted run, a checkpoint refusing another world size).

The benchmark (bench/benchmark_distributed.py) runs once on 2 CPU ranks under torch.distributed.run (--quick, with
--profile): its rows and each rank's profile are written.

The subprocesses find the package and the library as this process did (the imported package's root on PYTHONPATH,
OPTIMIZED_OPS_LIBRARY = optimized_ops.library_path()), rendezvous through a file (no port to pick), and run with
NVLink multicast forced off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

import optimized_ops
from optimized_ops.distributed import NO_MULTICAST_ENV

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"
PACKAGE_ROOT = pathlib.Path(optimized_ops.__file__).resolve().parent.parent
JOB_TIMEOUT_S = 240

sys.path.insert(0, str(HERE))
import distributed_worker  # noqa: E402  (the case names)

CASE_NAMES = list(distributed_worker.CASES)


def _env(rank, world, init_file, extra=None):
    env = dict(os.environ)
    env.update(NO_MULTICAST_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OPTIMIZED_OPS_LIBRARY"] = optimized_ops.library_path()
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), DIST_INIT_FILE=str(init_file),
               OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


def run_job(world, tmp, *args, extra_env=None, timeout=JOB_TIMEOUT_S):
    """W worker processes; returns ([rank reports], [(returncode, output)], seconds)."""
    tmp = pathlib.Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    init = tmp / "rendezvous"
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--out", str(tmp), *args], cwd=str(HERE.parents[1]),
                              env=_env(r, world, init, extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    t0 = time.perf_counter()
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seconds = time.perf_counter() - t0
    reports = []
    for r in range(world):
        f = tmp / f"rank{r}.json"
        reports.append(json.loads(f.read_text()) if f.exists() else None)
    return reports, outs, seconds


_JOBS: dict = {}


def job(world, backend, tmp_path_factory):
    key = (world, backend)
    if key not in _JOBS:
        args = ["--backend", backend, "--device", "cuda" if backend == "nccl" else "cpu", "--timeout-s", "60"]
        _JOBS[key] = run_job(world, tmp_path_factory.mktemp(f"dist-{backend}-{world}"), *args)
    return _JOBS[key]


def _check_case(world, backend, case, tmp_path_factory):
    reports, outs, _ = job(world, backend, tmp_path_factory)
    tail = "\n".join(o[-3000:] for _, o in outs)
    for r, rep in enumerate(reports):
        assert rep is not None, f"rank {r} of {world} wrote no report:\n{tail}"
        assert rep["env"] == NO_MULTICAST_ENV, rep["env"]
        res = rep["results"].get(case)
        assert res is not None, f"rank {r}: case {case} did not run:\n{tail}"
        assert res["status"] == "ok", f"rank {r} of {world} ({backend}): {case}:\n{res['status']}"


@pytest.mark.parametrize("case", CASE_NAMES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gloo_cpu(world, case, tmp_path_factory):
    _check_case(world, "gloo", case, tmp_path_factory)


def _two_gpus_reason():
    if not optimized_ops.built_with_cuda():
        return "liboptimized_ops was built without CUDA"
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA devices; {torch.cuda.device_count()} visible"
    return ""


TWO_GPUS = _two_gpus_reason()


@pytest.mark.skipif(bool(TWO_GPUS), reason=TWO_GPUS or "2 GPUs")
@pytest.mark.parametrize("case", CASE_NAMES)
def test_nccl_two_gpus(case, tmp_path_factory):
    _check_case(2, "nccl", case, tmp_path_factory)


@pytest.mark.parametrize("kind", ["dead", "hung"])
def test_failed_rank_stops_the_others_with_an_error(kind, tmp_path):
    """Rank 1 exits (dead) or sleeps past the timeout (hung) while rank 0 runs an expert-parallel forward: rank 0
    raises DistributedError naming the collective and its rank, within the timeout (no hang)."""
    timeout = 3.0
    reports, outs, seconds = run_job(2, tmp_path, "--failure", kind, "--timeout-s", str(timeout),
                                     extra_env={"HANG_S": str(timeout + 3)}, timeout=60)
    tail = "\n".join(o[-3000:] for _, o in outs)
    rep = reports[0]
    assert rep is not None, tail
    res = rep["results"]["failure"]
    assert res["status"] == "ok", res["status"]
    assert "optimized_ops.distributed: all_gather failed on rank 0 of 2" in res["error"], res["error"]
    assert "a peer rank failed, left early or timed out" in res["error"], res["error"]
    assert res["seconds"] < timeout + 10, res
    if kind == "dead":
        assert outs[1][0] == 3
    assert seconds < 60


def test_no_multicast_env_is_forced(monkeypatch):
    for k in NO_MULTICAST_ENV:
        monkeypatch.setenv(k, "1" if k == "NCCL_NVLS_ENABLE" else "0")
    env = optimized_ops.distributed.force_no_multicast_env()
    assert {k: env[k] for k in NO_MULTICAST_ENV} == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                                      "NVSHMEM_DISABLE_NVLS": "1"}


def test_single_process_moe_is_unchanged():
    """nn.MoE without a process group: the same parameters, state_dict keys and output as moe_layer."""
    torch.manual_seed(0)
    moe = optimized_ops.nn.MoE(16, 8, 4, 2)
    assert moe.process_group is None and moe.w13.shape == (4, 16, 16)
    assert list(moe.state_dict()) == ["w13", "w2", "router.weight"]
    x = torch.randn(5, 16)
    want, _ = optimized_ops.moe_layer(x, moe.router.weight, moe.w13, moe.w2, 2)
    assert torch.equal(moe(x), want)


def test_checkpoints_hold_the_bare_model_names():
    """train_from_nvme saves DDP's inner model (no ``module.`` prefix) and still loads old DDP checkpoints."""
    from optimized_ops.models.training import _without_ddp_prefix
    bare = torch.nn.Linear(2, 3)
    old = {"module." + k: v for k, v in bare.state_dict().items()}
    assert list(_without_ddp_prefix(old, bare)) == ["weight", "bias"]
    wrapper = torch.nn.Sequential()
    wrapper.module = torch.nn.Linear(2, 3)  # a model whose own names start with "module."
    own = wrapper.state_dict()
    assert list(_without_ddp_prefix(own, wrapper)) == list(own)


def _torchrun_benchmark(nproc, tmp_path, *args, timeout=JOB_TIMEOUT_S):
    """bench/benchmark_distributed.py under torch.distributed.run with ``nproc`` CPU ranks (gloo); returns the
    completed process."""
    env = _env(0, nproc, tmp_path / "unused")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DIST_INIT_FILE"):
        env.pop(k)
    import socket
    with socket.socket() as sock:  # a free port for the rendezvous (port 0 is not shared between the ranks)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(port), str(HERE.parents[1] / "bench" / "benchmark_distributed.py"),
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(HERE.parents[1]))


def test_benchmark_runs_two_ranks_and_profiles(tmp_path):
    """bench/benchmark_distributed.py under torch.distributed.run on the CPU (gloo, 2 ranks, --quick): every case
    writes its rows (the ratio to one process), and --profile writes each rank's trace and table."""
    out, prof = tmp_path / "out", tmp_path / "prof"
    proc = _torchrun_benchmark(2, tmp_path, "--quick", "--device", "cpu", "--profile", str(prof), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [report] = list(out.glob("*/python-distributed.json"))
    rows = json.loads(report.read_text())["results"]
    assert rows and all(r["status"] in ("ok", "skipped") for r in rows), [(r.get("variant"), r["status"]) for r in rows]
    assert any(r.get("vs_baseline") for r in rows), "no row measured against one process"
    for r in rows:  # strong scaling (the default): the efficiency is the speedup over N
        assert r["scaling"] == "strong"
        if r.get("vs_baseline"):
            assert r["scaling_efficiency"] == pytest.approx(r["vs_baseline"] / 2, rel=1e-12)
    for r in range(2):
        assert (prof / f"ddp-rank{r}.json").stat().st_size > 0
        text = (prof / f"ddp-rank{r}.txt").read_text()
        assert "ms per step" in text and "Self CPU" in text, text[:500]


def _load_script(path, name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_shape_presets_and_explicit_flags(monkeypatch):
    """--ep-shape deepseek sets 64 experts top-8, d_model 2048, d_ff 1408; a flag given explicitly wins over the preset
    and over --quick; --scaling defaults to strong."""
    for k in NO_MULTICAST_ENV:  # the module forces these at import: restored after the test
        monkeypatch.setenv(k, os.environ.get(k, ""))
    bench = _load_script(HERE.parents[1] / "bench" / "benchmark_distributed.py", "benchmark_distributed_presets")
    a = bench.parse_args(["--scaling", "weak", "--ep-shape", "deepseek"])
    assert (a.scaling, a.ep_experts, a.ep_top_k, a.ep_d_model, a.ep_d_ff, a.ep_tokens) == ("weak", 64, 8, 2048, 1408,
                                                                                             16384)
    a = bench.parse_args(["--ep-shape", "deepseek", "--ep-top-k", "4", "--ep-d-ff", "512"])
    assert (a.scaling, a.ep_experts, a.ep_top_k, a.ep_d_model, a.ep_d_ff) == ("strong", 64, 4, 2048, 512)
    a = bench.parse_args(["--quick", "--ep-tokens", "100", "--min-samples", "2"])
    assert (a.ep_tokens, a.ep_experts, a.ep_d_model, a.min_samples, a.max_samples) == (100, 8, 256, 2, 10)
    a = bench.parse_args(["--quick", "--ep-shape", "deepseek"])
    assert (a.ep_experts, a.ep_top_k) == (64, 8) and a.ep_d_model < 2048
    a = bench.parse_args([])
    assert (a.scaling, a.ep_experts, a.ep_top_k, a.ep_d_model, a.ep_d_ff) == ("strong", 16, 2, 4096, 14336)


# weak mode on the CPU: tiny shapes (the DeepSeek preset's routing, 64 experts top-8), a few samples
WEAK_T = 64
WEAK_ARGS = ["--quick", "--device", "cpu", "--scaling", "weak", "--ep-shape", "deepseek", "--ep-tokens", str(WEAK_T),
             "--ep-d-model", "64", "--ep-d-ff", "64", "--tp-tokens", str(WEAK_T), "--tp-d-model", "64", "--tp-d-ff",
             "128", "--ddp-batch", "2", "--ddp-seq", "32", "--min-samples", "2", "--max-samples", "3",
             "--min-time-s", "0", "--warmup", "1"]


def _check_weak_report(report, w):
    """The rows of one weak-scaling run of world size w: per-GPU baselines, the efficiency formula, the shares."""
    assert report["machine"]["world_size"] == w and report["machine"]["results_key"] == "cpu"
    rows = report["results"]
    assert rows and all(r["scaling"] == "weak" and r["status"] == "ok" for r in rows), \
        [(r["variant"], r["status"], r["reason"]) for r in rows]
    per_gpu = {"ep": WEAK_T, "tp": WEAK_T, "ddp": 2 * 32}
    parallel = [r for r in rows if r["role"] == "parallel"]
    assert {(r["case"], r["series"]) for r in parallel} == {("ep", "EP"), ("ep", "EP overlap"), ("tp", "TP"),
                                                            ("ddp", "DDP")}
    for r in rows:
        if r["role"] == "baseline":  # one GPU on one GPU's share
            assert r["world_size"] == 1 and r["tokens"] == per_gpu[r["case"]], r
            assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["time_ms"]["median"] * 1e-3), rel=1e-12)
    for r in parallel:
        assert r["world_size"] == w and r["tokens"] == w * per_gpu[r["case"]], r
        assert r["validation"]["passed"] is True, r["validation"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["time_ms"]["median"] * 1e-3), rel=1e-12)
        base = next(b for b in rows if b["role"] == "baseline" and b["case"] == r["case"]
                    and b["direction"] == r["direction"])
        assert r["baseline"]["tokens_per_s"] == base["tokens_per_s"]
        eff = r["tokens_per_s"] / (w * base["tokens_per_s"])
        assert r["scaling_efficiency"] == pytest.approx(eff, rel=1e-12) and eff > 0
        assert r["vs_baseline"] == pytest.approx(base["time_ms"]["median"] / r["time_ms"]["median"], rel=1e-12)
        key = {"ep": "a2a_share", "tp": "allreduce_share", "ddp": "allreduce_share"}[r["case"]]
        if r["series"] == "EP overlap":
            continue
        comm = [c for c in rows if c["role"] == "comm" and c["case"] == r["case"] and c["direction"] == r["direction"]]
        if w == 1:  # no communication: share 0, nothing timed
            assert r[key] == 0.0 and not comm
        else:
            [c] = comm
            assert r[key] == pytest.approx(c["time_ms"]["median"] / r["time_ms"]["median"], rel=1e-12) and r[key] > 0
            assert c[key] == r[key]
            if r["case"] == "tp":  # the forward's all-reduce of (N T, d) fp32, and the backward's in fwd+bwd
                assert c["allreduce_bytes"] == [w * WEAK_T * 64 * 4] * (2 if r["direction"] == "fwd+bwd" else 1)
            if r["case"] == "ddp":  # DDP's buckets: every fp32 gradient once
                assert sum(c["allreduce_bytes"]) == r["shape"]["parameters"] * 4
    ep = next(r for r in parallel if r["case"] == "ep")
    assert (ep["shape"]["experts"], ep["shape"]["top_k"]) == (64, 8)


def test_benchmark_weak_scaling_and_plot(tmp_path):
    """--scaling weak on 1 and 2 CPU ranks writes python-distributed-weak-w1.json / -w2.json side by side (the
    baselines on one GPU's share, scaling_efficiency = tokens/s(N) / (N x tokens/s(baseline)), validation passed,
    a2a_share for ep and allreduce_share for tp and ddp, 0 at one rank); scripts/plot_scaling.py on that folder
    writes scaling.json / .md (and .png where matplotlib is installed) with the rows' numbers."""
    out = tmp_path / "out"
    reports = {}
    for w in (1, 2):
        proc = _torchrun_benchmark(w, tmp_path, *WEAK_ARGS, "--out", str(out), timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        folder = out / "cpu"
        assert (folder / f"python-distributed-weak-w{w}.md").read_text().count("| ep |") == 4
        reports[w] = json.loads((folder / f"python-distributed-weak-w{w}.json").read_text())
        _check_weak_report(reports[w], w)
    assert not list(out.glob("*/python-distributed.json"))  # strong mode's name is left alone

    plot = _load_script(HERE.parents[1] / "scripts" / "plot_scaling.py", "plot_scaling")
    written = plot.run(folder)
    summary = json.loads((folder / "scaling.json").read_text())
    assert summary["world_sizes"] == [1, 2] and summary["files"] == ["python-distributed-weak-w1.json",
                                                                     "python-distributed-weak-w2.json"]
    series = {(s["case"], s["direction"], s["series"]): s for s in summary["series"]}
    want = {(r["case"], r["direction"], r["series"]) for rep in reports.values() for r in rep["results"]
            if r["role"] == "parallel"}
    assert set(series) == want and len(want) == 7  # ep x2 directions x2 layouts, tp x2 directions, ddp
    md = (folder / "scaling.md").read_text()
    for key, s in series.items():
        ref = next(r for r in reports[1]["results"] if r["role"] == "baseline" and r["case"] == key[0]
                   and r["direction"] == key[1])["tokens_per_s"]
        assert s["reference_tokens_per_s"] == ref
        assert [p["world_size"] for p in s["points"]] == [1, 2]
        for p in s["points"]:
            r = next(r for r in reports[p["world_size"]]["results"] if r["role"] == "parallel"
                     and (r["case"], r["direction"], r["series"]) == key)
            assert p["tokens_per_s"] == r["tokens_per_s"] and p["scaling_efficiency"] == r["scaling_efficiency"]
            assert p["baseline_tokens_per_s"] == r["baseline"]["tokens_per_s"]
            assert p["a2a_share"] == r.get("a2a_share") and p["allreduce_share"] == r.get("allreduce_share")
            assert p["ideal_tokens_per_s"] == pytest.approx(p["world_size"] * ref, rel=1e-12)
            assert p["efficiency_vs_ideal"] == pytest.approx(r["tokens_per_s"] / (p["world_size"] * ref), rel=1e-12)
            assert f"| {p['world_size']} | {p['tokens_per_s']:.4g} | " in md
            assert f" | {100 * p['scaling_efficiency']:.1f}% | " in md
        target = {"ep": 0.85, "tp": 0.75, "ddp": 0.85}[key[0]]
        last = s["points"][-1]["scaling_efficiency"]
        assert s["target"] == target and s["largest_world_size"] == 2 and s["efficiency_at_largest"] == last
        assert s["verdict"] == ("met" if last >= target else "missed") + " at N=2 (the target is for N=8)"
    try:
        import matplotlib  # noqa: F401
        have_mpl = True
    except ImportError:
        have_mpl = False
    png = folder / "scaling.png"
    assert (png in written) == have_mpl and png.exists() == have_mpl
    if have_mpl:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
