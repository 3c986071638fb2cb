"""How fast the simulator runs: wall time and simulated instructions per second (one core).

    python scripts/bench_sim.py                 # every case, median of 3
    python scripts/bench_sim.py --repeat 5 --json bench.json
    python scripts/bench_sim.py --only 70b

For each case: lowering time, simulation time (engine + memory + breakdown), instructions,
instructions per second of simulation, and the predicted step time and MFU (so a speed-up that
changes the answer shows). Full mode (every rank) runs where the program stays small enough.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.specs.cluster import get_cluster  # noqa: E402
from simexec.program.lower import lower  # noqa: E402
from simexec.specs.model import get_model  # noqa: E402
from simexec.outputs import outputs_refused, write_atomic  # noqa: E402
from simexec.specs.plan import load_plan, resolve  # noqa: E402
from simexec.sim.simulate import simulate_program  # noqa: E402

# Llama 3.1 405B has 126 layers: 16 stages of 8, less one layer on the first and the last stage
# (they hold the embedding and the head), as the Llama 3 paper balances its pipeline.
_STAGES_405B = ",".join(["7"] + ["8"] * 14 + ["7"])

CASES = [
    # name, model, cluster, plan, seq_len, full mode feasible
    ("7b", "llama2-7b", "1xdgx-a100-80g", "dp=8,zero=3,gbs=64", 4096, True),
    ("70b", "llama3-70b", "128xdgx-h100", "dp=16,tp=8,pp=8,gbs=1024,schedule=1f1b", 8192, False),
    ("405b", "llama3-405b", "2048xdgx-h100", f"tp=8,pp=16,gbs=2048,stages={_STAGES_405B}", 8192, False),
]


def bench(model: str, cluster: str, plan: str, seq_len: int, symmetric: bool, repeat: int) -> dict:
    rp = resolve(get_model(model), get_cluster(cluster), load_plan(plan), seq_len)
    lowers, sims, result, n = [], [], None, 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        program = lower(rp, symmetric=symmetric)
        t1 = time.perf_counter()
        result = simulate_program(rp, program)
        t2 = time.perf_counter()
        lowers.append(t1 - t0)
        sims.append(t2 - t1)
        n = len(program)
    sim = statistics.median(sims)
    return {
        "model": model, "cluster": cluster, "plan": plan, "seq_len": seq_len, "world": rp.world,
        "mode": "symmetric" if symmetric else "full", "instructions": n,
        "lower_s": statistics.median(lowers), "simulate_s": sim, "instructions_per_s": n / sim,
        "step_time_s": result.step_time_s, "mfu": result.mfu, "peak_memory_gib": result.peak_memory_bytes / 2**30,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the median is reported")
    ap.add_argument("--only", action="append", help="case names to run (7b, 70b, 405b)")
    ap.add_argument("--json", dest="json_path", help="also write the rows as JSON")
    args = ap.parse_args()
    if outputs_refused("bench_sim.py", {"--json": args.json_path}):
        return 2
    rows = []
    print(f"{'case':<6} {'mode':<9} {'ranks':>6} {'instrs':>9} {'lower s':>8} {'sim s':>7} {'instr/s':>9} "
          f"{'step s':>8} {'MFU':>6}")
    for name, model, cluster, plan, seq, full_ok in CASES:
        if args.only and name not in args.only:
            continue
        for symmetric in (True, False):
            if not symmetric and not full_ok:
                continue
            row = dict(case=name, **bench(model, cluster, plan, seq, symmetric, args.repeat))
            rows.append(row)
            print(f"{name:<6} {row['mode']:<9} {row['world']:>6} {row['instructions']:>9,} {row['lower_s']:>8.3f} "
                  f"{row['simulate_s']:>7.3f} {row['instructions_per_s']:>9,.0f} {row['step_time_s']:>8.3f} "
                  f"{100 * row['mfu']:>5.1f}%", flush=True)
    if args.json_path:
        write_atomic(args.json_path, json.dumps(rows, indent=1).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
