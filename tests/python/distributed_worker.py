"""One rank of the distributed tests (tests/python/test_distributed.py launches W of them; torchrun can too).

Every case builds the same global problem on every rank from a fixed seed, runs the single-process layer on all of
it (the reference: float64 where the ops have a float64 CPU path, else float32 checked against the single-GPU
layer, itself checked against float64 by test_moe_layer.py), runs the parallel layer on this rank's part, and
compares the forward and the gradients. The cases share one process group (made once per job).

    # what test_distributed.py does, per world size (gloo, CPU):
    RANK=r WORLD_SIZE=W DIST_INIT_FILE=/tmp/x python tests/python/distributed_worker.py --out DIR
    # on 2 GPUs (NCCL):
    torchrun --nproc_per_node 2 tests/python/distributed_worker.py --backend nccl --device cuda

Exit status 0 when every case passed on this rank; the results go to ``DIR/rank<r>.json`` (case -> "ok" or the
error) and to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

import optimized_ops
from optimized_ops import distributed as odist
from optimized_ops.distributed import _comm

RANK = WORLD = 0
DEVICE = torch.device("cpu")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _u(shape, scale, dtype, g, lo=-1.0):
    """U(lo, 1) * scale, drawn in float64 on the CPU (the same on every rank), then to dtype and the device."""
    x = torch.rand(shape, generator=g, dtype=torch.float64) * (1 - lo) + lo
    return (x * scale).to(dtype).to(DEVICE)


def _close(name, got, want, rtol, atol):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if not torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True):
        err = (got - want).abs().max().item() if got.numel() else 0.0
        raise AssertionError(f"{name}: max |diff| {err:.3g} (rtol {rtol}, atol {atol})")


def _sum_over_ranks(t):
    t = t.detach().clone().contiguous()
    dist.all_reduce(t)
    return t


# ---- expert parallelism -----------------------------------------------------------------------------------------

def _split_tokens(counts, x):
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return x[starts[RANK]:starts[RANK] + counts[RANK]], starts[RANK]


def _ep_case(*, tokens, e=8, k=2, d=16, f=12, capacity_factor=None, scoring="softmax", overlap=True,
             empty_experts=(), seed=0):
    """EP layer (this rank's tokens ``tokens[RANK]``) vs the single-GPU nn.MoE on all the tokens."""
    g = _gen(seed)
    dtype = torch.float32
    t = sum(tokens)
    if empty_experts:   # positive tokens and all-negative router rows: those experts are never chosen
        x = _u((t, d), 1.0, dtype, g, lo=0.1)
    else:
        x = _u((t, d), 1.0, dtype, g)
    dense = optimized_ops.nn.MoE(d, f, e, k, capacity_factor=capacity_factor, scoring=scoring, device=DEVICE,
                                 dtype=dtype)
    with torch.no_grad():
        dense.router.weight.copy_(_u((e, d), 3.0 / math.sqrt(d), dtype, g))
        for i in empty_experts:
            dense.router.weight[i] = -_u((d,), 1.0, dtype, g, lo=0.5)
        dense.w13.copy_(_u((e, d, 2 * f), 1 / math.sqrt(d), dtype, g))
        dense.w2.copy_(_u((e, f, d), 1 / math.sqrt(f), dtype, g))
    dout = _u((t, d), 1.0, dtype, g)

    # reference: the whole problem on one process
    xr = x.clone().requires_grad_()
    out = dense(xr)
    m = dense.last_metrics
    ((out * dout).sum() + m.loss).backward()

    ep = odist.ExpertParallelMoE.from_dense(dense, overlap=overlap)
    assert isinstance(ep, optimized_ops.nn.MoE) and ep.w13.shape[0] == e // WORLD
    first = RANK * (e // WORLD)
    x_mine, start = _split_tokens(tokens, x)
    x_mine = x_mine.clone().requires_grad_()
    out_mine = ep(x_mine)
    em = ep.last_metrics
    ((out_mine * dout[start:start + tokens[RANK]]).sum() + em.loss).backward()

    # float32 both sides, each row through the same ops; on CUDA the per-expert GEMMs see other row counts
    # (another tiling, another summation order)
    tol = dict(rtol=2e-5, atol=2e-6) if DEVICE.type == "cpu" else dict(rtol=1e-4, atol=1e-5)
    _close("out", out_mine, out[start:start + tokens[RANK]], **tol)
    _close("x.grad", x_mine.grad, xr.grad[start:start + tokens[RANK]], **tol)
    _close("w13.grad", ep.w13.grad, dense.w13.grad[first:first + e // WORLD], **tol)
    _close("w2.grad", ep.w2.grad, dense.w2.grad[first:first + e // WORLD], **tol)
    _close("router.grad (summed over ranks)", _sum_over_ranks(ep.router.weight.grad), dense.router.weight.grad,
           rtol=1e-4, atol=1e-5)
    assert em.tokens_per_expert.cpu().tolist() == m.tokens_per_expert.cpu().tolist(), \
        f"tokens_per_expert {em.tokens_per_expert.tolist()} != {m.tokens_per_expert.tolist()}"
    assert int(em.dropped) == int(m.dropped), f"dropped {int(em.dropped)} != {int(m.dropped)}"
    for name in ("load", "utilization", "active_experts", "imbalance", "aux_loss", "z_loss", "loss"):
        _close(name, getattr(em, name), getattr(m, name), rtol=1e-5, atol=1e-6)
    for i in empty_experts:
        assert int(m.tokens_per_expert[i]) == 0, f"expert {i} was meant to get no tokens"
    if capacity_factor is not None and capacity_factor < 1.5:
        assert int(m.dropped) > 0, "the capacity case should drop pairs"
    return {"dropped": int(m.dropped), "tokens": tokens}


def _tokens(base):
    return [base[i % len(base)] for i in range(WORLD)]


def case_ep_dropless_uneven():
    return _ep_case(tokens=_tokens([7, 3, 11, 5]))


def case_ep_dropless_no_overlap():
    return _ep_case(tokens=_tokens([7, 3, 11, 5]), overlap=False, seed=1)


def case_ep_rank_without_tokens():
    tokens = _tokens([9, 4, 6, 2])
    tokens[-1] = 0
    return _ep_case(tokens=tokens, seed=2)


def case_ep_experts_without_tokens():
    return _ep_case(tokens=_tokens([6, 10, 3, 8]), empty_experts=(1, 2, 3), seed=3)


def case_ep_capacity():
    return _ep_case(tokens=_tokens([13, 5, 9, 2]), capacity_factor=0.75, seed=4)


def case_ep_sigmoid_top1():
    return _ep_case(tokens=_tokens([5, 8, 1, 6]), k=1, scoring="sigmoid", seed=5)


def case_ep_p2p_fallback():
    os.environ["OPTIMIZED_OPS_A2A_FALLBACK"] = "1"
    try:
        return _ep_case(tokens=_tokens([6, 0, 9, 4]), seed=6)
    finally:
        del os.environ["OPTIMIZED_OPS_A2A_FALLBACK"]


def case_ep_nn_moe_process_group():
    """nn.MoE(process_group=...) shards the experts; its state_dict holds this rank's experts only."""
    moe = optimized_ops.nn.MoE(16, 8, 8, 2, process_group=dist.group.WORLD, device=DEVICE)
    assert moe.w13.shape == (8 // WORLD, 16, 16) and moe.w2.shape == (8 // WORLD, 8, 16)
    y = moe(torch.randn(3, 16, device=DEVICE))
    assert y.shape == (3, 16) and "expert_parallel" in repr(moe)
    try:
        optimized_ops.nn.MoE(16, 8, 6, 2, process_group=dist.group.WORLD) if WORLD == 4 else None
    except ValueError as e:
        assert "multiple of the expert-parallel group's size 4" in str(e), e
    else:
        assert WORLD != 4, "6 experts over 4 ranks should be refused"


# ---- tensor parallelism -----------------------------------------------------------------------------------------

TP_DTYPE = torch.float64


def _tp_dtype():
    return torch.float32 if DEVICE.type == "cuda" else TP_DTYPE


def _tol():
    return dict(rtol=1e-9, atol=1e-11) if _tp_dtype() == torch.float64 else dict(rtol=2e-4, atol=2e-5)


def _grads_as_module(module):
    """A copy of ``module`` whose parameters are ``module``'s gradients (so that ``from_dense`` of it shards them
    like the parameters)."""
    c = copy.deepcopy(module)
    with torch.no_grad():
        for (name, p), (_, q) in zip(module.named_parameters(), c.named_parameters()):
            q.copy_(p.grad)
    return c


def _compare_params(tp, expected, what):
    got = dict(tp.named_parameters())
    for name, p in expected.named_parameters():
        _close(f"{what} {name}.grad", got[name].grad, p, **_tol())


def _config(**kw):
    from optimized_ops.models import TransformerConfig
    base = dict(d_model=64, n_heads=8, n_kv_heads=4, n_layers=2, d_ff=48, vocab_size=64, max_seq_len=16, bias=True)
    base.update(kw)
    return TransformerConfig(**base)


def case_tp_linear_column_row():
    dt = _tp_dtype()
    g = _gen(10)
    torch.manual_seed(10)
    full1 = torch.nn.Linear(12, 8, device=DEVICE, dtype=dt)
    full2 = torch.nn.Linear(8, 12, device=DEVICE, dtype=dt)
    x = _u((3, 5, 12), 1.0, dt, g)
    dy = _u((3, 5, 12), 1.0, dt, g)
    xr = x.clone().requires_grad_()
    y = torch.nn.functional.linear(torch.nn.functional.linear(xr, full1.weight, full1.bias), full2.weight, full2.bias)
    (y * dy).sum().backward()
    col = odist.ColumnParallelLinear.from_dense(full1, gather_output=True)
    row = odist.RowParallelLinear.from_dense(full2, input_is_parallel=False)
    xt = x.clone().requires_grad_()
    yt = row(col(xt))
    (yt * dy).sum().backward()
    _close("y", yt, y, **_tol())
    _close("x.grad", xt.grad, xr.grad, **_tol())
    _compare_params(col, odist.ColumnParallelLinear.from_dense(_grads_as_module(full1)), "column")
    _compare_params(row, odist.RowParallelLinear.from_dense(_grads_as_module(full2)), "row")


def _block_modules(cfg, seed):
    from optimized_ops.models.transformer import Attention, SwiGLU
    torch.manual_seed(seed)
    dt = _tp_dtype()
    attn = Attention(cfg, reference=False).to(DEVICE, dt)
    mlp = SwiGLU(cfg, reference=False).to(DEVICE, dt)
    with torch.no_grad():
        for p in list(attn.parameters()) + list(mlp.parameters()):
            p.uniform_(-0.3, 0.3)
    return attn, mlp


def case_tp_mlp_and_attention():
    cfg = _config()
    attn, mlp = _block_modules(cfg, 11)
    dt = _tp_dtype()
    g = _gen(11)
    b, s = 2, 6
    x = _u((b, s, cfg.d_model), 1.0, dt, g)
    dy = _u((b, s, cfg.d_model), 1.0, dt, g)
    pos = torch.arange(s, device=DEVICE)
    for name, dense, make, call in [
            ("mlp", mlp, odist.TensorParallelSwiGLU.from_dense, lambda m, h: m(h)),
            ("attention", attn, odist.TensorParallelAttention.from_dense, lambda m, h: m(h, pos))]:
        dense.zero_grad()
        xr = x.clone().requires_grad_()
        y = call(dense, xr)
        (y * dy).sum().backward()
        tp = make(dense)
        xt = x.clone().requires_grad_()
        yt = call(tp, xt)
        (yt * dy).sum().backward()
        _close(f"{name} y", yt, y, **_tol())
        _close(f"{name} x.grad", xt.grad, xr.grad, **_tol())
        _compare_params(tp, make(_grads_as_module(dense)), name)


def case_tp_sequence_parallel_block():
    """norm -> attention -> residual -> norm -> MLP -> residual, with the norms and residuals on sequence shards."""
    cfg = _config()
    attn, mlp = _block_modules(cfg, 12)
    dt = _tp_dtype()
    norm1 = optimized_ops.nn.RMSNorm(cfg.d_model, device=DEVICE, dtype=dt)
    norm2 = optimized_ops.nn.RMSNorm(cfg.d_model, device=DEVICE, dtype=dt)
    with torch.no_grad():
        norm1.weight.uniform_(0.5, 1.5)
        norm2.weight.uniform_(0.5, 1.5)
    g = _gen(12)
    b, s = 2, 8
    x = _u((b, s, cfg.d_model), 1.0, dt, g)
    dy = _u((b, s, cfg.d_model), 1.0, dt, g)
    pos = torch.arange(s, device=DEVICE)

    def block(n1, a, n2, m, h):
        h = h + a(n1(h), pos)
        return h + m(n2(h))

    xr = x.clone().requires_grad_()
    y = block(norm1, attn, norm2, mlp, xr)
    (y * dy).sum().backward()

    sl = slice(RANK * s // WORLD, (RANK + 1) * s // WORLD)
    tp_attn = odist.TensorParallelAttention.from_dense(attn, sequence_parallel=True)
    tp_mlp = odist.TensorParallelSwiGLU.from_dense(mlp, sequence_parallel=True)
    n1, n2 = copy.deepcopy(norm1), copy.deepcopy(norm2)
    for n in (n1, n2):
        n.zero_grad(set_to_none=True)
    xt = x[:, sl].clone().requires_grad_()
    yt = block(n1, tp_attn, n2, tp_mlp, xt)
    (yt * dy[:, sl]).sum().backward()
    odist.allreduce_sequence_parallel_grads([n1.weight, n2.weight, tp_attn, tp_mlp])
    _close("y shard", yt, y[:, sl], **_tol())
    _close("x.grad shard", xt.grad, xr.grad[:, sl], **_tol())
    _close("norm1.weight.grad", n1.weight.grad, norm1.weight.grad, **_tol())
    _close("norm2.weight.grad", n2.weight.grad, norm2.weight.grad, **_tol())
    _compare_params(tp_attn, odist.TensorParallelAttention.from_dense(_grads_as_module(attn)), "attention")
    _compare_params(tp_mlp, odist.TensorParallelSwiGLU.from_dense(_grads_as_module(mlp)), "mlp")


def case_tp_transformer():
    from optimized_ops.models import Transformer
    from optimized_ops.models.transformer import Attention, SwiGLU
    cfg = _config(bias=False)
    dt = _tp_dtype()
    torch.manual_seed(13)
    model = Transformer(cfg, device=DEVICE, dtype=dt)
    tp = odist.parallelize_transformer(copy.deepcopy(model))
    g = torch.Generator().manual_seed(13)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=g).to(DEVICE)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    loss_tp = tp(tokens[:, :-1], tokens[:, 1:])
    loss_tp.backward()
    _close("loss", loss_tp, loss, **_tol())
    for i, (blk, blk_tp) in enumerate(zip(model.layers, tp.layers)):
        assert isinstance(blk_tp.attn, odist.TensorParallelAttention) and isinstance(blk_tp.ffn,
                                                                                   odist.TensorParallelSwiGLU)
        _compare_params(blk_tp.attn, odist.TensorParallelAttention.from_dense(_grads_as_module(blk.attn)),
                        f"layer {i} attention")
        _compare_params(blk_tp.ffn, odist.TensorParallelSwiGLU.from_dense(_grads_as_module(blk.ffn)), f"layer {i} mlp")
    sharded = {n for n, _ in tp.named_parameters() if ".attn." in n or ".ffn." in n}
    full = dict(model.named_parameters())
    for n, p in tp.named_parameters():
        if n not in sharded:
            _close(f"{n}.grad (replicated)", p.grad, full[n].grad, **_tol())


# ---- data parallelism -------------------------------------------------------------------------------------------

def case_dp_ddp_gradients():
    """DDP over W ranks, 2 sequences each, equals one process on the 2W sequences (float64 on the CPU)."""
    from optimized_ops.models import Transformer
    cfg = _config(bias=False, n_layers=1)
    dt = _tp_dtype()
    torch.manual_seed(14)
    model = Transformer(cfg, device=DEVICE, dtype=dt)
    ddp = odist.wrap_ddp(copy.deepcopy(model), DEVICE)
    g = torch.Generator().manual_seed(14)
    tokens = torch.randint(0, cfg.vocab_size, (2 * WORLD, 9), generator=g).to(DEVICE)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    mine = tokens[2 * RANK:2 * RANK + 2]
    ddp(mine[:, :-1], mine[:, 1:]).backward()
    full = dict(model.named_parameters())
    for n, p in ddp.module.named_parameters():
        _close(f"{n}.grad", p.grad, full[n].grad, **_tol())


def _shared_dir(tag):
    """A directory every rank sees: rank 0 makes it and broadcasts the path."""
    obj = [tempfile.mkdtemp(prefix=f"oo-dist-{tag}-") if RANK == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def case_dp_train_resume():
    """train_data_parallel: stopped after 2 of 4 steps and resumed equals an uninterrupted run (bit for bit on the
    CPU); the ranks end with the same parameters; a checkpoint refuses another world size."""
    from optimized_ops.models import Transformer
    from optimized_ops.models.training import TrainConfig, synthetic_corpus, train_from_nvme, write_token_shards
    root = _shared_dir("train")
    data = os.path.join(root, "tokens")
    if RANK == 0:
        write_token_shards(data, synthetic_corpus(8 * 4 * 17 * 2 + 64, vocab_size=64, seed=0), seq_len=16)
    dist.barrier()
    cfg = _config(bias=False, n_layers=1)

    def run(ckpt, stop_after=None):
        torch.manual_seed(15)
        model = Transformer(cfg)
        tc = TrainConfig(batch_size=2, steps=4, stop_after=stop_after, lr=3e-3, warmup_steps=1, device=str(DEVICE),
                         checkpoint_dir=os.path.join(root, ckpt), log_every=0, prefetch=1, dtype="fp32")
        return odist.train_data_parallel(model, data, tc), model

    full, m_full = run("full")
    first, _ = run("split", stop_after=2)
    second, m_resumed = run("split")
    assert second.start_step == 2 and second.resumed_from is not None, (second.start_step, second.resumed_from)
    # Bit for bit on the CPU with 1 or 2 ranks. With more, gloo's ring all-reduce sums 3+ terms in an order that
    # depends on where an element sits in DDP's bucket, and DDP rebuilds its buckets after the first step of each
    # run (a resumed run rebuilds at another step): the same values to rounding. (The resumed run's first two
    # losses are the checkpoint's history: rank 0's.)
    exact = DEVICE.type == "cpu" and WORLD <= 2
    if exact:
        assert second.losses[2:] == full.losses[2:], f"resumed losses {second.losses} != uninterrupted {full.losses}"
    else:
        _close("losses", torch.tensor(second.losses[2:]), torch.tensor(full.losses[2:]), rtol=1e-4, atol=1e-5)
    if RANK == 0:
        assert first.losses == full.losses[:2] == second.losses[:2], (first.losses, full.losses, second.losses)
    for (n, p), q in zip(m_full.named_parameters(), m_resumed.parameters()):
        if exact:
            assert torch.equal(p.detach().cpu(), q.detach().cpu()), f"{n}: resumed != uninterrupted"
        else:
            _close(n, q, p, rtol=1e-4, atol=1e-4)
    flat = torch.cat([p.detach().reshape(-1) for p in m_full.parameters()]).double()
    summary = torch.stack([flat.sum(), flat.square().sum()])
    everyone = [torch.zeros_like(summary) for _ in range(WORLD)]
    dist.all_gather(everyone, summary)
    assert all(torch.equal(everyone[0], s) for s in everyone), "the ranks' parameters differ after training"
    dist.barrier()
    if RANK == 0:  # the same checkpoint, another world size: refused
        try:
            train_from_nvme(Transformer(cfg), data, TrainConfig(
                batch_size=2, steps=4, device=str(DEVICE), checkpoint_dir=os.path.join(root, "full"), log_every=0,
                rank=0, world_size=WORLD + 1, prefetch=1, dtype="fp32"))
        except ValueError as e:
            assert "world_size" in str(e), e
        else:
            raise AssertionError("resuming on another world size was not refused")
    dist.barrier()
    return {"losses": full.losses}


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


# ---- failures ---------------------------------------------------------------------------------------------------

def failure_job(kind):
    """Rank 1 fails (``dead``: exits; ``hung``: sleeps past the timeout) while rank 0 runs an EP forward; rank 0
    must raise DistributedError naming the collective within the timeout."""
    dist.barrier()
    if RANK == 1:
        if kind == "dead":
            os._exit(3)
        time.sleep(float(os.environ.get("HANG_S", "12")))
        os._exit(0)
    time.sleep(0.5)
    moe = optimized_ops.nn.MoE(8, 8, 4, 2, process_group=dist.group.WORLD)
    t0 = time.perf_counter()
    try:
        moe(torch.randn(5, 8))
    except odist.DistributedError as e:
        return {"error": str(e), "seconds": time.perf_counter() - t0}
    raise AssertionError("the forward returned although rank 1 failed")


# ---- the job ----------------------------------------------------------------------------------------------------

def main(argv=None):
    global RANK, WORLD, DEVICE
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--cases", default="all")
    p.add_argument("--failure", default=None, choices=[None, "dead", "hung"])
    p.add_argument("--timeout-s", type=float, default=60.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    odist.force_no_multicast_env()
    init = os.environ.get("DIST_INIT_FILE")
    RANK, WORLD = odist.init_process_group(
        args.backend, timeout=datetime.timedelta(seconds=args.timeout_s),
        init_method=f"file://{init}" if init else None,
        rank=int(os.environ["RANK"]) if init else None, world_size=int(os.environ["WORLD_SIZE"]) if init else None)
    DEVICE = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    results = {}
    if args.failure:
        try:
            results["failure"] = {"status": "ok", **failure_job(args.failure)}
        except Exception as e:  # noqa: BLE001
            results["failure"] = {"status": f"{type(e).__name__}: {e}"}
    else:
        names = list(CASES) if args.cases == "all" else args.cases.split(",")
        for name in names:
            t0 = time.perf_counter()
            try:
                extra = CASES[name]() or {}
                results[name] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 3), **extra}
            except Exception:  # noqa: BLE001 - reported per case
                results[name] = {"status": traceback.format_exc(limit=6)}
    env = {k: os.environ.get(k) for k in _comm.NO_MULTICAST_ENV}
    report = {"rank": RANK, "world": WORLD, "backend": args.backend, "device": str(DEVICE), "env": env,
              "results": results}
    if args.out:
        with open(os.path.join(args.out, f"rank{RANK}.json"), "w") as fh:
            json.dump(report, fh)
    bad = [n for n, r in results.items() if r["status"] != "ok"]
    print(f"rank {RANK}/{WORLD} {args.backend}: {len(results) - len(bad)} passed, {len(bad)} failed"
          + "".join(f"\n  {n}: {results[n]['status']}" for n in bad), flush=True)
    if not args.failure:
        with contextlib.suppress(Exception):
            dist.barrier()
            dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if bad else 0)  # no teardown races with a peer that already left


if __name__ == "__main__":
    main()
