"""MoE token dispatch as Megatron-Core and DeepEP run it: the dispatcher kind (`moe_dispatcher`), the
all-to-alls overlapped with another micro-batch's compute (`moe_a2a_overlap`), load imbalance
(`moe_router_skew`) and the grouped GEMM's per-expert efficiency."""
from collections import Counter

import pytest

from simexec.errors import PlanError
from simexec.program.blocks import Anatomy
from simexec.program.layer_order import destination_domains
from simexec.program.groups import domain_split
from simexec.program.layer_order import layer_steps
from simexec.program.lower import lower
from simexec.program.moe_overlap import combined_1f1b, moe_overlap_order
from simexec.program.schedules import Action
from simexec.sim.compute import ComputeModel
from simexec.sim.simulate import simulate
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve

MOE = get_model("moe-tiny")  # 4 experts of FFN 128
MIXTRAL = get_model("mixtral-8x7b")


def rp_of(plan: str, model=MOE, cluster="local", seq=None):
    return resolve(model, get_cluster(cluster), parse_plan(plan), seq)


def _moe_collectives(rp, rank: int = 0) -> Counter:
    prog = lower(rp)
    return Counter((i.block, i.collective, i.group, i.bytes) for i in prog.ranks[rank] if i.kind == "collective"
                   and i.layer == 0 and i.mb == 0 and i.block.startswith(("dispatch", "combine", "etp")))


# --- 1. dispatcher kinds ---------------------------------------------------------------------------
def test_dispatcher_steps_in_forward_order():
    names = lambda d, etp=1: [(s.name, s.axis, s.fwd, s.bwd) for s in layer_steps(True, False, 1, "allgather", etp, d)
                              if s.axis][2:]
    assert names("alltoall") == [("mlp_in", "tp", "", "allreduce"), ("dispatch", "ep", "alltoall", "alltoall"),
                                 ("combine", "ep", "alltoall", "alltoall"), ("mlp_out", "tp", "allreduce", "")]
    assert names("allgather")[1:3] == [("dispatch", "ep", "allgather", "reducescatter"),
                                       ("combine", "ep", "reducescatter", "allgather")]
    assert [n for n, *_ in names("deepep", 2)] == ["mlp_in", "dispatch_net", "dispatch", "etp_in", "etp_out",
                                                   "combine", "combine_net", "mlp_out"]


def test_allgather_dispatcher_gathers_every_token_and_reduce_scatters_back():
    """Megatron-Core's MoEAllGatherTokenDispatcher: the ep group's tokens gathered whole (each once, not
    top_k times), the experts' outputs reduce-scattered; the experts compute the same rows."""
    rp = rp_of("dp=4,ep=4,moe_dispatcher=allgather")
    an = Anatomy(rp)
    c = _moe_collectives(rp)
    gathered = an.routed_tokens * an.h * an.dt * 4
    assert c[("dispatch", "allgather", (0, 1, 2, 3), gathered)] == 1
    assert c[("dispatch", "reducescatter", (0, 1, 2, 3), gathered)] == 1
    assert c[("combine", "reducescatter", (0, 1, 2, 3), gathered)] == 1
    assert an.layer(0)["experts"].flops == Anatomy(rp_of("dp=4,ep=4")).layer(0)["experts"].flops


def test_allgather_dispatcher_folded_gathers_over_etp_too():
    rp = rp_of("dp=2,cp=2,ep=2,etp=2,moe_dispatcher=allgather")
    an = Anatomy(rp)
    c = _moe_collectives(rp)
    etp_bytes = an.gathered_tokens_bytes * 2
    assert sum(n for (b, v, _, by), n in c.items() if b == "etp_in" and v == "allgather" and by == etp_bytes) == 1


def test_deepep_splits_ep_into_nvlink_and_network_hops():
    """ep=8 over tp=2 on 2 DGX nodes: DeepEP's network hop goes between the two same-index GPUs, once per
    destination node per token (fewer bytes than the all-to-all's top_k copies), then fans out in the node."""
    rp = rp_of("tp=2,sp=1,dp=8,ep=8,moe_dispatcher=deepep", MIXTRAL, "2xdgx-h100", 1024)
    an = Anatomy(rp)
    c = _moe_collectives(rp)
    net = {k: n for k, n in c.items() if k[0] == "dispatch_net"}
    (block, verb, group, nbytes), = [k for k in net if k[1] == "alltoall"][:1]
    assert group == (0, 8)
    assert nbytes == pytest.approx(an.dispatch_bytes / 2 * destination_domains(8, 2, 2))
    assert nbytes < an.dispatch_bytes  # 1.57 of top_k 2 copies cross the network
    assert any(k[0] == "dispatch" and k[2] == (0, 2, 4, 6) and k[3] == an.dispatch_bytes for k in c)
    assert any(k[0] == "combine_net" for k in c)


def test_deepep_nvlink_hop_carries_a_token_once_per_rank():
    """Inside the domain DeepEP forwards a token once to each rank holding one of its experts (the rank
    permutes it to its experts' rows): with 4 experts per rank, fewer bytes than top_k copies, and both
    the lowering prices that."""
    m = MIXTRAL.model_copy(update={"moe": MIXTRAL.moe.model_copy(update={"experts": 64, "top_k": 8})})
    rp = rp_of("dp=16,ep=16,moe_dispatcher=deepep", m, "2xdgx-h100", 1024)
    an = Anatomy(rp)
    reached = destination_domains(64, 8, 16)  # ep ranks a token's 8 experts are on
    assert 6.0 < reached < 8.0
    assert an.deepep_domain_bytes == pytest.approx(an.dispatch_bytes / 8 * reached)
    c = _moe_collectives(rp)
    assert any(k[0] == "dispatch" and k[2] == tuple(range(8)) and k[3] == an.deepep_domain_bytes for k in c)
    assert any(k[0] == "combine" and k[3] == an.deepep_domain_bytes for k in c)
    assert an.exchange_bytes("dispatch", 2) == an.deepep_domain_bytes
    assert an.exchange_bytes("dispatch", 1) == an.dispatch_bytes  # inside one domain: the all-to-all


def test_deepep_inside_one_domain_is_the_all_to_all():
    a = simulate(MIXTRAL, "2xdgx-h100", "dp=16,ep=8,gbs=16", 1024).step_time_s
    b = simulate(MIXTRAL, "2xdgx-h100", "dp=16,ep=8,gbs=16,moe_dispatcher=deepep", 1024).step_time_s
    assert a == pytest.approx(b)


def test_destination_domains_and_domain_split():
    assert destination_domains(8, 2, 1) == 1.0
    assert destination_domains(8, 2, 2) == pytest.approx(2 * (1 - 4 / 8 * 3 / 7))
    assert destination_domains(256, 8, 32) == pytest.approx(32 * (1 - __import__("math").comb(248, 8)
                                                                  / __import__("math").comb(256, 8)))
    assert destination_domains(8, 8, 4) == pytest.approx(4.0)  # every expert: every domain
    assert domain_split((0, 2, 4, 6, 8, 10, 12, 14), 10, 8) == ((8, 10, 12, 14), (2, 10))


# --- 2. overlap with the other micro-batch ---------------------------------------------------------
def test_combined_1f1b_order_and_pairs():
    acts = [Action(0, k, m) for m in range(3) for k in "FB"]
    order = combined_1f1b(acts)
    assert [(a.kind, a.mb) for a in order] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert moe_overlap_order(acts) == (order, {1, 3})
    assert moe_overlap_order(acts[:2])[1] == frozenset()  # one micro-batch: nothing pairs
    every_forward_first = [Action(0, "F", m) for m in range(3)] + [Action(0, "B", m) for m in range(3)]
    assert moe_overlap_order(every_forward_first)[1] == frozenset()  # no steady state


def test_overlap_hides_the_all_to_alls():
    plan = "dp=8,ep=8,gbs=32,recompute=selective"
    base = simulate(MIXTRAL, "dgx-h100", plan, 1024)
    over = simulate(MIXTRAL, "dgx-h100", plan + ",moe_a2a_overlap=1", 1024)
    assert over.step_time_s < base.step_time_s


def test_overlap_under_an_interleaved_pipeline_pairs_the_steady_state():
    from simexec.program.schedules import schedule

    plain = schedule("interleaved-1f1b").order(4, 0, 8, 2)
    acts = combined_1f1b(plain)  # Megatron's one more warm-up forward, then the steady state's pairs
    first_b = [i for i, a in enumerate(acts) if a.kind == "B"][0]
    assert first_b == [i for i, a in enumerate(plain) if a.kind == "B"][0] + 1 and sorted(acts) == sorted(plain)
    pairs = moe_overlap_order(plain)[1]
    assert pairs and all(acts[i].kind == "F" and acts[i + 1].kind == "B" for i in pairs)
    # the merged pairs hide the all-to-alls under the other pass's compute
    plan = "dp=8,pp=2,vpp=2,ep=8,gbs=64,recompute=selective"
    base = simulate(MIXTRAL, "2xdgx-h100", plan, 1024)
    over = simulate(MIXTRAL, "2xdgx-h100", plan + ",moe_a2a_overlap=1", 1024)
    assert over.step_time_s < base.step_time_s
    assert over.breakdown_s["comm.ep"] < 0.5 * base.breakdown_s["comm.ep"]


@pytest.mark.parametrize("pp,vpp,rounds", [(2, 2, 2), (4, 2, 3), (4, 4, 1), (2, 4, 3)])
def test_overlap_under_interleaved_pipelines_never_deadlocks_nor_slows(pp, vpp, rounds):
    """Megatron's extra warm-up forward keeps each pair's forward and backward independent, so merging
    them never waits in a cycle through the neighbours; with every forward first (rounds = 1) nothing pairs."""
    dp = 16 // pp
    plan = f"dp={dp},pp={pp},vpp={vpp},ep=4,gbs={pp * rounds * dp}"
    base = simulate(MIXTRAL, "2xdgx-h100", plan, 512).step_time_s
    over = simulate(MIXTRAL, "2xdgx-h100", plan + ",moe_a2a_overlap=1", 512).step_time_s
    assert over == pytest.approx(base) if rounds == 1 else over < base


def test_overlap_with_one_micro_batch_degrades_to_none():
    plan = "dp=8,ep=8,gbs=8"
    base = simulate(MIXTRAL, "dgx-h100", plan, 1024).step_time_s
    assert simulate(MIXTRAL, "dgx-h100", plan + ",moe_a2a_overlap=1", 1024).step_time_s == pytest.approx(base)


@pytest.mark.parametrize("plan, fragment", [
    ("dp=4,moe_a2a_overlap=1", "needs ep > 1"),
    ("dp=4,ep=4,moe_dispatcher=allgather,moe_a2a_overlap=1", "alltoall or deepep"),
    ("dp=4,ep=4,recompute=full,moe_a2a_overlap=1", "recompute=full"),
    ("dp=2,pp=2,ep=2,gbs=8,moe_a2a_overlap=1", "needs vpp > 1"),
    ("dp=2,pp=2,vpp=2,ep=2,gbs=8,p2p_overlap=0,moe_a2a_overlap=1", "needs p2p_overlap=1"),
])
def test_overlap_refused_where_megatron_refuses_it(plan, fragment):
    with pytest.raises(PlanError, match=fragment):
        rp_of(plan)


def test_knobs_refused_on_a_dense_model():
    with pytest.raises(PlanError, match="need an MoE model"):
        rp_of("dp=2,moe_dispatcher=allgather", get_model("gpt-tiny"))


# --- 3. load imbalance -----------------------------------------------------------------------------
def test_router_skew_scales_the_busiest_ranks_rows_and_dispatch():
    a, b = Anatomy(rp_of("dp=4,ep=4")), Anatomy(rp_of("dp=4,ep=4,moe_router_skew=1.5"))
    assert b.layer(0)["experts"].flops == pytest.approx(1.5 * a.layer(0)["experts"].flops)
    assert b.dispatch_bytes == pytest.approx(1.5 * a.dispatch_bytes)
    assert b.layer(0)["router"].flops == a.layer(0)["router"].flops
    capped = MOE.model_copy(update=dict(moe=MOE.moe.model_copy(update=dict(capacity_factor=1.0))))
    assert Anatomy(rp_of("dp=4,ep=4,moe_router_skew=1.5", capped)).router_skew == 1.0  # padded to capacity
    with pytest.raises(Exception):
        parse_plan("dp=4,ep=4,moe_router_skew=0.5")


def test_router_skew_slows_the_step():
    plan = "dp=8,ep=8,gbs=8"
    assert (simulate(MIXTRAL, "dgx-h100", plan + ",moe_router_skew=1.5", 1024).step_time_s
            > simulate(MIXTRAL, "dgx-h100", plan, 1024).step_time_s)


# --- 4. grouped GEMM ---------------------------------------------------------------------------------
def test_grouped_gemm_runs_at_its_per_expert_size():
    cm = ComputeModel(get_cluster("dgx-h100"), "bf16")
    f = 4e11
    assert cm.efficiency("gemm", f, groups=8) == pytest.approx(cm.efficiency("gemm", f / 8))
    assert cm.efficiency("gemm", f, groups=8) < cm.efficiency("gemm", f)
    assert cm.efficiency("gemm", f, groups=1) == cm.efficiency("gemm", f)


def test_experts_block_carries_its_gemm_count_dense_blocks_none():
    an = Anatomy(rp_of("dp=4,ep=2"))
    assert an.layer(0)["experts"].gemm_groups == 2 * MOE.moe.experts / 2
    assert an.layer(0)["moe_out"].gemm_groups == 0.0
    assert all(b.gemm_groups == 0.0 for b in Anatomy(rp_of("dp=2", get_model("gpt-tiny"))).layer(0).values())
    experts = [i for i in lower(rp_of("dp=4,ep=2")).ranks[0] if i.kind == "compute" and i.block == "experts"]
    assert experts and all(i.gemm_groups == 4.0 for i in experts)


# --- 5. search ---------------------------------------------------------------------------------------
def test_search_enumerates_dispatchers_and_overlap():
    from simexec.search.space import expert_dispatches, moe_a2a_overlaps
    from simexec.program.schedules import schedule

    triples = expert_dispatches(MIXTRAL, {}, 2, 1, 8, True, 8)
    assert (8, None, "deepep") in triples and (8, None, "allgather") in triples and (1, None, "alltoall") in triples
    assert (2, None, "deepep") not in triples  # ep 2 x tp 2 stays in the node
    assert (1, None, "allgather") not in triples
    assert moe_a2a_overlaps({}, 8, "alltoall", schedule("1f1b"), 1, 1, "none") == [False, True]
    assert moe_a2a_overlaps({}, 8, "alltoall", schedule("1f1b"), 2, 1, "none") == [False]
    assert moe_a2a_overlaps({}, 8, "alltoall", schedule("interleaved-1f1b"), 2, 2, "none") == [False, True]
    assert moe_a2a_overlaps({}, 8, "allgather", schedule("1f1b"), 1, 1, "none") == [False]


def test_torchtitan_searches_the_all_to_all_only():
    from simexec.specs.stack import get_stack

    choices = get_stack("torchtitan").search_choices
    assert choices["moe_dispatcher"] == ["alltoall"] and choices["moe_a2a_overlap"] == [False]


def test_bounds_stay_below_the_simulation_of_the_new_knobs():
    from simexec.search.bounds import Bounds
    from simexec.search.space import AnyOf, structures

    cl = get_cluster("2xdgx-h100")
    b = Bounds(MIXTRAL, cl, 1024)
    fix = {"tp": 2, "sp": True, "pp": 1, "cp": 1, "zero": 1, "mbs": 1, "recompute": "selective",
           "moe_dispatcher": AnyOf(("allgather", "deepep", "alltoall")), "moe_a2a_overlap": AnyOf((False, True))}
    cands = []
    for st in structures(MIXTRAL, cl, 32, 1024, fix):
        cands.extend(b.candidates(st, len(cands)))
    seen = set()
    for c in cands:
        p = parse_plan(c.plan_string)
        if p.ep == 1 or (p.moe_dispatcher, p.moe_a2a_overlap) in seen:
            continue
        seen.add((p.moe_dispatcher, p.moe_a2a_overlap))
        r = simulate(MIXTRAL, cl, p, 1024)
        assert c.time_lb <= r.step_time_s and b.refine(c) <= r.step_time_s, c.plan_string
    assert len(seen) >= 4


# --- 6. executor -------------------------------------------------------------------------------------
def test_executor_refuses_the_router_skew_in_one_line_and_runs_the_overlap():
    from simexec.exec.rank.unsupported_plans import unsupported

    msg = unsupported(rp_of("dp=4,ep=4,moe_router_skew=1.2"))
    assert msg and "moe_router_skew" in msg and "\n" not in msg
    assert unsupported(rp_of("dp=4,ep=4,gbs=16,moe_a2a_overlap=1")) is None  # tests/test_exec_interp_ext.py runs it


@pytest.mark.parametrize("knob", ["moe_dispatcher=allgather", "moe_dispatcher=deepep"])
def test_executor_runs_the_dispatchers_inside_one_domain(knob):
    from simexec.exec.rank.unsupported_plans import unsupported

    assert unsupported(rp_of("dp=4,ep=4," + knob)) is None


def test_group_limited_routing_caps_the_domains_deepep_sends_to():
    from simexec.program.layer_order import destination_domains

    assert destination_domains(256, 8, 8) == pytest.approx(5.2947, abs=1e-3)  # uniform over 8 domains
    assert destination_domains(256, 8, 8, 8, 4) == 4.0  # one group per domain: the 4 picked groups' domains
    assert destination_domains(256, 8, 4, 8, 4) == pytest.approx(4 * (1 - 15 / 70))  # two groups a domain
    assert destination_domains(256, 8, 16, 8, 4) == pytest.approx(8 * (1 - 120 / 496))  # a group spans two
    assert destination_domains(256, 8, 1, 8, 4) == 1.0


def test_group_limited_topk_keeps_each_token_in_its_best_groups():
    import torch

    from simexec.exec.nn.gpt import group_limited_topk

    probs = torch.softmax(torch.randn(64, 16, generator=torch.Generator().manual_seed(0)), dim=-1)
    top, idx = group_limited_topk(probs, 4, groups=4, group_topk=2)
    groups = idx // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    for n in range(64):  # the two groups with the largest sum of their top 2 scores
        scores = probs[n].view(4, 4).topk(2, dim=-1)[0].sum(-1)
        assert set(groups[n].tolist()) <= set(scores.topk(2)[1].tolist())
    assert torch.equal(top, probs.gather(-1, idx))
    plain = group_limited_topk(probs, 4)
    assert torch.equal(plain[1], probs.topk(4, dim=-1)[1])


def test_router_groups_are_checked_and_imported():
    from simexec.errors import SpecError
    from simexec.specs.model import MoESpec

    moe = get_model("deepseek-v3").moe
    assert (moe.router_groups, moe.router_group_topk) == (8, 4)
    for bad in (dict(router_groups=3), dict(router_groups=4, router_group_topk=5),
                dict(router_groups=4, router_group_topk=3)):
        with pytest.raises((ValueError, SpecError)):
            MoESpec(experts=8, top_k=2, expert_ffn=16, **bad)
