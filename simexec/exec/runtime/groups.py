"""Process groups for every axis a program communicates over, built from one rendezvous.

`torch.distributed.new_group` is itself a collective over the whole world: every rank must call
it for every group, members or not, in the same order. So the driver derives one sorted list of
`(axis, ranks)` from the program (`group_specs`) and ships it to every rank, and each rank builds
its `GroupTable` by walking that list. Groups are keyed by axis *and* ranks: two axes over the same
ranks (say `dp` and `embed`) get separate groups, as each has its own stream in the program.

torch is imported lazily so that the driver can compute `group_specs` without it.
"""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Iterable

from simexec.errors import ExecError

if TYPE_CHECKING:  # pragma: no cover
    from simexec.specs.plan import ResolvedPlan
    from simexec.program.instructions import Program

GroupSpec = tuple[str, tuple[int, ...]]
WORLD = "world"


def group_specs(rp: "ResolvedPlan", program: "Program") -> list[GroupSpec]:
    """Every distinct (axis, ranks) the program's collectives use, plus each mesh axis' groups of
    more than one rank (an interpreter may need them for things the program does not price, such as
    checks), plus the world; sorted, so every rank creates them in the same order."""
    specs: set[GroupSpec] = set()
    for ins in program:
        if ins.kind == "collective":
            axis = ins.axis or ins.op.partition("@")[2]
            specs.add((axis, tuple(ins.group)))
    mesh = rp.mesh
    for axis, size in mesh.sizes.items():
        if size > 1:
            specs.update((axis, mesh.group(r, axis)) for r in range(mesh.world))
    specs.add((WORLD, tuple(range(mesh.world))))
    return sorted(specs)


class GroupTable:
    """This rank's process groups, looked up by `(axis, ranks)` as collectives name them."""

    def __init__(self, specs: Iterable[GroupSpec], rank: int, *, timeout_s: float, backend: str | None = None):
        import torch.distributed as dist

        self.rank = rank
        self._groups: dict[GroupSpec, object] = {}
        timeout = timedelta(seconds=timeout_s)
        for axis, ranks in specs:
            ranks = tuple(ranks)
            if axis == WORLD and len(ranks) == dist.get_world_size():
                pg = dist.group.WORLD  # no second world group: saves a rendezvous
            else:
                # every rank calls new_group for every group (it is collective over the world)
                pg = dist.new_group(list(ranks), timeout=timeout, backend=backend)
            if rank in ranks:
                self._groups[(axis, ranks)] = pg

    def get(self, axis: str, ranks: Iterable[int]) -> object:
        key = (axis, tuple(ranks))
        try:
            return self._groups[key]
        except KeyError:
            have = ", ".join(f"{a}{list(r)}" for a, r in sorted(self._groups))
            raise ExecError(f"rank {self.rank}: no process group for {axis} over {list(key[1])} (has {have})") from None

    @property
    def world(self) -> object:
        import torch.distributed as dist

        return dist.group.WORLD

    def __contains__(self, key: GroupSpec) -> bool:
        return (key[0], tuple(key[1])) in self._groups

    def __len__(self) -> int:
        return len(self._groups)
