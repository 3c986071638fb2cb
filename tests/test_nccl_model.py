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
