"""CPU ranks sharing one host's cores: what an instruction costs a core, and how the OS shares the cores.

On the `local` cluster every rank is a Python process running PyTorch on the CPU with one thread,
and `node.cpu_cores` cores serve them all (4 ranks on 2 cores on the machine this was written on).
Pretending each rank owns a device gets such a machine badly wrong: compute of N busy ranks runs
about N/C slower, a rank waiting in a collective gives its core away, and a rank whose collective
has completed must wait for a core before it runs again. This module models that, and the engine
(`simexec.sim.engine`) hands it every compute, copy and host-optimizer instruction of a cluster whose
`costs.cores_shared` is set (a calibrated `local` profile; the preset's placeholders leave it off).

**What an instruction costs a core** (`HostCosts.cpu_seconds`), in CPU-seconds on one core:

    instr_overhead_s                       the interpreter's Python around the instruction
  + ops x device.launch_overhead_s         eager PyTorch dispatch, per aten op the block runs
  + bwd_overhead_s (backward only)         autograd engine set-up of `torch.autograd.backward`
  + flops / (peak[dtype] x eff(op, flops)) GEMMs and attention (the saturating efficiency curve of
                                           `simexec.sim.compute`)
  + bytes / (memory_bw x memory_eff)       memory traffic, each byte weighted by the block's
    x elementwise_cost[phase.block]        measured element-wise cost (on a CPU core GELU-tanh,
                                           softmax and normalisation cost several times an add's)

`ops` is how many aten operators the executor's block dispatches: counted (`DISPATCH`, refreshed
by `simexec.calibrate.microbench.count_dispatch`, checked against the executor by the tests), and for the
optimizer torch's fused Adam (`simexec.exec.nn.optim`): two operators for the whole step, plus two per
tensor under 16-bit types (the gradient's fp32 copy, the rounded copy back into the parameter), the
tensors being the rank's parameters (ZeRO 0), its flat buckets (ZeRO 1-2) or its gathered units
(ZeRO 3). On a CPU core the fused kernel also sets up a pass per tensor, priced as an operator
(`adam_kernel_passes`), and its bytes cost an element-wise factor of their own (`optim.optim`:
square roots and divisions), fitted to the one-rank step's optimizer.

A collective or message costs the rank's own thread too, besides the transfer (`issue_seconds`):
the interpreter's Python around it, `instr_overhead_s` (a collective's twice: at its call and
once it is waited for), a collective's call into torch.distributed (`collective_issue_s`, measured
by the micro-benchmarks' `issue`: about 60 µs of an idle core on the 2-core VM, where an operator
takes 5), and the operators that prepare its tensors and put the result in place
(`simexec.sim.host.issue`). A collective of parameter units makes passes over their tensors one tensor
at a time (`tensor_passes`), each a tensor view or copy and the Python around it, about two
operators' dispatch a tensor (`ISSUE_OPS_PER_TENSOR`): a gradient bucket puts each gradient into
its flat buffer before the call and, all-reduced, views each result out once waited; a ZeRO-1/2
bucket is reduce-scattered and its parameters gathered in place, whole (ZeRO-2's hooks copy each
gradient into its bucket as autograd makes it); ZeRO-3 flattens a unit's gradients before their
reduce-scatter and views a gathered unit into its parameters. An activation collective of tp, sp,
cp or ep dispatches a handful of operators on each side (`activation_ops`: a copy or a
concatenation before, slices and views after), and a few more for each partial gradient of a
replicated norm or router it sums (`partial_gradients`). What the thread does before
the call joins the compute instruction before the collective in program order, what it does once
waited the compute instruction after it.
`scripts/issue_cost.py` times both sides per kind of collective in real steps, beside the model.

**How the cores are shared** is `simexec.sim.host.cores`: processor sharing with a wait for a woken
thread (`Cores`, the default), or whole slices in turn (`SlicedCores`).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Optional

from simexec.specs.cluster import ClusterSpec
from simexec.program.instructions import Instr, Program
from simexec.sim.host.cores import Cores
from simexec.sim.host.issue import ISSUE_OPS_PER_TENSOR, activation_ops, is_activation_collective, partial_gradients, tensor_passes

ADAM_FUSED_OPS = 2  # _foreach_add_ on the step counts, _fused_adam_ (simexec.exec.nn.optim.Adam)
ADAM_OPS_PER_16BIT_TENSOR = 2  # the gradient's fp32 copy, the master's rounded copy into the parameter
# elements of 16-bit gradients the executor's Adam casts and updates per fused call: small on a CPU
# rank (its memory is what the peak measures), large on an accelerator (each call is a kernel launch)
ADAM_PIECE = {"cpu": 1 << 14, "accelerator": 1 << 24}
ADAM_FLOPS_PER_PARAM = 12.0
FLOP_BOUND = ("gemm", "attention")
# The share of a collective step's bytes that gloo's TCP event loop copies: every read (a pair's
# `handleReadWrite` reads on the loop thread), the sends being written by the calling thread when the
# receiver was ready first (`Pair::send` -> `sendUnboundBuffer`). Each member sends and receives one
# chunk a step, so half of the step's bytes.
LOOP_SHARE_OF_BYTES = 0.5
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
    about what an operator's dispatch does (`scripts/adam_passes.py`: 4.5-5.4 µs a tensor in a warm
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
        "fwd.router": 18, "bwd.router": 28,
    },
}
# Every table counts fp32. Under 16-bit types the executor's RMSNorm (`simexec.exec.nn.gpt._RMSNorm`)
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


def dispatch_key(model) -> str:
    """The features of a model that set how many operators the executor's blocks dispatch."""
    parts = [model.norm, "swiglu" if model.gated else "mlp", "pos" if model.learned_pos else "rope"]
    if model.bias:
        parts.append("bias")
    if model.kv_heads != model.heads and not model.is_mla:
        parts.append("gqa")
    if model.qk_norm:
        parts.append("qknorm")
    if model.is_mla:
        parts.append("mla-qlora" if model.q_lora_rank else "mla")
    if model.moe is not None:
        parts.append(f"moe{model.moe.experts}x{model.moe.top_k}+{model.moe.shared_experts}")
    return "-".join(parts)


def cost_family(model) -> str:
    """The kernels a model's blocks run (norm, MLP, positions, MoE), without its sizes: element-wise
    costs measured on one model of a family (`elementwise_cost["<family>/<phase>.<block>"]`) price
    every model of it."""
    key = _strip_adders(dispatch_key(model))[0]
    dense, _, moe = key.partition("-moe")
    return dense + ("-moe" if moe else "")


def dispatch_table(key: str, ep: int = 1, cp: int = 1, cp_impl: str = "allgather",
                   dtype: str = "fp32", sp: bool = False, flash: bool = True) -> dict[str, int]:
    """Operators per `<phase>.<block>` for a `dispatch_key` (features without a table of their own
    borrow the default's), MoE loops for the experts a rank of expert parallelism `ep` holds, the
    attention block of context parallelism `cp` in `dtype`, fused (`flash`) or not, the blocks of
    sequence parallelism."""
    key, adders = _strip_adders(key)
    dense, _, moe = key.partition("-moe")
    table = dict(DISPATCH.get(key if not moe else dense, DISPATCH[DEFAULT_TABLE]))
    if moe:
        table.update(DISPATCH.get(dense + "-moe", DISPATCH["rmsnorm-swiglu-rope-moe"]))
    if sp:
        table.update(SP_OPS.get(dense, SP_OPS[DEFAULT_TABLE]))
    if moe:
        experts, shared = _moe_counts(moe)
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


def _moe_counts(moe: str) -> tuple[int, int]:
    """(routed experts, shared experts) of a dispatch key's MoE part (`4x2+1`: 4 experts, top 2, 1 shared)."""
    return int(moe.split("x")[0]), int(moe.split("+")[1])


def _strip_adders(key: str) -> tuple[str, set[str]]:
    """A dispatch key without the features that add operators to any table (grouped heads, qk norms,
    MLA), and those features."""
    adders = set()
    for feature in ("mla-qlora", "mla", "qknorm", "gqa"):
        if f"-{feature}" in key:
            adders.add(feature)
            key = key.replace(f"-{feature}", "")
    return key, adders


# Operators that wait for the device: the executor's MoE forward reads the per-expert token counts
# with `tolist()` to split its tokens, so the host stops issuing until the device has caught up.
HOST_SYNC_BLOCKS = ("experts",)


def exchanges_counts(ins: Instr) -> bool:
    """Whether a collective is a forward MoE dispatch, which the executor (like Megatron-LM's
    all-to-all token dispatcher) runs as two all-to-alls: each rank's per-expert token counts first
    (small, and the host waits for them: they size the receive buffers), then the tokens."""
    return ins.kind == "collective" and ins.block == "dispatch" and ins.phase != "bwd"


def forwards_without_grad(names: Iterable[str]) -> frozenset:
    """Of a rank's instruction names, the forwards the executor runs without autograd (no graph
    recorded, nothing saved): those a `recompute.*` instruction repeats later."""
    return frozenset("fwd." + n[len("recompute."):] for n in names if n.startswith("recompute."))


def shares_cores(cluster: ClusterSpec) -> bool:
    """Whether the cluster's ranks are CPU processes sharing the host's cores (simexec.sim.host.model)."""
    return bool(getattr(cluster.costs, "cores_shared", False))


def host_model(machine, program: Program) -> Optional["HostCosts"]:
    """The engine's hook: a HostCosts for a cluster whose ranks share cores, else None."""
    cluster = machine.cluster
    if not shares_cores(cluster):
        return None
    return HostCosts(cluster, program, getattr(machine, "dtype", None))


def dispatch_clock(machine, program: Program) -> Optional[tuple[list[float], list[bool]]]:
    """The engine's hook for an accelerator driven by an eager host (`costs.host_dispatch_s` > 0):
    per instruction of the program (flattened in rank order), the host thread's seconds to issue it
    (`instr_overhead_s` + operators x `host_dispatch_s` (+ `bwd_overhead_s`)) and whether it waits
    for the device first. The device runs an instruction no earlier than the host has issued it,
    and ends it no earlier than the host has issued its last operator; the host runs ahead
    otherwise, so small kernels leave the device idle (launch-bound) and large ones hide the host.
    None where the host keeps ahead (the default) or the ranks share the host's cores (HostCosts)."""
    cluster = machine.cluster
    if shares_cores(cluster) or getattr(cluster.costs, "host_dispatch_s", 0.0) <= 0:
        return None
    hc = HostCosts(cluster, program, getattr(machine, "dtype", None))
    per_op, c = cluster.costs.host_dispatch_s, cluster.costs
    issue, sync = [], []
    for rank in sorted(program.ranks):
        for ins in program.ranks[rank]:
            if ins.kind != "compute" or ins.stream == "host" or ins.op == "cpu_optimizer":
                issue.append(0.0)
                sync.append(False)
                continue
            t = c.instr_overhead_s + hc.ops(ins) * per_op + c.bwd_overhead_s * hc.engine_calls(ins)
            issue.append(t)
            sync.append(ins.block in HOST_SYNC_BLOCKS and ins.phase != "bwd")
    return issue, sync


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
# tp_overlap splits only the column-parallel blocks' backwards (`simexec.program.lower`, `column_backward`)
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
    family, adders = _strip_adders(key)
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
        shared = _moe_counts(moe)[1]
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


def grad_tensors(block: str, model, sp: bool, tp: int = 1, ep: int = 1) -> int:
    """Parameter tensors whose gradient a block's backward makes and the main-gradient hook moves
    (`simexec.exec.nn.gpt.param_specs`): a block's own norm unless sp gives the norm a block of its
    own; under tp > 1 not those replicated over tp with partial gradients (norms, the router, MLA's
    down projections), which the tensor-parallel collective sums instead."""
    if model is None:
        return 0
    embed, _, _, ffn = unit_tensors(model)
    norm = 2 if model.norm == "layernorm" else 1
    bias = 1 if model.bias else 0
    whole = tp == 1  # tensors replicated over tp with partial gradients are hooked only without tp
    own_norm = norm if whole and not sp else 0
    up = ffn - 1 - bias  # the up (and gate) projections; the down one is fc2's
    if block in SP_NORM_BLOCKS:
        return norm if whole else 0
    if block == "embed":
        return embed
    if block == "qkv":
        n = own_norm + (3 if model.bias or getattr(model, "qkv_bias", False) else 0)
        n += 2 * norm if model.qk_norm and whole else 0
        if getattr(model, "is_mla", False):  # wq (or wq_b) and wkv_b; wq_a, q_a_norm, wkv_a, kv_a_norm
            down = (1 + norm if model.q_lora_rank else 0) + 1 + norm
            return n + 2 + (down if whole else 0)
        return n + 3
    if block in ("proj", "fc2"):
        return 1 + bias
    if block == "fc1":
        return own_norm + up
    if block == "router":
        return own_norm + (1 if whole else 0)
    if block == "experts":
        return ffn * math.ceil(model.moe.experts / max(1, ep))
    if block == "moe_out":
        return ffn * model.moe.shared_experts
    if block == "head":
        return own_norm + 1
    return 0


def ops_of(ins: Instr, table: dict[str, int]) -> int:
    """Aten operators a compute instruction dispatches (recompute runs the forward's)."""
    phase = "fwd" if ins.phase == "recompute" else ins.phase
    return table.get(f"{phase}.{ins.block}", table.get(f"fwd.{ins.block}", DEFAULT_OPS))


# --- parameters tensors, for the optimizer's per-tensor cost ------------------------------------------
def unit_tensors(model) -> tuple[int, int, int, int]:
    """Parameter tensors of (the embedding, a dense layer, the head, one MoE expert's FFN) in the
    executor's layout (simexec.exec.nn.gpt.param_specs)."""
    norm = 2 if model.norm == "layernorm" else 1
    ffn = (2 if model.gated else 1) * (2 if model.bias else 1) + (2 if model.bias else 1)
    qkv_bias = 3 if (model.bias or getattr(model, "qkv_bias", False)) else 0
    attn = 3 + qkv_bias + 1 + (1 if model.bias else 0)
    if getattr(model, "is_mla", False):  # q (or its latent, norm and up projection), kv's three, o
        attn += (1 + norm if model.q_lora_rank else 0) + norm
    embed = 1 + (1 if model.learned_pos else 0)
    return embed, 2 * norm + attn + ffn, norm + 1, ffn


def optimizer_tensors(program: Program, rank: int, model) -> int:
    """Tensors the rank's Adam step updates: flat buckets (ZeRO 1-2), gathered units (ZeRO 3), else
    every parameter tensor of the units (embedding, layers, head) the rank holds."""
    instrs = program.ranks[rank]
    buckets = {i.block for i in instrs if i.kind == "collective" and i.block.startswith("params")}
    units = {(i.axis, i.layer) for i in instrs if i.kind == "collective" and i.block == "gather"}
    if buckets or units:
        return len(buckets) + len(units)
    if model is None:
        return 1
    blocks = {i.block for i in instrs if i.kind == "compute"}
    layers = {i.layer for i in instrs if i.kind == "compute" and 0 <= i.layer < model.layers}
    units = layers | ({-1} if "embed" in blocks else set()) | ({model.layers} if "head" in blocks else set())
    ep = _plan_ep(program) if getattr(model, "moe", None) is not None else 1
    return max(1, sum(unit_tensor_count(model, u, ep) for u in units))


def unit_tensor_count(model, unit: int, ep: int = 1, part: str = "all") -> int:
    """Parameter tensors a rank holds of one unit (-1 the embedding, `model.layers` the head, else a
    layer): its `part` "dense", "expert" (a MoE layer's routed experts, this rank's share of ep) or
    "all"."""
    embed, layer, head, expert = unit_tensors(model)
    moe = getattr(model, "moe", None)
    if unit < 0 or unit >= model.layers or moe is None or not model.is_moe_layer(unit):
        dense = embed if unit < 0 else head if unit >= model.layers else layer
        return 0 if part == "expert" else dense
    routed = math.ceil(moe.experts / ep) * expert
    dense = layer - expert + 1 + moe.shared_experts * expert  # the router and the shared experts
    return {"dense": dense, "expert": routed}.get(part, dense + routed)


# --- what an instruction costs ------------------------------------------------------------------------
class HostCosts:
    """CPU-seconds of an instruction on one core of the host, and the cores' scheduler for a run."""

    def __init__(self, cluster: ClusterSpec, program: Program, dtype: Optional[str] = None):
        c, d, node = cluster.costs, cluster.device, cluster.node
        self.cluster = cluster
        self.program = program
        plan = _plan_of(program)
        dtype = dtype or (plan.dtype if plan is not None else "bf16")
        self.dtype = dtype
        self.peak = d.peak_flops.get(dtype) or d.peak_flops.get("fp32") or max(d.peak_flops.values())
        self.eff = {"gemm": (c.gemm_eff, c.gemm_half_flops), "attention": (c.attention_eff, c.attention_half_flops)}
        self.mem_bw = d.memory_bw * c.memory_eff
        self.copy_bw = node.host_link_bw * c.host_link_eff
        self.op_s = d.launch_overhead_s
        self.instr_s = getattr(c, "instr_overhead_s", 0.0)
        self.issue_s = getattr(c, "collective_issue_s", 0.0)
        self.bwd_s = getattr(c, "bwd_overhead_s", 0.0)
        self.cores = node.cpu_cores
        self.slice_s = getattr(c, "sched_slice_s", 0.0)
        self.background = getattr(c, "background_load", 0.0)
        self.contention = c.compute_contention  # slowdown of a thread when every core is busy
        self.model = _model_of(program)
        key = program.meta.get("dispatch") or (dispatch_key(self.model) if self.model is not None else DEFAULT_TABLE)
        self.table = dispatch_table(key, max(1, plan.ep), plan.cp, plan.cp_impl, dtype, plan.sp,
                                    plan.flash_attention) if plan is not None else dispatch_table(key, dtype=dtype)
        split = plan is not None and plan.pipeline_schedule.splits_backward
        if split:
            self.table = split_backward_table(self.table, key.split("/")[0], dtype=dtype)
        elif plan is not None and plan.tp_overlap:
            self.table = split_backward_table(self.table, key.split("/")[0], COLUMN_BLOCKS, sp=plan.sp, dtype=dtype)
        self.master_grads = bool(plan.master_grads) if plan is not None else False
        # main gradients: which phase makes the weight gradients, and each block's count of them
        self.main_grads = plan is not None and bool(plan.grad_fp32) and dtype != "fp32"
        self.grads_phase = "wgrad" if split else "bwd"
        self.wgrad_blocks = COLUMN_BLOCKS if plan is not None and plan.tp_overlap else ()
        self._grad_tensors: dict[str, int] = {}
        self._grad_args = (bool(plan.sp), plan.tp, max(1, plan.ep)) if plan is not None else (False, 1, 1)
        # layers whose attention masks a sliding window's band (`simexec.program.lower.windowed_layers`)
        self.windowed = frozenset(program.meta.get("windowed_layers", ()))
        self.window_ops = 0
        if plan is not None:
            self.window_ops = WINDOW_OPS["cp" if plan.cp > 1 else "fused" if plan.flash_attention else "unfused"]
        self.zero = plan.zero if plan is not None else 0
        self.zero3 = plan.zero3 if plan is not None else None
        self.sp = bool(plan.sp) if plan is not None else False
        self.step_ops = 0  # what loss scaling and clipping add to the step
        if plan is not None:
            self.step_ops = (OVERFLOW_CHECK_OPS if plan.loss_scale > 0 else 0) + (CLIP_SCALE_OPS if plan.clip_grad > 0 else 0)
        self.elementwise = dict(getattr(c, "elementwise_cost", None) or {})
        self.family = cost_family(self.model) if self.model is not None else ""
        self._tensors: dict[int, int] = {}
        self.nograd = getattr(c, "nograd_fwd_ratio", 1.0)
        self._nograd_names: dict[int, frozenset] = {}

    @classmethod
    def transfers_only(cls, cluster: ClusterSpec) -> "HostCosts":
        """Just the communication half (`transfer`), for pricing single collectives without a program."""
        hc = cls.__new__(cls)
        hc.cluster, hc.op_s = cluster, cluster.device.launch_overhead_s
        hc.issue_s = getattr(cluster.costs, "collective_issue_s", 0.0)
        return hc

    def efficiency(self, op: str, flops: float) -> float:
        max_eff, half = self.eff.get(op, self.eff["gemm"])
        return max_eff * flops / (flops + half)

    def roofline(self, op: str, flops: float, nbytes: float) -> float:
        """Seconds of the arithmetic and memory traffic on one core (the two add: small CPU kernels
        do not overlap them)."""
        t = nbytes / self.mem_bw if nbytes > 0 else 0.0
        if op in FLOP_BOUND and flops > 0:
            t += flops / (self.peak * self.efficiency(op, flops))
        return t

    def tensors(self, rank: int) -> int:
        n = self._tensors.get(rank)
        if n is None:
            n = self._tensors[rank] = optimizer_tensors(self.program, rank, self.model)
        return n

    def _adam(self, ins: Instr) -> Optional[tuple[bool, float, bool]]:
        """For an Adam step (on the device or the host's): (run by the host, its elements, the fp32
        gradient copy); None for any other instruction."""
        if not (ins.op in ("optimizer", "cpu_optimizer") or ins.block in ("optim", "cpu_optim")):
            return None
        host = ins.op == "cpu_optimizer" or ins.block == "cpu_optim"  # its FLOPs are its elements
        return host, ins.flops if host else ins.flops / ADAM_FLOPS_PER_PARAM, self.master_grads and not host

    def ops(self, ins: Instr) -> int:
        """Aten operators of one instruction (compute, host optimizer or offload copy)."""
        if ins.kind == "copy":
            return self.tensors(ins.rank)  # one copy_ per tensor
        adam = self._adam(ins)
        if adam is not None:
            host, elements, master = adam
            piece = ADAM_PIECE["cpu" if host or self.cluster.device.name == "cpu" else "accelerator"]
            return adam_ops(self.tensors(ins.rank), self.dtype, elements, master, piece) + self.step_ops
        if ins.block in ("unscale", "grad_norm"):
            return UNSCALE_OPS if ins.block == "unscale" else GRAD_NORM_OPS
        n = ops_of(ins, self.table)
        if ins.block == "attn" and ins.phase != "bwd" and ins.layer in self.windowed:
            n += self.window_ops
        if self.main_grads and ins.phase == ("wgrad" if ins.block in self.wgrad_blocks else self.grads_phase):
            k = self._grad_tensors.get(ins.block)
            if k is None:
                k = self._grad_tensors[ins.block] = grad_tensors(ins.block, self.model, *self._grad_args)
            n += MAIN_GRAD_OPS * k
        return n

    def engine_calls(self, ins: Instr) -> int:
        """Calls into the autograd engine: one per backward instruction, one per batch of a weight pass."""
        if ins.phase == "bwd":
            return 1
        return weight_pass_calls(ins.block, self.model, self.sp) if ins.phase == "wgrad" else 0

    def kernel_passes(self, ins: Instr) -> int:
        """Per-tensor passes of an Adam step run on a CPU core (`adam_kernel_passes`), priced as
        operators; none for other instructions, nor for an accelerator's Adam (one fused launch per
        chunk of tensors)."""
        adam = self._adam(ins)
        if adam is None or not (adam[0] or self.cluster.device.name == "cpu"):
            return 0
        _, elements, master = adam
        return adam_kernel_passes(self.tensors(ins.rank), self.dtype, elements, master)

    def cpu_seconds(self, ins: Instr) -> float:
        """CPU-seconds of a compute, copy or host-optimizer instruction on one idle core."""
        t = self.instr_s + (self.ops(ins) + self.kernel_passes(ins)) * self.op_s
        if ins.kind == "copy":
            return t + (ins.bytes / self.copy_bw if ins.bytes > 0 else 0.0)
        t += self.bwd_s * self.engine_calls(ins)
        op = "optimizer" if ins.op == "cpu_optimizer" else ins.op
        t += self.roofline(op, ins.flops, ins.bytes * self.elementwise_factor(ins))
        if self.nograd != 1.0 and ins.phase == "fwd" and ins.name in self.without_grad(ins.rank):
            t *= self.nograd
        return t

    def issue_seconds(self, ins: Instr) -> float:
        """CPU-seconds the rank's own thread spends on a collective or message, apart from the
        transfer: both sides of `issue_split`."""
        return sum(self.issue_split(ins))

    def issue_split(self, ins: Instr) -> tuple[float, float]:
        """(before the call, once waited): CPU-seconds of the rank's thread around a collective or
        message. Before: the interpreter's Python (`instr_overhead_s`), a collective's call
        (`collective_issue_s`: torch.distributed's Python and the backend's work queued, which
        `transfer` takes out of the call's latency) and the operators that prepare its tensors:
        for a collective that carries parameter units the passes over their tensors that
        `tensor_passes` counts, at `ISSUE_OPS_PER_TENSOR` operators a tensor; for an activation
        collective those of `activation_ops`. Once waited, a collective's Python again (the wait, its
        result recorded: `scripts/issue_cost.py`'s `finish`) and the operators that put the result in
        place."""
        call = self.issue_s if ins.kind == "collective" else 0.0
        if is_activation_collective(ins):
            partial = partial_gradients(self.model, ins, self.sp)
            before, after = activation_ops(ins, partial)
            return self.instr_s + call + before * self.op_s, self.instr_s + after * self.op_s
        before, after = tensor_passes(ins, self.zero, self.zero3)
        per_pass = 0.0
        if (before or after) and self.model is not None:
            part = "expert" if ins.axis == "edp" else "dense"
            ep = _plan_ep(self.program) if part == "expert" else 1
            tensors = sum(unit_tensor_count(self.model, u, ep, part) for u in ins.items)
            per_pass = ISSUE_OPS_PER_TENSOR * tensors * self.op_s
        waited = self.instr_s if ins.kind == "collective" else 0.0
        return self.instr_s + call + before * per_pass, waited + after * per_pass

    def without_grad(self, rank: int) -> frozenset:
        """The forward instructions of this rank that run without autograd: those a `recompute.*`
        instruction repeats later (full recompute's layers, selective recompute's attention)."""
        names = self._nograd_names.get(rank)
        if names is None:
            names = self._nograd_names[rank] = forwards_without_grad(i.name for i in self.program.ranks.get(rank, ()))
        return names

    def cost_block(self, ins: Instr) -> str:
        """The block whose measured element-wise cost prices `ins`: a norm split out under sp keeps
        that of the block it opens without sp (the block fits measure the norm inside it)."""
        if ins.block == "cpu_optim":
            return "optim"  # the same fused Adam kernel on a core of the same host
        if ins.block == "norm1":
            return "qkv"
        if ins.block == "norm2":
            moe = self.model is not None and self.model.is_moe_layer(ins.layer)
            return "router" if moe else "fc1"
        return "head" if ins.block == "norm" else ins.block

    def elementwise_factor(self, ins: Instr) -> float:
        """Cost of a byte of this instruction's element-wise traffic relative to a streaming add."""
        if not self.elementwise or ins.kind != "compute":
            return 1.0
        key = f"{'fwd' if ins.phase == 'recompute' else ins.phase}.{self.cost_block(ins)}"
        own = self.elementwise.get(f"{self.family}/{key}")  # measured on this model's family
        return own if own is not None else self.elementwise.get(key, 1.0)

    # --- communication over loopback: steps whose members each need a core -----------------------
    @staticmethod
    def comm_steps(ins: Instr) -> tuple[int, float]:
        """(steps, bytes each member moves per step) of a collective or message with gloo's algorithms:
        ring all-reduce 2(n-1) steps of S/n; all-gather n-1 of S/n; all-to-all one step of (n-1)S/n
        (gloo posts every send and receive at once, then waits for them all); reduce-scatter as an
        all-reduce (gloo reduces the whole tensor, then keeps its slice); broadcast a tree of
        ceil(log2 n) steps of S; send/recv one step of S."""
        S = float(ins.bytes)
        if ins.kind in ("send", "recv"):
            return 1, S
        n = max(1, len(ins.group))
        if n <= 1:
            return 0, 0.0
        verb = ins.collective
        if verb in ("allreduce", "reducescatter"):
            return 2 * (n - 1), S / n
        if verb == "alltoall":
            return 1, (n - 1) * S / n
        if verb == "allgather":
            return n - 1, S / n
        if verb == "broadcast":
            return max(1, math.ceil(math.log2(n))), S
        return n - 1, S / n

    def comm_seconds(self, steps: int, chunk: float) -> tuple[float, float, float]:
        """(call latency, CPU per step per member, latency per step) on an idle host. A step costs each
        member CPU: `comm_cpu_s` for handing the message between gloo's threads and the kernel (each
        hand-off a thread wake-up and syscalls, dear on a VM: `scripts/comm_cpu.py` measures it),
        and its bytes at `intra_bw` (x `intra_bw_eff`) bytes per second of a core, since loopback TCP
        copies them through the kernel. Only its latency is free."""
        c, node = self.cluster.costs, self.cluster.node
        return c.collective_latency_s, (c.comm_cpu_s or self.op_s) + self._copy_seconds(chunk), node.intra_latency_s

    def _copy_seconds(self, chunk: float) -> float:
        """A core's time to copy a step's bytes through loopback TCP (`intra_bw` x `intra_bw_eff`)."""
        return chunk / (self.cluster.node.intra_bw * self.cluster.costs.intra_bw_eff) if chunk > 0 else 0.0

    def loop_seconds(self, chunk: float) -> float:
        """The part of a step's burst that gloo's event loop copies, where the loops run at `SCHED_IDLE`
        (`costs.gloo_loops_idle`); else 0 (the loop's work is the burst's like the rest)."""
        return LOOP_SHARE_OF_BYTES * self._copy_seconds(chunk) if self.cluster.costs.gloo_loops_idle else 0.0

    def transfer(self, env, cores: "Cores", ins: Instr, ranks, done: Callable[[], None]) -> None:
        """Run a collective / message on the host: the call's latency, then per step every member's
        communication thread needs `burst` of CPU (waiting for a core if none is free) and the data
        `wire` seconds on the loopback, two steps on the wire at most (gloo's rings send the next
        piece while the previous two are in flight: `gloo/allreduce.cc`, `gloo/allgather.cc`), so
        a step's latency overlaps the next one's CPU; `done()` when the last step is over. Where gloo's
        event loops run at `SCHED_IDLE`, the part of the burst they copy (`loop_seconds`) runs after
        the rest on the cores the other threads leave idle. A forward MoE dispatch is two all-to-alls,
        the token counts' first (`exchanges_counts`)."""
        steps, chunk = self.comm_steps(ins)
        call, burst, wire = self.comm_seconds(steps, chunk)
        if ins.kind == "collective":  # the calling thread's share of the call it has paid (`issue_split`)
            call = max(0.0, call - self.issue_s)
        loop = self.loop_seconds(chunk)
        calls = [(steps, call, burst - loop, wire, loop)]
        if exchanges_counts(ins):
            calls.insert(0, (steps, *self.comm_seconds(steps, 0.0), 0.0))
        members = tuple(ranks) or (ins.rank,)
        env.process(self._comm(env, cores, members, calls, done))

    @staticmethod
    def _comm(env, cores, members, calls, done):
        for steps, call, burst, wire, loop in calls:
            if call > 0:
                yield env.timeout(call)
            flying = []
            for _ in range(steps):
                if len(flying) >= 2:
                    yield flying.pop(0)
                yield env.all_of([cores.run((r, "comm"), burst) for r in members])
                if loop > 0:
                    yield env.all_of([cores.run((r, "loop"), loop) for r in members])
                if wire > 0:
                    flying.append(env.timeout(wire))
            for w in flying:
                yield w
        done()

    def cores_for(self, env) -> "Cores":
        weights = {r: len(v) for r, v in (self.program.represents or {}).items() if len(v) > 1}
        return Cores.of(env, self.cluster, weights)


def _plan_of(program: Program):
    """The plan the program was lowered from (its string in the program's meta), or None."""
    from simexec.errors import SimexecError
    from simexec.specs.plan import parse_plan

    try:
        return parse_plan(str(program.meta.get("plan", "")))
    except SimexecError:
        return None


def _plan_ep(program: Program) -> int:
    plan = _plan_of(program)
    return max(1, plan.ep) if plan is not None else 1


def _model_of(program: Program):
    """The program's model spec, when its name is a preset (the optimizer's tensor count needs it)."""
    try:
        from simexec.specs.model import get_model

        return get_model(str(program.meta.get("model", "")))
    except Exception:  # noqa: BLE001 - a model file: fall back to counting what the program shows
        return None
