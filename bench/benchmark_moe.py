#!/usr/bin/env python3
"""Python benchmark of the MoE family (issue 16's targets): the grouped GEMM alone against torch._grouped_mm, and
the whole layer (optimized_ops.moe_layer) against the same layer written in torch (a per-expert loop, and on
torch._grouped_mm), forward and forward+backward, with the share of its non-GEMM pieces, in one run.

    python bench/benchmark_moe.py [--device cuda|cpu] [--variants all|auto|NAME,...] [--dtypes bf16]
        [--moe-cases gemm,layer] [--quick] [--out bench/results]

is `python bench/benchmark_all.py --ops moe ...` (bench/runner.py: the harness, statistics, cold-L2 timing with CUDA
events, rotating inputs, ceilings, output files, the registry).

This file also holds the plain-torch layers that tests/python/test_moe_layer.py checks the layer with:
reference_layer (any dtype; float64 is the reference), torch_loop_layer and torch_grouped_mm_layer (the peers).

Cases (the row field "case"; the generic table shows them in shape_label):
  gemm   the grouped GEMM alone, out = grouped_mm(x, w, offs), x (T k, K) rows sorted by expert, w (E, K, N)
         row-major, at the issue's three shapes (CUDA, bf16): 8 experts top-2 4096 -> 14336 T = 8192; 64 experts
         top-8 2048 -> 1408 T = 8192; 256 experts top-8 7168 -> 2048 T = 4096; each with two routings:
           balanced  T k / E rows per expert;
           zipf      each token draws k distinct experts without replacement (torch.multinomial, CPU generator
                     seeded 16 + E) with probability proportional to (i + 1)^-1.2 for expert i (Zipf, s = 1.2,
                     expert 0 the most popular): at 8 experts top-2 the busiest expert gets ~35% of the pairs,
                     at 256 top-8 ~4% (about 10x an even share), and the tail experts a handful of rows.
         ours: every grouped_gemm rung of the device but naive (named in --variants to include it; a thread per
         output, ~300 ms a call here) and auto; the peer torch._grouped_mm(x, w, offs=offs) (the baseline:
         vs_baseline = vs_grouped_mm = its time / the row's; targets >= 1.0 balanced, >= 1.3 zipf and at 256
         experts). TFLOP/s = 2 T k K N / time.
  layer  the whole layer, dropless, bf16, 8 experts top-2, T = 8192, d_model 4096, d_ff 14336 (SwiGLU experts, the
         softmax router, normalized top-2 weights, aux and z losses), inputs x U(-1, 1), router weight and w13
         U(+-1/sqrt(d)), w2 U(+-1/sqrt(d_ff)), dy U(-1, 1):
           ours:<V>          optimized_ops.moe_layer(x, router_weight, w13, w2, 2, variant=V) for auto and the
                             grouped_gemm rungs but naive and cpu (named to include them)
           torch_loop        torch_loop_layer: Mixtral's (Hugging Face) per-expert loop: softmax + topk, one_hot
                             mask, torch.where per expert (a host synchronisation each), index rows, x @ w13[e],
                             F.silu(gate) * up, @ w2[e], times the weight, index_add_ (the baseline of the table:
                             vs_baseline = vs_loop = its time / the row's; target >= 3x)
           torch_grouped_mm  torch_grouped_mm_layer: the same layer on torch._grouped_mm (softmax + topk, a stable
                             argsort of the ids, searchsorted offsets, both projections as torch._grouped_mm,
                             F.silu(gate) * up, the outputs unsorted and summed with their weights by a bmm; no host
                             synchronisation); vs_grouped_mm = its time / the row's (target >= 1.2x)
           pieces            ours without the experts (optimized_ops.moe.layer._moe_forward with the identity as the
                             experts: router logits, moe_route, moe_permute, the gather, moe_combine, the metrics
                             and losses, and their backward); share_of_layer = its time / ours:auto's
                             (target <= 0.10), also set on the ours rows as pieces_share
         Every implementation computes the aux loss (E sum f_i P_i) and the z-loss (mean lse^2). fwd = the forward
         under torch.no_grad(); fwd+bwd = the forward with x, the router weight, w13 and w2 requiring grad, then
         torch.autograd.grad([out, 0.01 aux + 0.001 z], leaves, [dy, 1]), timed together. TFLOP/s over the expert
         GEMMs' 6 T k d d_ff flops (fwd; 18 T k d d_ff fwd+bwd), the router and the combine not counted.
         Memory at this shape (bf16): w13 + w2 2.8 GB, their gradients 2.8 GB, activations of one fwd+bwd ~3 GB
         (T k = 16384 slots: xs 134 MB, gate|up 940 MB, a 470 MB, y 134 MB, and their gradients); the weights are
         shared by the rotating sets (only x and dy rotate: 2 sets), so a timed fwd+bwd holds ~10 GB. The float64
         validation holds ~35 GB at its peak (the weights, their gradients and the per-expert activations in
         float64), freed before the timing.

Validation (before any timing), on input set 0:
  gemm   per group in float64 (group by group: a float64 copy of every weight would be 30 GB at 256 experts), the
         GEMM rule of bench/tolerance.py (gemm_allowed_error: one rounding to the dtype + fp32 accumulation over K),
         per element.
  layer  out, dx, d router weight, dw13, dw2 (fwd: out) against reference_layer in float64 with the expert choice of
         our router (the same float32 logits; checked to be a top-k of the float64 logits up to the logits' GEMM
         rounding, so that a near-tie cannot fail a row), with the reduction rule (flash-attention's, design.md):
         max |impl - fp64| <= 2 max |same - fp64| + 2 u max |ref| + 16 sqrt(n) 2^-24 max |ref| + floor, per
         tensor, where same = reference_layer run in the dtype (a torch layer of that precision) and n the longest
         reduction of the layer (max(T, d, d_ff)).
A rung that fails is a "failed" row, not timed; a peer that fails is noted and timed anyway.

CPU (--device cpu; --quick the smoke test, under a minute on 2 cores): the same cases in float32 at small shapes
(the issue's shapes scaled down: dims / 8, T / 16), ours = the cpu rung, torch._grouped_mm's CPU path as the peer.

Output: python-moe.{json,md} under --out/<gpu>/ (bench/runner.py names the files python-<family>).
"""

from __future__ import annotations

import math
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
from tolerance import accumulation_unit, dtype_name, gemm_allowed_error, reduction_allowed_error  # noqa: E402

CASES = ["gemm", "layer"]
ROUTINGS = ["balanced", "zipf"]
ZIPF_S = 1.2
AUX_COEF, Z_COEF = 0.01, 0.001

# Grouped GEMM shapes: (E, k, K, N, T); the layer: (E, k, d_model, d_ff, T). Per device, then --quick.
DEFAULTS = {
    "cuda": {"dtype": "bf16",
             "gemm": [(8, 2, 4096, 14336, 8192), (64, 8, 2048, 1408, 8192), (256, 8, 7168, 2048, 4096)],
             "layer": (8, 2, 4096, 14336, 8192)},
    "cpu": {"dtype": "fp32", "gemm": [(8, 2, 512, 1792, 512), (64, 8, 256, 176, 512), (256, 8, 896, 256, 256)],
            "layer": (8, 2, 512, 1792, 512)},
}
QUICK = {
    "cuda": {"dtype": "bf16", "gemm": [(8, 2, 1024, 3584, 2048), (64, 8, 512, 352, 2048), (256, 8, 1792, 512, 1024)],
             "layer": (8, 2, 1024, 3584, 2048)},
    "cpu": {"dtype": "fp32", "gemm": [(8, 2, 64, 128, 64), (64, 8, 32, 24, 64), (256, 8, 64, 32, 32)],
            "layer": (4, 2, 32, 64, 48)},
}


def _reason(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# ---- the layer in plain torch: the reference and the peers -------------------------------------------------

def reference_kept(ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(T k,) bool: the pairs p = t k + j each expert keeps, its first `capacity` in pair order (all when 0)."""
    flat = ids.reshape(-1).long()
    if capacity == 0:
        return torch.ones_like(flat, dtype=torch.bool)
    onehot = F.one_hot(flat, num_experts)
    rank = (onehot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # pairs of the same expert before p
    return rank < capacity


def reference_layer(x, router_weight, w13, w2, top_k, ids, *, capacity=0, scoring="softmax", normalize=None,
                    dtype=torch.float64):
    """The MoE layer in plain torch with a given expert choice ``ids`` (T, k), computed in ``dtype`` (the router in
    float32, or float64 when ``dtype`` is float64): a per-expert loop over the kept pairs (dense masks, host
    indexing: a reference, not a peer). float64 is the tests' and the benchmark's reference; the activations'
    dtype is the same-precision torch layer of the tolerance rule. Differentiable in every input.

    Returns ``(out (T, d) of dtype, aux_loss, z_loss)``: aux = E sum_i f_i P_i (f from ``ids`` before the
    capacity, no gradient; P the mean over tokens of the softmax, or the sigmoids normalized over the E experts),
    z = mean_t logsumexp(logits_t)^2."""
    rdt = torch.float64 if dtype == torch.float64 else torch.float32
    t, d = x.shape
    e, k = router_weight.shape[0], top_k
    f = w2.shape[1]
    if normalize is None:
        normalize = k > 1
    xd, w13d, w2d = x.to(dtype), w13.to(dtype), w2.to(dtype)
    logits = x.to(rdt) @ router_weight.to(rdt).t()
    ids = ids.long()
    if scoring == "softmax":
        scores = torch.softmax(logits, -1)
        probs = scores
    else:
        scores = torch.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdim=True)
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    flat = ids.reshape(-1)
    kept = reference_kept(ids, e, capacity)
    token = torch.arange(t * k, device=x.device) // k
    wflat = weights.reshape(-1).to(dtype)
    out = torch.zeros(t, d, dtype=dtype, device=x.device)
    # unbind, not w13d[g]: its backward stacks the experts' gradients once (indexing would add a zero-filled
    # full-size gradient per expert: 8 x 7.5 GB in float64 at the benchmark's layer)
    for g, (w13g, w2g) in enumerate(zip(w13d.unbind(0), w2d.unbind(0))):
        sel = ((flat == g) & kept).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        h = xd[token[sel]] @ w13g
        a = F.silu(h[:, :f]) * h[:, f:]
        out = out.index_add(0, token[sel], (a @ w2g) * wflat[sel, None])
    load = F.one_hot(flat, e).sum(0).to(rdt) / (t * k)
    aux = e * (load * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return out, aux, z


def _torch_route(x, router_weight, top_k, normalize):
    """Mixtral's router in torch: float32 logits, softmax, topk, the weights renormalized over the k."""
    logits = x.float() @ router_weight.float().t()
    probs = torch.softmax(logits, -1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize is None:
        normalize = top_k > 1
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, probs, weights, ids


def _torch_losses(logits, probs, counts, pairs):
    e = logits.shape[1]
    aux = e * (counts.float() / pairs * probs.mean(0)).sum()
    return aux, torch.logsumexp(logits, -1).square().mean()


def torch_loop_layer(x, router_weight, w13, w2, top_k, *, normalize=None):
    """The peer a user has: Mixtral's per-expert loop (Hugging Face transformers' MixtralSparseMoeBlock) on w13 / w2,
    dropless, softmax scoring. Returns ``(out, aux_loss, z_loss)``. torch.where per expert reads its count to the
    host (a synchronisation each), as the original does."""
    t, d = x.shape
    e, f = router_weight.shape[0], w2.shape[1]
    logits, probs, weights, ids = _torch_route(x, router_weight, top_k, normalize)
    weights = weights.to(x.dtype)
    mask = F.one_hot(ids, e).permute(2, 1, 0)  # (E, k, T)
    out = torch.zeros_like(x)
    for g in range(e):
        j, tok = torch.where(mask[g])
        if tok.numel() == 0:
            continue
        h = x[tok] @ w13[g]
        y = (F.silu(h[:, :f]) * h[:, f:]) @ w2[g]
        out.index_add_(0, tok, y * weights[tok, j, None])
    aux, z = _torch_losses(logits, probs, mask.sum((1, 2)), t * top_k)
    return out, aux, z


def torch_grouped_mm_layer(x, router_weight, w13, w2, top_k, *, normalize=None):
    """The same layer on torch._grouped_mm (torchtitan's way), dropless, softmax scoring, no host synchronisation:
    a stable argsort of the ids, offsets by searchsorted, both projections as torch._grouped_mm, the outputs put
    back in pair order and summed with their weights by a bmm. Returns ``(out, aux_loss, z_loss)``."""
    t, d = x.shape
    e, f = router_weight.shape[0], w2.shape[1]
    logits, probs, weights, ids = _torch_route(x, router_weight, top_k, normalize)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)                      # slot s holds pair order[s]
    ends = torch.arange(e, device=x.device, dtype=flat.dtype)
    offs = torch.searchsorted(flat[order], ends, right=True, out_int32=True)
    xs = x[order // top_k]
    h = torch._grouped_mm(xs, w13, offs=offs)
    y = torch._grouped_mm(F.silu(h[:, :f]) * h[:, f:], w2, offs=offs)
    y_pairs = y[torch.argsort(order)].view(t, top_k, d)           # back in pair order
    out = torch.bmm(weights.to(x.dtype).unsqueeze(1), y_pairs).squeeze(1)
    counts = torch.zeros(e, device=x.device, dtype=torch.float32).scatter_add_(
        0, flat, torch.ones(flat.numel(), device=x.device))
    aux, z = _torch_losses(logits, probs, counts, t * top_k)
    return out, aux, z


# ---- validation --------------------------------------------------------------------------------------------

def choice_is_topk(ids, x, router_weight) -> bool:
    """True when ``ids`` (T, k) is a top-k of each token's float64 logits up to the float32 logits' GEMM rounding:
    the float64 reference may then use it (a near-tie may go either way, both correct)."""
    x64, r64 = x.detach().double(), router_weight.detach().double()
    logits = x64 @ r64.t()
    slack = gemm_allowed_error("fp32", x.shape[1], logits, x64.abs() @ r64.abs().t()).amax(-1)
    chosen = logits.gather(1, ids.long())
    rest = logits.scatter(1, ids.long(), float("-inf"))
    return bool((chosen.amin(-1) >= rest.amax(-1) - 2 * slack).all())


def layer_check(names, got, ref, same, dtype, n):
    """The reduction rule per tensor (the module docstring): got / ref / same lists of tensors (None: skipped).
    Returns the validation record of bench/runner.py's rows."""
    d = dtype_name(dtype)
    worst, max_rel, checked, first = 0.0, 0.0, 0, ""
    for name, g, r, s in zip(names, got, ref, same):
        if r is None:
            continue
        r = r.detach().double()
        err = (g.detach().double() - r).abs().max().item() if r.numel() else 0.0
        same_err = (s.detach().double() - r).abs().max().item() if r.numel() else 0.0
        mref = r.abs().max().item() if r.numel() else 0.0
        allowed = reduction_allowed_error(d, n, same_err, mref, 0.0, accumulation_unit(d))
        ratio = math.inf if math.isnan(err) else (err / allowed if err > 0 else 0.0)
        if ratio > 1 and not first:
            first = (f"{name}: max error {err:.3g} > allowed {allowed:.3g} (same-dtype torch's error {same_err:.3g}, "
                     f"max |ref| {mref:.3g})")
        worst, checked = max(worst, ratio), checked + r.numel()
        max_rel = max(max_rel, err / mref if mref > 0 else err)
    return {"passed": worst <= 1.0, "max_rel_error": max_rel, "worst_ratio": worst, "checked": int(checked),
            "first_failure": first}


def _validation_json(v):
    return {k: v[k] for k in ("passed", "max_rel_error", "worst_ratio", "checked")}


# ---- grouped GEMM rows -------------------------------------------------------------------------------------

def group_sizes(e, k, t, routing):
    """Rows per expert (a list of E ints summing to T k): balanced, or Zipf-skewed (the module docstring)."""
    if routing == "balanced":
        base, extra = divmod(t * k, e)
        return [base + (1 if i < extra else 0) for i in range(e)]
    p = torch.arange(1, e + 1, dtype=torch.float64).pow(-ZIPF_S)
    gen = torch.Generator().manual_seed(16 + e)
    ids = torch.multinomial(p.expand(t, e), k, replacement=False, generator=gen)
    return torch.bincount(ids.flatten(), minlength=e).tolist()


def gemm_flops(s, kk, n):
    return 2.0 * s * kk * n


def base_row(op, case, direction, variant, backend, dname, shape, label, flops, min_bytes, flops_formula,
             bytes_formula):
    return {"op": op, "family": "moe", "case": case, "direction": direction, "variant": variant, "backend": backend,
            "dtype": dname, "shape": shape, "shape_label": label,
            "threads": torch.get_num_threads() if backend == "cpu" else None, "status": "ok", "reason": "",
            "validation": None, "time_ms": None, "flops": flops, "flops_formula": flops_formula,
            "min_bytes": min_bytes, "bytes_formula": bytes_formula, "tflops": None, "gbps": None, "baseline": None,
            "vs_baseline": None, "roofline_fraction": None, "roofline_peak": None, "roofline_bandwidth": None,
            "kernel": None}


def finish_row(r, st, peak, bw):
    r["time_ms"] = runner.stats_json(st)
    sec = st["median"] * 1e-3
    if r["flops"]:
        r["tflops"] = r["flops"] / sec / 1e12
    r["gbps"] = r["min_bytes"] / sec / 1e9
    if peak and r["flops"]:
        r["roofline_peak"] = {"name": f"{peak['name']} {peak['shape']}", "value": peak["value"], "unit": "TFLOP/s"}
        ideal = r["flops"] / (peak["value"] * 1e12)
        if bw:
            r["roofline_bandwidth"] = {"name": bw["name"], "value": bw["value"], "unit": "GB/s"}
            ideal = max(ideal, r["min_bytes"] / (bw["value"] * 1e9))
        r["roofline_fraction"] = ideal / sec


def _ceilings(ceilings, dname):
    peak = next((c for c in ceilings if c["name"] == f"torch_matmul_{dname}"), None)
    bw = next((c for c in ceilings if c["unit"] == "GB/s"), None)
    return peak, bw


def _free(device):
    if device == "cuda":
        torch.cuda.empty_cache()


def gemm_group(oo, backend, timer, log, notes, dname, e, k, kk, n, t, routing, variants, ceilings):
    dtype = runner.DTYPES[dname]
    elem = torch.tensor([], dtype=dtype).element_size()
    s = t * k
    sizes = group_sizes(e, k, t, routing)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(backend)
    label = f"gemm E{e} top{k} T{t} {kk}->{n} {routing}"
    shape = {"experts": e, "top_k": k, "tokens": t, "rows": s, "k": kk, "n": n, "routing": routing,
             "max_rows_per_expert": max(sizes), "empty_experts": sum(1 for c in sizes if c == 0)}
    set_bytes = (s * kk + e * kk * n + s * n) * elem
    budget = (torch.cuda.mem_get_info()[0] // 4) if backend == "cuda" else (1 << 30)
    nsets = runner.rotating_set_count(set_bytes, timer.cache_bytes, budget)
    gen = torch.Generator(device=backend).manual_seed(1600 + e + kk + n)

    def uniform(*shape_, scale=1.0):  # in place: one float32 temporary (15 GB for the 256-expert weights)
        return torch.rand(*shape_, generator=gen, device=backend).mul_(2).sub_(1).mul_(scale).to(dtype)

    sets = [(uniform(s, kk), uniform(e, kk, n, scale=1 / math.sqrt(kk))) for _ in range(max(nsets, 1))]
    log(f"moe {label} {backend} {dname} ({len(sets)} input sets; rows per expert max {max(sizes)}, "
        f"empty {shape['empty_experts']})")

    fns = {v: (lambda x, w, v=v: oo.grouped_mm(x, w, offs, variant=v)) for v in variants}
    fns["torch._grouped_mm"] = lambda x, w: torch._grouped_mm(x, w, offs=offs)
    names = list(fns)
    # -- validate: every output of set 0, then one float64 pass over the groups checks them all
    outs, skip, failed = {}, {}, {}
    with torch.no_grad():
        for name in names:
            try:
                outs[name] = fns[name](*sets[0])
            except Exception as e_:  # noqa: BLE001 - reported in the row
                (failed if name in variants else skip)[name] = _reason(e_)
                log(f"  {name}: {'FAILED' if name in failed else 'skipped'} {_reason(e_)}")
        worst = {name: 0.0 for name in outs}
        rel = {name: 0.0 for name in outs}
        x0, w0 = sets[0]
        start = 0
        for g, end in enumerate(offs.tolist()):
            if end == start:
                continue
            xg, wg = x0[start:end].double(), w0[g].double()
            ref = xg @ wg
            bound = gemm_allowed_error(dname, kk, ref, xg.abs() @ wg.abs())
            mref = ref.abs().max().item()
            for name, o in outs.items():
                err = (o[start:end].double() - ref).abs()
                ratio = torch.where(err == 0, torch.zeros_like(err), err / bound)
                r = math.inf if torch.isnan(ratio).any().item() else ratio.max().item()
                worst[name] = max(worst[name], r)
                rel[name] = max(rel[name], err.max().item() / mref if mref > 0 else err.max().item())
            del ref, bound, xg, wg
            start = end
    checks = {name: {"passed": worst[name] <= 1.0, "max_rel_error": rel[name], "worst_ratio": worst[name],
                     "checked": s * n} for name in outs}
    del outs
    _free(backend)

    peak, bw = _ceilings(ceilings, dname) if backend == timer.device else (None, None)
    rows, group = [], {}
    for name in names:
        r = base_row("grouped_mm", "gemm", "fwd", name, backend, dname, shape, label, gemm_flops(s, kk, n),
                     set_bytes, "2*T*k*K*N", "(T*k*K + E*K*N + T*k*N)*E (read x, w; write out)")
        group[name] = r
        if name in skip or name in failed:
            r.update(status="skipped" if name in skip else "failed", reason=skip.get(name) or failed.get(name))
            continue
        v = checks[name]
        r["validation"] = _validation_json(v)
        if not v["passed"]:
            msg = f"validation: max error / allowed = {v['worst_ratio']:.3g}"
            if name in variants:
                r.update(status="failed", reason=msg)
                log(f"  {name:>18}: FAILED {msg}")
                continue
            notes.append(f"moe {name} at {label} {backend} {dname} failed validation ({msg}): timed anyway")
        fn = fns[name]

        def run(i, fn=fn):
            with torch.no_grad():
                return fn(*sets[i % len(sets)])
        try:
            st = timer.measure(run)
        except Exception as e_:  # noqa: BLE001
            r.update(status="failed" if name in variants else "skipped", reason=_reason(e_))
            continue
        finish_row(r, st, peak, bw)
        log(f"  {name:>18}: {st['median']:.4g} ms [{st['p10']:.4g}-{st['p90']:.4g}] {r['tflops']:.4g} TFLOP/s")
    peer = group["torch._grouped_mm"]
    for name, r in group.items():
        if name == "torch._grouped_mm" or r["status"] != "ok" or peer["status"] != "ok":
            continue
        r["baseline"] = {"name": "torch._grouped_mm", "time_ms": peer["time_ms"], "tflops": peer["tflops"],
                         "validation": peer["validation"]}
        r["vs_baseline"] = r["vs_grouped_mm"] = peer["time_ms"]["median"] / r["time_ms"]["median"]
    rows += list(group.values())
    del sets, fns
    _free(backend)
    return rows


# ---- layer rows --------------------------------------------------------------------------------------------

class LayerInputs:
    """The layer's weights (shared by the rotating sets) and the rotating x, dy."""

    def __init__(self, e, k, d, f, t, dtype, device, nsets, gen):
        def uniform(*shape, scale=1.0):  # drawn in float32 on the device, scaled in place, then rounded once
            return torch.rand(*shape, generator=gen, device=device).mul_(2).sub_(1).mul_(scale).to(dtype)

        self.k = k
        self.router = uniform(e, d, scale=1 / math.sqrt(d)).requires_grad_()
        self.w13 = uniform(e, d, 2 * f, scale=1 / math.sqrt(d)).requires_grad_()
        self.w2 = uniform(e, f, d, scale=1 / math.sqrt(f)).requires_grad_()
        self.xs = [uniform(t, d).requires_grad_() for _ in range(nsets)]
        self.dys = [uniform(t, d) for _ in range(nsets)]
        self.one = torch.ones((), device=device)

    def leaves(self, i, experts=True):
        x = self.xs[i % len(self.xs)]
        return (x, self.router, self.w13, self.w2) if experts else (x, self.router)


def _ours(oo, variant):
    def fn(x, rw, w13, w2, k):
        out, m = oo.moe_layer(x, rw, w13, w2, k, aux_loss_coef=AUX_COEF, z_loss_coef=Z_COEF, variant=variant)
        return out, m.loss
    return fn


def _peer(layer):
    def fn(x, rw, w13, w2, k):
        out, aux, z = layer(x, rw, w13, w2, k)
        return out, AUX_COEF * aux + Z_COEF * z
    return fn


def _pieces(x, rw, k, e):
    """The layer without its experts: optimized_ops.moe.layer._moe_forward with the identity as the experts."""
    from optimized_ops.moe.layer import _moe_forward

    out, m = _moe_forward(x, rw, k, lambda xs, offs: xs, capacity_factor=None, scoring="softmax", normalize=None,
                          aux_loss_coef=AUX_COEF, z_loss_coef=Z_COEF)
    return out, m.loss


def layer_rows(oo, args, backend, timer, log, notes, dname, e, k, d, f, t, variants, ceilings):
    dtype = runner.DTYPES[dname]
    elem = torch.tensor([], dtype=dtype).element_size()
    label_base = f"E{e} top{k} T{t} {d}/{f}"
    shape = {"experts": e, "top_k": k, "tokens": t, "d_model": d, "d_ff": f, "capacity": "dropless"}
    budget = (torch.cuda.mem_get_info()[0] // 8) if backend == "cuda" else (1 << 30)
    nsets = runner.rotating_set_count(2 * t * d * elem, timer.cache_bytes, budget)
    gen = torch.Generator(device=backend).manual_seed(1616 + d + f)
    inp = LayerInputs(e, k, d, f, t, dtype, backend, nsets, gen)
    weights_gb = 3 * e * d * f * elem / 1e9
    log(f"moe layer {label_base} {backend} {dname}: weights {weights_gb:.2f} GB (+ their gradients), "
        f"{nsets} rotating x/dy sets")

    fns = {f"ours:{v}": _ours(oo, v) for v in variants}
    fns["torch_loop"] = _peer(torch_loop_layer)
    fns["torch_grouped_mm"] = _peer(torch_grouped_mm_layer)
    names = list(fns)
    ours_names = [n_ for n_ in names if n_.startswith("ours:")]
    grad_names = ["out", "dx", "d router_weight", "dw13", "dw2"]
    n_red = max(t, d, f)

    # -- validation on set 0: the float64 reference with our router's choice, then the same-dtype torch layer
    from optimized_ops.moe.layer import router_logits

    leaves0 = inp.leaves(0)
    dy0 = inp.dys[0]
    with torch.no_grad():
        ids = oo.moe_route(router_logits(leaves0[0], leaves0[1]), k, normalize=k > 1)[0]
    if not choice_is_topk(ids, leaves0[0], leaves0[1]):
        notes.append(f"moe layer {label_base}: our router's choice is not a top-k of the float64 logits")

    def reference(dt):
        lv = [t_.detach().to(dt).requires_grad_() for t_ in leaves0]
        out, aux, z = reference_layer(*lv, k, ids, dtype=dt)
        loss = AUX_COEF * aux + Z_COEF * z
        grads = torch.autograd.grad([out, loss], lv, [dy0.to(out.dtype), torch.ones_like(loss)])
        return [out.detach(), *grads]

    ref = reference(torch.float64)
    same = reference(dtype)
    checks, skip, failed = {}, {}, {}
    for name in names:
        try:
            with torch.no_grad():
                out = fns[name](*leaves0, k)[0]
            fwd = layer_check(["out"], [out], ref[:1], same[:1], dtype, n_red)
            del out
            out, loss = fns[name](*leaves0, k)
            grads = torch.autograd.grad([out, loss], leaves0, [dy0, torch.ones_like(loss)])
            both = layer_check(grad_names, [out.detach(), *grads], ref, same, dtype, n_red)
            del out, loss, grads
            checks[name] = {"fwd": fwd, "fwd+bwd": both}
        except Exception as e_:  # noqa: BLE001 - reported in the row
            (failed if name in ours_names else skip)[name] = _reason(e_)
            log(f"  {name}: {'FAILED' if name in failed else 'skipped'} {_reason(e_)}")
    del ref, same
    _free(backend)

    peak, bw = _ceilings(ceilings, dname) if backend == timer.device else (None, None)
    rows = []
    for direction in ("fwd", "fwd+bwd"):
        mult = 1 if direction == "fwd" else 3
        flops = mult * 6.0 * t * k * d * f
        min_bytes = (2 * t * d + 3 * e * d * f) * elem if direction == "fwd" else (4 * t * d + 9 * e * d * f) * elem
        bytes_formula = ("(2*T*d + 3*E*d*d_ff)*E (read x, the weights; write out)" if direction == "fwd" else
                         "(4*T*d + 9*E*d*d_ff)*E (fwd; read dy, x, the weights; write dx and the weight gradients)")
        group = {}
        for name in names + ["pieces"]:
            label = f"layer {direction} {label_base}"
            if name == "pieces":
                r = base_row("moe_layer", "layer", direction, name, backend, dname, shape, label, None,
                             (2 * t * d + t * k * d) * elem * mult,
                             "not counted (the router's 2*T*d*E flops are negligible)",
                             "(2*T*d + T*k*d)*E per pass (gather read + write, combine read + write)")
                r["what"] = ("ours without the experts: router logits, moe_route, moe_permute, gather, moe_combine, "
                             "metrics and losses" + (" and their backward" if direction == "fwd+bwd" else "") +
                             " (not validated: the layer's rows are)")
            else:
                r = base_row("moe_layer", "layer", direction, name, backend, dname, shape, label, flops, min_bytes,
                             "6*T*k*d*d_ff (the expert GEMMs)" + (" x 3 (fwd + dgrad + wgrad)" if mult == 3 else ""),
                             bytes_formula)
            group[name] = r
            if name in skip or name in failed:
                r.update(status="skipped" if name in skip else "failed", reason=skip.get(name) or failed.get(name))
                continue
            if name == "pieces":
                def call(i):
                    x, rw = inp.leaves(i, experts=False)
                    return _pieces(x, rw, k, e)
                grad_leaves = (lambda i: inp.leaves(i, experts=False))
            else:
                v = checks[name][direction]
                r["validation"] = _validation_json(v)
                if not v["passed"]:
                    if name in ours_names:
                        r.update(status="failed", reason="validation: " + v["first_failure"])
                        log(f"  {direction:>7} {name:>18}: FAILED {r['reason']}")
                        continue
                    note = (f"moe {name} at {label} {backend} {dname} failed validation ({v['first_failure']}): "
                            "timed anyway")
                    notes.append(note)
                    log("  note: " + note)
                fn = fns[name]

                def call(i, fn=fn):
                    return fn(*inp.leaves(i), k)
                grad_leaves = inp.leaves

            if direction == "fwd":
                def run(i, call=call):
                    with torch.no_grad():
                        return call(i)
            else:
                def run(i, call=call, grad_leaves=grad_leaves):
                    out, loss = call(i)
                    return torch.autograd.grad([out, loss], grad_leaves(i), [inp.dys[i % len(inp.dys)], inp.one])
            try:
                st = timer.measure(run)
            except Exception as e_:  # noqa: BLE001
                r.update(status="failed" if name in ours_names or name == "pieces" else "skipped", reason=_reason(e_))
                continue
            finish_row(r, st, peak, bw)
            rate = f"{r['tflops']:.4g} TFLOP/s" if r["tflops"] else ""
            log(f"  {direction:>7} {name:>18}: {st['median']:.4g} ms [{st['p10']:.4g}-{st['p90']:.4g}] {rate}")

        def ok(name):
            r_ = group.get(name)
            return r_ if r_ and r_["status"] == "ok" else None

        loop, gmm, pieces = ok("torch_loop"), ok("torch_grouped_mm"), ok("pieces")
        auto = ok("ours:auto")
        if pieces and auto:
            pieces["share_of_layer"] = pieces["time_ms"]["median"] / auto["time_ms"]["median"]
        for name, r in group.items():
            if not ok(name) or name in ("torch_loop", "pieces"):
                continue
            tm = r["time_ms"]["median"]
            if loop:
                r["baseline"] = {"name": "torch_loop (Mixtral's per-expert loop)", "time_ms": loop["time_ms"],
                                 "tflops": loop["tflops"], "validation": loop["validation"]}
                r["vs_baseline"] = r["vs_loop"] = loop["time_ms"]["median"] / tm
            if gmm and name != "torch_grouped_mm":
                r["vs_grouped_mm"] = gmm["time_ms"]["median"] / tm
            if pieces and name in ours_names:
                r["pieces_share"] = pieces["time_ms"]["median"] / tm
        rows += list(group.values())
    del inp, fns
    _free(backend)
    return rows


# ---- the family --------------------------------------------------------------------------------------------

def resolve_variants(oo, args, device):
    rungs = list(oo.variants("grouped_gemm"))
    if args.variants_arg is None or args.variants_arg == ["all"]:
        ours = ["cpu"] if device == "cpu" else [v for v in rungs if v not in ("cpu", "naive")] + ["auto"]
        return ours
    for v in args.variants_arg:
        if v != "auto" and v not in rungs:
            raise SystemExit(f"--variants: expected all, auto or some of {', '.join(rungs)}; given '{v}'")
    return [v for v in args.variants_arg if (v == "cpu") == (device == "cpu") or v == "auto"]


def moe_rows(args, device, timer, ceilings, log, notes):
    import optimized_ops as oo

    plan = (QUICK if args.quick else DEFAULTS)[device]
    dtypes = list(args.dtypes_arg) if args.dtypes_arg else [plan["dtype"]]
    variants = resolve_variants(oo, args, device)
    notes += [
        "moe rows (bench/benchmark_moe.py): the case, direction and routing are in shape_label and the JSON's "
        "fields; gemm rows: ours = optimized_ops.grouped_mm(x, w, offs, variant=V), vs baseline = "
        "torch._grouped_mm's time / the row's (vs_grouped_mm); routing balanced (T k / E rows per expert) or zipf "
        f"(k distinct experts per token, P(expert i) ~ (i + 1)^-{ZIPF_S}, seeded); layer rows: ours:V = "
        "optimized_ops.moe_layer(variant=V) (dropless, SwiGLU, softmax top-k, normalized weights, aux + z losses), "
        "vs baseline = torch_loop's time / the row's (vs_loop), vs_grouped_mm = torch_grouped_mm's / the row's, "
        "pieces = ours without the experts, share_of_layer = pieces / ours:auto (issue 16 targets: gemm >= 1.0x "
        "balanced, >= 1.3x zipf and at 256 experts; layer >= 3x torch_loop, >= 1.2x torch_grouped_mm, pieces <= 10%)",
        "moe validation: gemm against float64 per group with the GEMM rule (gemm_allowed_error, n = K); layer: out "
        "and the gradients of x, router weight, w13, w2 against a float64 torch layer with our router's choice, "
        "max |err| <= 2 x the same-dtype torch layer's + rounding noise (reduction_allowed_error, n = max(T, d, d_ff))"]
    rows = []
    for dname in dtypes:
        if "gemm" in args.moe_cases:
            for e, k, kk, n, t in plan["gemm"]:
                for routing in ROUTINGS:
                    rows += gemm_group(oo, device, timer, log, notes, dname, e, k, kk, n, t, routing, variants,
                                       ceilings)
        if "layer" in args.moe_cases:
            e, k, d, f, t = plan["layer"]
            vs = list(variants)
            if "auto" not in vs:
                vs.append("auto")  # the pieces' share is against ours:auto
            rows += layer_rows(oo, args, device, timer, log, notes, dname, e, k, d, f, t, vs, ceilings)
    return rows


def add_arguments(p):
    p.add_argument("--moe-cases", dest="moe_cases_text", default=None,
                   help=f"moe: comma list of {', '.join(CASES)} (default all)")


def prepare(args, device):
    t = getattr(args, "moe_cases_text", None)
    args.moe_cases = t.split(",") if t else list(CASES)
    for c in args.moe_cases:
        if c not in CASES:
            raise SystemExit(f"--moe-cases: expected some of {', '.join(CASES)}; given '{c}'")


def ceiling_dtypes(args, device):
    if args.dtypes_arg:
        return [d for d in args.dtypes_arg if d in runner.DTYPES]
    return [(QUICK if args.quick else DEFAULTS)[device]["dtype"]]


FAMILY = runner.register(runner.Family(
    "moe", rows=moe_rows, add_arguments=add_arguments, prepare=prepare, ceiling_dtypes=ceiling_dtypes,
    summary="MoE: the grouped GEMM vs torch._grouped_mm (balanced and Zipf routing), the layer vs a torch "
            "per-expert loop and a torch._grouped_mm layer, fwd and fwd+bwd (bench/benchmark_moe.py)"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return runner.main(["--ops", "moe", *argv])


if __name__ == "__main__":
    sys.exit(main())
