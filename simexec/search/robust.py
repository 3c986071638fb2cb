"""`search --robust`: re-rank the search's best plans by what a straggler (or GPU variation) costs them.

A straggler's cost is a property of the plan, not a formula: each candidate is lowered again and its
step re-simulated with the straggler's compute slowdown on one rank (`Engine(compute_slowdown=...)`
through `simexec.sim.variation.run_slowed`), so pipeline depth, group sizes and how much
communication the plan overlaps set the cost through the engine's mechanics.

Worst placement. The default straggler is one GPU computing 1.2x slower (`rank:R:1.2`), placed where
it costs the plan most. The search simulates symmetrically: one rank per pipeline stage stands for
the ranks of its stage, and a slow rank slows its representative (`simexec.sim.slowdown`), since every
data-, tensor- and context-parallel collective of the stage waits for it. So the placements that
differ are the stages: the straggler is tried on each stage's representative (pp simulations per
plan) and the slowest step is the plan's straggled step. The first and last stage hold the
embedding, head and loss, a middle stage sits where the 1F1B schedule has the least slack: which one
costs most depends on the plan, which is why all are tried. Any `--slow` spec (`rank:R:F,node:N:F,
nic:N:F`) may be given instead of a bare factor; it is then applied as written to every plan.

Variation (`--variation CV --seeds K`): each candidate's step over K seeds of per-GPU speed
(`simexec.sim.variation.variation_report`); plans are then ranked by the p90 step.

Only the best `top` x `ROBUST_POOL` plans the search simulated are re-simulated, not the space: a plan
slower than all of them when healthy would need a straggler to cost it less than it costs them by more
than the healthy gap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from simexec.errors import SpecError
from simexec.search.runners import Context

ROBUST_POOL = 3  # re-simulate the best top x 3 plans
DEFAULT_FACTOR = 1.2


@dataclass(frozen=True)
class RobustSpec:
    """A straggler to rank plans by: a factor placed at each plan's worst stage, or a fixed `--slow` spec."""

    factor: Optional[float] = DEFAULT_FACTOR
    slow: Optional[str] = None
    variation: Optional[float] = None
    seeds: int = 16
    link_variation: Optional[float] = None

    def describe(self) -> str:
        what = (f"one GPU {self.factor:g}x slower at the plan's worst stage" if self.slow is None
                else f"--slow {self.slow}")
        if self.variation is not None:
            links = f", NIC CV {self.link_variation:g}" if self.link_variation is not None else ""
            what += f"; GPU variation CV {self.variation:g}{links} over {self.seeds} seeds (ranked by p90)"
        return what


def parse_robust(text: Optional[str], variation: Optional[float] = None, seeds: int = 16,
                 link_variation: Optional[float] = None) -> RobustSpec:
    """`--robust` [F | SPEC]: a bare number is the worst-placed straggler's factor; anything else a
    `--slow` spec. Bad input raises a one-line SpecError. Link variation alone draws the NICs with
    identical GPUs (a GPU CV of 0)."""
    from simexec.sim.variation import gpu_cv

    variation = gpu_cv(variation, seeds, link_variation)
    text = (text or "").strip()
    if not text:
        return RobustSpec(DEFAULT_FACTOR, None, variation, seeds, link_variation)
    try:
        factor = float(text)
    except ValueError:
        if not all(len(x.split(":")) == 3 for x in text.split(",") if x.strip()):
            raise SpecError(f"--robust {text!r}: expected a slowdown factor (1.2) or a --slow spec "
                            f"(rank:R:F, node:N:F, nic:N:F)") from None
        return RobustSpec(None, text, variation, seeds, link_variation)
    if not (factor >= 1.0 and math.isfinite(factor)):
        raise SpecError(f"--robust {text}: the straggler's factor must be a finite number >= 1")
    return RobustSpec(factor, None, variation, seeds, link_variation)


@dataclass
class RobustRow:
    plan: str
    step_time_s: float  # healthy
    straggled_step_time_s: float
    ratio: float
    straggler: dict  # where the straggler was: {"compute": {rank: F}, "nic": {...}}
    tokens_per_s: float  # under the straggler
    p90_step_time_s: Optional[float] = None

    def key(self) -> tuple:
        worst = self.p90_step_time_s if self.p90_step_time_s is not None else self.straggled_step_time_s
        return (worst, self.straggled_step_time_s, self.step_time_s, self.plan)


@dataclass
class RobustReport:
    spec: str
    ranked_by: str
    rows: list[RobustRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"spec": self.spec, "ranked_by": self.ranked_by, "plans": [dict(r.__dict__) for r in self.rows]}

    def format(self) -> str:
        var = any(r.p90_step_time_s is not None for r in self.rows)
        lines = [f"  robust: {self.spec}; {len(self.rows)} plans re-simulated, ranked by {self.ranked_by}:",
                 f"  {'#':>3}  {'healthy s':>9}  {'straggled s':>11}  {'x':>6}  {'tokens/s':>11}"
                 + (f"  {'p90 s':>9}" if var else "") + "  where  plan"]
        for i, r in enumerate(self.rows, 1):
            where = ",".join(f"r{k}" for k in r.straggler.get("compute", {})) or "-"
            p90 = f"  {r.p90_step_time_s:9.4g}" if var else ""
            lines.append(f"  {i:>3}  {r.step_time_s:9.4g}  {r.straggled_step_time_s:11.4g}  {r.ratio:6.3f}  "
                         f"{r.tokens_per_s:11,.0f}{p90}  {where:<5}  {r.plan}")
        return "\n".join(lines)


def _lowered(plan: str, ctx: Context):
    from simexec.program.lower import lower
    from simexec.specs.plan import parse_plan, resolve
    from simexec.specs.stack import get_stack

    cluster = ctx.cluster
    if ctx.profile is not None:
        from simexec.sim.profile import apply_profile

        cluster = apply_profile(cluster, ctx.profile)
    stack = ctx.stack if ctx.stack is not None else get_stack(None)
    rp = resolve(ctx.model, cluster, parse_plan(plan), ctx.seq_len, stack)
    return rp, lower(rp, symmetric=True)


def worst_straggler(rp, program, factor: float) -> tuple[float, dict[int, float]]:
    """The slowest step with one rank `factor` x slower, over one placement per pipeline stage (the
    simulated ranks of the symmetric program); ties go to the lowest rank."""
    from simexec.sim.variation import run_slowed

    best = (-math.inf, {})
    for r in sorted(program.ranks):
        step = run_slowed(rp, program, {r: factor}).step_time_s
        if step > best[0]:
            best = (step, {r: factor})
    return best


def robust_report(plans: list[dict], ctx: Context, spec: RobustSpec) -> RobustReport:
    """Re-simulate `plans` (search entries, healthy numbers) under `spec`; best first."""
    from simexec.sim.slowdown import parse_slow
    from simexec.sim.variation import gpus_per_node, run_slowed, variation_report

    rows = []
    for e in plans:
        rp, program = _lowered(e["plan"], ctx)
        healthy = e["step_time_s"]
        if spec.slow is None:
            straggled, where = worst_straggler(rp, program, spec.factor)
            placed = {"compute": {str(k): v for k, v in where.items()}, "nic": {}}
        else:
            slow = parse_slow(spec.slow, rp.world, gpus_per_node(rp))
            straggled = run_slowed(rp, program, slow.compute, slow.nic).step_time_s
            placed = slow.to_json()
        p90 = None
        if spec.variation is not None:
            p90 = variation_report(rp, program, spec.variation, spec.seeds, healthy, spec.link_variation).p90_s
        rows.append(RobustRow(e["plan"], healthy, straggled, straggled / healthy if healthy > 0 else 1.0, placed,
                              rp.tokens_per_step / straggled if straggled > 0 else 0.0, p90))
    rows.sort(key=RobustRow.key)
    by = "p90 step time under variation" if spec.variation is not None else "straggled step time"
    return RobustReport(spec.describe(), by, rows)
