"""Micro-benchmarks of this machine, run on the executor's own Ray actors (one per rank).

`run_microbench` is a runner for `simexec.exec.api.execute(..., runner=...)`: instead of a training
step, every rank runs the same sequence of benchmarks, coordinated by barriers, and returns its
timings as the run's `extra`. What it measures, each with the tensors, process groups and threads
of a real run (torch on the CPU with one thread per rank, gloo over loopback):

- `ops`: the cost of dispatching one tiny PyTorch operator, and of one tiny autograd backward;
- `gemm`, `attention`, `elementwise`: matmuls, scaled-dot-product attention (forward and
  backward) and element-wise adds over a range of sizes, on one rank while the others wait;
- `blocks`: the executor's own instructions (a one-rank step of the model's program, each
  instruction timed), on one rank alone; also of moe-tiny's (`block_models`), and the model's
  step under full recompute (`recompute="full"`: its layers' first forward runs without autograd);
- `sharing`: that same step on 1, 2, ... N ranks at once: how much slower compute gets when ranks
  share the cores (each step's begin and end kept, so that only steps all ranks ran together count);
- `collectives`: all-reduce, all-gather, reduce-scatter, all-to-all and broadcast over groups of 2
  and of all ranks, across message sizes, one group alone and every disjoint group at once; with
  the CPU time the group's first rank spent on each (`cpu`: every thread of its process);
- `interleaved`: matmuls then an all-reduce, in a loop, over 2 and over all ranks: a collective's
  cost inside a step, where its members arrive from computing on shared cores;
- `p2p`: send/recv between two ranks across sizes (time and CPU per message), and a small
  ping-pong while the other ranks compute (how long a woken rank waits for a core);
- `copies`: host memory copies across sizes.

gloo's event loops run as the executor runs them (at `SCHED_IDLE`, `simexec.exec.runtime.gloo_loops`; the
benchmarks' own groups too), and `extra["gloo_loops_idled"]` says how many did, for the fit.

Times are per repetition (seconds); the fit reads each set at its mean (`simexec.calibrate.comm.summed_mean`).
`count_dispatch` counts the aten operators each instruction of the executor dispatches (the
`simexec.sim.host.operators.DISPATCH` table).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from simexec.exec.rank.collectives import all_gather_tensor, reduce_scatter_tensor
from simexec.exec.runtime.gloo_loops import idle_gloo_loops
from simexec.exec.rank.interpreter import run_rank



@dataclass
class BenchConfig:
    """What to measure; `quick()` is the demo's smaller set."""

    model: str = "gpt-tiny"
    reps: int = 9
    # collectives and messages have heavy tails and are read at their mean: more samples
    comm_reps: int = 25
    gemm: tuple = ((64, 64, 64), (64, 64, 256), (64, 256, 64), (128, 128, 128), (64, 512, 512),
                   (256, 256, 256), (512, 512, 512))
    attention: tuple = ((1, 2, 64, 16), (1, 4, 64, 16), (2, 4, 64, 16), (1, 4, 256, 16), (1, 8, 256, 32))
    elementwise: tuple = (1 << 8, 1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
    collective_bytes: tuple = (256, 4096, 65536, 1 << 20, 4 << 20)
    verbs: tuple = ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast")
    p2p_bytes: tuple = (256, 4096, 65536, 1 << 20, 4 << 20)
    copy_bytes: tuple = (1 << 12, 1 << 16, 1 << 20, 1 << 23)
    block_steps: int = 9  # the first is discarded: each instruction's mean over 8 steps, as many as a plan's steady state
    block_mbs: tuple = (1, 2, 4)  # micro-batch sizes of the one-rank step: per-byte costs need two sizes at least
    # other models whose one-rank step is timed too (at micro-batches 1 and 2): their families' blocks
    # (MoE's router and experts, SwiGLU, RMSNorm, RoPE) get element-wise costs of their own
    block_models: tuple = ("moe-tiny",)
    sharing_steps: int = 24
    sharing_rounds: int = 2
    pingpong_s: float = 1.0
    interleave_gemms: tuple = (1, 4, 16)  # 128^3 matmuls between all-reduces (a tensor-parallel layer's pattern)
    interleave_bytes: tuple = (16384, 262144)
    interleave_iters: int = 48
    issue_bytes: int = 8192  # a tensor-parallel activation of the small models
    issue_reps: int = 100

    @staticmethod
    def quick(model: str = "gpt-tiny") -> "BenchConfig":
        return BenchConfig(model=model, reps=5, comm_reps=9, gemm=((64, 64, 64), (64, 64, 256), (128, 128, 128), (256, 256, 256)),
                           attention=((1, 2, 64, 16), (1, 4, 64, 16), (1, 4, 256, 16)),
                           elementwise=(1 << 10, 1 << 16, 1 << 20), collective_bytes=(256, 16384, 1 << 20),
                           p2p_bytes=(256, 16384, 1 << 20), copy_bytes=(1 << 16, 1 << 20), block_steps=4, block_mbs=(1, 4),
                           block_models=(), pingpong_s=0.5,
                           interleave_gemms=(1, 16), interleave_bytes=(16384,), interleave_iters=24, issue_reps=30)


def sync(group=None) -> None:
    """A barrier over `group` (the world by default), so that timed work starts together."""
    dist.barrier(group=group)


def _time(fn: Callable[[], object], reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class Bench:
    """One rank's micro-benchmarks, with the process groups they run over."""

    def __init__(self, cfg: BenchConfig, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.out: dict[str, list] = {}
        pairs = [tuple(range(i, i + 2)) for i in range(0, world - 1, 2)]
        self.groups: dict[tuple[int, ...], object] = {}
        for g in pairs + ([tuple(range(world))] if world > 2 else []):
            pg = dist.new_group(list(g))  # collective over the world: every rank creates every group
            if rank in g:
                self.groups[g] = pg
        self.pairs = pairs
        if world >= 2:
            self.groups.setdefault(tuple(range(world)), dist.group.WORLD)
        # each new group starts event loops of its own: they run as the executor runs its groups' loops
        self.loops_idled = idle_gloo_loops()

    def add(self, kind: str, **rec) -> None:
        self.out.setdefault(kind, []).append(rec)

    # --- compute, on rank 0 while the others wait ---------------------------------------------------
    def compute(self) -> None:
        cfg = self.cfg
        if self.rank == 0:
            a = torch.zeros(1)
            ts = _time(lambda: a.add_(1.0), 200, warmup=20)
            self.add("ops", what="op", t=ts)
            x = torch.zeros(4, requires_grad=True)

            def tiny_bwd():
                y = x * 2.0
                torch.autograd.backward(y, torch.ones(4))

            ts = _time(tiny_bwd, 100, warmup=10)
            self.add("ops", what="bwd", ops=3, t=ts)
            for m, k, n in cfg.gemm:
                p, q = torch.randn(m, k), torch.randn(k, n)
                ts = _time(lambda: p @ q, cfg.reps)
                self.add("gemm", m=m, k=k, n=n, flops=2.0 * m * k * n, bytes=4.0 * (m * k + k * n + m * n), t=ts)
            for b, h, s, d in cfg.attention:
                q, k_, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
                ts = _time(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True), cfg.reps)
                flops = 2.0 * b * h * s * (s * 0.5) * (2 * d)
                self.add("attention", phase="fwd", b=b, h=h, s=s, d=d, flops=flops, bytes=4.0 * 4 * b * h * s * d, t=ts)
                o = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
                g = torch.ones_like(o)
                ts = _time(lambda: torch.autograd.grad(o, (q, k_, v), g, retain_graph=True), cfg.reps)
                self.add("attention", phase="bwd", b=b, h=h, s=s, d=d, flops=2 * flops, bytes=4.0 * 8 * b * h * s * d, t=ts)
            for n in cfg.elementwise:
                p, q = torch.randn(n), torch.randn(n)
                r = torch.empty(n)
                ts = _time(lambda: torch.add(p, q, out=r), cfg.reps)
                self.add("elementwise", n=n, bytes=12.0 * n, t=ts)
            for n in cfg.copy_bytes:
                src, dst = torch.randn(n // 4), torch.empty(n // 4)
                ts = _time(lambda: dst.copy_(src), cfg.reps)
                self.add("copies", bytes=float(n), t=ts)
        sync()

    # --- the executor's blocks: alone, then on 1..N ranks at once ------------------------------------
    def blocks(self, rp1, instrs1) -> None:
        if self.rank == 0:
            runs = [(None, mbs) for mbs in self.cfg.block_mbs]
            runs += [(other, mbs) for other in self.cfg.block_models if other != self.cfg.model for mbs in (1, 2)]
            for other, mbs in runs:
                rp, instrs = (rp1, instrs1) if (other, mbs) == (None, 1) else \
                    one_rank_program(other or self.cfg.model, mbs)
                rec = _Recorder()
                run_rank(rp, instrs, steps=self.cfg.block_steps, groups=None, tracer=rec, device=torch.device("cpu"))
                self.add("blocks", mbs=mbs, records=rec.best(), **({"model": other} if other else {}))
            rp, instrs = one_rank_program(self.cfg.model, 1, recompute="full")
            rec = _Recorder()
            run_rank(rp, instrs, steps=self.cfg.block_steps, groups=None, tracer=rec, device=torch.device("cpu"))
            self.add("blocks", mbs=1, recompute="full", records=rec.best())
        sync()
        for i, n in enumerate(list(range(1, self.world + 1)) * self.cfg.sharing_rounds):
            sync()
            if self.rank < n:
                clock = StepClock()
                out = run_rank(rp1, instrs1, steps=self.cfg.sharing_steps, groups=None, tracer=clock,
                               device=torch.device("cpu"))
                self.add("sharing", active=n, round=i, steps=out["step_times_s"], spans=clock.spans())
            sync()

    # --- communication -------------------------------------------------------------------------------
    def _coll(self, verb: str, group: tuple[int, ...], nbytes: int):
        pg = self.groups[group]
        n = len(group)
        el = max(n, nbytes // 4 // n * n)
        if verb == "allreduce":
            x = torch.zeros(el)
            return lambda: dist.all_reduce(x, group=pg)
        if verb == "allgather":
            x, out = torch.zeros(el // n), torch.zeros(el)
            return lambda: all_gather_tensor(out, x, group=pg)
        if verb == "reducescatter":
            x, out = torch.zeros(el), torch.zeros(el // n)
            return lambda: reduce_scatter_tensor(out, x, group=pg)
        if verb == "alltoall":
            x, out = torch.zeros(el), torch.zeros(el)
            return lambda: dist.all_to_all_single(out, x, group=pg)
        if verb == "broadcast":
            x = torch.zeros(el)
            return lambda: dist.broadcast(x, src=group[0], group=pg)
        raise ValueError(verb)

    def collectives(self) -> None:
        cfg = self.cfg
        sizes = sorted({len(g) for g in self.groups})
        for size in sizes:
            all_groups = [g for g in ([*self.pairs] if size == 2 else [tuple(range(self.world))])]
            for mode in ("solo", "all") if len(all_groups) > 1 else ("solo",):
                active = all_groups[:1] if mode == "solo" else all_groups
                mine = next((g for g in active if self.rank in g), None)
                for verb in cfg.verbs:
                    for nbytes in cfg.collective_bytes:
                        sync()
                        if mine is not None:
                            fn = self._coll(verb, mine, nbytes)
                            pg = self.groups[mine]
                            ts, cpu = [], []
                            for r in range(cfg.comm_reps + 2):
                                dist.barrier(group=pg)
                                t0, c0 = time.perf_counter(), time.process_time()
                                fn()
                                if r >= 2:
                                    ts.append(time.perf_counter() - t0)
                                    cpu.append(time.process_time() - c0)
                            if self.rank == mine[0]:
                                self.add("collectives", verb=verb, group=list(mine), n=len(mine), mode=mode,
                                         concurrent=len(active), bytes=float(nbytes), t=ts, cpu=cpu)
        sync()

    def issue(self) -> None:
        """The CPU a rank's own thread spends in the call of an asynchronous all-reduce (torch.distributed's
        Python, gloo's work set up and queued for its worker thread), the call alone, as the
        interpreter makes it: both members of the first pair call together after a barrier."""
        cfg = self.cfg
        sync()
        if self.pairs and self.rank in self.pairs[0]:
            g = self.pairs[0]
            pg = self.groups[g]
            x = torch.zeros(cfg.issue_bytes // 4)
            cpu = []
            for r in range(cfg.issue_reps + 5):
                dist.barrier(group=pg)
                c0 = time.thread_time()
                work = dist.all_reduce(x, group=pg, async_op=True)
                c1 = time.thread_time()
                work.wait()
                if r >= 5:
                    cpu.append(c1 - c0)
            if self.rank == g[0]:
                self.add("issue", verb="allreduce", n=len(g), bytes=float(x.numel() * 4), cpu=cpu)
        sync()

    def interleaved(self) -> None:
        """Compute, then an all-reduce, in a loop over a group of 2 and of all ranks (the others
        idle): a collective inside a step costs more than one alone, since its members arrive from
        computing on shared cores rather than together from a barrier."""
        cfg = self.cfg
        a = torch.randn(128, 128)
        for g in self.pairs[:1] + ([tuple(range(self.world))] if self.world > 2 else []):
            for nbytes in cfg.interleave_bytes:
                msg = torch.zeros(max(1, int(nbytes) // 4))
                for k in cfg.interleave_gemms:
                    sync()
                    if self.rank not in g:
                        continue
                    pg = self.groups[g]
                    dist.barrier(group=pg)
                    ts = []
                    for it in range(cfg.interleave_iters + 3):
                        t0 = time.perf_counter()
                        for _ in range(k):
                            a @ a
                        dist.all_reduce(msg, group=pg)
                        if it >= 3:
                            ts.append(time.perf_counter() - t0)
                    if self.rank == g[0]:
                        self.add("interleaved", n=len(g), gemms=k, gemm_flops=2.0 * 128 ** 3, bytes=float(nbytes),
                                 t=ts)
        sync()

    def p2p(self) -> None:
        cfg = self.cfg
        if self.world < 2:
            return
        for nbytes in cfg.p2p_bytes:
            sync()
            if self.rank in (0, 1):
                x = torch.zeros(max(1, nbytes // 4))
                ts, cpu = [], []
                pair = self.groups[(0, 1)]
                for r in range(cfg.comm_reps + 2):
                    dist.barrier(group=pair)
                    t0, c0 = time.perf_counter(), time.process_time()
                    if self.rank == 0:
                        dist.send(x, 1)
                        dist.recv(x, 1)  # a zero-byte-ish ack would do; the echo measures the round trip
                    else:
                        dist.recv(x, 0)
                        dist.send(x, 0)
                    if r >= 2:  # per message: each rank sent one and received one
                        ts.append((time.perf_counter() - t0) / 2)
                        cpu.append((time.process_time() - c0) / 2)
                if self.rank == 0:
                    self.add("p2p", bytes=float(nbytes), t=ts, cpu=cpu)
        # ping-pong of small messages while the other ranks compute: a woken rank waits for a core.
        # Everyone runs for the same window; rank 0 tells rank 1 in each message whether to go on.
        window = cfg.pingpong_s
        for busy in sorted({0, self.world - 2}):
            sync()
            t_end = time.perf_counter() + window
            if self.rank in (0, 1):
                x = torch.ones(1)
                ts = []
                while True:
                    t0 = time.perf_counter()
                    if self.rank == 0:
                        x.fill_(1.0 if t0 < t_end - 0.02 else 0.0)
                        dist.send(x, 1)
                        dist.recv(x, 1)
                    else:
                        dist.recv(x, 0)
                        dist.send(x, 0)
                    ts.append(time.perf_counter() - t0)
                    if float(x) == 0.0:
                        break
                if self.rank == 0:
                    self.add("pingpong", busy=busy, t=ts[1:-1] or ts)
            elif self.rank < 2 + busy:
                a = torch.randn(64, 64)
                while time.perf_counter() < t_end:
                    a = torch.tanh(a @ a)
        sync()


class StepClock:
    """A tracer for `run_rank` that keeps when each step began and ended (perf_counter: one clock
    for every process of the host), so that ranks' steps can be compared over a common window."""

    def __init__(self):
        self.t: dict[int, list[float]] = {}

    def begin(self, ins, step: int) -> None:
        self.t.setdefault(step, [time.perf_counter(), 0.0])

    def end(self, ins, step: int) -> None:
        self.t[step][1] = time.perf_counter()

    def counter(self, category: str, nbytes: float) -> None:
        pass

    def spans(self) -> list[list[float]]:
        return [self.t[k] for k in sorted(self.t)]


class _Recorder:
    """A tracer for `run_rank` that keeps each compute instruction's times over the steps after the first."""

    def __init__(self):
        self.open: dict[str, float] = {}
        self.times: dict[str, list] = {}
        self.meta: dict[str, tuple] = {}

    def begin(self, ins, step: int) -> None:
        self.open[ins.name] = time.perf_counter()

    def end(self, ins, step: int) -> None:
        t0 = self.open.pop(ins.name, None)
        if t0 is None or ins.kind != "compute" or step == 0:
            return
        self.times.setdefault(ins.name, []).append(time.perf_counter() - t0)
        self.meta[ins.name] = (ins.phase, ins.block, ins.op, ins.flops, ins.bytes, ins.layer, ins.mb)

    def counter(self, category: str, nbytes: float) -> None:
        pass

    def best(self) -> list[dict]:
        out = []
        for name, ts in self.times.items():
            phase, block, op, flops, nbytes, layer, mb = self.meta[name]
            out.append({"name": name, "phase": phase, "block": block, "op": op, "flops": flops, "bytes": nbytes,
                        "t": ts})
        return out


def one_rank_program(model, mbs: int = 1, recompute: str = "none"):
    """A one-rank program of `model` (a preset name or a ModelSpec) at this micro-batch size."""
    from simexec.specs.cluster import get_cluster
    from simexec.program.lower import lower
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve

    spec = get_model(model) if isinstance(model, str) else model
    rp = resolve(spec, get_cluster("local"), load_plan(f"dp=1,mbs={mbs},gbs={2 * mbs},dtype=fp32,recompute={recompute}"))
    return rp, lower(rp, symmetric=False).ranks[0]


def run_microbench(rp, instrs, *, steps: int, groups, tracer, device, seed: int = 0,
                   config: Optional[BenchConfig] = None) -> dict:
    """A runner for `execute`: every rank runs the benchmarks; `extra` holds this rank's timings."""
    cfg = config or BenchConfig()
    torch.manual_seed(seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    b = Bench(cfg, rank, world)
    t0 = time.perf_counter()
    rp1, instrs1 = one_rank_program(cfg.model)
    timings = {}
    for name, fn in (("compute", b.compute), ("blocks", lambda: b.blocks(rp1, instrs1)),
                     ("collectives", b.collectives), ("issue", b.issue), ("interleaved", b.interleaved),
                     ("p2p", b.p2p)):
        t = time.perf_counter()
        fn()
        timings[name] = time.perf_counter() - t
    return {"losses": [], "step_times_s": [time.perf_counter() - t0], "peak_memory_bytes": 0,
            "extra": {"results": b.out, "timings": timings, "config": asdict(cfg), "rank": rank, "world": world,
                      "gloo_loops_idled": b.loops_idled}}


# --- dispatch counts (the simulator's DISPATCH table) ------------------------------------------------------
def _op_count():
    """A TorchDispatchMode that counts the aten operators dispatched while it is active (`.n`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    return _Count()


class CountTracer:
    """A tracer that keeps, per `<phase>.<block>` compute instruction, the operators it dispatched
    (the last micro-batch's where they differ)."""

    def __init__(self, cnt):
        self.cnt, self.open, self.out = cnt, {}, {}

    def begin(self, ins, step):
        self.open[ins.name] = self.cnt.n

    def end(self, ins, step):
        n0 = self.open.pop(ins.name, None)
        if n0 is not None and ins.kind == "compute" and ins.block not in ("optim", "cpu_optim"):
            self.out[f"{ins.phase}.{ins.block}"] = self.cnt.n - n0

    def counter(self, *a):
        pass


def count_dispatch(model="gpt-tiny") -> dict[str, int]:
    """Aten operators each `<phase>.<block>` instruction of a one-rank step dispatches (the last
    micro-batch's count where they differ), in this process. `model` is a preset name or a ModelSpec;
    the count depends on its features, not its sizes (`simexec.program.dispatch_key`), so a large
    model is counted on a copy shrunk to a few MB (`shrunk`)."""
    from simexec.specs.model import get_model

    spec = get_model(model) if isinstance(model, str) else model
    rp, instrs = one_rank_program(shrunk(spec))
    cnt = _op_count()
    tr = CountTracer(cnt)
    with cnt:
        run_rank(rp, instrs, steps=1, groups=None, tracer=tr, device=torch.device("cpu"))
    return tr.out


def count_dispatch_plan(model: str, plan: str, timeout_s: float = 120.0) -> dict[str, int]:
    """`count_dispatch` for a plan of several ranks (context parallelism changes the attention block):
    its ranks run one step as spawned gloo processes on 127.0.0.1; rank 0's counts."""
    from simexec.specs.cluster import get_cluster
    from simexec.exec.runtime.spawn import spawn_ranks
    from simexec.specs.model import get_model
    from simexec.specs.plan import parse_plan, resolve

    world = resolve(get_model(model), get_cluster("local"), parse_plan(plan)).world
    return spawn_ranks(_count_rank, world, (model, plan), timeout_s)


def _count_rank(rank: int, world: int, port: int, model: str, plan: str, out) -> None:
    with plan_rank(rank, world, port, model, plan) as (rp, prog, groups):
        cnt = _op_count()
        tr = CountTracer(cnt)
        with cnt:
            run_rank(rp, prog.ranks[rank], steps=1, groups=groups, tracer=tr, device=torch.device("cpu"))
        if rank == 0:
            out.put(tr.out)


@contextlib.contextmanager
def plan_rank(rank: int, world: int, port: int, model: str, plan: str):
    """One rank of a plan on the `local` cluster, in a gloo world on 127.0.0.1 of one intra-op thread:
    (resolved plan, program, process groups); the ranks meet at a barrier before the world ends."""
    from simexec.specs.cluster import get_cluster
    from simexec.exec.runtime.groups import GroupTable, group_specs
    from simexec.program.lower import lower
    from simexec.specs.model import get_model
    from simexec.specs.plan import parse_plan, resolve

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rp = resolve(get_model(model), get_cluster("local"), parse_plan(plan))
        prog = lower(rp, symmetric=False)
        yield rp, prog, GroupTable(group_specs(rp, prog), rank, timeout_s=60)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def shrunk(model):
    """The same architecture at toy sizes (two layers, hidden 64, vocabulary 256, sequence 32): what
    sets the operator count (norm, gating, biases, positions, grouped heads, experts) is kept."""
    from simexec.specs.model import MoESpec

    heads = 4
    kv = heads if model.kv_heads == model.heads else (1 if model.kv_heads == 1 else 2)
    moe = model.moe
    layers = 2
    if moe is not None:
        dense = min(moe.first_dense_layers, 1)
        layers = dense + 1
        moe = MoESpec(**{**moe.model_dump(), "expert_ffn": 32, "first_dense_layers": dense})
    update = {"layers": layers, "hidden": 64, "heads": heads, "kv_heads": kv, "head_dim": 16, "ffn": 128,
              "vocab": 256, "seq_len": 32, "moe": moe}
    if model.max_positions is not None:
        update["max_positions"] = 32
    if model.is_mla:
        update.update(q_lora_rank=16 if model.q_lora_rank else None, kv_lora_rank=16, qk_rope_head_dim=8,
                      v_head_dim=16, kv_heads=heads)
    return model.model_copy(update=update)
