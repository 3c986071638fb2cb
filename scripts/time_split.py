#!/usr/bin/env python
"""Where a step's time goes, predicted against measured: compute against communication, per plan.

    python scripts/time_split.py traces/local [--profile traces/profiles/local-traces.json]
    python scripts/time_split.py DIR            # a directory of scripts/validate_calibration.py

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
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simexec.errors import SimexecError  # noqa: E402


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


def split(trace, predicted) -> dict[str, tuple[float, float]]:
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


def instruction_times(traces) -> dict[str, list[float]]:
    """Compute events' durations (µs) by instruction kind (`bwd.fc1`, ...), over the given traces."""
    from simexec.calibrate.traces import _event_kind

    out: dict[str, list[float]] = {}
    for t in traces:
        for e in t.events:
            if e.kind == "compute" and not e.id.split(":", 1)[-1].startswith("optim"):
                out.setdefault(_event_kind(e.id), []).append(e.dur_us)
    return out


def versus(mine: dict[str, list[float]], ref: dict[str, list[float]]) -> tuple[float, float]:
    """(sum of medians, sum of means) over the kinds both ran, relative to the reference's."""
    kinds = [k for k in mine if k in ref]
    med = sum(statistics.median(mine[k]) for k in kinds) / sum(statistics.median(ref[k]) for k in kinds)
    mean = sum(statistics.fmean(mine[k]) for k in kinds) / sum(statistics.fmean(ref[k]) for k in kinds)
    return med, mean


def report(directory: Path, profile_path: Optional[Path] = None, versus_plan: Optional[str] = None) -> list[str]:
    """The table's lines; raises SimexecError for a directory, profile or trace that cannot be read."""
    from simexec.calibrate.profiles import load_profile
    from simexec.calibrate.traces import _case, predict_case
    from simexec.calibrate.evaluate import _sections
    from simexec.specs.cluster import get_cluster
    from simexec.trace.schema import Trace

    runs = _runs(directory)
    profile_path = profile_path or _default_profile(directory)
    profile = _sections(load_profile(profile_path))
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
        res = predict_case(_case(trace, str(path)), get_cluster("local"), profile, trace=True)
        parts = split(trace, res.trace)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", help="traces/<name> (a recording) or a validate_calibration.py --out directory")
    ap.add_argument("--profile", default=None, help="profile to predict with (default: the directory's trace profile)")
    ap.add_argument("--versus", default=None, metavar="PLAN", help="also compare compute instructions with this plan's")
    args = ap.parse_args(argv)
    try:
        lines = report(Path(args.directory), Path(args.profile) if args.profile else None, args.versus)
    except SimexecError as exc:
        print(f"time_split: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
