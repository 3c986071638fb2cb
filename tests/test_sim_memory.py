"""Peak memory: ZeRO model states against the ZeRO paper, Megatron-LM's bytes per parameter, and OOM plans
reported, not refused."""
import pytest

from simexec.specs.cluster import GiB, get_cluster
from simexec.program.lower import lower
from simexec.specs.model import get_model
from simexec.specs.plan import PlanError, parse_plan, resolve
from simexec.sim.simulate import simulate

MODEL = get_model("gpt3-125m")
N = 4


@pytest.mark.parametrize("zero,states", [
    (0, lambda P: 16 * P),
    (1, lambda P: 4 * P + 12 * P / N),
    (2, lambda P: 2 * P + 14 * P / N),
    (3, lambda P: 16 * P / N),
])
def test_zero_model_states_match_the_paper(zero, states):
    """Mixed-precision Adam: 2+2+12 bytes per parameter, sharded by stage (Rajbhandari et al. 2020,
    Fig. 1). Stage 3 as DeepSpeed runs it: FSDP makes its gradient shards during the backward."""
    impl = ",zero_impl=deepspeed" if zero == 3 else ""
    r = simulate(MODEL, "local", f"dp={N},zero={zero}{impl},gbs={N}", seq_len=256)
    b = r.memory_breakdown_bytes
    assert b["params"] + b["grads"] + b["optimizer"] == pytest.approx(states(MODEL.params), rel=1e-9)


def _states_at_step(plan: str) -> float:
    """Model-state bytes (with the fp32 main gradients) live on rank 0 as its optimizer step runs."""
    rp = resolve(MODEL, get_cluster("local"), parse_plan(plan), 256)
    live = 0.0
    for ins in lower(rp).ranks[0]:
        if ins.kind == "compute" and ins.block == "optim":
            return live
        if ins.kind == "memory" and ins.category in ("params", "grads", "optimizer"):
            live += ins.bytes if ins.op == "alloc" else -ins.bytes
    raise AssertionError("no optimizer step")


@pytest.mark.parametrize("plan,states", [
    # Megatron-LM docs/user-guide/features/dist_optimizer.md, "Distributed Optimizer": bytes per parameter
    ("dtype=fp16,master_grads=1", lambda P: 20 * P),  # fp16 parameters, fp16 gradients
    ("dtype=bf16,grad_fp32=1,master_grads=1", lambda P: 18 * P),  # bf16 parameters, fp32 gradients
    ("dtype=fp32,master_grads=1", lambda P: 16 * P),  # fp32 parameters, fp32 gradients
    ("dtype=fp16,master_grads=1,zero=1", lambda P: 4 * P + 16 * P / N),  # distributed optimizer
    ("dtype=bf16,grad_fp32=1,master_grads=1,zero=1", lambda P: 6 * P + 12 * P / N),
    ("dtype=fp32,zero=1", lambda P: 8 * P + 8 * P / N),
    # torch DDP without gradient_as_bucket_view (Megatron-LM 2021's pp = 1 runs): its buckets beside .grad
    ("dtype=fp16,master_grads=1,grad_bucket_view=0", lambda P: 22 * P),
])
def test_megatron_bytes_per_parameter_at_the_optimizer_step(plan, states):
    assert _states_at_step(f"dp={N},gbs={N},{plan}") == pytest.approx(states(MODEL.params), rel=1e-9)
    r = simulate(MODEL, "local", f"dp={N},gbs={N},{plan}", seq_len=256)
    assert r.peak_memory_bytes >= states(MODEL.params)


def test_oom_plan_is_reported_with_peak_and_capacity():
    """Llama-3-70B with tp=8 alone needs ~140 GB of model states per GPU: it does not fit in 80 GB."""
    r = simulate("llama3-70b", "dgx-a100-80g", "tp=8,gbs=1", seq_len=2048)
    assert not r.fits
    assert r.memory_capacity_bytes == get_cluster("dgx-a100-80g").device.memory_bytes
    assert r.peak_memory_bytes > 140e9
    assert r.step_time_s > 0
    assert "DOES NOT FIT" in r.format()


def test_peak_includes_allocator_reserve_and_workspace():
    """On a GPU the peak is the caching allocator's reserved peak (simexec.sim.allocator) plus the runtime's
    workspace; the breakdown's `allocator` is what it reserves beyond the live tensors at that moment."""
    r = simulate("gpt3-125m", "dgx-a100-80g", "dp=8,gbs=8")
    b = r.memory_breakdown_bytes
    assert r.memory_model == "caching-allocator"
    assert b["workspace"] == pytest.approx(2 * GiB)
    assert b["allocator"] >= 0
    assert r.peak_memory_bytes >= r.peak_tensor_bytes + 2 * GiB
    assert sum(b.values()) == pytest.approx(r.peak_memory_bytes, rel=1e-9)
    assert r.fits


def test_a_measurement_is_held_against_the_tensors_alone():
    """A run measures its tensors (`max_memory_allocated`; the live-tensor tracker on CPU ranks):
    `compare` holds it against the prediction's peak without the runtime's workspace and the
    allocator's waste. On CPU ranks, which have neither, the two peaks are one."""
    from simexec.trace.compare import compare
    from simexec.trace.schema import Trace

    r = simulate("gpt3-125m", "dgx-a100-80g", "dp=8,gbs=8", trace=True)
    b, summary = r.memory_breakdown_bytes, r.trace.meta["summary"]
    tensors = summary["peak_tensor_bytes_per_rank"]["0"]
    assert tensors == pytest.approx(r.peak_memory_bytes - 2 * GiB - b["allocator"], rel=1e-9)
    assert r.peak_tensor_bytes == tensors and "of which tensors" in r.format()
    measured = Trace(meta={**r.trace.meta, "kind": "measured",
                           "summary": {"peak_memory_bytes_per_rank": {"0": tensors * 1.02}}},
                     events=r.trace.events)
    mem = compare(r.trace, measured).memory
    assert mem["error"] == pytest.approx(1 / 1.02 - 1) and mem["predicted_source"] == "summary (tensors)"
    on_cpu = simulate("gpt-tiny", "local", "dp=2,gbs=4", trace=True)
    cpu = on_cpu.trace.meta["summary"]
    assert cpu["peak_tensor_bytes_per_rank"] == cpu["peak_memory_bytes_per_rank"]
    assert on_cpu.peak_tensor_bytes == on_cpu.peak_memory_bytes and "of which" not in on_cpu.format()


def test_torch_ddp_buckets_are_filled_before_and_emptied_after_their_all_reduce():
    """grad_bucket_view=0: each bucket's gradients are copied in (read and written) before its
    all-reduce, and all of them copied back once every bucket is reduced, before the step."""
    rp = resolve(MODEL, get_cluster("local"), parse_plan(f"dp={N},gbs={N},dtype=fp16,grad_bucket_view=0"), 256)
    prog = lower(rp).ranks[0]
    names = [i.name for i in prog]
    reduces = [i for i in prog if i.kind == "collective" and i.block.startswith("grads")]
    assert len(reduces) > 1
    for r in reduces:
        [copy_in] = [i for i in prog if i.name in r.deps]
        assert copy_in.block == "bucket_in" + r.block.removeprefix("grads") and copy_in.bytes == 2 * r.bytes
    [out] = [i for i in prog if i.block == "bucket_out"]
    assert out.bytes == pytest.approx(2 * sum(r.bytes for r in reduces))
    assert set(r.name for r in reduces) <= set(out.deps)
    assert names.index(out.name) < names.index(next(i.name for i in prog if i.block == "optim"))
    plain = resolve(MODEL, get_cluster("local"), parse_plan(f"dp={N},gbs={N},dtype=fp16"), 256)
    assert not [i for i in lower(plain).ranks[0] if i.block.startswith("bucket_")]


def test_torch_ddp_buckets_need_zero_0():
    with pytest.raises(PlanError, match="grad_bucket_view=0 .* needs zero=0, got zero=1"):
        resolve(MODEL, get_cluster("local"), parse_plan(f"dp={N},gbs={N},zero=1,grad_bucket_view=0"), 256)


def test_fsdp2_in_torchtitan_shards_fp32_master_weights_and_reserves_its_gradients_apart(monkeypatch):
    """torchtitan builds its model in fp32 and FSDP2 casts each shard per all-gather: no bf16 shard, 12 B per
    parameter before the gradients. FSDP2 allocates each reduce-scatter's output, the unit's gradient shard,
    on the reduce-scatter stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce):
    the caching allocator keeps those pages in that stream's pool, beside the compute stream's high-water mark."""
    import dataclasses

    from simexec.specs import zero3_flavours
    from simexec.specs.stack import STACKS

    stack = STACKS["torchtitan-compile"]
    P = get_model("llama3-8b").params

    def run(**over):
        return simulate("llama3-8b", "dgx-h100", "dp=8,zero=3,gbs=8", 8192, stack=stack.model_copy(update=over))

    own = run()
    b = own.memory_breakdown_bytes
    assert b["params"] == 0 and b["optimizer"] == pytest.approx(12 * P / 8, rel=1e-3)
    assert run(zero3_shards_are_master=False).memory_breakdown_bytes["params"] == pytest.approx(2 * P / 8, rel=1e-3)
    rp = resolve(get_model("llama3-8b"), get_cluster("dgx-h100"), parse_plan("dp=8,zero=3,gbs=8"), 8192, stack)
    shards = [i for i in lower(rp).ranks[0] if i.kind == "memory" and i.name.startswith("mem.alloc.grads.shard")]
    assert shards and {i.stream for i in shards} == {"comm.dp"}
    fsdp = zero3_flavours.ZERO3_FLAVOURS["fsdp"]
    monkeypatch.setitem(zero3_flavours.ZERO3_FLAVOURS, "fsdp", dataclasses.replace(fsdp, grad_shards_on_reduce_stream=False))
    one_pool = run()
    assert one_pool.peak_tensor_bytes == pytest.approx(own.peak_tensor_bytes)
    assert own.peak_memory_bytes > one_pool.peak_memory_bytes + 1 * GiB


def test_an_eager_loss_leaves_its_logits_place_to_the_first_gradient_only():
    """torchtitan's eager loss makes the bf16 logits and their fp32 copy, saves the fp32 log-softmax above them
    and frees both: nll's fp32 gradient fits their place, log-softmax's gradient beside it does not, so the
    allocator reserves 2 B per logit beyond the tensors (a compiled loss keeps the bf16 logits, no hole)."""
    from simexec.specs.stack import STACKS

    def run(kind):
        r = simulate("llama3-8b", "dgx-h100", "dp=8,zero=3,gbs=8", 8192,
                     stack=STACKS["torchtitan-compile"].model_copy(update={"cross_entropy": kind}))
        return r.peak_memory_bytes - r.peak_tensor_bytes

    assert run("eager") - run("compiled") == pytest.approx(2 * 8192 * 128256, rel=0.05)
