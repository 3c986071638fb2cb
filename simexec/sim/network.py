"""Links, fair sharing between concurrent transfers, and collective algorithms with alpha-beta costs.

Links (each one direction, capacities after the cluster's efficiency factors):

- per device: NVLink port out / in (`node.intra_bw * intra_bw_eff`); PCIe device-to-host and
  host-to-device (`node.host_link_bw * host_link_eff`). Ranks of one NVLink domain
  (`ClusterSpec.nvlink_domain`: the node, or a whole GB200 NVL72 rack of 18 nodes) talk over these
  ports; on a switchless mesh (`node.intra_peer_bw`) a group of k devices reaches only its k-1 links;
- per node: the NICs together (`nics_per_node * nic_bw * inter_bw_eff`), out / in; one device can
  drive only its own share of them (its rail: NICs / GPUs per node), a cap on each of its flows;
- per pod (when `network.pod_nodes` splits the cluster): the uplinks, the pod's NIC total divided by
  `oversubscription`, for traffic that leaves the pod;
- per node: the host CPU (Adam steps per second) for `cpu_optimizer`.

Sharing is a fluid model: a transfer advances at the rate of its most loaded link, where a link's
capacity is split in proportion to the bytes each transfer puts on it per unit of progress ("each of
n equal flows gets bw/n"); rates are recomputed whenever a transfer starts or ends.

Collectives on NVIDIA devices (`device.nccl_arch`) are priced as NCCL prices them: every
(algorithm, protocol) pair NCCL considers on the group (ring; tree for all-reduce; NVLS and NVLS-tree
where the switches reduce; PAT for one GPU per node), each with NCCL's latency and the protocol's
share of the links' bandwidth, the cheapest chosen (`simexec.sim.nccl_tuning`, docs/collectives.md).
Elsewhere (RCCL, gloo) the candidates are alpha-beta: ring, double binary tree and hierarchical
all-reduce. Either way a chosen algorithm's phases load the links, so concurrent ones share them.

A group spanning several NVLink domains crosses between them over the NICs of the nodes its members
sit on, each node carrying its members' share of their domain's traffic.

Symmetric programs simulate one rank per pipeline rank. A collective's group keeps all its ranks,
and the ranks a present rank stands for run the same collective over their own groups at the same
time. Per-device links are private to one group member, so only present members' ports are modelled;
a node's (pod's) links are shared by every group of that axis with members there: |R ∩ node| /
|G ∩ node| groups, R the ranks the present members stand for, G the group. That multiplicity
multiplies the transfer's demand on the node's links, so 8 GPUs of a node each running a
data-parallel all-reduce share the node's NICs in symmetric and full mode alike.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Iterable

from simpy.events import Timeout

from simexec.sim import nccl_tuning
from simexec.specs.cluster import ClusterSpec

INF = math.inf

# A phase of a transfer: (amount, ((link, demand), ...), rate cap, latency after it).
# `amount` is in units of progress (bytes); `demand` the bytes it puts on the link per unit.
Phase = tuple[float, tuple[tuple[int, float], ...], float, float]


BYTES, SOLO, TAIL = 0, 1, 2  # flow states: sharing links; alone (one timer to the end); latency only


class Flow:
    """One transfer phase on the fluid network: `left` bytes at `rate`, then `tail` seconds of latency.

    A flow alone on all its links needs no event when its bytes end: one timer covers bytes and
    latency (state SOLO). If another flow joins meanwhile, the time is split again; if the bytes
    had already ended, the flow leaves its links at once (state TAIL) and keeps its timer.
    """

    __slots__ = ("fluid", "left", "rate", "t", "links", "cap", "tail", "timer", "done", "seq", "state")

    def __init__(self, fluid, seq, amount, links, cap, tail, done):
        self.fluid = fluid
        self.seq = seq
        self.left = amount
        self.rate = 0.0
        self.t = fluid.env.now
        self.links = links
        self.cap = cap
        self.tail = tail
        self.timer = None
        self.done = done
        self.state = BYTES

    def __call__(self, _event) -> None:  # the timer's callback
        self.fluid._timer(self)


class Fluid:
    """Links as shared resources: concurrent flows split each link; rates change as flows come and go."""

    def __init__(self, env, capacity: list[float]):
        self.env = env
        self.cap = capacity  # shared with the Network, which appends links as it meets them
        self.load: dict[int, float] = {}
        self.on: dict[int, dict[int, Flow]] = {}
        self._seq = 0

    def start(self, amount: float, links, cap: float, tail: float, done: Callable[[], None]) -> Flow:
        """Start a flow of `amount` bytes over `links`; `done()` runs `tail` seconds after its bytes end."""
        self._seq += 1
        if amount <= 0.0:
            links = ()
        f = Flow(self, self._seq, amount, links, cap, tail, done)
        if not links:
            self._set(f, cap, True)
            return f
        load, on = self.load, self.on
        shared = False
        for lid, d in links:
            load[lid] = load.get(lid, 0.0) + d
            flows = on.get(lid)
            if flows is None:
                on[lid] = {f.seq: f}
            else:
                if flows:
                    shared = True
                flows[f.seq] = f
        if not shared:  # the common case: nothing else on these links
            r = cap
            cap_ = self.cap
            for lid, d in links:
                x = cap_[lid] / d
                if x < r:
                    r = x
            self._set(f, r, True)
            return f
        affected: dict[int, Flow] = {}
        for lid, _ in links:
            affected.update(on[lid])
        self._rerate(affected.values())
        return f

    def _set(self, f: Flow, rate: float, alone: bool) -> None:
        """(Re)schedule f's timer for its new rate."""
        if f.timer is not None:
            f.timer.callbacks.clear()  # the old timer is stale: it will fire into nothing
        f.rate = rate
        left = f.left if f.left > 0.0 else 0.0
        dt = left / rate if rate < INF else 0.0
        if alone:
            f.state = SOLO
            dt += f.tail
        else:
            f.state = BYTES
        f.timer = Timeout(self.env, dt)
        f.timer.callbacks.append(f)

    def _leave(self, f: Flow) -> dict[int, Flow]:
        """Take f off its links; return the flows left on them."""
        load, on = self.load, self.on
        affected: dict[int, Flow] = {}
        for lid, d in f.links:
            flows = on[lid]
            del flows[f.seq]
            if flows:
                load[lid] -= d
                affected.update(flows)
            else:
                load[lid] = 0.0  # drop float residue once a link is idle
        f.links = ()
        return affected

    def _rerate(self, flows: Iterable[Flow]) -> None:
        now, cap, load, on = self.env.now, self.cap, self.load, self.on
        live = []
        for f in flows:
            el = now - f.t
            if el > 0.0:
                moved = f.rate * el
                if f.state == SOLO and moved >= f.left:
                    # Its bytes ended while it was alone; only latency is left: free the links now.
                    f.left = 0.0
                    f.state = TAIL
                    self._leave(f)
                    continue
                f.left -= moved
                f.t = now
            live.append(f)
        for f in live:
            r = f.cap
            alone = True
            for lid, _ in f.links:
                x = cap[lid] / load[lid]
                if x < r:
                    r = x
                if alone and len(on[lid]) > 1:
                    alone = False
            if r != f.rate or alone != (f.state == SOLO) or f.timer is None:
                self._set(f, r, alone)

    def _timer(self, f: Flow) -> None:
        if f.state == BYTES:  # bytes done, others speed up; then the latency
            f.left = 0.0
            f.t = self.env.now
            affected = self._leave(f)
            if affected:
                self._rerate(affected.values())
            if f.tail > 0.0:
                f.state = TAIL
                f.timer = Timeout(self.env, f.tail)
                f.timer.callbacks.append(f)
                return
        elif f.links:  # SOLO: bytes and latency both over
            affected = self._leave(f)
            if affected:
                self._rerate(affected.values())
        f.done()


class _Geometry:
    """Where a group's members sit (NVLink domains, nodes, pods), and how many concurrent copies of it
    share each node and pod.

    `domains` and `k` (the most members in one domain) decide NVLink against network; `node_share` is
    the fraction of its domain's members a node holds (1 where the domain is the node), the share of
    the domain's network traffic that node's NICs carry.
    """

    __slots__ = ("n", "domains", "k", "present", "node_mult", "node_share", "pods", "pod_mult", "pod_k")


class Network:
    """Topology of one cluster and the transfers (phases over links) of collectives, p2p and copies."""

    def __init__(self, cluster: ClusterSpec, present: Iterable[int], represents: dict[int, tuple[int, ...]]):
        c, node, net = cluster.costs, cluster.node, cluster.network
        self.gpn = max(1, node.gpus_per_node)
        self.domain = max(self.gpn, cluster.nvlink_domain)
        self.nodes = cluster.nodes
        self.pod_nodes = net.pod_nodes if 0 < net.pod_nodes < cluster.nodes else 0
        self.nvl_bw = node.intra_bw * c.intra_bw_eff
        self.pcie_bw = node.host_link_bw * c.host_link_eff
        self.peer_bw = node.intra_peer_bw * c.intra_bw_eff  # 0: switched fabric
        self.node_nic_bw = net.nics_per_node * net.nic_bw * c.inter_bw_eff
        self.rail_bw = self.node_nic_bw / self.gpn if self.node_nic_bw > 0 else self.nvl_bw
        if self.node_nic_bw <= 0:
            self.node_nic_bw = self.nvl_bw * self.gpn  # no NICs: only ever one node (the `local` cluster)
        self.pod_bw = self.pod_nodes * self.node_nic_bw / net.oversubscription
        self.a_intra = node.intra_latency_s
        self.a_inter = net.latency_s
        self.call_latency = c.collective_latency_s
        self.nccl_arch = cluster.device.nccl_arch
        self.nvls = node.nvls
        self.collnet = net.sharp and self.peer_bw == 0  # CollNet Direct needs an NVSwitch fabric
        self.rail_optimized = net.topology == "rail-optimized" and net.nics_per_node > 0
        self.rails = max(1, min(self.gpn, net.nics_per_node))
        self.domain_nics = net.nics_per_node * (self.domain // self.gpn)
        self.cpu_vendor = node.cpu_vendor
        self.cpu_rate = node.cpu_optimizer_params_per_s
        self.present = set(present)
        self.represents = {r: tuple(v) for r, v in represents.items() if v}
        self.capacity: list[float] = []
        self._ids: dict[tuple[str, int], int] = {}
        self._geo: dict[tuple[int, ...], _Geometry] = {}
        self._cache: dict[tuple, tuple[Phase, ...]] = {}
        self._choice: dict[tuple, str] = {}
        self.nic_slowdown: dict[int, float] = {}  # node -> factor: its NICs carry 1/factor of their bandwidth

    def slow_nics(self, factors: dict[int, float]) -> None:
        """Divide the named nodes' NIC links (`nic_tx`, `nic_rx`) by their factors: a degraded NIC or
        cable. Only the links' capacities change, so the collective chosen and its latencies stay what
        NCCL would pick on healthy hardware; a flow alone on its rail keeps its rail cap. Call before
        the first transfer is priced."""
        self.nic_slowdown = {int(n): float(f) for n, f in factors.items() if f != 1.0}
        for (kind, where), lid in self._ids.items():
            if kind in ("nic_tx", "nic_rx") and where in self.nic_slowdown:
                self.capacity[lid] = self.node_nic_bw / self.nic_slowdown[where]

    # --- links ---------------------------------------------------------------------------------

    def node_of(self, rank: int) -> int:
        return rank // self.gpn

    def domain_of(self, rank: int) -> int:
        """The NVLink domain of a rank: ranks of one domain talk over NVLink, others over the NICs."""
        return rank // self.domain

    def pod_of(self, node: int) -> int:
        return node // self.pod_nodes if self.pod_nodes else 0

    def rail_of(self, rank: int) -> int:
        """The NIC (rail) a rank sends through: its node's NICs shared out in local-rank order."""
        return (rank % self.gpn) * self.rails // self.gpn

    def _cross_rail_share(self) -> float:
        """On a rail-optimized network, the share of a rank's traffic to evenly spread peers in other
        nodes that targets another rail: NCCL's PXN (on by default since NCCL 2.12) first moves it over
        NVLink to the node's GPU on the destination's rail, which sends it on that rail; 0 on a fat tree,
        where every NIC reaches every other through the leaf and spine switches."""
        return (self.rails - 1) / self.rails if self.rail_optimized else 0.0

    def link(self, kind: str, where: int) -> int:
        key = (kind, where)
        lid = self._ids.get(key)
        if lid is None:
            lid = self._ids[key] = len(self.capacity)
            self.capacity.append({
                "nvl_tx": self.nvl_bw, "nvl_rx": self.nvl_bw, "nic_tx": self.node_nic_bw,
                "nic_rx": self.node_nic_bw, "pod_tx": self.pod_bw, "pod_rx": self.pod_bw,
                "d2h": self.pcie_bw, "h2d": self.pcie_bw, "cpu": self.cpu_rate,
            }[kind] / (self.nic_slowdown.get(where, 1.0) if kind in ("nic_tx", "nic_rx") else 1.0))
        return lid

    def _stands_for(self, rank: int) -> tuple[int, ...]:
        return self.represents.get(rank, (rank,))

    def geometry(self, group: tuple[int, ...]) -> _Geometry:
        g = self._geo.get(group)
        if g is not None:
            return g
        g = _Geometry()
        g.n = len(group)
        per_dom = Counter(self.domain_of(r) for r in group)
        g.domains = len(per_dom)
        g.k = max(per_dom.values())
        per_node = Counter(self.node_of(r) for r in group)
        g.present = tuple(r for r in group if r in self.present) or (group[0],)
        stood = Counter()
        for r in g.present:
            stood.update(self.node_of(x) for x in self._stands_for(r))
        g.node_mult = {}
        g.node_share = {}
        for r in g.present:
            nd = self.node_of(r)
            g.node_mult[nd] = max(1.0, stood[nd] / per_node[nd])
            g.node_share[nd] = per_node[nd] / per_dom[self.domain_of(r)]
        per_pod = Counter(self.pod_of(nd) for nd in per_node.elements())
        g.pods = len(per_pod) if self.pod_nodes else 1
        g.pod_k = dict(per_pod)
        stood_pod = Counter()
        for nd, cnt in stood.items():
            stood_pod[self.pod_of(nd)] += cnt
        g.pod_mult = {self.pod_of(nd): max(1.0, stood_pod[self.pod_of(nd)] / per_pod[self.pod_of(nd)])
                      for nd in g.node_mult}
        self._geo[group] = g
        return g

    def _nvl(self, ranks: Iterable[int], demand: float) -> list[tuple[int, float]]:
        out = []
        for r in ranks:
            out.append((self.link("nvl_tx", r), demand))
            out.append((self.link("nvl_rx", r), demand))
        return out

    def _nic(self, g: _Geometry, demand: float) -> list[tuple[int, float]]:
        out = []
        for nd, mult in g.node_mult.items():
            d = demand * mult * g.node_share[nd]
            out.append((self.link("nic_tx", nd), d))
            out.append((self.link("nic_rx", nd), d))
        if g.pods > 1:
            for pod, mult in g.pod_mult.items():
                out.append((self.link("pod_tx", pod), demand * mult))
                out.append((self.link("pod_rx", pod), demand * mult))
        return out

    # --- phases --------------------------------------------------------------------------------

    def _ring(self, g: _Geometry, amount: float, steps: int) -> Phase:
        """A ring step pattern over the whole group: every rank sends `amount` to its successor.

        Rings are laid out domain by domain (as NCCL builds them node by node), so a ring enters and
        leaves each NVLink domain once; inside a domain a device forwards (k-1)/k of the data over
        NVLink, the rest crosses the NICs.
        """
        if g.domains == 1:
            return (amount, tuple(self._nvl(g.present, 1.0)), self._mesh_cap(g), steps * self.a_intra)
        links = self._nvl(g.present, (g.k - 1) / g.k) if g.k > 1 else []
        links += self._nic(g, 1.0)
        return (amount, tuple(links), g.k * self.rail_bw, steps * self.a_inter)

    def _intra(self, g: _Geometry, amount: float, steps: int) -> Phase:
        """A ring inside each NVLink domain (its k members), all domains at once."""
        return (amount, tuple(self._nvl(g.present, 1.0)), self._mesh_cap(g), steps * self.a_intra)

    def _mesh_cap(self, g: _Geometry) -> float:
        """A device's rate inside a switchless mesh: its k-1 links to the group's other members
        (RCCL lays rings over all of them); unbounded (the port decides) on a switched fabric."""
        return (g.k - 1) * self.peer_bw if self.peer_bw > 0 and g.k > 1 else INF

    def _inter(self, g: _Geometry, amount: float, steps: int) -> Phase:
        """k parallel rings across domains, one per local rank; `amount` is what each domain sends."""
        return (amount, tuple(self._nic(g, 1.0)), g.k * self.rail_bw, steps * self.a_inter)

    def collective(self, verb: str, group: tuple[int, ...], nbytes: float) -> tuple[Phase, ...]:
        """Phases of the fastest algorithm for this collective on an idle network, as NCCL picks it
        (`simexec.sim.nccl_tuning`) on NCCL devices, the cheapest alpha-beta candidate elsewhere."""
        key = (verb, group, nbytes)
        out = self._cache.get(key)
        if out is None:
            g = self.geometry(group)
            cands = self._candidates(verb, g, float(nbytes))
            name, out = min(cands, key=lambda c: self.estimate(c[1]))
            amount, links, cap, lat = out[-1]
            out = out[:-1] + ((amount, links, cap, lat + self.call_latency),)
            self._cache[key] = out
            self._choice[key] = name
        return out

    def algorithm(self, verb: str, group: tuple[int, ...], nbytes: float) -> str:
        """The algorithm/protocol `collective` chose (e.g. `ring/LL128`, `nvls/Simple`; `ring` off NCCL)."""
        self.collective(verb, group, nbytes)
        return self._choice[(verb, group, nbytes)]

    def _candidates(self, verb: str, g: _Geometry, S: float) -> list[tuple[str, tuple[Phase, ...]]]:
        if g.n == 1:
            return [("none", ((0.0, (), INF, 0.0),))]
        if self.nccl_arch is not None and verb != "alltoall":
            return self._nccl_candidates(verb, g, S)
        return self._alpha_beta_candidates(verb, g, S)

    def _nccl_candidates(self, verb: str, g: _Geometry, S: float) -> list[tuple[str, tuple[Phase, ...]]]:
        """NCCL's (algorithm, protocol) pairs on this group: each one's traffic on the links, its
        bandwidth scaled by the protocol's efficiency (a link carries 1/efficiency bytes per payload
        byte) and NCCL's latency in place of per-hop alphas."""
        n, N, k = g.n, g.domains, g.k
        out = []
        for opt in nccl_tuning.options(verb, n, N, self.nccl_arch, self.cpu_vendor, self.nvls, S,
                                       collnet=self.collnet, nics=self.domain_nics):
            a = opt.algorithm
            if a.startswith("collnet") or (a == "nvls" and N > 1):
                # The switches reduce: each domain sends its reduced S once and gets the result once,
                # spread over its NICs (a ring's all-reduce moves 2(n-1)/n S each way). Inside the
                # domain a reduce-scatter and an all-gather over NVLink (CollNet), or NVLS (S each way).
                if a == "nvls":  # NVLS's efficiency is its NVLink share's (as for nvls_tree)
                    links = self._nvl(g.present, 1.0 / opt.efficiency) + self._nic(g, 1.0)
                    phase = (S, tuple(links), k * self.rail_bw, opt.latency_s)
                else:
                    links = (self._nvl(g.present, 2 * (k - 1) / k) if k > 1 else []) + self._nic(g, 1.0)
                    phase = self._scaled((S, tuple(links), k * self.rail_bw, 0.0), opt)
            elif a in ("ring", "pat"):
                amount = {"allreduce": 2 * (n - 1) / n * S, "broadcast": S}.get(verb, (n - 1) / n * S)
                phase = self._scaled(self._ring(g, amount, 0), opt)
            elif a == "tree":
                links = (self._nvl(g.present, 1.0) if k > 1 else []) + (self._nic(g, 1.0) if N > 1 else [])
                cap = k * self.rail_bw if N > 1 else self._mesh_cap(g)
                phase = self._scaled((2 * S, tuple(links), cap, 0.0), opt)
            elif a == "nvls":
                # Multimem loads reduce in the switch and stores multicast from it: an all-reduce moves
                # S each way per GPU, an all-gather / reduce-scatter (n-1)/n S.
                amount = S if verb == "allreduce" else (n - 1) / n * S
                phase = self._scaled((amount, tuple(self._nvl(g.present, 1.0)), self._mesh_cap(g), 0.0), opt)
            else:  # nvls_tree: NVLS inside each domain (S each way), a tree of 2S between them
                amount = S if N <= 2 else 2 * S  # two domains: the tree's two directions run at once
                links = self._nvl(g.present, S / amount / opt.efficiency) + self._nic(g, 1.0)
                phase = (amount, tuple(links), k * self.rail_bw, opt.latency_s)
            out.append((f"{a}/{opt.protocol}", (phase,)))
        return out

    @staticmethod
    def _scaled(phase: Phase, opt: "nccl_tuning.Option") -> Phase:
        """A phase at `opt`'s protocol efficiency and bandwidth cap, with its latency."""
        amount, links, cap, _ = phase
        e = opt.efficiency
        return (amount, tuple((lid, d / e) for lid, d in links), min(cap * e, opt.cap), opt.latency_s)

    def _alpha_beta_candidates(self, verb: str, g: _Geometry, S: float) -> list[tuple[str, tuple[Phase, ...]]]:
        """Off NCCL (RCCL, gloo): ring, double binary tree and a hierarchical all-reduce, per-hop alphas."""
        n, N, k = g.n, g.domains, g.k
        if verb == "allreduce":
            # Ring: 2(n-1)/n * S per rank in 2(n-1) steps (Patarasuk & Yuan 2009; Thakur et al. 2005).
            cands = [("ring", (self._ring(g, 2 * (n - 1) / n * S, 2 * (n - 1)),))]
            if N > 1:
                # Double binary tree: ~2S per rank, 2 log2(N) inter-node steps (NCCL 2.4, Sanders et al. 2009).
                lat = 2 * math.ceil(math.log2(N)) * self.a_inter + 2 * (k - 1) * self.a_intra
                links = (self._nvl(g.present, 1.0) if k > 1 else []) + self._nic(g, 1.0)
                cands.append(("tree", ((2 * S, tuple(links), k * self.rail_bw, lat),)))
                if k > 1:
                    # Hierarchical: reduce-scatter in the node, all-reduce of each 1/k share across
                    # nodes (k rings at once), all-gather in the node (Jia et al. 2018; Horovod/NCCL).
                    cands.append(("hierarchical", (
                        self._intra(g, (k - 1) / k * S, k - 1),
                        self._inter(g, 2 * (N - 1) / N * S, 2 * (N - 1)),
                        self._intra(g, (k - 1) / k * S, k - 1),
                    )))
            return cands
        if verb in ("allgather", "reducescatter"):
            # Ring only (NCCL and RCCL have no hierarchical all-gather / reduce-scatter): (n-1)/n * S
            # per rank in n-1 steps; S is the full (gathered / unreduced) tensor.
            return [("ring", (self._ring(g, (n - 1) / n * S, n - 1),))]
        if verb == "alltoall":
            return [("pairwise", (self._alltoall(g, S),))]
        if verb == "broadcast":
            # Pipelined ring (chain) broadcast: S / B + (n-1) alpha for large messages.
            return [("ring", (self._ring(g, S, n - 1),))]
        raise ValueError(f"unknown collective {verb!r}")

    def _alltoall(self, g: _Geometry, S: float) -> Phase:
        """Pairwise exchange: each rank sends S/n to every other rank in n-1 steps."""
        n, k = g.n, g.k
        if g.domains == 1:
            links = self._nvl(g.present, (k - 1) / n) if k > 1 else []
            return (S, tuple(links), self._mesh_cap(g) * n / max(1, k - 1), (n - 1) * self.a_intra)
        out_frac = (n - k) / n  # of each rank's data, what leaves its NVLink domain
        # PXN on rails: a rank forwards the cross-rail share of what it sends out, and (by symmetry)
        # relays as much for its node's peers, over NVLink
        pxn = out_frac * self._cross_rail_share()
        links = self._nvl(g.present, (k - 1) / n + pxn) if k > 1 or pxn else []
        for nd, mult in g.node_mult.items():
            d = k * out_frac * mult * g.node_share[nd]
            links.append((self.link("nic_tx", nd), d))
            links.append((self.link("nic_rx", nd), d))
        if g.pods > 1:
            for pod, mult in g.pod_mult.items():
                kp = g.pod_k[pod]
                links.append((self.link("pod_tx", pod), kp * (n - kp) / n * mult))
                links.append((self.link("pod_rx", pod), kp * (n - kp) / n * mult))
        return (S, tuple(links), self.rail_bw / out_frac, (n - 1) * self.a_inter)

    def p2p(self, src: int, dst: int, nbytes: float) -> tuple[Phase, ...]:
        """One point-to-point message (pipeline activations or gradients)."""
        key = ("p2p", src, dst, nbytes)
        out = self._cache.get(key)
        if out is None:
            a, b = self.node_of(src), self.node_of(dst)
            if self.domain_of(src) == self.domain_of(dst):
                links = ((self.link("nvl_tx", src), 1.0), (self.link("nvl_rx", dst), 1.0))
                out = ((float(nbytes), links, self.peer_bw or INF, self.a_intra),)
            else:
                ma, mb = self._node_share(src), self._node_share(dst)
                links = [(self.link("nic_tx", a), ma), (self.link("nic_rx", b), mb)]
                if self.pod_nodes and self.pod_of(a) != self.pod_of(b):
                    links += [(self.link("pod_tx", self.pod_of(a)), ma), (self.link("pod_rx", self.pod_of(b)), mb)]
                lat = self.a_inter
                if self.rail_optimized and self.rail_of(src) != self.rail_of(dst):
                    # PXN: over NVLink to the sender node's GPU on the receiver's rail, then out its NIC
                    proxy = a * self.gpn + dst % self.gpn
                    links += [(self.link("nvl_tx", src), 1.0), (self.link("nvl_rx", proxy), 1.0)]
                    lat += self.a_intra
                out = ((float(nbytes), tuple(links), self.rail_bw, lat),)
            self._cache[key] = out
        return out

    def _node_share(self, rank: int) -> float:
        """Concurrent copies of one rank's traffic on its node: the ranks it stands for there."""
        nd = self.node_of(rank)
        return float(max(1, sum(1 for x in self._stands_for(rank) if self.node_of(x) == nd)))

    def copy(self, rank: int, direction: str, nbytes: float) -> tuple[Phase, ...]:
        """A host<->device copy over the device's own PCIe link (`d2h` or `h2d`)."""
        return ((float(nbytes), ((self.link(direction, rank), 1.0),), INF, 0.0),)

    def cpu_step(self, rank: int, params: float) -> tuple[Phase, ...]:
        """A CPU optimizer step: the node's cores are shared by the ranks stepping at once."""
        return ((float(params), ((self.link("cpu", self.node_of(rank)), self._node_share(rank)),), INF, 0.0),)

    def estimate(self, phases: Iterable[Phase]) -> float:
        """Seconds of the phases on an otherwise idle network."""
        t = 0.0
        cap = self.capacity
        for amount, links, rcap, lat in phases:
            r = rcap
            for lid, d in links:
                if d > 0:
                    r = min(r, cap[lid] / d)
            t += (amount / r if amount > 0 and r < INF else 0.0) + lat
        return t
