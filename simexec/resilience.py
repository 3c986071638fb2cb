"""Stragglers and failures run for real, beside what the simulator and the goodput model predict.

`execute` (`simexec.exec.api`) measures; this module, which may read both sides (`sim` and `exec`
never import each other), reads `--slow` with the simulator's own parser and sets the predictions
beside the measurements:

- stragglers: `simulate --full --slow SPEC` on the same model, cluster and plan: every rank its own
  factor, as the executor's ranks have;
- a kill: `simexec.sim.goodput` takes the restart time as a parameter, so it is given the restart
  measured here, and what it predicts is the work lost: restart + steps redone x the healthy step
  for this kill at a known step, and `lost_per_failure` (Daly) for a failure at a random time
  with the same restart and an interval of K healthy steps, each checkpoint blocking for the
  measured save.
"""
from __future__ import annotations

import os
from typing import Optional, Union

from simexec.errors import SpecError

NO_FAILURES_S = 1e9  # an MTBF of 30 years, far beyond any run here: Daly's per-failure cost at its limit


def parse_execute_slow(spec: str, world: int, gpus_per_node: int) -> dict[int, float]:
    """`--slow` for `execute`: simulate's grammar and parser (`simexec.sim.slowdown.parse_slow`),
    `node:N:F` as the ranks of node N; `nic:N:F` is the simulator's only (CPU ranks share no NIC)."""
    from simexec.sim.slowdown import parse_slow

    slow = parse_slow(spec, world, gpus_per_node)
    if slow.nic:
        raise SpecError(f"--slow {spec!r}: nic:N:F slows a node's NIC links in the simulator only; "
                        "execute slows ranks (rank:R:F, node:N:F)")
    return dict(slow.compute)


def execute_with_predictions(model, cluster, plan, *, slow: Optional[str] = None, seq_len: Optional[int] = None,
                             json_path: Optional[Union[str, os.PathLike]] = None, **kw):
    """`execute` with `slow` as SPEC text, then the predictions set beside its `stragglers` and
    `recovery` reports (and written into `json_path`)."""
    from simexec.exec.api import execute, resolved
    from simexec.sim.variation import gpus_per_node
    from simexec.trace.schema import save_json

    rp = resolved(model, cluster, plan, seq_len)
    factors = parse_execute_slow(slow, rp.world, gpus_per_node(rp)) if slow else None
    result = execute(rp.model, rp.cluster, rp.plan, seq_len=rp.seq_len, slow=factors, **kw)
    if "stragglers" in result.reports:
        result.reports["stragglers"].update(predicted_straggler(rp, slow))
    if "recovery" in result.reports:
        result.reports["recovery"]["predicted"] = predicted_recovery(result.reports["recovery"])
    if json_path:
        save_json(result.to_json(rp), json_path)
    return result


def predicted_straggler(rp, spec: str) -> dict:
    from simexec.sim.simulate import simulate

    st = simulate(rp.model, rp.cluster, rp.plan, seq_len=rp.seq_len, symmetric=False, slow=spec).stragglers
    return {"predicted_ratio": st.slowdown, "predicted_step_s": st.step_time_s,
            "predicted_healthy_step_s": st.baseline_step_time_s,
            "predicted_by": "simexec simulate --full --slow (the same model, cluster and plan)"}


def predicted_recovery(rec: dict) -> Optional[dict]:
    """The goodput model's charge for the kill, given the restart measured."""
    from simexec.sim.goodput import lost_per_failure

    m = rec["measured"]
    step = m.get("healthy_step_s")
    if step is None:
        return None
    tau = rec["checkpoint_every"] * step
    this = m["restart_s"] + rec["steps_redone"] * step
    return {"this_kill_s": this, "redo_s": rec["steps_redone"] * step,
            "per_failure_expected_s": lost_per_failure(tau, m.get("checkpoint_save_s") or 0.0, NO_FAILURES_S,
                                                       m["restart_s"]),
            "interval_s": tau, "error_vs_this_kill": m["lost_s"] / this - 1 if this > 0 else None,
            "basis": "simexec.sim.goodput given the restart measured here: restart + steps redone x healthy step "
                     "(this kill); Daly's per-failure cost, about restart + (interval + save) / 2 (a failure at a "
                     "random time)"}
