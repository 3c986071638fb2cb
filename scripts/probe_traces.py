"""Read CPU-host recordings: where a step's time and CPU go, measured against predicted.

    python scripts/probe_traces.py trace-sharing [traces/local] [--versus dp1] [--profile P]
    python scripts/probe_traces.py time-split traces/local [--profile traces/profiles/local-traces.json]
    python scripts/probe_traces.py collective-joins [traces/local] [--stream comm.dp] [--kinds bwd.grads]
    python scripts/probe_traces.py recording-cpu [traces/local-sched-idle] [--profile PROFILE] [--plans dp2,tp4]
    python scripts/probe_traces.py profile-swap [--recording traces/local] [--swap comm] ...
    python scripts/probe_traces.py core-use [--profile traces/profiles/local-traces.json] PLAN [PLAN ...]
    python scripts/probe_traces.py SUBCOMMAND --help         # what each reads and prints

The analyses themselves are simexec.calibrate.host_probes.
"""
from __future__ import annotations

import argparse
import collections
import copy
import gzip
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simexec.calibrate.host_probes import (bench_alone, collective_joins, counting_cores, measured_case,  # noqa: E402
                                           plan_sharing, predicted_sharing, recording_cpu_rows, time_split)
from simexec.errors import SimexecError  # noqa: E402


DOCS = {
    "trace-sharing": """How much slower a rank's compute runs when ranks share the cores, read from recorded traces.

    python scripts/probe_traces.py trace-sharing [traces/local] [--versus dp1] [--profile P]

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
""",
    "time-split": """Where a step's time goes, predicted against measured: compute against communication, per plan.

    python scripts/probe_traces.py time-split traces/local [--profile traces/profiles/local-traces.json]
    python scripts/probe_traces.py time-split DIR            # a directory of scripts/validate_calibration.py

For each plan of a recording (or of a validation run's directory), the round of median step time is
re-simulated under the profile and the conditions it ran in, and three numbers are compared with the
trace: the step time, the summed durations of its compute instructions (every rank) and those of its
collectives and receives (sends are left out: an eager send's event ends when it is waited). A
profile can predict the step time well and the split badly, when a fit lengthens one part for what
the other misses; the medians of |log(predicted / measured)| at the end say how far the split is off.

`--versus dp1` adds, per plan, how long its compute instructions took against the same instructions
(block, phase) in that plan's runs, over every round: the sum of their medians and of their means.
It means something where the plans run the same instructions (data-parallel, ZeRO and pipeline
plans against `dp1`; not tensor or expert parallelism, whose blocks are smaller).
""",
    "collective-joins": """How long a step's collectives take once their last member has joined, read from recorded traces,
beside what the micro-benchmarks measured for the same collective after a barrier.

    python scripts/probe_traces.py collective-joins [traces/local] [--stream comm.dp] [--kinds bwd.grads]

For each plan of a recording (`manifest.json`, as `scripts/record_traces.py` writes it) and each
collective of the chosen stream whose name starts with one of `--kinds`: the time from the last
member's issue to each member's end (the median over the members), every round listed. Then the
median over all of them, and the recording's micro-benchmark for that verb, group size and the
nearest size, after a barrier (`traces/local/microbench.json.gz`; median and mean of its samples).
A member that arrives early waits for the last; after the last joins, only the collective itself
is left, so the two numbers measure the same work in a step and alone.
""",
    "recording-cpu": """Where a recording's CPU goes a step, measured against predicted, plan by plan.

    python scripts/probe_traces.py recording-cpu [traces/local-sched-idle] [--profile PROFILE] [--plans dp2,tp4]

For each plan of a recording (`manifest.json`, as `scripts/record_traces.py` writes it; the first
round of each) whose traces timed their ranks' CPU: the rank's main thread's CPU a step, every
thread's (main and gloo's), the cores' worth busy and the step time, predicted (every rank
simulated under the profile, in the run's conditions: `simexec.calibrate.traces.predict_case`)
against measured (`simexec.trace.compare.cpu_of`). The profile defaults to the recording's trace profile,
`traces/profiles/<recording>-traces.json`.
""",
    "profile-swap": """Which of a profile's numbers a prediction misses: swap some in from another profile and predict again.

    python scripts/probe_traces.py profile-swap [--recording traces/local] [--profile traces/profiles/local-microbench.json]
                                   [--donor traces/profiles/local-traces.json] [--swap comm] [--swap costs.idle_wake_s]

Predicts every plan of a recording (`manifest.json` of `scripts/record_traces.py`) with `--profile`, then
once per `--swap` with those numbers taken from `--donor`, and prints each plan's error against the
median of its measured rounds and the calibration and held-out plans' MAPE. A swap is comma-separated
dotted keys (`costs.idle_wake_s,node.intra_bw`) or a group: `comm` (the host model's communication
numbers) or `compute` (its compute numbers).
""",
    "core-use": """How the simulated host's cores spend a step: CPU asked for, cores busy, time idle.

    python scripts/probe_traces.py core-use [--profile traces/profiles/local-traces.json] PLAN [PLAN ...]

Simulates gpt-tiny's plans on the `local` cluster under a calibrated profile and follows the host
model's cores (`simexec.sim.host.cores.Cores`) through the step: the CPU-seconds the main threads and the
communication threads ask for (every rank, before any slowdown), the core-seconds handed out (the
busy cores over time: the asked CPU times the slowdowns of busy and alternating cores), how long no
thread ran and how long every core was taken, and the waits of woken threads. A step longer than its
busy core-seconds over the cores leaves cores idle; one as long spends its time in slowdowns.
""",
}


def cmd_trace_sharing(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_traces.py trace-sharing",
                                 description=DOCS["trace-sharing"].split("\n\n")[0])
    ap.add_argument("recording", nargs="?", default="traces/local")
    ap.add_argument("--versus", default="dp1", help="the plan whose compute per micro-batch is 1")
    ap.add_argument("--cores", type=int, default=None, help="the host's cores (default: the traces' metadata)")
    ap.add_argument("--profile", default=None, help="also predict each trace with this profile and compare")
    args = ap.parse_args(argv)
    from simexec.sim.profile import load_profile
    from simexec.errors import SimexecError
    from simexec.trace.late_waits import collective_groups
    from simexec.trace.schema import Trace, load_json

    root = Path(args.recording)
    try:
        manifest = load_json(root / "manifest.json", "recording manifest")
    except SimexecError as exc:
        print(f"probe_traces.py trace-sharing: error: {exc}", file=sys.stderr)
        return 2
    profile = None
    if args.profile:
        try:
            profile = load_profile(args.profile)
        except SimexecError as exc:
            print(f"probe_traces.py trace-sharing: error: {exc}", file=sys.stderr)
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
            print(f"probe_traces.py trace-sharing: error: {exc}", file=sys.stderr)
            return 2
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"probe_traces.py trace-sharing: error: {path}: not a measured step trace ({exc})", file=sys.stderr)
            return 2
    if args.versus not in by_plan:
        print(f"probe_traces.py trace-sharing: error: no plan {args.versus!r} in {root} "
              f"(plans: {', '.join(by_plan)})", file=sys.stderr)
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


def _runs(directory: Path) -> list[tuple[str, str, float, Path]]:
    """(plan name, role, step time, trace path) of every run a recording or a validation run holds."""
    from simexec.trace.schema import load_json

    if (directory / "validation.json").is_file():
        data = load_json(directory / "validation.json", "validation")
        return [(r["spec"]["name"], r["spec"]["role"], r["step_s"], Path(r["trace_path"])) for r in data["runs"]]
    if (directory / "manifest.json").is_file():
        data = load_json(directory / "manifest.json", "recording manifest")
        return [(r["name"], r["role"], r["step_time_s"], directory / r["file"]) for r in data["runs"]]
    raise SimexecError(f"{directory} holds neither validation.json nor manifest.json")


def _default_profile(directory: Path) -> Path:
    found = sorted((directory / "profiles").glob("*-traces.json"))
    if found:
        return found[0]
    return ROOT / "traces" / "profiles" / f"{directory.name}-traces.json"


def instruction_times(traces) -> dict[str, list[float]]:
    """Compute events' durations (µs) by instruction kind (`bwd.fc1`, ...), over the given traces."""
    from simexec.calibrate.traces import event_kind

    out: dict[str, list[float]] = {}
    for t in traces:
        for e in t.events:
            if e.kind == "compute" and not e.id.split(":", 1)[-1].startswith("optim"):
                out.setdefault(event_kind(e.id), []).append(e.dur_us)
    return out


def versus(mine: dict[str, list[float]], ref: dict[str, list[float]]) -> tuple[float, float]:
    """(sum of medians, sum of means) over the kinds both ran, relative to the reference's."""
    kinds = [k for k in mine if k in ref]
    med = sum(statistics.median(mine[k]) for k in kinds) / sum(statistics.median(ref[k]) for k in kinds)
    mean = sum(statistics.fmean(mine[k]) for k in kinds) / sum(statistics.fmean(ref[k]) for k in kinds)
    return med, mean


def report(directory: Path, profile_path: Optional[Path] = None, versus_plan: Optional[str] = None) -> list[str]:
    """The table's lines; raises SimexecError for a directory, profile or trace that cannot be read."""
    from simexec.sim.profile import load_profile
    from simexec.calibrate.traces import trace_case, predict_case
    from simexec.calibrate.evaluate import profile_sections
    from simexec.specs.cluster import get_cluster
    from simexec.trace.schema import Trace

    runs = _runs(directory)
    profile_path = profile_path or _default_profile(directory)
    profile = profile_sections(load_profile(profile_path))
    by: dict[str, list] = {}
    for name, role, step, path in runs:
        by.setdefault(name, []).append((step, role, path))
    if versus_plan is not None and versus_plan not in by:
        raise SimexecError(f"--versus {versus_plan!r} is not a plan of {directory} ({', '.join(by)})")
    traces = {name: [(step, role, Trace.load(path), path) for step, role, path in rs] for name, rs in by.items()}
    ref = instruction_times(t for _, _, t, _ in traces[versus_plan]) if versus_plan else None
    lines = [f"profile {profile_path}; the median round of each plan; error = predicted / measured - 1"]
    extra = f" {'median x ' + versus_plan:>14s} {'mean x ' + versus_plan:>12s}" if ref else ""
    lines.append(f"{'plan':16s} {'role':9s} {'step':>8s} {'compute':>8s} {'comm':>8s}{extra}")
    logs = {"compute": [], "comm": []}
    for name, rs in traces.items():
        step, role, trace, path = sorted(rs, key=lambda r: r[0])[(len(rs) - 1) // 2]
        res = predict_case(trace_case(trace, str(path)), get_cluster("local"), profile, trace=True)
        parts = time_split(trace, res.trace)
        cells = []
        for k in ("compute", "comm"):
            m, p = parts[k]
            if m > 0 and p > 0:
                logs[k].append(abs(math.log(p / m)))
                cells.append(f"{p / m - 1:+8.0%}")
            else:
                cells.append(f"{'-':>8s}")
        if ref is not None:
            med, mean = versus(instruction_times(t for _, _, t, _ in rs), ref)
            cells.append(f"{med:14.2f} {mean:12.2f}")
        lines.append(f"{name:16s} {role:9s} {res.step_time_s / step - 1:+8.1%} " + " ".join(cells))
    lines.append("median |log(predicted / measured)|: " + ", ".join(
        f"{k} {statistics.median(v):.3f}" for k, v in logs.items() if v))
    return lines


def cmd_time_split(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_traces.py time-split", description=DOCS["time-split"].split("\n\n")[0])
    ap.add_argument("directory", help="traces/<name> (a recording) or a validate_calibration.py --out directory")
    ap.add_argument("--profile", default=None, help="profile to predict with (default: the directory's trace profile)")
    ap.add_argument("--versus", default=None, metavar="PLAN", help="also compare compute instructions with this plan's")
    args = ap.parse_args(argv)
    try:
        lines = report(Path(args.directory), Path(args.profile) if args.profile else None, args.versus)
    except SimexecError as exc:
        print(f"probe_traces.py time-split: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def cmd_collective_joins(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_traces.py collective-joins",
                                 description=DOCS["collective-joins"].split("\n\n")[0])
    ap.add_argument("recording", nargs="?", default="traces/local")
    ap.add_argument("--stream", default="comm.dp", help="the collectives' stream (comm.dp, comm.tp, ...)")
    ap.add_argument("--kinds", default="bwd.grads", help="comma-separated name prefixes of the collectives")
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError
    from simexec.trace.late_waits import collective_groups
    from simexec.trace.schema import Trace, load_json

    root = Path(args.recording)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    try:
        manifest = load_json(root / "manifest.json", "recording manifest")
    except SimexecError as exc:
        print(f"probe_traces.py collective-joins: error: {exc}", file=sys.stderr)
        return 2
    rows: dict[tuple, list[float]] = collections.defaultdict(list)
    for run in manifest.get("runs", []):
        try:
            trace = Trace.load(root / str(run.get("file")))
        except (OSError, SimexecError) as exc:
            print(f"probe_traces.py collective-joins: error: {exc}", file=sys.stderr)
            return 2
        world = int(trace.meta.get("world") or 0)
        for name, verb, members, nbytes, ms in collective_joins(trace.events, args.stream, kinds, collective_groups(trace)):
            rows[(run.get("name"), verb, members, nbytes, world)].append(ms)
    if not rows:
        print(f"probe_traces.py collective-joins: error: no {args.stream} collectives named {','.join(kinds)}* "
              f"in {root}", file=sys.stderr)
        return 2
    print(f"{'plan':14s} {'verb':14s} {'ranks':>5s} {'bytes':>9s}  ms after the last member joined")
    pooled: dict[tuple, list[float]] = collections.defaultdict(list)
    for (plan, verb, members, nbytes, _world), ms in rows.items():
        print(f"{plan:14s} {verb:14s} {members:5d} {nbytes:9d}  " + ", ".join(f"{m:.1f}" for m in ms))
        pooled[(verb, members, nbytes)].extend(ms)
    print()
    for (verb, members, nbytes), ms in sorted(pooled.items()):
        # the executor runs a CPU reduce-scatter as an all-reduce of the whole tensor
        bench_verb = "allreduce" if verb == "reducescatter" else verb
        alone = bench_alone(root, bench_verb, members, nbytes)
        line = (f"{verb} over {members} ranks, {nbytes} B: median {statistics.median(ms):.2f} ms in steps "
                f"({len(ms)} collectives, {min(ms):.1f}-{max(ms):.1f})")
        if alone:
            line += f"; {bench_verb} of {alone[2]} B after a barrier: median {alone[0]:.2f} ms, mean {alone[1]:.2f}"
        print(line)
    return 0


def cmd_recording_cpu(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_traces.py recording-cpu",
                                 description=DOCS["recording-cpu"].splitlines()[0])
    ap.add_argument("recording", nargs="?", default=str(ROOT / "traces" / "local-sched-idle"))
    ap.add_argument("--profile", help="trace profile (default: traces/profiles/<recording>-traces.json)")
    ap.add_argument("--plans", default="", help="comma-separated plan names of the manifest (default: all)")
    args = ap.parse_args(argv)
    recording = Path(args.recording)
    profile_path = Path(args.profile) if args.profile else ROOT / "traces" / "profiles" / f"{recording.name}-traces.json"
    if not (recording / "manifest.json").is_file():
        print(f"probe_traces.py recording-cpu: {recording} holds no manifest.json (a directory "
              "scripts/record_traces.py wrote)", file=sys.stderr)
        return 2
    from simexec.sim.profile import load_profile
    from simexec.errors import SimexecError

    plans = tuple(p for p in args.plans.split(",") if p)
    try:
        profile = {k: v for k, v in load_profile(profile_path).items() if k in ("costs", "device", "node")}
        got = recording_cpu_rows(recording, profile, plans)
    except SimexecError as exc:
        print(f"probe_traces.py recording-cpu: {exc}", file=sys.stderr)
        return 2
    if not got:
        print(f"probe_traces.py recording-cpu: no plan of {recording} "
              f"{'named ' + args.plans + ' ' if plans else ''}timed its ranks' CPU", file=sys.stderr)
        return 2
    print(f"{recording} under {profile_path}: a rank a step, predicted / measured")
    print(f"{'plan':14s} {'role':9s} {'main thread ms':>15s} {'all threads ms':>15s} {'cores busy':>11s} {'step ms':>15s}")
    for r in got:
        p, m = r["predicted"], r["measured"]
        print(f"{r['name']:14s} {r['role']:9s} {1e3 * p['main_thread_s']:6.1f} / {1e3 * m['main_thread_s']:6.1f} "
              f"{1e3 * p['per_rank_s']:6.1f} / {1e3 * m['per_rank_s']:6.1f} {p['cores_busy']:4.2f} / {m['cores_busy']:4.2f} "
              f"{1e3 * r['step'][0]:6.1f} / {1e3 * r['step'][1]:6.1f}")
    return 0


GROUPS = {
    "comm": ("costs.idle_wake_s", "costs.sched_slice_s", "costs.collective_latency_s", "costs.comm_cpu_s",
             "node.intra_bw", "node.intra_latency_s"),
    "compute": ("costs.compute_contention", "costs.instr_overhead_s", "costs.bwd_overhead_s", "costs.attention_eff",
                "device.peak_flops", "device.launch_overhead_s"),
}


def swapped(profile: dict, donor: dict, keys: tuple[str, ...]) -> dict:
    out = copy.deepcopy(profile)
    for key in keys:
        section, _, name = key.partition(".")
        if name not in (donor.get(section) or {}):
            raise SimexecError(f"--swap: the donor profile has no {key!r}")
        out.setdefault(section, {})[name] = copy.deepcopy(donor[section][name])
    return out


def plans(recording: Path) -> list[tuple[str, str, str, str, float]]:
    """(name, model, plan, role, median measured step seconds) per plan of the recording."""
    try:
        runs = json.loads((recording / "manifest.json").read_text())["runs"]
    except (OSError, ValueError, KeyError) as exc:
        raise SimexecError(f"--recording {recording}: no readable manifest.json with runs ({exc})") from None
    by: dict[tuple, list[float]] = {}
    for r in runs:
        by.setdefault((r["name"], r["model"], r["plan"], r["role"]), []).append(r["step_time_s"])
    return [(*k, statistics.median(v)) for k, v in by.items()]


def evaluate(rows, profile: dict) -> dict[str, float]:
    from simexec.sim.simulate import simulate

    errors: dict[str, float] = {}
    for name, model, plan, _, measured in rows:
        errors[name] = simulate(model, "local", plan, profile=profile).step_time_s / measured - 1.0
    return errors


def mape(rows, errors: dict[str, float], role: str) -> float:
    return 100.0 * statistics.fmean(abs(errors[name]) for name, _, _, r, _ in rows if r == role)


def cmd_profile_swap(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_traces.py profile-swap", description=DOCS["profile-swap"].split("\n\n")[0])
    ap.add_argument("--recording", default=str(ROOT / "traces" / "local"))
    ap.add_argument("--profile", default=str(ROOT / "traces" / "profiles" / "local-microbench.json"))
    ap.add_argument("--donor", default=str(ROOT / "traces" / "profiles" / "local-traces.json"))
    ap.add_argument("--swap", action="append", default=[], help="keys or a group (comm, compute); repeatable")
    args = ap.parse_args(argv)
    try:
        profile, donor = (json.loads(Path(p).read_text()) for p in (args.profile, args.donor))
        rows = plans(Path(args.recording))
        variants = [("as is", profile)]
        for swap in args.swap or ["comm", "compute"]:
            keys = GROUPS.get(swap) or tuple(k.strip() for k in swap.split(",") if k.strip())
            variants.append((f"with {swap}", swapped(profile, donor, keys)))
        results = [(label, evaluate(rows, p)) for label, p in variants]
    except (OSError, ValueError, SimexecError) as exc:
        print(f"probe_traces.py profile-swap: error: {exc}", file=sys.stderr)
        return 2
    print("| plan | role | measured ms | " + " | ".join(label for label, _ in results) + " |")
    print("|---|---|---|" + "---|" * len(results))
    for name, _, _, role, measured in rows:
        print(f"| `{name}` | {role} | {measured * 1e3:.1f} | "
              + " | ".join(f"{100 * errs[name]:+.1f}%" for _, errs in results) + " |")
    for role in ("calibrate", "heldout"):
        print(f"| {role} MAPE | | | " + " | ".join(f"{mape(rows, errs, role):.1f}%" for _, errs in results) + " |")
    return 0


def cmd_core_use(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_traces.py core-use", description=DOCS["core-use"].split("\n\n")[0])
    ap.add_argument("plans", nargs="+", help="plan strings, e.g. dp=4,zero=3,gbs=8,dtype=fp32")
    ap.add_argument("--profile", default=str(ROOT / "traces" / "profiles" / "local-traces.json"),
                    help="a calibrated local profile")
    ap.add_argument("--model", default="gpt-tiny")
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError
    from simexec.sim.host import model as host
    from simexec.sim.simulate import simulate

    stats: collections.Counter = collections.Counter()
    host.Cores = counting_cores(stats)  # the engine builds its cores through this name (HostCosts.cores_for)
    cols = ("step", "main CPU", "comm CPU", "busy core-s", "idle", "all cores", "wake waits")
    print(f"{'plan':36s} " + " ".join(f"{c:>11s}" for c in cols) + "   (ms)")
    for plan in args.plans:
        stats.clear()
        try:
            r = simulate(args.model, "local", plan, profile=args.profile)
        except SimexecError as exc:
            print(f"probe_traces.py core-use: error: {exc}", file=sys.stderr)
            return 2
        row = (r.step_time_s, stats["main_cpu_s"], stats["comm_cpu_s"], stats["busy_core_s"], stats["idle_s"],
               stats["full_s"], stats["wake_wait_s"])
        print(f"{plan:36s} " + " ".join(f"{1e3 * v:11.1f}" for v in row))
    return 0

COMMANDS = {"trace-sharing": cmd_trace_sharing, "time-split": cmd_time_split,
            "collective-joins": cmd_collective_joins, "recording-cpu": cmd_recording_cpu,
            "profile-swap": cmd_profile_swap, "core-use": cmd_core_use}


def main(argv: Optional[list[str]] = None) -> int:
    subcommands = "\n".join(f"  {name:18s} {DOCS[name].strip().splitlines()[0]}" for name in COMMANDS)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=subcommands,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=COMMANDS)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's arguments (SUBCOMMAND --help)")
    args = ap.parse_args(argv)
    return COMMANDS[args.command](args.args)


if __name__ == "__main__":
    raise SystemExit(main())
