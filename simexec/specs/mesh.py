"""The rank mesh: which rank sits at which coordinates of the parallel axes, and the groups of ranks
that differ along some of them (the collectives' groups)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Mesh:
    """Rank layout: rank <-> coordinates on (tp, cp, dp, pp), fastest-varying axis first."""

    sizes: dict[str, int]
    order: tuple[str, ...]

    @cached_property
    def _strides(self) -> dict[str, int]:
        strides, acc = {}, 1
        for axis in self.order:
            strides[axis] = acc
            acc *= self.sizes[axis]
        return strides

    @property
    def world(self) -> int:
        out = 1
        for s in self.sizes.values():
            out *= s
        return out

    def coords(self, rank: int) -> dict[str, int]:
        return {a: (rank // self._strides[a]) % self.sizes[a] for a in self.order}

    def rank(self, **coords: int) -> int:
        return sum(coords.get(a, 0) * self._strides[a] for a in self.order)

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """Ranks that differ from `rank` only along `axis`, in axis order."""
        c = self.coords(rank)
        base = rank - c[axis] * self._strides[axis]
        return tuple(base + i * self._strides[axis] for i in range(self.sizes[axis]))

    def span(self, rank: int, axes: tuple[str, ...], keep=None) -> tuple[int, ...]:
        """Ranks that differ from `rank` only along `axes` (sorted), optionally filtered by `keep(coords)`."""
        mine = self.coords(rank)
        out = [rank - sum(mine[a] * self._strides[a] for a in axes)]
        for a in axes:
            out = [r + i * self._strides[a] for r in out for i in range(self.sizes[a])]
        return tuple(sorted(r for r in out if keep is None or keep(self.coords(r))))

    def subgroup(self, rank: int, axis: str, size: int) -> tuple[int, ...]:
        """Consecutive blocks of `size` along `axis` (ep groups, HSDP shard groups)."""
        full = self.group(rank, axis)
        i = full.index(rank) // size
        return full[i * size : (i + 1) * size]
