"""The space of plans `simexec search` walks: every plan for one model, cluster and global batch.

The space is the product of the plan's knobs, each over a short list of sensible values; `resolve`
then drops the combinations that break a rule (heads not divisible by tp, micro-batches not divisible
by pp under interleaving, ...). What "sensible" means, knob by knob:

=================  ============================================================================
knob               values tried
=================  ============================================================================
tp                 powers of two up to the GPUs of one node (TP all-reduces every layer: it stays
                   on NVLink, as Megatron-LM and every published large run keep it)
sp                 off, on (tp > 1 only)
cp                 powers of two, keeping at least 1,024 tokens per rank (shorter chunks starve
                   the attention kernel), at most 32
cp_impl            allgather, ring (cp > 1 only); a2a where each tp rank's heads split over cp and
                   it moves fewer bytes per layer than the all-gather, or holds less (grouped K/V
                   heads make the all-gather's K/V small: Llama 3 70B needs cp >= 6 for either)
pp                 every divisor of world/(tp*cp) up to the layers
vpp                1, and each divisor v of layers/pp with 2 <= v <= 8 (interleaved 1F1B); 1
                   alone when pp does not divide the layers
stages             the even split when pp*vpp divides the layers, and the balanced split
                   (`simexec.specs.plan.balanced_stages`: the embedding and the head each count as a
                   layer, as DeepSpeed, Megatron-LM and torchtitan can split) when it differs:
                   without it a pp that does not divide the layers (BLOOM-176B: 70 layers, pp 12)
                   has no plan, and with it the end stages stop being the pipeline's slowest
schedule           pp = 1: none; vpp = 1: 1f1b, gpipe, zb-h1; vpp > 1: interleaved-1f1b, interleaved-zb;
                   vpp = 2: zb-v and dualpipev too (two chunks per rank in a V)
dualpipe_overlap   dualpipev only: off (torch's runtime: a pair's passes one after the other), on
                   (DeepSeek's: merged kernel by kernel, one's communication under the other's compute)
tp_overlap         tp > 1 and a schedule that does not split the backward: off (torch's DTensor,
                   torchtitan), on (Megatron-LM: a column-parallel GEMM's input-gradient collective
                   under its weight-gradient GEMM)
dp                 what is left: world / (tp*cp*pp)
ep, etp            MoE only: ep powers of two dividing the experts and dp, experts split over tp
                   (etp unset); and parallel folding, etp 1 or tp (tp > 1 with sp only, as Megatron-
                   Core's MoE layer), ep dividing the experts with etp*ep dividing tp*cp*dp, where
                   the groups differ from the unfolded plan's
moe_dispatcher     MoE with ep > 1: alltoall, allgather, and deepep where the ep group leaves its
                   NVLink domain (inside one it is the all-to-all)
moe_a2a_overlap    off, and on where Megatron-Core runs it: an all-to-all dispatcher, no full
                   recompute, pp = 1 or an interleaved pipeline (its combined 1F1B)
zero               0 (DDP), 1, 2, 3 (FSDP), 3 (YaFSDP); stages above 0 only when dp > 1 (with one
                   data-parallel rank they shard over nobody and equal zero=0)
dp_shard           ZeRO-3 only: unset, or one node's worth of the dp group (HSDP: shard inside a
                   node, replicate across), when that is a proper divisor of dp
offload            none; optimizer (zero >= 1, ZeRO-Offload builds on ZeRO); optimizer+params
                   (zero = 3)
mbs                1, 2, 4, 8, 16 (dividing gbs/dp; Megatron-LM ran its smaller Table 1 models at 16)
recompute          none, selective, full (op, torchtitan's per-operator policy, where the stack allows it)
recompute_layers   all layers, or half of the layers of a virtual stage (recompute only as much
                   as memory needs, as YaFSDP advises; the lowering counts them per stage)
recompute_modules  selective only: the default (core_attn) and, over all layers, one heavier set
                   (`heavier_recompute_modules`), as Megatron-Bridge's recipes pick: mla_up_proj in
                   place of core_attn on MLA models, + mlp for dense layers, + layernorm+moe_act for
                   MoE layers: between the default and full recompute in memory and time, and one
                   set only (every subset would multiply the structures)
offload_layers     0, and half the layers where Megatron-Core offloads activations (pp = 1, vpp = 1,
                   no recompute, a whole backward): Megatron-Bridge's Llama 3 70B recipe offloads 40
                   of 80; the copies run under the compute, so it trades host-link time for the
                   memory that recompute would buy with FLOPs
=================  ============================================================================

Kept at the plan's defaults (they change the arithmetic, not just the split): dtype (bf16),
flash_attention, bucket_mb, rank_order; and what describes the training software rather than the
split, which could only cost time or memory: grad_overlap (reducing the gradients after the backward
is never faster than overlapping them with it), p2p_overlap (nor is waiting for pipeline sends),
grad_fp32 and master_grads (Megatron-LM's gradient layout: more bytes per parameter, more gradient
traffic), grad_allreduce (DeepSpeed's bf16 ZeRO-1: twice the gradient traffic); and param_overlap
(Megatron-LM's parameter all-gathers in the next forward), which, like grad_overlap, stays as the plan
has it unless `fix` sets it. `fix` pins any field of `Plan` to one value, inside or
outside these lists (tp=16 across nodes, mbs=3, stages=..., dtype=fp8, ...), and leaves an enumerated knob
but gbs and stages a choice of its own values instead (`AnyOf`: `tp=4|8`, `zero=0|1`, `recompute_layers=none|8`,
`offload_layers=0|16`, `recompute_modules=none|core_attn+mlp`).

The space factors into *structures* (everything that shapes the compute and the activations: tp,
sp, cp, pp, vpp, schedule, ep, mbs, recompute, recompute_modules, offload_layers) times *state variants* (how model states are kept:
zero, its flavour, dp_shard, offload). Search bounds a structure once and each variant cheaply.

Validation: every structure is checked by `resolve` with its first state variant that passes; every
state variant by `resolve` once per (dp, ep, whether the schedule splits the backward) it occurs
with. The rules of `resolve` each read either structure fields or state fields with those three,
never both, so the two checks together accept exactly what `resolve` accepts plan by plan (tests/test_search.py holds the space to that); a plan
is resolved again, in full, when it is simulated.

A cluster sized to the plan (`local`) has no world size of its own: the search uses one rank per
host core unless `fix` pins dp, tp, cp and pp.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import product
from typing import Iterator, Optional

from simexec.specs.cluster import ClusterSpec
from simexec.errors import PlanError
from simexec.specs.model import ModelSpec
from simexec.specs.stack import StackSpec
from simexec.specs.plan import DEFAULT_RECOMPUTE_MODULES, Plan, ResolvedPlan, balanced_stages, resolve
from simexec.specs.plan_rules import heads_unsplit
from simexec.program.schedules import SCHEDULES, default_schedule, schedule
from simexec.specs.zero3_flavours import DEFAULT_ZERO3_FLAVOUR, ZERO3_FLAVOURS

MBS = (1, 2, 4, 8, 16)
MIN_CP_CHUNK = 1024
MAX_CP = 32
MAX_VPP = 8
# a ZeRO-3 flavour that holds its gradient shards from the start (zero_impl=deepspeed) is a stack's own
# choice, not a knob of the default one: the space leaves it out (`--fix zero_impl=deepspeed`, or a
# stack that allows it, still searches it); None: the default flavour
ZERO_VARIANTS = ((0, None), (1, None), (2, None), (3, None)) + tuple(
    (3, name) for name, flavour in ZERO3_FLAVOURS.items()
    if name != DEFAULT_ZERO3_FLAVOUR and not flavour.holds_grad_shards)
RECOMPUTE = ("none", "selective", "full")
# torchtitan's per-operator checkpointing, which only it runs: searched under a stack that allows it
FRAMEWORK_RECOMPUTE = RECOMPUTE + ("op",)
STATE_KEYS = ("zero", "zero_impl", "dp_shard", "offload", "reshard_after_forward")
# Fields the space enumerates; any other field of `fix` passes through to every plan unchanged.
ENUMERATED = {
    "tp", "sp", "cp", "cp_impl", "pp", "vpp", "schedule", "dp", "ep", "etp", "zero", "zero_impl", "dp_shard",
    "offload", "mbs", "recompute", "recompute_layers", "gbs", "stages", "dualpipe_overlap", "tp_overlap",
    "moe_dispatcher", "moe_a2a_overlap", "reshard_after_forward", "recompute_modules", "offload_layers",
}


@dataclass
class SpaceStats:
    """How many combinations the space held, how many `resolve` refused, and by which rule: its
    message with the numbers taken out, so that one rule broken with different values counts once."""

    combinations: int = 0
    invalid: int = 0
    refusals: Counter = field(default_factory=Counter)  # rule -> combinations it refused
    examples: dict = field(default_factory=dict)  # rule -> the first message that broke it

    def rule(self, e: Exception) -> str:
        message = " ".join(str(e).split())
        rule = _NUMBERS.sub("#", message)
        self.examples.setdefault(rule, message)
        return rule

    def refuse(self, rule: str) -> None:
        self.invalid += 1
        self.refusals[rule] += 1

    def most_often(self, k: int = 3) -> list[dict]:
        """The k rules that refused the most combinations: an example message of each, and its count."""
        return [{"refusal": self.examples[r], "combinations": n} for r, n in self.refusals.most_common(k)]


_NUMBERS = re.compile(r"\d+(\.\d+)?")


@dataclass
class Structure:
    """One structure and its valid state variants. `rp` is the structure resolved with `states[0]`."""

    fields: dict
    states: list[tuple]  # (zero, zero_impl, dp_shard, offload), each valid with this structure
    rp: ResolvedPlan
    extra: dict = field(default_factory=dict)  # fields passed through from `fix`
    pair: int = -1  # index of its (tp, cp) pair in the enumeration (`structures`' part)

    def plan(self, state: tuple) -> Plan:
        return Plan(**self.fields, **dict(zip(STATE_KEYS, state)), **self.extra)

    def plan_string(self, state: tuple) -> str:
        return self.plan(state).to_string()


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class AnyOf(tuple):
    """A `fix` value that leaves the search a choice among several (`--fix "tp=4|8"`): the space
    enumerates these values of the knob instead of its own list."""


class Allowed(AnyOf):
    """What a framework can run of a knob (`StackSpec.search_choices`): the space's own values that are
    among these. Where the space has one value only (the knob does not apply: cp_impl without cp, a
    schedule without pp) that value stays."""


# the enumerated knobs a fix may give alternatives for (gbs is the search's, stages a value of its own)
ALTERNATIVE_KEYS = ENUMERATED - {"gbs", "stages"}


def search_world(cluster: ClusterSpec, fix: dict) -> int:
    """World size the search fills: the cluster's, or for a cluster sized to the plan, what `fix` pins
    (dp*tp*cp*pp) or one rank per host core."""
    if not cluster.sized_to_plan:
        return cluster.world_size
    if all(fix.get(k) is not None and not isinstance(fix[k], AnyOf) for k in ("dp", "tp", "cp", "pp")):
        return fix["dp"] * fix["tp"] * fix["cp"] * fix["pp"]
    return cluster.node.cpu_cores


def _choices(fix: dict, key: str, default: list) -> list:
    """The values of a knob to enumerate: what `fix` pins or allows, else the space's own."""
    if key not in fix:
        return default
    val = fix[key]
    if isinstance(val, Allowed):
        kept = [v for v in default if v in val]
        return kept if kept or len(default) > 1 else default
    return list(val) if isinstance(val, AnyOf) else [val]


def structures(model: ModelSpec, cluster: ClusterSpec, gbs: int, seq_len: int, fix: Optional[dict] = None,
               stats: Optional[SpaceStats] = None, part: Optional[tuple[int, int]] = None,
               stack: Optional[StackSpec] = None) -> Iterator[Structure]:
    """Every structure of the space with the state variants `resolve` accepts, in a fixed order.
    part=(k, n): only those of every n-th (tp, cp) pair from the k-th (`Structure.pair` says whose a
    structure is), so that n workers can share the space without enumerating it all."""
    fix = dict(fix or {})
    stats = stats if stats is not None else SpaceStats()
    world = search_world(cluster, fix)
    gpn = cluster.nvlink_domain or world  # tp and HSDP shards stay inside one NVLink domain
    extra = {k: v for k, v in fix.items() if k not in ENUMERATED}
    state_ok: dict[tuple, str] = {}  # (dp, ep, etp, split, *state) -> the rule it breaks, "" if none
    pair = -1
    for tp in _choices(fix, "tp", _pow2_upto(gpn)):
        cps = [c for c in _pow2_upto(MAX_CP) if c == 1 or seq_len // c >= MIN_CP_CHUNK]
        for cp in _choices(fix, "cp", cps):
            pair += 1
            if part is not None and pair % part[1] != part[0]:
                continue
            if tp <= 0 or cp <= 0 or world % (tp * cp):
                continue
            rest = world // (tp * cp)
            pps = [p for p in _divisors(rest) if p <= model.layers]
            for pp in _choices(fix, "pp", pps):
                if pp <= 0 or rest % pp:
                    continue
                dp = rest // pp
                if fix.get("dp") is not None and dp not in _choices(fix, "dp", [dp]):
                    continue
                for fields in structure_fields(model, gbs, fix, tp, cp, pp, dp, cluster.nvlink_domain or world):
                    states = state_variants(fix, dp, tp, cp, gpn)
                    stats.combinations += len(states)
                    st = _validate(model, cluster, seq_len, fields, states, extra, state_ok, stats, stack)
                    if st is not None:
                        st.pair = pair
                        yield st


def _validate(model, cluster, seq_len, fields, states, extra, state_ok, stats, stack=None) -> Optional[Structure]:
    """Resolve the structure with its first passing state; check the other states once per (dp, ep)."""
    rp, first = None, None
    failed = []
    for i, state in enumerate(states):
        try:
            rp = resolve(model, cluster, Plan(**fields, **dict(zip(STATE_KEYS, state)), **extra), seq_len, stack)
            first = i
            break
        except (PlanError, ValueError) as e:
            failed.append((state, stats.rule(e)))
    for _, rule in failed:
        stats.refuse(rule)
    if rp is None:
        return None
    key0 = (fields["dp"], fields["ep"], fields.get("etp"), rp.plan.pipeline_schedule.splits_backward)
    for state, rule in failed:
        state_ok[key0 + state] = rule
    state_ok[key0 + states[first]] = ""
    good = []
    for state in states[first:]:
        key = key0 + state
        rule = state_ok.get(key)  # "": valid
        if rule is None:
            try:
                resolve(model, cluster, Plan(**fields, **dict(zip(STATE_KEYS, state)), **extra), seq_len, stack)
                rule = ""
            except (PlanError, ValueError) as e:
                rule = stats.rule(e)
            state_ok[key] = rule
        if rule:
            stats.refuse(rule)
        else:
            good.append(state)
    return Structure(fields, good, rp, extra)


def _stage_splits(model: ModelSpec, fix: dict, pp: int, vpp: int) -> list[Optional[tuple[int, ...]]]:
    """Layers per virtual stage to try: None (the even split) when pp*vpp divides the layers, and the
    balanced split when it exists and differs from the even one."""
    if "stages" in fix:
        return [fix["stages"]]
    n = pp * vpp
    out: list[Optional[tuple[int, ...]]] = [None] if model.layers % n == 0 else []
    if pp > 1:
        balanced = balanced_stages(model.layers, n)
        if balanced is not None and len(set(balanced)) > 1:
            out.append(balanced)
    return out


def structure_fields(model, gbs, fix, tp, cp, pp, dp, domain: int = 0) -> Iterator[dict]:
    """The plan fields of each structure with this (tp, cp, pp, dp) under `fix` (all but its state variants');
    `domain`: the ranks of one NVLink domain (0: unknown, DeepEP's dispatch is then not tried)."""
    layers_per_rank = model.layers // pp if model.layers % pp == 0 else 0
    vpps = [1] + [v for v in range(2, MAX_VPP + 1) if layers_per_rank % v == 0] if pp > 1 and layers_per_rank else [1]
    for vpp in _choices(fix, "vpp", vpps):
        scheds = [None]  # None: the default for vpp, then every other schedule that runs with it
        if pp > 1:
            scheds += [name for name, s in SCHEDULES.items() if s.runs_with_vpp(vpp) and name != default_schedule(vpp)]
        for stages in _stage_splits(model, fix, pp, vpp):
            per_stage = min(stages) if stages else model.layers // (pp * vpp)
            yield from _knob_fields(model, gbs, fix, dict(dp=dp, tp=tp, cp=cp, pp=pp, vpp=vpp, stages=stages),
                                    scheds, per_stage, domain)


def _knob_fields(model, gbs, fix, split: dict, scheds: list, per_stage: int, domain: int = 0) -> Iterator[dict]:
    tp, cp, dp = split["tp"], split["cp"], split["dp"]
    if isinstance(fix.get("schedule"), Allowed):  # None stands for the default schedule of its vpp
        named = [s for s in scheds if (s or default_schedule(split["vpp"])) in fix["schedule"]]
        scheds = named if named or len(scheds) == 1 else []
    for schedule_name in scheds if isinstance(fix.get("schedule"), Allowed) else _choices(fix, "schedule", scheds):
        sched = schedule(schedule_name or default_schedule(split["vpp"]))
        # a zero-bubble schedule refuses sp (`simexec.specs.plan`): not enumerated, rather than refused
        sps = [False, True] if tp > 1 and not sched.splits_backward else [False]
        overlaps = [False, True] if sched.overlapped_pairs else [False]
        tp_overlaps = [False, True] if tp > 1 and not sched.splits_backward else [False]
        for sp, overlap, tp_overlap in product(_choices(fix, "sp", sps), _choices(fix, "dualpipe_overlap", overlaps),
                                               _choices(fix, "tp_overlap", tp_overlaps)):
            for cp_impl in _choices(fix, "cp_impl", _cp_impls(model, tp, cp)):
                for ep, etp, dispatcher in expert_dispatches(model, fix, tp, cp, dp, sp, domain):
                    for mbs in _choices(fix, "mbs", [m for m in MBS if gbs % (m * dp) == 0]):
                        own = FRAMEWORK_RECOMPUTE if isinstance(fix.get("recompute"), Allowed) else RECOMPUTE
                        for recompute in _choices(fix, "recompute", list(own)):
                            if "recompute_layers" in fix:
                                rls = _choices(fix, "recompute_layers", [])
                            elif recompute == "none":
                                rls = [None]
                            else:
                                half = per_stage // 2
                                rls = [None] + ([half] if 1 <= half < per_stage else [])
                            a2a = moe_a2a_overlaps(fix, ep, dispatcher, sched, split["pp"], split["vpp"], recompute)
                            offloads = offload_layer_counts(model, fix, sched, split["pp"], split["vpp"], recompute)
                            for rl, moe_overlap in product(rls, a2a):
                                for mods in recompute_module_sets(model, fix, recompute, rl):
                                    for n_off in offloads:
                                        yield dict(split, sp=sp, cp_impl=cp_impl, schedule=schedule_name, ep=ep, etp=etp,
                                                   mbs=mbs, gbs=gbs, recompute=recompute, recompute_layers=rl,
                                                   recompute_modules=mods, offload_layers=n_off,
                                                   dualpipe_overlap=overlap, tp_overlap=tp_overlap,
                                                   moe_dispatcher=dispatcher, moe_a2a_overlap=moe_overlap)


def _cp_impls(model: ModelSpec, tp: int, cp: int) -> list[str]:
    """How cp can exchange K/V. The all-to-all needs each tp rank's heads to split over cp
    (`simexec.specs.plan`), and is left out where it would move at least the all-gather's bytes and hold at
    least its memory: per token, q, k, v and the output against cp times the K/V, and the output's
    second copy against the cp - 1 gathered K/V (with grouped K/V heads and small cp it loses both)."""
    if cp == 1:
        return ["allgather"]
    if heads_unsplit(model, tp, cp):
        return ["allgather", "ring"]
    q, kv, o = model.attention_widths
    useful = q + kv + o < cp * kv or o < (cp - 1) * kv
    return ["allgather", "ring"] + (["a2a"] if useful else [])


def _eps(model: ModelSpec, dp: int) -> list[int]:
    if model.moe is None:
        return [1]
    return [e for e in _pow2_upto(dp) if model.moe.experts % e == 0 and dp % e == 0]


def expert_layouts(model: ModelSpec, fix: dict, tp: int, cp: int, dp: int, sp: bool) -> list[tuple]:
    """(ep, etp) pairs: ep out of dp with experts split over tp (etp None), then parallel folding
    (`Plan.etp`: 1 or tp, ep out of tp*cp*dp) where its groups differ from those (etp = tp over cp = 1
    with ep dividing dp is the unfolded plan again) and Megatron-Core runs it (tp > 1 needs sp)."""
    out = [] if _pinned(fix, "etp") else [(ep, None) for ep in _choices(fix, "ep", _eps(model, dp))]
    if model.moe is None or (tp > 1 and not sp):
        return out
    stage = tp * cp * dp
    etps = [e for e in _choices(fix, "etp", sorted({1, tp})) if e is not None]
    for etp in etps:
        for ep in _pow2_upto(stage):
            if model.moe.experts % ep or stage % (etp * ep) or model.moe.expert_ffn % etp:
                continue
            if etp == tp and cp == 1 and dp % ep == 0 and not _pinned(fix, "etp"):
                continue
            if "ep" in fix and not _allowed(fix, "ep", ep):
                continue
            out.append((ep, etp))
    return out


def expert_dispatches(model: ModelSpec, fix: dict, tp: int, cp: int, dp: int, sp: bool,
                       domain: int) -> list[tuple]:
    """(ep, etp, moe_dispatcher) triples: each expert layout (`expert_layouts`) with the dispatchers
    that differ on it: alltoall; allgather where ep > 1; deepep where the ep group leaves its NVLink
    domain (inside one, DeepEP's dispatch is the all-to-all). The ep group's span in ranks: etp*ep when
    folded, else ep blocks of dp under the default rank order (tp and cp inside)."""
    out = []
    for ep, etp in expert_layouts(model, fix, tp, cp, dp, sp):
        span = (etp * ep) if etp is not None else ep * tp * cp
        kinds = ["alltoall"] + (["allgather"] if ep > 1 else []) + (["deepep"] if ep > 1 and 0 < domain < span else [])
        out += [(ep, etp, d) for d in _choices(fix, "moe_dispatcher", kinds)]
    return out


def moe_a2a_overlaps(fix: dict, ep: int, dispatcher: str, sched, pp: int, vpp: int, recompute: str) -> list[bool]:
    """moe_a2a_overlap where Megatron-Core runs it (`simexec.specs.plan_rules`): ep > 1, an all-to-all
    dispatcher, no full recompute, a whole backward, and no pipeline or an interleaved one (vpp > 1)."""
    runs = (ep > 1 and dispatcher != "allgather" and recompute != "full" and not sched.splits_backward
            and (pp == 1 or vpp > 1))
    return _choices(fix, "moe_a2a_overlap", [False, True] if runs else [False])


def heavier_recompute_modules(model: ModelSpec) -> tuple[str, ...]:
    """The one set of Megatron-Core's --recompute-modules the space tries beside the default (core_attn):
    the attention's module (core_attn; mla_up_proj on MLA models, as Megatron-Bridge's DeepSeek-V3 recipe),
    plus mlp where the model has dense layers and layernorm+moe_act where it has MoE layers (the pair
    Megatron-Bridge's MoE recipes recompute: element-wise work that frees whole saved tensors)."""
    mods = ["mla_up_proj" if model.is_mla else "core_attn"]
    moe_layers = [model.is_moe_layer(i) for i in range(model.layers)]
    if not all(moe_layers):
        mods.append("mlp")
    if any(moe_layers):
        mods += ["layernorm", "moe_act"]
    return tuple(mods)


def _module_names(v) -> str:
    """A recompute_modules value as one string, None standing for the default (core_attn)."""
    if v is None:
        return "+".join(DEFAULT_RECOMPUTE_MODULES)
    return v if isinstance(v, str) else "+".join(v)


def recompute_module_sets(model: ModelSpec, fix: dict, recompute: str, recompute_layers: Optional[int]) -> list:
    """recompute_modules to try: None (the default, core_attn) and, under selective recompute of all
    layers, `heavier_recompute_modules`; what `fix` pins or allows instead (a stack's list names sets
    joined by '+', None standing for core_attn)."""
    own = [None]
    if recompute == "selective" and recompute_layers is None:
        own.append(heavier_recompute_modules(model))
    if "recompute_modules" not in fix:
        return own
    val = fix["recompute_modules"]
    if isinstance(val, Allowed):
        names = {_module_names(v) for v in val}
        return [m for m in own if _module_names(m) in names] or own[:1]
    return _choices(fix, "recompute_modules", own)


def offload_layer_counts(model: ModelSpec, fix: dict, sched, pp: int, vpp: int, recompute: str) -> list[int]:
    """offload_layers to try: 0, and half the layers where Megatron-Core runs activation offloading
    (`simexec.specs.plan_rules`: pp = 1, vpp = 1, no recompute, a whole backward; fewer than all layers)."""
    half = model.layers // 2
    runs = pp == 1 and vpp == 1 and recompute == "none" and not sched.splits_backward and 1 <= half < model.layers
    own = [0] + ([half] if runs else [])
    return _choices(fix, "offload_layers", own)


def _pinned(fix: dict, key: str) -> bool:
    """`fix` sets `key` to values none of which is None."""
    return key in fix and not _allowed(fix, key, None)


def _allowed(fix: dict, key: str, v) -> bool:
    val = fix[key]
    return v in val if isinstance(val, (Allowed, AnyOf)) else v == val


def state_variants(fix: dict, dp: int, tp: int, cp: int, gpn: int) -> list[tuple]:
    """The (zero, zero_impl, dp_shard, offload, reshard_after_forward) variants of one mesh under `fix`;
    FSDP2's reshard_after_forward=0 only where `fix` names the knob (a stack that runs it)."""
    if isinstance(fix.get("zero"), Allowed):
        zeros = [zv for zv in ZERO_VARIANTS if (zv[0] == 0 or dp > 1) and zv[0] in fix["zero"]]
        if isinstance(fix.get("zero_impl"), Allowed):  # the framework's own ZeRO-3
            zeros = [zv for zv in zeros if zv[0] != 3] + [
                (3, None if name == DEFAULT_ZERO3_FLAVOUR else name) for name in fix["zero_impl"] if 3 in fix["zero"] and dp > 1]
    elif "zero" in fix:
        zeros = [(z, impl) for z in _choices(fix, "zero", []) for impl in _choices(fix, "zero_impl", [None])]
    elif "zero_impl" in fix:
        zeros = [(3, impl) for impl in _choices(fix, "zero_impl", [])]
    else:
        zeros = [zv for zv in ZERO_VARIANTS if zv[0] == 0 or dp > 1]
    node_shard = gpn // (tp * cp) if gpn % (tp * cp) == 0 else 0
    out = []
    for zero, zero_impl in zeros:
        if "dp_shard" in fix:
            shards = _choices(fix, "dp_shard", [])
        else:
            shards = [None] + ([node_shard] if zero == 3 and 1 < node_shard < dp and dp % node_shard == 0 else [])
        offloads = ["none"] + (["optimizer"] if zero >= 1 else []) + (["optimizer+params"] if zero == 3 else [])
        if "offload" in fix:
            offloads = _choices(fix, "offload", offloads if isinstance(fix["offload"], Allowed) else [])
        fsdp2 = zero == 3 and (zero_impl or DEFAULT_ZERO3_FLAVOUR) == "fsdp"
        rafs = _choices(fix, "reshard_after_forward", [True, False]) if fsdp2 and "reshard_after_forward" in fix else [True]
        for dp_shard in shards:
            for offload in offloads:
                for raf in rafs:
                    out.append((zero, zero_impl, dp_shard, offload, raf))
    return out


def plans(model: ModelSpec, cluster: ClusterSpec, gbs: int, seq_len: int, fix: Optional[dict] = None,
          stats: Optional[SpaceStats] = None) -> Iterator[Plan]:
    """Every valid plan of the space, structure by structure (for brute force and tests)."""
    for st in structures(model, cluster, gbs, seq_len, fix, stats):
        for state in st.states:
            yield st.plan(state)
