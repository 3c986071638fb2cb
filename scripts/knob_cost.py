#!/usr/bin/env python
"""What one plan knob changes in a step on this machine, measured and predicted.

    python scripts/knob_cost.py [--knob grad_fp32=1] [--rounds 3] [--steps 12] [--seq-len 64] [--profile P] [PLAN ...]

Runs each plan (gpt-tiny, local Ray CPU ranks) with and without the knob (`--knob`, a plan
fragment: `grad_fp32=1`, main gradients under bf16, by default; `param_overlap=1` for ZeRO-1/2
plans), the two interleaved for `--rounds` rounds, and prints the median step time of each, the
measured ratio and the simulator's ratio under the calibrated profile (default
traces/profiles/local-traces.json). The ratios are what to read: a shared host moves absolute step
times by tens of percent between rounds. Plans default to three bf16 ones for `grad_fp32`, three
ZeRO-1/2 ones for `param_overlap` and three tp ones for `tp_overlap` (docs/executor.md quotes them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_PLANS = {
    "grad_fp32=1": ("dp=2,gbs=8,dtype=bf16", "dp=4,zero=2,gbs=8,dtype=bf16", "dp=4,zero=3,gbs=8,dtype=bf16"),
    "param_overlap=1": ("dp=2,zero=1,gbs=8", "dp=4,zero=1,gbs=8", "dp=4,zero=2,gbs=8"),
    "tp_overlap=1": ("tp=2,gbs=8", "dp=2,tp=2,gbs=8", "tp=2,sp=1,gbs=8"),
}

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("plans", nargs="*", help="plan strings (default: three for the knob)")
ap.add_argument("--knob", default="grad_fp32=1", help="plan fragment added to each plan (default grad_fp32=1)")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--steps", type=int, default=12, help="steps per run (the executor's median after the warm-up)")
ap.add_argument("--seq-len", type=int, default=64)
ap.add_argument("--profile", default=str(ROOT / "traces" / "profiles" / "local-traces.json"))


def main(argv=None) -> int:
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        ap.error(f"need --rounds >= 1 and --steps >= 2; got {args.rounds} and {args.steps}")
    plans = args.plans or DEFAULT_PLANS.get(args.knob)
    if not plans:
        ap.error(f"no default plans for --knob {args.knob}; give plans ({', '.join(DEFAULT_PLANS)} have defaults)")
    from simexec.calibrate.runs import Session
    from simexec.errors import SimexecError
    from simexec.specs.model import get_model
    from simexec.sim.simulate import simulate

    knob = "," + args.knob.strip(",")
    model = get_model("gpt-tiny")
    try:
        predicted = {p: simulate(model, "local", p, seq_len=args.seq_len, profile=args.profile).step_time_s
                     for base in plans for p in (base, base + knob)}
        measured: dict[str, list[float]] = {p: [] for p in predicted}
        with Session() as s:
            for _ in range(args.rounds):
                for p in predicted:
                    m = s.execute(model, p, steps=args.steps, seq_len=args.seq_len)
                    measured[p].append(m.step_time_s)
    except SimexecError as exc:
        print(f"knob_cost: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'plan':34s} {'measured ms':>12s} {'with ' + args.knob:>18s} {'ratio':>7s} {'predicted ratio':>16s}")
    for base in plans:
        a, b = statistics.median(measured[base]), statistics.median(measured[base + knob])
        print(f"{base:34s} {a * 1e3:12.1f} {b * 1e3:18.1f} {b / a:7.3f} "
              f"{predicted[base + knob] / predicted[base]:16.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
