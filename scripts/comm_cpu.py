#!/usr/bin/env python
"""What a gloo collective costs a member's CPU, not only its wall time.

    python scripts/comm_cpu.py [--ranks 2,4] [--reps 200] [--bytes 256,16384,262144]

Spawns each number of `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each) and runs
all-reduces of each size back to back, then a ping-pong of the smallest size between ranks 0 and 1
(the others wait in a barrier). Rank 0 prints, per operation, the wall time and the CPU time its
process spent (user and system, every thread: `resource.getrusage`) and its context switches
(voluntary, involuntary). A collective hands each message between gloo's threads and the kernel;
on bare metal a hand-off costs microseconds, on this virtual machine a large part of a
millisecond of system time. The host model charges it per step of a collective to every member's
core: `costs.comm_cpu_s` (docs/calibration.md, "Communication over loopback"), which the
micro-benchmarks measure the same way (`simexec.calibrate.comm.fit_comm_cpu`).
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import time


def _usage() -> tuple[float, float, float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, float(r.ru_nvcsw), float(r.ru_nivcsw)


def _measure(op, reps: int) -> tuple[float, ...]:
    for _ in range(10):
        op()
    u0, t0 = _usage(), time.perf_counter()
    for _ in range(reps):
        op()
    wall, u1 = time.perf_counter() - t0, _usage()
    return (wall / reps, *((b - a) / reps for a, b in zip(u0, u1)))


def _row(label: str, m: tuple[float, ...]) -> str:
    wall, user, system, vol, invol = m
    return (f"{label:28s} wall {wall * 1e3:7.3f} ms  cpu {(user + system) * 1e3:7.3f} ms "
            f"(user {user * 1e3:6.3f}, system {system * 1e3:6.3f})  switches {vol:5.1f} + {invol:5.1f}")


def _worker(rank: int, world: int, port: int, sizes: list[int], reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))
        dist.barrier()
        m = _measure(lambda: dist.all_reduce(x), reps)
        if rank == 0:
            print(_row(f"{world} ranks all-reduce {nbytes} B", m), flush=True)
    x = torch.zeros(max(1, sizes[0] // 4))
    dist.barrier()
    if rank in (0, 1):
        peer = 1 - rank

        def pingpong():
            if rank == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)

        m = _measure(pingpong, reps)
        if rank == 0:
            print(_row(f"{world} ranks ping-pong {sizes[0]} B", m) + "  (a round trip: 2 messages)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4", help="comma-separated process counts")
    ap.add_argument("--reps", type=int, default=200, help="operations timed per line")
    ap.add_argument("--bytes", default="256,16384,262144", help="comma-separated all-reduce sizes")
    args = ap.parse_args(argv)
    try:
        worlds = [int(r) for r in args.ranks.split(",")]
        sizes = [int(b) for b in args.bytes.split(",")]
    except ValueError:
        ap.error(f"--ranks and --bytes must be comma-separated integers, got {args.ranks!r} and {args.bytes!r}")
    if any(w < 2 for w in worlds) or any(b < 4 for b in sizes) or args.reps < 10:
        ap.error(f"need ranks >= 2, bytes >= 4 and --reps >= 10; got {args.ranks}, {args.bytes}, {args.reps}")
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for world in worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(world, port, sizes, args.reps), nprocs=world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
