"""Megatron-Core's overlap of the MoE all-to-alls with another micro-batch's compute
(--overlap-moe-expert-parallel-comm, `Plan.moe_a2a_overlap`): which forward and backward of a rank's
schedule run as a pair, interleaved kernel by kernel (the lowering's `overlapped`), and the order
that makes such pairs. The search's bounds read the same pairs."""
from __future__ import annotations

from simexec.program.schedules import Action


def combined_1f1b(actions: list[Action]) -> list[Action]:
    """Megatron-Core's combined 1F1B: the rank's schedule with one more warm-up forward, so that in every
    steady-state step the forward and the backward it pairs with are independent. Without a pipeline
    (`combined_1f1b_schedule_for_no_pipelining`, megatron/core/pipeline_parallel/combined_1f1b.py) that is
    the first micro-batch's forward alone, then each next forward with the previous micro-batch's backward,
    then the last backward alone; under the interleaved schedule `get_pp_rank_microbatches`
    (schedules.py) adds the one forward to its warm-up, whose steady state then pairs each forward with the
    backward of a virtual micro-batch the next stage no longer waits on this rank's forward for."""
    return _combined(actions)[0]


def _combined(actions: list[Action]) -> tuple[list[Action], frozenset[int]]:
    fwd = [a for a in actions if a.kind == "F"]
    rest = [a for a in actions if a.kind != "F"]
    first_backward = next((i for i, a in enumerate(actions) if a.kind != "F"), len(actions))
    warmup = min(first_backward, len(fwd))  # the plain order's warm-up and its first steady forward
    out, pairs = fwd[:warmup], []
    for f, b in zip(fwd[warmup:], rest):
        if (f.mb, f.chunk) != (b.mb, b.chunk):
            pairs.append(len(out))
        out += [f, b]
    return out + rest[len(fwd) - warmup:], frozenset(pairs)


def moe_overlap_order(actions: list[Action]) -> tuple[list[Action], frozenset[int]]:
    """A rank's actions under `moe_a2a_overlap` (`combined_1f1b`) and where its pairs start: each
    steady-state forward with the backward after it (never the last warm-up forward with the first
    backward of a schedule that runs every forward first)."""
    return _combined(actions)
