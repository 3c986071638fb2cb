"""A rank's process groups: which ranks it talks to over each axis.

One function computes them, and the lowering, the search's bounds and the executor read them from it,
so the three cannot disagree on who reduces with whom.
"""
from __future__ import annotations

from dataclasses import dataclass

from simexec.specs.plan import ResolvedPlan


@dataclass(frozen=True)
class RankGroups:
    """The ranks (sorted tuples, the rank itself included) of each group `rank` belongs to.

    Gradients are reduced, and ZeRO shards, over dp x cp: context-parallel ranks hold the same
    parameters. HSDP (`dp_shard`) shards within blocks of dp_shard dp ranks (all of their cp ranks) and
    replicates across blocks (`rep`); expert parameters are data-parallel over the ranks that hold the
    same experts (the same position in the ep group: `edp`).

    Under parallel folding (`Plan.etp`) the expert groups come from the MoE layers' own mesh over the
    ranks of this rank's pipeline stage, in Megatron-Core's order (its expert RankGenerator, order
    "tp-ep-dp-pp"): etp fastest, then ep, then edp, over the stage's ranks in rank order. Without it
    an expert is split over the tp group (`etp` is `tp`), ep is a block of the dp axis and edp the
    dp x cp ranks at the same place in their block.
    """

    tp: tuple[int, ...]
    cp: tuple[int, ...]
    dp: tuple[int, ...]  # dp x cp: the ranks that hold the same dense parameters
    ep: tuple[int, ...]
    edp: tuple[int, ...]
    etp: tuple[int, ...]  # the ranks one routed expert's weights are split over
    zero_axis: str  # "dp", or "dp_shard" under HSDP
    zero: tuple[int, ...]  # the ranks ZeRO shards over
    rep: tuple[int, ...]  # HSDP: the replicas of this rank's shard; () without HSDP
    embed: tuple[int, ...]  # the first and the head's pipeline stage at this rank's other coordinates
    # moe_dispatcher=deepep: the ep ranks in this rank's NVLink domain, and the ep ranks at this rank's
    # place in the other domains (DeepEP's RDMA peers: the same local index on every node)
    ep_domain: tuple[int, ...] = ()
    ep_net: tuple[int, ...] = ()


def rank_groups(rp: ResolvedPlan, rank: int) -> RankGroups:
    p, mesh = rp.plan, rp.mesh
    me = mesh.coords(rank)
    dp = mesh.span(rank, ("dp", "cp"))
    if p.dp_shard:
        block = me["dp"] // p.dp_shard
        zero_axis = "dp_shard"
        zero = mesh.span(rank, ("dp", "cp"), keep=lambda c: c["dp"] // p.dp_shard == block)
        rep = mesh.span(rank, ("dp",), keep=lambda c: c["dp"] % p.dp_shard == me["dp"] % p.dp_shard)
    else:
        zero_axis, zero, rep = "dp", dp, ()
    embed = tuple(sorted({mesh.rank(**{**me, "pp": 0}), mesh.rank(**{**me, "pp": rp.head_pp_rank})}))
    if p.etp is not None:
        etp, ep, edp = folded_expert_groups(rp, rank)
    else:
        etp = mesh.group(rank, "tp")
        ep = mesh.subgroup(rank, "dp", p.ep)
        edp = mesh.span(rank, ("dp", "cp"), keep=lambda c: c["dp"] % p.ep == me["dp"] % p.ep)
    ep_domain, ep_net = domain_split(ep, rank, rp.cluster.nvlink_domain or rp.world)
    return RankGroups(
        tp=mesh.group(rank, "tp"),
        cp=mesh.group(rank, "cp"),
        dp=dp,
        ep=ep,
        edp=edp,
        etp=etp,
        zero_axis=zero_axis,
        zero=zero,
        rep=rep,
        embed=embed,
        ep_domain=ep_domain,
        ep_net=ep_net,
    )


def domain_split(group: tuple[int, ...], rank: int, domain: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the members of `group` in `rank`'s NVLink domain of `domain` consecutive ranks, the members
    at `rank`'s place among its domain's members in each domain): DeepEP's two hops, NVLink within a
    domain and RDMA between same-index GPUs of different nodes."""
    by_domain: dict[int, list[int]] = {}
    for r in group:
        by_domain.setdefault(r // domain, []).append(r)
    mine = by_domain[rank // domain]
    place = mine.index(rank)
    net = tuple(sorted(m[place] for m in by_domain.values() if len(m) > place))
    return tuple(mine), net


def deepep_two_hops(rp: ResolvedPlan) -> bool:
    """moe_dispatcher=deepep over an ep group that leaves its NVLink domain: the lowering emits DeepEP's
    two hops (`ep_net`, then `ep_domain`) rather than one all-to-all over ep, and the executor runs them."""
    return (rp.plan.moe_dispatcher == "deepep" and rp.model.moe is not None
            and any(len(rank_groups(rp, r).ep_net) > 1 for r in range(rp.world)))


def deepep_domains_even(rp: ResolvedPlan) -> bool:
    """Whether every NVLink domain holds as many of each ep group's ranks (DeepEP's layout: the same
    GPUs per node, a token's network peer the GPU of its sender's local index on the destination node)."""
    return all(len(g.ep_domain) * len(g.ep_net) == len(g.ep) for g in (rank_groups(rp, r) for r in range(rp.world)))


def folded_expert_groups(rp: ResolvedPlan, rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(etp, ep, edp) of `rank` on the expert mesh of a folded plan: the ranks of its pipeline stage in
    rank order, index i at etp = i % etp, ep = i // etp % ep, edp = i // (etp*ep), as Megatron-Core's
    RankGenerator(tp=etp, ep=ep, dp=edp, order="tp-ep-dp-pp") numbers them (pp slowest, which `resolve`
    asks of a folded plan with pp > 1)."""
    p = rp.plan
    stage = rp.mesh.span(rank, ("tp", "cp", "dp"))
    i = stage.index(rank)
    etp, ep = p.etp, p.ep
    a, b, c = i % etp, i // etp % ep, i // (etp * ep)
    pick = lambda keep: tuple(r for j, r in enumerate(stage) if keep(j % etp, j // etp % ep, j // (etp * ep)))
    return (pick(lambda x, y, z: y == b and z == c), pick(lambda x, y, z: x == a and z == c),
            pick(lambda x, y, z: x == a and y == b))
