#!/usr/bin/env python3
"""Python benchmark of the linear family (issue 15's targets): optimized_ops.linear (y = act(x W^T + b), autograd
on our dgrad / wgrad / bgrad) against torch eager F.linear + the activation, torch.compile of it, and the GEMMs
alone, forward and forward+backward, in one run.

    python bench/benchmark_linear.py [--device cuda|cpu] [--variants all|auto|NAME,...] [--dtypes bf16,...]
        [--shapes MxNxK,...] [--linear-cases seed,layer,skinny] [--no-compile] [--quick] [--out bench/results]

is `python bench/benchmark_all.py --ops linear ...` (bench/runner.py: the harness, statistics, cold-cache timing
with CUDA events, rotating inputs, ceilings, output files, the registry).

Shapes are M x N x K: x (M, K), W (N, K) as torch.nn.Linear stores it, b (N), y (M, N). Inputs uniform in
[-1, 1) (x, dy) and [-1/sqrt(K), 1/sqrt(K)) (W, b: nn.Linear's init, so that the pre-activation is O(1) and
GELU is not linear); rotating input sets covering 2x the cache.

Cases (the row field "case"):
  seed    the seed's 1M-parameter layer: M = 256, N = K = 1024, bias, no activation; fp32 (and bf16 on CUDA,
          where fused / persistent run); every variant of optimized_ops.variants("linear") for the device
          (CUDA: naive, fused, persistent, auto; CPU: cpu) and the peer `eager` (F.linear); on CUDA also the
          cpu rung and eager on the host (backend "cpu", fp32): the seed's CPU / GPU naive / GPU optimized table.
  layer   bf16 (fp32 on the CPU) 4096 tokens x 4096 -> 16384, bias, GELU (erf): every variant but naive (named
          in --variants to include it), `eager` = F.gelu(F.linear(x, W, b)) and its autograd, `compile` =
          torch.compile of that function (fullgraph, dynamic=False; compiled by the validation run, outside the
          timed region; skipped with the reason when it fails), and `gemm_only`: the GEMMs alone, forward
          torch.matmul(x, W.t()), fwd+bwd that plus dX = dy W and dW = dy^T x (no bias, no activation, not
          validated: the yardstick of "the epilogues are nearly free"). vs_gemms = gemm_only's time / the
          row's (target: >= 1/1.05), vs_compile = compile's time / the row's (target >= 1.0), vs_baseline =
          eager's time / the row's (target >= 1.05).
          fp8 rows (CUDA): `persistent-fp8` and `auto-fp8` = ours with fp8=True (x, W e4m3, g e5m2, per-tensor
          current scaling), against `eager_fp8` = the same recipe on torch._scaled_mm (vs_eager_fp8) and eager
          bf16 (vs_baseline); validated with the quantization's worst case added to the rule below.
  skinny  forward only, M = 32 and 128, 4096 -> 16384, GELU, vs eager (target >= 1.0).
Directions: fwd = the inference forward (under torch.no_grad(): nothing kept for a backward); fwd+bwd = x, W
and b requiring grad, y = f(x, W, b), then torch.autograd.grad(y, (x, W, b), dy) with a fixed upstream
gradient dy, timed together (as bench/benchmark_attention.py's fwd+bwd).

Validation (before any timing): on input set 0, the forward output and (fwd+bwd) dX, dW, db against float64
torch (F.linear + the activation, autograd) with the linear family's rule, the GEMM rule of bench/tolerance.py
(gemm_allowed_error) carried through the activation as src/testing/linear_reference.h does: per element
  y:  gemm_allowed_error(dtype, K, y, 1.2 mag) + 8 u_acc (|pre| + |y|),  mag = |x| |W|^T + |b|
  g = dy act'(pre), its error e_g = |dy| (8 sqrt(K) u_acc mag + u |pre| + 8 u_acc (1 + |pre|)) + u |g| (the
      saved pre rounded to the dtype, g materialized in it; 0 without an activation)
  dX: gemm_allowed_error(dtype, N, dX, |g| |W|) + e_g |W|       (reduction over N, the output features)
  dW: gemm_allowed_error(dtype, M, dW, |g|^T |x|) + e_g^T |x|   (reduction over M, the rows)
  db: u |db| + floor + sum_i e_g + (M + 1) u_acc sum_i |g|      (reduction over M)
A rung that fails is a "failed" row, not timed; a peer that fails is noted and timed anyway (eager bf16 rounds
the pre-activation before GELU, which this rule does not allow for: expect that note on bf16 rows).

Output: python-linear.{json,md} under --out/<gpu>/ (bench/runner.py names the files python-<family>).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
from tolerance import HALF_SUBNORMAL_STEP, accumulation_unit, dtype_name, gemm_allowed_error, unit_roundoff  # noqa: E402

CASES = ["seed", "layer", "skinny"]
CUDA_RUNGS = ["naive", "fused", "persistent", "auto"]
CASE_ACTIVATION = {"seed": "none", "layer": "gelu", "skinny": "gelu"}
CASE_DIRECTIONS = {"seed": ["fwd", "fwd+bwd"], "layer": ["fwd", "fwd+bwd"], "skinny": ["fwd"]}
CASE_PEERS = {"seed": ["eager"], "layer": ["eager", "compile", "gemm_only", "eager_fp8"], "skinny": ["eager"]}
# fp8 rows (the layer case on CUDA): ours with fp8=True, named "<rung>-fp8", and the peer eager_fp8.
FP8_RUNGS = ["persistent", "auto"]
FP8_PEERS = {"eager_fp8"}

# Per device and case: dtypes and shapes (M, N, K).
DEFAULTS = {
    "cuda": {"seed": (["fp32", "bf16"], [(256, 1024, 1024)]),
             "layer": (["bf16"], [(4096, 16384, 4096)]),
             "skinny": (["bf16"], [(32, 16384, 4096), (128, 16384, 4096)])},
    "cpu": {"seed": (["fp32"], [(256, 1024, 1024)]),
            "layer": (["fp32"], [(256, 4096, 1024)]),
            "skinny": (["fp32"], [(8, 4096, 1024), (32, 4096, 1024)])},
}
QUICK = {
    "cuda": {"seed": (["fp32", "bf16"], [(256, 1024, 1024)]),
             "layer": (["bf16"], [(2048, 8192, 2048)]),
             "skinny": (["bf16"], [(32, 8192, 2048)])},
    "cpu": {"seed": (["fp32"], [(16, 64, 64)]),
            "layer": (["fp32"], [(64, 256, 128)]),
            "skinny": (["fp32"], [(4, 256, 128)])},
}
SEED_HOST = (["fp32"], [(256, 1024, 1024)])  # the seed's CPU rows on a CUDA run


def _reason(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# ---- the model: flops, bytes --------------------------------------------------------------------

def flops(direction, m, n, k):
    return (2.0 if direction == "fwd" else 6.0) * m * n * k


def min_bytes(direction, act, m, n, k, elem):
    """fwd: read x, W, b; write y. fwd+bwd: the training forward (+ pre written with an activation), then read dy,
    x, W (+ pre), write dX, dW, db."""
    fwd = (m * k + n * k + n + m * n) * elem
    if direction == "fwd":
        return fwd
    pre = m * n * elem if act != "none" else 0
    return fwd + pre + (m * n + m * k + n * k) * elem + pre + (m * k + n * k + n) * elem


def bytes_formula(direction, act):
    if direction == "fwd":
        return "(M*K + N*K + N + M*N)*E (read x, W, b; write y)"
    if act == "none":
        return "(M*K + N*K + N + M*N)*E + (M*N + M*K + N*K)*E + (M*K + N*K + N)*E (fwd; read dy, x, W; write dX, dW, db)"
    return ("(M*K + N*K + N + 2*M*N)*E + (2*M*N + M*K + N*K)*E + (M*K + N*K + N)*E "
            "(fwd + pre written; read dy, pre, x, W; write dX, dW, db)")


# ---- operands -----------------------------------------------------------------------------------

class InputSet:
    def __init__(self, m, n, k, dtype, device, gen):
        def uniform(*shape, scale=1.0):  # drawn in float32 on the device, scaled, then rounded once
            return ((torch.rand(*shape, generator=gen, device=device) * 2 - 1) * scale).to(dtype)

        s = 1.0 / math.sqrt(k)
        self.x = uniform(m, k).requires_grad_()
        self.w = uniform(n, k, scale=s).requires_grad_()
        self.b = uniform(n, scale=s).requires_grad_()
        self.dy = uniform(m, n)
        # for gemm_only (no autograd)
        self.xd, self.wd = self.x.detach(), self.w.detach()

    def leaves(self):
        return (self.x, self.w, self.b)


def is_fp8(name):
    return name.endswith("-fp8") or name in FP8_PEERS


def run_fwd(fn, s):
    with torch.no_grad():
        return fn(s.x, s.w, s.b)


def run_fwd_bwd(fn, s):
    y = fn(s.x, s.w, s.b)
    return y, torch.autograd.grad(y, s.leaves(), s.dy)


def gemms_fwd(s):
    with torch.no_grad():
        return torch.matmul(s.xd, s.wd.t())


def gemms_fwd_bwd(s):
    with torch.no_grad():
        return torch.matmul(s.xd, s.wd.t()), torch.matmul(s.dy, s.wd), torch.matmul(s.dy.t(), s.xd)


def torch_act(z, act):
    return F.gelu(z) if act == "gelu" else z


def make_eager(act):
    def eager(x, w, b):
        return torch_act(F.linear(x, w, b), act)
    return eager


def make_ours(oo, act, variant):
    activation = None if act == "none" else act
    fp8 = variant.endswith("-fp8")
    rung = variant.removesuffix("-fp8")

    def ours(x, w, b):
        return oo.linear(x, w, b, activation=activation, variant=rung, fp8=fp8)
    return ours


# ---- the fp8 peer: torch._scaled_mm with per-tensor current scaling (what torchao's Float8Linear does with
# its "tensorwise" recipe), an autograd.Function: x, W e4m3, g e5m2, each scaled by fp8_max / amax of its own
# values; the transposed copies _scaled_mm needs (its mat2 column-major) made by .t().contiguous().

def _to_fp8(t, fmt):
    fmax = torch.finfo(fmt).max
    amax = t.detach().abs().amax().float()
    q = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    return (t.float() * q).clamp(-fmax, fmax).to(fmt), q.reciprocal()


class _EagerFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, act):
        x8, sx = _to_fp8(x, torch.float8_e4m3fn)
        w8, sw = _to_fp8(w, torch.float8_e4m3fn)
        pre = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, bias=b, out_dtype=x.dtype)
        ctx.save_for_backward(x, w, pre)
        ctx.act = act
        return torch_act(pre, act)

    @staticmethod
    def backward(ctx, dy):
        x, w, pre = ctx.saved_tensors
        g = torch.ops.aten.gelu_backward(dy, pre) if ctx.act == "gelu" else dy
        g8, sg = _to_fp8(g, torch.float8_e5m2)
        w8, sw = _to_fp8(w, torch.float8_e4m3fn)
        x8, sx = _to_fp8(x, torch.float8_e4m3fn)
        dx = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=sg, scale_b=sw, out_dtype=x.dtype)
        dw = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=sg, scale_b=sx,
                              out_dtype=w.dtype)
        return dx, dw, g.sum(0), None


def make_eager_fp8(act):
    def eager_fp8(x, w, b):
        return _EagerFp8Linear.apply(x, w, b, act)
    return eager_fp8


# ---- validation ---------------------------------------------------------------------------------

def _gelu_grad64(z):
    return 0.5 * (1 + torch.erf(z / math.sqrt(2.0))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


class Reference:
    """float64 outputs and per-element bounds of input set 0 (the module docstring's rule)."""

    def __init__(self, s0, act, dname, backward, fp8=False):
        x, w, b = (t.detach().double() for t in s0.leaves())
        m, k = x.shape
        n = w.shape[0]
        ua, u = accumulation_unit(dname), unit_roundoff(dname)
        pre = torch.addmm(b, x, w.t())
        mag = torch.addmm(b.abs(), x.abs(), w.abs().t())
        y = torch_act(pre, act)
        # fp8 (x, W e4m3: 2^-4 relative each; g e5m2: 2^-3): the quantization's worst case on top
        q_fwd, q_bwd = (0.13, 0.19) if fp8 else (0.0, 0.0)
        self.fwd = [("y", y, gemm_allowed_error(dname, k, y, 1.2 * mag) + 8 * ua * (pre.abs() + y.abs()) +
                     1.2 * q_fwd * mag)]
        self.bwd = []
        if not backward:
            return
        dy = s0.dy.double()
        if act == "none":
            g, eg, eg_sum = dy, None, None
        else:
            g = dy * _gelu_grad64(pre)
            dpre = 8 * math.sqrt(k) * ua * mag + u * pre.abs() + q_fwd * mag
            eg_sum = dy.abs() * (dpre + 8 * ua * (1 + pre.abs()))
            eg = eg_sum + u * g.abs()
        del pre, mag
        ga, wa, xa = g.abs(), w.abs(), x.abs()
        dx = g @ w
        dx_bound = gemm_allowed_error(dname, n, dx, ga @ wa) + q_bwd * (ga @ wa)
        dw = g.t() @ x
        dw_bound = gemm_allowed_error(dname, m, dw, ga.t() @ xa) + q_bwd * (ga.t() @ xa)
        db = g.sum(0)
        db_bound = u * db.abs() + HALF_SUBNORMAL_STEP[dtype_name(dname)] + (m + 1) * ua * ga.sum(0)
        if eg is not None:
            dx_bound += eg @ wa
            dw_bound += eg.t() @ xa
            db_bound += eg_sum.sum(0)
        self.bwd = [("dX", dx, dx_bound), ("dW", dw, dw_bound), ("db", db, db_bound)]


def check(refs, got):
    """refs: [(name, ref, bound)], got: the same tensors. Returns the validation record."""
    worst, max_rel, checked, first = 0.0, 0.0, 0, ""
    for (name, ref, bound), t in zip(refs, got):
        err = (t.detach().double() - ref).abs()
        ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
        r = math.inf if torch.isnan(ratio).any().item() else (ratio.max().item() if ratio.numel() else 0.0)
        mref = ref.abs().max().item() if ref.numel() else 0.0
        e = err.max().item() if err.numel() else 0.0
        if r > 1 and not first:
            first = f"{name}: max error / allowed = {r:.3g} (max error {e:.3g}, max |ref| {mref:.3g})"
        worst, checked = max(worst, r), checked + ref.numel()
        max_rel = max(max_rel, e / mref if mref > 0 else e)
    return {"passed": worst <= 1.0, "max_rel_error": max_rel, "worst_ratio": worst, "checked": int(checked),
            "first_failure": first}


def _validation_json(v):
    return {k: v[k] for k in ("passed", "max_rel_error", "worst_ratio", "checked")}


# ---- one group: (case, backend, dtype, shape) ---------------------------------------------------

def base_row(case, direction, variant, backend, dname, m, n, k, act, elem):
    return {"op": "linear", "family": "linear", "case": case, "direction": direction, "variant": variant,
            "backend": backend, "dtype": dname, "activation": act, "shape": {"m": m, "n": n, "k": k},
            "shape_label": f"{m}x{n}x{k}", "threads": torch.get_num_threads() if backend == "cpu" else None,
            "status": "ok", "reason": "", "validation": None, "time_ms": None, "flops": flops(direction, m, n, k),
            "flops_formula": "2*M*N*K" if direction == "fwd" else "6*M*N*K (fwd 2MNK + dX 2MNK + dW 2MNK)",
            "min_bytes": min_bytes(direction, act, m, n, k, elem), "bytes_formula": bytes_formula(direction, act),
            "tflops": None, "gbps": None, "baseline": None, "vs_baseline": None, "roofline_fraction": None,
            "roofline_peak": None, "roofline_bandwidth": None, "kernel": None}


def finish_row(r, st, peak, bw):
    r["time_ms"] = runner.stats_json(st)
    sec = st["median"] * 1e-3
    r["tflops"] = r["flops"] / sec / 1e12
    r["gbps"] = r["min_bytes"] / sec / 1e9
    if peak:
        r["roofline_peak"] = {"name": f"{peak['name']} {peak['shape']}", "value": peak["value"], "unit": "TFLOP/s"}
        ideal = r["flops"] / (peak["value"] * 1e12)
        if bw:
            r["roofline_bandwidth"] = {"name": bw["name"], "value": bw["value"], "unit": "GB/s"}
            ideal = max(ideal, r["min_bytes"] / (bw["value"] * 1e9))
        r["roofline_fraction"] = ideal / sec


def linear_group(oo, args, backend, timer, log, notes, case, dname, m, n, k, variants, peers, ceilings):
    act = CASE_ACTIVATION[case]
    directions = CASE_DIRECTIONS[case]
    dtype = runner.DTYPES[dname]
    elem = torch.tensor([], dtype=dtype).element_size()
    on_run_device = backend == timer.device
    peak = next((c for c in ceilings if c["name"] == f"torch_matmul_{dname}"), None) if on_run_device else None
    bw = next((c for c in ceilings if c["unit"] == "GB/s"), None) if on_run_device else None

    set_bytes = (m * k + n * k + n + 2 * m * n) * elem
    budget = (torch.cuda.mem_get_info()[0] // 4) if backend == "cuda" else (1 << 30)
    nsets = runner.rotating_set_count(set_bytes, timer.cache_bytes, budget)
    gen = torch.Generator(device=backend).manual_seed(1500 + m + n + k)
    sets = [InputSet(m, n, k, dtype, backend, gen) for _ in range(nsets)]
    log(f"linear {case} {backend} {dname} M={m} N={n} K={k} act {act} ({nsets} input sets)")

    fns, skip = {}, {}
    for v in variants:
        fns[v] = make_ours(oo, act, v)
    for p in peers:
        if p == "eager":
            fns[p] = make_eager(act)
        elif p == "compile":
            if args.no_compile:
                skip[p] = "--no-compile"
                continue
            torch._dynamo.reset()
            fns[p] = torch.compile(make_eager(act), fullgraph=True, dynamic=False)
        elif p == "gemm_only":
            fns[p] = None
        elif p == "eager_fp8":
            fns[p] = make_eager_fp8(act)
    names = list(variants) + list(peers)

    # -- validate every implementation once, each direction (compiles torch.compile's graphs here)
    refs = {False: Reference(sets[0], act, dname, "fwd+bwd" in directions)}
    if any(is_fp8(v) for v in names):
        refs[True] = Reference(sets[0], act, dname, "fwd+bwd" in directions, fp8=True)
    checks, failed = {}, {}
    for name in names:
        if name in skip or name == "gemm_only":
            continue
        ours = name in variants
        ref = refs[is_fp8(name)]
        try:
            res = {}
            if "fwd" in directions:
                res["fwd"] = check(ref.fwd, [run_fwd(fns[name], sets[0])])
            if "fwd+bwd" in directions:
                y, grads = run_fwd_bwd(fns[name], sets[0])
                res["fwd+bwd"] = check(ref.fwd + ref.bwd, [y, *grads])
                del y, grads
            checks[name] = res
        except NotImplementedError as e:
            skip[name] = _reason(e)
        except Exception as e:  # noqa: BLE001 - reported in the row
            if ours:
                failed[name] = _reason(e)
            else:
                skip[name] = _reason(e)
        if name in skip or name in failed:
            log(f"  {name}: {'skipped' if name in skip else 'FAILED'} {skip.get(name) or failed.get(name)}")
    del refs
    if backend == "cuda":
        torch.cuda.empty_cache()

    rows = []
    for direction in directions:
        group = {}
        for name in names:
            r = base_row(case, direction, name, backend, dname, m, n, k, act, elem)
            group[name] = r
            if name in skip:
                r.update(status="skipped", reason=skip[name])
                continue
            if name in failed:
                r.update(status="failed", reason=failed[name])
                continue
            if name == "gemm_only":
                r["what"] = ("the GEMMs alone: torch.matmul(x, W.t())" if direction == "fwd" else
                               "the GEMMs alone: torch.matmul(x, W.t()), dy @ W, dy.t() @ x") + " (not validated)"
                run = (lambda i: gemms_fwd(sets[i % nsets])) if direction == "fwd" else \
                    (lambda i: gemms_fwd_bwd(sets[i % nsets]))
            else:
                v = checks[name][direction]
                r["validation"] = _validation_json(v)
                if not v["passed"]:
                    if name in variants:
                        r.update(status="failed", reason="validation: " + v["first_failure"])
                        log(f"  {direction:>7} {name:>12}: FAILED {r['reason']}")
                        continue
                    note = (f"linear {name} at {case} {backend} {dname} {m}x{n}x{k} {direction} failed validation "
                            f"({v['first_failure']}): timed anyway")
                    notes.append(note)
                    log("  note: " + note)
                fn = fns[name]
                run = (lambda i, fn=fn: run_fwd(fn, sets[i % nsets])) if direction == "fwd" else \
                    (lambda i, fn=fn: run_fwd_bwd(fn, sets[i % nsets]))
            try:
                st = timer.measure(run)
            except Exception as e:  # noqa: BLE001
                r.update(status="failed" if name in variants else "skipped", reason=_reason(e))
                continue
            finish_row(r, st, peak, bw)
            log(f"  {direction:>7} {name:>12}: {st['median']:.4g} ms [{st['p10']:.4g}-{st['p90']:.4g}] "
                f"{r['tflops']:.3g} TFLOP/s")
        # -- ratios: vs eager (the baseline), vs torch.compile, vs the GEMMs alone
        def ok(name):
            r = group.get(name)
            return r if r and r["status"] == "ok" and r["time_ms"] else None

        eager, comp, gemms, efp8 = ok("eager"), ok("compile"), ok("gemm_only"), ok("eager_fp8")
        for name, r in group.items():
            if not ok(name):
                continue
            t = r["time_ms"]["median"]
            if is_fp8(name) and name != "eager_fp8":
                r["vs_eager_fp8"] = efp8["time_ms"]["median"] / t if efp8 else None
            if eager and name != "eager":
                r["baseline"] = {"name": "torch eager (F.linear" + (" + F.gelu" if act == "gelu" else "") + ")",
                                 "time_ms": eager["time_ms"], "tflops": eager["tflops"],
                                 "validation": eager["validation"]}
                r["vs_baseline"] = eager["time_ms"]["median"] / t
            if case == "layer" and name not in ("compile", "gemm_only"):
                r["vs_compile"] = comp["time_ms"]["median"] / t if comp else None
                r["vs_gemms"] = gemms["time_ms"]["median"] / t if gemms else None
                if gemms:
                    r["gemms_time_ms"] = gemms["time_ms"]
        rows += list(group.values())
    del sets, fns
    if backend == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---- the family ---------------------------------------------------------------------------------

def resolve_variants(oo, args, device):
    rungs = list(oo.variants("linear"))
    if device == "cpu":
        ours = ["cpu"]
    else:
        ours = [v for v in CUDA_RUNGS if v == "auto" or v in rungs]
    if args.variants_arg is None or args.variants_arg == ["all"]:
        return ours, False
    for v in args.variants_arg:
        if v != "auto" and v not in rungs:
            raise SystemExit(f"--variants: expected all, auto or some of {', '.join(rungs)}; given '{v}'")
    keep = [v for v in args.variants_arg if (v == "cpu") == (device == "cpu") or v == "auto"]
    return keep, True


def case_plan(args, device, case):
    dtypes, shapes = (QUICK if args.quick else DEFAULTS)[device][case]
    if args.dtypes_arg:
        dtypes = list(args.dtypes_arg)
    if args.shapes_arg:
        shapes = [parse_mnk(s) for s in args.shapes_arg]
    return dtypes, shapes


def linear_rows(args, device, timer, ceilings, log, notes):
    import optimized_ops as oo

    variants, explicit = resolve_variants(oo, args, device)
    notes += [
        "linear rows (bench/benchmark_linear.py): shapes MxNxK (x M x K, W N x K, y M x N); ours = "
        "optimized_ops.linear(x, W, b, activation, variant=V); eager = F.linear (+ F.gelu, erf) and its autograd; "
        "compile = torch.compile of it (fullgraph, dynamic=False); gemm_only = torch.matmul(x, W.t()) (fwd) plus "
        "dy @ W and dy.t() @ x (fwd+bwd); fwd = inference forward (no_grad), fwd+bwd = forward with x, W, b "
        "requiring grad + torch.autograd.grad with a fixed dy, timed together; vs baseline = eager's time / the "
        "row's, vs_compile = compile's / the row's, vs_gemms = gemm_only's / the row's (targets, issue 15: layer "
        ">= 1.05x eager, >= 1.0x compile, vs_gemms >= 1/1.05; skinny >= 1.0x eager)",
        "linear fp8 rows (layer case, CUDA): <rung>-fp8 = optimized_ops.linear(..., fp8=True) (x, W e4m3, g e5m2, "
        "per-tensor current scaling); eager_fp8 = the same recipe on torch._scaled_mm (amax, scale, cast and the "
        "transposed copies in torch ops; an autograd.Function, dX and dW on _scaled_mm, db = g.sum); vs_eager_fp8 = "
        "eager_fp8's time / the row's; validated against the unquantized float64 reference with the quantization's "
        "worst case added (0.13 mag for y, 0.19 for dX, dW)",
        "linear validation: y, dX, dW, db vs float64 torch, the GEMM rule (gemm_allowed_error) carried through the "
        "activation as src/testing/linear_reference.h (n = K for y, N for dX, M for dW and db); the generic table "
        "does not show the case (seed, layer, skinny) or the direction: see the JSON's fields"]
    rows = []
    for case in args.linear_cases:
        dtypes, shapes = case_plan(args, device, case)
        vs = list(variants)
        if case != "seed" and "naive" in vs and not explicit:
            vs.remove("naive")  # one thread per output: the seed case measures it; name it to include it
        peers = list(CASE_PEERS[case])
        if case == "layer" and device == "cuda":
            vs += [f"{v}-fp8" for v in FP8_RUNGS if v in vs]
        else:
            peers = [p for p in peers if p not in FP8_PEERS]
        for dname in dtypes:
            for m, n, k in shapes:
                rows += linear_group(oo, args, device, timer, log, notes, case, dname, m, n, k, vs, peers,
                                     ceilings)
        if case == "seed" and device == "cuda" and not args.shapes_arg and not args.dtypes_arg:
            # the seed's CPU rows: the cpu rung and eager on the host, timed with the CPU rules
            host_timer = runner.Timer("cpu", timer.opt)
            for dname in SEED_HOST[0]:
                for m, n, k in SEED_HOST[1]:
                    rows += linear_group(oo, args, "cpu", host_timer, log, notes, case, dname, m, n, k, ["cpu"],
                                         ["eager"], ceilings)
            del host_timer
    return rows


def parse_mnk(text):
    parts = text.lower().split("x")
    try:
        m, n, k = (int(x) for x in parts)
    except ValueError:
        m = n = k = 0
    if len(parts) != 3 or min(m, n, k) < 1:
        raise SystemExit(f"--shapes: linear shapes are MxNxK (rows x out features x in features); given '{text}'")
    return m, n, k


def add_arguments(p):
    p.add_argument("--linear-cases", dest="linear_cases_text", default=None,
                   help=f"linear: comma list of {', '.join(CASES)} (default all)")
    try:  # shared with the fused family: added by whichever family registers first
        p.add_argument("--no-compile", action="store_true", help="fused, linear: leave out the torch.compile rows")
    except argparse.ArgumentError:
        pass


def prepare(args, device):
    t = getattr(args, "linear_cases_text", None)
    args.linear_cases = t.split(",") if t else list(CASES)
    for c in args.linear_cases:
        if c not in CASES:
            raise SystemExit(f"--linear-cases: expected some of {', '.join(CASES)}; given '{c}'")
    for s in args.shapes_arg or []:
        parse_mnk(s)


def ceiling_dtypes(args, device):
    table = (QUICK if args.quick else DEFAULTS)[device]
    if args.dtypes_arg:
        return [d for d in args.dtypes_arg if d in runner.DTYPES]
    cases = getattr(args, "linear_cases", None) or CASES
    return list(dict.fromkeys(d for c in cases for d in table[c][0]))


FAMILY = runner.register(runner.Family(
    "linear", rows=linear_rows, add_arguments=add_arguments, prepare=prepare, ceiling_dtypes=ceiling_dtypes,
    summary="linear layers (cpu, naive, fused, persistent) vs torch eager F.linear + GELU, torch.compile and the GEMMs "
            "alone, fwd and fwd+bwd (bench/benchmark_linear.py)"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return runner.main(["--ops", "linear", *argv])


if __name__ == "__main__":
    sys.exit(main())
