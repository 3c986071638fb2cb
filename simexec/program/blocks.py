"""Anatomy of one transformer layer on one rank: FLOPs, bytes moved and saved activations per sub-block.

Sub-blocks are cut where Megatron-style tensor parallelism communicates (docs/program.md), so
every number here is for one micro-batch on one rank after the plan's tp/sp/cp/ep splits.
Activation bytes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", §4, Table 2): per layer s·b·h·(34 + 5·a·s/h) bytes with 2-byte activations,
10 + 24/t under tensor parallelism, 34/t with sequence parallelism; with a fused (Flash) attention
kernel the 5·a·s²·b term of the materialised softmax disappears.

A block is a chain of kernels: tensor-core GEMMs (`flops`, priced at the GEMM efficiency for their
size, which holds their operand traffic) and the memory-bound kernels around them (`bytes`: norms,
bias adds, activation functions, dropout, residual adds, softmax, layout copies, rotary embedding,
weight-gradient accumulation), the kernels of Megatron-LM's GPT layer (Shoeybi et al. 2019;
Narayanan et al. 2021: fused bias+GeLU, fused bias+dropout+add, fused scale-mask-softmax, apex
LayerNorm). Each memory-bound kernel is counted by what it reads and writes once from HBM; the
backward bytes are counted kernel by kernel, not as a multiple of the forward. Without a fused
attention kernel (`flash_attention=0`, Megatron-LM 2021) the attention core is two batched GEMMs
over the full s x s scores (the causal mask does not skip work) around a softmax and a dropout that
each stream the a·s²·b scores through HBM (Dao et al. 2022, §2.2).
"""
from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import Optional

from simexec.program.block import Block, gemm_cost
from simexec.program.layer_order import LayerStep, layer_steps
from simexec.program.moe_blocks import MoEBlocks
from simexec.program.selective_recompute import SelectiveRecompute
from simexec.program.stack_kernels import CrossEntropyCost, FrameworkKernels, cross_entropy_cost
from simexec.specs.model import keys_per_query
from simexec.specs.plan import ResolvedPlan


FUSED_ATTENTION_BWD_RATIO = 2.5
HIGH_PRECISION_GEMM = "gemm_bf16"  # op class of a GEMM an FP8 recipe leaves in bf16


class Anatomy(FrameworkKernels, MoEBlocks, SelectiveRecompute):
    """Per-rank block costs for one resolved plan (computed once, looked up per instruction)."""

    def __init__(self, rp: ResolvedPlan):
        self.rp = rp
        m, p = rp.model, rp.plan
        self.dt = rp.dtype_bytes
        self.tp, self.cp, self.ep = p.tp, p.cp, p.ep
        # what an expert's FFN width is split by: etp under parallel folding, else tp
        self.etp = rp.expert_tp
        self.seq = rp.seq_len
        self.tokens = p.mbs * rp.seq_len // p.cp  # tokens of one micro-batch on one cp rank
        self.sp_div = p.tp if p.sp else 1  # what sequence parallelism divides replicated activations by
        # Megatron's sequence-parallel layout: each norm runs on this rank's slice of the sequence, in a
        # block of its own between the g-conjugate's reduce-scatter and the f-conjugate's all-gather,
        # and the column-parallel GEMM after it saves its input as that slice (re-gathered for the
        # weight gradient in the backward: `lower`'s `*_regather` all-gathers)
        self.sp = bool(p.sp)
        self.h = m.hidden
        self.grad_dt = 4 if p.dtype == "fp32" else 2
        # the sum weight gradients accumulate into over micro-batches: fp32 under `grad_fp32`
        self.acc_dt = rp.grad_bytes
        # dropout on the attention probabilities and the residual branches (ModelSpec.dropout: 0.1 for
        # GPT-2/3 and Megatron's GPT, 0 for Llama-style models): its 1-byte masks are kept only when on
        self.dropout = m.dropout > 0
        # CPU ranks (simexec's executor) run PyTorch's eager CPU operators where GPU training stacks
        # run fused kernels (Megatron, TransformerEngine, FlashAttention); each flag below is one
        # thing that changes in what a block holds
        self.eager_kernels = rp.cluster.device.name == "cpu"
        # Megatron / cuBLAS on GPUs accumulate weight gradients in place (fused wgrad into main_grad);
        # autograd on the CPU executor makes each one a temporary, then adds it to .grad
        self.fused_wgrad = not self.eager_kernels
        # fused attention kernels on GPUs skip the tiles a sliding window masks out (FlashAttention's
        # window_size, FlexAttention's block mask); PyTorch's CPU kernel takes the band as a mask and
        # computes every score
        self.skips_masked_tiles = not self.eager_kernels
        # MLA's value heads are narrower than its key heads: GPU kernels take both widths (FlashAttention
        # 3, cuDNN through TransformerEngine); PyTorch's CPU kernel takes one, so V is padded to the key
        # width and the output sliced back (as HF's DeepSeek does for FlashAttention 2)
        self.pads_value_heads = self.eager_kernels
        # ring attention on CPU ranks (simexec's executor) merges the chunks' outputs in fp32 and keeps
        # that output for its backward beside the output projection's copy; TransformerEngine's ring
        # saves the one output both read
        self.ring_keeps_fp32_output = self.eager_kernels
        # the RMSNorm backward of CPU ranks (simexec.exec.nn.gpt._RMSNorm, eager operators) holds three
        # fp32 buffers of its input's size at its worst; Megatron's and TransformerEngine's fused
        # kernels hold none, and torch's CPU layer_norm backward is one kernel
        self.norm_bwd_fp32_buffers = 3 if m.norm == "rmsnorm" and self.eager_kernels else 0
        # and its SwiGLU backward (simexec.exec.nn.gpt._SwiGLU) one buffer of the activation's size
        # beside the two gradients, where Megatron's fused bias-SwiGLU kernel holds none
        self.swiglu_bwd_buffers = 1 if m.gated and self.eager_kernels else 0
        # a norm's statistics per token: RMSNorm's 1/rms in fp32 everywhere (simexec.exec.nn.gpt._RMSNorm
        # too); LayerNorm's mean and 1/std in fp32 on GPUs (Apex, TransformerEngine, torch's CUDA
        # kernel), in the input's type from torch's CPU kernel
        self.norm_stats_per_token = 4.0 if m.norm == "rmsnorm" else 2.0 * (self.dt if self.eager_kernels else 4)
        # a fused attention kernel's backward FLOPs per forward FLOP on GPUs; the CPU executor's
        # attention is priced per operator by the host model (simexec.sim.host), which counts 2
        self.attention_bwd_ratio = 2.0 if self.eager_kernels else FUSED_ATTENTION_BWD_RATIO
        # FP8 training: the linear layers' GEMMs take FP8 operands cast by the stack's recipe; every
        # activation, weight and gradient the program keeps stays bf16 (`dt`)
        self.fp8 = rp.stack.fp8 if p.dtype == "fp8" else None
        # the LM head's GEMM stays in bf16 under FP8 recipes (Megatron-Core's output layer is not a TE module;
        # torchtitan's float8 converter skips `output`: torchtitan/components/quantization/float8.py)
        self.head_op = HIGH_PRECISION_GEMM if self.fp8 else "gemm"
        self._kinds: dict[tuple[bool, Optional[int]], dict[str, Block]] = {}

    # --- memory-bound kernels (bytes read + written) ----------------------------------------------
    def norm_fwd(self) -> float:
        """LayerNorm / RMSNorm: read x, write y (replicated over tp unless sp)."""
        return 2 * self.dt * self.tokens * self.h / self.sp_div

    @cached_property
    def norm_stats(self) -> float:
        """What a norm saves beside its input: its statistics of each token it normalises (this rank's
        slice under sp). Korthikanti et al. leave them out of their per-layer formula as small."""
        return self.tokens / self.sp_div * self.norm_stats_per_token

    @property
    def opening_stats(self) -> float:
        """The statistics of the norm that opens a column-parallel block (under sp, its own block's)."""
        return 0.0 if self.sp else self.norm_stats

    def norm_bwd(self) -> float:
        """Norm backward (read x, dy; write dx) + the residual stream's gradient sum (read 2, write 1)."""
        return 6 * self.dt * self.tokens * self.h / self.sp_div

    def opening_norm(self) -> tuple[float, float]:
        """(forward, backward) bytes of the norm that opens a column-parallel block; nothing under sp,
        where the norm is a block of its own (`sp_norm`)."""
        return (0.0, 0.0) if self.sp else (self.norm_fwd(), self.norm_bwd())

    def residual_fwd(self) -> float:
        """(bias +) dropout + residual add: read branch and residual, write the sum (+ a 1-byte mask)."""
        n = self.tokens * self.h / self.sp_div
        return 3 * self.dt * n + (n if self.dropout else 0.0)

    def residual_bwd(self, bias: bool) -> float:
        """Dropout backward (read dy and the mask, write dx); the bias gradient reads dy once more."""
        n = self.tokens * self.h / self.sp_div
        if not self.dropout:
            return self.dt * n if bias else 0.0
        return (2 * self.dt + 1) * n + (self.dt * n if bias else 0.0)

    def weight_grad_bytes(self, params: float) -> float:
        """Accumulating a weight gradient over micro-batches: read the sum and the new one, write the sum
        (the sum in fp32 under `grad_fp32`: 10 bytes per parameter instead of 6)."""
        return (2 * self.acc_dt + self.grad_dt) * params

    # --- activations crossing block boundaries -------------------------------------------------------
    @cached_property
    def hidden_bytes(self) -> float:
        """One [s/cp, b, h] activation, as it crosses a block boundary on this rank (split by sp)."""
        return self.tokens * self.h * self.dt / self.sp_div

    @cached_property
    def full_hidden_bytes(self) -> float:
        """The same activation gathered over the tp group (what tp all-reduces move)."""
        return self.tokens * self.h * self.dt

    @cached_property
    def n_logits(self) -> float:
        """The head's logits on this rank: its tokens times its shard of the vocabulary."""
        return self.tokens * self.rp.model.vocab / self.tp

    @cached_property
    def cross_entropy(self) -> CrossEntropyCost:
        """The stack's cross entropy over this rank's logits; simexec's executor's on CPU ranks (native)."""
        kind = "native" if self.eager_kernels else self.rp.stack.cross_entropy
        return cross_entropy_cost(kind, self.dt, vocab_parallel=self.tp > 1)

    @property
    def loss_fwd_transient(self) -> float:
        """What the loss's forward makes before what it saves and frees after (`CrossEntropyCost.fwd_transient`)."""
        return self.cross_entropy.fwd_transient * self.n_logits

    @property
    def loss_grad_first(self) -> float:
        """The loss backward's first gradient, held while it makes the rest (`CrossEntropyCost.bwd_first`)."""
        return self.cross_entropy.bwd_first * self.n_logits

    @cached_property
    def logits_released(self) -> float:
        """What the loss saved of the logits (Megatron's fp32 exp(z)) that the backward lets go once it
        has made their gradient in the head's dtype, before any weight-gradient pass."""
        return self.cross_entropy.released * self.n_logits

    def freed_by_input_pass(self, i: int) -> float:
        """Under a zero-bubble schedule, what layer i's input-gradient pass frees of its saved bytes;
        the rest lives until its weight pass."""
        return sum(b.saved - b.kept_for_weight_pass for b in self.layer(i).values())

    @cached_property
    def attended_kv_width(self) -> float:
        """Elements per token of K and V together as the attention kernel takes them: the model's grouped
        heads, or one per query head where the stack repeats them first (`StackSpec.expands_kv_heads`)."""
        m = self.rp.model
        kv = m.attention_widths[1]
        if self.rp.stack.expands_kv_heads and not m.is_mla and m.kv_head_count < m.heads:
            return kv * m.heads / m.kv_head_count
        return kv

    @cached_property
    def kv_bytes(self) -> float:
        """K and V of the whole sequence for this rank's heads, as the kernel takes them (what cp all-gathers)."""
        return self.rp.plan.mbs * self.seq * self.attended_kv_width * self.dt / self.tp

    @cached_property
    def heads_exchange_bytes(self) -> tuple[float, float]:
        """cp_impl=a2a (DeepSpeed-Ulysses): what one rank's two all-to-alls over cp move per layer and
        micro-batch, each way: q, k and v of its tokens for its heads (sequence-split in, heads-split out),
        and the attention's output (heads-split in, sequence-split out)."""
        q, kv, o = self.rp.model.attention_widths
        per_token = self.tokens * self.dt / self.tp
        return (q + kv) * per_token, o * per_token

    def exchange_bytes(self, name: str, ep_net_ranks: int = 1) -> float:
        """What one rank's exchange `name` (a `LayerStep` on the cp, ep or etp axis) moves: a collective's
        buffer as `simexec.sim.network` takes it, an all-gather's gathered tensor, an all-to-all's send
        buffer, per `Plan.moe_dispatcher`. `ep_net_ranks`: the size of the rank's `ep_net` group (the
        NVLink domains DeepEP's network hop spans; above 1 the deepep dispatch and combine are its NVLink
        hop). The lowering and the search's bounds both read it."""
        dispatcher = self.rp.plan.moe_dispatcher
        if name in ("dispatch", "combine") and dispatcher == "deepep" and ep_net_ranks > 1:
            return self.deepep_domain_bytes
        if name in ("dispatch", "combine"):
            return self.gathered_tokens_bytes if dispatcher == "allgather" else self.dispatch_bytes
        if name in ("dispatch_net", "combine_net"):
            return self.deepep_network_bytes(ep_net_ranks)
        if name in ("etp_in", "etp_out"):
            return self.gathered_tokens_bytes * self.etp if dispatcher == "allgather" else self.etp_gathered_bytes
        if name == "kv":
            return self.kv_bytes
        return self.heads_exchange_bytes[0 if name == "heads_in" else 1]

    # --- blocks --------------------------------------------------------------------------------------
    @property
    def dense(self) -> dict[str, Block]:
        """A dense layer's blocks, attending to the whole context."""
        return self.blocks(False, None)

    @property
    def moe(self) -> dict[str, Block]:
        """An MoE layer's blocks, attending to the whole context."""
        return self.blocks(True, None)

    def blocks(self, moe: bool, window: Optional[int]) -> dict[str, Block]:
        """The blocks of a layer with an MoE or a dense MLP, and attention over `window` keys (None:
        the whole context); computed once per kind."""
        key = (moe, window)
        if key not in self._kinds:
            attention = self._attention(window)
            blocks = self._with_workspace({**attention, **(self.moe_mlp() if moe else self._mlp())})
            self._kinds[key] = self.with_sp_layout_copies(self.with_stack_elementwise(blocks), moe)
        return self._kinds[key]

    # --- backward workspace ------------------------------------------------------------------------------
    def wgrad_tmp(self, *params: float) -> float:
        """The largest weight-gradient temporary of a block (0 with fused wgrad)."""
        return 0.0 if self.fused_wgrad or not params else max(params) * self.grad_dt

    def norm_bwd_temps(self, elems: float) -> float:
        """The temporaries a norm's backward over `elems` input elements holds at its worst, beside the
        incoming gradient (its own output among them); 0 for a fused kernel."""
        return self.norm_bwd_fp32_buffers * 4.0 * elems

    def bwd_workspaces(self, moe: bool = False) -> dict[str, float]:
        """Per block, the transient bytes its backward holds at its peak beyond what it saved (see
        Block.bwd_workspace). n_s: the residual stream's gradient on this rank (split by sp), carried
        through a layer's backward; n: a gathered hidden gradient (a column-parallel GEMM's input
        gradient before the f-conjugate's all-reduce / reduce-scatter)."""
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        n_s, n = self.hidden_bytes, self.full_hidden_bytes
        qk, v = m.qk_head_dim, m.value_head_dim
        ctx = T * m.heads * v * dt / t
        w_q, w_kv, _ = m.attention_widths
        qkv = T * (w_q + w_kv) * dt / t
        attended = T * (w_q + self.attended_kv_width) * dt / t  # the kernel's dQ, dK, dV
        o_params = m.heads * v * h
        qkv_params = m.attention_matmul_params() - o_params
        latent = m.latent_matmul_params()
        # a block that opens with a norm (without sp) runs the norm's backward last, on the GEMM's
        # input gradient n with the residual stream's gradient carried beside it
        opening_norm = 0.0 if self.sp else n_s + n + self.norm_bwd_temps(T * h)
        inner_norms = max(self.norm_bwd_temps(T * (m.q_lora_rank or 0)), self.norm_bwd_temps(T * (m.kv_lora_rank or 0)),
                          self.norm_bwd_temps(T * max(m.heads, m.kv_heads) / t * qk) if m.qk_norm else 0.0)
        ws = {
            "proj": n_s + ctx + self.wgrad_tmp(o_params / t),
            "qkv": max(n_s + qkv + n + self.wgrad_tmp((qkv_params - latent) / t + latent), n_s + qkv + inner_norms,
                       opening_norm),
        }
        if self.sp:  # a norm on the sequence slice: its input gradient
            ws["norm1"] = ws["norm2"] = n_s + self.norm_bwd_temps(T * h / self.sp_div)
        if self.rp.plan.flash_attention:
            ws["attn"] = n_s + ctx + attended + T * m.heads * (qk + 2) * 4 / t  # dO, dQ/dK/dV, fp32 dQ accumulator, delta
        else:
            ws["attn"] = n_s + ctx + attended + 2 * T * self.seq * m.heads * dt / t  # dP and dS over the scores
        if self.cp > 1 and self.rp.plan.cp_impl == "allgather":
            # the gathered K/V's gradients, whole, until their reduce-scatter; on CPU ranks twice: the
            # executor's gathered K/V is a strided view (the all-gather's output moved back to the
            # sequence dimension), so autograd copies the kernel's gradient into that layout
            ws["attn"] += T * self.attended_kv_width * dt / t * ((self.cp - 1) + (self.cp if self.eager_kernels else 0))
        if not moe:
            width = m.ffn * (2 if m.gated else 1) / t
            ffn = m.ffn / t
            ws["fc2"] = n_s + T * ffn * dt + self.wgrad_tmp(m.ffn * h / t)
            swiglu = T * (ffn + width + self.swiglu_bwd_buffers * ffn) * dt
            ws["fc1"] = max(n_s + max(swiglu, T * width * dt + n) + self.wgrad_tmp(h * width), opening_norm)
        else:
            ws.update(self.moe_workspaces(n_s, n, opening_norm))
        return ws

    def _with_workspace(self, blocks: dict[str, Block]) -> dict[str, Block]:
        ws = self.bwd_workspaces(moe="router" in blocks)
        wp = self.weight_passes(moe="router" in blocks)
        out = {}
        for k, b in blocks.items():
            params, grad_out = wp.get(k, (0.0, 0.0))
            out[k] = replace(b, bwd_workspace=ws.get(k, 0.0), **self._weight_pass(b, params, grad_out))
        return out

    def _weight_pass(self, b: Block, params: float, grad_out: float) -> dict[str, float]:
        """A block's weight-gradient pass: one GEMM per weight GEMM of the forward (its FLOPs), the
        gradient accumulation, autograd's temporary."""
        if not params:
            return {}
        return {"wgrad_flops": b.flops, "wgrad_bytes": self.weight_grad_bytes(params), "wgrad_tmp": self.wgrad_tmp(params),
                "grad_out": grad_out}

    def weight_passes(self, moe: bool = False) -> dict[str, tuple[float, float]]:
        """Per weight-bearing block: (its GEMMs' weight elements on this rank, the output gradients
        its weight-gradient pass reads). Those gradients are the GEMMs' output gradients and, for a
        block opening with a norm (without sp), the norm output's gradient its weights need."""
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        n = self.full_hidden_bytes
        norm = 0.0 if self.sp else n
        o_params = m.heads * m.value_head_dim * h
        latent = m.latent_matmul_params()
        qkv_rank = (m.attention_matmul_params() - o_params - latent) / t + latent
        qkv_out = sum(m.attention_widths[:2]) / t
        out = {"qkv": (qkv_rank, T * qkv_out * dt + norm), "proj": (o_params / t, n)}
        if not moe:
            width = m.ffn * (2 if m.gated else 1) / t
            out["fc1"] = (h * width, T * width * dt + norm)
            out["fc2"] = (m.ffn * h / t, n)
        else:
            out.update(self.moe_weight_passes(norm))
        return out

    def layer(self, i: int) -> dict[str, Block]:
        m = self.rp.model
        return self.blocks(m.is_moe_layer(i), m.attention_window(i, self.seq))

    def layer_steps(self, i: int) -> tuple[LayerStep, ...]:
        """Layer i's blocks in forward order with the collectives between them (`layer_steps`)."""
        p = self.rp.plan
        return layer_steps(self.rp.model.is_moe_layer(i), bool(p.sp), p.cp, p.cp_impl, p.etp or 1, p.moe_dispatcher,
                           not self.moe_without_tp)

    def _keys_per_query(self, window: Optional[int]) -> float:
        """Keys a fused attention kernel computes per query of this rank (load-balanced over cp)."""
        m = self.rp.model
        if not m.causal:
            return float(self.seq)
        if window is not None and not self.skips_masked_tiles:
            return float(self.seq)
        return keys_per_query(self.seq, window)

    def _sdpa_mask(self, window: Optional[int]) -> float:
        """Scores of the boolean mask PyTorch's CPU kernel is given, queries x keys of one sequence: a
        sliding window's band, or the causal mask of local queries against gathered keys (cp_impl=
        allgather). The kernel keeps its additive form, in the compute dtype, for the backward; fused
        GPU kernels take the window or the offsets instead. 0 where no mask is passed."""
        gathered = self.cp > 1 and self.rp.plan.cp_impl == "allgather"
        if not self.eager_kernels or not (window is not None or (gathered and self.rp.model.causal)):
            return 0.0
        return (self.seq / self.cp if gathered else self.seq) * self.seq

    def _attention(self, window: Optional[int]) -> dict[str, Block]:
        m, t, T, dt, h, sp = self.rp.model, self.tp, self.tokens, self.dt, self.h, self.sp_div
        qk, v = m.qk_head_dim, m.value_head_dim
        o_params = m.heads * v * h
        qkv_params = m.attention_matmul_params() - o_params
        latent = m.latent_matmul_params()  # MLA's down projections: every tp rank computes them whole
        qkv_rank = (qkv_params - latent) / t + latent
        f_qkv = 2.0 * T * qkv_rank
        qkv_out = sum(m.attention_widths[:2]) / t
        has_bias = m.bias or m.qkv_bias
        # qkv: norm (its own block under sp), GEMM, bias add (matmul then add: read + write the
        # output), rotary on q and k
        norm_f, norm_b = self.opening_norm()
        ln = T * h * dt / sp  # a norm's saved input (replicated over tp unless sp)
        b_qkv = norm_f + (2 * dt * T * qkv_out if has_bias else 0.0)
        bb_qkv = norm_b + (dt * T * qkv_out if has_bias else 0.0) + self.weight_grad_bytes(qkv_rank)
        if not m.learned_pos:
            rope = 2 * dt * T * (m.heads / t + (m.kv_heads / t if not m.is_mla else 1)) * (m.qk_rope_head_dim or qk)
            b_qkv += rope
            bb_qkv += rope
        if self.attended_kv_width > m.attention_widths[1]:
            # repeat_kv: read K and V, write the repeated copies; the backward sums the copies' gradients back
            repeat = dt * T * (m.attention_widths[1] + self.attended_kv_width) / t
            b_qkv += repeat
            bb_qkv += repeat
        # the norm's output is the GEMM's input: kept as the stack keeps a linear layer's input
        ln_out = self.saved_linear_input(T * h / sp)
        saved_qkv = ln_out if self.sp else ln + ln_out + self.norm_stats
        if m.is_mla:
            # the latents (whole on every tp rank): their norms read and write them and save their input
            # and 1/rms (fp32); the up projections save the normed latents. The rotary and non-rotary
            # parts of q and k, and k beside v, are concatenated per head (read and written).
            lat, norms = (m.q_lora_rank or 0) + m.kv_lora_rank, 2 if m.q_lora_rank else 1
            cat = 2 * dt * T * m.heads * (3 * qk + v) / t
            b_qkv += 2 * dt * T * lat + cat
            bb_qkv += 3 * dt * T * lat + cat
            saved_qkv += T * ((lat + m.qk_rope_head_dim) * dt + 4 * norms) + self.saved_linear_input(T * lat)
        if m.qk_norm:
            # a norm over each q and k head: read and write them; the backward reads the saved input
            # and the output gradient and writes the input gradient; it saves its input and 1/rms (fp32)
            heads_qk = T * (m.heads + m.kv_heads) / t
            b_qkv += 2 * dt * heads_qk * qk
            bb_qkv += 3 * dt * heads_qk * qk
            saved_qkv += heads_qk * (qk * dt + 4)
        q_bytes = T * m.heads * qk * dt / t
        kv_local = T * self.attended_kv_width * dt / t
        saved_attn = q_bytes + kv_local
        if self.cp > 1 and self.rp.plan.cp_impl == "allgather":
            saved_attn += kv_local * (self.cp - 1)  # the attention keeps the gathered K/V for its backward
        ctx_bytes = T * m.heads * v * dt / t
        # whether the attention's backward reads the output the projection saves as its input (a fused
        # kernel's backward reads O) rather than a copy of its own
        shares_output = self.rp.plan.flash_attention
        if self.rp.plan.flash_attention:
            # one fused kernel (FlashAttention): its q/k/v/o traffic is inside its efficiency; causal
            # attention skips the masked half of the scores, a sliding window all but its band. It
            # saves each query row's log-sum-exp (fp32) for its backward
            ctx = self._keys_per_query(window)
            saved_attn += T * m.heads / t * 4
            saved_attn += self._sdpa_mask(window) * dt
            padded = m.is_mla and self.pads_value_heads and v != qk
            f_attn = 2.0 * T * ctx * m.heads * (qk + (qk if padded else v)) / t
            if padded:  # the padded V and the kernel's padded output, which the slice copies out of
                shares_output = False
                saved_attn += 2 * T * m.heads * qk * dt / t
            if self.cp > 1 and self.rp.plan.cp_impl == "ring" and self.ring_keeps_fp32_output:
                saved_attn += T * m.heads * v * 4 / t
            if self.cp > 1 and self.rp.plan.cp_impl == "a2a" and not padded:
                # the kernel keeps its output in the heads-split layout for its backward, while the output
                # projection keeps the all-to-all's sequence-split copy (a padded output is counted above)
                shares_output = False
                saved_attn += ctx_bytes
            attn = Block("attention", f_attn, 0.0, saved_attn, 0.0, bwd_flop_ratio=self.attention_bwd_ratio,
                         keys=0.0 if self.eager_kernels else ctx)
        else:
            # unfused (Megatron-LM 2021): baddbmm Q.K^T over all s x s scores, fused scale-mask-softmax,
            # dropout, bmm with V, then the context is made contiguous again ([b, a, s, d] -> [s, b, h])
            scores = T * self.seq * m.heads / t  # score elements of this rank
            f_attn = 2.0 * T * self.seq * m.heads * (qk + v) / t
            drop_f = (2 * dt + 1) if self.dropout else 0.0
            b_attn = scores * (dt + 2 * dt + drop_f + dt) + 2 * ctx_bytes  # QK^T out, softmax, dropout, PV in
            # PV backward: write dP, read P; dropout bwd; softmax bwd (y, dy -> dx); Q.K^T bwd reads dS twice
            bb_attn = scores * (dt + dt + drop_f + 3 * dt + 2 * dt) + 2 * ctx_bytes
            if not self._selective:
                # softmax output (2 B), dropout mask (1 B), dropout output (2 B) per score: 5·a·s²·b;
                # without dropout the softmax output only (read by both its backward and P.V's)
                per_score = 5.0 * (dt / 2) if self.dropout else dt
                saved_attn += per_score * m.heads * T * self.seq / t
            attn = Block("gemm", f_attn, b_attn, saved_attn, bb_attn)
        f_proj, _ = gemm_cost(T, m.heads * v / t, h, dt)
        b_proj = self.residual_fwd()
        bb_proj = self.residual_bwd(m.bias) + self.weight_grad_bytes(o_params / t)
        mask = T * h / sp if self.dropout else 0.0  # dropout mask, 1 byte per element
        # the projection's input: the context itself where the stack saves it as computed; where it saves an
        # FP8 copy, that copy beside the context the attention's backward still reads
        proj_in = self.saved_linear_input(T * m.heads * v / t)
        saved_proj = proj_in + (ctx_bytes if shares_output else 0.0) if self.keeps_fp8_inputs else ctx_bytes
        return {
            **self.sp_norm("norm1"),
            "qkv": self.with_fp8_casts(Block("gemm", f_qkv, b_qkv, saved_qkv, bb_qkv), (T, h, qkv_rank / h, True)),
            "attn": attn,
            "proj": self.with_fp8_casts(Block("gemm", f_proj, b_proj, saved_proj + mask, bb_proj, bwd_only=mask),
                                         (T, m.heads * v / t, h)),
        }

    def sp_norm(self, name: str) -> dict[str, Block]:
        """Under sp, the norm before a column-parallel block as a block of its own, on this rank's
        slice of the sequence: it saves its input; the GEMM block saves the norm's output."""
        if not self.sp:
            return {}
        return {name: Block("elementwise", 0.0, self.norm_fwd(), self.hidden_bytes + self.norm_stats, self.norm_bwd())}

    @property
    def residual_mask(self) -> float:
        """A residual branch's dropout mask on this rank (1 byte per element), 0 without dropout."""
        return self.tokens * self.h / self.sp_div if self.dropout else 0.0

    @property
    def _selective(self) -> bool:
        return self.selective_recomputes_attention

    def activation(self, width: float) -> tuple[float, float]:
        """Activation function over `width` features per token on this rank: GeLU (fused with its
        bias, Megatron) or SwiGLU (silu(gate) * up); (forward, backward) bytes."""
        T, dt, m = self.tokens, self.dt, self.rp.model
        if m.gated:
            return 3 * dt * T * width, 5 * dt * T * width
        return 2 * dt * T * width, (3 + (1 if m.bias else 0)) * dt * T * width

    def _mlp(self) -> dict[str, Block]:
        m, t, T, dt, h, sp = self.rp.model, self.tp, self.tokens, self.dt, self.h, self.sp_div
        width = m.ffn * (2 if m.gated else 1)
        f1, _ = gemm_cost(T, h, width / t, dt)
        f2, _ = gemm_cost(T, m.ffn / t, h, dt)
        a_f, a_b = self.activation(m.ffn / t)
        ln = T * h * dt / sp
        ln_out = self.saved_linear_input(T * h / sp)
        norm_f, norm_b = self.opening_norm()
        return {
            **self.sp_norm("norm2"),
            "fc1": self.with_fp8_casts(
                Block("gemm", f1, norm_f + a_f, (ln_out if self.sp else ln + ln_out) + self.opening_stats + T * width * dt / t,
                      norm_b + a_b + self.weight_grad_bytes(h * width / t), bwd_only=T * width * dt / t), (T, h, width / t, True)),
            "fc2": self.with_fp8_casts(
                Block("gemm", f2, self.residual_fwd(), self.saved_linear_input(T * m.ffn / t) + self.residual_mask,
                      self.residual_bwd(m.bias) + self.weight_grad_bytes(m.ffn * h / t), bwd_only=self.residual_mask), (T, m.ffn / t, h)),
        }

    # --- embedding and head --------------------------------------------------------------------------
    @cached_property
    def embed(self) -> Block:
        """Lookup (read rows, write), + learned positions, + dropout; backward scatters into a dense
        vocab x hidden gradient of this rank's vocab shard (zeroed, then written), which is then added
        into the sum the weight gradients accumulate in, as every weight gradient is."""
        m, T, h, dt = self.rp.model, self.tokens, self.h, self.dt
        n = T * h
        fwd = 2 * dt * n + (3 * dt * n if m.learned_pos else 0.0) + ((2 * dt + 1) * n if self.dropout else 0.0)
        bwd = 2 * dt * n + self.grad_dt * self.embed_params() + self.weight_grad_bytes(self.embed_params())
        # the incoming (gathered) gradient and the dense vocab-shard weight gradient, which the
        # embedding's backward materialises before adding it to main_grad even in Megatron
        return Block("embedding", 0.0, fwd, 0.0, bwd, bwd_workspace=n * dt + self.embed_params() * dt)

    @cached_property
    def head(self) -> dict[str, Block]:
        m, t, T, dt, h = self.rp.model, self.tp, self.tokens, self.dt, self.h
        f, _ = gemm_cost(T, h, m.vocab / t, dt)
        n_logits = self.n_logits
        ce = self.cross_entropy
        logits = ce.saved * n_logits  # what the loss keeps of the logits for its backward
        # final norm (a block of its own under sp), GEMM, and a cast of the logits to fp32 where the loss has one
        norm_f, norm_b = self.norm_fwd(), 3 * dt * T * h / self.sp_div
        b_head = (0.0 if self.sp else norm_f) + ce.head_cast * n_logits
        bb_head = (0.0 if self.sp else norm_b) + self.weight_grad_bytes(h * m.vocab / t)
        wgrad_tmp = self.wgrad_tmp(h * m.vocab / t)
        # the logits' gradient the GEMMs read, and what the loss's backward holds at its own peak
        # (the loss backward's first gradient is the lowering's own allocation: `loss_grad_first`)
        cast, loss_peak = ce.grad_out * n_logits, (ce.bwd_workspace - ce.bwd_first) * n_logits
        if self.sp:
            # the norm saves its input, the GEMM the norm's output (this rank's slices); backward: the
            # GEMM's input gradient (gathered), the norm's (this rank's slice)
            blocks = {
                "norm": Block("elementwise", 0.0, norm_f, self.hidden_bytes + self.norm_stats, norm_b,
                              self.hidden_bytes + self.norm_bwd_temps(T * h / self.sp_div)),  # as norm1
                "head": Block(self.head_op, f, b_head, self.hidden_bytes + logits, bb_head,
                              max(loss_peak, self.full_hidden_bytes + wgrad_tmp + cast)),
            }
        else:
            # backward: the logits' gradient (`cast`); the GEMM's input gradient and the norm's, plus autograd's weight-gradient temporary; then the norm's backward
            n = self.full_hidden_bytes
            blocks = {"head": Block(self.head_op, f, b_head, 2 * T * h * dt + self.norm_stats + logits, bb_head,
                                    max(loss_peak, 2 * n + wgrad_tmp + cast, n + self.norm_bwd_temps(T * h)))}
        head = blocks["head"]
        grad_out = cast + (0.0 if self.sp else self.full_hidden_bytes)
        blocks["head"] = replace(head, **self._weight_pass(head, h * m.vocab / t, grad_out))
        return {
            **blocks,
            "xent": Block("loss", 0.0, ce.fwd * n_logits, 0.0, ce.bwd * n_logits),
            "loss": Block("loss", 0.0, 8.0 * T, 0.0),
        }

    @cached_property
    def mtp(self) -> dict[str, Block]:
        """An MTP depth's input blocks (DeepSeek-V3 §2.2, Megatron-Core's MultiTokenPredictionLayer) in
        forward order: `mtp_embed`, the shifted tokens' lookup in the shared embedding (this rank's
        vocabulary shard, as `embed`; its backward scatters into the embedding's gradient); `mtp_norm`,
        enorm and hnorm and their concatenation, embedding first (on this rank's slice under sp);
        `mtp_in`, eh_proj, a column-parallel 2h -> h/tp GEMM (Megatron-Core's gather_output=False) that
        saves its input (under sp its slice, re-gathered for the weight gradient)."""
        t, T, dt, h, sp = self.tp, self.tokens, self.dt, self.h, self.sp_div
        cat = 2 * dt * T * 2 * h / sp  # the concatenation: read both halves, write them side by side
        norm = Block("elementwise", 0.0, 2 * self.norm_fwd() + cat, 2 * (self.hidden_bytes + self.norm_stats),
                     2 * self.norm_bwd() + cat, bwd_workspace=2 * self.hidden_bytes)
        f, _ = gemm_cost(T, 2 * h, h / t, dt)
        gemm = Block("gemm", f, 0.0, 2 * self.hidden_bytes, self.weight_grad_bytes(2 * h * h / t),
                     bwd_workspace=2 * self.full_hidden_bytes + self.wgrad_tmp(2 * h * h / t))
        gemm = replace(gemm, **self._weight_pass(gemm, 2 * h * h / t, dt * T * h / t))
        return {"mtp_embed": self.embed, "mtp_norm": norm, "mtp_in": gemm}

    def mtp_in_params(self) -> float:
        """An MTP depth's own parameters outside its block: the projection (over tp) and three norms."""
        m = self.rp.model
        return 2 * m.hidden * m.hidden / self.tp + 3 * m.pre_norm_params()

    # --- parameters ----------------------------------------------------------------------------------
    def layer_param_counts(self, i: int) -> tuple[float, float]:
        """(dense, expert) parameters of layer i held by one rank before ZeRO sharding."""
        m, p = self.rp.model, self.rp.plan
        replicated = m.tp_replicated_params_per_layer()
        if not m.is_moe_layer(i):
            return (m.layer_params(i) - replicated) / p.tp + replicated, 0.0
        experts = m.moe.experts * m.expert_params()
        dense = (m.attention_params() - m.latent_params() + m.moe_mlp_params() - m.router_params() - experts) / p.tp
        return dense + replicated + m.router_params(), experts / (self.rp.expert_tp * p.ep)

    def embed_params(self) -> float:
        return self.rp.model.embedding_params() / self.tp

    def head_params(self) -> float:
        m = self.rp.model
        own = m.lm_head_params() / self.tp + m.final_norm_params()
        if self.rp.tied_copy:
            own += m.embedding_params() / self.tp
        return own

