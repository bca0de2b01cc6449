"""The first call of an op in a fresh process made inside torch.cuda.graph(...): forward and backward
captured before the op (or anything else of the library) has run once, then replayed on new inputs
and compared with eager. Each op runs in its own fresh Python process; inside it, every CUDA variant
and dtype is captured in turn, each on its own first call (so per-kernel lazy set-up, such as a
function attribute set on first launch, is covered too).

Why: a lazily initialised resource (a device-attribute query, cudaFuncSetAttribute, a memory-pool or
handle creation, a host synchronisation, work on the legacy stream) made on the first call would
break the capture of a user's very first training step (cudaErrorStreamCaptureImplicit /
cudaErrorStreamCaptureUnsupported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import optimized_ops
from conftest import requires_cuda

# The CUDA rungs, written out here so that the child process asks the library nothing before its
# first capture; test_variant_lists_are_current keeps them equal to the library's tables.
GEMM_CUDA = {"auto": "fp32 fp16 bf16", "naive": "fp32 fp16 bf16", "coalesced": "fp32 fp16 bf16",
             "smem_tiled": "fp32 fp16 bf16", "register_tiled": "fp32 fp16 bf16", "wmma": "fp16 bf16",
             "mma_pipeline": "fp16 bf16", "wgmma_tma": "fp16 bf16", "wgmma_ws": "fp16 bf16",
             "wgmma_persistent": "fp16 bf16", "gemv": "fp32 fp16 bf16"}
FUSED_CUDA = ["auto", "unfused", "fused_streaming", "fused_registers"]

OPS = ["matmul", "softmax", "log_softmax", "layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm",
       "gelu", "bias_gelu", "silu_and_mul"]

CHILD = r"""
import os
import sys
import torch

import optimized_ops

op, gemm_cuda, fused_cuda = sys.argv[1], eval(sys.argv[2]), eval(sys.argv[3])
gen = torch.Generator().manual_seed(1234)
R, W = 37, 1031          # rows, width: odd, not a multiple of any block size


def rand(*shape, dtype):
    return ((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * 2).to(dtype).cuda()


# The Hopper GEMM rungs take operands TMA can describe (rows 16-byte aligned), in the backward
# products too: sizes in multiples of 8 for them.
MM = {False: (R, 67, 45), True: (40, 64, 48)}  # (M, K, N) by "is a Hopper rung"

# op -> (make inputs, call); outputs are tuples
MAKE = {
    "matmul": lambda d, h=False: dict(a=rand(3, MM[h][0], MM[h][1], dtype=d), b=rand(MM[h][1], MM[h][2], dtype=d)),
    "softmax": lambda d: dict(x=rand(R, W, dtype=d)),
    "log_softmax": lambda d: dict(x=rand(R, W, dtype=d)),
    "layer_norm": lambda d: dict(x=rand(R, W, dtype=d), w=rand(W, dtype=d), b=rand(W, dtype=d)),
    "rms_norm": lambda d: dict(x=rand(R, W, dtype=d), w=rand(W, dtype=d)),
    "add_layer_norm": lambda d: dict(x=rand(R, W, dtype=d), r=rand(R, W, dtype=d), w=rand(W, dtype=d),
                                     b=rand(W, dtype=d)),
    "add_rms_norm": lambda d: dict(x=rand(R, W, dtype=d), r=rand(R, W, dtype=d), w=rand(W, dtype=d)),
    "gelu": lambda d: dict(x=rand(R, W, dtype=d)),
    "bias_gelu": lambda d: dict(x=rand(R, W, dtype=d), b=rand(W, dtype=d)),
    "silu_and_mul": lambda d: dict(x=rand(R, 2 * W, dtype=d)),
}
o = optimized_ops
CALL = {
    "matmul": lambda i, v: (o.matmul(i["a"], i["b"], variant=v),),
    "softmax": lambda i, v: (o.softmax(i["x"], -1, variant=v),),
    "log_softmax": lambda i, v: (o.log_softmax(i["x"], -1, scale=0.5, variant=v),),
    "layer_norm": lambda i, v: (o.layer_norm(i["x"], W, i["w"], i["b"], variant=v),),
    "rms_norm": lambda i, v: (o.rms_norm(i["x"], W, i["w"], variant=v),),
    "add_layer_norm": lambda i, v: o.add_layer_norm(i["x"], i["r"], W, i["w"], i["b"], variant=v),
    "add_rms_norm": lambda i, v: o.add_rms_norm(i["x"], i["r"], W, i["w"], variant=v),
    "gelu": lambda i, v: (o.gelu(i["x"], "tanh", variant=v),),
    "bias_gelu": lambda i, v: (o.bias_gelu(i["x"], i["b"], variant=v),),
    "silu_and_mul": lambda i, v: (o.silu_and_mul(i["x"], variant=v),),
}
# output shapes, known without running the op (its first call must be the captured one)
OUT = {"matmul": [(3, R, 45)], "matmul_hopper": [(3, 40, 48)], "add_layer_norm": [(R, W)] * 2, "add_rms_norm": [(R, W)] * 2,
       "silu_and_mul": [(R, W)]}
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

captured = 0
for dtype in (torch.float32, torch.bfloat16):
    variants = ([v for v, dts in gemm_cuda.items() if NAMES[dtype] in dts.split()] if op == "matmul"
                else fused_cuda)
    for variant in variants:
        what = f"{op} {variant} {NAMES[dtype]}"
        hopper = variant.startswith("wgmma_")
        make = (lambda d: MAKE[op](d, hopper)) if op == "matmul" else MAKE[op]
        inputs = {k: t.requires_grad_() for k, t in make(dtype).items()}
        gys = [rand(*s, dtype=dtype) for s in OUT.get(op + ("_hopper" if hopper else ""), [(R, W)])]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # the first call of this op, variant and dtype
                outs = CALL[op](inputs, variant)
                grads = torch.autograd.grad(outs, list(inputs.values()), gys)
        except Exception as e:
            print(f"FAILED capture of {what} (first call in this process): {type(e).__name__}: {e}")
            sys.exit(1)
        for trial in range(2):  # new inputs written into the captured memory, then replay
            new = make(dtype)
            with torch.no_grad():
                for k, t in inputs.items():
                    t.copy_(new[k])
                for g in gys:
                    g.copy_(rand(*g.shape, dtype=dtype))
            graph.replay()
            torch.cuda.synchronize()
            e_outs = CALL[op](inputs, variant)
            e_grads = torch.autograd.grad(e_outs, list(inputs.values()), gys)
            for got, want in zip((*outs, *grads), (*e_outs, *e_grads)):
                torch.testing.assert_close(got, want, msg=lambda m: f"{what} replay {trial} vs eager: {m}")
        captured += 1
print(f"ok: {captured} captures of {op}", flush=True)
# Leave without the interpreter's teardown: once in 16 runs on the H100, torch aborted at exit
# ("terminate called without an active exception", from its autograd device threads) after every
# capture had passed; the library starts no thread here. What this test checks is done above.
sys.stderr.flush()
os._exit(0)
"""


@requires_cuda
@pytest.mark.parametrize("op", OPS)
def test_first_call_inside_cuda_graph(op):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, op, repr(GEMM_CUDA), repr(FUSED_CUDA)],
                          capture_output=True, text=True, timeout=600, env=env)
    report = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    assert proc.stdout.strip().splitlines()[-1].startswith(f"ok: "), report
    assert "0 captures" not in proc.stdout, report


def test_variant_lists_are_current():
    """The lists the child uses without asking the library are the library's."""
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    if optimized_ops.built_with_cuda():
        cuda_gemm = {}
        for v in ["auto", *optimized_ops.variants()]:
            dts = [names[d] for d in names if optimized_ops.variant_supports(v, d, "cuda")[0]]
            if dts:
                cuda_gemm[v] = " ".join(dts)
        assert cuda_gemm == GEMM_CUDA
    assert ["auto", *[v for v in optimized_ops.fused_variants() if v != "cpu"]] == FUSED_CUDA
