"""Does the plan search find published plans (Megatron-LM SC'21 Tables 1 and 2, BLOOM-176B), and do at least as well?

For each row of Table 1 (data/megatron_sc21_table1.csv) and each PTD-P row of Table 2 (its model,
gpus/8 DGX A100-80GB nodes, its global batch, sequence 2048):

(a) Under the 2021 software's knobs (`MEGATRON_2021`: no sequence or context parallelism, no ZeRO,
    no offload, full recompute, fp16, unfused attention) with tp, pp, vpp, schedule, micro-batch
    and dp free: the best plan of every distinct (tp, pp), ranked by step time. The published
    (tp, pp) must fit, and "rank among the top": its best plan within `TOLERANCE` of the best plan's
    step time (the simulator's median error on Table 1 rounded up, docs/validation.md; closer plans
    are a tie to the simulator's accuracy). Its rank among the pairs is reported as well, and the
    rank of its best plan among every plan of the recipe (each pair's plans ahead of it counted up to
    `PLAN_DEPTH`).
The same checks run for BLOOM-176B (BigScience 2022: 384 A100-80GB, global batch 2048, tp 4, pp 12),
under what Megatron-DeepSpeed ran it with (`bloom_recipe` in published.py: bf16, ZeRO-1, its
uneven pipeline partition) instead of the 2021 knobs.
(b) With every parallelism and memory knob free (the same kernels: fp16, unfused attention, as the
    published run had), the best plan must be at least as fast as the published pair's best.

Only pairs that can beat the published one are searched to the end: every search is given the
published pair's step time as its `limit`, so a pair whose plans are all bounded slower costs no
simulation (the search's bounds never exceed the simulator).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from simexec.search.driver import search
from simexec.search.report import explain
from simexec.search.space import structures
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.validation.markdown import replace_block
from simexec.validation.published import (BLOOM_2022, TABLE1_CSV, TABLE2, bloom_model, bloom_recipe, jean_zay,
                                          megatron_model, megatron_name, read_megatron_csv, t2_suffix)

SEQ = 2048
TOLERANCE = 0.05
PLAN_DEPTH = 100  # plans of one (tp, pp) counted ahead of the published pair's best, at most
# what the published runs computed, in every search: their kernels, the loss scaled by 8192 and the
# gradients clipped at 1.0 (examples/sc21/CONFIG.sh: `--clip-grad 1.0 --fp16 --loss-scale 8192`; BLOOM's
# tr11-176B-ml.slurm clips at 1.0 too, in bf16 without a loss scale)
KERNELS = {"dtype": "fp16", "flash_attention": False, "loss_scale": 8192.0, "clip_grad": 1.0}
BLOOM_KERNELS = {"dtype": "bf16", "flash_attention": False, "clip_grad": 1.0}
# Megatron-LM 2021 (v2.x): local DDP all-reduces the gradients after the whole backward
# (`model.allreduce_gradients()` in `train_step`; overlap came with --overlap-grad-reduce in 2023), and
# its fp16 optimizer copies them to fp32 main gradients for the step (`main_param.grad =
# main_grad.float()`): 20 bytes per parameter (Megatron-LM docs, "Distributed Optimizer"). Its
# pipeline messages block: `_communicate` waits on every request of `batch_isend_irecv`.
# Megatron-LM 2021 splits the layers evenly over the stages (`num_layers % pipeline size == 0`). Its
# column-parallel GEMMs all-reduce their input gradient after the whole backward: the asynchronous
# all-reduce under the weight-gradient GEMM (`--async-tensor-model-parallel-allreduce`,
# `ColumnParallelLinearWithAsyncAllreduce`) came with commit 16c9044 of 2021-09-02, after the paper's.
MEGATRON_2021 = {**KERNELS, "sp": False, "cp": 1, "zero": 0, "offload": "none", "recompute": "full",
                 "recompute_layers": None, "grad_overlap": False, "master_grads": True, "p2p_overlap": False,
                 "tp_overlap": False, "stages": None}
# each group of rows has its own generated block in the docs: a run of some groups leaves the others' as they were
MARKERS = {"table1": ("<!-- search-validation:begin -->", "<!-- search-validation:end -->"),
           "table2": ("<!-- search-validation-table2:begin -->", "<!-- search-validation-table2:end -->")}


def table1() -> list[dict]:
    """The rows of Table 1: name, model preset, cluster, global batch, published tp and pp."""
    rows = []
    for size, _heads, _hidden, _layers, tp, pp, gpus, gbs, _tflops in read_megatron_csv(TABLE1_CSV):
        rows.append({"name": megatron_name(size), "cluster": f"{gpus // 8}xdgx-a100-80g", "gpus": gpus,
                     "gbs": gbs, "tp": tp, "pp": pp, "recipe": "megatron-2021", "group": "table1"})
    return rows


def table2() -> list[dict]:
    """The PTD-P rows of Table 2 (GPT-3 175B at tp 8 x pp 12, 530B at tp 8 x pp 35, each at three GPU
    counts and one global batch): the same model parallelism with data parallelism growing, so fewer
    micro-batches per pipeline. Their models are not presets (`megatron_model` builds them)."""
    rows = []
    for r in TABLE2:
        _size, heads, hidden, layers, tp, pp, gpus, gbs, _tflops = r
        rows.append({"name": megatron_name(r[0]) + t2_suffix(r), "cluster": f"{gpus // 8}xdgx-a100-80g",
                     "gpus": gpus, "gbs": gbs, "tp": tp, "pp": pp, "recipe": "megatron-2021",
                     "shape": (heads, hidden, layers), "group": "table2"})
    return rows


def bloom() -> dict:
    """BLOOM-176B (BigScience 2022, outside Table 1): 384 A100-80GB of Jean Zay, global batch 2048,
    published tp 4, pp 12 (the BLOOM row of predictions.py); 70 layers, so pp 12 needs the uneven
    split DeepSpeed made."""
    return {"name": "bloom-176b", "cluster": "48xjean-zay-a100-80g", "gpus": 384, "gbs": 2048, "tp": 4, "pp": 12,
            "recipe": "bloom-2022", "group": "table1"}


def rows_all() -> list[dict]:
    return table1() + table2() + [bloom()]


def row_setup(row: dict):
    """(model, cluster, recipe(tp, pp) -> fixed knobs, knobs every plan of the row shares)."""
    if row["recipe"] == "bloom-2022":
        model = bloom_model()
        return model, jean_zay(48), lambda tp, pp: bloom_recipe(model, tp, pp), BLOOM_2022, BLOOM_KERNELS
    model = megatron_model(*row["shape"], name=row["name"]) if "shape" in row else get_model(row["name"], seq_len=SEQ)
    return model, get_cluster(row["cluster"]), knobs, MEGATRON_2021, KERNELS


def knobs(tp: int, pp: int) -> dict:
    """The 2021 recipe for one (tp, pp): torch DDP (gradients all-reduced in 25 MB buckets during the
    last micro-batch's backward) is allowed only without a pipeline, and the authors ran it there
    (`DDP=torch` in examples/sc21/run_table_1.sh for every pp = 1 row); with a pipeline Megatron-LM
    2021 requires its local DDP (`assert args.DDP_impl == 'local'` in megatron/training.py), which
    all-reduces after the backward."""
    return dict(MEGATRON_2021, tp=tp, pp=pp, grad_overlap=pp == 1, grad_bucket_view=pp > 1)


def pairs(model, cluster, gbs: int, shared: dict = MEGATRON_2021) -> list[tuple[int, int]]:
    """Every (tp, pp) with at least one valid plan under a recipe's shared knobs (the 2021 ones by default)."""
    return sorted({(st.fields["tp"], st.fields["pp"]) for st in structures(model, cluster, gbs, SEQ, shared)})


def _best(model, cluster, gbs: int, fix: dict, workers: int, limit: Optional[float] = None, depth: int = 1):
    """The best plan under `fix` (None if none beats `limit`), how many of its plans beat `limit`
    (counted up to `depth`), and the simulations it took."""
    res = search(model, cluster, gbs, seq_len=SEQ, top=depth, fix=fix, workers=workers, progress=False, limit=limit)
    ahead = [p for p in res.plans if limit is None or p["step_time_s"] < limit]
    return (ahead[0] if ahead else None), len(ahead), res.evaluated


def check_row(row: dict, workers: int = 1) -> dict:
    """Criteria (a) and (b) for one row (see the module doc)."""
    t0 = time.perf_counter()
    model, cluster, recipe, shared, kernels = row_setup(row)
    gbs, pub = row["gbs"], (row["tp"], row["pp"])
    published, _, sims = _best(model, cluster, gbs, recipe(*pub), workers)
    out = {**row, "fits": published is not None, "published_plan": published}
    if published is None:
        return {**out, "pass": False, "wall_s": time.perf_counter() - t0, "simulated": sims}
    p_step = published["step_time_s"]
    faster = []  # (step, tp, pp, plan): pairs whose best beats the published pair's
    ahead, capped = 0, False  # plans of any pair that beat it; whether a pair had PLAN_DEPTH of them
    candidates = [pq for pq in pairs(model, cluster, gbs, shared) if pq != pub]
    for tp, pp in candidates:
        best, k, n = _best(model, cluster, gbs, recipe(tp, pp), workers, limit=p_step, depth=PLAN_DEPTH)
        sims += n
        ahead += k
        capped = capped or k == PLAN_DEPTH
        if best is not None:
            faster.append((best["step_time_s"], tp, pp, best))
    faster.sort(key=lambda x: x[:3])
    best = faster[0][3] if faster else published
    gap = p_step / best["step_time_s"] - 1.0
    free, _, n = _best(model, cluster, gbs, dict(kernels), workers, limit=p_step * (1 + 1e-9))
    sims += n
    free = free or published  # nothing strictly faster: the published pair's plan is the best
    out.update(
        rank=1 + len(faster), pairs=1 + len(candidates), plan_rank=1 + ahead, plan_rank_capped=capped,
        faster_pairs=[{"tp": tp, "pp": pp, "step_time_s": s, "plan": b["plan"]} for s, tp, pp, b in faster],
        best_2021=best, gap=gap, ranks_among_top=gap <= TOLERANCE,
        unconstrained=free, unconstrained_at_least_as_fast=free["step_time_s"] <= p_step,
        why=gain(best, published),
        simulated=sims, wall_s=time.perf_counter() - t0,
    )
    out["pass"] = out["fits"] and out["ranks_among_top"] and out["unconstrained_at_least_as_fast"]
    return out


def gain(best: dict, published: dict) -> str:
    """What the best plan changes from the published pair's best, and where its step time goes."""
    if best is published or best["plan"] == published["plan"]:
        return "the published pair is the best"
    ex = explain(best, published)
    parts = [f"{k} {v:+.3g} s" for k, v in list(ex["delta_breakdown_s"].items())[:4]]
    return (f"{', '.join(ex['plan_changes'])}: step {ex['delta_step_time_s']:+.3g} s "
            f"({', '.join(parts)})")


def plan_rank(r: dict) -> str:
    """The published pair's best plan's rank, a lower bound where a pair had `PLAN_DEPTH` plans ahead."""
    return f"{'at least ' if r['plan_rank_capped'] else ''}{r['plan_rank']}"


def short_plan(plan: str) -> str:
    """A plan string without the knobs every plan of the row shares."""
    drop = ("gbs=", "recompute=full", "dtype=fp16", "flash_attention=0", "grad_overlap=0", "master_grads=1",
            "p2p_overlap=0", "bucket_mb=", "loss_scale=", "clip_grad=")
    return ",".join(p for p in plan.split(",") if not p.startswith(drop))


def to_markdown(results: list[dict], command: str, group: str = "table1") -> str:
    begin, end = MARKERS[group]
    lines = [begin, "", f"Generated by `{command}`.", "",
             "| row | GPUs | published tp x pp | fits | rank of (tp, pp) | rank of its best plan | published pair's best (s) "
             "| best plan, recipe pinned | best (s) | gap | within 5% | best, all knobs free (s) | at least as fast |",
             "| --- | ---: | --- | --- | --- | ---: | ---: | --- | ---: | ---: | --- | ---: | --- |"]
    for r in results:
        if not r["fits"]:
            lines.append(f"| {r['name']} | {r['gpus']} | {r['tp']} x {r['pp']} | no | | | | | | | | | |")
            continue
        yes = {True: "yes", False: "**no**"}
        lines.append(
            f"| {r['name']} | {r['gpus']} | {r['tp']} x {r['pp']} | yes | {r['rank']} of {r['pairs']} | {plan_rank(r)} | "
            f"{r['published_plan']['step_time_s']:.4g} | `{short_plan(r['best_2021']['plan'])}` | "
            f"{r['best_2021']['step_time_s']:.4g} | {100 * r['gap']:.1f}% | {yes[r['ranks_among_top']]} | "
            f"{r['unconstrained']['step_time_s']:.4g} | {yes[r['unconstrained_at_least_as_fast']]} |")
    wall = sum(r.get("wall_s", 0.0) for r in results)
    sims = sum(r.get("simulated", 0) for r in results)
    passed = sum(1 for r in results if r["pass"])
    lines += ["", f"{passed} of {len(results)} rows pass (fits, within {100 * TOLERANCE:g}%, at least as fast); "
                  f"{sims} plans simulated in {wall:.0f} s."]
    misses = [r for r in results if r["fits"] and not r["ranks_among_top"]]
    if misses:
        lines += ["", "What the best plan (recipe pinned) changes from the published pair's best, and what it saves "
                      "(simulated breakdown, best - published):", ""]
        lines += [f"- {r['name']}: {gain(r['best_2021'], r['published_plan'])}" for r in misses]
    lines += ["", end]
    return "\n".join(lines)


def update_markdown(path: Path, block: str, group: str = "table1") -> None:
    """Replace the group's generated block of `path` (between its markers), or append it."""
    replace_block(path, block, *MARKERS[group], new_doc="")
