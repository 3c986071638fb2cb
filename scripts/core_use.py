#!/usr/bin/env python
"""How the simulated host's cores spend a step: CPU asked for, cores busy, time idle.

    python scripts/core_use.py [--profile traces/profiles/local-traces.json] PLAN [PLAN ...]

Simulates gpt-tiny's plans on the `local` cluster under a calibrated profile and follows the host
model's cores (`simexec.sim.host.cores.Cores`) through the step: the CPU-seconds the main threads and the
communication threads ask for (every rank, before any slowdown), the core-seconds handed out (the
busy cores over time: the asked CPU times the slowdowns of busy and alternating cores), how long no
thread ran and how long every core was taken, and the waits of woken threads. A step longer than its
busy core-seconds over the cores leaves cores idle; one as long spends its time in slowdowns.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def counting_cores(stats: collections.Counter):
    """`Cores` that add up, into `stats`, what they hand out."""
    from simexec.sim.host.cores import Cores

    class CountingCores(Cores):
        def _advance(self) -> None:
            dt = self.env.now - self.t
            if dt > 0:
                stats["idle_s"] += dt if self.n == 0 else 0.0
                stats["full_s"] += dt if self.n >= self.capacity else 0.0
                stats["busy_core_s"] += dt * min(self.capacity, self.n)
            super()._advance()

        def run(self, key, seconds: float):
            k = self._weight(key)
            stats["comm_cpu_s" if isinstance(key, tuple) else "main_cpu_s"] += seconds * k
            if seconds > 0 and self.last_end.get(key) != self.env.now:
                stats["wake_wait_s"] += (self.idle_wake_wait() + self.wake_wait()) * k
            return super().run(key, seconds)

    return CountingCores


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
            print(f"core_use: error: {exc}", file=sys.stderr)
            return 2
        row = (r.step_time_s, stats["main_cpu_s"], stats["comm_cpu_s"], stats["busy_core_s"], stats["idle_s"],
               stats["full_s"], stats["wake_wait_s"])
        print(f"{plan:36s} " + " ".join(f"{1e3 * v:11.1f}" for v in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
