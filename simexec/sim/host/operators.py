"""How many aten operators the executor dispatches for an instruction: the counted tables.

The host model prices an operator at the device's launch overhead (`simexec.sim.host.model`), so it
needs each block's count, which depends on the model's features (`simexec.program.dispatch_key`),
the plan's parallelism (experts per rank, context and sequence parallelism, a split backward) and
the dtype, and the optimizer step's count, which depends on its tensors and pieces
(`simexec.program.adam`). Every count here was measured on the executor; the tests hold them to it.
"""
from __future__ import annotations

import math

from simexec.program.adam import ADAM_PIECE
from simexec.program.dispatch_key import dispatch_key
from simexec.program.instructions import Instr

ADAM_FUSED_OPS = 2  # _foreach_add_ on the step counts, _fused_adam_ (simexec.exec.nn.optim.Adam)
ADAM_OPS_PER_16BIT_TENSOR = 2  # the gradient's fp32 copy, the master's rounded copy into the parameter
# The passes over the gradients before the step, counted with count_dispatch_plan on gpt-tiny at ZeRO
# 0, 1 and 3. loss_scale: `unscale` is one fused unscale-and-check over the rank's gradients and two
# operators making its flag and scale; the step reads the flag (one). clip_grad: the norm is one
# _foreach_norm and six operators summing and shaping the squares (two more per piece of a ZeRO shard
# whose parameters are replicated over tp for some and split for others); the step computes the
# coefficient and scales the gradients with seven more. On a CPU these foreach kernels loop over the
# tensors (2.5 µs a tensor for the norm, 1.3 for the scaling, 0.4 for the unscaling on the 2-core VM
# with torch 2.13), which is not priced: about 0.3 ms a step for gpt-tiny's 69 tensors.
UNSCALE_OPS = 3
OVERFLOW_CHECK_OPS = 1
GRAD_NORM_OPS = 7
CLIP_SCALE_OPS = 7


def adam_ops(tensors: int, dtype: str, elements: float = 0.0, master_grads: bool = False,
             piece: int = ADAM_PIECE["cpu"]) -> int:
    """Aten operators of one Adam step over `tensors` parameter tensors of `elements` in all, held in
    `dtype`. 16-bit gradients are cast to fp32 all at once under `master_grads`; else the kernel runs
    per `piece` elements (a tensor split where a piece fills up): two operators a call, a slice and a
    cast a piece, a flattening view and the master's copy into the parameter a tensor."""
    if dtype not in ("bf16", "fp16"):
        return ADAM_FUSED_OPS
    if master_grads:
        return ADAM_FUSED_OPS + ADAM_OPS_PER_16BIT_TENSOR * tensors
    calls = max(1, math.ceil(elements / piece))
    pieces = tensors + calls - 1
    return ADAM_FUSED_OPS * calls + 2 * pieces + 2 * tensors


def adam_kernel_passes(tensors: int, dtype: str, elements: float = 0.0, master_grads: bool = False,
                       piece: int = ADAM_PIECE["cpu"]) -> int:
    """Tensors torch's CPU fused Adam runs its kernel over one at a time: `_fused_adam_` is one
    operator, but on a CPU it loops over its tensor lists and sets up a pass per tensor, which costs
    about what an operator's dispatch does (`scripts/probe_host.py adam-passes`: 4.5-5.4 µs a tensor in a warm
    loop on the 2-core VM with torch 2.13). The tensors are the parameters, or under 16-bit gradients cast a piece at a time, the
    pieces' views (`adam_ops`)."""
    if dtype in ("bf16", "fp16") and not master_grads:
        return tensors + max(1, math.ceil(elements / piece)) - 1
    return tensors


# Aten operators the executor dispatches per block instruction, keyed "<phase>.<block>", counted with
# a TorchDispatchMode around each instruction of a one-step run (simexec.calibrate.microbench.count_dispatch).
# The count does not depend on sizes, nor (within one or two ops) on tp, pp, ZeRO or recompute; it
# depends on the model's features (`dispatch_key`: norm, gating, positions, biases, q/k norms, experts; a tied
# head differs by one or two), hence one table per set of features, named after the models it fits.
DISPATCH: dict[str, dict[str, int]] = {
    # gpt-tiny, gpt3-*, megatron-*: LayerNorm, GeLU MLP, learned positions, biases
    "layernorm-mlp-pos-bias": {
        "fwd.embed": 20, "fwd.qkv": 23, "fwd.attn": 9, "fwd.proj": 9, "fwd.fc1": 8, "fwd.fc2": 9,
        "fwd.head": 8, "fwd.xent": 18, "fwd.loss": 10,
        "bwd.loss": 9, "bwd.xent": 8, "bwd.head": 11, "bwd.fc2": 13, "bwd.fc1": 16, "bwd.proj": 13,
        "bwd.attn": 9, "bwd.qkv": 47, "bwd.embed": 7,
    },
    # Llama, Mistral, TinyLlama (GQA or not): RMSNorm, SwiGLU, rotary positions, no biases
    "rmsnorm-swiglu-rope": {
        "fwd.embed": 17, "fwd.qkv": 39, "fwd.attn": 9, "fwd.proj": 8, "fwd.fc1": 17, "fwd.fc2": 8,
        "fwd.head": 14, "fwd.xent": 18, "fwd.loss": 10,
        "bwd.loss": 9, "bwd.xent": 8, "bwd.head": 19, "bwd.fc2": 10, "bwd.fc1": 37, "bwd.proj": 10,
        "bwd.attn": 9, "bwd.qkv": 60, "bwd.embed": 3,
    },
    # MoE layers of the same (moe-tiny, traces/gpu/mixtral-mini.json); `experts` and `moe_out` come
    # from MOE_LOOP_OPS
    "rmsnorm-swiglu-rope-moe": {
        "fwd.embed": 17, "fwd.qkv": 39, "fwd.attn": 9, "fwd.proj": 8, "fwd.router": 23, "fwd.head": 14,
        "fwd.xent": 18, "fwd.loss": 10,
        "bwd.loss": 9, "bwd.xent": 8, "bwd.head": 19, "bwd.router": 35, "bwd.proj": 10, "bwd.attn": 9,
        "bwd.qkv": 60, "bwd.embed": 3,
    },
}
# The MoE blocks loop over experts, in Python: operators = fixed + per expert, over the rank's local
# routed experts (`experts`) or the shared experts (`moe_out`). Counted at 4 + 1 shared (moe-tiny),
# 8 + 0 (Mixtral-style) and 256 + 1 (DeepSeek-V3's counts, shrunk): the same two numbers fit all.
MOE_LOOP_OPS = {"fwd.experts": (16, 5), "bwd.experts": (6, 26), "fwd.moe_out": (14, 6), "bwd.moe_out": (14, 26)}
# Context parallelism runs another attention block (counted on gpt-tiny and moe-tiny at cp 2 and 4,
# rank 0): the all-gather flavour builds the load-balanced causal mask of its query chunks against
# the gathered keys (16 + 3 cp operators forward); the ring runs flash attention per K/V chunk and
# merges the chunks by log-sum-exp, in fp32 under 16-bit types (its instructions cover every hop).
CP_ATTN_OPS = {
    "allgather": lambda cp, half: {"fwd.attn": 16 + 3 * cp, "bwd.attn": 10},
    "ring": lambda cp, half: {"fwd.attn": 62 if half else 58, "bwd.attn": 64 if half else 58},
    "a2a": lambda cp, half: {},  # the whole sequence for fewer heads: the single-rank attention's
}
# Sequence parallelism moves each norm into a block of its own (`norm1`, `norm2`, `norm` before the
# head) and gives the column-parallel GEMMs a custom autograd function that saves the weight, not the
# gathered input (re-gathered for the backward): counted on gpt-tiny, moe-tiny, moe-tiny with 0 and 2
# shared experts and a shrunk llama3-8b at tp 2 (`count_dispatch_plan`), the same at micro-batch 1
# and 2, in fp32 (16-bit types: HALF_NORM_CAST_OPS). MoE's shared experts then cost (fixed, per
# shared expert) as MOE_LOOP_OPS.
SP_OPS: dict[str, dict[str, int]] = {
    "layernorm-mlp-pos-bias": {
        "fwd.norm1": 3, "fwd.norm2": 3, "fwd.norm": 3, "bwd.norm1": 5, "bwd.norm2": 5, "bwd.norm": 4,
        "fwd.qkv": 23, "bwd.qkv": 49, "fwd.fc1": 8, "bwd.fc1": 14, "fwd.head": 8, "bwd.head": 10,
    },
    "rmsnorm-swiglu-rope": {
        "fwd.norm1": 8, "fwd.norm2": 8, "fwd.norm": 8, "bwd.norm1": 13, "bwd.norm2": 13, "bwd.norm": 12,
        "fwd.qkv": 34, "bwd.qkv": 53, "fwd.fc1": 11, "bwd.fc1": 29, "fwd.head": 8, "bwd.head": 10,
        "fwd.router": 20, "bwd.router": 28,  # the route keeps its top-k indices (the allgather dispatcher reads them)
    },
}
# Every table counts fp32. Under 16-bit types the executor's RMSNorm (`simexec.exec.nn.ops.rms_norm`)
# normalises in fp32, whose casts add operators to each block that holds one (the norms of their own
# under sp, else the blocks they open: qkv, fc1 or the router, the head), and the head casts its
# logits: counted on tests/data/window-tiny.yaml, moe-tiny and gpt-tiny in bf16 against fp32.
HALF_NORM_CAST_OPS = {"fwd": 2, "bwd": 6}
HALF_HEAD_CAST_OPS = {"fwd": 1, "bwd": 1}
# ... and in a split backward (counted as SPLIT_OPS, in bf16): the norm's input pass 4, its weight
# pass 3 (both read the input in fp32); the logits' cast in the head's input pass
HALF_NORM_SPLIT_CAST_OPS = {"bwd": 4, "wgrad": 3}
NORM_OPENED_BLOCKS = ("qkv", "fc1", "router", "head")  # without sp, the blocks a norm opens
SP_NORM_BLOCKS = ("norm1", "norm2", "norm")  # under sp, the norms' own blocks
SP_MOE_OUT_OPS = {"fwd.moe_out": (17, 12), "bwd.moe_out": (14, 36)}
DEFAULT_TABLE = "layernorm-mlp-pos-bias"  # models whose features no table has borrow these counts
# a norm over each q and k head (qk_norm) adds its operators to the qkv block of any table
QK_NORM_OPS = {"fwd.qkv": 12, "bwd.qkv": 24}
# group-limited routing (router_groups > 1: `simexec.exec.nn.gpt.group_limited_topk`) adds the groups'
# scores, their top-k, the mask and the gather to the router's forward (counted on deepseek-v3 and
# tests/data/moe-group-tiny.yaml against moe-tiny, with and without sp: +14 either way; the backward's
# gather takes the top-k's place)
ROUTER_GROUP_OPS = {"fwd.router": 14}
# A layer's sliding window changes the operators of its forward attention: counted on
# tests/data/window-tiny.yaml with the window on every layer, against the same model without it. The
# band mask is built once for the positions a step's micro-batches share; then the fused kernel with
# a mask runs 3 more than with `is_causal`, the unfused attention 2 fewer (no causal mask to build),
# and context parallelism's all-gather, whose gathered positions are new at each call, builds the
# band instead of the causal mask (+3). The backward is alike.
WINDOW_OPS = {"fused": 3, "unfused": -2, "cp": 3}
# Without a fused kernel (`flash_attention=0`) attention is Q.K^T, the causal mask, softmax and P.V
# one operator each (`_unfused_attention`): counted on gpt-tiny and moe-tiny, alone and under context
# parallelism's all-gather (whose mask comes from the gathered positions, as with the fused kernel).
# Query heads in groups (`gqa` in the dispatch key) view the queries per group: 2 more each way.
# The ring computes per K/V chunk alike fused or not; with grouped heads it expands each chunk's
# K and V to the query heads first (8 more operators forward, 12 backward, counted at cp 2).
UNFUSED_ATTN_OPS = {"fwd.attn": 32, "bwd.attn": 31}


def unfused_cp_attn_ops(cp: int) -> dict[str, int]:
    """The unfused attention under context parallelism's all-gather (its mask as the fused one's)."""
    return {"fwd.attn": 33 + 3 * cp, "bwd.attn": 32}


GQA_OPS = {"unfused": {"fwd.attn": 2, "bwd.attn": 2}, "ring": {"fwd.attn": 8, "bwd.attn": 12}}
# Multi-head latent attention (`mla` in the dispatch key, `qlora` with a q latent), counted (as the
# tables, `count_dispatch`) on tests/data/mla-tiny.yaml with and without its q latent against the
# same model without MLA: the
# latents' projections and norms, the rotary key shared by the heads and the concatenations per head
# in qkv; the fused attention pads V to the key width and slices the output (5 each way), the
# unfused one and the ring take K and V apart.
MLA_OPS = {"fwd.qkv": 15, "bwd.qkv": 24}
Q_LORA_OPS = {"fwd.qkv": 9, "bwd.qkv": 18}
MLA_ATTN_OPS = {"fused": {"fwd.attn": 5, "bwd.attn": 5}, "unfused": {"fwd.attn": 2, "bwd.attn": 1},
                "ring": {"fwd.attn": 2, "bwd.attn": 4}}
DEFAULT_OPS = 12  # a block no table knows


def cost_family(model) -> str:
    """The kernels a model's blocks run (norm, MLP, positions, MoE), without its sizes: element-wise
    costs measured on one model of a family (`elementwise_cost["<family>/<phase>.<block>"]`) price
    every model of it."""
    key = strip_adders(dispatch_key(model))[0]
    dense, _, moe = key.partition("-moe")
    return dense + ("-moe" if moe else "")


def dispatch_table(key: str, ep: int = 1, cp: int = 1, cp_impl: str = "allgather",
                   dtype: str = "fp32", sp: bool = False, flash: bool = True) -> dict[str, int]:
    """Operators per `<phase>.<block>` for a `dispatch_key` (features without a table of their own
    borrow the default's), MoE loops for the experts a rank of expert parallelism `ep` holds, the
    attention block of context parallelism `cp` in `dtype`, fused (`flash`) or not, the blocks of
    sequence parallelism."""
    key, adders = strip_adders(key)
    dense, _, moe = key.partition("-moe")
    table = dict(DISPATCH.get(key if not moe else dense, DISPATCH[DEFAULT_TABLE]))
    if moe:
        table.update(DISPATCH.get(dense + "-moe", DISPATCH["rmsnorm-swiglu-rope-moe"]))
    if sp:
        table.update(SP_OPS.get(dense, SP_OPS[DEFAULT_TABLE]))
    if moe:
        experts, shared = moe_counts(moe)
        local = math.ceil(experts / max(1, ep))
        for block, n in (("experts", local), ("moe_out", shared)):
            for phase in ("fwd", "bwd"):
                loops = SP_MOE_OUT_OPS if sp and block == "moe_out" else MOE_LOOP_OPS
                fixed, per = loops[f"{phase}.{block}"]
                table[f"{phase}.{block}"] = fixed + per * n
    ring = cp > 1 and cp_impl == "ring"
    if cp > 1:
        table.update(CP_ATTN_OPS.get(cp_impl, CP_ATTN_OPS["allgather"])(cp, dtype in ("bf16", "fp16")))
    if not flash and not ring:
        table.update(unfused_cp_attn_ops(cp) if cp > 1 and cp_impl == "allgather" else UNFUSED_ATTN_OPS)
    kernel = "ring" if ring else "unfused" if not flash else "fused"
    extra = []
    if "gqa" in adders and kernel != "fused":
        extra.append(GQA_OPS[kernel])
    if "qknorm" in adders:
        extra.append(QK_NORM_OPS)
    if "groups" in adders:
        extra.append(ROUTER_GROUP_OPS)
    if "mla" in adders or "mla-qlora" in adders:
        extra += [MLA_OPS, MLA_ATTN_OPS[kernel]] + ([Q_LORA_OPS] if "mla-qlora" in adders else [])
    for ops in extra:
        for block, n in ops.items():
            table[block] += n
    if dtype in ("bf16", "fp16"):
        if key.startswith("rmsnorm"):
            for block in SP_NORM_BLOCKS if sp else NORM_OPENED_BLOCKS:
                for phase, n in HALF_NORM_CAST_OPS.items():
                    if f"{phase}.{block}" in table:
                        table[f"{phase}.{block}"] += n
        for phase, n in HALF_HEAD_CAST_OPS.items():
            table[f"{phase}.head"] += n
    return table


def moe_counts(moe: str) -> tuple[int, int]:
    """(routed experts, shared experts) of a dispatch key's MoE part (`4x2+1`: 4 experts, top 2, 1 shared)."""
    return int(moe.split("x")[0]), int(moe.split("+")[1])


def strip_adders(key: str) -> tuple[str, set[str]]:
    """A dispatch key without the features that add operators to any table (grouped heads, qk norms,
    MLA, router groups), and those features."""
    adders = set()
    for feature in ("mla-qlora", "mla", "qknorm", "gqa", "groups"):
        if f"-{feature}" in key:
            adders.add(feature)
            key = key.replace(f"-{feature}", "")
    return key, adders


# Operators that wait for the device: the executor's MoE forward reads the per-expert token counts
# with `tolist()` to split its tokens, so the host stops issuing until the device has caught up.
HOST_SYNC_BLOCKS = ("experts",)

# A zero-bubble schedule's split backward (`simexec.exec.nn.weight_grads`): operators of a block's
# (input-gradient pass, weight pass), counted in fp32 as DISPATCH is, with count_dispatch_plan on
# gpt-tiny and on tests/data/window-tiny.yaml (grouped heads; its qkv counts the same with kv_heads =
# heads), pp=2, schedule=zb-h1
# (tests/test_calibrate.py holds them to the executor). A weight pass dispatches about three
# operators per parameter tensor (the weight-gradient GEMM or reduction, its transpose, its
# accumulation). Blocks not counted take their forward's count for the weight pass and the rest of
# the whole backward's for the input-gradient pass.
SPLIT_OPS = {
    "layernorm-mlp-pos-bias": {"qkv": (26, 21), "proj": (4, 6), "fc1": (7, 9), "fc2": (4, 6), "head": (5, 6)},
    "rmsnorm-swiglu-rope": {"qkv": (47, 14), "proj": (4, 3), "fc1": (27, 11), "fc2": (4, 3), "head": (11, 8),
                            "router": (27, 8)},
}
# q/k norms add to qkv's passes (tests/data/qk-norm-tiny.yaml); MoE models take their dense family's
# counts, the router's counted on moe-tiny
QKNORM_SPLIT_OPS = (14, 11)
# MLA's qkv split, whole (tests/data/mla-tiny.yaml, with its q latent and without)
MLA_SPLIT_OPS = {"mla-qlora": (77, 27), "mla": (66, 19)}
# the MoE output block's split, (fixed, per shared expert) of each pass: counted on moe-tiny with 0, 1
# and 2 shared experts (input pass 14, 26, 43; weight pass 0, 9, 18)
MOE_OUT_SPLIT_OPS = {"bwd": (14, 14), "wgrad": (0, 9)}
# The head's counted with schedule=zb-v (its first rank holds the head), tp_overlap's at tp 2 alike.
# Under sequence parallelism (only tp_overlap splits then) the norms are blocks of their own and the
# column-parallel GEMMs' autograd function is sp's: counted at tp=2,sp=1,tp_overlap=1.
SPLIT_OPS_SP = {
    "layernorm-mlp-pos-bias": {"qkv": (24, 24), "fc1": (5, 8), "head": (5, 5)},
    "rmsnorm-swiglu-rope": {"qkv": (37, 15), "fc1": (19, 10), "head": (5, 5)},
}
WEIGHT_BLOCKS = ("qkv", "proj", "fc1", "fc2", "router", "experts", "moe_out", "head")
# tp_overlap splits only the column-parallel blocks' backwards
# (`simexec.program.lowering.tensor_parallel`, `column_backward`)
COLUMN_BLOCKS = ("qkv", "fc1", "router", "head")


def weight_pass_calls(block: str, model, sp: bool) -> int:
    """Autograd engine calls of a block's weight pass: `simexec.exec.nn.weight_grads` batches the
    parameters whose joins are independent, so one call for the GEMMs, one for the norm opening the
    block (its affine feeds them), one for the bias adds after them, one for q/k norms after the q/k
    GEMMs; MLA's down GEMMs, latent norms and up GEMMs one each; an expert's up and down GEMMs one
    each (tests/test_exec_weight_grads.py holds these to the executor's batches)."""
    if model is None or block == "embed":
        return 1
    bias = bool(model.bias)
    norm = 0 if sp else 1
    if block == "qkv":
        if model.is_mla:
            return 3 + norm
        return 1 + norm + int(bias or bool(getattr(model, "qkv_bias", False))) + int(bool(model.qk_norm))
    if block in ("fc1", "router", "head"):
        return 1 + norm + int(bias and block == "fc1")
    if block in ("experts", "moe_out"):
        return 2 + 2 * int(bias)
    return 1 + int(bias)


def split_backward_table(table: dict[str, int], key: str, blocks: tuple[str, ...] = WEIGHT_BLOCKS + ("embed",),
                         sp: bool = False, dtype: str = "fp32") -> dict[str, int]:
    """`table` (for dispatch key `key`, in `dtype`) with each of `blocks`' backward split into `bwd`
    (input gradients) and `wgrad` (by default every weight-bearing block, a zero-bubble schedule's
    split; `sp`: the blocks of sequence parallelism); the embedding's backward is all weight pass."""
    out = dict(table)
    family, adders = strip_adders(key)
    family = family.partition("-moe")[0]
    # grouped heads add no operators to qkv; q/k norms and MLA counts of their own (without sp)
    known = {"gqa"} if sp else {"gqa", "qknorm"}
    counted = {b: n for b, n in (SPLIT_OPS_SP if sp else SPLIT_OPS).get(family, {}).items()
               if not (adders - known and b == "qkv")}
    if "qknorm" in adders and "qkv" in counted:
        counted["qkv"] = (counted["qkv"][0] + QKNORM_SPLIT_OPS[0], counted["qkv"][1] + QKNORM_SPLIT_OPS[1])
    mla = next((a for a in ("mla-qlora", "mla") if a in adders), None)
    if mla and not sp and family in SPLIT_OPS:
        counted["qkv"] = MLA_SPLIT_OPS[mla]
    moe = key.partition("-moe")[2]
    if moe and not sp:
        shared = moe_counts(moe)[1]
        counted["moe_out"] = tuple(fixed + per * shared for fixed, per in MOE_OUT_SPLIT_OPS.values())
    half = dtype in ("bf16", "fp16")
    for block in blocks:
        whole = table.get(f"bwd.{block}")
        if whole is None:
            continue
        w = min(table.get(f"fwd.{block}", whole), whole)
        b_ops, w_ops = counted.get(block, (whole - w, w))
        if half and block in counted:  # the counts are fp32's: add the casts of the norm the block holds
            if not sp and family.startswith("rmsnorm") and block in NORM_OPENED_BLOCKS:
                b_ops, w_ops = b_ops + HALF_NORM_SPLIT_CAST_OPS["bwd"], w_ops + HALF_NORM_SPLIT_CAST_OPS["wgrad"]
            if block == "head":
                b_ops += HALF_HEAD_CAST_OPS["bwd"]
        out[f"bwd.{block}"], out[f"wgrad.{block}"] = b_ops, w_ops
    if "bwd.embed" in table and "embed" in blocks:
        out["wgrad.embed"] = table["bwd.embed"]
    return out


# Main gradients (`grad_fp32` under a 16-bit dtype): the executor's hook adds each 16-bit gradient
# into its fp32 main gradient as it lands (one `add_`, or the first micro-batch's copy, counted with
# `count_dispatch_plan`), and the hook is a Python call of about an operator's cost besides (gpt-tiny
# `dp=2,gbs=8`: 13 µs a gradient on the 2-core VM, 2026-11-29): two operators a gradient.
MAIN_GRAD_OPS = 2

def ops_of(ins: Instr, table: dict[str, int]) -> int:
    """Aten operators a compute instruction dispatches (recompute runs the forward's)."""
    phase = "fwd" if ins.phase == "recompute" else ins.phase
    return table.get(f"{phase}.{ins.block}", table.get(f"fwd.{ins.block}", DEFAULT_OPS))

