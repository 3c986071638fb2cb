"""Selective recompute by submodule (Megatron-Core's --recompute-modules), priced from a layer's blocks.

A mixin of `simexec.program.blocks.Anatomy`. Megatron (NVIDIA/Megatron-LM@d98e8a6) checkpoints each
module it is given in one of two ways (megatron/core/transformer/transformer_config.py:560-581):
- normal checkpointing (core_attn, mlp, moe, shared_experts): the module keeps its input and saves
  nothing inside; its forward runs again before its backward (transformer_layer.py:537-539 and :992 for
  mlp, moe/moe_layer.py:247-252 for moe and the shared experts, attention.py's
  `_checkpointed_attention_forward` for core_attn);
- output-discarding checkpointing (moe_act, layernorm, mla_up_proj; tensor_parallel.CheckpointWithoutOutput):
  the module's output is freed once its consumer has run, and made again before the backward that
  reads it (moe/experts.py:269-272 for the experts' activation, transformer_layer.py:470-527 for the
  input and pre-MLP norms, multi_latent_attention.py:171-174 and :985 for MLA's q/kv up projections and RoPE).

Per layer this gives what the forward does not keep (`selective_discarded`) and what runs again in
phase "recompute" (`selective_recomputed`): whole blocks where a module is one (mlp: fc1 and fc2 with
the tp collectives around them; moe: the router, dispatch, experts, combine and the shared experts),
else the part of a block the module is, priced from the block's own formulas. The attention core
(core_attn) keeps its own placement, right before the attention's backward (`LayerLowering.
attention_backward`); the rest runs at the start of the layer's backward, which holds what they make
from there on (as `recompute=op`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

from simexec.program.block import Block, gemm_cost
from simexec.program.layer_order import LayerStep

# the whole-block modules and the layer steps they cover (with the tp and ep exchanges between them)
MLP_STEPS = ("mlp_in", "fc1", "fc2", "mlp_out")
MOE_STEPS = ("mlp_in", "router", "dispatch", "dispatch_net", "etp_in", "experts", "etp_out", "combine_net", "combine",
             "moe_out", "mlp_out")


class RecomputeStep(NamedTuple):
    """One step selective recompute runs again: a compute block (its recompute cost) or an exchange
    (`block` None: the step's own collective)."""

    step: LayerStep
    block: Optional[Block]


class SelectiveRecompute:
    """`Anatomy`'s selective recompute per module (see the module doc)."""

    @property
    def selective_modules(self) -> tuple[str, ...]:
        return self.rp.plan.selective_modules

    @property
    def selective_recomputes_attention(self) -> bool:
        """Selective recompute covers the attention core (the default module)."""
        return "core_attn" in self.selective_modules

    def _modules_of(self, i: int) -> set[str]:
        """The modules that apply to layer i: mlp to dense layers, moe, moe_act and shared_experts to
        MoE layers; moe covers the other two there."""
        mods = set(self.selective_modules)
        if self.rp.model.is_moe_layer(i):
            mods.discard("mlp")
            if "moe" in mods:
                mods -= {"moe_act", "shared_experts"}
            if not self.rp.model.moe.shared_experts:
                mods.discard("shared_experts")
        else:
            mods -= {"moe", "moe_act", "shared_experts"}
        return mods

    def selective_discarded(self, i: int) -> float:
        """What selective recompute frees of layer i's saved activations between its forward and its
        backward, beyond the attention core's scores (counted in the attention block)."""
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        mods, blocks = self._modules_of(i), self.layer(i)
        out = 0.0
        if "layernorm" in mods:  # the two pre-norms' outputs (the GEMMs' inputs after them, as those keep them)
            out += 2 * self.saved_linear_input(T * h / self.sp_div)
        if "mla_up_proj" in mods:  # q, k and v the attention kernel saves: the up projections' outputs
            out += T * (m.heads * m.qk_head_dim + m.attention_widths[1]) * dt / t
        if "mlp" in mods:  # fc1's output (the activation's input) and the activation's output (fc2's input)
            out += T * m.ffn * (2 if m.gated else 1) * dt / t + self.saved_linear_input(T * m.ffn / t)
        if "moe" in mods:  # all but the norm's input, its statistics and the MoE input (its output)
            e = m.moe
            out += self.routed_tokens * e.experts * 4 + blocks["experts"].saved
            out += blocks["moe_out"].saved - self.residual_mask
        if "moe_act" in mods:  # the activation's output, fc2's input
            out += self.saved_linear_input(self.expert_rows * m.moe.expert_ffn / self.etp)
        if "shared_experts" in mods:  # their fc1's output and activation's output
            out += T * self.shared_ffn * (3 if m.gated else 2) / t * dt
        return out

    @property
    def shared_ffn(self) -> float:
        """The shared experts' FFN width summed over them (0 without)."""
        e = self.rp.model.moe
        return (e.shared_expert_ffn or e.expert_ffn) * e.shared_experts if e else 0.0

    def selective_recomputed(self, i: int) -> tuple[RecomputeStep, ...]:
        """What selective recompute runs again before layer i's backward, in forward order (the
        attention core apart)."""
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        mods, blocks = self._modules_of(i), self.layer(i)
        steps = self.layer_steps(i)
        norm = Block("elementwise", 0.0, self.norm_fwd(), 0.0)
        out: list[RecomputeStep] = []
        if "layernorm" in mods:
            out.append(RecomputeStep(LayerStep("norm1"), norm))
        if "mla_up_proj" in mods:
            o_params = m.heads * m.value_head_dim * h
            latent = m.latent_matmul_params()
            up = (m.attention_matmul_params() - o_params - latent) / t
            rope = 2 * dt * T * (m.heads / t + 1) * m.qk_rope_head_dim
            cat = 2 * dt * T * m.heads * (3 * m.qk_head_dim + m.value_head_dim) / t
            out.append(RecomputeStep(LayerStep("qkv_up"), Block("gemm", 2.0 * T * up, rope + cat, 0.0)))
        if "layernorm" in mods:
            out.append(RecomputeStep(LayerStep("norm2"), norm))
        whole = MLP_STEPS if "mlp" in mods else MOE_STEPS if "moe" in mods else ()
        opening, _ = self.opening_norm()
        for step in steps:
            if step.name not in whole:
                continue
            if step.axis:
                out.append(RecomputeStep(step, None))
                continue
            b = blocks[step.name]
            if step.name in ("fc1", "router"):  # the norm before them is not the module's
                b = replace(b, bytes=b.bytes - opening)
            elif step.name in ("fc2", "moe_out"):  # nor the residual add after them
                b = replace(b, bytes=b.bytes - self.residual_fwd())
            out.append(RecomputeStep(step, replace(b, saved=0.0)))
        if "moe_act" in mods:
            act, _ = self.activation(m.moe.expert_ffn / self.etp)
            out.append(RecomputeStep(LayerStep("moe_act"), Block("elementwise", 0.0, act * self.expert_rows / T, 0.0)))
        if "shared_experts" in mods:
            f1, _ = gemm_cost(T, h, self.shared_ffn * (2 if m.gated else 1) / t, dt)
            f2, _ = gemm_cost(T, self.shared_ffn / t, h, dt)
            act, _ = self.activation(self.shared_ffn / t)
            out.append(RecomputeStep(LayerStep("shared_experts"), Block("gemm", f1 + f2, act, 0.0)))
        return tuple(out)
