"""The pipeline schedule under a structure's stage costs: a closed-form critical path per pipeline
rank (`PipelineTimes`), and the schedule replayed action by action for the refined bound."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

from simexec.search.stage_costs import StageCosts, UnitCost
from simexec.specs.zero3_flavours import Zero3Flavour

if TYPE_CHECKING:
    from simexec.search.bounds import Bounds


class ReplayEnd(NamedTuple):
    """Where a pipeline rank's replay ends (seconds)."""

    last_compute: float  # the end of its last compute
    closing: float  # the collective that follows it
    stream_done: float  # when its ZeRO stream is done


def _slot(free: list[float], ready: float, seconds: float) -> float:
    """A collective on a stream whose `len(free)` threads are free at the (sorted) times `free`: it
    starts on the first free one, once `ready`; returns its end (and books the thread)."""
    start = free[0] if free[0] > ready else ready
    end = start + seconds
    free[0] = end
    free.sort()
    return end


def _zero3_pass(units: list[UnitCost], te: float, tt: float, cf: list[float],
                arr: float, depth: int = 2, gathers: bool = True,
                reduces: bool = True) -> tuple[float, float, list[float]]:
    """One forward or backward pass under ZeRO-3 (see `PipelineTimes.replay`): `te` the end of
    the rank's previous compute, `tt` the collective closing it, `cf` when each of the ZeRO stream's
    collective threads is free (a FIFO of that many servers: a collective no slower and issued no
    later starts no later), `arr` when the pass's pipeline message arrives, `depth` the units
    gathered ahead (`Zero3Flavour.prefetch_depth`); `gathers`: the units are not still gathered from
    an earlier pass, `reduces`: a backward's gradients are reduce-scattered now. Returns the three
    after the pass."""
    n = len(units)
    if not gathers:
        depth = n
    cf = list(cf)
    g_end = [0.0] * n
    for j in range(min(depth, n) if gathers else 0):  # prefetched at the start of the pass: no dependency
        g_end[j] = _slot(cf, 0.0, units[j].gather)
    for j, (opening, body, closing, _, reduce_scatter) in enumerate(units):  # unpacked: the hot loop
        start = te + tt + opening
        if arr > start:
            start = arr
        if g_end[j] > start:
            start = g_end[j]
        arr = 0.0
        te = start + body
        tt = closing
        if reduce_scatter > 0.0 and reduces:  # this unit's gradients
            _slot(cf, te, reduce_scatter)
        if j + depth < n:  # the gather `depth` units ahead, into the buffer this unit frees
            g_end[j + depth] = _slot(cf, te, units[j + depth].gather)
    return te, tt, cf


class PipelineTimes:
    """Per pipeline rank of one structure: the end of its last compute, the activations it holds
    before its first backward, its work after that, and the schedule replayed (`replay`)."""

    def __init__(self, b: Bounds, stages: StageCosts):
        self.b, self.stages = b, stages
        self.rp, self.p, self.an, self.comm = stages.rp, stages.p, stages.an, stages.comm
        self.pp, self.vpp, self.m, self.V = stages.pp, stages.vpp, stages.m, stages.V
        self.stage, self.owner, self.split = stages.stage, stages.owner, stages.split
        self.F, self.B, self.W, self.Fx, self.Bx = stages.F, stages.B, stages.W, stages.Fx, stages.Bx
        self.Fh, self.Bh, self.Ft, self.Bt = stages.Fh, stages.Bh, stages.Ft, stages.Bt
        self.saved, self.kept = stages.saved, stages.kept
        self._critical_path()

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
        """Under DualPipe's overlapped pairs, or `moe_a2a_overlap`'s (`simexec.program.moe_overlap`),
        where rank r's pairs start in its order (none otherwise; without a pipeline the pairs' positions
        are in the combined order, whose actions are all of the one chunk)."""
        if self.p.moe_a2a_overlap:
            from simexec.program.moe_overlap import moe_overlap_order

            return moe_overlap_order(self._order()[r])[1]
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

    def _critical_path(self) -> None:
        """Per pipeline rank: the end of its last compute (a compute-only replay of the schedule) and
        the activations live before its first backward.

        Within a rank every compute waits for the collectives before it, so a rank's actions add up;
        across ranks a pipeline send waits only for the compute before it, so the chains leave out the
        collective that ends a stage (`Ft`, `Bt`)."""
        pp, V, m, F, B, Ft, Bt = self.pp, self.V, self.m, self.F, self.B, self.Ft, self.Bt
        Fh, Bh = self.Fh, self.Bh
        hb, k = self.an.hidden_bytes, self.rp.pipeline_slices
        ranks = self.comm.rank_of_stage

        def message(src: int, dst: int) -> float:
            """A pipeline message's seconds: its piece over the link, then the all-gather of the
            pieces over the receiver's tp group where it is sliced; none within a rank (a V's turn)."""
            if src == dst:
                return 0.0
            t = self.comm.p2p(src, dst, hb / k)
            return t + (self.comm.coll("allgather", ranks[dst], "tp", hb) if k > 1 else 0.0)

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
        end, self.act, self.w_after, self.work = [], [], [], []
        Fx, Bx, W = self.Fx, self.Bx, self.W
        for r in range(pp):
            st = self.stage[r]
            counts = self._forwards_before_first_backward(r)
            f_before = sum(n * F[st[c]] for c, n in enumerate(counts))
            work = m * sum(Fx[vs] + Bx[vs] + W[vs] for vs in st)
            self.work.append(work)
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

    def replay(self, zshard: Optional[int] = None, zero3: Optional[Zero3Flavour] = None,
               reshard_after_forward: bool = True) -> list[ReplayEnd]:
        """The pipeline schedule (`simexec.program.schedules.pipeline_order`, as the lowering walks it) with
        every compute at full speed, every collective the compute waits on at its idle-network price
        and every pipeline message sent as soon as its compute ends. A forward waits for the previous
        stage's forward of its micro-batch and its message, a backward for the next stage's backward;
        within a rank the actions run in order, each after the collective that closes the previous
        one and the one that opens it. Anything the simulator adds only delays; returns, per rank, the
        end of its last compute, the collective that follows it and when its ZeRO stream is done.

        zshard (ZeRO-3 over dp, or over dp_shard groups of that size when > 0): actions go unit by
        unit, each unit's gathers and reduce-scatters the calls flavour `zero3` issues. Each pass
        gathers its first `prefetch_depth` units' parameters up front and unit j+depth's once unit j
        has computed; a unit computes once its gather is done; a backward unit's gradients are
        reduce-scattered after it; the gathers and reduce-scatters take turns on their stream's threads.
        A chunk's units still gathered from its previous pass (`reshard_after_forward=0` between a
        forward and its backward; FSDP2 under a pipeline after a backward but the last) are not
        gathered again, and such a pipeline's gradients are reduce-scattered in the last backward only."""
        pp, V, m = self.pp, self.V, self.m
        F, B, Fh, Bh, Ft, Bt = self.F, self.B, self.Fh, self.Bh, self.Ft, self.Bt
        p2pF, p2pB, stage = self.p2pF, self.p2pB, self.stage
        Fb = [F[v] - Fh[v] - Ft[v] for v in range(V)]
        Bb = [B[v] - Bh[v] - Bt[v] for v in range(V)]
        order, step = self._order(), 3  # a DualPipe pair: a forward, then the other chunk's B and W
        if self.p.moe_a2a_overlap:  # a forward, then another micro-batch's backward
            from simexec.program.moe_overlap import moe_overlap_order

            order, step = {r: moe_overlap_order(acts)[0] for r, acts in order.items()}, 2
        pairs = [self._pairs(r) for r in range(pp)]
        fend = [[-1.0] * m for _ in range(V)]
        bend = [[-1.0] * m for _ in range(V)]
        wend = [[-1.0] * m for _ in range(V)]
        ptr = [0] * pp
        t_end = [0.0] * pp
        t_tail = [0.0] * pp
        c_free = [[0.0] * self.b.threads for _ in range(pp)]  # when each ZeRO stream thread is free
        units = None
        depth = zero3.prefetch_depth if zero3 is not None else 2
        defer = zero3 is not None and pp > 1 and zero3.pipeline_defers_reduction
        held: dict[tuple, bool] = {}  # (rank, chunk) -> its units are gathered now
        if zshard is not None:
            units = {(r, c): self.stages.unit_costs(r, c, zshard, zero3) for r in range(pp) for c in range(self.vpp)}
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
                    if i in pairs[r]:  # a forward and another pass's whole backward, overlapped
                        done = self._replay_pair(acts[i], acts[i + 1], stage[r], te + tt, fend, bend, wend)
                        if done is None:
                            break
                        te, tt = done, 0.0
                        i += step
                        left -= step
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
                        last = mb == m - 1
                        gathers = not held.get((r, chunk), False)
                        te, tt, cf = _zero3_pass(units[(r, chunk)][half], te, tt, cf, arr, depth, gathers,
                                                 not defer or last)
                        if kind == "F":
                            held[(r, chunk)] = not reshard_after_forward
                        elif kind == "B":
                            held[(r, chunk)] = defer and not last
                    ends[vs][mb] = te
                    i += 1
                    left -= 1
                    moved = True
                ptr[r], t_end[r], t_tail[r], c_free[r] = i, te, tt, cf
            if not moved:  # cannot happen for the schedules simexec builds; keep the first bound
                return [ReplayEnd(0.0, 0.0, 0.0)] * pp
        return [ReplayEnd(te, tt, max(cf)) for te, tt, cf in zip(t_end, t_tail, c_free)]

    def _order(self) -> dict:
        """`simexec.program.schedules.pipeline_order` of this structure's schedule, made once per shape."""
        from simexec.program.schedules import pipeline_order

        key = ("order", self.p.schedule_name, self.pp, self.m, self.vpp)
        order = self.b.live.get(key)
        if order is None:
            order = self.b.live[key] = pipeline_order(self.p.schedule_name, self.pp, self.m, self.vpp)
        return order

    def _replay_pair(self, fwd, bwd, stages: list[int], free: float, fend, bend, wend) -> Optional[float]:
        """`replay` of an overlapped pair once both inputs have arrived (None before): it starts when
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
