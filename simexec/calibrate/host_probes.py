"""Analyses of CPU-host recordings: how ranks that share a host's cores compute, wait, join their
collectives and spend their CPU, measured and as the simulator predicts it.

The `scripts/probe_traces.py` subcommands print these beside each other; each function reads a
recording (`manifest.json` and its traces, as `scripts/record_traces.py` writes them) or a trace.
The simulator's charge to a rank's own thread (`issue_prices`, `thread_charges`) is what
`scripts/probe_host.py issue-cost` and `thread-cpu` set beside their measurements.
"""
from __future__ import annotations

import collections
import math
import statistics
from pathlib import Path
from typing import Optional


def measured_case(trace: dict, where: str):
    """The measured trace, parsed once, as the case the simulator re-runs (`simexec.calibrate.traces`)."""
    from simexec.calibrate.traces import trace_case
    from simexec.trace.schema import Trace

    return trace_case(Trace.from_chrome(trace, where), where)


def predicted_sharing(case, profile: dict, groups: Optional[dict] = None) -> dict:
    """`plan_sharing` of the simulator's prediction of a measured case (every rank)."""
    from simexec.calibrate.traces import predict_case
    from simexec.specs.cluster import get_cluster

    return plan_sharing(predict_case(case, get_cluster("local"), profile).trace.to_chrome(), groups)


def plan_sharing(trace: dict, groups: Optional[dict] = None) -> dict:
    """Span, compute per (rank, micro-batch), mean ranks computing, and how far apart the members
    of a collective end (the median over the collectives with more than one member; `groups`, from
    `simexec.trace.late_waits.collective_groups`, tells the groups that share an instruction's name apart)
    and how long they wait for the last to call it (`simexec.trace.late_waits`), of one trace."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    comp = [e for e in ev if e["args"].get("kind") == "compute" and e["args"].get("phase") in ("fwd", "bwd")]
    if not comp:
        raise ValueError("no forward or backward compute events")
    span = max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)
    edges = sorted([(e["ts"], 1) for e in comp] + [(e["ts"] + e["dur"], -1) for e in comp])
    level, last, time_at = 0, edges[0][0], collections.Counter()
    for x, step in edges:
        time_at[level] += x - last
        level, last = level + step, x
    busy = sum(t for k, t in time_at.items() if k > 0)
    units = len({(e["pid"], e["args"]["mb"]) for e in comp})
    from simexec.trace.late_waits import late_waits
    from simexec.trace.schema import Trace

    ends = collections.defaultdict(list)
    for e in ev:
        if e["args"].get("kind") == "collective":
            ends[(e["name"], (groups or {}).get((e["pid"], e["name"])))].append(e["ts"] + e["dur"])
    apart = [max(t) - min(t) for t in ends.values() if len(t) > 1]
    late = late_waits(Trace.from_chrome(trace), groups).get("all")
    ranks = len({e["pid"] for e in ev})
    return {"ranks": ranks, "span_ms": span / 1e3, "cores_busy": cores_busy(trace),
            "compute_ms": sum(e["dur"] for e in comp) / units / 1e3,
            "compute_step_ms": sum(e["dur"] for e in comp) / ranks / 1e3,
            "computing": sum(k * t for k, t in time_at.items()) / busy,
            "ends_apart_ms": statistics.median(apart) / 1e3 if apart else 0.0,
            "late_wait_ms": late.per_collective_s * 1e3 if late else 0.0,
            "late_wait_step_ms": late.per_rank_step_s * 1e3 if late else 0.0}


def cores_busy(trace: dict) -> float:
    """The cores' worth the ranks kept busy over a step (`simexec.trace.compare.cpu_of`); NaN where the
    trace carries no CPU times (recordings before 2026-11-27)."""
    from simexec.trace.compare import cpu_of
    from simexec.trace.schema import Trace

    cpu = cpu_of(Trace.from_chrome(trace))
    return cpu["cores_busy"] if cpu else float("nan")


def time_split(trace, predicted) -> dict[str, tuple[float, float]]:
    """{"compute" | "comm": (measured µs, predicted µs)}, summed over every rank's matching events."""
    pred = {e.id: e for e in predicted.events}
    out = {"compute": [0.0, 0.0], "comm": [0.0, 0.0]}
    for e in trace.events:
        q = pred.get(e.id)
        if q is None or e.kind not in ("compute", "collective", "recv"):
            continue
        part = out["compute" if e.kind == "compute" else "comm"]
        part[0] += e.dur_us
        part[1] += q.dur_us
    return {k: (v[0], v[1]) for k, v in out.items()}


def collective_joins(events: list, stream: str, kinds: tuple[str, ...],
          groups: Optional[dict] = None) -> list[tuple[str, str, int, int, float]]:
    """(name, verb, members, bytes, ms from the last member's issue to the members' median end) per
    collective of `stream` whose name starts with one of `kinds`; `groups`
    (`simexec.trace.late_waits.collective_groups`) tells apart the groups that call it under one name."""
    by_call: dict[tuple, list] = collections.defaultdict(list)
    for e in events:
        if e.stream == stream and e.name.startswith(kinds):
            by_call[(e.name, (groups or {}).get((e.rank, e.name)))].append(e)
    out = []
    for (name, _), es in sorted(by_call.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        last = max(e.start_us for e in es)
        out.append((name, es[0].op.partition("@")[0], len(es), int(es[0].bytes),
                    statistics.median((e.end_us - last) / 1e3 for e in es)))
    return out


def bench_alone(recording: Path, verb: str, ranks: int, nbytes: int) -> tuple[float, float, int] | None:
    """(median ms, mean ms, bytes) of the micro-benchmark's `verb` over `ranks` ranks after a barrier,
    at the benchmarked size nearest `nbytes` (in ratio); None without one."""
    from simexec.calibrate.micro import merge_results
    from simexec.trace.schema import load_json

    path = recording / "microbench.json.gz"
    if not path.exists():
        return None
    recs = [r for r in merge_results(load_json(path, "micro-benchmarks")["extras"]).get("collectives", [])
            if r.get("verb") == verb and r.get("n") == ranks and r.get("mode", "solo") == "solo" and r.get("t")]
    if not recs:
        return None
    rec = min(recs, key=lambda r: abs(math.log(r["bytes"] / max(1, nbytes))))
    return statistics.median(rec["t"]) * 1e3, statistics.fmean(rec["t"]) * 1e3, int(rec["bytes"])


def recording_cpu_rows(recording: Path, profile: dict, plans: tuple[str, ...] = ()) -> list[dict]:
    """One row per plan (first round): predicted and measured `cpu_of`, and step times (seconds)."""
    from simexec.calibrate.traces import load_cases, predict_case
    from simexec.specs.cluster import get_cluster
    from simexec.trace.compare import cpu_of
    from simexec.trace.schema import Trace, load_json

    runs = load_json(recording / "manifest.json", "recording manifest").get("runs", [])
    out, seen = [], set()
    for run in runs:
        if run["name"] in seen or (plans and run["name"] not in plans):
            continue
        seen.add(run["name"])
        path = recording / run["file"]
        measured = cpu_of(Trace.load(path))
        if not measured or "main_thread_s" not in measured:
            continue
        case = load_cases([path])[0]
        res = predict_case(case, get_cluster("local"), profile, trace=True)
        out.append({"name": run["name"], "role": run["role"], "predicted": cpu_of(res.trace), "measured": measured,
                    "step": (res.step_time_s, case.step_s)})
    return out


def counting_cores(stats: collections.Counter):
    """`Cores` that add up, into `stats`, what they hand out."""
    from simexec.sim.host.cores import Cores

    class CountingCores(Cores):
        def advance(self) -> None:
            dt = self.env.now - self.t
            if dt > 0:
                stats["idle_s"] += dt if self.n == 0 else 0.0
                stats["full_s"] += dt if self.n >= self.capacity else 0.0
                stats["busy_core_s"] += dt * min(self.capacity, self.n)
            super().advance()

        def run(self, key, seconds: float):
            k = self.weight_of(key)
            stats["comm_cpu_s" if isinstance(key, tuple) else "main_cpu_s"] += seconds * k
            if seconds > 0 and self.last_end.get(key) != self.env.now:
                stats["wake_wait_s"] += (self.idle_wake_wait() + self.wake_wait()) * k
            return super().run(key, seconds)

    return CountingCores


def collective_kind(block: str) -> str:
    """A collective's kind from its block name (`grads12` -> `grads`): the probes price each kind once."""
    return block.rstrip("0123456789")


def rank0_costs(model: str, plan: str, profile: str):
    """`HostCosts` under `profile` on the `local` cluster, and the lowest rank's instructions: what the
    simulator charges that rank's thread (issue_prices and thread_charges price it)."""
    from simexec.specs.cluster import get_cluster
    from simexec.program.lower import lower
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve
    from simexec.sim.host.model import HostCosts
    from simexec.sim.profile import apply_profile

    cluster = apply_profile(get_cluster("local"), profile)
    rp = resolve(get_model(model), cluster, load_plan(plan), None)
    prog = lower(rp, symmetric=False)
    return HostCosts(cluster, prog, rp.plan.dtype), prog.ranks[min(prog.ranks)]


def issue_prices(model: str, plan: str, profile: str) -> dict[str, tuple[float, float]]:
    """The simulator's charge to the rank's thread per kind of collective, (before the call, once
    waited): medians over rank 0's."""
    hc, instrs = rank0_costs(model, plan, profile)
    prices = collections.defaultdict(list)
    for ins in instrs:
        if ins.kind == "collective":
            prices[collective_kind(ins.block)].append(hc.issue_split(ins))
    return {k: tuple(statistics.median(side) for side in zip(*v)) for k, v in prices.items()}


def thread_charges(model: str, plan: str, profile: str) -> dict[str, float]:
    """What the simulator charges the lowest rank's thread a step, by the same parts (seconds)."""
    hc, instrs = rank0_costs(model, plan, profile)
    parts: dict[str, float] = collections.defaultdict(float)
    for ins in instrs:
        if ins.kind == "compute":
            parts[f"compute {'fwd' if ins.phase == 'recompute' else ins.phase}.{ins.block}"] += hc.cpu_seconds(ins)
        elif ins.kind == "collective":
            before, after = hc.issue_split(ins)
            parts[f"call {collective_kind(ins.block)}"] += before
            parts[f"wait {collective_kind(ins.block)}"] += after
        elif ins.kind in ("send", "recv"):
            parts["p2p"] += hc.issue_seconds(ins)
    return parts
