"""Parallel plans: the split of one training step over ranks, parsed from a short string or a file.

`Plan` holds what the user wrote; `resolve()` checks it against a model and a cluster and returns a
`ResolvedPlan` with every derived fact (world size, micro-batches, layers per stage, mesh). Each
rule a plan can break has its own message naming the rule and the values.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from simexec.specs.cluster import ClusterSpec, one_line, read_mapping
from simexec.errors import PlanError
from simexec.specs.pipeline_layout import resolve_layout
from simexec.specs.plan_rules import check_plan
from simexec.specs.mesh import Mesh
from simexec.specs.model import ModelSpec
from simexec.specs.stack import StackSpec, get_stack
from simexec.program.schedules import SCHEDULES, Schedule, default_schedule, schedule
from simexec.specs.zero3_flavours import DEFAULT_ZERO3_FLAVOUR, ZERO3_FLAVOURS, Zero3Flavour, zero3_flavour

AXES = ("tp", "cp", "dp", "pp")
# bytes of the activations, weights and gradients a plan keeps: FP8 recipes keep them in bf16 and cast
# only the linear GEMMs' operands (simexec.specs.stack.Fp8Recipe)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
# Megatron-Core's --recompute-modules under selective recompute (TransformerConfig.recompute_modules,
# NVIDIA/Megatron-LM@d98e8a6 megatron/core/transformer/transformer_config.py:560, checked at :1940);
# the first four keep the submodule's input, the last three discard its output (`simexec.program.
# selective_recompute`)
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts", "moe_act", "layernorm", "mla_up_proj")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)


class Plan(BaseModel):
    """How one training step is split. Axes left out are 1; `dp` left out is derived from the world size."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    dp: Optional[int] = Field(None, gt=0, description="data-parallel degree; None = world / (tp*cp*pp)")
    tp: int = Field(1, gt=0, description="tensor-parallel degree (Megatron 1D)")
    sp: bool = Field(False, description="sequence parallel on top of tp (Korthikanti et al. 2022)")
    cp: int = Field(1, gt=0, description="context-parallel degree: the sequence split across ranks")
    cp_impl: Literal["allgather", "ring", "a2a"] = Field(
        "allgather", description="K/V exchange: all-gather (Llama 3), ring, or all-to-all between sequence and "
        "heads (DeepSpeed-Ulysses)")
    pp: int = Field(1, gt=0, description="pipeline stages")
    vpp: int = Field(1, gt=0, description="virtual stages per pipeline rank (interleaving)")
    ep: int = Field(1, gt=0, description="expert-parallel degree: carved out of dp, or with etp out of tp*cp*dp")
    etp: Optional[int] = Field(
        None, gt=0, description="expert tensor-parallel degree (Megatron-Core's --expert-tensor-parallel-size): the"
        " MoE layers fold onto a mesh of their own (etp, ep, edp; etp fastest) over each pipeline stage's tp*cp*dp"
        " ranks (MoE Parallel Folding, arXiv 2504.14960); None: every expert split over tp, ep carved out of dp")
    moe_dispatcher: Literal["alltoall", "allgather", "deepep"] = Field(
        "alltoall", description="MoE token dispatcher (Megatron-Core's --moe-token-dispatcher-type): alltoall, each"
        " token's top_k rows sent to their experts' ranks over ep; allgather, every token all-gathered over the"
        " ep (x etp) group, each rank keeping its experts' rows, reduce-scattered back; deepep (Megatron's flex"
        " dispatcher over DeepEP): node-limited, a token crosses the network once per destination node and fans"
        " out over NVLink there")
    moe_a2a_overlap: bool = Field(
        False, description="MoE: one micro-batch's forward and another's backward interleaved layer by layer, so"
        " each one's dispatch and combine run under the other's compute (Megatron-Core's"
        " --overlap-moe-expert-parallel-comm, combined 1F1B); with a single micro-batch nothing pairs")
    moe_router_skew: float = Field(
        1.0, ge=1.0, description="MoE load imbalance: the busiest expert-parallel rank receives this times the"
        " balanced rows, and every rank waits for it in the combine; 1: balanced routing (Megatron-Bridge's"
        " benchmarks force it)")
    zero: int = Field(0, ge=0, le=3, description="ZeRO stage: 1 optimizer, 2 +gradients, 3 +parameters")
    zero_impl: Optional[Literal[tuple(ZERO3_FLAVOURS)]] = Field(
        None, description="flavour of ZeRO-3; default fsdp (see `lazy_grad_shards` for how they differ)")
    zero3_gather_bucket: Optional[float] = Field(
        None, gt=0, description="zero_impl=deepspeed: elements per parameter all-gather call (DeepSpeed's"
        " stage3_prefetch_bucket_size, default 5e7)")
    zero3_persist_below: Optional[float] = Field(
        None, ge=0, description="zero_impl=deepspeed: tensors of at most this many elements stay unsharded, never"
        " gathered (DeepSpeed's stage3_param_persistence_threshold, default 1e5); 0: every tensor is sharded")
    zero3_reduce_bucket: Optional[float] = Field(
        None, gt=0, description="zero_impl=deepspeed: elements per gradient reduce-scatter call (DeepSpeed's"
        " reduce_bucket_size, default 5e8)")
    reshard_after_forward: bool = Field(
        True, description="zero=3, zero_impl=fsdp: FSDP2's fully_shard(reshard_after_forward=...); 0: a unit gathered"
        " for its forward stays gathered until its backward is done, which then needs no second all-gather"
        " (torchtitan's default under pp>1)")
    dp_shard: Optional[int] = Field(None, gt=0, description="HSDP: shard within groups of this size, replicate across")
    offload: Literal["none", "optimizer", "optimizer+params"] = "none"
    mbs: int = Field(1, gt=0, description="micro-batch size (sequences)")
    gbs: Optional[int] = Field(None, gt=0, description="global batch (sequences); None = mbs*dp*pp")
    schedule: Optional[Literal[tuple(SCHEDULES)]] = Field(
        None, description="pipeline schedule; default 1f1b, interleaved-1f1b when vpp > 1; zb-h1: zero-bubble"
        " (Qi et al. 2024), the backward split into input and weight gradients, the latter filling the bubble;"
        " interleaved-zb: the same over vpp virtual stages; zb-v: zero-bubble over two chunks per rank placed in"
        " a V (vpp=2; rank r holds stages r and 2pp-1-r); dualpipev: DualPipeV over the same V, pairs of one"
        " chunk's forward and the other's whole backward (run one after the other, as torch's runtime does)"
    )
    dualpipe_overlap: bool = Field(
        False, description="dualpipev: each pair's forward and whole backward interleaved kernel by kernel, so that"
        " one's communication (expert all-to-alls, tp collectives) runs under the other's compute (DeepSeek-V3's"
        " DualPipe); False: one after the other, as torch.distributed.pipelining's runtime runs a pair")
    recompute: Literal["none", "selective", "full", "op"] = Field(
        "none", description="activation recomputation before a layer's backward: selective, the attention core "
        "(Megatron-LM); full, the layer's forward; op, torchtitan's per-operator selective checkpointing, which keeps "
        "the attention's output and every other matmul's and recomputes the other matmuls and the element-wise ops")
    recompute_layers: Optional[int] = Field(None, ge=0, description="layers per stage that recompute; None = all")
    offload_layers: int = Field(
        0, ge=0, description="activation CPU offloading: the saved activations of the first this many transformer"
        " layers go to pinned host memory after their forward and come back before their backward, weights stay"
        " (Megatron-Core's cpu_offloading=True, cpu_offloading_num_layers=N, cpu_offloading_weights=False over"
        " Transformer Engine's cpu_offload.py); 0: none")
    recompute_modules: Optional[tuple[str, ...]] = Field(
        None, min_length=1, description="recompute=selective: the submodules it covers, in place of the default"
        " core_attn (Megatron-Core's --recompute-modules): core_attn, mlp (dense layers), moe, shared_experts,"
        " moe_act (the experts' activation), layernorm (the two pre-norms), mla_up_proj (MLA's q/kv up"
        " projections and RoPE); written joined by '+', e.g. mla_up_proj+mlp; None = core_attn")
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    flash_attention: bool = Field(True, description="fused attention kernel: no s x s scores kept for backward")
    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size in MB (DDP default 25)")
    grad_overlap: bool = Field(
        True, description="reduce data-parallel gradients as buckets fill, overlapped with the backward (torch DDP,"
        " FSDP); False: after the backward (Megatron-LM 2021's local DDP)")
    p2p_overlap: bool = Field(
        True, description="pipeline sends overlap the compute after them (isend, torch pipelining); False:"
        " blocking exchanges between groups of actions (Megatron-LM's batch_isend_irecv, waited)")
    tp_overlap: bool = Field(
        False, description="tp > 1: a column-parallel GEMM's backward issues its input gradient's tp all-reduce"
        " (reduce-scatter under sp) before its weight-gradient GEMM, which runs under it (Megatron-LM's"
        " LinearWithGradAccumulationAndAsyncCommunication, on by default since Megatron-Core); False: the"
        " collective after the whole backward (torch's DTensor, torchtitan, Megatron-LM before September 2021)")
    tp_async: bool = Field(
        False, description="sp: each all-gather before a column-parallel GEMM and each reduce-scatter after a "
        "row-parallel one is split into tp chunks that overlap the GEMM, which waits only for the first chunk (and "
        "leaves only the last exposed): torchtitan's async TP (micro-pipelined fused all-gather-matmul and "
        "matmul-reduce-scatter over SymmetricMemory), Megatron-Core's --tp-comm-overlap (userbuffers)")
    fp8_param_gather: bool = Field(
        False, description="dtype=fp8 with ZeRO: parameters are all-gathered as their FP8 copies, cast on the shard "
        "(torchtitan's enable_fsdp_float8_all_gather, Megatron-Core's --fp8-param-gather): half the bytes, and the "
        "linear layers get their FP8 weights without casting them")
    grad_fp32: bool = Field(
        False, description="accumulate and reduce gradients in fp32 (Megatron-LM's"
        " --accumulate-allreduce-grads-in-fp32, its default for bf16)")
    grad_bucket_view: bool = Field(
        True, description="gradients are views into the data-parallel reduction buckets (DDP's"
        " gradient_as_bucket_view=True, Megatron-LM's contiguous buffer, FSDP); False: torch DDP's default, whose"
        " buckets are a second copy of the gradients, filled before and copied back after each all-reduce")
    param_overlap: bool = Field(
        False, description="ZeRO-1/2: all-gather the updated parameters during the next step's forward, each bucket"
        " before its first layer runs (Megatron-LM's --overlap-param-gather), instead of after the optimizer step")
    grad_allreduce: bool = Field(
        False, description="ZeRO-1: all-reduce the whole gradients and keep this rank's share of the sum instead of"
        " reduce-scattering them (DeepSpeed's BF16_Optimizer, which Megatron-DeepSpeed pipelines train with: twice"
        " the gradient traffic)")
    master_grads: bool = Field(
        False, description="the optimizer step copies the gradients to fp32 main gradients first (Megatron-LM's"
        " mixed-precision optimizer); False: Adam reads them as kept (ZeRO paper)")
    loss_scale: float = Field(
        0.0, ge=0, description="loss scale for fp16: the backward starts from this instead of 1, and the step divides"
        " the gradients by it and skips itself if any overflowed (Megatron-LM's --loss-scale); the initial scale"
        " under loss_scale_window; 0: none")
    loss_scale_window: int = Field(
        0, ge=0, description="dynamic loss scaling: halve the scale when the gradients overflow, double it after"
        " this many clean steps in a row (Megatron-LM's --loss-scale-window, DeepSpeed's loss_scale_window);"
        " loss_scale is then the initial scale; 0: the scale is static")
    loss_scale_hysteresis: int = Field(
        2, ge=1, description="dynamic loss scaling: overflows tolerated before the scale halves, restored when it"
        " grows (Megatron-LM's --hysteresis, DeepSpeed's hysteresis)")
    clip_grad: float = Field(
        0.0, ge=0, description="clip the gradients to this global L2 norm before the optimizer step (Megatron-LM's"
        " --clip-grad, torchtitan's max_norm, DeepSpeed's gradient_clipping); 0: no clipping")
    rank_order: str = Field("tp-cp-dp-pp", description="mesh axes, fastest-varying first")
    stages: Optional[tuple[int, ...]] = Field(None, min_length=1, description="layers per (virtual) stage, in order")
    layout: Optional[str] = Field(
        None, min_length=1, description="Megatron-Core's --pipeline-model-parallel-layout: each virtual stage's"
        " contents, e.g. 'Et|(tt|)*30mL' (E embedding, t transformer layer, m MTP layer, L head and loss, | between"
        " the pp*vpp stages, (..)*n repeats; `simexec.specs.pipeline_layout`); exclusive with stages")

    @field_validator("recompute_modules", mode="before")
    @classmethod
    def _modules(cls, v: object) -> object:
        if isinstance(v, str):
            v = tuple(x.strip() for x in v.split("+") if x.strip())
        if isinstance(v, (list, tuple)):
            unknown = [x for x in v if x not in RECOMPUTE_MODULES]
            if unknown:
                raise ValueError(f"unknown module {unknown[0]!r}; allowed: {', '.join(RECOMPUTE_MODULES)}")
            if len(set(v)) != len(v):
                raise ValueError(f"recompute_modules {'+'.join(v)} names a module twice")
            return tuple(v)
        return v

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """The submodules selective recompute covers (`recompute_modules`, default core_attn); () unless
        recompute=selective."""
        if self.recompute != "selective":
            return ()
        return self.recompute_modules or DEFAULT_RECOMPUTE_MODULES

    @field_validator("rank_order")
    @classmethod
    def _order(cls, v: str) -> str:
        axes = v.split("-")
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"rank_order {v!r} must order exactly the axes {'-'.join(AXES)}")
        return v

    @property
    def schedule_name(self) -> str:
        return self.schedule or default_schedule(self.vpp)

    @property
    def pipeline_schedule(self) -> Schedule:
        """The schedule this plan runs, with its traits (`simexec.program.schedules.SCHEDULES`)."""
        return schedule(self.schedule_name)

    @property
    def zero3(self) -> Optional[Zero3Flavour]:
        """The ZeRO-3 flavour's policy (`simexec.specs.zero3_flavours`); None unless zero=3."""
        return self.zero3_policy(self.zero_impl) if self.zero == 3 else None

    def zero3_policy(self, impl: Optional[str]) -> Zero3Flavour:
        """Flavour `impl` (None: the default) with this plan's DeepSpeed bucket and persistence settings."""
        flavour = zero3_flavour(impl or DEFAULT_ZERO3_FLAVOUR)
        if flavour.name != "deepspeed":
            return flavour
        changes = {k: v for k, v in (("gather_bucket_params", self.zero3_gather_bucket),
                                     ("persist_below_params", self.zero3_persist_below),
                                     ("reduce_bucket_params", self.zero3_reduce_bucket)) if v is not None}
        return dataclasses.replace(flavour, **changes) if changes else flavour

    @property
    def lazy_grad_shards(self) -> bool:
        """ZeRO-3 gradient shards that exist only from their unit's first reduce-scatter of a step to
        the optimizer step (FSDP2: `.grad` made in the post-backward, freed by `zero_grad`; YaFSDP as
        simexec runs it), rather than one flat partition allocated at start and zeroed after each
        step (`deepspeed`: DeepSpeed stage 3, the system of the ZeRO paper). Gathering is the same:
        `fsdp` and `deepspeed` allocate each unit's gathered parameters on demand, `yafsdp` reuses
        two buffers."""
        return self.zero3 is not None and not self.zero3.holds_grad_shards

    def to_string(self) -> str:
        """The short form `parse_plan` reads back: only fields that differ from their defaults."""
        parts = []
        for name, field in type(self).model_fields.items():
            val = getattr(self, name)
            if val == field.default:
                continue
            if name == "stages":
                parts.append("stages=" + ",".join(str(x) for x in val))
            elif name == "recompute_modules":
                parts.append(f"{name}=" + "+".join(val))
            elif isinstance(val, bool):
                parts.append(f"{name}={int(val)}")
            elif isinstance(val, float):
                short = f"{val:g}"
                parts.append(f"{name}={short if float(short) == val else repr(val)}")
            else:
                parts.append(f"{name}={val}")
        return ",".join(parts) or "tp=1"  # all defaults (dp derived): any default key reads back the same

    def __str__(self) -> str:
        return self.to_string()


_BOOL = {"1": True, "0": False, "true": True, "false": False}


def split_pairs(text: str, where: str) -> dict[str, str]:
    """`a=1,b=x,stages=1,2,3` -> {"a": "1", "b": "x", "stages": "1,2,3"}: `stages=` (and `layout=`)
    takes every following bare item. Shared by plan strings and `search --fix`."""
    pairs: dict[str, str] = {}
    items = [p.strip() for p in text.split(",") if p.strip()]
    i = 0
    while i < len(items):
        item = items[i]
        if "=" not in item:
            raise PlanError(f"{where}: expected key=value, got {item!r}")
        key, val = (s.strip() for s in item.split("=", 1))
        if key in pairs:
            raise PlanError(f"{where}: {key} given twice")
        if key in ("stages", "layout"):  # a layout's commas are cosmetic (Megatron drops them)
            vals = [val]
            while i + 1 < len(items) and "=" not in items[i + 1]:
                i += 1
                vals.append(items[i])
            val = ",".join(vals)
        pairs[key] = val
        i += 1
    return pairs


def parse_plan(text: str) -> Plan:
    """`dp=2,tp=4,pp=2,zero=1,mbs=1,gbs=64`; `stages=` takes every following bare integer."""
    where = f"plan {text!r}"
    fields: dict[str, object] = {}
    for key, val in split_pairs(text, where).items():
        if key == "stages":
            fields[key] = tuple(_int(key, v, text) for v in val.split(","))
        elif key not in Plan.model_fields:
            raise PlanError(f"{where}: unknown key {key!r}; keys: {', '.join(Plan.model_fields)}")
        elif Plan.model_fields[key].annotation is bool:
            if val.lower() not in _BOOL:
                raise PlanError(f"{where}: {key} must be 1/0/true/false, got {val!r}")
            fields[key] = _BOOL[val.lower()]
        else:
            fields[key] = val
    return validate_fields(fields, where)


def _int(key: str, val: str, text: str) -> int:
    try:
        return int(val)
    except ValueError:
        raise PlanError(f"plan {text!r}: {key} takes integers, got {val!r}") from None


def validate_fields(fields: dict, where: str) -> Plan:
    """A `Plan` of loose fields (lists for stages, strings for booleans), or a `PlanError` naming `where`."""
    if isinstance(fields.get("stages"), list):
        fields["stages"] = tuple(fields["stages"])
    for key in (k for k, f in Plan.model_fields.items() if f.annotation is bool):
        if isinstance(fields.get(key), str):
            fields[key] = _BOOL.get(fields[key].lower(), fields[key])
    try:
        return Plan.model_validate(fields)
    except ValidationError as exc:
        raise PlanError(f"{where}: {one_line(exc)}") from None


def load_plan(text_or_path: str) -> Plan:
    """A plan string, or a YAML/JSON file of plan fields."""
    path = Path(text_or_path)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        data = read_mapping(path, "plan")
        return validate_fields(data, f"plan file {path}")
    return parse_plan(text_or_path)


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan checked against its model and cluster, with every derived number."""

    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    seq_len: int
    dp: int
    micro_batches: int
    stage_layers: tuple[tuple[int, ...], ...]  # layer indices of each virtual stage
    mesh: Mesh
    stack: StackSpec = field(default_factory=lambda: get_stack(None))  # the framework that runs it

    @property
    def world(self) -> int:
        return self.mesh.world

    @property
    def virtual_stages(self) -> int:
        return self.plan.pp * self.plan.vpp

    def stage(self, pp_rank: int, chunk: int) -> int:
        """The virtual stage of a pipeline rank's chunk (`simexec.program.schedules.stage_of`)."""
        return self.plan.pipeline_schedule.stage_of(self.plan.pp, pp_rank, chunk)

    def place(self, stage: int) -> tuple[int, int]:
        """(pipeline rank, chunk) of a virtual stage."""
        return self.plan.pipeline_schedule.place_of(self.plan.pp, stage)

    def stages_of_pp_rank(self, pp_rank: int) -> tuple[int, ...]:
        """Virtual stage indices held by pipeline rank `pp_rank`, by chunk (Megatron's interleaved
        assignment, or a V)."""
        return tuple(self.stage(pp_rank, c) for c in range(self.plan.vpp))

    @property
    def head_pp_rank(self) -> int:
        """The pipeline rank of the last virtual stage (the head and the loss): the last rank, or the
        first under a V-shaped schedule."""
        return self.place(self.virtual_stages - 1)[0]

    @property
    def tied_copy(self) -> bool:
        """Tied embeddings, or MTP layers (which embed the shifted tokens: DeepSeek-V3 §2.2), with the
        head on another pipeline rank than the embedding: that rank keeps a copy of the embedding,
        summed with the first stage's gradient (Megatron-LM's shared embedding group)."""
        return (self.model.tied_embeddings or self.model.mtp_layers > 0) and self.head_pp_rank != 0

    def layers_of_pp_rank(self, pp_rank: int) -> tuple[int, ...]:
        return tuple(l for s in self.stages_of_pp_rank(pp_rank) for l in self.stage_layers[s])

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.plan.dtype]

    @property
    def param_gather_bytes(self) -> int:
        """Bytes per parameter a ZeRO all-gather moves and its gathered copy holds: FP8 under
        `fp8_param_gather`, else the parameters' own."""
        return 1 if self.plan.fp8_param_gather else self.dtype_bytes

    @property
    def grad_bytes(self) -> int:
        """Bytes of one gradient element as kept and reduced: fp32 for fp32 training or `grad_fp32`,
        else 2 (fp8 training keeps bf16 gradients)."""
        return 4 if self.plan.dtype == "fp32" or self.plan.grad_fp32 else 2

    @property
    def master_grad_bytes(self) -> int:
        """Bytes per parameter of the fp32 main-gradient copy the optimizer step makes (Megatron-LM's
        `main_param.grad = main_grad.float()`): 4 with `master_grads` when the gradients are not
        already fp32 and the step runs on the device, else 0 (the copy would be the buffer itself)."""
        p = self.plan
        return 4 if p.master_grads and self.grad_bytes < 4 and p.offload == "none" else 0

    @property
    def bucket_copy_bytes(self) -> int:
        """Bytes per parameter of torch DDP's own bucket buffers under `grad_bucket_view=0`: allocated
        when the model is wrapped and kept for the whole run beside the `.grad` tensors (the saving
        torch documents for gradient_as_bucket_view); 0 where no gradient is all-reduced over dp."""
        return self.grad_bytes if not self.plan.grad_bucket_view and self.zero_group_size > 1 else 0

    @property
    def pipeline_slices(self) -> int:
        """Pieces a pipeline message is cut into over tp (Megatron-LM's scatter/gather, SC'21 §4.1).

        Without sp every tp rank holds the whole activation (and, after the f/g all-reduces, the
        whole input gradient): each sends 1/tp of it and the receiving stage all-gathers the pieces
        over tp, so the link between stages carries one copy, not tp. With sp the activation is
        already split over tp, so each rank sends what it has."""
        p = self.plan
        if p.pp == 1 or p.tp == 1 or p.sp or self.model.hidden % p.tp:
            return 1
        return p.tp

    @property
    def tokens_per_step(self) -> int:
        return (self.plan.gbs or 0) * self.seq_len

    @property
    def folded(self) -> bool:
        """The MoE layers run on their own mesh (etp, ep, edp) over a stage's tp*cp*dp ranks (`Plan.etp`)."""
        return self.plan.etp is not None

    @property
    def expert_tp(self) -> int:
        """The ranks each routed expert's weights are split over: etp when folded, else tp."""
        return self.plan.etp if self.plan.etp is not None else self.plan.tp

    @property
    def expert_dp(self) -> int:
        """The ranks that hold the same experts (expert data parallel): tp*cp*dp / (etp*ep) when folded,
        else dp*cp / ep."""
        p = self.plan
        if p.etp is not None:
            return p.tp * p.cp * self.dp // (p.etp * p.ep)
        return self.dp * p.cp // p.ep

    @property
    def zero_group_size(self) -> int:
        """Ranks that shard model states: dp (or dp_shard under HSDP) times cp, since context-parallel
        ranks hold the same parameters and reduce their gradients together (Megatron's dp-cp group)."""
        return (self.plan.dp_shard or self.dp) * self.plan.cp

    def params_on_pp_rank(self, pp_rank: int) -> dict[str, float]:
        """Parameters held by one rank of pipeline rank `pp_rank` before ZeRO sharding.

        Dense weights are split by tp; expert weights by tp and ep. Norms, MLA's latent projections
        and a MoE router are replicated.
        """
        m, p = self.model, self.plan
        dense = expert = 0.0
        blocks = list(self.layers_of_pp_rank(pp_rank))
        if pp_rank == self.head_pp_rank and m.mtp_layers:  # the MTP depths sit beside the head
            blocks += [m.mtp_block(d) for d in range(m.mtp_layers)]
            dense += m.mtp_layers * (2 * m.hidden * m.hidden / p.tp + 3 * m.pre_norm_params())
        for layer in blocks:
            if m.is_moe_layer(layer):
                dense += (m.attention_params() - m.latent_params()) / p.tp + m.tp_replicated_params_per_layer()
                dense += m.router_params()
                shared = m.moe_mlp_params() - m.router_params() - m.moe.experts * m.expert_params()
                dense += shared / p.tp
                expert += m.moe.experts * m.expert_params() / (self.expert_tp * p.ep)
            else:
                replicated = m.tp_replicated_params_per_layer()
                dense += (m.layer_params(layer) - replicated) / p.tp + replicated
        if pp_rank == 0:
            dense += m.embedding_params() / p.tp
        if pp_rank == self.head_pp_rank:
            dense += m.lm_head_params() / p.tp + m.final_norm_params()
            if self.tied_copy:
                dense += m.embedding_params() / p.tp  # a copy of the tied embedding on the last stage
        return {"dense": dense, "expert": expert, "total": dense + expert}

    def model_state_bytes(self, pp_rank: int) -> dict[str, float]:
        """Mixed-precision Adam model states per rank (ZeRO paper: 2+2+12 bytes per parameter).

        `grad_fp32` keeps the gradients in fp32 (2+4+12 = 18, Megatron-LM's bf16 default);
        `grad_bucket_view=0` adds torch DDP's bucket copy of them to `grads`. The fp32
        copy of `master_grads` is not here: it lives only through the optimizer step (the lowering
        allocates it there, `master_grad_bytes`). Expert parameters are sharded by ZeRO over dp/ep
        ranks, as Megatron's expert data parallel. Under ZeRO-3 a stack whose shards are the fp32 master
        (`StackSpec.zero3_shards_are_master`: FSDP2 in torchtitan) keeps no low-precision shard: 0+4+12.
        """
        p = self.plan
        params = self.params_on_pp_rank(pp_rank)
        n_dense, n_expert = params["dense"], params["expert"]
        shard_dense = self.zero_group_size
        shard_expert = self.expert_dp if p.etp is not None else max(1, self.zero_group_size // p.ep)
        w = self.dtype_bytes if p.dtype != "fp8" else 2  # fp8 training keeps bf16 weights
        k = 12 if p.dtype != "fp32" else 8  # fp32 training: Adam m, v only (no master copy)
        grad_b = self.grad_bytes
        bucket_b = self.bucket_copy_bytes

        # the shards themselves the optimizer's fp32 master (`StackSpec.zero3_shards_are_master`): no copy in w
        no_copy = p.zero >= 3 and k == 12 and self.stack is not None and self.stack.zero3_shards_are_master

        def split(n: float, shard: int) -> tuple[float, float, float]:
            wt = 0.0 if no_copy else n * w / (shard if p.zero >= 3 else 1)
            gr = n * (grad_b + (bucket_b if shard > 1 else 0)) / (shard if p.zero >= 2 else 1)
            op = n * k / (shard if p.zero >= 1 else 1)
            return wt, gr, op

        a = split(n_dense, shard_dense)
        b = split(n_expert, shard_expert)
        out = {"params": a[0] + b[0], "grads": a[1] + b[1], "optimizer": a[2] + b[2]}
        if p.offload != "none":
            out["optimizer"] = 0.0
        if p.offload == "optimizer+params":
            out["params"] = 0.0
        return out


def resolve(model: ModelSpec, cluster: ClusterSpec, plan: Plan, seq_len: Optional[int] = None,
            stack: Optional[StackSpec] = None) -> ResolvedPlan:
    """Check every rule; return the plan with derived numbers, or raise PlanError naming the rule.
    `stack`: the framework that runs it (None: the default stack)."""
    p = plan
    seq = model.seq_len if seq_len is None else seq_len
    if seq <= 0:
        raise PlanError(f"sequence length must be positive, got {seq}")
    if model.learned_pos and model.max_positions is not None and seq > model.max_positions:
        raise PlanError(
            f"sequence length {seq} exceeds the learned position table of {model.name} (max_positions {model.max_positions})"
        )
    inner = p.tp * p.cp * p.pp
    if cluster.sized_to_plan:
        dp = p.dp or 1
        cluster = cluster.with_world_size(dp * inner)
    world = cluster.world_size
    if p.dp is None:
        if world % inner:
            raise PlanError(f"world size {world} is not divisible by tp*cp*pp = {p.tp}*{p.cp}*{p.pp} = {inner}")
        dp = world // inner
    else:
        dp = p.dp
        if dp * inner != world:
            raise PlanError(
                f"world size {world} != dp*tp*cp*pp = {dp}*{p.tp}*{p.cp}*{p.pp} = {dp * inner}"
                f" (cluster {cluster.name}: {cluster.nodes} node(s) x {cluster.node.gpus_per_node})"
            )
    gbs = p.gbs if p.gbs is not None else p.mbs * dp * p.pp
    check_plan(model, cluster, p, dp, gbs, seq)
    micro = gbs // (p.mbs * dp)
    stage_layers = _stage_layers(model, p)
    smallest = min(len(s) for s in stage_layers if s) if any(stage_layers) else 0
    if p.recompute_layers is not None and p.recompute_layers > smallest:
        raise PlanError(
            f"recompute_layers={p.recompute_layers} exceeds the {smallest} layers of the smallest"
            f" {'virtual ' if p.vpp > 1 else ''}pipeline stage (it counts layers per stage, as Megatron's"
            " recompute-num-layers)"
        )
    plan = p.model_copy(update={"dp": dp, "gbs": gbs})
    mesh = Mesh(sizes={"tp": p.tp, "cp": p.cp, "dp": dp, "pp": p.pp}, order=tuple(p.rank_order.split("-")))
    return ResolvedPlan(model, cluster, plan, seq, dp, micro, stage_layers, mesh, stack or get_stack(None))


def _stage_layers(model: ModelSpec, p: Plan) -> tuple[tuple[int, ...], ...]:
    n = p.pp * p.vpp
    if p.layout is not None:
        return tuple(s.layers for s in resolve_layout(p.layout, p.pp, p.vpp, model.layers, model.mtp_layers))
    if p.stages is not None:
        counts = list(p.stages)
    else:
        counts = [model.layers // n] * n
    out, start = [], 0
    for c in counts:
        out.append(tuple(range(start, start + c)))
        start += c
    return tuple(out)


def balanced_stages(layers: int, n_stages: int) -> Optional[tuple[int, ...]]:
    """Layers per (virtual) stage when the embedding and the output layer each count as one layer:
    the first stage gives a layer to the embedding, the last to the head and loss, and the units left
    over after an even split go to the middle stages, the last first (in 1F1B an earlier stage holds
    more micro-batches' activations). This is the split of DeepSpeed's
    `partition_method='type:transformer|embedding'` (BLOOM-176B: 70 layers on 12 stages, 5,6,...,6,5),
    of Megatron-LM's `--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`
    and of torchtitan's input and output weights of 1; Llama 3 405B drops a layer from both end
    stages for the same reason. None when a stage would hold no layer."""
    counts = _embedding_and_loss_split(layers, n_stages)
    return counts if counts and min(counts) >= 1 else None


def balanced_layout(layers: int, n_stages: int) -> Optional[str]:
    """The same split as `balanced_stages` in Megatron's layout notation, where it leaves an end stage with the
    embedding or the loss alone (Llama 3.1 405B's 126 layers on 128 virtual stages: `E|t|...|t|L`, which
    Megatron-LM builds from the same two flags); None where a middle stage would hold nothing."""
    counts = _embedding_and_loss_split(layers, n_stages)
    if not counts or min(counts[1:-1], default=1) < 1 or min(counts) < 0:
        return None
    return "|".join(("E" if i == 0 else "") + "t" * c + ("L" if i == n_stages - 1 else "")
                    for i, c in enumerate(counts))


def _embedding_and_loss_split(layers: int, n_stages: int) -> Optional[tuple[int, ...]]:
    if n_stages < 2:
        return None
    base, extra = divmod(layers + 2, n_stages)
    units = [base] * n_stages
    order = list(range(n_stages - 2, 0, -1)) + [n_stages - 1, 0]
    for i in order[:extra]:
        units[i] += 1
    return tuple(u - (i == 0) - (i == n_stages - 1) for i, u in enumerate(units))
