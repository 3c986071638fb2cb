#!/usr/bin/env python
"""How much CPU a plan's ranks use per step on this machine, against the cores they have.

    python scripts/plan_cpu.py [--steps 16] [--rounds 2] PLAN [PLAN ...]

Runs each plan (gpt-tiny, local Ray CPU ranks, one warm-up run first) and reads the rank processes'
user + system time from /proc/<pid>/stat before and after: CPU-seconds per step and the cores busy
on average. Every thread of a rank counts: its main thread's compute and gloo's communication
threads. The simulator's counterpart is the core time the host model hands out in a step
(compute instructions plus every collective step's burst, `simexec.sim.host.cores.Cores.run`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids) -> float:
    """User + system time of these processes so far (0 for one that has gone)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", nargs="+", help="plan strings, e.g. dp=4,zero=3,gbs=8,dtype=fp32")
    ap.add_argument("--steps", type=int, default=16, help="steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per plan")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        ap.error(f"need --steps >= 2 and --rounds >= 1; got {args.steps} and {args.rounds}")
    from simexec.calibrate.runs import Session
    from simexec.errors import SimexecError

    try:
        with Session() as s:
            for plan in args.plans:
                s.execute("gpt-tiny", plan, steps=3)
            print(f"{'plan':34s} {'step ms':>8s} {'CPU ms/step':>12s} {'cores busy':>11s}")
            for _ in range(args.rounds):
                for plan in args.plans:
                    pids = s.pool.pids()
                    c0, w0 = cpu_seconds(pids), time.perf_counter()
                    m = s.execute("gpt-tiny", plan, steps=args.steps)
                    c1, w1 = cpu_seconds(pids), time.perf_counter()
                    used = c1 - c0
                    print(f"{plan:34s} {m.step_time_s * 1e3:8.1f} {used / args.steps * 1e3:12.1f} "
                          f"{used / (w1 - w0):11.2f}", flush=True)
    except SimexecError as exc:
        print(f"plan_cpu: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
