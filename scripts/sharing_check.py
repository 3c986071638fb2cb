#!/usr/bin/env python
"""Does the sharing micro-benchmark see the compute contention the data-parallel plans see?

    python scripts/sharing_check.py [--rounds 4]

In one Ray session, alternating, each round measures
- the sharing benchmark's own workload: the one-rank gpt-tiny program on one rank, then on two
  ranks at once (`simexec.calibrate.microbench`, steps 8-15 of 16), and
- the plans: `dp=1` and `dp=2` at global batch 8, their compute instructions summed over the
  traced step (every rank),
and prints each pair's ratio. `compute_contention` comes from the first; the trace fit sees the
second. If the benchmark missed something the plans have, the first ratio would stay below the
second round after round; docs/calibration_findings.md ("What limits the numbers") quotes a run.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _one_rank_steps(rp, instrs, *, steps, groups, tracer, device, seed=0, active=1):
    """A runner for `execute`: the first `active` ranks step the one-rank program, the rest wait."""
    import torch
    import torch.distributed as dist

    from simexec.exec.rank.interpreter import run_rank
    from simexec.calibrate.microbench import _one_rank_program, _StepClock, _sync

    rp1, instrs1 = _one_rank_program("gpt-tiny")
    times = []
    _sync()
    if dist.get_rank() < active:
        out = run_rank(rp1, instrs1, steps=16, groups=None, tracer=_StepClock(), device=torch.device("cpu"))
        times = out["step_times_s"][8:]
    _sync()
    return {"losses": [], "step_times_s": [1.0], "peak_memory_bytes": 0, "extra": {"t": times}}


def _compute_ms(result) -> float:
    return sum(e.dur_us for e in result.trace.events if e.kind == "compute" and e.op != "optimizer") / 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from simexec.calibrate.runs import Session

    with Session() as s:
        for _ in range(args.rounds):
            bench = []
            for active in (1, 2):
                m = s.execute("gpt-tiny", "dp=2,gbs=2,dtype=fp32", steps=1,
                              runner=functools.partial(_one_rank_steps, active=active))
                bench.append(statistics.fmean(t for e in m.result.extra.values() for t in e["t"]))
            one, two = (s.execute("gpt-tiny", f"dp={n},gbs=8,dtype=fp32", steps=16) for n in (1, 2))
            print(f"benchmark, 2 ranks / 1: {bench[1] / bench[0]:.2f}x   "
                  f"plans, dp=2 / dp=1 compute: {_compute_ms(two.result) / _compute_ms(one.result):.2f}x   "
                  f"(steps {one.step_time_s * 1e3:.0f} and {two.step_time_s * 1e3:.0f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
