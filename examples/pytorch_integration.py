"""OptimizedTransformer in a PyTorch training loop, and how much faster one training step is.

    python examples/pytorch_integration.py            # CUDA: 124M (GPT-2 small shape), batch 16 x seq 1024, bf16
    python examples/pytorch_integration.py --smoke    # a tiny model on the CPU, seconds

``OptimizedTransformer(d_model=768, n_heads=12, ...)`` is an ordinary ``torch.nn.Module``: its parameters go to
any optimizer, it runs under ``torch.autocast``, ``model(tokens, targets)`` returns the loss and ``loss.backward()``
runs the library's backward kernels (flash attention, fused norms, RoPE, linear + cross-entropy without the
logits in memory). The script times one training step -- forward, backward and an AdamW step, bf16 autocast on
CUDA -- of the model and of three others on the same random tokens, each from the same kind of loop:

  torch.nn.Transformer    ``torch.nn.Transformer(d_model=768, nhead=12, num_encoder_layers=12,
                          num_decoder_layers=0, dropout=0.0, batch_first=True)`` used as a decoder-only language
                          model, as the project's first example did: a token and a learned position embedding, its
                          encoder stack with a causal mask (and its final LayerNorm) and a tied LM head. A DIFFERENT
                          architecture (post-norm LayerNorm, a ReLU MLP of 2048, no RoPE), so its speedup is
                          indicative only;
  torch eager             ``Transformer(config, reference=True)``: the same architecture, same weights, in plain
                          PyTorch (F.scaled_dot_product_attention, F.rms_norm, F.linear, F.cross_entropy);
  torch.compile           ``torch.compile`` of that reference model.

and prints tokens/s for each and ``Speedup: X.XXx`` of ours over each. Times are wall-clock over ``--steps``
steps after ``--warmup`` steps (torch.compile compiles during the warm-up), with the GPU synchronised at both
ends; ``bench/benchmark_models.py`` measures the same comparison with the project's benchmark rules (validation
against float64, CUDA events, statistics, MFU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch
import torch.nn.functional as F

from optimized_ops.models import OptimizedTransformer, Transformer

GPT2_SMALL = dict(d_model=768, n_heads=12, n_layers=12, vocab_size=50257, max_seq_len=1024)
SMOKE = dict(d_model=64, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=64)


class TorchTransformerLM(torch.nn.Module):
    """``torch.nn.Transformer`` as a decoder-only LM: embeddings, its encoder stack under a causal mask (which ends
    with the encoder's final LayerNorm) and an LM head tied to the token embedding."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int, vocab_size: int, max_seq_len: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab_size, d_model)
        self.pos = torch.nn.Embedding(max_seq_len, d_model)
        self.transformer = torch.nn.Transformer(d_model=d_model, nhead=n_heads, num_encoder_layers=n_layers,
                                                num_decoder_layers=0, dropout=0.0, batch_first=True)
        torch.nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's (N(0, 1) embeddings through a tied head:
        torch.nn.init.normal_(self.pos.weight, std=0.02)  # a loss of ~36 at the start)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(s, device=tokens.device)
        h = self.transformer.encoder(x, mask=mask, is_causal=True)  # ends with nn.Transformer's own final LayerNorm
        logits = F.linear(h, self.tok.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_training(name, model, batches, device, bf16, warmup, steps):
    """Tokens/s of `steps` AdamW steps after `warmup` ones; returns (tokens/s, the first step's loss)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step(i):
        tok = batches[i % len(batches)]
        with autocast:
            loss = model(tok[:, :-1], tok[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first = float(step(0).detach())
    for i in range(1, warmup):
        step(i)
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        step(warmup + i)
    sync(device)
    elapsed = time.perf_counter() - t0
    b, s1 = batches[0].shape
    tps = b * (s1 - 1) * steps / elapsed
    print(f"  {name:<34} {elapsed / steps * 1e3:9.2f} ms/step  {tps:12,.0f} tokens/s  (first-step loss {first:.4f})",
          flush=True)
    return tps, first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (seconds)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where present; cpu with --smoke)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 16; 2 with --smoke)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; 32 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 3 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --smoke)")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--compile", action="store_true", help="include torch.compile in a --smoke run")
    args = p.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    shape = SMOKE if args.smoke else GPT2_SMALL
    batch = args.batch or (2 if args.smoke else 16)
    seq = args.seq or (32 if args.smoke else 1024)
    steps = args.steps or (3 if args.smoke else 10)
    warmup = args.warmup or (1 if args.smoke else 3)
    bf16 = device.type == "cuda"
    if args.smoke and device.type == "cpu":
        torch.set_num_threads(1)  # a tiny model: OpenMP's barriers would cost more than the work
    compile_reason = ("--no-compile" if args.no_compile else
                      "left out of --smoke (pass --compile to include it)" if args.smoke and not args.compile else "")

    torch.manual_seed(0)
    ours = OptimizedTransformer(**shape, device=device)  # d_model=768, n_heads=12, n_layers=12, ... by default
    config, state = ours.config, {k: v.detach().clone() for k, v in ours.state_dict().items()}
    n_params = sum(p.numel() for p in ours.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen).to(device) for _ in range(4)]
    print(f"OptimizedTransformer: {n_params / 1e6:.1f}M parameters, batch {batch} x seq {seq} on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"{'bf16 autocast' if bf16 else 'fp32'}, AdamW; {steps} timed steps after {warmup}")

    results = {}
    results["ours"], loss_ours = time_training("optimized_ops OptimizedTransformer", ours, batches, device, bf16,
                                               warmup, steps)
    del ours
    free(device)

    torch.manual_seed(0)
    seed_model = TorchTransformerLM(config.d_model, config.n_heads, config.n_layers, config.vocab_size,
                                    config.max_seq_len).to(device)
    n_seed = sum(p.numel() for p in seed_model.parameters())
    results["nn"], _ = time_training(f"torch.nn.Transformer ({n_seed / 1e6:.1f}M)", seed_model, batches, device, bf16,
                                     warmup, steps)
    del seed_model
    free(device)

    ref = Transformer(config, reference=True, device=device)
    ref.load_state_dict(state)
    results["eager"], loss_ref = time_training("same architecture, torch eager", ref, batches, device, bf16,
                                               warmup, steps)
    del ref
    free(device)

    if compile_reason:
        print(f"  {'same architecture, torch.compile':<34} skipped: {compile_reason}")
    else:
        ref = Transformer(config, reference=True, device=device)
        ref.load_state_dict(state)
        results["compile"], _ = time_training("same architecture, torch.compile", torch.compile(ref), batches,
                                              device, bf16, warmup, steps)
        del ref
        free(device)

    print(f"\nSame weights, same first batch: loss {loss_ours:.5f} (ours) vs {loss_ref:.5f} (torch reference)")
    print(f"Speedup: {results['ours'] / results['nn']:.2f}x vs torch.nn.Transformer(d_model={config.d_model}, "
          f"nhead={config.n_heads}) as a decoder-only LM -- a different architecture (post-norm LayerNorm, ReLU MLP "
          "of 2048, learned positions, no RoPE): indicative only")
    print(f"Speedup: {results['ours'] / results['eager']:.2f}x vs the same architecture in torch eager "
          "(Transformer(config, reference=True))")
    if "compile" in results:
        print(f"Speedup: {results['ours'] / results['compile']:.2f}x vs torch.compile of the same architecture")
    else:
        print(f"Speedup vs torch.compile of the same architecture: not measured ({compile_reason})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
