"""MoE parallel folding (`Plan.etp`): the expert mesh (etp, ep, edp) over a pipeline stage's
tp*cp*dp ranks, in Megatron-Core's order (its expert RankGenerator, order "tp-ep-dp-pp")."""
from collections import Counter

import pytest

from simexec.errors import PlanError
from simexec.program.groups import rank_groups
from simexec.program.layer_order import layer_steps
from simexec.program.lower import lower
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve

MOE = get_model("moe-tiny")  # 4 experts of FFN 128


def rp_of(plan: str, model=MOE, cluster="local"):
    return resolve(model, get_cluster(cluster), parse_plan(plan))


def test_etp_parses_and_round_trips():
    p = parse_plan("dp=2,tp=2,sp=1,ep=4,etp=1")
    assert p.etp == 1 and parse_plan(p.to_string()) == p
    assert parse_plan("dp=2,ep=2").etp is None


@pytest.mark.parametrize("plan, fragment", [
    ("dp=2,tp=2,sp=1,ep=4,etp=2", "etp*ep=8 must divide tp*cp*dp=4"),
    ("dp=4,ep=3,etp=1", "experts 4 not divisible by ep=3"),
    ("dp=2,tp=2,ep=4,etp=1", "etp=1 with tp=2 needs sp=1"),
    ("dp=4,ep=2,etp=1,zero=1,dp_shard=2", "dp_shard=2 (HSDP) does not run with etp=1"),
    ("dp=2,tp=2,sp=1,ep=1,etp=1,pp=2,gbs=4,rank_order=tp-cp-pp-dp", "needs pp as the slowest axis"),
])
def test_folded_plans_refused_with_their_rule(plan, fragment):
    with pytest.raises(PlanError) as exc:
        rp_of(plan)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_etp_on_dense_model_refused():
    with pytest.raises(PlanError, match="etp=1 on dense model gpt-tiny"):
        rp_of("dp=2,etp=1", get_model("gpt-tiny"))


def test_expert_ffn_divisible_by_etp():
    with pytest.raises(PlanError, match="expert FFN size 128 not divisible by etp=3"):
        rp_of("dp=3,etp=3")


def test_ep_spans_tp_and_dp():
    """tp=2, dp=2 with ep=4, etp=1: ep spans all four ranks of the stage (out of dp alone it would be
    refused), each expert whole on one rank, no expert data parallelism."""
    with pytest.raises(PlanError, match="ep=4 does not divide dp=2"):
        rp_of("dp=2,tp=2,sp=1,ep=4")
    rp = rp_of("dp=2,tp=2,sp=1,ep=4,etp=1")
    for r in range(4):
        g = rank_groups(rp, r)
        assert g.ep == (0, 1, 2, 3) and g.etp == (r,) and g.edp == (r,)
        assert g.tp == (r - r % 2, r - r % 2 + 1)  # the attention's groups are unchanged
    assert rp.expert_dp == 1 and rp.expert_tp == 1


def test_megatron_order_etp_fastest_then_ep_then_edp():
    """8 ranks per stage (tp=2, dp=4), etp=2, ep=2: as Megatron's RankGenerator(tp=2, ep=2, dp=2)
    numbers them, etp groups are consecutive pairs, ep groups stride 2, edp groups stride 4; pp slowest."""
    rp = rp_of("dp=4,tp=2,sp=1,ep=2,etp=2,pp=2,gbs=16")
    g = rank_groups(rp, 9)  # stage 1 holds ranks 8..15; rank 9 is index 1 there
    assert g.etp == (8, 9) and g.ep == (9, 11) and g.edp == (9, 13)
    g = rank_groups(rp, 6)
    assert g.etp == (6, 7) and g.ep == (4, 6) and g.edp == (2, 6)


def test_unfolded_groups_unchanged_and_etp_is_tp():
    rp = rp_of("dp=2,tp=2,ep=2")
    g = rank_groups(rp, 0)
    assert g.etp == g.tp == (0, 1) and g.ep == (0, 2) and g.edp == (0,)


def test_expert_parameters_split_over_etp_times_ep():
    m = get_model("deepseek-v3")
    cl = get_cluster("32xdgx-h100")
    folded = resolve(m, cl, parse_plan("tp=2,sp=1,dp=128,ep=32,etp=1"))
    split = resolve(m, cl, parse_plan("tp=2,sp=1,dp=128,ep=32"))
    assert folded.params_on_pp_rank(0)["expert"] == pytest.approx(2 * split.params_on_pp_rank(0)["expert"])
    assert folded.params_on_pp_rank(0)["dense"] == split.params_on_pp_rank(0)["dense"]
    assert folded.expert_dp == 256 // 32
    # ZeRO-1 shards the experts' optimizer states over edp = 8 ranks, the dense over dp = 128
    z = resolve(m, cl, parse_plan("tp=2,sp=1,dp=128,ep=32,etp=1,zero=1"))
    states = z.model_state_bytes(0)
    n = z.params_on_pp_rank(0)
    assert states["optimizer"] == pytest.approx(12 * (n["dense"] / 128 + n["expert"] / 8))


def _collectives(plan: str) -> Counter:
    rp = rp_of(plan)
    prog = lower(rp)
    return Counter((i.block, i.collective, i.group) for i in prog.ranks[0] if i.kind == "collective"
                   and i.block in ("dispatch", "combine", "etp_in", "etp_out") and i.layer == 0 and i.mb == 0)


def test_lowering_dispatches_over_the_folded_ep_group():
    c = _collectives("dp=2,tp=2,sp=1,ep=4,etp=1")
    assert c[("dispatch", "alltoall", (0, 1, 2, 3))] == 2 and c[("combine", "alltoall", (0, 1, 2, 3))] == 2
    assert not any(b.startswith("etp") for b, _, _ in c)


def test_lowering_gathers_over_etp_around_the_experts():
    c = _collectives("dp=2,tp=2,sp=1,ep=2,etp=2")
    assert c[("etp_in", "allgather", (0, 1))] == 1 and c[("etp_in", "reducescatter", (0, 1))] == 1
    assert c[("etp_out", "reducescatter", (0, 1))] == 1 and c[("etp_out", "allgather", (0, 1))] == 1
    assert c[("dispatch", "alltoall", (0, 2))] == 2
    steps = [s.name for s in layer_steps(True, True, 1, "allgather", 2)]
    assert steps[steps.index("dispatch"):steps.index("combine") + 1] == ["dispatch", "etp_in", "experts", "etp_out",
                                                                         "combine"]


def test_folded_expert_blocks_compute_the_same_rows_times_width():
    """etp=1, ep=4 and etp=2, ep=2 on the same 4 ranks: each rank's experts do the same FLOPs (rows x
    width), the etp=1 plan moving no etp traffic."""
    from simexec.program.blocks import Anatomy

    a = Anatomy(rp_of("dp=2,tp=2,sp=1,ep=4,etp=1")).layer(0)["experts"]
    b = Anatomy(rp_of("dp=2,tp=2,sp=1,ep=2,etp=2")).layer(0)["experts"]
    assert a.flops == pytest.approx(b.flops)


def test_simulate_folded_plan_reports_etp_traffic():
    from simexec.sim.simulate import simulate

    r = simulate(MOE, "local", "dp=2,tp=2,sp=1,ep=2,etp=2")
    assert r.breakdown_s.get("comm.etp", 0) > 0
    assert "comm.etp" not in simulate(MOE, "local", "dp=2,tp=2,sp=1,ep=4,etp=1").breakdown_s


def test_executor_runs_folding_and_refuses_what_it_cannot_in_one_line():
    from simexec.exec.rank.unsupported_plans import unsupported

    for plan in ("dp=2,tp=2,sp=1,ep=4,etp=1", "dp=2,tp=2,sp=1,ep=2,etp=2", "dp=2,cp=2,ep=4,etp=1"):
        assert unsupported(rp_of(plan)) is None, plan
    unshared = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"shared_experts": 0})})
    assert unsupported(rp_of("dp=2,tp=2,sp=1,ep=4,etp=1", unshared)) is None
    dropping = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"capacity_factor": 1.0})})
    msg = unsupported(rp_of("dp=2,tp=2,sp=1,ep=4,etp=1", dropping))
    assert msg and "with etp=1 and tp=2" in msg and "\n" not in msg


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_folded_dispatch_moves_each_tp_ranks_slice_with_or_without_shared_experts(dispatcher):
    """Under folding over tp each tp rank routes its own slice of the sequence, shared experts or not
    (they only add the tp gather around the MLP): the dispatch moves the slice's rows, half of what the
    same ranks move with tp=1 and ep over dp alone."""
    unshared = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"shared_experts": 0})})

    def dispatch_bytes(plan: str, model=MOE) -> float:
        rp = rp_of(f"{plan},moe_dispatcher={dispatcher}", model)
        return next(i.bytes for i in lower(rp, symmetric=True).ranks[0]
                    if i.block == "dispatch" and i.phase == "fwd" and i.kind == "collective")

    shared = dispatch_bytes("dp=2,tp=2,sp=1,ep=4,etp=1")
    assert shared == dispatch_bytes("dp=2,tp=2,sp=1,ep=4,etp=1", unshared)
    assert shared == dispatch_bytes("dp=4,ep=4") / 2
    rp = rp_of("dp=2,tp=2,sp=1,ep=4,etp=1")
    tokens, h, dt = rp.plan.mbs * rp.seq_len // 2, MOE.hidden, 2  # one tp rank's slice of its micro-batch, bf16
    assert shared == (tokens * MOE.moe.top_k if dispatcher == "alltoall" else tokens * 4) * h * dt


def test_search_enumerates_folded_layouts():
    from simexec.search.space import expert_layouts

    assert (4, 1) in expert_layouts(MOE, {}, 2, 1, 2, True)  # folded layouts are searched by default
    from simexec.search.space import AnyOf

    pairs = expert_layouts(MOE, {"etp": AnyOf((None, 1, 2))}, 2, 1, 2, True)
    assert (4, 1) in pairs and (2, 1) in pairs and (2, None) in pairs
    assert (2, 2) not in pairs  # etp = tp, ep out of dp: the unfolded plan again
    assert all(e is None for _, e in expert_layouts(MOE, {"etp": 1}, 2, 1, 2, False))  # tp > 1 without sp
    assert expert_layouts(MOE, {"etp": 1}, 1, 2, 2, False) == [(1, 1), (2, 1), (4, 1)]


def test_folded_moe_layers_without_shared_experts_gather_nothing_over_tp():
    """Each tp rank routes the sequence slice it holds: no tp all-gather before a folded MoE MLP and no
    reduce-scatter after it, unless a shared expert (a TP MLP over the gathered sequence) needs them."""
    from simexec.program.lower import lower
    from simexec.specs.cluster import get_cluster
    from simexec.specs.model import get_model
    from simexec.specs.plan import parse_plan, resolve

    def mlp_collectives(model: str, plan: str) -> set:
        rp = resolve(get_model(model), get_cluster("2xdgx-h100"), parse_plan(plan), 1024)
        layer = rp.model.layers - 1  # a MoE layer in both models
        return {i.block for i in lower(rp).ranks[0]
                if i.kind == "collective" and i.layer == layer and i.block in ("mlp_in", "mlp_out")}

    assert mlp_collectives("mixtral-8x7b", "tp=2,sp=1,ep=8,etp=1,gbs=16") == set()
    # the router then has no tp collective for tp_overlap to run its weight pass beside
    assert mlp_collectives("mixtral-8x7b", "tp=2,sp=1,ep=8,etp=1,tp_overlap=1,gbs=16") == set()
    assert mlp_collectives("mixtral-8x7b", "tp=2,sp=1,ep=4,gbs=16") == {"mlp_in", "mlp_out"}
    assert mlp_collectives("moe-tiny", "tp=2,sp=1,ep=4,etp=1,gbs=16") == {"mlp_in", "mlp_out"}
