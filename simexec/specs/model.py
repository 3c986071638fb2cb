"""Decoder-only transformer specs (dense and MoE): fields, derived sizes and FLOPs, presets, HF import.

Reading order: the two spec classes and their checks; parameter counts; FLOPs; the presets; loading a
spec from a preset name, a Hugging Face ``config.json`` or a file of ModelSpec fields.

Imports stdlib and pydantic only, so the simulator and the CLI can use it without torch.
"""
from __future__ import annotations

import difflib
import json
import warnings
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

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"moe.top_k {self.top_k} exceeds moe.experts {self.experts}")
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
    max_positions: Optional[int] = Field(
        None, gt=0, description="rows of the learned position table; None: seq_len (only with learned_pos)"
    )
    q_lora_rank: Optional[int] = Field(
        None, gt=0, description="MLA: rank of the query down-projection; None: a full q_proj"
    )
    kv_lora_rank: Optional[int] = Field(None, gt=0, description="MLA: rank of the compressed KV latent; None: no MLA")
    qk_rope_head_dim: Optional[int] = Field(None, gt=0, description="MLA: rotary part of each q/k head")
    v_head_dim: Optional[int] = Field(None, gt=0, description="MLA: value width per head; None: head_dim")

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
        k = self.full_attention_every
        return None if k and (i + 1) % k == 0 else self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (0-based) has a sparse MLP: moe is set and i >= moe.first_dense_layers."""
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
        """The gate: hidden x experts, no bias (Mixtral, DeepSeek; DeepSeek-V3's 256-entry
        load-balancing bias and Qwen2-MoE's 1-wide shared-expert gate are left out)."""
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

    def training_flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Forward + backward = 3 x forward (backward does two matmuls per forward one); no recompute.
        Full activation recompute adds one more forward (Megatron eq. 3 counts 4x)."""
        return 3.0 * self.forward_flops_per_token(seq_len)


# ---------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------

_GPT3 = "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1"
_MEGATRON = "Narayanan et al. SC'21, 'Efficient Large-Scale Language Model Training on GPU Clusters', Table 1"


def _gpt3(name: str, layers: int, hidden: int, heads: int, head_dim: int, note: str = "") -> ModelSpec:
    """GPT-3: learned positions, LayerNorm, biases, FFN 4h, tied embeddings, vocab 50257, context 2048."""
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=head_dim,
        ffn=4 * hidden, gated=False, vocab=50257, seq_len=2048, tied_embeddings=True, norm="layernorm",
        bias=True, learned_pos=True, dropout=0.1, source=_GPT3 + note,
    )


def _megatron(name: str, heads: int, hidden: int, layers: int, published: str) -> ModelSpec:
    """Megatron-LM GPT: as GPT-3 but vocab 51200 (padded), sized by Table 1's heads/hidden/layers."""
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
        ffn=4 * hidden, gated=False, vocab=51200, seq_len=2048, tied_embeddings=True, norm="layernorm",
        bias=True, learned_pos=True, dropout=0.1, source=f"{_MEGATRON} ({published} row)",
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq_len: int, source: str, tied: bool = False) -> ModelSpec:
    """Llama: RMSNorm, SwiGLU, RoPE, no biases; embeddings untied but in Llama 3.2 1B/3B."""
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads,
        ffn=ffn, gated=True, vocab=vocab, seq_len=seq_len, tied_embeddings=tied, norm="rmsnorm",
        bias=False, learned_pos=False, source=source,
    )


def _presets() -> dict[str, ModelSpec]:
    l2 = "HF meta-llama/Llama-2-{}-hf config.json; Touvron et al. 2023 (Llama 2), context 4096"
    l3 = "HF meta-llama/{} config.json; Llama 3 Herd of Models 2024, pre-training context 8192"
    specs = [
        _gpt3("gpt3-125m", 12, 768, 12, 64),
        # Table 2.1 prints 24 heads x 128 = 3072 != d_model 2048 (1.52B); 16 x 128 gives the 1.3B.
        _gpt3("gpt3-1.3b", 24, 2048, 16, 128, "; 16 heads (the table's 24 x 128 does not equal d_model 2048)"),
        _gpt3("gpt3-2.7b", 32, 2560, 32, 80),
        _gpt3("gpt3-6.7b", 32, 4096, 32, 128),
        # Table 2.1 prints d_model 5140, inconsistent with 40 heads x 128; 5120 is the usual reading.
        _gpt3("gpt3-13b", 40, 5120, 40, 128, "; d_model 5120 (the table's 5140 does not equal 40 x 128)"),
        _gpt3("gpt3-175b", 96, 12288, 96, 128),
        _megatron("megatron-1.7b", 24, 2304, 24, "1.7B"),
        _megatron("megatron-3.6b", 32, 3072, 30, "3.6B"),
        _megatron("megatron-7.5b", 32, 4096, 36, "7.5B"),
        _megatron("megatron-18.4b", 48, 6144, 40, "18.4B"),
        _megatron("megatron-39.1b", 64, 8192, 48, "39.1B"),
        _megatron("megatron-76.1b", 80, 10240, 60, "76.1B"),
        _megatron("megatron-145.6b", 96, 12288, 80, "145.6B"),
        _megatron("megatron-310.1b", 128, 16384, 96, "310.1B"),
        _megatron("megatron-529.6b", 128, 20480, 105, "529.6B"),
        _megatron("megatron-1t", 160, 25600, 128, "1008B"),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, l2.format("7b")),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, l2.format("13b")),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, l2.format("70b")),
        _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 8192,
               l3.format("Llama-3.2-1B") + " (1,235,814,400 parameters, the LM head tied to the embedding)", tied=True),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, l3.format("Meta-Llama-3-8B")),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, l3.format("Meta-Llama-3-70B")),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, l3.format("Llama-3.1-405B")),
        ModelSpec(
            name="mistral-7b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
            gated=True, vocab=32000, seq_len=8192, tied_embeddings=False, norm="rmsnorm", sliding_window=4096,
            source="Jiang et al. 2023, Mistral 7B, Table 1 (window 4096, context 8192); HF "
            "mistralai/Mistral-7B-v0.1 config.json (7,241,732,096 parameters)",
        ),
        ModelSpec(
            name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
            gated=True, vocab=32000, seq_len=4096, tied_embeddings=False, norm="rmsnorm",
            moe=MoESpec(experts=8, top_k=2, expert_ffn=14336),
            source="HF mistralai/Mixtral-8x7B-v0.1 config.json; Jiang et al. 2024. seq_len 4096 chosen as a "
            "training length (config max_position_embeddings is 32768: pass seq_len=32768 for that)",
        ),
        ModelSpec(
            name="deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128, head_dim=128, ffn=18432,
            gated=True, vocab=129280, seq_len=4096, tied_embeddings=False, norm="rmsnorm",
            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
            moe=MoESpec(experts=256, top_k=8, expert_ffn=2048, shared_experts=1, first_dense_layers=3),
            source="HF deepseek-ai/DeepSeek-V3 config.json; DeepSeek-AI arXiv 2412.19437 (671B total, 37B "
            "active, 4K pre-training context). The multi-token-prediction module (14B) is left out",
        ),
        # Tiny models that train on a CPU. The executor's tests rely on these exact numbers
        # (tp up to 4, pp up to 4, cp 2): change them only together with those tests.
        ModelSpec(
            name="gpt-tiny", layers=4, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=256, gated=False,
            vocab=512, seq_len=64, tied_embeddings=False, norm="layernorm", bias=True, learned_pos=True,
            # no dropout: the executor runs none (a seeded dropout that matches the single process
            # under tp / sp / cp would need masks drawn per global element), so the simulator must not
            # count its masks either
            dropout=0.0, source="simexec test model (GPT-2 shaped)",
        ),
        ModelSpec(
            name="moe-tiny", layers=4, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=256, gated=True,
            vocab=512, seq_len=64, tied_embeddings=False, norm="rmsnorm", bias=False, learned_pos=False,
            moe=MoESpec(experts=4, top_k=2, expert_ffn=128, shared_experts=1, first_dense_layers=0,
                        capacity_factor=None),
            source="simexec test model (DeepSeek-MoE shaped: routed + shared experts)",
        ),
    ]
    return {m.name: m for m in specs}


MODELS: dict[str, ModelSpec] = _presets()


def list_models() -> list[ModelSpec]:
    """Every preset, in MODELS order."""
    return list(MODELS.values())


# ---------------------------------------------------------------------------------------------------
# Loading: preset name, Hugging Face config.json, or a JSON/YAML file of ModelSpec fields
# ---------------------------------------------------------------------------------------------------

_MISSING = object()


def _one_line(err: ValidationError) -> str:
    """A pydantic error as one line: 'field: problem (got value)' joined by '; '."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if loc and not isinstance(e.get("input"), dict) else ""
        parts.append(f"{loc}: {msg}{got}" if loc else msg)
    return "; ".join(parts)


def _build(fields: dict[str, Any], origin: str) -> ModelSpec:
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as e:
        raise SpecError(f"invalid model spec from {origin}: {_one_line(e)}") from None


def _get(cfg: dict, key: str, origin: str, default: Any = _MISSING, kind: type = int) -> Any:
    """cfg[key], checked to be a `kind`; SpecError naming the key and the file when absent or mistyped."""
    if key not in cfg or cfg[key] is None:
        if default is _MISSING:
            mtype = f" (model_type {cfg['model_type']})" if key != "model_type" and "model_type" in cfg else ""
            raise SpecError(f"missing key '{key}' in {origin}{mtype}")
        return default
    v = cfg[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise SpecError(f"key '{key}' in {origin} must be of type {kind.__name__}, got {v!r}")
    return v


def _head_dim(hidden: int, heads: int, origin: str, explicit: Optional[int] = None) -> int:
    """The config's head_dim if it gives one (Llama 3.x, Gemma), else hidden / heads."""
    if explicit is not None:
        return explicit
    if heads <= 0 or hidden % heads:
        raise SpecError(f"{origin}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return hidden // heads


def _dropout(cfg: dict, origin: str, keys: tuple[str, ...], default: float) -> float:
    """The largest of the config's dropout probabilities `keys` (each defaults to transformers'
    default for the family when absent): masks are kept wherever any of them is on."""
    vals = []
    for k in keys:
        v = cfg.get(k)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
            raise SpecError(f"key '{k}' in {origin} must be a probability in [0, 1), got {v!r}")
        vals.append(float(v))
    return max(vals)


def _sliding_window(cfg: dict, origin: str, layers: int) -> dict[str, Any]:
    """`sliding_window` and `full_attention_every` of a config: which layers have the window comes
    from `layer_types` where the config lists them (transformers >= 4.54), else from Qwen2/3's
    `use_sliding_window` (layers from `max_window_layers` on), else every layer has Mistral's
    `sliding_window` when it is set."""
    types = _get(cfg, "layer_types", origin, default=None, kind=list)
    if types is not None:
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise SpecError(f"key 'layer_types' in {origin} must list 'sliding_attention' or 'full_attention' "
                            f"for each of the {layers} layers, got {types!r}")
        sliding = [t == "sliding_attention" for t in types]
    elif "use_sliding_window" in cfg:
        on = _get(cfg, "use_sliding_window", origin, default=False, kind=bool)
        first = _get(cfg, "max_window_layers", origin, default=0)
        sliding = [on and i >= first for i in range(layers)]
    else:
        sliding = [cfg.get("sliding_window") is not None] * layers
    if not any(sliding):
        return {}
    window = _get(cfg, "sliding_window", origin)
    if all(sliding):
        return dict(sliding_window=window)
    for k in range(2, layers + 1):
        if all(s == bool((i + 1) % k) for i, s in enumerate(sliding)):
            return dict(sliding_window=window, full_attention_every=k)
    full = [i for i, s in enumerate(sliding) if not s]
    raise SpecError(f"{origin}: layers {full} attend fully and the others through a window of {window}; "
                    "simexec models a window on every layer or every layer but each k-th")


def _hf_llama_like(cfg: dict, origin: str) -> dict[str, Any]:
    """llama, mistral, phi3, qwen2, qwen3 (and the base of the MoE ones): RMSNorm, SwiGLU, RoPE
    (Phi-3 fuses q, k, v into one matrix and gate and up into another: the same weights); Qwen3's
    RMSNorm on each head's q and k; Mistral's, Phi-3's and Qwen's sliding-window attention. Dropout is
    the largest of the attention's and the residual branches' (Phi-3's `resid_pdrop`)."""
    hidden = _get(cfg, "hidden_size", origin)
    heads = _get(cfg, "num_attention_heads", origin)
    layers = _get(cfg, "num_hidden_layers", origin)
    mtype = cfg["model_type"]
    attention_bias = _get(cfg, "attention_bias", origin, default=mtype in ("qwen2", "qwen2_moe"), kind=bool)
    mlp_bias = _get(cfg, "mlp_bias", origin, default=False, kind=bool)
    return dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=_get(cfg, "num_key_value_heads", origin, default=heads),
        head_dim=_head_dim(hidden, heads, origin, _get(cfg, "head_dim", origin, default=None)),
        ffn=_get(cfg, "intermediate_size", origin),
        gated=True,
        vocab=_get(cfg, "vocab_size", origin),
        seq_len=_get(cfg, "max_position_embeddings", origin),
        tied_embeddings=_get(cfg, "tie_word_embeddings", origin, default=False, kind=bool),
        norm="rmsnorm",
        # Llama's attention_bias covers q,k,v,o; without mlp_bias we model q,k,v only (o's bias is off by hidden).
        bias=attention_bias and mlp_bias,
        qkv_bias=attention_bias and not mlp_bias,
        qk_norm=mtype in ("qwen3", "qwen3_moe"),
        dropout=_dropout(cfg, origin, ("attention_dropout", "hidden_dropout", "resid_pdrop"), 0.0),
        **_sliding_window(cfg, origin, layers),
    )


def _hf_gemma(cfg: dict, origin: str) -> dict[str, Any]:
    """Gemma (1): as Llama, with the head tied to the embedding unless the config says otherwise
    (GemmaConfig's default) and heads of `head_dim` 256. Its GeGLU is priced as SwiGLU (one gated
    activation each), its embedding's scaling by sqrt(hidden) and its norms' 1 + w are left out (an
    element-wise pass each, no weights)."""
    f = _hf_llama_like(cfg, origin)
    f["tied_embeddings"] = _get(cfg, "tie_word_embeddings", origin, default=True, kind=bool)
    return f


def _hf_mixtral(cfg: dict, origin: str) -> dict[str, Any]:
    f = _hf_llama_like(cfg, origin)
    f["moe"] = dict(
        experts=_get(cfg, "num_local_experts", origin),
        top_k=_get(cfg, "num_experts_per_tok", origin),
        expert_ffn=f["ffn"],
    )
    return f


def _leading_dense(dense: list[int], origin: str) -> int:
    """ModelSpec only knows a leading block of dense layers: other layouts are approximated by moving
    the dense layers to the front. Parameter and FLOP totals stay exact; placement (pipeline balance) may not."""
    if dense != list(range(len(dense))):
        warnings.warn(f"{origin}: dense layers {dense} modelled as the first {len(dense)} layers", stacklevel=4)
    return len(dense)


def _hf_qwen_moe(cfg: dict, origin: str) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE: layer i is sparse iff (i+1) % decoder_sparse_step == 0 and i not in
    mlp_only_layers; Qwen2-MoE's one shared expert of shared_expert_intermediate_size (its 1-wide
    sigmoid gate is left out); Qwen3-MoE has none."""
    f = _hf_llama_like(cfg, origin)
    step = _get(cfg, "decoder_sparse_step", origin, default=1)
    only = _get(cfg, "mlp_only_layers", origin, default=[], kind=list)
    dense = [i for i in range(f["layers"]) if i in only or step <= 0 or (i + 1) % step]
    shared_ffn = _get(cfg, "shared_expert_intermediate_size", origin, default=0)
    f["moe"] = dict(
        experts=_get(cfg, "num_experts", origin),
        top_k=_get(cfg, "num_experts_per_tok", origin),
        expert_ffn=_get(cfg, "moe_intermediate_size", origin),
        shared_experts=1 if shared_ffn else 0,
        shared_expert_ffn=shared_ffn or None,
        first_dense_layers=_leading_dense(dense, origin),
    )
    return f


def _hf_deepseek(cfg: dict, origin: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: MLA + fine-grained MoE. Layer i is sparse iff i >= first_k_dense_replace and
    i % moe_layer_freq == 0. The multi-token-prediction layers (num_nextn_predict_layers) are left out."""
    f = _hf_llama_like(cfg, origin)
    freq = _get(cfg, "moe_layer_freq", origin, default=1)
    first = _get(cfg, "first_k_dense_replace", origin, default=0)
    dense = [i for i in range(f["layers"]) if i < first or freq <= 0 or i % freq]
    f.update(
        head_dim=_get(cfg, "qk_nope_head_dim", origin),
        q_lora_rank=_get(cfg, "q_lora_rank", origin, default=None),
        kv_lora_rank=_get(cfg, "kv_lora_rank", origin),
        qk_rope_head_dim=_get(cfg, "qk_rope_head_dim", origin),
        v_head_dim=_get(cfg, "v_head_dim", origin),
        moe=dict(
            experts=_get(cfg, "n_routed_experts", origin),
            top_k=_get(cfg, "num_experts_per_tok", origin),
            expert_ffn=_get(cfg, "moe_intermediate_size", origin),
            shared_experts=_get(cfg, "n_shared_experts", origin, default=0),
            first_dense_layers=_leading_dense(dense, origin),
        ),
    )
    return f


def _hf_gpt2(cfg: dict, origin: str) -> dict[str, Any]:
    """GPT-2: learned positions, LayerNorm, biases, FFN n_inner (default 4*n_embd), tied head."""
    hidden = _get(cfg, "n_embd", origin)
    heads = _get(cfg, "n_head", origin)
    positions = _get(cfg, "n_positions", origin)
    return dict(
        layers=_get(cfg, "n_layer", origin), hidden=hidden, heads=heads, kv_heads=heads,
        head_dim=_head_dim(hidden, heads, origin), ffn=_get(cfg, "n_inner", origin, default=4 * hidden),
        gated=False, vocab=_get(cfg, "vocab_size", origin), seq_len=positions, max_positions=positions,
        tied_embeddings=_get(cfg, "tie_word_embeddings", origin, default=True, kind=bool),
        norm="layernorm", bias=True, learned_pos=True,
        dropout=_dropout(cfg, origin, ("attn_pdrop", "resid_pdrop", "embd_pdrop"), 0.1),
    )


def _hf_gpt_neox(cfg: dict, origin: str) -> dict[str, Any]:
    """GPT-NeoX / Pythia: rotary (partial; no parameters), LayerNorm, biases, separate embed_out.
    The parallel residual changes neither parameters nor FLOPs."""
    hidden = _get(cfg, "hidden_size", origin)
    heads = _get(cfg, "num_attention_heads", origin)
    bias = _get(cfg, "attention_bias", origin, default=True, kind=bool)
    return dict(
        layers=_get(cfg, "num_hidden_layers", origin), hidden=hidden, heads=heads, kv_heads=heads,
        head_dim=_head_dim(hidden, heads, origin), ffn=_get(cfg, "intermediate_size", origin),
        gated=False, vocab=_get(cfg, "vocab_size", origin), seq_len=_get(cfg, "max_position_embeddings", origin),
        tied_embeddings=_get(cfg, "tie_word_embeddings", origin, default=False, kind=bool),
        norm="layernorm", bias=bias, learned_pos=False,
        dropout=_dropout(cfg, origin, ("attention_dropout", "hidden_dropout"), 0.0),
    )


_HF_IMPORTERS = {
    "deepseek_v2": _hf_deepseek,
    "deepseek_v3": _hf_deepseek,
    "gemma": _hf_gemma,
    "gpt2": _hf_gpt2,
    "gpt_neox": _hf_gpt_neox,
    "llama": _hf_llama_like,
    "mistral": _hf_llama_like,
    "phi3": _hf_llama_like,
    "mixtral": _hf_mixtral,
    "qwen2": _hf_llama_like,
    "qwen2_moe": _hf_qwen_moe,
    "qwen3": _hf_llama_like,
    "qwen3_moe": _hf_qwen_moe,
}


def from_hf_config(cfg: dict, name: str, origin: Optional[str] = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict. `origin` (default `name`) names it in errors.

    seq_len is the config's context length (max_position_embeddings / n_positions); get_model's
    seq_len overrides it.
    """
    origin = origin or name
    if not isinstance(cfg, dict):
        raise SpecError(f"{origin}: a Hugging Face config must be a JSON object, got {type(cfg).__name__}")
    mtype = _get(cfg, "model_type", origin, kind=str)
    importer = _HF_IMPORTERS.get(mtype)
    if importer is None:
        raise SpecError(f"unsupported model_type {mtype!r} in {origin}; supported: {', '.join(sorted(_HF_IMPORTERS))}")
    fields = importer(cfg, origin)
    return _build({**fields, "name": name, "source": f"Hugging Face config ({mtype}) {origin}"}, origin)


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read model file {path}: {e.strerror or e}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SpecError(f"reading {path} needs PyYAML (pip install pyyaml), or write it as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(f"invalid YAML in {path}: {str(e).splitlines()[0]}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"invalid JSON in {path}: {e.msg} at line {e.lineno} column {e.colno}") from None


def _load_file(path: Path) -> ModelSpec:
    if path.is_dir():
        path = path / "config.json"
    data = _read_file(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a mapping of model fields, got {type(data).__name__}")
    # A checkpoint directory's name (…/Llama-2-7b-hf/config.json) names the model better than "config".
    stem = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    if "model_type" in data:
        return from_hf_config(data, data.get("_name_or_path") or stem, origin=str(path))
    return _build({"name": stem, **data}, str(path))


def get_model(name_or_path: str, seq_len: Optional[int] = None) -> ModelSpec:
    """A preset (see MODELS) by name, or a local file: a Hugging Face config.json (it has `model_type`),
    a checkpoint directory holding one, or a JSON/YAML file of ModelSpec fields (`name` defaults to the
    file name). `seq_len` overrides the spec's. Never touches the network."""
    if name_or_path in MODELS:
        spec, origin = MODELS[name_or_path], f"preset {name_or_path}"
    else:
        path = Path(name_or_path).expanduser()
        if path.exists():
            spec, origin = _load_file(path), str(path)
        elif path.suffix in (".json", ".yaml", ".yml") or "/" in name_or_path:
            raise SpecError(f"model file not found: {name_or_path}")
        else:
            close = difflib.get_close_matches(name_or_path, MODELS, n=5, cutoff=0.5) or list(MODELS)[:5]
            raise SpecError(
                f"unknown model {name_or_path!r}; close names: {', '.join(close)} "
                "(or pass the path of a config.json / JSON / YAML file)"
            )
    if seq_len is not None:
        spec = _build({**spec.model_dump(), "seq_len": seq_len}, f"{origin} with seq_len {seq_len}")
    return spec
