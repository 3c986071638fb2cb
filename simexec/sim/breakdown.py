"""Where the step time goes, read off one rank's compute stream.

Every instant of [0, step time] on the compute stream is either busy (by phase: compute, recompute,
optimizer) or idle. An idle gap ends when the instruction after it may start, so the dependency
that finished last is what the stream waited on: a collective on `comm.<axis>` makes the gap
exposed `comm.<axis>` time; a pipeline recv splits into `comm.pp` (while its message was on the
wire) and `pipeline_bubble` (before the previous stage had sent it); a collective issued before its
peers were ready adds `sync` (the tied-embedding all-reduce between the first and last stage: the
pipeline drain). Before a dependency itself started, the wait follows what *it* waited on. After its
last compute instruction the stream waits for the rank's other streams, then for other ranks (`idle`).

`kernel_split` divides the same stream's busy time by the precision and class of its kernels, so that a
step that lands near a measured one through fast GEMMs against slow communication shows which part is fast.
"""
from __future__ import annotations

from simexec.program.blocks import HIGH_PRECISION_GEMM
from simexec.sim.engine import COLLECTIVE, COMPUTE, MEMORY, RECV, Engine

_BUSY = {"fwd": "compute", "bwd": "compute", "wgrad": "compute", "recompute": "recompute", "optim": "optimizer"}


def _label(stream: str) -> str:
    if stream.startswith("comm."):
        return stream
    if stream.startswith("p2p."):
        return "comm.pp"
    if stream.startswith("copy."):
        return "offload"
    if stream == "host":
        return "optimizer"
    return "idle"


def _peer_wait(axis: str) -> str:
    """Waiting for the other members of a collective: the pipeline drain for the tied embedding
    (first and last stage), load imbalance (`sync`) otherwise."""
    return "pipeline_bubble" if axis in ("embed", "pp") else "sync"


def slowest_rank(eng: Engine) -> int:
    """The rank whose compute stream finishes last (ties: the busiest one, then the lowest rank)."""
    last = {rank: eng.end[seq[-1]] for (rank, stream), seq in eng.streams.items() if stream == "compute" and seq}
    if not last:
        return min(r for r, _ in eng.streams)
    latest = max(last.values())
    tied = sorted(r for r, t in last.items() if t == latest)
    if len(tied) == 1:
        return tied[0]
    start, end = eng.start, eng.end

    def busy(rank: int) -> float:
        return sum(end[k] - start[k] for k in eng.streams[(rank, "compute")])

    return max(tied, key=lambda r: (busy(r), -r))


def breakdown(eng: Engine, rank: int, step_time: float) -> dict[str, float]:
    """Seconds per category on `rank`'s compute stream; they add up to the step time."""
    out: dict[str, float] = {}

    def add(key: str, dt: float) -> None:
        if dt > 0.0:
            out[key] = out.get(key, 0.0) + dt

    start, end, instrs = eng.start, eng.end, eng.instrs
    prev: dict[int, int] = {}
    for (r, _), seq in eng.streams.items():
        if r == rank:
            for x in range(1, len(seq)):
                prev[seq[x]] = seq[x - 1]
    seq = [k for k in eng.streams.get((rank, "compute"), ()) if eng.kind[k] != MEMORY]
    t = 0.0
    for k in seq:
        s = start[k]
        if s > t:
            deps = eng.xdeps[k]
            if deps:
                _waited(eng, max(deps, key=lambda d: end[d]), t, s, prev, add)
            else:
                add("idle", s - t)
        add(_BUSY.get(instrs[k].phase, "compute"), end[k] - s)
        t = max(t, end[k])
    rank_end = t
    for (r, _), other in eng.streams.items():
        if r == rank and other:
            rank_end = max(rank_end, end[other[-1]])
    if rank_end > t:
        last = max((other[-1] for (r, _), other in eng.streams.items() if r == rank and other), key=lambda k: end[k])
        _waited(eng, last, t, rank_end, prev, add)
    add("idle", step_time - max(rank_end, t))
    tiny = 1e-9 * step_time  # float dust from subtracting equal times
    return {k: v for k, v in out.items() if v > tiny}


def kernel_split(eng: Engine, rank: int, dtype: str) -> dict[str, tuple[float, float]]:
    """(busy seconds, FLOPs) on `rank`'s compute stream by kernel: the GEMMs at the plan's dtype
    (`gemm.fp8` under an FP8 recipe), those a recipe leaves in bf16 (`gemm.bf16`: the LM head, the
    router), attention, and the memory-bound rest (norms, activations, permutes, the loss, the
    optimizer). A GEMM's seconds include the memory traffic priced with it (its FP8 casts)."""
    out: dict[str, tuple[float, float]] = {}
    for k in eng.streams.get((rank, "compute"), ()):
        if eng.kind[k] != COMPUTE:
            continue
        ins = eng.instrs[k]
        if ins.op == "gemm":
            key = f"gemm.{dtype}"
        elif ins.op == HIGH_PRECISION_GEMM:
            key = "gemm.bf16"
        elif ins.op == "attention":
            key = "attention"
        else:
            key = "memory-bound"
        s, f = out.get(key, (0.0, 0.0))
        out[key] = (s + eng.end[k] - eng.start[k], f + ins.flops)
    return dict(sorted(out.items()))


def _waited(eng: Engine, d: int, a: float, b: float, prev: dict[int, int], add) -> None:
    """Attribute [a, b], a wait that ended when instruction d did.

    d's own span [start, end] is its category; before d started it waited on its deps or its stream
    predecessor, so the rest of the gap follows that one, and so on down the chain.
    """
    start, end, kind = eng.start, eng.end, eng.kind
    while b > a:
        kd = kind[d]
        if kd == RECV:
            ts = eng.matches[eng.match[d]].xfer_start
            wire = b - max(a, ts) if 0.0 <= ts < b else 0.0
            add("comm.pp", wire)
            add("pipeline_bubble", (b - a) - wire)
            return
        if kd == COMPUTE:
            add("idle", b - a)
            return
        label = _label(eng.instrs[d].stream)
        s = start[d]
        if kd == COLLECTIVE:
            # Issued at s, started once the last member issued it: before that it waited for ranks.
            mid = eng.match[d]
            xs = eng.matches[mid].xfer_start if mid >= 0 else s
            if xs > s:
                cut = max(a, xs)
                add(label, b - cut)
                b = cut
                add(_peer_wait(eng.instrs[d].axis), b - max(a, s))
                b = max(a, s)
        if s <= a:
            add(label, b - a)
            return
        add(label, b - s)
        cands = list(eng.xdeps[d])
        if d in prev:
            cands.append(prev[d])
        if not cands:
            add(label, s - a)
            return
        d = max(cands, key=lambda c: end[c])
        b = min(s, end[d])
        if b < s:
            add(label, s - b)
