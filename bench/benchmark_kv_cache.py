#!/usr/bin/env python3
"""Python benchmark of the KV-cache family (issue 14's targets): paged decode attention, every CUDA rung
against torch.nn.functional.scaled_dot_product_attention on the same K/V stored contiguously, the page-size
and fp8 sweeps, append with fused RoPE, and one CUDA-graph decode step, in one run.

    python bench/benchmark_kv_cache.py [--device cuda|cpu] [--variants all|auto|NAME,...] [--shapes BxL,...]
        [--cases decode,page_size,fp8,append,graph] [--naive-max-tokens N] [--quick] [--out bench/results]

is `python bench/benchmark_all.py --ops kv_cache ...` (bench/runner.py: the harness, statistics, cold-L2 timing
with CUDA events, ceilings, output files, the registry).

Setup (issue 14): decode, q_len = 1, bf16, GQA H_q = 32 / H_kv = 8, D = 128, page size 16, K/V pages scattered
(the page table is a random permutation of the cache's pages), (B, L) = (1, 32k), (16, 4k), (64, 4k), (128, 8k);
every sequence holds L tokens.

Cases (the row field "case"):
  decode     ours:<rung> = optimized_ops.paged_attention_decode(q (B, H_q, D), cache, page_table, seq_lens,
             variant=<rung>, validate=False) for contiguous_naive (only where B*L <= --naive-max-tokens: it
             re-reads each group's K/V per query head), paged, paged_split, paged_mma, auto; the peer `sdpa` =
             F.scaled_dot_product_attention(q (B, H_q, 1, D), k, v (B, H_kv, L, D) contiguous, enable_gqa=True)
             under torch's default backend choice. GB/s = K/V bytes read / time; vs_baseline = sdpa's time
             over the row's; vs_copy = GB/s over the device_copy ceiling of the run (a decode only reads: it can
             pass the copy figure, which counts a read and a write).
  page_size  ours:auto at (64, 4k) with page sizes 1 and 256 (--page-sizes); vs_page16 = the page-16 auto row's
             time over the row's (target: within 15%).
  fp8        ours:<paged rungs> at (64, 4k) with a float8_e4m3fn cache (per-head scales, q bf16); tokens/s =
             B / time (one new token per sequence and step); vs_bf16 = the bf16 row's time of the same rung over
             the row's (target >= 1.8x for auto).
  append     optimized_ops.append_kv(cache, k, v (B, H_kv, D), page_table, positions (B,), q=q, rope="neox",
             validate=False): one token per sequence at each decode shape, and a prefill chunk (16 x 1024
             tokens); bytes = k, v read + written, q read + written; vs_copy = GB/s over device_copy, and
             vs_copy_same_size = the time of a copy moving the same bytes (half read, half written) over the
             row's (target: >= 0.85x copy).
  graph      one decode step at B = 1, L = 1k: ours:graph = plan_paged_decode once, then the planned
             paged_attention_decode(..., plan=plan, validate=False) captured in a torch.cuda.CUDAGraph and
             replayed; ours:eager = the same planned call without the graph; sdpa = SDPA eager. time_ms is the
             harness's (CUDA events, cold L2); wall_us = host wall-clock per step over back-to-back steps
             (launch overhead included: the number this case is about); plan_us = plan_paged_decode's host time.
  prefill    chunked prefill over a cached prefix (B x prefix + chunk: (1, 4096 + 2048), (4, 2048 + 512),
             (8, 0 + 1024), (1, 32768 + 32)): ours:<v> = paged_attention_prefill(q (B, chunk, H_q, D), cache,
             page_table, seq_lens, validate=False) for auto (chunks >= 64: K/V gathered out of the pages, then
             flash2) and paged_mma; the peer flash_attention = optimized_ops.flash_attention(q, k, v, causal=True)
             on the same K/V stored contiguously (B, prefix + chunk, H_kv, D). TFLOP/s over 4*B*H_q*D*(chunk *
             prefix + chunk * (chunk + 1) / 2); vs_baseline = flash_attention's time over the row's. No target in
             issue 14: it says what the gather costs and what the decode-shaped rung loses.

Validation (before any timing, flash-attention's rule, bench/tolerance.attention_allowed_error): the outputs of
up to three sequences (first, middle, last; every head) against float64 attention over the gathered K/V (the
dequantized cache for fp8); max|impl - fp64| <= 2 x max|same-dtype torch math - fp64| + rounding noise with
n = L. A failing rung is a failed row, not timed; a failing peer is noted and timed. Append: the written K (after
RoPE) and V slots and the rotated q against a float64 RoPE, with the reduction rule (n = 2).

CPU (--device cpu; `--quick` the smoke test): the cpu rung against SDPA (math) at small shapes, same cases but
the graph one (CUDA only).

Output: python-kv_cache.{json,md} under --out/<gpu>/ (bench/runner.py names the files python-<family>).
"""

from __future__ import annotations

import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
from tolerance import accumulation_unit, attention_allowed_error, reduction_allowed_error  # noqa: E402

CASES = ["decode", "page_size", "fp8", "append", "graph", "prefill"]
CUDA_RUNGS = ["contiguous_naive", "paged", "paged_split", "paged_mma", "auto"]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# Per device: (heads_q, heads_kv, head_dim, dtype, decode shapes (B, L), sweep shape, page sizes, graph shape,
# append prefill chunk (B, S_new), page size)
DEFAULTS = {
    "cuda": dict(hq=32, hkv=8, d=128, dtype="bf16", shapes=[(1, 32768), (16, 4096), (64, 4096), (128, 8192)],
                 sweep=(64, 4096), page_sizes=[1, 256], graph=(1, 1024), chunk=(16, 1024), page=16,
                 prefill=[(1, 4096, 2048), (4, 2048, 512), (8, 0, 1024), (1, 32768, 32)]),
    "cpu": dict(hq=8, hkv=2, d=64, dtype="fp32", shapes=[(1, 2048), (4, 512)], sweep=(4, 512), page_sizes=[1, 64],
                graph=(1, 256), chunk=(2, 64), page=16, prefill=[(1, 512, 128)]),
}
QUICK = {
    "cuda": dict(DEFAULTS["cuda"], shapes=[(1, 32768), (64, 4096)]),
    "cpu": dict(hq=4, hkv=2, d=32, dtype="fp32", shapes=[(1, 256), (3, 100)], sweep=(3, 100), page_sizes=[1, 64],
                graph=(1, 64), chunk=(2, 16), page=16, prefill=[(1, 64, 64)]),
}


def kv_bytes(batch, seqlen, hkv, d, elem):
    """The figure of merit's bytes: K and V read once, 2 * L * H_kv * D * E per sequence."""
    return 2 * batch * seqlen * hkv * d * elem


def decode_flops(batch, seqlen, hq, d):
    return 4.0 * batch * hq * seqlen * d


def _reason(e):
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text[:300]


# ---- problems ----------------------------------------------------------------------------------

class Problem:
    """B sequences of L tokens in a paged cache with a shuffled page table, and the same K/V contiguous."""

    def __init__(self, oo, batch, seqlen, hq, hkv, d, page, dtype, cache_dtype, device, gen, contiguous=True):
        self.batch, self.seqlen, self.hq, self.hkv, self.d, self.page = batch, seqlen, hq, hkv, d, page
        self.dtype, self.cache_dtype = dtype, cache_dtype
        per_seq = -(-seqlen // page)
        num_pages = batch * per_seq
        self.cache = None
        scales = {}
        if cache_dtype == FP8:
            scales = dict(k_scale=torch.full((hkv,), 1.0 / 64, device=device),
                          v_scale=torch.full((hkv,), 1.0 / 64, device=device))
        self.cache = oo.PagedKVCache(num_pages, page, hkv, d, dtype=cache_dtype, device=device, **scales)
        for pages, scale in ((self.cache.k_pages, self.cache.k_scale), (self.cache.v_pages, self.cache.v_scale)):
            for i in range(0, num_pages, 4096):  # in chunks: a float32 temporary of the whole cache is GBs
                x = torch.randn(pages[i:i + 4096].shape, device=device, generator=gen)
                if scale is not None:
                    x = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
                pages[i:i + 4096] = x.to(cache_dtype)
        perm = torch.randperm(num_pages, device="cpu", generator=torch.Generator().manual_seed(77 + batch + seqlen))
        self.page_table = perm.view(batch, per_seq).to(torch.int32).to(device)
        self.seq_lens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, hq, d, device=device, generator=gen).to(dtype)
        self.k = self.v = None
        if contiguous:
            self.k, self.v = self.contiguous(dtype)

    def contiguous(self, dtype, seqs=None):
        """K, V as (B', H_kv, L, D) contiguous tensors of `dtype` (dequantized for fp8), for `seqs` (default all)."""
        table = self.page_table if seqs is None else self.page_table[seqs]
        out = []
        for pages, scale in ((self.cache.k_pages, self.cache.k_scale), (self.cache.v_pages, self.cache.v_scale)):
            x = pages[table.long()]  # (B', P, page, H_kv, D)
            x = x.reshape(x.shape[0], -1, self.hkv, self.d)[:, :self.seqlen]
            if scale is not None:
                x = x.to(torch.float32) * scale[:, None]
            out.append(x.to(dtype).transpose(1, 2).contiguous())
            del x
        return out

    def kv_bytes(self):
        return kv_bytes(self.batch, self.seqlen, self.hkv, self.d, self.cache.k_pages.element_size())

    def label(self):
        return f"{self.batch}x{self.seqlen}"


def sdpa(q, k, v):
    """The peer: q (B, H_q, D) -> (B, H_q, D) over contiguous (B, H_kv, L, D) K/V."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)


def pick_seqs(batch):
    return sorted({0, batch // 2, batch - 1})


class DecodeReference:
    """float64 attention of the picked sequences, and the same-dtype torch math path's error against it."""

    def __init__(self, p):
        self.seqs = pick_seqs(p.batch)
        idx = torch.tensor(self.seqs, device=p.q.device)
        k64, v64 = p.contiguous(torch.float64, idx)
        q = p.q[idx]
        self.ref = sdpa_math(q.to(torch.float64), k64, v64)
        same_dtype = p.dtype
        ks, vs = k64.to(same_dtype), v64.to(same_dtype)  # exact: the cache's values (fp8 * scale) fit bf16
        self.same_error = (sdpa_math(q, ks, vs).to(torch.float64) - self.ref).abs().max().item()
        self.max_ref = self.ref.abs().max().item()
        self.idx, self.seqlen = idx, p.seqlen

    def check(self, out, dname):
        err = (out[self.idx].to(torch.float64) - self.ref).abs().max().item()
        allowed = attention_allowed_error(dname, self.seqlen, self.same_error, self.max_ref)
        ok = err <= allowed and math.isfinite(err)
        return {"passed": ok, "max_error": err, "allowed": allowed, "same_dtype_error": self.same_error,
                "sequences": self.seqs,
                "first_failure": "" if ok else f"max error {err:.3g} > allowed {allowed:.3g}"}


def sdpa_math(q, k, v):
    """Explicit math (works for float64 and on every device): q (B, H_q, D), k, v (B, H_kv, L, D)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("bhd,bhld->bhl", q, k) / math.sqrt(q.shape[-1])
    if q.dtype in (torch.float16, torch.bfloat16):
        s = s.to(q.dtype)
    p = torch.softmax(s.float() if q.dtype != torch.float64 else s, dim=-1).to(q.dtype)
    return torch.einsum("bhl,bhld->bhd", p, v)


# ---- rows --------------------------------------------------------------------------------------

def base_row(case, variant, device, dname, p_or_shape, label, cache_dtype, page):
    return {"op": "kv_cache", "family": "kv_cache", "case": case, "direction": "fwd", "variant": variant,
            "backend": device, "dtype": dname, "cache_dtype": str(cache_dtype).removeprefix("torch."),
            "page_size": page, "shape": p_or_shape, "shape_label": label,
            "threads": torch.get_num_threads() if device == "cpu" else None, "status": "ok", "reason": "",
            "validation": None, "time_ms": None, "flops": None, "min_bytes": None, "bytes_formula": None,
            "tflops": None, "gbps": None, "baseline": None, "vs_baseline": None, "vs_copy": None,
            "roofline_fraction": None, "roofline_bandwidth": None, "tokens_per_s": None, "kernel": None}


def finish_row(r, st, bw):
    r["time_ms"] = runner.stats_json(st)
    sec = st["median"] * 1e-3
    if r["flops"]:
        r["tflops"] = r["flops"] / sec / 1e12
    r["gbps"] = r["min_bytes"] / sec / 1e9
    if bw:
        r["roofline_bandwidth"] = {"name": bw["name"], "value": bw["value"], "unit": "GB/s"}
        r["vs_copy"] = r["gbps"] / bw["value"]
        r["roofline_fraction"] = r["vs_copy"]


def decode_group(oo, args, device, timer, log, notes, cfg, dname, batch, seqlen, page, cache_dtype, variants,
                 peer, bw, case):
    dtype = runner.DTYPES[dname]
    gen = torch.Generator(device=device).manual_seed(1400 + batch + seqlen + page)
    cdname = "fp8_e4m3" if cache_dtype == FP8 else dname
    label = f"{batch}x{seqlen}"
    shape = {"batch": batch, "seqlen": seqlen, "heads_q": cfg["hq"], "heads_kv": cfg["hkv"], "head_dim": cfg["d"],
             "page_size": page}
    log(f"kv_cache {case} {dname} cache {cdname} B={batch} L={seqlen} page {page}")
    rows = []
    try:
        p = Problem(oo, batch, seqlen, cfg["hq"], cfg["hkv"], cfg["d"], page, dtype, cache_dtype, device, gen,
                    contiguous=peer)
    except torch.cuda.OutOfMemoryError as e:
        for v in variants + (["sdpa"] if peer else []):
            r = base_row(case, v, device, dname, shape, label, cache_dtype, page)
            r.update(status="skipped", reason="out of memory building the problem: " + _reason(e))
            rows.append(r)
        return rows
    ref = DecodeReference(p)
    impls = [(f"ours:{v}", v) for v in variants] + ([("sdpa", None)] if peer else [])
    for name, v in impls:
        r = base_row(case, v or "sdpa", device, dname, shape, label, cache_dtype, page)
        r.update(flops=decode_flops(batch, seqlen, cfg["hq"], cfg["d"]), min_bytes=p.kv_bytes(),
                 bytes_formula="2*B*L*H_kv*D*E (K and V read once; E = the cache's bytes per element)")
        rows.append(r)
        if v == "contiguous_naive" and batch * seqlen > args.naive_max_tokens:
            r.update(status="skipped", reason=f"contiguous_naive above --naive-max-tokens {args.naive_max_tokens} "
                                              "(B*L): it re-reads each group's K/V per query head")
            continue
        if v is None:
            def call(i, p=p):
                return sdpa(p.q, p.k, p.v)
        else:
            def call(i, p=p, v=v):
                return oo.paged_attention_decode(p.q, p.cache, p.page_table, p.seq_lens, validate=False, variant=v)
        try:
            with torch.no_grad():
                if v is not None:  # the checked mode once (the page table read back)
                    out = oo.paged_attention_decode(p.q, p.cache, p.page_table, p.seq_lens, validate=True, variant=v)
                else:
                    out = call(0)
                check = ref.check(out, dname)
                del out
        except Exception as e:  # noqa: BLE001 - reported in the row
            r.update(status="failed" if v is not None else "skipped", reason=_reason(e))
            log(f"  {name}: {r['reason']}")
            continue
        r["validation"] = check
        if not check["passed"]:
            if v is not None:
                r.update(status="failed", reason="validation: " + check["first_failure"])
                log(f"  {name}: {r['reason']}")
                continue
            notes.append(f"kv_cache sdpa at {case} {label} failed validation ({check['first_failure']}): timed anyway")
        try:
            with torch.no_grad():
                st = timer.measure(call)
        except Exception as e:  # noqa: BLE001
            r.update(status="failed" if v is not None else "skipped", reason=_reason(e))
            continue
        finish_row(r, st, bw)
        r["tokens_per_s"] = batch / (st["median"] * 1e-3)
        log(f"  {name:>22}: {st['median'] * 1e3:.4g} us [{st['p10'] * 1e3:.4g}-{st['p90'] * 1e3:.4g}] "
            f"{r['gbps']:.4g} GB/s")
    base = next((r for r in rows if r["variant"] == "sdpa" and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok" and r is not base:
            r["baseline"] = {"name": "sdpa (contiguous K/V, enable_gqa=True)", "time_ms": base["time_ms"],
                             "gbps": base["gbps"]}
            r["vs_baseline"] = base["time_ms"]["median"] / r["time_ms"]["median"]
    del p, ref
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---- prefill -----------------------------------------------------------------------------------

def prefill_flops(batch, hq, d, prefix, chunk):
    """q . k and p . v of a chunk of `chunk` queries over `prefix` cached keys and itself (causal)."""
    return 4.0 * batch * hq * d * (chunk * prefix + chunk * (chunk + 1) / 2)


def prefill_group(oo, args, device, timer, log, cfg, dname, batch, prefix, chunk, page, variants):
    """paged_attention_prefill of a chunk over a cached prefix (pages scattered) against
    optimized_ops.flash_attention (causal, bottom-right) on the same K/V stored contiguously; checked on
    the first and last 64 queries of sequence 0 against float64 attention."""
    dtype = runner.DTYPES[dname]
    hq, hkv, d, total = cfg["hq"], cfg["hkv"], cfg["d"], prefix + chunk
    label = f"{batch}x{prefix}+{chunk}"
    shape = {"batch": batch, "prefix": prefix, "chunk": chunk, "heads_q": hq, "heads_kv": hkv, "head_dim": d,
             "page_size": page}
    log(f"kv_cache prefill {dname} B={batch} prefix={prefix} chunk={chunk} page {page}")
    gen = torch.Generator(device=device).manual_seed(1500 + batch + total)
    per_seq = -(-total // page)
    cache = oo.PagedKVCache(batch * per_seq, page, hkv, d, dtype=dtype, device=device)
    perm = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(91 + total))
    table = perm.view(batch, per_seq).to(torch.int32).to(device)
    k = torch.randn(batch, total, hkv, d, device=device, generator=gen).to(dtype)
    v = torch.randn(batch, total, hkv, d, device=device, generator=gen).to(dtype)
    q = torch.randn(batch, chunk, hq, d, device=device, generator=gen).to(dtype)
    pos = torch.arange(total, dtype=torch.int32, device=device).repeat(batch, 1)
    oo.append_kv(cache, k, v, table, pos, validate=False)
    lens = torch.full((batch,), total, dtype=torch.int32, device=device)
    rows_idx = sorted(set(range(min(64, chunk))) | set(range(max(0, chunk - 64), chunk)))
    ridx = torch.tensor(rows_idx, device=device)

    def attention64(qq, kk, vv, dt):
        """(len(rows), H_q, D) attention of sequence 0's picked queries in dt (float64: the reference)."""
        group = hq // hkv
        kh = kk[0].to(dt).transpose(0, 1).repeat_interleave(group, 0)      # (H_q, L, D)
        vh = vv[0].to(dt).transpose(0, 1).repeat_interleave(group, 0)
        qh = qq[0, ridx].to(dt).transpose(0, 1)                              # (H_q, R, D)
        s_ = (qh @ kh.transpose(-1, -2)).float() / math.sqrt(d) if dt != torch.float64 else \
            (qh @ kh.transpose(-1, -2)) / math.sqrt(d)
        allowed = torch.arange(total, device=device)[None, :] <= (ridx[:, None] + prefix)
        s_ = s_.masked_fill(~allowed, -math.inf)
        p_ = torch.softmax(s_, dim=-1).to(dt)
        return (p_ @ vh).transpose(0, 1).to(torch.float64)                   # (R, H_q, D)

    ref = attention64(q, k, v, torch.float64)
    same_error = (attention64(q, k, v, dtype) - ref).abs().max().item()
    max_ref = ref.abs().max().item()
    impls = [(f"ours:{var}", var) for var in variants] + [("flash_attention", None)]
    rows = []
    for name, var in impls:
        r = base_row("prefill", var or "flash_attention", device, dname, shape, label, dtype, page)
        r.update(flops=prefill_flops(batch, hq, d, prefix, chunk), min_bytes=kv_bytes(batch, total, hkv, d,
                                                                                      k.element_size()),
                 bytes_formula="2*B*(prefix+chunk)*H_kv*D*E (the K/V read once)")
        rows.append(r)
        if var is None:
            def call(i):
                return oo.flash_attention(q, k, v, causal=True)
        else:
            def call(i, var=var):
                return oo.paged_attention_prefill(q, cache, table, lens, validate=False, variant=var)
        try:
            with torch.no_grad():
                out = call(0)
                err = (out[0, ridx].to(torch.float64) - ref).abs().max().item()
                allowed = attention_allowed_error(dname, total, same_error, max_ref)
                ok = err <= allowed and math.isfinite(err)
                r["validation"] = {"passed": ok, "max_error": err, "allowed": allowed, "same_dtype_error": same_error,
                                   "sequences": [0], "first_failure": "" if ok else
                                   f"max error {err:.3g} > allowed {allowed:.3g}"}
                del out
            if not ok:
                r.update(status="failed", reason="validation: " + r["validation"]["first_failure"])
                log(f"  {name}: {r['reason']}")
                continue
            with torch.no_grad():
                st = timer.measure(call)
        except Exception as e:  # noqa: BLE001 - reported in the row
            r.update(status="failed", reason=_reason(e))
            log(f"  {name}: {r['reason']}")
            continue
        finish_row(r, st, None)
        r["tokens_per_s"] = batch * chunk / (st["median"] * 1e-3)
        log(f"  {name:>22}: {st['median'] * 1e3:.4g} us [{st['p10'] * 1e3:.4g}-{st['p90'] * 1e3:.4g}] "
            f"{r['tflops']:.4g} TFLOP/s")
    base = next((r for r in rows if r["variant"] == "flash_attention" and r["status"] == "ok"), None)
    for r in rows:
        if base and r["status"] == "ok" and r is not base:
            r["baseline"] = {"name": "optimized_ops.flash_attention (contiguous K/V, causal)",
                             "time_ms": base["time_ms"]}
            r["vs_baseline"] = base["time_ms"]["median"] / r["time_ms"]["median"]
    del cache, k, v, q
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---- append ------------------------------------------------------------------------------------

def rope_neox64(x, pos, theta=10000.0):
    """x (..., T, H, D) float64, pos (..., T): neox rotation over all D."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float64, device=x.device) * 2.0 / d)
    ang = pos.to(torch.float64)[..., None, None] * inv  # (..., T, 1, D/2)
    c, s = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def append_group(oo, args, device, timer, log, cfg, dname, batch, s_new, seqlen, page, bw, copy_same_size):
    dtype = runner.DTYPES[dname]
    hq, hkv, d = cfg["hq"], cfg["hkv"], cfg["d"]
    elem = torch.tensor([], dtype=dtype).element_size()
    label = f"{batch}x{s_new}@{seqlen}"
    shape = {"batch": batch, "new_tokens": s_new, "seqlen": seqlen, "heads_q": hq, "heads_kv": hkv, "head_dim": d,
             "page_size": page}
    r = base_row("append", "auto", device, dname, shape, label, dtype, page)
    mb = 2 * (2 * batch * s_new * hkv * d * elem) + 2 * batch * s_new * hq * d * elem
    r.update(min_bytes=mb, bytes_formula="2*(2*T*H_kv*D*E) + 2*T*H_q*D*E (k, v read, written into their pages; "
                                         "q read, rotated in place; T = B*S_new tokens)")
    log(f"kv_cache append {dname} B={batch} S_new={s_new} at L={seqlen}")
    gen = torch.Generator(device=device).manual_seed(1500 + batch + s_new)
    per_seq = -(-seqlen // page)
    cache = oo.PagedKVCache(batch * per_seq, page, hkv, d, dtype=dtype, device=device)
    perm = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(91))
    table = perm.view(batch, per_seq).to(torch.int32).to(device)
    start = seqlen - s_new
    pos = (start + torch.arange(s_new, device=device, dtype=torch.int32)).expand(batch, s_new).contiguous()
    k = torch.randn(batch, s_new, hkv, d, device=device, generator=gen).to(dtype)
    v = torch.randn(batch, s_new, hkv, d, device=device, generator=gen).to(dtype)
    q0 = torch.randn(batch, s_new, hq, d, device=device, generator=gen).to(dtype)
    one = s_new == 1
    kk, vv, qq, pp = (k[:, 0], v[:, 0], q0[:, 0].clone(), pos[:, 0]) if one else (k, v, q0.clone(), pos)
    try:
        oo.append_kv(cache, kk, vv, table, pp, q=qq, rope="neox", validate=True)
        # validation: the written slots and q against float64 RoPE
        t = pos.long()
        pages = table.long().gather(1, t // page)
        slots = t % page
        got_k, got_v = cache.k_pages[pages, slots], cache.v_pages[pages, slots]
        got_q = qq.unsqueeze(1) if one else qq
        worst = None
        for name, got, x, rot in (("k", got_k, k, True), ("v", got_v, v, False), ("q", got_q, q0, True)):
            ref = rope_neox64(x.to(torch.float64), pos) if rot else x.to(torch.float64)
            same = _rope_same_dtype(x, pos).to(torch.float64) if rot else ref  # float32 math, one rounding
            err = (got.to(torch.float64) - ref).abs().max().item()
            allowed = reduction_allowed_error(dname, 2, (same - ref).abs().max().item(), ref.abs().max().item(),
                                              0.0, accumulation_unit(dname))
            if worst is None or err / allowed > worst[1] / worst[2]:
                worst = (name, err, allowed)
        ok = worst[1] <= worst[2]
        r["validation"] = {"passed": ok, "max_error": worst[1], "allowed": worst[2], "tensor": worst[0],
                           "first_failure": "" if ok else f"{worst[0]}: max error {worst[1]:.3g} > {worst[2]:.3g}"}
    except Exception as e:  # noqa: BLE001
        r.update(status="failed", reason=_reason(e))
        log(f"  append: {r['reason']}")
        return [r]
    if not ok:
        r.update(status="failed", reason="validation: " + r["validation"]["first_failure"])
        log(f"  append: {r['reason']}")
        return [r]
    st = timer.measure(lambda i: oo.append_kv(cache, kk, vv, table, pp, q=qq, rope="neox", validate=False))
    finish_row(r, st, bw)
    r["tokens_per_s"] = batch * s_new / (st["median"] * 1e-3)
    cst = copy_same_size(mb)
    if cst:
        r["copy_same_size"] = runner.stats_json(cst)
        r["vs_copy_same_size"] = cst["median"] / st["median"]
    log(f"  append: {st['median'] * 1e3:.4g} us {r['gbps']:.4g} GB/s")
    return [r]


def _rope_same_dtype(x, pos, theta=10000.0):
    """RoPE computed in float32 and rounded once to x's dtype (what a fused kernel does)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d // 2, dtype=torch.float32, device=x.device) * 2.0 / d)
    ang = pos.to(torch.float32)[..., None, None] * inv
    c, s = torch.cos(ang), torch.sin(ang)
    xf = x.float()
    x1, x2 = xf[..., :d // 2], xf[..., d // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def make_copy_same_size(device, timer):
    cache = {}

    def measure(nbytes):
        half = max(int(nbytes) // 2, 1)
        if half not in cache:
            src = torch.empty(half, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            cache[half] = timer.measure(lambda i: dst.copy_(src))
        return cache[half]
    return measure


# ---- the CUDA-graph step -------------------------------------------------------------------------

def graph_group(oo, args, device, timer, log, cfg, dname, batch, seqlen, page, bw):
    dtype = runner.DTYPES[dname]
    shape = {"batch": batch, "seqlen": seqlen, "heads_q": cfg["hq"], "heads_kv": cfg["hkv"], "head_dim": cfg["d"],
             "page_size": page}
    label = f"{batch}x{seqlen}"
    names = ["graph", "eager", "sdpa"]
    rows = {n: base_row("graph", n, device, dname, shape, label, dtype, page) for n in names}
    for r in rows.values():
        r.update(flops=decode_flops(batch, seqlen, cfg["hq"], cfg["d"]),
                 min_bytes=kv_bytes(batch, seqlen, cfg["hkv"], cfg["d"], torch.tensor([], dtype=dtype).element_size()),
                 bytes_formula="2*B*L*H_kv*D*E")
    if device != "cuda":
        for r in rows.values():
            r.update(status="skipped", reason="CUDA graphs: CUDA only")
        return list(rows.values())
    log(f"kv_cache graph {dname} B={batch} L={seqlen}")
    gen = torch.Generator(device=device).manual_seed(1600)
    p = Problem(oo, batch, seqlen, cfg["hq"], cfg["hkv"], cfg["d"], page, dtype, dtype, device, gen)
    ref = DecodeReference(p)
    t0 = time.perf_counter()
    plan = oo.plan_paged_decode(batch, cfg["hq"], cfg["hkv"], cfg["d"], page_size=page, max_seq_len=seqlen,
                                dtype=dtype, device=device)
    plan_us = (time.perf_counter() - t0) * 1e6
    calls = {}
    with torch.no_grad():
        calls["eager"] = lambda i: oo.paged_attention_decode(p.q, p.cache, p.page_table, p.seq_lens, plan=plan,
                                                             validate=False)
        calls["sdpa"] = lambda i: sdpa(p.q, p.k, p.v)
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    calls["eager"](0)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = calls["eager"](0)
            calls["graph"] = lambda i: g.replay()
        except Exception as e:  # noqa: BLE001
            rows["graph"].update(status="failed", reason="capture: " + _reason(e))
    for n in names:
        r = rows[n]
        if r["status"] != "ok":
            continue
        try:
            with torch.no_grad():
                out = calls[n](0)
                if n == "graph":
                    torch.cuda.synchronize()
                    out = static_out
                check = ref.check(out, dname)
        except Exception as e:  # noqa: BLE001
            r.update(status="failed" if n != "sdpa" else "skipped", reason=_reason(e))
            continue
        r["validation"] = check
        if not check["passed"] and n != "sdpa":
            r.update(status="failed", reason="validation: " + check["first_failure"])
            continue
        with torch.no_grad():
            st = timer.measure(calls[n])
            finish_row(r, st, bw)
            # host wall clock per step, back to back (launch overhead included), warm
            steps = 20 if args.quick else 1000
            for _ in range(10):
                calls[n](0)
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            for _ in range(steps):
                calls[n](0)
            torch.cuda.synchronize()
            r["wall_us"] = (time.perf_counter() - w0) / steps * 1e6
        if n != "sdpa":
            r["plan_us"] = plan_us
            r["plan"] = {"variant": plan.variant, "splits": plan.splits, "workspace_bytes": plan.workspace_bytes}
        log(f"  {n:>6}: {st['median'] * 1e3:.4g} us (events), {r['wall_us']:.4g} us/step wall")
    base = rows["sdpa"]
    for n in ("graph", "eager"):
        r = rows[n]
        if r["status"] == "ok" and base["status"] == "ok":
            r["baseline"] = {"name": "sdpa eager", "time_ms": base["time_ms"], "wall_us": base["wall_us"]}
            r["vs_baseline"] = base["time_ms"]["median"] / r["time_ms"]["median"]
            r["vs_baseline_wall"] = base["wall_us"] / r["wall_us"]
    return list(rows.values())


# ---- the family --------------------------------------------------------------------------------

def resolve_variants(args, device):
    import optimized_ops as oo

    rungs = list(oo.variants("kv_cache"))
    if device == "cpu":
        ours = ["cpu"]
    else:
        ours = [v for v in CUDA_RUNGS if v == "auto" or v in rungs]
    if args.variants_arg is None or args.variants_arg == ["all"]:
        return ours
    for v in args.variants_arg:
        if v != "auto" and v not in rungs:
            raise SystemExit(f"--variants: expected all, auto or some of {', '.join(rungs)}; given '{v}'")
    return list(args.variants_arg)


def kv_cache_rows(args, device, timer, ceilings, log, notes):
    import optimized_ops as oo

    cfg = dict((QUICK if args.quick else DEFAULTS)[device])
    if args.shapes_arg:
        cfg["shapes"] = [parse_bl(s) for s in args.shapes_arg]
    dname = (args.dtypes_arg or [cfg["dtype"]])[0]
    page = cfg["page"]
    variants = resolve_variants(args, device)
    cases = args.kv_cases
    bw = next((c for c in ceilings if c["unit"] == "GB/s"), None)
    notes += [
        f"kv_cache rows (bench/benchmark_kv_cache.py): decode q_len 1, {dname}, GQA {cfg['hq']}/{cfg['hkv']}, "
        f"D = {cfg['d']}, pages scattered (shuffled page table); ours = optimized_ops.paged_attention_decode(..., "
        "variant=V, validate=False); sdpa = F.scaled_dot_product_attention(q (B, H_q, 1, D), k, v (B, H_kv, L, D) "
        "contiguous, enable_gqa=True); GB/s = K/V bytes read (2*B*L*H_kv*D*E) / time; vs sdpa = sdpa's time / "
        "the row's; vs copy = GB/s / device_copy of this run",
        "kv_cache validation: up to 3 sequences (every head) against float64 attention over the gathered (fp8: "
        "dequantized) K/V, flash-attention's rule with n = L; append: written K (RoPE neox), V and rotated q "
        "against float64, the reduction rule with n = 2",
        "kv_cache graph: plan_paged_decode once, the planned call captured in torch.cuda.CUDAGraph and replayed; "
        "time = CUDA events (cold L2), wall us = host time per step over back-to-back steps (warm)"]
    rows = []
    decode_rows = []
    if "decode" in cases:
        for b, l in cfg["shapes"]:
            decode_rows += decode_group(oo, args, device, timer, log, notes, cfg, dname, b, l, page,
                                        runner.DTYPES[dname], variants, True, bw, "decode")
        rows += decode_rows
    sb, sl = cfg["sweep"]

    def ref_row(rs, variant, b, l):
        return next((r for r in rs if r["variant"] == variant and r["shape"]["batch"] == b
                     and r["shape"]["seqlen"] == l and r["status"] == "ok"), None)

    if "page_size" in cases:
        auto = "auto" if device == "cuda" else "cpu"
        base = ref_row(decode_rows, auto, sb, sl)
        sweep = []
        sizes = list(args.page_sizes or cfg["page_sizes"])
        if base is None and page not in sizes:
            sizes.append(page)
        for ps in sizes:
            sweep += decode_group(oo, args, device, timer, log, notes, cfg, dname, sb, sl, ps, runner.DTYPES[dname],
                                  [auto], False, bw, "page_size")
        base = base or ref_row(sweep, auto, sb, sl)
        for r in sweep:
            if base and r["status"] == "ok":
                r["vs_page16"] = base["time_ms"]["median"] / r["time_ms"]["median"]
                r["page16_time_ms"] = base["time_ms"]
        rows += sweep
    if "fp8" in cases:
        fvars = [v for v in variants if v != "contiguous_naive"]
        fp8_rows = decode_group(oo, args, device, timer, log, notes, cfg, dname, sb, sl, page, FP8, fvars, False, bw,
                                "fp8")
        for r in fp8_rows:
            b16 = ref_row(decode_rows, r["variant"], sb, sl)
            if b16 and r["status"] == "ok":
                r["vs_bf16"] = b16["time_ms"]["median"] / r["time_ms"]["median"]
                r["bf16_tokens_per_s"] = b16["tokens_per_s"]
        rows += fp8_rows
    if "append" in cases:
        copy_same = make_copy_same_size(device, timer)
        cb, cs = cfg["chunk"]  # a prefill chunk of cs tokens per sequence, written at positions cs..2cs-1
        for b, s_new, l in [(b, 1, l) for b, l in cfg["shapes"]] + [(cb, cs, 2 * cs)]:
            rows += append_group(oo, args, device, timer, log, cfg, dname, b, s_new, l, page, bw, copy_same)
    if "graph" in cases:
        gb, gl = cfg["graph"]
        rows += graph_group(oo, args, device, timer, log, cfg, dname, gb, gl, page, bw)
    if "prefill" in cases:
        pvars = ["auto", "paged_mma"] if device == "cuda" else ["auto", "cpu"]
        for b, prefix, chunk in cfg["prefill"]:
            rows += prefill_group(oo, args, device, timer, log, cfg, dname, b, prefix, chunk, page, pvars)
    return rows


def parse_bl(text):
    parts = text.lower().split("x")
    try:
        b, l = (int(x) for x in parts)
    except ValueError:
        b = l = 0
    if len(parts) != 2 or min(b, l) < 1:
        raise SystemExit(f"--shapes: kv_cache shapes are BxL (batch x cached tokens); given '{text}'")
    return b, l


def add_arguments(p):
    p.add_argument("--cases", dest="kv_cases_text", default=None,
                   help=f"kv_cache: comma list of {', '.join(CASES)} (default all)")
    p.add_argument("--page-sizes", dest="page_sizes_text", default=None,
                   help="kv_cache: the page-size sweep at B=64 L=4k (default 1,256; compared with 16)")
    p.add_argument("--naive-max-tokens", type=int, default=16 * 4096,
                   help="kv_cache: largest B*L for contiguous_naive (default 65536)")


def prepare(args, device):
    args.kv_cases = args.kv_cases_text.split(",") if getattr(args, "kv_cases_text", None) else list(CASES)
    for c in args.kv_cases:
        if c not in CASES:
            raise SystemExit(f"--cases: expected some of {', '.join(CASES)}; given '{c}'")
    t = getattr(args, "page_sizes_text", None)
    args.page_sizes = [int(x) for x in t.split(",")] if t else None


def ceiling_dtypes(args, device):
    return []  # memory-bound: the copy ceiling only


FAMILY = runner.register(runner.Family(
    "kv_cache", rows=kv_cache_rows, add_arguments=add_arguments, prepare=prepare, ceiling_dtypes=ceiling_dtypes,
    summary="paged decode attention (contiguous_naive, paged, paged_split, paged_mma) vs SDPA enable_gqa on contiguous K/V, "
            "page sizes, fp8, append+RoPE, CUDA-graph step (bench/benchmark_kv_cache.py)"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    return runner.main(["--ops", "kv_cache", *argv])


if __name__ == "__main__":
    sys.exit(main())
