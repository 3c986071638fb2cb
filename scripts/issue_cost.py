#!/usr/bin/env python
"""What a gradient bucket costs its rank's own thread inside a step, and the all-reduce after it.

    python scripts/issue_cost.py [--plan dp=2,gbs=8,dtype=fp32] [--model gpt-tiny] [--steps 24]

Runs the plan on the executor's Ray actors (CPU ranks, gloo), as `simexec execute` does, with the
interpreter's gradient-bucket call timed in three parts: from its start to the moment it calls
`all_reduce` (the interpreter's Python: moving each gradient into the flat buffer, one view per
parameter tensor), from then to the end of the wait, and from the last member's call to the end
(the collective alone, the members' arrival spread taken out). Medians over the steps after the
first four, per rank. The simulator charges the first part to the rank's thread
(`simexec.sim.host.HostCosts.issue_seconds`) and the rest to the transfer.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def runner(rp, instrs, *, steps, groups, tracer, device, seed=0):
    """`simexec.exec.interpreter.run_rank`, with every gradient bucket timed (see the module doc)."""
    import torch
    import torch.distributed as dist

    from simexec.exec import interpreter as interp

    marks: dict[str, list[float]] = {"python": [], "wait": [], "after_last": []}
    calls: list[float] = []
    all_reduce = interp.TorchComm.all_reduce
    grads_bucket = interp._Rank.grads_bucket

    def timed_all_reduce(*args, **kwargs):
        calls.append(time.time())
        return all_reduce(*args, **kwargs)

    def timed_bucket(self, ins, verb, g):
        calls.clear()
        t0 = time.time()
        grads_bucket(self, ins, verb, g)
        self.inflight[ins.name].wait()
        t1 = time.time()
        issued = calls[0] if calls else t0
        last = torch.tensor([issued], dtype=torch.float64)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=g)
        marks["python"].append(issued - t0)
        marks["wait"].append(t1 - issued)
        marks["after_last"].append(t1 - float(last))

    interp.TorchComm.all_reduce = staticmethod(timed_all_reduce)
    interp._Rank.grads_bucket = timed_bucket
    try:
        out = interp.run_rank(rp, instrs, steps=steps, groups=groups, tracer=tracer, device=device, seed=seed)
    finally:
        interp.TorchComm.all_reduce = staticmethod(all_reduce)
        interp._Rank.grads_bucket = grads_bucket
    out["extra"] = {k: statistics.median(v[4:] or v) * 1e3 if v else float("nan") for k, v in marks.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="dp=2,gbs=8,dtype=fp32")
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    if args.steps < 5:
        print(f"issue_cost: error: --steps must be at least 5 (the first four are warm-up), got {args.steps}",
              file=sys.stderr)
        return 2
    from simexec.calibrate_runs import Session
    from simexec.errors import SimexecError

    try:
        with Session() as session:
            m = session.execute(args.model, args.plan, steps=args.steps, runner=runner, timeout_s=300.0)
    except SimexecError as exc:
        print(f"issue_cost: error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model} {args.plan}: gradient bucket, medians in ms")
    print("rank  python before the call  call to end of wait  last member's call to end")
    for rank, ex in sorted(m.result.extra.items()):
        print(f"{rank:>4}  {ex['python']:>22.2f}  {ex['wait']:>19.2f}  {ex['after_last']:>25.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
