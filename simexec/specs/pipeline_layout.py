"""Megatron-Core's pipeline layout notation (`--pipeline-model-parallel-layout`), read as Megatron reads it.

`"Et|(tt|)*30mL"`: E the embedding, t a transformer layer, m a multi-token-prediction layer, L the
head and its loss; `|` separates the pp*vpp virtual stages in model order (Megatron gives stage i to
pipeline rank i % pp, chunk i // pp); `(..)*n` and `x*n` repeat; commas are cosmetic. The parsing and
the rules follow megatron/core/transformer/pipeline_parallel_layer_layout.py
(`parse_str_to_list`, `validate_layer_layout`; NVIDIA/Megatron-LM d98e8a64).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from simexec.errors import PlanError

LAYER_CHARS = "EtmL"
# Megatron's two unrolling patterns, in its order: a parenthesised group, then a single character
_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")


@dataclass(frozen=True)
class StageContents:
    """What one virtual stage holds: its transformer layers (indices), the embedding, MTP depths, the head."""

    layers: tuple[int, ...]
    embedding: bool = False
    mtp: tuple[int, ...] = ()
    head: bool = False


def expand_layout(text: str) -> list[str]:
    """The layout's stages as strings of layer characters, repetitions unrolled (Megatron's
    `parse_str_to_list`), or a PlanError naming the first character it does not know."""
    s = text.replace(",", "")
    for pattern in _REPEATS:
        s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
    stages = s.split("|")
    for i, stage in enumerate(stages):
        bad = next((ch for ch in stage if ch not in LAYER_CHARS), None)
        if bad is not None:
            raise PlanError(f"layout {text!r}: stage {i} has {bad!r}; known layer characters are E, t, m, L")
    return stages


def resolve_layout(text: str, pp: int, vpp: int, layers: int, mtp_layers: int) -> tuple[StageContents, ...]:
    """Each virtual stage's contents, or a PlanError naming the broken rule (Megatron's
    `validate_layer_layout`, plus simexec's: the embedding on the first stage, the head on the last,
    the MTP layers beside the head)."""
    stages = expand_layout(text)
    n = pp * vpp

    def fail(msg: str) -> None:
        raise PlanError(f"layout {text!r}: {msg}")

    if len(stages) != n:
        fail(f"layout has {len(stages)} stages, pp*vpp = {pp}*{vpp} = {n}")
    flat = "".join(stages)
    for ch, name in (("E", "embedding"), ("L", "loss")):
        if flat.count(ch) != 1:
            fail(f"the {name} ({ch}) must appear exactly once, found {flat.count(ch)}")
    if flat[0] != "E":
        fail(f"the first layer must be the embedding (E), got {flat[0]!r}")
    if flat[-1] != "L":
        fail(f"the last layer must be the loss (L), got {flat[-1]!r}")
    if flat.count("t") != layers:
        fail(f"layout places {flat.count('t')} transformer layers, the model has {layers}")
    if flat.count("m") != mtp_layers:
        fail(f"layout places {flat.count('m')} MTP layers, the model has {mtp_layers} (mtp_layers)")
    if "m" in flat and "t" in flat[flat.index("m"):]:
        fail("transformer layers must come before the MTP layers")
    if "E" not in stages[0]:
        fail("the embedding must be on the first stage (stages before it would hold nothing)")
    if "L" not in stages[-1]:
        fail("the loss must be on the last stage (stages after it would hold nothing)")
    if mtp_layers and stages[-1].count("m") != mtp_layers:
        fail("simexec places the MTP layers beside the head: all m on the stage of L")
    out, start = [], 0
    for i, stage in enumerate(stages):
        count = stage.count("t")
        out.append(StageContents(tuple(range(start, start + count)), embedding="E" in stage,
                                 mtp=tuple(range(mtp_layers)) if "m" in stage else (), head="L" in stage))
        start += count
    return tuple(out)
