"""Data parallelism: the 124M OptimizedTransformer (or a small one) trained with DDP from token shards on disk.

    torchrun --nproc_per_node 2 examples/distributed/data_parallel.py                          # NCCL, GPT-2 small
    torchrun --nproc_per_node 2 examples/distributed/data_parallel.py --device cpu --small     # gloo, on the CPU
    torchrun --nproc_per_node 2 examples/distributed/data_parallel.py --data /nvme/tokens --checkpoint-dir ckpt

``optimized_ops.distributed.train_data_parallel(model, path, config)`` is ``train_from_nvme`` under
``DistributedDataParallel``: each rank's streaming loader reads its own part of every epoch, the gradients are
averaged once per optimizer step, rank 0 writes the checkpoints, and a run started again with the same
``--checkpoint-dir`` on the same number of ranks resumes where it stopped (another number of ranks is refused).
Without ``--data``, rank 0 writes a synthetic corpus into a temporary directory first.
"""

from __future__ import annotations

import argparse
import datetime
import tempfile

import torch
import torch.distributed as dist

from optimized_ops.distributed import init_process_group, train_data_parallel
from optimized_ops.models import OptimizedTransformer
from optimized_ops.models.training import TrainConfig, synthetic_corpus, write_token_shards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--data", default=None)
    p.add_argument("--small", action="store_true", help="a 4-layer 256-wide model (CPU-friendly)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint-dir", default=None)
    args = p.parse_args()
    rank, world = init_process_group("nccl" if args.device == "cuda" else "gloo",
                                     timeout=datetime.timedelta(seconds=300))
    path = args.data
    if path is None:
        obj = [tempfile.mkdtemp(prefix="oo-ddp-") + "/tokens" if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        path = obj[0]
        vocab = 512 if args.small else 50257
        if rank == 0:
            n = (args.seq + 1) * args.batch * world * (args.steps + 2)
            write_token_shards(path, synthetic_corpus(n, vocab_size=vocab, seed=0), seq_len=args.seq)
        dist.barrier()
    kw = dict(d_model=256, n_heads=8, n_layers=4, vocab_size=512) if args.small else {}
    torch.manual_seed(0)
    model = OptimizedTransformer(max_seq_len=args.seq, **kw)
    config = TrainConfig(batch_size=args.batch, steps=args.steps, lr=1e-3, warmup_steps=2, device=str(
        torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else "cpu"),
        checkpoint_dir=args.checkpoint_dir, log_every=5)
    result = train_data_parallel(model, path, config)
    if rank == 0:
        print(f"{world} ranks: {result.steps} steps, last loss {result.losses[-1]:.4f}, "
              f"{result.tokens_per_s * world:,.0f} tokens/s over all ranks"
              + (f", resumed from {result.resumed_from}" if result.resumed_from else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
