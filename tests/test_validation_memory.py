"""scripts/validate_memory.py and simexec.validation.memory: what each published peak measured, the rows
mapped by validate_modern's rule, and a small row end to end."""
import subprocess
import sys
import json
from pathlib import Path

import pytest

from simexec.errors import SpecError
from simexec.validation import memory, modern

ROOT = Path(__file__).resolve().parents[1]


def _row(**over):
    base = {r["name"]: r for r in modern.read_rows()}["tt2412-h100-llama31-8b-fsdp-compile-8"]
    return {**base, **over}


def test_each_peak_says_what_it_measured():
    assert memory.measured_kind(_row()) == "reserved"  # torchtitan logs max_memory_reserved
    assert memory.measured_kind(_row(stack="megatron-core", notes="allocated; per rank")) == "allocated"
    with pytest.raises(SpecError, match="notes must open with one of allocated"):
        memory.measured_kind(_row(stack="megatron-core", notes="peak 70 GB"))


def test_rows_with_a_published_peak_and_an_allocated_one_compares_tensors_only():
    rows = memory.memory_rows_from_files()
    assert rows and all(float(r["peak_mem_gib"]) > 0 for r in rows)
    reserved = memory.predict_memory(_row())
    allocated = memory.predict_memory(_row(stack="torchtitan-compile", notes="allocated; test"))
    assert reserved["status"] == allocated["status"] == "ok" and reserved["fits"]
    assert allocated["predicted_gib"] < reserved["predicted_gib"]
    assert reserved["error"] == pytest.approx(reserved["predicted_gib"] / reserved["measured_gib"] - 1)


def test_script_writes_json_for_one_row(tmp_path):
    out = tmp_path / "m.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "validate_memory.py"), "--only",
                          "tt2412-h100-llama31-8b-fsdp-compile-8", "--json", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == ["tt2412-h100-llama31-8b-fsdp-compile-8"]
    assert data["summary"]["rows"] == 1 and data["summary"]["wrong_verdicts"] == []


def test_torchtitan_of_summer_2025_recomputes_cudnn_attention_on_b200():
    """tao-train's B200 table ran torchtitan 6fc499f6f: cuDNN attention first on sm100, not in the per-op
    _save_list (simexec.validation.modern.SM100_CUDNN_SOURCES); its MI300X table, the same era on ROCm, ran
    flash, which the list saves."""
    rows = {r["name"]: r for r in memory.memory_rows_from_files()}
    b200, mi300x = (modern.map_row(rows[f"tao-{d}-llama3-8b-bf16-8"]) for d in ("b200", "mi300x"))
    assert b200.stack.attention_kernel_on(b200.cluster.device) == "cudnn"
    assert "cudnn" not in b200.stack.op_sac_saved_attention
    assert mi300x.stack.attention_kernel_on(mi300x.cluster.device) in mi300x.stack.op_sac_saved_attention
    tt2412 = modern.map_row(_row())  # December 2024: flash on H100, saved
    assert tt2412.stack.attention_kernel_on(tt2412.cluster.device) == "fa2" and tt2412.stack.cudnn_attention_from is None


def test_megatron_bridge_perf_recipes_keep_bf16_gradients():
    """Megatron-Bridge@067f987df03b's 16-GPU Qwen3 30B recipe (and every perf recipe) sets
    grad_reduce_in_fp32 = False: a bf16 gradient buffer, 2 bytes per parameter where fp32 main gradients hold 4
    (simexec.validation.modern.BF16_GRAD_SOURCES); other Megatron-Core rows keep fp32."""
    rows = {r["name"]: r for r in memory.memory_rows_from_files()}
    qwen = rows["mbskill-h100-qwen3-30b-bf16-16"]
    assert "grad_fp32" not in modern.map_row(qwen).plan
    assert "grad_fp32=1" in modern.map_row({**qwen, "source": "mb-other:x"}).plan
    out = memory.predict_memory(qwen)
    assert out["breakdown_gib"]["grads"] == pytest.approx(out["breakdown_gib"]["params"], rel=0.01)
