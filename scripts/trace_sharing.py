#!/usr/bin/env python
"""How much slower a rank's compute runs when ranks share the cores, read from recorded traces.

    python scripts/trace_sharing.py [traces/local] [--versus dp1] [--profile P]

For each plan of a recording (`manifest.json`, as `scripts/record_traces.py` writes it), over its
rounds (medians): the traced step's span, the summed forward and backward compute per micro-batch
and rank against the `--versus` plan's, how many ranks were computing on average while any was
(a sweep over the compute events of every rank), and the slowdown per core's worth: the compute
ratio divided by the share of a core each computing rank had, max(1, computing / cores). Plans
whose ranks hold the same layers as the reference (data parallelism, ZeRO) compare directly; the
others hold fewer layers or shards of them, and their ratio says so. Then how long a collective's
members wait for the last to call it: per collective, the mean over members of (the last call -
their own), averaged over the step's collectives (`late wait`) and summed over them per rank (`a
step`): ranks that drift apart on shared cores wait for each other. `c+w step` adds a rank's
compute in the step and its waits for late members: while the cores are busy, whichever order the
OS runs the ranks' work in, the last rank gets to a collective about when processor sharing says
all do, so the simulator's compute alone should come near the host's compute and waits together.
`busy` is the cores' worth the ranks kept busy over the step (their CPU over the step time; traces
recorded before 2026-11-27 do not carry CPU times: nan).

With `--profile` (a profile of the same host, e.g. traces/profiles/local-traces.json) it also
simulates every trace's plan with it, every rank (`simexec.calibrate.traces.predict_case`, with the
background load measured beside the run), and prints the prediction's compute per micro-batch,
ranks computing, collective members' ends and waits for the last member beside the measured ones:
where the simulator has the ranks compute together and the host did not, their compute is priced as
shared when it was not, and no member waits for a late one.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import sys
from pathlib import Path
from typing import Optional


def measured_case(trace: dict, where: str):
    """The measured trace, parsed once, as the case the simulator re-runs (`simexec.calibrate.traces`)."""
    from simexec.calibrate.traces import _case
    from simexec.trace.schema import Trace

    return _case(Trace.from_chrome(trace, where), where)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recording", nargs="?", default="traces/local")
    ap.add_argument("--versus", default="dp1", help="the plan whose compute per micro-batch is 1")
    ap.add_argument("--cores", type=int, default=None, help="the host's cores (default: the traces' metadata)")
    ap.add_argument("--profile", default=None, help="also predict each trace with this profile and compare")
    args = ap.parse_args(argv)
    from simexec.calibrate.profiles import load_profile
    from simexec.errors import SimexecError
    from simexec.trace.late_waits import collective_groups
    from simexec.trace.schema import Trace, load_json

    root = Path(args.recording)
    try:
        manifest = load_json(root / "manifest.json", "recording manifest")
    except SimexecError as exc:
        print(f"trace_sharing: error: {exc}", file=sys.stderr)
        return 2
    profile = None
    if args.profile:
        try:
            profile = load_profile(args.profile)
        except SimexecError as exc:
            print(f"trace_sharing: error: {exc}", file=sys.stderr)
            return 2
    by_plan: dict[str, list[dict]] = collections.defaultdict(list)
    predicted: dict[str, list[dict]] = collections.defaultdict(list)
    cores = args.cores
    for run in manifest.get("runs", []):
        path = root / str(run.get("file"))
        try:
            with gzip.open(path, "rt") as fh:
                trace = json.load(fh)
            if cores is None:
                node = ((trace.get("metadata") or {}).get("cluster_spec") or {}).get("node") or {}
                cores = int(node.get("cpu_cores") or 2)
            case = measured_case(trace, str(path))
            groups = collective_groups(Trace.from_chrome(trace, str(path)))
            by_plan[run["name"]].append(plan_sharing(trace, groups))
            if profile is not None:
                predicted[run["name"]].append(predicted_sharing(case, profile, groups))
        except SimexecError as exc:
            print(f"trace_sharing: error: {exc}", file=sys.stderr)
            return 2
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"trace_sharing: error: {path}: not a measured step trace ({exc})", file=sys.stderr)
            return 2
    if args.versus not in by_plan:
        print(f"trace_sharing: error: no plan {args.versus!r} in {root} (plans: {', '.join(by_plan)})", file=sys.stderr)
        return 2
    ref = statistics.median(r["compute_ms"] for r in by_plan[args.versus])
    keys = ("span_ms", "compute_ms", "compute_step_ms", "computing", "ends_apart_ms", "late_wait_ms",
            "late_wait_step_ms", "cores_busy")
    print(f"{'plan':16} {'ranks':>5} {'span ms':>8} {'compute/mb':>10} {'x ' + args.versus:>8} {'computing':>9} "
          f"{'per core':>8} {'ends apart':>10} {'late wait':>9} {'a step':>7} {'c+w step':>8} {'busy':>5}"
          + (f" {'pred span':>9} {'pred c/mb':>9} {'pred computing':>14} {'pred apart':>10} {'pred late':>9}"
             f" {'pred c+w':>8} {'pred busy':>9}" if profile else ""))
    for name, rs in by_plan.items():
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        ratio = med["compute_ms"] / ref
        line = (f"{name:16} {rs[0]['ranks']:5d} {med['span_ms']:8.1f} {med['compute_ms']:10.2f} {ratio:8.2f} "
                f"{med['computing']:9.2f} {ratio / max(1.0, med['computing'] / cores):8.2f} "
                f"{med['ends_apart_ms']:10.2f} {med['late_wait_ms']:9.2f} {med['late_wait_step_ms']:7.1f} "
                f"{med['compute_step_ms'] + med['late_wait_step_ms']:8.1f} {med['cores_busy']:5.2f}")
        if profile is not None:
            pred = {k: statistics.median(r[k] for r in predicted[name]) for k in keys}
            line += (f" {pred['span_ms']:9.1f} {pred['compute_ms']:9.2f} {pred['computing']:14.2f} "
                     f"{pred['ends_apart_ms']:10.2f} {pred['late_wait_ms']:9.2f} "
                     f"{pred['compute_step_ms'] + pred['late_wait_step_ms']:8.1f} {pred['cores_busy']:9.2f}")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
