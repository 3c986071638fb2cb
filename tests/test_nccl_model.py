"""NCCL's algorithm/protocol choice and costs (simexec.sim.nccl_tuning through Network.collective):
physics and ordering, not tuned equality."""
import pytest

from simexec.sim import nccl_tuning
from simexec.sim.network import Network
from simexec.specs.cluster import get_cluster

# nccl-tests all_reduce_perf, in-place busbw (GB/s), 8 GPUs of one node, NCCL 2.18.5 (Azure
# AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md with NVLS, ND_A100_v4_results.md).
H100_NVLS_BUSBW_1G = 466.35
A100_BUSBW_1G = 228.10


def timed(cluster_name, verb, n, nbytes, group=None):
    c = get_cluster(cluster_name)
    nodes = max(c.nodes, -(-n // c.node.gpus_per_node))
    c = c.model_copy(update={"nodes": nodes})
    group = tuple(group or range(n))
    net = Network(c, group, {})
    return net.estimate(net.collective(verb, group, float(nbytes))), net.algorithm(verb, group, float(nbytes))


def busbw(verb, n, nbytes, t):
    f = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reducescatter": (n - 1) / n}[verb]
    return f * nbytes / t / 1e9


def test_ring_latency_grows_linearly_with_ranks_across_nodes():
    """NCCL's ring all-gather takes n-1 steps: doubling the ranks doubles the latency increment."""
    lat = {n: next(o.latency_s for o in nccl_tuning.options("allgather", n, n // 8, "hopper", "intel", True, 1024)
                   if o.algorithm == "ring" and o.protocol == "LL") for n in (32, 64, 128, 256)}
    assert lat[128] - lat[64] == pytest.approx(2 * (lat[64] - lat[32]), rel=1e-9)
    assert lat[256] - lat[128] == pytest.approx(2 * (lat[128] - lat[64]), rel=1e-9)
    small = {n: timed("dgx-h100", "allgather", n, 1 << 20)[0] for n in (64, 1024)}
    assert small[1024] > 8 * small[64]


def test_small_allreduce_across_nodes_takes_the_tree_with_ll():
    t, algo = timed("dgx-a100-80g", "allreduce", 128, 1024)
    assert algo == "tree/LL"


@pytest.mark.parametrize("cluster,expected", [("dgx-a100-80g", "ring/Simple"), ("dgx-h100", "nvls/Simple")])
def test_large_allreduce_in_a_node_takes_ring_or_nvls_simple(cluster, expected):
    assert timed(cluster, "allreduce", 8, 1 << 30)[1] == expected


def test_protocol_moves_from_ll_to_simple_as_messages_grow():
    order = {"LL": 0, "LL128": 1, "Simple": 2}
    protos = [order[timed("dgx-a100-80g", "allreduce", 8, s)[1].split("/")[1]] for s in (1 << 10, 1 << 24, 1 << 30)]
    assert protos == sorted(protos) and protos[0] == 0 and protos[-1] == 2


def test_intra_node_allreduce_busbw_near_nccl_tests():
    """DGX H100 with NVLS beats its ring and lands near nccl-tests' 466 GB/s; DGX A100 near 228 GB/s."""
    t, _ = timed("dgx-h100", "allreduce", 8, 1 << 30)
    h100 = busbw("allreduce", 8, 1 << 30, t)
    assert H100_NVLS_BUSBW_1G * 0.9 < h100 < H100_NVLS_BUSBW_1G * 1.15
    t, _ = timed("dgx-a100-80g", "allreduce", 8, 1 << 30)
    assert busbw("allreduce", 8, 1 << 30, t) == pytest.approx(A100_BUSBW_1G, rel=0.05)


def test_no_hierarchical_allgather_across_nodes():
    """NCCL runs all-gather / reduce-scatter across nodes as rings (PAT with one GPU per node)."""
    for verb in ("allgather", "reducescatter"):
        assert timed("dgx-h100", verb, 16, 1 << 28)[1].startswith("ring/")
        one_per_node = tuple(range(0, 64, 8))
        assert timed("dgx-h100", verb, 64, 1 << 16, one_per_node)[1] in ("pat/Simple", "ring/LL", "ring/LL128")


def test_nvls_needs_the_switch_and_hopper():
    assert not any(o.algorithm.startswith("nvls")
                   for o in nccl_tuning.options("allreduce", 8, 1, "ampere", "amd", False, 1 << 30))
    assert not any(o.algorithm.startswith("nvls")
                   for o in nccl_tuning.options("allreduce", 8, 1, "ampere", "amd", True, 1 << 30))
    assert any(o.algorithm == "nvls" for o in nccl_tuning.options("allreduce", 8, 1, "hopper", "intel", True, 1 << 30))


def test_ll_puts_twice_the_bytes_on_the_links():
    """A protocol's efficiency is bytes on the wire: LL's phase loads NVLink twice as much per byte."""
    net = Network(get_cluster("dgx-a100-80g"), range(8), {})
    g = tuple(range(8))
    assert net.algorithm("allgather", g, 1024) == "ring/LL"
    assert net.algorithm("allgather", g, 1 << 30) == "ring/Simple"
    ll = net.collective("allgather", g, 1024)[0][1][0][1]
    simple = net.collective("allgather", g, 1 << 30)[0][1][0][1]
    assert ll == pytest.approx(2 * simple)


def test_alpha_beta_cluster_keeps_its_candidates():
    """Off NCCL (RCCL on MI300X, gloo) the plain alpha-beta candidates stay."""
    t, algo = timed("mi300x-8", "allreduce", 8, 1 << 30)
    assert algo == "ring"


def _sharp(cluster_name, n):
    c = get_cluster(cluster_name)
    c = c.model_copy(update={"nodes": max(c.nodes, -(-n // c.node.gpus_per_node)),
                             "network": c.network.model_copy(update={"sharp": True})})
    return c


def test_collnet_only_with_sharp_and_only_for_allreduce():
    """CollNet and multi-node NVLS are NCCL_COLLNET_ENABLE's algorithms: absent by default, all-reduce only."""
    plain = {o.algorithm for o in nccl_tuning.options("allreduce", 128, 16, "ampere", "amd", False, 1 << 30)}
    assert not any(a.startswith("collnet") for a in plain)
    sharp = {o.algorithm for o in nccl_tuning.options("allreduce", 128, 16, "ampere", "amd", False, 1 << 30,
                                                       collnet=True, nics=8)}
    assert {"collnet_direct", "collnet_chain"} <= sharp
    gathers = {o.algorithm for o in nccl_tuning.options("allgather", 128, 16, "hopper", "intel", True, 1 << 30,
                                                         collnet=True, nics=8)}
    assert not any(a.startswith("collnet") for a in gathers) and "nvls" not in gathers
    hopper = nccl_tuning.options("allreduce", 128, 16, "hopper", "intel", True, 1 << 30, collnet=True, nics=8)
    assert "nvls" in {o.algorithm for o in hopper}


def test_collnet_direct_pays_for_gpus_sharing_a_nic():
    one = nccl_tuning.collnet_direct_efficiency("ampere", 8, 8)
    shared = nccl_tuning.collnet_direct_efficiency("ampere", 8, 4)
    assert one == 1.0 and shared == pytest.approx(1 / 1.5)
    assert nccl_tuning.collnet_direct_efficiency("hopper", 8, 8) == pytest.approx(0.85)


@pytest.mark.parametrize("cluster", ["dgx-a100-80g", "dgx-h100"])
def test_sharp_halves_the_network_bytes_of_a_large_allreduce(cluster):
    """A ring all-reduce sends 2(n-1)/n S through each node's NICs; with the switches reducing, S: a
    large all-reduce across nodes gets faster, and a small one's latency stops growing with the nodes."""
    n, big = 128, 1 << 30
    group = tuple(range(n))
    plain_c = get_cluster(cluster).model_copy(update={"nodes": n // 8})
    plain = Network(plain_c, group, {})
    sharp = Network(_sharp(cluster, n), group, {})
    t_plain = plain.estimate(plain.collective("allreduce", group, float(big)))
    t_sharp = sharp.estimate(sharp.collective("allreduce", group, float(big)))
    assert t_sharp < 0.9 * t_plain
    assert sharp.algorithm("allreduce", group, float(big)).split("/")[0] in ("collnet_direct", "collnet_chain", "nvls")
    g8 = tuple(range(1024))
    wide = Network(_sharp(cluster, 1024), g8, {})
    small = {m: wide.estimate(wide.collective("allreduce", g, 65536.0)) for m, g in ((128, group), (1024, g8))}
    assert small[1024] < 1.2 * small[128]
    # all-gather does not change
    ag = [net.estimate(net.collective("allgather", group, float(big))) for net in (plain, sharp)]
    assert ag[0] == pytest.approx(ag[1])


# DeepEP V2 README (deepseek-ai/DeepEP@0297fc8, README.md "Performance"): SM90 + CX7 400 Gb/s, 8K tokens,
# hidden 7168, top-8, FP8 dispatch; dispatch "logical bandwidth" (local share included) on 2 and 4 nodes.
# NCCL-free kernels that saturate the NICs: the ceiling NCCL's grouped send/recv reaches at best.
DEEPEP_SM90_DISPATCH_GBPS = {2: 90.0, 4: 61.0}


@pytest.mark.parametrize("nodes", [2, 4, 8, 16])
def test_cross_node_alltoall_runs_at_each_gpus_nic(nodes):
    """NCCL's all-to-all is grouped send/recv; with PXN every GPU's off-node share leaves through one
    NIC of its rail, so large-message busbw is the per-GPU NIC rate times (n-1)/(n-k): 2x on two nodes,
    falling toward 1x with more (nccl-tests#130, sjeaugey: "N/(N-1)x the bandwidth per GPU")."""
    c = get_cluster("dgx-h100")
    n, k, S = 8 * nodes, 8, float(8 << 30)
    t, _ = timed("dgx-h100", "alltoall", n, S)
    nic = c.network.nic_bw * c.costs.inter_bw_eff
    assert (n - 1) / n * S / t == pytest.approx(nic * (n - 1) / (n - k), rel=0.01)


@pytest.mark.parametrize("nodes", sorted(DEEPEP_SM90_DISPATCH_GBPS))
def test_cross_node_alltoall_at_most_deepeps_ceiling(nodes):
    """Large all-to-alls across H100 nodes land at, not above, what NIC-saturating kernels reach."""
    S = float(512 << 20)
    t, _ = timed("dgx-h100", "alltoall", 8 * nodes, S)
    algbw = S / t / 1e9
    ceiling = DEEPEP_SM90_DISPATCH_GBPS[nodes]
    assert 0.9 * ceiling < algbw <= 1.02 * ceiling
