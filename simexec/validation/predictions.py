"""Predict published large-scale training results from their configurations alone, and compare.

Nothing here is fitted to these rows: every prediction uses the cluster presets (datasheets and
published micro-benchmarks, simexec/specs/cluster.py) and one rule for what a paper leaves out.

Rows (docs/validation.md has the findings):
- Megatron-LM, Narayanan et al. SC'21, Table 1: GPT 1.7B-1T on 32-3,072 A100-80GB (DGX A100,
  Selene), achieved TFLOP/s per GPU counted with the paper's eq. 3; and Table 2's PTD-P rows
  (175B and 530B at three GPU counts each, micro-batch 1).
- ZeRO, Rajbhandari et al. SC'20, Figure 1: model-state memory of a 7.5B model on 64 GPUs, stages 0-3.
- BLOOM-176B, Le Scao et al. 2022 / BigScience tr11: 384 A100-80GB, tp 4, pp 12, dp 8, ~150 TFLOP/s.

The rule for Megatron rows (the paper gives neither micro-batch size nor virtual stages for
Table 1): micro-batch 1; virtual stages per pipeline rank = the largest v <= 3 that divides the
layers per stage (3 is the most the authors' own scripts use, Megatron-LM examples/sc21); interleaved
1F1B wherever pp > 1 (it needs micro-batches divisible by pp: true for every row); full activation
recompute; fp16; no fused attention (FlashAttention came a year later); gradient all-reduce as
Megatron-LM 2021 did it: torch DDP (25 MB buckets overlapped with the last backward, copied in and
out of `.grad` as torch DDP's default does) without a pipeline, Megatron's local DDP (the whole
gradient buffer reduced after the backward) with one; Megatron's native vocab-parallel cross entropy
(`MEGATRON_2021`: the megatron-core stack before Transformer Engine's fused loss). BLOOM's
Megatron-DeepSpeed runs the same loss.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from simexec.sim.simulate import SimResult, simulate
from simexec.specs.model import ModelSpec
from simexec.specs.plan import Plan, load_plan
from simexec.specs.stack import get_stack
from simexec.validation.markdown import replace_block
from simexec.validation.published import (BLOOM_SRC, SC21_T1, SC21_T2, SEQ, TABLE1, TABLE2, TFLOPS, ZERO_SRC,
                                          bloom_model, bloom_recipe, eq3_flops, jean_zay, megatron_name,
                                          megatron_plan, megatron_spec, read_megatron_csv, t2_suffix)

MEGATRON_2021 = get_stack("megatron-core").model_copy(update={"name": "megatron-lm-2021", "cross_entropy": "native"})


def row(name: str, source: str, metric: str, published: float, predicted: float, **config) -> dict:
    """One result row: error is signed and relative, (predicted - published) / published."""
    return {"name": name, "source": source, "metric": metric, "published": published, "predicted": predicted,
            "error": (predicted - published) / published, "config": config}


# --- Megatron-LM -----------------------------------------------------------------------------------

def predict_megatron(params_b: float, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int,
                     global_batch: int) -> tuple[float, SimResult, str, str]:
    """Achieved TFLOP/s per GPU (eq. 3) of a Megatron-LM GPT run on DGX A100-80GB nodes, by the rule.

    Returns (TFLOP/s per GPU, the simulation result, plan, cluster)."""
    if gpus % 8:
        raise ValueError(f"{gpus} GPUs is not a whole number of DGX A100 nodes (8 GPUs each)")
    model = megatron_spec(params_b, heads, hidden, layers)
    plan = megatron_plan(layers, tp, pp, gpus, global_batch)
    cluster = f"{gpus // 8}xdgx-a100-80g"
    res = simulate(model, cluster, plan, SEQ, stack=MEGATRON_2021)
    flops = eq3_flops(global_batch, SEQ, layers, hidden, model.vocab)
    return flops / res.step_time_s / gpus / 1e12, res, plan, cluster


# Micro-batch size and virtual stages of each Table 1 run in the authors' script
# (examples/sc21/run_table_1.sh in Megatron-LM), which the paper leaves out.
AUTHORS_MBS_VPP = {"megatron-1.7b": (16, 1), "megatron-3.6b": (16, 1), "megatron-7.5b": (16, 1),
                   "megatron-18.4b": (8, 1), "megatron-39.1b": (4, 1), "megatron-76.1b": (2, 3),
                   "megatron-145.6b": (2, 2), "megatron-310.1b": (1, 2), "megatron-529.6b": (1, 3),
                   "megatron-1t": (1, 1)}


def authors_table(log=print) -> None:
    """Table 1 predicted with the authors' micro-batch and interleaving instead of the rule
    (docs/validation.md, finding 7), as markdown rows."""
    log("| row | authors' mbs, vpp (run_table_1.sh) | micro-batches | bubble | predicted | error |")
    log("| --- | --- | ---: | ---: | ---: | ---: |")
    for params_b, heads, hidden, layers, tp, pp, gpus, gbs, published in TABLE1:
        name = megatron_name(params_b)
        mbs, vpp = AUTHORS_MBS_VPP[name]
        model = megatron_spec(params_b, heads, hidden, layers)
        plan = load_plan(megatron_plan(layers, tp, pp, gpus, gbs)).model_copy(update=dict(mbs=mbs, vpp=vpp))
        res = simulate(model, f"{gpus // 8}xdgx-a100-80g", plan, SEQ, stack=MEGATRON_2021)
        tflops = eq3_flops(gbs, SEQ, layers, hidden, model.vocab) / res.step_time_s / gpus / 1e12
        bubble = res.breakdown_s.get("pipeline_bubble", 0.0) / res.step_time_s
        log(f"| {name} | {mbs}, {vpp} | {gbs // plan.dp // mbs} | {100 * bubble:.1f}% | {tflops:.1f} | "
            f"{100 * (tflops / published - 1):+.1f}% |")


def megatron_rows(table: Iterable[tuple] = TABLE1, source: str = SC21_T1, suffix: Callable[[tuple], str] = None,
                  only: Optional[Callable[[str], bool]] = None, log=print) -> list[dict]:
    out = []
    for r in table:
        params_b, heads, hidden, layers, tp, pp, gpus, gbs, published = r
        name = megatron_name(params_b) + (suffix(r) if suffix else "")
        if only and not only(name):
            continue
        t0 = time.perf_counter()
        tflops, res, plan, cluster = predict_megatron(params_b, heads, hidden, layers, tp, pp, gpus, gbs)
        out.append(row(name, source, TFLOPS, float(published), tflops, model=res.model, cluster=cluster, plan=plan,
                       step_time_s=res.step_time_s, fits=res.fits,
                       breakdown={k: round(v / res.step_time_s, 4) for k, v in res.breakdown_s.items()}))
        log(f"  {name:<28} {tflops:7.1f} vs {published:5.0f}  {100 * out[-1]['error']:+6.1f}%   "
            f"({time.perf_counter() - t0:.1f} s)")
    return out


# --- ZeRO model states ---------------------------------------------------------------------------

ZERO_PSI = 7.5e9
ZERO_ND = 64
ZERO_PUBLISHED = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}  # GB per GPU as Figure 1 prints them (rounded)


def zero_formula(stage: int, psi: float = ZERO_PSI, nd: int = ZERO_ND, k: int = 12) -> float:
    """Bytes per GPU of fp16 params (2 psi), fp16 grads (2 psi) and K psi optimizer states, by stage."""
    return {0: (2 + 2 + k) * psi, 1: 4 * psi + k * psi / nd, 2: 2 * psi + (2 + k) * psi / nd,
            3: (2 + 2 + k) * psi / nd}[stage]


def zero_model(psi: float = ZERO_PSI) -> ModelSpec:
    """A GPT of exactly psi parameters (40 layers of hidden 3840; the vocabulary takes up the rest)."""
    h, layers = 3840, 40
    probe = ModelSpec(name="probe", layers=layers, hidden=h, heads=30, kv_heads=30, head_dim=128, ffn=4 * h,
                      gated=False, vocab=1, seq_len=SEQ, tied_embeddings=True, norm="layernorm", bias=True,
                      learned_pos=True, dropout=0.1)
    vocab = 1 + (psi - probe.params) / h
    if vocab != int(vocab):
        raise ValueError(f"no vocabulary makes a {psi:g}-parameter model of this shape")
    return probe.model_copy(update={"name": f"gpt-{psi / 1e9:g}b", "vocab": int(vocab),
                                    "source": ZERO_SRC + f": {psi:g} parameters"})


STATES = ("params", "grads", "optimizer")


def model_states(res: SimResult, rank: int = 0) -> dict[str, float]:
    """Live bytes per model-state category on `rank` when the step starts (the simulator's memory
    timeline at t = 0): what persists across steps. Later in the step ZeRO-2 also holds a bucket of
    full gradients until its reduce-scatter, and ZeRO-3 gathers parameters into buffers; Figure 1
    counts neither (the paper counts such buffers apart, as residual memory)."""
    live = dict.fromkeys(STATES, 0.0)
    for c in res.trace.counters:
        if c.rank == rank and c.ts_us == 0.0 and c.category in live:
            live[c.category] = c.bytes
    return live


def zero_rows(only: Optional[Callable[[str], bool]] = None, log=print) -> list[dict]:
    """Model-state memory per GPU (params + grads + optimizer, as the step starts) for stages 0-3."""
    model = zero_model()
    assert model.params == ZERO_PSI
    out = []
    for stage in range(4):
        name = f"zero-7.5b-64gpu-stage{stage}"
        if only and not only(name):
            continue
        # stage 3 as DeepSpeed runs it: the gradient partition allocated at start, like the paper's count
        # (FSDP, the default flavour, makes the gradient shards during the backward)
        impl = ",zero_impl=deepspeed" if stage == 3 else ""
        plan = f"dp={ZERO_ND},zero={stage}{impl},gbs={ZERO_ND},dtype=fp16"
        res = simulate(model, f"{ZERO_ND // 8}xdgx-a100-80g", plan, 512, trace=True, stack=MEGATRON_2021)
        gb = sum(model_states(res).values()) / 1e9
        at_peak = sum(res.memory_breakdown_bytes[k] for k in STATES) / 1e9
        out.append(row(name, ZERO_SRC, "model-state GB per GPU", ZERO_PUBLISHED[stage], gb,
                       formula_gb=zero_formula(stage) / 1e9, at_peak_gb=at_peak, plan=plan,
                       cluster=f"{ZERO_ND // 8}xdgx-a100-80g"))
        log(f"  {name:<28} {gb:7.3f} vs {ZERO_PUBLISHED[stage]:5.1f}  (formula {zero_formula(stage) / 1e9:.3f})")
    return out


# --- BLOOM-176B ------------------------------------------------------------------------------------

def bloom_rows(only: Optional[Callable[[str], bool]] = None, log=print) -> list[dict]:
    """tr11-176B-ml.slurm: tp 4, pp 12, micro-batch 2, global batch 2048, bf16, ZeRO-1 (DeepSpeed's
    BF16 optimizer), --checkpoint-activations, Megatron's fused softmax (no FlashAttention), DeepSpeed's
    pipeline (non-interleaved 1F1B; gradients reduced after the backward; blocking `dist.send` / `dist.recv`,
    deepspeed/runtime/pipe/p2p.py); 'type:transformer|embedding'
    partitioning puts the embedding and its tied head with 5 layers on the first and last stage."""
    name = "bloom-176b-384gpu"
    if only and not only(name):
        return []
    model, cluster = bloom_model(), jean_zay(48)
    plan = Plan(**bloom_recipe(model, 4, 12), dp=8, mbs=2, gbs=2048).to_string()
    res = simulate(model, cluster, plan, SEQ, stack=MEGATRON_2021)
    tflops = eq3_flops(2048, SEQ, model.layers, model.hidden, model.vocab) / res.step_time_s / 384 / 1e12
    out = [row(name, BLOOM_SRC, TFLOPS, 150.0, tflops, model=model.name, cluster=cluster.name, plan=plan,
               step_time_s=res.step_time_s, fits=res.fits,
               breakdown={k: round(v / res.step_time_s, 4) for k, v in res.breakdown_s.items()})]
    log(f"  {name:<28} {tflops:7.1f} vs {150:5.0f}  {100 * out[0]['error']:+6.1f}%")
    return out


# --- all rows, summary, markdown -------------------------------------------------------------------

def all_rows(only: Optional[Callable[[str], bool]] = None, megatron_csv: Optional[str] = None, log=print) -> list[dict]:
    rows: list[dict] = []
    log("Megatron-LM SC'21 Table 1")
    rows += megatron_rows(read_megatron_csv(megatron_csv) if megatron_csv else TABLE1,
                          source=SC21_T1 if not megatron_csv else f"{megatron_csv}", only=only, log=log)
    if not megatron_csv:
        log("Megatron-LM SC'21 Table 2 (PTD-P)")
        rows += megatron_rows(TABLE2, SC21_T2, suffix=t2_suffix, only=only, log=log)
        log("ZeRO SC'20 model states")
        rows += zero_rows(only, log=log)
        log("BLOOM-176B")
        rows += bloom_rows(only, log=log)
    return rows


def summary(rows: list[dict], prefix: str = "megatron") -> dict:
    errs = [abs(r["error"]) for r in rows if r["name"].startswith(prefix)]
    if not errs:
        return {}
    return {"rows": len(errs), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}


BEGIN, END = "<!-- validate_published:begin -->", "<!-- validate_published:end -->"


def to_markdown(rows: list[dict], command: str) -> str:
    s = summary(rows)
    lines = [BEGIN, "", f"Generated by `{command}` (simexec {_version()}).", "",
             "| row | published | predicted | error | metric | plan (cluster) |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        c = r["config"]
        where = f"`{c.get('plan', '')}` ({c.get('cluster', '')})"
        lines.append(f"| {r['name']} | {r['published']:g} | {r['predicted']:.4g} | {100 * r['error']:+.1f}% | "
                     f"{r['metric']} | {where} |")
    t1 = summary([r for r in rows if "-t2-" not in r["name"]])
    if s:
        lines += ["", f"Megatron rows: {s['rows']}, median |error| {100 * s['median_abs_error']:.1f}%, "
                      f"largest |error| {100 * s['max_abs_error']:.1f}% (targets: 7% and 15%)"
                      + (f"; Table 1 alone: median {100 * t1['median_abs_error']:.1f}%, largest "
                         f"{100 * t1['max_abs_error']:.1f}%." if t1 and t1["rows"] < s["rows"] else ".")]
    timed = [r for r in rows if r["config"].get("breakdown")]
    if timed:
        cols = ["compute", "recompute", "comm.tp", "pipeline_bubble", "comm.pp", "comm.dp"]
        lines += ["", "Where the predicted step goes (share of the step on the slowest rank's compute stream):", "",
                  "| row | step (s) | " + " | ".join(cols) + " | other |", "| --- | ---: |" + " ---: |" * (len(cols) + 1)]
        for r in timed:
            b = r["config"]["breakdown"]
            other = 1.0 - sum(b.get(c, 0.0) for c in cols)
            lines.append(f"| {r['name']} | {r['config']['step_time_s']:.3g} | "
                         + " | ".join(f"{100 * b.get(c, 0.0):.1f}%" for c in cols) + f" | {100 * other:.1f}% |")
    sources = sorted({r["source"] for r in rows})
    lines += ["", "Sources: " + "; ".join(sources) + ".", "", END]
    return "\n".join(lines)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("simexec")
    except Exception:
        return "dev"


def update_markdown(path: Path, block: str) -> None:
    """Replace the generated block of `path` (between the markers), or append it."""
    replace_block(path, block, BEGIN, END, new_doc="# Validation against published results\n\n")
