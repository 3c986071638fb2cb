"""A transformer layer's sub-blocks in forward order, with the collectives between them.

The lowering, the search's bounds and the executor's dataflow all walk a layer block by block; the
order, and which tp/cp/ep collective sits between which two blocks, is written here once. The
backward runs the same steps in reverse, each collective as its `bwd` verb.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

# Megatron's f/g conjugates: (forward op, backward op) without and with sequence parallelism; ""
# where that side is the identity.
TP_CONJUGATES = {
    "attn_in": (("", "allreduce"), ("allgather", "reducescatter")),
    "attn_out": (("allreduce", ""), ("reducescatter", "allgather")),
    "mlp_in": (("", "allreduce"), ("allgather", "reducescatter")),
    "mlp_out": (("allreduce", ""), ("reducescatter", "allgather")),
    "embed_out": (("allreduce", ""), ("reducescatter", "allgather")),
    "head_in": (("", "allreduce"), ("allgather", "reducescatter")),
    # an MTP depth (Megatron-Core's MultiTokenPredictionLayer): its embedding's sum as `embed_out`;
    # eh_proj's column-parallel input as `attn_in` (the concatenated norms' gradient summed, under sp
    # the input gathered over the sequence); its output gathered over the hidden dimension
    # (gather_from_tensor_model_parallel_region, whose backward is a split) and under sp split over
    # the sequence (scatter_to_sequence_parallel_region, whose backward gathers it)
    "mtp_embed_out": (("allreduce", ""), ("reducescatter", "allgather")),
    "mtp_eh_in": (("", "allreduce"), ("allgather", "reducescatter")),
    "mtp_eh_out": (("allgather", ""), ("allgather", "allgather")),
}


class LayerStep(NamedTuple):
    """One step of a layer's forward: a sub-block's compute (`axis` ""), or a collective over
    `axis` ("tp", "cp", "ep", "etp"; "ep_domain" and "ep_net", DeepEP's two hops of the ep group) issued by the forward as `fwd` and by the backward as `bwd` (""
    where that side is the identity)."""

    name: str  # the sub-block (a key of `Anatomy.layer(i)`) or the collective's block name
    axis: str = ""
    fwd: str = ""
    bwd: str = ""
    # a column-parallel GEMM block whose input comes through the tp conjugate just before it: its
    # input gradient is what that conjugate's backward sums (and under sp it reads the re-gathered input)
    column: bool = False
    # ring attention (cp_impl=ring): the attention in cp parts while K/V hop around the cp group
    ring: bool = False


def _tp(name: str, sp: bool) -> LayerStep:
    fwd, bwd = TP_CONJUGATES[name][1 if sp else 0]
    return LayerStep(name, "tp", fwd, bwd)


# The MoE dispatch and combine per `Plan.moe_dispatcher`, in forward order: (name, axis, fwd, bwd).
# alltoall (Megatron-Core's MoEAlltoAllTokenDispatcher): each token's top_k rows to their experts' ranks
# and back. allgather (MoEAllGatherTokenDispatcher): the tokens all-gathered over ep, each rank keeping
# its experts' rows, the outputs reduce-scattered back. deepep (MoEFlexTokenDispatcher over DeepEP's
# internode kernels): a hop between same-index GPUs of the ep group's NVLink domains (`ep_net`,
# each token once per destination domain) and a hop inside the domain (`ep_domain`, each token once
# per rank holding one of its experts); the combine the same hops reversed, summing in the domain first.
DISPATCH_STEPS = {
    "alltoall": ((("dispatch", "ep", "alltoall", "alltoall"),),
                 (("combine", "ep", "alltoall", "alltoall"),)),
    "allgather": ((("dispatch", "ep", "allgather", "reducescatter"),),
                  (("combine", "ep", "reducescatter", "allgather"),)),
    "deepep": ((("dispatch_net", "ep_net", "alltoall", "alltoall"), ("dispatch", "ep_domain", "alltoall", "alltoall")),
               (("combine", "ep_domain", "alltoall", "alltoall"), ("combine_net", "ep_net", "alltoall", "alltoall"))),
}


@lru_cache(maxsize=None)
def layer_steps(moe: bool, sp: bool, cp: int, cp_impl: str, etp: int = 1,
                dispatcher: str = "alltoall", moe_tp: bool = True) -> tuple[LayerStep, ...]:
    """A layer's steps in forward order, for a dense or MoE layer under sequence parallelism `sp`
    and context parallelism `cp` (`cp_impl`: "allgather" K/V, "ring", or "a2a" heads exchange).
    `etp` > 1 (parallel folding with experts split over etp ranks): the dispatched tokens are
    all-gathered over etp before the experts and their outputs reduce-scattered after (Megatron-Core's
    MoEAlltoAllTokenDispatcher over its expert tp group). `dispatcher`: `DISPATCH_STEPS`. `moe_tp`
    False: a MoE layer has no tp collectives around its MLP (parallel folding under sp with no shared
    expert: each tp rank routes the sequence slice it holds; Megatron-Core's MoELayer gathers over tp
    only for the shared experts' TP MLP).
    Under sp each norm is a block of its own before its sub-layer's tp conjugate (without sp it is
    part of the GEMM block after it). A sliding window changes the attention's cost, not the order."""
    steps = [LayerStep("norm1")] if sp else []
    steps += [_tp("attn_in", sp), LayerStep("qkv", column=True)]
    if cp > 1 and cp_impl == "ring":
        steps.append(LayerStep("attn", ring=True))
    elif cp > 1 and cp_impl == "a2a":
        steps += [LayerStep("heads_in", "cp", "alltoall", "alltoall"), LayerStep("attn"),
                  LayerStep("heads_out", "cp", "alltoall", "alltoall")]
    elif cp > 1:
        steps += [LayerStep("kv", "cp", "allgather", "reducescatter"), LayerStep("attn")]
    else:
        steps.append(LayerStep("attn"))
    steps += [LayerStep("proj"), _tp("attn_out", sp)]
    if sp:
        steps.append(LayerStep("norm2"))
    tp_around_mlp = moe_tp or not moe
    if tp_around_mlp:
        steps.append(_tp("mlp_in", sp))
    if moe:
        dispatch, combine = DISPATCH_STEPS[dispatcher]
        steps += [LayerStep("router", column=tp_around_mlp), *(LayerStep(*s) for s in dispatch)]
        if etp > 1:
            steps.append(LayerStep("etp_in", "etp", "allgather", "reducescatter"))
        steps.append(LayerStep("experts"))
        if etp > 1:
            steps.append(LayerStep("etp_out", "etp", "reducescatter", "allgather"))
        steps += [*(LayerStep(*s) for s in combine), LayerStep("moe_out")]
    else:
        steps += [LayerStep("fc1", column=True), LayerStep("fc2")]
    if tp_around_mlp:
        steps.append(_tp("mlp_out", sp))
    return tuple(steps)


def destination_domains(experts: int, top_k: int, domains: int, groups: int = 1, group_topk: int = 1) -> float:
    """The NVLink domains a token's top_k distinct experts fall in on average, the experts spread evenly and
    in order over `domains`.

    Without router groups the experts are drawn uniformly from all of them: domains x (1 - P(a domain holds
    none)), P = C(experts - experts/domains, top_k) / C(experts, top_k). Under group-limited routing
    (`groups` > 1: Megatron-Core's group_limited_topk, which DeepSeek-V3's node-limited routing runs) a token
    first picks `group_topk` groups, by the sum of each group's top (top_k / group_topk) scores, and takes its
    top_k among their experts; under the tables' forced-balanced (random) logits the groups are a uniform
    choice and each picked group gives about top_k / group_topk experts. Where a domain holds whole groups,
    the domains reached are those of the picked groups (hypergeometric: domains x (1 - C(groups - groups /
    domains, group_topk) / C(groups, group_topk))); where a group spans several domains, each picked group's
    top_k / group_topk experts are drawn uniformly within it. Other layouts take the ungrouped formula."""
    if domains <= 1:
        return 1.0
    if groups > 1 and groups % domains == 0:
        return domains * (1.0 - _none_drawn(groups, groups // domains, group_topk))
    if groups > 1 and domains % groups == 0:
        per_group = domains // groups
        return group_topk * per_group * (1.0 - _none_drawn(experts // groups, experts // domains, top_k // group_topk))
    return domains * (1.0 - _none_drawn(experts, experts / domains, top_k))


def _none_drawn(population: float, marked: float, draws: int) -> float:
    """P(no marked item among `draws` drawn without replacement from `population`, `marked` of them marked)."""
    miss = 1.0
    for i in range(draws):
        miss *= max(0.0, population - marked - i) / (population - i)
    return miss
