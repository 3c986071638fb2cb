"""`execute`: run a plan for real and measure it.

resolve -> lower (the simulator's very program, every rank spelled out) -> refuse what the
interpreter cannot run yet (before any actor starts) -> Ray -> one actor per rank -> results,
a measured trace in the shared schema, and `--json` / `--trace` / `--profile` files.

The trace holds one step, so its instruction ids match the simulator's one step one to one: the
steady step (the second half's step nearest its median time; the last of a run of fewer than 4
steps); `step_times_s` has every step. A failed run still writes the
trace (the last step with any events) and the JSON (with `error`) before raising `ExecError`.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Union

from simexec.errors import ExecError
from simexec.outputs import write_atomic
from simexec.trace.schema import Trace, save_json


@dataclass
class ExecResult:
    losses: list[float]  # per step: mean over the ranks that report a loss
    step_time_s: Optional[float]  # median over the steps after the warm-up step (None: no step finished)
    step_times_s: list[float]  # per step: the slowest rank's
    peak_memory_bytes_per_rank: dict[int, int]
    trace: Trace
    losses_per_rank: dict[int, list[float]] = field(default_factory=dict)
    params: Optional[dict[int, dict]] = None  # rank -> {name: cpu tensor}, with return_params=True
    placement: dict[int, str] = field(default_factory=dict)  # rank -> Ray node id
    timings: dict[str, float] = field(default_factory=dict)  # ray_start_s, actors_s, rendezvous_s, run_s, ...
    fingerprint: str = ""
    error: Optional[str] = None
    extra: dict[int, object] = field(default_factory=dict)  # rank -> a runner's "extra" result
    first_step: int = 0  # the step `losses` and `step_times_s` begin at (resumed runs)
    reports: dict[str, dict] = field(default_factory=dict)  # stragglers, recovery, checkpoints (`execute`)
    loss_scales: list[float] = field(default_factory=list)  # loss_scale: the scale of each step
    skipped_steps: list[int] = field(default_factory=list)  # loss_scale: steps skipped for overflow

    def format(self) -> str:
        """A few lines for the terminal."""
        mib = {r: f"{b / 2**20:.1f}" for r, b in self.peak_memory_bytes_per_rank.items()}
        st = f"{self.step_time_s * 1e3:.1f} ms" if self.step_time_s is not None else "n/a"
        lines = [f"losses        {', '.join(f'{x:.4f}' for x in self.losses) or 'n/a'}",
                 f"step time     {st} (median after warm-up; steps: "
                 f"{', '.join(f'{t * 1e3:.1f}' for t in self.step_times_s)} ms)",
                 f"peak memory   {', '.join(f'r{r} {v}' for r, v in mib.items())} MiB",
                 *([f"loss scale    {', '.join(f'{x:g}' for x in self.loss_scales)} (skipped steps: "
                    f"{', '.join(map(str, self.skipped_steps)) or 'none'})"] if self.loss_scales else []),
                 f"events        {len(self.trace.events)} (program {self.fingerprint})",
                 "wall times    " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in self.timings.items())]
        st = self.reports.get("stragglers")
        if st:
            pred = f", x{st['predicted_ratio']:.3f} simulated" if st.get("predicted_ratio") else ""
            lines.append(f"stragglers    {st['slowed_step_s'] * 1e3:.1f} ms slowed vs {st['healthy_step_s'] * 1e3:.1f} ms "
                         f"healthy: x{st['measured_ratio']:.3f} measured{pred}")
        rec = self.reports.get("recovery")
        if rec:
            m, p = rec["measured"], rec.get("predicted")
            this = f"; predicted {p['this_kill_s']:.2f} s" if p else ""
            lines.append(f"recovery      rank {rec['killed']['rank']} killed at step {rec['killed']['step']}, resumed "
                         f"from step {rec['resumed_from_step']} ({rec['steps_redone']} redone): lost {m['lost_s']:.2f} s "
                         f"(restart {m['restart_s']:.2f} s + redo {m['redo_s']:.2f} s){this}")
        if self.error:
            lines.append(f"error         {self.error}")
        return "\n".join(lines)

    def to_json(self, rp=None) -> dict:
        out = {"losses": self.losses, "step_time_s": self.step_time_s, "step_times_s": self.step_times_s,
               "peak_memory_bytes_per_rank": {str(r): b for r, b in self.peak_memory_bytes_per_rank.items()},
               "losses_per_rank": {str(r): v for r, v in self.losses_per_rank.items()},
               "placement": {str(r): n for r, n in self.placement.items()}, "timings": self.timings,
               "program_fingerprint": self.fingerprint, "error": self.error}
        if self.loss_scales:
            out.update(loss_scales=self.loss_scales, skipped_steps=self.skipped_steps)
        if self.first_step:
            out["first_step"] = self.first_step
        out.update(self.reports)
        if rp is not None:
            out.update(_describe(rp))
        return out


def execute(model, cluster, plan, *, steps: int = 3, seq_len: Optional[int] = None,
            ray_address: Optional[str] = None, backend: str = "gloo", seed: int = 0, timeout_s: float = 60.0,
            trace_path: Optional[Union[str, os.PathLike]] = None, json_path: Optional[Union[str, os.PathLike]] = None,
            profile_dir: Optional[Union[str, os.PathLike]] = None, trace: bool = True, fault=None,
            runner: Optional[Union[str, Callable]] = None, return_params: bool = False,
            on_start: Optional[Callable[[list[dict]], None]] = None, pool=None,
            memory_plan: bool = False, slow: Optional[dict[int, float]] = None,
            checkpoint_dir: Optional[Union[str, os.PathLike]] = None, checkpoint_every: int = 0,
            resume: bool = False, kill: Optional[str] = None) -> ExecResult:
    """Run `steps` training steps of `plan` on real ranks and measure them.

    model / cluster / plan: specs or their names (`gpt-tiny`, `local`, `dp=2,tp=2`).
    timeout_s: a run in which no rank makes progress for this long is a hang; it ends with an
    `ExecError` naming the rank and instruction (so do a dead rank and one that raises).
    trace=False: no events (to measure the tracer's overhead). fault: a `Fault` or its text
    (default: the SIMEXEC_FAULT environment variable), for fault tests. runner: a stand-in for
    `simexec.exec.rank.interpreter.run_rank` with the same signature (tests, custom interpreters).
    on_start: called with every rank's {rank, pid, node_id, ip, host} once all are set up.
    pool: rank actors kept alive across runs (`simexec.calibrate.runs.RankPool`): its `launch`
    replaces `Launch`, so several plans run without starting actors each time.
    memory_plan: run the program in the order that lowers each rank's peak
    (`simexec.program.reorder`): the same instructions and maths, the memory saving measured.

    slow: stragglers, {rank: F} (`simexec.resilience` reads `simulate --slow`'s SPEC into it): the
    plan runs healthy, then with those ranks computing F times as long; the result is the slowed
    run's, with `stragglers` (both runs' step times and their ratio). checkpoint_dir / checkpoint_every:
    every rank saves its state (torch.distributed.checkpoint) after steps K, 2K, ... resume: continue
    from the newest complete checkpoint there (`first_step`). kill `rank:R:step:S`: rank R exits hard
    as it begins step S; the run restarts from the newest checkpoint and finishes, and `recovery`
    says what the failure cost, measured (`simexec.resilience` adds the goodput model's prediction).
    """
    from simexec.exec.runtime.launcher import start_ray, stop_ray
    from simexec.exec.measure.tracer import FAULT_ENV, Fault
    from simexec.program.lower import lower
    from simexec.specs.plan import resolve

    if backend not in ("gloo", "nccl", "xla"):
        raise ExecError(f"backend must be gloo, nccl or xla, got {backend!r}")
    if backend == "xla":  # PyTorch/XLA lives in its own environment (scripts/xla_env.sh)
        from simexec.exec.rank.xla import unavailable

        why = unavailable()
        if why:
            raise ExecError(f"backend xla: {why}")
    if steps < 1:
        raise ExecError(f"steps must be at least 1, got {steps}")
    rp = resolve(*_specs(model, cluster, plan), seq_len)
    if backend == "xla" and rp.plan.offload_layers:  # the saved-tensor hooks copy CUDA/CPU storages
        raise ExecError(f"backend xla: offload_layers={rp.plan.offload_layers} runs on gloo and nccl ranks only")
    control, kill_at = _control(rp, steps, backend, runner, slow, checkpoint_dir, checkpoint_every, resume, kill)
    program = lower(rp, symmetric=False)
    if memory_plan:
        from simexec.program.reorder import reorder_program

        program = reorder_program(program).program
    if runner is None:
        from simexec.exec.rank.unsupported_plans import unsupported

        missing = unsupported(rp)
        if missing:
            raise ExecError(missing if missing.startswith("the executor") else
                            f"the executor cannot run plan {rp.plan} yet: {missing}")
    if fault is None and os.environ.get(FAULT_ENV):
        fault = os.environ[FAULT_ENV]
    if isinstance(fault, str):
        fault = Fault.parse(fault)

    timings: dict[str, float] = {}
    owned = False
    attempt = _Attempt(rp, program, pool=pool, steps=steps, seed=seed, runner=runner, return_params=return_params,
                       profile_dir=profile_dir, files=(trace_path, json_path),
                       launch_kw=dict(backend=backend, timeout_s=timeout_s, trace=trace, fault=fault,
                                      profile=profile_dir is not None, on_start=on_start))
    report: dict = {}
    try:
        t0 = time.perf_counter()
        owned = start_ray(ray_address)
        timings["ray_start_s"] = time.perf_counter() - t0
        if control is not None and control.slow:
            healthy, _ = attempt.run(replace(control, slow={}), timings={})
            outs, infos = attempt.run(control, timings)
            report["stragglers"] = _stragglers(control.slow, healthy, outs)
        elif kill_at is not None:
            outs, infos, report["recovery"], control = _kill_and_restart(attempt, control, kill_at, timings)
        else:
            outs, infos = attempt.run(control, timings)
    finally:
        t0 = time.perf_counter()
        stop_ray(owned)
        if owned:
            timings["ray_stop_s"] = time.perf_counter() - t0
    result = _result(rp, program, outs, infos, timings)
    result.first_step = control.start_step if control is not None else 0
    result.reports = report
    if control is not None:
        result.reports["checkpoints"] = _checkpoint_summary(control, outs)
    _write(result, rp, trace_path, json_path, profile_dir, outs)
    return result


@dataclass
class _Attempt:
    """One launch of the plan's ranks and one run of them; a failed run writes what it measured."""

    rp: object
    program: object
    pool: object
    steps: int
    seed: int
    runner: object
    return_params: bool
    profile_dir: object
    files: tuple
    launch_kw: dict

    def run(self, control, timings: dict, *, expect_failure: bool = False) -> tuple[dict, list]:
        from simexec.exec.runtime.launcher import Launch, RankFailure

        launch = (self.pool.launch if self.pool is not None else Launch)(self.rp, self.program, **self.launch_kw)
        with launch:
            timings.update(launch.timings)
            t0 = time.perf_counter()
            try:
                outs = launch.run(steps=self.steps, seed=self.seed, runner=self.runner,
                                  return_params=self.return_params, control=control,
                                  profile_dir=str(self.profile_dir) if self.profile_dir else None)
            except RankFailure as exc:
                timings["run_s"] = time.perf_counter() - t0
                exc.partial["detected_wall_s"] = time.time()
                if not expect_failure:
                    result = _result(self.rp, self.program, exc.partial["outs"], launch.infos, timings,
                                     error=str(exc))
                    exc.partial["result"] = result
                    _write(result, self.rp, *self.files, self.profile_dir, exc.partial["outs"])
                raise
            timings["run_s"] = time.perf_counter() - t0
        timings["teardown_s"] = launch.timings.get("teardown_s", 0.0)
        return outs, launch.infos


def _control(rp, steps: int, backend: str, runner, slow, checkpoint_dir, every: int, resume: bool, kill):
    """The ranks' `RunControl` from the options (None when none is given), and the kill's (rank, step);
    bad values fail with one line before any rank starts."""
    from simexec.exec.rank.run_control import RunControl, newest_checkpoint, parse_kill

    if not (slow or checkpoint_dir or every or resume or kill):
        return None, None
    if runner is not None:
        raise ExecError("--slow, --checkpoint-dir, --resume and --kill need the executor's own interpreter, not a runner")
    if slow and (checkpoint_dir or every or resume or kill):
        raise ExecError("--slow runs the plan twice (healthy, slowed): it does not combine with checkpoints or --kill")
    if backend == "xla" and (checkpoint_dir or kill):
        raise ExecError("checkpoints and --kill are not implemented for backend xla")
    if slow:
        bad = {r: f for r, f in slow.items() if not 0 <= r < rp.world or not 1.0 <= f < float("inf")}
        if bad:
            raise ExecError(f"slow: ranks must be in 0..{rp.world - 1} and factors finite numbers >= 1, got {bad}")
        return RunControl(slow=dict(slow)), None
    if every < 0:
        raise ExecError(f"--checkpoint-every must be at least 1, got {every}")
    if (every or resume or kill) and not checkpoint_dir:
        raise ExecError("--checkpoint-every, --resume and --kill need --checkpoint-dir")
    if kill and not every:
        raise ExecError("--kill needs --checkpoint-every K: the restart resumes from the newest checkpoint")
    if kill and resume:
        raise ExecError("--kill restarts from a checkpoint of its own run: it does not combine with --resume")
    directory = os.fspath(checkpoint_dir)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ExecError(f"--checkpoint-dir {directory}: not a directory")
    kill_at = parse_kill(kill, rp.world, steps) if kill else None
    start, path = 0, None
    if resume:
        newest = newest_checkpoint(directory)
        if newest is None:
            raise ExecError(f"--resume: no complete checkpoint under {directory}")
        path, start = newest
        if start >= steps:
            raise ExecError(f"--resume: the newest checkpoint ({path}) holds {start} steps; --steps {steps} asks for no more")
    elif kill:
        from simexec.exec.rank.run_control import CHECKPOINT_PREFIX

        if os.path.isdir(directory) and any(n.startswith(CHECKPOINT_PREFIX) for n in os.listdir(directory)):
            raise ExecError(f"--kill: {directory} holds checkpoints already; the restart must find its own run's")
    os.makedirs(directory, exist_ok=True)
    return RunControl(checkpoint_dir=directory, checkpoint_every=every, resume_from=path, start_step=start,
                      kill_rank=kill_at[0] if kill_at else None, kill_step=kill_at[1] if kill_at else None), kill_at


def _kill_and_restart(attempt: _Attempt, control, kill_at: tuple[int, int], timings: dict) -> tuple:
    """The run with its kill, then the restart from the newest checkpoint: the restart's outputs and
    rank infos, what the failure cost, and the restart's `RunControl`."""
    import json

    from simexec.exec.measure.recovery import recovery_report
    from simexec.exec.rank.run_control import KILL_RECORD, newest_checkpoint
    from simexec.exec.runtime.launcher import RankFailure

    first: dict = {}
    try:
        attempt.run(control, first, expect_failure=True)
        raise ExecError(f"--kill rank:{kill_at[0]}:step:{kill_at[1]}: the run finished without the rank dying")
    except RankFailure as exc:
        failure = exc
    torn_down = time.time()
    detected = failure.partial["detected_wall_s"]
    record_path = os.path.join(control.checkpoint_dir, KILL_RECORD)
    if failure.rank != kill_at[0] or failure.kind != "died" or not os.path.exists(record_path):
        raise ExecError(f"--kill: the run failed otherwise than by the kill: {failure}")
    with open(record_path) as fh:
        killed = json.load(fh)
    newest = newest_checkpoint(control.checkpoint_dir)
    path, start = newest if newest is not None else (None, 0)
    restart = replace(control, kill_rank=None, kill_step=None, resume_from=path, start_step=start)
    outs, infos = attempt.run(restart, timings)
    before = {r: st.get("progress", []) for r, st in failure.partial["status"].items()}
    healthy = [t1 - t0 for rows in before.values() for s, t0, t1, _ in rows if s > 0]
    saves = [s for o in outs.values() for _, s in o.get("checkpoints", [])]
    loads = [o["load_s"] for o in outs.values() if o.get("load_s") is not None]
    report = recovery_report(
        kill_rank=kill_at[0], kill_step=kill_at[1], kill_wall_s=killed["wall_s"], detected_wall_s=detected,
        torn_down_wall_s=torn_down, every=control.checkpoint_every, resumed_from=start,
        healthy_step_s=statistics.median(healthy) if healthy else None,
        save_s=statistics.median(saves) if saves else None, load_s=max(loads) if loads else None,
        restarted={r: o.get("progress", []) for r, o in outs.items()}, before=before, steps=attempt.steps)
    report["first_attempt_timings"] = first
    return outs, infos, report, restart


def _stragglers(factors: dict[int, float], healthy: dict, slowed: dict) -> dict:
    """Both runs' step times, their ratio and the slowed ranks' own CPU."""
    from simexec.exec.measure.stragglers import straggler_report

    return straggler_report(factors, _slowest_steps(healthy), _slowest_steps(slowed),
                            {r: o.get("main_cpu_times_s", []) for r, o in healthy.items()},
                            {r: o.get("main_cpu_times_s", []) for r, o in slowed.items()})


def _slowest_steps(outs: dict) -> list[float]:
    times = [o["step_times_s"] for o in outs.values() if o.get("step_times_s")]
    return [max(t[s] for t in times if len(t) > s) for s in range(max(map(len, times), default=0))]


def _checkpoint_summary(control, outs: dict) -> dict:
    saves = sorted({n for o in outs.values() for n, _ in o.get("checkpoints", [])})
    per_save = [max(s for o in outs.values() for n, s in o.get("checkpoints", []) if n == k) for k in saves]
    loads = [o["load_s"] for o in outs.values() if o.get("load_s") is not None]
    return {"dir": control.checkpoint_dir, "every": control.checkpoint_every, "saved_after_steps": saves,
            "save_s": per_save, "resumed_from": control.resume_from, "first_step": control.start_step,
            "load_s": max(loads) if loads else None}


def execute_in_process(model, cluster, plan, *, steps: int = 3, seq_len: Optional[int] = None, seed: int = 0,
                       device=None, trace_path: Optional[Union[str, os.PathLike]] = None,
                       json_path: Optional[Union[str, os.PathLike]] = None,
                       profile_dir: Optional[Union[str, os.PathLike]] = None) -> ExecResult:
    """A one-rank plan run in this process, without Ray or a process group: `execute`'s interpreter,
    tracer, trace and files, on `device` (the first GPU where there is one, else the CPU). For a
    one-GPU machine without Ray, and for a rank under a debugger or a profiler (`profile_dir`:
    torch.profiler over every step, the instructions as ranges, `rank0.pt.trace.json`)."""
    import platform
    import socket

    import torch

    from simexec.exec.rank.interpreter import run_rank
    from simexec.exec.rank.unsupported_plans import unsupported
    from simexec.exec.measure.tracer import Tracer, chrome_text, torch_profiler
    from simexec.program.lower import lower
    from simexec.specs.plan import resolve

    rp = resolve(*_specs(model, cluster, plan), seq_len)
    program = lower(rp, symmetric=False)
    if len(program.ranks) != 1:
        raise ExecError(f"a run in this process has one rank; plan {rp.plan} has {len(program.ranks)}")
    missing = unsupported(rp)
    if missing:
        raise ExecError(f"the executor cannot run plan {rp.plan} yet: {missing}")
    if steps < 1:
        raise ExecError(f"steps must be at least 1, got {steps}")
    device = torch.device(device) if device is not None else \
        torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ExecError(f"device {device}: this machine has no CUDA device")
        torch.cuda.set_device(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank actor runs (simexec.exec.runtime.worker)
    prof = torch_profiler(device) if profile_dir else None
    try:
        tracer = Tracer(0, device=device, profile=prof is not None)
        t0 = time.perf_counter()
        with prof if prof is not None else contextlib.nullcontext():
            res = run_rank(rp, program.ranks[0], steps=steps, groups=None, tracer=tracer, device=device, seed=seed)
        timings = {"run_s": time.perf_counter() - t0}
    finally:
        torch.set_num_threads(threads)
    out = {key: res.get(key, []) for key in ("losses", "step_times_s", "cpu_times_s", "main_cpu_times_s")}
    out.update(peak_memory_bytes=int(res.get("peak_memory_bytes", 0) or 0), trace=tracer.export())
    if prof is not None:
        out["profile"] = chrome_text(prof)
    info = {"rank": 0, "node_id": None, "host": socket.gethostname(), "torch": torch.__version__, "ray": None,
            "kernel": platform.release(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"}
    result = _result(rp, program, {0: out}, [info], timings)
    _write(result, rp, trace_path, json_path, profile_dir, {0: out})
    return result


def resolved(model, cluster, plan, seq_len: Optional[int] = None):
    """The ResolvedPlan of specs or their names, as `execute` resolves them."""
    from simexec.specs.plan import resolve

    return resolve(*_specs(model, cluster, plan), seq_len)


def _specs(model, cluster, plan) -> tuple:
    """Model, cluster and plan specs from specs or their names."""
    from simexec.specs.cluster import ClusterSpec, get_cluster
    from simexec.specs.model import ModelSpec, get_model
    from simexec.specs.plan import Plan, load_plan

    return (model if isinstance(model, ModelSpec) else get_model(model),
            cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster),
            plan if isinstance(plan, Plan) else load_plan(plan))


def _result(rp, program, outs: dict[int, dict], infos: list[dict], timings: dict, error: Optional[str] = None) -> ExecResult:
    from simexec.exec.measure.tracer import build_events, pick_step

    per_rank = {r: o["losses"] for r, o in sorted(outs.items()) if o.get("losses")}
    n_steps = max((len(v) for v in per_rank.values()), default=0)
    losses = [statistics.fmean(v[s] for v in per_rank.values() if len(v) > s) for s in range(n_steps)]
    times = [o["step_times_s"] for o in outs.values() if o.get("step_times_s")]
    step_times = [max(t[s] for t in times if len(t) > s) for s in range(max(map(len, times), default=0))]
    exports = {r: o["trace"] for r, o in outs.items() if o.get("trace")}
    step = pick_step(exports.values(), () if error else step_times)
    events, counters = build_events(program, exports, step) if exports else ([], [])
    measured = step_times[1:] or step_times
    step_time = statistics.median(measured) if measured else None
    peak = {r: o["peak_memory_bytes"] for r, o in sorted(outs.items()) if "peak_memory_bytes" in o}
    params = {r: o["params"] for r, o in sorted(outs.items()) if "params" in o} or None
    scaled = {} if error else loss_scaling(outs)
    summary = {"step_time_s": step_time, "step_times_s": step_times,
               "peak_memory_bytes_per_rank": {str(r): b for r, b in peak.items()}, "losses": losses}
    cpu = {str(r): o["cpu_times_s"] for r, o in sorted(outs.items()) if o.get("cpu_times_s")}
    if cpu:  # each rank's process CPU a step, every thread: what it took of the host's cores
        summary["cpu_times_s_per_rank"] = cpu
        main = {str(r): o["main_cpu_times_s"] for r, o in sorted(outs.items()) if o.get("main_cpu_times_s")}
        if main:  # the rank's own thread's share of it (the rest: gloo's threads, Ray's)
            summary["main_cpu_times_s_per_rank"] = main
    if error:
        summary["error"] = error
    meta = {"kind": "measured", "program": program.fingerprint(), "program_executed": program.executed_fingerprint(),
            "summary": summary,
            "trace_step": step, "timings": timings, "ends_when_waited": [], **_describe(rp)}
    if infos:  # where it ran: calibration records it in the profile it fits
        meta["machine"] = {k: infos[0].get(k) for k in ("host", "device", "torch", "ray", "kernel")}
    # how gloo's event loops ran (simexec.exec.runtime.gloo_loops): it changes what collectives cost on shared cores
    meta["gloo_event_loops"] = "SCHED_IDLE" if outs and all(o.get("gloo_loops_idled") for o in outs.values()) \
        else "as gloo starts them"
    return ExecResult(losses=losses, step_time_s=step_time, step_times_s=step_times, peak_memory_bytes_per_rank=peak,
                      trace=Trace(meta=meta, events=events, counters=counters), losses_per_rank=per_rank,
                      params=params, placement={i["rank"]: i["node_id"] for i in infos}, timings=dict(timings),
                      fingerprint=program.fingerprint(), error=error,
                      extra={r: o["extra"] for r, o in sorted(outs.items()) if "extra" in o},
                      loss_scales=scaled.get("loss_scales", []), skipped_steps=scaled.get("skipped_steps", []))


def loss_scaling(outs: dict[int, dict]) -> dict:
    """The loss scale of each step and the skipped steps. Every rank moves its scale on the same
    world-reduced overflow flag, so the ranks agree; a rank that does not has trained on other
    steps than the rest, and the run is refused, naming the first step where they part."""
    reports = [(r, o["loss_scales"], o["skipped_steps"]) for r, o in sorted(outs.items()) if "loss_scales" in o]
    if not reports:
        return {}
    r0, scales0, skipped0 = reports[0]
    for r, scales, skipped in reports[1:]:
        if scales != scales0 or skipped != skipped0:
            step = next((s for s in range(max(len(scales), len(scales0)))
                         if scales[s:s + 1] != scales0[s:s + 1] or (s in skipped) != (s in skipped0)), 0)
            raise ExecError(f"ranks {r0} and {r} disagree on the loss scale at step {step}: rank {r0} "
                            f"{_scale_at(scales0, skipped0, step)}, rank {r} {_scale_at(scales, skipped, step)}")
    return {"loss_scales": scales0, "skipped_steps": skipped0}


def _scale_at(scales: list[float], skipped: list[int], step: int) -> str:
    scale = f"scale {scales[step]:g}" if step < len(scales) else "no scale"
    return f"{scale}, {'skipped' if step in skipped else 'taken'}"


def _describe(rp) -> dict:
    """Names as the simulator's traces give them (so `compare` can match the two), plus full specs."""
    return {"model": rp.model.name, "cluster": rp.cluster.name, "plan": rp.plan.to_string(), "world": rp.world,
            "seq_len": rp.seq_len, "symmetric": False, "model_spec": rp.model.model_dump(),
            "cluster_spec": rp.cluster.model_dump(), "plan_fields": rp.plan.model_dump()}


def _write(result: ExecResult, rp, trace_path, json_path, profile_dir, outs: dict[int, dict]) -> None:
    """Write each requested file whole or not at all (`simexec.outputs.write_atomic`)."""
    if trace_path:
        result.trace.save(trace_path)
    if json_path:
        save_json(result.to_json(rp), json_path)
    if profile_dir:
        for r, o in outs.items():
            if o.get("profile"):
                write_atomic(Path(profile_dir) / f"rank{r}.pt.trace.json", o["profile"].encode())
