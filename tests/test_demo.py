"""`simexec demo` end to end, on two small plans (starts a local Ray instance)."""
import json
import os

import pytest

from simexec.calibrate.evaluate import PlanSpec


@pytest.mark.ray
def test_demo_writes_report_plots_traces_and_summary(tmp_path, ray_session):
    from simexec.demo import demo

    specs = (PlanSpec("dp1", "gpt-tiny", "dp=1,gbs=4,dtype=fp32", "calibrate", "single rank"),
             PlanSpec("dp2", "gpt-tiny", "dp=2,gbs=4,dtype=fp32", "heldout", "dp"))
    summary = demo(tmp_path, progress=False, specs=specs, steps=3, rounds=2, max_nfev=4)
    for key in ("heldout_mape_before", "heldout_mape_after"):
        assert summary[key] >= 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["heldout_mape_after"] == pytest.approx(summary["heldout_mape_after"])
    report = (tmp_path / "report.md").read_text()
    assert "dp=2" in report and "heldout" in report
    for name in ("calibration.png", "timeline-dp1.png", "memory-dp2.png", "durations-dp2.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000
    assert (tmp_path / "traces" / "dp2.json.gz").exists()
    assert saved["rounds"] == 2 and (tmp_path / "traces" / "rounds" / "dp2.r1.json.gz").exists()
    assert saved["repeatability"] >= 0
    assert (tmp_path / "traces" / "dp2.predicted-after.json.gz").exists()
    assert (tmp_path / "profiles" / "demo-traces.json").exists()
    micro = json.loads((tmp_path / "profiles" / "demo-microbench.json").read_text())
    assert micro["costs"]["gloo_loops_idle"] is hasattr(os, "SCHED_IDLE")  # the benchmarks' loops as the plans'


def test_demo_refuses_an_unwritable_directory(tmp_path):
    from simexec.demo import demo
    from simexec.errors import SimexecError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SimexecError, match="cannot write"):
        demo(blocker / "out", progress=False)


def test_demo_refuses_fewer_than_one_round(tmp_path, capsys):
    from simexec.cli import main

    assert main(["demo", "--rounds", "0", "--out", str(tmp_path / "out")]) == 2
    assert "rounds (--rounds) must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
