"""Benchmark of `simexec search`: wall time and plans per second for one search.

Default: Llama-3-70B on 128 nodes x 8 H100 (1,024 GPUs) with 4M-token global batches (gbs 1024,
sequence 4096), the case of issue 8 (target: under 60 s on a 2-core machine).

    python scripts/bench_search.py                      # the default case, local processes
    python scripts/bench_search.py --workers 1          # in one process
    python scripts/bench_search.py --model gpt3-1.3b --cluster dgx-a100-80g --gbs 16 --seq-len 2048
    python scripts/bench_search.py --json bench.json    # the figures (and the search result) as JSON

Reports: the space (valid plans, how many the memory bound ruled out, how many the time bound
pruned), the simulations run, wall time split into bounding and simulating, valid plans settled per
second (bounded, pruned or simulated) and simulations per second.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.outputs import outputs_refused, write_atomic  # noqa: E402
from simexec.search.driver import parse_fix, search  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--cluster", default="128xdgx-h100")
    ap.add_argument("--gbs", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--fix", default=None, help="plan fields to pin, e.g. tp=8,pp=4")
    ap.add_argument("--workers", type=int, default=None, help="local processes (default: CPU count)")
    ap.add_argument("--repeat", type=int, default=1, help="run the search this many times; report each")
    ap.add_argument("--json", default=None, help="write figures and the last result here")
    ap.add_argument("--progress", action="store_true", help="show the progress bar")
    args = ap.parse_args()
    if outputs_refused("bench_search.py", {"--json": args.json}):
        return 2

    fix = parse_fix(args.fix) if args.fix else None
    runs = []
    res = None
    for i in range(args.repeat):
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        res = search(args.model, args.cluster, args.gbs, seq_len=args.seq_len, top=args.top, fix=fix,
                     workers=args.workers, progress=args.progress)
        wall = time.perf_counter() - t0
        runs.append({
            "wall_s": wall, "bound_s": res.bound_s, "simulate_s": wall - res.bound_s, "driver_cpu_s": time.process_time() - cpu0, "valid_plans": res.candidates,
            "oom_by_bound": res.oom_bound, "pruned": res.pruned, "simulated": res.evaluated,
            "plans_per_s": res.candidates / wall, "simulations_per_s": res.evaluated / wall,
            "best": res.plans[0]["plan"] if res.plans else None,
            "best_step_time_s": res.plans[0]["step_time_s"] if res.plans else None,
            "workers": res.workers, "backend": res.backend,
        })
        r = runs[-1]
        print(f"run {i + 1}: {args.model} on {args.cluster}, gbs {args.gbs}, seq {args.seq_len}: "
              f"{r['wall_s']:.1f} s wall with {r['workers']} worker(s), backend {r['backend']} "
              f"({r['bound_s']:.1f} s enumerating and bounding, {r['simulate_s']:.1f} s simulating)")
        print(f"  {res.space:,} combinations, {res.candidates:,} valid plans: {res.oom_bound:,} cannot fit (bound), "
              f"{res.pruned:,} pruned (time bound), {res.evaluated:,} simulated")
        print(f"  {r['plans_per_s']:,.0f} plans settled per second, {r['simulations_per_s']:.1f} simulations per second")
        print(f"  best: {r['best']}  ({r['best_step_time_s']:.4g} s/step)" if r["best"] else "  nothing fits")
    print()
    print(res.format())
    if args.json:
        out = {"case": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                "platform": platform.platform()},
               "runs": runs, "result": res.to_json()}
        write_atomic(args.json, json.dumps(out, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
