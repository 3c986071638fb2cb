#!/usr/bin/env python
"""One collective timed again and again, each after a barrier: how often the host stalls it.

    python scripts/collective_series.py [--ranks 2] [--bytes 1048576] [--reps 200] [--slow-ms 2]
                                        [--compute-ms 0] [--gloo-loops idle|default]
    python scripts/collective_series.py --recording traces/local [--bytes 1048576] [--ranks 2]

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each) and times an
all-reduce of `--bytes` `--reps` times, each after a barrier and `--compute-ms` of matrix
products on every rank (as a training step calls its collectives: right after compute). A sample
is the last member's time from its call to the end, the collective's own time. Prints every
sample in order, then the median, the mean and the share of samples over `--slow-ms`.

`--gloo-loops` sets how gloo's event-loop threads are scheduled: `idle` as the executor runs them
(`simexec.exec.runtime.gloo_loops`), `default` as gloo leaves them. Under `default` the samples are
bimodal: the all-reduce runs at the speed its CPU allows, or it waits for the scheduler's next
tick while gloo's loops spin on the cores; after 20 ms of compute most samples wait
(docs/calibration_findings.md, "gloo's spinning event loop"). The environment's `SIMEXEC_GLOO_LOOPS=default`
overrides `idle`, as in the executor. `--recording` reads the same benchmark (alone after a
barrier, `solo`) from a recording's micro-benchmarks instead of running it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, world: int, port: int, nbytes: int, reps: int, compute_ms: float, loops: str, out) -> None:
    import torch
    import torch.distributed as dist

    from simexec.exec.runtime.gloo_loops import idle_gloo_loops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.barrier()
    if loops == "idle":
        idle_gloo_loops()
    x = torch.zeros(max(1, nbytes // 4))
    a = torch.randn(128, 128)
    ts = []
    for _ in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < compute_ms:
            a @ a
        t1 = time.perf_counter()
        dist.all_reduce(x)
        ts.append(time.perf_counter() - t1)
    every = [None] * world
    dist.all_gather_object(every, ts[2:])
    if rank == 0:
        out.put([min(sample) for sample in zip(*every)])
    dist.barrier()
    dist.destroy_process_group()


def measure(ranks: int, nbytes: int, reps: int, compute_ms: float = 0.0, loops: str = "idle") -> list[float]:
    from simexec.exec.runtime.spawn import spawn_ranks

    return spawn_ranks(_worker, ranks, (nbytes, reps, compute_ms, loops),
                       timeout_s=60.0 + (0.1 + compute_ms / 1e3) * reps)


def recorded(recording: Path, ranks: int, nbytes: int) -> list[float]:
    from simexec.calibrate.micro import merge_results
    from simexec.errors import SimexecError
    from simexec.trace.schema import load_json

    raw = load_json(recording / "microbench.json.gz", "micro-benchmark timings")
    recs = merge_results(raw.get("extras") or {}).get("collectives", [])
    for rec in recs:
        if (rec["verb"] == "allreduce" and rec["n"] == ranks and int(rec["bytes"]) == nbytes
                and rec.get("mode", "solo") == "solo"):
            return list(rec["t"])
    sizes = sorted({int(r["bytes"]) for r in recs if r["verb"] == "allreduce" and r["n"] == ranks})
    raise SimexecError(f"{recording}: no {ranks}-rank all-reduce of {nbytes} B (recorded: {sizes or 'none'})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--slow-ms", type=float, default=2.0, help="a sample over this many ms counts as stalled")
    ap.add_argument("--compute-ms", type=float, default=0.0, help="matrix products on every rank before each call")
    ap.add_argument("--gloo-loops", choices=("idle", "default"), default="idle",
                    help="gloo's event-loop threads at SCHED_IDLE, as the executor runs them, or as gloo leaves them")
    ap.add_argument("--recording", type=Path, default=None, help="read a recording's micro-benchmark instead")
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.bytes < 4 or args.reps < 1 or not 0 <= args.compute_ms <= 1000:
        print(f"collective_series: error: --ranks {args.ranks} (>= 2), --bytes {args.bytes} (>= 4), "
              f"--reps {args.reps} (>= 1) and --compute-ms {args.compute_ms:g} (0 to 1000)", file=sys.stderr)
        return 2
    from simexec.errors import SimexecError

    try:
        ts = recorded(args.recording, args.ranks, args.bytes) if args.recording else \
            measure(args.ranks, args.bytes, args.reps, args.compute_ms, args.gloo_loops)
    except SimexecError as exc:
        print(f"collective_series: error: {exc}", file=sys.stderr)
        return 2
    ms = [t * 1e3 for t in ts]
    print(" ".join(f"{t:.1f}" for t in ms))
    slow = sum(t > args.slow_ms for t in ms)
    how = "recorded" if args.recording else f"after {args.compute_ms:g} ms of compute, gloo loops {args.gloo_loops}"
    print(f"{args.ranks}-rank all-reduce of {args.bytes} B ({how}), {len(ms)} samples: median {statistics.median(ms):.3f} ms, "
          f"mean {statistics.fmean(ms):.3f} ms; over {args.slow_ms:g} ms: {slow} ({100.0 * slow / len(ms):.0f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
