"""Properties of simulated steps that must hold for any plan."""
from hypothesis import given, settings, strategies as st

from simexec.sim.simulate import simulate

STATES = ("params", "grads", "optimizer")


def model_states(plan: str) -> float:
    r = simulate("gpt3-1.3b", "1xdgx-a100-80g", plan, seq_len=512)
    return sum(r.memory_breakdown_bytes.get(k, 0.0) for k in STATES)


@settings(max_examples=6, deadline=None)
@given(dp=st.sampled_from([2, 4, 8]), extra=st.sampled_from(["", ",offload=optimizer"]))
def test_a_higher_zero_stage_never_raises_model_state_memory(dp, extra):
    tp = 8 // dp
    states = [model_states(f"dp={dp},tp={tp},zero={z},gbs={dp * 2}{extra}") for z in range(4)]
    assert all(a >= b for a, b in zip(states, states[1:])), states


def bubble_fraction(m: int, schedule: str) -> float:
    plan = f"pp=4,dp=2,gbs={2 * m},schedule={schedule}" if schedule != "interleaved-1f1b" else \
        f"pp=4,vpp=2,dp=2,gbs={2 * m}"
    r = simulate("gpt3-1.3b", "1xdgx-a100-80g", plan, seq_len=512)
    return r.breakdown_s.get("pipeline_bubble", 0.0) / r.step_time_s


@settings(max_examples=6, deadline=None)
@given(m=st.sampled_from([4, 8, 12]), schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
def test_more_micro_batches_never_raise_the_bubble_fraction(m, schedule):
    assert bubble_fraction(2 * m, schedule) <= bubble_fraction(m, schedule) + 1e-9
