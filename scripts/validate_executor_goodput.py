"""Hold the executor's measured stragglers and failures against the simulator's and goodput model's.

    python scripts/validate_executor_goodput.py                  # a table on stdout
    python scripts/validate_executor_goodput.py --json out.json

On CPU ranks (gloo, Ray actors) of the `local` cluster, a small plan (default gpt-tiny, dp=2, two
micro-batches of 4 sequences of 64 tokens per rank: steps of about 40 ms, long enough that the host's
scheduling noise stays a small part of them):

- stragglers: `execute --slow rank:1:F` runs the plan healthy, then with rank 1 computing F times as
  long (`simexec.exec.rank.interpreter`); the measured ratio of the steady steps' median times is
  set beside `simulate --full --slow rank:1:F`'s predicted ratio for the same plan, model and cluster.
  Several rounds (each a healthy and a slowed run); the median of their ratios is reported.
- failure: `execute --checkpoint-every K --kill rank:1:step:S` kills rank 1 as it begins step S; the
  run restarts from the newest checkpoint. Measured: the restart (kill -> first restarted step
  begins) and the steps redone; predicted (`simexec.sim.goodput`): the restart measured here plus
  the steps redone at the healthy step time, and Daly's expected cost of a failure at a random time
  with that restart and the interval of K steps.

The ranks share this host's cores with whatever else runs: the load average before and after is
printed beside the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stragglers(model: str, plan: str, seq_len: int, steps: int, factor: float, rounds: int) -> dict:
    from simexec.resilience import execute_with_predictions

    runs = []
    for _ in range(rounds):
        res = execute_with_predictions(model, "local", plan, steps=steps, seq_len=seq_len, slow=f"rank:1:{factor:g}", trace=False)
        runs.append(res.reports["stragglers"])
    ratios = [r["measured_ratio"] for r in runs]
    return {"slow": f"rank:1:{factor:g}", "rounds": runs, "measured_ratios": ratios,
            "measured_ratio": statistics.median(ratios), "predicted_ratio": runs[0]["predicted_ratio"],
            "healthy_step_s": statistics.median(r["healthy_step_s"] for r in runs),
            "slowed_step_s": statistics.median(r["slowed_step_s"] for r in runs),
            "slowed_rank_cpu_ratio": statistics.median(r["slowed_rank_cpu_ratio"]["1"] for r in runs)}


def failure(model: str, plan: str, seq_len: int, steps: int, every: int, kill_step: int) -> dict:
    from simexec.exec.api import execute
    from simexec.resilience import execute_with_predictions

    with tempfile.TemporaryDirectory(prefix="simexec-ckpt-") as tmp:
        res = execute_with_predictions(model, "local", plan, steps=steps, seq_len=seq_len, checkpoint_dir=tmp, checkpoint_every=every,
                      kill=f"rank:1:step:{kill_step}", trace=False)
    rec = res.reports["recovery"]
    uninterrupted = execute(model, "local", plan, steps=steps, seq_len=seq_len, trace=False)
    rec["losses_match_uninterrupted"] = rec["losses_all_steps"] == uninterrupted.losses
    return rec


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--plan", default="dp=2,mbs=4,gbs=16,dtype=fp32")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12, help="steps of each straggler run (the first is a warm-up)")
    ap.add_argument("--factor", type=float, default=2.0, help="rank 1's compute slowdown")
    ap.add_argument("--rounds", type=int, default=3, help="healthy + slowed pairs; their median ratio is reported")
    ap.add_argument("--every", type=int, default=2, help="checkpoint every K steps")
    ap.add_argument("--kill-step", type=int, default=3, help="rank 1 dies as it begins this step")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    from simexec.exec.runtime.launcher import start_ray, stop_ray

    load_before = os.getloadavg()
    owned = start_ray()
    try:
        st = stragglers(args.model, args.plan, args.seq_len, args.steps, args.factor, args.rounds)
        rec = failure(args.model, args.plan, args.seq_len, max(args.steps, args.kill_step + 2), args.every,
                      args.kill_step)
    finally:
        stop_ray(owned)
    load_after = os.getloadavg()

    m, p = rec["measured"], rec["predicted"]
    print(f"{args.model} {args.plan} seq {args.seq_len} on local CPU ranks (gloo); load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} cores")
    print(f"stragglers {st['slow']}: healthy {st['healthy_step_s'] * 1e3:.1f} ms, slowed "
          f"{st['slowed_step_s'] * 1e3:.1f} ms (medians over {args.rounds} rounds of {args.steps - 1} steady steps)")
    print(f"  measured ratio x{st['measured_ratio']:.3f} (rounds: "
          f"{', '.join(f'{r:.3f}' for r in st['measured_ratios'])}); simulated x{st['predicted_ratio']:.3f}; "
          f"rank 1's own CPU a step x{st['slowed_rank_cpu_ratio']:.2f}")
    print(f"failure rank 1 killed at step {args.kill_step}, checkpoint every {args.every}: resumed from step "
          f"{rec['resumed_from_step']}, {rec['steps_redone']} step(s) redone; losses "
          f"{'equal' if rec['losses_match_uninterrupted'] else 'DIFFER from'} the uninterrupted run's")
    print(f"  measured: restart {m['restart_s']:.2f} s (detect {m['detect_s']:.2f}, teardown {m['teardown_s']:.2f}, "
          f"load {m['load_s']:.2f}), redo {m['redo_s']:.3f} s, lost {m['lost_s']:.2f} s; "
          f"healthy step {m['healthy_step_s'] * 1e3:.1f} ms (a start's first {m['first_step_of_a_start_s'] * 1e3:.1f} ms), "
          f"save {m['checkpoint_save_s']:.2f} s")
    print(f"  predicted with the measured restart: this kill {p['this_kill_s']:.2f} s "
          f"(redo {p['redo_s']:.3f} s; measured {100 * p['error_vs_this_kill']:+.1f}%), "
          f"a failure at a random time {p['per_failure_expected_s']:.2f} s (Daly, interval {p['interval_s']:.3f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"stragglers": st, "failure": rec, "load_average": [load_before, load_after],
                                               "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
