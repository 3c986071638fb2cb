"""Measure this CPU host the way the executor uses it, against what the simulator's host model charges.

    python scripts/probe_host.py SUBCOMMAND [ARGS]      # SUBCOMMAND --help says what each measures
    python scripts/probe_host.py --help                 # the subcommands, one line each

Gloo ranks spawned on 127.0.0.1 (wake-cpu, call-cpu, idle-wake, gloo-threads, comm-cpu,
collective-series, collective-ops), one process's torch (tensor-passes, adam-passes), or plans run on
the executor's local Ray ranks (issue-cost, thread-cpu, plan-cpu, knob-cost, live-memory, memory-sweep,
sharing-check, bench-drift). The simulator's side of issue-cost and thread-cpu is
simexec.calibrate.host_probes; collective-ops' is simexec.calibrate.operator_counts.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simexec.calibrate.host_probes import collective_kind, issue_prices, thread_charges  # noqa: E402
from simexec.calibrate.operator_counts import collective_operator_rows  # noqa: E402
from simexec.errors import SimexecError  # noqa: E402
from simexec.outputs import outputs_refused, write_atomic  # noqa: E402


DOCS = {
    "wake-cpu": """What a blocking wait costs the thread that waits, in CPU, not only in wall time.

    python scripts/probe_host.py wake-cpu [--ranks 2] [--iters 200] [--rounds 5] [--bytes 16384]

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each) that loop over k
matrix products (128 x 128, k = 1, 4, 16) followed by nothing, by an all-reduce of `--bytes`, or
by a 0.3 ms sleep, rounds interleaved. Rank 0 prints each loop's wall time and its main thread's
CPU time (`time.thread_time`: that thread alone, not gloo's) per iteration, medians over rounds,
and what the all-reduce and the sleep add to the main thread's CPU. gloo's main thread blocks in
a collective without spinning; what it pays is waking up again (the scheduler, and on a virtual
machine a halted vCPU's exit and entry) and refilling its caches. The host model charges a
collective's CPU to the communication thread (`costs.comm_cpu_s`) and the main thread only its
interpreter's Python around the call (docs/host_model.md).
""",
    "call-cpu": """What a collective's call costs its calling thread alone: the micro-benchmarks' `issue`.

    python scripts/probe_host.py call-cpu [--reps 100]

Two gloo ranks on 127.0.0.1 (one intra-op thread, gloo's event loops at idle priority, as the
executor runs them) call an asynchronous 8 KB all-reduce together after a barrier, `--reps` times
(`simexec.calibrate.microbench.Bench.issue`); rank 0 prints the median CPU its thread spent in the call
(`time.thread_time`: torch.distributed's Python, gloo's work set up and queued), which a
micro-benchmark profile keeps as `costs.collective_issue_s`, beside an 8 KB add for scale.
""",
    "idle-wake": """What waking a rank costs against how long its core has idled: a gloo ping-pong after a pause.

    python scripts/probe_host.py idle-wake [--ranks 4] [--reps 40] [--gaps-ms 0,0.05,0.2,0.5,1,3,10]
    python scripts/probe_host.py idle-wake --pipe --gaps-ms 0.02,0.1,0.2,0.5,1,2,5,20,100

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
""",
    "gloo-threads": """How many collectives of one gloo process group run at once: time async collectives issued together.

    python scripts/probe_host.py gloo-threads [--ranks 4] [--kb 200] [--reps 20]

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
""",
    "comm-cpu": """What a gloo collective costs a member's CPU, not only its wall time.

    python scripts/probe_host.py comm-cpu [--ranks 2,4] [--reps 200] [--bytes 256,16384,262144]

Spawns each number of `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each) and runs
all-reduces of each size back to back, then a ping-pong of the smallest size between ranks 0 and 1
(the others wait in a barrier). Rank 0 prints, per operation, the wall time and the CPU time its
process spent (user and system, every thread: `resource.getrusage`) and its context switches
(voluntary, involuntary). A collective hands each message between gloo's threads and the kernel;
on bare metal a hand-off costs microseconds, on this virtual machine a large part of a
millisecond of system time. The host model charges it per step of a collective to every member's
core: `costs.comm_cpu_s` (docs/calibration.md, "Communication over loopback"), which the
micro-benchmarks measure the same way (`simexec.calibrate.comm.fit_comm_cpu`).
""",
    "tensor-passes": """What one pass over a unit's parameter tensors costs a CPU core, per tensor, by what it does.

    python scripts/probe_host.py tensor-passes [--tensors 16] [--shape 64,64] [--repeats 300]

The interpreter handles a collective's parameter tensors one at a time (`simexec.exec.rank.sharding`):
views of a flat buffer (`_Flat.views`: a slice and a reshape each), copies into them, parameters
pointed at them (`p.data = view`) and, for FSDP's release, pointed at one empty tensor. The host
model prices a pass of views or copies at `ISSUE_OPS_PER_TENSOR` operators a tensor
(`simexec.sim.host.issue.tensor_passes`) and the release at nothing; this times each kind of pass, one
intra-op thread, median over the repeats, in µs per tensor.
""",
    "collective-series": """One collective timed again and again, each after a barrier: how often the host stalls it.

    python scripts/probe_host.py collective-series [--ranks 2] [--bytes 1048576] [--reps 200] [--slow-ms 2]
                                        [--compute-ms 0] [--gloo-loops idle|default]
    python scripts/probe_host.py collective-series --recording traces/local [--bytes 1048576] [--ranks 2]

Spawns `--ranks` CPU processes (gloo on 127.0.0.1, one intra-op thread each) and times an
all-reduce of `--bytes` `--reps` times, each after a barrier and `--compute-ms` of matrix
products on every rank (as a training step calls its collectives: right after compute). A sample
is the last member's time from its call to the end, the collective's own time. Prints every
sample in order, then the median, the mean and the share of samples over `--slow-ms`.

`--gloo-loops` sets how gloo's event-loop threads are scheduled: `idle` as the executor runs them
(`simexec.exec.runtime.gloo_loops`), `default` as gloo leaves them. Under `default` the samples are
bimodal: the all-reduce runs at the speed its CPU allows, or it waits for the scheduler's next
tick while gloo's loops spin on the cores; after 20 ms of compute most samples wait
(docs/host_model.md, "gloo's event loops at idle priority"). The environment's `SIMEXEC_GLOO_LOOPS=default`
overrides `idle`, as in the executor. `--recording` reads the same benchmark (alone after a
barrier, `solo`) from a recording's micro-benchmarks instead of running it.
""",
    "adam-passes": """What torch's fused Adam costs a CPU core per tensor and per element, against the simulator's price.

    python scripts/probe_host.py adam-passes [--elements 16384,65536,270000,1048576] [--tensors 1,4,16,53,128]

Times one fp32 Adam step (`torch.optim.adam.adam(..., fused=True)`, as `simexec.exec.nn.optim.Adam`
runs it) over T tensors holding E elements in all, one intra-op thread, the median of 50 steps after
10 discarded; then, for a calibrated `local` profile, what the host model charges the same step
(`HostCosts.cpu_seconds`: two operators, a kernel pass per tensor at `launch_overhead_s`, the bytes
at the memory bandwidth times `elementwise_cost["optim.optim"]`). The per-tensor column is the step over T
tensors less the step over one, per extra tensor.
""",
    "collective-ops": """Aten operators the interpreter dispatches around each activation collective, against the model.

    python scripts/probe_host.py collective-ops [--model gpt-tiny] [--plan tp=2,gbs=2,dtype=fp32]

Runs one step of the plan as spawned gloo processes on 127.0.0.1 with a TorchDispatchMode counting
operators on rank 0: those of the interpreter's call (`RankInterpreter.collective`, the tensors prepared) and
of the collective's `finish` (the result put in place once waited), without the c10d operator of
the collective itself. Prints, per kind of activation collective (block, phase, micro-batch), what
was counted beside what `simexec.sim.host.issue.activation_ops` charges for it. Exit 1 where any differs.
""",
    "issue-cost": """What a step's collectives cost their rank's own thread, beside the transfer, against the model.

    python scripts/probe_host.py issue-cost [--plan dp=2,gbs=8,dtype=fp32] [--model gpt-tiny] [--steps 24]
                                 [--profile traces/profiles/local-microbench.json]

Runs the plan on the executor's Ray actors (CPU ranks, gloo), as `simexec execute` does, with the
interpreter's collectives timed, per kind of collective (`block`, buckets and layers merged):
- `before`: from the interpreter taking the instruction to its call into torch.distributed (moving
  gradients into a flat buffer, allocating the output);
- `call`: the call itself (torch.distributed's Python and the backend's work queued), wall time;
- `after`: from that call's return until the interpreter goes on;
- `finish`: the result put in place once the collective is waited on (views back into the
  parameters or gradients);
- `model before`, `model finish`: what the simulator charges the rank's thread for it
  (`HostCosts.issue_split` under `--profile`), to compare with before + call + after, and with
  finish.
Medians over the steps after the first four, over ranks. For the gradient bucket of ZeRO-0 (waited
at once), also the time from the call to the end of the wait and from the last member's call to the
end: the collective alone, the members' arrival spread taken out.
""",
    "thread-cpu": """Where a rank's own thread spends its CPU in a step, part by part, against the simulator's charge.

    python scripts/probe_host.py thread-cpu [--plan tp=2,gbs=8,dtype=fp32] [--model gpt-tiny] [--steps 14]
                                 [--profile traces/profiles/local-microbench.json]

Runs the plan on the executor's Ray actors (CPU ranks, gloo), as `simexec execute` does, with the
lowest rank's thread CPU (`time.thread_time`) split, exclusively, by part: each compute block
(`compute <phase>.<block>`), a collective's preparation (`call <block>`), its call into
torch.distributed (`c10d <verb>`), its wait and result put in place (`wait <block>`), messages,
copies, `reap` and the rest of the interpreter (`other`). Medians over the steps after the first
four, in ms a step, beside what `HostCosts` charges the thread on an idle core (`cpu_seconds`,
`issue_split`; the simulator charges a collective's call as `collective_issue_s` within `call`),
largest difference first. Shared cores slow every part alike: compare the parts with each other.
""",
    "plan-cpu": """How much CPU a plan's ranks use per step on this machine, against the cores they have.

    python scripts/probe_host.py plan-cpu [--steps 16] [--rounds 2] PLAN [PLAN ...]

Runs each plan (gpt-tiny, local Ray CPU ranks, one warm-up run first) and reads the rank processes'
user + system time from /proc/<pid>/stat before and after: CPU-seconds per step and the cores busy
on average. Every thread of a rank counts: its main thread's compute and gloo's communication
threads. The simulator's counterpart is the core time the host model hands out in a step
(compute instructions plus every collective step's burst, `simexec.sim.host.cores.Cores.run`).
""",
    "knob-cost": """What one plan knob changes in a step on this machine, measured and predicted.

    python scripts/probe_host.py knob-cost [--knob grad_fp32=1] [--rounds 3] [--steps 12] [--seq-len 64] [--profile P] [PLAN ...]

Runs each plan (gpt-tiny, local Ray CPU ranks) with and without the knob (`--knob`, a plan
fragment: `grad_fp32=1`, main gradients under bf16, by default; `param_overlap=1` for ZeRO-1/2
plans), the two interleaved for `--rounds` rounds, and prints the median step time of each, the
measured ratio and the simulator's ratio under the calibrated profile (default
traces/profiles/local-traces.json). The ratios are what to read: a shared host moves absolute step
times by tens of percent between rounds. Plans default to three bf16 ones for `grad_fp32`, three
ZeRO-1/2 ones for `param_overlap` and three tp ones for `tp_overlap` (docs/executor.md quotes them).
""",
    "live-memory": """What a rank holds at its measured peak, storage by storage, against the simulator's prediction.

    python scripts/probe_host.py live-memory [--model moe-tiny] [--rank R] PLAN

Runs one step of PLAN on local Ray CPU ranks with a runner that wraps the executor's own
`run_rank`: every tensor storage its peak-memory tracker counts is tagged with the instruction and
the aten operator that made it. Prints the rank's measured and predicted peak, then the storages
alive at the end of the instruction where the peak fell, grouped by the instruction that made them
(layer 0 in full, the other layers summed), and the predicted activations the program saves per
block of a layer (`simexec.program.blocks.Anatomy`): it traces a gap such as moe-tiny's
`dp=4,ep=2` one to the norms, the rotary tables and the combine's tokens.
""",
    "memory-sweep": """Each rank's measured peak memory against the simulator's prediction, over a list of plans.

    python scripts/probe_host.py memory-sweep                                  # the default sweep (bf16, seq 64)
    python scripts/probe_host.py memory-sweep --model gpt-tiny "dp=2,zero=3,gbs=8,mbs=4,dtype=bf16"
    python scripts/probe_host.py memory-sweep --json sweep.json

Runs two steps of every plan on local Ray CPU ranks (one actor pool for the whole sweep) and
compares the executor's per-rank peak (every live tensor storage, `simexec.exec.measure.live_memory`) with
`simexec simulate` on the same plan string, dtype included. The default sweep covers every memory
feature the executor runs: ZeRO stages and flavours, tp, the pipeline schedules, recompute,
offload, the three context-parallel implementations, experts, latent attention, a sliding window,
tied embeddings, and RMSNorm models (q/k norms, latent attention, windows) under tp, sp and pp. The
errors are signed: above zero, the rank held more than predicted.
""",
    "sharing-check": """Does the sharing micro-benchmark see the compute contention the data-parallel plans see?

    python scripts/probe_host.py sharing-check [--rounds 4]

In one Ray session, alternating, each round measures
- the sharing benchmark's own workload: the one-rank gpt-tiny program on one rank, then on two
  ranks at once (`simexec.calibrate.microbench`, steps 8-15 of 16), and
- the plans: `dp=1` and `dp=2` at global batch 8, their compute instructions summed over the
  traced step (every rank),
and prints each pair's ratio. `compute_contention` comes from the first; the trace fit sees the
second. If the benchmark missed something the plans have, the first ratio would stay below the
second round after round.
""",
    "bench-drift": """Do the micro-benchmarks and the plans see the same host? Run them side by side, alternating.

    python scripts/probe_host.py bench-drift [--rounds 3]

In one Ray session, each round runs the micro-benchmarks' one-rank step (`simexec.calibrate.microbench`:
gpt-tiny at micro-batch 1, two micro-batches and the optimizer step, every instruction timed; the
other benchmarks cut to a token size) and then the `dp=1` plan (global batch 8: eight
micro-batches), and prints the benchmark's step (the median over its timed steps of the summed
instruction times) against the plan's equivalent (its steady step less the optimizer step, per two
micro-batches, plus the optimizer step). Apart, the two drift with the host (docs/calibration.md,
"When they run"); side by side they should agree.
""",
}


MODES = ("none", "allreduce", "sleep")


KS = (1, 4, 16)


def _wake_cpu_rank(rank: int, world: int, port: int, args) -> None:
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


def cmd_wake_cpu(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py wake-cpu", description=DOCS["wake-cpu"].split("\n\n")[0])
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
    mp.spawn(_wake_cpu_rank, args=(args.ranks, port, args), nprocs=args.ranks)
    return 0


def _call_cpu_rank(rank: int, world: int, port: int, reps: int, out) -> None:
    import time

    import torch
    import torch.distributed as dist

    from simexec.calibrate.microbench import BenchConfig, Bench

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        bench = Bench(BenchConfig(issue_reps=reps), rank, world)
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


def cmd_call_cpu(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py call-cpu", description=DOCS["call-cpu"].splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args(argv)
    if args.reps < 1:
        print(f"probe_host.py call-cpu: error: --reps must be at least 1, got {args.reps}", file=sys.stderr)
        return 2
    from simexec.exec.runtime.spawn import spawn_ranks

    got = spawn_ranks(_call_cpu_rank, 2, (args.reps,), 120.0)
    print(f"an asynchronous 8 KB all-reduce's call over 2 ranks: {statistics.median(got['call']) * 1e6:.1f} µs of its "
          f"thread's CPU (median of {args.reps}); an 8 KB add: {statistics.median(got['add']) * 1e6:.1f} µs")
    return 0


def _idle_wake_worker(rank: int, world: int, port: int, gaps: list[float], reps: int) -> None:
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


def cmd_idle_wake(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py idle-wake", description=DOCS["idle-wake"].split("\n\n")[0])
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
    mp.spawn(_idle_wake_worker, args=(args.ranks, port, gaps, args.reps), nprocs=args.ranks)
    return 0


def _gloo_threads_worker(rank: int, world: int, port: int, numel: int, reps: int) -> None:
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


def cmd_gloo_threads(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py gloo-threads", description=DOCS["gloo-threads"].split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kb", type=float, default=200.0, help="each rank's all-gather input, KB (fp32)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_threads_worker, args=(args.ranks, port, int(args.kb * 1024 / 4), args.reps), nprocs=args.ranks)
    return 0


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


def _comm_cpu_worker(rank: int, world: int, port: int, sizes: list[int], reps: int) -> None:
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


def cmd_comm_cpu(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py comm-cpu", description=DOCS["comm-cpu"].split("\n\n")[0])
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
        mp.spawn(_comm_cpu_worker, args=(world, port, sizes, args.reps), nprocs=world)
    return 0


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return dims


def time_passes(tensors: int, shape: tuple[int, ...], repeats: int) -> dict[str, float]:
    """Median µs per tensor of each kind of pass over `tensors` parameters of `shape`."""
    import torch

    torch.set_num_threads(1)
    n = math.prod(shape)
    params = [torch.nn.Parameter(torch.randn(shape)) for _ in range(tensors)]
    grads = [torch.randn(shape) for _ in range(tensors)]
    flat = torch.empty(tensors * n)
    empty = torch.empty(0)

    def views():
        return [flat[i * n:(i + 1) * n].view(shape) for i in range(tensors)]

    made = views()

    def point(vs):
        for p, v in zip(params, vs):
            p.data = v

    kinds = {
        "views of the flat buffer": views,
        "copies into views": lambda: [v.copy_(g) for v, g in zip(made, grads)],
        "parameters pointed at new views": lambda: point(views()),
        "release (pointed at one empty tensor)": lambda: point([empty] * tensors),
    }
    out = {}
    for name, fn in kinds.items():
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts) / tensors * 1e6
    return out


def cmd_tensor_passes(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py tensor-passes", description=DOCS["tensor-passes"].splitlines()[0])
    ap.add_argument("--tensors", type=int, default=16, help="tensors in a pass (a gpt-tiny layer: 16)")
    ap.add_argument("--shape", type=_shape, default=(64, 64))
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    if args.tensors < 1 or args.repeats < 1:
        print(f"probe_host.py tensor-passes: error: --tensors and --repeats must be at least 1, got {args.tensors} and "
              f"{args.repeats}", file=sys.stderr)
        return 2
    for name, us in time_passes(args.tensors, args.shape, args.repeats).items():
        print(f"{name:<40}{us:8.2f} µs a tensor")
    return 0


def _collective_series_worker(rank: int, world: int, port: int, nbytes: int, reps: int,
                              compute_ms: float, loops: str, out) -> None:
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

    return spawn_ranks(_collective_series_worker, ranks, (nbytes, reps, compute_ms, loops),
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


def cmd_collective_series(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py collective-series",
                                 description=DOCS["collective-series"].split("\n\n")[0])
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
        print(f"probe_host.py collective-series: error: --ranks {args.ranks} (>= 2), --bytes {args.bytes} (>= 4), "
              f"--reps {args.reps} (>= 1) and --compute-ms {args.compute_ms:g} (0 to 1000)", file=sys.stderr)
        return 2
    from simexec.errors import SimexecError

    try:
        ts = recorded(args.recording, args.ranks, args.bytes) if args.recording else \
            measure(args.ranks, args.bytes, args.reps, args.compute_ms, args.gloo_loops)
    except SimexecError as exc:
        print(f"probe_host.py collective-series: error: {exc}", file=sys.stderr)
        return 2
    ms = [t * 1e3 for t in ts]
    print(" ".join(f"{t:.1f}" for t in ms))
    slow = sum(t > args.slow_ms for t in ms)
    how = "recorded" if args.recording else f"after {args.compute_ms:g} ms of compute, gloo loops {args.gloo_loops}"
    print(f"{args.ranks}-rank all-reduce of {args.bytes} B ({how}), {len(ms)} samples: median {statistics.median(ms):.3f} ms, "
          f"mean {statistics.fmean(ms):.3f} ms; over {args.slow_ms:g} ms: {slow} ({100.0 * slow / len(ms):.0f}%)")
    return 0


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def time_step(tensors: int, elements: int, steps: int = 60, warm: int = 10) -> float:
    """Median seconds of one fused fp32 Adam step over `tensors` tensors of `elements` in all."""
    import torch
    from torch.optim.adam import adam

    n = max(1, elements // tensors)
    w = [torch.randn(n) for _ in range(tensors)]
    g = [torch.randn(n) for _ in range(tensors)]
    m = [torch.zeros(n) for _ in range(tensors)]
    v = [torch.zeros(n) for _ in range(tensors)]
    counts = [torch.zeros(()) for _ in range(tensors)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        adam(w, g, m, v, [], counts, fused=True, amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-3,
             weight_decay=0.0, eps=1e-6, maximize=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warm:])


def pricer(profile: str):
    """The host model's CPU-seconds for the same step, as a function of (tensors, elements):
    `HostCosts.cpu_seconds` of the optimizer instruction the lowering emits for that many fp32
    parameters, held in that many tensors."""
    from simexec.specs.cluster import get_cluster
    from simexec.program.adam import adam_bytes_per_param
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve
    from simexec.program.instructions import Instr, Program
    from simexec.program.adam import ADAM_FLOPS_PER_PARAM
    from simexec.sim.host.model import HostCosts
    from simexec.sim.profile import apply_profile

    cluster = apply_profile(get_cluster("local"), profile)
    per_param = adam_bytes_per_param(resolve(get_model("gpt-tiny"), cluster, load_plan("dp=1,gbs=1,dtype=fp32")))

    def price(tensors: int, elements: int) -> float:
        class Priced(HostCosts):
            def tensors(self, rank: int) -> int:  # the step's tensors, not a program's
                return tensors

        ins = Instr(0, "optim.optim", "compute", "compute", "optimizer", phase="optim", block="optim",
                    flops=elements * ADAM_FLOPS_PER_PARAM, bytes=elements * per_param)
        return Priced(cluster, Program(meta={}, ranks={0: [ins]}), "fp32").cpu_seconds(ins)

    return price


def cmd_adam_passes(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py adam-passes", description=DOCS["adam-passes"].split("\n\n")[0])
    ap.add_argument("--elements", type=_ints, default=[16384, 65536, 270000, 1048576],
                    help="elements in all, comma-separated")
    ap.add_argument("--tensors", type=_ints, default=[1, 4, 16, 53, 128], help="tensor counts, comma-separated")
    ap.add_argument("--profile", default=str(ROOT / "traces" / "profiles" / "local-microbench.json"),
                    help="a calibrated local profile to price the steps with")
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError

    try:
        price = pricer(args.profile)
    except SimexecError as exc:
        print(f"probe_host.py adam-passes: error: {exc}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    print(f"{'elements':>9s} {'tensors':>7s} {'measured ms':>11s} {'model ms':>9s} {'per extra tensor µs':>20s}")
    for e in args.elements:
        one = None
        for t in sorted(args.tensors):
            ms = time_step(t, e) * 1e3
            one = ms if t == 1 else one
            extra = f"{(ms - one) / (t - 1) * 1e3:20.1f}" if one is not None and t > 1 else f"{'':20s}"
            print(f"{e:9d} {t:7d} {ms:11.3f} {price(t, e) * 1e3:9.3f} {extra}")
    return 0


def cmd_collective_ops(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py collective-ops",
                                 description=DOCS["collective-ops"].split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--plan", default="tp=2,gbs=2,dtype=fp32")
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError

    try:
        rows = collective_operator_rows(args.model, args.plan)
    except SimexecError as e:
        print(f"probe_host.py collective-ops: {e}", file=sys.stderr)
        return 2
    print(f"{args.model} {args.plan}: operators on rank 0, (before the call, once waited)")
    print(f"{'phase':5} {'block':14} {'verb':14} {'mb':3} {'group':>5} {'partial':>7}  counted   model")
    for r in rows:
        print(f"{r['phase']:5} {r['block']:14} {r['verb']:14} {r['mb']:3} {r['group']:5d} {r['partial']:7d}  "
              f"{str(r['counted']):8}  {r['model']}")
    return 0 if all(tuple(r["counted"]) == tuple(r["model"]) for r in rows) else 1


VERBS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all_single")


def issue_cost_runner(rp, instrs, *, steps, groups, tracer, device, seed=0):
    """`simexec.exec.rank.interpreter.run_rank`, with every collective's own Python timed."""
    import torch
    import torch.distributed as dist

    from simexec.exec.rank import collectives
    from simexec.exec.rank import interpreter as interp

    marks: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    calls: list[tuple[float, float]] = []
    saved = {v: getattr(collectives.TorchComm, v) for v in VERBS}
    collective, inflight_init = interp.RankInterpreter.collective, collectives.InflightComm.__init__

    def timed_verb(fn):
        def call(*args, **kwargs):
            t = time.time()
            out = fn(*args, **kwargs)
            calls.append((t, time.time()))
            return out
        return staticmethod(call)

    def timed_collective(self, ins):
        calls.clear()
        t0 = time.time()
        collective(self, ins)
        t1 = time.time()
        if not calls or self.step_no < 4:
            return
        m = marks[collective_kind(ins.block)]
        m["before"].append(calls[0][0] - t0)
        m["call"].append(sum(end - start for start, end in calls))
        m["after"].append(t1 - calls[-1][1])
        if ins.block.startswith("grads") and not ins.block.startswith("grads_rep") and ins.collective == "allreduce":
            self.inflight[ins.name].wait()
            t2 = time.time()
            last = torch.tensor([calls[0][0]], dtype=torch.float64)
            dist.all_reduce(last, op=dist.ReduceOp.MAX, group=self.group(ins))
            m["call_to_end"].append(t2 - calls[0][0])
            m["last_call_to_end"].append(t2 - float(last))

    def timed_inflight(self, rank, ins, works, finish):
        if finish is not None:
            inner = finish

            def finish():
                t = time.time()
                inner()
                if rank.step_no >= 4:
                    marks[collective_kind(ins.block)]["finish"].append(time.time() - t)
        inflight_init(self, rank, ins, works, finish)

    for v in VERBS:
        setattr(collectives.TorchComm, v, timed_verb(saved[v]))
    interp.RankInterpreter.collective = timed_collective
    collectives.InflightComm.__init__ = timed_inflight
    try:
        out = interp.run_rank(rp, instrs, steps=steps, groups=groups, tracer=tracer, device=device, seed=seed)
    finally:
        for v in VERBS:
            setattr(collectives.TorchComm, v, staticmethod(saved[v]))
        interp.RankInterpreter.collective, collectives.InflightComm.__init__ = collective, inflight_init
    out["extra"] = {k: {part: list(v) for part, v in m.items()} for k, m in marks.items()}
    return out


def plan_parser(command: str, plan: str, steps: int) -> argparse.ArgumentParser:
    """The flags of a subcommand that runs one plan with an instrumented rank runner."""
    ap = argparse.ArgumentParser(prog=f"probe_host.py {command}", description=DOCS[command].splitlines()[0])
    ap.add_argument("--plan", default=plan)
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--profile", default="traces/profiles/local-microbench.json")
    return ap


def run_plan(script: str, args, runner, model_side, timeout_s: float):
    """`model_side(model, plan, profile)` and the plan run on Ray actors with `runner`; on a bad flag
    or plan, one line on stderr and None."""
    if args.steps < 5:
        print(f"{script}: error: --steps must be at least 5 (the first four are warm-up), got {args.steps}",
              file=sys.stderr)
        return None
    from simexec.calibrate.runs import Session
    from simexec.errors import SimexecError

    try:
        predicted = model_side(args.model, args.plan, args.profile)
        with Session() as session:
            return predicted, session.execute(args.model, args.plan, steps=args.steps, runner=runner,
                                              timeout_s=timeout_s)
    except SimexecError as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        return None


def cmd_issue_cost(argv=None) -> int:
    args = plan_parser("issue-cost", "dp=2,gbs=8,dtype=fp32", 24).parse_args(argv)
    got = run_plan("probe_host.py issue-cost", args, issue_cost_runner, issue_prices, 300.0)
    if got is None:
        return 2
    prices, m = got
    pooled: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for ex in m.result.extra.values():
        for kind, parts in ex.items():
            for part, v in parts.items():
                pooled[kind][part].extend(v)

    def ms(v):
        return f"{statistics.median(v) * 1e3:.3f}" if v else "-"

    print(f"{args.model} {args.plan}: medians in ms over ranks and steps 5-{args.steps}")
    print(f"{'collective':<14}{'count':>6}{'before':>9}{'call':>9}{'after':>9}{'finish':>9}{'model before':>14}"
          f"{'model finish':>14}{'call to end':>13}{'last call to end':>18}")
    nan = (float("nan"), float("nan"))
    for kind, p in sorted(pooled.items()):
        before, finish = prices.get(kind, nan)
        print(f"{kind:<14}{len(p['before']):>6}{ms(p['before']):>9}{ms(p['call']):>9}{ms(p['after']):>9}{ms(p['finish']):>9}"
              f"{before * 1e3:>14.3f}{finish * 1e3:>14.3f}{ms(p['call_to_end']):>13}{ms(p['last_call_to_end']):>18}")
    return 0


def thread_cpu_runner(rp, instrs, *, steps, groups, tracer, device, seed=0):
    """`simexec.exec.rank.interpreter.run_rank`, with the thread's CPU split by part."""
    from simexec.exec.rank import collectives
    from simexec.exec.rank import interpreter as interp

    acc: dict[str, float] = collections.defaultdict(float)
    per_step: list[dict[str, float]] = []
    stack = [["other", time.thread_time()]]

    def enter(part):
        now = time.thread_time()
        acc[stack[-1][0]] += now - stack[-1][1]
        stack.append([part, now])

    def leave():
        now = time.thread_time()
        part, since = stack.pop()
        acc[part] += now - since
        stack[-1][1] = now

    def timed(fn, part_of):
        def call(*args, **kwargs):
            enter(part_of(*args))
            try:
                return fn(*args, **kwargs)
            finally:
                leave()
        return call

    R, I, C = interp.RankInterpreter, collectives.InflightComm, collectives.TorchComm
    saved = [(R, "compute", lambda s, ins: f"compute {'fwd' if ins.phase == 'recompute' else ins.phase}.{ins.block}"),
             (R, "collective", lambda s, ins: f"call {collective_kind(ins.block)}"),
             (R, "p2p", lambda s, ins: "p2p"), (R, "copy", lambda s, ins: "copy"), (R, "reap", lambda s: "reap"),
             (I, "wait", lambda s: f"wait {collective_kind(s.ins.block)}")]
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in saved]
    for cls, name, part_of in saved:
        setattr(cls, name, timed(getattr(cls, name), part_of))
    verbs = {v: getattr(C, v) for v in VERBS}
    for v, fn in verbs.items():
        setattr(C, v, staticmethod(timed(fn, lambda *a, v=v: f"c10d {v}")))
    run_step = R.run_step

    def counted_step(self, step):
        acc.clear()
        stack[:] = [["other", time.thread_time()]]
        out = run_step(self, step)
        acc[stack[-1][0]] += time.thread_time() - stack[-1][1]
        if step >= 4:
            per_step.append(dict(acc))
        return out

    R.run_step = counted_step
    try:
        out = interp.run_rank(rp, instrs, steps=steps, groups=groups, tracer=tracer, device=device, seed=seed)
    finally:
        R.run_step = run_step
        for cls, name, fn in originals:
            setattr(cls, name, fn)
        for v, fn in verbs.items():
            setattr(C, v, staticmethod(fn))
    out["extra"] = {"steps": per_step}
    return out


def cmd_thread_cpu(argv=None) -> int:
    args = plan_parser("thread-cpu", "tp=2,gbs=8,dtype=fp32", 14).parse_args(argv)
    got = run_plan("probe_host.py thread-cpu", args, thread_cpu_runner, thread_charges, 600.0)
    if got is None:
        return 2
    predicted, m = got
    rank = min(m.result.extra, key=int)
    steps = m.result.extra[rank]["steps"]
    parts = sorted(set(predicted) | {p for s in steps for p in s})
    rows = [(p, statistics.median(s.get(p, 0.0) for s in steps), predicted.get(p, 0.0)) for p in parts]
    total = statistics.median(sum(s.values()) for s in steps)
    print(f"{args.model} {args.plan}, rank {rank}: its thread's CPU in ms a step, medians over steps 5-{args.steps}; "
          f"in all {total * 1e3:.1f} measured, {sum(predicted.values()) * 1e3:.1f} charged")
    print(f"{'part':<30}{'measured':>10}{'charged':>10}{'difference':>12}")
    for part, got, charged in sorted(rows, key=lambda r: -abs(r[1] - r[2])):
        print(f"{part:<30}{got * 1e3:>10.2f}{charged * 1e3:>10.2f}{(got - charged) * 1e3:>+12.2f}")
    return 0


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids) -> float:
    """User + system time of these processes so far (0 for one that has gone)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def cmd_plan_cpu(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py plan-cpu", description=DOCS["plan-cpu"].split("\n\n")[0])
    ap.add_argument("plans", nargs="+", help="plan strings, e.g. dp=4,zero=3,gbs=8,dtype=fp32")
    ap.add_argument("--steps", type=int, default=16, help="steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per plan")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.rounds < 1:
        ap.error(f"need --steps >= 2 and --rounds >= 1; got {args.steps} and {args.rounds}")
    from simexec.calibrate.runs import Session
    from simexec.errors import SimexecError

    try:
        with Session() as s:
            for plan in args.plans:
                s.execute("gpt-tiny", plan, steps=3)
            print(f"{'plan':34s} {'step ms':>8s} {'CPU ms/step':>12s} {'cores busy':>11s}")
            for _ in range(args.rounds):
                for plan in args.plans:
                    pids = s.pool.pids()
                    c0, w0 = cpu_seconds(pids), time.perf_counter()
                    m = s.execute("gpt-tiny", plan, steps=args.steps)
                    c1, w1 = cpu_seconds(pids), time.perf_counter()
                    used = c1 - c0
                    print(f"{plan:34s} {m.step_time_s * 1e3:8.1f} {used / args.steps * 1e3:12.1f} "
                          f"{used / (w1 - w0):11.2f}", flush=True)
    except SimexecError as exc:
        print(f"probe_host.py plan-cpu: error: {exc}", file=sys.stderr)
        return 2
    return 0


DEFAULT_PLANS = {
    "grad_fp32=1": ("dp=2,gbs=8,dtype=bf16", "dp=4,zero=2,gbs=8,dtype=bf16", "dp=4,zero=3,gbs=8,dtype=bf16"),
    "param_overlap=1": ("dp=2,zero=1,gbs=8", "dp=4,zero=1,gbs=8", "dp=4,zero=2,gbs=8"),
    "tp_overlap=1": ("tp=2,gbs=8", "dp=2,tp=2,gbs=8", "tp=2,sp=1,gbs=8"),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="probe_host.py knob-cost", description=DOCS["knob-cost"].split("\n\n")[0])
    ap.add_argument("plans", nargs="*", help="plan strings (default: three for the knob)")
    ap.add_argument("--knob", default="grad_fp32=1", help="plan fragment added to each plan (default grad_fp32=1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12, help="steps per run (the executor's median after the warm-up)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--profile", default=str(ROOT / "traces" / "profiles" / "local-traces.json"))
    return ap


def cmd_knob_cost(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        ap.error(f"need --rounds >= 1 and --steps >= 2; got {args.rounds} and {args.steps}")
    plans = args.plans or DEFAULT_PLANS.get(args.knob)
    if not plans:
        ap.error(f"no default plans for --knob {args.knob}; give plans ({', '.join(DEFAULT_PLANS)} have defaults)")
    from simexec.calibrate.runs import Session
    from simexec.errors import SimexecError
    from simexec.specs.model import get_model
    from simexec.sim.simulate import simulate

    knob = "," + args.knob.strip(",")
    model = get_model("gpt-tiny")
    try:
        predicted = {p: simulate(model, "local", p, seq_len=args.seq_len, profile=args.profile).step_time_s
                     for base in plans for p in (base, base + knob)}
        measured: dict[str, list[float]] = {p: [] for p in predicted}
        with Session() as s:
            for _ in range(args.rounds):
                for p in predicted:
                    m = s.execute(model, p, steps=args.steps, seq_len=args.seq_len)
                    measured[p].append(m.step_time_s)
    except SimexecError as exc:
        print(f"probe_host.py knob-cost: error: {exc}", file=sys.stderr)
        return 2
    print(f"{'plan':34s} {'measured ms':>12s} {'with ' + args.knob:>18s} {'ratio':>7s} {'predicted ratio':>16s}")
    for base in plans:
        a, b = statistics.median(measured[base]), statistics.median(measured[base + knob])
        print(f"{base:34s} {a * 1e3:12.1f} {b * 1e3:18.1f} {b / a:7.3f} "
              f"{predicted[base + knob] / predicted[base]:16.3f}")
    return 0


def tagging_runner(out_dir: str):
    """A `run_rank` stand-in that records, per rank, the live storages after each instruction of the
    first step: {instruction: [(made by instruction, aten op, shape, bytes)]} for the peak's."""

    def runner(rp, instrs, *, steps, groups, tracer, device, seed=0):
        import torch

        from simexec.exec.rank import interpreter as interp
        from simexec.exec.measure import live_memory

        torch.set_num_threads(1)
        now, op = ["start"], ["?"]
        origin: dict[int, tuple] = {}
        track, dispatch = live_memory.LiveBytes.track, live_memory.LiveBytes.__torch_dispatch__

        def tagged_track(self, t, created=False):
            key = nbytes = None
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    st = t.untyped_storage()
                    key, nbytes = id(st), st.nbytes()
                except (RuntimeError, NotImplementedError):
                    key = None
            was = key is not None and key in self._seen and self._seen[key].alive
            track(self, t, created)
            if key is not None and not was and key in self._seen:
                origin[key] = (now[0], op[0], list(t.shape), nbytes)

        def tagged_dispatch(self, func, types, args=(), kwargs=None):
            op[0] = str(func)
            return dispatch(self, func, types, args, kwargs)

        live_memory.LiveBytes.track, live_memory.LiveBytes.__torch_dispatch__ = tagged_track, tagged_dispatch
        best = {"peak": -1, "at": None, "live": []}

        class Tagging:
            def begin(self, ins, step):
                now[0] = ins.name
                tracer.begin(ins, step)

            def end(self, ins, step):
                tracer.end(ins, step)
                t = live_memory.LIVE_TRACKER[0]
                if t is not None and t.peak > best["peak"]:
                    best.update(peak=t.peak, at=ins.name,
                                live=[origin[k] for k, f in t._seen.items() if f.alive and k in origin])

            def counter(self, category, nbytes):
                tracer.counter(category, nbytes)

        try:
            res = interp.run_rank(rp, instrs, steps=steps, groups=groups, tracer=Tagging(), device=device, seed=seed)
        finally:
            live_memory.LiveBytes.track, live_memory.LiveBytes.__torch_dispatch__ = track, dispatch
        Path(out_dir, f"rank{instrs[0].rank}.json").write_text(json.dumps(best))
        return res

    return runner


def cmd_live_memory(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py live-memory", description=DOCS["live-memory"].split("\n\n")[0])
    ap.add_argument("plan", help="plan string, e.g. dp=4,ep=2,gbs=8,dtype=fp32")
    ap.add_argument("--model", default="moe-tiny")
    ap.add_argument("--rank", type=int, default=None, help="the rank to show (default: the largest measured peak)")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    args = ap.parse_args(argv)
    from simexec.program.blocks import Anatomy
    from simexec.specs.cluster import get_cluster
    from simexec.errors import SimexecError
    from simexec.exec.api import execute
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve
    from simexec.sim.simulate import simulate

    try:
        rp = resolve(get_model(args.model), get_cluster("local"), load_plan(args.plan), args.seq_len)
        if args.rank is not None and not 0 <= args.rank < rp.world:
            raise SimexecError(f"--rank {args.rank}: the plan has ranks 0-{rp.world - 1}")
        predicted = simulate(args.model, "local", args.plan, seq_len=args.seq_len).peak_memory_bytes_per_rank
        with tempfile.TemporaryDirectory() as tmp:
            res = execute(args.model, "local", args.plan, steps=1, seq_len=args.seq_len, runner=tagging_runner(tmp))
            rank = args.rank if args.rank is not None else max(res.peak_memory_bytes_per_rank,
                                                               key=res.peak_memory_bytes_per_rank.get)
            best = json.loads(Path(tmp, f"rank{rank}.json").read_text())
    except SimexecError as exc:
        print(f"probe_host.py live-memory: error: {exc}", file=sys.stderr)
        return 2
    measured, predicted = res.peak_memory_bytes_per_rank[rank], predicted[rank]
    print(f"rank {rank}: measured peak {measured / 1e6:.3f} MB at {best['at']}, predicted {predicted / 1e6:.3f} MB "
          f"(error {predicted / measured - 1:+.1%})")
    by_made: dict[str, int] = defaultdict(int)
    for made, _, _, nbytes in best["live"]:
        layer = made.split(".L")[1].split(".")[0] if ".L" in made else ""
        key = made if layer in ("0", "-1", "") else f"{made.split('.L')[0]}.L1+ (summed)"
        by_made[key] += nbytes
    print("\nlive at the peak, by the instruction that made it (kB):")
    for made, nbytes in sorted(by_made.items(), key=lambda kv: -kv[1]):
        print(f"  {made:32s} {nbytes / 1e3:9.1f}")
    print("\nlayer 0's storages (instruction, operator, shape, kB):")
    for made, op, shape, nbytes in best["live"]:
        if ".L0." in made:
            print(f"  {made:22s} {op:46s} {str(shape):20s} {nbytes / 1e3:7.1f}")
    an = Anatomy(rp)
    print("\npredicted activations a layer saves, per block (kB):")
    for name, block in an.layer(0).items():
        print(f"  {name:10s} {block.saved / 1e3:7.1f}")
    return 0


SEQ = 64


_BF16 = ",gbs=8,dtype=bf16"


DEFAULT_SWEEP: list[tuple[str, str]] = [
    *[("gpt-tiny", p + _BF16) for p in (
        "dp=2,mbs=4", "dp=2,zero=1,mbs=4", "dp=2,zero=2,mbs=4", "dp=2,zero=3,mbs=4",
        "dp=2,zero=3,zero_impl=yafsdp,mbs=4", "dp=2,zero=3,zero_impl=deepspeed,mbs=4", "tp=2,mbs=4", "pp=2,mbs=4,schedule=gpipe", "pp=2,mbs=4,schedule=zb-h1",
        "pp=2,vpp=2,mbs=2", "pp=2,vpp=2,schedule=interleaved-zb,mbs=2", "pp=2,vpp=2,schedule=zb-v,mbs=2",
        "pp=2,vpp=2,schedule=dualpipev,mbs=2", "dp=2,recompute=full,mbs=4",
        "dp=2,recompute=selective,mbs=4", "dp=2,offload=optimizer,mbs=4", "cp=2,mbs=4", "cp=2,cp_impl=ring,mbs=4",
        "cp=2,cp_impl=a2a,mbs=4")],
    ("moe-tiny", "dp=2,ep=2,mbs=4" + _BF16), ("moe-tiny", "tp=2,mbs=4" + _BF16),
    ("moe-tiny", "dp=2,ep=2,pp=2,vpp=2,mbs=2,gbs=16,dtype=bf16,schedule=dualpipev,dualpipe_overlap=1"),
    ("tests/data/moe-cap-tiny.yaml", "dp=2,ep=2,mbs=4" + _BF16),  # experts cut and padded to capacity
    ("tests/data/mla-tiny.yaml", "tp=2,mbs=4" + _BF16), ("tests/data/window-tiny.yaml", "dp=1,mbs=4" + _BF16),
    ("tests/data/gpt-tiny-tied.yaml", "pp=2,mbs=4" + _BF16), ("gpt-tiny", "dp=1,gbs=16,mbs=16,dtype=bf16"),
    ("tests/data/gpt-tiny-tied.yaml", "pp=2,vpp=2,schedule=zb-v,mbs=2" + _BF16),  # the V: one embedding for the head
    ("tests/data/gpt-tiny-tied.yaml", "dp=2,pp=2,zero=1,mbs=2" + _BF16),  # the tied sum before the reduce-scatter
    # main gradients: fp32 buckets, shards and buffers beside bf16 parameters
    *[("gpt-tiny", p + _BF16 + ",grad_fp32=1") for p in ("dp=2,mbs=4", "dp=2,zero=3,mbs=4", "dp=2,zero=3,zero_impl=yafsdp,mbs=4")],
    # DeepSpeed's BF16_Optimizer path over a pipeline; parameters gathered in the next forward
    ("gpt-tiny", "dp=2,pp=2,zero=1,mbs=2,grad_fp32=1,grad_allreduce=1,grad_overlap=0" + _BF16),
    ("gpt-tiny", "dp=2,zero=2,mbs=4,param_overlap=1" + _BF16),
    # weight gradients under the input gradients' tp collectives: what they read lives until they run
    ("gpt-tiny", "tp=2,mbs=4,tp_overlap=1" + _BF16), ("gpt-tiny", "tp=2,sp=1,mbs=4,tp_overlap=1" + _BF16),
    ("moe-tiny", "dp=2,ep=2,tp=2,mbs=2,tp_overlap=1" + _BF16),
    # RMSNorm models: the CPU kernels' backward buffers, q/k norms, latent norms, windows under tp, sp, pp
    *[("tests/data/window-tiny.yaml", p + _BF16) for p in ("tp=2,mbs=4", "pp=2,mbs=4", "pp=2,mbs=4,schedule=zb-h1")],
    *[("tests/data/qk-norm-tiny.yaml", p + _BF16) for p in ("tp=2,mbs=4", "tp=2,sp=1,mbs=4", "pp=2,mbs=4")],
    ("tests/data/qk-norm-tiny.yaml", "dp=1,gbs=8,mbs=4,dtype=fp32"),
    *[("tests/data/mla-tiny.yaml", p + _BF16) for p in ("tp=2,sp=1,mbs=4", "pp=2,mbs=4", "pp=2,mbs=4,schedule=zb-h1")],
]


def _model(name: str):
    from simexec.specs.model import get_model

    path = ROOT / name
    return get_model(str(path) if path.suffix in (".yaml", ".yml") and path.exists() else name)


def sweep(cases: list[tuple[str, str]], seq_len: int, ray_address=None) -> list[dict]:
    """One row per plan: measured and predicted peak bytes per rank and the signed errors."""
    from simexec.calibrate.runs import Session
    from simexec.sim.simulate import simulate

    rows = []
    with Session(ray_address=ray_address, measure_load=False) as session:
        for model_name, plan in cases:
            model = _model(model_name)
            predicted = simulate(model, "local", plan, seq_len=seq_len).peak_memory_bytes_per_rank
            measured = session.execute(model, plan, steps=2, seq_len=seq_len).result.peak_memory_bytes_per_rank
            ranks = sorted(measured)
            errors = [measured[r] / predicted[r] - 1 for r in ranks]
            rows.append({"model": model_name, "plan": plan, "measured_bytes": [measured[r] for r in ranks],
                         "predicted_bytes": [round(predicted[r]) for r in ranks], "errors": errors})
            worst = max(errors, key=abs)
            print(f"{model_name:30s} {plan:52s} worst rank {worst:+6.1%}  "
                  f"({', '.join(f'{e:+.1%}' for e in errors)})", flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    worst = [abs(max(r["errors"], key=abs)) for r in rows]
    return {"plans": len(rows), "median_worst_rank_abs_error": statistics.median(worst),
            "max_worst_rank_abs_error": max(worst), "within_5pct": sum(w <= 0.05 for w in worst)}


def cmd_memory_sweep(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py memory-sweep", description=DOCS["memory-sweep"].splitlines()[0])
    ap.add_argument("plans", nargs="*", help="plan strings (default: the built-in sweep); dtype as given")
    ap.add_argument("--model", default="gpt-tiny", help="the model of the plans given (default gpt-tiny)")
    ap.add_argument("--seq-len", type=int, default=SEQ)
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--json", default=None, help="write the rows and a summary here")
    args = ap.parse_args(argv)
    if outputs_refused("probe_host.py memory-sweep", {"--json": args.json}):
        return 2
    cases = [(args.model, p) for p in args.plans] if args.plans else DEFAULT_SWEEP
    try:
        rows = sweep(cases, args.seq_len, args.ray_address)
        s = summary(rows)
        print(f"{s['plans']} plans: worst-rank |error| median {s['median_worst_rank_abs_error']:.1%}, "
              f"max {s['max_worst_rank_abs_error']:.1%}; {s['within_5pct']} within 5%")
        if args.json:
            text = json.dumps({"seq_len": args.seq_len, "rows": rows, "summary": s}, indent=1) + "\n"
            write_atomic(args.json, text.encode())
    except SimexecError as exc:  # a bad plan or model, a failed run, an output that cannot be written
        print(f"probe_host.py memory-sweep: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _one_rank_steps(rp, instrs, *, steps, groups, tracer, device, seed=0, active=1):
    """A runner for `execute`: the first `active` ranks step the one-rank program, the rest wait."""
    import torch
    import torch.distributed as dist

    from simexec.exec.rank.interpreter import run_rank
    from simexec.calibrate.microbench import one_rank_program, StepClock, sync

    rp1, instrs1 = one_rank_program("gpt-tiny")
    times = []
    sync()
    if dist.get_rank() < active:
        out = run_rank(rp1, instrs1, steps=16, groups=None, tracer=StepClock(), device=torch.device("cpu"))
        times = out["step_times_s"][8:]
    sync()
    return {"losses": [], "step_times_s": [1.0], "peak_memory_bytes": 0, "extra": {"t": times}}


def _compute_ms(result) -> float:
    return sum(e.dur_us for e in result.trace.events if e.kind == "compute" and e.op != "optimizer") / 1e3


def cmd_sharing_check(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py sharing-check", description=DOCS["sharing-check"].split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from simexec.calibrate.runs import Session

    with Session() as s:
        for _ in range(args.rounds):
            bench = []
            for active in (1, 2):
                m = s.execute("gpt-tiny", "dp=2,gbs=2,dtype=fp32", steps=1,
                              runner=functools.partial(_one_rank_steps, active=active))
                bench.append(statistics.fmean(t for e in m.result.extra.values() for t in e["t"]))
            one, two = (s.execute("gpt-tiny", f"dp={n},gbs=8,dtype=fp32", steps=16) for n in (1, 2))
            print(f"benchmark, 2 ranks / 1: {bench[1] / bench[0]:.2f}x   "
                  f"plans, dp=2 / dp=1 compute: {_compute_ms(two.result) / _compute_ms(one.result):.2f}x   "
                  f"(steps {one.step_time_s * 1e3:.0f} and {two.step_time_s * 1e3:.0f} ms)", flush=True)
    return 0


PLAN = "dp=1,gbs=8,dtype=fp32"


def _bench_step(extra: dict) -> float:
    from simexec.calibrate.micro import merge_results

    recs = merge_results({str(k): v for k, v in extra.items()})["blocks"][0]["records"]
    return statistics.median(sum(r["t"][i] for r in recs) for i in range(len(recs[0]["t"])))


def _plan_equivalent(result) -> float:
    """The plan's steady step as two micro-batches and one optimizer step (from its trace)."""
    from simexec.trace.schema import steady_step

    step = steady_step(result.step_times_s, result.step_time_s)
    events = result.trace.events
    optim = sum(e.dur_us for e in events if e.phase == "optim") / 1e6
    micro = len({e.mb for e in events if e.mb >= 0})
    return (step - optim) * 2 / micro + optim


def cmd_bench_drift(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="probe_host.py bench-drift", description=DOCS["bench-drift"].split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from simexec.calibrate.runs import Session
    from simexec.calibrate.microbench import BenchConfig, run_microbench

    cfg = BenchConfig(gemm=(), attention=(), elementwise=(), copy_bytes=(), collective_bytes=(256,),
                      verbs=("allreduce",), p2p_bytes=(256,), block_models=(), block_mbs=(1,),
                      interleave_gemms=(1,), interleave_bytes=(16384,), interleave_iters=4, pingpong_s=0.1,
                      sharing_rounds=1)
    runner = functools.partial(run_microbench, config=cfg)
    t0 = time.perf_counter()
    with Session() as sess:
        for r in range(args.rounds):
            bench = _bench_step(sess.execute("gpt-tiny", "dp=4,gbs=4,dtype=fp32", steps=1, runner=runner,
                                             timeout_s=600.0).result.extra)
            plan = _plan_equivalent(sess.execute("gpt-tiny", PLAN, steps=16).result)
            print(f"[{time.perf_counter() - t0:6.1f} s] round {r}: benchmark step {bench * 1e3:.2f} ms, "
                  f"`{PLAN}` as the same work {plan * 1e3:.2f} ms, ratio {bench / plan:.3f}", flush=True)
    return 0


COMMANDS = {"wake-cpu": cmd_wake_cpu, "call-cpu": cmd_call_cpu, "idle-wake": cmd_idle_wake,
            "gloo-threads": cmd_gloo_threads, "comm-cpu": cmd_comm_cpu, "tensor-passes": cmd_tensor_passes,
            "collective-series": cmd_collective_series, "adam-passes": cmd_adam_passes,
            "collective-ops": cmd_collective_ops, "issue-cost": cmd_issue_cost, "thread-cpu": cmd_thread_cpu,
            "plan-cpu": cmd_plan_cpu, "knob-cost": cmd_knob_cost, "live-memory": cmd_live_memory,
            "memory-sweep": cmd_memory_sweep, "sharing-check": cmd_sharing_check, "bench-drift": cmd_bench_drift}


def main(argv: Optional[list[str]] = None) -> int:
    subcommands = "\n".join(f"  {name:18s} {DOCS[name].strip().splitlines()[0]}" for name in COMMANDS)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=subcommands,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=COMMANDS)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the subcommand's arguments (SUBCOMMAND --help)")
    args = ap.parse_args(argv)
    return COMMANDS[args.command](args.args)


if __name__ == "__main__":
    raise SystemExit(main())
