"""Plans the executor cannot run yet, and why: checked before any rank starts (`simexec.exec.api`),
so that a plan the simulator takes but the interpreter would run wrongly fails with its reason."""
from __future__ import annotations

from typing import Optional

from simexec.program.blocks import Anatomy
from simexec.program.groups import deepep_domains_even, deepep_two_hops
from simexec.program.param_tensors import unit_tensors

# selective recompute's modules that are whole blocks of the executor's model, which it recomputes by
# replaying their forward; the others are parts of a block (a norm, an activation, MLA's up
# projections), and moe re-runs the dispatch and combine, which the executor does not replay yet
EXECUTED_RECOMPUTE_MODULES = ("core_attn", "mlp")


def splits_a_unit(rp) -> bool:
    """Whether the plan's ZeRO-3 flavour gathers or reduces some unit of this model in more than one
    call, or keeps some of its tensors out of the gathers (persisted unsharded)."""
    z3, an, layers = rp.plan.zero3, Anatomy(rp), rp.model.layers
    for u in (-1, *range(layers), layers):
        dense = an.embed_params() if u == -1 else an.head_params() if u == layers else an.layer_param_counts(u)[0]
        tensors = unit_tensors(rp, u, dense)
        gathers = z3.gather_calls(tensors)
        if len(gathers) > 1 or sum(gathers) < sum(tensors) or len(z3.reduce_calls(tensors)) > 1:
            return True
    return False


def unsupported(rp) -> Optional[str]:
    """None if this interpreter runs the plan; else what is missing, naming the plan feature."""
    m, p = rp.model, rp.plan
    missing = []
    if m.mtp_layers and p.zero3 is not None and p.zero3.preallocated_buffers:
        missing.append(f"multi-token prediction with zero_impl={p.zero3.name} ({m.name}: an MTP depth needs its "
                       "unit, the embedding's and the head's gathered at once, which the flavour's two alternating "
                       "buffers cannot hold)")
    if m.mtp_layers and m.learned_pos and rp.head_pp_rank != 0:
        missing.append(f"multi-token prediction with learned positions with pp={p.pp} ({m.name}: the MTP depths "
                       "embed the shifted tokens on the last stage, whose copy of the embedding holds the word "
                       "table only, not the position table)")
    if rp.tied_copy and p.zero >= 2:
        missing.append(f"tied embeddings with pp={p.pp} and zero={p.zero} ({m.name}: the two stages' copies of "
                       "the embedding would be summed before every micro-batch's reduce-scatter; the executor "
                       "runs a tied model over a pipeline with zero=0 or 1, as DeepSpeed's pipeline engine does, or under"
                       " schedule=zb-v or dualpipev, whose first rank holds the head beside the embedding)")
    if m.tied_embeddings and p.zero3 is not None and p.zero3.preallocated_buffers:
        missing.append(f"tied embeddings with zero_impl={p.zero3.name} ({m.name}: the LM head needs the embedding's "
                       "unit and its own gathered at once, which YaFSDP's two alternating buffers cannot hold)")
    if p.zero3 is not None and splits_a_unit(rp):
        missing.append(f"zero_impl={p.zero3.name}'s collectives on {m.name} (per-bucket gathers, persisted small "
                       "parameters or bucketed reduce-scatters; the executor gathers and reduces each unit whole, in "
                       "one call: zero3_persist_below=0 and buckets above a unit's size give that)")
    if m.moe is not None and m.moe.capacity_factor is not None and p.cp > 1:
        missing.append(f"MoE token dropping (capacity_factor={m.moe.capacity_factor}) with cp={p.cp} (each "
                       "sequence fills the experts' buffers up to their capacity, and cp splits it over ranks)")
    if p.etp is not None and p.tp > 1 and m.moe is not None and m.moe.capacity_factor is not None:
        missing.append(f"MoE token dropping (capacity_factor={m.moe.capacity_factor}) with etp={p.etp} and "
                       f"tp={p.tp} (each tp rank fills the experts' buffers from its own sequence shard)")
    if deepep_two_hops(rp) and not deepep_domains_even(rp):
        missing.append(f"moe_dispatcher=deepep with ep={p.ep} over NVLink domains of {rp.cluster.nvlink_domain} that "
                       "hold different numbers of an ep group's ranks (DeepEP's network peer of a rank is the rank "
                       "at its local index on the other node)")
    if deepep_two_hops(rp) and p.etp is not None and p.etp > 1:
        missing.append(f"moe_dispatcher=deepep across NVLink domains with etp={p.etp} (the rows each etp rank "
                       "receives differ in number; the executor gathers its etp exchange's even pieces only)")
    if p.moe_router_skew != 1.0:
        missing.append(f"moe_router_skew={p.moe_router_skew:g} (the executor's router routes the tokens it is given;"
                       " a skew is the simulator's what-if)")
    if p.dtype == "fp8":
        missing.append("dtype=fp8")
    if p.tp_async:
        missing.append("tp_async=1 (chunked tp collectives pipelined with their GEMMs)")
    if p.recompute == "op":
        missing.append("recompute=op (torchtitan's per-operator checkpointing; the executor recomputes whole layers "
                       "or the attention core)")
    partial = [x for x in p.selective_modules if x not in EXECUTED_RECOMPUTE_MODULES]
    if partial:
        missing.append(f"recompute_modules {'+'.join(partial)} (the executor recomputes whole blocks: "
                       f"{', '.join(EXECUTED_RECOMPUTE_MODULES)})")
    if not missing and (p.sp or p.cp > 1):
        missing += _lowering_gaps(rp)
    if not missing:
        return None
    return f"the executor cannot run plan {p.to_string()} on {m.name} yet: " + "; ".join(missing)


def _lowering_gaps(rp) -> list[str]:
    """Communication the math needs that the lowering does not emit (checked on the program of the
    first pipeline stage's representative rank, so that a fixed lowering is picked up by itself)."""
    from simexec.program.lower import lower

    p = rp.plan
    prog = lower(rp, symmetric=True)
    rank = rp.mesh.rank()
    instrs = prog.ranks[rank]
    gaps = []
    if p.sp and p.tp > 1 and not any(i.block == "embed_out" and i.phase == "bwd" for i in instrs):
        gaps.append("sp: no backward embed_out (the vocab-parallel embedding needs the gradient of its whole "
                    "sequence: the all-gather conjugate of the forward reduce-scatter)")
    if p.cp > 1:
        peers = set(rp.mesh.group(rank, "cp"))
        reduces = [i for i in instrs if i.kind == "collective" and i.block.startswith("grads")]
        if not any(peers <= set(i.group) for i in reduces):
            gaps.append("cp: gradients are reduced over dp only; parameters replicated over cp need their "
                        "gradients summed over dp x cp")
    return gaps

