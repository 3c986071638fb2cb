"""The Adam step's sizes that the lowering, the executor and the simulator must agree on.

The lowering prices the step by its FLOPs per parameter, the executor cuts 16-bit gradients into
fused calls of `ADAM_PIECE` elements, and the host model counts the operators those calls dispatch;
the numbers live here, below all three, so that each reads the same ones.
"""
from __future__ import annotations

ADAM_FLOPS_PER_PARAM = 12.0
# elements of 16-bit gradients the executor's Adam casts and updates per fused call: small on a CPU
# rank (its memory is what the peak measures), large on an accelerator (each call is a kernel launch)
ADAM_PIECE = {"cpu": 1 << 14, "accelerator": 1 << 24}
