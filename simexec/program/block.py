"""One sub-block's cost on one rank: the record `simexec.program.blocks.Anatomy` computes and the lowering
prices its compute instructions from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, slots=True)
class Block:
    """One sub-block's forward cost and what its forward leaves saved for backward."""

    op: str  # op class: gemm, attention, elementwise, embedding, loss
    flops: float
    bytes: float  # memory traffic of the forward's memory-bound kernels
    saved: float  # activation bytes kept from forward to backward
    bwd: Optional[float] = None  # memory traffic of the backward's memory-bound kernels; None: 2x forward
    # transient bytes the backward holds beyond `saved` at its peak: the residual stream's gradient
    # carried through the layer, the incoming and input gradients, intermediate activation gradients,
    # and (autograd without fused wgrad) the largest weight-gradient temporary. Weight gradients that
    # accumulate in place into main_grad (Megatron's gradient_accumulation_fusion) count nothing here.
    bwd_workspace: float = 0.0
    # Split by a zero-bubble schedule (`Schedule.splits_backward`) into the input-gradient pass
    # and the weight-gradient pass: the latter's GEMM FLOPs and memory traffic (parts of the backward's),
    # its weight-gradient temporary (part of `bwd_workspace`) and the output gradients it reads, which
    # the input-gradient pass leaves kept until it runs
    wgrad_flops: float = 0.0
    wgrad_bytes: float = 0.0
    wgrad_tmp: float = 0.0
    grad_out: float = 0.0
    # the part of `saved` that only the input-gradient pass reads: what the ops between the block's
    # output and its last weight GEMM saved (an activation function's input, softmax probabilities,
    # dropout masks, the MoE combine's operands). A zero-bubble schedule frees it there and keeps the
    # rest, which the weight pass's autograd graph still holds, until that pass; a block without
    # weights frees all it saved there.
    bwd_only: float = 0.0
    # backward FLOPs per forward FLOP: a matmul's backward is two matmuls (input and weight gradients);
    # a fused attention kernel's backward is five against its forward's two (FlashAttention recomputes
    # the scores Q.K^T, then dV, dP, dQ, dK: Dao 2023, Algorithm 2), 2.5x
    bwd_flop_ratio: float = 2.0
    # a fused attention kernel on a GPU: the keys its average query attends to, which sets how far the
    # kernel's inner loop amortises its prologue and epilogue (simexec.sim.compute); 0 elsewhere
    keys: float = 0.0
    # a grouped GEMM (the routed experts): how many GEMMs of equal size its FLOPs split into, which sets
    # the size each runs at (simexec.sim.compute); 0: one GEMM per kernel, sized by the block's FLOPs
    gemm_groups: float = 0.0

    @property
    def kept_for_weight_pass(self) -> float:
        """Saved bytes that live until the weight-gradient pass under a zero-bubble schedule."""
        return self.saved - self.bwd_only if self.wgrad_flops else 0.0

    @property
    def bwd_flops(self) -> float:
        return self.bwd_flop_ratio * self.flops

    @property
    def bwd_bytes(self) -> float:
        return 2.0 * self.bytes if self.bwd is None else self.bwd


def gemm_cost(m: float, k: float, n: float, dt: int) -> tuple[float, float]:
    """FLOPs and operand bytes of an (m x k) @ (k x n) matmul."""
    return 2.0 * m * k * n, dt * (m * k + k * n + m * n)


def ln_bytes(tokens: float, h: float, dt: int, sp: int) -> float:
    """One [tokens, h] activation on this rank (split by sequence parallelism)."""
    return tokens * h * dt / sp
