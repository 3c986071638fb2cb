"""All-to-all context parallelism (cp_impl=a2a, DeepSpeed-Ulysses), as the lowering emits it
(docs/program.md, `simexec.program.lowering.layers.LayerLowering.exchange`).

Each cp rank holds its share of the sequence (chunks i and 2cp-1-i, `data.cp_positions`) for all of
its heads. `heads_in` gives every cp rank the whole sequence for a cp-th of those heads: one
`all_to_all_single` carries q, k and v together; the received chunks, in cp-rank order, are put back
in sequence order, so that attention runs causally over positions 0..S-1 as on one rank. `heads_out`
turns the attention's output back into this rank's tokens for all its heads. Each backward is the
other exchange applied to the gradients.
"""
from __future__ import annotations

import torch
from torch import Tensor

from simexec.exec.nn import data
from simexec.program.instructions import Instr


def to_heads(x: Tensor, head_dim: int, n: int) -> Tensor:
    """Send layout for sequence -> heads: the head dimension cut into n groups, group j first (to rank j)."""
    return x.unflatten(head_dim, (n, -1)).movedim(head_dim, 0).contiguous()


def from_seq(r: Tensor, seq_dim: int) -> Tensor:
    """Received (n, ...) sequence chunks, in rank order, joined along the sequence dimension."""
    return r.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)


def to_seq(x: Tensor, seq_dim: int, n: int) -> Tensor:
    """Send layout for heads -> sequence: the sequence cut into n chunks, chunk j first (to rank j)."""
    return x.unflatten(seq_dim, (n, -1)).movedim(seq_dim, 0).contiguous()


def from_heads(r: Tensor, head_dim: int) -> Tensor:
    """Received (n, ...) head groups, in rank order, joined along the head dimension."""
    return r.movedim(0, head_dim).flatten(head_dim, head_dim + 1)


# block: ((sequence-side name, heads-side name, head dimension, sequence dimension), ...). q (B, nh, T, hd)
# <-> qf (B, nh/cp, S, hd); kv (K, B, nkv, T, hd) <-> kvf (K, B, nkv/cp, S, hd); o (B, T, nh*hd) <-> oh
# (B, S, nh/cp*hd), whose last dimension is head-major
_EXCHANGED = {
    "heads_in": (("q", "qf", 1, 2), ("kv", "kvf", 2, 3)),
    "heads_out": (("o", "oh", 2, 1),),
}


class HeadsExchange:
    """The all-to-alls of cp_impl=a2a for `RankInterpreter` (`simexec.exec.rank.interpreter`), a mixin.

    Reads of the rank: `rank`, `plan`, `rp`, `device`, `comm`, `read`, `take_grad`, `issue`,
    `deliver`, `drop_consumed`, `env`, `d`. Its own: `heads` (whether the plan runs it), `heads_pos` (the
    sequence's positions in order, where attention runs), `heads_gathered` (the positions as the
    exchange delivers the sequence, cp rank by cp rank) and `heads_order` (the permutation into order)."""

    def setup_heads(self) -> None:
        p = self.plan
        self.heads = p.cp > 1 and p.cp_impl == "a2a"
        if not self.heads:
            return
        gathered = torch.cat([data.cp_positions(self.rp.seq_len, p.cp, r) for r in range(p.cp)])
        self.heads_gathered = gathered.to(self.device)
        self.heads_order = torch.argsort(gathered).to(self.device)
        self.heads_pos = torch.arange(self.rp.seq_len, device=self.device)

    def heads_exchange(self, ins: Instr, g, backward: bool) -> None:
        """One all-to-all over cp for every tensor of `_EXCHANGED[block]`: the forward `heads_in` and the
        backward `heads_out` go from the sequence side to the heads side, the other two back."""
        l, mb, n = ins.layer, ins.mb, self.plan.cp
        table = _EXCHANGED[ins.block]
        to_heads_side = (ins.block == "heads_in") != backward
        srcs, targets = [], []
        for seq_name, heads_name, _, _ in table:
            src, dst = (seq_name, heads_name) if to_heads_side else (heads_name, seq_name)
            srcs.append(self.take_grad((src, l, mb)) if backward else self.read((src, l, mb)))
            targets.append((dst, l, mb))
            if srcs[-1] is None:
                raise RuntimeError(f"rank {self.rank}: {ins.name}: nothing to exchange (no gradient of {src} arrived)")
        sends = []
        for x, (_, _, hd, sd) in zip(srcs, table):
            x = x.detach()
            if to_heads_side:
                sends.append(to_heads(x, hd, n))
            else:  # in sequence order -> as the cp ranks hold it, chunk j for rank j
                sends.append(to_seq(x.index_select(sd, self.heads_gathered), sd, n))
        flat = [s.reshape(n, -1) for s in sends]
        buf = torch.cat(flat, 1) if len(flat) > 1 else flat[0]
        out = torch.empty_like(buf)
        work = self.comm.all_to_all_single(out, buf, group=g, async_op=True)
        shapes = [s.shape for s in sends]

        def finish():
            off = 0
            for shape, (_, _, hd, sd), key in zip(shapes, table, targets):
                size = shape[1:].numel()
                r = out[:, off : off + size].reshape(shape)
                off += size
                v = from_seq(r, sd).index_select(sd, self.heads_order) if to_heads_side else from_heads(r, hd)
                self.deliver(key, v, backward)

        w = self.issue(ins, [work], finish)
        for key in targets:
            (self.d if backward else self.env)[key] = w
        if not backward:
            for seq_name, heads_name, _, _ in table:
                self.drop_consumed((seq_name if to_heads_side else heads_name, l, mb))
