"""Train a GPT-2-small-shaped OptimizedTransformer (or its plain-PyTorch reference) from token shards.

The corpus is the library's synthetic one (``optimized_ops.models.training.synthetic_corpus``: a sparse
second-order Markov chain over a Zipf vocabulary, in documents; no download), written once as shards of
``seq_len + 1`` tokens under ``--data-dir`` (default ``~/.cache/optimized_ops``) and streamed by
``optimized_ops.data.StreamingLoader`` through ``train_from_nvme`` (bf16 autocast and fused AdamW on
CUDA, warm-up + cosine schedule, gradient accumulation, checkpoints that resume exactly). Each run
writes a JSON of its loss curve, learning rates, tokens/s and MFU; two JSONs make the comparison plot.

    python examples/train_gpt.py --out ours.json                    # 124M, seq 1024, batch 16, 300 steps
    python examples/train_gpt.py --reference --out reference.json   # the same model in plain PyTorch
    python examples/train_gpt.py --plot ours.json reference.json --plot-out loss.png
    python examples/train_gpt.py --tiny --device cpu                # a smoke run: seconds on a CPU
    python examples/train_gpt.py --moe --out moe.json               # 8 experts, top-2

Both models start from the same weights (both draw them from ``--seed`` in the same order) and
read the same batches in the same order (same ``--seed``), so their curves differ only by the kernels'
rounding. Stop a run and start it again with the same ``--checkpoint-dir``: it resumes where it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys

import torch

from optimized_ops.models.training import TrainConfig, synthetic_corpus, train_from_nvme, write_token_shards

# The GPT-2 small shape (124M parameters with tied embeddings) and a tiny one for smoke runs.
GPT2_SMALL = dict(d_model=768, n_heads=12, n_layers=12, vocab_size=50257, max_seq_len=1024)
TINY = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=128, vocab_size=256, max_seq_len=64)
# Training defaults: (full, --tiny)
DEFAULTS = dict(steps=(300, 40), batch_size=(16, 8), seq_len=(1024, 64), lr=(6e-4, 1e-2), warmup=(30, 4))
# bf16 dense peak of the H100 SXM (TFLOP/s), for the MFU; override with --peak-tflops.
H100_BF16_PEAK_TFLOPS = 989.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model and short run (CPU smoke test)")
    p.add_argument("--reference", action="store_true", help="train the plain-PyTorch reference model")
    p.add_argument("--moe", action="store_true", help="Mixture-of-Experts MLPs: 8 experts, top-2")
    p.add_argument("--data", help="an existing token shard dataset (write_token_shards); give --vocab with it")
    default_dir = os.environ.get("OPTIMIZED_OPS_DATA", os.path.expanduser("~/.cache/optimized_ops"))
    p.add_argument("--data-dir", default=default_dir,
                   help="where the synthetic corpus's shards are written if absent (default: $OPTIMIZED_OPS_DATA "
                   "or ~/.cache/optimized_ops)")
    p.add_argument("--corpus-tokens", type=int, help="synthetic corpus length (default: what the run reads, "
                   "at least 1M tokens)")
    p.add_argument("--vocab", type=int, help="vocabulary (default: GPT-2's 50257; 256 with --tiny)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--min-lr", type=float, help="end of the cosine (default lr / 10)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where present)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--peak-tflops", type=float, help=f"the device's peak for the MFU (default on CUDA: "
                   f"{H100_BF16_PEAK_TFLOPS:g}, the H100's bf16 dense)")
    p.add_argument("--out", help="the JSON to write (default: train_gpt-<model>.json)")
    p.add_argument("--plot", nargs=2, metavar=("OURS_JSON", "REFERENCE_JSON"),
                   help="compare two runs' JSONs (no training): a table and a loss-curve plot")
    p.add_argument("--plot-out", default="train_gpt_loss.png")
    args = p.parse_args(argv)
    i = 1 if args.tiny else 0
    for name, values in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[i])
    if args.vocab is None:
        args.vocab = TINY["vocab_size"] if args.tiny else GPT2_SMALL["vocab_size"]
    return args


# ---- data ----------------------------------------------------------------------------------------------

def ensure_corpus(args) -> str:
    """The shard directory: ``--data``, or the synthetic corpus written under ``--data-dir`` if absent."""
    if args.data:
        return args.data
    needed = args.steps * args.batch_size * args.grad_accum * args.seq_len + 1
    tokens = args.corpus_tokens or max(needed, 1 << 20)
    path = os.path.join(args.data_dir, f"synthetic-v{args.vocab}-s{args.seq_len}-n{tokens}-seed{args.seed}")
    try:
        from optimized_ops import data
        data.dataset_info(path)
        print(f"corpus: {path} (present)")
        return path
    except ValueError:
        pass  # absent or incomplete: (re)write it
    corpus = synthetic_corpus(tokens, args.vocab, seed=args.seed)
    info = write_token_shards(path, corpus, seq_len=args.seq_len, overwrite=True)
    print(f"corpus: wrote {info.num_records} sequences of {args.seq_len + 1} tokens ({tokens} synthetic tokens, "
          f"vocab {args.vocab}) to {path}")
    return path


# ---- the model -----------------------------------------------------------------------------------------

def build_model(args):
    """The optimized model, or with ``--reference`` the plain-PyTorch one, initialized from ``--seed``."""
    from optimized_ops.models import OptimizedTransformer
    from optimized_ops.models.config import MoEConfig

    shape = dict(TINY if args.tiny else GPT2_SMALL)
    shape["vocab_size"] = args.vocab
    shape["max_seq_len"] = max(shape["max_seq_len"], args.seq_len)
    if args.moe:
        shape["moe"] = MoEConfig(num_experts=8, top_k=2)
    # Both kinds draw the same initial weights from the same seed (Transformer.reset_parameters).
    torch.manual_seed(args.seed)
    return OptimizedTransformer(**shape, reference=args.reference)


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (parameters a token goes through) + the attention's 12 L d S
    (PaLM's estimate, as nanoGPT's MFU); with experts, only the top-k experts' parameters count."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    if cfg.moe is not None:
        expert = 3 * cfg.d_model * cfg.expert_d_ff
        n -= cfg.n_layers * (cfg.moe.num_experts - cfg.moe.top_k) * expert
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.d_model * seq_len


# ---- training ------------------------------------------------------------------------------------------

def train(args) -> dict:
    path = ensure_corpus(args)
    model = build_model(args)
    which = "reference" if args.reference else "optimized"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = TrainConfig(batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps, lr=args.lr,
                         min_lr=args.min_lr, warmup_steps=args.warmup, weight_decay=args.weight_decay,
                         grad_clip=args.grad_clip if args.grad_clip > 0 else None,
                         grad_accum_steps=args.grad_accum, dtype=args.dtype, device=device, compile=args.compile,
                         seed=args.seed, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                         log_every=args.log_every)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {which}, {n_params / 1e6:.1f}M parameters, {model.config}")
    result = train_from_nvme(model, path, config)
    rate = result.steady_tokens_per_s if math.isfinite(result.steady_tokens_per_s) else result.tokens_per_s
    flops = flops_per_token(model, args.seq_len)
    peak = args.peak_tflops or (H100_BF16_PEAK_TFLOPS if result.device.startswith("cuda") else None)
    out = {
        "model": which, "moe": args.moe, "tiny": args.tiny,
        "model_config": dataclasses.asdict(model.config), "data": os.path.abspath(path),
        "train_config": {k: (os.fspath(v) if isinstance(v, os.PathLike) else v)
                         for k, v in dataclasses.asdict(config).items()},
        **{k: v for k, v in result.to_dict().items() if k not in ("notes",)},
        "tokens_per_s_used": rate, "flops_per_token": flops,
        "tflops": rate * flops / 1e12, "peak_tflops": peak, "mfu": rate * flops / 1e12 / peak if peak else None,
        "notes": result.notes, "torch": torch.__version__, "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name(torch.device(result.device)) if result.device.startswith("cuda")
        else platform.processor() or "cpu",
    }
    return out


# ---- the comparison ------------------------------------------------------------------------------------

def tail_mean(values, n: int = 10) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail) if tail else math.nan


def compare(ours_file: str, reference_file: str, plot_out: str) -> None:
    with open(ours_file) as f:
        ours = json.load(f)
    with open(reference_file) as f:
        ref = json.load(f)
    rows = [(ours_file, ours), (reference_file, ref)]
    print(f"{'run':<32} {'model':<10} {'steps':>6} {'first loss':>10} {'last-10 loss':>12} {'tokens/s':>12} {'MFU':>7}")
    for name, r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        print(f"{os.path.basename(name):<32} {r['model']:<10} {len(r['losses']):>6} {r['losses'][0]:>10.4f} "
              f"{tail_mean(r['losses']):>12.4f} {r['tokens_per_s_used']:>12,.0f} {mfu:>7}")
    if ours.get("device") != ref.get("device") or ours.get("device_name") != ref.get("device_name"):
        print(f"note: the runs used different devices ({ours.get('device_name')} vs {ref.get('device_name')}): "
              "the speedup compares different machines")
    print(f"speedup (tokens/s, {ours['model']} / {ref['model']}): "
          f"{ours['tokens_per_s_used'] / ref['tokens_per_s_used']:.2f}x")
    n = min(len(ours["losses"]), len(ref["losses"]))
    if n:
        gap = max(abs(a - b) for a, b in zip(ours["losses"][:n], ref["losses"][:n]))
        print(f"largest loss difference over the first {n} steps: {gap:.3g}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in rows:
        label = f"{r['model']} ({r['tokens_per_s_used']:,.0f} tokens/s)"
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats / token)")
    shape = ours.get("model_config", {})
    ax.set_title(f"d_model {shape.get('d_model')}, {shape.get('n_layers')} layers, vocab {shape.get('vocab_size')}, "
                 f"seed {ours.get('train_config', {}).get('seed')}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_out, dpi=120)
    print(f"plot: {plot_out}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        compare(args.plot[0], args.plot[1], args.plot_out)
        return 0
    out = train(args)
    file = args.out or f"train_gpt-{out['model']}{'-moe' if args.moe else ''}.json"
    with open(file, "w") as f:
        json.dump(out, f, indent=1)
    mfu = f", MFU {100 * out['mfu']:.1f}%" if out["mfu"] else ""
    print(f"{out['model']}: {out['steps']} steps, loss {out['losses'][0]:.4f} -> {tail_mean(out['losses']):.4f} "
          f"(last 10), {out['tokens_per_s_used']:,.0f} tokens/s{mfu}; waited {out['data_wait_s']:.3f} s for data; "
          f"wrote {file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
