#!/usr/bin/env python
"""How many collectives of one gloo process group run at once: time async collectives issued together.

    python scripts/gloo_threads.py [--ranks 4] [--kb 200] [--reps 20]

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each), then, between
barriers, issues 1 or 4 all-gathers, a reduce-scatter with three all-gathers behind it, and so on,
all `async_op=True` on one group, and waits for them in order. Prints the median time at which
each has ended (ms after the issue). If the group ran one collective at a time, four all-gathers
would end at 1x, 2x, 3x and 4x one alone; gloo's two worker threads per group
(`ProcessGroupGloo`'s default) end them in pairs. The simulator's `costs.collective_threads`
(docs/cluster.md) is that number. Also shows that a gloo reduce-scatter's work does not report
completion before `wait()` (which copies its slice out), and how long an all-reduce of the
gathered size takes alone and beside an all-gather (ZeRO-3's backward: the executor's
reduce-scatter of one layer's gradients beside the gather of the next layer's parameters).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time


def _worker(rank: int, world: int, port: int, numel: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    x, gathered = torch.ones(numel), torch.empty(numel * world)
    rs_in, rs_out = torch.ones(numel * world), torch.empty(numel)

    def ag():
        return dist.all_gather_into_tensor(gathered, x, async_op=True)

    def red():
        return rs(rs_out, rs_in, async_op=True)

    def ar():  # the whole tensor: how the executor reduce-scatters on gloo (simexec.exec.rank.collectives)
        return dist.all_reduce(rs_in, async_op=True)

    cases = [("1 all-gather", lambda: [ag()]), ("1 reduce-scatter", lambda: [red()]),
             ("4 all-gathers", lambda: [ag() for _ in range(4)]),
             ("reduce-scatter, 3 all-gathers", lambda: [red()] + [ag() for _ in range(3)]),
             ("3 reduce-scatters", lambda: [red() for _ in range(3)]),
             ("1 all-reduce", lambda: [ar()]), ("all-reduce, all-gather", lambda: [ar(), ag()])]
    for label, issue in cases:
        ends = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            works = issue()
            row = []
            for w in works:
                w.wait()
                row.append(time.perf_counter() - t0)
            ends.append(row)
        med = [statistics.median(r[i] for r in ends) * 1e3 for i in range(len(ends[0]))]
        if rank == 0:
            print(f"{label:32s} ends at " + ", ".join(f"{m:.2f}" for m in med) + " ms", flush=True)
    dist.barrier()
    w = red()
    time.sleep(0.2)
    done = w.is_completed()
    w.wait()
    if rank == 0:
        print(f"a reduce-scatter reports completion 200 ms after its issue, before wait(): {done}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kb", type=float, default=200.0, help="each rank's all-gather input, KB (fp32)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.ranks, port, int(args.kb * 1024 / 4), args.reps), nprocs=args.ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
