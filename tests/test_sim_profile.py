"""Calibrated profiles replace a cluster's cost parameters."""
import json
from pathlib import Path

import pytest

from simexec.specs.cluster import get_cluster
from simexec.errors import SimexecError, SpecError
from simexec.sim.profile import apply_profile
from simexec.sim.simulate import simulate

PROFILE = {"name": "a100-slow-gemm", "machine": "test", "measured_at": "2024-01-01T00:00:00Z",
           "costs": {"gemm_eff": 0.41}, "device": {"memory_bytes": 40e9}}


def test_profile_fields_replace_the_clusters():
    c = apply_profile(get_cluster("dgx-a100-80g"), PROFILE)
    assert c.costs.gemm_eff == 0.41
    assert c.costs.attention_eff == get_cluster("dgx-a100-80g").costs.attention_eff
    assert c.device.memory_bytes == 40e9


def test_simulate_takes_a_profile_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    base = simulate("gpt3-125m", "dgx-a100-80g", "dp=8,gbs=8")
    slow = simulate("gpt3-125m", "dgx-a100-80g", "dp=8,gbs=8", profile=path)
    assert slow.step_time_s > base.step_time_s
    assert slow.memory_capacity_bytes == 40e9


def test_invalid_profile_is_a_spec_error():
    with pytest.raises(SpecError, match="gemm_eff"):
        apply_profile(get_cluster("dgx-a100-80g"), {"costs": {"gemm_eff": 2.0}})
    with pytest.raises(SpecError, match="none of the sections"):
        apply_profile(get_cluster("dgx-a100-80g"), {"name": "empty"})


def test_a_profile_file_that_is_not_one_is_named_in_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{bad")
    trace = Path(__file__).resolve().parents[1] / "traces" / "local" / "dp1.r0.json.gz"
    for path, words in ((tmp_path / "none.json", "profile file not found"), (tmp_path / "bad.json", "not valid JSON"),
                        (trace, "has none of the sections")):  # a gzip trace is read, then refused for what it holds
        with pytest.raises(SimexecError, match=words) as exc:
            apply_profile(get_cluster("local"), path)
        assert "\n" not in str(exc.value)
