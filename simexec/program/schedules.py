"""Pipeline schedules as per-rank action lists (torch.distributed.pipelining's `pipeline_order` idea).

An action is (chunk, kind, micro-batch). Chunk c of pipeline rank r is virtual stage c * pp + r
(Megatron's interleaved assignment, a loop over the ranks), except under a V-shaped schedule, where
rank r holds stages r and 2 pp - 1 - r (`stage_of`): the first rank holds the embedding and the head,
and the last rank hands its first chunk's output to its second without a message. Kind 'F' is a
forward and 'B' a backward; zero-bubble schedules split the backward into 'B' (the input gradients,
which the previous stage waits for) and 'W' (the weight gradients, which nothing downstream waits
for), and a whole backward among split ones is its 'B' followed at once by its 'W'. A schedule only
orders the actions; lowering turns each into instructions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Optional

from simexec.errors import PlanError


class Action(NamedTuple):
    chunk: int
    kind: str  # "F", "B" or "W"
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


def zb_h1(pp: int, rank: int, m: int) -> list[Action]:
    """Zero-bubble ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1): 1F1B's order of
    forwards and input-gradient backwards, each backward followed by the weight-gradient pass of the
    oldest backward still owed one, except that rank r owes r of them until the end, where they fill
    the cool-down bubble. A micro-batch's activations live until its W, so every rank holds at most pp
    micro-batches, 1F1B's peak on its first rank; the bubble shrinks from (p-1)(F+B+W) to (p-1)(F+B-W).
    """
    return interleaved_zb(pp, rank, m, 1)


def interleaved_zb(pp: int, rank: int, m: int, vpp: int) -> list[Action]:
    """Interleaved zero bubble (the paper's ZB-H1 over virtual stages; torch.distributed.pipelining's
    ScheduleInterleavedZeroBubble): interleaved 1F1B's units with (v-1)p + (p-1-r) forwards of warm-up
    instead of Megatron's (v-1)p + 2(p-1-r), each input-gradient backward followed by the weight pass
    of the oldest one owed, rank r owing r of them until the end. With vpp = 1 it is ZB-H1."""
    total = m * vpp

    def unit(k: int, kind: str) -> Action:
        chunk = (k // pp) % vpp
        if kind != "F":
            chunk = vpp - 1 - chunk
        return Action(chunk, kind, (k // (pp * vpp)) * pp + k % pp)

    warmup = min((vpp - 1) * pp + pp - 1 - rank, total)
    out = [unit(k, "F") for k in range(warmup)]
    f, b, w = warmup, 0, 0

    def backward() -> None:
        nonlocal b, w
        out.append(unit(b, "B"))
        b += 1
        if b > rank:
            out.append(unit(w, "W"))
            w += 1

    while f < total:
        out.append(unit(f, "F"))
        f += 1
        backward()
    while b < total:
        backward()
    out += [unit(k, "W") for k in range(w, total)]
    return out


def zb_v(pp: int, rank: int, m: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §6; torch.distributed.pipelining's
    ScheduleZBVZeroBubble): two chunks per rank in a V, rank r holding stages r and 2p-1-r. Warm-up:
    2(p-r)-1 forwards of chunk 0, then r pairs of (chunk 1, chunk 0) forwards, then p-r rounds of a
    chunk-1 forward, input-gradient and weight pass. Steady state: a chunk-0 forward (while any are
    left), its input gradient and weight pass, then the same for chunk 1. Cool-down: r pairs of
    input gradients (chunk 0, chunk 1), p-r chunk-0 input gradients each with a weight pass, then the
    weight passes still owed, chunk 1's first. Every rank holds at most 2p micro-batch-chunks, 1F1B's
    peak, with the bubble filled when F, B and W take the same time. The order is built for
    max(m, 2p-1) micro-batches and the ones past m left out, as torch does."""
    n = max(m, 2 * pp - 1)
    out: list[Action] = []
    f, b, w = [0, 0], [0, 0], [0, 0]

    def do(*steps: str) -> None:
        """Append each step's next action: '1B' is chunk 1's next input-gradient pass."""
        for step in steps:
            chunk, kind = int(step[0]), step[1]
            count = {"F": f, "B": b, "W": w}[kind]
            out.append(Action(chunk, kind, count[chunk]))
            count[chunk] += 1

    for _ in range(2 * (pp - rank) - 1):
        do("0F")
    for _ in range(rank):
        do("1F", "0F")
    for _ in range(pp - rank):
        do("1F", "1B", "1W")
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            do("0F")
        do("0B", "0W", "1F", "1B", "1W")
    for _ in range(rank):
        do("0B", "1B")
    for _ in range(pp - rank):
        do("0B", "0W")
    while w[1] < b[1]:
        do("1W")
    while w[0] < b[0]:
        do("0W")
    return [a for a in out if a.mb < m]


def dualpipe_v(pp: int, rank: int, m: int) -> list[Action]:
    """DualPipeV's order for one rank (`_dualpipe_v`)."""
    return _dualpipe_v(pp, rank, m)[0]


def dualpipe_pairs(pp: int, rank: int, m: int) -> frozenset[int]:
    """Where DualPipeV's overlapped pairs start in `dualpipe_v`'s order: the position of a pair's
    forward, followed by the other chunk's input-gradient and weight passes (its whole backward)."""
    return _dualpipe_v(pp, rank, m)[1]


def _dualpipe_v(pp: int, rank: int, m: int) -> tuple[list[Action], frozenset[int]]:
    """DualPipeV (DeepSeek-V3's bidirectional DualPipe folded into one V, the DualPipe repository's
    DualPipeV; torch.distributed.pipelining's ScheduleDualPipeV): rank r holds stages r and 2p-1-r, as
    ZB-V. Warm-up: 2(p-r-1) chunk-0 forwards, r+1 pairs (chunk 0, chunk 1), p-r-1 rounds of
    a chunk-1 input gradient, the oldest weight pass owed and a chunk-1 forward. Main phase: pairs of a
    forward of one chunk and the whole backward of the other (DualPipe overlaps the two with its own
    kernels; torch's runtime, without them, runs one after the other, as here). Then whole backwards,
    the second half of the cool-down split into input and weight passes. A whole backward is its input
    gradient followed at once by its weight pass. Needs at least 2p micro-batches. Returns the order and
    where its overlapped pairs start."""
    out: list[Action] = []
    pairs: set[int] = set()
    f, b = [0, 0], [0, 0]
    owed: list[tuple[int, int]] = []  # (chunk, micro-batch) whose weight pass is still to run

    def forward(chunk: int) -> None:
        out.append(Action(chunk, "F", f[chunk]))
        f[chunk] += 1

    def backward(chunk: int, whole: bool = True) -> None:
        out.append(Action(chunk, "B", b[chunk]))
        if whole:
            out.append(Action(chunk, "W", b[chunk]))
        else:
            owed.append((chunk, b[chunk]))
        b[chunk] += 1

    def weight() -> None:
        if owed:
            chunk, mb = owed.pop(0)
            out.append(Action(chunk, "W", mb))

    def pair(fwd: int) -> None:
        pairs.add(len(out))
        forward(fwd)
        backward(1 - fwd)

    for _ in range(2 * (pp - rank - 1)):
        forward(0)
    for _ in range(rank + 1):
        forward(0)
        forward(1)
    for _ in range(pp - rank - 1):
        backward(1, whole=False)
        weight()
        forward(1)
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:  # not overlapped, to shorten the bubble (as DualPipe)
            forward(0)
            backward(1)
        else:
            pair(0)
        pair(1)
    for _ in range(pp - rank - 1):
        backward(1)
        pair(1)
    split = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(1, whole=not split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(0, whole=not split)
    for _ in range(pp - rank - 1):
        weight()
        backward(0, whole=not split)
    for _ in range(rank + 1):
        weight()
    return out, frozenset(pairs)


def stage_of(schedule_name: str, pp: int, rank: int, chunk: int) -> int:
    """The virtual stage that chunk `chunk` of pipeline rank `rank` holds under a schedule."""
    return schedule(schedule_name).stage_of(pp, rank, chunk)


def place_of(schedule_name: str, pp: int, stage: int) -> tuple[int, int]:
    """(pipeline rank, chunk) holding virtual stage `stage`: the inverse of `stage_of`."""
    return schedule(schedule_name).place_of(pp, stage)


def _interleaved_warmup(pp: int, rank: int, m: int, vpp: int) -> int:
    """Forward units before the first backward; with as many micro-batches as stages, every rank
    runs all its forwards first (Megatron-LM's `all_warmup_microbatches`)."""
    total = m * vpp
    if m == pp:
        return total
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def exchange_groups(acts: list[Action], schedule_name: str, pp: int, rank: int, m: int,
                    vpp: int = 1) -> list[list[Action]]:
    """A rank's actions (`pipeline_order(...)[rank]`) between two blocking pipeline exchanges, as
    Megatron-LM's schedules run them: one action each, except the interleaved schedule's steady
    state, which runs a forward and a backward and then exchanges for both
    (`send_forward_backward_recv_forward_backward`)."""
    if not schedule(schedule_name).grouped_exchanges:
        return [[a] for a in acts]
    warmup = _interleaved_warmup(pp, rank, m, vpp)
    steady_end = warmup + 2 * (m * vpp - warmup)
    groups = [[a] for a in acts[:warmup]]
    groups += [acts[k:k + 2] for k in range(warmup, steady_end, 2)]
    return groups + [[a] for a in acts[steady_end:]]


def pipeline_order(schedule_name: str, pp: int, m: int, vpp: int = 1) -> dict[int, list[Action]]:
    """rank -> ordered actions for every pipeline rank."""
    sched = schedule(schedule_name)
    if m < sched.min_micro_batches_per_pp * pp:
        raise PlanError(f"{sched.name} needs at least {sched.min_micro_batches_per_pp}*pp ="
                        f" {sched.min_micro_batches_per_pp * pp} micro-batches, got {m}")
    if sched.micro_batches_divisible_by_pp and m % pp:
        raise PlanError(f"{sched.name} needs micro-batches ({m}) divisible by pp={pp}")
    return {r: sched.order(pp, r, m, vpp) for r in range(pp)}


Placement = Literal["one", "loop", "v"]


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule and the traits lowering, simulation, search and plan validation ask of it;
    adding a schedule is adding its order function and one record to `SCHEDULES`."""

    name: str
    order: Callable[[int, int, int, int], list[Action]]  # (pp, rank, micro-batches, vpp) -> one rank's actions
    # how a rank's chunks map to virtual stages: one chunk; vpp chunks in a loop over the ranks
    # (chunk c of rank r is stage c pp + r); two chunks in a V (rank r holds stages r and 2 pp - 1 - r)
    placement: Placement = "one"
    splits_backward: bool = False  # the backward split into B (input gradients) and W (weight gradients)
    all_forwards_first: bool = False  # every forward before the first backward (GPipe)
    warmup_per_later_rank: int = 1  # a loop schedule's warm-up forwards per pipeline rank after this one
    grouped_exchanges: bool = False  # blocking exchanges pair a forward with a backward in the steady state
    overlapped_pairs: bool = False  # pairs of one chunk's forward and another's backward (dualpipe_overlap)
    min_micro_batches_per_pp: int = 0  # the order needs at least this many micro-batches per pipeline rank
    micro_batches_divisible_by_pp: bool = False  # the order walks micro-batches in rounds of pp
    # why blocking pipeline exchanges (p2p_overlap=0) deadlock under this order; None: they do not
    blocking_exchanges_deadlock: Optional[str] = None

    @property
    def multi_chunk(self) -> bool:
        """More than one chunk per rank (vpp > 1)."""
        return self.placement != "one"

    @property
    def interleaved(self) -> bool:
        """vpp chunks per rank in a loop over the ranks (Megatron's interleaved assignment)."""
        return self.placement == "loop"

    @property
    def v_shaped(self) -> bool:
        """Two chunks per rank in a V."""
        return self.placement == "v"

    def runs_with_vpp(self, vpp: int) -> bool:
        """Whether this schedule runs with `vpp` chunks per rank."""
        return {"one": vpp == 1, "loop": vpp >= 2, "v": vpp == 2}[self.placement]

    def stage_of(self, pp: int, rank: int, chunk: int) -> int:
        """The virtual stage that chunk `chunk` of pipeline rank `rank` holds."""
        if self.v_shaped:
            return rank if chunk == 0 else 2 * pp - 1 - rank
        return chunk * pp + rank

    def place_of(self, pp: int, stage: int) -> tuple[int, int]:
        """(pipeline rank, chunk) holding virtual stage `stage`: the inverse of `stage_of`."""
        chunk, rank = divmod(stage, pp)
        if self.v_shaped and chunk:
            rank = pp - 1 - rank
        return rank, chunk


_P2P_V = "with blocking exchanges one action at a time, the two ends of a V each wait for the other's send"
_P2P_ZB = ("its order pairs no forward with a backward, so blocking exchanges one action at a time wait on"
           " each other")

SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", lambda pp, r, m, v: gpipe(pp, r, m), all_forwards_first=True),
    Schedule("1f1b", lambda pp, r, m, v: one_f_one_b(pp, r, m)),
    Schedule("interleaved-1f1b", interleaved_1f1b, placement="loop", warmup_per_later_rank=2,
             grouped_exchanges=True, micro_batches_divisible_by_pp=True),
    Schedule("zb-h1", lambda pp, r, m, v: zb_h1(pp, r, m), splits_backward=True),
    Schedule("interleaved-zb", interleaved_zb, placement="loop", splits_backward=True,
             micro_batches_divisible_by_pp=True, blocking_exchanges_deadlock=_P2P_ZB),
    Schedule("zb-v", lambda pp, r, m, v: zb_v(pp, r, m), placement="v", splits_backward=True,
             blocking_exchanges_deadlock=_P2P_V),
    Schedule("dualpipev", lambda pp, r, m, v: dualpipe_v(pp, r, m), placement="v", splits_backward=True,
             overlapped_pairs=True, min_micro_batches_per_pp=2, blocking_exchanges_deadlock=_P2P_V),
)}


def schedule(name: str) -> Schedule:
    """The schedule named `name`."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise PlanError(f"unknown schedule {name!r}; schedules: {', '.join(SCHEDULES)}") from None


def default_schedule(vpp: int) -> str:
    """The schedule a plan that names none runs: 1F1B, interleaved when there are several chunks per rank."""
    return "interleaved-1f1b" if vpp > 1 else "1f1b"


def format_order(order: dict[int, list[Action]]) -> str:
    """Rank x step grid, as torch's `_format_pipeline_order`."""
    width = max((len(str(a)) for acts in order.values() for a in acts), default=3) + 1
    return "\n".join(f"rank {r}: " + "".join(str(a).ljust(width) for a in acts) for r, acts in order.items())
