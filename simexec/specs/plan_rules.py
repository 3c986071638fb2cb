"""The rules a parallel plan must keep against a model and a cluster (`simexec.specs.plan.resolve` runs
them): one `if` each, each message naming the rule and the values."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Optional

from simexec.errors import PlanError
from simexec.program.schedules import SCHEDULES, Schedule
from simexec.specs.cluster import ClusterSpec
from simexec.specs.model import ModelSpec
from simexec.specs.pipeline_layout import resolve_layout

if TYPE_CHECKING:
    from simexec.specs.plan import Plan


def heads_unsplit(model: ModelSpec, tp: int, cp: int) -> Optional[str]:
    """Why cp_impl=a2a cannot split each tp rank's query and K/V heads over cp, or None where it can."""
    for kind, n in (("attention", model.heads), ("KV", model.kv_head_count)):
        if (n // tp) % cp:
            return (f"{kind} heads per tp rank {n}/{tp} = {n // tp} not divisible by cp={cp} (cp_impl=a2a splits "
                    "them over cp); use cp_impl=allgather or ring")
    return None


def check_plan(model: ModelSpec, cluster: ClusterSpec, p: Plan, dp: int, gbs: int, seq: int) -> None:
    """The rules of parallel training, one `if` each."""
    def fail(msg: str) -> None:
        raise PlanError(msg)

    if model.heads % p.tp:
        fail(f"attention heads {model.heads} not divisible by tp={p.tp}")
    if model.kv_heads % p.tp:
        fail(f"KV heads {model.kv_heads} not divisible by tp={p.tp}")
    if model.ffn % p.tp:
        fail(f"FFN size {model.ffn} not divisible by tp={p.tp}")
    if p.sp and p.tp == 1:
        fail("sp=1 needs tp > 1 (sequence parallel splits along the tensor-parallel group)")
    if p.sp and seq % p.tp:
        fail(f"sequence length {seq} not divisible by tp={p.tp} (needed by sp)")
    if p.cp > 1 and seq % (2 * p.cp):
        fail(f"sequence length {seq} not divisible by 2*cp = {2 * p.cp} (causal load balancing)")
    if (p.cp > 1 and p.cp_impl == "ring" and model.sliding_window is not None
            and any(model.attention_window(i, seq) for i in range(model.layers))):
        fail(f"cp_impl=ring does not run sliding-window attention (window {model.sliding_window} < sequence "
             f"{seq}); use cp_impl=allgather")
    if p.cp > 1 and p.cp_impl == "a2a" and (why := heads_unsplit(model, p.tp, p.cp)):
        fail(why)
    if p.sp and p.cp > 1 and (seq // p.cp) % p.tp:
        fail(f"sequence chunk {seq // p.cp} per cp rank not divisible by tp={p.tp} (needed by sp)")
    n_stages = p.pp * p.vpp
    if p.layout is not None:
        if p.stages is not None:
            fail("give layout or stages, not both")
        resolve_layout(p.layout, p.pp, p.vpp, model.layers, model.mtp_layers)
    elif p.stages is not None:
        if len(p.stages) != n_stages:
            fail(f"stages has {len(p.stages)} entries, expected pp*vpp = {p.pp}*{p.vpp} = {n_stages}")
        if any(s <= 0 for s in p.stages):
            fail(f"stages {','.join(map(str, p.stages))}: every stage needs at least one layer")
        if sum(p.stages) != model.layers:
            fail(f"stages sum to {sum(p.stages)}, but the model has {model.layers} layers")
    elif model.layers % n_stages:
        fail(f"layers {model.layers} not divisible by pp*vpp = {p.pp}*{p.vpp} = {n_stages} (give stages=... for an uneven split)")
    if gbs % (p.mbs * dp):
        fail(f"global batch {gbs} not divisible by mbs*dp = {p.mbs}*{dp} = {p.mbs * dp}")
    micro = gbs // (p.mbs * dp)
    _check_schedule(p, p.pipeline_schedule, micro, f"gbs/(mbs*dp) = {gbs}/({p.mbs}*{dp})", fail)
    sched = p.schedule_name
    if p.tp_overlap:
        if p.tp < 2:
            fail(f"tp_overlap=1 needs tp > 1, got tp={p.tp}")
        if p.pipeline_schedule.splits_backward:
            fail(f"tp_overlap=1 does not run with schedule={sched}, whose weight-gradient GEMMs wait for their own"
                 " W actions; use tp_overlap=0")
    if p.fp8_param_gather and (p.dtype != "fp8" or p.zero == 0):
        fail(f"fp8_param_gather=1 needs dtype=fp8 and ZeRO (zero >= 1), got dtype={p.dtype}, zero={p.zero}")
    if p.tp_async and not (p.sp and p.tp > 1):
        fail(f"tp_async=1 needs sequence parallelism over tp > 1 (sp=1), got tp={p.tp}, sp={int(p.sp)}")
    if p.pipeline_schedule.splits_backward:
        if p.pp < 2:
            fail(f"schedule={sched} needs pp >= 2")
        if p.zero == 3:
            fail(f"schedule={sched} does not run with zero=3 (the deferred weight gradients would hold every"
                 " gathered unit until they run); use zero <= 2")
        if p.sp:
            fail(f"schedule={sched} does not run with sp=1 (the deferred weight gradients of the column-parallel"
                 " GEMMs would need their inputs gathered over tp a second time); use sp=0")
    if model.moe is None and p.ep > 1:
        fail(f"ep={p.ep} on dense model {model.name} (no experts to distribute)")
    if model.moe is None and p.etp is not None:
        fail(f"etp={p.etp} on dense model {model.name} (no experts to split)")
    if model.moe is None and (p.moe_dispatcher != "alltoall" or p.moe_a2a_overlap or p.moe_router_skew != 1.0):
        fail(f"moe_dispatcher, moe_a2a_overlap and moe_router_skew need an MoE model ({model.name} is dense)")
    if p.moe_a2a_overlap:
        _check_moe_a2a_overlap(p, fail)
    etp = p.tp if p.etp is None else p.etp
    if model.moe is not None:
        if model.moe.experts % p.ep:
            fail(f"experts {model.moe.experts} not divisible by ep={p.ep}")
        if model.moe.expert_ffn % etp:
            fail(f"expert FFN size {model.moe.expert_ffn} not divisible by {'tp' if p.etp is None else 'etp'}={etp}")
    if p.etp is None and dp % p.ep:
        fail(f"ep={p.ep} does not divide dp={dp} (experts are spread over data-parallel ranks; etp=... folds them"
             " over tp*cp*dp)")
    if p.etp is not None:
        stage = p.tp * p.cp * dp
        if stage % (p.etp * p.ep):
            fail(f"etp*ep={p.etp * p.ep} must divide tp*cp*dp={stage} (the expert mesh folds a pipeline stage's ranks)")
        if p.tp > 1 and not p.sp:
            fail(f"etp={p.etp} with tp={p.tp} needs sp=1 (Megatron-Core's MoE layer refuses tensor parallelism"
                 " without sequence parallelism in training: each tp rank dispatches its sequence shard)")
        if p.dp_shard is not None:
            fail(f"dp_shard={p.dp_shard} (HSDP) does not run with etp={p.etp} (expert parameters shard over the"
                 " expert data-parallel group)")
        if p.pp > 1 and p.rank_order.split("-")[-1] != "pp":
            fail(f"etp={p.etp} with pp={p.pp} needs pp as the slowest axis of rank_order, got {p.rank_order}"
                 " (the expert mesh folds each pipeline stage's ranks, as Megatron-Core asserts)")
    if p.zero_impl is not None and p.zero != 3:
        fail(f"zero_impl={p.zero_impl} needs zero=3, got zero={p.zero}")
    for knob in ("zero3_gather_bucket", "zero3_persist_below", "zero3_reduce_bucket"):
        if getattr(p, knob) is not None and (p.zero != 3 or p.zero_impl != "deepspeed"):
            fail(f"{knob}={getattr(p, knob):g} is a DeepSpeed ZeRO-3 setting: it needs zero=3,zero_impl=deepspeed")
    if not p.reshard_after_forward and (p.zero != 3 or p.zero3.name != "fsdp"):
        fail("reshard_after_forward=0 is FSDP2's setting: it needs zero=3 with zero_impl=fsdp")
    if p.param_overlap and p.zero not in (1, 2):
        fail(f"param_overlap=1 needs zero=1 or 2, got zero={p.zero}")
    if p.grad_allreduce and p.zero != 1:
        fail(f"grad_allreduce=1 needs zero=1, got zero={p.zero}")
    if p.dp_shard is not None:
        if p.zero == 0:
            fail(f"dp_shard={p.dp_shard} (HSDP) needs zero >= 1")
        if dp % p.dp_shard:
            fail(f"dp_shard={p.dp_shard} does not divide dp={dp}")
        if p.ep > 1 and p.dp_shard % p.ep:
            fail(f"dp_shard={p.dp_shard} not divisible by ep={p.ep}")
    if not p.grad_bucket_view and p.zero != 0:
        fail(f"grad_bucket_view=0 (torch DDP's separate buckets) needs zero=0, got zero={p.zero}")
    if p.offload == "optimizer+params" and p.zero != 3:
        fail(f"offload=optimizer+params needs zero=3, got zero={p.zero}")
    if p.loss_scale_window and not p.loss_scale:
        fail(f"loss_scale_window={p.loss_scale_window} (dynamic loss scaling) needs an initial loss_scale > 0,"
             " e.g. loss_scale=65536")
    if p.loss_scale_hysteresis != type(p).model_fields["loss_scale_hysteresis"].default and not p.loss_scale_window:
        fail(f"loss_scale_hysteresis={p.loss_scale_hysteresis} needs dynamic loss scaling (loss_scale_window > 0)")
    if p.recompute_layers is not None and p.recompute == "none":
        fail(f"recompute_layers={p.recompute_layers} needs recompute=selective, full or op")
    _check_recompute_modules(model, p, fail)
    if not cluster.device.supports(p.dtype):
        fail(f"dtype={p.dtype} not supported by {cluster.device.name} (has {', '.join(cluster.device.peak_flops)})")
    if p.pp > 1 and n_stages > model.layers and p.layout is None:
        fail(f"pp*vpp = {n_stages} exceeds the model's {model.layers} layers")
    if p.offload_layers:
        _check_offload_layers(model, p, fail)


def _check_offload_layers(model: ModelSpec, p: Plan, fail: Callable[[str], None]) -> None:
    """Megatron-Core's rules for activation CPU offloading (TransformerConfig.__post_init__,
    NVIDIA/Megatron-LM@d98e8a64 megatron/core/transformer/transformer_config.py: num_layers below the
    model's, no pipeline parallelism, no recomputation; Transformer Engine's get_cpu_offload_context,
    NVIDIA/TransformerEngine@d0067d0d transformer_engine/pytorch/cpu_offload.py, refuses offloading every
    layer: the last one's is never copied). simexec's own: no schedule that splits the backward, which
    Megatron-Core does not run (the lowering reloads a layer for its one backward)."""
    n = p.offload_layers
    if n >= model.layers:
        fail(f"offload_layers={n} must be below the model's {model.layers} layers (Megatron-Core: CPU offloading "
             "can be done only for layers less than num_layers)")
    if p.pp > 1:
        fail(f"offload_layers={n} needs pp=1, got pp={p.pp} (Megatron-Core has no pipeline parallelism with CPU "
             "offloading)")
    if p.vpp > 1:
        fail(f"offload_layers={n} needs vpp=1, got vpp={p.vpp} (one model chunk: Megatron-Core's offload context "
             "counts the whole model's layers)")
    if p.recompute != "none":
        fail(f"offload_layers={n} needs recompute=none, got recompute={p.recompute} (Megatron-Core: CPU offloading "
             "does not work when activation recomputation is enabled)")
    if p.pipeline_schedule.splits_backward:
        fail(f"offload_layers={n} does not run with schedule={p.schedule_name} (a split backward)")


def _check_recompute_modules(model: ModelSpec, p: Plan, fail: Callable[[str], None]) -> None:
    """Megatron-Core's checks of recompute_modules (TransformerConfig.__post_init__, NVIDIA/Megatron-LM@d98e8a6
    megatron/core/transformer/transformer_config.py:1940-1995), and modules the model has no part for."""
    mods = p.recompute_modules
    if mods is None:
        return
    from simexec.specs.plan import RECOMPUTE_MODULES
    allowed = ", ".join(RECOMPUTE_MODULES)
    if p.recompute != "selective":
        fail(f"recompute_modules={'+'.join(mods)} needs recompute=selective, got recompute={p.recompute}")
    for mod in mods:
        if mod == "mla_up_proj" and not model.is_mla:
            fail(f"recompute_modules: {mod} needs multi-latent attention; {model.name} has none (allowed: {allowed})")
        if mod in ("moe", "moe_act", "shared_experts") and model.moe is None:
            fail(f"recompute_modules: {mod} needs an MoE model; {model.name} is dense (allowed: {allowed})")
        if mod == "moe" and p.moe_a2a_overlap:  # transformer_config.py:3030-3032
            fail("recompute_modules: moe cannot run with moe_a2a_overlap=1 (Megatron-Core disables moe recompute"
                 f" under --overlap-moe-expert-parallel-comm; allowed: {allowed})")
        if mod == "shared_experts" and model.moe is not None and not model.moe.shared_experts:
            fail(f"recompute_modules: {mod} needs shared experts; {model.name}'s MoE has none (allowed: {allowed})")


def _check_moe_a2a_overlap(p: Plan, fail: Callable[[str], None]) -> None:
    """Megatron-Core's rules for --overlap-moe-expert-parallel-comm (TransformerConfig.__post_init__,
    megatron/core/transformer/transformer_config.py): expert parallelism, the alltoall or flex dispatcher,
    no full recompute; under a pipeline the interleaved schedule, whose steady state pairs each forward
    with another virtual micro-batch's backward (combined_1f1b.py `combined_1f1b_schedule_for_interleaved_
    pipelining`): `simexec.program.moe_overlap`."""
    if p.ep == 1:
        fail("moe_a2a_overlap=1 needs ep > 1 (it hides the expert-parallel all-to-alls)")
    if p.moe_dispatcher == "allgather":
        fail("moe_a2a_overlap=1 needs moe_dispatcher=alltoall or deepep (Megatron-Core's alltoall/flex), got allgather")
    if p.pipeline_schedule.splits_backward:
        fail(f"moe_a2a_overlap=1 does not run with schedule={p.pipeline_schedule.name} (its pairs are a forward and"
             " a whole backward)")
    if p.recompute == "full":
        fail("moe_a2a_overlap=1 does not run with recompute=full (Megatron-Core refuses full recomputation with it)")
    if p.pp > 1 and p.vpp == 1:
        fail(f"moe_a2a_overlap=1 with pp={p.pp} needs vpp > 1 (Megatron-Core runs it in the interleaved schedule"
             " only: TransformerConfig asserts virtual_pipeline_model_parallel_size, which vpp=1 leaves unset)")
    if p.pp > 1 and not p.p2p_overlap:
        fail(f"moe_a2a_overlap=1 with pp={p.pp} needs p2p_overlap=1 (a pair's forward and backward exchange with"
             " their neighbours on their own, as Megatron-Core's combined 1F1B posts them)")


def _check_schedule(p: Plan, sched: Schedule, micro: int, micro_from: str, fail: Callable[[str], None]) -> None:
    """The rules of a plan's pipeline schedule: chunks per rank for its placement, micro-batches its
    order needs, and whether blocking exchanges can run it. `micro_from` says where `micro` came from."""

    def blocking_exchanges() -> None:
        if sched.blocking_exchanges_deadlock and not p.p2p_overlap:
            fail(f"schedule={sched.name} needs p2p_overlap=1 ({sched.blocking_exchanges_deadlock})")

    if p.vpp > 1 and not sched.multi_chunk:
        fail(f"vpp={p.vpp} needs schedule={_either(s.name for s in SCHEDULES.values() if s.multi_chunk)},"
             f" got {sched.name}")
    if sched.v_shaped:
        if p.vpp != 2:
            fail(f"schedule={sched.name} needs vpp=2 (two chunks per rank in a V), got vpp={p.vpp}")
        blocking_exchanges()
    if micro < sched.min_micro_batches_per_pp * p.pp:
        fail(f"{sched.name} needs at least {sched.min_micro_batches_per_pp}*pp ="
             f" {sched.min_micro_batches_per_pp * p.pp} micro-batches, got {micro} ({micro_from})")
    if p.dualpipe_overlap and not sched.overlapped_pairs:
        fail(f"dualpipe_overlap=1 needs schedule={_either(s.name for s in SCHEDULES.values() if s.overlapped_pairs)},"
             f" got {sched.name}")
    if sched.interleaved:
        if p.vpp < 2:
            fail(f"schedule={sched.name} needs vpp >= 2")
        if p.pp < 2:
            fail(f"schedule={sched.name} needs pp >= 2")
        if micro < p.pp:
            fail(f"{sched.name} needs at least pp={p.pp} micro-batches, got {micro} ({micro_from})")
    if sched.micro_batches_divisible_by_pp and micro % p.pp:
        fail(f"{sched.name} needs micro-batches ({micro}) divisible by pp={p.pp}")
    if sched.interleaved:
        blocking_exchanges()


def _either(names: Iterable[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    names = list(names)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
