"""The communication a search's bounds price: idle-network seconds, without contention, so that they
stay below what the simulator's network gives."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from simexec.program.lower import representatives
from simexec.specs.plan import ResolvedPlan


class CommCosts:
    """Idle-network seconds of one mesh's (tp, cp, dp, pp) collectives, pipeline messages, copies and
    CPU optimizer steps, priced by the simulator's `Network` on its representative ranks and memoised:
    its structures share them."""

    def __init__(self, rp: ResolvedPlan):
        from simexec.sim.network import Network

        self.rp = rp
        self.reps = representatives(rp)
        self.net = Network(rp.cluster, list(self.reps), self.reps)
        self.mesh = rp.mesh
        self.rank_of_stage = {rp.mesh.coords(r)["pp"]: r for r in self.reps}
        self._memo: dict[tuple, float] = {}

    def coll(self, verb: str, rank: int, axis: str, nbytes: float, ep: int = 1, dp_shard: Optional[int] = None,
             etp: Optional[int] = None) -> float:
        """Idle-network seconds of one collective of `rank`'s group `axis` (tp, cp, ep, edp: experts'
        data-parallel group, etp: the ranks an expert is split over, zero: the group ZeRO shards over,
        ep_domain / ep_net: DeepEP's two hops of the ep group),
        0 for groups of one. `etp`: the plan's (None: not folded)."""
        if not verb or nbytes <= 0:
            return 0.0
        group = self.groups(rank, ep, dp_shard, etp)[axis]
        if len(group) <= 1:
            return 0.0
        key = (verb, group, nbytes)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self.net.estimate(self.net.collective(verb, group, nbytes))
        return t

    def groups(self, rank: int, ep: int, dp_shard: Optional[int],
               etp: Optional[int] = None) -> dict[str, tuple[int, ...]]:
        """The process groups of `rank`, as the lowering builds them (its own code, so they agree)."""
        key = ("groups", rank, ep, dp_shard, etp)
        g = self._memo.get(key)
        if g is None:
            from simexec.program.groups import rank_groups

            plan = self.rp.plan.model_copy(update=dict(ep=ep, dp_shard=dp_shard, etp=etp))
            rg = rank_groups(replace(self.rp, plan=plan), rank)
            g = self._memo[key] = {"tp": rg.tp, "cp": rg.cp, "ep": rg.ep, "edp": rg.edp, "etp": rg.etp, "zero": rg.zero,
                                   "ep_domain": rg.ep_domain, "ep_net": rg.ep_net}
        return g

    def p2p(self, src_stage: int, dst_stage: int, nbytes: float) -> float:
        """Idle-network seconds of one pipeline message: what `Network.estimate` gives for it, from
        the message's rate and latency found once per pair of stages."""
        rl = self._memo.get(("p2p", src_stage, dst_stage))
        if rl is None:
            a, b = self.rank_of_stage[src_stage], self.rank_of_stage[dst_stage]
            rl = self._memo[("p2p", src_stage, dst_stage)] = self._rate(self.net.p2p(a, b, 1.0))
        rate, lat = rl
        return (nbytes / rate if nbytes > 0 and rate < math.inf else 0.0) + lat

    def copy(self, rank: int, direction: str, nbytes: float) -> float:
        return self.net.estimate(self.net.copy(rank, direction, nbytes))

    def cpu(self, rank: int, params: float) -> float:
        """Idle seconds of a CPU optimizer step of `params` parameters (the node's cores shared by
        the ranks this one stands for there), as `Network.estimate` gives it."""
        rate = self._memo.get(("cpu", rank))
        if rate is None:
            rate = self._memo[("cpu", rank)] = self._rate(self.net.cpu_step(rank, 1.0))[0]
        return params / rate if params > 0 and rate < math.inf else 0.0

    def _rate(self, flows: list) -> tuple[float, float]:
        """(rate, latency) of a single-flow transfer: its cap, or the tightest of its links."""
        (_, links, rate, lat), = flows
        for lid, d in links:
            if d > 0:
                rate = min(rate, self.net.capacity[lid] / d)
        return rate, lat
