"""Property tests: random plans, plan strings, plan files and cluster files thrown at the validator.

It either accepts, and then the derived facts hold, or raises the project's own SimexecError:
never a TypeError, ZeroDivisionError, pydantic ValidationError or anything else.
"""
import atexit
import itertools
import json
import shutil
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from simexec.specs.cluster import PRESETS, ClusterSpec, get_cluster, load_cluster_file
from simexec.errors import SimexecError
from simexec.specs.model_presets import MODELS
from simexec.specs.plan import Plan, ResolvedPlan, load_plan, parse_plan, resolve

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TMP = Path(tempfile.mkdtemp(prefix="simexec-props-"))  # hypothesis and function-scoped tmp_path do not mix
atexit.register(shutil.rmtree, TMP, ignore_errors=True)

CLUSTERS = ["local", "dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "hgx-h200", "2xdgx-h100", "4xdgx-a100-80g",
            "16xhgx-h200"]
ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))]


def plan_fields(small: bool):
    """Degrees from small sets, random flags, sometimes random stages."""
    deg = st.sampled_from([1, 2, 4] if small else [1, 2, 3, 4, 8, 16])
    return st.fixed_dictionaries(
        {},
        optional={
            "dp": st.sampled_from([1, 2, 3, 4, 8] if not small else [1, 2, 4]),
            "tp": deg, "cp": st.sampled_from([1, 2]), "pp": deg, "vpp": st.sampled_from([1, 2, 3]),
            "ep": st.sampled_from([1, 2, 4, 8]), "sp": st.booleans(), "cp_impl": st.sampled_from(["allgather", "ring"]),
            "zero": st.integers(0, 3), "zero_impl": st.sampled_from(["fsdp", "yafsdp", "deepspeed"]),
            "dp_shard": st.sampled_from([1, 2, 3, 4]),
            "offload": st.sampled_from(["none", "optimizer", "optimizer+params"]),
            "mbs": st.sampled_from([1, 2, 3]), "gbs": st.integers(1, 128),
            "schedule": st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
            "recompute": st.sampled_from(["none", "selective", "full"]), "recompute_layers": st.integers(0, 5),
            "dtype": st.sampled_from(["bf16", "fp16", "fp32", "fp8"]), "flash_attention": st.booleans(),
            "bucket_mb": st.floats(0.5, 200), "grad_bucket_view": st.booleans(), "rank_order": st.sampled_from(ORDERS),
            "stages": st.lists(st.integers(-1, 40), min_size=1, max_size=8).map(tuple),
        },
    )


def check_resolved(rp: ResolvedPlan) -> None:
    p, m = rp.plan, rp.model
    assert rp.dp * p.tp * p.cp * p.pp == rp.world == rp.cluster.world_size == rp.mesh.world
    assert p.dp == rp.dp and p.gbs is not None
    assert rp.micro_batches >= 1 and rp.micro_batches * p.mbs * rp.dp == p.gbs
    # stages cover every layer exactly once, in order
    assert len(rp.stage_layers) == p.pp * p.vpp and all(rp.stage_layers)
    assert [l for s in rp.stage_layers for l in s] == list(range(m.layers))
    assert sorted(l for r in range(p.pp) for l in rp.layers_of_pp_rank(r)) == list(range(m.layers))
    for r in range(p.pp):
        states = rp.model_state_bytes(r)
        assert all(v >= 0 for v in states.values())
    assert m.params <= sum(rp.params_on_pp_rank(r)["total"] for r in range(p.pp)) * p.tp * p.ep + 1
    assert parse_plan(p.to_string()) == p


def resolve_or_own_error(model: str, cluster: str, fields: dict, seq_len):
    plan = Plan(**fields)
    try:
        rp = resolve(MODELS[model], get_cluster(cluster), plan, seq_len=seq_len)
    except SimexecError as exc:
        assert str(exc) and "\n" not in str(exc)
        event("refused")
        return
    event("accepted")
    check_resolved(rp)


@FAST
@given(
    model=st.sampled_from(sorted(MODELS)),
    cluster=st.sampled_from(CLUSTERS),
    fields=plan_fields(small=False),
    seq_len=st.sampled_from([None, None, 0, 1, 63, 64, 128, 2048, 4096, 4098]),
)
def test_random_plans_on_presets(model, cluster, fields, seq_len):
    resolve_or_own_error(model, cluster, fields, seq_len)


@FAST
@given(
    model=st.sampled_from(["gpt-tiny", "moe-tiny"]),
    fields=plan_fields(small=True),
    seq_len=st.sampled_from([None, 32, 64, 96]),
)
def test_random_plans_on_local_tiny_models(model, fields, seq_len):
    """The tiny models on `local` accept often: this exercises the derived facts."""
    resolve_or_own_error(model, "local", fields, seq_len)


# --- parse_plan ------------------------------------------------------------------------------------

KEYS = list(Plan.model_fields) + ["stages", "dq", "", "sp", "dp"]
VALUES = st.one_of(
    st.integers(-3, 200).map(str),
    st.sampled_from(["1", "0", "true", "false", "yes", "inf", "nan", "1.5", "1e3", "fsdp", "ring", "bf16", "fp8",
                     "tp-cp-dp-pp", "none", "full", "gpipe", "interleaved-1f1b", "optimizer+params", " ", "=", "٣"]),
    st.text(max_size=6),
)


@FAST
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=8), st.lists(st.integers(-2, 40), max_size=4))
def test_parse_plan_from_key_value_pieces(pairs, extra):
    text = ",".join(f"{k}={v}" for k, v in pairs) + "".join(f",{x}" for x in extra)
    try:
        p = parse_plan(text)
    except SimexecError:
        return
    assert parse_plan(p.to_string()) == p


@FAST
@given(st.text(alphabet=st.sampled_from(list("dptscpzerogbm=,0123456789-_. :\n\t")) | st.characters(), max_size=40))
def test_parse_plan_random_text(text):
    try:
        p = parse_plan(text)
    except SimexecError:
        return
    assert parse_plan(p.to_string()) == p


# --- files -----------------------------------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**15), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["dgx-h100", "fat-tree", "bf16", "1e12", "4xdgx-h100"]))
JSONISH = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                       max_leaves=12)


def _mutate(data: dict, draw_path, value):
    """Replace, delete or add one (possibly nested) key of a preset dump."""
    d = data
    for key in draw_path[:-1]:
        if not isinstance(d.get(key), dict):
            break
        d = d[key]
    last = draw_path[-1]
    if value is _DELETE:
        d.pop(last, None)
    else:
        d[last] = value
    return data


_DELETE = object()
SECTION_KEYS = sorted({k for c in PRESETS.values() for k in c.model_dump()}
                      | {f"{s}.{k}" for c in PRESETS.values() for s, v in c.model_dump().items() if isinstance(v, dict)
                         for k in v} | {"base", "bogus", "device.bogus"})


@st.composite
def cluster_dicts(draw):
    kind = draw(st.sampled_from(["random", "mutated-full", "mutated-base"]))
    if kind == "random":
        keys = st.text(max_size=8) | st.sampled_from(SECTION_KEYS) | st.integers(0, 3)
        return draw(st.dictionaries(keys, JSONISH, max_size=6))
    if kind == "mutated-full":
        data = PRESETS[draw(st.sampled_from(sorted(PRESETS)))].model_dump()
    else:
        data = {"base": draw(st.sampled_from(sorted(PRESETS) + ["2xdgx-h100", "3xlocal", "nope"]))}
    for _ in range(draw(st.integers(0, 3))):
        path = draw(st.sampled_from(SECTION_KEYS)).split(".")
        value = draw(st.just(_DELETE) | JSONISH | st.integers(0, 64) | st.floats(0, 1e15))
        data = _mutate(data, path, value)
    return data


@FAST
@given(data=cluster_dicts(), fmt=st.sampled_from(["json", "yaml"]))
def test_random_cluster_files(data, fmt):
    path = TMP / f"cluster.{fmt}"
    try:
        text = json.dumps(data) if fmt == "json" else yaml.safe_dump(data)
    except (ValueError, yaml.YAMLError):
        return
    path.write_text(text)
    try:
        c = load_cluster_file(path)
    except SimexecError as exc:
        assert str(exc) and "\n" not in str(exc)
        event("refused")
        return
    event("accepted")
    assert isinstance(c, ClusterSpec) and c.nodes >= 1
    # an accepted cluster is usable: resolve a tiny plan on it (or refuse it with our error)
    try:
        resolve(MODELS["gpt-tiny"], c, parse_plan("tp=1"))
    except SimexecError:
        pass


@FAST
@given(text=st.text(max_size=60), fmt=st.sampled_from(["json", "yaml", "yml"]))
def test_random_text_as_cluster_or_plan_file(text, fmt):
    path = TMP / f"text.{fmt}"
    path.write_text(text)
    for load in (lambda: load_cluster_file(path), lambda: load_plan(str(path))):
        try:
            load()
        except SimexecError as exc:
            assert "\n" not in str(exc)


@FAST
@given(
    data=st.dictionaries(st.sampled_from(list(Plan.model_fields) + ["bogus"]) | st.integers(0, 3),
                         JSONISH | st.integers(0, 8), max_size=6),
    fmt=st.sampled_from(["json", "yaml"]),
)
def test_random_plan_files(data, fmt):
    path = TMP / f"plan.{fmt}"
    try:
        path.write_text(json.dumps(data) if fmt == "json" else yaml.safe_dump(data))
    except (ValueError, yaml.YAMLError):
        return
    try:
        p = load_plan(str(path))
    except SimexecError as exc:
        assert "\n" not in str(exc)
        return
    assert parse_plan(p.to_string()) == p
