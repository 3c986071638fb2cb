"""The memory reorder (`simexec.program.reorder`): dependencies kept, the peak never higher and lower
where the order is free, the simulator's report of both orders, and (Ray) the executor's losses
unchanged with a lower measured peak."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simexec.program.lower import lower
from simexec.program.reorder import MOVES, check_reorder, live_peak, reorder_program
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import load_plan, resolve

PLANS = ["dp=2,gbs=4", "tp=2,gbs=2", "tp=2,sp=true,tp_overlap=true,gbs=2", "dp=2,zero=3,gbs=2,mbs=1",
         "dp=2,zero=3,zero_impl=yafsdp,gbs=2,mbs=1", "dp=2,zero=2,gbs=4,mbs=1", "pp=2,gbs={g},mbs=1",
         "pp=2,schedule=zb-h1,gbs={g},mbs=1", "pp=2,vpp=2,schedule=zb-v,gbs={g},mbs=1",
         "pp=2,dp=2,schedule=zb-h1,gbs={g2},mbs=1", "pp=2,tp=2,schedule=zb-h1,gbs={g},mbs=1",
         "dp=2,zero=3,recompute=full,gbs=4,mbs=1"]


def program_of(plan: str, symmetric: bool = False):
    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), load_plan(plan))
    return lower(rp, symmetric=symmetric)


def collective_orders(program) -> dict:
    """(group, rank) -> the rank's collectives over that group, in program order."""
    out: dict = {}
    for rank, instrs in program.ranks.items():
        for i in instrs:
            if i.kind == "collective":
                out.setdefault(i.group, {}).setdefault(rank, []).append(i.name)
    return out


@settings(max_examples=25, deadline=None)
@given(plan=st.sampled_from(PLANS), mbs=st.sampled_from([2, 4]),
       moves=st.lists(st.sampled_from(MOVES), min_size=1, max_size=2, unique=True))
def test_reorder_keeps_dependencies_and_collective_order_and_never_raises_the_peak(plan, mbs, moves):
    program = program_of(plan.format(g=mbs, g2=2 * mbs))
    text = program.to_text()
    result = reorder_program(program, tuple(moves))
    assert program.to_text() == text  # the original is left as it was
    new = result.program
    new.validate()
    check_reorder(program, new)
    for group, ranks in collective_orders(new).items():
        orders = {tuple(v) for v in ranks.values()}
        assert len(orders) == 1, f"collectives over {group} in different orders"
    for rank, r in result.ranks.items():
        assert live_peak(new.ranks[rank]) == r.peak_after <= r.peak_before == live_peak(program.ranks[rank])


@pytest.mark.parametrize("plan", ["pp=2,schedule=zb-h1,gbs=8,mbs=1", "dp=2,zero=3,gbs=2,mbs=1"])
def test_reorder_lowers_the_peak_of_deferred_weight_passes_and_prefetched_gathers(plan):
    result = reorder_program(program_of(plan))
    assert result.moved > 0
    assert any(r.peak_after < r.peak_before for r in result.ranks.values())


def test_a_weight_pass_moves_to_right_after_its_input_gradient_and_the_sends_it_feeds():
    program = program_of("pp=2,schedule=zb-h1,gbs=4,mbs=1")
    names = [i.name for i in reorder_program(program).program.ranks[1]]
    bwd, wgrad = names.index("bwd.head.L4.m0"), names.index("wgrad.head.L4.m0")
    between = [n for n in names[bwd + 1:wgrad] if not n.startswith("mem.")]
    assert between == [] and wgrad - bwd < names.index("p2p.act.v0.m1") - bwd


def test_nothing_moves_where_the_order_holds_nothing_back():
    program = program_of("dp=2,gbs=4")
    assert reorder_program(program).program.to_text() == program.to_text()


def test_simulate_reports_both_orders_only_with_memory_plan():
    from simexec.sim.simulate import simulate

    plain = simulate("gpt-tiny", "local", "pp=2,schedule=zb-h1,gbs=8,mbs=1")
    assert plain.reordered is None and "reordered" not in plain.format()
    r = simulate("gpt-tiny", "local", "pp=2,schedule=zb-h1,gbs=8,mbs=1", memory_plan=True)
    assert r.step_time_s == plain.step_time_s and r.peak_memory_bytes == plain.peak_memory_bytes
    assert r.reordered.moved > 0 and r.reordered.peak_memory_bytes < r.peak_memory_bytes
    assert r.reordered.step_time_s >= r.step_time_s  # the weight passes no longer fill the bubbles
    assert "reordered for memory" in r.format() and r.to_json()["reordered"]["moved"] == r.reordered.moved


def test_simulate_reports_the_reordered_plan_on_gpus():
    from simexec.sim.simulate import simulate

    r = simulate("llama3-8b", "2xdgx-h100", "dp=2,pp=8,schedule=zb-h1,gbs=64,mbs=1", memory_plan=True)
    assert r.reordered.peak_memory_bytes < r.peak_memory_bytes
    assert 0 < r.reordered.planned_peak_bytes < r.planned_peak_bytes


@pytest.mark.ray
def test_executor_runs_the_reordered_program_with_the_same_losses_and_a_lower_peak(ray_session):
    from simexec.exec.api import execute

    plan = "pp=2,schedule=zb-h1,gbs=4,mbs=1,dtype=fp32"
    original = execute("gpt-tiny", "local", plan, steps=2, trace=False)
    reordered = execute("gpt-tiny", "local", plan, steps=2, trace=False, memory_plan=True)
    assert len(original.losses) == 2
    assert all(abs(a - b) <= 1e-6 for a, b in zip(original.losses, reordered.losses))
    assert reordered.peak_memory_bytes_per_rank[1] < original.peak_memory_bytes_per_rank[1]
