"""The interpreter on the remaining plan dimensions (issue 6): MoE with expert parallelism, context
parallel (all-gather, ring and all-to-all), ZeRO-3 YaFSDP, HSDP and offload, each against the single-process reference (fp32, relative
1e-4, 3 steps, losses and final parameters); and the memory of the two ZeRO-3 flavours. Uses the rank
pool and `check_plan` of test_exec_interp.py."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

import torch
from test_exec_interp import check_plan, resolved, run_plan

EXTENDED = [
    # MoE (moe-tiny routes without dropping): experts over ep, each expert's FFN over tp, shared experts
    ("moe-tiny", "dp=1,gbs=2"),
    ("moe-tiny", "tp=2"),
    ("moe-tiny", "dp=2,ep=2"),
    ("moe-tiny", "dp=2,ep=2,tp=2"),
    ("moe-tiny", "dp=4,ep=2,zero=1"),
    ("moe-tiny", "dp=2,ep=2,pp=2,gbs=4"),
    ("moe-tiny", "dp=2,ep=2,recompute=full"),
    # context parallel: load-balanced sequence chunks, K/V all-gathered
    ("gpt-tiny", "cp=2"),
    ("gpt-tiny", "cp=2,tp=2"),
    ("moe-tiny", "cp=2"),
    # ZeRO-3 flavours, HSDP, offload
    ("gpt-tiny", "dp=4,zero=3,zero_impl=yafsdp"),
    ("gpt-tiny", "dp=2,zero=3,zero_impl=fsdp1,gbs=8"),
    # the flat partition summed into, zeroed each step
    ("gpt-tiny", "dp=2,zero=3,zero_impl=deepspeed,zero3_persist_below=0,gbs=8"),
    ("gpt-tiny", "dp=4,zero=3,dp_shard=2"),
    ("gpt-tiny", "dp=4,zero=1,dp_shard=2"),
    ("gpt-tiny", "dp=2,zero=1,offload=optimizer"),
    ("gpt-tiny", "dp=2,zero=3,offload=optimizer"),
    ("gpt-tiny", "dp=4,zero=3,offload=optimizer+params"),
    # combinations
    ("gpt-tiny", "dp=2,tp=2,sp=1,zero=3"),  # sequence-parallel norms' gradients into ZeRO-3 units
    ("gpt-tiny", "tp=2,sp=1,pp=2,vpp=2,gbs=8,mbs=2"),  # gathers of several sequences, virtual stages
    ("moe-tiny", "dp=2,ep=2,tp=2,zero=3"),
    ("moe-tiny", "dp=4,ep=2,zero=3,zero_impl=yafsdp"),
    ("moe-tiny", "dp=4,ep=2,zero=3,zero_impl=fsdp1"),
    ("moe-tiny", "dp=4,ep=2,zero=3,zero_impl=deepspeed,zero3_persist_below=0"),
    ("moe-tiny", "dp=4,ep=2,zero=2,dp_shard=2,gbs=8"),
    ("moe-tiny", "dp=2,ep=2,zero=1,offload=optimizer"),
    ("gpt-tiny", "dp=4,pp=2,zero=3,zero_impl=yafsdp,gbs=8"),
    # FSDP2: a unit kept gathered from its forward to its backward; under a pipeline, kept over the
    # step's micro-batches, its gradients accumulated unsharded and reduce-scattered once
    ("gpt-tiny", "dp=2,zero=3,reshard_after_forward=0,gbs=8"),
    ("gpt-tiny", "dp=2,pp=2,zero=3,gbs=8"),
    ("gpt-tiny", "dp=2,pp=2,zero=3,reshard_after_forward=0,gbs=8"),
    ("gpt-tiny", "dp=4,zero=2,dp_shard=2,gbs=8"),
    ("gpt-tiny", "cp=2,tp=2,sp=1"),
    ("gpt-tiny", "dp=2,cp=2,zero=3"),
    ("moe-tiny", "dp=2,ep=2,cp=2"),
    ("moe-tiny", "dp=2,ep=2,tp=2,sp=1"),
    # ring context parallel: K/V hop around the cp group, partial attentions merged by log-sum-exp,
    # flash-style backward per hop with dK/dV travelling home
    ("gpt-tiny", "cp=2,cp_impl=ring"),
    ("gpt-tiny", "cp=2,tp=2,cp_impl=ring"),
    ("gpt-tiny", "cp=4,cp_impl=ring"),
    ("gpt-tiny", "cp=2,cp_impl=ring,recompute=selective"),
    ("moe-tiny", "cp=2,tp=2,sp=1,cp_impl=ring"),
    # all-to-all context parallel (DeepSpeed-Ulysses): q, k and v exchanged for the whole sequence of a
    # cp-th of the heads, the attention's output exchanged back
    ("gpt-tiny", "cp=2,cp_impl=a2a"),
    ("gpt-tiny", "cp=4,cp_impl=a2a,recompute=selective"),
    ("gpt-tiny", "cp=2,tp=2,sp=1,cp_impl=a2a,recompute=full"),
    ("gpt-tiny", "dp=2,cp=2,pp=2,gbs=4,cp_impl=a2a,flash_attention=0"),
    ("moe-tiny", "dp=2,ep=2,cp=2,cp_impl=a2a"),
    # MoE parallel folding (etp=1): ep spans cp x dp, or tp x dp (each tp rank routes its own slice of
    # the sequence, the experts whole on their rank), each expert on one rank (edp of one) or two
    ("moe-tiny", "dp=2,cp=2,ep=4,etp=1"),
    ("moe-tiny", "dp=2,tp=2,sp=1,ep=4,etp=1"),
    ("moe-tiny", "dp=2,tp=2,sp=1,ep=2,etp=1,zero=1"),
    ("moe-tiny", "dp=2,tp=2,sp=1,ep=4,etp=1,moe_dispatcher=allgather"),
    # etp > 1: the dispatched rows gathered over etp (uneven after an all-to-all), each expert split over it
    ("moe-tiny", "dp=4,ep=2,etp=2"),
    ("moe-tiny", "dp=2,tp=2,sp=1,ep=2,etp=2"),
    ("moe-tiny", "dp=2,tp=2,sp=1,ep=2,etp=2,moe_dispatcher=allgather"),
    # pipeline layouts with stages that hold no transformer layer (only the embedding, or only the head)
    ("gpt-tiny", "pp=3,gbs=6,layout=E|tttt|L"),
    ("gpt-tiny", "pp=2,vpp=2,gbs=4,layout=E|tt|tt|L"),
    ("moe-tiny", "tp=2,sp=1,pp=2,gbs=4,layout=E|ttttL"),
    # MoE dispatchers: allgather (each token once with its routing weights gathered over ep, the
    # weighted outputs reduce-scattered back); deepep inside one NVLink domain (one all-to-all over ep)
    ("moe-tiny", "dp=2,ep=2,moe_dispatcher=allgather"),
    ("moe-tiny", "dp=2,ep=2,tp=2,sp=1,moe_dispatcher=allgather"),
    ("moe-tiny", "dp=4,ep=4,moe_dispatcher=deepep"),
    # moe_a2a_overlap: one micro-batch's forward merged with another's backward, layer by layer, with
    # and without an interleaved pipeline (Megatron's combined 1F1B)
    ("moe-tiny", "dp=2,ep=2,gbs=8,moe_a2a_overlap=1"),
    ("moe-tiny", "dp=2,ep=2,pp=2,vpp=2,gbs=8,moe_a2a_overlap=1"),
]


@pytest.mark.parametrize("model,plan", EXTENDED, ids=[f"{m}:{p}" for m, p in EXTENDED])
def test_plan_matches_reference(model, plan):
    from simexec.exec.rank.unsupported_plans import unsupported

    why = unsupported(resolved(model, plan))
    if why:
        pytest.xfail(why)
    check_plan(model, plan)


@pytest.mark.parametrize("plan", ["dp=2,ep=2", "dp=2,ep=2,tp=2,sp=1", "dp=4,ep=2,zero=3,mbs=2,gbs=8",
                                  "dp=2,ep=2,pp=2,gbs=4", "dp=4,ep=4,mbs=2,gbs=8",
                                  "dp=4,ep=4,mbs=2,gbs=8,moe_dispatcher=allgather"])
def test_token_dropping_matches_reference(plan):
    """capacity_factor=1: the experts' buffers cut and padded to capacity per sequence, so every
    split of the batch drops what the single process drops (tests/test_exec_model.py checks that
    some are dropped)."""
    check_plan(str(Path(__file__).resolve().parent / "data" / "moe-cap-tiny.yaml"), plan)


@pytest.mark.parametrize("plan", ["dp=2,ep=2", "dp=4,ep=4,moe_dispatcher=deepep"])
def test_group_limited_routing_matches_reference(plan):
    """router_groups=4, router_group_topk=2: each token's experts from its two best groups, on every split."""
    check_plan(str(Path(__file__).resolve().parent / "data" / "moe-group-tiny.yaml"), plan)


def test_deepseek_layout_matches_reference():
    """Latent attention beside MoE layers, every split they meet in DeepSeek-V3's training at once:
    experts over ep, heads over tp with sp, stages over pp."""
    check_plan(str(Path(__file__).resolve().parent / "data" / "mla-moe-tiny.yaml"), "dp=2,ep=2,tp=2,sp=1,pp=2,gbs=8")


@pytest.mark.parametrize("plan", ["dp=1,gbs=2", "tp=2,gbs=2", "tp=2,sp=1,gbs=2"])
def test_latent_attention_peak_memory_follows_the_simulator(plan):
    """MLA keeps its latents (whole on every tp rank), the normed latents its up projections read and,
    on CPU ranks, V padded to the key width with the kernel's padded output: each rank's peak within
    4% of the prediction (before the simulator priced them, 5-8% above it)."""
    from simexec.specs.model import get_model
    from simexec.sim.simulate import simulate

    model = str(Path(__file__).resolve().parent / "data" / "mla-tiny.yaml")
    _, results = run_plan(model, plan)
    predicted = simulate(get_model(model), "local", plan + ",dtype=fp32", seq_len=32).peak_memory_bytes
    for r, res in enumerate(results):
        err = res["peak_memory_bytes"] / predicted - 1
        assert abs(err) < 0.04, f"{plan} rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted:.0f} ({err:+.1%})"


def test_yafsdp_preallocates_and_fsdp_allocates_on_demand():
    """YaFSDP: two buffers per rank from the start, no allocation of a gathered layer in the step;
    FSDP: a gathered layer's buffer allocated at each use. The measured peaks differ the way the
    simulator predicts for the same plans."""
    from simexec.sim.simulate import simulate

    measured, predicted, unit = {}, {}, 0.0
    for flavour in ("fsdp", "yafsdp"):
        plan = f"dp=4,zero=3,zero_impl={flavour}"
        rp, results = run_plan("gpt-tiny", plan)
        measured[flavour] = results[0]
        predicted[flavour] = simulate("gpt-tiny", "local", plan + ",dtype=fp32", seq_len=32).peak_memory_bytes
        from simexec.program.lower import lower

        unit = max(i.bytes for i in lower(rp, symmetric=False).ranks[0]
                   if i.block == "gather" and 0 <= i.layer < rp.model.layers)
    assert measured["yafsdp"]["largest_alloc_bytes"] < unit <= measured["fsdp"]["largest_alloc_bytes"]
    d_measured = measured["yafsdp"]["peak_memory_bytes"] - measured["fsdp"]["peak_memory_bytes"]
    d_predicted = predicted["yafsdp"] - predicted["fsdp"]
    assert d_measured * d_predicted > 0, (
        f"yafsdp - fsdp peak: measured {d_measured / 1e3:.0f} kB, predicted {d_predicted / 1e3:.0f} kB")


def test_zero3_gradient_shards_come_with_the_backward_under_fsdp_and_from_the_start_under_deepspeed():
    """FSDP makes a unit's gradient shard at its first reduce-scatter and lets it go after the
    optimizer step; DeepSpeed's flat partition is there from the start. The peak (early in the
    backward) tells them apart: each rank within 2% of the prediction under both, and DeepSpeed's
    peak above FSDP's by what the simulator says, within a fifth (before the shards were made
    lazily in the simulator, FSDP's ranks measured 5% under it). DeepSpeed runs with every tensor
    sharded (its default keeps gpt-tiny's, all under 1e5 elements, whole, which the executor refuses)."""
    from simexec.sim.simulate import simulate

    measured, predicted = {}, {}
    for flavour in ("fsdp", "deepspeed,zero3_persist_below=0"):
        plan = f"dp=4,zero=3,zero_impl={flavour},mbs=4"
        _, results = run_plan("gpt-tiny", plan)
        predicted[flavour] = simulate("gpt-tiny", "local", plan + ",dtype=fp32", seq_len=32).peak_memory_bytes
        measured[flavour] = [res["peak_memory_bytes"] for res in results]
        for r, m in enumerate(measured[flavour]):
            err = m / predicted[flavour] - 1
            assert abs(err) < 0.02, f"{plan} rank {r}: measured {m}, predicted {predicted[flavour]:.0f} ({err:+.1%})"
    ds = "deepspeed,zero3_persist_below=0"
    d_predicted = predicted[ds] - predicted["fsdp"]
    d_measured = min(measured[ds]) - max(measured["fsdp"])
    assert d_predicted > 0 and abs(d_measured / d_predicted - 1) < 0.2, (d_measured, d_predicted)


def test_zero2_over_several_micro_batches_holds_its_partition_and_fills_its_bucket_in_the_backward():
    """ZeRO-2 holds DeepSpeed's gradient partition from the start, summed into over micro-batches,
    and makes its reduce bucket as the head's weight gradient lands, before the head's backward lets
    its inputs go. Every rank within 3% of the prediction in bf16, over two micro-batches and with
    small buckets (what remains is the head's weight gradient beside the new bucket, about 1.5%);
    before both, +6.1% and -4.8% (scripts/probe_host.py memory-sweep)."""
    from simexec.sim.simulate import simulate

    for plan in ("dp=2,zero=2,mbs=2,gbs=8", "dp=4,zero=2,mbs=2,gbs=8,bucket_mb=0.05"):
        _, results = run_plan("gpt-tiny", plan, seq_len=64, dtype="bf16")
        predicted = simulate("gpt-tiny", "local", plan + ",dtype=bf16", seq_len=64).peak_memory_bytes
        for r, res in enumerate(results):
            err = res["peak_memory_bytes"] / predicted - 1
            assert abs(err) < 0.03, f"{plan} rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted:.0f} ({err:+.1%})"


def test_moe_peak_memory_follows_the_simulator():
    """An expert-parallel MoE step holds what the program says: fused-kernel norms and rotary
    embeddings (input and 1/rms, shared tables), the all-to-alls' received tokens freed once
    permuted, the combine's un-permuted outputs kept for the routing weights' gradient. Every rank
    within 2% of the prediction (routing imbalance moves a rank by about 1%)."""
    from simexec.sim.simulate import simulate

    plan = "dp=2,ep=2,gbs=4"
    _, results = run_plan("moe-tiny", plan, seq_len=None)
    predicted = simulate("moe-tiny", "local", plan + ",dtype=fp32").peak_memory_bytes
    for r, res in enumerate(results):
        err = res["peak_memory_bytes"] / predicted - 1
        assert abs(err) < 0.02, f"rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted:.0f} ({err:+.1%})"


@pytest.mark.parametrize("plan", ["dp=1,gbs=2", "tp=2,gbs=2"])
def test_qk_norms_hold_the_memory_the_simulator_gives_them(tmp_path, plan):
    """The norms over q and k heads keep their input and 1/rms (fp32) for the backward: what the
    step holds beyond the same model without them is what the program counts, within 5%."""
    import json

    from simexec.specs.model import get_model
    from simexec.sim.simulate import simulate

    with_qk = str(Path(__file__).resolve().parent / "data" / "qk-norm-tiny.yaml")
    spec = get_model(with_qk).model_copy(update={"qk_norm": False})
    without = tmp_path / "no-qk-norm.json"
    without.write_text(json.dumps({k: v for k, v in spec.model_dump().items() if v is not None}))
    measured, predicted = [], []
    for model in (with_qk, str(without)):
        _, results = run_plan(model, plan)
        measured.append(results[0]["peak_memory_bytes"])
        predicted.append(simulate(get_model(model), "local", plan + ",dtype=fp32", seq_len=32).peak_memory_bytes)
    d_measured, d_predicted = measured[0] - measured[1], predicted[0] - predicted[1]
    assert d_predicted > 0 and d_measured == pytest.approx(d_predicted, rel=0.05), (d_measured, d_predicted)


@pytest.mark.parametrize("plan", ["dp=2,tp=2,sp=1,gbs=2", "dp=2,tp=2,sp=1,gbs=2,master_grads=1", "dp=2,tp=2,gbs=2"])
def test_sequence_parallel_and_16bit_step_memory_follows_the_simulator(plan):
    """In bf16, as the program counts: under sp the norms' inputs and outputs stay sequence slices
    (the column-parallel GEMMs gather the slice again for their weight gradient), and Adam casts the
    16-bit gradients to fp32 a piece at a time, or every one at once under `master_grads` (the peak
    then falls in the step). Every rank within 2% of the prediction; before, the step's fp32 copies
    put the measured peak 6% above it."""
    from simexec.program.lower import lower
    from simexec.specs.model import get_model
    from simexec.specs.cluster import get_cluster
    from simexec.specs.plan import parse_plan, resolve
    from simexec.sim.simulate import simulate
    from test_exec_interp import _pool

    full = plan + ",dtype=bf16"
    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(full))
    results = _pool().run(rp, lower(rp, symmetric=False), 2)
    predicted = simulate("gpt-tiny", "local", full).peak_memory_bytes
    for r, res in enumerate(results):
        err = res["peak_memory_bytes"] / predicted - 1
        assert abs(err) < 0.02, f"{plan} rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted:.0f} ({err:+.1%})"


def test_torch_ddp_buckets_beside_the_gradients_follow_the_simulator():
    """grad_bucket_view=0 (torch DDP's default): the buckets are a second copy of the gradients, so
    the step holds one more gradient's bytes than with `.grad` viewing the buckets, as the simulator
    says; each peak within 2% of its prediction."""
    from simexec.specs.model import get_model
    from simexec.sim.simulate import simulate

    measured, predicted = {}, {}
    for view in (1, 0):
        plan = f"dp=2,gbs=4,grad_bucket_view={view}"
        _, results = run_plan("gpt-tiny", plan)
        measured[view] = max(r["peak_memory_bytes"] for r in results)
        predicted[view] = simulate("gpt-tiny", "local", plan + ",dtype=fp32", seq_len=32).peak_memory_bytes
        err = measured[view] / predicted[view] - 1
        assert abs(err) < 0.02, f"{plan}: measured {measured[view]}, predicted {predicted[view]:.0f} ({err:+.1%})"
    grads = 4 * get_model("gpt-tiny").params  # fp32
    assert measured[0] - measured[1] == pytest.approx(grads, rel=0.1)
    assert predicted[0] - predicted[1] == pytest.approx(grads, rel=0.1)


# gradient clipping: the global norm summed over shards, stages and experts, each replica counted once
CLIP = 0.05  # well below gpt-tiny's and moe-tiny's gradient norms, so every step clips
CLIPPED = [
    ("gpt-tiny", "dp=2"),
    ("gpt-tiny", "tp=2,sp=1"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8"),
    ("gpt-tiny", "dp=4,zero=1,dp_shard=2"),
    ("gpt-tiny", "dp=2,tp=2,zero=2,gbs=4"),
    ("gpt-tiny", "dp=2,pp=2,vpp=2,zero=3,gbs=8"),
    ("gpt-tiny", "dp=2,cp=2"),
    ("gpt-tiny", "dp=2,zero=1,offload=optimizer"),
    ("moe-tiny", "dp=2,ep=2,tp=2"),
    ("moe-tiny", "dp=4,ep=2,zero=3"),
]


# static loss scaling: a power of two, so that scaling and unscaling are exact in fp32
SCALE = 1024


def test_clipping_and_loss_scaling_change_the_reference():
    """The runs below test something: at CLIP every step's update differs from the unclipped one; a
    loss scale of a power of two, unscaled, changes nothing, and the gradients' norm stays below
    CLIP x SCALE, so a run that clipped before unscaling would differ; a loss scale the gradients do
    not survive skips every step."""
    from test_exec_interp import _reference, rel_err

    free = _reference("gpt-tiny", 4, 32, 3)

    def moved(other):
        return max(rel_err(other["params"][k], v) for k, v in free["params"].items())

    assert moved(_reference("gpt-tiny", 4, 32, 3, f"clip_grad={CLIP}")) > 0.05
    assert moved(_reference("gpt-tiny", 4, 32, 3, f"loss_scale={SCALE}")) < 1e-6
    unscaled = _reference("gpt-tiny", 4, 32, 3, f"loss_scale={SCALE},clip_grad={CLIP * SCALE:g}")
    assert moved(unscaled) < 1e-6  # clipping at CLIP x SCALE never clips the unscaled gradients
    overflow = _reference("gpt-tiny", 4, 32, 3, "loss_scale=3e38")
    init = _reference("gpt-tiny", 4, 32, 0)
    assert all(torch.equal(overflow["params"][k], v) for k, v in init["params"].items())


@pytest.mark.parametrize("model,plan", CLIPPED, ids=[f"{m}:{p}" for m, p in CLIPPED])
def test_clipped_plan_matches_reference(model, plan):
    check_plan(model, f"{plan},clip_grad={CLIP}")


@pytest.mark.parametrize("plan", ["dp=2,tp=2,pp=2,gbs=8,loss_scale=1024,clip_grad=0.05",
                                  "dp=2,zero=1,offload=optimizer,loss_scale=1024,clip_grad=0.05",
                                  "dp=4,zero=3,loss_scale=3e38"])
def test_loss_scaled_plan_matches_reference(plan):
    """Unscaled before the clipping's norm; the last plan overflows on every rank and skips every step."""
    check_plan("gpt-tiny", plan)


# dynamic loss scaling from 2**126, doubled after every clean step, halved after two overflows: 2**128
# exceeds fp32 and overflows the loss's gradient itself, 2**126 and 2**127 leave gpt-tiny's gradients
# (at most 2.5x the seed at the start, under 1x after a step) at least 1.6x below fp32's largest value
DYNAMIC = f"loss_scale={2.0 ** 126!r},loss_scale_window=1,loss_scale_hysteresis=2"
DYNAMIC_STEPS = 6


def test_dynamic_loss_scale_grows_backs_off_and_skips():
    """The reference's trajectory under DYNAMIC, which the executor's runs below must reproduce."""
    from test_exec_interp import _reference

    ref = _reference("gpt-tiny", 8, 32, DYNAMIC_STEPS, DYNAMIC)
    assert [math.log2(x) for x in ref["loss_scales"]] == [126, 127, 128, 128, 127, 128]
    assert ref["skipped_steps"] == [2, 3, 5]


@pytest.mark.parametrize("plan", ["dp=2,tp=2,pp=2,gbs=8", "dp=4,zero=3,gbs=8", "dp=2,zero=1,offload=optimizer,gbs=8"])
def test_dynamically_scaled_plan_matches_reference(plan):
    """Every rank grows, backs off and skips with the reference, whatever holds its gradients."""
    check_plan("gpt-tiny", f"{plan},{DYNAMIC},clip_grad={CLIP}", steps=DYNAMIC_STEPS)


@pytest.mark.parametrize("model,plan", [
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8,schedule=zb-h1"),  # tp-partial norm gradients summed by the weight passes
    ("gpt-tiny", "dp=2,pp=2,zero=2,gbs=8,schedule=zb-h1,recompute=full,clip_grad=0.01"),
    ("moe-tiny", "dp=2,ep=2,tp=2,pp=2,gbs=8,schedule=zb-h1"),
    ("tied", "pp=2,gbs=4,schedule=zb-h1"),
    ("mla", "tp=2,pp=2,gbs=4,schedule=zb-h1"),
    ("gpt-tiny", "cp=2,pp=2,gbs=4,cp_impl=ring,schedule=zb-h1,p2p_overlap=0"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,vpp=2,gbs=8,schedule=interleaved-zb"),
    ("moe-tiny", "dp=2,ep=2,pp=2,vpp=2,gbs=8,zero=1,schedule=interleaved-zb,recompute=selective"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,vpp=2,gbs=8,schedule=zb-v"),  # the V: loss on the first rank, a turn on the last
    # the head reads the embedding on the first rank: no copy, so ZeRO-2 runs too (refused with a loop's copy)
    ("tied", "dp=2,pp=2,vpp=2,gbs=8,zero=2,schedule=zb-v"),
    ("moe-tiny", "dp=2,ep=2,pp=2,vpp=2,gbs=8,zero=1,schedule=zb-v,recompute=full,clip_grad=0.01"),
    ("moe-tiny", "dp=2,ep=2,pp=2,vpp=2,gbs=8,schedule=dualpipev"),  # whole backwards beside split ones
    # DualPipe's pairs merged kernel by kernel: one pass's collectives in flight while the other computes
    ("moe-tiny", "dp=2,ep=2,tp=2,pp=2,vpp=2,gbs=8,zero=1,schedule=dualpipev,dualpipe_overlap=1"),
])
def test_zero_bubble_matches_reference(model, plan):
    """ZB-H1: each block's backward split into its input gradients (B) and, later, its weight gradients
    (W), against the single-process reference."""
    from test_exec_interp import MLA, TIED

    check_plan({"tied": TIED, "mla": MLA}.get(model, model), plan)


@pytest.mark.parametrize("model,plan", [
    ("gpt-tiny", "tp=2,tp_overlap=1"),
    ("gpt-tiny", "dp=2,tp=2,sp=1,tp_overlap=1"),  # the weight gradients re-read the re-gathered inputs
    ("moe-tiny", "dp=2,ep=2,tp=2,tp_overlap=1"),  # the router's weight gradient under the mlp_in all-reduce
    ("moe-tiny", "dp=2,ep=2,tp=2,sp=1,tp_overlap=1"),
    ("gpt-tiny", "dp=2,tp=2,zero=3,tp_overlap=1"),
    ("gpt-tiny", "dp=2,tp=2,zero=2,tp_overlap=1,recompute=selective"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8,zero=1,recompute=full,tp_overlap=1,clip_grad=0.01"),
    ("mla", "tp=2,pp=2,gbs=4,tp_overlap=1"),  # latent projections' partial gradients
    ("mla", "tp=2,sp=1,gbs=4,tp_overlap=1"),
    ("tied", "tp=2,pp=2,gbs=4,tp_overlap=1"),
    ("gpt-tiny", "cp=2,tp=2,cp_impl=ring,tp_overlap=1"),
    ("gpt-tiny", "tp=2,sp=1,pp=2,gbs=4,p2p_overlap=0,tp_overlap=1"),  # blocking exchanges around the weight passes
])
def test_tp_overlap_matches_reference(model, plan):
    """Megatron-LM's asynchronous tp gradient communication: each column-parallel block's weight
    gradients computed while the all-reduce (reduce-scatter under sp) of its input gradient is in
    flight, the partial gradients of tp-replicated parameters summed after them."""
    from test_exec_interp import MLA, TIED

    check_plan({"tied": TIED, "mla": MLA}.get(model, model), plan)


def test_zero_bubble_peak_memory_follows_the_simulator():
    """Under ZB-H1 a micro-batch's activations and the output gradients its W reads live until W, so
    the last stage holds pp micro-batches, not 1F1B's one: every rank within 4% of its prediction, and
    the last stage's peak grows as predicted."""
    from simexec.sim.simulate import simulate

    peaks = {}
    for schedule in ("1f1b", "zb-h1"):
        plan = f"pp=2,gbs=8,schedule={schedule}"
        _, results = run_plan("gpt-tiny", plan)
        predicted = simulate("gpt-tiny", "local", plan + ",dtype=fp32", seq_len=32).peak_memory_bytes_per_rank
        for r, res in enumerate(results):
            err = res["peak_memory_bytes"] / predicted[r] - 1
            assert abs(err) < 0.04, f"{plan} rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted[r]:.0f} ({err:+.1%})"
        peaks[schedule] = (results[1]["peak_memory_bytes"], predicted[1])
    measured_growth = peaks["zb-h1"][0] / peaks["1f1b"][0] - 1
    predicted_growth = peaks["zb-h1"][1] / peaks["1f1b"][1] - 1
    assert measured_growth > 0.1 and abs(measured_growth - predicted_growth) < 0.1 * predicted_growth + 0.02


def test_zb_v_peak_memory_follows_the_simulator():
    """ZB-V holds the first and last stages on the first rank and the two middle ones on the last: both
    ranks' measured peaks within 3% of the prediction."""
    from simexec.sim.simulate import simulate

    plan = "pp=2,vpp=2,gbs=8,mbs=2,schedule=zb-v"
    _, results = run_plan("gpt-tiny", plan)
    predicted = simulate("gpt-tiny", "local", plan + ",dtype=fp32", seq_len=32).peak_memory_bytes_per_rank
    for r, res in enumerate(results):
        err = res["peak_memory_bytes"] / predicted[r] - 1
        assert abs(err) < 0.03, f"{plan} rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted[r]:.0f} ({err:+.1%})"


def _measured_and_predicted(model: str, plan: str, seq_len: int) -> tuple[list[int], dict]:
    """Per-rank peaks of the plan as given (its dtype included) run by the executor, and as simulated."""
    from simexec.specs.model import get_model
    from simexec.sim.simulate import simulate
    from test_exec_interp import run_plan

    _, results = run_plan(model, plan, seq_len, steps=2, dtype=None)
    predicted = simulate(get_model(model), "local", plan, seq_len=seq_len).peak_memory_bytes_per_rank
    return [r["peak_memory_bytes"] for r in results], predicted


@pytest.mark.parametrize("model,plan", [("gpt-tiny", "pp=2,gbs=16,mbs=4,dtype=fp32"),
                                        ("gpt-tiny", "pp=2,gbs=16,mbs=4,dtype=bf16"),
                                        ("moe-tiny", "pp=2,gbs=8,mbs=4,dtype=fp32")])
def test_zero_bubble_weight_pass_keeps_only_what_it_reads(model, plan):
    """Under ZB-H1, with micro-batches large enough for the activations to dominate: a block's
    input-gradient pass frees what only it reads (an activation function's input, the attention's
    saved tensors, the MoE combine's operands, the fp32 logits once their gradient is cast) and the
    weight pass's operands live until it runs. Every rank within 3%; counting every activation until
    the weight pass, as before, put the last stage 12% above its measured peak."""
    measured, predicted = _measured_and_predicted(model, plan + ",schedule=zb-h1", 64)
    for r, m in enumerate(measured):
        err = m / predicted[r] - 1
        assert abs(err) < 0.03, f"{model} {plan} rank {r}: measured {m}, predicted {predicted[r]:.0f} ({err:+.1%})"


def test_sixteen_bit_logits_gradient_is_cast_beside_the_fp32_one():
    """In bf16 the head's backward casts the fp32 logits' gradient to bf16 while the fp32 one is
    held: with the vocabulary dominating (micro-batch 16), the peak falls there and is predicted
    within 1% (it was 6.8% above the prediction without the cast)."""
    measured, predicted = _measured_and_predicted("gpt-tiny", "dp=1,gbs=16,mbs=16,dtype=bf16", 64)
    assert abs(measured[0] / predicted[0] - 1) < 0.01, (measured, predicted)


@pytest.mark.parametrize("model,plan", [("window-tiny.yaml", "tp=2,gbs=8,mbs=4,dtype=bf16"),
                                        ("qk-norm-tiny.yaml", "dp=1,gbs=8,mbs=4,dtype=fp32"),
                                        ("mla-tiny.yaml", "tp=2,gbs=8,mbs=4,dtype=bf16")])
def test_eager_norm_and_swiglu_backward_buffers_are_counted(model, plan):
    """On CPU ranks RMSNorm's backward holds three fp32 buffers of its input and SwiGLU's one of the
    activation beside its gradients; a block's saved tensors go after its own backward. Every rank
    within 3% (without the buffers: +9.9%, +4.3% and +5.7%)."""
    measured, predicted = _measured_and_predicted(str(Path(__file__).parent / "data" / model), plan, 64)
    for r, m in enumerate(measured):
        assert abs(m / predicted[r] - 1) < 0.03, (r, m, predicted[r])


def test_ring_sends_let_their_buffers_go_once_sent():
    """Ring attention's last sends are waited by no instruction; gloo reports a send complete only
    once waited, so the rank held every micro-batch's K/V and dK/dV messages until the step ended
    (+10.9% over the prediction with two micro-batches). Each rank within 1%."""
    measured, predicted = _measured_and_predicted("gpt-tiny", "cp=2,cp_impl=ring,gbs=8,mbs=4,dtype=bf16", 64)
    for r, m in enumerate(measured):
        assert abs(m / predicted[r] - 1) < 0.01, (r, m, predicted[r])


@pytest.mark.parametrize("model,plan", [("window-tiny.yaml", "cp=2,cp_impl=a2a"), ("mla-tiny.yaml", "cp=2,tp=2,cp_impl=a2a"),
                                        ("qk-norm-tiny.yaml", "cp=2,cp_impl=a2a,schedule=zb-h1,pp=2,gbs=4")])
def test_all_to_all_context_parallelism_matches_reference(model, plan):
    """cp_impl=a2a where the attention is not plain: a sliding window (which ring attention refuses),
    latent attention with value heads narrower than the key heads, grouped query heads with qk norms."""
    check_plan(str(Path(__file__).parent / "data" / model), plan)


@pytest.mark.parametrize("model,impl,tol", [("gpt-tiny", "allgather", 0.02), ("gpt-tiny", "ring", 0.02),
                                            ("gpt-tiny", "a2a", 0.02), ("mla-tiny.yaml", "allgather", 0.05),
                                            ("mla-tiny.yaml", "a2a", 0.05)])
def test_context_parallel_memory_follows_the_simulator(model, impl, tol):
    """With activations most of the peak (16 sequences of 64): the all-gather keeps the gathered K/V
    for the attention's backward and holds their gradients whole until the reduce-scatter; the ring
    on CPU keeps its fp32 output beside the output projection's copy; the all-to-all keeps the
    attention's output in both layouts, and frees q, k and v of the sequence split once exchanged.
    Every rank within `tol` of its prediction (before these were counted: +7.2%, +3.3%, +3.2% and,
    for MLA's all-gather, +33%)."""
    from simexec.sim.simulate import simulate

    model = str(Path(__file__).parent / "data" / model) if model.endswith(".yaml") else model
    plan = f"cp=2,gbs=16,mbs=16,cp_impl={impl}"
    _, results = run_plan(model, plan, seq_len=64)
    predicted = simulate(model, "local", plan + ",dtype=fp32", seq_len=64).peak_memory_bytes_per_rank
    for r, res in enumerate(results):
        err = res["peak_memory_bytes"] / predicted[r] - 1
        assert abs(err) < tol, f"{plan} rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted[r]:.0f} ({err:+.1%})"


def nodes_of(gpus: int, world: int):
    """The `local` cluster as nodes of `gpus` ranks each, every node one NVLink domain."""
    from simexec.specs.cluster import get_cluster

    local = get_cluster("local")
    return local.model_copy(update={"nodes": world // gpus, "node": local.node.model_copy(update={"gpus_per_node": gpus})})


DATA = Path(__file__).resolve().parent / "data"
# moe_dispatcher=deepep over ep groups that leave their node (DeepEP's two hops: each token once per
# destination node over the network, then over NVLink to the ranks holding its experts; the combine
# summed in the node, then at the source): (model, plan, ranks per node)
DEEPEP_ACROSS = [
    ("moe-tiny", "dp=4,ep=4,moe_dispatcher=deepep", 2),
    (str(DATA / "moe-group-tiny.yaml"), "dp=4,ep=4,moe_dispatcher=deepep", 2),  # group-limited routing
    (str(DATA / "moe-cap-tiny.yaml"), "dp=4,ep=4,mbs=2,gbs=8,moe_dispatcher=deepep", 2),  # tokens dropped
    ("moe-tiny", "dp=4,ep=2,zero=1,moe_dispatcher=deepep", 1),  # two ep groups, one rank per node each
    ("moe-tiny", "dp=4,ep=4,tp=2,sp=1,moe_dispatcher=deepep", 4),  # experts split over tp
    ("moe-tiny", "dp=2,tp=2,sp=1,ep=4,etp=1,moe_dispatcher=deepep", 2),  # folded: ep over tp x dp
    ("moe-tiny", "dp=4,ep=4,recompute=full,moe_dispatcher=deepep", 2),
    ("moe-tiny", "dp=4,ep=4,pp=2,gbs=8,moe_dispatcher=deepep", 2),
    ("moe-tiny", "dp=4,ep=4,gbs=8,moe_dispatcher=deepep,moe_a2a_overlap=1", 2),
]


@pytest.mark.parametrize("model,plan,gpus", DEEPEP_ACROSS, ids=[f"{Path(m).stem}:{p}:{g}" for m, p, g in DEEPEP_ACROSS])
def test_deepep_across_nvlink_domains_matches_reference(model, plan, gpus):
    """The lowering's two hops, run as DeepEP's internode kernels move tokens, train as the single process."""
    from simexec.exec.rank.unsupported_plans import unsupported
    from simexec.program.groups import deepep_two_hops

    cluster = nodes_of(gpus, resolved(model, plan).world)
    rp = resolved(model, plan, cluster=cluster)
    assert deepep_two_hops(rp) and unsupported(rp) is None
    check_plan(model, plan, cluster=cluster)


def test_deepep_hops_send_a_token_once_per_domain_then_once_per_rank():
    """What DeepEP's hops select (`ActivationCollectives.hop_plan`), on rank 0 of ep 4 over two nodes of
    two ranks (rank j holds experts 2j, 2j+1): the network hop sends a token once to each node holding
    one of its experts, not once per expert; the NVLink hop once to each rank holding one."""
    from simexec.exec.nn.gpt import Route
    from simexec.exec.rank.activation_collectives import ActivationCollectives
    from simexec.program.instructions import Instr

    class Echo:  # every peer sends what this rank sends: the selection is what is checked
        @staticmethod
        def all_to_all_single(out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
            out.copy_(inp)

    class Rank(ActivationCollectives):
        comm = Echo

        def read(self, key):
            return self.env[key]

    model = str(DATA / "moe-group-tiny.yaml")
    r = Rank()
    r.rp = resolved(model, "dp=4,ep=4,moe_dispatcher=deepep", cluster=nodes_of(2, 4))
    r.rank, r.m, r.env = 0, r.rp.model, {}
    experts = torch.tensor([[0, 1], [0, 5], [4, 6], [-1, 2], [-1, -1]])  # -1: dropped under a capacity
    r.env[("route", 0, 0)] = Route(torch.zeros(10, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), experts)
    hop = lambda block, group: Instr(0, f"fwd.{block}.L0.m0", "collective", "comm.ep", "alltoall@ep",
                                     phase="fwd", block=block, layer=0, mb=0, axis="ep", group=group)
    r.hop_plan(hop("dispatch_net", (0, 2)), None, net=True)
    sel, send, recv, rows = r.env[("hop_net", 0, 0)]
    assert sel.tolist() == [0, 1, 3, 1, 2] and send == [3, 2] and rows == 5  # 5 rows, not 7 assignments
    r.hop_plan(hop("dispatch", (0, 1)), None, net=False)
    sel, send, _, _ = r.env[("hop_domain", 0, 0)]
    assert sel.tolist() == [0, 1, 3, 2] and send == [3, 1]  # token 0's two experts on rank 0: one copy
    assert r.env[("gathered_experts", 0, 0)].tolist() == [[0, 1], [0, 5], [0, 5], [-1, 2]]


def test_deepep_across_nvlink_domains_refusals():
    """Across domains the executor runs deepep where every domain holds as many of an ep group's ranks
    (DeepEP's layout) and the experts are whole on their rank; inside one domain deepep is one all-to-all."""
    from simexec.exec.rank.unsupported_plans import unsupported
    from simexec.program.groups import deepep_two_hops
    from simexec.specs.cluster import get_cluster
    from simexec.specs.model import get_model
    from simexec.specs.plan import parse_plan, resolve

    m = get_model("moe-tiny")
    m16 = m.model_copy(update={"moe": m.moe.model_copy(update={"experts": 16})})
    across = resolve(m16, get_cluster("2xdgx-h100"), parse_plan("dp=16,ep=16,moe_dispatcher=deepep,gbs=16"), 32)
    assert deepep_two_hops(across) and unsupported(across) is None
    inside = resolve(m16, get_cluster("2xdgx-h100"), parse_plan("dp=16,ep=8,moe_dispatcher=deepep,gbs=16"), 32)
    assert not deepep_two_hops(inside) and unsupported(inside) is None
    m6 = m.model_copy(update={"moe": m.moe.model_copy(update={"experts": 6})})
    uneven = resolve(m6, nodes_of(2, 6), parse_plan("dp=6,ep=3,moe_dispatcher=deepep,gbs=6"), 32)
    assert "hold different numbers of an ep group's ranks" in unsupported(uneven)
    folded = resolve(m, nodes_of(2, 8), parse_plan("dp=4,tp=2,sp=1,ep=2,etp=2,moe_dispatcher=deepep,gbs=4"), 32)
    assert "moe_dispatcher=deepep across NVLink domains with etp=2" in unsupported(folded)


@pytest.mark.parametrize("plan", ["dp=2,tp=2,sp=1,ep=4,etp=1", "dp=2,tp=2,sp=1,ep=2,etp=2,moe_dispatcher=allgather"])
def test_folding_without_shared_experts_matches_reference(plan):
    """Parallel folding over tp on a MoE without shared experts: no tp collective surrounds the MoE
    layer, each tp rank routes its own slice of the sequence, and the router's partial weight
    gradients are summed over tp by the first norm's all-reduce (the lowering's `norm_grads`)."""
    check_plan(str(Path(__file__).resolve().parent / "data" / "moe-noshared-tiny.yaml"), plan)


def test_folding_without_shared_experts_sums_the_router_gradient_over_tp():
    """The lowering's norm_grads of a folded MoE layer without shared experts carries the router."""
    from simexec.program.lower import lower

    path = str(Path(__file__).resolve().parent / "data" / "moe-noshared-tiny.yaml")
    rp = resolved(path, "dp=2,tp=2,sp=1,ep=4,etp=1")
    m = rp.model
    sums = [i for i in lower(rp, symmetric=True).ranks[0] if i.block == "norm_grads" and 0 <= i.layer < m.layers]
    assert sums and all(i.bytes == (m.pre_norm_params() + m.hidden * m.moe.experts) * 4 for i in sums)


MTP = [
    ("mtp-tiny", "dp=1,gbs=2"),
    ("mtp-tiny", "dp=2"),
    ("mtp-tiny", "cp=2"),
    ("mtp-moe-tiny", "pp=2,gbs=4"),
    ("mtp-moe-tiny", "dp=2,ep=2"),
    ("mtp-moe-tiny", "dp=2,ep=2,zero=1"),
    # tp: eh_proj column-parallel, its output gathered over the hidden dimension (under sp split over the
    # sequence after), its input's gradient summed (under sp gathered, reduce-scattered, re-gathered)
    ("mtp-tiny", "tp=2"),
    ("mtp-tiny", "tp=2,sp=1"),
    ("mtp-moe-tiny", "dp=2,ep=2,tp=2,sp=1"),
    ("mtp-tiny", "tp=2,sp=1,tp_overlap=1"),  # eh_proj's weight gradient under its input gradient's reduce-scatter
    ("mtp-moe-tiny", "tp=2,pp=2,gbs=4,schedule=zb-h1"),  # the depth's weight pass: eh_proj, the norms, the lookup
    # ZeRO-3: the embedding's and the head's units gathered beside a depth's, their gradient shares
    # reduce-scattered after its backward; or kept gathered from the forward (reshard_after_forward=0)
    ("mtp-tiny", "dp=2,zero=3"),
    ("mtp-tiny", "dp=2,tp=2,sp=1,zero=3"),
    ("mtp-moe-tiny", "dp=2,ep=2,zero=3"),
    ("mtp-tiny", "dp=2,zero=3,reshard_after_forward=0,gbs=8"),
]


@pytest.mark.parametrize("model,plan", MTP, ids=[f"{m}:{p}" for m, p in MTP])
def test_multi_token_prediction_matches_reference(model, plan):
    """MTP depths (DeepSeek-V3 §2.2, Megatron-Core's MultiTokenPredictionLayer) beside the head: each
    projects the normed shifted embedding and hidden state, runs a block like the last layer, the shared
    head and a cross entropy k tokens ahead, scaled into the loss. Under cp each chunk's shifted tokens
    come from the whole sequence; under pp the last stage embeds them with its copy of the embedding,
    summed with the first stage's."""
    check_plan(str(Path(__file__).resolve().parent / "data" / f"{model}.yaml"), plan)


def test_multi_token_prediction_adds_its_scaled_losses_to_the_reference():
    from simexec.exec.nn.reference import reference
    from simexec.specs.cluster import get_cluster
    from simexec.specs.plan import resolve

    rp = resolved(str(Path(__file__).resolve().parent / "data" / "mtp-tiny.yaml"), "dp=1,gbs=2")
    with_mtp = reference(rp, 1)["losses"][0]
    without = reference(resolve(rp.model.model_copy(update={"mtp_layers": 0}), get_cluster("local"), rp.plan, 32),
                        1)["losses"][0]
    # two depths, each a cross entropy near ln(512) over random tokens, weighted 0.3 / 2 each
    assert with_mtp - without == pytest.approx(0.3 * math.log(512), rel=0.05)


@pytest.mark.parametrize("sp", [0, 1])
def test_multi_token_prediction_lowers_megatron_tp_collectives(sp):
    """Under tp an MTP depth communicates as Megatron-Core's MultiTokenPredictionLayer: the shifted
    embedding summed (sp: reduce-scattered), eh_proj's input gradient summed (sp: the input gathered,
    re-gathered for the weight gradient, its gradient reduce-scattered), its column-parallel output
    gathered over the hidden dimension (sp: the gradient gathered over the sequence), each at the size
    the simulator prices."""
    from simexec.program.blocks import Anatomy
    from simexec.program.lower import lower

    rp = resolved(str(Path(__file__).resolve().parent / "data" / "mtp-tiny.yaml"), f"tp=2,sp={sp}")
    an = Anatomy(rp)
    full = an.full_hidden_bytes
    got = {(i.phase, i.block): (i.collective, i.bytes) for i in lower(rp).ranks[0]
           if i.kind == "collective" and i.layer == rp.model.mtp_block(0) and i.mb == 0}
    want = ({("fwd", "mtp_embed_out"): ("reducescatter", full), ("bwd", "mtp_embed_out"): ("allgather", full),
             ("fwd", "mtp_eh_in"): ("allgather", 2 * full), ("bwd", "mtp_eh_regather"): ("allgather", 2 * full),
             ("bwd", "mtp_eh_in"): ("reducescatter", 2 * full), ("fwd", "mtp_eh_out"): ("allgather", full),
             ("bwd", "mtp_eh_out"): ("allgather", full)} if sp else
            {("fwd", "mtp_embed_out"): ("allreduce", full), ("bwd", "mtp_eh_in"): ("allreduce", 2 * full),
             ("fwd", "mtp_eh_out"): ("allgather", full)})
    assert {k: v for k, v in got.items() if k[1].startswith("mtp_") and k[1] != "mtp_norm_grads"} == want
    # under sp enorm's and hnorm's gradients, each over its rank's slice, summed over tp
    assert (("bwd", "mtp_norm_grads") in got) == bool(sp)


def test_multi_token_prediction_refused_where_the_lowering_lacks_what_it_reads():
    from simexec.exec.rank.unsupported_plans import unsupported

    why = unsupported(resolved(str(Path(__file__).resolve().parent / "data" / "mtp-tiny.yaml"), "pp=2,gbs=4"))
    assert why and "learned positions with pp=2" in why
    why = unsupported(resolved(str(Path(__file__).resolve().parent / "data" / "mtp-moe-tiny.yaml"),
                               "dp=2,zero=3,zero_impl=yafsdp"))
    assert why and "multi-token prediction with zero_impl=yafsdp" in why


def test_multi_token_prediction_gathers_the_shared_units_under_zero3():
    """Under ZeRO-3 an MTP depth gathers the embedding's and the head's units beside its own (FSDP's
    unshard of a module called again; one still gathered is used as it is) and reduce-scatters its
    shares of their gradients after its backward."""
    from simexec.program.lower import lower

    rp = resolved(str(Path(__file__).resolve().parent / "data" / "mtp-tiny.yaml"), "dp=2,zero=3")
    L, first, u = rp.model.layers, rp.model.mtp_block(0), rp.model.mtp_block(1)
    names = {i.name: i for i in lower(rp).ranks[0] if i.kind == "collective"}
    # forward: the head's unit is still gathered for the first depth, the embedding's gathered again;
    # the backward starts with the last depth, which gathers both
    assert names[f"fwd.gather.L{first}.m0.mtp-1"].layer == -1
    assert names[f"bwd.gather.L{u}.m0.mtp-1"].layer == -1
    assert names[f"bwd.gather.L{u}.m0.mtp{L}"].layer == L
    for unit in (-1, L):
        rs = names[f"bwd.grads.L{unit}.m0.mtp{u}"]
        assert rs.collective == "reducescatter" and rs.layer == unit


@pytest.mark.parametrize("model,plan,reason", [
    (str(Path(__file__).resolve().parent / "data" / "moe-cap-tiny.yaml"), "dp=2,tp=2,sp=1,ep=4,etp=1",
     "token dropping (capacity_factor=1.0) with etp=1 and tp=2"),
])
def test_folding_refused_where_not_run(model, plan, reason):
    from simexec.exec.rank.unsupported_plans import unsupported

    assert reason in (unsupported(resolved(model, plan)) or "")
