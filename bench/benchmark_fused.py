#!/usr/bin/env python3
"""Python benchmark of the fused memory-bound ops: optimized_ops against torch eager, torch.compile of the
same torch expression and Liger-Kernel, forward, backward and forward+backward, in one run.

    python bench/benchmark_fused.py [--device cuda|cpu] [--fused-ops softmax,rms_norm,...,cross_entropy,rope]
        [--dtypes bf16,fp16,fp32] [--shapes 16384x8192,4097x4099] [--variants auto|all|NAME,...]
        [--directions fwd,bwd,fwd+bwd] [--gelu none|tanh] [--no-compile] [--no-liger]
        [--ce-shapes 8192x128256] [--rope-shapes 4x4096x32x8x128] [--quick] [--out bench/results]

is `python bench/benchmark_all.py --ops fused ...`: the fused family of the Python runner (bench/runner.py
holds the harness: statistics, stopping rule, cold-cache timing with CUDA events, rotating inputs,
ceilings, output files, and the registry this module adds itself to).

What is compared, per (op, dtype, shape ROWSxWIDTH; silu_and_mul's WIDTH is d, its x is R x 2d):
  ours           optimized_ops.<op>(..., variant=V), V = auto (default) or each rung (--variants all)
  torch_eager    the torch expression: F.softmax, F.log_softmax, F.layer_norm, F.rms_norm;
                 h = x + residual then F.layer_norm / F.rms_norm (returning y and h); F.gelu(x + bias);
                 a, b = x.chunk(2, -1); F.silu(a) * b
  torch_compile  torch.compile of that expression (mode default, fullgraph=True, dynamic=False;
                 torch._dynamo.reset() before each group so no recompile limit is hit; compiled and
                 warmed up by the validation run, outside the timed region)
  liger          Liger-Kernel (PyPI `liger-kernel`, Triton; CUDA only) for the ops it has: softmax
                 (LigerSoftmaxFunction), layer_norm (LigerLayerNormFunction), rms_norm (LigerRMSNormFunction,
                 casting_mode "llama", its default; in_place=False), add_rms_norm (LigerFusedAddRMSNormFunction),
                 silu_and_mul (LigerFusedGateUpSiLUMulFunction: x (R, 2d) as ours, no chunk copies),
                 cross_entropy (LigerCrossEntropyFunction), rope (LigerRopeFunction). It is imported from the
                 environment, else from the wheel in .whl/ (scripts/fetch-wheels puts it there; unpacked into
                 .whl/unpacked/, the environment is not touched); absent, failing to import, on the CPU, or
                 raising: its rows are "skipped" with the reason. vs_liger = Liger's time over the row's.
                 Liger has no log_softmax, add_layer_norm or bias_gelu; its GEGLU (gelu_tanh(a) * b) matches
                 no op of the family.
Directions (inputs require grad in all three, as in training):
  fwd      the forward (it saves what the backward needs);
  bwd      torch.autograd.grad(outputs, inputs, cotangents) on the graph of a forward run just before
           each sample, untimed (enqueued ahead of the L2 flush and the start event): the backward
           alone, cold, as training runs it (retain_graph is not used: torch.compile's backward
           donates its saved buffers and refuses it);
  fwd+bwd  the forward, then torch.autograd.grad, timed together.
Every gradient is taken (input, residual, weight, bias); the add forms receive a cotangent for both
y and residual_out.

Validation (before any timing; the fused rule of src/testing/tolerance.h, mirrored in bench/tolerance.py):
every implementation's outputs and gradients on input set 0 against float64 (the torch expression on
float64 copies, in row chunks on the device; weight/bias gradients summed over the chunks); per tensor,
max|ours - ref| must be <= 2 x max|torch_eager - ref| + (2u + 16 sqrt(n) 2^-24) max|ref| + floor
(u: the dtype's unit roundoff; n: the row width, the rows for weight and bias gradients).
torch_compile is checked the same way; a baseline that fails is noted, not dropped.

GB/s counts the minimum bytes (the byte model of the C++ benchmark, bench/fused/fused_bench.cpp: each input
read once, each output written once, statistics fp32; fwd+bwd = fwd + bwd); roofline = the fraction
of torch's device copy bandwidth measured in this run; copy_same_size = a copy_ of the same bytes,
timed the same way; vs baseline = torch.compile's time over ours.

Cross-entropy and RoPE (issue 17) have shapes and inputs of their own (see the section "cross-entropy and
RoPE" below):
  cross_entropy  logits (T, V) and int64 targets, reduction mean; ours = optimized_ops.cross_entropy (auto, every
                 rung with --variants all, and auto_inplace = inplace_backward=True, the gradient written over the
                 logits as Liger does); torch_eager = F.cross_entropy; torch_compile of it; liger. fwd = the loss
                 alone (logits not requiring grad: reads the logits once); fwd+bwd = loss and autograd.grad with an
                 upstream gradient of 1 (reads the logits once, writes their gradient once). --ce-shapes TxV.
  rope           q (B, S, Hq, D), k (B, S, Hk, D), neox layout, positions arange(S), theta 10000; ours =
                 optimized_ops.rope(q, k, positions) (angles computed in the kernel); torch_eager = HF's
                 apply_rotary_pos_emb (q * cos + rotate_half(q) * sin, cos/sin (S, D) in q's dtype built as HF's
                 LlamaRotaryEmbedding does, outside the timed region); torch_compile of it; liger (LigerRopeFunction
                 on (B, H, S, D) transpose views, HF's cos/sin). fwd, bwd, fwd+bwd as above; bytes: read q, k and
                 write q_out, k_out (bwd: the gradients); the cos/sin tables and positions are not counted.
                 --rope-shapes BxSxHqxHkxD.
Liger's cross-entropy writes the gradient over the logits and its RoPE rotates q, k (and in the backward the
incoming gradients) in place: such implementations are validated on a copy of input set 0, and the sets are
redrawn after they are timed.
"""

from __future__ import annotations

import importlib
import math
import os
import pathlib
import re
import sys
import zipfile

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
from tolerance import reduction_allowed_error  # noqa: E402

ROW_OPS = ["softmax", "log_softmax", "layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "bias_gelu",
           "silu_and_mul"]
CASE_OPS = ["cross_entropy", "linear_cross_entropy", "rope"]  # shapes and inputs of their own (the section
# "cross-entropy and RoPE")
FUSED_OPS = ROW_OPS + CASE_OPS
DIRECTIONS = ["fwd", "bwd", "fwd+bwd"]
EPS = 1e-5

# Standard shapes per device and dtype (torch.compile compiles once per (op, dtype, shape): keep it lean).
DEFAULT_SHAPES = {
    "cuda": {"bf16": ["4096x4096", "16384x8192", "4096x32768", "4097x4099"],
             "fp16": ["16384x8192"], "fp32": ["16384x8192"]},
    "cpu": {"fp32": ["256x1024", "1024x4096"]},
}
QUICK_SHAPES = {"cuda": {"bf16": ["4096x4096", "16384x8192"]}, "cpu": {"fp32": ["256x1024"]}}


# ---- the byte model (bench/fused/fused_bench.cpp: rows, vector and statistics units) -----------------

BYTE_MODEL = {  # (op, direction): (R*W*E units, W*E units, 4*R units, what)
    ("softmax", "fwd"): (2, 0, 0, "read x; write y"),
    ("softmax", "bwd"): (3, 0, 0, "read y, dy; write dx"),
    ("layer_norm", "fwd"): (2, 2, 2, "read x, weight, bias; write y, mean, rstd"),
    ("layer_norm", "bwd"): (3, 3, 2, "read dy, h, weight, mean, rstd; write dx, dweight, dbias"),
    ("rms_norm", "fwd"): (2, 1, 1, "read x, weight; write y, rstd"),
    ("rms_norm", "bwd"): (3, 2, 1, "read dy, h, weight, rstd; write dx, dweight"),
    ("add_layer_norm", "fwd"): (4, 2, 2, "read x, residual, weight, bias; write y, residual_out, mean, rstd"),
    ("add_layer_norm", "bwd"): (4, 3, 2, "read dy, h, dresidual_out, weight, mean, rstd; write dx, dweight, dbias"),
    ("add_rms_norm", "fwd"): (4, 1, 1, "read x, residual, weight; write y, residual_out, rstd"),
    ("add_rms_norm", "bwd"): (4, 2, 1, "read dy, h, dresidual_out, weight, rstd; write dx, dweight"),
    ("bias_gelu", "fwd"): (2, 1, 0, "read x, bias; write y"),
    ("bias_gelu", "bwd"): (3, 2, 0, "read dy, x, bias; write dx, dbias"),
    ("silu_and_mul", "fwd"): (3, 0, 0, "read x (R x 2d); write y (R x d)"),
    ("silu_and_mul", "bwd"): (5, 0, 0, "read dy (R x d), x (R x 2d); write dx (R x 2d)"),
}
BYTE_MODEL[("log_softmax", "fwd")] = BYTE_MODEL[("softmax", "fwd")]
BYTE_MODEL[("log_softmax", "bwd")] = BYTE_MODEL[("softmax", "bwd")]


def min_bytes(op, direction, rows, width, elem):
    if direction == "fwd+bwd":
        return min_bytes(op, "fwd", rows, width, elem) + min_bytes(op, "bwd", rows, width, elem)
    a, b, c, _ = BYTE_MODEL[(op, direction)]
    return a * rows * width * elem + b * width * elem + c * 4 * rows


def bytes_formula(op, direction):
    if direction == "fwd+bwd":
        return f"fwd + bwd: {bytes_formula(op, 'fwd')}; {bytes_formula(op, 'bwd')}"
    a, b, c, what = BYTE_MODEL[(op, direction)]
    w = "d" if op == "silu_and_mul" else "W"
    s = f"{a}*R*{w}*E"
    if b:
        s += f" + {b}*W*E" if b > 1 else " + W*E"
    if c:
        s += f" + {4 * c}*R"
    return f"{s} ({what})"


# ---- the Liger-Kernel peer ---------------------------------------------------------------------

LIGER_VERSION = "0.8.5"  # the version scripts/fetch-wheels downloads (requires torch >= 2.1.2, triton >= 2.3.1)
WHEEL_DIR = runner.ROOT / ".whl"
# op -> the autograd.Function of liger_kernel.ops it is measured with (read from the wheel's source)
LIGER_FUNCTIONS = {"softmax": "LigerSoftmaxFunction", "layer_norm": "LigerLayerNormFunction",
                   "rms_norm": "LigerRMSNormFunction", "add_rms_norm": "LigerFusedAddRMSNormFunction",
                   "silu_and_mul": "LigerFusedGateUpSiLUMulFunction", "cross_entropy": "LigerCrossEntropyFunction",
                   "rope": "LigerRopeFunction", "linear_cross_entropy": "LigerFusedLinearCrossEntropyFunction"}


class Liger:
    """liger_kernel.ops, or why it cannot run here (`reason`); `version` and `source` for the notes."""

    def __init__(self, ops=None, version="", source="", reason=""):
        self.ops, self.version, self.source, self.reason = ops, version, source, reason

    def function(self, op):
        """(the autograd.Function for op, "") or (None, why not)."""
        if self.ops is None:
            return None, self.reason
        fn = getattr(self.ops, LIGER_FUNCTIONS[op], None)
        if fn is None:
            return None, f"liger-kernel {self.version} has no {LIGER_FUNCTIONS[op]}"
        return fn, ""


def _version_key(path):
    m = re.match(r"liger_kernel-([0-9][^-]*)-", path.name)
    return [int(x) if x.isdigit() else -1 for x in re.split(r"[.]", m.group(1))] if m else []


def liger_wheel():
    """The carried wheel: LIGER_VERSION's when present, else the newest liger_kernel-*.whl in .whl/."""
    wheels = sorted(WHEEL_DIR.glob("liger_kernel-*.whl"), key=_version_key)
    pinned = [w for w in wheels if w.name.startswith(f"liger_kernel-{LIGER_VERSION}-")]
    return (pinned or wheels or [None])[-1]


def _unpack(wheel):
    """The wheel unpacked under .whl/unpacked/<its name>/ (once; a pure-Python wheel is its own site dir)."""
    dest = WHEEL_DIR / "unpacked" / wheel.stem
    if not (dest / ".complete").exists():
        tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        (tmp / ".complete").write_text(wheel.name + "\n")
        if dest.exists():
            import shutil
            shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return dest


def _forget_liger():
    for name in [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]:
        del sys.modules[name]


def _first_line(e):
    return (f"{type(e).__name__}: {e}".splitlines() or [type(e).__name__])[0][:300]


def load_liger(device, log):
    """Imports liger_kernel.ops: from the environment, else from the wheel in .whl/. Never raises."""
    from importlib import metadata

    ops, source, version = None, "", ""
    try:
        ops = importlib.import_module("liger_kernel.ops")
        source = "the environment"
        try:
            version = metadata.version("liger-kernel")
        except Exception:  # noqa: BLE001 - importable without its metadata (a source tree on the path)
            version = "?"
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("liger_kernel"):
            return Liger(reason=f"liger-kernel failed to import: {_first_line(e)}")
        _forget_liger()
    except Exception as e:  # noqa: BLE001 - any failure is a skip reason, never the run's end
        return Liger(reason=f"liger-kernel failed to import: {_first_line(e)}")
    if ops is None:
        wheel = liger_wheel()
        if wheel is None:
            return Liger(reason="liger-kernel is not installed and .whl/ holds no liger_kernel-*.whl "
                                "(scripts/fetch-wheels downloads it where PyPI is reachable)")
        try:
            site = _unpack(wheel)
            sys.path.insert(0, str(site))
            importlib.invalidate_caches()
            ops = importlib.import_module("liger_kernel.ops")
        except Exception as e:  # noqa: BLE001
            _forget_liger()
            return Liger(reason=f"liger-kernel from {wheel.name} failed to import: {_first_line(e)}")
        source = f".whl/{wheel.name}"
        version = wheel.name.split("-")[1]
    liger = Liger(ops, version, source)
    if device != "cuda":
        liger.ops, liger.reason = None, (f"liger-kernel {version} imported, but its kernels are Triton, "
                                         f"for CUDA devices only: this run is on the {device}")
    return liger


def liger_row_fns(liger, op):
    """Liger's call for a row op, with the torch expression's signature and a tuple result; or (None, reason)."""
    f, why = liger.function(op)
    if f is None:
        return None, why
    if op == "softmax":
        return (lambda x: (f.apply(x),)), ""
    if op == "layer_norm":
        return (lambda x, weight, bias: (f.apply(x, weight, bias, EPS),)), ""
    if op == "rms_norm":  # offset 0, casting_mode "llama" (LigerRMSNorm's default), in_place=False: dY is reused
        return (lambda x, weight: (f.apply(x, weight, EPS, 0.0, "llama", False),)), ""
    if op == "add_rms_norm":  # returns (Y, S = X + R), as ours (y, residual_out)
        return (lambda x, residual, weight: tuple(f.apply(x, residual, weight, EPS, 0.0, "llama", False))), ""
    if op == "silu_and_mul":  # x (R, 2d) = [gate | up], as ours; in_place=False keeps x
        return (lambda x: (f.apply(x, False),)), ""
    return None, f"no Liger-Kernel row for {op}"


# ---- the ops: inputs, the torch expression, ours ---------------------------------------------

class Spec:
    """One op: which tensors it takes (row tensors are (R, W), or (R, 2d) for silu_and_mul's x;
    vectors are (W)), the torch expression and the optimized_ops call; both return a tuple."""

    def __init__(self, name, rows_inputs, vector_inputs, torch_fn, ours_fn):
        self.name, self.rows_inputs, self.vector_inputs = name, rows_inputs, vector_inputs
        self.torch_fn, self.ours_fn = torch_fn, ours_fn

    def inputs(self):
        return self.rows_inputs + self.vector_inputs


def make_specs(gelu_approximate):
    import optimized_ops as oo

    def norm_shape(x):
        return (x.shape[-1],)

    def add_ln(x, residual, weight, bias):
        h = x + residual
        return F.layer_norm(h, norm_shape(h), weight, bias, EPS), h

    def add_rms(x, residual, weight):
        h = x + residual
        return F.rms_norm(h, norm_shape(h), weight, EPS), h

    def silu_mul(x):
        a, b = x.chunk(2, dim=-1)
        return (F.silu(a) * b,)

    return {
        "softmax": Spec("softmax", ["x"], [], lambda x: (F.softmax(x, -1),),
                        lambda v, x: (oo.softmax(x, -1, variant=v),)),
        "log_softmax": Spec("log_softmax", ["x"], [], lambda x: (F.log_softmax(x, -1),),
                            lambda v, x: (oo.log_softmax(x, -1, variant=v),)),
        "layer_norm": Spec("layer_norm", ["x"], ["weight", "bias"],
                           lambda x, weight, bias: (F.layer_norm(x, norm_shape(x), weight, bias, EPS),),
                           lambda v, x, weight, bias: (oo.layer_norm(x, norm_shape(x), weight, bias, EPS, variant=v),)),
        "rms_norm": Spec("rms_norm", ["x"], ["weight"],
                         lambda x, weight: (F.rms_norm(x, norm_shape(x), weight, EPS),),
                         lambda v, x, weight: (oo.rms_norm(x, norm_shape(x), weight, EPS, variant=v),)),
        "add_layer_norm": Spec("add_layer_norm", ["x", "residual"], ["weight", "bias"], add_ln,
                               lambda v, x, residual, weight, bias: tuple(oo.add_layer_norm(
                                   x, residual, norm_shape(x), weight, bias, EPS, variant=v))),
        "add_rms_norm": Spec("add_rms_norm", ["x", "residual"], ["weight"], add_rms,
                             lambda v, x, residual, weight: tuple(oo.add_rms_norm(
                                 x, residual, norm_shape(x), weight, EPS, variant=v))),
        "bias_gelu": Spec("bias_gelu", ["x"], ["bias"],
                          lambda x, bias: (F.gelu(x + bias, approximate=gelu_approximate),),
                          lambda v, x, bias: (oo.bias_gelu(x, bias, gelu_approximate, variant=v),)),
        "silu_and_mul": Spec("silu_and_mul", ["x"], [], silu_mul, lambda v, x: (oo.silu_and_mul(x, variant=v),)),
    }


def parse_shape(text):
    parts = text.lower().split("x")
    try:
        rows, width = (int(p) for p in parts)
    except ValueError:
        rows = width = 0
    if len(parts) != 2 or rows < 1 or width < 1:
        raise SystemExit(f"--shapes: fused shapes are ROWSxWIDTH with positive integers; given '{text}'")
    return rows, width


# ---- operands --------------------------------------------------------------------------------

class InputSet:
    """Leaves (requiring grad) and cotangents of one rotating set."""

    def __init__(self, spec, rows, width, dtype, device, gen):
        def uniform(*shape):  # drawn on the device (fast for the large shapes), in float32, then cast
            return (torch.rand(*shape, generator=gen, device=device) * 2 - 1).to(dtype)

        self.leaves = {}
        for name in spec.rows_inputs:
            cols = 2 * width if spec.name == "silu_and_mul" else width
            self.leaves[name] = uniform(rows, cols).requires_grad_()
        for name in spec.vector_inputs:
            self.leaves[name] = uniform(width).requires_grad_()
        n_out = 2 if spec.name.startswith("add_") else 1
        self.cotangents = [uniform(rows, width) for _ in range(n_out)]

    def args(self):
        return list(self.leaves.values())


def run_fwd(fn, s):
    return fn(*s.args())


def run_fwd_bwd(fn, s):
    outs = fn(*s.args())
    return outs, torch.autograd.grad(outs, s.args(), s.cotangents)


# ---- validation ------------------------------------------------------------------------------

def reference_and_check(spec, s0, impls, dname, device, log):
    """Outputs and gradients of each implementation (run once on set 0) against float64, chunked
    over rows. impls: {name: (outs, grads)}. Returns {name: {"fwd": validation, "bwd": validation}}."""
    rows = s0.cotangents[0].shape[0]
    width_total = sum(t.shape[-1] for n, t in s0.leaves.items() if n in spec.rows_inputs)
    chunk = max(1, (1 << 24) // max(width_total, 1))
    names = list(s0.leaves)
    n_out = len(s0.cotangents)
    acc = ErrorAcc(impls)
    record = acc.record
    vec_ref = {}

    for r0 in range(0, rows, chunk):
        sl = slice(r0, min(rows, r0 + chunk))
        leaves64 = []
        for n in names:
            t = s0.leaves[n].detach()
            t64 = (t[sl] if n in spec.rows_inputs else t).double().requires_grad_()
            leaves64.append(t64)
        outs64 = spec.torch_fn(*leaves64)
        grads64 = torch.autograd.grad(outs64, leaves64, [c[sl].double() for c in s0.cotangents])
        for impl, (outs, grads) in impls.items():
            for i in range(n_out):
                record(impl, f"out{i}", outs[i][sl], outs64[i].detach())
            for n, g, g64 in zip(names, grads, grads64):
                if n in spec.rows_inputs:
                    record(impl, f"d{n}", g[sl], g64)
        for n, g64 in zip(names, grads64):
            if n not in spec.rows_inputs:
                vec_ref[n] = vec_ref.get(n, 0) + g64
    for impl, (outs, grads) in impls.items():
        for n, g in zip(names, grads):
            if n not in spec.rows_inputs:
                record(impl, f"d{n}", g, vec_ref[n])

    width = s0.cotangents[0].shape[-1]
    vector_keys = {f"d{n}" for n in names if n not in spec.rows_inputs}
    lengths = {k: rows if k in vector_keys else width for keys in acc.acc.values() for k in keys}  # the reductions
    out = acc.judge(dname, lengths)
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def check_for(direction, v):
    """The validation record of a row: fwd rows the outputs, bwd the gradients, fwd+bwd both."""
    if direction == "fwd":
        return v["fwd"]
    if direction == "bwd":
        return v["bwd"]
    a, b = v["fwd"], v["bwd"]
    return {"passed": a["passed"] and b["passed"], "max_rel_error": max(a["max_rel_error"], b["max_rel_error"]),
            "worst_ratio": max(a["worst_ratio"], b["worst_ratio"]), "checked": a["checked"] + b["checked"],
            "first_failure": a["first_failure"] or b["first_failure"]}


def _validation_json(v):
    return {k: v[k] for k in ("passed", "max_rel_error", "worst_ratio", "checked")}


# ---- the rows --------------------------------------------------------------------------------

def op_rungs(op=None):
    """The rungs of ours for op (None: the row ops' fused ladder); cross_entropy and rope have tables of
    their own (src/fused/cross_entropy_params.h, rope_params.h)."""
    import optimized_ops as oo

    if op == "rope":
        return list(oo.rope_variants())
    if op == "cross_entropy":
        try:
            return list(oo.variants("cross_entropy"))
        except Exception:  # noqa: BLE001 - no Python query for cross-entropy's table yet: its rows, by hand
            return list(CE_RUNGS)
    return list(oo.fused_variants()) + ["triton"]  # the Triton rung (optimized_ops/triton/): TRITON_OPS only


TRITON_OPS = ("softmax", "layer_norm", "rms_norm")  # the row ops with a variant="triton"


def triton_skip(op):
    """Why ours:triton has no row for op here ("" where it runs): another op, or Triton unavailable."""
    import optimized_ops.triton as ot

    if op not in TRITON_OPS:
        return f"no Triton rung for {op} (optimized_ops/triton/ has {', '.join(TRITON_OPS)})"
    ok, why = ot.availability()
    return "" if ok else f"Triton unavailable: {why}"


def resolve_variants(args, device, op=None):
    given = args.variants_arg
    if given is None:
        return ["auto"]
    rungs = op_rungs(op)
    known = dict.fromkeys(op_rungs() + op_rungs("cross_entropy") + op_rungs("rope"))
    out = []
    for name in given:
        if name == "all":
            out += ["auto"] + [v for v in rungs if (v == "cpu") == (device == "cpu")]
        elif name == "auto" or name in rungs:
            if (name == "cpu") == (device == "cpu") or name == "auto":
                out.append(name)
        elif name not in known:  # another op's rung (rope's "cuda") is simply not this op's
            raise SystemExit(f"--variants: expected auto, all or some of {', '.join(known)}; given '{name}'")
    return list(dict.fromkeys(out))


def shapes_by_dtype(args, device):
    if args.dtypes_arg is None and args.shapes_arg is None:
        table = (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)[device]
        return {d: [parse_shape(s) for s in shapes] for d, shapes in table.items()}
    dtypes = args.dtypes_arg or (["bf16"] if device == "cuda" else ["fp32"])
    if args.shapes_arg is None:
        table = (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)[device]
        default = next(iter(table.values()))
        return {d: [parse_shape(s) for s in table.get(d, default)] for d in dtypes}
    return {d: [parse_shape(s) for s in args.shapes_arg] for d in dtypes}


def fused_rows(args, device, timer, ceilings, log, notes):
    """Rows of the fused ops (the family's entry in bench/runner.py); appends to `notes`."""
    import optimized_ops as oo

    notes += ["Python fused rows (bench/benchmark_fused.py): ours = optimized_ops.<op>, torch_eager = the torch "
              "expression, torch_compile = torch.compile of it (default mode, fullgraph, dynamic=False); "
              "vs baseline = torch.compile's time over ours; roofline = fraction of the device copy bandwidth; "
              "fwd = training forward (inputs require grad); bwd = autograd.grad on the graph of an untimed forward "
              "run just before each sample (ahead of the L2 flush); fwd+bwd = both, timed together",
              "Python fused validation: max|impl - float64| <= 2 x max|torch eager - float64| + u max|float64| "
              "per output and gradient"]
    notes += [f"min_bytes {op} {d} = {bytes_formula(op, d)}" for op in (args.fused_ops or FUSED_OPS)
              for d in (args.directions or DIRECTIONS) if (op, d if d != "fwd+bwd" else "fwd") in BYTE_MODEL]

    specs = make_specs(args.gelu)
    ops = args.fused_ops or FUSED_OPS
    for op in ops:
        if op not in specs and op not in CASE_OPS:
            raise SystemExit(f"--fused-ops: expected some of {', '.join(FUSED_OPS)}; given '{op}'")
    directions = args.directions or DIRECTIONS
    for d in directions:
        if d not in DIRECTIONS:
            raise SystemExit(f"--directions: expected some of {', '.join(DIRECTIONS)}; given '{d}'")
    variants = resolve_variants(args, device)
    plan = shapes_by_dtype(args, device)
    bw = next((c for c in ceilings if c["unit"] == "GB/s"), None)
    liger = None
    if not args.no_liger and any(op in LIGER_FUNCTIONS for op in ops):
        liger = load_liger(device, log)
        log(f"fused: liger-kernel {liger.version} from {liger.source}" if liger.version else "fused: no liger-kernel")
        if liger.reason:
            log(f"  its rows are skipped: {liger.reason}")
        notes.append("Python fused peer liger = Liger-Kernel " + (
            f"{liger.version} (from {liger.source}; liger_kernel.ops' autograd.Functions: "
            + ", ".join(f"{op} {LIGER_FUNCTIONS[op]}" for op in ops if op in LIGER_FUNCTIONS)
            + "; rms_norm casting_mode llama, in_place=False); vs_liger = Liger's time over the row's"
            if liger.version else "absent") + (f"; its rows are skipped: {liger.reason}" if liger.reason else ""))
    rows_out = []
    for op in ops:
        if op in CASE_OPS:
            continue
        spec = specs[op]
        impl_names = ([f"ours:{v}" for v in variants] + ["torch_eager"] + ([] if args.no_compile else ["torch_compile"])
                      + (["liger"] if liger is not None and op in LIGER_FUNCTIONS else []))
        for dname, shapes in plan.items():
            dtype = runner.DTYPES[dname]
            elem = torch.tensor([], dtype=dtype).element_size()
            for rows, width in shapes:
                label = f"{rows}x{width}"
                # -- operands: enough sets to cover 2x the cache
                set_bytes = int(min_bytes(op, "fwd", rows, width, elem) + min_bytes(op, "bwd", rows, width, elem))
                budget = (torch.cuda.mem_get_info()[0] // 4) if device == "cuda" else (1 << 30)
                nsets = runner.rotating_set_count(set_bytes, timer.cache_bytes, budget)
                gen = torch.Generator(device=device).manual_seed(4242)
                sets = [InputSet(spec, rows, width, dtype, device, gen) for _ in range(nsets)]
                log(f"fused {op} {dname} {label} ({nsets} input sets)")

                # -- the implementations; ours that cannot run here are skipped rows
                fns, skip = {}, {}
                for v in variants:
                    max_w = oo.fused_registers_max_width(op, dtype, False) if v == "fused_registers" else 0
                    if v == "fused_registers" and op in ("bias_gelu", "silu_and_mul"):
                        skip[f"ours:{v}"] = "elementwise op: fused_registers runs the same kernel as fused_streaming"
                    elif v == "fused_registers" and 0 < max_w < width:
                        skip[f"ours:{v}"] = f"row of {width} elements exceeds fused_registers' {max_w}"
                    elif v == "triton" and triton_skip(op):
                        skip[f"ours:{v}"] = triton_skip(op)
                    fns[f"ours:{v}"] = (lambda f, v: (lambda *a: f(v, *a)))(spec.ours_fn, v)
                fns["torch_eager"] = spec.torch_fn
                if not args.no_compile:
                    torch._dynamo.reset()
                    fns["torch_compile"] = torch.compile(spec.torch_fn, fullgraph=True, dynamic=False)
                if "liger" in impl_names:
                    fns["liger"], why = liger_row_fns(liger, op)
                    if fns["liger"] is None:
                        skip["liger"] = why

                # -- validate every implementation once (compiles and warms up torch.compile)
                results, failed = {}, {}
                for name in impl_names:
                    if name in skip:
                        continue
                    try:
                        outs, grads = run_fwd_bwd(fns[name], sets[0])
                        results[name] = (tuple(o.detach() for o in outs), grads)
                    except Exception as e:  # noqa: BLE001 - reported in the row
                        if name == "liger":  # a peer that cannot run here is a skip, never the run's failure
                            skip[name] = f"liger-kernel raised: {_first_line(e)}"
                            notes.append(f"liger at {op} {dname} {label}: {skip[name]}")
                            continue
                        failed[name] = f"{type(e).__name__}: {e}".splitlines()[0]
                checks = {}
                if "torch_eager" in results:
                    checks = reference_and_check(spec, sets[0], results, dname, device, log)
                del results
                for name, v in checks.items():
                    if not name.startswith("ours:") and not (v["fwd"]["passed"] and v["bwd"]["passed"]):
                        note = (f"{name} at {op} {dname} {label} failed validation "
                                f"({v['fwd']['first_failure'] or v['bwd']['first_failure']}): timed anyway")
                        notes.append(note)
                        log("  note: " + note)

                for direction in directions:
                    mb = min_bytes(op, direction, rows, width, elem)
                    group_rows = {}
                    for name in impl_names:
                        variant = name.split(":", 1)[1] if name.startswith("ours:") else name
                        r = {"op": op, "family": "fused", "direction": direction, "variant": variant,
                             "backend": device, "dtype": dname, "shape": {"rows": rows, "width": width},
                             "shape_label": label,
                             "threads": torch.get_num_threads() if device == "cpu" else None, "status": "ok",
                             "reason": "", "validation": None, "time_ms": None, "flops": 0.0, "min_bytes": mb,
                             "bytes_formula": bytes_formula(op, direction), "tflops": None, "gbps": None,
                             "baseline": None, "vs_baseline": None, "roofline_fraction": None,
                             "roofline_peak": None, "roofline_bandwidth": None, "kernel": None}
                        if variant == "auto" and name.startswith("ours:"):
                            r["resolved_variant"] = oo.resolve_fused_variant(op, dtype, device, width,
                                                                              direction == "bwd")
                        group_rows[name] = r
                        if not ready_to_time(r, name, skip.get(name), failed, checks, direction):
                            continue
                        st = time_direction(fns[name], sets, direction, timer)
                        record_time(r, st, mb, bw, name, direction, log)
                    finish_group(group_rows, mb, timer, device)
                    rows_out += list(group_rows.values())
                del sets, fns
                if device == "cuda":
                    torch.cuda.empty_cache()
    rows_out += case_rows([op for op in ops if op in CASE_OPS], args, device, timer, bw, liger, log, notes)
    return rows_out


def ready_to_time(r, name, skip_reason, failed, checks, direction):
    """Whether row r (implementation `name`) is timed: not when skipped, when its run failed, when torch eager
    (the tolerance's yardstick) failed, or when ours failed validation (a peer that fails is noted and timed)."""
    if skip_reason:
        r.update(status="skipped", reason=skip_reason)
        return False
    if name in failed:
        r.update(status="failed", reason=failed[name])
        return False
    if name not in checks:
        r.update(status="failed", reason="not validated: torch eager (the yardstick of the tolerance) failed: " +
                 failed.get("torch_eager", "?"))
        return False
    v = check_for(direction, checks[name])
    r["validation"] = _validation_json(v)
    if not v["passed"] and name.startswith("ours:"):
        r.update(status="failed", reason="validation: " + v["first_failure"])
        return False
    return True


def record_time(r, st, mb, bw, name, direction, log):
    """A timed row: its statistics, GB/s on its minimum bytes mb, its fraction of the copy ceiling bw."""
    r["time_ms"] = runner.stats_json(st)
    r["gbps"] = mb / (st["median"] * 1e-3) / 1e9
    if bw:
        r["roofline_bandwidth"] = {"name": bw["name"], "value": bw["value"], "unit": "GB/s"}
        r["roofline_fraction"] = r["gbps"] / bw["value"]
    log(f"  {direction:>7} {name:>24}: {st['median']:.4g} ms [{st['p10']:.4g}-{st['p90']:.4g}] "
        f"{r['gbps']:.0f} GB/s" + (f" ({r['roofline_fraction'] * 100:.0f}% of copy)" if bw else ""))


def finish_group(group_rows, mb, timer, device):
    """A group's timed rows against the same-size copy (timed here), the baseline (torch.compile, else torch
    eager) and Liger."""
    copy = same_size_copy(mb, timer, device)
    base_name = "torch_compile" if "torch_compile" in group_rows else "torch_eager"
    base = group_rows[base_name]
    for name, r in group_rows.items():
        if r["status"] != "ok" or r["time_ms"] is None:
            continue
        r["copy_same_size"] = {"time_ms": runner.stats_json(copy), "gbps": mb / (copy["median"] * 1e-3) / 1e9}
        r["vs_copy_same_size"] = copy["median"] / r["time_ms"]["median"]
        if name != base_name and base["status"] == "ok" and base["time_ms"]:
            r["baseline"] = {"name": base_name.replace("_", "."), "time_ms": base["time_ms"],
                             "tflops": 0.0, "validation": base["validation"]}
            r["vs_baseline"] = base["time_ms"]["median"] / r["time_ms"]["median"]
    add_vs_liger(group_rows)


def add_vs_liger(group_rows):
    """vs_liger = Liger's median time over the row's, on every measured row of the group but Liger's."""
    lg = group_rows.get("liger")
    if not lg or lg["status"] != "ok" or not lg["time_ms"]:
        return
    for name, r in group_rows.items():
        if name != "liger" and r["status"] == "ok" and r["time_ms"]:
            r["vs_liger"] = lg["time_ms"]["median"] / r["time_ms"]["median"]


# ---- cross-entropy and RoPE ------------------------------------------------------------------
# Each has a Case: its shape, how a rotating input set is drawn, the implementations, the calls of each
# direction, the byte model and the float64 reference. The rows have the family's schema.

CE_RUNGS = ["cpu", "fused_streaming", "fused_registers"]  # kCrossEntropyVariants (src/fused/cross_entropy_params.h)
CE_SHAPES = {"cuda": {"bf16": ["8192x128256", "4096x32000"]}, "cpu": {"fp32": ["512x32000"]}}
CE_QUICK_SHAPES = {"cuda": {"bf16": ["4096x32000"]}, "cpu": {"fp32": ["128x4096"]}}
CE_LOGIT_SCALE = 4.0  # logits uniform in [-4, 4]: a softmax far from uniform
LCE_SHAPES = {"cuda": {"bf16": ["8192x128256x4096"]}, "cpu": {"fp32": ["64x1000x64"]}}
LCE_QUICK_SHAPES = {"cuda": {"bf16": ["2048x32000x1024"]}, "cpu": {"fp32": ["32x500x32"]}}
ROPE_SHAPES = {"cuda": {"bf16": ["4x4096x32x8x128"]}, "cpu": {"fp32": ["2x512x8x2x128"]}}
ROPE_QUICK_SHAPES = {"cuda": {"bf16": ["4x4096x32x8x128"]}, "cpu": {"fp32": ["1x128x4x2x64"]}}
ROPE_THETA = 10000.0


class CaseSet:
    """One rotating input set: leaves (requiring grad), constants (targets), cotangents, drawn from a seed
    so that refill() restores them after an implementation that writes into its inputs (Liger)."""

    def __init__(self, case, seed):
        self.case, self.seed = case, seed
        self.refill()

    def refill(self):
        self.leaves, self.consts, self.cotangents = self.case.draw(self.seed)

    def clone(self):
        c = CaseSet.__new__(CaseSet)
        c.case, c.seed = self.case, self.seed
        c.leaves = {n: t.detach().clone().requires_grad_() for n, t in self.leaves.items()}
        c.consts = dict(self.consts)
        c.cotangents = [t.clone() for t in self.cotangents]
        return c


class Case:
    op = ""
    directions = DIRECTIONS
    fwd_training = True  # "fwd": the training forward (inputs require grad); False: the loss alone, no grad

    def call(self, fn, s, grad):
        if grad:
            return fn(*s.leaves.values(), *s.consts.values())
        with torch.no_grad():
            return fn(*(t.detach() for t in s.leaves.values()), *s.consts.values())

    def fwd(self, fn, s):
        return self.call(fn, s, self.fwd_training)

    def fwd_bwd(self, fn, s):
        outs = self.call(fn, s, True)
        return outs, torch.autograd.grad(outs, list(s.leaves.values()), s.cotangents)

    def min_bytes(self, direction):
        if direction == "fwd+bwd":
            return self.min_bytes("fwd") + self.min_bytes("bwd")
        return self.bytes[direction][0]

    def add_peers(self, fns, skip, args, liger, eager, liger_call):
        """The peers into fns: torch eager (`eager`), torch.compile of it, and Liger's function for the op
        (`liger_call(its autograd.Function)` -> the call; skipped with the reason where Liger lacks it)."""
        fns["torch_eager"] = eager
        if not args.no_compile:
            fns["torch_compile"] = torch.compile(eager, fullgraph=True, dynamic=False)
        if liger is not None:
            f, why = liger.function(self.op)
            if f is None:
                skip["liger"] = why
            fns["liger"] = liger_call(f)

    def bytes_formula(self, direction):
        if direction == "fwd+bwd" and direction not in self.bytes:
            return f"fwd + bwd: {self.bytes_formula('fwd')}; {self.bytes_formula('bwd')}"
        return self.bytes[direction][1]


class CrossEntropyCase(Case):
    op = "cross_entropy"
    directions = ["fwd", "fwd+bwd"]
    fwd_training = False

    def __init__(self, text, dtype, device):
        parts = text.lower().split("x")
        try:
            self.rows, self.vocab = (int(p) for p in parts)
        except ValueError:
            self.rows = self.vocab = 0
        if len(parts) != 2 or self.rows < 1 or self.vocab < 1:
            raise SystemExit(f"--ce-shapes: TOKENSxVOCAB with positive integers; given '{text}'")
        self.dtype, self.device = dtype, device
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.label = f"{self.rows}x{self.vocab}"
        self.shape = {"rows": self.rows, "width": self.vocab}
        r, v, e = self.rows, self.vocab, self.elem
        self.bytes = {"fwd": (r * v * e + 8 * r, "R*V*E + 8*R (read logits (R x V) and int64 targets; the loss "
                                                  "alone, logits not requiring grad)"),
                      "fwd+bwd": (2 * r * v * e + 8 * r, "2*R*V*E + 8*R (read logits and int64 targets once; "
                                                          "write the logits' gradient once)")}
        self.set_bytes = 2 * r * v * e

    def min_bytes(self, direction):
        return self.bytes[direction][0]

    def draw(self, seed):
        gen = torch.Generator(device=self.device).manual_seed(seed)
        logits = ((torch.rand(self.rows, self.vocab, generator=gen, device=self.device) * 2 - 1)
                  * CE_LOGIT_SCALE).to(self.dtype).requires_grad_()
        target = torch.randint(0, self.vocab, (self.rows,), generator=gen, device=self.device)
        return {"logits": logits}, {"target": target}, [torch.ones((), dtype=self.dtype, device=self.device)]

    def implementations(self, variants, args, liger):
        """{name: fn(logits, target) -> (loss,)}, {name: skip reason}, names that write into their inputs."""
        import optimized_ops as oo

        fns, skip = {}, {}
        for v in variants:
            fns[f"ours:{v}"] = (lambda v: lambda logits, target: (oo.cross_entropy(logits, target, variant=v),))(v)
        if "auto" in variants:
            fns["ours:auto_inplace"] = lambda logits, target: (
                oo.cross_entropy(logits, target, inplace_backward=True, variant="auto"),)
        # Liger: (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
        #  return_z_loss, return_token_accuracy, return_predicted_tokens) -> (loss, z_loss, accuracy, tokens)
        self.add_peers(fns, skip, args, liger, lambda logits, target: (F.cross_entropy(logits, target),),
                       lambda f: lambda logits, target: (f.apply(logits, target, None, -100, 0.0, 0.0, "mean", None,
                                                                 False, False, False)[0],))
        return fns, skip, {"ours:auto_inplace", "liger"}

    def skip_direction(self, name, direction):
        if name == "ours:auto_inplace" and direction == "fwd":
            return "without a gradient to compute, inplace_backward changes nothing (the auto row)"
        return ""

    def check(self, s0, results, dname):
        """results: {name: (fwd outs, fwd+bwd outs, grads)} -> {name: {"fwd": ..., "bwd": ...}}."""
        logits, target = s0.leaves["logits"].detach(), s0.consts["target"]
        g = s0.cotangents[0].double()
        acc = ErrorAcc(results)
        chunk = max(1, (1 << 24) // self.vocab)
        loss_sum = torch.zeros((), dtype=torch.float64, device=logits.device)
        for r0 in range(0, self.rows, chunk):
            sl = slice(r0, min(self.rows, r0 + chunk))
            x64 = logits[sl].double().requires_grad_()
            losses = F.cross_entropy(x64, target[sl], reduction="none")
            (gx,) = torch.autograd.grad(losses.sum(), [x64])
            loss_sum += losses.detach().sum()
            for name, (_, _, grads) in results.items():
                acc.record(name, "dlogits", grads[0][sl], gx * (g / self.rows))
        ref = loss_sum / self.rows
        for name, (fwd_outs, outs, _) in results.items():
            acc.record(name, "out0", fwd_outs[0], ref)
            acc.record(name, "out0", outs[0], ref)
        return acc.judge(dname, {"out0": self.vocab + self.rows, "dlogits": self.vocab})


class LinearCrossEntropyCase(Case):
    """cross_entropy(hidden @ weight.T, target), mean over the tokens: ours chunks over the tokens so the (T, V)
    logits never exist; torch's F.linear + F.cross_entropy materializes them (and their gradient). Rows carry
    TFLOP/s of the GEMMs' flops and, fwd+bwd, the peak memory the call allocated beyond its inputs."""
    op = "linear_cross_entropy"
    directions = ["fwd", "fwd+bwd"]
    fwd_training = False
    measure_memory = True

    def __init__(self, text, dtype, device):
        parts = text.lower().split("x")
        try:
            self.rows, self.vocab, self.d = (int(p) for p in parts)
        except ValueError:
            self.rows = self.vocab = self.d = 0
        if len(parts) != 3 or min(self.rows, self.vocab, self.d) < 1:
            raise SystemExit(f"--lce-shapes: TOKENSxVOCABxD with positive integers; given '{text}'")
        self.dtype, self.device = dtype, device
        self.elem = e = torch.tensor([], dtype=dtype).element_size()
        self.label = f"{self.rows}x{self.vocab}x{self.d}"
        self.shape = {"rows": self.rows, "width": self.vocab, "d": self.d}
        t, v, d = self.rows, self.vocab, self.d
        inputs = (t * d + v * d) * e + 8 * t
        self.bytes = {"fwd": (inputs, "(T*d + V*d)*E + 8*T (read hidden, weight and int64 targets)"),
                      "fwd+bwd": (inputs + (t * d + v * d) * e, "2*(T*d + V*d)*E + 8*T (read hidden, weight, "
                                                                   "targets; write their gradients)")}
        self.flops = {"fwd": 2.0 * t * v * d, "fwd+bwd": 6.0 * t * v * d}
        self.set_bytes = 2 * (t * d + v * d) * e

    def min_bytes(self, direction):
        return self.bytes[direction][0]

    def draw(self, seed):
        gen = torch.Generator(device=self.device).manual_seed(seed)
        # hidden ~ U(-1, 1), weight ~ U(-1, 1) / sqrt(d): logits of a few units, a softmax far from uniform
        hidden = (torch.rand(self.rows, self.d, generator=gen, device=self.device) * 2 - 1).to(self.dtype)
        weight = ((torch.rand(self.vocab, self.d, generator=gen, device=self.device) * 2 - 1)
                  * (3.0 / math.sqrt(self.d))).to(self.dtype)
        target = torch.randint(0, self.vocab, (self.rows,), generator=gen, device=self.device)
        return ({"hidden": hidden.requires_grad_(), "weight": weight.requires_grad_()}, {"target": target},
                [torch.ones((), dtype=self.dtype, device=self.device)])

    def implementations(self, variants, args, liger):
        import optimized_ops as oo

        fns, skip = {}, {}
        fns["ours:auto"] = lambda h, w, target: (oo.linear_cross_entropy(h, w, target),)
        # Liger: (input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
        #  reduction, softcap, return_z_loss, accum_dtype, ...) -> (loss, z_loss, token_accuracy, predicted_tokens)
        self.add_peers(fns, skip, args, liger, lambda h, w, target: (F.cross_entropy(F.linear(h, w), target),),
                       lambda f: lambda h, w, target: (f.apply(h, w, target, None, None, -100, 0.0, 0.0, "mean", None,
                                                               False, None)[0],))
        return fns, skip, set()

    def skip_direction(self, name, direction):
        return ""

    def check(self, s0, results, dname):
        h, w, target = s0.leaves["hidden"].detach(), s0.leaves["weight"].detach(), s0.consts["target"]
        g = s0.cotangents[0].double()
        acc = ErrorAcc(results)
        w64 = w.double()
        dw64 = torch.zeros_like(w64)
        chunk = max(1, (1 << 26) // self.vocab)
        loss_sum = torch.zeros((), dtype=torch.float64, device=h.device)
        for r0 in range(0, self.rows, chunk):
            sl = slice(r0, min(self.rows, r0 + chunk))
            h64 = h[sl].double().requires_grad_()
            wl = w64.detach().requires_grad_()
            losses = F.cross_entropy(F.linear(h64, wl), target[sl], reduction="none")
            gh, gw = torch.autograd.grad(losses.sum() * (g / self.rows), [h64, wl])
            loss_sum += losses.detach().sum()
            dw64 += gw
            for name, (_, _, grads) in results.items():
                acc.record(name, "dhidden", grads[0][sl], gh)
            del h64, wl, losses, gh, gw
        for name, (fwd_outs, outs, grads) in results.items():
            acc.record(name, "out0", fwd_outs[0], loss_sum / self.rows)
            acc.record(name, "out0", outs[0], loss_sum / self.rows)
            acc.record(name, "dweight", grads[1], dw64)
        return acc.judge(dname, {"out0": self.d + self.vocab + self.rows, "dhidden": self.vocab + self.d,
                                 "dweight": self.rows + self.d})


class RopeCase(Case):
    op = "rope"

    def __init__(self, text, dtype, device):
        parts = text.lower().split("x")
        try:
            b, s, hq, hk, d = (int(p) for p in parts)
        except ValueError:
            b = s = hq = hk = d = 0
        if len(parts) != 5 or min(b, s, hq, hk, d) < 1 or d % 2:
            raise SystemExit(f"--rope-shapes: BxSxHQxHKxD with positive integers, D even; given '{text}'")
        self.b, self.s, self.hq, self.hk, self.d = b, s, hq, hk, d
        self.dtype, self.device = dtype, device
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.label = f"B{b}xS{s}xHq{hq}xHk{hk}xD{d}"
        self.shape = {"batch": b, "seqlen": s, "heads_q": hq, "heads_k": hk, "head_dim": d}
        n = 2 * b * s * (hq + hk) * d * self.elem
        self.bytes = {"fwd": (n, "2*B*S*(Hq+Hk)*D*E (read q, k; write q_out, k_out; cos/sin and positions not "
                                 "counted)"),
                      "bwd": (n, "2*B*S*(Hq+Hk)*D*E (read dq_out, dk_out; write dq, dk)")}
        self.set_bytes = 2 * n
        # positions arange(S); HF LlamaRotaryEmbedding's cos/sin (float32 math, cast to q's dtype), (S, D)
        self.positions = torch.arange(s, device=device)
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        freqs = self.positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        inv64 = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
        emb64 = torch.cat((self.positions.double()[:, None] * inv64[None, :],) * 2, dim=-1)
        self.cos64, self.sin64 = emb64.cos(), emb64.sin()

    def draw(self, seed):
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def uniform(*shape):
            return (torch.rand(*shape, generator=gen, device=self.device) * 2 - 1).to(self.dtype)

        q = uniform(self.b, self.s, self.hq, self.d).requires_grad_()
        k = uniform(self.b, self.s, self.hk, self.d).requires_grad_()
        cotangents = [uniform(self.b, self.s, self.hq, self.d), uniform(self.b, self.s, self.hk, self.d)]
        return {"q": q, "k": k}, {}, cotangents

    @staticmethod
    def hf(q, k, cos, sin):
        """HF's apply_rotary_pos_emb on (B, S, H, D): cos/sin (S, D) broadcast over the heads."""
        def rotate_half(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), dim=-1)

        c, s_ = cos[:, None, :], sin[:, None, :]
        return q * c + rotate_half(q) * s_, k * c + rotate_half(k) * s_

    def implementations(self, variants, args, liger):
        import optimized_ops as oo

        fns, skip = {}, {}
        positions, cos, sin = self.positions, self.cos, self.sin
        for v in variants:
            fns[f"ours:{v}"] = (lambda v: lambda q, k: tuple(
                oo.rope(q, k, positions, theta=ROPE_THETA, layout="neox", variant=v)))(v)
        cos1, sin1 = cos[None], sin[None]  # (1, S, D)

        def liger_rope(f):
            def call(q, k):
                # LigerRopeFunction takes HF's (B, H, S, D) views; it rotates their storage in place
                qo, ko = f.apply(q.transpose(1, 2), k.transpose(1, 2), cos1, sin1)
                return qo.transpose(1, 2), ko.transpose(1, 2)
            return call

        self.add_peers(fns, skip, args, liger, lambda q, k: RopeCase.hf(q, k, cos, sin), liger_rope)
        return fns, skip, {"liger"}

    def skip_direction(self, name, direction):
        return ""

    def check(self, s0, results, dname):
        q64 = s0.leaves["q"].detach().double().requires_grad_()
        k64 = s0.leaves["k"].detach().double().requires_grad_()
        outs64 = RopeCase.hf(q64, k64, self.cos64, self.sin64)
        grads64 = torch.autograd.grad(outs64, [q64, k64], [c.double() for c in s0.cotangents])
        acc = ErrorAcc(results)
        for name, (fwd_outs, outs, grads) in results.items():
            for i in range(2):
                acc.record(name, f"out{i}", fwd_outs[i], outs64[i].detach())
                acc.record(name, f"out{i}", outs[i], outs64[i].detach())
            acc.record(name, "dq", grads[0], grads64[0])
            acc.record(name, "dk", grads[1], grads64[1])
        return acc.judge(dname, {"out0": 2, "out1": 2, "dq": 2, "dk": 2})


class ErrorAcc:
    """max |got - ref| and max |ref| per (implementation, tensor), then the fused rule against torch eager's
    error (the format of reference_and_check's result)."""

    def __init__(self, impls):
        self.acc = {k: {} for k in impls}

    def record(self, impl, key, got, ref):
        err = (got.detach().double() - ref).abs()
        e = math.inf if torch.isnan(err).any().item() else err.max().item() if err.numel() else 0.0
        m = ref.abs().max().item() if ref.numel() else 0.0
        cur = self.acc[impl].setdefault(key, [0.0, 0.0, 0])
        cur[0], cur[1], cur[2] = max(cur[0], e), max(cur[1], m), cur[2] + ref.numel()

    def judge(self, dname, lengths):
        eager = self.acc["torch_eager"]
        out = {}
        for impl, keys in self.acc.items():
            res = {}
            for direction, names in (("fwd", [k for k in keys if k.startswith("out")]),
                                     ("bwd", [k for k in keys if k.startswith("d")])):
                worst, max_rel, checked, first = 0.0, 0.0, 0, ""
                for k in names:
                    err, mag, n = keys[k]
                    allowed = reduction_allowed_error(dname, lengths[k], eager[k][0], mag, 0.0, 2.0**-24)
                    ratio = err / allowed
                    if ratio > 1 and not first:
                        first = f"{k}: max error {err:.3g}, allowed {allowed:.3g} (torch eager {eager[k][0]:.3g})"
                    worst, checked = max(worst, ratio), checked + n
                    max_rel = max(max_rel, err / mag if mag > 0 else 0.0)
                res[direction] = {"passed": worst <= 1.0, "max_rel_error": max_rel, "worst_ratio": worst,
                                  "checked": checked, "first_failure": first}
            out[impl] = res
        return out


def case_plan(op, args, device):
    """[(dtype name, shape text)] of a case op: --ce-shapes / --rope-shapes, --dtypes, else the defaults."""
    given = {"cross_entropy": args.ce_shapes, "rope": args.rope_shapes, "linear_cross_entropy": args.lce_shapes}[op]
    table = ({"cross_entropy": CE_QUICK_SHAPES, "rope": ROPE_QUICK_SHAPES, "linear_cross_entropy": LCE_QUICK_SHAPES}
             if args.quick else {"cross_entropy": CE_SHAPES, "rope": ROPE_SHAPES, "linear_cross_entropy": LCE_SHAPES}
             )[op][device]
    dtypes = args.dtypes_arg or list(table)
    default = next(iter(table.values()))
    return [(d, text) for d in dtypes for text in (given.split(",") if given else table.get(d, default))]


def case_time(case, fn, sets, direction, timer):
    n = len(sets)
    if direction == "fwd":
        return timer.measure(lambda i: case.fwd(fn, sets[i % n]))
    if direction == "fwd+bwd":
        return timer.measure(lambda i: case.fwd_bwd(fn, sets[i % n]))
    graph = {}  # the training forward of sample i, run untimed before it

    def forward(i):
        graph["outs"] = case.call(fn, sets[i % n], True)

    def backward(i):
        s = sets[i % n]
        return torch.autograd.grad(graph.pop("outs"), list(s.leaves.values()), s.cotangents)

    return timer.measure(backward, before=forward)


def new_row(case, direction, variant, device, dname):
    return {"op": case.op, "family": "fused", "direction": direction, "variant": variant, "backend": device,
            "dtype": dname, "shape": dict(case.shape), "shape_label": case.label,
            "threads": torch.get_num_threads() if device == "cpu" else None, "status": "ok", "reason": "",
            "validation": None, "time_ms": None, "flops": 0.0, "min_bytes": case.min_bytes(direction),
            "bytes_formula": case.bytes_formula(direction), "tflops": None, "gbps": None, "baseline": None,
            "vs_baseline": None, "roofline_fraction": None, "roofline_peak": None, "roofline_bandwidth": None,
            "kernel": None}


def case_rows(ops, args, device, timer, bw, liger, log, notes):
    """The rows of cross_entropy and rope (ops among CASE_OPS)."""
    if not ops:
        return []
    directions = args.directions or DIRECTIONS
    rows_out = []
    for op in ops:
        # linear_cross_entropy: ours is its auto (its `variant` picks the linear family's GEMM rung, another ladder)
        variants = ["auto"] if op == "linear_cross_entropy" else resolve_variants(args, device, op)
        cls = {"cross_entropy": CrossEntropyCase, "rope": RopeCase, "linear_cross_entropy": LinearCrossEntropyCase}[op]
        for dname, text in case_plan(op, args, device):
            dtype = runner.DTYPES[dname]
            case = cls(text, dtype, device)
            for d in [d for d in directions if d in case.directions]:
                note = f"min_bytes {op} {d} = {case.bytes_formula(d)}"
                if note.split(" = ")[0] not in {n.split(" = ")[0] for n in notes}:
                    notes.append(note)
            budget = (torch.cuda.mem_get_info()[0] // 4) if device == "cuda" else (1 << 30)
            nsets = runner.rotating_set_count(case.set_bytes, timer.cache_bytes, budget)
            sets = [CaseSet(case, 4242 + i) for i in range(nsets)]
            log(f"fused {op} {dname} {case.label} ({nsets} input sets)")
            if not args.no_compile:
                torch._dynamo.reset()
            fns, skip, clobbers = case.implementations(variants, args, liger)
            names = list(fns)

            # -- validate: the direction "fwd" and fwd+bwd of each, once on set 0 (a copy for those that
            #    write into their inputs); compiles torch.compile's graphs and warms Triton up
            results, failed = {}, {}
            for name in names:
                if name in skip:
                    continue
                try:
                    s = sets[0].clone() if name in clobbers else sets[0]
                    fwd_outs = tuple(o.detach() for o in case.fwd(fns[name], s))
                    s = sets[0].clone() if name in clobbers else sets[0]
                    outs, grads = case.fwd_bwd(fns[name], s)
                    results[name] = (fwd_outs, tuple(o.detach() for o in outs), grads)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    if name == "liger":
                        skip[name] = f"liger-kernel raised: {_first_line(e)}"
                        notes.append(f"liger at {op} {dname} {case.label}: {skip[name]}")
                        continue
                    failed[name] = _first_line(e)
            checks = case.check(sets[0], results, dname) if "torch_eager" in results else {}
            del results
            if device == "cuda":
                torch.cuda.empty_cache()
            for name, v in checks.items():
                if not name.startswith("ours:") and not (v["fwd"]["passed"] and v["bwd"]["passed"]):
                    note = (f"{name} at {op} {dname} {case.label} failed validation "
                            f"({v['fwd']['first_failure'] or v['bwd']['first_failure']}): timed anyway")
                    notes.append(note)
                    log("  note: " + note)

            for direction in [d for d in directions if d in case.directions]:
                mb = case.min_bytes(direction)
                group_rows = {}
                for name in names:
                    variant = name.split(":", 1)[1] if name.startswith("ours:") else name
                    r = new_row(case, direction, variant, device, dname)
                    if name.startswith("ours:") and variant.startswith("auto") and op != "linear_cross_entropy":
                        r["resolved_variant"] = {"rope": "cuda", "cross_entropy": "fused_streaming"}[op] \
                            if device == "cuda" else "cpu"
                    if hasattr(case, "flops"):
                        r["flops"] = case.flops[direction]
                    group_rows[name] = r
                    why = skip.get(name) or case.skip_direction(name, direction)
                    if not ready_to_time(r, name, why, failed, checks, direction):
                        continue
                    try:
                        st = case_time(case, fns[name], sets, direction, timer)
                    except Exception as e:  # noqa: BLE001
                        r.update(status="skipped" if name == "liger" else "failed",
                                 reason=("liger-kernel raised: " if name == "liger" else "") + _first_line(e))
                        continue
                    finally:
                        if name in clobbers:  # its writes into the sets are undone for the next ones
                            for s in sets:
                                s.refill()
                    record_time(r, st, mb, bw, name, direction, log)
                    if r["flops"]:
                        r["tflops"] = r["flops"] / (st["median"] * 1e-3) / 1e12
                    if getattr(case, "measure_memory", False) and direction == "fwd+bwd" and device == "cuda":
                        r["peak_memory_bytes"] = case_peak_memory(case, fns[name], sets[0])
                        log(f"  {'':>7} {name:>24}: {r['tflops']:.1f} TFLOP/s, peak "
                            f"{r['peak_memory_bytes'] / 2**20:.0f} MiB beyond the inputs")
                finish_group(group_rows, mb, timer, device)
                add_vs_memory(group_rows)
                rows_out += list(group_rows.values())
            del sets, fns
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows_out


def case_peak_memory(case, fn, s):
    """CUDA bytes allocated at the peak of one fwd+bwd beyond what was allocated before it (the inputs); the
    outputs and gradients are dropped afterwards."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = case.fwd_bwd(fn, s)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del outs
    return peak


def add_vs_memory(group_rows):
    """memory_vs_torch_eager = torch eager's peak over the row's (> 1: less memory than eager)."""
    eager = group_rows.get("torch_eager")
    if not eager or not eager.get("peak_memory_bytes"):
        return
    for r in group_rows.values():
        if r.get("peak_memory_bytes"):
            r["memory_vs_torch_eager"] = eager["peak_memory_bytes"] / r["peak_memory_bytes"]


def time_direction(fn, sets, direction, timer):
    n = len(sets)
    if direction == "fwd":
        return timer.measure(lambda i: run_fwd(fn, sets[i % n]))
    if direction == "fwd+bwd":
        return timer.measure(lambda i: run_fwd_bwd(fn, sets[i % n]))
    graph = {}  # the forward of sample i, run untimed before it

    def forward(i):
        graph["outs"] = fn(*sets[i % n].args())

    def backward(i):
        outs = graph.pop("outs")
        return torch.autograd.grad(outs, sets[i % n].args(), sets[i % n].cotangents)

    return timer.measure(backward, before=forward)


def same_size_copy(nbytes, timer, device):

    half = max(16, int(nbytes // 2))
    budget = (torch.cuda.mem_get_info()[0] // 4) if device == "cuda" else (1 << 30)
    pairs = runner.rotating_set_count(2 * half, timer.cache_bytes, budget)
    bufs = [(torch.empty(half, dtype=torch.uint8, device=device).fill_(60),
             torch.empty(half, dtype=torch.uint8, device=device)) for _ in range(pairs)]
    st = timer.measure(lambda i: bufs[i % pairs][1].copy_(bufs[i % pairs][0]))
    del bufs
    return st


# ---- the plot --------------------------------------------------------------------------------

def plot_fused(report, path):
    """One PNG for the family: a panel per (op, direction), GB/s of each implementation per
    (dtype, shape), the measured copy bandwidth as a dashed line. Returns [path] or []."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmark_fused: matplotlib is not installed: no plot", file=sys.stderr)
        return []
    rows = [r for r in report["results"] if r.get("family") == "fused" and r["status"] == "ok"]
    if not rows:
        return []
    ops = list(dict.fromkeys(r["op"] for r in rows))
    directions = [d for d in DIRECTIONS if any(r["direction"] == d for r in rows)]
    impls = list(dict.fromkeys(r["variant"] for r in rows))
    bw = next((c for c in report.get("ceilings", []) if c["unit"] == "GB/s"), None)
    machine = report["machine"].get("gpu") or f"CPU ({report['machine'].get('cpu')})"
    fig, axes = plt.subplots(len(ops), len(directions), figsize=(5.2 * len(directions), 2.9 * len(ops)),
                             squeeze=False)
    cmap = plt.get_cmap("viridis")
    colors = {"torch_eager": "#ff7f0e", "torch_compile": "#d62728", "liger": "#2ca02c"}
    ours = [v for v in impls if v not in colors]
    for i, v in enumerate(ours):
        colors[v] = cmap(0.15 + 0.7 * i / max(len(ours) - 1, 1))
    for oi, op in enumerate(ops):
        for di, direction in enumerate(directions):
            ax = axes[oi, di]
            sel = [r for r in rows if r["op"] == op and r["direction"] == direction]
            groups = list(dict.fromkeys((r["dtype"], r["shape_label"]) for r in sel))
            width = 0.8 / max(len(impls), 1)
            for vi, v in enumerate(impls):
                ys = []
                for g in groups:
                    m = next((r for r in sel if (r["dtype"], r["shape_label"]) == g and r["variant"] == v), None)
                    ys.append(m["gbps"] if m else 0)
                xs = [k + (vi - (len(impls) - 1) / 2) * width for k in range(len(groups))]
                label = v if v.startswith("torch") else "Liger-Kernel" if v == "liger" else f"optimized_ops {v}"
                ax.bar(xs, ys, width, label=label, color=colors[v])
            if bw:
                ax.axhline(bw["value"], color="black", linestyle="--", linewidth=0.8)
                ax.axhline(0.9 * bw["value"], color="gray", linestyle=":", linewidth=0.8)
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels([f"{d}\n{s}" for d, s in groups], fontsize=7)
            ax.set_title(f"{op} {direction}", fontsize=9)
            ax.set_ylabel("GB/s (min bytes)", fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    extra = "; dashed: device copy, dotted: 90% of it" if bw else ""
    fig.suptitle(f"fused ops on {machine}: GB/s of the minimum bytes{extra}", fontsize=11)
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(labels))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def prepare(args, device):
    args.fused_ops = args.fused_ops.split(",") if args.fused_ops else None
    args.directions = args.directions.split(",") if args.directions else None


def add_arguments(p):
    p.add_argument("--fused-ops", default=None, help=f"fused: comma list of {', '.join(FUSED_OPS)}")
    p.add_argument("--directions", default=None, help="fused: comma list of fwd, bwd, fwd+bwd (default all)")
    p.add_argument("--gelu", default="none", choices=["none", "tanh"], help="fused: bias_gelu's form")
    p.add_argument("--no-compile", action="store_true", help="fused: leave out the torch.compile rows")
    p.add_argument("--no-liger", action="store_true", help="fused: leave out the Liger-Kernel rows")
    p.add_argument("--ce-shapes", default=None,
                   help="fused: cross_entropy shapes TOKENSxVOCAB (default 8192x128256,4096x32000 on CUDA)")
    p.add_argument("--lce-shapes", default=None,
                   help="fused: linear_cross_entropy shapes TOKENSxVOCABxD, comma-separated (default 8192x128256x4096 "
                        "bf16 on CUDA)")
    p.add_argument("--rope-shapes", default=None,
                   help="fused: rope shapes BxSxHQxHKxD (default 4x4096x32x8x128 on CUDA)")


FAMILY = runner.register(runner.Family(
    "fused", rows=fused_rows, add_arguments=add_arguments, prepare=prepare, plot=plot_fused,
    summary="the fused ops, cross-entropy and RoPE vs torch eager, torch.compile and Liger-Kernel "
            "(bench/benchmark_fused.py)"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return runner.main(["--ops", "fused", *argv])


if __name__ == "__main__":
    sys.exit(main())
