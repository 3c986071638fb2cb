"""Selective recompute by submodule (`Plan.recompute_modules`, Megatron-Core's --recompute-modules):
validation, the plan string, what each module keeps and recomputes, and the executor's replay."""
from __future__ import annotations

import pytest

from simexec.errors import PlanError
from simexec.program.lower import lower
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve

CLUSTER = "dgx-h100"


def _deepseek_like():
    """DeepSeek-V3 cut to four layers (one dense, three MoE): MLA, shared experts."""
    m = get_model("deepseek-v3")
    return m.model_copy(update={"layers": 4, "moe": m.moe.model_copy(update={"first_dense_layers": 1})})


def _resolve(model, plan: str, seq_len: int | None = None, cluster: str = CLUSTER):
    model = get_model(model) if isinstance(model, str) else model
    return resolve(model, get_cluster(cluster), parse_plan(plan), seq_len)


def test_plan_string_round_trips():
    p = parse_plan("tp=2,recompute=selective,recompute_modules=mla_up_proj+mlp")
    assert p.recompute_modules == ("mla_up_proj", "mlp")
    assert "recompute_modules=mla_up_proj+mlp" in p.to_string()
    assert parse_plan(p.to_string()) == p
    assert parse_plan("recompute=selective").selective_modules == ("core_attn",)
    assert parse_plan("recompute=full").selective_modules == ()


@pytest.mark.parametrize("model,plan,words", [
    ("gpt-tiny", "recompute=selective,recompute_modules=attn", ["'attn'", "core_attn", "mla_up_proj"]),
    ("gpt-tiny", "recompute=selective,recompute_modules=mlp+mlp", ["twice"]),
    ("gpt-tiny", "recompute=selective,recompute_modules=mla_up_proj", ["mla_up_proj", "allowed"]),
    ("gpt-tiny", "recompute=selective,recompute_modules=moe_act", ["moe_act", "dense"]),
    ("gpt-tiny", "recompute=selective,recompute_modules=moe", ["moe", "dense"]),
    ("gpt-tiny", "recompute=selective,recompute_modules=shared_experts", ["shared_experts", "dense"]),
    ("gpt-tiny", "recompute=full,recompute_modules=mlp", ["needs recompute=selective"]),
    ("moe-tiny", "ep=2,gbs=8,moe_a2a_overlap=1,recompute=selective,recompute_modules=moe", ["moe_a2a_overlap"]),
    ("gpt-tiny", "recompute_modules=core_attn", ["needs recompute=selective"]),
])
def test_bad_modules_fail_in_one_line(model, plan, words):
    with pytest.raises(PlanError) as err:
        _resolve(model, plan)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def _peak_and_recompute(model, plan: str, seq_len: int | None = None) -> tuple[float, float]:
    """(the peak rank's tensors, rank 0's recompute FLOPs) of one step."""
    from simexec.sim.simulate import simulate

    model = get_model(model) if isinstance(model, str) else model
    r = simulate(model, CLUSTER, plan, seq_len)
    instrs = lower(_resolve(model, plan, seq_len), symmetric=True).ranks[0]
    return r.peak_tensor_bytes, sum(i.flops for i in instrs if i.phase == "recompute" and i.kind == "compute")


def test_mla_up_projection_keeps_less_than_the_attention_core_and_recomputes_more():
    base = "ep=8,gbs=8,recompute=selective"
    core = _peak_and_recompute(_deepseek_like(), base, 4096)
    up = _peak_and_recompute(_deepseek_like(), base + ",recompute_modules=mla_up_proj", 4096)
    both = _peak_and_recompute(_deepseek_like(), base + ",recompute_modules=core_attn+mla_up_proj", 4096)
    assert up[0] < core[0] and both[0] <= up[0]
    assert both[1] > up[1] > 0 and both[1] > core[1]


def test_mlp_recompute_keeps_less_on_a_dense_model_and_recomputes_its_gemms():
    base = "tp=8,sp=1,gbs=1,recompute=selective"
    core = _peak_and_recompute("mistral-7b", base)
    mlp = _peak_and_recompute("mistral-7b", base + ",recompute_modules=core_attn+mlp")
    norms = _peak_and_recompute("mistral-7b", base + ",recompute_modules=core_attn+mlp+layernorm")
    assert norms[0] < mlp[0] < core[0]
    m = get_model("mistral-7b")
    tokens, layers = m.seq_len, m.layers
    gemms = 2 * tokens * m.hidden * 3 * m.ffn / 8  # fc1 (gate and up) and fc2 on one of 8 tp ranks
    assert mlp[1] - core[1] == pytest.approx(layers * gemms, rel=1e-6)
    assert norms[1] == mlp[1]  # the norms are memory-bound: bytes, no FLOPs


@pytest.mark.parametrize("mods,blocks", [
    ("mlp", {"fc1", "fc2"}), ("core_attn+mlp", {"attn", "fc1", "fc2"}), ("layernorm", {"norm1", "norm2"}),
])
def test_dense_modules_recompute_their_blocks(mods, blocks):
    prog = lower(_resolve("gpt-tiny", f"tp=2,gbs=2,recompute=selective,recompute_modules={mods}", cluster="local"), symmetric=True)
    prog.validate()
    assert {i.block for i in prog.ranks[0] if i.phase == "recompute" and i.kind == "compute"} == blocks


def test_moe_modules_recompute_their_parts():
    plan = "dp=2,ep=2,tp=2,gbs=4,recompute=selective,recompute_modules="
    moe = lower(_resolve("moe-tiny", plan + "moe", cluster="local"), symmetric=True).ranks[0]
    got = {(i.kind, i.block) for i in moe if i.phase == "recompute"}
    assert {("compute", "router"), ("compute", "experts"), ("compute", "moe_out"),
            ("collective", "dispatch"), ("collective", "combine")} <= got
    parts = lower(_resolve("moe-tiny", plan + "moe_act+shared_experts", cluster="local"), symmetric=True).ranks[0]
    assert {i.block for i in parts if i.phase == "recompute"} == {"moe_act", "shared_experts"}


def test_executor_refuses_modules_inside_blocks():
    from simexec.exec.rank.unsupported_plans import unsupported

    rp = resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan("dp=1,gbs=2,recompute=selective,"
                                                                           "recompute_modules=core_attn+layernorm"))
    why = unsupported(rp)
    assert why is not None and "recompute_modules layernorm" in why and "\n" not in why


@pytest.mark.parametrize("plan", ["dp=2,gbs=4,recompute=selective,recompute_modules=core_attn+mlp",
                                  "tp=2,gbs=2,recompute=selective,recompute_modules=mlp"])
def test_executor_recomputes_whole_blocks_as_the_reference(plan):
    pytest.importorskip("torch")
    from tests.test_exec_interp import check_plan

    check_plan("gpt-tiny", plan)
