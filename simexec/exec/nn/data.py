"""Deterministic synthetic token batches, split the same way by every plan and by the reference.

Step `s` of seed `seed` draws one global batch of gbs sequences of seq+1 tokens; inputs are tokens
[:-1], targets tokens [1:]. Data-parallel rank d takes the d-th contiguous gbs/dp sequences, micro-batch
m the m-th mbs of those. Under context parallelism the sequence is cut into 2*cp chunks and cp rank i
keeps chunks i and 2*cp-1-i (causal load balancing, as Megatron-LM and Llama 3 do), with their positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Batch:
    tokens: Tensor  # (B, T) input ids
    targets: Tensor  # (B, T) next-token ids
    pos: Tensor  # (T,) positions of these tokens in the sequence


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
    return Batch(x[lo : lo + p.mbs][:, pos], y[lo : lo + p.mbs][:, pos], pos)


def whole_batch(rp, seed: int, step: int) -> Batch:
    """The global batch as one, for the single-process reference."""
    x, y = global_batch(rp.model.vocab, rp.plan.gbs, rp.seq_len, seed, step)
    return Batch(x, y, torch.arange(rp.seq_len))
