"""Communication costs of CPU ranks on the host model, fitted to the micro-benchmarks' collectives.

The host model (`simexec.sim.host.model`) prices a collective or message as a call latency, a hop latency
per step and the bytes a core copies, on cores the ranks share. `fit_comm_cpu` fits what a
collective costs the cores from the CPU time the benchmarks measured; `fit_comm` then fits the
collective call and hop latencies, the loopback bandwidth, the wake-up of an idle core and the
scheduler's slice jointly, each benchmark predicted by simulating it on the host model
(`host_comm_time`, `host_pingpong_time`, `host_loop_time`). Every benchmark is read at its mean
(`summed_mean`), here and in `simexec.calibrate.micro`, which runs these fits.
"""
from __future__ import annotations

import statistics
from typing import Callable, Optional, Sequence

from simexec.specs.cluster import ClusterSpec


def summed_mean(ts: Sequence[float]) -> float:
    """What one benchmark sample adds to a step: the mean of its timings. A step sums hundreds of
    instructions, so their means add up, not their medians, and on shared cores the tails are
    heavy (a busy host's 4-byte ping-pong: median 0.14 ms, mean 1.1 ms; a 2-rank compute-then-
    all-reduce loop: median 0.78 ms, mean 1.6 ms). Read at the median, the micro-benchmarks left
    every in-step collective that much too cheap."""
    return statistics.fmean(ts) if ts else float("nan")


def _comm_cluster(base: ClusterSpec, coll: float, hop: float, bw: float, slice_s: float, background: float,
                  cores: int, idle_wake: float = 0.0) -> ClusterSpec:
    from simexec.sim.profile import apply_profile

    return apply_profile(base, {"costs": {"collective_latency_s": coll, "intra_bw_eff": 1.0, "cores_shared": True,
                                          "sched_slice_s": slice_s, "background_load": background,
                                          "idle_wake_s": idle_wake},
                                "node": {"intra_latency_s": hop, "intra_bw": bw, "cpu_cores": cores}})


def bench_instr(verb: str, n: int, nbytes: float):
    """The instruction a micro-benchmark's collective (`p2p`: one message) over n ranks stands for."""
    from simexec.program.instructions import Instr

    kind = "send" if verb == "p2p" else "collective"
    return Instr(0, "bench", kind, "comm.x", f"{verb}@x", bytes=float(nbytes), group=tuple(range(n)), peer=1)


def host_comm_time(cluster: ClusterSpec, verb: str, n: int, nbytes: float, busy: int = 0) -> float:
    """Seconds of one collective (`p2p`: one message) over n ranks that all start it at once, on the
    host model of `simexec.sim.host.model` (`busy` other ranks computing meanwhile)."""
    import simpy

    from simexec.sim.host.cores import Cores
    from simexec.sim.host.model import HostCosts

    env = simpy.Environment()
    cores, hc = Cores.of(env, cluster), HostCosts.transfers_only(cluster)
    _occupy(env, cores, busy)
    ins = bench_instr(verb, n, nbytes)
    out = []
    t0 = env.now
    if verb == "broadcast":
        env.process(_root_of_broadcast(env, cores, hc, ins, lambda: out.append(env.now)))
    else:
        env.process(_called(env, cores, hc, ins, tuple(range(2 if verb == "p2p" else n)), lambda: out.append(env.now)))
    env.run(until=t0 + 10.0 if busy else None)
    return out[0] - t0 if out else float("inf")


def _called(env, cores, hc, ins, members, done):
    """A collective's members each pay its call on their own thread (`collective_issue_s`, which
    `HostCosts.transfer` takes out of the call's latency), then the transfer runs."""
    issue = hc.issue_s if ins.kind == "collective" else 0.0
    if issue > 0:
        yield env.all_of([cores.run((r, "main"), issue) for r in members])
    hc.transfer(env, cores, ins, members, done)


def _root_of_broadcast(env, cores, hc, ins, done):
    """A broadcast as its root times it (the micro-benchmark's clock runs there): gloo's binomial tree
    has the root send in each of its rounds and wait for nothing but the sends being written, so it
    returns after the call and its own bursts, while the other members still receive. No plan lowers
    a broadcast; this keeps the benchmark from pulling the call latency towards zero."""
    steps, chunk = hc.comm_steps(ins)
    call, burst, _wire = hc.comm_seconds(steps, chunk)
    if call > 0:
        yield env.timeout(call)
    for _ in range(steps):
        yield cores.run((0, "comm"), burst)
    done()


def _occupy(env, cores, busy: int) -> None:
    """`busy` threads computing for ever, already running (past any wake-up) when this returns."""
    for b in range(busy):
        cores.run(100 + b, 1e9)
    if busy:
        env.run(until=env.now + 0.1)


def host_pingpong_time(cluster: ClusterSpec, nbytes: float = 4.0, busy: int = 0, iters: int = 8) -> float:
    """Seconds of one round trip of two ranks sending a message back and forth in a tight loop (the
    micro-benchmark `pingpong`), `busy` other ranks computing meanwhile, on the host model: the
    cores idle only while a message is on the wire."""
    import simpy

    from simexec.program.instructions import Instr
    from simexec.sim.host.cores import Cores
    from simexec.sim.host.model import HostCosts

    env = simpy.Environment()
    cores, hc = Cores.of(env, cluster), HostCosts.transfers_only(cluster)
    _occupy(env, cores, busy)
    ins = Instr(0, "bench", "send", "comm.x", "p2p@x", bytes=float(nbytes), group=(0, 1), peer=1)
    marks: list[float] = []

    def loop():
        for _ in range(2 * iters):
            marks.append(env.now)
            done = env.event()
            hc.transfer(env, cores, ins, (0, 1), done.succeed)
            yield done
        marks.append(env.now)

    env.process(loop())
    env.run(until=env.now + 10.0 if busy else None)
    skip = 2
    return (marks[-1] - marks[skip]) / ((len(marks) - 1 - skip) / 2)


def host_loop_time(cluster: ClusterSpec, n: int, compute_s: float, nbytes: float, iters: int = 8) -> float:
    """Seconds per iteration of n ranks that each compute `compute_s` CPU-seconds and then all-reduce
    `nbytes` together, in a loop (the micro-benchmark `interleaved`), on the host model."""
    import simpy

    from simexec.program.instructions import Instr
    from simexec.sim.host.cores import Cores
    from simexec.sim.host.model import HostCosts

    env = simpy.Environment()
    cores, hc = Cores.of(env, cluster), HostCosts.transfers_only(cluster)
    ins = Instr(0, "bench", "collective", "comm.x", "allreduce@x", bytes=float(nbytes), group=tuple(range(n)))
    done = [env.event() for _ in range(iters)]
    arrived = [0] * iters
    marks: list[float] = []
    call = compute_s + hc.issue_s  # the collective's call runs on the same thread

    def rank(r: int):
        for it in range(iters):
            if r == 0:
                marks.append(env.now)
            if call > 0:
                yield cores.run(r, call)
            arrived[it] += 1
            if arrived[it] == n:
                hc.transfer(env, cores, ins, tuple(range(n)), done[it].succeed)
            yield done[it]
        if r == 0:
            marks.append(env.now)

    for r in range(n):
        env.process(rank(r))
    env.run()
    skip = min(2, iters - 1)
    return (marks[-1] - marks[skip]) / (iters - skip)


def fit_comm_cpu(colls: list[dict], p2p: list[dict], issue_s: float = 0.0) -> Optional[dict]:
    """What a collective or message costs a member's cores, from the CPU time the micro-benchmarks
    measured for each (every thread of the process, less a collective's call, `issue_s`, which the
    calling thread pays; records without `cpu` are left out): per step
    (`HostCosts.comm_steps`), `comm_cpu` seconds for the hand-offs between gloo's threads and the
    kernel plus the step's bytes at `intra_bw` bytes per second of a core. Least squares on the log
    means, started from the linear fit on relative errors: a relative error counts a time predicted
    half as long as -0.5 and one predicted twice as long as +1, so that fit alone runs low (on 42 of
    the 55 records of the 2026-11-24 09:03 recording, a byte 1.7x too cheap). None without enough
    records."""
    import numpy as np
    from scipy.optimize import least_squares, lsq_linear

    from simexec.sim.host.model import HostCosts

    rows, ys, names = [], [], []
    recs = [(r["verb"], r["n"], r) for r in colls if r.get("mode", "solo") == "solo"] + [("p2p", 2, r) for r in p2p]
    for verb, n, rec in recs:
        if not rec.get("cpu"):
            continue
        steps, chunk = HostCosts.comm_steps(bench_instr(verb, n, rec["bytes"]))
        cpu = summed_mean(rec["cpu"]) - (issue_s if verb != "p2p" else 0.0)
        if steps <= 0 or cpu <= 0:
            continue
        rows.append([steps, steps * chunk])
        ys.append(cpu)
        names.append(f"{verb}@{n}:{int(rec['bytes'])}")
    if len(rows) < 3:
        return None
    A, y = np.asarray(rows, float), np.asarray(ys, float)
    w = 1.0 / y
    start = lsq_linear(A * w[:, None], y * w, bounds=(0.0, np.inf)).x
    sol = np.exp(least_squares(lambda x: np.log(A @ np.exp(x)) - np.log(y),
                               np.log(np.maximum(start, [1e-7, 1e-12]))).x)
    per_step, per_byte = float(sol[0]), float(sol[1])
    pred = A @ sol
    return {"comm_cpu": max(1e-7, per_step), "intra_bw": 1.0 / per_byte if per_byte > 0 else None,
            "rel_err": {k: float(p / t - 1) for k, p, t in zip(names, pred, y)}}


COMM_PARAMS = ("coll_latency", "hop_latency", "intra_bw", "idle_wake", "slice")


def fit_comm(colls: list[dict], p2p: list[dict], pingpong: list[dict], base: ClusterSpec, *, background: float,
             cores: int, fixed: Optional[dict[str, float]] = None, loops: Sequence[dict] = (),
             gemm_s: Optional[Callable[[float], float]] = None) -> dict:
    """The scheduler slice, the hop latency, the collective call latency, the loopback bandwidth
    (bytes per second of a core) and the wake-up of an idle core, jointly: least squares (soft-L1)
    on log times of every collective and message measured alone (after a barrier: the cores idle),
    of the small ping-pong in a tight loop with and without other ranks computing (the cores idle
    only while a message is on the wire, or never), and of the compute-then-all-reduce loops
    (`loops`, their matmuls priced by `gemm_s(flops)`), each predicted by the host model
    (`host_comm_time`, `host_pingpong_time`, `host_loop_time`, `simexec.sim.host.model`) with `base`'s
    `comm_cpu_s`. `fixed` holds parameters measured otherwise (`COMM_PARAMS` names): the loops are
    what separates the slice from the hop latency, so without them the slice must be given."""
    import numpy as np
    from scipy.optimize import least_squares

    fixed = dict(fixed or {})
    # (what, ranks, bytes, other ranks computing (loops: CPU-seconds of compute per iteration), seconds)
    obs = [(r["verb"], r["n"], r["bytes"], 0, summed_mean(r["t"])) for r in colls
           if r.get("mode", "solo") == "solo"]
    obs += [("p2p", 2, r["bytes"], 0, summed_mean(r["t"])) for r in p2p]
    obs += [("pingpong", 2, 4.0, int(r.get("busy", 0)), summed_mean(r["t"])) for r in pingpong]  # round trips
    if gemm_s is not None:
        obs += [("loop", r["n"], r["bytes"], r["gemms"] * gemm_s(r["gemm_flops"]), summed_mean(r["t"]))
                for r in loops]
    obs = [o for o in obs if o[4] > 0]
    start = dict(zip(COMM_PARAMS, (base.costs.collective_latency_s or 100e-6, base.node.intra_latency_s or 50e-6,
                                   base.node.intra_bw * base.costs.intra_bw_eff,
                                   getattr(base.costs, "idle_wake_s", 0.0) or 100e-6,
                                   getattr(base.costs, "sched_slice_s", 0.0) or 1.5e-3)))
    bounds = dict(zip(COMM_PARAMS, ((1e-7, 1e-1), (1e-7, 1e-1), (1e6, 1e12), (1e-6, 2e-2), (1e-5, 2e-2))))
    free = [n for n in COMM_PARAMS if n not in fixed]
    if not obs or not free:
        return {**start, **fixed}

    def values(x) -> dict[str, float]:
        return {**fixed, **dict(zip(free, (float(v) for v in np.exp(x))))}

    def pred(x):
        v = values(x)
        c = _comm_cluster(base, v["coll_latency"], v["hop_latency"], v["intra_bw"], v["slice"], background, cores,
                          v["idle_wake"])
        return np.array([host_loop_time(c, n, busy, b) if verb == "loop" else host_pingpong_time(c, b, busy)
                         if verb == "pingpong" else host_comm_time(c, verb, n, b, busy)
                         for verb, n, b, busy, _ in obs])

    y = np.log([o[4] for o in obs])
    lo, hi = (np.log([bounds[n][i] for n in free]) for i in (0, 1))
    x0 = np.clip(np.log([start[n] for n in free]), lo + 1e-6, hi - 1e-6)
    res = least_squares(lambda x: np.log(pred(x)) - y, x0, loss="soft_l1", f_scale=0.2, diff_step=0.01,
                        bounds=(lo, hi))
    p = pred(res.x)
    return {**values(res.x),
            "rel_err": {f"{v}@{n}:{int(b)}{'/busy' + format(busy, '.3g') if busy else ''}": float(pv / t - 1)
                        for (v, n, b, busy, t), pv in zip(obs, p)}}
