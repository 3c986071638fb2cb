"""`simexec demo`: the whole loop on this machine, in a few minutes, with no argument.

simulate gpt-tiny's plans (the `local` preset) -> execute them on local Ray CPU ranks -> calibrate
(quick micro-benchmarks, then a fit to the calibration plans' traces) -> simulate again -> compare
with what was measured, on held-out plans too. Writes `out_dir` with

- `report.md`: the plans, predicted before and after calibration against measured, with errors;
- `summary.json`: held-out step-time MAPE before and after (`heldout_mape_before`,
  `heldout_mape_after`), peak-memory errors, the machine, timings;
- `plots/`: timeline (predicted vs measured), memory, op durations, calibration before / after;
- `traces/` (measured and predicted, gzip JSON; every plan is run `rounds` times, interleaved, each
  round's trace is in `traces/rounds/`, and the median round is the plan's measured trace, the one
  the trace fit and the plots use) and `profiles/` (the calibrated profiles).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Union

from simexec.errors import SimexecError
from simexec.outputs import write_atomic

STEPS = 6
ROUNDS = 3  # each plan measured this many times, interleaved; the median round stands for it


class _Progress:
    """A tqdm bar over the demo's stages (silent when progress is off)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="simexec demo", unit="step", dynamic_ncols=True,
                            bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}] {postfix}")

    def __call__(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(msg[:60])
            self.bar.update(1)

    def note(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(msg[:60])
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def demo(out_dir: Union[str, Path] = "simexec-demo", progress: bool = True, *, session=None,
         specs=None, steps: int = STEPS, rounds: int = ROUNDS, max_nfev: int = 25) -> dict:
    """Run the demo; returns the summary (also written to out_dir/summary.json)."""
    from simexec.calibrate.profiles import CalibrationError, jsonable, make_profile, save_profile
    from simexec.calibrate.traces import fit_traces
    from simexec.calibrate.evaluate import (
        DEMO, case_of, evaluate, fit_memory, mape, measure, mem_worst, profile_sections, repeatability, runnable,
        typical_runs, world_of,
    )
    from simexec.calibrate.runs import Session
    from simexec.specs.cluster import get_cluster

    if rounds < 1:
        raise SimexecError(f"demo: rounds (--rounds) must be at least 1, got {rounds}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").write_text("")
        (out / ".write-test").unlink()
    except OSError as exc:
        raise SimexecError(f"demo: cannot write to {out}: {exc.strerror or exc}") from None
    t0 = time.perf_counter()
    specs, skipped = runnable(specs or DEMO)
    if not specs:
        raise CalibrationError("demo: the executor runs none of the demo's plans")
    # stages: the preset's predictions, the micro-benchmarks, a warm-up per world size, each plan,
    # the calibration, the calibrated predictions, the plots
    bar = _Progress(total=rounds * len(specs) + len({world_of(s) for s in specs}) + 5, enabled=progress)
    cluster = get_cluster("local")
    timings = {}
    try:
        # 1. predictions with the preset, before anything is measured
        from simexec.sim.simulate import simulate

        before_traces = {}
        for s in specs:
            res = simulate(s.model, cluster, s.plan, symmetric=False, trace=True)
            before_traces[s.name] = res.trace
            res.trace.save(out / "traces" / f"{s.name}.predicted-before.json.gz")
        bar("simulated with the local preset")
        timings["simulate_s"] = time.perf_counter() - t0

        # 2. one Ray session: quick micro-benchmarks, then every plan
        t1 = time.perf_counter()
        own = session is None
        sess = session or Session()
        if own:
            bar.note("starting Ray")
            sess.__enter__()
        try:
            from simexec.calibrate.micro import calibrate_from_microbench

            bar.note("micro-benchmarks")
            prof_mb = calibrate_from_microbench(cluster, 4, None, name="demo-microbench", quick=True, session=sess)
            bar("micro-benchmarks")
            runs = measure(sess, specs, out / "traces" / "rounds", rounds=rounds, steps=steps, tick=bar)
        finally:
            if own:
                sess.__exit__(None, None, None)
        timings["measure_s"] = time.perf_counter() - t1
        typical = typical_runs(runs)
        for r in typical:
            shutil.copyfile(r.trace_path, out / "traces" / f"{r.spec.name}.json.gz")

        # 3. calibrate on the calibration plans' median rounds, starting from the micro-benchmarks
        t2 = time.perf_counter()
        bar.note("fitting the traces")
        calib = [r for r in typical if r.spec.role == "calibrate"]
        start = profile_sections(prof_mb)
        fitted, report = fit_traces([case_of(r) for r in calib], cluster, start, max_nfev=max_nfev)
        fitted = fit_memory(calib, cluster, fitted)
        prof_tr = jsonable(make_profile("demo-traces", "traces", fitted["costs"], fitted.get("device"),
                                         fitted.get("node"), machine=prof_mb.get("machine"), fit=report))
        save_profile(prof_mb, out / "profiles" / "demo-microbench.json")
        save_profile(prof_tr, out / "profiles" / "demo-traces.json")
        bar("calibrated")
        timings["calibrate_s"] = time.perf_counter() - t2

        # 4. simulate again, compare
        t3 = time.perf_counter()
        rows = evaluate(runs, cluster, {"before": None, "microbench": profile_sections(prof_mb),
                                        "traces": profile_sections(prof_tr)})
        after_traces = {}
        from simexec.calibrate.traces import predict_case

        for r in typical:
            res = predict_case(case_of(r), cluster, profile_sections(prof_tr), trace=True)
            after_traces[r.spec.name] = res.trace
            res.trace.save(out / "traces" / f"{r.spec.name}.predicted-after.json.gz")
        bar("simulated with the calibrated profile")
        _plots(out, typical, rows, before_traces, after_traces)
        bar("plots")
        timings["report_s"] = time.perf_counter() - t3
    finally:
        bar.close()
    summary = {
        "heldout_mape_before": mape(rows, "before"), "heldout_mape_after": mape(rows, "traces"),
        "heldout_mape_microbench": mape(rows, "microbench"),
        "calibration_mape_before": mape(rows, "before", "calibrate"),
        "calibration_mape_after": mape(rows, "traces", "calibrate"),
        "peak_memory_worst_error_before": mem_worst(rows, "before"),
        "peak_memory_worst_error_after": mem_worst(rows, "traces"),
        "plans": {r.name: {"plan": r.plan, "role": r.role, "measured_s": r.measured_s,
                           "predicted_before_s": r.predicted_s["before"],
                           "predicted_microbench_s": r.predicted_s["microbench"],
                           "predicted_after_s": r.predicted_s["traces"],
                           "measured_peak_bytes": r.measured_peak,
                           "predicted_peak_before_bytes": r.predicted_peak["before"],
                           "predicted_peak_after_bytes": r.predicted_peak["traces"],
                           "background_cores": r.background} for r in rows},
        "rounds": rounds, "repeatability": repeatability(rows),
        "skipped": skipped, "machine": prof_mb.get("machine"), "timings": timings,
        "wall_s": time.perf_counter() - t0,
    }
    write_atomic(out / "summary.json", (json.dumps(jsonable(summary), indent=2) + "\n").encode())
    write_atomic(out / "report.md", _report(rows, summary).encode())
    return summary


def _plots(out: Path, runs, rows, before: dict, after: dict) -> None:
    from simexec.trace import plot
    from simexec.trace.schema import Trace

    pdir = out / "plots"
    pdir.mkdir(parents=True, exist_ok=True)
    cal = [(r.name, r.predicted_s["before"], r.measured_s) for r in rows]
    cal_after = [(r.name, r.predicted_s["traces"], r.measured_s) for r in rows]
    plot.plot_calibration(cal, cal_after, pdir / "calibration.png",
                          heldout=[r.name for r in rows if r.role == "heldout"])
    for run in runs:
        name = run.spec.name
        measured = Trace.load(run.trace_path)
        plot.plot_timeline([after[name], measured], pdir / f"timeline-{name}.png",
                           title=f"{name}: predicted (calibrated) vs measured")
        plot.plot_memory([after[name], measured], pdir / f"memory-{name}.png",
                         title=f"{name}: live memory, predicted (calibrated) vs measured")
        plot.plot_durations(after[name], measured, pdir / f"durations-{name}.png",
                            title=f"{name}: op durations, predicted (calibrated) vs measured")


def _report(rows, summary: dict) -> str:
    def pct(x):
        return f"{100 * x:+.1f}%"

    m = summary.get("machine") or {}
    lines = [
        "# simexec demo",
        "",
        f"gpt-tiny's plans on `{m.get('hostname', '?')}` ({m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"torch {m.get('torch', '?')}): simulated with the `local` preset, executed on Ray CPU ranks, "
        "calibrated (quick micro-benchmarks, then a least-squares fit to the calibration plans' traces), "
        "simulated again. Held-out plans were not used by the calibration.",
        "",
        f"Held-out step-time MAPE: **{100 * summary['heldout_mape_before']:.1f}%** before calibration, "
        f"**{100 * summary['heldout_mape_after']:.1f}%** after "
        f"({100 * summary['heldout_mape_microbench']:.1f}% with the micro-benchmarks alone). "
        f"Worst peak-memory error: {100 * summary['peak_memory_worst_error_before']:.1f}% before, "
        f"{100 * summary['peak_memory_worst_error_after']:.1f}% after.",
        "",
        f"Every plan ran {summary['rounds']} times, interleaved; measured is the median"
        + (f", and a round differs from it by {100 * summary['repeatability']:.1f}% on average (the noise floor)."
           if summary.get("repeatability") is not None else "."),
        "",
        "| plan | role | measured ms | predicted before ms | error | predicted after ms | error | peak memory MiB measured / after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.role != "calibrate", r.name)):
        lines.append(
            f"| `{r.plan.replace(',gbs=8,dtype=fp32', '')}` | {r.role} | {r.measured_s * 1e3:.1f} | "
            f"{r.predicted_s['before'] * 1e3:.1f} | {pct(r.err('before'))} | {r.predicted_s['traces'] * 1e3:.1f} | "
            f"{pct(r.err('traces'))} | {r.measured_peak / 2**20:.2f} / {r.predicted_peak['traces'] / 2**20:.2f} |")
    lines += ["", "Background load (cores other processes used while each plan ran) is part of the prediction: "
              "see `docs/calibration.md`.", "",
              "Plots: `plots/calibration.png`, and per plan `plots/timeline-*.png`, `plots/memory-*.png`, "
              "`plots/durations-*.png`. Traces: `traces/` (measured `NAME.json.gz`, the median of "
              f"{summary.get('rounds', 1)} rounds in `rounds/`, predicted "
              "`NAME.predicted-before.json.gz` / `NAME.predicted-after.json.gz`). Profiles: `profiles/`.", ""]
    if summary.get("skipped"):
        lines += ["Left out (the executor cannot run them yet): " + ", ".join(summary["skipped"]), ""]
    lines += [f"Wall time {summary['wall_s']:.0f} s.", ""]
    return "\n".join(lines)
