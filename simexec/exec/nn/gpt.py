"""The executor's GPT, cut into the sub-blocks of docs/program.md and sharded for one rank.

Reading order, nanoGPT's: the parameters of the full model (one list, one seeded init), the rule that
slices them to one rank, then the blocks in forward order, then `forward`, which chains the blocks of
an unsharded model (the single-process reference). Tensors are (B, T, C): batch, time, channels.

Tensor parallelism is Megatron's (Shoeybi et al. 2019): Q/K/V and the up/gate projections are split by
columns (heads, FFN units), the output and down projections by rows, the embedding and the LM head by
vocabulary. A block never communicates: row-parallel blocks return *partial sums* that the next
collective instruction (`attn_out`, `mlp_out`, `embed_out`) adds up. For that sum to come out right,
anything a row-parallel block adds that is not itself partial (the residual, the bias, the position
embedding) is added by each tensor-parallel rank on its own 1/tp slice of the hidden dimension only;
such biases and the position table are therefore stored split along the hidden dimension, which is
also what `ResolvedPlan.params_on_pp_rank` counts (every non-norm parameter divided by tp).

Norms (and the MoE router) are replicated over tp, but the gradient a rank computes for them is only
its share (the heads / FFN units it holds): `ParamSpec.tp_partial` names the f-conjugate collective
whose backward sums them over tp together with the activation gradient (see interpreter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from simexec.exec.nn.weight_grads import SplitPass
from simexec.specs.model import ModelSpec


# ---------------------------------------------------------------------------------------------------
# Where a rank sits
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """One rank's place in the plan, as far as the model's tensors are concerned."""

    tp: int = 1
    tp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    sp: bool = False

    @staticmethod
    def of(rp, rank: int) -> "Layout":
        """The layout of `rank` in a ResolvedPlan. ep groups are consecutive blocks of the dp axis."""
        c = rp.mesh.coords(rank)
        p = rp.plan
        return Layout(tp=p.tp, tp_rank=c["tp"], ep=p.ep, ep_rank=c["dp"] % p.ep, cp=p.cp, cp_rank=c["cp"], sp=p.sp)


def split_range(n: int, parts: int, i: int) -> tuple[int, int]:
    """[lo, hi) of part i when n is split as torch.tensor_split splits it."""
    q, r = divmod(n, parts)
    lo = i * q + min(i, r)
    return lo, lo + q + (1 if i < r else 0)


# ---------------------------------------------------------------------------------------------------
# Parameters: the full model's list, its seeded init, and the slice one rank holds
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the full model and how it is split."""

    name: str
    shape: tuple[int, ...]
    std: float  # normal(0, std) init; 0.0: zeros; -1.0: ones (norm weights)
    unit: int  # -1 embedding, l a layer, L the head: the `items` of buckets and ZeRO-3 gathers
    tp_dim: Optional[int] = None  # dimension split over tp; None: replicated over tp
    expert: Optional[int] = None  # routed expert index (held by one ep rank); None: a dense parameter
    tp_partial: str = ""  # replicated over tp, grads partial: summed by this collective's backward
    sp_partial: str = ""  # under sp, the collective that sums them instead ("": the interpreter's rule for norms)


def param_specs(m: ModelSpec) -> list[ParamSpec]:
    """Every parameter of the full model, in init order. Weights are (in, out): y = x @ W."""
    H, L, hd = m.hidden, m.layers, m.head_dim
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * L)  # GPT-2: residual projections scaled by 1/sqrt(2L)
    out: list[ParamSpec] = []

    def add(name, shape, s, unit, tp_dim=None, expert=None, tp_partial="", sp_partial=""):
        out.append(ParamSpec(name, tuple(shape), s, unit, tp_dim, expert, tp_partial, sp_partial))

    def norm(prefix, unit, partial, width=H, sp_partial=""):
        add(f"{prefix}.w", (width,), -1.0, unit, tp_partial=partial, sp_partial=sp_partial)
        if m.norm == "layernorm":
            add(f"{prefix}.b", (width,), 0.0, unit, tp_partial=partial, sp_partial=sp_partial)

    def ffn(prefix, unit, width, expert=None):
        add(f"{prefix}.w1", (H, width), std, unit, 1, expert)  # up: column-parallel
        if m.bias:
            add(f"{prefix}.b1", (width,), 0.0, unit, 0, expert)
        if m.gated:
            add(f"{prefix}.wg", (H, width), std, unit, 1, expert)  # gate: column-parallel
            if m.bias:
                add(f"{prefix}.bg", (width,), 0.0, unit, 0, expert)
        add(f"{prefix}.w2", (width, H), resid_std, unit, 0, expert)  # down: row-parallel
        if m.bias:
            add(f"{prefix}.b2", (H,), 0.0, unit, 0, expert)  # hidden slice per tp rank

    add("embed.wte", (m.vocab, H), std, -1, 0)  # vocab-parallel
    if m.learned_pos:
        add("embed.wpe", (m.max_positions or m.seq_len, H), std, -1, 1)  # hidden slice per tp rank
    qkv_bias = m.bias or m.qkv_bias
    for l in range(L):
        p = f"layers.{l}"
        norm(f"{p}.norm1", l, "attn_in")
        if m.is_mla:
            _mla_specs(m, l, add, norm, std)
        else:
            add(f"{p}.attn.wq", (H, m.heads * hd), std, l, 1)
            add(f"{p}.attn.wk", (H, m.kv_heads * hd), std, l, 1)
            add(f"{p}.attn.wv", (H, m.kv_heads * hd), std, l, 1)
        if qkv_bias:
            add(f"{p}.attn.bq", (m.heads * hd,), 0.0, l, 0)
            add(f"{p}.attn.bk", (m.kv_heads * hd,), 0.0, l, 0)
            add(f"{p}.attn.bv", (m.kv_heads * hd,), 0.0, l, 0)
        if m.qk_norm:  # one weight for every head: each tp rank's gradient covers its own heads
            norm(f"{p}.attn.q_norm", l, "attn_in", hd)
            norm(f"{p}.attn.k_norm", l, "attn_in", hd)
        add(f"{p}.attn.wo", (m.heads * m.value_head_dim, H), resid_std, l, 0)
        if m.bias:
            add(f"{p}.attn.bo", (H,), 0.0, l, 0)
        norm(f"{p}.norm2", l, "mlp_in")
        if m.is_moe_layer(l):
            add(f"{p}.moe.router", (H, m.moe.experts), std, l, tp_partial="mlp_in")
            for e in range(m.moe.experts):
                ffn(f"{p}.moe.e{e}", l, m.moe.expert_ffn, expert=e)
            for s in range(m.moe.shared_experts):
                ffn(f"{p}.moe.s{s}", l, m.moe.shared_expert_ffn or m.moe.expert_ffn)
        else:
            ffn(f"{p}.mlp", l, m.ffn)
    norm("head.norm", L, "head_in")
    if not m.tied_embeddings:  # tied: the head multiplies by the embedding's transpose
        add("head.w", (H, m.vocab), std, L, 1)  # vocab-parallel
    return out


def _mla_specs(m: ModelSpec, l: int, add, norm, std: float) -> None:
    """Multi-head latent attention's projections (DeepSeek-V2/V3), as DeepSeek's reference splits
    them over tp: the down projections to the q and kv latents (and the kv latent's shared rotary
    key) and the latents' norms are replicated, each tp rank's heads taking their share of the
    gradient, summed over tp by the input gradient's all-reduce, or under sp by the first norm's
    (`norm_grads`: the reduce-scatter would carry them in every slot); the up projections are
    column-parallel by heads, each head's columns together (q: nope then rope; kv: nope key then
    value)."""
    p, H = f"layers.{l}.attn", m.hidden
    q_width = m.heads * m.qk_head_dim
    if m.q_lora_rank:
        add(f"{p}.wq_a", (H, m.q_lora_rank), std, l, tp_partial="attn_in", sp_partial="norm_grads")
        norm(f"{p}.q_a_norm", l, "attn_in", m.q_lora_rank, sp_partial="norm_grads")
        add(f"{p}.wq_b", (m.q_lora_rank, q_width), std, l, 1)
    else:
        add(f"{p}.wq", (H, q_width), std, l, 1)
    add(f"{p}.wkv_a", (H, m.kv_lora_rank + m.qk_rope_head_dim), std, l, tp_partial="attn_in", sp_partial="norm_grads")
    norm(f"{p}.kv_a_norm", l, "attn_in", m.kv_lora_rank, sp_partial="norm_grads")
    add(f"{p}.wkv_b", (m.kv_lora_rank, m.heads * (m.head_dim + m.value_head_dim)), std, l, 1)


def init_full(m: ModelSpec, seed: int) -> dict[str, Tensor]:
    """The full model's parameters, drawn in `param_specs` order from one seeded generator: every rank
    and the reference draw the same numbers, then keep their slice."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for s in param_specs(m):
        if s.std > 0:
            out[s.name] = torch.randn(s.shape, generator=g) * s.std
        else:
            out[s.name] = torch.ones(s.shape) if s.std < 0 else torch.zeros(s.shape)
    return out


def local_experts(m: ModelSpec, lay: Layout) -> range:
    """Routed experts held by this rank's ep index (contiguous blocks)."""
    if m.moe is None:
        return range(0)
    lo, hi = split_range(m.moe.experts, lay.ep, lay.ep_rank)
    return range(lo, hi)


def stage_units(rp, pp_rank: int) -> set[int]:
    """The units (embedding -1, layers, head L) a pipeline rank holds."""
    units = set(rp.layers_of_pp_rank(pp_rank))
    if pp_rank == 0:
        units.add(-1)
    if pp_rank == rp.head_pp_rank:
        units.add(rp.model.layers)
    return units


def stage_specs(rp, pp_rank: int) -> list[ParamSpec]:
    """The parameters a pipeline rank holds (before experts are split over ep): its units', and with
    tied embeddings over a pipeline, on the last stage, a copy of the embedding in the head's unit
    (Megatron-LM's): initialised as the first stage's, its gradient summed with the first stage's
    by the `tied` all-reduce, so the two stay equal."""
    m = rp.model
    units = stage_units(rp, pp_rank)
    out = [s for s in param_specs(m) if s.unit in units]
    if rp.tied_copy and pp_rank == rp.head_pp_rank:
        wte = next(s for s in param_specs(m) if s.name == "embed.wte")
        out.append(replace(wte, unit=m.layers))
    return out


def is_tied_copy(spec: ParamSpec, m: ModelSpec) -> bool:
    """The last stage's copy of a tied embedding (`stage_specs`)."""
    return spec.name == "embed.wte" and spec.unit == m.layers


def holds(spec: ParamSpec, m: ModelSpec, lay: Layout) -> bool:
    return spec.expert is None or spec.expert in local_experts(m, lay)


def shard(spec: ParamSpec, full: Tensor, lay: Layout) -> Tensor:
    """This rank's slice of one full parameter (a contiguous copy of its own: a slice along the first
    dimension is contiguous already, and `.contiguous()` would keep the whole tensor's storage)."""
    if spec.tp_dim is None or lay.tp == 1:
        return full.clone()
    return full.tensor_split(lay.tp, dim=spec.tp_dim)[lay.tp_rank].clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------------------------------


def add_slice(y: Tensor, t: Tensor, lo: int) -> Tensor:
    """y + t placed at [lo, lo + t.shape[-1]) of the last dimension (zeros elsewhere)."""
    if t.shape[-1] == y.shape[-1]:  # no tensor parallelism: nothing to pad
        return y + t
    return y + F.pad(t, (lo, y.shape[-1] - lo - t.shape[-1]))


def rope_tables(pos: Tensor, hd: int, dtype: torch.dtype, base: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos and sin (T, hd) of the rotary embedding at positions pos (T,), rotate-half layout."""
    inv = 1.0 / base ** (torch.arange(0, hd, 2, device=pos.device, dtype=torch.float32) / hd)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # (T, hd/2)
    return torch.cat([ang.cos(), ang.cos()], -1).to(dtype), torch.cat([ang.sin(), ang.sin()], -1).to(dtype)


def _rotate_half(x: Tensor, sign: int) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1) if sign > 0 else torch.cat([x[..., h:], -x[..., :h]], -1)


class _Rope(torch.autograd.Function):
    """Rotary embedding that saves only the tables it was given (Megatron computes them once per
    forward pass and hands the same to every layer's fused RoPE): autograd's version keeps its own
    cos / sin per call."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x, 1) * sin

    @staticmethod
    def backward(ctx, g: Tensor):
        cos, sin = ctx.saved_tensors
        return g * cos + _rotate_half(g * sin, -1), None, None


def rope(x: Tensor, tables: tuple[Tensor, Tensor]) -> Tensor:
    """Rotary embedding (Su et al. 2021, rotate-half form) of x (B, nh, T, hd) with `rope_tables`."""
    return _Rope.apply(x, *tables)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm saving its input and 1/rms only (Megatron's fused RMSNorm): torch's CPU `rms_norm`
    is composed of operators and also keeps the normalised input for the weight's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float) -> Tensor:
        xo = _opmath(x)
        rstd = torch.rsqrt(xo.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, w)
        return (xo * rstd).to(x.dtype) * w

    @staticmethod
    def backward(ctx, g: Tensor):
        # in place where it can be, with the operators of the plain formula (the dispatch tables,
        # simexec.sim.host.model, count them): at most three input-sized buffers beside g, as near as
        # eager operators come to a fused kernel's none; a split backward's input pass computes no
        # weight gradient, its weight pass no input gradient
        x, rstd, w = ctx.saved_tensors
        want_x = ctx.needs_input_grad[0] and SplitPass.now != "weight"
        want_w = ctx.needs_input_grad[1] and SplitPass.now != "input"
        xhat = _opmath(x) * rstd
        gw = dx = None
        if want_w:
            gw = (_opmath(g) * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)
        if want_x:
            gx = torch.mul(_opmath(g), _opmath(w))
            dot = (gx * xhat).mean(-1, keepdim=True)
            dx = gx.sub_(xhat.mul_(dot)).mul_(rstd).to(x.dtype)
        return dx, gw, None


def _opmath(t: Tensor) -> Tensor:
    """16-bit values are normalised in fp32 (as torch's and Megatron's norms do)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def rms_norm(x: Tensor, w: Tensor, eps: float = 1e-5) -> Tensor:
    return _RMSNorm.apply(x, w, eps)


def add_seq_slice(y: Tensor, t: Tensor, lo: int) -> Tensor:
    """y (B, T, C) + t (B, Ts, C) placed at [lo, lo + Ts) of the sequence (zeros elsewhere)."""
    if t.shape[1] == y.shape[1]:
        return y + t
    return y + F.pad(t, (0, 0, lo, y.shape[1] - lo - t.shape[1]))


class _GatheredLinear(torch.autograd.Function):
    """x @ w where x is a norm's output all-gathered over the sequence (sp), saving w but not x:
    the weight gradient reads x whole, which the backward gets from `fetch` (the interpreter's
    re-gather of the slice each rank kept), as Megatron-LM's column-parallel linear does under
    sequence parallelism."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, fetch) -> Tensor:
        ctx.save_for_backward(w)
        ctx.fetch = fetch
        return x @ w

    @staticmethod
    def backward(ctx, gy: Tensor):
        (w,) = ctx.saved_tensors
        # a split backward's input pass computes no weight gradient, its weight pass no input gradient
        gx = gy @ w.t() if ctx.needs_input_grad[0] and SplitPass.now != "weight" else None
        gw = None
        if ctx.needs_input_grad[1] and SplitPass.now != "input":
            x = ctx.fetch()
            gw = x.reshape(-1, x.shape[-1]).t() @ gy.reshape(-1, gy.shape[-1])
        return gx, gw, None


# ---------------------------------------------------------------------------------------------------
# Ring attention pieces (context parallel, cp_impl=ring)
# ---------------------------------------------------------------------------------------------------
# Ring attention (Liu et al. 2023) computes a rank's attention one K/V chunk at a time and merges the
# partial results by their log-sum-exp (the online softmax of flash attention, Dao et al. 2022). The
# backward is flash attention's: from the final output O, its row log-sum-exp L and dO, every chunk's
# contribution is recomputed on its own (P = exp(S - L), dS = P * (dP - rowsum(dO * O))), so the
# chunks can arrive in any order and nothing per chunk is kept from the forward. All in fp32.


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


def _unfused_attention(q: Tensor, k: Tensor, v: Tensor, qpos: Tensor, kpos: Tensor, causal: bool,
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


class _Xent(torch.autograd.Function):
    """exp(logits - gmax) in place on the logits, saved once; see GPT.xent."""

    @staticmethod
    def forward(ctx, logits: Tensor, gmax: Tensor, targets: Tensor, vlo: int) -> Tensor:
        z = logits.detach()  # the same storage: overwritten (no other reader, see GPT.xent)
        z.sub_(gmax.unsqueeze(-1))
        V = z.shape[-1]
        mine = (targets >= vlo) & (targets < vlo + V)
        idx = (targets - vlo).clamp(0, V - 1).unsqueeze(-1)
        at = z.gather(-1, idx).squeeze(-1) * mine
        z.exp_()
        ctx.z, ctx.idx, ctx.mine = z, idx, mine  # not save_for_backward: the backward reuses z's storage
        return torch.stack([z.sum(-1), at])

    @staticmethod
    def backward(ctx, g: Tensor):
        z, idx, mine = ctx.z, ctx.idx, ctx.mine
        del ctx.z, ctx.idx, ctx.mine
        dz = z.mul_(g[0].unsqueeze(-1).to(z.dtype))  # d sum(exp z) / dz = exp z, in place
        dz.scatter_add_(-1, idx, (g[1] * mine).unsqueeze(-1).to(z.dtype))  # d z_target / dz
        return dz, None, None, None


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up saving only its inputs, silu recomputed in the backward (Megatron's fused
    bias-SwiGLU): autograd's unfused version would also keep silu(gate)."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g: Tensor):
        # d up = g silu(gate); d gate = g up s (1 + gate (1 - s)), s = sigmoid(gate): in place where
        # it can be, with as many operators as the plain formula (the dispatch tables count them), so
        # that one buffer beside the two gradients is all it holds (a fused kernel holds none)
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        dgate = g * up
        dgate.mul_(s)
        silu = s.mul_(gate)
        dup = g * silu
        t = silu.neg_().add_(gate).add_(1)  # 1 + gate - silu(gate)
        dgate.mul_(t)
        return dgate, dup


@dataclass
class Route:
    """A MoE layer's routing of its N tokens (no gradients): where each assignment sits in the rows
    sent to the experts, and how many rows each expert gets."""

    rows: Tensor  # (N*k,) row of each assignment (token*k + slot) in the expert-sorted list; -1: dropped
    counts: Tensor  # (E,) rows per expert (under a capacity factor, the padded capacity)


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
        self.vlo, self.vhi = split_range(m.vocab, lay.tp, lay.tp_rank)  # this rank's vocabulary slice
        self.nh, self.nkv = m.heads // lay.tp, m.kv_heads // lay.tp
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
        y = x @ W if fetch is None else _GatheredLinear.apply(x, W, fetch)
        bias = self.p.get(f"{prefix}.{b}")
        return y if bias is None else y + bias

    def _ffn_up(self, prefix: str, h: Tensor, fetch=None) -> Tensor:
        """Up (and gate) projection + activation: column-parallel, no communication."""
        up = self._lin(h, prefix, "w1", "b1", fetch)
        if self.m.gated:
            return _SwiGLU.apply(self._lin(h, prefix, "wg", "bg", fetch), up)  # SwiGLU (Shazeer 2020)
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

    def final_norm(self, x: Tensor) -> Tensor:
        return self._norm("head.norm", x)

    def _ffn_down(self, prefix: str, a: Tensor) -> Tensor:
        """Down projection, row-parallel: a partial sum; its bias on this rank's hidden slice."""
        y = a @ self.p[f"{prefix}.w2"]
        b = self.p.get(f"{prefix}.b2")
        return y if b is None else add_slice(y, b, self.hlo)

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
            return _unfused_attention(q, k, v, qpos, kpos, self.m.causal, band)
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
        moe = self.m.moe
        if self.lay.sp:
            logits = _GatheredLinear.apply(x, self.p[f"layers.{l}.moe.router"], fetch)
            probs = torch.softmax(logits.reshape(-1, moe.experts), dim=-1)  # (N, E)
        else:
            h = self._norm(f"layers.{l}.norm2", x).reshape(-1, x.shape[-1])  # (N, C)
            probs = torch.softmax(h @ self.p[f"layers.{l}.moe.router"], dim=-1)  # (N, E)
        top, idx = probs.topk(moe.top_k, dim=-1)  # (N, k)
        w = top / top.sum(-1, keepdim=True)
        flat = idx.reshape(-1)  # (N*k,) expert of each assignment
        src = x.reshape(-1, x.shape[-1]) if self.lay.sp else h
        if moe.capacity_factor is None:
            order = torch.argsort(flat, stable=True)
            route = Route(torch.argsort(order), torch.bincount(flat, minlength=moe.experts))
            xs = src[order // moe.top_k]
        else:
            sequences = x.shape[0]
            cap = expert_capacity(moe.capacity_factor, w.shape[0] // sequences, moe.top_k, moe.experts)
            rows = _capacity_rows(flat, sequences, moe.experts, cap)
            kept = (rows >= 0).nonzero().squeeze(1)
            n_rows = moe.experts * sequences * cap
            route = Route(rows, torch.full((moe.experts,), sequences * cap, dtype=torch.int64, device=flat.device))
            # gathered, then the padding rows zeroed in place: autograd keeps the indices and the mask
            # only (index_copy into zeros would save the gathered tokens too)
            pick = torch.zeros(n_rows, dtype=torch.int64, device=flat.device)
            pick[rows[kept]] = kept // moe.top_k
            pad = torch.ones(n_rows, dtype=torch.bool, device=flat.device)
            pad[rows[kept]] = False
            xs = src[pick].masked_fill_(pad.unsqueeze(1), 0)
        return (None if self.lay.sp else h), w, xs, route

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
        ys = [self._ffn_down(f"layers.{l}.moe.e{e}", self._ffn_up(f"layers.{l}.moe.e{e}", g)) for e, g in zip(mine, groups)]
        y = torch.cat(ys) if ys else xr[:0]
        return y[torch.argsort(perm)]  # back to arrival order

    def moe_out(self, l: int, x: Tensor, h: Tensor, w: Tensor, yc: Tensor, route: Route, fetch=None) -> Tensor:
        """Weighted sum of the k expert outputs per token (yc (N*k, C), expert-sorted, as combine
        returns them), plus the shared experts on the normed tokens h (N, C; under sp the gathered
        (B, T, C)), plus the residual x -> (B, T, C) partial over tp."""
        N, k = w.shape
        per_slot = yc[route.rows.clamp(min=0)].view(N, k, -1)  # (N, k, C) in token order
        if self.m.moe.capacity_factor is not None:  # a dropped assignment adds nothing
            per_slot = per_slot.masked_fill_((route.rows < 0).view(N, k, 1), 0)
        y = (w.unsqueeze(-1) * per_slot).sum(1)  # (N, C)
        if self.lay.sp:
            y = y.view(h.shape)
        for s in range(self.m.moe.shared_experts):
            pre = f"layers.{l}.moe.s{s}"
            y = y + self._ffn_down(pre, self._ffn_up(pre, h, fetch))
        return self._residual(y if self.lay.sp else y.view(x.shape), x)

    # -- head and loss ------------------------------------------------------------------------------

    def head(self, x: Tensor, fetch=None) -> tuple[Tensor, Tensor]:
        """Final norm (under sp: `final_norm`) + LM head (vocab-parallel): (B, T, C) -> logits
        (B, T, V/tp) in fp32 (the cross entropy's precision, whatever the model's) and their local max
        (B, T), which carries no gradient (softmax does not depend on the shift)."""
        w = self.p["embed.wte"].t() if self.m.tied_embeddings else self.p["head.w"]  # tied: this rank's vocab rows
        if self.lay.sp:
            logits = _GatheredLinear.apply(x, w, fetch).float()
        else:
            logits = (self._norm("head.norm", x) @ w).float()
        return logits, logits.detach().amax(-1)

    def xent(self, logits: Tensor, gmax: Tensor, targets: Tensor) -> Tensor:
        """Local half of the vocab-parallel cross entropy (Megatron): with z = logits - global max,
        returns (2, B, T): sum of exp(z) over this rank's vocabulary, and z at the target if this rank
        holds the target (else 0). Summed over tp by `ce_sum`.

        As Megatron's `_VocabParallelCrossEntropy`, it works in place on the logits (which nothing
        else needs once the local max is taken: the LM head's matmul saves its input, not its output):
        exp(z) overwrites them and is the one logits-sized tensor kept for the backward, which turns
        it into the logits' gradient in place. The logits must not be read again afterwards."""
        return _Xent.apply(logits, gmax, targets, self.vlo)
    @staticmethod
    def loss(ce: Tensor, scale: float) -> Tensor:
        """Sum over tokens of log(sum exp z) - z_target, times scale = 1 / tokens of the global batch,
        so that the losses of all micro-batches and ranks add up to the global mean."""
        return (ce[0].log() - ce[1]).sum() * scale

    # -- the whole model, unsharded ------------------------------------------------------------------

    def forward(self, tokens: Tensor, targets: Tensor, pos: Tensor) -> Tensor:
        """Mean cross entropy of a whole (B, T) batch: the blocks chained without communication. Only
        valid for an unsharded layout (tp = ep = cp = 1), where every collective is the identity."""
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
        logits, lmax = self.head(x)
        return self.loss(self.xent(logits, lmax, targets), 1.0 / targets.numel())
