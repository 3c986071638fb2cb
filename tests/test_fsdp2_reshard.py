"""FSDP2's reshard_after_forward and its behaviour under torch's pipelining (`Zero3Flavour.
pipeline_defers_reduction`): the gathers and reduce-scatters each issues and the memory it holds."""
from __future__ import annotations

from collections import Counter

import pytest

from simexec.errors import PlanError
from simexec.program.lower import lower
from simexec.sim.simulate import simulate
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve

MODEL = get_model("gpt3-125m")
SEQ = 256


def _rank0(plan: str):
    rp = resolve(MODEL, get_cluster("local"), parse_plan(plan), SEQ)
    return rp, lower(rp).ranks[0]


def _counts(plan: str) -> tuple[Counter, int]:
    """(gathers per phase, reduce-scatters) of rank 0, and its units."""
    rp, instrs = _rank0(plan)
    gathers = Counter(i.phase for i in instrs if i.kind == "collective" and i.block == "gather")
    reduces = sum(1 for i in instrs if i.kind == "collective" and i.block == "grads")
    return gathers, reduces


def _units(plan: str) -> int:
    """Gathers of one pass over the rank's units (the first forward gathers them all; a tied head
    gathers the embedding's unit too)."""
    _, instrs = _rank0(plan)
    return sum(1 for i in instrs if i.kind == "collective" and i.block == "gather" and i.phase == "fwd" and i.mb == 0)


def _peak_buffers(plan: str) -> float:
    _, instrs = _rank0(plan)
    live = peak = 0.0
    for i in instrs:
        if i.kind == "memory" and i.category == "buffers":
            live += i.bytes if i.op == "alloc" else -i.bytes
            peak = max(peak, live)
    return peak


def test_resharding_after_forward_gathers_twice_per_micro_batch():
    plan = "dp=4,zero=3,gbs=16"  # four micro-batches
    n = _units(plan)
    gathers, reduces = _counts(plan)
    assert gathers == {"fwd": 4 * n, "bwd": 4 * n} and reduces == 4 * n


def test_keeping_the_forward_gather_drops_the_backward_one():
    """reshard_after_forward=0: one gather per unit and micro-batch; every micro-batch still
    reduce-scatters (torchtitan's gradient accumulation never turns gradient sync off)."""
    plan = "dp=4,zero=3,gbs=16,reshard_after_forward=0"
    n = _units(plan)
    gathers, reduces = _counts(plan)
    assert gathers == {"fwd": 4 * n} and reduces == 4 * n
    # the whole model gathered at once at the turn from forward to backward
    whole = MODEL.params * 2
    assert _peak_buffers(plan) >= _peak_buffers("dp=4,zero=3,gbs=16") + 0.8 * whole


def test_a_pipelined_fsdp2_stage_gathers_once_and_reduces_once_a_step():
    plan = "dp=2,pp=2,zero=3,gbs=8,reshard_after_forward=0"  # four micro-batches a stage
    n = _units(plan)
    gathers, reduces = _counts(plan)
    assert gathers == {"fwd": n} and reduces == n


def test_a_pipelined_fsdp2_stage_that_reshards_after_forward_regathers_only_what_it_freed():
    """1F1B on stage 0 (F0 F1 B0 F2 B1 F3 B2 B3): the forwards reshard, the backwards but the last
    keep the units, so F2 and F3 find them gathered and B3 finds B2's."""
    plan = "dp=2,pp=2,zero=3,gbs=8"
    n = _units(plan)
    gathers, reduces = _counts(plan)
    assert gathers == {"fwd": 2 * n, "bwd": 3 * n} and reduces == n


def test_fsdp1_under_a_pipeline_keeps_per_micro_batch_collectives():
    plan = "dp=2,pp=2,zero=3,zero_impl=fsdp1,gbs=8"
    n = _units(plan)
    gathers, reduces = _counts(plan)
    assert gathers == {"fwd": 4 * n, "bwd": 4 * n} and reduces == 4 * n


def test_the_pipelined_peak_grows_by_a_stages_unsharded_parameters_and_gradients():
    """Held across micro-batches: the stage's gathered parameters and its unsharded gradients."""
    plan = "dp=2,pp=2,zero=3,gbs=8"
    rp, instrs = _rank0(plan)
    gathered = sum(i.bytes for i in instrs if i.kind == "memory" and i.op == "alloc" and ".gather." in i.name
                   and i.name.startswith("mem.alloc.fwd") and i.name.endswith(".m0"))
    held = gathered * (1 + rp.grad_bytes / rp.param_gather_bytes)
    assert _peak_buffers(plan) >= held
    assert _peak_buffers("dp=2,pp=2,zero=3,zero_impl=fsdp1,gbs=8") < 0.5 * held


@pytest.mark.parametrize("plan", ["dp=4,zero=2,reshard_after_forward=0", "dp=4,zero=3,zero_impl=yafsdp,reshard_after_forward=0"])
def test_reshard_after_forward_is_fsdp2s(plan):
    with pytest.raises(PlanError, match="reshard_after_forward=0"):
        resolve(MODEL, get_cluster("local"), parse_plan(plan), SEQ)


def test_fsdp2_keeps_its_root_gathered_from_the_forward_to_the_end_of_the_backward():
    """FSDPState._lazy_init sets the root group's post_forward_mesh_info to None: the embedding and the
    head, gathered for the forward, stay gathered until the backward has run through the embedding;
    the blocks reshard after each pass. FSDP1 reshards the root's units like the rest, and so does
    simexec's executor on CPU ranks (gpt-tiny's head is untied: a tied one gathers the embedding's
    parameters itself)."""
    def rank0_of(plan, cluster="dgx-h100"):
        return lower(resolve(get_model("gpt-tiny"), get_cluster(cluster), parse_plan(plan)), symmetric=False).ranks[0]

    rank0 = rank0_of("dp=8,zero=3,gbs=8")
    pos = {i.name: n for n, i in enumerate(rank0)}
    head = get_model("gpt-tiny").layers
    embed_bwd = max(n for n, i in enumerate(rank0) if i.kind == "compute" and i.phase == "bwd" and i.layer == -1)
    for unit in (-1, head):
        assert pos[f"mem.free.fwd.gather.L{unit}.m0"] > embed_bwd
        assert f"bwd.gather.L{unit}.m0" not in pos
    assert pos["mem.free.fwd.gather.L0.m0"] < min(n for n, i in enumerate(rank0) if i.phase == "bwd")
    fsdp1 = rank0_of("dp=8,zero=3,zero_impl=fsdp1,gbs=8")
    assert any(i.name == f"bwd.gather.L{head}.m0" for i in fsdp1)
    # simexec's executor on CPU ranks reshards the root like any unit
    assert any(i.name == f"bwd.gather.L{head}.m0" for i in rank0_of("dp=2,zero=3,gbs=2", cluster="local"))
