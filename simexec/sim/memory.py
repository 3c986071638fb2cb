"""Live device memory per rank over the step, from the program's alloc/free instructions.

On a GPU the peak is what the caching allocator reserves: the program's allocations and frees, paired
into a trace (`simexec.sim.alloc_trace`), replayed through a model of PyTorch's CUDA caching allocator
(`simexec.sim.allocator`), its reserved peak plus the fixed `workspace_bytes` (CUDA context,
cuBLAS/NCCL workspaces, outside the allocator); beside it the arena an offline planner would need
(`simexec.sim.memory_plan`). Elsewhere (the executor's CPU ranks) the total at any time is the live
bytes of every category, plus `allocator_overhead` x the dynamic bytes, plus the fixed
`workspace_bytes`. The peak and the breakdown at the peak say whether a plan fits and, if not, what
to cut.

A measured run reports less: PyTorch's `max_memory_allocated` (and the executor's tracker of live
tensors on CPU ranks) counts the tensors alone, not the allocator's waste, and on an accelerator not
the runtime's memory outside the allocator. `tensor_peak` is that figure, which `simexec compare`
holds against a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from simexec.specs.cluster import CostParams
from simexec.program.instructions import MEMORY_CATEGORIES
from simexec.sim.alloc_trace import build_trace
from simexec.sim.allocator import replay
from simexec.sim.memory_plan import plan_offsets

DYNAMIC = ("activations", "buffers", "workspace")


@dataclass
class MemoryReport:
    """Peaks and breakdowns of the simulated ranks; `timeline` holds (time, category, live bytes)."""

    peak: dict[int, float]
    breakdown: dict[int, dict[str, float]]
    peak_time: dict[int, float]
    capacity: float
    timeline: dict[int, list[tuple[float, str, float]]] = field(default_factory=dict)
    tensor_peak: dict[int, float] = field(default_factory=dict)
    # the caching allocator's replay (GPU ranks): the offline planner's arena plus the runtime's
    # workspace, and the allocator the peak comes from ("" where the peak is the share model's)
    planned_peak: dict[int, float] = field(default_factory=dict)
    allocator: str = ""

    def fits(self, margin: float = 0.0) -> bool:
        """Whether every rank's peak leaves `margin` bytes of the device free."""
        return max(self.peak.values(), default=0.0) + margin <= self.capacity


# What shrinks each category of the peak, for the largest one's hint (`SimResult.format`).
SHRINKS = {
    "params": "tp, pp or zero=3 shard the parameters",
    "grads": "zero=2 or 3, tp or pp shard the gradients",
    "optimizer": "zero >= 1 shards the optimizer states; offload=optimizer moves them to the host",
    "activations": "recompute (selective, full), a smaller mbs, or more tp with sp, cp or pp split them",
    "buffers": "smaller ZeRO-3 units or buckets, or fewer in flight",
    "workspace": "the runtime's own: fixed per device",
    "allocator": "follows the others: shrink the largest; expandable_segments:True cuts fragmentation",
}


def memory_report(events_by_rank: dict[int, list[tuple[float, int, str, float]]], costs: CostParams,
                  capacity: float, keep_timeline: bool = False, fixed: bool = True,
                  runtime_outside_allocator: bool = True, caching_allocator: bool = False,
                  expandable_segments: bool = False, memory_plan: bool = False) -> MemoryReport:
    """`events_by_rank[r]`: (time, program order, category, +bytes for alloc / -bytes for free[, tag]).

    fixed: add `workspace_bytes`; False when the program allocates the runtime workspace itself.
    runtime_outside_allocator: `workspace_bytes` is the runtime's, which a measurement of the tensors
    does not see (an accelerator's context and libraries); False where it stands for tensors (the
    executor's own on CPU ranks, `simexec.calibrate.evaluate.fit_memory`).
    caching_allocator: the peak is the CUDA caching allocator's reserved peak (events carry tags), with
    `expandable_segments` as the stack sets it, plus `workspace_bytes`; not `allocator_overhead`.
    memory_plan: with the caching allocator, also plan the trace's offsets offline (`plan_offsets`,
    quadratic in the blocks: on request).
    """
    overhead = costs.allocator_overhead
    runtime = costs.workspace_bytes if runtime_outside_allocator and not fixed else 0.0
    fixed = costs.workspace_bytes if fixed else 0.0
    peak, breakdown, peak_time, timeline, tensor_peak = {}, {}, {}, {}, {}
    planned: dict[int, float] = {}
    for rank, events in events_by_rank.items():
        events.sort()
        if caching_allocator:
            _reserved_peak(rank, events, costs, capacity, expandable_segments, peak, breakdown, peak_time,
                           planned if memory_plan else None)
        live = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
        static = dynamic = 0.0
        best, best_t, best_live = fixed, 0.0, dict(live)
        tensors = 0.0 if runtime_outside_allocator else fixed
        line = [] if keep_timeline else None
        for t, _, cat, delta, *_ in events:
            live[cat] = live.get(cat, 0.0) + delta
            if cat in DYNAMIC:
                dynamic += delta
            else:
                static += delta
            total = static + dynamic * (1.0 + overhead) + fixed
            if total > best:
                best, best_t, best_live = total, t, dict(live)
            held = static + dynamic - runtime + (0.0 if runtime_outside_allocator else fixed)
            if held > tensors:
                tensors = held
            if line is not None:
                line.append((t, cat, live[cat]))
        tensor_peak[rank] = tensors
        if line is not None:
            timeline[rank] = line
        if caching_allocator:
            continue
        bd = {c: best_live.get(c, 0.0) for c in MEMORY_CATEGORIES}
        bd["workspace"] += fixed
        bd["allocator"] = overhead * sum(best_live.get(c, 0.0) for c in DYNAMIC)
        peak[rank], peak_time[rank], breakdown[rank] = best, best_t, bd
    kind = ("expandable-segments" if expandable_segments else "caching-allocator") if caching_allocator else ""
    return MemoryReport(peak, breakdown, peak_time, capacity, timeline, tensor_peak, planned, kind)


def _reserved_peak(rank: int, events: list, costs: CostParams, capacity: float, expandable: bool,
                   peak: dict, breakdown: dict, peak_time: dict, planned: Optional[dict]) -> None:
    """The caching allocator's reserved peak of one rank (sorted events), its breakdown and planned peak.
    The runtime's workspace is outside the allocator: left out of the replay, added to its peak."""
    runtime = costs.workspace_bytes
    trace = build_trace(events, skip=("workspace",))
    result = replay(trace, capacity - runtime, expandable)
    live = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
    at = trace.keys[result.peak_event] if result.peak_event >= 0 else None
    if at is not None:
        for t, order, cat, delta, *_ in events:
            if (t, order) > at:
                break
            if cat != "workspace":
                live[cat] = live.get(cat, 0.0) + delta
    bd = {c: live.get(c, 0.0) for c in MEMORY_CATEGORIES}
    bd["workspace"] = runtime
    bd["allocator"] = max(0.0, result.reserved_peak - sum(v for c, v in live.items() if c != "workspace"))
    peak[rank] = result.reserved_peak + runtime
    peak_time[rank] = at[0] if at is not None else 0.0
    breakdown[rank] = bd
    if planned is not None:
        planned[rank] = plan_offsets(trace).arena_bytes + runtime
