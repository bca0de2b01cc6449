"""Tensor parallelism: a transformer whose attention heads and MLP columns are split over the GPUs.

    torchrun --nproc_per_node 2 examples/distributed/tensor_parallel.py                  # NCCL
    torchrun --nproc_per_node 2 examples/distributed/tensor_parallel.py --device cpu     # gloo, on the CPU

``optimized_ops.distributed.parallelize_transformer(model)`` replaces each block's attention (heads split, GQA
groups whole) and SwiGLU MLP (up projection by columns, down projection by rows) by their tensor-parallel shards:
one all-reduce per block in the forward and one in the backward, Megatron-LM's scheme. Every rank sees the same
tokens; the loss and the replicated parameters' gradients are the same on every rank. The example checks the
first loss against the unsplit model's and trains a few steps.
"""

from __future__ import annotations

import argparse
import copy
import datetime

import torch
import torch.distributed as dist

from optimized_ops.distributed import init_process_group, parallelize_transformer
from optimized_ops.models import Transformer, TransformerConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    rank, world = init_process_group("nccl" if args.device == "cuda" else "gloo",
                                     timeout=datetime.timedelta(seconds=120))
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

    cfg = TransformerConfig(d_model=256, n_heads=8, n_kv_heads=4, n_layers=4, vocab_size=1024, max_seq_len=args.seq)
    torch.manual_seed(0)                          # the same model on every rank, then sharded
    dense = Transformer(cfg, device=dev)
    model = parallelize_transformer(copy.deepcopy(dense))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    with torch.no_grad(), autocast:
        want = dense(tokens[:, :-1], tokens[:, 1:]).item()
    del dense
    for step in range(args.steps):
        with autocast:
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0 and rank == 0:
            print(f"first loss {loss.item():.5f}; the unsplit model's {want:.5f}", flush=True)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d} | loss {loss.item():.4f}", flush=True)
    if rank == 0:
        heads = model.layers[0].attn
        print(f"{world} ranks: {heads.n_heads} query / {heads.n_kv_heads} kv heads and "
              f"{model.layers[0].ffn.w13.local_out // 2} of {cfg.d_ff} MLP columns per rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
