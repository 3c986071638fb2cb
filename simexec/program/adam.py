"""The Adam step's sizes that the lowering, the executor and the simulator must agree on.

The lowering prices the step by its FLOPs per parameter, the executor cuts 16-bit gradients into
fused calls of `ADAM_PIECE` elements, and the host model counts the operators those calls dispatch;
the lowering and the search's bounds price its memory traffic alike (`adam_bytes_per_param`). The
numbers live here, below all of them, so that each reads the same ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simexec.specs.plan import ResolvedPlan

ADAM_FLOPS_PER_PARAM = 12.0
# elements of 16-bit gradients the executor's Adam casts and updates per fused call: small on a CPU
# rank (its memory is what the peak measures), large on an accelerator (each call is a kernel launch)
ADAM_PIECE = {"cpu": 1 << 14, "accelerator": 1 << 24}
ADAM_BYTES_PER_PARAM = 28.0  # read fp32 master, m, v, bf16 grad; write them back and the bf16 weight


def adam_bytes_per_param(rp: ResolvedPlan) -> float:
    """Memory traffic of the optimizer step per parameter: Adam reads 2 more bytes of a 4-byte
    gradient; the fp32 main-gradient copy (`master_grads`) reads 2 and writes 4 first."""
    extra = rp.grad_bytes - 2.0
    if rp.master_grad_bytes:
        extra += 2.0 + 2.0 * rp.master_grad_bytes
    return ADAM_BYTES_PER_PARAM + extra
