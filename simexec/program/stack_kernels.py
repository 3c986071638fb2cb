"""What a training framework's kernels add to a layer's blocks (`simexec.specs.stack`): the casts of an FP8
recipe around each linear GEMM, the element-wise kernels it launches beyond Megatron-Core's fused ones,
what its per-operator checkpointing runs again before a layer's backward, and what its cross-entropy
kernels move and keep (`cross_entropy_cost`).

A mixin of `simexec.program.blocks.Anatomy`, whose sizes (`tokens`, `h`, `dt`, `tp`, `sp_div`) and
blocks it reads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from simexec.program.block import Block
from simexec.specs.stack import DEFAULT_STACK, STACKS


@dataclass(frozen=True)
class CrossEntropyCost:
    """A cross entropy's memory traffic and what it holds, in bytes per logit of this rank."""

    head_cast: float  # the head's output cast to fp32 by a kernel of its own, ahead of the loss
    fwd: float  # the loss kernels' traffic, forward
    bwd: float  # ... backward, through the logits' gradient in the head's dtype
    saved: float  # kept from the forward to the backward
    bwd_workspace: float  # held beyond `saved` at the loss backward's peak
    grad_out: float  # the logits' gradient the head's GEMMs read, beyond `saved`
    released: float  # of `saved`, what the loss backward frees before a weight-gradient pass


def cross_entropy_cost(kind: str, dt: float, vocab_parallel: bool = False) -> CrossEntropyCost:
    """What a stack's cross entropy (`StackSpec.cross_entropy`) costs over logits of `dt` bytes;
    `vocab_parallel`: the logits are sharded over tp along the vocabulary.

    native: Megatron's vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py): the
      logits cast to fp32, max, subtract, exp in place, sum, divide (32 B); the fp32 exp(z) saved; its
      backward scales it in place and casts the gradient to dt.
    te: Transformer Engine's Triton kernel (transformer_engine/pytorch/cross_entropy.py, Megatron's
      cross_entropy_fusion_impl="te"): one pass for max and sum, one that writes the gradient into the
      logits in place (3 dt); the backward scales that gradient (2 dt); nothing in fp32.
    eager: torch's `cross_entropy(logits.float(), labels)` unfused (torchtitan's loss, uncompiled): the
      fp32 copy, a log-softmax that reads its input three times and writes its fp32 output (16 B), which
      it saves; the backward writes nll's dense fp32 gradient, log-softmax's fp32 input gradient beside
      it and the saved output (8 B held beyond it), then casts to dt. Vocabulary-parallel (torchtitan
      with tp: `loss_parallel()`, whose DTensor handlers replace the kernels,
      torch/distributed/tensor/parallel/loss.py): the backward `_nll_loss_and_log_softmax_backward`
      makes `(grad_input + torch.exp(x)) * grad_output` from the saved output x: the dense one-hot
      `grad_input`, `exp(x)` and their sum, then the sum and the product beside `grad_input`: 12 B
      held beyond the saved output, 4 B more than the unsharded kernels (the traffic is left as theirs).
    compiled: the same under torch.compile (Inductor): the forward reads the dt logits twice and saves
      them; the backward reads them and writes the dt gradient in one kernel.
    """
    low = dt < 4  # a 16-bit head: casts to and from fp32 exist
    if kind == "native":
        return CrossEntropyCost(dt + 4, 32.0, 8.0 + 4.0 + dt, 4.0, dt if low else 0.0, dt if low else 0.0,
                                4.0 if low else 0.0)
    if kind == "te":
        return CrossEntropyCost(0.0, 3 * dt, 2 * dt, dt, 0.0, 0.0, 0.0)
    if kind == "eager":
        return CrossEntropyCost(dt + 4 if low else 0.0, 16.0, 4.0 + 16.0 + (4.0 + dt if low else 0.0), 4.0,
                                12.0 if vocab_parallel else 8.0, dt if low else 4.0, 4.0)
    if kind == "compiled":
        return CrossEntropyCost(0.0, 2 * dt, 2 * dt, dt, dt, dt, dt)
    raise ValueError(f"unknown cross entropy {kind!r}")


class FrameworkKernels:
    """The stack's share of a layer's blocks."""

    def fp8_casts(self, m: float, k: float, n: float, after_norm: bool = False, weights: float = -1.0
                  ) -> tuple[float, float]:
        """(forward, backward) bytes of the casts one linear GEMM (m x k) @ (k x n) needs under an FP8
        recipe (`Fp8Recipe`), 0 without one. A cast reads bf16 and writes FP8 (3 bytes per element),
        plus one more read of the bf16 tensor for its amax under per-tensor current scaling; its
        transposed copy is one more byte in the same kernel (TE's cast_transpose) or, without that
        kernel, a second cast in the backward. Forward: the input (none where the norm before it
        writes FP8) and the weights (`weights` elements, default k x n; once per step where cached,
        so a micro-batch's share); backward: the output gradient in both layouts, and without the
        fused transpose, the input and weights again along the other axis."""
        r = self.fp8
        if r is None:
            return 0.0, 0.0
        w = k * n if weights < 0 else weights
        cast = 3.0 + (2.0 if r.scaling == "current" else 0.0)
        transpose = 1.0 if r.cast_writes_transpose else 0.0
        fused_input = after_norm and r.norm_cast_fused
        per_weight = (cast + transpose) / (self.rp.micro_batches if r.weights_cast_once_per_step else 1)
        if self.rp.plan.fp8_param_gather:  # the gathered weights are FP8 already; the shard's cast is 1/dp of it
            per_weight = 0.0
        fwd = ((0.0 if fused_input else cast) + transpose) * m * k + per_weight * w
        bwd = (cast + (transpose or cast)) * m * n
        if not r.cast_writes_transpose:
            bwd += cast * (m * k + w)
        return fwd, bwd

    def with_fp8_casts(self, block: Block, *gemms: tuple) -> Block:
        """`block` with the FP8 casts of its linear GEMMs (`fp8_casts` arguments each) added to its traffic."""
        if self.fp8 is None:
            return block
        f = b = 0.0
        for g in gemms:
            df, db = self.fp8_casts(*g)
            f, b = f + df, b + db
        return replace(block, bytes=block.bytes + f, bwd=block.bwd_bytes + b)

    def with_stack_elementwise(self, blocks: dict[str, Block]) -> dict[str, Block]:
        """The blocks with the element-wise traffic the stack's kernels move beyond the fused kernels they
        count (`StackSpec.layer_elementwise` against Megatron-Core's), half on the attention's opening
        block and half on the MLP's; none on CPU ranks, whose operators the host model prices."""
        own, ref = self.rp.stack.layer_elementwise, STACKS[DEFAULT_STACK].layer_elementwise
        if self.eager_kernels or own == ref:
            return blocks
        unit = self.tokens * self.h * self.dt / self.sp_div
        fwd, bwd = (own.fwd_units - ref.fwd_units) * unit / 2, (own.bwd_units - ref.bwd_units) * unit / 2
        out = dict(blocks)
        for name in ("qkv", "fc1" if "fc1" in blocks else "router"):
            b = out[name]
            out[name] = replace(b, bytes=max(0.0, b.bytes + fwd), bwd=max(0.0, b.bwd_bytes + bwd))
        return out

    def with_sp_layout_copies(self, blocks: dict[str, Block], moe: bool) -> dict[str, Block]:
        """The blocks with the memory passes a stack adds around each sequence-parallel collective, forward
        and backward (the backward of an all-gather is a reduce-scatter and the other way round).
        Without tp_async, a stack whose sequence parallelism shards dim 1 (`StackSpec.sp_layout_copies`)
        reads and writes the gathered hidden tensor once per collective (the backward of the chunk-and-cat
        is one too). Under tp_async as torch runs it (`tp_async_local_reduce`) the gathers copy nothing,
        and each reduce-scatter ends in a kernel that reads the tp stacked partials and writes this
        rank's share. Two collectives open and close the attention and two the MLP (none around a folded
        MoE's experts): their passes go on the blocks that open each, on the same stream as the GEMMs."""
        p, stack = self.rp.plan, self.rp.stack
        if self.eager_kernels or not (p.sp and p.tp > 1):
            return blocks
        full = self.tokens * self.h * self.dt
        if p.tp_async:
            per_pair = (1.0 + 1.0 / p.tp) * full if stack.tp_async_local_reduce else 0.0
        else:
            per_pair = 2 * 2.0 * full if stack.sp_layout_copies else 0.0
        if per_pair <= 0:
            return blocks
        out = dict(blocks)
        opening = ["qkv"] + ([] if moe and self.moe_without_tp else ["fc1" if "fc1" in blocks else "router"])
        for name in opening:  # one gather and one reduce-scatter each way
            b = out[name]
            out[name] = replace(b, bytes=b.bytes + per_pair, bwd=b.bwd_bytes + per_pair)
        return out

    def op_recomputed(self, i: int) -> dict[str, Block]:
        """What `recompute=op` runs again before layer i's backward, per block: torchtitan's policy
        (torchtitan/distributed/activation_checkpoint.py, `_get_custom_policy`) saves the outputs of the
        attention kernel and of the matmuls, except every second matmul a block runs, and recomputes the
        rest. A Llama layer's matmuls run wq, wk, wv, wo, w1, w3, w2 (w1, w2 without gating): wk, wo and w3
        (w2) are recomputed, with every element-wise kernel. Blocks whose matmuls do not follow that order
        (MoE, MLA) recompute half their FLOPs. What the kept matmul outputs hold is counted as the blocks'
        saved activations."""
        m = self.rp.model
        q, kv, _ = m.attention_widths  # kv: K and V together
        shares = {"qkv": kv / 2 / (q + kv) if not m.is_mla else 0.5, "proj": 1.0,
                  "fc1": 0.5 if m.gated else 0.0, "fc2": 0.0 if m.gated else 1.0}
        out = {}
        for name, b in self.layer(i).items():
            if b.op == "gemm" and b.flops:
                share = shares.get(name, 0.5)
                out[name] = Block("gemm", share * b.flops, b.bytes, 0.0)
            elif b.op == "elementwise":
                out[name] = Block(b.op, 0.0, b.bytes, 0.0)
        return out

    def op_kept(self, i: int) -> float:
        """What `recompute=op` keeps of layer i's activations from its forward to its backward: the layer's
        input (the region's), the kept matmuls' outputs (wq's, wv's; w1's and w2's, or without gating fc1's)
        and the attention kernel's output with its log-sum-exp; the recomputed blocks' outputs and every
        element-wise output are made again. Blocks that do not follow a Llama layer's order (MoE, MLA)
        keep half of what they save."""
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        blocks = self.layer(i)
        if m.is_moe_layer(i) or m.is_mla:
            return self.hidden_bytes + sum(b.saved for b in blocks.values()) / 2
        q, kv, _ = m.attention_widths
        matmuls = T * (q + kv / 2) / t + (T * m.ffn / t + T * h if m.gated else T * m.ffn / t)
        attention = T * m.heads * m.value_head_dim / t * dt + T * m.heads / t * 4
        return self.hidden_bytes + matmuls * dt + attention
