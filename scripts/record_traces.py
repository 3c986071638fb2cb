#!/usr/bin/env python
"""Re-record `traces/`: this machine's measured step traces and calibrated profiles.

    python scripts/record_traces.py [--rounds 1] [--name local]

Runs what `scripts/validate_calibration.py` runs (the micro-benchmarks, then every plan of the
matrix in one Ray session, then the trace fit on the calibration plans) and keeps its products:

    traces/local/<plan>.json.gz        measured traces (gzip Chrome JSON, the steady step nearest their median)
    traces/local/microbench.json.gz    the raw micro-benchmark timings (every run of them, pooled)
    traces/local/manifest.json         plans, roles, measured step times, background load, machine
    traces/profiles/<name>-microbench.json, traces/profiles/<name>-traces.json

`tests/test_calibrate_recorded.py` reads them (no Ray needed).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simexec.calibrate.evaluate import MATRIX, load_outcome, run_validation, summary_table, table  # noqa: E402
from simexec.outputs import outputs_refused  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "traces"), help="the traces/ directory")
    ap.add_argument("--rounds", type=int, default=1, help="times each plan is measured")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--name", default="local", help="profile name prefix")
    ap.add_argument("--from", dest="source", default=None,
                    help="keep the products of an earlier `validate_calibration.py --out DIR` run instead of running")
    args = ap.parse_args(argv)
    if outputs_refused("record_traces.py", folders={"--out": args.out}):
        return 2
    out = Path(args.out)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.source:
            outcome = load_outcome(Path(args.source))
            tmp = args.source
        else:
            outcome = run_validation(Path(tmp), MATRIX, rounds=args.rounds, steps=args.steps, name=args.name,
                                     progress=lambda m: print(f"[{time.perf_counter() - t0:6.1f} s] {m}", flush=True))
        dest = out / args.name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        runs = []
        for run in outcome.runs:
            src = Path(run.trace_path)
            name = src.name
            shutil.copy(src, dest / name)
            runs.append({"name": run.spec.name, "file": name, "model": run.spec.model, "plan": run.spec.plan,
                         "role": run.spec.role, "dims": run.spec.dims, "round": run.round,
                         "step_time_s": run.step_s, "step_times_s": run.steps_s,
                         "peak_memory_bytes_per_rank": {str(k): v for k, v in run.peak.items()},
                         "background_cores": run.background})
        shutil.copy(Path(tmp) / "microbench.json.gz", dest / "microbench.json.gz")
        (out / "profiles").mkdir(parents=True, exist_ok=True)
        for label in ("microbench", "traces"):
            shutil.copy(Path(tmp) / "profiles" / f"{args.name}-{label}.json", out / "profiles" / f"{args.name}-{label}.json")
        manifest = {"recorded_by": "scripts/record_traces.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "summary": outcome.summary, "runs": runs}
        (dest / "manifest.json").write_text(json.dumps(json.loads(json.dumps(manifest, default=str)), indent=1) + "\n")
    print(summary_table(outcome.summary))
    print(table(outcome.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
