"""Replay an allocation trace through a model of PyTorch's CUDA caching allocator: its reserved peak.

What runs out on a GPU is the memory the caching allocator has reserved from CUDA
(`torch.cuda.max_memory_reserved`), not the tensors: freed blocks stay cached in their segments, and a
request no cached block fits takes a new segment. The rules below are those of
c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch@001074d25084fdb87a799823e395a50f5ec044d3, the default
configuration: no max_split_size, no roundup_power2_divisions, no garbage collection threshold):

- a request is rounded up to a multiple of 512 B (`kMinBlockSize`, `round_size`);
- requests <= 1 MiB (`kSmallSize`) use the small pool, the rest the large pool (`get_pool`);
- a request no cached block fits takes a new segment (`get_allocation_size`): 2 MiB (`kSmallBuffer`)
  for the small pool, 20 MiB (`kLargeBuffer`) for requests under 10 MiB (`kMinLargeAlloc`), else its size
  rounded up to 2 MiB (`kRoundLarge`);
- the cached free block is the pool's best fit, the smallest that fits, the lowest address among equals
  (`get_free_block`, `BlockComparatorSize`);
- it is split when the rest is >= 512 B in the small pool, > 1 MiB in the large one (`should_split`);
- a freed block merges with free neighbours in its segment (`free_block`, `try_merge_blocks`);
- a new segment that would pass the capacity first releases every cached segment with no block in use
  (`release_cached_blocks`, `release_blocks`) and retries; past that PyTorch raises OOM (the replay goes
  on, and the peak says by how much it does not fit).

`expandable_segments:True` (Note [Expandable Segments]): one segment per pool (and stream) whose
physical pages are mapped as needed, 2 MiB pages for the small pool and 20 MiB (`kLargeBuffer`) for the
large (`find_expandable_block`); a request no free mapped block fits takes the lowest address where
free and unmapped space together fit it and maps the missing pages (`try_allocate_expandable_block`);
every split leaves >= 512 B (`should_split`); on a retry the fully free pages are unmapped
(`unmap_block`). So freed space at the segment's end is reused by requests of any size, and what is
wasted is inside pages.

Streams: a block belongs to the stream it was allocated on (`Block::stream`); `get_free_block` looks
for a cached block of the request's stream only (`BlockComparatorSize` orders by stream first, and a
found block of another stream is no fit), a segment is allocated for one stream, and an expandable
segment serves one stream (`get_expandable_segment`/`find_expandable_block` match `segment->stream()`).
So the pools below are per stream: a buffer a stack allocates on a side stream (FSDP2's all-gather
output on its copy-in stream, `foreach_all_gather` in torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py) is cached there and never serves the compute stream's activations, nor the
reverse. `release_cached_blocks` frees the wholly free segments of every stream. The best fit of an
expandable segment ignores the room a block could map at its end (`expandable_size`): a tie-break
among free blocks.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from simexec.sim.alloc_trace import AllocationTrace

MiB = 1 << 20
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize
SMALL_BUFFER = 2 * MiB  # kSmallBuffer
LARGE_BUFFER = 20 * MiB  # kLargeBuffer
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge
ADDRESS_SPACE = 1 << 50  # an expandable segment's reserved virtual range: more than any device


def round_size(size: int) -> int:
    """`round_size`: at least 512 B, a multiple of 512 B."""
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """`get_allocation_size`: the segment a request with no cached fit takes."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = ("addr", "size", "allocated", "mapped", "prev", "next", "pool")

    def __init__(self, addr: int, size: int, pool: "_Pool", mapped: bool = True):
        self.addr, self.size, self.pool, self.mapped = addr, size, pool, mapped
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Pool:
    """A pool's cached free blocks, sorted by (size, address) as `BlockComparatorSize`."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.segment: _Block | None = None  # expandable: the segment's first block

    def insert(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = (b.size, b.addr)
        i = bisect.bisect_left(self.keys, key)
        del self.keys[i]
        del self.blocks[key]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        return self.blocks[self.keys[i]] if i < len(self.keys) else None


@dataclass
class ReplayResult:
    """The replay's reserved and allocated bytes: peaks, and the event of the reserved peak."""

    reserved_peak: int
    allocated_peak: int  # the rounded blocks in use (max_memory_allocated)
    peak_event: int  # index into the trace's events (-1: nothing allocated)
    allocated_at_peak: int
    out_of_memory: bool  # a segment passed the capacity even after releasing the cache


class CachingAllocator:
    """The allocator's state; `malloc` / `free` as its DeviceCachingAllocator does them (module docstring)."""

    def __init__(self, capacity: float, expandable_segments: bool = False):
        self.capacity = capacity
        self.expandable = expandable_segments
        self.pools: dict[tuple[str, bool], _Pool] = {}  # (stream, small): each stream's small and large pool
        self.reserved = self.allocated = 0
        self.next_address = 0
        self.out_of_memory = False

    # --- malloc -------------------------------------------------------------------------------------
    def pool(self, stream: str, small: bool) -> _Pool:
        key = (stream, small)
        if key not in self.pools:
            self.pools[key] = _Pool(small)
        return self.pools[key]

    def malloc(self, nbytes: int, stream: str = "compute") -> _Block:
        size = round_size(nbytes)
        pool = self.pool(stream, size <= SMALL_SIZE)
        block = pool.best_fit(size)
        if block is not None:
            pool.remove(block)
        else:
            block = self._new_memory(pool, size)
        rest = block.size - size
        if rest >= MIN_BLOCK if (pool.small or self.expandable) else rest > SMALL_SIZE:
            tail = _Block(block.addr + size, rest, pool)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            pool.insert(tail)
        block.allocated = True
        self.allocated += block.size
        return block

    def _new_memory(self, pool: _Pool, size: int) -> _Block:
        """`alloc_block`, then `release_cached_blocks` and again when the capacity is passed."""
        need = allocation_size(size) if not self.expandable else self._pages_to_map(pool, size)
        if self.reserved + need > self.capacity:
            self.release_cached_blocks()
            if self.expandable:
                need = self._pages_to_map(pool, size)
            if self.reserved + need > self.capacity:
                self.out_of_memory = True
        if self.expandable:
            return self._expand(pool, size)
        block = _Block(self.next_address, allocation_size(size), pool)
        self.next_address += block.size
        self.reserved += block.size
        return block

    # --- expandable segments ------------------------------------------------------------------------
    def _page(self, pool: _Pool) -> int:
        return SMALL_BUFFER if pool.small else LARGE_BUFFER

    def _segment(self, pool: _Pool) -> _Block:
        if pool.segment is None:
            pool.segment = _Block(self.next_address, ADDRESS_SPACE, pool, mapped=False)
            self.next_address += ADDRESS_SPACE
        return pool.segment

    def _expandable_start(self, pool: _Pool, size: int) -> _Block:
        """`find_expandable_block`: the lowest-addressed unmapped block (or the free one before it)
        from which free and unmapped blocks add up to `size`."""
        b = self._segment(pool)
        while b is not None:
            if not b.mapped:
                c = b.prev if b.prev is not None and not b.prev.allocated else b
                room, d = 0, c
                while d is not None and not d.allocated and room < size:
                    room, d = room + d.size, d.next
                if room >= size:
                    return c
            b = b.next
        raise AssertionError("an expandable segment's address space ends in an unmapped block")

    def _pages_to_map(self, pool: _Pool, size: int) -> int:
        c, page, need, left = self._expandable_start(pool, size), self._page(pool), 0, size
        while left > 0:
            take = min(left, c.size)
            if not c.mapped:
                need += page * ((take + page - 1) // page)
            left -= take
            c = c.next
        return need

    def _expand(self, pool: _Pool, size: int) -> _Block:
        """`try_allocate_expandable_block`: map pages until the candidate block holds `size`."""
        c = self._expandable_start(pool, size)
        if not c.mapped:
            c = self._map(c, min(c.size, size))
        while c.size < size:
            c = self._map(c.next, min(size - c.size, c.next.size))
        pool.remove(c)
        return c

    def _map(self, b: _Block, size: int) -> _Block:
        """`map_block`: back the first `size` bytes of unmapped `b` (in whole pages), merge with free neighbours."""
        page = self._page(b.pool)
        mapped = min(b.size, page * ((size + page - 1) // page))
        if mapped < b.size:
            rest = _Block(b.addr + mapped, b.size - mapped, b.pool, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, mapped
        b.mapped = True
        self.reserved += mapped
        b = self._merge_free(b)
        b.pool.insert(b)
        return b

    def _unmap(self, b: _Block) -> None:
        """`unmap_block`: release the whole pages inside free block `b`."""
        page = self._page(b.pool)
        start = page * ((b.addr + page - 1) // page)
        end = page * ((b.addr + b.size) // page)
        if start >= end:
            return
        b.pool.remove(b)
        if start > b.addr:
            before = _Block(b.addr, start - b.addr, b.pool)
            before.prev, before.next = b.prev, b
            if b.prev is not None:
                b.prev.next = before
            elif b.pool.segment is b:
                b.pool.segment = before
            b.prev = before
            b.pool.insert(before)
        if b.addr + b.size > end:
            after = _Block(end, b.addr + b.size - end, b.pool)
            after.prev, after.next = b, b.next
            if b.next is not None:
                b.next.prev = after
            b.next = after
            b.pool.insert(after)
        b.addr, b.size, b.mapped = start, end - start, False
        self.reserved -= b.size
        self._merge_unmapped(b)

    # --- free ---------------------------------------------------------------------------------------
    def free(self, block: _Block) -> None:
        """`free_block`: back to the pool, merged with free neighbours of its segment."""
        block.allocated = False
        self.allocated -= block.size
        block = self._merge_free(block)
        block.pool.insert(block)

    def _merge_free(self, b: _Block) -> _Block:
        for other in (b.prev, b.next):
            if other is not None and not other.allocated and other.mapped and b.mapped:
                b.pool.remove(other)
                self._absorb(b, other)
        return b

    def _merge_unmapped(self, b: _Block) -> None:
        for other in (b.prev, b.next):
            if other is not None and not other.mapped:
                self._absorb(b, other)

    def _absorb(self, b: _Block, other: _Block) -> None:
        if other is b.prev:
            b.addr, b.prev = other.addr, other.prev
            if b.prev is not None:
                b.prev.next = b
            elif b.pool.segment is other:
                b.pool.segment = b
        else:
            b.next = other.next
            if b.next is not None:
                b.next.prev = b
        b.size += other.size

    def release_cached_blocks(self) -> None:
        """`release_cached_blocks`: free every cached segment with nothing in use (expandable: unmap free pages)."""
        for pool in list(self.pools.values()):
            for b in list(pool.blocks.values()):
                if self.expandable:
                    self._unmap(b)
                elif b.prev is None and b.next is None:
                    pool.remove(b)
                    self.reserved -= b.size


def replay(trace: AllocationTrace, capacity: float, expandable_segments: bool = False) -> ReplayResult:
    """Run `trace` through a fresh allocator; the peaks of its reserved and allocated bytes."""
    alloc = CachingAllocator(capacity, expandable_segments)
    handles: dict[int, _Block] = {}
    best = best_alloc = 0
    best_event, at_best = -1, 0
    for event, op in trace.ops:
        if op >= 0:
            handles[op] = alloc.malloc(trace.blocks[op].size, trace.blocks[op].stream)
        else:
            alloc.free(handles.pop(-op - 1))
        if alloc.reserved > best:
            best, best_event, at_best = alloc.reserved, event, alloc.allocated
        best_alloc = max(best_alloc, alloc.allocated)
    return ReplayResult(best, best_alloc, best_event, at_best, alloc.out_of_memory)
