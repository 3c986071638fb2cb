"""Collective costs and link sharing on hand-built programs (no lowering)."""
import pytest

from simexec.specs.cluster import get_cluster
from simexec.program.instructions import Instr, Program
from simexec.sim.engine import Engine
from simexec.sim.machine import Machine



def alpha_beta(cluster):
    """The cluster priced by plain alpha-beta candidates (no NCCL tuning model), so that link-sharing
    expectations are closed forms; NCCL's choices are tested in tests/test_nccl_model.py."""
    return cluster.model_copy(update={"device": cluster.device.model_copy(update={"nccl_arch": None})})


NCCL_A100 = get_cluster("dgx-a100-80g")
A100 = alpha_beta(NCCL_A100)
NVL = A100.node.intra_bw * A100.costs.intra_bw_eff
ALPHA = A100.node.intra_latency_s
CALL = A100.costs.collective_latency_s


def coll(rank, name, verb, group, nbytes, stream="comm.tp", **kw):
    axis = stream.split(".", 1)[1]
    return Instr(rank=rank, name=name, kind="collective", stream=stream, op=f"{verb}@{axis}", bytes=float(nbytes),
                 group=tuple(group), axis=axis, **kw)


def run(ranks, cluster=A100, represents=None):
    prog = Program(meta={}, ranks=ranks, represents=represents or {})
    eng = Engine(prog, Machine(cluster, prog))
    step = eng.run()
    return step, {i.id: (eng.start[k], eng.end[k]) for k, i in enumerate(eng.instrs)}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_lone_ring_allreduce_matches_alpha_beta(n):
    """A lone all-reduce inside a node costs 2(n-1)/n * S/B + 2(n-1) alpha (+ the call latency)."""
    S = 512e6
    g = range(n)
    step, _ = run({r: [coll(r, "ar", "allreduce", g, S)] for r in g})
    assert step == pytest.approx(2 * (n - 1) / n * S / NVL + 2 * (n - 1) * ALPHA + CALL, rel=1e-12)


# nccl-tests all_reduce_perf, 8x A100-SXM4-80GB on NVSwitch, in-place bus bandwidth (GB/s) by message
# size (Azure AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md, NCCL 2.18.5).
NCCL_TESTS_A100_BUSBW = {16_777_216: 109.22, 33_554_432: 132.77, 67_108_864: 166.63, 1 << 30: 228.10,
                         1 << 33: 231.58}


@pytest.mark.parametrize("nbytes", sorted(NCCL_TESTS_A100_BUSBW))
def test_nvlink_allreduce_is_no_slower_than_nccl_tests(nbytes):
    """A tensor-parallel all-reduce on one DGX A100 (Megatron's 18.4B: 25 MB per layer and micro-batch)
    costs at most what nccl-tests measures, and its bus bandwidth reaches the measured plateau
    within 3%: tp's exposed all-reduces are not overpriced."""
    n = 8
    step, _ = run({r: [coll(r, "ar", "allreduce", range(n), nbytes)] for r in range(n)}, NCCL_A100)
    busbw = 2 * (n - 1) / n * nbytes / step / 1e9
    assert busbw >= NCCL_TESTS_A100_BUSBW[nbytes] * 0.97
    if nbytes >= 1 << 30:
        assert busbw == pytest.approx(NCCL_TESTS_A100_BUSBW[nbytes], rel=0.03)


@pytest.mark.parametrize("verb", ["allgather", "reducescatter"])
def test_lone_ring_allgather_and_reducescatter(verb):
    """All-gather / reduce-scatter move (n-1)/n of the full tensor in n-1 steps."""
    S, n = 256e6, 8
    step, _ = run({r: [coll(r, "x", verb, range(n), S)] for r in range(n)})
    assert step == pytest.approx((n - 1) / n * S / NVL + (n - 1) * ALPHA + CALL, rel=1e-12)


def test_two_flows_on_one_link_each_take_twice_as_long():
    """Two all-reduces over the same two GPUs at once share the NVLink ports: each one's transfer doubles."""
    S = 1e9
    g = (0, 1)
    lone, _ = run({r: [coll(r, "a", "allreduce", g, S)] for r in g})
    both, times = run({r: [coll(r, "a", "allreduce", g, S), coll(r, "b", "allreduce", g, S, stream="comm.dp")]
                       for r in g})
    fixed = 2 * ALPHA + CALL
    assert lone - fixed == pytest.approx(S / NVL, rel=1e-12)
    assert both - fixed == pytest.approx(2 * (lone - fixed), rel=1e-12)
    assert times["0:a"] == pytest.approx(times["0:b"], rel=1e-12)


def test_flow_speeds_up_when_the_other_ends():
    """A short flow and a long flow share a link; once the short one ends the long one gets it all."""
    g = (0, 1)
    small, big = 0.25e9, 1e9
    _, times = run({r: [coll(r, "a", "allreduce", g, small), coll(r, "b", "allreduce", g, big, stream="comm.dp")]
                    for r in g})
    fixed = 2 * ALPHA + CALL
    # the small one runs at half rate; the big one moved `small` bytes by then and the rest at full rate
    assert times["0:a"][1] == pytest.approx(2 * small / NVL + fixed, rel=1e-9)
    assert times["0:b"][1] == pytest.approx((2 * small + (big - small)) / NVL + fixed, rel=1e-9)


def test_collective_waits_for_every_present_member():
    """A collective starts only when its last member issues it."""
    comp = Instr(rank=1, name="c", kind="compute", stream="compute", op="gemm", flops=1e13, bytes=0.0)
    step, times = run({0: [coll(0, "ar", "allreduce", (0, 1), 1e8)],
                       1: [comp, coll(1, "ar", "allreduce", (0, 1), 1e8, deps=("c",))]})
    t_c = times["1:c"][1]
    assert times["0:ar"][0] == 0.0
    assert times["0:ar"][1] == times["1:ar"][1] == pytest.approx(t_c + 1e8 / NVL + 2 * ALPHA + CALL, rel=1e-12)


def test_node_nics_are_shared_by_symmetric_peers():
    """Eight ranks of a node each in their own cross-node dp group share the node's NICs, and the
    symmetric program (one rank standing for eight) predicts the same time as the full one."""
    c = alpha_beta(get_cluster("2xdgx-a100-80g"))
    S = 1e9
    groups = {r: (r, r + 8) for r in range(8)}
    full = {r: [coll(r, "g", "allreduce", groups[r % 8], S, stream="comm.dp")] for r in range(16)}
    t_full, _ = run(full, c)
    sym = {0: [coll(0, "g", "allreduce", (0, 8), S, stream="comm.dp")],
           8: [coll(8, "g", "allreduce", (0, 8), S, stream="comm.dp")]}
    t_sym, _ = run(sym, c, represents={0: tuple(range(8)), 8: tuple(range(8, 16))})
    rail = c.network.nic_bw * c.costs.inter_bw_eff  # one NIC per GPU on a DGX
    assert t_full == pytest.approx(t_sym, rel=1e-12)
    assert t_full == pytest.approx(S / rail + 2 * c.network.latency_s + CALL, rel=1e-12)


def test_spanning_nodes_uses_the_faster_algorithm():
    """A 16-rank all-reduce over 2 nodes is no slower than the flat ring (hierarchical or tree may win)."""
    c = alpha_beta(get_cluster("2xdgx-a100-80g"))
    S, n = 1e9, 16
    step, _ = run({r: [coll(r, "ar", "allreduce", range(n), S, stream="comm.dp")] for r in range(n)}, c)
    node_bw = c.network.nics_per_node * c.network.nic_bw * c.costs.inter_bw_eff
    flat = 2 * (n - 1) / n * S / min(NVL, node_bw) + 2 * (n - 1) * c.network.latency_s + CALL
    assert step <= flat * (1 + 1e-12)


def test_a_message_moves_once_both_ends_have_posted_it():
    """Send and recv are a rendezvous: with the recv posted early the data moves at once; posted
    after the receiver's compute, it moves then, and the send ends with it."""
    nbytes = 1e9
    send = Instr(rank=0, name="m", kind="send", stream="p2p.send", op="send", bytes=nbytes, peer=1)
    early = Instr(rank=1, name="m", kind="recv", stream="p2p.recv", op="recv", bytes=nbytes, peer=0)
    _, times = run({0: [send], 1: [early]})
    wire = nbytes / NVL + ALPHA
    assert times["0:m"] == pytest.approx((0.0, wire), rel=1e-12)
    assert times["1:m"] == pytest.approx((0.0, wire), rel=1e-12)
    comp = Instr(rank=1, name="c", kind="compute", stream="compute", op="gemm", flops=1e14, bytes=0.0)
    late = Instr(rank=1, name="m", kind="recv", stream="p2p.recv", op="recv", bytes=nbytes, peer=0)
    _, times = run({0: [send], 1: [comp, late]})  # posted when rank 1's thread gets past `c`
    t_c = times["1:c"][1]
    assert t_c > wire
    assert times["1:m"] == pytest.approx((t_c, t_c + wire), rel=1e-12)
    assert times["0:m"] == pytest.approx((0.0, t_c + wire), rel=1e-12)


def test_messages_do_not_queue_behind_each_other():
    """Two receives from two senders: the one whose sender is ready completes first, whatever
    their order in the program (irecv posts both at once)."""
    nbytes = 1e8
    slow = Instr(rank=0, name="c", kind="compute", stream="compute", op="gemm", flops=1e15, bytes=0.0)
    s0 = Instr(rank=0, name="a", kind="send", stream="p2p.send", op="send", bytes=nbytes, peer=2, deps=("c",))
    s1 = Instr(rank=1, name="b", kind="send", stream="p2p.send", op="send", bytes=nbytes, peer=2)
    r_a = Instr(rank=2, name="a", kind="recv", stream="p2p.recv", op="recv", bytes=nbytes, peer=0)
    r_b = Instr(rank=2, name="b", kind="recv", stream="p2p.recv", op="recv", bytes=nbytes, peer=1)
    _, times = run({0: [slow, s0], 1: [s1], 2: [r_a, r_b]})
    assert times["2:b"][1] < times["0:c"][1] < times["2:a"][1]


def test_traffic_leaving_a_pod_shares_the_oversubscribed_uplink():
    """With one node per pod and 4:1 oversubscription, cross-node all-reduces run 4x slower."""
    base = alpha_beta(get_cluster("2xdgx-a100-80g"))
    net = base.network.model_copy(update={"pod_nodes": 1, "oversubscription": 4.0})
    pods = base.model_copy(update={"network": net})
    S = 1e9
    ranks = {r: [coll(r, "g", "allreduce", (r % 8, r % 8 + 8), S, stream="comm.dp")] for r in range(16)}
    fixed = 2 * base.network.latency_s + CALL
    flat, _ = run(ranks, base)
    over, _ = run(ranks, pods)
    assert over - fixed == pytest.approx(4 * (flat - fixed), rel=1e-9)


def test_small_allreduce_across_many_nodes_takes_the_tree():
    """For a tiny message over 16 nodes the tree's 2 log2(N) latency steps beat the ring's 2(N-1)."""
    c = alpha_beta(get_cluster("16xdgx-a100-80g"))
    g = tuple(range(0, 128, 8))  # one rank per node
    step, _ = run({r: [coll(r, "ar", "allreduce", g, 1024, stream="comm.dp")] for r in g}, c)
    alpha = c.network.latency_s
    assert step < 2 * (len(g) - 1) * alpha
    assert step == pytest.approx(2 * 4 * alpha + CALL, rel=1e-2)


def test_broadcast_is_a_pipelined_chain():
    """Broadcast of S bytes: S / B plus one hop latency per link of the chain."""
    S, n = 1e9, 8
    step, _ = run({r: [coll(r, "b", "broadcast", range(n), S)] for r in range(n)})
    assert step == pytest.approx(S / NVL + (n - 1) * ALPHA + CALL, rel=1e-12)


def test_alltoall_sends_all_but_its_own_share():
    """Pairwise all-to-all inside a node: each rank sends (n-1)/n of S over its NVLink port."""
    S, n = 1e9, 8
    step, _ = run({r: [coll(r, "a", "alltoall", range(n), S, stream="comm.ep")] for r in range(n)})
    assert step == pytest.approx((n - 1) / n * S / NVL + (n - 1) * ALPHA + CALL, rel=1e-12)


def test_forward_moe_dispatch_is_two_all_to_alls():
    """The forward dispatch exchanges the token counts before the tokens (as the executor and
    Megatron-LM's all-to-all dispatcher do); the other three MoE all-to-alls move tokens only."""
    from simexec.sim.simulate import simulate

    res = simulate("mixtral-8x7b", "dgx-h100", "dp=8,ep=8,gbs=8", trace=True)
    dur = {e.name: e.dur_us for e in res.trace.events if e.id.startswith("0:") and e.name.endswith(".L0.m0")}
    one_call = dur["fwd.combine.L0.m0"]  # the same bytes over the same group, one call
    assert dur["bwd.dispatch.L0.m0"] == pytest.approx(one_call)
    assert one_call < dur["fwd.dispatch.L0.m0"] < 1.5 * one_call


def _topology(name: str, topology: str, nodes: int):
    from simexec.specs.cluster import get_cluster
    c = get_cluster(name)
    return c.model_copy(update={"nodes": nodes, "network": c.network.model_copy(update={"topology": topology})})


def test_rail_optimized_prices_cross_rail_traffic_over_nvlink_first():
    """NCCL's PXN on a rail-optimized network: a message from GPU 0 of node 0 to GPU 1 of node 1 first
    crosses NVLink to node 0's GPU 1; a same-rail message and any message on a fat tree do not."""
    from simexec.sim.network import Network
    ranks = list(range(16))
    rail = Network(_topology("dgx-h100", "rail-optimized", 2), ranks, {})
    tree = Network(_topology("dgx-h100", "fat-tree", 2), ranks, {})
    nvl = {rail.link("nvl_tx", 0), rail.link("nvl_rx", 1)}
    cross = {lid for lid, _ in rail.p2p(0, 9, 1e6)[0][1]}
    assert nvl <= cross
    assert not nvl & {lid for lid, _ in rail.p2p(0, 8, 1e6)[0][1]}
    assert not any(k == "nvl_tx" for (k, _), lid in tree._ids.items() if lid in {l for l, _ in tree.p2p(0, 9, 1e6)[0][1]})
    assert rail.estimate(rail.p2p(0, 9, 1e6)) > rail.estimate(rail.p2p(0, 8, 1e6))
    # an all-to-all across the two nodes puts the cross-rail share on NVLink as well
    group = tuple(ranks)
    def nvl_demand(net):
        phase = net.collective("alltoall", group, 1e8)[0]
        ids = {net.link("nvl_tx", r) for r in ranks}
        return max(d for lid, d in phase[1] if lid in ids)
    assert nvl_demand(rail) == pytest.approx(nvl_demand(tree) + 0.5 * 7 / 8)
