"""search --robust (a worst-placed straggler), --objective time-to-train, and time-to-train under --slow."""
import pytest

from simexec.cli import main
from simexec.search.robust import RobustSpec, parse_robust, robust_report
from simexec.search.runners import Context
from simexec.search.time_to_train import rank_by_days
from simexec.errors import SpecError
from simexec.sim.goodput import GoodputParams
from simexec.sim.simulate import simulate
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model

MODEL, NODE, SEQ = "llama2-7b", "1xdgx-a100-80g", 1024


def _robust(plans):
    ctx = Context(get_model(MODEL), get_cluster(NODE), SEQ)
    entries = [{"plan": p, "step_time_s": simulate(MODEL, NODE, p, seq_len=SEQ).step_time_s} for p in plans]
    rows = {row.plan: row for row in robust_report(entries, ctx, RobustSpec()).rows}
    return [rows[p] for p in plans]


def test_a_straggler_costs_a_deeper_pipeline_more_and_an_overlapped_plan_less():
    flat, deep, tp = "dp=8,zero=1,gbs=32", "dp=1,pp=8,gbs=32", "dp=1,tp=8,gbs=32"
    f, d, t = _robust([flat, deep, tp])
    # the slow stage paces every micro-batch of the pipeline, its fill and drain included: more seconds lost
    assert d.straggled_step_time_s - d.step_time_s > 1.05 * (f.straggled_step_time_s - f.step_time_s)
    # the last stage (head and loss) is where one slow GPU costs the 8-deep pipeline most
    assert d.straggler["compute"] == {"7": 1.2}
    # all-compute data parallelism pays nearly the full 1.2; exposed tensor-parallel comm is not slowed
    assert f.ratio == pytest.approx(1.2, abs=0.02)
    assert t.ratio < f.ratio - 0.03


def test_time_to_train_counts_stragglers():
    healthy = simulate(MODEL, NODE, "dp=8,zero=1,gbs=16", seq_len=SEQ, tokens=1e11).time_to_train
    slowed = simulate(MODEL, NODE, "dp=8,zero=1,gbs=16", seq_len=SEQ, tokens=1e11, slow="rank:3:1.3")
    ttt = slowed.time_to_train
    assert ttt.days > 1.2 * healthy.days
    assert ttt.breakdown_days["stragglers"] == pytest.approx(
        healthy.goodput.solve_s * (slowed.stragglers.slowdown - 1) / 86400, rel=1e-9)
    assert "stragglers" not in healthy.breakdown_days


def test_days_rank_a_smaller_checkpoint_copy_first_at_equal_step():
    ctx = Context(get_model(MODEL), get_cluster(NODE), SEQ)
    r = simulate(MODEL, NODE, "dp=8,zero=0,gbs=16", seq_len=SEQ)
    same = {"step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s, "breakdown_s": r.breakdown_s}
    pool = [{"plan": "dp=8,zero=0,gbs=16", **same}, {"plan": "dp=8,zero=1,gbs=16", **same}]
    ranked = rank_by_days(pool, ctx, 1e12, GoodputParams(failures_per_gpu_hour=1e-3), keep=2, whole=True).ranked
    # zero=1 shards Adam's states: each rank copies an eighth of them to host per checkpoint
    assert [x["plan"] for x in ranked] == ["dp=8,zero=1,gbs=16", "dp=8,zero=0,gbs=16"]
    assert ranked[0]["days"] < ranked[1]["days"]


def test_search_objective_time_to_train_orders_by_days():
    from simexec.search.driver import search

    res = search(MODEL, NODE, 16, seq_len=SEQ, top=2, objective="time-to-train", tokens=1e11,
                 fix={"tp": 1, "pp": 1, "cp": 1, "mbs": 1, "recompute": "none"}, workers=1, progress=False)
    days = [p["days"] for p in res.plans]
    assert days == sorted(days) and len(days) == 2
    assert res.time_to_train["pool"] >= 2 and res.objective == "time-to-train"
    assert res.to_json()["plans"][0]["time_to_train"]["days"] == days[0]


def test_parse_robust():
    assert parse_robust(None).factor == 1.2 and parse_robust("1.5").factor == 1.5
    assert parse_robust("rank:0:2,nic:0:2").slow == "rank:0:2,nic:0:2"
    for bad in ("0.9", "inf", "slow", "rank:1"):
        with pytest.raises(SpecError):
            parse_robust(bad)
    links = parse_robust("", link_variation=0.1)  # NICs drawn, the GPUs identical
    assert (links.variation, links.link_variation) == (0.0, 0.1) and "NIC CV 0.1" in links.describe()


@pytest.mark.parametrize("flags", [["--objective", "time-to-train"], ["--tokens", "1e12"],
                                   ["--objective", "time-to-train", "--tokens", "-1"],
                                   ["--robust", "0.5"], ["--robust", "rank:99:2"], ["--variation", "0.05"],
                                   ["--robust", "--variation", "2"], ["--link-variation", "0.1"],
                                   ["--robust", "--link-variation", "1.5"],
                                   ["--objective", "time-to-train", "--tokens", "1e12", "--failure-rate", "-1"]])
def test_search_bad_input_is_one_line(flags, capsys):
    rc = main(["search", "--model", "gpt-tiny", "--cluster", "local", "--gbs", "4", "--workers", "1", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("simexec: error:"), err
