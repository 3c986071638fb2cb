"""The caching allocator's replay and the offline planner on traces whose peaks are known by hand."""
from simexec.sim.alloc_trace import build_trace
from simexec.sim.allocator import CachingAllocator, allocation_size, replay, round_size
from simexec.sim.memory_plan import plan_offsets

MiB = 1 << 20
CAP = 80 * 1024 * MiB


def _events(ops):
    """ops: ("+", tag, bytes) / ("-", tag, bytes) in order -> (time, order, category, ±bytes, tag)."""
    return [(float(k), k, "activations", b if op == "+" else -b, tag) for k, (op, tag, b) in enumerate(ops)]


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert allocation_size(1024) == 2 * MiB
    assert allocation_size(5 * MiB) == 20 * MiB
    assert allocation_size(30 * MiB + 1) == 32 * MiB


def test_small_allocation_takes_a_2mib_segment():
    trace = build_trace(_events([("+", "a", 1024)]))
    r = replay(trace, CAP)
    assert r.reserved_peak == 2 * MiB and r.allocated_peak == 1024


def test_fragmentation_without_expandable_segments():
    # 30 MiB, 5 MiB, 30 MiB, 5 MiB live; free the 30s; then a 60 MiB request.
    ops = [("+", "a", 30 * MiB), ("+", "b", 5 * MiB), ("+", "c", 30 * MiB), ("+", "d", 5 * MiB),
           ("-", "a", 30 * MiB), ("-", "c", 30 * MiB), ("+", "e", 60 * MiB)]
    trace = build_trace(_events(ops))
    # by hand: two 30 MiB segments, one 20 MiB segment shared by the 5 MiB blocks (split: 15 MiB > 1 MiB
    # left), then the 60 MiB request fits no cached block: a new 60 MiB segment: 30 + 20 + 30 + 60
    assert replay(trace, CAP).reserved_peak == 140 * MiB
    # expandable: 20 MiB pages of one segment: a@0-30, b@30-35, c@35-65, d@65-70 (pages to 80 MiB);
    # freeing a leaves a hole of 30 MiB, c of 30 MiB: e (60 MiB) goes after d at 70 MiB: pages to 140 MiB
    assert replay(trace, CAP, expandable_segments=True).reserved_peak == 140 * MiB
    # and reused space at the end: free d too, and e fits from 35 MiB (c's hole + d's + unmapped)
    ops2 = ops[:-1] + [("-", "d", 5 * MiB), ("+", "e", 60 * MiB)]
    t2 = build_trace(_events(ops2))
    assert replay(t2, CAP).reserved_peak == 140 * MiB  # no segment is merged across: a new 60 MiB one
    assert replay(t2, CAP, expandable_segments=True).reserved_peak == 100 * MiB  # 35 + 60 -> 5 pages


def test_interleaved_growth_fragments_and_expandable_does_not():
    # layers saving 30 MiB and 5 MiB alternately, all freed, then a 70 MiB request: the cached segments
    # (30 MiB each, the 5 MiB ones in 20 MiB segments) cannot serve it; one expandable segment can
    ops = []
    for i in range(4):
        ops += [("+", f"big{i}", 30 * MiB), ("+", f"small{i}", 5 * MiB)]
    for i in range(4):
        ops += [("-", f"big{i}", 30 * MiB), ("-", f"small{i}", 5 * MiB)]
    ops.append(("+", "wide", 70 * MiB))
    trace = build_trace(_events(ops))
    # cudaMalloc: 4 x 30 + one 20 MiB segment holds all four 5 MiB blocks = 140; then 70 more = 210
    assert replay(trace, CAP).reserved_peak == 210 * MiB
    # expandable: 4 x 35 = 140 MiB mapped (7 pages); all free and merged: 70 MiB reuses them
    assert replay(trace, CAP, expandable_segments=True).reserved_peak == 140 * MiB


def test_release_cached_blocks_when_the_capacity_is_reached():
    ops = [("+", "a", 40 * MiB), ("-", "a", 40 * MiB), ("+", "b", 50 * MiB)]
    trace = build_trace(_events(ops))
    assert replay(trace, CAP).reserved_peak == 90 * MiB  # the 40 MiB segment stays cached
    r = replay(trace, 60 * MiB)  # would pass 60 MiB: the cached segment is released first
    assert r.reserved_peak == 50 * MiB and not r.out_of_memory


def test_free_merges_neighbours():
    a = CachingAllocator(CAP)
    x, y = a.malloc(3 * MiB), a.malloc(3 * MiB)  # both in one 20 MiB segment
    assert a.reserved == 20 * MiB
    a.free(x)
    a.free(y)
    z = a.malloc(19 * MiB)  # needs the merged free block
    # merged back to the 20 MiB segment; the 1 MiB left is not split off (large pool: > 1 MiB)
    assert a.reserved == 20 * MiB and z.size == 20 * MiB


def test_partial_and_multi_frees_become_pieces():
    # one allocation freed in three parts by other tags; one free releasing two allocations
    ops = [("+", "act.L3.m0", 30 * MiB), ("-", "act.L3.m0.fc2", 10 * MiB), ("-", "act.L3.m0.attn", 15 * MiB),
           ("+", "grads.shard.L1", 4 * MiB), ("+", "grads.shard.L2", 4 * MiB), ("-", "grads.shards", 8 * MiB)]
    trace = build_trace(_events(ops))
    sizes = sorted(b.size for b in trace.blocks)
    assert sizes == [4 * MiB, 4 * MiB, 5 * MiB, 10 * MiB, 15 * MiB]
    assert [b.free_at for b in trace.blocks if b.size == 5 * MiB] == [None]  # never freed
    assert trace.unmatched_free_bytes == 0


def test_planner_between_live_bytes_and_reserved():
    ops = []
    for i in range(6):
        ops += [("+", f"x{i}", (i + 1) * 3 * MiB), ("+", f"t{i}", 700 * 1024)]
        if i >= 2:
            ops += [("-", f"x{i - 2}", (i - 1) * 3 * MiB), ("-", f"t{i - 2}", 700 * 1024)]
    trace = build_trace(_events(ops))
    plan = plan_offsets(trace)
    live = trace.max_live_bytes()
    assert live <= plan.arena_bytes <= replay(trace, CAP).reserved_peak
    # no two blocks live at once overlap in the plan
    blocks = trace.blocks
    for a in blocks:
        for b in blocks:
            if a.block < b.block:
                fa = a.free_at if a.free_at is not None else 10**9
                fb = b.free_at if b.free_at is not None else 10**9
                if a.alloc_at < fb and b.alloc_at < fa:
                    oa, ob = plan.offsets[a.block], plan.offsets[b.block]
                    assert oa + round_size(a.size) <= ob or ob + round_size(b.size) <= oa


def test_simulate_on_dgx_h100_reserved_at_least_allocated():
    from simexec.sim.simulate import simulate

    r = simulate("llama3-8b", "dgx-h100", "dp=8,zero=1,mbs=1,gbs=16", memory_plan=True)
    assert r.memory_model == "caching-allocator"
    for rank, reserved in r.peak_memory_bytes_per_rank.items():
        assert reserved >= r.peak_tensor_bytes_per_rank[rank]
        assert r.planned_peak_bytes_per_rank[rank] <= reserved
    out = r.to_json()
    assert "planned_peak_bytes_per_rank" in out and out["memory_model"] == "caching-allocator"
    assert "offline memory plan" in r.format()


def test_the_offline_plan_is_made_on_request_only():
    from simexec.sim.simulate import simulate

    r = simulate("llama3-8b", "dgx-h100", "dp=8,zero=1,mbs=1,gbs=16")
    assert r.planned_peak_bytes == 0 and "offline memory plan" not in r.format()


def _stream_events(ops):
    """ops: ("+", tag, bytes, stream) / ("-", tag, bytes) in order -> events with the allocation's stream."""
    return [(float(k), k, "buffers", o[2] if o[0] == "+" else -o[2], o[1], *(o[3:] if o[0] == "+" else ()))
            for k, o in enumerate(ops)]


def test_a_freed_block_serves_only_its_own_stream():
    # 30 MiB on the all-gather's stream, freed; 30 MiB on the compute stream: PyTorch's get_free_block
    # skips the cached block of the other stream, so a second 30 MiB segment; the same stream reuses it
    ops = [("+", "gathered", 30 * MiB, "comm.dp"), ("-", "gathered", 30 * MiB), ("+", "act", 30 * MiB, "compute")]
    trace = build_trace(_stream_events(ops))
    assert [b.stream for b in trace.blocks] == ["comm.dp", "compute"]
    assert replay(trace, CAP).reserved_peak == 60 * MiB
    same = [("+", "gathered", 30 * MiB, "comm.dp"), ("-", "gathered", 30 * MiB), ("+", "next", 30 * MiB, "comm.dp")]
    assert replay(build_trace(_stream_events(same)), CAP).reserved_peak == 30 * MiB
    # expandable segments: one segment per stream, 2 pages of 20 MiB each
    assert replay(trace, CAP, expandable_segments=True).reserved_peak == 80 * MiB
    assert replay(build_trace(_stream_events(same)), CAP, expandable_segments=True).reserved_peak == 40 * MiB
    # events without a stream are the compute stream's
    assert build_trace(_events([("+", "a", 1024)])).blocks[0].stream == "compute"


def test_release_cached_blocks_frees_every_streams_segments():
    alloc = CachingAllocator(100 * MiB)
    alloc.free(alloc.malloc(60 * MiB, "comm.dp"))
    alloc.malloc(60 * MiB, "compute")  # 120 > 100: the comm stream's free segment is released first
    assert alloc.reserved == 60 * MiB and not alloc.out_of_memory


def test_allocation_markers_name_the_stream_that_allocates():
    """ZeRO-3's gathered parameters are allocated on the gather's side stream (FSDP2's copy-in
    stream); the sequence-parallel backward's re-gather buffer on the compute stream, which issues it."""
    from simexec.program.lower import lower
    from simexec.specs.cluster import get_cluster
    from simexec.specs.model import get_model
    from simexec.specs.plan import parse_plan, resolve

    def allocs(plan):
        rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(plan))
        return [i for i in lower(rp).ranks[0] if i.kind == "memory" and i.op == "alloc"]

    gathers = [i for i in allocs("dp=2,zero=3,gbs=2") if ".gather." in i.name]
    assert gathers and all(i.stream == "comm.dp" for i in gathers)
    regathers = [i for i in allocs("tp=2,sp=1,gbs=1") if "_regather" in i.name]
    assert regathers and all(i.stream == "compute" for i in regathers)
