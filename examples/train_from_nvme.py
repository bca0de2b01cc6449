"""Training a model from shard files on local storage: ``train_from_nvme(model, path, config)``.

The training data never sits in host memory as a whole: ``optimized_ops.data.StreamingLoader``
reads batches of token sequences from the shard files (O_DIRECT, io_uring or a pread pool) into
pinned buffers and copies them to the GPU on its own stream while the previous steps compute, so
the loop below only waits for storage when the disk is slower than the model.

    python examples/train_from_nvme.py                       # synthetic data in a temporary dir
    python examples/train_from_nvme.py --data /nvme/tokens   # shards written by write_shards
    torchrun --nproc-per-node 8 examples/train_from_nvme.py --data /nvme/tokens   # one rank per GPU

The records are int32 sequences of ``seq_len + 1`` tokens (inputs and shifted targets); write your
own with ``optimized_ops.data.write_shards(path, tokens.reshape(-1, seq_len + 1))``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from optimized_ops import data


@dataclasses.dataclass
class TrainConfig:
    batch_size: int = 64
    epochs: int = 1
    lr: float = 3e-3
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    shuffle: bool = True
    seed: int = 0
    rank: int = int(os.environ.get("RANK", 0))              # data-parallel rank (torchrun sets these)
    world_size: int = int(os.environ.get("WORLD_SIZE", 1))
    max_steps: int | None = None
    log_every: int = 50
    prefetch: int = 4


class TinyLM(torch.nn.Module):
    """Embedding -> MLP -> vocabulary: enough to learn the synthetic data's next-token rule."""

    def __init__(self, vocab: int, dim: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


def train_from_nvme(model: torch.nn.Module, path: str, config: TrainConfig | dict | None = None) -> dict:
    """Trains ``model`` (tokens (B, S) -> logits (B, S, V)) on the token shards at ``path``.

    Returns the loss of every step, the steps taken, tokens per second and the time the loop spent
    waiting for data (zero when the loader keeps ahead of the model)."""
    cfg = config if isinstance(config, TrainConfig) else TrainConfig(**(config or {}))
    device = torch.device(cfg.device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    loader = data.StreamingLoader(path, batch_size=cfg.batch_size, device=device, shuffle=cfg.shuffle,
                                  seed=cfg.seed, rank=cfg.rank, world_size=cfg.world_size,
                                  drop_last=cfg.world_size > 1,  # equal step counts on every rank
                                  prefetch=cfg.prefetch)
    losses, tokens, step = [], 0, 0
    start = time.perf_counter()
    with loader:
        for epoch in range(cfg.epochs):
            for batch in loader:  # (B, S + 1) int32 on the device, ready on the current stream
                x, y = batch[:, :-1].long(), batch[:, 1:].long()
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                tokens += y.numel()
                step += 1
                if cfg.log_every and step % cfg.log_every == 0 and cfg.rank == 0:
                    print(f"epoch {epoch} step {step}: loss {losses[-1]:.3f}", flush=True)
                if cfg.max_steps and step >= cfg.max_steps:
                    break
            if cfg.max_steps and step >= cfg.max_steps:
                break
        stats = loader.stats()
    elapsed = time.perf_counter() - start
    return {"losses": losses, "steps": step, "tokens_per_s": tokens / elapsed if elapsed else math.inf,
            "data_wait_s": stats["consumer_wait_s"], "elapsed_s": elapsed, "io": loader.io_backend}


def make_synthetic(path: str, sequences: int = 20000, seq_len: int = 64, vocab: int = 256, seed: int = 0):
    """Token sequences following next = (3 * token + 1) mod vocab from a random start: a model that
    learns the rule drives the loss to zero."""
    rng = np.random.default_rng(seed)
    seq = np.empty((sequences, seq_len + 1), dtype=np.int32)
    seq[:, 0] = rng.integers(0, vocab, sequences)
    for t in range(seq_len):
        seq[:, t + 1] = (3 * seq[:, t] + 1) % vocab
    return data.write_shards(path, seq, records_per_shard=4096, overwrite=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="token shard directory (default: synthetic data in a temporary directory)")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default=TrainConfig.device)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data
        if path is None:
            path = os.path.join(tmp, "tokens")
            info = make_synthetic(path, vocab=args.vocab)
            print(f"synthetic dataset: {info.num_records} sequences of {info.record_shape[0]} tokens in {path}")
        result = train_from_nvme(TinyLM(args.vocab), path,
                                 TrainConfig(epochs=args.epochs, batch_size=args.batch_size, device=args.device))
    print(f"{result['steps']} steps, loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}, "
          f"{result['tokens_per_s']:.0f} tokens/s, waited {result['data_wait_s']:.3f} s for data ({result['io']})")


if __name__ == "__main__":
    main()
