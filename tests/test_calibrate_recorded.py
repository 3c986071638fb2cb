"""This machine's recorded traces and profiles (traces/, re-recorded by scripts/record_traces.py): the
calibrated profile predicts the held-out plans' step times; the raw micro-benchmarks fit again to
sane numbers. No Ray needed."""
import json
import math
import statistics
from pathlib import Path

import pytest

from simexec.sim.profile import load_profile
from simexec.calibrate.micro import fit_microbench
from simexec.calibrate.traces import load_cases, predict_case
from simexec.specs.cluster import get_cluster
from simexec.sim.profile import apply_profile
from simexec.trace.schema import load_json
from simexec.calibrate import host_probes

ROOT = Path(__file__).resolve().parents[1]
DIR = ROOT / "traces" / "local"


def probe(script: str, *args: str):
    """`scripts/<script>` run as a user runs it: (exit status, stdout, stderr)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    return out.returncode, out.stdout, out.stderr


def probe_traces(*args: str):
    return probe("probe_traces.py", *args)


def probe_host(*args: str):
    return probe("probe_host.py", *args)
PROFILES = ROOT / "traces" / "profiles"
pytestmark = pytest.mark.skipif(not (DIR / "manifest.json").exists(), reason="no recorded traces (scripts/record_traces.py)")

LOCAL = get_cluster("local")
# The held-out step-time MAPE the recorded profile reaches on the recorded held-out traces (per
# round: 6.0% for the 2026-11-24 17:12 recording, 5.7% against each plan's median), with room for
# the simulator's own changes. docs/calibration.md has the table.
HELDOUT_MAPE_MAX = 0.16


def manifest() -> dict:
    return json.loads((DIR / "manifest.json").read_text())


def _mape(runs, profile) -> float:
    errs = []
    for r in runs:
        case = load_cases([DIR / r["file"]])[0]
        pred = predict_case(case, LOCAL, profile, trace=False).step_time_s
        errs.append(abs(pred / case.step_s - 1.0))
    return statistics.fmean(errs)


def test_recorded_profiles_load_and_describe_this_kind_of_machine():
    for name in ("local-microbench", "local-traces"):
        prof = load_profile(PROFILES / f"{name}.json")
        assert {"name", "machine", "measured_at", "method", "costs"} <= set(prof)
        c = apply_profile(LOCAL, prof)
        assert c.costs.cores_shared and c.node.cpu_cores == prof["machine"]["cores"]


def test_recorded_profile_predicts_held_out_traces():
    runs = manifest()["runs"]
    held = [r for r in runs if r["role"] == "heldout"]
    assert len(held) >= 6
    prof = {k: v for k, v in load_profile(PROFILES / "local-traces.json").items() if k in ("costs", "device", "node")}
    after = _mape(held, prof)
    before = _mape(held, None)
    assert after < HELDOUT_MAPE_MAX
    assert after < 0.6 * before  # calibration helps a lot


def test_the_recording_of_the_executor_as_it_runs_today_is_predicted_with_its_loops_idle():
    """traces/local-sched-idle (gloo's event loops at SCHED_IDLE, each rank's CPU timed): its traces
    say so, its trace profile holds it, it predicts the held-out runs, and the ZeRO-3 family (whose
    collectives run beside computing ranks) is predicted closer with the loops' copy at idle priority
    than with the loops modelled as gloo starts them."""
    here = ROOT / "traces" / "local-sched-idle"
    runs = json.loads((here / "manifest.json").read_text())["runs"]
    prof = {k: v for k, v in load_profile(PROFILES / "local-sched-idle-traces.json").items()
            if k in ("costs", "device", "node")}
    assert prof["costs"]["gloo_loops_idle"] is True
    held = [r for r in runs if r["role"] == "heldout"]
    cases = load_cases([here / r["file"] for r in held])
    assert all(c.loops_idle and c.main_cpu_s for c in cases)

    def err(case) -> float:
        return abs(predict_case(case, LOCAL, prof, trace=False).step_time_s / case.step_s - 1.0)

    assert statistics.fmean(err(c) for c in cases) < HELDOUT_MAPE_MAX
    zero3 = [c for c, r in zip(cases, held) if r["name"] in ("dp4-z3", "hsdp", "dp2-yafsdp")]
    assert len(zero3) == 9
    idle = statistics.fmean(err(c) for c in zero3)
    for c in zero3:
        c.loops_idle = False
    assert idle < statistics.fmean(err(c) for c in zero3)


def test_recorded_microbenchmarks_fit_again():
    raw = load_json(DIR / "microbench.json.gz", "micro-benchmarks")
    sections, report = fit_microbench(raw["extras"], LOCAL, measured_background=raw.get("background"))
    c, d, n = sections["costs"], sections["device"], sections["node"]
    assert c["cores_shared"] and n["cpu_cores"] >= 1
    assert 1e-7 < d["launch_overhead_s"] < 1e-4  # a dispatched PyTorch operator: microseconds
    assert 1e9 < d["peak_flops"]["fp32"] < 1e13
    assert 1.0 <= c["compute_contention"] <= 3.0
    assert all(v > 0 for v in (c["instr_overhead_s"], n["intra_latency_s"], n["intra_bw"]))
    assert abs(report["gemm"]["rel_err"][-1]) < 0.3
    assert c["gloo_loops_idle"] is False  # recorded before the benchmarks counted their idled loops
    assert c["collective_issue_s"] == LOCAL.costs.collective_issue_s == 0.0  # nor timed a call alone


def test_benchmarks_that_ran_gloos_loops_idle_are_fitted_so(monkeypatch):
    """The collectives' fit simulates the benchmarks with the event loops as they ran, and the profile
    says so; every rank must have idled its loops. Benchmarks that timed a collective's call alone
    (`issue`) give the profile its CPU on the calling thread."""
    import simexec.calibrate.micro as cm

    raw = load_json(DIR / "microbench.json.gz", "micro-benchmarks")
    seen = []
    real = cm.fit_comm
    monkeypatch.setattr(cm, "fit_comm", lambda *a, **k: seen.append(a[3].costs.gloo_loops_idle) or real(*a, **k))
    idled = {r: {**ex, "gloo_loops_idled": 3} for r, ex in raw["extras"].items()}
    calls = {"verb": "allreduce", "n": 2, "bytes": 8192.0, "cpu": [61e-6, 58e-6, 90e-6]}
    idled["0"] = {**idled["0"], "results": {**idled["0"]["results"], "issue": [calls]}}
    sections, report = fit_microbench(idled, LOCAL, measured_background=raw.get("background"))
    assert seen == [True] and sections["costs"]["gloo_loops_idle"] is True and report["gloo_loops_idle"] is True
    assert sections["costs"]["collective_issue_s"] == pytest.approx(61e-6)  # the calls' median
    one_left = {**idled, "0": {**idled["0"], "gloo_loops_idled": 0}}
    assert cm.gloo_loops_idle(one_left) is False and cm.gloo_loops_idle(raw["extras"]) is False


def test_a_recording_becomes_a_validation_directory_to_refit(tmp_path):
    """`validate_calibration.py --refit traces/local` starts from the recording: every run, its trace
    copied beside it, the raw micro-benchmarks and their profile."""
    from simexec.calibrate.evaluate import from_recording, load_outcome

    out = from_recording(DIR, tmp_path / "v")
    outcome = load_outcome(out)
    runs = manifest()["runs"]
    assert len(outcome.runs) == len(runs)
    assert {r.spec.role for r in outcome.runs} == {"calibrate", "heldout"}
    assert all(Path(r.trace_path).is_file() and Path(r.trace_path).parent == out / "traces" for r in outcome.runs)
    assert outcome.runs[0].step_s == runs[0]["step_time_s"]
    assert (out / "microbench.json.gz").is_file() and "microbench" in outcome.profiles


@pytest.mark.parametrize("manifest_text,message", [
    ('{"runs": [{"name": "x"}], "summary": {}}', "lacks"),
    ('{"runs": [{"name": "dp1", "model": "gpt-tiny", "plan": "dp=1", "role": "calibrate", "file": "nope.json.gz"}]}',
     "nope.json.gz is not in"),
])
def test_a_broken_recording_is_refused_in_one_line(tmp_path, manifest_text, message):
    from simexec.calibrate.profiles import CalibrationError
    from simexec.calibrate.evaluate import from_recording

    (tmp_path / "rec").mkdir()
    (tmp_path / "rec" / "manifest.json").write_text(manifest_text)
    with pytest.raises(CalibrationError, match=message):
        from_recording(tmp_path / "rec", tmp_path / "out")


def validate_calibration(*args: str):
    """`scripts/validate_calibration.py` refusing its flags: (exit status, stderr lines)."""
    code, _, err = probe("validate_calibration.py", *args)
    return code, err.strip().splitlines()


def test_validate_calibration_refuses_an_unknown_trace_parameter_in_one_line():
    """`--trace-params` names what the trace fit moves; a name no fit knows is refused before anything
    is read or measured."""
    code, err = validate_calibration("--refit", str(DIR), "--trace-params", "op,bandwidth")
    assert code == 2
    assert len(err) == 1 and "unknown bandwidth;" in err[0] and "intra_bw" in err[0]


@pytest.mark.parametrize("cost,message", [
    ("bandwidth=1", "no numeric costs field 'bandwidth'; known:"),
    ("idle_poll_s=soon", "could not convert string to float"),
    ("idle_poll_s=-1", "idle_poll_s: Input should be greater than 0"),
])
def test_validate_calibration_refuses_a_bad_cost_in_one_line(cost, message):
    """`--cost NAME=VALUE` sets a number of the preset's costs for a what-if; a name it does not have,
    a value that is not a number or one outside the field's bounds is refused before anything is read."""
    code, err = validate_calibration("--refit", str(DIR), "--cost", cost)
    assert code == 2
    assert len(err) == 1 and message in err[0]


def test_validation_measures_again_after_a_stop_for_noise(tmp_path, monkeypatch):
    """`--attempts N` (`run_validation_retrying`) measures again, `--retry-after` seconds after each stop
    of `--max-noise`, up to N measurements; the last stop is raised. Other errors are not tried again."""
    from simexec.calibrate import evaluate
    from simexec.calibrate.profiles import CalibrationError
    from simexec.calibrate.evaluate import UnsteadyHostError, run_validation_retrying

    calls, slept, said = [], [], []

    def unsteady(out, specs, **kw):
        calls.append(kw["max_noise"])
        raise UnsteadyHostError(f"the host is too unsteady to judge the simulator: attempt {len(calls)}")

    monkeypatch.setattr(evaluate, "run_validation", unsteady)
    kw = dict(attempts=3, retry_after_s=7.0, sleep=slept.append, progress=said.append, max_noise=0.05)
    with pytest.raises(UnsteadyHostError, match="attempt 3$"):
        run_validation_retrying(tmp_path, **kw)
    assert calls == [0.05] * 3 and slept == [7.0, 7.0]
    assert sum("measuring again in 7 s" in line for line in said) == 2

    def broken(out, specs, **kw):
        calls.append(kw["max_noise"])
        raise CalibrationError("the plan matrix needs runnable calibration and held-out plans")

    calls.clear(), slept.clear()
    monkeypatch.setattr(evaluate, "run_validation", broken)
    with pytest.raises(CalibrationError, match="the plan matrix"):
        run_validation_retrying(tmp_path, **kw)
    assert len(calls) == 1 and not slept


@pytest.mark.parametrize("args,message", [
    (["--attempts", "2"], "--attempts 2 needs --max-noise"),
    (["--attempts", "2", "--max-noise", "5", "--refit", "DIR"], "--attempts 2 needs --max-noise and a measurement"),
    (["--attempts", "2", "--max-noise", "5", "--retry-after", "-1"], "--retry-after -1: expected seconds >= 0"),
])
def test_validate_calibration_refuses_retries_it_cannot_make_in_one_line(args, message):
    code, err = validate_calibration(*[a if a != "DIR" else str(DIR) for a in args])
    assert code == 2
    assert len(err) == 1 and message in err[0]


def test_validate_calibration_attempts_must_be_a_whole_number():
    code, err = validate_calibration("--attempts", "0")
    assert code == 2 and "expected a whole number >= 1, got '0'" in err[-1]


GPU = ROOT / "traces" / "gpu"


def _gpu_steps_plan_names() -> set[str]:
    """The plan names `scripts/gpu_steps.py` records (its `PLANS`), read from its source, not imported."""
    import ast

    tree = ast.parse((ROOT / "scripts" / "gpu_steps.py").read_text())
    plans = next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "PLANS")
    return {ast.literal_eval(t.elts[0]) for t in plans.elts}


def test_h100_trace_profile_predicts_the_held_out_gpu_steps_better_than_the_datasheet():
    """The executor's steps on one H100 (traces/gpu/steps, scripts/gpu_steps.py): the traces rebuild
    their models from the specs they carry (Hugging Face configs, no preset name), and the profile
    fitted to the calibration plans' traces halves the datasheet preset's error on the held-out ones."""
    cluster = get_cluster(str(GPU / "h100-1gpu.yaml"))
    runs = json.loads((GPU / "steps" / "manifest.json").read_text())["runs"]
    assert {r["name"] for r in runs} == _gpu_steps_plan_names()
    profile = load_profile(PROFILES / "h100-traces.json")
    fitted = {Path(t).name.removesuffix(".json.gz") for t in profile["fit"]["traces"]}
    held = [r for r in runs if r["name"] not in fitted and not r.get("error")]
    assert len(held) >= 3 and fitted <= {r["name"] for r in runs}
    machine = profile["machine"]  # the traces' (the executor names the `device`), else the kernel profile's
    assert (machine.get("device") or machine.get("gpu")).startswith("NVIDIA H100")
    errs = {"datasheet": [], "traces": []}
    for r in held:
        case = load_cases([GPU / "steps" / f"{r['name']}.json.gz"])[0]
        assert case.model.name == Path(r["model"]).stem
        for label, prof in (("datasheet", None), ("traces", profile)):
            errs[label].append(abs(predict_case(case, cluster, prof, trace=False).step_time_s / case.step_s - 1))
    assert statistics.fmean(errs["traces"]) < 0.6 * statistics.fmean(errs["datasheet"])


def test_every_recorded_gpu_step_compares_with_the_current_simulator():
    """docs/gpu_steps.md's table compares each recorded step with a prediction event by event: every
    recording must still be of the program the simulator lowers today (the instructions that ran:
    `program_executed`). A change to those instructions needs the steps recorded again on a GPU
    (`scripts/gpu_steps.py run`)."""
    from simexec.trace.compare import compare
    from simexec.sim.simulate import simulate
    from simexec.trace.schema import Trace

    runs = json.loads((GPU / "steps" / "manifest.json").read_text())["runs"]
    assert runs
    for r in runs:
        measured = Trace.load(GPU / "steps" / f"{r['name']}.json.gz")
        predicted = simulate(str(ROOT / r["model"]), str(GPU / "h100-1gpu.yaml"), r["plan"], r["seq_len"],
                             symmetric=False, trace=True).trace
        assert compare(predicted, measured).overall["count"] == len(measured.events), r["name"]


def test_the_gpu_trace_fit_finds_the_hosts_adam_rate_only_from_an_offloading_plan():
    """The host's Adam rate is among the trace fit's parameters where a calibration plan offloads its
    optimizer (the recorded H100 profile), and the fitted rate prices that plan's host step."""
    cases = {c.plan: c for c in load_cases([GPU / "steps" / f"{n}.json.gz" for n in ("tl-offload", "tl-mbs4")])}
    assert [c.offloads for c in cases.values()] == [True, False]
    profile = load_profile(PROFILES / "h100-traces.json")
    rate = profile["fit"]["params"]["cpu_adam"]
    assert profile["node"]["cpu_optimizer_params_per_s"] == pytest.approx(rate)
    assert rate < get_cluster(str(GPU / "h100-1gpu.yaml")).node.cpu_optimizer_params_per_s  # a slower host


def test_time_split_sums_compute_and_communication_of_matching_events():
    """`probe_traces.py time-split`: one rank alone has no communication and its compute is predicted to
    within the recorded profile's accuracy; a data-parallel plan's collectives are summed apart."""
    from simexec.trace.schema import Trace

    profile = load_profile(PROFILES / "local-traces.json")
    for name, has_comm in (("dp1.r1", False), ("dp4.r1", True)):
        trace = Trace.load(DIR / f"{name}.json.gz")
        predicted = predict_case(load_cases([DIR / f"{name}.json.gz"])[0], LOCAL, profile, trace=True).trace
        parts = host_probes.time_split(trace, predicted)
        measured_compute = sum(e.dur_us for e in trace.events if e.kind == "compute")
        assert parts["compute"][0] == pytest.approx(measured_compute)
        assert (parts["comm"][0] > 0) == has_comm
        if not has_comm:
            assert parts["compute"][1] == pytest.approx(parts["compute"][0], rel=0.1)


def test_trace_sharing_counts_the_ranks_computing_at_once():
    """`probe_traces.py trace-sharing`: two ranks whose 1 ms compute events overlap for 0.5 ms compute 4/3 at
    a time on average over the 1.5 ms that either does; on the recording, one rank alone computes one
    at a time and the four ranks of `dp=4` more than two. A collective's members wait for the last
    to call it."""
    import gzip

    def ev(pid: int, ts: float, dur: float) -> dict:
        return {"ph": "X", "pid": pid, "ts": ts, "dur": dur, "args": {"kind": "compute", "phase": "fwd", "mb": 0}}

    got = host_probes.plan_sharing({"traceEvents": [ev(0, 0.0, 1000.0), ev(1, 500.0, 1000.0)]})
    assert got["computing"] == pytest.approx(2000.0 / 1500.0) and got["ranks"] == 2
    assert got["compute_ms"] == pytest.approx(1.0) and got["span_ms"] == pytest.approx(1.5)
    assert got["compute_step_ms"] == pytest.approx(1.0)  # 2 ms of compute over two ranks
    # one all-reduce name, two groups: members end 1 ms apart in one and 0.5 ms in the other
    coll = [{"ph": "X", "pid": r, "name": "c", "ts": 0.0, "dur": end, "args": {"kind": "collective"}}
            for r, end in ((0, 1000.0), (1, 2000.0), (2, 5000.0), (3, 5500.0))]
    groups = {(r, "c"): (0, 1) if r < 2 else (2, 3) for r in range(4)}
    trace = {"traceEvents": [ev(0, 0.0, 1000.0)] + coll}
    assert host_probes.plan_sharing(trace, groups)["ends_apart_ms"] == pytest.approx(0.75)
    assert host_probes.plan_sharing(trace)["ends_apart_ms"] == pytest.approx(4.5)
    assert host_probes.plan_sharing(trace, groups)["late_wait_ms"] == 0.0  # every member called at 0
    # the first group's second member calls 2 ms late: its first waits 2 ms, 1 ms a member, 0.5 ms a
    # collective over both groups, and 4 ms of waiting over 4 ranks in the step
    coll[1] = {**coll[1], "ts": 2000.0}
    late = host_probes.plan_sharing({"traceEvents": [ev(0, 0.0, 1000.0)] + coll}, groups)
    assert late["late_wait_ms"] == pytest.approx(0.5) and late["late_wait_step_ms"] == pytest.approx(0.5)
    cases = {}
    for name, lo, hi in (("dp1.r1", 1.0, 1.0), ("dp4.r1", 2.0, 4.0)):
        with gzip.open(DIR / f"{name}.json.gz", "rt") as fh:
            trace = json.load(fh)
        computing = host_probes.plan_sharing(trace)["computing"]
        assert lo - 1e-9 <= computing <= hi + 1e-9
        cases[name] = host_probes.measured_case(trace, name)
    from simexec.trace.late_waits import collective_groups
    from simexec.trace.schema import Trace

    assert set(collective_groups(Trace.load(DIR / "dp4.r1.json.gz")).values()) == {(0, 1, 2, 3)}
    # the prediction of the same run: one rank alone at its own compute; dp=4's ranks all at once
    profile = json.loads((ROOT / "traces" / "profiles" / "local-traces.json").read_text())
    one = host_probes.predicted_sharing(cases["dp1.r1"], profile)
    assert one["computing"] == pytest.approx(1.0) and one["ranks"] == 1
    four = host_probes.predicted_sharing(cases["dp4.r1"], profile)
    assert four["ranks"] == 4 and four["computing"] == pytest.approx(4.0, rel=0.05)
    assert four["ends_apart_ms"] == 0.0  # a collective ends for all its members at once
    assert four["late_wait_ms"] == 0.0  # and its members, computing in step, call it at once
    assert one["cores_busy"] == pytest.approx(1.0, rel=1e-3)  # one rank alone holds a core all its step
    assert 1.5 < four["cores_busy"] <= 2.0 + 1e-9  # four ranks on two cores, never more than both
    # a run that timed its CPU: two ranks of 30 and 50 ms a step (the second half) over 40 ms steps
    summary = {"step_times_s": [0.5] * 8 + [0.04] * 8,
               "cpu_times_s_per_rank": {"0": [0.5] * 8 + [0.03] * 8, "1": [0.5] * 8 + [0.05] * 8}}
    assert host_probes.cores_busy({"traceEvents": [], "metadata": {"summary": summary}}) == pytest.approx(2.0)
    assert math.isnan(host_probes.cores_busy({"traceEvents": [], "metadata": {"summary": {"step_times_s": [0.04] * 16}}}))


def test_trace_sharing_refuses_a_missing_profile_in_one_line():
    code, _, err = probe_traces("trace-sharing", str(DIR), "--profile", "/nonexistent/profile.json")
    assert code == 2
    err = err.strip()
    assert err.startswith("probe_traces.py trace-sharing: error:") and "\n" not in err and "profile.json" in err


def test_collective_joins_times_a_collective_from_its_last_member_on():
    """`probe_traces.py collective-joins`: members that issue at 0 and 2 ms and end at 5 and 6 ms took a median
    3.5 ms once the last had joined; two groups that call it under one name are timed apart; on the
    recording, `dp=2`'s gradient all-reduce is found on both ranks, positive, and the script's report
    names its micro-benchmark."""
    from simexec.trace.schema import Event, Trace

    def ev(rank: int, start_ms: float, end_ms: float) -> Event:
        return Event(id=f"{rank}:bwd.grads0", rank=rank, stream="comm.dp", name="bwd.grads0", kind="collective",
                     op="allreduce@dp", start_us=start_ms * 1e3, dur_us=(end_ms - start_ms) * 1e3, bytes=4096.0)

    got = host_probes.collective_joins([ev(0, 0.0, 5.0), ev(1, 2.0, 6.0)], "comm.dp", ("bwd.grads",))
    assert got == [("bwd.grads0", "allreduce", 2, 4096, pytest.approx(3.5))]
    # two groups under one name, each timed from its own last member
    four = [ev(0, 0.0, 5.0), ev(1, 2.0, 6.0), ev(2, 10.0, 11.0), ev(3, 10.0, 12.0)]
    groups = {(r, "bwd.grads0"): (0, 1) if r < 2 else (2, 3) for r in range(4)}
    got = host_probes.collective_joins(four, "comm.dp", ("bwd.grads",), groups)
    assert [(m, ms) for _, _, m, _, ms in got] == [(2, pytest.approx(3.5)), (2, pytest.approx(1.5))]
    trace = Trace.load(DIR / "dp2.r1.json.gz")
    (name, verb, members, nbytes, ms), = host_probes.collective_joins(trace.events, "comm.dp", ("bwd.grads",))
    assert verb == "allreduce" and members == 2 and nbytes > 0 and ms > 0
    alone = host_probes.bench_alone(DIR, "allreduce", 2, nbytes)
    assert alone is not None and alone[0] > 0 and alone[2] == 1 << 20
    assert probe_traces("collective-joins", str(DIR))[0] == 0
    assert probe_traces("collective-joins", str(DIR), "--stream", "comm.nowhere")[0] == 2


def test_issue_cost_prices_each_kind_of_collective_as_the_simulator_charges_it():
    """`probe_host.py issue-cost`: the model columns are `issue_split` per kind of collective (a ZeRO-3
    gather of one gpt-tiny layer: the Python around it before the call, once waited the Python again
    and a pass of two operators over each of its 16 tensors); a warm-up longer than the run is refused
    with a one-line error."""
    profile = ROOT / "traces" / "profiles" / "local-microbench.json"
    prof = json.loads(profile.read_text())
    prices = host_probes.issue_prices("gpt-tiny", "dp=4,zero=3,gbs=8,dtype=fp32", str(profile))
    python = prof["costs"]["instr_overhead_s"]
    layer = (python, python + 2 * 16 * prof["device"]["launch_overhead_s"])
    assert set(prices) == {"gather", "grads"} and prices["gather"] == pytest.approx(layer)
    assert host_probes.collective_kind("grads12") == "grads" and host_probes.collective_kind("grads_rep0") == "grads_rep"
    assert probe_host("issue-cost", "--steps", "3")[0] == 2


def test_tensor_passes_times_each_kind_of_pass_and_refuses_an_empty_one():
    """`probe_host.py tensor-passes`: a per-tensor time for each kind of pass the host model counts (or
    leaves out); a pass over no tensors is refused with a one-line error."""
    code, out, err = probe_host("tensor-passes", "--tensors", "4", "--shape", "8,8", "--repeats", "5")
    assert code == 0, err[-2000:]
    times = [float(line.split()[-4]) for line in out.splitlines() if line.endswith("µs a tensor")]
    assert len(times) == 4 and all(us > 0 for us in times)
    code, _, err = probe_host("tensor-passes", "--tensors", "0")
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--tensors" in err[0]


def test_wake_cpu_times_the_main_threads_cpu_per_wait_and_refuses_bad_flags():
    """`probe_host.py wake-cpu`: two gloo ranks, each loop's wall and main-thread CPU per iteration, and
    what the all-reduce and the sleep add; nonsense flags are refused in one line."""
    import subprocess
    import sys

    script = str(ROOT / "scripts" / "probe_host.py")
    out = subprocess.run([sys.executable, script, "wake-cpu", "--iters", "3", "--rounds", "1"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["1"], ["4"], ["16"])]
    assert [(r[0], r[1]) for r in rows] == [(k, m) for k in ("1", "4", "16") for m in ("none", "allreduce", "sleep")]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows) and all(len(r) == 5 for r in rows if r[1] != "none")
    bad = subprocess.run([sys.executable, script, "wake-cpu", "--ranks", "1"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--ranks >= 2" in bad.stderr.strip().splitlines()[-1]


def test_recording_cpu_sets_each_plans_predicted_cpu_beside_the_measured(tmp_path):
    """`probe_traces.py recording-cpu`: per plan of a recording that timed its ranks' CPU, the main thread's
    and every thread's CPU a step and the cores busy, predicted and measured; a directory without a
    manifest is refused in one line."""
    here = ROOT / "traces" / "local-sched-idle"
    prof = {k: v for k, v in load_profile(PROFILES / "local-sched-idle-traces.json").items()
            if k in ("costs", "device", "node")}
    (row,) = host_probes.recording_cpu_rows(here, prof, ("dp2",))
    p, m = row["predicted"], row["measured"]
    assert 0 < m["main_thread_s"] <= m["per_rank_s"] and 0 < p["main_thread_s"] <= p["per_rank_s"]
    assert 0.5 < p["main_thread_s"] / m["main_thread_s"] < 2 and 1 < m["cores_busy"] <= 2
    code, out, _ = probe_traces("recording-cpu", "--plans", "dp2")
    assert code == 0 and "dp2" in out
    code, _, err = probe_traces("recording-cpu", str(tmp_path))
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "manifest.json" in err[0]
    code, _, err = probe_traces("recording-cpu", "--profile", str(tmp_path / "none.json"), "--plans", "dp2")
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "none.json" in err[0]
