#!/usr/bin/env python
"""Held-out accuracy of the simulator on this machine's CPU ranks, before and after calibration.

    python scripts/validate_calibration.py [--out DIR] [--rounds 3] [--markdown docs/calibration.md]
    python scripts/validate_calibration.py --refit DIR [--markdown docs/calibration.md]

One Ray session runs everything: the micro-benchmarks, then every plan of
`simexec.calibrate.evaluate.MATRIX` the executor supports, `--rounds` times, with the micro-benchmarks
again between rounds (all their runs pooled -> a micro-benchmark profile); the trace fit
(`scipy.optimize.least_squares`) on the calibration plans' traces (-> a trace profile). Every plan
is then predicted with the `local` preset (before), the micro-benchmark profile and the trace
profile; the held-out plans' step-time MAPE and the worst peak-memory error are the result. The
table goes to stdout, `DIR/validation.json` and, with --markdown, between the markers
`<!-- validation:begin -->` / `<!-- validation:end -->` of that file.

--refit DIR measures nothing: it fits both profiles again from an earlier run's raw micro-benchmark
timings and traces in DIR and predicts its runs again (after a change of the cost model), rewriting
DIR's profiles and validation.json. DIR can also be a recording of `scripts/record_traces.py`
(`traces/local`, the measurements behind docs/calibration.md): it is copied to --out first.

--trace-params NAMES chooses what the trace fit moves (`simexec.calibrate.profiles.PARAMS` names), e.g. to see
how the held-out error moves when a parameter the micro-benchmarks measured is held.

--max-noise PCT stops the measurement after any round whose noise floor so far (one plan's rounds
against their median) is above PCT percent, and removes its traces: on a host that unsteady the
table says more about the host than about the simulator. --attempts N measures again, up to N times
in all, --retry-after SECONDS after each stop, for a shared host whose other users come and go.

--cost NAME=VALUE sets a number of the `local` preset's `costs` (e.g. `idle_poll_s=4.3e-3`) for a
what-if: with --refit, how the same measurements move under another value.

--cpu-scheduler slices models the host's cores as time slices (`simexec.sim.host.cores.SlicedCores`)
instead of processor sharing, in both fits and every prediction.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simexec.calibrate.profiles import PARAMS  # noqa: E402
from simexec.calibrate.evaluate import (  # noqa: E402
    MATRIX, from_recording, refit, run_validation_retrying, save_outcome, summary_table, table,
)
from simexec.calibrate.traces import TRACE_PARAMS  # noqa: E402
from simexec.specs.cluster import get_cluster  # noqa: E402
from simexec.errors import SimexecError  # noqa: E402
from simexec.validation.markdown import replace_block  # noqa: E402
from simexec.outputs import outputs_refused  # noqa: E402

BEGIN, END = "<!-- validation:begin -->", "<!-- validation:end -->"


def render(outcome, argv: list[str]) -> str:
    s = outcome.summary
    m = s.get("machine") or {}
    rep = s.get("repeatability")
    command = f"`python scripts/validate_calibration.py {' '.join(argv)}`"
    if "--refit" in argv:
        command = ("Commands: `python scripts/validate_calibration.py --out DIR` measured the runs (`python "
                   "scripts/record_traces.py --from DIR` keeps them in `traces/local`); " + command +
                   " fits and predicts them again with the current simulator (no measuring, ~10 minutes), "
                   "which made this table")
    else:
        command = f"Command: {command}"
    lines = [
        command,
        "",
        f"Measured {s.get('measured_at', '')} on `{m.get('hostname', '?')}` ({m.get('cpu', '?')}, "
        f"{m.get('cores', '?')} cores, torch {m.get('torch', '?')}); {s['plans']} plans "
        f"({s['heldout_plans']} held out), {s['rounds']} rounds of {s['steps']} steps each; the host's other "
        f"users took {s['background_cores_mean']:.2f} cores on average while the plans ran"
        + (f"; one plan's rounds differ from their median by {100 * rep:.1f}% on average (the noise floor)"
           if rep is not None else "") + f". Wall time {s['total_s'] / 60:.1f} min.",
        "",
        summary_table(s),
        "",
        table(outcome.rows),
    ]
    if outcome.skipped:
        lines += ["", "Left out (the executor cannot run them yet):", ""]
        lines += [f"- `{k}`: {v}" for k, v in outcome.skipped.items()]
    return "\n".join(lines)


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0.0 < value < 100.0:
        raise argparse.ArgumentTypeError(f"expected a percentage between 0 and 100, got {text!r}")
    return value / 100.0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "simexec-validation"),
                    help="directory for traces, profiles and validation.json")
    ap.add_argument("--rounds", type=int, default=3, help="times each plan is measured (interleaved)")
    ap.add_argument("--steps", type=int, default=16, help="steps per run (the median of the last half counts)")
    ap.add_argument("--quick", action="store_true", help="smaller micro-benchmark set")
    ap.add_argument("--max-nfev", type=int, default=40, help="simulations the trace fit may spend per parameter")
    ap.add_argument("--markdown", default=None, help="a Markdown file to write the table into (between markers)")
    ap.add_argument("--name", default="local", help="profile name prefix")
    ap.add_argument("--refit", default=None, metavar="DIR", help="fit and predict an earlier run's products again")
    ap.add_argument("--trace-params", default=None, metavar="NAMES",
                    help="comma-separated parameters the trace fit moves (simexec.calibrate.profiles.PARAMS; default: "
                         + ",".join(TRACE_PARAMS) + ")")
    ap.add_argument("--cpu-scheduler", choices=("sharing", "slices"), default="sharing",
                    help="how the model shares the host's cores (costs.cpu_scheduler; docs/calibration.md)")
    ap.add_argument("--cost", action="append", default=[], metavar="NAME=VALUE",
                    help="set one of the `local` preset's `costs` fields (a number) in both fits and every "
                         "prediction, e.g. idle_poll_s=4.3e-3; repeatable")
    ap.add_argument("--max-noise", type=_percent, default=None, metavar="PCT",
                    help="stop, fitting and keeping nothing, after any round whose plans' rounds differ from "
                         "their median by more than PCT percent on average (the noise floor)")
    ap.add_argument("--attempts", type=_positive, default=1, metavar="N",
                    help="with --max-noise: measure again after a stop, up to N measurements in all")
    ap.add_argument("--retry-after", type=float, default=300.0, metavar="SECONDS",
                    help="with --attempts: how long to wait after a stop before measuring again (default 300)")
    args = ap.parse_args(argv)
    if outputs_refused("validate_calibration", {"--markdown": args.markdown}, {"--out": args.out}):
        return 2
    if args.attempts > 1 and (args.max_noise is None or args.refit):
        print(f"validate_calibration: error: --attempts {args.attempts} needs --max-noise and a measurement "
              "(not --refit): only a measurement stopped for noise is tried again", file=sys.stderr)
        return 2
    if args.retry_after < 0:
        print(f"validate_calibration: error: --retry-after {args.retry_after:g}: expected seconds >= 0",
              file=sys.stderr)
        return 2
    trace_params = None
    if args.trace_params is not None:
        trace_params = tuple(n.strip() for n in args.trace_params.split(",") if n.strip())
        unknown = [n for n in trace_params if n not in PARAMS]
        if unknown or not trace_params:
            what = f"unknown {', '.join(unknown)}" if unknown else "no name given"
            print(f"validate_calibration: error: --trace-params {args.trace_params!r}: {what}; known: "
                  f"{', '.join(PARAMS)}", file=sys.stderr)
            return 2
    local = get_cluster("local")
    costs = {"cpu_scheduler": args.cpu_scheduler}
    numeric = {k for k, v in local.costs.model_dump().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for item in args.cost:
        name, _, value = item.partition("=")
        try:
            if name not in numeric:
                raise ValueError(f"no numeric costs field {name!r}; known: {', '.join(sorted(numeric))}")
            costs[name] = float(value)
        except ValueError as exc:
            print(f"validate_calibration: error: --cost {item!r}: {exc}", file=sys.stderr)
            return 2
    try:  # validated, so that the fields' bounds hold
        checked = type(local.costs).model_validate({**local.costs.model_dump(), **costs})
    except ValueError as exc:  # pydantic's ValidationError
        first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
        print(f"validate_calibration: error: --cost: {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2
    cluster = local.model_copy(update={"costs": checked})

    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    try:
        if args.refit:
            out = Path(args.refit)
            if (out / "manifest.json").is_file() and not (out / "validation.json").is_file():
                out = from_recording(out, Path(args.out), args.name)
            outcome = refit(out, max_nfev=args.max_nfev, name=args.name, progress=progress, cluster=cluster,
                            trace_params=trace_params)
        else:
            out = Path(args.out)
            outcome = run_validation_retrying(out, MATRIX, attempts=args.attempts, retry_after_s=args.retry_after,
                                              rounds=args.rounds, steps=args.steps, quick_bench=args.quick,
                                              max_nfev=args.max_nfev, name=args.name, progress=progress,
                                              cluster=cluster, trace_params=trace_params, max_noise=args.max_noise)
    except SimexecError as exc:
        print(f"validate_calibration: error: {exc}", file=sys.stderr)
        return 2
    save_outcome(outcome, out)
    text = render(outcome, argv)
    print(text)
    if args.markdown:
        replace_block(Path(args.markdown), f"{BEGIN}\n{text}\n{END}", BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
