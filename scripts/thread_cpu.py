#!/usr/bin/env python
"""Where a rank's own thread spends its CPU in a step, part by part, against the simulator's charge.

    python scripts/thread_cpu.py [--plan tp=2,gbs=8,dtype=fp32] [--model gpt-tiny] [--steps 14]
                                 [--profile traces/profiles/local-microbench.json]

Runs the plan on the executor's Ray actors (CPU ranks, gloo), as `simexec execute` does, with the
lowest rank's thread CPU (`time.thread_time`) split, exclusively, by part: each compute block
(`compute <phase>.<block>`), a collective's preparation (`call <block>`), its call into
torch.distributed (`c10d <verb>`), its wait and result put in place (`wait <block>`), messages,
copies, `reap` and the rest of the interpreter (`other`). Medians over the steps after the first
four, in ms a step, beside what `HostCosts` charges the thread on an idle core (`cpu_seconds`,
`issue_split`; the simulator charges a collective's call as `collective_issue_s` within `call`),
largest difference first. Shared cores slow every part alike: compare the parts with each other.
"""
from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # issue_cost, beside this script

from issue_cost import VERBS, kind_of as _kind, plan_parser, rank0_costs, run_plan  # noqa: E402


def runner(rp, instrs, *, steps, groups, tracer, device, seed=0):
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

    R, I, C = interp._Rank, collectives._Inflight, collectives.TorchComm
    saved = [(R, "compute", lambda s, ins: f"compute {'fwd' if ins.phase == 'recompute' else ins.phase}.{ins.block}"),
             (R, "collective", lambda s, ins: f"call {_kind(ins.block)}"),
             (R, "p2p", lambda s, ins: "p2p"), (R, "copy", lambda s, ins: "copy"), (R, "reap", lambda s: "reap"),
             (I, "wait", lambda s: f"wait {_kind(s.ins.block)}")]
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


def model_parts(model: str, plan: str, profile: str) -> dict[str, float]:
    """What the simulator charges the lowest rank's thread a step, by the same parts (seconds)."""
    hc, instrs = rank0_costs(model, plan, profile)
    parts: dict[str, float] = collections.defaultdict(float)
    for ins in instrs:
        if ins.kind == "compute":
            parts[f"compute {'fwd' if ins.phase == 'recompute' else ins.phase}.{ins.block}"] += hc.cpu_seconds(ins)
        elif ins.kind == "collective":
            before, after = hc.issue_split(ins)
            parts[f"call {_kind(ins.block)}"] += before
            parts[f"wait {_kind(ins.block)}"] += after
        elif ins.kind in ("send", "recv"):
            parts["p2p"] += hc.issue_seconds(ins)
    return parts


def main(argv=None) -> int:
    args = plan_parser(__doc__, "tp=2,gbs=8,dtype=fp32", 14).parse_args(argv)
    got = run_plan("thread_cpu", args, runner, model_parts, 600.0)
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


if __name__ == "__main__":
    raise SystemExit(main())
