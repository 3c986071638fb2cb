"""The executor on XLA devices (simexec.exec.rank.xla), on the PJRT CPU runtime.

torch_xla 2.9.0 is bound to torch 2.9.0 while the main environment has torch 2.13, so these tests are
skipped wherever torch_xla cannot be imported; `scripts/xla_env.sh` creates `.venv-xla` (torch 2.9.0,
torch_xla 2.9.0, the project) and runs them there.

- single-rank plans on XLA match the eager single-process reference (fp32: relative 1e-4, 3 steps,
  losses and parameters);
- every compute instruction is its own XLA graph, executed and timed on its own (graph cut);
- several ranks on the CPU runtime: compute on XLA, collectives through gloo on host copies
  (the `xla` process group does not work there, see simexec/exec/rank/xla.py), against the reference.
"""
from __future__ import annotations

import os

import pytest

from simexec.exec.rank.xla import unavailable

_WHY = unavailable()
if _WHY is not None:
    pytest.skip(f"XLA tests skipped: {_WHY}", allow_module_level=True)

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402

from simexec.exec.rank import xla as X  # noqa: E402
from test_exec_interp import RankPool, _reference, check_plan, rel_err, resolved  # noqa: E402

DEV = X.device()  # before any backward in this process: autograd sizes its per-device queues once
STEPS = 3
RTOL = 1e-4


def _run_single(model: str, plan: str, tracer=None) -> tuple[object, dict, list]:
    from simexec.exec.rank.interpreter import run_rank
    from simexec.program.lower import lower

    rp = resolved(model, plan)
    instrs = lower(rp, symmetric=False).ranks[0]
    return rp, run_rank(rp, instrs, steps=STEPS, groups=None, tracer=tracer, device=DEV, seed=0), instrs


@pytest.mark.parametrize("model,plan", [("gpt-tiny", "dp=1,gbs=4,mbs=2"), ("gpt-tiny", "dp=1,gbs=4,mbs=1"),
                                        ("moe-tiny", "dp=1,gbs=2")])
def test_single_rank_on_xla_matches_eager(model, plan):
    rp, res, _ = _run_single(model, plan)
    ref = _reference(model, rp.plan.gbs, 32, STEPS)
    assert len(res["losses"]) == STEPS
    for got, want in zip(res["losses"], ref["losses"]):
        assert abs(got - want) / abs(want) <= RTOL, f"{plan}: XLA losses {res['losses']} vs eager {ref['losses']}"
    for name, want in ref["params"].items():
        assert rel_err(res["params"][name], want) <= RTOL, name


def test_each_compute_instruction_is_one_graph_timed_on_its_own():
    """A traced step: every compute instruction has its event, and the device executed at least one
    graph per compute instruction (the cut at its end), not one graph for the whole step."""
    import torch_xla.debug.metrics as met

    from simexec.exec.measure.tracer import Tracer

    tracer = Tracer(0)
    before = (met.metric_data("ExecuteTime") or (0,))[0]
    rp, res, instrs = _run_single("gpt-tiny", "dp=1,gbs=2", tracer)
    executed = (met.metric_data("ExecuteTime") or (0,))[0] - before
    computes = [i.name for i in instrs if i.kind == "compute"]
    traced = {name for name, step, t0, t1 in tracer.records if step == STEPS - 1 and t1 >= t0}
    assert set(computes) <= traced
    assert executed >= STEPS * len(computes), f"{executed} graph executions for {STEPS} x {len(computes)} instructions"


_POOL: RankPool | None = None


def _xla_pool() -> RankPool:
    global _POOL
    if _POOL is None:
        import atexit

        _POOL = RankPool(4, device="xla")
        atexit.register(_POOL.close)
    return _POOL


@pytest.mark.parametrize("model,plan", [("gpt-tiny", "dp=2"), ("gpt-tiny", "tp=2,sp=1"), ("gpt-tiny", "pp=2,gbs=4"),
                                        ("gpt-tiny", "dp=2,zero=3"), ("gpt-tiny", "cp=2,cp_impl=ring")])
def test_several_xla_ranks_with_gloo_host_collectives(model, plan):
    check_plan(model, plan, pool=_xla_pool())


def test_process_group_backend_on_the_cpu_runtime_is_gloo():
    assert X.runtime() == "CPU" and X.process_group_backend() == "gloo"
    assert torch.device(DEV).type == "xla"


@pytest.mark.ray
def test_execute_with_backend_xla_on_ray_actors():
    """`execute(..., backend="xla")`: Ray actors, each rank on its XLA device, gloo for the
    collectives (CPU runtime); the losses are the reference's and every instruction is traced."""
    pytest.importorskip("ray")
    from simexec.exec.api import execute

    res = execute("gpt-tiny", "local", "dp=2,gbs=4,dtype=fp32", backend="xla", seq_len=32, steps=STEPS,
                  timeout_s=300)
    ref = _reference("gpt-tiny", 4, 32, STEPS)
    assert len(res.losses) == STEPS
    for got, want in zip(res.losses, ref["losses"]):
        assert abs(got - want) / abs(want) <= RTOL, f"{res.losses} vs {ref['losses']}"
    from simexec.program.lower import lower

    program = lower(resolved("gpt-tiny", "dp=2,gbs=4"), symmetric=False)
    for rank in (0, 1):
        computes = {i.name for i in program.ranks[rank] if i.kind == "compute"}
        assert computes <= {e.name for e in res.trace.events if e.rank == rank}
