"""What the executor's rank thread does around a collective, besides the transfer: the tensors it
prepares before the call and puts in place once the result is waited for, counted in aten operators
(`simexec.sim.host.model.HostCosts.issue_split` prices each at the device's launch overhead).

Two kinds of collective differ in what they handle:
- a collective of parameter units (gradient buckets, ZeRO's gathers and reduce-scatters) makes
  passes over the units' tensors one tensor at a time (`tensor_passes`);
- an activation collective of tensor, sequence or context parallelism, or MoE's all-to-all, handles
  one activation (`activation_ops`), and in the backward of a tensor-parallel block's input it also
  sums the partial gradients of the parameters replicated over tp: the norms and the router
  (`partial_gradients`).
"""
from __future__ import annotations

from typing import Optional

from simexec.program.instructions import Instr
from simexec.specs.zero3_flavours import Zero3Flavour

ISSUE_OPS_PER_TENSOR = 2  # a side of a parameter unit's collective, per tensor: a view and the Python around it

# Operators the interpreter dispatches around an activation collective (`simexec.exec.rank.interpreter.
# activation_collective`, `alltoall`, `norm_grads`), its own c10d operator aside (the call, priced as
# `collective_issue_s`): (before the call, once waited), per verb, read forward. Counted with a TorchDispatchMode
# (`scripts/probe_host.py collective-ops`) on gpt-tiny and moe-tiny at tp 2 and 4 with and without sp, cp 2 and
# ep 2; the counts do not depend on sizes.
# - all-reduce: the input detached and copied out (clone), then a slice and a view of the result;
# - reduce-scatter: the input's dimension moved first and each member's chunk flattened and joined
#   (two operators a member), an output allocated; the result viewed back;
# - all-gather: an output allocated beside the moved input; the result's dimension moved back;
# - all-to-all: the input made contiguous, an output allocated; nothing once waited.
ACTIVATION_OPS = {
    "allreduce": (3, 3),
    "reducescatter": (11, 4),
    "allgather": (4, 1),
    "alltoall": (2, 0),
}
REDUCESCATTER_OPS_PER_MEMBER = 2
BACKWARD_READ_OPS = -1  # a gradient is taken, not read and detached: one operator fewer (not all-to-all's)
CP_KV_OPS = 1  # context parallelism's K/V all-gather stacks the two first
# cp_impl=a2a's exchanges (`simexec.exec.rank.heads_exchange`), counted on gpt-tiny at cp=2 (block, backward):
# q and k/v (or the output) laid out for the call (split, permuted, made contiguous, joined) and, once
# waited, sliced, laid out again and put in sequence order (heads_in forward) or the heads joined
HEADS_EXCHANGE_OPS = {("heads_in", False): (12, 12), ("heads_out", False): (6, 5),
                      ("heads_out", True): (6, 5), ("heads_in", True): (14, 10)}
DISPATCH_COUNTS_OPS = 5  # MoE's forward dispatch first exchanges per-expert counts (`exchanges_counts`)
# A partial gradient summed with an activation's: flattened before the call (and the activation with
# it, once, replacing the all-reduce's copy); once waited, sliced, viewed, copied out and, after the
# first micro-batch, added to what the earlier ones left.
PARTIAL_BEFORE_OPS = 1
PARTIAL_AFTER_OPS = 3
NORM_GRADS_OPS = 1  # sp's all-reduce of the norms' partial gradients alone: their concatenation

ACTIVATION_AXES = ("tp", "cp", "ep", "etp")
PIPELINE_GATHERS = ("act_gather", "grad_gather")  # a pipeline message's slices, re-joined over tp


def tensor_passes(ins: Instr, zero: int = 0, zero3: Optional[Zero3Flavour] = None) -> tuple[int, int]:
    """Passes the interpreter makes over a collective's parameter tensors one tensor at a time,
    (before its call, once waited), as `simexec.exec.rank.sharding` handles each kind under ZeRO stage
    `zero` and ZeRO-3 flavour `zero3`:
    - a gradient bucket (`grads<k>`) moves each gradient into its flat buffer, and all-reduced
      (ZeRO-0) views each result out; ZeRO-1 reduce-scatters in place into the rank's slice, in one
      piece; under ZeRO-2 a hook has also copied each gradient into the bucket as autograd made it
      (a pass per micro-batch, as many as the bucket's reduce-scatters);
    - ZeRO-1/2 gather the parameters in place (`params<k>`) and HSDP all-reduces a flat shard
      (`grads_rep`): nothing per tensor;
    - ZeRO-3 flattens a unit's gradients before their reduce-scatter (`grads`) and views its
      gathered parameters out (`gather`); for the backward a flavour with preallocated buffers
      (YaFSDP) also views the unit's gradients into its gradient buffer. (FSDP's release after a
      unit's last use points each parameter at one empty tensor, no view: a tenth of a pass or
      less, `scripts/probe_host.py tensor-passes`.)"""
    if ins.kind != "collective" or not ins.items:
        return 0, 0
    block = ins.block
    if block.startswith("grads") and block[5:].isdigit():
        if ins.collective == "allreduce":
            return 1, 1
        return (2 if zero == 2 else 1), 0
    if block == "grads":
        return 1, 0
    if block == "gather":
        return 0, (2 if zero3 is not None and zero3.preallocated_buffers and ins.phase == "bwd" else 1)
    return 0, 0


def is_activation_collective(ins: Instr) -> bool:
    return ins.kind == "collective" and ins.axis in ACTIVATION_AXES and ins.block not in PIPELINE_GATHERS


def partial_gradients(model, ins: Instr, sp: bool) -> int:
    """Tensors of partial gradients a backward tp collective sums with its activation (the
    executor's `ParamSpec.tp_partial`): a layer's first norm with its attention input, its second
    norm (and a MoE layer's router) with its MLP input, the final norm with the head's input. Under
    sp the norms' backward follows the reduce-scatter after them: the second norm rides the
    attention input's, and the first and final norms get an all-reduce of their own (`norm_grads`)."""
    if model is None or ins.phase != "bwd" or len(ins.group) < 2:
        return 0
    norm = 2 if model.norm == "layernorm" else 1
    moe = getattr(model, "moe", None) is not None and 0 <= ins.layer < model.layers and model.is_moe_layer(ins.layer)
    router = 1 if moe else 0
    carried = {"attn_in": norm, "mlp_in": router, "norm_grads": norm} if sp else \
        {"attn_in": norm, "mlp_in": norm + router, "head_in": norm}
    return carried.get(ins.block, 0)


def activation_ops(ins: Instr, partial: int = 0) -> tuple[int, int]:
    """(before the call, once waited): operators an activation collective dispatches besides its own,
    with `partial` tensors of partial gradients summed with it (`partial_gradients`)."""
    after_partial = partial * (PARTIAL_AFTER_OPS + (1 if ins.mb > 0 else 0))
    if ins.block == "norm_grads":
        return NORM_GRADS_OPS + PARTIAL_BEFORE_OPS * partial, after_partial
    exchange = HEADS_EXCHANGE_OPS.get((ins.block, ins.phase == "bwd"))
    if exchange is not None:
        return exchange
    verb = ins.collective
    before, after = ACTIVATION_OPS.get(verb, (0, 0))
    if ins.phase == "bwd" and verb != "alltoall" and not ins.block.endswith("_regather"):
        before += BACKWARD_READ_OPS
    if verb == "reducescatter":
        before += REDUCESCATTER_OPS_PER_MEMBER * len(ins.group)
    if verb == "allreduce" and partial:
        before += 1  # the activation flattened for the concatenation, in place of its copy: one more
    if ins.block == "kv" and verb == "allgather":
        before += CP_KV_OPS
    if ins.block == "dispatch" and ins.phase != "bwd":
        before += DISPATCH_COUNTS_OPS
    return before + PARTIAL_BEFORE_OPS * partial, after + after_partial
