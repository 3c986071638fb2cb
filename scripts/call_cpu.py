#!/usr/bin/env python
"""What a collective's call costs its calling thread alone: the micro-benchmarks' `issue`.

    python scripts/call_cpu.py [--reps 100]

Two gloo ranks on 127.0.0.1 (one intra-op thread, gloo's event loops at idle priority, as the
executor runs them) call an asynchronous 8 KB all-reduce together after a barrier, `--reps` times
(`simexec.calibrate.microbench._Bench.issue`); rank 0 prints the median CPU its thread spent in the call
(`time.thread_time`: torch.distributed's Python, gloo's work set up and queued), which a
micro-benchmark profile keeps as `costs.collective_issue_s`, beside an 8 KB add for scale.
"""
from __future__ import annotations

import argparse
import statistics
import sys


def _rank(rank: int, world: int, port: int, reps: int, out) -> None:
    import time

    import torch
    import torch.distributed as dist

    from simexec.calibrate.microbench import BenchConfig, _Bench

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        bench = _Bench(BenchConfig(issue_reps=reps), rank, world)
        bench.issue()
        x = torch.zeros(2048)
        adds = []
        for _ in range(reps):
            c = time.thread_time()
            torch.add(x, x)
            adds.append(time.thread_time() - c)
        if rank == 0:
            out.put({"call": bench.out["issue"][0]["cpu"], "add": adds})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args(argv)
    if args.reps < 1:
        print(f"call_cpu: error: --reps must be at least 1, got {args.reps}", file=sys.stderr)
        return 2
    from simexec.exec.runtime.spawn import spawn_ranks

    got = spawn_ranks(_rank, 2, (args.reps,), 120.0)
    print(f"an asynchronous 8 KB all-reduce's call over 2 ranks: {statistics.median(got['call']) * 1e6:.1f} µs of its "
          f"thread's CPU (median of {args.reps}); an 8 KB add: {statistics.median(got['add']) * 1e6:.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
