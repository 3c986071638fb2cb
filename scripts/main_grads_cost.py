#!/usr/bin/env python
"""What main gradients (`grad_fp32=1` under bf16) cost a step on this machine, measured and predicted.

    python scripts/main_grads_cost.py [--rounds 3] [--steps 12] [--seq-len 64] [--profile P] [PLAN ...]

Runs each plan (gpt-tiny, local Ray CPU ranks) with and without `grad_fp32=1`, the two interleaved
for `--rounds` rounds, and prints the median step time of each, the measured ratio and the
simulator's ratio under the calibrated profile (default traces/profiles/local-traces.json). The
ratios are what to read: a shared host moves absolute step times by tens of percent between rounds.
The simulator prices the executor's per-gradient hook at `simexec.sim.host.MAIN_GRAD_OPS`
operators (docs/executor.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_PLANS = ("dp=2,gbs=8,dtype=bf16", "dp=4,zero=2,gbs=8,dtype=bf16", "dp=4,zero=3,gbs=8,dtype=bf16")
MAIN = ",grad_fp32=1"

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("plans", nargs="*", default=list(DEFAULT_PLANS), help="bf16 plan strings (default: three)")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--steps", type=int, default=12, help="steps per run (the executor's median after the warm-up)")
ap.add_argument("--seq-len", type=int, default=64)
ap.add_argument("--profile", default=str(ROOT / "traces" / "profiles" / "local-traces.json"))


def main(argv=None) -> int:
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        ap.error(f"need --rounds >= 1 and --steps >= 2; got {args.rounds} and {args.steps}")
    from simexec.calibrate_runs import Session
    from simexec.errors import SimexecError
    from simexec.model import get_model
    from simexec.simulate import simulate

    model = get_model("gpt-tiny")
    try:
        predicted = {p: simulate(model, "local", p, seq_len=args.seq_len, profile=args.profile).step_time_s
                     for base in args.plans for p in (base, base + MAIN)}
        measured: dict[str, list[float]] = {p: [] for p in predicted}
        with Session() as s:
            for _ in range(args.rounds):
                for p in predicted:
                    m = s.execute(model, p, steps=args.steps, seq_len=args.seq_len)
                    measured[p].append(m.step_time_s)
    except SimexecError as exc:
        print(f"main_grads_cost: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'plan':34s} {'measured ms':>12s} {'with grad_fp32':>15s} {'ratio':>7s} {'predicted ratio':>16s}")
    for base in args.plans:
        a, b = statistics.median(measured[base]), statistics.median(measured[base + MAIN])
        print(f"{base:34s} {a * 1e3:12.1f} {b * 1e3:15.1f} {b / a:7.3f} "
              f"{predicted[base + MAIN] / predicted[base]:16.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
