"""Parameter tensors in the executor's layout (`simexec.exec.nn.param_layout.param_specs`), counted per unit,
per block and per optimizer step: the passes that go one tensor at a time (the optimizer's, the
main-gradient hooks', a collective's views) cost an operator's dispatch each."""
from __future__ import annotations

import math

from simexec.program.instructions import Program
from simexec.sim.host.operators import SP_NORM_BLOCKS

def grad_tensors(block: str, model, sp: bool, tp: int = 1, ep: int = 1) -> int:
    """Parameter tensors whose gradient a block's backward makes and the main-gradient hook moves
    (`simexec.exec.nn.param_layout.param_specs`): a block's own norm unless sp gives the norm a block of its
    own; under tp > 1 not those replicated over tp with partial gradients (norms, the router, MLA's
    down projections), which the tensor-parallel collective sums instead."""
    if model is None:
        return 0
    embed, _, _, ffn = unit_tensors(model)
    norm = 2 if model.norm == "layernorm" else 1
    bias = 1 if model.bias else 0
    whole = tp == 1  # tensors replicated over tp with partial gradients are hooked only without tp
    own_norm = norm if whole and not sp else 0
    up = ffn - 1 - bias  # the up (and gate) projections; the down one is fc2's
    if block in SP_NORM_BLOCKS:
        return norm if whole else 0
    if block == "embed":
        return embed
    if block == "qkv":
        n = own_norm + (3 if model.bias or getattr(model, "qkv_bias", False) else 0)
        n += 2 * norm if model.qk_norm and whole else 0
        if getattr(model, "is_mla", False):  # wq (or wq_b) and wkv_b; wq_a, q_a_norm, wkv_a, kv_a_norm
            down = (1 + norm if model.q_lora_rank else 0) + 1 + norm
            return n + 2 + (down if whole else 0)
        return n + 3
    if block in ("proj", "fc2"):
        return 1 + bias
    if block == "fc1":
        return own_norm + up
    if block == "router":
        return own_norm + (1 if whole else 0)
    if block == "experts":
        return ffn * math.ceil(model.moe.experts / max(1, ep))
    if block == "moe_out":
        return ffn * model.moe.shared_experts
    if block == "head":
        return own_norm + 1
    return 0


def unit_tensors(model) -> tuple[int, int, int, int]:
    """Parameter tensors of (the embedding, a dense layer, the head, one MoE expert's FFN) in the
    executor's layout (simexec.exec.nn.param_layout.param_specs)."""
    norm = 2 if model.norm == "layernorm" else 1
    ffn = (2 if model.gated else 1) * (2 if model.bias else 1) + (2 if model.bias else 1)
    qkv_bias = 3 if (model.bias or getattr(model, "qkv_bias", False)) else 0
    attn = 3 + qkv_bias + 1 + (1 if model.bias else 0)
    if getattr(model, "is_mla", False):  # q (or its latent, norm and up projection), kv's three, o
        attn += (1 + norm if model.q_lora_rank else 0) + norm
    embed = 1 + (1 if model.learned_pos else 0)
    return embed, 2 * norm + attn + ffn, norm + 1, ffn


def optimizer_tensors(program: Program, rank: int, model, ep: int = 1) -> int:
    """Tensors the rank's Adam step updates: flat buckets (ZeRO 1-2), gathered units (ZeRO 3), else
    every parameter tensor of the units (embedding, layers, head) the rank holds, of a MoE layer's
    routed experts its share of expert parallelism `ep`."""
    instrs = program.ranks[rank]
    buckets = {i.block for i in instrs if i.kind == "collective" and i.block.startswith("params")}
    units = {(i.axis, i.layer) for i in instrs if i.kind == "collective" and i.block == "gather"}
    if buckets or units:
        return len(buckets) + len(units)
    if model is None:
        return 1
    blocks = {i.block for i in instrs if i.kind == "compute"}
    layers = {i.layer for i in instrs if i.kind == "compute" and 0 <= i.layer < model.layers}
    units = layers | ({-1} if "embed" in blocks else set()) | ({model.layers} if "head" in blocks else set())
    ep = ep if getattr(model, "moe", None) is not None else 1
    return max(1, sum(unit_tensor_count(model, u, ep) for u in units))


def unit_tensor_count(model, unit: int, ep: int = 1, part: str = "all") -> int:
    """Parameter tensors a rank holds of one unit (-1 the embedding, `model.layers` the head, else a
    layer): its `part` "dense", "expert" (a MoE layer's routed experts, this rank's share of ep) or
    "all"."""
    embed, layer, head, expert = unit_tensors(model)
    moe = getattr(model, "moe", None)
    if unit < 0 or unit >= model.layers or moe is None or not model.is_moe_layer(unit):
        dense = embed if unit < 0 else head if unit >= model.layers else layer
        return 0 if part == "expert" else dense
    routed = math.ceil(moe.experts / ep) * expert
    dense = layer - expert + 1 + moe.shared_experts * expert  # the router and the shared experts
    return {"dense": dense, "expert": routed}.get(part, dense + routed)

