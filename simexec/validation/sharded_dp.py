"""Predict the published pure sharded-data-parallel runs of simexec/validation/data/sharded_dp_runs.csv (ZeRO-3,
SHARD_GRAD_OP, FSDP1/2, YaFSDP on 8 to 2,240 GPUs): the `sharded-dp` family of scripts/validate_modern.py.

One rule per column, nothing fitted (the CSV's header names the sources and how its columns were filled).

Model: the simexec preset where `model` names one (llama2/3 shapes); megatron-174.6b / 529.6b ->
simexec.validation.published.megatron_spec (Megatron GPT: GELU, LayerNorm, learned positions, biases, tied,
vocab 51200; the 529.6B preset); `mpt-*` -> MPT as llm-foundry builds it (mosaicml/llm-foundry@8c8dd48
llmfoundry/models/mpt/configuration_mpt.py defaults, which the benchmark yamls scripts/train/yamls/pretrain/
mpt-*.yaml leave alone): LayerNorm (low_precision_layernorm), non-gated GELU MLP of `ffn` (expansion_ratio 4),
tied embeddings, learned positional embedding of seq_len rows, no dropout (resid/emb/attn_pdrop 0.0), vocab
50368, and biases: `no_bias` defaults to False, and the rows' NumParams counts them (mpt-7b: 6,658,859,008 =
32 x 12h^2 + (50368 + 2048) h + 32 x (9h linear biases + 4h LayerNorm) + 2h, h = 4096: tests/test_validation_modern.py);
any other name -> a Llama-style ModelSpec from the columns (simexec.validation.modern.row_model).

Cluster: a100-80gb -> `Nxdgx-a100-80g`, a100-40gb -> `Nxdgx-a100-40g`, h100 -> `Nxdgx-h100` (N = gpus / 8),
h100-hbm2e-500w -> data/h100-hbm2e-500w.yaml as modern.py. `network` `KxG:fabric` sets the preset's
`nics_per_node` = K and `nic_bw` = G Gb/s where they differ (every row so far equals its preset: 8x200 = DGX
A100's HDR, 8x400 = DGX H100's NDR); `unstated` -> the preset.

Stack and plan (tp = pp = 1; dp derived = gpus; `zero` as the row, `zero_impl` only under zero=3):

| stack | simexec stack | plan |
| --- | --- | --- |
| deepspeed-zero3 | deepspeed | zero_impl=deepspeed-2021 (the ZeRO-3 of DeepSpeed 0.3.13-0.5.5, March-October 2021, the only one released when Megatron SC'21 compared against it: simexec.specs.zero3_flavours); fp16 gradients reduced in fp16 (DeepSpeed's communication_data_type defaults to the model's dtype) |
| fsdp1 (llmf) | `LLM_FOUNDRY_STACK`: torchtitan's eager element-wise traffic (Composer runs MPT's modules eagerly: LayerNorm, GELU, residual adds; no torch.compile in the benchmark yamls), FlashAttention (attn_impl flash/triton), cross_entropy `compiled` (llm-foundry's default loss_fn `fused_crossentropy`, flash_attn's Triton kernel: one fused forward, one fused backward, modeling_mpt.py) | zero_impl=`FSDP1_IMPL`; grad_fp32 where the row's FSDP mixed precision is DEFAULT (Composer's get_mixed_precision: reduce_dtype float32), not under PURE (reduce_dtype = the precision, bf16): mosaicml/composer composer/trainer/mosaic_fsdp_utils.py |
| fsdp1 (yafsdp) | torchtitan (HF transformers' Llama run eagerly, its loss on an fp32 copy of the logits) | zero_impl=`FSDP1_IMPL`; bf16 reduction (YaFSDP's examples run through accelerate with mixed_precision bf16, whose FSDP plugin reduces in bf16: huggingface/accelerate utils/dataclasses.py set_mixed_precision) |
| yafsdp | torchtitan, as its FSDP baseline | zero_impl=yafsdp; bf16 reduction (the same rule) |
| fsdp2, fsdp2-compile | torchtitan, torchtitan-compile (eager loss for tt-2412, modern.EAGER_LOSS_SOURCES) | zero_impl=fsdp (FSDP2); grad_fp32 (torchtitan's mixed_precision_reduce float32) |

dtype as the row (fp16 for meg-sc21: simexec runs fp16 at the bf16 peak). recompute: modern.recompute_fields
(`full:block N layers` -> full, N layers); `selective:op` -> `op`; `selective:layer` -> full on every second
layer (torchtitan's layer SAC checkpoints every `selective_ac_option`-th block, default "2": torchtitan
torchtitan/config_manager.py and parallelisms/parallelize_llama.py at 157a12c56).

Measured step: `step_s` as published; `tokens_per_s_per_gpu` -> gbs x seq_len / (value x gpus);
`tflops_per_gpu` / `mfu` through the row's `flop_count` (`FLOP_COUNTS`, exactly as the CSV header states).

Trend: for each `series` (rows ordered by gpus), the fraction of consecutive GPU-count steps where the sign of
the predicted change in per-GPU throughput (gbs x seq_len / (step x gpus), i.e. the scaling efficiency, which
the sources publish) equals the published one. Per-GPU throughput rather than step time: in strong and mixed
series the step time falls or rises with the batch per GPU whatever the model, so its sign says little.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

from simexec.errors import SpecError
from simexec.specs.cluster import GB, ClusterSpec, get_cluster
from simexec.specs.model import ModelSpec
from simexec.specs.model_presets import MODELS
from simexec.specs.plan import Plan
from simexec.specs.stack import StackSpec, get_stack
from simexec.validation.modern import (GRAND_TETON_H100, Mapped, NotComparable, compared_row, eager_loss_source,
                                       line, measured_step_s as modern_measured_step_s, recompute_fields,
                                       row_model as modern_row_model)
from simexec.validation.published import DATA, eq3_flops, megatron_spec, read_published_csv
from simexec.validation.table_script import predicted_rows

CSV = DATA / "sharded_dp_runs.csv"
FAMILY = "sharded-dp"
# The ZeRO-3 flavour FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) rows run as.
FSDP1_IMPL = "fsdp1"
DEVICE_CLUSTERS = {"a100-80gb": "dgx-a100-80g", "a100-40gb": "dgx-a100-40g", "h100": "dgx-h100"}
# Peak bf16 FLOP/s the llmf and torchtitan MFUs divide by (the CSV header: Composer's GPU_AVAILABLE_FLOPS,
# torchtitan's utils.py): A100 312e12, H100 SXM 989e12.
MFU_PEAKS = {"a100-80gb": 312e12, "a100-40gb": 312e12, "h100": 989e12, "h100-hbm2e-500w": 989e12}
MPT_VOCAB = 50368
# torchtitan's layer-selective AC default: every second block (selective_ac_option = "2")
LAYER_SAC_EVERY = 2
# llm-foundry's MPT under Composer: eager modules as torchtitan's eager stack, with flash_attn's fused Triton
# cross entropy (loss_fn default 'fused_crossentropy', llmfoundry/models/mpt/modeling_mpt.py) as the loss.
LLM_FOUNDRY_STACK = get_stack("torchtitan").model_copy(update={
    "name": "llm-foundry", "cross_entropy": "compiled", "source": "llm-foundry MPT under Composer + torch FSDP, eager"})


def source_key(r: dict) -> str:
    return r["source"].split(":")[0]


def num_params_in_notes(r: dict) -> int:
    m = re.search(r"NumParams (\d+)", r["notes"])
    if not m:
        raise NotComparable(f"{r['name']}: llmf-mfu needs the row's NumParams (notes)")
    return int(m.group(1))


def mpt_model(r: dict) -> ModelSpec:
    hidden, heads, seq = int(r["hidden"]), int(r["heads"]), int(r["seq_len"])
    return ModelSpec(name=r["model"], layers=int(r["layers"]), hidden=hidden, heads=heads, kv_heads=int(r["kv_heads"]),
                     head_dim=hidden // heads, ffn=int(r["ffn"]), gated=False, vocab=int(r["vocab"]), seq_len=seq,
                     tied_embeddings=True, norm="layernorm", bias=True, learned_pos=True, max_positions=seq,
                     dropout=0.0, source=f"llm-foundry MPT ({r['model']}), sharded_dp_runs.csv row {r['name']}")


def row_model(r: dict) -> ModelSpec:
    if r["model"] in MODELS:
        return MODELS[r["model"]]
    if r["model"].startswith("megatron-"):
        return megatron_spec(float(r["model"].removeprefix("megatron-").removesuffix("b")), int(r["heads"]),
                             int(r["hidden"]), int(r["layers"]))
    if r["model"].startswith("mpt-"):
        return mpt_model(r)
    return modern_row_model({**r, "moe_experts": ""})


def row_cluster(r: dict) -> ClusterSpec:
    gpus, device = int(r["gpus"]), r["device"]
    if gpus % 8:
        raise SpecError(f"{gpus} GPUs is not a whole number of 8-GPU nodes")
    if device == "h100-hbm2e-500w":
        capped = get_cluster(str(GRAND_TETON_H100))
        cluster = capped.model_copy(update={"nodes": gpus // 8, "name": f"{gpus // 8}x{capped.name}"})
    elif device in DEVICE_CLUSTERS:
        cluster = get_cluster(f"{gpus // 8}x{DEVICE_CLUSTERS[device]}")
    else:
        raise SpecError(f"device {device!r} has no simexec cluster")
    return with_network(cluster, r["network"])


def with_network(cluster: ClusterSpec, network: str) -> ClusterSpec:
    """`cluster` with the row's NICs (`KxG:fabric`, G in Gb/s) where they differ from its preset's."""
    m = re.fullmatch(r"(\d+)x(\d+):\w+", network)
    if network == "unstated" or not m:
        return cluster
    nics, nic_bw = int(m.group(1)), int(m.group(2)) * GB / 8
    net = cluster.network
    if (nics, nic_bw) == (net.nics_per_node, net.nic_bw):
        return cluster
    return cluster.model_copy(update={"network": net.model_copy(update={"nics_per_node": nics, "nic_bw": nic_bw}),
                                      "name": f"{cluster.name}-{network.replace(':', '-')}"})


def row_stack(r: dict) -> StackSpec:
    stack = r["stack"]
    if stack == "deepspeed-zero3":
        return get_stack("deepspeed")
    if stack == "fsdp1" and source_key(r) == "llmf":
        return LLM_FOUNDRY_STACK
    if stack in ("fsdp1", "yafsdp", "fsdp2"):
        base = get_stack("torchtitan")
    elif stack == "fsdp2-compile":
        base = get_stack("torchtitan-compile")
    else:
        raise SpecError(f"stack {stack!r} has no simexec mapping")
    if eager_loss_source(r):
        base = base.model_copy(update={"cross_entropy": "eager"})
    return base


def grad_fp32(r: dict) -> bool:
    """Whether the row's framework reduces gradients in fp32 (the module docstring's table)."""
    if r["stack"] in ("fsdp2", "fsdp2-compile"):
        return True
    if r["stack"] == "fsdp1" and source_key(r) == "llmf":
        return "mixed precision DEFAULT" in r["notes"]
    return False


def row_plan(r: dict) -> str:
    zero = int(r["zero"])
    fields: dict = dict(zero=zero, mbs=int(r["mbs"]), gbs=int(r["gbs"]), dtype=r["dtype"], flash_attention=True,
                        grad_fp32=grad_fp32(r))
    recompute = r["recompute"]
    if recompute == "selective:op":
        fields["recompute"] = "op"
    elif recompute == "selective:layer":
        fields.update(recompute="full", recompute_layers=int(r["layers"]) // LAYER_SAC_EVERY)
    else:
        fields.update(recompute_fields(recompute))
    if zero == 3:
        fields["zero_impl"] = {"deepspeed-zero3": "deepspeed-2021", "yafsdp": "yafsdp", "fsdp1": FSDP1_IMPL}.get(
            r["stack"], "fsdp")  # fsdp2, fsdp2-compile: FSDP2
    return Plan(**fields).to_string()


def map_row(r: dict) -> Mapped:
    return Mapped(model=row_model(r), cluster=row_cluster(r), plan=row_plan(r), stack=row_stack(r),
                  seq_len=int(r["seq_len"]))


# --- the sources' FLOP counts (the CSV header's `flop_count` entries) ---------------------------------------

def megatron_eq3(r: dict) -> float:
    """FLOPs of one iteration, the paper's eq. 3 (full recompute counted)."""
    return eq3_flops(int(r["gbs"]), int(r["seq_len"]), int(r["layers"]), int(r["hidden"]), int(r["vocab"]))


def llmf_mfu(r: dict) -> float:
    """FLOPs of one step as llm-foundry's MFU counts them: per sequence 3 x 2 N s + 3 x 4 l h s^2 (N the
    table's NumParams)."""
    s, n = int(r["seq_len"]), num_params_in_notes(r)
    return int(r["gbs"]) * (3 * 2 * n * s + 3 * 4 * int(r["layers"]) * int(r["hidden"]) * s * s)


def torchtitan_6n(r: dict) -> float:
    """FLOPs of one step as torchtitan counts them: per token 6 N + 12 l h q s (N every parameter, embeddings
    included; h heads, q head dim)."""
    s, heads = int(r["seq_len"]), int(r["heads"])
    n = row_model(r).params
    return int(r["gbs"]) * s * (6 * n + 12 * int(r["layers"]) * heads * (int(r["hidden"]) // heads) * s)


FLOP_COUNTS: dict[str, Callable[[dict], float]] = {
    "megatron-eq3": megatron_eq3, "llmf-mfu": llmf_mfu, "torchtitan-6n": torchtitan_6n}


def measured_step_s(r: dict) -> float:
    if r["metric"] not in ("tflops_per_gpu", "mfu"):
        return modern_measured_step_s(r)
    if r["flop_count"] not in FLOP_COUNTS:
        raise NotComparable(f"flop count {r['flop_count']!r} unknown for its {r['metric']}")
    flops, value, gpus = FLOP_COUNTS[r["flop_count"]](r), float(r["value"]), int(r["gpus"])
    if r["metric"] == "mfu":
        return flops / (value * MFU_PEAKS[r["device"]] * gpus)
    return flops / (value * 1e12 * gpus)


def predict_row(r: dict) -> dict:
    """One result row, as modern.predict_row, with the row's series and scaling."""
    out = {"name": r["name"], "source": r["source"], "device": r["device"], "gpus": int(r["gpus"]),
           "stack": r["stack"], "model": r["model"], "seq_len": int(r["seq_len"]), "metric": r["metric"],
           "value": float(r["value"]), "published_peak_gib": None, "families": [FAMILY], "status": "ok",
           "reason": "", "plan": "", "cluster": "", "predicted_s": None, "measured_s": None, "error": None,
           "series": r["series"], "gbs": int(r["gbs"])}
    return compared_row(out, lambda: measured_step_s(r), lambda: map_row(r))


def read_rows(path: Path = CSV) -> list[dict]:
    return read_published_csv(path)


def sharded_dp_rows(only: Optional[Callable[[str], bool]] = None, path: Path = CSV, log=print) -> list[dict]:
    return predicted_rows(read_rows(path), predict_row, line, only, log)


def per_gpu_throughput(o: dict, step_s: float) -> float:
    return o["gbs"] * o["seq_len"] / (step_s * o["gpus"])


def sign(x: float) -> int:
    return (x > 0) - (x < 0)


def trend(rows: list[dict]) -> dict:
    """Over every series of compared rows (ordered by gpus): how many consecutive GPU-count steps there are,
    and the fraction where the predicted per-GPU throughput moves the way the published one does."""
    series: dict[str, list[dict]] = defaultdict(list)
    for o in rows:
        if o.get("series") and o["status"] == "ok":
            series[o["series"]].append(o)
    steps = agree = 0
    per_series = {}
    for key, members in sorted(series.items()):
        members.sort(key=lambda o: o["gpus"])
        hits = [sign(per_gpu_throughput(b, b["predicted_s"]) - per_gpu_throughput(a, a["predicted_s"])) ==
                sign(per_gpu_throughput(b, b["measured_s"]) - per_gpu_throughput(a, a["measured_s"]))
                for a, b in zip(members, members[1:])]
        if hits:
            per_series[key] = sum(hits) / len(hits)
            steps, agree = steps + len(hits), agree + sum(hits)
    return {"steps": steps, "agree": agree / steps if steps else None, "series": per_series}
