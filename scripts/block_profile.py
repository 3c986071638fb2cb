"""Where the time of one instruction goes: a one-rank program under torch.profiler, per instance.

`simexec compare` says which instruction a prediction misses; this script says what the executor
does inside it. It runs a one-rank plan in this process (`execute_in_process`: no Ray; one GPU, or
the CPU), the interpreter's instructions as profiler ranges, and for every instance of the named block
(`--block experts`) in the last step reports:

- the instruction's span as the tracer measures it (CUDA events on a GPU),
- the host's time inside its range, and how much of it went to synchronising calls
  (cudaStreamSynchronize, cudaMemcpy, cudaDeviceSynchronize, cudaEventSynchronize) and to the
  allocator's cudaMalloc/cudaFree,
- the device time of the kernels it launched, and the slowest operators and kernels.

    python scripts/block_profile.py run --model traces/gpu/mixtral-mini.json \\
        --plan dp=1,gbs=8,mbs=4,dtype=bf16 --seq-len 2048 --block experts --out DIR   # on the GPU
    python scripts/block_profile.py report DIR --block experts                         # anywhere

`run` writes DIR/profile.json.gz (the Chrome trace of every step), DIR/trace.json.gz (the measured
trace, `simexec.exec.api.execute_in_process`) and prints the report.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CLUSTER = str(ROOT / "traces/gpu/h100-1gpu.yaml")

from simexec.trace.profiler import block_instances, gemm_shapes  # noqa: E402


def run(args) -> int:
    from simexec.exec.api import execute_in_process

    out = Path(args.out)
    res = execute_in_process(args.model, args.cluster, args.plan, steps=args.steps, seq_len=args.seq_len,
                             trace_path=out / "trace.json.gz", profile_dir=out)
    raw = out / "rank0.pt.trace.json"
    with open(raw, "rb") as src, gzip.open(out / "profile.json.gz", "wb") as dst:
        dst.write(src.read())
    raw.unlink()
    print("step times ms: " + ", ".join(f"{t * 1e3:.1f}" for t in res.step_times_s))
    return report(argparse.Namespace(dir=args.out, block=args.block, top=args.top))


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def report(args) -> int:
    src = Path(args.dir)
    if not (src / "profile.json.gz").is_file():
        sys.exit(f"block_profile: {src}: no profile.json.gz (the output of `block_profile.py run --out DIR`)")
    events = _events(src / "profile.json.gz")
    rows = block_instances(events, args.block)
    if not rows:
        sys.exit(f"block_profile: no instruction named *.{args.block}* in {src / 'profile.json.gz'}")
    spans = {}
    if (src / "trace.json.gz").exists():  # the measured trace: one step of the second half (pick_step)
        from simexec.trace.schema import Trace

        spans = {e.id.split(":", 1)[-1]: e.dur_us for e in Trace.load(src / "trace.json.gz").events}
    by_phase: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_phase[r["name"].split(".")[0]].append(r)
    for phase, mine in sorted(by_phase.items(), key=lambda kv: kv[0] != "fwd"):
        _report_phase(phase, mine, spans, args)
    split = gemm_shapes(events, args.block)
    if split["met"] or split["new"]:
        n = len(split["met"]) + len(split["new"])
        print(f"GEMMs in .{args.block} over the run: {len(split['new'])} of {n} of a shape not met before; host "
              + ", ".join(f"{k} {statistics.median(v):.1f} us" for k, v in split.items() if v) + " (medians)")
    return 0


def _report_phase(phase: str, rows: list[dict], spans: dict, args) -> None:
    print(f"{phase}.{args.block}: {len(rows)} instances in the last step (ms, median over instances)")
    cols = ("host_us", "sync_us", "alloc_us", "kernel_us", "device_span_us", "gap_before_first_kernel_us")
    for c in cols:
        print(f"  {c[:-3]:28s} {statistics.median(r[c] for r in rows) / 1e3:8.3f}")
    tracer = statistics.median(spans.get(r["name"], float("nan")) for r in rows) / 1e3
    print(f"  {'traced span':28s} {tracer:8.3f}")
    print(f"  operators {statistics.median(r['ops'] for r in rows):.0f}, kernels "
          f"{statistics.median(r['kernels'] for r in rows):.0f}, allocator calls "
          f"{statistics.median(r['allocs'] for r in rows):.0f} per instance")
    for key, label in (("top_ops", "operators by host time"), ("top_kernels", "kernels by device time")):
        total: dict[str, float] = defaultdict(float)
        for r in rows:
            for name, us in r[key]:
                total[name] += us / len(rows)
        if not total:
            continue
        print(f"  {label} (ms per instance; nested operators overlap):")
        for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"    {us / 1e3:8.3f}  {name}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a one-rank plan under the profiler and report one block")
    r.add_argument("--model", required=True)
    r.add_argument("--cluster", default=CLUSTER)
    r.add_argument("--plan", required=True)
    r.add_argument("--seq-len", type=int, default=None)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--block", required=True, help="instruction block to report, e.g. experts")
    r.add_argument("--top", type=int, default=8)
    r.add_argument("--out", required=True)
    p = sub.add_parser("report", help="report one block of a profile `run` wrote")
    p.add_argument("dir")
    p.add_argument("--block", required=True)
    p.add_argument("--top", type=int, default=8)
    args = ap.parse_args(argv)
    from simexec.errors import SimexecError

    try:
        return run(args) if args.cmd == "run" else report(args)
    except SimexecError as exc:
        print(f"block_profile: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
