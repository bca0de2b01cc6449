"""The model tools of issue 20 on the CPU: the smoke modes of examples/pytorch_integration.py, the profiler
(``python -m optimized_ops.models.profile --smoke``) and bench/benchmark_models.py --smoke run end to end and write
their outputs (the Chrome traces, the family table's JSON, the benchmark's JSON with its rows ok), and the profiler's
kernel-family classifier on known kernel and operator names.

The classifier tests load python/optimized_ops/models/profile.py by its path (they need no model); the others are
skipped, with the reason, while ``optimized_ops.models`` cannot be imported."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

import optimized_ops

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROFILE_PY = ROOT / "python" / "optimized_ops" / "models" / "profile.py"


def _models_reason() -> str:
    try:
        import optimized_ops.models as m

        for name in ("Transformer", "TransformerConfig", "MoEConfig", "OptimizedTransformer", "generate"):
            getattr(m, name)
    except Exception as e:  # noqa: BLE001 - any failure is the skip reason
        return f"optimized_ops.models is not importable yet ({type(e).__name__}: {e})"
    return ""


MODELS_REASON = _models_reason()
requires_models = pytest.mark.skipif(bool(MODELS_REASON), reason=MODELS_REASON or "optimized_ops.models present")


def _profile_module():
    spec = importlib.util.spec_from_file_location("_model_tools_profile", PROFILE_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env():
    """The environment of the subprocesses: this optimized_ops first on the path (and the library it loaded)."""
    env = dict(os.environ)
    pkg_root = str(pathlib.Path(optimized_ops.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OPTIMIZED_OPS_LIBRARY", optimized_ops.library_path())
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")  # smoke runs are CPU runs either way
    return env


def _run(args, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


# ---- the classifier -------------------------------------------------------------------------------------------

KNOWN_NAMES = {
    # GEMMs and linear layers: ours, cuBLAS, CUTLASS, torch's CPU ops and autograd nodes
    "void optimized::cuda::(anonymous namespace)::gemm_wgmma_tma_kernel<128, 256>(CUtensorMap, CUtensorMap)":
        "gemm_linear",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas":
        "gemm_linear",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "gemm_linear",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)": "gemm_linear",
    "void optimized::cuda::(anonymous namespace)::act_grad_kernel<__nv_bfloat16>(...)": "gemm_linear",
    "aten::mm": "gemm_linear", "aten::addmm": "gemm_linear", "AddmmBackward0": "gemm_linear",
    "MmBackward0": "gemm_linear", "aten::linear": "gemm_linear", "optimized::linear_forward": "gemm_linear",
    "optimized_linear_forward_Function": "gemm_linear",
    # attention (FlashAttention and mem-efficient names carry "cutlass": attention is checked first)
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>"
    "(Flash_fwd_params)": "attention",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)":
        "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "void optimized::cuda::flash2::flash2_fwd_kernel<128, true>(optimized::AttentionParams)": "attention",
    "void optimized::cuda::(anonymous namespace)::softmax_kernel(optimized::AttentionParams, float*)": "attention",
    "optimized::attention_fwd": "attention", "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    # the KV cache and decode
    "void optimized::cuda::kv_cache_cuda::decode_tile_kernel<128>(optimized::KvDecodeParams, int, SplitOut)":
        "kv_cache_decode",
    "void optimized::cuda::(anonymous namespace)::append_kernel<__nv_bfloat16>(optimized::KvAppendParams, Plan)":
        "kv_cache_decode",
    "void optimized::cuda::(anonymous namespace)::gather_kernel(optimized::KvGatherParams)": "kv_cache_decode",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_copy_kernel_impl"
    "<c10::BFloat16>>>": "kv_cache_decode",
    "optimized::paged_attention_decode": "kv_cache_decode", "optimized::kv_cache_append": "kv_cache_decode",
    "aten::index_copy_": "kv_cache_decode",
    # fused norms and activations
    "void optimized::cuda::fused::(anonymous namespace)::row_streaming_kernel<4, __nv_bfloat16>(optimized::FusedParams)":
        "fused_norm_act",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float)": "fused_norm_act",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>":
        "fused_norm_act",
    "optimized::rms_norm_fwd": "fused_norm_act", "aten::native_layer_norm": "fused_norm_act",
    "aten::_fused_rms_norm": "fused_norm_act", "optimized::silu_and_mul_fwd": "fused_norm_act",
    "aten::softmax": "fused_norm_act",
    # cross-entropy (torch's is log_softmax + nll_loss)
    "void optimized::cuda::(anonymous namespace)::ce_row_kernel<__nv_bfloat16>(optimized::CrossEntropyParams)":
        "cross_entropy",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, float, "
    "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*)": "cross_entropy",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*)":
        "cross_entropy",
    "optimized::cross_entropy_fwd": "cross_entropy", "aten::_log_softmax": "cross_entropy",
    "_LinearCrossEntropy": "cross_entropy",
    # rope ("property" must not match)
    "void optimized::cuda::(anonymous namespace)::rope_kernel<__nv_bfloat16>(optimized::RopeParams, Geom)": "rope",
    "optimized::rope_fwd": "rope", "aten::property_like_op": "other",
    # MoE
    "void optimized::cuda::(anonymous namespace)::grouped_wgmma_kernel<128>(CUtensorMap)": "moe",
    "void optimized::cuda::(anonymous namespace)::route_warp_kernel<8>(optimized::MoeRouteParams)": "moe",
    "void optimized::cuda::(anonymous namespace)::gather_kernel<8>(optimized::MoeGatherParams, long)": "moe",
    "optimized::grouped_mm_swiglu": "moe", "optimized::moe_route": "moe", "optimized::moe_combine": "moe",
    # the loader and copies
    "Memcpy HtoD (Pageable -> Device)": "loader_copies", "Memset (Device)": "loader_copies",
    "void optimized::loader::(anonymous namespace)::gather_kernel(unsigned char const*, unsigned char*, long)":
        "loader_copies",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>":
        "loader_copies",
    "aten::copy_": "loader_copies", "aten::_to_copy": "loader_copies", "aten::to": "loader_copies",
    "aten::cat": "loader_copies", "aten::fill_": "loader_copies",
    # torch-native other: the optimizer, random numbers and grad-norm reductions (not "norm"), arithmetic
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, "
    "FusedAdamMathFunctor<float, 4>>": "other",
    "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
    "normal_and_transform>": "other",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float>>>": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "other",
    "aten::add_": "other", "aten::embedding": "other", "aten::topk": "other", "aten::normal_": "other",
    "aten::mul": "other",
}


def test_classifier_known_names():
    prof = _profile_module()
    keys = [k for k, _ in prof.FAMILIES]
    assert keys == ["gemm_linear", "attention", "kv_cache_decode", "fused_norm_act", "cross_entropy", "rope", "moe",
                    "loader_copies", "other"]
    wrong = {name: (prof.classify(name), want) for name, want in KNOWN_NAMES.items() if prof.classify(name) != want}
    assert not wrong, "misclassified (got, want): " + json.dumps(wrong, indent=1)


def test_is_ours():
    prof = _profile_module()
    assert prof.is_ours("void optimized::cuda::(anonymous namespace)::rope_kernel<float>(optimized::RopeParams)")
    assert prof.is_ours("optimized::linear_forward")
    assert prof.is_ours("optimized_rms_norm_fwd_Function")
    assert not prof.is_ours("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN")
    assert not prof.is_ours("aten::mm")


def test_family_times_gpu_and_cpu_traces():
    prof = _profile_module()
    gpu = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "ts": 0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "void optimized::cuda::flash2::flash2_fwd_kernel<128, true>"
                                             "(optimized::AttentionParams)", "ts": 10, "dur": 5.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 20, "dur": 2.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100.0},  # CPU side: not counted on CUDA
    ]}
    ft = prof.family_times(gpu, "cuda")
    assert ft["total_us"] == pytest.approx(17.0)
    assert ft["families"]["gemm_linear"]["us"] == pytest.approx(10.0)
    assert ft["families"]["attention"]["ours_us"] == pytest.approx(5.0)
    assert ft["families"]["loader_copies"]["count"] == 1
    # CPU: self time = duration minus the direct children's (per thread)
    cpu = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::t", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1, "ts": 3.0, "dur": 6.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 1, "ts": 4.0, "dur": 2.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::rms_norm", "pid": 1, "tid": 2, "ts": 4.0, "dur": 3.0},
        {"ph": "X", "cat": "user_annotation", "name": "train_step_0", "pid": 1, "tid": 1, "ts": 0.0, "dur": 20.0},
    ]}
    ft = prof.family_times(cpu, "cpu")
    fam = ft["families"]
    assert fam["gemm_linear"]["us"] == pytest.approx((10 - 1 - 6) + (6 - 2))   # linear's self + addmm's self
    assert fam["loader_copies"]["us"] == pytest.approx(2.0)
    assert fam["other"]["us"] == pytest.approx(1.0)                             # aten::t
    assert fam["fused_norm_act"]["us"] == pytest.approx(3.0)                    # another thread
    assert ft["total_us"] == pytest.approx(13.0)                                # = the outermost ops' durations


def test_short_names():
    prof = _profile_module()
    assert prof._short("void optimized::cuda::(anonymous namespace)::gemm_wgmma_tma_kernel<128, 256>(CUtensorMap)") \
        == "optimized::cuda::gemm_wgmma_tma_kernel<...>"
    assert prof._short("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD (Pageable -> Device)"


# ---- the smoke runs ---------------------------------------------------------------------------------------------

@requires_models
def test_profile_smoke_writes_trace_table_and_memory(tmp_path):
    out = tmp_path / "profile"
    _run(["-m", "optimized_ops.models.profile", "--smoke", "--out", str(out)])
    prof = _profile_module()
    report = json.loads((out / "profile.json").read_text())
    assert report["schema"] == "optimized-ops-profile/1"
    keys = [k for k, _ in prof.FAMILIES]
    for phase in ("train", "decode"):
        ph = report["phases"][phase]
        assert [r["family"] for r in ph["families"]] == keys
        assert ph["busy_ms_per_step"] > 0
        trace = json.loads(pathlib.Path(ph["trace"]).read_text())
        assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])
        shares = sum(r["share"] for r in ph["families"])
        assert shares == pytest.approx(1.0, abs=1e-6)
    train = {r["family"]: r for r in report["phases"]["train"]["families"]}
    for family in ("gemm_linear", "attention", "fused_norm_act", "cross_entropy", "rope"):
        assert train[family]["count"] > 0, family          # the optimized model runs each of these
        assert train[family]["ours_share"] > 0.5, family
    decode = {r["family"]: r for r in report["phases"]["decode"]["families"]}
    assert decode["kv_cache_decode"]["count"] > 0
    rows = report["memory"]
    assert {r["op"] for r in rows} == {"matmul", "attention", "moe"}
    assert all(r["status"] == "ok" and r["peak_bytes"] is not None for r in rows), rows
    pivot = {(p["op"], p["direction"]): p for p in report["memory_pivot"]}
    assert pivot[("attention", "fwd")]["reduction"] > 1.0     # the materialized N x N scores
    md = (out / "profile.md").read_text()
    assert "Memory Usage Analysis" in md and "| gemm/linear |" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "profile.png").stat().st_size > 0


@requires_models
def test_benchmark_models_smoke_rows_ok(tmp_path):
    _run([str(ROOT / "bench" / "benchmark_models.py"), "--smoke", "--out", str(tmp_path)])
    path = tmp_path / "cpu" / "python-models.json"
    report = json.loads(path.read_text())
    assert report["schema"] == "optimized-ops-bench/1"
    rows = report["results"]
    assert {r["case"] for r in rows} == {"train", "train_moe", "decode", "loader"}
    bad = [(r["case"], r["variant"], r["status"], r["reason"]) for r in rows if r["status"] not in ("ok", "skipped")]
    assert not bad, bad
    for r in rows:
        assert r["family"] == "models"
        if r["variant"] in ("ours", "torch_eager", "gpu_tensors", "loader"):
            assert r["status"] == "ok", (r["case"], r["variant"], r["reason"])
            assert r["time_ms"]["median"] > 0 and r["tokens_per_s"] > 0
        if r["status"] == "ok" and r["case"] != "loader" or r["variant"] == "loader":
            assert r["validation"] and r["validation"]["passed"], (r["case"], r["variant"], r["validation"])
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert all(r["variant"] == "torch_compile" for r in skipped)  # left out of the smoke run, with the reason
    ours_train = next(r for r in rows if r["case"] == "train" and r["variant"] == "ours")
    assert ours_train["vs_eager"] > 0 and ours_train["targets"]["vs_eager"]["target"] == 1.5
    decode_batches = sorted(r["shape"]["batch"] for r in rows if r["case"] == "decode" and r["variant"] == "ours")
    assert decode_batches == [1, 2]
    md = (tmp_path / "cpu" / "python-models.md").read_text()
    assert "models on cpu" in md and "| train | ours |" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "cpu" / "python-models.png").stat().st_size > 0


@requires_models
def test_pytorch_integration_smoke_prints_speedups():
    proc = _run([str(ROOT / "examples" / "pytorch_integration.py"), "--smoke"])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("Speedup: ")]
    assert len(lines) == 2, proc.stdout                   # torch.nn.Transformer and torch eager (compile left out)
    assert "torch.nn.Transformer" in lines[0] and "different architecture" in lines[0]
    assert "torch eager" in lines[1]
    for ln in lines:
        float(ln.split()[1].rstrip("x"))
    assert "tokens/s" in proc.stdout
