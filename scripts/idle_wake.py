#!/usr/bin/env python
"""What waking a rank costs against how long its core has idled: a gloo ping-pong after a pause.

    python scripts/idle_wake.py [--ranks 4] [--reps 40] [--gaps-ms 0,0.05,0.2,0.5,1,3,10]

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each); ranks 0 and 1 play a
4-byte ping-pong while the others wait in a barrier. Before each round trip rank 0 sleeps the gap,
so rank 1 has blocked in its receive, and its core idled, that long. Prints each gap's round trip
(median, 10th and 90th percentile). On bare metal it does not depend on the gap. On a virtual
machine a vCPU left idle past the hypervisor's poll window (KVM's `halt_poll_ns`, 200 µs) is halted
and its physical core given away, and the round trip grows by what the host takes to run it again:
the host model's `costs.idle_wake_s` (docs/calibration.md, "Waking an idle core").
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time


def _worker(rank: int, world: int, port: int, gaps: list[float], reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(1)
    for gap in gaps:
        dist.barrier()
        times = []
        if rank in (0, 1):
            for r in range(reps + 2):
                if rank == 0:
                    if gap > 0:
                        time.sleep(gap)
                    t0 = time.perf_counter()
                    dist.send(x, 1)
                    dist.recv(x, 1)
                    if r >= 2:
                        times.append(time.perf_counter() - t0)
                else:
                    dist.recv(x, 0)
                    dist.send(x, 0)
        if rank == 0:
            times.sort()
            p10, p90 = times[len(times) // 10], times[(9 * len(times)) // 10]
            print(f"gap {gap * 1e3:6.2f} ms: round trip median {statistics.median(times) * 1e3:7.3f} ms, "
                  f"p10 {p10 * 1e3:7.3f}, p90 {p90 * 1e3:7.3f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="processes; ranks 2.. wait in a barrier")
    ap.add_argument("--reps", type=int, default=40, help="round trips per gap")
    ap.add_argument("--gaps-ms", default="0,0.05,0.2,0.5,1,3,10", help="pauses before each round trip, ms")
    args = ap.parse_args(argv)
    try:
        gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    except ValueError:
        ap.error(f"--gaps-ms must be comma-separated numbers, got {args.gaps_ms!r}")
    if args.ranks < 2 or args.reps < 10 or any(g < 0 for g in gaps):
        ap.error(f"need --ranks >= 2, --reps >= 10 and gaps >= 0; got {args.ranks}, {args.reps}, {args.gaps_ms}")
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.ranks, port, gaps, args.reps), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
