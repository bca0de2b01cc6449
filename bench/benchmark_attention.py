#!/usr/bin/env python3
"""Python benchmark of the attention family: every rung of optimized_ops.flash_attention (naive, flash,
flash2; cpu on the CPU) against torch.nn.functional.scaled_dot_product_attention with each backend
forced, forward and forward+backward, in one run; and the peak-memory table (--memory).

    python bench/benchmark_attention.py [--device cuda|cpu] [--dtypes bf16,fp16] [--variants all|auto|NAME,...]
        [--seqlens 1024,4096,16384] [--head-dims 64,128] [--tokens 16384] [--hidden 2048] [--shapes BxSxHxD,...]
        [--causal both|on|off] [--varlen auto|off|only] [--directions fwd,bwd,fwd+bwd] [--peers flash,cudnn,...]
        [--quick] [--out bench/results]
    python bench/benchmark_attention.py --memory [--device cuda|cpu] [--memory-seqlens 8192,16384] [--quick]

is `python bench/benchmark_all.py --ops attention ...` (the memory mode: `benchmark_all.py attention-memory
...`): the attention family of the Python runner (bench/runner.py holds the harness: statistics, stopping rule,
cold-cache timing with CUDA events, rotating inputs, ceilings, output files, and the registry this module adds
itself to).

Shapes (the FlashAttention papers' setup): per head dim D and sequence length N, B = tokens / N sequences and
H = hidden / D heads (default 16384 tokens, hidden 2048: N = 16k is B = 1, H = 16 at D = 128), causal and not;
--shapes BxSxHxD gives them directly. q, k, v are (B, S, H, D) tensors drawn from N(0, 1); the SDPA peers take
(B, H, S, D) transpose views of the same data (what a model's qkv projection hands them), no copy.

What is compared, per (dtype, shape, causal):
  ours:<v>       optimized_ops.flash_attention(q, k, v, causal=..., variant=v), v each rung (--variants all, the
                 default: naive, flash, flash2 on CUDA; cpu on the CPU) or auto; naive only where its O(N^2)
                 workspace (B*H*S_q*S_k*4 bytes, x2 for the backward) fits the free device memory (else a skipped
                 row that says so)
  sdpa_<b>       F.scaled_dot_product_attention under torch.nn.attention.sdpa_kernel([SDPBackend.<B>]), the context
                 entered once around the validation and around the whole timed loop (not per call): flash
                 (FlashAttention-2, the target peer), cudnn, efficient, math (math only up to --math-max-seqlen and
                 where its O(N^2) intermediates fit; a backend that refuses a shape is a skipped row with its reason)
  varlen         optimized_ops.flash_attention_varlen on the same number of tokens packed as B sequences of unequal
                 lengths (drawn with a fixed seed between N/2 and 3N/2, summing to B*N), for every fixed shape with
                 B >= 2; compared by TFLOP/s with the same rung at fixed length N ("vs fixed"; target >= 0.9)
  GQA rows (--gqa g): the same shape with H / g kv heads (forward only), compared per query head with the
                 MHA row by TFLOP/s ("vs_mha"; issue 18's target >= 1.0 at g = 8)
Directions:
  fwd            the forward under torch.no_grad() (inference: no autograd state saved);
  bwd            torch.autograd.grad(out, (q, k, v), dout) on the graph of a forward run just before each sample,
                 untimed (enqueued ahead of the L2 flush and the start event): the backward alone;
  fwd+bwd        the forward with autograd, then torch.autograd.grad, timed together.

TFLOP/s (the FlashAttention papers' and issue 13's count): fwd = 4 * B * H * S_q * S_k * D (two GEMMs of 2 S_q S_k D
per head), halved for causal; bwd = 2.5 x fwd (five GEMMs, the recompute of S included); fwd+bwd = 3.5 x fwd;
varlen: the sum over sequences. Ratios: vs FA2 = sdpa_flash's time over the row's (>1: faster), vs cuDNN =
sdpa_cudnn's time over the row's; roofline = the fraction of the torch.matmul (cuBLAS) rate of the dtype measured in
this run (attention is compute-bound at every default shape; min_bytes is in each row).

Validation (before any timing; flash-attention's rule, design.md, bench/tolerance.attention_allowed_error):
every implementation's output (fwd rows) and dq, dk, dv (bwd and fwd+bwd rows) on input set 0, for up to three
(batch, head) pairs (the first, the middle and the last; varlen: the first, middle and last sequence), against
float64 math on the device (in query-row chunks); per tensor, max|impl - fp64| must be
<= 2 x max|same-dtype torch math - fp64| + 2u max|fp64| + 16 sqrt(n) 2^-24 max|fp64| + floor
(u: the dtype's unit roundoff; n: the reduction length, S_k for out and dq, S_q for dk and dv). A peer that fails
is noted and timed anyway; ours that fails is a failed row, not timed.

Memory (--memory; issue 13 item 5, the learners' table): B = 1, H = 16, D = 128, N in {8192, 16384}; naive, flash,
flash2 and the SDPA backends, fwd and fwd+bwd: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(),
minus what was allocated before the call (the inputs and dout), i.e. the outputs, saved state, gradients and
workspace the call needed. Writes python-attention-memory.{json,md}. (A workspace allocated outside torch's caching
allocator would not be counted: the peak of torch.cuda.mem_get_info()'s used bytes is recorded beside it.)

Output: python-attention.{json,md,png} under --out/<gpu>/ (python-attention-memory.* for --memory).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
from tolerance import attention_allowed_error  # noqa: E402

DIRECTIONS = ["fwd", "bwd", "fwd+bwd"]
PEERS = ["flash", "cudnn", "efficient", "math"]
PEER_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
HALF_ONLY = {"flash2": ("fp16", "bf16"), "hopper": ("fp16", "bf16")}  # attention.h: tensor-core fp16/bf16
# Rungs that run a subset (include/optimized/attention.h): hopper is sm_90a code, head dims 64 and 128 (the other
# head dims are refused by the library; skipped rows here say why).
FORWARD_ONLY = {}  # every rung runs the backward (hopper's since hopper_bwd.cuh)
FIXED_LENGTH_ONLY = {}  # every rung runs varlen batches (hopper since its varlen forward)
HEAD_DIMS_ONLY = {"hopper": (64, 128)}
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
CHECK_PAIRS = 3
GiB = float(1 << 30)

# Per device: (tokens, hidden, head dims, sequence lengths, dtypes, directions, peers)
DEFAULTS = {
    "cuda": dict(tokens=16384, hidden=2048, head_dims=[64, 128], seqlens=[1024, 4096, 16384], dtypes=["bf16"],
                 directions=["fwd", "fwd+bwd"], peers=PEERS),
    "cpu": dict(tokens=256, hidden=256, head_dims=[64], seqlens=[64, 128], dtypes=["fp32"],
                directions=["fwd", "fwd+bwd"], peers=["math"]),
}
QUICK = {
    "cuda": dict(tokens=16384, hidden=2048, head_dims=[128], seqlens=[1024, 4096], dtypes=["bf16"],
                 directions=["fwd", "fwd+bwd"], peers=PEERS),
    "cpu": dict(tokens=128, hidden=128, head_dims=[64], seqlens=[32, 64], dtypes=["fp32"],
                directions=["fwd", "fwd+bwd"], peers=["math"]),
}


# ---- shapes ------------------------------------------------------------------------------------

class Shape:
    """One problem: B sequences of S tokens (or packed unequal `lengths`), H heads of D."""

    def __init__(self, batch, seqlen, heads, head_dim, lengths=None, heads_kv=None):
        self.batch, self.seqlen, self.heads, self.head_dim = batch, seqlen, heads, head_dim
        self.lengths = lengths  # varlen: the B sequence lengths (sum = B * S)
        self.heads_kv = heads_kv or heads  # GQA: H / H_kv query heads per kv head (--gqa)

    @property
    def group(self):
        return self.heads // self.heads_kv

    @property
    def varlen(self):
        return self.lengths is not None

    def label(self):
        core = f"{self.batch}x{self.seqlen}x{self.heads}x{self.head_dim}"
        if self.group > 1:
            core += f" gqa{self.group}:1"
        return f"varlen:{core}" if self.varlen else core

    def tokens(self):
        return sum(self.lengths) if self.varlen else self.batch * self.seqlen

    def pair_count(self):
        """sum over sequences of S_q * S_k (one head)."""
        return sum(n * n for n in self.lengths) if self.varlen else self.batch * self.seqlen * self.seqlen

    def flops(self, causal, direction):
        per_head = self.pair_count() * self.heads * 4.0 * self.head_dim
        if causal:  # the papers' convention: half the square (the diagonal is not counted apart)
            per_head /= 2
        return per_head * FLOP_FACTOR[direction]

    def min_bytes(self, direction, elem):
        """fwd: read q, k, v, write out and the fp32 lse; bwd: read q, k, v, out, dout, lse, write dq, dk, dv."""
        t = self.tokens() * self.heads * self.head_dim * elem
        kv = self.tokens() * self.heads_kv * self.head_dim * elem  # k or v (GQA: fewer heads)
        lse = self.tokens() * self.heads * 4
        return {"fwd": 2 * t + 2 * kv + lse, "bwd": 5 * t + 4 * kv + lse,
                "fwd+bwd": 7 * t + 6 * kv + 2 * lse}[direction]

    def as_json(self):
        d = {"batch": self.batch, "seqlen": self.seqlen, "heads": self.heads, "head_dim": self.head_dim}
        if self.group > 1:
            d["heads_kv"] = self.heads_kv
        if self.varlen:
            d["lengths"] = list(self.lengths)
        return d


def bytes_formula(direction):
    return {"fwd": "4*T*H*D*E + 4*T*H (read q, k, v; write out, lse fp32)",
            "bwd": "8*T*H*D*E + 4*T*H (read q, k, v, out, dout, lse; write dq, dk, dv)",
            "fwd+bwd": "12*T*H*D*E + 8*T*H (fwd + bwd)"}[direction]


def flops_formula(direction):
    f = {"fwd": "", "bwd": "2.5 x ", "fwd+bwd": "3.5 x "}[direction]
    return f"{f}4*B*H*S_q*S_k*D (half for causal; varlen: sum over sequences)"


def parse_shape(text):
    parts = text.lower().split("x")
    try:
        b, s, h, d = (int(p) for p in parts)
    except ValueError:
        b = s = h = d = 0
    if len(parts) != 4 or min(b, s, h, d) < 1:
        raise SystemExit(f"--shapes: attention shapes are BxSxHxD with positive integers; given '{text}'")
    return Shape(b, s, h, d)


def varlen_lengths(batch, seqlen, seed=1313):
    """B unequal lengths in [N/2, 3N/2] summing to B*N, drawn with a fixed seed (the last one absorbs the
    remainder and is redrawn until it lies in range)."""
    gen = torch.Generator().manual_seed(seed + batch * 7919 + seqlen)
    lo, hi = max(1, seqlen // 2), max(1, (3 * seqlen) // 2)
    total = batch * seqlen
    for _ in range(10000):
        head = torch.randint(lo, hi + 1, (batch - 1,), generator=gen).tolist()
        last = total - sum(head)
        if lo <= last <= hi and len(set(head + [last])) > 1:
            return head + [last]
    raise RuntimeError(f"no varlen split of {total} tokens into {batch} sequences found")


def default_shapes(args, device):
    if args.shapes_arg:
        return [parse_shape(s) for s in args.shapes_arg]
    cfg = (QUICK if args.quick else DEFAULTS)[device]
    tokens = args.tokens or cfg["tokens"]
    hidden = args.hidden or cfg["hidden"]
    dims = args.head_dims or cfg["head_dims"]
    seqlens = args.seqlens or cfg["seqlens"]
    shapes = []
    for d in dims:
        if hidden % d:
            raise SystemExit(f"--hidden {hidden} is not a multiple of head dim {d}")
        for n in seqlens:
            if tokens % n:
                raise SystemExit(f"--tokens {tokens} is not a multiple of sequence length {n}")
            shapes.append(Shape(tokens // n, n, hidden // d, d))
    return shapes


# ---- the implementations -----------------------------------------------------------------------

class Impl:
    """One implementation: forward(q, k, v) -> out in (B, S, H, D) (packed (T, H, D) for varlen), and the
    context to enter around its runs (the forced SDPA backend)."""

    def __init__(self, name, forward, context=None, ours=False, variant=None):
        self.name, self.forward, self.ours, self.variant = name, forward, ours, variant
        self.context = context or contextlib.nullcontext


def sdpa_backend(peer):
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, PEER_BACKENDS[peer], None)


def make_impls(variants, peers, causal, varlen, deterministic):
    import optimized_ops as oo

    impls = []
    for v in variants:
        if varlen:
            def fwd(q, k, v_, meta, v=v):
                return oo.flash_attention_varlen(q, k, v_, meta["cu"], meta["cu"], meta["max"], meta["max"],
                                                 causal=causal, variant=v)
        else:
            def fwd(q, k, v_, meta, v=v):
                return oo.flash_attention(q, k, v_, causal=causal, deterministic=deterministic, variant=v)
        impls.append(Impl(f"ours:{v}", fwd, ours=True, variant=v))
    if varlen:
        return impls
    for p in peers:
        backend = sdpa_backend(p)

        def fwd(q, k, v_, meta):
            gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v_.transpose(1, 2),
                                               is_causal=causal, **gqa)
            return o.transpose(1, 2)

        if backend is None:
            ctx = None
        else:
            from torch.nn.attention import sdpa_kernel
            ctx = (lambda b=backend: sdpa_kernel([b]))
        impl = Impl(f"sdpa_{p}", fwd, context=ctx)
        impl.missing_backend = backend is None
        impls.append(impl)
    return impls


# ---- operands ----------------------------------------------------------------------------------

class InputSet:
    """q, k, v (leaves requiring grad) and dout of one rotating set: (B, S, H, D), or packed (T, H, D) with
    cu_seqlens for varlen."""

    def __init__(self, shape, dtype, device, gen):
        lead = (shape.tokens(),) if shape.varlen else (shape.batch, shape.seqlen)

        def normal(heads):
            return torch.randn(*lead, heads, shape.head_dim, generator=gen, device=device,
                               dtype=torch.float32).to(dtype)

        self.q = normal(shape.heads).requires_grad_()
        self.k, self.v = (normal(shape.heads_kv).requires_grad_() for _ in range(2))
        self.dout = normal(shape.heads)
        self.meta = {}
        if shape.varlen:
            cu = [0]
            for n in shape.lengths:
                cu.append(cu[-1] + n)
            self.meta = {"cu": torch.tensor(cu, dtype=torch.int32, device=device), "max": max(shape.lengths),
                         "cu_list": cu}

    def leaves(self):
        return [self.q, self.k, self.v]

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.dout))


def run_fwd(impl, s):
    with torch.no_grad():
        return impl.forward(s.q, s.k, s.v, s.meta)


def run_fwd_bwd(impl, s):
    out = impl.forward(s.q, s.k, s.v, s.meta)
    return out, torch.autograd.grad(out, s.leaves(), s.dout)


# ---- validation --------------------------------------------------------------------------------

def head_reference(q, k, v, dout, causal, scale, backward, chunk=None):
    """Output (and dq, dk, dv) of softmax(q k^T * scale) v for one head, in q's dtype with torch's ops as they are,
    causal aligned bottom-right (== top-left for S_q == S_k), by query-row chunks (rows are independent given k
    and v; dk and dv are summed over the chunks)."""
    sq, sk = q.shape[0], k.shape[0]
    chunk = chunk or max(1, min(sq, (1 << 26) // max(sk, 1)))
    outs, dqs = [], []
    dk = torch.zeros_like(k) if backward else None
    dv = torch.zeros_like(v) if backward else None
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        qc = q[r0:r1]  # rows r0..r1 of a problem of S_q rows: the causal offset is the whole problem's
        if backward:
            qc = qc.detach().requires_grad_()
            kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        else:
            kk, vv = k, v
        with torch.enable_grad() if backward else torch.no_grad():
            s = (qc @ kk.transpose(0, 1)) * scale
            if causal:
                i = torch.arange(r0, r1, device=q.device).unsqueeze(1)
                j = torch.arange(sk, device=q.device).unsqueeze(0)
                s = s.masked_fill(j > i + (sk - sq), float("-inf"))
            o = torch.softmax(s, dim=-1) @ vv
        if backward:
            g = torch.autograd.grad(o, (qc, kk, vv), dout[r0:r1])
            dqs.append(g[0])
            dk += g[1]
            dv += g[2]
        outs.append(o.detach())
    out = torch.cat(outs)
    return (out, torch.cat(dqs), dk, dv) if backward else (out,)


def pick_pairs(shape):
    """(sequence, head) pairs checked: the first, the middle and the last."""
    nseq = len(shape.lengths) if shape.varlen else shape.batch
    cand = [(0, 0), (nseq // 2, shape.heads // 2), (nseq - 1, shape.heads - 1)]
    return list(dict.fromkeys(cand))[:CHECK_PAIRS]


def head_slice(t, shape, meta, b, h):
    """(S, D) of sequence b, head h, of a (B, S, H, D) tensor or a packed (T, H, D) one."""
    if shape.varlen:
        cu = meta["cu_list"]
        return t[cu[b]:cu[b + 1], h]
    return t[b, :, h]


class Reference:
    """float64 and same-dtype references for the checked pairs of input set 0."""

    def __init__(self, shape, s0, causal, backward):
        self.shape, self.backward = shape, backward
        self.pairs = pick_pairs(shape)
        scale = 1.0 / math.sqrt(shape.head_dim)
        self.ref64, self.same = {}, {}
        for b, h in self.pairs:
            q = head_slice(s0.q.detach(), shape, s0.meta, b, h)
            k, v = (head_slice(t.detach(), shape, s0.meta, b, h // shape.group) for t in (s0.k, s0.v))
            do = head_slice(s0.dout, shape, s0.meta, b, h)
            self.ref64[(b, h)] = head_reference(q.double(), k.double(), v.double(), do.double(), causal, scale,
                                                backward)
            self.same[(b, h)] = head_reference(q, k, v, do, causal, scale, backward)

    def check(self, got, dname):
        """got: {(b, h): tensors as the reference (out[, dq, dk, dv])}. Returns {"fwd": record, "bwd": record}."""
        keys = ["out", "dq", "dk", "dv"] if self.backward else ["out"]
        acc = {k: [0.0, 0.0, 0.0, 0] for k in keys}  # err, same err, max |ref|, checked
        for pair, tensors in got.items():
            for i, key in enumerate(keys[:len(tensors)]):
                ref = self.ref64[pair][i]
                err = (tensors[i].double() - ref).abs()
                e = math.inf if torch.isnan(err).any().item() else (err.max().item() if err.numel() else 0.0)
                se = (self.same[pair][i].double() - ref).abs()
                se = math.inf if torch.isnan(se).any().item() else (se.max().item() if se.numel() else 0.0)
                a = acc[key]
                a[0], a[1] = max(a[0], e), max(a[1], se)
                a[2] = max(a[2], ref.abs().max().item() if ref.numel() else 0.0)
                a[3] += ref.numel()
        seq = max(self.shape.lengths) if self.shape.varlen else self.shape.seqlen
        res = {}
        for direction, dkeys in (("fwd", ["out"]), ("bwd", ["dq", "dk", "dv"])):
            worst, max_rel, checked, first = 0.0, 0.0, 0, ""
            for key in dkeys:
                if key not in acc or acc[key][3] == 0:
                    continue
                err, same, mag, n = acc[key]
                allowed = attention_allowed_error(dname, seq, same, mag)
                ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else math.inf)
                if ratio > 1 and not first:
                    first = f"{key}: max error {err:.3g}, allowed {allowed:.3g} (torch same-dtype math {same:.3g})"
                worst, checked = max(worst, ratio), checked + n
                max_rel = max(max_rel, err / mag if mag > 0 else 0.0)
            if checked:
                res[direction] = {"passed": worst <= 1.0, "max_rel_error": max_rel, "worst_ratio": worst,
                                  "checked": checked, "first_failure": first}
        return res

    def gather(self, tensors, s0):
        # out and dq per query head; dk and dv (GQA: not gathered, the backward rows are skipped) per kv head
        return {(b, h): [head_slice(t.detach(), self.shape, s0.meta, b, h) for t in tensors] for b, h in self.pairs}


def check_for(direction, v):
    if direction == "fwd":
        return v.get("fwd")
    if direction == "bwd":
        return v.get("bwd")
    a, b = v.get("fwd"), v.get("bwd")
    if a is None or b is None:
        return None
    return {"passed": a["passed"] and b["passed"], "max_rel_error": max(a["max_rel_error"], b["max_rel_error"]),
            "worst_ratio": max(a["worst_ratio"], b["worst_ratio"]), "checked": a["checked"] + b["checked"],
            "first_failure": a["first_failure"] or b["first_failure"]}


def _validation_json(v):
    return {k: v[k] for k in ("passed", "max_rel_error", "worst_ratio", "checked")}


def oom_is_skip(impl, e):
    """An O(N^2) implementation (naive, sdpa_math) out of device memory is a skip, not a failure."""
    return isinstance(e, torch.cuda.OutOfMemoryError) and (impl.variant == "naive" or impl.name == "sdpa_math")


def _reason(e):
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


# ---- memory estimates (skips before running out of memory) ---------------------------------------

def available_bytes(device):
    if device != "cuda":
        return math.inf
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def o_n2_bytes(impl, shape, backward):
    """What the O(N^2) implementations hold at once: naive's workspace (B*H*S_q*S_k fp32, x2 backward, the
    header's figure), math's score and probability matrices (~3 fp32-sized copies forward, 6 with autograd)."""
    if impl.variant == "naive":
        return shape.pair_count() * shape.heads * 4 * (2 if backward else 1)
    if impl.name == "sdpa_math":
        return shape.pair_count() * shape.heads * 4 * (6 if backward else 3)
    return 0


# ---- the rows ----------------------------------------------------------------------------------

def resolve_variants(args, device):
    import optimized_ops as oo

    rungs = list(oo.variants("attention")) + ["triton"]  # + the Triton rung (optimized_ops/triton/attention.py)
    ours = [v for v in rungs if (v == "cpu") == (device == "cpu")]
    if args.variants_arg is None or args.variants_arg == ["all"]:
        return ours
    for v in args.variants_arg:
        if v != "auto" and v not in rungs:
            raise SystemExit(f"--variants: expected all, auto or some of {', '.join(rungs)}; given '{v}'")
    return list(args.variants_arg)


def triton_skip(shape):
    """Why ours:triton has no row here ("" where it runs): Triton unavailable, or a varlen row (the
    Triton rung is flash_attention's only)."""
    import optimized_ops.triton as ot

    ok, why = ot.availability()
    if not ok:
        return f"Triton unavailable: {why}"
    return "varlen: the Triton rung runs flash_attention only" if shape.varlen else ""


def attention_rows(args, device, timer, ceilings, log, notes):
    """Rows of the attention family (its entry in bench/runner.py); appends to `notes`."""
    cfg = (QUICK if args.quick else DEFAULTS)[device]
    dtypes = args.dtypes_arg or cfg["dtypes"]
    directions = args.directions_list or cfg["directions"]
    peers = args.peers_list if args.peers_list is not None else cfg["peers"]
    variants = resolve_variants(args, device)
    shapes = default_shapes(args, device)
    causals = {"both": [False, True], "on": [True], "off": [False]}[args.causal]

    notes += ["attention rows (bench/benchmark_attention.py): ours = optimized_ops.flash_attention(q, k, v) on "
              "(B, S, H, D) tensors; sdpa_<backend> = F.scaled_dot_product_attention on (B, H, S, D) transpose "
              "views of the same data under sdpa_kernel([SDPBackend.<BACKEND>]); vs FA2 = sdpa_flash's time over "
              "the row's, vs cuDNN = sdpa_cudnn's; varlen rows: flash_attention_varlen on unequal lengths with the "
              "same total tokens, vs fixed = the row's TFLOP/s over the same rung's at fixed length",
              "attention directions: fwd under torch.no_grad(); bwd = autograd.grad on the graph of an untimed "
              "forward run just before each sample; fwd+bwd = both, timed together",
              "attention validation: per output and gradient, on up to 3 (sequence, head) pairs, max|impl - float64| "
              "<= 2 x max|torch same-dtype math - float64| + rounding noise (flash-attention's rule)"]
    notes += [f"attention flops {d} = {flops_formula(d)}; min_bytes = {bytes_formula(d)} "
              f"(T tokens, E bytes per element)" for d in directions]

    peaks = {c["name"].removeprefix("torch_matmul_"): c for c in ceilings if c["name"].startswith("torch_matmul_")}
    bw = next((c for c in ceilings if c["unit"] == "GB/s"), None)
    rows_out = []
    for dname in dtypes:
        dtype = runner.DTYPES[dname]
        elem = torch.tensor([], dtype=dtype).element_size()
        for base_shape in shapes:
            for causal in causals:
                groups = []
                if args.varlen != "only":
                    groups.append(base_shape)
                    for g in args.gqa:  # GQA rows (forward): H / g kv heads, compared per query head below
                        if g > 1 and base_shape.heads % g == 0:
                            groups.append(Shape(base_shape.batch, base_shape.seqlen, base_shape.heads,
                                                base_shape.head_dim, heads_kv=base_shape.heads // g))
                if args.varlen != "off" and base_shape.batch >= 2:
                    groups.append(Shape(base_shape.batch, base_shape.seqlen, base_shape.heads, base_shape.head_dim,
                                        varlen_lengths(base_shape.batch, base_shape.seqlen)))
                fixed_rows = {}
                for shape in groups:
                    rows = attention_group(args, device, timer, log, notes, dname, dtype, elem, shape, causal,
                                           variants, peers, directions, peaks.get(dname), bw)
                    if not shape.varlen and shape.group == 1:
                        fixed_rows = {(r["variant"], r["direction"]): r for r in rows}
                    else:  # varlen: against the same shape at fixed length; GQA: per query head, against MHA
                        ref, ratio = ("fixed_length", "vs_fixed") if shape.varlen else ("mha", "vs_mha")
                        for r in rows:
                            f = fixed_rows.get((r["variant"], r["direction"]))
                            if r["status"] == "ok" and f and f["status"] == "ok" and f["tflops"]:
                                r[ref] = {"shape_label": f["shape_label"], "tflops": f["tflops"],
                                          "time_ms": f["time_ms"]}
                                r[ratio] = r["tflops"] / f["tflops"]
                    rows_out += rows
    return rows_out


def attention_group(args, device, timer, log, notes, dname, dtype, elem, shape, causal, variants, peers,
                    directions, peak, bw):
    label = shape.label()
    impls = make_impls(variants, peers, causal, shape.varlen, args.deterministic)
    want_bwd = any(d != "fwd" for d in directions)
    # -- operands: enough sets to cover 2x the cache (at most a quarter of the free memory)
    set_bytes = 2 * shape.tokens() * (shape.heads + shape.heads_kv) * shape.head_dim * elem
    budget = (torch.cuda.mem_get_info()[0] // 4) if device == "cuda" else (1 << 30)
    nsets = runner.rotating_set_count(set_bytes, timer.cache_bytes, budget)
    gen = torch.Generator(device=device).manual_seed(4242)
    sets = [InputSet(shape, dtype, device, gen) for _ in range(nsets)]
    log(f"attention {dname} {label}{' causal' if causal else ''} ({nsets} input sets)")

    # -- skips known before running
    skip = {}  # (impl name, direction) or (impl name, None): reason
    avail = available_bytes(device)
    for impl in impls:
        if impl.variant in HALF_ONLY and dname not in HALF_ONLY[impl.variant]:
            skip[(impl.name, None)] = f"{impl.variant} supports {', '.join(HALF_ONLY[impl.variant])}; given {dname}"
        if impl.variant in FIXED_LENGTH_ONLY and shape.varlen:
            skip[(impl.name, None)] = FIXED_LENGTH_ONLY[impl.variant]
        if impl.variant in HEAD_DIMS_ONLY and shape.head_dim not in HEAD_DIMS_ONLY[impl.variant]:
            skip[(impl.name, None)] = (f"{impl.variant} runs head dims "
                                       f"{', '.join(map(str, HEAD_DIMS_ONLY[impl.variant]))}; given {shape.head_dim}")
        if shape.group > 1:
            for direction in directions:
                if direction != "fwd":
                    skip[(impl.name, direction)] = ("GQA rows are forward only here (the per-head references check "
                                                    "dk / dv of a kv head against one query head's share)")
        if impl.variant in FORWARD_ONLY:
            for direction in directions:
                if direction != "fwd":
                    skip[(impl.name, direction)] = FORWARD_ONLY[impl.variant]
        if impl.ours and impl.variant == "triton" and triton_skip(shape):
            skip[(impl.name, None)] = triton_skip(shape)
        if getattr(impl, "missing_backend", False):
            skip[(impl.name, None)] = f"torch {torch.__version__} has no SDPBackend.{PEER_BACKENDS[impl.name[5:]]}"
        if impl.name == "sdpa_math" and shape.seqlen > args.math_max_seqlen:
            skip[(impl.name, None)] = f"math backend above --math-max-seqlen {args.math_max_seqlen} (O(N^2) memory)"
        if impl.variant == "naive" and args.naive_max_seqlen and shape.seqlen > args.naive_max_seqlen:
            skip[(impl.name, None)] = f"naive above --naive-max-seqlen {args.naive_max_seqlen}"
        for direction in directions:
            need = o_n2_bytes(impl, shape, direction != "fwd")
            if need and need > 0.7 * avail:
                what = "workspace" if impl.ours else "intermediates"
                skip.setdefault((impl.name, direction),
                                f"O(N^2) {what} of {need / GiB:.1f} GiB ({'with' if direction != 'fwd' else 'no'} "
                                f"backward) exceed the free device memory ({avail / GiB:.1f} GiB)")

    def skipped(name, direction):
        return skip.get((name, None)) or skip.get((name, direction))

    # -- validate every implementation once on set 0 (fwd under no_grad; fwd+bwd where a bwd row is wanted)
    ref = Reference(shape, sets[0], causal, want_bwd)
    checks, failed = {}, {}
    for impl in impls:
        if skipped(impl.name, "fwd") and skipped(impl.name, "fwd+bwd"):
            continue
        got = {}
        with impl.context():
            try:
                if not skipped(impl.name, "fwd"):
                    out = run_fwd(impl, sets[0])
                    got = ref.gather([out], sets[0])
                    del out
                if want_bwd and not skipped(impl.name, "fwd+bwd"):
                    out, grads = run_fwd_bwd(impl, sets[0])
                    g = ref.gather([out, *grads], sets[0])
                    got = {p: got.get(p, g[p])[:1] + g[p][1:] for p in g}
                    del out, grads
            except Exception as e:  # noqa: BLE001 - reported in the row
                failed[impl.name] = _reason(e)
                if oom_is_skip(impl, e):
                    failed[impl.name] = "out of memory: " + failed[impl.name]
                log(f"  {impl.name}: {failed[impl.name]}")
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
        checks[impl.name] = ref.check(got, dname)
        del got
    del ref
    for name, v in checks.items():
        if not name.startswith("ours:") and not all(x["passed"] for x in v.values()):
            note = (f"{name} at attention {dname} {label} causal={causal} failed validation "
                    f"({next(x['first_failure'] for x in v.values() if not x['passed'])}): timed anyway")
            notes.append("attention " + note)
            log("  note: " + note)

    rows = []
    for direction in directions:
        flops = shape.flops(causal, direction)
        mb = shape.min_bytes(direction, elem)
        group = {}
        for impl in impls:
            variant = impl.variant if impl.ours else impl.name
            r = {"op": "attention", "family": "attention", "direction": direction, "variant": variant,
                 "backend": device, "dtype": dname, "shape": shape.as_json(), "shape_label": label,
                 "causal": causal, "varlen": shape.varlen,
                 "threads": torch.get_num_threads() if device == "cpu" else None, "status": "ok", "reason": "",
                 "validation": None, "time_ms": None, "flops": flops, "flops_formula": flops_formula(direction),
                 "min_bytes": mb, "bytes_formula": bytes_formula(direction), "tflops": None, "gbps": None,
                 "baseline": None, "vs_baseline": None, "vs_cudnn": None, "roofline_fraction": None,
                 "roofline_peak": None, "roofline_bandwidth": None, "kernel": None}
            group[impl.name] = r
            why = skipped(impl.name, direction)
            if why:
                r.update(status="skipped", reason=why)
                continue
            if impl.name in failed:
                # a peer that cannot run this shape (no kernel for it) is a skip, and so is an O(N^2) rung out of
                # memory; ours raising otherwise is a failure
                oom = failed[impl.name].startswith("out of memory: ")
                r.update(status="failed" if impl.ours and not oom else "skipped", reason=failed[impl.name])
                continue
            v = check_for(direction, checks.get(impl.name, {}))
            if v is None:
                r.update(status="failed", reason="not validated")
                continue
            r["validation"] = _validation_json(v)
            if not v["passed"] and impl.ours:
                r.update(status="failed", reason="validation: " + v["first_failure"])
                continue
            try:
                with impl.context():
                    st = time_direction(impl, sets, direction, timer)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at timing
                r.update(status="failed" if impl.ours and not oom_is_skip(impl, e) else "skipped", reason=_reason(e))
                if device == "cuda":
                    torch.cuda.empty_cache()
                continue
            r["time_ms"] = runner.stats_json(st)
            sec = st["median"] * 1e-3
            r["tflops"] = flops / sec / 1e12
            r["gbps"] = mb / sec / 1e9
            if peak:
                r["roofline_peak"] = {"name": f"{peak['name']} {peak['shape']}", "value": peak["value"],
                                      "unit": "TFLOP/s"}
                ideal = flops / (peak["value"] * 1e12)
                if bw:
                    r["roofline_bandwidth"] = {"name": bw["name"], "value": bw["value"], "unit": "GB/s"}
                    ideal = max(ideal, mb / (bw["value"] * 1e9))
                r["roofline_fraction"] = ideal / sec
            log(f"  {direction:>7} {impl.name:>16}: {st['median']:.4g} ms [{st['p10']:.4g}-{st['p90']:.4g}] "
                f"{r['tflops']:.4g} TFLOP/s")
            if impl.variant == "naive" and device == "cuda":
                torch.cuda.empty_cache()  # give naive's O(N^2) workspace back to the others
        # ratios to the peers measured in this run
        fa2, cudnn = group.get("sdpa_flash"), group.get("sdpa_cudnn")
        for name, r in group.items():
            if r["status"] != "ok":
                continue
            if fa2 and fa2["status"] == "ok" and name != "sdpa_flash":
                r["baseline"] = {"name": "sdpa_flash (FA2)", "time_ms": fa2["time_ms"], "tflops": fa2["tflops"],
                                 "validation": fa2["validation"]}
                r["vs_baseline"] = fa2["time_ms"]["median"] / r["time_ms"]["median"]
            if cudnn and cudnn["status"] == "ok":
                r["vs_cudnn"] = cudnn["time_ms"]["median"] / r["time_ms"]["median"]
        rows += list(group.values())
    del sets
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def time_direction(impl, sets, direction, timer):
    n = len(sets)
    if direction == "fwd":
        return timer.measure(lambda i: run_fwd(impl, sets[i % n]))
    if direction == "fwd+bwd":
        return timer.measure(lambda i: run_fwd_bwd(impl, sets[i % n]))
    graph = {}  # the forward of sample i, run untimed before it

    def forward(i):
        s = sets[i % n]
        graph["out"] = impl.forward(s.q, s.k, s.v, s.meta)

    def backward(i):
        s = sets[i % n]
        return torch.autograd.grad(graph.pop("out"), s.leaves(), s.dout)

    return timer.measure(backward, before=forward)


# ---- the memory table ----------------------------------------------------------------------------

def memory_main(argv):
    """--memory: peak memory of one call per (N, direction, implementation); writes python-attention-memory.*"""
    p = argparse.ArgumentParser(prog="benchmark_attention.py --memory",
                                description="Peak device memory of one attention call above its inputs")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--dtypes", default=None, help="comma list of fp16, bf16, fp32 (default bf16; CPU fp32)")
    p.add_argument("--memory-seqlens", default=None, help="comma list of N (default 8192,16384)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--variants", default="naive,flash,flash2", help="ours (comma list; default naive,flash,flash2)")
    p.add_argument("--peers", default="flash,math,cudnn,efficient", help="SDPA backends (comma list)")
    p.add_argument("--directions", default="fwd,fwd+bwd")
    p.add_argument("--quick", action="store_true", help="N = 1024, 2048 (or 128, 256 on the CPU)")
    p.add_argument("--out", default=str(runner.ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    import optimized_ops as oo

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and oo.built_with_cuda() else "cpu"

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if args.memory_seqlens:
        seqlens = [int(x) for x in args.memory_seqlens.split(",")]
    elif args.quick:
        seqlens = [1024, 2048] if device == "cuda" else [128, 256]
    else:
        seqlens = [8192, 16384] if device == "cuda" else [512, 1024]
    dtypes = args.dtypes.split(",") if args.dtypes else (["bf16"] if device == "cuda" else ["fp32"])
    directions = args.directions.split(",")
    variants = [v for v in args.variants.split(",") if v] if device == "cuda" else ["cpu"]
    peers = [x for x in args.peers.split(",") if x]
    rows = []
    log(f"attention memory: {device}, torch {torch.__version__}, library {oo.library_path()}")
    for dname in dtypes:
        dtype = runner.DTYPES[dname]
        elem = torch.tensor([], dtype=dtype).element_size()
        for n in seqlens:
            shape = Shape(args.batch, n, args.heads, args.head_dim)
            for impl in make_impls(variants, peers, False, False, False):
                for direction in directions:
                    rows.append(memory_row(impl, shape, dname, dtype, elem, direction, device, log))
    notes = ["attention memory (bench/benchmark_attention.py --memory): peak = torch.cuda.max_memory_allocated() "
             "during one call after reset_peak_memory_stats(), minus the bytes allocated before it (q, k, v, dout): "
             "outputs, saved state, gradients and workspace; fwd under torch.no_grad(), fwd+bwd = forward with "
             "autograd then torch.autograd.grad; naive_predicted = B*H*S_q*S_k*4 bytes (x2 fwd+bwd), the header's "
             "workspace size; device_used_peak = the largest rise of torch.cuda.mem_get_info()'s used bytes seen "
             "(sampled before and after the call: catches memory taken outside torch's allocator only if it is "
             "still held at the end)"]
    report = {"schema": runner.SCHEMA,
              "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "command": "python bench/benchmark_attention.py --memory " + " ".join(argv),
              "machine": runner.query_machine(device), "options": {"mode": "memory"}, "ceilings": [],
              "results": rows, "notes": notes}
    report = runner._clean(report)
    for path in runner.write_outputs(report, args.out):
        print(f"wrote {path}")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def memory_row(impl, shape, dname, dtype, elem, direction, device, log):
    variant = impl.variant if impl.ours else impl.name
    naive_pred = shape.pair_count() * shape.heads * 4 * (2 if direction != "fwd" else 1)
    r = {"op": "attention", "family": "attention-memory", "direction": direction, "variant": variant,
         "backend": device, "dtype": dname, "shape": shape.as_json(), "shape_label": shape.label(), "causal": False,
         "varlen": False, "threads": torch.get_num_threads() if device == "cpu" else None, "status": "ok",
         "reason": "", "validation": None, "time_ms": None, "flops": shape.flops(False, direction),
         "min_bytes": shape.min_bytes(direction, elem), "tflops": None, "gbps": None, "baseline": None,
         "vs_baseline": None, "roofline_fraction": None, "kernel": None, "peak_bytes": None, "peak_mib": None,
         "inputs_bytes": None, "naive_predicted_bytes": naive_pred, "device_used_peak_bytes": None}
    if impl.variant in HALF_ONLY and dname not in HALF_ONLY[impl.variant]:
        r.update(status="skipped", reason=f"{impl.variant} supports {', '.join(HALF_ONLY[impl.variant])}")
        return r
    if getattr(impl, "missing_backend", False):
        r.update(status="skipped", reason="this torch has no such SDPBackend")
        return r
    if device != "cuda":
        r.update(status="skipped", reason="peak memory is measured on CUDA (torch.cuda.max_memory_allocated)")
        return r
    need = o_n2_bytes(impl, shape, direction != "fwd")
    avail = available_bytes(device)
    if need > 0.85 * avail:
        r.update(status="skipped", reason=f"O(N^2) memory of {need / GiB:.1f} GiB exceeds the free "
                                          f"{avail / GiB:.1f} GiB")
        return r
    torch.cuda.empty_cache()
    gen = torch.Generator(device=device).manual_seed(99)
    s = InputSet(shape, dtype, device, gen)
    r["inputs_bytes"] = s.nbytes()
    try:
        with impl.context():
            run_fwd(impl, s) if direction == "fwd" else run_fwd_bwd(impl, s)  # warm-up (handles, workspace)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            used0 = torch.cuda.mem_get_info()
            torch.cuda.reset_peak_memory_stats()
            result = run_fwd(impl, s) if direction == "fwd" else run_fwd_bwd(impl, s)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
            used1 = torch.cuda.mem_get_info()
            del result
    except Exception as e:  # noqa: BLE001 - out of memory or no kernel: reported in the row
        r.update(status="skipped" if isinstance(e, torch.cuda.OutOfMemoryError) or not impl.ours else "failed",
                 reason=_reason(e))
        log(f"  memory {dname} N={shape.seqlen} {direction} {impl.name}: {r['reason']}")
        del s
        torch.cuda.empty_cache()
        return r
    r["peak_bytes"] = int(peak)
    r["peak_mib"] = peak / float(1 << 20)
    r["device_used_peak_bytes"] = int(max(0, (used0[0] - used1[0])))
    log(f"  memory {dname} N={shape.seqlen} {direction:>7} {impl.name:>14}: {r['peak_mib']:.0f} MiB above inputs "
        f"(naive predicted {naive_pred / (1 << 20):.0f} MiB)")
    del s
    torch.cuda.empty_cache()
    return r


# ---- the plot ----------------------------------------------------------------------------------

def plot_attention(report, path):
    """One PNG: a panel per (direction, head dim), TFLOP/s of each implementation per (N, causal), fixed
    length. Returns [path] or []."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmark_attention: matplotlib is not installed: no plot", file=sys.stderr)
        return []
    rows = [r for r in report["results"] if r.get("family") == "attention" and r["status"] == "ok"
            and not r.get("varlen")]
    if not rows:
        return []
    panels = list(dict.fromkeys((r["direction"], r["dtype"], r["shape"]["head_dim"]) for r in rows))
    impls = list(dict.fromkeys(r["variant"] for r in rows))
    machine = report["machine"].get("gpu") or f"CPU ({report['machine'].get('cpu')})"
    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, 3.4 * nrows), squeeze=False)
    cmap = plt.get_cmap("viridis")
    peer_colors = {"sdpa_flash": "#ff7f0e", "sdpa_cudnn": "#d62728", "sdpa_efficient": "#9467bd",
                   "sdpa_math": "#8c564b"}
    ours = [v for v in impls if v not in peer_colors]
    colors = dict(peer_colors)
    for i, v in enumerate(ours):
        colors[v] = cmap(0.15 + 0.7 * i / max(len(ours) - 1, 1))
    for k, (direction, dname, d) in enumerate(panels):
        ax = axes[k // ncols, k % ncols]
        sel = [r for r in rows if (r["direction"], r["dtype"], r["shape"]["head_dim"]) == (direction, dname, d)]
        groups = list(dict.fromkeys((r["shape"]["seqlen"], r["causal"]) for r in sel))
        width = 0.8 / max(len(impls), 1)
        for vi, v in enumerate(impls):
            ys = []
            for g in groups:
                m = next((r for r in sel if (r["shape"]["seqlen"], r["causal"]) == g and r["variant"] == v), None)
                ys.append(m["tflops"] if m else 0)
            xs = [j + (vi - (len(impls) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, ys, width, label=v if v.startswith("sdpa") else f"optimized_ops {v}",
                   color=colors.get(v, "gray"))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"N={n}{' causal' if c else ''}" for n, c in groups], fontsize=7)
        ax.set_title(f"{direction} {dname} d={d}", fontsize=9)
        ax.set_ylabel("TFLOP/s", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    for k in range(len(panels), nrows * ncols):
        axes[k // ncols, k % ncols].axis("off")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle(f"attention on {machine}: TFLOP/s (4BHS^2D fwd, 3.5x fwd+bwd, half for causal)", fontsize=11)
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=min(len(labels), 4))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


# ---- registration --------------------------------------------------------------------------------

def _int_list(text):
    return [int(x) for x in text.split(",")] if text else None


def prepare(args, device):
    # --directions is shared with the fused family (whichever registers first adds it; fused's prepare may
    # already have split it)
    d = getattr(args, "directions", None)
    args.directions_list = d.split(",") if isinstance(d, str) else (list(d) if d else None)
    for d in args.directions_list or []:
        if d not in DIRECTIONS:
            raise SystemExit(f"--directions: expected some of {', '.join(DIRECTIONS)}; given '{d}'")
    args.peers_list = None if args.peers is None else [p for p in args.peers.split(",") if p and p != "none"]
    for p in args.peers_list or []:
        if p not in PEERS:
            raise SystemExit(f"--peers: expected some of {', '.join(PEERS)} or none; given '{p}'")
    args.seqlens = _int_list(args.seqlens_text)
    args.gqa = _int_list(getattr(args, "gqa_text", None)) or []
    args.head_dims = _int_list(args.head_dims_text)


def add_arguments(p):
    p.add_argument("--seqlens", dest="seqlens_text", default=None,
                   help="attention: comma list of N (default 1024,4096,16384); B = tokens / N")
    p.add_argument("--head-dims", dest="head_dims_text", default=None,
                   help="attention: comma list of D (default 64,128); H = hidden / D")
    p.add_argument("--tokens", type=int, default=None, help="attention: B * N (default 16384)")
    p.add_argument("--hidden", type=int, default=None, help="attention: H * D (default 2048)")
    p.add_argument("--causal", default="both", choices=["both", "on", "off"], help="attention: causal rows")
    p.add_argument("--gqa", dest="gqa_text", default=None,
                   help="attention: comma list of query heads per kv head (e.g. 8): forward rows beside each fixed "
                        "shape with H / g kv heads, the same flops, vs_mha = their TFLOP/s over the MHA row's")
    p.add_argument("--varlen", default="auto", choices=["auto", "off", "only"],
                   help="attention: varlen rows beside each fixed shape with B >= 2 (auto), none, or only them")
    try:  # shared with the fused family: added by whichever family registers first
        p.add_argument("--directions", default=None,
                       help="comma list of fwd, bwd, fwd+bwd (default: fused all three, attention fwd,fwd+bwd)")
    except argparse.ArgumentError:
        pass
    p.add_argument("--peers", default=None,
                   help="attention: SDPA backends, comma list of flash, cudnn, efficient, math, or none "
                        "(default all four on CUDA, math on the CPU)")
    p.add_argument("--math-max-seqlen", type=int, default=4096, help="attention: longest N for sdpa_math")
    p.add_argument("--naive-max-seqlen", type=int, default=0,
                   help="attention: longest N for the naive rung (default 0: wherever its workspace fits)")
    p.add_argument("--deterministic", action="store_true", help="attention: ours with deterministic=True")


def ceiling_dtypes(args, device):
    cfg = (QUICK if args.quick else DEFAULTS)[device]
    return [d for d in (args.dtypes_arg or cfg["dtypes"]) if d in ("bf16", "fp16", "fp32")]


FAMILY = runner.register(runner.Family(
    "attention", rows=attention_rows, add_arguments=add_arguments, prepare=prepare, ceiling_dtypes=ceiling_dtypes,
    plot=plot_attention,
    summary="attention (naive, flash, flash2) vs SDPA flash / cuDNN / efficient / math (bench/benchmark_attention.py)"))
MEMORY_FAMILY = runner.register(runner.Family(
    "attention-memory", standalone=memory_main,
    summary="peak memory of one attention call, naive vs flash2 vs SDPA (bench/benchmark_attention.py --memory)"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--memory" in argv:
        return memory_main([a for a in argv if a != "--memory"])
    return runner.main(["--ops", "attention", *argv])


if __name__ == "__main__":
    sys.exit(main())
