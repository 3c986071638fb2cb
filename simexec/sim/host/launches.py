"""The host thread of a GPU rank issuing its framework's kernels (`StackSpec.host`, docs/stacks.md §2).

Eager PyTorch issues every kernel from the host: Python, the dispatcher and autograd, then the
driver's launch. The device runs a kernel no earlier than the host has issued it, so a rank whose
kernels are shorter than their issue (small layers, short sequences, many small experts) waits on
its host. The stack says how many operators each half of a layer launches (`HostLaunches`), and
which scopes run as CUDA graphs (one launch each); `launch_clock` turns that into the engine's issue
clock (`simexec.sim.engine.Engine`, `issue` and `host_sync`): per compute instruction, the host
seconds to issue it, the layer's operators shared among the instructions of the same half, phase
and micro-batch. A forward MoE dispatch whose token counts the host reads (Megatron-Core's
all-to-all dispatcher, `moe_dispatch_syncs`) makes the host wait for the device there.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

from simexec.program.instructions import Program, exchanges_counts
from simexec.specs.stack import HostLaunches

MLP_BLOCKS = frozenset({"fc1", "fc2", "norm2"})
MOE_BLOCKS = frozenset({"router", "experts", "moe_out", "shared", "shared_fc1", "shared_fc2"})
# A layer's outside: embedding, the LM head, the loss, the final norm. One forward launch each,
# two backward (a GEMM's input and weight gradients), so that a layer-free instruction is not free.
OUTSIDE_OPS = (1, 2)


def _half(block: str) -> str:
    if block in MOE_BLOCKS or block.startswith("moe") or block.startswith("shared"):
        return "moe"
    return "mlp" if block in MLP_BLOCKS else "attn"


def launch_clock(program: Program) -> Optional[tuple[list[float], list[bool]]]:
    """Per instruction of the program (flattened in rank order), the host seconds to issue it and
    whether the host waits for the device before it; None where the stack has no host model."""
    rp = program.resolved
    host: Optional[HostLaunches] = rp.stack.host if rp is not None else None
    if host is None:
        return None
    plan = rp.plan
    graphed = set(host.cuda_graphs)
    syncs = host.moe_dispatch_syncs and plan.moe_dispatcher == "alltoall"
    if "full" in graphed and syncs and rp.model.moe is not None:
        graphed.discard("full")  # a capture cannot hold a host wait: the layers stay as the other scopes say
    launch = host.launch_s
    per_op = (host.launch_s, host.launch_s) if host.compiled else host.op_s
    halves = {"attn": host.attention_ops, "mlp": host.mlp_ops, "moe": host.moe_ops}
    issue: list[float] = []
    sync: list[bool] = []
    for rank in sorted(program.ranks):
        instrs = program.ranks[rank]
        groups: dict[tuple, int] = defaultdict(int)
        for ins in instrs:
            if ins.kind == "compute" and ins.layer >= 0 and ins.layer < rp.model.layers:
                groups[(ins.layer, ins.mb, ins.chunk, ins.phase != "fwd", _half(ins.block))] += 1
        first_full = True
        for ins in instrs:
            if ins.kind != "compute" or ins.stream == "host" or ins.op == "cpu_optimizer":
                issue.append(0.0)
                sync.append(syncs and exchanges_counts(ins))
                continue
            b = int(ins.phase != "fwd")
            if "full" in graphed:  # the whole forward and backward is one replay
                issue.append(launch if first_full else 0.0)
                first_full = False
                sync.append(False)
                continue
            if ins.op == "optimizer" or not (0 <= ins.layer < rp.model.layers):
                issue.append(OUTSIDE_OPS[b] * per_op[b])
                sync.append(False)
                continue
            half = _half(ins.block)
            n = groups[(ins.layer, ins.mb, ins.chunk, bool(b), half)]
            scope = {"attn": "attn", "mlp": "mlp", "moe": "moe_router"}[half]
            t = (launch if scope in graphed else halves[half][b] * per_op[b]) / n
            if ins.block == "experts" and ins.gemm_groups:  # one GEMM per local expert and linear, from C++
                t += ins.gemm_groups / 2 * host.expert_launches[b] * launch
            issue.append(t)
            sync.append(False)
    return issue, sync
