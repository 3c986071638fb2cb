"""Plans: one test per validation rule (the message names the rule and the values), parsing of the
short string and of plan files, and the derived numbers (dp, micro-batches, stages, mesh, ZeRO
model states against the closed forms of the ZeRO paper)."""
import csv
import json
from pathlib import Path

import pytest

from simexec.specs.cluster import get_cluster
from simexec.errors import PlanError, SimexecError, SpecError
from simexec.specs.mesh import Mesh
from simexec.specs.model_presets import MODELS
from simexec.specs.plan import Plan, ResolvedPlan, balanced_stages, load_plan, parse_plan, resolve
from simexec.validation.published import DATA as PUBLISHED  # the published tables, sources inside

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"

TINY = MODELS["gpt-tiny"]  # 4 layers, 4 heads, 4 KV heads, FFN 256, seq 64, dense
MOE = MODELS["moe-tiny"]  # as TINY, with 4 experts of FFN 128


def ok(model, cluster: str, plan: str, **kw) -> ResolvedPlan:
    model = MODELS[model] if isinstance(model, str) else model
    return resolve(model, get_cluster(cluster), parse_plan(plan), **kw)


def refused(model, cluster: str, plan: str, *fragments: str, **kw) -> str:
    """Resolve must raise PlanError whose one-line message holds every fragment."""
    with pytest.raises(PlanError) as exc:
        ok(model, cluster, plan, **kw)
    msg = str(exc.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


# --- validation: one rule each ----------------------------------------------------------------------


def test_world_size_must_equal_dp_tp_cp_pp():
    # The example: 8 GPUs, but dp*tp = 6.
    refused("llama2-7b", "1xdgx-a100-80g", "dp=3,tp=2", "world size 8 != dp*tp*cp*pp = 3*2*1*1 = 6")


def test_world_size_must_be_divisible_when_dp_is_derived():
    refused("llama2-7b", "dgx-a100-80g", "tp=3", "world size 8 is not divisible by tp*cp*pp = 3*1*1 = 3")


def test_world_size_counts_every_axis():
    refused("llama2-7b", "dgx-h100", "dp=2,tp=2,cp=2,pp=2,gbs=8", "world size 8 != dp*tp*cp*pp = 2*2*2*2 = 16")


def test_heads_divisible_by_tp():
    refused(TINY, "local", "tp=8", "attention heads 4 not divisible by tp=8")


def test_kv_heads_divisible_by_tp():
    # Llama-2-70B: 64 query heads, 8 KV heads (GQA).
    refused("llama2-70b", "2xdgx-h100", "tp=16", "KV heads 8 not divisible by tp=16")


def test_ffn_divisible_by_tp():
    odd = TINY.model_copy(update={"ffn": 250})
    refused(odd, "local", "tp=4", "FFN size 250 not divisible by tp=4")


def test_expert_ffn_divisible_by_tp():
    odd = MOE.model_copy(update={"moe": MOE.moe.model_copy(update={"expert_ffn": 130})})
    refused(odd, "local", "tp=4", "expert FFN size 130 not divisible by tp=4")


def test_layers_divisible_by_pp():
    refused(TINY, "local", "pp=3", "layers 4 not divisible by pp*vpp = 3*1 = 3", "stages=")


def test_layers_divisible_by_pp_times_vpp():
    refused("llama2-7b", "dgx-h100", "pp=4,vpp=3,gbs=8", "layers 32 not divisible by pp*vpp = 4*3 = 12")


def test_stages_length_must_be_pp_times_vpp():
    refused(TINY, "local", "pp=2,stages=1,1,2", "stages has 3 entries, expected pp*vpp = 2*1 = 2")


def test_stages_must_sum_to_layers():
    refused(TINY, "local", "pp=2,stages=1,2", "stages sum to 3, but the model has 4 layers")


def test_stages_must_be_positive():
    refused(TINY, "local", "pp=2,stages=0,4", "stages 0,4", "at least one layer")


def test_stages_allow_a_split_pp_does_not_divide():
    rp = ok(TINY, "local", "pp=3,stages=1,2,1")
    assert rp.stage_layers == ((0,), (1, 2), (3,))


def test_balanced_stages_count_the_embedding_and_the_head_as_layers():
    assert balanced_stages(70, 12) == (5,) + (6,) * 10 + (5,)  # BLOOM-176B on DeepSpeed's partition
    assert balanced_stages(126, 16) == (7,) + (8,) * 14 + (7,)  # Llama 3 405B: one layer fewer at each end
    assert balanced_stages(80, 8) == (9, 10, 10, 10, 10, 11, 11, 9)  # the spare units go to later stages
    assert balanced_stages(4, 4) is None and balanced_stages(24, 1) is None  # an end stage would be empty
    for layers in range(1, 60):
        for n in range(2, layers + 1):
            split = balanced_stages(layers, n)
            if split is not None:
                units = [c + (i == 0) + (i == n - 1) for i, c in enumerate(split)]
                assert sum(split) == layers and min(split) >= 1 and max(units) - min(units) <= 1


def test_all_to_all_context_parallelism_splits_each_tp_ranks_heads_over_cp():
    # Llama 3 8B: 32 query heads, 8 KV heads; cp_impl=a2a gives each cp rank a cp-th of a tp rank's heads
    ok("llama3-8b", "1xdgx-h100", "tp=2,cp=4,cp_impl=a2a,gbs=8")
    refused("llama3-8b", "2xdgx-h100", "tp=8,cp=2,cp_impl=a2a,gbs=8",
            "KV heads per tp rank 8/8 = 1 not divisible by cp=2", "cp_impl=allgather or ring")
    refused(TINY, "local", "cp=8,cp_impl=a2a,gbs=1", "attention heads per tp rank 4/1 = 4 not divisible by cp=8")
    ok(TINY, "local", "cp=4,cp_impl=ring,gbs=1")  # the other exchanges do not split heads


def test_gbs_divisible_by_mbs_times_dp():
    refused(TINY, "local", "dp=4,gbs=10", "global batch 10 not divisible by mbs*dp = 1*4 = 4")
    refused(TINY, "local", "dp=2,mbs=2,gbs=6", "global batch 6 not divisible by mbs*dp = 2*2 = 4")


def test_experts_divisible_by_ep():
    refused(MOE, "local", "dp=3,ep=3", "experts 4 not divisible by ep=3")


def test_ep_on_dense_model():
    refused(TINY, "local", "dp=2,ep=2", "ep=2 on dense model gpt-tiny")


def test_ep_must_divide_dp():
    refused(MOE, "local", "dp=2,ep=4", "ep=4 does not divide dp=2")


def test_sp_needs_tp():
    refused(TINY, "local", "dp=2,sp=1", "sp=1 needs tp > 1")


def test_sequence_divisible_by_tp_with_sp():
    refused(TINY, "local", "tp=4,sp=1", "sequence length 66 not divisible by tp=4 (needed by sp)", seq_len=66)
    ok(TINY, "local", "tp=4,sp=0", seq_len=66)  # without sp the sequence is not split


def test_sequence_divisible_by_two_cp():
    refused(TINY, "local", "cp=2", "sequence length 66 not divisible by 2*cp = 4", seq_len=66)
    ok(TINY, "local", "cp=2", seq_len=68)


def test_cp_chunk_divisible_by_tp_with_sp():
    refused(TINY, "local", "tp=4,cp=2,sp=1", "sequence chunk 34 per cp rank not divisible by tp=4", seq_len=68)


def test_vpp_needs_interleaved_schedule():
    refused(TINY, "local", "pp=2,vpp=2,schedule=1f1b", "vpp=2 needs schedule=interleaved-1f1b, interleaved-zb, zb-v or dualpipev, got 1f1b")


def test_interleaved_schedule_needs_vpp():
    refused(TINY, "local", "pp=2,schedule=interleaved-1f1b", "interleaved-1f1b needs vpp >= 2")


def test_interleaved_schedule_needs_pp():
    refused(TINY, "local", "vpp=2", "interleaved-1f1b needs pp >= 2")


def test_interleaving_with_too_few_micro_batches():
    refused("llama2-7b", "dgx-h100", "dp=2,pp=4,vpp=2,gbs=4", "at least pp=4 micro-batches, got 2")


def test_interleaving_with_indivisible_micro_batches():
    refused("llama2-7b", "dgx-h100", "dp=2,pp=4,vpp=2,gbs=12", "micro-batches (6) divisible by pp=4")
    ok("llama2-7b", "dgx-h100", "dp=2,pp=4,vpp=2,gbs=16")


def test_zero_bubble_needs_a_pipeline_and_refuses_what_its_deferred_weight_passes_cannot_hold():
    refused(TINY, "local", "dp=2,schedule=zb-h1", "schedule=zb-h1 needs pp >= 2")
    refused(TINY, "local", "dp=2,pp=2,zero=3,gbs=4,schedule=zb-h1", "does not run with zero=3")
    refused(TINY, "local", "tp=2,sp=1,pp=2,gbs=4,schedule=zb-h1", "does not run with sp=1")
    refused(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=zb-h1", "vpp=2 needs schedule=interleaved-1f1b")
    assert ok(TINY, "local", "dp=2,pp=2,zero=2,gbs=4,schedule=zb-h1").plan.schedule_name == "zb-h1"
    refused(TINY, "local", "pp=2,gbs=4,schedule=interleaved-zb", "schedule=interleaved-zb needs vpp >= 2")
    refused(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=interleaved-zb,p2p_overlap=0", "needs p2p_overlap=1")
    refused(TINY, "local", "dp=2,pp=2,vpp=2,zero=3,gbs=8,schedule=interleaved-zb", "does not run with zero=3")
    assert ok(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=interleaved-zb").plan.schedule_name == "interleaved-zb"


def test_zb_v_holds_two_chunks_per_rank_in_a_v_and_the_head_on_the_first_rank():
    refused(TINY, "local", "pp=2,gbs=4,schedule=zb-v", "schedule=zb-v needs vpp=2")
    refused(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=zb-v,p2p_overlap=0", "needs p2p_overlap=1")
    refused(TINY, "local", "dp=2,pp=2,vpp=2,zero=3,gbs=8,schedule=zb-v", "does not run with zero=3")
    refused(TINY, "local", "tp=2,sp=1,pp=2,vpp=2,gbs=4,schedule=zb-v", "does not run with sp=1")
    rp = ok(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=zb-v")
    assert [rp.stages_of_pp_rank(r) for r in range(2)] == [(0, 3), (1, 2)]
    assert [rp.place(vs) for vs in range(4)] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert rp.head_pp_rank == 0 and ok(TINY, "local", "pp=2,vpp=2,gbs=4").head_pp_rank == 1
    # the first rank holds the embedding and the head, the last two middle stages
    params = [rp.params_on_pp_rank(r)["dense"] for r in range(2)]
    m = rp.model
    assert params[0] - params[1] == pytest.approx(m.embedding_params() + m.lm_head_params() + m.final_norm_params())


def test_dualpipev_takes_the_v_and_at_least_two_micro_batches_per_stage():
    refused(TINY, "local", "pp=2,vpp=2,gbs=3,schedule=dualpipev", "dualpipev needs at least 2*pp = 4 micro-batches, got 3")
    refused(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=dualpipev,p2p_overlap=0", "needs p2p_overlap=1")
    refused(TINY, "local", "pp=2,gbs=8,schedule=dualpipev", "schedule=dualpipev needs vpp=2")
    assert ok(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=dualpipev").head_pp_rank == 0
    refused(TINY, "local", "pp=2,vpp=2,gbs=4,schedule=zb-v,dualpipe_overlap=1", "dualpipe_overlap=1 needs schedule=dualpipev, got zb-v")


def test_tp_overlap_needs_tp_and_a_whole_backward():
    refused(TINY, "local", "dp=2,tp_overlap=1", "tp_overlap=1 needs tp > 1, got tp=1")
    refused(TINY, "local", "tp=2,pp=2,gbs=4,schedule=zb-h1,tp_overlap=1",
            "tp_overlap=1 does not run with schedule=zb-h1")
    assert ok(TINY, "local", "tp=2,sp=1,pp=2,gbs=4,tp_overlap=1").plan.tp_overlap


def test_zero_impl_needs_zero3():
    refused(TINY, "local", "dp=2,zero=2,zero_impl=yafsdp", "zero_impl=yafsdp needs zero=3, got zero=2")
    assert ok(TINY, "local", "dp=2,zero=3,zero_impl=yafsdp").plan.zero3.name == "yafsdp"


def test_grad_allreduce_needs_zero1():
    for zero in (0, 2, 3):
        refused(TINY, "local", f"dp=2,zero={zero},grad_allreduce=1", f"grad_allreduce=1 needs zero=1, got zero={zero}")
    assert ok(TINY, "local", "dp=2,zero=1,grad_allreduce=1").plan.grad_allreduce


def test_param_overlap_needs_zero1_or_2():
    for zero in (0, 3):
        refused(TINY, "local", f"dp=2,zero={zero},param_overlap=1", f"param_overlap=1 needs zero=1 or 2, got zero={zero}")
    assert ok(TINY, "local", "dp=2,zero=2,param_overlap=1").plan.param_overlap


def test_dp_shard_needs_zero():
    refused(TINY, "local", "dp=4,dp_shard=2", "dp_shard=2 (HSDP) needs zero >= 1")


def test_dp_shard_must_divide_dp():
    refused(TINY, "local", "dp=4,zero=3,dp_shard=3", "dp_shard=3 does not divide dp=4")


def test_dp_shard_divisible_by_ep():
    refused(MOE, "local", "dp=4,ep=4,zero=1,dp_shard=2", "dp_shard=2 not divisible by ep=4")


def test_offload_params_needs_zero3():
    refused(TINY, "local", "dp=2,zero=1,offload=optimizer+params", "offload=optimizer+params needs zero=3, got zero=1")
    ok(TINY, "local", "dp=2,zero=3,offload=optimizer+params")


def test_recompute_layers_needs_recompute():
    refused(TINY, "local", "recompute_layers=1", "recompute_layers=1 needs recompute=selective, full or op")


def test_dynamic_loss_scaling_needs_an_initial_scale():
    refused(TINY, "local", "loss_scale_window=1000", "loss_scale_window=1000 (dynamic loss scaling) needs an initial loss_scale > 0")
    refused(TINY, "local", "loss_scale=1024,loss_scale_hysteresis=1", "loss_scale_hysteresis=1 needs dynamic loss scaling")
    ok(TINY, "local", "loss_scale=65536,loss_scale_window=1000,loss_scale_hysteresis=1")


def test_recompute_layers_at_most_the_smallest_stage():
    refused(TINY, "local", "pp=2,recompute=full,recompute_layers=3", "recompute_layers=3 exceeds the 2 layers")
    refused(TINY, "local", "pp=2,stages=1,3,recompute=full,recompute_layers=2", "recompute_layers=2 exceeds the 1 layers")
    ok(TINY, "local", "pp=2,recompute=full,recompute_layers=2")


def test_fp8_refused_on_a100():
    refused("llama2-7b", "dgx-a100-80g", "dp=8,dtype=fp8", "dtype=fp8 not supported by A100-SXM4-80GB", "bf16")


def test_fp8_allowed_on_h100_and_h200():
    assert ok("llama2-7b", "dgx-h100", "dp=8,dtype=fp8").plan.dtype == "fp8"
    assert ok("llama2-7b", "hgx-h200", "dp=8,dtype=fp8").plan.dtype == "fp8"


def test_sequence_length_must_be_positive():
    refused(TINY, "local", "dp=1", "sequence length must be positive, got 0", seq_len=0)


def test_sequence_within_learned_position_table():
    fixed = TINY.model_copy(update={"max_positions": 64})
    refused(fixed, "local", "dp=1", "sequence length 128 exceeds the learned position table", "64", seq_len=128)
    ok(TINY, "local", "dp=1", seq_len=128)  # no fixed table: positions grow with the sequence


def test_every_refusal_is_a_simexec_error():
    assert issubclass(PlanError, SimexecError) and issubclass(SpecError, SimexecError)


# --- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,value", [("1", True), ("0", False), ("true", True), ("false", False), ("TRUE", True)])
def test_booleans(text, value):
    assert parse_plan(f"tp=2,sp={text}").sp is value
    assert parse_plan(f"flash_attention={text}").flash_attention is value


def test_boolean_refuses_other_words():
    with pytest.raises(PlanError, match="sp must be 1/0/true/false, got 'yes'"):
        parse_plan("tp=2,sp=yes")


def test_stages_take_the_rest_of_the_integers():
    p = parse_plan("pp=4,stages=7,9,9,7,gbs=64")
    assert p.stages == (7, 9, 9, 7) and p.gbs == 64 and p.pp == 4
    assert parse_plan("pp=2, stages = 1, 3").stages == (1, 3)


def test_stages_refuse_non_integers():
    with pytest.raises(PlanError, match="stages takes integers, got 'x'"):
        parse_plan("pp=2,stages=1,x")


def test_bare_value_outside_stages():
    with pytest.raises(PlanError, match="expected key=value, got '3'"):
        parse_plan("dp=2,3")


def test_unknown_key():
    with pytest.raises(PlanError, match="unknown key 'dq'"):
        parse_plan("dq=2")


@pytest.mark.parametrize("text,key", [("dp=2,dp=4", "dp"), ("pp=2,stages=2,2,stages=1,3", "stages")])
def test_duplicate_key(text, key):
    with pytest.raises(PlanError, match=f"{key} given twice"):
        parse_plan(text)


@pytest.mark.parametrize("text,key", [
    ("tp=two", "tp"), ("tp=0", "tp"), ("mbs=1.5", "mbs"), ("zero=4", "zero"), ("schedule=zigzag", "schedule"),
    ("dtype=int4", "dtype"), ("rank_order=tp-dp-pp", "rank_order"), ("bucket_mb=inf", "bucket_mb"),
    ("offload=all", "offload"),
])
def test_bad_value_names_the_key(text, key):
    with pytest.raises(PlanError) as exc:
        parse_plan(text)
    msg = str(exc.value)
    assert key in msg and "\n" not in msg


def test_yaml_and_json_plan_files(tmp_path):
    want = parse_plan("tp=4,sp=1,pp=4,stages=7,9,9,7,zero=1,gbs=64,recompute=selective")
    y = tmp_path / "p.yaml"
    y.write_text("tp: 4\nsp: true\npp: 4\nstages: [7, 9, 9, 7]\nzero: 1\ngbs: 64\nrecompute: selective\n")
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"tp": 4, "sp": 1, "pp": 4, "stages": [7, 9, 9, 7], "zero": 1, "gbs": 64,
                             "recompute": "selective"}))
    assert load_plan(str(y)) == want
    assert load_plan(str(j)) == want
    assert load_plan("tp=4,sp=1,pp=4,stages=7,9,9,7,zero=1,gbs=64,recompute=selective") == want


@pytest.mark.parametrize("name,text,error,fragment", [
    ("bad.yaml", "tp: [4\n", SpecError, "not valid YAML"),
    ("bad.json", "{tp: 4}", SpecError, "not valid JSON"),
    ("list.yaml", "- tp: 4\n", SpecError, "must hold a mapping"),
    ("unknown.yaml", "tp: 4\nfoo: 1\n", PlanError, "foo"),
    ("type.json", '{"tp": "four"}', PlanError, "tp"),
    ("stages.yaml", "pp: 2\nstages: [1, x]\n", PlanError, "stages"),
])
def test_bad_plan_file_is_one_line(tmp_path, name, text, error, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(error) as exc:
        load_plan(str(path))
    msg = str(exc.value)
    assert fragment in msg and "\n" not in msg
    assert str(path) in msg


def test_missing_plan_file():
    with pytest.raises(SpecError, match="not found"):
        load_plan("/nonexistent/plan.yaml")


@pytest.mark.parametrize("text", [
    "", "dp=2,tp=4,pp=2,zero=1,mbs=1,gbs=64", "tp=2,sp=1,flash_attention=0", "pp=4,vpp=2,stages=4,4,4,4,4,4,4,4",
    "zero=3,zero_impl=yafsdp,dp_shard=2,offload=optimizer+params", "bucket_mb=25.123456789", "bucket_mb=0.5",
    "rank_order=dp-tp-cp-pp,cp=2,cp_impl=ring", "recompute=full,recompute_layers=0,dtype=fp8,schedule=gpipe",
])
def test_to_string_round_trips(text):
    p = parse_plan(text)
    assert parse_plan(p.to_string()) == p
    assert str(p) == p.to_string()


def test_default_plan_round_trips_with_dp_derived():
    assert parse_plan(Plan().to_string()) == Plan()
    assert parse_plan(Plan().to_string()).dp is None


# --- derived numbers -------------------------------------------------------------------------------


def test_dp_derived_from_world_size():
    rp = ok("llama2-7b", "4xdgx-h100", "tp=8,mbs=2,gbs=64")
    assert rp.world == 32 and rp.dp == 4 and rp.plan.dp == 4
    assert rp.micro_batches == 64 // (2 * 4)


def test_default_gbs_gives_pp_micro_batches():
    rp = ok("llama2-7b", "dgx-h100", "dp=2,pp=4,mbs=2")
    assert rp.plan.gbs == 2 * 2 * 4 and rp.micro_batches == 4


def test_uneven_stages():
    rp = ok("llama3-8b", "dgx-h100", "dp=2,pp=4,stages=7,9,9,7,gbs=8")
    assert [len(s) for s in rp.stage_layers] == [7, 9, 9, 7]
    assert rp.stage_layers[1][0] == 7 and rp.stage_layers[3][-1] == 31
    assert rp.layers_of_pp_rank(3) == tuple(range(25, 32))


def test_interleaved_stages_of_pp_rank():
    rp = ok("llama2-7b", "dgx-h100", "dp=2,pp=4,vpp=2,gbs=16")
    assert rp.virtual_stages == 8 and all(len(s) == 4 for s in rp.stage_layers)
    assert rp.stages_of_pp_rank(0) == (0, 4) and rp.stages_of_pp_rank(3) == (3, 7)
    assert rp.layers_of_pp_rank(0) == (0, 1, 2, 3, 16, 17, 18, 19)
    assert sorted(l for r in range(4) for l in rp.layers_of_pp_rank(r)) == list(range(32))


def test_mesh_tp_fastest_by_default():
    rp = ok(TINY, "local", "tp=2,dp=2,pp=2")
    m = rp.mesh
    assert m.world == 8 and rp.cluster.world_size == 8
    assert m.coords(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert m.group(0, "tp") == (0, 1)
    assert m.group(0, "dp") == (0, 2)
    assert m.group(0, "pp") == (0, 4)
    assert m.group(5, "dp") == (5, 7)


@pytest.mark.parametrize("order,groups", [
    ("dp-tp-cp-pp", {"dp": (0, 1), "tp": (0, 2), "pp": (0, 4)}),
    ("pp-dp-tp-cp", {"pp": (0, 1), "dp": (0, 2), "tp": (0, 4)}),
    ("tp-cp-pp-dp", {"tp": (0, 1), "pp": (0, 2), "dp": (0, 4)}),
])
def test_mesh_rank_order_variants(order, groups):
    m = ok(TINY, "local", f"tp=2,dp=2,pp=2,rank_order={order}").mesh
    for axis, g in groups.items():
        assert m.group(0, axis) == g


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "dp-pp-tp-cp", "cp-pp-dp-tp"])
def test_mesh_coords_invert_and_groups_partition(order):
    m = Mesh(sizes={"tp": 2, "cp": 2, "dp": 3, "pp": 2}, order=tuple(order.split("-")))
    assert sorted(m.rank(**m.coords(r)) for r in range(m.world)) == list(range(m.world))
    for axis in ("tp", "cp", "dp", "pp"):
        groups = {m.group(r, axis) for r in range(m.world)}
        assert sorted(r for g in groups for r in g) == list(range(m.world))
        assert all(len(g) == m.sizes[axis] for g in groups)


# --- ZeRO model states -----------------------------------------------------------------------------

ZERO_FORMS = {  # bytes per parameter on a rank, Ψ = params on the rank, N = dp (ZeRO SC'20 Fig. 1)
    0: lambda n: 16.0,
    1: lambda n: 4 + 12 / n,
    2: lambda n: 2 + 14 / n,
    3: lambda n: 16 / n,
}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_bytes_match_zero_closed_forms(zero):
    n = 4
    rp = ok(TINY, "local", f"dp={n},zero={zero}")
    psi = rp.params_on_pp_rank(0)["total"]
    assert psi == TINY.params  # pp = tp = 1: every parameter is on the rank
    states = rp.model_state_bytes(0)
    assert sum(states.values()) == pytest.approx(ZERO_FORMS[zero](n) * psi)
    assert states["params"] == pytest.approx((2 / n if zero == 3 else 2) * psi)


def test_hsdp_shards_over_dp_shard():
    rp = ok(TINY, "local", "dp=8,zero=3,dp_shard=2")
    assert rp.zero_group_size == 2
    assert sum(rp.model_state_bytes(0).values()) == pytest.approx(16 / 2 * TINY.params)


def test_zero_paper_figure_1_reproduced():
    """7.5B parameters on N_d = 64: 120, 31.4, 16.6, 1.9 GB (the published CSV)."""
    rows = [r for r in csv.reader(l for l in (PUBLISHED / "zero_sc20_model_states.csv").open() if not l.startswith("#"))]
    table = {int(r[0]): float(r[2]) for r in rows[1:]}
    assert set(table) == {0, 1, 2, 3}
    model = MODELS["megatron-7.5b"]  # 7.5B class, dense
    for zero, published in table.items():
        rp = ok(model, "8xdgx-a100-80g", f"dp=64,zero={zero},gbs=64")
        psi = rp.params_on_pp_rank(0)["total"]
        per_param = sum(rp.model_state_bytes(0).values()) / psi
        assert per_param == pytest.approx(ZERO_FORMS[zero](64))
        assert per_param * 7.5e9 / 1e9 == pytest.approx(published, abs=0.05)


# --- the example plan in the docs ------------------------------------------------------------------


def test_example_plan_file_resolves():
    rp = resolve(MODELS["llama3-8b"], get_cluster(str(EXAMPLES / "cluster.yaml")), load_plan(str(EXAMPLES / "plan.yaml")))
    assert rp.world == 32 and rp.dp == 2 and rp.micro_batches == 32
    assert [len(s) for s in rp.stage_layers] == [7, 9, 9, 7]


def test_plan_doc_names_every_field():
    text = (ROOT / "docs" / "plan.md").read_text()
    missing = [f for f in Plan.model_fields if f"`{f}`" not in text]
    assert not missing, f"docs/plan.md does not describe {missing}"
