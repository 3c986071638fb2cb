"""Reorder a program's instructions to lower each rank's peak of live tensor bytes where the order is free.

The lowering fixes one order; some of it is a choice for speed, not a dependency (ROAM, Hu et al. 2024,
arXiv:2310.19295, reorders the operators before planning their memory). Two such choices hold memory:

- a zero-bubble schedule's weight-gradient passes (`wgrad`, Qi et al. 2023, arXiv:2401.10241) wait
  until a bubble, and hold their block's saved inputs and output gradient until then: moved back to
  right after their input-gradient pass (and the sends or collectives it issues), they free them early;
- ZeRO-3's parameter gathers are issued one unit ahead (prefetch): moved forward to just before the
  first instruction that waits for them, one gathered unit is live at a time instead of two. A gather
  runs on its own stream, so it (and its allocation) also gains a dependency on the compute instruction
  it now follows.

Both trade overlap for memory; the simulator prices both orders. What stays exact:

- every instruction's `deps` precede it, and a `wgrad` follows its `bwd` (what it reads);
- the weight passes keep their order among themselves, so gradients are summed in the same order
  (bit-identical losses);
- the communication instructions (collectives, sends, receives, copies) keep their order on every
  rank, so collectives of a group stay in one order on all its members;
- a moved gather crosses no instruction that waits on communication other than an earlier one of its
  own stream (a wait there could need a peer that waits for this gather: a deadlock).

A memory marker that names a moved instruction in its `deps`, and the `mem.alloc.<name>` before it,
move with it. A rank whose peak the moves would not lower keeps its order. Pure and torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from simexec.program.instructions import Instr, Program

COMMUNICATION = ("collective", "send", "recv", "copy")
MOVES = ("wgrad", "gather")


@dataclass
class RankReorder:
    """One rank's live-tensor peaks (program order, the markers' running sum) before and after."""

    peak_before: float
    peak_after: float
    moved: int


@dataclass
class ReorderResult:
    program: Program
    ranks: dict[int, RankReorder] = field(default_factory=dict)

    @property
    def moved(self) -> int:
        return sum(r.moved for r in self.ranks.values())


def live_peak(instrs: list[Instr]) -> float:
    """The largest running sum of the memory markers in program order: the live tensor bytes."""
    live = peak = 0.0
    for i in instrs:
        if i.kind == "memory":
            live += i.bytes if i.op == "alloc" else -i.bytes
            peak = max(peak, live)
    return peak


def reorder_program(program: Program, moves: tuple[str, ...] = MOVES) -> ReorderResult:
    """A new program whose ranks run in the order of `reorder_rank` where it lowers their peak."""
    out: dict[int, list[Instr]] = {}
    ranks: dict[int, RankReorder] = {}
    for rank, instrs in program.ranks.items():
        new, moved = reorder_rank(instrs, moves)
        before, after = live_peak(instrs), live_peak(new)
        if after >= before:
            new, moved, after = list(instrs), 0, before
        out[rank] = new
        ranks[rank] = RankReorder(before, after, moved)
    meta = dict(program.meta, reordered="memory")
    reordered = Program(meta=meta, ranks=out, represents=dict(program.represents), resolved=program.resolved)
    return ReorderResult(reordered, ranks)


def reorder_rank(instrs: list[Instr], moves: tuple[str, ...] = MOVES) -> tuple[list[Instr], int]:
    """One rank's instructions reordered (module docstring) and how many units moved."""
    order = list(instrs)
    moved = 0
    if "wgrad" in moves:
        order, n = _weight_passes_early(order)
        moved += n
    if "gather" in moves:
        order, n = _gathers_late(order)
        moved += n
    return order, moved


def _unit(order: list[Instr], k: int) -> list[int]:
    """The indices of instruction k with its markers: `mem.alloc.<name>` and the markers naming it."""
    name = order[k].name
    idx = [k]
    alloc = "mem.alloc." + name
    for j in range(k - 1, -1, -1):
        if order[j].name == alloc:
            idx.insert(0, j)
            break
    for j in range(k + 1, len(order)):
        if order[j].kind == "memory" and name in order[j].deps:
            idx.append(j)
    return idx


def _move(order: list[Instr], idx: list[int], before: int) -> list[Instr]:
    """`order` with the instructions at `idx` taken out and put, in their order, before index `before`."""
    taken = set(idx)
    unit = [order[j] for j in idx]
    head = [order[j] for j in range(before) if j not in taken]
    tail = [order[j] for j in range(before, len(order)) if j not in taken]
    return head + unit + tail


def _weight_passes_early(order: list[Instr]) -> tuple[list[Instr], int]:
    moved = 0
    floor = -1  # the previous weight pass's position: they keep their order
    names = [i.name for i in order]
    for name in [i.name for i in order if i.kind == "compute" and i.phase == "wgrad"]:
        k = names.index(name)
        idx = _unit(order, k)
        members = {order[j].name for j in idx}
        pos = {n: j for j, n in enumerate(names)}
        bwd = "bwd." + name[len("wgrad."):]
        # after B, the unit's deps, and the allocations its frees release
        allocs = ["mem.alloc." + order[j].name[len("mem.free."):] for j in idx if order[j].name.startswith("mem.free.")]
        earliest = max([floor, pos.get(bwd, k)] + [pos[a] for a in allocs if a in pos and a not in members] +
                       [pos[d] for j in idx for d in order[j].deps if d in pos and d not in members])
        # what B's output feeds first: the sends and collectives issued right after it go first
        j = earliest + 1
        while j < idx[0] and (order[j].kind in COMMUNICATION or
                              (order[j].kind == "memory" and order[j].name not in members)):
            j += 1
        if j < idx[0]:
            order = _move(order, idx, j)
            moved += 1
            names = [i.name for i in order]
            floor = names.index(name)
        else:
            floor = k
    return order, moved


def _gathers_late(order: list[Instr]) -> tuple[list[Instr], int]:
    moved = 0
    for name in [i.name for i in order if i.kind == "collective" and i.block == "gather"]:
        names = [i.name for i in order]
        k = names.index(name)
        gather = order[k]
        idx = _unit(order, k)
        members = {order[j].name for j in idx}
        stream_before = {i.name for i in order[:k] if i.stream == gather.stream and i.kind in COMMUNICATION}
        kinds = {i.name: i.kind for i in order}
        j = k + 1
        while j < len(order):
            i = order[j]
            if i.name in members:
                j += 1
                continue
            if name in i.deps or i.kind in COMMUNICATION:
                break
            if i.kind == "compute" and (set(gather.items) & {i.layer} or any(
                    kinds.get(d) in COMMUNICATION and d not in stream_before for d in i.deps)):
                break
            j += 1
        if any(order[x].name not in members for x in range(k + 1, j)):
            # the gather's stream runs on its own: it waits for the compute it now follows
            after = next((order[x].name for x in range(j - 1, k, -1)
                          if order[x].kind == "compute" and order[x].name not in members), None)
            if after is not None:
                for x in idx:
                    if order[x].kind != "memory" or order[x].op == "alloc":
                        order[x] = replace(order[x], deps=tuple(dict.fromkeys(order[x].deps + (after,))))
            order = _move(order, idx, j)
            moved += 1
    return order, moved


def check_reorder(original: Program, reordered: Program) -> None:
    """Raise ValueError unless `reordered` keeps what `reorder_program` promises: the same instructions,
    deps before their users, a `wgrad` after its `bwd`, the weight passes' and communication's order."""
    for rank, instrs in original.ranks.items():
        new = reordered.ranks[rank]
        if sorted(i.name for i in instrs) != sorted(i.name for i in new):
            raise ValueError(f"rank {rank}: the reordered program has other instructions")
        pos = {i.name: k for k, i in enumerate(new)}
        for k, i in enumerate(new):
            for d in i.deps:
                if pos[d] > k:
                    raise ValueError(f"rank {rank}: {i.name} comes before its dependency {d}")
            if i.phase == "wgrad" and i.kind == "compute":
                bwd = "bwd." + i.name[len("wgrad."):]
                if bwd in pos and pos[bwd] > k:
                    raise ValueError(f"rank {rank}: {i.name} comes before {bwd}")
        for keep in (lambda i: i.kind in COMMUNICATION, lambda i: i.kind == "compute" and i.phase == "wgrad"):
            if [i.name for i in instrs if keep(i)] != [i.name for i in new if keep(i)]:
                raise ValueError(f"rank {rank}: communication or weight passes changed their order")
