"""The event engine on hand-built programs: order, deps, overlap slowdown, deadlocks."""
import pytest

from simexec.specs.cluster import get_cluster
from simexec.program.instructions import Instr, Program, ProgramError
from simexec.sim.compute import ComputeModel
from simexec.sim.engine import Engine
from simexec.sim.machine import Machine

A100 = get_cluster("dgx-a100-80g")
NVL = A100.node.intra_bw * A100.costs.intra_bw_eff
# an NCCL kernel holds one SM per channel: compute beside it runs on the rest
SLOW = A100.device.sms / (A100.device.sms - A100.costs.nccl_channels)


def gemm(rank, name, flops=1e13, **kw):
    return Instr(rank=rank, name=name, kind="compute", stream="compute", op="gemm", flops=flops, bytes=0.0, **kw)


def engine(ranks, cluster=A100):
    prog = Program(meta={}, ranks=ranks)
    eng = Engine(prog, Machine(cluster, prog))
    eng.run()
    return eng, {i.id: (eng.start[k], eng.end[k]) for k, i in enumerate(eng.instrs)}


def t_gemm(flops=1e13):
    return ComputeModel(A100, "bf16").time("gemm", flops, 0.0)


def test_stream_runs_in_order_back_to_back():
    """Instructions of one stream run one after another with no gaps."""
    _, times = engine({0: [gemm(0, "a"), gemm(0, "b", 2e13), gemm(0, "c")]})
    assert times["0:a"] == (0.0, pytest.approx(t_gemm()))
    assert times["0:b"][0] == times["0:a"][1]
    assert times["0:c"] == (pytest.approx(t_gemm() + t_gemm(2e13)), pytest.approx(2 * t_gemm() + t_gemm(2e13)))


def test_deps_across_streams():
    """A compute waiting on a collective starts when the collective ends."""
    def ar(r):
        return Instr(rank=r, name="ar", kind="collective", stream="comm.tp", op="allreduce@tp", bytes=1e9,
                     group=(0, 1), axis="tp", deps=("a",))

    ranks = {r: [gemm(r, "a"), ar(r), gemm(r, "b", deps=("ar",))] for r in (0, 1)}
    _, times = engine(ranks)
    assert times["0:ar"][0] == times["0:a"][1]
    assert times["0:b"][0] == times["0:ar"][1]


def test_memory_instructions_take_no_time():
    """alloc/free sit at the end of their stream predecessor."""
    mem = Instr(rank=0, name="m", kind="memory", stream="compute", op="alloc", bytes=1e9, category="activations")
    _, times = engine({0: [gemm(0, "a"), mem, gemm(0, "b")]})
    assert times["0:m"] == (times["0:a"][1], times["0:a"][1])
    assert times["0:b"][0] == times["0:a"][1]


def test_compute_slows_while_a_transfer_overlaps_it():
    """Compute overlapped by an NCCL collective of its rank runs SMs / (SMs - channels) times slower
    (108 / 92 on an A100), only for the overlapped part: the chain is re-rated when the transfer starts and ends."""
    S = 2e9  # long enough to start and end inside the compute
    ranks = {}
    for r in (0, 1):
        ranks[r] = [
            gemm(r, "a", 2e12),
            Instr(rank=r, name="ar", kind="collective", stream="comm.dp", op="allreduce@dp", bytes=S,
                  group=(0, 1), axis="dp", deps=("a",)),
            gemm(r, "b", 1e15),
        ]
    _, times = engine(ranks)
    a_end = times["0:a"][1]
    ar_start, ar_end = times["0:ar"]
    overlap = ar_end - ar_start
    work_b = t_gemm(1e15)
    # during the transfer b advances at 1/SLOW; afterwards at full speed
    expected_end = ar_end + (work_b - overlap / SLOW)
    assert ar_start == a_end
    assert times["0:b"][1] == pytest.approx(expected_end, rel=1e-12)


def overlapped(transfer_of, cluster=A100):
    """A long GEMM on rank 0 with `transfer_of(rank)` of both ranks running under it from its start:
    the GEMM's end, the transfer's span and the GEMM's idle time."""
    ranks = {r: [transfer_of(r), gemm(r, "b", 1e15)] for r in (0, 1)}
    _, times = engine(ranks, cluster)
    return times["0:b"][1], times["0:x"], ComputeModel(cluster, "bf16").time("gemm", 1e15, 0.0)


def test_nccl_allgather_takes_its_channels_sms():
    """An NCCL all-gather under a GEMM slows it by SMs / (SMs - channels) while in flight."""
    def ag(r):
        return Instr(rank=r, name="x", kind="collective", stream="comm.dp", op="allgather@dp", bytes=2e9,
                     group=(0, 1), axis="dp")

    end, (s, e), work = overlapped(ag)
    assert SLOW == pytest.approx(108 / 92)
    assert end == pytest.approx(e + work - (e - s) * (92 / 108), rel=1e-12)


def test_host_copy_leaves_compute_alone():
    """A host copy runs on a copy engine: the GEMM beside it keeps every SM."""
    def d2h(r):
        return Instr(rank=r, name="x", kind="copy", stream="copy.d2h", op="d2h", bytes=2e9)

    end, (s, e), work = overlapped(d2h)
    assert e > s
    assert end == pytest.approx(work, rel=1e-12)


def test_concurrent_transfers_add_their_sms():
    """Two NCCL collectives in flight at once hold twice the channels."""
    ranks = {}
    for r in (0, 1):
        ranks[r] = [Instr(rank=r, name=f"x{a}", kind="collective", stream=f"comm.{a}", op=f"allreduce@{a}",
                          bytes=2e9, group=(0, 1), axis=a) for a in ("dp", "tp")] + [gemm(r, "b", 1e15)]
    _, times = engine(ranks)
    (s, e), work = times["0:xdp"], t_gemm(1e15)
    assert times["0:xtp"] == (s, e)
    assert times["0:b"][1] == pytest.approx(e + work - (e - s) * (108 - 32) / 108, rel=1e-12)


def test_uniform_overlap_slowdown_for_every_transfer():
    """A cluster with a uniform `overlap_slowdown` (CPU ranks, old cluster files) slows compute by it
    under any transfer, copies included, as before per-kind charging."""
    cluster = A100.model_copy(update={"costs": A100.costs.model_copy(update={"overlap_slowdown": 1.3})})

    def d2h(r):
        return Instr(rank=r, name="x", kind="copy", stream="copy.d2h", op="d2h", bytes=2e9)

    end, (s, e), work = overlapped(d2h, cluster)
    assert end == pytest.approx(e + work - (e - s) / 1.3, rel=1e-12)


def test_userbuffers_gather_on_copy_engines_reduce_scatter_on_sms():
    """tp_async (Transformer Engine's userbuffers): the ring-exchange all-gather holds no SM, the
    pipelined reduce-scatter `userbuffers_sms`, DeepEP's hops `deepep_sms`, other collectives NCCL's
    channels, a send NCCL's channels per peer."""
    from simexec.sim.overlap import OverlapShares

    shares = OverlapShares(A100, tp_async=True)
    c = A100.costs

    def coll(verb, axis, block=""):
        return Instr(rank=0, name="x", kind="collective", stream=f"comm.{axis}", op=f"{verb}@{axis}",
                     axis=axis, block=block, group=(0, 1))

    assert shares.held(coll("allgather", "tp", "fc1")) == 0
    assert shares.held(coll("allgather", "tp", "attn_regather")) == c.userbuffers_sms
    assert shares.held(coll("reducescatter", "tp", "fc2")) == c.userbuffers_sms
    assert shares.held(coll("allreduce", "tp", "norm_grads")) == c.nccl_channels
    assert shares.held(coll("alltoall", "ep_net")) == c.deepep_sms
    send = Instr(rank=0, name="s", kind="send", stream="p2p.send", op="send", peer=1)
    assert shares.held(send) == c.nccl_p2p_channels
    assert OverlapShares(A100).held(coll("allgather", "tp", "fc1")) == c.nccl_channels
    assert shares.rate(0) == 1.0 and shares.rate(10_000) == pytest.approx(1 / 108)


def test_gpu_cluster_needs_sms_or_a_uniform_slowdown():
    from simexec.specs.cluster import ClusterSpec

    bad = A100.model_dump()
    bad["device"]["sms"] = None
    with pytest.raises(ValueError, match="overlap_slowdown is unset and device.sms"):
        ClusterSpec.model_validate(bad)
    bad["costs"]["overlap_slowdown"] = 1.05
    assert ClusterSpec.model_validate(bad).costs.overlap_slowdown == 1.05


def test_deadlock_names_the_stuck_instructions():
    """A collective whose peer never issues it leaves the program stuck; the error says where."""
    a = Instr(rank=0, name="x", kind="collective", stream="comm.tp", op="allreduce@tp", bytes=1.0,
              group=(0, 1), axis="tp")
    b = Instr(rank=1, name="y", kind="collective", stream="comm.tp", op="allreduce@tp", bytes=1.0,
              group=(0, 1), axis="tp")
    with pytest.raises(ProgramError, match="deadlocks: 0:x on comm.tp"):
        engine({0: [a], 1: [b]})


def test_unknown_dep_is_an_error():
    with pytest.raises(ProgramError, match="waits on nope"):
        engine({0: [gemm(0, "a", deps=("nope",))]})


def test_waiting_on_a_memory_instruction_waits_on_its_predecessor():
    """A memory marker ends with the instruction before it, so waiting on it waits on that one."""
    mem = Instr(rank=0, name="m", kind="memory", stream="compute", op="free", bytes=1e9, category="buffers")
    ar = Instr(rank=0, name="ar", kind="collective", stream="comm.dp", op="allreduce@dp", bytes=1e6,
               group=(0, 1), axis="dp", deps=("m",))
    peer = Instr(rank=1, name="ar", kind="collective", stream="comm.dp", op="allreduce@dp", bytes=1e6,
                 group=(0, 1), axis="dp")
    _, times = engine({0: [gemm(0, "a"), mem, ar], 1: [peer]})
    assert times["0:ar"][0] == times["0:a"][1] == times["0:m"][0]


def _threads(n: int):
    return A100.model_copy(update={"costs": A100.costs.model_copy(update={"collective_threads": n})})


def _dp_collectives(r, deps_of=None):
    def ar(name, nbytes=1e8, deps=()):
        return Instr(rank=r, name=name, kind="collective", stream="comm.dp", op="allreduce@dp", bytes=nbytes,
                     group=(0, 1), axis="dp", deps=deps)

    free = Instr(rank=r, name="free", kind="memory", stream="comm.dp", op="free", bytes=1e8, category="buffers",
                 deps=("a",))
    return [ar("a"), free, ar("b", 1e6), ar("c", deps=(deps_of or {}).get("c", ())), gemm(r, "g", deps=("c",))]


def test_one_collective_at_a_time_per_stream_by_default():
    """NCCL runs a communicator's collectives one after another: each starts when the one before ends."""
    _, times = engine({r: _dp_collectives(r) for r in (0, 1)})
    assert times["0:b"][0] == times["0:a"][1]
    assert times["0:c"][0] == times["0:b"][1]


def test_a_concurrent_stream_keeps_collective_threads_in_flight():
    """With two collective threads (gloo) a collective starts beside the one before it, the next
    when one of the two has ended; a memory marker that waits on a collective still waits for it."""
    _, times = engine({r: _dp_collectives(r) for r in (0, 1)}, cluster=_threads(2))
    assert times["0:b"][0] == times["0:a"][0] == 0.0
    assert times["0:b"][1] < times["0:a"][1]  # the small one, started second, ends first
    assert times["0:c"][0] == pytest.approx(times["0:b"][1])  # a slot frees when b ends
    assert times["0:free"][0] == times["0:a"][1]
    assert times["0:g"][0] == times["0:c"][1]
    serial, _ = engine({r: _dp_collectives(r) for r in (0, 1)})
    assert max(times["0:g"]) < max(serial.end)


def test_a_collective_that_waits_on_one_in_flight_starts_when_it_ends():
    """A collective that consumes another's result (sp's reduce-scatter, then all-gather) waits for it
    on a concurrent stream too."""
    _, times = engine({r: _dp_collectives(r, {"c": ("a",)}) for r in (0, 1)}, cluster=_threads(2))
    assert times["0:c"][0] == times["0:a"][1]


def test_clipping_holds_every_pipeline_stage_until_the_last_backward_ends():
    """Without clipping the last stage steps as soon as its own backward is done; with it, its step
    waits for the norm, which needs the first stage's last backward (1F1B ends there)."""
    from simexec.sim.simulate import simulate

    def timeline(plan):
        res = simulate("gpt-tiny", "dgx-a100-80g", plan, trace=True)
        events = res.trace.events
        last_bwd = max(e.end_us for e in events if e.rank == 0 and e.phase == "bwd" and e.kind == "compute")
        step = next(e for e in events if e.rank != 0 and e.name == "optim.optim.L-1.m-1")
        return res.step_time_s, last_bwd, step.start_us

    base = "dp=4,pp=2,gbs=32,dtype=bf16"
    t_free, last_free, step_free = timeline(base)
    t_clip, last_clip, step_clip = timeline(base + ",clip_grad=1")
    assert step_free < last_free  # the last stage does not wait for stage 0
    assert step_clip > last_clip
    assert t_clip > t_free


def test_nccl_channels_follow_the_groups_ranks_per_node():
    """Inside a node a collective holds `nccl_channels`; across nodes two per NIC its ranks on a node
    use (DGX H100: a NIC per GPU): one rank per node 2, two 4, eight 16."""
    from simexec.sim.overlap import OverlapShares

    shares = OverlapShares(get_cluster("4xdgx-h100"))
    assert shares.channels(tuple(range(8))) == 16
    assert shares.channels((0, 8, 16, 24)) == 2
    assert shares.channels((0, 1, 8, 9)) == 4
    assert shares.channels(tuple(range(32))) == 16
    assert shares.fewest_channels() == 2
    assert shares.nccl_slowdown((0, 8)) == pytest.approx(132 / 130)
