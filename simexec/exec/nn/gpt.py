"""The executor's GPT, cut into the sub-blocks of docs/program.md and sharded for one rank.

Reading order, nanoGPT's: small helpers, the MoE routing, then the blocks in forward order, then
`forward`, which chains the blocks of an unsharded model (the single-process reference). Tensors are
(B, T, C): batch, time, channels. Which parameters a rank holds, and which slice of each, is
`simexec.exec.nn.param_layout`'s.

Tensor parallelism is Megatron's (Shoeybi et al. 2019). A block never communicates: row-parallel
blocks return *partial sums* that the next collective instruction (`attn_out`, `mlp_out`,
`embed_out`) adds up. For that sum to come out right, anything a row-parallel block adds that is not
itself partial (the residual, the bias, the position embedding) is added by each tensor-parallel rank
on its own 1/tp slice of the hidden dimension only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from simexec.exec.nn.attention import band_mask, split_kv, unfused_attention
from simexec.exec.nn.ops import GatheredLinear, SwiGLU, VocabParallelXent, rms_norm, rope, rope_tables
from simexec.exec.nn.param_layout import Layout, local_experts, split_range
from simexec.specs.model import ModelSpec


# ---------------------------------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------------------------------


def add_slice(y: Tensor, t: Tensor, lo: int) -> Tensor:
    """y + t placed at [lo, lo + t.shape[-1]) of the last dimension (zeros elsewhere)."""
    if t.shape[-1] == y.shape[-1]:  # no tensor parallelism: nothing to pad
        return y + t
    return y + F.pad(t, (lo, y.shape[-1] - lo - t.shape[-1]))


def add_seq_slice(y: Tensor, t: Tensor, lo: int) -> Tensor:
    """y (B, T, C) + t (B, Ts, C) placed at [lo, lo + Ts) of the sequence (zeros elsewhere)."""
    if t.shape[1] == y.shape[1]:
        return y + t
    return y + F.pad(t, (0, 0, lo, y.shape[1] - lo - t.shape[1]))


# ---------------------------------------------------------------------------------------------------
# MoE routing
# ---------------------------------------------------------------------------------------------------


@dataclass
class Route:
    """A MoE layer's routing of its N tokens (no gradients): where each assignment sits in the rows
    sent to the experts, and how many rows each expert gets."""

    rows: Tensor  # (N*k,) row of each assignment (token*k + slot) in the expert-sorted list; -1: dropped
    counts: Tensor  # (E,) rows per expert (under a capacity factor, the padded capacity)
    experts: Optional[Tensor] = None  # (N, k) expert of each assignment, -1 where dropped


def group_limited_topk(probs: Tensor, top_k: int, groups: int = 1, group_topk: int = 1) -> tuple[Tensor, Tensor]:
    """The top_k experts of each token (row of `probs`), under group-limited routing taken only from its
    `group_topk` groups with the largest sum of their top (top_k / group_topk) scores, as Megatron-Core's
    group_limited_topk does (megatron/core/transformer/moe/moe_utils.py); groups = 1: a plain top-k."""
    if groups <= 1:
        return probs.topk(top_k, dim=-1)
    n, e = probs.shape
    by_group = probs.view(n, groups, e // groups)
    group_scores = by_group.topk(top_k // group_topk, dim=-1)[0].sum(dim=-1)  # (N, groups)
    picked = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(group_topk, dim=-1)[1], 1.0)
    allowed = picked.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e).bool()
    _, idx = probs.masked_fill(~allowed, -1.0).topk(top_k, dim=-1)  # probabilities are >= 0
    return probs.gather(-1, idx), idx


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, experts: int) -> int:
    """Rows of one expert's buffer per sequence of `tokens` tokens: the balanced load times the
    capacity factor, rounded up (Megatron-LM's `ceil(tokens * top_k / experts * capacity_factor)`)."""
    return math.ceil(tokens * top_k / experts * capacity_factor)


def _capacity_rows(experts: Tensor, sequences: int, n_experts: int, capacity: int) -> Tensor:
    """Under a capacity factor, each sequence fills each expert's buffer up to `capacity` rows in
    token order (GShard's groups, one per sequence; Megatron-LM's `position` drop policy), so that
    what is dropped does not depend on how the batch is split over ranks and micro-batches. experts
    (N*k,) the expert of each assignment, token-major -> its row in the padded buffer, laid out
    expert by expert, then sequence by sequence; -1 where dropped."""
    nk = experts.shape[0]
    seq = torch.arange(nk, device=experts.device) // (nk // sequences)
    queue = seq * n_experts + experts  # (sequence, expert) queue of each assignment
    order = torch.argsort(queue, stable=True)
    sizes = torch.bincount(queue, minlength=sequences * n_experts)
    starts = torch.cumsum(sizes, 0) - sizes
    place = torch.empty_like(queue)
    place[order] = torch.arange(nk, device=experts.device) - starts[queue[order]]
    rows = experts * (sequences * capacity) + seq * capacity + place
    return torch.where(place < capacity, rows, torch.full_like(rows, -1))


# ---------------------------------------------------------------------------------------------------
# The blocks
# ---------------------------------------------------------------------------------------------------


class GPT:
    """One rank's shard of the model: `p` maps parameter names to this rank's tensors (which the
    interpreter may swap, e.g. for ZeRO-3 gathered views); each method is one block of docs/program.md.

    Shapes per rank: B micro-batch, T this rank's tokens (the sequence / cp, and / tp in the residual
    stream under sp), C = hidden, nh / nkv the heads held (heads / tp), V the vocabulary slice.
    """

    def __init__(self, m: ModelSpec, lay: Layout, params: dict[str, Tensor], flash: bool = True):
        self.m, self.lay, self.p, self.flash = m, lay, params, flash
        H = m.hidden
        self.hlo, self.hhi = split_range(H, lay.tp, lay.tp_rank)  # this rank's hidden slice
        self.elo = split_range(H, lay.etp, lay.etp_rank)[0]  # a routed expert's hidden slice (its bias's)
        self.vlo, self.vhi = split_range(m.vocab, lay.tp, lay.tp_rank)  # this rank's vocabulary slice
        self.nh, self.nkv = m.heads // lay.tp, m.kv_heads // lay.tp
        # parallel folding over tp without a shared expert: no tp collective around the MoE layer, whose
        # blocks read and write this rank's sequence slice as the second norm leaves it
        self.moe_on_slice = lay.fold_tp and m.moe is not None and not m.moe.shared_experts
        self._rope: Optional[tuple] = None  # (positions, (head dim, dtype), (cos, sin)) last built
        self._band: Optional[tuple] = None  # (query positions, key positions, window, mask) last built

    def _rope_tables(self, pos: Tensor, hd: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The rotary tables of positions `pos`, built once for every layer and micro-batch that share
        that tensor (the interpreter hands the same one to a step's micro-batches)."""
        c = self._rope
        if c is None or c[0] is not pos or c[1] != (hd, dtype):
            c = self._rope = (pos, (hd, dtype), rope_tables(pos, hd, dtype))
        return c[2]

    def _band_mask(self, qpos: Tensor, kpos: Tensor, window: int) -> Tensor:
        """The sliding window's mask, built once for every layer and micro-batch that share the
        position tensors (as the rotary tables are)."""
        c = self._band
        if c is None or c[0] is not qpos or c[1] is not kpos or c[2] != window:
            c = self._band = (qpos, kpos, window, band_mask(qpos, kpos, window))
        return c[3]

    def _norm(self, prefix: str, x: Tensor) -> Tensor:
        w = self.p[f"{prefix}.w"]
        if self.m.norm == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, self.p[f"{prefix}.b"], eps=1e-5)
        return rms_norm(x, w, eps=1e-5)

    def _lin(self, x: Tensor, prefix: str, w: str, b: str, fetch=None) -> Tensor:
        """x @ W (+ bias); `fetch` given: x is gathered over the sequence and not saved (sp)."""
        W = self.p[f"{prefix}.{w}"]
        y = x @ W if fetch is None else GatheredLinear.apply(x, W, fetch)
        bias = self.p.get(f"{prefix}.{b}")
        return y if bias is None else y + bias

    def _ffn_up(self, prefix: str, h: Tensor, fetch=None) -> Tensor:
        """Up (and gate) projection + activation: column-parallel, no communication."""
        up = self._lin(h, prefix, "w1", "b1", fetch)
        if self.m.gated:
            return SwiGLU.apply(self._lin(h, prefix, "wg", "bg", fetch), up)  # SwiGLU (Shazeer 2020)
        return F.gelu(up, approximate="tanh")  # GPT-2's GELU

    def _residual(self, y: Tensor, x: Tensor) -> Tensor:
        """A row-parallel partial sum y (B, T, C) plus the residual x, so that the sum over tp holds
        x once: this rank's hidden slice of x (x whole, replicated over tp), or under sp x as this
        rank's slice of the sequence (the reduce-scatter then hands each rank its slice, with its
        residual)."""
        if self.lay.sp:
            return add_seq_slice(y, x, self.lay.tp_rank * x.shape[1])
        return add_slice(y, x[..., self.hlo : self.hhi], self.hlo)

    # -- sequence-parallel norms --------------------------------------------------------------------
    # Under sp (Korthikanti et al. 2022) each norm runs on this rank's slice of the sequence, between
    # the reduce-scatter that ends a sub-layer and the all-gather of its output that starts the next
    # one; without sp the norms open the column-parallel blocks (qkv, fc1, router, head).

    def norm1(self, l: int, x: Tensor) -> Tensor:
        return self._norm(f"layers.{l}.norm1", x)

    def norm2(self, l: int, x: Tensor) -> Tensor:
        return self._norm(f"layers.{l}.norm2", x)

    def final_norm(self, x: Tensor, norm: str = "head.norm") -> Tensor:
        return self._norm(norm, x)

    def _ffn_down(self, prefix: str, a: Tensor, lo: Optional[int] = None) -> Tensor:
        """Down projection, row-parallel: a partial sum; its bias on this rank's hidden slice (`lo`:
        where it starts, a routed expert's over etp; else this rank's over tp)."""
        y = a @ self.p[f"{prefix}.w2"]
        b = self.p.get(f"{prefix}.b2")
        return y if b is None else add_slice(y, b, self.hlo if lo is None else lo)

    # -- embedding ----------------------------------------------------------------------------------

    def embed(self, tokens: Tensor, pos: Tensor) -> Tensor:
        """(B, T) token ids at positions pos (T,) -> (B, T, C), partial over tp: this rank's vocabulary
        rows (others read as zero) plus its hidden slice of the position embedding."""
        wte = self.p["embed.wte"]
        mine = (tokens >= self.vlo) & (tokens < self.vhi)
        x = F.embedding((tokens - self.vlo).clamp(0, wte.shape[0] - 1), wte) * mine.unsqueeze(-1)
        if self.m.learned_pos:
            x = add_slice(x, self.p["embed.wpe"][pos].unsqueeze(0), self.hlo)  # (1, T, C/tp) -> (B, T, C)
        return x

    # -- attention ----------------------------------------------------------------------------------

    def qkv(self, l: int, x: Tensor, pos: Tensor, fetch=None) -> tuple[Tensor, Tensor]:
        """First norm (under sp: `norm1`, before the gather) + Q/K/V (column-parallel by heads), with
        qk_norm a norm over each q and k head. x (B, T, C) -> q (B, nh, T, hd) and kv (2, B, nkv, T,
        hd) (under MLA (1, B, nh, T, qk + v), `split_kv`); RoPE at positions pos (T,) unless the model
        learns positions."""
        B, T, _ = x.shape
        pre, hd = f"layers.{l}.attn", self.m.head_dim
        h = x if self.lay.sp else self._norm(f"layers.{l}.norm1", x)
        if self.m.is_mla:
            return self._mla_qkv(pre, h, pos, fetch)
        q = self._lin(h, pre, "wq", "bq", fetch).view(B, T, self.nh, hd).transpose(1, 2)
        k = self._lin(h, pre, "wk", "bk", fetch).view(B, T, self.nkv, hd).transpose(1, 2)
        v = self._lin(h, pre, "wv", "bv", fetch).view(B, T, self.nkv, hd).transpose(1, 2)
        if self.m.qk_norm:
            q, k = self._norm(f"{pre}.q_norm", q), self._norm(f"{pre}.k_norm", k)
        if not self.m.learned_pos:
            tables = self._rope_tables(pos, hd, q.dtype)
            q, k = rope(q, tables), rope(k, tables)
        return q, torch.stack([k, v])

    def _mla_qkv(self, pre: str, h: Tensor, pos: Tensor, fetch=None) -> tuple[Tensor, Tensor]:
        """Multi-head latent attention (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.1): queries from the
        normed q latent (or from h), keys' and values' non-rotary part from the normed kv latent, and
        one rotary key shared by every head, taken from h beside the kv latent. h (B, T, C) ->
        q (B, nh, T, qk) and kv (1, B, nh, T, qk + v)."""
        m = self.m
        B, T = h.shape[0], h.shape[1]
        nope, rot, r = m.head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            cq = self._norm(f"{pre}.q_a_norm", self._lin(h, pre, "wq_a", "", fetch))
            q = cq @ self.p[f"{pre}.wq_b"]
        else:
            q = self._lin(h, pre, "wq", "", fetch)
        q = q.view(B, T, self.nh, nope + rot).transpose(1, 2)
        ckv = self._lin(h, pre, "wkv_a", "", fetch)  # (B, T, r + rot)
        kv = self._norm(f"{pre}.kv_a_norm", ckv[..., :r]) @ self.p[f"{pre}.wkv_b"]
        kv = kv.view(B, T, self.nh, nope + m.value_head_dim).transpose(1, 2)  # (B, nh, T, nope + v)
        tables = self._rope_tables(pos, rot, q.dtype)
        k_rot = rope(ckv[..., r:].unsqueeze(1), tables).expand(B, self.nh, T, rot)
        q = torch.cat([q[..., :nope], rope(q[..., nope:], tables)], -1)
        k = torch.cat([kv[..., :nope], k_rot], -1)
        return q, torch.cat([k, kv[..., nope:]], -1).unsqueeze(0)

    def attn(self, l: int, q: Tensor, kv: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor:
        """Causal attention of this rank's heads: q (B, nh, T, hd) against kv (2, B, nkv, S, hd) at
        positions qpos (T,), kpos (S,) (S > T under context parallelism) -> (B, T, nh*hd); within
        the layer's sliding window, if it has one."""
        k, v = split_kv(kv, q.shape[-1])
        gqa = self.nh != self.nkv
        window = self.m.attention_window(l, kpos.shape[0])  # kpos: every position of the sequence
        if not self.flash:
            band = self._band_mask(qpos, kpos, window) if window is not None else None
            return unfused_attention(q, k, v, qpos, kpos, self.m.causal, band)
        vd = v.shape[-1]
        if vd != q.shape[-1]:  # MLA: fused kernels take one head width; V padded, as HF's DeepSeek does for FlashAttention
            v = F.pad(v, (0, q.shape[-1] - vd))
        if window is not None:  # sliding window: the band, as a mask
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self._band_mask(qpos, kpos, window), enable_gqa=gqa)
        elif kpos is qpos or (qpos.shape == kpos.shape and bool((qpos == kpos).all())):  # `is`: no device sync
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.m.causal, enable_gqa=gqa)
        else:  # context parallel: local queries against the gathered keys, masked by position
            mask = kpos[None, :] <= qpos[:, None] if self.m.causal else None  # (T, S)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        if vd != q.shape[-1]:
            o = o[..., :vd]
        B, _, T, _ = q.shape
        return o.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hd)

    def proj(self, l: int, o: Tensor, x: Tensor) -> Tensor:
        """Output projection (row-parallel) + residual: o (B, T, nh*hd), x (B, T, C) (under sp
        (B, T/tp, C)) -> (B, T, C) partial; bias on this rank's hidden slice."""
        y = o @ self.p[f"layers.{l}.attn.wo"]
        b = self.p.get(f"layers.{l}.attn.bo")
        return self._residual(y if b is None else add_slice(y, b, self.hlo), x)

    # -- dense MLP ----------------------------------------------------------------------------------

    def fc1(self, l: int, x: Tensor, fetch=None) -> Tensor:
        """Second norm (under sp: `norm2`) + up (and gate) projection + activation:
        (B, T, C) -> (B, T, ffn/tp)."""
        h = x if self.lay.sp else self._norm(f"layers.{l}.norm2", x)
        return self._ffn_up(f"layers.{l}.mlp", h, fetch)

    def fc2(self, l: int, a: Tensor, x: Tensor) -> Tensor:
        """Down projection (row-parallel) + residual: (B, T, ffn/tp), (B, T, C) -> (B, T, C) partial."""
        return self._residual(self._ffn_down(f"layers.{l}.mlp", a), x)

    # -- MoE MLP ------------------------------------------------------------------------------------

    def router(self, l: int, x: Tensor, fetch=None) -> tuple[Optional[Tensor], Tensor, Tensor, Route]:
        """Second norm (under sp: `norm2`) + gate + top-k. x (B, T, C) -> h (N, C) normed tokens
        (None under sp, where the shared experts read the gathered x themselves), w (N, k) routing
        weights (top-k softmax probabilities, renormalised), xs (N*k, C) token copies sorted by expert
        (what dispatch sends), and the Route. Under a capacity factor each expert's rows are cut or
        zero-padded to its capacity per sequence (`_capacity_rows`); else no token is dropped."""
        h, src, w, route = self._route(l, x, fetch)
        moe = self.m.moe
        if moe.capacity_factor is None:
            xs = src[torch.argsort(route.rows) // moe.top_k]
        else:
            rows = route.rows
            kept = (rows >= 0).nonzero().squeeze(1)
            n_rows = int(route.counts.sum())
            # gathered, then the padding rows zeroed in place: autograd keeps the indices and the mask
            # only (index_copy into zeros would save the gathered tokens too)
            pick = torch.zeros(n_rows, dtype=torch.int64, device=rows.device)
            pick[rows[kept]] = kept // moe.top_k
            pad = torch.ones(n_rows, dtype=torch.bool, device=rows.device)
            pad[rows[kept]] = False
            xs = src[pick].masked_fill_(pad.unsqueeze(1), 0)
        return h, w, xs, route

    def router_gathered(self, l: int, x: Tensor, fetch=None) -> tuple[Optional[Tensor], Tensor, Route]:
        """The router of Megatron-Core's MoEAllGatherTokenDispatcher: what the dispatch all-gathers
        is each token once with its routing weights, xg (N, C + k) = [normed token | w], rather than
        one copy per assignment; the experts pick their assignments from the gathered rows by
        `Route.experts` (a dropped one, under a capacity factor, is -1: no expert computes it)."""
        h, src, w, route = self._route(l, x, fetch)
        return h, torch.cat([src, w.to(src.dtype)], dim=1), route

    def _route(self, l: int, x: Tensor, fetch=None) -> tuple[Optional[Tensor], Tensor, Tensor, Route]:
        """The gate and top-k: h (None under sp), the normed tokens src (N, C), w (N, k) and the Route."""
        moe = self.m.moe
        if self.moe_on_slice:  # x: this tp rank's slice, as the second norm left it
            probs = torch.softmax((x @ self.p[f"layers.{l}.moe.router"]).reshape(-1, moe.experts), dim=-1)
        elif self.lay.sp:
            logits = GatheredLinear.apply(x, self.p[f"layers.{l}.moe.router"], fetch)
            if self.lay.fold_tp:  # parallel folding: this tp rank routes its slice of the gathered sequence
                lo, hi = self._folded_slice(x.shape[1])
                logits, x = logits[:, lo:hi], x[:, lo:hi]
            probs = torch.softmax(logits.reshape(-1, moe.experts), dim=-1)  # (N, E)
        else:
            h = self._norm(f"layers.{l}.norm2", x).reshape(-1, x.shape[-1])  # (N, C)
            probs = torch.softmax(h @ self.p[f"layers.{l}.moe.router"], dim=-1)  # (N, E)
        top, idx = group_limited_topk(probs, moe.top_k, moe.router_groups, moe.router_group_topk)  # (N, k)
        w = top / top.sum(-1, keepdim=True)
        flat = idx.reshape(-1)  # (N*k,) expert of each assignment
        src = x.reshape(-1, x.shape[-1]) if self.lay.sp else h
        if moe.capacity_factor is None:
            order = torch.argsort(flat, stable=True)
            route = Route(torch.argsort(order), torch.bincount(flat, minlength=moe.experts), idx)
        else:
            sequences = x.shape[0]
            cap = expert_capacity(moe.capacity_factor, w.shape[0] // sequences, moe.top_k, moe.experts)
            rows = _capacity_rows(flat, sequences, moe.experts, cap)
            route = Route(rows, torch.full((moe.experts,), sequences * cap, dtype=torch.int64, device=flat.device),
                          idx.masked_fill(rows.view(idx.shape) < 0, -1))
        return (None if self.lay.sp else h), src, w, route

    def _folded_slice(self, seq: int) -> tuple[int, int]:
        """[lo, hi) of the gathered sequence this tp rank routes under parallel folding (Megatron-Core's
        MoE layer routes the sequence-parallel shard each tp rank holds)."""
        return split_range(seq, self.lay.tp, self.lay.tp_rank)

    def experts(self, l: int, xr: Tensor, counts: Tensor) -> Tensor:
        """This rank's routed experts on the tokens it received. xr (R, C) arrives grouped by source
        rank, then by local expert; counts (sources, local experts) says how many -> (R, C) partial
        over tp, in the same order."""
        mine = local_experts(self.m, self.lay)
        n_local = len(mine)
        expert_of_row = torch.repeat_interleave(
            torch.arange(n_local, device=xr.device).repeat(counts.shape[0]), counts.reshape(-1)
        )
        perm = torch.argsort(expert_of_row, stable=True)  # rows grouped by expert
        # Megatron's sort_chunks_by_idxs: one permuted copy, which the expert GEMMs save; the index's
        # backward keeps only `perm`, so xr itself is not needed by the backward (the interpreter frees it)
        groups = xr[perm].split(torch.bincount(expert_of_row, minlength=n_local).tolist())
        ys = [self._ffn_down(f"layers.{l}.moe.e{e}", self._ffn_up(f"layers.{l}.moe.e{e}", g), self.elo)
              for e, g in zip(mine, groups)]
        y = torch.cat(ys) if ys else xr[:0]
        return y[torch.argsort(perm)]  # back to arrival order

    def experts_gathered(self, l: int, xg: Tensor, experts: Tensor) -> Tensor:
        """moe_dispatcher=allgather: this rank's routed experts on the tokens gathered over ep. xg
        (R, C + k) [token | routing weights] as `router_gathered` packs them, experts (R, k) each
        assignment's expert -> (R, C) each gathered token's weighted sum over the assignments this
        rank's experts computed (zero elsewhere; the combine's reduce-scatter sums the ranks' shares,
        as Megatron's unpermute scatter-adds the probability-weighted outputs)."""
        C = self.m.hidden
        tokens, w = xg[:, :C], xg[:, C:]
        y = torch.zeros_like(tokens)
        for e in local_experts(self.m, self.lay):
            tok, slot = (experts == e).nonzero(as_tuple=True)
            pre = f"layers.{l}.moe.e{e}"
            ye = self._ffn_down(pre, self._ffn_up(pre, tokens[tok]), self.elo) * w[tok, slot].unsqueeze(1)
            y = y.index_add(0, tok, ye)
        return y

    def moe_out(self, l: int, x: Tensor, h: Tensor, w: Tensor, yc: Tensor, route: Route, fetch=None) -> Tensor:
        """Weighted sum of the k expert outputs per token (yc (N*k, C), expert-sorted, as combine
        returns them), plus the shared experts on the normed tokens h (N, C; under sp the gathered
        (B, T, C)), plus the residual x -> (B, T, C) partial over tp."""
        N, k = w.shape
        per_slot = yc[route.rows.clamp(min=0)].view(N, k, -1)  # (N, k, C) in token order
        if self.m.moe.capacity_factor is not None:  # a dropped assignment adds nothing
            per_slot = per_slot.masked_fill_((route.rows < 0).view(N, k, 1), 0)
        return self.moe_out_weighted(l, x, h, (w.unsqueeze(-1) * per_slot).sum(1), fetch)

    def moe_out_weighted(self, l: int, x: Tensor, h: Tensor, y: Tensor, fetch=None) -> Tensor:
        """The routed experts' weighted sum per token y (N, C), plus the shared experts on h, plus the
        residual x -> (B, T, C) partial over tp (moe_dispatcher=allgather: y is what the combine's
        reduce-scatter returns)."""
        if self.moe_on_slice:  # no shared expert, no mlp_out: this rank's slice plus its residual
            return y.view(x.shape) + x
        if self.lay.fold_tp:  # this tp rank's slice of the sequence; the mlp_out reduce-scatter sums the slices
            B, T, C = h.shape
            lo, hi = self._folded_slice(T)
            y = F.pad(y.view(B, hi - lo, C), (0, 0, lo, T - hi))
        elif self.lay.sp:
            y = y.view(h.shape)
        for s in range(self.m.moe.shared_experts):
            pre = f"layers.{l}.moe.s{s}"
            y = y + self._ffn_down(pre, self._ffn_up(pre, h, fetch))
        return self._residual(y if self.lay.sp else y.view(x.shape), x)

    # -- head and loss ------------------------------------------------------------------------------

    def head(self, x: Tensor, fetch=None, norm: str = "head.norm", normed: bool = False) -> tuple[Tensor, ...]:
        """Final norm (under sp: `final_norm`) + LM head (vocab-parallel): (B, T, C) -> logits
        (B, T, V/tp) in fp32 (the cross entropy's precision, whatever the model's) and their local max
        (B, T), which carries no gradient (softmax does not depend on the shift). `norm`: an MTP depth's
        own final norm before the shared head (`mtp_norm`). `normed` (without sp, before an MTP depth):
        also the normed hidden state the next depth reads (Megatron-Core's final_layernorm output)."""
        w = self.p["embed.wte"].t() if self.m.tied_embeddings else self.p["head.w"]  # tied: this rank's vocab rows
        if self.lay.sp:
            logits = GatheredLinear.apply(x, w, fetch).float()
            return logits, logits.detach().amax(-1)
        h = self._norm(norm, x)
        logits = (h @ w).float()
        return (logits, logits.detach().amax(-1)) + ((h,) if normed else ())

    # -- multi-token prediction ---------------------------------------------------------------------
    # DeepSeek-V3 §2.2 as Megatron-Core's MultiTokenPredictionLayer runs it: depth d (0-based) predicts
    # the token d + 2 ahead from the previous depth's hidden state (the main model's after its final
    # norm; a depth's after its own) and the embedding of the token d + 1 ahead; then a block like the
    # last layer, the depth's final norm and the shared head and cross entropy.

    @staticmethod
    def mtp_norm(d: int) -> str:
        """The final norm of MTP depth d (the main head's for d = -1)."""
        return "head.norm" if d < 0 else f"mtp.{d}.norm"

    def mtp_in(self, d: int, h: Tensor, tokens: Tensor, pos: Tensor) -> Tensor:
        """MTP depth d's input, unsharded: h (B, T, C) the previous depth's hidden state after its final
        norm, tokens / pos the ids and positions one further ahead -> eh_proj([enorm(embed(tokens)) |
        hnorm(h)]) (B, T, C)."""
        return self.mtp_proj(d, self.mtp_norms(d, self.embed(tokens, pos), h))

    def mtp_norms(self, d: int, e: Tensor, h: Tensor) -> Tensor:
        """enorm(e) | hnorm(h): e the shifted tokens' embedding (summed over tp), h the previous depth's
        hidden state after its final norm (the head's `normed` output, under sp the norm block's, on
        this rank's slice of the sequence as e). Megatron-Core concatenates the embedding first."""
        return torch.cat([self._norm(f"mtp.{d}.enorm", e), self._norm(f"mtp.{d}.hnorm", h)], -1)

    def mtp_proj(self, d: int, eh: Tensor, fetch=None) -> Tensor:
        """eh_proj, column-parallel (Megatron-Core's gather_output=False): (B, T, 2C) -> (B, T, C/tp);
        `fetch` given: eh is gathered over the sequence and not saved (sp)."""
        W = self.p[f"mtp.{d}.eh_proj"]
        return eh @ W if fetch is None else GatheredLinear.apply(eh, W, fetch)

    def mtp_scale(self, d: int, tokens: int) -> float:
        """Each kept token's weight in MTP depth d's loss: mtp_loss_scaling_factor / depths over the
        tokens depth d keeps (`tokens` of the global batch, d + 1 fewer per sequence: Megatron-Core's
        `mtp_loss_scale * mtp_loss / num_tokens`)."""
        return self.m.mtp_loss_scaling_factor / self.m.mtp_layers / tokens

    def xent(self, logits: Tensor, gmax: Tensor, targets: Tensor) -> Tensor:
        """Local half of the vocab-parallel cross entropy (Megatron): with z = logits - global max,
        returns (2, B, T): sum of exp(z) over this rank's vocabulary, and z at the target if this rank
        holds the target (else 0). Summed over tp by `ce_sum`.

        As Megatron's `_VocabParallelCrossEntropy`, it works in place on the logits (which nothing
        else needs once the local max is taken: the LM head's matmul saves its input, not its output):
        exp(z) overwrites them and is the one logits-sized tensor kept for the backward, which turns
        it into the logits' gradient in place. The logits must not be read again afterwards."""
        return VocabParallelXent.apply(logits, gmax, targets, self.vlo)

    @staticmethod
    def loss(ce: Tensor, scale: float, mask: Optional[Tensor] = None) -> Tensor:
        """Sum over tokens of log(sum exp z) - z_target, times scale = 1 / tokens of the global batch,
        so that the losses of all micro-batches and ranks add up to the global mean. `mask` (T,): an
        MTP depth's, which drops the positions whose target lies past the sequence."""
        per_token = ce[0].log() - ce[1]
        return (per_token if mask is None else per_token * mask).sum() * scale

    # -- the whole model, unsharded ------------------------------------------------------------------

    def forward(self, tokens: Tensor, targets: Tensor, pos: Tensor, mtp: tuple = ()) -> Tensor:
        """Mean cross entropy of a whole (B, T) batch, plus the MTP depths' scaled losses (`mtp`: their
        `data.Shifted`): the blocks chained without communication. Only valid for an unsharded layout
        (tp = ep = cp = 1), where every collective is the identity."""
        assert self.lay == Layout(), "forward() chains blocks without their collectives"
        x = self.embed(tokens, pos)
        for l in range(self.m.layers):
            q, kv = self.qkv(l, x, pos)
            x = self.proj(l, self.attn(l, q, kv, pos, pos), x)
            if self.m.is_moe_layer(l):
                h, w, xs, route = self.router(l, x)
                ys = self.experts(l, xs, route.counts.view(1, -1))
                x = self.moe_out(l, x, h, w, ys, route)
            else:
                x = self.fc2(l, self.fc1(l, x), x)
        logits, lmax, h = self.head(x, normed=True)
        total = self.loss(self.xent(logits, lmax, targets), 1.0 / targets.numel())
        for d, sh in enumerate(mtp):
            u = self.m.mtp_block(d)
            x = self.mtp_in(d, h, sh.tokens, sh.pos)
            q, kv = self.qkv(u, x, pos)
            x = self.proj(u, self.attn(u, q, kv, pos, pos), x)
            if self.m.is_moe_layer(u):
                hh, w, xs, route = self.router(u, x)
                x = self.moe_out(u, x, hh, w, self.experts(u, xs, route.counts.view(1, -1)), route)
            else:
                x = self.fc2(u, self.fc1(u, x), x)
            logits, lmax, h = self.head(x, norm=self.mtp_norm(d), normed=True)
            scale = self.mtp_scale(d, int(sh.mask.sum()) * targets.shape[0])
            total = total + self.loss(self.xent(logits, lmax, sh.targets), scale, sh.mask)
        return total
