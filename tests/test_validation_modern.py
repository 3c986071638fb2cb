"""scripts/validate_modern.py and simexec.validation.modern: the one rule mapping a published modern run
to a simexec model, cluster, stack and plan; the unit conversion; refused rows; and one small row end to end."""
import subprocess
import sys
import json
from pathlib import Path

import pytest

from simexec.specs.cluster import get_cluster
from simexec.specs.model_presets import MODELS
from simexec.validation import modern, sharded_dp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows():
    return {r["name"]: r for r in modern.read_rows()}


def test_megatron_core_row_maps_to_the_distributed_optimizer_and_tp_overlap(rows):
    r = rows["mb2511-h100-llama3-70b-fp8cs-64"]
    m = modern.map_row(r)
    # Megatron-Bridge's performance configurations keep bf16 gradient buffers (grad_reduce_in_fp32 off)
    assert m.plan == ("tp=4,sp=1,pp=8,vpp=5,zero=1,gbs=128,dtype=fp8,tp_overlap=1,tp_async=1,fp8_param_gather=1,"
                      "param_overlap=1")
    assert m.model is MODELS["llama3-70b"] and m.cluster.name == "8xdgx-h100" and m.cluster.world_size == 64
    assert m.stack.name == "megatron-core" and m.stack.fp8.scaling == "current"  # the row's FP8-CS recipe
    assert modern.families(r) == [modern.SUPERSEDED]  # 26.04.01 measured it again, at gbs 256
    assert set(modern.families(rows[r["superseded_by"]])) == {"fp8", "tp", "pp", "h100"}


def test_torchtitan_cp_row_maps_to_fsdp2_allgather_cp_on_the_500w_hbm2e_parts(rows):
    r = rows["tt2412-h100-llama31-8b-cp2-64k"]
    m = modern.map_row(r)
    assert m.plan == "cp=2,zero=3,gbs=4,recompute=full,dtype=fp8,grad_fp32=1"  # cp_impl allgather is the default
    assert m.seq_len == 65536 and m.stack.name == "torchtitan-compile" and m.stack.fp8.scaling == "current"
    assert m.cluster.device.memory_bw == 2.4e12 and m.cluster.world_size == 8
    assert m.cluster.device.peak_flops["bf16"] < 0.75 * get_cluster("dgx-h100").device.peak_flops["bf16"]
    assert "long-context" in modern.families(r) and "fsdp" in modern.families(r)


def test_gb200_moe_row_maps_to_trays_and_a_built_model(rows):
    r = rows["mb2511-gb200-qwen3-235b-bf16-256"]
    m = modern.map_row(r)
    # 94 layers on 8 x 3 virtual stages: the embedding and the loss count as a layer each
    assert m.plan == (
        "pp=8,vpp=3,ep=32,moe_dispatcher=deepep,zero=1,gbs=8192,param_overlap=1,stages=3," + "4," * 22 + "3")
    # 256 GPUs: Slurm's --segment 16 puts 16 trays (64 GPUs) in each NVLink domain; 8 GPUs: one rack
    assert m.cluster.nodes == 64 and m.cluster.world_size == 256 and m.cluster.node.nvlink_domain_gpus == 64
    assert modern.map_row(rows["mb2511-gb200-qwen3-30b-mxfp8-8"]).cluster.node.nvlink_domain_gpus == 72
    assert m.model.head_dim == 128 and m.model.qk_norm and m.model.moe.experts == 128 and m.model.moe.top_k == 8
    assert m.model.moe.expert_ffn == 1536 and m.model.moe.capacity_factor is None and not m.model.tied_embeddings


def test_megatron_fsdp_and_block_recompute(rows):
    m = modern.map_row(rows["mb2511-h100-llama3-8b-fp8cs-fsdp-8"])
    assert m.plan == "zero=3,gbs=128,recompute=full,recompute_layers=5,dtype=fp8,fp8_param_gather=1"
    assert modern.recompute_fields("selective:mla_up_proj") == {"recompute": "selective",
                                                                "recompute_modules": ("mla_up_proj",)}
    assert modern.recompute_fields("selective:mla_up_proj,mlp")["recompute_modules"] == ("mla_up_proj", "mlp")
    assert modern.recompute_fields("selective:core_attn") == {"recompute": "selective"}


def test_unit_conversion():
    base = {"gbs": "128", "seq_len": "8192", "gpus": "8", "source": "x:y", "dtype": "bf16", "device": "h100",
            "stack": "megatron-core"}
    assert modern.measured_step_s({**base, "metric": "step_s", "value": "12.5"}) == 12.5
    assert modern.measured_step_s({**base, "metric": "tokens_per_s_per_gpu", "value": "16384"}) == pytest.approx(8.0)
    with pytest.raises(modern.NotComparable):
        modern.measured_step_s({**base, "metric": "tflops_per_gpu", "value": "400"})
    modern.FLOP_COUNTS["x"] = lambda r: 8e15
    try:
        assert modern.measured_step_s({**base, "metric": "tflops_per_gpu", "value": "500"}) == pytest.approx(2.0)
        peak = 989e12  # dgx-h100 bf16 dense peak
        assert modern.measured_step_s({**base, "metric": "mfu", "value": "0.5"}) == pytest.approx(
            8e15 / (0.5 * peak * 8), rel=0.02)
    finally:
        del modern.FLOP_COUNTS["x"]


def test_refused_and_not_comparable_rows_are_kept_out_of_the_statistics(rows):
    # an MoE row whose experts fold onto their own mesh (etp 1 under tp 4) maps to a folded plan
    assert "etp=1" in modern.map_row(rows["dgxc25051-h100-grok1-bf16-512"]).plan
    # 64 virtual stages for 32 layers: no split leaves every middle stage a layer
    grok = modern.predict_row({**rows["mb2511-gb200-llama3-8b-fp8cs-8"], "gpus": "16", "pp": "16", "vpp": "4"})
    assert grok["status"] == "refused" and "not divisible by pp*vpp" in grok["reason"] and grok["error"] is None
    paper = modern.predict_row(rows["llama3paper-h100-405b-8k-gpus"])
    assert paper["status"] == "not comparable"
    ok = {"status": "ok", "error": 0.1, "families": ["h100"]}
    s = modern.summary([grok, paper, ok])
    assert s["rows"] == 1 and s["refused"] == 1 and s["not_comparable"] == 1 and s["median_error"] == 0.1


def test_superseded_rows_are_summarised_apart():
    r = {"superseded_by": "newer-row", "dtype": "fp8", "seq_len": "4096", "tp": "2", "pp": "1", "cp": "1",
         "fsdp": "0", "moe_experts": "", "device": "h100"}
    assert modern.families(r) == [modern.SUPERSEDED]
    assert "tp" in modern.families({**r, "superseded_by": ""})
    old = {"status": "ok", "error": -0.6, "families": [modern.SUPERSEDED]}
    current = [{"status": "ok", "error": e, "families": ["h100"]} for e in (0.1, -0.05)]
    s = modern.summary([old] + current)
    assert s["rows"] == 2 and s["superseded"] == 1 and s["median_abs_error"] == pytest.approx(0.075)
    assert s["families"][modern.SUPERSEDED]["rows"] == 1 and s["families"]["h100"]["rows"] == 2
    assert "1 superseded apart" in modern.summary_lines(s)[0]


def test_mlperf_gpt3_rows_map_to_the_submission_plan_and_form_scale_out_series(rows):
    r = rows["mlperf31-eos-gpt3-175b-10752"]
    m = modern.map_row(r)
    assert m.plan == ("tp=4,sp=1,pp=8,vpp=12,zero=1,gbs=2688,dtype=fp8,tp_overlap=1,tp_async=1,grad_fp32=1,"
                      "param_overlap=1")  # dp = 10752 / 32 = 336: 8 micro-batches, as the result log's GA
    assert m.model is MODELS["gpt3-175b"] and m.cluster.world_size == 10752 and m.stack.fp8.scaling == "delayed"
    assert set(modern.families(r)) == {"fp8", "tp", "pp", modern.SCALE_OUT, "h100"}
    series = {}
    for row in rows.values():
        if row["series"] and not row["superseded_by"]:
            series.setdefault(row["series"], set()).add(int(row["gpus"]))
    assert series["mlperf31-eos-gpt3"] == {512, 768, 4096, 6144, 8192, 10240, 10752}
    assert all(len(gpus) >= 2 for gpus in series.values())


def test_only_series_families_report_a_trend():
    def row(gpus, pred, meas, fams):
        return {"series": "s", "status": "ok", "gpus": gpus, "gbs": gpus, "seq_len": 1, "predicted_s": pred,
                "measured_s": meas, "error": pred / meas - 1, "families": fams}

    s = modern.summary([row(8, 1.0, 1.0, [modern.SCALE_OUT, "h100"]), row(16, 1.1, 1.2, [modern.SCALE_OUT, "h100"])])
    assert s["families"][modern.SCALE_OUT]["trend"]["steps"] == 1 and "trend" not in s["families"]["h100"]


def test_moe_dispatcher_and_overlap_columns_become_plan_knobs():
    assert modern.moe_fields({"name": "r"}) == {"moe_dispatcher": "alltoall"}
    assert modern.moe_fields({"name": "r", "moe_dispatcher": "hybridep", "moe_a2a_overlap": "1"}) == {
        "moe_dispatcher": "deepep", "moe_a2a_overlap": True}
    with pytest.raises(modern.SpecError, match="moe_dispatcher 'nccl'"):
        modern.moe_fields({"name": "r", "moe_dispatcher": "nccl"})


def test_tp_overlap_and_capacity_columns(rows):
    """NeMo 25.04's DeepSeek-V3 script turns TP overlap off and drops tokens at capacity 1.0 (the columns)."""
    r = rows["dgxcnew-h100-dsv3-bf16-512"]
    m = modern.map_row(r)
    assert "tp_overlap" not in m.plan and "tp_async" not in m.plan and m.model.moe.capacity_factor == 1.0
    assert m.plan.split("layout=")[1].startswith("Ettttttt|") and m.plan.endswith("|ttttttL")
    on = modern.map_row(dict(r, tp_overlap="", moe_capacity=""))
    assert "tp_overlap=1" in on.plan and on.model.moe.capacity_factor is None


def test_script_end_to_end_on_one_small_row(tmp_path):
    out, md = tmp_path / "out.json", tmp_path / "v.md"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_modern.py"), "--only",
                          "mb2511-b200-llama3-8b-fp8cs-8", "--json", str(out), "--markdown", str(md)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    (r,) = data["rows"]
    assert r["name"] == "mb2511-b200-llama3-8b-fp8cs-8" and r["status"] == "ok" and r["cluster"] == "1xhgx-b200"
    assert r["measured_s"] == pytest.approx(128 * 8192 / (30624 * 8))
    assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
    assert data["summary"]["rows"] == 1 and "b200" in data["summary"]["families"]
    text = md.read_text()
    assert modern.BEGIN in text and modern.END in text and "mb2511-b200-llama3-8b-fp8cs-8" in text
    assert "mb2511-b200-llama3-8b-fp8cs-8" in run.stdout


# --- the sharded-dp family (simexec.validation.sharded_dp, data/sharded_dp_runs.csv) ---------------------------

@pytest.fixture(scope="module")
def sdp_rows():
    return {r["name"]: r for r in sharded_dp.read_rows()}


def test_sharded_dp_rows_map_by_stack(sdp_rows):
    m = sharded_dp.map_row(sdp_rows["megsc21-zero3-174.6b-384"])
    assert m.plan == "zero=3,zero_impl=deepspeed-2021,mbs=4,gbs=1536,recompute=full,dtype=fp16"
    assert m.stack.name == "deepspeed" and m.cluster.name == "48xdgx-a100-80g"
    assert (m.model.layers, m.model.hidden, m.model.vocab) == (96, 12288, 51200) and m.model.bias
    default = sharded_dp.map_row(sdp_rows["mpt-h100-7b-128"])  # Composer's DEFAULT mixed precision reduces in fp32
    assert default.plan == f"zero=3,zero_impl={sharded_dp.FSDP1_IMPL},mbs=6,gbs=768,grad_fp32=1"
    assert default.stack.cross_entropy == "compiled" and default.cluster.name == "16xdgx-h100"
    pure = sharded_dp.map_row(sdp_rows["mpt-a100-40-7b-8"])  # PURE reduces in bf16
    assert "grad_fp32" not in pure.plan and pure.cluster.name == "1xdgx-a100-40g"
    assert sharded_dp.map_row(sdp_rows["mpt-h100-3b-128"]).plan == "zero=2,mbs=8,gbs=1024,grad_fp32=1"
    ya = sharded_dp.map_row(sdp_rows["yafsdp-yafsdp-l2-70b-s2048-256"])
    assert ya.plan == "zero=3,zero_impl=yafsdp,gbs=256,recompute=full,recompute_layers=10"
    assert ya.stack.name == "torchtitan" and ya.model is MODELS["llama2-70b"]
    tt = sharded_dp.map_row(sdp_rows["tt2404-a100-llama3-8b-selective-layer-mbs1-64"])
    assert tt.plan == "zero=3,zero_impl=fsdp,gbs=64,recompute=full,recompute_layers=16,grad_fp32=1"
    cl = sharded_dp.row_model(sdp_rows["yafsdp-yafsdp-cl-34b-s2048-128"])
    assert (cl.kv_heads, cl.ffn, cl.vocab, cl.gated, cl.norm) == (8, 22016, 32000, True, "rmsnorm")


def test_mpt_models_count_the_published_parameters(sdp_rows):
    for r in sdp_rows.values():
        if r["model"].startswith("mpt-"):
            assert sharded_dp.row_model(r).params == sharded_dp.num_params_in_notes(r), r["name"]


def test_network_column_overrides_the_preset_nics():
    base = get_cluster("2xdgx-a100-80g")
    assert sharded_dp.with_network(base, "8x200:roce") is base and sharded_dp.with_network(base, "unstated") is base
    four = sharded_dp.with_network(base, "4x100:efa")
    assert four.network.nics_per_node == 4 and four.network.nic_bw == 12.5e9


def test_flop_counts_reproduce_the_published_mfu(sdp_rows):
    """llmf-mfu and torchtitan-6n, as the header states them, give back each row's MFU (its notes) from its
    tokens/s; megatron-eq3 turns TFLOP/s into a step time."""
    import re

    checked = 0
    for r in sdp_rows.values():
        mfu = re.search(r"MFU ([\d.]+)%", r["notes"])
        if r["flop_count"] in ("llmf-mfu", "torchtitan-6n") and mfu:
            step = sharded_dp.measured_step_s(r)
            peak = sharded_dp.MFU_PEAKS[r["device"]]
            got = sharded_dp.FLOP_COUNTS[r["flop_count"]](r) / (step * int(r["gpus"]) * peak)
            assert got == pytest.approx(float(mfu.group(1)) / 100, rel=0.01), r["name"]
            checked += 1
    assert checked >= 60
    r = sdp_rows["megsc21-zero3-174.6b-384"]
    assert sharded_dp.measured_step_s(r) == pytest.approx(
        sharded_dp.megatron_eq3(r) / (144e12 * 384)) == pytest.approx(81.58, rel=1e-3)


def test_trend_counts_per_gpu_throughput_steps():
    def row(gpus, pred, meas, series="s"):
        return {"series": series, "status": "ok", "gpus": gpus, "gbs": gpus, "seq_len": 1, "predicted_s": pred,
                "measured_s": meas}

    # throughput per GPU = 1 / step here: predicted falls then rises, published falls twice
    t = sharded_dp.trend([row(8, 1.0, 1.0), row(16, 1.1, 1.2), row(32, 1.05, 1.3), row(8, 1.0, 1.0, "")])
    assert t["steps"] == 2 and t["agree"] == 0.5 and t["series"] == {"s": 0.5}


def test_script_reports_the_sharded_dp_family_with_a_trend(tmp_path):
    out, md = tmp_path / "out.json", tmp_path / "v.md"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_modern.py"), "--only",
                          "mpt-h100-13b-,yafsdp-fsdp1-l2-7b-s2048,megsc21-zero3-174.6b-384", "--json", str(out),
                          "--markdown", str(md)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 10 and all(r["families"] == ["sharded-dp"] for r in data["rows"])
    fam = data["summary"]["families"]["sharded-dp"]
    assert fam["rows"] == 10 and fam["median_abs_error"] >= 0
    assert fam["trend"]["steps"] == 6 and 0 <= fam["trend"]["agree"] <= 1  # mpt-h100-13b series: 3 + 2 steps; yafsdp: 1
    assert "sharded-dp" in run.stdout and "trend agrees in" in run.stdout
    assert "trend (per-GPU throughput)" in md.read_text()


def test_precision_pairs_compare_the_fp8_gain_published_and_predicted():
    row = dict(status="ok", families=["moe"], breakdown={"compute": 0.8, "comm.ep": 0.2},
               kernels={"gemm.fp8": 0.6, "gemm.bf16": 0.05}, kernel_tflops={"gemm.fp8": 900.0})
    rows = [dict(row, name="x-h100-m-bf16-8", measured_s=12.0, predicted_s=10.0, error=-1 / 6),
            dict(row, name="x-h100-m-fp8-8", measured_s=10.0, predicted_s=8.0, error=-0.2),
            dict(row, name="y-h100-m-fp8-8", measured_s=10.0, predicted_s=8.0, error=-0.2)]
    lines = modern.precision_pairs(rows)
    assert lines[-1] == "| x-h100-m-bf16-8 | 1.200 | 1.250 | 1.042 |" and len(lines) == 6
    table = "\n".join(modern.moe_parts(rows))
    assert "| x-h100-m-fp8-8 | -20.0% | 80% | 0% | 20% | 0% | 0% | fp8 60% | 900 |" in table
