"""Predict the published H100/H200/B200/GB200 training runs of simexec/validation/data/modern_runs.csv, and compare.

Every row is predicted by one rule, from its own columns (the CSV's header names the sources and the
rules by which its columns were filled); nothing here is fitted to the rows.

Model: the simexec preset when `model` names one (simexec.specs.model_presets.MODELS), else a ModelSpec
from the row's fields built as the Llama 3 / Mixtral / DeepSeek-V3 presets are: RMSNorm, gated SwiGLU
FFN, RoPE, no biases, untied embeddings; MoE rows every layer sparse, `moe_experts` routed experts of
`moe_ffn` picking `moe_top_k`, `moe_shared` shared experts, dropless (capacity None: the Megatron-Bridge
tables force balanced, dropless routing) unless the row's `moe_capacity` gives the capacity factor its run
dropped and padded to (`MoESpec.capacity_factor`; a preset model takes it too). Two facts of a non-preset model that the columns do not carry
come from its Hugging Face config.json (`CONFIG_EXTRAS`): Qwen3-MoE's head_dim 128 (not hidden/heads)
and its per-head q/k RMSNorm. The sequence length is the row's `seq_len`.

Cluster: h100 -> `Nxdgx-h100`, h200 -> `Nxhgx-h200`, b200 -> `Nxhgx-b200`, mi300x -> `Nxmi300x-8` (N = gpus / 8); gb200 -> the
`gb200-nvl72` preset cut to gpus / 4 trays of 4 GPUs (one NVLink domain per 72 GPUs; from 128 GPUs on, one per
64 GPUs: Slurm's --segment 16, `SEGMENTED_GPUS`). The torchtitan
rows ran on Meta's Grand Teton H100 with 96 GB of HBM2e at its 500 W default (the rows' notes): the cluster
file data/h100-hbm2e-500w.yaml (its memory, bandwidth, and peaks under the cap, each sourced there), gpus / 8
nodes of it.

Stack: the row's `stack` (megatron-core, torchtitan, torchtitan-compile, deepspeed are
simexec.specs.stack.STACKS); `nemo` -> megatron-core; `other` (the Llama 3 paper's own framework) ->
simexec's default; a torchtitan row of a source in `EAGER_LOSS_SOURCES` (a torchtitan commit that ran the
loss eager under compile) gets `cross_entropy: eager`; one in `SM100_CUDNN_SOURCES` (a torchtitan commit that ran
cuDNN attention on sm100 and did not save it under per-op checkpointing) gets `cudnn_attention_from: (10, 0)` and
`op_sac_saved_attention: (fa2, fa3)`. An FP8 row's `fp8_recipe` replaces the stack's FP8 scaling (torchao's `tensorwise` is
current scaling); the stack's other FP8 traits (where it casts) stay.

Plan: tp, sp, pp, vpp (interleaved-1f1b when vpp > 1), cp, ep (MoE rows), mbs, gbs, dtype (bf16 | fp8),
recompute (none | selective | full: `selective:<modules>` -> selective, `full:block N layers` -> full with
recompute_layers=N; torchtitan's selective is its per-operator policy, `op`, which its llama3 configs choose:
selective_ac_option = "op"), fused attention (simexec's default); dp is derived (gpus / (tp*pp*cp)). Where pp*vpp
does not divide the layers (Llama 3.1 405B's 126, DeepSeek-V3's 61, Qwen3-235B's 94), the virtual stages
are `simexec.specs.plan.balanced_stages` (`balanced_layout` where an end stage is left with only the embedding
or the loss): the embedding and the loss count as a layer each (Megatron's
--account-for-embedding/loss-in-pipeline-split, which the 405B recipes set; the Qwen3 recipes give a
hand-written pipeline layout of the same kind, approximated by this split). Megatron-Bridge's DeepSeek-V3
rows take its recipe's `layout` for their (pp, vpp) (`DSV3_LAYOUTS`), with the MTP module where the row
says it ran one (`mtp_layers=1`); a row's `layout` column (its release config's pipeline layout) comes
first. What the framework does beyond the columns, by stack:

| stack | settings |
| --- | --- |
| megatron-core | distributed optimizer `zero=1,param_overlap=1`; `grad_overlap=1`; `grad_fp32=1` (Megatron's bf16 default) except for `BF16_GRAD_SOURCES` (recipes with grad_reduce_in_fp32 off); `tp_overlap=1` and `tp_async=1` (Megatron-Bridge's recipes set --tp-comm-overlap) when tp > 1 and the row's `tp_overlap` is not 0; `fp8_param_gather=1` under the FP8 current-scaling recipe (which sets it); `cp_impl=ring` when cp > 1 (Transformer Engine's p2p context parallel); Megatron-FSDP rows (fsdp = 1): `zero=3` instead of the distributed optimizer |
| torchtitan, torchtitan-compile | `zero=3` (FSDP2) when fsdp = 1 or cp > 1 (it shards over dp_shard x cp: parallel_dims.py `fsdp_enabled`), else `zero=0`; `grad_fp32=1` (FSDP2 reduces in fp32: `--training.mixed_precision_reduce` default float32); `cp_impl=allgather` when cp > 1 (`--experimental.context_parallel_rotate_method` default allgather); both pytorch/torchtitan@9dec370 torchtitan/config_manager.py; `tp_async=1` where the row says async TP (enable_async_tensor_parallel); `recompute=op` for its selective AC (its llama3 configs' selective_ac_option = "op"); `reshard_after_forward=0` when pp > 1 (its FSDP policy: `not pp_enabled`) |
| other (Llama 3 paper) | `cp_impl=allgather` when cp > 1 (the paper's all-gather context parallelism) |

MoE rows: `moe_dispatcher` (alltoall where empty; Megatron's flex dispatcher over DeepEP or Hybrid-EP is
simexec's node-limited `deepep`, `DISPATCHERS`) and `moe_a2a_overlap` (1: the recipe's
--overlap-moe-expert-parallel-comm) become the plan's knobs of the same names; an MoE row whose expert
tensor-parallel size (`etp`) differs from tp runs Megatron-Core's parallel folding: plan `etp` (the experts
on their own etp x ep x edp mesh over each stage's ranks); the MTP module where the notes say it ran one.
Not modelled (in the notes of the rows that have them): activation offloading. A row simexec refuses
(PlanError, SpecError) is kept as `refused`.

Superseded rows: where a publisher measured the same workload (system, model, precision) again in a newer
software release (the plan or GPU count may change with it), the older row names the newer one in
`superseded_by`. simexec models each stack as it is now, so a superseded row is predicted and printed in its
own family, `superseded`, and left out of the overall statistics and the other families (one rule for every
publisher and model).

Measured step time: `step_s` as published; `tokens_per_s_per_gpu` -> gbs * seq_len / (value * gpus)
(torchtitan counts a step's tokens before the cp split and divides by tp*cp*pp, train.py at 9dec370:
the same per-GPU figure); `tflops_per_gpu` and `mfu` through the FLOP count the source states
(`FLOP_COUNTS`). The Llama 3 paper (Table 4) states no FLOP count, so its rows are `not comparable`.

Error = predicted / measured - 1 (positive: simexec predicts a slower step).
Families (a row may be in several): fp8, long-context (seq_len >= 32768 or cp > 1), tp, pp, fsdp, moe,
scale-out (rows of a `series`: one publisher's model, plan and software at several GPU counts, with the
share of GPU-count steps whose per-GPU throughput moves as published), and the device; and `sharded-dp`, the rows of data/sharded_dp_runs.csv, mapped by their own rules
(simexec.validation.sharded_dp), which the table (`TABLE`) predicts after these, with the share of
GPU-count steps whose per-GPU throughput moves as published (its `trend`).
"""
from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from simexec.errors import PlanError, SpecError
from simexec.specs.cluster import ClusterSpec, get_cluster
from simexec.specs.model import ModelSpec, MoESpec
from simexec.specs.model_presets import MODELS
from simexec.specs.plan import Plan, balanced_layout, balanced_stages
from simexec.specs.stack import StackSpec, get_stack
from simexec.validation.markdown import replace_block
from simexec.validation.published import DATA, read_published_csv
from simexec.validation.table_script import Table, predicted_rows

CSV = DATA / "modern_runs.csv"

# Hugging Face config.json facts the CSV's columns leave out: Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B
# set "head_dim": 128 (hidden / heads would be 64) and Qwen3-MoE's attention norms each head's q and k
# (transformers models/qwen3_moe/modeling_qwen3_moe.py: q_norm, k_norm).
CONFIG_EXTRAS: dict[str, dict] = {
    "Qwen/Qwen3-30B-A3B": {"head_dim": 128, "qk_norm": True},
    "Qwen/Qwen3-235B-A22B": {"head_dim": 128, "qk_norm": True},
}
STACK_ALIASES = {"nemo": "megatron-core", "other": None}
FP8_SCALING = {"tensorwise": "current"}  # torchao's dynamic tensorwise = per-tensor current scaling
# Sources whose TFLOP/s (and MFU) can be turned back into a step time: source key -> FLOPs of one
# step as that source counts them. None known for the rows so far.
FLOP_COUNTS: dict[str, Callable[[dict], float]] = {}
DEVICE_CLUSTERS = {"h100": "dgx-h100", "h200": "hgx-h200", "b200": "hgx-b200", "mi300x": "mi300x-8"}
GRAND_TETON_H100 = DATA / "h100-hbm2e-500w.yaml"  # the tt-* rows' H100s (their notes)
LONG_CONTEXT = 32768
# The family of a row whose configuration a newer release of the same publisher measured again (its
# `superseded_by` names that row): printed, and summarised apart from the rows that describe the current stacks.
SUPERSEDED = "superseded"
# The family of rows that form series over GPU counts (`series`): the summary gives its per-GPU throughput trend.
SCALE_OUT = "scale-out"
TREND_FAMILIES = (SCALE_OUT, "sharded-dp")


class NotComparable(Exception):
    """The row's published number cannot be turned into a step time."""


@dataclass(frozen=True)
class Mapped:
    """What one row becomes for simexec.simulate."""

    model: ModelSpec
    cluster: ClusterSpec
    plan: str
    stack: StackSpec
    seq_len: int


def _int(r: dict, col: str, default: int = 1) -> int:
    v = r[col].strip()
    return int(v) if v else default


def row_mtp(r: dict) -> int:
    """MTP depths a row trains: one where its notes say it ran with an MTP module, else none."""
    return 1 if "WITH one MTP module" in r["notes"] else 0


# Megatron-Bridge's DeepSeek-V3 pipeline layouts by (pp, vpp) (src/megatron/bridge/recipes/deepseek/deepseek_v3.py
# at 5776a6d90b4d, set_deepseek_v3_pipeline_model_parallel_layout): (embedding, decoder layers) of the first
# virtual stage, decoder layers of each middle one, decoder layers of the last (+ its MTP depths and the loss).
DSV3_LAYOUTS = {(4, 1): (16, 16, 13, 4), (8, 1): (8, 8, 5, 8), (4, 2): (8, 8, 5, 8), (16, 1): (4, 4, 1, 16),
                (8, 2): (4, 4, 1, 16), (4, 4): (4, 4, 1, 16)}


def dsv3_layout(pp: int, vpp: int, mtp: int) -> Optional[str]:
    """The layout Megatron-Bridge gives DeepSeek-V3 at (pp, vpp), in Megatron's notation; None where it has none."""
    shape = DSV3_LAYOUTS.get((pp, vpp))
    if shape is None:
        return None
    first, middle, last, stages = shape
    return "|".join(["E" + "t" * first] + ["t" * middle] * (stages - 2) + ["t" * last + "m" * mtp + "L"])


def row_capacity(r: dict) -> Optional[float]:
    """The row's expert capacity factor (token dropping, each expert's input padded to capacity); None: dropless."""
    text = (r.get("moe_capacity") or "").strip()
    return float(text) if text else None


def row_model(r: dict) -> ModelSpec:
    if r["model"] in MODELS:
        m = MODELS[r["model"]]
        if row_capacity(r) is not None and m.moe is not None:
            m = m.model_copy(update={"moe": m.moe.model_copy(update={"capacity_factor": row_capacity(r)})})
        return m.model_copy(update={"mtp_layers": row_mtp(r)}) if row_mtp(r) else m
    hidden, heads = int(r["hidden"]), int(r["heads"])
    moe = None
    if r["moe_experts"]:
        moe = MoESpec(experts=int(r["moe_experts"]), top_k=int(r["moe_top_k"]), expert_ffn=int(r["moe_ffn"]),
                      shared_experts=int(r["moe_shared"]), first_dense_layers=0, capacity_factor=row_capacity(r))
    fields = dict(name=r["model"], layers=int(r["layers"]), hidden=hidden, heads=heads, kv_heads=int(r["kv_heads"]),
                  head_dim=hidden // heads, ffn=int(r["ffn"]), gated=True, vocab=int(r["vocab"]),
                  seq_len=int(r["seq_len"]), tied_embeddings=False, norm="rmsnorm", bias=False, learned_pos=False,
                  moe=moe, source=f"modern_runs.csv row {r['name']} ({r['source'].split(':')[0]})")
    fields.update(CONFIG_EXTRAS.get(r["model"], {}))
    return ModelSpec(**fields)


def is_torchtitan(r: dict) -> bool:
    return r["stack"].startswith("torchtitan")


# GB200 jobs of 128 GPUs and more run with Slurm's --segment 16 (NVIDIA's recommendation for large jobs such
# as MoE training, developer.nvidia.com/blog "Unlock exascale performance on NVIDIA GB200 NVL72 with Slurm
# topology-aware job scheduling"): their trays come 16 to a rack, so each 64-GPU group shares one NVLink domain
# and a 72-GPU rack's other 2 trays go to other jobs; smaller jobs fit one rack (one block).
SEGMENTED_GPUS, GB200_SEGMENT_TRAYS = 128, 16


def row_cluster(r: dict) -> ClusterSpec:
    gpus, device = int(r["gpus"]), r["device"]
    if device == "gb200":
        if gpus % 4:
            raise SpecError(f"{gpus} GPUs is not a whole number of GB200 trays (4 GPUs each)")
        cluster = get_cluster("gb200-nvl72")
        if gpus >= SEGMENTED_GPUS:  # Slurm places the job's trays 16 to an NVL72 rack: 64-GPU NVLink domains
            node = cluster.node.model_copy(update={"nvlink_domain_gpus": GB200_SEGMENT_TRAYS * cluster.node.gpus_per_node})
            cluster = cluster.model_copy(update={"node": node})
        return cluster.model_copy(update={"nodes": gpus // 4, "name": f"gb200-nvl72-{gpus}gpu"})
    if device not in DEVICE_CLUSTERS:
        raise SpecError(f"device {device!r} has no simexec cluster")
    if gpus % 8:
        raise SpecError(f"{gpus} GPUs is not a whole number of 8-GPU nodes")
    if device == "h100" and is_torchtitan(r):
        capped = get_cluster(str(GRAND_TETON_H100))
        return capped.model_copy(update={"nodes": gpus // 8, "name": f"{gpus // 8}x{capped.name}"})
    return get_cluster(f"{gpus // 8}x{DEVICE_CLUSTERS[device]}")


# Sources that ran torchtitan at a commit whose loss was eager even under --compile: from torchtitan@e8977b007
# (2024-12-18, "turning off compile on loss function") to torchtitan@bbb1b616e (2025-04-02, which compiles
# it again): tt-2412 at 9dec370 (2024-12-26), tt-808 (pull request of 2025-01-27), and tao-train's H100
# table (added to torchao's float8 README by pytorch/ao@8c81863ba on 2025-03-12, run on pytorch 2.7.0a0; its
# MI300X and B200 tables ran torchtitan 2c8b59479 and 6fc499f6f of August 2025). Prefixes of `source`.
EAGER_LOSS_SOURCES = ("tt-2412:", "tt-808:", "tao-train:docs/source/workflows/training.md 'NVIDIA H100'")


def eager_loss_source(r: dict) -> bool:
    """Whether a torchtitan row's run computed its loss eager (`EAGER_LOSS_SOURCES`)."""
    return r["source"].startswith(EAGER_LOSS_SOURCES)


# Sources that ran torchtitan between @3b85aa31f (2025-05-14, "Use cudnn backend on B200": SDPA under
# sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH], set_priority=True) where
# has_cuda_capability(10, 0), flash first elsewhere; @6a3a9da95, 2025-10-09, put cuDNN first on every device)
# whose per-op checkpointing _save_list names only the flash and efficient SDPA ops (until @b39377f9f,
# 2025-12-01): tt-h200 at e7c0cae (2025-06-11) and tao-train's MI300X and B200 tables (2c8b59479, 6fc499f6f of
# August 2025). On sm100 their attention is cuDNN's, and recompute=op recomputes it. Prefixes of `source`.
SM100_CUDNN_SOURCES = ("tt-h200:", "tao-train:docs/source/workflows/training.md 'AMD MI300x'",
                       "tao-train:docs/source/workflows/training.md 'Training e2e benchmarks on NVIDIA B200'")


# Megatron-Core sources whose recipe keeps the gradient buffer in bf16 (`ddp.grad_reduce_in_fp32 = False`), where
# the other rows keep Megatron-LM's fp32 main gradients. Megatron-LM@2a75ac12c (the submodule of Megatron-Bridge@067f987df03b)
# param_and_grad_buffer.py `group_params_for_buffers`: grad_dtype = torch.float if grad_reduce_in_fp32 else
# param.dtype. mb-skill: Megatron-Bridge@067f987df03b recipes/qwen/h100/qwen3_moe.py
# `qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config` sets it False (with `use_precision_aware_optimizer = True`, whose
# distrib_optimizer.py `_copy_model_grads_to_main_grads` hands the bf16 shard over as `decoupled_grad`, no fp32 copy);
# mb-gb200doc: the recipe's docstring ("BF16 grad accumulation"). mb-2511 and mb-newest: every Megatron-Bridge
# performance configuration the published tables ran sets it False, from the first one on
# (Megatron-Bridge@568b3a3ef, 2025-08-28, scripts/performance/llm/configs/*_pretrain_overrides.yaml
# `mixed_precision.grad_reduce_in_fp32: false`; @cf457d8d3 scripts/performance/configs/*/*_llm_pretrain.py; @067f987df03b
# perf_recipes/_common.py `_benchmark_common` and `_perf_precision`), and the oldest table is 25.09's. Prefixes of `source`.
BF16_GRAD_SOURCES = ("mb-skill:", "mb-gb200doc:", "mb-2511:", "mb-newest:")


def row_grad_fp32(r: dict) -> bool:
    """Whether a Megatron-Core row's run kept fp32 main gradients (not a `BF16_GRAD_SOURCES` recipe)."""
    return not r["source"].startswith(BF16_GRAD_SOURCES)


def row_stack(r: dict) -> StackSpec:
    stack = get_stack(STACK_ALIASES.get(r["stack"], r["stack"]))
    if is_torchtitan(r) and eager_loss_source(r):
        stack = stack.model_copy(update={"cross_entropy": "eager"})
    if is_torchtitan(r) and r["source"].startswith(SM100_CUDNN_SOURCES):
        stack = stack.model_copy(update={"cudnn_attention_from": (10, 0), "op_sac_saved_attention": ("fa2", "fa3")})
    if r["dtype"] == "fp8" and r["fp8_recipe"]:
        scaling = FP8_SCALING.get(r["fp8_recipe"], r["fp8_recipe"])
        stack = stack.model_copy(update={"fp8": stack.fp8.model_copy(update={"scaling": scaling})})
    if r.get("cuda_graphs") == "1" and r["moe_experts"] and stack.host is not None:
        # Megatron-Bridge's MoE workload configs graph the router and the token counts' preprocessing
        # with TE (cuda_graph_scope moe_router, moe_preprocess: the B200 Qwen3 row's source); the dispatch and
        # the experts stay eager. A dense row's scope is not stated: its layers are priced eager.
        stack = stack.model_copy(update={"host": stack.host.model_copy(update={"cuda_graphs": ("moe_router",)})})
    return stack


def recompute_fields(text: str) -> dict:
    """`none`, `selective`, `full`; `selective:<modules>` -> selective over those modules (Megatron-Core's
    --recompute-modules, separated by `+` or `,`); `full:block N layers` -> full, N layers."""
    kind, _, detail = text.strip().partition(":")
    if kind not in ("none", "selective", "full"):
        raise SpecError(f"recompute {text!r}: expected none, selective or full")
    out: dict = {"recompute": kind}
    m = re.search(r"(\d+)\s+layers", detail)
    if kind == "full" and m:
        out["recompute_layers"] = int(m.group(1))
    modules = tuple(x.strip() for x in re.split(r"[+,]", detail) if x.strip())
    if kind == "selective" and modules and modules != ("core_attn",):
        out["recompute_modules"] = modules
    return out


# A row's `moe_dispatcher` column -> simexec's plan. Megatron-Core's flex dispatcher runs DeepEP or NVIDIA's
# Hybrid-EP (DeepEP's hybrid-ep branch, docs/README_Hybrid-EP.md: RDMA between nodes, NVLink inside one, tokens
# cross the network once per destination node): both are simexec's node-limited `deepep`.
DISPATCHERS = {"": "alltoall", "alltoall": "alltoall", "allgather": "allgather", "deepep": "deepep",
               "hybridep": "deepep"}


def moe_fields(r: dict) -> dict:
    """The MoE plan knobs a row's columns give: its dispatcher and whether dispatch and combine overlap another
    micro-batch's compute (Megatron-Core's --overlap-moe-expert-parallel-comm, `moe_a2a_overlap` in the recipes)."""
    dispatcher = (r.get("moe_dispatcher") or "").strip()
    if dispatcher not in DISPATCHERS:
        raise SpecError(f"row {r['name']}: moe_dispatcher {dispatcher!r} is none of {sorted(DISPATCHERS)[1:]}")
    out: dict = {"moe_dispatcher": DISPATCHERS[dispatcher]}
    if (r.get("moe_a2a_overlap") or "").strip() == "1":
        out["moe_a2a_overlap"] = True
    return out


def row_plan(r: dict) -> str:
    tp, pp, cp, vpp = _int(r, "tp"), _int(r, "pp"), _int(r, "cp"), _int(r, "vpp")
    fields: dict = dict(tp=tp, sp=r["sp"] == "1", pp=pp, vpp=vpp, cp=cp, mbs=int(r["mbs"]), gbs=int(r["gbs"]),
                        dtype=r["dtype"], flash_attention=True, **recompute_fields(r["recompute"]))
    if (r.get("offload_layers") or "").strip():
        fields["offload_layers"] = int(r["offload_layers"])
    if r["moe_experts"]:
        fields["ep"] = _int(r, "ep")
        if _int(r, "etp") != tp:  # Megatron-Core's parallel folding: the experts on their own (etp, ep, edp) mesh
            fields["etp"] = _int(r, "etp")
        fields.update(moe_fields(r))
    layers = int(r["layers"])
    layout = (r.get("layout") or "").strip() or (
        dsv3_layout(pp, vpp, row_mtp(r)) if r["model"] == "deepseek-v3" and r["source"].startswith("mb-") else None)
    if layout:
        fields["layout"] = layout
    elif pp > 1 and layers % (pp * vpp):
        stages = balanced_stages(layers, pp * vpp)
        if stages:
            fields["stages"] = stages
        else:
            fields["layout"] = balanced_layout(layers, pp * vpp)  # None where no split leaves a layer per stage
    fsdp = r["fsdp"] == "1"
    stack = STACK_ALIASES.get(r["stack"], r["stack"])
    if stack == "megatron-core":
        fields.update(dict(zero=3) if fsdp else dict(zero=1, param_overlap=True))
        # Megatron-Bridge's recipes turn on --tp-comm-overlap wherever tp > 1 (recipes/llama/h100/llama3.py);
        # a row's tp_overlap column says where its script turns it off
        overlap = tp > 1 and (r.get("tp_overlap") or "").strip() != "0"
        fields.update(grad_overlap=True, grad_fp32=row_grad_fp32(r), tp_overlap=overlap, tp_async=overlap and r["sp"] == "1")
        # Megatron-Bridge's FP8 current-scaling recipe sets fp8_param_gather=True (training/mixed_precision.py,
        # bf16_with_fp8_current_scaling_mixed)
        fields["fp8_param_gather"] = r["fp8_recipe"] == "current"
        if cp > 1:
            fields["cp_impl"] = "ring"
    elif is_torchtitan(r):
        # FSDP2 shards over dp_shard x cp whenever cp > 1 too (torchtitan/distributed/parallel_dims.py:
        # fsdp_enabled = dp_shard_enabled or cp_enabled)
        fields.update(zero=3 if fsdp or cp > 1 else 0, grad_fp32=True)
        if fields["recompute"] == "selective":  # torchtitan's llama3 configs: selective_ac_option = "op"
            fields["recompute"] = "op"
        fields["tp_async"] = "async TP" in r["notes"]  # enable_async_tensor_parallel, as the row says
        # torchtitan shards with reshard_after_forward = not pp_enabled (torchtitan@9dec370
        # parallelize_llama.py apply_fsdp; HEAD distributed/fsdp.py get_fsdp_reshard_after_forward_policy)
        if fields["zero"] == 3 and pp > 1:
            fields["reshard_after_forward"] = False
        if cp > 1:
            fields["cp_impl"] = "allgather"
    elif cp > 1:
        fields["cp_impl"] = "allgather"
    return Plan(**fields).to_string()


def measured_step_s(r: dict) -> float:
    value, gpus = float(r["value"]), int(r["gpus"])
    metric = r["metric"]
    if metric == "step_s":
        return value
    if metric == "tokens_per_s_per_gpu":
        return int(r["gbs"]) * int(r["seq_len"]) / (value * gpus)
    key = r["source"].split(":")[0]
    if metric in ("tflops_per_gpu", "mfu"):
        if key not in FLOP_COUNTS:
            raise NotComparable(f"{key} states no FLOP count for its {metric}")
        flops = FLOP_COUNTS[key](r)
        if metric == "mfu":
            peak = row_cluster(r).device.peak_flops[r["dtype"]]
            return flops / (value * peak * gpus)
        return flops / (value * 1e12 * gpus)
    raise NotComparable(f"metric {metric!r}")


def families(r: dict) -> list[str]:
    if (r.get("superseded_by") or "").strip():
        return [SUPERSEDED]
    out = []
    if r["dtype"] == "fp8":
        out.append("fp8")
    if int(r["seq_len"]) >= LONG_CONTEXT or _int(r, "cp") > 1:
        out.append("long-context")
    if _int(r, "tp") > 1:
        out.append("tp")
    if _int(r, "pp") > 1:
        out.append("pp")
    if r["fsdp"] == "1":
        out.append("fsdp")
    if r["moe_experts"]:
        out.append("moe")
    if (r.get("series") or "").strip():
        out.append(SCALE_OUT)
    return out + [r["device"]]


def map_row(r: dict) -> Mapped:
    return Mapped(model=row_model(r), cluster=row_cluster(r), plan=row_plan(r), stack=row_stack(r),
                  seq_len=int(r["seq_len"]))


def simulate_mapped(mapping: Callable[[], Mapped], out: dict):
    """Simulate what `mapping` maps a row to, its plan and cluster noted in `out`; None, with `out` marked
    refused and why, where simexec refuses the mapping (PlanError, SpecError)."""
    from simexec.sim.simulate import simulate

    try:
        m = mapping()
        out.update(plan=m.plan, cluster=m.cluster.name)
        return simulate(m.model, m.cluster, m.plan, seq_len=m.seq_len, stack=m.stack)
    except (PlanError, SpecError) as exc:
        out.update(status="refused", reason=str(exc).splitlines()[0])
        return None


def simulate_row(r: dict, out: dict):
    """Simulate a row as mapped (`map_row`), its plan and cluster noted in `out`; None, with `out` marked
    refused and why, where simexec refuses the mapping."""
    return simulate_mapped(lambda: map_row(r), out)


def record_result(out: dict, res, t0: float) -> dict:
    """`out` with the simulated step (`res`) compared with its measured one, and the simulation's wall time."""
    out.update(predicted_s=res.step_time_s, error=res.step_time_s / out["measured_s"] - 1.0, fits=res.fits,
               peak_memory_gib=res.peak_memory_bytes / 2**30, sim_wall_s=time.perf_counter() - t0,
               breakdown={k: round(v / res.step_time_s, 4) for k, v in res.breakdown_s.items()},
               kernels={k: round(v / res.step_time_s, 4) for k, v in res.kernels_s.items()},
               kernel_tflops={k: round(v, 1) for k, v in res.kernels_tflops.items()})
    return out


def predict_row(r: dict) -> dict:
    """One result row: status ok | refused | not comparable, with the mapping and the comparison."""
    out = {"name": r["name"], "source": r["source"], "device": r["device"], "gpus": int(r["gpus"]),
           "stack": r["stack"], "model": r["model"], "seq_len": int(r["seq_len"]), "metric": r["metric"],
           "value": float(r["value"]), "published_peak_gib": float(r["peak_mem_gib"]) if r["peak_mem_gib"] else None,
           "families": families(r), "status": "ok", "reason": "",
           "plan": "", "cluster": "", "predicted_s": None, "measured_s": None, "error": None,
           "series": (r.get("series") or "").strip(), "gbs": int(r["gbs"])}
    return compared_row(out, lambda: measured_step_s(r), lambda: map_row(r))


def compared_row(out: dict, measured: Callable[[], float], mapping: Callable[[], Mapped]) -> dict:
    """`out` with the measured step (`measured()`; a NotComparable one leaves it unsimulated) and, unless
    simexec refuses the mapping, the simulated one and the error."""
    try:
        out["measured_s"] = measured()
    except NotComparable as exc:
        out.update(status="not comparable", reason=str(exc))
        return out
    t0 = time.perf_counter()
    res = simulate_mapped(mapping, out)
    if res is None:
        return out
    return record_result(out, res, t0)


def read_rows(path: Path = CSV) -> list[dict]:
    return read_published_csv(path)


def modern_rows(only: Optional[Callable[[str], bool]] = None, path: Path = CSV, log=print) -> list[dict]:
    return predicted_rows(read_rows(path), predict_row, line, only, log)


def all_rows(only: Optional[Callable[[str], bool]] = None, log=print) -> list[dict]:
    """The rows of modern_runs.csv, then those of sharded_dp_runs.csv (family `sharded-dp`)."""
    from simexec.validation.sharded_dp import sharded_dp_rows  # it builds on this module's rules

    return modern_rows(only, log=log) + sharded_dp_rows(only, log=log)


def line(o: dict) -> str:
    if o["status"] != "ok":
        return f"  {o['name']:<46} {o['device']:<6} {o['stack']:<19} {o['status']}: {o['reason']}"
    return (f"  {o['name']:<46} {o['device']:<6} {o['stack']:<19} {o['predicted_s']:8.3f} {o['measured_s']:8.3f} "
            f"{100 * o['error']:+7.1f}%  {o['plan']}  ({o['sim_wall_s']:.1f} s)")


def _stats(errors: list[float]) -> dict:
    return {"rows": len(errors), "median_abs_error": statistics.median(abs(e) for e in errors),
            "within_15pct": sum(abs(e) <= 0.15 for e in errors) / len(errors),
            "median_error": statistics.median(errors)}


def summary(rows: list[dict]) -> dict:
    """Statistics over the compared rows, overall and per family (refused and not comparable rows left out)."""
    ok = [r for r in rows if r["status"] == "ok"]
    current = [r for r in ok if SUPERSEDED not in r["families"]]
    if not current:
        return {}
    from simexec.validation.sharded_dp import trend

    fams = sorted({f for r in ok for f in r["families"]})
    families_ = {f: _stats([r["error"] for r in ok if f in r["families"]]) for f in fams}
    for f, st in families_.items():  # the families whose rows form series over GPU counts
        t = trend([r for r in ok if f in r["families"]]) if f in TREND_FAMILIES else {"steps": 0}
        if t["steps"]:
            st["trend"] = t
    return {**_stats([r["error"] for r in current]),
            "refused": sum(r["status"] == "refused" and SUPERSEDED not in r["families"] for r in rows),
            "not_comparable": sum(r["status"] == "not comparable" for r in rows),
            "superseded": len(ok) - len(current),
            # every published run trained: a row simulated as not fitting is a wrong verdict
            "wrong_fits": sorted(r["name"] for r in current if r.get("fits") is False),
            "families": families_}


def trend_text(st: dict) -> str:
    """A family's trend agreement, or '' where its rows form no series."""
    t = st.get("trend")
    if not t:
        return ""
    return f"{100 * t['agree']:.0f}% of {t['steps']} GPU-count steps"


def summary_lines(s: dict) -> list[str]:
    if not s:
        return ["no row compared"]
    apart = f", {s['superseded']} superseded apart" if s.get("superseded") else ""
    lines = [f"{s['rows']} rows compared ({s['refused']} refused, {s['not_comparable']} not comparable{apart}): "
             f"median |error| {100 * s['median_abs_error']:.1f}%, {100 * s['within_15pct']:.0f}% within 15%, "
             f"median error {100 * s['median_error']:+.1f}%"]
    wrong = s.get("wrong_fits", [])
    lines.append(f"  predicted not to fit, though each trained: {len(wrong)} rows" + (f" ({', '.join(wrong)})" if wrong else ""))
    for f, st in s["families"].items():
        trend_ = trend_text(st)
        lines.append(f"  {f:<13} {st['rows']:3d} rows: median |error| {100 * st['median_abs_error']:5.1f}%, "
                     f"within 15% {100 * st['within_15pct']:3.0f}%, median error {100 * st['median_error']:+6.1f}%"
                     + (f"; per-GPU throughput trend agrees in {trend_}" if trend_ else ""))
    return lines


BEGIN, END = "<!-- validate_modern:begin -->", "<!-- validate_modern:end -->"


def to_markdown(rows: list[dict], command: str) -> str:
    s = summary(rows)
    lines = [BEGIN, "", f"Generated by `{command}`.", "",
             "| row | device | stack | plan | predicted (s) | measured (s) | error |",
             "| --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        plan = f"`{r['plan']}`" if r["plan"] else ""
        if r["status"] == "ok":
            nums = f"{r['predicted_s']:.3g} | {r['measured_s']:.3g} | {100 * r['error']:+.1f}%"
        else:
            nums = f" | {r['measured_s']:.3g} | {r['status']}: {r['reason']}" if r["measured_s"] else \
                f" | | {r['status']}: {r['reason']}"
        lines.append(f"| {r['name']} | {r['device']} | {r['stack']} | {plan} | {nums} |")
    if s:
        lines += ["", summary_lines(s)[0] + ".", "", summary_lines(s)[1].strip() + ".", "",
                  "| family | rows | median abs error | within 15% | median error | trend (per-GPU throughput) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for f, st in s["families"].items():
            lines.append(f"| {f} | {st['rows']} | {100 * st['median_abs_error']:.1f}% | "
                         f"{100 * st['within_15pct']:.0f}% | {100 * st['median_error']:+.1f}% | {trend_text(st)} |")
        lines += moe_parts(rows)
        if any("trend" in st for st in s["families"].values()):
            lines += ["", "Trend: over each series of rows that differ only in GPU count, the share of consecutive "
                      "GPU-count steps where the predicted per-GPU throughput moves (up or down) as the published "
                      "one does."]
    lines += ["", END]
    return "\n".join(lines)


def moe_parts(rows: list[dict]) -> list[str]:
    """Markdown: where each compared MoE row's predicted step goes (shares of the slowest rank's compute
    stream), and the rate its GEMMs reach at the plan's precision while they run, so that a row near its
    published step by cancellation (compute too fast against communication too slow) shows; rows of one
    workload in bf16 and FP8 sit side by side by name."""
    moe = sorted((r for r in rows if r["status"] == "ok" and "moe" in r["families"] and r.get("breakdown")),
                 key=lambda r: r["name"])
    if not moe:
        return []
    out = ["", "MoE rows, where the predicted step goes (shares of the slowest rank's step; GEMMs: those at the "
           "plan's precision, their casts included, and the TFLOP/s they reach while they run):", "",
           "| row | error | compute | recompute | exposed ep | other comm | bubble | GEMMs | GEMM TFLOP/s |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in moe:
        b, k, rate = r["breakdown"], r.get("kernels", {}), r.get("kernel_tflops", {})
        comm = sum(v for key, v in b.items() if key.startswith("comm.") and key != "comm.ep")
        gemm = next((key for key in k if key.startswith("gemm.") and key != "gemm.bf16"), "gemm.bf16")
        out.append(f"| {r['name']} | {100 * r['error']:+.1f}% | {100 * b.get('compute', 0):.0f}% | "
                   f"{100 * b.get('recompute', 0):.0f}% | {100 * b.get('comm.ep', 0):.0f}% | {100 * comm:.0f}% | "
                   f"{100 * b.get('pipeline_bubble', 0):.0f}% | {gemm.split('.')[1]} {100 * k.get(gemm, 0):.0f}% | "
                   f"{rate.get(gemm, 0):.0f} |")
    return out + precision_pairs(rows)


def precision_pairs(rows: list[dict]) -> list[str]:
    """Markdown: the FP8 speedup over bf16, published and predicted, for each pair of compared rows that
    differ only in precision (names equal but for `bf16` / `fp8`): a predicted step near the published one
    with an FP8 gain far from the published gain is right by cancellation."""
    ok = {r["name"]: r for r in rows if r["status"] == "ok"}
    pairs = []
    for name, r in sorted(ok.items()):
        parts = name.split("-")
        if "bf16" in parts:
            other = "-".join("fp8" if p == "bf16" else p for p in parts)
            if other in ok:
                pairs.append((r, ok[other]))
    if not pairs:
        return []
    out = ["", "Rows in bf16 and FP8 of one workload: the FP8 speedup (bf16 step / FP8 step), published and "
           "predicted:", "", "| bf16 row | published | predicted | predicted / published |", "| --- | ---: | ---: | ---: |"]
    for b, f in pairs:
        pub, pred = b["measured_s"] / f["measured_s"], b["predicted_s"] / f["predicted_s"]
        out.append(f"| {b['name']} | {pub:.3f} | {pred:.3f} | {pred / pub:.3f} |")
    return out


def update_markdown(path: Path, block: str) -> None:
    replace_block(path, block, BEGIN, END, new_doc="# Validation against published results\n\n")


TABLE = Table("validate_modern.py", f"  {'row':<46} {'device':<6} {'stack':<19} {'pred s':>8} {'meas s':>8} {'error':>8}  plan",
              lambda only: all_rows(only), summary, summary_lines, to_markdown, update_markdown)
