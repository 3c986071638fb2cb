"""Megatron-Core's overlap of the MoE all-to-alls with another micro-batch's compute
(--overlap-moe-expert-parallel-comm, `Plan.moe_a2a_overlap`): which forward and backward of a rank's
schedule run as a pair, interleaved kernel by kernel (the lowering's `overlapped`), and the order
that makes such pairs without a pipeline. The search's bounds read the same pairs."""
from __future__ import annotations

from simexec.program.schedules import Action


def combined_1f1b(actions: list[Action]) -> list[Action]:
    """Megatron-Core's combined 1F1B without a pipeline (`combined_1f1b_schedule_for_no_pipelining`,
    megatron/core/pipeline_parallel/combined_1f1b.py): the first micro-batch's forward alone, then each
    next forward with the previous micro-batch's backward, then the last backward alone."""
    fwd = [a for a in actions if a.kind == "F"]
    rest = [a for a in actions if a.kind != "F"]
    out = fwd[:1]
    for f, b in zip(fwd[1:], rest):
        out += [f, b]
    return out + rest[len(fwd) - 1:]


def forward_backward_pairs(actions: list[Action]) -> frozenset[int]:
    """Where a forward is followed at once by another micro-batch's (or chunk's) backward: the pairs that
    `moe_a2a_overlap` (Megatron-Core's --overlap-moe-expert-parallel-comm) runs interleaved, each one's
    dispatch and combine under the other's compute; none where the schedule has no such pair."""
    return frozenset(i for i in range(len(actions) - 1) if actions[i].kind == "F" and actions[i + 1].kind == "B"
                     and (actions[i].mb, actions[i].chunk) != (actions[i + 1].mb, actions[i + 1].chunk))


def moe_overlap_order(actions: list[Action], pp: int) -> tuple[list[Action], frozenset[int]]:
    """A rank's actions under `moe_a2a_overlap` and where its pairs start: without a pipeline the
    combined 1F1B order; with one (interleaved 1F1B) the schedule's own order, whose steady state
    alternates a forward and another micro-batch's backward."""
    order = combined_1f1b(actions) if pp == 1 else list(actions)
    return order, forward_backward_pairs(order)
