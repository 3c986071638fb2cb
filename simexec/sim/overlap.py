"""How fast a GPU computes while its rank's transfers are in flight, by what moves each transfer.

A communication kernel occupies SMs that compute kernels then cannot use; a copy-engine copy
occupies none. So each transfer holds a number of SMs while it is in flight (`OverlapShares.held`):
- an NCCL collective: one CTA per channel, each on an SM: `costs.nccl_channels` inside an NVLink
  domain; across domains NCCL's topology search builds its rings per NIC (a channel's speed close to one
  400 Gb/s NIC's, 48 GB/s on Hopper, then duplicated: NVIDIA/nccl@5067397c src/graph/search.cc,
  sm90SpeedArrayInter and dupChannels), so two per NIC the
  group's ranks on a node use, at most `costs.nccl_channels` (16 with 8 GPUs of a DGX H100, 2 with one);
  an NCCL send/recv the channels NCCL gives one peer (`costs.nccl_p2p_channels`);
- DeepEP's dispatch and combine (the `ep_net` / `ep_domain` hops of `moe_dispatcher=deepep`):
  `costs.deepep_sms`;
- under `tp_async`, Transformer Engine's userbuffers on the tp axis: the all-gathers before a GEMM
  by ring exchange on the copy engines (none), the reduce-scatters and the backward's bulk
  re-gathers of the input on `costs.userbuffers_sms`; the tp all-reduces stay NCCL's;
- host <-> device copies (offload): copy engines, none.
Compute then runs at (SMs - held) / SMs of its idle speed (`rate`), the held SMs of concurrent
transfers adding up, at most all but one SM.

Where the cluster gives a uniform `costs.overlap_slowdown` (CPU ranks, devices without `device.sms`)
every transfer counts one and compute runs 1/overlap_slowdown as fast while any is in flight.
"""
from __future__ import annotations

from typing import Optional

from simexec.specs.cluster import ClusterSpec
from simexec.program.instructions import Instr

DEEPEP_AXES = ("ep_net", "ep_domain")


class OverlapShares:
    """The SMs each transfer holds and the compute rate they leave, for one cluster and plan."""

    def __init__(self, cluster: ClusterSpec, tp_async: bool = False):
        costs = cluster.costs
        self.uniform: Optional[float] = costs.overlap_slowdown
        self.sms = cluster.device.sms or 0
        self.nccl = costs.nccl_channels
        self.p2p = costs.nccl_p2p_channels
        self.deepep = costs.deepep_sms
        self.ub = costs.userbuffers_sms
        self.tp_async = tp_async
        self.cluster = cluster
        nics = cluster.network.nics_per_node / cluster.node.gpus_per_node if cluster.node.gpus_per_node else 0.0
        self.net_per_rank = max(1.0, nics)
        self._rates: dict[int, float] = {0: 1.0}
        self._groups: dict[tuple[int, ...], int] = {}

    def channels(self, group: tuple[int, ...]) -> int:
        """NCCL's channels for a collective over `group`: `nccl_channels` inside an NVLink domain; across
        domains two per NIC its ranks on a node use (the ring search's graph per NIC, duplicated), at
        most `nccl_channels`."""
        out = self._groups.get(group)
        if out is None:
            c = self.cluster
            out = self.nccl
            if c.nodes > 1 and len({c.domain_of(r) for r in group}) > 1:
                per_node: dict[int, int] = {}
                for r in group:
                    nd = c.node_of(r)
                    per_node[nd] = per_node.get(nd, 0) + 1
                out = min(self.nccl, 2 * max(1, round(max(per_node.values()) * self.net_per_rank)))
            self._groups[group] = out
        return out

    def held(self, ins: Instr) -> int:
        """SMs transfer `ins` holds while in flight (uniform slowdown: 1 for every transfer)."""
        if self.uniform is not None:
            return 1
        if ins.kind == "copy":
            return 0
        if ins.axis in DEEPEP_AXES:
            return self.deepep
        if ins.kind == "send" or ins.kind == "recv":
            return self.p2p
        if self.tp_async and ins.axis == "tp" and ins.kind == "collective":
            verb = ins.op.split("@", 1)[0]
            if verb == "allgather":
                return self.ub if ins.block.endswith("_regather") else 0
            if verb == "reducescatter":
                return self.ub
        return self.channels(ins.group) if ins.group else self.nccl

    def rate(self, held: int) -> float:
        """Compute speed (1 = idle device) while transfers holding `held` SMs in all are in flight."""
        r = self._rates.get(held)
        if r is None:
            if self.uniform is not None:
                r = 1.0 / self.uniform
            else:
                r = (self.sms - min(held, self.sms - 1)) / self.sms
            self._rates[held] = r
        return r

    def fewest_channels(self) -> int:
        """The fewest channels a collective may hold: one rank per node across NVLink domains."""
        return min(self.nccl, 2 * max(1, round(self.net_per_rank))) if self.cluster.nodes > 1 else self.nccl

    def nccl_slowdown(self, group: tuple[int, ...] = ()) -> float:
        """How much slower compute runs beside one NCCL collective over `group` (what the search's
        bounds may assume of a ZeRO stream's collectives); no group: one inside an NVLink domain."""
        if self.uniform is not None:
            return self.uniform
        return 1.0 / self.rate(self.channels(group) if group else self.nccl)
