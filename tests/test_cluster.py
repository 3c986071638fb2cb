"""Clusters: presets carry their datasheet numbers, NxPRESET, unknown names, YAML/JSON cluster files
(full and `base:` forms), one-line errors naming the field, and `local` sized to the plan."""
import json
from pathlib import Path

import pytest
import yaml

from simexec.specs.cluster import (
    PRESETS, ClusterSpec, CostParams, DeviceSpec, NetworkSpec, NodeSpec, get_cluster, list_clusters, load_cluster_file,
)
from simexec.errors import SpecError
from simexec.specs.model_presets import MODELS
from simexec.specs.plan import parse_plan, resolve

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
TERA = 1e12


# --- presets ---------------------------------------------------------------------------------------


def test_presets_exist():
    assert {"dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "hgx-h200", "local"} <= set(PRESETS)
    assert [c.name for c in list_clusters()] == list(PRESETS)
    assert all(c.source for c in PRESETS.values())  # every preset cites where its numbers come from


@pytest.mark.parametrize("name", ["dgx-a100-40g", "dgx-a100-80g"])
def test_a100_datasheet(name):
    d = PRESETS[name].device
    assert d.peak_flops["bf16"] == 312 * TERA and d.peak_flops["fp16"] == 312 * TERA
    assert d.peak_flops["fp32"] == 19.5 * TERA
    assert not d.supports("fp8")
    assert PRESETS[name].node.gpus_per_node == 8


def test_a100_memory():
    """As PyTorch reports the A100s' capacity ("79.25 GiB total capacity", "39.59 GiB")."""
    assert PRESETS["dgx-a100-40g"].device.memory_bytes == 39.59 * 2**30
    assert PRESETS["dgx-a100-80g"].device.memory_bytes == 79.25 * 2**30


def test_h100_datasheet():
    d = PRESETS["dgx-h100"].device
    assert d.peak_flops["bf16"] == 989 * TERA and d.peak_flops["fp8"] == 1979 * TERA
    assert d.memory_bw == 3.35 * TERA
    assert PRESETS["dgx-h100"].node.intra_bw == 450e9


def test_h200_datasheet():
    d = PRESETS["hgx-h200"].device
    assert d.memory_bw == 4.8 * TERA
    assert d.peak_flops["bf16"] == 989 * TERA and d.supports("fp8")


def test_n_nodes_of_a_preset():
    c = get_cluster("4xdgx-h100")
    assert c.world_size == 32 and c.nodes == 4 and c.name == "4xdgx-h100"
    assert c.device == PRESETS["dgx-h100"].device
    assert c.node_of(8) == 1 and c.node_of(31) == 3


def test_unknown_cluster_suggests_a_preset():
    with pytest.raises(SpecError) as exc:
        get_cluster("dgx-h10")
    msg = str(exc.value)
    assert "unknown cluster 'dgx-h10'" in msg and "did you mean" in msg and "dgx-h100" in msg


def test_unknown_cluster_without_a_close_name_lists_presets():
    with pytest.raises(SpecError, match="presets: dgx-a100-40g"):
        get_cluster("zzzz")


def test_zero_nodes_refused():
    with pytest.raises(SpecError, match="node count must be at least 1"):
        get_cluster("0xdgx-h100")


def test_local_takes_no_node_count():
    with pytest.raises(SpecError, match="one host"):
        get_cluster("2xlocal")


def test_local_is_sized_to_the_plan():
    local = get_cluster("local")
    assert local.sized_to_plan and local.world_size == 0
    rp = resolve(MODELS["gpt-tiny"], local, parse_plan("dp=2,tp=2,pp=2"))
    assert rp.world == 8 and rp.cluster.world_size == 8 and rp.cluster.node.gpus_per_node == 8
    assert resolve(MODELS["gpt-tiny"], local, parse_plan("tp=4")).world == 4  # dp left out: 1


# --- cluster files ---------------------------------------------------------------------------------


def write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data)
    elif name.endswith(".json"):
        path.write_text(json.dumps(data))
    else:
        path.write_text(yaml.safe_dump(data))
    return str(path)


def test_yaml_file_with_base_and_overrides(tmp_path):
    path = write(tmp_path, "mine.yaml", "base: dgx-h100\nnodes: 4\nnetwork:\n  nics_per_node: 4\n  pod_nodes: 2\n"
                 "  oversubscription: 2.0\ndevice:\n  memory_bytes: 1.0e+11\n")
    c = get_cluster(path)
    base = PRESETS["dgx-h100"]
    assert c.name == "mine" and c.nodes == 4 and c.world_size == 32
    assert c.network.nics_per_node == 4 and c.network.pod_nodes == 2 and c.network.oversubscription == 2.0
    assert c.network.nic_bw == base.network.nic_bw  # untouched fields keep the preset's value
    assert c.device.memory_bytes == 1e11 and c.device.peak_flops == base.device.peak_flops
    assert c.costs == base.costs and c.node == base.node


def test_base_may_be_n_nodes_of_a_preset(tmp_path):
    c = get_cluster(write(tmp_path, "b.yaml", {"base": "2xdgx-a100-80g", "name": "two"}))
    assert c.world_size == 16 and c.name == "two"


def test_full_json_file(tmp_path):
    data = PRESETS["hgx-h200"].model_dump()
    data.update(name="my-h200", nodes=2)
    c = get_cluster(write(tmp_path, "full.json", data))
    assert c.name == "my-h200" and c.world_size == 16
    assert c.device == PRESETS["hgx-h200"].device and c.costs == PRESETS["hgx-h200"].costs


def test_full_file_name_defaults_to_file_name(tmp_path):
    data = PRESETS["dgx-h100"].model_dump()
    del data["name"]
    assert load_cluster_file(Path(write(tmp_path, "rack7.json", data))).name == "rack7"


def _full(**changes):
    data = PRESETS["dgx-h100"].model_dump()
    for dotted, val in changes.items():
        *path, last = dotted.split("__")
        d = data
        for p in path:
            d = d[p]
        if val is KeyError:
            del d[last]
        else:
            d[last] = val
    return data


@pytest.mark.parametrize("name,data,fragment", [
    ("bad.yaml", "nodes: [4\n", "not valid YAML"),
    ("bad.json", '{"nodes": 4,}', "not valid JSON"),
    ("list.yaml", "- dgx-h100\n", "must hold a mapping"),
    ("type.yaml", _full(nodes="many"), "nodes"),
    ("type2.json", _full(network__nic_bw="fast"), "network.nic_bw"),
    ("type3.yaml", _full(device__peak_flops=[312e12]), "device.peak_flops"),
    ("unknown.yaml", _full(device__hbm=1), "device.hbm"),
    ("unknown2.json", _full(colour="blue"), "colour"),
    ("missing.yaml", _full(costs=KeyError), "costs"),
    ("missing2.json", _full(node__gpus_per_node=KeyError), "node.gpus_per_node"),
    ("range.yaml", _full(costs__gemm_eff=1.5), "costs.gemm_eff"),
    ("range2.yaml", _full(nodes=0), "nodes"),
    ("inf.yaml", _full(network__nic_bw=float("inf")), "network.nic_bw"),
    ("peak.yaml", _full(device__peak_flops={"bf16": 0.0}), "device.peak_flops"),
    ("nonet.yaml", _full(nodes=2, network__nics_per_node=0), "nics_per_node"),
    ("topo.yaml", _full(network__topology="torus"), "network.topology"),
    ("base.yaml", {"base": "dgx-h200"}, "base"),
    ("base2.yaml", {"base": ["dgx-h100"]}, "base"),
    ("base3.yaml", "base: dgx-h100\nnode:\n  gpus_per_node: eight\n", "node.gpus_per_node"),
])
def test_malformed_cluster_file_is_one_line_naming_the_field(tmp_path, name, data, fragment):
    path = write(tmp_path, name, data)
    with pytest.raises(SpecError) as exc:
        get_cluster(path)
    msg = str(exc.value)
    assert fragment in msg, msg
    assert path in msg and "\n" not in msg


def test_missing_cluster_file():
    with pytest.raises(SpecError, match="not found"):
        get_cluster("/nonexistent/cluster.yaml")


def test_binary_cluster_file(tmp_path):
    path = tmp_path / "blob.yaml"
    path.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(SpecError, match="blob.yaml"):
        get_cluster(str(path))


# --- the documented examples -----------------------------------------------------------------------


def test_example_cluster_file():
    c = get_cluster(str(EXAMPLES / "cluster.yaml"))
    assert c.nodes == 4 and c.world_size == 32
    assert c.network.nics_per_node == 4 and c.network.pod_nodes == 2 and c.network.oversubscription == 2.0
    assert c.device.peak_flops["bf16"] == 989 * TERA and c.device.supports("fp8")


def test_example_files_are_real_numbers():
    """YAML 1.1 reads 989e12 as a string: the examples write numbers that are numbers to any YAML reader."""
    def leaves(d):
        for v in d.values():
            yield from leaves(v) if isinstance(v, dict) else [v]
    raw = yaml.safe_load((EXAMPLES / "cluster.yaml").read_text())
    for section in ("device", "node", "network", "costs"):
        assert not any(isinstance(v, str) and v[:1].isdigit() for v in leaves(raw[section])), section


def test_example_base_form_equals_the_full_example():
    full = get_cluster(str(EXAMPLES / "cluster.yaml"))
    short = get_cluster(str(EXAMPLES / "cluster-base.yaml"))
    assert short.model_dump(exclude={"name", "source"}) == full.model_dump(exclude={"name", "source"})


def test_cluster_doc_names_every_field():
    text = (ROOT / "docs" / "cluster.md").read_text()
    for spec in (ClusterSpec, DeviceSpec, NodeSpec, NetworkSpec, CostParams):
        missing = [f for f in spec.model_fields if f"`{f}`" not in text]
        assert not missing, f"docs/cluster.md does not describe {spec.__name__} fields {missing}"


def test_device_memory_is_what_cuda_gives_a_process():
    """The presets' capacity is the device's memory as CUDA reports it to a process, a little under the
    HBM's nominal 80 GiB / 141 GiB; the Hopper ones as measured on one H100 and one H200
    (traces/gpu/device_memory.json, scripts/device_memory.py)."""
    rows = {r["gpu"]: r for r in json.loads((Path(__file__).resolve().parent.parent
                                             / "traces/gpu/device_memory.json").read_text())["rows"]}
    assert PRESETS["dgx-h100"].device.memory_bytes == rows["NVIDIA H100 80GB HBM3"]["total_memory_bytes"]
    assert PRESETS["hgx-h200"].device.memory_bytes == rows["NVIDIA H200"]["total_memory_bytes"]
    for name, nominal in (("dgx-a100-40g", 40), ("dgx-a100-80g", 80), ("dgx-h100", 80), ("hgx-h200", 141)):
        assert 0.98 * nominal * 2**30 < PRESETS[name].device.memory_bytes < nominal * 2**30, name
    for r in rows.values():  # the runtime, cuBLAS and one NCCL communicator fit in the presets' workspace
        assert r["after_nccl_bytes"] < PRESETS["dgx-h100"].costs.workspace_bytes
