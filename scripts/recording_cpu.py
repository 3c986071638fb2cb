#!/usr/bin/env python
"""Where a recording's CPU goes a step, measured against predicted, plan by plan.

    python scripts/recording_cpu.py [traces/local-sched-idle] [--profile PROFILE] [--plans dp2,tp4]

For each plan of a recording (`manifest.json`, as `scripts/record_traces.py` writes it; the first
round of each) whose traces timed their ranks' CPU: the rank's main thread's CPU a step, every
thread's (main and gloo's), the cores' worth busy and the step time, predicted (every rank
simulated under the profile, in the run's conditions: `simexec.calibrate.traces.predict_case`)
against measured (`simexec.trace.compare.cpu_of`). The profile defaults to the recording's trace profile,
`traces/profiles/<recording>-traces.json`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rows(recording: Path, profile: dict, plans: tuple[str, ...] = ()) -> list[dict]:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recording", nargs="?", default=str(ROOT / "traces" / "local-sched-idle"))
    ap.add_argument("--profile", help="trace profile (default: traces/profiles/<recording>-traces.json)")
    ap.add_argument("--plans", default="", help="comma-separated plan names of the manifest (default: all)")
    args = ap.parse_args(argv)
    recording = Path(args.recording)
    profile_path = Path(args.profile) if args.profile else ROOT / "traces" / "profiles" / f"{recording.name}-traces.json"
    if not (recording / "manifest.json").is_file():
        print(f"recording_cpu: {recording} holds no manifest.json (a directory scripts/record_traces.py wrote)",
              file=sys.stderr)
        return 2
    from simexec.calibrate.profiles import load_profile
    from simexec.errors import SimexecError

    plans = tuple(p for p in args.plans.split(",") if p)
    try:
        profile = {k: v for k, v in load_profile(profile_path).items() if k in ("costs", "device", "node")}
        got = rows(recording, profile, plans)
    except SimexecError as exc:
        print(f"recording_cpu: {exc}", file=sys.stderr)
        return 2
    if not got:
        print(f"recording_cpu: no plan of {recording} {'named ' + args.plans + ' ' if plans else ''}timed its "
              "ranks' CPU", file=sys.stderr)
        return 2
    print(f"{recording} under {profile_path}: a rank a step, predicted / measured")
    print(f"{'plan':14s} {'role':9s} {'main thread ms':>15s} {'all threads ms':>15s} {'cores busy':>11s} {'step ms':>15s}")
    for r in got:
        p, m = r["predicted"], r["measured"]
        print(f"{r['name']:14s} {r['role']:9s} {1e3 * p['main_thread_s']:6.1f} / {1e3 * m['main_thread_s']:6.1f} "
              f"{1e3 * p['per_rank_s']:6.1f} / {1e3 * m['per_rank_s']:6.1f} {p['cores_busy']:4.2f} / {m['cores_busy']:4.2f} "
              f"{1e3 * r['step'][0]:6.1f} / {1e3 * r['step'][1]:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
