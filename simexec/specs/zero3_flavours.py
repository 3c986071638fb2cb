"""ZeRO-3 flavours (a plan's `zero_impl`) as policy records: the traits in which the systems simexec
models differ, read by lowering, the executor, the host-cost model and search alike.

Every flavour shards each unit's parameters over the data-parallel ranks, all-gathers them before
the unit runs and reduce-scatters its gradients; they differ in where the gathered parameters and
unsharded gradients live, and in when a unit's gradient shard exists. Free of torch, as the
simulator reads it too.
"""
from __future__ import annotations

from dataclasses import dataclass

from simexec.errors import PlanError


@dataclass(frozen=True)
class Zero3Flavour:
    """One ZeRO-3 implementation; adding one is adding a record to `ZERO3_FLAVOURS`."""

    name: str
    # gathered parameters and unsharded gradients live in two buffers per parameter class,
    # allocated at start and used by the units in turn (by parity), the backward accumulating
    # straight into the gradient buffer (YaFSDP); False: each unit's are allocated on demand and
    # freed after its last use (FSDP2, DeepSpeed)
    preallocated_buffers: bool = False
    # every unit's gradient shard allocated at start, summed into and zeroed as each step starts
    # (DeepSpeed stage 3, the system of the ZeRO paper); False: made by the unit's first
    # reduce-scatter of a step and dropped after the optimizer step (FSDP2's `.grad`, YaFSDP as
    # simexec runs it)
    holds_grad_shards: bool = False


ZERO3_FLAVOURS: dict[str, Zero3Flavour] = {f.name: f for f in (
    Zero3Flavour("fsdp"),
    Zero3Flavour("yafsdp", preallocated_buffers=True),
    Zero3Flavour("deepspeed", holds_grad_shards=True),
)}
DEFAULT_ZERO3_FLAVOUR = "fsdp"


def zero3_flavour(name: str) -> Zero3Flavour:
    """The ZeRO-3 flavour named `name`."""
    try:
        return ZERO3_FLAVOURS[name]
    except KeyError:
        raise PlanError(f"unknown zero_impl {name!r}; flavours: {', '.join(ZERO3_FLAVOURS)}") from None
