"""Run whole training steps through the executor on one GPU and score the simulator's predictions.

Two steps, because the GPU host needs only torch, Ray and the project's light dependencies:

    python scripts/gpu_steps.py run --out DIR [--in-process]                 # on the GPU machine (CUDA events)
    python scripts/gpu_steps.py calibrate DIR                                # here: fit traces/profiles/h100-traces.json
    python scripts/gpu_steps.py report DIR --markdown docs/gpu_steps.md      # here: simulate, compare, tabulate

`run` executes each plan of PLANS with `simexec execute --backend nccl` semantics (one Ray actor, or
with `--in-process` this process, for a GPU machine without Ray; one GPU, the cluster
`traces/gpu/h100-1gpu.yaml`) and keeps each measured trace and result (traces/gpu/steps holds the
recorded ones). `calibrate` fits the trace profile to the plans marked
"calibrate", starting from the kernel-fitted profile `traces/profiles/h100.json`
(scripts/gpu_profile.py). `report` simulates every plan with the datasheet preset, the kernel profile
and the trace profile, compares each prediction with the measured trace event by event
(`simexec.trace.compare`) and writes the table: step time, peak memory, the op classes that carry the
error, and the held-out plans' error apart.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = str(ROOT / "traces/gpu/h100-1gpu.yaml")
PROFILE = str(ROOT / "traces/profiles/h100.json")
TRACE_PROFILE = str(ROOT / "traces/profiles/h100-traces.json")
STEPS = 10

# (name, model, seq_len, plan): one GPU, so every plan is dp=1; they vary what a single GPU does.
# Models are Hugging Face configs beside the cluster file (the GPT-3 presets tie their embeddings,
# which the executor does not run yet).
TINYLLAMA = "traces/gpu/tinyllama-1.1b.json"
MOE = "traces/gpu/mixtral-mini.json"
PLANS = [
    ("tl-mbs4", TINYLLAMA, 2048, "dp=1,gbs=8,mbs=4,dtype=bf16"),
    ("tl-mbs1", TINYLLAMA, 2048, "dp=1,gbs=4,mbs=1,dtype=bf16"),
    ("tl-full-recompute", TINYLLAMA, 2048, "dp=1,gbs=8,mbs=4,dtype=bf16,recompute=full"),
    ("tl-selective", TINYLLAMA, 2048, "dp=1,gbs=8,mbs=4,dtype=bf16,recompute=selective"),
    ("tl-unfused-attn", TINYLLAMA, 2048, "dp=1,gbs=4,mbs=2,dtype=bf16,flash_attention=0"),
    ("tl-offload", TINYLLAMA, 2048, "dp=1,gbs=8,mbs=4,dtype=bf16,offload=optimizer"),
    ("tl-fp32", TINYLLAMA, 1024, "dp=1,gbs=4,mbs=2,dtype=fp32"),
    ("tl-seq8k", TINYLLAMA, 8192, "dp=1,gbs=2,mbs=1,dtype=bf16,recompute=selective"),
    ("moe-mbs4", MOE, 2048, "dp=1,gbs=8,mbs=4,dtype=bf16"),
]
# the trace profile is fitted to these; the others are held out. One is launch-bound (mbs 1): in the
# others the GPU is the bottleneck, which cannot tell the host's cost per operator from the device's.
CALIBRATE = ("tl-mbs4", "tl-mbs1", "tl-full-recompute", "tl-offload", "moe-mbs4")


def run(out: str, only: list[str], backend: str, in_process: bool = False) -> int:
    import torch

    from simexec.errors import SimexecError
    from simexec.exec.api import execute, execute_in_process

    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    machine = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
               "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "backend": backend}
    runs = []
    if in_process:  # no Ray: the one rank runs here (a GPU machine where Ray is not installed)
        owned, stop = False, lambda owned: None
        machine["backend"] = "in process"
    else:
        from simexec.exec.runtime.launcher import start_ray, stop_ray

        owned, stop = start_ray(), stop_ray
    try:
        for name, model, seq, plan in PLANS:
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            try:
                if in_process:
                    res = execute_in_process(str(ROOT / model), CLUSTER, plan, steps=STEPS, seq_len=seq,
                                             device="cpu" if backend == "gloo" else None,
                                             trace_path=dest / f"{name}.json.gz")
                else:
                    res = execute(str(ROOT / model), CLUSTER, plan, steps=STEPS, seq_len=seq, backend=backend,
                                  timeout_s=300, trace_path=dest / f"{name}.json.gz")
            except SimexecError as exc:
                print(f"{name}: {exc}", flush=True)
                runs.append({"name": name, "model": model, "seq_len": seq, "plan": plan, "error": str(exc)})
                continue
            runs.append({"name": name, "model": model, "seq_len": seq, "plan": plan,
                         "step_time_s": res.step_time_s, "step_times_s": res.step_times_s,
                         "peak_memory_bytes": res.peak_memory_bytes_per_rank.get(0), "losses": res.losses})
            print(f"{name}: {res.step_time_s * 1e3:.1f} ms, peak {res.peak_memory_bytes_per_rank.get(0, 0) / 2**30:.2f} "
                  f"GiB, losses {res.losses[0]:.3f} -> {res.losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    finally:
        stop(owned)
    (dest / "manifest.json").write_text(json.dumps({"machine": machine, "steps": STEPS, "runs": runs}, indent=1))
    return 0


def calibrate(src: str, out: str) -> int:
    from simexec.calibrate.traces import calibrate_from_traces

    paths = [Path(src) / f"{name}.json.gz" for name in CALIBRATE]
    recorded = json.loads((Path(src) / "manifest.json").read_text())["machine"].get("measured_at")
    prof = calibrate_from_traces(paths, CLUSTER, out, base_profile=PROFILE, name="h100-traces", measured_at=recorded)
    print(f"wrote {out}: " + ", ".join(f"{k} {v:.4g}" for k, v in prof["fit"]["params"].items()))
    return 0


def _fmt_err(x) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


BEGIN, END = "<!-- gpu_steps:begin -->", "<!-- gpu_steps:end -->"
PROFILES = (("datasheet", None), ("kernels", PROFILE), ("traces", TRACE_PROFILE))


def report(src: str, markdown: str | None, json_out: str | None) -> int:
    from simexec.trace.compare import compare
    from simexec.validation.markdown import replace_block
    from simexec.sim.simulate import simulate
    from simexec.trace.schema import Trace

    manifest = json.loads((Path(src) / "manifest.json").read_text())
    rows, details = [], []
    for r in manifest["runs"]:
        role = "calibrate" if r["name"] in CALIBRATE else "held out"
        if r.get("error"):
            rows.append(f"| {r['name']} | {role} | `{r['plan']}` | failed: {r['error']} |" + " |" * 5)
            continue
        measured = Trace.load(str(Path(src) / f"{r['name']}.json.gz"))
        out = {"name": r["name"], "role": role, "model": r["model"], "plan": r["plan"],
               "measured_s": r["step_time_s"], "measured_peak_bytes": r["peak_memory_bytes"]}
        for label, profile in PROFILES:
            sim = simulate(str(ROOT / r["model"]), CLUSTER, r["plan"], r["seq_len"], symmetric=False, profile=profile,
                           trace=True)
            cmp = compare(sim.trace, measured)
            top = sorted(cmp.op_class_errors.items(), key=lambda kv: -kv[1]["measured_us"])[:3]
            out[label] = {"step_time_s": sim.step_time_s, "step_time_error": cmp.step_time_error,
                          "peak_memory_error": cmp.peak_memory_error,
                          "op_classes": {k: {"median_ratio": v["median_ratio"], "measured_ms": v["measured_us"] / 1e3,
                                             "predicted_ms": v["predicted_us"] / 1e3} for k, v in top}}
        details.append(out)
        cells = " | ".join(f"{out[label]['step_time_s'] * 1e3:.1f} ({_fmt_err(out[label]['step_time_error'])})"
                           for label, _ in PROFILES)
        classes = ", ".join(f"{k} {v['median_ratio']:.2f}" for k, v in out["kernels"]["op_classes"].items())
        rows.append(f"| {r['name']} | {role} | `{r['plan']}` | {r['step_time_s'] * 1e3:.1f} | {cells} | "
                    f"{r['peak_memory_bytes'] / 2**30:.2f} | {_fmt_err(out['datasheet']['peak_memory_error'])} | "
                    f"{classes} |")
    m = manifest["machine"]

    def mape(label: str, held_out: bool) -> str:
        errs = [abs(x[label]["step_time_error"]) for x in details
                if x[label]["step_time_error"] is not None and (x["role"] == "held out" or not held_out)]
        return f"{sum(errs) / len(errs):.1%}" if errs else "n/a"

    worst_mem = max((abs(x["datasheet"]["peak_memory_error"]) for x in details
                     if x["datasheet"]["peak_memory_error"] is not None), default=float("nan"))
    text = "\n".join([
        BEGIN, "",
        f"Measured {m['measured_at']} on {m['gpu']} (torch {m['torch']}, CUDA {m['cuda']}, backend {m['backend']}), "
        f"{manifest['steps']} steps per plan, the median after the warm-up step. Regenerate with the commands in "
        "`scripts/gpu_steps.py` (the recorded run is `traces/gpu/steps`).", "",
        "| plan | role | knobs | measured ms | datasheet ms (error) | kernel profile ms (error) | "
        "trace profile ms (error) | measured peak GiB | peak error | pred/meas median per op class (kernel profile) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |", *rows, "",
        "| step-time MAPE | datasheet preset | kernel profile | trace profile |", "| --- | ---: | ---: | ---: |",
        f"| all {len(details)} plans | {mape('datasheet', False)} | {mape('kernels', False)} | "
        f"{mape('traces', False)} |",
        f"| held out | {mape('datasheet', True)} | {mape('kernels', True)} | {mape('traces', True)} |", "",
        f"Worst peak-memory error (the profiles do not change memory): {worst_mem:.1%}.", "", END])
    print(text)
    if json_out:
        Path(json_out).write_text(json.dumps({"machine": m, "plans": details}, indent=1))
    if markdown:
        replace_block(Path(markdown), text, BEGIN, END, new_doc="# Whole training steps on one H100\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute the plans on this machine's GPU")
    r.add_argument("--out", required=True)
    r.add_argument("--only", nargs="*", default=[], help="plan names (default: all)")
    r.add_argument("--backend", default="nccl", choices=("nccl", "gloo"), help="gloo: a CPU dry run")
    r.add_argument("--in-process", action="store_true", help="run the one rank in this process, without Ray")
    c = sub.add_parser("calibrate", help="fit the trace profile to the calibration plans")
    c.add_argument("src")
    c.add_argument("--out", default=TRACE_PROFILE)
    p = sub.add_parser("report", help="simulate the same plans and compare")
    p.add_argument("src")
    p.add_argument("--markdown", default=None)
    p.add_argument("--json", default=None)
    args = ap.parse_args()
    from simexec.errors import SimexecError

    try:
        if args.cmd == "run":
            return run(args.out, args.only, args.backend, args.in_process)
        if not (Path(args.src) / "manifest.json").is_file():
            raise SimexecError(f"{args.src}: no manifest.json (the output of `gpu_steps.py run --out DIR`)")
        if args.cmd == "calibrate":
            return calibrate(args.src, args.out)
        return report(args.src, args.markdown, args.json)
    except SimexecError as exc:
        print(f"gpu_steps: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
