#!/usr/bin/env python
"""What a blocking wait costs the thread that waits, in CPU, not only in wall time.

    python scripts/wake_cpu.py [--ranks 2] [--iters 200] [--rounds 5] [--bytes 16384]

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each) that loop over k
matrix products (128 x 128, k = 1, 4, 16) followed by nothing, by an all-reduce of `--bytes`, or
by a 0.3 ms sleep, rounds interleaved. Rank 0 prints each loop's wall time and its main thread's
CPU time (`time.thread_time`: that thread alone, not gloo's) per iteration, medians over rounds,
and what the all-reduce and the sleep add to the main thread's CPU. gloo's main thread blocks in
a collective without spinning; what it pays is waking up again (the scheduler, and on a virtual
machine a halted vCPU's exit and entry) and refilling its caches. The host model charges a
collective's CPU to the communication thread (`costs.comm_cpu_s`) and the main thread only its
interpreter's Python around the call (docs/calibration_findings.md).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

MODES = ("none", "allreduce", "sleep")
KS = (1, 4, 16)


def _rank(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    x = torch.ones(max(1, args.bytes // 4))
    res: dict = {}
    for _ in range(args.rounds):
        for k in KS:
            for mode in MODES:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(args.iters):
                    for _ in range(k):
                        a @ b
                    if mode == "allreduce":
                        dist.all_reduce(x)
                    elif mode == "sleep":
                        time.sleep(3e-4)
                res.setdefault((k, mode), []).append(((time.perf_counter() - t0) / args.iters,
                                                      (time.thread_time() - c0) / args.iters))
    if rank == 0:
        med = {key: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for key, v in res.items()}
        print(f"{world} ranks, {args.bytes} B all-reduce, {args.iters} iterations x {args.rounds} rounds (medians, us)")
        print(f"{'k':>3} {'mode':<10} {'wall':>9} {'main CPU':>9} {'added CPU':>10}")
        for k in KS:
            for mode in MODES:
                w, c = med[(k, mode)]
                added = c - med[(k, "none")][1]
                print(f"{k:>3} {mode:<10} {w * 1e6:9.1f} {c * 1e6:9.1f} {'' if mode == 'none' else f'{added * 1e6:10.1f}'}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bytes", type=int, default=16384)
    args = ap.parse_args(argv)
    if args.ranks < 2 or args.iters < 1 or args.rounds < 1 or args.bytes < 4:
        ap.error(f"need --ranks >= 2, --iters >= 1, --rounds >= 1, --bytes >= 4 (got {args.ranks}, {args.iters}, "
                 f"{args.rounds}, {args.bytes})")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_rank, args=(args.ranks, port, args), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
