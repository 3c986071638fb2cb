"""Aten operators the interpreter dispatches around each activation collective, counted on rank 0 of
a real step (spawned gloo ranks on 127.0.0.1), beside what the host model charges for them
(`simexec.sim.host.issue.activation_ops`): the count the simulator's per-operator price stands on.
"""
from __future__ import annotations

from contextlib import ExitStack
from unittest import mock


def _counted_rank(rank: int, world: int, port: int, model: str, plan: str, out) -> None:
    """One rank's step with each collective's operators counted: {instruction name: (before, finish)}."""
    import torch

    from simexec.exec.rank import collectives, interpreter
    from simexec.calibrate.microbench import CountTracer, plan_rank
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace != "c10d":
                self.n += 1
            return func(*args, **(kwargs or {}))

    cnt = Count()
    counts: dict[str, list[int]] = {}
    collective, wait = interpreter.RankInterpreter.collective, collectives.InflightComm.wait

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
            stack.enter_context(mock.patch.object(interpreter.RankInterpreter, "collective", counted_collective))
            stack.enter_context(mock.patch.object(collectives.InflightComm, "wait", counted_wait))
            stack.enter_context(cnt)
            interpreter.run_rank(rp, prog.ranks[rank], steps=1, groups=groups, tracer=CountTracer(cnt),
                                 device=torch.device("cpu"))
        if rank == 0:
            out.put({k: tuple(v) for k, v in counts.items()})


def collective_operator_rows(model: str, plan: str, timeout_s: float = 120.0) -> list[dict]:
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
