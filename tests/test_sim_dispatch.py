"""An eager host issuing a GPU's operators (`costs.host_dispatch_s`, simexec.sim.host.model.dispatch_clock)."""
import pytest

from simexec.specs.cluster import get_cluster
from simexec.program.lower import lower
from simexec.specs.model import get_model
from simexec.specs.plan import load_plan, resolve
from simexec.sim.host.model import HostCosts
from simexec.sim.simulate import simulate

CLUSTER = "dgx-h100"


def _issue_seconds(model: str, plan: str, per_op: float) -> float:
    """What the host needs to issue every compute instruction of rank 0, by the host model's counts."""
    rp = resolve(get_model(model), get_cluster(CLUSTER), load_plan(plan))
    program = lower(rp)
    hc = HostCosts(get_cluster(CLUSTER), program)
    return sum(hc.ops(i) * per_op for i in program.ranks[0] if i.kind == "compute")


def test_off_by_default_and_zero_changes_nothing():
    a = simulate("gpt-tiny", CLUSTER, "dp=8,gbs=32")
    b = simulate("gpt-tiny", CLUSTER, "dp=8,gbs=32", profile={"costs": {"host_dispatch_s": 0.0}})
    assert a.step_time_s == b.step_time_s


def test_tiny_kernels_make_the_step_host_bound():
    """gpt-tiny's kernels take microseconds on an H100: the step is the host's issue time."""
    per_op = 20e-6
    res = simulate("gpt-tiny", CLUSTER, "dp=8,gbs=32", profile={"costs": {"host_dispatch_s": per_op}})
    host = _issue_seconds("gpt-tiny", "dp=8,gbs=32", per_op)
    device = simulate("gpt-tiny", CLUSTER, "dp=8,gbs=32").step_time_s
    assert device < 0.2 * host
    assert host <= res.step_time_s <= host + device


def test_large_kernels_hide_the_host():
    """A model whose kernels outlast their issue: the host runs ahead and the step is the device's."""
    plan = "dp=8,tp=1,gbs=8,recompute=full"
    base = simulate("llama3-8b", CLUSTER, plan)
    host = simulate("llama3-8b", CLUSTER, plan, profile={"costs": {"host_dispatch_s": 10e-6}})
    assert _issue_seconds("llama3-8b", plan, 10e-6) < 0.2 * base.step_time_s
    assert host.step_time_s == pytest.approx(base.step_time_s, rel=0.01)


def test_issue_cost_grows_with_the_operator_count():
    """Between the two regimes the step grows with the per-operator cost, never shrinks."""
    times = [simulate("gpt3-125m", CLUSTER, "dp=8,gbs=8", profile={"costs": {"host_dispatch_s": t}}).step_time_s
             for t in (0.0, 5e-6, 20e-6, 80e-6)]
    assert times == sorted(times) and times[-1] > 2 * times[0]
