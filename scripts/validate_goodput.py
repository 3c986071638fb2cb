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

BLOOM-176B (BigScience's chronicles and README, github.com/bigscience-workshop/bigscience at e726b15,
train/tr11-176B-ml/; "The Technology Behind BLOOM Training", huggingface/blog at 03cd167,
bloom-megatron-deepspeed.md): 384 A100 80GB on Jean Zay, TP 4, PP 12, DP 8 (simexec.validation.published's
BLOOM recipe). Published: "1-2 GPU failures a week"; a checkpoint of "2.3TB" ("just the bf16 weights are
329GB": 176.2e9 x 2 bytes in GiB, so binary units) saved "in 40 secs" to GPFS.

MegaScale (ByteDance, arXiv:2402.15627, sections 4.4 and 6.3; its section 6.1 plan for 175B: TP 8, PP 8,
6 virtual stages, batch 6144 on 12,288 GPUs): a production run on "more than 10,000 GPUs" restarted "over 100
times" in "several weeks"; detection and diagnosis take "less than 10 minutes", catching up from the latest
checkpoint "within 15 minutes", and the effective training time is "over 90%". The model is simexec's
`gpt3-175b` under that plan on 12,288 A100s (the production model is undisclosed: "hundreds of billions of
parameters"); the restart is the two published upper bounds together (25 min), so the prediction is a lower
bound.

Not included: Meta's RSC-1/RSC-2 study (arXiv:2410.21680; its rates could be read only from secondary
summaries here), ByteRobust (arXiv:2509.16293: 97% ETTR on 9,600 GPUs, without failure counts or restart
times in its abstract), Gemini (no chip or failure counts), Alibaba's reports.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
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


BLOOM_SOURCE = ("github.com/bigscience-workshop/bigscience@e726b15 train/tr11-176B-ml/{chronicles,README}.md; "
                "huggingface/blog@03cd167 bloom-megatron-deepspeed.md")
BLOOM_FAILURES_PER_WEEK = (1, 2)  # "On average we were getting 1-2 GPU failures a week"
BLOOM_CHECKPOINT_TIB = 2.3  # "each checkpoint with fp32 optim states and bf16+fp32 weights is 2.3TB"
BLOOM_CHECKPOINT_SAVE_S = 40  # "A checkpoint is saved in 40 secs"
MEGASCALE_SOURCE = "MegaScale, arXiv:2402.15627, sections 4.4, 6.1, 6.3"
MEGASCALE_PLAN = "dp=192,tp=8,pp=8,vpp=6,zero=1,gbs=6144"
MEGASCALE_RESTART_S = (10 + 15) * 60.0  # detection and diagnosis "less than 10 minutes" + catch-up "within 15"


def bloom_rows(params: GoodputParams) -> list[dict]:
    from simexec.specs.plan import Plan
    from simexec.validation.published import bloom_model, bloom_recipe, jean_zay

    model = bloom_model()
    plan = Plan(**bloom_recipe(model, 4, 12), dp=8, mbs=2, gbs=2048).to_string()
    rp = resolve(model, jean_zay(48), load_plan(plan))
    ckpt = plan_checkpoint(rp, params)
    g = goodput(DAY, rp.world, ckpt, params)
    low, high = BLOOM_FAILURES_PER_WEEK
    return [
        {"run": "bloom-176b", "quantity": f"GPU failures a week on 384 A100s (published: {low}-{high})",
         "predicted": 7 * DAY / g.mtbf_s, "published": high, "low": low, "bound": "range", "source": BLOOM_SOURCE},
        {"run": "bloom-176b", "quantity": "checkpoint TiB (published 2.3, binary units)",
         "predicted": ckpt.total_bytes / 2**40, "published": BLOOM_CHECKPOINT_TIB, "source": BLOOM_SOURCE},
        {"run": "bloom-176b", "quantity": "checkpoint write s (published 40 s to GPFS; default: Tectonic's per node)",
         "predicted": ckpt.write_s, "published": BLOOM_CHECKPOINT_SAVE_S, "source": BLOOM_SOURCE},
    ]


def megascale_rows(params: GoodputParams) -> list[dict]:
    rp = resolve(get_model("gpt3-175b"), get_cluster("1536xdgx-a100-80g"), load_plan(MEGASCALE_PLAN))
    bounded = replace(params, restart_s=MEGASCALE_RESTART_S)
    ckpt = plan_checkpoint(rp, bounded)
    g = goodput(DAY, rp.world, ckpt, bounded)
    detection_only = replace(params, restart_s=10 * 60.0)
    return [
        {"run": "megascale", "quantity": "weeks to 100 restarts on 12,288 GPUs (published: 100+ in 'several weeks')",
         "predicted": 100 * g.mtbf_s / (7 * DAY), "published": None, "source": MEGASCALE_SOURCE},
        {"run": "megascale", "quantity": "effective training time, restart 10 + 15 min (published: > 90%)",
         "predicted": g.goodput, "published": 0.90, "bound": ">", "source": MEGASCALE_SOURCE,
         "detail": {"mtbf_h": g.mtbf_s / HOUR, "interval_min": g.interval_s / 60, "restart_min": g.restart_s / 60,
                    "goodput_at_10_min_restart": goodput(DAY, rp.world, ckpt, detection_only).goodput}},
    ]


def _verdict(r: dict) -> str:
    if r.get("published") is None:
        return ""
    if r.get("bound") == ">":
        return "  ok" if r["predicted"] > r["published"] else "  MISSED"
    if r.get("bound") == "range":
        return "  ok (within)" if r["low"] <= r["predicted"] <= r["published"] else "  MISSED"
    if r.get("bound") == "<":
        return "  ok (within)" if r["predicted"] <= r["published"] else "  MISSED"
    return ""


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write {'rows': [...], 'measured_fleets': {...}} here")
    args = ap.parse_args(argv)
    params = GoodputParams()
    rows = llama3_rows(params) + opt175b_rows(params) + bloom_rows(params) + megascale_rows(params)
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
    print(f"  sources: {SOURCE}; {OPT_SOURCE}; {BLOOM_SOURCE}; {MEGASCALE_SOURCE}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "measured_fleets": MEASURED_FAILURES_PER_GPU_HOUR},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
