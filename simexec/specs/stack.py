"""Software stacks: what a training framework does that changes step time, apart from the hardware and the plan.

A stack is data, like a cluster. The hardware (a `ClusterSpec`) says how fast kernels can run; the
plan says how the work is split; the stack says which kernels the framework launches for that work:
which GEMMs run in FP8 and what casting them costs, which element-wise kernels it fuses, whether
its host keeps ahead of the GPU. Every value cites the framework code it comes from
(docs/stacks.md). The default stack is `megatron-core`, the kernels simexec's blocks have always
described (Megatron-LM's fused kernels).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from simexec.errors import SpecError
from simexec.specs.cluster import DeviceSpec, deep_merge, names_a_file, one_line, read_mapping, unknown_name


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Fp8Recipe(_Spec):
    """How a stack runs a linear layer's three GEMMs in FP8 (forward, input gradient, weight gradient).

    Each GEMM operand is cast from bf16 to FP8 by a memory-bound kernel before the GEMM, which reads
    the FP8 copies; Hopper's FP8 tensor cores take only the `TN` layout, so the weight gradient
    (X^T dY) and the input gradient (dY W) need transposed FP8 copies as well. What this costs
    depends on where the stack casts (see the fields); the GEMM outputs, attention, norms, softmax
    and the loss stay in bf16.
    """

    scaling: Literal["delayed", "current", "rowwise", "blockwise", "mxfp8"] = Field(
        description="delayed: per-tensor scale from an amax history, amax taken inside the cast kernel (TE's "
        "DelayedScaling); current: per-tensor scale from the tensor's own amax, one more read of the bf16 "
        "tensor before the cast (TE's Float8CurrentScaling, torchao's tensorwise); rowwise / blockwise / "
        "mxfp8: a scale per row, per 128-element block or per 32 elements, found inside the cast kernel")
    norm_cast_fused: bool = Field(
        description="the norm ahead of the QKV and FC1 GEMMs writes their FP8 input itself (TE's "
        "LayerNormLinear / LayerNormMLP): no separate cast of those inputs")
    cast_writes_transpose: bool = Field(
        description="a cast writes the transposed FP8 copy in the same kernel (TE's cast_transpose); False: "
        "the backward casts the saved bf16 tensor again along the other axis (torchao)")
    weights_cast_once_per_step: bool = Field(
        description="a weight's FP8 copy is made on the first micro-batch and reused by the rest (TE's "
        "is_first_microbatch, which Megatron-Core passes); False: cast on every micro-batch")
    saves_fp8_input: bool = Field(
        False, description="a linear layer keeps its input's FP8 copy for the weight gradient, in the one layout "
        "that GEMM reads, not the bf16 tensor (TransformerEngine@d0067d0d module/linear.py and layernorm_linear.py: "
        "`update_usage(rowwise_usage=False, columnwise_usage=True)`, then `saved_inputmat` / `ln_out` saved); "
        "False: the bf16 input, cast again in the backward (torchao's matmul_with_hp_or_float8_args saves "
        "input_hp)")


class ElementwiseTraffic(_Spec):
    """A dense Llama-style layer's element-wise kernels (norms, rotary embedding, activation, residual adds,
    gradient sums) as a framework launches them: their HBM traffic per token in units of one hidden-size
    activation (hidden x 2 bytes), forward and backward. docs/stacks.md §1 derives them."""

    fwd_units: float = Field(ge=0)
    bwd_units: float = Field(ge=0)


class HostLaunches(_Spec):
    """What a GPU rank's host thread does to issue a layer's kernels (docs/stacks.md §2): the operators a
    framework launches per layer, forward and backward, priced at `op_s` each, and the scopes it runs as
    CUDA graphs (one launch for the whole scope). The host issues ahead of the device until it is slower
    than the kernels it launches (small layers, short sequences, fine-grained experts), or until it waits
    for the device (`moe_dispatch_syncs`): `simexec.sim.host.stack_clock`."""

    op_s: tuple[float, float] = Field(description="host seconds per operator the framework issues, forward (Python, "
                                      "the dispatcher, autograd's record, the driver's launch) and backward (autograd's "
                                      "engine running the node from C++, the dispatcher, the launch)")
    launch_s: float = Field(ge=0, description="host seconds per kernel launched from C++ without Python in between "
                            "(a grouped GEMM's per-expert cuBLAS calls, a compiled graph's kernels)")
    attention_ops: tuple[int, int] = Field(description="operators of a layer's attention half (norm, QKV, rotary, "
                                           "attention, projection, residual), forward and backward")
    mlp_ops: tuple[int, int] = Field(description="operators of a dense MLP half (norm, FC1, activation, FC2, residual)")
    moe_ops: tuple[int, int] = Field((0, 0), description="operators of an MoE MLP apart from its experts' GEMMs "
                                     "(router, top-k, auxiliary loss, permutation, token counts, activation)")
    expert_launches: tuple[int, int] = Field((0, 0), description="kernels launched per local expert from C++ "
                                             "(a grouped GEMM that runs one GEMM per expert), forward and backward")
    compiled: bool = Field(False, description="the layer's operators are one compiled graph's kernels: each costs "
                           "`launch_s`, not `op_s`")
    cuda_graphs: tuple[Literal["attn", "mlp", "moe_router", "full"], ...] = Field(
        (), description="scopes captured as CUDA graphs, one launch each: attn, mlp (a dense MLP half), moe_router "
        "(the router and the token counts' preprocessing), full (the whole forward and backward; not where the "
        "host waits for the device inside it)")
    moe_dispatch_syncs: bool = Field(False, description="the host waits for the device at a forward MoE dispatch "
                                     "(it reads the token counts per expert to size the all-to-all)")


class StackSpec(_Spec):
    """One training framework as it runs a transformer on GPUs."""

    name: str
    fp8: Fp8Recipe
    attention_kernel: Literal["cudnn", "fa2", "fa3"] = Field(
        description="the fused attention kernel: cudnn (Transformer Engine's FusedAttention, which it prefers "
        "over FlashAttention on Hopper and newer), fa2 (FlashAttention-2, torch SDPA's flash backend), fa3")
    layer_elementwise: ElementwiseTraffic = Field(
        description="the element-wise kernels of a layer; simexec's blocks count Megatron-Core's fused ones, and "
        "a stack that launches more moves the difference too")
    cudnn_attention_from: Optional[tuple[int, int]] = Field(
        None, description="the framework puts cuDNN attention first on CUDA devices of at least this compute "
        "capability (`DeviceSpec.compute_capability`), whatever `attention_kernel` says elsewhere: torchtitan from "
        "@3b85aa31f (2025-05-14, 'Use cudnn backend on B200') runs SDPA under sdpa_kernel([CUDNN_ATTENTION, "
        "FLASH_ATTENTION, ...], set_priority=True) where has_cuda_capability(10, 0) (torchtitan@6fc499f6f "
        "torchtitan/models/attention.py, ScaledDotProductAttention._init_backend); None: `attention_kernel` "
        "everywhere")
    op_sac_saved_attention: tuple[Literal["cudnn", "fa2", "fa3"], ...] = Field(
        ("cudnn", "fa2", "fa3"), description="the attention kernels whose outputs `recompute=op` saves. torchtitan's "
        "_save_list names SDPA's aten ops: the flash and efficient ones only until torchtitan@b39377f9f "
        "(2025-12-01, 'add all SDPA backends to op_sac_save_list', which adds "
        "_scaled_dot_product_cudnn_attention); a kernel not named is recomputed before the layer's backward, its "
        "output and log-sum-exp not kept")
    op_sac_keeps_unread: bool = Field(
        True, description="`recompute=op` keeps every output its policy saves, also one no backward reads (a "
        "Llama layer's w2 output: the residual add's backward reads neither operand). Eager: "
        "torch/utils/checkpoint.py's _CachingTorchDispatchMode stores each MUST_SAVE op's outputs as it runs "
        "them. False under torch.compile: the partitioner drops the saved values its backward graph does not use "
        "(torch/_functorch/partitioners.py, _extract_fwd_bwd_modules)")
    zero3_shards_are_master: bool = Field(
        False, description="under ZeRO-3 the sharded parameters are the fp32 master weights the optimizer "
        "steps, with no low-precision copy of the shard: the framework builds its model in fp32 and FSDP2's "
        "MixedPrecisionPolicy casts the shard for each all-gather (FSDPParam.all_gather_inputs: "
        "_to_dtype_if_needed(self._sharded_param_data, self.param_dtype)); False: a bf16 shard beside the "
        "optimizer's fp32 copy (Megatron's distributed optimizer)")
    cross_entropy: Literal["native", "te", "eager", "compiled"] = Field(
        description="the loss kernels over the logits (simexec.program.stack_kernels.cross_entropy_cost): native "
        "(Megatron's vocab-parallel cross entropy in fp32), te (Transformer Engine's Triton kernel, the gradient "
        "written into the logits in the forward), eager (torch's cross_entropy on an fp32 copy, unfused), "
        "compiled (the same under torch.compile)")
    expands_kv_heads: bool = Field(
        False, description="the model repeats each K/V head for the query heads that share it before the attention "
        "kernel (torchtitan's repeat_kv, up to torchtitan@ff0829c10, 2026-01-27, 'GQA without kv repeats'): the "
        "kernel reads, saves and (context parallel with all-gather) gathers K and V at the query heads' count, "
        "and a copy kernel writes them, forward, and sums their gradients back, backward; False: the kernel "
        "takes the grouped heads as they are (Transformer Engine, FlashAttention, SDPA's enable_gqa)")
    fp8_attention: bool = Field(
        False, description="fused attention in FP8 too (FlashAttention-3 / cuDNN FP8); the published recipes "
        "keep it in bf16")
    expandable_segments: bool = Field(
        False, description="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True as the framework's launcher sets it: "
        "the caching allocator grows one segment per pool page by page (simexec.sim.allocator)")
    sp_layout_copies: bool = Field(
        False, description="sequence parallelism shards activations laid out [batch, sequence, hidden] on the "
        "sequence (DTensor's Shard(1), torchtitan's SequenceParallel): torch's functional all-gather and "
        "reduce-scatter work on dim 0, so each one over the sequence copies the whole gathered tensor "
        "(torch.cat(torch.chunk(...)) in torch/distributed/_functional_collectives.py), forward and backward; "
        "async TP's fused ops take the shards in place (Inductor restrides them). Megatron-Core's [sequence, "
        "batch, hidden] gathers in place")
    tp_async_local_reduce: bool = Field(
        False, description="tp_async as torch's symmetric-memory async TP runs it: a matmul's partial outputs are "
        "exchanged chunk by chunk and then summed by a reduction kernel on the compute stream, reading the "
        "stacked partials (the whole unreduced tensor) once they have all arrived "
        "(_fused_matmul_reduce_scatter_impl in torch/distributed/_symmetric_memory/__init__.py)")
    host: Optional[HostLaunches] = Field(
        None, description="the host's cost of issuing the kernels on a GPU rank (None: the host keeps ahead)")
    search_choices: dict[str, list[Union[bool, int, str]]] = Field(
        default_factory=dict, description="the plan knobs this framework can run, as the values of each "
        "(`{zero: [0, 1], schedule: [1f1b, interleaved-1f1b]}`): the search enumerates only these; a user's --fix "
        "overrides a knob")
    source: str = ""

    def attention_kernel_on(self, device: DeviceSpec) -> str:
        """The fused attention kernel this framework runs on `device` (`cudnn_attention_from`)."""
        cc = device.compute_capability
        if self.cudnn_attention_from is not None and cc is not None and cc >= self.cudnn_attention_from:
            return "cudnn"
        return self.attention_kernel


# Host seconds per eager operator: the host's own part measured on CPU tensors of one element
# (scripts/probe_op_host_cost.py, torch 2.13, one thread's CPU time on this project's Xeon VM): 3.6 us a
# forward op recorded by autograd, 5.7 us a backward node run by the engine; plus the driver's
# cuLaunchKernel, 3.0 us on GB200 (meta-pytorch/tritonbench PR #1017, nop_triton_direct_culaunch).
CU_LAUNCH_S = 3.0e-6
EAGER_OP_S = (3.6e-6 + CU_LAUNCH_S, 5.7e-6 + CU_LAUNCH_S)
# Megatron-Core's MoE layer apart from its experts' GEMMs, forward and backward: router GEMM, softmax and
# top-k, the auxiliary loss, TE's fused permute and unpermute, the token counts' sum and device-to-host
# copy, sort_chunks, the activation (megatron/core/transformer/moe/{router,token_dispatcher,moe_utils}.py):
# a code-reading count, not a profile.
MCORE_MOE_OPS = (15, 15)

TORCHTITAN_CHOICES = dict(zero=[0, 3], zero_impl=["fsdp"], cp_impl=["allgather"], recompute=["none", "op", "full"],
                          schedule=["1f1b", "gpipe", "interleaved-1f1b", "interleaved-zb", "zb-v"], offload=["none"],
                          tp_overlap=[False], moe_dispatcher=["alltoall"], moe_a2a_overlap=[False],
                          reshard_after_forward=[True, False], offload_layers=[0])

# --- presets ------------------------------------------------------------------------------------
STACKS: dict[str, StackSpec] = {
    "megatron-core": StackSpec(
        name="megatron-core",
        # Transformer Engine as Megatron-Core builds its layers (megatron/core/extensions/transformer_engine.py:
        # TELayerNormColumnParallelLinear for QKV and FC1, TERowParallelLinear for the projection and FC2);
        # TE's default recipe is DelayedScaling (transformer_engine/common/recipe/__init__.py); its
        # cast_transpose kernels write both layouts (transformer_engine/pytorch/module/base.py); Megatron-Core
        # passes is_first_microbatch so weight casts are cached (megatron/core/transformer/transformer_block.py).
        fp8=Fp8Recipe(scaling="delayed", norm_cast_fused=True, cast_writes_transpose=True,
                      weights_cast_once_per_step=True, saves_fp8_input=True),
        # TE's backend selection gives FusedAttention (cuDNN) preference on compute capability >= 9.0
        # (transformer_engine/pytorch/attention/dot_product_attention/utils.py, get_attention_backend)
        attention_kernel="cudnn",
        # TE's LayerNormLinear norms, fused RoPE, bias-SwiGLU and bias-dropout-add: 7 kernels forward, 9 backward,
        # 23 and 34 units (megatron/core/models/gpt/gpt_layer_specs.py, docs/stacks.md §1.3): what the blocks count
        layer_elementwise=ElementwiseTraffic(fwd_units=23, bwd_units=34),
        # Megatron-Bridge's recipes set cross_entropy_loss_fusion=True with cross_entropy_fusion_impl="te"
        # (Megatron-Bridge@067f987 src/megatron/bridge/recipes/llama/h100/llama3.py:98-99); Megatron-LM's own default is the
        # native vocab-parallel one (--cross-entropy-loss-fusion off)
        cross_entropy="te",
        # eager by default (Megatron-Bridge's recipes: cuda_graph_impl="none", recipes/llama/h100/llama3.py:92).
        # Per layer: attention half 7 kernels forward (TE norm in LayerNormLinear, QKV GEMM, 2 fused RoPE, cuDNN
        # attention, projection GEMM, bias-dropout-add), 10 backward (norm 2, QKV dgrad+wgrad, RoPE 2, attention,
        # projection 2, residual grad); MLP half 5 / 8 (docs/stacks.md §1.3). TE's GroupedLinear runs one cuBLAS
        # GEMM per local expert (multi_stream_cublas_gemm, TransformerEngine@d0067d0
        # transformer_engine/common/gemm/cublaslt_gemm.cu:971-1040): fc1 and fc2 forward, dgrad and wgrad of each
        # backward. The all-to-all dispatcher reads the token counts on the host before the token all-to-all
        # (MoEAlltoAllTokenDispatcher.preprocess, cuda_sync_point "before_ep_alltoall", token_dispatcher.py@d98e8a6)
        host=HostLaunches(op_s=EAGER_OP_S, launch_s=CU_LAUNCH_S, attention_ops=(7, 10), mlp_ops=(5, 8),
                          moe_ops=MCORE_MOE_OPS, expert_launches=(2, 4), moe_dispatch_syncs=True),
        # DDP or the distributed optimizer (megatron/core/optimizer/distrib_optimizer.py), Megatron-FSDP
        # (megatron/core/distributed/fsdp); context parallel as TE's p2p ring or a2a (cp_comm_type); the
        # pipeline schedules of megatron/core/pipeline_parallel/schedules.py; async TP gradients always on
        search_choices=dict(zero=[0, 1, 3], zero_impl=["fsdp"], cp_impl=["ring", "a2a"],
                            recompute=["none", "selective", "full"], schedule=["1f1b", "interleaved-1f1b"],
                            offload=["none"], tp_overlap=[True]),
        source="Megatron-Core with Transformer Engine (NeMo, Megatron-Bridge)",
    ),
    "torchtitan": StackSpec(
        name="torchtitan",
        # torchao Float8Linear, tensorwise dynamic scaling (torchao/float8/config.py: recipe "tensorwise"),
        # casts inside each linear's forward and backward (torchao/float8/float8_linear.py); every micro-batch
        # casts its weights again.
        fp8=Fp8Recipe(scaling="current", norm_cast_fused=False, cast_writes_transpose=False,
                      weights_cast_once_per_step=False),
        # F.scaled_dot_product_attention: flash first, cuDNN last in torch 2.5.1-2.7's priority order
        # (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, priority_order); newer torch prefers cuDNN
        # on sm90+ (check_prefer_cudnn_attention): a stack file with attention_kernel: cudnn says so
        attention_kernel="fa2",
        # eager aten ops: nn.RMSNorm decomposed (torch <= 2.8) with an fp32 up-cast, complex RoPE in fp32, silu and
        # mul apart, residual and gradient adds (torchtitan/models/llama3/model.py @238fa99; docs/stacks.md §1.1)
        layer_elementwise=ElementwiseTraffic(fwd_units=72, bwd_units=190),
        # cross_entropy(pred.flatten(0, 1).float(), labels) (torchtitan/components/loss.py)
        cross_entropy="eager",
        # aten operators per layer as dispatched (docs/stacks.md §1.1, decomposed RMSNorm): attention half 20
        # forward (norm 8, 3 mm, RoPE 6, SDPA, wo, add), 38 backward; MLP half 14 / 29. Its experts run as one
        # grouped_mm; its EP dispatch reads the splits on the host (torchtitan/distributed/expert_parallel.py)
        host=HostLaunches(op_s=EAGER_OP_S, launch_s=CU_LAUNCH_S, attention_ops=(20, 38), mlp_ops=(14, 29),
                          moe_dispatch_syncs=True),
        # FSDP2 (fully_shard) or plain replication; torch's context parallel (all-gather of K/V); the
        # schedules of torch.distributed.pipelining; DTensor's TP collectives after each backward
        search_choices=TORCHTITAN_CHOICES,
        # run_train.sh exports PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True" (pytorch/torchtitan)
        expandable_segments=True,
        # the model is built in fp32 on the meta device and materialised in fp32; apply_fsdp passes
        # MixedPrecisionPolicy(param_dtype=bfloat16) (torchtitan@9dec370 parallelize_llama.py, train.py)
        zero3_shards_are_master=True,
        sp_layout_copies=True,  # SequenceParallel() shards dim 1 (torchtitan/models/llama3/infra/parallelize.py)
        tp_async_local_reduce=True,  # enable_async_tensor_parallel: torch's micro-pipeline TP pass
        # keys = repeat_kv(xk, self.n_rep) before F.scaled_dot_product_attention (torchtitan@9dec370
        # torchtitan/models/llama/model.py; removed by @ff0829c10, 2026-01-27: a stack file says so)
        expands_kv_heads=True,
        source="torchtitan, eager (torchao float8)",
    ),
    "torchtitan-compile": StackSpec(
        name="torchtitan-compile",
        # torch.compile fuses the amax reduction and the casts into the kernels around them
        # (torchao/float8/README.md: "torch.compile is required for good performance").
        fp8=Fp8Recipe(scaling="current", norm_cast_fused=True, cast_writes_transpose=True,
                      weights_cast_once_per_step=False),
        attention_kernel="fa2",  # compile leaves SDPA one opaque kernel, as eager
        # Inductor fuses each block's pointwise chains and reductions (docs/stacks.md §1.2)
        layer_elementwise=ElementwiseTraffic(fwd_units=22, bwd_units=32),
        # the loss compiled with the model (torchtitan@bbb1b616e, 2025-04-02, build_cross_entropy_loss; since
        # torchtitan@08b8b244f: compile.components ["model", "loss"]). Between torchtitan@e8977b007
        # (2024-12-18, "turning off compile on loss function") and then it ran eager: a stack file with
        # cross_entropy: eager says so
        cross_entropy="compiled",
        # per block: the 7 mm, SDPA and ~6 Triton kernels forward, ~10 and 15 extern kernels backward (§1.2):
        # attention half 8 / 13, MLP half 6 / 12. Each kernel is Inductor's CachingAutotuner.run, 6.8 us with its
        # cuLaunchKernel on GB200 (meta-pytorch/tritonbench PR #1017, nop_inductor_per_kernel)
        host=HostLaunches(op_s=(6.8e-6, 6.8e-6), launch_s=6.8e-6, attention_ops=(8, 13), mlp_ops=(6, 12),
                          compiled=True, moe_dispatch_syncs=True),
        search_choices=TORCHTITAN_CHOICES,
        op_sac_keeps_unread=False,  # the compiled blocks' partitioner keeps only what their backward reads
        expandable_segments=True,  # the same run_train.sh
        zero3_shards_are_master=True,
        sp_layout_copies=True,  # the copies are extern-adjacent (a cuBLAS mm on one side): compile keeps them
        tp_async_local_reduce=True,
        expands_kv_heads=True,  # repeat_kv, as eager: SDPA takes materialised K/V tensors
        source="torchtitan with torch.compile per block (torchao float8)",
    ),
    "deepspeed": StackSpec(
        name="deepspeed",
        # Megatron-DeepSpeed runs Transformer Engine's layers for FP8 the way Megatron-LM does.
        fp8=Fp8Recipe(scaling="delayed", norm_cast_fused=True, cast_writes_transpose=True,
                      weights_cast_once_per_step=True, saves_fp8_input=True),
        attention_kernel="fa2",  # Megatron-DeepSpeed's --use-flash-attn-v2 (megatron/model/transformer.py)
        # apex fused RMSNorm, unfused RoPE and SwiGLU, scripted bias-dropout-add (docs/stacks.md §1.4)
        layer_elementwise=ElementwiseTraffic(fwd_units=40, bwd_units=72),
        cross_entropy="native",  # Megatron's vocab_parallel_cross_entropy (megatron/model/gpt_model.py)
        # attention half 15 forward (apex norm, QKV GEMM, unfused RoPE ~10, flash attention, projection, scripted
        # bias-dropout-add), 18 backward; MLP half 6 / 13 (docs/stacks.md §1.4)
        host=HostLaunches(op_s=EAGER_OP_S, launch_s=CU_LAUNCH_S, attention_ops=(15, 18), mlp_ops=(6, 13)),
        # ZeRO stages 0-3 and ZeRO-Offload; DeepSpeed-Ulysses for sequence parallelism; its pipeline
        # engine runs 1F1B (deepspeed/runtime/pipe/schedule.py, TrainSchedule)
        search_choices=dict(zero=[0, 1, 2, 3], zero_impl=["deepspeed"], cp_impl=["a2a"],
                            recompute=["none", "selective", "full"], schedule=["1f1b"], tp_overlap=[False],
                            moe_dispatcher=["alltoall"], moe_a2a_overlap=[False],
                            # Megatron-DeepSpeed's selective recompute is the attention core alone; its
                            # activation offload (cpu_checkpointing) is not Megatron-Core's offload_layers
                            recompute_modules=["core_attn"], offload_layers=[0]),
        source="Megatron-DeepSpeed / DeepSpeed ZeRO with Transformer Engine",
    ),
}
DEFAULT_STACK = "megatron-core"


def get_stack(name_or_path: str | None) -> StackSpec:
    """A preset by name (None: the default), or a YAML/JSON file (`base: <preset>` plus fields to change)."""
    if name_or_path is None:
        return STACKS[DEFAULT_STACK]
    if name_or_path in STACKS:
        return STACKS[name_or_path]
    if names_a_file(name_or_path):
        return load_stack_file(Path(name_or_path))
    raise unknown_name("stack", name_or_path, list(STACKS), "stacks")


def load_stack_file(path: Path) -> StackSpec:
    data = read_mapping(Path(path), "stack")
    data.setdefault("name", Path(path).stem)
    base_name = data.pop("base", None)
    if base_name is not None:
        if base_name not in STACKS:
            raise SpecError(f"stack file {path}: base: unknown stack {base_name!r}; stacks: {', '.join(STACKS)}")
        data = deep_merge(STACKS[base_name].model_dump(), data)
    try:
        return StackSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"stack file {path}: {one_line(exc)}") from None
