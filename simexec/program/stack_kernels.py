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
from simexec.specs.stack import DEFAULT_STACK, STACKS, Fp8Recipe


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
    fwd_transient: float = 0.0  # made by the forward before what it saves, freed once the loss is computed
    bwd_first: float = 0.0  # of `bwd_workspace`, what the backward makes first and holds while it makes the rest


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
      it and the saved output (8 B held beyond it), then casts to dt. The logits and their fp32 copy are
      made before the saved output and freed after it (torchtitan's train.py: the copy is the loss's
      argument, `del pred` follows the loss), so the backward's first gradient (nll's, 4 B) finds their
      place free and its second does not: the caching allocator reserves beyond the tensors there
      (`fwd_transient`, `bwd_first`; torch/nn/functional.py cross_entropy -> log_softmax, nll_loss;
      nll_loss_backward's grad_input = zeros_like(self), then _log_softmax_backward_data's output). Vocabulary-parallel (torchtitan
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
                                12.0 if vocab_parallel else 8.0, dt if low else 4.0, 4.0,
                                fwd_transient=dt + (4.0 if low else 0.0), bwd_first=4.0)
    if kind == "compiled":
        return CrossEntropyCost(0.0, 2 * dt, 2 * dt, dt, dt, dt, dt)
    raise ValueError(f"unknown cross entropy {kind!r}")


MXFP8_BLOCK = 32  # elements per E8M0 scale (transformer_engine/pytorch/constants.py, MXFP8_BLOCK_SCALING_SIZE)


def fp8_copies(recipe: Fp8Recipe, any_layout: bool, both_layouts: bool) -> int:
    """FP8 copies a cast writes of one bf16 tensor. One layout: one. Both (an operand used by a GEMM and
    by its transposed use in the backward): a per-tensor scale serves either use, so where the GEMM takes
    any layout (Blackwell: transformer_engine/pytorch/utils.py is_non_tn_fp8_gemm_supported) one copy
    backs both (Float8CurrentScalingQuantizer.inner_tensor_specs, tensor/float8_tensor.py: `_data` only);
    on TN-only GEMMs (Hopper) a transposed copy. A block-scaled tensor's scales run along the GEMM's
    reduction axis, which the transposed use swaps: two copies whatever the GEMM takes (MXFP8's
    `_rowwise_data` and `_columnwise_data`, tensor/mxfp8_tensor.py; the 1x128 blocks' columnwise copy)."""
    if not both_layouts:
        return 1
    if recipe.scaling in ("mxfp8", "blockwise"):
        return 2
    return 1 if any_layout else 2


def fp8_scale_bytes(recipe: Fp8Recipe) -> float:
    """Scale bytes per element of one FP8 copy: one E8M0 byte per 32 elements for MXFP8
    (`_rowwise_scale_inv` [rows, cols / 32] uint8, tensor/mxfp8_tensor.py), an fp32 per 128 for
    blockwise; per-tensor scales are one number."""
    return {"mxfp8": 1.0 / MXFP8_BLOCK, "blockwise": 4.0 / 128}.get(recipe.scaling, 0.0)


def fp8_cast_bytes(recipe: Fp8Recipe, any_layout: bool, both_layouts: bool = True) -> float:
    """HBM bytes per element of the kernels that cast one bf16 tensor to FP8: read it (2), under
    per-tensor current scaling read it once more for the amax first (2; Float8CurrentScalingQuantizer
    computes the amax, then casts), and write each FP8 copy (1) with its scales."""
    amax = 2.0 if recipe.scaling == "current" else 0.0
    return 2.0 + amax + fp8_copies(recipe, any_layout, both_layouts) * (1.0 + fp8_scale_bytes(recipe))


def fp8_norm_input_bytes(recipe: Fp8Recipe, any_layout: bool) -> float:
    """Cast bytes per element of a GEMM input that a fused norm produces, beyond the norm's own bf16-sized
    output, as Transformer Engine's rmsnorm_fwd / layernorm_fwd choose (pytorch/csrc/extensions/
    normalization.cpp): delayed scaling, FULLY_FUSED, the norm writes FP8 and on TN-only GEMMs the
    transposed copy costs its byte; current scaling, FUSED_NORM_AMAX_FP8, the norm writes bf16 and
    its amax and a cast reads it back (the scale needs the whole tensor's amax first); MXFP8 and
    blockwise, UNFUSED unless NVTE_NORM_FWD_USE_CUDNN is set (Megatron-Bridge's Llama recipes do not),
    a whole cast."""
    if recipe.scaling == "current":
        return fp8_cast_bytes(recipe, any_layout) - 2.0
    if recipe.scaling in ("mxfp8", "blockwise"):
        return fp8_cast_bytes(recipe, any_layout)
    return fp8_copies(recipe, any_layout, True) - 1.0


class FrameworkKernels:
    """The stack's share of a layer's blocks."""

    def fp8_casts(self, m: float, k: float, n: float, after_norm: bool = False, weights: float = -1.0
                  ) -> tuple[float, float]:
        """(forward, backward) bytes of the casts one linear GEMM (m x k) @ (k x n) needs under an FP8
        recipe (`Fp8Recipe`), 0 without one; `fp8_cast_bytes` prices one element. Forward: the input
        (after a norm that writes FP8, only what the fusion leaves: `fp8_norm_input_bytes`) and the
        weights (`weights` elements, default k x n; once per step where cached, so a micro-batch's
        share); backward: the output gradient in both layouts, and where the stack's cast writes one
        layout only, the input and weights again along the other axis."""
        r = self.fp8
        if r is None:
            return 0.0, 0.0
        w = k * n if weights < 0 else weights
        any_layout = self.rp.cluster.device.fp8_gemm_any_layout
        both = fp8_cast_bytes(r, any_layout, both_layouts=True)
        one = fp8_cast_bytes(r, any_layout, both_layouts=False)
        separate = not r.cast_writes_transpose and both > one  # the other layout is a second cast, later
        first = one if separate else both
        x = fp8_norm_input_bytes(r, any_layout) if after_norm and r.norm_cast_fused else first
        per_weight = first / (self.rp.micro_batches if r.weights_cast_once_per_step else 1)
        if self.rp.plan.fp8_param_gather:  # the gathered weights are FP8 already; the shard's cast is 1/dp of it
            per_weight = 0.0
        fwd = x * m * k + per_weight * w
        bwd = (one + one if separate else both) * m * n
        if separate:
            bwd += one * (m * k + w)
        return fwd, bwd

    def saved_linear_input(self, elements: float) -> float:
        """Bytes a linear layer keeps of its `elements`-element input for its weight gradient: the FP8 copy
        in one layout with its scales where the stack keeps that (`Fp8Recipe.saves_fp8_input`), else the
        input as computed."""
        if not self.keeps_fp8_inputs:
            return elements * self.dt
        return elements * (1.0 + fp8_scale_bytes(self.fp8))

    @property
    def keeps_fp8_inputs(self) -> bool:
        """Linear layers keep FP8 copies of their inputs for the backward (`Fp8Recipe.saves_fp8_input`)."""
        return self.fp8 is not None and self.fp8.saves_fp8_input

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

    @property
    def op_saves_attention(self) -> bool:
        """Whether `recompute=op` saves the attention kernel's outputs: the kernel the stack runs on this
        device (`StackSpec.attention_kernel_on`) is one its policy names (`op_sac_saved_attention`)."""
        stack = self.rp.stack
        return stack.attention_kernel_on(self.rp.cluster.device) in stack.op_sac_saved_attention

    def op_recomputed(self, i: int) -> dict[str, Block]:
        """What `recompute=op` runs again before layer i's backward, per block: torchtitan's policy
        (torchtitan/distributed/activation_checkpoint.py, `_get_custom_policy`) saves the outputs of the
        attention kernel and of the matmuls, except every second matmul a block runs, and recomputes the
        rest. A Llama layer's matmuls run wq, wk, wv, wo, w1, w3, w2 (w1, w2 without gating): wk, wo and w3
        (w2) are recomputed, with every element-wise kernel, and the attention kernel where the policy does
        not name it (`op_saves_attention`). Blocks whose matmuls do not follow that order (MoE, MLA)
        recompute half their FLOPs. What the kept matmul outputs hold is counted as the blocks' saved
        activations."""
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
            elif b.op == "attention" and not self.op_saves_attention:
                out[name] = replace(b, saved=0.0)
        return out

    def op_kept(self, i: int) -> float:
        """What `recompute=op` keeps of layer i's activations from its forward to its backward: the layer's
        input (the region's), the kept matmuls' outputs (wq's, wv's; w1's, or without gating fc1's; w2's,
        which no backward reads, only where the stack keeps unread outputs: `op_sac_keeps_unread`) and,
        where the policy saves it (`op_saves_attention`), the attention kernel's output with its
        log-sum-exp; the recomputed blocks' outputs and every element-wise output are made again. Blocks
        that do not follow a Llama layer's order (MoE, MLA) keep half of what they save."""
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        blocks = self.layer(i)
        if m.is_moe_layer(i) or m.is_mla:
            return self.hidden_bytes + sum(b.saved for b in blocks.values()) / 2
        q, kv, _ = m.attention_widths
        unread = T * h if m.gated and self.rp.stack.op_sac_keeps_unread else 0.0  # w2's output
        matmuls = T * (q + kv / 2) / t + T * m.ffn / t + unread
        attention = T * m.heads * m.value_head_dim / t * dt + T * m.heads / t * 4 if self.op_saves_attention else 0.0
        return self.hidden_bytes + matmuls * dt + attention
