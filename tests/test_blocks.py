"""Per-layer activation memory equals Korthikanti et al. 2022 (Table 2) in each of its variants, plus
the small buffers the paper leaves out."""
import pytest

from simexec.program.blocks import Anatomy
from simexec.program.groups import rank_groups
from simexec.program.lower import lower
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve

MODEL = get_model("gpt3-1.3b")  # GPT: MHA, GeLU MLP of 4h, dropout after attention and MLP
S, B, H, A = MODEL.seq_len, 2, MODEL.hidden, MODEL.heads


def left_out(t: int = 1, sp: bool = False, flash: bool = False) -> float:
    """What the paper's formula leaves out as small: the two LayerNorms' statistics (mean and 1/std,
    fp32, per token of the rank's sequence) and, with FlashAttention (which came after it), each query
    row's log-sum-exp per head (fp32)."""
    return S * B / (t if sp else 1) * 2 * 2 * 4 + (S * B * A / t * 4 if flash else 0.0)


def saved_per_layer(plan: str) -> float:
    rp = resolve(MODEL, get_cluster("1xdgx-a100-80g"), parse_plan(plan))
    return sum(b.saved for b in Anatomy(rp).dense.values())


def test_no_parallelism_keeps_sbh_34_plus_5as_over_h():
    assert saved_per_layer("dp=8,mbs=2,flash_attention=0") == pytest.approx(S * B * H * (34 + 5 * A * S / H) + left_out())


def test_tensor_parallel_splits_24_of_the_34():
    t = 2
    expected = S * B * H * (10 + 24 / t + 5 * A * S / (H * t)) + left_out(t)
    assert saved_per_layer(f"tp={t},dp=4,mbs=2,flash_attention=0") == pytest.approx(expected)


def test_sequence_parallel_splits_everything():
    t = 4
    expected = S * B * H / t * (34 + 5 * A * S / H) + left_out(t, sp=True)
    assert saved_per_layer(f"tp={t},sp=1,dp=2,mbs=2,flash_attention=0") == pytest.approx(expected)


def test_selective_recompute_with_sequence_parallel_keeps_34_over_t():
    t = 8
    expected = S * B * H * 34 / t + left_out(t, sp=True)
    assert saved_per_layer(f"tp={t},sp=1,mbs=2,recompute=selective,flash_attention=0") == pytest.approx(expected)


def test_fused_attention_keeps_no_scores():
    assert saved_per_layer("dp=8,mbs=2") == pytest.approx(S * B * H * 34 + left_out(flash=True))


def test_no_dropout_keeps_no_masks():
    """Without dropout the two residual masks (1 byte each) and, unfused, the mask and dropout output
    of the scores go: 32 + 2·a·s/h per sbh instead of 34 + 5·a·s/h."""
    m = MODEL.model_copy(update={"dropout": 0.0})
    rp = resolve(m, get_cluster("1xdgx-a100-80g"), parse_plan("dp=8,mbs=2,flash_attention=0"))
    got = sum(b.saved for b in Anatomy(rp).dense.values())
    assert got == pytest.approx(S * B * H * (32 + 2 * A * S / H) + left_out())


def test_backward_workspace_drops_weight_gradients_with_fused_wgrad():
    rp = resolve(MODEL, get_cluster("1xdgx-a100-80g"), parse_plan("dp=8,mbs=2"))
    an = Anatomy(rp)
    n = S * B * H * 2
    assert an.dense["fc2"].bwd_workspace == pytest.approx(n + S * B * MODEL.ffn * 2)  # dY and dA only
    assert all(b.bwd_workspace > 0 for b in an.dense.values())


@pytest.mark.parametrize("factor", [0.5, 1.25])
def test_expert_capacity_scales_what_the_experts_compute_and_receive(factor):
    """MoESpec.capacity_factor: the experts' buffers hold factor x the balanced load (cut or padded),
    so their GEMMs, saved activations and the all-to-alls scale by it; the router does not."""
    from simexec.sim.simulate import simulate

    base = get_model("mixtral-8x7b")
    capped = base.model_copy(update={"moe": base.moe.model_copy(update={"capacity_factor": factor})})
    plan = parse_plan("dp=8,ep=8,gbs=8,dtype=bf16")
    a, b = (Anatomy(resolve(m, get_cluster("1xdgx-h100"), plan)) for m in (base, capped))
    assert b.moe["experts"].flops == pytest.approx(factor * a.moe["experts"].flops)
    assert b.moe["experts"].saved == pytest.approx(factor * a.moe["experts"].saved)
    assert b.dispatch_bytes == pytest.approx(factor * a.dispatch_bytes)
    assert b.moe["router"].flops == a.moe["router"].flops
    step = [simulate(m, "1xdgx-h100", "dp=8,ep=8,gbs=8,dtype=bf16,zero=3", seq_len=1024).step_time_s
            for m in (base, capped)]
    assert (step[1] > step[0]) == (factor > 1)


def test_the_executor_refuses_expert_capacity_only_with_context_parallelism():
    pytest.importorskip("torch")
    from simexec.exec.rank.unsupported_plans import unsupported

    m = get_model("moe-tiny")
    capped = m.model_copy(update={"moe": m.moe.model_copy(update={"capacity_factor": 1.25})})
    assert unsupported(resolve(m, get_cluster("local"), parse_plan("dp=2,ep=2,gbs=4"))) is None
    assert unsupported(resolve(capped, get_cluster("local"), parse_plan("dp=2,ep=2,gbs=4"))) is None
    assert "capacity_factor=1.25" in unsupported(resolve(capped, get_cluster("local"), parse_plan("dp=2,ep=2,cp=2,gbs=4")))


def test_sliding_window_prices_the_band_on_gpus_and_every_score_on_cpus():
    """A causal window of w over s positions leaves s*w - w^2/2 query-key pairs: GPU kernels skip the
    tiles outside the band (FlashAttention's window_size), PyTorch's CPU kernel takes the band as a
    mask and computes all s^2, and keeps the mask's additive form (s x s, in the compute dtype) for
    its backward; the layer every `full_attention_every` keeps the causal s^2/2, and a window as long
    as the sequence changes nothing."""
    s, w = 4096, 1024
    base = get_model("llama3-8b", seq_len=s)
    windowed = base.model_copy(update=dict(sliding_window=w, full_attention_every=2))
    for cluster, pairs in (("dgx-h100", s * w - w * w / 2), ("local", s * s)):
        an = Anatomy(resolve(windowed, get_cluster(cluster), parse_plan("gbs=8")))
        causal = an.layer(1)["attn"].flops  # layer 1 of every 2 attends fully
        assert an.layer(0)["attn"].flops == pytest.approx(causal * pairs / (s * s / 2))
        assert an.layer(0)["qkv"] == an.layer(1)["qkv"]
        mask = s * s * 2 if cluster == "local" else 0.0
        assert an.layer(0)["attn"].saved == pytest.approx(an.layer(1)["attn"].saved + mask, rel=1e-12)
    long = base.model_copy(update=dict(sliding_window=s))
    assert Anatomy(resolve(long, get_cluster("local"), parse_plan("gbs=8"))).layer(0)["attn"].flops == causal
    unfused = Anatomy(resolve(windowed, get_cluster("dgx-h100"), parse_plan("gbs=8,flash_attention=0")))
    assert unfused.layer(0)["attn"] == unfused.layer(1)["attn"]  # the unfused scores are all computed


def test_sliding_window_refuses_the_ring_and_the_search_leaves_it_out():
    from simexec.errors import PlanError
    from simexec.search.space import plans

    m = get_model("llama3-8b", seq_len=8192).model_copy(update=dict(sliding_window=4096))
    with pytest.raises(PlanError, match="cp_impl=ring does not run sliding-window attention"):
        resolve(m, get_cluster("dgx-h100"), parse_plan("cp=2,cp_impl=ring,gbs=4"))
    resolve(m, get_cluster("dgx-h100"), parse_plan("cp=2,gbs=4"))  # the all-gather runs it
    resolve(m, get_cluster("dgx-h100"), parse_plan("cp=2,cp_impl=a2a,gbs=4"))  # and the all-to-all
    found = list(plans(m, get_cluster("dgx-h100"), 8, 8192, {"cp": 2, "tp": 4, "zero": 1}))
    assert found and {p.cp_impl for p in found} == {"allgather"}  # the all-to-all: more bytes and memory at cp 2


def test_fp32_main_gradients_accumulate_each_micro_batch_at_ten_bytes_a_parameter():
    """A weight gradient's accumulation reads the sum and the new gradient and writes the sum: 6 bytes
    per parameter in bf16, 10 when the sum is fp32 (`grad_fp32`); everything else in a block stays."""
    plain = Anatomy(resolve(MODEL, get_cluster("1xdgx-a100-80g"), parse_plan("dp=8,mbs=2")))
    fp32 = Anatomy(resolve(MODEL, get_cluster("1xdgx-a100-80g"), parse_plan("dp=8,mbs=2,grad_fp32=1")))
    h = MODEL.hidden
    weights = {"qkv": 3 * h * h, "proj": h * h, "fc1": MODEL.ffn * h, "fc2": MODEL.ffn * h}
    for name, params in weights.items():
        a, b = plain.dense[name], fp32.dense[name]
        assert b.bwd_bytes - a.bwd_bytes == pytest.approx(4 * params, rel=1e-3), name
        assert (b.flops, b.bytes, b.saved, b.bwd_flops) == (a.flops, a.bytes, a.saved, a.bwd_flops)


def test_the_embedding_gradient_is_accumulated_like_every_weight_gradient():
    """The embedding's backward zeroes a dense gradient of its vocabulary shard, scatters the rows into
    it, then adds it into the accumulated sum as every weight gradient is (`weight_grad_bytes`): 2 bytes per
    parameter for the zeroing and 6 for the sum in bf16, 4 more when the sum is fp32 (`grad_fp32`)."""
    params = MODEL.embedding_params() / 2
    rows = 2 * 2 * (2 * S) * H  # read the incoming gradient of two sequences, write its rows
    plain = Anatomy(resolve(MODEL, get_cluster("1xdgx-a100-80g"), parse_plan("dp=4,tp=2,mbs=2"))).embed
    fp32 = Anatomy(resolve(MODEL, get_cluster("1xdgx-a100-80g"), parse_plan("dp=4,tp=2,mbs=2,grad_fp32=1"))).embed
    assert plain.bwd_bytes == pytest.approx(rows + (2 + 6) * params, rel=1e-9)
    assert fp32.bwd_bytes - plain.bwd_bytes == pytest.approx(4 * params, rel=1e-9)


@pytest.mark.parametrize("impl,mask", [("allgather", 2048 * 4096 * 2), ("a2a", 0)])
def test_cpu_ranks_keep_the_gathered_keys_causal_mask_for_the_backward(impl, mask):
    """Context parallelism by all-gather hands PyTorch's CPU kernel its local queries' causal mask
    against every key (s/cp x s), which it keeps in the compute dtype; the all-to-all attends over
    the whole sequence causally, the ring masks each chunk itself, and GPU kernels take offsets."""
    m = get_model("llama3-8b", seq_len=4096)
    plan = parse_plan(f"cp=2,cp_impl={impl},gbs=8")
    cpu = Anatomy(resolve(m, get_cluster("local"), plan)).layer(0)["attn"].saved
    gpu = Anatomy(resolve(m, get_cluster("dgx-h100"), plan)).layer(0)["attn"].saved
    assert cpu - gpu == pytest.approx(mask, rel=1e-12)
    ring = Anatomy(resolve(m, get_cluster("local"), parse_plan("cp=2,cp_impl=ring,gbs=8")))
    assert ring._sdpa_mask(None) == 0.0


@pytest.mark.parametrize("model,plan", [
    ("gpt-tiny", "tp=2,gbs=2"), ("gpt-tiny", "tp=2,sp=1,gbs=2"), ("gpt-tiny", "cp=2,gbs=2,cp_impl=ring"),
    ("gpt-tiny", "cp=2,tp=2,sp=1,gbs=2,cp_impl=a2a"), ("moe-tiny", "ep=2,dp=2,tp=2,sp=1,cp=2,gbs=4"),
])
def test_layer_steps_are_the_layers_blocks_in_the_order_the_lowering_emits(model, plan):
    """`Anatomy.layer_steps`: every block of the layer once, in the order of its forward's compute
    instructions in the lowered program, with the collectives between them."""
    rp = resolve(get_model(model), get_cluster("local"), parse_plan(plan))
    an = Anatomy(rp)
    steps = an.layer_steps(0)
    assert sorted(s.name for s in steps if not s.axis) == sorted(an.layer(0))
    prog = lower(rp).ranks[0]
    emitted = [i.block for i in prog if i.phase == "fwd" and i.layer == 0 and i.mb == 0
               and (i.kind == "compute" or i.kind == "collective" and not i.block.startswith("gather"))]
    groups, expected = rank_groups(rp, 0), []
    for s in steps:
        if s.ring:
            expected += [s.name] * rp.plan.cp
        elif not s.axis or (s.fwd and len(getattr(groups, s.axis)) > 1):
            expected.append(s.name)
    assert emitted == expected


def test_transformer_engine_keeps_fp8_copies_of_linear_inputs_torchao_keeps_bf16():
    """Under FP8, Transformer Engine's linear layers keep their input's FP8 copy for the weight gradient
    (one byte an element): a Llama layer keeps 29 h per token where bf16 keeps 33.5 h. The projection keeps
    its copy beside the context the fused attention's backward reads. torchao keeps the bf16 inputs."""
    from simexec.specs.stack import get_stack

    llama = get_model("llama3-8b")
    T, h = 4096, llama.hidden

    def saved(dtype: str, stack: str) -> dict[str, float]:
        rp = resolve(llama, get_cluster("1xdgx-h100"), parse_plan(f"dp=8,dtype={dtype}"), seq_len=T,
                     stack=get_stack(stack))
        return {k: b.saved for k, b in Anatomy(rp).layer(0).items()}

    bf16, te, tao = saved("bf16", "megatron-core"), saved("fp8", "megatron-core"), saved("fp8", "torchtitan")
    assert tao == saved("bf16", "torchtitan")
    assert bf16["qkv"] - te["qkv"] == pytest.approx(T * h)  # the norm output: 2 bytes -> 1
    assert te["proj"] - bf16["proj"] == pytest.approx(T * h)  # an FP8 copy beside the bf16 context
    assert bf16["fc1"] - te["fc1"] == pytest.approx(T * h)
    assert te["fc2"] == pytest.approx(bf16["fc2"] / 2)  # the activation's output, FP8


@pytest.mark.parametrize("ep, sorted_", [(2, True), (8, False)])
def test_alltoall_sorts_received_rows_by_local_expert_and_back(ep, sorted_):
    """Megatron-Core's alltoall dispatcher with more than one local expert sorts the received rows by
    expert after the dispatch and back before the combine (`sort_chunks_by_idxs`): a read and a write of
    the rows each way, forward and backward; DeepEP's dispatcher permutes once, which the router counts."""
    mixtral = get_model("mixtral-8x7b")

    def experts(dispatcher: str):
        rp = resolve(mixtral, get_cluster("1xdgx-h100"), parse_plan(f"dp=8,ep={ep},moe_dispatcher={dispatcher}"),
                     seq_len=1024)
        an = Anatomy(rp)
        return an, an.layer(0)["experts"]

    an, a2a = experts("alltoall")
    _, deepep = experts("deepep")
    sort = 2 * 2 * an.dt * an.expert_rows * an.h if sorted_ else 0.0
    assert a2a.bytes - deepep.bytes == pytest.approx(sort)
    assert a2a.bwd_bytes - deepep.bwd_bytes == pytest.approx(sort)


def test_repeated_kv_heads_are_gathered_and_saved_at_the_query_heads_count():
    """torchtitan's repeat_kv (StackSpec.expands_kv_heads): context parallel all-gathers K/V for every
    query head, and the kernel saves them so; a stack that takes the grouped heads moves n_kv / n_heads."""
    from simexec.specs.stack import get_stack

    llama = get_model("llama3-70b")  # 64 query heads, 8 K/V heads
    plan = parse_plan("tp=8,sp=1,cp=2,gbs=4")
    grouped, repeated = (Anatomy(resolve(llama, get_cluster("4xdgx-h100"), plan, stack=get_stack(s)))
                         for s in ("megatron-core", "torchtitan"))
    assert repeated.kv_bytes == pytest.approx(grouped.kv_bytes * 8)
    tokens = grouped.tokens
    kv_row = tokens * llama.attention_widths[1] * 2 / 8  # K and V of the rank's grouped heads, bf16
    assert repeated.dense["attn"].saved - grouped.dense["attn"].saved == pytest.approx(7 * kv_row * 2)
    assert repeated.dense["qkv"].bytes - grouped.dense["qkv"].bytes >= 9 * kv_row
