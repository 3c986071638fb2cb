"""scripts/validate_modern.py and simexec.validation.modern: the one rule mapping a published modern run
to a simexec model, cluster, stack and plan; the unit conversion; refused rows; and one small row end to end."""
import subprocess
import sys
import json
from pathlib import Path

import pytest

from simexec.specs.cluster import get_cluster
from simexec.specs.model_presets import MODELS
from simexec.validation import modern

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows():
    return {r["name"]: r for r in modern.read_rows()}


def test_megatron_core_row_maps_to_the_distributed_optimizer_and_tp_overlap(rows):
    r = rows["mb2511-h100-llama3-70b-fp8cs-64"]
    m = modern.map_row(r)
    assert m.plan == ("tp=4,sp=1,pp=8,vpp=5,zero=1,gbs=128,dtype=fp8,tp_overlap=1,tp_async=1,fp8_param_gather=1,"
                      "grad_fp32=1,"
                      "param_overlap=1")
    assert m.model is MODELS["llama3-70b"] and m.cluster.name == "8xdgx-h100" and m.cluster.world_size == 64
    assert m.stack.name == "megatron-core" and m.stack.fp8.scaling == "current"  # the row's FP8-CS recipe
    assert set(modern.families(r)) == {"fp8", "tp", "pp", "h100"}


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
    assert m.plan == "pp=8,vpp=3,ep=32,zero=1,gbs=8192,grad_fp32=1,param_overlap=1,stages=3," + "4," * 22 + "3"
    assert m.cluster.nodes == 64 and m.cluster.world_size == 256 and m.cluster.node.nvlink_domain_gpus == 72
    assert m.model.head_dim == 128 and m.model.qk_norm and m.model.moe.experts == 128 and m.model.moe.top_k == 8
    assert m.model.moe.expert_ffn == 1536 and m.model.moe.capacity_factor is None and not m.model.tied_embeddings


def test_megatron_fsdp_and_block_recompute(rows):
    m = modern.map_row(rows["mb2511-h100-llama3-8b-fp8cs-fsdp-8"])
    assert m.plan == "zero=3,gbs=128,recompute=full,recompute_layers=5,dtype=fp8,fp8_param_gather=1,grad_fp32=1"
    assert modern.recompute_fields("selective:mla_up_proj") == {"recompute": "selective"}


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
    grok = modern.predict_row(rows["dgxc25051-h100-grok1-bf16-512"])
    assert grok["status"] == "refused" and "expert tp 1 != tp 4" in grok["reason"] and grok["error"] is None
    paper = modern.predict_row(rows["llama3paper-h100-405b-8k-gpus"])
    assert paper["status"] == "not comparable"
    ok = {"status": "ok", "error": 0.1, "families": ["h100"]}
    s = modern.summary([grok, paper, ok])
    assert s["rows"] == 1 and s["refused"] == 1 and s["not_comparable"] == 1 and s["median_error"] == 0.1


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
