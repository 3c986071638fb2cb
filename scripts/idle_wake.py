#!/usr/bin/env python
"""What waking a rank costs against how long its core has idled: a gloo ping-pong after a pause.

    python scripts/idle_wake.py [--ranks 4] [--reps 40] [--gaps-ms 0,0.05,0.2,0.5,1,3,10]
    python scripts/idle_wake.py --pipe --gaps-ms 0.02,0.1,0.2,0.5,1,2,5,20,100

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each); ranks 0 and 1 play a
4-byte ping-pong while the others wait in a barrier. Before each round trip rank 0 sleeps the gap,
so rank 1 has blocked in its receive, and its core idled, that long. Prints each gap's round trip
(median, 10th and 90th percentile). On bare metal it does not depend on the gap. On a virtual
machine a vCPU left idle past the hypervisor's poll window (KVM's `halt_poll_ns`, 200 µs) is halted
and its physical core given away, and the round trip grows by what the host takes to run it again:
the host model's `costs.idle_wake_s` (docs/calibration.md, "Waking an idle core").

`--pipe` times the wake-up alone, without gloo: one process blocks on a pipe while the other,
on the other core, spins for the gap and then writes its clock; the reader prints how long it took
to run again (median, 10th and 90th percentile), then the fit `a + b (1 - exp(-gap / tau))` over
the gaps (`scipy.optimize.curve_fit` on the medians): `tau` is the window the host model takes as
`costs.idle_poll_s`.
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


def pipe_wakeups(gaps: list[float], reps: int) -> list[float]:
    """Median wake-up of a process blocked on a pipe after its core idled each gap (seconds)."""
    import struct

    r_wake, w_wake = os.pipe()
    r_go, w_go = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer, on core 1: spins (keeping its core busy) for the gap, then writes
        os.sched_setaffinity(0, {1})
        for gap in gaps:
            for _ in range(reps):
                os.read(r_go, 1)
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < gap:
                    pass
                os.write(w_wake, struct.pack("d", time.perf_counter()))
        os._exit(0)
    os.sched_setaffinity(0, {0})
    medians = []
    for gap in gaps:
        times = []
        for _ in range(reps):
            os.write(w_go, b"x")
            (sent,) = struct.unpack("d", os.read(r_wake, 8))
            times.append(time.perf_counter() - sent)
        times.sort()
        medians.append(statistics.median(times))
        print(f"idle {gap * 1e3:7.2f} ms: wake-up median {medians[-1] * 1e6:7.1f} us, "
              f"p10 {times[len(times) // 10] * 1e6:7.1f}, p90 {times[(9 * len(times)) // 10] * 1e6:7.1f}", flush=True)
    os.waitpid(pid, 0)
    return medians


def fit_window(gaps: list[float], wakes: list[float]) -> tuple[float, float, float]:
    """(a, b, tau) of `a + b (1 - exp(-gap / tau))` through the median wake-ups."""
    import numpy as np
    from scipy.optimize import curve_fit

    x, y = np.asarray(gaps), np.asarray(wakes)
    (a, b, tau), _ = curve_fit(lambda g, a, b, tau: a + b * (1.0 - np.exp(-g / tau)), x, y,
                               p0=(float(y.min()), float(y.max() - y.min()), 1e-3),
                               bounds=([0.0, 0.0, 1e-6], [1.0, 1.0, 10.0]))
    return float(a), float(b), float(tau)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="processes; ranks 2.. wait in a barrier")
    ap.add_argument("--reps", type=int, default=40, help="round trips per gap")
    ap.add_argument("--gaps-ms", default="0,0.05,0.2,0.5,1,3,10", help="pauses before each round trip, ms")
    ap.add_argument("--pipe", action="store_true", help="time the wake-up alone, over a pipe, and fit its window")
    args = ap.parse_args(argv)
    try:
        gaps = [float(g) / 1e3 for g in args.gaps_ms.split(",")]
    except ValueError:
        ap.error(f"--gaps-ms must be comma-separated numbers, got {args.gaps_ms!r}")
    if args.ranks < 2 or args.reps < 10 or any(g < 0 for g in gaps):
        ap.error(f"need --ranks >= 2, --reps >= 10 and gaps >= 0; got {args.ranks}, {args.reps}, {args.gaps_ms}")
    if args.pipe:
        if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
            ap.error("--pipe needs Linux and two cores (one process on each)")
        a, b, tau = fit_window(gaps, pipe_wakeups(gaps, args.reps))
        print(f"fit: {a * 1e6:.1f} us + {b * 1e6:.1f} us x (1 - exp(-idle / {tau * 1e3:.2f} ms))")
        return 0
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.ranks, port, gaps, args.reps), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
