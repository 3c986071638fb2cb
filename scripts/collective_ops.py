#!/usr/bin/env python
"""Aten operators the interpreter dispatches around each activation collective, against the model.

    python scripts/collective_ops.py [--model gpt-tiny] [--plan tp=2,gbs=2,dtype=fp32]

Runs one step of the plan as spawned gloo processes on 127.0.0.1 with a TorchDispatchMode counting
operators on rank 0: those of the interpreter's call (`_Rank.collective`, the tensors prepared) and
of the collective's `finish` (the result put in place once waited), without the c10d operator of
the collective itself. Prints, per kind of activation collective (block, phase, micro-batch), what
was counted beside what `simexec.sim.host.issue.activation_ops` charges for it. Exit 1 where any differs.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from unittest import mock


def _counted_rank(rank: int, world: int, port: int, model: str, plan: str, out) -> None:
    """One rank's step with each collective's operators counted: {instruction name: (before, finish)}."""
    import torch

    from simexec.exec.rank import collectives, interpreter
    from simexec.calibrate.microbench import _CountTracer, plan_rank
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace != "c10d":
                self.n += 1
            return func(*args, **(kwargs or {}))

    cnt = Count()
    counts: dict[str, list[int]] = {}
    collective, wait = interpreter._Rank.collective, collectives._Inflight.wait

    def counted_collective(self, ins):
        n0 = cnt.n
        collective(self, ins)
        counts[ins.name] = [cnt.n - n0, 0]

    def counted_wait(self):
        finish = self.finish
        if not self.done and finish is not None:
            def timed():
                n0 = cnt.n
                finish()
                counts.setdefault(self.ins.name, [0, 0])[1] += cnt.n - n0
            self.finish = timed
        return wait(self)

    with plan_rank(rank, world, port, model, plan) as (rp, prog, groups):
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(interpreter._Rank, "collective", counted_collective))
            stack.enter_context(mock.patch.object(collectives._Inflight, "wait", counted_wait))
            stack.enter_context(cnt)
            interpreter.run_rank(rp, prog.ranks[rank], steps=1, groups=groups, tracer=_CountTracer(cnt),
                                 device=torch.device("cpu"))
        if rank == 0:
            out.put({k: tuple(v) for k, v in counts.items()})


def compare(model: str, plan: str, timeout_s: float = 120.0) -> list[dict]:
    """One row per kind of activation collective on rank 0: counted and modelled operators."""
    from simexec.specs.cluster import get_cluster
    from simexec.exec.runtime.spawn import spawn_ranks
    from simexec.program.lower import lower
    from simexec.specs.model import get_model
    from simexec.specs.plan import parse_plan, resolve
    from simexec.sim.host.issue import activation_ops, is_activation_collective, partial_gradients

    rp = resolve(get_model(model), get_cluster("local"), parse_plan(plan))
    counted = spawn_ranks(_counted_rank, rp.world, (model, plan), timeout_s)
    rows: dict[tuple, dict] = {}
    for ins in lower(rp, symmetric=False).ranks[0]:
        if not is_activation_collective(ins) or ins.name not in counted:
            continue
        partial = partial_gradients(rp.model, ins, rp.plan.sp)
        key = (ins.phase, ins.block.rstrip("0123456789"), ins.collective, min(ins.mb, 1))
        rows.setdefault(key, {"phase": ins.phase, "block": key[1], "verb": ins.collective, "mb": ">0" if key[3] else "0",
                              "group": len(ins.group), "partial": partial, "counted": counted[ins.name],
                              "model": activation_ops(ins, partial)})
    return [rows[k] for k in sorted(rows)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--plan", default="tp=2,gbs=2,dtype=fp32")
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError

    try:
        rows = compare(args.model, args.plan)
    except SimexecError as e:
        print(f"collective_ops: {e}", file=sys.stderr)
        return 2
    print(f"{args.model} {args.plan}: operators on rank 0, (before the call, once waited)")
    print(f"{'phase':5} {'block':14} {'verb':14} {'mb':3} {'group':>5} {'partial':>7}  counted   model")
    for r in rows:
        print(f"{r['phase']:5} {r['block']:14} {r['verb']:14} {r['mb']:3} {r['group']:5d} {r['partial']:7d}  "
              f"{str(r['counted']):8}  {r['model']}")
    return 0 if all(tuple(r["counted"]) == tuple(r["model"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
