"""Expert parallelism: an MoE layer whose experts are spread over the GPUs, trained a few steps.

    torchrun --nproc_per_node 2 examples/distributed/expert_parallel.py                  # NCCL, one GPU per rank
    torchrun --nproc_per_node 2 examples/distributed/expert_parallel.py --device cpu     # gloo, on the CPU

``optimized_ops.nn.MoE(..., process_group=group)`` holds E / W experts on each of the W ranks and a replicated
router. Each rank brings its own tokens; the layer sends every (token, expert) pair to its expert's rank by
all-to-all (the counts first, then the rows: variable splits, no padding), runs the local experts on the grouped
GEMM (the rows for this rank's own experts while the others are in flight) and sends the results back. The router
is replicated: sum (or, with DDP, average) its gradient over the ranks; the experts' gradients stay local.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist

import optimized_ops
from optimized_ops.distributed import init_process_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capacity-factor", type=float, default=None)
    args = p.parse_args()

    # NVLink multicast forced off, a timeout so a failed rank stops the others with an error.
    rank, world = init_process_group("nccl" if args.device == "cuda" else "gloo",
                                     timeout=datetime.timedelta(seconds=120))
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    torch.manual_seed(0)  # the same router on every rank; each rank draws its own experts
    moe = optimized_ops.nn.MoE(args.d_model, args.d_ff, args.experts, args.top_k, capacity_factor=args.capacity_factor,
                               process_group=dist.group.WORLD, device=dev, dtype=dtype)
    torch.manual_seed(1 + rank)
    moe.reset_parameters()
    with torch.no_grad():
        dist.broadcast(moe.router.weight, src=0)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-3)
    # A toy regression: each rank's tokens map to a fixed random target.
    x = torch.randn(args.tokens, args.d_model, device=dev, dtype=dtype)
    target = torch.randn_like(x)
    for step in range(args.steps):
        y = moe(x)
        loss = (y.float() - target.float()).square().mean() + moe.last_metrics.loss
        loss.backward()
        dist.all_reduce(moe.router.weight.grad)  # the replicated router: the group's gradient
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            m = moe.last_metrics
            print(f"step {step:3d} | loss {loss.item():.4f} | tokens per expert {m.tokens_per_expert.tolist()} | "
                  f"dropped {int(m.dropped)}", flush=True)
    if rank == 0:
        print(f"{world} ranks, experts {moe.expert_offset}..{moe.expert_offset + moe.w13.shape[0] - 1} on rank 0")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
