"""Does the simulator rank 3D topologies the way BigScience measured them for BLOOM-176B?

    python scripts/validate_topologies.py                                  # every run, a table on stdout
    python scripts/validate_topologies.py --markdown docs/validation.md    # and the table in the docs
    python scripts/validate_topologies.py --json out.json

Before training BLOOM, BigScience timed candidate (dp, tp, pp, micro-batch) splits of GPT models of
176B-206B parameters on the 48 Jean Zay nodes they trained on, under the software they trained with
(tests/data/published/bigscience_tr11_topologies.csv, with its source). Unlike Megatron-LM's Table 1,
which fixes one plan per model, these are several plans of the same model measured on the same
machine on the same day: what a plan search claims to rank.

Each run is simulated under `bloom_recipe` (validate_published.py: bf16, DeepSpeed's BF16 optimizer
with ZeRO-1, full recompute, fused softmax without FlashAttention, DeepSpeed's pipeline, the
'type:transformer|embedding' partition) on `jean_zay(48)`. Checks:

- **fits**: the simulator fits every run that ran and refuses every run that ran out of memory;
- **order**: within each model (same layers, hidden and heads), every two runs whose measured times
  differ by more than `TIE` come out in the measured order.

The step-time error of each run is reported, not checked (finding 8: the BLOOM recipe runs about 11%
fast); only the runs' order and fit are the simulator's claim here.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # validate_published, beside this script

from simexec.validation.markdown import replace_block  # noqa: E402
from simexec.outputs import outputs_refused, write_atomic  # noqa: E402
from simexec.specs.plan import Plan  # noqa: E402
from simexec.sim.simulate import simulate  # noqa: E402
from validate_published import SEQ, bloom_model, bloom_recipe, jean_zay, read_published_csv  # noqa: E402

CSV = Path(__file__).resolve().parents[1] / "tests" / "data" / "published" / "bigscience_tr11_topologies.csv"
NODES = 48
TIE = 0.05  # measured times closer than this are a tie: the simulator's median error on Table 1, rounded up
BEGIN, END = "<!-- topologies:begin -->", "<!-- topologies:end -->"


def read_runs(path: Path = CSV) -> list[dict]:
    """The measured runs: shape (layers, hidden, heads), split (dp, tp, pp, mbs), gbs, memory, time, OOM."""
    runs = []
    for d in read_published_csv(path):
        runs.append({**{k: int(d[k]) for k in ("layers", "hidden", "heads", "dp", "tp", "pp", "mbs", "gbs")},
                     "mem_gb": float(d["mem_gb"]) if d["mem_gb"] else None,
                     "sec_per_it": float(d["sec_per_it"]) if d["sec_per_it"] else None,
                     "oom": d["oom"] == "1"})
    return runs


def model_of(run: dict):
    """BLOOM's architecture (ALiBi, LayerNorm, GeLU, biases, tied 250,880-token vocabulary) at the run's shape."""
    h, a = run["hidden"], run["heads"]
    return bloom_model().model_copy(update={"name": f"bloom-{run['layers']}x{h}-a{a}", "layers": run["layers"],
                                            "hidden": h, "heads": a, "kv_heads": a, "head_dim": h // a, "ffn": 4 * h})


def plan_of(run: dict, model) -> str:
    """The BLOOM recipe at the run's split, with DeepSpeed's partition of `model`'s layers."""
    return Plan(**bloom_recipe(model, run["tp"], run["pp"]), dp=run["dp"], mbs=run["mbs"], gbs=run["gbs"]).to_string()


def simulate_run(run: dict) -> dict:
    """One run's prediction: step time, peak memory, fits."""
    t0 = time.perf_counter()
    model = model_of(run)
    plan = plan_of(run, model)
    res = simulate(model, jean_zay(NODES), plan, SEQ)
    out = {**run, "model": model.name, "plan": plan, "predicted_s": res.step_time_s, "peak_gib": res.peak_memory_bytes / 2**30,
           "fits": res.fits, "wall_s": time.perf_counter() - t0}
    out["fit_agrees"] = out["fits"] == (not run["oom"])
    if run["sec_per_it"] is not None:
        out["error"] = res.step_time_s / run["sec_per_it"] - 1.0
    return out


def order_checks(results: list[dict]) -> list[dict]:
    """Every two measured runs of one model whose times differ by more than TIE: does the simulator agree?"""
    checks = []
    for a, b in combinations([r for r in results if r["sec_per_it"] is not None], 2):
        if (a["layers"], a["hidden"], a["heads"]) != (b["layers"], b["hidden"], b["heads"]):
            continue
        fast, slow = (a, b) if a["sec_per_it"] < b["sec_per_it"] else (b, a)
        if slow["sec_per_it"] / fast["sec_per_it"] - 1.0 <= TIE:
            continue
        checks.append({"model": fast["model"], "faster": split(fast), "slower": split(slow),
                       "measured_ratio": slow["sec_per_it"] / fast["sec_per_it"],
                       "predicted_ratio": slow["predicted_s"] / fast["predicted_s"],
                       "holds": slow["predicted_s"] > fast["predicted_s"]})
    return checks


def split(run: dict) -> str:
    return f"dp {run['dp']} x tp {run['tp']} x pp {run['pp']}, mbs {run['mbs']}"


def to_markdown(results: list[dict], checks: list[dict], command: str) -> str:
    lines = [BEGIN, "", f"Generated by `{command}`.", "",
             "| model (layers x hidden, heads) | split | measured (s/it) | predicted (s) | error | measured memory | "
             "predicted peak | fits as measured |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        measured = "OOM" if r["oom"] else f"{r['sec_per_it']:.2f}"
        err = f"{100 * r['error']:+.1f}%" if "error" in r else ""
        mem = f"{r['mem_gb']:g} GB" if r["mem_gb"] else ""
        peak = f"{r['peak_gib']:.1f} GiB" + ("" if r["fits"] else " (OOM)")
        lines.append(f"| {r['layers']} x {r['hidden']}, {r['heads']} | {split(r)} | {measured} | "
                     f"{r['predicted_s']:.2f} | {err} | {mem} | {peak} | {'yes' if r['fit_agrees'] else '**no**'} |")
    fit_ok = sum(r["fit_agrees"] for r in results)
    lines += ["", f"Fits as measured: {fit_ok} of {len(results)} runs.", "",
              f"Orders (runs of one model whose measured times differ by more than {100 * TIE:g}%):", "",
              "| model | faster | slower | measured slower/faster | predicted | holds |",
              "| --- | --- | --- | ---: | ---: | --- |"]
    for c in checks:
        lines.append(f"| {c['model']} | {c['faster']} | {c['slower']} | {c['measured_ratio']:.3f} | "
                     f"{c['predicted_ratio']:.3f} | {'yes' if c['holds'] else '**no**'} |")
    lines += ["", f"{sum(c['holds'] for c in checks)} of {len(checks)} orders hold.", "", END]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", help="write the tables into this file (between their markers)")
    ap.add_argument("--json", help="write {'runs': [...], 'orders': [...]} here")
    args = ap.parse_args(argv)
    if outputs_refused("validate_topologies.py", {"--markdown": args.markdown, "--json": args.json}):
        return 2
    results = []
    for run in read_runs():
        r = simulate_run(run)
        results.append(r)
        measured = "OOM" if run["oom"] else f"{run['sec_per_it']:.2f} s"
        print(f"{r['model']:22s} {split(run):28s} measured {measured:>9s}  predicted {r['predicted_s']:7.2f} s"
              f"  peak {r['peak_gib']:5.1f} GiB {'fits' if r['fits'] else 'OOM '}"
              f"{'' if r['fit_agrees'] else '  (fit disagrees)'}  ({r['wall_s']:.0f} s)", flush=True)
    checks = order_checks(results)
    for c in checks:
        print(f"{c['model']}: {c['faster']} before {c['slower']}: measured {c['measured_ratio']:.3f}, "
              f"predicted {c['predicted_ratio']:.3f} {'holds' if c['holds'] else 'FAILS'}")
    if args.json:
        write_atomic(args.json, json.dumps({"tie": TIE, "runs": results, "orders": checks}, indent=1).encode())
    if args.markdown:
        replace_block(Path(args.markdown), to_markdown(results, checks, "python scripts/validate_topologies.py "
                                                                        f"--markdown {args.markdown}"),
                      BEGIN, END, new_doc="")
    ok = all(r["fit_agrees"] for r in results) and all(c["holds"] for c in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
