"""Gradient clipping by the global L2 norm (`clip_grad`) across a sharded, replicated model.

The norm is that of the whole model's gradient, as one process computing it would get it
(`torch.nn.utils.clip_grad_norm_`). Every rank holds some of it: its tensor-parallel slices, its
pipeline stage's layers, its experts, its ZeRO shards; and much of it several times: data-parallel
replicas, parameters replicated over tp (norms, the router), HSDP's replicated shards. So each rank
sums the squares of what it holds, each piece weighted by 1 / (how many ranks hold that same piece),
and one all-reduce over the world adds the sums up: the same total on every rank, then the same
coefficient min(1, clip_grad / norm). The last pipeline stage's copy of a tied embedding weighs 0.

`ClipWeights.of` derives the weights from the plan alone (which ranks hold which slice of which
parameter), so no extra collective is needed to find the replicas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch
from torch import Tensor

from simexec.exec.nn.param_layout import Layout, ParamSpec, holds, is_tied_copy, stage_units

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: clip_grad / (norm + EPS)


class Holders:
    """Which ranks of the world hold which slice of a parameter, from the plan."""

    def __init__(self, rp):
        self.rp = rp
        coords = [rp.mesh.coords(r) for r in range(rp.world)]
        self.ranks = [(c["tp"], stage_units(rp, c["pp"]), Layout.of(rp, r)) for r, c in enumerate(coords)]

    def _slice(self, spec: ParamSpec, r: int):
        tp_rank, units, lay = self.ranks[r]
        if spec.unit not in units or not holds(spec, self.rp.model, lay):
            return None
        if spec.expert is not None:  # a routed expert: split over etp
            return lay.etp_rank if spec.tp_dim is not None and lay.etp > 1 else "all"
        return tp_rank if spec.tp_dim is not None and self.rp.plan.tp > 1 else "all"

    def count(self, spec: ParamSpec, rank: int) -> int:
        """Ranks that hold the same slice of `spec` as `rank` (itself included)."""
        mine = self._slice(spec, rank)
        return sum(1 for r in range(len(self.ranks)) if self._slice(spec, r) == mine)


@dataclass
class ClipWeights:
    """For each optimizer tensor, in order: its (start, end, weight) pieces. A parameter's tensor is
    one piece; a ZeRO shard (a slice of parameters laid end to end, `_Flat`) one piece per run of
    parameters with the same weight. A shard's elements are held by 1 / group size of the ranks that
    hold the whole parameter."""

    pieces: list[list[tuple[int, int, float]]]

    @classmethod
    def of(cls, rp, rank: int, specs: dict[str, ParamSpec], keys: Sequence[Hashable], flats: dict,
           numel: dict[str, int]) -> "ClipWeights":
        holders = Holders(rp)
        copies: dict[str, int] = {}

        def weight(name: str, share: int = 1) -> float:
            if is_tied_copy(specs[name], rp.model):  # counted once, on the first stage (Megatron-LM)
                return 0.0
            if name not in copies:
                copies[name] = holders.count(specs[name], rank)
            return share / copies[name]

        out = []
        for k in keys:
            fl = flats.get(k)
            if fl is None:
                out.append([(0, numel[k], weight(k))])
                continue
            lo, hi = fl.index * fl.shard, (fl.index + 1) * fl.shard
            runs: list[tuple[int, int, float]] = []
            off = 0
            for name, n in zip(fl.names, fl.numels):
                a, b = max(lo, off), min(hi, off + n)
                off += n
                if a >= b:
                    continue
                w = weight(name, fl.group_size)
                if runs and runs[-1][2] == w and runs[-1][1] == a - lo:
                    runs[-1] = (runs[-1][0], b - lo, w)
                else:
                    runs.append((a - lo, b - lo, w))
            out.append(runs)
        return cls(out)

    def squared_norm(self, grads: Sequence[Tensor]) -> Tensor:
        """This rank's weighted share of the model's squared gradient norm, an fp32 tensor of one element."""
        views, weights = [], []
        for g, runs in zip(grads, self.pieces):
            for a, b, w in runs:
                views.append(g if (a, b) == (0, g.numel()) else g.reshape(-1)[a:b])
                weights.append(w)
        if not views:
            return torch.zeros(1, dtype=torch.float32)
        norms = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32))
        w = torch.tensor(weights, dtype=torch.float32, device=norms.device)
        return (norms.square() * w).sum().reshape(1)


def clip_coefficient(squared_norm: Tensor, max_norm: float) -> Tensor:
    """min(1, max_norm / (norm + EPS)) as torch.nn.utils.clip_grad_norm_ computes it."""
    return (max_norm / (squared_norm.sqrt() + EPS)).clamp(max=1.0)
