"""optimized_ops.models: the Transformer on the library's ops against the same model in plain PyTorch
(``reference=True``), and its configuration.

Parity (CPU, float32; CUDA, bfloat16, skipped without a device): the optimized model, its torch twin in the same
dtype and a float64 copy of the twin (the yardstick) load one state_dict; the logits, the loss, the gradient of
every parameter and the parameters after one AdamW step are compared with the house rule (design.md,
flash-attention's): per tensor, max |ours - fp64| <= 2 max |torch same dtype - fp64| + ulp(dtype) * max |fp64|.
Cases: RMSNorm and LayerNorm, GQA, MHA and MQA, tied and untied embeddings, biases, dense SwiGLU and MoE (top-2
softmax, top-1 sigmoid with a capacity that drops pairs); the MoE cases first check that the float64 routing has
clear top-k margins and that the three models route alike. Also: bf16 autocast on the CPU (the optimized model's
own autocast handling against torch's), the float64 optimized model, the seeded initialization, state_dict both
ways, the config's errors (each names its field), the argument errors of forward, OptimizedTransformer.

Small odd shapes: d_model 64, 4 heads, 2 kv heads, 2 layers, d_ff 75, vocab 97, 3 sequences of 13 tokens."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import optimized_ops
from conftest import accumulation_unit, reduction_allowed_error, requires_cuda
from optimized_ops.models import MoEConfig, OptimizedTransformer, Transformer, TransformerConfig, swiglu_hidden_dim
from optimized_ops.models import reference as ref_math
from optimized_ops.moe.layer import router_logits

B, S, V = 3, 13, 97


def config(**kw) -> TransformerConfig:
    base = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=V, max_seq_len=32, d_ff=75,
                init_std=0.1)
    base.update(kw)
    return TransformerConfig(**base)


def models(cfg, *, seed=0, dtype=torch.float32, device="cpu"):
    """(ours, torch twin of ours' dtype, float64 torch twin on the CPU), all holding ours' weights."""
    torch.manual_seed(seed)
    ours = Transformer(cfg, device=device, dtype=dtype)
    torch.manual_seed(seed + 1)  # another draw: load_state_dict must make them equal
    twin = Transformer(cfg, reference=True, device=device, dtype=dtype)
    twin.load_state_dict(ours.state_dict())
    twin64 = Transformer(cfg, reference=True, dtype=torch.float64)
    twin64.load_state_dict(ours.state_dict())
    return ours, twin, twin64


def batch(seed=0, device="cpu", ignored=((0, 3), (2, 12))):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for b, s in ignored:
        targets[b, s] = -100
    return inputs.to(device), targets.to(device)


def check(name, got, want, same, dtype, roundings=1.0, n=None):
    """max |got - want| <= 2 max |same - want| + roundings * eps(dtype) * max |want|; with ``n``, the MoE layer's
    rule instead where it is looser (test_moe_layer.py, bench/tolerance.py's reduction rule: 2 max |same - want|
    + 2 u max |want| + 16 sqrt(n) 2^-24 max |want|, n the longest reduction)."""
    got, want, same = (t.detach().cpu().double() for t in (got, want, same))
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    base = (same - want).abs().max().item() if want.numel() else 0.0
    bound = 2 * base + roundings * torch.finfo(dtype).eps * scale + 1e-30
    if n is not None:
        bound = max(bound, reduction_allowed_error(dtype, n, base, scale, 0.0, accumulation_unit(dtype)))
    assert err <= bound, (f"{name}: error {err:.3g} > bound {bound:.3g} (torch's own error {base:.3g}, "
                          f"max |ref| {scale:.3g})")
    return err / bound


def routing_margins(model64, inputs):
    """The smallest gap, over every token of every MoE layer, between the k-th and the (k+1)-th router score of
    the float64 reference (inf for k = E): the routing cannot flip between implementations when it is clear."""
    margins = []

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        logits = x @ module.router.weight.double().T
        scores = logits.softmax(-1) if module.scoring == "softmax" else logits.sigmoid()
        if module.top_k < module.num_experts:
            top = scores.topk(module.top_k + 1, dim=-1).values
            margins.append((top[:, -2] - top[:, -1]).min().item())

    handles = [blk.ffn.register_forward_pre_hook(hook) for blk in model64.layers]
    with torch.no_grad():
        model64(inputs)
    for h in handles:
        h.remove()
    return min(margins, default=math.inf)


def route_like_ours(ours, twin, twin64, tolerance):
    """Hooks that make the references use our expert choice (computed bit for bit as our layer computes it:
    its float32 router logits through moe_route), after checking that our choice is a top-k of the float64
    reference's scores within ``tolerance``. For 16-bit activations, whose rounding flips near ties."""
    chosen, handles = {}, []

    def capture(i):
        def hook(module, args, kwargs):
            amp = kwargs.get("amp")
            x = args[0] if amp is None else args[0].to(amp)
            logits = router_logits(x.reshape(-1, x.shape[-1]), module.router.weight)
            chosen[i] = optimized_ops.moe_route(logits, module.top_k, scoring=module.scoring)[0].long().cpu()
        return hook

    def force(i, check):
        def hook(module, args):
            ids = chosen[i]
            if check:
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                logits = x @ module.router.weight.double().T
                scores = logits.softmax(-1) if module.scoring == "softmax" else logits.sigmoid()
                picked = scores.gather(1, ids).min(-1).values
                others = scores.scatter(1, ids, -math.inf).max(-1).values
                assert (picked >= others - tolerance).all(), f"layer {i}: our choice is no top-k of the float64 scores"
            module.forced_topk_ids = ids.to(args[0].device)
        return hook

    for i, (a, b, c) in enumerate(zip(ours.layers, twin.layers, twin64.layers)):
        handles.append(a.ffn.register_forward_pre_hook(capture(i), with_kwargs=True))
        handles.append(b.ffn.register_forward_pre_hook(force(i, False)))
        handles.append(c.ffn.register_forward_pre_hook(force(i, True)))
    return handles


def run_parity(cfg, dtype=torch.float32, device="cpu", roundings=1.0, seed=0, autocast=None):
    """The module docstring's comparison; returns the worst error / bound ratio. MoE: in float32 the routing
    must be clear (float64 top-k margins > 1e-4) and the three models must route alike on their own; with
    16-bit activations the references take our choice (route_like_ours); the bound is the MoE layer's own
    (check's n: the longest reduction, max(tokens, d_model, d_ff))."""
    ours, twin, twin64 = models(cfg, seed=seed, dtype=dtype, device=device)
    inputs, targets = batch(seed, device)
    sixteen = dtype != torch.float32 or autocast is not None
    act = dtype if autocast is None else autocast
    n = None if cfg.moe is None else max(B * S, cfg.d_model, cfg.expert_d_ff)
    if cfg.moe is not None:
        if sixteen:
            route_like_ours(ours, twin, twin64, tolerance=0.1)
        else:
            assert routing_margins(twin64, inputs.cpu()) > 1e-4, "test inputs: unclear routing (pick another seed)"
    ctx = (lambda: torch.autocast(device, dtype=autocast)) if autocast else (lambda: torch.autocast(device,
                                                                                                     enabled=False))
    ratios = []
    with torch.no_grad(), ctx():
        logits = [m(x) for m, x in ((ours, inputs), (twin, inputs), (twin64, inputs.cpu()))]
    assert logits[0].shape == (B, S, V)
    if cfg.moe is not None and not sixteen:  # the same experts: our per-expert counts, the references' choices
        for blk, blk_t, blk64 in zip(ours.layers, twin.layers, twin64.layers):
            assert torch.equal(blk_t.ffn.last_topk_ids.cpu(), blk64.ffn.last_topk_ids)
            counts = torch.bincount(blk64.ffn.last_topk_ids.reshape(-1), minlength=cfg.moe.num_experts)
            if cfg.moe.capacity_factor is None or not ours.training:
                assert blk.ffn.last_metrics.tokens_per_expert.cpu().tolist() == counts.tolist()
    ratios.append(check("logits", *logits, act, roundings, n))

    with ctx():
        losses = [m(x, t) for m, x, t in ((ours, inputs, targets), (twin, inputs, targets),
                                          (twin64, inputs.cpu(), targets.cpu()))]
    assert losses[0].dim() == 0
    if cfg.moe is not None:
        assert ours.last_aux_loss is not None and twin64.last_aux_loss is not None
        # (under autocast our router reads the 16-bit copy of its input that the experts read: moe_layer takes
        # one x; torch's reference routes from the float32 norm output)
        ratios.append(check("aux loss", ours.last_aux_loss, twin64.last_aux_loss, twin.last_aux_loss, act,
                            roundings, n))
        if cfg.moe.capacity_factor is not None:
            dropped = sum(int(blk.ffn.last_metrics.dropped) for blk in ours.layers)
            assert dropped > 0, "the capacity case drops no pair: not a test of dropping"
    ratios.append(check("loss", *losses, act, roundings, n))
    for loss in losses:
        loss.backward()

    params = [dict(m.named_parameters()) for m in (ours, twin, twin64)]
    assert list(params[0]) == list(params[1]) == list(params[2])
    for name in params[0]:
        grads = [p[name].grad for p in params]
        assert all(g is not None for g in grads), f"{name}: no gradient"
        assert grads[0].dtype == params[0][name].dtype
        ratios.append(check(f"d{name}", *grads, act, roundings, n))

    # one AdamW step. Its first update is lr * g / (|g| + eps): with the default eps (1e-8) that is lr * sign(g),
    # and a gradient element within rounding of zero flips its update (in torch's float32 as in ours), so that
    # the largest error says nothing of the step; eps = 1 (above every |g| here, <= 0.7) keeps the update close
    # to linear in g, which carries the gradients' rule over to the parameters.
    for m in (ours, twin, twin64):
        torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1.0, weight_decay=0.1).step()
    for name in params[0]:
        ratios.append(check(f"{name} after AdamW", *(p[name] for p in params), dtype, roundings, n))
    return max(ratios)


PARITY = {
    "rms-gqa-tied-dense": dict(),
    "layer-mha-untied-bias-dense": dict(norm="layer", n_kv_heads=4, tie_embeddings=False, bias=True),
    "rms-mqa-untied-moe-top2": dict(n_kv_heads=1, tie_embeddings=False, init_std=0.2,
                                    moe=MoEConfig(num_experts=5, top_k=2, d_ff=41)),
    "layer-gqa-tied-moe-top1-sigmoid-capacity": dict(norm="layer", init_std=0.2,
                                                     moe=MoEConfig(num_experts=4, top_k=1, scoring="sigmoid",
                                                                   capacity_factor=1.0)),
}


@pytest.mark.parametrize("case", PARITY)
def test_parity_cpu_float32(case):
    run_parity(config(**PARITY[case]))


@requires_cuda
@pytest.mark.parametrize("case", PARITY)
def test_parity_cuda_bfloat16(case):
    """The model in bf16 on CUDA (every op on its CUDA rung) against torch's bf16 on CUDA and float64; two
    roundings of the largest value (the fused LM head + loss round the logits' gradient once more)."""
    run_parity(config(**PARITY[case]), dtype=torch.bfloat16, device="cuda", roundings=2.0)


@pytest.mark.parametrize("case", ["rms-gqa-tied-dense", "rms-mqa-untied-moe-top2"])
def test_parity_cpu_bf16_autocast(case):
    """float32 parameters under torch.autocast(bfloat16): the optimized model casts its GEMMs', attention's and
    LM head's operands itself (the library's ops know no autocast) and keeps the norms and the residual stream
    in float32, as torch's autocast does for the reference; the parameters' gradients are float32."""
    run_parity(config(**PARITY[case]), autocast=torch.bfloat16, roundings=2.0)


@requires_cuda
def test_parity_cuda_bf16_autocast():
    run_parity(config(**PARITY["rms-mqa-untied-moe-top2"]), device="cuda", autocast=torch.bfloat16, roundings=2.0)


def test_float64_model_matches_the_float64_reference():
    """Every dense op has a CPU float64 path: the optimized model in float64 equals the reference to ~1e-13 in
    the forward and in every gradient (the norms keep float64 statistics for float64 inputs)."""
    cfg = config(norm="layer", bias=True, tie_embeddings=False)
    torch.manual_seed(3)
    ours = Transformer(cfg, dtype=torch.float64)
    torch.manual_seed(3)
    twin = Transformer(cfg, reference=True, dtype=torch.float64)
    inputs, targets = batch(3)
    torch.testing.assert_close(ours(inputs), twin(inputs), rtol=1e-12, atol=1e-12)
    a, b = ours(inputs, targets), twin(inputs, targets)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    a.backward()
    b.backward()
    for (name, p), q in zip(ours.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_moe_float64_is_refused_clearly():
    ours = Transformer(config(moe=MoEConfig(4, 2)), dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="MoE layers .* float64"):
        ours(batch()[0])


def test_positions_rotate_like_the_reference():
    """Explicit positions (per row, offset) reach RoPE as in the reference; arange(S) is the default."""
    ours, twin, _ = models(config())
    inputs, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(inputs, positions=torch.arange(S)), ours(inputs))
        pos = torch.arange(S)[None, :] + torch.tensor([[0], [5], [100]])
        got, want = ours(inputs, positions=pos), twin(inputs, positions=pos)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got[1], ours(inputs)[1]), "positions changed nothing"


def test_loss_is_mean_over_kept_targets():
    ours, _, _ = models(config())
    inputs, targets = batch()
    with torch.no_grad():
        logits = ours(inputs)
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100)
        torch.testing.assert_close(ours(inputs, targets), want, rtol=1e-5, atol=1e-6)
        assert torch.isnan(ours(inputs, torch.full_like(targets, -100)))


# ---- initialization and state_dict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=False, norm="layer", bias=True),
                                dict(moe=MoEConfig(num_experts=3, top_k=2))], ids=["dense", "untied", "moe"])
def test_seeded_init_identical_and_state_dict_both_ways(kw):
    cfg = config(init_std=0.02, **kw)
    torch.manual_seed(7)
    ours = Transformer(cfg)
    torch.manual_seed(7)
    twin = Transformer(cfg, reference=True)
    a, b = ours.state_dict(), twin.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
    # both ways, strict
    other = Transformer(cfg, reference=True)
    assert not torch.equal(other.tok_emb.weight, twin.tok_emb.weight)
    other.load_state_dict(ours.state_dict())
    ours2 = Transformer(cfg)
    ours2.load_state_dict(other.state_dict())
    for k, v in ours2.state_dict().items():
        assert torch.equal(v, a[k]), k


def test_init_is_gpt2():
    cfg = config(n_layers=8, d_model=128, d_ff=256, vocab_size=1000, tie_embeddings=False, norm="layer", bias=True,
                 init_std=0.02)
    torch.manual_seed(0)
    m = Transformer(cfg)
    resid = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name, p in m.named_parameters():
        if "norm" in name:
            assert torch.all(p == (1 if name.endswith("weight") else 0)), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
        else:
            want = resid if name.endswith(("attn.proj.weight", "ffn.w2.weight")) else 0.02
            assert p.std().item() == pytest.approx(want, rel=0.1), name
            assert abs(p.mean().item()) < 0.1 * want, name


def test_init_same_on_any_dtype_and_meta_has_no_memory():
    cfg = config()
    torch.manual_seed(1)
    a = Transformer(cfg)
    torch.manual_seed(1)
    b = Transformer(cfg, dtype=torch.float64)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.double(), q), name
    m = Transformer(cfg, device="meta")
    assert m.tok_emb.weight.is_meta and m.num_parameters() == a.num_parameters()


def test_tied_embedding_is_one_parameter():
    m = Transformer(config(tie_embeddings=True))
    assert m.lm_head_weight() is m.tok_emb.weight and not hasattr(m, "lm_head")
    untied = Transformer(config(tie_embeddings=False))
    assert untied.lm_head_weight() is untied.lm_head.weight
    assert untied.num_parameters() == m.num_parameters() + V * 64


def test_optimized_transformer_gpt2_small_shape():
    m = OptimizedTransformer(device="meta")
    c = m.config
    assert (c.d_model, c.n_heads, c.n_kv_heads, c.n_layers, c.vocab_size, c.max_seq_len, c.d_ff) == \
        (768, 12, 12, 12, 50257, 1024, 2048)
    assert isinstance(m, Transformer) and not m.reference
    assert m.num_parameters() == 50257 * 768 + 12 * (4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768) + 768
    small = OptimizedTransformer(64, 4, 2, 97, 32, n_kv_heads=2, norm="layer")
    assert small.config == config(norm="layer", d_ff=None, init_std=0.02)
    with pytest.raises(TypeError, match="nhead: not a TransformerConfig field"):
        OptimizedTransformer(nhead=12)
    assert OptimizedTransformer(64, 4, 1, 97, 32, reference=True).reference


# ---- config --------------------------------------------------------------------------------------------------------

def test_config_defaults():
    c = TransformerConfig()
    assert c.n_kv_heads == 12 and c.d_ff == swiglu_hidden_dim(768) == 2048 and c.head_dim == 64
    assert swiglu_hidden_dim(64) == 192 and swiglu_hidden_dim(4096) == 10944
    assert c.norm == "rms" and c.tie_embeddings and c.moe is None
    m = TransformerConfig(moe={"num_experts": 8, "top_k": 2})
    assert m.moe == MoEConfig(8, 2) and m.expert_d_ff == 2048 and m.moe.normalize_weights
    assert TransformerConfig(**m.to_dict()) == m and TransformerConfig.from_dict(m.to_dict()) == m
    assert MoEConfig(8, 1).normalize_weights is False


BAD_CONFIG = [
    (dict(d_model=0), "d_model"), (dict(d_model=100), "d_model: expected a multiple of n_heads"),
    (dict(d_model=36, n_heads=12), "d_model: expected an even head dim"), (dict(n_heads=1.5), "n_heads"),
    (dict(n_layers=0), "n_layers"), (dict(vocab_size=-1), "vocab_size"), (dict(max_seq_len=True), "max_seq_len"),
    (dict(n_kv_heads=5), "n_kv_heads: expected None or an int that divides n_heads = 12; given 5"),
    (dict(n_kv_heads=24), "n_kv_heads"), (dict(d_ff=0), "d_ff"), (dict(norm="batch"), "norm: .* given 'batch'"),
    (dict(norm_eps=-1e-5), "norm_eps"), (dict(rope_theta=0.0), "rope_theta"),
    (dict(rope_theta=float("inf")), "rope_theta"), (dict(tie_embeddings=1), "tie_embeddings"),
    (dict(bias="no"), "bias"), (dict(init_std=0), "init_std"),
]


@pytest.mark.parametrize("kw,match", BAD_CONFIG, ids=[m.split(":")[0] + "-" + str(i) for i, (_, m) in
                                                       enumerate(BAD_CONFIG)])
def test_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=f"TransformerConfig: {match}"):
        TransformerConfig(**kw)


BAD_MOE = [
    (dict(num_experts=0, top_k=1), "num_experts"), (dict(num_experts=2000, top_k=1), "num_experts"),
    (dict(num_experts=4, top_k=5), "top_k: expected an int 1 <= k <= min.* = 4; given 5"),
    (dict(num_experts=64, top_k=33), "top_k"), (dict(num_experts=4, top_k=2, d_ff=0), "d_ff"),
    (dict(num_experts=4, top_k=2, capacity_factor=0.0), "capacity_factor"),
    (dict(num_experts=4, top_k=2, scoring="relu"), "scoring"), (dict(num_experts=4, top_k=2, normalize=1), "normalize"),
    (dict(num_experts=4, top_k=2, aux_loss_coef=-1), "aux_loss_coef"),
    (dict(num_experts=4, top_k=2, z_loss_coef=float("nan")), "z_loss_coef"),
]


@pytest.mark.parametrize("kw,match", BAD_MOE, ids=[f"{m.split(':')[0]}-{i}" for i, (_, m) in enumerate(BAD_MOE)])
def test_moe_config_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=f"MoEConfig: {match}"):
        MoEConfig(**kw)


def test_config_moe_type_error():
    with pytest.raises(TypeError, match="TransformerConfig: moe: expected None, an optimized_ops.models.MoEConfig"):
        TransformerConfig(moe=8)


# ---- forward's argument errors -------------------------------------------------------------------------------------

def test_forward_argument_errors():
    m = Transformer(config())
    x, t = batch()
    with pytest.raises(ValueError, match="forward: tokens: expected an integer tensor"):
        m(x.float())
    with pytest.raises(ValueError, match="forward: tokens: expected an integer tensor"):
        m(x[0])
    with pytest.raises(ValueError, match="forward: tokens: expected at most max_seq_len = 32"):
        m(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="forward: targets: expected an integer tensor of tokens' shape"):
        m(x, t[:, :-1])
    with pytest.raises(ValueError, match="forward: positions: expected an integer tensor"):
        m(x, positions=torch.arange(S + 1))
    with pytest.raises(TypeError, match="config: expected an optimized_ops.models.TransformerConfig"):
        Transformer(dict(d_model=64))


def test_reference_rope_matches_the_library_rope():
    """The reference's float32 RoPE formula and optimized_ops.rope agree to float32 rounding (small angles)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 7, 4, 16, generator=g)
    pos = torch.arange(7)
    got = optimized_ops.rope(q, None, pos, theta=500.0)[0]
    torch.testing.assert_close(got, ref_math.rope(q, pos, 500.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref_math.rope(q.double(), pos, 500.0), optimized_ops.rope(q.double(), None, pos,
                                                                                         theta=500.0)[0])


def test_module_structure_uses_library_modules():
    m = Transformer(config(moe=MoEConfig(4, 2)))
    r = Transformer(config(moe=MoEConfig(4, 2)), reference=True)
    assert isinstance(m.layers[0].attn.qkv, optimized_ops.nn.Linear)
    assert isinstance(m.layers[0].attn_norm, optimized_ops.nn.RMSNorm)
    assert isinstance(m.layers[0].ffn, optimized_ops.nn.MoE)
    assert type(r.layers[0].attn.qkv) is torch.nn.Linear and type(r.layers[0].attn_norm) is torch.nn.RMSNorm
    assert not isinstance(r.layers[0].ffn, optimized_ops.nn.MoE)
    assert "optimized" in repr(m) and "reference" in repr(r)
    copy.deepcopy(m)  # modules stay plain torch modules


@pytest.mark.parametrize("reference,moe", [(False, None), (False, MoEConfig(4, 2)), (True, None)],
                         ids=["optimized-dense", "optimized-moe", "reference-dense"])
def test_meta_forward_gives_shapes(reference, moe):
    """A model on the meta device runs forward on meta tokens (shapes only: the ops' fake kernels), e.g. to count
    FLOPs or memory before allocating; the reference MoE finds its experts' tokens from data and cannot."""
    m = Transformer(config(moe=moe), reference=reference, device="meta")
    x = torch.zeros(B, S, dtype=torch.long, device="meta")
    assert m(x).shape == (B, S, V) and m(x, x).shape == ()
