"""Attention computed piecewise: ring attention's per-chunk forward, merge and backward (context
parallel, cp_impl=ring), the sliding window's mask, and attention without a fused kernel.

Ring attention (Liu et al. 2023) computes a rank's attention one K/V chunk at a time and merges the
partial results by their log-sum-exp (the online softmax of flash attention, Dao et al. 2022). The
backward is flash attention's: from the final output O, its row log-sum-exp L and dO, every chunk's
contribution is recomputed on its own (P = exp(S - L), dS = P * (dP - rowsum(dO * O))), so the
chunks can arrive in any order and nothing per chunk is kept from the forward. All in fp32.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def _finite(lse: Tensor) -> Tensor:
    """lse with -inf (rows a chunk hides completely) replaced by 0, so that exp(s - lse) is 0 there."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device))


def _expand_kv(t: Tensor, rep: int) -> Tensor:
    """(B, nkv, S, hd) -> (B, nkv*rep, S, hd): query head h reads kv head h // rep (SDPA's enable_gqa)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def attn_partial(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q (B, nh, T, hd) against one K/V chunk k, v (B, nkv, S, hd) under mask (T, S)
    (True: visible; None: all) -> o (B, nh, T, hd), normalised within the chunk, and the row
    log-sum-exp lse (B, nh, T) of the scaled scores (-inf, with o = 0, where the chunk is hidden)."""
    rep = q.shape[1] // k.shape[1]
    s = torch.matmul(q, _expand_kv(k, rep).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, _expand_kv(v, rep)), lse


def attn_merge(o: Tensor, lse: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial attentions over disjoint key sets: the attention over
    their union and its log-sum-exp (log(e^lse + e^lse2), computed stably)."""
    m = _finite(torch.maximum(lse, lse2))
    a, b = torch.exp(lse - m), torch.exp(lse2 - m)
    tot = a + b
    inv = torch.where(tot > 0, 1.0 / tot.clamp_min(1e-38), torch.zeros((), dtype=tot.dtype, device=tot.device))
    return o * (a * inv).unsqueeze(-1) + o2 * (b * inv).unsqueeze(-1), m + torch.log(tot)


def attn_partial_bwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, lse: Tensor,
                     do: Tensor, delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Flash-attention backward of one K/V chunk, given the final row log-sum-exp lse (B, nh, T), the
    output gradient do (B, nh, T, hd) and delta = rowsum(do * o) (B, nh, T) of the final output o.
    Returns this chunk's share of dq (B, nh, T, hd), and dk, dv (B, nkv, S, hd)."""
    B, nkv, S, hd = k.shape
    rep = q.shape[1] // nkv
    ke, ve = _expand_kv(k, rep), _expand_kv(v, rep)
    s = torch.matmul(q, ke.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - _finite(lse).unsqueeze(-1))  # (B, nh, T, S): the final softmax restricted to this chunk
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = p * (torch.matmul(do, ve.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    if rep > 1:  # sum the query heads that share a kv head
        dk, dv = dk.view(B, nkv, rep, S, hd).sum(2), dv.view(B, nkv, rep, S, hd).sum(2)
    return dq, dk, dv


def split_kv(kv: Tensor, qk: int) -> tuple[Tensor, Tensor]:
    """K and V (views) of the qkv block's `kv`: stacked, (2, B, nkv, S, hd); or under MLA, whose value
    heads are narrower than its key heads, side by side in one (1, B, nh, S, qk + v). Either way the
    sequence is dimension 3, where context parallelism gathers and the ring passes chunks."""
    if kv.shape[0] == 2:
        return kv[0], kv[1]
    return kv[0, ..., :qk], kv[0, ..., qk:]


def band_mask(qpos: Tensor, kpos: Tensor, window: int) -> Tensor:
    """Causal sliding-window mask (T, S): query at position i sees keys at i - window + 1 .. i."""
    d = qpos[:, None] - kpos[None, :]
    return (d >= 0) & (d < window)


def unfused_attention(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, kpos: Tensor, causal: bool,
                       band: Optional[Tensor] = None) -> Tensor:
    """Attention without a fused kernel (`flash_attention=0`, Megatron-LM 2021): Q.K^T over every
    score, scale and causal mask in place, softmax, then P.V; the backward keeps the softmax output P
    (B, nh, T, S) beside q, k and v. Query heads sharing a kv head broadcast against it (no copies).
    `band`: a sliding window's mask (`band_mask`) in place of the causal one.
    q (B, nh, T, hd), k, v (B, nkv, S, hd) -> (B, T, nh*hd)."""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    qg = q.view(B, nkv, nh // nkv, T, hd)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).mul_(1.0 / math.sqrt(hd))  # (B, nkv, rep, T, S)
    if band is not None:
        s = s.masked_fill_(band.logical_not(), float("-inf"))
    elif causal:
        s = s.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), v.unsqueeze(2))  # (B, nkv, rep, T, v's hd)
    return o.view(B, nh, T, -1).transpose(1, 2).reshape(B, T, -1)
