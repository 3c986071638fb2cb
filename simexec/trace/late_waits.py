"""How long a collective's members wait for the last of them to call it.

A collective starts once every member has called it, so a member that calls early waits for the
latest. Ranks that drift apart (cores shared with other ranks, a slow GPU, uneven work) spend that
wait inside their collectives' measured times; a simulation whose ranks run in step has none of it.
Per collective instance (one name on the members of one group): the mean over its members of the
last member's call minus their own.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from simexec.trace.schema import Trace

Groups = dict[tuple[int, str], tuple[int, ...]]  # (rank, instruction name) -> the collective's ranks


@dataclass(frozen=True)
class LateWaits:
    """A trace's waits for late members, over the collectives with two or more members in it."""

    collectives: int
    per_collective_s: float  # the mean over those collectives of their members' mean wait
    per_rank_step_s: float  # every member's wait summed, over the trace's ranks

    def to_json(self) -> dict:
        return {"collectives": self.collectives, "per_collective_s": self.per_collective_s,
                "per_rank_step_s": self.per_rank_step_s}


def collective_groups(trace: Trace) -> Optional[Groups]:
    """Each collective's ranks, read from the program of the trace's plan (rebuilt from its meta:
    `model_spec`, `cluster_spec`, `plan`, `seq_len`): one name stands for a collective of each group
    (the tensor-parallel groups of `dp=2,tp=2` all-reduce under one name at once). None when the
    meta cannot rebuild the program, or rebuilds another one than the trace's `program`."""
    from simexec.specs.cluster import ClusterSpec, get_cluster
    from simexec.errors import SimexecError
    from simexec.program.lower import lower
    from simexec.specs.model import ModelSpec, get_model
    from simexec.specs.plan import load_plan, resolve

    meta = trace.meta
    try:
        model = ModelSpec.model_validate(meta["model_spec"]) if isinstance(meta.get("model_spec"), dict) \
            else get_model(str(meta.get("model")))
        cluster = ClusterSpec.model_validate(meta["cluster_spec"]) if isinstance(meta.get("cluster_spec"), dict) \
            else get_cluster(str(meta.get("cluster")))
        program = lower(resolve(model, cluster, load_plan(str(meta.get("plan"))), meta.get("seq_len")),
                        symmetric=False)
    except (SimexecError, ValueError, KeyError, TypeError):
        return None
    if meta.get("program_executed"):  # the instructions that ran, whatever the memory estimates
        if meta["program_executed"] != program.executed_fingerprint():
            return None
    else:
        fingerprint = meta.get("program") or meta.get("program_fingerprint")
        if fingerprint and fingerprint != program.fingerprint():
            return None
    return {(r, ins.name): tuple(ins.group) for r, instrs in program.ranks.items() for ins in instrs
            if ins.kind == "collective"}


def late_waits(trace: Trace, groups: Optional[Groups] = None) -> dict[str, LateWaits]:
    """The waits by communication stream (`comm.dp`, `comm.tp`, ...) and over all (`all`). Without
    `groups`, one name is one collective (right unless several groups share a name)."""
    calls: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for e in trace.events:
        if e.kind == "collective":
            group = (groups or {}).get((e.rank, e.name))
            calls[(e.stream, e.name, group)].append((e.rank, e.start_us))
    ranks = max(1, len({e.rank for e in trace.events}))
    by_stream: dict[str, list[list[float]]] = defaultdict(list)
    for (stream, _, _), members in calls.items():
        if len(members) > 1:
            last = max(t for _, t in members)
            waits = [(last - t) * 1e-6 for _, t in members]
            by_stream[stream].append(waits)
            by_stream["all"].append(waits)
    return {stream: LateWaits(len(inst), statistics.fmean(statistics.fmean(w) for w in inst),
                              sum(sum(w) for w in inst) / ranks)
            for stream, inst in sorted(by_stream.items())}
