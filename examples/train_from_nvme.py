"""Training a model from shard files on local storage: ``train_from_nvme(model, path, config)``.

The training data never sits in host memory as a whole: ``optimized_ops.data.StreamingLoader``
reads batches of token sequences from the shard files (O_DIRECT, io_uring or a pread pool) into
pinned buffers and copies them to the GPU on its own stream while the previous steps compute, so
the loop only waits for storage when the disk is slower than the model. The loop itself is the
library's ``optimized_ops.models.training.train_from_nvme`` (bf16 autocast on CUDA, AdamW,
gradient accumulation, clipping, a warm-up + cosine schedule, checkpoints that resume exactly);
this example gives it a tiny model and data whose rule it can learn completely.

    python examples/train_from_nvme.py                       # synthetic data in a temporary dir
    python examples/train_from_nvme.py --data /nvme/tokens   # shards written by write_token_shards
    torchrun --nproc-per-node 8 examples/train_from_nvme.py --data /nvme/tokens   # one rank per GPU

The records are integer sequences of ``seq_len + 1`` tokens (inputs and shifted targets); write
your own corpus with ``optimized_ops.models.training.write_token_shards(path, tokens, seq_len=...)``.
With torchrun each rank reads its own part of every epoch and trains its own replica (wrap the
model in ``DistributedDataParallel`` to average the gradients). For a transformer trained this way,
see ``examples/train_gpt.py``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from optimized_ops import data
from optimized_ops.models.training import TrainConfig, train_from_nvme  # noqa: F401  (train_from_nvme: re-exported)


class TinyLM(torch.nn.Module):
    """Embedding -> MLP -> vocabulary: enough to learn the synthetic data's next-token rule.

    ``forward(tokens, targets=None)`` follows ``optimized_ops.models.Transformer``: logits (B, S, V),
    or the mean cross-entropy when ``targets`` are given."""

    def __init__(self, vocab: int, dim: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, vocab))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.mlp(self.embed(tokens))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


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
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.data
        if path is None:
            path = os.path.join(tmp, "tokens")
            info = make_synthetic(path, vocab=args.vocab)
            print(f"synthetic dataset: {info.num_records} sequences of {info.record_shape[0]} tokens in {path}")
        config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, device=args.device,
                             log_every=50, rank=int(os.environ.get("RANK", 0)),  # torchrun sets these
                             world_size=int(os.environ.get("WORLD_SIZE", 1)))
        result = train_from_nvme(TinyLM(args.vocab), path, config)
    print(f"{result.steps} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
          f"{result.tokens_per_s:.0f} tokens/s, waited {result.data_wait_s:.3f} s for data ({result.io})")


if __name__ == "__main__":
    main()
