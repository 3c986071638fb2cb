"""`search`: find the fastest plan that fits, by simulating only the plans that could win.

1. **Space** (`simexec.search_space`): every plan of the model on the cluster, as structures (the
   split of the compute) times state variants (ZeRO stage and flavour, HSDP, offload), each checked
   by `resolve`.
2. **Bounds**, per plan, without simulating, priced by the simulator's own `ComputeModel` and
   `Network` (idle network), with the process groups the lowering itself builds:
   - memory: model states (`ResolvedPlan.model_state_bytes`) + workspace + YaFSDP's buffers + the
     activations the schedule holds before a rank's first backward, with the allocator's overhead.
     Each term is memory the lowering allocates and nothing frees before that moment, so the
     simulated peak cannot be lower; a bound over capacity counts the plan as `oom` unsimulated.
   - time: a closed-form critical path of the pipeline: micro-batch 0 through every stage and
     back, then the rank's remaining forwards and backwards, each costing its compute plus the
     collectives the compute stream waits on (tensor-parallel f/g, context-parallel K/V, expert
     all-to-all) and the pipeline messages; then the last gradient reduction, the optimizer step
     (or its offload round trip) and the ZeRO-1/2 parameter all-gather. Also: the ZeRO stream's
     collectives run one after another, and compute runs `overlap_slowdown` slower while they are
     in flight. At least total FLOPs / (world x peak x best efficiency).
   - refined time (for plans the first bound does not rule out): the schedule replayed action by
     action (`simexec.schedules.pipeline_order`), under ZeRO-3 unit by unit with the parameter
     gathers (two ahead) and gradient reduce-scatters taking turns on their stream.
   Contention, slowdowns and every wait the bounds leave out only add time, so they stay below the
   simulator (tests/test_search.py holds them to that on hundreds of plans).
3. **Order and prune**: plans are simulated in order of their time bound (memory bound for the
   memory objective), refined when they reach the head of the queue, in waves of `WAVE`. A plan is
   skipped (`pruned`) when its bound is past the K-th best found so far and it cannot be on the
   Pareto front either: past the window (`pareto_window`, by default none beyond the K-th best), or
   a simulated plan is at least as fast as its time bound and at least as small as its memory bound,
   strictly better on one. So the top K and the Pareto front inside the window are those an
   exhaustive search finds.
4. **Parallel**: waves go to local processes (spawn) or Ray tasks; a wave's plans and the pruning
   after it do not depend on which worker ran what, so serial, local and Ray searches return
   identical results, run after run. Ties break on (step time, peak memory, plan string).

A plan's numbers are those of `simexec.simulate.simulate` on its plan string, to the last digit: the
search parses the string it reports and simulates exactly that.
"""
from __future__ import annotations

import heapq
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

from simexec.cluster import ClusterSpec, GiB, get_cluster
from simexec.errors import PlanError, SimexecError
# _TP_OPS: (forward op, backward op) of Megatron's f/g conjugates, as the lowering emits them
from simexec.lower import _TP_OPS, ADAM_BYTES_PER_PARAM, ADAM_FLOPS_PER_PARAM, representatives
from simexec.model import ModelSpec, get_model
from simexec.plan import Plan, ResolvedPlan, _validate_fields, parse_plan, split_pairs
from simexec.search_space import SpaceStats, Structure, search_world, structures

WAVE = 16  # plans simulated between two pruning decisions (fixed: results must not depend on workers)
PARETO_WINDOW = 0.0  # the Pareto front is exact over plans as fast as the K-th best (widen: pareto_window)
OBJECTIVES = ("throughput", "memory")
_RESULT_KEYS = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes", "fits",
                "breakdown_s", "memory_breakdown_bytes", "memory_capacity_bytes")


# ---------------------------------------------------------------------------------------------------
# --fix
# ---------------------------------------------------------------------------------------------------

_OPTIONAL = {name for name, f in Plan.model_fields.items() if f.default is None}


def parse_fix(text: str) -> dict:
    """`tp=8,pp=4,recompute=full` -> {"tp": 8, "pp": 4, "recompute": "full"}, typed as `Plan` types them.

    Any `Plan` field may be pinned; `none` unsets an optional one (`recompute_layers=none`);
    `stages=` takes every following bare integer, as in plan strings. Raises PlanError on bad input.
    """
    if not isinstance(text, str):
        raise PlanError(f"--fix takes key=value pairs, got {text!r}")
    raw = split_pairs(text, f"--fix {text!r}")
    if not raw:
        raise PlanError(f"--fix {text!r}: no key=value pairs")
    return normalize_fix(raw, where=f"--fix {text!r}")


def normalize_fix(fix: Optional[dict], where: str = "fix") -> dict:
    """Check and type a dict of pinned plan fields (strings as on the command line, or typed values)."""
    if not fix:
        return {}
    fields: dict[str, Any] = {}
    for key, val in fix.items():
        if key not in Plan.model_fields:
            raise PlanError(f"{where}: unknown key {key!r}; keys: {', '.join(Plan.model_fields)}")
        if isinstance(val, str) and val.strip().lower() in ("none", "null", "") and key in _OPTIONAL:
            fields[key] = None
            continue
        if key == "stages" and isinstance(val, str):
            try:
                val = tuple(int(v) for v in val.split(","))
            except ValueError:
                raise PlanError(f"{where}: stages takes integers, got {val!r}") from None
        fields[key] = val
    typed = {k: v for k, v in fields.items() if v is not None}
    plan = _validate_fields(dict(typed), where)  # types and ranges, one-line PlanError
    return {k: (getattr(plan, k) if fields[k] is not None else None) for k in fields}


# ---------------------------------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------------------------------


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
            from simexec.lower import _RankLowering

            plan = self.rp.plan.model_copy(update=dict(ep=ep, dp_shard=dp_shard))
            rl = _RankLowering(replace(self.rp, plan=plan), None, rank, [])
            g = self._memo[key] = {"tp": rl.g_tp, "cp": rl.g_cp, "ep": rl.g_ep, "edp": rl.g_edp, "zero": rl.g_zero}
        return g

    def p2p(self, src_stage: int, dst_stage: int, nbytes: float) -> float:
        """Idle-network seconds of one pipeline message: what `Network.estimate` gives for it, from
        the message's rate and latency found once per pair of stages."""
        rl = self._memo.get(("p2p", src_stage, dst_stage))
        if rl is None:
            a, b = self.rank_of_stage[src_stage], self.rank_of_stage[dst_stage]
            (_, links, cap, lat), = self.net.p2p(a, b, 1.0)
            rate = cap
            for lid, d in links:
                if d > 0:
                    rate = min(rate, self.net.capacity[lid] / d)
            rl = self._memo[("p2p", src_stage, dst_stage)] = (rate, lat)
        rate, lat = rl
        return (nbytes / rate if nbytes > 0 and rate < math.inf else 0.0) + lat

    def copy(self, rank: int, direction: str, nbytes: float) -> float:
        return self.net.estimate(self.net.copy(rank, direction, nbytes))

    def cpu(self, rank: int, params: float) -> float:
        """Idle seconds of a CPU optimizer step of `params` parameters (the node's cores shared by
        the ranks this one stands for there), as `Network.estimate` gives it."""
        rate = self._memo.get(("cpu", rank))
        if rate is None:
            (_, links, cap, _lat), = self.net.cpu_step(rank, 1.0)
            rate = cap
            for lid, d in links:
                if d > 0:
                    rate = min(rate, self.net.capacity[lid] / d)
            self._memo[("cpu", rank)] = rate
        return params / rate if params > 0 and rate < math.inf else 0.0


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
        self.layers: dict[tuple, tuple[float, float, float, float, float]] = {}
        self.states: dict[tuple, tuple] = {}
        self.memory: dict[tuple, tuple] = {}
        self.params: dict[tuple, list[dict]] = {}
        self.workspace = cluster.costs.workspace_bytes
        self.dyn = 1.0 + cluster.costs.allocator_overhead
        self.slow = 1.0 - 1.0 / cluster.costs.overlap_slowdown

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

    def refine(self, c: Candidate) -> float:
        """A tighter time bound for a plan the first one did not prune: the same prices, but the
        pipeline schedule replayed action by action (every micro-batch's messages and waits)."""
        if not c.refined:
            c.time_lb = max(c.time_lb, c.sb.replay_bound(c.state))
            c.refined = True
        return c.time_lb


def _zero3_pass(units: list, te: float, tt: float, cf: float, arr: float) -> tuple[float, float, float]:
    """One forward or backward pass under ZeRO-3 (see `_StructureBounds._replay`): `te` the end of
    the rank's previous compute, `tt` the collective closing it, `cf` when the ZeRO stream is free,
    `arr` when the pass's pipeline message arrives. Returns the three after the pass."""
    n = len(units)
    g_end = [0.0] * n
    for j in range(min(2, n)):  # prefetched at the start of the pass: no dependency
        cf += units[j][3]
        g_end[j] = cf
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
            cf = (cf if cf > te else te) + rs
        if j + 2 < n:  # the gather two units ahead, into the buffer this unit frees
            cf = (cf if cf > te else te) + units[j + 2][3]
            g_end[j + 2] = cf
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
        from simexec.blocks import Anatomy

        self.b, self.st = b, st
        self.rp = rp = st.rp
        self.p = p = rp.plan
        self.cm = b.cm(p.dtype)
        self.mesh_key, self.mesh = b.mesh(rp)
        self.an = an = Anatomy(rp)
        self.pp, self.vpp, self.m = p.pp, p.vpp, rp.micro_batches
        self.V = p.pp * p.vpp
        self.L = rp.model.layers
        self.sp = 1 if p.sp else 0
        model = rp.model
        ranks = self.mesh.rank_of_stage
        self.F, self.B, self.saved, self.Ft, self.Bt = [], [], [], [], []
        self.Fx, self.Bx = [], []  # the compute alone (F and B less the collectives they wait on)
        self.Fh, self.Bh = [], []  # the collective that opens F and B (it may run before the recv)
        self._k = 0.0
        dense: dict[int, tuple] = {}
        for vs in range(self.V):
            r = ranks[vs % p.pp]
            layers = rp.stage_layers[vs]
            n = len(layers)
            n_rc = 0 if p.recompute == "none" else (n if p.recompute_layers is None else min(n, p.recompute_layers))
            if model.moe is None:
                pair = dense.get(r)
                if pair is None:
                    pair = dense[r] = (self._layer(layers[0], True, r), self._layer(layers[0], False, r))
                lr, ln = pair
                f = n * ln[0]
                b_ = n_rc * lr[1] + (n - n_rc) * ln[1]
                saved = n_rc * lr[2] + (n - n_rc) * ln[2]
                kf = n * ln[5]
                kb = n_rc * lr[6] + (n - n_rc) * ln[6]
                ft, bt = ln[3], ln[4]
            else:
                f = b_ = saved = kf = kb = 0.0
                for pos, l in enumerate(layers):
                    c = self._layer(l, pos < n_rc, r)
                    f += c[0]
                    b_ += c[1]
                    saved += c[2]
                    kf += c[5]
                    kb += c[6]
                ft, bt = c[3], self._layer(layers[0], 0 < n_rc, r)[4]
            if vs == 0:
                ef, eb = self._tp("embed_out", 0, r), self._tp("embed_out", 1, r)
                f += self._fwd(an.embed) + ef
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
                f += hf
                b_ += hb
                saved += hs
                kf += hkf
                kb += hkb
                ft = 0.0
            self.F.append(f)
            self.B.append(b_)
            self.Fx.append(f - kf)
            self.Bx.append(b_ - kb)
            self.Fh.append(fh)
            self.Bh.append(bh)
            self.saved.append(saved)
            self.Ft.append(ft)
            self.Bt.append(bt)
        self._pipeline()
        self._replayed: Optional[list] = None
        self._zero3_replays: dict = {}

    # --- prices --------------------------------------------------------------------------------
    def _fwd(self, blk) -> float:
        return self.cm.time(blk.op, blk.flops, blk.bytes)

    def _bwd(self, blk) -> float:
        return self.cm.time(blk.op, blk.bwd_flops, blk.bwd_bytes)

    def _tp(self, block: str, bwd: int, rank: int) -> float:
        verb = _TP_OPS[block][self.sp][bwd]
        return self._coll(verb, rank, "tp", self.an.full_hidden_bytes)

    def _coll(self, verb: str, rank: int, axis: str, nbytes: float) -> float:
        """A collective the compute stream waits on (its seconds are also added up in `_k`)."""
        t = self.mesh.coll(verb, rank, axis, nbytes, self.p.ep)
        self._k += t
        return t

    def _layer_forward(self, blocks: dict, rank: int) -> float:
        an, p, t = self.an, self.p, 0.0
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
        of their gradients), or as cp partial attentions between the hops of ring attention (whose
        messages are left out: they only delay)."""
        p = self.p
        if p.cp > 1 and p.cp_impl == "ring":
            f, by = (attn.bwd_flops, attn.bwd_bytes) if bwd else (attn.flops, attn.bytes)
            return p.cp * self.cm.time(attn.op, f / p.cp, by / p.cp)
        if bwd:
            return self._bwd(attn) + (self._coll("reducescatter", rank, "cp", self.an.kv_bytes) if p.cp > 1 else 0.0)
        return (self._coll("allgather", rank, "cp", self.an.kv_bytes) if p.cp > 1 else 0.0) + self._fwd(attn)

    def _layer(self, l: int, rc: bool, rank: int) -> tuple:
        """Layer l: (forward s, backward s incl. recompute, activation bytes saved, the collective
        ending its forward, the one ending its backward, collective s in the forward, in the
        backward)."""
        p = self.p
        moe = self.rp.model.is_moe_layer(l)
        key = (self.mesh_key, p.tp, self.sp, p.cp, p.cp_impl, p.ep, p.mbs, p.dtype, p.flash_attention, p.recompute, rc,
               moe, rank)
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
        if "fc1" in blocks:
            b += self._bwd(blocks["fc2"]) + self._bwd(blocks["fc1"])
        else:
            a2a = self._coll("alltoall", rank, "ep", an.dispatch_bytes)
            self._k += a2a
            b += self._bwd(blocks["moe_out"]) + a2a + self._bwd(blocks["experts"]) + a2a + self._bwd(blocks["router"])
        b += self._tp("mlp_in", 1, rank) + self._tp("attn_out", 1, rank) + self._bwd(blocks["proj"])
        if rc and p.recompute == "selective":
            b += self._attention(blocks["attn"], rank, 0) if p.cp_impl == "ring" else self._fwd(blocks["attn"])
        b += self._attention(blocks["attn"], rank, 1)
        b += self._bwd(blocks["qkv"]) + self._tp("attn_in", 1, rank)
        saved = an.hidden_bytes if full else sum(x.saved for x in blocks.values())
        kb = self._k
        out = (f, b, saved, self._tp("mlp_out", 0, rank), self._tp("attn_in", 1, rank), kf, kb)
        self.b.layers[key] = out
        return out

    def _head(self, rank: int) -> tuple[float, float, float]:
        an = self.an
        h = an.head
        ce = 4.0 * an.tokens
        self._k = 0.0
        f = self._tp("head_in", 0, rank) + self._fwd(h["head"])
        f += self._coll("allreduce", rank, "tp", ce) + self._fwd(h["xent"])
        f += self._coll("allreduce", rank, "tp", 2 * ce) + self._fwd(h["loss"])
        kf, self._k = self._k, 0.0
        b = self._bwd(h["loss"]) + self._bwd(h["xent"]) + self._bwd(h["head"]) + self._tp("head_in", 1, rank)
        return f, b, h["head"].saved, kf, self._k

    # --- the schedule --------------------------------------------------------------------------
    def _forwards_before_first_backward(self, r: int) -> list[int]:
        """How many forwards of each chunk rank r runs before its first backward (simexec.schedules)."""
        pp, m, v = self.pp, self.m, self.vpp
        sched = self.p.schedule_name
        if sched == "gpipe":
            return [m]
        if sched != "interleaved-1f1b":
            return [min(pp - r, m)]
        total = m * v
        w = min(min((pp - r - 1) * 2 + (v - 1) * pp, total) + 1, total)
        counts = [0] * v
        full, rest = divmod(w, pp)
        for k in range(full):  # forward unit k runs chunk (k // pp) % v
            counts[k % v] += pp
        counts[full % v] += rest
        return counts

    def _pipeline(self) -> None:
        """Per pipeline rank: the end of its last compute (a compute-only replay of the schedule) and
        the activations live before its first backward.

        Within a rank every compute waits for the collectives before it, so a rank's actions add up;
        across ranks a pipeline send waits only for the compute before it, so the chains leave out the
        collective that ends a stage (`Ft`, `Bt`)."""
        pp, V, m, F, B, Ft, Bt = self.pp, self.V, self.m, self.F, self.B, self.Ft, self.Bt
        Fh, Bh = self.Fh, self.Bh
        hb = self.an.hidden_bytes
        p2pF = [self.mesh.p2p(vs % pp, (vs + 1) % pp, hb) for vs in range(V - 1)]
        p2pB = [self.mesh.p2p((vs + 1) % pp, vs % pp, hb) for vs in range(V - 1)]
        # micro-batch 0 through every forward, then back through the later stages' backwards:
        # earliest start of the first compute of F(vs, mb 0) and of B(vs, mb 0)
        reach = [0.0] * V
        for vs in range(1, V):
            reach[vs] = reach[vs - 1] + F[vs - 1] - Fh[vs - 1] - Ft[vs - 1] + p2pF[vs - 1]
        back = [0.0] * V
        back[V - 1] = reach[V - 1] + F[V - 1] - Fh[V - 1] + Bh[V - 1]
        for vs in range(V - 2, -1, -1):
            back[vs] = back[vs + 1] + B[vs + 1] - Bh[vs + 1] - Bt[vs + 1] + p2pB[vs]
        interleaved = self.p.schedule_name == "interleaved-1f1b"
        end, self.act, self.w_after = [], [], []
        Fx, Bx = self.Fx, self.Bx
        for r in range(pp):
            counts = self._forwards_before_first_backward(r)
            f_before = sum(n * F[c * pp + r] for c, n in enumerate(counts))
            work = m * sum(Fx[c * pp + r] + Bx[c * pp + r] for c in range(self.vpp))
            self.w_after.append(work - sum(n * Fx[c * pp + r] for c, n in enumerate(counts)))
            self.act.append(sum(n * self.saved[c * pp + r] for c, n in enumerate(counts)))
            vs_first = (self.vpp - 1) * pp + r if interleaved else r
            first_b = max(back[vs_first], reach[r] + f_before - Fh[r] + Bh[vs_first])
            total = m * sum(F[c * pp + r] + B[c * pp + r] for c in range(self.vpp))
            end.append(first_b + total - f_before - Bh[vs_first])
        # the last micro-batch's gradients still walk down to stage 0 (chunk 0 of every rank)
        last = [0.0] * pp
        for r in range(pp - 1, -1, -1):
            last[r] = end[r]
            if r < pp - 1:
                last[r] = max(last[r], last[r + 1] - Bt[r + 1] + p2pB[r] + B[r] - Bh[r])
        # end of each rank's last compute, and the collective still running after it
        self.last_compute = [last[r] - Bt[r] for r in range(pp)]
        self.own_last_compute = [end[r] - Bt[r] for r in range(pp)]
        self.tail = Bt[:pp]

    # --- per state variant ---------------------------------------------------------------------
    def _params(self) -> list[dict]:
        """Per pipeline rank: parameters (dense, expert), the largest unit, the last unit's dense
        parameters and each chunk's units' dense parameters."""
        p = self.p
        key = (p.tp, p.pp, p.vpp, p.ep, p.stages)
        out = self.b.params.get(key)
        if out is None:
            out = []
            for r in range(p.pp):
                prm = self.rp.params_on_pp_rank(r)
                units = self._units(r)
                biggest = max(self._unit_params(u) for u in units)
                last_unit = -1 if r == 0 else self.rp.stage_layers[r][0]
                chunks = [[self._unit_dense(u) for u in self._units(r, c)] for c in range(p.vpp)]
                out.append(dict(dense=prm["dense"], expert=prm["expert"], biggest=biggest,
                                last_dense=self._unit_dense(last_unit), chunks=chunks))
            self.b.params[key] = out
        return out

    def _memory(self, state: tuple) -> tuple[list[float], list[float], list[float]]:
        """Per pipeline rank: model-state bytes (`model_state_bytes`), YaFSDP's preallocated buffers
        and the optimizer's shard of parameters."""
        p, rp = self.p, self.rp
        key = (p.tp, p.pp, p.vpp, p.ep, p.stages, rp.dp, p.cp, p.dtype, state)
        out = self.b.memory.get(key)
        if out is not None:
            return out
        zero, zero_impl, dp_shard, offload = state
        vrp = self.rp if (p.zero, p.zero_impl, p.dp_shard, p.offload) == state else replace(
            rp, plan=p.model_copy(update=dict(zero=zero, zero_impl=zero_impl, dp_shard=dp_shard, offload=offload)))
        groups = self.mesh.groups(self.mesh.rank_of_stage[0], p.ep, dp_shard)
        zero_size = len(groups["zero"])
        edp = max(1, len(groups["edp"]))
        dt, gdt = rp.dtype_bytes, (4 if p.dtype == "fp32" else 2)
        yafsdp = zero == 3 and (zero_impl or "fsdp") == "yafsdp" and zero_size > 1
        static, buffers, shards = [], [], []
        params = self._params()
        memo = _MemoParams(vrp, params)
        for r, prm in enumerate(params):
            ms = ResolvedPlan.model_state_bytes(memo, r)
            static.append(ms["params"] + ms["grads"] + ms["optimizer"])
            big = prm["biggest"]
            buffers.append(2 * big * dt + 2 * big * gdt if yafsdp else 0.0)
            shards.append(prm["dense"] / (zero_size if zero >= 1 else 1) + prm["expert"] / (edp if zero >= 1 else 1))
        out = self.b.memory[key] = (static, buffers, shards)
        return out

    def _state(self, state: tuple) -> tuple:
        """Per pipeline rank: model-state bytes, buffers, (last gradient reduction, optimizer and
        parameter gather) seconds, the busy time of the ZeRO axis' stream (fixed, per micro-batch)
        and the gradient traffic."""
        p, rp = self.p, self.rp
        key = (self.mesh_key, p.tp, p.pp, p.vpp, p.ep, p.dtype, p.stages, state)
        out = self.b.states.get(key)
        if out is not None:
            return out
        zero, zero_impl, dp_shard, offload = state
        static, buffers, shards = self._memory(state)
        dt, gdt = rp.dtype_bytes, (4 if p.dtype == "fp32" else 2)
        mesh, cm = self.mesh, self.cm
        verb = "allreduce" if zero == 0 else "reducescatter"

        def zc(verb: str, rank: int, nbytes: float, axis: str = "zero") -> float:
            return mesh.coll(verb, rank, axis, nbytes, p.ep, dp_shard)

        tail, busy, traffic = [], [], []
        for r, prm in enumerate(self._params()):
            rank = mesh.rank_of_stage[r]
            shard = shards[r]
            if offload != "none":
                opt = mesh.copy(rank, "d2h", shard * gdt) + mesh.cpu(rank, shard) + mesh.copy(rank, "h2d", shard * dt)
            else:
                opt = cm.time("optimizer", shard * ADAM_FLOPS_PER_PARAM, shard * ADAM_BYTES_PER_PARAM)
            # the last unit's gradients are reduced after the last backward, before the optimizer
            red = zc(verb, rank, prm["last_dense"] * gdt)
            gather = 0.0
            if zero in (1, 2):  # parameters all-gathered after the step
                gather = zc("allgather", rank, prm["dense"] * dt)
                if prm["expert"] > 0:
                    gather = max(gather, zc("allgather", rank, prm["expert"] * dt, "edp"))
            tail.append((red, opt + gather))
            # The ZeRO axis' stream runs its collectives one after another. Buckets split a
            # reduction in parts, and an idle-network collective costs at least as much in parts
            # as whole (affine in bytes per algorithm, the fastest taken: concave, so subadditive).
            total = zc(verb, rank, prm["dense"] * gdt)
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
        out = self.b.states[key] = (static, buffers, tail, busy, traffic)
        return out

    def _units(self, r: int, chunk: Optional[int] = None) -> list[int]:
        """Parameter units of pipeline rank r (or of one of its chunks): -1 embedding, L the head."""
        units = []
        for c in range(self.vpp) if chunk is None else (chunk,):
            vs = c * self.pp + r
            if vs == 0:
                units.append(-1)
            units.extend(self.rp.stage_layers[vs])
            if vs == self.V - 1:
                units.append(self.L)
        return units

    def _unit_params(self, unit: int) -> float:
        if unit == -1:
            return self.an.embed_params()
        if unit == self.L:
            return self.an.head_params()
        return sum(self.an.layer_param_counts(unit))

    def _unit_dense(self, unit: int) -> float:
        if unit == -1:
            return self.an.embed_params()
        if unit == self.L:
            return self.an.head_params()
        return self.an.layer_param_counts(unit)[0]

    def replay_bound(self, state: tuple) -> float:
        """Time bound from `_replay`: each rank's last compute, then its last gradient reduction,
        optimizer step and parameter gather, as in `bounds`. Under ZeRO-3 the replay goes unit by
        unit with the parameter gathers and gradient reduce-scatters on their stream."""
        zero, _, dp_shard, _ = state
        _, _, tails, _, _ = self._state(state)
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
        dt, gdt = self.rp.dtype_bytes, (4 if p.dtype == "fp32" else 2)
        vs = chunk * self.pp + r
        layers = self.rp.stage_layers[vs]
        n = len(layers)
        n_rc = 0 if p.recompute == "none" else (n if p.recompute_layers is None else min(n, p.recompute_layers))
        fwd, bwd = [], []
        for u in self._units(r, chunk):
            dense = self._unit_dense(u)
            g = self.mesh.coll("allgather", rank, "zero", dense * dt, p.ep, zshard or None)
            rs = self.mesh.coll("reducescatter", rank, "zero", dense * gdt, p.ep, zshard or None)
            if u == -1:
                fo, fc = 0.0, self._tp("embed_out", 0, rank)
                fwd.append((0.0, self._fwd(an.embed), fc, g, 0.0))
                bo = self._tp("embed_out", 1, rank)  # before the embedding's backward
                bwd.append((bo, self._bwd(an.embed), 0.0, g, rs))
            elif u == self.L:
                hf, hb, _, _, _ = self._head(rank)
                fo = self._tp("head_in", 0, rank)
                bc = self._tp("head_in", 1, rank)
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
        """The pipeline schedule (`simexec.schedules.pipeline_order`, as the lowering walks it) with
        every compute at full speed, every collective the compute waits on at its idle-network price
        and every pipeline message sent as soon as its compute ends. A forward waits for the previous
        stage's forward of its micro-batch and its message, a backward for the next stage's backward;
        within a rank the actions run in order, each after the collective that closes the previous
        one and the one that opens it. Anything the simulator adds only delays; returns, per rank, the
        end of its last compute, the collective that follows it and when its ZeRO stream is done.

        zshard (ZeRO-3 over dp, or over dp_shard groups of that size when > 0): actions go unit by
        unit. Each pass gathers its first two units' parameters up front and unit j+2's once unit j
        has computed; a unit computes once its gather is done; a backward unit's gradients are
        reduce-scattered after it; the gathers and reduce-scatters take turns on one stream."""
        from simexec.schedules import pipeline_order

        pp, V, m = self.pp, self.V, self.m
        F, B, Fh, Bh, Ft, Bt = self.F, self.B, self.Fh, self.Bh, self.Ft, self.Bt
        hb = self.an.hidden_bytes
        p2pF = [self.mesh.p2p(vs % pp, (vs + 1) % pp, hb) for vs in range(V - 1)]
        p2pB = [self.mesh.p2p((vs + 1) % pp, vs % pp, hb) for vs in range(V - 1)]
        Fb = [F[v] - Fh[v] - Ft[v] for v in range(V)]
        Bb = [B[v] - Bh[v] - Bt[v] for v in range(V)]
        order = pipeline_order(self.p.schedule_name, pp, m, self.vpp)
        fend = [[-1.0] * m for _ in range(V)]
        bend = [[-1.0] * m for _ in range(V)]
        ptr = [0] * pp
        t_end = [0.0] * pp
        t_tail = [0.0] * pp
        c_free = [0.0] * pp  # when the rank's ZeRO stream is free
        units = None
        if zshard is not None:
            units = {(r, c): self._unit_costs(r, c, zshard) for r in range(pp) for c in range(self.vpp)}
        left = sum(len(a) for a in order.values())
        while left:
            moved = False
            for r in range(pp):
                acts, i = order[r], ptr[r]
                te, tt, cf = t_end[r], t_tail[r], c_free[r]
                while i < len(acts):
                    chunk, kind, mb = acts[i]
                    vs = chunk * pp + r
                    if kind == "F":
                        arr = 0.0
                        if vs > 0:
                            dep = fend[vs - 1][mb]
                            if dep < 0.0:
                                break
                            arr = dep + p2pF[vs - 1]
                        if units is None:
                            start = te + tt + Fh[vs]
                            te = (start if start > arr else arr) + Fb[vs]
                            tt = Ft[vs]
                        else:
                            te, tt, cf = _zero3_pass(units[(r, chunk)][0], te, tt, cf, arr)
                        fend[vs][mb] = te
                    else:
                        arr = 0.0
                        if vs < V - 1:
                            dep = bend[vs + 1][mb]
                            if dep < 0.0:
                                break
                            arr = dep + p2pB[vs]
                        if units is None:
                            start = te + tt + Bh[vs]
                            te = (start if start > arr else arr) + Bb[vs]
                            tt = Bt[vs]
                        else:
                            te, tt, cf = _zero3_pass(units[(r, chunk)][1], te, tt, cf, arr)
                        bend[vs][mb] = te
                    i += 1
                    left -= 1
                    moved = True
                ptr[r], t_end[r], t_tail[r], c_free[r] = i, te, tt, cf
            if not moved:  # cannot happen for the schedules simexec builds; keep the first bound
                return [(0.0, 0.0, 0.0)] * pp
        return list(zip(t_end, t_tail, c_free))

    def bounds(self, state: tuple) -> tuple[float, float, float]:
        """(ordering estimate, time lower bound, memory lower bound) of this structure with `state`."""
        static, buffers, tails, busy, traffic = self._state(state)
        ws, dyn, a = self.b.workspace, self.b.dyn, self.b.slow
        t = mem = tr = 0.0
        lc, own, tl, act, m, wa = self.last_compute, self.own_last_compute, self.tail, self.act, self.m, self.w_after
        for r in range(self.pp):
            red, after = tails[r]
            rest = (red if red > tl[r] else tl[r]) + after
            x = lc[r] + rest
            fixed, per_mb = busy[r]
            z = fixed + m * per_mb
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
            y = static[r] + ws + dyn * (buffers[r] + act[r])
            if y > mem:
                mem = y
            if traffic[r] > tr:
                tr = traffic[r]
        est = t + 0.1 * tr
        # float sums in another order than the simulator's may differ in the last bits: stay below
        return est, t * (1.0 - 1e-9), mem * (1.0 - 1e-9)


# ---------------------------------------------------------------------------------------------------
# Evaluation (runs in workers)
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Context:
    model: ModelSpec
    cluster: ClusterSpec
    seq_len: Optional[int]
    profile: Any = None


_CTX: Optional[_Context] = None


def _init_worker(ctx: _Context) -> None:
    global _CTX
    _CTX = ctx
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle


def _evaluate(plan_string: str, ctx: Optional[_Context] = None, simulator: Optional[Callable] = None) -> dict:
    """Simulate one plan string exactly as `simexec simulate` would; a plain dict of its numbers."""
    ctx = ctx or _CTX
    if simulator is None:
        from simexec.simulate import simulate as simulator
    try:
        res = simulator(ctx.model, ctx.cluster, parse_plan(plan_string), ctx.seq_len, profile=ctx.profile)
    except SimexecError as exc:  # a plan the simulator refuses is reported, not fatal to the search
        return {"plan": plan_string, "error": f"{type(exc).__name__}: {exc}"}
    d = res.to_json() if hasattr(res, "to_json") else dict(res)
    out = {"plan": plan_string}
    for k in _RESULT_KEYS:
        if k in d:
            out[k] = d[k]
    return out


class _Serial:
    name = "serial"

    def __init__(self, ctx: _Context, simulator: Optional[Callable]):
        self.ctx, self.simulator, self.workers = ctx, simulator, 1

    def map(self, plans: list[str], on_result: Callable[[dict], None]) -> None:
        for s in plans:
            on_result(_evaluate(s, self.ctx, self.simulator))

    def close(self, interrupted: bool = False) -> None:
        pass


class _Processes:
    name = "processes"

    def __init__(self, ctx: _Context, workers: int):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.workers = workers
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                        initializer=_init_worker, initargs=(ctx,))

    def map(self, plans: list[str], on_result: Callable[[dict], None]) -> None:
        from concurrent.futures import as_completed

        futures = [self.pool.submit(_evaluate, s) for s in plans]
        for fut in as_completed(futures):
            on_result(fut.result())

    def close(self, interrupted: bool = False) -> None:
        if interrupted:
            procs = list(getattr(self.pool, "_processes", {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:  # the workers this search started: do not wait for their current plan
                if proc.is_alive():
                    proc.terminate()
        else:
            self.pool.shutdown(wait=True)


class _Ray:
    name = "ray"

    def __init__(self, ctx: _Context, address: str, workers: Optional[int]):
        import ray

        self.ray = ray
        self.owned = not ray.is_initialized()
        if self.owned:
            ray.init(address=None if address == "local" else address, log_to_driver=False)
        self.ctx_ref = ray.put(ctx)
        self.remote = ray.remote(num_cpus=1, max_retries=2)(_evaluate)
        self.workers = workers or int(ray.cluster_resources().get("CPU", 1))
        self.pending: list = []

    def map(self, plans: list[str], on_result: Callable[[dict], None]) -> None:
        ray = self.ray
        self.pending = [self.remote.remote(s, self.ctx_ref) for s in plans]
        while self.pending:
            done, self.pending = ray.wait(self.pending, num_returns=1)
            for ref in done:
                on_result(ray.get(ref))

    def close(self, interrupted: bool = False) -> None:
        for ref in self.pending:
            try:
                self.ray.cancel(ref, force=True)
            except Exception:
                pass
        if self.owned:
            self.ray.shutdown()


# ---------------------------------------------------------------------------------------------------
# Result
# ---------------------------------------------------------------------------------------------------


def _bottleneck(breakdown: dict, step: float) -> str:
    """The largest share of the step that is not useful compute (compute if there is none)."""
    over = {k: v for k, v in breakdown.items() if k != "compute" and v > 0}
    if not over:
        return "compute"
    k = max(sorted(over), key=lambda x: over[x])
    if step <= 0:
        return k
    share = 100 * over[k] / step
    return f"{k} {share:.0f}%" if share >= 1 else f"{k} {share:.1f}%"


def _entry(r: dict) -> dict:
    out = {"plan": r["plan"], "step_time_s": r["step_time_s"], "tokens_per_s": r["tokens_per_s"],
           "tflops_per_gpu": r.get("tflops_per_gpu"), "mfu": r["mfu"],
           "peak_memory_bytes": r["peak_memory_bytes"], "fits": r["fits"],
           "bottleneck": _bottleneck(r.get("breakdown_s", {}), r["step_time_s"]),
           "breakdown_s": r.get("breakdown_s", {}), "memory_breakdown_bytes": r.get("memory_breakdown_bytes", {})}
    return out


def _sort_key(objective: str):
    if objective == "memory":
        return lambda r: (r["peak_memory_bytes"], r["step_time_s"], r["plan"])
    return lambda r: (r["step_time_s"], r["peak_memory_bytes"], r["plan"])


def pareto_front(results: list[dict]) -> list[dict]:
    """Fitting plans no other fitting plan beats in both step time and peak memory (ties kept),
    fastest first."""
    pts = sorted((r for r in results if r.get("fits")), key=_sort_key("throughput"))
    front: list[dict] = []
    best_mem = math.inf
    for r in pts:
        dominated = any(
            f["step_time_s"] <= r["step_time_s"] and f["peak_memory_bytes"] <= r["peak_memory_bytes"]
            and (f["step_time_s"] < r["step_time_s"] or f["peak_memory_bytes"] < r["peak_memory_bytes"])
            for f in front
        ) if r["peak_memory_bytes"] >= best_mem else False
        if not dominated:
            front.append(r)
            best_mem = min(best_mem, r["peak_memory_bytes"])
    return front


def _plan_diff(a: str, b: str) -> list[str]:
    pa, pb = parse_plan(a), parse_plan(b)
    out = []
    for name in Plan.model_fields:
        va, vb = getattr(pa, name), getattr(pb, name)
        if va != vb:
            out.append(f"{name} {_fmt_val(vb)} -> {_fmt_val(va)}")
    return out


def _fmt_val(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(int(v))
    return str(v)


def explain(best: Optional[dict], runner: Optional[dict], objective: str = "throughput") -> dict:
    """Why `best` beats `runner`: the difference of their breakdowns, largest first."""
    if best is None:
        return {"text": "no plan fits"}
    if runner is None:
        return {"best": best["plan"], "text": f"{best['plan']} is the only plan that fits"}
    keys = sorted(set(best["breakdown_s"]) | set(runner["breakdown_s"]))
    delta = {k: best["breakdown_s"].get(k, 0.0) - runner["breakdown_s"].get(k, 0.0) for k in keys}
    delta = {k: v for k, v in sorted(delta.items(), key=lambda kv: (-abs(kv[1]), kv[0])) if v != 0.0}
    dt = best["step_time_s"] - runner["step_time_s"]
    dm = best["peak_memory_bytes"] - runner["peak_memory_bytes"]
    changes = _plan_diff(best["plan"], runner["plan"])
    parts = [f"{k} {v:+.3g} s" for k, v in list(delta.items())[:4]]
    if objective == "memory":
        head = (f"best uses {-dm / GiB:.3g} GiB less peak memory than the runner-up"
                if dm < 0 else "best ties the runner-up on peak memory and is faster")
    else:
        rel = -dt / runner["step_time_s"] if runner["step_time_s"] > 0 else 0.0
        head = (f"best is {-dt:.4g} s ({100 * rel:.2f}%) faster per step than the runner-up"
                if dt < 0 else "best ties the runner-up on step time and needs less memory")
    text = f"{head}; plan: {', '.join(changes) or 'same'}; breakdown (best - runner-up): {', '.join(parts) or 'equal'}"
    return {"best": best["plan"], "runner_up": runner["plan"], "delta_step_time_s": dt,
            "delta_peak_memory_bytes": dm, "plan_changes": changes, "delta_breakdown_s": delta, "text": text}


@dataclass
class SearchResult:
    """What a search found. `plans`: the top fitting plans, best first (numbers as `simulate` gives them)."""

    model: str
    cluster: str
    gbs: int
    seq_len: int
    world: int
    objective: str
    top: int
    fix: dict
    plans: list[dict]
    pareto: list[dict]
    space: int  # combinations enumerated
    invalid: int  # refused by resolve
    candidates: int  # valid plans
    evaluated: int  # simulated
    pruned: int  # skipped by the time bound (and not on the Pareto front)
    oom: int  # known not to fit: by the memory bound or simulated
    oom_bound: int
    errors: int
    interrupted: bool
    explanation: dict
    capacity_bytes: float
    pareto_limit: Optional[float] = None  # the front covers plans up to this step time (peak memory)
    closest: Optional[dict] = None  # when nothing fits: the plan that comes closest
    error_examples: list = field(default_factory=list)  # the first plans the simulator refused, and why
    wall_s: float = 0.0
    bound_s: float = 0.0  # enumerating and bounding the space
    backend: str = ""
    workers: int = 1

    def to_json(self) -> dict:
        """JSON-ready; the same for the same inputs, whatever the backend (wall time left out)."""
        return {
            "model": self.model, "cluster": self.cluster, "gbs": self.gbs, "seq_len": self.seq_len,
            "world": self.world, "objective": self.objective, "top": self.top,
            "fix": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.fix.items()},
            "plans": self.plans, "evaluated": self.evaluated, "pruned": self.pruned, "oom": self.oom,
            "oom_by_bound": self.oom_bound, "invalid": self.invalid, "space": self.space,
            "candidates": self.candidates, "errors": self.errors, "interrupted": self.interrupted,
            "pareto": [{k: r[k] for k in ("plan", "step_time_s", "tokens_per_s", "peak_memory_bytes", "fits")}
                       for r in self.pareto],
            "pareto_limit": self.pareto_limit,
            "explanation": self.explanation, "closest": self.closest, "error_examples": self.error_examples,
        }

    def format(self) -> str:
        lines = [
            f"search: {self.model} on {self.cluster} ({self.world} GPUs), gbs {self.gbs}, seq {self.seq_len}, "
            f"objective {self.objective}" + (f", fixed {_fix_str(self.fix)}" if self.fix else ""),
            f"  {self.space:,} combinations, {self.invalid:,} invalid, {self.candidates:,} valid plans: "
            f"{self.oom_bound:,} cannot fit (bound), {self.pruned:,} pruned (time bound), "
            f"{self.evaluated:,} simulated ({self.oom - self.oom_bound:,} of them OOM)"
            + (f" in {self.wall_s:.1f} s ({self.backend}, {self.workers} workers)" if self.wall_s else ""),
        ]
        if self.interrupted:
            lines.append("  INTERRUPTED: the best plans found so far")
        if self.errors:
            first = self.error_examples[0] if self.error_examples else {}
            lines.append(f"  {self.errors} plan(s) failed to simulate, e.g. {first.get('plan')}: {first.get('error')}")
        if not self.plans:
            lines.append(f"  no plan fits in {self.capacity_bytes / GiB:.1f} GiB")
            if self.closest:
                lines.append(f"  closest: {self.closest['plan']} needs {self.closest['peak_memory_bytes'] / GiB:.1f} GiB"
                             f" ({self.closest['how']})")
            return "\n".join(lines)
        lines.append("")
        lines.append(f"  top {len(self.plans)} by {self.objective}:")
        lines.append(_table(self.plans))
        lines.append("")
        if self.pareto_limit is not None:
            edge = (f"step time up to {self.pareto_limit:.4g} s" if self.objective == "throughput"
                    else f"peak memory up to {self.pareto_limit / GiB:.2f} GiB")
        else:
            edge = "every fitting plan simulated"
        lines.append(f"  Pareto front, throughput vs peak memory ({edge}):")
        lines.append(_table(self.pareto, rank=False))
        lines.append("")
        lines.append("  why the best: " + self.explanation.get("text", ""))
        return "\n".join(lines)


def _fix_str(fix: dict) -> str:
    return ",".join(f"{k}={_fmt_val(v) if not isinstance(v, tuple) else ','.join(map(str, v))}" for k, v in fix.items())


def _table(rows: list[dict], rank: bool = True) -> str:
    head = f"  {'#':>3}  {'step s':>9}  {'tokens/s':>11}  {'MFU':>6}  {'peak GiB':>8}  {'bottleneck':<20}  plan"
    out = [head]
    for i, r in enumerate(rows, 1):
        out.append(
            f"  {i if rank else '':>3}  {r['step_time_s']:9.4g}  {r['tokens_per_s']:11,.0f}  {100 * r['mfu']:5.1f}%  "
            f"{r['peak_memory_bytes'] / GiB:8.2f}  {r.get('bottleneck', ''):<20}  {r['plan']}"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------------


def search(model: Union[str, ModelSpec], cluster: Union[str, ClusterSpec], gbs: int, *, seq_len: Optional[int] = None,
           top: int = 10, objective: str = "throughput", fix: Optional[dict] = None, profile: Any = None,
           ray_address: Optional[str] = None, workers: Optional[int] = None, progress: bool = True,
           pareto_window: float = PARETO_WINDOW, prune: bool = True,
           simulator: Optional[Callable] = None) -> SearchResult:
    """Search the plans of `model` on `cluster` at global batch `gbs` (sequences).

    top: plans to return; objective: "throughput" (shortest step) or "memory" (smallest peak);
    fix: plan fields pinned to one value (see `parse_fix`); profile: a calibrated profile, as for
    `simulate`; ray_address: run the simulations as Ray tasks on that cluster ("auto", an address,
    or "local" to start a Ray instance here) instead of local processes; workers: local processes
    (default: the CPU count; 1 = in this process); progress: a progress bar on stderr.
    pareto_window: the Pareto front is exact over the plans at most this fraction slower
    (throughput) or larger (memory) than the best, and over all plans as good as the K-th best.
    prune: False simulates every plan that might fit (brute force, for checks).
    simulator: stand-in for `simexec.simulate.simulate` (tests; runs in this process).
    Ctrl-C stops the search and returns the best plans so far, `interrupted` set. Local processes
    use the spawn start method: a script that calls `search` needs `if __name__ == "__main__":`.
    """
    t0 = time.perf_counter()
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs <= 0:
        raise PlanError(f"global batch must be a positive integer, got {gbs!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top <= 0:
        raise PlanError(f"top must be a positive integer, got {top!r}")
    if not pareto_window >= 0:
        raise PlanError(f"pareto_window must be >= 0, got {pareto_window!r}")
    # a name is loaded as `simexec simulate` loads it (the sequence length can size a learned position table)
    model = model if isinstance(model, ModelSpec) else get_model(model, seq_len=seq_len)
    cluster = cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster)
    fix = normalize_fix(fix)
    if fix.get("gbs") not in (None, gbs):
        raise PlanError(f"fix gbs={fix['gbs']} contradicts the global batch {gbs}")
    fix.pop("gbs", None)
    seq = model.seq_len if seq_len is None else seq_len
    if seq <= 0:
        raise PlanError(f"sequence length must be positive, got {seq}")
    bound_cluster = cluster
    if profile is not None:
        from simexec.sim.profile import apply_profile

        bound_cluster = apply_profile(cluster, profile)

    # 1. the space, with bounds
    stats = SpaceStats()
    bounds = Bounds(model, bound_cluster, seq)
    cands: list[Candidate] = []
    interrupted = False
    try:
        for st in structures(model, bound_cluster, gbs, seq, fix, stats):
            cands.extend(bounds.candidates(st, len(cands)))
    except KeyboardInterrupt:  # nothing simulated yet: an empty, interrupted result
        interrupted = True
        cands = []
    capacity = bound_cluster.device.memory_bytes
    bound_s = time.perf_counter() - t0
    fitting = [c for c in cands if c.mem_lb <= capacity]
    oom_bound = len(cands) - len(fitting)
    # Simulate in order of the bound of the objective (ties: the estimate, then the enumeration), so
    # that the K-th best settles early. Under throughput a plan's bound is refined (the replay) when
    # it reaches the head of the queue, and it goes back in with the refined bound.
    if objective == "memory":
        def order_key(c: Candidate) -> tuple:
            return (c.mem_lb, c.est, c.order)
    else:
        def order_key(c: Candidate) -> tuple:
            return (c.time_lb, c.est, c.order)
    queue = [(order_key(c), c.order, c) for c in fitting]
    heapq.heapify(queue)
    refine_on_pop = prune and objective == "throughput"

    # 2. simulate in waves, pruning between them
    ctx = _Context(model, cluster, seq_len, profile)
    n_workers = workers if workers is not None else (os.cpu_count() or 1)
    if simulator is not None or interrupted or not fitting or (ray_address is None and n_workers <= 1):
        runner = _Serial(ctx, simulator)
    elif ray_address is not None:
        runner = _Ray(ctx, ray_address, workers)
    else:
        runner = _Processes(ctx, n_workers)
    bar = _progress(len(fitting), progress)
    results: list[dict] = []
    ok: list[dict] = []
    pruned = 0
    key = _sort_key(objective)
    try:
        while queue and not interrupted:
            wave: list[Candidate] = []
            kth, edge = _limits(ok, top, objective, pareto_window)
            while len(wave) < WAVE and queue:
                head, _, c = queue[0]
                if refine_on_pop and not c.refined:
                    bounds.refine(c)
                    heapq.heapreplace(queue, (order_key(c), c.order, c))
                    continue
                heapq.heappop(queue)
                if prune and head[0] > max(kth, edge):
                    # every plan left is bounded at least as far out: none can matter any more
                    pruned += 1 + len(queue)
                    bar.update(1 + len(queue))
                    queue.clear()
                    break
                if prune and _prunable(c, kth, edge, ok, objective, bounds):
                    pruned += 1
                    bar.update(1)
                    continue
                wave.append(c)
            if not wave:
                continue
            got: list[dict] = []

            def on_result(r: dict) -> None:
                got.append(r)
                bar.update(1)

            runner.map([c.plan_string for c in wave], on_result)
            got.sort(key=lambda r: r["plan"])
            results.extend(got)
            ok.extend(r for r in got if "error" not in r and r["fits"])
            ok.sort(key=key)
            if ok:
                bar.set_postfix_str(f"best {ok[0]['step_time_s']:.4g} s" if objective == "throughput"
                                    else f"best {ok[0]['peak_memory_bytes'] / GiB:.2f} GiB")
    except KeyboardInterrupt:
        interrupted = True
    finally:
        runner.close(interrupted)
        bar.close()
    errors = sum(1 for r in results if "error" in r)
    oom_sim = sum(1 for r in results if "error" not in r and not r["fits"])
    ok.sort(key=key)
    entries = [_entry(r) for r in ok[:top]]
    kth, edge = _limits(ok, top, objective, pareto_window)
    limit = max(kth, edge) if ok else None
    attr = "peak_memory_bytes" if objective == "memory" else "step_time_s"
    front_rows = [_entry(r) for r in pareto_front([r for r in ok if r[attr] <= limit])] if ok else []
    explanation = explain(entries[0] if entries else None, entries[1] if len(entries) > 1 else None, objective)
    closest = None
    if not entries:
        sims = [r for r in results if "error" not in r]
        if sims:
            r = min(sims, key=lambda r: (r["peak_memory_bytes"], r["plan"]))
            closest = {"plan": r["plan"], "peak_memory_bytes": r["peak_memory_bytes"],
                       "how": f"simulated, {(r['peak_memory_bytes'] - capacity) / GiB:.2f} GiB over"}
        elif cands:
            c = min(cands, key=lambda c: (c.mem_lb, c.order))
            closest = {"plan": c.plan_string, "peak_memory_bytes": c.mem_lb,
                       "how": f"lower bound, at least {(c.mem_lb - capacity) / GiB:.2f} GiB over"}
    return SearchResult(
        model=model.name, cluster=cluster.name, gbs=gbs, seq_len=seq, world=search_world(cluster, fix),
        objective=objective, top=top, fix=fix, plans=entries, pareto=front_rows,
        pareto_limit=None if limit is None or math.isinf(limit) else limit, space=stats.combinations,
        invalid=stats.invalid, candidates=len(cands), evaluated=len(results), pruned=pruned,
        oom=oom_bound + oom_sim, oom_bound=oom_bound, errors=errors, interrupted=interrupted,
        explanation=explanation, capacity_bytes=capacity, closest=closest, wall_s=time.perf_counter() - t0,
        bound_s=bound_s, backend=runner.name, workers=runner.workers,
        error_examples=sorted((r for r in results if "error" in r), key=lambda r: r["plan"])[:3],
    )


def _limits(ok: list[dict], top: int, objective: str, window: float) -> tuple[float, float]:
    """(the K-th best so far, the edge of the Pareto window around the best): infinite until K
    plans fit."""
    if len(ok) < top:
        return math.inf, math.inf
    attr = "peak_memory_bytes" if objective == "memory" else "step_time_s"
    return ok[top - 1][attr], ok[0][attr] * (1.0 + window)


def _prunable(c: Candidate, kth: float, edge: float, ok: list[dict], objective: str, bounds: Bounds) -> bool:
    """True when the plan can enter neither the top K (its bound is past the K-th best) nor the
    Pareto front inside the window: its bound is past the window's edge, or a simulated plan is at
    least as fast as its time bound and at least as small as its memory bound, strictly on one.
    Tries the cheap bound first, then the replayed one."""
    if math.isinf(kth):
        return False
    if _outside(c, kth, edge, ok, objective):
        return True
    if c.refined:
        return False
    bounds.refine(c)
    return _outside(c, kth, edge, ok, objective)


def _outside(c: Candidate, kth: float, edge: float, ok: list[dict], objective: str) -> bool:
    bound = c.mem_lb if objective == "memory" else c.time_lb
    if not bound > kth:
        return False
    if bound > edge:
        return True
    for r in ok:
        step, peak = r["step_time_s"], r["peak_memory_bytes"]
        if step <= c.time_lb and peak <= c.mem_lb and (step < c.time_lb or peak < c.mem_lb):
            return True
    return False


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return _NoBar()
    return tqdm(total=total, desc="search", unit="plan", file=sys.stderr, dynamic_ncols=True, leave=False)
