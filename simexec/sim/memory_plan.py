"""An offline memory plan: every block of an allocation trace placed at a fixed offset in one arena.

Knowing every size and lifetime ahead, a planner packs the blocks so that two blocks live at the same
time never overlap; the arena's size is the peak a framework that executed the plan would reserve.
Greedy by size (TFLite's `ArenaPlanner` with its `SimpleMemoryArena` best fit,
tensorflow/lite/simple_memory_arena.cc; ROAM, Hu et al. 2024, arXiv:2310.19295, plans offsets the same
way after ordering the operators): blocks in decreasing size (the longer-lived first among equals), each at
the lowest offset of the smallest gap among the blocks already placed that overlap it in time. Sizes are
rounded to 512 B as the caching allocator rounds them. The plan keeps the program's order of allocations
and frees; reordering them (ROAM's other half) is not done here.
"""
from __future__ import annotations

from dataclasses import dataclass

from simexec.sim.alloc_trace import AllocationTrace
from simexec.sim.allocator import round_size


@dataclass
class MemoryPlan:
    """Each block's offset and the arena's size (the planned peak)."""

    offsets: dict[int, int]
    arena_bytes: int


def plan_offsets(trace: AllocationTrace) -> MemoryPlan:
    """Greedy-by-size best-fit offsets for the trace's blocks (module docstring)."""
    end_of_trace = len(trace.keys) + 1
    spans = [(b.block, round_size(b.size), b.alloc_at, end_of_trace if b.free_at is None else b.free_at)
             for b in trace.blocks if b.size > 0]
    spans.sort(key=lambda s: (-s[1], -(s[3] - s[2]), s[2]))
    placed: list[tuple[int, int, int, int]] = []  # (offset, end offset, alloc event, free event), by offset
    offsets: dict[int, int] = {}
    arena = 0
    for block, size, start, stop in spans:
        best, best_gap, cursor = None, None, 0
        for off, end, a, f in placed:
            if a >= stop or start >= f:
                continue  # not live at the same time
            gap = off - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, end)
        offset = best if best is not None else cursor
        offsets[block] = offset
        _insert_by_offset(placed, (offset, offset + size, start, stop))
        arena = max(arena, offset + size)
    return MemoryPlan(offsets, arena)


def _insert_by_offset(placed: list, item: tuple) -> None:
    lo, hi = 0, len(placed)
    while lo < hi:
        mid = (lo + hi) // 2
        if placed[mid][0] <= item[0]:
            lo = mid + 1
        else:
            hi = mid
    placed.insert(lo, item)
