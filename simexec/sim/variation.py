"""Step time on a real cluster: named stragglers, and GPU-to-GPU speed variation over many seeds.

Both re-run the discrete-event simulation of an already lowered program with per-rank compute
slowdowns (`Engine(compute_slowdown=...)`) and, for stragglers, slowed NICs (`Network.slow_nics`);
memory is not affected and is not recomputed.

Variation: GPUs of one SKU do not sustain one speed. Sinha et al., "Not All GPUs Are Created Equal:
Characterizing Variability in Large-Scale, Accelerator-Rich Systems" (SC'22, arXiv:2208.11035v3)
measured over 90% of the GPUs of Summit, Vortex, Frontera, Longhorn and Corona: 8% average
performance variation (22% at most, by application and cluster), outliers up to 1.5x slower than the
median GPU. The model: each GPU's slowdown against the simulated (nominal) GPU is
`max(1, 1 + CV * z)`, z standard normal, drawn per real rank with `numpy.random.default_rng(seed)`.
The nominal device is the median one; GPUs faster than it are not credited (a step waits for the
slowest member of every group, so with more than a handful of ranks per group the faster half
almost never sets the pace). Symmetric mode keeps one simulated rank per stage, charged the largest
draw of the ranks it stands for (`simexec.sim.slowdown`), so the cost stays one small simulation per
seed at any rank count while the maximum over more ranks grows with the rank count, as it should.

Link variation (`link_cv`): NICs and cables of one model do not all carry their line rate either (a link
trained down, a flapping port, a congested rail). Each node's NIC links get a factor `max(1, 1 + link_cv * z)`
from a second stream of the same seed (`numpy.random.default_rng([seed, 1])`), applied as a slowed NIC is
(`Network.slow_nics`: the links' capacity shrinks, NCCL's choice of algorithm stays the healthy one); in
symmetric mode a simulated rank's node takes the largest factor of the nodes it stands for. The two CVs
have no default: measure your fleet (per-GPU GEMM speed, per-NIC `ib_write_bw` or nccl-tests busbw).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from simexec.errors import SpecError
from simexec.program.instructions import Program
from simexec.specs.plan import ResolvedPlan
from simexec.sim.slowdown import Slowdown, simulated_compute, simulated_nics


@dataclass
class SlowedStep:
    """One simulated step with slowed ranks or NICs."""

    step_time_s: float
    breakdown_s: dict[str, float]
    slowest_rank: int


def gpus_per_node(rp: ResolvedPlan) -> int:
    return rp.cluster.node.gpus_per_node or rp.world


def run_slowed(rp: ResolvedPlan, program: Program, compute: Optional[dict[int, float]] = None,
               nic: Optional[dict[int, float]] = None) -> SlowedStep:
    """Simulate `program` with real-rank compute factors and node NIC factors (step time only)."""
    from simexec.sim.breakdown import breakdown, slowest_rank
    from simexec.sim.engine import Engine
    from simexec.sim.machine import machine_for

    machine = machine_for(rp.cluster, program, rp.plan.dtype)
    if nic:
        machine.network.slow_nics(simulated_nics(nic, program, gpus_per_node(rp)))
    eng = Engine(program, machine, simulated_compute(compute or {}, program))
    step = eng.run()
    slow = slowest_rank(eng)
    return SlowedStep(step, breakdown(eng, slow, step), slow)


@dataclass
class StragglerReport:
    """A step with named stragglers against the same step on healthy hardware."""

    slow: dict
    step_time_s: float
    baseline_step_time_s: float
    slowdown: float  # step_time_s / baseline_step_time_s
    breakdown_s: dict[str, float]

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def format(self) -> str:
        return (f"  stragglers      step {self.step_time_s:.4g} s vs {self.baseline_step_time_s:.4g} s healthy: "
                f"x{self.slowdown:.3f} ({100 * (self.slowdown - 1):+.1f}%)")


def straggler_report(rp: ResolvedPlan, program: Program, slow: Slowdown, baseline_step_s: float) -> StragglerReport:
    run = run_slowed(rp, program, slow.compute, slow.nic)
    ratio = run.step_time_s / baseline_step_s if baseline_step_s > 0 else 1.0
    return StragglerReport(slow.to_json(), run.step_time_s, baseline_step_s, ratio, run.breakdown_s)


def draw_slowdowns(world: int, cv: float, seed: int) -> np.ndarray:
    """Per real rank, its compute slowdown against the nominal GPU: max(1, 1 + cv * z)."""
    z = np.random.default_rng(seed).standard_normal(world)
    return np.maximum(1.0, 1.0 + cv * z)


LINK_STREAM = 1  # the second random stream of a seed: node NIC factors, independent of the GPUs'


def draw_link_slowdowns(nodes: int, cv: float, seed: int) -> np.ndarray:
    """Per node, its NIC links' slowdown against their line rate: max(1, 1 + cv * z)."""
    z = np.random.default_rng([seed, LINK_STREAM]).standard_normal(nodes)
    return np.maximum(1.0, 1.0 + cv * z)


def group_max(draws: np.ndarray, program: Program) -> dict[int, float]:
    """Per simulated rank, the largest draw among the ranks it stands for (vectorised)."""
    reps = program.represents or {}
    out = {}
    for r in program.ranks:
        members = reps.get(r, (r,))
        f = float(draws[list(members)].max())
        if f != 1.0:
            out[r] = f
    return out


@dataclass
class VariationReport:
    """Step times over `seeds` draws of per-GPU speed (coefficient of variation `cv`) and, where
    `link_cv` is set, of per-node NIC bandwidth."""

    cv: float
    seeds: int
    baseline_step_time_s: float
    step_times_s: list[float] = field(default_factory=list)
    p50_s: float = 0.0
    p90_s: float = 0.0
    p99_s: float = 0.0
    median_slowdown: float = 1.0  # p50 / the identical-GPU step
    link_cv: Optional[float] = None

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def format(self) -> str:
        links = f", links CV {self.link_cv:g}" if self.link_cv is not None else ""
        return (f"  variation       CV {self.cv:g}{links} over {self.seeds} seeds: p50 {self.p50_s:.4g} s  "
                f"p90 {self.p90_s:.4g} s  p99 {self.p99_s:.4g} s  "
                f"(median x{self.median_slowdown:.3f} vs identical GPUs)")


def check_variation(cv: float, seeds: int, link_cv: Optional[float] = None) -> None:
    if not (0.0 <= cv < 1.0):
        raise SpecError(f"--variation {cv:g}: the coefficient of variation must be in [0, 1)")
    if link_cv is not None and not (0.0 <= link_cv < 1.0):
        raise SpecError(f"--link-variation {link_cv:g}: the coefficient of variation must be in [0, 1)")
    if seeds < 1:
        raise SpecError(f"--seeds {seeds}: need at least one seed")


def gpu_cv(variation: Optional[float], seeds: int, link_cv: Optional[float] = None) -> Optional[float]:
    """The per-GPU CV to draw with, checked: `variation`, or 0 (identical GPUs) where only the links
    vary; None where neither does."""
    if link_cv is not None and variation is None:
        variation = 0.0
    if variation is not None:
        check_variation(variation, seeds, link_cv)
    return variation


def variation_report(rp: ResolvedPlan, program: Program, cv: float, seeds: int,
                     baseline_step_s: float, link_cv: Optional[float] = None) -> VariationReport:
    """One simulation per seed (seed 0..seeds-1) with drawn per-GPU slowdowns and, with `link_cv`,
    per-node NIC slowdowns."""
    check_variation(cv, seeds, link_cv)
    from simexec.sim.engine import Engine
    from simexec.sim.machine import machine_for

    gpn = gpus_per_node(rp)
    nodes = -(-rp.world // gpn)
    times = []
    for seed in range(seeds):
        factors = group_max(draw_slowdowns(rp.world, cv, seed), program) if cv > 0 else {}
        machine = machine_for(rp.cluster, program, rp.plan.dtype)
        if link_cv:
            draws = draw_link_slowdowns(nodes, link_cv, seed)
            slowed = {n: float(f) for n, f in enumerate(draws) if f != 1.0}
            machine.network.slow_nics(simulated_nics(slowed, program, gpn))
        times.append(Engine(program, machine, factors).run())
    arr = np.asarray(times)
    p50, p90, p99 = (float(np.percentile(arr, q)) for q in (50, 90, 99))
    return VariationReport(cv, seeds, baseline_step_s, [float(t) for t in times], p50, p90, p99,
                           p50 / baseline_step_s if baseline_step_s > 0 else 1.0, link_cv)
