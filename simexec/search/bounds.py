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
  `overlap_slowdown` slower while they are in flight. At least total FLOPs / (world x peak x best efficiency).
- refined time (for plans the first bound does not rule out): the schedule replayed action by
  action (`simexec.program.schedules.pipeline_order`), under ZeRO-3 unit by unit with the parameter
  gathers (two ahead) and gradient reduce-scatters taking turns on their stream's threads.

Contention, slowdowns and every wait the bounds leave out only add time, so they stay below the
simulator (tests/test_search.py holds them to that on hundreds of plans).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Optional

from simexec.specs.cluster import ClusterSpec
from simexec.program.adam import ADAM_FLOPS_PER_PARAM, adam_bytes_per_param
from simexec.program.layer_order import TP_CONJUGATES as _TP_OPS
from simexec.program.lower import representatives
from simexec.specs.model import ModelSpec
from simexec.specs.plan import ResolvedPlan
from simexec.search.space import Structure



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


class _Mesh:
    """Network and representative ranks of one mesh (tp, cp, dp, pp), shared by its structures."""

    def __init__(self, rp: ResolvedPlan):
        from simexec.sim.network import Network

        self.rp = rp
        self.reps = representatives(rp)
        self.net = Network(rp.cluster, list(self.reps), self.reps)
        self.mesh = rp.mesh
        self.rank_of_stage = {rp.mesh.coords(r)["pp"]: r for r in self.reps}
        self._memo: dict[tuple, float] = {}

    def coll(self, verb: str, rank: int, axis: str, nbytes: float, ep: int = 1, dp_shard: Optional[int] = None) -> float:
        """Idle-network seconds of one collective of `rank`'s group `axis` (tp, cp, ep, edp: experts'
        data-parallel group, zero: the group ZeRO shards over), 0 for groups of one."""
        if not verb or nbytes <= 0:
            return 0.0
        group = self.groups(rank, ep, dp_shard)[axis]
        if len(group) <= 1:
            return 0.0
        key = (verb, group, nbytes)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = self.net.estimate(self.net.collective(verb, group, nbytes))
        return t

    def groups(self, rank: int, ep: int, dp_shard: Optional[int]) -> dict[str, tuple[int, ...]]:
        """The process groups of `rank`, as the lowering builds them (its own code, so they agree)."""
        key = ("groups", rank, ep, dp_shard)
        g = self._memo.get(key)
        if g is None:
            from simexec.program.groups import rank_groups

            plan = self.rp.plan.model_copy(update=dict(ep=ep, dp_shard=dp_shard))
            rg = rank_groups(replace(self.rp, plan=plan), rank)
            g = self._memo[key] = {"tp": rg.tp, "cp": rg.cp, "ep": rg.ep, "edp": rg.edp, "zero": rg.zero}
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
        self._meshes: dict[tuple, _Mesh] = {}
        self.layers: dict[tuple, tuple] = {}
        self.states: dict[tuple, tuple] = {}
        self.memory: dict[tuple, tuple] = {}
        self.params: dict[tuple, list[dict]] = {}
        self.live: dict[tuple, list] = {}  # passes before the first weight pass, or before the first backward
        self._rebuilt: dict[int, _StructureBounds] = {}
        self.workspace = cluster.costs.workspace_bytes
        self.dyn = 1.0 + cluster.costs.allocator_overhead
        self.slow = 1.0 - 1.0 / cluster.costs.overlap_slowdown
        self.threads = cluster.costs.collective_threads

    def cm(self, dtype: str):
        cm = self._cm.get(dtype)
        if cm is None:
            cm = self._cm[dtype] = self.ComputeModel(self.cluster, dtype)
        return cm

    def mesh(self, rp: ResolvedPlan) -> tuple[tuple, _Mesh]:
        p = rp.plan
        key = (p.tp, p.cp, rp.dp, p.pp, p.rank_order)
        m = self._meshes.get(key)
        if m is None:
            m = self._meshes[key] = _Mesh(rp)
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


def _slot(free: list[float], ready: float, seconds: float) -> float:
    """A collective on a stream whose `len(free)` threads are free at the (sorted) times `free`: it
    starts on the first free one, once `ready`; returns its end (and books the thread)."""
    start = free[0] if free[0] > ready else ready
    end = start + seconds
    free[0] = end
    free.sort()
    return end


def _zero3_pass(units: list, te: float, tt: float, cf: list[float], arr: float) -> tuple[float, float, list[float]]:
    """One forward or backward pass under ZeRO-3 (see `_StructureBounds._replay`): `te` the end of
    the rank's previous compute, `tt` the collective closing it, `cf` when each of the ZeRO stream's
    collective threads is free (a FIFO of that many servers: a collective no slower and issued no
    later starts no later), `arr` when the pass's pipeline message arrives. Returns the three after
    the pass."""
    n = len(units)
    cf = list(cf)
    g_end = [0.0] * n
    for j in range(min(2, n)):  # prefetched at the start of the pass: no dependency
        g_end[j] = _slot(cf, 0.0, units[j][3])
    for j, (opening, body, closing, _, rs) in enumerate(units):
        start = te + tt + opening
        if arr > start:
            start = arr
        if g_end[j] > start:
            start = g_end[j]
        arr = 0.0
        te = start + body
        tt = closing
        if rs > 0.0:  # this unit's gradients
            _slot(cf, te, rs)
        if j + 2 < n:  # the gather two units ahead, into the buffer this unit frees
            g_end[j + 2] = _slot(cf, te, units[j + 2][3])
    return te, tt, cf


class _MemoParams:
    """A ResolvedPlan whose `params_on_pp_rank` answers from the search's cache, so that
    `ResolvedPlan.model_state_bytes` (called unbound on it) costs a few multiplications."""

    def __init__(self, rp: ResolvedPlan, params: list[dict]):
        self._rp, self._params = rp, params

    def __getattr__(self, name: str):
        return getattr(self._rp, name)

    def params_on_pp_rank(self, pp_rank: int) -> dict[str, float]:
        prm = self._params[pp_rank]
        return {"dense": prm["dense"], "expert": prm["expert"], "total": prm["dense"] + prm["expert"]}


class _StructureBounds:
    """Per-stage forward/backward costs and activations of one structure; bounds per state variant."""

    def __init__(self, b: Bounds, st: Structure):
        from simexec.program.blocks import Anatomy

        self.b = b
        self.rp = rp = st.rp
        self.p = p = rp.plan
        self.cm = b.cm(p.dtype)
        self.mesh_key, self.mesh = b.mesh(rp)
        self.an = an = Anatomy(rp)
        self.pp, self.vpp, self.m = p.pp, p.vpp, rp.micro_batches
        self.V = p.pp * p.vpp
        # virtual stage of each (pipeline rank, chunk), and the pipeline rank of each virtual stage
        self.stage = [[rp.stage(r, c) for c in range(p.vpp)] for r in range(p.pp)]
        self.owner = [rp.place(vs)[0] for vs in range(self.V)]
        self.v_shaped = p.pipeline_schedule.v_shaped
        self.L = rp.model.layers
        self.sp = 1 if p.sp else 0
        self.dt, self.gdt = rp.dtype_bytes, rp.grad_bytes  # parameters, gradients
        model = rp.model
        ranks = self.mesh.rank_of_stage
        # zero-bubble schedules: B is the input-gradient pass, W the weight-gradient pass
        self.split = p.pipeline_schedule.splits_backward
        self.F, self.B, self.W, self.saved, self.Ft, self.Bt = [], [], [], [], [], []
        self.kept: list[float] = []
        self.Fx, self.Bx = [], []  # the compute alone (F and B less the collectives they wait on)
        self.Fh, self.Bh = [], []  # the collective that opens F and B (it may run before the recv)
        self._k = 0.0
        dense: dict[int, tuple] = {}
        for vs in range(self.V):
            r = ranks[self.owner[vs]]
            layers = rp.stage_layers[vs]
            n = len(layers)
            n_rc = self._n_recomputed(n)
            if model.moe is None and model.sliding_window is None:  # every layer alike
                pair = dense.get(r)
                if pair is None:
                    pair = dense[r] = (self._layer(layers[0], True, r), self._layer(layers[0], False, r))
                lr, ln = pair
                f = n * ln[0]
                w = n * ln[7]
                b_ = n_rc * lr[1] + (n - n_rc) * ln[1]
                saved = n_rc * lr[2] + (n - n_rc) * ln[2]
                kf = n * ln[5]
                kb = n_rc * lr[6] + (n - n_rc) * ln[6]
                ft, bt = ln[3], ln[4]
            else:
                f = b_ = w = saved = kf = kb = 0.0
                for pos, l in enumerate(layers):
                    c = self._layer(l, pos < n_rc, r)
                    f += c[0]
                    w += c[7]
                    b_ += c[1]
                    saved += c[2]
                    kf += c[5]
                    kb += c[6]
                ft, bt = c[3], self._layer(layers[0], 0 < n_rc, r)[4]
            if vs == 0:
                ef, eb = self._tp("embed_out", 0, r), self._tp("embed_out", 1, r)
                f += self._fwd(an.embed) + ef
                if self.split:  # the embedding's backward is all weight gradient
                    w += self.cm.time(an.embed.op, an.embed.bwd_flops, an.embed.bwd_bytes)
                    b_ += eb
                else:
                    b_ += self._bwd(an.embed) + eb  # eb runs before the embedding's backward compute
                kf += ef
                kb += eb
                bt = 0.0
            # opening collectives: waiting only for the rank's previous compute, they may overlap
            # the wait for the pipeline message
            fh = 0.0 if vs == 0 else self._tp("attn_in", 0, r)
            last_rc = n_rc >= n  # the stage's last layer recomputes (positions < n_rc do)
            bh = self._tp("attn_in", 0, r) if (last_rc and p.recompute == "full") else self._tp("mlp_out", 1, r)
            if vs == self.V - 1:
                bh = 0.0
                hf, hb, hs, hkf, hkb = self._head(r)
                w += self._wgrad(an.head["head"])
                f += hf
                b_ += hb
                saved += hs
                kf += hkf
                kb += hkb
                ft = 0.0
            self.F.append(f)
            self.B.append(b_)
            self.W.append(w)
            self.Fx.append(f - kf)
            self.Bx.append(b_ - kb)
            self.Fh.append(fh)
            self.Bh.append(bh)
            self.saved.append(saved)
            if self.split:  # the output gradients a stage's input-gradient pass keeps for its weight pass
                kept = sum(sum(b.grad_out for b in an.layer(l).values()) - an.freed_by_input_pass(l) for l in layers)
                head = an.head["head"].grad_out - an.logits_released
                self.kept.append(kept + (head if vs == self.V - 1 else 0.0))
            self.Ft.append(ft)
            self.Bt.append(bt)
        self._pipeline()
        self._replayed: Optional[list] = None
        self._zero3_replays: dict = {}

    def _n_recomputed(self, n: int) -> int:
        """How many of a stage's n layers recompute (the first ones)."""
        p = self.p
        return 0 if p.recompute == "none" else (n if p.recompute_layers is None else min(n, p.recompute_layers))

    # --- prices --------------------------------------------------------------------------------
    def _fwd(self, blk) -> float:
        return self.cm.time(blk.op, blk.flops, blk.bytes)

    def _bwd(self, blk) -> float:
        if self.split:
            return self._input_pass(blk)
        return self.cm.time(blk.op, blk.bwd_flops, blk.bwd_bytes)

    def _input_pass(self, blk) -> float:
        """A block's backward without its weight gradients (`bwd` of a split backward)."""
        return self.cm.time(blk.op, blk.bwd_flops - blk.wgrad_flops, blk.bwd_bytes - blk.wgrad_bytes)

    def _weight_pass(self, blk) -> float:
        """A block's weight gradients alone (`wgrad` of a split backward)."""
        return self.cm.time(blk.op, blk.wgrad_flops, blk.wgrad_bytes)

    def _wgrad(self, blk) -> float:
        """A block's weight-gradient pass (zero-bubble schedules only)."""
        if not (self.split and blk.wgrad_flops):
            return 0.0
        return self._weight_pass(blk)

    def _column_bwd(self, blk, block: str, rank: int) -> float:
        """A column-parallel block's backward and the tp collective of its input gradient after it.
        Under tp_overlap the block's weight-gradient pass runs while that collective is in flight: the
        pair takes at least the input-gradient pass and the longer of the two."""
        c = self._tp(block, 1, rank)
        if not (self.p.tp_overlap and blk.wgrad_flops):
            return self._bwd(blk) + c
        w = self._weight_pass(blk)
        self._k -= min(c, w)  # the collective's seconds under the weight pass are not waited for
        return self._input_pass(blk) + max(w, c)

    def _closing(self, blk, block: str, rank: int) -> float:
        """What of the tp collective after a column-parallel block's backward outlasts its compute."""
        c = self._tp(block, 1, rank)
        if not (self.p.tp_overlap and blk.wgrad_flops):
            return c
        return max(0.0, c - self._weight_pass(blk))

    def _tp(self, block: str, bwd: int, rank: int) -> float:
        verb = _TP_OPS[block][self.sp][bwd]
        return self._coll(verb, rank, "tp", self.an.full_hidden_bytes)

    def _coll(self, verb: str, rank: int, axis: str, nbytes: float) -> float:
        """A collective the compute stream waits on (its seconds are also added up in `_k`)."""
        t = self.mesh.coll(verb, rank, axis, nbytes, self.p.ep)
        self._k += t
        return t

    def _layer_forward(self, blocks: dict, rank: int) -> float:
        an, t = self.an, 0.0
        t += self._tp("attn_in", 0, rank) + self._fwd(blocks["qkv"])
        t += self._attention(blocks["attn"], rank, 0) + self._fwd(blocks["proj"])
        t += self._tp("attn_out", 0, rank) + self._tp("mlp_in", 0, rank)
        if "fc1" in blocks:
            t += self._fwd(blocks["fc1"]) + self._fwd(blocks["fc2"])
        else:
            a2a = self._coll("alltoall", rank, "ep", an.dispatch_bytes)
            self._k += a2a
            t += self._fwd(blocks["router"]) + a2a + self._fwd(blocks["experts"]) + a2a + self._fwd(blocks["moe_out"])
        return t + self._tp("mlp_out", 0, rank)

    def _attention(self, attn, rank: int, bwd: int) -> float:
        """The attention core: after an all-gather of K/V over cp (backward: before a reduce-scatter
        of their gradients), between cp_impl=a2a's two all-to-alls, or as cp partial attentions
        between the hops of ring attention (whose messages are left out: they only delay)."""
        p = self.p
        if p.cp > 1 and p.cp_impl == "ring":
            f, by = (attn.bwd_flops, attn.bwd_bytes) if bwd else (attn.flops, attn.bytes)
            return p.cp * self.cm.time(attn.op, f / p.cp, by / p.cp)
        if p.cp > 1 and p.cp_impl == "a2a":
            qkv, out = self.an.heads_exchange_bytes
            exchanges = self._coll("alltoall", rank, "cp", qkv) + self._coll("alltoall", rank, "cp", out)
            return exchanges + (self._bwd(attn) if bwd else self._fwd(attn))
        if bwd:
            return self._bwd(attn) + (self._coll("reducescatter", rank, "cp", self.an.kv_bytes) if p.cp > 1 else 0.0)
        return (self._coll("allgather", rank, "cp", self.an.kv_bytes) if p.cp > 1 else 0.0) + self._fwd(attn)

    def _layer(self, l: int, rc: bool, rank: int) -> tuple:
        """Layer l: (forward s, backward s incl. recompute, activation bytes saved, the collective
        ending its forward, the one ending its backward, collective s in the forward, in the
        backward, weight-gradient pass s under a zero-bubble schedule)."""
        p = self.p
        moe, window = self.rp.model.is_moe_layer(l), self.rp.model.attention_window(l, self.rp.seq_len)
        key = (self.mesh_key, p.tp, self.sp, p.cp, p.cp_impl, p.ep, p.mbs, p.dtype, p.flash_attention, p.recompute, rc,
               moe, window, rank, self.split, p.tp_overlap)
        out = self.b.layers.get(key)
        if out is not None:
            return out
        an = self.an
        blocks = an.layer(l)
        full = rc and p.recompute == "full"
        self._k = 0.0
        f = self._layer_forward(blocks, rank)
        kf = self._k
        b = f if full else 0.0
        self._k = kf if full else 0.0
        b += self._tp("mlp_out", 1, rank)
        column = blocks["fc1"] if "fc1" in blocks else blocks["router"]  # before the mlp_in collective
        if "fc1" in blocks:
            b += self._bwd(blocks["fc2"])
        else:
            a2a = self._coll("alltoall", rank, "ep", an.dispatch_bytes)
            self._k += a2a
            b += self._bwd(blocks["moe_out"]) + a2a + self._bwd(blocks["experts"]) + a2a
        b += self._column_bwd(column, "mlp_in", rank) + self._tp("attn_out", 1, rank) + self._bwd(blocks["proj"])
        if rc and p.recompute == "selective":
            b += self._attention(blocks["attn"], rank, 0) if p.cp_impl == "ring" else self._fwd(blocks["attn"])
        b += self._attention(blocks["attn"], rank, 1)
        b += self._column_bwd(blocks["qkv"], "attn_in", rank)
        saved = an.hidden_bytes if full else sum(x.saved for x in blocks.values())
        kb = self._k
        w = sum(self._wgrad(x) for x in blocks.values())
        out = (f, b, saved, self._tp("mlp_out", 0, rank), self._closing(blocks["qkv"], "attn_in", rank), kf, kb, w)
        self.b.layers[key] = out
        return out

    def _head(self, rank: int) -> tuple[float, float, float, float, float]:
        """The head: (forward s, backward s, activation bytes saved, collective s in the forward, in
        the backward)."""
        an = self.an
        h = an.head
        ce = 4.0 * an.tokens
        self._k = 0.0
        f = self._tp("head_in", 0, rank) + self._fwd(h["head"])
        f += self._coll("allreduce", rank, "tp", ce) + self._fwd(h["xent"])
        f += self._coll("allreduce", rank, "tp", 2 * ce) + self._fwd(h["loss"])
        kf, self._k = self._k, 0.0
        b = self._bwd(h["loss"]) + self._bwd(h["xent"]) + self._column_bwd(h["head"], "head_in", rank)
        return f, b, h["head"].saved, kf, self._k

    # --- the schedule --------------------------------------------------------------------------
    def _forwards_before_first_backward(self, r: int) -> list[int]:
        """How many forwards of each chunk rank r runs before its first backward (simexec.program.schedules)."""
        pp, m, v = self.pp, self.m, self.vpp
        sched = self.p.pipeline_schedule
        if sched.all_forwards_first:
            return [m]
        if sched.v_shaped:  # counted on the schedule, once per shape
            key = ("F", sched.name, pp, m, v)
            per_rank = self.b.live.get(key)
            if per_rank is None:
                per_rank = []
                for acts in self._order().values():
                    counts = [0] * v
                    for a in acts:
                        if a.kind != "F":
                            break
                        counts[a.chunk] += 1
                    per_rank.append(counts)
                self.b.live[key] = per_rank
            return per_rank[r]
        if not sched.interleaved:
            return [min(pp - r, m)]
        total = m * v
        hops = (pp - r - 1) * sched.warmup_per_later_rank
        w = min(min(hops + (v - 1) * pp, total) + 1, total)
        counts = [0] * v
        full, rest = divmod(w, pp)
        for k in range(full):  # forward unit k runs chunk (k // pp) % v
            counts[k % v] += pp
        counts[full % v] += rest
        return counts

    def _passes_before_first_weight_pass(self, r: int) -> tuple[list[int], list[int]]:
        """Under a zero-bubble schedule, how many forwards and input-gradient passes of each chunk rank
        r runs before its first weight pass, which frees the first activations and kept gradients
        (counted on the schedule, once per shape)."""
        key = (self.p.schedule_name, self.pp, self.m, self.vpp)
        per_rank = self.b.live.get(key)
        if per_rank is None:
            per_rank = []
            for acts in self._order().values():
                counts = {"F": [0] * self.vpp, "B": [0] * self.vpp}
                for a in acts:
                    if a.kind == "W":
                        break
                    counts[a.kind][a.chunk] += 1
                per_rank.append((counts["F"], counts["B"]))
            self.b.live[key] = per_rank
        return per_rank[r]

    def _pairs(self, r: int) -> frozenset[int]:
        """Under DualPipe's overlapped pairs, where rank r's pairs start in its order (none otherwise)."""
        if not self.p.dualpipe_overlap:
            return frozenset()
        key = ("pairs", self.pp, self.m)
        per_rank = self.b.live.get(key)
        if per_rank is None:
            from simexec.program.schedules import dualpipe_pairs

            per_rank = self.b.live[key] = [dualpipe_pairs(self.pp, q, self.m) for q in range(self.pp)]
        return per_rank[r]

    def _pair_seconds(self, vf: int, vb: int) -> float:
        """At least how long an overlapped pair of stage vf's forward and stage vb's whole backward
        takes: all their compute, and no less than either pass's own chain of compute and collectives
        (the other pass fills its waits, it cannot shorten them)."""
        Fx, Bx, W = self.Fx, self.Bx, self.W
        return max(Fx[vf] + Bx[vb] + W[vb], self.F[vf], self.B[vb] + W[vb])

    def _pipeline(self) -> None:
        """Per pipeline rank: the end of its last compute (a compute-only replay of the schedule) and
        the activations live before its first backward.

        Within a rank every compute waits for the collectives before it, so a rank's actions add up;
        across ranks a pipeline send waits only for the compute before it, so the chains leave out the
        collective that ends a stage (`Ft`, `Bt`)."""
        pp, V, m, F, B, Ft, Bt = self.pp, self.V, self.m, self.F, self.B, self.Ft, self.Bt
        Fh, Bh = self.Fh, self.Bh
        hb, k = self.an.hidden_bytes, self.rp.pipeline_slices
        ranks = self.mesh.rank_of_stage

        def message(src: int, dst: int) -> float:
            """A pipeline message's seconds: its piece over the link, then the all-gather of the
            pieces over the receiver's tp group where it is sliced; none within a rank (a V's turn)."""
            if src == dst:
                return 0.0
            t = self.mesh.p2p(src, dst, hb / k)
            return t + (self.mesh.coll("allgather", ranks[dst], "tp", hb) if k > 1 else 0.0)

        # a pipeline message's seconds after each stage's forward (to the next) and backward (from it)
        own = self.owner
        self.p2pF = p2pF = [message(own[vs], own[vs + 1]) for vs in range(V - 1)]
        self.p2pB = p2pB = [message(own[vs + 1], own[vs]) for vs in range(V - 1)]
        # micro-batch 0 through every forward, then back through the later stages' backwards:
        # earliest start of the first compute of F(vs, mb 0) and of B(vs, mb 0)
        reach = [0.0] * V
        for vs in range(1, V):
            reach[vs] = reach[vs - 1] + F[vs - 1] - Fh[vs - 1] - Ft[vs - 1] + p2pF[vs - 1]
        back = [0.0] * V
        back[V - 1] = reach[V - 1] + F[V - 1] - Fh[V - 1] + Bh[V - 1]
        for vs in range(V - 2, -1, -1):
            back[vs] = back[vs + 1] + B[vs + 1] - Bh[vs + 1] - Bt[vs + 1] + p2pB[vs]
        end, self.act, self.w_after = [], [], []
        Fx, Bx, W = self.Fx, self.Bx, self.W
        for r in range(pp):
            st = self.stage[r]
            counts = self._forwards_before_first_backward(r)
            f_before = sum(n * F[st[c]] for c, n in enumerate(counts))
            work = m * sum(Fx[vs] + Bx[vs] + W[vs] for vs in st)
            self.w_after.append(work - sum(n * Fx[st[c]] for c, n in enumerate(counts)))
            if self.split:  # every forward and input-gradient pass before the first weight pass
                fwds, bwds = self._passes_before_first_weight_pass(r)
                self.act.append(sum(n * self.saved[st[c]] for c, n in enumerate(fwds))
                                + sum(n * self.kept[st[c]] for c, n in enumerate(bwds)))
            else:
                self.act.append(sum(n * self.saved[st[c]] for c, n in enumerate(counts)))
            vs_first = max(st)  # a rank's first backward is of its last chunk, the deepest stage
            first_b = max(back[vs_first], reach[r] + f_before - Fh[r] + Bh[vs_first])
            total = m * sum(F[vs] + B[vs] + W[vs] for vs in st)
            acts = self._order()[r]
            for i in self._pairs(r):  # a pair's passes overlap: at least `_pair_seconds`
                vf, vb = st[acts[i].chunk], st[acts[i + 1].chunk]
                total -= F[vf] + B[vb] + W[vb] - self._pair_seconds(vf, vb)
            end.append(first_b + total - f_before - Bh[vs_first])
        # the last micro-batch's gradients still walk down to stage 0 (chunk 0 of every rank)
        last = [0.0] * pp
        for r in range(pp - 1, -1, -1):
            last[r] = end[r]
            if r < pp - 1 and not self.split:
                last[r] = max(last[r], last[r + 1] - Bt[r + 1] + p2pB[r] + B[r] - Bh[r])
        # end of each rank's last compute, and the collective still running after it (a zero-bubble
        # rank ends with weight passes, which wait for the last backward's closing collective)
        tail = [0.0] * pp if self.split else Bt[:pp]
        self.last_compute = [last[r] - tail[r] for r in range(pp)]
        self.own_last_compute = [end[r] - tail[r] for r in range(pp)]
        self.tail = tail

    # --- per state variant ---------------------------------------------------------------------
    def _params(self) -> list[dict]:
        """Per pipeline rank: parameters (dense, expert), the largest unit, the last unit's dense
        parameters and each chunk's units' dense parameters."""
        p = self.p
        key = (p.tp, p.pp, p.vpp, p.ep, p.stages, self.v_shaped)
        out = self.b.params.get(key)
        if out is None:
            out = []
            for r in range(p.pp):
                prm = self.rp.params_on_pp_rank(r)
                units = self._units(r)
                biggest = max(self._unit_params(u) for u in units)
                last_unit = -1 if r == 0 else self.rp.stage_layers[r][0]
                chunks = [[self._unit_params(u, True) for u in self._units(r, c)] for c in range(p.vpp)]
                out.append(dict(dense=prm["dense"], expert=prm["expert"], biggest=biggest,
                                last_dense=self._unit_params(last_unit, True), chunks=chunks))
            self.b.params[key] = out
        return out

    def _memory(self, state: tuple) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
        """Per pipeline rank: model-state bytes (`model_state_bytes`), those held before the first
        backward (without lazily made ZeRO-3 gradient shards), YaFSDP's preallocated buffers, the
        optimizer's shard of parameters and the fp32 main-gradient copy of the optimizer step."""
        p, rp = self.p, self.rp
        key = (p.tp, p.pp, p.vpp, p.ep, p.stages, self.v_shaped, rp.dp, p.cp, p.dtype, p.grad_fp32,
               p.master_grads, p.grad_bucket_view, state)
        out = self.b.memory.get(key)
        if out is not None:
            return out
        zero, zero_impl, dp_shard, offload = state
        vrp = self.rp if (p.zero, p.zero_impl, p.dp_shard, p.offload) == state else replace(
            rp, plan=p.model_copy(update=dict(zero=zero, zero_impl=zero_impl, dp_shard=dp_shard, offload=offload)))
        groups = self.mesh.groups(self.mesh.rank_of_stage[0], p.ep, dp_shard)
        zero_size = len(groups["zero"])
        edp = max(1, len(groups["edp"]))
        dt, gdt = self.dt, self.gdt
        preallocated = vrp.plan.zero3 is not None and vrp.plan.zero3.preallocated_buffers and zero_size > 1
        lazy = zero == 3 and vrp.plan.lazy_grad_shards and (zero_size > 1 or edp > 1)
        static, early, buffers, shards, main = [], [], [], [], []
        params = self._params()
        memo = _MemoParams(vrp, params)
        for r, prm in enumerate(params):
            ms = ResolvedPlan.model_state_bytes(memo, r)
            static.append(ms["params"] + ms["grads"] + ms["optimizer"])
            made = gdt * (prm["dense"] / zero_size * (zero_size > 1) + prm["expert"] / edp * (edp > 1)) if lazy else 0.0
            early.append(static[-1] - min(made, ms["grads"]))
            big = prm["biggest"]
            buffers.append(2 * big * dt + 2 * big * gdt if preallocated else 0.0)
            shards.append(prm["dense"] / (zero_size if zero >= 1 else 1) + prm["expert"] / (edp if zero >= 1 else 1))
            main.append(shards[-1] * vrp.master_grad_bytes)
        out = self.b.memory[key] = (static, early, buffers, shards, main)
        return out

    def _state(self, state: tuple) -> tuple:
        """Per pipeline rank: model-state bytes, buffers, (last gradient reduction, optimizer and
        parameter gather) seconds, the busy time of the ZeRO axis' stream (fixed, per micro-batch)
        and the gradient traffic."""
        p, rp = self.p, self.rp
        key = (self.mesh_key, p.tp, p.pp, p.vpp, p.ep, p.dtype, p.stages, self.v_shaped, p.grad_fp32, p.master_grads,
               p.grad_overlap, p.grad_bucket_view, p.grad_allreduce, p.param_overlap, state)
        out = self.b.states.get(key)
        if out is not None:
            return out
        zero, zero_impl, dp_shard, offload = state
        static, early, buffers, shards, main = self._memory(state)
        vrp = self.rp if (p.zero, p.zero_impl, p.dp_shard, p.offload) == state else replace(
            rp, plan=p.model_copy(update=dict(zero=zero, zero_impl=zero_impl, dp_shard=dp_shard, offload=offload)))
        dt, gdt = self.dt, self.gdt
        mesh, cm = self.mesh, self.cm
        verb = "allreduce" if zero == 0 or (zero == 1 and p.grad_allreduce) else "reducescatter"

        def zc(verb: str, rank: int, nbytes: float, axis: str = "zero") -> float:
            return mesh.coll(verb, rank, axis, nbytes, p.ep, dp_shard)

        tail, busy, traffic = [], [], []
        for r, prm in enumerate(self._params()):
            rank = mesh.rank_of_stage[r]
            shard = shards[r]
            if offload != "none":
                opt = mesh.copy(rank, "d2h", shard * gdt) + mesh.cpu(rank, shard) + mesh.copy(rank, "h2d", shard * dt)
            else:
                opt = cm.time("optimizer", shard * ADAM_FLOPS_PER_PARAM, shard * adam_bytes_per_param(vrp))
            # the last unit's gradients are reduced after the last backward, before the optimizer
            red = zc(verb, rank, prm["last_dense"] * gdt)
            gather = 0.0
            if zero in (1, 2) and not p.param_overlap:  # parameters all-gathered after the step
                gather = zc("allgather", rank, prm["dense"] * dt)
                if prm["expert"] > 0:
                    gather = max(gather, zc("allgather", rank, prm["expert"] * dt, "edp"))
            tail.append((red, opt + gather))
            # The ZeRO axis' stream runs its collectives one after another. Buckets split a
            # reduction in parts, and an idle-network collective costs at least as much in parts
            # as whole (affine in bytes per algorithm, the fastest taken: concave, so subadditive).
            total = zc(verb, rank, prm["dense"] * gdt)
            if not p.grad_overlap and zero in (0, 1):  # every bucket waits for the last backward
                tail[-1] = (max(red, total), opt + gather)
            if zero == 3:
                z = sum(2 * zc("allgather", rank, u * dt) + zc(verb, rank, u * gdt) for ch in prm["chunks"] for u in ch)
                busy.append((0.0, z))
            elif zero == 2:
                z = sum(zc(verb, rank, sum(ch) * gdt) for ch in prm["chunks"])
                busy.append((zc("allgather", rank, prm["dense"] * dt), z))
            elif zero == 1:
                busy.append((total + zc("allgather", rank, prm["dense"] * dt), 0.0))
            else:
                busy.append((total, 0.0))
            traffic.append(total)
        out = self.b.states[key] = (static, early, buffers, tail, busy, traffic, main)
        return out

    def _units(self, r: int, chunk: Optional[int] = None) -> list[int]:
        """Parameter units of pipeline rank r (or of one of its chunks): -1 embedding, L the head."""
        units = []
        for c in range(self.vpp) if chunk is None else (chunk,):
            vs = self.stage[r][c]
            if vs == 0:
                units.append(-1)
            units.extend(self.rp.stage_layers[vs])
            if vs == self.V - 1:
                units.append(self.L)
        return units

    def _unit_params(self, unit: int, dense_only: bool = False) -> float:
        """Parameters of one unit (all, or the dense ones: those ZeRO shards over its axis)."""
        if unit == -1:
            return self.an.embed_params()
        if unit == self.L:
            return self.an.head_params()
        counts = self.an.layer_param_counts(unit)
        return counts[0] if dense_only else sum(counts)

    def replay_bound(self, state: tuple) -> float:
        """Time bound from `_replay`: each rank's last compute, then its last gradient reduction,
        optimizer step and parameter gather, as in `bounds`. Under ZeRO-3 the replay goes unit by
        unit with the parameter gathers and gradient reduce-scatters on their stream."""
        zero, _, dp_shard, _ = state
        _, _, _, tails, _, _, _ = self._state(state)
        if zero == 3 and len(self.mesh.groups(self.mesh.rank_of_stage[0], self.p.ep, dp_shard)["zero"]) > 1:
            ends = self._zero3_replays.get(dp_shard)
            if ends is None:
                ends = self._zero3_replays[dp_shard] = self._replay(dp_shard or 0)
            t = 0.0
            for r, (end, tail, comm_end) in enumerate(ends):
                _, after = tails[r]
                t = max(t, max(end + tail, comm_end) + after)
            return t * (1.0 - 1e-9)
        ends = self._replayed
        if ends is None:
            ends = self._replayed = self._replay()
        t = 0.0
        for r, (end, tail, _) in enumerate(ends):
            red, after = tails[r]
            t = max(t, end + (red if red > tail else tail) + after)
        return t * (1.0 - 1e-9)

    def _unit_costs(self, r: int, chunk: int, zshard: int) -> tuple[list, list]:
        """Forward and backward of each unit of one chunk, in the order the lowering runs them:
        (opening collective, compute and the collectives inside it, closing collective, parameter
        all-gather, gradient reduce-scatter) in seconds."""
        p, an = self.p, self.an
        rank = self.mesh.rank_of_stage[r]
        dt, gdt = self.dt, self.gdt
        vs = self.stage[r][chunk]
        layers = self.rp.stage_layers[vs]
        n = len(layers)
        n_rc = self._n_recomputed(n)
        fwd, bwd = [], []
        for u in self._units(r, chunk):
            dense = self._unit_params(u, True)
            g = self.mesh.coll("allgather", rank, "zero", dense * dt, p.ep, zshard or None)
            rs = self.mesh.coll("reducescatter", rank, "zero", dense * gdt, p.ep, zshard or None)
            if u == -1:
                fc = self._tp("embed_out", 0, rank)
                fwd.append((0.0, self._fwd(an.embed), fc, g, 0.0))
                bo = self._tp("embed_out", 1, rank)  # before the embedding's backward
                bwd.append((bo, self._bwd(an.embed), 0.0, g, rs))
            elif u == self.L:
                hf, hb, _, _, _ = self._head(rank)
                fo = self._tp("head_in", 0, rank)
                bc = self._closing(an.head["head"], "head_in", rank)
                fwd.append((fo, hf - fo, 0.0, g, 0.0))
                bwd.append((0.0, hb - bc, bc, g, rs))
            else:
                pos = layers.index(u)
                rc = pos < n_rc
                c = self._layer(u, rc, rank)
                fo, fc = self._tp("attn_in", 0, rank), c[3]
                fwd.append((fo, c[0] - fo - fc, fc, g, 0.0))
                bo = self._tp("attn_in", 0, rank) if (rc and p.recompute == "full") else self._tp("mlp_out", 1, rank)
                bc = c[4]
                bwd.append((bo, c[1] - bo - bc, bc, g, rs))
        bwd.reverse()
        return fwd, bwd

    def _replay(self, zshard: Optional[int] = None) -> list[tuple[float, float, float]]:
        """The pipeline schedule (`simexec.program.schedules.pipeline_order`, as the lowering walks it) with
        every compute at full speed, every collective the compute waits on at its idle-network price
        and every pipeline message sent as soon as its compute ends. A forward waits for the previous
        stage's forward of its micro-batch and its message, a backward for the next stage's backward;
        within a rank the actions run in order, each after the collective that closes the previous
        one and the one that opens it. Anything the simulator adds only delays; returns, per rank, the
        end of its last compute, the collective that follows it and when its ZeRO stream is done.

        zshard (ZeRO-3 over dp, or over dp_shard groups of that size when > 0): actions go unit by
        unit. Each pass gathers its first two units' parameters up front and unit j+2's once unit j
        has computed; a unit computes once its gather is done; a backward unit's gradients are
        reduce-scattered after it; the gathers and reduce-scatters take turns on their stream's threads."""
        pp, V, m = self.pp, self.V, self.m
        F, B, Fh, Bh, Ft, Bt = self.F, self.B, self.Fh, self.Bh, self.Ft, self.Bt
        p2pF, p2pB, stage = self.p2pF, self.p2pB, self.stage
        Fb = [F[v] - Fh[v] - Ft[v] for v in range(V)]
        Bb = [B[v] - Bh[v] - Bt[v] for v in range(V)]
        order = self._order()
        pairs = [self._pairs(r) for r in range(pp)]
        fend = [[-1.0] * m for _ in range(V)]
        bend = [[-1.0] * m for _ in range(V)]
        wend = [[-1.0] * m for _ in range(V)]
        ptr = [0] * pp
        t_end = [0.0] * pp
        t_tail = [0.0] * pp
        c_free = [[0.0] * self.b.threads for _ in range(pp)]  # when each ZeRO stream thread is free
        units = None
        if zshard is not None:
            units = {(r, c): self._unit_costs(r, c, zshard) for r in range(pp) for c in range(self.vpp)}
        # per action kind: its ends, opening / body / closing seconds, and per stage the action it waits
        # on (the previous stage's forward, the next stage's backward) with the message between
        kinds = {
            "F": (fend, Fh, Fb, Ft, [None] + [(fend[vs - 1], p2pF[vs - 1]) for vs in range(1, V)], 0),
            "B": (bend, Bh, Bb, Bt, [(bend[vs + 1], p2pB[vs]) for vs in range(V - 1)] + [None], 1),
            "W": (wend, [0.0] * V, self.W, [0.0] * V, [None] * V, 1),
        }
        left = sum(len(a) for a in order.values())
        while left:
            moved = False
            for r in range(pp):
                acts, i = order[r], ptr[r]
                te, tt, cf = t_end[r], t_tail[r], c_free[r]
                while i < len(acts):
                    chunk, kind, mb = acts[i]
                    vs = stage[r][chunk]
                    if i in pairs[r]:  # a forward and the other chunk's whole backward, overlapped
                        done = self._replay_pair(acts[i], acts[i + 1], stage[r], te + tt, fend, bend, wend)
                        if done is None:
                            break
                        te, tt = done, 0.0
                        i += 3
                        left -= 3
                        moved = True
                        continue
                    ends, opening, body, closing, waits, half = kinds[kind]
                    arr = 0.0
                    if waits[vs] is not None:
                        dep_ends, msg = waits[vs]
                        dep = dep_ends[mb]
                        if dep < 0.0:
                            break
                        arr = dep + msg
                    if units is None:
                        start = te + tt + opening[vs]
                        te = (start if start > arr else arr) + body[vs]
                        tt = closing[vs]
                    else:
                        te, tt, cf = _zero3_pass(units[(r, chunk)][half], te, tt, cf, arr)
                    ends[vs][mb] = te
                    i += 1
                    left -= 1
                    moved = True
                ptr[r], t_end[r], t_tail[r], c_free[r] = i, te, tt, cf
            if not moved:  # cannot happen for the schedules simexec builds; keep the first bound
                return [(0.0, 0.0, 0.0)] * pp
        return list(zip(t_end, t_tail, [max(cf) for cf in c_free]))

    def _order(self) -> dict:
        """`simexec.program.schedules.pipeline_order` of this structure's schedule, made once per shape."""
        from simexec.program.schedules import pipeline_order

        key = ("order", self.p.schedule_name, self.pp, self.m, self.vpp)
        order = self.b.live.get(key)
        if order is None:
            order = self.b.live[key] = pipeline_order(self.p.schedule_name, self.pp, self.m, self.vpp)
        return order

    def _replay_pair(self, fwd, bwd, stages: list[int], free: float, fend, bend, wend) -> Optional[float]:
        """`_replay` of an overlapped pair once both inputs have arrived (None before): it starts when
        the rank is free and the forward's input is there (the forward's first kernel leads); each pass
        ends no sooner than its own chain allows, the pair no sooner than `_pair_seconds`. Its
        collectives may hide under the other pass, so no opening or closing one is counted."""
        vf, vb = stages[fwd.chunk], stages[bwd.chunk]
        arr_f = arr_b = 0.0
        if vf > 0:
            if fend[vf - 1][fwd.mb] < 0.0:
                return None
            arr_f = fend[vf - 1][fwd.mb] + self.p2pF[vf - 1]
        if vb < self.V - 1:
            if bend[vb + 1][bwd.mb] < 0.0:
                return None
            arr_b = bend[vb + 1][bwd.mb] + self.p2pB[vb]
        start = max(free, arr_f)
        fend[vf][fwd.mb] = start + self.F[vf] - self.Fh[vf] - self.Ft[vf]
        bend[vb][bwd.mb] = max(start, arr_b) + self.B[vb] - self.Bh[vb] - self.Bt[vb]
        done = max(start + self._pair_seconds(vf, vb), fend[vf][fwd.mb], bend[vb][bwd.mb] + self.W[vb])
        wend[vb][bwd.mb] = done
        return done

    def bounds(self, state: tuple) -> tuple[float, float, float]:
        """(ordering estimate, time lower bound, memory lower bound) of this structure with `state`."""
        static, early, buffers, tails, busy, traffic, main = self._state(state)
        ws, dyn, a = self.b.workspace, self.b.dyn, self.b.slow
        t = mem = tr = 0.0
        lc, own, tl, act, m, wa = self.last_compute, self.own_last_compute, self.tail, self.act, self.m, self.w_after
        for r in range(self.pp):
            red, after = tails[r]
            rest = (red if red > tl[r] else tl[r]) + after
            x = lc[r] + rest
            fixed, per_mb = busy[r]
            z = (fixed + m * per_mb) / self.b.threads  # its threads share the stream's work
            if z > x:
                x = z
            # Compute runs 1/overlap_slowdown slower while a transfer of the rank is in flight, and the
            # ZeRO stream keeps one in flight for z seconds: after its first backward the rank's own
            # sequence E = own[r] + rest gains a * overlap, overlap >= work + z - T, so
            # T >= (E + a (work + z)) / (1 + a), a = 1 - 1/overlap_slowdown.
            y = (own[r] + rest + a * (wa[r] + z)) / (1.0 + a)
            if y > x:
                x = y
            if x > t:
                t = x
            y = early[r] + ws + dyn * (buffers[r] + act[r])
            if y > mem:
                mem = y
            y = static[r] + ws + main[r]  # the optimizer step: model states and the fp32 main gradients
            if y > mem:
                mem = y
            if traffic[r] > tr:
                tr = traffic[r]
        est = t + 0.1 * tr
        # float sums in another order than the simulator's may differ in the last bits: stay below
        return est, t * (1.0 - 1e-9), mem * (1.0 - 1e-9)

