#!/usr/bin/env python
"""What a step's collectives cost their rank's own thread, beside the transfer, against the model.

    python scripts/issue_cost.py [--plan dp=2,gbs=8,dtype=fp32] [--model gpt-tiny] [--steps 24]
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
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

VERBS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all_single")


def kind_of(block: str) -> str:
    return block.rstrip("0123456789")


def runner(rp, instrs, *, steps, groups, tracer, device, seed=0):
    """`simexec.exec.rank.interpreter.run_rank`, with every collective's own Python timed."""
    import torch
    import torch.distributed as dist

    from simexec.exec.rank import collectives
    from simexec.exec.rank import interpreter as interp

    marks: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    calls: list[tuple[float, float]] = []
    saved = {v: getattr(collectives.TorchComm, v) for v in VERBS}
    collective, inflight_init = interp._Rank.collective, collectives._Inflight.__init__

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
        m = marks[kind_of(ins.block)]
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
                    marks[kind_of(ins.block)]["finish"].append(time.time() - t)
        inflight_init(self, rank, ins, works, finish)

    for v in VERBS:
        setattr(collectives.TorchComm, v, timed_verb(saved[v]))
    interp._Rank.collective = timed_collective
    collectives._Inflight.__init__ = timed_inflight
    try:
        out = interp.run_rank(rp, instrs, steps=steps, groups=groups, tracer=tracer, device=device, seed=seed)
    finally:
        for v in VERBS:
            setattr(collectives.TorchComm, v, staticmethod(saved[v]))
        interp._Rank.collective, collectives._Inflight.__init__ = collective, inflight_init
    out["extra"] = {k: {part: list(v) for part, v in m.items()} for k, m in marks.items()}
    return out


def rank0_costs(model: str, plan: str, profile: str):
    """`HostCosts` under `profile` on the `local` cluster, and the lowest rank's instructions: what the
    simulator charges that rank's thread (shared with scripts/thread_cpu.py)."""
    from simexec.specs.cluster import get_cluster
    from simexec.program.lower import lower
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve
    from simexec.sim.host.model import HostCosts
    from simexec.sim.profile import apply_profile

    cluster = apply_profile(get_cluster("local"), profile)
    rp = resolve(get_model(model), cluster, load_plan(plan), None)
    prog = lower(rp, symmetric=False)
    return HostCosts(cluster, prog, rp.plan.dtype), prog.ranks[min(prog.ranks)]


def model_prices(model: str, plan: str, profile: str) -> dict[str, tuple[float, float]]:
    """The simulator's charge to the rank's thread per kind of collective, (before the call, once
    waited): medians over rank 0's."""
    hc, instrs = rank0_costs(model, plan, profile)
    prices = collections.defaultdict(list)
    for ins in instrs:
        if ins.kind == "collective":
            prices[kind_of(ins.block)].append(hc.issue_split(ins))
    return {k: tuple(statistics.median(side) for side in zip(*v)) for k, v in prices.items()}


def plan_parser(doc: str, plan: str, steps: int) -> argparse.ArgumentParser:
    """The flags of a script that runs one plan with an instrumented rank runner."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
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


def main(argv=None) -> int:
    args = plan_parser(__doc__, "dp=2,gbs=8,dtype=fp32", 24).parse_args(argv)
    got = run_plan("issue_cost", args, runner, model_prices, 300.0)
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


if __name__ == "__main__":
    raise SystemExit(main())
