"""The published modern training runs (simexec/validation/data/modern_runs.csv) parse, and every row
is a configuration a simulator can lay out: known device, a parallel layout that divides the GPUs, a
global batch made of whole micro-batches, a model shape and a positive measurement."""
import pytest

from simexec.specs.model_presets import MODELS
from simexec.validation.published import DATA, read_published_csv

CSV = DATA / "modern_runs.csv"
COLUMNS = ("name,source,device,gpus,stack,model,layers,hidden,ffn,heads,kv_heads,vocab,seq_len,moe_experts,moe_top_k,"
           "moe_ffn,moe_shared,dtype,fp8_recipe,tp,sp,pp,vpp,cp,ep,etp,fsdp,mbs,gbs,recompute,offload_layers,cuda_graphs,tp_overlap,metric,"
           "value,peak_mem_gib,moe_dispatcher,moe_a2a_overlap,moe_capacity,superseded_by,layout,series,notes").split(",")
REQUIRED = ("name", "source", "device", "gpus", "stack", "model", "layers", "hidden", "ffn", "heads", "kv_heads",
            "vocab", "seq_len", "dtype", "tp", "sp", "pp", "cp", "fsdp", "mbs", "gbs", "recompute", "metric", "value")
DEVICES = {"h100", "h200", "b200", "gb200", "mi300x", "a100"}
STACKS = {"megatron-core", "nemo", "torchtitan", "torchtitan-compile", "deepspeed", "other"}
METRICS = {"step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"}
FP8_RECIPES = {"delayed", "current", "mxfp8", "blockwise", "rowwise", "tensorwise"}


@pytest.fixture(scope="module")
def rows():
    return read_published_csv(CSV)


def test_header_names_the_sources_and_the_columns(rows):
    lines = CSV.read_text().splitlines()
    assert lines[0].startswith("#") and any(line.startswith("# Rules") for line in lines)
    assert list(rows[0]) == COLUMNS


def test_rows_have_the_required_fields_and_unique_names(rows):
    assert len(rows) >= 40
    for r in rows:
        missing = [c for c in REQUIRED if not r[c].strip()]
        assert not missing, (r["name"], missing)
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names))
    sources = {r["source"].split(":")[0] for r in rows}
    header = CSV.read_text()
    assert all(f"# {key}:" in header for key in sources), sources


def test_categorical_fields_take_known_values(rows):
    for r in rows:
        assert r["device"] in DEVICES, r["name"]
        assert r["stack"] in STACKS, r["name"]
        assert r["metric"] in METRICS, r["name"]
        assert r["dtype"] in {"bf16", "fp8"}, r["name"]
        assert (r["fp8_recipe"] in FP8_RECIPES) if r["dtype"] == "fp8" else not r["fp8_recipe"], r["name"]
        assert r["sp"] in {"0", "1"} and r["fsdp"] in {"0", "1"} and r["cuda_graphs"] in {"", "0", "1"}, r["name"]
        if r["model"] in MODELS:  # a preset name means exactly that model's shape
            m = MODELS[r["model"]]
            assert (int(r["layers"]), int(r["hidden"]), int(r["heads"]), int(r["kv_heads"]), int(r["vocab"])) == (
                m.layers, m.hidden, m.heads, m.kv_heads, m.vocab), r["name"]


def test_layout_divides_the_gpus_and_the_batch(rows):
    for r in rows:
        gpus, tp, pp, cp, mbs, gbs = (int(r[c]) for c in ("gpus", "tp", "pp", "cp", "mbs", "gbs"))
        assert gpus % (tp * pp * cp) == 0, r["name"]
        dp = gpus // (tp * pp * cp)
        assert gbs % mbs == 0 and gbs % (dp * mbs) == 0, r["name"]
        if r["vpp"]:  # empty where the source says interleaved without the count
            assert int(r["vpp"]) >= 1, r["name"]
        if r["sp"] == "1":
            assert tp > 1, r["name"]


def test_moe_rows_are_complete_and_dense_rows_empty(rows):
    moe_cols = ("moe_experts", "moe_top_k", "moe_ffn", "moe_shared", "ep", "etp")
    for r in rows:
        if r["moe_experts"]:
            assert all(r[c] for c in moe_cols), r["name"]
            assert int(r["moe_top_k"]) <= int(r["moe_experts"]), r["name"]
            dp = int(r["gpus"]) // (int(r["tp"]) * int(r["pp"]) * int(r["cp"]))
            assert (dp * int(r["tp"]) * int(r["cp"])) % (int(r["ep"]) * int(r["etp"])) == 0, r["name"]
            assert r["moe_dispatcher"] in {"alltoall", "allgather", "deepep", "hybridep"}, r["name"]
            assert r["moe_a2a_overlap"] in {"0", "1"}, r["name"]
        else:
            assert not any(r[c] for c in moe_cols + ("moe_dispatcher", "moe_a2a_overlap")), r["name"]


def test_a_superseded_row_names_a_newer_row_of_its_workload(rows):
    by_name = {r["name"]: r for r in rows}
    superseded = [r for r in rows if r["superseded_by"]]
    assert superseded
    for r in superseded:
        newer = by_name[r["superseded_by"]]
        assert not newer["superseded_by"], r["name"]
        assert (newer["device"], newer["model"], newer["dtype"], newer["fp8_recipe"]) == (
            r["device"], r["model"], r["dtype"], r["fp8_recipe"]), r["name"]
        assert newer["source"].split(":")[0] != r["source"].split(":")[0], r["name"]


def test_values_are_positive(rows):
    for r in rows:
        assert float(r["value"]) > 0, r["name"]
        if r["peak_mem_gib"]:
            assert float(r["peak_mem_gib"]) > 0, r["name"]
        if r["metric"] == "mfu":
            assert float(r["value"]) <= 1, r["name"]
