"""Calibrate the simulator's hardware model against measured step traces.

`calibrate_from_traces(trace_paths, cluster, out_path)`: fit the cost parameters
(`simexec.calibrate.profiles.PARAMS`) to measured step traces with `scipy.optimize.least_squares` (soft-L1
loss on log durations): every event's predicted duration comes from simulating the trace's program
with the candidate parameters (`fit_traces`), so the fit sees exactly the cost functions and
contention the simulator uses. It starts from a profile (the micro-benchmarks',
`simexec.calibrate.micro`, typically) and writes one (`simexec.calibrate.profiles`).
"""
from __future__ import annotations

import json
import math
import re
import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Union

from simexec.calibrate.profiles import (
    PARAMS, CalibrationError, Param, PathLike, jsonable, host_cores, make_profile, now_iso,
    profiled_cluster, save_profile, set_params,
)
from simexec.sim.profile import load_profile
from simexec.trace.schema import steady_step
from simexec.specs.cluster import ClusterSpec, get_cluster
from simexec.errors import SimexecError
from simexec.specs.plan import parse_plan

TRACE_PARAMS = ("op", "instr", "bwd", "gemm_flops", "attention_eff", "coll_latency", "hop_latency", "intra_bw",
                "slice", "contention", "timeslicing", "idle_wake")
# An accelerator's traces: no core sharing to fit, and memory-bound kernels run at the device's own
# bandwidth (on CPU ranks the per-block element-wise costs of the micro-benchmarks stand for it). The
# GEMM rate stays where the datasheet or the kernel micro-benchmarks (scripts/gpu_profile.py) put it:
# a block's time mixes its GEMMs with its memory-bound kernels, and a step trace cannot tell them apart.
ACCELERATOR_TRACE_PARAMS = ("op", "dispatch", "instr", "bwd", "attention_eff", "memory_bw", "coll_latency",
                            "hop_latency", "intra_bw", "cpu_adam")


@dataclass
class TraceCase:
    """One measured trace, ready to be re-simulated."""

    path: str
    model: object  # ModelSpec
    plan: str
    seq_len: Optional[int]
    measured: dict[str, float]  # event id -> µs (compute, copies, host steps)
    comm: dict[str, float]  # event id -> µs (collectives, send/recv)
    step_s: float
    peak: dict[int, float]
    background: Optional[float]
    machine: Optional[dict] = None  # where it was measured (executor traces name it)
    loops_idle: bool = False  # gloo's event loops ran at SCHED_IDLE (the executor's default since it names them)
    main_cpu_s: Optional[float] = None  # a rank's main thread's CPU a step, the mean over ranks (runs that time it)

    @property
    def offloads(self) -> bool:
        """Whether the plan steps its optimizer on the host (the trace then times the host's Adam)."""
        return parse_plan(self.plan).offload != "none"


def trace_case(trace, where: str) -> TraceCase:
    """A measured trace as a `TraceCase` (`where` names it in errors); refuses a predicted one."""
    from simexec.specs.model import ModelSpec, get_model
    from simexec.trace.schema import ends_when_waited

    meta = trace.meta
    if meta.get("kind") != "measured":
        raise CalibrationError(f"{where}: not a measured trace (kind {meta.get('kind')!r}); calibrate from `simexec execute --trace` output")
    m = meta.get("model_spec") or meta.get("model")  # the spec: a model from a file has no preset name
    try:
        model = ModelSpec.model_validate(m) if isinstance(m, dict) else get_model(str(m))
    except Exception as exc:  # noqa: BLE001 - a model we cannot rebuild
        raise CalibrationError(f"{where}: cannot rebuild its model ({type(exc).__name__})") from None
    summary = meta.get("summary") or {}
    step = steady_step(summary.get("step_times_s") or [], summary.get("step_time_s"))
    if not step:
        raise CalibrationError(f"{where}: has no measured step time in its summary")
    # the executor's optimizer step waits for the gradient collectives inside its own time: left out
    comp = {e.id: e.dur_us for e in trace.events
            if e.kind in ("compute", "copy") and e.dur_us > 0 and not e.name.startswith(("optim.", "host."))}
    # a send's measured time runs from isend to the wait at the end of the step: not the transfer's;
    # nor is a gloo reduce-scatter's (its work reports completion only once waited)
    waited = ends_when_waited(meta)
    comm = {e.id: e.dur_us for e in trace.events
            if e.kind in ("collective", "recv") and e.dur_us > 0 and e.op.partition("@")[0] not in waited}
    peak = {int(r): float(b) for r, b in ((meta.get("summary") or {}).get("peak_memory_bytes_per_rank") or {}).items()}
    return TraceCase(where, model, str(meta.get("plan")), meta.get("seq_len"), comp, comm, float(step), peak,
                 meta.get("background_load"), meta.get("machine"),
                 meta.get("gloo_event_loops") == "SCHED_IDLE",  # absent before the executor idled them
                 main_thread_cpu(trace))


def main_thread_cpu(trace) -> Optional[float]:
    """The mean CPU a step of the ranks' main threads (`simexec.trace.compare.cpu_of`), where the trace has it."""
    from simexec.trace.compare import cpu_of

    return (cpu_of(trace) or {}).get("main_thread_s")


def cases_machine(cases: Sequence[TraceCase]) -> Optional[dict]:
    """The machine the traces were measured on, when they all name the same one."""
    machines = {json.dumps(c.machine, sort_keys=True) for c in cases}
    return json.loads(machines.pop()) if len(machines) == 1 else None


def load_cases(trace_paths: Iterable[PathLike]) -> list[TraceCase]:
    from simexec.trace.schema import Trace

    paths = [str(p) for p in trace_paths]
    if not paths:
        raise CalibrationError("no traces given")
    return [trace_case(Trace.load(p), p) for p in paths]


def predict_case(case: TraceCase, cluster: ClusterSpec, profile: Optional[dict] = None, *, trace: bool = True):
    """Simulate the case's plan (every rank) on the cluster with the profile, under the run's
    conditions: the background load measured with the trace, when it was, and how gloo's event loops
    ran."""
    from simexec.sim.simulate import simulate

    prof = json.loads(json.dumps(profile)) if profile else {"costs": {}}
    if getattr(cluster.costs, "cores_shared", False) or (prof.get("costs") or {}).get("cores_shared"):
        if case.background is not None:
            prof.setdefault("costs", {})["background_load"] = float(case.background)
        prof.setdefault("costs", {})["gloo_loops_idle"] = case.loops_idle
    return simulate(case.model, cluster, case.plan, case.seq_len, symmetric=False, profile=prof, trace=trace)


def _dominant_dtype(cases: list[TraceCase]) -> str:
    """The dtype most of the traces ran in: the one whose peak `gemm_flops` stands for (the others
    are scaled with it)."""
    dtypes = [parse_plan(c.plan).dtype for c in cases]
    return max(sorted(set(dtypes)), key=dtypes.count) if dtypes else "fp32"


def fit_traces(cases: list[TraceCase], base: ClusterSpec, base_profile: dict, *, params: Sequence[str] = TRACE_PARAMS,
               max_nfev: int = 60, event_weight: float = 0.5, comm_weight: float = 0.2, step_weight: float = 3.0,
               cpu_weight: float = 1.0, prior_weight: float = 0.2, diff_step: float = 0.1, restarts: int = 2,
               progress: Optional[Callable[[int, float], None]] = None) -> tuple[dict, dict]:
    """Least squares (soft-L1 on log durations) of the named parameters to measured traces.

    Residuals: per trace, for each kind of compute instruction (`event_groups`: the same block and
    phase on every rank, layer and micro-batch) log(summed predicted / summed measured) (weight
    `event_weight` x the square root of its share of the trace's measured time, so each trace counts
    alike), the same for its collectives and messages (`comm_weight`), its step time's
    (`step_weight`), and where the run timed it its main threads' CPU a step (`cpu_weight`: on shared
    cores a step's time is CPU work and waiting for cores, and the CPU tells the two apart); plus a
    weak pull of each parameter towards its starting value (`prior_weight` per e-fold), which keeps
    parameters the traces cannot see where they were. Sums, not single events:
    a step adds its instructions up, and on shared cores their times have heavy tails, so a fit to
    each event's log ratio matches the typical event and leaves every sum short."""
    import numpy as np
    from scipy.optimize import least_squares

    start = profiled_cluster(base, base_profile)
    dtype = _dominant_dtype(cases)
    ps = [PARAMS[n] for n in params]
    x0 = np.array([_to_x(p, max(p.get(start, dtype) or p.start or 0.0, p.least(start) if p.least else 0.0))
                   for p in ps])
    lo = np.array([_to_x(p, p.lo) for p in ps])
    hi = np.array([_to_x(p, p.hi) for p in ps])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
    calls = [0]
    best = [math.inf, None]
    groups = [(event_groups(c.measured), event_groups(c.comm)) for c in cases]

    def profile_at(x) -> dict:
        return set_params(base_profile, {p.name: _from_x(p, v) for p, v in zip(ps, x)}, base, dtype)

    def residuals(x):
        prof = profile_at(x)
        out = []
        for case, (comp, comm) in zip(cases, groups):
            try:
                res = predict_case(case, base, prof)
            except SimexecError:
                return np.full(n_residuals(cases, groups, len(ps)), 10.0)
            pred = {e.id: e.dur_us for e in res.trace.events}
            out.extend(group_residuals(comp, pred, event_weight))
            out.extend(group_residuals(comm, pred, comm_weight))
            out.append(step_weight * math.log(max(res.step_time_s, 1e-9) / case.step_s))
            if case.main_cpu_s:  # a simulation on dedicated devices times no CPU: nothing to match
                cpu = main_thread_cpu(res.trace)
                out.append(cpu_weight * math.log(max(cpu, 1e-9) / case.main_cpu_s) if cpu else 0.0)
        out.extend(prior_weight * (x - x0))
        r = np.asarray(out)
        calls[0] += 1
        cost = float(np.sum(np.minimum(r**2, 2 * np.abs(r))))
        if cost < best[0]:
            best[0], best[1] = cost, np.array(x)
        if progress is not None:
            progress(calls[0], cost)
        return r

    t0 = time.perf_counter()
    residuals(x0)

    def solve(x_start, nfev, step=diff_step):
        return least_squares(residuals, x_start, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, diff_step=step,
                             x_scale="jac", max_nfev=nfev, xtol=1e-8, ftol=1e-8, gtol=1e-8)

    # The simulator is a discrete-event model: its cost has small steps where events swap order,
    # on which a gradient method can stall. Coarse differences and restarts from nearby points step
    # over them; a last pass with fine differences then resolves the minimum they found, which can
    # be narrower than the coarse step.
    sol = solve(x0, max_nfev)
    nfev = int(sol.nfev)
    rng = np.random.default_rng(0)
    for _ in range(restarts):
        trial = np.clip(best[1] + rng.normal(0.0, 0.15, size=len(ps)), lo + 1e-9, hi - 1e-9)
        sol = solve(trial, max(10, max_nfev // 2))
        nfev += int(sol.nfev)
    sol = solve(np.array(best[1]), max(10, max_nfev // 2), diff_step / 10)
    nfev += int(sol.nfev)
    x = best[1]
    values = {p.name: _from_x(p, v) for p, v in zip(ps, x)}
    prof = profile_at(x)
    idle = {c.loops_idle for c in cases}
    if len(idle) == 1 and (prof.get("costs") or {}).get("cores_shared"):  # the runs' loops, for what the profile predicts
        prof["costs"]["gloo_loops_idle"] = idle.pop()
    report = {"params": values, "start": {p.name: _from_x(p, v) for p, v in zip(ps, x0)}, "cost": best[0] / 2,
              "nfev": nfev, "status": int(sol.status), "message": str(sol.message),
              "wall_s": time.perf_counter() - t0, "traces": [c.path for c in cases]}
    return prof, report


def n_residuals(cases, groups, nparams: int) -> int:
    """How many residuals a fit over these cases and event groups makes, its parameters' priors included."""
    return sum(len(comp) + len(comm) + 1 + bool(c.main_cpu_s) for c, (comp, comm) in zip(cases, groups)) + nparams


_INDEX = re.compile(r"^(?:L-?\d+|m\d+|v\d+|s\d+|c\d+)$")


def event_kind(event_id: str) -> str:
    """An event's instruction without its rank, layer, micro-batch, virtual stage or chunk:
    `3:bwd.fc1.L2.m5` -> `bwd.fc1`."""
    name = event_id.split(":", 1)[-1]
    return ".".join(t for t in name.split(".") if not _INDEX.match(t)) or name


def event_groups(events: dict[str, float]) -> list[tuple[list[str], float, float]]:
    """The events of one trace by kind: (ids, summed measured µs, share of the trace's measured time)."""
    by: dict[str, list[str]] = {}
    for i in events:
        by.setdefault(event_kind(i), []).append(i)
    total = sum(events.values()) or 1.0
    out = []
    for kind in sorted(by):
        ids = by[kind]
        m = sum(events[i] for i in ids)
        out.append((ids, max(m, 1.0), m / total))
    return out


def group_residuals(groups, pred: dict[str, float], weight: float) -> list[float]:
    """weight x sqrt(share) x log(summed predicted / summed measured) for each group of events."""
    return [weight * math.sqrt(share) * math.log(max(sum(pred.get(i, 0.0) for i in ids), 1.0) / m)
            for ids, m, share in groups]


def _to_x(p: Param, v: float) -> float:
    return math.log(max(v, 1e-300)) if p.log else float(v)


def _from_x(p: Param, x: float) -> float:
    return float(math.exp(x)) if p.log else float(x)


def calibrate_from_traces(trace_paths: Iterable[PathLike], cluster: Union[str, ClusterSpec] = "local",
                          out_path: Optional[PathLike] = None, base_profile: Optional[Union[PathLike, dict]] = None,
                          *, name: Optional[str] = None, params: Optional[Sequence[str]] = None, max_nfev: int = 60,
                          progress: Optional[Callable[[int, float], None]] = None,
                          measured_at: Optional[str] = None) -> dict:
    """Fit the cluster's cost parameters to measured step traces; write and return the profile.

    base_profile: where the fit starts (a micro-benchmark profile, typically); without one it starts
    from the cluster's own numbers, with the host model of CPU ranks switched on for `local`.
    measured_at: when the traces were recorded (default: now); the fit's own time is `fit.fitted_at`."""
    base = cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster)
    cases = load_cases(trace_paths)
    if params is None:
        params = TRACE_PARAMS if base.sized_to_plan else ACCELERATOR_TRACE_PARAMS
        if not any(c.comm for c in cases):  # nothing in the traces sees the links
            params = tuple(p for p in params if p not in ("coll_latency", "hop_latency", "intra_bw"))
        if not any(c.offloads for c in cases):  # nor the host's Adam
            params = tuple(p for p in params if p != "cpu_adam")
    if base_profile is None:
        start = {"costs": {"cores_shared": bool(base.sized_to_plan)}, "node": {}}
        if base.sized_to_plan:
            start["node"]["cpu_cores"] = host_cores()
            start["costs"].update({"sched_slice_s": 1.5e-3, "instr_overhead_s": 20e-6, "bwd_overhead_s": 50e-6})
    elif isinstance(base_profile, dict):
        start = base_profile
    else:
        start = load_profile(base_profile)
    # the traces' machine; else the starting profile's (a profile of the same machine, typically)
    machine = cases_machine(cases) or start.get("machine")
    start = {k: v for k, v in start.items() if k in ("costs", "device", "node", "network")}
    fitted, report = fit_traces(cases, base, start, params=params, max_nfev=max_nfev, progress=progress)
    prof = make_profile(name or f"{socket.gethostname()}-traces", "traces", fitted.get("costs", {}),
                        fitted.get("device"), fitted.get("node"), machine=machine,
                        fit=jsonable({**report, "fitted_at": now_iso()}), measured_at=measured_at)
    if out_path:
        save_profile(prof, out_path)
    return prof
