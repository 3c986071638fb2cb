"""Deterministic synthetic token batches, split the same way by every plan and by the reference.

Step `s` of seed `seed` draws one global batch of gbs sequences of seq+1 tokens; inputs are tokens
[:-1], targets tokens [1:]. Data-parallel rank d takes the d-th contiguous gbs/dp sequences, micro-batch
m the m-th mbs of those. Under context parallelism the sequence is cut into 2*cp chunks and cp rank i
keeps chunks i and 2*cp-1-i (causal load balancing, as Megatron-LM and Llama 3 do), with their positions.
A model with MTP depths also gets, per depth k, the tokens and targets k positions ahead (`shifted`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Shifted:
    """What MTP depth k (1-based) reads at each of a batch's positions p (DeepSeek-V3 §2.2, Megatron-Core's
    `roll_tensor` applied k times): the input token, position and target at p + k, and whether p + k
    is still in the sequence (past its end: token, position and target 0, masked out of the loss)."""

    tokens: Tensor  # (B, T)
    pos: Tensor  # (T,)
    targets: Tensor  # (B, T)
    mask: Tensor  # (T,) 1.0 where p + k < seq, else 0.0


@dataclass(frozen=True)
class Batch:
    tokens: Tensor  # (B, T) input ids
    targets: Tensor  # (B, T) next-token ids
    pos: Tensor  # (T,) positions of these tokens in the sequence
    mtp: tuple[Shifted, ...] = ()  # per MTP depth, its shifted tokens (`shifted`)

    def to(self, device, pos: Tensor) -> "Batch":
        """On `device`, with the positions tensor `pos` (shared by a step's micro-batches)."""
        mtp = tuple(Shifted(s.tokens.to(device), s.pos.to(device), s.targets.to(device), s.mask.to(device))
                    for s in self.mtp)
        return Batch(self.tokens.to(device), self.targets.to(device), pos, mtp)


def shifted(x: Tensor, y: Tensor, pos: Tensor, seq: int, depths: int) -> tuple[Shifted, ...]:
    """Each MTP depth's `Shifted` at positions `pos` (this rank's, under cp) of whole sequences x, y
    (B, seq): read from the whole sequence, so a cp rank's chunk sees the tokens of the next chunk as
    Megatron-Core's cp-aware roll exchanges them."""
    out = []
    for k in range(1, depths + 1):
        ahead = pos + k
        inside = ahead < seq
        at = torch.where(inside, ahead, torch.zeros_like(ahead))
        keep = inside.unsqueeze(0)
        out.append(Shifted(torch.where(keep, x[:, at], 0), at, torch.where(keep, y[:, at], 0), inside.float()))
    return tuple(out)


def global_batch(vocab: int, gbs: int, seq: int, seed: int, step: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets), each (gbs, seq), of step `step`."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tok = torch.randint(0, vocab, (gbs, seq + 1), generator=g)
    return tok[:, :-1], tok[:, 1:]


def cp_positions(seq: int, cp: int, cp_rank: int) -> Tensor:
    """Positions held by cp rank `cp_rank`: chunks i and 2cp-1-i of 2cp equal chunks."""
    if cp == 1:
        return torch.arange(seq)
    c = seq // (2 * cp)
    a, b = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def micro_batch(rp, seed: int, step: int, dp_rank: int, mb: int, cp_rank: int = 0) -> Batch:
    """Micro-batch `mb` of data-parallel rank `dp_rank` (and context-parallel rank `cp_rank`)."""
    p = rp.plan
    x, y = global_batch(rp.model.vocab, p.gbs, rp.seq_len, seed, step)
    per_dp = p.gbs // rp.dp
    lo = dp_rank * per_dp + mb * p.mbs
    pos = cp_positions(rp.seq_len, p.cp, cp_rank)
    x, y = x[lo : lo + p.mbs], y[lo : lo + p.mbs]
    return Batch(x[:, pos], y[:, pos], pos, shifted(x, y, pos, rp.seq_len, rp.model.mtp_layers))


def whole_batch(rp, seed: int, step: int) -> Batch:
    """The global batch as one, for the single-process reference."""
    x, y = global_batch(rp.model.vocab, rp.plan.gbs, rp.seq_len, seed, step)
    pos = torch.arange(rp.seq_len)
    return Batch(x, y, pos, shifted(x, y, pos, rp.seq_len, rp.model.mtp_layers))
