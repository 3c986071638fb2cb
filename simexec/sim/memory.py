"""Live device memory per rank over the step, from the program's alloc/free instructions.

The total at any time is the live bytes of every category, plus the caching allocator's waste
(`allocator_overhead` x the dynamic bytes: activations, buffers, workspace, the tensors that come and
go) plus the fixed `workspace_bytes` (CUDA context, cuBLAS/NCCL workspaces). The peak and the
breakdown at the peak say whether a plan fits and, if not, what to cut.

A measured run reports less: PyTorch's `max_memory_allocated` (and the executor's tracker of live
tensors on CPU ranks) counts the tensors alone, not the allocator's waste, and on an accelerator not
the runtime's memory outside the allocator. `tensor_peak` is that figure, which `simexec compare`
holds against a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from simexec.specs.cluster import CostParams
from simexec.program.instructions import MEMORY_CATEGORIES

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
    "allocator": "follows the others: shrink the largest",
}


def memory_report(events_by_rank: dict[int, list[tuple[float, int, str, float]]], costs: CostParams,
                  capacity: float, keep_timeline: bool = False, fixed: bool = True,
                  runtime_outside_allocator: bool = True) -> MemoryReport:
    """`events_by_rank[r]`: (time, program order, category, +bytes for alloc / -bytes for free).

    fixed: add `workspace_bytes`; False when the program allocates the runtime workspace itself.
    runtime_outside_allocator: `workspace_bytes` is the runtime's, which a measurement of the tensors
    does not see (an accelerator's context and libraries); False where it stands for tensors (the
    executor's own on CPU ranks, `simexec.calibrate.evaluate.fit_memory`).
    """
    overhead = costs.allocator_overhead
    runtime = costs.workspace_bytes if runtime_outside_allocator and not fixed else 0.0
    fixed = costs.workspace_bytes if fixed else 0.0
    peak, breakdown, peak_time, timeline, tensor_peak = {}, {}, {}, {}, {}
    for rank, events in events_by_rank.items():
        events.sort()
        live = dict.fromkeys(MEMORY_CATEGORIES, 0.0)
        static = dynamic = 0.0
        best, best_t, best_live = fixed, 0.0, dict(live)
        tensors = 0.0 if runtime_outside_allocator else fixed
        line = [] if keep_timeline else None
        for t, _, cat, delta in events:
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
        bd = {c: best_live.get(c, 0.0) for c in MEMORY_CATEGORIES}
        bd["workspace"] += fixed
        bd["allocator"] = overhead * sum(best_live.get(c, 0.0) for c in DYNAMIC)
        peak[rank], peak_time[rank], breakdown[rank], tensor_peak[rank] = best, best_t, bd, tensors
        if line is not None:
            timeline[rank] = line
    return MemoryReport(peak, breakdown, peak_time, capacity, timeline, tensor_peak)
