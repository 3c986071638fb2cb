"""Hold the failure and checkpoint model (simexec.sim.goodput) against published training runs.

    python scripts/validate_goodput.py                 # a table on stdout
    python scripts/validate_goodput.py --json out.json

Every row gives simexec's prediction with its defaults (Llama 3's failure rate per GPU-hour, Tectonic's
write bandwidth, async_save, an 11-minute restart), the published figure, and their ratio. No rate is
tuned to a row: where a run's figure implies another per-GPU rate, that rate is printed as a measured
fleet of its own (`simexec.sim.goodput.MEASURED_FAILURES_PER_GPU_HOUR`, `--failure-rate`).

Llama 3 405B ("The Llama 3 Herd of Models", Meta, arXiv:2407.21783, section 3.3.4 and Table 5):
16,384 H100 80GB GPUs, a 54-day snapshot of pre-training, 466 interruptions (47 planned, 419
unexpected) and "higher than 90% effective training time". The plan is the paper's (Table 4: TP 8,
CP 1, PP 16, DP 128, 16M-token batches of 8,192-token sequences; 126 layers, first and last stage one
layer short). The failure rate is Table 5's, so the unexpected-interruption count is an identity
(it checks the arithmetic, not the model); the effective training time is the prediction: Daly's
expected wall time with the plan's checkpoint (its model states, Tectonic's bandwidth, async_save)
and the default restart time, failures only (maintenance stops are not in the model).

OPT-175B (Meta's logbook notes, github.com/facebookresearch/metaseq, projects/OPT/chronicles/, commit
f2cd36798793604cf51ab8b8a2cb167c964f9667): 1,024 A100 80GB GPUs (128 nodes of 8; final_update.md),
the model is GPT-3 175B's shape (simexec's `gpt3-175b`), trained with FSDP and Megatron tensor
parallelism 8 (plan dp=128,tp=8,zero=3; 2M-token batches of 2,048-token sequences, gbs 1024).
Published: "~2 machines go down every day" (final_update.md); "40+ restarts" between the November
17 and December 3 2021 notes, "for a variety of hardware, infrastructure, or experimental stability
issues" (27_percent_update.md: a count that includes restarts the model has no cause for, so an upper
bound for hardware); a checkpoint of "1.6TB ... (992 files, each ~1.7GB)" (27_percent_update.md).
simexec's checkpoint is weights plus Adam's fp32 master and two moments (2 + 12 bytes per parameter).

Not included, because their figures could not be read from a primary source here: MegaScale
(arXiv:2402.15627), Meta's RSC-1/RSC-2 reliability study (arXiv:2410.21680), BLOOM's chronicles,
Alibaba's and ByteDance's other reports.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.sim.goodput import (DAY, HOUR, LLAMA3_INTERRUPTIONS, LLAMA3_PLANNED,  # noqa: E402
                                 MEASURED_FAILURES_PER_GPU_HOUR, OPT175B_MACHINE_FAILURES_PER_DAY, GoodputParams,
                                 goodput, plan_checkpoint)
from simexec.specs.cluster import get_cluster  # noqa: E402
from simexec.specs.model import get_model  # noqa: E402
from simexec.specs.plan import load_plan, resolve  # noqa: E402

LLAMA3_PLAN = "dp=128,tp=8,pp=16,stages=7," + "8," * 14 + "7,gbs=2048"
SOURCE = "The Llama 3 Herd of Models, arXiv:2407.21783, sec. 3.3.4, Table 5"
OPT_SOURCE = ("github.com/facebookresearch/metaseq projects/OPT/chronicles/{final_update,27_percent_update}.md "
              "@f2cd367")
OPT_PLAN = "dp=128,tp=8,zero=3,gbs=1024"
OPT_NOTE_DAYS = 16  # November 17 to December 3, 2021: the two notes between which the 40+ restarts fell


def llama3_rows(params: GoodputParams) -> list[dict]:
    rp = resolve(get_model("llama3-405b"), get_cluster("2048xdgx-h100"), load_plan(LLAMA3_PLAN))
    ckpt = plan_checkpoint(rp, params)
    days = 54
    # Daly's wall time is linear in the work: the goodput of any run length is the same ratio.
    g = goodput(DAY, rp.world, ckpt, params)
    predicted_failures = days * DAY / g.mtbf_s
    return [
        {"run": "llama3-405b", "quantity": "unexpected interruptions in 54 days (identity: rate from this run)",
         "predicted": predicted_failures, "published": sum(LLAMA3_INTERRUPTIONS.values()), "source": SOURCE},
        {"run": "llama3-405b", "quantity": "all interruptions in 54 days (+47 planned, not modelled)",
         "predicted": predicted_failures + LLAMA3_PLANNED, "published": 466, "source": SOURCE},
        {"run": "llama3-405b", "quantity": "effective training time (published: > 90%)",
         "predicted": g.goodput, "published": 0.90, "bound": ">", "source": SOURCE,
         "detail": {"mtbf_h": g.mtbf_s / HOUR, "checkpoint_tb": ckpt.total_bytes / 1e12,
                    "blocking_s": ckpt.blocking_s, "write_s": ckpt.write_s, "interval_min": g.interval_s / 60,
                    "restart_min": g.restart_s / 60}},
    ]


def opt175b_rows(params: GoodputParams) -> list[dict]:
    rp = resolve(get_model("gpt3-175b"), get_cluster("128xdgx-a100-80g"), load_plan(OPT_PLAN))
    ckpt = plan_checkpoint(rp, params)
    g = goodput(DAY, rp.world, ckpt, params)
    per_day = DAY / g.mtbf_s
    return [
        {"run": "opt-175b", "quantity": "machine failures per day on 1,024 A100s (published: ~2)",
         "predicted": per_day, "published": OPT175B_MACHINE_FAILURES_PER_DAY, "source": OPT_SOURCE,
         "detail": {"mtbf_h": g.mtbf_s / HOUR, "implied_rate_per_gpu_hour":
                    MEASURED_FAILURES_PER_GPU_HOUR["opt-175b (1,024 A100, cloud, 2021)"]}},
        {"run": "opt-175b", "quantity": "restarts in 16 days (published 40+, incl. instability: upper bound)",
         "predicted": per_day * OPT_NOTE_DAYS, "published": 40, "bound": "<", "source": OPT_SOURCE},
        {"run": "opt-175b", "quantity": "checkpoint TB (published 992 files x ~1.7 GB)",
         "predicted": ckpt.total_bytes / 1e12, "published": 992 * 1.7e9 / 1e12, "source": OPT_SOURCE},
        {"run": "opt-175b", "quantity": "effective training time at the default rate (not published)",
         "predicted": g.goodput, "published": None, "source": OPT_SOURCE},
        {"run": "opt-175b", "quantity": "effective training time at OPT's own rate (not published)",
         "predicted": goodput(DAY, rp.world, ckpt, GoodputParams(
             failures_per_gpu_hour=MEASURED_FAILURES_PER_GPU_HOUR["opt-175b (1,024 A100, cloud, 2021)"],
             storage_write_bw_per_node=params.storage_write_bw_per_node, restart_s=params.restart_s,
             async_checkpoint=params.async_checkpoint)).goodput, "published": None, "source": OPT_SOURCE},
    ]


def _verdict(r: dict) -> str:
    if r.get("published") is None:
        return ""
    if r.get("bound") == ">":
        return "  ok" if r["predicted"] > r["published"] else "  MISSED"
    if r.get("bound") == "<":
        return "  ok (within)" if r["predicted"] <= r["published"] else "  MISSED"
    return ""


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write {'rows': [...], 'measured_fleets': {...}} here")
    args = ap.parse_args(argv)
    params = GoodputParams()
    rows = llama3_rows(params) + opt175b_rows(params)
    print(f"  {'run':<12} {'quantity':<70} {'predicted':>10} {'published':>10} {'ratio':>7}")
    for r in rows:
        pub = r["published"]
        ratio = r["predicted"] / pub if pub else None
        r["ratio"] = ratio
        print(f"  {r['run']:<12} {r['quantity']:<70} {r['predicted']:10.4g} "
              f"{'-' if pub is None else format(pub, '.4g'):>10} {'-' if ratio is None else format(ratio, '.3f'):>7}"
              f"{_verdict(r)}")
        if "detail" in r:
            print("    " + ", ".join(f"{k} {v:.3g}" for k, v in r["detail"].items()))
    print("  measured fleets (interruptions per GPU-hour; simexec --failure-rate):")
    for name, rate in MEASURED_FAILURES_PER_GPU_HOUR.items():
        print(f"    {name:<40} {rate:.3g}")
    print(f"  sources: {SOURCE}; {OPT_SOURCE}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "measured_fleets": MEASURED_FAILURES_PER_GPU_HOUR},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
