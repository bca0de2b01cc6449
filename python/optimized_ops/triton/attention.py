"""FlashAttention in Triton, forward and backward: ``out = softmax(scale * Q K^T) V`` per head, with
causal masking (aligned bottom-right, as flash-attn: query ``i`` sees keys ``j <= i + S_k - S_q``)
and GQA / MQA (query head ``h`` reads key/value head ``h // (H_q / H_kv)``). Layout (B, S, H, D), any
strides with a unit-stride last dimension.

Versions (one story per kernel):
1. forward (``_attn_fwd_kernel``): one program per ``(BLOCK_M query rows, batch * head)``; the Q tile
   stays in registers while ``BLOCK_N``-key tiles of K and V stream through: ``S = Q K^T`` on tensor
   cores, the online softmax (running max ``m``, running sum ``l``, the accumulator rescaled by
   ``exp(m_old - m_new)``), ``acc += P V`` -- S and P never leave the chip (FlashAttention-2's loop
   order). Causal programs stop at the last key block their rows can see. Writes out and the
   log-sum-exp ``lse = m + log(l)`` (float32; ``-inf`` and a zero row where no key is visible).
2. backward, FlashAttention-2's split without atomics, deterministic:
   ``_attn_bwd_delta_kernel``: ``delta_i = sum_d dO_id * O_id`` (float32);
   ``_attn_bwd_dkdv_kernel``: one program per (key block, batch * kv head) recomputes
   ``P^T = exp(S^T - lse)`` for every query block (of every query head of its GQA group) and
   accumulates ``dV += P^T dO`` and ``dK += scale * dS^T Q`` with ``dS = P * (dP - delta)``,
   ``dP = dO V^T``, in registers: dk and dv summed over the group with no atomics;
   ``_attn_bwd_dq_kernel``: one program per (query block, batch * head): ``dQ += scale * dS K``.
Products accumulate in float32; P and dS are rounded to the input dtype for the tensor-core products
(as flash-attn does). float32 inputs use ``input_precision="ieee"`` (no tf32).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _compat, interpreter  # noqa: F401  (_compat: the interpreter under NumPy >= 2.4)


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
                     sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                     H_Q, GROUP, S_Q, S_K, D, scale,
                     CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = bh % H_Q
    hk = (h // GROUP).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    rn = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    rd = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    d_ok = rd < D
    q = tl.load(q_ptr + b * sqb + h.to(tl.int64) * sqh + rm[:, None] * sqs + rd[None, :],
                mask=(rm[:, None] < S_Q) & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # (BLOCK_M, BLOCK_D)
    shift = S_K - S_Q  # causal: row i sees keys j <= i + shift
    hi = S_K
    if CAUSAL:
        hi = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + shift, 0), S_K)
    for n0 in range(0, hi, BLOCK_N):
        cols = n0 + rn
        kt = tl.load(k_base + cols[None, :] * sks + rd[:, None], mask=(cols[None, :] < S_K) & d_ok[:, None],
                     other=0.0)  # (BLOCK_D, BLOCK_N)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale  # (BLOCK_M, BLOCK_N)
        ok = cols[None, :] < S_K
        if CAUSAL:
            ok = ok & (cols[None, :] <= rm[:, None] + shift)
        s = tl.where(ok, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alive = m_new != -float("inf")
        m_safe = tl.where(alive, m_new, 0.0)
        p = tl.exp(s - m_safe[:, None])  # masked: exp(-inf) = 0
        alpha = tl.where(alive, tl.exp(m_i - m_safe), 1.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + cols[:, None] * svs + rd[None, :], mask=(cols[:, None] < S_K) & d_ok[None, :],
                    other=0.0)  # (BLOCK_N, BLOCK_D)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * sob + h.to(tl.int64) * soh + rm[:, None] * sos + rd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < S_Q) & d_ok[None, :])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), -float("inf"))
    tl.store(lse_ptr + bh.to(tl.int64) * S_Q + rm, lse, mask=rm < S_Q)


@triton.jit
def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, sob, sos, soh, sdb, sds, sdh, H_Q, S_Q, D,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    mask = (rm[:, None] < S_Q) & (rd[None, :] < D)
    o = tl.load(o_ptr + b * sob + h * soh + rm[:, None] * sos + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * sdb + h * sdh + rm[:, None] * sds + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh.to(tl.int64) * S_Q + rm, tl.sum(o * do, 1), mask=rm < S_Q)


@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                          sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
                          sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
                          H_Q, H_KV, GROUP, S_Q, S_K, D, scale,
                          CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // H_KV).to(tl.int64)
    hk = (bhk % H_KV).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows
    rm0 = tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < D
    kv_mask = (rn[:, None] < S_K) & d_ok[None, :]
    k = tl.load(k_ptr + b * skb + hk * skh + rn[:, None] * sks + rd[None, :], mask=kv_mask, other=0.0)  # (N, D)
    v = tl.load(v_ptr + b * svb + hk * svh + rn[:, None] * svs + rd[None, :], mask=kv_mask, other=0.0)  # (N, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    shift = S_K - S_Q
    lo = 0
    if CAUSAL:  # the first query row that sees this block's first key: i >= j - shift
        lo = tl.maximum(pid_n * BLOCK_N - shift, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):  # every query head of the GQA group, in order: dk, dv without atomics
        h = (hk * GROUP + g).to(tl.int64)
        q_base = q_ptr + b * sqb + h * sqh
        do_base = do_ptr + b * sdb + h * sdh
        row_base = (b * H_Q + h) * S_Q
        for m0 in range(lo, S_Q, BLOCK_M):
            rm = m0 + rm0
            q_ok = (rm[:, None] < S_Q) & d_ok[None, :]
            q = tl.load(q_base + rm[:, None] * sqs + rd[None, :], mask=q_ok, other=0.0)  # (M, D)
            do = tl.load(do_base + rm[:, None] * sds + rd[None, :], mask=q_ok, other=0.0)  # (M, D)
            lse = tl.load(lse_ptr + row_base + rm, mask=rm < S_Q, other=0.0)  # (M,)
            delta = tl.load(delta_ptr + row_base + rm, mask=rm < S_Q, other=0.0)  # (M,)
            if IEEE:
                st = tl.dot(k, tl.trans(q), input_precision="ieee") * scale  # (N, M): S^T
            else:
                st = tl.dot(k, tl.trans(q)) * scale
            ok = (rn[:, None] < S_K) & (rm[None, :] < S_Q) & (lse[None, :] != -float("inf"))
            if CAUSAL:
                ok = ok & (rn[:, None] <= rm[None, :] + shift)
            pt = tl.where(ok, tl.exp(st - tl.where(ok, lse[None, :], 0.0)), 0.0)  # (N, M): P^T
            if IEEE:
                dv += tl.dot(pt.to(do.dtype), do, input_precision="ieee")
                dpt = tl.dot(v, tl.trans(do), input_precision="ieee")  # (N, M): dP^T
            else:
                dv += tl.dot(pt.to(do.dtype), do)
                dpt = tl.dot(v, tl.trans(do))
            dst = pt * (dpt - delta[None, :])  # (N, M): dS^T
            if IEEE:
                dk += tl.dot(dst.to(q.dtype), q, input_precision="ieee")
            else:
                dk += tl.dot(dst.to(q.dtype), q)
    tl.store(dk_ptr + b * sdkb + hk * sdkh + rn[:, None] * sdks + rd[None, :], (dk * scale).to(dk_ptr.dtype.element_ty),
             mask=kv_mask)
    tl.store(dv_ptr + b * sdvb + hk * sdvh + rn[:, None] * sdvs + rd[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                        sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh, sdqb, sdqs, sdqh,
                        H_Q, GROUP, S_Q, S_K, D, scale,
                        CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H_Q).to(tl.int64)
    h = (bh % H_Q).to(tl.int64)
    hk = h // GROUP
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn0 = tl.arange(0, BLOCK_N)
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < D
    q_ok = (rm[:, None] < S_Q) & d_ok[None, :]
    q = tl.load(q_ptr + b * sqb + h * sqh + rm[:, None] * sqs + rd[None, :], mask=q_ok, other=0.0)  # (M, D)
    do = tl.load(do_ptr + b * sdb + h * sdh + rm[:, None] * sds + rd[None, :], mask=q_ok, other=0.0)  # (M, D)
    row_base = bh.to(tl.int64) * S_Q
    lse = tl.load(lse_ptr + row_base + rm, mask=rm < S_Q, other=0.0)
    delta = tl.load(delta_ptr + row_base + rm, mask=rm < S_Q, other=0.0)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    shift = S_K - S_Q
    hi = S_K
    if CAUSAL:
        hi = tl.minimum(tl.maximum((pid_m + 1) * BLOCK_M + shift, 0), S_K)
    for n0 in range(0, hi, BLOCK_N):
        rn = n0 + rn0
        kv_ok = (rn[:, None] < S_K) & d_ok[None, :]
        k = tl.load(k_base + rn[:, None] * sks + rd[None, :], mask=kv_ok, other=0.0)  # (N, D)
        v = tl.load(v_base + rn[:, None] * svs + rd[None, :], mask=kv_ok, other=0.0)  # (N, D)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (M, N)
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k)) * scale
            dp = tl.dot(do, tl.trans(v))
        ok = (rm[:, None] < S_Q) & (rn[None, :] < S_K) & (lse[:, None] != -float("inf"))
        if CAUSAL:
            ok = ok & (rn[None, :] <= rm[:, None] + shift)
        p = tl.where(ok, tl.exp(s - tl.where(ok, lse[:, None], 0.0)), 0.0)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + b * sdqb + h * sdqh + rm[:, None] * sdqs + rd[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=q_ok)


def _blocks(d: int, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, warps): small tiles in the interpreter (CPU tests), else per head dim."""
    block_d = max(16, triton.next_power_of_2(d))
    if interpreter():
        return 16, 16, block_d, 4
    if backward:
        return (64, 64, block_d, 8) if block_d <= 128 else (32, 32, block_d, 8)
    return (128, 64, block_d, 8) if block_d <= 128 else (64, 32, block_d, 8)


def _s(t):
    return t.stride(0), t.stride(1), t.stride(2)


def attention_fwd(q, k, v, scale: float, causal: bool):
    """q (B, S_q, H_q, D), k, v (B, S_k, H_kv, D), unit-stride last dimensions. Returns out (laid out
    as q), lse (B, H_q, S_q) float32."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        lse.fill_(-math.inf)
        return out, lse
    bm, bn, bd, warps = _blocks(d, False)
    grid = (triton.cdiv(s_q, bm), b * h_q)
    _attn_fwd_kernel[grid](q, k, v, out, lse, *_s(q), *_s(k), *_s(v), *_s(out), h_q, h_q // h_kv, s_q, s_k, d,
                           float(scale), CAUSAL=causal, IEEE=q.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
                           BLOCK_D=bd, num_warps=warps, num_stages=2)
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, scale: float, causal: bool):
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    bm, bn, bd, warps = _blocks(d, True)
    delta = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    _attn_bwd_delta_kernel[(triton.cdiv(s_q, bm), b * h_q)](out, dout, delta, *_s(out), *_s(dout), h_q, s_q, d,
                                                            BLOCK_M=bm, BLOCK_D=bd)
    ieee = q.dtype == torch.float32
    _attn_bwd_dkdv_kernel[(triton.cdiv(s_k, bn), b * h_kv)](
        q, k, v, dout, lse, delta, dk, dv, *_s(q), *_s(k), *_s(v), *_s(dout), *_s(dk), *_s(dv),
        h_q, h_kv, h_q // h_kv, s_q, s_k, d, float(scale), CAUSAL=causal, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_D=bd, num_warps=warps, num_stages=2)
    _attn_bwd_dq_kernel[(triton.cdiv(s_q, bm), b * h_q)](
        q, k, v, dout, lse, delta, dq, *_s(q), *_s(k), *_s(v), *_s(dout), *_s(dq),
        h_q, h_q // h_kv, s_q, s_k, d, float(scale), CAUSAL=causal, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_D=bd, num_warps=warps, num_stages=2)
    return dq, dk, dv
