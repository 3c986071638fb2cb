"""The Blackwell and MI300X presets, and NVLink domains larger than a node (GB200 NVL72)."""
import pytest

from simexec.errors import SpecError
from simexec.sim import nccl_tuning
from simexec.sim.network import Network
from simexec.specs.cluster import (BLACKWELL_SUSTAINED_CLOCK, GB, PRESETS, TRAINING_SHAPES, ClusterSpec, NodeSpec,
                                   get_cluster)
from tests.test_sim_network import coll, run

S = 256e6  # bytes of one all-gather (the gathered tensor)


def ring_simple_latency(cluster: ClusterSpec, ranks: int, domains: int) -> float:
    """NCCL's latency of a Simple ring all-gather (simexec.sim.nccl_tuning), what these groups run."""
    opts = nccl_tuning.options("allgather", ranks, domains, cluster.device.nccl_arch, cluster.node.cpu_vendor,
                               cluster.node.nvls, S)
    return next(o.latency_s for o in opts if (o.algorithm, o.protocol) == ("ring", "Simple"))


def allgather_seconds(cluster: ClusterSpec, group) -> float:
    """A lone all-gather of `group` on an idle network, every member present."""
    net = Network(cluster, list(group), {})
    return net.estimate(net.collective("allgather", tuple(group), S))


@pytest.mark.parametrize("name, world, domain", [
    ("hgx-b200", 8, 8), ("4xhgx-b200", 32, 8), ("gb200-nvl72", 72, 72), ("2xgb200-nvl72", 144, 72),
    ("mi300x-8", 8, 8),
])
def test_presets_and_their_node_counts(name, world, domain):
    c = get_cluster(name)
    assert c.world_size == world and c.nvlink_domain == domain


def test_gb200_rack_is_18_trays_of_4_with_their_own_nics():
    c = PRESETS["gb200-nvl72"]
    assert (c.nodes, c.node.gpus_per_node, c.node.nvlink_domain_gpus) == (18, 4, 72)
    assert c.network.nics_per_node == 4 and c.node.intra_bw == 900 * GB
    assert get_cluster("2xgb200-nvl72").nodes == 36


def test_dense_peaks_are_half_the_sparse_datasheet_figures():
    assert PRESETS["hgx-b200"].device.peak_flops["bf16"] == 2250e12
    assert PRESETS["gb200-nvl72"].device.peak_flops["bf16"] == 360e15 / 72 / 2
    assert PRESETS["mi300x-8"].device.peak_flops["fp8"] == 2614.9e12


def test_blackwell_tensor_cores_run_at_the_clock_they_sustain_under_the_power_cap():
    # B200 ~1580 of 1965 MHz under back-to-back tensor-core kernels at 1000 W (flashinfer PR #2899), over the
    # fall H100's GEMM figure already carries (TRAINING_SHAPES)
    assert BLACKWELL_SUSTAINED_CLOCK == pytest.approx((1580 / 1965) / TRAINING_SHAPES, abs=1e-3)
    assert 0.85 < BLACKWELL_SUSTAINED_CLOCK < 0.95
    b200, gb200, h100 = (PRESETS[n].costs for n in ("hgx-b200", "gb200-nvl72", "dgx-h100"))
    assert b200.gemm_eff == pytest.approx(0.776 * TRAINING_SHAPES * BLACKWELL_SUSTAINED_CLOCK, abs=1e-3)
    assert b200.fp8_gemm_eff == pytest.approx(0.763 * TRAINING_SHAPES * BLACKWELL_SUSTAINED_CLOCK, abs=1e-3)
    assert gb200.gemm_eff == pytest.approx(0.729 * TRAINING_SHAPES * BLACKWELL_SUSTAINED_CLOCK, abs=1e-3)
    for c in (b200, gb200):  # cuDNN on GB200 (causal), at the sustained clock
        assert c.attention_eff == pytest.approx(0.707 * 0.974 * BLACKWELL_SUSTAINED_CLOCK, abs=1e-3)
        assert c.attention_bwd_eff == pytest.approx(0.564 * 0.974 * BLACKWELL_SUSTAINED_CLOCK, abs=1e-3)
    assert (h100.gemm_eff, h100.attention_eff) == (0.72, round(0.659 * 0.876, 3))  # the reference stands


def test_domain_must_be_a_multiple_of_the_node():
    base = PRESETS["gb200-nvl72"].node.model_dump()
    with pytest.raises(ValueError, match="nvlink_domain_gpus 70 must be a multiple of gpus_per_node 4"):
        NodeSpec(**{**base, "nvlink_domain_gpus": 70})


def test_domain_error_in_a_cluster_file_is_one_line(tmp_path):
    f = tmp_path / "rack.yaml"
    f.write_text("base: gb200-nvl72\nnode:\n  nvlink_domain_gpus: 6\n")
    with pytest.raises(SpecError) as e:
        get_cluster(str(f))
    assert "\n" not in str(e.value) and "multiple of gpus_per_node 4" in str(e.value)


def test_tp8_inside_a_rack_is_priced_at_nvlink_rates():
    """tp=8 spans two GB200 trays but one NVLink domain: it costs what an 8-GPU all-gather on one
    HGX B200 board costs at GB200's NVLink efficiency, a third of the same two trays over their NICs."""
    rack = get_cluster("2xgb200-nvl72")
    tp = tuple(range(8))  # trays 0 and 1 of rack 0
    t_rack = allgather_seconds(rack, tp)
    nvl = rack.node.intra_bw * rack.costs.intra_bw_eff
    assert t_rack == pytest.approx(7 / 8 * S / nvl + ring_simple_latency(rack, 8, 1) + rack.costs.collective_latency_s)
    as_trays = rack.model_copy(update={"node": rack.node.model_copy(update={"nvlink_domain_gpus": 0})})
    assert allgather_seconds(as_trays, tp) > 3 * t_rack


def test_ep64_inside_a_rack_is_an_nvlink_all_to_all():
    """ep=64 over 16 trays of one rack: each GPU sends 63/64 of its tokens over its NVLink port."""
    rack = get_cluster("2xgb200-nvl72")
    ep = tuple(range(64))
    net = Network(rack, list(ep), {})
    t = net.estimate(net.collective("alltoall", ep, S))
    nvl = rack.node.intra_bw * rack.costs.intra_bw_eff
    assert t == pytest.approx(63 / 64 * S / nvl + 63 * rack.node.intra_latency_s + rack.costs.collective_latency_s)


def test_dp_across_two_racks_uses_the_nics():
    """A dp group of one GPU per rack crosses between racks over the trays' NICs: its rate is one
    GPU's rail (a NIC), not NVLink."""
    rack = get_cluster("2xgb200-nvl72")
    dp = (5, 77)
    t = allgather_seconds(rack, dp)
    rail = rack.network.nic_bw * rack.costs.inter_bw_eff
    assert t == pytest.approx(S / 2 / rail + ring_simple_latency(rack, 2, 2) + rack.costs.collective_latency_s)
    assert t > 10 * allgather_seconds(rack, (5, 6))


def test_simulated_allgather_across_presets():
    """The engine prices one 8-GPU all-gather: a GB200 tray pair (one NVLink domain) as fast as an HGX
    B200 board at the same efficiency; two HGX B200 nodes (4 GPUs each) go over the network."""
    def step(cluster, group):
        return run({r: [coll(r, "ag", "allgather", group, S)] for r in group}, cluster=cluster)[0]

    rack = get_cluster("gb200-nvl72")
    two_b200 = get_cluster("2xhgx-b200")
    t_rack = step(rack, range(8))
    t_b200 = step(get_cluster("hgx-b200"), range(8))
    assert t_rack == pytest.approx(t_b200, rel=1e-9)  # same NVLink 5 port and efficiency
    split = (0, 1, 2, 3, 8, 9, 10, 11)
    assert step(two_b200, split) > 2 * t_b200


def test_mi300x_mesh_gives_a_small_group_only_its_links():
    """On the switchless MI300X mesh a pair has one 64 GB/s link; all eight GPUs use seven each."""
    c = PRESETS["mi300x-8"]
    eff = c.costs.intra_bw_eff
    call, a = c.costs.collective_latency_s, c.node.intra_latency_s
    assert allgather_seconds(c, (0, 1)) == pytest.approx(S / 2 / (64 * GB * eff) + a + call)
    assert allgather_seconds(c, tuple(range(8))) == pytest.approx(7 / 8 * S / (7 * 64 * GB * eff) + 7 * a + call)


@pytest.mark.parametrize("name", ["dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "hgx-h200"])
def test_existing_presets_keep_one_domain_per_node(name):
    c = PRESETS[name]
    assert c.node.nvlink_domain_gpus == 0 and c.node.intra_peer_bw == 0 and c.nvlink_domain == 8
