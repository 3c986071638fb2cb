"""`search --objective time-to-train`: rank plans by the days to train N tokens, failures and checkpoints in.

The days (`simexec.sim.goodput.time_to_train`) are the step time scaled to the run, then Daly's
expected wall time with the plan's own checkpoint: every plan writes the same model states, but the
blocking device-to-host copy is of its largest rank's states (ZeRO and pipeline depth shard them),
so a plan that keeps more state per GPU checkpoints slower and fails over the same MTBF (the GPU
count is the search's). Those terms are small next to the step time, so the ranking follows the
step time except where two plans are close.

The search simulates the fastest `top` x `TIME_TO_TRAIN_POOL` plans (its throughput search, pruning
intact) and ranks them by days. Whether that is the exact top is checked, not assumed: any plan left
out steps at least as slowly as the slowest of the pool, and its wall time is at least its step
time's work times e^{R/M} (Daly's T_w with no checkpoint cost, R the bare restart), so when that
lower bound is past the K-th best days no plan outside the pool can enter the top K (`exact`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from simexec.search.runners import Context
from simexec.sim.goodput import DAY, HOUR, GoodputParams, plan_checkpoint, time_to_train


@dataclass
class DaysRanking:
    tokens: float
    ranked: list[dict] = field(default_factory=list)  # the pool's results with "days", fewest first
    exact: bool = True
    outside_days_lower_bound: float = math.inf  # no plan outside the pool trains in fewer days

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "exact": self.exact,
                "outside_days_lower_bound": None if math.isinf(self.outside_days_lower_bound)
                else self.outside_days_lower_bound, "pool": len(self.ranked)}


def _resolved(plan: str, ctx: Context):
    from simexec.specs.plan import parse_plan, resolve
    from simexec.specs.stack import get_stack

    cluster = ctx.cluster
    if ctx.profile is not None:
        from simexec.sim.profile import apply_profile

        cluster = apply_profile(cluster, ctx.profile)
    stack = ctx.stack if ctx.stack is not None else get_stack(None)
    return resolve(ctx.model, cluster, parse_plan(plan), ctx.seq_len, stack)


def rank_by_days(pool: list[dict], ctx: Context, tokens: float, params: GoodputParams,
                 complete: bool = True, keep: int = 0, whole: bool = False) -> DaysRanking:
    """`pool`: the fastest fitting results (step order), `keep` of which are reported (default a third);
    whole: the pool holds every plan that fits (the search pruned none for it)."""
    ranked = []
    for r in pool:
        rp = _resolved(r["plan"], ctx)
        t = time_to_train(tokens, r["tokens_per_s"], r.get("breakdown_s", {}), rp.world,
                          plan_checkpoint(rp, params), params)
        ranked.append({**r, "days": t.days, "time_to_train": t.to_json()})
    ranked.sort(key=lambda r: (r["days"], r["step_time_s"], r["plan"]))
    out = DaysRanking(tokens, ranked, exact=complete)
    if not ranked or whole or not complete:
        return out
    keep = keep or max(1, len(pool) // 3)
    slowest = max(pool, key=lambda r: r["step_time_s"])
    gpus = _resolved(slowest["plan"], ctx).world
    rate = params.failures_per_gpu_hour * gpus / HOUR
    solve = tokens / slowest["tokens_per_s"] if slowest["tokens_per_s"] > 0 else math.inf
    out.outside_days_lower_bound = solve * math.exp(params.restart_s * rate) / DAY
    kth = ranked[min(keep, len(ranked)) - 1]["days"]
    out.exact = complete and out.outside_days_lower_bound >= kth
    return out
