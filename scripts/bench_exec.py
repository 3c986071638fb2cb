"""Benchmark the executor on local ranks: Ray start-up, step time against torch's own DDP (dp plans)
and FSDP2 (`fully_shard`, zero=3 plans), and tracing on against off.

Everything runs in the same Ray actors, one per rank, so the comparison shares processes, CPU shares
and process groups: each actor trains three variants side by side, step by step in rotating order
(`lockstep`): the executor with tracing (the interpreter with a `Tracer`), the executor without
(the interpreter's null tracer), and the torch baseline on the same model maths
(`simexec.exec.nn.gpt.GPT` blocks wrapped in `nn.Module`s), data (`simexec.exec.nn.data`),
micro-batching (DDP `no_sync` / FSDP2 `set_requires_gradient_sync` for all but the last micro-batch)
and Adam (`simexec.exec.nn.optim`). A step's time is the slowest rank's. The headline ratios are
paired: the median over steps of the ratio of two variants' times in that step (they ran within a
second of each other, so the load of a shared machine, which moves step times by tens of percent,
cancels); the medians and minima (least disturbed step) of each variant are given too.

The model (default `bench`, a GPT-2-shaped 4-layer model of hidden 256, vocabulary 4096, sequence
128: 5.3 M parameters) is sized so that compute dominates the interpreter's per-instruction cost, as
in real use; `--model gpt-tiny` shows the overhead-bound extreme. `--overhead` first measures the
interpreter's own cost per instruction on one rank in this process (no Ray): the executor's step
against the same blocks chained in one autograd graph, as a time per instruction.

    python scripts/bench_exec.py [--model bench] [--seq-len 128] [--dp 2] [--gbs 8] [--mbs 2]
                                 [--steps 21] [--overhead] [--only ddp|fsdp2] [--json bench.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.outputs import outputs_refused, write_atomic  # noqa: E402

VARIANTS = ("traced", "untraced", "torch")


def bench_model(seq_len: int):
    """The default benchmark model: GPT-2 shaped, big enough for compute to dominate on a CPU core."""
    from simexec.specs.model import ModelSpec

    return ModelSpec(name="bench", layers=4, hidden=256, heads=8, kv_heads=8, head_dim=32, ffn=1024, gated=False,
                     vocab=4096, seq_len=seq_len, norm="layernorm", bias=True, learned_pos=True,
                     source="scripts/bench_exec.py")


def get_bench_model(name: str, seq_len: int):
    from simexec.specs.model import get_model

    return bench_model(seq_len) if name == "bench" else get_model(name)


def torch_model(m, seed: int):
    """The full model as nn.Modules (embedding, one module per layer, head) calling the very blocks
    of `simexec.exec.nn.gpt.GPT`, so DDP and FSDP2 see the executor's maths with a module per unit."""
    import torch.nn as nn

    from simexec.exec.nn.gpt import GPT
    from simexec.exec.nn.param_layout import Layout, init_full, param_specs

    if m.moe is not None:
        raise SystemExit("the torch baselines cover dense models only")
    full = init_full(m, seed)
    names: dict[int, list[str]] = {}
    for s in param_specs(m):
        names.setdefault(s.unit, []).append(s.name)

    class Unit(nn.Module):
        def __init__(self, unit: int):
            super().__init__()
            self.unit, self.names = unit, names[unit]
            self.ps = nn.ParameterList([nn.Parameter(full[n].clone()) for n in self.names])

        def gpt(self):
            return GPT(m, Layout(), dict(zip(self.names, self.ps)))

    class Embed(Unit):
        def forward(self, tokens, pos):
            return self.gpt().embed(tokens, pos)

    class Block(Unit):
        def forward(self, x, pos):
            g, l = self.gpt(), self.unit
            q, kv = g.qkv(l, x, pos)
            x = g.proj(l, g.attn(l, q, kv, pos, pos), x)
            return g.fc2(l, g.fc1(l, x), x)

    class Head(Unit):
        def forward(self, x, targets, scale):
            g = self.gpt()
            logits, lmax = g.head(x)
            return g.loss(g.xent(logits, lmax, targets), scale)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = Embed(-1)
            self.blocks = nn.ModuleList(Block(l) for l in range(m.layers))
            self.head = Head(m.layers)

        def forward(self, tokens, targets, pos, scale):
            x = self.embed(tokens, pos)
            for b in self.blocks:
                x = b(x, pos)
            return self.head(x, targets, scale)

    return Model()


class TorchTrainer:
    """torch's own training of the same model: DDP (kind=ddp) or FSDP2 (kind=fsdp2) over the world
    group, or the plain model in this process (kind=plain, no torch.distributed); one `step` at a time."""

    def __init__(self, rp, *, seed: int, kind: str):
        import torch.distributed as dist

        from simexec.exec.nn.optim import Adam

        self.rp, self.seed, self.kind = rp, seed, kind
        self.rank = dist.get_rank() if kind != "plain" else 0
        model = torch_model(rp.model, seed)
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            # gradient_as_bucket_view: gradients live in the buckets, as the executor's do (no copy-in)
            model = DDP(model, bucket_cap_mb=rp.plan.bucket_mb, gradient_as_bucket_view=True)
        elif kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for unit in [model.embed, *model.blocks, model.head]:
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model = model
        self.params = list(model.parameters())
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.params]
        self.opt = Adam([p.detach() for p in local])

    def step(self, step: int):
        """One training step; returns this rank's loss tensor (mean over its micro-batches)."""
        import torch

        from simexec.exec.nn import data

        micro, kind, model = self.rp.micro_batches, self.kind, self.model
        total = torch.zeros(())
        for mb in range(micro):
            b = data.micro_batch(self.rp, self.seed, step, self.rank, mb)
            scale = 1.0 / (b.targets.numel() * micro)
            last = mb == micro - 1
            ctx = _nullcontext()
            if kind == "ddp" and not last:
                ctx = model.no_sync()
            elif kind == "fsdp2":
                model.set_requires_gradient_sync(last)
            with ctx:
                loss = model(b.tokens, b.targets, b.pos, scale)
                loss.backward()
            total += loss.detach()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in self.params]
        self.opt.step([g.detach() for g in grads])
        for p in self.params:
            p.grad = None
        return total

    def global_loss(self, total) -> float:
        import torch.distributed as dist

        if self.kind != "plain":
            dist.all_reduce(total)
            total /= dist.get_world_size()
        return float(total.item())


class ExecTrainer:
    """The executor's interpreter on this rank's program, one `step` at a time (what `run_rank`
    times: `run_step`)."""

    def __init__(self, rp, instrs, *, groups, tracer, device, seed: int):
        from simexec.exec.rank.interpreter import RankInterpreter

        self.r = RankInterpreter(rp, instrs, groups, tracer, device, seed)

    def step(self, step: int):
        return self.r.run_step(step)

    def global_loss(self, loss) -> float:
        return self.r.global_loss(loss)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def lockstep(trainers: dict, steps: int) -> tuple[dict, dict]:
    """Run the trainers step by step, in rotating order: step s of every variant back to back, so
    that load on the machine, which changes by the second, hits them alike. Step times and losses."""
    names = list(trainers)
    times = {v: [] for v in names}
    losses = {v: [] for v in names}
    for s in range(steps):
        k = s % len(names)
        for v in names[k:] + names[:k]:
            t0 = time.perf_counter()
            out = trainers[v].step(s)
            times[v].append(time.perf_counter() - t0)
            losses[v].append(out)
        for v in names:  # outside the timing, in the same order on every rank (a collective)
            losses[v][-1] = trainers[v].global_loss(losses[v][-1])
    return times, losses


def bench_runner(rp, instrs, *, steps, groups, tracer, device, seed=0, kind="ddp"):
    """A `run_rank` stand-in that trains every variant side by side (`lockstep`)."""
    trainers = {
        # the worker's own tracer: its progress also feeds the driver's watchdog
        "traced": ExecTrainer(rp, instrs, groups=groups, tracer=tracer, device=device, seed=seed),
        "untraced": ExecTrainer(rp, instrs, groups=groups, tracer=None, device=device, seed=seed),
        "torch": TorchTrainer(rp, seed=seed, kind=kind),
    }
    times, losses = lockstep(trainers, steps)
    return {"losses": losses["traced"], "step_times_s": times["traced"], "params": {},
            "peak_memory_bytes": 0, "extra": {"times": times, "losses": losses}}


def overhead(m, seq_len: int, gbs: int, mbs: int, steps: int) -> dict:
    """One rank, this process, no Ray: the executor's step (untraced) against the same blocks in one
    autograd graph per micro-batch with the same Adam (lockstep); the difference per instruction."""
    import torch

    from simexec.specs.cluster import get_cluster
    from simexec.program.lower import lower
    from simexec.specs.plan import parse_plan, resolve

    torch.set_num_threads(1)
    rp = resolve(m, get_cluster("local"), parse_plan(f"dp=1,gbs={gbs},mbs={mbs},dtype=fp32"), seq_len)
    instrs = lower(rp, symmetric=False).ranks[0]
    n = sum(1 for i in instrs if i.kind != "memory")
    trainers = {"exec": ExecTrainer(rp, instrs, groups=None, tracer=None, device=torch.device("cpu"), seed=0),
                "plain": TorchTrainer(rp, seed=0, kind="plain")}
    times, _ = lockstep(trainers, steps)
    e, p = statistics.median(times["exec"][1:]), statistics.median(times["plain"][1:])
    ratio = statistics.median(a / b for a, b in zip(times["exec"][1:], times["plain"][1:]))  # paired, per step
    return {"instructions": n, "exec_step_s": e, "plain_step_s": p, "us_per_instruction": (ratio - 1) * p / n * 1e6,
            "exec_over_plain": ratio}


def summarise(extra: dict[int, dict]) -> dict[str, dict]:
    """Per variant: the slowest rank's time of every measured step (the first is a warm-up), their
    median and their minimum (the step least disturbed by other load on the machine)."""
    out = {}
    for v in VARIANTS:
        per_rank = [e["times"][v] for e in extra.values()]
        slowest = [max(t[s] for t in per_rank) for s in range(len(per_rank[0]))][1:]
        out[v] = {"median": statistics.median(slowest), "best": min(slowest), "steps": slowest}
    return out


def paired(t: dict, a: str, b: str) -> float:
    """The median over steps of a / b within each step: the two ran back to back in the same
    processes, so load that changes from step to step cancels out."""
    return statistics.median(x / y for x, y in zip(t[a]["steps"], t[b]["steps"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench", help="`bench` (default, see above) or a preset name")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=21, help="steps per variant, side by side (the first is a warm-up)")
    ap.add_argument("--overhead", action="store_true", help="also measure the interpreter's cost per instruction")
    ap.add_argument("--only", choices=("ddp", "fsdp2"), default=None)
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    if outputs_refused("bench_exec.py", {"--json": args.json_path}):
        return 2

    from simexec.exec.api import execute
    from simexec.exec.runtime.launcher import start_ray, stop_ray

    m = get_bench_model(args.model, args.seq_len)
    report: dict = {"model": m.name, "params": m.params, "seq_len": args.seq_len, "dp": args.dp, "gbs": args.gbs,
                    "mbs": args.mbs, "steps": args.steps, "runs": {}}
    print(f"model {m.name} ({m.params / 1e6:.1f} M parameters), seq {args.seq_len}, dp {args.dp}, gbs {args.gbs}, "
          f"mbs {args.mbs}; {args.steps - 1} measured steps per variant, run side by side")
    if args.overhead:
        o = overhead(m, args.seq_len, args.gbs // args.dp, args.mbs, args.steps)
        report["overhead"] = o
        print(f"interpreter overhead (1 rank, no Ray): executor {o['exec_step_s'] * 1e3:.1f} ms vs one autograd "
              f"graph {o['plain_step_s'] * 1e3:.1f} ms per step: "
              f"{o['us_per_instruction']:.0f} us per instruction (paired ratio {o['exec_over_plain']:.3f}, "
              f"{o['instructions']} instructions)")
    t0 = time.perf_counter()
    owned = start_ray(args.ray_address)
    ray_start = time.perf_counter() - t0
    report["ray_start_s"] = ray_start
    print(f"Ray start-up: {ray_start:.1f} s" + ("" if owned else " (already running)"))
    base = f"dp={args.dp},gbs={args.gbs},mbs={args.mbs},dtype=fp32"
    try:
        for name, plan, kind in [("ddp", base, "ddp"), ("fsdp2", base + ",zero=3", "fsdp2")]:
            if args.only and name != args.only:
                continue
            runner = functools.partial(bench_runner, kind=kind)
            res = execute(m, "local", plan, steps=args.steps, seq_len=args.seq_len, runner=runner, timeout_s=600)
            t = summarise(res.extra)
            ex = next(iter(res.extra.values()))["losses"]
            agree = max(abs(a - b) / abs(b) for a, b in zip(ex["traced"], ex["torch"]))
            row = {"plan": plan, "step_time_s": t, "loss_rel_diff_vs_torch": agree,
                   "actors_s": res.timings.get("actors_s"), "rendezvous_s": res.timings.get("rendezvous_s")}
            for stat in ("median", "best"):
                row[f"exec_over_{kind}_{stat}"] = t["untraced"][stat] / t["torch"][stat]
                row[f"traced_over_untraced_{stat}"] = t["traced"][stat] / t["untraced"][stat]
            row[f"exec_over_{kind}_paired"] = paired(t, "untraced", "torch")
            row["traced_over_untraced_paired"] = paired(t, "traced", "untraced")
            report["runs"][name] = row
            print(f"{plan}  (actors {row['actors_s']:.1f} s, rendezvous {row['rendezvous_s']:.2f} s, "
                  f"losses vs {kind}: {agree:.1e})")
            print(f"  paired  executor/{kind} {row[f'exec_over_{kind}_paired']:.3f}  "
                  f"tracing {100 * (row['traced_over_untraced_paired'] - 1):+.1f}%  (median over steps of per-step ratios)")
            for stat in ("median", "best"):
                print(f"  {stat:6s}  executor {t['untraced'][stat] * 1e3:7.1f} ms  traced {t['traced'][stat] * 1e3:7.1f} ms"
                      f"  {kind} {t['torch'][stat] * 1e3:7.1f} ms  |  executor/{kind} "
                      f"{row[f'exec_over_{kind}_{stat}']:.3f}  tracing {100 * (row[f'traced_over_untraced_{stat}'] - 1):+.1f}%")
    finally:
        stop_ray(owned)
    if args.json_path:
        write_atomic(args.json_path, json.dumps(report, indent=2).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
