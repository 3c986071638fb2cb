"""Decoder-only transformer specs (dense and MoE): fields, derived sizes and FLOPs, and lookup by name or file.

Reading order: the two spec classes and their checks; parameter counts; FLOPs; loading a spec from a
preset name (`simexec.specs.model_presets`) or a file (`simexec.specs.hf_import`).

Imports stdlib and pydantic only, so the simulator and the CLI can use it without torch.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from simexec.errors import SpecError


# ---------------------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------------------


class MoESpec(BaseModel):
    """Sparse MLP layers: `experts` routed experts, `top_k` chosen per token."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    experts: int = Field(gt=0, description="routed experts per MoE layer")
    top_k: int = Field(gt=0, description="experts each token is routed to")
    expert_ffn: int = Field(gt=0, description="hidden size of one expert's FFN")
    shared_experts: int = Field(0, ge=0, description="always-active experts (DeepSeek style), each of size expert_ffn")
    first_dense_layers: int = Field(0, ge=0, description="leading layers that keep a dense FFN (DeepSeek-V3: 3)")
    capacity_factor: Optional[float] = Field(
        None, gt=0, description="experts' buffers hold this times the balanced load, cut (tokens dropped) "
        "or padded to it (GShard, Switch; Megatron-LM's --moe-expert-capacity-factor with "
        "--moe-pad-expert-input-to-capacity); None: every routed token, no padding")
    shared_expert_ffn: Optional[int] = Field(
        None, gt=0, description="FFN size of each shared expert; None: expert_ffn (Qwen2-MoE: one wide shared expert)"
    )
    router_groups: int = Field(
        1, gt=0, description="group-limited routing: the experts in this many equal groups, each token's top_k "
        "taken from its `router_group_topk` best groups (DeepSeek-V3's node-limited routing: n_group 8, "
        "topk_group 4; Megatron-Core's --moe-router-num-groups / --moe-router-group-topk); 1: no groups")
    router_group_topk: int = Field(1, gt=0, description="groups each token's experts may come from")

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"moe.top_k {self.top_k} exceeds moe.experts {self.experts}")
        if self.router_groups > 1:
            if self.experts % self.router_groups:
                raise ValueError(f"moe.router_groups {self.router_groups} does not divide moe.experts {self.experts}")
            if not self.router_group_topk <= self.router_groups:
                raise ValueError(f"moe.router_group_topk {self.router_group_topk} exceeds moe.router_groups "
                                 f"{self.router_groups}")
            if self.top_k % self.router_group_topk or \
                    self.top_k > self.router_group_topk * (self.experts // self.router_groups):
                raise ValueError(f"moe.top_k {self.top_k} cannot be taken from {self.router_group_topk} groups of "
                                 f"{self.experts // self.router_groups} experts (top_k a multiple of router_group_topk)")
        return self


def keys_per_query(seq: int, window: Optional[int] = None) -> float:
    """Keys the average query of causal attention over `seq` positions attends to: seq/2 (the
    triangle, counted as the continuous s^2/2 that the causal kernels' cost follows), or under a
    sliding window w < seq the band's s*w - w^2/2 pairs spread over the s queries."""
    if window is None or window >= seq:
        return seq / 2.0
    return window - window * window / (2.0 * seq)


class ModelSpec(BaseModel):
    """A decoder-only transformer. Sizes are per layer unless said otherwise.

    Multi-head latent attention (MLA, DeepSeek-V2/V3) is on when `kv_lora_rank` is set. Then
    `head_dim` is the per-head *non-rotary* query/key width (DeepSeek's qk_nope_head_dim),
    `qk_rope_head_dim` the rotary part added to it, and `v_head_dim` the value width.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0, description="== heads for MHA, 1 for MQA, in between for GQA")
    head_dim: int = Field(gt=0)
    ffn: int = Field(gt=0, description="dense FFN hidden size")
    gated: bool = Field(description="SwiGLU-style gated FFN (3 matrices) instead of 2")
    vocab: int = Field(gt=0)
    seq_len: int = Field(gt=0, description="default training sequence length")
    tied_embeddings: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = Field(False, description="linear layers carry biases (GPT-2/3 style)")
    learned_pos: bool = Field(False, description="learned absolute position embedding (GPT) instead of RoPE")
    causal: bool = True
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="dropout probability on attention probabilities and residual branches (GPT-2/3, "
        "Megatron GPT: 0.1); 0: no dropout, so no masks kept for the backward (Llama, Mistral, Mixtral, DeepSeek)",
    )
    moe: Optional[MoESpec] = None
    source: str = Field("", description="where the numbers come from")
    # Additions; all default to "absent" so the fields above keep their meaning.
    qkv_bias: bool = Field(False, description="biases on q, k, v only (Qwen2); implied by `bias`")
    qk_norm: bool = Field(False, description="a norm (of kind `norm`) over each head's q and k, one weight of "
                          "head_dim shared by the heads, before the rotary embedding (Qwen3, Gemma 3)")
    sliding_window: Optional[int] = Field(
        None, gt=0, description="sliding-window attention: each query attends to the last `sliding_window` "
        "positions, itself included (Mistral 7B: 4096); None: the whole causal context"
    )
    full_attention_every: int = Field(
        0, ge=0, description="with sliding_window: every k-th layer (i + 1 divisible by k) attends to the whole "
        "context (Gemma 2, gpt-oss: 2; Gemma 3: 6); 0: every layer has the window"
    )
    attention_sinks: bool = Field(
        False, description="a learned logit per head joins each query's softmax as one more key without a value "
        "(gpt-oss): one parameter per head per layer; its FLOPs are negligible")
    max_positions: Optional[int] = Field(
        None, gt=0, description="rows of the learned position table; None: seq_len (only with learned_pos)"
    )
    q_lora_rank: Optional[int] = Field(
        None, gt=0, description="MLA: rank of the query down-projection; None: a full q_proj"
    )
    kv_lora_rank: Optional[int] = Field(None, gt=0, description="MLA: rank of the compressed KV latent; None: no MLA")
    qk_rope_head_dim: Optional[int] = Field(None, gt=0, description="MLA: rotary part of each q/k head")
    v_head_dim: Optional[int] = Field(None, gt=0, description="MLA: value width per head; None: head_dim")
    mtp_layers: int = Field(
        0, ge=0, description="multi-token prediction depths (DeepSeek-V3 §2.2: 1; HF num_nextn_predict_layers,"
        " Megatron-Core's mtp_num_layers): each two norms, a 2h->h projection, a block like the last layer and the"
        " shared head and loss again; 0: none")
    mtp_loss_scaling_factor: float = Field(
        0.1, ge=0, description="weight of the MTP losses (their mean over the depths) added to the main loss"
        " (DeepSeek-V3 §2.2 lambda: 0.3, then 0.1; Megatron-Core's mtp_loss_scaling_factor, default 0.1)")

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        if self.moe is not None and self.moe.first_dense_layers >= self.layers:
            raise ValueError(
                f"moe.first_dense_layers {self.moe.first_dense_layers} leaves no MoE layer among layers {self.layers}"
            )
        if self.learned_pos and self.max_positions is not None and self.seq_len > self.max_positions:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds the learned position table max_positions {self.max_positions}"
            )
        if self.sliding_window is not None and not self.causal:
            raise ValueError(f"sliding_window {self.sliding_window} is modelled for causal attention only (causal is False)")
        if self.full_attention_every and self.sliding_window is None:
            raise ValueError(f"full_attention_every {self.full_attention_every} needs sliding_window to be set")
        if self.full_attention_every == 1:
            raise ValueError("full_attention_every 1 leaves no layer with the sliding window (0: every layer has it)")
        if self.is_mla:
            if self.qk_rope_head_dim is None:
                raise ValueError(f"MLA (kv_lora_rank {self.kv_lora_rank}) needs qk_rope_head_dim")
            if self.kv_heads != self.heads:
                raise ValueError(
                    f"MLA expands the latent to every head: kv_heads {self.kv_heads} must equal heads {self.heads}"
                )
            if self.bias or self.qkv_bias:
                raise ValueError("MLA attention with linear biases is not modelled (bias/qkv_bias must be False)")
            if self.qk_norm:
                raise ValueError("MLA normalises its latents, not q and k heads: qk_norm must be False")
        else:
            stray = {k: getattr(self, k) for k in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim") if getattr(self, k)}
            if stray:
                raise ValueError(f"MLA fields {stray} need kv_lora_rank to be set")
        return self

    # -- small facts used below ----------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3) instead of MHA/GQA."""
        return self.kv_lora_rank is not None

    @property
    def kv_head_count(self) -> int:
        """K/V heads as attention reads them: kv_heads, or every head under MLA (whose latent is
        expanded into a key and a value per head)."""
        return self.heads if self.is_mla else self.kv_heads

    @property
    def attention_widths(self) -> tuple[int, int, int]:
        """Elements per token, over all heads, of (q, k and v together, the attention's output)."""
        return (self.heads * self.qk_head_dim, self.kv_head_count * (self.qk_head_dim + self.value_head_dim),
                self.heads * self.value_head_dim)

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: head_dim, plus the rotary part under MLA (128 + 64 for DeepSeek-V3)."""
        return self.head_dim + (self.qk_rope_head_dim or 0)

    @property
    def value_head_dim(self) -> int:
        """Width of one value head: head_dim, or v_head_dim under MLA."""
        return self.v_head_dim or self.head_dim

    def attention_window(self, i: int, seq_len: Optional[int] = None) -> Optional[int]:
        """The sliding window of layer i (0-based), or None where it attends to the whole context
        (also where the window holds a whole sequence of `seq_len`, when given)."""
        if self.sliding_window is None or (seq_len is not None and self.sliding_window >= seq_len):
            return None
        i = self.block_kind_layer(i)
        k = self.full_attention_every
        return None if k and (i + 1) % k == 0 else self.sliding_window

    def mtp_block(self, depth: int) -> int:
        """The layer number of MTP depth `depth`'s transformer block: after the main layers (0..layers-1)
        and the head (`layers`, the lowering's unit for it)."""
        return self.layers + 1 + depth

    def block_kind_layer(self, i: int) -> int:
        """The main layer whose kind block i has: itself, or for an MTP block the last layer (Megatron-Core
        builds the MTP block from the decoder's last layer spec; training.py's `last_layer_is_moe`)."""
        return self.layers - 1 if self.layers < i <= self.layers + self.mtp_layers else i

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) has a sparse MLP: moe is set and i >= moe.first_dense_layers (an MTP block:
        as the last layer)."""
        i = self.block_kind_layer(i)
        if not 0 <= i < self.layers:
            raise ValueError(f"layer index {i} out of range for {self.name} with {self.layers} layers")
        return self.moe is not None and i >= self.moe.first_dense_layers

    @property
    def moe_layers(self) -> int:
        """Number of layers with a sparse MLP."""
        return 0 if self.moe is None else self.layers - self.moe.first_dense_layers

    # -------------------------------------------------------------------------------------------------
    # Parameter counts. Each matches the PyTorch module of the reference implementation (HF
    # transformers / Megatron-LM): weights of every Linear, Embedding and norm, plus biases.
    # -------------------------------------------------------------------------------------------------

    def _norm(self, width: int) -> int:
        """One norm over `width` features: LayerNorm has weight+bias, RMSNorm a weight only."""
        return 2 * width if self.norm == "layernorm" else width

    def attention_matmul_params(self) -> int:
        """Weights of the attention projections only (no biases or norms): what the matmuls multiply by.

        MHA/GQA: q and o are hidden x heads*head_dim, k and v hidden x kv_heads*head_dim.
        MLA (DeepSeek-V3, arXiv 2412.19437 sec. 2.1.1; HF modeling_deepseek_v3): q_a (hidden x q_lora_rank),
        q_b (q_lora_rank x heads*qk_head_dim), kv_a (hidden x kv_lora_rank+rope), kv_b
        (kv_lora_rank x heads*(head_dim+v_head_dim)), o (heads*v_head_dim x hidden).
        """
        h = self.hidden
        if not self.is_mla:
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            return 2 * h * q + 2 * h * kv
        nq = self.heads * self.qk_head_dim
        q = h * nq if self.q_lora_rank is None else h * self.q_lora_rank + self.q_lora_rank * nq
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.heads * (self.head_dim + self.value_head_dim)
        o = self.heads * self.value_head_dim * h
        return q + kv_a + kv_b + o

    def attention_params(self) -> int:
        """attention_matmul_params plus biases (all four projections if `bias`, q/k/v if `qkv_bias`)
        and, under MLA, the norms on the q and kv latents."""
        n = self.attention_matmul_params()
        if self.is_mla:
            return n + self._norm(self.kv_lora_rank) + (self._norm(self.q_lora_rank) if self.q_lora_rank else 0)
        qkv_bias = (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.attention_sinks:
            n += self.heads
        if self.bias:
            n += qkv_bias + self.hidden
        elif self.qkv_bias:
            n += qkv_bias
        return n

    def norm_params_per_layer(self) -> int:
        """A block's norms, replicated over tensor parallelism: the two pre-norms (before attention
        and before the MLP) and, with qk_norm, the ones on q and k heads."""
        return self.pre_norm_params() * 2 + self.qk_norm_params()

    def latent_matmul_params(self) -> int:
        """MLA's down projections: to the q latent (if any) and to the kv latent with the shared rotary
        key. 0 without MLA."""
        if not self.is_mla:
            return 0
        return self.hidden * ((self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim)

    def latent_params(self) -> int:
        """MLA's down projections and the norms of its latents, which tensor parallelism replicates
        (DeepSeek-V3's reference model and Megatron-LM split the heads, not the latents). 0 without MLA."""
        if not self.is_mla:
            return 0
        norms = self._norm(self.kv_lora_rank) + (self._norm(self.q_lora_rank) if self.q_lora_rank else 0)
        return self.latent_matmul_params() + norms

    def tp_replicated_params_per_layer(self) -> int:
        """A layer's parameters that every tensor-parallel rank holds whole (beside a MoE router):
        its norms and MLA's latent projections."""
        return self.norm_params_per_layer() + self.latent_params()

    def pre_norm_params(self) -> int:
        """One norm over the residual stream (each pre-norm, the final norm)."""
        return self._norm(self.hidden)

    def qk_norm_params(self) -> int:
        """The norms over each head's q and k (qk_norm): one head_dim-wide norm each."""
        return 2 * self._norm(self.head_dim) if self.qk_norm else 0

    def _ffn_matmul(self, ffn: int) -> int:
        """Weights of one FFN of width `ffn`: 3 matrices if gated (gate, up, down), else 2."""
        return (3 if self.gated else 2) * self.hidden * ffn

    def _ffn(self, ffn: int) -> int:
        """One FFN with its biases (one per output feature of each matrix) when `bias`."""
        biases = ((2 if self.gated else 1) * ffn + self.hidden) if self.bias else 0
        return self._ffn_matmul(ffn) + biases

    def dense_mlp_params(self) -> int:
        """The dense FFN: 2*hidden*ffn (+ffn+hidden biases), or 3*hidden*ffn when gated (SwiGLU)."""
        return self._ffn(self.ffn)

    def expert_params(self) -> int:
        """One routed expert: an FFN of width moe.expert_ffn. 0 for a dense model."""
        return self._ffn(self.moe.expert_ffn) if self.moe else 0

    def _shared_ffn(self) -> int:
        return self.moe.shared_expert_ffn or self.moe.expert_ffn

    def shared_expert_params(self) -> int:
        """One shared expert: an FFN of width moe.shared_expert_ffn (default expert_ffn). 0 if none."""
        if not self.moe or not self.moe.shared_experts:
            return 0
        return self._ffn(self._shared_ffn())

    def router_params(self) -> int:
        """The gate: hidden x experts, no bias (Mixtral, DeepSeek; gpt-oss's per-expert bias, DeepSeek-V3's
        256-entry load-balancing bias and Qwen2-MoE's 1-wide shared-expert gate are left out)."""
        return self.hidden * self.moe.experts if self.moe else 0

    def _moe_mlp(self, routed: int) -> int:
        """Router + `routed` routed experts + the shared experts."""
        shared = self.moe.shared_experts * self.shared_expert_params()
        return self.router_params() + routed * self.expert_params() + shared

    def moe_mlp_params(self) -> int:
        """A sparse MLP: router + experts * expert + shared_experts * shared expert. 0 for a dense model."""
        return self._moe_mlp(self.moe.experts) if self.moe else 0

    def mlp_params(self, i: int) -> int:
        """The MLP of layer i: sparse or dense."""
        return self.moe_mlp_params() if self.is_moe_layer(i) else self.dense_mlp_params()

    def layer_params(self, i: int) -> int:
        """One transformer block: attention + two norms + its MLP."""
        return self.attention_params() + self.norm_params_per_layer() + self.mlp_params(i)

    def embedding_params(self) -> int:
        """Token embedding vocab x hidden, plus a learned position table (max_positions or seq_len) x hidden."""
        pos = (self.max_positions or self.seq_len) * self.hidden if self.learned_pos else 0
        return self.vocab * self.hidden + pos

    def lm_head_params(self) -> int:
        """Output projection hidden x vocab, no bias; 0 when it shares the token embedding."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def final_norm_params(self) -> int:
        """The norm after the last block."""
        return self.pre_norm_params()

    @property
    def params(self) -> int:
        """All parameters (counted by layer kind, so it checks against sum(layer_params))."""
        dense_layers = self.layers - self.moe_layers
        return (
            self.layers * (self.attention_params() + self.norm_params_per_layer())
            + dense_layers * self.dense_mlp_params()
            + self.moe_layers * self.moe_mlp_params()
            + self.embedding_params()
            + self.lm_head_params()
            + self.final_norm_params()
        )

    def mtp_layer_params(self) -> int:
        """One MTP depth's own parameters (Megatron-Core's MultiTokenPredictionLayer): the norms of the
        hidden state and of the shifted token embedding, the 2h->h projection, a transformer block like
        the last layer's and its final norm. The embedding and the output head are the model's, shared."""
        return 3 * self.pre_norm_params() + 2 * self.hidden * self.hidden + self.layer_params(self.layers - 1)

    @property
    def mtp_params(self) -> int:
        """The MTP module's trained parameters (not in `params`, which is the main model: DeepSeek-V3's 671B)."""
        return self.mtp_layers * self.mtp_layer_params()

    @property
    def checkpoint_params(self) -> int:
        """Parameters of a Hugging Face checkpoint with the MTP module: each depth stores its own copy of
        the embedding and the head (DeepSeek-V3: 671B + 14B = 685B, its model card)."""
        return self.params + self.mtp_params + self.mtp_layers * (self.embedding_params() + self.vocab * self.hidden)

    @property
    def active_params(self) -> int:
        """Parameters one token uses (embeddings included, as Mixtral's 12.9B and DeepSeek-V3's 37B are)."""
        if not self.moe:
            return self.params
        # A token meets the router, top_k routed experts and the shared experts of each sparse layer.
        return self.params - self.moe_layers * (self.moe_mlp_params() - self._moe_mlp(self.moe.top_k))

    @property
    def non_embedding_params(self) -> int:
        """params minus token/position embeddings and the LM head (Kaplan et al. 2020's N)."""
        return self.params - self.embedding_params() - self.lm_head_params()

    # -------------------------------------------------------------------------------------------------
    # FLOPs per token (multiply-add = 2 FLOPs). Counted: every matmul a token goes through; not counted:
    # biases, norms, activations, softmax, the embedding lookup (elementwise, < 1% at these sizes).
    # -------------------------------------------------------------------------------------------------

    def _seq(self, seq_len: Optional[int]) -> int:
        s = self.seq_len if seq_len is None else seq_len
        if s <= 0:
            raise ValueError(f"seq_len must be positive, got {s}")
        return s

    def mlp_active_matmul_params(self, i: int) -> int:
        """Matmul weights one token meets in layer i's MLP: dense FFN, or router + top_k + shared experts."""
        if not self.is_moe_layer(i):
            return self._ffn_matmul(self.ffn)
        shared = self.moe.shared_experts * self._ffn_matmul(self._shared_ffn())
        return self.router_params() + self.moe.top_k * self._ffn_matmul(self.moe.expert_ffn) + shared

    def attention_score_flops_per_token(self, seq_len: Optional[int] = None, window: Optional[int] = None) -> float:
        """Q.K^T and softmax.V for one token in one layer: 2*s*heads*qk_head_dim + 2*s*heads*value_head_dim
        (= 4*s*heads*head_dim for MHA/GQA) for full attention over s keys. Causal: the average token
        sees `keys_per_query` keys (s/2 without a window; Megatron's eq. 3 counts the full term).
        Under MLA the K/V are expanded per head, as in training (no weight absorption)."""
        s = self._seq(seq_len)
        keys = keys_per_query(s, window) if self.causal else s
        return 2.0 * keys * self.heads * (self.qk_head_dim + self.value_head_dim)

    def layer_forward_flops_per_token(self, i: int, seq_len: Optional[int] = None) -> float:
        """Layer i: 2 x (attention projections + active MLP matmul weights) + attention scores."""
        weights = self.attention_matmul_params() + self.mlp_active_matmul_params(i)
        return 2.0 * weights + self.attention_score_flops_per_token(seq_len, self.attention_window(i))

    def lm_head_flops_per_token(self) -> float:
        """Logits: 2*hidden*vocab, whether or not the head is tied to the embedding."""
        return 2.0 * self.hidden * self.vocab

    def forward_flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Forward FLOPs per token: sum of layer_forward_flops_per_token + the LM head.

        For a dense model this is 2*N_matmul + 2*hidden*vocab + layers * attention scores, i.e. the
        "2N + 2*n_layer*n_ctx*d_attn" of Kaplan et al. 2020, with causal attention counted at half.
        """
        s = self._seq(seq_len)
        layers = sum(self.layer_forward_flops_per_token(i, s) for i in range(self.layers))
        return layers + self.lm_head_flops_per_token()

    def mtp_forward_flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """The MTP depths' forward FLOPs per token: each its 2h->h projection, its block and the head's
        logits again (what Megatron's num_floating_point_operations adds for mtp_num_layers; the norms,
        which Megatron also counts, are not matmuls)."""
        block = self.layer_forward_flops_per_token(self.layers - 1, seq_len)
        return self.mtp_layers * (2.0 * 2 * self.hidden * self.hidden + block + self.lm_head_flops_per_token())

    def training_flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Forward + backward = 3 x forward (backward does two matmuls per forward one); no recompute.
        Full activation recompute adds one more forward (Megatron eq. 3 counts 4x). MTP depths are
        included, as Megatron-LM's training.py counts them in the FLOPs its MFU divides."""
        return 3.0 * (self.forward_flops_per_token(seq_len) + self.mtp_forward_flops_per_token(seq_len))


# ---------------------------------------------------------------------------------------------------
# Loading: preset name, Hugging Face config.json, or a JSON/YAML file of ModelSpec fields
# ---------------------------------------------------------------------------------------------------


def _one_line(err: ValidationError) -> str:
    """A pydantic error as one line: 'field: problem (got value)' joined by '; '."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if loc and not isinstance(e.get("input"), dict) else ""
        parts.append(f"{loc}: {msg}{got}" if loc else msg)
    return "; ".join(parts)


def build_model_spec(fields: dict[str, Any], origin: str) -> ModelSpec:
    """A ModelSpec from its fields; a validation error becomes one SpecError line naming `origin`."""
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as e:
        raise SpecError(f"invalid model spec from {origin}: {_one_line(e)}") from None


def list_models() -> list[ModelSpec]:
    """Every preset, in MODELS order."""
    from simexec.specs.model_presets import MODELS

    return list(MODELS.values())


def get_model(name_or_path: str, seq_len: Optional[int] = None) -> ModelSpec:
    """A preset (see model_presets.MODELS) by name, or a local file: a Hugging Face config.json (it has
    `model_type`), a checkpoint directory holding one, or a JSON/YAML file of ModelSpec fields (`name`
    defaults to the file name). `seq_len` overrides the spec's. Never touches the network."""
    from simexec.specs.hf_import import load_model_file
    from simexec.specs.model_presets import MODELS

    if name_or_path in MODELS:
        spec, origin = MODELS[name_or_path], f"preset {name_or_path}"
    else:
        path = Path(name_or_path).expanduser()
        if path.exists():
            spec, origin = load_model_file(path), str(path)
        elif path.suffix in (".json", ".yaml", ".yml") or "/" in name_or_path:
            raise SpecError(f"model file not found: {name_or_path}")
        else:
            close = difflib.get_close_matches(name_or_path, MODELS, n=5, cutoff=0.5) or list(MODELS)[:5]
            raise SpecError(
                f"unknown model {name_or_path!r}; close names: {', '.join(close)} "
                "(or pass the path of a config.json / JSON / YAML file)"
            )
    if seq_len is not None:
        spec = build_model_spec({**spec.model_dump(), "seq_len": seq_len}, f"{origin} with seq_len {seq_len}")
    return spec
