"""A GPU rank's host issuing its stack's kernels (`StackSpec.host`, simexec.sim.host.launches)."""
import pytest

from simexec.sim.simulate import simulate
from simexec.specs.stack import STACKS

CLUSTER = "dgx-h100"


def _stack(name: str, **host):
    s = STACKS[name]
    return s.model_copy(update={"host": s.host.model_copy(update=host)})


def test_small_plan_is_host_bound_eager_and_not_graphed():
    """gpt-tiny's kernels take microseconds on an H100: eager torchtitan waits on its host, the same
    stack with its layers graphed does not."""
    plan = "dp=8,gbs=32"
    device = simulate("gpt-tiny", CLUSTER, plan, stack=_stack("torchtitan", op_s=(0.0, 0.0), launch_s=0.0))
    eager = simulate("gpt-tiny", CLUSTER, plan, stack="torchtitan")
    graphed = simulate("gpt-tiny", CLUSTER, plan, stack=_stack("torchtitan", cuda_graphs=("full",)))
    assert eager.step_time_s > 2 * device.step_time_s
    assert graphed.step_time_s == pytest.approx(device.step_time_s, rel=0.02)
    layers = simulate("gpt-tiny", CLUSTER, plan, stack=_stack("torchtitan", cuda_graphs=("attn", "mlp")))
    assert device.step_time_s <= layers.step_time_s < eager.step_time_s


def test_host_waits_at_the_moe_dispatch():
    """The all-to-all dispatcher reads the token counts on the host: the host loses its lead there, and
    where issuing the experts outlasts the token all-to-all the device waits for it; without the
    wait the host would have issued them ahead."""
    plan = "ep=8,dp=8,zero=3,gbs=8"
    many = dict(expert_launches=(400, 4))  # issuing the experts takes longer than the all-to-all
    wait = simulate("mixtral-8x7b", CLUSTER, plan, seq_len=512, stack=_stack("megatron-core", **many))
    ahead = simulate("mixtral-8x7b", CLUSTER, plan, seq_len=512,
                     stack=_stack("megatron-core", moe_dispatch_syncs=False, **many))
    assert wait.step_time_s > 1.02 * ahead.step_time_s


def test_large_model_step_unchanged():
    """Llama 3 8B's layers outlast their issue: the host hides behind the device (within 1%)."""
    plan = "dp=8,gbs=8,recompute=full"
    host = simulate("llama3-8b", CLUSTER, plan)
    none = simulate("llama3-8b", CLUSTER, plan, stack=STACKS["megatron-core"].model_copy(update={"host": None}))
    assert host.step_time_s == pytest.approx(none.step_time_s, rel=0.01)
