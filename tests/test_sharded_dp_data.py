"""The published sharded-data-parallel runs (simexec/validation/data/sharded_dp_runs.csv) parse, and every row is
a configuration a simulator can lay out: a known device and stack, a source declared in the header, a global
batch made of whole micro-batches on every data-parallel rank, a positive measurement, and series whose rows
differ only in their GPU count and batch."""
import re
from collections import defaultdict

import pytest

from simexec.specs.model_presets import MODELS
from simexec.validation.published import DATA, read_published_csv

CSV = DATA / "sharded_dp_runs.csv"
COLUMNS = ("name,source,device,gpus,gpus_per_node,network,stack,model,layers,hidden,ffn,heads,kv_heads,vocab,seq_len,"
           "dtype,tp,pp,zero,shard_group,mbs,gbs,recompute,metric,value,flop_count,series,scaling,notes").split(",")
REQUIRED = ("name", "source", "device", "gpus", "gpus_per_node", "network", "stack", "model", "layers", "hidden", "ffn",
            "heads", "kv_heads", "vocab", "seq_len", "dtype", "tp", "pp", "zero", "shard_group", "mbs", "gbs",
            "recompute", "metric", "value")
DEVICES = {"a100-40gb", "a100-80gb", "v100-32gb", "h100", "h100-hbm2e-500w"}
STACKS = {"deepspeed-zero3", "fsdp1", "fsdp2", "fsdp2-compile", "yafsdp", "hsdp", "zero++", "mics"}
METRICS = {"step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "samples_per_s"}
RECOMPUTE = re.compile(r"^(none|full|full:block \d+ layers|selective:(op|layer))$")
NETWORK = re.compile(r"^(unstated|\d+x\d+:(infiniband|roce|efa|rdma))$")


@pytest.fixture(scope="module")
def rows():
    return read_published_csv(CSV)


def test_header_declares_sources_flop_counts_and_rules(rows):
    text = CSV.read_text()
    lines = text.splitlines()
    assert lines[0].startswith("#") and any(line.startswith("# Rules") for line in lines)
    assert list(rows[0]) == COLUMNS
    for key in {r["source"].split(":")[0] for r in rows}:
        assert f"# {key}:" in text, key
    for count in {r["flop_count"] for r in rows if r["flop_count"]}:
        assert f"# - {count}:" in text, count


def test_rows_are_complete_unique_and_known(rows):
    assert len(rows) >= 25
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names))
    for r in rows:
        missing = [c for c in REQUIRED if not r[c].strip()]
        assert not missing, (r["name"], missing)
        assert r["device"] in DEVICES and r["stack"] in STACKS and r["metric"] in METRICS, r["name"]
        assert r["dtype"] in {"bf16", "fp16"}, r["name"]
        assert RECOMPUTE.match(r["recompute"]) and NETWORK.match(r["network"]), r["name"]
        assert float(r["value"]) > 0, r["name"]
        if r["metric"] in ("tflops_per_gpu", "mfu"):  # a FLOP rate means nothing without the source's FLOP count
            assert r["flop_count"], r["name"]
        if r["metric"] == "mfu":
            assert float(r["value"]) <= 1, r["name"]


def test_model_shapes_are_consistent(rows):
    for r in rows:
        layers, hidden, ffn, heads, kv = (int(r[c]) for c in ("layers", "hidden", "ffn", "heads", "kv_heads"))
        assert hidden % heads == 0 and heads % kv == 0 and ffn > hidden, r["name"]
        if r["model"] in MODELS:  # a preset name means exactly that model's shape
            m = MODELS[r["model"]]
            assert (layers, hidden, heads, kv, int(r["vocab"])) == (m.layers, m.hidden, m.heads, m.kv_heads, m.vocab), r[
                "name"]
        block = re.match(r"full:block (\d+) layers", r["recompute"])
        if block:
            assert 0 < int(block.group(1)) <= layers, r["name"]


def test_pure_sharded_data_parallel_layout_divides_the_batch(rows):
    for r in rows:
        gpus, per_node, tp, pp, mbs, gbs, group = (int(r[c]) for c in (
            "gpus", "gpus_per_node", "tp", "pp", "mbs", "gbs", "shard_group"))
        assert tp == pp == 1, r["name"]
        assert gpus % per_node == 0 or gpus < per_node, r["name"]
        dp = gpus
        assert gbs % (dp * mbs) == 0, r["name"]
        assert int(r["zero"]) in (1, 2, 3), r["name"]
        assert gpus % group == 0, r["name"]  # an HSDP row shards within groups and replicates across them


def test_series_vary_only_in_scale(rows):
    series = defaultdict(list)
    for r in rows:
        assert bool(r["series"]) == bool(r["scaling"]), r["name"]
        if r["series"]:
            series[r["series"]].append(r)
    assert len(series) >= 5
    fixed = [c for c in COLUMNS if c not in ("name", "gpus", "shard_group", "mbs", "gbs", "value", "notes", "source")]
    for key, members in series.items():
        assert len({m["gpus"] for m in members}) == len(members) >= 2, key
        for c in fixed:
            assert len({m[c] for m in members}) == 1, (key, c)
        gbs = {m["gbs"] for m in members}
        scaling = members[0]["scaling"]
        if scaling == "strong":
            assert len(gbs) == 1, key
        elif scaling == "weak":
            assert len({m["mbs"] for m in members}) == 1 and len(
                {int(m["gbs"]) // int(m["gpus"]) for m in members}) == 1, key
        else:
            assert scaling == "mixed", key
    assert any(m[0]["scaling"] == "strong" for m in series.values())
