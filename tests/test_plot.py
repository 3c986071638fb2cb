"""plot: every figure is written as PNG and SVG, with the axes, labels, titles and legends expected,
and large traces are drawn one collection per lane."""
import pytest

pytest.importorskip("matplotlib")

from simexec.errors import SimexecError  # noqa: E402
from simexec.trace.plot import (plot_calibration, plot_durations, plot_memory, plot_timeline,  # noqa: E402
                          plot_traces)
from simexec.trace.schema import Counter, Event, Trace  # noqa: E402

STEPS = [("compute", "compute", "gemm", 400.0), ("compute", "compute", "attention", 200.0),
         ("comm.tp", "collective", "allreduce@tp", 100.0), ("compute", "compute", "elementwise", 50.0),
         ("p2p.send", "send", "send", 30.0)]


def make(kind: str, scale: float = 1.0, ranks: int = 2, layers: int = 3, counters: bool = True) -> Trace:
    events, cnts = [], []
    for r in range(ranks):
        t = 0.0
        for layer in range(layers):
            for i, (stream, k, op, dur) in enumerate(STEPS):
                name = f"fwd.{op}.{i}.L{layer}"
                events.append(Event(id=f"{r}:{name}", rank=r, stream=stream, name=name, kind=k, op=op,
                                    start_us=t, dur_us=dur * scale, layer=layer))
                t += dur * scale
            if counters:
                cnts.append(Counter(rank=r, ts_us=t, category="activations", bytes=2e8 * (layer + 1)))
        if counters:
            cnts.append(Counter(rank=r, ts_us=0.0, category="params", bytes=1e9))
    return Trace(meta={"kind": kind, "plan": "tp=2,gbs=2", "program": "f00"}, events=events, counters=cnts)


def _check_file(path):
    data = path.read_bytes()
    assert len(data) > 1000
    if path.suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert b"<svg" in data[:2000]


def _legend_texts(ax):
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg else []


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_timeline(tmp_path, suffix):
    out = tmp_path / f"timeline{suffix}"
    fig = plot_timeline([make("predicted"), make("measured", scale=1.5)], out)
    _check_file(out)
    assert len(fig.axes) == 2
    top, bottom = fig.axes
    assert "predicted" in top.get_title(loc="left") and "measured" in bottom.get_title(loc="left")
    assert bottom.get_xlabel() == "time (ms)" and top.get_ylabel() == "rank / stream"
    assert top.get_shared_x_axes().joined(top, bottom)
    lanes = [t.get_text() for t in top.get_yticklabels()]
    assert lanes == ["r0 compute", "r0 comm.tp", "r0 p2p.send", "r1 compute", "r1 comm.tp", "r1 p2p.send"]
    assert _legend_texts(top) == ["gemm", "attention", "elementwise", "allreduce@tp", "send"]
    # shared axis: the measured run (1.5x longer) sets the limit for both
    assert top.get_xlim()[1] >= 1.5 * 3 * 780 / 1e3
    assert fig.get_suptitle().startswith("timeline")


def test_timeline_draws_one_collection_per_lane_and_caps_ranks():
    t = make("measured", ranks=20, layers=40, counters=False)
    fig = plot_timeline([t], max_ranks=8)
    (ax,) = fig.axes
    assert len(ax.collections) == 8 * 3  # 8 ranks x 3 streams, not one artist per event
    assert len(ax.get_yticklabels()) == 24
    assert "first 8 of 20 ranks" in fig.get_suptitle()


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_memory(tmp_path, suffix):
    out = tmp_path / f"memory{suffix}"
    fig = plot_memory([make("predicted"), make("measured", scale=1.2)], out)
    _check_file(out)
    assert len(fig.axes) == 2
    for r, ax in enumerate(fig.axes):
        assert ax.get_title() == f"rank {r}"
        assert ax.get_xlabel() == "time (ms)" and ax.get_ylabel() == "live memory (GB)"
        assert len(ax.lines) == 2
        # 1 GB params + 3 x 0.2 GB activations at the end of the step
        assert max(max(line.get_ydata()) for line in ax.lines) == pytest.approx(1.6)
    assert _legend_texts(fig.axes[0]) == ["predicted", "measured"]


def test_memory_without_any_memory_is_an_error():
    with pytest.raises(SimexecError, match="no memory"):
        plot_memory([make("measured", counters=False)])


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_durations(tmp_path, suffix):
    out = tmp_path / f"durations{suffix}"
    fig = plot_durations(make("predicted"), make("measured", scale=2.0), out)
    _check_file(out)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "predicted duration (µs)" and ax.get_ylabel() == "measured duration (µs)"
    texts = _legend_texts(ax)
    assert "y = x" in texts and "gemm (6)" in texts and "allreduce@tp (6)" in texts
    assert "median APE 50.0%" in ax.get_title()
    assert len(ax.collections) == len(STEPS)  # one scatter per op class


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_calibration(tmp_path, suffix):
    out = tmp_path / f"calibration{suffix}"
    before = [("dp=2", 1.0, 2.0), ("tp=2", 3.0, 2.0)]  # APE 50%, 50%
    after = [("dp=2", 2.0, 2.0), ("tp=2", 2.2, 2.0)]  # APE 0%, 10%
    fig = plot_calibration(before, after, out)
    _check_file(out)
    assert len(fig.axes) == 2
    bars, scatter = fig.axes
    assert "50.0% before" in fig.get_suptitle() and "5.0% after" in fig.get_suptitle()
    assert bars.get_ylabel() == "step time (ms)"
    assert [t.get_text() for t in bars.get_xticklabels()] == ["dp=2", "tp=2"]
    assert _legend_texts(bars) == ["measured", "predicted before (MAPE 50.0%)", "predicted after (MAPE 5.0%)"]
    assert len(bars.patches) == 6
    assert scatter.get_xlabel() == "predicted step time (ms)" and scatter.get_ylabel() == "measured step time (ms)"
    assert _legend_texts(scatter) == ["before", "after", "y = x"]


def test_calibration_stars_the_held_out_plans_and_gives_their_own_error(tmp_path):
    """The demo's plot: the plans the calibration never saw are starred, and the title gives their
    MAPE beside the one over every plan, which the calibration plans pull down."""
    before = [("dp=2", 1.0, 2.0), ("tp=2", 3.0, 2.0)]  # APE 50%, 50%
    after = [("dp=2", 2.0, 2.0), ("tp=2", 2.2, 2.0)]  # APE 0%, 10%
    fig = plot_calibration(before, after, tmp_path / "c.png", heldout=["tp=2"])
    bars = fig.axes[0]
    assert [t.get_text() for t in bars.get_xticklabels()] == ["dp=2", "tp=2*"]
    assert bars.get_xlabel() == "plan (* held out)"
    assert "5.0% after (2 plans); held out (1): 50.0% before, 10.0% after" in fig.get_suptitle()


def test_plot_traces_adds_a_memory_panel_when_there_are_counters(tmp_path):
    pred, meas = make("predicted"), make("measured", scale=1.3)
    pred.save(tmp_path / "p.json")
    meas.save(tmp_path / "m.json.gz")
    fig = plot_traces([str(tmp_path / "m.json.gz"), str(tmp_path / "p.json")], tmp_path / "out.png")
    _check_file(tmp_path / "out.png")
    assert len(fig.axes) == 3
    assert "predicted" in fig.axes[0].get_title(loc="left")  # predicted on top whatever the order given
    assert fig.axes[2].get_ylabel() == "live memory (GB)" and fig.axes[2].get_xlabel() == "time (ms)"
    assert _legend_texts(fig.axes[2]) == ["rank 0", "rank 1", "predicted", "measured"]
    assert "p.json" in fig.get_suptitle() and "m.json.gz" in fig.get_suptitle()


def test_plot_traces_single_trace_without_counters(tmp_path):
    make("measured", counters=False).save(tmp_path / "t.json")
    fig = plot_traces([str(tmp_path / "t.json")], tmp_path / "t.svg")
    _check_file(tmp_path / "t.svg")
    assert len(fig.axes) == 1 and fig.axes[0].get_xlabel() == "time (ms)"


def test_unknown_suffix_is_refused(tmp_path):
    with pytest.raises(SimexecError, match="png"):
        plot_timeline([make("measured")], tmp_path / "x.jpeg")


def test_simulated_trace_plots(tmp_path):
    simulate = pytest.importorskip("simexec.sim.simulate").simulate
    t = simulate("gpt-tiny", "local", "dp=2,tp=2,pp=2,gbs=8", symmetric=False, trace=True).trace
    t.save(tmp_path / "sim.json.gz")
    fig = plot_traces([str(tmp_path / "sim.json.gz")], tmp_path / "sim.png")
    _check_file(tmp_path / "sim.png")
    assert len(fig.axes) == 1 + bool(t.counters)
    assert "gemm" in _legend_texts(fig.axes[0])


def test_plot_traces_reads_a_plain_chrome_trace(tmp_path):
    import json

    events = [{"ph": "X", "name": f"k{i}", "cat": "kernel", "pid": i % 2, "tid": 7, "ts": 10.0 * i, "dur": 8.0}
              for i in range(20)]
    (tmp_path / "foreign.json").write_text(json.dumps({"traceEvents": events}))
    fig = plot_traces([str(tmp_path / "foreign.json")], tmp_path / "foreign.png")
    _check_file(tmp_path / "foreign.png")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["r0 7", "r1 7"]
    assert _legend_texts(fig.axes[0]) == ["kernel"]


def test_memory_panel_shows_a_summary_peak_when_a_trace_has_no_counters(tmp_path):
    pred = make("predicted")
    meas = make("measured", counters=False)
    meas.meta["summary"] = {"peak_memory_bytes_per_rank": {"0": 1.8e9, "1": 1.7e9}}
    pred.save(tmp_path / "p.json")
    meas.save(tmp_path / "m.json")
    fig = plot_traces([str(tmp_path / "p.json"), str(tmp_path / "m.json")])
    mem = fig.axes[-1]
    assert _legend_texts(mem) == ["rank 0", "rank 1", "predicted", "measured (peak)"]
    flat = [line for line in mem.lines if line.get_label().startswith("measured peak")]
    assert sorted(line.get_ydata()[0] for line in flat) == pytest.approx([1.7, 1.8])


def test_symmetric_prediction_memory_covers_the_represented_ranks():
    pred = make("predicted", ranks=1)
    pred.meta.update(symmetric=True, represents={"0": [0, 1, 2]})
    fig = plot_memory([pred, make("measured", ranks=3)])
    assert [ax.get_title() for ax in fig.axes] == ["rank 0", "rank 1", "rank 2"]
    assert all(len(ax.lines) == 2 for ax in fig.axes)
