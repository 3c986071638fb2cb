"""Held-out accuracy of the simulator on this machine: measure a matrix of plans, calibrate on some,
predict the others before and after calibration. Shared by `scripts/validate_calibration.py` and
`simexec.demo`.

A plan is measured `rounds` times (interleaved with the other plans, so that a burst of load on the
host does not hit one plan only); its measured step time is the median over the rounds of each run's
steady-state step time (`simexec.trace.schema.steady_step`: the median of its last half of
steps). Every run records the cores' worth of CPU the host's other users took meanwhile
(`background`), and predictions of that run take it as the host model's `background_load`: the
simulator predicts the plan under the conditions it ran in, not under some other moment's. The
spread between rounds of one plan is the noise floor of any prediction on this machine, and is
reported with the errors.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from simexec.calibrate.profiles import CalibrationError, jsonable, make_profile, now_iso, profiled_cluster, save_profile
from simexec.calibrate.micro import measure_microbench, microbench_profile
from simexec.calibrate.traces import TRACE_PARAMS, TraceCase, fit_traces, predict_case, trace_case
from simexec.specs.cluster import ClusterSpec, get_cluster
from simexec.trace.schema import steady_step

STEPS = 16  # per run: the median of the last eight is its step time (`steady_step`)


@dataclass(frozen=True)
class PlanSpec:
    name: str  # short label for tables
    model: str
    plan: str
    role: str  # "calibrate" or "heldout"
    dims: str = ""  # the plan dimensions it exercises


def _p(name, plan, role, dims, model="gpt-tiny") -> PlanSpec:
    return PlanSpec(name, model, f"{plan},gbs=8,dtype=fp32", role, dims)


# Every plan dimension the executor runs, on the tiny models; calibration plans on one side,
# held-out plans (other combinations, schedules and dimensions) on the other.
MATRIX: tuple[PlanSpec, ...] = (
    _p("dp1", "dp=1", "calibrate", "single rank"),
    _p("dp4", "dp=4", "calibrate", "dp"),
    _p("tp2", "tp=2", "calibrate", "tp"),
    _p("dp2-tp2", "dp=2,tp=2", "calibrate", "dp x tp"),
    _p("pp4", "pp=4", "calibrate", "pp 1f1b"),
    _p("dp4-z1", "dp=4,zero=1", "calibrate", "zero 1"),
    _p("dp2-rcf", "dp=2,recompute=full", "calibrate", "recompute full"),
    _p("dp2-pp2", "dp=2,pp=2", "calibrate", "dp x pp"),
    _p("dp2", "dp=2", "heldout", "dp"),
    _p("tp4", "tp=4", "heldout", "tp"),
    _p("pp2", "pp=2", "heldout", "pp 1f1b"),
    _p("pp4-gpipe", "pp=4,schedule=gpipe", "heldout", "pp gpipe"),
    _p("pp2-vpp2", "pp=2,vpp=2", "heldout", "pp interleaved"),
    _p("dp4-z2", "dp=4,zero=2", "heldout", "zero 2"),
    _p("dp4-z3", "dp=4,zero=3", "heldout", "zero 3 (fsdp)"),
    _p("dp2-yafsdp", "dp=2,zero=3,zero_impl=yafsdp", "heldout", "zero 3 (yafsdp)"),
    _p("hsdp", "dp=4,zero=3,dp_shard=2", "heldout", "hsdp"),
    _p("dp2-tp2-rcs", "dp=2,tp=2,recompute=selective", "heldout", "tp + recompute selective"),
    _p("dp2-offload", "dp=2,offload=optimizer", "heldout", "offload"),
    _p("moe-ep2", "dp=4,ep=2", "heldout", "ep (MoE)", model="moe-tiny"),
    _p("dp2-tp2-sp", "dp=2,tp=2,sp=1", "heldout", "sp"),
    _p("cp2", "dp=2,cp=2", "heldout", "cp"),
)

# The demo's calibration plans hold each way the ranks share the cores that its held-out plans
# have (one rank alone, one rank per core, two per core): from dp=1 and dp=4 alone the trace fit
# cannot tell the compute contention of two ranks from the cost of four on two cores.
DEMO: tuple[PlanSpec, ...] = (
    _p("dp1", "dp=1", "calibrate", "single rank"),
    _p("dp4", "dp=4", "calibrate", "dp"),
    _p("dp2-rcf", "dp=2,recompute=full", "calibrate", "recompute full"),
    _p("tp2", "tp=2", "calibrate", "tp"),
    _p("pp4", "pp=4", "calibrate", "pp"),
    _p("dp2", "dp=2", "heldout", "dp"),
    _p("dp2-tp2", "dp=2,tp=2", "heldout", "dp x tp"),
    _p("dp4-z1", "dp=4,zero=1", "heldout", "zero 1"),
    _p("pp2", "pp=2", "heldout", "pp"),
)


def runnable(specs: Sequence[PlanSpec]) -> tuple[list[PlanSpec], dict[str, str]]:
    """The plans the executor can run now, and why the others are left out."""
    from simexec.exec.rank.unsupported_plans import unsupported
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve

    ok, skipped = [], {}
    for s in specs:
        try:
            rp = resolve(get_model(s.model), get_cluster("local"), load_plan(s.plan))
            why = unsupported(rp)
        except Exception as exc:  # noqa: BLE001 - an invalid plan is skipped with its reason
            why = str(exc).splitlines()[0]
        if why:
            skipped[s.name] = why
        else:
            ok.append(s)
    return ok, skipped


# --- measuring -------------------------------------------------------------------------------------
@dataclass
class Run:
    """One execution of one plan."""

    spec: PlanSpec
    round: int
    trace_path: str
    step_s: float
    steps_s: list[float]
    peak: dict[int, float]
    background: Optional[float]


def measure(session, specs: Sequence[PlanSpec], out_dir: Path, *, rounds: int = 1, steps: int = STEPS,
            tick: Optional[Callable[[str], None]] = None,
            between_rounds: Optional[Callable[[int], None]] = None,
            after_round: Optional[Callable[[int, list[Run]], None]] = None) -> list[Run]:
    """Execute every plan `rounds` times (round by round), saving each trace under out_dir;
    `after_round(r, runs so far)` runs after every round, then `between_rounds(r)` after every
    round but the last."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    warm_up(session, specs, tick)
    runs = []
    for r in range(rounds):
        for s in specs:
            m = session.execute(s.model, s.plan, steps=steps)
            suffix = f".r{r}" if rounds > 1 else ""
            path = out_dir / f"{s.name}{suffix}.json.gz"
            m.result.trace.save(path)
            runs.append(Run(s, r, str(path), float(steady_step(m.result.step_times_s, m.result.step_time_s)),
                            [float(x) for x in m.result.step_times_s],
                            {int(k): float(v) for k, v in m.result.peak_memory_bytes_per_rank.items()},
                            m.background))
            if tick is not None:
                tick(f"{s.name} {m.result.step_time_s * 1e3:.0f} ms")
        if after_round is not None:
            after_round(r, runs)
        if between_rounds is not None and r < rounds - 1:
            between_rounds(r)
    return runs


def by_plan(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs of each plan, in the order measured."""
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.spec.name, []).append(r)
    return by


def typical_runs(runs: Sequence[Run]) -> list[Run]:
    """Per plan, the round whose step time is the median of its rounds (the lower of the middle two
    for an even count): the run that stands for the plan where one trace per plan is wanted. A host
    shared with other virtual machines slows a whole run now and then (one round's compute 50%
    longer than the next's), and the median round leaves those out."""
    return [sorted(rs, key=lambda r: r.step_s)[(len(rs) - 1) // 2] for rs in by_plan(runs).values()]


def world_of(spec: PlanSpec) -> int:
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve

    return resolve(get_model(spec.model), get_cluster("local"), load_plan(spec.plan)).world


def warm_up(session, specs: Sequence[PlanSpec], tick: Optional[Callable[[str], None]] = None) -> None:
    """One short, discarded run per world size: a fresh set of rank actors spends its first run's
    steps on lazy initialisation (gloo's connections, allocator pools, the interpreter's caches),
    several steps long, which no plan's step should carry."""
    seen: set[int] = set()
    for s in specs:
        w = world_of(s)
        if w in seen:
            continue
        seen.add(w)
        session.execute(s.model, s.plan, steps=4)
        if tick is not None:
            tick(f"warm-up of {w} rank(s)")


# --- predicting ------------------------------------------------------------------------------------
def case_of(run: Run) -> TraceCase:
    from simexec.trace.schema import Trace

    return trace_case(Trace.load(run.trace_path), run.trace_path)


def predict_run(run: Run, cluster: ClusterSpec, profile: Optional[dict]) -> tuple[float, dict[int, float]]:
    """(step time, peak memory per rank) the simulator predicts for this run's plan and conditions."""
    res = predict_case(case_of(run), cluster, profile, trace=False)
    return res.step_time_s, {int(r): float(b) for r, b in res.peak_memory_bytes_per_rank.items()}


def fit_memory(runs: Sequence[Run], cluster: ClusterSpec, profile: dict) -> dict:
    """Calibrate the memory model's free number to measured peaks: `workspace_bytes`, the bytes per
    rank the executor holds beyond the model's categories (the median gap over the runs;
    `allocator_overhead` 0: CPU tensors are not cached by an allocator). With the executor holding
    what Megatron holds (docs/executor.md, "Memory") the gap is the backward's temporaries, mostly
    the LM head's weight-gradient: about one logits-sized tensor (0.13 MB on gpt-tiny)."""
    import numpy as np

    from simexec.sim.simulate import simulate

    rows, ys = [], []
    base = json.loads(json.dumps(profile))
    base.setdefault("costs", {}).update({"workspace_bytes": 0.0, "allocator_overhead": 0.0})
    for run in runs:
        case = case_of(run)
        res = simulate(case.model, profiled_cluster(cluster, base), case.plan, case.seq_len, symmetric=False)
        b = res.memory_breakdown_bytes
        dyn = b.get("activations", 0.0) + b.get("buffers", 0.0) + b.get("workspace", 0.0)
        rows.append([1.0, dyn])
        ys.append(max(run.peak.values()) - res.peak_memory_bytes)
    if not rows:
        return profile
    # The executor's extra bytes over the model's are partly structural (see docs/host_model.md,
    # "What the model leaves out"): a robust constant (the median gap) rather than a least-squares
    # pair that one structural outlier would drag.
    ws, alloc = max(0.0, float(np.median(ys))), 0.0
    out = json.loads(json.dumps(profile))
    out.setdefault("costs", {}).update({"workspace_bytes": ws, "allocator_overhead": alloc})
    return out


@dataclass
class Row:
    name: str
    role: str
    dims: str
    plan: str
    model: str
    measured_s: float
    rounds_s: list[float]
    background: Optional[float]
    measured_peak: float
    predicted_s: dict[str, float] = field(default_factory=dict)
    predicted_peak: dict[str, float] = field(default_factory=dict)

    def err(self, which: str) -> float:
        return self.predicted_s[which] / self.measured_s - 1.0

    def mem_err(self, which: str) -> float:
        return self.predicted_peak[which] / self.measured_peak - 1.0


def evaluate(runs: Sequence[Run], cluster: ClusterSpec, profiles: dict[str, Optional[dict]]) -> list[Row]:
    """Per plan: measured (median over rounds) and each profile's prediction (median over rounds of
    the prediction under that round's background)."""
    rows = []
    for name, rs in by_plan(runs).items():
        s = rs[0].spec
        bgs = [r.background for r in rs if r.background is not None]
        row = Row(name, s.role, s.dims, s.plan, s.model, statistics.median(r.step_s for r in rs),
                  [r.step_s for r in rs], statistics.fmean(bgs) if bgs else None,
                  statistics.median(max(r.peak.values()) for r in rs))
        for label, prof in profiles.items():
            preds = [predict_run(r, cluster, prof) for r in rs]
            row.predicted_s[label] = statistics.median(p[0] for p in preds)
            row.predicted_peak[label] = statistics.median(max(p[1].values()) for p in preds)
        rows.append(row)
    return rows


def mape(rows: Sequence[Row], which: str, role: str = "heldout") -> float:
    xs = [abs(r.err(which)) for r in rows if r.role == role]
    return statistics.fmean(xs) if xs else float("nan")


def mem_worst(rows: Sequence[Row], which: str, role: Optional[str] = None) -> float:
    xs = [abs(r.mem_err(which)) for r in rows if role is None or r.role == role]
    return max(xs) if xs else float("nan")


def spread(groups: Iterable[Sequence[float]]) -> Optional[float]:
    """Mean over the groups of two or more of |x - their median| / median; None without any."""
    xs = []
    for g in groups:
        if len(g) > 1:
            mid = statistics.median(g)
            xs += [abs(x / mid - 1.0) for x in g]
    return statistics.fmean(xs) if xs else None


def repeatability(rows: Sequence[Row], role: Optional[str] = None) -> Optional[float]:
    """Mean over plans of |round - median| / median: how much one plan's runs differ (noise floor)."""
    return spread(r.rounds_s for r in rows if role is None or r.role == role)


def runs_spread(runs: Sequence[Run]) -> Optional[float]:
    """The noise floor of runs measured so far (`repeatability` before any prediction)."""
    return spread([r.step_s for r in rs] for rs in by_plan(runs).values())


class UnsteadyHostError(CalibrationError):
    """A measurement stopped by `noise_guard`: the host, not the inputs, was at fault, so the same
    measurement may pass later (`scripts/validate_calibration.py --attempts`)."""


def noise_guard(limit: Optional[float]) -> Optional[Callable[[int, list[Run]], None]]:
    """An `after_round` hook that stops a measurement, and removes its traces, once its plans'
    rounds differ by more than `limit` (a fraction): on a host that unsteady the table would say
    more about the host than about the simulator, and the fits after it take ten minutes."""
    if limit is None:
        return None

    def check(r: int, runs: list[Run]) -> None:
        noise = runs_spread(runs)
        if noise is None or noise <= limit:
            return
        for run in runs:
            Path(run.trace_path).unlink(missing_ok=True)
        for folder in {Path(run.trace_path).parent for run in runs}:
            if not any(folder.iterdir()):
                folder.rmdir()
        raise UnsteadyHostError(f"the host is too unsteady to judge the simulator: after {r + 1} rounds one "
                               f"plan's rounds differ from their median by {100 * noise:.1f}% on average "
                               f"(limit {100 * limit:.1f}%); nothing was fitted or kept")
    return check


# --- the whole procedure ---------------------------------------------------------------------------
@dataclass
class Outcome:
    rows: list[Row]
    profiles: dict[str, dict]
    skipped: dict[str, str]
    summary: dict
    runs: list[Run]


LABELS = {"before": "before (preset)", "microbench": "after micro-benchmarks", "traces": "after traces"}


def run_validation(out_dir: Path, specs: Sequence[PlanSpec] = MATRIX, *, rounds: int = 3, steps: int = STEPS,
                   quick_bench: bool = False, max_nfev: int = 40, session=None, name: str = "local",
                   progress: Optional[Callable[[str], None]] = None, cluster: Optional[ClusterSpec] = None,
                   trace_params: Optional[Sequence[str]] = None, max_noise: Optional[float] = None) -> Outcome:
    """Micro-benchmark calibration, the plan matrix measured `rounds` times, trace calibration on the
    calibration plans, predictions of every plan before and after each calibration. `trace_params`:
    the parameters the trace fit moves (`simexec.calibrate.profiles.PARAMS` names; its default set without).
    `max_noise`: stop after any round whose noise floor so far is above it (`noise_guard`)."""
    from simexec.calibrate.runs import Session

    out_dir = Path(out_dir)
    tick = progress or (lambda msg: None)
    t0 = time.perf_counter()
    ok, skipped = runnable(specs)
    if not any(s.role == "calibrate" for s in ok) or not any(s.role == "heldout" for s in ok):
        raise CalibrationError("the plan matrix needs runnable calibration and held-out plans")
    cluster = cluster or get_cluster("local")
    own = session is None
    sess = session or Session()
    if own:
        sess.__enter__()
    raws = []

    def bench(_round: Optional[int] = None) -> None:
        tick(f"micro-benchmarks ({len(raws) + 1} of {rounds})")
        raws.append(measure_microbench(sess, 4, quick=quick_bench))

    try:
        bench()  # and again between rounds: the host's speed drifts over minutes, and so do the plans'
        runs = measure(sess, ok, out_dir / "traces", rounds=rounds, steps=steps, tick=tick, between_rounds=bench,
                       after_round=noise_guard(max_noise))
    finally:
        if own:
            sess.__exit__(None, None, None)
    prof_mb = microbench_profile(raws, cluster, out_dir / "profiles" / f"{name}-microbench.json",
                                 name=f"{name}-microbench", quick=quick_bench, raw_path=out_dir / "microbench.json.gz",
                                 wall_s=time.perf_counter() - t0)
    return fit_and_evaluate(out_dir, runs, prof_mb, rounds=rounds, steps=steps, skipped=skipped, max_nfev=max_nfev,
                            name=name, tick=tick, timing={"measure_s": time.perf_counter() - t0, "t0": t0},
                            cluster=cluster, trace_params=trace_params)


def run_validation_retrying(out_dir: Path, specs: Sequence[PlanSpec] = MATRIX, *, attempts: int = 1,
                            retry_after_s: float = 300.0, sleep: Callable[[float], None] = time.sleep,
                            progress: Optional[Callable[[str], None]] = None, **kw) -> Outcome:
    """`run_validation`, measured again `retry_after_s` after each stop for noise (`UnsteadyHostError`),
    up to `attempts` measurements in all: a shared host's busy spell passes, a broken input does not
    (any other error is raised at once)."""
    tick = progress or (lambda msg: None)
    for attempt in range(1, attempts + 1):
        try:
            return run_validation(out_dir, specs, progress=progress, **kw)
        except UnsteadyHostError as exc:
            if attempt == attempts:
                raise
            tick(f"attempt {attempt} of {attempts}: {exc}; measuring again in {retry_after_s:g} s")
            sleep(retry_after_s)
    raise ValueError(f"attempts must be at least 1, got {attempts}")


def refit(out_dir: Path, *, max_nfev: int = 40, name: str = "local",
          progress: Optional[Callable[[str], None]] = None, cluster: Optional[ClusterSpec] = None,
          trace_params: Optional[Sequence[str]] = None) -> Outcome:
    """Fit and predict again from a validation run's products (its raw micro-benchmark timings and its
    traces), measuring nothing: how a change of the cost model moves the same measurements. `cluster`:
    the `local` preset by default (another, e.g. with `costs.cpu_scheduler` "slices", compares models)."""
    from simexec.sim.profile import load_profile
    from simexec.calibrate.micro import fit_microbench
    from simexec.trace.schema import load_json

    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    old = load_outcome(out_dir)
    raw = load_json(out_dir / "microbench.json.gz", "micro-benchmark timings")
    old_mb = load_profile(out_dir / "profiles" / f"{name}-microbench.json")
    cluster = cluster or get_cluster("local")
    sections, report = fit_microbench(raw["extras"], cluster, measured_background=raw.get("background"))
    prof_mb = make_profile(f"{name}-microbench", "microbench", sections["costs"], sections["device"], sections["node"],
                           machine=old_mb.get("machine"), measured_at=old_mb.get("measured_at"),
                           fit={**(old_mb.get("fit") or {}), "report": jsonable(report), "refit": True})
    return fit_and_evaluate(out_dir, old.runs, prof_mb, rounds=old.summary.get("rounds", 1),
                            steps=old.summary.get("steps", STEPS), skipped=old.skipped, max_nfev=max_nfev, name=name,
                            tick=progress or (lambda msg: None),
                            timing={"measure_s": old.summary.get("measure_s", 0.0),
                                    "t0": t0 - old.summary.get("measure_s", 0.0)}, cluster=cluster,
                            trace_params=trace_params)


def fit_and_evaluate(out_dir: Path, runs: Sequence[Run], prof_mb: dict, *, rounds: int, steps: int, skipped: dict,
                     max_nfev: int, name: str, tick: Callable[[str], None], timing: dict,
                     cluster: Optional[ClusterSpec] = None, trace_params: Optional[Sequence[str]] = None
                     ) -> Outcome:
    """The trace fit on the calibration runs (from the micro-benchmark profile), both profiles saved
    under out_dir/profiles, every run predicted before and after each calibration."""
    cluster = cluster or get_cluster("local")
    calib = [r for r in runs if r.spec.role == "calibrate"]
    tick("fitting the traces")
    sections = {k: v for k, v in prof_mb.items() if k in ("costs", "device", "node")}
    sections = fit_memory(calib, cluster, sections)
    prof_mb = {**prof_mb, "costs": sections["costs"]}
    fitted, report = fit_traces([case_of(r) for r in calib], cluster, sections, max_nfev=max_nfev,
                                params=tuple(trace_params or TRACE_PARAMS))
    fitted = fit_memory(calib, cluster, fitted)
    prof_tr = make_profile(f"{name}-traces", "traces", fitted["costs"], fitted.get("device"), fitted.get("node"),
                           machine=prof_mb.get("machine"), measured_at=prof_mb.get("measured_at"),
                           fit={**report, "base": f"{name}-microbench", "fitted_at": now_iso(),
                                "traces": [Path(r.trace_path).name for r in calib]})
    prof_tr = jsonable(prof_tr)
    save_profile(prof_mb, out_dir / "profiles" / f"{name}-microbench.json")
    save_profile(prof_tr, out_dir / "profiles" / f"{name}-traces.json")
    tick("predicting")
    profiles = {"before": None, "microbench": profile_sections(prof_mb), "traces": profile_sections(prof_tr)}
    rows = evaluate(runs, cluster, profiles)
    bgs = [r.background for r in runs if r.background is not None]
    summary = {
        "heldout_mape_before": mape(rows, "before"), "heldout_mape_microbench": mape(rows, "microbench"),
        "heldout_mape_traces": mape(rows, "traces"), "heldout_mape_after": mape(rows, "traces"),
        "calibration_mape_traces": mape(rows, "traces", "calibrate"),
        "peak_memory_worst_error_before": mem_worst(rows, "before"),
        "peak_memory_worst_error_microbench": mem_worst(rows, "microbench"),
        "peak_memory_worst_error_traces": mem_worst(rows, "traces"),
        "repeatability": repeatability(rows), "rounds": rounds, "steps": steps,
        "plans": len(rows), "heldout_plans": sum(r.role == "heldout" for r in rows),
        "background_cores_mean": statistics.fmean(bgs) if bgs else None,
        "machine": prof_mb.get("machine"), "measured_at": prof_mb.get("measured_at"),
        "measure_s": timing["measure_s"], "total_s": time.perf_counter() - timing["t0"], "skipped": skipped,
    }
    return Outcome(rows, {"microbench": prof_mb, "traces": prof_tr}, skipped, summary, runs)


def profile_sections(profile: dict) -> dict:
    """The calibrated sections of a profile (costs, device, node, network): what a cluster takes from it."""
    return {k: v for k, v in profile.items() if k in ("costs", "device", "node", "network")}


# --- reporting -------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:+.1f}%"


def table(rows: Sequence[Row], labels: Sequence[str] = ("before", "microbench", "traces")) -> str:
    head = ["plan", "role", "dimensions", "measured ms"]
    for l in labels:
        head += [f"{l} ms", f"{l} err"]
    head += [f"peak mem err ({labels[0]} / {labels[-1]})"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (r.role != "calibrate", r.name)):
        cells = [f"`{r.plan.replace(',gbs=8,dtype=fp32', '')}`" + (f" ({r.model})" if r.model != "gpt-tiny" else ""),
                 r.role, r.dims, f"{r.measured_s * 1e3:.1f}"]
        for l in labels:
            cells += [f"{r.predicted_s[l] * 1e3:.1f}", _pct(r.err(l))]
        cells += [f"{_pct(r.mem_err(labels[0]))} / {_pct(r.mem_err(labels[-1]))}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def summary_table(summary: dict, labels: Sequence[str] = ("before", "microbench", "traces")) -> str:
    out = ["| | " + " | ".join(LABELS.get(l, l) for l in labels) + " |", "|---|" + "---|" * len(labels)]
    out.append("| held-out step-time MAPE | " + " | ".join(
        f"{100 * summary[f'heldout_mape_{l}']:.1f}%" for l in labels) + " |")
    out.append("| worst peak-memory error (all plans) | " + " | ".join(
        f"{100 * summary[f'peak_memory_worst_error_{l}']:.1f}%" for l in labels) + " |")
    return "\n".join(out)


def save_outcome(outcome: Outcome, out_dir: Path) -> Path:
    data = {"summary": outcome.summary, "rows": [asdict(r) for r in outcome.rows],
            "runs": [{**asdict(r), "spec": asdict(r.spec)} for r in outcome.runs]}
    path = Path(out_dir) / "validation.json"
    from simexec.trace.schema import save_json

    save_json(json.loads(json.dumps(data, default=str)), path)
    return path


def from_recording(traces_dir: Path, out_dir: Path, name: str = "local") -> Path:
    """A validation directory (what `run_validation` leaves) rebuilt from a recording of
    `scripts/record_traces.py` (`traces/<name>`: its manifest, traces and raw micro-benchmark timings,
    with `traces/profiles/<name>-*.json`), so that `refit` can fit and predict the committed
    measurements again without measuring."""
    import shutil

    from simexec.trace.schema import load_json, save_json

    traces_dir, out_dir = Path(traces_dir), Path(out_dir)
    manifest = load_json(traces_dir / "manifest.json", "recording manifest")
    specs = {s.name: s for s in MATRIX}
    (out_dir / "traces").mkdir(parents=True, exist_ok=True)
    (out_dir / "profiles").mkdir(parents=True, exist_ok=True)
    where = traces_dir / "manifest.json"
    runs = []
    try:
        for r in manifest["runs"]:
            spec = specs.get(r["name"]) or PlanSpec(r["name"], r["model"], r["plan"], r["role"], r.get("dims", ""))
            if not (traces_dir / r["file"]).is_file():
                raise CalibrationError(f"recording manifest {where}: its trace {r['file']} is not in {traces_dir}")
            shutil.copy(traces_dir / r["file"], out_dir / "traces" / r["file"])
            runs.append({"spec": asdict(spec), "round": r["round"],
                         "trace_path": str((out_dir / "traces" / r["file"]).resolve()), "step_s": r["step_time_s"],
                         "steps_s": r["step_times_s"], "peak": r["peak_memory_bytes_per_rank"],
                         "background": r.get("background_cores")})
        summary = manifest["summary"]
    except KeyError as exc:
        raise CalibrationError(f"recording manifest {where}: a run or the manifest lacks {exc}") from None
    except TypeError:
        raise CalibrationError(f"recording manifest {where}: `runs` must be a list of objects") from None
    for src, dst in ((traces_dir / "microbench.json.gz", out_dir / "microbench.json.gz"),
                     (traces_dir.parent / "profiles" / f"{name}-microbench.json",
                      out_dir / "profiles" / f"{name}-microbench.json")):
        if not src.is_file():
            raise CalibrationError(f"recording {traces_dir}: {src} is missing (scripts/record_traces.py writes it)")
        shutil.copy(src, dst)
    save_json({"summary": summary, "rows": [], "runs": runs}, out_dir / "validation.json")
    return out_dir


def load_outcome(out_dir: Path) -> Outcome:
    """An outcome saved by `save_outcome` (with its profiles), to keep or report it again."""
    from simexec.trace.schema import load_json

    out_dir = Path(out_dir)
    data = load_json(out_dir / "validation.json", "validation")
    runs = []
    for r in data["runs"]:
        spec = PlanSpec(**r["spec"])
        runs.append(Run(spec, r["round"], r["trace_path"], r["step_s"], r["steps_s"],
                        {int(k): v for k, v in r["peak"].items()}, r["background"]))
    rows = [Row(**row) for row in data["rows"]]
    profiles = {}
    for label in ("microbench", "traces"):
        found = sorted((out_dir / "profiles").glob(f"*-{label}.json"))
        if found:
            profiles[label] = json.loads(found[0].read_text())
    return Outcome(rows, profiles, data["summary"].get("skipped", {}), data["summary"], runs)
