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

from typing import NamedTuple

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


def stage_of(schedule: str, pp: int, rank: int, chunk: int) -> int:
    """The virtual stage that chunk `chunk` of pipeline rank `rank` holds."""
    if schedule in V_SHAPED:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def place_of(schedule: str, pp: int, stage: int) -> tuple[int, int]:
    """(pipeline rank, chunk) holding virtual stage `stage`: the inverse of `stage_of`."""
    chunk, rank = divmod(stage, pp)
    if schedule in V_SHAPED and chunk:
        rank = pp - 1 - rank
    return rank, chunk


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
    if schedule == "zb-h1":
        return {r: zb_h1(pp, r, m) for r in range(pp)}
    if schedule == "zb-v":
        return {r: zb_v(pp, r, m) for r in range(pp)}
    if schedule == "dualpipev":
        if m < 2 * pp:
            raise PlanError(f"dualpipev needs at least 2*pp = {2 * pp} micro-batches, got {m}")
        return {r: dualpipe_v(pp, r, m) for r in range(pp)}
    if schedule == "interleaved-zb":
        if m % pp:
            raise PlanError(f"interleaved-zb needs micro-batches ({m}) divisible by pp={pp}")
        return {r: interleaved_zb(pp, r, m, vpp) for r in range(pp)}
    raise PlanError(f"unknown schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "interleaved-zb", "zb-v", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "interleaved-zb", "zb-v", "dualpipev")  # schedules whose backward is split into B and W
INTERLEAVED = ("interleaved-1f1b", "interleaved-zb")  # schedules over vpp virtual stages in a loop
V_SHAPED = ("zb-v", "dualpipev")  # two chunks per rank in a V (`stage_of`)
MULTI_CHUNK = INTERLEAVED + V_SHAPED  # schedules with more than one chunk per rank


def format_order(order: dict[int, list[Action]]) -> str:
    """Rank x step grid, as torch's `_format_pipeline_order`."""
    width = max((len(str(a)) for acts in order.values() for a in acts), default=3) + 1
    return "\n".join(f"rank {r}: " + "".join(str(a).ljust(width) for a in acts) for r, acts in order.items())
