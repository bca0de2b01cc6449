"""The paged KV cache from PyTorch (optimized_ops.PagedKVCache, append_kv, paged_attention_decode,
paged_attention_prefill; torch.ops.optimized.kv_cache_append / paged_attention_decode /
paged_attention_prefill / kv_cache_variants) against float64
references: decode over pages gathered into contiguous K/V per sequence (page sizes 1, 16, 256;
sequence lengths 0, 1, 17; GQA / MQA; q_len 1 and 4 with the causal rule inside the new tokens;
softcap, window, ALiBi; fp8 cache), append then decode against flash_attention over the contiguous
sequence, chunked prefill against flash_attention over the whole prompt, RoPE (neox, interleaved, partial) against a float64 rotation, padding positions, the error
paths, opcheck and torch.compile. CPU tests run the "cpu" variant; the CUDA tests (each CUDA variant against the float64
reference, append with RoPE, a torch.cuda graph of append + planned decode over growing steps) skip
with the reason without a device (run on the H100: bench/results/h100/logs/issue14/).

Tolerance: FlashAttention's rule (design.md): error(ours vs float64) <= 2 x error(torch math in the
same dtype vs float64) + rounding noise."""

from __future__ import annotations

import math

import pytest
import torch

import optimized_ops
from conftest import CUDA_REASON, rand, requires_cuda, unit_roundoff

ops = torch.ops.optimized
FP8 = torch.float8_e4m3fn


# ---- references ------------------------------------------------------------------------------------

def make_table(rng, batch: int, pages_per_seq: int, num_pages: int) -> torch.Tensor:
    """A page table whose rows own disjoint, scattered pages (a random permutation)."""
    perm = torch.randperm(num_pages, generator=rng)[: batch * pages_per_seq]
    return perm.reshape(batch, pages_per_seq).to(torch.int32)


def scatter(cache_pages: torch.Tensor, table: torch.Tensor, b: int, values: torch.Tensor) -> None:
    """Writes values (L, H, D) as tokens 0..L-1 of sequence b (the reference's own placement)."""
    page_size = cache_pages.shape[1]
    for t in range(values.shape[0]):
        cache_pages[int(table[b, t // page_size]), t % page_size] = values[t]


def decode_reference(q, kvs, seq_lens, *, scale=None, softcap=0.0, window_left=-1, alibi=None, dtype=torch.float64):
    """(out (B, q_len, H_q, D), lse (B, H_q, q_len)) of kv_cache.h's decode rule in `dtype`: q (B, q_len,
    H_q, D); kvs[b] = (K, V) of sequence b, (L_b, H_kv, D); query t of sequence b at position
    L_b - q_len + t sees keys j <= its position (and >= position - window_left)."""
    b_, q_len, h_q, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(q.shape, dtype=dtype)
    lse = torch.full((b_, h_q, q_len), -math.inf, dtype=dtype)
    for b in range(b_):
        k, v = kvs[b]
        n = int(seq_lens[b])
        if n == 0:
            continue
        group = h_q // k.shape[1]
        kh = k[:n].to(dtype).transpose(0, 1).repeat_interleave(group, 0)   # (H_q, L, D)
        vh = v[:n].to(dtype).transpose(0, 1).repeat_interleave(group, 0)
        qh = q[b].to(dtype).transpose(0, 1)                                # (H_q, q_len, D)
        s = (qh @ kh.transpose(-1, -2)) * scale                            # (H_q, q_len, L)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(q_len)[:, None] + n - q_len
        j = torch.arange(n)[None, :]
        if alibi is not None:
            slopes = (alibi[b] if alibi.dim() == 2 else alibi).to(dtype)[:, None, None]
            s = s - slopes * (pos - j).to(dtype)
        allowed = j <= pos
        if window_left >= 0:
            allowed &= j >= pos - window_left
        s = s.masked_fill(~allowed, -math.inf)
        l_ = torch.logsumexp(s, -1)
        seen = torch.isfinite(l_)[..., None]
        p = torch.where(seen, torch.exp(s - torch.where(seen, l_[..., None], torch.zeros_like(l_[..., None]))),
                        torch.zeros_like(s))
        out[b] = (p @ vh).transpose(0, 1)
        lse[b] = l_
    return out, lse


def _max_error(got, want) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    err = torch.where(same, torch.zeros_like(got), (got - want).abs())
    if torch.isnan(err).any():
        return math.inf
    return err.max().item() if err.numel() else 0.0


def check_rule(name, ours, ref64, ref_same, keys=1):
    err, base = _max_error(ours, ref64), _max_error(ref_same, ref64)
    finite = ref64[torch.isfinite(ref64)]
    mag = max(finite.abs().max().item() if finite.numel() else 0.0, 1.0)
    acc = 2.0**-53 if ours.dtype == torch.float64 else 2.0**-24
    noise = (4 * unit_roundoff(ours.dtype) + 8 * math.sqrt(max(keys, 1)) * acc) * mag
    assert err <= 2 * base + noise, f"{name}: error {err:.3g} > 2 x torch's {base:.3g} + noise {noise:.3g}"


def filled_cache(rng, *, batch, seq_lens, h_kv, d, page_size, dtype, spare_pages=3):
    """A cache with random K/V for each sequence written straight into its pages (not through
    append), the table and the per-sequence (K, V) in the cache's dtype."""
    pages_per_seq = max(1, -(-max(seq_lens) // page_size))
    num_pages = batch * pages_per_seq + spare_pages
    cache = optimized_ops.PagedKVCache(num_pages, page_size, h_kv, d, dtype=dtype, device="cpu")
    table = make_table(rng, batch, pages_per_seq, num_pages)
    kvs = []
    for b, n in enumerate(seq_lens):
        k, v = rand((n, h_kv, d), dtype, "cpu", rng), rand((n, h_kv, d), dtype, "cpu", rng)
        scatter(cache.k_pages, table, b, k)
        scatter(cache.v_pages, table, b, v)
        kvs.append((k, v))
    return cache, table, kvs


def run_decode_case(rng, *, seq_lens, q_len, h_q, h_kv, d, page_size, dtype, **options):
    batch = len(seq_lens)
    cache, table, kvs = filled_cache(rng, batch=batch, seq_lens=seq_lens, h_kv=h_kv, d=d, page_size=page_size,
                                     dtype=dtype)
    q = rand((batch, q_len, h_q, d), dtype, "cpu", rng)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    window = options.pop("window_left", -1)
    out, lse = optimized_ops.paged_attention_decode(q, cache, table, lens, window_size=(window, -1),
                                                    return_lse=True, variant="cpu", **options)
    ref_kw = dict(scale=options.get("softmax_scale"), softcap=options.get("softcap", 0.0), window_left=window,
                  alibi=options.get("alibi_slopes"))
    out64, lse64 = decode_reference(q, kvs, lens, **ref_kw)
    out_s, lse_s = decode_reference(q, kvs, lens, dtype=dtype, **ref_kw)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (batch, h_q, q_len)
    keys = max(seq_lens)
    check_rule("out", out, out64, out_s, keys)
    check_rule("lse", lse, lse64, lse_s.double() if dtype != torch.float64 else lse_s.float().double(), keys)
    return out, lse


# ---- decode against the reference ----------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (8, 2), (4, 1)])
def test_decode_one_token(rng, page_size, dtype, h_q, h_kv):
    out, lse = run_decode_case(rng, seq_lens=[0, 1, 17], q_len=1, h_q=h_q, h_kv=h_kv, d=16, page_size=page_size,
                               dtype=dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all(), "seq_len 0: out 0, lse -inf"


@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_speculative_q_len_4(rng, page_size, dtype):
    run_decode_case(rng, seq_lens=[4, 17, 5], q_len=4, h_q=8, h_kv=2, d=24, page_size=page_size, dtype=dtype)


@pytest.mark.parametrize("options", [
    dict(softcap=3.0),
    dict(window_left=5),
    dict(window_left=0),
    dict(softmax_scale=0.3),
    dict(alibi="heads"),
    dict(alibi="batch", softcap=2.0, window_left=7),
], ids=lambda o: "-".join(sorted(o)))
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_options(rng, options, q_len):
    options = dict(options)
    seq_lens, h_q = [17, 4, 9], 4
    if options.get("alibi") == "heads":
        options["alibi_slopes"] = torch.rand(h_q, generator=rng) + 0.1
    elif options.get("alibi") == "batch":
        options["alibi_slopes"] = torch.rand(len(seq_lens), h_q, generator=rng) + 0.1
    options.pop("alibi", None)
    run_decode_case(rng, seq_lens=seq_lens, q_len=q_len, h_q=h_q, h_kv=2, d=16, page_size=16,
                    dtype=torch.float32, **options)


def test_decode_three_dimensional_q(rng):
    cache, table, kvs = filled_cache(rng, batch=2, seq_lens=[3, 17], h_kv=2, d=8, page_size=4, dtype=torch.float32)
    q = rand((2, 4, 8), torch.float32, "cpu", rng)
    lens = torch.tensor([3, 17], dtype=torch.int64)  # int64 is converted
    out, lse = optimized_ops.paged_attention_decode(q, cache, table.long(), lens, return_lse=True, variant="cpu")
    assert out.shape == (2, 4, 8) and lse.shape == (2, 4)
    out4 = optimized_ops.paged_attention_decode(q[:, None], cache, table, lens.int(), variant="auto")
    torch.testing.assert_close(out, out4[:, 0], rtol=0, atol=0)


def test_decode_unvalidated_out_of_range_page_is_masked(rng):
    cache, table, kvs = filled_cache(rng, batch=1, seq_lens=[12], h_kv=1, d=8, page_size=4, dtype=torch.float64)
    bad = table.clone()
    bad[0, 1] = 1_000_000  # tokens 4..7 live on a page that does not exist
    q = rand((1, 1, 2, 8), torch.float64, "cpu", rng)
    lens = torch.tensor([12], dtype=torch.int32)
    out = optimized_ops.paged_attention_decode(q, cache, bad, lens, validate=False, variant="cpu")
    k, v = kvs[0]
    keep = torch.tensor([t < 4 or t >= 8 for t in range(12)])
    out64, _ = decode_reference(q, [(k[keep], v[keep])], torch.tensor([int(keep.sum())]))
    torch.testing.assert_close(out, out64, rtol=1e-12, atol=1e-12)


# ---- fp8 cache ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_append_and_decode(rng, dtype):
    h_kv, d, page_size, seq_lens = 2, 16, 16, [1, 17]
    k_scale = torch.tensor([0.5, 0.25])
    v_scale = torch.tensor([0.125, 1.0])
    cache = optimized_ops.PagedKVCache(5, page_size, h_kv, d, dtype=FP8, device="cpu", k_scale=k_scale,
                                       v_scale=v_scale)
    assert cache.k_scale.dtype == torch.float32 and cache.k_scale.shape == (h_kv,)
    table = make_table(rng, 2, 2, 5)
    s_new = max(seq_lens)
    k = rand((2, s_new, h_kv, d), dtype, "cpu", rng) * 4
    v = rand((2, s_new, h_kv, d), dtype, "cpu", rng) * 4
    positions = torch.arange(s_new, dtype=torch.int32).repeat(2, 1)
    positions[0, seq_lens[0]:] = -1  # padding
    optimized_ops.append_kv(cache, k, v, table, positions, variant="cpu")
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    gathered = cache.gather(table, lens, dtype=torch.float64)
    for b, n in enumerate(seq_lens):  # stored = fp8(x / scale), read back as fp8 * scale
        want_k = (k[b, :n].double() / k_scale.double()[:, None]).to(FP8).double() * k_scale.double()[:, None]
        want_v = (v[b, :n].double() / v_scale.double()[:, None]).to(FP8).double() * v_scale.double()[:, None]
        torch.testing.assert_close(gathered[b][0], want_k, rtol=0.07, atol=1e-3)
        torch.testing.assert_close(gathered[b][1], want_v, rtol=0.07, atol=1e-3)
    q = rand((2, 2, 4, d), dtype, "cpu", rng)
    q_len = 2
    lens_q = torch.tensor([max(n, q_len) for n in seq_lens], dtype=torch.int32)
    if seq_lens[0] < q_len:  # keep every sequence at least q_len long
        q = q[:, :1]
        q_len, lens_q = 1, lens
    out, lse = optimized_ops.paged_attention_decode(q, cache, table, lens_q, return_lse=True, variant="cpu")
    out64, lse64 = decode_reference(q, gathered, lens_q)
    torch.testing.assert_close(out.double(), out64, rtol=0, atol=8 * unit_roundoff(dtype) + 1e-5)
    torch.testing.assert_close(lse.double(), lse64, rtol=0, atol=1e-4)


def test_fp8_cache_default_scales_and_refusals():
    cache = optimized_ops.PagedKVCache(2, 4, 3, 8, dtype=FP8, device="cpu")
    assert torch.equal(cache.k_scale, torch.ones(3)) and torch.equal(cache.v_scale, torch.ones(3))
    with pytest.raises(ValueError, match="k_scale, v_scale: expected None"):
        optimized_ops.PagedKVCache(2, 4, 3, 8, dtype=torch.float32, k_scale=torch.ones(3))
    with pytest.raises(ValueError, match="page_size: expected 1 to 256"):
        optimized_ops.PagedKVCache(2, 257, 3, 8)


# ---- append then decode = attention over the concatenated sequence ------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("q_len", [1, 4])
def test_append_then_decode_equals_flash_attention(rng, page_size, q_len):
    batch, h_q, h_kv, d, prefix = 2, 4, 2, 16, 17
    total = prefix + q_len
    pages_per_seq = -(-total // page_size)
    cache = optimized_ops.PagedKVCache(batch * pages_per_seq + 1, page_size, h_kv, d, dtype=torch.float32)
    table = make_table(rng, batch, pages_per_seq, cache.num_pages)
    k = rand((batch, total, h_kv, d), torch.float32, "cpu", rng)
    v = rand((batch, total, h_kv, d), torch.float32, "cpu", rng)
    q = rand((batch, total, h_q, d), torch.float32, "cpu", rng)
    pos = torch.arange(total, dtype=torch.int32).repeat(batch, 1)
    # the prompt in one chunk, then the new tokens one append at a time
    optimized_ops.append_kv(cache, k[:, :prefix], v[:, :prefix], table, pos[:, :prefix], variant="cpu")
    for t in range(prefix, total):
        optimized_ops.append_kv(cache, k[:, t], v[:, t], table, pos[:, t], variant="cpu")
    lens = torch.full((batch,), total, dtype=torch.int32)
    out = optimized_ops.paged_attention_decode(q[:, prefix:], cache, table, lens, variant="cpu")
    want = optimized_ops.flash_attention(q, k, v, causal=True, variant="cpu")[:, prefix:]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _chunked_prefill(rng, device, dtype, variant, *, page_size, chunks, h_q=4, h_kv=2, d=64, validate=True):
    """A prompt appended and attended chunk by chunk (chunked prefill over the cache): each chunk's
    out equals flash_attention over the whole prompt (causal), at the chunk's rows."""
    batch, total = 2, sum(chunks)
    pages_per_seq = -(-total // page_size)
    cache = optimized_ops.PagedKVCache(batch * pages_per_seq + 1, page_size, h_kv, d, dtype=dtype, device=device)
    table = make_table(rng, batch, pages_per_seq, cache.num_pages).to(device)
    k = rand((batch, total, h_kv, d), dtype, "cpu", rng)
    v = rand((batch, total, h_kv, d), dtype, "cpu", rng)
    q = rand((batch, total, h_q, d), dtype, "cpu", rng)
    want = optimized_ops.flash_attention(q.double(), k.double(), v.double(), causal=True, variant="cpu")
    start = 0
    for n in chunks:
        pos = torch.arange(start, start + n, dtype=torch.int32).repeat(batch, 1).to(device)
        optimized_ops.append_kv(cache, k[:, start:start + n].to(device), v[:, start:start + n].to(device), table, pos,
                                variant=variant)
        lens = torch.full((batch,), start + n, dtype=torch.int32, device=device)
        out = optimized_ops.paged_attention_prefill(q[:, start:start + n].to(device), cache, table, lens,
                                                    variant=variant, validate=validate)
        assert out.shape == (batch, n, h_q, d) and out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 8 * unit_roundoff(dtype)
        torch.testing.assert_close(out.cpu().double(), want[:, start:start + n], rtol=tol, atol=tol)
        start += n


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("variant", ["cpu", "auto"])  # auto: chunks of >= 64 through attention_forward
@pytest.mark.parametrize("validate", [True, False])   # the gather: the longest sequence's rows, or the capacity
def test_chunked_prefill_equals_flash_attention(rng, page_size, variant, validate):
    _chunked_prefill(rng, "cpu", torch.float32, variant, page_size=page_size, chunks=[17, 70, 1, 9, 100],
                     validate=validate)


def test_prefill_right_aligns_short_sequences(rng):
    """S_new = 12 over sequences of 30, 12, 5 and 0 tokens: rows before a sequence's start see no key
    (out 0, lse -inf); the rest is decode's rule, as the float64 reference says."""
    seq_lens, s_new, h_q, h_kv, d = [30, 12, 5, 0], 12, 4, 2, 16
    cache, table, kvs = filled_cache(rng, batch=4, seq_lens=seq_lens, h_kv=h_kv, d=d, page_size=4,
                                     dtype=torch.float32)
    q = rand((4, s_new, h_q, d), torch.float32, "cpu", rng)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out, lse = optimized_ops.paged_attention_prefill(q, cache, table, lens, return_lse=True, variant="cpu")
    out64, lse64 = decode_reference(q, kvs, lens)
    out_s, lse_s = decode_reference(q, kvs, lens, dtype=torch.float32)
    check_rule("out", out, out64, out_s, max(seq_lens))
    check_rule("lse", lse, lse64, lse_s.double(), max(seq_lens))
    assert (out[2, :7] == 0).all() and torch.isneginf(lse[2, :, :7]).all()
    assert (out[3] == 0).all() and torch.isneginf(lse[3]).all()


def test_prefill_without_pages(rng):
    """A page table of no pages (auto, a chunk of 64: the gather path would have no key row): out 0,
    lse -inf."""
    cache = optimized_ops.PagedKVCache(4, 16, 2, 16, dtype=torch.float32)
    q = rand((2, 64, 4, 16), torch.float32, "cpu", rng)
    out, lse = optimized_ops.paged_attention_prefill(q, cache, torch.zeros(2, 0, dtype=torch.int32),
                                                     torch.zeros(2, dtype=torch.int32), return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_prefill_compiles(rng):
    cache, table, _ = filled_cache(rng, batch=2, seq_lens=[20, 11], h_kv=2, d=16, page_size=4, dtype=torch.float32)
    q = rand((2, 11, 4, 16), torch.float32, "cpu", rng)
    lens = torch.tensor([20, 11], dtype=torch.int32)
    torch.library.opcheck(ops.paged_attention_prefill.default,
                          (q, cache.k_pages, cache.v_pages, table, lens), {"variant": "cpu"})
    f = torch.compile(lambda q_: optimized_ops.paged_attention_prefill(q_, cache, table, lens, variant="cpu"),
                      fullgraph=True)
    torch.testing.assert_close(f(q), optimized_ops.paged_attention_prefill(q, cache, table, lens, variant="cpu"))


def test_append_skips_padding_positions(rng):
    cache = optimized_ops.PagedKVCache(4, 2, 1, 4, dtype=torch.float32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    k = rand((2, 3, 1, 4), torch.float32, "cpu", rng)
    pos = torch.tensor([[0, 1, -1], [-1, 2, 3]], dtype=torch.int32)
    optimized_ops.append_kv(cache, k, k, table, pos, variant="cpu")
    torch.testing.assert_close(cache.k_pages[0, 0], k[0, 0])
    torch.testing.assert_close(cache.k_pages[0, 1], k[0, 1])
    assert (cache.k_pages[1] == 0).all() and (cache.k_pages[2] == 0).all(), "padding wrote a slot"
    torch.testing.assert_close(cache.k_pages[3, 0], k[1, 1])
    torch.testing.assert_close(cache.k_pages[3, 1], k[1, 2])


# ---- RoPE ------------------------------------------------------------------------------------------------

def rope_reference(x, positions, layout, theta, rotary_dim):
    """x (B, S, H, D) rotated in float64 at positions (B, S) (< 0 left as is)."""
    x = x.double().clone()
    r = rotary_dim
    half = r // 2
    inv = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / r)        # (half,)
    ang = positions.double()[..., None] * inv                                   # (B, S, half)
    cos, sin = torch.cos(ang)[:, :, None, :], torch.sin(ang)[:, :, None, :]
    if layout == "neox":
        a, b = x[..., :half].clone(), x[..., half:r].clone()
        x[..., :half], x[..., half:r] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:r:2].clone(), x[..., 1:r:2].clone()
        x[..., 0:r:2], x[..., 1:r:2] = a * cos - b * sin, a * sin + b * cos
    return x


@pytest.mark.parametrize("layout", ["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_append(rng, layout, rotary_dim, dtype):
    batch, s_new, h_q, h_kv, d, page_size, theta = 2, 5, 4, 2, 16, 4, 500.0
    cache = optimized_ops.PagedKVCache(8, page_size, h_kv, d, dtype=dtype)
    table = make_table(rng, batch, 4, 8)
    k = rand((batch, s_new, h_kv, d), dtype, "cpu", rng)
    v = rand((batch, s_new, h_kv, d), dtype, "cpu", rng)
    q = rand((batch, s_new, h_q, d), dtype, "cpu", rng)
    q0 = q.clone()
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 9, 10, 11, 15]], dtype=torch.int32)
    got_q = optimized_ops.append_kv(cache, k, v, table, pos, q=q, rope=layout, rope_theta=theta,
                                    rotary_dim=rotary_dim, variant="cpu")
    assert got_q is q, "q is rotated in place and returned"
    r = rotary_dim or d
    want_q = rope_reference(q0, pos, layout, theta, r)
    want_k = rope_reference(k, pos, layout, theta, r)
    tol = dict(rtol=0, atol=4 * unit_roundoff(dtype) * 2 + 1e-6)
    torch.testing.assert_close(q.double(), want_q, **tol)
    for b in range(batch):
        for s in range(s_new):
            p = int(pos[b, s])
            page, slot = int(table[b, p // page_size]), p % page_size
            torch.testing.assert_close(cache.k_pages[page, slot].double(), want_k[b, s], **tol)
            torch.testing.assert_close(cache.v_pages[page, slot], v[b, s], rtol=0, atol=0)  # v is not rotated


def test_append_without_rope_leaves_q_alone(rng):
    cache = optimized_ops.PagedKVCache(2, 4, 1, 8, dtype=torch.float32)
    q = rand((1, 1, 2, 8), torch.float32, "cpu", rng)
    q0 = q.clone()
    k = rand((1, 1, 1, 8), torch.float32, "cpu", rng)
    out = optimized_ops.append_kv(cache, k, k, torch.tensor([[1]], dtype=torch.int32),
                                  torch.tensor([[2]], dtype=torch.int32), q=q)
    assert out is q and torch.equal(q, q0)
    torch.testing.assert_close(cache.k_pages[1, 2], k[0, 0])


# ---- errors --------------------------------------------------------------------------------------------------

def _small(rng, dtype=torch.float32):
    cache = optimized_ops.PagedKVCache(4, 4, 2, 8, dtype=dtype)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    k = rand((2, 1, 2, 8), dtype, "cpu", rng)
    q = rand((2, 1, 4, 8), dtype, "cpu", rng)
    return cache, table, k, q


def test_errors_page_table_validated(rng):
    cache, table, k, q = _small(rng)
    pos = torch.tensor([[0], [5]], dtype=torch.int32)
    bad = table.clone()
    bad[1, 1] = 4  # == num_pages
    with pytest.raises(ValueError, match="optimized::kv_cache_append: .*page_table"):
        optimized_ops.append_kv(cache, k, k, bad, pos)
    bad[1, 1] = -1
    with pytest.raises(ValueError, match="optimized::kv_cache_append: .*page_table"):
        optimized_ops.append_kv(cache, k, k, bad, pos)
    with pytest.raises(ValueError, match="optimized::kv_cache_append: .*position"):
        optimized_ops.append_kv(cache, k, k, table, torch.tensor([[0], [8]], dtype=torch.int32))
    lens = torch.tensor([1, 6], dtype=torch.int32)
    bad[1, 1] = 9
    with pytest.raises(ValueError, match="optimized::paged_attention_decode: .*page_table"):
        optimized_ops.paged_attention_decode(q, cache, bad, lens)
    with pytest.raises(ValueError, match="optimized::paged_attention_decode: .*seq_lens"):
        optimized_ops.paged_attention_decode(q, cache, table, torch.tensor([1, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="optimized::paged_attention_decode: .*seq_lens"):
        optimized_ops.paged_attention_decode(q, cache, table, torch.tensor([1, -1], dtype=torch.int32))


def test_errors_shapes_and_arguments(rng):
    cache, table, k, q = _small(rng)
    pos = torch.tensor([[0], [1]], dtype=torch.int32)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="optimized::kv_cache_append: k"):
        optimized_ops.append_kv(cache, k[:, :, :1], k[:, :, :1], table, pos)       # H_kv 1 != the cache's 2
    with pytest.raises(ValueError, match="optimized::paged_attention_decode: q"):
        optimized_ops.paged_attention_decode(q[..., :4], cache, table, lens)       # D 4 != 8
    with pytest.raises(ValueError, match="optimized::paged_attention_decode: q: expected 4 dimensions"):
        ops.paged_attention_decode(q[0, 0], cache.k_pages, cache.v_pages, table, lens)
    with pytest.raises(ValueError, match="window_size: only the left side"):
        optimized_ops.paged_attention_decode(q, cache, table, lens, window_size=(4, 2))
    with pytest.raises(ValueError, match="optimized::kv_cache_append: rope: expected one of none, neox, interleaved"):
        ops.kv_cache_append(cache.k_pages, cache.v_pages, k, k, table, pos, rope="gptj")
    with pytest.raises(ValueError, match="rope: expected None, 'neox' or 'interleaved'"):
        optimized_ops.append_kv(cache, k, k, table, pos, rope="gptj")
    with pytest.raises(ValueError, match="variant"):
        optimized_ops.paged_attention_decode(q, cache, table, lens, variant="fastest")
    with pytest.raises(TypeError, match="cache: expected an optimized_ops.PagedKVCache"):
        optimized_ops.paged_attention_decode(q, (cache.k_pages, cache.v_pages), table, lens)
    fp8 = optimized_ops.PagedKVCache(4, 4, 2, 8, dtype=FP8)
    with pytest.raises(ValueError, match="scale"):  # fp8 pages without their scales
        ops.paged_attention_decode(q, fp8.k_pages, fp8.v_pages, table, lens)


def test_no_autograd(rng):
    cache, table, k, q = _small(rng)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only"):
        optimized_ops.paged_attention_decode(q, cache, table, lens)
    with torch.no_grad():
        out = optimized_ops.paged_attention_decode(q, cache, table, lens)
    assert not out.requires_grad
    out = optimized_ops.paged_attention_decode(q.detach(), cache, table, lens)
    assert not out.requires_grad


def test_variants():
    ladder = ["cpu", "contiguous_naive", "paged", "paged_split", "paged_mma"]
    assert optimized_ops.variants("kv_cache") == ladder
    assert optimized_ops.kv_cache_variants() == ladder
    assert list(ops.kv_cache_variants()) == ladder


# ---- torch.library: opcheck, compile --------------------------------------------------------------------------

def test_opcheck(rng):
    cache, table, k, q = _small(rng)
    pos = torch.tensor([[0], [5]], dtype=torch.int32)
    torch.library.opcheck(ops.kv_cache_append.default, (cache.k_pages, cache.v_pages, k, k, table, pos),
                          dict(variant="cpu"))
    q_app = rand((2, 1, 4, 8), torch.float32, "cpu", rng)
    torch.library.opcheck(ops.kv_cache_append.default, (cache.k_pages, cache.v_pages, k, k, table, pos),
                          dict(q=q_app, rope="neox", rotary_dim=4))
    lens = torch.tensor([1, 6], dtype=torch.int32)
    torch.library.opcheck(ops.paged_attention_decode.default, (q, cache.k_pages, cache.v_pages, table, lens),
                          dict(softcap=2.0, window_left=3, variant="cpu"))
    # fp8 pages: torch's schema check compares mutated tensors with arithmetic float8 lacks on the CPU
    # ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'), so it is left out for them.
    fp8 = optimized_ops.PagedKVCache(4, 4, 2, 8, dtype=FP8)
    no_schema = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.kv_cache_append.default, (fp8.k_pages, fp8.v_pages, k, k, table, pos),
                          dict(k_scale=fp8.k_scale, v_scale=fp8.v_scale), test_utils=no_schema)
    torch.library.opcheck(ops.paged_attention_decode.default, (q, fp8.k_pages, fp8.v_pages, table, lens),
                          dict(k_scale=fp8.k_scale, v_scale=fp8.v_scale, alibi_slopes=torch.rand(4)),
                          test_utils=no_schema)


def _decode_step(q, k, v, k_pages, v_pages, table, positions, lens):
    """One decode step as a model runs it: rotate q and k, append k, v, attend over the cache."""
    ops.kv_cache_append(k_pages, v_pages, k, v, table, positions, q=q, rope="neox")
    out, _ = ops.paged_attention_decode(q, k_pages, v_pages, table, lens)
    return out * 2


def test_torch_compile_decode_step(rng):
    torch._dynamo.reset()
    cache, table, _, _ = _small(rng)
    ref_cache, _, _, _ = _small(rng)
    compiled = torch.compile(_decode_step, fullgraph=True, backend="aot_eager")
    for step in range(3):
        k = rand((2, 1, 2, 8), torch.float32, "cpu", rng)
        v = rand((2, 1, 2, 8), torch.float32, "cpu", rng)
        q = rand((2, 1, 4, 8), torch.float32, "cpu", rng)
        positions = torch.tensor([[step], [step + 2]], dtype=torch.int32)
        lens = positions[:, 0] + 1
        q_ref = q.clone()
        got = compiled(q, k, v, cache.k_pages, cache.v_pages, table, positions, lens)
        want = _decode_step(q_ref, k, v, ref_cache.k_pages, ref_cache.v_pages, table, positions, lens)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(q, q_ref, rtol=0, atol=0)  # q rotated in place in the compiled graph too
        torch.testing.assert_close(cache.k_pages, ref_cache.k_pages, rtol=0, atol=0)


def test_torch_compile_python_api(rng):
    torch._dynamo.reset()
    cache, table, k, q = _small(rng)
    lens = torch.tensor([1, 2], dtype=torch.int32)

    def step(q, k, positions):
        q = optimized_ops.append_kv(cache, k, k, table, positions, q=q, rope="interleaved")
        return optimized_ops.paged_attention_decode(q, cache, table, lens, softcap=5.0)

    q2 = q.clone()
    pos = torch.tensor([[0], [1]], dtype=torch.int32)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, pos)
    want = optimized_ops.paged_attention_decode(q, cache, table, lens, softcap=5.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(q, q2), "the compiled append rotated q in place"


# ---- CUDA --------------------------------------------------------------------------------------------------------

CUDA_VARIANTS = ["contiguous_naive", "paged", "paged_split", "paged_mma", "auto"]


def _to_cuda(cache):
    cc = optimized_ops.PagedKVCache(cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim,
                                    dtype=cache.dtype, device="cuda")
    cc.k_pages.copy_(cache.k_pages)
    cc.v_pages.copy_(cache.v_pages)
    return cc


@requires_cuda
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
@pytest.mark.parametrize("page_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_len,h_q,h_kv", [(1, 8, 2), (4, 4, 1), (3, 4, 4)])
def test_cuda_decode_against_reference(rng, variant, page_size, dtype, q_len, h_q, h_kv):
    seq_lens = [0, 17, 300]
    batch, d = len(seq_lens), 64
    cache, table, kvs = filled_cache(rng, batch=batch, seq_lens=seq_lens, h_kv=h_kv, d=d, page_size=page_size,
                                     dtype=dtype)
    q = rand((batch, q_len, h_q, d), dtype, "cpu", rng)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    slopes = torch.rand(h_q, generator=rng) * 0.3
    if variant == "paged_mma" and dtype == torch.float32:  # tensor cores: 16-bit q only
        with pytest.raises(NotImplementedError, match=variant):
            optimized_ops.paged_attention_decode(q.cuda(), _to_cuda(cache), table.cuda(), lens.cuda(), variant=variant)
        return
    for options in [dict(), dict(softcap=5.0, window_left=20, alibi_slopes=slopes)]:
        window = options.pop("window_left", -1) if "window_left" in options else -1
        alibi = options.get("alibi_slopes")
        kw = dict(options, alibi_slopes=alibi.cuda() if alibi is not None else None)
        out, lse = optimized_ops.paged_attention_decode(q.cuda(), _to_cuda(cache), table.cuda(), lens.cuda(),
                                                        window_size=(window, -1), return_lse=True, variant=variant,
                                                        **kw)
        assert out.is_cuda and out.dtype == dtype and out.shape == q.shape
        ref_kw = dict(softcap=options.get("softcap", 0.0), window_left=window, alibi=alibi)
        out64, lse64 = decode_reference(q, kvs, lens, **ref_kw)
        out_s, lse_s = decode_reference(q, kvs, lens, dtype=dtype, **ref_kw)
        check_rule("out", out.cpu(), out64, out_s, max(seq_lens))
        check_rule("lse", lse.cpu(), lse64, lse_s.double(), max(seq_lens))


@requires_cuda
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_cuda_append_rope(rng, variant, layout):
    batch, s_new, h_q, h_kv, d, page_size, theta, rd = 2, 5, 4, 2, 64, 4, 500.0, 32
    dtype = torch.bfloat16
    cache = optimized_ops.PagedKVCache(8, page_size, h_kv, d, dtype=dtype, device="cuda")
    table = make_table(rng, batch, 4, 8)
    k = rand((batch, s_new, h_kv, d), dtype, "cpu", rng)
    v = rand((batch, s_new, h_kv, d), dtype, "cpu", rng)
    q = rand((batch, s_new, h_q, d), dtype, "cpu", rng)
    pos = torch.tensor([[3, 4, 5, 6, 7], [0, 9, 10, 11, 15]], dtype=torch.int32)
    qc = q.cuda()
    optimized_ops.append_kv(cache, k.cuda(), v.cuda(), table.cuda(), pos.cuda(), q=qc, rope=layout, rope_theta=theta,
                            rotary_dim=rd, variant=variant)
    tol = dict(rtol=0, atol=8 * unit_roundoff(dtype) + 1e-6)
    torch.testing.assert_close(qc.cpu().double(), rope_reference(q, pos, layout, theta, rd), **tol)
    want_k = rope_reference(k, pos, layout, theta, rd)
    kp, vp = cache.k_pages.cpu(), cache.v_pages.cpu()
    for b in range(batch):
        for s in range(s_new):
            p = int(pos[b, s])
            page, slot = int(table[b, p // page_size]), p % page_size
            torch.testing.assert_close(kp[page, slot].double(), want_k[b, s], **tol)
            torch.testing.assert_close(vp[page, slot], v[b, s], rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
def test_cuda_graph_append_and_decode_growing(rng, variant):
    """append + planned decode (validate=False) captured once in a torch.cuda.CUDAGraph, replayed over
    growing steps with positions / seq_lens updated in place between replays: each replay equals an
    eager run on a twin cache bitwise, and the float64 reference at a few steps."""
    batch, h_q, h_kv, d, page_size, steps, dtype = 2, 8, 2, 64, 16, 40, torch.float16
    start = [50, 300]
    pages_per_seq = -(-(max(start) + steps) // page_size)
    num_pages = batch * pages_per_seq + 3
    table = make_table(rng, batch, pages_per_seq, num_pages).cuda()
    caches = [optimized_ops.PagedKVCache(num_pages, page_size, h_kv, d, dtype=dtype, device="cuda") for _ in range(2)]
    init_k = rand((num_pages, page_size, h_kv, d), dtype, "cpu", rng)
    init_v = rand((num_pages, page_size, h_kv, d), dtype, "cpu", rng)
    for c in caches:
        c.k_pages.copy_(init_k)
        c.v_pages.copy_(init_v)
    plan = optimized_ops.plan_paged_decode(batch, h_q, h_kv, d, page_size=page_size, max_seq_len=max(start) + steps,
                                           dtype=dtype, device="cuda", variant=variant)
    assert plan.variant != "auto"

    def inputs():
        return dict(k=torch.zeros(batch, 1, h_kv, d, dtype=dtype, device="cuda"),
                    v=torch.zeros(batch, 1, h_kv, d, dtype=dtype, device="cuda"),
                    q=torch.zeros(batch, 1, h_q, d, dtype=dtype, device="cuda"),
                    pos=torch.zeros(batch, 1, dtype=torch.int32, device="cuda"),
                    lens=torch.ones(batch, dtype=torch.int32, device="cuda"))

    def step(cache, x):
        optimized_ops.append_kv(cache, x["k"], x["v"], table, x["pos"], q=x["q"], rope="neox", validate=False,
                                variant=plan.variant)
        return optimized_ops.paged_attention_decode(x["q"], cache, table, x["lens"], return_lse=True,
                                                    validate=False, plan=plan)

    g_in, e_in = inputs(), inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream (torch's rule before capture); writes nothing
        g_in["pos"].fill_(-1)      # padding: the warm-up append is skipped
        step(caches[0], g_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = step(caches[0], g_in)
    for i in range(steps):
        k, v = rand((batch, 1, h_kv, d), dtype, "cpu", rng), rand((batch, 1, h_kv, d), dtype, "cpu", rng)
        q = rand((batch, 1, h_q, d), dtype, "cpu", rng)
        pos = torch.tensor([[s + i] for s in start], dtype=torch.int32)
        lens = pos[:, 0] + 1
        for x in (g_in, e_in):
            x["k"].copy_(k), x["v"].copy_(v), x["q"].copy_(q), x["pos"].copy_(pos), x["lens"].copy_(lens)
        graph.replay()
        e_out, e_lse = step(caches[1], e_in)
        assert torch.equal(g_out, e_out), f"step {i}: out: graph != eager"
        assert torch.equal(g_lse, e_lse), f"step {i}: lse: graph != eager"
        if i in (0, steps // 2, steps - 1):
            kp, vp = caches[1].k_pages.cpu(), caches[1].v_pages.cpu()
            kvs = []
            for b in range(batch):
                n = int(lens[b])
                idx = [(int(table[b, t // page_size]), t % page_size) for t in range(n)]
                kvs.append((torch.stack([kp[p, s] for p, s in idx]), torch.stack([vp[p, s] for p, s in idx])))
            q_rot = e_in["q"].cpu()
            out64, lse64 = decode_reference(q_rot, kvs, lens)
            out_s, _ = decode_reference(q_rot, kvs, lens, dtype=dtype)
            check_rule("out", g_out.cpu(), out64, out_s, max(int(n) for n in lens))


@requires_cuda
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
def test_cuda_chunked_prefill_equals_flash_attention(rng, variant):
    _chunked_prefill(rng, "cuda", torch.bfloat16, variant, page_size=16, chunks=[100, 37, 1, 200])


@requires_cuda
def test_cuda_plan_refuses_another_shape(rng):
    plan = optimized_ops.plan_paged_decode(2, 4, 2, 64, page_size=16, max_seq_len=100, dtype=torch.float16)
    assert plan.workspace_bytes >= 0 and plan.splits >= 1
    cache = optimized_ops.PagedKVCache(8, 16, 2, 64, dtype=torch.float16, device="cuda")
    q = torch.zeros(3, 1, 4, 64, dtype=torch.float16, device="cuda")
    table = torch.zeros(3, 2, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="plan: expected batch 2"):
        optimized_ops.paged_attention_decode(q, cache, table, torch.ones(3, dtype=torch.int32, device="cuda"),
                                             plan=plan)


def test_plan_on_cpu():
    plan = optimized_ops.plan_paged_decode(2, 4, 2, 16, page_size=4, max_seq_len=10, dtype=torch.float32,
                                           device="cpu")
    assert (plan.variant, plan.splits, plan.workspace_bytes) == ("cpu", 1, 0)
