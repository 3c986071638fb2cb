"""Stragglers, slowed NICs and GPU-to-GPU variation in the simulator (simexec.sim.variation)."""
import numpy as np
import pytest

from simexec.cli import main
from simexec.errors import SpecError
from simexec.sim.simulate import simulate
from simexec.sim.slowdown import parse_slow
from simexec.sim.variation import draw_link_slowdowns, draw_slowdowns

MODEL, ONE_NODE, PLAN = "llama2-7b", "1xdgx-a100-80g", "dp=8,zero=1,gbs=16"


def _compute(breakdown):
    return sum(breakdown.get(k, 0.0) for k in ("compute", "recompute", "optimizer"))


@pytest.mark.parametrize("symmetric", [True, False])
def test_straggler_slows_the_compute_part_by_its_factor(symmetric):
    r = simulate(MODEL, ONE_NODE, PLAN, seq_len=1024, symmetric=symmetric, slow="rank:3:1.3")
    s = r.stragglers
    assert _compute(s.breakdown_s) == pytest.approx(1.3 * _compute(r.breakdown_s), rel=0.02)
    assert s.slowdown == pytest.approx(1.3, rel=0.05)


def test_node_spec_slows_every_rank_of_the_node():
    assert parse_slow("node:1:2", 16, 8).compute == {r: 2.0 for r in range(8, 16)}


def test_nic_slowdown_slows_a_cross_node_all_reduce():
    r = simulate(MODEL, "2xdgx-a100-80g", "dp=16,gbs=16", seq_len=512, slow="nic:1:8")
    base = sum(v for k, v in r.breakdown_s.items() if k.startswith("comm."))
    slowed = sum(v for k, v in r.stragglers.breakdown_s.items() if k.startswith("comm."))
    assert slowed > 2 * base
    assert r.stragglers.step_time_s > r.step_time_s


def test_variation_percentiles_and_growth_with_rank_count():
    small = simulate(MODEL, ONE_NODE, PLAN, seq_len=1024, variation=0.05, seeds=8).variation
    big = simulate(MODEL, "8xdgx-a100-80g", "dp=64,zero=1,gbs=128", seq_len=1024, variation=0.05, seeds=8).variation
    for v in (small, big):
        assert v.p99_s >= v.p90_s >= v.p50_s >= v.baseline_step_time_s
    assert big.median_slowdown > small.median_slowdown > 1.0


def test_variation_is_deterministic_for_a_seed():
    assert np.array_equal(draw_slowdowns(4096, 0.05, 7), draw_slowdowns(4096, 0.05, 7))
    assert draw_slowdowns(4096, 0.05, 7).min() >= 1.0
    a = simulate(MODEL, ONE_NODE, PLAN, seq_len=1024, variation=0.05, seeds=3).variation
    b = simulate(MODEL, ONE_NODE, PLAN, seq_len=1024, variation=0.05, seeds=3).variation
    assert a.step_times_s == b.step_times_s


def test_link_variation_slows_a_cross_node_all_reduce_and_is_deterministic():
    kw = dict(seq_len=512, seeds=4)
    healthy = simulate(MODEL, "2xdgx-a100-80g", "dp=16,gbs=16", link_variation=0.0, **kw).variation
    links = simulate(MODEL, "2xdgx-a100-80g", "dp=16,gbs=16", link_variation=0.5, **kw).variation
    again = simulate(MODEL, "2xdgx-a100-80g", "dp=16,gbs=16", link_variation=0.5, **kw).variation
    assert healthy.median_slowdown == pytest.approx(1.0) and healthy.cv == 0.0
    assert links.link_cv == 0.5 and links.p50_s > healthy.p50_s and links.step_times_s == again.step_times_s
    # the NICs' stream of a seed is not the GPUs'
    assert not np.array_equal(draw_link_slowdowns(64, 0.1, 3), draw_slowdowns(64, 0.1, 3))


@pytest.mark.parametrize("spec", ["rank:8:2", "gpu:0:2", "rank:0:0.9", "rank:x:2", "nic:3:2", ""])
def test_bad_slow_specs_fail_with_one_line(spec):
    with pytest.raises(SpecError):
        parse_slow(spec, 8, 8)


@pytest.mark.parametrize("flags", [["--slow", "rank:99:2"], ["--variation", "1.5"],
                                   ["--variation", "0.1", "--seeds", "0"], ["--tokens", "0"],
                                   ["--link-variation", "-0.1"]])
def test_cli_errors_are_one_line(flags, capsys):
    rc = main(["simulate", "--model", "gpt-tiny", "--cluster", "local", "--plan", "dp=2,gbs=4", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("simexec: error:")
