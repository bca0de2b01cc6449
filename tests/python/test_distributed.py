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


def test_benchmark_runs_two_ranks_and_profiles(tmp_path):
    """bench/benchmark_distributed.py under torch.distributed.run on the CPU (gloo, 2 ranks, --quick): every case
    writes its rows (the ratio to one process), and --profile writes each rank's trace and table."""
    out, prof = tmp_path / "out", tmp_path / "prof"
    env = _env(0, 2, tmp_path / "unused")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DIST_INIT_FILE"):
        env.pop(k)
    import socket
    with socket.socket() as sock:  # a free port for the rendezvous (port 0 is not shared between the ranks)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port),
           str(HERE.parents[1] / "bench" / "benchmark_distributed.py"), "--quick", "--device", "cpu",
           "--profile", str(prof), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT_S, cwd=str(HERE.parents[1]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [report] = list(out.glob("*/python-distributed.json"))
    rows = json.loads(report.read_text())["results"]
    assert rows and all(r["status"] in ("ok", "skipped") for r in rows), [(r.get("variant"), r["status"]) for r in rows]
    assert any(r.get("vs_baseline") for r in rows), "no row measured against one process"
    for r in range(2):
        assert (prof / f"ddp-rank{r}.json").stat().st_size > 0
        text = (prof / f"ddp-rank{r}.txt").read_text()
        assert "ms per step" in text and "Self CPU" in text, text[:500]
