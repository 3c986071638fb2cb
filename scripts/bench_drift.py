#!/usr/bin/env python
"""Do the micro-benchmarks and the plans see the same host? Run them side by side, alternating.

    python scripts/bench_drift.py [--rounds 3]

In one Ray session, each round runs the micro-benchmarks' one-rank step (`simexec.calibrate.microbench`:
gpt-tiny at micro-batch 1, two micro-batches and the optimizer step, every instruction timed; the
other benchmarks cut to a token size) and then the `dp=1` plan (global batch 8: eight
micro-batches), and prints the benchmark's step (the median over its timed steps of the summed
instruction times) against the plan's equivalent (its steady step less the optimizer step, per two
micro-batches, plus the optimizer step). Apart, the two drift with the host (docs/calibration.md,
"When they run"); side by side they should agree.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLAN = "dp=1,gbs=8,dtype=fp32"


def _bench_step(extra: dict) -> float:
    from simexec.calibrate.micro import merge_results

    recs = merge_results({str(k): v for k, v in extra.items()})["blocks"][0]["records"]
    return statistics.median(sum(r["t"][i] for r in recs) for i in range(len(recs[0]["t"])))


def _plan_equivalent(result) -> float:
    """The plan's steady step as two micro-batches and one optimizer step (from its trace)."""
    from simexec.calibrate.traces import steady_step

    step = steady_step(result.step_times_s, result.step_time_s)
    events = result.trace.events
    optim = sum(e.dur_us for e in events if e.phase == "optim") / 1e6
    micro = len({e.mb for e in events if e.mb >= 0})
    return (step - optim) * 2 / micro + optim


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from simexec.calibrate.runs import Session
    from simexec.calibrate.microbench import BenchConfig, run_microbench

    cfg = BenchConfig(gemm=(), attention=(), elementwise=(), copy_bytes=(), collective_bytes=(256,),
                      verbs=("allreduce",), p2p_bytes=(256,), block_models=(), block_mbs=(1,),
                      interleave_gemms=(1,), interleave_bytes=(16384,), interleave_iters=4, pingpong_s=0.1,
                      sharing_rounds=1)
    runner = functools.partial(run_microbench, config=cfg)
    t0 = time.perf_counter()
    with Session() as sess:
        for r in range(args.rounds):
            bench = _bench_step(sess.execute("gpt-tiny", "dp=4,gbs=4,dtype=fp32", steps=1, runner=runner,
                                             timeout_s=600.0).result.extra)
            plan = _plan_equivalent(sess.execute("gpt-tiny", PLAN, steps=16).result)
            print(f"[{time.perf_counter() - t0:6.1f} s] round {r}: benchmark step {bench * 1e3:.2f} ms, "
                  f"`{PLAN}` as the same work {plan * 1e3:.2f} ms, ratio {bench / plan:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
