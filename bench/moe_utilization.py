#!/usr/bin/env python3
"""Expert utilization of a small MoE model trained with and without the load-balancing loss: issue 16's "expert
utilization and dropped tokens of a small model trained with the aux loss, as a plot" (the seed promised "90%
expert utilization").

    python bench/moe_utilization.py [--device auto|cuda|cpu] [--steps N] [--tokens T] [--experts E]
        [--capacity-factor CF] [--aux-coef C] [--variant V] [--out bench/results/<gpu>/moe-utilization/moe-utilization.json]

The model (optimized_ops.nn.MoE twice, residual): a token id and a context id -> Embedding(V = 512, d = 64) +
Embedding(64 contexts, d) -> 2 x [x + MoE(RMSNorm(x))] -> RMSNorm -> Linear(d, V); each MoE: E = 16 SwiGLU experts
(d_ff = 128), top-2, softmax router, capacity factor 1.25 (each expert keeps at most ceil(1.25 T k / E) pairs; the
rest are dropped). The task, synthetic and learnable: T tokens per step drawn from a Zipf distribution over the
vocabulary (P(v) ~ (v + 1)^-1.1, as word frequencies: token 0 is 18% of the stream), each with a context id drawn
uniformly (a stand-in for what attention would mix in), and the target a fixed random permutation of (token +
context) mod V (cross-entropy): the experts must combine both. The context embedding starts at a quarter of the
token embedding's scale, so the untrained router routes by token identity and the frequent tokens crowd a few
experts; a router that uses the context can spread them evenly. Two runs from the same initialization and the same
batches, AdamW (lr 3e-3): the task loss plus each layer's MoEMetrics.loss with aux_loss_coef = 0.01 ("aux"), and
with aux_loss_coef = 0 ("no_aux"); z_loss_coef = 0.001 in both.

Recorded per step and layer (optimized_ops.MoEMetrics, read back once at the end): utilization = mean / max of the
pairs the experts processed (1: every expert as busy as the busiest; what the seed's "90%" is read as), imbalance =
E x the busiest expert's share of the routed pairs before the capacity (1: even), the dropped fraction = pairs
dropped / (T k), the active experts (fraction with at least one pair), the aux loss and the task loss.

Output: the JSON at --out (the configuration, every step's numbers per run and layer, and a summary over the last
10% of the steps) and, where matplotlib is installed, a PNG beside it (utilization, imbalance, dropped fraction and
task loss per step, the runs against each other, the layers averaged). Default 300 steps on CUDA (well under a
minute on the H100), 120 steps of 1024 tokens on the CPU. The batch is a sample: even a perfectly balanced router
leaves the busiest of E experts about 2 standard deviations (2 sqrt(T k / E) pairs) above an even share, so
utilization tops out near 1 / (1 + 2 / sqrt(T k / E)): ~0.94 at T = 8192, ~0.85 at T = 1024. And once an expert is
full, the capacity caps it at (1 - dropped fraction) / capacity factor (0.8 at 1.25).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402  (the machine key of the results folder)

VOCAB, CONTEXTS, D_MODEL, D_FF, LAYERS, TOP_K = 512, 64, 64, 128, 2, 2
ZIPF_TOKENS = 1.1
METRICS = ["utilization", "imbalance", "dropped_fraction", "active_experts", "aux_loss"]


class TinyMoEModel(torch.nn.Module):
    """Embedding(token) + Embedding(context) -> LAYERS x [x + MoE(RMSNorm(x))] -> RMSNorm -> Linear: per token, no
    attention."""

    def __init__(self, oo, experts, capacity_factor, aux_coef, variant, device):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL, device=device)
        self.context = torch.nn.Embedding(CONTEXTS, D_MODEL, device=device)
        with torch.no_grad():
            self.context.weight.mul_(0.25)  # the untrained router sees mostly the token (the module docstring)
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(D_MODEL, device=device) for _ in range(LAYERS))
        self.moes = torch.nn.ModuleList(
            oo.nn.MoE(D_MODEL, D_FF, experts, TOP_K, capacity_factor=capacity_factor, aux_loss_coef=aux_coef,
                      z_loss_coef=1e-3, device=device, variant=variant) for _ in range(LAYERS))
        self.final = torch.nn.RMSNorm(D_MODEL, device=device)
        self.head = torch.nn.Linear(D_MODEL, VOCAB, device=device)

    def forward(self, tokens, contexts):
        x = self.embed(tokens) + self.context(contexts)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(self.final(x)), [moe.last_metrics for moe in self.moes]


def train(oo, args, aux_coef, device, log):
    """One run; returns its per-step record (device tensors stacked and read back once at the end)."""
    torch.manual_seed(args.seed)
    model = TinyMoEModel(oo, args.experts, args.capacity_factor, aux_coef, args.variant, device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    zipf = torch.arange(1, VOCAB + 1, dtype=torch.float64).pow(-ZIPF_TOKENS)
    target_of = torch.randperm(VOCAB, generator=gen).to(device)
    pairs = args.tokens * TOP_K
    steps = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        tokens = torch.multinomial(zipf, args.tokens, replacement=True, generator=gen).to(device)
        contexts = torch.randint(0, CONTEXTS, (args.tokens,), generator=gen).to(device)
        logits, metrics = model(tokens, contexts)
        task = F.cross_entropy(logits, target_of[(tokens + contexts) % VOCAB])
        loss = task + sum(m.loss for m in metrics)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # one row per step, on the device: the task loss, then METRICS of each layer
        steps.append(torch.cat([task.detach().reshape(1)] + [torch.stack([
            m.utilization, m.imbalance, m.dropped.float() / pairs, m.active_experts, m.aux_loss.detach()])
            for m in metrics]))
    table = torch.stack(steps).cpu()  # (steps, 1 + LAYERS * len(METRICS)): the one read-back
    wall = time.perf_counter() - t0
    record = {"aux_loss_coef": aux_coef, "wall_s": wall, "task_loss": table[:, 0].tolist()}
    per_layer = table[:, 1:].reshape(len(steps), LAYERS, len(METRICS))
    for i, name in enumerate(METRICS):
        record[name] = per_layer[:, :, i].tolist()  # [step][layer]
    log(f"  aux_loss_coef {aux_coef}: {args.steps} steps in {wall:.1f} s; final task loss "
        f"{record['task_loss'][-1]:.3f}")
    return record


def summarize(record, frac=0.1):
    n = len(record["task_loss"])
    tail = slice(max(n - max(int(n * frac), 1), 0), n)
    out = {"task_loss": sum(record["task_loss"][tail]) / len(record["task_loss"][tail])}
    for name in METRICS:
        rows = record[name][tail]
        out[name] = sum(sum(r) / len(r) for r in rows) / len(rows)  # layers averaged
    return out


def plot(result, path):
    """Four panels (utilization, imbalance, dropped fraction, task loss) per step; returns [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("moe_utilization: matplotlib is not installed: no plot (the JSON holds every number)", file=sys.stderr)
        return []
    panels = [("utilization", "utilization (mean / max pairs per expert)"),
              ("imbalance", "imbalance (E x busiest expert's share, routed)"),
              ("dropped_fraction", "dropped pairs / (T k)"), ("task_loss", "task loss (cross-entropy)")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    colors = {"aux": "#1f77b4", "no_aux": "#d62728"}
    for ax, (name, title) in zip(axes.flat, panels):
        for run, rec in result["runs"].items():
            ys = rec[name] if name == "task_loss" else [sum(r) / len(r) for r in rec[name]]
            ax.plot(range(1, len(ys) + 1), ys, color=colors.get(run), lw=1.2,
                    label=f"{run} (aux_loss_coef {rec['aux_loss_coef']})")
        if name == "utilization":
            c = result["config"]
            noise = 1 / (1 + 2 / (c["tokens"] * c["top_k"] / c["experts"]) ** 0.5)
            ax.axhline(0.9, color="gray", ls="--", lw=0.8, label="90% (the seed's promise)")
            ax.axhline(noise, color="gray", ls=":", lw=0.8,
                       label=f"{noise:.2f}: a balanced router's batch noise (docstring)")
            ax.set_ylim(0, 1.02)
        if name == "imbalance":
            ax.axhline(1.0, color="gray", ls="--", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="lower right")
    c = result["config"]
    fig.suptitle(f"MoE expert utilization: {c['layers']} layers x {c['experts']} experts top-{c['top_k']}, capacity "
                 f"factor {c['capacity_factor']}, {c['tokens']} tokens/step, {result['machine']} (layers averaged)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--steps", type=int, default=None, help="default 300 on CUDA, 120 on the CPU")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192 on CUDA, 1024 on the CPU)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux-coef", type=float, default=0.01, help="the aux run's aux_loss_coef (the other run: 0)")
    p.add_argument("--variant", default="auto", help="the grouped GEMM's rung")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--out", default=None, help="the JSON (default bench/results/<gpu or cpu>/moe-utilization/moe-utilization.json); "
                                               "the PNG beside it")
    args = p.parse_args(argv)
    import optimized_ops as oo

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and oo.built_with_cuda() else "cpu"
    if device == "cuda" and not (torch.cuda.is_available() and oo.built_with_cuda()):
        sys.exit("--device cuda: torch sees no GPU or the library was built without CUDA")
    args.steps = args.steps or (300 if device == "cuda" else 120)
    args.tokens = args.tokens or (8192 if device == "cuda" else 1024)
    machine = runner.query_machine(device)
    # In a folder of its own: bench/results/<gpu>/*.json are the benchmark's files (scripts/render_results.py).
    out = pathlib.Path(args.out) if args.out else (runner.ROOT / "bench" / "results" / machine["gpu_key"] /
                                                  "moe-utilization" / "moe-utilization.json")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"moe_utilization: {device}, {args.steps} steps x {args.tokens} tokens, {LAYERS} layers x {args.experts} "
        f"experts top-{TOP_K}, capacity factor {args.capacity_factor}")
    runs = {"aux": train(oo, args, args.aux_coef, device, log), "no_aux": train(oo, args, 0.0, device, log)}
    result = {"what": "bench/moe_utilization.py: a small MoE model trained with and without the aux loss",
              "machine": machine.get("gpu") or f"CPU ({machine['cpu']})",
              "command": "python bench/moe_utilization.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": {"device": device, "steps": args.steps, "tokens": args.tokens, "vocab": VOCAB,
                         "contexts": CONTEXTS, "d_model": D_MODEL, "d_ff": D_FF, "layers": LAYERS, "experts": args.experts, "top_k": TOP_K,
                         "capacity_factor": args.capacity_factor, "token_zipf_s": ZIPF_TOKENS, "lr": 3e-3,
                         "z_loss_coef": 1e-3, "variant": args.variant, "seed": args.seed},
              "definitions": {
                  "utilization": "mean over experts / max over experts of the pairs each processed (after capacity)",
                  "imbalance": "E x max_i f_i, f_i the share of the T k routed pairs the router sent to expert i",
                  "dropped_fraction": "pairs dropped by the capacity / (T k)",
                  "active_experts": "fraction of experts that processed at least one pair",
                  "aux_loss": "E sum_i f_i P_i (1 when balanced)"},
              "summary_last_10pct": {run: summarize(rec) for run, rec in runs.items()},
              "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    for run, s in result["summary_last_10pct"].items():
        log(f"  {run:>6}: utilization {s['utilization']:.3f}, imbalance {s['imbalance']:.2f}, dropped "
            f"{s['dropped_fraction'] * 100:.1f}%, active {s['active_experts'] * 100:.0f}%, task loss "
            f"{s['task_loss']:.3f} (last 10% of the steps, layers averaged)")
    for path in plot(result, out.with_suffix(".png")):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
