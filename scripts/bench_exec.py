"""Benchmark the executor on local ranks: Ray start-up, step time against torch's own DDP (dp plans)
and FSDP2 (`fully_shard`, zero=3 plans), and tracing on against off.

Everything runs in the same Ray actors, one per rank, so the comparison shares processes, CPU shares
and process groups: each actor runs, in rounds and in rotating order, the executor with tracing
(`interpreter.run_rank` with a `Tracer`), the executor without (the interpreter's null tracer), and
the torch baseline on the same model maths (`simexec.exec.model.GPT` blocks wrapped in
`nn.Module`s), data (`simexec.exec.data`), micro-batching (DDP `no_sync` / FSDP2
`set_requires_gradient_sync` for all but the last micro-batch) and Adam (`simexec.exec.optim`).
A variant's time per round is its median step (after one warm-up step) of the slowest rank; the
report gives the median over rounds and the best round (least disturbed by other load: on a shared
2-core machine the median moves by tens of percent). Interleaving keeps background load from
favouring one variant.

    python scripts/bench_exec.py [--model gpt-tiny] [--seq-len 64] [--dp 2] [--gbs 8] [--rounds 5]
                                 [--steps 5] [--json bench.json]
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

VARIANTS = ("traced", "untraced", "torch")


def torch_model(m, seed: int):
    """The full model as nn.Modules (embedding, one module per layer, head) calling the very blocks
    of `simexec.exec.model.GPT`, so DDP and FSDP2 see the executor's maths with a module per unit."""
    import torch.nn as nn

    from simexec.exec.model import GPT, Layout, init_full, param_specs

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


def torch_steps(rp, *, steps: int, seed: int, kind: str) -> dict:
    """`steps` training steps of DDP (kind=ddp) or FSDP2 (kind=fsdp2) over the world group."""
    import torch
    import torch.distributed as dist

    from simexec.exec import data
    from simexec.exec.optim import Adam

    rank = dist.get_rank()
    model = torch_model(rp.model, seed)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=rp.plan.bucket_mb)
        no_sync = model.no_sync
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for unit in [model.embed, *model.blocks, model.head]:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    opt = Adam([p.detach() for p in local])
    micro, times, losses = rp.micro_batches, [], []
    for step in range(steps):
        t0 = time.perf_counter()
        total = torch.zeros(())
        for mb in range(micro):
            b = data.micro_batch(rp, seed, step, rank, mb)
            scale = 1.0 / (b.targets.numel() * micro)
            last = mb == micro - 1
            if kind == "ddp":
                ctx = no_sync() if not last else _nullcontext()
            else:
                model.set_requires_gradient_sync(last)
                ctx = _nullcontext()
            with ctx:
                loss = model(b.tokens, b.targets, b.pos, scale)
                loss.backward()
            total += loss.detach()
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
        opt.step([g.detach() for g in grads])
        for p in params:
            p.grad = None
        times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return {"step_times_s": times, "losses": losses}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def bench_runner(rp, instrs, *, steps, groups, tracer, device, seed=0, rounds=5, kind="ddp"):
    """A `run_rank` stand-in that runs every variant `rounds` times, in rotating order."""
    from simexec.exec.interpreter import run_rank
    from simexec.exec.tracer import Tracer

    times = {v: [] for v in VARIANTS}
    losses = {}
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for v in order:
            if v == "torch":
                res = torch_steps(rp, steps=steps, seed=seed, kind=kind)
            else:
                tr = Tracer(tracer.rank, device=device) if v == "traced" else None
                res = run_rank(rp, instrs, steps=steps, groups=groups, tracer=tr, device=device, seed=seed)
            times[v].append(res["step_times_s"])
            losses[v] = res["losses"]
    return {"losses": losses["traced"], "step_times_s": times["traced"][-1], "params": {},
            "peak_memory_bytes": 0, "extra": {"times": times, "losses": losses}}


def summarise(extra: dict[int, dict]) -> dict[str, dict[str, float]]:
    """Per variant, over rounds, of each round's median measured step of the slowest rank: the
    median, and the best (least disturbed by other load on the machine)."""
    out = {}
    for v in VARIANTS:
        per_round = []
        rounds = len(next(iter(extra.values()))["times"][v])
        for i in range(rounds):
            per_rank = [e["times"][v][i] for e in extra.values()]
            slowest = [max(t[s] for t in per_rank) for s in range(len(per_rank[0]))]
            per_round.append(statistics.median(slowest[1:] or slowest))
        out[v] = {"median": statistics.median(per_round), "best": min(per_round)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5, help="steps per round and variant (the first is warm-up)")
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)

    from simexec.exec.api import execute
    from simexec.exec.launcher import start_ray, stop_ray

    t0 = time.perf_counter()
    owned = start_ray(args.ray_address)
    ray_start = time.perf_counter() - t0
    report: dict = {"model": args.model, "seq_len": args.seq_len, "ray_start_s": ray_start, "runs": {}}
    print(f"Ray start-up: {ray_start:.1f} s" + ("" if owned else " (already running)"))
    try:
        for name, plan, kind in [("ddp", f"dp={args.dp},gbs={args.gbs},dtype=fp32", "ddp"),
                                 ("fsdp2", f"dp={args.dp},zero=3,gbs={args.gbs},dtype=fp32", "fsdp2")]:
            runner = functools.partial(bench_runner, rounds=args.rounds, kind=kind)
            res = execute(args.model, "local", plan, steps=args.steps, seq_len=args.seq_len, runner=runner,
                          timeout_s=300)
            t = summarise(res.extra)
            ex = next(iter(res.extra.values()))["losses"]
            agree = max(abs(a - b) / abs(b) for a, b in zip(ex["traced"], ex["torch"]))
            row = {"plan": plan, "step_time_s": t, "loss_rel_diff_vs_torch": agree,
                   "actors_s": res.timings.get("actors_s"), "rendezvous_s": res.timings.get("rendezvous_s")}
            for stat in ("median", "best"):
                row[f"exec_over_{kind}_{stat}"] = t["untraced"][stat] / t["torch"][stat]
                row[f"traced_over_untraced_{stat}"] = t["traced"][stat] / t["untraced"][stat]
            report["runs"][name] = row
            print(f"{plan}  (actors {row['actors_s']:.1f} s, rendezvous {row['rendezvous_s']:.2f} s, "
                  f"losses vs {kind}: {agree:.1e})")
            for stat in ("median", "best"):
                print(f"  {stat:6s}  executor {t['untraced'][stat] * 1e3:7.1f} ms  traced {t['traced'][stat] * 1e3:7.1f} ms"
                      f"  {kind} {t['torch'][stat] * 1e3:7.1f} ms  |  executor/{kind} "
                      f"{row[f'exec_over_{kind}_{stat}']:.3f}  tracing {100 * (row[f'traced_over_untraced_{stat}'] - 1):+.1f}%")
    finally:
        stop_ray(owned)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
