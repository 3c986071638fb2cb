"""compare: known errors come out exactly on synthetic traces, traces of other programs are refused,
critical paths follow the waits, files round-trip, and a simulated program against a perturbed copy."""
import json
from dataclasses import replace
import subprocess
import sys

import pytest

from simexec.trace.compare import compare, compare_files
from simexec.trace.critical_path import critical_path
from simexec.errors import TraceError
from simexec.trace.schema import Counter, Event, Trace

OPS = [("qkv", "compute", "compute", "gemm", 40.0), ("attn", "compute", "compute", "attention", 20.0),
       ("attn_out", "collective", "comm.tp", "allreduce@tp", 10.0), ("fc", "compute", "compute", "gemm", 60.0),
       ("act", "compute", "compute", "elementwise", 5.0)]


def make(kind: str, scale: float = 1.0, ranks: int = 2, meta: dict | None = None, layers: int = 2) -> Trace:
    """Each rank runs OPS back to back for `layers` layers; every duration (and so every start) x scale."""
    events, counters = [], []
    for r in range(ranks):
        t = 0.0
        for layer in range(layers):
            for block, k, stream, op, dur in OPS:
                name = f"fwd.{block}.L{layer}.m0"
                events.append(Event(id=f"{r}:{name}", rank=r, stream=stream, name=name, kind=k, op=op,
                                    start_us=t, dur_us=dur * scale, phase="fwd", layer=layer, mb=0))
                t += dur * scale
            counters.append(Counter(rank=r, ts_us=t, category="activations", bytes=1e6 * (layer + 1) * (r + 1)))
        counters.append(Counter(rank=r, ts_us=0.0, category="params", bytes=4e6))
    m = {"kind": kind, "model": "gpt-tiny", "plan": "tp=2,gbs=2", "program": "abc123"}
    m.update(meta or {})
    return Trace(meta=m, events=events, counters=counters)


# --- known errors -----------------------------------------------------------------------------------
def test_measured_twice_predicted_is_50_percent_ape_and_minus_half_step_time():
    c = compare(make("predicted"), make("measured", scale=2.0))
    for table in (c.op_class_errors, c.stream_errors):
        for stats in table.values():
            assert stats["median_ape"] == pytest.approx(0.5)
            assert stats["p90_ape"] == pytest.approx(0.5)
            assert stats["median_ratio"] == pytest.approx(0.5)
    assert c.op_class_errors["gemm"]["count"] == 2 * 2 * 2  # ranks x layers x (qkv, fc)
    assert c.block_errors["fwd.qkv"]["count"] == 2 * 2 and set(c.block_errors) == {f"fwd.{b}" for b, *_ in OPS}
    assert c.to_json()["block_errors"]["fwd.fc"]["median_ratio"] == pytest.approx(0.5)
    assert set(c.stream_errors) == {"compute", "comm.tp"}
    assert c.step_time_error == pytest.approx(-0.5)  # span of events: predicted half of measured
    assert c.step_time["measured_source"] == "events"


def test_measured_half_predicted_is_100_percent_ape():
    c = compare(make("predicted"), make("measured", scale=0.5))
    assert c.overall["median_ape"] == pytest.approx(1.0)
    assert c.step_time_error == pytest.approx(1.0)


def test_gloo_reduce_scatters_measured_to_their_wait_are_left_out():
    """On CPU ranks a gloo reduce-scatter reports completion only once waited: its measured span is
    not its transfer, so its error is not reported; GPU traces keep theirs."""
    def with_rs(kind, meta=None):
        t = make(kind, meta=meta)
        t.events = [replace(e, op="reducescatter@tp") if e.op == "allreduce@tp" else e for e in t.events]
        return t

    cpu = compare(with_rs("predicted"), with_rs("measured", {"machine": {"device": "cpu"}}))
    assert "reducescatter@tp" not in cpu.op_class_errors and "comm.tp" not in cpu.stream_errors
    assert cpu.to_json()["unmatched"]["ends_when_waited"] == {"count": 4, "ops": ["reducescatter@tp"]}
    assert "left out: 4 reducescatter@tp events" in cpu.format()
    gpu = compare(with_rs("predicted"), with_rs("measured", {"machine": {"device": "cuda"}}))
    assert gpu.op_class_errors["reducescatter@tp"]["count"] == 4


def test_median_and_p90_per_op_class():
    pred, meas = make("predicted", ranks=1, layers=10), make("measured", ranks=1, layers=10)
    attention = [e for e in meas.events if e.op == "attention"]
    for i, e in enumerate(attention):  # measured = predicted x (1 + i/10): APE = 1 - 1/(1 + i/10)
        e.dur_us *= 1 + i / 10
    apes = sorted(1 - 1 / (1 + i / 10) for i in range(10))
    s = compare(pred, meas).op_class_errors["attention"]
    assert s["count"] == 10
    assert s["median_ape"] == pytest.approx((apes[4] + apes[5]) / 2)
    assert s["p90_ape"] == pytest.approx(apes[8] + 0.1 * (apes[9] - apes[8]))  # numpy's linear quantile
    assert compare(pred, meas).op_class_errors["gemm"]["median_ape"] == 0.0


def test_step_time_prefers_summary():
    pred = make("predicted", meta={"summary": {"step_time_s": 1.0}})
    meas = make("measured", meta={"summary": {"step_time_s": 0.8}})
    c = compare(pred, meas)
    assert c.step_time_error == pytest.approx(0.25)
    assert c.to_json()["step_time_error"] == pytest.approx(0.25)


def test_peak_memory_worst_rank_from_summary():
    pred = make("predicted", ranks=3, meta={"summary": {"peak_memory_bytes_per_rank": {"0": 100, "1": 200, "2": 50}}})
    meas = make("measured", ranks=3, meta={"summary": {"peak_memory_bytes_per_rank": {"0": 110, "1": 250, "2": 50}}})
    c = compare(pred, meas)
    assert c.memory["worst_rank"] == 1
    assert c.peak_memory_error == pytest.approx(-0.2)
    assert c.memory["per_rank"]["0"]["error"] == pytest.approx(100 / 110 - 1)
    assert c.memory["per_rank"]["2"]["error"] == 0.0


def test_peak_memory_from_counters():
    pred, meas = make("predicted"), make("measured")
    for cnt in meas.counters:
        if cnt.rank == 1 and cnt.category == "activations":
            cnt.bytes *= 1.5
    c = compare(pred, meas)
    # rank 1 peak: params 4 MB + activations 4 MB predicted, 4 + 6 measured
    assert c.memory["measured_source"] == "counters"
    assert c.memory["worst_rank"] == 1
    assert c.peak_memory_error == pytest.approx(8 / 10 - 1)


def test_unmatched_ids_on_either_side():
    pred, meas = make("predicted"), make("measured")
    dropped = meas.events.pop(0)
    extra = Event(id="1:extra", rank=1, stream="compute", name="extra", kind="compute", op="gemm",
                  start_us=1e4, dur_us=1.0)
    meas.events.append(extra)
    u = compare(pred, meas).unmatched
    assert u["predicted_only"] == [dropped.id] and u["measured_only"] == ["1:extra"]
    assert u["predicted_only_count"] == 1 and u["measured_only_count"] == 1
    assert u["matched"] == len(pred.events) - 1


# --- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, word", [
    ({"program": "fff999"}, "program"),
    ({"plan": "dp=2,gbs=2"}, "plan"),
    ({"model": {"name": "llama2-7b", "layers": 32}}, "model"),
])
def test_traces_of_other_programs_are_refused(change, word):
    with pytest.raises(TraceError) as err:
        compare(make("predicted"), make("measured", meta=change))
    msg = str(err.value)
    assert word in msg and "\n" not in msg
    assert "predicted" in msg and "measured" in msg


def test_no_common_id_is_refused():
    meas = make("measured", meta={"program": ""})
    for e in meas.events:
        e.id = "x" + e.id
    with pytest.raises(TraceError, match="share no instruction id"):
        compare(make("predicted", meta={"program": ""}), meas)


def test_fingerprint_under_either_key_and_model_dict():
    pred = make("predicted", meta={"program": None, "program_fingerprint": "abc123"})
    meas = make("measured", meta={"model": {"name": "gpt-tiny", "layers": 2}})
    assert compare(pred, meas).overall["count"] == len(meas.events)
    with pytest.raises(TraceError):
        compare(make("predicted", meta={"program": None, "program_fingerprint": "zzz"}), meas)


def test_the_instructions_that_ran_decide_where_both_traces_name_them():
    """A recording stays comparable when only the simulator's memory estimates changed: where both
    traces carry `program_executed` it decides (the whole program's hash may differ), and it refuses
    when the instructions differ; a trace without it falls back to the whole program's hash."""
    pred = make("predicted", meta={"program": "new-memory-model", "program_executed": "same-instrs"})
    assert compare(pred, make("measured", meta={"program_executed": "same-instrs"})).overall["count"] > 0
    with pytest.raises(TraceError, match="different programs"):
        compare(pred, make("measured", meta={"program": "new-memory-model", "program_executed": "other-instrs"}))
    with pytest.raises(TraceError, match="different programs"):
        compare(pred, make("measured"))  # an older recording: the whole program's hash differs


def test_the_executed_fingerprint_leaves_out_the_simulators_prices_only():
    """Memory markers and a compute instruction's FLOPs and bytes are estimates: changing them keeps
    the fingerprint. A message's size, an instruction's dependencies or its name change it."""
    from simexec.specs.cluster import get_cluster
    from simexec.program.lower import lower
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve

    program = lower(resolve(get_model("gpt-tiny"), get_cluster("local"), load_plan("dp=2,gbs=4")), symmetric=False)
    full, executed = program.fingerprint(), program.executed_fingerprint()
    mem = next(i for i in program.ranks[0] if i.kind == "memory")
    program.ranks[0][program.ranks[0].index(mem)] = replace(mem, bytes=mem.bytes * 2)
    assert program.fingerprint() != full and program.executed_fingerprint() == executed
    rank0 = program.ranks[0]
    comp = next(i for i in rank0 if i.kind == "compute" and i.flops > 0)
    rank0[rank0.index(comp)] = replace(comp, flops=comp.flops * 2, bytes=comp.bytes * 2)
    assert program.executed_fingerprint() == executed
    coll = next(i for i in rank0 if i.kind == "collective")
    for change in (dict(bytes=coll.bytes * 2), dict(deps=coll.deps[:-1]), dict(name=coll.name + "x")):
        k = rank0.index(coll)
        rank0[k] = replace(coll, **change)
        assert program.executed_fingerprint() != executed, change
        rank0[k] = coll
    assert program.executed_fingerprint() == executed


# --- critical path ----------------------------------------------------------------------------------
def _ev(rank, name, kind, stream, op, start, dur):
    return Event(id=f"{rank}:{name}", rank=rank, stream=stream, name=name, kind=kind, op=op, start_us=start, dur_us=dur)


def _waits(att_us: float, kind: str) -> Trace:
    """rank 0: gemm 10 us; rank 1: attention att_us; both all-reduce (each posts when ready, all end
    3 us after the last arrives); then rank 0 runs elementwise 7 us."""
    ready = max(10.0, att_us)
    return Trace(meta={"kind": kind, "program": "p"}, events=[
        _ev(0, "a", "compute", "compute", "gemm", 0, 10),
        _ev(1, "b", "compute", "compute", "attention", 0, att_us),
        _ev(0, "ar", "collective", "comm.tp", "allreduce@tp", 10, ready + 3 - 10),
        _ev(1, "ar", "collective", "comm.tp", "allreduce@tp", att_us, ready + 3 - att_us),
        _ev(0, "c", "compute", "compute", "elementwise", ready + 3, 7),
    ])


def test_critical_path_follows_the_last_member_of_a_collective():
    pred, meas = _waits(5, "predicted"), _waits(20, "measured")
    cp = critical_path(pred)
    assert cp.ids == ["0:a", "0:ar", "0:c"]
    assert cp.share == pytest.approx({"gemm": 10 / 20, "allreduce@tp": 3 / 20, "elementwise": 7 / 20})
    assert critical_path(meas).ids == ["1:b", "1:ar", "0:c"]
    c = compare(pred, meas).critical_path
    assert c["only_predicted_ops"] == ["gemm"] and c["only_measured_ops"] == ["attention"]
    assert c["only_predicted"] == ["0:a", "0:ar"] and c["only_measured"] == ["1:b", "1:ar"]
    assert c["measured"]["share"]["attention"] == pytest.approx(20 / 30)
    assert c["share_diff"]["gemm"] == pytest.approx(-0.5)


def test_critical_path_through_send_recv_and_idle_gaps():
    t = Trace(meta={"kind": "measured"}, events=[
        _ev(0, "f", "compute", "compute", "gemm", 0, 10),
        _ev(0, "x", "send", "p2p.send", "send", 10, 2),
        _ev(1, "x", "recv", "p2p.recv", "recv", 0, 12),  # posted early, waits for the data
        _ev(1, "g", "compute", "compute", "gemm", 15, 5),  # 3 us launch gap
        _ev(1, "h", "compute", "comm.dp", "allreduce@dp", 0, 1),  # off the path
    ])
    cp = critical_path(t)
    assert cp.ids == ["0:f", "0:x", "1:x", "1:g"]
    assert cp.time_us == pytest.approx({"gemm": 15, "send": 2, "idle": 3})
    assert sum(cp.share.values()) == pytest.approx(1.0)
    assert cp.span_us == 20


def test_critical_path_identical_for_a_time_dilated_copy():
    c = compare(make("predicted"), make("measured", scale=1.7)).critical_path
    assert c["jaccard"] == 1.0 and not c["only_predicted"] and not c["only_measured"]
    assert c["predicted"]["share"] == pytest.approx(c["measured"]["share"])
    assert sum(c["predicted"]["share"].values()) == pytest.approx(1.0)


# --- symmetric predicted traces ---------------------------------------------------------------------
def test_symmetric_prediction_maps_measured_ranks_to_representatives():
    pred = make("predicted", ranks=1, meta={"program": "sym", "symmetric": True, "represents": {"0": [0, 1]},
                                            "summary": {"peak_memory_bytes_per_rank": {"0": 100}}})
    meas = make("measured", ranks=2, scale=2.0, meta={"summary": {"peak_memory_bytes_per_rank": {"0": 100, "1": 125}}})
    c = compare(pred, meas)
    assert c.unmatched["predicted_only_count"] == 0 and c.unmatched["measured_only_count"] == 0
    assert c.op_class_errors["gemm"]["count"] == 2 * 2 * 2
    assert c.overall["median_ape"] == pytest.approx(0.5)
    assert c.memory["worst_rank"] == 1 and c.peak_memory_error == pytest.approx(-0.2)


# --- files, JSON, text ------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_round_trip_through_files(tmp_path, suffix):
    pred = make("predicted", meta={"summary": {"step_time_s": 1e-3, "peak_memory_bytes_per_rank": {"0": 5, "1": 6}}})
    meas = make("measured", scale=1.5)
    pred.save(tmp_path / f"p{suffix}")
    meas.save(tmp_path / f"m{suffix}")
    direct = compare(pred, meas).to_json()
    loaded = compare(Trace.load(tmp_path / f"p{suffix}"), Trace.load(tmp_path / f"m{suffix}")).to_json()
    assert json.loads(json.dumps(loaded)) == json.loads(json.dumps(direct))
    swapped = compare_files(tmp_path / f"m{suffix}", tmp_path / f"p{suffix}")  # order read from meta kind
    assert swapped.step_time_error == pytest.approx(direct["step_time_error"])


def test_json_holds_the_documented_keys_and_format_reads():
    c = compare(make("predicted"), make("measured", scale=2.0))
    out = json.loads(json.dumps(c.to_json()))
    for key in ("step_time_error", "peak_memory_error", "op_class_errors", "stream_errors", "critical_path",
                "unmatched"):
        assert key in out
    assert set(out["op_class_errors"]["gemm"]) >= {"median_ape", "p90_ape", "count"}
    text = c.format()
    assert "step time:" in text and "-50.0%" in text and "gemm" in text and "critical path" in text


def test_import_stays_light():
    code = ("import sys, simexec.trace.compare, simexec.trace.plot; "
            "print(sorted(m for m in ('torch', 'ray', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- a real program: the simulator's prediction against perturbed copies of itself -------------------
def _simulated(plan: str, symmetric: bool = False) -> Trace:
    simulate = pytest.importorskip("simexec.sim.simulate").simulate
    return simulate("gpt-tiny", "local", plan, symmetric=symmetric, trace=True).trace


def _perturbed(t: Trace, time_scale: float = 1.0, op_scale: dict | None = None, mem_scale: dict | None = None) -> Trace:
    meta = json.loads(json.dumps(t.meta))
    meta["kind"] = "measured"
    s = meta.setdefault("summary", {})
    if "step_time_s" in s:
        s["step_time_s"] *= time_scale
    peaks = s.get("peak_memory_bytes_per_rank") or {}
    s["peak_memory_bytes_per_rank"] = {r: b * (mem_scale or {}).get(int(r), 1.0) for r, b in peaks.items()}
    op_scale = op_scale or {}
    events = [replace(e, start_us=e.start_us * time_scale, dur_us=e.dur_us * time_scale * op_scale.get(e.op, 1.0))
              for e in t.events]
    counters = [Counter(c.rank, c.ts_us * time_scale, c.category, c.bytes) for c in t.counters]
    return Trace(meta=meta, events=events, counters=counters)


PLAN = "dp=2,tp=2,pp=2,gbs=8"


def test_simulated_program_against_time_dilated_copy():
    pred = _simulated(PLAN)
    meas = _perturbed(pred, time_scale=1.25, mem_scale={3: 1.1})
    c = compare(pred, meas)
    assert c.step_time_error == pytest.approx(1 / 1.25 - 1)
    timed = [e for e in pred.events if e.dur_us > 0 and e.kind != "memory"]
    assert c.overall["count"] == len(timed)
    for stats in c.op_class_errors.values():
        assert stats["median_ape"] == pytest.approx(0.2) and stats["p90_ape"] == pytest.approx(0.2)
    assert {"gemm", "attention", "allreduce@tp", "send", "recv"} <= set(c.op_class_errors)
    assert c.critical_path["jaccard"] == 1.0
    assert c.memory["worst_rank"] == 3 and c.peak_memory_error == pytest.approx(1 / 1.1 - 1)
    assert c.unmatched["predicted_only_count"] == 0 == c.unmatched["measured_only_count"]


def test_simulated_program_against_copy_with_slower_gemms():
    pred = _simulated(PLAN)
    c = compare(pred, _perturbed(pred, op_scale={"gemm": 2.0, "allreduce@tp": 0.8}))
    assert c.op_class_errors["gemm"]["median_ape"] == pytest.approx(0.5)
    assert c.op_class_errors["allreduce@tp"]["median_ape"] == pytest.approx(0.25)
    assert c.op_class_errors["attention"]["median_ape"] == pytest.approx(0.0)
    assert c.stream_errors["compute"]["count"] == c.kind_errors["compute"]["count"]


def test_symmetric_simulation_matches_a_full_trace():
    full, sym = _simulated(PLAN), _simulated(PLAN, symmetric=True)
    assert len(sym.events) < len(full.events)
    c = compare(sym, _perturbed(full))
    assert c.unmatched["measured_only_count"] == 0
    assert c.overall["count"] == len([e for e in full.events if e.dur_us > 0 and e.kind != "memory"])
    assert len(c.memory["per_rank"]) == 8


def test_simulations_of_different_plans_are_refused():
    with pytest.raises(TraceError, match="different"):
        compare(_simulated(PLAN), _perturbed(_simulated("dp=4,tp=2,gbs=8")))


def test_traces_that_say_their_reduce_scatters_end_on_completion_keep_them():
    """The executor now times a CPU reduce-scatter to its completion and says so in the trace's meta."""
    def with_rs(kind, meta=None):
        t = make(kind, meta=meta)
        t.events = [replace(e, op="reducescatter@tp") if e.op == "allreduce@tp" else e for e in t.events]
        return t

    meta = {"machine": {"device": "cpu"}, "ends_when_waited": []}
    c = compare(with_rs("predicted"), with_rs("measured", meta))
    assert c.op_class_errors["reducescatter@tp"]["count"] == 4
    assert c.to_json()["unmatched"]["ends_when_waited"]["count"] == 0


# --- waits for late members --------------------------------------------------------------------------
def test_late_waits_tell_groups_that_share_a_name_apart():
    """One all-reduce name, two tensor-parallel groups: rank 1 calls 2 ms after rank 0, ranks 2 and 3
    together. Told apart, rank 0 waits 2 ms: 1 ms a member in its group, none in the other, 0.5 ms a
    collective and 0.5 ms a rank. Taken for one collective of four, three members would wait 2 ms."""
    from simexec.trace.late_waits import late_waits

    events = [Event(id=f"{r}:c", rank=r, stream="comm.tp", name="c", kind="collective", op="allreduce@tp",
                    start_us=2000.0 if r == 1 else 0.0, dur_us=3000.0 - (2000.0 if r == 1 else 0.0))
              for r in range(4)]
    trace = Trace(meta={}, events=events)
    groups = {(r, "c"): (0, 1) if r < 2 else (2, 3) for r in range(4)}
    w = late_waits(trace, groups)["comm.tp"]
    assert w.collectives == 2
    assert w.per_collective_s == pytest.approx(0.5e-3) and w.per_rank_step_s == pytest.approx(0.5e-3)
    one = late_waits(trace)["all"]
    assert one.collectives == 1 and one.per_rank_step_s == pytest.approx(1.5e-3)


def test_compare_reports_the_measured_waits_for_late_members():
    """A copy of a simulated program in which rank 0 calls each of its tensor-parallel collectives 0.5 ms
    early (and ends them as before): it waits 0.5 ms for its partner in every one; the simulation,
    whose ranks call together, waits for nobody. The groups come from the plan's program."""
    pred = _simulated(PLAN)
    meas = _perturbed(pred)
    meas.events = [replace(e, start_us=e.start_us - 500.0, dur_us=e.dur_us + 500.0)
                   if e.rank == 0 and e.stream == "comm.tp" else e for e in meas.events]
    c = compare(pred, meas)
    early = sum(1 for e in meas.events if e.rank == 0 and e.stream == "comm.tp")
    tp = c.late_waits["comm.tp"]
    assert tp["predicted"]["per_rank_step_s"] == 0.0 and tp["predicted"]["collectives"] > 0
    assert tp["measured"]["per_rank_step_s"] == pytest.approx(early * 0.5e-3 / 8)
    assert c.late_waits["comm.dp"]["measured"]["per_rank_step_s"] == pytest.approx(0.0, abs=1e-12)
    assert "waits for late members" in c.format() and "late_waits" in c.to_json()
    # the same compute on both sides: a rank's compute plus its waits is over by the waits alone
    cw = c.to_json()["compute_and_waits"]
    assert cw["measured"]["compute_s"] == pytest.approx(cw["predicted"]["compute_s"])
    assert cw["measured"]["waits_s"] == pytest.approx(early * 0.5e-3 / 8)
    assert cw["error"] == pytest.approx(cw["predicted"]["compute_s"] / (cw["predicted"]["compute_s"] + early * 0.5e-3 / 8) - 1)
    assert "compute + waits a rank" in c.format()


def test_compare_reports_cpu_a_rank_a_step_on_shared_cores():
    """The simulation's CPU a rank a step (a symmetric one: its rank 0 stands for both) against a
    run's, the median of each rank's steady steps (its second half); and the cores' worth each side
    kept busy over its step."""
    from pathlib import Path

    simulate = pytest.importorskip("simexec.sim.simulate").simulate
    profile = Path(__file__).resolve().parents[1] / "traces" / "profiles" / "local-traces.json"
    plan = "dp=2,gbs=8,dtype=fp32"
    full = simulate("gpt-tiny", "local", plan, profile=profile, trace=True, symmetric=False).trace
    sym = simulate("gpt-tiny", "local", plan, profile=profile, trace=True, symmetric=True).trace
    pcpu = sym.meta["summary"]["cpu_s_per_rank"]["0"]
    assert full.meta["summary"]["cpu_s_per_rank"] == {"0": pytest.approx(pcpu), "1": pytest.approx(pcpu)}
    meas = _perturbed(full)
    s = meas.meta["summary"]
    del s["cpu_s_per_rank"]
    s["step_times_s"] = [0.5] * 8 + [0.04] * 8  # a slow warm-up, then 40 ms steps
    s["cpu_times_s_per_rank"] = {"0": [0.5] * 8 + [0.03] * 8, "1": [0.5] * 8 + [0.05] * 8}
    s["main_cpu_times_s_per_rank"] = {"0": [0.4] * 8 + [0.02] * 8, "1": [0.4] * 8 + [0.04] * 8}
    c = compare(sym, meas)
    cpu = c.to_json()["cpu"]
    assert cpu["measured"] == {"per_rank_s": pytest.approx(0.04), "cores_busy": pytest.approx(2.0),
                               "main_thread_s": pytest.approx(0.03)}
    step, pmain = sym.meta["summary"]["step_time_s"], sym.meta["summary"]["main_cpu_s_per_rank"]["0"]
    assert 0 < pmain < pcpu  # the gradient all-reduce's bursts run on the communication thread
    assert cpu["predicted"] == {"per_rank_s": pytest.approx(pcpu), "cores_busy": pytest.approx(2 * pcpu / step),
                                "main_thread_s": pytest.approx(pmain)}
    assert cpu["error"] == pytest.approx(pcpu / 0.04 - 1)
    assert "CPU a rank a step" in c.format() and "of it the rank's own thread" in c.format()
    del s["main_cpu_times_s_per_rank"]  # a run that timed only its processes: no split on either side
    split = compare(sym, meas).cpu
    assert "main_thread_s" not in split["predicted"] and "main_thread_s" not in split["measured"]
    assert split["error"] == pytest.approx(pcpu / 0.04 - 1) and "own thread" not in compare(sym, meas).format()
    del s["cpu_times_s_per_rank"]
    assert compare(sym, meas).cpu == {} and "CPU a rank" not in compare(sym, meas).format()
