"""A model's dispatch key: the features that set how many aten operators the executor's blocks
dispatch. The lowering records it in a program's meta, so that a program read back from its text
still names the operator counts (`simexec.sim.host.operators`) that price it."""
from __future__ import annotations


def dispatch_key(model) -> str:
    """The features of a model that set how many operators the executor's blocks dispatch."""
    parts = [model.norm, "swiglu" if model.gated else "mlp", "pos" if model.learned_pos else "rope"]
    if model.bias:
        parts.append("bias")
    if model.kv_heads != model.heads and not model.is_mla:
        parts.append("gqa")
    if model.qk_norm:
        parts.append("qknorm")
    if model.is_mla:
        parts.append("mla-qlora" if model.q_lora_rank else "mla")
    if model.moe is not None:
        parts.append(f"moe{model.moe.experts}x{model.moe.top_k}+{model.moe.shared_experts}")
        if model.moe.router_groups > 1:
            parts.append("groups")
    return "-".join(parts)
