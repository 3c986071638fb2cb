"""Anatomy of one transformer layer on one rank: FLOPs, bytes moved and saved activations per sub-block.

Sub-blocks are cut where Megatron-style tensor parallelism communicates (docs/program.md), so
every number here is for one micro-batch on one rank after the plan's tp/sp/cp/ep splits.
Activation bytes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", §4, Table 2): per layer s·b·h·(34 + 5·a·s/h) bytes with 2-byte activations,
10 + 24/t under tensor parallelism, 34/t with sequence parallelism; with a fused (Flash) attention
kernel the 5·a·s²·b term of the materialised softmax disappears.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from simexec.plan import ResolvedPlan


@dataclass(frozen=True, slots=True)
class Block:
    """One sub-block's forward cost and what its forward leaves saved for backward."""

    op: str  # op class: gemm, attention, elementwise, embedding, loss
    flops: float
    bytes: float  # memory traffic of the forward
    saved: float  # activation bytes kept from forward to backward

    @property
    def bwd_flops(self) -> float:
        """Backward of a matmul is two matmuls (input and weight gradients): 2x forward."""
        return 2.0 * self.flops

    @property
    def bwd_bytes(self) -> float:
        return 2.0 * self.bytes


def _gemm(m: float, k: float, n: float, dt: int) -> tuple[float, float]:
    """FLOPs and bytes of an (m x k) @ (k x n) matmul."""
    return 2.0 * m * k * n, dt * (m * k + k * n + m * n)


class Anatomy:
    """Per-rank block costs for one resolved plan (computed once, looked up per instruction)."""

    def __init__(self, rp: ResolvedPlan):
        self.rp = rp
        m, p = rp.model, rp.plan
        self.dt = rp.dtype_bytes
        self.tp, self.cp, self.ep = p.tp, p.cp, p.ep
        self.seq = rp.seq_len
        self.tokens = p.mbs * rp.seq_len // p.cp  # tokens of one micro-batch on one cp rank
        self.sp_div = p.tp if p.sp else 1  # what sequence parallelism divides replicated activations by
        self.h = m.hidden

    # --- activations crossing block boundaries -------------------------------------------------------
    @cached_property
    def hidden_bytes(self) -> float:
        """One [s/cp, b, h] activation, as it crosses a block boundary on this rank (split by sp)."""
        return self.tokens * self.h * self.dt / self.sp_div

    @cached_property
    def full_hidden_bytes(self) -> float:
        """The same activation gathered over the tp group (what tp all-reduces move)."""
        return self.tokens * self.h * self.dt

    @cached_property
    def kv_bytes(self) -> float:
        """K and V of the whole sequence for this rank's KV heads (what cp all-gathers)."""
        m = self.rp.model
        per_tok = m.kv_heads * (m.qk_head_dim + m.value_head_dim) if not m.is_mla else m.heads * (m.qk_head_dim + m.value_head_dim)
        return self.rp.plan.mbs * self.seq * per_tok * self.dt / self.tp

    @cached_property
    def dispatch_bytes(self) -> float:
        """Tokens sent to experts by one rank: top_k copies of each of its tokens."""
        moe = self.rp.model.moe
        return self.tokens * moe.top_k * self.h * self.dt / self.sp_div if moe else 0.0

    # --- blocks --------------------------------------------------------------------------------------
    @cached_property
    def dense(self) -> dict[str, Block]:
        return {**self._attention(), **self._mlp()}

    @cached_property
    def moe(self) -> dict[str, Block]:
        return {**self._attention(), **self._moe()}

    def layer(self, i: int) -> dict[str, Block]:
        return self.moe if self.rp.model.is_moe_layer(i) else self.dense

    def _attention(self) -> dict[str, Block]:
        m, t, T, dt, h, sp = self.rp.model, self.tp, self.tokens, self.dt, self.h, self.sp_div
        qk, v = m.qk_head_dim, m.value_head_dim
        o_params = m.heads * v * h
        qkv_params = m.attention_matmul_params() - o_params
        f_qkv = 2.0 * T * qkv_params / t
        b_qkv = dt * (T * h + qkv_params / t + T * (m.heads * qk + 2 * m.kv_heads * max(qk, v)) / t)
        # attention core over the whole context: causal halves the work (load-balanced over cp)
        ctx = self.seq * (0.5 if m.causal else 1.0)
        f_attn = 2.0 * T * ctx * m.heads * (qk + v) / t
        q_bytes = T * m.heads * qk * dt / t
        kv_local = T * m.kv_heads * (qk + v) * dt / t if not m.is_mla else T * m.heads * (qk + v) * dt / t
        b_attn = 2 * q_bytes + kv_local * self.cp  # read q, k, v of the context, write o
        saved_attn = q_bytes + kv_local
        if not self.rp.plan.flash_attention and not self._selective:
            # softmax output (2 B), dropout mask (1 B), dropout output (2 B) per score: 5·a·s²·b
            saved_attn += 5.0 * m.heads * T * self.seq / t * (dt / 2)
        f_proj, b_proj = _gemm(T, m.heads * v / t, h, dt)
        ln = T * h * dt / sp  # a norm's saved input (replicated over tp unless sp)
        mask = T * h / sp  # dropout mask, 1 byte per element
        return {
            "qkv": Block("gemm", f_qkv, b_qkv, 2 * ln),
            "attn": Block("attention", f_attn, b_attn, saved_attn),
            "proj": Block("gemm", f_proj, b_proj, T * m.heads * v * dt / t + mask),
        }

    @property
    def _selective(self) -> bool:
        return self.rp.plan.recompute == "selective"

    def _mlp(self) -> dict[str, Block]:
        m, t, T, dt, h, sp = self.rp.model, self.tp, self.tokens, self.dt, self.h, self.sp_div
        width = m.ffn * (2 if m.gated else 1)
        f1, b1 = _gemm(T, h, width / t, dt)
        f2, b2 = _gemm(T, m.ffn / t, h, dt)
        ln = T * h * dt / sp
        return {
            "fc1": Block("gemm", f1, b1, 2 * ln + T * width * dt / t),
            "fc2": Block("gemm", f2, b2, T * m.ffn * dt / t + T * h / sp),
        }

    def _moe(self) -> dict[str, Block]:
        m, t, T, dt, h, sp = self.rp.model, self.tp, self.tokens, self.dt, self.h, self.sp_div
        moe = m.moe
        width = moe.expert_ffn * (2 if m.gated else 1)
        routed = T * moe.top_k  # token-expert pairs this rank's experts see (balanced routing)
        fr, br = _gemm(T, h, moe.experts, dt)
        fe1, be1 = _gemm(routed, h, width / t, dt)
        fe2, be2 = _gemm(routed, moe.expert_ffn / t, h, dt)
        shared_ffn = (moe.shared_expert_ffn or moe.expert_ffn) * moe.shared_experts
        fs1, bs1 = _gemm(T, h, shared_ffn * (2 if m.gated else 1) / t, dt)
        fs2, bs2 = _gemm(T, shared_ffn / t, h, dt)
        ln = T * h * dt / sp
        return {
            "router": Block("gemm", fr, br, 2 * ln + T * moe.experts * 4),
            "experts": Block("gemm", fe1 + fe2, be1 + be2, routed * (h + width / t + moe.expert_ffn / t) * dt),
            "moe_out": Block("gemm", fs1 + fs2, bs1 + bs2 + routed * h * dt,
                             T * (h + shared_ffn * (3 if m.gated else 2) / t) * dt + T * h / sp),
        }

    # --- embedding and head --------------------------------------------------------------------------
    @cached_property
    def embed(self) -> Block:
        return Block("embedding", 0.0, 2 * self.full_hidden_bytes, 0.0)

    @cached_property
    def head(self) -> dict[str, Block]:
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        f, b = _gemm(T, h, m.vocab / t, dt)
        logits = T * m.vocab / t * 4  # fp32 logits for the cross entropy
        return {
            "head": Block("gemm", f, b, T * h * dt / self.sp_div + T * h * dt + logits),
            "xent": Block("loss", 0.0, 2 * logits, 0.0),
            "loss": Block("loss", 0.0, 8.0 * T, 0.0),
        }

    # --- parameters ----------------------------------------------------------------------------------
    def layer_param_counts(self, i: int) -> tuple[float, float]:
        """(dense, expert) parameters of layer i held by one rank before ZeRO sharding."""
        m, p = self.rp.model, self.rp.plan
        norms = m.norm_params_per_layer()
        if not m.is_moe_layer(i):
            return (m.layer_params(i) - norms) / p.tp + norms, 0.0
        experts = m.moe.experts * m.expert_params()
        dense = (m.attention_params() + m.moe_mlp_params() - m.router_params() - experts) / p.tp
        return dense + norms + m.router_params(), experts / (p.tp * p.ep)

    def embed_params(self) -> float:
        return self.rp.model.embedding_params() / self.tp

    def head_params(self) -> float:
        m = self.rp.model
        own = m.lm_head_params() / self.tp + m.final_norm_params()
        if m.tied_embeddings and self.rp.plan.pp > 1:
            own += m.embedding_params() / self.tp
        return own
