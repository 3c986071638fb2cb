"""Stragglers and slow GPUs as data: which ranks compute slower, which nodes' NICs carry less.

`Slowdown` names real ranks and nodes. The engine simulates a program's present ranks; in symmetric
mode one rank per pipeline stage stands for the others (`Program.represents`), so a simulated rank
takes the largest factor among the ranks it stands for: every step those ranks meet in collectives
(data-, tensor-, context-parallel) that wait for their slowest member, so the group runs at the pace
of its slowest rank. The approximation: ranks that never wait for each other inside a step (none,
in a synchronous step with a gradient reduction) would be charged too much; and a group that
mixes a slow and a fast rank is charged as if all were slow for the compute between two collectives,
which overstates a straggler's cost when its work overlaps others' communication. A `--full`
simulation gives each rank its own factor and needs neither approximation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from simexec.errors import SpecError
from simexec.program.instructions import Program

SLOW_KINDS = ("rank", "node", "nic")


@dataclass(frozen=True)
class Slowdown:
    """compute: real rank -> factor (>= 1, its compute takes factor x longer);
    nic: node -> factor (its NIC links carry 1/factor of their bandwidth)."""

    compute: dict[int, float] = field(default_factory=dict)
    nic: dict[int, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.compute) or bool(self.nic)

    def to_json(self) -> dict:
        return {"compute": {str(r): f for r, f in sorted(self.compute.items())},
                "nic": {str(n): f for n, f in sorted(self.nic.items())}}


def parse_slow(spec: str, world: int, gpus_per_node: int) -> Slowdown:
    """`rank:R:F,node:N:F,nic:N:F` -> Slowdown; a bad entry fails with one line naming it."""
    nodes = max(1, -(-world // max(1, gpus_per_node)))
    compute: dict[int, float] = {}
    nic: dict[int, float] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in SLOW_KINDS:
            raise SpecError(f"--slow {item!r}: expected rank:R:F, node:N:F or nic:N:F")
        kind, where, factor = parts
        try:
            idx, f = int(where), float(factor)
        except ValueError:
            raise SpecError(f"--slow {item!r}: {kind} index must be an integer and the factor a number") from None
        if not f >= 1.0 or f == float("inf"):
            raise SpecError(f"--slow {item!r}: factor must be a finite number >= 1, got {factor}")
        limit = world if kind == "rank" else nodes
        if not 0 <= idx < limit:
            raise SpecError(f"--slow {item!r}: {kind} {idx} out of range (the plan has "
                            f"{world} ranks on {nodes} node{'s' if nodes > 1 else ''})")
        if kind == "rank":
            compute[idx] = max(f, compute.get(idx, 1.0))
        elif kind == "node":
            g = max(1, gpus_per_node)
            for r in range(idx * g, min(world, (idx + 1) * g)):
                compute[r] = max(f, compute.get(r, 1.0))
        else:
            nic[idx] = max(f, nic.get(idx, 1.0))
    if not compute and not nic:
        raise SpecError(f"--slow {spec!r}: names no rank, node or NIC")
    return Slowdown(compute, nic)


def simulated_compute(factors: dict[int, float], program: Program) -> dict[int, float]:
    """Per simulated rank: the largest factor among the ranks it stands for (itself in full mode)."""
    reps = program.represents or {}
    out = {}
    for r in program.ranks:
        f = max((factors.get(x, 1.0) for x in reps.get(r, (r,))), default=1.0)
        if f != 1.0:
            out[r] = f
    return out


def simulated_nics(nic: dict[int, float], program: Program, gpus_per_node: int) -> dict[int, float]:
    """Per node of a simulated rank: the largest NIC factor among the nodes of the ranks the
    node's simulated ranks stand for (the node itself in full mode)."""
    g = max(1, gpus_per_node)
    reps = program.represents or {}
    out: dict[int, float] = {}
    for r in program.ranks:
        f = max((nic.get(x // g, 1.0) for x in reps.get(r, (r,))), default=1.0)
        if f != 1.0:
            out[r // g] = max(f, out.get(r // g, 1.0))
    return out
