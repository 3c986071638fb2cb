"""Megatron-Core's pipeline layout notation (`Plan.layout`), stages without transformer layers and
multi-token prediction (`ModelSpec.mtp_layers`)."""
import pytest

from simexec.errors import PlanError
from simexec.sim.simulate import simulate
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.pipeline_layout import expand_layout, resolve_layout
from simexec.specs.plan import parse_plan, resolve

# Megatron-Bridge's DeepSeek-V3 layout (scripts/performance configs, `pp_layout="Et|(tt|)*30mL"`)
DSV3_LAYOUT = "Et|(tt|)*30mL"


def test_expand_repeats_as_megatron():
    # the docstring example of Megatron's parse_str_to_list
    assert expand_layout("Ettt|(tt|)*29,m|L") == ["Ettt"] + ["tt"] * 29 + ["m", "L"]
    assert expand_layout("Et*3|t") == ["Ettt", "t"]
    assert expand_layout("(|ab)*2,cd".replace("a", "t").replace("b", "t").replace("c", "m").replace("d", "L")) \
        == ["", "tt", "ttmL"]


def test_dsv3_layout_resolves():
    stages = resolve_layout(DSV3_LAYOUT, 16, 2, 61, 1)
    assert len(stages) == 32
    assert stages[0].embedding and stages[0].layers == (0,)
    assert all(len(s.layers) == 2 for s in stages[1:31])
    assert stages[31].layers == () and stages[31].head and stages[31].mtp == (0,)


@pytest.mark.parametrize("layout, pp, vpp, msg", [
    (DSV3_LAYOUT, 16, 1, "layout has 32 stages, pp*vpp = 16*1 = 16"),
    ("Et|(tt|)*29mL", 16, 2, "layout has 31 stages, pp*vpp = 16*2 = 32"),
    ("Et|(tt|)*30tmL", 16, 2, "layout places 62 transformer layers, the model has 61"),
    ("Et|(tt|)*30L", 16, 2, "layout places 0 MTP layers, the model has 1"),
    ("tE|(tt|)*30mL", 16, 2, "the first layer must be the embedding"),
    ("Et|(tt|)*30Lm", 16, 2, "the last layer must be the loss"),
    ("Et|(tt|)*30mx", 16, 2, "known layer characters"),
    ("Et|(tt|)*29tm|tL", 16, 2, "transformer layers must come before the MTP layers"),
])
def test_layout_errors(layout, pp, vpp, msg):
    with pytest.raises(PlanError, match=msg.replace("*", r"\*").replace("(", r"\(")):
        resolve_layout(layout, pp, vpp, 61, 1)


def test_layout_and_stages_exclusive():
    m = get_model("gpt-tiny")
    plan = parse_plan(f"pp=2,stages=1,{m.layers - 1},layout=E{'t' * m.layers}|L")
    with pytest.raises(PlanError, match="not both"):
        resolve(m, get_cluster("local"), plan)


def test_plan_string_round_trip_keeps_commas():
    p = parse_plan("pp=2,layout=Et,t|tL,mbs=1")
    assert p.layout == "Et,t|tL" and p.mbs == 1
    assert parse_plan(p.to_string()) == p


def test_stage_with_only_the_embedding_simulates():
    m = get_model("gpt-tiny")
    plan = f"pp=2,vpp=2,gbs=8,layout=E|{'t' * (m.layers // 2)}|{'t' * (m.layers - m.layers // 2)}|L"
    rp = resolve(m, get_cluster("local"), parse_plan(plan))
    assert rp.stage_layers[0] == () and rp.stage_layers[3] == ()
    r = simulate(m, "local", plan)
    assert r.step_time_s > 0


def test_dsv3_mtp_params_match_the_checkpoint():
    m = get_model("deepseek-v3").model_copy(update={"mtp_layers": 1})
    assert m.params / 1e9 == pytest.approx(671, abs=0.5)
    # the model card: 671B main model + 14B MTP module = 685B in the Hugging Face checkpoint, whose MTP
    # layer stores its own embedding and head
    assert m.checkpoint_params / 1e9 == pytest.approx(685, abs=1)
    assert m.mtp_params / 1e9 == pytest.approx(11.6, abs=0.1)


def test_dsv3_layout_simulates_with_mtp():
    m = get_model("deepseek-v3", seq_len=4096).model_copy(update={"mtp_layers": 1})
    c = get_cluster("dgx-h100").model_copy(update={"nodes": 32})
    r = simulate(m, c, f"tp=2,pp=16,vpp=2,ep=8,sp=1,mbs=1,gbs=128,layout={DSV3_LAYOUT}")
    assert r.step_time_s > 0


def test_mtp_costs_about_an_extra_block_and_head():
    m = get_model("moe-tiny", seq_len=2048)
    with_mtp = m.model_copy(update={"mtp_layers": 1})
    plan = "pp=2,gbs=8"
    base = simulate(m, "dgx-h100", plan).step_time_s
    mtp = simulate(with_mtp, "dgx-h100", plan).step_time_s
    assert mtp > base
    # FLOPs: one more block of the last layer's kind, a 2h->h projection and the head again
    extra = with_mtp.training_flops_per_token() - m.training_flops_per_token()
    assert extra == pytest.approx(3 * (m.layer_forward_flops_per_token(m.layers - 1) + m.lm_head_flops_per_token()
                                       + 4 * m.hidden ** 2))
    # the slowest stage (the head's) gains at most its own share plus the extra block and head, and at
    # least a sizeable part of them
    assert mtp - base < base
