"""Pipeline schedules as per-rank action lists (torch.distributed.pipelining's `pipeline_order` idea).

An action is (chunk, 'F' or 'B', micro-batch): chunk c of pipeline rank r is virtual stage
c * pp + r (Megatron's interleaved assignment). A schedule only orders the actions; lowering turns
each into instructions.
"""
from __future__ import annotations

from typing import NamedTuple

from simexec.errors import PlanError


class Action(NamedTuple):
    chunk: int
    kind: str  # "F" or "B"
    mb: int

    def __str__(self) -> str:  # torch-pipelining style: 0F3 = chunk 0, forward, micro-batch 3
        return f"{self.chunk}{self.kind}{self.mb}"


def gpipe(pp: int, rank: int, m: int) -> list[Action]:
    """All forwards, then all backwards (Huang et al. 2019). Bubble (p-1)/(m+p-1)."""
    return [Action(0, "F", i) for i in range(m)] + [Action(0, "B", i) for i in range(m)]


def one_f_one_b(pp: int, rank: int, m: int) -> list[Action]:
    """PipeDream-Flush 1F1B (Narayanan et al. 2021): same bubble as GPipe, at most p in flight.

    warm-up = min(p - rank - 1, m) forwards, then alternate F and B, then drain the Bs.
    """
    warmup = min(pp - rank - 1, m)
    out = [Action(0, "F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        out += [Action(0, "F", f), Action(0, "B", b)]
        f, b = f + 1, b + 1
    out += [Action(0, "B", i) for i in range(b, m)]
    return out


def interleaved_1f1b(pp: int, rank: int, m: int, vpp: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (SC'21 §2.2.2): bubble shrinks by vpp.

    The k-th forward unit of a rank runs chunk (k // p) % v on micro-batch (k // (p v)) p + k % p;
    backward units walk the chunks in reverse. Warm-up = 2 (p - rank - 1) + (v - 1) p units, or
    every unit when there are as many micro-batches as stages.
    """
    if m % pp:
        raise PlanError(f"interleaved-1f1b needs micro-batches ({m}) divisible by pp={pp}")
    total = m * vpp

    def unit(k: int, forward: bool) -> Action:
        chunk = (k // pp) % vpp
        if not forward:
            chunk = vpp - 1 - chunk
        mb = (k // (pp * vpp)) * pp + k % pp
        return Action(chunk, "F" if forward else "B", mb)

    warmup = _interleaved_warmup(pp, rank, m, vpp)
    out = [unit(k, True) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        out += [unit(f, True), unit(b, False)]
        f, b = f + 1, b + 1
    out += [unit(k, False) for k in range(b, total)]
    return out


def _interleaved_warmup(pp: int, rank: int, m: int, vpp: int) -> int:
    """Forward units before the first backward; with as many micro-batches as stages, every rank
    runs all its forwards first (Megatron-LM's `all_warmup_microbatches`)."""
    total = m * vpp
    if m == pp:
        return total
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def exchange_groups(acts: list[Action], schedule: str, pp: int, rank: int, m: int,
                    vpp: int = 1) -> list[list[Action]]:
    """A rank's actions (`pipeline_order(...)[rank]`) between two blocking pipeline exchanges, as
    Megatron-LM's schedules run them: one action each, except the interleaved schedule's steady
    state, which runs a forward and a backward and then exchanges for both
    (`send_forward_backward_recv_forward_backward`)."""
    if schedule != "interleaved-1f1b":
        return [[a] for a in acts]
    warmup = _interleaved_warmup(pp, rank, m, vpp)
    steady_end = warmup + 2 * (m * vpp - warmup)
    groups = [[a] for a in acts[:warmup]]
    groups += [acts[k:k + 2] for k in range(warmup, steady_end, 2)]
    return groups + [[a] for a in acts[steady_end:]]


def pipeline_order(schedule: str, pp: int, m: int, vpp: int = 1) -> dict[int, list[Action]]:
    """rank -> ordered actions for every pipeline rank."""
    if schedule == "gpipe":
        return {r: gpipe(pp, r, m) for r in range(pp)}
    if schedule == "1f1b":
        return {r: one_f_one_b(pp, r, m) for r in range(pp)}
    if schedule == "interleaved-1f1b":
        return {r: interleaved_1f1b(pp, r, m, vpp) for r in range(pp)}
    raise PlanError(f"unknown schedule {schedule!r}; schedules: gpipe, 1f1b, interleaved-1f1b")


def format_order(order: dict[int, list[Action]]) -> str:
    """Rank x step grid, as torch's `_format_pipeline_order`."""
    width = max((len(str(a)) for acts in order.values() for a in acts), default=3) + 1
    return "\n".join(f"rank {r}: " + "".join(str(a).ljust(width) for a in acts) for r, acts in order.items())
