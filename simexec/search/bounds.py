"""Lower bounds on the step time and peak memory of a plan, without simulating it.

Priced by the simulator's own `ComputeModel` and `Network` (idle network), with the process groups
the lowering itself builds:

- memory: model states (`ResolvedPlan.model_state_bytes`, less the gradient shards that ZeRO-3
  makes during the backward, `Plan.lazy_grad_shards`) + workspace + YaFSDP's buffers + the
  activations the schedule holds before a rank's first backward, with the allocator's overhead;
  and the model states with the fp32 main gradients of the optimizer step.
  Each term is memory the lowering allocates and nothing frees before that moment, so the
  simulated peak cannot be lower; a bound over capacity counts the plan as `oom` unsimulated.
- time: a closed-form critical path of the pipeline: micro-batch 0 through every stage and
  back, then the rank's remaining forwards and backwards, each costing its compute plus the
  collectives the compute stream waits on (tensor-parallel f/g, context-parallel K/V, expert
  all-to-all) and the pipeline messages; then the last gradient reduction, the optimizer step
  (or its offload round trip) and the ZeRO-1/2 parameter all-gather. Also: the ZeRO stream's
  collectives take at least their summed time over its `collective_threads`, and compute runs
  slower while they are in flight, by the SMs an NCCL collective holds (`simexec.sim.overlap`). At least total FLOPs / (world x peak x best efficiency).
- refined time (for plans the first bound does not rule out): the schedule replayed action by
  action (`simexec.program.schedules.pipeline_order`), under ZeRO-3 unit by unit with the parameter
  gathers (two ahead) and gradient reduce-scatters taking turns on their stream's threads.

Contention, slowdowns and every wait the bounds leave out only add time, so they stay below the
simulator (tests/test_search.py holds them to that on hundreds of plans).

The prices: `stage_costs` (compute and the collectives it waits on, per layer and stage),
`comm_costs` (idle-network seconds), `state_costs` (model states per state variant); `pipeline`
assembles the stages into the critical path and the replay, and this module each plan's bounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from simexec.specs.cluster import ClusterSpec
from simexec.specs.model import ModelSpec
from simexec.specs.plan import ResolvedPlan
from simexec.specs.stack import StackSpec
from simexec.search.comm_costs import CommCosts
from simexec.sim.overlap import OverlapShares
from simexec.search.pipeline import PipelineTimes, ReplayEnd
from simexec.search.space import Structure
from simexec.search.stage_costs import LayerCost, StageCosts
from simexec.search.state_costs import RankMemory, RankParams, RankState, StateCosts


@dataclass
class Candidate:
    """One plan of the space with its bounds; `order` is its place in the enumeration."""

    est: float
    time_lb: float
    mem_lb: float
    order: int
    structure: Structure = field(repr=False)
    state: tuple = ()
    sb: Any = field(default=None, repr=False)  # the structure's bounds, for refining
    refined: bool = False

    @property
    def plan_string(self) -> str:
        return self.structure.plan_string(self.state)


class Bounds:
    """Lower bounds on step time and peak memory of the plans of one search (see the module doc).

    Costs are cached at the level they depend on: a layer's forward/backward by (mesh, tp, sp, cp,
    ep, mbs, recompute), model states by (layout, state variant), so a structure costs a few dict
    look-ups per stage and a state variant a few per pipeline rank."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, seq_len: int):
        from simexec.sim.compute import ComputeModel

        self.model, self.cluster, self.seq_len = model, cluster, seq_len
        self.ComputeModel = ComputeModel
        self._cm: dict[str, Any] = {}
        self._comms: dict[tuple, CommCosts] = {}
        self.layers: dict[tuple, LayerCost] = {}
        self.states: dict[tuple, list[RankState]] = {}
        self.memory: dict[tuple, list[RankMemory]] = {}
        self.params: dict[tuple, list[RankParams]] = {}
        self.live: dict[tuple, list] = {}  # passes before the first weight pass, or before the first backward
        self._rebuilt: dict[int, _StructureBounds] = {}
        self.workspace = cluster.costs.workspace_bytes
        # GPU ranks: the simulator's peak is the caching allocator's reserve, at least the tensors it holds
        # (simexec.sim.allocator); a bound counts the tensors alone. CPU ranks keep the overhead share.
        self.dyn = 1.0 + (cluster.costs.allocator_overhead if cluster.device.name == "cpu" else 0.0)
        # the ZeRO stream's collectives are NCCL's: compute beside one runs at least this much slower
        # (its channels depend on the group: `zero_slow`)
        self.shares = OverlapShares(cluster)
        self.threads = cluster.costs.collective_threads

    def cm(self, dtype: str, stack: StackSpec):
        cm = self._cm.get((dtype, stack.name))
        if cm is None:
            cm = self._cm[(dtype, stack.name)] = self.ComputeModel(self.cluster, dtype, stack)
        return cm

    def comm(self, rp: ResolvedPlan) -> tuple[tuple, CommCosts]:
        """The communication prices of `rp`'s mesh, and the mesh's key."""
        p = rp.plan
        key = (p.tp, p.cp, rp.dp, p.pp, p.rank_order)
        m = self._comms.get(key)
        if m is None:
            m = self._comms[key] = CommCosts(rp)
        return key, m

    def candidates(self, st: Structure, start: int) -> list[Candidate]:
        sb = _StructureBounds(self, st)
        return [Candidate(*sb.bounds(state), start + i, st, state, sb) for i, state in enumerate(st.states)]

    def first_bounds(self, structures: Iterable[Structure]) -> list[list[tuple]]:
        """(estimate, time bound, memory bound) of each state of each structure: a worker's part of
        the search (`Candidate`s made of them lack their structure's bounds; `refine` rebuilds
        those where it needs them)."""
        out = []
        for st in structures:
            sb = _StructureBounds(self, st)
            out.append([sb.bounds(state) for state in st.states])
        return out

    def refine(self, c: Candidate) -> float:
        """A tighter time bound for a plan the first one did not prune: the same prices, but the
        pipeline schedule replayed action by action (every micro-batch's messages and waits)."""
        if not c.refined:
            if c.sb is None:  # bounded by a worker
                c.sb = self._rebuilt.get(id(c.structure))
                if c.sb is None:
                    c.sb = self._rebuilt[id(c.structure)] = _StructureBounds(self, c.structure)
            c.time_lb = max(c.time_lb, c.sb.replay_bound(c.state))
            c.refined = True
        return c.time_lb


class _StructureBounds:
    """The bounds of one structure's state variants: its stages' costs and pipeline critical path,
    shared by the variants, and each variant's model-state costs."""

    def __init__(self, b: Bounds, st: Structure):
        self.b = b
        self.stages = stages = StageCosts(b, st)
        self.pipeline = PipelineTimes(b, stages)
        self.state_costs = StateCosts(b, stages)
        self.p, self.comm, self.pp, self.m = stages.p, stages.comm, stages.pp, stages.m
        self._replayed: Optional[list[ReplayEnd]] = None
        self._zero_slow: dict[tuple, float] = {}
        self._zero3_replays: dict[tuple, list[ReplayEnd]] = {}  # (dp_shard, zero_impl, raf) -> its replay

    def replay_bound(self, state: tuple) -> float:
        """Time bound from `PipelineTimes.replay`: each rank's last compute, then its last gradient
        reduction, optimizer step and parameter gather, as in `bounds`. Under ZeRO-3 the replay goes
        unit by unit with the parameter gathers and gradient reduce-scatters on their stream."""
        zero, zero_impl, dp_shard, _, raf = state
        ranks = self.state_costs.state(state)
        if zero == 3 and len(self.comm.groups(self.comm.rank_of_stage[0], self.p.ep, dp_shard, self.p.etp)["zero"]) > 1:
            ends = self._zero3_replays.get((dp_shard, zero_impl, raf))
            if ends is None:
                ends = self._zero3_replays[(dp_shard, zero_impl, raf)] = self.pipeline.replay(
                    dp_shard or 0, self.p.zero3_policy(zero_impl), raf)
            t = 0.0
            for e, rank in zip(ends, ranks):
                t = max(t, max(e.last_compute + e.closing, e.stream_done) + rank.after_reduction)
            return t * (1.0 - 1e-9)
        ends = self._replayed
        if ends is None:
            ends = self._replayed = self.pipeline.replay()
        t = 0.0
        for e, rank in zip(ends, ranks):
            red, tail = rank.last_reduction, e.closing
            t = max(t, e.last_compute + (red if red > tail else tail) + rank.after_reduction)
        return t * (1.0 - 1e-9)

    def zero_slow(self, state: tuple) -> float:
        """a = 1 - 1/s, s the least slowdown one collective of the ZeRO stream (its gathers and
        reductions over the ZeRO and expert-data groups, HSDP's replica all-reduce) causes."""
        a = self._zero_slow.get(state)
        if a is None:
            shares, dp_shard = self.b.shares, state[2]
            g = self.comm.groups(self.comm.rank_of_stage[0], self.p.ep, dp_shard, self.p.etp)
            s = min((shares.nccl_slowdown(g[k]) for k in ("zero", "edp") if len(g[k]) > 1),
                    default=shares.nccl_slowdown())
            if (dp_shard or self.p.ep > 1) and shares.uniform is None:  # replicas of a shard, experts' groups
                s = min(s, 1.0 / shares.rate(shares.fewest_channels()))
            a = self._zero_slow[state] = 1.0 - 1.0 / s
        return a

    def bounds(self, state: tuple) -> tuple[float, float, float]:
        """(ordering estimate, time lower bound, memory lower bound) of this structure with `state`."""
        ranks = self.state_costs.state(state)
        ws, dyn, a = self.b.workspace, self.b.dyn, self.zero_slow(state)
        t = mem = tr = 0.0
        pl, m = self.pipeline, self.m
        lc, own, tl, act, wa, wk = pl.last_compute, pl.own_last_compute, pl.tail, pl.act, pl.w_after, pl.work
        for r in range(self.pp):
            rank = ranks[r]
            red = rank.last_reduction
            rest = (red if red > tl[r] else tl[r]) + rank.after_reduction
            x = lc[r] + rest
            # its threads share the stream's work
            z = (rank.stream_fixed + m * rank.stream_per_micro_batch) / self.b.threads
            if z > x:
                x = z
            # Compute runs at most 1 - a as fast while an NCCL collective of the rank is in flight
            # (a = 1 - 1/s, s: `OverlapShares.nccl_slowdown`; more transfers only hold more SMs), and
            # the ZeRO stream keeps one in flight for z seconds. After its first backward the rank's
            # compute is busy C >= work + a * overlap and its own sequence E = own[r] + rest gains
            # a * overlap; both C and z lie within T, so overlap >= C + z - T, overlap (1 - a) >=
            # work + z - T, and T >= E + a (work + z - T) / (1 - a): T >= E + a (work + z - E)
            # (where work + z < T, T >= E covers it).
            e = own[r] + rest
            y = e + a * (wa[r] + z - e)
            if y > x:
                x = y
            # the same over the whole step (under ZeRO-3 the stream is busy from the first forward):
            # T >= C >= work + a (C + z - T) gives T >= work + a z
            y = wk[r] + a * z
            if y > x:
                x = y
            if x > t:
                t = x
            mm = rank.memory
            y = mm.early_model_states + ws + dyn * (mm.buffers + mm.gathered_at_backward + act[r])
            if y > mem:
                mem = y
            y = mm.early_model_states + ws + dyn * (mm.buffers + (mm.held_after_backward if m > 1 else 0.0))
            if y > mem:
                mem = y
            y = mm.model_states + ws + mm.main_grads  # the optimizer step: model states and the fp32 main gradients
            if y > mem:
                mem = y
            if rank.grad_traffic > tr:
                tr = rank.grad_traffic
        est = t + 0.1 * tr
        # float sums in another order than the simulator's may differ in the last bits: stay below
        return est, t * (1.0 - 1e-9), mem * (1.0 - 1e-9)
