#!/usr/bin/env python
"""One collective timed again and again, each after a barrier: how often the host stalls it.

    python scripts/collective_series.py [--ranks 2] [--bytes 1048576] [--reps 200] [--slow-ms 2]
    python scripts/collective_series.py --recording traces/local [--bytes 1048576] [--ranks 2]

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each) and times an
all-reduce of `--bytes` `--reps` times, each after a barrier, on rank 0. Prints every sample in
order, then the median, the mean and the share of samples over `--slow-ms`. On this VM the
samples are bimodal: the all-reduce either runs at the speed its CPU allows or a few milliseconds
later, and the slow ones come in runs, at a rate that changes over minutes with the host's other
tenants (docs/calibration.md, "The loopback copy rate held at its measurement"). `--recording`
reads the same benchmark (alone after a barrier, `solo`) from a recording's micro-benchmarks
instead of running it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, world: int, port: int, nbytes: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.zeros(max(1, nbytes // 4))
    ts = []
    for _ in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        ts.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(ts[2:])
    dist.barrier()
    dist.destroy_process_group()


def measure(ranks: int, nbytes: int, reps: int) -> list[float]:
    from simexec.exec.spawn import spawn_ranks

    return spawn_ranks(_worker, ranks, (nbytes, reps), timeout_s=60.0 + 0.1 * reps)


def recorded(recording: Path, ranks: int, nbytes: int) -> list[float]:
    from simexec.calibrate_micro import merge_results
    from simexec.errors import SimexecError
    from simexec.trace import load_json

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
    ap.add_argument("--recording", type=Path, default=None, help="read a recording's micro-benchmark instead")
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.bytes < 4 or args.reps < 1:
        print(f"collective_series: error: --ranks {args.ranks} (>= 2), --bytes {args.bytes} (>= 4) and "
              f"--reps {args.reps} (>= 1)", file=sys.stderr)
        return 2
    from simexec.errors import SimexecError

    try:
        ts = recorded(args.recording, args.ranks, args.bytes) if args.recording else measure(args.ranks, args.bytes,
                                                                                              args.reps)
    except SimexecError as exc:
        print(f"collective_series: error: {exc}", file=sys.stderr)
        return 2
    ms = [t * 1e3 for t in ts]
    print(" ".join(f"{t:.1f}" for t in ms))
    slow = sum(t > args.slow_ms for t in ms)
    print(f"{args.ranks}-rank all-reduce of {args.bytes} B, {len(ms)} samples: median {statistics.median(ms):.3f} ms, "
          f"mean {statistics.fmean(ms):.3f} ms; over {args.slow_ms:g} ms: {slow} ({100.0 * slow / len(ms):.0f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
