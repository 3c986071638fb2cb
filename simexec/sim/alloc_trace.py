"""A rank's allocation trace: which free releases which allocation, from the program's alloc/free markers.

The lowering names a marker `mem.alloc.<tag>` / `mem.free.<tag>`, but its tags do not always pair one to
one: a layer's saved activations are allocated as one marker (`act.L3.m0`) and released block by block
(`act.L3.m0.attn`, `act.L3.m0.fc1`, ...); a recomputed layer's or a zero-bubble input pass's share goes
under other names (`act.recompute.L3.m0`, `act.input_pass.L3.m0`); one free may release several
allocations (`grads.shards`, a bucket freed as `grads.dp.b3` after its allocation as `grads.dp.L5.b3`).
The pairing rule, in order, each step taking the live allocations of the free's category until the
free's bytes are covered:

1. the same tag (oldest first);
2. a tag that is a dot-prefix of the free's (`act.L3.m0` for `act.L3.m0.attn`), longest first;
3. a tag holding every index token (`L3`, `m0`, `b3`) of the free's, oldest first;
4. any live allocation of the category, newest first.

A free smaller than what is left of its allocation releases a piece of it, so each allocation is split
into per-piece blocks (one per free that released part of it, and one for what is never freed), allocated
together where the allocation was. Granularity: a block is what the lowering frees at once, a block's
saved activations or a layer's buffers, where PyTorch holds many tensors (each rounded and placed
alone); the replay sees fewer, larger requests than the real allocator.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

INDEX_TOKEN = re.compile(r"^[A-Za-z]+-?\d+$")
TOLERANCE = 1.0  # bytes: float sums of the same sizes


@dataclass(frozen=True)
class TraceBlock:
    """One piece of memory: `size` bytes live from event `alloc_at` to `free_at` (None: held to the end)."""

    block: int
    size: int
    alloc_at: int
    free_at: int | None
    category: str
    tag: str
    stream: str = "compute"


@dataclass
class AllocationTrace:
    """A rank's blocks and the order of their allocs and frees: `ops` is (event, +block id / -(id + 1))."""

    blocks: list[TraceBlock]
    ops: list[tuple[int, int]]
    keys: list[tuple[float, int]]  # each event's (time, program order)
    unmatched_free_bytes: float = 0.0  # frees with no live allocation left to release

    def max_live_bytes(self) -> int:
        live = best = 0
        for _, op in self.ops:
            live += self.blocks[op].size if op >= 0 else -self.blocks[-op - 1].size
            best = max(best, live)
        return best


def _index_tokens(tag: str) -> frozenset[str]:
    return frozenset(t for t in tag.split(".") if INDEX_TOKEN.match(t))


class _Live:
    __slots__ = ("seq", "tag", "category", "remaining", "pieces", "at", "index", "stream")

    def __init__(self, seq: int, tag: str, category: str, nbytes: float, at: int, stream: str = "compute"):
        self.seq, self.tag, self.category, self.remaining, self.at = seq, tag, category, nbytes, at
        self.stream = stream
        self.index = _index_tokens(tag)
        self.pieces: list[tuple[float, int]] = []  # (bytes, event of the free)


def build_trace(events: list[tuple], skip: tuple[str, ...] = ()) -> AllocationTrace:
    """`events`: one rank's (time, program order, category, +bytes alloc / -bytes free, tag[, stream]), in
    any order; `skip`: categories left out (the runtime workspace, counted apart)."""
    events = sorted(e for e in events if e[2] not in skip)
    by_tag: dict[str, list[_Live]] = {}
    by_category: dict[str, dict[int, _Live]] = {}
    allocations: list[_Live] = []
    unmatched = 0.0
    for k, (_, _, cat, delta, tag, *rest) in enumerate(events):
        if delta > 0:
            a = _Live(len(allocations), tag, cat, delta, k, rest[0] if rest else "compute")
            allocations.append(a)
            by_tag.setdefault(tag, []).append(a)
            by_category.setdefault(cat, {})[a.seq] = a
            continue
        need = -delta
        for a in _candidates(tag, cat, by_tag, by_category):
            if a.remaining <= TOLERANCE:
                continue
            take = min(need, a.remaining)
            if a.remaining - take <= TOLERANCE:
                take = a.remaining
            a.pieces.append((take, k))
            a.remaining -= take
            need -= take
            if a.remaining <= TOLERANCE:
                by_tag[a.tag].remove(a)
                del by_category[a.category][a.seq]
            if need <= TOLERANCE:  # before asking for the next candidate: the later rules scan every live one
                break
        if need > TOLERANCE:
            unmatched += need
    blocks: list[TraceBlock] = []
    ops: list[tuple[int, int]] = []
    for a in allocations:
        pieces = sorted(a.pieces, key=lambda p: -p[1])  # the piece freed last was allocated first
        if a.remaining > TOLERANCE:
            pieces.insert(0, (a.remaining, None))
        for nbytes, free_at in pieces:
            b = TraceBlock(len(blocks), int(math.ceil(nbytes)), a.at, free_at, a.category, a.tag, a.stream)
            blocks.append(b)
            ops.append((a.at, b.block))
            if free_at is not None:
                ops.append((free_at, -b.block - 1))
    ops.sort(key=lambda o: o[0])  # stable: a free's pieces and an allocation's stay in order
    return AllocationTrace(blocks, ops, [(e[0], e[1]) for e in events], unmatched)


def _candidates(tag: str, cat: str, by_tag: dict[str, list[_Live]], by_category: dict[str, dict[int, _Live]]):
    """The live allocations a free of `tag` releases, in the pairing rule's order (module docstring)."""
    seen: set[int] = set()
    for a in list(by_tag.get(tag, ())):
        seen.add(a.seq)
        yield a
    parts = tag.split(".")
    for n in range(len(parts) - 1, 0, -1):
        for a in list(by_tag.get(".".join(parts[:n]), ())):
            if a.category == cat and a.seq not in seen:
                seen.add(a.seq)
                yield a
    live = by_category.get(cat, {})
    index = _index_tokens(tag)
    if index:
        for a in [a for a in live.values() if a.seq not in seen and index <= a.index]:
            seen.add(a.seq)
            yield a
    for a in sorted((a for a in live.values() if a.seq not in seen), key=lambda a: -a.seq):
        yield a
