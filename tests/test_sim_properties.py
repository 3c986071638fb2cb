"""Properties over a few plans: more bandwidth never slows a step."""
from hypothesis import given, settings, strategies as st

from simexec.cluster import get_cluster
from simexec.model import get_model
from simexec.simulate import simulate

BASE = get_cluster("2xdgx-a100-80g")
MODEL = get_model("gpt3-125m", seq_len=1024)
PLANS = [
    "dp=4,tp=2,pp=2,gbs=16",
    "dp=16,zero=3,gbs=16",
    "dp=8,tp=2,zero=1,gbs=16,bucket_mb=10",
    "tp=4,pp=4,gbs=8,sp=1",
    "dp=2,tp=2,pp=4,vpp=3,gbs=8",
]


def faster(intra: float, inter: float, pcie: float):
    return BASE.model_copy(update={
        "node": BASE.node.model_copy(update={"intra_bw": BASE.node.intra_bw * intra,
                                             "host_link_bw": BASE.node.host_link_bw * pcie}),
        "network": BASE.network.model_copy(update={"nic_bw": BASE.network.nic_bw * inter}),
    })


factor = st.floats(min_value=1.0, max_value=16.0)


@settings(max_examples=15, deadline=None)
@given(plan=st.sampled_from(PLANS), intra=factor, inter=factor, pcie=factor)
def test_more_bandwidth_never_slows_a_step(plan, intra, inter, pcie):
    slow = simulate(MODEL, BASE, plan).step_time_s
    fast = simulate(MODEL, faster(intra, inter, pcie), plan).step_time_s
    assert fast <= slow * (1 + 1e-9)
