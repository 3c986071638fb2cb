#!/usr/bin/env python
"""Which of a profile's numbers a prediction misses: swap some in from another profile and predict again.

    python scripts/profile_swap.py [--recording traces/local] [--profile traces/profiles/local-microbench.json]
                                   [--donor traces/profiles/local-traces.json] [--swap comm] [--swap costs.idle_wake_s]

Predicts every plan of a recording (`manifest.json` of `scripts/record_traces.py`) with `--profile`, then
once per `--swap` with those numbers taken from `--donor`, and prints each plan's error against the
median of its measured rounds and the calibration and held-out plans' MAPE. A swap is comma-separated
dotted keys (`costs.idle_wake_s,node.intra_bw`) or a group: `comm` (the host model's communication
numbers) or `compute` (its compute numbers). docs/calibration_findings.md ("What limits the numbers") quotes it.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simexec.errors import SimexecError  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        print(f"profile_swap: error: {exc}", file=sys.stderr)
        return 2
    print("| plan | role | measured ms | " + " | ".join(label for label, _ in results) + " |")
    print("|---|---|---|" + "---|" * len(results))
    for name, _, _, role, measured in rows:
        print(f"| `{name}` | {role} | {measured * 1e3:.1f} | "
              + " | ".join(f"{100 * errs[name]:+.1f}%" for _, errs in results) + " |")
    for role in ("calibrate", "heldout"):
        print(f"| {role} MAPE | | | " + " | ".join(f"{mape(rows, errs, role):.1f}%" for _, errs in results) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
