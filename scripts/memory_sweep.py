#!/usr/bin/env python
"""Each rank's measured peak memory against the simulator's prediction, over a list of plans.

    python scripts/memory_sweep.py                                  # the default sweep (bf16, seq 64)
    python scripts/memory_sweep.py --model gpt-tiny "dp=2,zero=3,gbs=8,mbs=4,dtype=bf16"
    python scripts/memory_sweep.py --json sweep.json

Runs two steps of every plan on local Ray CPU ranks (one actor pool for the whole sweep) and
compares the executor's per-rank peak (every live tensor storage, `simexec.exec.measure.live_memory`) with
`simexec simulate` on the same plan string, dtype included. The default sweep covers every memory
feature the executor runs: ZeRO stages and flavours, tp, the pipeline schedules, recompute,
offload, the three context-parallel implementations, experts, latent attention, a sliding window,
tied embeddings, and RMSNorm models (q/k norms, latent attention, windows) under tp, sp and pp. The
errors are signed: above zero, the rank held more than predicted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simexec.errors import SimexecError  # noqa: E402
from simexec.outputs import outputs_refused, write_atomic  # noqa: E402

SEQ = 64
_BF16 = ",gbs=8,dtype=bf16"
DEFAULT_SWEEP: list[tuple[str, str]] = [
    *[("gpt-tiny", p + _BF16) for p in (
        "dp=2,mbs=4", "dp=2,zero=1,mbs=4", "dp=2,zero=2,mbs=4", "dp=2,zero=3,mbs=4",
        "dp=2,zero=3,zero_impl=yafsdp,mbs=4", "dp=2,zero=3,zero_impl=deepspeed,mbs=4", "tp=2,mbs=4", "pp=2,mbs=4,schedule=gpipe", "pp=2,mbs=4,schedule=zb-h1",
        "pp=2,vpp=2,mbs=2", "pp=2,vpp=2,schedule=interleaved-zb,mbs=2", "pp=2,vpp=2,schedule=zb-v,mbs=2",
        "pp=2,vpp=2,schedule=dualpipev,mbs=2", "dp=2,recompute=full,mbs=4",
        "dp=2,recompute=selective,mbs=4", "dp=2,offload=optimizer,mbs=4", "cp=2,mbs=4", "cp=2,cp_impl=ring,mbs=4",
        "cp=2,cp_impl=a2a,mbs=4")],
    ("moe-tiny", "dp=2,ep=2,mbs=4" + _BF16), ("moe-tiny", "tp=2,mbs=4" + _BF16),
    ("moe-tiny", "dp=2,ep=2,pp=2,vpp=2,mbs=2,gbs=16,dtype=bf16,schedule=dualpipev,dualpipe_overlap=1"),
    ("tests/data/moe-cap-tiny.yaml", "dp=2,ep=2,mbs=4" + _BF16),  # experts cut and padded to capacity
    ("tests/data/mla-tiny.yaml", "tp=2,mbs=4" + _BF16), ("tests/data/window-tiny.yaml", "dp=1,mbs=4" + _BF16),
    ("tests/data/gpt-tiny-tied.yaml", "pp=2,mbs=4" + _BF16), ("gpt-tiny", "dp=1,gbs=16,mbs=16,dtype=bf16"),
    ("tests/data/gpt-tiny-tied.yaml", "pp=2,vpp=2,schedule=zb-v,mbs=2" + _BF16),  # the V: one embedding for the head
    ("tests/data/gpt-tiny-tied.yaml", "dp=2,pp=2,zero=1,mbs=2" + _BF16),  # the tied sum before the reduce-scatter
    # main gradients: fp32 buckets, shards and buffers beside bf16 parameters
    *[("gpt-tiny", p + _BF16 + ",grad_fp32=1") for p in ("dp=2,mbs=4", "dp=2,zero=3,mbs=4", "dp=2,zero=3,zero_impl=yafsdp,mbs=4")],
    # DeepSpeed's BF16_Optimizer path over a pipeline; parameters gathered in the next forward
    ("gpt-tiny", "dp=2,pp=2,zero=1,mbs=2,grad_fp32=1,grad_allreduce=1,grad_overlap=0" + _BF16),
    ("gpt-tiny", "dp=2,zero=2,mbs=4,param_overlap=1" + _BF16),
    # weight gradients under the input gradients' tp collectives: what they read lives until they run
    ("gpt-tiny", "tp=2,mbs=4,tp_overlap=1" + _BF16), ("gpt-tiny", "tp=2,sp=1,mbs=4,tp_overlap=1" + _BF16),
    ("moe-tiny", "dp=2,ep=2,tp=2,mbs=2,tp_overlap=1" + _BF16),
    # RMSNorm models: the CPU kernels' backward buffers, q/k norms, latent norms, windows under tp, sp, pp
    *[("tests/data/window-tiny.yaml", p + _BF16) for p in ("tp=2,mbs=4", "pp=2,mbs=4", "pp=2,mbs=4,schedule=zb-h1")],
    *[("tests/data/qk-norm-tiny.yaml", p + _BF16) for p in ("tp=2,mbs=4", "tp=2,sp=1,mbs=4", "pp=2,mbs=4")],
    ("tests/data/qk-norm-tiny.yaml", "dp=1,gbs=8,mbs=4,dtype=fp32"),
    *[("tests/data/mla-tiny.yaml", p + _BF16) for p in ("tp=2,sp=1,mbs=4", "pp=2,mbs=4", "pp=2,mbs=4,schedule=zb-h1")],
]


def _model(name: str):
    from simexec.specs.model import get_model

    path = ROOT / name
    return get_model(str(path) if path.suffix in (".yaml", ".yml") and path.exists() else name)


def sweep(cases: list[tuple[str, str]], seq_len: int, ray_address=None) -> list[dict]:
    """One row per plan: measured and predicted peak bytes per rank and the signed errors."""
    from simexec.calibrate.runs import Session
    from simexec.sim.simulate import simulate

    rows = []
    with Session(ray_address=ray_address, measure_load=False) as session:
        for model_name, plan in cases:
            model = _model(model_name)
            predicted = simulate(model, "local", plan, seq_len=seq_len).peak_memory_bytes_per_rank
            measured = session.execute(model, plan, steps=2, seq_len=seq_len).result.peak_memory_bytes_per_rank
            ranks = sorted(measured)
            errors = [measured[r] / predicted[r] - 1 for r in ranks]
            rows.append({"model": model_name, "plan": plan, "measured_bytes": [measured[r] for r in ranks],
                         "predicted_bytes": [round(predicted[r]) for r in ranks], "errors": errors})
            worst = max(errors, key=abs)
            print(f"{model_name:30s} {plan:52s} worst rank {worst:+6.1%}  "
                  f"({', '.join(f'{e:+.1%}' for e in errors)})", flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    worst = [abs(max(r["errors"], key=abs)) for r in rows]
    return {"plans": len(rows), "median_worst_rank_abs_error": statistics.median(worst),
            "max_worst_rank_abs_error": max(worst), "within_5pct": sum(w <= 0.05 for w in worst)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plans", nargs="*", help="plan strings (default: the built-in sweep); dtype as given")
    ap.add_argument("--model", default="gpt-tiny", help="the model of the plans given (default gpt-tiny)")
    ap.add_argument("--seq-len", type=int, default=SEQ)
    ap.add_argument("--ray-address", default=None)
    ap.add_argument("--json", default=None, help="write the rows and a summary here")
    args = ap.parse_args(argv)
    if outputs_refused("memory_sweep.py", {"--json": args.json}):
        return 2
    cases = [(args.model, p) for p in args.plans] if args.plans else DEFAULT_SWEEP
    try:
        rows = sweep(cases, args.seq_len, args.ray_address)
        s = summary(rows)
        print(f"{s['plans']} plans: worst-rank |error| median {s['median_worst_rank_abs_error']:.1%}, "
              f"max {s['max_worst_rank_abs_error']:.1%}; {s['within_5pct']} within 5%")
        if args.json:
            text = json.dumps({"seq_len": args.seq_len, "rows": rows, "summary": s}, indent=1) + "\n"
            write_atomic(args.json, text.encode())
    except SimexecError as exc:  # a bad plan or model, a failed run, an output that cannot be written
        print(f"memory_sweep.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
