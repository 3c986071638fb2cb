"""Where the executor's parameters live: the full model's list (one seeded init), and the slice of it
one rank holds under tensor, expert and pipeline parallelism.

Tensor parallelism is Megatron's (Shoeybi et al. 2019): Q/K/V and the up/gate projections are split by
columns (heads, FFN units), the output and down projections by rows, the embedding and the LM head by
vocabulary. Biases added after a row-parallel block and the position table are stored split along the
hidden dimension (each tp rank adds its own slice, see `simexec.exec.nn.gpt`), which is also what
`ResolvedPlan.params_on_pp_rank` counts (every non-norm parameter divided by tp).

Norms (and the MoE router) are replicated over tp, but the gradient a rank computes for them is only
its share (the heads / FFN units it holds): `ParamSpec.tp_partial` names the f-conjugate collective
whose backward sums them over tp together with the activation gradient (see interpreter).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

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
    etp: int = 1  # the ranks a routed expert's weights are split over (tp, or under parallel folding `Plan.etp`)
    etp_rank: int = 0
    fold_tp: bool = False  # parallel folding over tp > 1: each tp rank routes its own slice of the sequence

    @staticmethod
    def of(rp, rank: int) -> "Layout":
        """The layout of `rank` in a ResolvedPlan. ep groups are consecutive blocks of the dp axis, or
        under parallel folding (`Plan.etp`) the expert mesh's (`folded_expert_groups`)."""
        c = rp.mesh.coords(rank)
        p = rp.plan
        ep_rank, etp, etp_rank = c["dp"] % p.ep, p.tp, c["tp"]
        if p.etp is not None:
            from simexec.program.groups import folded_expert_groups

            etp_group, ep_group, _ = folded_expert_groups(rp, rank)
            ep_rank, etp, etp_rank = ep_group.index(rank), p.etp, etp_group.index(rank)
        return Layout(tp=p.tp, tp_rank=c["tp"], ep=p.ep, ep_rank=ep_rank, cp=p.cp, cp_rank=c["cp"], sp=p.sp,
                      etp=etp, etp_rank=etp_rank, fold_tp=p.etp is not None and p.tp > 1)


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

    def layer(l):
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

    for l in range(L):
        layer(l)
    norm("head.norm", L, "head_in")
    if not m.tied_embeddings:  # tied: the head multiplies by the embedding's transpose
        add("head.w", (H, m.vocab), std, L, 1)  # vocab-parallel
    for d in range(m.mtp_layers):  # Megatron-Core's MultiTokenPredictionLayer, unit `mtp_block(d)`
        u = m.mtp_block(d)
        # enorm of the shifted tokens' embedding, hnorm of the previous depth's hidden state: whole
        # gradients (eh_proj's input gradient is summed over tp before them); under sp each rank's over
        # its slice of the sequence, summed by `mtp_norm_grads`
        norm(f"mtp.{d}.enorm", u, "", sp_partial="mtp_norm_grads")
        norm(f"mtp.{d}.hnorm", u, "", sp_partial="mtp_norm_grads")
        add(f"mtp.{d}.eh_proj", (2 * H, H), std, u, 1)  # [embedding | hidden] -> hidden, column-parallel
        layer(u)  # a block like the last layer (`ModelSpec.block_kind_layer`)
        # its final norm, before the shared head: partial as the head's, summed by the depth's head's
        # head_in (at layer u + mtp_layers, the lowering's `mtp_head`)
        norm(f"mtp.{d}.norm", u, "head_in")
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
    """The units (embedding -1, layers, head L, the MTP depths beside it) a pipeline rank holds."""
    units = set(rp.layers_of_pp_rank(pp_rank))
    if pp_rank == 0:
        units.add(-1)
    if pp_rank == rp.head_pp_rank:
        m = rp.model
        units.add(m.layers)
        units.update(m.mtp_block(d) for d in range(m.mtp_layers))
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
    parts, i = (lay.tp, lay.tp_rank) if spec.expert is None else (lay.etp, lay.etp_rank)
    if spec.tp_dim is None or parts == 1:
        return full.clone()
    return full.tensor_split(parts, dim=spec.tp_dim)[i].clone(memory_format=torch.contiguous_format)
