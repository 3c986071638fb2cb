"""Symmetric mode (one rank per pipeline stage) predicts what simulating every rank predicts."""
import json

import pytest

from simexec.sim.simulate import simulate

PLANS = [
    ("gpt3-1.3b", "2xdgx-a100-80g", "dp=4,tp=2,pp=2,gbs=16"),
    ("gpt3-1.3b", "2xdgx-a100-80g", "dp=8,tp=2,zero=3,gbs=16"),
    ("gpt3-125m", "2xdgx-a100-80g", "dp=8,pp=2,zero=1,gbs=16,rank_order=pp-tp-cp-dp"),
]


@pytest.mark.parametrize("model,cluster,plan", PLANS)
def test_symmetric_and_full_agree(model, cluster, plan):
    sym = simulate(model, cluster, plan, symmetric=True)
    full = simulate(model, cluster, plan, symmetric=False)
    assert sym.symmetric and not full.symmetric
    assert sym.instructions < full.instructions
    assert sym.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert sym.peak_memory_bytes == pytest.approx(full.peak_memory_bytes, rel=1e-9)
    assert sym.peak_memory_bytes_per_rank.keys() == full.peak_memory_bytes_per_rank.keys()
    for r, b in full.peak_memory_bytes_per_rank.items():
        assert sym.peak_memory_bytes_per_rank[r] == pytest.approx(b, rel=1e-9)


def test_repeat_runs_are_bit_identical():
    runs = [simulate("gpt3-1.3b", "2xdgx-a100-80g", "dp=4,tp=2,pp=2,gbs=16", trace=True) for _ in range(2)]
    a, b = (dict(r.to_json(), wall_s=0.0) for r in runs)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert runs[0].trace.to_chrome() == runs[1].trace.to_chrome()
