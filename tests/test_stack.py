"""Software stacks: FP8 recipes, attention kernels, and what the search may try for each framework."""
import subprocess
import sys
from dataclasses import replace

import pytest

from simexec import simulate
from simexec.errors import SpecError
from simexec.program.blocks import FUSED_ATTENTION_BWD_RATIO, HIGH_PRECISION_GEMM, Anatomy
from simexec.program.lower import lower
from simexec.program.stack_kernels import fp8_cast_bytes, fp8_norm_input_bytes
from simexec.sim.compute import ComputeModel, attention_efficiency
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve
from simexec.specs.stack import STACKS, Fp8Recipe, get_stack


def _resolved(plan: str, cluster: str = "dgx-h100", stack: str = "megatron-core", model: str = "llama3-8b"):
    return resolve(get_model(model), get_cluster(cluster), parse_plan(plan), None, get_stack(stack))


def test_unknown_stack_is_one_line():
    with pytest.raises(SpecError, match="unknown stack 'megatron'.*did you mean megatron-core"):
        get_stack("megatron")


def test_stack_file_changes_fields_over_a_base(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: torchtitan\nattention_kernel: cudnn\n")
    s = get_stack(str(f))
    assert s.name == "mine" and s.attention_kernel == "cudnn" and s.fp8 == STACKS["torchtitan"].fp8
    f.write_text("base: torchtitan\nattention_kernel: fa9\n")
    with pytest.raises(SpecError, match="stack file .*attention_kernel"):
        get_stack(str(f))


def test_fp8_keeps_activations_bf16_and_the_head_gemm_in_bf16():
    an = Anatomy(_resolved("dp=8,dtype=fp8"))
    assert an.dt == 2
    assert an.head["head"].op == HIGH_PRECISION_GEMM
    assert Anatomy(_resolved("dp=8")).head["head"].op == "gemm"
    cm = ComputeModel(get_cluster("dgx-h100"), "fp8", get_stack(None))
    assert cm.peaks["gemm"] == 1979e12 and cm.peaks["attention"] == 989e12 and cm.peaks["gemm_bf16"] == 989e12


def test_fp8_casts_cost_more_where_the_stack_does_not_fuse_them():
    fused = Anatomy(_resolved("dp=8,dtype=fp8", stack="megatron-core"))
    eager = Anatomy(_resolved("dp=8,dtype=fp8", stack="torchtitan"))
    plain = Anatomy(_resolved("dp=8"))
    for name in ("qkv", "proj", "fc1", "fc2"):
        assert plain.dense[name].bytes < fused.dense[name].bytes < eager.dense[name].bytes
        assert fused.dense[name].bwd_bytes < eager.dense[name].bwd_bytes
    # the norm writes the QKV input in FP8 under TE: only the transposed copy and the weights are cast
    tokens, h = fused.tokens, fused.h
    assert fused.fp8_casts(tokens, h, h, True)[0] < fused.fp8_casts(tokens, h, h, False)[0]


def test_fp8_speedup_comes_from_the_mechanics_not_the_peak_ratio():
    speedups = {}
    for stack in ("megatron-core", "torchtitan"):
        bf16 = simulate("llama3-8b", "dgx-h100", "dp=8,gbs=32", stack=stack).step_time_s
        fp8 = simulate("llama3-8b", "dgx-h100", "dp=8,gbs=32,dtype=fp8", stack=stack).step_time_s
        speedups[stack] = bf16 / fp8
    # the FP8 peak is twice bf16's; attention, the head, casts and element-wise kernels keep it far below
    assert 1.05 < speedups["torchtitan"] < speedups["megatron-core"] < 1.6


def test_fused_attention_backward_counts_two_and_a_half_forwards_on_gpus_only():
    gpu = Anatomy(_resolved("dp=8")).dense["attn"]
    assert gpu.bwd_flops == pytest.approx(FUSED_ATTENTION_BWD_RATIO * gpu.flops) and gpu.keys > 0
    cpu = Anatomy(resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan("dp=1,dtype=fp32"))).dense["attn"]
    assert cpu.bwd_flops == pytest.approx(2 * cpu.flops) and cpu.keys == 0


def test_attention_efficiency_rises_with_keys_per_query_and_backward_is_slower():
    cm = ComputeModel(get_cluster("dgx-h100"), "bf16", get_stack(None))
    short, long = cm.efficiency("attention", 1e12, "fwd", 512), cm.efficiency("attention", 1e12, "fwd", 8192)
    assert short < long < get_cluster("dgx-h100").costs.attention_eff
    assert cm.efficiency("attention", 1e12, "bwd", 8192) < long
    # a longer sequence gives each query more keys: attention's share of the step grows faster than its FLOPs
    program = lower(_resolved("dp=8,gbs=8"))
    assert any(i.keys == pytest.approx(4096) for i in program.ranks[0] if i.op == "attention")


def test_a_stack_on_another_kernel_takes_its_published_figures_where_there_are_some():
    h100 = get_cluster("dgx-h100").costs
    cudnn = attention_efficiency(h100, "H100-SXM5-80GB", "cudnn")
    fa2 = attention_efficiency(h100, "H100-SXM5-80GB", "fa2")
    assert cudnn == (h100.attention_eff, h100.attention_bwd_eff, h100.attention_half_keys)
    assert fa2[0] < cudnn[0] and fa2[1] < cudnn[1]
    a100 = get_cluster("dgx-a100-80g").costs  # no table for A100: its own fields
    assert attention_efficiency(a100, "A100-SXM4-80GB", "fa2")[0] == a100.attention_eff


def test_search_tries_only_what_the_stack_can_run():
    from simexec.search.driver import search

    for stack, check in (
        ("torchtitan", lambda p: p.cp_impl == "allgather" and not p.tp_overlap and p.zero in (0, 3)
         and p.zero_impl in (None, "fsdp")),
        ("deepspeed", lambda p: p.schedule_name == "1f1b" and not p.tp_overlap
         and (p.zero < 3 or p.zero_impl == "deepspeed")),
    ):
        res = search("llama3-8b", "dgx-h100", 16, workers=1, progress=False, top=5, stack=stack)
        plans = [parse_plan(e["plan"]) for e in res.to_json()["plans"]]
        assert plans and all(check(p) for p in plans), (stack, [e["plan"] for e in res.to_json()["plans"]])


def test_cli_refuses_an_unknown_stack_in_one_line():
    r = subprocess.run([sys.executable, "-m", "simexec.cli", "simulate", "--model", "llama3-8b", "--cluster", "dgx-h100",
                        "--plan", "dp=8", "--stack", "titan"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "unknown stack 'titan'" in r.stderr


def test_eager_element_wise_kernels_move_the_traffic_their_stack_counts():
    fused, eager = Anatomy(_resolved("dp=8,mbs=2")), Anatomy(_resolved("dp=8,mbs=2", stack="torchtitan"))
    unit = fused.tokens * fused.h * fused.dt
    # the counts are torchtitan's layer without repeat_kv, whose copies of K and V (1 + 4 of the 8 K/V heads'
    # width, 2 x 1024 of 4096) the blocks add each way
    repeat = (1 + 4) * 2 * 1024 / 4096
    assert eager.attended_kv_width == 4 * fused.attended_kv_width
    eager_units = sum(b.bytes for b in eager.dense.values()) / unit - repeat
    assert sum(b.bytes for b in fused.dense.values()) / unit == pytest.approx(23.0)  # what the blocks count
    assert eager_units == pytest.approx(72.0)
    extra_bwd = sum(b.bwd_bytes for b in eager.dense.values()) - sum(b.bwd_bytes for b in fused.dense.values())
    assert extra_bwd / unit - repeat == pytest.approx(190.0 - 34.0)
    # compiled torchtitan moves about what TE's fused kernels do: within 5% of the step
    plan = "dp=8,mbs=2,gbs=16,zero=3"
    steps = {s: simulate("llama3-8b", "dgx-h100", plan, stack=s).step_time_s
             for s in ("megatron-core", "torchtitan", "torchtitan-compile")}
    assert steps["torchtitan"] > 1.1 * steps["torchtitan-compile"]
    assert steps["torchtitan-compile"] / steps["megatron-core"] < 1.25  # FlashAttention-2 against cuDNN


def test_per_operator_checkpointing_recomputes_every_other_matmul_and_the_element_wise_kernels():
    rp = _resolved("dp=8,mbs=2,gbs=16,recompute=op", stack="torchtitan-compile")
    an = Anatomy(rp)
    again = an.op_recomputed(0)
    dense = an.dense
    m = rp.model
    q, kv, _ = m.attention_widths
    assert again["qkv"].flops == pytest.approx(dense["qkv"].flops * (kv / 2) / (q + kv))  # wk of wq, wk, wv
    assert again["proj"].flops == dense["proj"].flops and again["fc2"].flops == 0  # wo again, w2 kept
    assert again["fc1"].flops == pytest.approx(dense["fc1"].flops / 2)  # w3 again, w1 kept
    assert all(again[k].bytes == dense[k].bytes for k in again)  # every element-wise kernel again
    program = lower(rp)
    assert {i.block for i in program.ranks[0] if i.phase == "recompute" and i.layer == 0} == set(again)
    runs = [simulate("llama3-8b", "dgx-h100", f"dp=8,mbs=2,gbs=16,recompute={r}", stack="torchtitan-compile")
            for r in ("none", "op", "full")]
    assert runs[0].step_time_s < runs[1].step_time_s < runs[2].step_time_s
    # it keeps the layer input, wq's, wv's and w1's outputs and the attention's: between full and none
    assert runs[2].peak_memory_bytes < runs[1].peak_memory_bytes < runs[0].peak_memory_bytes
    kept, saved = an.op_kept(0), sum(b.saved for b in dense.values())
    per_token = (m.hidden + q + kv / 2 + m.ffn) * an.dt + m.heads * m.value_head_dim * an.dt + m.heads * 4
    assert kept == pytest.approx(an.tokens * per_token) and kept < saved
    # eager, the policy's store also keeps w2's output, which no backward reads; compiled, the partitioner
    # drops it (torch/utils/checkpoint.py _CachingTorchDispatchMode; torch/_functorch/partitioners.py)
    eager = Anatomy(_resolved("dp=8,mbs=2,gbs=16,recompute=op", stack="torchtitan"))
    assert eager.op_kept(0) - kept == pytest.approx(an.tokens * m.hidden * an.dt)
    from simexec.exec.rank.unsupported_plans import unsupported

    tiny = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan("dp=1,dtype=fp32,recompute=op"))
    assert "recompute=op" in (unsupported(tiny) or "")


def test_an_attention_kernel_the_policy_does_not_name_is_recomputed_not_kept():
    """torchtitan from @3b85aa31f puts cuDNN attention first on sm100 (has_cuda_capability(10, 0)); its
    _save_list named only the flash and efficient SDPA ops until @b39377f9f, so per-op checkpointing
    recomputed cuDNN's output and log-sum-exp rather than keep them."""
    era = STACKS["torchtitan-compile"].model_copy(update={"cudnn_attention_from": (10, 0),
                                                          "op_sac_saved_attention": ("fa2", "fa3")})
    assert era.attention_kernel_on(get_cluster("hgx-b200").device) == "cudnn"
    assert era.attention_kernel_on(get_cluster("dgx-h100").device) == "fa2"
    assert era.attention_kernel_on(get_cluster("mi300x-8").device) == "fa2"  # not a CUDA device
    plan = parse_plan("dp=8,gbs=8,recompute=op")
    b200, h100 = (Anatomy(resolve(get_model("llama3-8b"), get_cluster(c), plan, None, era)) for c in ("hgx-b200", "dgx-h100"))
    m, T = b200.rp.model, b200.tokens
    assert h100.op_kept(0) - b200.op_kept(0) == pytest.approx(T * m.heads * (m.value_head_dim * 2 + 4))
    assert "attn" in b200.op_recomputed(0) and "attn" not in h100.op_recomputed(0)
    assert b200.op_recomputed(0)["attn"].flops == b200.dense["attn"].flops
    # the kernel the stack runs there sets the attention's efficiency too
    cm = ComputeModel(get_cluster("hgx-b200"), "bf16", era)
    assert cm.eff["attention"] == ComputeModel(get_cluster("hgx-b200"), "bf16", get_stack("megatron-core")).eff["attention"]


def test_async_tp_pipelines_the_gathers_and_scatters_with_their_gemms():
    plan = "tp=8,sp=1,mbs=4,gbs=32,recompute=op"
    rp = _resolved(plan + ",tp_async=1", stack="torchtitan-compile")
    program = lower(rp)
    fwd = [i for i in program.ranks[0] if i.layer == 0 and i.phase == "fwd"]
    names = [i.name for i in fwd]
    gather, rest = names.index("fwd.attn_in.L0.m0"), names.index("fwd.attn_in.L0.m0.rest")
    qkv = next(i for i in fwd if i.name == "fwd.qkv.L0.m0")
    assert "fwd.attn_in.L0.m0" in qkv.deps and "fwd.attn_in.L0.m0.rest" not in qkv.deps
    after = fwd[names.index("fwd.qkv.L0.m0") + 1:]
    assert any("fwd.attn_in.L0.m0.rest" in i.deps for i in after if i.kind == "compute")
    assert fwd[gather].bytes == pytest.approx(fwd[rest].bytes / 7)
    sync = simulate("llama3-8b", "dgx-h100", plan, stack="torchtitan-compile")
    pipelined = simulate("llama3-8b", "dgx-h100", plan + ",tp_async=1", stack="torchtitan-compile")
    assert pipelined.step_time_s < sync.step_time_s
    with pytest.raises(Exception, match="tp_async=1 needs sequence parallelism"):
        _resolved("tp=8,mbs=4,gbs=32,tp_async=1")


def test_fp8_parameter_gathers_move_one_byte_per_parameter_and_skip_the_weight_casts():
    plain = lower(_resolved("dp=8,zero=3,mbs=1,gbs=8,dtype=fp8", stack="torchtitan-compile"))
    fp8 = lower(_resolved("dp=8,zero=3,mbs=1,gbs=8,dtype=fp8,fp8_param_gather=1", stack="torchtitan-compile"))
    gathers = [sum(i.bytes for i in p.ranks[0] if i.block == "gather") for p in (plain, fp8)]
    assert gathers[1] == pytest.approx(gathers[0] / 2)
    casts = [Anatomy(_resolved(f"dp=8,zero=3,dtype=fp8,fp8_param_gather={g}")).dense["fc1"].bytes for g in (0, 1)]
    assert casts[1] < casts[0]
    with pytest.raises(Exception, match="fp8_param_gather=1 needs dtype=fp8 and ZeRO"):
        _resolved("dp=8,zero=0,dtype=fp8,fp8_param_gather=1")


def test_memory_margin_judges_fit_and_the_largest_category_says_what_shrinks_it():
    plan = "dp=8,zero=3,mbs=1,gbs=16"
    free = simulate("llama3-8b", "dgx-h100", plan)
    assert free.fits and free.memory_margin_bytes == 0
    room = free.memory_capacity_bytes - free.peak_memory_bytes
    tight = simulate("llama3-8b", "dgx-h100", plan, memory_margin_bytes=room + 2**30)
    assert not tight.fits and "DOES NOT FIT with" in tight.format()
    assert "largest: activations" in free.format()
    assert set(free.to_json()["peak_tensor_bytes_per_rank"]) == {str(r) for r in range(8)}
    assert all(free.peak_tensor_bytes_per_rank[r] <= free.peak_memory_bytes_per_rank[r] for r in range(8))
    r = subprocess.run([sys.executable, "-m", "simexec.cli", "search", "--model", "llama3-8b", "--cluster", "dgx-h100",
                        "--gbs", "16", "--memory-margin", "100"], capture_output=True, text=True)
    assert r.returncode == 2 and "memory margin 100 GiB" in r.stderr


def test_search_with_a_margin_never_proposes_a_plan_that_eats_it():
    from simexec.search.driver import search

    margin = 30 * 2**30
    res = search("llama3-8b", "dgx-h100", 16, workers=1, progress=False, top=5, memory_margin_bytes=margin)
    cap = simulate("llama3-8b", "dgx-h100", "dp=8").memory_capacity_bytes
    plans = res.to_json()["plans"]
    assert plans and all(p["peak_memory_bytes"] + margin <= cap for p in plans)


def test_the_loss_holds_what_its_kernels_keep_of_the_logits():
    """An eager fp32 cross entropy holds two fp32 gradients beside its saved log-softmax; a compiled or
    Transformer Engine one keeps the bf16 logits only; Megatron's native one its fp32 exp(z)."""
    heads = {k: Anatomy(resolve(get_model("llama3-8b"), get_cluster("dgx-h100"), parse_plan("dp=8"), 8192,
                                STACKS["megatron-core"].model_copy(update={"cross_entropy": k}))).head
             for k in ("native", "te", "eager", "compiled")}
    n = 8192 * 128256
    saved = {k: h["head"].saved for k, h in heads.items()}
    assert saved["native"] - saved["te"] == pytest.approx(2 * n)
    assert saved["eager"] == saved["native"] and saved["compiled"] == saved["te"]
    first = {k: 4.0 * n if k == "eager" else 0.0 for k in heads}  # nll's gradient, the lowering's own allocation
    peak = {k: h["head"].saved + h["head"].bwd_workspace + first[k] for k, h in heads.items()}
    assert peak["eager"] - peak["native"] > 5.5 * n  # 12 B per logit against 4 + the 2-byte cast and the GEMMs'
    assert peak["te"] < peak["compiled"] < peak["native"] < peak["eager"]
    traffic = {k: h["xent"].bytes + h["xent"].bwd_bytes + h["head"].bytes for k, h in heads.items()}
    assert traffic["te"] < traffic["native"] and traffic["compiled"] < traffic["eager"]
    # the simulated peak follows: an eager loss needs more memory than Megatron's
    peaks = {k: simulate("llama3-8b", "dgx-h100", "dp=8,zero=3", 8192,
                         stack=STACKS["megatron-core"].model_copy(update={"cross_entropy": k})).peak_memory_bytes
             for k in ("native", "eager")}
    assert peaks["eager"] > peaks["native"] + 4 * n


def test_a_vocabulary_parallel_eager_loss_holds_the_dtensor_handlers_temporaries():
    """Under tp, torch's `loss_parallel()` replaces the eager kernels (torch/distributed/tensor/parallel/
    loss.py): its backward makes `(grad_input + exp(x)) * grad_output`, 12 B per logit beside the saved
    fp32 log-softmax where the unsharded kernels hold 8; Megatron's own vocab-parallel loss is unchanged."""
    def head(plan, kind):
        rp = resolve(get_model("llama3-8b"), get_cluster("dgx-h100"), parse_plan(plan), 8192,
                     STACKS["torchtitan"].model_copy(update={"cross_entropy": kind}))
        return Anatomy(rp).head["head"]

    n = 8192 * 128256 / 2
    eager, native = head("dp=4,tp=2,sp=1", "eager"), head("dp=4,tp=2,sp=1", "native")
    assert eager.bwd_workspace == pytest.approx((12 - 4) * n)  # beside nll's dense gradient (`loss_grad_first`)
    assert head("dp=8", "eager").bwd_workspace - 2 * n * (8 - 4) == pytest.approx(0, abs=n)
    assert native.bwd_workspace < 8 * n


def test_sequence_parallel_on_dim_one_copies_the_gathered_tensor_around_each_collective():
    """torchtitan shards [batch, seq, hidden] on the sequence: torch's functional all-gather and
    reduce-scatter chunk-and-cat the whole gathered tensor (2 x read + write per layer side and
    direction); Megatron-Core gathers dim 0 in place; torch's async TP copies nothing on the gathers
    and sums the stacked partials of each reduce-scatter on the compute stream."""
    plan = "tp=8,sp=1,mbs=2"
    mc = Anatomy(_resolved(plan, stack="megatron-core")).dense
    tt_eager = _resolved(plan, stack="torchtitan")
    plain = get_stack("torchtitan").model_copy(update={"sp_layout_copies": False, "tp_async_local_reduce": False})
    tt = Anatomy(tt_eager).dense
    bare = Anatomy(replace(tt_eager, stack=plain)).dense
    full = tt_eager.plan.mbs * tt_eager.model.seq_len * tt_eager.model.hidden * 2
    for name in ("qkv", "fc1"):
        assert tt[name].bytes - bare[name].bytes == pytest.approx(4 * full)
        assert tt[name].bwd_bytes - bare[name].bwd_bytes == pytest.approx(4 * full)
        assert tt[name].flops == bare[name].flops
    assert tt["proj"].bytes == bare["proj"].bytes
    async_rp = _resolved(plan + ",tp_async=1", stack="torchtitan")
    reduce = Anatomy(async_rp).dense["qkv"].bytes - Anatomy(replace(async_rp, stack=plain)).dense["qkv"].bytes
    assert reduce == pytest.approx((1 + 1 / 8) * full)
    no_sp = _resolved("tp=8,mbs=2", stack="torchtitan")
    assert Anatomy(no_sp).dense["qkv"].bytes == Anatomy(replace(no_sp, stack=plain)).dense["qkv"].bytes
    assert mc["qkv"].bytes < tt["qkv"].bytes


def _with_scaling(scaling: str) -> Fp8Recipe:
    return STACKS["megatron-core"].fp8.model_copy(update={"scaling": scaling})


def test_mxfp8_cast_writes_what_te_quantizer_allocates():
    # MXFP8Quantizer (transformer_engine/pytorch/tensor/mxfp8_tensor.py): _rowwise_data and _columnwise_data,
    # each the tensor's shape in uint8, and one E8M0 scale per 32 elements for each; it reads bf16 once
    mx = _with_scaling("mxfp8")
    assert fp8_cast_bytes(mx, any_layout=True) == 2 + 2 * (1 + 1 / 32)
    assert fp8_cast_bytes(mx, any_layout=False) == fp8_cast_bytes(mx, any_layout=True)
    # current scaling on Blackwell: one `_data` backs both GEMM uses; the amax is one more read
    cs = _with_scaling("current")
    assert fp8_cast_bytes(cs, any_layout=True) == 2 + 2 + 1
    assert fp8_cast_bytes(cs, any_layout=False) == 2 + 2 + 2  # Hopper: the transposed copy too
    assert fp8_cast_bytes(_with_scaling("delayed"), any_layout=True) == 3


def test_norm_fusion_follows_te_normalization_choice():
    # normalization.cpp: delayed FULLY_FUSED, current FUSED_NORM_AMAX_FP8 (the cast reads the norm's output
    # back), MXFP8 UNFUSED without NVTE_NORM_FWD_USE_CUDNN (a whole cast)
    assert fp8_norm_input_bytes(_with_scaling("delayed"), any_layout=True) == 0
    assert fp8_norm_input_bytes(_with_scaling("delayed"), any_layout=False) == 1
    assert fp8_norm_input_bytes(_with_scaling("current"), any_layout=True) == 2 + 1
    mx = _with_scaling("mxfp8")
    assert fp8_norm_input_bytes(mx, any_layout=True) == fp8_cast_bytes(mx, any_layout=True)


def test_mxfp8_layer_moves_more_cast_bytes_than_per_tensor_on_blackwell():
    def casts(scaling: str, plan: str) -> float:
        stack = STACKS["megatron-core"].model_copy(update={"fp8": _with_scaling(scaling)})
        an = Anatomy(resolve(get_model("llama3-8b"), get_cluster("hgx-b200"), parse_plan(plan), None, stack))
        plain = Anatomy(_resolved(plan.replace(",dtype=fp8", ""), cluster="hgx-b200"))
        return sum(an.dense[n].bytes + an.dense[n].bwd_bytes - plain.dense[n].bytes - plain.dense[n].bwd_bytes
                   for n in ("qkv", "proj", "fc1", "fc2"))
    plan = "dp=8,gbs=64,dtype=fp8"
    # per-tensor delayed scaling on sm100 writes one FP8 copy, fused into the norm; MXFP8 two copies, unfused
    assert casts("delayed", plan) < casts("mxfp8", plan)
