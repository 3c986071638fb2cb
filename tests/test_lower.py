"""Lowering: each plan dimension issues what the real technique issues, and programs are well formed."""
import os
from collections import Counter
from pathlib import Path

import pytest

from simexec.program.blocks import Anatomy
from simexec.specs.cluster import get_cluster
from simexec.program.layer_order import TP_CONJUGATES
from simexec.program.lower import lower
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve
from simexec.program.instructions import Instr, Program

GOLDEN = Path(__file__).parent / "data" / "golden"

PLANS = [
    ("gpt-tiny", "dp=2,tp=2,gbs=8"),
    ("gpt-tiny", "tp=2,sp=1,pp=2,gbs=4"),
    ("gpt-tiny", "pp=2,vpp=2,gbs=4"),
    ("gpt-tiny", "pp=4,gbs=8,schedule=gpipe"),
    ("gpt-tiny", "dp=4,zero=1,gbs=8"),
    ("gpt-tiny", "dp=4,zero=2,gbs=8"),
    ("gpt-tiny", "dp=4,zero=3,gbs=8"),
    ("gpt-tiny", "dp=4,zero=3,zero_impl=yafsdp,gbs=8"),
    ("gpt-tiny", "dp=4,zero=3,dp_shard=2,gbs=8"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8,recompute=full,recompute_layers=1"),
    ("gpt-tiny", "cp=2,tp=2,gbs=2"),
    ("gpt-tiny", "dp=2,zero=1,offload=optimizer,gbs=4"),
    ("gpt-tiny", "pp=2,stages=1,3,gbs=4"),
    ("moe-tiny", "dp=2,ep=2,tp=2,gbs=4,recompute=selective"),
    ("gpt-tiny", "dp=2,pp=2,vpp=2,gbs=8,grad_overlap=0,bucket_mb=0.001,master_grads=1"),
    ("gpt-tiny", "dp=4,zero=2,gbs=8,grad_overlap=0,bucket_mb=0.001"),
    ("gpt-tiny", "dp=4,zero=3,dp_shard=2,gbs=8,grad_overlap=0,grad_fp32=1"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8,zero=1,clip_grad=1"),
    ("gpt-tiny", "dp=2,pp=2,gbs=8,zero=1,grad_allreduce=1,grad_fp32=1,dtype=bf16"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,vpp=2,gbs=8,zero=2,param_overlap=1"),
    ("gpt-tiny", "dp=2,zero=3,offload=optimizer,gbs=4,clip_grad=1"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8,schedule=zb-h1,recompute=full"),
    ("moe-tiny", "dp=2,ep=2,tp=2,pp=2,gbs=8,zero=2,schedule=zb-h1"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8,tp_overlap=1,recompute=full"),
    ("moe-tiny", "dp=2,ep=2,tp=2,sp=1,gbs=4,zero=3,tp_overlap=1"),
]


def _program(model: str, plan: str, symmetric: bool = False) -> Program:
    rp = resolve(get_model(model), get_cluster("local"), parse_plan(plan))
    return lower(rp, symmetric=symmetric)


@pytest.mark.parametrize("model,plan", PLANS)
def test_programs_are_well_formed_in_both_modes(model, plan):
    for symmetric in (False, True):
        _program(model, plan, symmetric).validate()


@pytest.mark.parametrize("model,plan", PLANS)
def test_activation_memory_is_freed_by_the_end_of_the_step(model, plan):
    prog = _program(model, plan)
    for rank, instrs in prog.ranks.items():
        live = Counter()
        for i in instrs:
            if i.kind == "memory" and i.category in ("activations", "buffers") and "yafsdp" not in i.name:
                live[i.category] += i.bytes if i.op == "alloc" else -i.bytes
        assert all(abs(v) < 1e-6 for v in live.values()), (rank, live)


def test_lowering_is_deterministic_and_text_round_trips():
    a, b = _program("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8"), _program("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8")
    assert a.to_text() == b.to_text()
    back = Program.from_text(a.to_text())
    assert back.to_text() == a.to_text()
    assert all(Instr.from_text(i.to_text()) == i for i in a)


def test_golden_program_text():
    """A reviewed program for a small plan; regenerate with SIMEXEC_REGEN_GOLDEN=1 after a deliberate change."""
    text = _program("gpt-tiny", "tp=2,pp=2,gbs=2").to_text() + "\n"
    path = GOLDEN / "gpt-tiny_tp2_pp2_gbs2.txt"
    if os.environ.get("SIMEXEC_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def test_tensor_parallel_issues_two_allreduces_per_layer_each_way():
    prog = _program("gpt-tiny", "tp=2,gbs=1")
    ops = Counter((i.phase, i.op) for i in prog.ranks[0] if i.axis == "tp" and i.block not in ("ce_max", "ce_sum"))
    layers = get_model("gpt-tiny").layers
    assert ops[("fwd", "allreduce@tp")] == 2 * layers + 1  # attention, MLP per layer, + embedding
    assert ops[("bwd", "allreduce@tp")] == 2 * layers + 1  # conjugates: attention, MLP inputs, + head input


def test_sequence_parallel_swaps_allreduce_for_allgather_and_reducescatter():
    prog = _program("gpt-tiny", "tp=2,sp=1,gbs=1")
    conj = ("embed_out", "attn_in", "attn_out", "mlp_in", "mlp_out", "head_in")
    ops = Counter(i.op for i in prog.ranks[0] if i.axis == "tp" and i.block in conj)
    assert "allreduce@tp" not in ops
    assert ops["allgather@tp"] == ops["reducescatter@tp"]  # every one has its conjugate


def test_sequence_parallel_norms_run_on_the_slice_and_the_backward_regathers_their_output():
    """Megatron's layout: norm (on this rank's slice) -> all-gather -> column-parallel GEMM, which
    saves the slice and all-gathers it again for its weight gradient; the partial norm gradients of
    a unit's first norm are summed over tp by an all-reduce of their own."""
    model = get_model("gpt-tiny")
    instrs = _program("gpt-tiny", "tp=2,sp=1,gbs=1").ranks[0]
    names = [i.name for i in instrs if i.kind in ("compute", "collective")]
    for l in range(model.layers):
        fwd = [n for n in names if n.startswith("fwd.") and f".L{l}." in n]
        assert fwd.index(f"fwd.norm1.L{l}.m0") < fwd.index(f"fwd.attn_in.L{l}.m0") < fwd.index(f"fwd.qkv.L{l}.m0")
        assert fwd.index(f"fwd.attn_out.L{l}.m0") < fwd.index(f"fwd.norm2.L{l}.m0") < fwd.index(f"fwd.mlp_in.L{l}.m0")
    by = {i.name: i for i in instrs}
    again = [i for i in instrs if i.block.endswith("_regather")]
    assert len(again) == 2 * model.layers + 1 and all(i.op == "allgather@tp" and i.phase == "bwd" for i in again)
    for i in again:  # the GEMM that reads it waits for it, and is the last to hold its buffer
        reader = {"attn": "qkv", "mlp": "fc1", "head": "head"}[i.block.split("_")[0]]
        assert i.name in by[f"bwd.{reader}.L{i.layer}.m0"].deps
    sums = [i for i in instrs if i.block == "norm_grads"]
    assert sorted(i.layer for i in sums) == list(range(model.layers + 1))
    grad = resolve(model, get_cluster("local"), parse_plan("tp=2,sp=1,gbs=1")).grad_bytes
    assert all(i.op == "allreduce@tp" and i.bytes == model.hidden * 2 * grad for i in sums)  # LayerNorm: w and b
    plain = _program("gpt-tiny", "tp=2,gbs=1").ranks[0]
    assert not any(i.block.endswith("_regather") or i.block.startswith("norm") for i in plain)


def test_data_parallel_reduces_gradients_only_in_the_last_micro_batch():
    prog = _program("gpt-tiny", "dp=2,gbs=8")
    grads = [i for i in prog.ranks[0] if i.block.startswith("grads")]
    assert grads and all(i.op == "allreduce@dp" for i in grads)
    bwd_last = {i.name for i in prog.ranks[0] if i.phase == "bwd" and i.mb == 3 and i.kind == "compute"}
    assert all(set(i.deps) <= bwd_last for i in grads)
    units = sorted(u for i in grads for u in i.items)
    assert units == list(range(-1, get_model("gpt-tiny").layers + 1))  # every parameter unit once


def _last_compute_before(rank: list, name: str) -> str:
    i = next(k for k, x in enumerate(rank) if x.name == name)
    return next(x.name for x in reversed(rank[:i]) if x.kind == "compute")


@pytest.mark.parametrize("plan", ["dp=2,gbs=8,bucket_mb=0.001", "dp=2,pp=2,vpp=2,gbs=8,bucket_mb=0.001",
                                  "dp=2,zero=1,gbs=8,bucket_mb=0.001"])
def test_without_grad_overlap_every_bucket_waits_for_the_last_backward(plan):
    """Megatron-LM 2021's local DDP: `model.allreduce_gradients()` after the whole backward."""
    with_overlap = _program("gpt-tiny", plan).ranks
    for r, rank in with_overlap.items():
        on = [i for i in rank if i.block.startswith("grads")]
        assert len(on) > 2  # tiny buckets: several per rank
        assert any(set(i.deps) != {_last_compute_before(rank, on[-1].name)} for i in on)  # overlapped
    for r, rank in _program("gpt-tiny", plan + ",grad_overlap=0").ranks.items():
        on = [i for i in with_overlap[r] if i.block.startswith("grads")]
        off = [i for i in rank if i.block.startswith("grads")]
        last_bwd = max(k for k, x in enumerate(rank) if x.kind == "compute" and x.phase == "bwd")
        assert len(off) > 2 and all(rank.index(i) > last_bwd for i in off)
        assert all(set(i.deps) == {rank[last_bwd].name} for i in off)
        assert sorted(u for i in off for u in i.items) == sorted(u for i in on for u in i.items)


def test_without_grad_overlap_zero2_and_zero3_reduce_after_each_backward_pass():
    for plan in ("dp=4,zero=2,gbs=8,bucket_mb=0.001,grad_overlap=0", "dp=4,zero=3,gbs=8,grad_overlap=0"):
        rank = _program("gpt-tiny", plan).ranks[0]
        rs = [i for i in rank if i.op == "reducescatter@dp" and i.phase == "bwd"]
        for i in rs:  # after the last backward compute of a micro-batch (the embedding's), which it depends on
            last = _last_compute_before(rank, i.name)
            assert set(i.deps) == {last}
            if last.startswith("bwd.grads_in."):  # FSDP2's copy of the gradients into the reduce-scatter's input
                last, = next(x for x in rank if x.name == last).deps
            assert last.startswith("bwd.embed.L-1."), last
        on = _program("gpt-tiny", plan.replace(",grad_overlap=0", "")).ranks[0]
        assert len(rs) == len([i for i in on if i.op == "reducescatter@dp" and i.phase == "bwd"])


def test_grad_fp32_doubles_the_gradient_bytes_and_master_grads_copies_them_for_the_step():
    base = _program("gpt-tiny", "dp=2,gbs=4,dtype=fp16").ranks[0]
    fp32 = _program("gpt-tiny", "dp=2,gbs=4,dtype=fp16,grad_fp32=1").ranks[0]
    assert sum(i.bytes for i in fp32 if i.block.startswith("grads")) == pytest.approx(
        2 * sum(i.bytes for i in base if i.block.startswith("grads")))
    copy = _program("gpt-tiny", "dp=2,gbs=4,dtype=fp16,master_grads=1").ranks[0]
    names = [i.name for i in copy]
    alloc, opt, free = (names.index(n) for n in ("mem.alloc.grads.main", "optim.optim.L-1.m-1", "mem.free.grads.main"))
    assert alloc < opt < free
    params = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan("dp=2,gbs=4")).params_on_pp_rank(0)
    assert copy[alloc].bytes == pytest.approx(4 * params["total"])
    assert copy[opt].bytes > next(i.bytes for i in base if i.block == "optim")  # the copy's traffic
    assert "mem.alloc.grads.main" not in [i.name for i in _program("gpt-tiny", "dp=2,gbs=4,master_grads=1,grad_fp32=1").ranks[0]]


def test_loss_scale_unscales_every_gradient_and_agrees_on_overflow_before_the_norm():
    prog = _program("gpt-tiny", "dp=2,pp=2,gbs=4,dtype=fp16,loss_scale=8192,clip_grad=1")
    free = _program("gpt-tiny", "dp=2,pp=2,gbs=4,dtype=fp16")
    for rank, instrs in prog.ranks.items():
        names = [i.name for i in instrs]
        order = [names.index(n) for n in ("optim.unscale.L-1.m-1", "optim.unscale", "optim.grad_norm.L-1.m-1",
                                          "optim.grad_norm", "optim.optim.L-1.m-1")]
        assert order == sorted(order)
        unscale = instrs[order[0]]
        reduce = instrs[order[1]]
        assert unscale.name in reduce.deps and reduce.name in instrs[order[2]].deps
        assert reduce.op == "allreduce@world" and len(reduce.group) == len(prog.ranks)
        adam = next(i for i in free.ranks[rank] if i.block == "optim")
        assert unscale.bytes == pytest.approx(2 * 2 * adam.flops / 12)  # fp16 gradients read and written


@pytest.mark.parametrize("plan", ["dp=2,pp=2,gbs=4", "dp=2,zero=1,offload=optimizer,gbs=4"])
def test_clip_grad_reads_every_gradient_and_sums_the_norm_over_the_world_before_the_step(plan):
    free = _program("gpt-tiny", plan)
    clipped = _program("gpt-tiny", plan + ",clip_grad=1")
    world = tuple(range(len(clipped.ranks)))
    for rank, instrs in clipped.ranks.items():
        by_name = {i.name: i for i in instrs}
        norm = by_name["optim.grad_norm.L-1.m-1"]
        reduce = by_name["optim.grad_norm"]
        assert reduce.op == "allreduce@world" and reduce.group == world and reduce.bytes == 4
        assert norm.name in reduce.deps
        step = next(i for i in instrs if i.block in ("optim", "grads_d2h"))
        assert reduce.name in step.deps  # the step (or the gradients' copy to the host) waits for the norm
        before = {i.name for i in instrs[:instrs.index(norm)]}
        assert all(i.name in before for i in instrs if i.block.startswith("grads") and i.kind == "collective")
        shard = next(i for i in free.ranks[rank] if i.block in ("optim", "cpu_optim"))
        adam = next(i for i in instrs if i.block in ("optim", "cpu_optim"))
        grad_bytes = 2  # bf16
        params = shard.flops if shard.block == "cpu_optim" else shard.flops / 12
        assert norm.bytes == pytest.approx(params * grad_bytes)  # read once
        assert adam.bytes - shard.bytes == pytest.approx(2 * params * grad_bytes)  # scaled: read and written
    assert not any(i.block == "grad_norm" for instrs in free.ranks.values() for i in instrs)


def test_zero2_reduce_scatters_every_micro_batch_and_zero1_only_the_last():
    z1 = _program("gpt-tiny", "dp=2,zero=1,gbs=8").ranks[0]
    z2 = _program("gpt-tiny", "dp=2,zero=2,gbs=8").ranks[0]
    rs1 = [i for i in z1 if i.op == "reducescatter@dp"]
    rs2 = [i for i in z2 if i.op == "reducescatter@dp"]
    assert len(rs2) == 4 * len(rs1)
    assert [i.op for i in z1 if i.block.startswith("params")] == ["allgather@dp"] * len(rs1)


def test_zero2_bucket_buffer_is_made_as_the_first_weight_gradient_lands():
    """DeepSpeed's reduce bucket takes its first gradient inside the head's backward: after that
    instruction's workspace, before the head's saved activations and logits are let go; with small
    buckets, each later bucket with its first layer's first backward instruction."""
    names = [i.name for i in _program("gpt-tiny", "dp=2,zero=2,gbs=8").ranks[0]]
    for mb in range(4):
        at = names.index(f"mem.alloc.grads.dp.L4.b{mb}")
        assert names[at - 2:at + 2] == [f"bwd.head.L4.m{mb}", f"mem.free.bwd.head.L4.m{mb}",
                                        f"mem.alloc.grads.dp.L4.b{mb}", f"mem.free.act.L4.m{mb}"]
    small = [i.name for i in _program("gpt-tiny", "dp=2,zero=2,gbs=4,mbs=2,bucket_mb=0.05").ranks[0]]
    for i, name in enumerate(small):
        if name.startswith("mem.alloc.grads.dp.L") and not name.startswith("mem.alloc.grads.dp.L4"):
            layer = name.split(".L")[1].split(".")[0]
            made = next(n for n in reversed(small[:i]) if not n.startswith("mem."))
            assert made.split(".")[0] == "bwd" and f".L{layer}." in made, (name, made)


def test_zero1_grad_allreduce_all_reduces_the_same_buckets_and_gathers_the_same_parameters():
    """DeepSpeed's BF16_Optimizer: the buckets a reduce-scatter would shard are all-reduced whole,
    then the step and the parameter all-gathers are ZeRO-1's."""
    rs = _program("gpt-tiny", "dp=2,zero=1,gbs=8").ranks[0]
    ar = _program("gpt-tiny", "dp=2,zero=1,gbs=8,grad_allreduce=1").ranks[0]
    grads = [(i.name, i.bytes) for i in rs if i.op == "reducescatter@dp"]
    assert grads and [(i.name, i.bytes) for i in ar if i.op == "allreduce@dp"] == grads
    assert not [i for i in ar if i.op == "reducescatter@dp"]
    assert [(i.op, i.bytes) for i in ar if i.block.startswith("params")] == \
        [(i.op, i.bytes) for i in rs if i.block.startswith("params")]


@pytest.mark.parametrize("plan", ["dp=2,zero=1,gbs=8,bucket_mb=0.02", "dp=2,pp=2,vpp=2,zero=2,gbs=8,bucket_mb=0.02"])
def test_param_overlap_gathers_parameters_as_the_step_starts_and_each_unit_waits_for_its_bucket(plan):
    """Megatron-LM's --overlap-param-gather: the all-gathers of the last step's update open the
    step, in the order the forward needs them; a unit's first forward waits for its bucket only."""
    from simexec.sim.simulate import simulate

    for rank, prog in _program("gpt-tiny", plan + ",param_overlap=1").ranks.items():
        base = [(i.op, i.bytes, i.items) for i in _program("gpt-tiny", plan).ranks[rank]
                if i.block.startswith("params")]
        gathers = [i for i in prog if i.block.startswith("params")]
        assert sorted((i.op, i.bytes, i.items) for i in gathers) == sorted(base) and base
        first_work = next(j for j, i in enumerate(prog) if i.kind != "memory")
        assert prog[first_work:first_work + len(gathers)] == gathers and all(not g.deps for g in gathers)
        bucket_of = {u: g.name for g in gathers for u in g.items}
        seen = set()
        for i in prog:
            if i.kind == "compute" and i.phase == "fwd":
                waits = {d for d in i.deps if d.startswith("fwd.params")}
                assert waits == ({bucket_of[i.layer]} if i.layer not in seen else set()), i.name
                seen.add(i.layer)
        assert set(bucket_of) == seen
    cluster = get_cluster("4xdgx-h100")
    step = {o: simulate(get_model("llama3-8b"), cluster, f"dp=32,zero=1,gbs=64,param_overlap={o}") for o in (0, 1)}
    assert step[1].step_time_s < step[0].step_time_s
    assert step[1].breakdown_s["comm.dp"] < 0.5 * step[0].breakdown_s["comm.dp"]


def test_zero3_gathers_each_unit_before_forward_and_backward_with_two_in_flight():
    prog = _program("gpt-tiny", "dp=2,zero=3,gbs=4")
    rank0 = prog.ranks[0]
    gathers = [i for i in rank0 if i.block == "gather"]
    units = get_model("gpt-tiny").layers + 2
    # two micro-batches, forward and backward: on CPU ranks the executor reshards the root as any unit
    # (FSDP2's root kept gathered on GPUs: tests/test_fsdp2_reshard.py)
    assert len(gathers) == 2 * 2 * units
    pos = {i.name: n for n, i in enumerate(rank0)}
    # the third gather of a pass waits for the first unit's compute: at most two buffers in flight
    third = [g for g in gathers if g.phase == "fwd" and g.mb == 0][2]
    assert third.deps and all(rank0[pos[d]].kind == "compute" for d in third.deps)


def test_zero3_tied_head_gathers_the_embedding_and_reduce_scatters_its_share():
    """A tied LM head reads the embedding's unit: under ZeRO-3 it gathers it beside its own, forward
    and backward, and reduce-scatters the head's share of the embedding's gradient after its backward,
    before the embedding's own; the gathered embedding is held while the head computes."""
    tied = str(Path(__file__).parent / "data" / "gpt-tiny-tied.yaml")
    rp = resolve(get_model(tied), get_cluster("local"), parse_plan("dp=2,zero=3,gbs=4"))
    rank0 = lower(rp, symmetric=False).ranks[0]
    pos = {i.name: n for n, i in enumerate(rank0)}
    embed = Anatomy(rp).embed_params() * rp.dtype_bytes
    for phase in ("fwd", "bwd"):
        for mb in (0, 1):
            g = rank0[pos[f"{phase}.gather.L4.m{mb}.tied"]]
            assert (g.layer, g.bytes) == (-1, embed)
            first = next(i for i in rank0[pos[g.name]:] if i.kind == "compute" and i.layer == 4 and i.phase == phase)
            assert g.name in first.deps
    for mb in (0, 1):
        share, own = pos[f"bwd.grads.L-1.m{mb}.tied"], pos[f"bwd.grads.L-1.m{mb}"]
        assert pos[f"bwd.head.L4.m{mb}"] < share < pos[f"bwd.embed.L-1.m{mb}"] < own
        assert rank0[share].bytes == rank0[own].bytes
    untied = _program("gpt-tiny", "dp=2,zero=3,gbs=4").ranks[0]
    assert not any(i.name.endswith(".tied") for i in untied)


@pytest.mark.parametrize("plan", ["dp=2,pp=2,zero=1,gbs=8", "dp=2,pp=2,zero=1,gbs=8,grad_overlap=0",
                                  "dp=2,pp=2,vpp=2,zero=1,gbs=8,bucket_mb=0.05", "dp=2,pp=2,gbs=8"])
def test_tied_sum_comes_before_zero1_reduce_scatters_and_after_the_all_reduce(plan):
    """Tied embeddings over a pipeline: under ZeRO-1 the two stages' gradients are summed before the
    reduce-scatter of the bucket that holds this stage's copy, which waits for the sum and comes after
    the stage's last send (the other stage needs it before it can join the sum); under ZeRO-0 after
    every bucket's all-reduce."""
    tied = str(Path(__file__).parent / "data" / "gpt-tiny-tied.yaml")
    rp = resolve(get_model(tied), get_cluster("local"), parse_plan(plan))
    prog = lower(rp, symmetric=False)
    prog.validate()
    for rank in (0, rp.mesh.rank(tp=0, cp=0, dp=0, pp=1)):
        instrs = prog.ranks[rank]
        pos = {i.name: k for k, i in enumerate(instrs)}
        tied_unit = -1 if rp.mesh.coords(rank)["pp"] == 0 else rp.model.layers
        buckets = [i for i in instrs if i.kind == "collective" and i.block.startswith("grads") and i.block[5:].isdigit()]
        holder = next(b for b in buckets if tied_unit in b.items)
        sends = [k for k, i in enumerate(instrs) if i.kind == "send"]
        if rp.plan.zero == 1:
            assert holder.deps == ("bwd.tied",) and pos["bwd.tied"] < pos[holder.name]
            assert not sends or sends[-1] < pos[holder.name]
        else:
            assert all(pos[b.name] < pos["bwd.tied"] for b in buckets)


def test_latent_attention_projections_are_whole_on_every_tp_rank():
    """MLA's down projections and latent norms are replicated over tp: each rank computes them whole
    and holds them whole, and their partial gradients are summed over tp with the input gradient's
    all-reduce, or under sp with the first norm's (`norm_grads`)."""
    m = get_model(str(Path(__file__).parent / "data" / "mla-tiny.yaml"))
    latent = m.latent_params() * 4  # fp32 gradients
    for plan, block in (("tp=2,gbs=2,dtype=fp32", "attn_in"), ("tp=2,sp=1,gbs=2,dtype=fp32", "norm_grads")):
        rp = resolve(m, get_cluster("local"), parse_plan(plan))
        an = Anatomy(rp)
        ins = next(i for i in lower(rp, symmetric=False).ranks[0] if i.phase == "bwd" and i.block == block and i.layer == 0)
        base = an.full_hidden_bytes if block == "attn_in" else m.pre_norm_params() * 4
        assert ins.bytes == base + latent, (plan, ins.bytes, base, latent)
    one, two = (Anatomy(resolve(m, get_cluster("local"), parse_plan(f"tp={t},gbs=2"))) for t in (1, 2))
    assert 2 * two.layer(0)["qkv"].flops - one.layer(0)["qkv"].flops == 2 * one.tokens * m.latent_matmul_params()
    rp1, rp2 = (resolve(m, get_cluster("local"), parse_plan(f"tp={t},gbs=2")) for t in (1, 2))
    held = (rp1.params_on_pp_rank(0)["total"], rp2.params_on_pp_rank(0)["total"])
    assert 2 * held[1] - held[0] == m.layers * (m.latent_params() + m.norm_params_per_layer()) + m.final_norm_params()


def test_yafsdp_preallocates_two_buffers_and_fsdp_allocates_per_unit():
    fsdp = _program("gpt-tiny", "dp=2,zero=3,gbs=2").ranks[0]
    yafsdp = _program("gpt-tiny", "dp=2,zero=3,zero_impl=yafsdp,gbs=2").ranks[0]
    assert sum(1 for i in fsdp if i.kind == "memory" and i.category == "buffers") > 20
    ya = [i for i in yafsdp if i.kind == "memory" and i.category == "buffers"]
    assert [i.name for i in ya] == ["mem.alloc.yafsdp.params", "mem.alloc.yafsdp.grads"]


@pytest.mark.parametrize("plan", ["dp=2,zero=3,gbs=4", "dp=4,zero=3,zero_impl=yafsdp,gbs=8", "dp=4,pp=2,zero=3,gbs=8",
                                  "dp=4,zero=3,dp_shard=2,offload=optimizer,gbs=8"])
def test_fsdp_gradient_shards_come_with_their_first_reduce_scatter_and_go_after_the_step(plan):
    """fsdp and yafsdp: no gradients as the step starts; a unit's shard with its first reduce-scatter
    (later ones' outputs until they land), all of them once the optimizer reads them, none after."""
    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(plan))
    for rank, instrs in lower(rp).ranks.items():
        names = [i.name for i in instrs]
        grads = [i for i in instrs if i.kind == "memory" and i.category == "grads" and i.name != "mem.alloc.grads.main"
                 and i.name != "mem.free.grads.main"]
        assert "mem.alloc.grads.static" not in names
        made = [i for i in grads if i.name.startswith("mem.alloc.grads.shard.L")]
        first = {i.name.removeprefix("mem.alloc.grads.shard.L"): names.index(i.name) for i in made}
        for u, at in first.items():
            rs = [k for k, n in enumerate(names) if n.startswith(f"bwd.grads.L{u}.m") and "." not in n.split(".m")[1]]
            assert rs and at < min(rs), (rank, u)  # allocated just before the unit's first reduce-scatter
        full = rp.model_state_bytes(rp.mesh.coords(rank)["pp"])["grads"]
        assert sum(i.bytes for i in made) == pytest.approx(full)
        free = names.index("mem.free.grads.shards")
        read = names.index("copy.grads_d2h") if rp.plan.offload != "none" else names.index("optim.optim.L-1.m-1")
        assert read < free and instrs[free].bytes == pytest.approx(full)
        live = 0.0
        for i in grads:
            live += i.bytes if i.op == "alloc" else -i.bytes
            assert live >= -1e-6
        assert live == pytest.approx(0.0, abs=1e-6)


def test_deepspeed_holds_its_gradient_partition_from_the_start():
    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan("dp=2,zero=3,zero_impl=deepspeed,gbs=4"))
    instrs = lower(rp).ranks[0]
    static = next(i for i in instrs if i.name == "mem.alloc.grads.static")
    assert static.bytes == pytest.approx(rp.model_state_bytes(0)["grads"])
    assert not any(i.name.startswith("mem.alloc.grads.shard") or i.name == "mem.free.grads.shards" for i in instrs)
    outs = [i for i in instrs if i.kind == "memory" and i.name.endswith(".out")]  # each reduce-scatter's output
    assert outs and sum(i.bytes if i.op == "alloc" else -i.bytes for i in outs) == pytest.approx(0.0)


def test_yafsdp_backward_waits_for_the_last_reduce_scatter_out_of_its_gradient_buffer():
    """Two gradient buffers by layer parity: before a layer's backward accumulates into one, the
    reduce-scatter of the layer two above (that buffer's last user) must have read it out."""
    prog = _program("gpt-tiny", "dp=2,zero=3,zero_impl=yafsdp,gbs=2").ranks[0]
    by = {i.name: i for i in prog}
    assert "bwd.grads.L3.m0" in by["bwd.fc2.L1.m0"].deps
    assert "bwd.grads.L2.m0" in by["bwd.fc2.L0.m0"].deps
    fsdp = {i.name: i for i in _program("gpt-tiny", "dp=2,zero=3,gbs=2").ranks[0]}
    assert not any(d.startswith("bwd.grads") for d in fsdp["bwd.fc2.L1.m0"].deps)


def test_sequence_parallel_collectives_have_a_norm_between_them():
    """Under sp a reduce-scatter and the all-gather after it have the norm between them: every
    tensor-parallel activation collective follows a compute block, as without sp."""
    for plan in ("tp=2,sp=1,gbs=1", "tp=2,gbs=1"):
        prog = {i.name: i for i in _program("gpt-tiny", plan).ranks[0]}
        acts = [i for i in prog.values() if i.axis == "tp" and i.block in TP_CONJUGATES]
        assert acts and all(prog[d].kind == "compute" for i in acts for d in i.deps)
    sp = {i.name: i for i in _program("gpt-tiny", "tp=2,sp=1,gbs=1").ranks[0]}
    assert sp["fwd.mlp_in.L0.m0"].deps == ("fwd.norm2.L0.m0",)
    assert sp["bwd.attn_out.L1.m0"].deps == ("bwd.norm2.L1.m0",)


def test_full_recompute_reruns_the_forward_of_recompute_layers_only():
    prog = _program("gpt-tiny", "pp=2,gbs=2,recompute=full,recompute_layers=1")
    for rank, instrs in prog.ranks.items():
        layers = {i.layer for i in instrs if i.phase == "recompute"}
        assert len(layers) == 1


def test_selective_recompute_reruns_attention_core_only():
    prog = _program("gpt-tiny", "gbs=1,recompute=selective")
    assert {i.block for i in prog.ranks[0] if i.phase == "recompute"} == {"attn"}


def test_pipeline_sends_match_receives_and_uneven_stages_hold_their_layers():
    prog = _program("gpt-tiny", "pp=2,stages=1,3,gbs=2")
    layers = [{i.layer for i in prog.ranks[r] if i.kind == "compute" and 0 <= i.layer < 4} for r in (0, 1)]
    assert layers == [{0}, {1, 2, 3}]
    sends = {i.name for i in prog.ranks[0] if i.kind == "send"}
    recvs = {i.name for i in prog.ranks[1] if i.kind == "recv"}
    assert sends == recvs


@pytest.mark.parametrize("plan,slices", [("tp=2,pp=2,gbs=4", 2), ("tp=2,sp=1,pp=2,gbs=4", 1), ("pp=2,gbs=4", 1)])
def test_pipeline_messages_are_sliced_over_tp_and_gathered_on_arrival(plan, slices):
    """Megatron's scatter/gather: without sp each tp rank sends 1/tp of the activation and the
    receiver all-gathers the pieces over tp before computing; with sp the activation is already split."""
    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(plan))
    assert rp.pipeline_slices == slices
    hidden = Anatomy(rp).hidden_bytes
    prog = lower(rp, symmetric=False)
    for rank, instrs in prog.ranks.items():
        by_name = {i.name: i for i in instrs}
        for ins in instrs:
            if ins.kind in ("send", "recv"):
                assert ins.bytes == hidden / slices
            if ins.kind != "recv":
                continue
            gather = by_name.get(ins.name + ".gather")
            readers = [i for i in instrs if i.kind == "compute" and ins.name in i.deps]
            if slices == 1:
                assert gather is None and readers
                continue
            assert gather.collective == "allgather" and gather.axis == "tp" and gather.bytes == hidden
            assert gather.deps == (ins.name,) and len(gather.group) == 2 and rank in gather.group
            assert not readers and any(gather.name in i.deps for i in instrs if i.kind == "compute")


@pytest.mark.parametrize("plan", ["pp=4,gbs=8", "pp=2,vpp=2,gbs=8", "tp=2,pp=2,vpp=2,gbs=4", "pp=2,schedule=gpipe,gbs=4"])
def test_blocking_pipeline_sends_are_waited_before_the_next_exchange_group(plan):
    """p2p_overlap=0 (Megatron-LM's blocking exchanges): every send is a dependency of the compute
    that opens the next group of actions; the interleaved schedule's steady state exchanges after
    each forward-backward pair, so the pair's two receives come before the forward's first compute."""
    from simexec.sim.simulate import simulate

    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(plan + ",p2p_overlap=0"))
    prog = lower(rp, symmetric=False)
    for rank, instrs in prog.ranks.items():
        computes = [k for k, i in enumerate(instrs) if i.kind == "compute"]
        for k, ins in enumerate(instrs):
            if ins.kind == "send" and any(c > k for c in computes):
                waited = [c for c in computes if c > k and ins.name in instrs[c].deps]
                assert waited, (rank, ins.name)
    if rp.plan.vpp > 1:
        rank0 = [i for i in prog.ranks[0] if i.kind in ("recv", "compute") and i.block != "optim"]
        first_b = next(k for k, i in enumerate(rank0) if i.kind == "compute" and i.phase == "bwd")
        # the steady state's first pair: its backward's gradient arrives before its forward computes
        recv_b = next(k for k, i in enumerate(rank0) if i.kind == "recv" and i.block == "grad")
        fwd_of_pair = max(k for k, i in enumerate(rank0[:first_b]) if i.kind == "compute" and i.phase == "fwd")
        assert recv_b < fwd_of_pair
    blocking = simulate("gpt-tiny", "local", plan + ",p2p_overlap=0", symmetric=False)  # no deadlock
    assert blocking.step_time_s > 0


def test_moe_layers_dispatch_and_combine_over_the_expert_group():
    prog = _program("moe-tiny", "dp=2,ep=2,gbs=2")
    a2a = [i for i in prog.ranks[0] if i.op == "alltoall@ep"]
    assert len(a2a) == 4 * get_model("moe-tiny").layers  # dispatch + combine, forward and backward, per mb
    assert all(i.group == (0, 1) for i in a2a)


def test_context_parallel_gathers_kv_forward_and_scatters_their_grads_backward():
    prog = _program("gpt-tiny", "cp=2,gbs=1")
    kv = Counter((i.phase, i.op) for i in prog.ranks[0] if i.block == "kv")
    layers = get_model("gpt-tiny").layers
    assert kv == {("fwd", "allgather@cp"): layers, ("bwd", "reducescatter@cp"): layers}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_all_to_all_context_parallelism_exchanges_heads_around_the_attention(recompute):
    """cp_impl=a2a (DeepSpeed-Ulysses): per layer an all-to-all of q, k and v before the attention and
    one of its output after it, each run the other way in the backward; no K/V all-gather. Selective
    recompute reruns the attention on the exchanged q, k and v; full recompute reruns the exchanges."""
    plan = f"cp=2,cp_impl=a2a,gbs=1,recompute={recompute}"
    prog = _program("llama3.2-1b", plan)
    rank0 = prog.ranks[0]
    layer0 = [(i.phase, i.block) for i in rank0 if i.layer == 0 and i.block in ("qkv", "heads_in", "attn", "heads_out", "proj")]
    fwd = [("fwd", "qkv"), ("fwd", "heads_in"), ("fwd", "attn"), ("fwd", "heads_out"), ("fwd", "proj")]
    bwd = [("bwd", "proj"), ("bwd", "heads_out")] + ([("recompute", "attn")] if recompute == "selective" else []) + \
        [("bwd", "attn"), ("bwd", "heads_in"), ("bwd", "qkv")]
    rec = [("recompute", b) for _, b in fwd] if recompute == "full" else []
    assert layer0 == fwd + rec + bwd
    assert not any(i.block == "kv" for i in rank0)
    rp = resolve(get_model("llama3.2-1b"), get_cluster("local"), parse_plan(plan))
    tokens = rp.seq_len // 2
    qkv, out = tokens * (32 * 64 + 8 * 2 * 64) * 2, tokens * 32 * 64 * 2  # bf16, 32 query and 8 KV heads of 64
    for i in rank0:
        if i.block in ("heads_in", "heads_out"):
            assert i.op == "alltoall@cp" and i.group == (0, 1)
            assert i.bytes == (qkv if i.block == "heads_in" else out)


def test_offload_copies_gradients_out_steps_on_the_host_and_copies_parameters_back():
    prog = _program("gpt-tiny", "dp=2,zero=1,offload=optimizer,gbs=2")
    names = [i.block for i in prog.ranks[0] if i.stream in ("copy.d2h", "host", "copy.h2d")]
    assert names == ["grads_d2h", "cpu_optim", "params_h2d"]
    assert not any(i.block == "optim" for i in prog.ranks[0])


def test_symmetric_mode_keeps_one_rank_per_pipeline_stage():
    prog = _program("gpt-tiny", "dp=2,tp=2,pp=2,gbs=4", symmetric=True)
    assert sorted(prog.ranks) == [0, 4]
    assert sorted(r for reps in prog.represents.values() for r in reps) == list(range(8))


def test_ring_context_parallel_passes_kv_around_the_ring():
    prog = _program("gpt-tiny", "cp=4,gbs=1,cp_impl=ring")
    prog.validate()
    fwd_sends = [i for i in prog.ranks[0] if i.kind == "send" and i.phase == "fwd" and i.layer == 0]
    bwd_sends = [i for i in prog.ranks[0] if i.kind == "send" and i.phase == "bwd" and i.layer == 0]
    assert len(fwd_sends) == 3 and len(bwd_sends) == 4  # cp-1 hops forward; backward brings dK/dV home
    assert {i.peer for i in fwd_sends} == {1}
    partials = [i for i in prog.ranks[0] if i.block == "attn" and i.phase == "fwd" and i.layer == 0]
    assert len(partials) == 4


def test_parameter_offload_copies_each_shard_in_before_its_gather():
    """On a GPU, FSDP2 copies the shard into the gather's input after it came over PCIe; simexec's
    executor on CPU ranks gathers from the shard itself."""
    for cluster, plan, copies in (("local", "dp=2,zero=3,offload=optimizer+params,gbs=2", False),
                                  ("dgx-h100", "dp=8,zero=3,offload=optimizer+params,gbs=8", True)):
        rank0 = lower(resolve(get_model("gpt-tiny"), get_cluster(cluster), parse_plan(plan)), symmetric=False).ranks[0]
        by_name = {i.name: i for i in rank0}
        for g in (i for i in rank0 if i.block == "gather"):
            if not copies:
                assert g.deps == (f"copy.{g.name}",)
                continue
            copy_in, = g.deps
            assert by_name[copy_in].block == "gather_in" and by_name[copy_in].deps == (f"copy.{g.name}",)


def test_context_parallel_ranks_reduce_gradients_together_with_data_parallel_ones():
    prog = _program("gpt-tiny", "dp=2,cp=2,gbs=2")
    grads = [i for i in prog.ranks[0] if i.block.startswith("grads")]
    assert grads and all(set(i.group) == {0, 1, 2, 3} for i in grads)  # cp is the fastest axis after tp


def test_hsdp_shards_within_blocks_and_replicates_across():
    prog = _program("gpt-tiny", "dp=4,zero=3,dp_shard=2,gbs=4")
    rank0 = prog.ranks[0]
    assert {i.group for i in rank0 if i.block == "gather"} == {(0, 1)}
    assert {i.group for i in rank0 if i.block == "grads_rep"} == {(0, 2)}


@pytest.mark.parametrize("model,plan", [("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8"), ("moe-tiny", "dp=2,ep=2,pp=4,gbs=8,zero=1")])
def test_zero_bubble_splits_the_backward_without_changing_the_work(model, plan):
    """zb-h1 moves each weight-bearing block's weight-gradient GEMM out of its backward into a `wgrad`
    instruction: per rank the FLOPs and bytes add up to 1F1B's, the gradients are reduced after the
    weight passes, and the partial gradients of tp-replicated parameters get an all-reduce of their own."""
    one = _program(model, plan)
    zb = _program(model, plan + ",schedule=zb-h1")
    for rank in one.ranks:
        def work(prog, kind):
            return sum(getattr(i, kind) for i in prog.ranks[rank] if i.kind == "compute")
        for kind in ("flops", "bytes"):
            assert work(zb, kind) == pytest.approx(work(one, kind), rel=1e-9)
        names = [i.name for i in zb.ranks[rank]]
        wgrads = [i for i in zb.ranks[rank] if i.phase == "wgrad" and i.kind == "compute"]
        assert {i.block for i in wgrads} >= {"qkv", "proj"} and all(i.flops > 0 or i.block == "embed" for i in wgrads)
        for i in zb.ranks[rank]:
            if i.kind == "collective" and i.block.startswith("grads"):
                last_w = max(n for n, j in enumerate(zb.ranks[rank]) if j.phase == "wgrad" and j.layer in i.items)
                assert names.index(i.name) > last_w
    tp_sums = [i for i in zb.ranks[0] if i.block == "norm_grads"]
    assert bool(tp_sums) == ("tp=2" in plan) and all(i.phase == "wgrad" and i.collective == "allreduce" for i in tp_sums)


@pytest.mark.parametrize("model,plan", [("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8"), ("gpt-tiny", "tp=2,sp=1,gbs=2"),
                                        ("moe-tiny", "dp=2,ep=2,tp=2,gbs=4")])
def test_tp_overlap_runs_each_column_gemms_weight_gradient_under_its_input_gradient_collective(model, plan):
    """tp_overlap (Megatron-LM's asynchronous tp gradient communication): a column-parallel block's
    backward is its input gradients, the tp collective that sums them, then its weight gradients,
    which do not wait for that collective; the next compute does. The work is the same."""
    one = _program(model, plan)
    ov = _program(model, plan + ",tp_overlap=1")
    sp = "sp=1" in plan
    for rank, instrs in ov.ranks.items():
        for kind in ("flops", "bytes"):
            total = [sum(getattr(i, kind) for i in p.ranks[rank] if i.kind == "compute") for p in (one, ov)]
            assert total[1] == pytest.approx(total[0], rel=1e-9)
        names = [i.name for i in instrs]
        wgrads = [(n, i) for n, i in enumerate(instrs) if i.phase == "wgrad" and i.kind == "compute"]
        blocks = {i.block for _, i in wgrads}
        assert blocks <= {"qkv", "fc1", "router", "head"} and "qkv" in blocks
        assert ("head" in blocks) == any(i.block == "head" for i in instrs)
        for n, w in wgrads:
            under = {"qkv": "attn_in", "fc1": "mlp_in", "router": "mlp_in", "head": "head_in"}[w.block]
            coll = f"bwd.{under}.L{w.layer}.m{w.mb}"
            at = names.index(coll)
            assert instrs[at].collective == ("reducescatter" if sp else "allreduce")
            assert names.index(f"bwd.{w.block}.L{w.layer}.m{w.mb}") < at < n  # input pass, collective, weights
            assert coll not in w.deps
            nxt = next(i for i in instrs[n + 1:] if i.kind == "compute")
            assert coll in nxt.deps  # the next compute waits for the sum
    plain = Counter(i.block for i in one.ranks[0] if i.kind == "collective" and i.axis == "tp")
    over = Counter(i.block for i in ov.ranks[0] if i.kind == "collective" and i.axis == "tp")
    # the tp-replicated parameters' partial gradients the weight passes make: one sum per unit, or
    # under sp in the all-reduce of the unit's last norm, which comes after them
    extra = over["norm_grads"] - plain["norm_grads"]
    assert over - plain == Counter({"norm_grads": extra}) and (extra == 0) == sp


def test_zero_bubble_keeps_activations_until_the_weight_pass():
    prog = _program("gpt-tiny", "pp=2,gbs=8,schedule=zb-h1")
    for instrs in prog.ranks.values():
        for n, i in enumerate(instrs):
            if i.kind == "memory" and i.op == "free" and i.name.startswith("mem.free.act.L"):
                assert instrs[n - 1].phase == "wgrad" or instrs[n - 1].kind == "memory", i.name


@pytest.mark.parametrize("plan", ["dp=1,gbs=2", "tp=2,sp=1,gbs=2", "dp=1,gbs=2,recompute=full"])
def test_each_block_lets_its_saved_activations_go_after_its_own_backward(plan):
    """Autograd frees a node's saved tensors once the node has run: after a block's backward its
    saved bytes are freed, before the next block of the layer runs (not all at the layer's end)."""
    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(plan))
    an = Anatomy(rp)
    instrs = lower(rp).ranks[0]
    names = [i.name for i in instrs]
    for block, b in an.layer(0).items():
        at = names.index(f"bwd.{block}.L0.m0")
        free = next(i for i in instrs[at + 1:] if i.kind == "memory" and i.op == "free"
                    and i.name.startswith("mem.free.act.L0.m0"))
        assert free.name == f"mem.free.act.L0.m0.{block}" and free.bytes == b.saved, (block, free)


@pytest.mark.parametrize("pp", [2, 4])
def test_zb_v_turns_on_the_last_rank_without_a_message_and_computes_the_loss_on_the_first(pp):
    """Under ZB-V rank r holds stages r and 2pp-1-r: stage pp-1's output and the gradient back to it
    stay on the last rank (no message names stage pp-1's activations or stage pp's gradient), every
    other stage boundary is one message each way, and the first rank embeds and computes the loss."""
    model = get_model("gpt-tiny").model_copy(update={"layers": 2 * pp})
    rp = resolve(model, get_cluster("local"), parse_plan(f"pp={pp},vpp=2,gbs={2 * pp},schedule=zb-v"), 32)
    prog = lower(rp, symmetric=False)
    prog.validate()
    messages = Counter(i.name.rsplit(".m", 1)[0] for ins in prog.ranks.values() for i in ins if i.kind == "send")
    V = 2 * pp
    assert set(messages) == ({f"p2p.act.v{vs}" for vs in range(V - 1) if vs != pp - 1}
                             | {f"p2p.grad.v{vs}" for vs in range(1, V) if vs != pp})
    assert set(messages.values()) == {2 * pp}  # one per micro-batch
    heads = {r for r, ins in prog.ranks.items() for i in ins if i.kind == "compute" and i.block in ("embed", "loss")}
    assert heads == {0}


def test_dualpipe_overlap_merges_each_pair_without_a_dependency_between_its_passes():
    """An overlapped pair is its forward and its whole backward lowered apart and merged: the same
    instructions as one after the other, every dependency on an earlier instruction, none between the
    pair's two passes, and a forward's collective followed by the backward's compute before the
    forward computes again."""
    from simexec.program.schedules import dualpipe_pairs, pipeline_order

    rp = resolve(get_model("moe-tiny"), get_cluster("local"),
                 parse_plan("dp=2,ep=2,tp=2,pp=2,vpp=2,gbs=8,schedule=dualpipev,dualpipe_overlap=1"), 32)
    merged = lower(rp, symmetric=False)
    merged.validate()
    apart = lower(resolve(rp.model, rp.cluster, rp.plan.model_copy(update={"dualpipe_overlap": False}), 32),
                  symmetric=False)
    order = pipeline_order("dualpipev", 2, rp.micro_batches, 2)
    for r, ins in merged.ranks.items():
        assert Counter(i.name for i in ins) == Counter(i.name for i in apart.ranks[r])
        seen: set[str] = set()
        for i in ins:
            assert set(i.deps) <= seen, i.name
            seen.add(i.name)
        pp_rank = rp.mesh.coords(r)["pp"]
        acts = order[pp_rank]
        for k in dualpipe_pairs(2, pp_rank, rp.micro_batches):
            f, b = acts[k], acts[k + 1]
            f_names = {i.name for i in ins if i.phase == "fwd" and (i.chunk, i.mb) == (f.chunk, f.mb)}
            b_names = {i.name for i in ins if i.phase in ("bwd", "wgrad") and (i.chunk, i.mb) == (b.chunk, b.mb)}
            assert f_names and b_names
            for i in ins:
                if i.name in f_names:
                    assert not set(i.deps) & b_names, i.name
                if i.name in b_names:
                    assert not set(i.deps) & f_names, i.name
    kinds = [(i.phase, i.kind) for i in merged.ranks[0]]
    turns = sum(1 for a, b in zip(kinds, kinds[1:]) if a == ("fwd", "collective") and b == ("bwd", "compute"))
    assert turns > 0


def _zero3_calls(plan: str, model: str = "llama3-8b", cluster: str = "4xdgx-h100", layer: int = 3):
    rp = resolve(get_model(model), get_cluster(cluster), parse_plan(plan))
    rank0 = lower(rp).ranks[0]
    pick = [i for i in rank0 if i.layer == layer and i.mb == 0]
    gathers = [i.bytes for i in pick if i.block == "gather" and i.phase == "fwd"]
    reduces = [i.bytes for i in pick if i.block == "grads"]
    copies = {b: sum(i.bytes for i in pick if i.block == b and i.phase == ph)
              for b, ph in (("gather_in", "fwd"), ("gather_out", "fwd"), ("grads_in", "bwd"))}
    return gathers, reduces, copies


def test_zero3_flavours_issue_their_stacks_collectives_per_layer():
    """FSDP2 and FSDP1: one grouped gather and reduce-scatter per layer, FSDP2 with its copy-in/out
    kernels; DeepSpeed: calls of a prefetch bucket's worth (5e7 elements) without the norms."""
    m = get_model("llama3-8b")
    layer = m.layer_params(3) * 2  # bf16, dp=32 over the whole model: no tp
    fsdp, fsdp1, ds = (_zero3_calls(f"dp=32,zero=3,zero_impl={f},gbs=32") for f in ("fsdp", "fsdp1", "deepspeed"))
    assert fsdp[0] == fsdp1[0] == [pytest.approx(layer)] and fsdp[1] == fsdp1[1] == [pytest.approx(layer)]
    assert fsdp[2]["gather_out"] == pytest.approx(2 * layer) and fsdp[2]["grads_in"] == pytest.approx(2 * layer)
    assert fsdp[2]["gather_in"] == pytest.approx(2 * layer / 32) and not any(fsdp1[2].values())
    h, q, kv, f = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.ffn
    attn = 2 * h * q + 2 * h * kv
    assert ds[0] == [pytest.approx(2 * x) for x in (attn + h * f, h * f, h * f)]  # norms persist, ungathered
    assert ds[1] == [pytest.approx(layer)]  # one reduce bucket (5e8 elements) per layer


def test_more_smaller_zero3_calls_make_a_slower_step_at_256_ranks(monkeypatch):
    import dataclasses

    from simexec.sim.simulate import simulate
    from simexec.specs import zero3_flavours

    fsdp1 = zero3_flavours.ZERO3_FLAVOURS["fsdp1"]
    plan = "dp=256,zero=3,zero_impl=fsdp1,gbs=256"
    one = simulate(get_model("llama3-8b"), get_cluster("32xdgx-h100"), plan).step_time_s
    monkeypatch.setitem(zero3_flavours.ZERO3_FLAVOURS, "fsdp1", dataclasses.replace(
        fsdp1, gather_bucket_params=2e6, reduce_bucket_params=2e6))
    assert len(_zero3_calls(plan, cluster="32xdgx-h100")[0]) >= 7  # a call per tensor
    many = simulate(get_model("llama3-8b"), get_cluster("32xdgx-h100"), plan).step_time_s
    assert many > one


def test_executor_refuses_a_flavour_that_splits_units_in_one_line():
    from simexec.exec.rank.unsupported_plans import unsupported

    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan("dp=2,zero=3,zero_impl=deepspeed,gbs=4"))
    why = unsupported(rp)
    assert why is not None and "\n" not in why and "deepspeed" in why
    assert unsupported(resolve(get_model("gpt-tiny"), get_cluster("local"),
                               parse_plan("dp=2,zero=3,zero_impl=fsdp1,gbs=4"))) is None


def test_deepspeed_2021_gathers_and_reduces_each_tensor_through_per_rank_lists():
    """DeepSpeed 0.3's ZeRO-3: one gather per sharded tensor and one reduce-scatter per tensor, each
    behind a host loop over the ranks (a view and a copy per rank): the gathers' on the compute stream
    (the device synchronized first), the reduce-scatters' on their own stream; the host time grows
    with the data-parallel size, so a bigger job pays more per call."""
    from simexec.specs.zero3_flavours import LIST_VIEW_S

    def lists(dp: int):
        rp = resolve(get_model("llama3-8b"), get_cluster(f"{dp // 8}xdgx-a100-80g"),
                     parse_plan(f"dp={dp},zero=3,zero_impl=deepspeed-2021,gbs={dp}"))
        return [i for i in lower(rp, symmetric=True).ranks[0] if i.block in ("gather_list", "grads_list")], rp

    found, rp = lists(64)
    gathers = [i for i in found if i.block == "gather_list"]
    reduces = [i for i in found if i.block == "grads_list"]
    assert gathers and all(i.stream == "compute" for i in gathers)
    assert reduces and all(i.stream.startswith("comm.") for i in reduces)
    launch = rp.cluster.device.launch_overhead_s
    assert gathers[0].host_s == pytest.approx(64 * (LIST_VIEW_S["allgather"] + launch))
    assert reduces[0].host_s == pytest.approx(64 * (LIST_VIEW_S["reducescatter"] + launch))
    calls = _zero3_calls("dp=32,zero=3,zero_impl=deepspeed-2021,gbs=32")
    assert len(calls[0]) == 7 and len(calls[1]) == 9  # a layer's 7 matrices gathered; norms reduced too
    bigger, _ = lists(128)
    assert bigger[0].host_s == pytest.approx(2 * gathers[0].host_s)
    text = gathers[0].to_text()
    assert "host_s=" in text and Instr.from_text(text) == gathers[0]
